#!/usr/bin/env python
"""Fine-tune a text classifier with Hugging Face Accelerate: one file to copy, the same on 1 GPU, N
GPUs and N nodes.

    python text_classification.py --train_file train.csv --validation_file dev.csv   # 1 process
    accelerate launch --num_processes 2 text_classification.py --task mrpc   # 2 GPUs, GLUE's mrpc
    # no GPU: 2 gloo processes; a launch also takes --config_file your_config.yaml
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
    """init_trackers' kwargs. SwanLab: $SWANLAB_MODE, else online if logged in, else offline."""
    if tracker != "swanlab":
        return {}
    netrc = Path.home() / ".swanlab" / ".netrc"  # written by `swanlab login`
    logged_in = os.environ.get("SWANLAB_API_KEY") or netrc.is_file()
    mode = os.environ.get("SWANLAB_MODE") or ("online" if logged_in else "offline")
    log_dir = os.environ.get("SWANLAB_LOG_DIR") or str(Path(output_dir, "swanlog").resolve())
    return {"swanlab": {"mode": mode, "name": run_name, "log_dir": log_dir}}


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
        model: Hub name or local folder of any checkpoint AutoModelForSequenceClassification loads.
        task: GLUE task (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli); sst2 without --train_file.
        train_file: your own training data: .csv, .json or .jsonl (an object a line), text and label
            columns.
        validation_file: your validation data, same columns as --train_file.
        text_column: column holding the text (files only).
        text_pair_column: column holding the second text of a pair (files only), e.g. a hypothesis.
        label_column: column of the labels (files only): strings or numbers, ids in sorted order.
        max_length: longest tokenised input; longer texts are cut, each batch padded to its longest.
        batch_size: GLOBAL batch per optimizer step, split over processes and accumulation steps.
        gradient_accumulation_steps: micro-batches whose gradients are summed per optimizer step.
        epochs: passes over the training set (the last one cut short by --max_steps).
        max_steps: stop after this many optimizer steps instead.
        lr: peak learning rate of AdamW, reached after the warm-up, then decayed linearly to zero.
        weight_decay: AdamW weight decay of the weight matrices (not of biases, LayerNorm weights).
        warmup_ratio: fraction of the optimizer steps the learning rate warms up over, from zero.
        max_grad_norm: clip the gradients' global L2 norm to this before each update; 0: off.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        seed: seed of the data order, dropout and any freshly initialised classifier head.
        num_workers: DataLoader workers per process; default 2 on a GPU, 0 on the CPU (its cores).
        output_dir: where the model, the tokenizer, checkpoints/ and offline SwanLab logs go.
        log_every: print and log the training loss every N optimizer steps (and the first and last).
        checkpoint_every: save_state every N steps (0: never) and at epoch ends; the newest 2 kept.
        resume: a checkpoint (output_dir/checkpoints/step_N) to go on from, at the batch after it.
        tracker: swanlab (offline without a login), none, or one Accelerate knows, e.g. tensorboard.
        project: tracker project name.
    """
    # ---- config: Accelerator, global -> per-process batch
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # shuffle: seed+epoch
        step_scheduler_with_optimizer=False,  # stepped below once per update, not once per process
    )
    world, accumulation = accelerator.num_processes, gradient_accumulation_steps
    shares = world * accumulation  # global batch = processes x micro-batches x per-process batch
    if batch_size % shares:
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {shares}")
    per_process = batch_size // shares
    split = f"{world} process(es) x {accumulation} micro-batch(es) x {per_process} examples"
    accelerator.print(f"global batch {batch_size} = {split}")
    set_seed(seed)  # the same on every process: same classifier head, and dropout drawn alike

    # ---- data: GLUE or your files, tokenised without padding, labels as ids
    with accelerator.local_main_process_first():  # one process per node fills the cache first
        if train_file is None:
            task = task or "sst2"
            glue = datasets.load_dataset("nyu-mll/glue", task)
            validation = "validation_matched" if task == "mnli" else "validation"
            raw = datasets.DatasetDict(train=glue["train"], validation=glue[validation])
            # GLUE's columns: the text (and a pair's second text), then label (already ids) and idx
            columns = [name for name in raw["train"].column_names if name not in ("label", "idx")]
            text_column, text_pair_column = columns[0], (columns[1] if len(columns) > 1 else None)
            label_column, label_ids = "label", None
            label_names = raw["train"].features["label"].names
        else:
            kind = "csv" if Path(train_file).suffix.lower() == ".csv" else "json"  # .json, .jsonl
            files = {"train": train_file, "validation": validation_file}
            raw = datasets.load_dataset(kind, data_files=files)
            label_values = sorted(raw["train"].unique(label_column))
            label_names = [str(value) for value in label_values]
            label_ids = {value: i for i, value in enumerate(label_values)}
        tokenizer = AutoTokenizer.from_pretrained(model)

        def tokenize(batch):
            texts = [text or "" for text in batch[text_column]]
            pairs = [text or "" for text in batch[text_pair_column]] if text_pair_column else None
            encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
            labels = batch[label_column]  # ids for GLUE; your files' values mapped to ids
            if label_ids is not None:
                labels = [label_ids[value] for value in labels]
            encoded["labels"] = labels
            return encoded

        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)

    # ---- model: the label names travel in config.json
    id2label = dict(enumerate(label_names))
    label2id = {name: i for i, name in id2label.items()}
    options = dict(
        num_labels=len(label_names), id2label=id2label, label2id=label2id, dtype=torch.float32
    )
    # A checkpoint fine-tuned on another label set gets a fresh classifier head of the right size.
    net = AutoModelForSequenceClassification.from_pretrained(
        model, ignore_mismatched_sizes=True, **options
    )

    # Dynamic padding: each batch to its longest example (a multiple of 8 feeds tensor cores).
    pad_to = None if accelerator.mixed_precision == "no" else 8
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to)
    has_gpu = torch.cuda.is_available()
    workers = num_workers if num_workers is not None else (2 if has_gpu else 0)
    loader_args = dict(collate_fn=collator, num_workers=workers, pin_memory=has_gpu)
    # The shuffle's own generator: an epoch's start draws nothing from the global (dropout's) RNG.
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_set, eval_set = tokenized["train"], tokenized["validation"]
    train_loader = DataLoader(train_set, batch_size=per_process, **shuffle, **loader_args)
    eval_loader = DataLoader(eval_set, batch_size=per_process * accumulation, **loader_args)

    # AdamW with weight decay on weight matrices only (not on biases and LayerNorm weights).
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)

    # ---- prepare: DDP wrapping, loaders sharded across processes, everything on the device
    net, optimizer, train_loader, eval_loader = accelerator.prepare(
        net, optimizer, train_loader, eval_loader
    )
    steps_per_epoch = math.ceil(len(train_loader) / accumulation)  # len: this process's batches
    if steps_per_epoch == 0:
        cause = f"fewer training examples than one --batch_size {batch_size}"
        raise SystemExit(f"error: {cause}; lower it")
    total_steps = max_steps or epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(warmup_ratio * total_steps)
    # Linear warm-up, then linear decay to zero, counted in optimizer steps.
    scheduler = accelerator.prepare(get_scheduler("linear", optimizer, warmup_steps, total_steps))

    step = 0
    if resume:  # weights, optimizer, schedule and RNG states; the step is the folder's name
        accelerator.load_state(resume)
        step = int(Path(resume).name.removeprefix("step_"))
    settings = dict(model=model, task=task, train_file=train_file, batch_size=batch_size)
    settings.update(lr=lr, epochs=num_epochs)
    init_kwargs = tracker_init_kwargs(tracker, output_dir, "text-starter")
    accelerator.init_trackers(project, settings, init_kwargs)

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop; the loss is summed on the device until logged
    progress = tqdm(total=total_steps, initial=step, desc="train")  # shown by the main process only
    running_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, num_epochs):
        net.train()
        train_loader.set_epoch(epoch)  # this epoch's shuffle: seed + epoch
        done = (step - epoch * steps_per_epoch) * accumulation  # batches a resumed epoch has had
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
            ends_epoch = step % steps_per_epoch == 0 or step >= total_steps  # then saved below
            if checkpoint_every and step % checkpoint_every == 0 and not ends_epoch:
                save_checkpoint()
            if step >= total_steps:
                break

        # ---- evaluation: every validation example counted once, on any number of processes
        net.eval()
        correct = seen = 0
        for batch in eval_loader:
            with torch.no_grad():
                predictions = net(**batch).logits.argmax(dim=-1)
            # gather_for_metrics drops the examples the sampler repeated to even out the shares
            predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == labels).sum().item()
            seen += len(labels)
        report = f"epoch {epoch + 1}/{num_epochs}: accuracy {correct / seen:.4f} on {seen} examples"
        accelerator.print(report)
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
