"""Run a recipe as `python recipe.py FLAGS` would, with one more attention implementation,
`nan_masked_rows`: torch's sdpa, whose backward pass gives NaN query gradients in the rows its mask
leaves fully masked (a left-padded row's padding), as cuDNN's sdpa kernel has been reported to do on
Hopper GPUs. The loss stays finite.

    python tests/nan_attention.py STEPS_FILE recipes/dpo.py --attn_implementation nan_masked_rows FLAGS...

Each optimizer step (counted from 1 as the recipes count) whose training forward pass met such a row
is appended to STEPS_FILE, one line each. Forward passes without gradients (a reference policy,
generation, evaluation) are not touched.
"""

import os
import runpy
import sys
from pathlib import Path

import accelerate
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "nan_masked_rows"
STEPS_FILE = Path(sys.argv.pop(1))
real_backward = accelerate.Accelerator.backward
steps_done = 0
recorded: set[int] = set()


class NanGradientInMaskedRows(torch.autograd.Function):
    """The identity on the query; its backward pass puts NaN into the gradient of the fully masked
    rows."""

    @staticmethod
    def forward(ctx, query, masked_rows):
        ctx.save_for_backward(masked_rows)
        return query.view_as(query)

    @staticmethod
    def backward(ctx, grad):
        (masked_rows,) = ctx.saved_tensors
        return grad.masked_fill(masked_rows[..., None], float("nan")), None


def nan_masked_rows(module, query, key, value, attention_mask, **kwargs):
    if attention_mask is not None and torch.is_grad_enabled():
        # [batch, 1, queries]: True where a query may attend to nothing
        masked_rows = ~attention_mask.any(dim=-1)
        if masked_rows.any() and steps_done + 1 not in recorded:
            recorded.add(steps_done + 1)
            with STEPS_FILE.open("a") as steps:
                steps.write(f"{steps_done + 1}\n")
        query = NanGradientInMaskedRows.apply(query, masked_rows)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def backward(self, loss, **kwargs):
    global steps_done
    real_backward(self, loss, **kwargs)
    steps_done += self.sync_gradients  # this micro-batch ended an optimizer step


AttentionInterface.register(NAME, nan_masked_rows)
AttentionMaskInterface.register(
    NAME, lambda *args, **kwargs: AttentionMaskInterface()["sdpa"](*args, **kwargs)
)
accelerate.Accelerator.backward = backward
sys.argv = [os.path.abspath(sys.argv[1]), *sys.argv[2:]]  # the recipe and its flags
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
