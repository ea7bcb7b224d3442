"""The text-classification starter: one file of public packages that trains exactly like the full
recipe.

Its per-step training losses must equal recipes/text_classification.py's (conftest's text_one and
text_two, the same flags, seed and data) on 1 process and on 2 gloo processes. The tiny BERT keeps
its dropout: the starter draws its random numbers in the full recipe's order (set_seed before the
model, the shuffle on a generator of its own, one evaluation per epoch), so the masks match too.
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
    TEXT_RUN,
    assert_public_imports_only,
    check,
    fails_with,
    free_port,
    losses,
    read_metrics,
    recipe_env,
    run,
    text_files,
    without_library,
)
from transformers import AutoModelForSequenceClassification

STARTER = REPO / "recipes" / "starters" / "text_classification.py"
STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+) lr ")
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+: accuracy ([\d.]+) on (\d+) examples$", re.MULTILINE)
TOLERANCE = 1e-5


def starter_env(tmp: Path, **extra) -> dict:
    """A user's environment without this project: the repository on no import path, and its library
    (installed in this checkout's environment) shadowed by a package that refuses to be imported."""
    return recipe_env(tmp, PYTHONPATH=without_library(tmp), **extra)


def printed_losses(stdout: str) -> dict[int, float]:
    """{step: loss} from the starter's `step 4/32 loss 0.6934717 lr 0.002897` lines."""
    found = {}
    for line in stdout.splitlines():
        match = STEP_LINE.match(line)
        if match:
            found[int(match[1])] = float(match[3])
    return found


def assert_same_losses(full: dict[int, float], starter: dict[int, float]) -> None:
    assert full and starter.keys() == full.keys(), (sorted(full), sorted(starter))
    # the loss moves: a real run to compare, not a constant
    assert len(set(full.values())) > 3, full
    gaps = {step: abs(starter[step] - full[step]) for step in full}
    assert max(gaps.values()) <= TOLERANCE, {step: (full[step], starter[step]) for step in full}


def assert_same_evaluation(full_out: Path, stdout: str) -> None:
    """Each epoch's accuracy printed by the starter is the full recipe's, over all 63 validation
    examples."""
    full = [m["eval/accuracy"] for m in read_metrics(full_out) if "eval/accuracy" in m]
    epochs = [
        (int(epoch), float(accuracy), int(seen)) for epoch, accuracy, seen in EPOCH_LINE.findall(stdout)
    ]
    assert [(epoch, seen) for epoch, _, seen in epochs] == [(1, 63), (2, 63)], stdout[-3000:]
    assert [accuracy for _, accuracy, _ in epochs] == [round(value, 4) for value in full]
    assert epochs[-1][1] >= 0.8  # chance is 0.5


def starter_flags(text_data, *drop: str) -> list:
    """text_one's flags (the files and TEXT_RUN), less the flags named in `drop` and their
    values."""
    flags = [*text_files(text_data), *TEXT_RUN]
    kept = []
    for i, item in enumerate(flags):
        if item in drop or (i and flags[i - 1] in drop):
            continue
        kept.append(item)
    return kept


@pytest.fixture(scope="module")
def starter_one(text_data, module_tmp):
    """The starter on 1 process with text_one's flags, except that it tracks: its default, SwanLab,
    with no login here, so offline."""
    tmp = module_tmp.mktemp("starter-text-one")
    cmd = [PYTHON, STARTER, *starter_flags(text_data, "--tracker"), "--output_dir", tmp / "out"]
    proc = check(run(cmd, starter_env(tmp), cwd=tmp))
    return SimpleNamespace(out=tmp / "out", proc=proc, losses=printed_losses(proc.stdout))


@pytest.fixture(scope="module")
def starter_two(text_data, module_tmp):
    """Only the starter copied into an empty folder, launched from there on 2 gloo processes with
    text_two's flags."""
    tmp = module_tmp.mktemp("starter-text-two")
    folder = tmp / "my_project"
    folder.mkdir()
    shutil.copy(STARTER, folder / STARTER.name)
    cmd = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", 2]
    cmd += ["--num_cpu_threads_per_process", 1, "--main_process_port", free_port(), STARTER.name]
    cmd += [*starter_flags(text_data), "--output_dir", "out"]
    proc = check(run(cmd, starter_env(tmp, ACCELERATE_USE_CPU="true"), cwd=folder))
    return SimpleNamespace(out=folder / "out", proc=proc, losses=printed_losses(proc.stdout), folder=folder)


def main_arguments() -> dict[str, str]:
    """{flag: its description in main's docstring} for every argument of the starter's main()."""
    tree = ast.parse(STARTER.read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    documented = dict(re.findall(r"^ {4}(\w+): (.+)$", ast.get_docstring(main), flags=re.MULTILINE))
    return {arg.arg: documented.get(arg.arg, "") for arg in main.args.args}


def test_imports_only_public_packages():
    imported = assert_public_imports_only(STARTER)
    assert {"accelerate", "torch", "transformers", "datasets", "fire"} <= imported


def test_help_explains_every_flag(tmp_path):
    flags = main_arguments()
    assert len(flags) >= 20 and all(flags.values()), [name for name, text in flags.items() if not text]
    proc = check(run([PYTHON, STARTER, "--help"], starter_env(tmp_path), cwd=tmp_path))
    # fire writes its help to stderr when that is not a terminal
    text = " ".join(proc.output.split())
    for name, description in flags.items():
        assert f"--{name}" in text, name
        assert " ".join(description.split()[:6]) in text, (name, description)


def test_an_indivisible_global_batch_stops_with_one_error_line(text_data, tmp_path):
    cmd = [PYTHON, STARTER, *starter_flags(text_data), "--batch_size", 15, "--gradient_accumulation_steps", 2]
    proc = run([*cmd, "--output_dir", tmp_path / "out"], starter_env(tmp_path), cwd=tmp_path)
    fails_with(proc, "--batch_size 15", "1 process(es) x 2 accumulation step(s)", "multiple of 2")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_one_process_losses_equal_the_full_recipes(text_one, starter_one):
    assert_same_losses(losses(text_one.out), starter_one.losses)
    assert "global batch 16 = 1 process(es) x 1 micro-batch(es) x 16 examples" in starter_one.proc.stdout
    # It learned as the full recipe did, evaluated every validation example once, and saved a model
    # that from_pretrained reads with its labels.
    assert_same_evaluation(text_one.out, starter_one.proc.stdout)
    model = AutoModelForSequenceClassification.from_pretrained(starter_one.out)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert (starter_one.out / "tokenizer.json").is_file()
    # Checkpoints at the epoch ends; SwanLab, asked for by
    # default and without a login, wrote its run offline.
    assert sorted(p.name for p in (starter_one.out / "checkpoints").iterdir()) == ["step_16", "step_32"]
    assert list((starter_one.out / "swanlog").glob("run-*/run-*.swanlab"))


def test_two_process_losses_equal_the_full_recipes_from_an_empty_folder(text_two, starter_two):
    assert_same_losses(losses(text_two.out), starter_two.losses)
    stdout = starter_two.proc.stdout
    assert "global batch 16 = 2 process(es) x 1 micro-batch(es) x 8 examples" in stdout
    assert stdout.count("step 32/32 loss") == 1  # the main process prints, the other does not
    # 63 validation examples on 2 processes: the one the sampler repeats is counted once.
    assert_same_evaluation(text_two.out, stdout)
    assert AutoModelForSequenceClassification.from_pretrained(starter_two.out).config.num_labels == 2
    assert sorted(p.name for p in starter_two.folder.iterdir()) == ["out", STARTER.name]
