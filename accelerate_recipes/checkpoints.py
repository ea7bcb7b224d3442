"""Checkpoints that survive crashes: written atomically, kept to the last N, found again by
`--resume auto`.

The recipe calls `accelerator.save_state` / `accelerator.load_state` itself (model, optimizer,
scheduler, grad scaler, RNG states); this module decides where they go and makes each one appear
only once it is whole:

    output_dir/checkpoints/step_00000120.partial/   save_state writes here first
    output_dir/checkpoints/step_00000120/           renamed when every process has finished
                                                    writing, with
        checkpoint.json                             the progress the recipe needs to continue
                                                    (step, epoch, batches already seen in that
                                                    epoch, ...), written last

A folder without checkpoint.json, or still named `.partial`, is a save that was interrupted: never
resumed from, and deleted at the next start. Old checkpoints are renamed `.deleting` before they are
deleted, for the same reason. On several nodes the output directory must be on a shared file system
(the model is written by the main process only).

A checkpoint does not depend on torch.compile: save_state writes the weights of the model as it was
before prepare() wrapped it (or, under FSDP and DeepSpeed, under the names of that model), so a
compiled run resumes without compiling and the other way round. The model saved for inference needs
`model_to_save` for the same.
"""

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from accelerate_recipes.errors import RecipeError

CHECKPOINTS_DIR = "checkpoints"
PROGRESS_FILE = "checkpoint.json"
PARTIAL_SUFFIX = ".partial"
# output_dir/model_best: the model of the best evaluation, saved like the final one
BEST_DIR = "model_best"
BEST_RECORD = "best.json"  # in it, written last: which metric, its value, the epoch and step
DELETING_SUFFIX = ".deleting"
# Settings that must match for a checkpoint to continue the same run.
MUST_MATCH = ("recipe", "model", "pretrained", "global_batch_size", "gradient_accumulation_steps")


def step_of(folder: Path) -> int | None:
    """The step in a checkpoint folder's name (step_00000120 -> 120), or None for other names."""
    name = folder.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def is_complete(folder: Path) -> bool:
    return step_of(folder) is not None and (folder / PROGRESS_FILE).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """The whole checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((f for f in directory.iterdir() if f.is_dir() and is_complete(f)), key=step_of)


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def read_progress(folder: Path) -> dict:
    try:
        return json.loads((folder / PROGRESS_FILE).read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(
            f"checkpoint {folder} is damaged ({PROGRESS_FILE}: {err}); delete it, or resume from an "
            "older one with --resume <its path>"
        ) from None


def model_to_save(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The prepared `model` as `accelerator.save_model` and `accelerator.get_state_dict` should get
    it, compiled or not.

    prepare() wraps the model in torch.compile's module when asked (the recipe's --compile, or a
    launcher's --dynamo_backend), and that wrapper would save every weight as `_orig_mod.<name>`,
    which a model rebuilt for inference cannot load: it is taken off here, with DDP's. Under FSDP
    and DeepSpeed the model stays as prepared: their full state dict gathers the shards, and already
    names the weights without that prefix.
    """
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return model
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def any_process_failed(accelerator, error: Exception | None) -> bool:
    """Whether any process met an error while saving: every process learns it, so none is left
    waiting for the others."""
    failed = torch.tensor(0.0 if error is None else 1.0, device=accelerator.device)
    return accelerator.reduce(failed, reduction="sum").item() > 0


class Checkpoints:
    """The checkpoints of one run in output_dir/checkpoints: what to resume from, and atomic saving
    with rotation."""

    def __init__(self, accelerator, output_dir: str | Path, keep: int = 2):
        if keep < 1:
            raise RecipeError(
                f"--keep_checkpoints {keep}: keep at least 1 (the newest is the one a resume needs)"
            )
        self.accelerator = accelerator
        self.directory = Path(output_dir) / CHECKPOINTS_DIR
        self.keep = keep
        self.last_saved: Path | None = None

    def newest(self) -> Path | None:
        return newest_checkpoint(self.directory)

    def resolve(self, resume: str | None) -> Path | None:
        """The checkpoint `--resume` names: None (start fresh), "auto" (the newest complete one, if
        any) or a path.

        Starting fresh where checkpoints of an earlier run exist would rotate them away, so that is
        refused. Once the choice stands, the output folder is made ready for this run, before it
        saves anything: what interrupted saves left is deleted (model_best/ put back whole), and
        metrics.jsonl starts empty or keeps the rows up to the checkpoint's step. Collective.
        """
        from accelerate_recipes.results import restart_metrics

        chosen = self._choose(resume)
        self.remove_partial()
        if self.accelerator.is_main_process:
            recover_folder(self.accelerator, self.directory.parent / BEST_DIR, BEST_RECORD)
            restart_metrics(self.directory.parent, read_progress(chosen).get("step") if chosen else None)
        self.accelerator.wait_for_everyone()
        return chosen

    def _choose(self, resume: str | None) -> Path | None:
        choice = None if resume is None else str(resume).strip()
        if choice in (None, "", "none", "None", "False", "false"):
            newest = self.newest()
            if newest is not None:
                raise RecipeError(
                    f"{self.directory} holds checkpoints of an earlier run (newest: {newest.name}); continue "
                    "it with "
                    "--resume auto, or start over in another --output_dir (or delete that folder first)"
                )
            return None
        if choice == "auto":
            return self.newest()
        path = Path(choice).expanduser()
        if not path.exists():
            raise RecipeError(
                f"--resume {choice} does not exist; give a checkpoint folder "
                f"(output_dir/{CHECKPOINTS_DIR}/step_N) or --resume auto"
            )
        if not is_complete(path):
            inside = complete_checkpoints(path) or complete_checkpoints(path / CHECKPOINTS_DIR)
            if inside:  # an output directory or its checkpoints folder: take the newest in it
                return inside[-1]
            raise RecipeError(
                f"--resume {choice} is not a complete checkpoint (no {PROGRESS_FILE}: its save was "
                "interrupted, or it "
                "is not a checkpoint folder); use --resume auto to take the newest complete one"
            )
        return path

    def check_compatible(self, folder: Path, config: dict) -> dict:
        """The saved progress of `folder`, after checking it was written by a run with the same
        essential settings."""
        progress = read_progress(folder)
        saved = progress.get("config", {})
        differ = [
            f"{key} {saved[key]!r} there, {config[key]!r} now"
            for key in MUST_MATCH
            if key in saved and key in config and saved[key] != config[key]
        ]
        if differ:
            raise RecipeError(
                f"checkpoint {folder} belongs to a run with other settings ({'; '.join(differ)}); "
                "use the same flags to continue it, or another --output_dir to start a new run"
            )
        if saved.get("world_size") not in (None, config.get("world_size")):
            self.accelerator.print(
                f"warning: {folder} was written by {saved['world_size']} process(es), this run has "
                f"{config.get('world_size')}: training continues with the same global batch, but not bit for "
                "bit"
            )
        return progress

    def remove_partial(self) -> None:
        """Delete what interrupted saves and deletions left: every folder that is not a complete
        checkpoint (main process; resolve() calls it before the run's first save)."""
        if self.accelerator.is_main_process and self.directory.is_dir():
            for folder in self.directory.iterdir():
                if folder.is_dir() and not is_complete(folder):
                    shutil.rmtree(folder, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    @contextmanager
    def saving(self, step: int, progress: dict):
        """`with checkpoints.saving(step, progress) as path: accelerator.save_state(path)` on every
        process.

        The folder is named for the step once every process wrote its part and checkpoint.json is in
        place; the oldest complete checkpoints beyond `keep` are then deleted. A failed write on any
        process (a full disk, say) stops every process with the cause, and leaves the previous
        checkpoints as they were.
        """
        accelerator = self.accelerator
        final = self.directory / f"step_{step:08d}"
        partial = final.with_name(final.name + PARTIAL_SUFFIX)

        def failed(reason: str) -> str:
            previous = self.newest()
            kept = f"; the previous checkpoint {previous} is kept" if previous else ""
            return (
                f"could not write checkpoint {partial} ({reason}){kept}; free disk space or choose another "
                "--output_dir, then continue with --resume auto"
            )

        with writing_on_every_process(accelerator, partial, failed):
            yield partial
        record = dict(
            progress,
            step=step,
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            world_size=accelerator.num_processes,
        )
        if accelerator.is_main_process:
            publish(partial, final, PROGRESS_FILE, record)
        accelerator.wait_for_everyone()
        # a node that does not share the file system
        if accelerator.is_local_main_process and partial.exists():
            publish(partial, final, PROGRESS_FILE, record)
        if accelerator.is_main_process:
            for old in complete_checkpoints(self.directory)[: -self.keep]:
                # Renamed first: a deletion cut short leaves a
                # folder that is plainly not a checkpoint.
                doomed = old.with_name(old.name + DELETING_SUFFIX)
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        accelerator.wait_for_everyone()
        self.last_saved = final


@contextmanager
def writing_on_every_process(accelerator, partial: Path, failed_message):
    """Every process writes its part into `partial` (started over by the main process, created on
    each node); when any process's write failed, all of them raise
    RecipeError(failed_message(reason)), none is left waiting."""
    error = None
    try:
        if accelerator.is_main_process:  # a leftover of an interrupted save is started over
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
    except OSError as err:
        error = err
    accelerator.wait_for_everyone()
    try:
        if accelerator.is_local_main_process:  # a node that does not share the file system
            partial.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        error = error or err
    try:
        yield partial
    # OSError, or torch's RuntimeError "PytorchStreamWriter failed writing file"
    except Exception as err:
        error = error or err
    if any_process_failed(accelerator, error):
        reason = f"{type(error).__name__}: {error}" if error else "another process could not write its part"
        raise RecipeError(failed_message(reason))


def publish(partial: Path, final: Path, record_file: str, record: dict) -> None:
    """Write the record last (the folder is whole from then on), then swap the folder in under its
    final name.

    A version already there (the same step saved again after a resume, or the previous model_best)
    is renamed away first and deleted last: a crash between the renames leaves both versions whole.
    """
    tmp = partial / f"{record_file}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, partial / record_file)
    doomed = final.with_name(final.name + DELETING_SUFFIX)
    if final.exists():
        os.replace(final, doomed)
    os.replace(partial, final)
    shutil.rmtree(doomed, ignore_errors=True)


@contextmanager
def saving_folder(accelerator, final: str | Path, record_file: str, record: dict):
    """`with saving_folder(accelerator, out / "model_best", "best.json", info) as path:
    accelerator.save_model(net, path)`

    A folder that replaces its previous version only once whole, for what the main process writes (a
    model for inference, beside the checkpoints). Every process enters (saving under FSDP /
    DeepSpeed gathers the weights from all of them); the main process writes `record_file` last,
    then swaps the folder in. A failed write on any process stops every process with the cause and
    leaves the previous version in place; a crash leaves either version whole, which
    `recover_folder` puts back under the final name at the next start.
    """
    final = Path(final)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)

    def failed(reason: str) -> str:
        kept = f"; the previous {final.name} is kept" if final.exists() else ""
        return f"could not write {partial} ({reason}){kept}; free disk space or choose another --output_dir"

    with writing_on_every_process(accelerator, partial, failed):
        yield partial
    if accelerator.is_main_process:
        # recover_folder may promote it once its record is written
        publish(partial, final, record_file, record)
    accelerator.wait_for_everyone()
    # A node that does not share the file system: save_pretrained creates the folder on every
    # process, empty there.
    if not accelerator.is_main_process and partial.is_dir():
        shutil.rmtree(partial, ignore_errors=True)


def recover_folder(accelerator, final: str | Path, record_file: str) -> None:
    """What a crash in `saving_folder` left (main process; call before the first save): the newest
    whole version back under its final name, the rest deleted."""
    if not accelerator.is_main_process:
        return
    final = Path(final)
    partial, doomed = (
        final.with_name(final.name + PARTIAL_SUFFIX),
        final.with_name(final.name + DELETING_SUFFIX),
    )
    if not final.exists():
        # the new version once its record is written, else the previous one
        for candidate in (partial, doomed):
            if (candidate / record_file).is_file():
                os.replace(candidate, final)
                break
    for leftover in (partial, doomed):
        shutil.rmtree(leftover, ignore_errors=True)
