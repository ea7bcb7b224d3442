"""DPO's set-up (recipes/dpo.py), in training and under --eval_only: the flags checked and taken
as the launch needs them, the data flags' pairs tokenised and batched, greedy answers to a few
validation prompts, and the settings and token rates the run reports.
"""

from dataclasses import replace

import torch
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from accelerate_recipes import RecipeError, cpu_threads_and_workers, quiet_other_local_processes

from .conversations import dataset_name
from .model import compile_settled, generate_answers, row_multiple
from .packed_attention import choose_attention
from .preference_pairs import load_pairs, pair_collator, tokenize_pairs
from .run_summary import run_settings
from .splits import read_splits


def check_flags(args) -> None:
    """Flags that cannot work together, before anything loads."""
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5 or args.sft_weight < 0:
        raise RecipeError("--beta must be > 0, 0 <= --label_smoothing < 0.5 and --sft_weight >= 0")
    if args.label_smoothing and args.loss_type != "sigmoid":
        raise RecipeError(f"--label_smoothing applies to --loss_type sigmoid only, not {args.loss_type}")


def launch_flags(args, accelerator) -> tuple:
    """(the flags as this launch takes them, the decoder blocks' compiled path): --compile by
    default on a CUDA GPU where inductor can work (compile_settled), --eval_generate off where the
    run shards the model (said so), and the attention implementation to load the model with
    (choose_attention: for packed rows on a GPU, torch's variable-length flash kernel, unless
    --attn_implementation says otherwise). A copy: the parsed flags stay as given."""
    args, blocks = compile_settled(args, accelerator)
    generation_off = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if args.eval_generate and generation_off:
        accelerator.print(
            "--eval_generate is off: answers need the whole model in each process, which this run shards"
        )
        args = replace(args, eval_generate=0)
    attention = choose_attention(args.attn_implementation, args.packing, accelerator)
    return replace(args, attn_implementation=attention), blocks


def load_pair_splits(accelerator, args, tokenizer) -> tuple[dict, dict]:
    """({train, validation}: tokenised pairs, counts per split). The local main process of each node
    reads first (into the datasets cache); the others then read the cached files."""
    quiet_other_local_processes(accelerator)  # one copy of the libraries' logs and bars per node
    dataset_name(args)  # refuses a run without data before anything loads
    raw = read_splits(accelerator, args, load_pairs)
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


def pair_loaders(accelerator, args, tokenizer, splits: dict, per_process: int) -> tuple:
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


def validation_answers(accelerator, model, tokenizer, pairs: list[dict], args) -> list[dict]:
    """Greedy answers to the first --eval_generate validation prompts beside their chosen answers:
    [{prompt, reference, answer}, ...]."""
    conversations = [pair["prompt"] + pair["chosen"][:1] for pair in pairs[: args.eval_generate]]
    _, samples = generate_answers(
        model, tokenizer, conversations, accelerator, args.max_new_tokens, 8, args.decode
    )
    return samples


def settings(args, model_name: str, lr: float, model, counts: dict, per_process: int) -> dict:
    """What the run derived from its flags and data, for run_config (the tracker, checkpoints,
    results.json)."""
    return run_settings(
        args,
        dataset_name(args),
        model_name,
        lr,
        model,
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
