"""The flags every recipe has, defined and documented once.

A recipe declares its own flags in a dataclass that extends TrainingFlags, gives a shared flag the
default its task needs by declaring it again (same type; its help stays the one written here unless
the recipe documents it anew), and hands its `main(args)` to `accelerate_recipes.cli.run`, which
reads the flags from the class. Importing this module does not import torch, so a script's --help
stays fast.

A flag whose value is one of a fixed set is annotated with its choices, `Literal["a", "b"]` (or
`Literal["a", "b"] | None`); building the flags, from the command line or in Python, refuses any
other value.
"""

import functools
import types
import typing
from dataclasses import dataclass, fields

from accelerate_recipes.errors import RecipeError


def choices_of(annotation) -> tuple | None:
    """The values a `Literal[...]` or `Literal[...] | None` annotation allows; None for any other
    annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and typing.get_origin(members[0]) is typing.Literal:
            return typing.get_args(members[0])
    return None


@functools.cache
def _choice_flags(cls) -> dict[str, tuple[tuple, bool]]:
    """Each choice flag of a flags class: its choices, and whether it may also be None."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (choices, typing.get_origin(hints[f.name]) is not typing.Literal)
        for f in fields(cls)
        if (choices := choices_of(hints[f.name])) is not None
    }


def check_choice(name: str, value, choices) -> None:
    """Refuse a value of --name outside its choices, in the words every recipe uses."""
    if value not in choices:
        listed = ", ".join(map(str, choices))
        raise RecipeError(f"unknown --{name} {value!r}; choose one of {listed}")


@dataclass
class TrainingFlags:
    """Flags shared by every recipe.

    Args:
        batch_size: GLOBAL batch per optimizer step, all processes together; each process loads
            batch_size / (num_processes x gradient_accumulation_steps), so the same flags train the
            same way on any number of GPUs.
        epochs: passes over the training set (ignored when --max_steps is set).
        max_steps: stop after this many optimizer steps.
        lr: peak learning rate, reached after warmup, then decayed; it does not change with the GPU
            count.
        weight_decay: weight decay on weight matrices and conv kernels (not on normalisation weights
            or biases).
        gradient_accumulation_steps: micro-batches summed before each optimizer step.
        max_grad_norm: clip the gradients' global L2 norm to this before each update; 0: no
            clipping.
        mixed_precision: no, fp16 or bf16; default: what the accelerate config or launcher says.
        early_stopping_patience: stop after this many evaluations in a row whose metric (the one
            results.json names metric_for_best_model) is not better than the best so far, saving the
            last model and results.json as at a normal end; 0 (the default): train to the end.
            Either way the model of the best evaluation is kept in output_dir/model_best.
        num_workers: DataLoader workers per process; default: the CPU cores per local process less
            one, at most 8; 0 on the CPU, where torch's threads get the cores.
        output_dir: where the model, model_best/ (the model of the best evaluation), results.json,
            metrics.jsonl, results.png, checkpoints/ and offline SwanLab logs go.
        log_every: log loss and throughput every N optimizer steps. Only log and checkpoint steps
            read values back from the GPU, and a stop signal or a non-finite loss is acted on at the
            next of them.
        checkpoint_every: save a checkpoint (accelerator.save_state) every N optimizer steps,
            besides the one at the end of each epoch; 0: at epoch ends only.
        keep_checkpoints: how many of the newest checkpoints to keep in output_dir/checkpoints.
        resume: auto (continue from the newest complete checkpoint in output_dir/checkpoints, or
            start fresh when there is none) or the path of a checkpoint; default: start fresh,
            refused when checkpoints exist.
        skip_nonfinite_steps: drop the update of a step whose loss is NaN or infinite and go on,
            instead of stopping.
        dist_timeout: seconds a process waits for the others (at start-up, in a checkpoint save, in
            any collective) before it stops with an error; the launcher's own wait for other nodes
            is --rdzv_conf timeout=N.
        tracker: swanlab, none, or another tracker Accelerate knows (tensorboard, wandb, mlflow,
            ...).
        swanlab_mode: cloud, offline, local or disabled; default $SWANLAB_MODE, else cloud when
            logged in, else offline.
        project: tracker project name.
        run_name: tracker run name; default: the recipe's name and its data.
        seed: seed for weights, data order, augmentation and generated data.
        plots: draw the run's pictures in --output_dir and log them to the trackers that take
            images: results.png every epoch and the recipe's own (confusion matrices, the
            detector's curves and predictions). False: no pictures, as Ultralytics' plots=False;
            the figures stay in metrics.jsonl and results.json.
        model: the output directory of a finished run (or its model_best/) that --eval_only and
            --predict use; default --output_dir.
        eval_only: evaluate the model in --model on the validation split of the data flags and write
            results.json to --output_dir, without training. Runs on any number of processes; each
            example is counted once. With --output_dir the model's folder (the default), the
            training run's results.json is replaced.
        predict: use the model in --model instead of training: the inputs to predict (a file, a
            folder, or the text itself, as the recipe says); give --predict several times for
            several. Prints one JSON line per input and nothing else; runs in one process.
    """

    batch_size: int = 32
    epochs: int = 3
    max_steps: int | None = None
    lr: float | None = None
    weight_decay: float = 0.0
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 0.0
    mixed_precision: str | None = None
    early_stopping_patience: int = 0
    num_workers: int | None = None
    output_dir: str = "outputs"
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    resume: str | None = None
    skip_nonfinite_steps: bool = False
    dist_timeout: int = 600
    tracker: str = "swanlab"
    swanlab_mode: str | None = None
    project: str = "accelerate-recipes"
    run_name: str | None = None
    seed: int = 42
    plots: bool = True
    model: str | None = None
    eval_only: bool = False
    predict: str | list[str] | None = None

    def __post_init__(self):
        """Check every choice flag (a field annotated `Literal[...]`) against its choices. A
        subclass with a __post_init__ of its own calls this one."""
        for name, (choices, optional) in _choice_flags(type(self)).items():
            value = getattr(self, name)
            if value is not None or not optional:
                check_choice(name, value, choices)
