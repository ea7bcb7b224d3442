"""How one step runs: a fresh folder, its commands launched as users launch them (accelerate launch
with a config of accelerate_configs/, or plain python), each within the step's own limit and what is
left of --budget, and its record. The steps themselves are in steps/, one class per family;
calls.Check puts them together."""

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .machine import now
from .paths import CONFIGS, REPO
from .processes import Interrupted, stop
from .run_outputs import discard_weights, measured_parts, read_json, tail

# `accelerate launch` through this interpreter: its
# console script need not sit beside it (or exist at all).
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


def config_precision(name: str) -> str:
    """The mixed_precision an accelerate config of accelerate_configs/ sets."""
    import yaml  # a dependency of accelerate, which reads its configs with it

    return str(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()).get("mixed_precision", "no"))


class StepRunner:
    """Runs a call's steps one by one and collects their records; the families in steps/ add the
    steps."""

    def __init__(self, out: Path, gpus: int, quick: bool, deadline: float):
        self.out, self.gpus, self.quick, self.deadline = out, gpus, quick, deadline
        self.cuda = gpus > 0
        self.results: list[dict] = []
        self.cut = False  # set when the budget stopped a command of the running step
        self.running: set[subprocess.Popen] = set()  # the commands started and not yet ended
        # the running step's commands, by log name: seconds each took
        self.seconds: dict[str, float] = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", SWANLAB_MODE="disabled")
        # Every step's processes import this checkout's packages, installed or not; a PYTHONPATH
        # already set (wheels unpacked with pip --target) stays behind it.
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )
        if not self.cuda:
            self.env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")

    def folder(self, name: str) -> Path:
        path = self.out / name
        # fresh: a recipe refuses to start over an earlier run's checkpoints
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def launch(self, config: str, processes: int | None = None) -> list[str]:
        """`accelerate launch` with a config of accelerate_configs/; on the CPU, gloo processes as
        `make *-cpu` (the sharded configs keep theirs: the recipes run FSDP2 and DeepSpeed over gloo
        too)."""
        if not self.cuda:
            on_cpu = config if config in ("fsdp", "deepspeed") else "cpu"
            return [
                *ACCELERATE,
                "launch",
                "--config_file",
                str(CONFIGS / f"{on_cpu}.yaml"),
                "--num_processes",
                str(processes or 2),
                "--num_cpu_threads_per_process",
                "1",
            ]
        command = [*ACCELERATE, "launch", "--config_file", str(CONFIGS / f"{config}.yaml")]
        return command + (["--num_processes", str(processes)] if processes else [])

    def single(self) -> list[str]:
        """One process on one device: 1gpu.yaml on a GPU, plain python on the CPU."""
        return self.launch("1gpu") if self.cuda else [sys.executable]

    def limit(self, timeout: float) -> tuple[float, str]:
        """Seconds a command may run: its own TIMEOUT or what is left of --budget, and which of the
        two it is."""
        left = self.deadline - time.monotonic()
        return (
            (max(1.0, left), "what was left of --budget")
            if left < timeout
            else (timeout, "the step's own limit")
        )

    def start(self, command: list, log: Path, env: dict | None = None) -> subprocess.Popen:
        """COMMAND in a session of its own (a signal to gpu-check does not reach it; stop() ends
        it), output to LOG."""
        with log.open("w") as handle:  # the child holds its own copy of the file
            handle.write("$ " + " ".join(map(str, command)) + "\n")
            handle.flush()
            proc = subprocess.Popen(
                [str(c) for c in command],
                cwd=REPO,
                env=env or self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.running.add(proc)
        return proc

    def wait(self, proc: subprocess.Popen, seconds: float, which: str) -> int:
        """PROC's exit status, or 124 after stopping it when SECONDS pass (a cut when WHICH is the
        budget)."""
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.cut = self.cut or "budget" in which or time.monotonic() >= self.deadline
            stop(proc)
            return 124

    def execute(
        self, command: list[str], run_dir: Path, timeout: float, log_name: str = "log.txt"
    ) -> tuple[int, str]:
        """Run one command with its output in RUN_DIR/log.txt; (exit status, last lines). 124: over
        its time."""
        timeout, which = self.limit(timeout)
        log = run_dir / log_name
        started = time.monotonic()
        code = self.wait(self.start(command, log), timeout, which)
        self.seconds[Path(log_name).stem] = time.monotonic() - started
        last = tail(log)
        if code == 124:
            last = f"stopped after {timeout:.0f} s, {which}\n{last}"
        return code, last

    def step(self, name: str, body, timeout: float) -> dict:
        """Run one step's BODY(run_dir, timeout) -> (status, commands, figures, detail); its record.
        A failure that the budget caused (a command stopped when --budget ran out) is recorded as
        incomplete, not failed."""
        print(f"== {name}", flush=True)
        run_dir = self.folder(name)
        started = time.perf_counter()
        self.cut = interrupted = False
        self.seconds = {}
        try:
            status, commands, figures, detail = body(run_dir, timeout)
        except Interrupted:
            status, commands, figures, detail = "incomplete", [], {}, "gpu-check was stopped by a signal"
            interrupted = True
        except Exception as err:  # a broken step is a failed step, the others still run
            status, commands, figures, detail = "fail", [], {}, f"{type(err).__name__}: {err}"
        # whatever the body left running (an exception, a signal) ends with it
        for proc in list(self.running):
            stop(proc)
        self.running.clear()
        # a measurement keeps its figures and logs, not the models and checkpoints
        discard_weights(run_dir)
        if status == "fail" and self.cut:
            status, detail = "incomplete", f"cut short when --budget ran out; {detail}"
        record = {
            "step": name,
            "status": status,
            "commands": commands,
            "wall_seconds": round(time.perf_counter() - started, 1),
            "figures": figures,
            "detail": detail,
            "timing": self.timing(run_dir),
            "output_dir": str(run_dir),
            "finished_at": now(),
            "host": platform.node(),
        }
        self.results.append(record)
        print(
            f"   {status}{': ' + detail.splitlines()[-1] if detail else ''} ({record['wall_seconds']} s)",
            flush=True,
        )
        if interrupted:
            raise Interrupted
        return record

    def timing(self, run_dir: Path) -> dict[str, dict]:
        """What each command of the step took, by its log's name, with the parts its run's
        results.json tells (measured_parts): a run of a chat step writes
        RUN_DIR/<name>/results.json, a step of one command RUN_DIR/results.json."""
        timing = {}
        for name, seconds in self.seconds.items():
            results = read_json(run_dir / name / "results.json") or (
                read_json(run_dir / "results.json") if name == "log" else {}
            )
            timing[name] = measured_parts(seconds, results)
        return timing

    def simple(self, command, run_dir, timeout, figures, expect: int = 0):
        """One command; pass when it exits EXPECT and figures(run_dir) works."""
        code, last = self.execute(command, run_dir, timeout)
        shown = " ".join(map(str, command))
        if code != expect:
            return (
                "fail",
                [shown],
                {},
                f"exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}",
            )
        return "pass", [shown], figures(run_dir), ""
