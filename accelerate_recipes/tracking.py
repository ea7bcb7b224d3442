"""Experiment tracking through Accelerate's built-in trackers, SwanLab by default.

SwanLab needs no login here: without one (and with no mode asked for) the run is written offline under the output
directory and can be uploaded later with `swanlab sync`. Only the main process logs (Accelerate does that).
"""

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from accelerate_recipes.cli import RecipeError

SWANLAB_MODES = ("online", "cloud", "offline", "local", "disabled")


@dataclass
class TrackerSetup:
    """What `Accelerator(log_with=...)` and `accelerator.init_trackers(...)` need, plus a note for the user."""

    log_with: list[str] = field(default_factory=list)
    init_kwargs: dict = field(default_factory=dict)
    swanlab_mode: str | None = None
    swanlab_dir: Path | None = None

    def where(self) -> str | None:
        """One line saying where the run's tracking data is and how to look at it, or None when nothing is tracked."""
        if self.swanlab_mode in ("offline", "local"):
            runs = sorted(self.swanlab_dir.glob("run-*"), key=os.path.getmtime) if self.swanlab_dir else []
            run_dir = runs[-1] if runs else self.swanlab_dir
            if self.swanlab_mode == "offline":
                return (
                    f"SwanLab (offline, not logged in): run saved in {run_dir}; upload it with `swanlab sync {run_dir}` "
                    "after `swanlab login`, or log in before the next run to track it in the cloud"
                )
            return f"SwanLab (local): run saved in {run_dir}; view it with `swanlab watch {self.swanlab_dir}`"
        if self.swanlab_mode == "online":
            return "SwanLab (cloud): the run's link is printed above by SwanLab"
        if self.log_with:
            return f"tracking with {', '.join(self.log_with)}"
        return None


def swanlab_logged_in() -> bool:
    """True when SwanLab will find an API key: SWANLAB_API_KEY or a saved `swanlab login` (.netrc)."""
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    user_dir = Path(os.environ.get("SWANLAB_ROOT") or os.environ.get("SWANLAB_SAVE_DIR") or Path.home() / ".swanlab")
    return (Path.cwd() / ".swanlab" / ".netrc").is_file() or (user_dir / ".netrc").is_file()


def resolve_swanlab_mode(requested: str | None) -> str:
    """The SwanLab mode: the flag, else $SWANLAB_MODE, else cloud when logged in and offline when not."""
    mode = (requested or os.environ.get("SWANLAB_MODE") or "").strip().lower()
    if not mode:
        return "online" if swanlab_logged_in() else "offline"
    if mode not in SWANLAB_MODES:
        raise RecipeError(f"unknown SwanLab mode {mode!r}; choose one of {', '.join(SWANLAB_MODES)}")
    if mode == "cloud":
        mode = "online"
    if mode == "online" and not swanlab_logged_in():
        raise RecipeError(
            "SwanLab cloud mode needs a login: run `swanlab login` (or set SWANLAB_API_KEY), "
            "or pass --swanlab_mode offline to keep the run on disk and `swanlab sync` it later"
        )
    if mode == "local" and importlib.util.find_spec("swanboard") is None:
        raise RecipeError(
            "SwanLab local mode needs its dashboard: pip install 'swanlab[dashboard]' (or use --swanlab_mode offline)"
        )
    return mode


def setup_tracker(tracker: str | None, output_dir: str | Path, run_name: str, swanlab_mode: str | None = None):
    """Validate `--tracker` and build the arguments Accelerate needs for it.

    tracker: "swanlab" (default), "none", or any tracker Accelerate knows by name (tensorboard, wandb, mlflow, ...).
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
        return TrackerSetup(log_with=[name])

    mode = resolve_swanlab_mode(swanlab_mode)
    log_dir = Path(os.environ.get("SWANLAB_LOG_DIR") or Path(output_dir) / "swanlog").resolve()
    # Keyword arguments passed through to swanlab.init on the main process.
    kwargs = {"mode": mode, "name": run_name}
    if mode in ("offline", "local"):
        kwargs["log_dir"] = str(log_dir)
    return TrackerSetup(
        log_with=["swanlab"], init_kwargs={"swanlab": kwargs}, swanlab_mode=mode, swanlab_dir=log_dir
    )
