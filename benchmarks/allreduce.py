#!/usr/bin/env python
"""All-reduce bandwidth between the processes of a launch: what DDP pays for every gradient
exchange.

    make allreduce-8gpu                                  # 8 GPUs over NCCL (any accelerate config works)
    make allreduce-2node NODE_RANK=0 MASTER_ADDR=10.0.0.1
    make allreduce-cpu                                   # 2 CPU processes over gloo
    accelerate launch --config_file accelerate_configs/2gpu.yaml --gpu_ids 0,4 benchmarks/allreduce.py

For each message size it times `torch.distributed.all_reduce` (sum) and prints, as nccl-tests define
them:
    algbw = bytes / time         what one process sees
    busbw = algbw x 2(n-1)/n     the traffic per link of a ring all-reduce, comparable across
                                 process counts
A ring all-reduce of K bytes over n processes sends 2(n-1)K/n bytes over each link, so busbw
approaches the slowest link's bandwidth: ~1.25 GB/s on 10 GbE, tens of GB/s over PCIe, hundreds over
NVLink. Each size is checked once, untimed: rank r contributes r + 1, so every element must equal
n(n+1)/2 (ones where that sum would not be exact in the dtype).
"""

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env

from accelerate_recipes import RecipeError, check_process_group, run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def human(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.4g} {unit}"
        num_bytes /= 1024


def fill_and_expected(world: int, rank: int, dtype) -> tuple[float, float]:
    """(this rank's value, the exact sum) for the correctness check.

    Every partial sum of a ring or tree all-reduce is a sum of some ranks' values; while all of them
    are integers the dtype holds exactly (up to 2^24 in fp32, 2^11 in fp16, only 2^8 in bf16) the
    check can be exact, with no false alarm from rounding. Rank r sends r + 1 while n(n+1)/2 fits
    (distinct values: a rank counted twice or left out shows up); otherwise the first ranks, as many
    as fit, send 1 and the rest 0.
    """
    # 2^(significand bits): every integer up to it is exact
    exact_up_to = round(2 / torch.finfo(dtype).eps)
    if world * (world + 1) // 2 <= exact_up_to:
        return float(rank + 1), world * (world + 1) / 2
    return float(rank < exact_up_to), float(min(world, exact_up_to))


def measure(num_bytes: int, dtype, device, warmup: int, iters: int, world: int, rank: int) -> dict:
    """Time one message size; returns seconds per all-reduce, algbw and busbw in GB/s, and whether
    sums were right.

    The buffer is filled and its sum checked once, before the clock starts: the timed loop holds
    only all_reduce calls (a fill per call would be timed as bandwidth). The timed calls run on
    zeros, which stay zeros.
    """
    numel = max(1, num_bytes // torch.tensor([], dtype=dtype).element_size())
    value, expected = fill_and_expected(world, rank, dtype)
    tensor = torch.full((numel,), value, dtype=dtype, device=device)
    dist.all_reduce(tensor)
    correct = bool(torch.all(tensor == expected).item())
    tensor.zero_()
    for _ in range(warmup):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    # The slowest process defines the collective's time.
    seconds = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    seconds = seconds.item()
    size = numel * tensor.element_size()
    algbw = size / seconds / 1e9
    ok = torch.tensor([1 if correct else 0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {
        "bytes": size,
        "seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (world - 1) / world,
        "correct": bool(ok.item()),
    }


def main(
    min_bytes: int = 1024,
    max_bytes: int | None = None,
    factor: int = 4,
    dtype: str = "fp32",
    warmup: int = 5,
    iters: int | None = None,
    output_dir: str = "outputs/allreduce",
):
    """Measure all-reduce time and bandwidth from MIN_BYTES to MAX_BYTES across all launched
    processes.

    Args:
        min_bytes: smallest message.
        max_bytes: largest message; default 1 GiB on GPUs, 64 MiB on the CPU (gloo is slow and RAM
            is shared).
        factor: each size is this many times the previous one.
        dtype: fp32, bf16 or fp16 (DDP all-reduces gradients in the parameters' dtype, fp32 unless
            you changed it).
        warmup: untimed all-reduces per size (connection set-up, NCCL's first-call cost).
        iters: timed all-reduces per size; default 20 on GPUs, 5 on the CPU.
        output_dir: where allreduce.json goes (one entry per size, plus world size, backend and
            device).
    """
    if dtype not in DTYPES:
        raise RecipeError(f"unknown --dtype {dtype!r}; choose fp32, bf16 or fp16")
    # Starts the process group the launcher asked for: NCCL
    # on GPUs, gloo on the CPU (ACCELERATE_USE_CPU=true).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    check_process_group(state)
    world, rank, device = state.num_processes, state.process_index, state.device
    if world < 2:
        raise RecipeError(
            "all-reduce needs at least 2 processes; launch with a multi-process config, e.g. "
            "make allreduce-cpu or accelerate launch --config_file accelerate_configs/2gpu.yaml "
            "benchmarks/allreduce.py"
        )
    on_gpu = device.type == "cuda"
    max_bytes = max_bytes or (2**30 if on_gpu else 2**26)
    iters = iters or (20 if on_gpu else 5)
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    backend = dist.get_backend()
    state.print(
        f"all-reduce (sum, {dtype}) over {world} processes, backend {backend}, device {device.type}; "
        "busbw = algbw x 2(n-1)/n"
    )
    state.print(f"{'size':>10} | {'time (ms)':>10} | {'algbw GB/s':>10} | {'busbw GB/s':>10} | ok")
    rows = []
    for size in sizes:
        row = measure(size, DTYPES[dtype], device, warmup, iters, world, rank)
        rows.append(row)
        state.print(
            f"{human(row['bytes']):>10} | {row['seconds'] * 1e3:>10.3f} | {row['algbw_gbps']:>10.3f} | "
            f"{row['busbw_gbps']:>10.3f} | {'yes' if row['correct'] else 'NO'}"
        )
    if state.is_main_process:
        path = Path(output_dir) / "allreduce.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "benchmark": "allreduce",
                    "world_size": world,
                    "backend": backend,
                    "device": device.type,
                    "dtype": dtype,
                    "iters": iters,
                    "sizes": rows,
                },
                indent=2,
            )
        )
        peak = max(rows, key=lambda r: r["busbw_gbps"])
        print(f"peak busbw {peak['busbw_gbps']:.3f} GB/s at {human(peak['bytes'])}; saved {path}")
    if not all(r["correct"] for r in rows):
        raise RecipeError(
            "some all-reduce results were wrong: the interconnect or driver corrupts data; "
            "check `nvidia-smi`, NCCL_P2P_DISABLE=1 as a test, and the cabling"
        )
    state.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
