"""GRPO's rollouts (the GRPO recipe, recipes/grpo.py, alone): a micro-batch's completions sampled
with keyed draws, scored by the rewards, and the figures a user watches of them; and the throughput
of generation and of the updates.

Sampling is keyed: each completion's random draws are a function of (--seed, epoch, prompt,
completion number, position) alone (sampling_keys here, generation.py's KeyedSampling for the
draws), not of a generator's state, so the same prompts give the same completions on 1 process, on
8, with or without accumulation, and after a resume. The recipe turns the scored rollouts into
advantages, the loss normaliser and the update (chat/policy_gradient.py holds the maths around it).
A few of a step's completions go to samples.jsonl and the tracker (log_samples).
"""

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import generation
from .generation import Completions, Sampling, splitmix64
from .model import SAMPLES_KEPT, write_samples
from .rewards import Rewards, is_correct, mean_scored, score_texts


# ------------------------------------------------------------------------------------ sampling keys
def sampling_keys(seed: int, epoch: int, prompt_index: torch.Tensor, generations: int) -> torch.Tensor:
    """One int64 key per completion: (seed, epoch, prompt, completion number), prompt-major as the
    rows are."""
    run = splitmix64(torch.tensor([seed * 1_000_003 + epoch], dtype=torch.int64))
    rows = prompt_index.to(torch.int64)[:, None] * 4099 + torch.arange(
        generations, device=prompt_index.device
    )
    # per (seed, epoch, prompt, completion)
    return splitmix64(rows.reshape(-1) + run.to(prompt_index.device))


@dataclass
class Rollout(Completions):
    """One micro-batch of rollouts (prompt-major: --num_generations rows per prompt) and all the
    update needs of it, filled in by roll_out, score and rollout_steps, in that order."""

    # the prompts of the micro-batch (training set indices)
    indices: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the completions, decoded
    generation_seconds: float = 0.0
    # each reward's value (None: not applicable) per row
    per_function: list[list] = field(default_factory=list)
    # the weighted totals (NaN: no reward applied)
    rewards: list[float] = field(default_factory=list)
    loss_mask: torch.Tensor | None = None  # the completion tokens the loss covers
    advantages: torch.Tensor | None = None  # one per row
    # what the step's summed token losses are divided by (loss_normaliser)
    normaliser: torch.Tensor | float = 1.0
    # REWARD_FIGURES and each reward's mean, for the log
    figures: dict = field(default_factory=dict)
    tokens: int = 0  # prompt and completion tokens, for the throughput
    old_logprobs: torch.Tensor | None = None  # the sampling policy's, when --num_iterations > 1
    reference_logprobs: torch.Tensor | None = None  # the reference's, with --beta

    def parts(self, rows: int) -> list["Rollout"]:
        """The micro-batch as passes of at most `rows` rows for the update (--update_rows; 0: one
        pass): each part keeps its rows' tensors and the micro-batch's normaliser, so the parts'
        losses add up to the whole's."""
        total = len(self.completion)
        if not rows or rows >= total:
            return [self]
        per_row = ("prompt", "prompt_mask", "completion", "mask", "truncated", "loss_mask", "advantages")
        per_row += ("old_logprobs", "reference_logprobs")
        return [
            dataclasses.replace(
                self,
                **{
                    name: getattr(self, name)[start : start + rows]
                    for name in per_row
                    if getattr(self, name) is not None
                },
            )
            for start in range(0, total, rows)
        ]


# ---------------------------------------------------------------------------------- roll out, score
def generate(accelerator, model, tokenizer, prompt_ids: list[list[int]], args, keys=None) -> Completions:
    """Completions of the prompts as --decode says (generation.py): sampled with keyed draws (one
    key per row) at --temperature and the sampling flags when `keys` are given, else greedy."""
    return generation.generate(
        accelerator,
        model,
        tokenizer,
        prompt_ids,
        args.max_new_tokens,
        args.decode,
        keys,
        Sampling.of(args),
        args.gather_for_generation,
    )


def roll_out(
    accelerator, model, tokenizer, rows: list[dict], indices: torch.Tensor, epoch: int, args
) -> Rollout:
    """One micro-batch of rollouts: --num_generations sampled completions of each prompt (rows
    prompt-major)."""
    started = time.perf_counter()
    generations = args.num_generations
    prompts = [rows[i]["prompt_ids"] for i in indices.tolist() for _ in range(generations)]
    keys = sampling_keys(args.seed, epoch, indices.to(accelerator.device), generations)
    completions = generate(accelerator, model, tokenizer, prompts, args, keys)
    return Rollout(
        **vars(completions),
        indices=indices.tolist(),
        texts=completions.texts(tokenizer),
        # generate reads EOS flags: already synchronised
        generation_seconds=time.perf_counter() - started,
    )


def score(rewards: Rewards, rows: list[dict], rollout: Rollout, generations: int) -> None:
    """The rewards of a micro-batch's completions, per function and weighted, into `rollout` (host
    lists)."""
    picked = [rows[i] for i in rollout.indices for _ in range(generations)]
    ids = [row[:n] for row, n in zip(rollout.completion.tolist(), rollout.mask.sum(dim=1).tolist())]
    texts, cut = rollout.texts, rollout.truncated.tolist()
    rollout.per_function, rollout.rewards = score_texts(rewards, picked, texts, cut, ids)


# ------------------------------------------------------------------------------------------ figures
# What rollout_steps computes of each micro-batch's
# rewards (reward_figures), besides each reward's mean.
REWARD_FIGURES = ("reward", "reward_std", "reward_std_in_group", "frac_reward_zero_std", "accuracy", "solved")
REWARD_FIGURES += ("completion_length", "truncated")


def figure_names(rewards: Rewards) -> tuple[str, ...]:
    """What each update logs as train/<name>, averaged over micro-batches and processes between log
    steps."""
    return ("loss", *REWARD_FIGURES, "clip_fraction", "kl", *[f"reward_{name}" for name in rewards.names])


def reward_figures(rollout: Rollout, spread: dict, names: tuple[str, ...]) -> dict[str, float]:
    """A micro-batch's REWARD_FIGURES by name, and each reward's mean (over the completions it
    applies to) as reward_<name> (`names`: the rewards')."""
    rewards, first = rollout.rewards, rollout.per_function[0]
    generations = len(rewards) // len(rollout.indices)
    correct = [is_correct(v) for v in first]
    solved = [any(correct[i : i + generations]) for i in range(0, len(correct), generations)]
    lengths = rollout.mask.sum(dim=1).tolist()
    figures = dict(
        reward=mean_scored(rewards),
        **spread,  # reward_std, reward_std_in_group, frac_reward_zero_std
        accuracy=sum(correct) / len(correct),
        solved=sum(solved) / len(solved),
        completion_length=sum(lengths) / len(lengths),
        truncated=sum(rollout.truncated.tolist()) / len(lengths),
    )
    return figures | {f"reward_{name}": mean_scored(v) for name, v in zip(names, rollout.per_function)}


def in_order(names: tuple[str, ...], on_device: dict, on_host: dict) -> torch.Tensor:
    """One micro-batch's figures as RunState adds them, in the order of `names`: the device's
    tensors stay there (no read), the host's numbers go over in one copy."""
    device = next(iter(on_device.values())).device
    host = [0.0 if name in on_device else on_host[name] for name in names]
    host = torch.tensor(host, dtype=torch.float32).to(device)
    return torch.stack(
        [on_device[name].float() if name in on_device else host[i] for i, name in enumerate(names)]
    )


def log_samples(accelerator, output: Path, state, rows: list[dict], rollout: Rollout, tracking) -> None:
    """A few of this step's completions with their rewards, to samples.jsonl and the tracker (main
    process)."""
    generations = len(rollout.rewards) // len(rollout.indices)
    samples = [
        {
            "step": state.step,
            "prompt": str(rows[rollout.indices[i // generations]]["messages"][-1]["content"]),
            "answer": rollout.texts[i],
            "reference": str(rows[rollout.indices[i // generations]].get("answer", "")),
            "reward": rollout.rewards[i],
        }
        for i in range(min(SAMPLES_KEPT, len(rollout.texts)))
    ]
    write_samples(accelerator, output, state.epoch + 1, state.step, samples, tracking)


class Throughput:
    """Tokens per second of generation and of the updates, apart (every process's tokens over the
    main process's time): completion tokens over the time in generate, and prompt + completion
    tokens over the time from an optimizer step's first forward pass to its end. The first optimizer
    step of a run is the warm-up, reported apart in seconds: it compiles the decode step (--decode
    compiled) and fills the allocator's caches; the rates are those of the steps after it (of the
    first when there is no other). The end waits for the device once per step, which costs nothing
    here: the next rollouts' generation waits for it anyway."""

    def __init__(self, accelerator):
        self.accelerator, self.device = accelerator, accelerator.device
        # tokens and seconds of the first step, then of the others
        self.generation = [0, 0.0, 0, 0.0]
        self.update = [0, 0.0, 0, 0.0]
        self.update_start: float | None = None
        self.pending_tokens = 0

    @staticmethod
    def _add(figures: list, tokens: int, seconds: float) -> None:
        first = figures[1] == 0.0
        figures[0 if first else 2] += tokens
        figures[1 if first else 3] += seconds

    def generated(self, tokens: int, seconds: float) -> None:
        self._add(self.generation, tokens, max(seconds, 1e-9))

    def update_started(self) -> None:
        if self.update_start is None:
            self.update_start = time.perf_counter()

    def trained(self, tokens: int) -> None:
        self.pending_tokens += tokens

    def update_ended(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._add(self.update, self.pending_tokens, max(time.perf_counter() - self.update_start, 1e-9))
        self.update_start, self.pending_tokens = None, 0

    def rates(self) -> dict:
        """Collective: the token counts are summed over the processes."""
        counts = torch.tensor(
            self.generation[::2] + self.update[::2], dtype=torch.float64, device=self.device
        )
        first_generated, generated, first_trained, trained = self.accelerator.reduce(counts, "sum").tolist()

        def steady(first_tokens, tokens, figures):
            return tokens / figures[3] if figures[3] else first_tokens / max(figures[1], 1e-9)

        return {
            "generation_tokens_per_second": steady(first_generated, generated, self.generation),
            "train_tokens_per_second": steady(first_trained, trained, self.update),
            # the decode step's compilation included
            "first_step_generation_seconds": self.generation[1],
            "first_step_update_seconds": self.update[1],
        }
