"""The DPO starter (recipes/starters/dpo.py) held to the full recipe (recipes/dpo.py).

With the flags, seed and data of the shared run dpo_one (the colour pairs: training pairs as text,
validation pairs as two whole conversations, some with a system turn; a fresh LoRA adapter, whose
reference is the base with the adapter switched off), the starter's per-step training losses,
learning rates, evaluation figures and adapter equal the full recipe's on 1 process, and on 2 gloo
processes with 2 micro-batches per step, launched from a folder that holds nothing but the starter.
A run resumed from a mid-epoch checkpoint repeats the remaining steps exactly. In this
process: both read the pairs into the same tokens and batches, and for a full fine-tune (the
reference a frozen copy) the starter's per-pair losses, reward margins and gradients equal the full
recipe's.
"""

import ast
import copy
import importlib.util
import os
import re
import shutil
from types import SimpleNamespace

import fire
import pytest
import torch
from accelerate import Accelerator
from conftest import (
    ACCELERATE,
    DPO_RUN,
    PYTHON,
    REPO,
    assert_public_imports_only,
    check,
    fails_with,
    free_port,
    read_metrics,
    recipe_env,
    run,
    without_library,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

STARTER = REPO / "recipes" / "starters" / "dpo.py"
ADAPTER = "adapter_model.safetensors"
# Flags of DPO_RUN the starter does not have: neither changes a number the training computes.
NOT_IN_STARTER = {"--max_new_tokens", "--num_workers"}
STEP_LINE = re.compile(r"^step (\d+)/8 loss (\S+) lr (\S+)$", re.MULTILINE)
EVAL_LINE = re.compile(r"^epoch (\d+) eval_loss (\S+) margin (\S+) accuracy (\S+)$", re.MULTILINE)


def load_starter():
    """The starter as a module of its own name (tests import the full recipe as `dpo`)."""
    spec = importlib.util.spec_from_file_location("dpo_starter", STARTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def starter_main() -> ast.FunctionDef:
    tree = ast.parse(STARTER.read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")


def starter_args(*left_out: str, **changed) -> list[str]:
    """DPO_RUN as the starter takes it (the flags it lacks must change no training number), with
    `changed` values."""
    flags = {f"--{arg.arg}" for arg in starter_main().args.args}
    pairs = list(zip(DPO_RUN[::2], DPO_RUN[1::2]))
    assert all(flag.startswith("--") and not value.startswith("--") for flag, value in pairs), DPO_RUN
    missing = {flag for flag, _ in pairs if flag not in flags}
    assert missing <= NOT_IN_STARTER, (
        f"DPO_RUN trains with {missing - NOT_IN_STARTER}, which the starter lacks"
    )
    pairs = [
        (flag, str(changed.get(flag[2:], value))) for flag, value in pairs if flag in flags - set(left_out)
    ]
    return [item for pair in pairs for item in pair]


@pytest.fixture(scope="module")
def starter_one(dpo_data, module_tmp):
    """The starter with plain python on 1 process, with dpo_one's flags but a checkpoint every 2
    steps (step_6 is in the second epoch, after 2 of its 4 steps)."""
    tmp = module_tmp.mktemp("dpo-starter-one")
    args = [*dpo_data["files"], *starter_args(checkpoint_every=2)]
    proc = check(run([PYTHON, STARTER, *args, "--output_dir", tmp / "out"], recipe_env(tmp)))
    return SimpleNamespace(proc=proc, out=tmp / "out", args=args, tmp=tmp)


@pytest.fixture(scope="module")
def starter_two(dpo_data, module_tmp):
    """The starter alone copied into an empty folder and launched there on 2 gloo processes, each
    step in 2 micro-batches of 2 pairs per process (the same global batch of 8), with a PYTHONPATH
    whose accelerate_recipes refuses to import, and the default tracker (SwanLab, offline without a
    login)."""
    tmp = module_tmp.mktemp("dpo-starter-two")
    folder = tmp / "my_project"
    folder.mkdir()
    shutil.copy(STARTER, folder / "dpo.py")
    env = recipe_env(tmp, ACCELERATE_USE_CPU="true", PYTHONPATH=without_library(tmp))
    launch = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
    launch += ["--main_process_port", free_port(), "dpo.py"]
    args = [
        *dpo_data["files"],
        *starter_args("--tracker"),
        "--gradient_accumulation_steps",
        2,
        "--output_dir",
        "out",
    ]
    return SimpleNamespace(
        proc=check(run([*launch, *args], env, cwd=folder)), out=folder / "out", folder=folder
    )


def step_lines(proc) -> dict[int, tuple[float, float]]:
    return {int(step): (float(loss), float(lr)) for step, loss, lr in STEP_LINE.findall(proc.stdout)}


def test_per_step_losses_equal_the_full_recipe_on_one_and_two_processes(dpo_one, starter_one, starter_two):
    """Every step: the starter's loss (the mean over the global batch's pairs) within 1e-5 of the
    full recipe's, the same learning rate (warm-up, then linear decay); after each epoch the same
    evaluation loss, reward margin and reward accuracy over every validation pair; at the end the
    same adapter."""
    metrics = read_metrics(dpo_one)
    reference = {m["step"]: (m["train/loss"], m["train/lr"]) for m in metrics if "train/loss" in m}
    names = ("eval/loss", "eval/reward_margin", "eval/reward_accuracy")
    evaluations = [tuple(m[name] for name in names) for m in metrics if "eval/loss" in m]
    assert sorted(reference) == list(range(1, 9)) and len(evaluations) == 2
    expected = load_file(str(dpo_one / ADAPTER))
    for starter, world, accumulation, per_process in ((starter_one, 1, 1, 8), (starter_two, 2, 2, 2)):
        proc = starter.proc
        assert (
            f"global batch 8 = {world} processes x {accumulation} micro-batches x {per_process}"
            in proc.stdout
        )
        printed = step_lines(proc)
        assert printed.keys() == reference.keys(), proc.stdout[-3000:]
        worst = max(abs(printed[step][0] - reference[step][0]) for step in reference)
        assert worst <= 1e-5, (
            f"{world} process(es): per-step losses differ from the full recipe's by up to {worst}"
        )
        assert [printed[s][1] for s in sorted(reference)] == pytest.approx(
            [reference[s][1] for s in sorted(reference)]
        )
        found = [tuple(float(x) for x in line[1:]) for line in EVAL_LINE.findall(proc.stdout)]
        assert found == [pytest.approx(e, abs=1e-5) for e in evaluations], (world, found, evaluations)
        adapter = load_file(str(starter.out / ADAPTER))
        assert adapter.keys() == expected.keys()
        assert max((adapter[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5


def test_the_starter_ran_from_an_empty_folder_and_saved_everything(starter_two):
    """2 processes from a folder holding only the starter: adapter, tokenizer, the checkpoints of
    both epoch ends, and the SwanLab run written offline with the training loss in it."""
    assert sorted(os.listdir(starter_two.folder)) == ["dpo.py", "out"]
    out = starter_two.out
    for name in (ADAPTER, "adapter_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert sorted(os.listdir(out / "checkpoints")) == ["step_4", "step_8"]
    (swanlab_run,) = (out / "swanlog").glob("run-*")
    assert b"train/loss" in next(swanlab_run.glob("run-*.swanlab")).read_bytes()


def test_a_run_resumed_from_a_checkpoint_repeats_the_remaining_steps_exactly(starter_one):
    """From step_6 (weights, optimizer, schedule and RNG states from load_state, the step from the
    folder's name, 2 steps of the second epoch's shuffle skipped): steps 7 and 8, the last
    evaluation and the adapter are those of the run that never stopped."""
    # the 2 newest of 2, 4, 6, 8
    assert sorted(os.listdir(starter_one.out / "checkpoints")) == ["step_6", "step_8"]
    resumed_out = starter_one.tmp / "resumed"
    cmd = [PYTHON, STARTER, *starter_one.args, "--output_dir", resumed_out]
    resumed = check(
        run([*cmd, "--resume", starter_one.out / "checkpoints" / "step_6"], recipe_env(starter_one.tmp))
    )
    before, after = step_lines(starter_one.proc), step_lines(resumed)
    assert sorted(after) == [7, 8], resumed.stdout[-3000:]
    assert all(after[step] == before[step] for step in (7, 8)), (after, before)
    assert EVAL_LINE.findall(resumed.stdout) == EVAL_LINE.findall(starter_one.proc.stdout)[1:]
    expected, adapter = load_file(str(starter_one.out / ADAPTER)), load_file(str(resumed_out / ADAPTER))
    assert adapter.keys() == expected.keys() and all(torch.equal(adapter[k], expected[k]) for k in expected)
    assert sorted(os.listdir(resumed_out / "checkpoints")) == ["step_8"]


def test_pairs_batches_and_a_full_fine_tunes_loss_equal_the_full_recipes(dpo_data):
    """Both formats (text; two whole conversations) give the full recipe's token ids (the prompt
    rendered with the generation prompt, each answer the rest of its rendered conversation) and
    batches (left-padded, chosen rows first); for a whole model trained against a frozen copy of
    itself, the same per-pair losses, reward margins and gradients."""
    import dpo as full
    from chat.preference_pairs import PairCollator, load_pairs, tokenize_pairs

    starter = load_starter()
    tokenizer = AutoTokenizer.from_pretrained(dpo_data["model"])
    root = dpo_data["root"]
    splits = load_pairs(root / "train.jsonl", root / "validation.jsonl", None, root / "cache", 0.1, 0)
    for name, pairs in zip(("train", "validation"), splits):
        rows, _ = tokenize_pairs(tokenizer, pairs, 64, "drop", name)
        mine = starter.read_pairs(str(root / f"{name}.jsonl"), tokenizer, 64)
        assert len(mine) == len(pairs)
        assert [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows] == [
            (p["prompt"], p["chosen"], p["rejected"]) for p in mine
        ]
    # the first 6 validation pairs (with and without a
    # system turn, answers of different lengths), batched
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    theirs = PairCollator(pad_id)(rows[:6])
    inputs, answer_mask = starter.collate(mine[:6])
    assert torch.equal(inputs["attention_mask"], theirs["attention_mask"])
    assert torch.equal(answer_mask, theirs["answer_mask"])
    real = inputs["attention_mask"].bool()
    assert torch.equal(inputs["input_ids"][real], theirs["input_ids"][real]) and not real.all()

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(dpo_data["model"], dtype=torch.float32)
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the policy as after some training: margins away from 0
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    losses, margins = starter.dpo_loss(accelerator, model, frozen, inputs, answer_mask, 0.5)
    losses.sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    policy, tokens = full.answer_logprobs(model, theirs)
    reference = full.reference_logprobs(accelerator, model, frozen, theirs, None)
    figures = full.pair_figures(policy, reference, tokens, full.DpoFlags(beta=0.5))
    figures["loss"].sum().backward()
    assert margins.abs().min() > 1e-3
    # A margin is beta x a difference of sums of answer log-probabilities (here up to ~37 nats); the
    # two paths sum in other orders, so they may differ by a few units in the last place of the
    # largest sum (4.4e-6 at 37 in float32; 3.8e-6 apart on a CPU kept to AVX2). The loss, -log
    # sigmoid(margin), moves less than its margin.
    tolerance = 0.5 * 8 * torch.finfo(torch.float32).eps * torch.cat((policy, reference)).abs().max().item()
    assert torch.allclose(losses, figures["loss"], rtol=0, atol=tolerance)
    assert torch.allclose(margins, figures["reward_margin"], rtol=0, atol=tolerance)
    for name, param in model.named_parameters():
        assert torch.allclose(grads[name], param.grad, atol=1e-6), name


def test_the_starter_imports_public_packages_only():
    imported = assert_public_imports_only(STARTER)
    assert {"accelerate", "torch", "transformers", "peft", "fire"} <= imported


def test_help_explains_every_flag(capsys):
    main = starter_main()
    documented = dict(re.findall(r"^ {4}(\w+): (.+)$", ast.get_docstring(main), re.MULTILINE))
    flags = [arg.arg for arg in main.args.args]
    assert sorted(documented) == sorted(flags), "the docstring's Args must document every flag of main()"
    with pytest.raises(fire.core.FireExit):
        fire.Fire(load_starter().main, command=["--help"])
    shown = capsys.readouterr()
    for flag in flags:
        assert f"--{flag}" in shown.out + shown.err and documented[flag][:50] in shown.out + shown.err, flag


def test_a_batch_that_does_not_split_is_a_one_line_error(dpo_data, tmp_path):
    args = [*dpo_data["files"], "--tracker", "none", "--output_dir", tmp_path / "out"]
    proc = run(
        [PYTHON, STARTER, *args, "--batch_size", "7", "--gradient_accumulation_steps", "2"],
        recipe_env(tmp_path),
    )
    fails_with(proc, "--batch_size 7", "multiple of 2")
