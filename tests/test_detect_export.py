"""--export: the trained detector as files that deploy. onnx and torchscript end to end (decoded
boxes, scores and classes, NMS in the graph) giving the PyTorch model's predictions of the same
images; onnx-raw giving its raw outputs; --predict from the files finding PyTorch's boxes and
writing YOLO label files for every image of a folder tree. Reads the shared run detect_one
(conftest), writes elsewhere."""

import json
import shutil

import numpy as np
import onnxruntime
import pytest
import torch
from conftest import DETECT_SCRIPT, PYTHON, check, fails_with, recipe_env, run
from detector_files import build_model, read_model_config, upright_rgb
from onnx_export import END_TO_END_OUTPUTS, OUTPUTS, TorchScriptDetector, export_model, same_detections
from yolo_data import letterbox
from yolo_model import postprocess


def letterboxed_images(shapes, count: int, size: int) -> torch.Tensor:
    """The first validation images of the shared set, letterboxed as --predict does: float [count,
    3, size, size]."""
    files = sorted((shapes.parent / "images" / "val").glob("*.jpg"))[:count]
    boxed = [letterbox(np.asarray(upright_rgb(f)), size)[0] for f in files]
    return torch.from_numpy(np.stack(boxed)).permute(0, 3, 1, 2).float() / 255


def postprocessed_rows(model, images: torch.Tensor, conf: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's predictions as an end-to-end file lays them out: [B, 300, 6] rows and counts."""
    with torch.no_grad():
        found = postprocess(
            model(images), model.strides, model.reg_max, conf_threshold=conf, iou_threshold=0.7
        )
    rows = torch.zeros(len(found), 300, 6)
    for i, f in enumerate(found):
        rows[i, : len(f["boxes"])] = torch.cat(
            (f["boxes"], f["scores"][:, None], f["labels"][:, None].float()), 1
        )
    return rows, torch.tensor([len(f["boxes"]) for f in found])


@pytest.fixture(scope="module")
def exported(detect_one, tmp_path_factory):
    """The shared run's model exported three ways, in-process, at conf 0.01 (the trained model is
    not sure of much)."""
    folder = tmp_path_factory.mktemp("exported")
    files = {}
    for fmt, name in (
        ("onnx", "model.onnx"),
        ("torchscript", "model.torchscript"),
        ("onnx-raw", "model_raw.onnx"),
    ):
        files[fmt] = export_model(detect_one.out, folder / name, fmt, conf_threshold=0.01)
    return files


def test_end_to_end_exports_give_pytorchs_predictions_of_the_same_images(exported, detect_one, detect_shapes):
    config = read_model_config(detect_one.out)
    model, _ = build_model("n", 3, False, weights=detect_one.out, cls_width=config["cls_width"])
    model.eval()
    # another batch and shape than the export traced
    images = letterboxed_images(detect_shapes, 12, 128)
    expected = postprocessed_rows(model, images, 0.01)
    assert int(expected[1].sum()) >= 10  # detections to compare
    session = onnxruntime.InferenceSession(str(exported["onnx"]), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == list(END_TO_END_OUTPUTS)
    inside = json.loads(session.get_modelmeta().custom_metadata_map["detector.json"])
    assert inside == dict(config, end_to_end=True, conf_threshold=0.01, iou_threshold=0.7, max_detections=300)
    rows, counts = (torch.from_numpy(o) for o in session.run(None, {"images": images.numpy()}))
    assert rows.shape == (12, 300, 6) and counts.dtype == torch.int64
    assert same_detections((rows, counts), expected) is None
    assert (rows[0, int(counts[0]) :] == 0).all()  # zeros past the count
    scripted = TorchScriptDetector(exported["torchscript"])
    assert scripted.config == inside
    assert same_detections(tuple(scripted.raw(images)), expected) is None
    # the check is one that can fail: another threshold's predictions are other detections
    assert same_detections((rows, counts), postprocessed_rows(model, images, 0.3)) is not None


def test_raw_onnx_export_gives_the_networks_outputs(exported, detect_one):
    config = read_model_config(detect_one.out)
    model, _ = build_model("n", 3, False, weights=detect_one.out, cls_width=config["cls_width"])
    session = onnxruntime.InferenceSession(str(exported["onnx-raw"]), providers=["CPUExecutionProvider"])
    assert json.loads(session.get_modelmeta().custom_metadata_map["detector.json"]) == config
    images = torch.rand(3, 3, 96, 160, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(images)
    found = session.run(None, {"images": images.numpy()})
    assert [o.name for o in session.get_outputs()] == list(OUTPUTS)
    for ours, theirs in zip(expected, found):
        # float32 convolutions summed in another order:
        # rounding far below 1e-3 on logits of a few units
        torch.testing.assert_close(torch.from_numpy(theirs), ours, rtol=1e-3, atol=1e-3)


def test_predict_from_the_exported_file_finds_pytorchs_boxes_and_writes_yolo_labels(
    exported, detect_one, detect_shapes, tmp_path
):
    env = recipe_env(tmp_path)
    tree = tmp_path / "images"
    val = sorted((detect_shapes.parent / "images" / "val").glob("*.jpg"))
    (tree / "deeper").mkdir(parents=True)
    for i, f in enumerate(val[:6]):
        shutil.copy(f, tree / ("deeper" if i % 2 else "") / f.name)
    for model_path, out in ((exported["onnx"], "onnx"), (detect_one.out, "torch")):
        predict = [PYTHON, DETECT_SCRIPT, "--predict", tree, "--model", model_path, "--conf_threshold", 0.01]
        check(run([*predict, "--predict_dir", tmp_path / out, "--predict_device", "cpu"], env))
    from_onnx = json.loads((tmp_path / "onnx" / "detections.json").read_text())
    from_torch = json.loads((tmp_path / "torch" / "detections.json").read_text())
    assert len(from_onnx) == len(from_torch) == 6 and sum(len(e["detections"]) for e in from_torch) > 0
    for a, b in zip(from_onnx, from_torch):
        assert [d["class_id"] for d in a["detections"]] == [d["class_id"] for d in b["detections"]]
        for x, y in zip(a["detections"], b["detections"]):
            assert (
                max(abs(p - q) for p, q in zip(x["box"], y["box"])) < 0.05
                and abs(x["score"] - y["score"]) < 1e-3
            )
    # one YOLO label file per image, subfolders kept:
    # class cx cy w h, normalised, one line per detection
    labels = sorted(
        p.relative_to(tmp_path / "torch" / "labels") for p in (tmp_path / "torch" / "labels").rglob("*")
    )
    assert [str(p) for p in labels if p.suffix] == sorted(
        [f.with_suffix(".txt").name for f in val[:6:2]] + [f"deeper/{f.stem}.txt" for f in val[1:6:2]]
    )
    entry = from_torch[0]
    lines = (tmp_path / "torch" / "labels" / f"{val[0].stem}.txt").read_text().splitlines()
    assert len(lines) == len(entry["detections"])
    width, height = upright_rgb(entry["image"]).size
    for line, det in zip(lines, entry["detections"]):
        c, cx, cy, w, h = line.split()
        x1, y1, x2, y2 = det["box"]
        assert int(c) == det["class_id"]
        assert [float(cx), float(cy), float(w), float(h)] == pytest.approx(
            [(x1 + x2) / 2 / width, (y1 + y2) / 2 / height, (x2 - x1) / width, (y2 - y1) / height], abs=1e-4
        )


def test_export_errors(detect_shapes, tmp_path):
    env = recipe_env(tmp_path)
    fails_with(
        run([PYTHON, DETECT_SCRIPT, "--export", "tflite", "--model", tmp_path], env), "unknown --export"
    )
    fails_with(run([PYTHON, DETECT_SCRIPT, "--export", "onnx", "--model", tmp_path], env), "detector.json")
    both = run([PYTHON, DETECT_SCRIPT, "--export", "onnx", "--predict", detect_shapes.parent], env)
    fails_with(both, "give one of --predict, --export and --eval_only, not --predict and --export")
