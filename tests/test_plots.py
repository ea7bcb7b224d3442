"""The pictures a run leaves behind: results.png from metrics.jsonl, confusion matrices, and the
detector's PR curve and matching; a run without matplotlib still finishes and says how to get
them."""

import json
import math
import subprocess

import pytest
import torch
from coco_map import coco_map
from conftest import PYTHON, REPO, check_png, time_limit
from eval_pictures import detection_confusion_matrix, plot_pr_curve

from accelerate_recipes.plots import (
    plot_confusion_matrix,
    plot_results,
    read_confusion_matrix_csv,
    save_confusion_matrix,
    write_confusion_matrix_csv,
)


def write_metrics(path, with_eval=True, steps=60, per_epoch=20):
    """A metrics.jsonl as TrainingProgress writes it: train rows every 5 steps, eval rows at epoch
    ends; a last line cut short."""
    lines = []
    for step in [1, *range(5, steps + 1, 5)]:
        lines.append(
            {
                "step": step,
                "train/loss": 2.3 * math.exp(-step / 30),
                "train/lr": 0.1 * (1 - step / steps),
                "train/epoch": step / per_epoch,
                "perf/step_seconds": 0.5,
                "perf/samples_per_second": 100.0 + step,
            }
        )
        if with_eval and step % per_epoch == 0:
            lines.append(
                {
                    "step": step,
                    "eval/accuracy": step / (steps + 10),
                    "eval/loss": 2.0 - step / 60,
                    "eval/ap50_95/cat": 0.3,
                    "perf/epoch_seconds": 10.0,
                }
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in lines) + '{"step": 61, "train/lo')
    return path


def test_results_png_draws_every_panel(tmp_path):
    full = plot_results(write_metrics(tmp_path / "full.jsonl"), tmp_path / "results.png")
    assert full == tmp_path / "results.png"
    with_eval = check_png(full, 800, 600)
    train_only = check_png(
        plot_results(write_metrics(tmp_path / "train.jsonl", with_eval=False), tmp_path / "t.png")
    )
    assert with_eval.size == train_only.size
    # The evaluation panel (bottom left quarter) holds the eval markers in one and a "nothing logged
    # yet" note in the other: the pictures differ there.
    box = (0, with_eval.height // 2, with_eval.width // 2, with_eval.height)
    assert with_eval.crop(box).tobytes() != train_only.crop(box).tobytes()


def test_confusion_matrix_csv_round_trip_and_picture(tmp_path):
    # the last class has no samples: a row of zeros
    counts = torch.tensor([[50, 3, 0], [4, 40, 6], [0, 0, 0]])
    names = ["airplane", "automobile", "bird"]
    path = save_confusion_matrix(counts, names, tmp_path)
    assert path == tmp_path / "confusion_matrix.csv"
    assert read_confusion_matrix_csv(path) == (names, counts.tolist())
    check_png(tmp_path / "confusion_matrix.png")
    counts_png = plot_confusion_matrix(counts, names, tmp_path / "counts.png", normalize=False)
    check_png(counts_png)
    # Many classes (CIFAR-100 has 100): drawn without cell labels, on a larger canvas.
    many = torch.randint(0, 5, (50, 50)) + torch.eye(50, dtype=torch.long) * 50
    names = [f"class {i}" for i in range(50)]
    write_confusion_matrix_csv(many, names, tmp_path / "many.csv")
    assert read_confusion_matrix_csv(tmp_path / "many.csv") == (names, many.tolist())
    check_png(plot_confusion_matrix(many, names, tmp_path / "many.png"), 1500, 1500)


def test_a_picture_that_cannot_be_drawn_warns_and_returns_none(tmp_path, capsys):
    assert plot_confusion_matrix([[1, 2], [3, 4]], ["only one name"], tmp_path / "bad.png") is None
    assert "plot_confusion_matrix drew nothing: ValueError" in capsys.readouterr().out
    assert not (tmp_path / "bad.png").exists()


def test_without_matplotlib_a_run_gets_the_csv_and_one_line_saying_how_to_get_pictures(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl")
    code = f"""
import sys
sys.modules["matplotlib"] = None  # as if it were not installed
from accelerate_recipes.plots import plot_results, save_confusion_matrix
for epoch in range(3):
    assert plot_results({str(tmp_path / "metrics.jsonl")!r}, {str(tmp_path / "results.png")!r}) is None
    save_confusion_matrix([[1, 0], [0, 1]], ["a", "b"], {str(tmp_path)!r})
print("finished")
"""
    proc = subprocess.run(
        [PYTHON, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=time_limit(120),
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [
        "matplotlib is not installed, so this run draws no pictures (results.png, ...); get them with: "
        "pip install matplotlib",
        "finished",
    ]
    assert (tmp_path / "confusion_matrix.csv").is_file()
    assert not list(tmp_path.glob("*.png"))


def record(true_boxes, true_labels, boxes, labels, scores):
    return dict(
        true_boxes=torch.tensor(true_boxes, dtype=torch.float).reshape(-1, 4),
        true_labels=torch.tensor(true_labels, dtype=torch.long),
        boxes=torch.tensor(boxes, dtype=torch.float).reshape(-1, 4),
        labels=torch.tensor(labels, dtype=torch.long),
        scores=torch.tensor(scores, dtype=torch.float),
    )


def test_detection_confusion_matrix_matches_as_ultralytics_does():
    records = [
        # object 0 (class 0) found as class 0; object 1
        # (class 1) found as class 2; a 0.2-score box ignored
        record(
            [[0, 0, 10, 10], [20, 20, 40, 40]],
            [0, 1],
            [[0, 0, 10, 10], [21, 21, 40, 40], [0, 0, 10, 10]],
            [0, 2, 1],
            [0.9, 0.5, 0.2],
        ),
        # two predictions on one object: the better overlap matches, the other is a false positive
        # (background row); a box overlapping an object at IoU 0.25 (< 0.45) matches nothing: that
        # object is missed
        record(
            [[0, 0, 10, 10], [50, 50, 70, 70]],
            [1, 0],
            [[0, 0, 10, 9], [0, 0, 10, 10], [50, 50, 60, 60]],
            [1, 1, 0],
            [0.9, 0.4, 0.8],
        ),
        # no objects: every prediction is a false positive; no predictions: every object is missed
        record([], [], [[5, 5, 9, 9]], [2], [0.3]),
        record([[1, 1, 5, 5]], [2], [], [], []),
    ]
    counts = detection_confusion_matrix(records, num_classes=3)
    # rows: true class, columns: predicted; index 3: background
    expected = torch.zeros(4, 4, dtype=torch.long)
    expected[0, 0] = 1  # image 1, object 0
    expected[1, 2] = 1  # image 1, object 1: class confusion
    expected[1, 1] = 1  # image 2, object 0: matched by the IoU-1.0 box
    expected[3, 1] = 1  # image 2: the second box on that object
    expected[0, 3] = 1  # image 2, object 1 missed (IoU 0.25)
    expected[3, 0] = 1  # image 2: the box at IoU 0.25
    expected[3, 2] = 1  # image 3
    expected[2, 3] = 1  # image 4
    assert counts.tolist() == expected.tolist()
    assert counts[:3].sum() == 5  # every object counted exactly once


def test_pr_curve_table_is_the_one_map50_is_computed_from(tmp_path):
    g = torch.Generator().manual_seed(1)
    records = []
    for _ in range(10):
        n = int(torch.randint(1, 5, (), generator=g))
        corner = torch.rand(n, 2, generator=g) * 80
        true_boxes = torch.cat((corner, corner + 10 + torch.rand(n, 2, generator=g) * 40), dim=1)
        true_labels = torch.randint(0, 3, (n,), generator=g)
        boxes = torch.cat(
            (true_boxes + torch.randn(n, 4, generator=g) * 3, torch.rand(2, 4, generator=g) * 30)
        )
        boxes[-2:, 2:] += 40
        records.append(
            dict(
                boxes=boxes,
                scores=torch.rand(n + 2, generator=g),
                labels=torch.cat((true_labels, torch.tensor([0, 3]))),
                true_boxes=true_boxes,
                true_labels=true_labels,
            )
        )
    scores, pr = coco_map(records, ["a", "b", "c", "d"])
    precision = pr["precision"]
    assert pr["recall"].tolist() == pytest.approx([i / 100 for i in range(101)])
    assert precision.shape == (101, len(pr["classes"])) and sorted(pr["classes"]) == [0, 1, 2, 3]
    with_truth = [k for k, c in enumerate(pr["classes"]) if c != 3]
    # class d: no ground truth, no curve
    assert (precision[:, [pr["classes"].index(3)]] == -1).all()
    # COCO's AP50 is the mean precision over the 101 recall
    # points, averaged over the classes with ground truth.
    assert float(precision[:, with_truth].mean()) == pytest.approx(scores["eval_map50"], abs=1e-6)
    assert 0 < scores["eval_map50"] < 1
    check_png(plot_pr_curve(pr, ["a", "b", "c", "d"], tmp_path / "PR_curve.png"))
    # nothing evaluated: the axes and a note
    check_png(plot_pr_curve(None, ["a"], tmp_path / "empty.png"))
