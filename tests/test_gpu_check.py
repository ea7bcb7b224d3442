"""`make gpu-check`'s harness: without a GPU it says so and exits 2; its CPU smoke mode runs the
real steps on gloo processes from a plain checkout (the package not installed) in one call that
keeps only report and logs in its results folder; preempt stops a run with SIGTERM and resumes it; a
second call after the first runs only what is not proven, and a step its budget stops leaves no
process and is incomplete, the steps before it on disk; reports fold into a proof file; a proof
whose step's files changed since is stale, and a call after it runs that step again. In-process: the
calls --plan makes of what is left (estimates built from measured parts), what no GPU has run first,
proof carried to GPUs like the ones that made it, the chat steps' commands carrying the recipes'
defaults, a compiled path that fell back failing its step, the disk a step needs, what a measuring
run leaves."""

import importlib.util
import json
import os
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import PYTHON, REPO, fails_with, recipe_env, run, time_limit
from gpu_check.calls import print_plan, read_machine
from gpu_check.paths import CONFIGS
from gpu_check.plan import (
    CALL_START,
    CHAT_STEPS,
    DEFAULT_BUDGET,
    ESTIMATED_SECONDS,
    NEXT_CALL,
    STEPS,
    STOP_GRACE_SECONDS,
    TIMEOUTS,
    disk_refusal,
    estimate,
    not_run,
    plan_calls,
    requirements,
)
from gpu_check.processes import alive, stop
from gpu_check.proof import (
    PER_GPU,
    PROOF,
    STEP_FILES,
    carry_refusal,
    code_digest,
    code_digests,
    describe_key,
    first_order,
    markdown_proof,
    new_to_gpus,
    proof_key,
    proven_steps,
    stale_proofs,
    step_files,
)
from gpu_check.report import UNSHARDED, assess, exit_status, markdown
from gpu_check.run_outputs import discard_weights, measured_parts
from gpu_check.runner import StepRunner
from gpu_check.steps.chat import PROMPT_BUCKET, ChatSteps, finite_figures
from gpu_check.steps.chat_figures import (
    COMPILE_FIGURES,
    dpo_figures,
    fell_back,
    grpo_figures,
    sft_figures,
    speed_comparison,
    trl_comparison,
    trl_figures,
)

from accelerate_recipes import PREEMPTED_EXIT_CODE
from accelerate_recipes.cli import RecipeError

CHECK = REPO / "benchmarks" / "gpu_check"  # a folder that Python runs: its __main__.py
# Steps of the one-GPU plan with tiny sizes; sync-bn and dp-vs-ddp need CUDA and are reported as not
# run. preempt runs in the budget-cut calls below, ddp and allreduce in test_no_install.py (through
# make, nothing installed).
SMOKE = ["sft", "dpo", "grpo", "sft-speed-lora", "fast94", "text-fsdp", "nccl-doctor", "sync-bn", "dp-vs-ddp"]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    proc = run([PYTHON, CHECK, "--output_dir", tmp_path / "out"], recipe_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.output[-2000:]
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.output[-2000:]
    assert proc.stderr.startswith("error: no NVIDIA GPU") and "--device cpu --quick" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_bad_input_is_one_line_naming_cause_and_fix(tmp_path):
    env = recipe_env(tmp_path)
    cpu = [PYTHON, CHECK, "--device", "cpu"]
    fails_with(run([*cpu, "--steps", "fast94,warp-drive"], env), "unknown step(s) warp-drive", "dp-vs-ddp")
    fails_with(
        run([*cpu, "--after", tmp_path / "none.json"], env), "--after", "not found", "docs/gpu-proof.json"
    )
    (tmp_path / "other.json").write_text('{"rows": []}')
    fails_with(
        run([*cpu, "--after", tmp_path / "other.json"], env), "neither a gpu-check report nor a proof file"
    )
    fails_with(run([*cpu, "--merge", tmp_path / "none"], env), "--merge", "not found", "report.json")
    fails_with(
        run([*cpu, "--results_dir", "x", "--output_dir", "x"], env), "another folder than --output_dir"
    )
    fails_with(run([*cpu, "--machine", "x"], env), "--machine", "together with --plan")


def test_help_explains_the_calls_the_proof_and_the_verdicts(tmp_path):
    proc = run([PYTHON, CHECK, "--help"], recipe_env(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.output[-2000:]
    for words in (
        "--after TEXT",
        "docs/gpu-proof.json",
        "--merge",
        "--results_dir",
        "PARTIAL",
        "unsharded",
        "--budget",
        "--plan",
        "--machine TEXT",
    ):
        assert words in proc.stdout, words


def plain_checkout(tmp_path) -> tuple[str, dict]:
    """The interpreter beneath this virtual environment with the environment's packages on
    PYTHONPATH, as on a GPU box whose python3 holds torch and the rest were unpacked with `pip
    --target`: .pth files do not run from there, so this project is not installed, and no
    `accelerate` script lies beside the interpreter."""
    python = getattr(sys, "_base_executable", sys.executable)
    packages = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    env = recipe_env(
        tmp_path,
        PYTHONPATH=packages,
        PATH=os.pathsep.join(
            p
            for p in os.environ["PATH"].split(os.pathsep)
            if Path(p).resolve() != Path(PYTHON).parent.resolve()
        ),
    )
    # found, not imported: the call that follows imports them
    # (importing torch here would cost a call's start-up)
    found = "import importlib.util as u; assert all(u.find_spec(m) for m in ('torch', 'accelerate', 'fire'))"
    probe = run([python, "-c", f"{found}; import accelerate_recipes"], env, cwd=tmp_path)
    assert "No module named 'accelerate_recipes'" in probe.stderr, probe.output[-2000:]
    assert not (Path(python).parent / "accelerate").exists()
    return python, env


@pytest.fixture(scope="module")
def smoke(module_tmp) -> dict:
    """One call of the CPU smoke mode from a plain checkout, with a results folder; its output and
    report."""
    tmp = module_tmp.mktemp("smoke")
    out, results = tmp / "check", tmp / "results"
    stale = out / "fast94" / "checkpoints" / "step_00000099"
    stale.mkdir(parents=True)  # an earlier check's leftovers: the step must start clean
    python, env = plain_checkout(tmp)
    # the GPU default of 510 s is no limit for a CPU that runs every step of the plan at tiny sizes:
    # scaled to this one
    budget = time_limit(600)
    command = [
        "--device",
        "cpu",
        "--quick",
        "--steps",
        ",".join(SMOKE),
        "--output_dir",
        out,
        "--results_dir",
        results,
    ]
    proc = run([python, CHECK, *command, "--budget", budget], env, timeout=budget + 120, cwd=tmp)
    report = json.loads((out / "report.json").read_text())
    return {"proc": proc, "out": out, "results": results, "report": report, "stale": stale}


@pytest.fixture(scope="module")
def budget_cut(module_tmp) -> dict:
    """Two calls: the first runs preempt (tiny on the CPU) and nothing else, so it ends when preempt
    does; the second, after the first's report, names bench alone (its full size takes minutes on a
    CPU) with a budget that lets bench start and then cuts it short. Each call's output and
    report."""
    tmp = module_tmp.mktemp("budget")
    env, first, second = recipe_env(tmp), tmp / "first", tmp / "second"
    proc = run(
        [PYTHON, CHECK, "--device", "cpu", "--steps", "preempt", "--output_dir", first], env, timeout=600
    )
    report = json.loads((first / "report.json").read_text())
    # The second call's budget covers its start (the interpreter, torch, the machine's record)
    # before bench: twice the first call's, measured a moment ago on this machine under the same
    # load, and a margin.
    start_up = report["wall_seconds"] - sum(r["wall_seconds"] for r in report["steps"])
    budget = round(2 * start_up + time_limit(5), 1)
    command = ["--device", "cpu", "--steps", "bench", "--after", first / "report.json", "--budget", budget]
    started = time.monotonic()
    cut = run([PYTHON, CHECK, *command, "--output_dir", second], env, timeout=600)
    seconds = time.monotonic() - started
    return {
        "first": {"proc": proc, "out": first, "report": report},
        "second": {"proc": cut, "out": second, "report": json.loads((second / "report.json").read_text())},
        "budget": budget,
        "seconds": seconds,
    }


def test_cpu_smoke_runs_the_one_gpu_plan_in_one_call_from_a_plain_checkout(smoke):
    proc, report = smoke["proc"], smoke["report"]
    results = {r["step"]: r for r in report["steps"]}
    failed = {name: r["detail"][-1500:] for name, r in results.items() if r["status"] != "pass"}
    assert proc.returncode == 0 and set(failed) == {"sync-bn", "dp-vs-ddp"}, (failed, proc.output[-3000:])
    assert [r["step"] for r in report["steps"]] == SMOKE  # in order of value, each once
    left_out = [s for s in STEPS if s not in SMOKE]
    assert report["verdict"] == (
        "PARTIAL: not proved: sync-bn, dp-vs-ddp (needs CUDA); " + f"{', '.join(left_out)} (not in --steps)"
    ), report["verdict"]
    # The machine comes first, with what a later fix needs.
    machine = report["machine"]
    assert report["mode"] == "cpu smoke" and machine["torch"] and machine["accelerate"] and machine["python"]
    assert {"peft", "pyarrow", "fsspec", "datasets", "deepspeed"} <= set(machine["packages"])
    assert machine["packages"]["peft"] and machine["dev_shm"].endswith("free") and machine["tools"]["make"]
    assert machine["tools"]["gcc"].startswith("gcc") and "nvidia-smi" in machine["tools"]
    assert report["key"] == proof_key("cpu smoke", True, machine)

    fast94 = results["fast94"]["figures"]
    recipe = json.loads((Path(results["fast94"]["output_dir"]) / "results.json").read_text())
    assert fast94["train_samples_per_second"] == recipe["train_samples_per_second"] > 0
    assert (
        len(fast94["epoch_seconds"]) == 1 and fast94["epoch_seconds"][0] > 0 and fast94["train_images"] == 128
    )
    assert recipe["preset"] == "fast94" and not smoke["stale"].exists()
    fsdp = results["text-fsdp"]["figures"]
    assert fsdp["distributed_type"] == "FSDP" and fsdp["world_size"] == 2 and fsdp["steps"] > 0
    doctor = results["nccl-doctor"]["figures"]
    assert "gloo all_reduce across 2 node(s) gave the right sum" in doctor["gloo"]
    assert doctor["nccl"].startswith("NCCL all-reduce not run: CPU run") and doctor["busbw_gbps"] is None
    for name in ("sync-bn", "dp-vs-ddp"):
        assert results[name]["status"] == "not run" and results[name]["detail"] == "needs CUDA"
    for name in ("sft", "dpo", "grpo", "fast94", "text-fsdp", "nccl-doctor"):
        assert (
            results[name]["wall_seconds"] > 0 and results[name]["commands"] and results[name]["finished_at"]
        )
    # each command's time, with the parts its results.json
    # tells; the estimates are a GPU's, not recorded here
    timing = results["fast94"]["timing"]["log"]
    assert timing["seconds"] > timing["launch"] > 0 and "estimate" not in results["fast94"]
    assert list(results["sft"]["timing"]) == ["lora", "trl-lora", "full", "trl-full", "lora-fsdp"]
    lora = results["sft"]["timing"]["lora"]
    assert lora["seconds"] > lora["launch"] > 0 and lora["steps"] > 0 and lora["other"] > 0, lora
    table = (smoke["out"] / "report.md").read_text()
    assert table.startswith("# GPU check: PARTIAL: not proved: sync-bn, dp-vs-ddp (needs CUDA)")
    assert f"| fast94 | pass | {results['fast94']['wall_seconds']} |" in table
    assert "| sync-bn | not run (needs CUDA) |" in table and "| nccl-doctor | pass (gloo only) |" in table
    assert f"train_samples_per_second: {fast94['train_samples_per_second']:.4g}" in table
    assert "- text-deepspeed: not in --steps" in table and "/dev/shm" in table and "pyarrow" in table


def test_sft_runs_lora_full_and_lora_under_fsdp2_as_on_one_gpu(smoke):
    sft = next(r for r in smoke["report"]["steps"] if r["step"] == "sft")
    assert sft["status"] == "pass" and list(sft["figures"]) == [
        "vs_trl",
        "lora",
        "trl-lora",
        "full",
        "trl-full",
        "lora-fsdp",
    ], sft
    # TRL right after the recipe's matching run, the sharded run last
    assert [
        (
            "--lora_r 16" in c,
            " -m accelerate.commands.accelerate_cli launch " in c,
            "sft_bench.py trl_speed " in c,
        )
        for c in sft["commands"]
    ] == [
        (True, False, False),
        (True, False, True),
        (False, False, False),
        (False, False, True),
        (True, True, False),
    ]
    assert "--lora_r 0" in sft["commands"][3] and "--device cpu" in sft["commands"][1]
    assert "accelerate_configs/fsdp.yaml --num_processes 2" in sft["commands"][4]
    for name in ("lora", "full", "lora-fsdp"):
        figures, method = sft["figures"][name], name.split("-")[0]
        assert figures["method"] == method and figures["steps"] == 3 and figures["mixed_precision"] == "no", (
            figures
        )
        assert figures["train_tokens_per_second"] > figures["train_target_tokens_per_second"] > 0
        assert figures["peak_memory_mb"] > 0 and figures["memory_plan_mb"]["total"] > 0
        assert "model_flops_utilisation" not in figures  # no GPU peak to divide by on the CPU
        assert figures.get("adapter_saved", method == "lora") is (method == "lora")
    assert (sft["figures"]["lora"]["distributed_type"], sft["figures"]["lora"]["world_size"]) == ("NO", 1)
    # FSDP needs a process group on the CPU: two gloo processes there, one (unsharded) on one GPU
    assert (sft["figures"]["lora-fsdp"]["distributed_type"], sft["figures"]["lora-fsdp"]["world_size"]) == (
        "FSDP",
        2,
    )
    one_gpu = ChatSteps(Path("unused"), 1, False, 0.0).sft_runs()
    assert [(name, processes) for name, _, processes in one_gpu] == [
        ("lora", 1),
        ("trl-lora", 1),
        ("full", 1),
        ("trl-full", 1),
        ("lora-padded", 1),  # on a GPU only: the recipe's default rows
        ("lora-fsdp", 1),
    ]
    fsdp = "launch --config_file " + str(CONFIGS / "fsdp.yaml") + " --num_processes 1"
    assert " ".join(one_gpu[5][1]).endswith(fsdp)
    assert [name for name, _, _ in ChatSteps(Path("unused"), 2, False, 0.0).sft_runs()] == ["lora", "full"]


def test_sft_compares_the_recipe_with_trl_on_the_same_inputs_and_device(smoke):
    """TRL's SFTTrainer (padding-free, fp32 on the CPU, no Liger there) trains the same
    conversations as the recipe, token for token, for as many steps; the comparison holds both runs'
    figures and their ratio."""
    sft = next(r for r in smoke["report"]["steps"] if r["step"] == "sft")
    compared = sft["figures"]["vs_trl"]
    assert list(compared) == ["lora", "full"], compared
    for method in ("lora", "full"):
        ours, trl = sft["figures"][method], sft["figures"][f"trl-{method}"]
        assert (
            trl["trainer"].startswith("trl.SFTTrainer ")
            and trl["method"] == method
            and trl["world_size"] == 1
        )
        assert (trl["steps"], trl["mixed_precision"], trl["weights_dtype"]) == (3, "no", "float32"), trl
        assert (
            trl["padding_free"] is True
            and trl["liger_kernel"] is False
            and trl["attn_implementation"] == "sdpa"
        )
        assert (
            trl["train_tokens_per_second"] > 0
            and trl["median_step_seconds"] > 0
            and trl["peak_memory_mb"] > 0
        )
        # the same tokens per conversation (the same chat template and tokenizer), and the recipe's
        # FLOPs per token
        assert abs(trl["mean_tokens_per_conversation"] - ours["mean_tokens_per_conversation"]) < 0.1, (
            ours,
            trl,
        )
        assert trl["flops_per_token"] == ours["flops_per_token"] and "model_flops_utilisation" not in trl
        results = json.loads((Path(sft["output_dir"]) / f"trl-{method}" / "results.json").read_text())
        # our count of the packed rows is TRL's
        assert results["train_tokens"] == results["trl_num_tokens"] > 0
        assert len(results["train_losses"]) == 3 and all(0 < loss < 20 for loss in results["train_losses"])
        row = compared[method]
        assert row["train_tokens_per_second"] == {
            "ours": round(ours["train_tokens_per_second"], 1),
            "trl": round(trl["train_tokens_per_second"], 1),
        }
        assert row["ours_over_trl"] == round(
            ours["train_tokens_per_second"] / trl["train_tokens_per_second"], 3
        )
        assert row["ours_over_trl"] > 0 and row["trl_liger_kernel"] is False
        assert row["attn_implementation"] == {"ours": ours["attn_implementation"], "trl": "sdpa"}
        assert row["peak_memory_mb"] == {
            "ours": round(ours["peak_memory_mb"], 1),
            "trl": round(trl["peak_memory_mb"], 1),
        }
        assert "model_flops_utilisation" not in row  # neither run has one on the CPU
    table = (smoke["out"] / "report.md").read_text()
    assert f"| sft | pass | {sft['wall_seconds']} | vs_trl: {{lora: {{ours_over_trl: " in table


def test_grpo_reports_generation_and_update_speed_apart_beside_trls_grpo_trainer(smoke):
    """The recipe's run, then TRL's GRPOTrainer on the same model, prompts and sizes; their figures
    side by side."""
    grpo = next(r for r in smoke["report"]["steps"] if r["step"] == "grpo")
    assert grpo["status"] == "pass", grpo
    assert list(grpo["figures"]) == ["vs_trl", "lora", "trl-lora", "prompts_per_bucket"], grpo
    command, trl_command = grpo["commands"]
    assert "recipes/grpo.py" in command and "--lora_r 16" in command and "--reward number" in command
    # the defaults
    assert "--max_prompt_length" not in command and "--eval_num_samples" not in command
    assert "grpo_bench.py trl" in trl_command and "--device cpu" in trl_command
    for flag in (
        "--batch_size 2",
        "--num_generations 2",
        "--max_new_tokens 8",
        "--max_steps 2",
        "--lora_r 16",
    ):
        assert flag in command and flag in trl_command, flag
    trl, compared = grpo["figures"]["trl-lora"], grpo["figures"]["vs_trl"]
    assert trl["trainer"].startswith("trl.GRPOTrainer") and trl["steps"] == 2
    assert (
        trl["generation_tokens_per_second"] > 0
        and trl["median_step_seconds"] > 0
        and trl["peak_memory_mb"] > 0
    )
    ours = grpo["figures"]["lora"]
    assert compared["ours_over_trl_generation"] == round(
        ours["generation_tokens_per_second"] / trl["generation_tokens_per_second"], 3
    )
    assert compared["trl_over_ours_step"] == round(
        trl["median_step_seconds"] / ours["median_step_seconds"], 3
    )
    assert compared["peak_memory_mb"] == {
        "ours": round(ours["peak_memory_mb"], 3),
        "trl": round(trl["peak_memory_mb"], 3),
    }
    # auto, on a CPU
    assert ours["decode_mode"] == "eager" and ours["first_step_generation_seconds"] > 0
    figures = grpo["figures"]["lora"]
    assert (figures["method"], figures["steps"], figures["num_generations"], figures["max_new_tokens"]) == (
        "lora",
        2,
        2,
        8,
    )
    results = json.loads((Path(grpo["output_dir"]) / "lora" / "results.json").read_text())
    assert figures["generation_tokens_per_second"] == results["generation_tokens_per_second"] > 0
    assert figures["update_tokens_per_second"] == results["train_tokens_per_second"] > 0
    assert figures["peak_memory_mb"] > 0
    prompts = [
        json.loads(line) for line in (Path(grpo["output_dir"]) / "inputs" / "train-prompts.jsonl").open()
    ]
    a, sign, b = prompts[0]["prompt"].split("?")[0].split()[-3:]
    assert prompts[0]["answer"] == str(int(a) + int(b) if sign == "+" else int(a) * int(b))
    assert "eval_pass_at_1" in results  # the evaluation sampled answers, as by default


def test_grpo_prompts_span_several_buckets_of_the_static_cache(smoke):
    """The prompts' lengths as the recipe tokenizes them (the chat template and its generation
    prompt): the training prompts fall in three buckets of PROMPT_BUCKET tokens, most in the first,
    and the held-out ones in all three."""
    from transformers import AutoTokenizer

    grpo = next(r for r in smoke["report"]["steps"] if r["step"] == "grpo")
    tokenizer = AutoTokenizer.from_pretrained(smoke["out"] / "chat-data" / "model")
    counted = {}
    for name in ("train", "validation"):
        written = Path(grpo["output_dir"]) / "inputs" / f"{name}-prompts.jsonl"
        rows = [json.loads(line) for line in written.open()]
        buckets = []
        for row in rows:
            messages = [{"role": "user", "content": row["prompt"]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            buckets.append(-(-len(tokenizer(text, add_special_tokens=False)["input_ids"]) // PROMPT_BUCKET))
        counted[name] = {f"up to {b * PROMPT_BUCKET}": buckets.count(b) for b in sorted(set(buckets))}
    assert counted == grpo["figures"]["prompts_per_bucket"], counted
    assert f"PROMPT_BUCKET = {PROMPT_BUCKET} " in (REPO / "recipes" / "chat" / "generation.py").read_text()
    train, held_out = counted["train"].values(), counted["validation"].values()
    assert len(train) == 3 and sum(train) == 64 and max(train) == list(train)[0], counted
    assert len(held_out) == 3, counted


def test_dpo_runs_padded_as_users_do_beside_trls_dpo_trainer_then_packed_each_finite(smoke):
    """The recipe in left-padded rows with its defaults (its --eval_generate answers included),
    TRL's DPOTrainer after it on the same model, pairs, batch, steps and device (both pad: they
    compare like with like), then packed rows (LoRA on the CPU; in full on a GPU); each run's loss
    finite at every logged step. The reference's forward pass is counted in the FLOPs."""
    dpo = next(r for r in smoke["report"]["steps"] if r["step"] == "dpo")
    assert dpo["status"] == "pass", dpo
    assert list(dpo["figures"]) == ["vs_trl", "lora-padded", "trl-lora", "lora"], dpo
    padded, trl_command, packed = dpo["commands"]
    assert all("--lora_r 16" in c for c in dpo["commands"])
    assert "dpo_bench.py trl_speed" in trl_command and "--device cpu" in trl_command
    assert "--packing" in packed and "--eval_generate 0" in packed
    assert "--packing" not in padded and "--nocompile" not in padded and "--eval_generate" not in padded
    answers = Path(dpo["output_dir"]) / "lora-padded" / "samples.jsonl"
    # --eval_generate's default answers, written
    assert answers.is_file() and answers.read_text().strip()
    for name in ("lora", "lora-padded"):
        figures = dpo["figures"][name]
        assert (
            figures["method"] == "lora" and figures["steps"] == 3 and figures["train_tokens_per_second"] > 0
        )
        assert figures["peak_memory_mb"] > 0 and figures["mean_tokens_per_row"] > 0
        # no cuDNN on a CPU
        assert figures["packing"] is (name == "lora") and figures["sdpa_backends_off"] == []
        assert figures["finite"]["logged_steps"] == 3 and figures["finite"]["loss"] == "finite", figures
        results = json.loads((Path(dpo["output_dir"]) / name / "results.json").read_text())
        assert {k: figures[k] for k in COMPILE_FIGURES if k in figures} == {
            k: results[k] for k in COMPILE_FIGURES if k in results
        }  # the compile counts as the run wrote them
        assert not fell_back(results)
    assert dpo["figures"]["lora-padded"]["compile"] is False  # the CPU's default; a GPU's compiles
    trl, ours = dpo["figures"]["trl-lora"], dpo["figures"]["lora-padded"]
    assert trl["trainer"].startswith("trl.DPOTrainer") and trl["steps"] == 3 and trl["method"] == "lora"
    # the recipes' switch: CUDA only
    assert trl["loss"] == "finite" and trl["sdpa_backends_off"] == []
    # TRL's MFU would count the recipe's FLOPs per token
    assert trl["flops_per_token"] == ours["flops_per_token"]
    compared = dpo["figures"]["vs_trl"]["lora"]
    rates = ours["train_tokens_per_second"], trl["train_tokens_per_second"]
    assert compared["train_tokens_per_second"] == {"ours": round(rates[0], 1), "trl": round(rates[1], 1)}
    assert compared["ours_over_trl"] == round(rates[0] / rates[1], 3) and compared["ours"] == "lora-padded"
    assert "full" not in dpo["figures"]["vs_trl"]
    # rows of 100 tokens
    results = {"train_tokens_per_second": 1000.0, "train_samples_per_second": 5.0}
    assets = {"matmul_parameters": 1_000_000, "layers": 2, "hidden": 64}
    attention = 12 * 2 * 64 * 100
    assert dpo_figures(results, assets, 1.0, "lora")["flops_per_token"] == 6_000_000 + attention
    full = dpo_figures(dict(results, precompute_ref=True), assets, 1.0, "full")
    assert full["flops_per_token"] == 6_000_000 + attention  # no reference pass
    assert full["model_flops_utilisation"] == round((6_000_000 + attention) * 1000 / 1e12, 4)


def test_a_run_is_finite_when_its_logged_losses_and_gradient_norms_are():
    assert finite_figures([0.69, 0.68], [1.5, 2.0]) == {
        "logged_steps": 2,
        "loss": "finite",
        "grad_norm": "finite",
    }
    nan = float("nan")
    assert finite_figures([0.69, nan], [1.5, nan]) == {
        "logged_steps": 2,
        "loss": "not finite",
        "grad_norm": "not finite",
    }
    assert finite_figures([], [])["loss"] == "not finite"
    assert finite_figures([0.69], [])["grad_norm"].startswith("not logged; the recipe's guard checks it")


def test_sft_speed_takes_the_sft_steps_runs_and_trains_rows_of_a_token_budget_within_one_epoch(smoke):
    """On the CPU the speed step's default way (eager, 2 conversations a step) and TRL's run are the
    sft step's own commands, taken from it in the same call, and it runs rows of up to 2,048 tokens
    itself, within one epoch; figures.speed holds each one's tokens/s over the default's."""
    step = next(r for r in smoke["report"]["steps"] if r["step"] == "sft-speed-lora")
    sft = next(r for r in smoke["report"]["steps"] if r["step"] == "sft")
    assert step["status"] == "pass" and list(step["figures"]) == ["speed", "eager", "tokens-2k", "trl"], step
    eager, tokens, trl = (step["figures"][name] for name in ("eager", "tokens-2k", "trl"))
    assert step["commands"][0] == sft["commands"][0] and step["commands"][2] == sft["commands"][1]
    assert eager == {**sft["figures"]["lora"], "from_step": "sft"} and trl["from_step"] == "sft"
    assert list(step["timing"]) == ["tokens-2k"]  # the one run it made
    assert "--batch_tokens 2048" in step["commands"][1] and tokens["batch_tokens"] == 2048
    assert (
        eager["method"] == tokens["method"] == "lora" and not eager["compile"] and 0 < tokens["epochs"] <= 1
    )
    speed = step["figures"]["speed"]
    ratio = tokens["train_tokens_per_second"] / eager["train_tokens_per_second"]
    assert speed["default"] == "eager" and speed["eager"]["over_default"] == 1.0
    assert speed["tokens-2k"]["over_default"] == round(ratio, 3)
    assert speed["fastest"] == ("tokens-2k" if ratio > 1 else "eager")
    fastest = step["figures"][speed["fastest"]]["train_tokens_per_second"]
    assert speed["fastest_over_trl"] == round(fastest / trl["train_tokens_per_second"], 3)
    assert speed_comparison({"compiled": {"train_tokens_per_second": 2.0}}, "eager") == {
        "compiled": {"train_tokens_per_second": 2.0},
        "fastest": "compiled",
    }


def test_results_folder_receives_the_report_and_one_tar_of_logs_without_models(smoke):
    results = smoke["results"]
    assert sorted(p.name for p in results.iterdir()) == ["logs.tar.gz", "report.json", "report.md"]
    assert json.loads((results / "report.json").read_text()) == smoke["report"]
    with tarfile.open(results / "logs.tar.gz") as tar:
        names = tar.getnames()
        sizes = sum(member.size for member in tar.getmembers())
    for log in ("sft/lora.txt", "sft/trl-lora.txt", "sft/full.txt", "sft/lora-fsdp.txt", "grpo/lora.txt"):
        assert log in names, names
    assert "fast94/log.txt" in names and "nccl-doctor/rank0.txt" in names
    assert "sft/full/results.json" in names and "sft/lora/metrics.jsonl" in names
    assert "sft/trl-full/results.json" in names and "grpo/lora/results.json" in names
    assert not [
        n
        for n in names
        if n.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")) or "/checkpoints/" in n
    ]
    assert not [n for n in names if n.split("/")[1] in ("inputs", "text-data")], names
    # the chat steps' shared model and data
    assert not [n for n in names if n.split("/")[0] == "chat-data"], names
    assert sizes < 2_000_000
    # Measuring runs leave no weights: once a run's results.json is read its models and checkpoints
    # go; the inputs the steps share stay (the chat model, the text model)
    left = [
        p.relative_to(smoke["out"]) for p in smoke["out"].rglob("*") if p.suffix in (".safetensors", ".bin")
    ]
    assert left and all(p.parts[0] in ("chat-data", "text-data") for p in left), left
    assert not [p for p in smoke["out"].rglob("*") if p.name in ("checkpoints", "model_best")]


def test_merge_folds_reports_into_a_proof_and_refuses_cpu_reports_for_the_repository(smoke, tmp_path):
    env = recipe_env(tmp_path)
    report = smoke["out"] / "report.json"
    fails_with(run([PYTHON, CHECK, "--merge", report], env), "CPU smoke report", "--proof OTHER.json")
    proof = tmp_path / "proof.json"
    merged = run([PYTHON, CHECK, "--merge", f"{report},{smoke['out']}", "--proof", proof], env, timeout=120)
    assert merged.returncode == 0, merged.output[-2000:]
    (machine,) = json.loads(proof.read_text())["machines"]
    assert machine["key"] == smoke["report"]["key"] and list(machine["steps"]) == [
        "sft",
        "dpo",
        "grpo",
        "sft-speed-lora",
        "fast94",
        "text-fsdp",
        "nccl-doctor",
    ]
    steps = {r["step"]: r for r in smoke["report"]["steps"]}
    assert machine["steps"]["fast94"]["figures"] == steps["fast94"]["figures"]
    # the commands as typed from the project's root: no interpreter path, no checkout path of the
    # machine the interpreter gpu-check ran the steps with
    executable = smoke["report"]["machine"]["executable"]
    (fast94,) = machine["steps"]["fast94"]["commands"]
    assert fast94 == steps["fast94"]["commands"][0].replace(f"{executable} {REPO}/", "python3 ")
    (launch,) = machine["steps"]["text-fsdp"]["commands"]
    assert steps["text-fsdp"]["commands"][0].startswith(
        f"{executable} -m accelerate.commands.accelerate_cli launch "
    )
    assert launch.startswith("accelerate launch --config_file accelerate_configs/fsdp.yaml ")
    assert " recipes/text_classification.py " in launch
    text = proof.with_suffix(".md").read_text()
    assert (
        "Proven: sft, dpo, grpo, sft-speed-lora, fast94, text-fsdp, nccl-doctor. Not yet: sft-speed-full"
        in text
    )
    assert fast94 in text and launch in text and "torch " + smoke["report"]["machine"]["torch"] in text
    assert str(REPO) not in text and executable not in text
    # --after a proof file: what it holds for this machine, on the code the smoke call ran, is not
    # run again
    ran = smoke["report"]["code"]
    carried, differences = proven_steps(json.loads(proof.read_text()), smoke["report"]["key"], None, ran)
    assert sorted(carried) == sorted(machine["steps"]) and not differences
    # an sft, dpo or grpo proof from before the comparison
    # with TRL proves too little: that step runs again
    older = json.loads(proof.read_text())
    for step in ("sft", "grpo"):
        del older["machines"][0]["steps"][step]["figures"]["vs_trl"]
    carried, _ = proven_steps(older, smoke["report"]["key"], None, ran)
    assert "sft" not in carried and "grpo" not in carried and "dpo" in carried
    other = dict(smoke["report"]["key"], torch="0.0.1")
    assert proven_steps(json.loads(proof.read_text()), other) == (
        {},
        [f"no entry for {describe_key(other)}"],
    )
    torch = smoke["report"]["machine"]["torch"]
    assert proven_steps(smoke["report"], other)[1] == [f"torch {torch!r} there, '0.0.1' here"]


def test_the_repository_proof_holds_only_gpu_figures_and_its_markdown_follows_from_it():
    """... and says which GPUs proved each step and where that proof holds."""
    proof = json.loads(PROOF.read_text())
    assert all(machine["key"]["mode"] == "gpu" for machine in proof["machines"])
    text = markdown_proof(proof)
    assert PROOF.with_suffix(".md").read_text() == text
    if not proof["machines"]:
        assert "**Nothing has been proven on a GPU yet.**" in text
        return
    assert "## Which GPUs proved each step, and where it holds" in text
    # its proofs predate the code digests: each is stale, and says so
    records = [(name, m) for m in proof["machines"] for name, r in m["steps"].items() if "code" not in r]
    assert records and "tree_code" not in proof
    older = "nowhere now, stale: it predates the code digests proofs record, so it ran older code"
    older += "; it runs again"
    fast94 = "| fast94 | 1 x NVIDIA H100 80GB HBM3 | 2026-11-26 15:07 UTC | "
    assert fast94 + older + " |" in text
    sft = "| sft | 1 x NVIDIA H100 80GB HBM3 | 2026-11-26 15:06 UTC | nowhere now, stale: it has no vs_trl, "
    assert sft in text and "Stale, so run again: sft, grpo, fast94, text-fsdp," in text


def processes_of(folder: Path) -> list:
    """Every process whose command line names FOLDER: what a step working there left running."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(folder) in " ".join(process.info["cmdline"] or []) and alive(process):
            found.append(process)
    return found


def test_a_stopped_step_leaves_no_process_behind(tmp_path):
    """2 gloo processes under torchrun, each in a session of its own: SIGTERM to the launcher lets
    the recipes save a checkpoint and exit 75; nothing of the step is left afterwards."""
    check = StepRunner(tmp_path, 0, True, time.monotonic() + 600)
    run_dir = check.folder("ddp")
    command = [
        *check.launch("2gpu", 2),
        REPO / "recipes" / "cifar.py",
        *("--dataset", "synthetic", "--synthetic_size", "4096", "--batch_size", "16", "--epochs", "20"),
        *("--log_every", "1", "--checkpoint_every", "0", "--tracker", "none", "--num_workers", "0"),
        *("--output_dir", run_dir),
    ]
    proc = check.start(command, run_dir / "log.txt")
    deadline = time.monotonic() + time_limit(120)
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and '"train/loss"' in metrics.read_text()) and time.monotonic() < deadline:
        assert proc.poll() is None, (run_dir / "log.txt").read_text()[-3000:]
        time.sleep(0.2)
    workers = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "cifar.py" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2 and all(os.getsid(w.pid) != os.getsid(proc.pid) for w in workers), workers
    stop(proc)
    assert not processes_of(run_dir)
    log = (run_dir / "log.txt").read_text()
    assert "SIGTERM at step" in log, log[-3000:]
    # the recipes saved before they ended
    assert list((run_dir / "checkpoints").glob("step_*")), log[-3000:]


def test_preempt_stops_a_run_with_sigterm_and_resumes_it_to_the_end(budget_cut):
    """SIGTERM after step 3: exit 75 and a checkpoint; --resume auto then runs to the last step.
    Nothing is left."""
    proc, report, first = (budget_cut["first"][k] for k in ("proc", "report", "out"))
    (preempt,) = report["steps"]
    assert proc.returncode == 0 and preempt["status"] == "pass", proc.output[-3000:]
    # the rest not in --steps
    assert report["verdict"].startswith("PARTIAL: not proved: sft, dpo"), report["verdict"]
    figures = preempt["figures"]
    assert (
        figures["stop_exit_code"] == PREEMPTED_EXIT_CODE
        and figures["checkpoints"]
        and figures["resumed_from"]
    )
    assert figures["steps"] == figures["total_steps"] == 10
    assert "SIGTERM at step" in (Path(preempt["output_dir"]) / "log.txt").read_text()
    assert not processes_of(first)


def test_a_budget_cut_is_incomplete_keeps_the_steps_before_and_a_later_call_runs_only_the_rest(budget_cut):
    """A call after the first's report carries preempt (passed there, not run again, although
    --steps names bench alone) and the budget cuts bench short: the report on disk holds preempt's
    figures and bench as incomplete, no process of bench is left, and the call ends within the
    budget and a stop's grace."""
    proc, report, second = (budget_cut["second"][k] for k in ("proc", "report", "out"))
    carried, bench = report["steps"]
    (preempt,) = budget_cut["first"]["report"]["steps"]
    assert proc.returncode == 1 and carried == {**preempt, "carried": True}, proc.output[-3000:]
    assert not (second / "preempt").exists() and "proven before: preempt" in proc.stdout
    assert bench["status"] == "incomplete" and bench["detail"].startswith(
        "cut short when --budget ran out"
    ), bench
    assert report["verdict"].startswith("INCOMPLETE: bench (cut short by --budget)"), report["verdict"]
    assert budget_cut["seconds"] < budget_cut["budget"] + STOP_GRACE_SECONDS + time_limit(20)
    assert not processes_of(second)
    # how the next call runs only what is left
    assert f"--after {second / 'report.json'}" in proc.stdout
    assert "| preempt | pass (earlier call, " in (second / "report.md").read_text()


def one_gpu_records() -> list[dict]:
    """What a check on one GPU without deepspeed records: the steps that need 2+ GPUs not run, the
    others passed."""
    needs = requirements(1, "deepspeed not installed")
    records = []
    for name in STEPS:
        figures = {"world_size": 1, "distributed_type": "FSDP"} if name == "text-fsdp" else {"steps": 8}
        if name == "sft":
            figures = {"lora": {"world_size": 1}, "lora-fsdp": {"world_size": 1, "distributed_type": "FSDP"}}
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
    verdict = assess(records)
    assert verdict["verdict"] == (
        "PARTIAL: not proved: text-deepspeed (deepspeed not installed); nccl-doctor, ddp, sync-bn, "
        "allreduce, dp-vs-ddp (needs 2+ GPUs); sharding in sft, sharding in text-fsdp (one process)"
    ), verdict["verdict"]
    assert exit_status(verdict["verdict"]) == 0
    assert verdict["notes"] == {
        "sft": f"lora-fsdp ran {UNSHARDED}",
        "text-fsdp": f"ran {UNSHARDED}",
    }
    # deepspeed that imports runs on one GPU too (unsharded); on the CPU its GPU path needs CUDA
    assert requirements(1, None)["text-deepspeed"] is None
    assert requirements(0, None)["text-deepspeed"] == "needs CUDA"
    # A step left for the next call makes the check
    # incomplete; a failed step makes it fail; both exit 1.
    records[1] = not_run("fast94", f"{NEXT_CALL}: estimated 90 s, 40 s of --budget left")
    verdict = assess(records)["verdict"]
    assert (
        verdict.startswith(f"INCOMPLETE: fast94 ({NEXT_CALL}: estimated 90 s") and exit_status(verdict) == 1
    )
    records[0].update(status="fail", detail="exit 1")
    verdict = assess(records)["verdict"]
    assert verdict.startswith("FAIL: sft; INCOMPLETE: fast94") and exit_status(verdict) == 1


def test_sft_figures_take_the_recipes_flops_and_compare_peak_memory_with_the_plan():
    results = {
        "train_tokens_per_second": 1e6,
        "train_samples_per_second": 1e4,  # 100 tokens per conversation
        "world_size": 2,
        "peak_memory_mb": 150.0,
        "peak_memory_kind": "cuda_max_allocated",
        "memory_plan_mb": {"weights": 40.0, "total": 100.0},
        "flops_per_token": 24_000.0,
        "model_flops_utilisation": 0.0123456,
    }
    figures = sft_figures(results)
    assert figures["model_flops_utilisation"] == 0.0123 and figures["flops_per_token"] == 24_000.0
    assert figures["peak_over_plan"] == 1.5 and figures["mean_tokens_per_conversation"] == 100.0
    cpu = sft_figures(dict(results, peak_memory_kind="host_max_rss", model_flops_utilisation=None))
    assert "model_flops_utilisation" not in cpu and "peak_over_plan" not in cpu
    assert requirements(1, None, ("peft",))["sft"] == "peft not installed"


def test_trl_figures_count_the_recipes_flops_and_an_sft_without_trl_is_not_proved():
    ours = {"train_tokens_per_second": 3000.0, "flops_per_token": 1e6, "peak_memory_mb": 900.0}
    trl = trl_figures(
        {"train_tokens_per_second": 2000.0, "world_size": 1, "peak_memory_mb": 1200.0}, ours, 1.0
    )
    assert trl["flops_per_token"] == 1e6 and trl["model_flops_utilisation"] == round(1e6 * 2000 / 1e12, 4)
    row = trl_comparison({"lora": dict(ours, model_flops_utilisation=0.003), "trl-lora": trl})["lora"]
    assert row["ours_over_trl"] == 1.5 and row["model_flops_utilisation"] == {"ours": 0.003, "trl": 0.002}
    assert row["peak_memory_mb"] == {"ours": 900.0, "trl": 1200.0}
    assert trl_comparison({"lora": ours}) == {}  # no TRL run: nothing to compare
    record = {"step": "sft", "status": "pass", "commands": [], "wall_seconds": 1.0, "detail": ""}
    record["figures"] = {"vs_trl": "not run: trl not installed (pip install trl)", "lora": {"world_size": 1}}
    assert (
        assess([record])["verdict"]
        == "PARTIAL: not proved: sft against TRL (trl not installed (pip install trl))"
    )


def h100_machine() -> dict:
    """The record of the H100 80GB that proved most one-GPU steps (docs/gpu-proof.json): GPUs,
    driver, versions."""
    proof = json.loads(PROOF.read_text())
    return next(m["machine"] for m in proof["machines"] if m["key"]["devices"] == ["NVIDIA H100 80GB HBM3"])


def like(machine: dict, name: str, mib: int, capability: str) -> dict:
    """MACHINE's record with another GPU of MIB MiB and that compute capability, the same
    software."""
    return dict(machine, devices=[name], nvidia_smi=[f"{name}, 580.159.04, {mib} MiB, {capability}"])


def test_the_plan_gives_the_first_call_to_what_no_gpu_has_run_dpo_and_grpo(capsys, tmp_path):
    """--plan on the H100's record: docs/gpu-proof.json's proofs predate the code digests, so every
    step runs again, and the first call goes to what no GPU has run with its defaults: dpo (never
    passed on one) and grpo (passed only with eager decoding, before --decode auto compiled it).
    That call fits a 15-minute lease with a machine start; the sft step and its speed steps come
    next. Each estimate adds up its runs' measured parts; the default budget, a cut step's grace and
    the report fit 9 minutes, and every step fits a call on its own."""
    assert DEFAULT_BUDGET + STOP_GRACE_SECONDS + 10 <= 9 * 60
    assert all(TIMEOUTS[s] <= DEFAULT_BUDGET for s in STEPS)
    assert STEPS[:5] == ["sft", "dpo", "grpo", "sft-speed-full", "sft-speed-lora"]
    assert STEPS[5:10] == ["fast94", "text-fsdp", "detect-640", "preempt", "bench"]
    assert all(ESTIMATED_SECONDS[s] + CALL_START <= DEFAULT_BUDGET for s in STEPS)
    proof = json.loads(PROOF.read_text())
    assert new_to_gpus(proof) == ["dpo", "grpo", "nccl-doctor", "ddp", "sync-bn", "allreduce", "dp-vs-ddp"]
    (tmp_path / "report.json").write_text(json.dumps({"machine": h100_machine()}))
    machine = read_machine(str(tmp_path))
    assert print_plan(machine, proof, "docs/gpu-proof.json", STEPS, 540) == 0
    out = capsys.readouterr().out
    assert "proven on these GPUs" not in out, out
    assert "stale, so run again: sft, grpo (it has no vs_trl, " in out
    others = "fast94, text-fsdp, detect-640, preempt, text-deepspeed, audit-cifar, audit-text, audit-detect"
    assert others + " (it predates the code digests" in out
    assert "never run on a GPU with their defaults, so first: dpo, grpo\n" in out
    assert "\ncall 1: dpo, grpo, text-fsdp: estimated " in out
    assert "\ncall 2: sft, sft-speed-full: estimated " in out
    assert "compiled and trl: the sft step's runs of this call" in out
    assert "not on these GPUs: nccl-doctor (needs 2+ GPUs)" in out
    todo = [name for name in STEPS if not requirements(1, None)[name]]
    calls, unfit = plan_calls(first_order(todo, proof), DEFAULT_BUDGET)
    assert list(calls[0]["steps"]) == ["dpo", "grpo"] and not unfit, calls[0]
    # a lease of 15 minutes: a machine start (1-2 minutes), the call with a cut step's grace and the
    # report, within 13
    machine_start, report = 120, 10
    first = plan_calls(first_order(todo, proof), 540)[0][0]
    assert list(first["steps"])[:2] == ["dpo", "grpo"]
    assert machine_start + first["seconds"] + STOP_GRACE_SECONDS + report <= 13 * 60, first["seconds"]
    # the estimates are those of the compiled defaults: dpo's
    # padded run compiles its blocks and its answers' decode
    padded = estimate("dpo")["parts"]["lora-padded"]
    assert padded["compile"] == 57.0 and padded["decode compile"] == 30.0 and padded["answers"] > 0, padded
    # one cache shape for every bucket
    assert estimate("grpo")["parts"]["lora"]["decode compile"] == 30.0
    assert estimate("sft")["parts"]["lora-padded"]["compile"] == 38.0
    for name in STEPS:  # an estimate is the sum of its parts, the chat model built once per call
        guess = estimate(name)
        total = sum(sum(p.values()) if isinstance(p, dict) else p for p in guess["parts"].values())
        assert guess["seconds"] == ESTIMATED_SECONDS[name] == round(total, 1)
        assert ("chat model" in guess["parts"]) is (name in CHAT_STEPS)
    sft = estimate("sft")["parts"]
    assert sft["lora"] == {"launch": 24, "compile": 38.0, "steps": 2.6, "evaluation": 4.0, "save": 2.5}
    # the runs the estimates count are those a GPU makes
    one_gpu = ChatSteps(Path("unused"), 1, False, 0.0)
    assert list(sft) == ["chat model", "packed-attention", *[name for name, _, _ in one_gpu.sft_runs()]]
    dpo_runs = [name for name in estimate("dpo")["parts"] if name != "chat model"]
    assert dpo_runs == ["lora-padded", "trl-lora", "full"]
    with_trl = importlib.util.find_spec("trl") is not None
    assert one_gpu.dpo_runs() == [name for name in dpo_runs if name != "trl-lora" or with_trl]
    alone, after_sft = estimate("sft-speed-full"), estimate("sft-speed-full", True, {"full", "trl-full"})
    assert list(alone["parts"]) == ["chat model", "compiled", "trl", "tokens-16k"] and list(
        after_sft["parts"]
    ) == ["tokens-16k"]
    # a speed run within one epoch of the 640 chats (290,880 tokens)
    assert 12 * 16384 < 640 * 454.5 and 20 * 16 <= 640
    with pytest.raises(RecipeError, match="holds no GPU machine's record"):
        read_machine(str(PROOF))


def test_proof_carries_to_gpus_of_the_same_architecture_with_as_much_memory_but_speed_figures_stay():
    """An H100's proof holds on an H200 (sm_90, more memory, the same software), but for the speed
    steps; it does not hold on less memory, another compute capability or other software. A carried
    record names the GPUs that proved it, and --merge folds only what a report's own GPUs proved.
    (Its records are given this tree's code digests: as made on this code, they hold by the GPUs'
    rule alone.)"""
    proof, h100 = json.loads(PROOF.read_text()), h100_machine()
    entry = next(m for m in proof["machines"] if m["machine"] == h100)
    entry["steps"]["sft-speed-lora"] = {
        **entry["steps"]["fast94"],
        "figures": {"speed": {"fastest": "compiled"}},
    }
    digests = code_digests()
    for name, record in entry["steps"].items():
        record["code"] = digests[name]
    h200 = like(h100, "NVIDIA H200", 143771, "9.0")
    here = proof_key("gpu", False, h200)
    carried, differences = proven_steps(proof, here, h200)
    assert not differences and carried["fast94"]["proven_on"] == "1 x NVIDIA H100 80GB HBM3"
    assert set(carried) == {"fast94", "text-fsdp", "detect-640", "preempt", "text-deepspeed"} | {
        "audit-cifar",
        "audit-text",
        "audit-detect",
    }
    assert "sft-speed-lora" in PER_GPU and list(stale_proofs(proof, here, h200)) == ["sft", "grpo"]
    # on the H100 itself its speed figures hold
    own, _ = proven_steps(proof, proof_key("gpu", False, h100), h100)
    assert "sft-speed-lora" in own and "proven_on" not in own["fast94"]
    there = entry["key"]
    h100_40 = like(h100, "NVIDIA H100 PCIe", 40960, "9.0")
    assert carry_refusal(there, h100, proof_key("gpu", False, h100_40), h100_40) == (
        "NVIDIA H100 80GB HBM3 (81559 MiB) there, NVIDIA H100 PCIe with less memory (40960 MiB) here"
    )
    a100 = like(h100, "NVIDIA A100-SXM4-80GB", 81920, "8.0")
    assert carry_refusal(there, h100, proof_key("gpu", False, a100), a100) == (
        "NVIDIA H100 80GB HBM3 (compute capability 9.0) there, NVIDIA A100-SXM4-80GB (8.0) here"
    )
    newer = dict(here, torch="2.14.0+cu130")
    assert carry_refusal(there, h100, newer, h200) == "torch '2.11.0+cu130' there, '2.14.0+cu130' here"
    assert proven_steps(proof, newer, h200) == ({}, [f"no entry for {describe_key(newer)}"])


def test_merge_folds_only_what_a_reports_own_gpus_proved(tmp_path, capsys):
    from gpu_check.proof import merge_reports

    h200 = like(h100_machine(), "NVIDIA H200", 143771, "9.0")
    record = {"status": "pass", "commands": [], "wall_seconds": 1.0, "figures": {"steps": 1}, "detail": ""}
    report = {"key": proof_key("gpu", False, h200), "machine": h200}
    report["steps"] = [dict(record, step="fast94", carried=True, proven_on="1 x NVIDIA H100 80GB HBM3")]
    estimated = {"seconds": 50.0, "parts": {}}
    report["steps"].append(dict(record, step="preempt", estimate=estimated, code=code_digest("preempt")))
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert merge_reports([str(tmp_path / "report.json")], tmp_path / "proof.json") == 0
    proof = json.loads((tmp_path / "proof.json").read_text())
    (machine,) = proof["machines"]
    assert (
        list(machine["steps"]) == ["preempt"] and machine["steps"]["preempt"]["estimate"]["seconds"] == 50.0
    )
    # what the markdown judges by
    assert machine["steps"]["preempt"]["code"] == proof["tree_code"]["preempt"]
    text = (tmp_path / "proof.md").read_text()
    assert (
        "| preempt | 1 x NVIDIA H200 | ? | 1 GPU of compute capability 9.0 with 143771 MiB or more each"
        in text
    )
    assert "Stale, so run again: none." in text
    assert "gpu-check: 1 proven step(s)" in capsys.readouterr().out
    # the same proof judged against a tree whose cifar
    # recipe changed since: stale, and the markdown says so
    proof["tree_code"]["preempt"] = "0" * 16
    changed = markdown_proof(proof)
    assert "| preempt | 1 x NVIDIA H200 | ? | nowhere now, stale: its code changed since (digest " in changed
    assert "Stale, so run again: preempt." in changed


def test_a_step_whose_files_changed_since_its_proof_is_stale_and_runs_again(budget_cut, tmp_path):
    """A proof holds for the code it ran: the digest of the files a step runs is the same for a copy
    of the tree and another once one of them changes, for the steps that run that file only. The
    first call's preempt proof holds for this tree, not for one whose cifar recipe changed, and a
    call --after a report whose preempt ran other code carries nothing: it runs preempt again (here
    with no budget left, so preempt is left for the next call) and says why."""
    root = tmp_path / "tree"
    for name in ("preempt", "text-fsdp"):
        for path in step_files(name):
            (root / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
            (root / path.relative_to(REPO)).write_bytes(path.read_bytes())
    assert {"recipes/cifar.py", "accelerate_recipes/cli.py"} <= {
        path.relative_to(REPO).as_posix() for path in step_files("preempt")
    }
    before = {name: code_digest(name, root) for name in ("preempt", "text-fsdp")}
    assert before == {name: code_digest(name) for name in before}  # a copy: this checkout's digests
    recipe = root / "recipes" / "cifar.py"
    recipe.write_text(recipe.read_text() + "\n# one more line\n")
    after = {name: code_digest(name, root) for name in before}
    assert after["preempt"] != before["preempt"] and after["text-fsdp"] == before["text-fsdp"]
    assert "recipes/cifar.py" in STEP_FILES["preempt"] and "recipes/cifar.py" not in STEP_FILES["text-fsdp"]

    first = budget_cut["first"]["report"]
    # the tree the first call ran
    key, machine, digests = first["key"], first["machine"], first["code"]
    assert first["steps"][0]["code"] == digests["preempt"] == code_digest("preempt")
    assert "preempt" in proven_steps(first, key, machine, digests)[0]
    changed = dict(digests, preempt=after["preempt"])
    assert proven_steps(first, key, machine, changed)[0] == {}
    why = f"its code changed since (digest {digests['preempt']} there, {after['preempt']} in this tree)"
    assert stale_proofs(first, key, machine, changed) == {"preempt": why}

    stale = json.loads(json.dumps(first))
    stale["steps"][0]["code"] = "0" * 16  # as if made on other code
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    out = tmp_path / "out"
    command = ["--device", "cpu", "--steps", "preempt", "--after", tmp_path / "stale.json"]
    command += ["--budget", "0.01"]
    proc = run([PYTHON, CHECK, *command, "--output_dir", out], recipe_env(tmp_path), timeout=300)
    (record,) = json.loads((out / "report.json").read_text())["steps"]
    assert proc.returncode == 1 and not record.get("carried"), proc.output[-3000:]
    assert record["status"] == "not run" and record["detail"].startswith(NEXT_CALL), record
    assert "run again: preempt (its code changed since (digest 0000000000000000 there, " in proc.stdout


def test_the_chat_steps_give_the_recipes_their_defaults_as_make_runs_them_on_one_gpu(tmp_path):
    """The commands of the dpo, sft and grpo steps on one GPU (built, not run): the runs made the
    way `make dpo-1gpu`, `sft-1gpu` and `grpo-1gpu ARGS="--train_file ... --lora_r 16"` make them,
    through 1gpu.yaml, give the recipe no flag that changes a default path: no --nocompile (compiled
    blocks), no --packing (padded rows), no --eval_generate or --max_new_tokens (dpo's 4 answers of
    up to 128 tokens, in a compiled decode), no --decode, --max_prompt_length or --eval_num_samples
    (grpo's); the other runs differ from them by those named alone."""
    check = ChatSteps(tmp_path, 1, False, 0.0)
    assets = {"model": "MODEL", "train": "TRAIN", "validation": "VALIDATION"}
    default_paths = {"--nocompile", "--compile", "--packing", "--decode", "--attn_implementation", "--liger"}
    default_paths |= {"--max_prompt_length", "--eval_num_samples", "--mixed_precision"}
    default_paths |= {"--gradient_checkpointing"}
    one_gpu = f"launch --config_file {CONFIGS / '1gpu.yaml'} "

    def flags(command) -> set[str]:
        return {str(part) for part in command if str(part).startswith("--")}

    pairs = {"train": "PAIRS", "validation": "HELD_OUT_PAIRS"}
    dpo = {name: command for name, _, command in check.dpo_commands(assets, pairs, tmp_path)}
    assert list(dpo) == ["lora-padded", *(["trl-lora"] if importlib.util.find_spec("trl") else []), "full"]
    padded = " ".join(map(str, dpo["lora-padded"]))
    assert one_gpu + str(REPO / "recipes" / "dpo.py") in padded and "--lora_r 16" in padded
    assert not flags(dpo["lora-padded"]) & (default_paths | {"--eval_generate", "--max_new_tokens"}), padded
    assert flags(dpo["full"]) - flags(dpo["lora-padded"]) == {"--packing", "--eval_generate"}
    assert "--lora_r" not in flags(dpo["full"])  # a full fine-tune: the recipe's default method

    sft = {name: command for name, _, command in check.sft_commands(assets, tmp_path)}
    padded = " ".join(map(str, sft["lora-padded"]))
    assert one_gpu + str(REPO / "recipes" / "sft.py") in padded and "--lora_r 16" in padded
    assert not flags(sft["lora-padded"]) & default_paths, padded
    assert flags(sft["lora"]) - flags(sft["lora-padded"]) == {"--packing"}
    assert [name for name in sft if name.endswith("-padded")] == ["lora-padded"]

    grpo, trl = check.grpo_commands(assets, pairs, tmp_path)
    shown = " ".join(map(str, grpo))
    assert one_gpu + str(REPO / "recipes" / "grpo.py") in shown and "--reward number --lora_r 16" in shown
    assert not flags(grpo) & default_paths, shown
    assert "--max_new_tokens 256" in shown  # the recipe's default
    peer = " ".join(map(str, trl))
    assert "grpo_bench.py trl" in peer and "--device cuda" in peer and "--max_new_tokens 256" in peer
    # on the CPU and in --quick the same ways, tiny: the
    # padded dpo run's answers shorter, nothing compiled there
    cpu_check = ChatSteps(tmp_path, 0, True, 0.0)
    cpu = {name: command for name, _, command in cpu_check.dpo_commands(assets, pairs, tmp_path)}
    assert list(cpu)[-1] == "lora" and "--max_new_tokens" in flags(cpu["lora-padded"])
    assert "lora-padded" not in [name for name, _, _ in cpu_check.sft_runs()]


def test_a_run_whose_compiled_path_fell_back_fails_its_step_and_each_run_counts_its_compilations():
    """The compile counts of results.json (the blocks' and the decode's graphs, recompiles, seconds,
    and the cause of a fall-back to eager) are carried into every chat run's figures, read where
    present (older runs have none); a run that fell back proved the eager path, not the compiled
    default, which its step fails on, naming why."""
    results = {
        "compile_graphs": 0,
        "compile_recompiles": 0,
        "compile_seconds": 0.41,
        "compile_fallback": "inductor needs a C compiler (no cc on PATH); --nocompile runs eagerly",
        "decode_graphs": 1,
        "decode_recompiles": 0,
        "decode_compile_seconds": 31.5,
        "decode_fallback": None,
    }
    assert fell_back(results) == [
        "its compiled blocks fell back to eager (inductor needs a C compiler (no cc on PATH); --nocompile "
        "runs eagerly): it proved the eager path, not the compiled default"
    ]
    decode = fell_back(dict(results, compile_fallback=None, decode_fallback="CUDA graph capture failed"))
    because = "its compiled decode fell back to eager (CUDA graph capture failed)"
    assert decode == [because + ": it proved the eager path, not the compiled default"]
    assert fell_back(dict(results, compile_fallback=None)) == [] and fell_back({}) == []
    assets = {"matmul_parameters": 1_000_000, "layers": 2, "hidden": 64}
    for figures in (sft_figures(results), dpo_figures(results, assets, None, "lora"), grpo_figures(results)):
        assert {k: figures[k] for k in COMPILE_FIGURES} == results
    for figures in (sft_figures({}), dpo_figures({}, assets, None, "lora"), grpo_figures({})):
        assert not set(COMPILE_FIGURES) & set(figures)  # a run from before the counts


def test_a_step_is_new_to_gpus_until_a_gpu_passed_it_running_its_defaults():
    """dpo has never passed on a GPU, and grpo passed only decoding eagerly: both new, and first in
    a call on GPUs. A GPU's pass with the defaults shown (dpo's padded run compiled, grpo's decode
    compiled) ends that, whatever its software or code; a CPU smoke report's pass never does."""
    proof = json.loads(PROOF.read_text())
    assert new_to_gpus(proof)[:2] == ["dpo", "grpo"] and new_to_gpus(None) == []
    assert first_order(["sft", "dpo", "grpo", "fast94"], proof) == ["dpo", "grpo", "sft", "fast94"]
    machine = proof["machines"][0]
    grpo = machine["steps"]["grpo"]
    machine["steps"]["grpo"] = {**grpo, "figures": {**grpo["figures"], "lora": {"decode_mode": "compiled"}}}
    machine["steps"]["dpo"] = {**grpo, "figures": {"lora-padded": {"compile": False}}}
    assert new_to_gpus(proof)[:1] == ["dpo"]  # an eager padded run does not show dpo's GPU default
    machine["steps"]["dpo"]["figures"]["lora-padded"]["compile"] = True
    assert "dpo" not in new_to_gpus(proof) and "grpo" not in new_to_gpus(proof)
    cpu = {"key": {"mode": "cpu smoke"}, "steps": [{"step": "dpo", "status": "pass", "figures": {}}]}
    assert "dpo" in new_to_gpus(cpu)


def test_a_step_refuses_to_start_without_the_disk_it_writes_in_one_line(tmp_path):
    assert disk_refusal("sft", False, 13 * 2**30, tmp_path) is None
    why = disk_refusal("sft", False, 5 * 2**30, tmp_path)
    assert why == (
        f"needs 12 GB of free disk in {tmp_path} (what it writes at once), 5.0 GB free: free some, or give "
        "--output_dir on a larger disk"
    )
    # tiny models on the CPU and in --quick
    assert disk_refusal("sft", True, 2**30, tmp_path) is None
    assert disk_refusal("fast94", False, 2**30, tmp_path).startswith("needs 2 GB of free disk")
    assert assess([not_run("sft", why)])["verdict"] == f"PARTIAL: not proved: sft ({why})"


def test_a_measuring_run_leaves_its_logs_and_results_not_its_weights(tmp_path):
    run = tmp_path / "sft" / "full"
    for name in (
        "checkpoints/step_00000020/model.safetensors",
        "model_best/model.safetensors",
        "model.safetensors",
    ):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(b"w" * 10)
    for name in ("results.json", "metrics.jsonl", "config.json"):
        (run / name).write_text("{}")
    (tmp_path / "sft" / "inputs").mkdir()
    # what the step's runs read: kept
    (tmp_path / "sft" / "inputs" / "model.safetensors").write_bytes(b"w")
    assert discard_weights(tmp_path / "sft") == 30
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl", "results.json"]
    assert (tmp_path / "sft" / "inputs" / "model.safetensors").is_file()
    parts = measured_parts(60.04, {"wall_seconds": 40.0, "train_seconds": 30.0, "warmup_seconds": 20.0})
    assert parts == {"seconds": 60.0, "launch": 20.0, "warmup": 20.0, "steps": 10.0, "other": 10.0}
    assert measured_parts(5.0, {}) == {"seconds": 5.0}


def test_a_gpu_report_shows_each_steps_estimate_beside_its_time_and_where_carried_proof_was_made():
    h200 = like(h100_machine(), "NVIDIA H200", 143771, "9.0")
    guess = estimate("sft")
    sft = {
        "step": "sft",
        "status": "fail",
        "commands": ["x"],
        "wall_seconds": 264.5,
        "figures": {},
        "detail": "exit 1",
    }
    sft.update(estimate=guess, timing={"lora": {"seconds": 80.0, "launch": 25.0}})
    carried = {**not_run("fast94", ""), "status": "pass", "wall_seconds": 58.3, "carried": True}
    carried.update(proven_on="1 x NVIDIA H100 80GB HBM3", finished_at="2026-11-26 15:07 UTC")
    report = {**assess([sft, carried]), "machine": h200, "mode": "gpu", "wall_seconds": 300.0, "budget": 540}
    text = markdown({**report, "steps": [sft, carried]})
    assert f"| sft | fail | 264.5 (est. {guess['seconds']:.0f}) |" in text
    assert "| fast94 | pass (proven on 1 x NVIDIA H100 80GB HBM3, 2026-11-26 15:07 UTC) | 58.3 |" in text
    shown = f"Estimated {guess['seconds']:.0f} s: chat model 20, packed-attention 20 (check 20), "
    assert shown + "lora 71.1 (launch 24, compile 38, " in text
    assert (
        "took 264.5 s." in text
        and "Measured, per command (seconds): lora: {seconds: 80, launch: 25}." in text
    )
