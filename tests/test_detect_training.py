"""The detection recipe trains for real on a generated YOLO-format set, evaluates each image once on
any world size, and its saved model drives --predict."""

import json

import pytest
import torch
from conftest import (
    ACCELERATE,
    CONFIGS,
    DETECT_SCRIPT,
    NAN_GRADIENT,
    NO_PLOTS,
    PYTHON,
    assert_nonfinite_gradients_handled,
    assert_quiet,
    check,
    check_png,
    fails_with,
    free_port,
    losses,
    read_audit,
    read_metrics,
    read_results,
    recipe_env,
    run,
)
from safetensors.torch import load_file
from synthetic_shapes import write_synthetic_dataset

from accelerate_recipes.meter import FIGURES
from accelerate_recipes.plots import read_confusion_matrix_csv

TRAIN = DETECT_SCRIPT
SMALL = [
    "--image_size",
    "128",
    "--optimizer",
    "adamw",
    "--lr",
    "0.002",
    "--tracker",
    "none",
    "--num_workers",
    "0",
    "--log_every",
    "1",
]


@pytest.fixture(scope="module")
def shapes(detect_shapes):
    """conftest's generated set: 96 training and 21 validation images (21 does not divide by 2
    processes or batch 4)."""
    return detect_shapes


@pytest.fixture(scope="module")
def trained(detect_one):
    """conftest's detect_one: 144 steps of batch 8 (12 epochs), evaluated once at the end, logged
    every 12 steps. The mAP floor below was measured with seed 0."""
    return detect_one.out, detect_one.proc


def test_training_lowers_the_loss_and_reports_coco_map(trained):
    out, proc = trained
    results = read_results(out)
    steps = losses(out)  # step 1's loss, then the mean of every 12 steps
    first, last = steps[1], steps[max(steps)]
    assert max(steps) == 144 and last < 0.8 * first, steps
    assert results["steps"] == 144 and results["world_size"] == 1
    assert results["eval_images"] == results["eval_unique_images"] == 21
    # A detector that finds nothing scores 0.000. Measured on these 144 steps: mAP50 0.019-0.050
    # over seeds 0 and 1 with AdamW fused or as a loop of tensor ops (rounding alone moves so short
    # a run that much); earlier versions of the recipe gave up to 0.093. The floor tells learning
    # from nothing, not a good run from a fair one.
    assert results["eval_map50"] > 0.01, results["eval_map50"]
    assert set(results["eval_ap_per_class"]) <= {"circle", "square", "triangle"}
    assert 2.5e6 < results["trainable_parameters"] < 3.5e6  # the nano size, near YOLOv8n's 3.2M
    # the figures Ultralytics' val prints, by class: P, R (and
    # F1) at the best mean F1's confidence, mAP50, mAP50-95
    assert "   P      R     F1  mAP50 mAP50-95" in proc.output and "(the best mean F1)" in proc.output
    per_class = results["eval_per_class"]
    assert set(per_class) == set(results["eval_ap_per_class"])
    assert all(per_class[c]["ap50_95"] == results["eval_ap_per_class"][c] for c in per_class)
    assert (
        0 <= results["eval_precision"] <= 1
        and 0 <= results["eval_recall"] <= 1
        and 0 < results["eval_f1"] <= 1
    )
    assert (
        results["eval_max_detections"] == 300 and results["eval_map50_95_at_100"] <= results["eval_map50_95"]
    )
    assert results["eval_fitness"] == pytest.approx(
        0.1 * results["eval_map50"] + 0.9 * results["eval_map50_95"]
    )
    assert (out / "model.safetensors").is_file() and json.loads((out / "detector.json").read_text())[
        "num_classes"
    ] == 3
    # One evaluation, at the end: it is the best, and model_best
    # holds the same (EMA) weights and detector.json.
    assert (results["metric_for_best_model"], results["best_epoch"], results["best_step"]) == (
        "eval_map50_95",
        12,
        144,
    )
    assert results["best_metric"] == results["eval_map50_95"] and results["stopped_early"] is False
    best, last = (
        load_file(str(out / "model_best" / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert best.keys() == last.keys() and all(torch.equal(best[k], last[k]) for k in best)
    assert (out / "model_best" / "detector.json").read_text() == (out / "detector.json").read_text()


def test_training_writes_its_pictures_and_a_confusion_matrix_of_every_object(trained, shapes):
    out, _ = trained
    check_png(out / "results.png", 800, 600)
    for name in ("PR_curve.png", "P_curve.png", "R_curve.png", "F1_curve.png"):
        check_png(out / name)
    check_png(out / "confusion_matrix.png")
    # the first 16 of the 21 validation images, 4 to a row
    check_png(out / "val_predictions.png", 4 * 320, 4 * 320)
    names, counts = read_confusion_matrix_csv(out / "confusion_matrix.csv")
    assert names == ["circle", "square", "triangle", "background"]
    objects = [0] * 3
    for label_file in (shapes.parent / "labels" / "val").glob("*.txt"):
        for line in label_file.read_text().splitlines():
            objects[int(line.split()[0])] += 1
    # every validation object counted once, found or missed
    assert [sum(row) for row in counts[:3]] == objects
    per_class = read_results(out)["eval_per_class"]
    assert [per_class[n]["instances"] if n in per_class else 0 for n in names[:3]] == objects
    assert counts[3][3] == 0  # background against background is not a thing


def test_the_evaluation_pictures_and_every_process_figures_reach_swanlab(detect_two):
    """detect_two (2 processes, SwanLab offline): the evaluation's PR curve, confusion matrix and a
    few validation images with their boxes, and results.png, logged as images at the last step;
    each process's figures at each log step logged as metrics.jsonl has them."""
    from test_resume import swanlab_images, swanlab_scalars

    (run_file,) = (detect_two.out / "swanlog").glob("run-*/run-*.swanlab")
    images = swanlab_images(run_file)
    keys = ["eval/PR_curve", "eval/confusion_matrix", "eval/predictions", "results"]
    assert sorted(images) == [(key, 6) for key in keys]
    check_png(images["eval/PR_curve", 6][0])
    check_png(images["eval/confusion_matrix", 6][0])
    check_png(images["results", 6][0], 800, 600)
    predictions = images["eval/predictions", 6]
    assert len(predictions) == 4 and all(picture.is_file() for picture in predictions)
    scalars = swanlab_scalars(run_file)
    names = [f"process/{name}/rank{rank}" for name in FIGURES for rank in (0, 1)]
    expected = {(k, m["step"]): m[k] for m in read_metrics(detect_two.out) for k in names if k in m}
    assert sorted({step for _, step in expected}) == [1, 6] and len(expected) == 2 * len(names)
    assert all(scalars[key] == pytest.approx(value, rel=1e-6) for key, value in expected.items())


def test_detector_loop_reads_nothing_between_log_steps_on_one_process(detect_one):
    """The host-read audit (benchmarks/host_reads.py) of the shared run: 12 epochs of 12 steps,
    logged at the epoch ends; the 2-process run's audit is test_host_reads.py's."""
    assert_quiet(read_audit(detect_one.out), detect_one.proc, steps=144, log_every=12)


def test_two_processes_evaluate_each_image_once_with_the_same_map(trained, shapes, tmp_path):
    """Same weights, 1 process vs 2 over gloo: the same 21 images (2 x 11 with one padded) and the
    same mAP."""
    model, _ = trained
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true")
    common = ["--data", shapes, "--eval_only", "True", "--batch_size", 4, *SMALL]
    # --model model_best on one process: the same weights as the final model (the run's one
    # evaluation was the best)
    one = check(
        run([PYTHON, TRAIN, *common, "--model", model / "model_best", "--output_dir", tmp_path / "one"], env)
    )
    two = check(
        run(
            [
                ACCELERATE,
                "launch",
                "--config_file",
                CONFIGS / "cpu.yaml",
                "--num_processes",
                2,
                "--main_process_port",
                free_port(),
                "--num_cpu_threads_per_process",
                1,
                TRAIN,
                *common,
                "--model",
                model,
                "--output_dir",
                tmp_path / "two",
            ],
            env,
            timeout=400,
        )
    )
    a, b = read_results(tmp_path / "one"), read_results(tmp_path / "two")
    assert b["world_size"] == 2 and a["world_size"] == 1, (one.output[-800:], two.output[-800:])
    assert a["eval_images"] == b["eval_images"] == b["eval_unique_images"] == 21
    assert b["eval_map50_95"] == pytest.approx(a["eval_map50_95"], abs=1e-6)
    assert b["eval_map50"] == pytest.approx(a["eval_map50"], abs=1e-6)
    # --eval_only writes the evaluation's pictures too; the matrix counts each image once on any
    # world size
    assert read_confusion_matrix_csv(tmp_path / "one" / "confusion_matrix.csv") == read_confusion_matrix_csv(
        tmp_path / "two" / "confusion_matrix.csv"
    )
    for name in ("PR_curve.png", "confusion_matrix.png", "val_predictions.png"):
        check_png(tmp_path / "two" / name)


def test_eval_only_evaluates_the_test_split_of_data_yaml(trained, shapes, tmp_path):
    model, _ = trained
    env = recipe_env(tmp_path)
    root = shapes.parent
    test_images = sorted((root / "images" / "train").glob("*.jpg"))[:5]
    (tmp_path / "test.txt").write_text("".join(f"{p}\n" for p in test_images))
    names = "names: [circle, square, triangle]\n"
    with_test = tmp_path / "with_test.yaml"
    with_test.write_text(
        f"path: {root}\ntrain: images/train\nval: images/val\ntest: {tmp_path / 'test.txt'}\n{names}"
    )
    command = [PYTHON, TRAIN, "--eval_only", "True", "--model", model, *SMALL, *NO_PLOTS]
    check(run([*command, "--data", with_test, "--split", "test", "--output_dir", tmp_path / "test"], env))
    results = read_results(tmp_path / "test")
    assert (results["split"], results["eval_images"], results["val_size"]) == ("test", 5, 5)
    without = tmp_path / "without_test.yaml"
    without.write_text(f"path: {root}\ntrain: images/train\nval: images/val\n{names}")
    refused = run([*command, "--data", without, "--split", "test", "--output_dir", tmp_path / "none"], env)
    fails_with(refused, "--split test", "has no test split")


def test_predict_writes_pictures_and_detections(trained, shapes, tmp_path):
    model, _ = trained
    val_images = shapes.parent / "images" / "val"
    proc = check(
        run(
            [
                PYTHON,
                TRAIN,
                "--model",
                model,
                "--predict",
                val_images,
                "--predict_dir",
                tmp_path / "pred",
                "--conf_threshold",
                0.01,
            ],
            recipe_env(tmp_path),
        )
    )
    report = json.loads((tmp_path / "pred" / "detections.json").read_text())
    assert len(report) == 21 and len(list((tmp_path / "pred").glob("*.png"))) == 21
    for entry in report:
        for det in entry["detections"]:
            x1, y1, x2, y2 = det["box"]
            assert 0 <= x1 <= x2 and 0 <= y1 <= y2 and det["score"] >= 0.01
            assert det["class_name"] in ("circle", "square", "triangle")
    assert "detections in 21 images" in proc.output
    # one JSON line per image, nothing else
    assert [json.loads(line) for line in proc.stdout.splitlines()] == report
    # --predict reads model_best as it reads the output directory: the same model finds the same
    # boxes.
    first = val_images / report[0]["image"].rsplit("/", 1)[1]
    check(
        run(
            [
                PYTHON,
                TRAIN,
                "--model",
                model / "model_best",
                "--predict",
                first,
                "--predict_dir",
                tmp_path / "best",
                "--conf_threshold",
                0.01,
            ],
            recipe_env(tmp_path),
        )
    )
    assert (
        json.loads((tmp_path / "best" / "detections.json").read_text())[0]["detections"]
        == report[0]["detections"]
    )


def test_detection_errors(shapes, tmp_path):
    env = recipe_env(tmp_path)
    base = [PYTHON, TRAIN, "--output_dir", tmp_path / "out", *SMALL]
    fails_with(run([*base, "--data", tmp_path / "missing.yaml"], env), "missing.yaml")
    fails_with(run([*base, "--data", shapes, "--image_size", 100], env), "multiple of 32")
    fails_with(run([*base, "--data", shapes, "--eval_only", "True"], env), "detector.json", "--model")
    fails_with(run([*base, "--data", shapes, "--init_weights", tmp_path], env), "model.safetensors")
    fails_with(run([PYTHON, TRAIN, "--model", tmp_path, "--predict", shapes.parent], env), "detector.json")


def test_a_bad_label_stops_the_recipe_naming_file_and_line_and_overwrites_nothing(tmp_path):
    data = write_synthetic_dataset(tmp_path / "shapes", num_train=8, num_val=4, image_size=128, seed=5)
    label = sorted((data.parent / "labels" / "train").glob("*.txt"))[0]
    label.write_text("0 0.5 0.5 0.2 0.2\n7 0.5 0.5 0.1 0.1\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"from": "an earlier run"}')
    proc = run(
        [PYTHON, TRAIN, "--data", data, "--batch_size", 4, "--epochs", 1, "--output_dir", out, *SMALL],
        recipe_env(tmp_path),
    )
    fails_with(proc, str(label), "line 2: class 7 is out of range")
    assert (out / "results.json").read_text() == '{"from": "an earlier run"}'


def test_nan_gradients_with_a_finite_loss_are_skipped_with_skip_nonfinite_steps(shapes, tmp_path):
    # NaN gradients in step 2 of 3 (tests/nan_gradient.py), the loss finite: the update of step 2 is
    # skipped. That the run stops at that step without the flag is the guard's own logic
    # (test_guard.py) and the chat recipes' runs.
    out = tmp_path / "out"
    args = [
        TRAIN,
        "--data",
        shapes,
        "--image_size",
        "64",
        "--batch_size",
        "8",
        "--max_steps",
        "3",
        "--log_every",
        "1",
    ]
    args += ["--checkpoint_every", "0", "--tracker", "none", "--num_workers", "0", "--skip_nonfinite_steps"]
    args += NO_PLOTS
    proc = run([PYTHON, NAN_GRADIENT, 2, *args, "--output_dir", out], recipe_env(tmp_path), timeout=300)
    assert_nonfinite_gradients_handled("skip", proc, out, bad_steps=[2])
    assert not list(out.glob("*.png")) and (out / "results.json").is_file()  # --plots False
