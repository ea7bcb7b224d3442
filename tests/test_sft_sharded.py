"""The chat recipe sharded for real on 2 CPU processes over gloo: FSDP2 (fsdp.yaml) and DeepSpeed
ZeRO-3 (deepspeed.yaml), LoRA and full fine-tunes with gradient checkpointing, against DDP
(cpu.yaml) with the same flags. The FSDP2 LoRA run spans two "nodes" on 127.0.0.1, as fsdp.yaml is
used across machines. The answer-token loss in several chunks under FSDP2 is held to the unsharded
one on 1 and 2 processes."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    CONFIGS,
    NO_PLOTS,
    PYTHON,
    REPO,
    SFT_SCRIPT,
    TORCH_EXTENSIONS,
    check,
    free_port,
    losses,
    read_results,
    recipe_env,
    run,
    sft_files,
    sharded_launch,
    stopped_with,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

# 96 conversations, global batch 8 = 2 processes x 2 per process x 2 accumulation steps: 12 steps
# per epoch, 8 run, a checkpoint every 4 (step 4 is mid-epoch). --max_grad_norm 0.1 clips (1.0 would
# not, on this task), so the runs agree only if every backend
# clips the same global norm of its sharded gradients.
FLAGS = ["--batch_size", "8", "--gradient_accumulation_steps", "2", "--lr", "1e-2", "--max_grad_norm", "0.1"]
FLAGS += ["--max_length", "128", "--max_steps", "8", "--checkpoint_every", "4", "--keep_checkpoints", "3"]
FLAGS += ["--log_every", "1", "--tracker", "none", "--num_workers", "0", "--gradient_checkpointing"]
# dropout masks are drawn per process: none, to compare runs
LORA = ["--lora_r", "8", "--lora_dropout", "0"]
# Same fp32 arithmetic on the same micro-batches; only where the gradient sums happen differs
# (all-reduce vs reduce-scatter). Measured max difference over the 8 steps: 0 for LoRA (FSDP2 and
# ZeRO-3), 4.8e-7 (FSDP2) and 9.5e-7 (ZeRO-3) for the full fine-tune. A wrong batch, a missed
# accumulation step or another clipping moves the loss by > 5e-3.
TOLERANCE = 1e-5
SHARDING = REPO / "benchmarks" / "sharding.py"
ANSWER_LOSS = REPO / "tests" / "sharded_answer_loss.py"


@pytest.fixture(scope="module")
def data(tiny_chat_model, sft_data, module_tmp):
    return dict(files=sft_files(tiny_chat_model, sft_data), root=module_tmp.mktemp("sft-sharded"))


def launch(data, name, config, *extra, ok=True):
    """sft.py with the data's files, FLAGS and NO_PLOTS, on 2 CPU processes under `config`, as `make sft-fsdp`
    starts it."""
    return sharded_launch(
        data["root"], name, config, SFT_SCRIPT, *data["files"], *FLAGS, *NO_PLOTS, *extra, ok=ok
    )


@pytest.fixture(scope="module")
def ddp_lora(data):
    return launch(data, "ddp-lora", "cpu.yaml", *LORA)[1]


@pytest.fixture(scope="module")
def fsdp_lora(data):
    """FSDP2 over two "nodes" of one process each on 127.0.0.1: the hostfile launcher starts
    fsdp.yaml on each with --num_machines 2, its machine rank and the main node's address, as on two
    servers."""
    hosts = data["root"] / "hosts.txt"
    hosts.write_text("localhost slots=1\nlocalhost slots=1\n")
    out = data["root"] / "fsdp-lora"
    launcher = [
        PYTHON,
        "-m",
        "recipe_tools.multinode",
        "--hostfile",
        hosts,
        "--config_file",
        CONFIGS / "fsdp.yaml",
    ]
    launcher += [
        "--main_process_port",
        free_port(),
        "--launch_args",
        "--num_cpu_threads_per_process 1 --mixed_precision no",
    ]
    args = [*data["files"], *FLAGS, *LORA, "--output_dir", out]
    proc = check(run([*launcher, SFT_SCRIPT, *args], recipe_env(data["root"], ACCELERATE_USE_CPU="true")))
    assert "all 2 node(s) finished" in proc.stdout
    return out


@pytest.fixture(scope="module")
def lesson(data):
    """The full fine-tunes under DDP, FSDP2 and ZeRO-3, run by the concepts guide's command
    (benchmarks/sharding.py) with the model, data and FLAGS of these tests; its report reads their
    results."""
    out = data["root"] / "lesson"
    model, *files = data["files"][1::2]  # --model M --train_file T --validation_file V
    command = [
        PYTHON,
        SHARDING,
        "run",
        "--model",
        model,
        "--train_file",
        files[0],
        "--validation_file",
        files[1],
    ]
    command += [f"--sft_args={' '.join(FLAGS)}", "--output_dir", out]
    env = recipe_env(data["root"], TORCH_EXTENSIONS_DIR=TORCH_EXTENSIONS)
    proc = check(run(command, env, timeout=600))
    return SimpleNamespace(out=out, proc=proc, rows=json.loads((out / "sharding.json").read_text()))


def assert_same_losses(run_dir, reference, tolerance=TOLERANCE):
    ours, theirs = losses(run_dir), losses(reference)
    assert ours and set(ours) <= set(theirs)
    worst = max(abs(ours[s] - theirs[s]) for s in ours)
    assert worst <= tolerance, (worst, ours, theirs)


def assert_same_weights(ours, theirs, tolerance):
    assert sorted(ours) == sorted(theirs)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert worst <= tolerance, worst


def reordered_sum_tolerance(weights, steps: int) -> float:
    """How far two fp32 runs that sum the same gradients in another order may drift apart in `steps`
    AdamW steps.

    A reordered fp32 sum differs by a few ulps (2^-23 relative each); AdamW normalises each step by
    the gradient's own size, so a relative change of its input changes the step by about as much,
    and the step never exceeds about lr, which is far below the weights here. 8 ulps of the largest
    weight per step bounds that with room; a wrong batch, a missed accumulation step or another
    clipping moves the weights by a fraction of lr (1e-2) instead.
    """
    largest = max(w.abs().max().item() for w in weights.values())
    return steps * 8 * 2**-23 * largest


def adapter(run_dir):
    return load_file(run_dir / "adapter_model.safetensors")


def test_fsdp_lora_shards_trains_like_ddp_and_saves_the_whole_adapter(fsdp_lora, ddp_lora):
    results = read_results(fsdp_lora)
    assert results["distributed_type"] == "FSDP" and results["world_size"] == 2 and results["steps"] == 8
    assert (
        results["num_machines"] == 2
        and results["method"] == "lora"
        and results["per_process_batch_size"] == 2
    )
    assert_same_losses(fsdp_lora, ddp_lora)
    steps = losses(fsdp_lora)
    assert steps[8] < steps[1] - 0.1, steps
    # SHARDED_STATE_DICT: each rank wrote its own shard of the weights and of the optimizer state.
    checkpoint = fsdp_lora / "checkpoints" / "step_00000004"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    # The adapter gathered from both ranks: every LoRA matrix of the 7 linear layers x 2 blocks,
    # whole, and what DDP trained up to the order of the gradient sums (measured: no difference on
    # an AVX-512 CPU, 1.5e-8 on an AVX2 one).
    saved = adapter(fsdp_lora)
    assert len(saved) == 28 and all("lora_" in k for k in saved)
    assert saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (8, 64)
    assert_same_weights(saved, adapter(ddp_lora), reordered_sum_tolerance(saved, steps=8))
    best = adapter(fsdp_lora / "model_best")
    best_step = read_results(fsdp_lora)["best_step"]
    assert_same_weights(
        best, adapter(ddp_lora / "model_best"), reordered_sum_tolerance(best, steps=best_step)
    )


def test_the_fsdp_adapter_and_its_merged_model_answer_alike_in_one_process(data, fsdp_lora):
    """The adapter gathered from two nodes' shards answers in one process (--predict); merged into
    its base (--merge) it is one plain model, without LoRA weights, that transformers loads and that
    answers the same, greedy token for token."""
    env = recipe_env(data["root"])
    prompts = ["What colour is the sky?", "Is 'a dull, tedious film' fresh or rotten?"]
    asked = [PYTHON, SFT_SCRIPT, "--max_new_tokens", "6", "--predict", prompts[0], "--predict", prompts[1]]
    answers = [
        json.loads(line) for line in check(run([*asked, "--model", fsdp_lora], env)).stdout.splitlines()
    ]
    assert [row["prompt"] for row in answers] == prompts
    merged = data["root"] / "fsdp-lora-merged"
    check(run([PYTHON, SFT_SCRIPT, "--merge", merged, "--model", fsdp_lora], env))
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    assert not any("lora" in key for key in load_file(merged / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged)
    for prompt, expected in zip(prompts, answers):
        chat = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        generated = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1] :]
        assert tokenizer.decode(generated, skip_special_tokens=True).strip() == expected["answer"].strip()


def test_fsdp_lora_resumes_mid_epoch_from_a_sharded_checkpoint(data, fsdp_lora):
    proc, resumed = launch(
        data, "fsdp-lora-resumed", "fsdp.yaml", *LORA, "--resume", fsdp_lora / "checkpoints" / "step_00000004"
    )
    assert "resumed from" in proc.output and "step 4 of 8" in proc.output
    assert read_results(resumed)["distributed_type"] == "FSDP"
    assert sorted(losses(resumed)) == [5, 6, 7, 8]
    # Same adapter weights, optimizer moments, schedule and
    # data position: the continuation is the same run.
    assert_same_losses(resumed, fsdp_lora, tolerance=0.0)
    # the same code path twice: bit for bit
    assert_same_weights(adapter(resumed), adapter(fsdp_lora), tolerance=0.0)


def test_fsdp_full_fine_tune_trains_like_ddp(lesson):
    out, ddp_full = lesson.out / "fsdp", lesson.out / "ddp"
    results = read_results(out)
    assert results["distributed_type"] == "FSDP" and results["method"] == "full" and results["steps"] == 8
    assert_same_losses(out, ddp_full)
    # The whole model, with the tied output head written once
    # as DDP writes it; measured max difference 1.2e-7.
    saved = load_file(out / "model.safetensors")
    assert_same_weights(
        saved, load_file(ddp_full / "model.safetensors"), reordered_sum_tolerance(saved, steps=8)
    )


def test_the_lesson_reports_what_each_strategy_plans_and_uses_per_process(lesson, data):
    """The concepts guide's table: per strategy the planned memory per process and the measured
    peak. Sharding over 2 processes halves the weights (the norms FSDP2 keeps whole aside) and the
    AdamW states per process, and leaves half the gradients where DDP holds them twice (its
    all-reduce buckets); the peak is the host's resident memory here, so only its presence and order
    of size are checked."""
    rows = {row["strategy"]: row for row in lesson.rows}
    assert list(rows) == ["DDP", "FSDP2", "ZeRO-3"] and {r["processes"] for r in rows.values()} == {2}
    # counted whole, also where ZeRO-3 partitioned them
    assert len({r["parameters"] for r in rows.values()}) == 1
    whole = rows["DDP"]["plan_mb"]
    for name in ("FSDP2", "ZeRO-3"):
        plan = rows[name]["plan_mb"]
        assert plan["optimizer"] == pytest.approx(whole["optimizer"] / 2, rel=1e-6), (name, plan, whole)
        assert plan["gradients"] == pytest.approx(whole["gradients"] / 4, rel=1e-6), (name, plan, whole)
        assert whole["weights"] / 2 <= plan["weights"] < whole["weights"]
        # what sharding divides; the loss's own term differs
        # by path (ZeRO-3 makes each chunk of logits again)
        assert plan["total"] - plan["logits"] < whole["total"] - whole["logits"]
        assert plan["activations"] == whole["activations"]
    for row in rows.values():
        assert row["peak_memory_kind"] == "host_max_rss" and 200 < row["peak_memory_mb"] < 8000, row
        assert row["median_step_seconds"] > 0 and row["eval_loss"] == pytest.approx(
            rows["DDP"]["eval_loss"], abs=1e-4
        )
    table = (lesson.out / "sharding.md").read_text()
    # a row per strategy
    assert table.startswith("| strategy | processes | weights MB") and table.count("\n| ") == 3
    assert "== ZeRO-3 on 2 process(es)" in lesson.proc.stdout and "| FSDP2 | 2 |" in lesson.proc.stdout
    # `report` on finished runs, in any order: DDP's row first, the others measured against it
    again = data["root"] / "lesson-report"
    proc = check(
        run(
            [PYTHON, SHARDING, "report", "--run_dir", lesson.out / "zero3", "--run_dir", lesson.out / "ddp"]
            + ["--output_dir", again],
            recipe_env(data["root"]),
        )
    )
    assert [row["strategy"] for row in json.loads((again / "sharding.json").read_text())] == ["DDP", "ZeRO-3"]
    assert "| ZeRO-3 | 2 |" in proc.stdout


@pytest.mark.parametrize("method", ["lora", "full"])
def test_deepspeed_zero3_trains_like_ddp(method, request, data):
    lora = method == "lora"
    if lora:
        reference = request.getfixturevalue("ddp_lora")
        _, out = launch(data, "zero3-lora", "deepspeed.yaml", *LORA)
    else:
        lesson = request.getfixturevalue("lesson")
        reference, out = lesson.out / "ddp", lesson.out / "zero3"
    results = read_results(out)
    assert results["distributed_type"] == "DEEPSPEED" and results["gradient_accumulation_steps"] == 2
    states = sorted(
        (out / "checkpoints" / "step_00000004" / "pytorch_model").glob("*mp_rank_00_model_states.pt")
    )
    # one shard per rank
    assert [p.name.split("_mp_")[0] for p in states] == ["zero_pp_rank_0", "zero_pp_rank_1"]
    engine = torch.load(states[0], map_location="cpu", weights_only=False)["ds_config"]
    assert engine["zero_optimization"]["stage"] == 3 and engine["gradient_clipping"] == 0.1
    assert_same_losses(out, reference)
    # DeepSpeed's own Adam step; measured max difference from DDP's weights: 1.6e-7 (adapter),
    # 5.3e-6 (full model).
    if lora:
        assert_same_weights(adapter(out), adapter(reference), 1e-5)
    else:
        assert_same_weights(
            load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"), 1e-4
        )


def test_eval_generate_is_refused_at_start_when_the_model_is_sharded(data):
    proc, out = launch(data, "generate", "fsdp.yaml", *LORA, "--eval_generate", "2", ok=False)
    stopped_with(
        proc, out, "--eval_generate needs the whole model in each process, and this run shards it (FSDP)"
    )
    assert "train:" not in proc.output  # stopped before any training


def test_fsdp_lora_trains_in_bf16_with_a_bf16_frozen_base_and_an_fp32_adapter(data):
    # A LoRA run in bf16 loads its frozen base in bf16 and peft keeps the adapter in fp32: the mix
    # of dtypes (and of frozen and trainable weights) that FSDP1's flat parameters refuse within one
    # unit; FSDP2 shards each on its own.
    proc, out = launch(data, "fsdp-lora-bf16", "fsdp.yaml", *LORA, "--mixed_precision", "bf16")
    assert "FSDP, device cpu:0, mixed precision bf16" in proc.output
    steps = losses(out)
    assert sorted(steps) == list(range(1, 9)) and steps[8] < steps[1] - 0.1, steps
    saved = adapter(out)
    assert len(saved) == 28 and {t.dtype for t in saved.values()} == {torch.float32}


@pytest.mark.parametrize("processes", [1, 2])
def test_the_answer_loss_in_chunks_under_fsdp2_gives_the_unsharded_loss_and_gradients(
    data, tiny_chat_model, processes
):
    """tests/sharded_answer_loss.py under fsdp.yaml: LoRA and a full fine-tune of the tiny Llama
    (output layer tied to the embeddings, gradient checkpointing, decoder blocks compiled as
    --compile compiles them on a GPU, with the aot_eager backend), 3 or more chunks of logits per
    micro-batch. A training pass, an evaluation pass and a training pass again give transformers'
    unsharded eager loss (within 1e-6 relative), every answer token's loss and every gradient
    (within 1e-6 + 1e-5 relative, averaged over the processes as FSDP2 averages); so do the token
    log-probabilities of GRPO's and DPO's updates at a temperature, and their gradients. The blocks
    compile one graph for all of it, without a break: a graph per block or per pass would show.
    FSDP2 up to torch 2.13 runs a group's forward hooks only when none of its modules is pending in
    the pass: a loss that called the output layer per chunk under activation checkpointing met its
    weight sharded again in the backward pass there (a DTensor error)."""
    # sharded_launch starts 2 processes; a later --num_processes wins
    _, out = sharded_launch(
        data["root"],
        f"answer-loss-{processes}",
        "fsdp.yaml",
        ANSWER_LOSS,
        tiny_chat_model,
        launcher=["--num_processes", str(processes)],
    )
    for rank in range(processes):
        results = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert results["world_size"] == processes
        for method in ("lora", "full"):
            run = results[method]
            assert run["tied"] and run["sharded"] == "DTensor" and run["chunks"] >= 3, (method, run["chunks"])
            assert (run["graphs"], run["graph_breaks"], run["blocks"]) == (1, 0, 2), method
            torch.testing.assert_close(
                run["token_losses"], run["expected_token_losses"], atol=1e-6, rtol=1e-5
            )
            expected = run["expected_gradients"]
            assert expected and ("model.embed_tokens.weight" in expected) == (method == "full")
            for name in ("first", "second"):
                loss, gradients = run[f"{name}_loss"], run[f"{name}_gradients"]
                assert abs(loss - run["expected_loss"]) <= 1e-6 * run["expected_loss"], (method, name, loss)
                assert gradients.keys() == expected.keys(), (method, name)
                for key, gradient in gradients.items():
                    torch.testing.assert_close(
                        gradient, expected[key], atol=1e-6, rtol=1e-5, msg=f"{method} {key}"
                    )
            # the token log-probabilities of GRPO's and DPO's updates, made in chunks the same way
            torch.testing.assert_close(run["logprobs"], run["expected_logprobs"], atol=1e-6, rtol=1e-5)
            expected, gradients = run["expected_logprob_gradients"], run["logprob_gradients"]
            assert gradients.keys() == expected.keys() and expected, method
            for key, gradient in gradients.items():
                message = f"logprobs {method} {key}"
                torch.testing.assert_close(gradient, expected[key], atol=1e-6, rtol=1e-5, msg=message)
