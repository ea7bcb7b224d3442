"""--export onnx: the trained detector written by torch's ONNX exporter, run by onnxruntime with PyTorch's outputs,
and --predict from the ONNX file finding PyTorch's boxes. Reads the shared run detect_one (conftest), writes
elsewhere."""

import json

import onnxruntime
import torch
from conftest import DETECT_SCRIPT, PYTHON, check, fails_with, recipe_env, run
from detector_files import build_model, read_model_config


def test_export_onnx_gives_pytorch_outputs_and_predicts_the_same_boxes(detect_one, detect_shapes, tmp_path):
    env = recipe_env(tmp_path)
    model_dir, exported = detect_one.out, tmp_path / "exported"
    export = [PYTHON, DETECT_SCRIPT, "--export", "onnx", "--model", model_dir, "--output_dir", exported]
    proc = check(run(export, env, timeout=500))
    onnx_file = exported / "model.onnx"
    assert f"{onnx_file}: ONNX of yolo-n (3 classes), checked with onnxruntime" in proc.output
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    config = read_model_config(model_dir)
    assert json.loads(session.get_modelmeta().custom_metadata_map["detector.json"]) == config
    model, _ = build_model("n", 3, False, weights=model_dir, cls_width=config["cls_width"])
    # another batch and size than the export traced (batch, height and width are dynamic)
    images = torch.rand(3, 3, 96, 160, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(images)
    found = session.run(None, {"images": images.numpy()})
    assert [o.name for o in session.get_outputs()] == ["stride8", "stride16", "stride32"]
    for ours, theirs in zip(expected, found):
        # float32 convolutions summed in another order: rounding far below 1e-3 on logits of a few units
        torch.testing.assert_close(torch.from_numpy(theirs), ours, rtol=1e-3, atol=1e-3)

    val_images = detect_shapes.parent / "images" / "val"
    for model_path, out in ((onnx_file, "onnx"), (model_dir, "torch")):
        predict = [PYTHON, DETECT_SCRIPT, "--predict", val_images, "--model", model_path, "--conf_threshold", 0.01]
        check(run([*predict, "--predict_dir", tmp_path / out, "--predict_device", "cpu"], env))
    from_onnx = json.loads((tmp_path / "onnx" / "detections.json").read_text())
    from_torch = json.loads((tmp_path / "torch" / "detections.json").read_text())
    assert len(from_onnx) == len(from_torch) == 21 and sum(len(e["detections"]) for e in from_torch) > 0
    for a, b in zip(from_onnx, from_torch):
        assert [d["class_id"] for d in a["detections"]] == [d["class_id"] for d in b["detections"]]
        for x, y in zip(a["detections"], b["detections"]):
            assert max(abs(p - q) for p, q in zip(x["box"], y["box"])) < 0.05 and abs(x["score"] - y["score"]) < 1e-3


def test_export_errors(detect_shapes, tmp_path):
    env = recipe_env(tmp_path)
    fails_with(run([PYTHON, DETECT_SCRIPT, "--export", "tflite", "--model", tmp_path], env), "unknown --export")
    fails_with(run([PYTHON, DETECT_SCRIPT, "--export", "onnx", "--model", tmp_path], env), "detector.json")
    both = run([PYTHON, DETECT_SCRIPT, "--export", "onnx", "--predict", detect_shapes.parent], env)
    fails_with(both, "give --export alone")
