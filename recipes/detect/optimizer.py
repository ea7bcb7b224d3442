"""The detector's optimizer, AdamW or SGD without weight decay on BatchNorm and biases, and
--patience's epochs as the evaluations that early stopping counts."""

import math

import torch

DEFAULT_PATIENCE = 100  # epochs without improvement before the run stops: Ultralytics' default


def build_optimizer(
    model: torch.nn.Module, name: str, lr: float, momentum: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW or SGD (nesterov) over the trainable parameters (--freeze leaves some out), with weight
    decay on conv and linear weights only (not on BatchNorm or biases)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim > 1]
    no_decay = [p for p in trainable if p.ndim <= 1]  # BatchNorm weights and biases
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True)
    # one fused kernel for all parameters where torch has one: for the nano model on one CPU thread,
    # about a quarter of the time of the loop of tensor ops
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999), fused=fused)


def evaluations_of_patience(args) -> int:
    """--patience's epochs as the evaluations (one every --eval_every epochs) that early stopping
    counts, or --early_stopping_patience's evaluations as given; 0: no early stopping."""
    if args.early_stopping_patience:
        return args.early_stopping_patience
    epochs = DEFAULT_PATIENCE if args.patience is None else args.patience
    return math.ceil(epochs / args.eval_every)
