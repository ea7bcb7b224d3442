"""The runtime any recipe may use, in recipes/ or copied into a project of its own.

The recipes keep every Accelerate call (prepare, accumulate, backward, gather_for_metrics, save) in
their own body; this package holds only the plumbing they would otherwise copy: command-line entry,
launch checks (check_launch), tracker set-up, the run's position (RunState), the bookkeeping after
each step (TrainingProgress) and the judge of the best model (BestModel), the steps every recipe
takes the same way (shared_steps: the run's Accelerator, the progress and checkpoint wiring, a
guarded optimizer step, a run's end, an evaluation-only run's results), the mode a run's flags name
(run_mode), a throughput meter, the results.json
writer, the run's pictures (accelerate_recipes.plots: results.png, confusion matrices), atomic
checkpoint folders, sharding set-up, seeded augmentation and the stop-signal / NaN guard. Code one
recipe alone uses lives beside that recipe; the stand-alone tools (doctor, hostfile launcher,
topology) are the recipe_tools package.
"""

import importlib

# Each name is imported from its module on first use, so that `from accelerate_recipes.cli import
# ...` (a script's --help) does not wait for torch to import.
_EXPORTS = {
    **dict.fromkeys(["Checkpoints", "model_to_save"], "checkpoints"),
    **dict.fromkeys(["run", "run_mode"], "cli"),
    **dict.fromkeys(["PREEMPTED_EXIT_CODE", "RecipeError", "explain_load_failure", "first_line"], "errors"),
    **dict.fromkeys(["StepGuard"], "guard"),
    **dict.fromkeys(
        [
            "check_launch",
            "check_process_group",
            "cpu_precision",
            "cpu_threads_and_workers",
            "explain_startup_failure",
            "num_machines",
            "prepare_output_dir",
            "quiet_other_local_processes",
        ],
        "launch",
    ),
    **dict.fromkeys(["BestModel", "RunState", "TrainingProgress"], "loop"),
    **dict.fromkeys(["always_build_attention_masks"], "masks"),
    **dict.fromkeys(["StepMeter"], "meter"),
    **dict.fromkeys(["TrainingFlags"], "flags"),
    **dict.fromkeys(["print_summary", "run_config", "run_facts", "write_results"], "results"),
    **dict.fromkeys(["setup_fsdp"], "sharding"),
    **dict.fromkeys(
        [
            "check_launch_flags",
            "clip_norm",
            "epoch_batches",
            "eval_only_config",
            "eval_only_results",
            "evaluation_accelerator",
            "finish_run",
            "keeps_update",
            "run_length",
            "RunLength",
            "saving_checkpoint",
            "training_accelerator",
            "training_progress",
        ],
        "shared_steps",
    ),
    **dict.fromkeys(["setup_tracker"], "tracking"),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'accelerate_recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"accelerate_recipes.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
