"""DPO's maths on preference pairs (recipes/dpo.py; the pairs themselves are in
preference_pairs.py): each answer's log-probability under a model, a pair's loss and the figures a
user watches of it, and --precompute_ref's reference log-probabilities, computed once and carried
by the checkpoints.
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object, send_to_device

from accelerate_recipes import RecipeError
from accelerate_recipes.checkpoints import read_progress

from .model import token_logprobs
from .packed_attention import PACKED_KWARGS


# -------------------------------------------------------------------------------- log-probabilities
def answer_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(each answer's log-probability, summed over its tokens; its answer tokens): chosen answers
    first, then the rejected ones. Only the answers' positions get logits: the last columns of a
    padded batch, or in a packed row (--packing) the positions answer_index names, laid out as a
    padded batch's."""
    answer_mask = batch["answer_mask"]
    if "position_ids" in batch:  # packed: one row, positions restarting per sequence, no mask
        # where the sequences start, for the attention
        packed = {key: batch[key] for key in PACKED_KWARGS}
        # the positions that predict each answer token
        row, at = batch["input_ids"], batch["answer_index"]
        logprobs = token_logprobs(model, row, None, row[0, at + 1], batch["position_ids"], at=at, **packed)
    else:
        positions = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)  # left padding skipped
        targets = batch["input_ids"][:, -answer_mask.shape[1] :]
        logprobs = token_logprobs(model, batch["input_ids"], batch["attention_mask"], targets, positions)
    return (logprobs * answer_mask).sum(dim=1), answer_mask.sum(dim=1)


# --------------------------------------------------------------------------------------------- loss
def pair_figures(policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, args) -> dict:
    """Each pair's loss and the figures a user watches (dpo.py's FIGURES), as tensors of one value
    per pair, from the rows' summed answer log-probabilities under the policy and the reference
    (chosen rows first) and their token counts."""
    pairs = len(policy) // 2
    # IPO compares mean token log-probabilities (as TRL), so length does not count
    if args.loss_type == "ipo":
        policy, reference = policy / tokens, reference / tokens
    chosen, rejected = policy[:pairs], policy[pairs:]
    chosen_reward = args.beta * (chosen - reference[:pairs]).detach()
    rejected_reward = args.beta * (rejected - reference[pairs:]).detach()
    margin = (chosen - reference[:pairs]) - (rejected - reference[pairs:])
    if args.loss_type == "sigmoid":
        smoothing = args.label_smoothing
        loss = -(1 - smoothing) * F.logsigmoid(args.beta * margin) - smoothing * F.logsigmoid(
            -args.beta * margin
        )
    elif args.loss_type == "ipo":
        loss = (margin - 1 / (2 * args.beta)) ** 2
    else:  # hinge
        loss = torch.relu(1 - args.beta * margin)
    mean_nll = -chosen / tokens[:pairs] if args.loss_type != "ipo" else -chosen
    if args.sft_weight:
        loss = loss + args.sft_weight * mean_nll
    logps_chosen, logps_rejected = policy[:pairs].detach(), policy[pairs:].detach()
    return dict(
        loss=loss,
        rewards_chosen=chosen_reward,
        rewards_rejected=rejected_reward,
        reward_margin=chosen_reward - rejected_reward,
        reward_accuracy=(chosen_reward > rejected_reward).float(),
        logps_chosen=logps_chosen,
        logps_rejected=logps_rejected,
        logp_accuracy=(logps_chosen > logps_rejected).float(),
        nll_chosen=mean_nll.detach(),
    )


# --------------------------------------------------------------------------------- stored reference
class StoredReference:
    """--precompute_ref: the reference's answer log-probabilities of every pair (chosen, rejected),
    by split and index, computed once before training by the model itself (the reference is the
    policy the run starts from), and saved with each checkpoint
    (accelerator.register_for_checkpointing), so a resumed run reads the same ones."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}  # per split: [pairs, 2], chosen and rejected

    def lookup(self, split: str, index: torch.Tensor) -> torch.Tensor:
        values = self.values[split][index.cpu()]
        return torch.cat([values[:, 0], values[:, 1]])  # the rows' order: chosen answers first

    @torch.no_grad()
    def compute(self, accelerator, model, splits: dict, collate, batch_size: int) -> float:
        """Every pair of every split, each process answering an equal share of batches (a sharded
        model's forward passes are collective), gathered; returns the seconds it took."""
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        world = accelerator.num_processes
        for split, pairs in splits.items():
            share = math.ceil(math.ceil(len(pairs) / world) / batch_size) * batch_size
            order = list(range(len(pairs)))
            # equal shares; the repeats agree
            padded = order + order[-1:] * (share * world - len(order))
            found = []
            with accelerator.split_between_processes(padded) as mine:
                for start in range(0, len(mine), batch_size):
                    batch = send_to_device(
                        collate([pairs[i] for i in mine[start : start + batch_size]]), model.device
                    )
                    logprobs = answer_logprobs(model, batch)[0].float().cpu()
                    half = len(logprobs) // 2
                    found += zip(batch["index"].tolist(), logprobs[:half].tolist(), logprobs[half:].tolist())
            values = torch.zeros(len(pairs), 2)
            for index, chosen, rejected in gather_object(found):
                values[index] = torch.tensor([chosen, rejected])
            self.values[split] = values
        model.train(was_training)
        return time.perf_counter() - started

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def check_same_reference(folder, precompute_ref: bool) -> None:
    """A checkpoint holds the stored reference log-probabilities exactly when its run had
    --precompute_ref; resumed with the other setting, load_state would miss them or find one object
    too many."""
    saved = bool(read_progress(Path(folder)).get("config", {}).get("precompute_ref"))
    if saved != precompute_ref:
        given = "with" if saved else "without"
        raise RecipeError(
            f"checkpoint {folder} was written by a run {given} --precompute_ref; resume it {given} "
            "the flag, or start a new run in another --output_dir"
        )
