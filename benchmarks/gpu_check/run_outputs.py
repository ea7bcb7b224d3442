"""What a step reads back from a run's folder (results.json, metrics.jsonl, the last lines of a log,
what its time was made of), and the weights it removes from there once read."""

import json
import shutil
from pathlib import Path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def logged(run_dir: Path, key: str) -> list[float]:
    """Every value a run logged under `key` in its metrics.jsonl, in order (none when the file is
    missing)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r]


def epoch_seconds(run_dir: Path) -> list[float]:
    return [round(seconds, 3) for seconds in logged(run_dir, "perf/epoch_seconds")]


def key_figures(results: dict, *keys) -> dict:
    keys = keys or (
        "world_size",
        "mixed_precision",
        "global_batch_size",
        "steps",
        "train_samples_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "wall_seconds",
    )
    return {k: results[k] for k in keys if k in results}


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# What a run writes that a measurement does not need once its results.json is read: checkpoints, the
# best model and the weights (a full fine-tune of the 0.5B chat model writes ~10 GB: a checkpoint of
# ~6 GB and two models of ~2 GB).
WEIGHT_FOLDERS = ("checkpoints", "model_best")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
# Folders of a step's inputs (generated data and models), kept: later runs of the step read them.
INPUT_FOLDERS = ("inputs", "data", "datasets-cache", "text-data", "chat-data", "bert", "model")


def discard_weights(folder: Path) -> int:
    """Remove the checkpoints, best models and weight files under FOLDER (a run's or a step's output
    folder), its input folders left alone; the bytes freed. The logs, results.json, metrics.jsonl
    and configs stay."""
    freed = 0
    if not folder.is_dir():
        return 0
    for path in sorted(folder.iterdir()):
        if path.name in INPUT_FOLDERS:
            continue
        if path.is_dir() and path.name in WEIGHT_FOLDERS:
            freed += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_dir() and not path.is_symlink():
            freed += discard_weights(path)
        elif path.is_file() and path.suffix in WEIGHT_SUFFIXES:
            freed += path.stat().st_size
            path.unlink()
    return freed


def measured_parts(seconds: float, results: dict) -> dict:
    """What one run's time was made of, from gpu-check's clock around its process (SECONDS) and the
    run's own
    results.json: launch (the process's time outside the run's own clock: launcher, imports, data
    and model loaded, exit), warmup (the first steps, left out of the throughput: compilation
    included), steps (the rest of training) and other (the run's own time outside training:
    evaluation and saving, or TRL's set-up)."""
    parts = {"seconds": round(seconds, 1)}
    wall, train, warmup = (results.get(k) for k in ("wall_seconds", "train_seconds", "warmup_seconds"))
    if wall:
        parts["launch"] = round(seconds - wall, 1)
    if warmup is not None:
        parts["warmup"] = round(warmup, 1)
    if train is not None:
        parts["steps"] = round(train - (warmup or 0), 1)
        if wall:
            parts["other"] = round(wall - train, 1)
    return parts
