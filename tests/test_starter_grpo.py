"""The GRPO starter (recipes/starters/grpo.py) held to the full recipe (recipes/grpo.py).

The starter samples with torch's seeded RNG, the full recipe with keyed noise, so their runs draw
different completions and are compared where they must agree: in this process, for one batch of
rollouts that the full recipe generated, the starter's group-relative advantages, its loss and the
loss's gradients, micro-batch by micro-batch, equal the full recipe's (`advantages`, `policy_loss`,
dapo normalisation) in fp32, and the micro-batches' shares add up to the whole batch's; its
generation is the plain softmax (and greedy the argmax) whatever the model's generation_config asks.

End to end: a LoRA run with plain python on 1 process saves its adapter and checkpoints; a run
resumed from the step-4 checkpoint it left (as a run stopped there would) goes on with steps 5 and 6
exactly as the run did and ends with the same adapter; the starter copied alone into an empty folder
fine-tunes the whole model on 2 gloo processes with 2 micro-batches per step and learns the user's
brevity reward. It imports public packages only.
"""

import ast
import importlib.util
import json
import os
import re
import shutil
from types import SimpleNamespace

import peft
import pytest
import torch
from accelerate import Accelerator
from conftest import (
    ACCELERATE,
    CONFIGS,
    PYTHON,
    REPO,
    assert_public_imports_only,
    check,
    free_port,
    recipe_env,
    run,
    without_library,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

STARTER = REPO / "recipes" / "starters" / "grpo.py"
STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+) reward (\S+)$", re.MULTILINE)
EVAL_LINE = re.compile(r"^epoch (\d+) eval_reward (\S+) over (\d+) prompts$", re.MULTILINE)
ADAPTER = "adapter_model.safetensors"
# 48 training prompts, 8 a step x 4 completions: 6 steps an epoch. The adapter run checkpoints every
# 2 steps; the full fine-tune (lr 5e-2: a LoRA on this 2-layer model of hidden size 32 barely moves
# its near-uniform softmax, whose logits the final norm bounds) takes 2 epochs, its checkpoints at
# the epoch ends only.
COMMON = ["--batch_size", "8", "--num_generations", "4", "--max_new_tokens", "8", "--seed", "0"]
LORA_RUN = [
    *COMMON,
    "--lora_r",
    "8",
    "--lr",
    "1e-2",
    "--epochs",
    "1",
    "--checkpoint_every",
    "2",
    "--tracker",
    "none",
]
FULL_RUN = [*COMMON, "--lora_r", "0", "--lr", "5e-2", "--epochs", "2", "--gradient_accumulation_steps", "2"]
FULL_RUN += ["--checkpoint_every", "0"]


def load_starter():
    """The starter as a module of its own name (tests import the full recipe as `grpo`)."""
    spec = importlib.util.spec_from_file_location("grpo_starter", STARTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_prompts(tokenizer, things: list[str]) -> list[list[int]]:
    chats = [[{"role": "user", "content": f"What colour is the {thing}?"}] for thing in things]
    texts = [
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def tiny_tokenizer(folder):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # as the starter does
    return tokenizer


def rows_of(completions, rows: slice):
    """The full recipe's Rollout of some rows of `completions` (its generate's output)."""
    from chat.rollouts import Rollout

    return Rollout(**{key: value[rows] for key, value in vars(completions).items()})


def test_advantages_loss_and_gradients_equal_the_full_recipes_for_each_micro_batch(tiny_chat_model):
    """4 prompts x 4 completions from the full recipe's keyed sampling, some of them cut short by an
    end-of-turn token, one group of equal rewards; a seeded LoRA whose B matrices are not zero, so
    every adapter weight has a gradient. The global batch split into 2 micro-batches: the starter's
    advantages, its loss shares (over the completion tokens of the whole batch) and their gradients
    equal the full recipe's within 1e-6, and add up to the whole batch's."""
    import grpo as full
    from chat.rollouts import generate, sampling_keys

    starter = load_starter()
    accelerator = Accelerator(cpu=True)
    tokenizer = tiny_tokenizer(tiny_chat_model)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    lora = peft.LoraConfig(
        task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False
    )
    model = peft.get_peft_model(base, lora)
    generations, temperature = 4, 0.7
    args = full.GrpoFlags(
        max_new_tokens=8, num_generations=generations, batch_size=4, temperature=temperature
    )
    prompts = chat_prompts(tokenizer, ["sky", "grass", "ripe plum", "snow"])
    keys = sampling_keys(0, 0, torch.arange(4), generations)
    rollout = generate(
        accelerator, model, tokenizer, [p for p in prompts for _ in range(generations)], args, keys
    )

    # Fixed completion ids of different lengths: every third row as sampled, the others end early at
    # a turn's end.
    width, end_of_turn = rollout.completion.shape[1], tokenizer.eos_token_id
    for row in range(16):
        if row % 3:
            stop = row % width
            rollout.completion[row, stop] = end_of_turn
            rollout.completion[row, stop + 1 :] = tokenizer.pad_token_id
            rollout.mask[row] = (torch.arange(width) <= stop).long()
    assert len(set(rollout.mask.sum(1).tolist())) > 3
    ends = rollout.mask.sum(1).tolist()
    texts = tokenizer.batch_decode(
        [c[:n] for c, n in zip(rollout.completion, ends)], skip_special_tokens=True
    )
    rewards = [-len(text) / 40 for text in texts]
    rewards[8:12] = [0.5] * 4  # a group without signal: its advantages are 0

    halves = [rows_of(rollout, slice(0, 8)), rows_of(rollout, slice(8, 16))]
    for half, rows in zip(halves, (slice(0, 8), slice(8, 16))):
        half.rewards, half.loss_mask = rewards[rows], half.mask
    full.advantages(accelerator, halves, generations, "group")
    loss_args = SimpleNamespace(
        epsilon=0.2,
        epsilon_high=None,
        beta=0.0,
        loss_type="dapo",
        batch_size=4,
        num_generations=4,
        max_new_tokens=8,
    )
    normaliser = full.loss_normaliser(accelerator, halves, loss_args)
    for half in halves:
        half.normaliser = normaliser

    advantages = starter.group_advantages(torch.tensor(rewards, dtype=torch.float64), generations).float()
    assert (advantages - torch.cat([h.advantages for h in halves])).abs().max() <= 1e-6
    assert advantages[8:12].abs().max() == 0 and advantages.abs().max() > 0.5

    # The starter's count: every completion token of every micro-batch (of every process), before
    # the forward passes.
    tokens = sum(half.mask.sum() for half in halves).float()
    assert tokens == normaliser
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    shares, share_gradients = [], []
    for half, ours in zip(halves, advantages.chunk(2)):
        theirs = full.policy_loss(full.token_logprobs(model, half, temperature), half, loss_args, None)[0]
        loss = starter.policy_loss(
            starter.token_logprobs(model, vars(half), temperature), ours, half.mask, tokens
        )
        expected, gradients = torch.autograd.grad(theirs, trainable), torch.autograd.grad(loss, trainable)
        assert abs(loss.item() - theirs.item()) <= 1e-6, (loss.item(), theirs.item())
        worst = max((g - e).abs().max().item() for g, e in zip(gradients, expected))
        assert worst <= 1e-6, worst
        # a gradient to compare, on every weight
        assert max(g.abs().max().item() for g in gradients) > 1e-3
        assert all(g.abs().sum() > 0 for g in gradients)
        shares.append(loss.detach())
        share_gradients.append(gradients)

    whole = starter.policy_loss(
        starter.token_logprobs(model, vars(rollout), temperature), advantages, rollout.mask, tokens
    )
    whole_gradients = torch.autograd.grad(whole, trainable)
    assert abs(sum(shares).item() - whole.item()) <= 1e-6 and abs(whole.item()) > 1e-3
    summed = [a + b for a, b in zip(*share_gradients)]
    assert max((s - w).abs().max().item() for s, w in zip(summed, whole_gradients)) <= 1e-6


def test_sampling_and_greedy_answers_ignore_the_models_generation_config(tiny_chat_model):
    """A model whose generation_config asks for a repetition penalty of 1.3, bans repeated tokens,
    suppresses tokens and samples at temperature 0.3 from its top 1 (top-p 0.5, min-p 0.2), which
    transformers applies unless told otherwise. Under the starter's options every score generate()
    draws from is the logits / the temperature (greedy: the logits themselves); with the same seed
    the starter draws the same completions and greedy answers as from the model without them; greedy
    tokens are the argmax of the softmax the update uses, and samples reach beyond the 50
    likeliest."""
    starter = load_starter()
    tokenizer = tiny_tokenizer(tiny_chat_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    prompts = [p for p in chat_prompts(tokenizer, ["sky", "ripe plum"]) for _ in range(4)]

    def answers(temperature: float) -> dict:
        torch.manual_seed(0)
        return starter.generate(model, tokenizer, prompts, 8, temperature)

    plain_sampled, plain_greedy = answers(1.0), answers(0.0)
    first_tokens = plain_sampled["completion"][:4, 0].tolist() + plain_greedy["completion"][:, 0].tolist()
    own = dict(repetition_penalty=1.3, no_repeat_ngram_size=1, suppress_tokens=first_tokens, temperature=0.3)
    model.generation_config.update(do_sample=True, top_k=1, top_p=0.5, min_p=0.2, **own)
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    width, pad = batch["input_ids"].shape[1], tokenizer.pad_token_id
    torch.manual_seed(0)
    by_its_config = model.generate(**batch, max_new_tokens=8, pad_token_id=pad)
    assert not torch.equal(by_its_config[:, width:], plain_greedy["completion"])  # the trap is set

    traced = dict(
        max_new_tokens=8,
        pad_token_id=pad,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    for options in (dict(starter.SAMPLING, do_sample=True, temperature=0.7), dict(do_sample=False)):
        out = model.generate(**batch, **starter.NEUTRAL, **options, **traced)
        for scores, logits in zip(out.scores, out.logits, strict=True):
            assert torch.allclose(scores, logits / options.get("temperature", 1.0), atol=1e-6), options

    sampled, greedy = answers(1.0), answers(0.0)
    assert torch.equal(sampled["completion"], plain_sampled["completion"])
    assert torch.equal(greedy["completion"], plain_greedy["completion"])
    assert model.generation_config.repetition_penalty == 1.3  # the model's own is left as it was
    for rollout in (greedy, sampled):
        attention = torch.cat([rollout["prompt_mask"], rollout["mask"]], 1)
        with torch.no_grad():
            logits = model(
                input_ids=torch.cat([rollout["prompt"], rollout["completion"]], 1),
                attention_mask=attention,
                position_ids=(attention.cumsum(1) - 1).clamp(min=0),
            ).logits[:, rollout["prompt"].shape[1] - 1 : -1]
        chosen = logits.gather(-1, rollout["completion"][..., None])
        rank = (logits > chosen).sum(-1)[rollout["mask"].bool()]  # 0: the likeliest token
        if rollout is greedy:
            assert rank.max() == 0
        else:
            assert rank.max() >= 50 and len(set(map(tuple, rollout["completion"].tolist()))) == 8


def step_lines(proc) -> dict[int, tuple[float, float]]:
    return {
        int(step): (float(loss), float(reward)) for step, _, loss, reward in STEP_LINE.findall(proc.stdout)
    }


@pytest.fixture(scope="module")
def lora_one(grpo_data, module_tmp):
    """The starter with plain python on 1 process: a LoRA adapter, 6 steps, checkpoints every 2."""
    tmp = module_tmp.mktemp("starter-grpo-one")
    brevity = f"{grpo_data['root'] / 'brevity.py'}:brevity"
    args = [*grpo_data["files"], "--reward", brevity, *LORA_RUN]
    proc = check(run([PYTHON, STARTER, *args, "--output_dir", tmp / "out"], recipe_env(tmp)))
    return SimpleNamespace(proc=proc, out=tmp / "out", args=args, tmp=tmp)


@pytest.fixture(scope="module")
def full_two(grpo_data, module_tmp):
    """The starter alone copied into an empty folder and launched there on 2 gloo processes, with a
    PYTHONPATH whose accelerate_recipes refuses to import: a full fine-tune, 2 micro-batches per
    step, SwanLab offline."""
    tmp = module_tmp.mktemp("starter-grpo-two")
    folder = tmp / "my_project"
    folder.mkdir()
    shutil.copy(STARTER, folder / "grpo.py")
    env = recipe_env(tmp, ACCELERATE_USE_CPU="true", PYTHONPATH=without_library(tmp))
    launch = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", 2]
    launch += ["--num_cpu_threads_per_process", 1, "--main_process_port", free_port(), "grpo.py"]
    brevity = f"{grpo_data['root'] / 'brevity.py'}:brevity"
    args = [*grpo_data["files"], "--reward", brevity, *FULL_RUN, "--output_dir", "out"]
    return SimpleNamespace(
        proc=check(run([*launch, *args], env, cwd=folder)), out=folder / "out", folder=folder
    )


def test_one_process_saves_the_adapter_and_its_checkpoints(lora_one):
    proc, out = lora_one.proc, lora_one.out
    assert "global batch 8 = 1 processes x 1 micro-batches x 8" in proc.stdout
    printed = step_lines(proc)
    assert sorted(printed) == list(range(1, 7)), proc.stdout[-3000:]
    assert all(-1 < reward < 0 for _, reward in printed.values())  # brevity: -characters / 40
    # each prompt once
    assert [(int(e), int(n)) for e, _, n in EVAL_LINE.findall(proc.stdout)] == [(1, 16)]
    for name in (ADAPTER, "adapter_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    adapter = load_file(str(out / ADAPTER))
    # B starts at 0: trained
    assert all(adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
    # the 2 newest of steps 2, 4, 6
    assert sorted(os.listdir(out / "checkpoints")) == ["step_4", "step_6"]


def test_a_run_resumed_from_a_checkpoint_goes_on_from_its_step_as_if_never_stopped(lora_one):
    """Weights, optimizer, schedule and every random state (the sampling's included) come back with
    load_state and the step from the folder's name: steps 5 and 6 sample, score and update exactly
    as the uninterrupted run did."""
    tmp, resumed_out = lora_one.tmp, lora_one.tmp / "resumed"
    cmd = [
        PYTHON,
        STARTER,
        *lora_one.args,
        "--output_dir",
        resumed_out,
        "--resume",
        lora_one.out / "checkpoints/step_4",
    ]
    resumed = check(run(cmd, recipe_env(tmp)))
    before, after = step_lines(lora_one.proc), step_lines(resumed)
    assert sorted(after) == [5, 6], resumed.stdout[-3000:]
    for step in (5, 6):
        assert after[step] == pytest.approx(before[step], abs=1e-6), (step, after[step], before[step])
    assert EVAL_LINE.findall(resumed.stdout) == EVAL_LINE.findall(lora_one.proc.stdout)
    expected, adapter = load_file(str(lora_one.out / ADAPTER)), load_file(str(resumed_out / ADAPTER))
    assert adapter.keys() == expected.keys()
    assert max((adapter[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
    assert sorted(os.listdir(resumed_out / "checkpoints")) == ["step_6"]


def test_two_processes_from_an_empty_folder_learn_the_users_reward(full_two):
    """The user's brevity reward (-characters / 40 of each completion) rises: the last 3 steps' mean
    beats the first 3 steps' by 0.1 (measured: -0.49 to -0.06); the validation prompts are answered
    once each after both epochs."""
    proc, out = full_two.proc, full_two.out
    assert sorted(os.listdir(full_two.folder)) == ["grpo.py", "out"]
    assert "global batch 8 = 2 processes x 2 micro-batches x 2" in proc.stdout
    printed = step_lines(proc)
    assert sorted(printed) == list(range(1, 13)), proc.stdout[-3000:]
    first, last = [printed[s][1] for s in (1, 2, 3)], [printed[s][1] for s in (10, 11, 12)]
    assert sum(last) / 3 > sum(first) / 3 + 0.1, printed
    assert [(int(e), int(n)) for e, _, n in EVAL_LINE.findall(proc.stdout)] == [(1, 16), (2, 16)]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert set(os.listdir(out / "checkpoints")) == {"step_6", "step_12"}
    # each process's own sampling state
    assert (out / "checkpoints" / "step_12" / "random_states_1.pkl").is_file()
    (swanlab_run,) = (out / "swanlog").glob("run-*")
    assert b"train/reward" in next(swanlab_run.glob("run-*.swanlab")).read_bytes()


def test_the_starter_imports_public_packages_only():
    imported = assert_public_imports_only(STARTER)
    assert {"accelerate", "torch", "transformers", "peft", "fire"} <= imported


def test_help_explains_every_flag(tmp_path):
    tree = ast.parse(STARTER.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    documented = dict(re.findall(r"^ {4}(\w+): (.+)$", ast.get_docstring(main), re.MULTILINE))
    flags = [arg.arg for arg in main.args.args]
    assert sorted(documented) == sorted(flags), "the docstring's Args must document every flag of main()"
    assert {"checkpoint_every", "resume"} <= set(flags) and "epsilon" not in flags
    proc = check(run([PYTHON, STARTER, "--help"], recipe_env(tmp_path)))
    for flag in flags:
        assert f"--{flag}" in proc.output and documented[flag][:50] in proc.output, flag
