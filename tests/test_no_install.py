"""A plain checkout runs with an interpreter that has the dependencies but not this package, with no
venv and no install step (`PYTHON_ENV=system`): what a GPU machine with PyTorch preinstalled, often
offline, offers."""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import REPO, recipe_env, run, time_limit


def bare_interpreter(folder):
    """A venv without pip whose only packages are this environment's site-packages, read through a
    .pth line: the dependencies are there, this project is not (its editable install is a .pth of
    that folder, which Python does not follow from a .pth-added path)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=time_limit(120)
    )
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def clean_checkout(folder):
    """The files a clone would hold: tracked and not ignored, as they are in the working tree
    now."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, names):
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    return folder


def test_gpu_check_cpu_smoke_runs_from_a_plain_checkout_without_installing(tmp_path):
    python = bare_interpreter(tmp_path / "py")
    checkout = clean_checkout(tmp_path / "checkout")
    env = recipe_env(tmp_path)
    env.pop("PYTHONPATH", None)
    probe = run(
        [python, "-c", "import torch, accelerate, transformers, fire; import accelerate_recipes"],
        env,
        cwd=tmp_path,
    )
    # the dependencies, not the package
    assert "No module named 'accelerate_recipes'" in probe.stderr, probe.output

    out = tmp_path / "check"
    proc = run(
        [
            "make",
            "--no-print-directory",
            "gpu-check",
            "PYTHON_ENV=system",
            f"PYTHON={python}",
            f"ARGS=--device cpu --quick --steps ddp,allreduce --output_dir {out}",
        ],
        env,
        cwd=checkout,
        timeout=600,
    )
    assert proc.returncode == 0, proc.output[-4000:]
    assert not (checkout / ".venv").exists() and "pip install" not in proc.output
    report = json.loads((out / "report.json").read_text())
    steps = {r["step"]: r for r in report["steps"]}
    assert steps["ddp"]["status"] == steps["allreduce"]["status"] == "pass", proc.output[-4000:]
    assert steps["ddp"]["figures"]["world_size"] == 2 and steps["allreduce"]["figures"]["world_size"] == 2
    assert f"{python} -m accelerate.commands.accelerate_cli launch" in steps["ddp"]["commands"][0]
    assert "PYTHON_ENV=system" in steps["allreduce"]["commands"][0]
    assert report["machine"]["python"] and report["machine"]["torch"]
