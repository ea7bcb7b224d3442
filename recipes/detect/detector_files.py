"""What train.py and predict.py both use: the saved model's files (detector.json beside
model.safetensors), the detector rebuilt from them, and pictures of detections."""

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file
from torchvision.utils import draw_bounding_boxes
from ultralytics_weights import converted_start
from yolo_model import Detector, model_info, size_of_weights

from accelerate_recipes import RecipeError

# written by train.py next to model.safetensors: what rebuilds the model
MODEL_CONFIG = "detector.json"
# the classification branch's first conv: its width is the branch's
CLASS_BRANCH_FIRST = "head.cls.0.0.0.weight"
# a pretrained start must give at least this share of the model's parameters by name and shape
MIN_MATCHED = 0.9
# One colour per class (cycling), each dark enough for white captions on it.
PALETTE = [
    "#e6194b",
    "#0b6ee0",
    "#d35400",
    "#8e24aa",
    "#00897b",
    "#c0a000",
    "#3f51b5",
    "#2e7d32",
    "#ad1457",
    "#5d4037",
]


def read_model_config(model_dir: Path) -> dict:
    """detector.json of the model saved in `model_dir` (size, num_classes, names, image_size,
    channels_last and, when not YOLOv8's default, cls_width), once both of its files are there."""
    config_file, weights = model_dir / MODEL_CONFIG, model_dir / "model.safetensors"
    for needed in (config_file, weights):
        if not needed.is_file():
            raise RecipeError(
                f"{needed} not found; --model must be the output directory of a finished "
                "recipes/detect/train.py run (or its model_best/)"
            )
    return json.loads(config_file.read_text())


def weights_file(path: Path, flag: str) -> Path:
    """model.safetensors in a run's folder (or its model_best/), or the file itself."""
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise RecipeError(f"{flag} {path}: no {file.name} there; give the output directory of a finished run")
    return file


def load_weights(model: torch.nn.Module, path: Path, flag: str) -> None:
    """Weights saved by an earlier run of this model (accelerator.save_model writes
    model.safetensors), from its folder or the file, all of them; `flag` names where the path came
    from in the errors."""
    file = weights_file(path, flag)
    try:
        model.load_state_dict(load_file(str(file)))
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise RecipeError(
            f"{flag} {file} does not fit this model ({first}); use the same --size and a data.yaml "
            "with the same number of classes as that run"
        ) from None


# --init_weights files converted from Ultralytics' layout on the fly
ULTRALYTICS_SUFFIXES = (".pt", ".pth")


def read_start(path: Path, flag: str = "--init_weights") -> dict:
    """A pretrained start as this recipe's tensors: dict(state, size, cls_width, names: the classes
    it was trained on or None, source: the file read). A model of this recipe (a run's folder, its
    model_best/, or a model.safetensors), or Ultralytics YOLOv8 detection weights (a .pt: converted
    in memory, which needs the ultralytics package). The size and the classification branch's width
    are read from the tensors."""
    path = Path(path)
    if path.suffix in ULTRALYTICS_SUFFIXES:
        if not path.is_file():
            raise RecipeError(
                f"{flag} {path} not found; give the .pt file Ultralytics wrote or you downloaded",
            )
        start = converted_start(path)
        return dict(start, source=str(path), kind=f"Ultralytics' YOLOv8{start['size']}, converted")
    file = weights_file(path, flag)
    try:
        state = load_file(str(file))
    except Exception as err:  # not a safetensors file, or a damaged one
        raise RecipeError(
            f"{flag} {file} is not a safetensors file ({str(err).splitlines()[0][:120]}); give a "
            "model.safetensors "
            "of this recipe, or Ultralytics' YOLOv8 .pt"
        ) from None
    config_file = file.parent / MODEL_CONFIG
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    width = state.get(CLASS_BRANCH_FIRST)
    return dict(
        state=state,
        size=size_of_weights(state),
        cls_width=int(width.shape[0]) if width is not None else None,
        names=config.get("names"),
        num_classes=config.get("num_classes"),
        source=str(file),
        kind=f"a yolo-{size_of_weights(state)} of this recipe",
    )


def load_matching_weights(model: Detector, start: dict, flag: str) -> str:
    """A pretrained start (read_start): every tensor whose name and shape this model has is loaded,
    the rest of the model keeps its fresh initialisation (after a change of class count, the
    classification outputs). Refuses a start that provides under MIN_MATCHED of the model's
    parameters: that is no detector of this size. Returns the line that says what was loaded and
    what was left."""
    saved, file = start["state"], start["source"]
    own = model.state_dict()
    fits = {k: v for k, v in saved.items() if k in own and own[k].shape == v.shape}
    parameters = dict(model.named_parameters())
    total = sum(p.numel() for p in parameters.values())
    matched = sum(parameters[k].numel() for k in fits if k in parameters)
    if matched < MIN_MATCHED * total:
        hint = f" (it is a yolo-{start['size']})" if start.get("size") else ""
        raise RecipeError(
            f"{flag} {file} gives only {matched / total:.0%} of this yolo-{model.size}'s weights "
            f"by name and shape{hint}; give a model.safetensors of this recipe with the same "
            "--size (or no --size), or Ultralytics' YOLOv8 .pt"
        )
    model.load_state_dict(fits, strict=False)
    left = [k for k in own if k not in fits and not k.endswith("num_batches_tracked")]
    shapes = [f"{tuple(saved[k].shape)} there, {tuple(own[k].shape)} here" for k in left if k in saved]
    line = (
        f"{flag} {file}: loaded {len(fits)} of {len(own)} tensors by name and shape "
        f"({matched / 1e6:.2f}M of {total / 1e6:.2f}M parameters)"
    )
    if left:
        named = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        line += f"; left at their initial values: {named}" + (f" ({shapes[0]})" if shapes else "")
    return line


def model_size(size: str | None, start: dict | None, flag: str = "--init_weights") -> str:
    """The model size to build: --size, else the pretrained start's, else n. A --size that is not
    the start's is
    refused: the start would not fit."""
    if size is not None and start is not None and start["size"] is not None and size != start["size"]:
        raise RecipeError(
            f"--size {size}, but {flag} {start['source']} is a yolo-{start['size']}; leave --size "
            f"out (the start gives it) or start from a yolo-{size}"
        )
    return size or (start["size"] if start is not None and start["size"] else "n")


def build_model(
    size: str,
    num_classes: int,
    channels_last: bool,
    weights: str | Path | dict | None = None,
    flag: str = "--model",
    cls_width: int | None = None,
    by_shape: bool = False,
) -> tuple[Detector, dict]:
    """The detector of this size for this many classes, with the weights of an earlier run when
    given (`flag` names where they came from), in channels-last layout when asked; and its size
    figures (parameters, GFLOPs at 640, the size YOLO papers and model cards quote).

    by_shape: a pretrained start (--init_weights: a path, or what read_start read) from a model that
    may detect other classes: the classification branch takes that model's hidden width, and every
    tensor that fits by name and shape is loaded (load_matching_weights); info["loaded"] says what
    was. Otherwise all weights must fit (a saved model's --model)."""
    start = None
    if weights is not None and by_shape:
        start = weights if isinstance(weights, dict) else read_start(Path(weights), flag)
        cls_width = start["cls_width"] or cls_width
    model = Detector(num_classes=num_classes, size=size, cls_width=cls_width)
    loaded = None
    if start is not None:
        loaded = load_matching_weights(model, start, flag)
    elif weights is not None:
        load_weights(model, Path(weights), flag)
    info = dict(model_info(model, image_size=640), loaded=loaded)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, info


def upright_rgb(path) -> Image.Image:
    """The image as RGB, turned upright by its EXIF orientation (as training reads it)."""
    return ImageOps.exif_transpose(Image.open(path)).convert("RGB")


def draw_detections(
    image_path,
    boxes: torch.Tensor,
    labels: torch.Tensor,
    scores: torch.Tensor,
    names: list[str],
    fit: int | None = None,
) -> Image.Image:
    """The image with one labelled box per detection (boxes in the image's own pixels); with `fit`,
    the image is first scaled to fit a fit x fit square, so the captions keep their size whatever
    the image's."""
    image = upright_rgb(image_path)
    if fit:
        scale = fit / max(image.size)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
        boxes = boxes * scale
    if len(boxes) == 0:
        return image
    captions = [f"{names[int(c)]} {float(s):.2f}" for c, s in zip(labels, scores)]
    colors = [PALETTE[int(c) % len(PALETTE)] for c in labels]
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    # Captions in white on their box's colour: readable on any background.
    drawn = draw_bounding_boxes(
        tensor, boxes.float(), labels=captions, colors=colors, width=2, fill_labels=True, label_colors="white"
    )
    return Image.fromarray(drawn.permute(1, 2, 0).numpy())
