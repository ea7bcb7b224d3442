#!/usr/bin/env python
"""GRPO (RL with verifiable rewards) for a chat model with Hugging Face Accelerate, LoRA or full, in
one file to copy.

    accelerate launch --num_processes 2 grpo.py --train_file math.jsonl \\
        --validation_file test.jsonl --lora_r 16

recipes/grpo.py adds keyed sampling, more rewards and losses, --beta, FSDP2, --chat, a NaN guard."""

import json
import os
import re
import runpy
import shutil
from pathlib import Path

import fire
import peft
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, gather_object, set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler


def number(prompts, completions, answer, **columns):
    """1.0 when the completion's last number equals the answer's."""
    texts = [str(text).replace(",", "") for text in (*completions, *answer)]  # 1,000: 1000
    found = [re.findall(r"-?\d+(?:\.\d+)?", text) for text in texts]
    last = [float(numbers[-1]) if numbers else None for numbers in found]
    guesses, expected = last[: len(completions)], last[len(completions) :]
    return [float(g is not None and g == e) for g, e in zip(guesses, expected)]


# Every logits processor off, or generate() takes generation_config's (Qwen2.5's: top-k, a penalty)
SAMPLING = dict(top_k=0, top_p=1.0, min_p=None, typical_p=1.0, top_h=None)
SAMPLING.update(epsilon_cutoff=0.0, eta_cutoff=0.0)
NEUTRAL = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, sequence_bias=None)
NEUTRAL.update(no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, bad_words_ids=None)
NEUTRAL.update(suppress_tokens=None, begin_suppress_tokens=None, min_length=0, min_new_tokens=None)
NEUTRAL.update(forced_bos_token_id=None, forced_eos_token_id=None, guidance_scale=None)
NEUTRAL.update(exponential_decay_length_penalty=None, watermarking_config=None)


def read_prompts(path: str, tokenizer) -> list[dict]:
    """A .jsonl's rows, each with its prompt's last turn (text) and its chat's token ids (ids)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if messages[-1]["role"] == "assistant":  # the answer of a conversation to continue
            row["answer"], messages = row.get("answer", messages[-1]["content"]), messages[:-1]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        row.update(text=messages[-1]["content"], ids=ids)
    return rows


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature=0.0):
    """Left-padded prompts' completions at `temperature` (0: greedy), masked to each end of turn."""
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    batch = batch.to(model.device)
    rollout = dict(prompt=batch.input_ids, prompt_mask=batch.attention_mask)
    ends = model.generation_config.eos_token_id  # end-of-turn token(s), and the tokenizer's eos
    stop = sorted({*(ends if isinstance(ends, list) else [ends]), tokenizer.eos_token_id} - {None})
    options = dict(NEUTRAL, max_new_tokens=max_new_tokens, eos_token_id=stop)
    options.update(pad_token_id=tokenizer.pad_token_id, do_sample=bool(temperature))
    if temperature:
        options.update(SAMPLING, temperature=temperature)
    model.eval()
    completion = model.generate(**batch, **options)[:, batch.input_ids.shape[1] :]
    model.train()
    is_stop = torch.isin(completion, torch.tensor(stop, device=completion.device)).long()
    mask = (is_stop.cumsum(1) - is_stop == 0).long()  # up to its first end-of-turn token, included
    kept = [c[: int(n)] for c, n in zip(completion, mask.sum(1))]
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    return dict(rollout, completion=completion, mask=mask, texts=texts)


def token_logprobs(model, rollout: dict, temperature: float):
    """Log-probabilities of the completion tokens, positions numbered as generate numbered them."""
    ids = torch.cat([rollout["prompt"], rollout["completion"]], dim=1)
    attention = torch.cat([rollout["prompt_mask"], rollout["mask"]], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    logits = logits[:, rollout["prompt"].shape[1] - 1 : -1].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, rollout["completion"][..., None]).squeeze(-1)


def group_advantages(rewards, generations: int):
    """Each reward minus its group's mean, over the group's spread (+1e-4: equal rewards give 0)."""
    groups = rewards.view(-1, generations)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)


def policy_loss(logprobs, advantages, mask, tokens):
    """-advantage x ratio per token / all tokens; ratio 1 on-policy (logp's gradient): no clip."""
    return -(torch.exp(logprobs - logprobs.detach()) * advantages[:, None] * mask).sum() / tokens


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
    reward: str = "number",
    lora_r: int = 0,
    batch_size: int = 16,
    num_generations: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    gradient_accumulation_steps: int = 1,
    epochs: int = 1,
    lr: float | None = None,
    seed: int = 42,
    checkpoint_every: int = 500,
    resume: str | None = None,
    tracker: str = "swanlab",
    output_dir: str = "outputs/grpo-starter",
):
    """Tune a chat model with GRPO on prompts a program checks: a LoRA adapter or the whole model.

    Args:
        train_file: .jsonl of {"prompt", "answer"} or {"messages"} (a last assistant turn: answer).
        validation_file: held-out prompts in the same format, answered greedily after each epoch.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        reward: comma-separated rewards, summed: number (the last number is the answer's) or
            path/to/file.py:function.
        lora_r: LoRA rank (alpha 2 x rank) on every linear layer; 0: train the whole model.
        batch_size: GLOBAL prompts per step, split evenly over processes and micro-batches.
        num_generations: completions sampled per prompt (a group, never split across processes).
        max_new_tokens: longest completion.
        temperature: of sampling and of the update's log-probabilities; no top-k, top-p or penalty.
        gradient_accumulation_steps: micro-batches per optimizer step.
        epochs: passes over the training prompts.
        lr: AdamW's peak lr, linear decay to 0; default 1e-4 with LoRA, 1e-6 in full; clipping at 1.
        seed: seed for LoRA's initial weights, the prompt order and sampling (each process its own).
        checkpoint_every: save_state every N steps (0: only at epoch ends); keeps the newest 2.
        resume: a checkpoint folder (output_dir/checkpoints/step_N) to continue from.
        tracker: swanlab (offline without a login), tensorboard, wandb, ... or none.
        output_dir: where the adapter (or model), its tokenizer, checkpoints and offline logs go.
    """
    if not train_file or not validation_file:
        raise SystemExit(
            "error: no data; give --train_file and --validation_file, .jsonl files of prompts"
        )

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    # Steps counted by micro-batches: a step's rollouts are all generated before its first forward.
    accumulation = gradient_accumulation_steps
    plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
    accelerator = Accelerator(  # precision: the accelerate config's, or launch's --mixed_precision
        gradient_accumulation_plugin=plugin,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        # one order, any world
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        step_scheduler_with_optimizer=False,  # stepped below once per step, not once per process
    )
    # cuDNN's sdpa, torch 2.11's default on Hopper, reportedly gives NaN gradients on left padding
    if accelerator.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    world, device = accelerator.num_processes, accelerator.device
    splits = world * accumulation  # the global batch: processes x micro-batches x per-process batch
    if batch_size % splits:
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {splits}")
    per_process = batch_size // splits
    layout = f"{world} processes x {accumulation} micro-batches x {per_process}"
    accelerator.print(f"global batch {batch_size} = {layout}")
    set_seed(seed, device_specific=True)  # each process samples its own; DDP copies rank 0's LoRA
    lr = lr or (1e-4 if lora_r else 1e-6)

    # ---- data: prompts rendered with the chat template, their answers for the rewards
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # masked out: any id does
    train_rows = read_prompts(str(train_file), tokenizer)
    validation_rows = read_prompts(str(validation_file), tokenizer)
    reward_functions = []
    for spec in reward.split(","):
        path, _, name = spec.strip().rpartition(":")
        reward_functions.append(number if spec.strip() == "number" else runpy.run_path(path)[name])

    def score(rows: list[dict], texts: list[str]) -> list[float]:
        """The rewards' sum, per completion."""
        prompts, expected = [row["text"] for row in rows], [row.get("answer") for row in rows]
        each_reward = [function(prompts, texts, answer=expected) for function in reward_functions]
        return [sum(each) for each in zip(*each_reward)]

    # ---- model: whole, or frozen (bf16 under bf16) with a LoRA adapter, its init seeded above
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    if lora_r:
        lora = dict(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear")
        net = peft.get_peft_model(net, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    # a batch: this process's prompts for a step; its own generator leaves sampling's RNG alone
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator())
    row_indices = list(range(len(train_rows)))
    train_loader = DataLoader(row_indices, batch_size=per_process * accumulation, **shuffle)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)

    # ---- prepare: DDP wrapping, each process its shard of the prompts, the device
    net, optimizer, train_loader = accelerator.prepare(net, optimizer, train_loader)
    steps_per_epoch, total_steps = len(train_loader), epochs * len(train_loader)
    scheduler = accelerator.prepare(get_scheduler("linear", optimizer, 0, total_steps))
    step = int(Path(resume).name.removeprefix("step_")) if resume else 0  # the folder's name
    if resume:  # weights, optimizer, schedule and RNG states
        accelerator.load_state(resume)
    settings = dict(batch_size=batch_size, lr=lr, lora_r=lora_r, epochs=epochs)
    settings.update(total_steps=total_steps, world=world)
    init_kwargs = tracker_init_kwargs(tracker, output_dir, "grpo-starter")
    accelerator.init_trackers("accelerate-recipes", settings, init_kwargs)
    policy = accelerator.unwrap_model(net)  # generate() runs on the model, not the DDP wrapper

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop: roll out, score, update
    for epoch in range(step // steps_per_epoch, epochs):
        train_loader.set_epoch(epoch)  # this epoch's shuffle, the same on every process
        done = step - epoch * steps_per_epoch  # batches (one per step) a resumed epoch has had
        batches = accelerator.skip_first_batches(train_loader, done) if done else train_loader
        for step_indices in batches:
            rollouts = []
            for indices in step_indices.chunk(accumulation):
                rows = [train_rows[i] for i in indices.tolist() for _ in range(num_generations)]
                prompts = [row["ids"] for row in rows]
                rollout = generate(policy, tokenizer, prompts, max_new_tokens, temperature)
                scores = score(rows, rollout["texts"])
                rewards = torch.tensor(scores, dtype=torch.float64, device=device)
                advantages = group_advantages(rewards, num_generations).float()
                rollouts.append(rollout | dict(rewards=rewards, advantages=advantages))
            # the loss's denominator: the step's completion tokens on every process
            own_tokens = sum(r["mask"].sum() for r in rollouts).float()
            tokens = accelerator.reduce(own_tokens, "sum").clamp(min=1)
            step_loss = torch.zeros((), device=device)
            for rollout in rollouts:
                with accelerator.accumulate(net):  # all-reduce at the step's last micro-batch only
                    logprobs = token_logprobs(net, rollout, temperature)
                    loss = policy_loss(logprobs, rollout["advantages"], rollout["mask"], tokens)
                    # x processes x micro-batches: undoes DDP's mean and backward's division
                    accelerator.backward(loss * world * accumulation)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(net.parameters(), 1.0)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                step_loss += loss.detach()
            scheduler.step()  # once per optimizer step
            step += 1
            # generate() has synchronised: reading these costs no wait
            loss_now = accelerator.reduce(step_loss, "sum").item()
            step_rewards = accelerator.gather(torch.cat([r["rewards"] for r in rollouts]))
            reward_now = step_rewards.mean().item()
            figures = f"loss {loss_now:.7e} reward {reward_now:.7f}"
            accelerator.print(f"step {step}/{total_steps} {figures}")
            accelerator.log({"train/loss": loss_now, "train/reward": reward_now}, step=step)
            if checkpoint_every and step % checkpoint_every == 0 and step % steps_per_epoch:
                save_checkpoint()  # epoch ends: below

        # ---- evaluation: a greedy answer to every validation prompt, each once; a checkpoint
        answers, chunk = [], per_process * num_generations  # as many at a time as a step's rollouts
        # consecutive shares, no repeats; gathered rank by rank: in the validation rows' order
        with accelerator.split_between_processes(validation_rows) as share:
            for start in range(0, len(share), chunk):
                prompts = [row["ids"] for row in share[start : start + chunk]]
                answers += generate(policy, tokenizer, prompts, max_new_tokens)["texts"]
        answers = gather_object(answers)
        eval_reward = sum(score(validation_rows, answers)) / len(answers)
        evaluated = f"eval_reward {eval_reward:.7f} over {len(answers)} prompts"
        accelerator.print(f"epoch {epoch + 1} {evaluated}")
        accelerator.log({"eval/reward": eval_reward}, step=step)
        save_checkpoint()

    # ---- save: the adapter (LoRA) or the model, and the tokenizer, for from_pretrained / peft
    state_dict = accelerator.get_state_dict(net)  # whole on the main process, also where sharded
    if accelerator.is_main_process:
        policy.save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
