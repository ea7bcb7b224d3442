"""Fast tests of the runtime's bookkeeping: which checkpoint a run resumes from, metrics.jsonl on resume, presets.

These classes only ask the accelerator who the main process is and wait for the others; a small stand-in object
answers that, so each case runs in milliseconds without starting processes.
"""

import json

import pytest

from accelerate_recipes.checkpoints import Checkpoints
from accelerate_recipes.cli import RecipeError, expand_preset
from accelerate_recipes.results import MetricsLog


class OneProcess:
    """The accelerator attributes Checkpoints and MetricsLog touch, for process `process_index` of a run."""

    def __init__(self, process_index=0):
        self.process_index = process_index
        self.is_main_process = process_index == 0
        self.is_local_main_process = process_index == 0
        self.num_processes = 1
        self.barriers = 0
        self.printed = []
        self.logged = []

    def wait_for_everyone(self):
        self.barriers += 1

    def print(self, *args):
        self.printed.append(" ".join(map(str, args)))

    def log(self, values, step=None):
        self.logged.append((step, values))


CONFIG = {"recipe": "cifar", "model": "resnet18", "global_batch_size": 64, "gradient_accumulation_steps": 1,
          "world_size": 2}


def checkpoint(out, step, config=CONFIG, complete=True, suffix=""):
    """A checkpoint folder as Checkpoints.saving leaves it: checkpoint.json is what makes it complete."""
    folder = out / "checkpoints" / f"step_{step:08d}{suffix}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    if complete:
        (folder / "checkpoint.json").write_text(json.dumps({"step": step, "epoch": 0, "config": config}))
    return folder


# ------------------------------------------------------------------------------------------------- Checkpoints
def test_auto_without_checkpoints_starts_fresh(tmp_path):
    ckpts = Checkpoints(OneProcess(), tmp_path)
    assert ckpts.resolve("auto") is None
    assert ckpts.resolve(None) is None and ckpts.newest() is None


def test_auto_takes_the_newest_complete_checkpoint(tmp_path):
    checkpoint(tmp_path, 90)
    newest = checkpoint(tmp_path, 120)
    checkpoint(tmp_path, 100)
    checkpoint(tmp_path, 150, complete=False)          # its save was cut short: no checkpoint.json
    checkpoint(tmp_path, 160, suffix=".partial")       # save_state still writing
    checkpoint(tmp_path, 170, suffix=".deleting")      # rotation cut short, even with its checkpoint.json
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


# -------------------------------------------------------------------------------------------------- MetricsLog
def write_metrics(path, steps):
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in steps)
                    + '{"step": 9, "train/lo')  # the last line, cut short by the crash


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint_and_logs_on_after_them(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6, 7, 8])
    log = MetricsLog(OneProcess(), tmp_path, resume_step=4)
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    log.log({"train/loss": 0.5}, step=5)
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert log.accelerator.logged == [(5, {"train/loss": 0.5})]


def test_a_new_run_starts_an_empty_metrics_file(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    MetricsLog(OneProcess(), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_only_the_main_process_writes_metrics(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [1, 2, 3])
    before = (tmp_path / "metrics.jsonl").read_text()
    log = MetricsLog(OneProcess(process_index=1), tmp_path, resume_step=1)
    log.log({"train/loss": 0.5}, step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------------------------------------------- presets
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
