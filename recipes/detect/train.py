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
(yolo_loss.py), the data pipeline (yolo_data.py) and the loaders built from --data
(yolo_loaders.py), the generated shapes set (synthetic_shapes.py), the optimizer and schedule
(optimizer_schedule.py), the weights' average (ema.py), the saved model's files
(detector_files.py), the mAP (coco_map.py), the pictures of an evaluation (eval_pictures.py), what
a run prints (detection_report.py) and what this script does when it does not train (modes.py:
--eval_only, --predict, --export) sit beside this file; copy the folder to start your own project.

Install: `pip install -e '.[detect]'` from a clone of accelerate-recipes (the runtime plus
torchmetrics, pycocotools and pyyaml).

One function per mode: train() reads top to bottom (config -> accelerator -> data -> model ->
optimizer -> prepare -> schedule -> resume -> loop -> eval -> save); modes.py's
evaluate_saved_model(), predict() and export() use a saved model. `--batch_size` is the GLOBAL
batch (all processes together), so the same flags give the same training on any number of GPUs;
every training image is in every epoch (the last batch is filled up), and a batch larger than the
set is lowered to the set.
"""

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import broadcast_object_list, set_seed
from coco_map import MAX_DETECTIONS, coco_map
from detection_report import (
    epoch_line,
    freeze_line,
    model_line,
    per_class_scalars,
    print_results,
    show_evaluation,
    start_classes_line,
)
from detector_files import MODEL_CONFIG, build_model, model_size, read_start
from ema import weight_average
from eval_pictures import detection_confusion_matrix
from flag_checks import check_flags, eval_conf_threshold
from modes import evaluate_saved_model, export, predict
from optimizer import build_optimizer, evaluations_of_patience
from yolo_data import scale_boxes_back
from yolo_loaders import data_loaders, fit_batch_to_data, training_data
from yolo_loss import DetectionLoss, keep_freed_memory
from yolo_model import postprocess

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RunState,
    check_launch_flags,
    clip_norm,
    epoch_batches,
    finish_run,
    keeps_update,
    model_to_save,
    prepare_output_dir,
    run,
    run_config,
    run_length,
    run_mode,
    saving_checkpoint,
    setup_tracker,
    training_accelerator,
    training_progress,
)
from accelerate_recipes.compiling import compile_results, process_compile_counts
from accelerate_recipes.flags import TrainingFlags
from accelerate_recipes.plots import plot_results
from accelerate_recipes.schedules import warmup_schedule

# --best_by: the evaluation's figure it reads
BEST_BY = {"map50_95": "eval_map50_95", "fitness": "eval_fitness"}
# what RunState sums and metrics.jsonl logs as train/*
LOSS_NAMES = ("loss", "box_loss", "cls_loss", "dfl_loss")


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


# --------------------------------------------------------------------------------------------- data
def to_model_input(images: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float in [0, 1]; on the device, so the loader workers move bytes, not
    floats."""
    images = images.float().div_(255)
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


# -------------------------------------------------------------------------------------------- model
def settle_start(args: DetectFlags):
    """(flags, start): a pretrained start read once (a model of this recipe, or Ultralytics' .pt
    converted in memory), which gives the size; --patience's epochs as the evaluations early
    stopping counts. The flags returned are a copy: the parsed ones stay as they are."""
    start = read_start(Path(args.init_weights)) if args.init_weights else None
    size = model_size(args.size, start)
    return replace(args, size=size, early_stopping_patience=evaluations_of_patience(args)), start


def build_detector(args: DetectFlags, start, names: list[str], accelerator) -> tuple:
    """(model, its build info): random weights, or the start's by name and shape, the first --freeze
    layers fixed; what the start gave and what is frozen said in a line each."""
    model, info = build_model(
        args.size, len(names), args.channels_last, start, flag="--init_weights", by_shape=True
    )
    if info["loaded"]:
        accelerator.print(info["loaded"])  # what the pretrained start gave, and what it left
        accelerator.print(start_classes_line(start, names))
    if args.freeze:
        accelerator.print(freeze_line(args.freeze, model.freeze(args.freeze), model))
    return model, info


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


# -------------------------------------------------------------------------------------------- train
def train(args: DetectFlags) -> None:
    """Train the detector on --data; the last (EMA) model, model_best/, results.json and the
    pictures go to --output_dir."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    check_flags(args)
    image_size = args.image_size or 640
    lr = args.lr if args.lr is not None else (0.64 if args.optimizer == "sgd" else 0.002)
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
    data = training_data(args, image_size, accelerator)
    # a set under one batch
    args, per_process = fit_batch_to_data(args, per_process, len(data.train_set), accelerator)
    train_loader, val_loader = data_loaders(args, data.train_set, data.val_set, per_process, accelerator)

    # ---- model (random weights, or --init_weights by name and shape), optimizer (no weight decay
    # on BatchNorm and biases), loss
    # --freeze: its layers fixed
    model, info = build_detector(args, start, data.names, accelerator)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = build_optimizer(
        model, args.optimizer, lr, args.momentum, args.weight_decay, accelerator.device
    )
    criterion = DetectionLoss(num_classes=len(data.names), strides=model.strides, reg_max=model.reg_max)
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
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    length = run_length(args, steps_per_epoch, len(train_loader), f"{len(data.train_set)} images")
    # --warmup_epochs, at most a tenth of the run
    warmup_steps = min(round(args.warmup_epochs * steps_per_epoch), length.total_steps // 10)
    decay_to = args.final_lr_ratio  # of the peak lr, at the last step
    schedule = warmup_schedule(optimizer, "cosine", warmup_steps, length.total_steps, decay_to)
    scheduler = accelerator.prepare(schedule)

    # Every training flag and the launch's facts, with what this recipe derived from them.
    config = run_config(
        "detect",
        args,
        accelerator,
        dataset=str(data.data_yaml),
        model=f"yolo-{args.size}",
        per_process_batch_size=per_process,
        trainable_parameters=trainable,
        parameters=info["parameters"],
        gflops_at_640=info["gflops"],
        image_size=image_size,
        num_classes=len(data.names),
        lr=lr,
        warmup_steps=warmup_steps,
        total_steps=length.total_steps,
        epochs=length.epochs,
        train_size=len(data.train_set),
        val_size=len(data.val_set),
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
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    # what --predict, --eval_only and --export rebuild the model from
    model_config = detector_config(args, data.names, image_size, unwrapped.cls_width)

    def save_model(folder: Path) -> None:
        """The (EMA) weights and detector.json. Collective."""
        accelerator.save_model(ema.module if ema is not None else model_to_save(accelerator, model), folder)
        if accelerator.is_main_process:
            (folder / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2))

    accelerator.print(model_line(args.size, info, len(data.names), len(data.train_set), len(data.val_set)))

    # ---- training loop
    while state.epoch < length.epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        data.train_set.set_epoch(state.epoch)  # each image's augmentation depends on seed and epoch only
        # no mosaic in the last --close_mosaic
        data.train_set.set_mosaic(state.epoch < length.epochs - args.close_mosaic)
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
        last_epoch = progress.finished or state.epoch + 1 == length.epochs
        if (state.epoch + 1) % args.eval_every == 0 or last_epoch:
            eval_model = ema.module if ema is not None else accelerator.unwrap_model(model)
            evaluation = evaluate(eval_model, val_loader, accelerator, data.names, args)
            state.last_eval, pictures = evaluation
            # logged with the epoch's figures, and each class's AP50-95 as eval/ap50_95/<class>
            seconds = progress.epoch_done(state.last_eval, **per_class_scalars(state.last_eval))
            if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
                with best.saving() as folder:
                    save_model(folder)
            if args.plots:
                show_evaluation(accelerator, pictures, data.names, state.step, output)
            speed = progress.meter.samples_per_second
            accelerator.print(epoch_line(state, length.epochs, seconds, speed))
        if accelerator.is_main_process and args.plots:
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
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print_results(results, output, path, tracking, script=__file__)


# --------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, loader, accelerator, names: list[str], args: DetectFlags) -> tuple[dict, dict]:
    """The figures Ultralytics users compare (coco_map: mAP@0.5 and mAP@0.5:0.95 with up to 300
    detections an image, COCO's 100-detection mAP beside it, precision, recall and F1 overall and
    per class), and the fitness, each validation image counted exactly once. NMS keeps every class
    above --conf_threshold (multi-label, as Ultralytics' val does) and suppresses at
    --iou_threshold.

    Every process predicts on its shard; gather_for_metrics collects the per-image records and drops
    the images the sampler repeated to give every process an equal share. Boxes are compared in
    original image pixels. Returns (metrics, what the pictures need: the first 16 records, and on
    the main process the evaluation's curves and the detection confusion matrix).
    """
    model.eval()
    records = []
    conf_threshold = eval_conf_threshold(args)
    # on the host: the loader was prepared without device placement
    for images, targets, metas in loader:
        # pinned on a GPU: the copy does not stall
        images = images.to(accelerator.device, non_blocking=True)
        with accelerator.autocast():
            outputs = model(to_model_input(images, args.channels_last))
        detections = postprocess(
            [o.float() for o in outputs],
            model.strides,
            model.reg_max,
            conf_threshold=conf_threshold,
            iou_threshold=args.iou_threshold,
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


# --------------------------------------------------------------------------------------------- main
def main(args: DetectFlags) -> None:
    """Train, or run the one other mode a flag names: a function per mode."""
    modes = {
        "predict": predict,
        "export": export,
        "eval_only": lambda flags: evaluate_saved_model(flags, evaluate),
    }
    return run_mode(args, modes, otherwise=train)


if __name__ == "__main__":
    run(main)
