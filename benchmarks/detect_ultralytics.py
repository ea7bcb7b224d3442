#!/usr/bin/env python
"""Ultralytics' side of `make bench-detect`: YOLOv8n from its model YAML (random weights), or
fine-tuned from a .pt, trained on a YOLO-format set, then its predictions on the validation images
scored by the recipe's own COCO evaluation. Run by benchmarks/detect.py in a process of its own, so
that its peak memory is its own.

    python benchmarks/detect_ultralytics.py --data data.yaml --image_size 256 --epochs 10 --batch_size 16 \\
        --out DIR

Offline: YOLO_OFFLINE=1, plots=False (no font download), amp=False on a CPU (Ultralytics' AMP check
downloads a model); its settings folder is kept inside DIR. Everything else is Ultralytics' default
(optimizer "auto", its nominal batch of 64 by accumulation, close_mosaic 10, ...). Writes
DIR/ultralytics.json: Ultralytics' own mAP of the last epoch, the same model's mAP by the recipe's
evaluator, training seconds and images/s, wall time, peak memory (host max RSS, as the recipe's
results.json reports it on a CPU) and the path of its best.pt. The recipe's evaluator sees what it
sees of its own model: the validation images letterboxed by the recipe's loader, the model's decoded
outputs through Ultralytics' NMS as its val runs it (every class above conf 0.001, IoU 0.7, at most
300 boxes), the boxes scaled back and scored by coco_map.
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]


def main(
    data: str,
    out: str,
    image_size: int = 256,
    epochs: int = 10,
    batch_size: int = 16,
    seed: int = 0,
    model: str = "yolov8n.yaml",
    device: str | None = None,
):
    """Train Ultralytics' model on `data`, evaluate it with the recipe's evaluator, write
    out/ultralytics.json.

    Args:
        data: the data.yaml (Ultralytics' YOLO format, which the recipe reads too).
        out: the folder for Ultralytics' run and ultralytics.json.
        image_size: imgsz.
        epochs: epochs.
        batch_size: batch.
        seed: seed.
        model: the model YAML (from scratch) or weights file.
        device: cpu, 0, ...; default the first GPU when there is one.
    """
    started = time.perf_counter()
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_CONFIG_DIR", str(folder / "settings"))
    import torch
    from ultralytics import YOLO

    device = device or ("0" if torch.cuda.is_available() else "cpu")
    yolo = YOLO(model)
    epoch_seconds, epoch_started = [], []
    yolo.add_callback("on_train_epoch_start", lambda trainer: epoch_started.append(time.perf_counter()))
    yolo.add_callback(
        "on_train_epoch_end", lambda trainer: epoch_seconds.append(time.perf_counter() - epoch_started[-1])
    )
    yolo.train(
        data=str(data),
        imgsz=image_size,
        epochs=epochs,
        batch=batch_size,
        seed=seed,
        device=device,
        project=str(folder),
        name="run",
        exist_ok=True,
        plots=False,
        amp=device != "cpu",
        # validates after the last epoch only, as the recipe's run is told to (--eval_every epochs)
        val=False,
        verbose=False,
    )
    trainer = yolo.trainer
    own = trainer.metrics  # its own validation of the final model
    sys.path.insert(0, str(REPO / "recipes" / "detect"))
    from yolo_data import load_data_config

    # every image, every epoch: its loader keeps the last batch
    train_images = len(load_data_config(Path(data)).train)
    train_seconds = sum(epoch_seconds)
    # the last epoch's model (EMA weights), as the recipe saves its last (EMA) model
    last = trainer.last
    scores = recipe_evaluation(last, data, image_size, device)
    # best.pt: what a fine-tune starts from
    best = Path(trainer.best) if Path(trainer.best).is_file() else Path(last)
    report = dict(
        tool="ultralytics",
        model=model,
        ultralytics_version=__import__("ultralytics").__version__,
        own_map50=float(own.get("metrics/mAP50(B)", float("nan"))),
        own_map50_95=float(own.get("metrics/mAP50-95(B)", float("nan"))),
        map50=scores["eval_map50"],
        map50_95=scores["eval_map50_95"],
        train_images=train_images,
        epochs=epochs,
        train_seconds=train_seconds,
        train_images_per_second=train_images * epochs / train_seconds,
        wall_seconds=time.perf_counter() - started,
        peak_memory_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        device=device,
        torch_threads=torch.get_num_threads(),
        dataloader_workers=trainer.args.workers,
        best_pt=str(best),
    )
    (folder / "ultralytics.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


def recipe_evaluation(weights: Path, data: str, image_size: int, device: str) -> dict:
    """The model's predictions on the validation images scored by the recipe's COCO evaluation: the
    images and boxes as the recipe's loader reads them, the model's decoded outputs through
    Ultralytics' NMS as its val runs it (every class above conf 0.001, IoU 0.7, at most 300 boxes),
    the boxes scaled back to the images' pixels."""
    import torch
    from coco_map import coco_map
    from torch.utils.data import DataLoader
    from ultralytics import YOLO
    from ultralytics.utils.nms import non_max_suppression
    from yolo_data import YoloDataset, collate, load_data_config, scale_boxes_back

    dataset = load_data_config(Path(data))
    # as train.py's
    val_set = YoloDataset(dataset.val, len(dataset.names), image_size=image_size, augment=False)
    target = torch.device("cuda:0" if device != "cpu" else "cpu")
    model = YOLO(str(weights)).model.float().eval().to(target)
    records = []
    with torch.no_grad():
        for images, targets, metas in DataLoader(val_set, batch_size=8, collate_fn=collate):
            decoded = model(images.to(target).float() / 255)
            decoded = decoded[0] if isinstance(decoded, (list, tuple)) else decoded
            found = non_max_suppression(
                decoded, conf_thres=0.001, iou_thres=0.7, multi_label=True, max_det=300
            )
            for rows, meta, truth in zip(found, metas, targets):
                rows, truth = rows.float().cpu(), truth[truth[:, 0] >= 0]
                records.append(
                    dict(
                        path=meta["path"],
                        boxes=scale_boxes_back(rows[:, :4], meta["ratio"], meta["pad"], meta["orig_shape"]),
                        scores=rows[:, 4],
                        labels=rows[:, 5].long(),
                        true_boxes=scale_boxes_back(
                            truth[:, 1:5], meta["ratio"], meta["pad"], meta["orig_shape"]
                        ),
                        true_labels=truth[:, 0].long(),
                    )
                )
    scores, _ = coco_map(records, dataset.names)
    return scores


if __name__ == "__main__":
    fire.Fire(main)
