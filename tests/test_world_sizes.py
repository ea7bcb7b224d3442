"""3 and 4 processes over gloo: the stop/NaN guard agrees on the right answer at every world size,
the global batch splits as --batch_size promises (or is refused in one line), and evaluation counts
each example once when the test split does not divide by the world size.

The guard's flags are a max over the processes; a reduction that summed them instead would still
pass at 2 processes but, at 3 or 4, stop every run at its first step or name the wrong step. Runs
are a few steps on tiny data: 4 processes share 2 cores here.
"""

from conftest import (
    ACCELERATE,
    CIFAR_SCRIPT,
    CONFIGS,
    TEXT_SCRIPT,
    check,
    free_port,
    losses,
    read_results,
    recipe_env,
    run,
    sentiment_rows,
    stopped_with,
    write_rows,
)

from accelerate_recipes.plots import read_confusion_matrix_csv

# 100 generated training images and a test split of a fifth, 20: 7, 7 and 6 on 3 processes.
CIFAR = [
    CIFAR_SCRIPT,
    "--dataset",
    "synthetic",
    "--synthetic_size",
    "100",
    "--tracker",
    "none",
    "--num_workers",
    "0",
    "--log_every",
    "1",
    "--checkpoint_every",
    "0",
]


def launch(processes: int, command: list, out, tmp_path):
    """The recipe under `accelerate launch` with `processes` CPU processes over gloo, one thread
    each."""
    return run(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            CONFIGS / "cpu.yaml",
            "--num_processes",
            processes,
            "--num_cpu_threads_per_process",
            "1",
            "--main_process_port",
            free_port(),
            *command,
            "--output_dir",
            out,
        ],
        recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
        timeout=400,
    )


def assert_every_step_checked(proc, out, world: int, steps: int, global_batch: int, per_process: int) -> dict:
    """The run on WORLD processes reached its last step with the guard agreeing at each (--log_every
    1), and split --batch_size, the global batch, as promised; returns its results."""
    results = read_results(out)
    assert results["world_size"] == world and results["distributed_type"] == "MULTI_CPU"
    assert results["steps"] == steps and sorted(losses(out)) == list(range(1, steps + 1))
    assert "not finite" not in proc.output
    assert (results["global_batch_size"], results["per_process_batch_size"]) == (global_batch, per_process)
    assert results["samples_seen_per_process"] == [steps * per_process] * world
    assert f"global batch {global_batch} = {world} process(es) x {per_process} per process" in proc.stdout
    return results


def test_cifar_on_3_processes_runs_every_step_and_counts_each_test_image_once(tmp_path):
    out = tmp_path / "out"
    proc = check(launch(3, [*CIFAR, "--batch_size", "24", "--max_steps", "3"], out, tmp_path))
    results = assert_every_step_checked(proc, out, world=3, steps=3, global_batch=24, per_process=8)
    # 20 test images on 3 processes: the shard padded to 7 is gathered back to 20, each image once.
    assert results["eval_samples"] == results["test_size"] == 20
    assert sum(map(sum, read_confusion_matrix_csv(out / "confusion_matrix.csv")[1])) == 20


def test_text_on_4_processes_runs_every_step_and_counts_each_validation_example_once(tiny_bert_dir, tmp_path):
    model = tiny_bert_dir
    train = write_rows(tmp_path / "reviews" / "train.csv", sentiment_rows(48, seed=0))
    # 63 = 4 x 15 + 3
    validation = write_rows(tmp_path / "reviews" / "dev.csv", sentiment_rows(63, seed=1))
    out = tmp_path / "out"
    proc = check(
        launch(
            4,
            [
                TEXT_SCRIPT,
                "--model",
                model,
                "--train_file",
                train,
                "--validation_file",
                validation,
                "--batch_size",
                "16",
                "--epochs",
                "1",
                "--lr",
                "3e-3",
                "--tracker",
                "none",
                "--num_workers",
                "0",
                "--log_every",
                "1",
                "--checkpoint_every",
                "0",
            ],
            out,
            tmp_path,
        )
    )
    # 48 rows at a global batch of 16: 3 steps, every one checked by the guard and none stopped.
    results = assert_every_step_checked(proc, out, world=4, steps=3, global_batch=16, per_process=4)
    assert results["eval_samples"] == results["validation_size"] == 63


def test_a_global_batch_that_does_not_divide_by_4_processes_is_refused(tmp_path):
    out = tmp_path / "out"
    stopped_with(
        launch(4, [*CIFAR, "--batch_size", "18", "--max_steps", "2"], out, tmp_path),
        out,
        "--batch_size 18 (the global batch) does not divide evenly over 4 process(es) x 1 accumulation "
        "step(s) = 4",
        "e.g. --batch_size 16 or 20",
    )


def test_a_nonfinite_loss_on_3_processes_stops_the_run_at_its_own_step(tmp_path):
    # A learning rate of 1e12 sends the loss to inf/NaN at the second step, on every process.
    out = tmp_path / "out"
    proc = launch(
        3,
        [*CIFAR, "--batch_size", "24", "--max_steps", "4", "--lr", "1e12", "--warmup_ratio", "0"],
        out,
        tmp_path,
    )
    stopped_with(
        proc,
        out,
        "the loss is not finite",
        "from step 2 on (seen at step 2)",
        "no checkpoint was saved before it",
    )
    assert sorted(losses(out)) == [1]  # step 1 was logged; nothing after the bad step
