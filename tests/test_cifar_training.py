"""The CIFAR recipe trains for real: one process on data in CIFAR's on-disk format, and one vs two
processes."""

import glob
import json
import os
import re
import signal

import pytest
import torch
from conftest import (
    ACCELERATE,
    CIFAR_RUN,
    CIFAR_SCRIPT,
    CONFIGS,
    NAN_GRADIENT,
    NO_PLOTS,
    PYTHON,
    TINY,
    assert_both_ranks_quiet,
    assert_nonfinite_gradients_handled,
    assert_quiet,
    assert_same_weights,
    check,
    check_png,
    fails_with,
    free_port,
    losses,
    processes_with,
    read_audit,
    read_metrics,
    read_results,
    recipe_env,
    run,
    start_in_own_session,
    time_limit,
    wait_for_checkpoint,
    write_cifar10,
)
from safetensors.torch import load_file

from accelerate_recipes import cpu_precision
from accelerate_recipes.meter import FIGURES
from accelerate_recipes.plots import read_confusion_matrix_csv

CONTRACT_KEYS = {
    "recipe",
    "dataset",
    "world_size",
    "num_machines",
    "mixed_precision",
    "global_batch_size",
    "steps",
    "epochs",
    "wall_seconds",
    "train_samples_per_second",
    "median_step_seconds",
    "peak_memory_mb",
    "eval_accuracy",
}


@pytest.fixture(scope="module")
def cifar_run(module_tmp):
    """640 training / 130 test images written as CIFAR-10 python batches, 2 epochs, SwanLab offline
    (no login), through torchvision's dataset and a DataLoader with its transforms."""
    tmp = module_tmp.mktemp("cifar")
    data = write_cifar10(tmp / "data", num_train=640, num_test=130)
    out = tmp / "out"
    env = recipe_env(tmp)
    proc = check(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--dataset",
                "cifar10",
                "--data_dir",
                data,
                "--verify_data",
                "False",
                "--download",
                "False",
                "--loader",
                "torch",
                "--batch_size",
                "32",
                "--epochs",
                "2",
                "--warmup_ratio",
                "0.2",
                "--mixed_precision",
                cpu_precision(),  # as the README says: bf16 only where the CPU computes it natively
                "--num_workers",
                "0",
                "--log_every",
                "5",
                "--output_dir",
                out,
            ],
            env,
            timeout=400,
        )
    )
    return out, proc


def test_single_process_learns_on_cifar_format_data(cifar_run):
    out, proc = cifar_run
    results = read_results(out)
    assert CONTRACT_KEYS <= results.keys()
    assert results["recipe"] == "cifar" and results["dataset"] == "cifar10" and results["world_size"] == 1
    assert results["loader"] == "torch"
    assert results["steps"] == 2 * (640 // 32) and results["epochs"] == 2
    assert results["eval_samples"] == 130
    assert results["train_loss_last"] < 0.7 * results["train_loss_first"]
    assert results["eval_accuracy"] > 0.5, results["eval_accuracy"]  # chance is 0.1
    assert results["train_samples_per_second"] > 0 and results["peak_memory_mb"] > 0
    assert (out / "model.safetensors").is_file()
    assert "cifar: summary" in proc.stdout


def test_pictures_and_confusion_counts_of_the_final_evaluation(cifar_run):
    out, _ = cifar_run
    results = read_results(out)
    check_png(out / "results.png", 800, 600)
    check_png(out / "confusion_matrix.png")
    names, counts = read_confusion_matrix_csv(out / "confusion_matrix.csv")
    assert names == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    assert len(counts) == 10 and all(len(row) == 10 for row in counts)
    assert sum(map(sum, counts)) == 130  # every test image once
    assert sum(counts[i][i] for i in range(10)) / 130 == pytest.approx(results["eval_accuracy"])
    # the generated test set's labels cycle through the classes: 13 images each
    assert [sum(row) for row in counts] == [13] * 10


def test_swanlab_offline_without_login_logs_metrics_we_can_read_back(cifar_run):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    out, proc = cifar_run
    assert "SwanLab (offline, not logged in)" in proc.stdout and "swanlab sync" in proc.stdout
    run_files = glob.glob(str(out / "swanlog" / "run-*" / "run-*.swanlab"))
    assert len(run_files) == 1
    reader = DataStoreReader()
    reader.open(run_files[0])
    logged = {}
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            logged[(record.scalar.key, record.scalar.step)] = record.scalar.value.number
    # Every train/loss and eval/accuracy in metrics.jsonl
    # reached SwanLab with the same value and step.
    expected = [
        (k, m["step"], m[k]) for m in read_metrics(out) for k in ("train/loss", "eval/accuracy") if k in m
    ]
    assert len(expected) >= 8
    for key, step, value in expected:
        assert logged[(key, step)] == pytest.approx(value, rel=1e-6), (key, step)


def test_the_runs_pictures_reach_swanlab_as_images(cifar_run):
    """The final confusion matrix and results.png, logged as images at the last step (offline: the
    pictures are in the run's media folder); the 1-process run logs no per-process figures."""
    from test_resume import swanlab_images

    out, _ = cifar_run
    (run_file,) = (out / "swanlog").glob("run-*/run-*.swanlab")
    images = swanlab_images(run_file)
    last = read_results(out)["steps"]
    assert sorted(images) == [("eval/confusion_matrix", last), ("results", last)]
    check_png(images["eval/confusion_matrix", last][0])
    check_png(images["results", last][0], 800, 600)
    logged = {key for m in read_metrics(out) for key in m}
    assert not [key for key in logged if key.startswith(("process/", "node/"))]


def test_every_process_times_its_steps_data_and_communication(cifar_two):
    """cifar_two (DDP, 2 gloo processes): at every log step each process's step time, data wait,
    communication wait and compute go to the tracker (metrics.jsonl holds the same), and
    results.json holds their means over the run by process and by node; the parts add up to the
    step, and the processes, in DDP's lockstep, take alike long a step."""
    results = read_results(cifar_two.out)
    assert results["node_of_process"] == [0, 0] and results["slow_processes"] == []
    for rank in (0, 1):
        step = results["step_seconds_per_process"][rank]
        names = ("data", "comm", "compute")
        parts = [results[f"{name}_seconds_per_process"][rank] for name in names]
        assert all(0 < part < step for part in parts), (rank, step, parts)
        assert sum(parts) == pytest.approx(step, rel=1e-5)
    steps = results["step_seconds_per_process"]
    assert abs(steps[0] - steps[1]) < 0.2 * max(steps), steps
    for name in ("step", "data", "comm", "compute"):
        mean = sum(results[f"{name}_seconds_per_process"]) / 2
        assert results[f"{name}_seconds_per_node"] == [pytest.approx(mean, rel=1e-5)], name
    logged = [m for m in read_metrics(cifar_two.out) if "train/loss" in m]
    assert [m["step"] for m in logged] == [1, 2, 4, 6, 8]
    for m in logged:
        for rank in (0, 1):
            step, data, comm, compute = (m[f"process/{name}/rank{rank}"] for name in FIGURES)
            assert compute == pytest.approx(step - data - comm, abs=1e-5)
            assert data >= 0 and comm >= 0 and compute > 0
        assert m["process/step_seconds/rank0"] == pytest.approx(m["perf/step_seconds"], rel=1e-5)
        assert "node/compute_seconds/node0" in m


def test_two_processes_match_one_process(cifar_one, cifar_two):
    """Same global batch and seed (conftest's CIFAR_RUN): 2 gloo processes follow the 1-process loss
    trajectory.

    Augmentation is off (its random crops are drawn per process) and BatchNorm is not synchronised
    (SyncBatchNorm needs CUDA), so each process normalises over its 16 samples instead of 32: the
    losses agree to within 0.05 (2% of the initial loss ln 10 = 2.3), not bitwise. Measured here: at
    most ~0.02. The losses are the means logged at steps 1, 2, 4, 6 and 8 (the steps between are the
    host-read audit's quiet ones).
    """
    one, two = cifar_one.out, cifar_two.out
    r1, r2 = read_results(one), read_results(two)
    assert (r1["world_size"], r2["world_size"]) == (1, 2)
    assert r2["distributed_type"] == "MULTI_CPU"
    # the default for generated data: each rank reads its own shard
    assert r1["loader"] == r2["loader"] == "device"
    # each rank loaded half of every global batch of 32 ...
    assert r2["per_process_batch_size"] == 16 and r2["samples_seen_per_process"] == [8 * 16, 8 * 16]
    # ... and the 129 test images were counted once, although 129 does not split evenly over 2 ranks
    # (the device loader pads rank 1's shard with one label -1 row, dropped after gathering).
    assert r1["eval_samples"] == r2["eval_samples"] == r2["test_size"] == 129
    counts = [read_confusion_matrix_csv(run / "confusion_matrix.csv")[1] for run in (one, two)]
    # the padded row is not counted
    assert sum(map(sum, counts[0])) == sum(map(sum, counts[1])) == 129
    # the same true labels
    assert [sum(row) for row in counts[0]] == [sum(row) for row in counts[1]]
    l1, l2 = losses(one), losses(two)
    assert sorted(l1) == sorted(l2) == [1, 2, 4, 6, 8]
    diffs = [abs(l1[s] - l2[s]) for s in l1]
    assert max(diffs) < 0.05, diffs
    assert "2 process(es) on 1 machine(s)" in cifar_two.proc.stdout
    # The settings run_config records: the precision accelerate applied (not the flag's default
    # None), the global batch, every training flag as given, the values the recipe derived, and no
    # flag that only says where files go.
    assert r2["mixed_precision"] in ("no", "bf16", "fp16") and r2["global_batch_size"] == 32
    assert r2["momentum"] == 0.9 and r2["augment"] is False and r2["lr"] == 0.02
    assert r2["model"] == "resnet18" and r2["epochs"] == 1 and r2["total_steps"] == 8
    assert not {"output_dir", "resume", "tracker", "batch_size", "predict"} & set(r2)


def test_cifar_loop_reads_nothing_between_log_steps_on_one_and_two_processes(cifar_one, cifar_two):
    """The host-read audit (benchmarks/host_reads.py) of the shared runs: steps 3, 5 and 7 read
    nothing on the host, on 1 process and on each of the 2."""
    assert_quiet(read_audit(cifar_one.out), cifar_one.proc, steps=8, log_every=2)
    assert_both_ranks_quiet(cifar_two, steps=8, log_every=2)


def test_a_killed_worker_is_restarted_by_the_elastic_agent_and_the_run_ends_as_if_never_killed(
    cifar_two, tmp_path
):
    """`make cifar-cpu RESTARTS=1`'s launch (`--max_restarts 1`, `--resume auto` added) on 2 gloo
    processes, rank 1 killed with SIGKILL mid-epoch: the launcher's elastic agent stops rank 0,
    starts both again, they continue from the checkpoint of step 4 and finish without a person, with
    the weights of the shared 2-process run cifar_two (CIFAR_RUN, 8 steps inside one epoch) bit for
    bit, and one SwanLab experiment (offline: two parts of one run id, the curve before the kill and
    after the restart). This run has the same flags and a checkpoint every 2 steps, which changes no
    number it computes. (The other killed runs are test_resume.py's; this one sits beside the run it
    continues to.)"""
    launch = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--max_restarts", "1"]
    launch += [
        "--num_processes",
        "2",
        "--num_cpu_threads_per_process",
        "1",
        "--main_process_port",
        free_port(),
    ]
    cifar = [
        CIFAR_SCRIPT,
        *NO_PLOTS,
        *CIFAR_RUN,
        "--checkpoint_every",
        "2",
        "--tracker",
        "swanlab",
        "--swanlab_mode",
        "offline",
    ]
    out, log = tmp_path / "out", tmp_path / "killed.log"
    marked = recipe_env(tmp_path, ACCELERATE_USE_CPU="true", RESUME_TEST_RUN=str(tmp_path))
    proc = start_in_own_session([*launch, *cifar, "--output_dir", out, "--resume", "auto"], marked, log)
    try:
        wait_for_checkpoint(proc, out, 4, log)  # mid-epoch 1
        rank1 = [
            pid for pid, e in processes_with("RESUME_TEST_RUN", str(tmp_path)).items() if e.get("RANK") == "1"
        ]
        assert len(rank1) == 1, "rank 1 not found"
        os.kill(rank1[0], signal.SIGKILL)
        # restarted, and finished
        assert proc.wait(timeout=time_limit(300)) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert "resumed from" in output and output.count("resumed from") == 1

    results = read_results(out)
    assert results["world_size"] == 2 and results["steps"] == read_results(cifar_two.out)["steps"] == 8
    assert results["resumed_from"].startswith(str(out / "checkpoints" / "step_0000000"))
    assert_same_weights(out, cifar_two.out)
    assert re.search(r"resumed from \S+: step \d of 8, epoch 1, [1-7] batch\(es\) of it already done", output)

    from test_resume import swanlab_scalars

    run_id = json.loads((out / "tracker_run.json").read_text())["id"]
    parts = sorted((out / "swanlog").glob("run-*/run-*.swanlab"))
    assert len(parts) == 2 and all(part.name == f"run-{run_id}.swanlab" for part in parts), parts
    logged = {**swanlab_scalars(parts[0]), **swanlab_scalars(parts[1])}
    expected = {(k, m["step"]): m[k] for m in read_metrics(out) for k in ("train/loss",) if k in m}
    assert sorted(expected) == sorted(key for key in logged if key[0] == "train/loss")
    assert all(logged[key] == pytest.approx(value, rel=1e-6) for key, value in expected.items())
    # and every process's figures, both halves in the same experiment
    keys = [f"process/{name}/rank{rank}" for name in FIGURES for rank in (0, 1)]
    expected = {(k, m["step"]): m[k] for m in read_metrics(out) for k in keys if k in m}
    assert len(expected) == len(keys) * 5  # steps 1, 2, 4, 6, 8
    assert all(logged[key] == pytest.approx(value, rel=1e-6) for key, value in expected.items())


def test_imagefolder_with_gradient_accumulation(tmp_path):
    """Your own images in train/<class>/ and val/<class>/, 2 accumulation steps per optimizer
    step."""
    from cifar_data import synthetic_images
    from PIL import Image

    images, labels = synthetic_images(60, num_classes=3, seed=3, size=40)
    for i, (image, label) in enumerate(zip(images, labels)):
        split = "val" if i % 5 == 0 else "train"
        folder = tmp_path / "imgs" / split / ["cat", "dog", "fox"][label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i}.png")
    out = tmp_path / "out"
    check(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                *NO_PLOTS,
                "--dataset",
                "imagefolder",
                "--data_dir",
                tmp_path / "imgs",
                "--image_size",
                "32",
                "--batch_size",
                "16",
                "--gradient_accumulation_steps",
                "2",
                "--max_steps",
                "3",
                "--tracker",
                "none",
                "--num_workers",
                "0",
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path),
        )
    )
    results = read_results(out)
    assert results["dataset"] == "imagefolder" and results["synthetic_data"] is False
    assert results["per_process_batch_size"] == 8 and results["gradient_accumulation_steps"] == 2
    assert results["steps"] == 3 and results["samples_seen_per_process"] == [3 * 16]
    assert results["eval_samples"] == 12 and results["test_size"] == 12


def test_fast94_preset_on_cifar_format_data_with_the_device_loader(tmp_path):
    """--preset fills in its flags, flags given by hand win; CIFAR arrays go to the device loader
    with cutout and flip test-time augmentation."""
    data = write_cifar10(tmp_path / "data", num_train=320, num_test=67)
    out = tmp_path / "out"
    proc = check(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                *NO_PLOTS,
                "--preset",
                "fast94",
                "--dataset",
                "cifar10",
                "--data_dir",
                data,
                "--verify_data",
                "False",
                "--download",
                "False",
                "--batch_size",
                "32",
                "--max_steps",
                "4",
                "--tracker",
                "none",
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path),
            timeout=300,
        )
    )
    results = read_results(out)
    assert results["preset"] == "fast94" and results["loader"] == "device"
    assert (results["lr"], results["label_smoothing"], results["schedule"]) == (0.2, 0.0, "linear")
    # 20% of 4 steps
    assert (results["cutout"], results["tta_flip"], results["warmup_steps"]) == (12, True, 1)
    # given on the command line: kept
    assert results["global_batch_size"] == 32 and results["steps"] == 4
    assert results["eval_samples"] == 67
    assert "| device" in proc.stdout


def test_loader_and_preset_errors(tmp_path):
    env = recipe_env(tmp_path)
    (tmp_path / "imgs" / "train" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "val" / "a").mkdir(parents=True)
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "--preset", "fast100", "--output_dir", tmp_path / "o"], env),
        "unknown --preset 'fast100'; choose one of: fast94",
    )
    fails_with(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--dataset",
                "synthetic",
                "--loader",
                "torch",
                "--cutout",
                "8",
                "--tracker",
                "none",
                "--output_dir",
                tmp_path / "o",
            ],
            env,
        ),
        "--cutout runs in the device loader",
    )
    fails_with(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--dataset",
                "synthetic",
                "--loader",
                "gpu",
                "--output_dir",
                tmp_path / "o",
            ],
            env,
        ),
        "unknown --loader 'gpu'; choose one of auto, device, torch",
    )


def same_tensors(a, b) -> bool:
    wa, wb = load_file(str(a)), load_file(str(b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_model_best_holds_the_best_epochs_weights_and_patience_ends_the_run(tmp_path):
    """Up to 5 epochs of 10 steps with a checkpoint kept at every epoch end,
    --early_stopping_patience 1: the run stops at the first evaluation that is not above the best
    before it, and model_best holds the weights of the epoch with the highest accuracy, the very
    tensors of that epoch's checkpoint. With this seed and a 16-image test set the accuracy fell at
    epoch 2 when measured here (0.125, then 0.0625): the run stopped there, and model_best (epoch 1)
    differed from the last model. Other CPUs may round otherwise; the checks hold for any course."""
    out = tmp_path / "out"
    proc = check(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                *NO_PLOTS,
                "--dataset",
                "synthetic",
                "--synthetic_size",
                "80",
                "--batch_size",
                "8",
                "--epochs",
                "5",
                "--checkpoint_every",
                "0",
                "--keep_checkpoints",
                "5",
                "--early_stopping_patience",
                "1",
                "--tracker",
                "none",
                "--num_workers",
                "0",
                "--log_every",
                "5",
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path),
        )
    )
    results = read_results(out)
    accuracy = [m["eval/accuracy"] for m in read_metrics(out) if "eval/accuracy" in m]
    # Patience 1, worked out from the logged evaluations: the run ends after the first one not above
    # every earlier one.
    ends = [i + 1 for i in range(1, len(accuracy)) if accuracy[i] <= max(accuracy[:i])]
    evaluations = ends[0] if ends else 5
    assert len(accuracy) == evaluations and results["steps"] == 10 * evaluations
    assert results["stopped_early"] == (evaluations < 5) and results["early_stopping_patience"] == 1
    # the first of equal ones: only a higher accuracy replaces it
    best_epoch = accuracy.index(max(accuracy)) + 1
    assert (results["metric_for_best_model"], results["best_metric"]) == ("eval_accuracy", max(accuracy))
    assert results["best_epoch"] == best_epoch and results["best_step"] == 10 * best_epoch
    assert json.loads((out / "model_best" / "best.json").read_text()) == {
        "metric": "eval_accuracy",
        "value": max(accuracy),
        "epoch": best_epoch,
        "step": 10 * best_epoch,
    }
    checkpoint = out / "checkpoints" / f"step_{10 * best_epoch:08d}" / "model.safetensors"
    assert same_tensors(out / "model_best" / "model.safetensors", checkpoint)
    last = out / "checkpoints" / f"step_{results['steps']:08d}" / "model.safetensors"
    assert same_tensors(out / "model.safetensors", last)  # the final model stays the last one
    assert same_tensors(out / "model_best" / "model.safetensors", out / "model.safetensors") == (
        best_epoch == evaluations
    )
    if results["stopped_early"]:
        assert (
            f"stopped early after epoch {evaluations} of 5 (step {10 * evaluations} of 50): eval_accuracy "
            f"did not improve in 1 evaluation(s) in a row (--early_stopping_patience 1); best eval_accuracy "
            f"{max(accuracy):.4f} at epoch {best_epoch}"
        ) in proc.stdout
    # no leftovers
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoints", "model_best"]


def test_nan_gradients_with_a_finite_loss_are_skipped_with_skip_nonfinite_steps(tmp_path):
    # NaN gradients in step 2 of 3 (tests/nan_gradient.py), the loss finite: the update of step 2 is
    # skipped. That the run stops at that step without the flag is the guard's own logic
    # (test_guard.py) and the chat recipes' runs.
    out = tmp_path / "out"
    args = [CIFAR_SCRIPT, *TINY, "--max_steps", "3", "--skip_nonfinite_steps", "--output_dir", out]
    proc = run([PYTHON, NAN_GRADIENT, 2, *args], recipe_env(tmp_path), timeout=300)
    assert_nonfinite_gradients_handled("skip", proc, out, bad_steps=[2])
    # TINY's --plots False: no pictures, the figures as ever
    assert not list(out.glob("*.png")) and (out / "confusion_matrix.csv").is_file()
    assert (out / "metrics.jsonl").is_file() and (out / "results.json").is_file()
