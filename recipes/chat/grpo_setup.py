"""GRPO's set-up (recipes/grpo.py), in training and under --eval_only: the flags checked, the
prompts of the data flags' two splits rendered with the chat template and tokenised with the columns
the rewards read checked, the run's length in whole batches of prompts, and the settings it derived.
"""

import dataclasses

from accelerate_recipes import RecipeError, quiet_other_local_processes

from . import generation
from .conversations import dataset_name
from .rewards import Rewards, check_columns, load_prompts
from .run_summary import run_settings
from .splits import read_splits


def check_flags(args):
    """Flags that cannot work together, refused before anything loads; returns the flags the run
    uses: --checkpoint_every rounded up to a multiple of --num_iterations (said so), since
    checkpoints fall between batches of rollouts, which a resume samples again."""
    if args.num_generations < 2:
        raise RecipeError(
            f"--num_generations {args.num_generations}: a group needs 2 or more completions to compare"
        )
    counts_ok = args.num_iterations >= 1 and args.max_new_tokens >= 1
    if not counts_ok or args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise RecipeError(
            "--num_iterations and --max_new_tokens must be >= 1, --temperature > 0, 0 < --top_p <= 1"
        )
    counts_ok = args.top_k >= 0 and args.eval_num_samples >= 0
    if not counts_ok or not 0 <= args.min_p < 1 or args.repetition_penalty <= 0:
        raise RecipeError(
            "--top_k and --eval_num_samples must be >= 0, 0 <= --min_p < 1, --repetition_penalty > 0"
        )
    if args.update_rows < 0:
        raise RecipeError(
            f"--update_rows {args.update_rows}: give the completions per update pass, or 0 for all"
        )
    every = args.checkpoint_every
    if not every or every % args.num_iterations == 0:
        return args
    rounded = -(-every // args.num_iterations) * args.num_iterations
    print(f"--checkpoint_every {every} rounded up to {rounded}, a multiple of --num_iterations")
    return dataclasses.replace(args, checkpoint_every=rounded)


def tokenize_prompts(
    accelerator, tokenizer, rows: list[dict], max_prompt_length: int, split: str
) -> list[dict]:
    """Each row with `prompt_ids`: its messages rendered with the chat template and the generation
    prompt. Rows longer than --max_prompt_length are left out, and counted."""
    kept = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append(dict(row, prompt_ids=ids))
    if len(kept) < len(rows):
        accelerator.print(
            f"{split}: {len(rows) - len(kept)} of {len(rows)} prompts longer than --max_prompt_length"
        )
    if not kept:
        raise RecipeError(f"{split}: no prompt fits in --max_prompt_length {max_prompt_length}; raise it")
    return kept


def load_prompt_splits(accelerator, args, tokenizer, rewards: Rewards) -> tuple[list, list]:
    """(training prompts, validation prompts), tokenised, with the columns the rewards need checked.
    The local main process of each node reads first (into the datasets cache); the others then read
    the cached files."""
    quiet_other_local_processes(accelerator)  # one copy of the libraries' logs and bars per node
    dataset_name(args)  # refuses a run without data before anything loads
    train_rows, validation_rows = read_splits(accelerator, args, load_prompts)
    train_rows = tokenize_prompts(accelerator, tokenizer, train_rows, args.max_prompt_length, "train")
    validation_rows = tokenize_prompts(
        accelerator, tokenizer, validation_rows, args.max_prompt_length, "validation"
    )
    check_columns(rewards, train_rows, "training prompts")
    check_columns(rewards, validation_rows, "validation prompts")
    return train_rows, validation_rows


def load_validation_prompts(accelerator, args, tokenizer, rewards: Rewards) -> list[dict]:
    """--eval_only's prompts: the validation split alone, tokenised, its reward columns checked."""
    _, validation_rows = read_splits(accelerator, args, load_prompts)
    validation_rows = tokenize_prompts(
        accelerator, tokenizer, validation_rows, args.max_prompt_length, "validation"
    )
    check_columns(rewards, validation_rows, "validation prompts")
    return validation_rows


def longest_prompt(rows: list[dict]) -> int:
    """Tokens of the longest prompt among `rows`: the static KV cache every generation of the run
    decodes in."""
    return max(len(row["prompt_ids"]) for row in rows)


def whole_steps_per_epoch(loader_batches: int, world: int, accumulation: int, prompts: int, args) -> int:
    """Batches of rollouts per epoch: whole global batches of prompts only."""
    steps = loader_batches // world // accumulation
    if steps == 0:
        raise RecipeError(
            f"the training prompts ({prompts}) are fewer than one global batch ({args.batch_size}); lower "
            "--batch_size or use more prompts"
        )
    return steps


def settings(args, accelerator, model_name: str, lr: float, model, rewards: Rewards, splits: tuple) -> dict:
    """What the run derived from its flags and data (`splits`: the training and validation prompts),
    for run_config (the tracker, checkpoints, results.json)."""
    return run_settings(
        args,
        dataset_name(args),
        model_name,
        lr,
        model,
        rewards=rewards.names,
        reward_weights=rewards.weights,
        train_size=len(splits[0]),
        validation_size=len(splits[1]),
        per_process_batch_size=args.batch_size
        // accelerator.num_processes
        // args.gradient_accumulation_steps,
        # what --decode chose on this device
        decode_mode=generation.decode_mode(args.decode, accelerator.device, accelerator.distributed_type),
    )
