"""results.json (one per run, read by tests and tools) and metrics.jsonl (every logged step)."""

import dataclasses
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import accelerate
import torch

from accelerate_recipes.launch import num_machines
from accelerate_recipes.meter import peak_memory_mb

RESULTS_FILE = "results.json"
METRICS_FILE = "metrics.jsonl"


def write_results(output_dir: str | Path, results: dict) -> Path:
    """Write results.json atomically: a reader never sees a half-written file."""
    path = Path(output_dir) / RESULTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


class MetricsLog:
    """Logs to the trackers through Accelerate and appends the same values to
    output_dir/metrics.jsonl.

    The JSON-lines copy needs no tracker to read back; it is written by the main process only.
    """

    def __init__(self, accelerator, output_dir: str | Path):
        self.accelerator = accelerator
        self.path = Path(output_dir) / METRICS_FILE

    def log(self, values: dict, step: int) -> None:
        self.accelerator.log(values, step=step)
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")


def restart_metrics(output_dir: str | Path, resume_step: int | None = None) -> None:
    """Ready output_dir/metrics.jsonl for a run (main process): a new run starts an empty file; a
    resumed one keeps the rows up to the checkpoint's step and drops those logged after it by the
    interrupted run (the resumed run logs those steps again)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.parent.is_dir():
        return  # nothing logged there yet
    kept = []
    if resume_step is not None and path.is_file():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= resume_step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the crash
    path.write_text("".join(kept))


# Flags that say where files go, which mode runs or how to track, not how the model is trained.
NOT_SETTINGS = (
    "output_dir",
    "resume",
    "eval_only",
    "predict",
    "tracker",
    "swanlab_mode",
    "project",
    "run_name",
)


def run_config(recipe: str, args, accelerator, **derived) -> dict:
    """The run's settings, as the tracker, each checkpoint.json and results.json record them: the
    recipe, how it was launched (world size, machines, precision, distributed type, global batch),
    every training flag in `args` (a recipe's flags dataclass), and what the recipe derived from
    them; a derived value wins over the flag of its name (the learning rate the recipe chose, the
    epochs --max_steps makes)."""
    flags = {name: value for name, value in dataclasses.asdict(args).items() if name not in NOT_SETTINGS}
    # Trackers take bool, int, float, str or None (accelerate's store_init_configuration); a list
    # flag (--hsv 0.1,0.2) is recorded as typed.
    flags = {name: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v for name, v in flags.items()}
    flags.pop("batch_size", None)  # recorded as global_batch_size
    launch = dict(
        recipe=recipe,
        world_size=accelerator.num_processes,
        num_machines=num_machines(accelerator.num_processes),
        mixed_precision=accelerator.mixed_precision,
        distributed_type=accelerator.distributed_type.value,
        global_batch_size=args.batch_size,
    )
    # the precision accelerate applies, not the flag's None
    return {"recipe": recipe, **flags, **launch, **derived}


def run_facts(accelerator, meter, samples_seen: int) -> dict:
    """The results.json entries every recipe shares, as a dict to merge into the recipe's own
    results:

    - train_seconds, train_samples_per_second (global), median_step_seconds: from `meter` (a
      StepMeter);
    - samples_seen_per_process: `samples_seen` of every process, gathered, in rank order;
    - peak_memory_mb (the largest of all processes) and peak_memory_kind ("cuda_max_allocated" or
      "host_max_rss");
    - device, torch_version, accelerate_version, and finished_at (UTC, ISO 8601).

    Collective: every process must call it.
    """
    device = accelerator.device
    samples_per_process = accelerator.gather(torch.tensor([samples_seen], device=device)).tolist()
    memory_mb, memory_kind = peak_memory_mb(device)
    peak_memory = (
        accelerator.gather(torch.tensor([memory_mb], device=device, dtype=torch.float64)).max().item()
    )
    return dict(
        train_seconds=meter.train_seconds,
        train_samples_per_second=meter.samples_per_second,
        median_step_seconds=meter.median_step_seconds,
        samples_seen_per_process=samples_per_process,
        peak_memory_mb=peak_memory,
        peak_memory_kind=memory_kind,
        device=str(device),
        torch_version=torch.__version__,
        accelerate_version=accelerate.__version__,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_summary(results: dict, keys: list[str], title: str = "summary") -> None:
    """A short two-column table of the chosen results."""
    rows = [(k, _fmt(results[k])) for k in keys if k in results]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    print(f"\n{title}\n{line}")
    for key, value in rows:
        print(f"{key:<{width}} | {value}")
    print(line)
