"""A run stopped by SIGTERM, as a scheduler stops it, and resumed."""

import signal
import sys
import time

from accelerate_recipes.cli import PREEMPTED_EXIT_CODE

from ..paths import RECIPES
from ..processes import stop
from ..run_outputs import read_json, tail
from ..runner import StepRunner, config_precision


class PreemptionSteps(StepRunner):
    """preempt: SIGTERM, exit 75 with a checkpoint, and --resume auto to the end."""

    def preempt(self, run_dir, timeout):
        """SIGTERM a CIFAR run after a few steps: exit 75 and a checkpoint; --resume auto then runs
        to the end.

        Within the step's time and what is left of --budget: half of it for reaching step 3, half of
        the rest for the exit after SIGTERM, the remainder for the resumed run."""
        sizes = (
            ["--synthetic_size", "80", "--batch_size", "8"]
            if self.quick or not self.cuda
            else ["--synthetic_size", "50000", "--batch_size", "512"]
        )
        # Plain python on one device, so that the signal goes to the training process itself as a
        # scheduler's would; on a GPU in the precision 1gpu.yaml gives the other steps (the launcher
        # is what would read it).
        precision = ["--mixed_precision", config_precision("1gpu")] if self.cuda else []
        command = [
            sys.executable,
            RECIPES / "cifar.py",
            "--dataset",
            "synthetic",
            *sizes,
            "--epochs",
            "1",
            "--log_every",
            "1",
            "--checkpoint_every",
            "0",
            "--tracker",
            "none",
            "--num_workers",
            "0",
            *precision,
            "--output_dir",
            run_dir,
        ]
        shown = [
            " ".join(map(str, command)),
            "kill -TERM <pid> after step 3",
            " ".join(map(str, command)) + " --resume auto",
        ]
        seconds, which = self.limit(timeout)
        started = time.monotonic()
        end = started + seconds
        log = run_dir / "log.txt"
        proc = self.start(command, log)
        metrics = run_dir / "metrics.jsonl"
        steps = 0
        while proc.poll() is None and time.monotonic() < started + seconds / 2:
            steps = metrics.read_text().count('"train/loss"') if metrics.is_file() else 0
            if steps >= 3:
                break
            time.sleep(0.2)
        if proc.poll() is not None:
            return "fail", shown, {}, f"the run ended (exit {proc.returncode}) before step 3:\n{tail(log)}"
        if steps < 3:
            self.cut = "budget" in which
            stop(proc)
            return (
                "fail",
                shown,
                {"steps_reached": steps},
                f"step 3 not reached within {seconds / 2:.0f} s (half of {which}, {seconds:.0f} "
                f"s):\n{tail(log)}",
            )
        signalled_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait = max(1.0, (end - signalled_at) / 2)
        code = self.wait(proc, wait, which)
        if code == 124:
            return "fail", shown, {}, f"no exit within {wait:.0f} s of SIGTERM ({which}):\n{tail(log)}"
        stop_seconds = time.monotonic() - signalled_at
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if p.is_dir())
        if code != PREEMPTED_EXIT_CODE or not checkpoints:
            return (
                "fail",
                shown,
                {"exit_code": code, "checkpoints": checkpoints},
                f"expected exit {PREEMPTED_EXIT_CODE} and a checkpoint; got exit {code}, "
                f"{checkpoints}:\n{tail(log)}",
            )
        code, last = self.execute(
            command + ["--resume", "auto"], run_dir, end - time.monotonic(), "resume.txt"
        )
        results = read_json(run_dir / "results.json")
        figures = {
            "stop_exit_code": PREEMPTED_EXIT_CODE,
            "checkpoints": checkpoints,
            "seconds_from_sigterm_to_exit": round(stop_seconds, 2),
            "resumed_from": results.get("resumed_from"),
            "steps": results.get("steps"),
            "total_steps": results.get("total_steps"),
            "mixed_precision": results.get("mixed_precision"),
        }
        if code != 0 or not results.get("resumed_from") or results.get("steps") != results.get("total_steps"):
            return "fail", shown, figures, f"resume: exit {code}; last lines:\n{last}"
        return "pass", shown, figures, ""
