"""Command-line entry point shared by the recipes."""

import os
import sys

import fire
from tqdm.std import tqdm  # every bar, whatever its front end, is listed in tqdm.std.tqdm._instances


# EX_TEMPFAIL from sysexits.h, "temporary failure, the user is invited to retry": a run stopped by SIGTERM or SIGUSR1
# after saving a checkpoint exits with it, so a job script can tell "requeue me" from a failure.
PREEMPTED_EXIT_CODE = 75


class RecipeError(Exception):
    """A problem the user can fix. Printed as one line (cause and fix), without a traceback."""


def address_in_use(err: Exception) -> bool:
    """Whether a socket or torch store error says the port is taken."""
    return "EADDRINUSE" in str(err) or "address already in use" in str(err).lower()


def port_in_use(address: str, port) -> RecipeError:
    """The error for a rendezvous port that another process holds."""
    return RecipeError(
        f"port {port} on {address} is in use (another run, or a stale process of an earlier one): pick another with "
        f"--main_process_port / MASTER_PORT, or find it with `ss -ltnp | grep :{port}`"
    )


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint; the message says where and how to continue."""


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


def expand_preset(argv: list[str], presets: dict[str, dict]) -> list[str]:
    """`--preset NAME` stands for that preset's flags; a flag also given on the command line keeps the given value."""
    name = None
    for i, arg in enumerate(argv):
        if arg.startswith("--preset="):
            name = arg.split("=", 1)[1]
        elif arg == "--preset" and i + 1 < len(argv):
            name = argv[i + 1]
    if name is None:
        return argv
    if name not in presets:
        raise RecipeError(f"unknown --preset {name!r}; choose one of: {', '.join(presets) or 'none defined'}")
    given = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    return [f"--{flag}={value}" for flag, value in presets[name].items() if flag not in given] + argv


def _close_progress_bars() -> None:
    """End any open tqdm bar, so that the message that follows starts on a line of its own."""
    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()


def run(main, presets: dict[str, dict] | None = None) -> None:
    """Run `main` as a command-line program: flags come from its signature and docstring (python-fire).

    `presets` maps a name to flag values that `--preset NAME` applies (see expand_preset).
    """
    argv = _drop_legacy_local_rank(sys.argv[1:])
    try:
        argv = expand_preset(argv, presets or {})
        fire.Fire(main, command=argv, name=os.path.basename(sys.argv[0]))
    except RecipeError as err:
        _close_progress_bars()
        rank = os.environ.get("RANK", "0")
        prefix = "error" if rank == "0" else f"error (rank {rank})"
        print(f"{prefix}: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Preempted as stop:
        _close_progress_bars()
        if os.environ.get("RANK", "0") == "0":
            print(f"stopped: {stop}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)
