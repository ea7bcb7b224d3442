"""`make gpu-check`'s harness: without a GPU it says so and exits 2; its CPU smoke mode runs the real steps on gloo
processes and reports real figures and statuses."""

import json

from conftest import PYTHON, REPO, fails_with, recipe_env, run

from accelerate_recipes import PREEMPTED_EXIT_CODE

CHECK = REPO / "benchmarks" / "gpu_check.py"


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    proc = run([PYTHON, CHECK, "--output_dir", tmp_path / "out"], recipe_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.output[-2000:]
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.output[-2000:]
    assert proc.stderr.startswith("error: no NVIDIA GPU") and "--device cpu --quick" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_steps_are_named(tmp_path):
    fails_with(run([PYTHON, CHECK, "--device", "cpu", "--steps", "fast94,warp-drive"], recipe_env(tmp_path)),
               "unknown step(s) warp-drive", "dp-vs-ddp")


def test_cpu_smoke_runs_the_steps_in_fresh_folders_and_reports_their_figures(tmp_path):
    out = tmp_path / "check"
    stale = out / "fast94" / "checkpoints" / "step_00000099"
    stale.mkdir(parents=True)  # an earlier check's leftovers: the step must start clean
    steps = "audit-cifar,fast94,preempt,ddp,allreduce,text-fsdp,sync-bn,dp-vs-ddp"
    proc = run([PYTHON, CHECK, "--device", "cpu", "--quick", "--steps", steps, "--output_dir", out],
               recipe_env(tmp_path), timeout=600)
    report = json.loads((out / "report.json").read_text())
    results = {r["step"]: r for r in report["steps"]}
    assert list(results) == steps.split(",")
    failed = {name: r["detail"][-1500:] for name, r in results.items() if r["status"] == "fail"}
    assert proc.returncode == 0 and not failed and report["verdict"] == "PASS", (failed, proc.output[-2000:])
    assert report["mode"] == "cpu smoke" and report["machine"]["torch"] and report["machine"]["accelerate"]

    audit = results["audit-cifar"]["figures"]
    assert audit["steps"] == 8 and audit["quiet_intervals"] == [2, 3, 4, 5, 6, 7] and audit["quiet_violations"] == 0

    fast94 = results["fast94"]["figures"]
    recipe = json.loads((out / "fast94" / "results.json").read_text())
    assert fast94["train_samples_per_second"] == recipe["train_samples_per_second"] > 0
    assert len(fast94["epoch_seconds"]) == 1 and fast94["epoch_seconds"][0] > 0 and fast94["train_images"] == 128
    assert recipe["preset"] == "fast94" and not stale.exists()

    preempt = results["preempt"]["figures"]
    assert preempt["stop_exit_code"] == PREEMPTED_EXIT_CODE and preempt["checkpoints"]
    assert preempt["steps"] == preempt["total_steps"] == 10 and preempt["resumed_from"]
    assert "SIGTERM at step" in (out / "preempt" / "log.txt").read_text()

    assert results["ddp"]["figures"]["world_size"] == 2 and results["ddp"]["figures"]["distributed_type"] == "MULTI_CPU"
    allreduce = results["allreduce"]["figures"]
    assert allreduce["world_size"] == 2 and allreduce["best_busbw_gbps"] > 0
    command = results["allreduce"]["commands"][0]
    assert command.startswith("make ") and "allreduce-cpu" in command
    fsdp = results["text-fsdp"]["figures"]
    assert fsdp["distributed_type"] == "FSDP" and fsdp["world_size"] == 2 and fsdp["steps"] > 0
    for name in ("sync-bn", "dp-vs-ddp"):
        assert results[name]["status"] == "not run" and results[name]["detail"] == "needs CUDA"

    for name in ("audit-cifar", "fast94", "preempt", "ddp", "allreduce", "text-fsdp"):
        assert results[name]["status"] == "pass" and results[name]["wall_seconds"] > 0 and results[name]["commands"]
    table = (out / "report.md").read_text()
    assert table.startswith("# GPU check: PASS")
    assert f"| fast94 | pass | {results['fast94']['wall_seconds']} |" in table
    assert "| sync-bn | not run (needs CUDA) |" in table
    assert f"train_samples_per_second: {fast94['train_samples_per_second']:.4g}" in table
