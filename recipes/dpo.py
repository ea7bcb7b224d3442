#!/usr/bin/env python
"""Preference tuning (DPO and its variants) of a chat model with Hugging Face Accelerate, LoRA or
full: 1 GPU, N GPUs, N nodes.

    python recipes/dpo.py --model HuggingFaceTB/SmolLM2-135M-Instruct --train_file pairs.jsonl --lora_r 16
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/dpo.py --train_file pairs.jsonl \\
        --lora_r 16
    # go on from the chat recipe's model
    python recipes/dpo.py --model outputs/sft --train_file pairs.jsonl --lora_r 16
    python recipes/dpo.py --eval_only --model outputs/dpo --validation_file held_out.jsonl
    python recipes/dpo.py --chat --model outputs/dpo

Each optimizer step takes --batch_size preference pairs (a prompt, a chosen and a rejected answer),
computes each answer's log-probability (summed over its tokens) under the model and under the
reference policy (the model this run starts from), and lowers the loss of --loss_type on the
difference of the two margins. The loss of a step is the mean over every pair of the global batch
(all micro-batches, all processes), so the same flags train the same way on any number of GPUs.

This file holds the recipe: the flags, the reference's log-probabilities of a batch, the
evaluation, and train(), which reads top to bottom (config -> accelerator -> data -> model and
reference -> optimizer -> prepare -> resume -> loop -> eval -> save). What it does when it does not
train is in dpo_modes.py (--eval_only) and chat/modes.py (--predict, --chat and --merge, shared by
the chat recipes). Beside it, in chat/: the flags' checks, the pairs' loaders and the run's settings
(dpo_setup.py), the answers' log-probabilities, the loss and --precompute_ref's stored reference
(preference_loss.py), the pair formats (preference_pairs.py) and the summary at the end
(run_summary.py).

Install: `pip install -e '.[chat]'` from a clone of accelerate-recipes (the runtime plus datasets,
peft and gguf).
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import set_seed
from chat.conversations import dataset_name
from chat.dpo_setup import (
    check_flags,
    launch_flags,
    load_pair_splits,
    pair_loaders,
    settings,
    token_rates,
    validation_answers,
)
from chat.generation import without_compiling
from chat.model import (
    DEFAULT_MODEL,
    ChatModelFlags,
    KernelFlags,
    adamw,
    build_model,
    compile_figures,
    load_tokenizer,
    reference_model,
    reference_policy,
    save_model,
    use_kernels,
    write_samples,
)
from chat.modes import chat, merge, predict
from chat.packing import check_packing
from chat.preference_loss import StoredReference, answer_logprobs, check_same_reference, pair_figures
from chat.preference_pairs import pair_collator
from chat.run_summary import DPO_SCORES, DPO_SUMMARY, print_run_summary, scores_line
from dpo_modes import evaluate_saved_model
from transformers import get_scheduler

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RunState,
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
from accelerate_recipes.plots import plot_results

BEST_METRICS = {"loss": ("eval_loss", False), "accuracy": ("eval_reward_accuracy", True)}
# Not measured for this recipe's defaults: 1e-6 is TRL's DPOConfig default for whole models;
# adapters take larger steps (make bench-dpo uses the
# LoRA default; docs/benchmarks.md has its figures).
DEFAULT_LORA_LR, DEFAULT_FULL_LR = 5e-5, 1e-6
# What each update logs as train/<name> and each evaluation as eval_<name>, per pair, averaged over
# the global batch.
FIGURES = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
FIGURES += ("logps_chosen", "logps_rejected", "logp_accuracy", "nll_chosen")
# results.png's evaluation panel
PLOTTED = ("eval/reward_accuracy", "eval/logp_accuracy", "eval/reward_margin")


@dataclass
class DpoFlags(ChatModelFlags, KernelFlags):
    """Tune a chat model on preference pairs with DPO or a variant (LoRA with --lora_r, else in
    full).

    The loss compares how much more likely the model makes the chosen answer than the rejected one
    with how much more the reference policy (the model this run starts from) does. The defaults
    follow TRL's DPOConfig: --beta 0.1, the sigmoid loss, lr 1e-6 for whole models; LoRA takes 5e-5
    here; one epoch; global batch 16.

    Args:
        train_file: training pairs, .json (a list) or .jsonl (one per line), in TRL's preference
            formats: text {"prompt", "chosen", "rejected"}; conversational {"prompt": [messages],
            "chosen": [assistant messages], "rejected": [...]}; or {"chosen": [whole conversation],
            "rejected": [whole conversation]}, whose shared first turns are the prompt. Rendered
            with the model's chat template.
        validation_file: held-out pairs in the same formats; default: --validation_size of the
            training pairs.
        dataset: a Hugging Face Hub dataset instead of files, as name or name:config
            (trl-lib/ultrafeedback_binarized): its train split, and its validation or test split;
            downloaded on first use.
        validation_size: fraction of the training pairs held out when no validation file or split is
            given.
        max_length: longest prompt plus answer in tokens; longer pairs are dropped, or cut
            (--too_long), and counted.
        too_long: drop (default) or truncate: what happens to a pair longer than --max_length;
            truncate cuts both answers to fit after the prompt (a prompt that leaves no room is
            dropped).
        packing: put each micro-batch's chosen and rejected sequences (each a prompt and one answer)
            in one row without padding, attention kept inside each one (positions restart per
            sequence): the same losses and figures as padded batches, no padding computed. Needs an
            attention implementation that keeps packed sequences apart: varlen (chosen by default on
            a GPU of compute capability 8.0 or newer in bf16/fp16: torch's variable-length flash
            kernel, each sequence attending to itself only), sdpa (a dense mask over the whole row,
            the default elsewhere), eager, flex_attention, flash_attention_2/3.
        loss_type: sigmoid (DPO), ipo (IPO: a squared loss on the margin of the answers' mean token
            log-probabilities, which does not push it without bound) or hinge (SLiC: max(0, 1 - beta
            x margin)).
        beta: how far the model may move from the reference: the scale of the margin (sigmoid,
            hinge) or the inverse of its target (ipo). 0.1 is usual; smaller moves further.
        label_smoothing: sigmoid only: the probability that a pair's labels are swapped
            (conservative DPO); 0-0.5.
        sft_weight: add this times the chosen answer's negative log-likelihood (mean per token) to
            each pair's loss (RPO; TRL's rpo_alpha): keeps the chosen answers likely while the
            margin grows. 0: off.
        precompute_ref: compute the reference's log-probabilities of every pair once, before
            training, and load no reference model: no second copy of the weights in a full
            fine-tune, no second forward pass per step. They are saved with each checkpoint, so a
            resumed run uses the same ones.
        reference_model: --eval_only: the reference policy the rewards are measured against;
            default: the adapter's base, the adapter switched off (a full model needs this flag).
        best_model_metric: which held-out figure picks model_best and early stopping: loss (lower)
            or accuracy (the share of pairs whose chosen answer gets the higher reward).
        lora_dropout: dropout on the LoRA branch's input; 0 by default, so that the model and its
            reference see the same function at step 1 (their margin starts at exactly 0).
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        eval_generate: before training and after each evaluation, answer the first N validation
            prompts greedily and write them beside their chosen answers to samples.jsonl and the
            tracker (needs the whole model in each process: off under FSDP and ZeRO-3). 0: none.
        model: the model to tune: a Hub name or folder of a chat model, a .gguf file, or the chat
            recipe's output (an adapter, trained on under --lora_r, or a full model); default
            Qwen/Qwen2.5-0.5B-Instruct. For --eval_only, --predict, --chat and --merge: the tuned
            model (default --output_dir).
        lr: peak learning rate; default 5e-5 with --lora_r, 1e-6 for a full fine-tune.
        seed: seed for LoRA's initial weights and the data order.
        eval_only: evaluate --model on the validation pairs (loss, rewards, margin, accuracy)
            against --reference_model and write results.json to --output_dir; any number of
            processes, each pair once.
        predict: answer prompts (text, a .txt file of one per line, or a .json/.jsonl of chats) with
            --model; one JSON line per prompt.
    """

    train_file: str | None = None
    validation_file: str | None = None
    dataset: str | None = None
    validation_size: float = 0.1
    max_length: int = 1024
    too_long: Literal["drop", "truncate"] = "drop"
    packing: bool = False
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    precompute_ref: bool = False
    reference_model: str | None = None
    best_model_metric: Literal["loss", "accuracy"] = "loss"
    lora_dropout: float = 0.0
    warmup_ratio: float = 0.1
    eval_generate: int = 4
    # The shared flags this task defaults otherwise: the global batch counts pairs.
    batch_size: int = 16
    epochs: int = 1
    max_grad_norm: float = 1.0
    log_every: int = 5
    checkpoint_every: int = 100
    output_dir: str = "outputs/dpo"


# --------------------------------------------------------------------------------------------- data
def first_batches(batches, limit: int):
    """The first `limit` batches of a loader: the whole steps of an epoch. The rest is read and left
    out, as drop_last leaves out a partial batch, so that the loader ends its epoch as usual."""
    for index, batch in enumerate(batches):
        if index < limit:
            yield batch


# --------------------------------------------------------------------------------------------- loss
@torch.no_grad()
def reference_logprobs(
    accelerator, model, reference, batch: dict, stored, split: str = "train"
) -> torch.Tensor:
    """The reference policy's answer log-probabilities of a batch's rows: computed now
    (chat.model.reference_model), or looked up when --precompute_ref stored them (a
    StoredReference)."""
    if stored is not None:
        return stored.lookup(split, batch["index"]).to(batch["input_ids"].device)
    with reference_model(accelerator, model, reference) as policy:
        return answer_logprobs(policy, batch)[0]


# ----------------------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(accelerator, model, reference, loader, args, stored: StoredReference | None) -> dict:
    """The FIGURES over the whole validation split, each pair counted once (gather_for_metrics drops
    the pairs the sampler repeated to even the processes out), as eval_<name>."""
    model.eval()
    sums, pairs = torch.zeros(len(FIGURES), dtype=torch.float64), 0
    for batch in loader:
        # compiled blocks: the graphs of training where shapes match, else eager
        with without_compiling():
            policy, tokens = answer_logprobs(model, batch)
            reference_rows = reference_logprobs(accelerator, model, reference, batch, stored, "validation")
        figures = pair_figures(policy, reference_rows, tokens, args)
        per_pair = accelerator.gather_for_metrics(
            torch.stack([figures[name].float() for name in FIGURES], dim=1)
        )
        sums += per_pair.double().sum(dim=0).cpu()
        pairs += len(per_pair)
    model.train()
    return {f"eval_{name}": value / max(pairs, 1) for name, value in zip(FIGURES, sums.tolist())} | {
        "eval_samples": pairs
    }


def sample_answers(
    accelerator, model, tokenizer, pairs: list[dict], args, epoch: int, step: int, output, tracking
):
    """Greedy answers to the first --eval_generate validation prompts beside their chosen answers,
    to samples.jsonl and the tracker (epoch 0: before training)."""
    if not args.eval_generate:
        return
    samples = validation_answers(accelerator, model, tokenizer, pairs, args)
    write_samples(accelerator, output, epoch, step, samples, tracking)


# -------------------------------------------------------------------------------------------- train
def train(args: DpoFlags) -> None:
    """DPO on the data flags' pairs; evaluate at each epoch's end, and save the last and the best
    model (an adapter with --lora_r), results.json, metrics.jsonl, samples.jsonl and results.png."""
    started = time.perf_counter()
    check_flags(args)
    output, model_name = Path(args.output_dir), args.model or DEFAULT_MODEL
    lr = args.lr or (DEFAULT_LORA_LR if args.lora_r else DEFAULT_FULL_LR)

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"dpo-{dataset_name(args)}", args.swanlab_mode
    )
    # Steps by count, as SFT's: a step's micro-batches are whole pairs of the global batch.
    accelerator = training_accelerator(args, tracking, steps_by_count=True)
    per_process = check_launch_flags(accelerator, args)
    world, accumulation = accelerator.num_processes, args.gradient_accumulation_steps
    # a copy of the flags as this launch takes them: --compile by default on a CUDA GPU (a compile
    # failure goes on eagerly), --eval_generate off under sharding, the attention packed rows need
    args, blocks = launch_flags(args, accelerator)
    set_seed(args.seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data: pairs rendered with the model's chat template
    tokenizer = load_tokenizer(model_name)
    splits, counts = load_pair_splits(accelerator, args, tokenizer)
    train_loader, eval_loader = pair_loaders(accelerator, args, tokenizer, splits, per_process)

    # ---- model and reference policy (none with --precompute_ref: the model itself before its first
    # step)
    model = build_model(args, model_name, accelerator)  # an adapter of ours in --model: trained on
    if args.packing:
        # attention that keeps each packed sequence to itself (the reference's too)
        check_packing(model)
    reference = None if args.precompute_ref else reference_policy(args, accelerator, model, model_name)
    # --liger, --compile; after the reference's copy
    use_kernels(model, args, accelerator.device, blocks)

    # ---- optimizer: AdamW on the trainable weights, weight decay on matrices only, fused on a GPU
    optimizer = adamw(model, lr, args.weight_decay, accelerator.device)

    # ---- the run's length in optimizer steps: whole global batches of pairs only
    steps_per_epoch = len(train_loader) // world // accumulation
    batches_per_epoch = steps_per_epoch * accumulation
    length = run_length(args, steps_per_epoch, batches_per_epoch, f"{len(splits['train'])} pairs")
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
        "dpo", args, accelerator, **settings(args, model_name, lr, model, counts, per_process)
    )
    config.update(warmup_steps=warmup_steps, total_steps=length.total_steps, epochs=length.epochs)

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    state = RunState(accelerator.device, FIGURES)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    stored = StoredReference() if args.precompute_ref else None
    if stored is not None:
        # the reference's log-probabilities travel with checkpoints
        accelerator.register_for_checkpointing(stored)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        check_same_reference(resume_from, args.precompute_ref)
        accelerator.load_state(resume_from)
    elif stored is not None:
        collate = pair_collator(tokenizer, args.packing)
        seconds = stored.compute(accelerator, model, splits, collate, per_process)
        config.update(precompute_ref_seconds=seconds)
        accelerator.print(f"reference log-probabilities of every pair computed in {seconds:.1f} s")
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    metric, higher = BEST_METRICS[args.best_model_metric]
    best = BestModel(
        accelerator, state, output, metric, higher_is_better=higher, patience=args.early_stopping_patience
    )
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    if resume_from is None:  # the answers before any update, to compare with those after
        sample_answers(accelerator, model, tokenizer, splits["validation"], args, 0, 0, output, tracking)

    # ---- training loop
    while state.epoch < length.epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        batches = epoch_batches(accelerator, train_loader, state.epoch, state.batches_done)
        # an epoch's last batches that make no whole step are left out
        batches = first_batches(batches, batches_per_epoch - state.batches_done)
        for batch in progress.timed(batches):  # each batch's wait timed
            state.batches_done += 1
            reference_rows = reference_logprobs(accelerator, model, reference, batch, stored)
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                policy, tokens = answer_logprobs(model, batch)
                figures = pair_figures(policy, reference_rows, tokens, args)
                # This micro-batch's pairs' share of the global batch's mean loss; x world x
                # accumulation undoes the means that DDP and accelerator.backward take.
                loss = figures["loss"].sum() / args.batch_size * world * accumulation
                accelerator.backward(loss)
                # a non-finite loss is noted on the device, read at the next log step
                guard.observe(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # the micro-batch's means; RunState averages them over micro-batches and processes
            state.add(
                torch.stack([figures[name].detach().float().mean() for name in FIGURES]), samples=per_process
            )
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
        state.last_eval = evaluate(accelerator, model, reference, eval_loader, args, stored)
        sample_answers(
            accelerator,
            model,
            tokenizer,
            splits["validation"],
            args,
            state.epoch + 1,
            state.step,
            output,
            tracking,
        )
        seconds = progress.epoch_done(state.last_eval)
        if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
            with best.saving() as folder:
                save_model(accelerator, model, tokenizer, folder)
        if accelerator.is_main_process and args.plots:
            # the accuracies and the margin: the log-probabilities are on another scale
            plot_results(progress.metrics.path, output / "results.png", eval_keys=PLOTTED)
        scores = scores_line(state.last_eval, DPO_SCORES)
        accelerator.print(f"epoch {state.epoch + 1}/{length.epochs}: {scores}, {seconds:.1f} s")
        state.epoch, state.batches_done = state.epoch + 1, 0
        with saving_checkpoint(checkpoints, progress, config) as folder:
            accelerator.save_state(folder)
    progress.close()

    # ---- save the model and the run's results
    accelerator.wait_for_everyone()
    # with the tokenizer, as from_pretrained reads it
    save_model(accelerator, model, tokenizer, output)
    results = dict(config, **progress.results(started))
    results.update(token_rates(results, splits["train"]), warmup_seconds=progress.meter.warmup_seconds)
    # graphs, recompiles, seconds, fallbacks, cache hits
    results.update(compile_figures(blocks, model, accelerator))
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print_run_summary(results, path, tracking, title="DPO: summary", rows=DPO_SUMMARY, script=__file__)


# --------------------------------------------------------------------------------------------- main
def main(args: DpoFlags) -> None:
    """Train, or run the one other mode a flag names: a function per mode."""
    modes = {
        "predict": predict,
        "eval_only": lambda flags: evaluate_saved_model(flags, evaluate),
        "chat": chat,
        "merge": merge,
    }
    return run_mode(args, modes, otherwise=train)


if __name__ == "__main__":
    run(main)
