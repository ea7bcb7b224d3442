#!/usr/bin/env python
"""Detection benchmark: our nano detector beside Ultralytics' YOLOv8n on the same data and settings,
from scratch, or both fine-tuned from the same Ultralytics best.pt (--transfer).

    make bench-detect                                   # CPU-sized: generated shapes at 256 px, both tools
    python benchmarks/detect.py --data path/to/data.yaml --image_size 640 --epochs 30 --batch_size 8
    python benchmarks/detect.py --tools ours            # our detector alone (no Ultralytics needed)
    make detect-data bench-detect ARGS="--transfer"     # both fine-tuned from one best.pt (tree crowns)
    python benchmarks/detect.py --image_size 640 --train_images 4096 --epochs 30 --batch_size 64   # a GPU

The same YOLO-format data, image size, epochs, global batch and seed go to both; each tool keeps its
other defaults (ours: AdamW lr 0.002; Ultralytics: optimizer "auto", its nominal batch of 64 by
accumulation; both close mosaic for the last 10 epochs). Both models are scored by ONE evaluator,
the recipe's COCO evaluation (torchmetrics with pycocotools, conf 0.001, at most 300 boxes an image,
NMS IoU 0.7) of each one's predictions on the same validation images, and each tool's own figure
stands beside it. Training images/s are the set's images x epochs over the seconds spent in training
epochs (evaluation left out); wall time is the whole process, start-up and evaluation included; peak
memory the process's (host max RSS on a CPU, allocated GPU memory for ours on a GPU). Ultralytics
runs offline in a process of its own (benchmarks/detect_ultralytics.py), from the `detect-compare`
extra. Writes outputs/bench-detect/results.json and prints a summary table.

--transfer is the fine-tune an Ultralytics user makes, from the same start for both tools:
Ultralytics trains a YOLOv8n (yolov8n.yaml) on --pretrain_data (default the generated shapes of
--train_images images) for --pretrain_epochs and saves its best.pt; then both tools fine-tune from
that one file on --data (default the real tree crowns of `make detect-data`, another set with
another class count) at equal epochs, image size, batch and seed: ours with `--init_weights best.pt`
(converted in memory), Ultralytics with `model=best.pt`. Both are scored by the one evaluator, with
training images/s beside each.

The generated shapes (seed 0) are the same on every machine and easy, so their figures compare
tools, machines and settings, not detectors on photographs.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fire
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "detect" / "train.py"
ULTRALYTICS = REPO / "benchmarks" / "detect_ultralytics.py"
TREE_CROWNS = Path("data/tree-crowns/data.yaml")  # make detect-data: --transfer's default target
sys.path.insert(0, str(REPO / "recipes" / "detect"))


def generated_set(data_dir: str, train_images: int, image_size: int) -> Path:
    """The generated shapes set of the benchmark (seed 0), written once under data_dir."""
    from synthetic_shapes import write_synthetic_dataset

    folder = Path(data_dir) / f"bench-shapes-{train_images}-{image_size}px"
    if not (folder / "data.yaml").is_file():
        num_val = max(8, train_images // 4)
        write_synthetic_dataset(folder, num_train=train_images, num_val=num_val, image_size=image_size)
    return folder / "data.yaml"


def run_ours(
    data: Path,
    out: Path,
    image_size: int,
    epochs: int,
    batch_size: int,
    seed: int,
    precision: str,
    *extra: str,
) -> dict:
    command = [
        sys.executable,
        str(TRAIN),
        "--data",
        str(data),
        "--image_size",
        str(image_size),
        "--size",
        "n",
        *extra,
    ]
    command += ["--epochs", str(epochs), "--batch_size", str(batch_size), "--seed", str(seed)]
    command += ["--mixed_precision", precision, "--eval_every", str(epochs), "--tracker", "none"]
    command += ["--checkpoint_every", "0", "--output_dir", str(out)]
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    # an Ultralytics .pt as --init_weights imports ultralytics: offline, its settings beside the run
    proc = subprocess.run(
        command, env=dict(os.environ, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(out / "settings"))
    )
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"error: the detection recipe failed (exit {proc.returncode}); see its output above")
    results = json.loads((out / "results.json").read_text())
    return dict(
        tool="accelerate-recipes",
        model="yolo-n",
        # the recipe's evaluator is the shared one: its own figure is that one
        own_map50=results["eval_map50"],
        own_map50_95=results["eval_map50_95"],
        map50=results["eval_map50"],
        map50_95=results["eval_map50_95"],
        train_images=results["train_size"],
        epochs=results["epochs"],
        train_seconds=results["train_seconds"],
        train_images_per_second=results["train_size"] * results["epochs"] / results["train_seconds"],
        wall_seconds=wall,
        peak_memory_mb=results["peak_memory_mb"],
        parameters=results["trainable_parameters"],
        gflops_at_640=results["gflops_at_640"],
        command=" ".join(command[1:]),
    )


def run_ultralytics(
    data: Path,
    out: Path,
    image_size: int,
    epochs: int,
    batch_size: int,
    seed: int,
    model: str = "yolov8n.yaml",
) -> dict:
    command = [sys.executable, str(ULTRALYTICS), "--data", str(data), "--out", str(out), "--model", model]
    command += ["--image_size", str(image_size), "--epochs", str(epochs), "--batch_size", str(batch_size)]
    command += ["--seed", str(seed)]
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(command, env=dict(os.environ, YOLO_OFFLINE="1"))
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(
            f"error: the Ultralytics run failed (exit {proc.returncode}); see its output above (it needs the "
            "detect-compare extra: pip install -e '.[detect-compare]')"
        )
    report = json.loads((out / "ultralytics.json").read_text())
    return dict(report, wall_seconds=wall, command=" ".join(command[1:]))


def main(
    data: str | None = None,
    train_images: int = 256,
    image_size: int = 256,
    epochs: int = 10,
    batch_size: int = 16,
    seed: int = 0,
    tools: str = "ours,ultralytics",
    precision: str | None = None,
    output_dir: str = "outputs/bench-detect",
    data_dir: str = "data",
    transfer: bool = False,
    pretrain_data: str | None = None,
    pretrain_epochs: int | None = None,
    threads: int | None = None,
):
    """Train our detector and Ultralytics' YOLOv8n on the same data for a fixed number of epochs and
    compare them.

    Args:
        data: a data.yaml (YOLO format); default the generated shapes set (seed 0) of train_images
            images.
        train_images: generated training images (validation gets a quarter as many); with no --data.
        image_size: network input side, for both.
        epochs: training epochs, for both (the budget: fixed work).
        batch_size: global batch, for both.
        seed: seed, for both.
        tools: ours, ultralytics, or both (comma-separated).
        precision: ours' --mixed_precision: no, bf16 or fp16; default bf16 on a GPU, no on a CPU
            (Ultralytics runs fp32 on a CPU and its AMP on a GPU).
        output_dir: where the runs, results.json and the table go.
        data_dir: where the generated set is written (reused when present).
        transfer: the fine-tune benchmark instead: Ultralytics trains YOLOv8n on --pretrain_data and
            saves best.pt, then both tools fine-tune from that file on --data (default
            data/tree-crowns/data.yaml).
        pretrain_data: with --transfer, the data.yaml Ultralytics' start is trained on; default the
            generated shapes of train_images images.
        pretrain_epochs: with --transfer, the epochs of that start; default --epochs.
        threads: torch threads for both tools (OMP_NUM_THREADS); default each tool's own choice. On
            a CPU shared with other work, 1 keeps both from stalling on threads that wait for a
            core.
    """
    chosen = [t.strip() for t in (tools.split(",") if isinstance(tools, str) else tools)]
    unknown = set(chosen) - {"ours", "ultralytics"}
    if unknown:
        sys.exit(f"error: unknown --tools {', '.join(sorted(unknown))}; choose ours, ultralytics or both")
    precision = precision or ("bf16" if torch.cuda.is_available() else "no")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # both tools' processes start with it
    out = Path(output_dir)
    # fresh: the recipe will not start over an earlier run's checkpoints
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rows, start = [], None
    if transfer:
        if set(chosen) != {"ours", "ultralytics"}:
            sys.exit("error: --transfer compares both tools from one start; leave --tools out")
        data_yaml = Path(data) if data else TREE_CROWNS
        if not data_yaml.is_file():
            sys.exit(
                f"error: {data_yaml} not found; write the tree crowns with make detect-data, or give --data"
            )
        pretrain_yaml = (
            Path(pretrain_data) if pretrain_data else generated_set(data_dir, train_images, image_size)
        )
        pretrained = run_ultralytics(
            pretrain_yaml, out / "start", image_size, pretrain_epochs or epochs, batch_size, seed
        )
        start = dict(pretrained, data=str(pretrain_yaml))
        best = start["best_pt"]
        from_best = ("--init_weights", best)
        rows.append(
            run_ours(data_yaml, out / "ours", image_size, epochs, batch_size, seed, precision, *from_best)
        )
        rows.append(
            run_ultralytics(data_yaml, out / "ultralytics", image_size, epochs, batch_size, seed, best)
        )
    else:
        data_yaml = Path(data) if data else generated_set(data_dir, train_images, image_size)
        if "ours" in chosen:
            rows.append(run_ours(data_yaml, out / "ours", image_size, epochs, batch_size, seed, precision))
        if "ultralytics" in chosen:
            rows.append(run_ultralytics(data_yaml, out / "ultralytics", image_size, epochs, batch_size, seed))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    report = dict(
        device=device,
        torch_version=torch.__version__,
        data=str(data_yaml),
        image_size=image_size,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        threads=threads,
        evaluator="accelerate-recipes coco_map (pycocotools), conf 0.001, every class above it, NMS IoU 0.7, "
        "300 boxes an image",
        runs=rows,
        # with --transfer: Ultralytics' run that wrote the best.pt both fine-tuned from
        start=start,
    )
    if len(rows) == 2:
        ours, theirs = rows
        report["ratios"] = dict(
            # a ratio to a figure near zero says nothing: none under 0.005
            map50_95=ours["map50_95"] / theirs["map50_95"] if theirs["map50_95"] >= 0.005 else None,
            train_images_per_second=ours["train_images_per_second"] / theirs["train_images_per_second"],
            wall_seconds=ours["wall_seconds"] / theirs["wall_seconds"],
        )
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\ndetection benchmark on {device}: {data_yaml}, {image_size} px, {epochs} epochs, batch "
        f"{batch_size}"
    )
    print("| tool | mAP50-95 | mAP50 | its own mAP50-95 / mAP50 | train images/s | wall s | peak MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tool']} {r['model']} | {r['map50_95']:.3f} | {r['map50']:.3f} | {r['own_map50_95']:.3f} "
            f"/ {r['own_map50']:.3f} | {r['train_images_per_second']:.1f} | {r['wall_seconds']:.0f} | "
            f"{r['peak_memory_mb']:.0f} |"
        )
    if "ratios" in report:
        ratios = report["ratios"]
        ratio = (
            f"{ratios['map50_95']:.2f}x"
            if ratios["map50_95"] is not None
            else "n/a (Ultralytics' under 0.005)"
        )
        print(
            f"ours / Ultralytics: mAP50-95 {ratio}, training images/s "
            f"{ratios['train_images_per_second']:.2f}x, wall time {ratios['wall_seconds']:.2f}x"
        )
    if start is not None:
        print(
            f"both fine-tuned from {start['best_pt']} (Ultralytics' YOLOv8n, {start['epochs']} epochs on "
            f"{start['data']}: mAP50-95 {start['map50_95']:.3f} there by the same evaluator)"
        )
    print(f"saved {out / 'results.json'}")


if __name__ == "__main__":
    fire.Fire(main)
