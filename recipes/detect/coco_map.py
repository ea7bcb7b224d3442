"""mAP as COCO defines it, from the recipe's evaluation records: train.py's evaluation and the benchmark beside
Ultralytics score predictions with this one function."""

import torch
from torchmetrics.detection import MeanAveragePrecision


def coco_map(records: list, names: list[str]) -> tuple[dict, dict | None]:
    """eval_map50, eval_map50_95 and eval_ap_per_class (AP50-95 by class name) from ONE COCO evaluation, and its
    precision-recall table at IoU 0.5 (recall points [R], precision [R, classes], class ids; None: nothing evaluated).

    MeanAveragePrecision(class_metrics=True) would run pycocotools' evaluation again once per class. The per-class AP
    is instead read from the one evaluation's precision table (extended_summary), as COCOeval.summarize averages it
    for the AP50-95 line: over IoU thresholds and recall points, all areas, the most detections; -1 entries (no
    ground truth) left out. A class with no ground truth in the set has no AP and is left out.
    """
    metric = MeanAveragePrecision(
        box_format="xyxy", iou_type="bbox", backend="pycocotools", extended_summary=True, sync_on_compute=False
    )
    metric.update(
        [dict(boxes=r["boxes"], scores=r["scores"], labels=r["labels"]) for r in records],
        [dict(boxes=r["true_boxes"], labels=r["true_labels"]) for r in records],
    )
    values = metric.compute()
    per_class, pr_curve = {}, None
    if "precision" in values:  # absent when there was nothing to evaluate (no predictions or no images)
        precision = values["precision"][:, :, :, 0, -1]  # [IoU thresholds, recall points, classes]
        pr_curve = dict(
            recall=torch.tensor(metric.rec_thresholds),
            precision=precision[0],  # IoU thresholds[0]: 0.5
            classes=values["classes"].reshape(-1).int().tolist(),
        )
        for k, c in enumerate(values["classes"].reshape(-1).tolist()):
            valid = precision[:, :, k][precision[:, :, k] > -1]
            if valid.numel():
                per_class[names[int(c)]] = float(valid.mean())
    scores = dict(eval_map50=float(values["map_50"]), eval_map50_95=float(values["map"]), eval_ap_per_class=per_class)
    return scores, pr_curve
