"""torch.compile with a net under it, and what a run compiled.

A compiled path that the user did not ask for (compiled by default on a GPU) must never end a first
run: when the toolchain inductor needs is missing, when dynamo or a backend fails, when a CUDA graph
cannot be captured, or when torch's recompile limit is reached, the path goes on eagerly, the failed
call is run again eagerly, and one line names the cause and the flags. A path the user asked for
(--compile) stops with that line instead.

CompileTally counts, for results.json, the graphs compiled, the recompiles among them and the
seconds spent compiling, from torch's own counters and compile callbacks.
"""

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import astuple, dataclass, field
from pathlib import Path

import torch

from accelerate_recipes.errors import RecipeError, first_line

TROUBLESHOOTING = "docs/troubleshooting.md#compiling"
# a CUDA graph that could not be recorded
CAPTURE_FAILURE = re.compile(r"captur|cuda ?graph", re.IGNORECASE)


def compile_failure(error: BaseException) -> bool:
    """Whether `error`, raised by a compiled call, is the compiler's (dynamo, AOTAutograd, inductor,
    the recompile limit) or a CUDA graph's capture, rather than the model's own (a shape error, out
    of memory)."""
    from torch._dynamo.exc import (
        BackendCompilerFailed,
        FailOnRecompileLimitHit,
        InternalTorchDynamoError,
        Unsupported,
    )
    from torch._inductor.exc import InductorError

    own_errors = (
        BackendCompilerFailed,
        FailOnRecompileLimitHit,
        InternalTorchDynamoError,
        Unsupported,
        InductorError,
    )
    if isinstance(error, own_errors):
        return True
    return isinstance(error, RuntimeError) and bool(CAPTURE_FAILURE.search(str(error)))


def failure_cause(error: BaseException) -> str:
    """The cause of a compile failure in a few words: the recompile limit, or the error's type and
    first line."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if isinstance(error, FailOnRecompileLimitHit):
        limit = torch._dynamo.config.recompile_limit
        return f"torch's recompile limit ({limit} graphs of one function) was reached"
    cause = f"{type(error).__name__}: "
    # BackendCompilerFailed: the backend's own error
    inner = getattr(error, "inner_exception", None)
    if isinstance(inner, BaseException):
        cause += f"{type(inner).__name__}: "
        error = inner
    return cause + first_line(error)[:200]


def _executable(name: str | None) -> str | None:
    return shutil.which(name) if name else None


def missing_toolchain(device, backend: str = "inductor") -> str | None:
    """What inductor lacks to generate code for `device` (its C or C++ compiler, Python's headers,
    Triton on a GPU), in one phrase with its fix; None when all is there or the backend generates no
    code (aot_eager)."""
    if backend != "inductor":
        return None
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if not headers.is_file():
        return f"Python's headers are missing ({headers}; apt-get install python3-dev)"
    if torch.device(device).type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (pip install triton)"
        # Triton builds its kernels' launcher with $CC, else the first of cc, gcc, clang
        compilers = [os.environ.get("CC"), "cc", "gcc", "clang"]
        if not any(map(_executable, compilers)):
            return "no C compiler for Triton (set CC, or apt-get install gcc)"
        return None
    from torch._inductor import config

    searched = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    if not any(map(_executable, searched)):
        names = ", ".join(name for name in searched if name)
        return f"no C++ compiler for inductor ({names} not found; set CXX, or apt-get install g++)"
    return None


# ---------------------------------------------------------------------------------------- the tally
@dataclass
class CompileCounts:
    """Graphs compiled, recompiles among those compilations, and the seconds they took."""

    graphs: int = 0
    recompiles: int = 0
    seconds: float = 0.0

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(*(a - b for a, b in zip(astuple(self), astuple(other))))

    def __add__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(*(a + b for a, b in zip(astuple(self), astuple(other))))


class _ProcessTally:
    """This process's compilations so far, from dynamo's compile callbacks (a compile id
    "frame/attempt": attempt 1 and above recompile a frame) and its graph counter. Installed at the
    first use."""

    def __init__(self):
        self.recompiles, self.seconds, self._started = 0, 0.0, None
        self.listen()

    def listen(self) -> None:
        """Register the callbacks, again after torch._dynamo.reset() (which drops every
        callback)."""
        from torch._dynamo.callback import callback_handler

        if self._start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)

    def _start(self, args) -> None:
        self._started = time.perf_counter()
        attempt = re.search(r"(\d+)/(\d+)", str(args.compile_id))
        self.recompiles += bool(attempt and int(attempt.group(2)) > 0)

    def _end(self, args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def counts(self) -> CompileCounts:
        from torch._dynamo.utils import counters

        return CompileCounts(counters["stats"]["unique_graphs"], self.recompiles, self.seconds)


_tally: _ProcessTally | None = None


def process_compile_counts() -> CompileCounts:
    """What this process has compiled so far (counting starts at the first call: call it before
    compiling)."""
    global _tally
    if _tally is None:
        _tally = _ProcessTally()
    _tally.listen()
    return _tally.counts()


# ---------------------------------------------------------------------------------- a compiled path
@dataclass
class CompiledPath:
    """One part of a run that may be compiled (the decoder blocks, the decode step, the model):
    whether the user asked for it, whether it went on eagerly and why, and what it compiled.

    `what` names the part in messages; `skip` and `insist` are the flags that turn the attempt off
    or make a failure an error ("--nocompile", "--compile")."""

    what: str
    skip: str
    insist: str
    explicit: bool = False
    # torch.compile's backend for the path: inductor generates code, aot_eager does not
    backend: str = "inductor"
    attempted: bool = True  # False: not compiled in this run (not asked for, not the default here)
    fallback: str | None = None
    counts: CompileCounts = field(default_factory=CompileCounts)
    when_eager: list = field(default_factory=list)  # what puts the compiled parts back to eager

    @property
    def eager(self) -> bool:
        return self.fallback is not None or not self.attempted

    def fall_back(self, cause: str, all_ranks_alike: bool = False) -> None:
        """Go on eagerly with one line that names `cause` (from the main process alone when
        `all_ranks_alike`); a RecipeError instead when the user asked for it."""
        if self.explicit:
            raise RecipeError(
                f"{self.insist}: {self.what} could not compile ({cause}); fix that (see "
                f"{TROUBLESHOOTING}) or run without {self.insist}"
            )
        self.fallback = cause
        rank = os.environ.get("RANK", "0")
        if all_ranks_alike and rank != "0":
            return
        where = "" if rank == "0" else f" (rank {rank})"
        print(
            f"{self.what} run eagerly{where}: {cause} ({self.skip} skips the attempt, "
            f"{self.insist} makes it an error)",
            file=sys.stderr,
            flush=True,
        )

    def check_toolchain(self, device, backend: str = "inductor") -> bool:
        """Before the first step: whether inductor has what it needs here; if not, fall_back (or the
        error)."""
        missing = missing_toolchain(device, backend)
        if missing is not None:
            self.fall_back(missing, all_ranks_alike=True)
        return missing is None

    @contextlib.contextmanager
    def counting(self):
        """Add what is compiled within to this path's counts."""
        before = process_compile_counts()
        try:
            yield
        finally:
            self.counts = self.counts + (process_compile_counts() - before)

    def call(self, compiled, eager, *args, **kwargs):
        """compiled(*args, **kwargs), or eager(...) once this path has gone eager; a compile failure
        makes it go eager (fall_back, then each of `when_eager`) and the call is made again eagerly,
        so that nothing is skipped."""
        if not self.eager:
            try:
                with self.counting():
                    return compiled(*args, **kwargs)
            except Exception as error:
                if not compile_failure(error):
                    raise
                self.fall_back(failure_cause(error))
                for undo in self.when_eager:
                    undo()
        return eager(*args, **kwargs)

    def figures(self, prefix: str, seconds_key: str) -> dict:
        """This path's counts for results.json, under `prefix` (compile_graphs, ... or
        decode_graphs, ...)."""
        return {
            f"{prefix}_graphs": self.counts.graphs,
            f"{prefix}_recompiles": self.counts.recompiles,
            seconds_key: round(self.counts.seconds, 2),
            f"{prefix}_fallback": self.fallback,
        }


def fail_loudly_in_forward() -> None:
    """Compile failures surface where a compiled call can catch them: the backward graph compiled
    with the forward (AOTAutograd would otherwise compile it at the first backward, outside any
    call), and the recompile limit an error rather than a silent eager run."""
    torch._functorch.config.force_non_lazy_backward_lowering = True
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def compile_modules(modules, backend, path: CompiledPath) -> None:
    """torch.compile each module in place (Module.compile: its hooks inside), each call through
    `path`: on a compile failure every module of the path goes back to its eager call and the failed
    call is made again eagerly."""
    modules = list(modules)
    fail_loudly_in_forward()
    process_compile_counts()  # the tally starts before the first compilation

    def back_to_eager() -> None:
        for module in modules:
            module._compiled_call_impl = None  # nn.Module's own slot for Module.compile's wrapper

    path.when_eager.append(back_to_eager)
    for module in modules:
        module.compile(backend=backend)
        module._compiled_call_impl = functools.partial(
            path.call, module._compiled_call_impl, module._call_impl
        )


def compile_results(since: CompileCounts) -> dict:
    """results.json's compile counts of a run that compiles only when asked (--compile, a launcher's
    --dynamo_backend): what this process compiled after `since` (process_compile_counts before
    prepare); a failure there is an error (the command line prints it in one line), so nothing falls
    back."""
    counts = process_compile_counts() - since
    path = CompiledPath("the model", "--nocompile", "--compile", explicit=True, counts=counts)
    return path.figures("compile", "compile_seconds")


COMPILE_SUMMARY_KEYS = ["compile_graphs", "compile_recompiles", "compile_seconds", "compile_fallback"]
DECODE_SUMMARY_KEYS = ["decode_graphs", "decode_recompiles", "decode_compile_seconds", "decode_fallback"]


def compile_summary_keys(results: dict) -> list[str]:
    """The compile counts worth a line of a run's summary table: those of a path that compiled or
    fell back."""
    keys = []
    for group in (COMPILE_SUMMARY_KEYS, DECODE_SUMMARY_KEYS):
        graphs, fallback = results.get(group[0]), results.get(group[-1])
        if graphs or fallback:
            keys += group
    return keys
