"""--compile: a CIFAR run compiled with torch.compile saves models that --predict and --eval_only
load, and checkpoints that resume without compiling, as an uncompiled run's resume with it.

One compiled run serves every test; the resumes continue from its checkpoints (and from a checkpoint
of a resume). They compile with the aot_eager backend: the same compiled wrapper (`_orig_mod.`
names, the graph breaks, the recompiles of a resume) without inductor's code generation, which took
about 100 s of a loaded 2-core CPU per run (inductor's kernels are what gpu-check runs on a GPU).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from cifar_data import synthetic_images
from conftest import CIFAR_SCRIPT, PYTHON, TINY, check, losses, read_results, recipe_env, run
from PIL import Image
from safetensors.torch import load_file

from accelerate_recipes.checkpoints import step_of

# every compiled run compiles the model anew, on a loaded CPU too
pytestmark = pytest.mark.timeout(1500)

# TINY for 4 steps, a checkpoint at step 2: 10 steps make an epoch, so step 2 is mid-epoch and step
# 4 ends the run.
FLAGS = [*TINY, "--checkpoint_every", "2", "--compile_backend", "aot_eager"]
FLAGS[FLAGS.index("--max_steps") + 1] = "4"
# the test split --dataset synthetic generates: 160 // 5 images, from --seed 42 + 1
TEST_IMAGES, TEST_SEED = 32, 43


@pytest.fixture(scope="module")
def compiled(module_tmp):
    tmp = module_tmp.mktemp("compiled")
    check(
        run(
            [PYTHON, CIFAR_SCRIPT, *FLAGS, "--compile", "--output_dir", tmp / "out"],
            recipe_env(tmp),
            timeout=1200,
        )
    )
    return tmp / "out"


def resume(source: Path, step: int, output_dir: Path, *flags) -> str:
    """Continue a copy of the run in `source` from its checkpoint at `step` with `--resume auto`;
    its output."""
    shutil.copytree(source, output_dir)
    for folder in (output_dir / "checkpoints").iterdir():
        if step_of(folder) > step:
            shutil.rmtree(folder)
    proc = check(
        run(
            [PYTHON, CIFAR_SCRIPT, *FLAGS, *flags, "--resume", "auto", "--output_dir", output_dir],
            recipe_env(output_dir.parent),
            timeout=1200,
        )
    )
    return proc.output


def assert_close_weights(a: Path, b: Path) -> None:
    """The same weights up to float rounding: compiled kernels add in another order than eager
    ones."""
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_a_compiled_run_saves_weights_under_the_models_own_names(compiled):
    results = read_results(compiled)
    assert results["compile"] is True and results["steps"] == 4
    # what it compiled: the training graph and the
    # evaluation's, each counted with its seconds; no fallback
    assert (
        results["compile_graphs"] >= 2
        and results["compile_seconds"] > 0
        and results["compile_fallback"] is None
    )
    # what load_trained_model rebuilds: torchvision's resnet18
    # (the CIFAR stem keeps its names), no `_orig_mod.`
    names = set(torchvision.models.resnet18(num_classes=10).state_dict())
    for folder in (compiled, compiled / "model_best", compiled / "checkpoints" / "step_00000002"):
        assert set(load_file(str(folder / "model.safetensors"))) == names, folder


def test_predict_and_eval_only_load_the_compiled_runs_models(compiled, tmp_path):
    images, labels = synthetic_images(TEST_IMAGES, num_classes=10, seed=TEST_SEED)
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = tmp_path / "test" / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i}.png")
    trained = read_results(compiled)
    # one evaluation in the run: model_best is the model of that evaluation, as the last one is
    assert trained["best_epoch"] == 1 and trained["best_metric"] == trained["eval_accuracy"]
    env = recipe_env(tmp_path)
    # Both modes load a folder through the same load_trained_model, and the run's two model folders
    # hold the same names (the test above): --predict reads the last model, --eval_only model_best.
    proc = check(
        run([PYTHON, CIFAR_SCRIPT, "--predict", tmp_path / "test", "--model", compiled], env, timeout=300)
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    correct = sum(row["label"] == Path(row["image"]).parent.name for row in rows)
    assert len(rows) == TEST_IMAGES
    assert correct / TEST_IMAGES == pytest.approx(trained["eval_accuracy"], abs=1.5 / TEST_IMAGES)
    # the test split evaluated again, without compiling:
    # the loss and accuracy the compiled run recorded
    best = compiled / "model_best"
    check(
        run(
            [PYTHON, CIFAR_SCRIPT, "--eval_only", "--model", best, *TINY, "--output_dir", tmp_path / "best"],
            env,
            timeout=300,
        )
    )
    evaluation = read_results(tmp_path / "best")
    assert evaluation["eval_samples"] == TEST_IMAGES and evaluation["model_dir"] == str(best)
    assert evaluation["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-4)
    assert evaluation["eval_accuracy"] == trained["eval_accuracy"]


def test_checkpoints_resume_with_and_without_compile(compiled, tmp_path):
    # the compiled run's mid-epoch checkpoint, continued
    # without --compile: the same last two steps and weights
    plain, again = tmp_path / "plain", tmp_path / "again"
    output = resume(compiled, 2, plain, "--checkpoint_every", "1")
    assert f"resumed from {plain / 'checkpoints' / 'step_00000002'}" in output
    assert read_results(plain)["compile"] is False and read_results(plain)["steps"] == 4
    assert read_results(plain)["compile_graphs"] == 0  # nothing compiled
    assert list(losses(plain)) == [1, 2, 3, 4]
    assert list(losses(plain).values()) == pytest.approx(list(losses(compiled).values()), rel=1e-3)
    assert_close_weights(plain, compiled)
    # and the uncompiled checkpoint that run wrote at step 3, continued with --compile: its last
    # step and weights
    output = resume(plain, 3, again, "--compile")
    assert f"resumed from {again / 'checkpoints' / 'step_00000003'}" in output
    assert read_results(again)["compile"] is True and read_results(again)["steps"] == 4
    assert list(losses(again).values()) == pytest.approx(list(losses(plain).values()), rel=1e-3)
    assert_close_weights(again, plain)
