"""The steps every recipe takes the same way, written once: the Accelerator of a run and the launch
checks of its flags, the progress and checkpoint wiring of the training loop, one optimizer step
under the non-finite guard, the batches of an epoch, a run's end (finish_run) and what a run that
only evaluates records.

The Accelerate calls stay in the recipe's own body, around these helpers:

    accelerator = training_accelerator(args, tracking)
    per_process = check_launch_flags(accelerator, args)
    ...
    length = run_length(args, steps_per_epoch, len(train_loader), f"{len(train_set)} images")
    ...
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    for batch in epoch_batches(accelerator, train_loader, state.epoch, state.batches_done):
        with accelerator.accumulate(model):
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                if keeps_update(progress, grad_norm):
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if accelerator.sync_gradients and progress.step_done(scheduler):
            with saving_checkpoint(checkpoints, progress, config) as folder:
                accelerator.save_state(folder)
"""

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import accelerate
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)

from accelerate_recipes.errors import RecipeError
from accelerate_recipes.launch import check_launch, explain_startup_failure, num_machines
from accelerate_recipes.loop import BestModel, RunState, TrainingProgress
from accelerate_recipes.meter import StepMeter
from accelerate_recipes.results import run_facts, write_results


def _accelerator(args, **options) -> accelerate.Accelerator:
    """The Accelerator of any mode, with `options`: a process group that does not form within
    --dist_timeout stops with one line that says why (explain_startup_failure)."""
    with explain_startup_failure(args.dist_timeout):
        # Looked up at the call, not at import: a launcher's stand-in for it is the one built.
        return accelerate.Accelerator(
            mixed_precision=args.mixed_precision,
            # The shuffle order then depends on the seed and epoch only, not on the number of
            # processes. non_blocking: batches are copied from pinned memory while the GPU still
            # works on the previous step.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
            # How long a process waits for the others, at start-up and in every collective.
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout))],
            **options,
        )


def training_accelerator(args, tracking, *, steps_by_count: bool = False, **options):
    """The Accelerator of a training run: --mixed_precision, --gradient_accumulation_steps, the
    tracker of `tracking` (setup_tracker's) logging into --output_dir, the seeded shuffle and
    --dist_timeout; the recipe steps its schedule itself, once per optimizer step. With
    `steps_by_count` an optimizer step ends after that many micro-batches, never at a loader's end
    (for a recipe that reads a step's micro-batches before its first forward pass). `options` go to
    Accelerator as they are."""
    accumulation = args.gradient_accumulation_steps
    if steps_by_count:
        plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
        options.update(gradient_accumulation_plugin=plugin)
    else:
        options.update(gradient_accumulation_steps=accumulation)
    return _accelerator(
        args,
        log_with=tracking.log_with or None,
        project_dir=str(Path(args.output_dir)),
        step_scheduler_with_optimizer=False,
        **options,
    )


def evaluation_accelerator(args, *, accumulation_steps: int = 1, tracking=None):
    """The Accelerator of a run that trains nothing (--eval_only, --plan_only): --mixed_precision
    and --dist_timeout; `accumulation_steps` is what check_launch (and a DeepSpeed config) compare
    the flag with; with `tracking` (setup_tracker's) its tracker logs into --output_dir."""
    options = {}
    if tracking is not None:
        options.update(log_with=tracking.log_with or None, project_dir=str(Path(args.output_dir)))
    return _accelerator(args, gradient_accumulation_steps=accumulation_steps, **options)


def check_launch_flags(accelerator, args) -> int:
    """check_launch with the run's flags (--batch_size, --gradient_accumulation_steps,
    --skip_nonfinite_steps, --max_grad_norm): every start-up check; returns the per-process
    batch."""
    return check_launch(
        accelerator,
        args.batch_size,
        args.gradient_accumulation_steps,
        args.skip_nonfinite_steps,
        args.max_grad_norm,
    )


@dataclass(frozen=True)
class RunLength:
    """How long a run trains: optimizer steps an epoch and in all, epochs, and the batches a
    process takes an epoch (accumulation micro-batches included)."""

    steps_per_epoch: int
    batches_per_epoch: int
    total_steps: int
    epochs: int


def run_length(args, steps_per_epoch: int, batches_per_epoch: int, training_set: str) -> RunLength:
    """--max_steps optimizer steps, else --epochs epochs of `steps_per_epoch`; the last epoch may be
    cut short. `training_set` names the data for the error when it holds no global batch ("640
    images")."""
    if steps_per_epoch == 0:
        raise RecipeError(
            f"the training set ({training_set}) is smaller than one global batch "
            f"({args.batch_size}); lower --batch_size or use more data"
        )
    total_steps = args.max_steps if args.max_steps else args.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    return RunLength(steps_per_epoch, batches_per_epoch, total_steps, epochs)


def training_progress(
    accelerator, args, state: RunState, best: BestModel, resumed_from, length: RunLength
) -> TrainingProgress:
    """The run's TrainingProgress and its StepGuard (`.guard`): it logs into --output_dir every
    --log_every steps, asks for a checkpoint every --checkpoint_every steps, drops non-finite
    updates with --skip_nonfinite_steps and counts --batch_size samples a step. `resumed_from` is
    the checkpoint the run goes on from (None: a fresh start)."""
    return TrainingProgress(
        accelerator,
        state,
        Path(args.output_dir),
        total_steps=length.total_steps,
        steps_per_epoch=length.steps_per_epoch,
        batches_per_epoch=length.batches_per_epoch,
        global_batch_size=args.batch_size,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        skip_nonfinite=args.skip_nonfinite_steps,
        resumed_from=resumed_from,
        best=best,
    )


def epoch_batches(accelerator, loader, epoch: int, skip: int):
    """The batches of epoch `epoch`: the loader's shuffle set for that epoch (it depends on the seed
    and the epoch only) and, where a resumed run goes on inside the epoch, its first `skip` batches
    left out (the interrupted run trained on them). A loader that shards itself and has a
    skip_first_batches of its own skips by that; any other by accelerate's."""
    loader.set_epoch(epoch)
    if not skip:
        return loader
    if hasattr(loader, "skip_first_batches"):
        return loader.skip_first_batches(skip)
    return accelerator.skip_first_batches(loader, skip)


def clip_norm(args) -> float:
    """What clip_grad_norm_ clips the gradients' total norm to: --max_grad_norm, or with 0 nothing
    (the norm is still measured, for the guard to check)."""
    return args.max_grad_norm or math.inf


def keeps_update(progress: TrainingProgress, grad_norm) -> bool:
    """`if keeps_update(progress, grad_norm): optimizer.step()`: whether the optimizer step under
    way updates the weights, `grad_norm` being its total gradient norm from clip_grad_norm_. False
    only with --skip_nonfinite_steps, for a non-finite loss or norm on any process; without that
    flag a non-finite one is noted on the device and the next check stops the run."""
    return not progress.guard.skip_update(progress.state.step + 1, grad_norm)


@contextmanager
def saving_checkpoint(checkpoints, progress: TrainingProgress, config: dict):
    """`with saving_checkpoint(...) as folder: accelerator.save_state(folder)`: a checkpoint of the
    run at its step, with its position and `config` (what a resumed run is checked against), saved
    atomically by `checkpoints` (Checkpoints); after it, a stop signal every process agreed on ends
    the run. Collective."""
    state = progress.state
    with checkpoints.saving(state.step, dict(state.position(), config=config)) as folder:
        yield folder
    progress.guard.stop_if_signalled(state.step, checkpoints.last_saved)  # PREEMPTED_EXIT_CODE


def finish_run(accelerator, output_dir, results: dict) -> Path | None:
    """End a run on every process together and write its results.json: all ranks wait for each
    other, then close the trackers and tear the process group down together (none while others
    still talk); the main process writes `results` into `output_dir`. The file's path on the main
    process, None on the others. Collective."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return write_results(output_dir, results) if accelerator.is_main_process else None


def eval_only_config(recipe: str, args, accelerator, **facts) -> dict:
    """What a run that evaluates a saved model records of itself (results.json, a tracker's
    config): the recipe, eval_only, how it was launched (processes, machines, precision, the global
    batch) and `facts`, the recipe's own (its data, its model)."""
    return dict(
        recipe=recipe,
        eval_only=True,
        world_size=accelerator.num_processes,
        num_machines=num_machines(accelerator.num_processes),
        mixed_precision=accelerator.mixed_precision,
        global_batch_size=args.batch_size,
        **facts,
    )


def eval_only_results(config: dict, accelerator, started: float, evaluation: dict) -> dict:
    """results.json of a run that evaluated a saved model: its `config` (eval_only_config's), no
    steps, the wall seconds since `started` (a time.perf_counter()), the `evaluation` and the
    entries every run records (run_facts). Collective."""
    return dict(
        config,
        steps=0,
        wall_seconds=time.perf_counter() - started,
        **evaluation,
        **run_facts(accelerator, StepMeter(accelerator.device), samples_seen=0),
    )
