"""An exponential moving average of a model's weights and BatchNorm statistics, as YOLO evaluates
and saves.

    ema = ModelEMA(model, decay=0.9999, ramp_steps=2000)
    ...after each optimizer step:  ema.update(model)
    evaluate / save ema.module; accelerator.register_for_checkpointing(ema) carries it through
    save_state/load_state.

weight_average(accelerator, model, decay) builds the average of a prepared model and registers it:
train.py's one call.

The decay ramps up as decay x (1 - exp(-updates / ramp_steps)), so early on the average follows the
fast-moving weights instead of remembering the random initialisation; the first update copies the
weights.

The update count is a Python int and the decay is computed on the host, so an update queues a few
fused kernels (torch._foreach_lerp_ over all floating-point tensors at once) and never waits for the
GPU. torch.optim.swa_utils.AveragedModel keeps its count in a device tensor and reads it back
several times per update.
"""

import copy
import math

import torch


class ModelEMA:
    """EMA of every floating-point parameter and buffer of `model`; other buffers (BatchNorm's
    num_batches_tracked) take the model's current value. `module` is the averaged copy (on the
    model's device, no gradients)."""

    def __init__(self, model: torch.nn.Module, decay: float, ramp_steps: float = 2000):
        self.decay = decay
        self.ramp_steps = ramp_steps
        self.updates = 0  # updates made so far
        self.module = copy.deepcopy(model).requires_grad_(False)
        self._source: torch.nn.Module | None = None
        self._float_pairs: tuple[list, list] = ([], [])
        self._other_pairs: tuple[list, list] = ([], [])

    def _pairs(self, model: torch.nn.Module) -> None:
        """Pair the averaged tensors with the model's once: the optimizer updates the model's
        tensors in place, so the lists stay valid and each update skips walking the module tree."""
        if self._source is model:
            return
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [*model.parameters(), *model.buffers()]
        if len(averaged) != len(current) or any(a.shape != c.shape for a, c in zip(averaged, current)):
            raise ValueError(
                "ModelEMA.update got a model of another architecture than the one it was built from"
            )
        floats = [(a, c.detach()) for a, c in zip(averaged, current) if a.is_floating_point()]
        others = [(a, c.detach()) for a, c in zip(averaged, current) if not a.is_floating_point()]
        self._float_pairs = ([a for a, _ in floats], [c for _, c in floats])
        self._other_pairs = ([a for a, _ in others], [c for _, c in others])
        self._source = model

    def current_decay(self) -> float:
        """Weight the average keeps at the next update: 0 at the first (a copy), rising towards
        `decay`."""
        return self.decay * (1 - math.exp(-self.updates / self.ramp_steps))

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """averaged <- d x averaged + (1 - d) x current, d = current_decay(); call after each
        optimizer step."""
        self._pairs(model)
        averaged, current = self._float_pairs
        if averaged:
            torch._foreach_lerp_(averaged, current, 1.0 - self.current_decay())
        if self._other_pairs[0]:
            torch._foreach_copy_(*self._other_pairs)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def weight_average(
    accelerator, model: torch.nn.Module, decay: float
) -> tuple[torch.nn.Module, ModelEMA | None]:
    """The prepared model unwrapped, and the exponential moving average of its weights (None with
    --ema_decay 0), registered so that save_state / load_state carry the averaged weights too."""
    # An average of the model itself, without torch.compile's wrapper (a launcher's --dynamo_backend
    # adds one): its weights keep their own names in model.safetensors and in checkpoints.
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    ema = ModelEMA(unwrapped, decay, ramp_steps=2000) if decay else None
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    return unwrapped, ema
