"""The YOLO-style detector of recipes/detect: task-aligned assignment, loss values on hand-built
predictions, NMS post-processing, model shapes and size, and a tiny overfit. Everything runs on CPU
at 64-pixel images."""

import pytest
import torch
from torchvision.ops import box_iou, complete_box_iou_loss
from yolo_loss import DetectionLoss, TaskAlignedAssigner, distribution_focal_loss, pad_targets
from yolo_model import SIZES, Detector, decode, make_anchors, model_info, postprocess

STRIDES = (8, 16, 32)
REG_MAX = 16


def level_shapes(height: int, width: int) -> list[tuple[int, int]]:
    return [(height // s, width // s) for s in STRIDES]


def anchors_for(height: int = 64, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    dummy = [torch.zeros(1, 1, h, w) for h, w in level_shapes(height, width)]
    return make_anchors(dummy, STRIDES)


def anchor_index(x: float, y: float, stride: int, height: int = 64, width: int = 64) -> int:
    """Index of the anchor centred at pixel (x, y) on the level of `stride` in the concatenated
    anchor list."""
    points, strides = anchors_for(height, width)
    hit = ((points[:, 0] == x) & (points[:, 1] == y) & (strides[:, 0] == stride)).nonzero()
    assert hit.numel() == 1, (x, y, stride)
    return int(hit)


def raw_outputs(
    boxes: torch.Tensor, cls_logits: torch.Tensor, height: int = 64, width: int = 64
) -> list[torch.Tensor]:
    """Raw detector outputs (batch 1) whose decoded box at anchor a is boxes[a] (xyxy pixels, up to
    the DFL range) and whose class logits are cls_logits[a]. A side distance d (in bins) puts weight
    1 - frac(d) on bin floor(d) and frac(d) on the next bin, so the DFL expectation is exactly d; an
    integer d puts all the mass on one bin."""
    points, strides = anchors_for(height, width)
    dist = torch.cat((points - boxes[:, :2], boxes[:, 2:] - points), dim=1) / strides
    dist = dist.clamp(0, REG_MAX - 1 - 1e-4)
    left = dist.floor().long()
    frac = dist - left
    probs = torch.zeros(dist.shape[0], 4, REG_MAX)
    probs.scatter_(-1, left[..., None], (1 - frac)[..., None])
    probs.scatter_add_(-1, (left + 1).clamp(max=REG_MAX - 1)[..., None], frac[..., None])
    box_logits = probs.clamp(min=1e-12).log().reshape(-1, 4 * REG_MAX)
    flat = torch.cat((box_logits, cls_logits), dim=1)  # [A, 4 * REG_MAX + C]
    outputs, start = [], 0
    for h, w in level_shapes(height, width):
        outputs.append(flat[start : start + h * w].T.reshape(1, -1, h, w).contiguous())
        start += h * w
    return outputs


def default_boxes(points: torch.Tensor) -> torch.Tensor:
    return torch.cat((points - 2.0, points + 2.0), dim=1)  # a small box around every anchor


# ----------------------------------------------------------------------------------------- assigner
def test_assigner_picks_topk_inside_anchors_by_iou():
    points, strides = anchors_for()
    num_anchors = points.shape[0]
    gt = torch.tensor([[6.0, 6.0, 42.0, 34.0]])
    # every anchor predicts a gt-sized box centred on itself: the closer to the gt centre, the
    # higher the IoU
    size = gt[0, 2:] - gt[0, :2]
    pred_boxes = torch.cat((points - size / 2, points + size / 2), dim=1)[None]
    pred_scores = torch.full((1, num_anchors, 3), 0.5)
    inside = (points[:, 0] > 6) & (points[:, 0] < 42) & (points[:, 1] > 6) & (points[:, 1] < 34)
    assert inside.sum() > 5  # the test needs more candidates than topk

    assigner = TaskAlignedAssigner(num_classes=3, topk=5)
    labels, boxes, scores, fg, gt_index = assigner(
        pred_scores, pred_boxes, points, torch.tensor([[2]]), gt[None], torch.tensor([[True]])
    )
    assert fg.shape == (1, num_anchors) and scores.shape == (1, num_anchors, 3)
    assert fg.sum() == 5
    assert not (fg[0] & ~inside).any(), "an anchor whose centre is outside the box got it"
    iou = box_iou(pred_boxes[0], gt)[:, 0]
    expected = iou.masked_fill(~inside, -1).topk(5).indices
    assert set(fg[0].nonzero()[:, 0].tolist()) == set(expected.tolist())
    assert (labels[0][fg[0]] == 2).all() and (gt_index[0][fg[0]] == 0).all()
    assert torch.allclose(boxes[0][fg[0]], gt.expand(5, 4))
    # soft targets: only the gt's class, the best anchor
    # scores the best IoU, all others less, background zero
    assert (scores[0][:, :2] == 0).all() and (scores[0][~fg[0]] == 0).all()
    assert scores[0, :, 2].max() == pytest.approx(iou[fg[0]].max().item(), rel=1e-5)
    assert (scores[0, fg[0], 2] > 0).all()
    # without widening (min_side 0), a gt with a single anchor centre inside gets that one anchor,
    # even with topk=10 and other anchors nearby
    small = torch.tensor([[[1.0, 1.0, 7.0, 7.0]]])
    _, _, _, fg, _ = TaskAlignedAssigner(3, topk=10, min_side=0)(
        pred_scores, pred_boxes, points, torch.tensor([[0]]), small, torch.tensor([[True]])
    )
    assert fg[0].nonzero()[:, 0].tolist() == [anchor_index(4, 4, 8)]


def test_assigner_gives_boxes_smaller_than_a_cell_candidates():
    """A 2-pixel box between anchor centres has no centre inside it: widened to 16 pixels about its
    centre for the choice of candidates (the default), it gets the anchors around it, and keeps its
    own box as the target."""
    points, _ = anchors_for()
    pred_boxes = default_boxes(points)[None]
    pred_scores = torch.full((1, points.shape[0], 3), 0.5)
    tiny = torch.tensor([[[9.0, 9.0, 11.0, 11.0]]])
    args = (pred_scores, pred_boxes, points, torch.tensor([[1]]), tiny, torch.tensor([[True]]))
    _, _, _, fg, _ = TaskAlignedAssigner(3, topk=10, min_side=0)(*args)
    assert fg.sum() == 0  # no anchor centre lies inside it: nothing would learn this object
    _, boxes, scores, fg, _ = TaskAlignedAssigner(3, topk=10)(*args)
    near = [anchor_index(x, y, 8) for x in (4, 12) for y in (4, 12)] + [anchor_index(8, 8, 16)]
    assert set(fg[0].nonzero()[:, 0].tolist()) <= set(near + [anchor_index(16, 16, 32)]) and fg.sum() >= 4
    assert torch.equal(boxes[0][fg[0]], tiny[0].expand(int(fg.sum()), 4))


@pytest.mark.parametrize("topk", [1, 3, 10])
def test_assigner_never_more_than_topk_per_gt(topk):
    points, _ = anchors_for()
    gts = torch.tensor([[[0.0, 0.0, 64.0, 64.0], [30.0, 2.0, 62.0, 30.0]]])
    pred_boxes = default_boxes(points)[None]
    scores = torch.rand(1, points.shape[0], 2, generator=torch.Generator().manual_seed(0))
    _, _, _, fg, gt_index = TaskAlignedAssigner(2, topk=topk)(
        scores, pred_boxes, points, torch.tensor([[0, 1]]), gts, torch.tensor([[True, True]])
    )
    for g in range(2):
        assert 1 <= (fg & (gt_index == g)).sum() <= topk


def test_assigner_competing_gts_go_to_higher_iou():
    points, _ = anchors_for()
    shared = anchor_index(28, 28, 8)  # anchor centre inside both gts
    gt_a = torch.tensor([10.0, 10.0, 34.0, 34.0])
    gt_b = torch.tensor([22.0, 22.0, 46.0, 46.0])
    gts = torch.stack((gt_a, gt_b))[None]
    for winner, target in ((0, gt_a), (1, gt_b)):
        pred_boxes = default_boxes(points)
        # overlaps the winner far more
        pred_boxes[shared] = target + torch.tensor([1.0, 1.0, 1.0, 1.0])
        _, boxes, _, fg, gt_index = TaskAlignedAssigner(2, topk=13)(
            torch.full((1, points.shape[0], 2), 0.5),
            pred_boxes[None],
            points,
            torch.tensor([[0, 1]]),
            gts,
            torch.tensor([[True, True]]),
        )
        assert fg[0, shared]
        assert gt_index[0, shared] == winner
        assert torch.equal(boxes[0, shared], target)


def test_assigner_image_without_objects_and_empty_batch():
    points, _ = anchors_for()
    num_anchors = points.shape[0]
    pred_scores = torch.full((2, num_anchors, 4), 0.5)
    pred_boxes = default_boxes(points)[None].expand(2, -1, -1)
    assigner = TaskAlignedAssigner(4)
    # image 0 has one object, image 1 only a padding row (mask False) that overlaps everything
    gts = torch.tensor([[[8.0, 8.0, 40.0, 40.0]], [[0.0, 0.0, 64.0, 64.0]]])
    labels, boxes, scores, fg, _ = assigner(
        pred_scores, pred_boxes, points, torch.tensor([[1], [3]]), gts, torch.tensor([[True], [False]])
    )
    assert fg[0].any() and not fg[1].any()
    assert scores[1].abs().sum() == 0 and boxes[1].abs().sum() == 0
    # no objects anywhere in the batch: M == 0
    labels, boxes, scores, fg, gt_index = assigner(
        pred_scores,
        pred_boxes,
        points,
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, 0, 4),
        torch.zeros(2, 0, dtype=torch.bool),
    )
    assert labels.shape == (2, num_anchors) and boxes.shape == (2, num_anchors, 4)
    assert scores.shape == (2, num_anchors, 4) and gt_index.shape == (2, num_anchors)
    assert not fg.any() and scores.sum() == 0


# --------------------------------------------------------------------------------------------- loss
# edges on stride-8 anchor centres: 9 stride-8 anchors inside, integer bins
GT = torch.tensor([4.0, 4.0, 36.0, 36.0])


def loss_for_prediction(
    pred_box: torch.Tensor, num_classes: int = 2, cls: int = 1
) -> tuple[torch.Tensor, dict]:
    """Every anchor predicts pred_box; the stride-8 anchors inside GT are confident in `cls`, all
    else near zero."""
    points, strides = anchors_for()
    boxes = pred_box.expand(points.shape[0], 4).clone()
    inside = (points > GT[:2]).all(1) & (points < GT[2:]).all(1) & (strides[:, 0] == 8)
    cls_logits = torch.full((points.shape[0], num_classes), -20.0)
    cls_logits[inside, cls] = 20.0
    targets = torch.cat((torch.tensor([float(cls)]), GT))[None, None]  # [1 image, 1 object, 5]
    return DetectionLoss(num_classes)(raw_outputs(boxes, cls_logits), targets)


def test_loss_perfect_prediction_is_near_zero_and_below_shifted():
    perfect, parts = loss_for_prediction(GT)
    assert parts["box"] < 1e-4
    assert parts["dfl"] < 1e-4  # all the mass on the exact integer bins
    assert parts["cls"] < 1e-2
    assert perfect == pytest.approx(parts["box"] + parts["cls"] + parts["dfl"])
    shifted, _ = loss_for_prediction(GT + torch.tensor([4.0, 0.0, 4.0, 0.0]))
    assert shifted > perfect + 0.1


def test_box_loss_grows_with_shift_and_matches_ciou():
    values = []
    for dx in (0.0, 2.0, 4.0, 6.0):
        pred = GT + torch.tensor([dx, 0.0, dx, 0.0])
        _, parts = loss_for_prediction(pred)
        values.append(parts["box"].item())
        # every positive predicts the same box, so the score-weighted mean is that box's CIoU loss
        # (x 7.5). One off-level anchor is a positive with a negligible weight (its class logit is
        # -20).
        assert parts["box"].item() == pytest.approx(
            7.5 * complete_box_iou_loss(pred, GT).item(), rel=1e-3, abs=1e-4
        )
    assert values == sorted(values) and values[-1] > values[1] > values[0] + 0.05


def test_distribution_focal_loss_values():
    logits = torch.full((1, 4, REG_MAX), -30.0)
    logits[0, :, 3] = 30.0
    assert distribution_focal_loss(logits, torch.full((1, 4), 3.0)).item() < 1e-6
    # half way between two bins that share the mass
    # equally: the cross-entropy is ln 2 from both sides
    logits = torch.full((1, 4, REG_MAX), -30.0)
    logits[0, :, 5:7] = 0.0
    assert distribution_focal_loss(logits, torch.full((1, 4), 5.5)).item() == pytest.approx(0.6931, abs=1e-3)


def test_loss_without_objects_and_under_bf16():
    torch.manual_seed(0)
    model = Detector(num_classes=3, size="n")
    images = torch.rand(2, 3, 64, 64)
    criterion = DetectionLoss(3)
    loss, parts = criterion(model(images), torch.zeros(2, 0, 5))
    assert torch.isfinite(loss) and loss > 0 and parts["box"] == 0 and parts["dfl"] == 0
    loss.backward()  # gradients reach the box branch too (as zeros), as DDP needs
    assert all(p.grad is not None for p in model.head.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(images)
    assert outputs[0].dtype == torch.bfloat16
    # only the second image
    targets = pad_targets([torch.zeros(0, 5), torch.tensor([[2.0, 8.0, 8.0, 40.0, 40.0]])])
    loss, parts = criterion(outputs, targets)
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and parts["box"] > 0
    with pytest.raises(ValueError, match=r"targets must be \[2, M, 5\]"):  # the old [T, 6] rows
        criterion(outputs, torch.tensor([[1.0, 2.0, 8.0, 8.0, 40.0, 40.0]]))


# -------------------------------------------------------------------------------------- postprocess
def detections_for(
    entries: list[tuple[tuple[float, float], list[float], int, float]], num_classes: int = 3, **kwargs
) -> dict:
    """entries: (stride-8 anchor centre, box xyxy, class, logit); every other anchor scores
    sigmoid(-20)."""
    points, _ = anchors_for()
    boxes = default_boxes(points)
    cls_logits = torch.full((points.shape[0], num_classes), -20.0)
    for (x, y), box, cls, logit in entries:
        a = anchor_index(x, y, 8)
        boxes[a] = torch.tensor(box)
        cls_logits[a, cls] = logit
    (result,) = postprocess(raw_outputs(boxes, cls_logits), STRIDES, REG_MAX, **kwargs)
    return result


def test_postprocess_nms_same_class_keeps_higher_score():
    det = detections_for([((20, 20), [10, 10, 30, 30], 0, 2.0), ((28, 20), [11, 10, 31, 30], 0, 3.0)])
    assert det["boxes"].shape == (1, 4) and det["labels"].dtype == torch.int64
    assert det["scores"][0].item() == pytest.approx(torch.sigmoid(torch.tensor(3.0)).item(), rel=1e-5)
    assert torch.allclose(det["boxes"][0], torch.tensor([11.0, 10.0, 31.0, 30.0]), atol=1e-3)
    assert det["labels"].tolist() == [0]


def test_postprocess_nms_different_classes_keeps_both_and_conf_threshold():
    entries = [((20, 20), [10, 10, 30, 30], 0, 2.0), ((28, 20), [11, 10, 31, 30], 1, 3.0)]
    det = detections_for(entries)
    assert det["labels"].tolist() == [1, 0]  # sorted by score
    det = detections_for(entries, conf_threshold=0.9)  # sigmoid(2) = 0.88, sigmoid(3) = 0.95
    assert det["labels"].tolist() == [1]


def test_postprocess_max_detections_keeps_best():
    entries = [((4 + 16 * i, 12), [16 * i, 0, 16 * i + 10, 20], 0, float(i)) for i in range(4)]
    entries += [((4 + 16 * i, 52), [16 * i, 44, 16 * i + 10, 60], 2, float(i) + 0.5) for i in range(4)]
    assert len(detections_for(entries)["scores"]) == 8  # disjoint boxes: NMS removes none
    det = detections_for(entries, max_detections=3)
    expected = torch.sigmoid(torch.tensor([3.5, 3.0, 2.5]))
    assert torch.allclose(det["scores"], expected)


def test_decode_boxes_in_pixels():
    points, _ = anchors_for(64, 96)
    boxes = default_boxes(points)
    a = points.shape[0] - 1  # last stride-32 anchor, centre (80, 48)
    boxes[a] = torch.tensor([40.0, 20.0, 96.0, 64.0])
    decoded, logits = decode(raw_outputs(boxes, torch.zeros(points.shape[0], 2), 64, 96), STRIDES, REG_MAX)
    assert decoded.shape == (1, points.shape[0], 4) and logits.shape == (1, points.shape[0], 2)
    assert torch.allclose(points[a], torch.tensor([80.0, 48.0]))
    assert torch.allclose(decoded[0, a], boxes[a], atol=1e-3)


# -------------------------------------------------------------------------------------------- model
def test_detector_output_shapes_train_eval_channels_last():
    torch.manual_seed(0)
    model = Detector(num_classes=5, size="n")
    assert model.strides == (8, 16, 32) and model.reg_max == 16 and model.num_classes == 5
    images = torch.rand(2, 3, 64, 96)
    expected = [(2, 4 * 16 + 5, 8, 12), (2, 4 * 16 + 5, 4, 6), (2, 4 * 16 + 5, 2, 3)]
    assert [tuple(o.shape) for o in model(images)] == expected
    model.eval()
    with torch.no_grad():
        plain = model(images)
        assert [tuple(o.shape) for o in plain] == expected
        last = model.to(memory_format=torch.channels_last)(images.to(memory_format=torch.channels_last))
    for a, b in zip(plain, last):
        assert torch.allclose(a, b, atol=1e-4)
    # the class prior: initial probabilities near 5 objects per 640x640 image
    prob = torch.sigmoid(plain[0][:, 64:]).mean().item()
    assert prob == pytest.approx(5 / 5 / 80**2, rel=0.5)


def test_model_size_and_flops():
    nano = Detector(num_classes=80, size="n")
    before = nano.backbone.stem[0][1].running_mean.clone()
    info_n = model_info(nano, image_size=640)
    assert 2.5e6 < info_n["parameters"] < 3.5e6 and isinstance(info_n["parameters"], int)
    assert 8.0 < info_n["gflops"] < 9.5  # YOLOv8n: 8.7
    # counting did not touch the model
    assert torch.equal(nano.backbone.stem[0][1].running_mean, before)
    assert next(nano.parameters()).device.type == "cpu"
    info_s = model_info(Detector(num_classes=80, size="s"), image_size=640)
    assert info_s["gflops"] > 3 * info_n["gflops"] and info_s["parameters"] > 3 * info_n["parameters"]
    assert set(SIZES) >= {"n", "s"}
    with pytest.raises(ValueError):
        Detector(num_classes=80, size="q")


def test_tiny_overfit():
    torch.manual_seed(0)
    images = torch.rand(2, 3, 64, 64) * 0.3
    images[0, :, 8:40, 8:40] = torch.tensor([0.9, 0.2, 0.2])[:, None, None]
    images[0, :, 36:60, 40:60] = torch.tensor([0.2, 0.2, 0.9])[:, None, None]
    images[1, :, 16:56, 4:36] = torch.tensor([0.2, 0.9, 0.2])[:, None, None]
    targets = pad_targets(
        [torch.tensor([[0.0, 8, 8, 40, 40], [1, 40, 36, 60, 60]]), torch.tensor([[1.0, 4, 16, 36, 56]])]
    )
    model = Detector(num_classes=2, size="n")
    criterion = DetectionLoss(num_classes=2, strides=model.strides, reg_max=model.reg_max)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    threads = torch.get_num_threads()
    # tiny tensors: one thread is several times faster than two on a shared 2-core machine
    torch.set_num_threads(1)
    try:
        for _ in range(40):
            loss, _ = criterion(model(images), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < 0.25 * losses[0], losses  # about 15 -> 1.5 in 40 steps
