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

One function per mode: train() reads top to bottom (config -> accelerator -> data -> model and
reference -> optimizer -> prepare -> resume -> loop -> eval -> save); evaluate_saved_model() is
--eval_only; --predict, --chat and --merge come from the chat recipes' shared layer (chat/model.py).
The pair formats are in chat/preference_pairs.py.

Install: `pip install -e '.[chat]'` from a clone of accelerate-recipes (the runtime plus datasets,
peft and gguf).
"""

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType, gather_object, send_to_device, set_seed
from chat.conversations import dataset_name
from chat.generation import without_compiling
from chat.model import (
    BASE,
    DEFAULT_MODEL,
    SAMPLES_KEPT,
    ChatModelFlags,
    KernelFlags,
    adamw,
    build_model,
    chat,
    check_one_mode,
    compile_figures,
    generate_answers,
    is_adapter,
    load_any,
    load_tokenizer,
    merge,
    model_facts,
    predict,
    print_saved,
    reference_model,
    reference_policy,
    row_multiple,
    save_model,
    settle_compile,
    token_logprobs,
    use_kernels,
    write_samples,
)
from chat.packed_attention import PACKED_KWARGS, choose_attention
from chat.packing import check_packing
from chat.preference_pairs import load_pairs, pair_collator, tokenize_pairs
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RecipeError,
    RunState,
    check_launch,
    check_launch_flags,
    clip_norm,
    cpu_threads_and_workers,
    epoch_batches,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    keeps_update,
    prepare_output_dir,
    print_summary,
    quiet_other_local_processes,
    run,
    run_config,
    saving_checkpoint,
    setup_fsdp,
    setup_tracker,
    training_accelerator,
    training_progress,
    write_results,
)
from accelerate_recipes.checkpoints import read_progress
from accelerate_recipes.compiling import compile_summary_keys
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


def check_flags(args: DpoFlags) -> None:
    """Flags that cannot work together, before anything loads."""
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5 or args.sft_weight < 0:
        raise RecipeError("--beta must be > 0, 0 <= --label_smoothing < 0.5 and --sft_weight >= 0")
    if args.label_smoothing and args.loss_type != "sigmoid":
        raise RecipeError(f"--label_smoothing applies to --loss_type sigmoid only, not {args.loss_type}")


# --------------------------------------------------------------------------------------------- data
def load_data(accelerator, args: DpoFlags, tokenizer) -> tuple[dict, dict]:
    """({train, validation}: tokenised pairs, counts per split). The local main process of each node
    reads first (into the datasets cache); the others then read the cached files."""
    quiet_other_local_processes(accelerator)  # one copy of the libraries' logs and bars per node
    dataset_name(args)  # refuses a run without data before anything loads
    with accelerator.local_main_process_first():
        raw = load_pairs(
            args.train_file,
            args.validation_file,
            args.dataset,
            args.cache_dir,
            args.validation_size,
            args.seed,
        )
    splits, counts = {}, {}
    for split, pairs in zip(("train", "validation"), raw):
        if not pairs:  # --eval_only with a validation file alone
            splits[split], counts[split] = [], {"pairs": 0, "dropped": 0, "truncated": 0}
            continue
        splits[split], counts[split] = tokenize_pairs(tokenizer, pairs, args.max_length, args.too_long, split)
        count = counts[split]
        if count["dropped"] or count["truncated"]:
            accelerator.print(
                f"{split}: of {count['pairs']} pairs, {count['dropped']} longer than --max_length "
                f"{args.max_length} "
                f"were dropped and {count['truncated']} cut to fit (--too_long {args.too_long})"
            )
    return splits, counts


def data_loaders(accelerator, args: DpoFlags, tokenizer, splits: dict, per_process: int) -> tuple:
    """The training loader (shuffled, whole batches only; None without training pairs, as
    --eval_only may have) and the validation loader, before accelerator.prepare."""
    pad_to = row_multiple(accelerator, args.compile and args.packing)
    num_workers = cpu_threads_and_workers(accelerator, args.num_workers, limit=2)
    loader_args = dict(num_workers=num_workers, pin_memory=torch.cuda.is_available())
    # compiled: one bound for every packed row (one_bound)
    longest = args.max_length if args.compile else None
    collate = pair_collator(tokenizer, args.packing, pad_to, longest)
    # The shuffle has a generator of its own: starting an
    # epoch then draws nothing from the global RNG.
    generator = torch.Generator().manual_seed(args.seed)
    train_loader = None
    if splits["train"]:
        train_loader = DataLoader(
            splits["train"],
            per_process,
            shuffle=True,
            drop_last=True,
            generator=generator,
            collate_fn=collate,
            **loader_args,
        )
    eval_loader = DataLoader(splits["validation"], per_process, collate_fn=collate, **loader_args)
    return train_loader, eval_loader


def first_batches(batches, limit: int):
    """The first `limit` batches of a loader: the whole steps of an epoch. The rest is read and left
    out, as drop_last leaves out a partial batch, so that the loader ends its epoch as usual."""
    for index, batch in enumerate(batches):
        if index < limit:
            yield batch


# --------------------------------------------------------------------------------------------- loss
def answer_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(each answer's log-probability, summed over its tokens; its answer tokens): chosen answers
    first, then the rejected ones. Only the answers' positions get logits: the last columns of a
    padded batch, or in a packed row (--packing) the positions answer_index names, laid out as a
    padded batch's."""
    answer_mask = batch["answer_mask"]
    if "position_ids" in batch:  # packed: one row, positions restarting per sequence, no mask
        # where the sequences start, for the attention
        packed = {key: batch[key] for key in PACKED_KWARGS}
        # the positions that predict each answer token
        row, at = batch["input_ids"], batch["answer_index"]
        logprobs = token_logprobs(model, row, None, row[0, at + 1], batch["position_ids"], at=at, **packed)
    else:
        positions = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)  # left padding skipped
        targets = batch["input_ids"][:, -answer_mask.shape[1] :]
        logprobs = token_logprobs(model, batch["input_ids"], batch["attention_mask"], targets, positions)
    return (logprobs * answer_mask).sum(dim=1), answer_mask.sum(dim=1)


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


def pair_figures(policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, args) -> dict:
    """Each pair's loss and the FIGURES a user watches, as tensors of one value per pair, from the
    rows' summed answer log-probabilities under the policy and the reference (chosen rows first) and
    their token counts."""
    pairs = len(policy) // 2
    # IPO compares mean token log-probabilities (as TRL), so length does not count
    if args.loss_type == "ipo":
        policy, reference = policy / tokens, reference / tokens
    chosen, rejected = policy[:pairs], policy[pairs:]
    chosen_reward = args.beta * (chosen - reference[:pairs]).detach()
    rejected_reward = args.beta * (rejected - reference[pairs:]).detach()
    margin = (chosen - reference[:pairs]) - (rejected - reference[pairs:])
    if args.loss_type == "sigmoid":
        smoothing = args.label_smoothing
        loss = -(1 - smoothing) * F.logsigmoid(args.beta * margin) - smoothing * F.logsigmoid(
            -args.beta * margin
        )
    elif args.loss_type == "ipo":
        loss = (margin - 1 / (2 * args.beta)) ** 2
    else:  # hinge
        loss = torch.relu(1 - args.beta * margin)
    mean_nll = -chosen / tokens[:pairs] if args.loss_type != "ipo" else -chosen
    if args.sft_weight:
        loss = loss + args.sft_weight * mean_nll
    logps_chosen, logps_rejected = policy[:pairs].detach(), policy[pairs:].detach()
    return dict(
        loss=loss,
        rewards_chosen=chosen_reward,
        rewards_rejected=rejected_reward,
        reward_margin=chosen_reward - rejected_reward,
        reward_accuracy=(chosen_reward > rejected_reward).float(),
        logps_chosen=logps_chosen,
        logps_rejected=logps_rejected,
        logp_accuracy=(logps_chosen > logps_rejected).float(),
        nll_chosen=mean_nll.detach(),
    )


class StoredReference:
    """--precompute_ref: the reference's answer log-probabilities of every pair (chosen, rejected),
    by split and index, computed once before training by the model itself (the reference is the
    policy the run starts from), and saved with each checkpoint
    (accelerator.register_for_checkpointing), so a resumed run reads the same ones."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}  # per split: [pairs, 2], chosen and rejected

    def lookup(self, split: str, index: torch.Tensor) -> torch.Tensor:
        values = self.values[split][index.cpu()]
        return torch.cat([values[:, 0], values[:, 1]])  # the rows' order: chosen answers first

    @torch.no_grad()
    def compute(self, accelerator, model, splits: dict, collate, batch_size: int) -> float:
        """Every pair of every split, each process answering an equal share of batches (a sharded
        model's forward passes are collective), gathered; returns the seconds it took."""
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        world = accelerator.num_processes
        for split, pairs in splits.items():
            share = math.ceil(math.ceil(len(pairs) / world) / batch_size) * batch_size
            order = list(range(len(pairs)))
            # equal shares; the repeats agree
            padded = order + order[-1:] * (share * world - len(order))
            found = []
            with accelerator.split_between_processes(padded) as mine:
                for start in range(0, len(mine), batch_size):
                    batch = send_to_device(
                        collate([pairs[i] for i in mine[start : start + batch_size]]), model.device
                    )
                    logprobs = answer_logprobs(model, batch)[0].float().cpu()
                    half = len(logprobs) // 2
                    found += zip(batch["index"].tolist(), logprobs[:half].tolist(), logprobs[half:].tolist())
            values = torch.zeros(len(pairs), 2)
            for index, chosen, rejected in gather_object(found):
                values[index] = torch.tensor([chosen, rejected])
            self.values[split] = values
        model.train(was_training)
        return time.perf_counter() - started

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def check_same_reference(folder, precompute_ref: bool) -> None:
    """A checkpoint holds the stored reference log-probabilities exactly when its run had
    --precompute_ref; resumed with the other setting, load_state would miss them or find one object
    too many."""
    saved = bool(read_progress(Path(folder)).get("config", {}).get("precompute_ref"))
    if saved != precompute_ref:
        given = "with" if saved else "without"
        raise RecipeError(
            f"checkpoint {folder} was written by a run {given} --precompute_ref; resume it {given} the flag, "
            "or "
            "start a new run in another --output_dir"
        )


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
    conversations = [pair["prompt"] + pair["chosen"][:1] for pair in pairs[: args.eval_generate]]
    _, samples = generate_answers(
        model, tokenizer, conversations, accelerator, args.max_new_tokens, 8, args.decode
    )
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
    # by default on a CUDA GPU; a compile failure goes on eagerly
    blocks = settle_compile(args, accelerator)
    generation_off = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if args.eval_generate and generation_off:
        accelerator.print(
            "--eval_generate is off: answers need the whole model in each process, which this run shards"
        )
        args.eval_generate = 0
    set_seed(args.seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data: pairs rendered with the model's chat template
    tokenizer = load_tokenizer(model_name)
    splits, counts = load_data(accelerator, args, tokenizer)
    train_loader, eval_loader = data_loaders(accelerator, args, tokenizer, splits, per_process)

    # ---- model and reference policy (none with --precompute_ref: the model itself before its first
    # step) packed rows on a GPU: torch's variable-length flash
    # kernel, unless --attn_implementation says otherwise
    args.attn_implementation = choose_attention(args.attn_implementation, args.packing, accelerator)
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
    if steps_per_epoch == 0:
        raise RecipeError(
            f"the training pairs ({len(splits['train'])}) are fewer than one global batch "
            f"({args.batch_size}); lower "
            "--batch_size or use more pairs"
        )
    batches_per_epoch = steps_per_epoch * accumulation
    total_steps = args.max_steps if args.max_steps else args.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(args.warmup_ratio * total_steps)

    setup_fsdp(accelerator, model)  # FSDP: one shard unit per transformer block of this model
    # ---- prepare: wrap for DDP / FSDP / DeepSpeed, shard the loaders across processes, move to the
    # device.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    scheduler = accelerator.prepare(get_scheduler("linear", optimizer, warmup_steps, total_steps))

    config = run_config(
        "dpo", args, accelerator, **settings(args, model_name, lr, model, counts, per_process)
    )
    config.update(warmup_steps=warmup_steps, total_steps=total_steps, epochs=num_epochs)

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
    progress = training_progress(
        accelerator,
        args,
        state,
        best,
        resume_from,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        batches_per_epoch=batches_per_epoch,
    )
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    if resume_from is None:  # the answers before any update, to compare with those after
        sample_answers(accelerator, model, tokenizer, splits["validation"], args, 0, 0, output, tracking)

    # ---- training loop
    while state.epoch < num_epochs and not progress.finished:
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
        if accelerator.is_main_process:
            # the accuracies and the margin: the log-probabilities are on another scale
            plot_results(progress.metrics.path, output / "results.png", eval_keys=PLOTTED)
        accelerator.print(
            f"epoch {state.epoch + 1}/{num_epochs}: {scores_line(state.last_eval)}, {seconds:.1f} s"
        )
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
    # all ranks tear the process group down together, none while others still talk
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        path = write_results(output, results)
        print_run_summary(results, path, tracking)


# ---------------------------------------------------------------------------------------- reporting
def settings(args: DpoFlags, model_name: str, lr: float, model, counts: dict, per_process: int) -> dict:
    """What the run derived from its flags and data, for run_config (the tracker, checkpoints,
    results.json)."""
    return dict(
        dataset=dataset_name(args),
        model=model_name,
        # lora or full, its parameters, the library versions, the attention
        **model_facts(args, model),
        lr=lr,
        per_process_batch_size=per_process,
        train_size=counts["train"]["pairs"] - counts["train"]["dropped"],
        validation_size=counts["validation"]["pairs"] - counts["validation"]["dropped"],
        train_dropped=counts["train"]["dropped"],
        train_truncated=counts["train"]["truncated"],
    )


def token_rates(results: dict, pairs: list[dict]) -> dict:
    """Tokens per second through the model: pairs per second x the mean tokens of a pair's two rows
    (the prompt is read twice, once before each answer; padding not counted)."""
    per_pair = sum(
        2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs
    ) / len(pairs)
    return dict(train_tokens_per_second=results["train_samples_per_second"] * per_pair)


def scores_line(evaluation: dict) -> str:
    """An evaluation in one line: `loss 0.6931, reward_margin 0.0000, reward_accuracy 0.5000,
    logp_accuracy 0.4`."""
    keys = ("eval_loss", "eval_reward_margin", "eval_reward_accuracy", "eval_logp_accuracy")
    return ", ".join(f"{k.removeprefix('eval_')} {evaluation[k]:.4f}" for k in keys if k in evaluation)


def print_run_summary(results: dict, path: Path, tracking) -> None:
    keys = [
        "dataset",
        "model",
        "method",
        "loss_type",
        "beta",
        "world_size",
        "num_machines",
        "mixed_precision",
    ]
    keys += [
        "global_batch_size",
        "steps",
        "epochs",
        "eval_loss",
        "eval_reward_margin",
        "eval_reward_accuracy",
    ]
    keys += ["eval_logp_accuracy", "best_metric", "best_epoch", "train_tokens_per_second", "peak_memory_mb"]
    keys += ["wall_seconds", *compile_summary_keys(results)]
    print_summary(results, keys, title="DPO: summary")
    print_saved(results, path, tracking, __file__)


# ----------------------------------------------------------------------------------------- evaluate
def evaluate_saved_model(args: DpoFlags) -> None:
    """--eval_only: --model (default --output_dir) on every validation pair against
    --reference_model (default: an adapter's base); the figures to results.json in --output_dir. Any
    number of processes, each pair once."""
    started = time.perf_counter()
    check_flags(args)
    output = Path(args.output_dir)
    model_dir = args.model or args.output_dir
    accelerator = evaluation_accelerator(args)
    per_process = check_launch(accelerator, args.batch_size, args.gradient_accumulation_steps)
    set_seed(args.seed)
    prepare_output_dir(output)
    if not args.reference_model and not is_adapter(model_dir):
        raise RecipeError(
            f"--model {model_dir} is a whole model: give --reference_model (the model it was tuned from) to "
            "measure "
            "its rewards against"
        )
    model, tokenizer = load_any(model_dir)
    splits, _ = load_data(accelerator, args, tokenizer)
    _, eval_loader = data_loaders(accelerator, args, tokenizer, splits, per_process)
    reference = BASE
    if args.reference_model:
        reference = load_any(args.reference_model)[0].eval().requires_grad_(False).to(accelerator.device)
    # the loaded models' attention (sdpa unless saved otherwise) must keep packed sequences apart
    if args.packing:
        check_packing(model)
        if reference is not BASE:
            check_packing(reference)
    # evaluation_mode: no DDP wrapper, which refuses a
    # model without trainable weights (a loaded adapter)
    model, eval_loader = (
        accelerator.prepare_model(model, evaluation_mode=True),
        accelerator.prepare(eval_loader),
    )
    evaluation = evaluate(accelerator, model, reference, eval_loader, args, None)
    if args.eval_generate:
        conversations = [p["prompt"] + p["chosen"][:1] for p in splits["validation"][: args.eval_generate]]
        _, samples = generate_answers(
            model, tokenizer, conversations, accelerator, args.max_new_tokens, 8, args.decode
        )
        accelerator.print("\n".join(json.dumps(s, ensure_ascii=False) for s in samples[:SAMPLES_KEPT]))
    accelerator.print(f"{scores_line(evaluation)} on {evaluation['eval_samples']} validation pairs")
    config = eval_only_config(
        "dpo",
        args,
        accelerator,
        dataset=dataset_name(args),
        model=model_dir,
        reference_model=args.reference_model or "the adapter's base",
        loss_type=args.loss_type,
        beta=args.beta,
        validation_size=len(splits["validation"]),
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        print(f"{write_results(output, results).name} saved in {output}")


# --------------------------------------------------------------------------------------------- main
def main(args: DpoFlags) -> None:
    """Train, or evaluate a saved model (--eval_only), or use it (--predict): a function per mode."""
    if args.predict is not None and args.eval_only:
        raise RecipeError("give --predict or --eval_only, not both")
    check_one_mode(args)
    if args.predict is not None:
        return predict(args)
    if args.chat:
        return chat(args)
    if args.merge:
        return merge(args)
    if args.eval_only:
        return evaluate_saved_model(args)
    return train(args)


if __name__ == "__main__":
    run(main)
