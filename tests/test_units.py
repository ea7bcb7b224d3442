"""Fast tests of the runtime's bookkeeping: which checkpoint a run resumes from, metrics.jsonl on
resume, the best model and early stopping, presets.

These classes only ask the accelerator who the main process is, wait for the others and sum small
tensors over the processes; a small stand-in object answers that, so each case runs in milliseconds
without starting processes.
"""

import json
import math

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import PYTHON, check, recipe_env, run

from accelerate_recipes.checkpoints import Checkpoints, recover_folder
from accelerate_recipes.cli import RecipeError, expand_preset
from accelerate_recipes.loop import BestModel, RunState, TrainingProgress
from accelerate_recipes.results import MetricsLog, restart_metrics
from accelerate_recipes.schedules import warmup_schedule


class OneProcess:
    """The accelerator attributes Checkpoints and MetricsLog touch, for process `process_index` of a
    run."""

    def __init__(self, process_index=0):
        self.process_index = process_index
        self.is_main_process = process_index == 0
        self.is_local_main_process = process_index == 0
        self.num_processes = 1
        self.device = torch.device("cpu")
        # what the guard reads to decide whether it watches the gradients
        self.distributed_type, self.mixed_precision, self.scaler = DistributedType.NO, "no", None
        self.barriers = 0
        self.printed = []
        self.logged = []
        self.trackers = []  # no tracker takes the run's pictures

    def wait_for_everyone(self):
        self.barriers += 1

    def reduce(self, tensor, reduction="sum"):
        return tensor.clone()  # the only process: its own value is the total

    def gather(self, tensor):
        return tensor

    def print(self, *args):
        self.printed.append(" ".join(map(str, args)))

    def log(self, values, step=None):
        self.logged.append((step, values))


CONFIG = {
    "recipe": "cifar",
    "model": "resnet18",
    "global_batch_size": 64,
    "gradient_accumulation_steps": 1,
    "world_size": 2,
}


def checkpoint(out, step, config=CONFIG, complete=True, suffix=""):
    """A checkpoint folder as Checkpoints.saving leaves it: checkpoint.json is what makes it
    complete."""
    folder = out / "checkpoints" / f"step_{step:08d}{suffix}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    if complete:
        (folder / "checkpoint.json").write_text(json.dumps({"step": step, "epoch": 0, "config": config}))
    return folder


# -------------------------------------------------------------------------------------- Checkpoints
def test_auto_without_checkpoints_starts_fresh(tmp_path):
    ckpts = Checkpoints(OneProcess(), tmp_path)
    assert ckpts.resolve("auto") is None
    assert ckpts.resolve(None) is None and ckpts.newest() is None


def test_auto_takes_the_newest_complete_checkpoint(tmp_path):
    checkpoint(tmp_path, 90)
    newest = checkpoint(tmp_path, 120)
    checkpoint(tmp_path, 100)
    checkpoint(tmp_path, 150, complete=False)  # its save was cut short: no checkpoint.json
    checkpoint(tmp_path, 160, suffix=".partial")  # save_state still writing
    # rotation cut short, even with its checkpoint.json
    checkpoint(tmp_path, 170, suffix=".deleting")
    (tmp_path / "checkpoints" / "notes").mkdir()
    ckpts = Checkpoints(OneProcess(), tmp_path)
    assert ckpts.newest() == newest
    assert ckpts.resolve("auto") == newest
    assert ckpts.resolve(" auto ") == newest


def test_a_path_names_a_checkpoint_an_output_dir_or_its_checkpoints_folder(tmp_path):
    older = checkpoint(tmp_path / "run", 10)
    newest = checkpoint(tmp_path / "run", 20)
    ckpts = Checkpoints(OneProcess(), tmp_path / "new")
    assert ckpts.resolve(str(older)) == older
    assert ckpts.resolve(str(tmp_path / "run")) == newest
    assert ckpts.resolve(str(tmp_path / "run" / "checkpoints")) == newest


@pytest.mark.parametrize("name", ["step_00000030.partial", "step_00000040", "missing"])
def test_a_path_to_an_unfinished_or_missing_checkpoint_is_refused(tmp_path, name):
    checkpoint(tmp_path, 30, suffix=".partial")
    checkpoint(tmp_path, 40, complete=False)
    with pytest.raises(RecipeError, match="does not exist|not a complete checkpoint"):
        Checkpoints(OneProcess(), tmp_path / "new").resolve(str(tmp_path / "checkpoints" / name))


@pytest.mark.parametrize("resume", [None, "", "none", "False"])
def test_a_fresh_start_over_an_earlier_runs_checkpoints_is_refused(tmp_path, resume):
    checkpoint(tmp_path, 50)
    with pytest.raises(RecipeError, match="step_00000050.*--resume auto"):
        Checkpoints(OneProcess(), tmp_path).resolve(resume)


def test_only_unfinished_saves_do_not_block_a_fresh_start(tmp_path):
    checkpoint(tmp_path, 50, complete=False)
    checkpoint(tmp_path, 60, suffix=".partial")
    assert Checkpoints(OneProcess(), tmp_path).resolve(None) is None


def test_a_checkpoint_of_other_settings_is_refused_naming_each_difference(tmp_path):
    folder = checkpoint(tmp_path, 10)
    ckpts = Checkpoints(OneProcess(), tmp_path)
    with pytest.raises(RecipeError) as err:
        ckpts.check_compatible(folder, dict(CONFIG, global_batch_size=128, gradient_accumulation_steps=2))
    assert "global_batch_size 64 there, 128 now" in str(err.value)
    assert "gradient_accumulation_steps 1 there, 2 now" in str(err.value)


def test_a_compatible_checkpoint_returns_its_progress_and_warns_on_another_world_size(tmp_path):
    folder = checkpoint(tmp_path, 10)
    accelerator = OneProcess()
    ckpts = Checkpoints(accelerator, tmp_path)
    assert ckpts.check_compatible(folder, CONFIG)["step"] == 10 and accelerator.printed == []
    progress = ckpts.check_compatible(folder, dict(CONFIG, world_size=4))
    assert progress["epoch"] == 0
    assert len(accelerator.printed) == 1 and "2 process(es), this run has 4" in accelerator.printed[0]


def test_a_damaged_progress_file_is_an_error_not_a_traceback(tmp_path):
    folder = checkpoint(tmp_path, 10)
    (folder / "checkpoint.json").write_text('{"step": 1')
    with pytest.raises(RecipeError, match="damaged"):
        Checkpoints(OneProcess(), tmp_path).check_compatible(folder, CONFIG)


def test_remove_partial_deletes_every_unfinished_folder_on_the_main_process_only(tmp_path):
    kept = [checkpoint(tmp_path, 10), checkpoint(tmp_path, 20)]
    checkpoint(tmp_path, 30, complete=False)
    checkpoint(tmp_path, 40, suffix=".partial")
    checkpoint(tmp_path, 50, suffix=".deleting")
    before = sorted((tmp_path / "checkpoints").iterdir())

    other = OneProcess(process_index=1)
    Checkpoints(other, tmp_path).remove_partial()
    assert sorted((tmp_path / "checkpoints").iterdir()) == before and other.barriers == 1

    main = OneProcess()
    Checkpoints(main, tmp_path).remove_partial()
    assert sorted((tmp_path / "checkpoints").iterdir()) == kept and main.barriers == 1


def test_keeping_no_checkpoint_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="keep at least 1"):
        Checkpoints(OneProcess(), tmp_path, keep=0)


# --------------------------------------------------------------------------------------- MetricsLog
def write_metrics(path, steps):
    path.write_text(
        "".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in steps)
        + '{"step": 9, "train/lo'
    )  # the last line, cut short by the crash


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint_and_logs_on_after_them(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6, 7, 8])
    restart_metrics(tmp_path, resume_step=4)  # what Checkpoints.resolve does on the main process
    log = MetricsLog(OneProcess(), tmp_path)
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    log.log({"train/loss": 0.5}, step=5)
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert log.accelerator.logged == [(5, {"train/loss": 0.5})]


def test_a_new_run_starts_an_empty_metrics_file(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    restart_metrics(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_only_the_main_process_writes_metrics(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    before = (tmp_path / "metrics.jsonl").read_text()
    log = MetricsLog(OneProcess(process_index=1), tmp_path)
    log.log({"train/loss": 0.5}, step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == before


# -------------------------------------------------------------------- best model and early stopping
@pytest.fixture
def make_log(tmp_path):
    """TrainingProgress with its BestModel as a recipe builds them (10 steps per epoch, judged by
    eval_accuracy), closed after the test."""
    logs = []

    def make(
        patience=0,
        state=None,
        accelerator=None,
        total_steps=100,
        resumed_from=None,
        metric="eval_accuracy",
        higher_is_better=True,
    ):
        accelerator = accelerator or OneProcess()
        state = state or RunState(accelerator.device)
        best = BestModel(
            accelerator, state, tmp_path, metric, higher_is_better=higher_is_better, patience=patience
        )
        log = TrainingProgress(
            accelerator,
            state,
            tmp_path,
            total_steps=total_steps,
            steps_per_epoch=10,
            batches_per_epoch=10,
            global_batch_size=8,
            log_every=10,
            checkpoint_every=0,
            resumed_from=resumed_from,
            best=best,
        )
        logs.append(log)
        return log

    yield make
    for log in logs:
        log.close()


def end_epoch(log, accuracy) -> bool:
    """An epoch as the recipes run it: its 10 steps, its evaluation, then the epoch counted. Returns
    whether the evaluation was the best so far."""
    log.start_epoch()
    log.state.step += 10
    evaluation = {"eval_accuracy": accuracy, "eval_loss": 1 - accuracy, "eval_samples": 64}
    log.epoch_done(evaluation)
    improved = log.best.judge(evaluation)
    log.state.epoch += 1
    return improved


def stopped_early(log) -> bool:
    return log.results(started=0.0)["stopped_early"]


def test_only_a_strictly_better_evaluation_improves_and_patience_counts_evaluations_in_a_row(make_log):
    log = make_log(patience=2)
    outcomes = []
    for accuracy in (0.5, 0.5, 0.6, 0.55):
        outcomes.append(end_epoch(log, accuracy))
        assert not log.finished
    # the first evaluation is the best so far; a tie is no improvement
    assert outcomes == [True, False, True, False]
    state = log.state
    assert (state.best_metric, state.best_epoch, state.best_step, state.evals_without_improvement) == (
        0.6,
        3,
        30,
        1,
    )
    assert not end_epoch(log, 0.6)  # the second in a row without improvement: patience 2 is used up
    assert log.finished and stopped_early(log) and state.step == 50 < log.total_steps
    log.close()
    assert log.accelerator.printed[-1].startswith(
        "stopped early after epoch 5 of 10 (step 50 of 100): eval_accuracy did not improve in 2 "
        "evaluation(s) in a "
        "row (--early_stopping_patience 2); best eval_accuracy 0.6000 at epoch 3, its model in "
    )
    results = log.results(started=0.0)
    assert {
        k: results[k]
        for k in (
            "metric_for_best_model",
            "best_metric",
            "best_epoch",
            "best_step",
            "early_stopping_patience",
            "stopped_early",
        )
    } == {
        "metric_for_best_model": "eval_accuracy",
        "best_metric": 0.6,
        "best_epoch": 3,
        "best_step": 30,
        "early_stopping_patience": 2,
        "stopped_early": True,
    }


def test_without_patience_the_best_is_kept_but_the_run_goes_to_its_last_step(make_log):
    log = make_log(total_steps=40)
    assert [end_epoch(log, a) for a in (0.7, 0.2, 0.1, 0.1)] == [True, False, False, False]
    assert log.state.evals_without_improvement == 3 and log.state.best_epoch == 1
    assert log.finished and not stopped_early(log)  # finished by its step count
    log.close()
    assert not any("stopped early" in line for line in log.accelerator.printed)
    assert log.results(started=0.0)["stopped_early"] is False


def test_patience_used_up_at_the_last_evaluation_is_a_normal_end(make_log):
    log = make_log(patience=1, total_steps=20)
    end_epoch(log, 0.5)
    end_epoch(log, 0.4)
    assert log.finished and not stopped_early(log)


def test_nan_never_improves_and_lower_can_be_better(make_log):
    log = make_log(patience=3)
    nan = {"eval_accuracy": math.nan, "eval_loss": math.nan, "eval_samples": 64}
    assert [log.best.judge(e) for e in (nan, {**nan, "eval_accuracy": 0.3}, nan)] == [False, True, False]
    assert log.state.best_metric == 0.3 and log.state.evals_without_improvement == 1
    # A run never gets that far: an epoch whose evaluation
    # is not finite stops it before anything is saved.
    with pytest.raises(RecipeError, match="the evaluation at step 10 gave eval_accuracy nan, eval_loss nan"):
        end_epoch(log, math.nan)

    by_loss = make_log(metric="eval_loss", higher_is_better=False)
    # loss 0.5, 0.3, 0.4
    assert [end_epoch(by_loss, a) for a in (0.5, 0.7, 0.6)] == [True, True, False]
    assert by_loss.state.best_metric == pytest.approx(0.3) and by_loss.state.best_epoch == 2


def test_the_best_and_the_patience_count_survive_save_state_and_load_state(make_log, tmp_path):
    log = make_log(patience=2)
    for accuracy in (0.4, 0.8, 0.7):
        end_epoch(log, accuracy)
    saved = log.state.state_dict()
    # save_state pickles the registered object's state_dict; load_state hands it to a fresh RunState
    restored = RunState(torch.device("cpu"))
    restored.load_state_dict(torch.load(_saved(tmp_path, saved), weights_only=False))
    assert (
        restored.best_metric,
        restored.best_epoch,
        restored.best_step,
        restored.evals_without_improvement,
    ) == (
        0.8,
        2,
        20,
        1,
    )
    resumed = make_log(patience=2, state=restored, resumed_from=tmp_path / "checkpoints" / "step_00000030")
    # equal to the carried best: not an improvement, and the second in a row
    assert not end_epoch(resumed, 0.8)
    assert stopped_early(resumed) and resumed.state.best_epoch == 2


def _saved(tmp_path, state_dict):
    path = tmp_path / "custom_checkpoint_0.pkl"
    torch.save(state_dict, path)
    return path


def test_a_checkpoint_written_before_best_tracking_loads_with_no_best(make_log):
    old = {
        "step": 30,
        "epoch": 3,
        "batches_done": 0,
        "samples_seen": 240,
        "first_loss": 2.3,
        "last_loss": 1.1,
        "last_eval": {"eval_accuracy": 0.5},
        "micro_batches": 0,
        "running": [0.0],
    }
    state = RunState(torch.device("cpu"))
    state.load_state_dict(old)
    assert (state.step, state.best_metric, state.evals_without_improvement) == (30, None, 0)
    log = make_log(patience=1, state=state, resumed_from="step_00000030")
    assert end_epoch(log, 0.5) and log.state.best_epoch == 4


class SecondOfTwo(OneProcess):
    """Process 1 of 2: a sum over the processes adds what the main process contributes."""

    def __init__(self, main_contributions):
        super().__init__(process_index=1)
        self.num_processes = 2
        self.main_contributions = list(main_contributions)

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        return tensor + torch.tensor(self.main_contributions.pop(0), dtype=tensor.dtype)


def test_every_process_decides_by_the_main_process_value(make_log):
    # This process computed other figures than the main process (0.51 vs 0.5, then 0.49 vs 0.5): it
    # follows the main process, so both record the same best and stop at the same evaluation.
    log = make_log(patience=1, accelerator=SecondOfTwo([[0.5], [0.5]]))
    assert end_epoch(log, 0.51) and log.state.best_metric == 0.5
    assert not end_epoch(log, 0.49)
    assert stopped_early(log) and not log.accelerator.main_contributions


def test_bad_settings_and_a_missing_metric_are_one_clear_error(make_log):
    for wrong in (-1, 1.5, "two", True):
        with pytest.raises(RecipeError, match=f"--early_stopping_patience {wrong}: give a whole number"):
            make_log(patience=wrong)
    log = make_log(metric="eval_f1")
    with pytest.raises(
        RecipeError, match="no 'eval_f1' to judge the best model by .*eval_accuracy, eval_loss"
    ):
        end_epoch(log, 0.5)


def write_best(log, weights: bytes):
    with log.best.saving() as folder:
        (folder / "model.safetensors").write_bytes(weights)
    return log.best.folder


def test_model_best_is_replaced_whole_with_its_record(make_log, tmp_path):
    log = make_log()
    end_epoch(log, 0.3)
    best = write_best(log, b"epoch 1")
    assert best == tmp_path / "model_best"
    end_epoch(log, 0.6)
    write_best(log, b"epoch 2")
    assert (best / "model.safetensors").read_bytes() == b"epoch 2"
    assert json.loads((best / "best.json").read_text()) == {
        "metric": "eval_accuracy",
        "value": 0.6,
        "epoch": 2,
        "step": 20,
    }
    # no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "model_best"]


def test_a_failed_write_of_model_best_keeps_the_previous_one(make_log, tmp_path):
    log = make_log()
    end_epoch(log, 0.3)
    write_best(log, b"epoch 1")
    end_epoch(log, 0.6)
    with pytest.raises(
        RecipeError,
        match=r"could not write .*model_best.partial \(OSError: disk full\); the previous "
        "model_best is kept",
    ):
        with log.best.saving() as folder:
            (folder / "model.safetensors").write_bytes(b"half of epoch 2")
            raise OSError("disk full")
    assert (tmp_path / "model_best" / "model.safetensors").read_bytes() == b"epoch 1"
    # the next start clears what the failed save left
    Checkpoints(OneProcess(), tmp_path).resolve(None)
    assert not (tmp_path / "model_best.partial").exists()
    assert (tmp_path / "model_best" / "model.safetensors").read_bytes() == b"epoch 1"


def folder_with(path, weights: bytes, record: bool = True):
    path.mkdir()
    (path / "model.safetensors").write_bytes(weights)
    if record:
        (path / "best.json").write_text("{}")


@pytest.mark.parametrize(
    "left, expected",
    [
        # cut between the two renames
        ({"model_best.deleting": b"old", "model_best.partial": b"new"}, b"new"),
        ({"model_best.deleting": b"old"}, b"old"),
        # cut while writing: the new one has no record
        ({"model_best": b"old", "model_best.partial": None}, b"old"),
        # cut while deleting the previous one
        ({"model_best": b"new", "model_best.deleting": b"old"}, b"new"),
    ],
)
def test_a_crash_while_saving_model_best_leaves_a_whole_one_at_the_next_start(left, expected, tmp_path):
    for name, weights in left.items():
        folder_with(tmp_path / name, weights or b"half", record=weights is not None)
    # only the main process acts
    recover_folder(OneProcess(process_index=1), tmp_path / "model_best", "best.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left)
    recover_folder(OneProcess(), tmp_path / "model_best", "best.json")
    assert [p.name for p in tmp_path.iterdir()] == ["model_best"]
    assert (tmp_path / "model_best" / "model.safetensors").read_bytes() == expected


# ------------------------------------------------------------------------------------------ presets
PRESETS = {"fast": {"epochs": 26, "batch_size": 512, "lr": 0.2}, "tiny": {"epochs": 1}}


@pytest.mark.parametrize("form", [["--preset=fast"], ["--preset", "fast"]])
def test_a_preset_stands_for_its_flags(form):
    argv = expand_preset(["--output_dir", "runs/a", *form], PRESETS)
    assert argv == ["--epochs=26", "--batch_size=512", "--lr=0.2", "--output_dir", "runs/a", *form]


@pytest.mark.parametrize("given", [["--lr", "0.05"], ["--lr=0.05"]])
def test_a_flag_given_on_the_command_line_keeps_its_value(given):
    argv = expand_preset(["--preset", "fast", *given], PRESETS)
    assert argv == ["--epochs=26", "--batch_size=512", "--preset", "fast", *given]


def test_dashed_flag_names_count_as_given():
    assert expand_preset(["--batch-size", "64", "--preset=fast"], PRESETS)[:2] == ["--epochs=26", "--lr=0.2"]


def test_no_preset_leaves_the_command_line_as_it_is():
    assert expand_preset(["--epochs", "3"], PRESETS) == ["--epochs", "3"]


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(RecipeError, match="unknown --preset 'fast94'; choose one of: fast, tiny"):
        expand_preset(["--preset", "fast94"], PRESETS)


def test_cpu_precision_follows_what_torch_may_use_and_the_documented_override(tmp_path):
    """bf16 is picked on the CPU only where it is native: never where oneDNN is kept to AVX2 (bf16
    is emulated there, tens of times slower than fp32), and ACCELERATE_RECIPES_CPU_BF16 overrides
    the detection either way."""
    env = recipe_env(tmp_path)
    env.pop("ACCELERATE_RECIPES_CPU_BF16", None)

    def precision(**extra):
        probe = "from accelerate_recipes import cpu_precision; print(cpu_precision())"
        return run([PYTHON, "-c", probe], {**env, **extra}, timeout=120)

    assert check(precision(ONEDNN_MAX_CPU_ISA="AVX2")).stdout.strip() == "no"
    assert check(precision(ACCELERATE_RECIPES_CPU_BF16="0")).stdout.strip() == "no"
    assert (
        check(precision(ONEDNN_MAX_CPU_ISA="AVX2", ACCELERATE_RECIPES_CPU_BF16="1")).stdout.strip() == "bf16"
    )
    bad = precision(ACCELERATE_RECIPES_CPU_BF16="maybe")
    assert (
        bad.returncode != 0
        and "ACCELERATE_RECIPES_CPU_BF16='maybe': set it to 1 (native bf16) or 0" in bad.stderr
    )


@pytest.mark.parametrize(
    ("decay", "transformers_name", "final_lr_ratio"),
    [("linear", "linear", 0.0), ("cosine", "cosine", 0.0), ("cosine", "cosine_with_min_lr", 0.05)],
)
@pytest.mark.parametrize(("warmup_steps", "total_steps"), [(0, 1), (0, 7), (3, 20), (10, 10)])
def test_warmup_schedules_give_transformers_learning_rates_and_resume_alike(
    decay, transformers_name, final_lr_ratio, warmup_steps, total_steps
):
    """cifar's and the detector's schedules give transformers' get_scheduler's learning rate at
    every step (the same arithmetic: equal within a few ulps), and load its saved state."""
    from transformers import get_scheduler

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)

    ours = warmup_schedule(optimizer(), decay, warmup_steps, total_steps, final_lr_ratio)
    extra = {"scheduler_specific_kwargs": {"min_lr_rate": final_lr_ratio}} if final_lr_ratio else {}
    theirs = get_scheduler(transformers_name, optimizer(), warmup_steps, total_steps, **extra)
    for step in range(total_steps + 2):
        assert math.isclose(ours.get_last_lr()[0], theirs.get_last_lr()[0], rel_tol=1e-12, abs_tol=1e-15), (
            step
        )
        for schedule in (ours, theirs):
            schedule.optimizer.step()
            schedule.step()
    resumed = warmup_schedule(optimizer(), decay, warmup_steps, total_steps, final_lr_ratio)
    resumed.load_state_dict(theirs.state_dict())  # a checkpoint written with transformers' schedule
    assert resumed.last_epoch == theirs.last_epoch and resumed.get_last_lr() == ours.get_last_lr()
