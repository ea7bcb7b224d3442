#!/usr/bin/env python
"""Train ResNet18 on CIFAR-10 with Hugging Face Accelerate: one file to copy, the same on 1 GPU, N
GPUs and N nodes.

    python cifar.py --epochs 5                     # one process (a GPU when there is one)
    accelerate launch --num_processes 2 cifar.py   # 2 GPUs; or --config_file your_config.yaml
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 cifar.py  # no GPU: gloo

It reads top to bottom (config -> data -> model -> prepare -> loop -> eval -> save); `--batch_size`
is the GLOBAL batch, so the same flags train alike on any number of processes. Needs accelerate,
torch, torchvision, fire (swanlab to track). The full recipe, recipes/cifar.py, trains exactly like
this file and adds other data (CIFAR-100, generated data, image folders), --pretrained, a loader
that keeps the images in GPU memory, presets, torch.compile, launch checks (e.g. a CPU --multi_gpu
launch that would train each process alone), a NaN and stop-signal guard, `--resume auto`, the best
model and early stopping, results.json, metrics.jsonl and plots, --eval_only and --predict.
"""

import math
import os
import shutil
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


class UnverifiedCIFAR10(torchvision.datasets.CIFAR10):
    """CIFAR-10 without the MD5 check (--verify_data False): a file whose MD5 is None need only
    exist."""

    train_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.test_list]
    meta = {**torchvision.datasets.CIFAR10.meta, "md5": None}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor: linear from 0 to 1 over the warm-up steps, then a cosine down to 0 at
    the last step."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, loader, accelerator) -> tuple[float, int]:
    """Top-1 accuracy on the whole test set, and the images seen: each once on any world size."""
    model.eval()
    correct, seen = torch.zeros((), dtype=torch.long, device=accelerator.device), 0
    for images, labels in loader:
        # gather_for_metrics drops the images the sampler repeated to even out the shares
        predictions, labels = accelerator.gather_for_metrics((model(images).argmax(dim=-1), labels))
        correct += (predictions == labels).sum()
        seen += len(labels)
    model.train()
    return correct.item() / max(seen, 1), seen


def tracker_init_kwargs(tracker: str, output_dir: str, run_name: str) -> dict:
    """init_trackers' kwargs. SwanLab: $SWANLAB_MODE, else online if logged in, else offline."""
    if tracker != "swanlab":
        return {}
    netrc = Path.home() / ".swanlab" / ".netrc"  # written by `swanlab login`
    logged_in = os.environ.get("SWANLAB_API_KEY") or netrc.is_file()
    mode = os.environ.get("SWANLAB_MODE") or ("online" if logged_in else "offline")
    log_dir = os.environ.get("SWANLAB_LOG_DIR") or str(Path(output_dir, "swanlog").resolve())
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
    """Train ResNet18 (with a CIFAR stem) on CIFAR-10; the model goes to
    output_dir/model.safetensors.

    Args:
        data_dir: where CIFAR-10 is, or is downloaded to (cifar-10-batches-py/ inside it).
        download: download CIFAR-10 into data_dir when it is not there.
        verify_data: check the files against the release's MD5 sums; turn off for a re-packed or
            smaller copy.
        augment: random crop (4-pixel zero padding) and horizontal flip of training images.
        batch_size: GLOBAL batch per optimizer step; each process loads batch_size / (processes x
            accumulation steps).
        epochs: passes over the training set (ignored when max_steps is set).
        max_steps: stop after this many optimizer steps.
        lr: peak learning rate of nesterov SGD; default 0.1 x batch_size / 128 (linear scaling with
            the global batch).
        momentum: SGD momentum.
        weight_decay: weight decay on conv kernels and weight matrices (not on BatchNorm weights or
            biases).
        label_smoothing: label smoothing of the cross-entropy loss.
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up from 0;
            then a cosine to 0.
        gradient_accumulation_steps: micro-batches whose gradients are summed before each optimizer
            step.
        max_grad_norm: clip the gradients' global L2 norm to this before each update; 0: no
            clipping.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        channels_last: NHWC memory layout, faster convolutions on GPUs with tensor cores.
        num_workers: DataLoader workers per process; default 4 on a GPU, 0 on the CPU (they would
            take its cores).
        seed: seed of the weights, the data order and the augmentation.
        log_every: print and log the training loss every N optimizer steps (and at the first and the
            last).
        checkpoint_every: save_state every N steps and at epoch ends (0: epoch ends only); the 2
            newest are kept.
        resume: a checkpoint folder (output_dir/checkpoints/step_N) to continue from, at the batch
            after it.
        tracker: swanlab (offline without a login), none, or another tracker Accelerate knows
            (tensorboard, ...).
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
        # shuffle: seed+epoch
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
        step_scheduler_with_optimizer=False,  # stepped below once per update, not once per process
    )
    world, accumulation = accelerator.num_processes, gradient_accumulation_steps
    shares = world * accumulation  # global batch = processes x micro-batches x per-process batch
    if batch_size % shares:
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {shares}")
    per_process = batch_size // shares
    share = f"{per_process} images per process and micro-batch"
    accelerator.print(f"global batch {batch_size}: {share}")
    lr = lr if lr is not None else 0.1 * batch_size / 128  # from the global batch: any GPU count
    set_seed(seed)
    torch.backends.cudnn.benchmark = True  # every training batch has the same shape

    # ---- data
    normalize = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
    crop_and_flip = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    augmentation = crop_and_flip if augment else []
    train_tf, test_tf = transforms.Compose(augmentation + normalize), transforms.Compose(normalize)
    cifar10 = torchvision.datasets.CIFAR10 if verify_data else UnverifiedCIFAR10
    with accelerator.local_main_process_first():  # one process per node downloads first
        fetch = download and accelerator.is_local_main_process
        train_set = cifar10(str(data_dir), train=True, transform=train_tf, download=fetch)
        test_set = cifar10(str(data_dir), train=False, transform=test_tf)
    workers = num_workers if num_workers is not None else (4 if torch.cuda.is_available() else 0)
    loader_args = dict(num_workers=workers, pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(
        train_set, batch_size=per_process, shuffle=True, drop_last=True, **loader_args
    )
    test_loader = DataLoader(test_set, batch_size=per_process * accumulation, **loader_args)

    # ---- model and optimizer
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    # CIFAR stem: ImageNet's 7x7 stride-2 conv and max-pool would shrink a 32x32 image to 8x8 before
    # the first block.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model = model.to(memory_format=torch.channels_last) if channels_last else model
    decay = [p for p in model.parameters() if p.ndim > 1]  # conv kernels, the classifier's matrix
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # BatchNorm weights and biases
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    # ---- prepare: DDP wrapping, loaders sharded across processes, device placement, autocast
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    steps_per_epoch = math.ceil(len(train_loader) / accumulation)  # len: this process's batches
    if steps_per_epoch == 0:
        cause = f"fewer training images than one --batch_size {batch_size}"
        raise SystemExit(f"error: {cause}; lower it")
    total_steps = max_steps or epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(warmup_ratio * total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps)
    )
    scheduler = accelerator.prepare(schedule)  # saved and restored with the checkpoints

    step = 0
    if resume:  # weights, optimizer, schedule and RNG states; the step is the folder's name
        accelerator.load_state(resume)
        step = int(Path(resume).name.removeprefix("step_"))
    init_kwargs = tracker_init_kwargs(tracker, output_dir, "cifar-starter")
    accelerator.init_trackers(project, flags, init_kwargs)

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop; the loss is summed on the device until logged
    progress = tqdm(total=total_steps, initial=step, desc="train")  # shown by the main process only
    running_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, num_epochs):
        train_loader.set_epoch(epoch)  # this epoch's shuffle: seed + epoch
        done = (step - epoch * steps_per_epoch) * accumulation  # batches a resumed epoch has had
        batches = accelerator.skip_first_batches(train_loader, done) if done else train_loader
        for images, labels in batches:
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with accelerator.accumulate(model):  # all-reduce at the step's last micro-batch only
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # the step's last micro-batch: update the weights
                    if max_grad_norm:
                        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            running_loss += loss.detach()
            micro_batches += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            progress.update(1)
            if step % log_every == 0 or step in (1, total_steps):
                # since the last log
                mean_loss = accelerator.reduce(running_loss / micro_batches, "mean").item()
                lr_now = scheduler.get_last_lr()[0]
                accelerator.print(f"step {step}/{total_steps} loss {mean_loss:.7f} lr {lr_now:.7g}")
                accelerator.log({"train/loss": mean_loss, "train/lr": lr_now}, step=step)
                running_loss, micro_batches = torch.zeros_like(running_loss), 0
            ends_epoch = step % steps_per_epoch == 0 or step >= total_steps  # then saved below
            if checkpoint_every and step % checkpoint_every == 0 and not ends_epoch:
                save_checkpoint()
            if step >= total_steps:
                break

        # ---- evaluation at each epoch's end, on the whole test set, then a checkpoint
        accuracy, seen = evaluate(model, test_loader, accelerator)
        accelerator.print(
            f"epoch {epoch + 1}/{num_epochs}: eval accuracy {accuracy:.4f} on {seen} test images"
        )
        accelerator.log({"eval/accuracy": accuracy}, step=step)
        save_checkpoint()
    progress.close()

    # ---- save the trained model: the plain ResNet's weights, without the DDP wrapper
    accelerator.wait_for_everyone()
    accelerator.save_model(model, output_dir)
    accelerator.end_training()  # finishes the trackers and ends the process group
    accelerator.print(f"model saved in {output_dir}/model.safetensors")


if __name__ == "__main__":
    fire.Fire(main)
