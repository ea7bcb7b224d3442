"""Checkpoints and resume for every recipe: a run killed anywhere continues to the same weights, bit
for bit on CPU.

Each run is a real subprocess, killed for real (SIGKILL, SIGTERM) once a checkpoint has appeared on
disk. The two killed runs whose reference is a shared session run sit in the file that makes that
run anyway: the text recipe's SIGKILL test in test_text_classification.py (text_one), the 2-process
run with a rank killed in test_cifar_training.py (cifar_two).
"""

import json
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    ACCELERATE,
    CIFAR_SCRIPT,
    CONFIGS,
    NO_PLOTS,
    PYTHON,
    REPO,
    assert_same_best,
    assert_same_weights,
    check,
    fails_with,
    free_port,
    read_metrics,
    read_results,
    recipe_env,
    run,
    saved_weights,
    sigkill_mid_epoch_then_resume,
    time_limit,
    wait_for_checkpoint,
)
from conftest import start_in_own_session as start
from synthetic_shapes import write_synthetic_dataset

from accelerate_recipes import PREEMPTED_EXIT_CODE
from accelerate_recipes.checkpoints import is_complete

DETECT_SCRIPT = REPO / "recipes" / "detect" / "train.py"
COMMON = ["--tracker", "none", "--num_workers", "0", "--log_every", "1", *NO_PLOTS]
# Two epochs, a checkpoint every 2 steps: a kill lands mid-epoch with several checkpoints behind it.
CIFAR = [
    CIFAR_SCRIPT,
    "--dataset",
    "synthetic",
    "--synthetic_size",
    "48",
    "--batch_size",
    "8",
    "--epochs",
    "2",
    "--checkpoint_every",
    "2",
    *COMMON,
]  # 6 steps per epoch


@pytest.fixture(scope="module")
def data(module_tmp):
    root = module_tmp.mktemp("resume-data")
    shapes = write_synthetic_dataset(root / "shapes", num_train=48, num_val=9, image_size=96, seed=3)
    return {"shapes": shapes}


def recipe_command(name: str, data: dict) -> list:
    if name == "cifar":
        return CIFAR
    # detect: 6 steps per epoch, EMA weights, mosaic augmentation in epochs 1 and 2 and off in epoch
    # 3 (--close_mosaic 1): a run killed in epoch 2 resumes with mosaic and turns it off where the
    # uninterrupted run did
    return [
        DETECT_SCRIPT,
        "--data",
        data["shapes"],
        "--image_size",
        "96",
        "--batch_size",
        "8",
        "--epochs",
        "3",
        "--close_mosaic",
        "1",
        "--checkpoint_every",
        "2",
        *COMMON,
    ]


def weights(output_dir: Path) -> dict:
    return saved_weights(output_dir)


@pytest.fixture(scope="module")
def uninterrupted(data, module_tmp):
    """The reference: each recipe run start to finish with the same flags. The text recipe's SIGKILL
    test, whose reference is the shared text_one run, is test_text_classification.py's (where
    text_one is made anyway)."""
    outputs = {}

    def get(name: str) -> Path:
        if name not in outputs:
            tmp = module_tmp.mktemp(f"reference-{name}")
            check(
                run(
                    [PYTHON, *recipe_command(name, data), "--output_dir", tmp / "out"],
                    recipe_env(tmp),
                    timeout=400,
                )
            )
            outputs[name] = tmp / "out"
        return outputs[name]

    return get


@pytest.mark.parametrize("name, kill_after", [("cifar", 8), ("detect", 8)])
def test_sigkill_mid_epoch_then_resume_auto_ends_with_the_same_weights(
    name, kill_after, data, uninterrupted, tmp_path
):
    sigkill_mid_epoch_then_resume(recipe_command(name, data), kill_after, uninterrupted(name), tmp_path)


def swanlab_scalars(run_file: Path) -> dict[tuple[str, int], float]:
    """(key, step) -> value of every scalar an offline SwanLab run file holds."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader, logged = DataStoreReader(), {}
    reader.open(str(run_file))
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            logged[(record.scalar.key, record.scalar.step)] = record.scalar.value.number
    return logged


def swanlab_images(run_file: Path) -> dict[tuple[str, int], list[Path]]:
    """(key, step) -> the picture files of every image an offline SwanLab run holds (in its media/
    folder)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader, logged = DataStoreReader(), {}
    reader.open(str(run_file))
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("media"):
            folder = run_file.parent / "media" / "image"
            files = [folder / item.filename for item in record.media.value.items]
            logged[(record.media.key, record.media.step)] = files
    return logged


def test_sigterm_saves_a_checkpoint_exits_75_and_resume_continues(uninterrupted, tmp_path):
    """Preempted (SIGTERM) and resumed with --resume auto: the weights of the uninterrupted run, and
    one SwanLab experiment (offline here: one folder per start, both of the same run id, which
    `swanlab sync` uploads as one) holding the curve before the stop and after the resume, each step
    once."""
    out, log = tmp_path / "out", tmp_path / "stopped.log"
    env = recipe_env(tmp_path)
    # epoch ends only: the SIGTERM save is the one mid-epoch
    stopping = [PYTHON, *CIFAR, "--checkpoint_every", "0"]
    stopping += ["--tracker", "swanlab", "--swanlab_mode", "offline"]
    proc = start([*stopping, "--output_dir", out], env, log)
    wait_for_checkpoint(proc, out, 6, log)  # the end of epoch 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=time_limit(120)) == PREEMPTED_EXIT_CODE, log.read_text()[-3000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[-1] > "step_00000006", saved  # a new checkpoint, after the epoch-end one
    stop_line = [line for line in log.read_text().splitlines() if line.startswith("stopped:")]
    assert stop_line and "SIGTERM at step" in stop_line[0] and "--resume auto" in stop_line[0]

    resumed = check(run([*stopping, "--output_dir", out, "--resume", "auto"], env, timeout=400))
    assert read_results(out)["resumed_from"].endswith(saved[-1])
    assert_same_weights(out, uninterrupted("cifar"))
    assert_same_best(out, uninterrupted("cifar"))

    run_id = json.loads((out / "tracker_run.json").read_text())["id"]
    parts = sorted((out / "swanlog").glob("run-*/run-*.swanlab"))
    assert len(parts) == 2 and all(part.name == f"run-{run_id}.swanlab" for part in parts), parts
    assert f"run {run_id} saved in 2 parts" in resumed.stdout and f"run-*-{run_id}" in resumed.stdout
    halves = [swanlab_scalars(part) for part in parts]
    steps = [sorted(step for key, step in half if key == "train/loss") for half in halves]
    stopped_at = int(saved[-1].removeprefix("step_"))
    assert steps[0][-1] >= stopped_at and steps[1][0] == stopped_at + 1 and steps[1][-1] == 12, steps
    logged = {**halves[0], **halves[1]}  # the resumed half rewrites nothing the first half logged
    expected = {(k, m["step"]): m[k] for m in read_metrics(out) for k in ("train/loss",) if k in m}
    assert sorted(expected) == sorted(k for k in logged if k[0] == "train/loss")
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key


def test_half_written_checkpoints_are_skipped_and_cleared(uninterrupted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(uninterrupted("cifar"), out)
    checkpoints = out / "checkpoints"
    newest_complete = sorted(checkpoints.iterdir())[-1]
    # A crash inside save_state leaves a `.partial` folder; a
    # folder without checkpoint.json is no checkpoint either.
    shutil.copytree(newest_complete, checkpoints / "step_00000013.partial")
    (checkpoints / "step_00000013.partial" / "checkpoint.json").unlink()
    shutil.copytree(newest_complete, checkpoints / "step_00000014")
    (checkpoints / "step_00000014" / "checkpoint.json").unlink()
    (checkpoints / "step_00000014" / "model.safetensors").write_bytes(b"cut short")

    proc = check(
        run([PYTHON, *CIFAR, "--output_dir", out, "--resume", "auto"], recipe_env(tmp_path), timeout=300)
    )
    assert f"resumed from {newest_complete}" in proc.stdout
    assert read_results(out)["resumed_from"] == str(newest_complete)
    assert (
        not (checkpoints / "step_00000013.partial").exists() and not (checkpoints / "step_00000014").exists()
    )


def test_nonfinite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # A learning rate of 1e12 sends the loss to inf/NaN at the second step.
    exploding = [
        PYTHON,
        *CIFAR,
        "--max_steps",
        "6",
        "--checkpoint_every",
        "1",
        "--lr",
        "1e12",
        "--warmup_ratio",
        "0",
    ]
    out = tmp_path / "out"
    error = fails_with(
        run([*exploding, "--output_dir", out], recipe_env(tmp_path), timeout=300),
        "the loss is not finite",
        "at step 2",
        "--skip_nonfinite_steps",
    )
    good = out / "checkpoints" / "step_00000001"
    assert str(good) in error
    assert [p.name for p in (out / "checkpoints").iterdir()] == [good.name]
    assert all(torch.isfinite(t).all() for t in weights(good).values())

    skipping = tmp_path / "skipping"
    proc = run(
        [*exploding, "--output_dir", skipping, "--skip_nonfinite_steps"], recipe_env(tmp_path), timeout=300
    )
    # The steps after the first are skipped, and no non-finite update reaches the weights; but their
    # forward passes filled BatchNorm's running statistics (not gradient updates) with NaN, so the
    # model predicts NaN: its evaluation stops the run
    # instead of saving it with a results.json that says so.
    newest = sorted((skipping / "checkpoints").iterdir())[-1]
    fails_with(proc, "the evaluation at step 6 gave eval_loss nan", f"the newest checkpoint is {newest}")
    assert "its update is skipped" in proc.stdout and not (skipping / "results.json").exists()
    trained = {k: t for k, t in weights(newest).items() if "running_" not in k}
    assert trained and all(torch.isfinite(t).all() for t in trained.values())


def test_keep_checkpoints_rotates_and_a_second_fresh_start_is_refused(uninterrupted, tmp_path):
    reference = uninterrupted("cifar")
    saved = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert saved == ["step_00000010", "step_00000012"]  # the newest two of 12 steps
    progress = json.loads((reference / "checkpoints" / saved[-1] / "checkpoint.json").read_text())
    assert (progress["step"], progress["epoch"], progress["batches_done"]) == (12, 2, 0)

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = (out / "results.json").read_bytes()
    fails_with(
        run([PYTHON, *CIFAR, "--output_dir", out], recipe_env(tmp_path), timeout=120),
        "holds checkpoints of an earlier run",
        "--resume auto",
        "another --output_dir",
    )
    assert (out / "results.json").read_bytes() == before  # nothing overwritten


@pytest.mark.parametrize("case", ["missing", "incomplete", "other settings", "output not writable"])
def test_bad_resume_and_output_errors(case, uninterrupted, tmp_path):
    reference = uninterrupted("cifar")
    newest = sorted((reference / "checkpoints").iterdir())[-1]
    args, fragments = {
        "missing": (["--resume", tmp_path / "nowhere"], ["nowhere does not exist", "--resume auto"]),
        "incomplete": (["--resume", tmp_path], ["is not a complete checkpoint", "--resume auto"]),
        "other settings": (
            ["--resume", newest, "--batch_size", "32"],
            ["belongs to a run with other settings", "global_batch_size 8 there, 32 now"],
        ),
        "output not writable": (
            ["--output_dir", tmp_path / "a-file" / "out"],
            ["cannot write to --output_dir"],
        ),
    }[case]
    (tmp_path / "a-file").write_text("in the way of a folder")
    out = ["--output_dir", tmp_path / "out"] if case != "output not writable" else []
    fails_with(run([PYTHON, *CIFAR, *out, *args], recipe_env(tmp_path), timeout=120), *fragments)


def test_a_checkpoint_that_cannot_be_written_stops_both_processes_and_keeps_the_previous_one(tmp_path):
    # The OS refuses the second checkpoint's folder (a file sits where it goes), as a full disk
    # would refuse its files.
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_00000002.partial").write_text("in the way")
    proc = run(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            CONFIGS / "cpu.yaml",
            "--num_processes",
            "2",
            "--num_cpu_threads_per_process",
            "1",
            "--main_process_port",
            free_port(),
            *CIFAR,
            "--max_steps",
            "4",
            "--checkpoint_every",
            "1",
            "--output_dir",
            out,
        ],
        recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
        timeout=300,
    )
    assert proc.returncode != 0
    # Both processes stop, neither waits for the other, and each prints its own line: they learn of
    # the failure from the same all-reduce, and the launcher's SIGTERM once one has exited only sets
    # the other's stop flag. A line may follow rank 0's progress bar on the same line, but is never
    # fused with the other rank's.
    found = re.findall(r"((error(?: \(rank 1\))?): could not write checkpoint [^\n]*)", proc.stderr)
    assert sorted(who for _, who in found) == ["error", "error (rank 1)"], proc.stderr[-3000:]
    errors = [line for line, _ in found]
    assert all("step_00000001 is kept" in e and "--resume auto" in e for e in errors), errors
    assert any("FileExistsError" in e for e in errors)
    assert is_complete(out / "checkpoints" / "step_00000001")


def test_nonfinite_loss_between_log_steps_is_caught_at_the_next_log_step_before_any_save(tmp_path):
    # The guard reads the device at log steps only: the loss turns non-finite at step 2 and is seen
    # at step 4, and no checkpoint is written after it.
    exploding = [
        PYTHON,
        *CIFAR,
        "--max_steps",
        "6",
        "--checkpoint_every",
        "0",
        "--log_every",
        "4",
        "--lr",
        "1e12",
        "--warmup_ratio",
        "0",
    ]
    out = tmp_path / "out"
    fails_with(
        run([*exploding, "--output_dir", out], recipe_env(tmp_path), timeout=300),
        "the loss is not finite",
        "from step 2 on (seen at step 4)",
        "no checkpoint was saved before it",
    )
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
