"""Learning-rate schedules over optimizer steps: a linear warmup, then a linear or a cosine decay.

    schedule = warmup_schedule(optimizer, "cosine", warmup_steps, total_steps)
    scheduler = accelerator.prepare(schedule)

The factors are those of transformers' get_scheduler ("linear", "cosine", and "cosine" with
final_lr_ratio for its "cosine_with_min_lr"; tests/test_units.py holds them equal step by step),
as a torch LambdaLR that saves and resumes the same way. The recipes that need nothing else from
transformers (cifar, the detector) take them from here: importing transformers' optimization module
loads the Trainer's helpers and peft, about a second at every start of a process.
"""

import functools
import math
from typing import Literal

import torch

Decay = Literal["cosine", "linear"]


def lr_factor(
    step: int, *, decay: Decay, warmup_steps: int, total_steps: int, final_lr_ratio: float
) -> float:
    """The learning rate at optimizer step `step` as a fraction of the peak: from 0 to 1 over
    `warmup_steps`, then down to `final_lr_ratio` (cosine) or to 0 (linear) at `total_steps`."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if decay == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, factor * (1 - final_lr_ratio) + final_lr_ratio)


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    decay: Decay,
    warmup_steps: int,
    total_steps: int,
    final_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_steps`, then `decay` ("cosine": to lr x `final_lr_ratio`;
    "linear": to zero) at `total_steps`; step it once per optimizer step."""
    factor = functools.partial(
        lr_factor,
        decay=decay,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        final_lr_ratio=final_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
