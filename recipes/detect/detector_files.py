"""What train.py and predict.py both use: the name of the saved model's config file, and pictures of detections."""

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.utils import draw_bounding_boxes

MODEL_CONFIG = "detector.json"  # written by train.py next to model.safetensors: what rebuilds the model
# One colour per class (cycling), each dark enough for white captions on it.
PALETTE = ["#e6194b", "#0b6ee0", "#d35400", "#8e24aa", "#00897b", "#c0a000", "#3f51b5", "#2e7d32", "#ad1457",
           "#5d4037"]


def upright_rgb(path) -> Image.Image:
    """The image as RGB, turned upright by its EXIF orientation (as training reads it)."""
    return ImageOps.exif_transpose(Image.open(path)).convert("RGB")


def draw_detections(image_path, boxes: torch.Tensor, labels: torch.Tensor, scores: torch.Tensor,
                    names: list[str], fit: int | None = None) -> Image.Image:
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
    drawn = draw_bounding_boxes(tensor, boxes.float(), labels=captions, colors=colors, width=2, fill_labels=True,
                                label_colors="white")
    return Image.fromarray(drawn.permute(1, 2, 0).numpy())
