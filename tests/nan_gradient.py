"""Run a recipe as `python recipe.py FLAGS` would, with NaN gradients at one optimizer step and a
finite loss, as a bug in a model's or a kernel's backward pass gives them:

    python tests/nan_gradient.py STEP recipes/sft.py FLAGS...

During the backward pass of optimizer step STEP (counted from 1 as the recipes count: one step per
gradient accumulation boundary) the gradient flowing into one trainable weight of the prepared model
is replaced by NaN. It is replaced inside the backward pass, so it reaches the weight before DDP
averages it over the processes or DeepSpeed's engine takes it, as the bug's would; the recipe itself
is not touched.
"""

import os
import runpy
import sys

import accelerate
import torch

NAN_STEP = int(sys.argv.pop(1))
real_backward = accelerate.Accelerator.backward
steps_done = 0


def backward(self, loss, **kwargs):
    global steps_done
    boundary = self.sync_gradients  # this micro-batch ends an optimizer step
    hook = None
    if boundary and steps_done + 1 == NAN_STEP:
        weight = next(p for model in self._models for p in model.parameters() if p.requires_grad)
        hook = weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    try:
        real_backward(self, loss, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    steps_done += boundary


accelerate.Accelerator.backward = backward
sys.argv = [os.path.abspath(sys.argv[1]), *sys.argv[2:]]  # the recipe and its flags
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
