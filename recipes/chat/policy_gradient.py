"""The maths around GRPO's policy-gradient step (recipes/grpo.py), which the recipe's loop calls:
the spread of rewards that may be missing (nan_std, for the advantages), the completion tokens'
log-probabilities under the policy and under the reference, what a step's summed losses are divided
by, and a micro-batch's update taken in passes of --update_rows.

The advantages and the clipped loss itself are the recipe's story and stay in grpo.py.
"""

import contextlib

import torch
from accelerate.utils import DistributedType

from accelerate_recipes import RecipeError

from .generation import Completions
from .model import reference_model
from .model import token_logprobs as target_logprobs
from .rollouts import Rollout


# --------------------------------------------------------------------------------------- advantages
def nan_std(values: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """The sample standard deviation of the values that are not NaN (0 with fewer than two)."""
    seen = ~values.isnan()
    count = seen.sum(dim=dim, keepdim=True) if dim is not None else seen.sum()
    mean = values.nansum(dim=dim, keepdim=True) / count.clamp(min=1) if dim is not None else values.nanmean()
    squares = torch.where(seen, (values - mean) ** 2, 0.0).sum(
        dim=dim, keepdim=True if dim is not None else False
    )
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


# -------------------------------------------------------------------------------- log-probabilities
def token_logprobs(model, rollout: Completions, temperature: float) -> torch.Tensor:
    """Log-probabilities of the completion tokens under `model` (at the sampling temperature); only
    the completion's positions get logits."""
    input_ids = torch.cat([rollout.prompt, rollout.completion], dim=1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.mask], dim=1)
    # as generate numbered them, left padding skipped
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return target_logprobs(model, input_ids, attention_mask, rollout.completion, positions, temperature)


# --------------------------------------------------------------------------------------- the update
def check_update_rows(accelerator, update_rows: int, rows: int) -> None:
    """--update_rows below a micro-batch's rows needs several backward passes per micro-step, which
    DeepSpeed's engine would count as micro-steps of their own."""
    if 0 < update_rows < rows and accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise RecipeError(
            f"--update_rows {update_rows} splits each micro-batch's update into several backward "
            "passes, which DeepSpeed's engine counts as micro-steps; under DeepSpeed raise "
            "--gradient_accumulation_steps instead"
        )


class UpdatePasses:
    """A micro-batch's update as passes of at most `rows` completions (--update_rows; 0: one pass).
    Iterating gives the parts, every one but the last under accelerator.no_sync when the micro-step
    syncs (its gradients stay local and the last pass's backward all-reduces them all); add() sums
    each pass's loss and weighs its clip fraction and KL by its share of the loss's tokens, into
    `figures`."""

    def __init__(self, accelerator, model, rollout: Rollout, rows: int):
        self.accelerator, self.model, self.rollout = accelerator, model, rollout
        self.parts = rollout.parts(rows)
        self.figures = dict(loss=0.0, clip_fraction=0.0, kl=0.0)

    def __iter__(self):
        for i, part in enumerate(self.parts):
            later = i < len(self.parts) - 1 and self.accelerator.sync_gradients
            with self.accelerator.no_sync(self.model) if later else contextlib.nullcontext():
                yield part

    def add(self, part: Rollout, loss, clip_fraction, kl) -> None:
        share = part.loss_mask.sum() / self.rollout.loss_mask.sum().clamp(min=1)
        self.figures["loss"] = self.figures["loss"] + loss
        self.figures["clip_fraction"] = self.figures["clip_fraction"] + clip_fraction * share
        self.figures["kl"] = self.figures["kl"] + kl * share


def loss_normaliser(accelerator, rollouts: list[Rollout], args):
    """What a step's summed losses are divided by, the same on every process: its completion tokens
    (dapo) or completions (grpo, dr_grpo x --max_new_tokens) over the whole global batch, counted
    before the forward pass."""
    if args.loss_type == "dapo":
        tokens = sum(r.loss_mask.sum() for r in rollouts)
        return accelerator.reduce(tokens.float(), reduction="sum").clamp(min=1)
    completions = args.batch_size * args.num_generations
    return completions * (args.max_new_tokens if args.loss_type == "dr_grpo" else 1)


@torch.no_grad()
def reference_token_logprobs(model, reference, rollout: Completions, args, accelerator):
    """The reference policy's log-probabilities of the completion tokens
    (chat.model.reference_policy); None with --beta 0. Computed once per batch of rollouts, before
    its first update."""
    if reference is None:
        return None
    with reference_model(accelerator, model, reference) as policy:
        return token_logprobs(policy, rollout, args.temperature)
