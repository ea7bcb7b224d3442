#!/usr/bin/env python
"""GRPO (RL with verifiable rewards) for a chat model with Hugging Face Accelerate, LoRA or full, in
one file to copy.

    accelerate launch --num_processes 2 grpo.py --train_file math.jsonl --validation_file test.jsonl \\
        --lora_r 16

The full recipe, recipes/grpo.py, adds keyed sampling, more rewards and losses, --beta, FSDP2,
--chat, a NaN guard."""

import json
import os
import re
import runpy
import shutil
from pathlib import Path

import fire
import peft
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, gather_object, set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler


def number(prompts, completions, answer, **columns):
    """1.0 when the completion's last number equals the answer's."""
    found = [re.findall(r"-?\d+(?:\.\d+)?", str(text).replace(",", "")) for text in (*completions, *answer)]
    last = [float(numbers[-1]) if numbers else None for numbers in found]
    return [
        float(g is not None and g == e) for g, e in zip(last[: len(completions)], last[len(completions) :])
    ]


# Every logits processor off, or generate() takes generation_config's (Qwen2.5's: top-k, a penalty)
SAMPLING = dict(top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, top_h=None)
NEUTRAL = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0)
NEUTRAL.update(encoder_no_repeat_ngram_size=0, min_new_tokens=None, bad_words_ids=None, sequence_bias=None)
NEUTRAL.update(
    suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None
)
NEUTRAL.update(exponential_decay_length_penalty=None, guidance_scale=None, watermarking_config=None)


def generate(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0
) -> dict:
    """Completions of left-padded prompts, sampled at `temperature` (0: greedy); masks up to each
    one's end of turn."""
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(model.device)
    ends = model.generation_config.eos_token_id  # end-of-turn token(s), and the tokenizer's eos
    stop = sorted({*(ends if isinstance(ends, list) else [ends]), tokenizer.eos_token_id} - {None})
    options = dict(
        NEUTRAL, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop
    )
    greedy = dict(do_sample=False)
    options |= dict(SAMPLING, do_sample=True, temperature=temperature) if temperature else greedy
    model.eval()
    completion = model.generate(**batch, **options)[:, batch.input_ids.shape[1] :]
    model.train()
    is_stop = torch.isin(completion, torch.tensor(stop, device=completion.device)).long()
    mask = (is_stop.cumsum(1) - is_stop == 0).long()  # up to and including the first end-of-turn token
    texts = tokenizer.batch_decode(
        [c[: int(n)] for c, n in zip(completion, mask.sum(1))], skip_special_tokens=True
    )
    return dict(
        prompt=batch.input_ids,
        prompt_mask=batch.attention_mask,
        completion=completion,
        mask=mask,
        texts=texts,
    )


def token_logprobs(model, rollout: dict, temperature: float):
    """Log-probabilities of the completion tokens, positions numbered as generate numbered them."""
    ids = torch.cat([rollout["prompt"], rollout["completion"]], dim=1)
    attention = torch.cat([rollout["prompt_mask"], rollout["mask"]], dim=1)
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0)
    ).logits
    logits = logits[:, rollout["prompt"].shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, rollout["completion"][..., None]).squeeze(-1)


def group_advantages(rewards, generations: int):
    """Each reward minus its group's mean, over the group's spread (+1e-4: equal rewards give 0s)."""
    groups = rewards.view(-1, generations)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)


def policy_loss(logprobs, advantages, mask, tokens):
    """-advantage x ratio per token / the global batch's tokens; on-policy ratio = 1 (logp's
    gradient): no clipping."""
    return -(torch.exp(logprobs - logprobs.detach()) * advantages[:, None] * mask).sum() / tokens


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
    """Improve a chat model with GRPO on prompts a program can check: a LoRA adapter (--lora_r) or
    the whole model.

    Args:
        train_file: .jsonl of {"prompt": ..., "answer": ...} or {"messages": [...]} (a last
            assistant turn: the answer).
        validation_file: held-out prompts in the same format, answered greedily after each epoch.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        reward: comma-separated rewards, summed: number (the last number is the answer's) or
            path/to/file.py:function.
        lora_r: rank of a LoRA adapter (alpha 2 x rank) on every linear layer; 0: train the whole model.
        batch_size: GLOBAL prompts per optimizer step; each process takes batch_size / (processes x
            accumulation).
        num_generations: completions sampled per prompt (a group, never split across processes).
        max_new_tokens: longest completion.
        temperature: sampling temperature (the update's log-probabilities use it too); no top-k,
            top-p or penalty.
        gradient_accumulation_steps: micro-batches per optimizer step.
        epochs: passes over the training prompts.
        lr: AdamW's peak lr, decayed linearly to 0; default 1e-4 with LoRA, 1e-6 in full; clipping at 1.
        seed: seed for LoRA's initial weights, the prompt order and sampling (each process its own stream).
        checkpoint_every: save_state every N steps and at epoch ends (0: epoch ends only); the 2
            newest are kept.
        resume: a checkpoint folder (output_dir/checkpoints/step_N) to continue from.
        tracker: swanlab (offline without a login), tensorboard, wandb, ... or none.
        output_dir: where the adapter (or model), its tokenizer, checkpoints and offline tracker logs go.
    """
    if not train_file or not validation_file:
        raise SystemExit("error: no data; give --train_file and --validation_file, .jsonl files of prompts")

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    # Steps counted by micro-batches: a step's rollouts are all generated before its first forward pass.
    accumulate = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps, sync_with_dataloader=False)
    accelerator = Accelerator(  # precision: the accelerate config's, or launch's --mixed_precision
        gradient_accumulation_plugin=accumulate,
        log_with=None if tracker == "none" else tracker,
        project_dir=output_dir,
        # one order, any world
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, else once per process
    )
    # cuDNN's sdpa, Hopper's default from torch 2.11, is reported to give NaN gradients where a mask
    # leaves whole query rows masked, as left padding does: off on CUDA, as in recipes/grpo.py.
    if accelerator.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    world, accumulation, device = accelerator.num_processes, gradient_accumulation_steps, accelerator.device
    if batch_size % (world * accumulation):  # the global batch: processes x micro-batches x per-process batch
        cause = f"--batch_size {batch_size} cannot split over {world} process(es) x {accumulation}"
        raise SystemExit(f"error: {cause} accumulation step(s); use a multiple of {world * accumulation}")
    per_process = batch_size // (world * accumulation)
    accelerator.print(
        f"global batch {batch_size} = {world} processes x {accumulation} micro-batches x {per_process}"
    )
    set_seed(seed, device_specific=True)  # each process samples its own; DDP copies rank 0's LoRA
    lr = lr or (1e-4 if lora_r else 1e-6)

    # ---- data: prompts rendered with the chat template, their answers for the rewards
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # padding is masked out; any id does

    def read(path: str) -> list[dict]:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        for row in rows:
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if messages[-1]["role"] == "assistant":  # the answer of a conversation to continue
                row["answer"], messages = row.get("answer", messages[-1]["content"]), messages[:-1]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            row.update(
                text=messages[-1]["content"], ids=tokenizer(text, add_special_tokens=False)["input_ids"]
            )
        return rows

    train_rows, validation_rows = read(str(train_file)), read(str(validation_file))
    specs = [spec.strip() for spec in reward.split(",")]  # number, or path/to/file.py:function
    rewards = [
        number if s == "number" else runpy.run_path(s.rpartition(":")[0])[s.rpartition(":")[2]] for s in specs
    ]

    def score(rows: list[dict], texts: list[str]) -> list[float]:  # the reward functions' sum, per completion
        answers = [row.get("answer") for row in rows]
        return [
            sum(each) for each in zip(*[f([r["text"] for r in rows], texts, answer=answers) for f in rewards])
        ]

    # ---- model: whole, or frozen with a LoRA adapter (set_seed above makes LoRA's init reproducible)
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    if lora_r:
        lora = dict(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear")
        net = peft.get_peft_model(net, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    # A loader batch: this process's prompts for a step; its own generator leaves sampling's RNG alone.
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator())
    train_loader = DataLoader(list(range(len(train_rows))), batch_size=per_process * accumulation, **shuffle)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)

    # ---- prepare: DDP wrapping, each process its shard of the prompts, the device
    net, optimizer, train_loader = accelerator.prepare(net, optimizer, train_loader)
    steps_per_epoch, total_steps = len(train_loader), epochs * len(train_loader)
    scheduler = accelerator.prepare(get_scheduler("linear", optimizer, 0, total_steps))  # checkpointed
    step = 0
    if resume:  # weights, optimizer, schedule and RNG states; the step is the folder's name
        accelerator.load_state(resume)
        step = int(Path(resume).name.removeprefix("step_"))
    settings = dict(
        batch_size=batch_size, lr=lr, lora_r=lora_r, epochs=epochs, total_steps=total_steps, world=world
    )
    accelerator.init_trackers(
        "accelerate-recipes", settings, tracker_init_kwargs(tracker, output_dir, "grpo-starter")
    )
    policy = accelerator.unwrap_model(net)  # generate() runs on the model itself, not on the DDP wrapper

    def save_checkpoint():
        folder = Path(output_dir, "checkpoints", f"step_{step}")
        accelerator.save_state(folder)
        if accelerator.is_main_process:  # keep the newest two
            for old in sorted(folder.parent.glob("step_*"), key=lambda p: int(p.name[5:]))[:-2]:
                shutil.rmtree(old)

    # ---- training loop: roll out, score, update
    for epoch in range(step // steps_per_epoch, epochs):
        train_loader.set_epoch(epoch)  # this epoch's shuffle, the same on every process
        done = step - epoch * steps_per_epoch  # batches (one per step) a resumed epoch already had
        for step_indices in accelerator.skip_first_batches(train_loader, done) if done else train_loader:
            rollouts = []
            for indices in step_indices.chunk(accumulation):  # the step's rollouts, before any forward pass
                rows = [train_rows[i] for i in indices.tolist() for _ in range(num_generations)]
                rollout = generate(policy, tokenizer, [r["ids"] for r in rows], max_new_tokens, temperature)
                scores = score(rows, rollout["texts"])
                rollout["rewards"] = torch.tensor(scores, dtype=torch.float64, device=device)
                rollout["advantages"] = group_advantages(rollout["rewards"], num_generations).float()
                rollouts.append(rollout)
            # all ranks
            tokens = accelerator.reduce(sum(r["mask"].sum() for r in rollouts).float(), "sum").clamp(min=1)
            step_loss = torch.zeros((), device=device)
            for rollout in rollouts:
                with accelerator.accumulate(net):  # no gradient all-reduce until the step's last micro-batch
                    logprobs = token_logprobs(net, rollout, temperature)
                    loss = policy_loss(logprobs, rollout["advantages"], rollout["mask"], tokens)
                    accelerator.backward(loss * world * accumulation)  # undoes DDP's and backward's means
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(net.parameters(), 1.0)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                step_loss += loss.detach()
            scheduler.step()  # once per optimizer step
            step += 1
            loss_now = accelerator.reduce(step_loss, "sum").item()  # generate() has synchronised: a free read
            reward_now = accelerator.gather(torch.cat([r["rewards"] for r in rollouts])).mean().item()
            accelerator.print(f"step {step}/{total_steps} loss {loss_now:.7e} reward {reward_now:.7f}")
            accelerator.log({"train/loss": loss_now, "train/reward": reward_now}, step=step)
            if checkpoint_every and step % checkpoint_every == 0 and step % steps_per_epoch:
                save_checkpoint()  # epoch ends: below

        # ---- evaluation once per epoch: greedy answers to every validation prompt, each once; a checkpoint
        answers, chunk = [], per_process * num_generations  # as many at a time as a step's rollouts
        with accelerator.split_between_processes(validation_rows) as share:  # consecutive shares, no repeats
            for rows in [share[start : start + chunk] for start in range(0, len(share), chunk)]:
                answers += generate(policy, tokenizer, [row["ids"] for row in rows], max_new_tokens)["texts"]
        answers = gather_object(answers)  # rank by rank: the validation rows' order
        eval_reward = sum(score(validation_rows, answers)) / len(answers)
        accelerator.print(f"epoch {epoch + 1} eval_reward {eval_reward:.7f} over {len(answers)} prompts")
        accelerator.log({"eval/reward": eval_reward}, step=step)
        save_checkpoint()

    # ---- save: the adapter (LoRA) or the model, with the tokenizer, as from_pretrained / peft read them
    state_dict = accelerator.get_state_dict(net)  # whole on the main process, also where sharded
    if accelerator.is_main_process:
        policy.save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
