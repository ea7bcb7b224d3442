#!/usr/bin/env python
"""Train ResNet18 on CIFAR-10 with Hugging Face Accelerate: the short version of recipes/cifar.py, made to be copied.

One file that needs only public packages (pip install accelerate torch torchvision fire swanlab) and runs unchanged on
one GPU, several GPUs, several nodes or the CPU. --batch_size is the GLOBAL batch, so the same flags train the same
way on any of them. It reads top to bottom: config -> data -> model -> prepare -> loop -> eval -> save.

    python recipes/starters/cifar.py --epochs 5                          # one process (a GPU when there is one)
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/starters/cifar.py            # 2 GPUs
    make cifar-2gpu STARTER=1                                            # the same through make
    accelerate launch --config_file accelerate_configs/2node.yaml --machine_rank 0 --main_process_ip 10.0.0.1 \
        recipes/starters/cifar.py                                        # on node 0; --machine_rank 1 on node 1
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \
        --num_cpu_threads_per_process 1 recipes/starters/cifar.py            # 2 processes on a CPU (gloo)

Paths are from the root of accelerate-recipes; to start a project of your own, copy this file (and the accelerate
configs you use) into it.

What recipes/cifar.py adds, and where to find it there: CIFAR-100, generated data and your own image folders
(build_datasets), ImageNet fine-tuning (--pretrained), a loader that keeps the images in GPU memory (cifar_data.py),
presets, cutout, test-time flips, torch.compile and SyncBatchNorm (CifarFlags); launch checks, a NaN and stop-signal
guard, augmentation that a resumed run repeats exactly, best-model keeping and early stopping (accelerate_recipes:
launch, guard, seeding, loop); results.json, metrics.jsonl and plots; --eval_only and --predict.
"""

import math
import os
import shutil
import sys
from pathlib import Path

import fire
import torch
import torch.nn as nn
import torchvision
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed, tqdm
from torch.utils.data import DataLoader
from torchvision import transforms

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 training-set statistics


class FlagError(Exception):
    """A flag that cannot work: reported as one `error: ...` line, not a traceback."""


class TrainingPosition:
    """Optimizer steps done; register_for_checkpointing makes save_state / load_state carry it with the weights."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class UnverifiedCIFAR10(torchvision.datasets.CIFAR10):
    """CIFAR-10 without the MD5 check (--verify_data False): torchvision checks only that a file whose MD5 is None
    exists, so a copy you re-packed or cut down yourself loads too."""

    train_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.test_list]
    meta = {**torchvision.datasets.CIFAR10.meta, "md5": None}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor: linear from 0 to 1 over the warm-up steps, then a cosine down to 0 at the last step."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, loader, accelerator) -> tuple[float, int]:
    """Top-1 accuracy on the whole test set and the number of images seen: each image counted once on any world size."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=accelerator.device)
    seen = 0
    for images, labels in loader:
        predictions = model(images).argmax(dim=-1)
        # Drops the images the sampler repeated to give every process an equal share of the last batch.
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        correct += (predictions == labels).sum()
        seen += len(labels)
    model.train()
    return correct.item() / max(seen, 1), seen


def swanlab_init_kwargs(output_dir: str, run_name: str) -> dict:
    """swanlab.init arguments: the cloud once `swanlab login` (or SWANLAB_API_KEY) is set, else an offline run in
    output_dir/swanlog that needs no network (upload it later with `swanlab sync`); SWANLAB_MODE decides first."""
    import swanlab

    mode = os.environ.get("SWANLAB_MODE") or ("online" if swanlab.Settings().api_key else "offline")
    log_dir = os.environ.get("SWANLAB_LOG_DIR") or str(Path(output_dir) / "swanlog")
    return {"swanlab": {"mode": mode, "name": run_name, "log_dir": log_dir}}


def main(
    data_dir: str = "data",
    download: bool = True,
    verify_data: bool = True,
    augment: bool = True,
    batch_size: int = 512,
    epochs: int = 30,
    max_steps: int | None = None,
    lr: float | None = None,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    label_smoothing: float = 0.1,
    warmup_ratio: float = 0.05,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float = 0.0,
    mixed_precision: str | None = None,
    channels_last: bool = True,
    num_workers: int | None = None,
    seed: int = 42,
    log_every: int = 10,
    checkpoint_every: int = 500,
    resume: str | None = None,
    tracker: str = "swanlab",
    project: str = "accelerate-recipes",
    output_dir: str = "outputs/cifar_starter",
):
    """Train ResNet18 (with a CIFAR stem) on CIFAR-10; the model goes to output_dir/model.safetensors.

    Args:
        data_dir: where CIFAR-10 is, or is downloaded to (cifar-10-batches-py/ inside it).
        download: download CIFAR-10 into data_dir when it is not there.
        verify_data: check the files against the release's MD5 sums; turn off for a re-packed or smaller copy.
        augment: random crop (4-pixel zero padding) and horizontal flip of training images.
        batch_size: GLOBAL batch per optimizer step, all processes together; each process loads
            batch_size / (processes x gradient_accumulation_steps) images per micro-batch.
        epochs: passes over the training set (ignored when max_steps is set).
        max_steps: stop after this many optimizer steps.
        lr: peak learning rate of nesterov SGD; default 0.1 x batch_size / 128 (linear scaling with the global batch).
        momentum: SGD momentum.
        weight_decay: weight decay on conv kernels and weight matrices (not on BatchNorm weights or biases).
        label_smoothing: label smoothing of the cross-entropy loss.
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up from 0; then a cosine to 0.
        gradient_accumulation_steps: micro-batches whose gradients are summed before each optimizer step.
        max_grad_norm: clip the gradients' global L2 norm to this before each update; 0: no clipping.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        channels_last: NHWC memory layout, faster convolutions on GPUs with tensor cores.
        num_workers: DataLoader worker processes per process; default 4 on a GPU, 0 on the CPU (they would take its
            cores from torch's threads).
        seed: seed of the weights, the data order and the augmentation.
        log_every: print and log the training loss every N optimizer steps (and at the first and the last).
        checkpoint_every: save a checkpoint every N optimizer steps, besides the one at each epoch's end; 0: epoch
            ends only. The newest two are kept in output_dir/checkpoints.
        resume: a checkpoint folder (output_dir/checkpoints/step_...) to go on from: weights, optimizer, schedule,
            random states and the step; the run continues at the batch after it.
        tracker: swanlab (cloud when logged in, else offline under output_dir/swanlog), none, or another tracker
            Accelerate knows (tensorboard, wandb, ...).
        project: tracker project name.
        output_dir: where model.safetensors, checkpoints/ and offline SwanLab runs go.
    """
    flags = dict(locals())  # every flag, for the tracker's run config

    # ---- accelerator: processes, device, precision, gradient accumulation, tracking
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        # The shuffle then depends on the seed and the epoch only, not on the number of processes.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
        # The schedule counts optimizer steps and is stepped once per step below (else once per process).
        step_scheduler_with_optimizer=False,
    )
    world = accelerator.num_processes
    if int(os.environ.get("WORLD_SIZE", "1")) > world:  # e.g. a GPU config on a machine where torch sees no GPU
        raise FlagError("the launched processes did not form one group; on a CPU set ACCELERATE_USE_CPU=true")
    shards = world * gradient_accumulation_steps  # global batch = processes x per-process batch x micro-batches
    if batch_size % shards:
        raise FlagError(
            f"--batch_size {batch_size} (the global batch) does not divide over {world} process(es) x "
            f"{gradient_accumulation_steps} accumulation step(s); use a multiple of {shards}"
        )
    per_process = batch_size // shards
    accelerator.print(f"global batch {batch_size}: {per_process} images per process and micro-batch")
    lr = lr if lr is not None else 0.1 * batch_size / 128  # from the global batch: the same on any number of GPUs
    set_seed(seed)
    torch.backends.cudnn.benchmark = True  # every training batch has the same shape

    # ---- data
    normalize = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
    augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    train_tf, test_tf = transforms.Compose(augmentation + normalize), transforms.Compose(normalize)
    cifar10 = torchvision.datasets.CIFAR10 if verify_data else UnverifiedCIFAR10
    with accelerator.local_main_process_first():  # one process per node downloads; the others then read its copy
        fetch = download and accelerator.is_local_main_process
        train_set = cifar10(str(data_dir), train=True, transform=train_tf, download=fetch)
        test_set = cifar10(str(data_dir), train=False, transform=test_tf)
    workers = num_workers if num_workers is not None else (4 if torch.cuda.is_available() else 0)
    loader_args = dict(num_workers=workers, pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(train_set, batch_size=per_process, shuffle=True, drop_last=True, **loader_args)
    test_loader = DataLoader(test_set, batch_size=per_process * gradient_accumulation_steps, **loader_args)

    # ---- model and optimizer
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    # CIFAR stem: ImageNet's 7x7 stride-2 conv and max-pool would shrink a 32x32 image to 8x8 before the first block.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    decay = [p for p in model.parameters() if p.ndim > 1]  # conv kernels and the classifier's weight matrix
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # BatchNorm weights and biases
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    # ---- prepare: DDP wrapping, loaders sharded across processes, device placement, autocast
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    steps_per_epoch = math.ceil(len(train_loader) / gradient_accumulation_steps)  # per process, after sharding
    if steps_per_epoch == 0:
        raise FlagError(f"the {len(train_set)} training images do not fill one global batch of {batch_size}")
    total_steps = max_steps or epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(warmup_ratio * total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps))
    scheduler = accelerator.prepare(schedule)  # prepared: save_state / load_state carry it

    # ---- resume, tracking
    position = TrainingPosition()
    accelerator.register_for_checkpointing(position)
    if resume:
        accelerator.load_state(resume)
        accelerator.print(f"resumed from {resume} at step {position.step}")
    init_kwargs = swanlab_init_kwargs(output_dir, "cifar-starter") if tracker == "swanlab" else {}
    accelerator.init_trackers(project, config=flags, init_kwargs=init_kwargs)
    saved_at = position.step

    def save_checkpoint() -> None:
        """All that --resume needs: weights, optimizer, schedule, random states and `position`. Every process."""
        nonlocal saved_at
        folder = Path(output_dir) / "checkpoints" / f"step_{position.step:07d}"
        accelerator.save_state(str(folder))
        saved_at = position.step
        if accelerator.is_main_process:  # the newest two are kept
            for old in sorted(folder.parent.glob("step_*"))[:-2]:
                shutil.rmtree(old)

    # ---- training loop
    first_epoch, steps_done_in_epoch = divmod(position.step, steps_per_epoch)
    progress = tqdm(total=total_steps, initial=position.step, desc="train", disable=not accelerator.is_main_process)
    running_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
    for epoch in range(first_epoch, num_epochs):
        model.train()
        train_loader.set_epoch(epoch)  # the shuffle of each epoch: from the seed and the epoch
        batches = train_loader
        if steps_done_in_epoch:  # resumed inside this epoch: go on after the batches trained on before
            batches = accelerator.skip_first_batches(train_loader, steps_done_in_epoch * gradient_accumulation_steps)
            steps_done_in_epoch = 0
        for images, labels in batches:
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with accelerator.accumulate(model):  # no gradient all-reduce on the micro-batches before the last
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # the step's last micro-batch: update the weights
                    if max_grad_norm:
                        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            running_loss += loss.detach()  # summed on the device; read at log steps only
            micro_batches += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            position.step += 1
            progress.update(1)
            if position.step % log_every == 0 or position.step in (1, total_steps):
                # The mean loss of the micro-batches since the last log, averaged over the processes.
                mean_loss = accelerator.reduce(running_loss / micro_batches, reduction="mean").item()
                lr_now = scheduler.get_last_lr()[0]
                accelerator.print(f"step {position.step}/{total_steps} loss {mean_loss:.7f} lr {lr_now:.7g}")
                accelerator.log({"train/loss": mean_loss, "train/lr": lr_now}, step=position.step)
                running_loss.zero_()
                micro_batches = 0
            if checkpoint_every and position.step % checkpoint_every == 0:
                save_checkpoint()
            if position.step >= total_steps:
                break

        # ---- evaluation at each epoch's end, on the whole test set
        accuracy, seen = evaluate(model, test_loader, accelerator)
        accelerator.print(f"epoch {epoch + 1}/{num_epochs}: eval accuracy {accuracy:.4f} on {seen} test images")
        accelerator.log({"eval/accuracy": accuracy}, step=position.step)
        if saved_at != position.step:
            save_checkpoint()
    progress.close()

    # ---- save the trained model: the plain ResNet's weights, without the DDP wrapper
    accelerator.wait_for_everyone()
    accelerator.save_model(model, output_dir)
    accelerator.end_training()  # finishes the trackers and ends the process group
    accelerator.print(f"model saved in {output_dir}/model.safetensors")


if __name__ == "__main__":
    try:
        fire.Fire(main)
    except FlagError as err:
        sys.exit(f"error: {err}")
