#!/usr/bin/env python
"""Train ResNet18 on CIFAR-10 / CIFAR-100 with Hugging Face Accelerate: one script for 1 GPU, N GPUs
and N nodes.

    python recipes/cifar.py --dataset synthetic --epochs 1              # one process, any machine
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/cifar.py
    make cifar-2node NODE_RANK=1 MASTER_ADDR=10.0.0.1                   # on the second of two nodes
    python recipes/cifar.py --predict photo.jpg --model outputs/cifar   # classify with a trained model
    # fine-tune ImageNet weights on your own images
    python recipes/cifar.py --dataset imagefolder --data_dir my_images --pretrained

The script reads top to bottom: config -> data -> model -> prepare -> loop -> eval -> save.
`--batch_size` is the GLOBAL batch (all processes together), so the same flags give the same
training on any number of GPUs.

Install: `pip install -e .` from a clone of accelerate-recipes (the runtime; this recipe needs no
extra). To start a project of your own, copy this file and the modules beside it that it imports:
cifar_data.py (the data sources and both loaders), cifar_model.py (the model, its inputs and
ImageNet weights) and cifar_modes.py (--eval_only and --predict).
"""

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
from accelerate.utils import set_seed

# beside this file: copy them with the recipe
from cifar_data import build_loaders, epoch_seeded, load_data
from cifar_model import (
    MODEL_CONFIG,
    build_model,
    describe_model,
    input_settings,
    pretrained_weights,
    ready_model,
    write_model_config,
)
from cifar_modes import evaluate_saved_model, predict

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RunState,
    TrainingFlags,
    check_launch_flags,
    clip_norm,
    epoch_batches,
    finish_run,
    keeps_update,
    model_to_save,
    prepare_output_dir,
    print_summary,
    run,
    run_config,
    run_length,
    run_mode,
    saving_checkpoint,
    setup_tracker,
    training_accelerator,
    training_progress,
)
from accelerate_recipes.compiling import compile_results, compile_summary_keys, process_compile_counts
from accelerate_recipes.plots import plot_results, save_confusion_matrix
from accelerate_recipes.schedules import warmup_schedule
from accelerate_recipes.tracking import log_image_files

PRESETS = {
    # ResNet-18 to 94% fast: the settings of the time-to-94% ResNet-18 baseline in
    # KellerJordan/cifar10-zoo (airbench/baselines/train_resnet18_94.py: 26 epochs, batch 500, SGD
    # nesterov lr 0.2 momentum 0.9 wd 5e-4, lr warmup over the first 20% of steps then linear decay
    # to 0, flip + 4-pixel translate + 12-pixel cutout, no label smoothing, flip test-time
    # augmentation; its notes give 94.0% mean accuracy, 51 s on one A100). Batch 512 here, so it
    # divides over 1, 2, 4, 8 and 16 processes.
    "fast94": dict(
        epochs=26,
        batch_size=512,
        lr=0.2,
        momentum=0.9,
        weight_decay=5e-4,
        warmup_ratio=0.2,
        schedule="linear",
        label_smoothing=0.0,
        cutout=12,
        tta_flip=True,
    )
}


# -------------------------------------------------------------------------------------------- flags
@dataclass
class CifarFlags(TrainingFlags):
    """Train a CIFAR-stem ResNet on CIFAR-10/100, generated data or your own image folders (or
    fine-tune ImageNet weights on them), evaluate a trained model, or classify images with it.

    Args:
        dataset: cifar10, cifar100, synthetic (generated, learnable, CIFAR-shaped; no download) or
            imagefolder.
        data_dir: where CIFAR is (or is downloaded to); for imagefolder the folder holding train/
            and val/.
        synthetic_size: training images generated for --dataset synthetic (the test split gets a
            fifth as many).
        download: download CIFAR when it is not in --data_dir, and --pretrained's weights when not
            in torch's cache.
        verify_data: check the CIFAR files against the release's MD5 sums; turn off for a re-packed
            subset.
        image_size: side length images are resized to for --dataset imagefolder (CIFAR is 32);
            default 32, or 224 with --pretrained (the size the ImageNet weights were trained at).
        loader: device (the whole dataset in device memory as uint8, batches cropped, flipped and
            normalised there: no DataLoader, no per-image Python), torch (DataLoader with
            torchvision transforms), or auto: device for CIFAR and generated data when it takes
            under a quarter of the free device memory, else torch.
        arch: the network to train: resnet18, resnet34 or resnet50 from torchvision, with a 3x3
            stride-1 stem and no max-pool.
        model: the output directory of a finished run (model.safetensors and model_config.json)
            for --predict and --eval_only; default --output_dir.
        pretrained: fine-tune torchvision's ImageNet weights of --arch (--dataset imagefolder
            only): torchvision's own 7x7 stem and max-pool, 224 px images unless --image_size says
            otherwise, ImageNet mean/std, a new final layer for your classes. The weights are read
            from torch's hub cache (torch.hub.get_dir()/checkpoints, e.g. resnet18-f37072fd.pth;
            TORCH_HOME moves it) and downloaded there first when missing, by one process per node.
            CIFAR and generated data always train from scratch.
        lr: peak learning rate of SGD (nesterov momentum), reached after warmup, then decayed to
            zero (--schedule); default 0.1 x batch_size / 128 (the linear scaling rule), so 0.4 for
            the default global batch of 512.
        momentum: SGD momentum.
        label_smoothing: label smoothing of the cross-entropy loss.
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        schedule: decay after warmup: cosine (to zero) or linear (to zero).
        max_grad_norm: clip the gradients' global L2 norm to this before each update (0, the
            default: no clipping, as in torchvision's ResNet reference; BatchNorm keeps ResNet's
            gradients tame).
        sync_bn: synchronise BatchNorm statistics across processes (GPUs only). Off by default, as
            in torchvision's and timm's references: each GPU normalises over its own share of the
            batch.
        channels_last: NHWC memory layout, faster for convolutions with tensor cores.
        augment: random pad-4 crop and horizontal flip on training images.
        cutout: side of a random square erased from each training image (0: off); --loader device
            only.
        tta_flip: evaluate on each test image and its mirror image, averaging the logits.
        compile: compile the model with torch.compile
            (Accelerator(dynamo_backend=--compile_backend): prepare() wraps it); the first steps and
            the first evaluation take longer while it compiles. The saved models hold the plain
            ResNet's weights, which --predict and --eval_only load as any others, and a checkpoint
            resumes with or without --compile.
        compile_backend: torch.compile's backend under --compile: inductor (default: generates fused
            kernels) or aot_eager (traces and runs torch's own kernels: no code generation, for
            checking a compiled run quickly).
        skip_nonfinite_steps: drop the update of a step whose loss is NaN or infinite and go on,
            instead of stopping (the optimizer skips it; BatchNorm statistics of that forward pass
            are kept).
        run_name: tracker run name; default cifar-<dataset>.
        preset: a named set of the flags above; flags you also give keep your value. fast94: the
            settings of a public ResNet-18 time-to-94% baseline (26 epochs, batch 512, lr 0.2, 20%
            warmup then linear decay, cutout 12, flip test-time augmentation); see PRESETS in this
            file for the source.
        eval_only: evaluate the model in --model (default --output_dir) on the test split of the
            data flags (--dataset, --data_dir, ...) and write results.json to --output_dir, without
            training; the model's classes, image size and normalisation come from its
            model_config.json. Runs on any number of processes. With --output_dir the model's folder
            (the default), the training run's results.json is replaced.
        predict: classify instead of training: an image file or a folder of images (subfolders
            included), with the model in --model (default --output_dir). Prints one JSON line per
            image, {"image", "label", "score"} (the class name and its probability), and nothing
            else; give --predict several times for several.
    """

    dataset: Literal["cifar10", "cifar100", "synthetic", "imagefolder"] = "cifar10"
    data_dir: str = "data"
    synthetic_size: int = 50_000
    download: bool = True
    verify_data: bool = True
    image_size: int | None = None
    loader: Literal["auto", "device", "torch"] = "auto"
    arch: Literal["resnet18", "resnet34", "resnet50"] = "resnet18"
    model: str | None = None
    pretrained: bool = False
    batch_size: int = 512
    epochs: int = 30
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.1
    warmup_ratio: float = 0.05
    schedule: Literal["cosine", "linear"] = "cosine"
    sync_bn: bool = False
    channels_last: bool = True
    augment: bool = True
    cutout: int = 0
    tta_flip: bool = False
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    output_dir: str = "outputs/cifar"
    preset: str | None = None


# -------------------------------------------------------------------------------------------- train
def train(args: CifarFlags) -> None:
    """Train --arch on --dataset; the model, model_best/, results.json and the pictures go to
    --output_dir."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    # from the global batch, not the GPU count
    lr = args.lr if args.lr is not None else 0.1 * args.batch_size / 128
    inputs = input_settings(args)  # the model, its stem, its images' size and normalisation

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"cifar-{args.dataset}", args.swanlab_mode
    )
    dynamo_backend = args.compile_backend if args.compile else None  # prepare() then compiles it
    accelerator = training_accelerator(args, tracking, dynamo_backend=dynamo_backend)
    per_process = check_launch_flags(accelerator, args)
    set_seed(args.seed)
    # every training batch has the same shape: pick the fastest kernels once
    torch.backends.cudnn.benchmark = True
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data
    train_set, test_set, classes = load_data(args, accelerator, inputs.image_size, inputs.mean, inputs.std)
    # the device loader when the images fit in device memory, else torch's DataLoader
    loaders = build_loaders(args, accelerator, train_set, test_set, per_process, inputs.mean, inputs.std)

    # ---- model and optimizer
    weights_file = pretrained_weights(args, accelerator, inputs.arch)
    model = build_model(inputs.arch, len(classes), stem=inputs.stem, weights=weights_file)
    model = ready_model(args, accelerator, model)
    # their fp32 gradients are what DDP all-reduces
    trainable = sum(p.numel() for p in model.parameters())
    optimizer = optimizer_for(args, model, lr)

    # ---- prepare: wrap for DDP, shard the loaders across processes (the device loader shards
    # itself and passes through), move to the device, add autocast; then the schedule on the
    # prepared optimizer. --compile: results.json counts what the run compiles.
    compiled_before = process_compile_counts()
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, loaders.train, loaders.test
    )
    # its set_epoch then also reaches torch's seeded augmentation
    train_loader = epoch_seeded(train_loader)
    # per process, after sharding
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    length = run_length(args, steps_per_epoch, len(train_loader), f"{len(train_set)} images")
    warmup_steps = round(args.warmup_ratio * length.total_steps)
    # Linear warmup over optimizer steps, then cosine or linear decay to zero.
    schedule = warmup_schedule(optimizer, args.schedule, warmup_steps, length.total_steps)
    scheduler = accelerator.prepare(schedule)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    config = run_config(
        "cifar",
        args,
        accelerator,
        model=inputs.arch,
        image_size=inputs.image_size,
        per_process_batch_size=per_process,
        trainable_parameters=trainable,
        lr=lr,
        warmup_steps=warmup_steps,
        total_steps=length.total_steps,
        epochs=length.epochs,
        loader=loaders.kind,
        train_size=len(train_set),
        test_size=len(test_set),
        synthetic_data=args.dataset == "synthetic",
    )
    # saved beside each model (the last and model_best):
    # what --predict and --eval_only rebuild it from
    model_config = describe_model(args, inputs, classes)

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    state = RunState(accelerator.device)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    best = BestModel(accelerator, state, output, "eval_accuracy", patience=args.early_stopping_patience)
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    # ---- training loop
    while state.epoch < length.epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        batches = epoch_batches(accelerator, train_loader, state.epoch, state.batches_done)
        for images, labels in progress.timed(batches):  # each batch's wait timed
            state.batches_done += 1
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                # a non-finite loss is noted on the device, read at the next log step
                guard.observe(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # summed on the device, read at log steps only
            state.add(loss.detach(), samples=labels.shape[0])
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            if progress.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                with saving_checkpoint(checkpoints, progress, config) as folder:
                    accelerator.save_state(folder)
            if progress.finished:
                break

        # ---- evaluation once per epoch, on the whole validation split
        # nothing non-finite since the last log step, before evaluating and saving
        guard.check(state.step)
        state.last_eval, confusion = evaluate(model, test_loader, accelerator, len(classes), args.tta_flip)
        seconds = progress.epoch_done(state.last_eval)
        if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
            with best.saving() as folder:
                save_trained_model(accelerator, model, folder, model_config)
        # confusion_matrix.csv and results.png every epoch; the matrix's picture at the end
        if accelerator.is_main_process:
            save_confusion_matrix(confusion, classes, output, draw=args.plots and progress.finished)
            if args.plots:
                plot_results(progress.metrics.path, output / "results.png")
                if progress.finished:  # to the trackers that take images
                    picture = output / "confusion_matrix.png"
                    log_image_files(accelerator, {"eval/confusion_matrix": picture}, state.step)
        speed = progress.meter.samples_per_second
        accelerator.print(epoch_line(state, length.epochs, seconds, speed))
        state.epoch, state.batches_done = state.epoch + 1, 0
        with saving_checkpoint(checkpoints, progress, config) as folder:
            accelerator.save_state(folder)
    progress.close()

    # ---- save the model and the run's results
    accelerator.wait_for_everyone()
    save_trained_model(accelerator, model, output, model_config)
    results = dict(config, **progress.results(started))
    # what --compile (or --dynamo_backend) compiled
    results.update(compile_results(compiled_before))
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print_run_summary(results, output, path, tracking)


# ----------------------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(
    model, loader, accelerator, num_classes: int, tta_flip: bool = False
) -> tuple[dict, torch.Tensor]:
    """Top-1 accuracy and mean loss over the whole test set, each sample counted once whatever the
    world size, and the confusion matrix (counts, rows: true class, columns: predicted class).

    tta_flip averages the logits of each image and its mirror image (test-time augmentation). The
    counts and the loss are summed on the device and read once, after the last batch.
    """
    model.eval()
    counts = torch.zeros(num_classes * num_classes, dtype=torch.long, device=accelerator.device)
    loss_sum = torch.zeros((), device=accelerator.device)
    for images, labels in loader:
        logits = model(images)
        if tta_flip:
            logits = (logits + model(images.flip(3))) / 2
        losses = nn.functional.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
        # gather_for_metrics drops the samples the sampler
        # repeated to give every process an equal share.
        preds, labels, losses = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels, losses))
        # Both loaders pad with label -1: the device loader its last shards, both the last batch
        # (one batch shape, so --compile compiles the evaluation once).
        keep = labels >= 0
        preds, labels, losses = preds[keep], labels[keep], losses[keep]
        counts += torch.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
        loss_sum += losses.sum()
    model.train()
    counts = counts.view(num_classes, num_classes).cpu()
    seen = int(counts.sum())
    correct = int(counts.diagonal().sum())
    loss = loss_sum.item() / max(seen, 1)
    return {"eval_accuracy": correct / max(seen, 1), "eval_loss": loss, "eval_samples": seen}, counts


# ---------------------------------------------------------------------------------- set-up and save
def optimizer_for(args: CifarFlags, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Nesterov SGD, with weight decay on conv and linear weights only (not on BatchNorm weights or
    biases)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        momentum=args.momentum,
        nesterov=True,
    )


def save_trained_model(accelerator, model, folder: Path, model_config: dict) -> None:
    """The weights under the plain model's names (compiled or not), and what --predict and
    --eval_only rebuild it from. Collective."""
    accelerator.save_model(model_to_save(accelerator, model), folder)
    if accelerator.is_main_process:
        write_model_config(folder, model_config)


def epoch_line(state: RunState, num_epochs: int, seconds: float, samples_per_second: float) -> str:
    """What each epoch's evaluation prints."""
    evaluation = state.last_eval
    return (
        f"epoch {state.epoch + 1}/{num_epochs}: eval accuracy {evaluation['eval_accuracy']:.4f}, "
        f"loss {evaluation['eval_loss']:.4f}, {seconds:.1f} s, {samples_per_second:.0f} samples/s"
    )


def print_run_summary(results: dict, output: Path, path: Path, tracking) -> None:
    """The end of a training run: its summary table, where its files are, how to use the model."""
    keys = [
        "dataset",
        "world_size",
        "num_machines",
        "mixed_precision",
        "global_batch_size",
        "loader",
        "steps",
        "epochs",
        "eval_accuracy",
        "best_metric",
        "best_epoch",
        "train_samples_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "wall_seconds",
        *compile_summary_keys(results),
    ]
    print_summary(results, keys, title="cifar: summary")
    print(
        f"model, model_best/ (epoch {results['best_epoch']}), {MODEL_CONFIG} and {path.name} saved "
        f"in {output}; classify images with: python {os.path.relpath(__file__)} --predict "
        f"IMAGE_OR_FOLDER --model {output}"
    )
    if tracking.where():
        print(tracking.where())


# --------------------------------------------------------------------------------------------- main
def main(args: CifarFlags) -> None:
    """Train, or run the one other mode a flag names: a function per mode."""
    modes = {"predict": predict, "eval_only": lambda flags: evaluate_saved_model(flags, evaluate)}
    return run_mode(args, modes, otherwise=train)


if __name__ == "__main__":
    run(main, presets=PRESETS)
