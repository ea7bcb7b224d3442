"""The bookkeeping around a recipe's training loop: where the run is (RunState), what follows each
optimizer step (TrainingProgress), and which evaluation was the best (BestModel).

    state = RunState(accelerator.device, ("loss",))
    accelerator.register_for_checkpointing(state)     # save_state / load_state carry the position
    best = BestModel(accelerator, state, output_dir, "eval_accuracy", patience=...)
    # with its StepGuard, StepMeter and MetricsLog
    progress = TrainingProgress(accelerator, state, output_dir, best=best, ...)
    ...
    state.add(loss.detach(), samples=len(labels))     # every micro-batch: summed on the device
    # every optimizer step; True: checkpoint now
    if accelerator.sync_gradients and progress.step_done(scheduler):
        save_checkpoint()
    ...
    progress.epoch_done(evaluation)   # after each evaluation: logged with the epoch's figures
    if best.judge(evaluation):        # the best so far: its weights go to output_dir/model_best
        with best.saving() as folder:
            accelerator.save_model(model_to_save(accelerator, model), folder)
    # the loop ends when progress.finished: every step done, or --early_stopping_patience
    # evaluations without improvement

Only log and checkpoint steps read values back from the device (the loss means, the guard's flags,
step times), so a GPU is never made to wait for the host on the steps between them.
"""

import math
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from accelerate_recipes.checkpoints import (
    BEST_DIR,
    BEST_RECORD,
    CHECKPOINTS_DIR,
    newest_checkpoint,
    saving_folder,
)
from accelerate_recipes.errors import RecipeError
from accelerate_recipes.guard import StepGuard
from accelerate_recipes.meter import FIGURES, ProcessFigures, StepMeter, StepParts, peak_memory_mb
from accelerate_recipes.results import MetricsLog, run_facts
from accelerate_recipes.tracking import log_image_files


class RunState:
    """The run's position and running figures: one object, saved and restored with the model.

    Register it with `accelerator.register_for_checkpointing(state)`; `accelerator.save_state` then
    writes it beside the weights, optimizer and RNG states, and `load_state` puts the run back
    exactly where it was: the same step, in the same epoch, after the batches already trained on,
    with the same running loss, the same best evaluation so far and the same count of evaluations
    without improvement.
    """

    def __init__(self, device: torch.device, loss_names: tuple[str, ...] = ("loss",)):
        self.loss_names = tuple(loss_names)
        self.step = 0  # optimizer steps done
        self.epoch = 0  # the epoch being trained (the number of finished epochs)
        self.batches_done = 0  # batches of that epoch already trained on, by this process
        self.samples_seen = 0  # training samples this process has consumed
        self.first_loss: float | None = None  # mean loss at the first log step
        self.last_loss: float | None = None  # mean loss at the latest log step
        self.last_eval: dict = {}
        self.best_metric: float | None = None  # the best value of the main evaluation metric so far
        # the epoch of that evaluation, counted from 1 as printed
        self.best_epoch: int | None = None
        self.best_step: int | None = None
        # evaluations in a row not better than best_metric (early stopping)
        self.evals_without_improvement = 0
        # sums since the last log step
        self.running = torch.zeros(len(self.loss_names), device=device)
        self.micro_batches = 0  # micro-batches in those sums

    def add(self, losses: torch.Tensor, samples: int) -> None:
        """One micro-batch: its loss (or loss parts, in `loss_names` order), added on the device; no
        read."""
        self.running += losses.detach().reshape(-1)
        self.micro_batches += 1
        self.samples_seen += samples

    def position(self) -> dict:
        """Where the run is, for people and tools reading a checkpoint's checkpoint.json."""
        return {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done}

    def describe(self, total_steps: int) -> str:
        return (
            f"step {self.step} of {total_steps}, epoch {self.epoch + 1}, {self.batches_done} "
            "batch(es) of it already done"
        )

    def state_dict(self) -> dict:
        keys = (
            "step",
            "epoch",
            "batches_done",
            "samples_seen",
            "first_loss",
            "last_loss",
            "last_eval",
            "micro_batches",
            "best_metric",
            "best_epoch",
            "best_step",
            "evals_without_improvement",
        )
        return {**{k: getattr(self, k) for k in keys}, "running": self.running.tolist()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key == "running":
                self.running = torch.tensor(value, dtype=self.running.dtype, device=self.running.device)
            else:
                setattr(self, key, value)


class BestModel:
    """Judges each evaluation against the best so far, by one metric: the best one's model goes to
    output_dir/model_best, and --early_stopping_patience evaluations in a row without improvement
    end the run. The best value and the count live in the RunState, so a resumed run judges on as if
    it had never stopped."""

    def __init__(
        self,
        accelerator,
        state: RunState,
        output_dir,
        metric: str,
        higher_is_better: bool = True,
        patience: int = 0,
    ):
        # fire passes what was typed
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise RecipeError(
                f"--early_stopping_patience {patience}: give a whole number of evaluations, 0 to "
                "turn early stopping off"
            )
        self.accelerator, self.state, self.metric, self.higher_is_better = (
            accelerator,
            state,
            metric,
            higher_is_better,
        )
        self.patience = patience
        self.folder = Path(output_dir) / BEST_DIR

    @property
    def out_of_patience(self) -> bool:
        """--early_stopping_patience evaluations in a row without improvement (a resumed run counts
        on)."""
        return bool(self.patience) and self.state.evals_without_improvement >= self.patience

    def judge(self, evaluation: dict) -> bool:
        """Whether `evaluation` is strictly better than every earlier one (NaN never is); recorded
        in the RunState. Every process calls it and all take the main process's value, so all decide
        alike."""
        state = self.state
        if self.metric not in evaluation:
            raise RecipeError(
                f"the evaluation has no {self.metric!r} to judge the best model by (it has "
                f"{', '.join(evaluation)}); pass BestModel one of those"
            )
        value = float(evaluation[self.metric])
        if self.accelerator.num_processes > 1:
            # The metric comes from gathered predictions, the same everywhere; to be sure every
            # process decides alike, all take the main process's value (a sum with zeros from the
            # others is exact).
            mine = torch.tensor(
                [value if self.accelerator.is_main_process else 0.0],
                dtype=torch.float64,
                device=self.accelerator.device,
            )
            value = self.accelerator.reduce(mine, reduction="sum").item()
        best = state.best_metric
        improved = value == value and (
            best is None or (value > best if self.higher_is_better else value < best)
        )
        if improved:
            state.best_metric, state.best_epoch, state.best_step = value, state.epoch + 1, state.step
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
        return improved

    @contextmanager
    def saving(self):
        """`with best.saving() as folder: accelerator.save_model(model, folder)` after an improved
        evaluation, on every process: output_dir/model_best is replaced only once the new model is
        whole, with best.json (metric, value, epoch, step) beside it. Collective."""
        state = self.state
        record = dict(
            metric=self.metric, value=state.best_metric, epoch=state.best_epoch, step=state.best_step
        )
        with saving_folder(self.accelerator, self.folder, BEST_RECORD, record) as folder:
            yield folder

    def results(self, total_steps: int) -> dict:
        """The results.json entries of the best evaluation and of early stopping."""
        state = self.state
        return dict(
            metric_for_best_model=self.metric,
            best_metric=state.best_metric,
            best_epoch=state.best_epoch,
            best_step=state.best_step,
            early_stopping_patience=self.patience,
            stopped_early=self.out_of_patience and state.step < total_steps,
        )

    def explain_stop(self, total_steps: int, steps_per_epoch: int) -> str:
        """The line that says why the run ended before its last step."""
        state = self.state
        epochs = -(-total_steps // steps_per_epoch)
        best = (
            f"best {self.metric} {state.best_metric:.4f} at epoch {state.best_epoch}, its model in "
            f"{self.folder}"
            if state.best_metric is not None
            else f"no evaluation gave a {self.metric}"
        )
        return (
            f"stopped early after epoch {state.epoch} of {epochs} (step {state.step} of "
            f"{total_steps}): {self.metric} did not improve in {state.evals_without_improvement} "
            f"evaluation(s) in a row (--early_stopping_patience {self.patience}); {best}"
        )


class TrainingProgress:
    """What follows each optimizer step, the same in every recipe: count it, time it, show it on the
    progress bar, and at log steps agree on the guard's flags and log the mean losses, learning rate
    and throughput; say when a checkpoint is due and when the run is over; at epoch ends log the
    evaluation with the epoch's figures.

    Builds the run's StepGuard (`.guard`), StepMeter (`.meter`) and MetricsLog (`.metrics`,
    output_dir/metrics.jsonl, appended to; Checkpoints.resolve trimmed it for a resumed run).
    Nothing is written to disk here.

    With more than one process, each log step also logs every process's and every node's step
    time, data wait and communication wait (StepParts, `timed` for the data wait; ProcessFigures),
    and warns once when one process is persistently slower than the others. Build it after
    `accelerator.prepare`: it hooks the prepared optimizers' parameters to time communication
    under DDP."""

    def __init__(
        self,
        accelerator,
        state: RunState,
        output_dir,
        *,
        total_steps: int,
        steps_per_epoch: int,
        batches_per_epoch: int,
        global_batch_size: int,
        log_every: int,
        checkpoint_every: int,
        skip_nonfinite: bool = False,
        resumed_from=None,
        best: BestModel | None = None,
    ):
        self.accelerator, self.state, self.best, self.resumed_from = accelerator, state, best, resumed_from
        self.total_steps, self.steps_per_epoch, self.batches_per_epoch = (
            total_steps,
            steps_per_epoch,
            batches_per_epoch,
        )
        self.global_batch_size, self.log_every, self.checkpoint_every = (
            global_batch_size,
            log_every,
            checkpoint_every,
        )
        # a stop names the newest complete one there
        checkpoints = Path(output_dir) / CHECKPOINTS_DIR
        self.guard = StepGuard(
            accelerator, skip_nonfinite=skip_nonfinite, last_checkpoint=lambda: newest_checkpoint(checkpoints)
        )
        self.meter = StepMeter(accelerator.device)
        # prepare wraps the model in DDP for the MULTI_* types (FSDP and DeepSpeed are types of
        # their own); accelerate keeps the prepared optimizers in a list with no public accessor
        ddp = accelerator.distributed_type.value.startswith("MULTI_")
        self.parts = StepParts(accelerator.device, getattr(accelerator, "_optimizers", ()), ddp)
        self.processes = ProcessFigures(accelerator)
        self.output_dir = Path(output_dir)
        self.metrics = MetricsLog(accelerator, output_dir)
        self.progress_bar = tqdm(
            total=total_steps,
            initial=state.step,
            desc="train",
            unit="step",
            disable=not accelerator.is_main_process,
        )
        self.epoch_started = time.perf_counter()
        if resumed_from:
            accelerator.print(f"resumed from {resumed_from}: {state.describe(total_steps)}")

    @property
    def finished(self) -> bool:
        """The run is over: every step done, or stopped early."""
        return self.state.step >= self.total_steps or (self.best is not None and self.best.out_of_patience)

    def start_epoch(self) -> None:
        """Before an epoch's first batch: its clock and the step timer start (evaluation and saving
        left out)."""
        self.epoch_started = time.perf_counter()
        self.meter.restart()

    def timed(self, batches):
        """`for batch in progress.timed(batches):` the batches, with the host's wait for each
        counted as the step's data wait."""
        started = time.perf_counter()
        iterator = iter(batches)  # a DataLoader starts its workers here: the first batch's wait
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.parts.data_waited(time.perf_counter() - started)
            yield batch
            started = time.perf_counter()

    def step_done(self, scheduler) -> bool:
        """After an optimizer step (and its scheduler step): True when a checkpoint is due now (its
        interval, or a stop signal every process agreed on). Collective at log and checkpoint
        steps."""
        state = self.state
        state.step += 1
        self.meter.step(self.global_batch_size)
        self.parts.step()
        self.progress_bar.update(1)
        at_log = state.step % self.log_every == 0 or state.step == 1 or self.finished
        # else the epoch-end save
        mid_epoch = state.batches_done < self.batches_per_epoch and not self.finished
        at_checkpoint = bool(self.checkpoint_every) and state.step % self.checkpoint_every == 0 and mid_epoch
        if at_log or at_checkpoint:
            # a non-finite loss stops here; a stop signal is saved by the caller
            self.guard.check(state.step)
        if at_log:
            # The mean of every micro-batch since the last log,
            # over all processes: the one read of the losses.
            means = self.accelerator.reduce(
                state.running / max(state.micro_batches, 1), reduction="mean"
            ).tolist()
            step_seconds = self.meter.interval_seconds()
            processes = self._process_figures(step_seconds)
            state.first_loss = means[0] if state.first_loss is None else state.first_loss
            state.last_loss = means[0]
            lr = scheduler.get_last_lr()[0]
            self.metrics.log(
                {
                    **{f"train/{name}": value for name, value in zip(state.loss_names, means)},
                    "train/lr": lr,
                    "train/epoch": state.step / self.steps_per_epoch,
                    "perf/step_seconds": step_seconds,
                    "perf/samples_per_second": self.global_batch_size / max(step_seconds, 1e-9),
                    **processes,
                },
                step=state.step,
            )
            self.progress_bar.set_postfix(loss=f"{means[0]:.3f}", lr=f"{lr:.3g}")
            state.running.zero_()
            state.micro_batches = 0
        return bool(self.guard.stop_signal) or at_checkpoint

    def _process_figures(self, step_seconds: float) -> dict:
        """A log step's figures of every process and node for the tracker (collective; none on one
        process), and the slow-process warning when one is due."""
        data, comm = self.parts.interval_means()
        if self.accelerator.num_processes == 1:
            return {}
        rows = self.processes.gather(step_seconds, data, comm)
        if not self.accelerator.is_main_process:
            return {}
        # step 1's lazy initialisation differs between processes: no verdict on it
        warning = self.processes.check_slow(rows, self.state.step) if self.state.step > 1 else None
        if warning:
            self.progress_bar.write(warning)
        return ProcessFigures.tracked(rows)

    def epoch_done(self, evaluation: dict, **extra) -> float:
        """At an epoch's end, after its evaluation: log it (eval_* as eval/*) with the epoch's time,
        throughput and peak memory. Returns the epoch's seconds. A non-finite figure in it stops the
        run before anything is saved."""
        self._check_finite(evaluation)
        seconds = time.perf_counter() - self.epoch_started
        memory_mb, _ = peak_memory_mb(self.accelerator.device)
        scalars = {
            f"eval/{k.removeprefix('eval_')}": v
            for k, v in evaluation.items()
            if isinstance(v, (int, float)) and k != "eval_samples"
        }
        self.metrics.log(
            {
                **scalars,
                **extra,
                "perf/epoch_seconds": seconds,
                "perf/train_samples_per_second": self.meter.samples_per_second,
                "perf/peak_memory_mb": memory_mb,
            },
            step=self.state.step,
        )
        return seconds

    def _check_finite(self, evaluation: dict) -> None:
        """The last line of defence against a model with NaN weights: the guard watches each step's
        loss and gradients, but a NaN that reaches the weights another way (an fp16 overflow in the
        optimizer, say) shows up in the evaluation, which then stops the run instead of saving that
        model and a results.json with NaN."""
        bad = {k: v for k, v in evaluation.items() if isinstance(v, float) and not math.isfinite(v)}
        if not bad:
            return
        checkpoint = self.guard.last_checkpoint()
        newest = f"the newest checkpoint is {checkpoint}" if checkpoint else "no checkpoint was saved"
        raise RecipeError(
            f"the evaluation at step {self.state.step} gave "
            f"{', '.join(f'{k} {v}' for k, v in bad.items())}: the model's weights or its "
            f"evaluation are not finite; neither that model nor results.json was saved ({newest}). "
            "Use bf16 instead of fp16, lower --lr, or check the validation data"
        )

    def results(self, started: float) -> dict:
        """The results.json entries of the run's course, the same in every recipe (collective:
        gathers sample counts)."""
        state = self.state
        best = self.best.results(self.total_steps) if self.best is not None else {}
        return dict(
            steps=state.step,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            skipped_nonfinite_steps=self.guard.skipped_steps,
            wall_seconds=time.perf_counter() - started,
            train_loss_first=state.first_loss,
            train_loss_last=state.last_loss,
            **state.last_eval,
            **best,
            **run_facts(self.accelerator, self.meter, state.samples_seen),
            **self._process_results(),
        )

    def _process_results(self) -> dict:
        """results.json's figures of every process and node: the mean seconds a step over the run
        (less its warm-up steps, as median_step_seconds) of the step, its data wait, its
        communication wait (None where not measured) and its compute, in rank and node order; and
        the ranks warned about as slow. Collective."""
        skip = self.meter.warmup_skipped()
        durations = self.meter.durations[skip:]
        data, comm = self.parts.run_means(skip)
        rows = self.processes.gather(statistics.fmean(durations) if durations else 0.0, data, comm)
        nodes = ProcessFigures.by_node(rows)
        figures = {"node_of_process": [row["node"] for row in rows]}
        for name in FIGURES:
            figures[f"{name}_per_process"] = [row[name] for row in rows]
        for name in FIGURES:
            figures[f"{name}_per_node"] = [nodes[node][name] for node in sorted(nodes)]
        figures["slow_processes"] = list(self.processes.slow_processes)
        return figures

    def close(self) -> None:
        """After the loop: says so when the run stopped early; the run's curves (results.png, drawn
        at its last epoch's end) to the trackers that take images."""
        self.progress_bar.close()
        if self.accelerator.is_main_process:
            curves = {"results": self.output_dir / "results.png"}
            log_image_files(self.accelerator, curves, self.state.step)
        self.guard.close()
        if self.best is not None and self.best.out_of_patience and self.state.step < self.total_steps:
            self.accelerator.print(self.best.explain_stop(self.total_steps, self.steps_per_epoch))
