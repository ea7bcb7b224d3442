#!/usr/bin/env python
"""When the model does not fit: one chat model fine-tuned in full under DDP, FSDP2 and DeepSpeed
ZeRO-3 on the same processes, with the memory each strategy plans and uses per process and the step
time it costs.

    python benchmarks/sharding.py run                       # 2 CPU processes, or every GPU of this machine
    python benchmarks/sharding.py run --processes 4 --strategies ddp,fsdp
    python benchmarks/sharding.py run --model Qwen/Qwen2.5-0.5B-Instruct --train_file a.jsonl \\
        --validation_file b.jsonl
    # a table from finished runs
    python benchmarks/sharding.py report --run_dir outputs/sharding/ddp --run_dir my-runs/fsdp
    make sharding

Each strategy runs recipes/sft.py with its config of accelerate_configs/ (cpu.yaml or 8gpu.yaml for
DDP, fsdp.yaml, deepspeed.yaml), the same model, data, global batch and steps. Without --model it
trains a generated model of Qwen2's architecture (hidden 768, 6 blocks, 38M parameters, random
weights, fp32) on generated conversations: no download.

The report (sharding.md and sharding.json in the output folder) gives per strategy the recipe's
memory plan per process (weights, gradients, optimizer states, activations, total), the measured
peak of the largest process, the step time, and how plan and peak differ from DDP's. DDP keeps
everything on every process; FSDP2 and ZeRO-3 keep 1/N of the weights, gradients and optimizer
states on each of N processes and gather each block's weights when it runs, which costs
communication every step. On a GPU the measured peak is what PyTorch's allocator handed out, the
figure the plan predicts. On the CPU it is the process's peak resident memory: the Python / PyTorch
runtime (about 0.9 GB) plus what the host's allocator keeps of freed buffers, which the gathers and
scatters of sharding churn; there the plan columns show the division and the peak shows what a CPU
run really costs (docs/concepts.md, section 6).
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from gpu_check.processes import free_port  # the package beside this file

from accelerate_recipes.cli import RecipeError, run

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
SFT = REPO / "recipes" / "sft.py"
STRATEGIES = {"ddp": "DDP", "fsdp": "FSDP2", "zero3": "ZeRO-3"}
# A full fine-tune (sharding matters most there) of short conversations: the steps are few and the
# activations small, so weights, gradients and optimizer states decide the memory.
LESSON_FLAGS = {
    "--batch_size": "4",
    "--max_length": "256",
    "--max_steps": "6",
    "--epochs": "1",
    "--lr": "1e-4",
    "--log_every": "1",
    "--checkpoint_every": "0",
    "--tracker": "none",
    "--num_workers": "0",
}
# Qwen2's architecture (grouped-query attention, gated MLP, tied embeddings) at 38M parameters.
LESSON_SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)
PLAN_PARTS = ("weights", "gradients", "optimizer", "activations", "logits", "total")


def config_of(strategy: str, cuda: bool) -> str:
    return {"fsdp": "fsdp", "zero3": "deepspeed"}.get(strategy, "8gpu" if cuda else "cpu")


def sft_arguments(model, train_file, validation_file, sft_args: str) -> list[str]:
    """The recipe's flags: the lesson's, where sft_args does not give its own, then sft_args."""
    extra = shlex.split(sft_args)
    given = {a.split("=")[0] for a in extra if a.startswith("--")}
    flags = [x for name, value in LESSON_FLAGS.items() if name not in given for x in (name, value)]
    data = ["--model", str(model), "--train_file", str(train_file), "--validation_file", str(validation_file)]
    return [*data, *flags, *extra]


def launch_command(strategy: str, processes: int, cuda: bool, precision: str, port: int) -> list[str]:
    """`accelerate launch` through this interpreter (its console script need not sit beside it)."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    command += [
        "--config_file",
        str(CONFIGS / f"{config_of(strategy, cuda)}.yaml"),
        "--num_processes",
        str(processes),
    ]
    command += ["--mixed_precision", precision, "--main_process_port", str(port)]
    if not cuda:
        # one core per process, as one GPU per process
        command += ["--num_cpu_threads_per_process", "1"]
    return command


def lesson_assets(folder: Path) -> tuple[Path, Path, Path]:
    """The generated model, its chat tokenizer and conversations (see the module's help)."""
    from chat_assets import write_chat_assets  # beside this file

    assets = write_chat_assets(folder, LESSON_SHAPE, train=256, validation=16, dtype="float32")
    return Path(assets["model"]), Path(assets["train"]), Path(assets["validation"])


def figures(run_dir: Path) -> dict:
    """One run's row from its results.json."""
    path = run_dir / "results.json"
    if not path.is_file():
        raise RecipeError(f"{run_dir} has no results.json: pass the output folders of finished sft.py runs")
    results = json.loads(path.read_text())
    plan = results.get("memory_plan_mb")
    if not plan:
        raise RecipeError(f"{path} has no memory_plan_mb: it is not a chat recipe (sft.py) run")
    kind = results.get("distributed_type", "?")
    return {
        "run": str(run_dir),
        "strategy": {"MULTI_CPU": "DDP", "MULTI_GPU": "DDP", "FSDP": "FSDP2", "DEEPSPEED": "ZeRO-3"}.get(
            kind, kind
        ),
        "processes": results["world_size"],
        "method": results.get("method"),
        "parameters": results.get("parameters"),
        "mixed_precision": results.get("mixed_precision"),
        "plan_mb": {k: plan[k] for k in PLAN_PARTS if k in plan},
        "peak_memory_mb": results["peak_memory_mb"],
        "peak_memory_kind": results.get("peak_memory_kind", ""),
        "median_step_seconds": results["median_step_seconds"],
        "train_tokens_per_second": results.get("train_tokens_per_second"),
        "train_loss_last": results.get("train_loss_last"),
        "eval_loss": results.get("eval_loss"),
    }


def markdown(rows: list[dict]) -> str:
    base = next((r for r in rows if r["strategy"] == "DDP"), rows[0])
    versus = base["strategy"]
    head = (
        "| strategy | processes | weights MB | gradients MB | optimizer MB | activations MB | planned MB | "
        f"measured peak MB | planned vs {versus} | measured vs {versus} | step s | tokens/s | eval loss |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        plan = r["plan_mb"]
        activations = plan.get("activations", 0) + plan.get("logits", 0)
        tokens = r["train_tokens_per_second"]
        planned, peak = plan["total"], r["peak_memory_mb"]
        lines.append(
            f"| {r['strategy']} | {r['processes']} | {plan.get('weights', 0):,.0f} | "
            f"{plan.get('gradients', 0):,.0f} | "
            f"{plan.get('optimizer', 0):,.0f} | {activations:,.0f} | {planned:,.0f} | {peak:,.0f} | "
            f"{planned - base['plan_mb']['total']:+,.0f} | {peak - base['peak_memory_mb']:+,.0f} | "
            f"{r['median_step_seconds']:.2f} | {'-' if tokens is None else f'{tokens:,.0f}'} | "
            f"{'-' if r['eval_loss'] is None else format(r['eval_loss'], '.4f')} |"
        )
    kind = rows[0]["peak_memory_kind"]
    lines.append(
        "\nPer process; activations include the logits. Measured peak: "
        + (
            "the largest process's peak resident memory (host RAM), the Python / PyTorch runtime included."
            if kind == "host_max_rss"
            else "the largest process's peak of memory PyTorch allocated on its GPU."
        )
    )
    return "\n".join(lines)


def report(run_dir: str | list[str] | None = None, output_dir: str = "outputs/sharding") -> None:
    """The table of finished sft.py runs (DDP first when there is one), printed and written to
    OUTPUT_DIR.

    Args:
        run_dir: the output folder of a finished sft.py run; repeat the flag for each run to compare
        output_dir: where sharding.md and sharding.json go
    """
    runs = [run_dir] if isinstance(run_dir, str) else list(run_dir or [])
    write_report([Path(d) for d in runs], Path(output_dir))


def write_report(run_dirs: list[Path], out: Path) -> list[dict]:
    if not run_dirs:
        raise RecipeError(
            "give finished sft.py runs: report --run_dir outputs/sharding/ddp --run_dir outputs/other"
        )
    rows = sorted((figures(d) for d in run_dirs), key=lambda r: r["strategy"] != "DDP")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    (out / "sharding.md").write_text(table + "\n")
    (out / "sharding.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)
    print(f"\nwritten: {out / 'sharding.md'}, {out / 'sharding.json'}")
    return rows


def train(
    strategies: str = "ddp,fsdp,zero3",
    processes: int | None = None,
    model: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    mixed_precision: str | None = None,
    sft_args: str = "",
    output_dir: str = "outputs/sharding",
) -> None:
    """Fine-tune one model under each strategy on the same processes, then print the report.

    Args:
        strategies: comma-separated, of ddp (a whole copy per process), fsdp (FSDP2), zero3
            (DeepSpeed ZeRO-3)
        processes: processes per strategy (default: every GPU here, at least 2; 2 on the CPU)
        model: a chat model (Hub name or folder) with --train_file and --validation_file; default:
            the generated one
        train_file: conversations for training (JSON/JSONL, any format sft.py reads)
        validation_file: conversations for evaluation
        mixed_precision: no, bf16 or fp16 (default: bf16 on GPUs, no on the CPU)
        sft_args: more sft.py flags as one string, --sft_args="--lora_r 16
            --gradient_checkpointing"; they override the lesson's (--batch_size 4 --max_length 256
            --max_steps 6 --lr 1e-4, full fine-tune)
        output_dir: one folder per strategy, and the report
    """
    import torch

    chosen = [s.strip() for s in (strategies.split(",") if isinstance(strategies, str) else strategies)]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown or not chosen:
        raise RecipeError(
            f"--strategies {','.join(unknown) or '(none)'}: choose from {', '.join(STRATEGIES)}"
        )
    if "zero3" in chosen and importlib_missing("deepspeed"):
        raise RecipeError(
            "zero3 needs DeepSpeed: make deepspeed-extra (or pip install deepspeed), or leave zero3 out"
        )
    if (model is None) != (train_file is None) or (train_file is None) != (validation_file is None):
        raise RecipeError("give --model, --train_file and --validation_file together, or none of them")
    cuda = torch.cuda.is_available()
    processes = int(processes or max(2, torch.cuda.device_count()))
    if processes < 2:
        raise RecipeError(f"--processes {processes}: sharding divides the model over 2 or more processes")
    if cuda and processes > torch.cuda.device_count():
        raise RecipeError(
            f"--processes {processes}: this machine has {torch.cuda.device_count()} GPU(s); sharding needs 2 "
            "or more, "
            'or run the lesson on 2 CPU processes: CUDA_VISIBLE_DEVICES="" make sharding'
        )
    precision = mixed_precision or ("bf16" if cuda else "no")
    out = Path(output_dir)
    if model is None:
        print("generating the lesson's model and conversations ...", flush=True)
        model, train_file, validation_file = lesson_assets(out / "assets")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if not cuda:
        # gloo processes; the recipes run FSDP2 and DeepSpeed over gloo too
        env["ACCELERATE_USE_CPU"] = "true"
    arguments = sft_arguments(model, train_file, validation_file, sft_args)
    run_dirs = []
    for strategy in chosen:
        run_dir = out / strategy
        if (run_dir / "checkpoints").exists() or (run_dir / "results.json").exists():
            raise RecipeError(f"{run_dir} holds an earlier run: remove it or pass another --output_dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [*launch_command(strategy, processes, cuda, precision, free_port()), str(SFT)]
        command += [*arguments, "--output_dir", str(run_dir)]
        print(f"== {STRATEGIES[strategy]} on {processes} process(es): {run_dir}", flush=True)
        log = run_dir / "log.txt"
        with log.open("w") as sink:
            code = subprocess.run(
                command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO
            ).returncode
        if code:
            tail = "\n".join(log.read_text().splitlines()[-12:])
            raise RecipeError(f"{STRATEGIES[strategy]} failed (exit {code}); the end of {log}:\n{tail}")
        run_dirs.append(run_dir)
    write_report(run_dirs, out)


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    run({"run": train, "report": report})
