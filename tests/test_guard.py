"""StepGuard and StepMeter in one real process: what they decide, and that ordinary steps read
nothing back."""

import math
import os
import signal
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from host_reads import Audit

from accelerate_recipes import RecipeError, StepGuard, StepMeter

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def run_steps(guard, losses, first_step=1, grad_norms=None):
    """Feed one loss (and, when given, one total gradient norm) per optimizer step; return the steps
    whose update the guard skipped."""
    skipped = []
    for offset, loss in enumerate(losses):
        guard.observe(torch.tensor(loss))
        if guard.skip_update(first_step + offset, None if grad_norms is None else grad_norms[offset]):
            skipped.append(first_step + offset)
    return skipped


def norms(*values: float) -> list[torch.Tensor]:
    """Total gradient norms as accelerator.clip_grad_norm_ gives them (a tensor on the device) but
    under DeepSpeed."""
    return [torch.tensor(value) for value in values]


def host_reads(audit: Audit) -> int:
    return sum(sum(per.values()) for (kind, *_), per in audit.sites.items() if kind in ("read", "sync"))


def test_a_nonfinite_loss_is_reported_at_the_next_check_with_its_own_step(accelerator):
    guard = StepGuard(accelerator, last_checkpoint=lambda: "checkpoints/step_00000002")
    try:
        # nothing skipped, nothing read
        assert run_steps(guard, [1.0, 0.9, float("nan"), float("inf"), 0.8]) == []
        with pytest.raises(RecipeError, match=r"from step 3 on \(seen at step 5\).*step_00000002"):
            guard.check(5)
        # The check consumed the flag: later clean steps pass.
        run_steps(guard, [0.5, 0.4], first_step=6)
        guard.check(7)
    finally:
        guard.close()


def test_skip_nonfinite_skips_exactly_the_bad_steps(accelerator):
    guard = StepGuard(accelerator, skip_nonfinite=True)
    try:
        assert run_steps(guard, [1.0, float("nan"), 0.9, float("-inf"), 0.7]) == [2, 4]
        assert guard.skipped_steps == 2
        guard.check(5)  # already handled step by step: no error
    finally:
        guard.close()


def test_nonfinite_gradients_with_a_finite_loss_stop_the_run_at_their_step_read_only_at_the_check(
    accelerator,
):
    guard = StepGuard(accelerator)
    audit = Audit(Path(__file__))
    try:
        with audit.mode():  # the host-read audit's own counter
            # step 2: the loss is finite and the gradients are
            # not; step 3: the NaN weights give a NaN loss
            run_steps(guard, [1.0, 0.9, NAN, 0.8], grad_norms=norms(0.5, NAN, NAN, 0.4))
            assert host_reads(audit) == 0  # the flags stayed on the device
            with pytest.raises(
                RecipeError, match=r"the gradients are not finite .*from step 2 on \(seen at step 4\)"
            ):
                guard.check(4)
        assert host_reads(audit) >= 1  # the check is where they are read
        # At the same step a non-finite loss is what is
        # named; an infinite norm counts as much as a NaN.
        run_steps(guard, [NAN, 1.0], first_step=5, grad_norms=norms(NAN, INF))
        with pytest.raises(RecipeError, match=r"the loss is not finite \(NaN or inf\) from step 5 on"):
            guard.check(6)
        run_steps(guard, [1.0], first_step=7, grad_norms=norms(INF))
        with pytest.raises(RecipeError, match=r"the gradients are not finite .*from step 7 on.*kernels"):
            guard.check(7)
    finally:
        guard.close()
        audit.hook.remove()  # the audit's optimizer-step counter, global to torch


def test_skip_nonfinite_skips_the_steps_with_nonfinite_gradients(accelerator, capsys):
    guard = StepGuard(accelerator, skip_nonfinite=True)
    try:
        # DeepSpeed's engine hands its norm over as a Python number (inf where it found an
        # overflow): watched alike.
        assert run_steps(guard, [1.0, 0.9, 0.8, NAN], grad_norms=[*norms(0.5, INF), math.inf, 0.1]) == [
            2,
            3,
            4,
        ]
        assert guard.skipped_steps == 3
        guard.check(4)
    finally:
        guard.close()
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert (
        warnings[0]
        == "warning: non-finite gradients (the loss was finite) at step 2; its update is skipped (1 so far)"
    )
    assert "non-finite loss at step 4" in warnings[2]


def test_an_fp16_loss_scaler_keeps_its_overflowing_steps_to_itself(accelerator):
    # What accelerate builds for fp16 on a GPU: a GradScaler, which skips the update of an
    # overflowing step itself (routine while it finds its
    # scale), so the guard does not stop on such a gradient.
    accelerator.scaler = torch.amp.GradScaler("cpu")
    guard = StepGuard(accelerator)
    try:
        run_steps(guard, [1.0, 0.9], grad_norms=norms(INF, NAN))
        guard.check(2)
        run_steps(guard, [NAN], first_step=3, grad_norms=norms(NAN))
        # the loss is still watched
        with pytest.raises(RecipeError, match="the loss is not finite"):
            guard.check(3)
    finally:
        guard.close()
        accelerator.scaler = None


def test_a_stop_signal_is_agreed_at_the_check_not_before(accelerator):
    guard = StepGuard(accelerator)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.received == signal.SIGUSR1
        run_steps(guard, [1.0, 1.0])
        assert guard.stop_signal == 0  # ordinary steps never look
        guard.check(2)
        assert guard.stop_signal == signal.SIGUSR1
    finally:
        guard.close()
    assert signal.getsignal(signal.SIGUSR1) is not guard._on_signal  # handlers put back


def test_meter_times_steps_without_reading_per_step(accelerator):
    meter = StepMeter(accelerator.device, warmup_steps=1)
    meter.restart()
    for _ in range(4):
        torch.randn(200, 200) @ torch.randn(200, 200)
        meter.step(32)
    assert meter.durations == []  # nothing converted until asked
    interval = meter.interval_seconds()
    assert len(meter.durations) == 4 and interval == pytest.approx(sum(meter.durations) / 4)
    meter.step(32)
    # only the steps since the last call
    assert meter.interval_seconds() == pytest.approx(meter.durations[-1])
    # warm-up step left out
    assert meter.samples_per_second == pytest.approx(4 * 32 / sum(meter.durations[1:]))
