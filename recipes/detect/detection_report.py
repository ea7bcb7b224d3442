"""What the detector prints and shows: the model and the start in a line each, an epoch's line, an
evaluation's pictures (to output_dir and the trackers that take images), and at the end the figures
by class, the summary table and what was saved where. train.py and modes.py both print with it."""

import os
from pathlib import Path

import torch
from detector_files import MODEL_CONFIG, draw_detections
from eval_pictures import save_eval_pictures

from accelerate_recipes import RunState, print_summary
from accelerate_recipes.tracking import IMAGE_TRACKERS, log_image_files, log_images

SUMMARY = [
    "model",
    "world_size",
    "num_machines",
    "mixed_precision",
    "global_batch_size",
    "image_size",
    "steps",
    "epochs",
    "eval_map50",
    "eval_map50_95",
    "eval_precision",
    "eval_recall",
    "eval_f1",
    "best_metric",
    "best_epoch",
    "eval_images",
    "train_samples_per_second",
    "median_step_seconds",
    "peak_memory_mb",
    "wall_seconds",
]


# ---------------------------------------------------------------------------------- before training
def start_classes_line(start: dict, names: list[str]) -> str:
    """What the pretrained start was trained to detect, beside the classes of --data."""
    theirs = start.get("names")
    if not theirs:
        return f"the start: {start['kind']}; its classes are not recorded"
    listed = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
    if list(theirs) == list(names):
        verdict = "the classes of --data: every output carries over"
    elif len(theirs) == len(names):
        verdict = "as many as --data's but other names: the class outputs carry over by position"
    else:
        verdict = f"--data has {len(names)}: the class outputs start fresh"
    return f"the start: {start['kind']}, {len(theirs)} classes ({listed}); {verdict}"


def freeze_line(layers: int, blocks: tuple[str, ...], model: torch.nn.Module) -> str:
    """What --freeze prints: the layers fixed and the parameters left to train."""
    fixed = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (
        f"--freeze {layers}: YOLOv8 layers 0-{layers - 1} fixed ({', '.join(blocks)}), with their BatchNorm "
        f"statistics; {(total - fixed) / 1e6:.2f}M of {total / 1e6:.2f}M parameters train"
    )


def model_line(size: str, info: dict, num_classes: int, train_size: int, val_size: int) -> str:
    """What training prints about the model and the data before it starts."""
    return (
        f"yolo-{size}: {info['parameters'] / 1e6:.2f}M parameters, {info['gflops']:.1f} GFLOPs at "
        f"640 for {num_classes} classes (YOLOv8n, 80 classes: 3.2M, 8.7); {train_size} training and "
        f"{val_size} validation images"
    )


# ---------------------------------------------------------------------------------- each evaluation
def log_pictures(accelerator, records: list, names: list[str], step: int, score_threshold: float) -> None:
    """A few validation images with their predicted boxes, for the trackers that take images
    (SwanLab, wandb)."""
    if not records or not any(tracker.name in IMAGE_TRACKERS for tracker in accelerator.trackers):
        return
    pictures = []
    for record in records:
        keep = record["scores"] >= score_threshold
        pictures.append(
            draw_detections(
                record["path"], record["boxes"][keep], record["labels"][keep], record["scores"][keep], names
            )
        )
    log_images(accelerator, {"eval/predictions": pictures}, step)


def show_evaluation(accelerator, pictures: dict, names: list[str], step: int, output: Path) -> None:
    """An evaluation's pictures (main process): PR_curve, confusion_matrix and val_predictions
    (.png) to output_dir, and to the trackers that take images a few images with their boxes, the
    PR curve and the confusion matrix."""
    if accelerator.is_main_process:
        log_pictures(accelerator, pictures["records"][:4], names, step, score_threshold=0.25)
        save_eval_pictures(output, pictures, names)
        drawn = {"eval/PR_curve": "PR_curve.png", "eval/confusion_matrix": "confusion_matrix.png"}
        log_image_files(accelerator, {key: output / name for key, name in drawn.items()}, step)


def per_class_scalars(evaluation: dict) -> dict:
    """The AP50-95 of each class, as logged: eval/ap50_95/<class name>."""
    return {f"eval/ap50_95/{name}": ap for name, ap in evaluation["eval_ap_per_class"].items()}


def epoch_line(state: RunState, num_epochs: int, seconds: float, images_per_second: float) -> str:
    """What an epoch's evaluation prints."""
    evaluation = state.last_eval
    return (
        f"epoch {state.epoch + 1}/{num_epochs}: mAP50 {evaluation['eval_map50']:.4f}, mAP50-95 "
        f"{evaluation['eval_map50_95']:.4f} on {evaluation['eval_images']} images, {seconds:.1f} s, "
        f"{images_per_second:.1f} images/s"
    )


# ------------------------------------------------------------------------------------------ the end
def class_table(results: dict) -> str:
    """The evaluation by class, as Ultralytics' val prints it: images, instances, precision, recall
    (and F1) at the confidence of the best mean F1, mAP50 and mAP50-95; the first row all
    classes."""
    columns = f"{'P':>6} {'R':>6} {'F1':>6} {'mAP50':>6} {'mAP50-95':>8}"
    header = f"{'class':>20} {'images':>7} {'instances':>9} {columns}"
    per_class = results["eval_per_class"]
    instances = sum(c["instances"] for c in per_class.values())
    rows = [
        header,
        f"{'all':>20} {results['eval_images']:>7} {instances:>9} {results['eval_precision']:>6.3f} "
        f"{results['eval_recall']:>6.3f} {results['eval_f1']:>6.3f} {results['eval_map50']:>6.3f} "
        f"{results['eval_map50_95']:>8.3f}",
    ]
    for name, c in per_class.items():
        rows.append(
            f"{name[:20]:>20} {c['images']:>7} {c['instances']:>9} {c['precision']:>6.3f} "
            f"{c['recall']:>6.3f} "
            f"{c['f1']:>6.3f} {c['ap50']:>6.3f} {c['ap50_95']:>8.3f}"
        )
    rows.append(
        f"P, R and F1 at confidence {results['eval_f1_confidence']:.3f} (the best mean F1); mAP with up to "
        f"{results['eval_max_detections']} detections an image (COCO's 100: mAP50-95 "
        f"{results['eval_map50_95_at_100']:.3f}); fitness (0.1 mAP50 + 0.9 mAP50-95) "
        f"{results['eval_fitness']:.3f}"
    )
    return "\n".join(rows)


def print_results(results: dict, output: Path, path: Path, tracking, script: str | None = None) -> None:
    """What a finished run or evaluation prints (main process): the figures by class, the summary
    table, what was saved where; after training, how to predict with the recipe `script` (train.py's
    __file__)."""
    print(class_table(results))
    if results.get("eval_only"):
        print_summary(results, SUMMARY, title="detect: evaluation")
        print(f"{path.name}, {MODEL_CONFIG} and the evaluation's pictures saved in {output}")
    else:
        print_summary(results, SUMMARY, title="detect: summary")
        best = f", model_best/ (epoch {results['best_epoch']})" if results["best_epoch"] else ""
        print(
            f"model, {MODEL_CONFIG}{best} and {path.name} saved in {output}; predict with: python "
            f"{os.path.relpath(script)} --predict IMAGE_OR_FOLDER --model {output}"
        )
    where = tracking.where()
    if where:
        print(where)
