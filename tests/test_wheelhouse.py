"""Offline machines: `recipe_tools.wheelhouse` describes an interpreter, checks it against the
project's requirements, and downloads from the package index only the wheels a described target
lacks (for its Python and platform)."""

import json
import zipfile

from conftest import PYTHON, REPO, fails_with, recipe_env, run

TOOL = [PYTHON, "-m", "recipe_tools.wheelhouse"]


def describe(tmp_path) -> dict:
    proc = run([*TOOL, "describe"], recipe_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.output[-2000:]
    return json.loads(proc.stdout)


def test_describe_and_check_this_interpreter(tmp_path):
    target = describe(tmp_path)
    major, minor = target["python_version"].split(".")
    assert int(major) == 3 and int(minor) >= 10 and target["implementation"] == "cp"
    assert {"torch", "accelerate", "transformers", "fire"} <= set(target["packages"])
    assert target["platforms"][-1].startswith("linux_") and any(
        t.startswith("manylinux_2_") for t in target["platforms"]
    )
    proc = run([*TOOL, "check", "--extras", "text,detect"], recipe_env(tmp_path), timeout=120)
    assert proc.returncode == 0 and "has every requirement" in proc.stdout, proc.output[-2000:]


def test_download_fetches_only_what_the_target_lacks_for_its_python(tmp_path):
    """A target like an offline GPU image: another Python version, everything but fire (and fire's
    termcolor)."""
    target = describe(tmp_path)
    for name in ("fire", "termcolor"):
        target["packages"].pop(name)
    target["python_version"] = "3.12"
    (tmp_path / "target.json").write_text(json.dumps(target))
    out = tmp_path / "wheels"
    proc = run(
        [*TOOL, "download", tmp_path / "target.json", "--extras", "text,detect", "--out", out],
        recipe_env(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.output[-3000:]
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == ["fire", "termcolor"], wheels
    pins = (out / "requirements.txt").read_text().split()
    assert [p.split("==")[0] for p in pins] == ["fire", "termcolor"]
    for wheel in out.glob("*.whl"):  # real wheels, installable on that Python
        assert zipfile.ZipFile(wheel).testzip() is None
        assert wheel.name.endswith("-py3-none-any.whl") or "cp312" in wheel.name
    assert "--no-index --find-links" in (out / "INSTALL.txt").read_text() and "--no-index" in proc.stdout


def test_a_target_with_everything_downloads_nothing(tmp_path):
    (tmp_path / "target.json").write_text(json.dumps(describe(tmp_path)))
    proc = run(
        [*TOOL, "download", tmp_path / "target.json", "--out", tmp_path / "wheels"], recipe_env(tmp_path)
    )
    assert proc.returncode == 0 and "nothing to download" in proc.stdout, proc.output[-2000:]
    assert not list((tmp_path / "wheels").glob("*.whl"))


def test_bad_input_is_one_line(tmp_path):
    env = recipe_env(tmp_path)
    fails_with(
        run([*TOOL, "download", tmp_path / "none.json"], env), "none.json not found", "describe > target.json"
    )
    (tmp_path / "bad.json").write_text('{"python_version": "3.12"}')
    fails_with(run([*TOOL, "download", tmp_path / "bad.json"], env), "is not the output of", "write it again")
    fails_with(run([*TOOL, "check", "--extras", "text,gpu"], env), "unknown extra(s) gpu", "choose from")
    proc = run(["make", "--no-print-directory", "wheelhouse"], env, cwd=REPO)
    assert proc.returncode == 2 and "set TARGET_ENV" in proc.stderr
