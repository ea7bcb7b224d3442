#!/usr/bin/env python
"""Fine-tune a transformers model for text classification with Hugging Face Accelerate: 1 GPU, N
GPUs, N nodes, FSDP.

    python recipes/text_classification.py --task sst2   # GLUE SST-2 with bert-base-cased
    python recipes/text_classification.py --train_file train.csv --validation_file dev.csv \\
        --label_column label
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/text_classification.py \\
        --task mrpc
    python recipes/text_classification.py --predict "a gripping, funny film" --model outputs/text

One function per mode: train() reads top to bottom (config -> accelerator -> data -> model ->
optimizer -> prepare -> schedule -> resume -> loop -> eval -> save); --eval_only and --predict live
beside it in text_classification_modes.py, the data and the model in text_classification_data.py;
the flags are TextFlags. `--batch_size` is the GLOBAL batch
(all processes together), so the same flags give the same training on any number of GPUs.

Install: `pip install -e '.[text]'` from a clone of accelerate-recipes (the runtime plus datasets
and torchmetrics).
"""

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from accelerate.utils import set_seed
from text_classification_data import data_loaders, dataset_name, glue_task, load_data, load_model
from text_classification_modes import evaluate_saved_model, predict, scores_line
from torchmetrics.functional.classification import (
    binary_f1_score,
    binary_matthews_corrcoef,
    multiclass_f1_score,
)
from transformers import get_scheduler

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RunState,
    TrainingFlags,
    always_build_attention_masks,
    check_launch_flags,
    clip_norm,
    epoch_batches,
    finish_run,
    keeps_update,
    model_to_save,
    prepare_output_dir,
    print_summary,
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

DEFAULT_MODEL = "google-bert/bert-base-cased"
# below this many optimizer steps a fine-tune is warned that it may not learn
MIN_USEFUL_STEPS = 100


@dataclass
class TextFlags(TrainingFlags):
    """Fine-tune a sequence-classification model on a GLUE task or your own CSV/JSON files, or
    classify texts.

    AdamW's learning rate warms up linearly, then decays linearly to zero. The defaults (global
    batch 16, --lr 5e-5 as in transformers' examples, weight decay 0.01, gradients clipped to norm
    1.0 as in transformers' Trainer) take the end of the BERT paper's fine-tuning grid (batch 16 or
    32, lr 5e-5, 3e-5 or 2e-5) that also learns on a small file: 480 labelled reviews, 3 epochs,
    MiniLM reached 0.60 accuracy at batch 32 / lr 2e-5 and 0.76 with these; small models on small
    data sets often want --lr 1e-4.

    Args:
        task: GLUE task through the `datasets` library: cola, sst2, mrpc, qqp, mnli, qnli, rte or
            wnli (default sst2 when no --train_file is given). Downloaded on first use, then read
            from the cache.
        train_file: your training data instead of a GLUE task: .csv, .tsv, .json or .jsonl (one
            object per line).
        validation_file: your validation data, same columns as --train_file.
        text_column: column holding the text (files only).
        text_pair_column: column holding the second text of a pair (files only; e.g. premise /
            hypothesis).
        label_column: column holding the label (files only); strings or integers. Labels get ids in
            sorted order, and the id -> label mapping is saved in the model's config.json.
        max_length: longest tokenised input; longer texts are truncated. Batches are padded to their
            longest example.
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        gradient_checkpointing: recompute activations in the backward pass: less memory, about a
            third slower.
        cache_dir: cache of the `datasets` library (downloads and tokenised data); default
            ~/.cache/huggingface/datasets.
        model: the model to fine-tune: a Hugging Face Hub name or local directory of any checkpoint
            AutoModelForSequenceClassification loads (default google-bert/bert-base-cased). For
            --eval_only and --predict, the fine-tuned model: the output_dir of a finished run or its
            model_best/ (default --output_dir).
        num_workers: DataLoader workers per process; default: up to 2 (collating token ids is
            cheap); 0 on the CPU.
        seed: seed for the classifier head, data order and dropout.
        eval_only: evaluate the fine-tuned model in --model (default --output_dir; e.g.
            output_dir/model_best) on the validation split of the same data flags as its training
            run (--task, or --train_file, whose labels give the ids, and --validation_file) and
            write results.json to --output_dir, without training. Runs on any number of processes;
            each example is counted once.
        predict: classify instead of training: a text, a .txt file (one text per line) or a
            .csv/.tsv/.json/.jsonl file (its --text_column), with the model in --model (default
            --output_dir). Prints JSON lines. The text is taken as typed, commas included; give
            --predict several times to classify several texts or files.
    """

    task: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    max_length: int = 128
    warmup_ratio: float = 0.1
    gradient_checkpointing: bool = False
    cache_dir: str | None = None
    # The shared flags this task defaults otherwise.
    batch_size: int = 16
    lr: float | None = 5e-5
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    output_dir: str = "outputs/text"


# --------------------------------------------------------------------------------------------- data


def default_run_name(args: TextFlags) -> str:
    return f"text-{dataset_name(args)}"


# -------------------------------------------------------------------------------------------- model


def save_model(accelerator, model, tokenizer, folder) -> None:
    """The model as from_pretrained and --predict read it, with the tokenizer. Collective: every
    process calls it."""
    # gathers the full weights under FSDP / DeepSpeed ZeRO-3; model_to_save: their own names,
    # compiled or not
    state_dict = accelerator.get_state_dict(model_to_save(accelerator, model))
    accelerator.unwrap_model(model, keep_torch_compile=False).save_pretrained(
        folder,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(folder)


@torch.no_grad()
def evaluate(model, loader, accelerator, extra_metric: str | None, num_labels: int) -> dict:
    """Accuracy (and F1 or Matthews correlation) over the whole validation set, each example counted
    once."""
    model.eval()
    predictions, references, loss_sum = [], [], 0.0
    for batch in loader:
        logits = model(**batch).logits
        losses = torch.nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="none")
        # gather_for_metrics drops the examples the sampler
        # repeated to give every process an equal share.
        preds, labels, losses = accelerator.gather_for_metrics(
            (logits.argmax(dim=-1), batch["labels"], losses)
        )
        predictions.append(preds.cpu())
        references.append(labels.cpu())
        loss_sum += losses.sum().item()
    model.train()
    preds, labels = torch.cat(predictions), torch.cat(references)
    result = {
        "eval_accuracy": (preds == labels).float().mean().item(),
        "eval_loss": loss_sum / len(labels),
        "eval_samples": len(labels),
    }
    if extra_metric == "matthews_correlation":  # CoLA
        result["eval_matthews_correlation"] = binary_matthews_corrcoef(preds, labels).item()
    elif extra_metric == "binary_f1":  # MRPC, QQP: F1 of the positive class, as GLUE reports it
        result["eval_f1"] = binary_f1_score(preds, labels).item()
    # your own files: the mean F1 over classes, whichever label is listed first
    elif extra_metric == "macro_f1":
        result["eval_f1"] = multiclass_f1_score(preds, labels, num_classes=num_labels, average="macro").item()
    return result


# ---------------------------------------------------------------------------------------- reporting


def warn_if_too_short(accelerator, args: TextFlags, total_steps: int, train_size: int) -> None:
    """A first fine-tune on a small file: too few updates to learn (not said when --max_steps asks
    for a short run)."""
    if not args.max_steps and total_steps < MIN_USEFUL_STEPS:
        accelerator.print(
            f"warning: {total_steps} optimizer steps in all ({train_size} examples / global batch "
            f"{args.batch_size} x {args.epochs} epochs); a fine-tune this short often stays near "
            f"chance. Aim for {MIN_USEFUL_STEPS}+ steps: raise --epochs or lower --batch_size, or "
            "raise --lr (1e-4 suits small models and small data sets)"
        )


def print_run_summary(results: dict, path: Path, tracking) -> None:
    """After training, on the main process: the summary table, what was saved where, and how to use
    it."""
    output = path.parent
    print_summary(
        results,
        [
            "dataset",
            "model",
            "world_size",
            "num_machines",
            "mixed_precision",
            "global_batch_size",
            "steps",
            "epochs",
            "eval_accuracy",
            "eval_f1",
            "eval_matthews_correlation",
            "best_metric",
            "best_epoch",
            "train_samples_per_second",
            "median_step_seconds",
            "peak_memory_mb",
            "wall_seconds",
        ],
        title="text classification: summary",
    )
    print(
        f"model, tokenizer, model_best/ (epoch {results['best_epoch']}) and {path.name} saved in "
        f"{output}; classify with: python {os.path.relpath(__file__)} --predict 'some text' "
        f"--model {output} (or --model {output / 'model_best'})"
    )
    where = tracking.where()
    if where:
        print(where)


# -------------------------------------------------------------------------------------------- train
def train(args: TextFlags) -> None:
    """Fine-tune --model on the data flags' training split, evaluate it after every epoch, and save
    the last and the best model (with the tokenizer), results.json, metrics.jsonl and results.png in
    --output_dir."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    model_name = args.model or DEFAULT_MODEL
    task = glue_task(args)

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(args.tracker, output, args.run_name or default_run_name(args), args.swanlab_mode)
    accelerator = training_accelerator(args, tracking)
    per_process = check_launch_flags(accelerator, args)
    world = accelerator.num_processes
    set_seed(args.seed)
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data, tokenizer and model
    data = load_data(accelerator, args, task, model_name)
    # All processes load the weights together: under DeepSpeed ZeRO-3 from_pretrained shards them
    # while reading, which takes every process (the Hub's file locks keep a first download by
    # several processes safe).
    model = load_model(model_name, data.label_names, task)
    train_loader, eval_loader = data_loaders(accelerator, args, data, per_process)

    # ---- optimizer: AdamW, weight decay on weight matrices only
    always_build_attention_masks()  # no host read of the padding in each forward pass
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # biases and LayerNorm weights
    # its fp32 gradients are what DDP all-reduces
    trainable = sum(p.numel() for p in decay + no_decay)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )

    # the whole batches each process is dealt an epoch, in optimizer steps
    steps_per_epoch = math.ceil(len(train_loader) // world / args.gradient_accumulation_steps)

    setup_fsdp(accelerator, model)  # FSDP: one shard unit per transformer block of this model
    # ---- prepare: wrap for DDP / FSDP / DeepSpeed, shard the loaders across processes, move to the
    # device. Model and optimizer in one call: DeepSpeed builds its engine from both.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    # ---- the run's length in optimizer steps
    training_set = f"{len(data.raw['train'])} examples"
    length = run_length(args, steps_per_epoch, len(train_loader), training_set)
    warmup_steps = round(args.warmup_ratio * length.total_steps)
    warn_if_too_short(accelerator, args, length.total_steps, len(data.raw["train"]))
    # ---- schedule: linear warmup, then linear decay to zero, over optimizer steps, on the prepared
    # optimizer (DeepSpeed ZeRO-3 regroups its parameters).
    schedule = get_scheduler("linear", optimizer, warmup_steps, length.total_steps)
    scheduler = accelerator.prepare(schedule)

    config = run_config(
        "text_classification",
        args,
        accelerator,
        dataset=dataset_name(args),
        model=model_name,
        per_process_batch_size=per_process,
        trainable_parameters=trainable,
        warmup_steps=warmup_steps,
        total_steps=length.total_steps,
        epochs=length.epochs,
        num_labels=len(data.label_names),
        train_size=len(data.raw["train"]),
        validation_size=len(data.raw["validation"]),
        transformers_version=transformers.__version__,
    )

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    state = RunState(accelerator.device)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    best = BestModel(accelerator, state, output, "eval_accuracy", patience=args.early_stopping_patience)
    progress = training_progress(accelerator, args, state, best, resume_from, length)
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    # ---- training loop
    while state.epoch < length.epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        batches = epoch_batches(accelerator, train_loader, state.epoch, state.batches_done)
        for batch in progress.timed(batches):  # each batch's wait timed
            state.batches_done += 1
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                # a non-finite loss is noted on the device, read at the next log step
                guard.observe(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # summed on the device, read at log steps only
            state.add(loss.detach(), samples=batch["labels"].shape[0])
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
        state.last_eval = evaluate(model, eval_loader, accelerator, data.extra_metric, len(data.label_names))
        seconds = progress.epoch_done(state.last_eval)
        if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
            with best.saving() as folder:
                save_model(accelerator, model, data.tokenizer, folder)
        if accelerator.is_main_process and args.plots:
            # kept up to date every epoch
            plot_results(progress.metrics.path, output / "results.png")
        accelerator.print(
            f"epoch {state.epoch + 1}/{length.epochs}: {scores_line(state.last_eval)}, "
            f"{seconds:.1f} s, {progress.meter.samples_per_second:.1f} samples/s"
        )
        state.epoch, state.batches_done = state.epoch + 1, 0
        with saving_checkpoint(checkpoints, progress, config) as folder:
            accelerator.save_state(folder)
    progress.close()

    # ---- save the model and the run's results
    accelerator.wait_for_everyone()
    # with the tokenizer, as from_pretrained reads it
    save_model(accelerator, model, data.tokenizer, output)
    results = dict(config, **progress.results(started))
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print_run_summary(results, path, tracking)


# --------------------------------------------------------------------------------------------- main
def main(args: TextFlags) -> None:
    """Train, or run the one other mode a flag names: a function per mode."""
    modes = {"predict": predict, "eval_only": lambda flags: evaluate_saved_model(flags, evaluate)}
    return run_mode(args, modes, otherwise=train)


if __name__ == "__main__":
    run(main)
