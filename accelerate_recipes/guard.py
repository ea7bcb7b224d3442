"""Stopping a run cleanly, on every process at the same step: on a stop signal, or when the loss is not finite.

A scheduler (SLURM preemption, Kubernetes eviction, `kill`) sends SIGTERM, or SIGUSR1 ahead of a time limit. The
process that gets it only raises a flag; at the next optimizer step all processes learn of it through one tiny
all-reduce, finish that step together, save a checkpoint and exit with PREEMPTED_EXIT_CODE. The same all-reduce
carries "some process saw a NaN or infinite loss", so no process steps the optimizer on poisoned gradients while the
others wait for it.
"""

import signal
import threading

import torch

from accelerate_recipes.cli import Preempted, RecipeError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StepGuard:
    """Watches the losses of each optimizer step and the stop signals of this process.

        guard.observe(loss)                  # after each backward: no device sync
        if not guard.step_is_bad(step):      # once per optimizer step, before optimizer.step(), on every process
            optimizer.step()
        ...
        if guard.stop_signal: save a checkpoint, then guard.stop(step, checkpoint)

    A non-finite loss raises a RecipeError naming the step (the optimizer has not stepped on it, and the newest
    checkpoint on disk is from before it), or, with `skip_nonfinite`, drops that step's gradients and goes on.
    """

    def __init__(self, accelerator, skip_nonfinite: bool = False, last_checkpoint=lambda: None):
        self.accelerator = accelerator
        self.skip_nonfinite = skip_nonfinite
        self.last_checkpoint = last_checkpoint
        self.received: int = 0  # signal this process got, 0 for none
        self.stop_signal: int = 0  # signal any process got, agreed at the last step
        self.skipped_steps = 0
        self._nonfinite = torch.zeros((), device=accelerator.device)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum

    def observe(self, loss: torch.Tensor) -> None:
        """Note whether this micro-batch's loss is finite (kept on the device; nothing waits for it)."""
        self._nonfinite = torch.maximum(self._nonfinite, (~torch.isfinite(loss.detach().float())).float())

    def step_is_bad(self, step: int) -> bool:
        """Agree with every process on this step: True to skip its optimizer update. Collective."""
        flags = torch.stack([self._nonfinite, torch.tensor(float(self.received), device=self._nonfinite.device)])
        nonfinite, signum = self.accelerator.reduce(flags, reduction="max").tolist()
        self._nonfinite = torch.zeros_like(self._nonfinite)
        if signum:
            self.stop_signal = int(signum)
        if not nonfinite:
            return False
        if self.skip_nonfinite:
            self.skipped_steps += 1
            self.accelerator.print(f"warning: non-finite loss at step {step}; its update is skipped "
                                   f"({self.skipped_steps} so far)")
            return True
        checkpoint = self.last_checkpoint()
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was saved before it"
        raise RecipeError(
            f"the loss is not finite (NaN or inf) at step {step}; training stopped before applying it, {kept}. Lower "
            "--lr, use bf16 instead of fp16, check the data, or pass --skip_nonfinite_steps to drop such steps"
        )

    def stop(self, step: int, checkpoint) -> None:
        """End the run after the stop signal's checkpoint: tear the process group down together and exit with
        PREEMPTED_EXIT_CODE (cli.run prints the message). Collective."""
        self.accelerator.end_training()
        raise Preempted(f"{signal.Signals(self.stop_signal).name} at step {step}; checkpoint saved in {checkpoint}; "
                        "continue with --resume auto")

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
