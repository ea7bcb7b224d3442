#!/usr/bin/env python
"""Fine-tune a transformers model for text classification with Hugging Face Accelerate: 1 GPU, N GPUs, N nodes, FSDP.

    python recipes/text_classification.py --task sst2                         # GLUE SST-2 with bert-base-cased
    python recipes/text_classification.py --train_file train.csv --validation_file dev.csv --label_column label
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/text_classification.py --task mrpc
    python recipes/text_classification.py --predict "a gripping, funny film" --model outputs/text

The script reads top to bottom: config -> data -> model -> prepare -> loop -> eval -> save. `--batch_size` is the
GLOBAL batch (all processes together), so the same flags give the same training on any number of GPUs.

Install: `pip install -e '.[text]'` from a clone of accelerate-recipes (the runtime plus datasets and torchmetrics).
"""

from accelerate_recipes.cli import answer_help_from_source

answer_help_from_source(__name__, __file__)  # -h/--help at once, before torch and the rest import

import json
import math
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import binary_f1_score, binary_matthews_corrcoef, multiclass_f1_score
from transformers import (
    AttentionMaskInterface,
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

from accelerate_recipes import (
    Checkpoints,
    RecipeError,
    RunState,
    StepMeter,
    TrainLog,
    check_launch,
    cpu_threads_and_workers,
    explain_startup_failure,
    first_line,
    model_to_save,
    num_machines,
    prepare_output_dir,
    print_summary,
    run,
    run_facts,
    setup_fsdp,
    setup_tracker,
    write_results,
)
from accelerate_recipes.plots import plot_results

DEFAULT_MODEL = "google-bert/bert-base-cased"
MIN_USEFUL_STEPS = 100  # below this many optimizer steps a fine-tune is warned that it may not learn
# GLUE task -> (text column, text-pair column, validation split, the metric GLUE reports besides accuracy)
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
FILE_FORMATS = {".csv": ("csv", {}), ".tsv": ("csv", {"sep": "\t"}), ".json": ("json", {}), ".jsonl": ("json", {})}


# ----------------------------------------------------------------------------------------------------------- data
def load_file(path: str, split: str, cache_dir: str | None, flag: str | None = None) -> datasets.Dataset:
    """One CSV / TSV / JSON / JSONL file through the `datasets` loaders (cached as Arrow in the datasets cache)."""
    file = Path(path).expanduser()
    flag = flag or f"--{split}_file"
    if file.suffix.lower() not in FILE_FORMATS:
        raise RecipeError(f"{flag} {path}: unknown format {file.suffix!r}; use .csv, .tsv, .json or .jsonl")
    if not file.is_file():
        raise RecipeError(f"{flag} {path} does not exist; give the path of a .csv, .tsv, .json or .jsonl file")
    builder, options = FILE_FORMATS[file.suffix.lower()]
    try:
        return datasets.load_dataset(builder, data_files={split: str(file.resolve())}, split=split,
                                     cache_dir=cache_dir, **options)
    except Exception as err:  # pyarrow / pandas parse errors of every kind
        reason = first_line(err)
        raise RecipeError(f"could not read {flag} {path} as {builder} ({reason}); check the file's format") from None


def load_text_data(task, train_file, validation_file, text_column, text_pair_column, label_column, cache_dir):
    """Return (DatasetDict with train and validation, text column, pair column, label column, label values, metric).

    `label values` are the labels as they appear in the data, in id order: GLUE's class names, or the sorted distinct
    values of the training file's label column (strings or numbers), so string labels work unchanged.
    """
    if task is not None:
        if task == "stsb":
            raise RecipeError("--task stsb is a regression task (similarity scores); this recipe classifies")
        if task not in GLUE_TASKS:
            raise RecipeError(f"unknown --task {task!r}; choose one of {', '.join(GLUE_TASKS)}, or give --train_file")
        text_column, text_pair_column, validation_split, extra_metric = GLUE_TASKS[task]
        try:
            glue = datasets.load_dataset("nyu-mll/glue", task, cache_dir=cache_dir)
        except Exception as err:  # offline, hub errors, a missing cache
            reason = first_line(err)
            raise RecipeError(
                f"could not load GLUE {task} from the Hugging Face Hub ({reason}); connect once to download it "
                "(it is cached under ~/.cache/huggingface/datasets), or train on your own files with "
                "--train_file/--validation_file"
            ) from None
        raw = datasets.DatasetDict(train=glue["train"], validation=glue[validation_split])
        return raw, text_column, text_pair_column, "label", glue["train"].features["label"].names, extra_metric

    if train_file is None or validation_file is None:
        raise RecipeError("give --task (a GLUE task) or both --train_file and --validation_file")
    raw = datasets.DatasetDict(
        train=load_file(train_file, "train", cache_dir), validation=load_file(validation_file, "validation", cache_dir)
    )
    for split, file in (("train", train_file), ("validation", validation_file)):
        columns = raw[split].column_names
        for flag, column in (("text_column", text_column), ("text_pair_column", text_pair_column),
                             ("label_column", label_column)):
            if column is not None and column not in columns:
                raise RecipeError(f"{file} has no column {column!r} (--{flag}); its columns are {', '.join(columns)}")
    train_values = raw["train"].unique(label_column)
    if any(value is None or value != value for value in train_values):  # None, or NaN in a numeric column
        raise RecipeError(f"{train_file}: some rows have no value in the label column {label_column!r}; fill or drop them")
    label_values = sorted(train_values)
    if len(label_values) < 2:
        raise RecipeError(f"{train_file}: the label column {label_column!r} has the single value {label_values[0]!r}; "
                          "a classifier needs two or more labels")
    unseen = sorted(set(raw["validation"].unique(label_column)) - set(label_values), key=str)
    if unseen:
        raise RecipeError(
            f"{validation_file}: label(s) {', '.join(map(repr, unseen[:5]))} in column {label_column!r} never occur "
            f"in {train_file} (known: {', '.join(map(repr, label_values[:10]))}); fix the labels or add such examples "
            "to the training file"
        )
    return raw, text_column, text_pair_column, label_column, label_values, "macro_f1"


def tokenize_datasets(raw, tokenizer, text_column, text_pair_column, label_column, label_ids, max_length):
    """Tokenise without padding (the collator pads each batch to its longest example) and map labels to ids.

    `label_ids` maps the values of a file's label column to ids; None when they already are ids (GLUE).
    """

    def tokenize(batch):
        texts = [t if t is not None else "" for t in batch[text_column]]
        pairs = [t if t is not None else "" for t in batch[text_pair_column]] if text_pair_column else None
        encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        labels = batch[label_column]
        encoded["labels"] = labels if label_ids is None else [label_ids[value] for value in labels]
        return encoded

    return raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="tokenize")


# ---------------------------------------------------------------------------------------------------------- model
@contextmanager
def explain_load_failure(name: str):
    """A model or tokenizer that cannot be loaded becomes one line saying what to give instead."""
    try:
        yield
    except (OSError, ValueError) as err:
        reason = first_line(err)
        raise RecipeError(
            f"could not load --model {name!r} ({reason}); give a local directory with config.json, the weights and the "
            "tokenizer files, or a Hugging Face Hub name while online (it is cached under ~/.cache/huggingface)"
        ) from None


def load_tokenizer(name: str):
    with explain_load_failure(name):
        return AutoTokenizer.from_pretrained(name)


def load_model(name: str, label_names: list[str], task: str | None):
    """Sequence-classification model from a Hub name or a local directory, with the label mapping."""
    with explain_load_failure(name):
        config = AutoConfig.from_pretrained(
            name, num_labels=len(label_names), finetuning_task=task,
            id2label=dict(enumerate(label_names)), label2id={label: i for i, label in enumerate(label_names)},
        )
        # A checkpoint already fine-tuned on another label set gets a fresh classifier of the right size.
        return AutoModelForSequenceClassification.from_pretrained(
            name, config=config, ignore_mismatched_sizes=True, dtype=torch.float32
        )


def always_build_attention_masks() -> None:
    """Have transformers build every padded batch's attention mask without first reading the padding on the host.

    Its stock sdpa and eager mask builders first ask `padding_mask.all()`, to drop the mask of a batch without padding;
    on a GPU that answer is a read from the device in every forward pass, which stalls the queue. With a padding mask
    given, the mask is now always built: a padded batch gets the very mask it got before, an unpadded one an all-true
    mask (the same attention). Models that build their masks another way (DeBERTa, say) keep doing so.
    """
    def without_padding_check(stock):
        def build_mask(*args, attention_mask=None, **kwargs):
            if attention_mask is not None:
                kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
            return stock(*args, attention_mask=attention_mask, **kwargs)

        build_mask.stock = stock
        return build_mask

    for name in ("sdpa", "eager"):
        stock = AttentionMaskInterface()[name]
        if not hasattr(stock, "stock"):  # not already replaced in this process
            AttentionMaskInterface.register(name, without_padding_check(stock))


@torch.no_grad()
def evaluate(model, loader, accelerator, extra_metric: str | None, num_labels: int) -> dict:
    """Accuracy (and F1 or Matthews correlation) over the whole validation set, each example counted once."""
    model.eval()
    predictions, references, loss_sum = [], [], 0.0
    for batch in loader:
        logits = model(**batch).logits
        losses = torch.nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="none")
        # gather_for_metrics drops the examples the sampler repeated to give every process an equal share.
        preds, labels, losses = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["labels"], losses))
        predictions.append(preds.cpu())
        references.append(labels.cpu())
        loss_sum += losses.sum().item()
    model.train()
    preds, labels = torch.cat(predictions), torch.cat(references)
    result = {"eval_accuracy": (preds == labels).float().mean().item(), "eval_loss": loss_sum / len(labels),
              "eval_samples": len(labels)}
    if extra_metric == "matthews_correlation":  # CoLA
        result["eval_matthews_correlation"] = binary_matthews_corrcoef(preds, labels).item()
    elif extra_metric == "binary_f1":  # MRPC, QQP: F1 of the positive class, as GLUE reports it
        result["eval_f1"] = binary_f1_score(preds, labels).item()
    elif extra_metric == "macro_f1":  # your own files: the mean F1 over classes, whichever label is listed first
        result["eval_f1"] = multiclass_f1_score(preds, labels, num_classes=num_labels, average="macro").item()
    return result


# -------------------------------------------------------------------------------------------------------- predict
def read_texts(source, text_column: str, text_pair_column: str | None) -> list[tuple[str, str | None]]:
    """Texts to classify: a .txt file (one per line), a .csv/.tsv/.json/.jsonl file (its text column), or the text itself."""
    items = source if isinstance(source, (list, tuple)) else [source]
    texts = []
    for item in map(str, items):
        path = Path(item).expanduser()
        if path.suffix.lower() in FILE_FORMATS and path.is_file():
            data = load_file(str(path), "predict", cache_dir=None, flag="--predict")
            for column in filter(None, (text_column, text_pair_column)):
                if column not in data.column_names:
                    raise RecipeError(f"{path} has no column {column!r} to classify; its columns are "
                                      f"{', '.join(data.column_names)} (set --text_column)")
            pairs = data[text_pair_column] if text_pair_column else [None] * len(data)
            texts += list(zip(data[text_column], pairs))
        elif path.suffix.lower() == ".txt" and path.is_file():
            texts += [(line, None) for line in path.read_text().splitlines() if line.strip()]
        else:
            texts.append((item, None))
    return texts


def check_fine_tuned(model_dir: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        raise RecipeError(f"--model {model_dir} is not a fine-tuned model directory (no config.json); train first "
                          "or point --model at the output_dir of a finished run")


def check_labels(model_dir: str, label_names: list[str]) -> None:
    """--eval_only: the data's labels, in id order, must be the ones the model was fine-tuned on."""
    trained = [str(name) for _, name in sorted(AutoConfig.from_pretrained(model_dir).id2label.items())]
    if trained != label_names:
        raise RecipeError(f"--model {model_dir} was fine-tuned on the labels {trained[:10]} and the data has "
                          f"{label_names[:10]}; evaluate it with the data flags of its training run")


@torch.no_grad()  # inference only: no graph kept for a backward pass
def predict_texts(model_dir: str, source, text_column: str, text_pair_column: str | None, max_length: int, batch_size: int):
    """Classify texts with a fine-tuned model and print one JSON line per text: text, label, score."""
    check_fine_tuned(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(device).eval()
    texts = read_texts(source, text_column, text_pair_column)
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        firsts = [t for t, _ in chunk]
        seconds = [p for _, p in chunk] if text_pair_column else None
        inputs = tokenizer(firsts, seconds, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        probabilities = model(**inputs.to(device)).logits.float().softmax(dim=-1)
        scores, ids = probabilities.max(dim=-1)
        for (text, pair), label_id, score in zip(chunk, ids.tolist(), scores.tolist()):
            row = {"text": text, **({"text_pair": pair} if pair is not None else {}),
                   "label": model.config.id2label[label_id], "score": round(score, 4)}
            print(json.dumps(row, ensure_ascii=False))


# ----------------------------------------------------------------------------------------------------------- main
def main(
    task: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str = "label",
    model: str | None = None,
    max_length: int = 128,
    batch_size: int = 16,
    epochs: int = 3,
    max_steps: int | None = None,
    early_stopping_patience: int = 0,
    lr: float = 5e-5,
    weight_decay: float = 0.01,
    warmup_ratio: float = 0.1,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float = 1.0,
    mixed_precision: str | None = None,
    gradient_checkpointing: bool = False,
    num_workers: int | None = None,
    log_every: int = 10,
    output_dir: str = "outputs/text",
    checkpoint_every: int = 500,
    keep_checkpoints: int = 2,
    resume: str | None = None,
    skip_nonfinite_steps: bool = False,
    dist_timeout: int = 600,
    cache_dir: str | None = None,
    tracker: str = "swanlab",
    swanlab_mode: str | None = None,
    project: str = "accelerate-recipes",
    run_name: str | None = None,
    seed: int = 42,
    predict: str | list[str] | None = None,
    eval_only: bool = False,
):
    """Fine-tune a sequence-classification model on a GLUE task or your own CSV/JSON files, or classify texts.

    Args:
        task: GLUE task through the `datasets` library: cola, sst2, mrpc, qqp, mnli, qnli, rte or wnli (default sst2
            when no --train_file is given). Downloaded on first use, then read from the cache.
        train_file: your training data instead of a GLUE task: .csv, .tsv, .json or .jsonl (one object per line).
        validation_file: your validation data, same columns as --train_file.
        text_column: column holding the text (files only).
        text_pair_column: column holding the second text of a pair (files only; e.g. premise / hypothesis).
        label_column: column holding the label (files only); strings or integers. Labels get ids in sorted order,
            and the id -> label mapping is saved in the model's config.json.
        model: Hugging Face Hub name or local directory of any checkpoint AutoModelForSequenceClassification loads;
            default google-bert/bert-base-cased for training, and --output_dir for --predict.
        max_length: longest tokenised input; longer texts are truncated. Batches are padded to their longest example.
        batch_size: GLOBAL batch per optimizer step, all processes together; each process loads
            batch_size / (num_processes x gradient_accumulation_steps). Default 16 and --lr 5e-5: from the BERT
            paper's fine-tuning grid (batch 16 or 32, lr 5e-5, 3e-5 or 2e-5) the end that also learns on a small
            file: 480 labelled reviews, 3 epochs, MiniLM reached 0.60 accuracy at batch 32 / lr 2e-5 and 0.76 here.
        epochs: passes over the training set (ignored when --max_steps is set).
        max_steps: stop after this many optimizer steps.
        early_stopping_patience: stop after this many evaluations in a row whose eval accuracy is not higher than the
            best so far, saving the last model and results.json as at a normal end; 0 (the default): train to the end.
            Either way the model of the best evaluation is kept in output_dir/model_best (use it with --predict
            --model output_dir/model_best).
        lr: peak learning rate of AdamW, reached after warmup, then linear decay to zero (default 5e-5, as
            transformers' examples; small models on small data sets often want 1e-4).
        weight_decay: AdamW weight decay on weight matrices (not on biases and LayerNorm).
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        gradient_accumulation_steps: micro-batches summed before each optimizer step.
        max_grad_norm: clip the gradients' global L2 norm to this before each update, the same under DDP, FSDP and
            DeepSpeed (default 1.0, as transformers' Trainer); 0: no clipping.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        gradient_checkpointing: recompute activations in the backward pass: less memory, about a third slower.
        num_workers: DataLoader workers per process; default: up to 2 (collating token ids is cheap); 0 on the CPU.
        log_every: log loss and throughput every N optimizer steps. Only log and checkpoint steps read values back
            from the GPU, and a stop signal or a non-finite loss is acted on at the next of them.
        output_dir: where the fine-tuned model and tokenizer (save_pretrained), model_best/ (the same for the best
            evaluation), results.json, metrics.jsonl, checkpoints/ and offline SwanLab logs go.
        checkpoint_every: save a checkpoint (accelerator.save_state) every N optimizer steps, besides the one at the
            end of each epoch; 0: at epoch ends only.
        keep_checkpoints: how many of the newest checkpoints to keep in output_dir/checkpoints.
        resume: auto (continue from the newest complete checkpoint in output_dir/checkpoints, or start fresh when
            there is none) or the path of a checkpoint; default: start fresh, refused when checkpoints exist.
        skip_nonfinite_steps: drop the update of a step whose loss is NaN or infinite and go on, instead of stopping.
        dist_timeout: seconds a process waits for the others (at start-up, in a checkpoint save, in any collective)
            before it stops with an error; the launcher's own wait for other nodes is --rdzv_conf timeout=N.
        cache_dir: cache of the `datasets` library (downloads and tokenised data); default ~/.cache/huggingface/datasets.
        tracker: swanlab, none, or another tracker Accelerate knows (tensorboard, wandb, mlflow, ...).
        swanlab_mode: cloud, offline, local or disabled; default $SWANLAB_MODE, else cloud when logged in, else offline.
        project: tracker project name.
        run_name: tracker run name; default text-<task>, or text-<folder>-<name> of the training file.
        seed: seed for the classifier head, data order and dropout.
        predict: classify instead of training: a text, a .txt file (one text per line) or a .csv/.tsv/.json/.jsonl
            file (its --text_column), with the model in --model (default --output_dir). Prints JSON lines. The text
            is taken as typed, commas included; give --predict several times to classify several texts or files.
        eval_only: evaluate the fine-tuned model in --model (default --output_dir; e.g. output_dir/model_best) on the
            validation split of the same data flags as its training run (--task, or --train_file, whose labels give
            the ids, and --validation_file) and write results.json to --output_dir, without training. Runs on any
            number of processes.
    """
    if predict is not None:
        if eval_only:
            raise RecipeError("give --predict or --eval_only, not both")
        return predict_texts(model or output_dir, predict, text_column, text_pair_column, max_length, batch_size)
    started = time.perf_counter()
    output = Path(output_dir)
    model = model or (output_dir if eval_only else DEFAULT_MODEL)
    if eval_only:
        check_fine_tuned(model)
    if task is None and train_file is None:
        task = "sst2"
    if task is not None and (train_file or validation_file):
        raise RecipeError("give either --task (a GLUE task) or --train_file/--validation_file, not both")
    dataset_name = task or f"{Path(train_file).resolve().parent.name}-{Path(train_file).stem}"  # e.g. reviews-train

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    # (--eval_only logs to no tracker: its results are in results.json and the output)
    tracking = setup_tracker("none" if eval_only else tracker, output, run_name or f"text-{dataset_name}", swanlab_mode)
    with explain_startup_failure(dist_timeout):
        accelerator = Accelerator(
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            log_with=tracking.log_with or None,
            project_dir=str(output),
            # The shuffle order then depends on the seed and epoch only, not on the number of processes.
            # non_blocking: batches are copied from pinned memory while the GPU still works on the previous step.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
            # Our schedule counts optimizer steps; we step it ourselves once per optimizer step.
            step_scheduler_with_optimizer=False,
            # How long a process waits for the others, at start-up and in every collective, before it stops.
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout))],
        )
    per_process = check_launch(accelerator, batch_size, gradient_accumulation_steps, skip_nonfinite_steps, max_grad_norm)
    world, machines = accelerator.num_processes, num_machines(accelerator.num_processes)
    set_seed(seed)
    if not accelerator.is_local_main_process:  # one copy of the library logs and progress bars per node
        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=keep_checkpoints)
    resume_from = None if eval_only else checkpoints.resolve(resume)  # None: a fresh start

    # ---- data and tokenizer: the local main process of each node downloads and tokenises first (into the cache),
    # the others then read the cached result
    with accelerator.local_main_process_first():
        raw, text_column, text_pair_column, label_column, label_values, extra_metric = load_text_data(
            task, train_file, validation_file, text_column, text_pair_column, label_column, cache_dir
        )
        label_names = [str(value) for value in label_values]
        tokenizer = load_tokenizer(model)
        label_ids = None if task else {value: i for i, value in enumerate(label_values)}
        tokenized = tokenize_datasets(raw, tokenizer, text_column, text_pair_column, label_column, label_ids, max_length)
    # All processes load the weights together: under DeepSpeed ZeRO-3 from_pretrained shards them while reading, which
    # takes every process (the Hub's file locks keep a first download by several processes safe).
    if eval_only:
        check_labels(model, label_names)
    net = load_model(model, label_names, task)
    # Padding to a multiple of 8 lets fp16/bf16 matrix multiplies use tensor cores.
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    num_workers = cpu_threads_and_workers(accelerator, num_workers, limit=2)  # on the CPU also torch's threads
    loader_args = dict(collate_fn=collator, num_workers=num_workers, pin_memory=torch.cuda.is_available())
    # The shuffle gets a generator of its own: starting an epoch then draws nothing from the global RNG (dropout's),
    # which checkpoints restore.
    train_loader = DataLoader(tokenized["train"], batch_size=per_process, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(seed), **loader_args)
    eval_loader = DataLoader(tokenized["validation"], batch_size=per_process * gradient_accumulation_steps, **loader_args)

    if eval_only:
        # ---- evaluation only: the saved model on the whole validation split, each example counted once
        net, eval_loader = accelerator.prepare(net, eval_loader)
        evaluation = evaluate(net, eval_loader, accelerator, extra_metric, len(label_names))
        scores = ", ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in evaluation.items() if k != "eval_samples")
        accelerator.print(f"{scores} on {evaluation['eval_samples']} validation examples")
        results = dict(recipe="text_classification", dataset=dataset_name, model=model, eval_only=True,
                       world_size=world, num_machines=machines, mixed_precision=accelerator.mixed_precision,
                       global_batch_size=batch_size, validation_size=len(raw["validation"]), steps=0,
                       wall_seconds=time.perf_counter() - started, **evaluation,
                       **run_facts(accelerator, StepMeter(accelerator.device), samples_seen=0))
        accelerator.wait_for_everyone()
        accelerator.end_training()
        if accelerator.is_main_process:
            print(f"{write_results(output, results).name} saved in {output}")
        return

    # ---- model and optimizer
    always_build_attention_masks()  # no host read of the padding in each forward pass
    if gradient_checkpointing:
        net.gradient_checkpointing_enable()
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]  # biases and LayerNorm weights
    trainable = sum(p.numel() for p in decay + no_decay)  # its fp32 gradients are what DDP all-reduces
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )

    # ---- learning-rate schedule over optimizer steps: linear warmup, then linear decay to zero
    batches_per_process = len(train_loader) // world  # prepare() deals the batches out to the processes
    if batches_per_process == 0:
        raise RecipeError(
            f"the training set ({len(raw['train'])} examples) is smaller than one global batch ({batch_size}); "
            "lower --batch_size or use more data"
        )
    steps_per_epoch = math.ceil(batches_per_process / gradient_accumulation_steps)
    total_steps = max_steps if max_steps else epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(warmup_ratio * total_steps)
    if not max_steps and total_steps < MIN_USEFUL_STEPS:  # a first fine-tune on a small file: too few updates to learn
        accelerator.print(
            f"warning: {total_steps} optimizer steps in all ({len(raw['train'])} examples / global batch {batch_size} "
            f"x {epochs} epochs); a fine-tune this short often stays near chance. Aim for {MIN_USEFUL_STEPS}+ steps: "
            "raise --epochs or lower --batch_size, or raise --lr (1e-4 suits small models and small data sets)"
        )

    setup_fsdp(accelerator, net)  # FSDP: one shard unit per transformer block of this model
    # ---- prepare: wrap for DDP / FSDP / DeepSpeed, shard the loaders across processes, move to the device.
    # Model and optimizer in one call: DeepSpeed builds its engine from both.
    net, optimizer, train_loader, eval_loader = accelerator.prepare(net, optimizer, train_loader, eval_loader)
    # Linear warmup, then linear decay to zero, on the prepared optimizer (DeepSpeed ZeRO-3 regroups its parameters).
    scheduler = accelerator.prepare(get_scheduler("linear", optimizer, warmup_steps, total_steps))

    config = dict(
        recipe="text_classification", dataset=dataset_name, model=model, world_size=world, num_machines=machines,
        mixed_precision=accelerator.mixed_precision, global_batch_size=batch_size, per_process_batch_size=per_process,
        gradient_accumulation_steps=gradient_accumulation_steps, trainable_parameters=trainable, lr=lr,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, warmup_steps=warmup_steps, total_steps=total_steps,
        epochs=num_epochs,
        max_length=max_length, num_labels=len(label_names), seed=seed, train_size=len(raw["train"]),
        validation_size=len(raw["validation"]), distributed_type=accelerator.distributed_type.value,
    )

    # ---- resume: weights, optimizer, schedule, RNG states and the run's position, all from save_state's folder
    state = RunState(accelerator.device)
    accelerator.register_for_checkpointing(state)  # save_state / load_state carry the position with the weights
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(project, config=config, init_kwargs=tracking.init_kwargs)
    log = TrainLog(accelerator, state, checkpoints, resumed_from=resume_from, total_steps=total_steps,
                   steps_per_epoch=steps_per_epoch, batches_per_epoch=len(train_loader), global_batch_size=batch_size,
                   log_every=log_every, checkpoint_every=checkpoint_every, skip_nonfinite=skip_nonfinite_steps,
                   metric_for_best_model="eval_accuracy", early_stopping_patience=early_stopping_patience)
    guard = log.guard  # stops on a non-finite loss or a stop signal, agreed by every process

    def save_checkpoint() -> None:
        """Everything a resumed run needs to continue as if it had never stopped; after a stop signal, exit. Collective."""
        with checkpoints.saving(state.step, dict(state.position(), config=config)) as path:
            accelerator.save_state(path)
        guard.stop_if_signalled(state.step, checkpoints.last_saved)  # exits with PREEMPTED_EXIT_CODE

    def save_model(folder: Path) -> None:
        """The model as from_pretrained and --predict read it, with the tokenizer. Collective: every process calls it."""
        # gathers the full weights under FSDP / DeepSpeed ZeRO-3; model_to_save: their own names, compiled or not
        state_dict = accelerator.get_state_dict(model_to_save(accelerator, net))
        accelerator.unwrap_model(net, keep_torch_compile=False).save_pretrained(
            folder, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(folder)

    # ---- training loop
    while state.epoch < num_epochs and not log.finished:
        log.start_epoch()
        net.train()
        train_loader.set_epoch(state.epoch)  # the shuffle of each epoch depends on the seed and the epoch only
        # Skip what the interrupted run had trained on in this epoch.
        batches = accelerator.skip_first_batches(train_loader, state.batches_done) if state.batches_done else train_loader
        for batch in batches:
            state.batches_done += 1
            with accelerator.accumulate(net):  # skips the gradient all-reduce on accumulation micro-steps
                loss = net(**batch).loss
                accelerator.backward(loss)
                guard.observe(loss)  # a non-finite loss is noted on the device, read at the next log step
                if accelerator.sync_gradients:
                    if max_grad_norm:
                        accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                    if not guard.skip_update(state.step + 1):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.add(loss.detach(), samples=batch["labels"].shape[0])  # summed on the device, read at log steps only
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            if log.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                save_checkpoint()
            if log.finished:
                break

        # ---- evaluation once per epoch, on the full validation set
        guard.check(state.step)  # nothing non-finite since the last log step, before evaluating and saving
        state.last_eval = evaluate(net, eval_loader, accelerator, extra_metric, len(label_names))
        seconds = log.epoch_done(state.last_eval)  # also judges it: log.improved, and early stopping's count
        if log.improved:  # the best accuracy so far: the model goes to output_dir/model_best, beside the last one
            with log.saving_best() as folder:
                save_model(folder)
        if accelerator.is_main_process:
            plot_results(log.metrics.path, output / "results.png")  # kept up to date every epoch
        scores = ", ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in state.last_eval.items() if k != "eval_samples")
        accelerator.print(f"epoch {state.epoch + 1}/{num_epochs}: {scores}, {seconds:.1f} s, "
                          f"{log.meter.samples_per_second:.1f} samples/s")
        state.epoch, state.batches_done = state.epoch + 1, 0
        save_checkpoint()
    log.close()

    # ---- save the model, tokenizer and the run's results
    accelerator.wait_for_everyone()
    save_model(output)
    results = dict(config, **log.results(started), transformers_version=transformers.__version__)
    accelerator.wait_for_everyone()  # all ranks tear the process group down together, none while others still talk
    accelerator.end_training()
    if accelerator.is_main_process:
        path = write_results(output, results)
        print_summary(results, ["dataset", "model", "world_size", "num_machines", "mixed_precision", "global_batch_size",
                                "steps", "epochs", "eval_accuracy", "eval_f1", "eval_matthews_correlation",
                                "best_metric", "best_epoch",
                                "train_samples_per_second", "median_step_seconds", "peak_memory_mb", "wall_seconds"],
                      title="text classification: summary")
        print(f"model, tokenizer, model_best/ (epoch {results['best_epoch']}) and {path.name} saved in {output}; "
              f"classify with: python {os.path.relpath(__file__)} --predict 'some text' --model {output} "
              f"(or --model {output / 'model_best'})")
        where = tracking.where()
        if where:
            print(where)


if __name__ == "__main__":
    run(main)
