"""Measurements over the recipes: benchmarks/bench.py (what `make bench` runs) and
benchmarks/host_reads.py's audit of each recipe's host reads between log steps."""

import shutil
import sys
from pathlib import Path

from ..paths import BENCHMARKS, RECIPES
from ..run_outputs import read_json
from .text import TextSteps

AUDIT = BENCHMARKS / "host_reads.py"


class MeasurementSteps(TextSteps):
    """bench and the host-read audits; the text model and data are the text steps' (TextSteps)."""

    def audit(self, recipe: str):
        def body(run_dir, timeout):
            quiet = [
                "--log_every",
                "1000",
                "--checkpoint_every",
                "0",
                "--tracker",
                "none",
                "--num_workers",
                "0",
            ]
            small = self.quick or not self.cuda
            if recipe == "cifar":
                args = [RECIPES / "cifar.py", "--dataset", "synthetic", "--max_steps", "8", *quiet] + (
                    ["--synthetic_size", "160", "--batch_size", "16"]
                    if small
                    else ["--synthetic_size", "10240", "--batch_size", "512"]
                )
            elif recipe == "text":
                t = self.text()
                args = [
                    RECIPES / "text_classification.py",
                    "--model",
                    t["model"],
                    "--train_file",
                    t["train"],
                    "--validation_file",
                    t["dev"],
                    "--batch_size",
                    "16",
                    "--max_length",
                    "64",
                    "--max_steps",
                    "8",
                    *quiet,
                ]
            else:
                args = [
                    RECIPES / "detect" / "train.py",
                    "--data",
                    "synthetic",
                    "--max_steps",
                    "8",
                    *quiet,
                    "--data_dir",
                    run_dir / "data",
                ] + (
                    ["--synthetic_size", "64", "--image_size", "128", "--batch_size", "8"]
                    if small
                    else ["--synthetic_size", "256", "--image_size", "640", "--batch_size", "32"]
                )
            command = [*self.single(), AUDIT, *args, "--output_dir", run_dir]
            code, last = self.execute(command, run_dir, timeout)
            report = read_json(run_dir / "host_reads.json")
            figures = {
                k: report[k]
                for k in (
                    "steps",
                    "quiet_intervals",
                    "quiet_violations",
                    "quiet_reads",
                    "sync_debug",
                    "device",
                )
                if k in report
            }
            if report:
                figures["cuda_syncs_per_interval"] = [i["cuda_syncs"] for i in report["intervals"]]
                figures["quiet_sites"] = [
                    f"{s['kind']} {s['op']} x{s['quiet_count']} at {s['site']} (via {s['via']})"
                    for s in report["sites"]
                    if s["quiet_count"]
                ][:10]
            shown = [" ".join(map(str, command))]
            if code == 0 and report:
                return "pass", shown, figures, ""
            return "fail", shown, figures, f"exit {code}; last lines:\n{last}"

        return body

    def bench(self, run_dir, timeout):
        t = self.text()
        sizes = ["--batch_size", "8", "--steps", "3", "--images", "128"] if self.quick else []
        command = [
            sys.executable,
            BENCHMARKS / "bench.py",
            *sizes,
            "--text_model",
            t["model"],
            "--text_data",
            Path(t["train"]).parent,
            "--output_dir",
            run_dir,
        ]
        # bench.py reads TEXT_DATA/train.csv and test.csv
        shutil.copy(t["dev"], Path(t["train"]).parent / "test.csv")

        def figures(d):
            report = read_json(d / "bench_results.json")
            rows = {
                r["name"]: {k: r[k] for k in ("a_value", "b_value", "ratio", "unit", "note")}
                for r in report.get("comparisons", [])
            }
            extra = {
                k: report[k]
                for k in ("model_flops_utilisation", "epoch_seconds_50k", "device")
                if k in report
            }
            return {**extra, "comparisons": rows}

        return self.simple(command, run_dir, timeout, figures)
