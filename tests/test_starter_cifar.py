"""The CIFAR starter (recipes/starters/cifar.py) keeps the full recipe's training maths.

With the same flags, seed and data, the starter and recipes/cifar.py log the same training loss and
learning rate at every step, end with the same weights and the same test accuracy, on 1 process and
on 2 gloo processes (there with 2 micro-batches per step and gradient clipping). Both read a tiny
CIFAR-10 written in the release's on-disk format through torchvision's CIFAR10 (the full recipe with
--loader torch: its device loader shuffles in its own way), with augmentation off (the full recipe
seeds it per image, the starter draws from torch's generator). 32 training images at a global batch
of 16 make 2 steps per epoch: the third step opens the second epoch, on a new shuffle. 21 test
images do not divide over 2 processes: each must still be counted once. BatchNorm normalises over
each process's batch, so the 2-process starter is compared with the 2-process recipe.

The starter imports only public packages and runs from a folder holding nothing but itself: its
2-process run starts there, with a decoy of this project's code first on PYTHONPATH that fails any
import of it.
"""

import ast
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    ACCELERATE,
    CONFIGS,
    PYTHON,
    REPO,
    assert_public_imports_only,
    check,
    fails_with,
    free_port,
    read_metrics,
    read_results,
    recipe_env,
    run,
    without_library,
    write_cifar10,
)

STARTER = REPO / "recipes" / "starters" / "cifar.py"
FULL_RECIPE = REPO / "recipes" / "cifar.py"
NUM_TRAIN, NUM_TEST = 32, 21
STEPS = 3
# Flags both scripts take. The warm-up covers 2 of the 3 steps (round(0.5 x 3)), so the logged rates
# pass through the warm-up and the cosine's end; lr, momentum, weight decay and label smoothing keep
# their defaults, which must agree.
SAME = ["--download", "False", "--verify_data", "False", "--augment", "False", "--num_workers", "0"]
SAME += ["--batch_size", "16", "--max_steps", STEPS, "--warmup_ratio", "0.5", "--log_every", "1"]
SAME += ["--checkpoint_every", "0"]
FULL_ONLY = ["--dataset", "cifar10", "--loader", "torch", "--tracker", "none"]
TWO_PROCESSES = ["--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5", "--tracker", "none"]
STEP_LINE = re.compile(r"^step (\d+)/\d+ loss (\S+) lr (\S+)$", re.MULTILINE)
EVAL_LINE = re.compile(r"eval accuracy (\S+) on (\d+) test images")


def launch_two(script, folder: Path, env: dict, *args):
    """`script` on 2 CPU processes over gloo, one thread each, started from `folder`."""
    cmd = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", 2]
    cmd += ["--num_cpu_threads_per_process", 1, "--main_process_port", free_port(), script, *args]
    return check(run(cmd, env, cwd=folder, timeout=300))


@pytest.fixture(scope="module")
def cifar10_dir(module_tmp) -> Path:
    return write_cifar10(module_tmp.mktemp("cifar10-tiny"), NUM_TRAIN, NUM_TEST, seed=0)


@pytest.fixture(scope="module")
def full_one(cifar10_dir, module_tmp):
    tmp = module_tmp.mktemp("full-one")
    args = [FULL_RECIPE, "--data_dir", cifar10_dir, *SAME, *FULL_ONLY, "--output_dir", tmp / "out"]
    return SimpleNamespace(out=tmp / "out", proc=check(run([PYTHON, *args], recipe_env(tmp), timeout=300)))


@pytest.fixture(scope="module")
def starter_one(cifar10_dir, module_tmp):
    """The starter with plain python and its default tracker: SwanLab, offline for a user with no
    login."""
    tmp = module_tmp.mktemp("starter-one")
    args = [STARTER, "--data_dir", cifar10_dir, *SAME, "--output_dir", tmp / "out"]
    return SimpleNamespace(
        out=tmp / "out", proc=check(run([PYTHON, *args], recipe_env(tmp), cwd=tmp, timeout=300))
    )


@pytest.fixture(scope="module")
def full_two(cifar10_dir, module_tmp):
    tmp = module_tmp.mktemp("full-two")
    env = recipe_env(tmp, ACCELERATE_USE_CPU="true")
    args = ["--data_dir", cifar10_dir, *SAME, *FULL_ONLY, *TWO_PROCESSES, "--output_dir", tmp / "out"]
    return SimpleNamespace(out=tmp / "out", proc=launch_two(FULL_RECIPE, REPO, env, *args))


@pytest.fixture(scope="module")
def starter_two(cifar10_dir, module_tmp):
    """The starter copied alone into an empty folder and launched there on 2 processes; the only
    folder on PYTHONPATH holds modules named like this project's that fail on import."""
    tmp = module_tmp.mktemp("starter-two")
    folder = tmp / "my_project"
    folder.mkdir()
    shutil.copy(STARTER, folder / "cifar.py")
    env = recipe_env(tmp, ACCELERATE_USE_CPU="true", PYTHONPATH=without_library(tmp))
    args = ["--data_dir", cifar10_dir, *SAME, *TWO_PROCESSES, "--output_dir", "out"]
    return SimpleNamespace(out=folder / "out", proc=launch_two("cifar.py", folder, env, *args), folder=folder)


def starter_steps(proc) -> dict[int, tuple[float, float]]:
    """{step: (loss, lr)} from the starter's `step N/T loss L lr R` lines."""
    return {int(step): (float(loss), float(lr)) for step, loss, lr in STEP_LINE.findall(proc.stdout)}


def full_steps(out: Path) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["train/loss"], m["train/lr"]) for m in read_metrics(out) if "train/loss" in m}


def assert_same_training(starter, full) -> tuple[float, float]:
    """Same steps, losses within 1e-5, same learning rates, same final weights and test accuracy;
    returns the largest loss and weight differences.

    The weights catch what 3 short steps barely move the loss by: weight decay put on BatchNorm
    parameters as well changed them by 3.5e-5 but the third loss by only 2e-6. Both scripts do the
    same float operations in the same order, so the weights agree bit for bit here; 1e-6 leaves room
    for nothing more than rounding."""
    ours, theirs = starter_steps(starter.proc), full_steps(full.out)
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1)), (ours, theirs)
    for step in theirs:
        assert ours[step][1] == pytest.approx(theirs[step][1], rel=1e-6, abs=1e-12), (step, ours, theirs)
    difference = max(abs(ours[step][0] - theirs[step][0]) for step in theirs)
    assert difference < 1e-5, (ours, theirs)

    from safetensors.torch import load_file

    mine, reference = load_file(starter.out / "model.safetensors"), load_file(full.out / "model.safetensors")
    # the plain torchvision ResNet18 with the CIFAR stem in both
    assert mine.keys() == reference.keys()
    assert all(mine[name].shape == tensor.shape for name, tensor in reference.items())
    weights = {
        name: (mine[name].double() - tensor.double()).abs().max().item() for name, tensor in reference.items()
    }
    assert max(weights.values()) < 1e-6, sorted(weights.items(), key=lambda item: -item[1])[:5]

    accuracy, seen = EVAL_LINE.findall(starter.proc.stdout)[-1]
    results = read_results(full.out)
    # each test image once, on any number of processes
    assert int(seen) == results["eval_samples"] == NUM_TEST
    assert float(accuracy) == pytest.approx(results["eval_accuracy"], abs=5e-5)
    return difference, max(weights.values())


def test_starter_trains_as_the_full_recipe_on_one_process(starter_one, full_one):
    losses, weights = assert_same_training(starter_one, full_one)
    print(f"1 process: largest loss difference {losses:.2e}, weight difference {weights:.2e}")


def test_starter_trains_as_the_full_recipe_on_two_processes_with_accumulation_and_clipping(
    starter_two, full_two
):
    # 16 = 2 x 4 x 2
    assert "global batch 16: 4 images per process and micro-batch" in starter_two.proc.stdout
    losses, weights = assert_same_training(starter_two, full_two)
    print(f"2 processes: largest loss difference {losses:.2e}, weight difference {weights:.2e}")


def test_starter_imports_only_public_packages_and_runs_alone(starter_two):
    assert_public_imports_only(STARTER)
    # Launched from a folder holding only itself (plus what
    # it wrote), with the decoys first on the import path.
    assert sorted(p.name for p in starter_two.folder.iterdir()) == ["cifar.py", "out"]
    assert "public packages only" not in starter_two.proc.output


def test_starter_tracks_offline_without_a_login_and_saves_checkpoints(starter_one):
    assert list((starter_one.out / "swanlog").glob("run-*")), "no offline SwanLab run"
    # save_state at each epoch's end: after step 2 (the
    # first epoch) and step 3 (where the run stopped)
    checkpoints = sorted(p.name for p in (starter_one.out / "checkpoints").iterdir())
    assert checkpoints == ["step_2", "step_3"]
    assert (starter_one.out / "checkpoints" / "step_3" / "model.safetensors").is_file()


def main_flags() -> list[str]:
    tree = ast.parse(STARTER.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    return [arg.arg for arg in main.args.args]


def test_help_explains_every_flag(tmp_path):
    proc = check(run([PYTHON, STARTER, "--help"], recipe_env(tmp_path), timeout=120))
    flags = main_flags()
    assert {"batch_size", "gradient_accumulation_steps", "max_grad_norm", "resume", "tracker"} <= set(flags)
    for flag in flags:
        # fire shows each flag with the description its Args entry in main's docstring gives
        assert re.search(rf"--{flag}=\S+\n(\s+(Type|Default): .*\n)+\s+\w", proc.output), flag


def test_indivisible_global_batch_is_one_error_line(tmp_path):
    args = ["--batch_size", "10", "--gradient_accumulation_steps", "4", "--tracker", "none"]
    proc = run([PYTHON, STARTER, *args, "--output_dir", tmp_path / "out"], recipe_env(tmp_path), timeout=120)
    fails_with(proc, "--batch_size 10", "multiple of 4")
