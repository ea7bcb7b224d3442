#!/usr/bin/env python
"""Chat fine-tuning (SFT) with Hugging Face Accelerate, LoRA or full, in one file to copy and edit.

    python sft.py --train_file chats.jsonl --validation_file dev.jsonl --lora_r 16   # 1 process
    accelerate launch --num_processes 2 sft.py ...   # 2 GPUs; or --config_file your_config.yaml
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 sft.py ...  # CPUs: gloo

Data: .jsonl or .json of {"messages": [{"role", "content"}, ...]}. The loss covers the assistant
turns (each with the token that closes it), averaged over every answer token of the global batch, so
1 GPU and N GPUs train alike. The full recipe, recipes/sft.py, trains exactly like this file and
adds other data formats, packing, FSDP / DeepSpeed, generated answers, early stopping, --predict,
--chat, --merge, launch checks, a NaN and stop guard, `--resume auto`, results.json.
"""

import os
import shutil
from pathlib import Path

import datasets
import fire
import peft
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    get_linear_schedule_with_warmup,
)

IGNORE = -100  # the label the loss skips


def turn_end(tokenizer) -> str:
    """What the template writes after an assistant's content ("<|im_end|>"): a target too, it
    teaches to stop."""
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "S9q"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    return text[text.index("S9q") + 3 :].rstrip()


def template_gaps(tokenizer, messages) -> list[int]:
    """Characters the template writes (headers, a default system prompt) before each content: the
    search skips them."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # characters no chat holds
    try:
        marked = [dict(message, content=mark) for message, mark in zip(messages, marks)]
        skeleton = tokenizer.apply_chat_template(marked, tokenize=False)
        starts = [skeleton.index(mark) for mark in marks]  # ValueError: a message left out
    except Exception:  # also templates that raise on these contents
        return [0] * len(messages)
    previous_ends = [0] + [start + len(mark) for start, mark in zip(starts, marks)]
    gaps = [start - end for start, end in zip(starts, previous_ends)]
    return gaps if min(gaps) >= 0 else [0] * len(messages)


def tokenize(example, tokenizer, max_length: int, end_of_turn: str) -> dict:
    """Ids of the rendered chat, and labels: the tokens holding an answer (or its turn end), -100
    elsewhere."""
    messages = example["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    is_target, cursor = bytearray(len(text)), 0
    for message, gap in zip(messages, template_gaps(tokenizer, messages)):
        content = message["content"].strip()  # many templates strip contents
        at = text.find(content, cursor + gap)
        if at < 0:  # the template writes this content its own way
            at = text.find(content, cursor)
        if at < 0:
            cause = f"the chat template rewrites {content[:40]!r}"
            raise SystemExit(f"error: {cause}; use a template that keeps contents")
        cursor = end = at + len(content)
        if message["role"] == "assistant":
            end += len(end_of_turn) if end_of_turn and text.startswith(end_of_turn, end) else 0
            is_target[at:end] = b"\x01" * (end - at)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoding["input_ids"]
    targets = [any(is_target[start:stop]) for start, stop in encoding["offset_mapping"]]
    labels = [token if target else IGNORE for token, target in zip(ids, targets)]
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}


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
    train_file: str | None = None,
    validation_file: str | None = None,
    model: str = "Qwen/Qwen2.5-0.5B-Instruct",
    max_length: int = 1024,
    lora_r: int = 0,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    batch_size: int = 16,
    gradient_accumulation_steps: int = 1,
    epochs: int = 3,
    lr: float | None = None,
    warmup_ratio: float = 0.03,
    seed: int = 42,
    log_every: int = 10,
    checkpoint_every: int = 500,
    resume: str | None = None,
    tracker: str = "swanlab",
    output_dir: str = "outputs/sft-starter",
):
    """Fine-tune a chat model on conversations: a LoRA adapter (--lora_r) or the whole model.

    Args:
        train_file: training chats, .jsonl or .json rows {"messages": [{"role", "content"}, ...]}.
        validation_file: validation conversations in the same format, evaluated after each epoch.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        max_length: longest conversation in tokens; longer ones are cut, and those left without an
            answer dropped.
        lora_r: rank of a LoRA adapter on every linear layer (8-64 are usual); 0: the whole model.
        lora_alpha: LoRA scale numerator (updates are scaled by alpha / r); default 2 x --lora_r.
        lora_dropout: dropout on the LoRA branch's input.
        batch_size: GLOBAL conversations per optimizer step, split over processes and micro-batches.
        gradient_accumulation_steps: micro-batches whose gradients add up to one optimizer step.
        epochs: passes over the training data.
        lr: AdamW's peak learning rate, then a linear decay to 0; default 2e-4 with LoRA, 2e-5 in
            full; clipping at 1.
        warmup_ratio: fraction of the steps the learning rate warms up linearly over.
        seed: seed for LoRA's initial weights, the data order and dropout.
        log_every: print and log the training loss every N optimizer steps (and the first and last).
        checkpoint_every: save_state every N steps (0: never) and at epoch ends; the newest 2 kept.
        resume: a checkpoint (output_dir/checkpoints/step_N) to go on from, at the batch after it.
        tracker: swanlab (offline without a login), none, or one Accelerate knows, e.g. tensorboard.
        output_dir: for the adapter (or model), tokenizer, checkpoints and offline tracker logs.
    """
    if not train_file or not validation_file:
        raise SystemExit(
            "error: no data; give --train_file and --validation_file, .jsonl or .json conversations"
        )

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    accumulation = gradient_accumulation_steps
    # Steps counted by micro-batches, not at the loader's end: an epoch's short tail is left out.
    plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
    accelerator = Accelerator(  # precision: the accelerate config's, or launch's --mixed_precision
        gradient_accumulation_plugin=plugin,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # shuffle: seed+epoch
        step_scheduler_with_optimizer=False,  # stepped below once per update, not once per process
    )
    # cuDNN's sdpa, Hopper's default from torch 2.11, is reported to give NaN gradients where a mask
    # leaves whole query rows masked: off on CUDA for the process, as in recipes/sft.py.
    if accelerator.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    world = accelerator.num_processes
    shares = world * accumulation  # global batch = processes x micro-batches x per-process batch
    if batch_size % shares:
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {shares}")
    per_process = batch_size // shares
    split = f"{world} process(es) x {accumulation} micro-batch(es) x {per_process}"
    accelerator.print(f"global batch {batch_size} = {split}")
    set_seed(seed)
    lr = lr or (2e-4 if lora_r else 2e-5)

    # ---- data: conversations -> token ids and answer-only labels
    # Right padding: positions count from the left. Padding is masked out, so any id pads.
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="right")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    files = {"train": train_file, "validation": validation_file}
    with accelerator.local_main_process_first():  # one process per node fills the cache first
        raw = datasets.load_dataset("json", data_files=files)
        args = dict(tokenizer=tokenizer, max_length=max_length, end_of_turn=turn_end(tokenizer))
        tokenized = raw.map(tokenize, fn_kwargs=args, remove_columns=raw["train"].column_names)
        tokenized = tokenized.filter(
            lambda labels: any(x != IGNORE for x in labels), input_columns="labels"
        )

    # ---- model: whole, or frozen with a LoRA adapter (its init seeded by set_seed above)
    # a bf16 frozen base with LoRA under bf16
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, use_cache=False)
    if lora_r:
        lora = dict(r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=lora_dropout)
        lora_config = peft.LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", **lora)
        net = peft.get_peft_model(net, lora_config)

    # Batches padded to their longest conversation (a multiple of 8 feeds tensor cores), labels -100
    pad_to = 8 if accelerator.mixed_precision != "no" else None
    collate = DataCollatorForSeq2Seq(
        tokenizer, label_pad_token_id=IGNORE, pad_to_multiple_of=pad_to
    )
    # The shuffle's own generator: an epoch's start draws nothing from the global (dropout's) RNG.
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_set, eval_set = tokenized["train"], tokenized["validation"]
    train_loader = DataLoader(train_set, batch_size=per_process, collate_fn=collate, **shuffle)
    eval_loader = DataLoader(eval_set, batch_size=per_process * accumulation, collate_fn=collate)
    trained = [p for p in net.parameters() if p.requires_grad]  # with LoRA, the adapter's only
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)

    # ---- prepare: DDP wrapping, each process its shard of every batch, the device
    net, optimizer, train_loader, eval_loader = accelerator.prepare(
        net, optimizer, train_loader, eval_loader
    )
    steps_per_epoch = len(train_loader) // accumulation  # whole optimizer steps only
    if steps_per_epoch == 0:
        cause = f"fewer training conversations than one --batch_size {batch_size}"
        raise SystemExit(f"error: {cause}; lower it")
    total_steps = epochs * steps_per_epoch
    warmup_steps = round(warmup_ratio * total_steps)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    scheduler = accelerator.prepare(scheduler)  # saved and restored with the checkpoints

    step = 0
    if resume:  # weights, optimizer, schedule and RNG states; the step is the folder's name
        accelerator.load_state(resume)
        step = int(Path(resume).name.removeprefix("step_"))
    settings = dict(batch_size=batch_size, lr=lr, lora_r=lora_r, epochs=epochs)
    settings.update(total_steps=total_steps, world=world)
    init_kwargs = tracker_init_kwargs(tracker, output_dir, "sft-starter")
    accelerator.init_trackers("accelerate-recipes", settings, init_kwargs)

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop; the loss is summed on the device until logged
    running_loss, steps_since_log = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, epochs):
        train_loader.set_epoch(epoch)  # this epoch's shuffle: seed + epoch
        done = (step - epoch * steps_per_epoch) * accumulation  # batches a resumed epoch has had
        batches = iter(accelerator.skip_first_batches(train_loader, done) if done else train_loader)
        for micro_batches in zip(*[batches] * accumulation):  # a step's; a short tail left out
            # the step's answer tokens over all its micro-batches and processes, before any forward
            local_tokens = sum((batch["labels"][:, 1:] != IGNORE).sum() for batch in micro_batches)
            answer_tokens = accelerator.reduce(local_tokens, "sum")
            for micro_batch in micro_batches:
                with accelerator.accumulate(net):  # all-reduce at the step's last micro-batch only
                    # summed token losses / the step's answer tokens: they add up to the global mean
                    loss = net(**micro_batch, num_items_in_batch=answer_tokens).loss
                    # x processes x micro-batches: undoes DDP's and backward's means
                    accelerator.backward(loss * world * accumulation)
                    if accelerator.sync_gradients:  # the step's last micro-batch: clip, update
                        accelerator.clip_grad_norm_(net.parameters(), 1.0)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                running_loss += loss.detach()
            scheduler.step()
            step, steps_since_log = step + 1, steps_since_log + 1
            if step % log_every == 0 or step in (1, total_steps):
                mean_loss = accelerator.reduce(running_loss, "sum").item() / steps_since_log
                running_loss, steps_since_log = torch.zeros_like(running_loss), 0
                lr_now = scheduler.get_last_lr()[0]
                report = f"step {step}/{total_steps} loss {mean_loss:.7f} lr {lr_now:.7e}"
                accelerator.print(report)
                accelerator.log({"train/loss": mean_loss, "train/lr": lr_now}, step=step)
            if checkpoint_every and step % checkpoint_every == 0 and step % steps_per_epoch:
                save_checkpoint()  # epoch ends: below

        # ---- evaluation each epoch: loss per answer token, each conversation once; a checkpoint
        net.eval()
        loss_sum, tokens = 0.0, 0
        for batch in eval_loader:
            inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            with torch.no_grad():
                logits = net(**inputs).logits.float()
            labels = batch["labels"][:, 1:]  # token t predicts token t + 1
            scores = logits[:, :-1].transpose(1, 2)  # the vocabulary second, as cross_entropy wants
            losses = torch.nn.functional.cross_entropy(scores, labels, reduction="none")
            per_row = (losses.sum(dim=1), (labels != IGNORE).sum(dim=1))  # loss sum, answer tokens
            # gather_for_metrics drops the conversations the sampler repeated to even out the shares
            sums, counts = accelerator.gather_for_metrics(per_row)
            loss_sum, tokens = loss_sum + sums.double().sum().item(), tokens + counts.sum().item()
        net.train()
        eval_loss = loss_sum / max(tokens, 1)
        report = f"epoch {epoch + 1} eval_loss {eval_loss:.7f} over {tokens} answer tokens"
        accelerator.print(report)
        accelerator.log({"eval/loss": eval_loss}, step=step)
        save_checkpoint()

    # ---- save: the adapter (LoRA) or the model, and the tokenizer, for from_pretrained / peft
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(net)  # whole on the main process, also where sharded
    if accelerator.is_main_process:
        accelerator.unwrap_model(net).save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)
    accelerator.print(f"{'adapter' if lora_r else 'model'} and tokenizer saved in {output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
