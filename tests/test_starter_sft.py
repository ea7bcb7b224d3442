"""The chat fine-tuning starter (recipes/starters/sft.py) held to the full recipe (recipes/sft.py):
with the flags, seed and data of the shared run sft_one, its per-step training losses, learning
rates, evaluation losses and adapter equal the full recipe's on 1 process and on 2 gloo processes on
two "nodes" on 127.0.0.1; it imports public packages only and runs from an empty folder.

The full recipe's own 1 vs 2 processes equality (padded vs packed rows) is asserted in
tests/test_sft.py, so sft_one is the reference for both starter runs.
"""

import ast
import os
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from conftest import (
    ACCELERATE,
    CONFIGS,
    PYTHON,
    REPO,
    SFT_RUN,
    assert_public_imports_only,
    check,
    fails_with,
    free_port,
    losses,
    read_metrics,
    recipe_env,
    run,
    sft_files,
    time_limit,
    without_library,
)
from safetensors.torch import load_file

STARTER = REPO / "recipes" / "starters" / "sft.py"
# Flags of SFT_RUN the starter does not have: none of them changes a number the training computes.
NOT_IN_STARTER = {"--eval_generate", "--max_new_tokens", "--num_workers"}
STEP_LINE = re.compile(r"^step (\d+)/24 loss (\S+) lr (\S+)$", re.MULTILINE)
EVAL_LINE = re.compile(r"^epoch \d+ eval_loss (\S+) ", re.MULTILINE)
ADAPTER = "adapter_model.safetensors"


def starter_main() -> ast.FunctionDef:
    tree = ast.parse(STARTER.read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")


def starter_args(*left_out: str) -> list[str]:
    """SFT_RUN as the starter takes it: the flags it lacks must be ones that change no training
    number."""
    flags = {f"--{arg.arg}" for arg in starter_main().args.args}
    pairs = list(zip(SFT_RUN[::2], SFT_RUN[1::2]))
    assert all(flag.startswith("--") and not value.startswith("--") for flag, value in pairs), SFT_RUN
    missing = {flag for flag, _ in pairs if flag not in flags}
    assert missing <= NOT_IN_STARTER, (
        f"SFT_RUN trains with {missing - NOT_IN_STARTER}, which the starter lacks"
    )
    return [item for flag, value in pairs if flag in flags and flag not in left_out for item in (flag, value)]


@pytest.fixture(scope="module")
def starter_one(tiny_chat_model, sft_data, module_tmp):
    """The starter with plain python on 1 process, with sft_one's flags."""
    tmp = module_tmp.mktemp("starter-sft-one")
    out = tmp / "out"
    args = [*sft_files(tiny_chat_model, sft_data), *starter_args(), "--output_dir", out]
    return SimpleNamespace(proc=check(run([PYTHON, STARTER, *args], recipe_env(tmp))), out=out)


@pytest.fixture(scope="module")
def starter_two(tiny_chat_model, sft_data, module_tmp):
    """The starter alone copied into an empty folder and launched there as two nodes would run it:
    2node.yaml on 127.0.0.1, one process per "node", machine ranks 0 and 1, with sft_one's flags but
    the default tracker (SwanLab, offline without a login). PYTHONPATH holds only a folder whose
    accelerate_recipes refuses to import: the repository's library, also installed in this
    environment, is out of reach."""
    tmp = module_tmp.mktemp("starter-sft-two")
    folder = tmp / "my_project"
    folder.mkdir()
    shutil.copy(STARTER, folder / "sft.py")
    env = recipe_env(tmp, ACCELERATE_USE_CPU="true", PYTHONPATH=without_library(tmp))
    port = free_port()
    args = [*sft_files(tiny_chat_model, sft_data), *starter_args("--tracker"), "--output_dir", "out"]
    nodes = []
    for rank in (0, 1):
        # 2 processes in all; fp32 as sft_one (2node.yaml
        # asks for bf16, which a CPU may only emulate)
        launch = [ACCELERATE, "launch", "--config_file", CONFIGS / "2node.yaml", "--num_processes", 2]
        launch += ["--machine_rank", rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        launch += ["--num_cpu_threads_per_process", 1, "--mixed_precision", "no", "sft.py", *args]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        nodes.append(subprocess.Popen([str(c) for c in launch], env=env, cwd=folder, **pipes))
    try:
        outputs = [node.communicate(timeout=time_limit(300)) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, (stdout + stderr)[-3000:]
    return SimpleNamespace(proc=SimpleNamespace(stdout=outputs[0][0]), out=folder / "out", folder=folder)


def test_per_step_losses_equal_the_full_recipe_on_one_and_two_processes(sft_one, starter_one, starter_two):
    """Every step logged: the starter's loss (the mean over the global batch's answer tokens) within
    1e-5 of the full recipe's, the same learning rate (warm-up, then linear decay), the same
    evaluation loss each epoch and the same adapter at the end."""
    metrics = read_metrics(sft_one.out)
    reference, lrs = losses(sft_one.out), {m["step"]: m["train/lr"] for m in metrics if "train/lr" in m}
    eval_losses = [m["eval/loss"] for m in metrics if "eval/loss" in m]
    assert sorted(reference) == list(range(1, 25)) and len(eval_losses) == 2
    expected = load_file(str(sft_one.out / ADAPTER))
    for starter, world in ((starter_one, 1), (starter_two, 2)):
        proc = starter.proc
        assert f"global batch 8 = {world} process(es) x 1 micro-batch(es) x {8 // world}" in proc.stdout
        printed = {int(step): (float(loss), float(lr)) for step, loss, lr in STEP_LINE.findall(proc.stdout)}
        assert printed.keys() == reference.keys(), proc.stdout[-3000:]
        worst = max(abs(printed[step][0] - reference[step]) for step in reference)
        assert worst <= 1e-5, (
            f"{world} process(es): per-step losses differ from the full recipe's by up to {worst}"
        )
        assert [printed[step][1] for step in sorted(lrs)] == pytest.approx(
            [lrs[s] for s in sorted(lrs)], rel=1e-6
        )
        assert [float(x) for x in EVAL_LINE.findall(proc.stdout)] == pytest.approx(eval_losses, abs=1e-5)
        adapter = load_file(str(starter.out / ADAPTER))
        assert adapter.keys() == expected.keys()
        assert max((adapter[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5


def test_the_starter_ran_from_an_empty_folder_and_saved_everything(starter_two):
    """2 processes from a folder holding only the starter: adapter, tokenizer, the checkpoints of
    both epoch ends, and the SwanLab run written offline, with the training loss in it."""
    assert sorted(os.listdir(starter_two.folder)) == ["out", "sft.py"]
    out = starter_two.out
    for name in (ADAPTER, "adapter_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert sorted(os.listdir(out / "checkpoints")) == ["step_12", "step_24"]
    (swanlab_run,) = (out / "swanlog").glob("run-*")
    assert b"train/loss" in next(swanlab_run.glob("run-*.swanlab")).read_bytes()


def test_the_starter_imports_public_packages_only():
    imported = assert_public_imports_only(STARTER)
    assert {"accelerate", "torch", "transformers", "datasets", "peft", "fire"} <= imported


def test_help_explains_every_flag(tmp_path):
    main = starter_main()
    documented = dict(re.findall(r"^ {4}(\w+): (.+)$", ast.get_docstring(main), re.MULTILINE))
    flags = [arg.arg for arg in main.args.args]
    assert sorted(documented) == sorted(flags), "the docstring's Args must document every flag of main()"
    proc = check(run([PYTHON, STARTER, "--help"], recipe_env(tmp_path)))
    for flag in flags:
        assert f"--{flag}" in proc.output, flag
        assert documented[flag][:50] in proc.output, flag


def test_a_batch_that_does_not_split_is_a_one_line_error(tiny_chat_model, sft_data, tmp_path):
    args = [*sft_files(tiny_chat_model, sft_data), "--tracker", "none", "--output_dir", tmp_path / "out"]
    proc = run(
        [PYTHON, STARTER, *args, "--batch_size", "7", "--gradient_accumulation_steps", "2"],
        recipe_env(tmp_path),
    )
    fails_with(proc, "--batch_size 7", "multiple of 2")
