"""The data of text_classification.py and its modes (text_classification_modes.py): a GLUE task or
your own CSV / TSV / JSON / JSONL files, tokenised, their loaders, and the model they fine-tune."""

from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
import transformers
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
)

from accelerate_recipes import (
    RecipeError,
    cpu_threads_and_workers,
    explain_load_failure,
    first_line,
    quiet_other_local_processes,
)

# GLUE task -> (text column, text-pair column, validation
# split, the metric GLUE reports besides accuracy)
GLUE_TASKS = {
    "cola": ("sentence", None, "validation", "matthews_correlation"),
    "sst2": ("sentence", None, "validation", None),
    "mrpc": ("sentence1", "sentence2", "validation", "binary_f1"),
    "qqp": ("question1", "question2", "validation", "binary_f1"),
    "mnli": ("premise", "hypothesis", "validation_matched", None),
    "qnli": ("question", "sentence", "validation", None),
    "rte": ("sentence1", "sentence2", "validation", None),
    "wnli": ("sentence1", "sentence2", "validation", None),
}

FILE_FORMATS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
}


def load_file(path: str, split: str, cache_dir: str | None, flag: str | None = None) -> datasets.Dataset:
    """One CSV / TSV / JSON / JSONL file through the `datasets` loaders (cached as Arrow in the
    datasets cache)."""
    file = Path(path).expanduser()
    flag = flag or f"--{split}_file"
    if file.suffix.lower() not in FILE_FORMATS:
        raise RecipeError(f"{flag} {path}: unknown format {file.suffix!r}; use .csv, .tsv, .json or .jsonl")
    if not file.is_file():
        raise RecipeError(
            f"{flag} {path} does not exist; give the path of a .csv, .tsv, .json or .jsonl file"
        )
    builder, options = FILE_FORMATS[file.suffix.lower()]
    try:
        return datasets.load_dataset(
            builder, data_files={split: str(file.resolve())}, split=split, cache_dir=cache_dir, **options
        )
    except Exception as err:  # pyarrow / pandas parse errors of every kind
        reason = first_line(err)
        raise RecipeError(
            f"could not read {flag} {path} as {builder} ({reason}); check the file's format"
        ) from None


@dataclass(frozen=True)
class TextSplits:
    """The train and validation splits as read, and how to read them."""

    raw: datasets.DatasetDict
    text_column: str
    text_pair_column: str | None
    label_column: str
    # the labels as they appear in the data, in id order: GLUE's class names, or the sorted distinct
    # values of the training file's label column (strings or numbers), so string labels work as-is
    label_values: list
    extra_metric: str | None  # what evaluate() reports besides accuracy


def load_text_data(
    task, train_file, validation_file, text_column, text_pair_column, label_column, cache_dir
) -> TextSplits:
    """A GLUE task's train and validation splits from the Hub, or those of your own two files."""
    if task is not None:
        if task == "stsb":
            raise RecipeError("--task stsb is a regression task (similarity scores); this recipe classifies")
        if task not in GLUE_TASKS:
            raise RecipeError(
                f"unknown --task {task!r}; choose one of {', '.join(GLUE_TASKS)}, or give --train_file"
            )
        text_column, text_pair_column, validation_split, extra_metric = GLUE_TASKS[task]
        try:
            glue = datasets.load_dataset("nyu-mll/glue", task, cache_dir=cache_dir)
        except Exception as err:  # offline, hub errors, a missing cache
            reason = first_line(err)
            raise RecipeError(
                f"could not load GLUE {task} from the Hugging Face Hub ({reason}); connect once to "
                "download it (it is cached under ~/.cache/huggingface/datasets), or train on your "
                "own files with --train_file/--validation_file"
            ) from None
        raw = datasets.DatasetDict(train=glue["train"], validation=glue[validation_split])
        names = glue["train"].features["label"].names
        return TextSplits(raw, text_column, text_pair_column, "label", names, extra_metric)

    if train_file is None or validation_file is None:
        raise RecipeError("give --task (a GLUE task) or both --train_file and --validation_file")
    raw = datasets.DatasetDict(
        train=load_file(train_file, "train", cache_dir),
        validation=load_file(validation_file, "validation", cache_dir),
    )
    for split, file in (("train", train_file), ("validation", validation_file)):
        columns = raw[split].column_names
        for flag, column in (
            ("text_column", text_column),
            ("text_pair_column", text_pair_column),
            ("label_column", label_column),
        ):
            if column is not None and column not in columns:
                raise RecipeError(
                    f"{file} has no column {column!r} (--{flag}); its columns are {', '.join(columns)}"
                )
    train_values = raw["train"].unique(label_column)
    # None, or NaN in a numeric column
    if any(value is None or value != value for value in train_values):
        raise RecipeError(
            f"{train_file}: some rows have no value in the label column {label_column!r}; fill or drop them"
        )
    label_values = sorted(train_values)
    if len(label_values) < 2:
        raise RecipeError(
            f"{train_file}: the label column {label_column!r} has the single value "
            f"{label_values[0]!r}; a classifier needs two or more labels"
        )
    unseen = sorted(set(raw["validation"].unique(label_column)) - set(label_values), key=str)
    if unseen:
        raise RecipeError(
            f"{validation_file}: label(s) {', '.join(map(repr, unseen[:5]))} in column "
            f"{label_column!r} never occur in {train_file} (known: "
            f"{', '.join(map(repr, label_values[:10]))}); fix the labels or add such examples to "
            "the training file"
        )
    return TextSplits(raw, text_column, text_pair_column, label_column, label_values, "macro_f1")


def tokenize_datasets(splits: TextSplits, tokenizer, label_ids, max_length: int) -> datasets.DatasetDict:
    """Tokenise without padding (the collator pads each batch to its longest example) and map labels
    to ids.

    `label_ids` maps the values of a file's label column to ids; None when they already are ids
    (GLUE).
    """
    text_column, pair_column, label_column = (
        splits.text_column,
        splits.text_pair_column,
        splits.label_column,
    )

    def tokenize(batch):
        texts = [t if t is not None else "" for t in batch[text_column]]
        pairs = [t if t is not None else "" for t in batch[pair_column]] if pair_column else None
        encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        labels = batch[label_column]
        encoded["labels"] = labels if label_ids is None else [label_ids[value] for value in labels]
        return encoded

    columns = splits.raw["train"].column_names
    return splits.raw.map(tokenize, batched=True, remove_columns=columns, desc="tokenize")


def glue_task(args) -> str | None:
    """The GLUE task the data flags name (sst2 when neither --task nor --train_file is given), None
    for your files."""
    task = "sst2" if args.task is None and args.train_file is None else args.task
    if task is not None and (args.train_file or args.validation_file):
        raise RecipeError("give either --task (a GLUE task) or --train_file/--validation_file, not both")
    return task


def dataset_name(args) -> str:
    """The task's name, or <folder>-<name> of the training file (e.g. reviews-train)."""
    if task := glue_task(args):
        return task
    train_file = Path(args.train_file)  # no GLUE task: a training file is given
    return f"{train_file.resolve().parent.name}-{train_file.stem}"


@dataclass
class TextData:
    """The train and validation splits, raw and tokenised, with what the model needs to know about
    them."""

    raw: datasets.DatasetDict
    tokenized: datasets.DatasetDict
    tokenizer: transformers.PreTrainedTokenizerBase
    label_names: list[str]  # the labels as strings, in id order
    extra_metric: str | None  # what evaluate() reports besides accuracy


def load_data(accelerator, args, task: str | None, model_name: str) -> TextData:
    """The data flags' train and validation splits, tokenised with the tokenizer of `model_name`.

    The local main process of each node downloads and tokenises first (into the cache); the others
    then read the cached result.
    """
    quiet_other_local_processes(accelerator)  # one copy of the libraries' logs and bars per node
    with accelerator.local_main_process_first():
        splits = load_text_data(
            task,
            args.train_file,
            args.validation_file,
            args.text_column,
            args.text_pair_column,
            args.label_column,
            args.cache_dir,
        )
        tokenizer = load_tokenizer(model_name)
        label_ids = None if task else {value: i for i, value in enumerate(splits.label_values)}
        tokenized = tokenize_datasets(splits, tokenizer, label_ids, args.max_length)
    label_names = [str(value) for value in splits.label_values]
    return TextData(splits.raw, tokenized, tokenizer, label_names, splits.extra_metric)


def data_loaders(accelerator, args, data: TextData, per_process: int) -> tuple[DataLoader, DataLoader]:
    """The training loader (shuffled, whole batches only) and the validation loader, before
    accelerator.prepare."""
    # Padding to a multiple of 8 lets fp16/bf16 matrix multiplies use tensor cores.
    collator = DataCollatorWithPadding(
        data.tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
    )
    # on the CPU also torch's threads
    num_workers = cpu_threads_and_workers(accelerator, args.num_workers, limit=2)
    loader_args = dict(collate_fn=collator, num_workers=num_workers, pin_memory=torch.cuda.is_available())
    # The shuffle gets a generator of its own: starting an epoch then draws nothing from the global
    # RNG (dropout's), which checkpoints restore.
    train_loader = DataLoader(
        data.tokenized["train"],
        batch_size=per_process,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
        **loader_args,
    )
    eval_loader = DataLoader(
        data.tokenized["validation"], batch_size=per_process * args.gradient_accumulation_steps, **loader_args
    )
    return train_loader, eval_loader


def load_tokenizer(name: str):
    with explain_load_failure(name):
        return AutoTokenizer.from_pretrained(name)


def load_model(name: str, label_names: list[str], task: str | None):
    """Sequence-classification model from a Hub name or a local directory, with the label
    mapping."""
    with explain_load_failure(name):
        config = AutoConfig.from_pretrained(
            name,
            num_labels=len(label_names),
            finetuning_task=task,
            id2label=dict(enumerate(label_names)),
            label2id={label: i for i, label in enumerate(label_names)},
        )
        # A checkpoint already fine-tuned on another label
        # set gets a fresh classifier of the right size.
        return AutoModelForSequenceClassification.from_pretrained(
            name, config=config, ignore_mismatched_sizes=True, dtype=torch.float32
        )
