"""Command-line entry point shared by the recipes."""

import os
import sys

import fire


class RecipeError(Exception):
    """A problem the user can fix. Printed as one line (cause and fix), without a traceback."""


def _drop_legacy_local_rank(argv: list[str]) -> list[str]:
    # `python -m torch.distributed.launch` appends --local-rank=N (or --local_rank N); the rank also arrives in the
    # LOCAL_RANK environment variable, which Accelerate reads, so the flag carries nothing we need.
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg.startswith(("--local-rank=", "--local_rank=")):
            continue
        if arg in ("--local-rank", "--local_rank"):
            skip_next = True
            continue
        kept.append(arg)
    return kept


def run(main) -> None:
    """Run `main` as a command-line program: flags come from its signature and docstring (python-fire)."""
    argv = _drop_legacy_local_rank(sys.argv[1:])
    try:
        fire.Fire(main, command=argv, name=os.path.basename(sys.argv[0]))
    except RecipeError as err:
        rank = os.environ.get("RANK", "0")
        prefix = "error" if rank == "0" else f"error (rank {rank})"
        print(f"{prefix}: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
