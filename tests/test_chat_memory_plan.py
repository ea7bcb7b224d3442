"""The chat recipes' memory plan (chat/memory_plan.py): its arithmetic against hand-computed bytes
for Qwen2.5-0.5B, the line naming the change that makes a run fit, --plan_only on a config alone,
and the plan against the peak memory measured in training runs on 1 and 2 CPU processes.
"""

import json
import shutil

import peft
import pytest
import torch
from chat.memory_plan import Launch, ModelSize, advice, fits, largest_token_budget, launch_of, parts
from chat_assets import QWEN25_05B
from chat_fixtures import COLOURS, write_chat_file
from conftest import (
    ACCELERATE,
    CONFIGS,
    PYTHON,
    SFT_SCRIPT,
    check,
    free_port,
    read_results,
    recipe_env,
    run,
)
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

MB = 2**20
# Qwen2.5-7B's shape, from the model's config.json on the
# Hugging Face Hub (0.5B's is chat_assets.QWEN25_05B).
QWEN_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
PARAMS_05B = 494_032_768
# One Qwen2.5-0.5B block: q (with bias), k and v (with biases, 128 = 2 KV heads x 64), o, gate, up,
# down, two norms.
BLOCK_05B = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896


def meta_qwen(lora_r: int = 0):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**QWEN25_05B), dtype=torch.bfloat16 if lora_r else None
        )
    if lora_r:
        model = peft.get_peft_model(
            model, peft.LoraConfig(task_type="CAUSAL_LM", r=lora_r, target_modules="all-linear")
        )
    return model


def launch(**changes) -> Launch:
    settings = dict(
        strategy="ddp",
        processes=1,
        micro_batch=4,
        accumulation=1,
        max_length=1024,
        checkpointing=False,
        compute_bytes=2,
        lora_r=0,
        device_mb=24 * 1024,
    )
    return Launch(**{**settings, **changes})


def test_the_plan_of_qwen25_05b_matches_the_bytes_counted_by_hand():
    size = ModelSize.of(meta_qwen())
    assert size.parameters == size.trainable == PARAMS_05B
    assert size.block_bytes == 4 * BLOCK_05B
    tokens = 4 * 1024
    block = tokens * 2 * (4 * 896 + 2 * 896 + 2 * 128 + 4 * 4864)  # bf16 compute
    plan = parts(size, launch())
    expected = dict(
        weights=4 * PARAMS_05B,
        gradients=4 * PARAMS_05B,
        optimizer=8 * PARAMS_05B,
        activations=24 * block,
        # the loss: the picked hidden states and their gradient, one chunk of 2**26 // 151936 = 441
        # positions' logits in bf16, their fp32 copy (softmax and gradient made in it) and the
        # gradient cast back to bf16, and the tied output layer's fp32 gradient, made in the forward
        # pass, with its weight's bf16 copy
        logits=2 * tokens * 896 * 2 + 441 * 151936 * (2 + 4 + 2) + 151936 * 896 * (4 + 2),
    )
    assert plan == pytest.approx(
        {**{k: v / MB for k, v in expected.items()}, "total": sum(expected.values()) / MB}
    )
    # ZeRO-3 makes each chunk again in the backward pass
    # (its output layer exists only inside its own call)
    zero3 = parts(size, launch(strategy="zero3", processes=8))["logits"]
    assert zero3 == pytest.approx((2 * tokens * 896 * 2 + 441 * 151936 * (2 + 4 + 4 + 4 + 2)) / MB)

    # FSDP over 8: a shard of everything, plus one block
    # gathered; checkpointing keeps the blocks' fp32 inputs.
    plan = parts(size, launch(strategy="fsdp", processes=8, checkpointing=True))
    assert plan["weights"] == pytest.approx((4 * PARAMS_05B / 8 + 4 * BLOCK_05B) / MB)
    assert plan["gradients"] == pytest.approx(4 * PARAMS_05B / 8 / MB)
    assert plan["optimizer"] == pytest.approx(8 * PARAMS_05B / 8 / MB)
    assert plan["activations"] == pytest.approx((24 * tokens * 896 * 4 + block) / MB)
    # ZeRO-2 keeps the weights whole; DDP on 2 processes
    # a second copy of the gradients (its buckets).
    assert parts(size, launch(strategy="zero2", processes=8))["weights"] == pytest.approx(4 * PARAMS_05B / MB)
    assert parts(size, launch(processes=2))["gradients"] == pytest.approx(8 * PARAMS_05B / MB)

    # LoRA r16 on every linear layer: peft's count on the
    # meta model, and the plan's own estimate, agree.
    lora = ModelSize.of(meta_qwen(16))
    assert (lora.trainable, lora.frozen_bytes, lora.trainable_bytes) == (8_798_208, 2 * PARAMS_05B, 4)
    assert size.as_lora(16, 2).trainable == lora.trainable
    plan = parts(lora, launch())
    assert plan["weights"] == pytest.approx((2 * PARAMS_05B + 4 * 8_798_208) / MB)
    # a frozen head
    assert plan["logits"] == pytest.approx((2 * tokens * 896 * 2 + 441 * 151936 * (2 + 4 + 2)) / MB)
    assert plan["optimizer"] == pytest.approx(8 * 8_798_208 / MB)


def test_model_flops_per_token_of_qwen25_05b_counted_by_hand():
    """PaLM's count (6 per matrix-multiply weight in full, 4 under LoRA, + 12 x layers x hidden x
    length) with the tied output head counted for the answer tokens only (half of them here), the
    only ones the loss makes logits for."""
    from sft import model_flops_per_token

    # 200 tokens on average, half of them answers
    conversations = {"num_tokens": [100, 300], "num_targets": [50, 150]}
    # q, o; k, v; gate, up, down (biases not)
    block_matmuls = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    head = 151936 * 896
    attention = 12 * 24 * 896 * 200
    assert (
        model_flops_per_token(meta_qwen(), conversations) == 6 * (24 * block_matmuls + head / 2) + attention
    )
    assert (
        model_flops_per_token(meta_qwen(16), conversations) == 4 * (24 * block_matmuls + head / 2) + attention
    )


def test_a_plan_that_does_not_fit_names_the_first_change_that_fits():
    size = ModelSize.of(meta_qwen())
    # 16 x 1024 tokens in one micro-batch: the blocks' activations
    # (18.4 GB) do not fit in 24 GB; checkpointing does.
    too_big = launch(micro_batch=16)
    assert parts(size, too_big)["total"] > 24 * 1024
    fitting = parts(size, launch(micro_batch=16, checkpointing=True))["total"]
    assert advice(size, too_big) == f"would fit with --gradient_checkpointing: {fitting:,.0f} MB per process"
    # Checkpointing already on, and 11.5 GB: half the micro-batch, twice the accumulation.
    line = advice(size, launch(micro_batch=16, checkpointing=True, device_mb=11_500))
    fitting = parts(size, launch(micro_batch=8, checkpointing=True))["total"]
    assert (
        line
        == f"would fit with --gradient_accumulation_steps 2 (micro-batch 8): {fitting:,.0f} MB per process"
    )
    # The full fine-tune's 7.5 GB of weights, gradients and states: LoRA on 6 GB, LoRA and
    # checkpointing on 3 GB.
    assert advice(size, launch(micro_batch=1, device_mb=6 * 1024)).startswith("would fit with --lora_r 16:")
    line = advice(size, launch(micro_batch=1, device_mb=3 * 1024))
    assert line.startswith("would fit with --lora_r 16 and --gradient_checkpointing:")
    # FSDP over the processes there are, with LoRA and
    # checkpointing, before asking for more processes.
    line = advice(size, launch(micro_batch=1, processes=4, device_mb=1536))
    assert line.startswith(
        "would fit with FSDP (full shard) on these 4 processes and --lora_r 16 and --gradient_c"
    )
    assert advice(size, launch(device_mb=64)).startswith("no change tried fits")


def test_hybrid_sharding_divides_by_the_shard_group_not_by_every_process():
    """2 nodes x 2 processes under HSDP keep what FSDP over one node's 2 keeps: twice FSDP over
    all 4."""
    size = ModelSize.of(meta_qwen())
    hybrid = parts(size, launch(strategy="fsdp", processes=4, shard_processes=2))
    one_node = parts(size, launch(strategy="fsdp", processes=2))
    every = parts(size, launch(strategy="fsdp", processes=4))
    sharded = ("weights", "gradients", "optimizer")
    assert [hybrid[k] for k in sharded] == [one_node[k] for k in sharded]
    assert hybrid["optimizer"] == pytest.approx(2 * every["optimizer"])
    assert launch(strategy="fsdp", processes=4, shard_processes=2).layout() == (
        "fsdp on 4 process(es), sharded in groups of 2"
    )


def test_the_largest_token_budget_is_the_last_that_fits():
    """--plan_only's line for --batch_tokens: a micro-batch of one packed row of that many tokens
    fits, 256 more do not; gradient checkpointing, which keeps less per token, lets the row grow."""
    size = ModelSize.of(meta_qwen())
    budgets = []
    for checkpointing in (False, True):
        on_80gb = launch(device_mb=80 * 1024, checkpointing=checkpointing)
        budget = largest_token_budget(size, on_80gb)
        assert budget % 256 == 0 and budget > 0

        def row(tokens):
            changed = launch(
                device_mb=80 * 1024, checkpointing=checkpointing, micro_batch=1, max_length=tokens
            )
            return fits(parts(size, changed)["total"], changed)

        assert row(budget) and not row(budget + 256)
        budgets.append(budget)
    assert budgets[1] > 2 * budgets[0]
    assert largest_token_budget(size, launch(device_mb=1024)) == 0  # the weights alone do not fit


def test_plan_only_plans_7b_from_its_config_alone(tmp_path):
    """Only config.json in the model folder: --plan_only builds the model on the meta device, prints
    the plan and the change that fits, exits 0 and writes nothing."""
    model = tmp_path / "qwen2.5-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN_7B}))
    out = tmp_path / "out"
    flags = ["--plan_only", "--model", model, "--output_dir", out, "--mixed_precision", "bf16"]
    proc = check(
        run(
            [
                PYTHON,
                SFT_SCRIPT,
                *flags,
                "--plan_devices",
                "8",
                "--plan_device_gb",
                "24",
                "--plan_sharding",
                "fsdp",
            ],
            recipe_env(tmp_path),
        )
    )
    assert "full fine-tune, fsdp on 8 process(es), micro-batch 2 x 1024 tokens" in proc.stdout
    assert "7,615,616,512 (7,615,616,512 trainable)" in proc.stdout  # Qwen2.5-7B's published 7.61B
    assert "does NOT fit" in proc.stdout and "would fit with --gradient_checkpointing:" in proc.stdout
    assert not out.exists()
    # Rows of a token budget: one row of 8192 tokens per
    # micro-batch, and the largest row that would fit.
    budget = [
        "--packing",
        "--batch_tokens",
        "8192",
        "--plan_device_gb",
        "80",
        "--plan_devices",
        "8",
        "--plan_sharding",
        "fsdp",
    ]
    proc = check(run([PYTHON, SFT_SCRIPT, *flags, *budget], recipe_env(tmp_path)))
    assert "micro-batch 1 x 8192 tokens" in proc.stdout
    assert "tokens fits: --packing --batch_tokens" in proc.stdout
    # Flags that cannot plan: refused in one line, here in process (the CLI's one `error:` line for
    # a RecipeError is the same for every recipe: test_cli.py).
    import sft
    from accelerate import Accelerator

    from accelerate_recipes import RecipeError

    def refused(*fragments, **given) -> None:
        with pytest.raises(RecipeError) as caught:
            sft.main(sft.SftFlags(plan_only=True, model=str(model), **given))
        assert "\n" not in str(caught.value) and all(f in str(caught.value) for f in fragments), caught.value

    refused("add --packing", batch_tokens=8192)
    refused("--plan_only", chat=True)
    accelerator = Accelerator(cpu=True)
    with pytest.raises(RecipeError, match="unknown --plan_sharding 'zero4'; choose one of ddp"):
        launch_of(accelerator, sft.SftFlags(plan_sharding="zero4"), per_process=2)


# -------------------------------------------------------------------------------------- GRPO's plan
PLAN_PARTS = ["weights", "gradients", "optimizer", "reference", "decode_copy", "kv_cache"]
PLAN_PARTS += ["activations", "logits"]


def test_grpos_plan_of_qwen25_05b_adds_the_decode_copy_and_its_static_kv_cache(monkeypatch):
    """GRPO's plan (rollout_plan) on the meta device, a full fine-tune in fp32 decoding with
    --decode static: 8 prompts x 8 completions per process, prompts up to 500 tokens, 256 new.
    Training's parts for 64 completions of 756 tokens, the decode copy (every weight again in the
    compute dtype) and one static KV cache of 64 rows x (512 + 256) positions, counted by hand.
    Where the cache alone makes the plan too big, one line says so."""
    from accelerate import Accelerator
    from chat import memory_plan
    from chat.memory_plan import HEADROOM, rollout_plan
    from grpo import GrpoFlags

    accelerator = Accelerator(cpu=True)
    args = GrpoFlags(decode="static", num_generations=8, max_new_tokens=256)
    plan = rollout_plan(accelerator, args, meta_qwen(), None, rows=64, longest_prompt=500)
    assert plan.cache == (64, 512 + 256) and list(plan.mb) == [*PLAN_PARTS, "total"]
    # keys and values x layers x KV heads x head size x rows x positions x fp32
    kv = 2 * 24 * 2 * 64 * 64 * 768 * 4
    training = parts(ModelSize.of(meta_qwen()), launch(micro_batch=64, max_length=756, compute_bytes=4))
    expected = {name: training[name] for name in ("weights", "gradients", "optimizer")}
    expected.update(reference=0.0, decode_copy=4 * PARAMS_05B / MB, kv_cache=kv / MB)
    expected.update(activations=training["activations"], logits=training["logits"])
    assert {k: v for k, v in plan.mb.items() if k != "total"} == pytest.approx(expected)
    assert plan.mb["total"] == pytest.approx(sum(expected.values()))
    # --update_rows: the update's passes hold fewer completions; the cache still holds a call's
    # every row
    passes = GrpoFlags(decode="static", update_rows=16)
    smaller = rollout_plan(accelerator, passes, meta_qwen(), None, rows=64, longest_prompt=500)
    assert smaller.launch.micro_batch == 16 and smaller.cache == plan.cache
    assert smaller.mb["activations"] == pytest.approx(training["activations"] / 4)
    eager = rollout_plan(accelerator, GrpoFlags(decode="eager"), meta_qwen(), None, 64, longest_prompt=500)
    assert eager.mb["kv_cache"] == eager.mb["decode_copy"] == 0

    total = plan.mb["total"]
    monkeypatch.setattr(memory_plan, "device_memory", lambda _: ((total - kv / MB / 2) / HEADROOM, "assumed"))
    table = rollout_plan(accelerator, args, meta_qwen(), None, rows=64, longest_prompt=500).table()
    assert "does NOT fit" in table and "it would fit without the static KV cache (" in table
    assert len([line for line in table.splitlines() if "KV cache (" in line]) == 1


def test_grpos_plan_counts_the_cache_and_the_copy_the_run_reserves(tiny_chat_model, tmp_path, capsys):
    """On the tiny chat model with --decode static, as grpo.py runs it: the plan is printed before
    training, and the bytes of its decode copy and KV cache are those of the FastDecoder's weights
    and of the StaticCache's tensors that generation.reserve_cache then makes; prompts of two length
    buckets decode in that cache, and no other is made. The reference's bytes: a full fine-tune's
    frozen copy, and the frozen copy of an adapter given in --model (kept apart from the
    weights)."""
    from accelerate import Accelerator
    from chat import generation
    from chat.memory_plan import print_rollout_plan, rollout_plan
    from chat.model import build_model, load_tokenizer, reference_policy
    from chat.rollouts import generate
    from grpo import GrpoFlags
    from test_grpo_parts import chat_prompts

    accelerator = Accelerator(cpu=True)
    args = GrpoFlags(lora_r=4, decode="static", num_generations=2, max_new_tokens=6)
    tokenizer = load_tokenizer(str(tiny_chat_model))
    prompts = [p for p in chat_prompts(tokenizer, ["sky", "sky " * 30, "ripe plum " * 20]) for _ in range(2)]
    longest = max(map(len, prompts))
    assert 64 < longest <= 128 and min(map(len, prompts)) <= 64
    model = build_model(args, str(tiny_chat_model), accelerator)
    plan = print_rollout_plan(accelerator, args, model, None, len(prompts), longest)
    printed = capsys.readouterr().out
    assert f"update passes of 6 completions x {longest + 6} tokens" in printed
    assert "decode static: one static KV cache of 8 rows x 134 positions for every generation" in printed
    assert "  kv_cache " in printed and "  decode_copy " in printed and ": fits" in printed
    decoder = generation.reserve_cache(accelerator, model, *plan.cache, args.decode)
    assert decoder.cache_bytes() == plan.mb["kv_cache"] * MB == 2 * 2 * 2 * 8 * 8 * 134 * 4
    copy_bytes = sum(p.numel() * p.element_size() for p in decoder.model.parameters())
    assert copy_bytes == plan.mb["decode_copy"] * MB
    generate(accelerator, model, tokenizer, prompts[:2], args)  # width bucket 64
    generate(accelerator, model, tokenizer, prompts, args)  # width bucket 128
    assert list(decoder.caches) == [plan.cache] and decoder.cache_bytes() == plan.mb["kv_cache"] * MB
    args.decode = "eager"
    eager = rollout_plan(accelerator, args, model, None, len(prompts), longest)
    assert eager.mb["kv_cache"] == eager.mb["decode_copy"] == 0
    assert generation.reserve_cache(accelerator, model, *eager.cache, args.decode) is None

    # references: a full fine-tune's frozen copy; an
    # adapter given in --model gets a frozen copy of itself
    full = GrpoFlags(beta=0.1, decode="eager")
    model = build_model(full, str(tiny_chat_model), accelerator)
    frozen_copy = reference_policy(full, accelerator, model, str(tiny_chat_model))
    weights = 4 * sum(p.numel() for p in model.parameters())
    assert rollout_plan(accelerator, full, model, frozen_copy, 6, longest).mb["reference"] * MB == weights
    adapter = tmp_path / "adapter"
    build_model(args, str(tiny_chat_model), accelerator).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    args.beta = 0.1
    model = build_model(args, str(adapter), accelerator)
    alone = rollout_plan(accelerator, args, model, None, 6, longest)
    frozen_adapter = reference_policy(args, accelerator, model, str(adapter))
    beside = rollout_plan(accelerator, args, model, frozen_adapter, 6, longest)
    assert beside.mb["reference"] * MB == 4 * alone.size.trainable > 0
    assert beside.mb["weights"] == alone.mb["weights"] and beside.size.parameters == alone.size.parameters


def test_the_grpo_run_records_its_plan(grpo_one):
    """grpo.py's plan in results.json (the shared 1-process run, which decodes eagerly on the CPU):
    every part and their total; no decode copy nor static cache, no reference (--beta 0)."""
    results = read_results(grpo_one)
    plan = results["memory_plan_mb"]
    assert list(plan) == [*PLAN_PARTS, "total"] and results["decode_mode"] == "eager"
    assert plan["total"] == pytest.approx(sum(v for k, v in plan.items() if k != "total"))
    assert plan["decode_copy"] == plan["kv_cache"] == plan["reference"] == 0 and plan["weights"] > 0


# ----------------------------------------------------------------------- plan against measured peak
@pytest.fixture(scope="module")
def plan_runs(tiny_chat_model, module_tmp):
    """The tiny chat model and a larger one with its tokenizer (hidden 512, 4 blocks: 15M
    parameters), and conversations whose answers run past --max_length 128, so every row is as long
    as the plan assumes."""
    root = module_tmp.mktemp("plan")
    larger = root / "larger"
    shutil.copytree(tiny_chat_model, larger)
    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update(
        dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8, head_dim=64)
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(larger)
    words = sorted(COLOURS)
    long = [
        [
            {"role": "user", "content": "colours"},
            {"role": "assistant", "content": " ".join(words[i:] + words * 12)},
        ]
        for i in range(40)
    ]
    files = ["--train_file", write_chat_file(root / "train.jsonl", long[:32], "messages")]
    files += ["--validation_file", write_chat_file(root / "validation.jsonl", long[32:], "messages")]
    flags = [
        "--max_length",
        "128",
        "--max_steps",
        "2",
        "--epochs",
        "1",
        "--tracker",
        "none",
        "--checkpoint_every",
        "0",
    ]
    flags += ["--num_workers", "0", "--mixed_precision", "no", *files]
    return dict(models={"tiny": tiny_chat_model, "larger": larger}, flags=flags, root=root)


def trained(plan_runs, name: str, processes: int) -> dict:
    """8 conversations of 128 tokens per process: 1 process in full, or 2 DDP processes with
    checkpointing."""
    out = plan_runs["root"] / f"{name}-{processes}"
    flags = [*plan_runs["flags"], "--model", plan_runs["models"][name], "--output_dir", out]
    if processes == 1:
        cmd = [PYTHON, SFT_SCRIPT, *flags, "--batch_size", "8"]
    else:
        cmd = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", 2]
        cmd += ["--main_process_port", free_port(), "--num_cpu_threads_per_process", 1, SFT_SCRIPT, *flags]
        cmd += ["--batch_size", "16", "--gradient_checkpointing"]
    check(run(cmd, recipe_env(out.parent, ACCELERATE_USE_CPU="true")))
    results = read_results(out)
    plan = results["memory_plan_mb"]
    assert plan["total"] == pytest.approx(sum(v for k, v in plan.items() if k != "total"))
    assert results["peak_memory_kind"] == "host_max_rss"
    return results


@pytest.fixture(scope="module")
def runtime_mb(plan_runs) -> float:
    """The peak RSS of the tiny model's run less its plan (8 MB): the Python / torch runtime, about
    900 MB. Measured on 1 and 2 processes it agreed within 1 MB, so one run serves both."""
    tiny = trained(plan_runs, "tiny", 1)
    return tiny["peak_memory_mb"] - tiny["memory_plan_mb"]["total"]


@pytest.mark.parametrize("processes", [1, 2])
def test_the_plan_accounts_for_the_memory_training_adds(plan_runs, runtime_mb, processes):
    """On the CPU the measured peak is the process's max RSS, most of it the runtime, so the plan
    (~420 MB on 1 process in full, ~350 MB on each of 2 DDP processes with checkpointing) is
    compared with the peak less the runtime.

    The measured part must stay within 1.5x the plan: RSS also holds what the plan leaves out,
    AdamW's temporaries at the optimizer step (a parameter-sized buffer: where checkpointing leaves
    few activations, the peak moves there) and the memory-mapped weights file. Measured on a quiet
    machine: 1.09-1.13x the plan on 1 process, 1.25-1.26x on 2 processes with checkpointing
    (1.04-1.09x without). Only this upper bound is asserted: under memory pressure (the full suite
    on 2 workers) the kernel evicts mapped pages from the resident set, and the same run measured
    147 MB against its plan of 420 there. A low RSS says nothing; one above 1.5x the plan would mean
    the plan misses what training holds.
    """
    larger = trained(plan_runs, "larger", processes)
    planned, measured = larger["memory_plan_mb"]["total"], larger["peak_memory_mb"] - runtime_mb
    assert planned > 300
    assert measured <= planned * 1.5, (planned, measured)
