"""The figures a detection user compares, computed as Ultralytics computes them: precision, recall
and F1 at the confidence of the best mean F1 (against Ultralytics' own ap_per_class on the same
matches), up to 300 detections an image scored (COCO's 100 beside it), and evaluation NMS over every
class above the threshold."""

import numpy as np
import pytest
import torch
from coco_map import coco_map
from test_detect_pretrained import offline_ultralytics
from yolo_model import postprocess


def separated_records(seed: int, images: int = 12) -> list[dict]:
    """Images of objects in cells of their own (100 px apart), found by at most one box per object
    and class that overlaps it well, a worse duplicate of lower score on some, a wrong class on
    others, and strays in empty cells: every box overlaps one object at most, so COCO's matching
    (best score first) and Ultralytics' (best IoU first) pair the same boxes."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(images):
        cells = torch.randperm(16, generator=g)[: int(torch.randint(3, 9, (), generator=g))]
        cell_corner = torch.stack((cells % 4, cells // 4), dim=1).float() * 100
        corner = cell_corner + torch.rand(len(cells), 2, generator=g) * 20
        true_boxes = torch.cat((corner, corner + 30 + torch.rand(len(cells), 2, generator=g) * 40), dim=1)
        true_labels = torch.randint(0, 3, (len(cells),), generator=g)
        found = torch.rand(len(cells), generator=g) < 0.8  # some objects are missed
        boxes = true_boxes[found] + torch.randn(int(found.sum()), 4, generator=g) * 3
        labels = true_labels[found].clone()
        wrong = torch.rand(len(labels), generator=g) < 0.15
        labels[wrong] = (labels[wrong] + 1) % 3
        scores = torch.rand(len(labels), generator=g) * 0.8 + 0.2
        # farther off and less sure: a false positive
        duplicates = torch.rand(len(labels), generator=g) < 0.3
        boxes = torch.cat((boxes, boxes[duplicates] + torch.tensor([9.0, 9.0, -9.0, -9.0])))
        labels = torch.cat((labels, labels[duplicates]))
        scores = torch.cat((scores, scores[duplicates] * 0.5))
        strays = torch.tensor([[430.0, 10.0, 470.0, 60.0], [430.0, 210.0, 480.0, 250.0]])
        boxes = torch.cat((boxes, strays))
        labels = torch.cat((labels, torch.randint(0, 3, (2,), generator=g)))
        scores = torch.cat((scores, torch.rand(2, generator=g)))
        truth = dict(true_boxes=true_boxes, true_labels=true_labels)
        records.append(dict(boxes=boxes, scores=scores, labels=labels, **truth))
    return records


@pytest.mark.parametrize("seed", [0, 1])
def test_precision_recall_and_f1_are_ultralytics_figures(seed, tmp_path):
    offline_ultralytics(tmp_path / "settings")
    from ultralytics.models.yolo.detect import DetectionValidator
    from ultralytics.utils.metrics import ap_per_class, box_iou

    records = separated_records(seed)
    validator = DetectionValidator()  # its matching of predictions to labels, at IoU 0.5:0.95
    tp, conf, pred_cls, target_cls = [], [], [], []
    for r in records:
        iou = box_iou(r["true_boxes"], r["boxes"])
        tp.append(np.asarray(validator.match_predictions(r["labels"], r["true_labels"], iou)))
        conf.append(r["scores"].numpy())
        pred_cls.append(r["labels"].numpy())
        target_cls.append(r["true_labels"].numpy())
    _, _, p, r, f1, _, classes, *_ = ap_per_class(*map(np.concatenate, (tp, conf, pred_cls, target_cls)))

    scores, curves = coco_map(records, ["a", "b", "c"])
    names = ["a", "b", "c"]
    for k, c in enumerate(classes):
        mine = scores["eval_per_class"][names[c]]
        assert (mine["precision"], mine["recall"], mine["f1"]) == pytest.approx((p[k], r[k], f1[k]), abs=1e-9)
    # Ultralytics' "all" row: the means over the classes
    assert scores["eval_precision"] == pytest.approx(p.mean(), abs=1e-9)
    assert scores["eval_recall"] == pytest.approx(r.mean(), abs=1e-9)
    # a real comparison
    assert 0.3 < scores["eval_precision"] < 0.95 and 0.3 < scores["eval_recall"] < 0.95
    assert 0 < scores["eval_f1_confidence"] < 1
    assert curves["f1_curve"].shape == (3, 1000)
    assert curves["confidence"][curves["best"]] == scores["eval_f1_confidence"]
    counted = sum(len(r["true_labels"]) for r in records)
    assert sum(c["instances"] for c in scores["eval_per_class"].values()) == counted


def test_up_to_300_detections_an_image_are_scored_with_cocos_100_beside():
    """150 objects in one image, each found exactly: all 150 count (mAP 1), where COCO's 100 scores
    two thirds."""
    grid = torch.meshgrid(torch.arange(15.0), torch.arange(10.0), indexing="ij")
    corners = torch.stack(grid, -1).reshape(-1, 2)
    true_boxes = torch.cat((corners * 40, corners * 40 + 30), dim=1)
    labels = torch.zeros(150, dtype=torch.long)
    record = dict(
        boxes=true_boxes.clone(),
        scores=torch.linspace(0.9, 0.3, 150),
        labels=labels,
        true_boxes=true_boxes,
        true_labels=labels,
    )
    scores, _ = coco_map([record], ["crowd"])
    assert scores["eval_max_detections"] == 300
    assert scores["eval_map50_95"] == pytest.approx(1.0) and scores["eval_map50"] == pytest.approx(1.0)
    # recall stops at 100 of 150
    assert scores["eval_map50_95_at_100"] == pytest.approx(0.67, abs=0.02)
    assert scores["eval_per_class"]["crowd"]["instances"] == 150
    assert scores["eval_recall"] == pytest.approx(1.0)


def test_evaluation_nms_scores_every_class_above_the_threshold():
    """An anchor sure of two classes: prediction keeps its best class, evaluation both, each through
    its own NMS."""
    height = width = 64
    anchors = sum((height // s) * (width // s) for s in (8, 16, 32))
    box = torch.full((1, 4 * 16, anchors), -10.0)
    box[0, 2::16, :] = 10.0  # every side 2 strides out from every anchor
    cls = torch.full((1, 2, anchors), -10.0)
    cls[0, 0, 5], cls[0, 1, 5] = 3.0, 1.0  # anchor 5: class 0 at 0.95, class 1 at 0.73
    cls[0, 1, 6] = 0.0  # anchor 6, next to it: class 1 at 0.5, overlapping anchor 5's class-1 box
    flat = torch.cat((box, cls), dim=1)
    outputs, start = [], 0
    for s in (8, 16, 32):
        n = (height // s) * (width // s)
        outputs.append(flat[:, :, start : start + n].reshape(1, -1, height // s, width // s))
        start += n
    # 32 x 32 boxes 8 px apart: IoU 0.6
    one = postprocess(outputs, (8, 16, 32), 16, conf_threshold=0.25, iou_threshold=0.5)[0]
    every = postprocess(outputs, (8, 16, 32), 16, conf_threshold=0.25, iou_threshold=0.5, multi_label=True)[0]
    assert one["labels"].tolist() == [0, 1]  # anchor 5's best class, anchor 6's (its only one)
    # anchor 5's class 1 (0.73) suppresses anchor 6's (0.5)
    assert every["labels"].tolist() == [0, 1]
    assert every["scores"].tolist() == pytest.approx([0.9526, 0.7311], abs=1e-4)
    assert one["scores"].tolist() == pytest.approx([0.9526, 0.5], abs=1e-4)
