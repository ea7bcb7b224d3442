"""Micro-batches of tokenised conversations: padded rows, or packed rows without padding
(position_ids restarting for each conversation, the cumulative lengths a variable-length kernel
reads), filled to a multiple of a row length when compiled, and rows of a token budget (best-fit
decreasing) for `--batch_tokens`."""

import bisect
import copy
from dataclasses import dataclass

import torch
import transformers
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from accelerate_recipes.errors import RecipeError

from .answer_loss import IGNORE_INDEX, target_index

# Attention implementations that keep packed examples apart when given restarting position_ids and
# no attention mask.
PACKING_ATTENTION = ("varlen", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def check_packing(model) -> None:
    """Packing puts a micro-batch's examples in one row with position_ids restarting at 0 for each;
    the attention implementations in PACKING_ATTENTION then keep each token's attention inside its
    own example. With sdpa/eager, transformers builds that mask only when the forward gets
    position_ids, no attention mask and no cache, so this also turns the model's cache off (training
    needs none)."""
    implementation = model.config._attn_implementation
    if implementation not in PACKING_ATTENTION:
        raise RecipeError(
            "--packing needs attention that keeps packed examples apart "
            f"({', '.join(PACKING_ATTENTION)}), and the model uses {implementation!r}; load it "
            "with one of those or drop --packing"
        )
    if not hasattr(transformers.masking_utils, "find_packed_sequence_indices"):
        raise RecipeError(
            f"transformers {transformers.__version__} cannot keep packed examples apart; upgrade "
            "it (pip install -U transformers) or drop --packing"
        )
    model.config.use_cache = False


@dataclass
class ChatCollator:
    """A transformers collator fed only input_ids and labels (the bookkeeping columns stay out of
    the batch), plus
    `target_index`: the flat positions that predict an answer token, which the loss computes logits
    for (answer_loss.py), found here on the host so that the GPU's forward pass waits for no
    count."""

    library_collator: object
    row_multiple: int | None = None  # packed rows: filled up to a multiple of this many tokens
    fill_id: int = 0
    # packed rows: the longest sequence the kernel is told of, at least (one_bound)
    longest: int | None = None

    def __call__(self, features: list) -> dict:
        # a row of conversations (token_budget_rows) comes as one feature holding them: they go in
        # one packed row
        features = [f for feature in features for f in (feature if isinstance(feature, list) else [feature])]
        batch = self.library_collator(
            [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        )
        if self.row_multiple:
            fill_packed_row(batch, self.row_multiple, self.fill_id)
        if self.longest and "max_length_q" in batch:
            one_bound(batch, max(self.longest, self.row_multiple or 0))
        batch["target_index"] = target_index(batch["labels"])
        return batch


def one_bound(batch: dict, bound: int) -> None:
    """Tell the variable-length kernel that a packed row's sequences are at most `bound` tokens long
    (the run's --max_length, or the filler's multiple if longer: more than any of them), not what
    its longest one is. The bound only sizes the kernel's grid (blocks past a sequence's end do
    nothing); compiled blocks take it as a constant, so one value for every row is one graph, where
    the longest of each row would compile again."""
    for key in ("max_length_q", "max_length_k"):
        batch[key] = max(batch[key], bound)


def fill_packed_row(batch: dict, multiple: int, fill_id: int) -> None:
    """Lengthen a packed row to a multiple of `multiple` tokens with one more sequence of `fill_id`
    tokens (its own positions from 0, no labels, its own span in the cumulative lengths): rows then
    take a few lengths in a run, and a compiled model compiles once per length rather than for every
    row. The filler attends only to itself, and no conversation's loss or attention changes."""
    length = batch["input_ids"].shape[1]
    extra = -length % multiple
    if not extra:
        return

    def extend(key, tail):
        batch[key] = torch.cat([batch[key], tail.to(batch[key].dtype).reshape(1, -1)], dim=1)

    extend("input_ids", torch.full((extra,), fill_id))
    extend("labels", torch.full((extra,), IGNORE_INDEX))
    extend("position_ids", torch.arange(extra))
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        batch[key] = torch.cat([batch[key], torch.tensor([length + extra], dtype=batch[key].dtype)])
    for key in ("max_length_q", "max_length_k"):
        batch[key] = max(batch[key], extra)


def collator(
    tokenizer, packing: bool, pad_to_multiple_of: int | None = None, longest: int | None = None
) -> ChatCollator:
    """Batches of tokenised examples. Padded: input_ids, attention_mask and labels padded on the
    right to the batch's longest example (labels with -100), its length rounded up to
    `pad_to_multiple_of`. Packed: the examples in one row without padding, position_ids restarting
    at 0 for each and the first label of each -100 (it would be predicted from the previous
    example); with `pad_to_multiple_of`, the row filled up to a multiple of it (fill_packed_row);
    with `longest` (the run's --max_length; for compiled blocks), that bound given for every row
    (one_bound)."""
    if packing:
        # The cumulative lengths (cu_seq_lens_q/k, max_length_q/k) feed a variable-length kernel
        # (packed_attention.py); other attention implementations ignore them.
        flattening = DataCollatorWithFlattening(
            return_position_ids=True, separator_id=IGNORE_INDEX, return_flash_attn_kwargs=True
        )
        fill_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return ChatCollator(flattening, pad_to_multiple_of, fill_id, longest)
    if tokenizer.pad_token is None:
        raise RecipeError(
            "the tokenizer has no pad token; call ensure_pad_token(tokenizer) before padding batches"
        )
    if tokenizer.padding_side != "right":
        # Training computes positions 0, 1, 2... from the left;
        # left padding would shift every padded example's.
        tokenizer = copy.copy(tokenizer)
        tokenizer.padding_side = "right"
    return ChatCollator(
        DataCollatorForSeq2Seq(
            tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=pad_to_multiple_of
        )
    )


# --------------------------------------------------------------------------- rows of a token budget
def token_budget_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """The conversations (their indices) grouped into rows of at most `budget` tokens, best-fit
    decreasing (the packing TRL's SFTTrainer does too): the longest first, each into the row it
    fills most tightly, a new row when none has room. Rows fill to within a few tokens of the budget
    when conversations are much shorter than it."""
    if lengths and max(lengths) > budget:
        raise RecipeError(
            f"a conversation of {max(lengths)} tokens does not fit in a row of --batch_tokens "
            f"{budget}; raise --batch_tokens to --max_length or more"
        )
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # the row with the least room that still fits it
        at = bisect.bisect_left(free, (lengths[index], -1))
        if at == len(free):
            rows.append([index])
            bisect.insort(free, (budget - lengths[index], len(rows) - 1))
        else:
            room, row = free.pop(at)
            rows[row].append(index)
            bisect.insort(free, (room - lengths[index], row))
    return [sorted(row) for row in rows]


class PackedRows(torch.utils.data.Dataset):
    """A training set seen as rows of conversations (token_budget_rows): item i is the list of row
    i's examples, which the packing collator puts in one row. The rows are made once; a shuffled
    loader draws them in a new order each epoch."""

    def __init__(self, examples, rows: list[list[int]]):
        self.examples, self.rows = examples, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[dict]:
        return [self.examples[i] for i in self.rows[index]]
