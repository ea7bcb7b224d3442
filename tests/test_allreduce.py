"""The all-reduce benchmark sums correctly over gloo and reports bandwidth as nccl-tests define
it."""

import json

import pytest
import torch
from conftest import ACCELERATE, CONFIGS, PYTHON, REPO, check, fails_with, recipe_env, run

SCRIPT = REPO / "benchmarks" / "allreduce.py"


def test_two_gloo_processes_sum_correctly_and_busbw_follows_the_formula(tmp_path):
    out = tmp_path / "out"
    proc = check(
        run(
            [
                ACCELERATE,
                "launch",
                "--config_file",
                CONFIGS / "cpu.yaml",
                "--num_cpu_threads_per_process",
                "1",
                SCRIPT,
                "--max_bytes",
                2**20,
                "--dtype",
                "bf16",
                "--warmup",
                1,
                "--iters",
                2,
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
        )
    )
    report = json.loads((out / "allreduce.json").read_text())
    assert (report["world_size"], report["backend"], report["device"]) == (2, "gloo", "cpu")
    assert [row["bytes"] for row in report["sizes"]] == [1024, 4096, 16384, 65536, 262144, 1048576]
    n = report["world_size"]
    for row in report["sizes"]:
        assert row["correct"] and row["seconds"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (n - 1) / n)
    assert "busbw GB/s" in proc.stdout and proc.stdout.count("| yes") == 6


def test_one_process_is_told_to_launch_more(tmp_path):
    fails_with(
        run([PYTHON, SCRIPT, "--output_dir", tmp_path / "out"], recipe_env(tmp_path)),
        "needs at least 2 processes",
        "make allreduce-cpu",
    )


def ring_sums(values, dtype):
    """The sums a ring all-reduce forms, in the dtype: chunk c is accumulated rank after rank
    starting at rank c."""
    n = len(values)
    sums = []
    for start in range(n):
        total = torch.tensor(values[start], dtype=dtype)
        for step in range(1, n):
            total = total + torch.tensor(values[(start + step) % n], dtype=dtype)
        sums.append(total.item())
    return sums


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_check_values_sum_exactly_at_any_rank_count(dtype):
    from allreduce import fill_and_expected

    for world in (2, 8, 22, 23, 64, 300):
        values = [fill_and_expected(world, rank, dtype)[0] for rank in range(world)]
        expected = fill_and_expected(world, 0, dtype)[1]
        assert set(ring_sums(values, dtype)) == {expected}, (world, dtype)
    # What each rank sending rank + 1 gives in bf16 from
    # 23 ranks up: rounding, not a broken interconnect.
    assert len(set(ring_sums([float(r + 1) for r in range(23)], torch.bfloat16))) > 1
