"""What a launcher gave this process, as `rank<N>.json` in the folder named by the first argument.

The launcher tests start this instead of a recipe: it imports only torch and accelerate's state, so
a config that starts 16 processes stays cheap, and the all-reduce proves that every process joined
one process group.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState

# As the recipes do: without GPUs, ACCELERATE_USE_CPU asks for one CPU process group over gloo.
state = PartialState(cpu=os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"))
joined = torch.ones(1)
if state.num_processes > 1:
    torch.distributed.all_reduce(joined)
record = {
    "rank": state.process_index,
    "local_rank": state.local_process_index,
    "world_size": state.num_processes,
    # the node's rank, as torch's elastic agent exports it
    "machine_rank": int(os.environ.get("GROUP_RANK", "0")),
    "joined": int(joined.item()),
    "distributed_type": state.distributed_type.value,
    "mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),
    "extra_args": sys.argv[2:],
}
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{state.process_index}.json").write_text(json.dumps(record))
state.wait_for_everyone()
state.destroy_process_group()
