"""What sft.py and its modes (sft_modes.py) set up the same way: the flags as the launch takes
them, the conversations, tokenised with the loss mask, and their loaders."""

from dataclasses import replace
from pathlib import Path

import datasets
import torch
from chat.conversations import load_conversations, tokenize_splits
from chat.model import compile_settled, row_multiple
from chat.packing import PackedRows, collator, token_budget_rows
from torch.utils.data import DataLoader

from accelerate_recipes import RecipeError, cpu_threads_and_workers, quiet_other_local_processes


def launch_flags(args, accelerator) -> tuple:
    """(the flags as this launch takes them, the decoder blocks' compiled path): --compile by
    default on a CUDA GPU without --liger where inductor can work (compile_settled), and with
    --batch_tokens the global batch that check_launch divides, a row per process per micro-step.
    A copy: the parsed flags stay as given."""
    args, blocks = compile_settled(args, accelerator)
    if not args.batch_tokens:
        return args, blocks
    if not args.packing:
        raise RecipeError("--batch_tokens fills packed rows by tokens; add --packing")
    if args.batch_tokens < args.max_length:
        raise RecipeError(
            f"--batch_tokens {args.batch_tokens} is below --max_length {args.max_length}: a "
            "conversation may not fit in a row; raise --batch_tokens or lower --max_length"
        )
    rows = accelerator.num_processes * args.gradient_accumulation_steps
    return replace(args, batch_size=rows), blocks


def dataset_name(args) -> str:
    """The Hub dataset's name, or <folder>-<name> of the training file (e.g. chats-train)."""
    if args.dataset:
        return args.dataset.rsplit("/", 1)[-1]
    if not args.train_file:
        raise RecipeError("give --train_file (a .json/.jsonl of conversations) or --dataset (a Hub dataset)")
    return f"{Path(args.train_file).resolve().parent.name}-{Path(args.train_file).stem}"


def load_data(accelerator, args, tokenizer) -> tuple[datasets.DatasetDict, datasets.DatasetDict, dict]:
    """(raw conversations, tokenised with the loss mask, counts per split). The local main process
    of each node reads and tokenises first (into the datasets cache); the others then read the
    cached result."""
    quiet_other_local_processes(accelerator)  # one copy of the libraries' logs and bars per node
    dataset_name(args)  # refuses a run without data before anything loads
    with accelerator.local_main_process_first():
        raw = load_conversations(
            args.train_file,
            args.validation_file,
            args.dataset,
            args.cache_dir,
            args.validation_size,
            args.seed,
        )
        tokenized, counts = tokenize_splits(raw, tokenizer, args.max_length)
    for split, count in counts.items():
        if count["truncated"] or count["without_targets"]:
            accelerator.print(
                f"{split}: {count['truncated']} of {count['examples']} conversations cut at --max_length "
                f"{args.max_length}; {count['without_targets']} of them kept no answer token and were dropped"
            )
    return raw, tokenized, counts


def data_loaders(accelerator, args, tokenizer, tokenized, per_process: int) -> tuple:
    """The training loader (shuffled, whole batches only; packed with --packing, in rows of
    --batch_tokens), the validation loader (padded, so each conversation's loss stays its own),
    before accelerator.prepare, and the conversations of a training micro-batch (on average over an
    epoch with --batch_tokens: the global batch in conversations is then that times the processes
    and the accumulation steps)."""
    pad_to, train_pad_to = (
        row_multiple(accelerator),
        row_multiple(accelerator, args.compile and args.packing),
    )
    # compiled: one bound for every packed row (one_bound)
    longest = args.max_length if args.compile else None
    # on the CPU also torch's threads
    num_workers = cpu_threads_and_workers(accelerator, args.num_workers, limit=2)
    loader_args = dict(num_workers=num_workers, pin_memory=torch.cuda.is_available())
    train_set = tokenized["train"]
    conversations = per_process
    if args.batch_tokens:  # items are rows of conversations, one per micro-batch (per_process is 1)
        train_set = PackedRows(train_set, token_budget_rows(train_set["num_tokens"], args.batch_tokens))
        conversations = sum(map(len, train_set.rows)) / len(train_set.rows)
    # The shuffle gets a generator of its own: starting an epoch then draws nothing from the global
    # RNG (dropout's), which checkpoints restore.
    train_loader = DataLoader(
        train_set,
        batch_size=per_process,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
        collate_fn=collator(tokenizer, args.packing, train_pad_to, longest),
        **loader_args,
    )
    eval_loader = DataLoader(
        tokenized["validation"],
        batch_size=round(conversations) * args.gradient_accumulation_steps,
        collate_fn=collator(tokenizer, False, pad_to),
        **loader_args,
    )
    return train_loader, eval_loader, conversations
