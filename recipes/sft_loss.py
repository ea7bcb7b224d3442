"""The chat recipe's loss over answer tokens, without the logits of the whole batch.

transformers' causal LMs compute logits for every position of a batch, in the compute dtype, and their loss upcasts
all of them to fp32; a prepared model's output conversion keeps one more fp32 copy. With a vocabulary of 150k tokens
that is the largest tensor of a small model's step, and over half of it belongs to prompt positions the loss ignores.

Here the model's forward pass, when it is given labels and the collator's `target_index` (the flat positions whose
next token is an answer token), runs the decoder, picks the hidden states of those positions only, and computes the
cross-entropy chunk by chunk: each chunk's logits are made, upcast and reduced, then dropped, and made again in the
backward pass (activation checkpointing), so at most one chunk of fp32 logits exists at a time. The sum over answer
tokens divided by `num_items_in_batch` is the loss transformers computes (tested against it within fp32 rounding).
The swap happens inside the model's own forward, so FSDP2 and DeepSpeed ZeRO-3 gather the output layer as usual.
Everything else (generation, --predict, a forward pass without labels) goes through the model's own forward.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

# fp32 logits alive at once: 2**26 values (256 MB), 441 positions of a 151,936-token vocabulary (Qwen2.5) or 1,365 of
# SmolLM2's 49,152 per chunk.
CHUNK_LOGITS = 2**26
IGNORE_INDEX = -100  # the label torch's cross-entropy (and transformers' loss) skips


@dataclass
class AnswerLossOutput(ModelOutput):
    """What the forward pass returns with labels: the loss (the answer tokens' summed cross-entropy / their count, or
    / num_items_in_batch when given) and each answer token's cross-entropy, in `target_index` order."""

    loss: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat positions (into labels.flatten()) whose next label is an answer token: the positions that predict one.
    Computed by the collator, on the host, so that the forward pass needs no host read to know their number."""
    predicts = torch.zeros_like(labels, dtype=torch.bool)
    predicts[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return predicts.flatten().nonzero().squeeze(1)


def _chunk_losses(output_layer, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output_layer(hidden).float(), targets, reduction="none")


def answer_token_losses(output_layer, hidden: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of every answer token (fp32, in `index` order) from the decoder's last hidden states."""
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    targets = labels.reshape(-1).index_select(0, index + 1)  # the next token, in the same row
    rows = max(1, CHUNK_LOGITS // output_layer.weight.shape[0])
    losses = []
    for start in range(0, len(index), rows):  # len(index): a shape, known on the host
        chunk = (output_layer, picked[start : start + rows], targets[start : start + rows])
        if torch.is_grad_enabled():
            losses.append(checkpoint(_chunk_losses, *chunk, use_reentrant=False))
        else:
            losses.append(_chunk_losses(*chunk))
    # A micro-batch without answer tokens still gives a loss that depends on the weights (0), as DDP expects.
    return torch.cat(losses) if losses else picked.sum(dim=1).float()


# Model types whose causal LM computes its logits as the output layer's plain product of the decoder's last hidden
# states (transformers 5): the loss here then equals theirs. Others (Gemma 2's soft-capping, Cohere's scale, ...)
# keep their own forward pass, and the loss is taken from their logits at the answer positions.
PLAIN_LOGITS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "olmo2", "starcoder2")


def use_answer_loss(model) -> bool:
    """Swap the causal LM's forward pass (under a peft adapter, its base model's) for one that, given labels and
    `target_index`, returns the answer tokens' losses (AnswerLossOutput); without them it is the model's own. True
    when the logits are computed for the answer positions only (a model type in PLAIN_LOGITS)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    plain = causal_lm.config.model_type in PLAIN_LOGITS
    own_forward = causal_lm.forward
    decoder, output_layer = causal_lm.get_decoder(), causal_lm.get_output_embeddings()

    def forward(*args, labels=None, target_index=None, num_items_in_batch=None, **kwargs):
        if labels is None or target_index is None:
            return own_forward(*args, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
        for unused in ("output_attentions", "output_hidden_states", "return_dict", "logits_to_keep"):
            kwargs.pop(unused, None)  # peft passes them on; the decoder's defaults are the ones meant
        if plain:
            hidden = decoder(*args, **kwargs).last_hidden_state
            token_losses = answer_token_losses(output_layer, hidden, labels, target_index)
        else:
            logits = own_forward(*args, **kwargs).logits
            picked = logits.reshape(-1, logits.shape[-1]).index_select(0, target_index).float()
            token_losses = F.cross_entropy(
                picked, labels.reshape(-1).index_select(0, target_index + 1), reduction="none"
            )
        count = max(len(target_index), 1) if num_items_in_batch is None else num_items_in_batch
        return AnswerLossOutput(loss=token_losses.sum() / count, token_losses=token_losses)

    causal_lm.forward = forward
    return plain
