"""`make gpu-check`'s harness: without a GPU it says so and exits 2; its CPU smoke mode runs the real steps on gloo
processes, in parts (one of them from a plain checkout, the package not installed), and merges the parts' reports."""

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import gpu_check
from conftest import PYTHON, REPO, fails_with, recipe_env, run

from accelerate_recipes import PREEMPTED_EXIT_CODE

CHECK = REPO / "benchmarks" / "gpu_check.py"
# The same orchestration as on a GPU, with tiny sizes; sync-bn and dp-vs-ddp need CUDA and are reported as not run.
SMOKE = [
    "audit-cifar",
    "fast94",
    "preempt",
    "nccl-doctor",
    "ddp",
    "allreduce",
    "text-fsdp",
    "sft",
    "sync-bn",
    "dp-vs-ddp",
]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    proc = run([PYTHON, CHECK, "--output_dir", tmp_path / "out"], recipe_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.output[-2000:]
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.output[-2000:]
    assert proc.stderr.startswith("error: no NVIDIA GPU") and "--device cpu --quick" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_steps_and_parts_are_named(tmp_path):
    env = recipe_env(tmp_path)
    fails_with(
        run([PYTHON, CHECK, "--device", "cpu", "--steps", "fast94,warp-drive"], env),
        "unknown step(s) warp-drive",
        "dp-vs-ddp",
        "nccl-doctor",
    )
    fails_with(run([PYTHON, CHECK, "--device", "cpu", "--part", "3/2"], env), "--part 3/2 is not K/N", "--part 1/2")
    fails_with(run([PYTHON, CHECK, "--merge", "--output_dir", tmp_path / "none"], env), "no part reports", "--part 1/N")


def test_help_explains_the_parts_the_merge_and_the_verdicts(tmp_path):
    proc = run([PYTHON, CHECK, "--help"], recipe_env(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.output[-2000:]
    for words in ("--part TEXT", "OUTPUT_DIR/part-K/report.md", "--merge", "PARTIAL", "unsharded", "--budget"):
        assert words in proc.stdout, words


def plain_checkout(tmp_path) -> tuple[str, dict]:
    """The interpreter beneath this virtual environment with the environment's packages on PYTHONPATH, as on a GPU
    box whose python3 holds torch and the rest were unpacked with `pip --target`: .pth files do not run from there,
    so this project is not installed, and no `accelerate` script lies beside the interpreter."""
    python = getattr(sys, "_base_executable", sys.executable)
    packages = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    env = recipe_env(
        tmp_path,
        PYTHONPATH=packages,
        PATH=os.pathsep.join(
            p for p in os.environ["PATH"].split(os.pathsep) if Path(p).resolve() != Path(PYTHON).parent.resolve()
        ),
    )
    probe = run([python, "-c", "import torch, accelerate, fire; import accelerate_recipes"], env, cwd=tmp_path)
    assert "No module named 'accelerate_recipes'" in probe.stderr, probe.output[-2000:]
    assert not (Path(python).parent / "accelerate").exists()
    return python, env


def test_cpu_smoke_runs_in_two_parts_and_merges_them_into_one_partial_report(tmp_path):
    out = tmp_path / "check"
    plan = gpu_check.split(SMOKE, 2, gpu_check.requirements(0, True))
    assert sorted(plan[0] + plan[1]) == sorted(SMOKE), plan
    # allreduce runs through make with this environment's interpreter; the other part runs from a plain checkout
    plain = next(k for k in (1, 2) if "allreduce" not in plan[k - 1])
    home = plan.index(next(p for p in plan if "fast94" in p)) + 1
    stale = out / f"part-{home}" / "fast94" / "checkpoints" / "step_00000099"
    stale.mkdir(parents=True)  # an earlier check's leftovers: the step must start clean
    python, plain_env = plain_checkout(tmp_path)
    common = ["--device", "cpu", "--quick", "--steps", ",".join(SMOKE), "--output_dir", out]
    procs = [
        run([python, CHECK, *common, "--part", f"{k}/2"], plain_env, timeout=600, cwd=tmp_path)
        if k == plain
        else run([PYTHON, CHECK, *common, "--part", f"{k}/2"], recipe_env(tmp_path), timeout=600)
        for k in (1, 2)
    ]
    parts = [json.loads((out / f"part-{k}" / "report.json").read_text()) for k in (1, 2)]
    for k, (proc, part) in enumerate(zip(procs, parts), start=1):
        failed = {r["step"]: r["detail"][-1500:] for r in part["steps"] if r["status"] == "fail"}
        assert proc.returncode == 0 and not failed, (k, failed, proc.output[-2000:])
        assert part["part"] == f"{k}/2" and part["plan"] == plan and [r["step"] for r in part["steps"]] == plan[k - 1]
        assert part["verdict"].startswith("PARTIAL: not proved: ") and f"(in part {3 - k}/2)" in part["verdict"]
        assert (out / f"part-{k}" / "report.md").read_text().startswith("# GPU check: PARTIAL")

    merge = run([PYTHON, CHECK, "--merge", "--output_dir", out], recipe_env(tmp_path), timeout=120)
    assert merge.returncode == 0, merge.output[-2000:]
    report = json.loads((out / "report.json").read_text())
    results = {r["step"]: r for r in report["steps"]}
    assert [r["step"] for r in report["steps"]] == [s for s in gpu_check.STEPS if s in SMOKE]  # each once, in order
    left_out = [s for s in gpu_check.STEPS if s not in SMOKE]
    assert report["verdict"] == (
        f"PARTIAL: not proved: sync-bn, dp-vs-ddp (needs CUDA); {', '.join(left_out)} (not in --steps)"
    ), report["verdict"]
    assert report["mode"] == "cpu smoke" and report["machine"]["torch"] and report["machine"]["accelerate"]
    assert [(p["part"], p["steps"], p["ran"]) for p in report["parts"]] == [
        ("1/2", plan[0], True),
        ("2/2", plan[1], True),
    ]

    audit = results["audit-cifar"]["figures"]
    assert audit["steps"] == 8 and audit["quiet_intervals"] == [2, 3, 4, 5, 6, 7] and audit["quiet_violations"] == 0
    fast94 = results["fast94"]["figures"]
    recipe = json.loads((Path(results["fast94"]["output_dir"]) / "results.json").read_text())
    assert fast94["train_samples_per_second"] == recipe["train_samples_per_second"] > 0
    assert len(fast94["epoch_seconds"]) == 1 and fast94["epoch_seconds"][0] > 0 and fast94["train_images"] == 128
    assert recipe["preset"] == "fast94" and not stale.exists()
    preempt = results["preempt"]["figures"]
    assert preempt["stop_exit_code"] == PREEMPTED_EXIT_CODE and preempt["checkpoints"]
    assert preempt["steps"] == preempt["total_steps"] == 10 and preempt["resumed_from"]
    assert "SIGTERM at step" in (Path(results["preempt"]["output_dir"]) / "log.txt").read_text()
    assert results["ddp"]["figures"]["world_size"] == 2 and results["ddp"]["figures"]["distributed_type"] == "MULTI_CPU"
    assert " -m accelerate.commands.accelerate_cli launch --config_file " in results["ddp"]["commands"][0]
    allreduce = results["allreduce"]["figures"]
    assert allreduce["world_size"] == 2 and allreduce["best_busbw_gbps"] > 0
    command = results["allreduce"]["commands"][0]
    assert command.startswith("make ") and "allreduce-cpu" in command
    fsdp = results["text-fsdp"]["figures"]
    assert fsdp["distributed_type"] == "FSDP" and fsdp["world_size"] == 2 and fsdp["steps"] > 0
    doctor = results["nccl-doctor"]["figures"]
    assert "gloo all_reduce across 2 node(s) gave the right sum" in doctor["gloo"]
    assert doctor["nccl"].startswith("NCCL all-reduce not run: CPU run") and doctor["busbw_gbps"] is None
    for name in ("sync-bn", "dp-vs-ddp"):
        assert results[name]["status"] == "not run" and results[name]["detail"] == "needs CUDA"
    sft = results["sft"]
    assert len(sft["commands"]) == 2 and "--lora_r 16" in sft["commands"][0] and "--lora_r" not in sft["commands"][1]
    for method in ("lora", "full"):
        figures = sft["figures"][method]
        assert figures["method"] == method and figures["steps"] == 3, figures
        assert (figures["distributed_type"], figures["world_size"], figures["mixed_precision"]) == ("FSDP", 2, "no")
        assert figures["train_tokens_per_second"] > figures["train_target_tokens_per_second"] > 0
        assert figures["peak_memory_mb"] > 0 and figures["memory_plan_mb"]["total"] > 0
        assert "model_flops_utilisation" not in figures  # no GPU peak to divide by on the CPU
    for name in ("audit-cifar", "fast94", "preempt", "ddp", "allreduce", "text-fsdp", "nccl-doctor", "sft"):
        assert results[name]["status"] == "pass" and results[name]["wall_seconds"] > 0 and results[name]["commands"]
    table = (out / "report.md").read_text()
    assert table.startswith("# GPU check: PARTIAL: not proved: sync-bn, dp-vs-ddp (needs CUDA)")
    assert f"| fast94 | pass | {results['fast94']['wall_seconds']} |" in table
    assert "| sync-bn | not run (needs CUDA) |" in table and "| nccl-doctor | pass (gloo only) |" in table
    assert f"train_samples_per_second: {fast94['train_samples_per_second']:.4g}" in table
    assert "- text-deepspeed: not in --steps" in table

    # A part that has not run: its steps are named as such, and the check is incomplete.
    shutil.move(out / "part-2", tmp_path / "part-2")
    merge = run([PYTHON, CHECK, "--merge", "--output_dir", out], recipe_env(tmp_path), timeout=120)
    report = json.loads((out / "report.json").read_text())
    assert merge.returncode == 1, merge.output[-2000:]
    assert report["verdict"].startswith(f"INCOMPLETE: {', '.join(plan[1])} (part 2/2 not run)"), report["verdict"]
    assert [r["step"] for r in report["steps"] if r["detail"] == "part 2/2 not run"] == plan[1]
    # A part of another split is refused rather than merged.
    shutil.move(tmp_path / "part-2", out / "part-2")
    other = dict(parts[1], part="3/3", plan=[SMOKE[:3], SMOKE[3:6], SMOKE[6:]])
    (out / "part-3").mkdir()
    (out / "part-3" / "report.json").write_text(json.dumps(other))
    fails_with(
        run([PYTHON, CHECK, "--merge", "--output_dir", out], recipe_env(tmp_path), timeout=120),
        "belong to different checks",
        "part-3",
    )


def test_preempt_ends_within_the_budget(tmp_path):
    budget = 6
    proc = run(
        [
            PYTHON,
            CHECK,
            "--device",
            "cpu",
            "--quick",
            "--steps",
            "preempt",
            "--budget",
            budget,
            "--output_dir",
            tmp_path / "out",
        ],
        recipe_env(tmp_path),
        timeout=120,
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (preempt,) = report["steps"]
    # Whatever this machine's speed: the step ends within the budget; where that was too little to stop and resume a
    # run, it fails saying the budget stopped it.
    assert 0 < preempt["wall_seconds"] <= budget + 2, preempt
    if preempt["status"] == "fail":
        assert proc.returncode == 1 and report["verdict"].startswith("FAIL: preempt"), proc.output[-2000:]
        assert "--budget" in preempt["detail"], preempt
    else:
        assert preempt["status"] == "pass" and proc.returncode == 0, proc.output[-2000:]


def one_gpu_records() -> list[dict]:
    """What a check on one GPU without deepspeed records: the steps that need 2+ GPUs not run, the others passed."""
    needs = gpu_check.requirements(1, False)
    records = []
    for name in gpu_check.STEPS:
        figures = {"world_size": 1, "distributed_type": "FSDP"} if name == "text-fsdp" else {"steps": 8}
        records.append(
            {
                "step": name,
                "status": "not run" if needs[name] else "pass",
                "commands": [],
                "wall_seconds": 0.0 if needs[name] else 12.5,
                "figures": {} if needs[name] else figures,
                "detail": needs[name] or "",
            }
        )
    return records


def test_a_one_gpu_report_is_partial_and_names_what_it_did_not_prove():
    records = one_gpu_records()
    verdict = gpu_check.assess(records)
    assert verdict["verdict"] == (
        "PARTIAL: not proved: text-deepspeed, nccl-doctor, ddp, sync-bn, allreduce, "
        "dp-vs-ddp (needs 2+ GPUs); FSDP sharding (one process)"
    )
    assert gpu_check.exit_status(verdict["verdict"]) == 0
    assert verdict["notes"] == {"text-fsdp": gpu_check.UNSHARDED}
    report = {
        **verdict,
        "mode": "gpu",
        "quick": False,
        "wall_seconds": 600.0,
        "steps": records,
        "machine": {
            "devices": ["NVIDIA H100 80GB HBM3"],
            "torch": "2.11.0",
            "cuda": "12.8",
            "accelerate": "1.15.0",
            "transformers": "5.17.0",
            "python": "3.12.3",
            "host": "gpu-box",
        },
    }
    text = gpu_check.markdown(report)
    assert "| text-fsdp | pass (unsharded: world size 1, no NCCL traffic) | 12.5 |" in text
    assert "| ddp | not run (needs 2+ GPUs) |" in text and "| nccl-doctor | not run (needs 2+ GPUs) |" in text
    assert "- FSDP sharding: text-fsdp ran unsharded: world size 1, no NCCL traffic; proves the FSDP code path" in text
    # With 2 GPUs but no deepspeed, text-deepspeed says so; a failed step makes the verdict FAIL, exit status 1.
    assert gpu_check.requirements(2, False)["text-deepspeed"] == "deepspeed not installed"
    records[0].update(status="fail", detail="exit 1")
    verdict = gpu_check.assess(records)["verdict"]
    assert verdict.startswith("FAIL: audit-cifar; not proved: text-deepspeed") and gpu_check.exit_status(verdict) == 1


def test_sft_figures_count_model_flops_as_palm_does_and_compare_peak_memory_with_the_plan():
    assets = {"matmul_parameters": 1000, "layers": 2, "hidden": 10}
    results = {
        "train_tokens_per_second": 1e6,
        "train_samples_per_second": 1e4,  # 100 tokens per conversation
        "world_size": 2,
        "peak_memory_mb": 150.0,
        "peak_memory_kind": "cuda_max_allocated",
        "memory_plan_mb": {"weights": 40.0, "total": 100.0},
    }
    # per token: 6N (full) or 4N (LoRA) + 12 x layers x hidden x 100 = 24,000; x 1e6 tokens/s over 2 GPUs of 1 TFLOPS
    full = gpu_check.sft_figures(results, assets, 1.0, "full")
    lora = gpu_check.sft_figures(results, assets, 1.0, "lora")
    assert full["model_flops_utilisation"] == 0.015 and lora["model_flops_utilisation"] == 0.014
    assert full["peak_over_plan"] == 1.5 and full["mean_tokens_per_conversation"] == 100.0
    cpu = gpu_check.sft_figures(dict(results, peak_memory_kind="host_max_rss"), assets, None, "full")
    assert "model_flops_utilisation" not in cpu and "peak_over_plan" not in cpu
    assert gpu_check.requirements(1, False, ("peft",))["sft"] == "peft not installed"


def test_two_parts_on_one_gpu_hold_every_step_once_and_fit_the_part_budget():
    needs = gpu_check.requirements(1, False)
    whole = gpu_check.estimate(gpu_check.STEPS, needs)
    assert whole > gpu_check.PART_BUDGET  # one command on a 9-minute limit would not hold it
    plan = gpu_check.split(gpu_check.STEPS, 2, needs)
    assert sorted(plan[0] + plan[1]) == sorted(gpu_check.STEPS) and plan == gpu_check.split(gpu_check.STEPS, 2, needs)
    for part in plan:
        assert gpu_check.estimate(part, needs) <= gpu_check.PART_BUDGET - 60, plan
        assert "bench" not in part or part[-1] == "bench"  # the least known step last: it can only cut itself
        assert all(gpu_check.TIMEOUTS[s] <= gpu_check.PART_BUDGET for s in part)
