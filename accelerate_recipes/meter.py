"""Training throughput and memory, measured the same way in every recipe."""

import math
import os
import resource
import statistics
import sys
import time

import torch


class StepMeter:
    """Wall time of each optimizer step (data loading included, evaluation excluded) and samples per
    second.

    Call `restart()` before training and after every pause (evaluation, checkpointing), and
    `step(n)` after each optimizer step with the number of samples all processes consumed in it. On
    a GPU `step` only records a CUDA event (the host does not wait for the GPU); the durations are
    read when asked for: `interval_seconds()` at log steps, the totals at the end. The first steps
    (allocator growth, cuDNN autotuning, lazy initialisation; a LoRA run's first three steps took
    about 3 s each on an H100, its median 0.45 s) are left out of the throughput: `warmup_steps` of
    them once a run has 4 x as many, fewer in shorter runs, one when there are two or more.
    """

    def __init__(self, device: torch.device, warmup_steps: int = 3):
        self.device = torch.device(device)
        self.warmup_steps = warmup_steps
        self.durations: list[float] = []
        self.samples: list[int] = []
        self._start = None  # the mark the next step's duration counts from
        # (mark, samples) of steps not yet converted to seconds
        self._pending: list[tuple[object, int]] = []
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
        """Mean seconds per step since the previous call (a host read on a GPU: call it at log steps
        only)."""
        self._flush()
        recent = self.durations[self._interval_from :]
        self._interval_from = len(self.durations)
        return sum(recent) / len(recent) if recent else 0.0

    def warmup_skipped(self) -> int:
        """How many of the first steps the run's figures leave out (see the class's docstring)."""
        self._flush()
        steps = len(self.durations)
        return min(self.warmup_steps, max(1, steps // 4)) if steps > 1 else 0

    def _measured(self) -> tuple[list[float], list[int]]:
        skip = self.warmup_skipped()
        return self.durations[skip:], self.samples[skip:]

    @property
    def warmup_seconds(self) -> float:
        """Wall seconds of the warm-up steps left out of the throughput (a compiled model compiles
        in them)."""
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


# Dense bf16 tensor-core peaks from NVIDIA's data sheets:
# the denominator of model FLOP utilisation (MFU).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """The peak of a device named as torch or nvidia-smi name it ("NVIDIA H100 80GB HBM3"); None
    when not listed."""
    return next((value for key, value in PEAK_TFLOPS.items() if key in device_name), None)


def flop_utilisation(flops_per_second: float, device: torch.device, processes: int) -> float | None:
    """Model FLOP utilisation: the model's FLOPs per second (all processes) over the peak of
    `processes` devices like this one; None off a GPU or on one whose peak is not listed."""
    device = torch.device(device)
    peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return flops_per_second / (peak * 1e12 * processes) if peak else None


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process and what it counts: GPU memory allocated by tensors, or the
    host's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "host_max_rss"


class StepParts:
    """Where each optimizer step of this process goes, beside its length (StepMeter): waiting for
    data and waiting in communication; the rest is compute. TrainingProgress gathers the figures of
    every process at log steps.

    - data: host seconds in the loader's `next()` (`TrainingProgress.timed`). On a GPU the host runs
      ahead of the device, so this wait costs step time only when the device ran out of queued work
      meanwhile.
    - communication: under DDP, from this process's last gradient of the step (a hook after the
      gradient of every parameter the optimizer updates) to the start of the optimizer update (its
      step pre-hook): the wait for the gradient all-reduce to finish, that is for the slowest
      process plus the part of the transfer the backward pass did not hide, and the clipping.
      Timed with CUDA events on the compute stream on a GPU (read at log steps only) and on the
      host clock on the CPU, where gloo's wait blocks the host. Under FSDP and DeepSpeed the
      collectives interleave with the compute layer by layer, with no one boundary between them:
      communication is not measured (None) and compute holds it.
    - compute: the step's length less both (forward, backward, the update, the loop's host work).

    Under DDP every process's step lasts as long as the slowest one's: the others wait for it in
    communication, so a slow process shows as the one that computes (or waits for data) longest
    and waits least in communication.
    """

    def __init__(self, device: torch.device, optimizers=(), ddp: bool = False):
        self.device = torch.device(device)
        self.data: list[float] = []  # per step
        self.comm: list[float | None] = []  # per step; None where not measured
        self._data = 0.0  # the current step's data wait so far
        self._grads = None  # the mark of the current step's latest gradient
        self._update = None  # the mark of the current step's optimizer update
        self._pending: list[tuple] = []  # (grads mark, update mark) of the steps not yet read
        self._interval_from = 0
        self.measures_comm = ddp  # `optimizers` update a DDP model's parameters
        if not ddp:
            return
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's wrapper
            if not hasattr(inner, "register_step_pre_hook"):
                continue
            inner.register_step_pre_hook(self._update_starts)
            for group in inner.param_groups:
                for parameter in group["params"]:
                    if parameter.requires_grad:
                        parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    def _mark(self, previous=None):
        if self.device.type == "cuda":
            event = previous or torch.cuda.Event(enable_timing=True)
            event.record()  # recorded again, it keeps the latest: behind the kernels queued so far
            return event
        return time.perf_counter()

    def _gradient_ready(self, parameter) -> None:
        self._grads = self._mark(self._grads)

    def _update_starts(self, optimizer, args, kwargs) -> None:
        self._update = self._mark()

    def data_waited(self, seconds: float) -> None:
        self._data += seconds

    def step(self) -> None:
        """After an optimizer step: close its figures."""
        self.data.append(self._data)
        self._pending.append((self._grads, self._update))
        self._data, self._grads, self._update = 0.0, None, None

    def _flush(self) -> None:
        if not self._pending:
            return
        if self.device.type == "cuda" and self.measures_comm:
            torch.cuda.current_stream(self.device).synchronize()  # a log step: all marks are done
        for grads, update in self._pending:
            if grads is None or update is None:  # not DDP, or an update the guard or scaler skipped
                self.comm.append(None)
            elif self.device.type == "cuda":
                self.comm.append(max(grads.elapsed_time(update) / 1000, 0.0))
            else:
                self.comm.append(max(update - grads, 0.0))
        self._pending = []

    def _means(self, start: int) -> tuple[float, float | None]:
        self._flush()
        data = self.data[start:]
        comm = [c for c in self.comm[start:] if c is not None]
        return (sum(data) / len(data) if data else 0.0), (sum(comm) / len(comm) if comm else None)

    def interval_means(self) -> tuple[float, float | None]:
        """(data, communication) seconds a step since the previous call (on a GPU a host read: call
        it at log steps only)."""
        means = self._means(self._interval_from)
        self._interval_from = len(self.data)
        return means

    def run_means(self, skip: int) -> tuple[float, float | None]:
        """(data, communication) seconds a step over the run, less its first `skip` (warm-up)
        steps."""
        return self._means(skip)


FIGURES = ("step_seconds", "data_seconds", "comm_seconds", "compute_seconds")
SLOW_MARGIN = 0.2  # a slow process is busy (data + compute) 20% longer than the others' median ...
SLOW_MIN_SECONDS = 0.005  # ... and 5 ms longer a step (tiny steps jitter by more than 20%) ...
SLOW_LOG_STEPS = 3  # ... at this many log steps in a row


def node_index(process_index: int) -> int:
    """This process's node: GROUP_RANK (set by torchrun, so by accelerate launch), else its rank
    over the processes of a node."""
    if os.environ.get("GROUP_RANK", "").isdigit():
        return int(os.environ["GROUP_RANK"])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return process_index // int(local) if local.isdigit() and int(local) > 0 else 0


class ProcessFigures:
    """Every process's step time, data wait and communication wait side by side (StepParts says
    what each measures), gathered onto the main process, by process and by node; and the one-line
    warning when one process is persistently slower than the others: busy (data + compute)
    SLOW_MARGIN longer than the median of the others at SLOW_LOG_STEPS log steps in a row. Under DDP
    the others then wait for it in communication at every step, so one slow GPU (another job on it,
    a hot or throttled card) or a node slow to load data slows them all."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.node = node_index(accelerator.process_index)
        self.streak = (None, 0)  # (the rank found slow at the latest log steps, how many in a row)
        self.slow_processes: list[int] = []  # the ranks warned about, once each

    def gather(self, step: float, data: float, comm: float | None) -> list[dict]:
        """Every process's figures, in rank order. Collective: all processes call it alike."""
        mine = [step, data, math.nan if comm is None else comm, float(self.node)]
        if self.accelerator.num_processes > 1:
            values = torch.tensor(mine, dtype=torch.float32, device=self.accelerator.device)
            rows = self.accelerator.gather(values).reshape(-1, len(mine)).tolist()
        else:
            rows = [mine]
        figures = []
        for rank, (step_s, data_s, comm_s, node) in enumerate(rows):
            comm_s = None if math.isnan(comm_s) else comm_s
            compute = max(step_s - data_s - (comm_s or 0.0), 0.0)
            row = dict(rank=rank, node=int(node), step_seconds=step_s, data_seconds=data_s)
            row.update(comm_seconds=comm_s, compute_seconds=compute)
            figures.append(row)
        return figures

    @staticmethod
    def by_node(rows: list[dict]) -> dict[int, dict]:
        """The mean of each figure over a node's processes (None where one was not measured)."""
        nodes = {}
        for node in sorted({row["node"] for row in rows}):
            mine = [row for row in rows if row["node"] == node]
            nodes[node] = {}
            for name in FIGURES:
                values = [row[name] for row in mine]
                nodes[node][name] = None if None in values else statistics.fmean(values)
        return nodes

    @staticmethod
    def tracked(rows: list[dict]) -> dict:
        """The tracker's keys: process/<figure>/rank<r> and node/<figure>/node<n> (SwanLab groups
        charts by the first part, so each figure's processes and nodes sit side by side)."""
        values = {}
        for row in rows:
            for name in FIGURES:
                if row[name] is not None:
                    values[f"process/{name}/rank{row['rank']}"] = row[name]
        for node, figures in ProcessFigures.by_node(rows).items():
            for name, value in figures.items():
                if value is not None:
                    values[f"node/{name}/node{node}"] = value
        return values

    def check_slow(self, rows: list[dict], step: int) -> str | None:
        """Judge one log step's figures: the warning line when a process has now been slow at
        SLOW_LOG_STEPS log steps in a row (once a process), else None."""
        if len(rows) < 2 or any(row["comm_seconds"] is None for row in rows):
            return None  # one process, or no boundary between compute and communication
        busy = [row["data_seconds"] + row["compute_seconds"] for row in rows]
        slowest = max(range(len(rows)), key=busy.__getitem__)
        others = statistics.median(b for rank, b in enumerate(busy) if rank != slowest)
        if busy[slowest] < others * (1 + SLOW_MARGIN) or busy[slowest] - others < SLOW_MIN_SECONDS:
            self.streak = (None, 0)
            return None
        previous, count = self.streak
        self.streak = (slowest, count + 1 if previous == slowest else 1)
        if self.streak[1] < SLOW_LOG_STEPS or slowest in self.slow_processes:
            return None
        self.slow_processes.append(slowest)
        row = rows[slowest]
        waits = statistics.median(r["comm_seconds"] for r in rows if r["rank"] != slowest)
        return (
            f"warning: process {slowest} (node {row['node']}) is the slowest at {SLOW_LOG_STEPS} "
            f"log steps in a row (step {step}): busy {busy[slowest]:.3g} s a step (compute "
            f"{row['compute_seconds']:.3g} s, data {row['data_seconds']:.3g} s) against "
            f"{others:.3g} s on the others, which wait {waits:.3g} s a step for it in "
            f"communication (it waits {row['comm_seconds']:.3g} s); one busy GPU or CPU slows "
            "them all: look for another job or a throttled device there"
        )
