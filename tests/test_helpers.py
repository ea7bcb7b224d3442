"""The shared helpers' rules, without starting a training."""

import pytest

from accelerate_recipes import RecipeError, per_process_batch_size
from accelerate_recipes.cli import _drop_legacy_local_rank
from accelerate_recipes.tracking import resolve_swanlab_mode, setup_tracker


def test_global_batch_splits_over_processes_and_accumulation():
    assert per_process_batch_size(512, 8, 1) == 64
    assert per_process_batch_size(512, 16, 2) == 16
    with pytest.raises(RecipeError, match="multiple of 24"):
        per_process_batch_size(500, 8, 3)


def test_legacy_local_rank_flag_is_dropped():
    assert _drop_legacy_local_rank(["--local-rank=1", "--epochs", "2"]) == ["--epochs", "2"]
    assert _drop_legacy_local_rank(["--local_rank", "0", "--lr", "0.1"]) == ["--lr", "0.1"]


def test_swanlab_mode_without_login(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for key in ("SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_ROOT", "SWANLAB_SAVE_DIR"):
        monkeypatch.delenv(key, raising=False)
    assert resolve_swanlab_mode(None) == "offline"
    monkeypatch.setenv("SWANLAB_MODE", "disabled")
    assert resolve_swanlab_mode(None) == "disabled"
    assert resolve_swanlab_mode("offline") == "offline"  # the flag beats the environment
    monkeypatch.setenv("SWANLAB_API_KEY", "x" * 21)
    assert resolve_swanlab_mode("cloud") == "online"


def test_tracker_setup_for_swanlab_offline_writes_under_output_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    setup = setup_tracker("swanlab", tmp_path / "run", "name", swanlab_mode="offline")
    assert setup.log_with == ["swanlab"]
    assert setup.init_kwargs["swanlab"]["log_dir"] == str((tmp_path / "run" / "swanlog").resolve())
    assert setup_tracker("none", tmp_path, "name").log_with == []
