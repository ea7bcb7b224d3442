#!/usr/bin/env python
"""Fine-tune a text classifier with Hugging Face Accelerate: one file to copy, the same on 1 GPU, N
GPUs and N nodes.

    python text_classification.py --train_file train.csv --validation_file dev.csv  # 1 process (or GLUE sst2)
    accelerate launch --num_processes 2 text_classification.py --task mrpc   # 2 GPUs; or --config_file
    # no GPU: 2 gloo processes
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 text_classification.py

It reads top to bottom (config -> data -> model -> prepare -> loop -> eval -> save); `--batch_size`
is the GLOBAL batch, so the same flags train alike on any number of processes. Needs torch,
accelerate, transformers, datasets, fire (swanlab to track). The full recipe,
recipes/text_classification.py, trains exactly like this file and adds launch checks, a NaN and stop
guard, `--resume auto`, early stopping, --eval_only, --predict, F1, FSDP, results.json.
"""

import math
import os
import shutil
from pathlib import Path

import datasets
import fire
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed, tqdm
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)


def tracker_init_kwargs(tracker: str, output_dir: str, run_name: str) -> dict:
    """init_trackers' init_kwargs. SwanLab: $SWANLAB_MODE, else online if logged in, else offline."""
    logged_in = os.environ.get("SWANLAB_API_KEY") or (Path.home() / ".swanlab" / ".netrc").is_file()
    mode = os.environ.get("SWANLAB_MODE") or ("online" if logged_in else "offline")
    log_dir = os.environ.get("SWANLAB_LOG_DIR") or str(Path(output_dir, "swanlog").resolve())
    return {"swanlab": {"mode": mode, "name": run_name, "log_dir": log_dir}} if tracker == "swanlab" else {}


def main(
    model: str = "google-bert/bert-base-cased",
    task: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str = "label",
    max_length: int = 128,
    batch_size: int = 16,
    gradient_accumulation_steps: int = 1,
    epochs: int = 3,
    max_steps: int | None = None,
    lr: float = 5e-5,
    weight_decay: float = 0.01,
    warmup_ratio: float = 0.1,
    max_grad_norm: float = 1.0,
    mixed_precision: str | None = None,
    seed: int = 42,
    num_workers: int | None = None,
    output_dir: str = "outputs/text_starter",
    log_every: int = 10,
    checkpoint_every: int = 500,
    resume: str | None = None,
    tracker: str = "swanlab",
    project: str = "accelerate-recipes",
):
    """Fine-tune a sequence-classification model on a GLUE task or on your own CSV / JSONL files.

    Args:
        model: Hugging Face Hub name or local folder of any checkpoint
            AutoModelForSequenceClassification loads.
        task: GLUE task (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli) through `datasets`; sst2
            without --train_file.
        train_file: your training data instead: .csv, .json or .jsonl (one object per line), text
            and label columns.
        validation_file: your validation data, same columns as --train_file.
        text_column: column holding the text (files only).
        text_pair_column: column holding the second text of a pair (files only), e.g. a hypothesis.
        label_column: column holding the label (files only): strings or numbers, given ids in sorted
            order.
        max_length: longest tokenised input; longer texts are cut. Each batch is padded to its
            longest example.
        batch_size: GLOBAL batch per optimizer step; each process loads batch_size / (processes x
            accumulation steps).
        gradient_accumulation_steps: micro-batches whose gradients are summed before each optimizer
            step.
        epochs: passes over the training set (the last one cut short by --max_steps).
        max_steps: stop after this many optimizer steps instead.
        lr: peak learning rate of AdamW, reached after the warm-up, then decayed linearly to zero.
        weight_decay: AdamW weight decay of the weight matrices (not of biases and LayerNorm
            weights).
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly
            from zero.
        max_grad_norm: clip the gradients' global L2 norm to this before each update; 0 turns
            clipping off.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        seed: seed of the data order, dropout and any freshly initialised classifier head.
        num_workers: DataLoader workers per process; default 2 on a GPU, 0 on the CPU (they would
            take its cores).
        output_dir: where the model, the tokenizer, checkpoints/ and offline SwanLab logs go.
        log_every: print and log the training loss every N optimizer steps (and at the first and
            last step).
        checkpoint_every: save a checkpoint (accelerator.save_state) every N steps, besides each
            epoch's end; 0: off.
        resume: a checkpoint folder (output_dir/checkpoints/step_N) to continue from, at the batch
            after it.
        tracker: swanlab (offline without a login), none, or another tracker Accelerate knows
            (tensorboard, ...).
        project: tracker project name.
    """
    # ---- config: Accelerator, global -> per-process batch
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # shuffle: seed+epoch
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, else once per process
    )
    world, accumulation = accelerator.num_processes, gradient_accumulation_steps
    if batch_size % (world * accumulation):  # the global batch: processes x micro-batches x per-process batch
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {world * accumulation}")
    per_process = batch_size // (world * accumulation)
    accelerator.print(
        f"global batch {batch_size} = {world} process(es) x {accumulation} micro-batch(es) x {per_process} "
        "examples"
    )
    set_seed(seed)  # the same on every process: same classifier head, and dropout drawn alike

    # ---- data: GLUE or your files, tokenised without padding, labels as ids
    # one process per machine fills the datasets cache, then the rest
    with accelerator.local_main_process_first():
        if train_file is None:
            task = task or "sst2"
            glue = datasets.load_dataset("nyu-mll/glue", task)
            validation = "validation_matched" if task == "mnli" else "validation"
            raw = datasets.DatasetDict(train=glue["train"], validation=glue[validation])
            # GLUE's columns: the text (and a pair's second text), then label and idx; its labels
            # already are ids
            columns = [column for column in raw["train"].column_names if column not in ("label", "idx")]
            text_column, text_pair_column = columns[0], (columns[1] if len(columns) > 1 else None)
            label_column, label_names, label_ids = "label", raw["train"].features["label"].names, None
        else:
            # .json / .jsonl: an object a line
            kind = "csv" if Path(train_file).suffix.lower() == ".csv" else "json"
            raw = datasets.load_dataset(kind, data_files={"train": train_file, "validation": validation_file})
            label_values = sorted(raw["train"].unique(label_column))
            label_names, label_ids = (
                [str(value) for value in label_values],
                {v: i for i, v in enumerate(label_values)},
            )
        tokenizer = AutoTokenizer.from_pretrained(model)

        def tokenize(batch):
            texts = [text or "" for text in batch[text_column]]
            pairs = [text or "" for text in batch[text_pair_column]] if text_pair_column else None
            encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
            labels = batch[label_column]  # ids for GLUE; your files' values mapped to ids
            encoded["labels"] = labels if label_ids is None else [label_ids[value] for value in labels]
            return encoded

        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)

    # ---- model: the label names travel in config.json
    id2label = dict(enumerate(label_names))
    label2id = {name: i for i, name in id2label.items()}
    options = dict(num_labels=len(label_names), id2label=id2label, label2id=label2id, dtype=torch.float32)
    # A checkpoint fine-tuned on another label set gets a fresh classifier head of the right size.
    net = AutoModelForSequenceClassification.from_pretrained(model, ignore_mismatched_sizes=True, **options)

    # Dynamic padding: each batch to its longest example (a
    # multiple of 8 feeds tensor cores under bf16/fp16).
    collator = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=None if accelerator.mixed_precision == "no" else 8
    )
    workers = num_workers if num_workers is not None else (2 if torch.cuda.is_available() else 0)
    loader_args = dict(collate_fn=collator, num_workers=workers, pin_memory=torch.cuda.is_available())
    # The shuffle's own generator: an epoch's start then
    # draws nothing from the global RNG (dropout's).
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_loader = DataLoader(tokenized["train"], batch_size=per_process, **shuffle, **loader_args)
    eval_loader = DataLoader(tokenized["validation"], batch_size=per_process * accumulation, **loader_args)

    # AdamW with weight decay on weight matrices only (not on biases and LayerNorm weights).
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr)

    # ---- prepare: DDP wrapping, loaders sharded across processes, everything on the device
    net, optimizer, train_loader, eval_loader = accelerator.prepare(net, optimizer, train_loader, eval_loader)
    steps_per_epoch = math.ceil(len(train_loader) / accumulation)  # len: this process's batches
    if steps_per_epoch == 0:
        raise SystemExit(f"error: fewer training examples than one --batch_size {batch_size}; lower it")
    total_steps = max_steps or epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    # Linear warm-up, then linear decay to zero, counted in optimizer steps.
    scheduler = accelerator.prepare(
        get_scheduler("linear", optimizer, round(warmup_ratio * total_steps), total_steps)
    )

    step = 0
    if resume:  # weights, optimizer, schedule and RNG states; the step is the folder's name
        accelerator.load_state(resume)
        step = int(Path(resume).name.removeprefix("step_"))
    settings = dict(
        model=model, task=task, train_file=train_file, batch_size=batch_size, lr=lr, epochs=num_epochs
    )
    accelerator.init_trackers(project, settings, tracker_init_kwargs(tracker, output_dir, "text-starter"))

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop
    progress = tqdm(total=total_steps, initial=step, desc="train")  # shown by the main process only
    # summed on the device until logged
    running_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, num_epochs):
        net.train()
        train_loader.set_epoch(epoch)  # this epoch's shuffle: seed + epoch
        done = (step - epoch * steps_per_epoch) * accumulation  # batches a resumed epoch already had
        for batch in accelerator.skip_first_batches(train_loader, done) if done else train_loader:
            with accelerator.accumulate(net):  # no all-reduce on micro-steps between updates
                loss = net(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if max_grad_norm:
                        accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            running_loss += loss.detach()
            micro_batches += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            progress.update(1)
            if step % log_every == 0 or step in (1, total_steps):
                # since the last log
                mean_loss = accelerator.reduce(running_loss / micro_batches, "mean").item()
                lr_now = scheduler.get_last_lr()[0]
                accelerator.print(f"step {step}/{total_steps} loss {mean_loss:.7f} lr {lr_now:.4g}")
                accelerator.log({"train/loss": mean_loss, "train/lr": lr_now}, step=step)
                running_loss, micro_batches = torch.zeros_like(running_loss), 0
            if (
                checkpoint_every
                and step % checkpoint_every == 0
                and step % steps_per_epoch
                and step < total_steps
            ):
                save_checkpoint()  # epoch ends: below
            if step >= total_steps:
                break

        # ---- evaluation: every validation example counted once, on any number of processes
        net.eval()
        correct = seen = 0
        for batch in eval_loader:
            with torch.no_grad():
                predictions = net(**batch).logits.argmax(dim=-1)
            # gather_for_metrics drops the examples the sampler
            # repeated to give every process an equal share.
            predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == labels).sum().item()
            seen += len(labels)
        accelerator.print(f"epoch {epoch + 1}/{num_epochs}: accuracy {correct / seen:.4f} on {seen} examples")
        accelerator.log({"eval/accuracy": correct / seen}, step=step)
        save_checkpoint()
    progress.close()

    # ---- save: the model as from_pretrained reads it, with its tokenizer
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(net)  # the model without its DDP wrapper
    unwrapped.save_pretrained(
        output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.print(f"model and tokenizer saved in {output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
