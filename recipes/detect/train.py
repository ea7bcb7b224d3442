#!/usr/bin/env python
"""Train a YOLO-style object detector with Hugging Face Accelerate: one script for 1 GPU, N GPUs and N nodes.

    python recipes/detect/train.py --data synthetic --image_size 256 --epochs 30       # generated shapes, any machine
    python recipes/detect/train.py --data path/to/data.yaml                            # your YOLO-format dataset
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/detect/train.py --data coco128
    make detect-1gpu ARGS="--data path/data.yaml"

Data is Ultralytics' YOLO format: a data.yaml (`path`, `train`, `val`, `names`) and one `class cx cy w h` text file per
image, so coco128-style folders work unchanged (recipes/detect/convert.py turns COCO JSON or Pascal VOC into it).
The detector (yolo_model.py), its assigner and loss (yolo_loss.py), the data pipeline (yolo_data.py), the generated
shapes set (synthetic_shapes.py), what predict.py shares with this script (detector_files.py) and the pictures of an
evaluation (eval_pictures.py) sit beside this file; copy the folder to start your own project.

Install: `pip install -e '.[detect]'` from a clone of accelerate-recipes (the runtime plus torchmetrics, pycocotools
and pyyaml).

The script reads top to bottom: config -> data -> model -> prepare -> loop -> eval -> save. `--batch_size` is the
GLOBAL batch (all processes together), so the same flags give the same training on any number of GPUs.
"""

from accelerate_recipes.cli import answer_help_from_source

answer_help_from_source(__name__, __file__)  # -h/--help at once, before torch and the rest import

import json
import math
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, broadcast_object_list, set_seed
from detector_files import MODEL_CONFIG, draw_detections
from ema import ModelEMA
from eval_pictures import detection_confusion_matrix, save_eval_pictures
from safetensors.torch import load_file
from synthetic_shapes import write_synthetic_dataset
from torch.utils.data import DataLoader
from torchmetrics.detection import MeanAveragePrecision
from transformers import get_scheduler
from yolo_data import YoloDataset, collate, download_dataset, load_data_config, scale_boxes_back
from yolo_loss import DetectionLoss
from yolo_model import SIZES, Detector, model_info, postprocess

from accelerate_recipes import (
    Checkpoints,
    RecipeError,
    RunState,
    TrainLog,
    check_launch,
    cpu_threads_and_workers,
    explain_startup_failure,
    model_to_save,
    num_machines,
    prepare_output_dir,
    print_summary,
    run,
    setup_tracker,
    write_results,
)
from accelerate_recipes.plots import plot_results
from accelerate_recipes.seeding import SeededAugmentation


# ----------------------------------------------------------------------------------------------------------- data
def resolve_data(data: str, data_dir: str, synthetic_size: int, image_size: int, seed: int, accelerator) -> Path:
    """Path of the data.yaml for --data: a file, `synthetic` (generated here) or a dataset we know how to download."""
    if data == "synthetic":
        folder = Path(data_dir) / f"shapes-{synthetic_size}-{image_size}px-seed{seed}"
        with accelerator.local_main_process_first():  # one writer per node; the others then read its files
            if not (folder / "data.yaml").exists() and accelerator.is_local_main_process:
                write_synthetic_dataset(folder, num_train=synthetic_size, num_val=max(8, synthetic_size // 4),
                                        image_size=image_size, seed=seed)
        return folder / "data.yaml"
    if not data.endswith((".yaml", ".yml")):
        with accelerator.local_main_process_first():
            return download_dataset(data, Path(data_dir), download=accelerator.is_local_main_process)
    return Path(data)


def to_model_input(images: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float in [0, 1]; on the device, so the loader workers move bytes, not floats."""
    images = images.float().div_(255)
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


# ---------------------------------------------------------------------------------------------------------- model
def load_weights(net: torch.nn.Module, path: Path) -> None:
    """Weights saved by an earlier run (accelerator.save_model writes model.safetensors)."""
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise RecipeError(f"--weights {path}: no {file.name} there; give the output directory of a finished run")
    try:
        net.load_state_dict(load_file(str(file)))
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise RecipeError(f"--weights {file} does not fit this model ({first}); use the same --size and a data.yaml "
                          "with the same number of classes as that run") from None


# ----------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, loader, accelerator, names: list[str], channels_last: bool, conf_threshold: float,
             iou_threshold: float) -> tuple[dict, dict]:
    """COCO mAP@0.5 and mAP@0.5:0.95 (torchmetrics + pycocotools), each validation image counted exactly once.

    Every process predicts on its shard; gather_for_metrics collects the per-image records and drops the images the
    sampler repeated to give every process an equal share. Boxes are compared in original image pixels.
    Returns (metrics, what the pictures need: the first 16 records, and on the main process the precision-recall
    table at IoU 0.5 and the detection confusion matrix).
    """
    model.eval()
    records = []
    for images, targets, metas in loader:  # on the host: the loader was prepared without device placement
        images = images.to(accelerator.device, non_blocking=True)  # pinned on a GPU: the copy does not stall
        with accelerator.autocast():
            outputs = model(to_model_input(images, channels_last))
        detections = postprocess([o.float() for o in outputs], model.strides, model.reg_max,
                                 conf_threshold=conf_threshold, iou_threshold=iou_threshold)
        batch = []
        for det, meta, truth in zip(detections, metas, targets):  # the targets never leave the host
            truth = truth[truth[:, 0] >= 0]  # drop the padding rows
            batch.append(dict(
                path=meta["path"],
                boxes=scale_boxes_back(det["boxes"], meta["ratio"], meta["pad"], meta["orig_shape"]).cpu(),
                scores=det["scores"].float().cpu(), labels=det["labels"].cpu(),
                true_boxes=scale_boxes_back(truth[:, 1:5], meta["ratio"], meta["pad"], meta["orig_shape"]),
                true_labels=truth[:, 0].long(),
            ))
        records += accelerator.gather_for_metrics(batch, use_gather_object=True)
    model.train()

    results = {"eval_images": len(records), "eval_unique_images": len({r["path"] for r in records})}
    pictures = {"records": records[:16]}
    if accelerator.is_main_process:  # the records are complete on every process; one computes
        scores, pictures["pr_curve"] = coco_map(records, names)
        results.update(scores)
        pictures["confusion"] = detection_confusion_matrix(records, len(names))
    results = broadcast_object_list([results])[0]  # and every process gets its figures, to log and save alike
    return results, pictures


def coco_map(records: list, names: list[str]) -> tuple[dict, dict | None]:
    """eval_map50, eval_map50_95 and eval_ap_per_class (AP50-95 by class name) from ONE COCO evaluation, and its
    precision-recall table at IoU 0.5 (recall points [R], precision [R, classes], class ids; None: nothing evaluated).

    MeanAveragePrecision(class_metrics=True) would run pycocotools' evaluation again once per class. The per-class AP
    is instead read from the one evaluation's precision table (extended_summary), as COCOeval.summarize averages it
    for the AP50-95 line: over IoU thresholds and recall points, all areas, the most detections; -1 entries (no
    ground truth) left out. A class with no ground truth in the set has no AP and is left out.
    """
    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", backend="pycocotools", extended_summary=True,
                                  sync_on_compute=False)
    metric.update([dict(boxes=r["boxes"], scores=r["scores"], labels=r["labels"]) for r in records],
                  [dict(boxes=r["true_boxes"], labels=r["true_labels"]) for r in records])
    values = metric.compute()
    per_class, pr_curve = {}, None
    if "precision" in values:  # absent when there was nothing to evaluate (no predictions or no images)
        precision = values["precision"][:, :, :, 0, -1]  # [IoU thresholds, recall points, classes]
        pr_curve = dict(recall=torch.tensor(metric.rec_thresholds), precision=precision[0],  # IoU thresholds[0]: 0.5
                        classes=values["classes"].reshape(-1).int().tolist())
        for k, c in enumerate(values["classes"].reshape(-1).tolist()):
            valid = precision[:, :, k][precision[:, :, k] > -1]
            if valid.numel():
                per_class[names[int(c)]] = float(valid.mean())
    scores = dict(eval_map50=float(values["map_50"]), eval_map50_95=float(values["map"]), eval_ap_per_class=per_class)
    return scores, pr_curve


def log_pictures(accelerator, records: list, names: list[str], step: int, score_threshold: float) -> None:
    """A few validation images with their predicted boxes, for trackers that take images (SwanLab, TensorBoard...)."""
    trackers = [t for t in accelerator.trackers if hasattr(t, "log_images")]
    if not trackers or not records:
        return
    pictures = []
    for record in records:
        keep = record["scores"] >= score_threshold
        pictures.append(draw_detections(record["path"], record["boxes"][keep], record["labels"][keep],
                                        record["scores"][keep], names))
    for tracker in trackers:
        try:
            tracker.log_images({"eval/predictions": pictures}, step=step)
        except Exception as err:  # pictures are a convenience; never stop training over one
            accelerator.print(f"warning: could not log images to {tracker.name}: {err}")


# ----------------------------------------------------------------------------------------------------------- main
def main(
    data: str = "coco128",
    data_dir: str = "data",
    synthetic_size: int = 512,
    image_size: int = 640,
    size: str = "n",
    batch_size: int = 64,
    epochs: int = 100,
    max_steps: int | None = None,
    early_stopping_patience: int = 0,
    optimizer: str = "adamw",
    lr: float | None = None,
    momentum: float = 0.937,
    weight_decay: float = 5e-4,
    warmup_epochs: float = 3.0,
    final_lr_ratio: float = 0.01,
    ema_decay: float = 0.9999,
    mosaic: float = 1.0,
    flip_lr: float = 0.5,
    flip_ud: float = 0.0,
    hsv: tuple = (0.015, 0.7, 0.4),
    scale: float = 0.5,
    conf_threshold: float = 0.001,
    iou_threshold: float = 0.7,
    eval_every: int = 1,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float = 10.0,
    mixed_precision: str | None = None,
    channels_last: bool = True,
    num_workers: int | None = None,
    log_every: int = 10,
    output_dir: str = "outputs/detect",
    checkpoint_every: int = 500,
    keep_checkpoints: int = 2,
    resume: str | None = None,
    skip_nonfinite_steps: bool = False,
    dist_timeout: int = 600,
    tracker: str = "swanlab",
    swanlab_mode: str | None = None,
    project: str = "accelerate-recipes",
    run_name: str | None = None,
    seed: int = 42,
    weights: str | None = None,
    eval_only: bool = False,
):
    """Train a YOLO-style anchor-free detector on a YOLO-format dataset.

    Args:
        data: a data.yaml in Ultralytics' format (path, train, val, names); coco128 (downloaded into --data_dir on
            first use, 128 COCO images with 80 classes, used for both train and val as Ultralytics does); or
            synthetic (generated shapes, no download; a pipeline check, not a real-data result).
        data_dir: where downloaded and generated datasets go.
        synthetic_size: training images generated for --data synthetic (validation gets a quarter as many).
        image_size: side of the square (letterboxed) network input; a multiple of 32.
        size: model size, n (nano) or s (small): YOLOv8's depth and width multipliers.
        batch_size: GLOBAL batch of images per optimizer step, all processes together; each process loads
            batch_size / (num_processes x gradient_accumulation_steps).
        epochs: passes over the training set (ignored when --max_steps is set).
        max_steps: stop after this many optimizer steps.
        early_stopping_patience: stop after this many evaluations (--eval_every) in a row whose mAP50-95 is not higher
            than the best so far, saving the last model and results.json as at a normal end; 0 (the default): train to
            the end. Either way the model of the best evaluation is kept in output_dir/model_best (for predict.py
            --model and --weights).
        optimizer: adamw, or sgd (nesterov momentum). The loss is a per-image mean, so SGD needs a larger --lr than
            Ultralytics' 0.01, which multiplies its loss by the batch size.
        lr: peak learning rate after warmup; default 0.002 for adamw, 0.01 x 64 for sgd (Ultralytics' 0.01 at its
            nominal batch of 64, moved onto a mean loss). Not scaled by the GPU count.
        momentum: SGD momentum, or AdamW's beta1.
        weight_decay: on conv and linear weights only (not on BatchNorm or biases).
        warmup_epochs: linear learning-rate warmup, in epochs (at least 20 steps, at most half the run).
        final_lr_ratio: the cosine schedule ends at lr x final_lr_ratio.
        ema_decay: decay of the exponential moving average of the weights that is evaluated and saved (0: off).
        mosaic: probability of a 4-image mosaic per training sample.
        flip_lr: probability of a horizontal flip.
        flip_ud: probability of a vertical flip.
        hsv: colour jitter gains for hue, saturation and value.
        scale: random scale jitter (+/- this fraction).
        conf_threshold: score below which predictions are dropped before NMS in evaluation (low for mAP).
        iou_threshold: IoU above which NMS suppresses a box of the same class.
        eval_every: evaluate every N epochs (and always after the last).
        gradient_accumulation_steps: micro-batches summed before each optimizer step.
        max_grad_norm: clip the gradients' global L2 norm to this before each update (0: no clipping); the early
            steps of a detector, with the assigner still matching poorly, can spike.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        channels_last: NHWC memory layout, faster for convolutions with tensor cores.
        num_workers: DataLoader workers per process; default: the CPU cores per local process less one, at most 8;
            0 on the CPU, where torch's threads get the cores.
        log_every: log the loss and throughput every N optimizer steps.
        output_dir: where the model (model.safetensors + detector.json), model_best/ (the same for the best
            evaluation), results.json, metrics.jsonl, checkpoints/ and offline SwanLab logs go.
        checkpoint_every: save a checkpoint (accelerator.save_state, with the EMA) every N optimizer steps, besides
            the one at the end of each epoch; 0: at epoch ends only.
        keep_checkpoints: how many of the newest checkpoints to keep in output_dir/checkpoints.
        resume: auto (continue from the newest complete checkpoint in output_dir/checkpoints, or start fresh when
            there is none) or the path of a checkpoint; default: start fresh, refused when checkpoints exist.
        skip_nonfinite_steps: drop the update of a step whose loss is NaN or infinite and go on, instead of stopping
            (the optimizer skips it; BatchNorm statistics of that forward pass are kept).
        dist_timeout: seconds a process waits for the others (at start-up, in a checkpoint save, in any collective)
            before it stops with an error; the launcher's own wait for other nodes is --rdzv_conf timeout=N.
        tracker: swanlab, none, or another tracker Accelerate knows (tensorboard, wandb, mlflow, ...).
        swanlab_mode: cloud, offline, local or disabled; default $SWANLAB_MODE, else cloud when logged in, else offline.
        project: tracker project name.
        run_name: tracker run name; default detect-<size>.
        seed: seed for weights, data order, augmentation and generated data.
        weights: start from the model of an earlier run (its output directory, or a model.safetensors file).
        eval_only: evaluate --weights on the validation set and write results.json, without training.
    """
    started = time.perf_counter()
    output = Path(output_dir)
    if size not in SIZES:
        raise RecipeError(f"unknown --size {size!r}; choose one of {', '.join(SIZES)}")
    if optimizer not in ("sgd", "adamw"):
        raise RecipeError(f"unknown --optimizer {optimizer!r}; choose sgd or adamw")
    if image_size % 32 or image_size < 64:
        raise RecipeError(f"--image_size {image_size} must be a multiple of 32 and at least 64 (the head's largest "
                          "stride is 32); e.g. --image_size 640")
    if max_grad_norm < 0:
        raise RecipeError(f"--max_grad_norm {max_grad_norm} must be >= 0 (0 turns clipping off); "
                          "e.g. --max_grad_norm 10")
    lr = lr if lr is not None else (0.64 if optimizer == "sgd" else 0.002)
    hsv = tuple(float(v) for v in hsv)

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(tracker, output, run_name or f"detect-{size}", swanlab_mode)
    with explain_startup_failure(dist_timeout):
        accelerator = Accelerator(
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            log_with=tracking.log_with or None,
            project_dir=str(output),
            # non_blocking: batches are copied from pinned memory while the GPU still works on the previous step.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
            step_scheduler_with_optimizer=False,
            # How long a process waits for the others, at start-up and in every collective, before it stops.
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout))],
        )
    per_process = check_launch(accelerator, batch_size, gradient_accumulation_steps, skip_nonfinite_steps, max_grad_norm)
    world, machines = accelerator.num_processes, num_machines(accelerator.num_processes)
    torch.backends.cudnn.benchmark = True  # training batches all have one shape: pick the fastest kernels once
    set_seed(seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=keep_checkpoints)
    resume_from = None if eval_only else checkpoints.resolve(resume)  # None: a fresh start

    # ---- data: YOLO txt labels; every label is checked once, up front, so a bad file fails now and not mid-epoch
    data_yaml = resolve_data(data, data_dir, synthetic_size, image_size, seed, accelerator)
    dataset = load_data_config(data_yaml)
    if data == "synthetic":
        accelerator.print("!" * 100 + "\n!! SYNTHETIC DATA: generated shapes, not a real dataset. mAP here measures "
                          "the pipeline, not the detector on real images.\n" + "!" * 100)
    names = dataset.names
    # Augmentation seeded per (seed, epoch, image): a resumed run, or one with another worker count, augments alike.
    train_set = SeededAugmentation(YoloDataset(dataset.train, len(names), image_size=image_size, augment=True,
                                               mosaic=mosaic, flip_lr=flip_lr, flip_ud=flip_ud, hsv=hsv, scale=scale),
                                   seed)
    val_set = YoloDataset(dataset.val, len(names), image_size=image_size, augment=False)
    num_workers = cpu_threads_and_workers(accelerator, num_workers)  # on the CPU also torch's threads, to fit the cores
    loader_args = dict(collate_fn=collate, num_workers=num_workers, pin_memory=torch.cuda.is_available(),
                       persistent_workers=num_workers > 0)
    train_loader = DataLoader(train_set, batch_size=per_process, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(seed), **loader_args)
    val_loader = DataLoader(val_set, batch_size=per_process * gradient_accumulation_steps, **loader_args)

    # ---- model, optimizer, EMA
    net = Detector(num_classes=len(names), size=size)
    if weights:
        load_weights(net, Path(weights))
    elif eval_only:
        raise RecipeError("--eval_only needs --weights: the output directory of a training run")
    info = model_info(net, image_size=640)  # at 640, the size YOLO papers and model cards quote
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]  # BatchNorm weights and biases
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999))
    criterion = DetectionLoss(num_classes=len(names), strides=net.strides, reg_max=net.reg_max)

    # ---- prepare: wrap for DDP, shard the loaders across processes, move to the device, add autocast
    net, opt, train_loader = accelerator.prepare(net, opt, train_loader)
    # Evaluation compares boxes on the host: its loader is sharded but left there, and evaluate() moves only the images.
    val_loader = accelerator.prepare_data_loader(val_loader, device_placement=False)
    # An average of the model itself, without torch.compile's wrapper (a launcher's --dynamo_backend adds one): its
    # weights keep their own names in model.safetensors and in checkpoints.
    unwrapped = accelerator.unwrap_model(net, keep_torch_compile=False)
    ema = ModelEMA(unwrapped, ema_decay, ramp_steps=2000) if ema_decay else None
    if ema is not None:
        accelerator.register_for_checkpointing(ema)  # save_state / load_state carry the averaged weights too

    # ---- learning-rate schedule over optimizer steps
    steps_per_epoch = math.ceil(len(train_loader) / gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise RecipeError(f"the training set ({len(train_set)} images) is smaller than one global batch "
                          f"({batch_size}); lower --batch_size or use more images")
    total_steps = max_steps if max_steps else epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = min(max(round(warmup_epochs * steps_per_epoch), 20), total_steps // 2)

    # Linear warmup, then cosine down to lr x final_lr_ratio.
    scheduler = accelerator.prepare(get_scheduler("cosine_with_min_lr", opt, warmup_steps, total_steps,
                                                  scheduler_specific_kwargs={"min_lr_rate": final_lr_ratio}))

    config = dict(
        recipe="detect", dataset=str(data_yaml), weights=weights, eval_only=eval_only, model=f"yolo-{size}",
        world_size=world, num_machines=machines,
        mixed_precision=accelerator.mixed_precision, global_batch_size=batch_size, per_process_batch_size=per_process,
        gradient_accumulation_steps=gradient_accumulation_steps, trainable_parameters=info["parameters"],
        gflops_at_640=info["gflops"], image_size=image_size, num_classes=len(names), optimizer=optimizer, lr=lr,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, warmup_steps=warmup_steps, total_steps=total_steps,
        epochs=num_epochs, ema_decay=ema_decay, mosaic=mosaic, seed=seed, train_size=len(train_set),
        val_size=len(val_set),
        distributed_type=accelerator.distributed_type.value,
    )

    # ---- resume: weights, EMA, optimizer, schedule, RNG states and the run's position, all from save_state's folder
    state = RunState(accelerator.device, ("loss", "box_loss", "cls_loss", "dfl_loss"))
    accelerator.register_for_checkpointing(state)  # save_state / load_state carry the position with the weights
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(project, config=config, init_kwargs=tracking.init_kwargs)
    log = TrainLog(accelerator, state, checkpoints, resumed_from=resume_from, total_steps=total_steps,
                   steps_per_epoch=steps_per_epoch, batches_per_epoch=len(train_loader), global_batch_size=batch_size,
                   log_every=log_every, checkpoint_every=checkpoint_every, skip_nonfinite=skip_nonfinite_steps,
                   metric_for_best_model="eval_map50_95", early_stopping_patience=early_stopping_patience)
    guard, metrics = log.guard, log.metrics  # stops on a non-finite loss or a stop signal; metrics.jsonl

    def save_checkpoint() -> None:
        """Everything a resumed run needs to continue as if it had never stopped; after a stop signal, exit. Collective."""
        with checkpoints.saving(state.step, dict(state.position(), config=config)) as path:
            accelerator.save_state(path)
        guard.stop_if_signalled(state.step, checkpoints.last_saved)  # exits with PREEMPTED_EXIT_CODE

    # What predict.py and --weights need to rebuild the model, written beside its weights.
    model_config = dict(size=size, num_classes=len(names), names=names, image_size=image_size,
                        channels_last=channels_last)

    def save_model(folder: Path) -> None:
        """The (EMA) weights and detector.json, as predict.py and --weights read them. Collective."""
        accelerator.save_model(ema.module if ema is not None else model_to_save(accelerator, net), folder)
        if accelerator.is_main_process:
            (folder / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2))

    accelerator.print(f"yolo-{size}: {info['parameters'] / 1e6:.2f}M parameters, {info['gflops']:.1f} GFLOPs at 640 "
                      f"for {len(names)} classes (YOLOv8n, 80 classes: 3.2M, 8.7); {len(train_set)} training and "
                      f"{len(val_set)} validation images")

    # ---- training loop
    if eval_only:
        num_epochs = 0  # the loop below does not run
        state.last_eval, pictures = evaluate(accelerator.unwrap_model(net), val_loader, accelerator, names,
                                             channels_last, conf_threshold, iou_threshold)
        metrics.log({"eval/map50": state.last_eval["eval_map50"], "eval/map50_95": state.last_eval["eval_map50_95"]},
                    step=0)
        if accelerator.is_main_process:
            save_eval_pictures(output, pictures, names)
    while state.epoch < num_epochs and not log.finished:
        log.start_epoch()
        net.train()
        train_loader.set_epoch(state.epoch)  # the shuffle of each epoch depends on the seed and the epoch only
        train_set.set_epoch(state.epoch)  # and so does each image's augmentation
        # Skip what the interrupted run had trained on in this epoch.
        batches = accelerator.skip_first_batches(train_loader, state.batches_done) if state.batches_done else train_loader
        for images, targets, _ in batches:
            state.batches_done += 1
            with accelerator.accumulate(net):  # skips the gradient all-reduce on accumulation micro-steps
                outputs = net(to_model_input(images, channels_last))
                loss, parts = criterion([o.float() for o in outputs], targets)
                accelerator.backward(loss)
                guard.observe(loss)  # a non-finite loss is noted on the device, read at the next log step
                if accelerator.sync_gradients:
                    if max_grad_norm:
                        accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                    if not guard.skip_update(state.step + 1):
                        opt.step()
                opt.zero_grad(set_to_none=True)
            # total, box, cls, dfl: summed on the device, read at log steps only
            state.add(torch.stack([loss.detach(), parts["box"], parts["cls"], parts["dfl"]]), samples=images.shape[0])
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            if ema is not None:
                ema.update(unwrapped)
            if log.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                save_checkpoint()
            if log.finished:
                break

        # ---- evaluation of the EMA weights on the whole validation set
        guard.check(state.step)  # nothing non-finite since the last log step, before evaluating and saving
        if (state.epoch + 1) % eval_every == 0 or log.finished or state.epoch + 1 == num_epochs:
            eval_model = ema.module if ema is not None else accelerator.unwrap_model(net)
            state.last_eval, pictures = evaluate(eval_model, val_loader, accelerator, names, channels_last,
                                                 conf_threshold, iou_threshold)
            seconds = log.epoch_done(state.last_eval, **{f"eval/ap50_95/{name}": ap for name, ap in
                                                         state.last_eval["eval_ap_per_class"].items()})
            if log.improved:  # the best mAP50-95 so far: the model goes to output_dir/model_best, beside the last
                with log.saving_best() as folder:
                    save_model(folder)
            if accelerator.is_main_process:
                log_pictures(accelerator, pictures["records"][:4], names, state.step, score_threshold=0.25)
                save_eval_pictures(output, pictures, names)  # PR_curve, confusion_matrix, val_predictions (.png)
            accelerator.print(
                f"epoch {state.epoch + 1}/{num_epochs}: mAP50 {state.last_eval['eval_map50']:.4f}, "
                f"mAP50-95 {state.last_eval['eval_map50_95']:.4f} on {state.last_eval['eval_images']} images, "
                f"{seconds:.1f} s, {log.meter.samples_per_second:.1f} images/s"
            )
        if accelerator.is_main_process:
            plot_results(metrics.path, output / "results.png")  # every epoch, so a stopped run has it too
        state.epoch, state.batches_done = state.epoch + 1, 0
        save_checkpoint()
    log.close()

    # ---- save the (EMA) model, what predict.py needs to rebuild it, and the run's results
    accelerator.wait_for_everyone()
    if not eval_only:
        save_model(output)
    results = dict(config, synthetic_data=data == "synthetic", **log.results(started))
    accelerator.wait_for_everyone()  # all ranks tear the process group down together, none while others still talk
    accelerator.end_training()
    if accelerator.is_main_process:
        if eval_only:  # as a training run leaves it
            (output / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2))
        path = write_results(output, results)
        print("AP50-95 per class: " + ", ".join(f"{k} {v:.3f}" for k, v in state.last_eval["eval_ap_per_class"].items()))
        print_summary(results, ["model", "world_size", "num_machines", "mixed_precision", "global_batch_size",
                                "image_size", "steps", "epochs", "eval_map50", "eval_map50_95", "best_metric",
                                "best_epoch", "eval_images",
                                "train_samples_per_second", "median_step_seconds", "peak_memory_mb", "wall_seconds"],
                      title="detect: summary")
        best = f", model_best/ (epoch {results['best_epoch']})" if results["best_epoch"] else ""
        print(f"model, {MODEL_CONFIG}{best} and {path.name} saved in {output}; predict with: python recipes/detect/predict.py --model {output} --source <image or folder>")
        where = tracking.where()
        if where:
            print(where)


if __name__ == "__main__":
    run(main)
