"""The GRPO starter (recipes/starters/grpo.py) held to the full recipe (recipes/grpo.py): with the flags, seed and data
of the shared run grpo_one, its per-step rewards (the same completions), losses and final adapter equal the full
recipe's on 1 process and on 2 gloo processes from an empty folder; it imports public packages only."""

import ast
import re
import shutil
from types import SimpleNamespace

import pytest
from conftest import (
    ACCELERATE,
    CONFIGS,
    GRPO_RUN,
    PYTHON,
    REPO,
    assert_public_imports_only,
    check,
    free_port,
    read_metrics,
    recipe_env,
    run,
    without_library,
)
from safetensors.torch import load_file

STARTER = REPO / "recipes" / "starters" / "grpo.py"
# Flags of GRPO_RUN the starter does not have, none of which changes a number the training computes: the weights are
# 1 and 1 (the starter sums its rewards), checkpoints and evaluations between epoch ends leave the weights alone.
NOT_IN_STARTER = {"--reward_weights", "--checkpoint_every", "--eval_every"}
STEP_LINE = re.compile(r"^step (\d+)/6 loss (\S+) reward (\S+)$", re.MULTILINE)
ADAPTER = "adapter_model.safetensors"


def starter_args() -> list[str]:
    """GRPO_RUN as the starter takes it."""
    tree = ast.parse(STARTER.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    flags = {f"--{arg.arg}" for arg in main.args.args}
    pairs = list(zip(GRPO_RUN[::2], GRPO_RUN[1::2]))
    missing = {flag for flag, _ in pairs if flag not in flags}
    assert missing <= NOT_IN_STARTER, f"GRPO_RUN trains with {missing - NOT_IN_STARTER}, which the starter lacks"
    return [item for flag, value in pairs if flag in flags for item in (flag, value)]


@pytest.fixture(scope="module")
def starter_runs(grpo_data, module_tmp):
    """The starter with plain python on 1 process, and copied alone into an empty folder and launched there on 2
    gloo processes with a PYTHONPATH whose accelerate_recipes refuses to import."""
    tmp = module_tmp.mktemp("starter-grpo")
    args = [*grpo_data["files"], "--reward", grpo_data["reward"], *starter_args()]
    one = check(run([PYTHON, STARTER, *args, "--output_dir", tmp / "one"], recipe_env(tmp)))
    folder = tmp / "my_project"
    folder.mkdir()
    shutil.copy(STARTER, folder / "grpo.py")
    env = recipe_env(tmp, ACCELERATE_USE_CPU="true", PYTHONPATH=without_library(tmp))
    launch = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", 2]
    launch += ["--num_cpu_threads_per_process", 1, "--main_process_port", free_port(), "grpo.py"]
    two = check(run([*launch, *args, "--output_dir", "out"], env, cwd=folder))
    return [SimpleNamespace(proc=one, out=tmp / "one"), SimpleNamespace(proc=two, out=folder / "out")]


def test_per_step_rewards_losses_and_adapter_equal_the_full_recipe_on_one_and_two_processes(grpo_one, starter_runs):
    metrics = read_metrics(grpo_one)
    rewards = {m["step"]: m["train/reward"] for m in metrics if "train/reward" in m}
    losses = {m["step"]: m["train/loss"] for m in metrics if "train/loss" in m}
    expected = load_file(str(grpo_one / ADAPTER))
    for world, starter in enumerate(starter_runs, start=1):
        printed = {int(s): (float(loss), float(r)) for s, loss, r in STEP_LINE.findall(starter.proc.stdout)}
        assert printed.keys() == losses.keys(), starter.proc.stdout[-3000:]
        assert all(abs(printed[s][1] - rewards[s]) <= 1e-5 for s in rewards), (world, printed, rewards)
        assert all(abs(printed[s][0] - losses[s]) <= 1e-5 for s in losses), (world, printed, losses)
        adapter = load_file(str(starter.out / ADAPTER))
        assert adapter.keys() == expected.keys()
        assert max((adapter[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5, world
        assert "epoch 1 eval_reward" in starter.proc.stdout


def test_the_starter_imports_public_packages_only():
    imported = assert_public_imports_only(STARTER)
    assert {"accelerate", "torch", "transformers", "peft", "fire"} <= imported


def test_help_explains_every_flag(tmp_path):
    tree = ast.parse(STARTER.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    documented = dict(re.findall(r"^ {4}(\w+): (.+)$", ast.get_docstring(main), re.MULTILINE))
    flags = [arg.arg for arg in main.args.args]
    assert sorted(documented) == sorted(flags), "the docstring's Args must document every flag of main()"
    proc = check(run([PYTHON, STARTER, "--help"], recipe_env(tmp_path)))
    for flag in flags:
        assert f"--{flag}" in proc.output and documented[flag][:50] in proc.output, flag
