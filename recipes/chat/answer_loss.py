"""The chat recipe's loss over answer tokens, without the logits of the whole batch.

transformers' causal LMs compute logits for every position of a batch, in the compute dtype, and
their loss upcasts all of them to fp32; a prepared model's output conversion keeps one more fp32
copy. With a vocabulary of 150k tokens that is the largest tensor of a small model's step, and over
half of it belongs to prompt positions the loss ignores.

Here the model's forward pass, when it is given labels and the collator's `target_index` (the flat
positions whose next token is an answer token), runs the decoder, picks the hidden states of those
positions only, and computes the cross-entropy chunk by chunk, so at most one chunk of fp32 logits
exists at a time. The sum over answer tokens divided by `num_items_in_batch` is the loss
transformers computes (tested against it within fp32 rounding).

Each chunk's gradients are made in the forward pass too, as Liger Kernel's fused linear
cross-entropy makes them (the gradient of a summed cross-entropy is the softmax less the one-hot
target): with respect to the picked hidden states and, when the output layer trains, its weight; the
backward pass only scales them by the loss's gradient. The weight is read once, inside the model's
forward pass, where sharding wrappers hold it gathered (accelerate's FSDP2 puts it in one group with
the embeddings, gathered until the backward pass), and nothing needs it later. Calling the layer per
chunk under activation checkpointing instead, as this loss once did, fails under FSDP2 up to torch
2.13: it runs a group's forward hooks only when none of the group's modules is pending in the pass,
so the second chunk's call registered a hook that reshards the group once that chunk's gradient is
done, and the first chunk's recompute then met a sharded weight. DeepSpeed ZeRO-3 gathers a weight
only inside its module's own call: there, and for an output layer that is not a plain linear layer
(LoRA on it), the layer is still called per chunk, each chunk made again in the backward pass.

The same forward pass, given `logprob_targets` (the last tokens of each row) instead, returns those
tokens' log-probabilities at a temperature (GRPO's policy and reference, DPO's sequence scores) from
the same chunks: no [rows, tokens, vocabulary] fp32 tensor there either. Their gradient depends on a
loss the forward pass does not know, so the backward pass makes each chunk's logits again from the
hidden states and the weight it kept (accelerate's FSDP2 keeps the unit that holds the output layer,
the root or a tail unit of final norm and output layer, gathered from the forward pass to the end of
the backward pass; the layer itself is not called again, so no hook runs twice).

The chunk size is the module's CHUNK_LOGITS, read at each call (tests set it lower to get several
chunks). Everything else (generation, --predict, a forward pass without labels or targets) goes
through the model's own forward.
"""

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from .packed_attention import without_mask

# fp32 logits alive at once: 2**26 values (256 MB), 441 positions of a 151,936-token vocabulary
# (Qwen2.5) or 1,365 of SmolLM2's 49,152 per chunk.
CHUNK_LOGITS = 2**26
IGNORE_INDEX = -100  # the label torch's cross-entropy (and transformers' loss) skips


@dataclass
class AnswerLossOutput(ModelOutput):
    """What the forward pass returns with labels: the loss (the answer tokens' summed cross-entropy
    / their count, or / num_items_in_batch when given) and each answer token's cross-entropy, in
    `target_index` order (without a
    gradient: the loss carries it)."""

    loss: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None


@dataclass
class TokenLogprobsOutput(ModelOutput):
    """What the forward pass returns with `logprob_targets`: each target token's log-probability,
    [rows, targets]."""

    logprobs: torch.Tensor | None = None


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat positions (into labels.flatten()) whose next label is an answer token: the positions
    that predict one. Computed by the collator, on the host, so that the forward pass needs no host
    read to know their number."""
    predicts = torch.zeros_like(labels, dtype=torch.bool)
    predicts[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return predicts.flatten().nonzero().squeeze(1)


def _fused_chunks(
    hidden, weight, bias, targets, dtype, rows: int, hidden_grad=False, weight_grad=False, bias_grad=False
):
    """Per-token cross-entropy of `hidden @ weight.T + bias` against `targets`, `rows` positions at
    a time, with the matmuls in `dtype`, and the gradients of their sum that are asked for: (losses,
    d hidden, d weight, d bias), None where not asked."""
    losses = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if hidden_grad else None
    # summed in fp32 over the chunks, as autograd sums an fp32 weight's gradients
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
    grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias_grad else None
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here
        weight_c = weight.to(dtype)
        bias_c = None if bias is None else bias.to(dtype)
        for start in range(0, len(targets), rows):  # len(targets): a shape, known on the host
            chunk = hidden[start : start + rows].to(dtype)
            target = targets[start : start + rows]
            logits = F.linear(chunk, weight_c, bias_c).float()
            log_total = logits.logsumexp(dim=-1)
            ignored = target == IGNORE_INDEX
            picked = target.masked_fill(ignored, 0).unsqueeze(1)
            losses[start : start + rows] = (log_total - logits.gather(1, picked).squeeze(1)).masked_fill(
                ignored, 0
            )
            if not (hidden_grad or weight_grad or bias_grad):
                continue
            # the softmax, in the fp32 logits' memory
            grad_logits = logits.sub_(log_total.unsqueeze(1)).exp_()
            grad_logits.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=grad_logits.dtype))
            grad_logits = grad_logits.masked_fill_(ignored.unsqueeze(1), 0).to(dtype)
            if hidden_grad:
                grad_hidden[start : start + rows] = grad_logits @ weight_c
            if weight_grad:
                grad_weight += grad_logits.t() @ chunk
            if bias_grad:
                grad_bias += grad_logits.sum(dim=0)
    grad_weight = grad_weight.to(weight.dtype) if weight_grad else None
    grad_bias = grad_bias.to(bias.dtype) if bias_grad else None
    return losses, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    """(summed loss, per-token losses) of the output layer's logits; the gradients are made in the
    forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, rows):
        losses, *grads = _fused_chunks(hidden, weight, bias, targets, dtype, rows, *ctx.needs_input_grad[:3])
        ctx.has_grad = [g is not None for g in grads]
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.mark_non_differentiable(losses)
        return losses.sum(), losses

    @staticmethod
    def backward(ctx, grad_loss, _grad_token_losses):
        # In place: a second backward pass through the same
        # graph then fails on the saved tensors' version.
        saved = iter(ctx.saved_tensors)
        grads = [next(saved).mul_(grad_loss) if has else None for has in ctx.has_grad]
        return *grads, None, None, None


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits: autocast's when it is on (the output layer's call would cast to it),
    else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _chunk_losses(output_layer, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output_layer(hidden).float(), targets, reduction="none")


def _chunk_plan(output_layer) -> tuple[int, bool]:
    """(positions per chunk of logits, whether the output layer must be called per chunk): the layer
    is called per chunk when its weight exists only inside its own call (DeepSpeed ZeRO-3: an empty
    tensor outside it) or when it is more than a plain product (a LoRA-adapted one). Read at each
    call: tests lower CHUNK_LOGITS."""
    weight = output_layer.weight
    partitioned = hasattr(weight, "ds_id")
    vocab = weight.ds_shape[0] if partitioned else weight.shape[0]
    return max(1, CHUNK_LOGITS // vocab), partitioned or not isinstance(output_layer, torch.nn.Linear)


def _checkpointed(per_chunk, output_layer, picked: torch.Tensor, targets: torch.Tensor, rows: int, *extra):
    """per_chunk(output_layer, hidden, targets, *extra) on each chunk of rows, the output layer
    called once per chunk and each chunk's logits made again in the backward pass (see _chunk_plan
    for when)."""
    values = []
    for start in range(0, len(targets), rows):
        chunk = (output_layer, picked[start : start + rows], targets[start : start + rows], *extra)
        if torch.is_grad_enabled():
            values.append(checkpoint(per_chunk, *chunk, use_reentrant=False))
        else:
            values.append(per_chunk(*chunk))
    # No targets still gives a value that depends on the weights (0), as DDP expects.
    return torch.cat(values) if values else picked.sum(dim=1).float()


def answer_token_losses(
    output_layer, hidden: torch.Tensor, labels: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, every answer token's cross-entropy: fp32, in `index` order) from the decoder's
    last hidden states. The summed loss carries the gradient; the per-token losses carry none."""
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    targets = labels.reshape(-1).index_select(0, index + 1)  # the next token, in the same row
    rows, per_chunk_calls = _chunk_plan(output_layer)
    if per_chunk_calls:
        losses = _checkpointed(_chunk_losses, output_layer, picked, targets, rows)
        return losses.sum(), losses.detach()
    # The layer runs once per pass itself, on no rows: module hooks that wait for every module of a
    # group to run (FSDP2's up to torch 2.13; accelerate groups the output layer with the
    # embeddings) close the pass as usual.
    output_layer(picked[:0])
    # read after the call: FSDP2 registers the gathered weight while it is gathered
    weight = output_layer.weight
    inputs = (picked, weight, output_layer.bias, targets, _compute_dtype(picked, weight), rows)
    if not torch.is_grad_enabled():  # evaluation: the losses alone
        losses = _fused_chunks(*inputs)[0]
        return losses.sum(), losses
    # Without answer tokens the summed loss is still 0 with a gradient (of zeros) for the weights,
    # as DDP expects.
    return _LinearCrossEntropy.apply(*inputs)


def _chunk_logits(chunk, weight, bias, dtype, temperature: float) -> torch.Tensor:
    return F.linear(chunk.to(dtype), weight, bias).float() / temperature


class _LinearLogprobs(torch.autograd.Function):
    """Each target's log-probability under the output layer's logits / temperature, a chunk of rows
    at a time; the backward pass makes each chunk's logits again (from the kept hidden states and
    weight) for its gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, rows, temperature):
        logprobs = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        log_totals = torch.empty_like(logprobs)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here
            weight_c, bias_c = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, len(targets), rows):
                logits = _chunk_logits(hidden[start : start + rows], weight_c, bias_c, dtype, temperature)
                log_totals[start : start + rows] = logits.logsumexp(dim=-1)
                picked = logits.gather(1, targets[start : start + rows, None]).squeeze(1)
                logprobs[start : start + rows] = picked - log_totals[start : start + rows]
        ctx.save_for_backward(hidden, weight, bias, targets, log_totals)
        ctx.dtype, ctx.rows, ctx.temperature = dtype, rows, temperature
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        hidden, weight, bias, targets, log_totals = ctx.saved_tensors
        hidden_grad, weight_grad, bias_grad = ctx.needs_input_grad[:3]
        dtype, rows, temperature = ctx.dtype, ctx.rows, ctx.temperature
        grad_hidden = torch.empty_like(hidden) if hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c, bias_c = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, len(targets), rows):
                chunk = hidden[start : start + rows]
                logits = _chunk_logits(chunk, weight_c, bias_c, dtype, temperature)
                grad = grad_logprobs[start : start + rows, None].float()
                # d log p(target) / d logits = (one-hot(target) - softmax) / temperature
                grad_logits = logits.sub_(log_totals[start : start + rows, None]).exp_().mul_(-grad)
                grad_logits.scatter_add_(1, targets[start : start + rows, None], grad)
                grad_logits = grad_logits.div_(temperature).to(dtype)
                if hidden_grad:
                    grad_hidden[start : start + rows] = grad_logits @ weight_c
                if weight_grad:
                    grad_weight += grad_logits.t() @ chunk.to(dtype)
                if bias_grad:
                    grad_bias += grad_logits.sum(dim=0)
        grad_weight = grad_weight.to(weight.dtype) if weight_grad else None
        grad_bias = grad_bias.to(bias.dtype) if bias_grad else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _chunk_logprobs(
    output_layer, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits = output_layer(hidden).float() / temperature
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)


def target_logprobs(
    output_layer,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The log-probabilities of `targets` [rows, n], the tokens after the last n positions of
    `hidden` [rows, width, h], under the output layer's logits / temperature: fp32, [rows, n], at
    most one chunk of fp32 logits at a time. With `index` (flat positions into hidden's rows x
    width, any shape), `targets` of its shape are the tokens those positions predict: a packed row's
    answers, wherever they sit in it."""
    if index is None:
        picked = hidden[:, -targets.shape[1] - 1 : -1].reshape(-1, hidden.shape[-1])
    else:
        picked = hidden.reshape(-1, hidden.shape[-1])[index.reshape(-1)]
    flat = targets.reshape(-1)
    rows, per_chunk_calls = _chunk_plan(output_layer)
    if per_chunk_calls:
        return _checkpointed(_chunk_logprobs, output_layer, picked, flat, rows, temperature).reshape(
            targets.shape
        )
    # the layer's own call, on no rows: FSDP2's group hooks close the pass (see above)
    output_layer(picked[:0])
    weight = output_layer.weight
    inputs = (picked, weight, output_layer.bias, flat, _compute_dtype(picked, weight), rows, temperature)
    return _LinearLogprobs.apply(*inputs).reshape(targets.shape)


# Model types whose causal LM computes its logits as the output layer's plain product of the
# decoder's last hidden states (transformers 5): the loss here then equals theirs. Others (Gemma 2's
# soft-capping, Cohere's scale, ...) keep their own forward pass, and the loss is taken from their
# logits at the answer positions.
PLAIN_LOGITS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "olmo2", "starcoder2")


def use_answer_loss(model) -> bool:
    """Swap the causal LM's forward pass (under a peft adapter, its base model's) for one that,
    given labels and `target_index`, returns the answer tokens' losses (AnswerLossOutput), or given
    `logprob_targets` (and a `temperature`) those tokens' log-probabilities (TokenLogprobsOutput);
    without them it is the model's own. True when the logits are computed for the chosen positions
    only (a model type in PLAIN_LOGITS). A copy of the model (copy.deepcopy: a reference policy)
    runs its own weights: the swapped forward is a method of the model."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(causal_lm, "own_forward"):
        causal_lm.own_forward = causal_lm.forward
        causal_lm.forward = types.MethodType(_chunked_forward, causal_lm)
    return causal_lm.config.model_type in PLAIN_LOGITS


def _chunked_forward(
    self,
    *args,
    labels=None,
    target_index=None,
    num_items_in_batch=None,
    logprob_targets=None,
    logprob_index=None,
    temperature=1.0,
    **kw,
):
    """use_answer_loss's forward pass of a causal LM (`self`). A packed row under `varlen` gets no
    mask built."""
    if len(args) < 2:  # the mask is a keyword argument
        kw = without_mask(self.config, kw)
    if logprob_targets is None and (labels is None or target_index is None):
        return self.own_forward(*args, labels=labels, num_items_in_batch=num_items_in_batch, **kw)
    for unused in ("output_attentions", "output_hidden_states", "return_dict", "logits_to_keep"):
        kw.pop(unused, None)  # peft passes them on; the decoder's defaults are the ones meant
    plain = self.config.model_type in PLAIN_LOGITS
    if logprob_targets is not None:
        if plain:
            hidden = self.get_decoder()(*args, **kw).last_hidden_state
            head = self.get_output_embeddings()
            logprobs = target_logprobs(head, hidden, logprob_targets, temperature, logprob_index)
        else:
            # 0: every position's logits
            keep = 0 if logprob_index is not None else logprob_targets.shape[1] + 1
            logits = self.own_forward(*args, logits_to_keep=keep, **kw).logits
            if logprob_index is None:
                logits = logits[:, :-1]
            else:
                logits = logits.flatten(0, 1)[logprob_index]
            logits = logits.float() / temperature
            logprobs = logits.log_softmax(dim=-1).gather(-1, logprob_targets[..., None]).squeeze(-1)
        return TokenLogprobsOutput(logprobs=logprobs)
    if plain:
        hidden = self.get_decoder()(*args, **kw).last_hidden_state
        summed, token_losses = answer_token_losses(self.get_output_embeddings(), hidden, labels, target_index)
    else:
        logits = self.own_forward(*args, **kw).logits
        picked = logits.reshape(-1, logits.shape[-1]).index_select(0, target_index).float()
        token_losses = F.cross_entropy(
            picked, labels.reshape(-1).index_select(0, target_index + 1), reduction="none"
        )
        summed, token_losses = token_losses.sum(), token_losses.detach()
    count = max(len(target_index), 1) if num_items_in_batch is None else num_items_in_batch
    return AnswerLossOutput(loss=summed / count, token_losses=token_losses)
