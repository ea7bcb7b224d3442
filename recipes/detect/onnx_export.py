"""The trained detector as ONNX, what `train.py --export onnx` writes, and that file run by onnxruntime in place of the
PyTorch model, what `train.py --predict IMAGES --model model.onnx` uses.

    python recipes/detect/train.py --export onnx --model outputs/detect          # outputs/detect/model.onnx
    python recipes/detect/train.py --predict photo.jpg --model outputs/detect/model.onnx

The file holds the network only: input `images` float32 [B, 3, H, W] in [0, 1] (H and W multiples of 32, all three
dynamic), outputs `stride8`, `stride16` and `stride32`, the raw per-level tensors Detector.forward returns (box DFL
logits, then class logits); decoding and NMS stay in yolo_model.postprocess, the same code as for the PyTorch model.
detector.json (class names, image size, ...) travels inside, as the ONNX metadata entry `detector.json`. Written by
torch's exporter (torch.onnx.export with dynamo=True: the onnx and onnxscript packages), checked after writing by
onnxruntime against PyTorch on one batch. Install: pip install 'accelerate-recipes[export]'.
"""

import json
from pathlib import Path

import torch
from detector_files import MODEL_CONFIG, build_model, read_model_config
from yolo_model import Detector

from accelerate_recipes import RecipeError

OUTPUTS = ("stride8", "stride16", "stride32")
# onnxruntime and PyTorch sum the convolutions in another order: float32 rounding, growing with depth, on logits of a
# few units; 1e-3 of the value (and 1e-3 absolute near zero) is far above that and far below a wrong weight.
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


def export_onnx(model_dir: Path, path: Path, image_size: int | None = None) -> Path:
    """Write the model saved in `model_dir` (model.safetensors + detector.json) as the ONNX file `path`, check it
    with onnxruntime against PyTorch, and return `path`. image_size: the side of the check's input (default the
    model's training size); the file itself takes any multiple of 32."""
    onnx, onnxruntime = _onnx_packages()
    config = read_model_config(model_dir)
    size = image_size or config["image_size"]
    model, _ = build_model(
        config["size"], config["num_classes"], False, weights=model_dir, cls_width=config.get("cls_width")
    )
    model.eval()
    example = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    dim = torch.export.Dim
    dynamic = {0: dim("batch", min=1, max=4096), 2: 32 * dim("height32", max=512), 3: 32 * dim("width32", max=512)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        model,
        (example,),
        str(path),
        dynamo=True,
        input_names=["images"],
        output_names=list(OUTPUTS),
        dynamic_shapes={"images": dynamic},
        verbose=False,
    )
    graph = onnx.load(str(path))
    onnx.helper.set_model_props(graph, {MODEL_CONFIG: json.dumps(config)})
    onnx.save(graph, str(path))
    with torch.no_grad():
        expected = model(example)
    found = OnnxDetector(path)(example)
    for name, ours, theirs in zip(OUTPUTS, expected, found):
        if not torch.allclose(theirs, ours, rtol=TOLERANCE, atol=TOLERANCE):
            raise RecipeError(
                f"{path}: onnxruntime's {name} differs from PyTorch's by up to "
                f"{(theirs - ours).abs().max():.2e}; the export is wrong, report it with your torch and onnx versions"
            )
    print(f"{path}: ONNX of yolo-{config['size']} ({config['num_classes']} classes), checked with onnxruntime")
    return path


class OnnxDetector:
    """An exported model.onnx run by onnxruntime, called like Detector: images float [B, 3, H, W] in [0, 1] -> the
    three raw per-level tensors (on the CPU), for yolo_model.postprocess. `config` is the detector.json inside."""

    strides, reg_max = Detector.strides, Detector.reg_max

    def __init__(self, path: Path):
        _, onnxruntime = _onnx_packages()
        try:
            self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as err:
            raise RecipeError(
                f"{path} cannot be loaded by onnxruntime ({str(err).splitlines()[0][:160]}); give a model.onnx "
                "written by train.py --export onnx"
            ) from None
        metadata = self.session.get_modelmeta().custom_metadata_map
        if MODEL_CONFIG not in metadata:
            raise RecipeError(
                f"{path} has no {MODEL_CONFIG} in its metadata; give a model.onnx written by --export onnx"
            )
        self.config = json.loads(metadata[MODEL_CONFIG])

    def __call__(self, images: torch.Tensor) -> list[torch.Tensor]:
        outputs = self.session.run(list(OUTPUTS), {"images": images.detach().float().cpu().numpy()})
        return [torch.from_numpy(o) for o in outputs]
