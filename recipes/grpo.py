#!/usr/bin/env python
"""Reinforcement learning with verifiable rewards (GRPO) for a chat model with Hugging Face
Accelerate, LoRA or full: 1 GPU, N GPUs, N nodes.

    python recipes/grpo.py --model HuggingFaceTB/SmolLM2-135M-Instruct --train_file math.jsonl \\
        --reward number
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/grpo.py \\
        --dataset openai/gsm8k:main
    # mean reward and accuracy of a trained model
    python recipes/grpo.py --eval_only --model outputs/grpo --validation_file test.jsonl
    python recipes/grpo.py --predict "What is 3 + 5?" --model outputs/grpo
    python recipes/grpo.py --chat --model outputs/grpo

Each optimizer step: every process takes its share of --batch_size prompts, samples
--num_generations completions of each (a group, never split across processes), scores them with the
--reward functions, turns the rewards into group-relative advantages, and takes the clipped
policy-gradient step. The loss is the sum of the completion tokens' losses over the whole global
batch (every process, every accumulation micro-step) divided by its completion tokens, counted
before the first forward pass, so the same flags train the same way on any number of GPUs.

Sampling is keyed: each completion's random draws are a function of (--seed, epoch, prompt,
completion number, position) alone, not of a generator's state, so the same prompts give the same
completions on 1 process, on 8, with or without accumulation, and after a resume.

This file holds the recipe: the flags, the advantages and the clipped loss, the evaluation, and
train(), which reads top to bottom (config -> accelerator -> data -> model -> optimizer -> prepare
-> resume -> loop: roll out, score, update -> eval -> save). What it does when it does not train is
in grpo_modes.py (--eval_only) and chat/modes.py (--predict, --chat and --merge, shared by the chat
recipes). Beside it, in chat/: the flags' checks, the prompts and the run's settings
(grpo_setup.py), the rollouts (keyed sampling, scoring, the figures logged of them, the throughput:
rollouts.py), the maths around the update (policy_gradient.py), the rewards and the prompt formats
(rewards.py), generation (eager, or a merged copy with a static KV cache and a compiled decode step:
--decode, generation.py) and the summary at the end (run_summary.py).

Install: `pip install -e '.[chat]'` from a clone of accelerate-recipes (the runtime plus datasets,
peft and gguf).
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import gather_object, set_seed
from chat import generation
from chat.conversations import dataset_name
from chat.grpo_setup import check_flags, load_prompt_splits, longest_prompt, settings, whole_steps_per_epoch
from chat.memory_plan import print_rollout_plan
from chat.model import (
    DEFAULT_MODEL,
    ChatModelFlags,
    adamw,
    build_model,
    compile_figures,
    load_tokenizer,
    reference_policy,
    save_model,
    write_samples,
)
from chat.modes import chat, merge, predict
from chat.policy_gradient import (
    UpdatePasses,
    check_update_rows,
    loss_normaliser,
    nan_std,
    reference_token_logprobs,
    token_logprobs,
)
from chat.rewards import Rewards, is_correct, mean_scored, score_texts
from chat.rollouts import (
    Rollout,
    Throughput,
    figure_names,
    generate,
    in_order,
    log_samples,
    reward_figures,
    roll_out,
    sampling_keys,
    score,
)
from chat.run_summary import GRPO_SCORES, GRPO_SUMMARY, print_run_summary, scores_line
from grpo_modes import evaluate_saved_model
from torch.utils.data import DataLoader
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

# Measured on make bench-grpo (docs/grpo.md): a LoRA adapter barely moves at 1e-5 in a few dozen
# steps; 1e-6 is TRL's default for whole models.
DEFAULT_LORA_LR, DEFAULT_FULL_LR = 1e-4, 1e-6
# the sampling keys of evaluations: the same at every evaluation, none of a training epoch
EVALUATION_EPOCH = -1


@dataclass
class GrpoFlags(ChatModelFlags):
    """Improve a chat model with GRPO on prompts whose answers a program can check (LoRA with
    --lora_r, else in full).

    Each optimizer step samples --num_generations completions for each of --batch_size prompts,
    scores them with the --reward functions, and raises the likelihood of the completions that
    scored above their group's mean. The defaults follow current practice (TRL's GRPOConfig, DAPO):
    8 completions per prompt, no KL term (--beta 0), clipping at 0.2, one update per batch of
    rollouts, the token-level loss over the whole global batch.

    Args:
        train_file: training prompts, .json (a list) or .jsonl (one per line): rows with a `prompt`
            (text) or `messages` (a conversation to continue; a final assistant turn is taken as the
            answer), or GSM8K's `question` and `answer` (the part after `####` is the answer); every
            other column (`answer`, ...) is passed to the rewards by name.
        validation_file: held-out prompts in the same formats, answered greedily at each evaluation;
            default: --validation_size of the training prompts.
        dataset: a Hugging Face Hub dataset instead of files, as name or name:config
            (openai/gsm8k:main): its train split, and its validation or test split; downloaded on
            first use.
        validation_size: fraction of the training prompts held out when no validation file or split
            is given.
        max_prompt_length: longest prompt in tokens (rendered with the chat template); longer ones
            are left out and counted.
        reward: the reward functions, comma-separated; the first is the correctness check behind
            `accuracy`. Built in: number (the completion's last number equals the answer's), tag
            (the answer inside <answer>...</answer> equals the answer), exact (the whole completion
            equals a short answer), format (one <answer>...</answer> pair ends the completion),
            length (the completion ended before --max_new_tokens). Your own:
            path/to/file.py:function or package.module:function, called as f(prompts, completions,
            **columns) and returning one float per completion (TRL's convention).
        reward_weights: one weight per reward, comma-separated; the reward of a completion is the
            weighted sum.
        answer_tag: the tag the tag and format rewards look for.
        num_generations: completions sampled per prompt (the group the advantages are relative to);
            memory and generation time grow with it.
        max_new_tokens: longest completion; also the longest answer of --predict and --chat.
        temperature: sampling temperature of the rollouts (the log-probabilities of the update use
            it too).
        top_p: nucleus sampling of the rollouts: sample among the most likely tokens whose
            probabilities sum to it.
        top_k: sample among the k most likely tokens only; 0: all of them.
        min_p: sample among the tokens at least min_p times as likely as the likeliest; 0: all of
            them.
        repetition_penalty: above 1, tokens the completion has already written are made less likely
            before the draw (the prompt's tokens are not penalised). top_p, top_k, min_p and
            repetition_penalty shape the sampling only: the update's log-probabilities are the whole
            softmax at --temperature, as in TRL, so with any of them set the rollouts come from a
            policy slightly other than the one the update differentiates; the defaults (all off)
            keep the two the same. Nothing else changes the rollouts: the model's own
            generation_config (a repetition penalty, n-gram bans, ...) is not applied, in training
            nor evaluation.
        beta: weight of the KL penalty against the reference policy, the policy this run starts
            from: under a fresh LoRA adapter the base with the adapter switched off, under an
            adapter given in --model a frozen copy of it, in full fine-tunes a frozen copy of the
            model; 0 (the default) loads no reference.
        epsilon: the ratio of new to old probability is clipped to [1 - epsilon, 1 + epsilon_high].
        epsilon_high: the upper clip; default --epsilon (DAPO's "clip higher" uses 0.28).
        num_iterations: optimizer steps taken on each batch of rollouts; 1 is on-policy (the ratio
            is 1).
        scale_rewards: group (divide each group's centred rewards by the group's standard
            deviation), batch (by the whole global batch's) or none (Dr. GRPO: centred only).
        loss_type: dapo (sum of token losses / completion tokens of the global batch; the default),
            grpo (the mean of each completion's token mean over the global batch) or dr_grpo (sum of
            token losses / (completions x --max_new_tokens)).
        mask_truncated: leave completions that hit --max_new_tokens out of the loss.
        update_rows: completions per forward and backward pass of the update; a process's
            micro-batch (its prompts x --num_generations) is split into passes of at most this many,
            their gradients summed before the all-reduce: the same update in a fraction of the
            activation memory (--gradient_checkpointing cuts it further, recomputing instead). 0
            (the default): the whole micro-batch at once. Not under DeepSpeed, whose engine counts
            every backward pass as a micro-step: use --gradient_accumulation_steps there.
        lora_dropout: dropout on the LoRA branch's input; 0 by default, so that the ratio of an
            on-policy step is 1.
        gather_for_generation: under FSDP2 or ZeRO-3, gather the whole model once per generation
            (each GPU then holds the full weights while it generates); false: gather block by block
            at every generated token, as the training passes do (for a model whose full weights do
            not fit one GPU; slower: 2.9x under FSDP2 in
            make bench-grpo-generation).
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        eval_every: also evaluate every N optimizer steps (0: at each epoch's end only).
        eval_num_samples: at each evaluation, besides the greedy answer, sample this many
            completions of every validation prompt at --temperature (with the same keys at every
            evaluation): their mean reward, pass@1 (the share of samples that are right) and pass@k
            (the share of prompts with a right one among them), which move before greedy answers
            flip; 0: greedy only.
        model: the policy to train: a Hub name or folder of a chat model, a .gguf file, or the chat
            recipe's output (an adapter or a full model); default Qwen/Qwen2.5-0.5B-Instruct. For
            --eval_only, --predict, --chat and --merge: the trained model (default --output_dir).
        lr: peak learning rate; default 1e-4 with --lora_r, 1e-6 for a full fine-tune (docs/grpo.md:
            measured).
        seed: seed for LoRA's initial weights, the prompt order and the sampling keys.
        eval_only: evaluate --model greedily on the validation prompts (mean reward, accuracy) and
            write results.json to --output_dir; any number of processes, each prompt counted once.
        predict: answer prompts (text, a .txt file of one per line, or a .json/.jsonl of chats) with
            --model; one JSON line per prompt.
    """

    train_file: str | None = None
    validation_file: str | None = None
    dataset: str | None = None
    validation_size: float = 0.1
    max_prompt_length: int = 512
    reward: str = "number"
    reward_weights: str | None = None
    answer_tag: str = "answer"
    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    scale_rewards: Literal["group", "batch", "none"] = "group"
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    mask_truncated: bool = False
    update_rows: int = 0
    lora_dropout: float = 0.0
    gather_for_generation: bool = True
    warmup_ratio: float = 0.0
    eval_every: int = 0
    eval_num_samples: int = 4
    # The shared flags this task defaults otherwise: the
    # global batch counts prompts, not completions.
    batch_size: int = 16
    epochs: int = 1
    max_grad_norm: float = 1.0
    log_every: int = 1
    checkpoint_every: int = 50
    output_dir: str = "outputs/grpo"


# --------------------------------------------------------------------------------------- advantages
def advantages(accelerator, rollouts: list[Rollout], generations: int, scale: str) -> dict:
    """Group-relative advantages of a step's rollouts, computed from every process's rewards
    (gathered: a group is whole on one process, the batch's spread needs them all). A completion no
    reward applied to (NaN) is left out of its group's mean and spread and gets no advantage, as in
    TRL. Returns the step's figures for the log."""
    device = accelerator.device
    mine = torch.tensor(
        [r for rollout in rollouts for r in rollout.rewards], device=device, dtype=torch.float64
    )
    everyone = accelerator.gather(mine).view(-1, generations)  # every group of the global batch
    std = nan_std(everyone, dim=1)
    scored = everyone.nan_to_num(nan=0.0)
    highest = torch.where(everyone.isnan(), -math.inf, scored).amax(dim=1)
    lowest = torch.where(everyone.isnan(), math.inf, scored).amin(dim=1)
    flat = (highest <= lowest).double()  # all equal: no advantage, no gradient
    own = mine.view(-1, generations)
    centred = own - own.nanmean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (nan_std(own, dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        centred = centred / (nan_std(everyone) + 1e-4)
    centred = centred.nan_to_num(nan=0.0)
    start = 0
    for rollout in rollouts:
        rows = len(rollout.rewards)
        rollout.advantages = centred.reshape(-1)[start : start + rows].float()
        start += rows
    # reward_std as TRL logs it (the whole global batch's spread), beside the spread within groups,
    # which is what group-scaled advantages see; frac_reward_zero_std: the share of groups that
    # teach nothing this step
    figures = torch.stack([nan_std(everyone), std.mean(), flat.mean()]).tolist()
    return dict(zip(("reward_std", "reward_std_in_group", "frac_reward_zero_std"), figures))


# --------------------------------------------------------------------------------------------- loss
def policy_loss(logprobs, rollout: Rollout, args, reference_logprobs) -> tuple:
    """The clipped surrogate of a micro-batch, as its share of the global batch's loss: (loss, clip
    fraction, kl)."""
    # on-policy (--num_iterations 1): the ratio is 1 and the gradient the same
    old = rollout.old_logprobs if rollout.old_logprobs is not None else logprobs.detach()
    ratio = torch.exp(logprobs - old)
    advantage = rollout.advantages[:, None]
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + high)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    mask = rollout.loss_mask.float()
    kl = torch.zeros((), device=logprobs.device)
    if reference_logprobs is not None:
        delta = reference_logprobs - logprobs
        per_token_kl = torch.exp(delta) - delta - 1  # k3: unbiased, never negative
        # x the ratio (1 on-policy, not in gradient): the samples come from the policy itself, and
        # only then is the gradient that of the KL divergence
        # (as TRL's default use_bias_correction_kl)
        per_token = per_token + args.beta * ratio * per_token_kl
        kl = (per_token_kl * mask).sum() / mask.sum().clamp(min=1)
    normaliser = rollout.normaliser  # the same on every process (loss_normaliser)
    if args.loss_type == "grpo":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / normaliser
    # dapo: / completion tokens of the global batch; dr_grpo: / (completions x max_new_tokens)
    else:
        loss = (per_token * mask).sum() / normaliser
    is_clipped = ((ratio < 1 - args.epsilon) & (advantage < 0)) | ((ratio > 1 + high) & (advantage > 0))
    clip_fraction = (is_clipped.float() * mask).sum() / mask.sum().clamp(min=1)
    return loss, clip_fraction.detach(), kl.detach()


# ----------------------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(accelerator, model, tokenizer, rows: list[dict], rewards: Rewards, args, batch: int) -> tuple:
    """Every validation prompt answered greedily and, with --eval_num_samples k, sampled k times at
    --temperature (keyed by the seed alone: the same draws at every evaluation, so two evaluations
    differ by the model only),
    scored: ({eval_reward, eval_accuracy, eval_*reward*, eval_sampled_reward, eval_pass_at_1,
    eval_pass_at_k}, greedy samples). Each process answers its share in the same number of batches
    (a sharded model generates in step); the prompts repeated to even the shares out are counted
    once."""
    indices = list(range(len(rows)))
    share = math.ceil(len(indices) / accelerator.num_processes)
    share = math.ceil(share / batch) * batch
    # equal shares; dropped later
    padded = indices + indices[-1:] * (share * accelerator.num_processes - len(indices))
    k = args.eval_num_samples
    per_call = max(1, batch // k) if k else batch  # prompts per sampled batch: k rows each
    greedy, sampled = [], []
    with accelerator.split_between_processes(padded) as mine:
        for start in range(0, len(mine), batch):
            chunk = mine[start : start + batch]
            answers = generate(accelerator, model, tokenizer, [rows[i]["prompt_ids"] for i in chunk], args)
            greedy += list(zip(chunk, answers.texts(tokenizer), answers.truncated.tolist()))
            for first in range(0, len(chunk) * bool(k), per_call):
                prompts = chunk[first : first + per_call]
                keys = sampling_keys(
                    args.seed, EVALUATION_EPOCH, torch.tensor(prompts, device=accelerator.device), k
                )
                ids = [rows[i]["prompt_ids"] for i in prompts for _ in range(k)]
                answers = generate(accelerator, model, tokenizer, ids, args, keys)
                rows_of = [(i, j) for i in prompts for j in range(k)]
                sampled += list(zip(rows_of, answers.texts(tokenizer), answers.truncated.tolist()))
    greedy = sorted(dict((i, (text, cut)) for i, text, cut in gather_object(greedy)).items())
    picked = [rows[i] for i, _ in greedy]
    texts = [text for _, (text, _) in greedy]
    per_function, totals = score_texts(rewards, picked, texts, [cut for _, (_, cut) in greedy])
    scores = {
        "eval_reward": mean_scored(totals),
        "eval_accuracy": sum(map(is_correct, per_function[0])) / len(totals),
        **{f"eval_reward_{n}": mean_scored(v) for n, v in zip(rewards.names, per_function)},
        "eval_samples": len(totals),
    }
    if k:
        sampled = sorted(dict((key, (text, cut)) for key, text, cut in gather_object(sampled)).items())
        sampled_texts, cuts = [text for _, (text, _) in sampled], [cut for _, (_, cut) in sampled]
        sampled_rows = [rows[i] for (i, _), _ in sampled]
        sampled_functions, sampled_totals = score_texts(rewards, sampled_rows, sampled_texts, cuts)
        right = [is_correct(v) for v in sampled_functions[0]]  # prompt-major: k in a row per prompt
        scores.update(
            eval_sampled_reward=mean_scored(sampled_totals),
            # the unbiased estimate of pass@1 from k samples
            eval_pass_at_1=sum(right) / len(right),
            eval_pass_at_k=sum(any(right[i : i + k]) for i in range(0, len(right), k)) / (len(right) // k),
        )
    samples = [
        {
            "prompt": str(row["messages"][-1]["content"]),
            "answer": text,
            "reference": str(row.get("answer", "")),
            "reward": reward,
        }
        for row, text, reward in zip(picked, texts, totals)
    ]
    return scores, samples


# -------------------------------------------------------------------------------------------- train
def rollout_steps(
    batches,
    limit: int,
    accelerator,
    model,
    reference,
    tokenizer,
    rows,
    rewards: Rewards,
    epoch: int,
    args,
    speed,
):
    """The micro-batches of whole optimizer steps, each a rollout ready for the update,
    --num_iterations times over.

    A step's rollouts are all generated, scored and given their advantages before its first forward
    pass: the advantages may need the whole batch's spread, and the loss is normalised by the
    completion tokens of the whole global batch, counted here. Of the first `limit` loader batches,
    the last that make no whole step are left out.
    """
    accumulation, generations = args.gradient_accumulation_steps, args.num_generations
    step = []
    for index, indices in enumerate(batches):
        if index >= limit:
            continue
        step.append(indices)
        if len(step) < accumulation:
            continue
        rollouts = [roll_out(accelerator, model, tokenizer, rows, i, epoch, args) for i in step]
        step = []
        for rollout in rollouts:
            score(rewards, rows, rollout, generations)
            rollout.loss_mask = rollout.mask * (~rollout.truncated[:, None] if args.mask_truncated else 1)
        spread = advantages(accelerator, rollouts, generations, args.scale_rewards)
        normaliser = loss_normaliser(accelerator, rollouts, args)
        for rollout in rollouts:
            rollout.normaliser, rollout.figures = (normaliser, reward_figures(rollout, spread, rewards.names))
            rollout.tokens = int(rollout.prompt_mask.sum() + rollout.mask.sum())
            # the policy that sampled, for the ratios of the later updates
            if args.num_iterations > 1:
                with torch.no_grad():
                    rollout.old_logprobs = token_logprobs(model, rollout, args.temperature)
            # once per batch of rollouts, whatever --num_iterations and the accumulation
            rollout.reference_logprobs = reference_token_logprobs(
                model, reference, rollout, args, accelerator
            )
        speed.generated(sum(int(r.mask.sum()) for r in rollouts), sum(r.generation_seconds for r in rollouts))
        for _ in range(args.num_iterations):
            yield from rollouts


def train(args: GrpoFlags) -> None:
    """GRPO on the data flags' prompts; evaluate at each epoch's end (and every --eval_every steps),
    and save the last and the best model (an adapter with --lora_r), results.json, metrics.jsonl,
    samples.jsonl and results.png."""
    started = time.perf_counter()
    args = check_flags(args)
    output, model_name = Path(args.output_dir), args.model or DEFAULT_MODEL
    lr = args.lr or (DEFAULT_LORA_LR if args.lora_r else DEFAULT_FULL_LR)
    rewards = Rewards(args.reward, args.reward_weights, args.answer_tag)

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"grpo-{dataset_name(args)}", args.swanlab_mode
    )
    # Steps by count: a step's rollouts are all generated before its first forward pass.
    accelerator = training_accelerator(args, tracking, steps_by_count=True)
    per_process = check_launch_flags(accelerator, args)
    world, accumulation = accelerator.num_processes, args.gradient_accumulation_steps
    # a micro-batch's completions; evaluation answers as many at once
    rows = per_process * args.num_generations
    check_update_rows(accelerator, args.update_rows, rows)
    set_seed(args.seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data: prompts with the columns the rewards read, rendered with the model's chat template
    tokenizer = load_tokenizer(model_name)
    train_rows, validation_rows = load_prompt_splits(accelerator, args, tokenizer, rewards)
    seeded = torch.Generator().manual_seed(args.seed)
    # The loader hands out prompt indices (whole batches
    # only); the shuffle has a generator of its own.
    train_loader = DataLoader(
        list(range(len(train_rows))), per_process, shuffle=True, drop_last=True, generator=seeded
    )

    # ---- model, reference policy and optimizer (AdamW, weight decay on matrices only, fused on a
    # GPU)
    model = build_model(args, model_name, accelerator)  # an adapter of ours in --model: trained on
    reference = reference_policy(args, accelerator, model, model_name) if args.beta else None
    # bytes per process, the decode copy and its one
    # static KV cache (the data's longest prompt) included
    plan = print_rollout_plan(
        accelerator, args, model, reference, rows, longest_prompt(train_rows + validation_rows)
    )
    optimizer = adamw(model, lr, args.weight_decay, accelerator.device)

    # ---- the run's length: each batch of rollouts gives --num_iterations optimizer steps
    rollouts_per_epoch = whole_steps_per_epoch(len(train_loader), world, accumulation, len(train_rows), args)
    steps_per_epoch = rollouts_per_epoch * args.num_iterations
    # micro-batch updates; a loader batch gives num_iterations
    batches_per_epoch = steps_per_epoch * accumulation
    length = run_length(args, steps_per_epoch, batches_per_epoch, f"{len(train_rows)} prompts")
    warmup_steps = round(args.warmup_ratio * length.total_steps)

    setup_fsdp(accelerator, model)  # FSDP: one shard unit per transformer block of this model
    # ---- prepare: wrap for DDP / FSDP / DeepSpeed, shard the prompt loader across processes, move
    # to the device.
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    schedule = get_scheduler("linear", optimizer, warmup_steps, length.total_steps)
    scheduler = accelerator.prepare(schedule)
    # every generation of the run (rollouts and evaluations)
    # decodes in this one cache: one shape to compile
    generation.reserve_cache(accelerator, model, *plan.cache, args.decode)

    derived = settings(args, accelerator, model_name, lr, model, rewards, (train_rows, validation_rows))
    config = run_config("grpo", args, accelerator, **derived)
    config.update(epochs=length.epochs, warmup_steps=warmup_steps, total_steps=length.total_steps)

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    # Sampling is keyed (KeyedSampling): a resumed run
    # samples the same completions without any RNG state.
    figures = figure_names(rewards)
    state = RunState(accelerator.device, figures)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    best = BestModel(accelerator, state, output, "eval_reward", patience=args.early_stopping_patience)
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all
    speed = Throughput(accelerator)

    def evaluate_now() -> dict:
        """Greedy answers to every validation prompt, scored; a few go to samples.jsonl and the
        tracker."""
        scores, samples = evaluate(accelerator, model, tokenizer, validation_rows, rewards, args, rows)
        write_samples(accelerator, output, state.epoch + 1, state.step, samples, tracking)
        return scores

    def evaluate_mid_epoch() -> None:
        """--eval_every: an evaluation between epoch ends, logged and judged as those are."""
        # nothing non-finite since the last log step: model_best gets no NaN weights
        guard.check(state.step)
        state.last_eval = evaluate_now()
        scores = {
            f"eval/{k.removeprefix('eval_')}": v for k, v in state.last_eval.items() if k != "eval_samples"
        }
        progress.metrics.log(scores, state.step)
        if best.judge(state.last_eval):
            with best.saving() as folder:
                save_model(accelerator, model, tokenizer, folder)

    # ---- training loop
    # Each optimizer step: roll out (rollout_steps generates
    # and scores the step's completions), then update.
    while state.epoch < length.epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        done = state.batches_done // args.num_iterations  # batches of prompts done
        batches = epoch_batches(accelerator, train_loader, state.epoch, done)
        limit, models = (rollouts_per_epoch * accumulation - done, (accelerator, model, reference, tokenizer))
        prompts = progress.timed(batches)  # the wait for prompts timed; generating is compute
        rollouts = (limit, *models, train_rows, rewards, state.epoch, args, speed)
        batches = rollout_steps(prompts, *rollouts)
        for rollout in batches:
            state.batches_done += 1
            speed.update_started()
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                # one, or of --update_rows rows
                passes = UpdatePasses(accelerator, model, rollout, args.update_rows)
                # the gradients of all passes but the last stay local: one all-reduce, as ever
                for part in passes:
                    logprobs = token_logprobs(model, part, args.temperature)
                    loss, clip_fraction, kl = policy_loss(logprobs, part, args, part.reference_logprobs)
                    # This pass's share of the global batch's loss; x world x accumulation undoes
                    # the means that DDP and accelerator.backward take, so the gradient is that of
                    # the global batch's loss.
                    loss = loss * world * accumulation
                    accelerator.backward(loss)
                    # a non-finite loss is noted on the device, read at the next log step
                    guard.observe(loss)
                    passes.add(part, loss=loss.detach(), clip_fraction=clip_fraction, kl=kl)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.add(in_order(figures, passes.figures, rollout.figures), samples=len(rollout.indices))
            speed.trained(rollout.tokens)
            if not accelerator.sync_gradients:
                continue
            speed.update_ended()
            scheduler.step()
            if progress.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                with saving_checkpoint(checkpoints, progress, config) as folder:
                    accelerator.save_state(folder)
            if state.step % args.log_every == 0 or state.step == 1:
                log_samples(accelerator, output, state, train_rows, rollout, tracking)
            if args.eval_every and state.step % args.eval_every == 0 and not progress.finished:
                evaluate_mid_epoch()
            if progress.finished:
                break

        # ---- evaluation once per epoch, on the whole validation split
        # nothing non-finite since the last log step, before evaluating and saving
        guard.check(state.step)
        state.last_eval = evaluate_now()
        seconds = progress.epoch_done(state.last_eval, **{f"perf/{k}": v for k, v in speed.rates().items()})
        if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
            with best.saving() as folder:
                save_model(accelerator, model, tokenizer, folder)
        if accelerator.is_main_process and args.plots:
            # kept up to date every epoch
            plot_results(progress.metrics.path, output / "results.png")
        scores = scores_line(state.last_eval, GRPO_SCORES)
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
    # tokens/s of generation and of the updates, apart; the
    # plan beside peak_memory_mb; what the decode compiled
    results.update(speed.rates(), memory_plan_mb=plan.mb, **compile_figures(None, model, accelerator))
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print_run_summary(results, path, tracking, title="GRPO: summary", rows=GRPO_SUMMARY, script=__file__)


# --------------------------------------------------------------------------------------------- main
def main(args: GrpoFlags) -> None:
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
