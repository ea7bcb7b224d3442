#!/usr/bin/env python
"""Host-read audit: run a recipe and count every read of a tensor's value on the host, per optimizer
step.

    python benchmarks/host_reads.py recipes/cifar.py --dataset synthetic --max_steps 6 --log_every 1000
    python benchmarks/host_reads.py --output reads.json recipes/text_classification.py --model ... \\
        --train_file ...
    # torchrun works the same way
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \\
        benchmarks/host_reads.py recipes/cifar.py --dataset synthetic ...

The audit's own flags come before the script; everything from the script on is the script's command
line. The script runs in this process as __main__ (runpy), so plain python, `accelerate launch` and
torchrun all work unchanged.

What counts as a host read: Tensor.item, tolist, numpy, __array__, cpu, .to("cpu") and copy_ into a
CPU tensor, bool(t), float(t), int(t), complex(t), t used as an index (__index__), formatting or
printing a tensor, `x in t`, torch.equal / allclose / is_nonzero. (On a CPU-only run `.to(device)`
counts only with the literal string "cpu": there `.to(accelerator.device)` also lands on the CPU,
and on a GPU machine it would not be a read.) On a GPU each of them waits for the queue to drain.
Ops whose output shape depends on the data (nonzero, masked_select, unique, boolean-mask indexing,
one-argument where) also wait on a GPU; they are listed separately as "shape" reads and fail the
check only with --strict. torch.cuda.synchronize() calls are counted as "sync". On CUDA the audit
also turns on torch.cuda.set_sync_debug_mode("warn") and counts each synchronisation warning, which
sees what the op list cannot (syncs inside C++ kernels, in other libraries).

Time is split at optimizer steps (torch.optim's global step hook, so any optimizer counts): interval
k holds what runs after optimizer step k and before step k + 1; interval 0 is the set-up and the
first forward/backward. Allowed to read: interval 0, the log steps (step 1, every --log_every steps,
the last step), the checkpoint steps (every --checkpoint_every steps) and the steps given with
--allow (epoch ends of multi-epoch runs). log_every and checkpoint_every come from the script's
flags, else from the defaults of its main(). Every other interval is quiet and must have no reads.
Run one epoch with a large --log_every and --checkpoint_every 0 to get a long quiet stretch.

Not counted:
- reads inside data loading: any frame on the stack in torch/utils/data, accelerate/data_loader.py
  or transformers/data, or in a function whose name contains "collate". Those tensors are built on
  the host, before the copy to the device, so on a GPU they are CPU tensors and reading them waits
  for nothing. The device data path (recipes/cifar_data.py) keeps its tensors on the GPU and is
  audited like the loop.
- reads of torch.optim's own step counters (0-dim CPU tensors read inside torch/optim unless
  capturable or fused): they stay on the host on a GPU too.
- on CUDA, reads of tensors that live on the CPU (listed under "host_tensor_reads", no wait
  involved).
Counted apart, as expected: under fp16 the GradScaler (torch's, which accelerate's optimizer wrapper
steps) reads its found_inf flag on the host in every optimizer step, to decide there whether to skip
optimizer.step. That one read per step, and the CUDA synchronisation it causes, are listed under
"grad_scaler_reads" and "grad_scaler_cuda_syncs" and fail nothing; bf16 and fp32 have no scaler and
no such read.
Limits: a read inside the Python body of another overridable torch function (F.interpolate, say) is
not seen separately; reads in DataLoader worker processes are not seen (they are data loading
anyway).

Output: a JSON file per process (--output, else $HOST_READS_OUTPUT, else OUTPUT_DIR/host_reads.json
when the script has --output_dir, else ./host_reads.json; rank r > 0 writes host_reads.rank<r>.json
beside it) with per-interval counts and the read sites (file:line of the first frame in recipes/,
accelerate_recipes/ or the script's folder, the op and the innermost frame it came through), and a
table printed by rank 0. The exit status is the script's, or 1 when it succeeded but a quiet
interval has reads (--check False turns that off).
"""

import ast
import collections
import inspect
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
READ_OPS = {
    "item",
    "tolist",
    "numpy",
    "__array__",
    "cpu",
    "__bool__",
    "__float__",
    "__int__",
    "__complex__",
    "__index__",
    "__format__",
    "__repr__",
    "__str__",
    "__contains__",
    "equal",
    "allclose",
    "is_nonzero",
}
SHAPE_OPS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique2"}
INDEX_OPS = {"__getitem__", "__setitem__", "index_put_", "index_put"}
DATA_LOADING = (
    f"torch{os.sep}utils{os.sep}data{os.sep}",
    f"accelerate{os.sep}data_loader.py",
    f"transformers{os.sep}data{os.sep}",
)
OPTIM_DIR = f"torch{os.sep}optim{os.sep}"
# torch/amp/grad_scaler.py (FSDP's sharded scaler inherits
# the method): where the fp16 scaler reads found_inf
GRAD_SCALER_FILE, GRAD_SCALER_STEP = "grad_scaler.py", "_maybe_opt_step"
GRAD_SCALER_NOTE = (
    "fp16 GradScaler: reads found_inf on the host once per optimizer step to decide whether to skip "
    "optimizer.step; expected under fp16"
)
# "called a synchronizing CUDA operation" from set_sync_debug_mode("warn")
SYNC_WARNING = "synchroniz"


def fail(message: str):
    sys.exit(f"error: {message}")


# ----------------------------------------------------------------------------------- what a call is
def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _is_cpu_target(args, kwargs, on_cuda: bool) -> bool:
    """Whether a Tensor.to(...) call copies a device tensor to the CPU.

    On CUDA: a CUDA tensor sent to the CPU (device as str, torch.device or another tensor). On a
    CPU-only run every tensor is already there, and `.to(accelerator.device)` would go to the GPU on
    a GPU machine, so only the literal string "cpu" counts.
    """
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if on_cuda and (source is None or source.device.type == "cpu"):
        return False
    for value in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
        if isinstance(value, str) and value.split(":")[0] == "cpu":
            return True
        if on_cuda and isinstance(value, torch.device) and value.type == "cpu":
            return True
        if on_cuda and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return True
    return False


def classify(name: str, args, kwargs, on_cuda: bool = False) -> str | None:
    """'read', 'shape' or None (not a host read) for one torch call."""
    if name in READ_OPS:
        return "read"
    if name == "to":
        return "read" if _is_cpu_target(args, kwargs, on_cuda) else None
    if (
        name == "copy_"
        and len(args) > 1
        and isinstance(args[0], torch.Tensor)
        and isinstance(args[1], torch.Tensor)
    ):
        # On a CPU-only run every tensor is on the CPU; a
        # copy between two CPU tensors is not a read.
        return "read" if args[0].device.type == "cpu" and args[1].device.type != "cpu" else None
    if name in SHAPE_OPS:
        return "shape"
    if name == "where" and len(args) == 1 and not kwargs:
        return "shape"
    if name in INDEX_OPS and len(args) > 1:
        index = args[1]
        if any(t.dtype == torch.bool for t in _tensors(index)):
            return "shape"
    if (
        name == "repeat_interleave"
        and "output_size" not in kwargs
        and any(isinstance(a, torch.Tensor) for a in args[1:2])
    ):
        return "shape"
    return None


# ----------------------------------------------------------------------------------------- recorder
class Audit:
    """Counts host reads per optimizer-step interval; `mode()` is the TorchFunctionMode that sees
    them."""

    def __init__(self, script: Path):
        self.step = 0
        self.project = [str(REPO / "recipes"), str(REPO / "accelerate_recipes"), str(script.parent)]
        try:  # the installed package, when it is not this checkout's
            import accelerate_recipes

            self.project.append(str(Path(accelerate_recipes.__file__).parent))
        except ImportError:
            pass
        self.project = [p + os.sep for p in dict.fromkeys(self.project)]
        self.me = str(Path(__file__).resolve())
        self.on_cuda = torch.cuda.is_available()
        # (kind, site, op, via) -> {interval: count}
        self.sites: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.excluded = collections.Counter()
        self.cuda_syncs = collections.Counter()
        self.hook = register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, _optimizer, _args, _kwargs) -> None:
        self.step += 1

    def _where(self, frame):
        """(project site, innermost frame outside this file, whether data loading is on the stack,
        whether the call comes from the fp16 GradScaler deciding to step or skip the optimizer)."""
        site, via, loading, scaler = None, None, False, False
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename != self.me:
                if via is None:
                    via = f"{_short(filename)}:{frame.f_lineno}"
                if any(part in filename for part in DATA_LOADING) or "collate" in frame.f_code.co_name:
                    loading = True
                if frame.f_code.co_name == GRAD_SCALER_STEP and filename.endswith(GRAD_SCALER_FILE):
                    scaler = True
                if site is None and any(filename.startswith(p) for p in self.project):
                    site = f"{_short(filename)}:{frame.f_lineno}"
            frame = frame.f_back
        return site, via, loading, scaler

    def record(self, kind: str, op: str, tensor=None, frame=None) -> None:
        site, via, loading, scaler = self._where(frame or sys._getframe(1))
        if loading:
            self.excluded["data_loading"] += 1
            return
        on_cpu = isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
        if on_cpu and via and OPTIM_DIR in via.replace("/", os.sep) and tensor.dim() == 0:
            self.excluded["optimizer_step_counters"] += 1
            return
        if scaler and kind == "read":
            # found_inf, once per optimizer step under fp16: known, reported apart
            kind = "grad_scaler"
        elif self.on_cuda and on_cpu and kind != "sync":
            kind = "host_tensor"  # nothing to wait for
        self.sites[(kind, site or via or "?", op, via or "?")][self.step] += 1

    def count_cuda_sync(self, frame) -> None:
        while frame is not None and frame.f_code.co_filename == warnings.__file__:
            frame = frame.f_back  # from the warning machinery up to the code that synchronised
        site, via, loading, scaler = self._where(frame)
        if not loading:
            if not scaler:
                self.cuda_syncs[self.step] += 1
            kind = "grad_scaler_sync" if scaler else "cuda_sync"
            self.sites[(kind, site or via or "?", "sync warning", via or "?")][self.step] += 1

    def mode(self) -> TorchFunctionMode:
        audit = self

        class HostReads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                kind = classify(name, args, kwargs, audit.on_cuda)
                if kind:
                    first = next(_tensors(args), None)
                    audit.record(kind, name, first, sys._getframe(1))
                return func(*args, **kwargs)

        return HostReads()

    # --------------------------------------------------------------------------------------- report
    def summary(self, allowed: set[int], strict: bool) -> dict:
        last = self.step
        failing = {"read", "sync", "cuda_sync"} | ({"shape"} if strict else set())
        intervals = []
        for k in range(last + 1):
            counts = collections.Counter()
            for (kind, *_), per in self.sites.items():
                counts[kind] += per.get(k, 0)
            allowed_here = k == 0 or k in allowed or k >= last
            intervals.append(
                {
                    "interval": k,
                    "after_step": k,
                    "allowed": allowed_here,
                    "reads": counts["read"],
                    "shape": counts["shape"],
                    "sync": counts["sync"],
                    "cuda_syncs": counts["cuda_sync"],
                    "host_tensor_reads": counts["host_tensor"],
                    "grad_scaler_reads": counts["grad_scaler"],
                    "grad_scaler_cuda_syncs": counts["grad_scaler_sync"],
                    "quiet_violations": 0 if allowed_here else sum(counts[c] for c in failing),
                }
            )
        quiet = [i["interval"] for i in intervals if not i["allowed"]]
        sites = []
        for (kind, site, op, via), per in sorted(self.sites.items(), key=lambda kv: -sum(kv[1].values())):
            in_quiet = {k: n for k, n in per.items() if k in quiet}
            sites.append(
                {
                    "kind": kind,
                    "site": site,
                    "op": op,
                    "via": via,
                    "count": sum(per.values()),
                    "quiet_count": sum(in_quiet.values()),
                    "intervals": dict(sorted(per.items())),
                    "fails": kind in failing and bool(in_quiet),
                }
                | ({"note": GRAD_SCALER_NOTE} if kind.startswith("grad_scaler") else {})
            )
        scaler_reads = sum(i["grad_scaler_reads"] for i in intervals)
        return {
            "steps": last,
            "allowed_intervals": sorted(i["interval"] for i in intervals if i["allowed"]),
            "quiet_intervals": quiet,
            "quiet_reads": sum(i["reads"] for i in intervals if not i["allowed"]),
            "quiet_violations": sum(i["quiet_violations"] for i in intervals),
            # The read for step k + 1 happens inside that step, so it falls in interval k.
            "grad_scaler_reads": scaler_reads,
            "grad_scaler_reads_per_step": scaler_reads / last if last else 0.0,
            "intervals": intervals,
            "sites": sites,
            "excluded": dict(self.excluded),
        }


def _short(filename: str) -> str:
    """From site-packages on for a library (also where the venv sits inside the checkout), else
    relative to the checkout, for the report."""
    marker = "site-packages" + os.sep
    if marker in filename:
        return filename.split(marker, 1)[1]
    try:
        return str(Path(filename).resolve().relative_to(REPO))
    except ValueError:
        return filename


# --------------------------------------------------------------------------------- flags of the run
def flag_value(argv: list[str], name: str) -> str | None:
    """The value of --name / --name=value in a command line (the last one wins, as in fire)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def main_defaults(script: Path) -> dict:
    """Literal defaults of the script's flags (log_every, checkpoint_every, ...), read without
    running it: those of the flags dataclass a recipe's main(args) takes, else those of main()'s own
    parameters."""
    from accelerate_recipes.cli import _commands_in_source, as_command

    try:
        command = _commands_in_source(script.read_text())
    except Exception:  # not a script of run(main): its main() is read below
        command = None
    if callable(command):
        return {
            name: param.default
            for name, param in inspect.signature(as_command(command)).parameters.items()
            if param.default is not inspect.Parameter.empty
        }
    tree = ast.parse(script.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            names = [a.arg for a in node.args.args][-len(node.args.defaults) :] if node.args.defaults else []
            defaults = {}
            for name, default in zip(names, node.args.defaults):
                try:
                    defaults[name] = ast.literal_eval(default)
                except ValueError:
                    pass
            for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults):
                if default is not None:
                    try:
                        defaults[arg.arg] = ast.literal_eval(default)
                    except ValueError:
                        pass
            return defaults
    return {}


def allowed_steps(script: Path, argv: list[str], last: int, extra: set[int]) -> tuple[set[int], dict]:
    defaults = main_defaults(script)
    every = {}
    for name in ("log_every", "checkpoint_every"):
        given = flag_value(argv, name)
        every[name] = int(float(given)) if given is not None else int(defaults.get(name) or 0)
    allowed = {1, last} | extra
    for n in every.values():
        if n > 0:
            allowed |= set(range(n, last + 1, n))
    return allowed, every


def output_path(output: str | None, argv: list[str]) -> Path:
    path = output or os.environ.get("HOST_READS_OUTPUT")
    if not path:
        out_dir = flag_value(argv, "output_dir")
        path = str(Path(out_dir) / "host_reads.json") if out_dir else "host_reads.json"
    path = Path(path)
    rank = int(os.environ.get("RANK", "0"))
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def print_table(report: dict) -> None:
    print(
        f"\nhost reads per optimizer step: {report['script']} on {report['device']}, rank {report['rank']} "
        f"of {report['world_size']}, {report['steps']} steps (log_every {report['log_every']}, "
        f"checkpoint_every {report['checkpoint_every']})"
    )
    scaler = report["grad_scaler_reads"] > 0
    print(
        f"{'after step':>10} | {'allowed':>7} | {'reads':>5} | {'shape':>5} | {'sync':>4} | "
        f"{'cuda syncs':>10}" + (f" | {'fp16 scaler':>11}" if scaler else "")
    )
    for i in report["intervals"]:
        cuda = str(i["cuda_syncs"]) if report["sync_debug"] else "-"
        print(
            f"{i['interval']:>10} | {'yes' if i['allowed'] else 'quiet':>7} | {i['reads']:>5} | "
            f"{i['shape']:>5} | "
            f"{i['sync']:>4} | {cuda:>10}" + (f" | {i['grad_scaler_reads']:>11}" if scaler else "")
        )
    if scaler:
        where = ", ".join(
            sorted({f"{s['site']} (via {s['via']})" for s in report["sites"] if s["kind"] == "grad_scaler"})
        )
        print(
            f"expected under fp16: {report['grad_scaler_reads']} GradScaler read(s) of found_inf, "
            f"{report['grad_scaler_reads_per_step']:.3g} per optimizer step, at {where}: the scaler decides "
            "on the host whether to skip optimizer.step (bf16 has no scaler); they fail nothing"
        )
    quiet_sites = [s for s in report["sites"] if s["quiet_count"] and not s["kind"].startswith("grad_scaler")]
    if quiet_sites:
        print("on quiet steps:")
        for s in quiet_sites:
            print(
                f"  {s['kind']:<11} {s['op']:<14} x{s['quiet_count']:<4} {s['site']}"
                + (f"  (via {s['via']})" if s["via"] != s["site"] else "")
            )
    verdict = "PASS" if not report["quiet_violations"] else "FAIL"
    print(
        f"{verdict}: {report['quiet_violations']} read(s) or sync(s) on {len(report['quiet_intervals'])} "
        f"quiet interval(s); saved {report['output']}",
        flush=True,
    )


# --------------------------------------------------------------------------------------------- main
SCRIPT_ARGS: list[str] = []


def audit(
    script: str | None = None,
    output: str | None = None,
    allow: str = "",
    strict: bool = False,
    check: bool = True,
):
    """Run SCRIPT with its flags, counting host reads of tensor values per optimizer step (see the
    module notes).

    Usage: host_reads.py [--output PATH] [--allow 12,24] [--strict] [--check False] SCRIPT [SCRIPT
    FLAGS...]

    Args:
        script: the recipe to run (recipes/cifar.py, recipes/text_classification.py,
            recipes/detect/train.py, ...).
        output: JSON report path; default $HOST_READS_OUTPUT, else OUTPUT_DIR/host_reads.json of the
            script's --output_dir, else ./host_reads.json. Rank r > 0 writes <stem>.rank<r>.json
            beside it.
        allow: comma-separated steps after which reads are allowed besides the log and checkpoint
            steps (epoch ends).
        strict: also fail on data-dependent shapes (nonzero, boolean-mask indexing, unique, ...).
        check: exit 1 when the script succeeded but a quiet interval has reads.
    """
    import runpy

    from accelerate_recipes import cli

    if not script:
        fail(
            "name the script to audit, e.g. host_reads.py recipes/cifar.py --dataset synthetic --max_steps 6"
        )
    path = Path(script).resolve()
    if not path.is_file():
        fail(f"{script} does not exist")
    # fire turns "12,24" into a tuple and "12" into an int
    extra = {
        int(s)
        for s in (allow if isinstance(allow, (tuple, list)) else str(allow).split(","))
        if str(s).strip()
    }
    argv = [str(a) for a in SCRIPT_ARGS]
    recorder = Audit(path)
    sync_debug = recorder.on_cuda
    original_sync = torch.cuda.synchronize

    def counted_synchronize(*args, **kwargs):
        recorder.record("sync", "cuda.synchronize", None, sys._getframe(1))
        return original_sync(*args, **kwargs)

    previous_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            recorder.count_cuda_sync(sys._getframe(1))
            return
        previous_show(message, category, filename, lineno, file, line)

    cli.EXIT_WHEN_DONE = False  # the report is written after the recipe returns, in this process
    sys.argv = [str(path), *argv]
    # as `python SCRIPT` would: sibling modules import (recipes/detect/*)
    sys.path[0] = str(path.parent)
    code, crash = 0, None
    with warnings.catch_warnings():
        warnings.showwarning = show
        if sync_debug:
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
            torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.synchronize = counted_synchronize
        try:
            with recorder.mode():
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code not in (None, 0) and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        # the report of a crashed run still says what was read before the crash
        except BaseException as err:
            code, crash = 1, err
        finally:
            torch.cuda.synchronize = original_sync
            if sync_debug:
                torch.cuda.set_sync_debug_mode("default")
            recorder.hook.remove()

    allowed, every = allowed_steps(path, argv, recorder.step, extra)
    report = {
        "script": _short(str(path)),
        "args": argv,
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "device": torch.cuda.get_device_name() if recorder.on_cuda else "cpu",
        "sync_debug": sync_debug,
        "exit_code": code,
        **every,
        "strict": strict,
        **recorder.summary(allowed, strict),
    }
    out = output_path(output, argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["output"] = str(out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if report["rank"] == 0:
        print_table(report)
    if crash is not None:
        raise crash
    if code:
        sys.exit(code)
    if check and report["quiet_violations"]:
        fail(f"{report['quiet_violations']} host read(s) or sync(s) between log steps; sites in {out}")


def split_argv(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(the audit's flags, the script, the script's flags): the script is the first argument ending
    in .py."""
    for i, arg in enumerate(argv):
        value_of_flag = i and argv[i - 1] in ("--output", "-o", "--allow", "-a")
        if arg.endswith(".py") and not arg.startswith("-") and not value_of_flag:
            return argv[:i], arg, argv[i + 1 :]
    return argv, None, []


if __name__ == "__main__":
    import fire

    own, script_path, rest = split_argv(sys.argv[1:])
    if script_path is None and not any(a in ("--help", "-h") for a in own):
        fail(
            "name the script to audit, e.g. host_reads.py recipes/cifar.py --dataset synthetic --max_steps 6"
        )
    SCRIPT_ARGS[:] = rest  # the script's own flags never pass through fire
    fire.Fire(audit, command=own + (["--script", script_path] if script_path else []), name="host_reads.py")
