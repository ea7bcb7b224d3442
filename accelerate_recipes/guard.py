"""Stopping a run cleanly, on every process at the same step: on a stop signal, or when the loss or
the gradients are not finite.

A scheduler (SLURM preemption, Kubernetes eviction, `kill`) sends SIGTERM, or SIGUSR1 ahead of a
time limit. The process that gets it only raises a flag. A loss that is NaN or infinite, or a step
whose gradients have a NaN or infinite total norm, only sets a flag on the device. Neither is read
by the host on ordinary steps: a read of a device value makes the host wait for the GPU, so it could
not queue the next step while the GPU works. The flags are read at the steps that read the device
anyway (log steps) and before every checkpoint, through one tiny all-reduce, so all processes learn
the same answer at the same step:

- a stop signal: all processes save a checkpoint and exit with PREEMPTED_EXIT_CODE;
- a non-finite loss or gradient norm: the run stops, naming the first step that had one and which of
  the two it was; no checkpoint is written after it, so the newest checkpoint on disk is a good one.

The gradients are watched as well as the loss because a finite loss can have NaN gradients (a
kernel's backward pass that divides by zero, say): their update puts NaN into every weight the
optimizer touches, and only the next step's loss would show it. With `skip_nonfinite` the flags are
agreed on at every optimizer step instead (one all-reduce and one read per step), because whether to
skip a step's update must be known before that update.

Not watched: the gradients of fp16 runs with a loss scaler (torch's GradScaler, DeepSpeed's): an
overflowing gradient is routine there, and the scaler itself skips that update and lowers the scale.
Under DeepSpeed the engine steps inside `accelerator.backward`, so the guard learns of a bad
gradient only after the step (DeepSpeed's ZeRO optimizer has by then skipped that update itself) and
stops the run at the next check.
"""

import math
import signal
import threading

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from accelerate_recipes.errors import Preempted, RecipeError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A bad step is recorded as 2 x step + 1 when only its gradients were not finite, 2 x step when its
# loss was not: the smallest code is the earliest step, and at the same step a non-finite loss is
# the one named.
_NO_BAD_STEP = 2**62  # "nothing non-finite yet"


def _max_over_processes(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of `tensor` over all processes, in place (itself when there is no
    process group)."""
    # Not accelerator.reduce: before accelerate 1.14 it sums for
    # reduction="max", and a sum of the sentinels overflows.
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def _uses_loss_scaler(accelerator) -> bool:
    """fp16 with a loss scaler, which skips the updates of overflowing gradients itself."""
    deepspeed_fp16 = (
        accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.mixed_precision == "fp16"
    )
    return accelerator.scaler is not None or deepspeed_fp16


def _what(code: int) -> str:
    """What a bad step's code says was not finite."""
    if code % 2:
        return "the gradients are not finite (their total norm is NaN or inf; the loss is finite)"
    return "the loss is not finite (NaN or inf)"


class StepGuard:
    """Watches the losses and gradients of each optimizer step and the stop signals of this process.

        guard.observe(loss)                              # after each backward: device-side, no read
        if accelerator.sync_gradients:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
            if not guard.skip_update(step + 1, grad_norm):   # device-side too, unless skip_nonfinite
                optimizer.step()
        ...
        # the host read: raises on a non-finite loss or gradient
        if log_step or checkpoint_step: guard.check(step)
        if guard.stop_signal: save a checkpoint, then guard.stop_if_signalled(step, checkpoint)

    A stop signal is therefore acted on at the next log or checkpoint step (`--log_every` bounds the
    delay).
    """

    def __init__(self, accelerator, skip_nonfinite: bool = False, last_checkpoint=lambda: None):
        self.accelerator = accelerator
        self.skip_nonfinite = skip_nonfinite
        self.last_checkpoint = last_checkpoint
        self.watch_gradients = not _uses_loss_scaler(accelerator)
        self.received: int = 0  # signal this process got, 0 for none
        self.stop_signal: int = 0  # signal any process got, agreed at the last check
        self.skipped_steps = 0
        device = accelerator.device
        # Integer flags on the device; the kernels below take Python numbers and never copy from the
        # host. this optimizer step's micro-batches
        self._nonfinite = torch.zeros((), device=device, dtype=torch.int64)
        # since the last check
        self._first_bad = torch.full((), _NO_BAD_STEP, device=device, dtype=torch.int64)
        self._signal = torch.zeros((), device=device, dtype=torch.int64)
        self._previous = {}
        # Python handles signals in the main thread only
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum

    def observe(self, loss: torch.Tensor) -> None:
        """Note whether this micro-batch's loss is finite (on the device; nothing waits for it)."""
        nonfinite = (~torch.isfinite(loss.detach())).any().to(self._nonfinite.dtype)
        torch.maximum(self._nonfinite, nonfinite, out=self._nonfinite)

    def _gradients_nonfinite(self, grad_norm) -> torch.Tensor | bool:
        """Whether a step's total gradient norm (accelerator.clip_grad_norm_'s answer) is NaN or
        infinite: a tensor on the device, or a Python bool where DeepSpeed's engine gave a Python
        number; False when not watched."""
        if grad_norm is None or not self.watch_gradients:
            return False
        if not isinstance(grad_norm, torch.Tensor):
            return not math.isfinite(grad_norm)
        # FSDP2's DTensor: combine every process' share (a collective)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        return (~torch.isfinite(grad_norm.detach())).any().to(self._nonfinite.device)

    def _agreed_flags(self, first_bad: torch.Tensor) -> tuple[int, int]:
        """One all-reduce and one read: (the code of the earliest bad step on any process, any stop
        signal)."""
        self._signal.fill_(self.received)  # a kernel with a Python number: no host-to-device copy
        flags = torch.stack([-first_bad, self._signal])  # max of -code = the earliest step
        earliest, signum = _max_over_processes(flags).tolist()
        if signum:
            self.stop_signal = int(signum)
        return -earliest, int(signum)

    def skip_update(self, step: int, grad_norm=None) -> bool:
        """At the end of optimizer step `step`, before its update, with the step's total gradient
        norm (None: the loss alone is watched): True to skip the update (only with skip_nonfinite,
        which makes this collective and reads the device; otherwise it records the step on the
        device and returns False without waiting for anything)."""
        loss_bad = self._nonfinite > 0
        bad = loss_bad | self._gradients_nonfinite(grad_norm)
        self._nonfinite.zero_()
        code = (2 * step + 1 - loss_bad.to(torch.int64)).masked_fill_(~bad, _NO_BAD_STEP)
        if not self.skip_nonfinite:
            torch.minimum(self._first_bad, code, out=self._first_bad)  # keep the earliest
            return False
        earliest, _ = self._agreed_flags(code)
        if earliest >= _NO_BAD_STEP:
            return False
        self.skipped_steps += 1
        what = "gradients (the loss was finite)" if earliest % 2 else "loss"
        self.accelerator.print(
            f"warning: non-finite {what} at step {step}; its update is skipped ({self.skipped_steps} so far)"
        )
        return True

    def check(self, step: int) -> None:
        """Agree with every process on what happened since the last check: sets `stop_signal`, and
        raises a RecipeError when a loss or a step's gradients were not finite. Collective; call it
        on every process at the same steps."""
        # skip_update already agreed on every step; only the signal is left to share
        if self.skip_nonfinite:
            self._agreed_flags(torch.full_like(self._first_bad, _NO_BAD_STEP))
            return
        earliest, _ = self._agreed_flags(self._first_bad)
        self._first_bad.fill_(_NO_BAD_STEP)
        if earliest >= _NO_BAD_STEP:
            return
        checkpoint = self.last_checkpoint()
        kept = (
            f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was saved before it"
        )
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            skip = "use FSDP or DDP to drop such steps with --skip_nonfinite_steps"
        else:
            skip = "pass --skip_nonfinite_steps to drop such steps"
        cause = (
            "check the model's code and kernels (an attention kernel's backward pass over fully "
            "masked rows, say)"
            if earliest % 2
            else "lower --lr"
        )
        raise RecipeError(
            f"{_what(earliest)} from step {earliest // 2} on (seen at step {step}); training "
            f"stopped and saved nothing after it, {kept}. {cause.capitalize()}, use bf16 instead "
            f"of fp16, check the data, or {skip}"
        )

    def stop_if_signalled(self, step: int, checkpoint) -> None:
        """After a save: when a stop signal was agreed on, end the run there (the process group torn
        down together, exit with PREEMPTED_EXIT_CODE; cli.run prints the message). Collective."""
        if not self.stop_signal:
            return
        self.accelerator.end_training()
        raise Preempted(
            f"{signal.Signals(self.stop_signal).name} at step {step}; checkpoint saved in "
            f"{checkpoint}; continue with --resume auto"
        )

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
