"""The scaling report runs the CIFAR recipe on 1 and 2 gloo processes and reports what was
measured."""

import json
import shutil
import statistics

import pytest
from conftest import PYTHON, REPO, check, fails_with, recipe_env, run

SCRIPT = REPO / "benchmarks" / "scaling.py"


def measured_step_seconds(run_dir, warmup):
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.fmean(
        r["perf/step_seconds"] for r in steps if "perf/step_seconds" in r and r["step"] > warmup
    )


@pytest.fixture(scope="module")
def one_vs_two(module_tmp):
    """One scaling run on 1 and 2 gloo processes, read by the report test and re-run by the
    fresh-start test."""
    tmp = module_tmp.mktemp("scaling")
    out = tmp / "scaling"
    proc = check(
        run(
            [
                PYTHON,
                SCRIPT,
                "run",
                "--setups",
                "cpu:1,cpu:2",
                "--per_device_batch",
                4,
                "--steps",
                5,
                "--warmup",
                2,
                "--output_dir",
                out,
            ],
            recipe_env(tmp),
            timeout=600,
        )
    )
    return out, proc


def test_cpu_one_vs_two_processes_table_chart_and_ring_prediction(one_vs_two):
    out, proc = one_vs_two
    rows = {row["setup"]: row for row in json.loads((out / "scaling.json").read_text())["rows"]}
    assert set(rows) == {"cpu-1", "cpu-2"}
    one, two = rows["cpu-1"], rows["cpu-2"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert (one["global_batch_size"], two["global_batch_size"]) == (4, 8)  # same batch per process

    # The figures are the runs' own: step times from
    # each run's metrics.jsonl, warm-up steps left out.
    for row in (one, two):
        step = measured_step_seconds(out / row["setup"], warmup=2)
        assert row["step_seconds"] == pytest.approx(step)
        assert row["samples_per_second"] == pytest.approx(row["global_batch_size"] / step)
    assert two["efficiency"] == pytest.approx(two["samples_per_second"] / one["samples_per_second"] / 2)

    # Ring all-reduce model: 2(n-1)/n x fp32 gradient bytes / busbw measured at DDP's bucket size.
    allreduce = json.loads((out / "cpu-2" / "allreduce.json").read_text())
    assert allreduce["world_size"] == 2 and allreduce["sizes"][0]["bytes"] == 25 * 2**20
    busbw = allreduce["sizes"][0]["busbw_gbps"]
    params = json.loads((out / "cpu-2" / "results.json").read_text())["trainable_parameters"]
    assert params == 11_173_962  # ResNet18 with the CIFAR stem and 10 classes
    comm = 2 * (2 - 1) / 2 * 4 * params / (busbw * 1e9)
    assert two["comm_seconds"] == pytest.approx(comm)
    assert two["predicted_efficiency"] == pytest.approx(one["step_seconds"] / (one["step_seconds"] + comm))
    assert two["prediction_error"] == pytest.approx(two["efficiency"] - two["predicted_efficiency"])
    assert two["limited_by"] in ("compute", "interconnect", "shared resources")

    table = (out / "scaling.md").read_text()
    assert f"| cpu-2 | 2 | 1 | {two['samples_per_second']:.1f} | {two['speedup']:.2f} |" in table
    assert f"| {two['predicted_efficiency']:.0%} |" in table
    assert table.split("\n\n", 1)[1] in proc.stdout  # the same table printed
    png = (out / "scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_report_names_what_is_missing_and_bad_setups(tmp_path):
    fails_with(
        run(
            [PYTHON, SCRIPT, "report", tmp_path / "nowhere", "--output_dir", tmp_path / "o"],
            recipe_env(tmp_path),
        ),
        "nowhere/results.json does not exist",
        "output_dir of finished recipe runs",
    )
    fails_with(
        run([PYTHON, SCRIPT, "run", "--setups", "gpus:2"], recipe_env(tmp_path)),
        "cannot read setup 'gpus:2'",
        "ids:0,4 (those GPUs)",
    )
    fails_with(
        run([PYTHON, SCRIPT, "run", "--setups", "cpu:1,ids:0,4"], recipe_env(tmp_path)), "mix of cpu and gpu"
    )


def test_scaling_run_again_in_the_same_folder_starts_fresh(one_vs_two, tmp_path):
    # The recipe refuses to start over an earlier run's checkpoints; a benchmark re-run must not
    # trip over that.
    out = tmp_path / "scaling"
    shutil.copytree(one_vs_two[0], out)  # a finished run's folder, checkpoints and all
    first = (out / "cpu-1" / "results.json").stat().st_mtime_ns
    command = [
        PYTHON,
        SCRIPT,
        "run",
        "--setups",
        "cpu:1",
        "--per_device_batch",
        4,
        "--steps",
        3,
        "--warmup",
        1,
        "--output_dir",
        out,
    ]
    check(run(command, recipe_env(tmp_path), timeout=300))
    assert (out / "cpu-1" / "results.json").stat().st_mtime_ns > first
    assert json.loads((out / "scaling.json").read_text())["rows"][0]["setup"] == "cpu-1"


def test_dataparallel_loop_reports_like_a_recipe_and_dp_setups_need_gpus(tmp_path):
    """The dp:N setup's loop (one process, nn.DataParallel) writes the recipes' results format;
    without GPUs DataParallel only calls the model, so here it runs as one device and `dp:2` is
    refused."""
    run_dir = tmp_path / "dp-1"
    check(
        run(
            [
                PYTHON,
                REPO / "benchmarks" / "dataparallel.py",
                "--batch_size",
                4,
                "--steps",
                3,
                "--precision",
                "no",
                "--output_dir",
                run_dir,
            ],
            recipe_env(tmp_path),
            timeout=300,
        )
    )
    results = json.loads((run_dir / "results.json").read_text())
    assert results["parallelism"] == "DataParallel" and (results["world_size"], results["devices"]) == (1, 1)
    # the recipe's ResNet18
    assert results["steps"] == 3 and results["trainable_parameters"] == 11_173_962
    logged = (run_dir / "metrics.jsonl").read_text().splitlines()
    step_seconds = [json.loads(line)["perf/step_seconds"] for line in logged]
    assert results["train_samples_per_second"] == pytest.approx(4 * 2 / sum(step_seconds[1:]))

    check(
        run(
            [PYTHON, SCRIPT, "report", run_dir, "--output_dir", tmp_path / "report", "--warmup", 1],
            recipe_env(tmp_path),
        )
    )
    (row,) = json.loads((tmp_path / "report" / "scaling.json").read_text())["rows"]
    assert row["parallelism"] == "DataParallel"
    assert row["samples_per_second"] == pytest.approx(4 / statistics.fmean(step_seconds[1:]))
    assert "| dp-1 | 1 (DataParallel, 1 GPUs) |" in (tmp_path / "report" / "scaling.md").read_text()
    fails_with(
        run([PYTHON, SCRIPT, "run", "--setups", "gpu:2,dp:2"], recipe_env(tmp_path)),
        "dp:2 needs 2 GPUs",
        "0 visible",
    )
