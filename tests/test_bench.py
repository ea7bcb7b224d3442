"""The speed harness runs end to end on tiny shapes and writes one entry per comparison."""

import json

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import PYTHON, REPO, check, fails_with, recipe_env, run, sentiment_rows, write_rows

from accelerate_recipes import cpu_precision


def test_harness_on_tiny_shapes_writes_every_comparison(tiny_bert_dir, tmp_path):
    text_data = tmp_path / "text"
    write_rows(text_data / "train.csv", sentiment_rows(96, seed=0))
    write_rows(text_data / "test.csv", sentiment_rows(32, seed=1))
    model = tiny_bert_dir
    out = tmp_path / "bench"
    proc = check(
        run(
            [
                PYTHON,
                REPO / "benchmarks" / "bench.py",
                "--batch_size",
                8,
                "--steps",
                3,
                "--images",
                128,
                "--text_model",
                model,
                "--text_data",
                text_data,
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path),
            timeout=600,
        )
    )
    report = json.loads((out / "bench_results.json").read_text())
    rows = {row["name"]: row for row in report["comparisons"]}
    # no compile on a CPU by default
    assert list(rows) == ["loader", "training", "overhead", "text"]
    for name in ("loader", "training", "overhead"):
        row = rows[name]
        assert row["a_value"] > 0 and row["b_value"] > 0 and row["unit"] in ("images/s", "samples/s")
        assert row["ratio"] == pytest.approx(row["a_value"] / row["b_value"])
    # The recipe figure is the recipe run's own results.json.
    recipe = json.loads((out / "recipe" / "results.json").read_text())
    assert rows["training"]["a_value"] == rows["overhead"]["a_value"] == recipe["train_samples_per_second"]
    # bf16 on a CPU only where it is native (emulated bf16 is ~40x slower than fp32); each row says
    # what it used.
    assert (
        recipe["loader"] == "device" and recipe["mixed_precision"] == cpu_precision() and recipe["steps"] == 3
    )
    used = "bf16" if cpu_precision() == "bf16" else "fp32"
    assert (
        rows["training"]["precision"] == f"{used} / fp32"
        and rows["overhead"]["precision"] == f"{used} / {used}"
    )
    assert f"| {used} / fp32 " in proc.stdout
    assert (
        rows["text"]["a_value"]
        == json.loads((out / "text" / "results.json").read_text())["train_samples_per_second"]
    )
    assert rows["overhead"]["note"].startswith("overhead ")
    assert "saved" in proc.stdout


def test_fp16_on_a_cpu_is_refused_before_anything_runs(tmp_path):
    # accelerate would train the recipe in fp32 there, and
    # the overhead row would compare it with an fp16 loop
    proc = run(
        [PYTHON, REPO / "benchmarks" / "bench.py", "--precision", "fp16", "--output_dir", tmp_path / "bench"],
        recipe_env(tmp_path),
    )
    fails_with(proc, "--precision fp16 needs a GPU", "use --precision bf16 or no")
    assert not (tmp_path / "bench").exists()


def test_text_benchmark_launches_with_the_configs_make_uses_for_the_hardware():
    from rotten_tomatoes import launch_config

    # A GPU box: the GPU configs (NCCL, one process per
    # GPU), never cpu.yaml with ACCELERATE_USE_CPU.
    assert launch_config(1, gpus=8) == ("1gpu", {})
    assert launch_config(2, gpus=8) == ("2gpu", {})
    # a count without a file of its own: --num_processes sets it
    assert launch_config(3, gpus=8) == ("8gpu", {})
    for config in ("2gpu", "8gpu"):
        assert (
            load_config_from_file(str(REPO / "accelerate_configs" / f"{config}.yaml")).distributed_type.value
            == "MULTI_GPU"
        )
    # No GPU: gloo processes on the CPU.
    assert launch_config(2, gpus=0) == ("cpu", {"ACCELERATE_USE_CPU": "true"})
    assert launch_config(1, gpus=0) == (None, {})
