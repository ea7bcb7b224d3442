#!/usr/bin/env python
"""RL with verifiable rewards (GRPO) for a chat model with Hugging Face Accelerate, LoRA or full, in one file to copy.

    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --train_file math.jsonl --reward number --lora_r 16
    accelerate launch --config_file accelerate_configs/2gpu.yaml grpo.py --train_file math.jsonl --lora_r 16
    make grpo-2gpu STARTER=1 ARGS="--train_file math.jsonl --lora_r 16"     # the same, from a clone of the project
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 \
        --num_cpu_threads_per_process 1 grpo.py ...                          # 2 processes on a CPU, over gloo

Data: .jsonl (one per line) or .json (a list) of {"prompt": "...", "answer": "..."} or {"messages": [...]} (a final
assistant turn is the answer). Each step every process samples --num_generations completions for each of its share of
--batch_size prompts, scores them, and takes the clipped policy-gradient step on group-relative advantages. The loss is
the sum of the completion tokens' losses over the global batch divided by its completion tokens, so 1 GPU and N GPUs
train alike; sampling is keyed by (seed, epoch, prompt, completion, position), so they also sample alike.

The full recipe, recipes/grpo.py (with grpo_rewards.py, the chat recipe's modules and the accelerate_recipes library),
adds: more rewards (tag, format, length) with weights, GSM8K's layout and Hub datasets, --beta (KL against the
reference), --num_iterations, --epsilon_high, --scale_rewards, the grpo / dr_grpo losses, --mask_truncated, FSDP2 and
ZeRO-3 with generation on gathered weights, .gguf models and the chat recipe's adapters, per-function reward figures,
solved prompts, clip fraction, samples.jsonl, tokens/s of generation and training, --eval_every, model_best/ and
early stopping, --eval_only, --predict, --chat and --merge, launch checks, a NaN and stop-signal guard, checkpoints
that resume mid-epoch, results.json, metrics.jsonl and results.png.
"""

import importlib.util
import json
import math
import os
import re
import shutil
import string
from pathlib import Path

import fire
import peft
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, gather_object, set_seed, tqdm
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor, get_scheduler


# ---------------------------------------------------------------------------------------------------- rewards
def normalized(text: str) -> str:
    return " ".join(str(text).split()).strip(string.punctuation + string.whitespace).casefold()


def number(prompts, completions, answer, **columns):
    """1.0 when the completion's last number equals the answer's."""
    last = [re.findall(r"-?\d[\d,]*(?:\.\d+)?", str(text)) for text in (*completions, *answer)]
    values = [float(found[-1].replace(",", "")) if found else None for found in last]
    given, expected = values[: len(completions)], values[len(completions) :]
    return [float(g is not None and e is not None and abs(g - e) < 1e-6) for g, e in zip(given, expected)]


def exact(prompts, completions, answer, **columns):
    """1.0 when the whole completion equals the short answer, up to case, spaces and surrounding punctuation."""
    return [float(normalized(c) == normalized(a)) for c, a in zip(completions, answer)]


def reward_function(spec: str):
    """number, exact, or your own path/to/file.py:function taking (prompts, completions, **columns)."""
    if spec in ("number", "exact"):
        return {"number": number, "exact": exact}[spec]
    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


# ---------------------------------------------------------------------------------------------------- sampling
def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN, MIX_1, MIX_2 = signed(0x9E3779B97F4A7C15), signed(0xBF58476D1CE4E5B9), signed(0x94D049BB133111EB)


def shift_right(x, bits: int):
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # logical shift; int64 arithmetic wraps


def splitmix64(x):
    x = x + GOLDEN
    x = (x ^ shift_right(x, 30)) * MIX_1
    x = (x ^ shift_right(x, 27)) * MIX_2
    return x ^ shift_right(x, 31)


class KeyedSampling(LogitsProcessor):
    """Sampling through greedy decoding: each row draws its token from the softmax by the inverse of its cumulative
    distribution at a uniform number hashed from (the row's key, position): the same draw in any batch on any process.
    The scores returned put the drawn token at 0 and every other at -inf."""

    def __init__(self, keys, temperature: float):
        self.keys, self.temperature = keys, temperature

    def __call__(self, input_ids, scores):
        cumulative = (scores.float() / self.temperature).softmax(dim=-1).cumsum(dim=-1)
        uniform = (shift_right(splitmix64(splitmix64(self.keys) + input_ids.shape[1]), 40).float() + 0.5) / 2**24
        drawn = torch.searchsorted(cumulative, uniform[:, None] * cumulative[:, -1:]).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf, dtype=torch.float32).scatter_(-1, drawn, 0.0)


def sampling_keys(seed: int, epoch: int, indices, generations: int):
    """One key per completion, (seed, epoch, prompt, completion number), prompt-major as the rows are."""
    completion = indices.to(torch.int64)[:, None] * 4099 + torch.arange(generations, device=indices.device)
    return splitmix64(completion.reshape(-1) + splitmix64(torch.tensor([seed * 1_000_003 + epoch])).to(indices.device))


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, processor=None) -> dict:
    """Completions of left-padded prompts (greedy without a processor); masks up to each one's end-of-turn token."""
    width, pad, device = max(map(len, prompts)), tokenizer.pad_token_id, model.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    configured = model.generation_config.eos_token_id  # a chat model's end-of-turn token(s)
    configured = configured if isinstance(configured, list) else [configured]
    stop = sorted({i for i in [*configured, tokenizer.eos_token_id] if i is not None})
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=stop)
    model.eval()
    output = model.generate(
        input_ids=ids,
        attention_mask=attention,
        generation_config=config,
        logits_processor=[processor] if processor else None,
    )
    model.train()
    completion = output[:, width:]
    is_stop = torch.isin(completion, torch.tensor(stop, device=device))
    first_stop = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1), completion.shape[1])
    mask = (torch.arange(completion.shape[1], device=device)[None] <= first_stop[:, None]).long()
    texts = tokenizer.batch_decode([c[: int(n)] for c, n in zip(completion, mask.sum(1))], skip_special_tokens=True)
    return dict(prompt=ids, prompt_mask=attention, completion=completion, mask=mask, texts=texts)


def token_logprobs(model, rollout: dict, temperature: float):
    """Log-probabilities of the completion tokens, positions numbered as generate numbered them."""
    ids = torch.cat([rollout["prompt"], rollout["completion"]], dim=1)
    attention = torch.cat([rollout["prompt_mask"], rollout["mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    logits = logits[:, rollout["prompt"].shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, rollout["completion"][..., None]).squeeze(-1)


def main(
    train_file: str | None = None,
    validation_file: str | None = None,
    model: str = "Qwen/Qwen2.5-0.5B-Instruct",
    reward: str = "number",
    lora_r: int = 0,
    lora_alpha: int | None = None,
    batch_size: int = 16,
    num_generations: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    epsilon: float = 0.2,
    gradient_accumulation_steps: int = 1,
    epochs: int = 1,
    max_steps: int | None = None,
    lr: float | None = None,
    max_grad_norm: float = 1.0,
    mixed_precision: str | None = None,
    seed: int = 42,
    log_every: int = 1,
    tracker: str = "swanlab",
    output_dir: str = "outputs/grpo-starter",
):
    """Improve a chat model with GRPO on prompts a program can check: a LoRA adapter (--lora_r) or the whole model.

    Args:
        train_file: training prompts, .jsonl or .json: {"prompt": ..., "answer": ...} or {"messages": [...]}.
        validation_file: held-out prompts in the same format, answered greedily after each epoch.
        model: Hub name or local folder of a chat model (its tokenizer must have a chat template).
        reward: comma-separated rewards, summed: number (the last number equals the answer), exact (the completion
            equals a short answer), or your own path/to/file.py:function(prompts, completions, **columns).
        lora_r: rank of a LoRA adapter on every linear layer; 0: train the whole model.
        lora_alpha: LoRA scale numerator; default 2 x --lora_r.
        batch_size: GLOBAL prompts per optimizer step; each process takes batch_size / (processes x accumulation).
        num_generations: completions sampled per prompt (a group, never split across processes).
        max_new_tokens: longest completion.
        temperature: sampling temperature (the update's log-probabilities use it too).
        epsilon: the probability ratio is clipped to [1 - epsilon, 1 + epsilon].
        gradient_accumulation_steps: micro-batches per optimizer step.
        epochs: passes over the training prompts (ignored with --max_steps).
        max_steps: stop after this many optimizer steps.
        lr: AdamW's peak learning rate, decayed linearly to 0; default 1e-5 with LoRA, 1e-6 in full.
        max_grad_norm: clip the gradients' global norm to this; 0: no clipping.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config says.
        seed: seed for LoRA's initial weights, the prompt order and the sampling keys.
        log_every: print and log the step's loss and reward every N optimizer steps.
        tracker: swanlab (offline without a login), tensorboard, wandb, ... or none.
        output_dir: where the adapter (or model), its tokenizer and offline tracker logs go.
    """
    if not train_file or not validation_file:
        raise SystemExit("error: give --train_file and --validation_file, .jsonl or .json files of prompts")
    if tracker == "swanlab" and not os.environ.get("SWANLAB_MODE"):  # never ask for a login, never block without one
        logged_in = os.environ.get("SWANLAB_API_KEY") or (Path.home() / ".swanlab" / ".netrc").is_file()
        os.environ["SWANLAB_MODE"] = "online" if logged_in else "offline"

    # ---- accelerator: processes, precision, gradient accumulation, tracking
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        # Steps counted by micro-batches: a step's rollouts are all generated before its first forward pass.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_with_dataloader=False
        ),
        log_with=None if tracker == "none" else tracker,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # the same order on any world size
        step_scheduler_with_optimizer=False,
    )
    world, accumulation = accelerator.num_processes, gradient_accumulation_steps
    if batch_size % (world * accumulation):
        raise SystemExit(f"error: --batch_size {batch_size} does not split into {world} x {accumulation} micro-batches")
    per_process = batch_size // (world * accumulation)
    set_seed(seed)
    lr = lr or (1e-5 if lora_r else 1e-6)

    # ---- data: prompts rendered with the chat template, their answers for the rewards
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # padding is masked out; any id does

    def read(path):
        text = Path(path).read_text()
        rows = json.loads(text) if path.endswith(".json") else [json.loads(line) for line in text.splitlines() if line]
        for row in rows:
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if messages[-1]["role"] == "assistant":  # the answer of a conversation to continue
                row["answer"], messages = row.get("answer", messages[-1]["content"]), messages[:-1]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            row.update(text=messages[-1]["content"], ids=tokenizer(text, add_special_tokens=False)["input_ids"])
        return rows

    train_rows, validation_rows = read(train_file), read(validation_file)
    rewards = [reward_function(spec.strip()) for spec in reward.split(",")]

    def score(rows, texts) -> list[list[float]]:
        answers = [row.get("answer") for row in rows]
        return [f(prompts=[r["text"] for r in rows], completions=texts, answer=answers) for f in rewards]

    # ---- model: the whole of it, or frozen with a LoRA adapter (set_seed above makes LoRA's init reproducible)
    dtype = torch.bfloat16 if lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    net.config.use_cache = False
    if lora_r:
        config = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=lora_r,
            lora_alpha=lora_alpha or 2 * lora_r,
            lora_dropout=0.0,
            target_modules="all-linear",
        )
        net = peft.get_peft_model(net, config)
    # The loader hands out prompt indices; its shuffle has a generator of its own.
    shuffle = dict(shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    train_loader = DataLoader(list(range(len(train_rows))), batch_size=per_process, **shuffle)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in trainable if p.ndim > 1], "weight_decay": 0.0},
            {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=lr,
    )

    # ---- prepare: DDP wrapping, each process its shard of the prompts, the device
    net, optimizer, train_loader = accelerator.prepare(net, optimizer, train_loader)
    steps_per_epoch = len(train_loader) // accumulation
    total_steps = max_steps or epochs * steps_per_epoch
    scheduler = accelerator.prepare(get_scheduler("linear", optimizer, 0, total_steps))
    accelerator.init_trackers(
        "accelerate-recipes",
        config=dict(batch_size=batch_size, lr=lr, lora_r=lora_r),
        init_kwargs={"swanlab": {"log_dir": str(Path(output_dir, "swanlog").resolve())}},
    )
    policy = accelerator.unwrap_model(net)  # generate() runs on the model itself, not on the DDP wrapper

    # ---- training loop: roll out, score, update
    progress = tqdm(total=total_steps, desc="train", disable=not accelerator.is_main_process)
    step = 0
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        train_loader.set_epoch(epoch)
        micro_batches = []
        for indices in train_loader:
            micro_batches.append(indices)
            if len(micro_batches) < accumulation:
                continue
            rollouts = []
            for indices in micro_batches:  # the step's rollouts, all before its first forward pass
                rows = [train_rows[i] for i in indices.tolist() for _ in range(num_generations)]
                keys = sampling_keys(seed, epoch, indices, num_generations)
                rollout = generate(
                    policy, tokenizer, [r["ids"] for r in rows], max_new_tokens, KeyedSampling(keys, temperature)
                )
                rollout["rewards"] = [sum(per) for per in zip(*score(rows, rollout["texts"]))]
                rollouts.append(rollout)
            micro_batches = []
            # Group-relative advantages: each completion's reward minus its group's mean, over the group's spread.
            rewards_now = [r for rollout in rollouts for r in rollout["rewards"]]
            mine = torch.tensor(rewards_now, dtype=torch.float64, device=accelerator.device)
            groups = mine.view(-1, num_generations)
            advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
            # The step's completion tokens, every micro-batch of every process, counted before the forward passes.
            tokens = accelerator.reduce(sum(ro["mask"].sum() for ro in rollouts).float(), "sum").clamp(min=1)
            step_loss = torch.zeros((), device=accelerator.device)
            for index, rollout in enumerate(rollouts):
                advantage = advantages[index * len(rollout["rewards"]) :][: len(rollout["rewards"])].float()[:, None]
                with accelerator.accumulate(net):  # no gradient all-reduce until the step's last micro-batch
                    logprobs = token_logprobs(net, rollout, temperature)
                    ratio = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of the log-probability
                    per_token = -torch.min(ratio * advantage, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantage)
                    loss = (per_token * rollout["mask"]).sum() / tokens  # this micro-batch's share of the step's loss
                    accelerator.backward(loss * world * accumulation)  # undoes the means DDP and backward take
                    if accelerator.sync_gradients:
                        if max_grad_norm:
                            accelerator.clip_grad_norm_(net.parameters(), max_grad_norm)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                step_loss += loss.detach()
            scheduler.step()
            step += 1
            progress.update()
            if step % log_every == 0 or step == 1 or step == total_steps:
                loss_now = accelerator.reduce(step_loss, "sum").item()
                reward_now = accelerator.gather(mine).mean().item()
                accelerator.print(f"step {step}/{total_steps} loss {loss_now:.7e} reward {reward_now:.7f}")
                accelerator.log({"train/loss": loss_now, "train/reward": reward_now}, step=step)
            if step == total_steps:
                break

        # ---- evaluation once per epoch: greedy answers to every validation prompt, each counted once
        answers = []
        with accelerator.split_between_processes(list(range(len(validation_rows)))) as share:
            for start in range(0, len(share), per_process * num_generations):
                chunk = share[start : start + per_process * num_generations]
                done = generate(policy, tokenizer, [validation_rows[i]["ids"] for i in chunk], max_new_tokens)
                answers += list(zip(chunk, done["texts"]))
        answers = sorted(gather_object(answers))
        per_function = score([validation_rows[i] for i, _ in answers], [text for _, text in answers])
        eval_reward = sum(map(sum, zip(*per_function))) / len(answers)
        accuracy = sum(v >= 1.0 for v in per_function[0]) / len(answers)
        accelerator.print(f"epoch {epoch + 1} eval_reward {eval_reward:.7f} accuracy {accuracy:.4f}")
        accelerator.log({"eval/reward": eval_reward, "eval/accuracy": accuracy}, step=step)
        if step == total_steps:
            break
    progress.close()

    # ---- save: the adapter (LoRA) or the model, with the tokenizer, as from_pretrained / peft read them
    accelerator.wait_for_everyone()
    policy.save_pretrained(
        output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(net),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        shutil.rmtree(Path(output_dir, "checkpoints"), ignore_errors=True)
    accelerator.print(f"{'adapter' if lora_r else 'model'} and tokenizer saved in {output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    fire.Fire(main)
