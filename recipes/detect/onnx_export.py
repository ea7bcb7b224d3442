"""The trained detector as a file that deploys, what `train.py --export` writes, and those files run
in place of the PyTorch model, what `train.py --predict IMAGES --model model.onnx` (or
model.torchscript) uses.

    python recipes/detect/train.py --export onnx --model outputs/detect          # outputs/detect/model.onnx
    python recipes/detect/train.py --export torchscript --model outputs/detect   # model.torchscript
    python recipes/detect/train.py --export onnx-raw --model outputs/detect      # the network alone
    python recipes/detect/train.py --predict photo.jpg --model outputs/detect/model.onnx

`onnx` and `torchscript` are end to end (end_to_end.EndToEnd): input `images` float32 [B, 3, H, W]
in [0, 1] (H and W multiples of 32; batch, height and width dynamic), outputs `detections` [B,
max_det, 6] (x1, y1, x2, y2 in input pixels, score, class id; best first, zeros past the image's
count) and `num_detections` [B]; decoding, the confidence threshold, NMS and max_det are in the
graph (ONNX's NonMaxSuppression), at the --conf_threshold (default 0.25), --iou_threshold and
max_det (300) of --predict. `onnx-raw` holds the network only, as before: outputs `stride8`,
`stride16` and `stride32`, the raw per-level tensors, for yolo_model.postprocess.

detector.json (class names, image size, and for end-to-end files the thresholds) travels inside: as
the ONNX metadata entry `detector.json`, and as the TorchScript file's extra file of that name. ONNX
is written by torch's exporter (torch.onnx.export with dynamo=True: the onnx and onnxscript
packages), TorchScript by torch.jit.trace; after writing, onnxruntime (or torch.jit.load) runs the
file on a batch of another size than the one traced and must give the PyTorch model's outputs.
Install for ONNX: pip install 'accelerate-recipes[export]'.
"""

import json
from pathlib import Path

import torch
from detector_files import MODEL_CONFIG, build_model, read_model_config
from end_to_end import EndToEnd
from yolo_model import Detector

from accelerate_recipes import RecipeError

EXPORTS = ("onnx", "torchscript", "onnx-raw")  # --export's choices
OUTPUTS = ("stride8", "stride16", "stride32")  # the raw network's outputs (onnx-raw)
END_TO_END_OUTPUTS = ("detections", "num_detections")
MAX_DETECTIONS = 300  # rows per image of an end-to-end file: the recipe's max_det
# onnxruntime and PyTorch sum the convolutions in another order: float32 rounding, growing with
# depth, on logits of a few units; 1e-3 of the value (and 1e-3 absolute near zero) is far above that
# and far below a wrong weight.
TOLERANCE = 1e-3


def _onnx_packages():
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  what torch's exporter writes the graph with
    except ImportError as err:
        raise RecipeError(
            f"--export onnx needs the onnx, onnxscript and onnxruntime packages ({err.name} is missing); "
            "pip install 'accelerate-recipes[export]'"
        ) from None
    return onnx, onnxruntime


def saved_detector(model_dir: Path) -> tuple[Detector, dict]:
    """The model saved in `model_dir`, in eval mode, and its detector.json."""
    config = read_model_config(model_dir)
    model, _ = build_model(
        config["size"], config["num_classes"], False, weights=model_dir, cls_width=config.get("cls_width")
    )
    return model.eval(), config


def check_images(size: int, batch: int) -> torch.Tensor:
    """The check's input: seeded noise, `batch` images of size x (size + 32)."""
    return torch.rand(batch, 3, size, size + 32, generator=torch.Generator().manual_seed(0))


def same_detections(found: tuple, expected: tuple) -> float | None:
    """None when two end-to-end outputs hold the same detections (counts equal, and each row of one
    within 0.1 of a row of the other, boxes in pixels and scores and classes x 100: a score 1e-3 off
    counts as a box 0.1 px off, and another class is far); else the largest distance. Equal scores
    may come in either order: rows are matched."""
    (rows, counts), (their_rows, their_counts) = found, expected
    if not torch.equal(counts.long(), their_counts.long()):
        return float("inf")
    worst = 0.0
    for image, count in enumerate(counts.tolist()):
        mine, theirs = rows[image, :count].clone(), their_rows[image, :count].clone()
        mine[:, 4:] *= 100
        theirs[:, 4:] *= 100
        if count:
            worst = max(worst, float(torch.cdist(mine, theirs, p=float("inf")).min(dim=1).values.max()))
    return None if worst < 0.1 else worst


def export_model(
    model_dir: Path,
    path: Path,
    fmt: str = "onnx",
    image_size: int | None = None,
    conf_threshold: float = 0.25,
    iou_threshold: float = 0.7,
) -> Path:
    """Write the model saved in `model_dir` (model.safetensors + detector.json) as `path` in the
    format `fmt` (onnx, torchscript or onnx-raw), check it against PyTorch, and return `path`.
    image_size: the side of the check's input (default the model's training size); the file itself
    takes any multiple of 32."""
    model, config = saved_detector(model_dir)
    size = image_size or config["image_size"]
    example = check_images(size, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "onnx-raw":
        network, outputs = model, list(OUTPUTS)
    else:
        network = EndToEnd(model, conf_threshold, iou_threshold, MAX_DETECTIONS).eval()
        outputs = list(END_TO_END_OUTPUTS)
        config = dict(
            config,
            end_to_end=True,
            conf_threshold=conf_threshold,
            iou_threshold=iou_threshold,
            max_detections=MAX_DETECTIONS,
        )
    if fmt == "torchscript":
        with torch.no_grad():
            # checked below, on another batch
            traced = torch.jit.trace(network, (example,), check_trace=False)
        torch.jit.save(traced, str(path), _extra_files={MODEL_CONFIG: json.dumps(config)})
        runner = TorchScriptDetector(path)
    else:
        onnx, _ = _onnx_packages()
        dim = torch.export.Dim
        dynamic = {0: dim("batch", min=1, max=4096), 2: 32 * dim("h32", max=512), 3: 32 * dim("w32", max=512)}
        torch.onnx.export(
            network,
            (example,),
            str(path),
            dynamo=True,
            input_names=["images"],
            output_names=outputs,
            dynamic_shapes={"images": dynamic},
            external_data=False,  # one file to deploy (a model under 2 GB)
            verbose=False,
        )
        graph = onnx.load(str(path))
        onnx.helper.set_model_props(graph, {MODEL_CONFIG: json.dumps(config)})
        onnx.save(graph, str(path))
        runner = OnnxDetector(path)
    check = check_images(size, 3)  # another batch than the one traced: the file follows it
    with torch.no_grad():
        expected = network(check)
    found = runner.raw(check)
    if fmt == "onnx-raw":
        for name, ours, theirs in zip(OUTPUTS, expected, found):
            if not torch.allclose(theirs, ours, rtol=TOLERANCE, atol=TOLERANCE):
                raise RecipeError(
                    f"{path}: onnxruntime's {name} differs from PyTorch's by up to "
                    f"{(theirs - ours).abs().max():.2e}; the export is wrong, report it with your torch "
                    "and onnx versions"
                )
    else:
        distance = same_detections(found, expected)
        if distance is not None:
            raise RecipeError(
                f"{path}: its detections differ from PyTorch's (counts {found[1].tolist()} against "
                f"{expected[1].tolist()}, distance {distance:.3g}); the export is wrong, report it with your "
                "torch and onnx versions"
            )
    kind = "the network's raw outputs" if fmt == "onnx-raw" else "end to end: boxes, scores, classes, NMS"
    runtime = "torch.jit.load" if fmt == "torchscript" else "onnxruntime"
    model_name = f"yolo-{config['size']} ({config['num_classes']} classes)"
    print(f"{path}: {fmt} of {model_name}, {kind}; checked with {runtime}")
    return path


def end_to_end_detections(detections: torch.Tensor, counts: torch.Tensor) -> list[dict]:
    """An end-to-end file's outputs as postprocess returns them: per image dict(boxes, scores,
    labels)."""
    return [
        dict(boxes=rows[:count, :4], scores=rows[:count, 4], labels=rows[:count, 5].long())
        for rows, count in zip(detections, counts.tolist())
    ]


class OnnxDetector:
    """A model.onnx that --export wrote, run by onnxruntime. raw(images float [B, 3, H, W] in [0,
    1]) gives the file's outputs (on the CPU); detect(images, conf_threshold, iou_threshold) per
    image dict(boxes, scores, labels), as yolo_model.postprocess gives them. `config` is the
    detector.json inside."""

    strides, reg_max = Detector.strides, Detector.reg_max

    def __init__(self, path: Path):
        _, onnxruntime = _onnx_packages()
        try:
            self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as err:
            raise RecipeError(
                f"{path} cannot be loaded by onnxruntime ({str(err).splitlines()[0][:160]}); give a "
                "model.onnx written by train.py --export onnx"
            ) from None
        metadata = self.session.get_modelmeta().custom_metadata_map
        if MODEL_CONFIG not in metadata:
            raise RecipeError(
                f"{path} has no {MODEL_CONFIG} in its metadata; give a model.onnx written by --export onnx"
            )
        self.config = json.loads(metadata[MODEL_CONFIG])
        self.names = [o.name for o in self.session.get_outputs()]

    def raw(self, images: torch.Tensor) -> list[torch.Tensor]:
        outputs = self.session.run(self.names, {"images": images.detach().float().cpu().numpy()})
        return [torch.from_numpy(o) for o in outputs]

    def detect(self, images: torch.Tensor, conf_threshold: float, iou_threshold: float) -> list[dict]:
        from yolo_model import postprocess

        if not self.config.get("end_to_end"):
            return postprocess(self.raw(images), self.strides, self.reg_max, conf_threshold, iou_threshold)
        return [keep_above(d, conf_threshold) for d in end_to_end_detections(*self.raw(images))]


class TorchScriptDetector(OnnxDetector):
    """A model.torchscript that --export torchscript wrote, run by torch.jit.load; called as
    OnnxDetector."""

    def __init__(self, path: Path):
        extra = {MODEL_CONFIG: ""}
        try:
            self.module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except Exception as err:
            raise RecipeError(
                f"{path} cannot be loaded by torch.jit.load ({str(err).splitlines()[0][:160]}); give a "
                "model.torchscript written by train.py --export torchscript"
            ) from None
        if not extra[MODEL_CONFIG]:
            raise RecipeError(
                f"{path} has no {MODEL_CONFIG} inside; give a file written by --export torchscript",
            )
        self.config = json.loads(extra[MODEL_CONFIG])

    def raw(self, images: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.module(images.detach().float().cpu()))


def keep_above(detections: dict, conf_threshold: float) -> dict:
    """The detections scoring above conf_threshold (an end-to-end file holds those above its
    own)."""
    keep = detections["scores"] > conf_threshold
    return {k: v[keep] for k, v in detections.items()}
