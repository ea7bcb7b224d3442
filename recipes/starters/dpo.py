#!/usr/bin/env python
"""Preference tuning (DPO) of a chat model with Hugging Face Accelerate, LoRA or full, in one file
to copy and edit.

    python dpo.py --train_file pairs.jsonl --validation_file dev.jsonl
    accelerate launch --num_processes 2 dpo.py ... --lora_r 16   # 2 GPUs, or --config_file FILE
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 dpo.py ...   # gloo

The sigmoid DPO loss, averaged over every pair of the global batch (1 GPU and N GPUs train alike),
falls as the model prefers the chosen answers more than its reference, the model this run starts
from. recipes/dpo.py adds IPO, hinge, FSDP, --chat, ...
"""

import copy
import json
import os
import shutil
from pathlib import Path

import fire
import peft
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def read_pairs(path: str, tokenizer, max_length: int) -> list[dict]:
    """Each pair's token ids: the prompt rendered with the generation prompt, each answer the text
    its whole conversation adds after it (end of turn included); pairs over max_length dropped."""
    text = Path(path).read_text()
    lines = [line for line in text.splitlines() if line]
    rows = json.loads(text) if path.endswith(".json") else [json.loads(line) for line in lines]
    pairs = []
    for number, row in enumerate(rows, 1):
        if not row.get("chosen") or not row.get("rejected"):
            raise SystemExit(
                f"error: {path} row {number} is not a pair; give it a chosen and a rejected answer"
            )
        if row.get("prompt") is None:  # two whole conversations: their shared start is the prompt
            shared, chosen, rejected = 0, row["chosen"], row["rejected"]
            most = min(len(chosen), len(rejected)) - 1  # each answer keeps at least its last turn
            while shared < most and chosen[shared] == rejected[shared]:
                shared += 1
            row = dict(prompt=chosen[:shared], chosen=chosen[shared:], rejected=rejected[shared:])
        for key, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
            if isinstance(row[key], str):  # text: one turn
                row[key] = [{"role": role, "content": row[key]}]
        prompt_text = tokenizer.apply_chat_template(
            row["prompt"], tokenize=False, add_generation_prompt=True
        )
        ids = {"prompt": tokenizer(prompt_text, add_special_tokens=False)["input_ids"]}
        for name in ("chosen", "rejected"):
            whole = tokenizer.apply_chat_template(row["prompt"] + row[name], tokenize=False)
            if not whole.startswith(prompt_text):
                raise SystemExit(
                    f"error: {path} row {number}: the template rewrites the prompt; "
                    "use another model"
                )
            ids[name] = tokenizer(whole[len(prompt_text) :], add_special_tokens=False)["input_ids"]
        if len(ids["prompt"]) + max(len(ids["chosen"]), len(ids["rejected"])) <= max_length:
            pairs.append(ids)
    return pairs


def collate(pairs: list[dict]) -> tuple[dict, torch.Tensor]:
    """(the model's inputs, answer_mask): the chosen rows, then the rejected, each prompt + answer
    left-padded (id 0, masked out) to end at the last column; answer_mask marks the answers."""
    rows = [(pair["prompt"], pair[name]) for name in ("chosen", "rejected") for pair in pairs]
    width, answer_width = max(len(p) + len(a) for p, a in rows), max(len(a) for _, a in rows)
    padding = [width - len(prompt) - len(answer) for prompt, answer in rows]
    input_ids = torch.tensor([[0] * pad + p + a for pad, (p, a) in zip(padding, rows)])
    attention_mask = torch.tensor([[0] * pad + [1] * (width - pad) for pad in padding])
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # each row's, padding skipped
    answer_mask = torch.tensor([[0] * (answer_width - len(a)) + [1] * len(a) for _, a in rows])
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return inputs, answer_mask


def answer_logprobs(model, inputs: dict, answer_mask: torch.Tensor) -> torch.Tensor:
    """Each row's answer log-probability, summed over its tokens."""
    width = answer_mask.shape[1]
    # logits only where they predict an answer token
    logits = model(**inputs, logits_to_keep=width + 1).logits[:, :-1].float()
    answers = inputs["input_ids"][:, -width:, None]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, answers).squeeze(-1)
    return (logprobs * answer_mask).sum(dim=1)


def dpo_loss(accelerator, net, reference, inputs: dict, answer_mask: torch.Tensor, beta: float):
    """Per pair: the sigmoid DPO loss and the reward margin, beta x how much more than the reference
    the model prefers the chosen answer in log-probability; reference None: the model, LoRA off."""
    if reference is None:
        reference, as_reference = net, accelerator.unwrap_model(net).disable_adapter()
    else:
        as_reference = accelerator.autocast()
    with torch.no_grad(), as_reference:
        reference_rows = answer_logprobs(reference, inputs, answer_mask)
    # rows: chosen answers first
    policy, pairs = answer_logprobs(net, inputs, answer_mask), len(answer_mask) // 2
    margin = (policy[:pairs] - reference_rows[:pairs]) - (policy[pairs:] - reference_rows[pairs:])
    return -torch.nn.functional.logsigmoid(beta * margin), beta * margin.detach()


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
    beta: float = 0.1,
    batch_size: int = 16,
    gradient_accumulation_steps: int = 1,
    epochs: int = 1,
    max_steps: int | None = None,
    lr: float | None = None,
    max_grad_norm: float = 1.0,
    seed: int = 42,
    log_every: int = 5,
    checkpoint_every: int = 100,
    resume: str | None = None,
    tracker: str = "swanlab",
    output_dir: str = "outputs/dpo-starter",
):
    """Tune a chat model on preference pairs with DPO: a LoRA adapter (--lora_r) or the whole model.

    Args:
        train_file: training pairs, .jsonl or .json of {"prompt", "chosen", "rejected"} (text or
            messages) or of two whole conversations {"chosen", "rejected"}.
        validation_file: held-out pairs, the same format: loss, reward margin, accuracy each epoch.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        max_length: longest prompt plus answer in tokens; longer pairs are dropped.
        lora_r: LoRA rank (alpha 2 x rank, no dropout) on every linear layer; 0: the whole model.
        beta: how far the model may move from the reference: the scale of the margin (0.1 is usual).
        batch_size: GLOBAL pairs per optimizer step, split evenly over processes and micro-batches.
        gradient_accumulation_steps: micro-batches whose gradients add up to one optimizer step.
        epochs: passes over the training pairs.
        max_steps: stop after this many optimizer steps instead (the last epoch cut short).
        lr: AdamW's peak lr (10% warm-up, linear decay to 0); default 5e-5 with LoRA, 1e-6 in full.
        max_grad_norm: clip the gradients' global norm to this before each update.
        seed: seed for LoRA's initial weights and the data order.
        log_every: print and log the training loss every N steps (and at the first and last).
        checkpoint_every: save_state every N steps (0: only at epoch ends); keeps the newest 2.
        resume: a checkpoint (output_dir/checkpoints/step_N) to go on from, at the batch after it.
        tracker: swanlab (offline without a login), tensorboard, wandb, ... or none.
        output_dir: where the adapter (or model), its tokenizer, checkpoints and offline logs go.
    """
    if not train_file or not validation_file:
        raise SystemExit(
            "error: no data; give --train_file and --validation_file, "
            ".jsonl or .json preference pairs"
        )

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    # Steps counted by micro-batches, not the loader's end: an epoch's short remainder is left out.
    accumulation = gradient_accumulation_steps
    plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
    accelerator = Accelerator(  # precision: the accelerate config's, or launch's --mixed_precision
        gradient_accumulation_plugin=plugin,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # shuffle: seed+epoch
        step_scheduler_with_optimizer=False,  # stepped below once per step, not once per process
    )
    # cuDNN's sdpa, torch 2.11's default on Hopper, reportedly gives NaN gradients on left padding
    if accelerator.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    world = accelerator.num_processes
    splits = world * accumulation  # the global batch: processes x micro-batches x per-process batch
    if batch_size % splits:
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {splits}")
    per_process = batch_size // splits
    layout = f"{world} processes x {accumulation} micro-batches x {per_process}"
    accelerator.print(f"global batch {batch_size} = {layout}")
    set_seed(seed)
    lr = lr or (5e-5 if lora_r else 1e-6)

    # ---- data: pairs rendered with the model's chat template; the shuffle draws no global RNG
    tokenizer = AutoTokenizer.from_pretrained(model)
    train_pairs = read_pairs(str(train_file), tokenizer, max_length)
    validation_pairs = read_pairs(str(validation_file), tokenizer, max_length)
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_loader = DataLoader(train_pairs, batch_size=per_process, collate_fn=collate, **shuffle)
    eval_loader = DataLoader(validation_pairs, batch_size=per_process, collate_fn=collate)

    # ---- model: whole, or frozen (bf16 under bf16) with a LoRA adapter, its init seeded above
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, use_cache=False)
    # the reference, the model this run starts from: LoRA's base (adapter off), or a frozen copy
    if lora_r:  # no dropout: the model starts as the same function as its reference (margin 0)
        lora = dict(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules="all-linear")
        net = peft.get_peft_model(net, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
        reference = None
    else:
        reference = copy.deepcopy(net).eval().requires_grad_(False).to(accelerator.device)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)

    # ---- prepare: DDP wrapping, each process its shard of every batch, the device
    net, optimizer, train_loader, eval_loader = accelerator.prepare(
        net, optimizer, train_loader, eval_loader
    )
    steps_per_epoch = len(train_loader) // accumulation  # whole optimizer steps only
    if steps_per_epoch == 0:
        raise SystemExit(
            f"error: fewer training pairs than one --batch_size {batch_size}; lower it"
        )
    total_steps = max_steps or epochs * steps_per_epoch
    num_epochs = -(-total_steps // steps_per_epoch)  # the last one cut short by --max_steps
    schedule = get_linear_schedule_with_warmup(optimizer, round(0.1 * total_steps), total_steps)
    scheduler = accelerator.prepare(schedule)

    step = int(Path(resume).name.removeprefix("step_")) if resume else 0  # the folder's name
    if resume:  # weights, optimizer, schedule and RNG states
        accelerator.load_state(resume)
    settings = dict(
        batch_size=batch_size, lr=lr, lora_r=lora_r, beta=beta, total_steps=total_steps, world=world
    )
    init_kwargs = tracker_init_kwargs(tracker, output_dir, "dpo-starter")
    accelerator.init_trackers("accelerate-recipes", settings, init_kwargs)

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop; the loss summed on the device until logged
    running_loss, steps_since_log = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, num_epochs):
        train_loader.set_epoch(epoch)  # this epoch's shuffle: seed + epoch
        done = (step - epoch * steps_per_epoch) * accumulation  # batches a resumed epoch has had
        batches = iter(accelerator.skip_first_batches(train_loader, done) if done else train_loader)
        for micro_batches in zip(*[batches] * accumulation):  # a step's; a short tail dropped
            for inputs, answer_mask in micro_batches:
                with accelerator.accumulate(net):  # all-reduce at the step's last micro-batch only
                    losses, _ = dpo_loss(accelerator, net, reference, inputs, answer_mask, beta)
                    loss = losses.sum() / batch_size  # these pairs' share of the global mean
                    # x processes x micro-batches: undoes DDP's mean and backward's division
                    accelerator.backward(loss * world * accumulation)
                    if accelerator.sync_gradients:  # the step's last micro-batch: clip, update
                        accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                running_loss += loss.detach()
            scheduler.step()
            step, steps_since_log = step + 1, steps_since_log + 1
            if step % log_every == 0 or step in (1, total_steps):
                # the processes' shares summed, averaged over the steps since the last log
                loss_now = accelerator.reduce(running_loss, "sum").item() / steps_since_log
                running_loss, steps_since_log = torch.zeros_like(running_loss), 0
                lr_now = scheduler.get_last_lr()[0]
                accelerator.print(f"step {step}/{total_steps} loss {loss_now:.7f} lr {lr_now:.7e}")
                accelerator.log({"train/loss": loss_now, "train/lr": lr_now}, step=step)
            due = checkpoint_every and step % checkpoint_every == 0 and step % steps_per_epoch
            if due and step < total_steps:
                save_checkpoint()  # epoch ends: below
            if step >= total_steps:
                break

        # ---- evaluation: each pair once (gather_for_metrics drops the sampler's repeats)
        net.eval()
        figures = []
        for inputs, answer_mask in eval_loader:
            with torch.no_grad():
                losses, margins = dpo_loss(accelerator, net, reference, inputs, answer_mask, beta)
            per_pair = torch.stack([losses, margins, (margins > 0).float()], 1)
            figures.append(accelerator.gather_for_metrics(per_pair))
        net.train()
        eval_loss, margin, accuracy = torch.cat(figures).double().mean(dim=0).tolist()
        summary = f"eval_loss {eval_loss:.7f} margin {margin:.7f} accuracy {accuracy:.7f}"
        accelerator.print(f"epoch {epoch + 1} {summary}")
        names = ("eval/loss", "eval/reward_margin", "eval/reward_accuracy")
        accelerator.log(dict(zip(names, (eval_loss, margin, accuracy))), step)
        save_checkpoint()

    # ---- save: the adapter (LoRA) or the model, and the tokenizer, for from_pretrained / peft
    state_dict = accelerator.get_state_dict(net)  # whole on the main process, also where sharded
    if accelerator.is_main_process:
        accelerator.unwrap_model(net).save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
