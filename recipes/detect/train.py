#!/usr/bin/env python
"""Train a YOLO-style object detector with Hugging Face Accelerate: one script for 1 GPU, N GPUs and
N nodes.

    # generated shapes, any machine
    python recipes/detect/train.py --data synthetic --image_size 256 --epochs 30
    python recipes/detect/train.py --data path/to/data.yaml               # your YOLO-format dataset
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/detect/train.py --data coco128
    make detect-1gpu ARGS="--data path/data.yaml"
    # a saved model's mAP
    python recipes/detect/train.py --eval_only --model outputs/detect --data path/to/data.yaml
    python recipes/detect/train.py --predict photo.jpg --model outputs/detect   # one JSON line per image
    python recipes/detect/train.py --export onnx --model outputs/detect   # model.onnx, for onnxruntime
    # from pretrained weights
    python recipes/detect/train.py --init_weights models/yolov8n --data path/to/data.yaml

Data is Ultralytics' YOLO format: a data.yaml (`path`, `train`, `val`, `names`) and one `class cx cy
w h` text file per image, so coco128-style folders work unchanged (recipes/detect/convert.py turns
COCO JSON or Pascal VOC into it). The detector (yolo_model.py), its assigner and loss
(yolo_loss.py), the data pipeline (yolo_data.py), the generated shapes set (synthetic_shapes.py),
the saved model's files (detector_files.py), what --predict runs (predict.py), the mAP (coco_map.py)
and the pictures of an evaluation (eval_pictures.py) sit beside this file; copy the folder to start
your own project.

Install: `pip install -e '.[detect]'` from a clone of accelerate-recipes (the runtime plus
torchmetrics, pycocotools and pyyaml).

One function per mode: train() reads top to bottom (config -> accelerator -> data -> model ->
optimizer -> prepare -> schedule -> resume -> loop -> eval -> save), evaluate_saved_model(),
predict() and export() use a saved model. `--batch_size` is the GLOBAL batch (all processes
together), so the same flags give the same training on any number of GPUs; every training image is
in every epoch (the last batch is filled up), and a batch larger than the set is lowered to the set.
"""

import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import broadcast_object_list, set_seed
from coco_map import MAX_DETECTIONS, coco_map
from detector_files import (
    MODEL_CONFIG,
    build_model,
    draw_detections,
    model_size,
    read_model_config,
    read_start,
)
from ema import ModelEMA
from eval_pictures import detection_confusion_matrix, save_eval_pictures

# imports onnx and onnxruntime (the export extra) when it runs
from onnx_export import export_model
from predict import detect_images
from synthetic_shapes import write_synthetic_dataset
from torch.utils.data import DataLoader, Dataset
from transformers import get_scheduler
from yolo_data import (
    DataConfig,
    FilledEpochSampler,
    YoloDataset,
    cache_in_memory,
    collate,
    download_dataset,
    load_data_config,
    scale_boxes_back,
)
from yolo_loss import DetectionLoss, keep_freed_memory
from yolo_model import FREEZABLE, postprocess

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RecipeError,
    RunState,
    check_launch_flags,
    clip_norm,
    cpu_threads_and_workers,
    epoch_batches,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    keeps_update,
    model_to_save,
    prepare_output_dir,
    print_summary,
    run,
    run_config,
    saving_checkpoint,
    setup_tracker,
    training_accelerator,
    training_progress,
    write_results,
)
from accelerate_recipes.compiling import compile_results, process_compile_counts
from accelerate_recipes.flags import TrainingFlags
from accelerate_recipes.plots import plot_results
from accelerate_recipes.seeding import SeededAugmentation
from accelerate_recipes.tracking import IMAGE_TRACKERS, log_image_files, log_images

# --best_by: the evaluation's figure it reads
BEST_BY = {"map50_95": "eval_map50_95", "fitness": "eval_fitness"}
DEFAULT_PATIENCE = 100  # epochs without improvement before the run stops: Ultralytics' default
# what RunState sums and metrics.jsonl logs as train/*
LOSS_NAMES = ("loss", "box_loss", "cls_loss", "dfl_loss")
# --conf_threshold's default: low for mAP, higher for use
EVAL_CONF_THRESHOLD, PREDICT_CONF_THRESHOLD = 0.001, 0.25
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


# -------------------------------------------------------------------------------------------- flags
@dataclass
class DetectFlags(TrainingFlags):
    """Train a YOLO-style anchor-free detector on a YOLO-format dataset; or, with --eval_only,
    measure the COCO mAP of a trained one, or with --predict, draw and list what it finds in images.

    Args:
        data: a data.yaml in Ultralytics' format (path, train, val, names); coco128 (downloaded into
            --data_dir on first use, 128 COCO images with 80 classes, used for both train and val as
            Ultralytics does); or synthetic (generated shapes, no download; a pipeline check, not a
            real-data result).
        data_dir: where downloaded and generated datasets go.
        synthetic_size: training images generated for --data synthetic (validation gets a quarter as
            many).
        image_size: side of the square (letterboxed) network input; a multiple of 32. Default: 640
            for training; for --eval_only and --predict, the size the model in --model was trained
            at.
        size: model size, n, s, m, l or x: YOLOv8's depth, width and max-channel multipliers.
            Default the size of --init_weights, else n.
        optimizer: adamw, or sgd (nesterov momentum). The loss is a per-image mean, so SGD needs a
            larger --lr than Ultralytics' 0.01, which multiplies its loss by the batch size.
        momentum: SGD momentum, or AdamW's beta1.
        warmup_epochs: linear learning-rate warmup, in epochs (at most a tenth of the run).
        final_lr_ratio: the cosine schedule ends at lr x final_lr_ratio.
        ema_decay: decay of the exponential moving average of the weights that is evaluated and
            saved (0: off).
        mosaic: probability of a 4-image mosaic per training sample.
        close_mosaic: turn mosaic off for the last N epochs, so that training ends on whole images
            like the ones it is evaluated on (Ultralytics' close_mosaic, 10 there too); 0: mosaic to
            the end.
        flip_lr: probability of a horizontal flip.
        flip_ud: probability of a vertical flip.
        hsv: colour jitter gains for hue, saturation and value.
        scale: random scale jitter (+/- this fraction).
        conf_threshold: score below which predictions are dropped before NMS; default 0.001 in
            evaluation (low, for mAP), 0.25 with --predict.
        iou_threshold: IoU above which NMS suppresses a box of the same class.
        eval_every: evaluate every N epochs (and always after the last).
        channels_last: NHWC memory layout, faster for convolutions with tensor cores.
        cache: keep the training and validation images decoded and resized in memory, instead of
            reading them from disk for every item (mosaic reads four an item): ram, off, or auto
            (ram when they take at most 1 GiB per process and a quarter of the available memory: a
            small set, e.g. 800 images at 640 px). Training is the same either way.
        init_weights: start training from pretrained weights instead of random ones: the model of an
            earlier run (its output directory, its model_best/, or a model.safetensors file), or
            Ultralytics YOLOv8 weights converted by `ultralytics_weights.py`. Loaded by name and
            shape, so the start may detect other classes: all but the classification outputs carry
            over (the run prints what was loaded and what was left), and a file that gives under 90%
            of the model's weights is refused. The optimizer, schedule and step count start fresh
            (--resume continues an interrupted run instead).
        predict_dir: where --predict writes a picture of each image with its boxes, its YOLO label
            file under labels/, and detections.json (every image's boxes in its own pixels, score,
            class id and name); an image found in a subfolder keeps that subfolder there; default
            <model>/predictions.
        predict_device: the device --predict runs on (cuda, cpu, ...); default the first GPU when
            there is one.
        lr: peak learning rate after warmup; default 0.002 for adamw, 0.01 x 64 for sgd
            (Ultralytics' 0.01 at its nominal batch of 64, moved onto a mean loss). Not scaled by
            the GPU count.
        patience: stop after this many epochs without a better --best_by; default 100, as
            Ultralytics' patience; counted in whole evaluations (--eval_every), saving the last
            model and results.json as at a normal end; 0: train to the end. Either way the model of
            the best evaluation is kept in output_dir/model_best (for --predict, --eval_only and
            --init_weights).
        early_stopping_patience: the same counted in evaluations, as the other recipes count it;
            give it or --patience, not both.
        best_by: what model_best is chosen by: map50_95, or fitness (0.1 mAP50 + 0.9 mAP50-95, what
            earlier Ultralytics 8 releases chose best.pt by; 8.4's is mAP50-95 alone).
        freeze: keep the first N of YOLOv8's layers fixed while training (Ultralytics' freeze,
            counted as its layers are: 10 is the whole backbone, 22 every layer but the head): their
            weights and their BatchNorm statistics; 0: train everything.
        split: the split of data.yaml that --eval_only evaluates: val, or test (data.yaml's
            `test:`).
        run_name: tracker run name; default detect-<size>.
        eval_only: evaluate the model in --model on the val split of --data (or --split test) and
            write results.json and the evaluation's pictures (PR_curve, P_curve, R_curve, F1_curve,
            confusion_matrix, val_predictions) to --output_dir, without training.
            Runs on any number of processes; each image is counted once. With --output_dir the
            model's folder (the default), the training run's results.json and pictures are replaced.
        predict: detect objects with the model in --model instead of training: an image file or a
            folder of images; give --predict several times for several. Prints one JSON line per
            image (its boxes, scores and classes) on stdout and writes the pictures, one YOLO label
            file per image (labels/<name>.txt: class cx cy w h, normalised, ready to train on as
            pseudo-labels) and detections.json to --predict_dir; folders are walked recursively;
            runs in one process. --model may also be a file --export wrote (model.onnx and
            model_raw.onnx: onnxruntime; model.torchscript: torch.jit.load).
        export: write the model in --model (default --output_dir) to --output_dir as a file that
            deploys, check it against PyTorch on a batch, and stop. onnx: model.onnx, end to end
            (decoded boxes, scores and classes, NMS in the graph: detections [B, 300, 6] and
            num_detections [B], at --conf_threshold (default 0.25) and --iou_threshold);
            torchscript: model.torchscript, the same end to end; onnx-raw: model_raw.onnx, the
            network's three raw outputs. Batch, height and width dynamic; detector.json inside. ONNX
            needs onnx, onnxscript and onnxruntime (pip install 'accelerate-recipes[export]').
    """

    data: str = "coco128"
    data_dir: str = "data"
    synthetic_size: int = 512
    image_size: int | None = None
    size: Literal["n", "s", "m", "l", "x"] | None = None
    optimizer: Literal["sgd", "adamw"] = "adamw"
    momentum: float = 0.937
    warmup_epochs: float = 3.0
    final_lr_ratio: float = 0.01
    ema_decay: float = 0.9999
    mosaic: float = 1.0
    close_mosaic: int = 10
    flip_lr: float = 0.5
    flip_ud: float = 0.0
    hsv: tuple = (0.015, 0.7, 0.4)
    scale: float = 0.5
    conf_threshold: float | None = None
    iou_threshold: float = 0.7
    eval_every: int = 1
    channels_last: bool = True
    cache: Literal["auto", "ram", "off"] = "auto"
    init_weights: str | None = None
    patience: int | None = None
    best_by: Literal["map50_95", "fitness"] = "map50_95"
    freeze: int = 0
    split: Literal["val", "test"] = "val"
    predict_dir: str | None = None
    predict_device: str | None = None
    export: Literal["onnx", "torchscript", "onnx-raw"] | None = None
    # The shared flags this task trains with by default.
    batch_size: int = 64
    epochs: int = 100
    weight_decay: float = 5e-4
    max_grad_norm: float = 10.0
    output_dir: str = "outputs/detect"


def check_flags(args: DetectFlags) -> None:
    """The flags' values a run cannot start with, refused before anything else happens."""
    if args.image_size is not None and (args.image_size % 32 or args.image_size < 64):
        raise RecipeError(
            f"--image_size {args.image_size} must be a multiple of 32 and at least 64 (the head's "
            "largest stride is 32); e.g. --image_size 640"
        )
    if args.close_mosaic < 0:
        raise RecipeError(
            f"--close_mosaic {args.close_mosaic} must be >= 0 (epochs at the end without mosaic)"
        )
    if isinstance(args.freeze, bool) or not isinstance(args.freeze, int) or not 0 <= args.freeze <= FREEZABLE:
        raise RecipeError(
            f"--freeze {args.freeze}: give the number of YOLOv8 layers to keep fixed, 0 to {FREEZABLE} "
            "(10: the backbone)"
        )
    if args.patience is not None and args.early_stopping_patience:
        raise RecipeError(
            "give --patience (epochs) or --early_stopping_patience (evaluations), not both; e.g. --patience "
            "50"
        )
    whole = isinstance(args.patience, int) and not isinstance(args.patience, bool) and args.patience >= 0
    if args.patience is not None and not whole:
        raise RecipeError(
            f"--patience {args.patience}: give a whole number of epochs, 0 to turn early stopping off",
        )
    if args.max_grad_norm < 0:
        raise RecipeError(
            f"--max_grad_norm {args.max_grad_norm} must be >= 0 (0 turns clipping off); e.g. --max_grad_norm "
            "10"
        )


# --------------------------------------------------------------------------------------------- data
def resolve_data(
    data: str, data_dir: str, synthetic_size: int, image_size: int, seed: int, accelerator
) -> Path:
    """Path of the data.yaml for --data: a file, `synthetic` (generated here) or a dataset we know
    how to download."""
    if data == "synthetic":
        folder = Path(data_dir) / f"shapes-{synthetic_size}-{image_size}px-seed{seed}"
        # one writer per node; the others then read its files
        with accelerator.local_main_process_first():
            if not (folder / "data.yaml").exists() and accelerator.is_local_main_process:
                write_synthetic_dataset(
                    folder,
                    num_train=synthetic_size,
                    num_val=max(8, synthetic_size // 4),
                    image_size=image_size,
                    seed=seed,
                )
        return folder / "data.yaml"
    if not data.endswith((".yaml", ".yml")):
        with accelerator.local_main_process_first():
            return download_dataset(data, Path(data_dir), download=accelerator.is_local_main_process)
    return Path(data)


def to_model_input(images: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float in [0, 1]; on the device, so the loader workers move bytes, not
    floats."""
    images = images.float().div_(255)
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def read_dataset(args: DetectFlags, image_size: int, accelerator) -> tuple[Path, DataConfig]:
    """--data's data.yaml and what it says: each split's images and the class names. Says so loudly
    for generated shapes."""
    data_yaml = resolve_data(
        args.data, args.data_dir, args.synthetic_size, image_size, args.seed, accelerator
    )
    dataset = load_data_config(data_yaml)
    if args.data == "synthetic":
        accelerator.print(
            "!" * 100 + "\n!! SYNTHETIC DATA: generated shapes, not a real dataset. mAP here measures "
            "the pipeline, not the detector on real images.\n" + "!" * 100
        )
    return data_yaml, dataset


def training_data(
    args: DetectFlags, image_size: int, accelerator
) -> tuple[Path, list[str], Dataset, YoloDataset]:
    """--data's data.yaml, its class names, the augmented training split and the validation
    split."""
    data_yaml, dataset = read_dataset(args, image_size, accelerator)
    names = dataset.names
    cache = cache_in_memory(args.cache, len(dataset.train) + len(dataset.val), image_size)
    # Augmentation seeded per (seed, epoch, image): a resumed
    # run, or one with another worker count, augments alike.
    train_set = SeededAugmentation(
        YoloDataset(
            dataset.train,
            len(names),
            image_size=image_size,
            augment=True,
            mosaic=args.mosaic,
            flip_lr=args.flip_lr,
            flip_ud=args.flip_ud,
            hsv=tuple(float(v) for v in args.hsv),
            scale=args.scale,
            cache=cache,
        ),
        args.seed,
    )
    return data_yaml, names, train_set, validation_set(dataset, image_size, cache)


def fit_batch_to_data(
    args: DetectFlags, per_process: int, train_size: int, accelerator
) -> tuple[DetectFlags, int]:
    """--batch_size larger than the training set is lowered to the set's size (rounded down to a
    multiple of the processes x accumulation steps), with a note; the flags with the batch trained
    on, and its per-process share."""
    shards = accelerator.num_processes * args.gradient_accumulation_steps
    if args.batch_size <= train_size:
        return args, per_process
    lowered = train_size // shards * shards
    if lowered == 0:
        raise RecipeError(
            f"the training set ({train_size} images) is smaller than {shards} (processes x accumulation "
            "steps); "
            "use more images, fewer processes or fewer --gradient_accumulation_steps"
        )
    accelerator.print(
        f"note: --batch_size {args.batch_size} is larger than the training set ({train_size} images): "
        f"training with --batch_size {lowered}"
    )
    return replace(args, batch_size=lowered), lowered // shards


def data_loaders(
    args: DetectFlags, train_set: Dataset, val_set: Dataset, per_process: int, accelerator
) -> tuple[DataLoader, DataLoader]:
    """The training loader (every image once an epoch, shuffled by seed and epoch, the last batch
    filled up: FilledEpochSampler) and the validation loader (a whole optimizer step's images per
    batch)."""
    loader_args = loader_settings(accelerator, args.num_workers)
    train_loader = DataLoader(
        train_set,
        batch_size=per_process,
        sampler=FilledEpochSampler(len(train_set), args.batch_size, args.seed),
        drop_last=True,  # never drops: the sampler's length is a multiple of the global batch
        **loader_args,
    )
    val_loader = DataLoader(val_set, batch_size=per_process * args.gradient_accumulation_steps, **loader_args)
    return train_loader, val_loader


def validation_set(dataset: DataConfig, image_size: int, cache: bool, split: str = "val") -> YoloDataset:
    """The val (or test) split, letterboxed to image_size and not augmented; every label is checked
    here, up front."""
    files = dataset.test if split == "test" else dataset.val
    return YoloDataset(files, len(dataset.names), image_size=image_size, augment=False, cache=cache)


def loader_settings(accelerator, num_workers: int | None) -> dict:
    """The DataLoader arguments every loader here shares (on the CPU this also gives torch's threads
    the cores)."""
    num_workers = cpu_threads_and_workers(accelerator, num_workers)
    return dict(
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )


# -------------------------------------------------------------------------------------------- model
def build_optimizer(
    model: torch.nn.Module, name: str, lr: float, momentum: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW or SGD (nesterov) over the trainable parameters (--freeze leaves some out), with weight
    decay on conv and linear weights only (not on BatchNorm or biases)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim > 1]
    no_decay = [p for p in trainable if p.ndim <= 1]  # BatchNorm weights and biases
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True)
    # one fused kernel for all parameters where torch has one: for the nano model on one CPU thread,
    # about a quarter of the time of the loop of tensor ops
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999), fused=fused)


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


def evaluations_of_patience(args: DetectFlags) -> int:
    """--patience's epochs as the evaluations (one every --eval_every epochs) that early stopping
    counts, or --early_stopping_patience's evaluations as given; 0: no early stopping."""
    if args.early_stopping_patience:
        return args.early_stopping_patience
    epochs = DEFAULT_PATIENCE if args.patience is None else args.patience
    return math.ceil(epochs / args.eval_every)


def weight_average(
    accelerator, model: torch.nn.Module, decay: float
) -> tuple[torch.nn.Module, ModelEMA | None]:
    """The prepared model unwrapped, and the exponential moving average of its weights (None with
    --ema_decay 0), registered so that save_state / load_state carry the averaged weights too."""
    # An average of the model itself, without torch.compile's wrapper (a launcher's --dynamo_backend
    # adds one): its weights keep their own names in model.safetensors and in checkpoints.
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    ema = ModelEMA(unwrapped, decay, ramp_steps=2000) if decay else None
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    return unwrapped, ema


def schedule_lengths(args: DetectFlags, batches_per_epoch: int) -> tuple[int, int, int, int]:
    """Optimizer steps per epoch, steps in all (--max_steps or --epochs), the epochs that makes, and
    warmup steps (--warmup_epochs, at most a tenth of the run)."""
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    total_steps = args.max_steps if args.max_steps else args.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = min(round(args.warmup_epochs * steps_per_epoch), total_steps // 10)
    return steps_per_epoch, total_steps, num_epochs, warmup_steps


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, final_lr_ratio: float
):
    """Linear warmup, then cosine down to lr x final_lr_ratio, over optimizer steps."""
    return get_scheduler(
        "cosine_with_min_lr",
        optimizer,
        warmup_steps,
        total_steps,
        scheduler_specific_kwargs={"min_lr_rate": final_lr_ratio},
    )


def detector_config(args: DetectFlags, names: list[str], image_size: int, cls_width: int) -> dict:
    """What --predict, --eval_only and --init_weights rebuild the model from, written beside its
    weights."""
    return dict(
        size=args.size,
        num_classes=len(names),
        names=names,
        image_size=image_size,
        channels_last=args.channels_last,
        cls_width=cls_width,
    )


def model_line(size: str, info: dict, num_classes: int, train_size: int, val_size: int) -> str:
    """What training prints about the model and the data before it starts."""
    return (
        f"yolo-{size}: {info['parameters'] / 1e6:.2f}M parameters, {info['gflops']:.1f} GFLOPs at "
        f"640 for {num_classes} classes (YOLOv8n, 80 classes: 3.2M, 8.7); {train_size} training and "
        f"{val_size} validation images"
    )


# --------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(
    model,
    loader,
    accelerator,
    names: list[str],
    channels_last: bool,
    conf_threshold: float,
    iou_threshold: float,
) -> tuple[dict, dict]:
    """The figures Ultralytics users compare (coco_map: mAP@0.5 and mAP@0.5:0.95 with up to 300
    detections an image, COCO's 100-detection mAP beside it, precision, recall and F1 overall and
    per class), and the fitness, each validation image counted exactly once. NMS keeps every class
    above conf_threshold (multi-label, as Ultralytics' val does).

    Every process predicts on its shard; gather_for_metrics collects the per-image records and drops
    the images the sampler repeated to give every process an equal share. Boxes are compared in
    original image pixels. Returns (metrics, what the pictures need: the first 16 records, and on
    the main process the evaluation's curves and the detection confusion matrix).
    """
    model.eval()
    records = []
    # on the host: the loader was prepared without device placement
    for images, targets, metas in loader:
        # pinned on a GPU: the copy does not stall
        images = images.to(accelerator.device, non_blocking=True)
        with accelerator.autocast():
            outputs = model(to_model_input(images, channels_last))
        detections = postprocess(
            [o.float() for o in outputs],
            model.strides,
            model.reg_max,
            conf_threshold=conf_threshold,
            iou_threshold=iou_threshold,
            max_detections=MAX_DETECTIONS,
            multi_label=True,  # every class above the threshold is scored, as Ultralytics' val does
        )
        batch = []
        for det, meta, truth in zip(detections, metas, targets):  # the targets never leave the host
            truth = truth[truth[:, 0] >= 0]  # drop the padding rows
            batch.append(
                dict(
                    path=meta["path"],
                    boxes=scale_boxes_back(
                        det["boxes"], meta["ratio"], meta["pad"], meta["orig_shape"]
                    ).cpu(),
                    scores=det["scores"].float().cpu(),
                    labels=det["labels"].cpu(),
                    true_boxes=scale_boxes_back(
                        truth[:, 1:5], meta["ratio"], meta["pad"], meta["orig_shape"]
                    ),
                    true_labels=truth[:, 0].long(),
                )
            )
        records += accelerator.gather_for_metrics(batch, use_gather_object=True)
    model.train()

    results = {"eval_images": len(records), "eval_unique_images": len({r["path"] for r in records})}
    pictures = {"records": records[:16]}
    if accelerator.is_main_process:  # the records are complete on every process; one computes
        scores, pictures["curves"] = coco_map(records, names, MAX_DETECTIONS)
        results.update(scores, eval_fitness=fitness(scores))
        pictures["confusion"] = detection_confusion_matrix(records, len(names))
    # and every process gets its figures, to log and save alike
    results = broadcast_object_list([results])[0]
    return results, pictures


def fitness(scores: dict) -> float:
    """0.1 mAP50 + 0.9 mAP50-95: what earlier Ultralytics 8 releases chose best.pt by (8.4.190's
    fitness is mAP50-95 alone, as --best_by map50_95)."""
    return 0.1 * scores["eval_map50"] + 0.9 * scores["eval_map50_95"]


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


def print_results(results: dict, output: Path, path: Path, tracking) -> None:
    """What a finished run or evaluation prints (main process): the figures by class, the summary
    table, what was saved where."""
    print(class_table(results))
    if results.get("eval_only"):
        print_summary(results, SUMMARY, title="detect: evaluation")
        print(f"{path.name}, {MODEL_CONFIG} and the evaluation's pictures saved in {output}")
    else:
        print_summary(results, SUMMARY, title="detect: summary")
        best = f", model_best/ (epoch {results['best_epoch']})" if results["best_epoch"] else ""
        print(
            f"model, {MODEL_CONFIG}{best} and {path.name} saved in {output}; predict with: python "
            f"{os.path.relpath(__file__)} --predict IMAGE_OR_FOLDER --model {output}"
        )
    where = tracking.where()
    if where:
        print(where)


# -------------------------------------------------------------------------------------------- train
def settle_start(args: DetectFlags):
    """(flags, start): a pretrained start read once (a model of this recipe, or Ultralytics' .pt
    converted in memory), which gives the size; --patience's epochs as the evaluations early
    stopping counts."""
    start = read_start(Path(args.init_weights)) if args.init_weights else None
    size = model_size(args.size, start)
    return replace(args, size=size, early_stopping_patience=evaluations_of_patience(args)), start


def build_detector(args: DetectFlags, start, names: list[str], accelerator) -> tuple:
    """(model, its build info, the trainable parameters): random weights, or the start's by name and
    shape, the first --freeze layers fixed; what the start gave and what is frozen said in a line
    each."""
    model, info = build_model(
        args.size, len(names), args.channels_last, start, flag="--init_weights", by_shape=True
    )
    if info["loaded"]:
        accelerator.print(info["loaded"])  # what the pretrained start gave, and what it left
        accelerator.print(start_classes_line(start, names))
    if args.freeze:
        accelerator.print(freeze_line(args.freeze, model.freeze(args.freeze), model))
    return model, info, sum(p.numel() for p in model.parameters() if p.requires_grad)


def train(args: DetectFlags) -> None:
    """Train the detector on --data; the last (EMA) model, model_best/, results.json and the
    pictures go to --output_dir."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    check_flags(args)
    image_size = args.image_size or 640
    lr = args.lr if args.lr is not None else (0.64 if args.optimizer == "sgd" else 0.002)
    conf_threshold = EVAL_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold
    args, start = settle_start(args)  # the size from a pretrained start; --patience in evaluations

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(args.tracker, output, args.run_name or f"detect-{args.size}", args.swanlab_mode)
    accelerator = training_accelerator(args, tracking)
    per_process = check_launch_flags(accelerator, args)
    # training batches all have one shape: pick the fastest kernels once
    torch.backends.cudnn.benchmark = True
    set_seed(args.seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data: YOLO txt labels; every label is checked once, up front, so a bad file fails now and
    # not mid-epoch
    data_yaml, names, train_set, val_set = training_data(args, image_size, accelerator)
    # a set under one batch
    args, per_process = fit_batch_to_data(args, per_process, len(train_set), accelerator)
    train_loader, val_loader = data_loaders(args, train_set, val_set, per_process, accelerator)

    # ---- model (random weights, or --init_weights by name and shape), optimizer (no weight decay
    # on BatchNorm and biases), loss
    # --freeze: its layers fixed
    model, info, trainable = build_detector(args, start, names, accelerator)
    optimizer = build_optimizer(
        model, args.optimizer, lr, args.momentum, args.weight_decay, accelerator.device
    )
    criterion = DetectionLoss(num_classes=len(names), strides=model.strides, reg_max=model.reg_max)
    keep_freed_memory()  # each step reuses the last one's freed memory instead of faulting it in

    # ---- prepare: wrap for DDP, shard the loaders across processes, move to the device, add autocast
    # a launcher's --dynamo_backend: results.json counts what it compiles
    compiled_before = process_compile_counts()
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    # Evaluation compares boxes on the host: its loader is sharded but left there, and evaluate()
    # moves only the images.
    val_loader = accelerator.prepare_data_loader(val_loader, device_placement=False)
    # the EMA that is evaluated and saved
    unwrapped, ema = weight_average(accelerator, model, args.ema_decay)

    # ---- learning-rate schedule over optimizer steps: linear warmup, then cosine down to lr x
    # final_lr_ratio
    steps_per_epoch, total_steps, num_epochs, warmup_steps = schedule_lengths(args, len(train_loader))
    scheduler = accelerator.prepare(warmup_cosine(optimizer, warmup_steps, total_steps, args.final_lr_ratio))

    # Every training flag and the launch's facts, with what this recipe derived from them.
    config = run_config(
        "detect",
        args,
        accelerator,
        dataset=str(data_yaml),
        model=f"yolo-{args.size}",
        per_process_batch_size=per_process,
        trainable_parameters=trainable,
        parameters=info["parameters"],
        gflops_at_640=info["gflops"],
        image_size=image_size,
        num_classes=len(names),
        lr=lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        epochs=num_epochs,
        train_size=len(train_set),
        val_size=len(val_set),
        init_weights=args.init_weights,
        synthetic_data=args.data == "synthetic",
    )

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    state = RunState(accelerator.device, LOSS_NAMES)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    best = BestModel(accelerator, state, output, BEST_BY[args.best_by], patience=args.early_stopping_patience)
    progress = training_progress(
        accelerator,
        args,
        state,
        best,
        resume_from,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        batches_per_epoch=len(train_loader),
    )
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    # what --predict, --eval_only and --export rebuild the model from
    model_config = detector_config(args, names, image_size, unwrapped.cls_width)

    def save_model(folder: Path) -> None:
        """The (EMA) weights and detector.json. Collective."""
        accelerator.save_model(ema.module if ema is not None else model_to_save(accelerator, model), folder)
        if accelerator.is_main_process:
            (folder / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2))

    accelerator.print(model_line(args.size, info, len(names), len(train_set), len(val_set)))

    # ---- training loop
    while state.epoch < num_epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        train_set.set_epoch(state.epoch)  # each image's augmentation depends on seed and epoch only
        # no mosaic in the last --close_mosaic
        train_set.set_mosaic(state.epoch < num_epochs - args.close_mosaic)
        batches = epoch_batches(accelerator, train_loader, state.epoch, state.batches_done)
        for images, targets, _ in progress.timed(batches):  # each batch's wait timed
            state.batches_done += 1
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                outputs = model(to_model_input(images, args.channels_last))
                loss, parts = criterion([o.float() for o in outputs], targets)
                accelerator.backward(loss)
                # a non-finite loss is noted on the device, read at the next log step
                guard.observe(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # total, box, cls, dfl: summed on the device, read at log steps only
            state.add(
                torch.stack([loss.detach(), parts["box"], parts["cls"], parts["dfl"]]),
                samples=images.shape[0],
            )
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            if ema is not None:
                ema.update(unwrapped)
            if progress.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                with saving_checkpoint(checkpoints, progress, config) as folder:
                    accelerator.save_state(folder)
            if progress.finished:
                break

        # ---- evaluation once per epoch, on the whole validation split
        # nothing non-finite since the last log step, before evaluating and saving
        guard.check(state.step)
        # (of the EMA weights, every --eval_every epochs and after the last)
        if (state.epoch + 1) % args.eval_every == 0 or progress.finished or state.epoch + 1 == num_epochs:
            eval_model = ema.module if ema is not None else accelerator.unwrap_model(model)
            state.last_eval, pictures = evaluate(
                eval_model,
                val_loader,
                accelerator,
                names,
                args.channels_last,
                conf_threshold,
                args.iou_threshold,
            )
            # logged with the epoch's figures, and each class's AP50-95 as eval/ap50_95/<class>
            seconds = progress.epoch_done(state.last_eval, **per_class_scalars(state.last_eval))
            if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
                with best.saving() as folder:
                    save_model(folder)
            show_evaluation(accelerator, pictures, names, state.step, output)
            accelerator.print(epoch_line(state, num_epochs, seconds, progress.meter.samples_per_second))
        if accelerator.is_main_process:
            # every epoch, so a stopped run has it too
            plot_results(progress.metrics.path, output / "results.png")
        state.epoch, state.batches_done = state.epoch + 1, 0
        with saving_checkpoint(checkpoints, progress, config) as folder:
            accelerator.save_state(folder)
    progress.close()

    # ---- save the model and the run's results
    accelerator.wait_for_everyone()
    # the (EMA) model and detector.json, what --predict and --eval_only rebuild it from
    save_model(output)
    results = dict(config, **progress.results(started))
    # what --compile (or --dynamo_backend) compiled
    results.update(compile_results(compiled_before))
    # all ranks tear the process group down together, none while others still talk
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        path = write_results(output, results)
        print_results(results, output, path, tracking)


# -------------------------------------------------------------------------------------------- modes
def evaluate_saved_model(args: DetectFlags) -> None:
    """The model in --model (default --output_dir) on the val split of --data: COCO mAP in
    results.json, and the evaluation's pictures, in --output_dir. Any number of processes; each
    image is counted once."""
    started = time.perf_counter()
    output, model_dir = Path(args.output_dir), Path(args.model or args.output_dir)
    check_flags(args)
    saved = read_model_config(model_dir)
    image_size = args.image_size or saved["image_size"]
    conf_threshold = EVAL_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"detect-{saved['size']}", args.swanlab_mode
    )
    accumulation = args.gradient_accumulation_steps
    accelerator = evaluation_accelerator(args, accumulation_steps=accumulation, tracking=tracking)
    per_process = check_launch_flags(accelerator, args)
    set_seed(args.seed)
    prepare_output_dir(output)

    data_yaml, dataset = read_dataset(args, image_size, accelerator)
    names = dataset.names
    if len(names) != saved["num_classes"]:
        raise RecipeError(
            f"--model {model_dir} detects {saved['num_classes']} classes and {data_yaml} has "
            f"{len(names)}: evaluate it on data with the same classes"
        )
    if args.split == "test" and not dataset.test:
        raise RecipeError(
            f"--split test: {data_yaml} has no test split; add one to it (test: images/test, a folder or a "
            "list "
            "of images like val), or evaluate --split val"
        )
    files = dataset.test if args.split == "test" else dataset.val
    cache = cache_in_memory(args.cache, len(files), image_size)
    val_set = validation_set(dataset, image_size, cache, args.split)
    val_loader = DataLoader(
        val_set,
        batch_size=per_process * args.gradient_accumulation_steps,
        **loader_settings(accelerator, args.num_workers),
    )
    model, info = build_model(
        saved["size"],
        len(names),
        args.channels_last,
        model_dir,
        flag="--model",
        cls_width=saved.get("cls_width"),
    )
    # on the device, no DDP wrapper: nothing to sync
    model = accelerator.prepare_model(model, evaluation_mode=True)
    # sharded, boxes on the host
    val_loader = accelerator.prepare_data_loader(val_loader, device_placement=False)

    config = eval_only_config(
        "detect",
        args,
        accelerator,
        dataset=str(data_yaml),
        model=f"yolo-{saved['size']}",
        model_dir=str(model_dir),
        per_process_batch_size=per_process,
        trainable_parameters=info["parameters"],
        gflops_at_640=info["gflops"],
        image_size=image_size,
        num_classes=len(names),
        conf_threshold=conf_threshold,
        iou_threshold=args.iou_threshold,
        split=args.split,
        val_size=len(val_set),
        distributed_type=accelerator.distributed_type.value,
        synthetic_data=args.data == "synthetic",
    )
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs)
    evaluation, pictures = evaluate(
        accelerator.unwrap_model(model),
        val_loader,
        accelerator,
        names,
        args.channels_last,
        conf_threshold,
        args.iou_threshold,
    )
    accelerator.log(
        {"eval/map50": evaluation["eval_map50"], "eval/map50_95": evaluation["eval_map50_95"]}, step=0
    )
    results = eval_only_results(dict(config, epochs=0), accelerator, started, evaluation)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        path = write_results(output, results)
        # the evaluated model's, as a run leaves it
        (output / MODEL_CONFIG).write_text(json.dumps(saved, indent=2))
        # PR_curve, confusion_matrix, val_predictions (.png)
        save_eval_pictures(output, pictures, names)
        print_results(results, output, path, tracking)


def predict(args: DetectFlags) -> None:
    """Detect objects with the model in --model (default --output_dir) in the images --predict
    names: one JSON line per image on stdout; each image drawn with its boxes, and detections.json,
    in --predict_dir. One process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("--predict runs in one process: start it with python, not a launcher")
    check_flags(args)
    detect_images(
        Path(args.model or args.output_dir),
        args.predict,
        out=args.predict_dir,
        conf_threshold=PREDICT_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold,
        iou_threshold=args.iou_threshold,
        image_size=args.image_size,
        device=args.predict_device,
    )


# --------------------------------------------------------------------------------------------- main
def export(args: DetectFlags) -> None:
    """The model in --model (default --output_dir) as a file that deploys in --output_dir:
    model.onnx (end to end), model.torchscript (end to end) or model_raw.onnx (the network alone),
    checked against PyTorch. One process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("--export runs in one process: start it with python, not a launcher")
    check_flags(args)
    files = {"onnx": "model.onnx", "torchscript": "model.torchscript", "onnx-raw": "model_raw.onnx"}
    name = files[args.export]
    export_model(
        Path(args.model or args.output_dir),
        Path(args.output_dir) / name,
        args.export,
        image_size=args.image_size,
        conf_threshold=PREDICT_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold,
        iou_threshold=args.iou_threshold,
    )


def main(args: DetectFlags) -> None:
    """Train, or evaluate a saved model (--eval_only), or use it (--predict): a function per mode."""
    if args.predict is not None and args.eval_only:
        raise RecipeError("give --predict or --eval_only, not both")
    if args.export is not None and (args.predict is not None or args.eval_only):
        raise RecipeError("give --export alone, without --predict or --eval_only")
    if args.predict is not None:
        return predict(args)
    if args.export is not None:
        return export(args)
    if args.eval_only:
        return evaluate_saved_model(args)
    return train(args)


if __name__ == "__main__":
    run(main)
