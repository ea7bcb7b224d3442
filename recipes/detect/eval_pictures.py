"""The pictures of a detector's evaluation, as Ultralytics users know them, written by train.py
after each evaluation:

- PR_curve.png: precision against recall at IoU 0.5, per class and the mean over classes (whose area
  is mAP50);
- P_curve.png, R_curve.png, F1_curve.png: precision, recall and F1 against the confidence threshold,
  per class and the mean, the confidence of the best mean F1 (where results.json's precision, recall
  and F1 are read) marked;
- confusion_matrix.png and .csv: classes plus background, predictions matched to ground truth as
  Ultralytics does;
- val_predictions.png: the first validation images with their predicted boxes.
"""

import math
from pathlib import Path

import torch
from detector_files import draw_detections
from PIL import Image
from torchvision.ops import box_iou

from accelerate_recipes.plots import new_figure, picture, save_confusion_matrix

MATCH_IOU = 0.45  # Ultralytics' confusion matrix: a prediction matches an object at IoU >= 0.45 ...
MATCH_SCORE = 0.25  # ... and counts only with a score >= 0.25 (mAP uses every score)


def detection_confusion_matrix(
    records: list, num_classes: int, iou_threshold: float = MATCH_IOU, score_threshold: float = MATCH_SCORE
) -> torch.Tensor:
    """Counts [K + 1, K + 1]; rows: the true class, columns: the predicted class; index K is
    background.

    In each image, predictions scoring at least score_threshold are matched one-to-one to
    ground-truth boxes of any class, the pair of highest IoU first, down to iou_threshold. A matched
    pair counts at (true class, predicted class); an object left unmatched at (its class,
    background): missed; a prediction left unmatched at (background, its class): a false positive.
    Evaluation records hold boxes in image pixels, on the CPU.
    """
    background = num_classes
    counts = torch.zeros(num_classes + 1, num_classes + 1, dtype=torch.long)
    for record in records:
        keep = record["scores"] >= score_threshold
        boxes, labels = record["boxes"][keep].float(), record["labels"][keep].tolist()
        true_labels = record["true_labels"].tolist()
        iou = box_iou(record["true_boxes"].float(), boxes)  # [objects, predictions]
        pairs = (iou >= iou_threshold).nonzero()
        pairs = pairs[iou[pairs[:, 0], pairs[:, 1]].argsort(descending=True, stable=True)]
        match = {}  # object -> prediction
        taken = set()
        for t, p in pairs.tolist():
            if t not in match and p not in taken:
                match[t] = p
                taken.add(p)
        for t, true_class in enumerate(true_labels):
            counts[true_class, labels[match[t]] if t in match else background] += 1
        for p, predicted in enumerate(labels):
            if p not in taken:
                counts[background, predicted] += 1
    return counts


@picture
def plot_pr_curve(pr: dict | None, names: list[str], png: Path) -> Path:
    """Precision against recall at IoU 0.5 as COCOeval interpolates it (101 recall points), one thin
    line per class with ground truth and a bold line for the mean over those classes; the legend
    gives each one's area (AP50)."""
    figure = new_figure(9, 6)
    ax = figure.subplots()
    valid = [k for k in range(pr["precision"].shape[1]) if (pr["precision"][:, k] > -1).all()] if pr else []
    if valid:
        recall, precision = pr["recall"], pr["precision"]
        many = len(valid) > 20  # beyond that a legend is unreadable: grey lines without names
        for k in valid:
            ax.plot(
                recall,
                precision[:, k],
                linewidth=1,
                color="gray" if many else None,
                alpha=0.5 if many else 1,
                label=None if many else f"{names[pr['classes'][k]]} {precision[:, k].mean():.3f}",
            )
        mean = precision[:, valid].mean(dim=1)
        ax.plot(recall, mean, linewidth=3, color="blue", label=f"all classes {mean.mean():.3f} mAP50")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    else:
        ax.text(0.5, 0.5, "no detections to evaluate", ha="center", va="center", color="gray")
    ax.set(
        xlim=(0, 1),
        ylim=(0, 1.02),
        xlabel="recall",
        ylabel="precision",
        title="Precision-recall curve at IoU 0.5 (legend: AP50)",
    )
    ax.grid(alpha=0.3)
    figure.savefig(png, dpi=100)
    return png


@picture
def plot_confidence_curve(curves: dict | None, names: list[str], which: str, png: Path) -> Path:
    """One of the confidence curves of coco_map (p_curve, r_curve or f1_curve) against the
    confidence threshold: a thin line per class with ground truth, a bold mean, and the confidence
    of the best mean F1 marked."""
    label = {"p_curve": "precision", "r_curve": "recall", "f1_curve": "F1"}[which]
    figure = new_figure(9, 6)
    ax = figure.subplots()
    valid = [k for k, truth in enumerate(curves["has_truth"]) if truth] if curves else []
    if valid:
        confidence, values = curves["confidence"], curves[which]
        many = len(valid) > 20
        for k in valid:
            name = None if many else names[curves["classes"][k]]
            color, alpha = ("gray", 0.5) if many else (None, 1)
            ax.plot(confidence, values[k], linewidth=1, color=color, alpha=alpha, label=name)
        mean = values[valid].mean(axis=0)
        best = curves["best"]
        label = f"all classes {mean[best]:.3f} at {confidence[best]:.3f}"
        ax.plot(confidence, mean, linewidth=3, color="blue", label=label)
        ax.axvline(confidence[best], color="blue", linestyle=":", linewidth=1)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    else:
        ax.text(0.5, 0.5, "no detections to evaluate", ha="center", va="center", color="gray")
    title = f"{label[0].upper() + label[1:]} against confidence at IoU 0.5 (dotted: the best mean F1)"
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="confidence", ylabel=label, title=title)
    ax.grid(alpha=0.3)
    figure.savefig(png, dpi=100)
    return png


@picture
def save_prediction_grid(
    records: list, names: list[str], png: Path, score_threshold: float = MATCH_SCORE, tile: int = 320
) -> Path:
    """The records' images with their predictions scoring at least score_threshold, each scaled into
    a tile x tile square before drawing (so captions stay readable), up to 4 to a row on a grey
    background."""
    columns = min(4, len(records))
    rows = math.ceil(len(records) / columns)
    grid = Image.new("RGB", (columns * tile, rows * tile), (114, 114, 114))
    for i, record in enumerate(records):
        keep = record["scores"] >= score_threshold
        image = draw_detections(
            record["path"],
            record["boxes"][keep],
            record["labels"][keep],
            record["scores"][keep],
            names,
            fit=tile,
        )
        row, column = divmod(i, columns)
        grid.paste(
            image, (column * tile + (tile - image.width) // 2, row * tile + (tile - image.height) // 2)
        )
    grid.save(png)
    return png


def save_eval_pictures(output: Path, pictures: dict, names: list[str]) -> None:
    """PR_curve.png, P_curve.png, R_curve.png, F1_curve.png, confusion_matrix.png / .csv and
    val_predictions.png in output, from what evaluate() returned."""
    plot_pr_curve(pictures["curves"], names, output / "PR_curve.png")
    for which, png in (("p_curve", "P_curve.png"), ("r_curve", "R_curve.png"), ("f1_curve", "F1_curve.png")):
        plot_confidence_curve(pictures["curves"], names, which, output / png)
    counts = pictures["confusion"]
    save_confusion_matrix(
        counts,
        [*names, "background"],
        output,
        title=f"Confusion matrix (normalised per true class; score >= {MATCH_SCORE}, IoU >= {MATCH_IOU})"
        f"\n{int(counts[:-1].sum())} objects, {int(counts[-1].sum())} false positives",
    )
    if pictures["records"]:
        save_prediction_grid(pictures["records"], names, output / "val_predictions.png")
