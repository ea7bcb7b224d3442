"""Experiment tracking through Accelerate's built-in trackers, SwanLab by default.

SwanLab needs no login here: without one (and with no mode asked for) the run is written offline
under the output directory and can be uploaded later with `swanlab sync`. Only the main process logs
(Accelerate does that).
"""

import importlib.util
import json
import os
import secrets
import socket
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from accelerate_recipes.errors import RecipeError

SWANLAB_MODES = ("online", "cloud", "offline", "local", "disabled")
# in the output directory: the tracker's id of the training it holds
TRACKER_RUN_FILE = "tracker_run.json"
RESUMABLE = {"swanlab", "wandb"}  # the trackers whose init takes an id and resume="allow"
IMAGE_TRACKERS = ("swanlab", "wandb")  # whose log_images takes a list of pictures per key
# SwanLab's default; SWANLAB_API_HOST points it at a private server
SWANLAB_API_HOST = "https://api.swanlab.cn"
# compute nodes without internet: give up on the cloud this fast instead of holding rank 0
REACH_SECONDS = 3.0


def is_main_process() -> bool:
    """Rank 0, known before the Accelerator exists: torchrun and accelerate launch set RANK; plain
    python is rank 0."""
    return os.environ.get("RANK", "0").strip() in ("0", "")


def swanlab_reachable(timeout: float = REACH_SECONDS) -> tuple[bool, str]:
    """(True, host) when a TCP connection to SwanLab's API host opens within `timeout` seconds, else
    (False, why)."""
    url = os.environ.get("SWANLAB_API_HOST") or SWANLAB_API_HOST
    parts = urlsplit(url if "://" in url else f"https://{url}")
    host, port = parts.hostname or url, parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return False, f"{host}:{port} ({err.strerror or type(err).__name__})"
    return True, f"{host}:{port}"


@dataclass
class TrackerSetup:
    """What `Accelerator(log_with=...)` and `accelerator.init_trackers(...)` need, plus a note for
    the user."""

    log_with: list[str] = field(default_factory=list)
    init_kwargs: dict = field(default_factory=dict)
    swanlab_mode: str | None = None
    swanlab_dir: Path | None = None
    offline_because: str = "not logged in"
    output_dir: Path | None = None
    run_id: str | None = None  # the training's id in its tracker (init_kwargs_for)

    def init_kwargs_for(self, resume_from: Path | None) -> dict:
        """`init_trackers`' init_kwargs for a run that resumes from `resume_from` (None: a fresh
        start): one experiment per training, as SwanLab and wandb continue the id of the training it
        continues with resume="allow" (the curves go on at the resumed step; offline parts sync into
        one); the other trackers start a new run, said in one line."""
        kwargs = {name: dict(self.init_kwargs.get(name, {})) for name in self.log_with}
        for name in self.log_with:
            if name in RESUMABLE:
                self.run_id = keep_run_id(self.output_dir, resume_from, name)
                kwargs[name].update(id=self.run_id, resume="allow")
            elif resume_from is not None and is_main_process():
                print(
                    f"{name}: a resumed run is logged as a new run ({name} takes no run id to continue)",
                    flush=True,
                )
        return kwargs

    def where(self) -> str | None:
        """One line saying where the run's tracking data is and how to look at it, or None when
        nothing is tracked."""
        if self.swanlab_mode in ("offline", "local"):
            runs = sorted(self.swanlab_dir.glob("run-*"), key=os.path.getmtime) if self.swanlab_dir else []
            run_dir = runs[-1] if runs else self.swanlab_dir
            run_id = self.run_id
            parts = [run for run in runs if run_id and run.name.endswith(f"-{run_id}")]
            # a resumed training: one folder per start
            if self.swanlab_mode == "offline" and len(parts) > 1:
                return (
                    f"SwanLab (offline, {self.offline_because}): run {run_id} saved in "
                    f"{len(parts)} parts, one per start, in {self.swanlab_dir}; upload them as one "
                    f"experiment with `swanlab sync {self.swanlab_dir}/run-*-{run_id}` after "
                    "`swanlab login`"
                )
            if self.swanlab_mode == "offline":
                return (
                    f"SwanLab (offline, {self.offline_because}): run saved in {run_dir}; upload it "
                    f"with `swanlab sync {run_dir}` after `swanlab login`, or log in before the "
                    "next run to track it in the cloud"
                )
            return f"SwanLab (local): run saved in {run_dir}; view it with `swanlab watch {self.swanlab_dir}`"
        if self.swanlab_mode == "online":
            return "SwanLab (cloud): the run's link is printed above by SwanLab"
        if self.log_with:
            return f"tracking with {', '.join(self.log_with)}"
        return None


def swanlab_logged_in() -> bool:
    """True when SwanLab will find an API key: SWANLAB_API_KEY or a saved `swanlab login`
    (.netrc)."""
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    user_dir = Path(
        os.environ.get("SWANLAB_ROOT") or os.environ.get("SWANLAB_SAVE_DIR") or Path.home() / ".swanlab"
    )
    return (Path.cwd() / ".swanlab" / ".netrc").is_file() or (user_dir / ".netrc").is_file()


def resolve_swanlab_mode(requested: str | None) -> str:
    """The SwanLab mode: the flag, else $SWANLAB_MODE, else cloud when logged in and offline when
    not.

    Only the main process logs, so only it looks at the login and the dashboard: the other ranks (on
    nodes that may have no login at all) take the mode as asked and never stop the run over it.
    """
    mode = (requested or os.environ.get("SWANLAB_MODE") or "").strip().lower()
    if mode and mode not in SWANLAB_MODES:
        raise RecipeError(f"unknown SwanLab mode {mode!r}; choose one of {', '.join(SWANLAB_MODES)}")
    if mode == "cloud":
        mode = "online"
    if not is_main_process():
        return mode or "offline"
    if not mode:
        return "online" if swanlab_logged_in() else "offline"
    if mode == "online" and not swanlab_logged_in():
        raise RecipeError(
            "SwanLab cloud mode needs a login: run `swanlab login` (or set SWANLAB_API_KEY), "
            "or pass --swanlab_mode offline to keep the run on disk and `swanlab sync` it later"
        )
    if mode == "local" and importlib.util.find_spec("swanboard") is None:
        raise RecipeError(
            "SwanLab local mode needs its dashboard: pip install 'swanlab[dashboard]' (or use "
            "--swanlab_mode offline)"
        )
    return mode


def new_run_id() -> str:
    """A tracker run id as SwanLab's own look: 21 lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(21))


def continued_run_id(output_dir: Path, resume_from: Path | None, tracker: str) -> str | None:
    """The id of the training a resumed run continues: kept in TRACKER_RUN_FILE in the output
    directory of the checkpoint it resumes from (<output_dir>/checkpoints/step_N), else in
    --output_dir, for the same tracker; None for a fresh start."""
    if resume_from is None:
        return None
    for folder in (Path(resume_from).resolve().parent.parent, output_dir):
        try:
            saved = json.loads((folder / TRACKER_RUN_FILE).read_text())
        except (OSError, ValueError):
            continue
        if saved.get("tracker") == tracker and saved.get("id"):
            return str(saved["id"])
    return None


def keep_run_id(output_dir: str | Path, resume_from: Path | None, tracker: str) -> str:
    """This training's tracker id: the one a resumed run continues (continued_run_id), else a new
    one, written to TRACKER_RUN_FILE by the main process so that every later resume logs into the
    same experiment."""
    output = Path(output_dir)
    run_id = continued_run_id(output, resume_from, tracker) or new_run_id()
    if is_main_process():
        try:
            (output / TRACKER_RUN_FILE).write_text(json.dumps({"tracker": tracker, "id": run_id}) + "\n")
        except OSError:
            # prepare_output_dir has named the cause of an output directory that cannot be written
            pass
    return run_id


def setup_tracker(
    tracker: str | None, output_dir: str | Path, run_name: str, swanlab_mode: str | None = None
):
    """Validate `--tracker` and build the arguments Accelerate needs for it (init_kwargs_for gives
    them once the checkpoint a run resumes from is known).

    tracker: "swanlab" (default), "none", or any tracker Accelerate knows by name (tensorboard,
    wandb, mlflow, ...).
    """
    name = str(tracker or "none").strip().lower()
    if name in ("none", "", "false", "off"):
        return TrackerSetup()
    known = [t.value for t in LoggerType if t.value != "all"]
    if name not in known:
        raise RecipeError(f"unknown tracker {tracker!r}; choose one of: none, {', '.join(known)}")
    if name not in [str(t) for t in get_available_trackers()]:
        package = {"comet_ml": "comet-ml"}.get(name, name)
        raise RecipeError(f"tracker {name!r} is not installed: pip install {package}, or pass --tracker none")
    if name != "swanlab":
        return TrackerSetup(log_with=[name], output_dir=Path(output_dir))

    mode = resolve_swanlab_mode(swanlab_mode)
    offline_because = "as asked" if swanlab_mode or os.environ.get("SWANLAB_MODE") else "not logged in"
    if mode == "online" and is_main_process():
        reachable, where = swanlab_reachable()
        if not reachable:
            # Without internet SwanLab would retry for a long
            # time while every other rank waits for rank 0.
            print(
                f"warning: SwanLab cloud is not reachable from this node ({where} within "
                f"{REACH_SECONDS:g} s); logging offline instead: upload the run later with "
                "`swanlab sync`",
                file=sys.stderr,
                flush=True,
            )
            mode, offline_because = "offline", "SwanLab cloud not reachable"
    log_dir = Path(os.environ.get("SWANLAB_LOG_DIR") or Path(output_dir) / "swanlog").resolve()
    # Keyword arguments passed through to swanlab.init on the main process.
    kwargs = {"mode": mode, "name": run_name}
    if mode in ("offline", "local"):
        kwargs["log_dir"] = str(log_dir)
    return TrackerSetup(
        log_with=["swanlab"],
        init_kwargs={"swanlab": kwargs},
        swanlab_mode=mode,
        swanlab_dir=log_dir,
        offline_because=offline_because,
        output_dir=Path(output_dir),
    )


def log_images(accelerator, images: dict[str, list], step: int) -> None:
    """Pictures (PIL images or arrays), a list per key, to the trackers that take them: SwanLab (as
    swanlab.Image) and wandb (as wandb.Image); nothing for the others. Only the main process has
    trackers. A picture that cannot be logged is one warning line, never the end of a run."""
    for tracker in accelerator.trackers:
        if tracker.name not in IMAGE_TRACKERS or not images:
            continue
        try:
            tracker.log_images(images, step=step)
        except Exception as err:  # pictures are a convenience
            accelerator.print(f"warning: could not log images to {tracker.name}: {err}")


def log_image_files(accelerator, files: dict[str, str | Path], step: int) -> None:
    """Picture files a run has written (results.png, confusion_matrix.png, ...) to the trackers
    that take images (log_images), each under its key; a file not there (no matplotlib, no
    evaluation yet) is left out."""
    if not any(tracker.name in IMAGE_TRACKERS for tracker in accelerator.trackers):
        return
    from PIL import Image

    images = {}
    for key, path in files.items():
        if Path(path).is_file():
            with Image.open(path) as picture:
                images[key] = [picture.convert("RGB")]
    log_images(accelerator, images, step)
