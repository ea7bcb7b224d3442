#!/usr/bin/env python
"""Supervised fine-tuning (SFT) of a chat model with Hugging Face Accelerate, LoRA or full: 1 GPU, N
GPUs, N nodes.

    python recipes/sft.py --model Qwen/Qwen2.5-0.5B-Instruct --train_file chats.jsonl --lora_r 16
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/sft.py --train_file chats.jsonl
    python recipes/sft.py --predict "Is this review fresh or rotten? A joy." --model outputs/sft
    python recipes/sft.py --chat --model outputs/sft                  # talk to it, answers streamed
    python recipes/sft.py --merge outputs/sft-merged --model outputs/sft   # the adapter merged into its base

One function per mode: train() reads top to bottom (config -> accelerator -> data -> model ->
optimizer -> prepare -> schedule -> resume -> loop -> eval -> save); the other modes live beside it,
--eval_only and --plan_only in sft_modes.py, --predict, --chat and --merge in chat/modes.py; the
flags are SftFlags, the data and its loaders in sft_data.py, the data formats and the loss mask in
chat/conversations.py. `--batch_size` is the GLOBAL batch of
conversations, and the loss of a step is the mean over every answer token of it (all micro-batches,
all processes), so the same flags train the same way on any number of GPUs.

Install: `pip install -e '.[chat]'` from a clone of accelerate-recipes (the runtime plus datasets,
peft and gguf).
"""

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import peft
import torch
from accelerate.utils import set_seed
from chat.answer_loss import PLAIN_LOGITS, use_answer_loss
from chat.generation import check_generation, without_compiling
from chat.memory_plan import numel, print_plan
from chat.model import (
    DEFAULT_MODEL,
    ChatModelFlags,
    KernelFlags,
    adamw,
    build_model,
    compile_figures,
    generate_answers,
    load_tokenizer,
    save_model,
    use_kernels,
    write_samples,
)
from chat.modes import chat, merge, predict
from chat.packed_attention import choose_attention
from chat.packing import check_packing
from chat.run_summary import SFT_SCORES, SFT_SUMMARY, print_run_summary, run_settings, scores_line
from sft_data import data_loaders, dataset_name, launch_flags, load_data
from sft_modes import evaluate_saved_model, plan_only
from transformers import get_scheduler

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RunState,
    always_build_attention_masks,
    check_launch_flags,
    clip_norm,
    epoch_batches,
    finish_run,
    keeps_update,
    prepare_output_dir,
    run,
    run_config,
    run_length,
    run_mode,
    saving_checkpoint,
    setup_fsdp,
    setup_tracker,
    training_accelerator,
    training_progress,
)
from accelerate_recipes.meter import flop_utilisation
from accelerate_recipes.plots import plot_results


@dataclass
class SftFlags(ChatModelFlags, KernelFlags):
    """Fine-tune a chat model on conversations (LoRA with --lora_r, else in full), or use the
    fine-tuned model.

    The loss covers the assistant's turns only (every one of a multi-turn conversation, with the
    token that ends the turn), found in the text the model's own chat template renders. AdamW's
    learning rate warms up linearly, then decays linearly to zero. The defaults follow common SFT
    practice (TRL's and LLaMA-Factory's): global batch 16, lr 2e-4 for LoRA and 2e-5 in full,
    gradients clipped to norm 1.0, 3 epochs.

    Args:
        train_file: training conversations, .json (a list) or .jsonl (one per line), in any of these
            formats: {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
            (multi-turn), ShareGPT's {"conversations": [{"from": "human"|"gpt"|"system", "value":
            ...}]}, Alpaca's {"instruction", "input", "output"}, or {"prompt", "completion"}.
        validation_file: validation conversations in the same formats; default: --validation_size of
            the training data, held out.
        dataset: a Hugging Face Hub dataset by name instead of files (its train split, and its
            validation or test split); downloaded on first use, then read from the cache.
        validation_size: fraction of the training conversations held out for validation when no
            validation file or split is given.
        max_length: longest conversation in tokens; longer ones are cut, and those left without an
            answer token are dropped (both counted and reported).
        packing: put each micro-batch's conversations in one row without padding, attention kept
            inside each one (positions restart per conversation): faster when lengths vary. Needs an
            attention implementation that keeps packed sequences apart: varlen (chosen by default on
            a GPU of compute capability 8.0 or newer in bf16/fp16: torch's variable-length flash
            kernel, each conversation attending to itself only), sdpa (a dense mask over the whole
            row, the default elsewhere), eager, flex_attention, flash_attention_2/3.
        batch_tokens: with --packing, fill each micro-batch by tokens instead of conversations: one
            row of up to this many tokens per process per micro-step, so a step carries world size x
            --gradient_accumulation_steps rows whatever the conversations' lengths; --batch_size is
            not used (results.json: global_batch_size, the conversations of a step on average). The
            rows are made once, before training, by best-fit decreasing (the longest conversation
            first, each into the row it fills most tightly; rows come within a few tokens of full),
            and drawn in a new order each epoch. The loss stays the mean over the step's answer
            tokens. --plan_only prints the largest that fits the memory. 0 (default): --batch_size
            conversations a step. At least --max_length.
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        eval_generate: after each evaluation, answer the first N validation prompts greedily and
            report the share that equals the reference (eval_exact_match: meaningful for short
            answers such as a label or a number); the first few go to output_dir/samples.jsonl and
            the tracker. 0: no generation.
        model: the model to fine-tune: a Hub name or a local folder of any chat model
            AutoModelForCausalLM loads with its tokenizer and chat template (Qwen2.5 / Qwen3, Llama,
            SmolLM; default Qwen/Qwen2.5-0.5B-Instruct), or a .gguf file (dequantised to fp32). For
            --eval_only, --predict, --chat and --merge: the fine-tuned model (an adapter or a full
            model; default --output_dir).
        lr: peak learning rate; default 2e-4 with --lora_r, 2e-5 for a full fine-tune.
        num_workers: DataLoader workers per process; default: up to 2 (collating token ids is
            cheap); 0 on the CPU.
        seed: seed for LoRA's initial weights, data order and dropout.
        eval_only: evaluate the fine-tuned model in --model (default --output_dir) on the validation
            conversations of the data flags: loss, perplexity and, with --eval_generate, exact
            match. Writes results.json to --output_dir; runs on any number of processes, each
            conversation counted once.
        predict: answer prompts instead of training: a prompt, a .txt file (one prompt per line) or
            a .json/.jsonl file of conversations (answered after their last user turn), with the
            model in --model. Prints one JSON line per prompt; give --predict several times for
            several.
        plan_only: print the memory plan (per-process weights, gradients, AdamW states, activations
            and whether they fit; when not, the change that would) and exit without loading the
            weights or the data: the model is built from its config on the meta device, so planning
            a 7B run needs no memory.
        plan_devices: plan for this many processes (one per GPU) instead of the launch's, e.g. 8.
        plan_device_gb: plan for devices of this many GB each instead of the memory seen (free GPU
            memory, or the host's available memory divided by the local processes on the CPU).
        plan_sharding: plan for ddp, zero1, zero2, fsdp (full shard) or zero3 instead of the
            launch's strategy.
    """

    train_file: str | None = None
    validation_file: str | None = None
    dataset: str | None = None
    validation_size: float = 0.1
    max_length: int = 1024
    packing: bool = False
    batch_tokens: int = 0
    warmup_ratio: float = 0.03
    eval_generate: int = 0
    plan_only: bool = False
    plan_devices: int = 0
    plan_device_gb: float = 0.0
    plan_sharding: Literal["ddp", "zero1", "zero2", "fsdp", "zero3"] | None = None
    # The shared flags this task defaults otherwise.
    batch_size: int = 16
    max_grad_norm: float = 1.0
    output_dir: str = "outputs/sft"


# --------------------------------------------------------------------------------------------- data


def whole_steps(batches, accumulation: int, accelerator, limit: int):
    """The first `limit` batches, each given `num_items_in_batch`: the answer tokens of its whole
    optimizer step (all its micro-batches, all processes), counted before the step's first forward
    pass.

    The model then returns its summed token losses divided by that count, and the step's loss is the
    mean over every answer token of the global batch, however the batch is split (transformers'
    Trainer does the same since 4.46; a mean per micro-batch would weigh short answers more). The
    rest of the loader is read and left out: a few batches at an epoch's end that make no whole
    step, as drop_last leaves out a partial batch.
    """
    step = []
    for index, batch in enumerate(batches):
        if index >= limit:
            continue
        step.append(batch)
        if len(step) == accumulation:
            # the model shifts labels by one
            targets = sum((b["labels"][:, 1:] != -100).sum() for b in step)
            # on the device: no read on the host
            targets = accelerator.reduce(targets, reduction="sum")
            yield from (dict(b, num_items_in_batch=targets) for b in step)
            step = []


# ----------------------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Loss per answer token (and its perplexity) over the whole validation split, each conversation
    counted once."""
    model.eval()
    loss_sum, token_count, conversations = 0.0, 0, 0
    for batch in loader:
        # each answer token's, in batch["target_index"] order; fp32 (FSDP2's mixed precision casts
        # outputs to bf16) compiled blocks: the graphs of training where shapes match, else eager
        with without_compiling():
            losses = model(**batch).token_losses.float()
        rows = batch["target_index"] // batch["labels"].shape[1]
        conversations_in_batch = len(batch["labels"])
        sums = torch.zeros(conversations_in_batch, device=losses.device).index_add_(0, rows, losses)
        counts = torch.zeros_like(sums, dtype=torch.long).index_add_(0, rows, torch.ones_like(rows))
        # One (loss sum, answer tokens) pair per conversation; gather_for_metrics drops the
        # conversations the sampler repeated to give every process an equal share.
        sums, counts = accelerator.gather_for_metrics((sums, counts))
        loss_sum += sums.double().sum().item()
        token_count += counts.sum().item()
        conversations += len(counts)
    model.train()
    loss = loss_sum / max(token_count, 1)
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(min(loss, 50.0)),
        "eval_tokens": token_count,
        "eval_samples": conversations,
    }


# ---------------------------------------------------------------------------------------- reporting
def settings(args: SftFlags, model_name: str, lr: float, model, counts: dict, per_process: int) -> dict:
    """What the run derived from its flags and data, for run_config (the tracker, checkpoints,
    results.json)."""
    return run_settings(
        args,
        dataset_name(args),
        model_name,
        lr,
        model,
        lora_alpha=args.lora_alpha or 2 * args.lora_r,
        per_process_batch_size=per_process,
        train_size=counts["train"]["examples"] - counts["train"]["without_targets"],
        validation_size=counts["validation"]["examples"] - counts["validation"]["without_targets"],
        train_truncated=counts["train"]["truncated"],
        train_dropped=counts["train"]["without_targets"],
    )


def model_flops_per_token(model, train_set) -> float:
    """Training FLOPs per token of the model's own arithmetic, counted as in the PaLM paper
    (Chowdhery et al., 2022, appendix B): per weight of a matrix multiply 6 in a full fine-tune
    (forward 2, backward 4) and 4 under LoRA (the frozen weights need no weight gradient; the
    adapters' own FLOPs are left out), plus 12 x layers x hidden x the mean conversation length for
    attention (a conversation attends within itself, packed or padded). The output layer counts for
    the answer tokens only where the loss makes logits for those alone (chat/answer_loss.py); the
    embedding lookup and the recomputation of gradient checkpointing do not count."""
    causal_lm = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    per_weight = 4 if isinstance(model, peft.PeftModel) else 6
    head = causal_lm.get_output_embeddings()
    blocks = sum(
        numel(m.weight)
        for name, m in causal_lm.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name
    )
    tokens, targets = (
        sum(train_set["num_tokens"]) / len(train_set),
        sum(train_set["num_targets"]) / len(train_set),
    )
    head_share = targets / tokens if causal_lm.config.model_type in PLAIN_LOGITS else 1.0
    config = causal_lm.config
    attention = 12 * config.num_hidden_layers * config.hidden_size * tokens
    return per_weight * (blocks + numel(head.weight) * head_share) + attention


def token_rates(results: dict, train_set) -> dict:
    """Training tokens and answer tokens per second: samples per second x the training set's mean
    tokens per conversation (padding not counted)."""
    samples_per_second = results["train_samples_per_second"]
    return dict(
        train_tokens_per_second=samples_per_second * sum(train_set["num_tokens"]) / len(train_set),
        train_target_tokens_per_second=samples_per_second * sum(train_set["num_targets"]) / len(train_set),
    )


# -------------------------------------------------------------------------------------------- train
def train(args: SftFlags) -> None:
    """Fine-tune --model on the data flags' conversations, evaluate after every epoch, and save the
    last and the best model (an adapter with --lora_r), results.json, metrics.jsonl, samples.jsonl
    and results.png."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    model_name = args.model or DEFAULT_MODEL
    lr = args.lr or (2e-4 if args.lora_r else 2e-5)
    # rows of another length every step: segments that grow, not a new block per length
    if args.packing:
        # read when CUDA starts, below
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"sft-{dataset_name(args)}", args.swanlab_mode
    )
    # By count, not at a loader's end: whole_steps reads a step's batches before its first forward.
    accelerator = training_accelerator(args, tracking, steps_by_count=True)
    # the flags as this launch takes them: --compile on a CUDA GPU, --batch_tokens' rows a batch
    args, blocks = launch_flags(args, accelerator)
    per_process = check_launch_flags(accelerator, args)
    check_generation(accelerator, args.eval_generate)
    world = accelerator.num_processes
    set_seed(args.seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data, tokenizer and model
    tokenizer = load_tokenizer(model_name)
    raw, tokenized, counts = load_data(accelerator, args, tokenizer)
    # packed rows on a GPU: torch's variable-length flash kernel, unless --attn_implementation says
    attention = choose_attention(args.attn_implementation, args.packing, accelerator)
    args = replace(args, attn_implementation=attention)
    model = build_model(args, model_name, accelerator)
    if args.packing:
        check_packing(model)
    # logits for the answer positions only, in chunks (chat/answer_loss.py): the loss stays the same
    use_answer_loss(model)
    # --liger's fused kernels, the blocks compiled (--compile)
    use_kernels(model, args, accelerator.device, blocks)
    train_loader, eval_loader, micro_batch_samples = data_loaders(
        accelerator, args, tokenizer, tokenized, per_process
    )
    if args.batch_tokens:  # from here on the global batch counts conversations: a step's, on average
        args = replace(args, batch_size=micro_batch_samples * world * args.gradient_accumulation_steps)
    # bytes per process, before any is spent on the device
    plan = print_plan(accelerator, args, model, per_process)
    # for the model FLOP utilisation (MFU)
    flops_per_token = model_flops_per_token(model, tokenized["train"])

    # ---- optimizer: AdamW on the trainable weights, weight decay on matrices only, fused on a GPU
    always_build_attention_masks()  # no host read of the padding in each forward pass
    optimizer = adamw(model, lr, args.weight_decay, accelerator.device)

    # ---- the run's length in optimizer steps: whole steps only (whole_steps leaves an epoch's
    # remainder out)
    steps_per_epoch = len(train_loader) // world // args.gradient_accumulation_steps
    batches_per_epoch = steps_per_epoch * args.gradient_accumulation_steps
    training_set = f"{len(tokenized['train'])} conversations"
    length = run_length(args, steps_per_epoch, batches_per_epoch, training_set)
    warmup_steps = round(args.warmup_ratio * length.total_steps)

    setup_fsdp(accelerator, model)  # FSDP: one shard unit per transformer block of this model
    # ---- prepare: wrap for DDP / FSDP / DeepSpeed, shard the loaders across processes, move to the
    # device.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    schedule = get_scheduler("linear", optimizer, warmup_steps, length.total_steps)
    scheduler = accelerator.prepare(schedule)

    config = run_config(
        "sft", args, accelerator, **settings(args, model_name, lr, model, counts, per_process)
    )
    config.update(warmup_steps=warmup_steps, total_steps=length.total_steps, epochs=length.epochs)

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    state = RunState(accelerator.device)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    best = BestModel(
        accelerator, state, output, "eval_loss", higher_is_better=False, patience=args.early_stopping_patience
    )
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    # ---- training loop
    while state.epoch < length.epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        batches = epoch_batches(accelerator, train_loader, state.epoch, state.batches_done)
        batches = whole_steps(
            batches, args.gradient_accumulation_steps, accelerator, batches_per_epoch - state.batches_done
        )
        for batch in progress.timed(batches):  # each batch's wait timed
            state.batches_done += 1
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                # Summed token losses / the step's answer tokens; x world x accumulation undoes the
                # means that DDP and accelerator.backward take, so the gradient is that of the
                # global batch's mean token loss.
                loss = model(**batch).loss * world * args.gradient_accumulation_steps
                accelerator.backward(loss)
                # a non-finite loss is noted on the device, read at the next log step
                guard.observe(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # the step's loss: the mean over its micro-batches
            state.add(loss.detach(), samples=micro_batch_samples)
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            if progress.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                with saving_checkpoint(checkpoints, progress, config) as folder:
                    accelerator.save_state(folder)
            if progress.finished:
                break

        # ---- evaluation once per epoch, on the whole validation split
        # nothing non-finite since the last log step, before evaluating and saving
        guard.check(state.step)
        state.last_eval = evaluate(model, eval_loader, accelerator)
        if args.eval_generate:
            conversations = raw["validation"]["messages"][: args.eval_generate]
            scores, samples = generate_answers(
                model, tokenizer, conversations, accelerator, args.max_new_tokens, per_process, args.decode
            )
            state.last_eval.update(scores)
            write_samples(accelerator, output, state.epoch + 1, state.step, samples, tracking)
        seconds = progress.epoch_done(state.last_eval)
        if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
            with best.saving() as folder:
                save_model(accelerator, model, tokenizer, folder)
        if accelerator.is_main_process and args.plots:
            # kept up to date every epoch
            plot_results(progress.metrics.path, output / "results.png")
        scores_text = scores_line(state.last_eval, SFT_SCORES)
        epoch = f"epoch {state.epoch + 1}/{length.epochs}"
        accelerator.print(f"{epoch}: {scores_text}, {seconds:.1f} s")
        state.epoch, state.batches_done = state.epoch + 1, 0
        with saving_checkpoint(checkpoints, progress, config) as folder:
            accelerator.save_state(folder)
    progress.close()

    # ---- save the model and the run's results
    accelerator.wait_for_everyone()
    # with the tokenizer, as from_pretrained reads it
    save_model(accelerator, model, tokenizer, output)
    results = dict(config, **progress.results(started))
    # beside peak_memory_mb
    results.update(token_rates(results, tokenized["train"]), memory_plan_mb=plan.mb)
    # with --compile: the first steps' compilation apart; graphs, recompiles, seconds and
    # fallbacks, and the graphs torch's caches gave
    results.update(
        warmup_seconds=progress.meter.warmup_seconds, **compile_figures(blocks, model, accelerator)
    )
    flops = flops_per_token * results["train_tokens_per_second"]  # all processes together
    results.update(
        flops_per_token=flops_per_token,
        model_flops_utilisation=flop_utilisation(flops, accelerator.device, world),
    )
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print_run_summary(
            results, path, tracking, title="chat fine-tuning: summary", rows=SFT_SUMMARY, script=__file__
        )


# --------------------------------------------------------------------------------------------- main
def main(args: SftFlags) -> None:
    """Train, or run the one other mode a flag names: a function per mode."""
    modes = {
        "predict": predict,
        "eval_only": lambda flags: evaluate_saved_model(flags, evaluate),
        "chat": chat,
        "merge": merge,
        "plan_only": plan_only,
    }
    return run_mode(args, modes, otherwise=train)


if __name__ == "__main__":
    run(main)
