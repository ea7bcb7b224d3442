"""The figures a detector is compared by, from the recipe's evaluation records: train.py's
evaluation and the benchmark beside Ultralytics score predictions with this one function.

One COCO evaluation (pycocotools' COCOeval, the datasets laid out as torchmetrics'
MeanAveragePrecision lays them out) gives everything:

- mAP@0.5 and mAP@0.5:0.95 with up to MAX_DETECTIONS (300) detections scored per image, the recipe's
  and Ultralytics' max_det; COCO's standard counts at most 100, which undercounts crowded scenes:
  that figure is given beside it;
- the AP50 and AP50-95 of each class, read from the same precision table;
- precision, recall and F1 against the confidence threshold at IoU 0.5, per class, from the
  evaluation's matches; the figures at the confidence where the mean F1 over the classes, smoothed,
  is highest (what Ultralytics' val prints as P and R, and the P, R and F1 curves it draws).
"""

import contextlib
import io

import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision.ops import box_convert

# detections scored per image: the recipe's max_det (postprocess) and Ultralytics' val's
MAX_DETECTIONS = 300
COCO_MAX_DETECTIONS = 100  # COCO's standard count, the second figure
# the confidence grid of the P, R and F1 curves (0 to 1), as Ultralytics draws them
CONFIDENCE_POINTS = 1000
# the mean F1 curve is smoothed over this share of the grid before its best point is taken
F1_SMOOTHING = 0.1


def coco_datasets(records: list) -> tuple[COCO, COCO]:
    """(ground truth, detections) as pycocotools datasets: one image per record (id = its index),
    boxes as xywh, every box's area its width x height, no crowds, and the categories of every label
    seen (with or without ground truth), as torchmetrics' MeanAveragePrecision builds them for its
    pycocotools backend."""
    truth, found = [], []
    for image_id, record in enumerate(records):
        truth_boxes = box_convert(record["true_boxes"].float(), "xyxy", "xywh").tolist()
        for box, label in zip(truth_boxes, record["true_labels"].tolist()):
            area = box[2] * box[3]
            truth.append(dict(image_id=image_id, bbox=box, area=area, category_id=int(label), iscrowd=0))
        boxes = box_convert(record["boxes"].float(), "xyxy", "xywh").tolist()
        for box, label, score in zip(boxes, record["labels"].tolist(), record["scores"].tolist()):
            area = box[2] * box[3]
            found.append(dict(image_id=image_id, bbox=box, area=area, category_id=int(label), score=score))
    labels = sorted({a["category_id"] for a in truth + found})
    images = [{"id": i} for i in range(len(records))]
    datasets = []
    for annotations in (truth, found):
        dataset = COCO()
        # COCOeval needs ids from 1
        numbered = [dict(a, id=i + 1) for i, a in enumerate(annotations)]
        dataset.dataset = dict(images=images, annotations=numbered, categories=[{"id": c} for c in labels])
        with contextlib.redirect_stdout(io.StringIO()):
            dataset.createIndex()
        datasets.append(dataset)
    return datasets[0], datasets[1]


def mean_valid(table: np.ndarray) -> float:
    """The mean of a COCOeval precision table's entries other than -1 (no ground truth), as
    COCOeval.summarize averages them; -1 when there is none."""
    valid = table[table > -1]
    return float(valid.mean()) if valid.size else -1.0


def smoothed(curve: np.ndarray, fraction: float) -> np.ndarray:
    """A moving average over an odd window of about `fraction` of the curve's points, the ends
    repeated outwards."""
    window = round(len(curve) * fraction * 2) // 2 + 1
    padded = np.concatenate((np.full(window // 2, curve[0]), curve, np.full(window // 2, curve[-1])))
    return np.convolve(padded, np.ones(window) / window, mode="valid")


def confidence_curves(evaluation: COCOeval) -> dict:
    """Precision, recall and F1 of each category against the confidence threshold, at the
    evaluation's first IoU threshold (0.5), all areas, the most detections: every detection scoring
    at least a threshold counts, matched as COCOeval matched it. Returns confidence [P]; p_curve,
    r_curve and f1_curve [K, P] (rows: evaluation.params.catIds; zeros for a category without ground
    truth); has_truth [K]."""
    params = evaluation.params
    grid = np.linspace(0, 1, CONFIDENCE_POINTS)
    num_categories, num_areas, num_images = len(params.catIds), len(params.areaRng), len(params.imgIds)
    precision = np.zeros((num_categories, CONFIDENCE_POINTS))
    recall = np.zeros((num_categories, CONFIDENCE_POINTS))
    has_truth = np.zeros(num_categories, dtype=bool)
    for k in range(num_categories):
        # evalImgs is laid out category, area range, image; area range 0 is "all"
        first = k * num_areas * num_images
        images = [e for e in evaluation.evalImgs[first : first + num_images] if e]
        objects = sum(int(np.count_nonzero(e["gtIgnore"] == 0)) for e in images)
        has_truth[k] = objects > 0
        if not images or not objects:
            continue
        scores = np.concatenate([e["dtScores"] for e in images])
        matched = np.concatenate([e["dtMatches"][0] for e in images]) > 0
        ignored = np.concatenate([e["dtIgnore"][0] for e in images]).astype(bool)
        # COCOeval's order, best score first
        order = np.argsort(-scores[~ignored], kind="mergesort")
        if not order.size:
            continue
        scores, matched = scores[~ignored][order], matched[~ignored][order]
        true_positives = np.cumsum(matched)
        cumulative_recall = true_positives / objects
        cumulative_precision = true_positives / np.arange(1, len(matched) + 1)
        # scores fall along the detections: the curves at a
        # threshold are those after its last detection
        recall[k] = np.interp(-grid, -scores, cumulative_recall, left=0)
        precision[k] = np.interp(-grid, -scores, cumulative_precision, left=1)
    f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-16)
    return dict(confidence=grid, p_curve=precision, r_curve=recall, f1_curve=f1, has_truth=has_truth)


def coco_map(
    records: list,
    names: list[str],
    max_detections: int = MAX_DETECTIONS,
) -> tuple[dict, dict | None]:
    """The figures of ONE COCO evaluation of `records` (per image: boxes, scores, labels,
    true_boxes, true_labels; boxes xyxy in image pixels), and its curves.

    Returns (scores, curves). scores: eval_map50, eval_map50_95 (up to max_detections detections an
    image), eval_map50_95_at_100 (COCO's 100), eval_max_detections, eval_ap_per_class (AP50-95 by
    class name), eval_precision, eval_recall, eval_f1 (means over the classes with ground truth) at
    eval_f1_confidence, and eval_per_class (images, instances, precision, recall, f1, ap50, ap50_95
    of each class with ground truth).
    curves (None: nothing evaluated): the precision-recall table at IoU 0.5 (recall [R], precision
    [R, classes],
    classes: the class ids of the columns), the confidence curves (confidence_curves, rows as the
    columns) and best, the index of eval_f1_confidence on their grid.
    """
    truth, found = coco_datasets(records)
    scores = dict(
        eval_map50=-1.0,
        eval_map50_95=-1.0,
        eval_map50_95_at_100=-1.0,
        eval_max_detections=max_detections,
        eval_ap_per_class={},
        eval_precision=0.0,
        eval_recall=0.0,
        eval_f1=0.0,
        eval_f1_confidence=0.0,
        eval_per_class={},
    )
    if not records or not truth.getCatIds():
        return scores, None
    evaluation = COCOeval(truth, found, iouType="bbox")
    evaluation.params.maxDets = [1, COCO_MAX_DETECTIONS, max_detections]
    with contextlib.redirect_stdout(io.StringIO()):
        evaluation.evaluate()
        evaluation.accumulate()
    # [IoU thresholds, recall points, categories, area ranges, max detections]; area 0 is all, the
    # last count the most
    table = evaluation.eval["precision"]
    classes = [int(c) for c in evaluation.params.catIds]
    scores.update(
        eval_map50=mean_valid(table[0, :, :, 0, -1]),
        eval_map50_95=mean_valid(table[:, :, :, 0, -1]),
        eval_map50_95_at_100=mean_valid(table[:, :, :, 0, 1]),
    )
    curves = confidence_curves(evaluation)
    with_truth = curves["has_truth"]
    best = 0
    if with_truth.any():
        best = int(smoothed(curves["f1_curve"][with_truth].mean(0), F1_SMOOTHING).argmax())
        scores.update(
            eval_precision=float(curves["p_curve"][with_truth, best].mean()),
            eval_recall=float(curves["r_curve"][with_truth, best].mean()),
            eval_f1=float(curves["f1_curve"][with_truth, best].mean()),
            eval_f1_confidence=float(curves["confidence"][best]),
        )
    images = {c: 0 for c in classes}
    instances = {c: 0 for c in classes}
    for record in records:
        labels = record["true_labels"].tolist()
        for c in set(labels):
            images[c] += 1
        for c in labels:
            instances[c] += 1
    for k, c in enumerate(classes):
        if not with_truth[k]:
            continue  # a class with no ground truth in the set has no AP, precision or recall
        name = names[c]
        scores["eval_ap_per_class"][name] = mean_valid(table[:, :, k, 0, -1])
        scores["eval_per_class"][name] = dict(
            images=images[c],
            instances=instances[c],
            precision=float(curves["p_curve"][k, best]),
            recall=float(curves["r_curve"][k, best]),
            f1=float(curves["f1_curve"][k, best]),
            ap50=mean_valid(table[0, :, k, 0, -1]),
            ap50_95=scores["eval_ap_per_class"][name],
        )
    curves.update(
        recall=torch.tensor(evaluation.params.recThrs),  # COCO's 101 recall points
        # interpolated precision at each, IoU 0.5, per class
        precision=torch.tensor(table[0, :, :, 0, -1]),
        classes=classes,
        best=best,  # the index of eval_f1_confidence on the confidence grid
    )
    return scores, curves
