"""Training throughput and memory, measured the same way in every recipe."""

import resource
import statistics
import sys
import time

import torch


class StepMeter:
    """Wall time of each optimizer step (data loading included, evaluation excluded) and samples per second.

    Call `restart()` before training and after every pause (evaluation, checkpointing), and `step(n)` after each
    optimizer step with the number of samples all processes consumed in it. The first `warmup_steps` steps
    (allocator growth, cuDNN autotuning, lazy initialisation) are left out of the throughput when there are more.
    """

    def __init__(self, device: torch.device, warmup_steps: int = 1):
        self.device = device
        self.warmup_steps = warmup_steps
        self.durations: list[float] = []
        self.samples: list[int] = []
        self._last: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels have finished, not just been queued
        return time.perf_counter()

    def restart(self) -> None:
        self._last = self._now()

    def step(self, samples: int) -> float:
        now = self._now()
        duration = now - (self._last if self._last is not None else now)
        self._last = now
        self.durations.append(duration)
        self.samples.append(samples)
        return duration

    def _measured(self) -> tuple[list[float], list[int]]:
        skip = self.warmup_steps if len(self.durations) > self.warmup_steps else 0
        return self.durations[skip:], self.samples[skip:]

    @property
    def train_seconds(self) -> float:
        return sum(self.durations)

    @property
    def samples_per_second(self) -> float:
        durations, samples = self._measured()
        return sum(samples) / sum(durations) if durations and sum(durations) > 0 else 0.0

    @property
    def median_step_seconds(self) -> float:
        durations, _ = self._measured()
        return statistics.median(durations) if durations else 0.0


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process and what it counts: GPU memory allocated by tensors, or the host's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "host_max_rss"
