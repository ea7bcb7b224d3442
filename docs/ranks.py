#!/usr/bin/env python
"""Print who is who in a distributed launch: node, rank, local rank, world size, and each process's
share of the data.

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 4 \
        --num_cpu_threads_per_process 1 docs/ranks.py

See docs/concepts.md for the multi-node version and what the numbers mean.
"""

import os

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env


def main(dataset_size: int = 40):
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    rank, world, local_rank = state.process_index, state.num_processes, state.local_process_index
    # torchrun (under accelerate launch) sets the node's rank here
    node = int(os.environ.get("GROUP_RANK", 0))
    # DistributedSampler's rule: process r takes samples r, r + world, r + 2 x world, ...
    share = list(range(dataset_size))[rank::world]
    # One all-reduce: every process adds rank + 1; all of them end with the same total.
    total = torch.tensor([rank + 1.0], device=state.device)
    if world > 1:
        dist.all_reduce(total)
    for turn in range(world):  # print in rank order
        if turn == rank:
            print(
                f"node {node} | rank {rank:>2} of world size {world} | local rank {local_rank} | "
                f"samples {share} | all-reduce sum {total.item():g}",
                flush=True,
            )
        state.wait_for_everyone()
    if state.is_main_process:
        print(
            f"world size {world} = {world // max(1, int(os.environ.get('LOCAL_WORLD_SIZE', world)))} node(s) "
            f"x {os.environ.get('LOCAL_WORLD_SIZE', world)} process(es) per node; "
            f"the sum 1 + ... + {world} = {world * (world + 1) // 2}",
            flush=True,
        )


if __name__ == "__main__":
    import fire

    fire.Fire(main)
