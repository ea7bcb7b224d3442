#!/usr/bin/env python
"""Ultralytics YOLOv8 detection weights as this recipe's model: converted once into model files
(model.safetensors + detector.json), or on the fly when train.py's --init_weights is given the .pt
itself.

    python recipes/detect/train.py --init_weights yolov8n.pt --data path/to/data.yaml    # on the fly
    python recipes/detect/ultralytics_weights.py --weights yolov8n.pt --out models/yolov8n        # once
    python recipes/detect/train.py --init_weights models/yolov8n --data path/to/data.yaml --epochs 50

Our detector's layers follow YOLOv8's (yolo_model.py), so the conversion is a table by module
position: Ultralytics' `model.<i>` is one of our named blocks, and inside a block its Conv's `conv`
/ `bn` are our Sequential's `0` / `1`. Every tensor is checked by shape, every tensor of ours must
be filled and every one of the file used (the fixed DFL projection `model.22.dfl` excepted, which
our decode computes). The size (n, s, m, l, x) and the class count are read from the shapes; the
classification branch keeps the file's hidden width (80 for COCO), so nothing of the file is lost
when a fine-tune changes the class count. A file of another task or family (segmentation, pose, OBB,
classification; YOLO11, YOLOv5u, YOLOv10, YOLO26, ...) is refused in one line that says what it is.

Reading Ultralytics' `.pt` files: they are pickles of Ultralytics' classes, so reading one needs the
`ultralytics` package installed (`pip install 'accelerate-recipes[detect-compare]'`, or `pip install
ultralytics`); it is not a dependency of the recipes. The file is read by Ultralytics' own loader,
which maps the module paths of older releases (`ultralytics.yolo.*`) and paths pickled on Windows,
so an older best.pt reads as Ultralytics reads it. A state dict saved without those classes
(`torch.save(yolo.model.state_dict(), path)`, or a .safetensors of it) reads without it.
Ultralytics' pretrained weights are published under AGPL-3.0 (or its Enterprise licence); weights
converted from them, and models fine-tuned from those, carry that licence.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from yolo_model import SIZES, YOLOV8_LAYERS, Detector

from accelerate_recipes import RecipeError, run

BLOCKS = YOLOV8_LAYERS  # our block -> model.<index> of Ultralytics' file
# Ultralytics' fixed projection onto the bins 0..15: our dfl_distances computes it
DFL = "model.22.dfl.conv.weight"
# What a model's last layer (its head) says about its task, by Ultralytics' class name.
TASKS = {
    "Detect": "detection",
    "Segment": "segmentation",
    "Pose": "pose",
    "OBB": "oriented-box (OBB)",
    "Classify": "classification",
    "v10Detect": "detection",
    "WorldDetect": "open-vocabulary (YOLO-World) detection",
    "YOLOEDetect": "open-vocabulary (YOLOE) detection",
    "RTDETRDecoder": "RT-DETR detection",
}
# The family of a model by the name of the YAML it was
# built from (model.yaml["yaml_file"]), first match wins.
FAMILIES = [
    (r"yoloe", "YOLOE"),
    (r"rtdetr", "RT-DETR"),
    (r"world", "YOLO-World"),
    (r"yolo26", "YOLO26"),
    (r"yolo12", "YOLO12"),
    (r"yolo11", "YOLO11"),
    (r"yolov10", "YOLOv10"),
    (r"yolov9", "YOLOv9"),
    (r"yolov8", "YOLOv8"),
    (r"yolov6", "YOLOv6"),
    (r"yolov5", "YOLOv5u"),
    (r"yolov3", "YOLOv3u"),
]
# YOLOv8 detection's layer types in order (yolov8.yaml): what a .pt's model must be made of to
# convert. the backbone
YOLOV8_TYPES = ["Conv", "Conv", "C2f", "Conv", "C2f", "Conv", "C2f", "Conv", "C2f", "SPPF"]
YOLOV8_TYPES += ["Upsample", "Concat", "C2f", "Upsample", "Concat", "C2f"]  # the neck, top down
# bottom up, and the head
YOLOV8_TYPES += ["Conv", "Concat", "C2f", "Conv", "Concat", "C2f", "Detect"]
SUPPORTED = "a yolov8n/s/m/l/x.pt detection model, or the best.pt of a YOLOv8 detection training"


def ultralytics_name(ours: str) -> str:
    """The name in Ultralytics' state dict of one of our tensors, e.g.
    backbone.stem.2.m.0.cv1.0.weight -> model.2.m.0.cv1.conv.weight, head.cls.1.0.1.bias ->
    model.22.cv3.1.0.bn.bias, head.box.0.2.weight (the plain output conv) ->
    model.22.cv2.0.2.weight."""
    block = next(b for b in sorted(BLOCKS, key=len, reverse=True) if ours.startswith(b + "."))
    parts = ours[len(block) + 1 :].split(".")
    # Our Conv is Sequential(conv, bn, act): its tensors end in `.0.<weight>` (the conv) or
    # `.1.<tensor>` (the BatchNorm); Ultralytics' Conv names those `conv` and `bn`. The head's last
    # conv (index 2) is a plain Conv2d.
    if len(parts) >= 2 and parts[-2] in ("0", "1") and not (block.startswith("head.") and parts[1] == "2"):
        parts[-2] = "conv" if parts[-2] == "0" else "bn"
    return ".".join(["model", str(BLOCKS[block]), *parts])


def describe_model(model: torch.nn.Module) -> str | None:
    """None for a YOLOv8 detection model; else what the model is, e.g. "a YOLO11 detection model
    (yolo11n.yaml)", "a YOLOv8 segmentation model (yolov8n-seg.yaml)", from its head's class and the
    YAML it was built from."""
    layers = list(getattr(model, "model", []))
    types = [type(layer).__name__ for layer in layers]
    yaml = getattr(model, "yaml", None)
    yaml_file = str(yaml.get("yaml_file", "")) if isinstance(yaml, dict) else ""
    end_to_end = bool(yaml.get("end2end")) if isinstance(yaml, dict) else False
    if types == YOLOV8_TYPES and not end_to_end and "yolov8" in (yaml_file or "yolov8"):
        return None
    task = TASKS.get(types[-1] if types else "", "unknown-task")
    yaml_name = Path(yaml_file).name.lower()
    family = next((name for pattern, name in FAMILIES if re.search(pattern, yaml_name)), None)
    if family is None:  # no YAML name: guess from the blocks, as their layouts differ
        blocks = set(types)
        family = "YOLO11 or YOLO26" if "C3k2" in blocks else "YOLOv5u" if "C3" in blocks else "another YOLO"
        family = "YOLOv10" if types and types[-1] == "v10Detect" else family
    article = "an" if family[0] in "AEIOU" or family.startswith("RT") else "a"
    built_from = f" ({Path(yaml_file).name})" if yaml_file else ""
    return f"{article} {family} {task} model{built_from}"


def describe_state(state: dict) -> str:
    """What a state dict that is not YOLOv8 detection weights holds, as far as its tensor names
    tell."""
    names = set(state)
    if any(".proto." in n for n in names):
        return "a segmentation model (it has a mask prototype branch, model.22.proto)"
    if any(n.startswith("model.22.cv4.") for n in names):
        return "a pose or oriented-box (OBB) model (it has a third head branch, model.22.cv4)"
    if any(".linear." in n for n in names) and "model.22.cv3.0.2.weight" not in names:
        return "a classification model (its head is a linear layer)"
    if any("one2one" in n for n in names):
        return "an end-to-end model (YOLOv10 or YOLO26: it has one2one head branches)"
    if any(".m.0.m.0." in n or ".attn." in n for n in names):
        return "a YOLO11-style model (C3k2 / attention blocks)"
    return "something else (it lacks YOLOv8's model.0.conv and model.22.cv3 tensors)"


def torch_checkpoint(path: Path):
    """An Ultralytics .pt read as Ultralytics reads it: its loader remaps older releases' module
    paths and pickled Windows paths. Needs the ultralytics package."""
    try:
        from ultralytics.nn.tasks import torch_safe_load
    except ImportError:
        raise RecipeError(
            f"{path} is an Ultralytics checkpoint (a pickle of its classes): reading it needs the "
            "ultralytics package; pip install 'accelerate-recipes[detect-compare]' (or pip install "
            "ultralytics), or convert it where ultralytics is installed (ultralytics_weights.py)"
        ) from None
    try:
        # a file you chose to trust: it unpickles Ultralytics' classes
        checkpoint, _ = torch_safe_load(str(path))
    except Exception as err:
        message = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise RecipeError(f"{path} cannot be read as an Ultralytics checkpoint ({message})") from None
    return checkpoint


def read_ultralytics(path: Path) -> tuple[dict, list[str] | None, int | None]:
    """(state dict in float32, class names or None, training image size or None) of an Ultralytics
    detection
    file: a checkpoint .pt (needs the ultralytics package), a state dict saved with torch.save, or a
    .safetensors."""
    if not path.is_file():
        raise RecipeError(f"{path} not found; give the .pt file Ultralytics wrote or you downloaded")
    if path.suffix == ".safetensors":
        return {k: v.float() for k, v in load_file(str(path)).items()}, None, None
    try:
        # a plain state dict needs no classes
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        checkpoint = None
    plain = isinstance(checkpoint, dict) and all(isinstance(v, torch.Tensor) for v in checkpoint.values())
    if plain and checkpoint:
        return {k: v.float() for k, v in checkpoint.items()}, None, None
    checkpoint = torch_checkpoint(path)
    model = (checkpoint.get("ema") or checkpoint.get("model")) if isinstance(checkpoint, dict) else None
    if not isinstance(model, torch.nn.Module):
        raise RecipeError(f"{path} holds no model (no `model` or `ema` entry); give {SUPPORTED}")
    what = describe_model(model)
    if what is not None:
        raise RecipeError(
            f"{path} is {what}, not YOLOv8 detection: this recipe's layers are YOLOv8's; give {SUPPORTED}"
        )
    names = getattr(model, "names", None)
    if isinstance(names, dict):
        names = [str(names[i]) for i in sorted(names)]
    train_args = checkpoint.get("train_args") or {}
    # older releases: a namespace
    train_args = train_args if isinstance(train_args, dict) else vars(train_args)
    image_size = train_args.get("imgsz") if isinstance(train_args.get("imgsz"), int) else None
    return {k: v.float() for k, v in model.state_dict().items()}, names, image_size


def mapped_state(state: dict) -> tuple[str, dict]:
    """(size, our state dict) of a YOLOv8 state dict: the first size whose every tensor finds one of
    the file's, by the table above and by shape, using every tensor of the file."""
    prefix = "model.22.cv3.0.2.weight"
    if prefix not in state or "model.0.conv.weight" not in state or "model.22.cv4.0.0.conv.weight" in state:
        raise RecipeError(
            f"the file is {describe_state(state)}, not YOLOv8 detection weights; give {SUPPORTED}",
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
            bins = torch.arange(16, dtype=state[DFL].dtype) if DFL in state else None
            if DFL in state and not torch.equal(state[DFL].flatten(), bins):
                raise RecipeError(
                    "the file's DFL projection is not the bins 0..15 of YOLOv8; it is not YOLOv8 weights",
                )
            return size, converted
    raise RecipeError(
        f"the file is {describe_state(state)}: its tensors match no YOLOv8 n/s/m/l/x detector (first misfit: "
        f"our {first_mismatch[0]} <- {first_mismatch[1]} of shape {first_mismatch[2]}); give {SUPPORTED}"
    )


def converted_start(weights: str | Path) -> dict:
    """Ultralytics YOLOv8 detection weights converted in memory: dict(state: our state dict, size,
    num_classes, names, cls_width, image_size: the training size the checkpoint records, or
    None)."""
    state, names, trained_size = read_ultralytics(Path(weights))
    size, converted = mapped_state(state)
    num_classes = converted["head.cls.0.2.weight"].shape[0]
    names = names if names and len(names) == num_classes else [f"class{i}" for i in range(num_classes)]
    return dict(
        state=converted,
        size=size,
        num_classes=int(num_classes),
        names=names,
        cls_width=int(converted["head.cls.0.0.0.weight"].shape[0]),
        image_size=trained_size,
    )


def yolov8_to_recipe(weights: str, out: str, image_size: int | None = None) -> Path:
    """Convert Ultralytics YOLOv8 detection weights (yolov8n.pt ... yolov8x.pt: COCO-pretrained, or
    your own training's best.pt) into this recipe's files: out/model.safetensors and
    out/detector.json.

    Args: weights: the Ultralytics file: a checkpoint .pt (reading it needs the ultralytics
        package), or a state dict of its model saved with torch.save or as .safetensors. out: the
        folder to write; then give it to train.py's --init_weights (fine-tune, any class count), or
        as --model to --predict, --eval_only and --export. image_size: the image size detector.json
        records (what --predict and --eval_only use by default); default the checkpoint's training
        size, else 640.
    Returns:
        the folder written.
    """
    # here, not at the top: detector_files imports this module
    from detector_files import MODEL_CONFIG

    start = converted_start(weights)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in start["state"].items()}, str(folder / "model.safetensors"))
    config = dict(
        size=start["size"],
        num_classes=start["num_classes"],
        names=start["names"],
        image_size=int(image_size or start["image_size"] or 640),
        channels_last=True,
        cls_width=start["cls_width"],
        converted_from=str(weights),
    )
    (folder / MODEL_CONFIG).write_text(json.dumps(config, indent=2))
    print(
        f"{weights}: YOLOv8{start['size']}, {start['num_classes']} classes, {len(start['state'])} tensors "
        f"converted -> {folder / 'model.safetensors'} and {MODEL_CONFIG}; fine-tune with: python "
        f"recipes/detect/train.py --init_weights {folder} --data path/to/data.yaml"
    )
    return folder


if __name__ == "__main__":
    run(yolov8_to_recipe)
