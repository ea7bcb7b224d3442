#!/usr/bin/env python
"""Run a detector trained by train.py on images: pictures with the boxes drawn (PNG) and a JSON of detections.

    python recipes/detect/predict.py --model outputs/detect --source photo.jpg
    python recipes/detect/predict.py --model outputs/detect --source data/shapes/images/val --conf_threshold 0.4

Writes <out>/<image name>.png for each image and <out>/detections.json: one entry per image with its boxes in the
image's own pixels (x1, y1, x2, y2), score, class id and class name.
"""

from accelerate_recipes.cli import answer_help_from_source

answer_help_from_source(__name__, __file__)  # -h/--help at once, before torch and the rest import

import json
from pathlib import Path

import numpy as np
import torch
from detector_files import MODEL_CONFIG, draw_detections, upright_rgb
from safetensors.torch import load_file
from tqdm.auto import tqdm
from yolo_data import IMAGE_SUFFIXES, letterbox, scale_boxes_back
from yolo_model import Detector, postprocess

from accelerate_recipes import RecipeError, run


def load_detector(model_dir: Path, device: torch.device) -> tuple[Detector, dict]:
    """The model saved by train.py (model.safetensors + detector.json), in eval mode on `device`."""
    config_file, weights = model_dir / MODEL_CONFIG, model_dir / "model.safetensors"
    for needed in (config_file, weights):
        if not needed.is_file():
            raise RecipeError(f"{needed} not found; --model must be the output directory of a finished "
                              "recipes/detect/train.py run")
    config = json.loads(config_file.read_text())
    model = Detector(num_classes=config["num_classes"], size=config["size"])
    model.load_state_dict(load_file(str(weights)))
    return model.to(device).eval(), config


def list_images(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if source.is_dir():
        images = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if images:
            return images
        raise RecipeError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {source}; point --source at an image "
                          "or a folder of images")
    raise RecipeError(f"--source {source} does not exist; give an image file or a folder of images")


@torch.no_grad()
def main(model: str = "outputs/detect", source: str = "", out: str | None = None, conf_threshold: float = 0.25,
         iou_threshold: float = 0.7, image_size: int | None = None, device: str | None = None):
    """Detect objects in an image or a folder of images with a model trained by recipes/detect/train.py.

    Args:
        model: the training run's output directory (model.safetensors and detector.json).
        source: an image file or a folder of images.
        out: where the pictures and detections.json go; default <model>/predictions.
        conf_threshold: keep detections scoring at least this.
        iou_threshold: IoU above which NMS suppresses a box of the same class.
        image_size: network input side (a multiple of 32); default the training size.
        device: cuda, cpu, ...; default the first GPU when there is one.
    """
    if not source:
        raise RecipeError("--source is required: an image file or a folder of images")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    detector, config = load_detector(Path(model), device)
    names, size = config["names"], image_size or config["image_size"]
    if size % 32:
        raise RecipeError(f"--image_size {size} must be a multiple of 32")
    out_dir = Path(out) if out else Path(model) / "predictions"
    out_dir.mkdir(parents=True, exist_ok=True)

    report = []
    for path in tqdm(list_images(Path(source)), desc="predict", unit="image"):
        try:
            original = np.asarray(upright_rgb(path))
        except OSError as err:
            raise RecipeError(f"cannot read image {path} ({err}); remove it or replace it with a valid image") from None
        boxed, ratio, pad = letterbox(original, size)
        batch = torch.from_numpy(np.ascontiguousarray(boxed)).permute(2, 0, 1)[None].to(device).float() / 255
        found = postprocess(detector(batch), detector.strides, detector.reg_max, conf_threshold=conf_threshold,
                            iou_threshold=iou_threshold)[0]
        boxes = scale_boxes_back(found["boxes"], ratio, pad, original.shape[:2]).cpu()
        scores, labels = found["scores"].cpu(), found["labels"].cpu()
        draw_detections(path, boxes, labels, scores, names).save(out_dir / f"{path.stem}.png")
        report.append({"image": str(path), "detections": [
            {"box": [round(v, 2) for v in box.tolist()], "score": round(float(s), 4), "class_id": int(c),
             "class_name": names[int(c)]} for box, s, c in zip(boxes, scores, labels)]})
    (out_dir / "detections.json").write_text(json.dumps(report, indent=1))
    total = sum(len(r["detections"]) for r in report)
    print(f"{total} detections in {len(report)} images; pictures and detections.json in {out_dir}")


if __name__ == "__main__":
    run(main)
