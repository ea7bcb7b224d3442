#!/usr/bin/env python
"""Ultralytics YOLOv8 detection weights as this recipe's model files (model.safetensors + detector.json).

    python recipes/detect/ultralytics_weights.py --weights yolov8n.pt --out models/yolov8n
    python recipes/detect/train.py --init_weights models/yolov8n --data path/to/data.yaml --epochs 50

Our detector's layers follow YOLOv8's (yolo_model.py), so the conversion is a table by module position: Ultralytics'
`model.<i>` is one of our named blocks, and inside a block its Conv's `conv` / `bn` are our Sequential's `0` / `1`.
Every tensor is checked by shape, every tensor of ours must be filled and every one of the file used (the fixed DFL
projection `model.22.dfl` excepted, which our decode computes), so a file of another architecture (YOLO11, v5, ...) is
refused rather than half loaded. The size (n, s, m) and the class count are read from the shapes; the classification
branch keeps the file's hidden width (80 for COCO), so nothing of the file is lost when a fine-tune changes the
class count.

Reading Ultralytics' `.pt` files: they are pickles of Ultralytics' classes, so reading one needs the `ultralytics`
package installed (`pip install 'accelerate-recipes[detect-compare]'`, or `pip install ultralytics`); it is not a
dependency of the recipes. A state dict saved without those classes (`torch.save(yolo.model.state_dict(), path)`, or a
.safetensors of it) reads without it. Ultralytics' pretrained weights are published under AGPL-3.0 (or its
Enterprise licence); weights converted from them, and models fine-tuned from those, carry that licence.
"""

import json
from pathlib import Path

import torch
from detector_files import MODEL_CONFIG
from safetensors.torch import load_file, save_file
from yolo_model import SIZES, Detector

from accelerate_recipes import RecipeError, run

# Our blocks, in YOLOv8's layer order (its detection YAML): model.<index> of Ultralytics' file. Indices 10, 11, 13,
# 14, 17 and 20 are Upsample and Concat layers, without weights.
BLOCKS = {
    "backbone.stem.0": 0,
    "backbone.stem.1": 1,
    "backbone.stem.2": 2,
    "backbone.stage3.0": 3,
    "backbone.stage3.1": 4,
    "backbone.stage4.0": 5,
    "backbone.stage4.1": 6,
    "backbone.stage5.0": 7,
    "backbone.stage5.1": 8,
    "backbone.stage5.2": 9,
    "neck.top_down4": 12,
    "neck.top_down3": 15,
    "neck.down3": 16,
    "neck.bottom_up4": 18,
    "neck.down4": 19,
    "neck.bottom_up5": 21,
    "head.box": "22.cv2",  # the box branch of each level
    "head.cls": "22.cv3",  # the classification branch of each level
}
DFL = "model.22.dfl.conv.weight"  # Ultralytics' fixed projection onto the bins 0..15: our dfl_distances computes it


def ultralytics_name(ours: str) -> str:
    """The name in Ultralytics' state dict of one of our tensors, e.g. backbone.stem.2.m.0.cv1.0.weight ->
    model.2.m.0.cv1.conv.weight, head.cls.1.0.1.bias -> model.22.cv3.1.0.bn.bias, head.box.0.2.weight (the plain
    output conv) -> model.22.cv2.0.2.weight."""
    block = next(b for b in sorted(BLOCKS, key=len, reverse=True) if ours.startswith(b + "."))
    parts = ours[len(block) + 1 :].split(".")
    # Our Conv is Sequential(conv, bn, act): its tensors end in `.0.<weight>` (the conv) or `.1.<tensor>` (the
    # BatchNorm); Ultralytics' Conv names those `conv` and `bn`. The head's last conv (index 2) is a plain Conv2d.
    if len(parts) >= 2 and parts[-2] in ("0", "1") and not (block.startswith("head.") and parts[1] == "2"):
        parts[-2] = "conv" if parts[-2] == "0" else "bn"
    return ".".join(["model", str(BLOCKS[block]), *parts])


def read_ultralytics(path: Path) -> tuple[dict, list[str] | None, int | None]:
    """(state dict in float32, class names or None, training image size or None) of an Ultralytics detection file:
    a checkpoint .pt (needs the ultralytics package), a state dict saved with torch.save, or a .safetensors."""
    if not path.is_file():
        raise RecipeError(f"--weights {path} not found; give the .pt file Ultralytics wrote or you downloaded")
    if path.suffix == ".safetensors":
        return {k: v.float() for k, v in load_file(str(path)).items()}, None, None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # a plain state dict needs no classes
    except Exception:
        checkpoint = None
    if isinstance(checkpoint, dict) and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return {k: v.float() for k, v in checkpoint.items()}, None, None
    try:
        import ultralytics  # noqa: F401  the pickle names its classes: importing the package lets torch find them
    except ImportError:
        raise RecipeError(
            f"--weights {path} is an Ultralytics checkpoint (a pickle of its classes): reading it needs the "
            "ultralytics package; pip install 'accelerate-recipes[detect-compare]' (or pip install ultralytics), or "
            "give a state dict saved with torch.save(model.model.state_dict(), path)"
        ) from None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # a file you chose to trust
    except Exception as err:
        raise RecipeError(f"--weights {path} cannot be read ({str(err).splitlines()[0][:160]})") from None
    model = (checkpoint.get("ema") or checkpoint.get("model")) if isinstance(checkpoint, dict) else None
    if not isinstance(model, torch.nn.Module):
        raise RecipeError(f"--weights {path} holds no model (no `model` or `ema` entry); give a YOLOv8 detection .pt")
    names = getattr(model, "names", None)
    if isinstance(names, dict):
        names = [str(names[i]) for i in sorted(names)]
    train_args = checkpoint.get("train_args") or {}
    image_size = train_args.get("imgsz") if isinstance(train_args.get("imgsz"), int) else None
    return {k: v.float() for k, v in model.state_dict().items()}, names, image_size


def mapped_state(state: dict) -> tuple[str, dict]:
    """(size, our state dict) of a YOLOv8 state dict: the first size whose every tensor finds one of the file's,
    by the table above and by shape, using every tensor of the file."""
    prefix = "model.22.cv3.0.2.weight"
    if prefix not in state or "model.0.conv.weight" not in state:
        raise RecipeError(
            "the file is not YOLOv8 detection weights (no model.0.conv / model.22.cv3 tensors); convert a "
            "yolov8n/s/m.pt detection model (YOLO11 and segmentation models are laid out differently)"
        )
    num_classes, cls_width = state[prefix].shape[0], state["model.22.cv3.0.0.conv.weight"].shape[0]
    first_mismatch = None
    for size in SIZES:
        ours = Detector(num_classes=num_classes, size=size, cls_width=cls_width).state_dict()
        converted, fits = {}, True
        for name, tensor in ours.items():
            source = ultralytics_name(name)
            if source not in state or state[source].shape != tensor.shape:
                fits = False
                found = tuple(state[source].shape) if source in state else None
                first_mismatch = first_mismatch or (name, source, found)
                break
            converted[name] = state[source].to(tensor.dtype)
        unused = set(state) - {ultralytics_name(n) for n in ours} - {DFL}
        if fits and not unused:
            if DFL in state and not torch.equal(state[DFL].flatten(), torch.arange(16, dtype=state[DFL].dtype)):
                raise RecipeError("the file's DFL projection is not the bins 0..15 of YOLOv8; it is not YOLOv8 weights")
            return size, converted
    largest = "; the file may be a yolov8l/x, which this recipe has no size for" if first_mismatch else ""
    raise RecipeError(
        f"the file's tensors do not match a YOLOv8 {', '.join(SIZES)} detector (first misfit: our {first_mismatch[0]} "
        f"<- {first_mismatch[1]} of shape {first_mismatch[2]}){largest}; convert yolov8n/s/m.pt detection weights"
    )


def yolov8_to_recipe(weights: str, out: str, image_size: int | None = None) -> Path:
    """Convert Ultralytics YOLOv8 detection weights (yolov8n.pt, yolov8s.pt, yolov8m.pt: COCO-pretrained, or your
    own training's best.pt) into this recipe's files: out/model.safetensors and out/detector.json.

    Args:
        weights: the Ultralytics file: a checkpoint .pt (reading it needs the ultralytics package), or a state dict
            of its model saved with torch.save or as .safetensors.
        out: the folder to write; then give it to train.py's --init_weights (fine-tune, any class count), or as
            --model to --predict, --eval_only and --export.
        image_size: the image size detector.json records (what --predict and --eval_only use by default); default
            the checkpoint's training size, else 640.
    Returns:
        the folder written.
    """
    state, names, trained_size = read_ultralytics(Path(weights))
    size, converted = mapped_state(state)
    num_classes = converted["head.cls.0.2.weight"].shape[0]
    cls_width = converted["head.cls.0.0.0.weight"].shape[0]
    names = names if names and len(names) == num_classes else [f"class{i}" for i in range(num_classes)]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in converted.items()}, str(folder / "model.safetensors"))
    config = dict(
        size=size,
        num_classes=num_classes,
        names=names,
        image_size=int(image_size or trained_size or 640),
        channels_last=True,
        cls_width=int(cls_width),
        converted_from=str(weights),
    )
    (folder / MODEL_CONFIG).write_text(json.dumps(config, indent=2))
    print(
        f"{weights}: YOLOv8{size}, {num_classes} classes, {len(converted)} tensors converted -> "
        f"{folder / 'model.safetensors'} and {MODEL_CONFIG}; fine-tune with: python recipes/detect/train.py "
        f"--init_weights {folder} --data path/to/data.yaml"
    )
    return folder


if __name__ == "__main__":
    run(yolov8_to_recipe)
