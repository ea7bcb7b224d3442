"""Fine-tuning controls of the detection recipe: --freeze N fixes YOLOv8's first N layers (weights
and BatchNorm statistics, the layers Ultralytics' freeze counts), --patience stops after epochs
without a better model (100 by default, as Ultralytics'), and --best_by picks what model_best is
chosen by."""

import json

import pytest
import torch
from conftest import DETECT_SCRIPT, NO_PLOTS, PYTHON, check, fails_with, read_results, recipe_env, run
from safetensors.torch import load_file
from ultralytics_weights import ultralytics_name
from yolo_loss import DetectionLoss, pad_targets
from yolo_model import Detector


def test_freeze_fixes_the_first_yolov8_layers_and_their_batchnorm_statistics():
    torch.manual_seed(0)
    model = Detector(3, "n")
    blocks = model.freeze(10)
    assert (len(blocks), blocks[0], blocks[-1]) == (10, "backbone.stem.0", "backbone.stage5.2")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    # the tensors Ultralytics' freeze=10 fixes: every one of model.0. to model.9.
    assert {ultralytics_name(n).split(".")[1] for n in frozen} == {str(i) for i in range(10)}
    assert frozen == {n for n in dict(model.named_parameters()) if n.startswith("backbone.")}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # even given every parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    criterion = DetectionLoss(num_classes=3, strides=model.strides, reg_max=model.reg_max)
    targets = pad_targets([torch.tensor([[0.0, 8, 8, 40, 40]]), torch.tensor([[2.0, 20, 10, 60, 50]])])
    # what the recipe calls each epoch (and DDP's wrapper
    # passes on): the frozen blocks stay in eval mode
    model.train()
    assert not model.backbone.stem[0][1].training and model.neck.down3[1].training
    for _ in range(2):
        loss, _ = criterion(model(torch.rand(2, 3, 64, 64)), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.state_dict()
    for name, tensor in before.items():
        if name.startswith("backbone."):  # weights, biases and BatchNorm running statistics alike
            assert torch.equal(after[name], tensor), name
    moved = [n for n in before if n.startswith("neck.") and not torch.equal(after[n], before[n])]
    assert any(n.endswith("running_mean") for n in moved) and any(n.endswith(".0.weight") for n in moved)
    with pytest.raises(ValueError, match="0 to 22"):
        Detector(3, "n").freeze(23)


def test_freeze_and_patience_in_a_fine_tune(detect_one, detect_shapes, tmp_path):
    """From the shared run's model, --freeze 10 --patience 1 --best_by fitness at lr 0: the
    backbone's weights and BatchNorm statistics stay those of the start while the neck's statistics
    move, and the run stops at the first evaluation whose fitness is not better than the best so
    far."""
    out = tmp_path / "out"
    args = ["--data", detect_shapes, "--init_weights", detect_one.out, "--freeze", 10, "--patience", 1]
    args += ["--lr", 0]
    args += ["--best_by", "fitness"]
    # epochs enough for the fitness to stop rising: at lr 0 only the neck's statistics move it
    args += ["--image_size", 64, "--batch_size", 16, "--epochs", 12, "--eval_every", 1, "--tracker", "none"]
    args += ["--num_workers", 0, "--checkpoint_every", 0, "--log_every", 100, *NO_PLOTS, "--output_dir", out]
    proc = check(run([PYTHON, DETECT_SCRIPT, *args], recipe_env(tmp_path), timeout=500))
    assert "--freeze 10: YOLOv8 layers 0-9 fixed (backbone.stem.0, " in proc.output
    start = load_file(str(detect_one.out / "model.safetensors"))
    tuned = load_file(str(out / "model.safetensors"))
    backbone = [k for k in start if k.startswith("backbone.")]
    assert all(torch.equal(start[k], tuned[k]) for k in backbone)
    assert any(not torch.equal(start[k], tuned[k]) for k in start if k.startswith("neck.") and "running" in k)
    results = read_results(out)
    assert results["trainable_parameters"] < 0.7 * results["parameters"]
    metrics = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    evaluations = [m["eval/fitness"] for m in metrics if "eval/fitness" in m]
    # stopped at the first evaluation not strictly better than every earlier one, or never met one
    assert all(later > earlier for earlier, later in zip(evaluations[:-2], evaluations[1:-1])), evaluations
    assert results["stopped_early"] and len(evaluations) < 12 and evaluations[-1] <= max(evaluations[:-1])
    assert results["early_stopping_patience"] == 1 and results["best_epoch"] == len(evaluations) - 1
    assert results["metric_for_best_model"] == "eval_fitness" and results["best_metric"] == max(evaluations)


def test_default_patience_is_a_hundred_epochs_counted_in_evaluations(detect_one):
    # 12 epochs, evaluated every 12: 100 epochs are 9 evaluations
    results = read_results(detect_one.out)
    assert results["patience"] is None and results["early_stopping_patience"] == 9
    assert results["best_by"] == "map50_95" and results["metric_for_best_model"] == "eval_map50_95"


def test_fine_tune_flag_errors(detect_shapes, tmp_path):
    env = recipe_env(tmp_path)
    base = [PYTHON, DETECT_SCRIPT, "--data", detect_shapes, "--tracker", "none"]
    base += ["--output_dir", tmp_path / "out"]
    fails_with(run([*base, "--freeze", 30], env), "--freeze 30", "0 to 22")
    fails_with(run([*base, "--patience", 5, "--early_stopping_patience", 2], env), "not both")
