"""torch's variable-length attention kernel (torch.nn.attention.varlen: CUDA, bf16/fp16) stood in
for on the CPU, so that the tests run the path a GPU takes through chat/packed_attention.py
(flash_varlen) in fp32.

The stand-in is a custom op, as the real kernel is: a compiled block sees it as one operation whose
lengths are plain integers (and compiles again when an integer it was compiled for changes, as with
the real one). It computes what the kernel's documented contract says, causal attention within each
sequence of the packed row, with sdpa under a block-diagonal mask built on the device from the
cumulative lengths: no value is read on the host.

    with use_stand_in(monkeypatch):  # packed_attention calls the stand-in, in fp32 too
        ...
"""

import contextlib

import torch
import torch.nn.functional as F


def attend(query, key, value, cu_seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """[T, heads, head_dim] in and out: each token attends to the tokens of its own sequence up to
    itself."""
    tokens = torch.arange(query.shape[0], device=query.device)
    # which sequence each token is in
    sequence = torch.searchsorted(cu_seq_lens[1:], tokens, right=True)
    allowed = (sequence[:, None] == sequence[None, :]) & (tokens[:, None] >= tokens[None, :])
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))
    grouped = k.shape[0] != q.shape[0]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=grouped)
    return out.transpose(0, 1).contiguous()


@torch.library.custom_op("recipes_tests::varlen_attn", mutates_args=())
def varlen_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    assert cu_seq_q.dtype == torch.int32 and max_q == max_k
    return attend(query, key, value, cu_seq_q, scale)


@varlen_op.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale):
    return torch.empty_like(query)


def _keep_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.scale = inputs[7]


def _gradients(ctx, grad):
    query, key, value, cu_seq_q = ctx.saved_tensors
    with torch.enable_grad():
        query, key, value = (x.detach().requires_grad_() for x in (query, key, value))
        out = attend(query, key, value, cu_seq_q, ctx.scale)
        return *torch.autograd.grad(out, (query, key, value), grad), None, None, None, None, None


varlen_op.register_autograd(_gradients, setup_context=_keep_inputs)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
    """The kernel's call as flash_varlen makes it on any torch release (is_causal, or a (-1, 0)
    window; scale; enable_gqa): causal attention only."""
    assert options.get("is_causal") or options.get("window_size") == (-1, 0), options
    scale = options.get("scale") or query.shape[-1] ** -0.5
    return varlen_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)


@contextlib.contextmanager
def use_stand_in(monkeypatch):
    """packed_attention's fast path on this machine: the stand-in as the kernel, run on any device
    and in fp32."""
    from chat import packed_attention

    with monkeypatch.context() as patch:
        patch.setattr(packed_attention, "varlen_attn", varlen_attn)
        patch.setattr(packed_attention, "kernel_runs_on", lambda device: True)
        patch.setattr(packed_attention, "KERNEL_DTYPES", (*packed_attention.KERNEL_DTYPES, torch.float32))
        yield
