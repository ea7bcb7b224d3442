"""Stopping a run cleanly, on every process at the same step: on a stop signal, or when the loss is not finite.

A scheduler (SLURM preemption, Kubernetes eviction, `kill`) sends SIGTERM, or SIGUSR1 ahead of a time limit. The
process that gets it only raises a flag. A loss that is NaN or infinite only sets a flag on the device. Neither is read
by the host on ordinary steps: a read of a device value makes the host wait for the GPU, so it could not queue the next
step while the GPU works. The flags are read at the steps that read the device anyway (log steps) and before every
checkpoint, through one tiny all-reduce, so all processes learn the same answer at the same step:

- a stop signal: all processes save a checkpoint and exit with PREEMPTED_EXIT_CODE;
- a non-finite loss: the run stops, naming the first step that had one; no checkpoint is written after it, so the
  newest checkpoint on disk is a good one.

With `skip_nonfinite` the flags are agreed on at every optimizer step instead (one all-reduce and one read per step),
because whether to skip a step's update must be known before that update.
"""

import signal
import threading

import torch
import torch.distributed as dist

from accelerate_recipes.errors import Preempted, RecipeError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_NO_BAD_STEP = 2**62  # "no non-finite loss yet"


def _max_over_processes(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of `tensor` over all processes, in place (itself when there is no process group)."""
    # Not accelerator.reduce: before accelerate 1.14 it sums for reduction="max", and a sum of the sentinels overflows.
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


class StepGuard:
    """Watches the losses of each optimizer step and the stop signals of this process.

        guard.observe(loss)                              # after each backward: device-side, no read
        if not (accelerator.sync_gradients and guard.skip_update(step + 1)):
            optimizer.step()
        ...
        if log_step or checkpoint_step: guard.check(step)   # the host read: raises on a non-finite loss
        if guard.stop_signal: save a checkpoint, then guard.stop_if_signalled(step, checkpoint)

    A stop signal is therefore acted on at the next log or checkpoint step (`--log_every` bounds the delay).
    """

    def __init__(self, accelerator, skip_nonfinite: bool = False, last_checkpoint=lambda: None):
        self.accelerator = accelerator
        self.skip_nonfinite = skip_nonfinite
        self.last_checkpoint = last_checkpoint
        self.received: int = 0  # signal this process got, 0 for none
        self.stop_signal: int = 0  # signal any process got, agreed at the last check
        self.skipped_steps = 0
        device = accelerator.device
        # Integer flags on the device; the kernels below take Python numbers and never copy from the host.
        self._nonfinite = torch.zeros((), device=device, dtype=torch.int64)  # this optimizer step's micro-batches
        self._first_bad = torch.full((), _NO_BAD_STEP, device=device, dtype=torch.int64)  # since the last check
        self._signal = torch.zeros((), device=device, dtype=torch.int64)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum

    def observe(self, loss: torch.Tensor) -> None:
        """Note whether this micro-batch's loss is finite (on the device; nothing waits for it)."""
        nonfinite = (~torch.isfinite(loss.detach())).any().to(self._nonfinite.dtype)
        torch.maximum(self._nonfinite, nonfinite, out=self._nonfinite)

    def _agreed_flags(self, first_bad: torch.Tensor) -> tuple[int, int]:
        """One all-reduce and one read: (the earliest step with a non-finite loss on any process, any stop signal)."""
        self._signal.fill_(self.received)  # a kernel with a Python number: no host-to-device copy
        flags = torch.stack([-first_bad, self._signal])  # max of -step = the earliest step
        earliest, signum = _max_over_processes(flags).tolist()
        if signum:
            self.stop_signal = int(signum)
        return -earliest, int(signum)

    def skip_update(self, step: int) -> bool:
        """At the end of optimizer step `step`, before its update: True to skip the update (only with skip_nonfinite,
        which makes this collective and reads the device; otherwise it records the step on the device and returns
        False without waiting for anything)."""
        bad = self._nonfinite > 0
        self._nonfinite.zero_()
        if not self.skip_nonfinite:
            self._first_bad.masked_fill_(bad & (self._first_bad == _NO_BAD_STEP), step)  # keep the earliest
            return False
        earliest, _ = self._agreed_flags(torch.full_like(self._first_bad, _NO_BAD_STEP).masked_fill_(bad, step))
        if earliest >= _NO_BAD_STEP:
            return False
        self.skipped_steps += 1
        self.accelerator.print(
            f"warning: non-finite loss at step {step}; its update is skipped ({self.skipped_steps} so far)"
        )
        return True

    def check(self, step: int) -> None:
        """Agree with every process on what happened since the last check: sets `stop_signal`, and raises a
        RecipeError when a loss was not finite. Collective; call it on every process at the same steps."""
        if self.skip_nonfinite:  # skip_update already agreed on every step; only the signal is left to share
            self._agreed_flags(torch.full_like(self._first_bad, _NO_BAD_STEP))
            return
        earliest, _ = self._agreed_flags(self._first_bad)
        self._first_bad.fill_(_NO_BAD_STEP)
        if earliest >= _NO_BAD_STEP:
            return
        checkpoint = self.last_checkpoint()
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was saved before it"
        raise RecipeError(
            f"the loss is not finite (NaN or inf) from step {earliest} on (seen at step {step}); training stopped "
            f"and saved nothing after it, {kept}. Lower --lr, use bf16 instead of fp16, check the data, or pass "
            "--skip_nonfinite_steps to drop such steps"
        )

    def stop_if_signalled(self, step: int, checkpoint) -> None:
        """After a save: when a stop signal was agreed on, end the run there (the process group torn down together,
        exit with PREEMPTED_EXIT_CODE; cli.run prints the message). Collective."""
        if not self.stop_signal:
            return
        self.accelerator.end_training()
        raise Preempted(
            f"{signal.Signals(self.stop_signal).name} at step {step}; checkpoint saved in {checkpoint}; "
            "continue with --resume auto"
        )

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
