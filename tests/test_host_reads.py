"""The host-read audit: the recipes read no tensor value on the host between log steps, and the
audit sees reads."""

import json
import textwrap

import pytest
from conftest import (
    AUDIT,
    PYTHON,
    TEXT_SCRIPT,
    assert_both_ranks_quiet,
    assert_quiet,
    check,
    fails_with,
    recipe_env,
    run,
    text_files,
)

# Six optimizer steps inside one epoch; logs only at
# steps 1 and 6, checkpoints only at the epoch end.
QUIET = [
    "--max_steps",
    "6",
    "--log_every",
    "1000",
    "--checkpoint_every",
    "0",
    "--tracker",
    "none",
    "--num_workers",
    "0",
]


def audited(out) -> dict:
    return json.loads((out / "host_reads.json").read_text())


# The shared runs' audits are checked where those runs are made, so that no worker makes a run only
# for this file: cifar_one / cifar_two in test_cifar_training.py, text_one / text_two in
# test_text_classification.py, detect_one in test_detect_training.py. detect_two (the copied detect/
# folder) is read here and in test_template.py.
def test_detector_loop_reads_nothing_between_log_steps_on_two_processes(detect_two):
    # 6 steps inside one epoch on 2 processes, logged at steps 1 and 6 only
    assert_both_ranks_quiet(detect_two, steps=6, log_every=1000)


# accelerate builds its fp16 GradScaler and autocast only off the CPU (there it runs fp16 as fp32,
# with no scaler). This launcher gives the Accelerator what it builds on a GPU, with torch's CPU
# GradScaler, then runs the recipe.
FP16_WITH_SCALER = """
import os
import runpy
import sys

import accelerate
import torch


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.mixed_precision == "fp16" and self.scaler is None, (self.mixed_precision, self.scaler)
        self.native_amp, self.scaler = True, torch.amp.GradScaler(self.device.type)


accelerate.Accelerator = Accelerator
sys.argv = [os.path.abspath(sys.argv[1]), *sys.argv[2:]]  # the recipe and its flags
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_fp16_grad_scaler_read_is_reported_once_per_step_as_expected(text_data, tmp_path):
    """Under fp16 the GradScaler reads found_inf in every optimizer step: counted apart, named, and
    not a failure."""
    launcher = tmp_path / "fp16_with_scaler.py"
    launcher.write_text(FP16_WITH_SCALER)
    out = tmp_path / "out"
    proc = run(
        [
            PYTHON,
            AUDIT,
            launcher,
            TEXT_SCRIPT,
            *text_files(text_data),
            "--batch_size",
            16,
            "--mixed_precision",
            "fp16",
            *QUIET,
            "--output_dir",
            out,
        ],
        recipe_env(tmp_path),
        timeout=300,
    )
    report = audited(out)
    assert_quiet(report, proc, steps=6, log_every=1000)
    # Step k + 1 reads found_inf inside optimizer.step, before the step counter moves: one read in
    # each interval 0-5.
    assert [i["grad_scaler_reads"] for i in report["intervals"]] == [1, 1, 1, 1, 1, 1, 0]
    assert report["grad_scaler_reads"] == 6 and report["grad_scaler_reads_per_step"] == 1.0
    (scaler,) = [s for s in report["sites"] if s["kind"] == "grad_scaler"]
    assert scaler["op"] == "item" and scaler["via"].startswith("torch/amp/grad_scaler.py:"), scaler
    assert scaler["site"].startswith("recipes/text_classification.py:") and not scaler["fails"], scaler
    assert "skip optimizer.step" in scaler["note"]
    assert "expected under fp16: 6 GradScaler read(s) of found_inf, 1 per optimizer step" in proc.stdout
    assert "on quiet steps:" not in proc.stdout


# A loop that reads its loss every step (the classic
# `.item()` in the loop) and reads in its collate function.
LEAKY = """
import torch
from torch.utils.data import DataLoader


def collate(rows):
    assert torch.stack(rows).abs().sum().item() >= 0   # host-side data: not counted
    return torch.stack(rows)


def main(log_every: int = 1000, checkpoint_every: int = 0):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader([torch.randn(4) for _ in range(24)], batch_size=4, collate_fn=collate)
    total = 0.0
    for x in loader:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total += loss.item()                        # LEAK: one read per step
        if x[x > 0].numel() < 0:                    # data-dependent shape
            break


if __name__ == "__main__":
    main()
"""


def test_a_read_in_every_step_is_counted_at_its_line_and_fails_the_run(tmp_path):
    script = tmp_path / "leaky.py"
    script.write_text(textwrap.dedent(LEAKY))
    leak_line = next(i for i, line in enumerate(script.read_text().splitlines(), 1) if "# LEAK" in line)
    out = tmp_path / "reads.json"
    proc = run([PYTHON, AUDIT, "--output", out, script], recipe_env(tmp_path))
    fails_with(proc, "4 host read(s) or sync(s) between log steps", str(out))
    report = json.loads(out.read_text())
    assert report["steps"] == 6 and report["quiet_intervals"] == [2, 3, 4, 5]
    assert [i["reads"] for i in report["intervals"]] == [0, 1, 1, 1, 1, 1, 1]
    assert [i["shape"] for i in report["intervals"]] == [0, 1, 1, 1, 1, 1, 1]
    (leak,) = [s for s in report["sites"] if s["fails"]]
    assert (leak["op"], leak["site"], leak["quiet_count"]) == ("item", f"{script}:{leak_line}", 4), leak
    # the collate function's six reads and the DataLoader's seed
    assert report["excluded"]["data_loading"] >= 6
    # --strict also fails on the boolean-mask index; --allow turns the quiet steps into allowed
    # ones.
    strict = run([PYTHON, AUDIT, "--output", out, "--strict", "True", script], recipe_env(tmp_path))
    fails_with(strict, "8 host read(s)")
    check(run([PYTHON, AUDIT, "--output", out, "--allow", "2,3,4,5", script], recipe_env(tmp_path)))
    assert json.loads(out.read_text())["quiet_violations"] == 0


@pytest.mark.parametrize(
    "args, message", [([], "name the script to audit"), (["missing.py"], "missing.py does not exist")]
)
def test_audit_errors(args, message, tmp_path):
    fails_with(run([PYTHON, AUDIT, *args], recipe_env(tmp_path)), message)
