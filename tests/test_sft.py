"""The chat fine-tuning recipe (recipes/sft.py) run as users run it: LoRA and full, 1 and 2 gloo
processes, two "nodes" on 127.0.0.1, kill and resume, and the fine-tuned model used through
--predict, --chat and --merge.

The shared runs (conftest: sft_one, sft_two, sft_accumulated, sft_full) train a tiny random Llama
with a Llama-3-like chat template on a learnable chat task; the data side (formats, the answer mask,
packing) is tests/test_chat_data.py.
"""

import json
import math
import os
import signal

import pytest
import torch
from conftest import (
    NAN_GRADIENT,
    NO_PLOTS,
    NONFINITE,
    PYTHON,
    SFT_COMMON,
    SFT_FULL,
    SFT_RUN,
    SFT_SCRIPT,
    SKIP_NONFINITE,
    assert_nonfinite_gradients_handled,
    assert_quiet,
    check,
    fails_with,
    free_port,
    read_audit,
    read_metrics,
    read_results,
    recipe_env,
    run,
    sft_files,
    sharded_launch,
)
from safetensors.torch import load_file
from test_resume import start, wait_for_checkpoint
from test_template import assert_copy_ran

ADAPTER = "adapter_model.safetensors"


def step_losses(out) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in read_metrics(out) if "train/loss" in row}


def samples(out) -> list[tuple]:
    """The generated answers of a run's evaluations, in order: (epoch, prompt, answer)."""
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return [(row["epoch"], row["prompt"], row["answer"]) for row in rows]


def assert_close_weights(a, b, name: str, atol: float) -> None:
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst <= atol, f"weights differ by up to {worst}"


def test_the_loss_of_a_step_is_the_mean_over_its_answer_tokens_however_the_batch_is_split(
    sft_one, sft_two, sft_accumulated
):
    """1 process with padded batches, 2 gloo processes with packed rows (varlen) and gradient
    checkpointing, and 1 process with 2 micro-batches per step, padded rows of varying widths
    through compiled blocks and the answers through the compiled decode (a GPU's defaults):
    conversations of different lengths, the same losses step by step, the same adapter, the same
    answers; the blocks compile once per kind of call and once more dynamic in the width (not once
    per width), the decode once per cache shape."""
    reference = step_losses(sft_one.out)
    assert sorted(reference) == list(range(1, 25))  # 12 steps per epoch, 2 epochs, each logged
    for run_ in (sft_two, sft_accumulated):
        losses = step_losses(run_.out)
        assert losses.keys() == reference.keys()
        worst = max(abs(losses[step] - reference[step]) for step in reference)
        assert worst <= 1e-5, f"per-step losses differ by up to {worst}"
        assert_close_weights(sft_one.out, run_.out, ADAPTER, atol=1e-5)
    one, two, accumulated = (read_results(r.out) for r in (sft_one, sft_two, sft_accumulated))
    assert (one["world_size"], two["world_size"], accumulated["gradient_accumulation_steps"]) == (1, 2, 2)
    assert two["packing"] and two["gradient_checkpointing"] and two["samples_seen_per_process"] == [96, 96]
    assert (one["attn_implementation"], two["attn_implementation"]) == ("sdpa", "varlen")
    assert accumulated["compile"] and not accumulated["packing"] and not one["compile"]
    # 24 steps of 48 micro-batches of many widths: the policy's first block and the others (whose
    # input carries a gradient), each static then dynamic in the width; the decode step one graph;
    # nothing fell back
    assert accumulated["compile_graphs"] <= 4 and accumulated["compile_recompiles"] <= 3, accumulated
    assert accumulated["decode_graphs"] == 1 and accumulated["decode_recompiles"] == 0
    assert accumulated["compile_fallback"] is None and accumulated["decode_fallback"] is None
    assert accumulated["compile_seconds"] > 0 and one["compile_graphs"] == one["decode_graphs"] == 0
    # greedy answers, eager and compiled
    assert samples(sft_one.out) == samples(sft_accumulated.out)
    assert accumulated["warmup_seconds"] > 0 and accumulated["warmup_seconds"] < accumulated["train_seconds"]
    assert abs(one["eval_loss"] - two["eval_loss"]) < 1e-5
    # The loss falls from the first step to the last.
    assert one["train_loss_last"] < one["train_loss_first"] - 0.2


def test_rows_of_a_token_budget_give_the_same_steps_on_one_process_with_accumulation_and_on_two(
    tiny_chat_model, sft_data, tmp_path
):
    """--packing --batch_tokens 256: micro-batches of one packed row of at most 256 tokens (about 7
    conversations here). A step takes a row per process per micro-step, so 1 process accumulating 2
    rows and 2 gloo processes with a row each train on the same rows and give the same per-step
    losses and adapter; the conversations seen are counted, not the rows."""
    flags = [*sft_files(tiny_chat_model, sft_data), *SFT_COMMON, "--tracker", "none", "--lora_r", "8"]
    flags += [
        *NO_PLOTS,
        "--packing",
        "--batch_tokens",
        "256",
        "--max_steps",
        "4",
        "--log_every",
        "1",
        "--eval_generate",
        "0",
    ]
    one = tmp_path / "one"
    accumulated = [PYTHON, SFT_SCRIPT, *flags, "--gradient_accumulation_steps", "2", "--output_dir", one]
    check(run(accumulated, recipe_env(tmp_path)))
    _, two = sharded_launch(tmp_path, "two", "cpu.yaml", SFT_SCRIPT, *flags)
    reference, losses = step_losses(one), step_losses(two)
    assert sorted(reference) == [1, 2, 3, 4] and losses.keys() == reference.keys()
    assert max(abs(losses[step] - reference[step]) for step in reference) <= 1e-5
    assert_close_weights(one, two, ADAPTER, atol=1e-5)
    seen = [read_results(one)["samples_seen_per_process"], read_results(two)["samples_seen_per_process"]]
    # 4 steps of 2 rows, more than 2 conversations a row, shared equally by the 2 processes
    assert sum(seen[0]) > 4 * 2 * 2 and seen[1] == pytest.approx([sum(seen[0]) / 2] * 2)
    # the global batch and the throughput count conversations, not rows
    conversations_per_step = sum(seen[0]) / 4
    for results in (read_results(one), read_results(two)):
        assert (results["batch_tokens"], results["per_process_batch_size"]) == (256, 1)
        assert results["global_batch_size"] == pytest.approx(conversations_per_step)
        step_conversations = results["train_samples_per_second"] * results["median_step_seconds"]
        assert step_conversations == pytest.approx(conversations_per_step, rel=0.5)


def test_sft_copy_runs_on_two_processes(sft_two):
    """sft.py and the chat layer it imports (recipes/chat/) copied into an empty project ran there
    on 2 processes, and saved model_best together at the evaluation of the lowest loss."""
    assert_copy_ran(sft_two)
    assert sft_two.modules == {
        "chat/answer_loss.py",
        "chat/conversations.py",
        "chat/generation.py",
        "chat/memory_plan.py",
        "chat/model.py",
        "chat/modes.py",
        "chat/packed_attention.py",
        "chat/packing.py",
        "chat/run_summary.py",
        "sft_data.py",
        "sft_modes.py",
    }
    results = read_results(sft_two.out)
    losses = [row["eval/loss"] for row in read_metrics(sft_two.out) if "eval/loss" in row]
    assert results["best_epoch"] == losses.index(min(losses)) + 1
    assert (sft_two.out / "model_best" / ADAPTER).is_file() and (
        sft_two.out / "model_best" / "best.json"
    ).is_file()


def test_results_samples_and_the_saved_adapter(sft_one):
    out = sft_one.out
    results = read_results(out)
    assert results["recipe"] == "sft" and results["method"] == "lora" and results["steps"] == 24
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert results["eval_samples"] == 32 and results["eval_generated"] == 8
    assert 0.0 <= results["eval_exact_match"] <= 1.0
    # Tokens per second: samples per second x the training
    # set's mean tokens (answer tokens) per conversation.
    assert results["train_tokens_per_second"] > results["train_target_tokens_per_second"] > 0
    assert results["trainable_parameters"] < results["parameters"] / 2
    assert results["metric_for_best_model"] == "eval_loss" and results["best_epoch"] in (1, 2)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["epoch"] for s in samples] == [1] * 5 + [2] * 5
    assert {"prompt", "reference", "answer"} <= samples[0].keys()
    for folder in (out, out / "model_best"):
        assert (folder / ADAPTER).is_file() and (folder / "adapter_config.json").is_file()
        assert (folder / "tokenizer.json").is_file() and not (folder / "model.safetensors").exists()
    assert (out / "results.png").stat().st_size > 10_000


def test_a_full_fine_tune_learns_the_task(sft_full):
    results = read_results(sft_full.out)
    assert results["method"] == "full" and results["trainable_parameters"] == results["parameters"]
    evaluations = [row for row in read_metrics(sft_full.out) if "eval/loss" in row]
    assert len(evaluations) == 4
    assert evaluations[-1]["eval/loss"] < 0.6 * evaluations[0]["eval/loss"]
    assert evaluations[-1]["eval/exact_match"] >= evaluations[0]["eval/exact_match"]
    assert (sft_full.out / "model.safetensors").is_file() and (sft_full.out / "config.json").is_file()
    # SwanLab, offline: the scalars and the sample answers as text.
    (swanlab_run,) = (sft_full.out / "swanlog").glob("run-*")
    logged = next(swanlab_run.glob("run-*.swanlab")).read_bytes()
    assert b"eval/exact_match" in logged and b"eval/samples" in logged
    assert any((swanlab_run / "media" / "text").iterdir())


def test_the_loop_reads_nothing_on_the_host_between_log_steps(sft_full):
    """48 steps logged every 4 (padded batches): the loss normalisation's count and all-reduce stay
    on the device, and the attention masks are built without reading the padding."""
    assert_quiet(read_audit(sft_full.out), sft_full.proc, steps=48, log_every=4)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_sigkill_mid_epoch_then_resume_auto_continues_bit_for_bit(
    method, request, tiny_chat_model, sft_data, tmp_path
):
    reference = request.getfixturevalue("sft_one" if method == "lora" else "sft_full").out
    flags = list(SFT_RUN if method == "lora" else SFT_FULL)
    # The reference's flags with a checkpoint every 3 steps
    # (checkpoints change no number the run computes).
    flags[flags.index("--checkpoint_every") + 1] = "3"
    cmd = [
        PYTHON,
        SFT_SCRIPT,
        *sft_files(tiny_chat_model, sft_data),
        *flags,
        "--output_dir",
        tmp_path / "out",
    ]
    out, log, env = tmp_path / "out", tmp_path / "killed.log", recipe_env(tmp_path)
    proc = start(cmd, env, log)
    try:
        wait_for_checkpoint(proc, out, 3, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "results.json").exists(), "the run finished before it was killed"
    resumed = check(run([*cmd, "--resume", "auto"], env))
    assert "resumed from" in resumed.stdout
    weights = ADAPTER if method == "lora" else "model.safetensors"
    for folder in ("", "model_best"):
        a, b = load_file(str(reference / folder / weights)), load_file(str(out / folder / weights))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{folder or 'last'} differs"
    assert step_losses(out).items() >= {k: v for k, v in step_losses(reference).items() if k > 3}.items()


def test_eval_only_on_two_nodes_counts_each_conversation_once(sft_one, sft_data, tmp_path):
    """--eval_only with 2 processes on two "nodes" on 127.0.0.1 (the hostfile launcher): the loss,
    perplexity and exact match of the training run's last evaluation, each of the 32 conversations
    counted once."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=1\nlocalhost slots=1\n")
    out = tmp_path / "eval"
    launcher = [
        PYTHON,
        "-m",
        "recipe_tools.multinode",
        "--hostfile",
        hostfile,
        "--main_process_port",
        free_port(),
    ]
    # fp32 as the training run (2node.yaml asks for bf16, which a CPU may emulate)
    launcher += [
        "--launch_args",
        "--num_cpu_threads_per_process 1 --mixed_precision no",
        SFT_SCRIPT,
        "--eval_only",
    ]
    data = [
        "--train_file",
        sft_data["train"],
        "--validation_file",
        sft_data["validation"],
        "--batch_size",
        "8",
    ]
    data += ["--eval_generate", "8", "--max_new_tokens", "6", "--model", sft_one.out, "--output_dir", out]
    check(run([*launcher, *data], recipe_env(tmp_path, ACCELERATE_USE_CPU="true")))
    results, trained = read_results(out), read_results(sft_one.out)
    assert (results["world_size"], results["num_machines"], results["eval_samples"]) == (2, 2, 32)
    assert results["eval_loss"] == pytest.approx(trained["eval_loss"], abs=1e-5)
    assert results["eval_exact_match"] == trained["eval_exact_match"]


def test_predict_and_chat_answer_alike(sft_one, tmp_path):
    env = recipe_env(tmp_path)
    prompts = ["What colour is the snow?", "Is 'a dull, tedious film' fresh or rotten?"]
    asked = [PYTHON, SFT_SCRIPT, "--max_new_tokens", "6"]
    predicted = check(
        run([*asked, "--predict", prompts[0], "--predict", prompts[1], "--model", sft_one.out], env)
    )
    rows = [json.loads(line) for line in predicted.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == prompts
    # --chat reads turns from stdin and streams each answer; an empty line ends it.
    chat = check(run([*asked, "--chat", "--model", sft_one.out], env, input=f"{prompts[0]}\n\n"))
    assert rows[0]["answer"].strip() in chat.stdout
    # --merge: test_sft_sharded merges the adapter trained on two nodes under FSDP2 and loads it in
    # transformers


def test_bad_input_is_one_line(tiny_chat_model, sft_data, tmp_path):
    env = recipe_env(tmp_path)
    fails_with(run([PYTHON, SFT_SCRIPT, "--tracker", "none"], env), "give --train_file", "--dataset")
    # A base model: a tokenizer without a chat template.
    base = tmp_path / "base"
    base.mkdir()
    for name in os.listdir(tiny_chat_model):
        if name != "chat_template.jinja":
            (base / name).write_bytes((tiny_chat_model / name).read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    args = [*sft_files(base, sft_data), "--tracker", "none", "--output_dir", tmp_path / "out"]
    fails_with(run([PYTHON, SFT_SCRIPT, *args], env), "chat template")
    fails_with(run([PYTHON, SFT_SCRIPT, "--chat", "--merge", "x"], env), "give one of")


@pytest.mark.parametrize("behaviour", NONFINITE)
def test_nan_gradients_with_a_finite_loss_stop_the_run_at_their_step_or_are_skipped(
    behaviour, tiny_chat_model, sft_data, tmp_path
):
    # NaN gradients in step 2 of 3 (tests/nan_gradient.py); the loss stays finite
    out = tmp_path / "out"
    args = [
        SFT_SCRIPT,
        *sft_files(tiny_chat_model, sft_data),
        *SFT_COMMON,
        "--lora_r",
        "8",
        "--max_steps",
        "3",
    ]
    args += ["--log_every", "1", "--tracker", "none", *SKIP_NONFINITE[behaviour], "--output_dir", out]
    proc = run([PYTHON, NAN_GRADIENT, 2, *args], recipe_env(tmp_path), timeout=300)
    assert_nonfinite_gradients_handled(behaviour, proc, out, bad_steps=[2])
