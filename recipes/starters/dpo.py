#!/usr/bin/env python
"""Preference tuning (DPO) of a chat model with Hugging Face Accelerate, LoRA or full, in one file
to copy and edit.

    python dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --train_file pairs.jsonl --validation_file dev.jsonl
    accelerate launch --num_processes 2 dpo.py ... --lora_r 16   # 2 GPUs; or --config_file your_config.yaml
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 dpo.py ...   # no GPU: gloo

Data: .jsonl/.json of {"prompt", "chosen", "rejected"} (text or messages) or two whole
conversations. The sigmoid DPO loss, averaged over every pair of the global batch (1 GPU and N GPUs
train alike), falls as the model prefers the chosen answers more than its reference, the model this
run starts from. recipes/dpo.py adds IPO, hinge, FSDP, --chat, ...
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
    """Token ids of each pair: the prompt rendered with the generation prompt, and each answer as
    the text the template adds after it in the whole conversation (with its end of turn). Pairs over
    max_length are dropped."""
    text = Path(path).read_text()
    rows = (
        json.loads(text)
        if path.endswith(".json")
        else [json.loads(line) for line in text.splitlines() if line]
    )
    pairs = []
    for number, row in enumerate(rows, 1):
        if not row.get("chosen") or not row.get("rejected"):
            raise SystemExit(
                f"error: {path} row {number} is not a pair; give it a chosen and a rejected answer"
            )
        if row.get("prompt") is None:  # two whole conversations: their shared start is the prompt
            shared, chosen, rejected = 0, row["chosen"], row["rejected"]
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            row = {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}
        # text: one turn
        for key, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
            row[key] = [{"role": role, "content": row[key]}] if isinstance(row[key], str) else row[key]
        prompt_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = {"prompt": tokenizer(prompt_text, add_special_tokens=False)["input_ids"]}
        for name in ("chosen", "rejected"):
            whole = tokenizer.apply_chat_template(row["prompt"] + row[name], tokenize=False)
            if not whole.startswith(prompt_text):
                raise SystemExit(
                    f"error: {path} row {number}: the template rewrites the prompt; use another model"
                )
            ids[name] = tokenizer(whole[len(prompt_text) :], add_special_tokens=False)["input_ids"]
        if len(ids["prompt"]) + max(len(ids["chosen"]), len(ids["rejected"])) <= max_length:
            pairs.append(ids)
    return pairs


def collate(pairs: list[dict]) -> tuple[dict, torch.Tensor]:
    """(the model's inputs, answer_mask): chosen rows, then rejected rows, each its prompt and
    answer, left-padded so that every answer ends at the last column (padding: id 0, masked out);
    answer_mask marks the answer tokens."""
    rows = [(pair["prompt"], pair[name]) for name in ("chosen", "rejected") for pair in pairs]
    width, answer_width = max(len(p) + len(a) for p, a in rows), max(len(a) for _, a in rows)
    padding = [width - len(prompt) - len(answer) for prompt, answer in rows]
    input_ids = torch.tensor([[0] * pad + p + a for pad, (p, a) in zip(padding, rows)])
    attention_mask = torch.tensor([[0] * pad + [1] * (width - pad) for pad in padding])
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # each row's own, padding skipped
    answer_mask = torch.tensor([[0] * (answer_width - len(a)) + [1] * len(a) for _, a in rows])
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids), answer_mask


def answer_logprobs(model, inputs: dict, answer_mask: torch.Tensor) -> torch.Tensor:
    """Each row's answer log-probability, summed over its tokens; only the answers' positions get logits."""
    width = answer_mask.shape[1]
    logits = model(**inputs, logits_to_keep=width + 1).logits[:, :-1].float()  # the logits before each answer
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, inputs["input_ids"][:, -width:, None]).squeeze(-1)
    return (logprobs * answer_mask).sum(dim=1)


def dpo_loss(accelerator, net, reference, inputs: dict, answer_mask: torch.Tensor, beta: float) -> tuple:
    """Per pair: the sigmoid DPO loss and the reward margin, beta x how much more the model than the
    reference prefers the chosen answer in log-probability. The reference: a frozen copy, or the
    model with LoRA switched off."""
    as_reference = (
        accelerator.autocast() if reference is not None else accelerator.unwrap_model(net).disable_adapter()
    )
    with torch.no_grad(), as_reference:
        reference_rows = answer_logprobs(net if reference is None else reference, inputs, answer_mask)
    # rows: chosen answers first
    policy, pairs = answer_logprobs(net, inputs, answer_mask), len(answer_mask) // 2
    margin = (policy[:pairs] - reference_rows[:pairs]) - (policy[pairs:] - reference_rows[pairs:])
    return -torch.nn.functional.logsigmoid(beta * margin), beta * margin.detach()


def tracker_init_kwargs(tracker: str, output_dir: str, run_name: str) -> dict:
    """init_trackers' init_kwargs. SwanLab: $SWANLAB_MODE, else online if logged in, else offline."""
    logged_in = os.environ.get("SWANLAB_API_KEY") or (Path.home() / ".swanlab" / ".netrc").is_file()
    mode = os.environ.get("SWANLAB_MODE") or ("online" if logged_in else "offline")
    log_dir = os.environ.get("SWANLAB_LOG_DIR") or str(Path(output_dir, "swanlog").resolve())
    return {"swanlab": {"mode": mode, "name": run_name, "log_dir": log_dir}} if tracker == "swanlab" else {}


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
        train_file: training pairs, .jsonl or .json: {"prompt", "chosen", "rejected"} or two whole
            conversations.
        validation_file: held-out pairs in the same format: loss, reward margin and accuracy after each epoch.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        max_length: longest prompt plus answer in tokens; longer pairs are dropped.
        lora_r: rank of a LoRA adapter (alpha 2 x rank, no dropout) on every linear layer; 0: the whole model.
        beta: how far the model may move from the reference: the scale of the margin (0.1 is usual).
        batch_size: GLOBAL pairs per optimizer step; each process loads batch_size / (processes x
            accumulation).
        gradient_accumulation_steps: micro-batches whose gradients add up to one optimizer step.
        epochs: passes over the training pairs.
        max_steps: stop after this many optimizer steps instead (the last epoch cut short).
        lr: AdamW's peak learning rate (10% warm-up, linear decay to 0); default 5e-5 with LoRA, 1e-6 in full.
        max_grad_norm: clip the gradients' global norm to this before each update.
        seed: seed for LoRA's initial weights and the data order.
        log_every: print and log the training loss every N optimizer steps (and at the first and last).
        checkpoint_every: save_state every N steps and at epoch ends (0: epoch ends only); the 2
            newest are kept.
        resume: a checkpoint folder (output_dir/checkpoints/step_N) to continue from, at the batch after it.
        tracker: swanlab (offline without a login), none, or another tracker Accelerate knows
            (tensorboard, ...).
        output_dir: where the adapter (or model), its tokenizer, checkpoints and offline tracker logs go.
    """
    if not train_file or not validation_file:
        raise SystemExit(
            "error: no data; give --train_file and --validation_file, .jsonl or .json preference pairs"
        )

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    # Steps counted by micro-batches, not at the loader's end: an epoch's short remainder is left out.
    accumulate = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps, sync_with_dataloader=False)
    accelerator = Accelerator(  # precision: the accelerate config's, or launch's --mixed_precision
        gradient_accumulation_plugin=accumulate,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # shuffle: seed+epoch
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, else once per process
    )
    # cuDNN's sdpa, Hopper's default from torch 2.11, is reported to give NaN gradients where a mask
    # leaves whole query rows masked, as left padding does: off on CUDA, as in recipes/dpo.py.
    if accelerator.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    world, accumulation = accelerator.num_processes, gradient_accumulation_steps
    if batch_size % (world * accumulation):  # the global batch: processes x micro-batches x per-process batch
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {world * accumulation}")
    per_process = batch_size // (world * accumulation)
    accelerator.print(
        f"global batch {batch_size} = {world} processes x {accumulation} micro-batches x {per_process}"
    )
    set_seed(seed)
    lr = lr or (5e-5 if lora_r else 1e-6)

    # ---- data: pairs rendered with the model's chat template
    tokenizer = AutoTokenizer.from_pretrained(model)
    train_pairs, validation_pairs = (
        read_pairs(str(f), tokenizer, max_length) for f in (train_file, validation_file)
    )
    # no global RNG draw
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_loader = DataLoader(train_pairs, batch_size=per_process, collate_fn=collate, **shuffle)
    eval_loader = DataLoader(validation_pairs, batch_size=per_process, collate_fn=collate)

    # ---- model: whole, or frozen with a LoRA adapter (set_seed above makes LoRA's init reproducible)
    # a bf16 frozen base with LoRA under bf16
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, use_cache=False)
    if lora_r:  # no dropout: the model and its reference start as the same function (a margin of exactly 0)
        lora = dict(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules="all-linear")
        net = peft.get_peft_model(net, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    # The reference policy, the model this run starts from: LoRA's base (adapter off) or a frozen copy.
    reference = None if lora_r else copy.deepcopy(net).eval().requires_grad_(False).to(accelerator.device)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)

    # ---- prepare: DDP wrapping, each process its shard of every batch, the device
    net, optimizer, train_loader, eval_loader = accelerator.prepare(net, optimizer, train_loader, eval_loader)
    steps_per_epoch = len(train_loader) // accumulation  # whole optimizer steps only
    if steps_per_epoch == 0:
        raise SystemExit(f"error: fewer training pairs than one --batch_size {batch_size}; lower it")
    total_steps = max_steps or epochs * steps_per_epoch
    num_epochs = -(-total_steps // steps_per_epoch)  # the last one cut short by --max_steps
    scheduler = accelerator.prepare(
        get_linear_schedule_with_warmup(optimizer, round(0.1 * total_steps), total_steps)
    )

    step = int(Path(resume).name.removeprefix("step_")) if resume else 0  # the step: the folder's name
    if resume:  # weights, optimizer, schedule and RNG states
        accelerator.load_state(resume)
    settings = dict(
        batch_size=batch_size, lr=lr, lora_r=lora_r, beta=beta, total_steps=total_steps, world=world
    )
    accelerator.init_trackers(
        "accelerate-recipes", settings, tracker_init_kwargs(tracker, output_dir, "dpo-starter")
    )

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop
    # summed on the device until logged
    running_loss, steps_since_log = torch.zeros((), device=accelerator.device), 0
    for epoch in range(step // steps_per_epoch, num_epochs):
        train_loader.set_epoch(epoch)  # this epoch's shuffle: seed + epoch
        done = (step - epoch * steps_per_epoch) * accumulation  # batches a resumed epoch already had
        batches = iter(accelerator.skip_first_batches(train_loader, done) if done else train_loader)
        for micro_batches in zip(*[batches] * accumulation):  # a step's micro-batches, a short tail dropped
            for inputs, answer_mask in micro_batches:
                with accelerator.accumulate(net):  # no gradient all-reduce until the step's last micro-batch
                    losses, _ = dpo_loss(accelerator, net, reference, inputs, answer_mask, beta)
                    loss = losses.sum() / batch_size  # these pairs' share of the mean over the global batch
                    accelerator.backward(loss * world * accumulation)  # undoes DDP's and backward's means
                    if accelerator.sync_gradients:  # the step's last micro-batch: clip, update
                        accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                running_loss += loss.detach()
            scheduler.step()
            step, steps_since_log = step + 1, steps_since_log + 1
            if step % log_every == 0 or step in (1, total_steps):
                loss_now = accelerator.reduce(running_loss, "sum").item() / steps_since_log  # shares: summed
                running_loss, steps_since_log = torch.zeros_like(running_loss), 0
                accelerator.print(
                    f"step {step}/{total_steps} loss {loss_now:.7f} lr {scheduler.get_last_lr()[0]:.7e}"
                )
                accelerator.log({"train/loss": loss_now, "train/lr": scheduler.get_last_lr()[0]}, step=step)
            due = checkpoint_every and step % checkpoint_every == 0 and step % steps_per_epoch
            if due and step < total_steps:
                save_checkpoint()  # epoch ends: below
            if step >= total_steps:
                break

        # ---- evaluation once per epoch: each pair once (gather_for_metrics drops the sampler's repeats)
        net.eval()
        figures = []
        for inputs, answer_mask in eval_loader:
            with torch.no_grad():
                losses, margins = dpo_loss(accelerator, net, reference, inputs, answer_mask, beta)
            figures.append(
                accelerator.gather_for_metrics(torch.stack([losses, margins, (margins > 0).float()], 1))
            )
        net.train()
        eval_loss, margin, accuracy = torch.cat(figures).double().mean(dim=0).tolist()
        accelerator.print(
            f"epoch {epoch + 1} eval_loss {eval_loss:.7f} margin {margin:.7f} accuracy {accuracy:.7f}"
        )
        accelerator.log(
            {"eval/loss": eval_loss, "eval/reward_margin": margin, "eval/reward_accuracy": accuracy}, step
        )
        save_checkpoint()

    # ---- save: the adapter (LoRA) or the model, with the tokenizer, as from_pretrained / peft read them
    state_dict = accelerator.get_state_dict(net)  # whole on the main process, also where sharded
    if accelerator.is_main_process:
        accelerator.unwrap_model(net).save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
