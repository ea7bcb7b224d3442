#!/usr/bin/env python
"""Chat fine-tuning (SFT) of a causal LM with Hugging Face Accelerate, LoRA or full, in one file to copy and edit.

    python sft.py --model Qwen/Qwen2.5-0.5B-Instruct --train_file chats.jsonl --lora_r 16
    accelerate launch --config_file accelerate_configs/2gpu.yaml sft.py --train_file chats.jsonl --lora_r 16
    make sft-2gpu STARTER=1 ARGS="--train_file chats.jsonl --lora_r 16"     # the same, from a clone of the project
    accelerate launch --config_file accelerate_configs/2node.yaml --machine_rank 0 --main_process_ip 10.0.0.1 sft.py ...
        # 2 nodes: this on the main node (10.0.0.1), and --machine_rank 1 with the same address on the other
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \
        --num_cpu_threads_per_process 1 sft.py ...                           # 2 processes on a CPU, over gloo

Data: .jsonl (one per line) or .json (a list) of {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}.
The loss covers the assistant turns only, each with the token that closes it, and a step's loss is the mean over every
answer token of its global batch (all processes, all accumulation micro-steps), so 1 GPU and N GPUs train alike.

The full recipe, recipes/sft.py (with sft_data.py beside it and the accelerate_recipes library), adds: ShareGPT,
Alpaca and prompt/completion files and Hub datasets (sft_data.py), packing and gradient checkpointing, .gguf models,
FSDP / DeepSpeed set-up, generated answers with exact match, model_best/ and early stopping, --eval_only, --predict,
--chat and --merge, the memory plan (sft_plan.py), launch checks (e.g. a CPU --multi_gpu launch that would train each
process alone), a NaN and stop-signal guard, checkpoints that resume mid-epoch with their running figures,
results.json, metrics.jsonl and results.png (accelerate_recipes/), and a SwanLab reachability check.
"""

import copy
import math
import os
import shutil
from pathlib import Path

import datasets
import fire
import peft
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed, tqdm
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, get_linear_schedule_with_warmup

IGNORE = -100  # the label the loss skips


# ------------------------------------------------------------------------------------------- data: the answer mask
def turn_end(tokenizer) -> str:
    """What the template writes right after an assistant's content ("<|im_end|>", "<|eot_id|>"): a target too, as it
    teaches the model to stop."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "S9q"}], tokenize=False
    )
    return text[text.index("S9q") + 3 :].rstrip()


def template_gaps(tokenizer, messages) -> list[int]:
    """Characters of the template's own text (headers, a default system prompt) before each message's content, seen by
    rendering placeholders, so that the search for a content skips them; 0s where that fails."""
    holders = [f"\ue000{i}\ue001" for i in range(len(messages))]  # characters no chat holds
    try:
        skeleton = tokenizer.apply_chat_template(
            [dict(m, content=h) for m, h in zip(messages, holders)], tokenize=False
        )
        starts = [skeleton.index(holder) for holder in holders]  # ValueError: the template drops a message
    except Exception:  # also templates that raise on these contents
        return [0] * len(messages)
    gaps = [start - end for start, end in zip(starts, [0] + [s + len(h) for s, h in zip(starts, holders)])]
    return gaps if min(gaps) >= 0 else [0] * len(messages)


def tokenize(example, tokenizer, max_length: int, end_of_turn: str) -> dict:
    """The conversation rendered once by the chat template, its ids, and labels: the ids of the tokens that carry
    characters of an assistant's content or of the turn end right after it, -100 elsewhere (cut at max_length)."""
    messages = example["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    is_target, cursor = bytearray(len(text)), 0
    for message, gap in zip(messages, template_gaps(tokenizer, messages)):
        content = message["content"].strip()  # many templates strip contents
        at = text.find(content, cursor + gap)
        at = at if at >= 0 else text.find(content, cursor)  # the template writes this content its own way
        if at < 0:
            raise ValueError(f"the chat template rewrites the message {content[:40]!r}; use one that keeps contents")
        cursor = end = at + len(content)
        if message["role"] == "assistant":
            end += len(end_of_turn) if end_of_turn and text.startswith(end_of_turn, end) else 0
            is_target[at:end] = b"\x01" * (end - at)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        token if stop > start and any(is_target[start:stop]) else IGNORE
        for token, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])
    ]
    return {"input_ids": encoding["input_ids"][:max_length], "labels": labels[:max_length]}


@torch.no_grad()
def evaluate(model, loader, accelerator) -> float:
    """Loss per answer token over the whole validation split, each conversation counted once on any world size."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"][:, 1:]  # token t predicts token t + 1
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
        # gather_for_metrics drops the conversations the sampler repeated to give each process an equal share
        sums, counts = accelerator.gather_for_metrics((losses.sum(dim=1), (labels != IGNORE).sum(dim=1)))
        loss_sum, tokens = loss_sum + sums.double().sum().item(), tokens + counts.sum().item()
    model.train()
    return loss_sum / max(tokens, 1)


def main(
    train_file: str | None = None,
    validation_file: str | None = None,
    validation_size: float = 0.1,
    model: str = "Qwen/Qwen2.5-0.5B-Instruct",
    max_length: int = 1024,
    lora_r: int = 0,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.05,
    batch_size: int = 16,
    gradient_accumulation_steps: int = 1,
    epochs: int = 3,
    max_steps: int | None = None,
    lr: float | None = None,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.03,
    max_grad_norm: float = 1.0,
    mixed_precision: str | None = None,
    seed: int = 42,
    log_every: int = 10,
    checkpoint_every: int = 500,
    resume: str | None = None,
    tracker: str = "swanlab",
    output_dir: str = "outputs/sft-starter",
):
    """Fine-tune a chat model on conversations: a LoRA adapter (--lora_r) or the whole model.

    Args:
        train_file: training conversations, .jsonl or .json, rows {"messages": [{"role", "content"}, ...]}.
        validation_file: validation conversations in the same format; default: --validation_size of the training data.
        validation_size: fraction of the training conversations held out (drawn with --seed) without a validation file.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        max_length: longest conversation in tokens; longer ones are cut, and those left without an answer dropped.
        lora_r: rank of a LoRA adapter on every linear layer (8-64 are usual); 0: fine-tune the whole model.
        lora_alpha: LoRA scale numerator (updates are scaled by alpha / r); default 2 x --lora_r.
        lora_dropout: dropout on the LoRA branch's input.
        batch_size: GLOBAL batch of conversations per optimizer step; each process loads
            batch_size / (processes x gradient_accumulation_steps).
        gradient_accumulation_steps: micro-batches whose gradients add up to one optimizer step.
        epochs: passes over the training data (ignored with --max_steps).
        max_steps: stop after this many optimizer steps.
        lr: peak learning rate of AdamW; default 2e-4 with LoRA, 2e-5 for a full fine-tune.
        weight_decay: AdamW weight decay on weight matrices (not on biases and norm weights).
        warmup_ratio: fraction of the steps the learning rate warms up linearly over, before it decays linearly to 0.
        max_grad_norm: clip the gradients' global norm to this; 0: no clipping.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config says.
        seed: seed for LoRA's initial weights, the data order and dropout.
        log_every: print and log the training loss every N optimizer steps (and at the first and last).
        checkpoint_every: save a checkpoint (accelerator.save_state) every N steps and at each epoch end, or with 0
            at epoch ends only; the 2 newest are kept in output_dir/checkpoints.
        resume: a checkpoint folder (output_dir/checkpoints/step_N) to continue from.
        tracker: swanlab (offline without a login: upload later with `swanlab sync`), tensorboard, wandb, ... or none.
        output_dir: where the adapter (or model), its tokenizer, checkpoints and offline tracker logs go.
    """
    if not train_file:
        raise SystemExit("error: give --train_file, a .jsonl or .json file of conversations")

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    if tracker == "swanlab" and not os.environ.get("SWANLAB_MODE"):  # never ask for a login, never block without one
        logged_in = os.environ.get("SWANLAB_API_KEY") or (Path.home() / ".swanlab" / ".netrc").is_file()
        os.environ["SWANLAB_MODE"] = "online" if logged_in else "offline"
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        # Steps counted by micro-batches, not at the loader's end: an epoch's remainder short of a step is left out.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_with_dataloader=False
        ),
        log_with=None if tracker == "none" else tracker,
        # the shuffle depends on the seed and the epoch only, not on the number of processes
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,  # else a prepared schedule steps once per process
    )
    world, accumulation = accelerator.num_processes, gradient_accumulation_steps
    if batch_size % (world * accumulation):
        raise SystemExit(
            f"error: --batch_size {batch_size} does not split into {world} process(es) x {accumulation} "
            f"accumulation step(s); give a multiple of {world * accumulation}"
        )
    per_process = batch_size // (world * accumulation)
    accelerator.print(
        f"global batch {batch_size} = {world} process(es) x {accumulation} micro-batch(es) x {per_process}"
    )
    set_seed(seed)
    lr = lr or (2e-4 if lora_r else 2e-5)

    # ---- data: conversations -> token ids and answer-only labels
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # padding is masked out; any id does
    files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
    # One process per node reads and tokenises into the datasets cache first; the others then read that cache.
    with accelerator.local_main_process_first():
        raw = datasets.load_dataset("json", data_files=files)
        if not validation_file:
            raw = raw["train"].train_test_split(test_size=validation_size, seed=seed)
            raw = datasets.DatasetDict(train=raw["train"], validation=raw["test"])
        args = dict(tokenizer=tokenizer, max_length=max_length, end_of_turn=turn_end(tokenizer))
        tokenized = raw.map(tokenize, fn_kwargs=args, remove_columns=raw["train"].column_names)
        tokenized = tokenized.filter(lambda labels: any(x != IGNORE for x in labels), input_columns="labels")

    # ---- model: the whole of it, or frozen with a LoRA adapter (set_seed above makes LoRA's init reproducible)
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32  # a bf16 frozen base
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    net.config.use_cache = False
    if lora_r:
        alpha = lora_alpha or 2 * lora_r
        config = peft.LoraConfig(
            task_type="CAUSAL_LM", r=lora_r, lora_alpha=alpha, lora_dropout=lora_dropout, target_modules="all-linear"
        )
        net = peft.get_peft_model(net, config)

    # Each batch padded on the right (positions count from the left) to its longest conversation, labels with -100.
    right_padding = copy.copy(tokenizer)
    right_padding.padding_side = "right"
    multiple = 8 if accelerator.mixed_precision != "no" else None  # tensor cores like multiples of 8
    collate = DataCollatorForSeq2Seq(right_padding, label_pad_token_id=IGNORE, pad_to_multiple_of=multiple)
    # The shuffle's own generator: an epoch's start then draws nothing from the global RNG (dropout's).
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_loader = DataLoader(tokenized["train"], batch_size=per_process, collate_fn=collate, **shuffle)
    eval_loader = DataLoader(tokenized["validation"], batch_size=per_process * accumulation, collate_fn=collate)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in trainable if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0},  # biases and norm weights
        ],
        lr=lr,
    )

    # ---- prepare: DDP wrapping, each process its shard of every batch, the device
    net, optimizer, train_loader, eval_loader = accelerator.prepare(net, optimizer, train_loader, eval_loader)
    steps_per_epoch = len(train_loader) // accumulation  # whole optimizer steps only
    if steps_per_epoch == 0:
        raise SystemExit(f"error: fewer training conversations than one --batch_size ({batch_size}); lower it")
    total_steps = max_steps or epochs * steps_per_epoch
    scheduler = get_linear_schedule_with_warmup(optimizer, round(warmup_ratio * total_steps), total_steps)
    scheduler = accelerator.prepare(scheduler)  # saved and restored with the checkpoints
    step = 0
    if resume:  # weights, optimizer, schedule and RNG states; the step is in the folder's name
        accelerator.load_state(resume)
        step = int(Path(resume).name.removeprefix("step_"))
    accelerator.init_trackers(
        "accelerate-recipes",
        config=dict(batch_size=batch_size, lr=lr, lora_r=lora_r, epochs=epochs, total_steps=total_steps, world=world),
        init_kwargs={"swanlab": {"log_dir": str(Path(output_dir, "swanlog").resolve())}},
    )

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop
    progress = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
    running_loss, steps_since_log = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, math.ceil(total_steps / steps_per_epoch)):
        train_loader.set_epoch(epoch)  # this epoch's shuffle, the same on every process
        done = (step % steps_per_epoch) * accumulation if epoch == step // steps_per_epoch else 0
        micro_batches = []
        for batch in accelerator.skip_first_batches(train_loader, done) if done else train_loader:
            micro_batches.append(batch)
            if len(micro_batches) < accumulation:
                continue
            # The step's answer tokens, all micro-batches of all processes, counted before its first forward pass.
            answer_tokens = accelerator.reduce(sum((b["labels"][:, 1:] != IGNORE).sum() for b in micro_batches), "sum")
            for micro_batch in micro_batches:
                with accelerator.accumulate(net):  # no gradient all-reduce until the step's last micro-batch
                    # Summed token losses / the step's answer tokens: these add up to the global batch's mean.
                    loss = net(**micro_batch, num_items_in_batch=answer_tokens).loss
                    # x world x accumulation undoes the means DDP and accelerator.backward take
                    accelerator.backward(loss * world * accumulation)
                    if accelerator.sync_gradients:
                        if max_grad_norm:
                            accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                running_loss += loss.detach()
            micro_batches = []
            scheduler.step()  # once per optimizer step
            step, steps_since_log = step + 1, steps_since_log + 1
            progress.update()
            if step % log_every == 0 or step == 1 or step == total_steps:
                # the mean step loss since the last log: this process's parts, summed over processes
                train_loss = accelerator.reduce(running_loss, "sum").item() / steps_since_log
                running_loss, steps_since_log = running_loss.zero_(), 0
                lr_now = scheduler.get_last_lr()[0]
                accelerator.print(f"step {step}/{total_steps} loss {train_loss:.7f} lr {lr_now:.7e}")
                accelerator.log({"train/loss": train_loss, "train/lr": lr_now}, step=step)
            if checkpoint_every and step % checkpoint_every == 0 and step % steps_per_epoch and step < total_steps:
                save_checkpoint()
            if step == total_steps:
                break

        # ---- evaluation once per epoch, then a checkpoint
        eval_loss = evaluate(net, eval_loader, accelerator)
        perplexity = math.exp(min(eval_loss, 50.0))
        accelerator.print(f"epoch {epoch + 1} eval_loss {eval_loss:.7f} perplexity {perplexity:.4f}")
        accelerator.log({"eval/loss": eval_loss, "eval/perplexity": perplexity}, step=step)
        save_checkpoint()
    progress.close()

    # ---- save: the adapter (LoRA) or the model, with the tokenizer, as from_pretrained / peft read them
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(net).save_pretrained(
        output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(net),  # whole on the main process, also where the weights are sharded
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.print(f"{'adapter' if lora_r else 'model'} and tokenizer saved in {output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
