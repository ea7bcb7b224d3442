"""Bad input ends with one line naming the cause and the fix, a non-zero exit, and no traceback."""

import inspect
import re

import pytest
from conftest import CIFAR_SCRIPT, PYTHON, TINY, fails_with, recipe_env, run, write_cifar10

from accelerate_recipes.cli import as_command


def cifar(tmp_path, *args, **env):
    return run(
        [
            PYTHON,
            CIFAR_SCRIPT,
            "--num_workers",
            "0",
            "--tracker",
            "none",
            "--output_dir",
            tmp_path / "out",
            *args,
        ],
        recipe_env(tmp_path, **env),
        timeout=120,
    )


def test_no_cifar_data_offline(tmp_path):
    # A proxy on a closed port makes the download fail at once, as on a machine without internet.
    proc = cifar(
        tmp_path,
        "--data_dir",
        tmp_path / "nothing",
        https_proxy="http://127.0.0.1:9",
        http_proxy="http://127.0.0.1:9",
    )
    fails_with(proc, "cifar-10-python.tar.gz", str(tmp_path / "nothing"), "--dataset synthetic")


def test_no_cifar_data_without_download(tmp_path):
    fails_with(
        cifar(tmp_path, "--dataset", "cifar100", "--data_dir", tmp_path, "--download", "False"),
        "cifar-100-python.tar.gz",
        "--dataset synthetic",
    )


def test_corrupt_cifar_file_is_named(tmp_path):
    data = write_cifar10(tmp_path / "data", num_train=50, num_test=10)
    batch = data / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(batch.read_bytes()[:100])  # a truncated copy
    fails_with(cifar(tmp_path, "--data_dir", data, "--download", "False"), "not found or corrupt")
    # Without checksums the truncated pickle is still reported, not a traceback.
    fails_with(
        cifar(tmp_path, "--data_dir", data, "--download", "False", "--verify_data", "False"), "corrupt"
    )


def test_missing_imagefolder_split(tmp_path):
    (tmp_path / "imgs" / "train" / "cat").mkdir(parents=True)
    fails_with(
        cifar(tmp_path, "--dataset", "imagefolder", "--data_dir", tmp_path / "imgs"), "val", "does not exist"
    )


def test_global_batch_that_does_not_divide(tmp_path):
    fails_with(
        cifar(
            tmp_path,
            "--dataset",
            "synthetic",
            "--synthetic_size",
            "64",
            "--batch_size",
            "30",
            "--gradient_accumulation_steps",
            "4",
        ),
        "--batch_size 30",
        "multiple of 4",
    )


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--tracker", "nonsense"], ["unknown tracker", "swanlab"]),
        (
            ["--tracker", "swanlab", "--swanlab_mode", "cloud"],
            ["swanlab login", "SWANLAB_API_KEY", "offline"],
        ),
        (["--dataset", "mnist"], ["unknown --dataset", "synthetic"]),
        (["--arch", "vgg11"], ["--arch", "vgg11", "resnet18"]),
        # --model is a finished run's folder (--predict, --eval_only), not the network
        (["--model", "resnet34"], ["--model is a finished run's folder", "--arch"]),
        # accelerate would train it in fp32 on the CPU while results.json says fp16
        (["--mixed_precision", "fp16"], ["--mixed_precision fp16 is not applied on cpu", "fp32"]),
    ],
)
def test_bad_options(tmp_path, args, fragments):
    fails_with(cifar(tmp_path, *TINY[:-6], *args), *fragments)


def test_help_explains_every_flag(tmp_path):
    proc = run([PYTHON, CIFAR_SCRIPT, "--help"], recipe_env(tmp_path, PAGER="cat"))
    assert proc.returncode == 0, proc.output
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("cifar_recipe", CIFAR_SCRIPT)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    command = as_command(module.main)  # the flags of main's dataclass, the shared ones included
    assert len(inspect.signature(command).parameters) > 40
    for name in inspect.signature(command).parameters:
        assert re.search(rf"--{name}\b", proc.output), f"--{name} missing from --help"
        assert re.search(rf"^\s+{name}:\s+\S", command.__doc__, re.M), f"{name} has no description"
