"""What train.py and predict.py both use: the saved model's files (detector.json beside model.safetensors), the
detector rebuilt from them, and pictures of detections."""

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file
from torchvision.utils import draw_bounding_boxes
from yolo_model import Detector, model_info

from accelerate_recipes import RecipeError

MODEL_CONFIG = "detector.json"  # written by train.py next to model.safetensors: what rebuilds the model
# One colour per class (cycling), each dark enough for white captions on it.
PALETTE = ["#e6194b", "#0b6ee0", "#d35400", "#8e24aa", "#00897b", "#c0a000", "#3f51b5", "#2e7d32", "#ad1457", "#5d4037"]


def read_model_config(model_dir: Path) -> dict:
    """detector.json of the model saved in `model_dir` (size, num_classes, names, image_size, channels_last), once
    both of its files are there."""
    config_file, weights = model_dir / MODEL_CONFIG, model_dir / "model.safetensors"
    for needed in (config_file, weights):
        if not needed.is_file():
            raise RecipeError(
                f"{needed} not found; --model must be the output directory of a finished "
                "recipes/detect/train.py run (or its model_best/)"
            )
    return json.loads(config_file.read_text())


def load_weights(model: torch.nn.Module, path: Path, flag: str) -> None:
    """Weights saved by an earlier run (accelerator.save_model writes model.safetensors), from its folder or the file;
    `flag` names where the path came from in the errors."""
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise RecipeError(f"{flag} {path}: no {file.name} there; give the output directory of a finished run")
    try:
        model.load_state_dict(load_file(str(file)))
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise RecipeError(
            f"{flag} {file} does not fit this model ({first}); use the same --size and a data.yaml "
            "with the same number of classes as that run"
        ) from None


def build_model(
    size: str, num_classes: int, channels_last: bool, weights: str | Path | None = None, flag: str = "--model"
) -> tuple[Detector, dict]:
    """The detector of this size for this many classes, with the weights of an earlier run when given (`flag` names
    where they came from), in channels-last layout when asked; and its size figures (parameters, GFLOPs at 640, the
    size YOLO papers and model cards quote)."""
    model = Detector(num_classes=num_classes, size=size)
    if weights:
        load_weights(model, Path(weights), flag)
    info = model_info(model, image_size=640)
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
    """The image with one labelled box per detection (boxes in the image's own pixels); with `fit`, the image is first
    scaled to fit a fit x fit square, so the captions keep their size whatever the image's."""
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
