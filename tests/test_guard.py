"""StepGuard and StepMeter in one real process: what they decide, and that ordinary steps read nothing back."""

import os
import signal

import pytest
import torch
from accelerate import Accelerator

from accelerate_recipes import RecipeError, StepGuard, StepMeter


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def run_steps(guard, losses, first_step=1):
    """Feed one loss per optimizer step; return the steps whose update the guard skipped."""
    skipped = []
    for offset, loss in enumerate(losses):
        guard.observe(torch.tensor(loss))
        if guard.skip_update(first_step + offset):
            skipped.append(first_step + offset)
    return skipped


def test_a_nonfinite_loss_is_reported_at_the_next_check_with_its_own_step(accelerator):
    guard = StepGuard(accelerator, last_checkpoint=lambda: "checkpoints/step_00000002")
    try:
        assert run_steps(guard, [1.0, 0.9, float("nan"), float("inf"), 0.8]) == []  # nothing skipped, nothing read
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
    assert meter.interval_seconds() == pytest.approx(meter.durations[-1])  # only the steps since the last call
    assert meter.samples_per_second == pytest.approx(4 * 32 / sum(meter.durations[1:]))  # warm-up step left out
