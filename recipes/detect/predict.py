"""Detection with a model trained by train.py, what `train.py --predict` runs: one JSON line per
image on stdout, and pictures with the boxes drawn (PNG) and a JSON of all detections on disk.

    python recipes/detect/train.py --predict photo.jpg --model outputs/detect
    python recipes/detect/train.py --predict data/shapes/images/val --model outputs/detect \\
        --conf_threshold 0.4
    python recipes/detect/train.py --predict photo.jpg --model outputs/detect/model.onnx   # onnxruntime

Writes, for each image, <out>/<image name>.png with its boxes drawn and <out>/labels/<image
name>.txt, its detections in YOLO's label format (class cx cy w h, normalised to the image:
pseudo-labels to train on, as Ultralytics' save_txt writes them); and <out>/detections.json: one
entry per image with its boxes in the image's own pixels (x1, y1, x2, y2), score, class id and class
name; each entry is also printed as a JSON line. A folder is walked recursively; an image in a
subfolder keeps that subfolder under <out> and <out>/labels.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from detector_files import build_model, draw_detections, read_model_config, upright_rgb

# onnxruntime is imported only for an ONNX model
from onnx_export import OnnxDetector, TorchScriptDetector
from torchvision.ops import box_convert
from tqdm.auto import tqdm
from yolo_data import IMAGE_SUFFIXES, letterbox, scale_boxes_back
from yolo_model import Detector, postprocess

from accelerate_recipes import RecipeError


def load_detector(model_dir: Path, device: torch.device) -> tuple[Detector, dict]:
    """The model saved by train.py (model.safetensors + detector.json), in eval mode on `device`; or
    a file --export
    wrote: a .onnx run by onnxruntime, a .torchscript by torch.jit.load, on the CPU."""
    if model_dir.suffix in (".onnx", ".torchscript"):
        detector = OnnxDetector(model_dir) if model_dir.suffix == ".onnx" else TorchScriptDetector(model_dir)
        return detector, detector.config
    config = read_model_config(model_dir)
    model, _ = build_model(
        config["size"], config["num_classes"], False, weights=model_dir, cls_width=config.get("cls_width")
    )
    return model.to(device).eval(), config


def list_images(sources) -> list[tuple[Path, Path]]:
    """The images to detect objects in, each with the name its outputs take: files as given (their
    name), and the images under a folder, subfolders included (their path inside it), sorted."""
    images = []
    for source in map(Path, sources if isinstance(sources, (list, tuple)) else [sources]):
        if source.is_file():
            images.append((source, Path(source.name)))
        elif source.is_dir():
            found = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not found:
                raise RecipeError(
                    f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {source} or its subfolders; point "
                    "--predict at an image or a folder of images"
                )
            images += [(p, p.relative_to(source)) for p in found]
        else:
            raise RecipeError(f"--predict {source} does not exist; give an image file or a folder of images")
    return images


def yolo_label_lines(boxes: torch.Tensor, labels: torch.Tensor, height: int, width: int) -> str:
    """Detections as a YOLO label file: one `class cx cy w h` line each, normalised to the image's
    size."""
    xywh = box_convert(boxes.float(), "xyxy", "cxcywh") / torch.tensor([width, height, width, height])
    lines = [f"{int(c)} " + " ".join(f"{v:.6f}" for v in row.tolist()) + "\n" for c, row in zip(labels, xywh)]
    return "".join(lines)


@torch.no_grad()
def detect_images(
    model_dir: Path,
    sources,
    out: str | None = None,
    conf_threshold: float = 0.25,
    iou_threshold: float = 0.7,
    image_size: int | None = None,
    device: str | None = None,
) -> None:
    """Detect objects in images (files or folders of them) with the model in `model_dir`: print one
    JSON line per image (image, detections), draw each image with its boxes into `out` (default
    <model_dir>/predictions) and write detections.json there. The progress bar and the closing count
    go to stderr."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    detector, config = load_detector(model_dir, device)
    names, size = config["names"], image_size or config["image_size"]
    if config.get("end_to_end") and conf_threshold < config["conf_threshold"]:
        print(
            f"note: {model_dir} was exported with its NMS at conf {config['conf_threshold']}: it holds no "
            "box "
            f"below that, so --conf_threshold {conf_threshold} finds what {config['conf_threshold']} finds",
            file=sys.stderr,
        )
    if size % 32:
        raise RecipeError(f"--image_size {size} must be a multiple of 32")
    out_dir = (
        Path(out) if out else (model_dir.parent if model_dir.suffix == ".onnx" else model_dir) / "predictions"
    )
    out_dir.mkdir(parents=True, exist_ok=True)

    report = []
    for path, name in tqdm(list_images(sources), desc="predict", unit="image"):
        try:
            original = np.asarray(upright_rgb(path))
        except OSError as err:
            raise RecipeError(
                f"cannot read image {path} ({err}); remove it or replace it with a valid image"
            ) from None
        boxed, ratio, pad = letterbox(original, size)
        batch = torch.from_numpy(np.ascontiguousarray(boxed)).permute(2, 0, 1)[None].to(device).float() / 255
        # an exported file: end to end, or its raw outputs postprocessed
        if isinstance(detector, OnnxDetector):
            found = detector.detect(batch, conf_threshold, iou_threshold)[0]
        else:
            found = postprocess(
                detector(batch),
                detector.strides,
                detector.reg_max,
                conf_threshold=conf_threshold,
                iou_threshold=iou_threshold,
            )[0]
        boxes = scale_boxes_back(found["boxes"], ratio, pad, original.shape[:2]).cpu()
        scores, labels = found["scores"].cpu(), found["labels"].cpu()
        picture = out_dir / name.with_suffix(".png")
        label_file = out_dir / "labels" / name.with_suffix(".txt")
        picture.parent.mkdir(parents=True, exist_ok=True)
        label_file.parent.mkdir(parents=True, exist_ok=True)
        draw_detections(path, boxes, labels, scores, names).save(picture)
        label_file.write_text(yolo_label_lines(boxes, labels, *original.shape[:2]))
        entry = {
            "image": str(path),
            "detections": [
                {
                    "box": [round(v, 2) for v in box.tolist()],
                    "score": round(float(s), 4),
                    "class_id": int(c),
                    "class_name": names[int(c)],
                }
                for box, s, c in zip(boxes, scores, labels)
            ],
        }
        report.append(entry)
        print(json.dumps(entry), flush=True)
    (out_dir / "detections.json").write_text(json.dumps(report, indent=1))
    total = sum(len(r["detections"]) for r in report)
    where = f"pictures, labels/ (YOLO txt) and detections.json in {out_dir}"
    print(f"{total} detections in {len(report)} images; {where}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(
        "predict.py has no command line of its own; predict with: python recipes/detect/train.py --predict "
        "IMAGE_OR_FOLDER --model OUTPUT_DIR"
    )
