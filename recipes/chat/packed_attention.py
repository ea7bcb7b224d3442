"""Attention for packed rows through a variable-length kernel, not a dense mask (sft.py --packing).

A packed row holds a micro-batch's conversations one after another, positions restarting at 0 for
each. With sdpa, transformers keeps them apart with a [T x T] block-diagonal mask over the whole
row: attention then costs T^2 per head instead of the sum of each conversation's length squared (16
conversations of ~450 tokens: about 16x the useful work), the mask rules out the flash kernel, and
grouped-query models get their keys and values repeated per head.

`varlen` (VARLEN) is registered with transformers' AttentionInterface. A forward pass that carries
the collator's cumulative conversation lengths (`cu_seq_lens_q`, `max_length_q`:
DataCollatorWithFlattening's flash-attention kwargs) attends within each conversation: on a GPU
through torch's variable-length flash kernel (torch.nn.attention.varlen, torch 2.10+, bf16/fp16,
Ampere or newer), elsewhere conversation by conversation with sdpa. A forward pass without them
(padded evaluation batches, generation) is plain sdpa with its mask, so a model loaded with `varlen`
evaluates and generates as with sdpa.

A packed row's forward pass asks transformers for no mask (without_mask): given position_ids and no
mask, transformers would otherwise look for packed sequences in the positions, read on the host
whether it found any (a wait for the GPU in every forward pass), and build a [1, 1, T, T]
block-diagonal mask that the kernel never reads (1 GiB at 32k tokens).
"""

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN = "varlen"
# What a packed batch hands the attention beside its row (DataCollatorWithFlattening's
# flash-attention kwargs): the cumulative sequence lengths and the longest sequence, passed on to
# the model's forward pass.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.10
    varlen_attn = None

# The kernel's keywords changed between torch releases: 2.10 takes is_causal; later ones express
# causality as a window (-1, 0) and add scale and enable_gqa.
KERNEL_KEYWORDS = set(inspect.signature(varlen_attn).parameters) if varlen_attn else set()
# what the kernel computes in; fp32 goes conversation by conversation
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def kernel_runs_on(device) -> bool:
    """torch's variable-length flash kernel exists and runs on `device` (CUDA, compute capability
    8.0 or newer)."""
    device = torch.device(device)
    if varlen_attn is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def choose_attention(requested: str | None, packing: bool, accelerator) -> str | None:
    """The attention implementation to load the model with: `requested` when given; `varlen` for
    packed rows on a GPU that runs the kernel in bf16/fp16 (the accelerator's device and mixed
    precision); otherwise None (transformers' default, sdpa). Registers `varlen` when it is the
    answer."""
    choice = requested
    half = accelerator.mixed_precision in ("bf16", "fp16")
    if requested is None and packing and half and kernel_runs_on(accelerator.device):
        choice = VARLEN
    if choice == VARLEN:
        register()
    return choice


def without_mask(config, kwargs: dict) -> dict:
    """The keyword arguments of a forward pass through the decoder, given a packed row's cumulative
    lengths under `varlen`, with an attention mask that asks transformers for none: it takes a 4-D
    mask as made already and passes it on as it is, and varlen_attention reads the lengths instead.
    Anything else (padded rows, another attention, a model with sliding-window layers, whose layers
    take sdpa's mask) as given."""
    if config._attn_implementation != VARLEN or kwargs.get("cu_seq_lens_q") is None:
        return kwargs
    if kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
        return kwargs
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in layer_types:
        return kwargs
    return dict(kwargs, attention_mask=kwargs["cu_seq_lens_q"].new_empty((1, 1, 0, 0), dtype=torch.bool))


def is_no_mask(attention_mask) -> bool:
    """Whether `attention_mask` is without_mask's: a 4-D mask without elements."""
    return (
        isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4 and attention_mask.numel() == 0
    )


def register() -> None:
    """Make `varlen` a name transformers loads models with. Its masks are sdpa's (looked up at each
    call, so that a replaced sdpa builder, such as accelerate_recipes.always_build_attention_masks,
    serves it too)."""
    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(
        VARLEN, lambda *args, **kwargs: AttentionMaskInterface()["sdpa"](*args, **kwargs)
    )


def varlen_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, heads, T, head_dim], key and value [1, kv_heads,
    T, head_dim]; returns [1, T, heads, head_dim]. With `cu_seq_lens_q` each conversation attends to
    itself only, causally."""
    # A padded batch or generation, or a sliding-window layer (Mistral, Gemma): sdpa with the mask
    # transformers built, packed rows' boundaries included.
    if cu_seq_lens_q is None or kwargs.get("sliding_window") is not None:
        if is_no_mask(attention_mask):
            raise ValueError(
                "a layer that needs a mask (no cu_seq_lens_q, or a sliding window) got without_mask's"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"packed rows come one per batch; got a batch of {query.shape[0]} rows with cu_seq_lens_q"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if torch.is_autocast_enabled(query.device.type):
        # as autocast casts sdpa's inputs: in a full fine-tune RoPE leaves q and k in fp32 (fp32
        # cos/sin), v in bf16
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    fast = query.dtype in KERNEL_DTYPES and dropout == 0.0 and kernel_runs_on(query.device)
    if fast:
        return flash_varlen(query, key, value, cu_seq_lens_q, max_length_q, scale).unsqueeze(0), None
    return per_conversation(query, key, value, cu_seq_lens_q, scale, dropout), None


def flash_varlen(query, key, value, cu_seq_lens, max_length: int, scale: float) -> torch.Tensor:
    """torch's variable-length flash kernel on [T, heads, head_dim] tensors (contiguous, as the
    kernel reads them)."""
    query, key, value = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    options = {}
    if "is_causal" in KERNEL_KEYWORDS:
        options["is_causal"] = True
    else:
        options["window_size"] = (-1, 0)
    if "scale" in KERNEL_KEYWORDS:
        options["scale"] = scale
    # the kernel scales by 1/sqrt(head_dim): fold the difference into q
    elif scale != query.shape[-1] ** -0.5:
        query = query * (scale * query.shape[-1] ** 0.5)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and "enable_gqa" in KERNEL_KEYWORDS:
        options["enable_gqa"] = True
    elif groups > 1:  # a kernel without grouped-query support: one key/value head per query head
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu_seq_lens = cu_seq_lens.to(torch.int32)
    return varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **options)


# a loop over the row's boundaries: compiled, every new set of boundaries would compile again
@torch.compiler.disable
def per_conversation(query, key, value, cu_seq_lens, scale: float, dropout: float) -> torch.Tensor:
    """Causal sdpa over each conversation's slice of the row (the CPU's path, and fp32 on a GPU).
    The boundaries are read on the host, which on the CPU waits for nothing."""
    bounds = cu_seq_lens.tolist()
    if bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q ends at {bounds[-1]}, the packed row has {query.shape[2]} tokens")
    grouped = query.shape[1] != key.shape[1]
    pieces = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=grouped,
        )
        for start, end in zip(bounds, bounds[1:])
        if end > start
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous()
