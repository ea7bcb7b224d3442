"""The shared helpers' rules, without starting a training."""

import json
import os
import socket
import time

import pytest
import torch
from conftest import PYTHON, recipe_env, run

from accelerate_recipes import RecipeError, explain_load_failure
from accelerate_recipes.cli import _drop_legacy_local_rank
from accelerate_recipes.launch import check_visible_gpus, per_process_batch_size
from accelerate_recipes.tracking import resolve_swanlab_mode, setup_tracker


def test_global_batch_splits_over_processes_and_accumulation():
    assert per_process_batch_size(512, 8, 1) == 64
    assert per_process_batch_size(512, 16, 2) == 16
    with pytest.raises(RecipeError, match="multiple of 24"):
        per_process_batch_size(500, 8, 3)


def test_a_model_that_cannot_be_loaded_is_one_line_naming_what_to_give(tmp_path):
    from transformers import AutoConfig

    empty = tmp_path / "empty"  # a local folder: transformers looks no further than its files
    empty.mkdir()
    with pytest.raises(RecipeError) as raised, explain_load_failure(str(empty), also=", a .gguf file"):
        AutoConfig.from_pretrained(empty)
    message = str(raised.value)
    assert message.startswith(f"could not load --model '{empty}' (") and "\n" not in message
    assert "config.json" in message and ", a .gguf file, or a Hugging Face Hub name while online" in message


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


def test_swanlab_login_is_the_main_process_concern_only(monkeypatch, tmp_path):
    # A rank on a node without `swanlab login` (RANK set
    # by the launcher, before any Accelerator exists).
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for key in ("SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_ROOT", "SWANLAB_SAVE_DIR", "SWANLAB_LOG_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    assert setup_tracker("swanlab", tmp_path / "run", "name", swanlab_mode="cloud").log_with == ["swanlab"]
    monkeypatch.setenv("RANK", "0")  # the main process decides, and says what to do
    with pytest.raises(RecipeError, match="cloud mode needs a login"):
        setup_tracker("swanlab", tmp_path / "run", "name", swanlab_mode="cloud")
    # a wrong flag is wrong on every rank
    with pytest.raises(RecipeError, match="unknown SwanLab mode"):
        monkeypatch.setenv("RANK", "1")
        resolve_swanlab_mode("clowd")


def test_swanlab_cloud_that_cannot_be_reached_logs_offline_within_seconds(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.setenv("SWANLAB_API_KEY", "x" * 21)  # logged in, but this node has no way out
    # a loopback port nobody listens on: refused, as a firewalled node would be
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("SWANLAB_API_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("RANK", raising=False)
    started = time.monotonic()
    setup = setup_tracker("swanlab", tmp_path / "run", "name", swanlab_mode="cloud")
    assert time.monotonic() - started < 5
    assert setup.swanlab_mode == "offline" and setup.init_kwargs["swanlab"]["mode"] == "offline"
    assert setup.init_kwargs["swanlab"]["log_dir"] == str((tmp_path / "run" / "swanlog").resolve())
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and f"127.0.0.1:{port}" in warning[0] and "offline" in warning[0]
    assert setup.where().startswith("SwanLab (offline, SwanLab cloud not reachable)")
    # Where the host answers, cloud mode stays.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("SWANLAB_API_HOST", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert (
            setup_tracker("swanlab", tmp_path / "run", "name", swanlab_mode="cloud").swanlab_mode == "online"
        )


AFFINITY_PROBE = """
import json, os, sys
import torch
from accelerate import Accelerator
from accelerate_recipes.launch import cpu_threads_and_workers, default_num_workers, usable_cores
os.sched_setaffinity(0, set(json.loads(sys.argv[1])))
accelerator = Accelerator(cpu=True)
requested = None if sys.argv[2] == "none" else int(sys.argv[2])
workers = cpu_threads_and_workers(accelerator, requested)
print(json.dumps({"cores": usable_cores(), "workers": workers, "threads": torch.get_num_threads(),
                  "gpu_default_workers": default_num_workers()}))
"""


def probe_cpu_sizing(tmp_path, cores, requested, **env):
    proc = run([PYTHON, "-c", AFFINITY_PROBE, json.dumps(cores), requested], recipe_env(tmp_path, **env))
    assert proc.returncode == 0, proc.output[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def test_cpu_threads_and_workers_fit_the_cores_this_process_may_use(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    two = allowed[:2]
    # One process on (up to) two cores: no workers, every core a torch thread; the line says so.
    sizing, out = probe_cpu_sizing(tmp_path, two, "none", OMP_NUM_THREADS="")
    assert sizing == {
        "cores": len(two),
        "workers": 0,
        "threads": len(two),
        "gpu_default_workers": len(two) - 1,
    }
    assert f"CPU: {len(two)} torch thread(s) and 0 DataLoader worker(s) per process" in out
    # Two local processes on those cores (make detect-cpu on 2 cores): 1 thread and 0 workers each.
    sizing, _ = probe_cpu_sizing(tmp_path, two, "none", OMP_NUM_THREADS="", LOCAL_WORLD_SIZE=2)
    assert (sizing["workers"], sizing["threads"]) == (0, 1)
    # Workers asked for take cores from torch; the
    # affinity mask, not os.cpu_count(), is what counts.
    sizing, _ = probe_cpu_sizing(tmp_path, allowed[:1], "1", OMP_NUM_THREADS="")
    assert sizing == {"cores": 1, "workers": 1, "threads": 1, "gpu_default_workers": 0}
    # A lower thread count from the launcher (--num_cpu_threads_per_process) is kept.
    sizing, _ = probe_cpu_sizing(tmp_path, two, "none", OMP_NUM_THREADS="1")
    assert sizing["threads"] == 1


def test_visible_gpus_must_cover_the_processes_of_this_machine(monkeypatch):
    # No GPU here: torch's count is set to what a 4-GPU machine reports, the rest of the check runs
    # as it would there.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_visible_gpus()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # make cifar-8gpu GPU_IDS=0,1,2,3 before the fix
    with pytest.raises(RecipeError) as err:
        check_visible_gpus()
    message = str(err.value)
    assert "\n" not in message and "LOCAL_WORLD_SIZE=8" in message and "4 GPU(s)" in message
    assert "--num_processes 4" in message and "--gpu_ids" in message
