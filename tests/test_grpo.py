"""The GRPO recipe (recipes/grpo.py) run as users run it: LoRA on 1 process, with accumulation, on 2
gloo processes under DDP, FSDP2 over two "nodes" on 127.0.0.1 and DeepSpeed ZeRO-3; a full fine-tune
with a KL term and two updates per batch of rollouts; kill and resume; --eval_only on 2 processes;
--predict; a reward that breaks.

The policy is the tiny random Llama of the chat tests; the prompts ask for colours ("What colour is
the plum?"), and the rewards are `exact` (the one-word answer) and a user's function from a file
that prefers shorter completions, which a random model learns within a few steps.
"""

import json
import os
import signal

import pytest
import torch
from conftest import (
    CONFIGS,
    GRPO_RUN,
    GRPO_SCRIPT,
    NAN_ATTENTION,
    NAN_GRADIENT,
    PYTHON,
    assert_nonfinite_gradients_handled,
    check,
    fails_with,
    free_port,
    grpo,
    read_metrics,
    read_results,
    recipe_env,
    run,
    steps_with_masked_rows,
)
from safetensors.torch import load_file
from test_resume import start, wait_for_checkpoint

ADAPTER = "adapter_model.safetensors"
# The same rollouts (keyed sampling) and one fp32 reduction order apart: measured max differences
# 1.5e-8 (loss), 6e-8 (mean reward) and 2.1e-6 (adapter weights, which reach 0.2) between 1 process,
# 2 processes and accumulation.
TOLERANCE = 1e-5
# FSDP2 and ZeRO-3 sum the gradients in another order (reduce-scatter) and DeepSpeed clips and steps
# in its own code. AdamW divides each update by the gradient's own running scale, so an entry whose
# gradient is near zero turns a reordered-sum error of a few ulps into an update difference of up to
# lr per step: the sharded adapters are held to 1e-4 (measured: 2.1e-6 FSDP2, 1.4e-5 ZeRO-3); the
# rewards, which show that every completion was the same, and the losses stay within TOLERANCE.
SHARDED_WEIGHTS_TOLERANCE = 1e-4


def launcher(config: str) -> list:
    """`accelerate launch` with `config` on 2 CPU processes in fp32 (as `make grpo-fsdp` starts it
    on a CPU box)."""
    cmd = [PYTHON, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", CONFIGS / config]
    cmd += ["--num_processes", "2", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]
    return [*cmd, "--main_process_port", free_port()]


@pytest.fixture(scope="module")
def grpo_accumulated(grpo_data):
    """2 accumulation micro-steps of 16 completions, each updated in passes of 6, 6 and 4
    (--update_rows)."""
    return grpo(grpo_data, "accumulated", "--gradient_accumulation_steps", "2", "--update_rows", "6")[1]


@pytest.fixture(scope="module")
def grpo_ddp(grpo_data):
    """2 processes under DDP, generating with --decode static (a merged copy, a static KV cache)
    where the others take the CPU's default, eager."""
    return grpo(grpo_data, "ddp", "--decode", "static", launcher=launcher("cpu.yaml"))[1]


@pytest.fixture(scope="module")
def grpo_zero3(grpo_data):
    return grpo(grpo_data, "zero3", launcher=launcher("deepspeed.yaml"))[1]


@pytest.fixture(scope="module")
def grpo_fsdp_two_nodes(grpo_data):
    """FSDP2 over two "nodes" of one process each on 127.0.0.1, started by the hostfile launcher as
    on two servers."""
    hosts = grpo_data["root"] / "hosts.txt"
    hosts.write_text("localhost slots=1\nlocalhost slots=1\n")
    multinode = [
        PYTHON,
        "-m",
        "recipe_tools.multinode",
        "--hostfile",
        hosts,
        "--config_file",
        CONFIGS / "fsdp.yaml",
    ]
    multinode += ["--main_process_port", free_port(), "--launch_args"]
    multinode += ["--num_cpu_threads_per_process 1 --mixed_precision no"]
    # each process's 16 completions updated in passes of at most 5: the sharded gradients reduced
    # once, after the last
    proc, out = grpo(grpo_data, "fsdp-two-nodes", "--update_rows", "5", launcher=multinode)
    assert "all 2 node(s) finished" in proc.stdout
    return out


@pytest.fixture(scope="module")
def grpo_fsdp_blockwise(grpo_data):
    """FSDP2 on 2 processes generating with --gather_for_generation false: each block gathers at
    every token."""
    return grpo(
        grpo_data, "fsdp-blockwise", "--gather_for_generation", "false", launcher=launcher("fsdp.yaml")
    )[1]


def per_step(out, key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in read_metrics(out) if key in row}


def test_the_same_rollouts_and_updates_on_1_process_2_processes_and_with_accumulation(
    grpo_one, grpo_accumulated, grpo_ddp, grpo_fsdp_two_nodes, grpo_fsdp_blockwise, grpo_zero3
):
    """Keyed sampling gives every run the same completions (the same rewards, step by step), however
    they are decoded (the DDP run's static copy), and the loss normalised over the global batch
    gives the same losses and adapter, however the batch is split (accumulation, --update_rows) or
    sharded."""
    reference_rewards, reference_losses = per_step(grpo_one, "train/reward"), per_step(grpo_one, "train/loss")
    adapter = load_file(str(grpo_one / ADAPTER))
    assert len(reference_losses) == 6
    sharded = (grpo_fsdp_two_nodes, grpo_fsdp_blockwise, grpo_zero3)
    for out in (grpo_accumulated, grpo_ddp, *sharded):
        results = read_results(out)
        assert results["steps"] == 6 and results["global_batch_size"] == 8, out.name
        rewards, losses = per_step(out, "train/reward"), per_step(out, "train/loss")
        assert rewards.keys() == reference_rewards.keys() and losses.keys() == reference_losses.keys()
        assert all(abs(rewards[k] - reference_rewards[k]) <= TOLERANCE for k in rewards), (out.name, rewards)
        assert all(abs(losses[k] - reference_losses[k]) <= TOLERANCE for k in losses), (out.name, losses)
        other = load_file(str(out / ADAPTER))
        assert other.keys() == adapter.keys()
        tolerance = SHARDED_WEIGHTS_TOLERANCE if out in sharded else TOLERANCE
        assert max((other[k] - adapter[k]).abs().max().item() for k in adapter) <= tolerance, out.name
    assert (read_results(grpo_ddp)["world_size"], read_results(grpo_ddp)["distributed_type"]) == (
        2,
        "MULTI_CPU",
    )
    assert (
        read_results(grpo_ddp)["decode_mode"] == "static" and read_results(grpo_one)["decode_mode"] == "eager"
    )
    assert read_results(grpo_fsdp_two_nodes)["num_machines"] == 2
    assert read_results(grpo_fsdp_two_nodes)["distributed_type"] == "FSDP"
    assert read_results(grpo_fsdp_blockwise)["distributed_type"] == "FSDP"
    assert read_results(grpo_zero3)["distributed_type"] == "DEEPSPEED"


def test_what_a_user_watches(grpo_one):
    """Per step: reward (each function's too), spread, accuracy, solved prompts, length, clip
    fraction, KL; evaluations at --eval_every and at the epoch's end; samples; results.json with
    tokens/s of generation and training apart."""
    rows = read_metrics(grpo_one)
    step = next(row for row in rows if row.get("step") == 1 and "train/loss" in row)
    watched = ("reward", "reward_std", "reward_std_in_group", "frac_reward_zero_std", "accuracy", "solved")
    for key in (*watched, "completion_length", "truncated", "clip_fraction", "kl"):
        assert f"train/{key}" in step, key
    trained = [row for row in rows if "train/frac_reward_zero_std" in row]
    assert all(0 <= row["train/frac_reward_zero_std"] <= 1 for row in trained)
    # rewards with a length term differ within a group: the spread is there, and the batch's is at
    # least the groups'
    assert all(0 < row["train/reward_std_in_group"] <= row["train/reward_std"] * 1.2 for row in trained)
    assert "train/reward_exact" in step and "train/reward_brevity" in step
    assert step["train/reward"] == pytest.approx(
        step["train/reward_exact"] + step["train/reward_brevity"], abs=1e-6
    )
    # --beta 0: no reference policy
    assert 0 < step["train/completion_length"] <= 8 and step["train/kl"] == 0.0
    evaluations = [row for row in rows if "eval/reward" in row]
    assert [row["step"] for row in evaluations] == [3, 6]
    assert all(0 <= row["eval/accuracy"] <= 1 and "eval/reward_brevity" in row for row in evaluations)
    # 4 samples of every validation prompt at the training temperature: pass@1 their share right,
    # pass@4 the prompts with one right among them
    assert all(0 <= row["eval/pass_at_1"] <= row["eval/pass_at_k"] <= 1 for row in evaluations)
    assert all(row["eval/sampled_reward"] != row["eval/reward"] for row in evaluations)
    results = read_results(grpo_one)
    assert results["recipe"] == "grpo" and results["metric_for_best_model"] == "eval_reward"
    assert results["eval_samples"] == 16  # every validation prompt, once
    assert {"eval_sampled_reward", "eval_pass_at_1", "eval_pass_at_k"} <= results.keys()
    assert results["generation_tokens_per_second"] > 0 and results["train_tokens_per_second"] > 0
    assert results["rewards"] == ["exact", "brevity"] and results["method"] == "lora"
    samples = [json.loads(line) for line in (grpo_one / "samples.jsonl").read_text().splitlines()]
    assert {"prompt", "answer", "reference", "reward"} <= samples[0].keys()
    assert "what colour is the" in samples[0]["prompt"].lower()
    assert (grpo_one / "results.png").is_file() and (grpo_one / "model_best" / ADAPTER).is_file()


def test_a_full_fine_tune_with_a_kl_term_and_two_updates_per_rollout_learns_the_reward(grpo_data):
    """Full fine-tune, a frozen reference copy (--beta), two updates per batch of rollouts (the
    second off-policy, clipped ratio), sequence-mean loss, batch-scaled advantages: the reward it is
    taught rises."""
    extra = ["--lora_r", "0", "--lr", "1e-2", "--epochs", "2", "--beta", "0.04", "--num_iterations", "2"]
    extra += [
        "--loss_type",
        "grpo",
        "--scale_rewards",
        "batch",
        "--mask_truncated",
        "--checkpoint_every",
        "0",
    ]
    proc, out = grpo(grpo_data, "full", *extra)
    results = read_results(out)
    # 6 batches of rollouts x 2 updates x 2 epochs
    assert results["method"] == "full" and results["steps"] == 24
    brevity = per_step(out, "train/reward_brevity")
    assert sum(brevity[s] for s in (21, 22, 23, 24)) > sum(brevity[s] for s in (1, 2, 3, 4)) + 0.2, brevity
    kl = per_step(out, "train/kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-6) and kl[24] > 0  # the policy leaves the reference
    assert (out / "model.safetensors").is_file()
    ask = ["--predict", "What colour is the sky?", "--model", out, "--max_new_tokens", "4"]
    predicted = check(run([PYTHON, GRPO_SCRIPT, *ask], recipe_env(grpo_data["root"])))
    assert json.loads(predicted.stdout.splitlines()[-1])["prompt"] == "What colour is the sky?"


def test_sigkill_then_resume_auto_continues_bit_for_bit(grpo_one, grpo_data):
    out = grpo_data["root"] / "killed"
    log = grpo_data["root"] / "killed.log"
    cmd = [
        PYTHON,
        GRPO_SCRIPT,
        *grpo_data["files"],
        "--reward",
        grpo_data["reward"],
        *GRPO_RUN,
        "--output_dir",
        out,
    ]
    env = recipe_env(grpo_data["root"])
    proc = start(cmd, env, log)
    try:
        wait_for_checkpoint(proc, out, 2, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "results.json").exists(), "the run finished before it was killed"
    resumed = check(run([*cmd, "--resume", "auto"], env))
    assert "resumed from" in resumed.stdout
    for folder in ("", "model_best"):
        a, b = load_file(str(grpo_one / folder / ADAPTER)), load_file(str(out / folder / ADAPTER))
        assert all(torch.equal(a[k], b[k]) for k in a), f"{folder or 'last'} differs"
    reference = per_step(grpo_one, "train/loss")
    assert per_step(out, "train/loss").items() >= {k: v for k, v in reference.items() if k > 2}.items()


def test_eval_only_on_two_processes_scores_each_prompt_once(grpo_one, grpo_data):
    out = grpo_data["root"] / "eval"
    data = ["--train_file", grpo_data["root"] / "train.jsonl", "--validation_file"]
    data += [grpo_data["root"] / "validation.jsonl", "--reward", grpo_data["reward"], "--max_new_tokens", "8"]
    cmd = [*launcher("cpu.yaml"), GRPO_SCRIPT, "--eval_only", "--model", grpo_one, *data, "--batch_size", "8"]
    env = recipe_env(grpo_data["root"], ACCELERATE_USE_CPU="true")
    check(run([*cmd, "--num_generations", "4", "--output_dir", out], env))
    results, trained = read_results(out), read_results(grpo_one)
    assert (results["world_size"], results["eval_samples"]) == (2, 16)
    assert results["eval_reward"] == pytest.approx(trained["eval_reward"], abs=1e-6)


def test_a_reward_that_breaks_stops_the_run_with_one_line(grpo_data):
    broken = grpo_data["reward"].replace(":brevity", ":broken")
    proc, _ = grpo(grpo_data, "broken", reward=broken, ok=False)
    fails_with(
        proc, "brevity.py:broken returned 1 value(s) for 32 completions; return one float per completion"
    )


def test_grpo_goes_on_training_the_chat_recipes_adapter(sft_one, grpo_data):
    """--model the chat recipe's LoRA output: GRPO starts from that adapter (at lr 1e-9 it ends
    where it began, to 1e-6), not from a fresh one, and the saved adapter names the same base model.
    With --beta, the KL reference is that starting adapter (a frozen copy beside it), not the base:
    KL 0 at step 1; only the trained one is saved."""
    extra = ["--max_steps", "2", "--eval_every", "0", "--lr", "1e-9", "--beta", "0.04"]
    _, out = grpo(grpo_data, "from-sft", *extra, model=sft_one.out)
    assert per_step(out, "train/kl")[1] == pytest.approx(0.0, abs=1e-7)
    assert not (out / "reference").exists() and not (out / "model_best" / "reference").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert (
        config["base_model_name_or_path"]
        == json.loads((sft_one.out / "adapter_config.json").read_text())["base_model_name_or_path"]
    )
    trained, start = load_file(str(out / ADAPTER)), load_file(str(sft_one.out / ADAPTER))
    assert trained.keys() == start.keys()
    assert max((trained[k] - start[k]).abs().max().item() for k in start) < 1e-6
    # a trained adapter, not zeros
    assert max(start[k].abs().max().item() for k in start if "lora_B" in k) > 1e-3


def test_nan_gradients_of_fully_masked_attention_rows_are_skipped_with_skip_nonfinite_steps(
    grpo_data, tmp_path
):
    # The update scores prompts and completions in one left-padded batch, with the padding as sdpa's
    # mask: exposed as DPO is (test_dpo.py) to a kernel whose backward
    # gives NaN in fully masked rows (tests/nan_attention.py).
    steps_file = tmp_path / "steps.txt"
    flags = ["--attn_implementation", "nan_masked_rows", "--max_steps", "2", "--checkpoint_every", "0"]
    flags += ["--eval_every", "0", "--max_new_tokens", "4", "--skip_nonfinite_steps"]
    proc, out = grpo(
        grpo_data, "nan-rows-skip", *flags, launcher=[PYTHON, NAN_ATTENTION, steps_file], ok=False
    )
    bad_steps = steps_with_masked_rows(steps_file)
    assert bad_steps, proc.output[-3000:]  # prompts of two lengths: left-padded batches
    assert_nonfinite_gradients_handled("skip", proc, out, bad_steps)


def test_nan_gradients_stop_the_run_at_their_step_before_an_evaluation_between_log_steps(grpo_data):
    # NaN gradients in step 2 (tests/nan_gradient.py), logs at steps 1 and 3 only, an evaluation
    # after step 2: the guard's check before that evaluation stops the run, so model_best never
    # holds the NaN weights.
    flags = ["--max_steps", "3", "--log_every", "100", "--eval_every", "2", "--checkpoint_every", "0"]
    flags += ["--max_new_tokens", "4"]
    proc, out = grpo(grpo_data, "nan-gradients-stop", *flags, launcher=[PYTHON, NAN_GRADIENT, 2], ok=False)
    assert_nonfinite_gradients_handled("stop", proc, out, bad_steps=[2])
    assert not (out / "model_best").exists()
