"""The runtime any recipe may use, in recipes/ or copied into a project of its own.

The recipes keep every Accelerate call (prepare, accumulate, backward, gather_for_metrics, save) in their own body;
this package holds only the plumbing they would otherwise copy: command-line entry, launch checks (check_launch),
tracker set-up, the run's position (RunState) and the bookkeeping after each step (TrainLog), a throughput meter, the
results.json writer, the run's pictures (accelerate_recipes.plots: results.png, confusion matrices), atomic checkpoint
folders, sharding set-up, seeded augmentation and the stop-signal / NaN guard. Code one recipe alone uses lives beside that recipe; the stand-alone tools (doctor,
hostfile launcher, topology) are the recipe_tools package.
"""

from accelerate_recipes.checkpoints import Checkpoints
from accelerate_recipes.cli import PREEMPTED_EXIT_CODE, RecipeError, run
from accelerate_recipes.guard import StepGuard
from accelerate_recipes.launch import (
    check_launch,
    check_process_group,
    cpu_precision,
    cpu_threads_and_workers,
    default_num_workers,
    describe_launch,
    explain_startup_failure,
    num_machines,
    per_process_batch_size,
    prepare_output_dir,
)
from accelerate_recipes.loop import RunState, TrainLog
from accelerate_recipes.meter import StepMeter, peak_memory_mb
from accelerate_recipes.results import MetricsLog, print_summary, run_facts, write_results
from accelerate_recipes.sharding import check_accumulation, check_skip_nonfinite, set_gradient_clipping, setup_fsdp
from accelerate_recipes.tracking import TrackerSetup, setup_tracker

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Checkpoints",
    "MetricsLog",
    "RecipeError",
    "RunState",
    "StepGuard",
    "StepMeter",
    "TrackerSetup",
    "TrainLog",
    "check_accumulation",
    "check_launch",
    "check_process_group",
    "check_skip_nonfinite",
    "cpu_precision",
    "cpu_threads_and_workers",
    "default_num_workers",
    "describe_launch",
    "explain_startup_failure",
    "num_machines",
    "peak_memory_mb",
    "per_process_batch_size",
    "prepare_output_dir",
    "print_summary",
    "run",
    "run_facts",
    "set_gradient_clipping",
    "setup_fsdp",
    "setup_tracker",
    "write_results",
]
