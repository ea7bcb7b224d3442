"""What a step reads back from a run's folder: results.json, metrics.jsonl, the last lines of a log."""

import json
from pathlib import Path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def logged(run_dir: Path, key: str) -> list[float]:
    """Every value a run logged under `key` in its metrics.jsonl, in order (none when the file is missing)."""
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
