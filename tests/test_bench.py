"""The speed harness runs end to end on tiny shapes and writes one entry per comparison."""

import json

import pytest
from conftest import PYTHON, REPO, check, recipe_env, run, sentiment_rows, tiny_bert, write_rows


def test_harness_on_tiny_shapes_writes_every_comparison(tmp_path):
    text_data = tmp_path / "text"
    write_rows(text_data / "train.csv", sentiment_rows(96, seed=0))
    write_rows(text_data / "test.csv", sentiment_rows(32, seed=1))
    model = tiny_bert(tmp_path / "tiny-bert")
    out = tmp_path / "bench"
    proc = check(run([PYTHON, REPO / "benchmarks" / "bench.py", "--batch_size", 8, "--steps", 3, "--images", 128,
                      "--text_model", model, "--text_data", text_data, "--output_dir", out],
                     recipe_env(tmp_path), timeout=600))
    report = json.loads((out / "bench_results.json").read_text())
    rows = {row["name"]: row for row in report["comparisons"]}
    assert list(rows) == ["loader", "training", "overhead", "text"]  # no compile on a CPU by default
    for name in ("loader", "training", "overhead"):
        row = rows[name]
        assert row["a_value"] > 0 and row["b_value"] > 0 and row["unit"] in ("images/s", "samples/s")
        assert row["ratio"] == pytest.approx(row["a_value"] / row["b_value"])
    # The recipe figure is the recipe run's own results.json.
    recipe = json.loads((out / "recipe" / "results.json").read_text())
    assert rows["training"]["a_value"] == rows["overhead"]["a_value"] == recipe["train_samples_per_second"]
    assert recipe["loader"] == "device" and recipe["mixed_precision"] == "bf16" and recipe["steps"] == 3
    assert rows["text"]["a_value"] == json.loads((out / "text" / "results.json").read_text())["train_samples_per_second"]
    assert rows["overhead"]["note"].startswith("overhead ")
    assert "saved" in proc.stdout
