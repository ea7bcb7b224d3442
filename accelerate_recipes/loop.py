"""The bookkeeping around a recipe's training loop: where the run is, and what happens after each optimizer step.

    state = RunState(accelerator.device, ("loss",))
    accelerator.register_for_checkpointing(state)       # save_state / load_state carry the position
    log = TrainLog(accelerator, state, output_dir, ...)  # with the run's StepGuard, StepMeter and MetricsLog
    ...
    state.add(loss.detach(), samples=len(labels))       # every micro-batch: summed on the device
    if accelerator.sync_gradients and log.step_done(scheduler):   # every optimizer step; True: checkpoint now
        save_checkpoint()

Only log and checkpoint steps read values back from the device (the loss means, the guard's flags, step times), so a
GPU is never made to wait for the host on the steps between them.
"""

import time

import torch
from tqdm.auto import tqdm


class RunState:
    """The run's position and running figures: one object, saved and restored with the model.

    Register it with `accelerator.register_for_checkpointing(state)`; `accelerator.save_state` then writes it beside
    the weights, optimizer and RNG states, and `load_state` puts the run back exactly where it was: the same step, in
    the same epoch, after the batches already trained on, with the same running loss.
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
        self.running = torch.zeros(len(self.loss_names), device=device)  # sums since the last log step
        self.micro_batches = 0  # micro-batches in those sums

    def add(self, losses: torch.Tensor, samples: int) -> None:
        """One micro-batch: its loss (or loss parts, in `loss_names` order), added on the device; no read."""
        self.running += losses.detach().reshape(-1)
        self.micro_batches += 1
        self.samples_seen += samples

    def position(self) -> dict:
        """Where the run is, for people and tools reading a checkpoint's checkpoint.json."""
        return {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done}

    def describe(self, total_steps: int) -> str:
        return (f"step {self.step} of {total_steps}, epoch {self.epoch + 1}, {self.batches_done} batch(es) of it "
                "already done")

    def state_dict(self) -> dict:
        keys = ("step", "epoch", "batches_done", "samples_seen", "first_loss", "last_loss", "last_eval",
                "micro_batches")
        return {**{k: getattr(self, k) for k in keys}, "running": self.running.tolist()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key == "running":
                self.running = torch.tensor(value, dtype=self.running.dtype, device=self.running.device)
            else:
                setattr(self, key, value)


class TrainLog:
    """What follows each optimizer step, the same in every recipe: count it, time it, and at log steps agree on the
    guard's flags and log the mean losses, learning rate and throughput; at epoch ends log the evaluation."""

    def __init__(self, accelerator, state: RunState, checkpoints, *, resumed_from, total_steps: int,
                 steps_per_epoch: int, batches_per_epoch: int, global_batch_size: int, log_every: int,
                 checkpoint_every: int, skip_nonfinite: bool = False):
        """Also builds the run's StepGuard (`.guard`), StepMeter (`.meter`) and MetricsLog (`.metrics`, beside the
        checkpoints; a run resumed from `resumed_from` keeps metrics.jsonl up to its step and says where it is)."""
        from accelerate_recipes.guard import StepGuard
        from accelerate_recipes.meter import StepMeter
        from accelerate_recipes.results import MetricsLog

        self.accelerator, self.state, self.resumed_from = accelerator, state, resumed_from
        self.guard = StepGuard(accelerator, skip_nonfinite=skip_nonfinite, last_checkpoint=checkpoints.newest)
        self.meter = StepMeter(accelerator.device)
        self.metrics = MetricsLog(accelerator, checkpoints.directory.parent,
                                  resume_step=state.step if resumed_from else None)
        if resumed_from:
            accelerator.print(f"resumed from {resumed_from}: {state.describe(total_steps)}")
        checkpoints.remove_partial()  # what interrupted saves left, before this run saves anything
        self.total_steps, self.steps_per_epoch, self.batches_per_epoch = total_steps, steps_per_epoch, batches_per_epoch
        self.global_batch_size, self.log_every, self.checkpoint_every = global_batch_size, log_every, checkpoint_every
        self.progress = tqdm(total=total_steps, initial=state.step, desc="train", unit="step",
                             disable=not accelerator.is_main_process)
        self.epoch_started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    def start_epoch(self) -> None:
        """Before an epoch's first batch: its clock and the step timer start (evaluation and saving left out)."""
        self.epoch_started = time.perf_counter()
        self.meter.restart()

    def step_done(self, scheduler) -> bool:
        """After an optimizer step (and its scheduler step): True when a checkpoint is due now (its interval, or a
        stop signal every process agreed on). Collective at log and checkpoint steps."""
        state = self.state
        state.step += 1
        self.meter.step(self.global_batch_size)
        self.progress.update(1)
        at_log = state.step % self.log_every == 0 or state.step == 1 or self.finished
        mid_epoch = state.batches_done < self.batches_per_epoch and not self.finished  # else the epoch-end save
        at_checkpoint = bool(self.checkpoint_every) and state.step % self.checkpoint_every == 0 and mid_epoch
        if at_log or at_checkpoint:
            self.guard.check(state.step)  # a non-finite loss stops here; a stop signal is saved by the caller
        if at_log:
            # The mean of every micro-batch since the last log, over all processes: the one read of the losses.
            means = self.accelerator.reduce(state.running / max(state.micro_batches, 1), reduction="mean").tolist()
            step_seconds = self.meter.interval_seconds()
            state.first_loss = means[0] if state.first_loss is None else state.first_loss
            state.last_loss = means[0]
            lr = scheduler.get_last_lr()[0]
            self.metrics.log(
                {**{f"train/{name}": value for name, value in zip(state.loss_names, means)}, "train/lr": lr,
                 "train/epoch": state.step / self.steps_per_epoch, "perf/step_seconds": step_seconds,
                 "perf/samples_per_second": self.global_batch_size / max(step_seconds, 1e-9)},
                step=state.step,
            )
            self.progress.set_postfix(loss=f"{means[0]:.3f}", lr=f"{lr:.3g}")
            state.running.zero_()
            state.micro_batches = 0
        return bool(self.guard.stop_signal) or at_checkpoint

    def epoch_done(self, evaluation: dict, **extra) -> float:
        """At an epoch's end, after its evaluation: log it (eval_* as eval/*) with the epoch's time, throughput and
        peak memory; returns the epoch's seconds. Every process calls it (only the main one writes)."""
        from accelerate_recipes.meter import peak_memory_mb

        seconds = time.perf_counter() - self.epoch_started
        memory_mb, _ = peak_memory_mb(self.accelerator.device)
        scalars = {f"eval/{k.removeprefix('eval_')}": v for k, v in evaluation.items()
                   if isinstance(v, (int, float)) and k != "eval_samples"}
        self.metrics.log({**scalars, **extra, "perf/epoch_seconds": seconds,
                          "perf/train_samples_per_second": self.meter.samples_per_second,
                          "perf/peak_memory_mb": memory_mb}, step=self.state.step)
        return seconds

    def results(self, started: float) -> dict:
        """The results.json entries of the run's course, the same in every recipe (collective: gathers sample counts)."""
        from accelerate_recipes.results import run_facts

        state = self.state
        return dict(steps=state.step, resumed_from=str(self.resumed_from) if self.resumed_from else None,
                    skipped_nonfinite_steps=self.guard.skipped_steps, wall_seconds=time.perf_counter() - started,
                    train_loss_first=state.first_loss, train_loss_last=state.last_loss, **state.last_eval,
                    **run_facts(self.accelerator, self.meter, state.samples_seen))

    def close(self) -> None:
        self.progress.close()
        self.guard.close()
