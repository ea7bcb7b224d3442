#!/usr/bin/env python
"""Detection benchmark: the nano detector trained on a fixed generated set, reporting mAP50-95, images/s and wall time.

    make bench-detect                                   # CPU-sized: 256 px, a few minutes on 2 cores
    python benchmarks/detect.py --image_size 640 --train_images 4096 --epochs 30 --batch_size 64   # a GPU

The set (generated shapes, seed 0) is the same on every machine, so the figures compare machines and settings; they
say nothing about accuracy on real photographs. Writes outputs/bench-detect/bench_detect.json.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fire
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "detect" / "train.py"


def main(
    train_images: int = 256,
    image_size: int = 256,
    epochs: int = 10,
    batch_size: int = 16,
    size: str = "n",
    precision: str | None = None,
    output_dir: str = "outputs/bench-detect",
    data_dir: str = "data",
):
    """Train the detector on generated shapes for a fixed number of epochs and print its figures.

    Args:
        train_images: generated training images (validation gets a quarter as many); fixed seed 0.
        image_size: network input side.
        epochs: training epochs (the budget: fixed work, so wall time measures the machine).
        batch_size: global batch.
        size: model size, n or s.
        precision: no, bf16 or fp16; default bf16 on a GPU, no on a CPU.
        output_dir: where the run and bench_detect.json go.
        data_dir: where the generated set is written (reused when present).
    """
    precision = precision or ("bf16" if torch.cuda.is_available() else "no")
    out = Path(output_dir)
    shutil.rmtree(out, ignore_errors=True)  # fresh: the recipe will not start over an earlier run's checkpoints
    command = [
        sys.executable,
        str(TRAIN),
        "--data",
        "synthetic",
        "--data_dir",
        data_dir,
        "--synthetic_size",
        str(train_images),
        "--image_size",
        str(image_size),
        "--size",
        size,
        "--epochs",
        str(epochs),
        "--batch_size",
        str(batch_size),
        "--mixed_precision",
        precision,
        "--eval_every",
        str(epochs),
        "--tracker",
        "none",
        "--output_dir",
        str(out),
        "--seed",
        "0",
    ]
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(command)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"error: the detection recipe failed (exit {proc.returncode}); see its output above")
    results = json.loads((out / "results.json").read_text())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    report = dict(
        device=device,
        torch_version=torch.__version__,
        command=" ".join(command[1:]),
        map50=results["eval_map50"],
        map50_95=results["eval_map50_95"],
        train_images_per_second=results["train_samples_per_second"],
        wall_seconds=wall,
        parameters=results["trainable_parameters"],
        gflops_at_640=results["gflops_at_640"],
    )
    (out / "bench_detect.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\ndetection benchmark on {device}: yolo-{size}, {train_images} generated images at {image_size} px, "
        f"{epochs} epochs, batch {batch_size}, {precision}"
    )
    print(
        f"  mAP50-95 {report['map50_95']:.3f}   mAP50 {report['map50']:.3f}   "
        f"{report['train_images_per_second']:.1f} train images/s   wall {wall:.0f} s"
    )
    print(f"saved {out / 'bench_detect.json'}")


if __name__ == "__main__":
    fire.Fire(main)
