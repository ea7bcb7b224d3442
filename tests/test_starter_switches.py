"""The chat starters (recipes/starters/sft.py, dpo.py, grpo.py) keep sdpa off cuDNN's kernel on
CUDA, as the full recipes do (chat/model.py's use_sdpa_backends): from torch 2.11 it is torch's
first choice on Hopper GPUs, and its backward is reported to give NaN gradients where a mask leaves
whole query rows masked (left-padded DPO and GRPO rows).

torch's sdpa switches are process-wide and can be set without a GPU, so each starter's main() runs
here, in this process, on an Accelerator that reports a CUDA device (or a CPU one), and stops at its
first check of the flags, a --batch_size that does not split: the switch is set on the starter's own
path, right after the Accelerator is built and before any data or model is loaded; on a CPU nothing
changes.
"""

import functools
import importlib.util

import pytest
import torch
from accelerate import Accelerator
from conftest import REPO

CHAT_STARTERS = ("sft", "dpo", "grpo")
SWITCHES = {  # torch's process-wide switch of each CUDA sdpa kernel: (is it on, turn it on or off)
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "mem_efficient": (
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.enable_mem_efficient_sdp,
    ),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
}


@functools.cache
def load_starter(name: str):
    """The starter as a module of its own name (tests import the full recipes as `sft`, `dpo`,
    `grpo`)."""
    path = REPO / "recipes" / "starters" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_starter_switches", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accelerator_on(device_type: str) -> type[Accelerator]:
    """An Accelerator that reports `device_type` as its device; all else is this machine's (one
    process, no GPU needed): what a starter's main() asks of it before its batch check."""

    class Reporting(Accelerator):
        @property
        def device(self) -> torch.device:
            return torch.device(device_type)

    return Reporting


def switches() -> dict[str, bool]:
    return {name: enabled() for name, (enabled, _) in SWITCHES.items()}


@pytest.fixture
def restored_switches():
    """torch's sdpa switches as they were before the test, whatever it set."""
    before = switches()
    yield before
    for name, (_, enable) in SWITCHES.items():
        enable(before[name])


@pytest.mark.parametrize("cudnn_before", [True, False], ids=["cudnn-on", "cudnn-off"])
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("name", CHAT_STARTERS)
def test_a_chat_starter_turns_cudnn_sdpa_off_on_cuda_right_after_building_its_accelerator(
    name, device_type, cudnn_before, restored_switches, monkeypatch, tmp_path
):
    """main() on a CUDA device: cuDNN's sdpa off once it stops at the batch check (before data and
    model), the other kernels as they were; on a CPU every switch as it was, cuDNN's on or off."""
    starter = load_starter(name)
    monkeypatch.setattr(starter, "Accelerator", accelerator_on(device_type))
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    before = switches()
    missing = str(tmp_path / "not-read.jsonl")  # main() stops before it reads a file
    flags = dict(batch_size=7, gradient_accumulation_steps=2, tracker="none", output_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="--batch_size 7 cannot split"):
        starter.main(train_file=missing, validation_file=missing, **flags)
    expected = before | {"cudnn": False} if device_type == "cuda" else before
    assert switches() == expected, (name, device_type)
