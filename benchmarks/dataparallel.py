#!/usr/bin/env python
"""torch.nn.DataParallel baseline: ONE process drives N GPUs, for the DP vs DDP comparison of the
scaling report.

    python benchmarks/dataparallel.py --gpus 2 --batch_size 512 --steps 30
    python benchmarks/scaling.py run --setups gpu:1,gpu:2,dp:2      # DDP (the recipe) and DP side by side

DataParallel, every step: copy the weights from GPU 0 to the others, split the batch, run the
replicas in threads of this one Python process, gather the outputs on GPU 0, and sum the gradients
back there. DDP instead runs one process per GPU and all-reduces gradients during the backward pass.
Same model (the recipe's CIFAR-stem ResNet18), optimizer (SGD nesterov, label smoothing 0.1),
precision (autocast), channels_last and device data path as recipes/cifar.py, and the same global
batch, so the two rows of the report differ in the parallelism only. Without GPUs DataParallel just
calls the model on the CPU (useful to check this script, not to measure anything).

Writes results.json and metrics.jsonl (perf/step_seconds per step) in the recipes' format, plus
`devices` and `parallelism`, so `scaling.py report` reads the run like any recipe run.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import fire
import torch
import torch.nn as nn
from bench import load_cifar_recipe

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


def main(
    gpus: int | None = None,
    batch_size: int = 512,
    steps: int = 30,
    images: int | None = None,
    precision: str = "bf16",
    arch: str = "resnet18",
    channels_last: bool = True,
    seed: int = 42,
    output_dir: str = "outputs/dataparallel",
):
    """Train the CIFAR recipe's ResNet with nn.DataParallel over GPUS GPUs and write results.json.

    Args:
        gpus: GPUs to drive from this one process (0..gpus-1); default all visible.
        batch_size: GLOBAL batch per step, split across the GPUs by DataParallel.
        steps: optimizer steps; the first is left out of the throughput (start-up, cuDNN
            autotuning).
        images: generated CIFAR-shaped training images; default enough for every step without
            repeating.
        precision: bf16, fp16 or no (fp32), as autocast around the forward pass.
        arch: resnet18, resnet34 or resnet50.
        channels_last: NHWC memory layout, as the recipe uses by default.
        seed: data and weight seed.
        output_dir: where results.json and metrics.jsonl go.
    """
    if precision not in DTYPES:
        sys.exit(f"error: unknown --precision {precision!r}; choose bf16, fp16 or no")
    available = torch.cuda.device_count()
    gpus = available if gpus is None else gpus
    if gpus > available:
        sys.exit(f"error: --gpus {gpus} but {available} GPU(s) are visible")
    if gpus and batch_size % gpus:
        sys.exit(f"error: --batch_size {batch_size} does not split evenly over {gpus} GPUs")
    if steps < 2:
        sys.exit("error: --steps must be at least 2 (the first step is left out of the throughput)")
    device = torch.device("cuda:0" if gpus else "cpu")
    torch.manual_seed(seed)
    recipe = load_cifar_recipe()
    x, y = recipe.synthetic_images(images or batch_size * steps, num_classes=10, seed=seed)
    loader = recipe.DeviceImageLoader(
        x, y, batch_size, device, train=True, mean=recipe.MEAN, std=recipe.STD, seed=seed
    )
    net = recipe.build_model(arch, num_classes=10).to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    parameters = sum(p.numel() for p in net.parameters())
    parallel = nn.DataParallel(net, device_ids=list(range(gpus)) or None)
    optimizer = torch.optim.SGD(
        net.parameters(), lr=0.1 * batch_size / 128, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    dtype = DTYPES[precision]

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    durations, step = [], 0
    started = time.perf_counter()
    with (out / "metrics.jsonl").open("w") as metrics:
        while step < steps:
            for images_batch, labels in loader:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # a benchmark: each step timed to its end
                begin = time.perf_counter()
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    loss = criterion(parallel(images_batch), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                durations.append(time.perf_counter() - begin)
                step += 1
                metrics.write(
                    json.dumps({"step": step, "train/loss": loss.item(), "perf/step_seconds": durations[-1]})
                    + "\n"
                )
                if step == steps:
                    break
    measured = durations[1:]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {
        "recipe": "dataparallel",
        "parallelism": "DataParallel",
        "model": arch,
        "world_size": 1,
        "num_machines": 1,
        "devices": max(gpus, 1),
        "device": name if device.type == "cpu" else f"{device} ({name})",
        "mixed_precision": precision,
        "global_batch_size": batch_size,
        "per_process_batch_size": batch_size // max(gpus, 1),
        "trainable_parameters": parameters,
        "steps": step,
        "wall_seconds": time.perf_counter() - started,
        "train_samples_per_second": batch_size * len(measured) / sum(measured),
        "median_step_seconds": statistics.median(measured),
        "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "torch_version": torch.__version__,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"DataParallel over {max(gpus, 1)} device(s) ({name}): {results['train_samples_per_second']:.1f} "
        f"samples/s, median step {results['median_step_seconds'] * 1e3:.1f} ms; saved {out / 'results.json'}"
    )


if __name__ == "__main__":
    fire.Fire(main)
