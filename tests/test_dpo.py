"""The preference-tuning recipe (recipes/dpo.py) run as users run it: a LoRA adapter on 1 process,
on 2 gloo processes with accumulation and packed rows and, with the reference precomputed, under
FSDP2 over two "nodes" on 127.0.0.1; a full fine-tune that learns against its precomputed reference,
on 1 process and under DeepSpeed ZeRO-3, killed and resumed; the chat recipe's adapter trained on
with IPO; --eval_only of packed rows on 2 processes, --predict, and bad pairs. In process: packed
rows against padded ones (log-probabilities, loss, gradients, the stored reference, the evaluation).

The policy is the tiny random Llama of the chat tests; the pairs ask for colours ("What colour is
the plum?"): the chosen answer is the right colour, the rejected one a wrong colour fixed per object
(conftest's colour_pairs). The figures the recipe logs are checked against a computation of their
own here: every answer scored alone, unpadded.
"""

import json
import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CONFIGS,
    DPO_RUN,
    DPO_SCRIPT,
    NAN_ATTENTION,
    NONFINITE,
    PYTHON,
    SKIP_NONFINITE,
    as_conversations,
    assert_nonfinite_gradients_handled,
    check,
    check_png,
    colour_pairs,
    dpo,
    free_port,
    read_metrics,
    read_results,
    recipe_env,
    run,
    steps_with_masked_rows,
)
from safetensors.torch import load_file
from test_resume import start, wait_for_checkpoint

from accelerate_recipes.errors import RecipeError

ADAPTER = "adapter_model.safetensors"
FIGURES = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logp_accuracy")
# The same pairs in other micro-batches: only the padding of a batch (left padding, a row's
# positions counted from its first token) and the order of fp32 sums change. Measured max
# differences from dpo_one on 2 processes, with accumulation and under FSDP2: 1.2e-7 (loss), 2.4e-6
# (adapter weights, which reach 0.2: AdamW divides each update by the gradient's own running scale,
# so where a LoRA A matrix's gradient is near zero a few ulps of reordered sum become a visible part
# of an update). With the accumulation factor left out of the loss (a gradient half the global batch
# mean's), the loss moved by 9e-4 and the adapter by 0.02
# (DPO_RUN's clipping makes the gradient's size count).
TOLERANCE = 1e-5
# FSDP2 and ZeRO-3 sum the gradients in another order (reduce-scatter) and DeepSpeed clips and steps
# with its own Adam: the sharded adapter and model are held to 1e-4 for the reason above (measured
# 2.4e-6 FSDP2, 1.2e-7 ZeRO-3).
SHARDED_WEIGHTS_TOLERANCE = 1e-4
# A full fine-tune that learns the colours: lr 3e-3, beta 0.5 (margins of a few tenths within 20
# steps), 5 epochs of 4 steps, against the reference log-probabilities computed once before
# training. No generated samples (they change no number, and cost time).
FULL = [
    "--lora_r",
    "0",
    "--lr",
    "3e-3",
    "--beta",
    "0.5",
    "--epochs",
    "5",
    "--precompute_ref",
    "--eval_generate",
    "0",
]


def launcher(config: str) -> list:
    """`accelerate launch` with `config` on 2 CPU processes in fp32 (as `make dpo-fsdp` starts it on
    a CPU box)."""
    cmd = [PYTHON, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", CONFIGS / config]
    cmd += ["--num_processes", "2", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]
    return [*cmd, "--main_process_port", free_port()]


def per_step(out, key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in read_metrics(out) if key in row}


def worst_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def dpo_two_accumulated(dpo_data):
    """DPO_RUN on 2 gloo processes with 2 micro-batches each, in the shape `make dpo-<N>gpu` trains
    on GPUs: left-padded rows through compiled decoder blocks for the policy and for the reference
    pass (the base under the adapter), and the --eval_generate answers through the compiled decode
    step, before training and after each epoch (--compile --decode compiled with the aot_eager
    backend: torch.compile's capture without code generation). The global batch of 8 is split four
    ways, so that a loss that left out either the world size or the accumulation factor would
    show."""
    extra = ["--gradient_accumulation_steps", "2", "--compile", "--compile_backend", "aot_eager"]
    extra += ["--decode", "compiled"]
    return dpo(dpo_data, "two-accumulated", *extra, launcher=launcher("cpu.yaml"))[1]


@pytest.fixture(scope="module")
def dpo_fsdp_two_nodes(dpo_data):
    """DPO_RUN with --precompute_ref under FSDP2 over two "nodes" of one process each on 127.0.0.1,
    started by the hostfile launcher as on two servers: the reference log-probabilities computed by
    the sharded model, once."""
    hosts = dpo_data["root"] / "hosts.txt"
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
    proc, out = dpo(dpo_data, "fsdp-two-nodes", "--precompute_ref", launcher=multinode)
    assert "all 2 node(s) finished" in proc.stdout
    # generation needs the whole model, which FSDP2 shards
    assert "--eval_generate is off" in proc.output
    return out


@pytest.fixture(scope="module")
def dpo_full(dpo_data):
    """A full fine-tune with the precomputed reference (FULL) on 1 process."""
    return dpo(dpo_data, "full", *FULL)


@pytest.fixture(scope="module")
def dpo_zero3(dpo_data):
    """FULL on 2 processes under DeepSpeed ZeRO-3: a whole model sharded, which a reference copy
    would not be."""
    return dpo(dpo_data, "zero3", *FULL, launcher=launcher("deepspeed.yaml"))[1]


# ----------------------------------------------------------------- the figures, computed here alone
def read_pairs_file(path) -> list[tuple[list, list, list]]:
    """(prompt, chosen, rejected) as message lists, from a file of text pairs or of whole
    conversations."""
    pairs = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "prompt" in row:
            prompt = [{"role": "user", "content": row["prompt"]}]
            answers = [[{"role": "assistant", "content": row[name]}] for name in ("chosen", "rejected")]
        else:
            prompt, answers = row["chosen"][:-1], [row["chosen"][-1:], row["rejected"][-1:]]
        pairs.append((prompt, *answers))
    return pairs


@torch.no_grad()
def answer_logprob(model, tokenizer, prompt: list, answer: list) -> float:
    """An answer's log-probability after its prompt, summed over its tokens: the whole conversation
    rendered by the chat template and read in one unpadded forward pass."""
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole_text = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(whole_text, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) > len(prompt_ids)
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logprobs[len(prompt_ids) - 1 :].sum().item()


def scored_pairs(model, tokenizer, pairs) -> torch.Tensor:
    """[pairs, 2]: each pair's chosen and rejected answer's log-probability under `model`."""
    rows = [
        [answer_logprob(model, tokenizer, prompt, a) for a in (chosen, rejected)]
        for prompt, chosen, rejected in pairs
    ]
    return torch.tensor(rows, dtype=torch.float64)


@pytest.fixture(scope="module")
def dpo_one_scored(dpo_one, dpo_data):
    """[pairs, 4]: the validation pairs' chosen and rejected answers scored here by dpo_one's
    adapter, then by its base."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dpo_data["model"])
    base = AutoModelForCausalLM.from_pretrained(dpo_data["model"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, dpo_one).eval()
    pairs = read_pairs_file(dpo_data["root"] / "validation.jsonl")
    with model.disable_adapter():
        reference = scored_pairs(model, tokenizer, pairs)
    return torch.cat([scored_pairs(model, tokenizer, pairs), reference], dim=1)


# ---------------------------------------------------------------------------------------- the tests
def test_the_loss_of_a_step_is_the_mean_over_the_global_batchs_pairs_however_it_is_split(
    dpo_one, dpo_two_accumulated
):
    """1 process with 1 micro-batch of 8 and 2 gloo processes with 2 micro-batches of 2 each: the
    same losses step by step and the same adapter, since each micro-batch adds its pairs' share of
    the global batch's mean. The 2-process run compiles the decoder blocks, 1 process runs them
    eagerly: neither changes a loss, figure or weight."""
    reference = per_step(dpo_one, "train/loss")
    assert sorted(reference) == list(range(1, 9))  # 4 steps an epoch, 2 epochs, each logged
    out = dpo_two_accumulated
    losses = per_step(out, "train/loss")
    assert losses.keys() == reference.keys()
    assert max(abs(losses[s] - reference[s]) for s in reference) <= TOLERANCE, (losses, reference)
    margins, expected = per_step(out, "train/reward_margin"), per_step(dpo_one, "train/reward_margin")
    assert max(abs(margins[s] - expected[s]) for s in expected) <= TOLERANCE
    assert worst_difference(load_file(str(out / ADAPTER)), load_file(str(dpo_one / ADAPTER))) <= TOLERANCE
    results = read_results(out)
    assert results["eval_samples"] == 16 and results["global_batch_size"] == 8
    assert results["eval_loss"] == pytest.approx(read_results(dpo_one)["eval_loss"], abs=TOLERANCE)
    assert (results["world_size"], results["distributed_type"]) == (2, "MULTI_CPU")
    assert (results["per_process_batch_size"], results["gradient_accumulation_steps"]) == (2, 2)
    assert results["compile"] and not read_results(dpo_one)["compile"] and results["warmup_seconds"] > 0
    assert results["attn_implementation"] == "sdpa"
    assert results["samples_seen_per_process"] == [32, 32]  # 2 epochs of 16 pairs each
    # the adapter moved: the comparison is not one of untouched weights
    assert reference[8] < reference[1] - 5e-3


def test_the_gpu_defaults_compiled_answer_as_eager_and_compile_once_per_kind(dpo_one, dpo_two_accumulated):
    """Padded rows of many widths through the compiled blocks (their losses and adapter are held to
    dpo_one's by the test above): the same greedy answers from the compiled decode as dpo_one's
    eager ones. The blocks compile each kind of call (the reference without gradients, the policy's
    first block, its later blocks, whose input carries a gradient; each with a padding mask and
    without one, where a micro-batch's 4 rows are of one length) static at its first width and
    dynamic at the next, never once per width: at most 12 graphs, within the limit compile_blocks
    sets; the decode step once for its one cache shape."""
    out = dpo_two_accumulated

    def answers(run_out):
        return [
            (s["epoch"], s["prompt"], s["answer"]) for s in map(json.loads, open(run_out / "samples.jsonl"))
        ]

    assert answers(out) == answers(dpo_one) and len(answers(out)) == 12
    results = read_results(out)
    assert results["compile"] and not results["packing"] and results["decode"] == "compiled"
    assert results["compile_graphs"] <= 12 and results["compile_recompiles"] <= 11, results
    from chat.model import BLOCK_GRAPH_LIMIT

    assert results["compile_graphs"] <= BLOCK_GRAPH_LIMIT
    assert (
        results["decode_graphs"] == 1
        and results["decode_recompiles"] == 0
        and results["decode_compile_seconds"] > 0
    )
    assert results["compile_fallback"] is None and results["decode_fallback"] is None
    assert read_results(dpo_one)["compile_graphs"] == read_results(dpo_one)["decode_graphs"] == 0


def test_the_evaluation_is_the_mean_over_the_pairs_of_each_pairs_figures(dpo_one, dpo_one_scored):
    """The recipe's evaluation of its last adapter against its base (left-padded batches of 8 pairs,
    answers of different lengths) equals the DPO figures computed here from each answer scored
    alone, averaged over the 16 validation pairs."""
    results = read_results(dpo_one)
    beta = results["beta"]
    policy_c, policy_r, ref_c, ref_r = dpo_one_scored.T
    chosen, rejected = beta * (policy_c - ref_c), beta * (policy_r - ref_r)
    expected = dict(
        loss=-F.logsigmoid(chosen - rejected).mean(),
        rewards_chosen=chosen.mean(),
        rewards_rejected=rejected.mean(),
        reward_margin=(chosen - rejected).mean(),
        reward_accuracy=(chosen > rejected).double().mean(),
        logps_chosen=policy_c.mean(),
        logps_rejected=policy_r.mean(),
        logp_accuracy=(policy_c > policy_r).double().mean(),
    )
    for name, value in expected.items():
        assert results[f"eval_{name}"] == pytest.approx(value.item(), abs=1e-5), name
    assert results["eval_samples"] == 16
    # the adapter moved every pair's margin: accuracies are meaningful
    assert (chosen - rejected).abs().min() > 1e-4


def test_what_a_user_watches(dpo_one):
    """Per step and per evaluation: the loss, both rewards, their margin, the reward and
    log-probability accuracies; at step 1 the policy is its reference, so the rewards are exactly 0;
    samples before training and after each epoch; results.json, results.png and the best adapter."""
    rows = read_metrics(dpo_one)
    steps = [row for row in rows if "train/loss" in row]
    evaluations = [row for row in rows if "eval/loss" in row]
    assert [row["step"] for row in evaluations] == [4, 8]
    for name in FIGURES:
        assert all(f"train/{name}" in row for row in steps) and all(
            f"eval/{name}" in row for row in evaluations
        )
    first = steps[0]
    assert (
        first["train/rewards_chosen"] == first["train/rewards_rejected"] == first["train/reward_margin"] == 0
    )
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-7)  # -log sigmoid(0)
    for row in [*steps, *evaluations]:
        split = "train" if "train/loss" in row else "eval"
        margin = row[f"{split}/rewards_chosen"] - row[f"{split}/rewards_rejected"]
        assert row[f"{split}/reward_margin"] == pytest.approx(margin, abs=1e-6)
        assert 0 <= row[f"{split}/reward_accuracy"] <= 1 and 0 <= row[f"{split}/logp_accuracy"] <= 1
    assert steps[-1]["train/reward_margin"] > 0
    results = read_results(dpo_one)
    assert (results["recipe"], results["method"], results["loss_type"], results["steps"]) == (
        "dpo",
        "lora",
        "sigmoid",
        8,
    )
    assert (results["train_size"], results["validation_size"], results["train_dropped"]) == (32, 16, 0)
    assert all(f"eval_{name}" in results for name in FIGURES)
    assert results["train_loss_first"] == pytest.approx(math.log(2), abs=1e-7)
    assert (
        results["trainable_parameters"] < results["parameters"] / 2 and results["train_tokens_per_second"] > 0
    )
    assert results["metric_for_best_model"] == "eval_loss" and results["best_epoch"] in (1, 2)
    samples = [json.loads(line) for line in (dpo_one / "samples.jsonl").read_text().splitlines()]
    # before training, then each epoch
    assert [s["epoch"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4
    assert all({"prompt", "reference", "answer"} <= s.keys() for s in samples)
    assert "what colour is the" in samples[0]["prompt"].lower()
    check_png(dpo_one / "results.png")
    for folder in (dpo_one, dpo_one / "model_best"):
        assert (folder / ADAPTER).is_file() and not (folder / "model.safetensors").exists()


def test_a_full_fine_tune_learns_the_colours(dpo_full):
    """Against the reference computed once before training: the training loss falls, and on the
    held-out pairs the right colour's reward pulls ahead of the wrong one's."""
    proc, out = dpo_full
    assert "reference log-probabilities of every pair computed" in proc.stdout
    results = read_results(out)
    assert results["method"] == "full" and results["trainable_parameters"] == results["parameters"]
    assert results["precompute_ref"] and results["steps"] == 20
    losses = per_step(out, "train/loss")
    first_epoch, last_epoch = [losses[s] for s in range(1, 5)], [losses[s] for s in range(17, 21)]
    assert sum(last_epoch) / 4 < sum(first_epoch) / 4 - 0.1, losses
    # stored, not recomputed: ~ulps
    assert per_step(out, "train/reward_margin")[1] == pytest.approx(0, abs=1e-5)
    evaluations = [row for row in read_metrics(out) if "eval/loss" in row]
    assert len(evaluations) == 5
    assert evaluations[-1]["eval/reward_margin"] > max(0.2, evaluations[0]["eval/reward_margin"] + 0.1)
    assert evaluations[-1]["eval/loss"] < evaluations[0]["eval/loss"] - 0.05
    assert (
        results["eval_reward_accuracy"] > 0.5
        and results["eval_rewards_chosen"] > results["eval_rewards_rejected"]
    )
    assert (out / "model.safetensors").is_file() and not (out / ADAPTER).exists()


def test_the_precomputed_reference_is_the_live_one(dpo_one, dpo_fsdp_two_nodes, dpo_full, dpo_data):
    """--precompute_ref stores each pair's reference log-probabilities, those of the starting model
    (scored here alone), and trains as the live reference does: dpo_one (the base with the adapter
    off, read beside each batch) and the FSDP2 run (its stored values) step for step, within
    TOLERANCE. Only the padding of the batches the reference was read in and the order of the
    gradient sums differ: measured 3e-7 apart (loss) between a live and a precomputed full
    fine-tune, 1.2e-7 between FSDP2 and 1 process; a pair's value looked up under another pair's
    index moves a step's loss by > 1e-2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    live, stored = per_step(dpo_one, "train/loss"), per_step(dpo_fsdp_two_nodes, "train/loss")
    assert live.keys() == stored.keys() and max(abs(live[s] - stored[s]) for s in live) <= TOLERANCE, (
        live,
        stored,
    )
    # ulps, not 0
    assert per_step(dpo_fsdp_two_nodes, "train/reward_margin")[1] == pytest.approx(0, abs=1e-5)
    assert read_results(dpo_fsdp_two_nodes)["precompute_ref"] and not read_results(dpo_one)["precompute_ref"]
    # The stored values, as every checkpoint carries them, against the starting model's own scores.
    checkpoint = sorted((dpo_full[1] / "checkpoints").iterdir())[-1]
    values = torch.load(checkpoint / "custom_checkpoint_1.pkl", weights_only=True)
    tokenizer = AutoTokenizer.from_pretrained(dpo_data["model"])
    model = AutoModelForCausalLM.from_pretrained(dpo_data["model"], dtype=torch.float32).eval()
    for split, file in (("train", "train.jsonl"), ("validation", "validation.jsonl")):
        pairs = read_pairs_file(dpo_data["root"] / file)
        expected = scored_pairs(model, tokenizer, pairs)
        assert values[split].shape == (len(pairs), 2)
        assert torch.allclose(values[split].double(), expected, atol=1e-4), split
    # A checkpoint resumes only with the setting it was
    # written with: one line, not load_state's count mismatch.
    from chat.preference_loss import check_same_reference

    live_checkpoint = sorted((dpo_one / "checkpoints").iterdir())[-1]
    check_same_reference(checkpoint, True) or check_same_reference(live_checkpoint, False)
    for folder, given, written in ((checkpoint, False, "with"), (live_checkpoint, True, "without")):
        with pytest.raises(
            RecipeError, match=f"written by a run {written} --precompute_ref; resume it {written} the"
        ):
            check_same_reference(folder, given)


def test_sharded_runs_train_as_one_process_does(dpo_one, dpo_fsdp_two_nodes, dpo_full, dpo_zero3):
    """The LoRA run under FSDP2 over two "nodes" and the full fine-tune under ZeRO-3 (a whole model
    sharded: its reference can only be the precomputed one, since these recipes do not shard a
    frozen copy) against 1 process: losses within TOLERANCE, weights within 1e-4 (see above)."""
    for out, single, weights in (
        (dpo_fsdp_two_nodes, dpo_one, ADAPTER),
        (dpo_zero3, dpo_full[1], "model.safetensors"),
    ):
        losses, expected = per_step(out, "train/loss"), per_step(single, "train/loss")
        assert losses.keys() == expected.keys()
        assert max(abs(losses[s] - expected[s]) for s in losses) <= TOLERANCE, (out.name, losses, expected)
        worst = worst_difference(load_file(str(out / weights)), load_file(str(single / weights)))
        assert worst <= SHARDED_WEIGHTS_TOLERANCE, (out.name, worst)
        assert read_results(out)["eval_samples"] == 16
    fsdp, zero3 = read_results(dpo_fsdp_two_nodes), read_results(dpo_zero3)
    assert (fsdp["distributed_type"], fsdp["num_machines"], fsdp["world_size"]) == ("FSDP", 2, 2)
    assert (zero3["distributed_type"], zero3["world_size"], zero3["method"]) == ("DEEPSPEED", 2, "full")
    assert zero3["precompute_ref"] and zero3["eval_reward_margin"] > 0.2


def test_sigkill_then_resume_auto_continues_bit_for_bit_with_the_stored_reference(dpo_full, dpo_data):
    """Killed once a mid-epoch checkpoint is on disk, then --resume auto: the reference
    log-probabilities come back from the checkpoint (not computed again) and the run ends on the
    uninterrupted run's weights, bit for bit."""
    _, reference = dpo_full
    out, log = dpo_data["root"] / "killed", dpo_data["root"] / "killed.log"
    # dpo_full's flags with a checkpoint every 3 steps (one lands mid-epoch): checkpoints change no
    # number it computes
    cmd = [
        PYTHON,
        DPO_SCRIPT,
        *dpo_data["files"],
        *DPO_RUN,
        *FULL,
        "--checkpoint_every",
        "3",
        "--output_dir",
        out,
    ]
    env = recipe_env(dpo_data["root"])
    proc = start(cmd, env, log)
    try:
        wait_for_checkpoint(proc, out, 3, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "results.json").exists(), "the run finished before it was killed"
    assert "reference log-probabilities of every pair computed" in log.read_text()
    resumed = check(run([*cmd, "--resume", "auto"], env))
    assert "resumed from" in resumed.stdout and "reference log-probabilities" not in resumed.stdout
    for folder in ("", "model_best"):
        a, b = (
            load_file(str(reference / folder / "model.safetensors")),
            load_file(str(out / folder / "model.safetensors")),
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{folder or 'last'} differs"
    start_step = read_results(out)["resumed_from"]
    assert start_step and "step_" in start_step
    done = int(start_step.rsplit("step_", 1)[1])
    expected = {k: v for k, v in per_step(reference, "train/loss").items() if k > done}
    assert per_step(out, "train/loss").items() >= expected.items() and expected


def test_dpo_goes_on_training_the_chat_recipes_adapter(sft_one, dpo_data):
    """--model the chat recipe's LoRA output with --lora_r: that adapter is trained on (not a fresh
    one), its frozen copy is the reference (rewards exactly 0 at step 1, apart later), and only the
    trained adapter is saved. With IPO and --sft_weight: the step-1 loss is (1 / (2 beta))^2 plus
    the weight times the chosen answers' token NLL."""
    extra = [
        "--model",
        sft_one.out,
        "--lora_r",
        "8",
        "--lr",
        "1e-3",
        "--max_steps",
        "3",
        "--loss_type",
        "ipo",
    ]
    extra += ["--sft_weight", "0.5", "--eval_generate", "0"]
    _, out = dpo(dpo_data, "from-sft", *extra)
    first = next(row for row in read_metrics(out) if row.get("step") == 1)
    assert first["train/reward_margin"] == 0 and first["train/rewards_chosen"] == 0
    assert first["train/loss"] == pytest.approx(
        (1 / (2 * 0.1)) ** 2 + 0.5 * first["train/nll_chosen"], rel=1e-6
    )
    assert per_step(out, "train/reward_margin")[3] != 0  # the policy moved; the reference did not
    results = read_results(out)
    assert results["loss_type"] == "ipo" and results["method"] == "lora"
    assert not (out / "reference").exists() and not (out / "model_best" / "reference").exists()
    trained, start_ = load_file(str(out / ADAPTER)), load_file(str(sft_one.out / ADAPTER))
    assert trained.keys() == start_.keys()
    assert 0 < worst_difference(trained, start_) < 1e-2  # 2 updates of at most ~lr each
    # a trained adapter, not zeros
    assert max(start_[k].abs().max().item() for k in start_ if "lora_B" in k) > 5e-2
    config, sft_config = (json.loads((d / "adapter_config.json").read_text()) for d in (out, sft_one.out))
    assert config["base_model_name_or_path"] == sft_config["base_model_name_or_path"]


def test_eval_only_on_two_processes_counts_each_pair_once(dpo_one, dpo_one_scored, dpo_data):
    """--eval_only of dpo_one's adapter against its base on 2 processes (8 pairs each, in batches of
    4, packed), from a validation file alone, with the hinge loss: dpo_one's rewards and accuracies
    (its evaluation padded), and the hinge loss of the margins computed here."""
    out = dpo_data["root"] / "eval"
    data = [
        "--validation_file",
        dpo_data["root"] / "validation.jsonl",
        "--batch_size",
        "8",
        "--loss_type",
        "hinge",
    ]
    data += ["--packing"]
    cmd = [
        *launcher("cpu.yaml"),
        DPO_SCRIPT,
        "--eval_only",
        "--model",
        dpo_one,
        *data,
        "--max_new_tokens",
        "4",
    ]
    proc = check(run([*cmd, "--output_dir", out], recipe_env(dpo_data["root"], ACCELERATE_USE_CPU="true")))
    # the samples
    assert len([line for line in proc.stdout.splitlines() if line.startswith('{"prompt"')]) == 4
    results, trained = read_results(out), read_results(dpo_one)
    assert (results["world_size"], results["eval_samples"], results["loss_type"]) == (2, 16, "hinge")
    for name in FIGURES[1:]:
        assert results[f"eval_{name}"] == pytest.approx(trained[f"eval_{name}"], abs=1e-6), name
    policy_c, policy_r, ref_c, ref_r = dpo_one_scored.T
    margins = results["beta"] * ((policy_c - ref_c) - (policy_r - ref_r))
    assert results["eval_loss"] == pytest.approx(torch.relu(1 - margins).mean().item(), abs=1e-5)


def test_predict_prints_one_json_line_per_prompt(dpo_one, tmp_path, capsys):
    import dpo as recipe

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What colour is the snow?\n\nWhat colour is the crow?\n")
    recipe.main(
        recipe.DpoFlags(
            predict=[str(prompts), "What colour is the sky?"], model=str(dpo_one), max_new_tokens=3
        )
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["prompt"] for row in rows] == [
        "What colour is the snow?",
        "What colour is the crow?",
        "What colour is the sky?",
    ]
    assert all(isinstance(row["answer"], str) for row in rows)


# -------------------------------------------------------------------------------- the loss, in here
def flags(**given):
    import dpo as recipe

    return recipe.DpoFlags(**given)


def test_each_loss_type_against_a_hand_computation():
    """Two pairs, chosen rows first: summed log-probabilities of the policy and the reference, and
    answer lengths."""
    from chat.preference_loss import pair_figures

    policy = torch.tensor([-4.0, -6.0, -5.0, -3.0])  # chosen: -4, -6; rejected: -5, -3
    reference = torch.tensor([-4.5, -5.0, -4.0, -4.0])
    tokens = torch.tensor([2.0, 3.0, 4.0, 1.0])
    # margins of the log-ratios: (0.5 - (-1)) = 1.5 for pair 1, (-1 - 1) = -2 for pair 2
    margin = torch.tensor([1.5, -2.0])

    def figures(**given):
        return pair_figures(policy, reference, tokens, flags(**given))

    sigmoid = figures(beta=0.1)
    assert torch.allclose(sigmoid["loss"], torch.log1p(torch.exp(-0.1 * margin)))
    assert torch.allclose(sigmoid["rewards_chosen"], torch.tensor([0.05, -0.1]))
    assert torch.allclose(sigmoid["rewards_rejected"], torch.tensor([-0.1, 0.1]))
    assert torch.allclose(sigmoid["reward_margin"], 0.1 * margin)
    assert sigmoid["reward_accuracy"].tolist() == [1.0, 0.0] and sigmoid["logp_accuracy"].tolist() == [
        1.0,
        0.0,
    ]
    # per token: 4 / 2, 6 / 3
    assert torch.allclose(sigmoid["nll_chosen"], torch.tensor([2.0, 2.0]))
    # conservative DPO: the labels swapped with probability 0.2
    smoothed = figures(beta=0.1, label_smoothing=0.2)["loss"]
    assert torch.allclose(
        smoothed, 0.8 * torch.log1p(torch.exp(-0.1 * margin)) + 0.2 * torch.log1p(torch.exp(0.1 * margin))
    )
    # hinge (SLiC)
    assert torch.allclose(figures(beta=0.5, loss_type="hinge")["loss"], torch.relu(1 - 0.5 * margin))
    # IPO on mean token log-probabilities: chosen -2, -2 (policy) against -2.25, -5/3; rejected
    # -1.25, -3 vs -1, -4
    per_token = (torch.tensor([-2.0, -2.0]) - torch.tensor([-2.25, -5 / 3])) - (
        torch.tensor([-1.25, -3.0]) - torch.tensor([-1.0, -4.0])
    )
    ipo = figures(beta=0.25, loss_type="ipo")
    assert torch.allclose(ipo["loss"], (per_token - 1 / (2 * 0.25)) ** 2)
    assert torch.allclose(ipo["reward_margin"], 0.25 * per_token)
    # --sft_weight adds the chosen answer's mean token NLL to each pair's loss, whatever the loss
    # type
    for loss_type in ("sigmoid", "hinge", "ipo"):
        plain, rpo = figures(loss_type=loss_type), figures(loss_type=loss_type, sft_weight=0.3)
        assert torch.allclose(rpo["loss"], plain["loss"] + 0.3 * torch.tensor([2.0, 2.0]))
        assert torch.equal(rpo["reward_margin"], plain["reward_margin"])
    # the gradient flows through the policy only
    live = policy.clone().requires_grad_(True)
    pair_figures(live, reference, tokens, flags())["loss"].sum().backward()
    assert live.grad is not None and live.grad[:2].lt(0).all() and live.grad[2:].gt(0).all()


# ----------------------------------------------------------------------------- packed rows, in here
# A packed row and the padded batch give the model the same tokens and weights; only the attention's
# shapes (one row with its sequences' bounds, or left-padded rows under a mask) and so the order of
# some fp32 sums differ. Measured on the tiny model (torch 2.14 and 2.11; sdpa, varlen, eager): the
# answers' summed log-probabilities and the loss equal to the bit, the gradients up to 6e-8 apart
# (the largest 0.34); with a LoRA adapter, the stored reference 9.5e-7 apart and the evaluation's
# figures 2.4e-7. Held to a few ulps of the largest summed log-probability (~40 here: 1 ulp
# is 3.8e-6), and the gradients as the SFT packing tests hold them (1e-6 + 1e-5 relative); the same
# row read as one sequence moves the log-probabilities by 0.05.
LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tokenized_pairs(tiny_chat_model):
    """The tiny chat model's tokenizer and 8 colour pairs tokenised: text pairs and whole
    conversations (some with a system message), answers of a word or a sentence, so the rows differ
    in length."""
    from chat.model import load_tokenizer
    from chat.preference_pairs import read_pairs, tokenize_pairs

    tokenizer = load_tokenizer(str(tiny_chat_model))
    rows = [
        pair if i % 2 else as_conversations(pair, "You answer in one word." if i % 4 == 0 else None)
        for i, pair in enumerate(colour_pairs()[:8])
    ]
    pairs, _ = tokenize_pairs(tokenizer, read_pairs(rows, "pairs.jsonl"), 64, "drop", "train")
    return tokenizer, pairs


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_a_packed_batch_gives_the_padded_batchs_log_probabilities_loss_and_gradients(
    tiny_chat_model, tokenized_pairs, attention
):
    """--packing: a micro-batch's 16 sequences (8 prompts with their chosen, then their rejected
    answer) in one row without a mask, positions restarting at each, filled up to a multiple of 16
    by one more sequence (as under bf16); under sdpa (the CPU's default: a block-diagonal mask built
    from the positions) and varlen (a GPU's default; on the CPU sdpa sequence by sequence, from the
    collator's cumulative lengths). Each answer's summed log-probability and token count, each
    pair's DPO figures (with the SFT term, which divides by the counts), their mean loss and every
    weight's gradient are the padded batch's."""
    from chat import packed_attention
    from chat.packing import check_packing
    from chat.preference_loss import answer_logprobs, pair_figures
    from chat.preference_pairs import pair_collator
    from dpo import FIGURES
    from transformers import AutoModelForCausalLM

    tokenizer, pairs = tokenized_pairs
    packed_attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation=attention)
    check_packing(model)
    padded, packed = pair_collator(tokenizer, False)(pairs), pair_collator(tokenizer, True, 16)(pairs)
    lengths = [len(p["prompt_ids"]) + len(p[f"{name}_ids"]) for name in ("chosen", "rejected") for p in pairs]
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, -(-sum(lengths) // 16) * 16)
    bounds = packed["cu_seq_lens_q"].tolist()
    # filler
    assert bounds[:-1] == [sum(lengths[:i]) for i in range(len(lengths) + 1)] and bounds[-1] > sum(lengths)
    assert torch.equal(packed["answer_mask"], padded["answer_mask"]) and torch.equal(
        packed["index"], padded["index"]
    )
    # a reference policy that likes some answers more than the model does, others less
    with torch.no_grad():
        reference = answer_logprobs(model, padded)[0] + torch.linspace(-1, 1, 2 * len(pairs))

    def step(batch):
        model.zero_grad(set_to_none=True)
        policy, tokens = answer_logprobs(model, batch)
        figures = pair_figures(policy, reference, tokens, flags(sft_weight=0.5))
        figures["loss"].mean().backward()
        gradients = {name: p.grad for name, p in model.named_parameters()}
        return policy.detach(), tokens, {k: v.detach() for k, v in figures.items()}, gradients

    policy, tokens, figures, gradients = step(packed)
    padded_policy, padded_tokens, padded_figures, padded_gradients = step(padded)
    torch.testing.assert_close(policy, padded_policy, atol=LOGPROB_TOLERANCE, rtol=0)
    counts = [len(p[f"{name}_ids"]) for name in ("chosen", "rejected") for p in pairs]
    assert torch.equal(tokens, padded_tokens) and tokens.tolist() == counts
    for name in FIGURES:
        torch.testing.assert_close(
            figures[name], padded_figures[name], atol=LOGPROB_TOLERANCE, rtol=0, msg=name
        )
    assert padded_figures["reward_margin"].abs().min() > 1e-3  # the loss is not at a flat point
    assert gradients.keys() == padded_gradients.keys() and all(g is not None for g in gradients.values())
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, padded_gradients[name], atol=1e-6, rtol=1e-5, msg=name)
    # the positions and bounds decide: the same row read as
    # one sequence lets later answers see earlier sequences
    length = packed["input_ids"].shape[1]
    bounds = torch.tensor([0, length], dtype=torch.int32)
    row = dict(packed, position_ids=torch.arange(length)[None], cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
    row.update(max_length_q=length, max_length_k=length)
    with torch.no_grad():
        assert (answer_logprobs(model, row)[0] - padded_policy).abs().max() > 1e-2


def test_compiled_blocks_give_the_eager_policy_and_reference_and_compile_once(
    tiny_chat_model, tokenized_pairs, tmp_path, monkeypatch
):
    """--packing --compile with a LoRA adapter, as dpo.py trains on a GPU: the decoder blocks
    compiled (aot_eager: torch.compile's capture without code generation), packed rows through
    `varlen` on the GPU's path (torch's variable-length kernel, a stand-in of the same op boundary
    here: tests/varlen_stand_in.py), each micro-batch's reference pass (the adapter off, no
    gradients) beside the policy's. Against the same model eager, four micro-batches give the same
    reference and policy log-probabilities (LOGPROB_TOLERANCE) and LoRA gradients (1e-6 + 1e-5
    relative): the same fp32 operations (measured: equal to the bit). On a model of 4 blocks the
    first micro-batch compiles at most 3 graphs (torch 2.14 and 2.11: the reference pass; the
    policy's first block, whose input carries no gradient; its other blocks) and the next ones none:
    a graph per block, or per micro-batch (a new longest sequence in each row, which the kernel
    takes as an integer: chat/packing.py's one_bound), would fail here, and torch falls back to
    eager after 8."""
    from accelerate import Accelerator
    from chat import packed_attention
    from chat.model import BASE, COMPILE_ROW_MULTIPLE, build_model, use_kernels
    from chat.preference_loss import answer_logprobs, pair_figures
    from chat.preference_pairs import pair_collator
    from dpo import DpoFlags, reference_logprobs
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM
    from varlen_stand_in import use_stand_in

    tokenizer, pairs = tokenized_pairs
    torch.manual_seed(0)
    deeper = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(tiny_chat_model, num_hidden_layers=4)
    )
    deeper.save_pretrained(tmp_path / "model")
    accelerator = Accelerator(cpu=True)
    packed_attention.register()
    # the pairs' --max_length
    collate = pair_collator(tokenizer, True, COMPILE_ROW_MULTIPLE, longest=64)
    batches = [collate(pairs[start : start + 2]) for start in range(0, 8, 2)]
    assert {b["input_ids"].shape[1] for b in batches} == {COMPILE_ROW_MULTIPLE}
    longest = [max(b["cu_seq_lens_q"].diff()[:-1].tolist()) for b in batches]  # the filler left out
    assert len(set(longest)) > 1 and {b["max_length_q"] for b in batches} == {COMPILE_ROW_MULTIPLE}

    graphs = []  # compiled: after the first micro-batch, after the last

    def micro_batches(compiled: bool) -> list:
        args = DpoFlags(lora_r=4, compile=compiled, compile_backend="aot_eager", attn_implementation="varlen")
        torch.manual_seed(0)  # the same adapter twice
        model = build_model(args, str(tmp_path / "model"), accelerator)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                # a trained adapter: peft starts B at zero, which leaves A without gradients
                if "lora_B" in name:
                    weight.normal_(0, 0.05)
        use_kernels(model, args, accelerator.device)
        results = []
        for index, batch in enumerate(batches):
            reference = reference_logprobs(accelerator, model, BASE, batch, None)
            model.zero_grad(set_to_none=True)
            policy, tokens = answer_logprobs(model, batch)
            pair_figures(policy, reference, tokens, flags(beta=0.5))["loss"].mean().backward()
            gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
            results.append((reference, policy.detach(), gradients))
            if compiled and index in (0, len(batches) - 1):
                graphs.append(counters["stats"]["unique_graphs"])
        assert len(model.get_decoder().layers) == 4
        return results

    torch._dynamo.reset()  # the blocks' code is shared with other tests' models: counted from none
    counters.clear()
    try:
        with use_stand_in(monkeypatch):
            eager, compiled = micro_batches(False), micro_batches(True)
    finally:
        torch._dynamo.reset()
    assert 1 <= graphs[0] <= 3 and graphs[1] == graphs[0], graphs
    for (reference, policy, gradients), expected in zip(compiled, eager):
        torch.testing.assert_close(reference, expected[0], atol=LOGPROB_TOLERANCE, rtol=0)
        torch.testing.assert_close(policy, expected[1], atol=LOGPROB_TOLERANCE, rtol=0)
        # the adapter moves the policy off its reference
        assert (policy - reference).abs().max() > 1e-3
        # every LoRA matrix
        assert gradients.keys() == expected[2].keys() and len(gradients) == 4 * 7 * 2
        for name, gradient in gradients.items():
            torch.testing.assert_close(gradient, expected[2][name], atol=1e-6, rtol=1e-5, msg=name)


def test_packed_rows_give_the_stored_reference_and_the_evaluation_of_padded_rows(
    tiny_chat_model, tokenized_pairs
):
    """--precompute_ref's stored log-probabilities of every pair and the evaluation against the live
    reference (a LoRA adapter's base, the adapter switched off), in batches of 3 pairs (the last of
    2), packed and padded: the same within LOGPROB_TOLERANCE."""
    import peft
    from accelerate import Accelerator
    from chat.model import BASE
    from chat.packing import check_packing
    from chat.preference_loss import StoredReference
    from chat.preference_pairs import pair_collator
    from dpo import evaluate
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    tokenizer, pairs = tokenized_pairs
    accelerator = Accelerator(cpu=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    check_packing(base)
    # an adapter that moves the model (init_lora_weights=False: B is not 0), so margins are not 0
    torch.manual_seed(0)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    )
    splits = {"train": pairs, "validation": pairs[:5]}
    stored, evaluation = {}, {}
    for packing in (False, True):
        collate = pair_collator(tokenizer, packing)
        stored[packing] = StoredReference()
        stored[packing].compute(accelerator, model, splits, collate, 3)
        evaluation[packing] = evaluate(
            accelerator, model, BASE, DataLoader(pairs, 3, collate_fn=collate), flags(), None
        )
    for split in splits:
        assert stored[True].values[split].shape == (len(splits[split]), 2)
        torch.testing.assert_close(
            stored[True].values[split], stored[False].values[split], atol=LOGPROB_TOLERANCE, rtol=0
        )
    assert evaluation[True].keys() == evaluation[False].keys() and evaluation[True]["eval_samples"] == len(
        pairs
    )
    for key, value in evaluation[False].items():
        assert evaluation[True][key] == pytest.approx(value, abs=LOGPROB_TOLERANCE), key
    # the adapter moved the model from its base
    assert abs(evaluation[False]["eval_reward_margin"]) > 5e-3


def test_flags_that_cannot_work_are_one_line():
    from chat.dpo_setup import check_flags

    for given, fragment in (
        (dict(loss_type="kto"), "unknown --loss_type 'kto'; choose one of sigmoid, ipo, hinge"),
        (dict(label_smoothing=0.2, loss_type="ipo"), "--label_smoothing applies to --loss_type sigmoid only"),
        (dict(label_smoothing=0.5), "--label_smoothing < 0.5"),
        (dict(too_long="wrap"), "unknown --too_long 'wrap'; choose one of drop, truncate"),
    ):
        with pytest.raises(RecipeError, match=fragment.replace("(", r"\(")):
            check_flags(flags(**given))


# --------------------------------------------------------------------------- pairs, in here and out
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_bad_pairs_are_one_line_naming_the_row_and_the_fix(tiny_chat_model, tmp_path):
    from chat.preference_pairs import load_pairs, read_pairs, tokenize_pairs
    from transformers import AutoTokenizer

    good = {"prompt": "What colour is the sky?", "chosen": "blue", "rejected": "green"}

    def refused(row, *fragments):
        with pytest.raises(RecipeError) as caught:
            read_pairs([good, row], "pairs.jsonl")
        message = str(caught.value)
        assert "\n" not in message and message.startswith("pairs.jsonl row 2: "), message
        for fragment in fragments:
            assert fragment in message, message

    refused(dict(good, rejected=""), "the rejected answer is empty", "give each pair two answers")
    refused(dict(good, chosen=[{"role": "assistant", "content": "  "}]), "the chosen answer is empty")
    refused(dict(good, rejected="blue"), "the chosen and rejected answers are the same")
    refused({"prompt": "Hi?", "chosen": "a"}, "no 'rejected' column", "needs 'chosen' and 'rejected'")
    refused(
        {"chosen": "blue", "rejected": "green"},
        "the prompt must end with a user turn",
        "give a 'prompt' column",
    )
    refused(dict(good, chosen=[{"role": "user", "content": "blue"}]), "not the assistant's")
    # whole conversations: the turns they share are the prompt
    user = {"role": "user", "content": "Sky?"}
    pair = read_pairs(
        [
            {
                "chosen": [user, {"role": "assistant", "content": "blue"}],
                "rejected": [user, {"role": "assistant", "content": "red"}],
            }
        ],
        "x",
    )[0]
    assert pair["prompt"] == [user] and pair["chosen"][0]["content"] == "blue"

    # A template that refuses a conversation's shape (as Mistral's and Gemma's do two user turns in
    # a row): the error names the row of the file the pair came from, also when the validation pairs
    # were drawn from the same file.
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- "
        "endif %}{%- endfor %}" + tokenizer.chat_template
    )
    rows = [dict(good, prompt=[{"role": "user", "content": f"What colour is thing {i}?"}]) for i in range(10)]
    rows[6]["prompt"] = [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Sky?"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    train, validation = load_pairs(path, None, None, str(tmp_path / "cache"), 0.3, 0)
    (split, pairs), number = next(
        ((split, pairs), number)
        for split, pairs in (("train", train), ("validation", validation))
        for number, pair in enumerate(pairs, 1)
        if len(pair["prompt"]) == 2
    )
    # the held-out draw moved it: its number in the split is not its row in the file
    assert number != 7
    with pytest.raises(RecipeError) as caught:
        tokenize_pairs(tokenizer, pairs, 64, "drop", split)
    message = str(caught.value)
    assert message.startswith(f"{path} row 7 ('Sky?'): the chat template cannot render it"), message
    assert "Conversation roles must alternate" in message and message.endswith("fix the row")


def test_over_long_pairs_are_dropped_or_cut_and_counted(tiny_chat_model):
    from chat.preference_pairs import PairCollator, read_pairs, tokenize_pairs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    tokenizer.pad_token = tokenizer.eos_token
    short_pair = {"prompt": "What colour is the sky?", "chosen": "blue", "rejected": "green"}
    long_answer = " ".join(["the sky is blue"] * 20)
    pairs = read_pairs(
        [
            short_pair,
            dict(short_pair, chosen=long_answer, rejected="green"),  # too long by its chosen answer
            # differ past any cut
            dict(short_pair, chosen=long_answer + " yes", rejected=long_answer + " no"),
        ],
        "pairs.jsonl",
    )
    rows, _ = tokenize_pairs(tokenizer, pairs[:1], 1024, "drop", "train")
    prompt_length, limit = len(rows[0]["prompt_ids"]), len(rows[0]["prompt_ids"]) + 8
    kept, counts = tokenize_pairs(tokenizer, pairs, limit, "drop", "train")
    assert counts == {"pairs": 3, "dropped": 2, "truncated": 0} and [r["index"] for r in kept] == [0]
    cut, counts = tokenize_pairs(tokenizer, pairs, limit, "truncate", "train")
    # the second pair cut to fit; the third dropped: cut
    # to the same 8 tokens, it would teach nothing
    assert counts == {"pairs": 3, "dropped": 1, "truncated": 1} and [r["index"] for r in cut] == [0, 1]
    assert (
        len(cut[1]["chosen_ids"]) == limit - prompt_length
        and cut[1]["rejected_ids"] == kept[0]["rejected_ids"]
    )
    batch = PairCollator(tokenizer.pad_token_id)(cut)
    assert batch["input_ids"].shape[1] <= limit and batch["answer_mask"].sum(1).tolist() == [
        len(cut[0]["chosen_ids"]),
        8,
        len(cut[0]["rejected_ids"]),
        len(cut[1]["rejected_ids"]),
    ]
    with pytest.raises(
        RecipeError, match="no pair fits in --max_length 4; raise it or use --too_long truncate"
    ):
        tokenize_pairs(tokenizer, pairs, 4, "truncate", "train")


@pytest.mark.parametrize("behaviour", NONFINITE)
def test_nan_gradients_of_fully_masked_attention_rows_stop_the_run_at_the_first_such_step_or_are_skipped(
    behaviour, dpo_data, tmp_path
):
    # What cuDNN's sdpa backward has been reported to do on Hopper with an explicit mask
    # (tests/nan_attention.py): NaN query gradients in the rows the mask leaves empty (a left-padded
    # row's padding), the loss finite. A recipe never sends such masks to that kernel on CUDA;
    # should another kernel do the same, the run stops at the first step whose batch had such a row,
    # naming it, or with --skip_nonfinite_steps drops exactly those steps' updates.
    steps_file = tmp_path / "steps.txt"
    flags = ["--attn_implementation", "nan_masked_rows", "--max_steps", "3", "--eval_generate", "0"]
    flags += SKIP_NONFINITE[behaviour]
    proc, out = dpo(
        dpo_data, f"nan-rows-{behaviour}", *flags, launcher=[PYTHON, NAN_ATTENTION, steps_file], ok=False
    )
    bad_steps = steps_with_masked_rows(steps_file)
    assert bad_steps, proc.output[-3000:]  # the pairs differ in length, so batches are left-padded
    assert_nonfinite_gradients_handled(behaviour, proc, out, bad_steps)
    if behaviour == "skip":
        results = read_results(out)
        # on a CPU
        assert (results["attn_implementation"], results["sdpa_backends_off"]) == ("nan_masked_rows", [])


def test_on_cuda_the_chat_recipes_keep_sdpa_off_cudnn_and_leave_the_other_kernels_alone():
    from chat.model import sdpa_backends_off, use_sdpa_backends
    from torch.nn.attention import SDPBackend

    assert sdpa_backends_off(torch.device("cuda", 1)) == [SDPBackend.CUDNN_ATTENTION]
    assert sdpa_backends_off("cpu") == [] and sdpa_backends_off(torch.device("meta")) == []
    switches = {
        SDPBackend.FLASH_ATTENTION: (
            torch.backends.cuda.flash_sdp_enabled,
            torch.backends.cuda.enable_flash_sdp,
        ),
        SDPBackend.EFFICIENT_ATTENTION: (
            torch.backends.cuda.mem_efficient_sdp_enabled,
            torch.backends.cuda.enable_mem_efficient_sdp,
        ),
        SDPBackend.CUDNN_ATTENTION: (
            torch.backends.cuda.cudnn_sdp_enabled,
            torch.backends.cuda.enable_cudnn_sdp,
        ),
        SDPBackend.MATH: (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    }
    before = {backend: enabled() for backend, (enabled, _) in switches.items()}
    try:
        torch.backends.cuda.enable_math_sdp(False)  # a kernel the user turned off stays off
        use_sdpa_backends("cpu")
        assert {b: enabled() for b, (enabled, _) in switches.items()} == before | {SDPBackend.MATH: False}
        # the switches are torch's, process-wide: set without a GPU too
        use_sdpa_backends(torch.device("cuda"))
        after = {b: enabled() for b, (enabled, _) in switches.items()}
        assert after == before | {SDPBackend.MATH: False, SDPBackend.CUDNN_ATTENTION: False}
    finally:
        for backend, (_, enable) in switches.items():
            enable(before[backend])
