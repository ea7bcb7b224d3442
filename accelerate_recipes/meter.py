"""Training throughput and memory, measured the same way in every recipe."""

import resource
import statistics
import sys
import time

import torch


class StepMeter:
    """Wall time of each optimizer step (data loading included, evaluation excluded) and samples per second.

    Call `restart()` before training and after every pause (evaluation, checkpointing), and `step(n)` after each
    optimizer step with the number of samples all processes consumed in it. On a GPU `step` only records a CUDA event
    (the host does not wait for the GPU); the durations are read when asked for: `interval_seconds()` at log steps,
    the totals at the end. The first steps (allocator growth, cuDNN autotuning, lazy initialisation; a LoRA run's
    first three steps took about 3 s each on an H100, its median 0.45 s) are left out of the throughput:
    `warmup_steps` of them once a run has 4 x as many, fewer in shorter runs, one when there are two or more.
    """

    def __init__(self, device: torch.device, warmup_steps: int = 3):
        self.device = torch.device(device)
        self.warmup_steps = warmup_steps
        self.durations: list[float] = []
        self.samples: list[int] = []
        self._start = None  # the mark the next step's duration counts from
        self._pending: list[tuple[object, int]] = []  # (mark, samples) of steps not yet converted to seconds
        self._interval_from = 0  # index into durations where the current log interval began

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # queued behind the step's kernels: it completes when they have
            return event
        return time.perf_counter()

    def _flush(self) -> None:
        """Turn the recorded marks into seconds (on a GPU this waits for the last recorded step)."""
        if not self._pending:
            return
        if self.device.type == "cuda":
            self._pending[-1][0].synchronize()
        previous = self._start
        for mark, samples in self._pending:
            if previous is None:
                seconds = 0.0
            elif self.device.type == "cuda":
                seconds = previous.elapsed_time(mark) / 1000
            else:
                seconds = mark - previous
            self.durations.append(seconds)
            self.samples.append(samples)
            previous = mark
        self._start = previous
        self._pending = []

    def restart(self) -> None:
        self._flush()
        self._start = self._mark()

    def step(self, samples: int) -> None:
        self._pending.append((self._mark(), samples))

    def interval_seconds(self) -> float:
        """Mean seconds per step since the previous call (a host read on a GPU: call it at log steps only)."""
        self._flush()
        recent = self.durations[self._interval_from :]
        self._interval_from = len(self.durations)
        return sum(recent) / len(recent) if recent else 0.0

    def _measured(self) -> tuple[list[float], list[int]]:
        self._flush()
        steps = len(self.durations)
        skip = min(self.warmup_steps, max(1, steps // 4)) if steps > 1 else 0
        return self.durations[skip:], self.samples[skip:]

    @property
    def warmup_seconds(self) -> float:
        """Wall seconds of the warm-up steps left out of the throughput (a compiled model compiles in them)."""
        durations, _ = self._measured()
        return self.train_seconds - sum(durations)

    @property
    def train_seconds(self) -> float:
        self._flush()
        return sum(self.durations)

    @property
    def samples_per_second(self) -> float:
        durations, samples = self._measured()
        return sum(samples) / sum(durations) if durations and sum(durations) > 0 else 0.0

    @property
    def median_step_seconds(self) -> float:
        durations, _ = self._measured()
        return statistics.median(durations) if durations else 0.0


# Dense bf16 tensor-core peaks from NVIDIA's data sheets: the denominator of model FLOP utilisation (MFU).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """The peak of a device named as torch or nvidia-smi name it ("NVIDIA H100 80GB HBM3"); None when not listed."""
    return next((value for key, value in PEAK_TFLOPS.items() if key in device_name), None)


def flop_utilisation(flops_per_second: float, device: torch.device, processes: int) -> float | None:
    """Model FLOP utilisation: the model's FLOPs per second (all processes) over the peak of `processes` devices like
    this one; None off a GPU or on one whose peak is not listed."""
    device = torch.device(device)
    peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return flops_per_second / (peak * 1e12 * processes) if peak else None


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process and what it counts: GPU memory allocated by tensors, or the host's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "host_max_rss"
