"""A recipe is a template: copied into an empty folder outside the repository, it runs with the
installed library only.

Each recipe's shared 2-process run (conftest's cifar_two, text_two, detect_two) follows README's
"Copying a recipe as a template": copy the recipe (the script and the modules beside it that it
imports, or the whole detect/ folder) and accelerate_configs/cpu.yaml, then `accelerate launch` it
from that folder on 2 gloo processes (under the host-read audit, which test_host_reads.py reads).
The repository's recipes/ folder is on no import path of those processes, so a module the copy
forgot fails the run; the copy's own __pycache__ shows its modules were the ones imported.
"""

import ast
import os
import subprocess
from pathlib import Path

from conftest import LIBRARY, PYTHON, RECIPES, REPO, local_imports, read_metrics, read_results

README = (REPO / "README.md").read_text()
STARTERS = sorted((RECIPES / "starters").glob("*.py"))
MAX_STARTER_LINES = 300
GUIDE = (REPO / "docs" / "template.md").read_text()


def check_isolated(folder: Path, env: dict) -> None:
    """From the project folder, the library imports from where it is installed and recipes/ is not
    importable."""
    probe = (
        "import importlib.util, sys, accelerate_recipes; print(accelerate_recipes.__file__); "
        "print(importlib.util.find_spec('recipes')); print(*sys.path, sep='\\n')"
    )
    out = subprocess.run(
        [PYTHON, "-c", probe], cwd=folder, env=env, capture_output=True, text=True, check=True
    )
    library, spec, *path = out.stdout.splitlines()
    assert Path(library).resolve().parent == LIBRARY
    assert spec == "None", spec
    assert not any(p and RECIPES in [Path(p).resolve(), *Path(p).resolve().parents] for p in path), path


def imported_from_copy(folder: Path, modules: set[str]) -> None:
    cached = {
        (p.parent.parent / p.name.split(".")[0]).relative_to(folder)
        for p in folder.rglob("__pycache__/*.pyc")
    }
    assert {Path(m.removesuffix(".py")) for m in modules} <= cached, (modules, cached)


def test_the_guide_names_every_file_a_copy_needs_and_the_readme_every_starter():
    section = GUIDE.split("## Copy a full recipe", 1)[1].split("\n## ", 1)[0]
    for script in ("cifar.py", "text_classification.py", "sft.py", "grpo.py", "dpo.py"):
        for name in {script} | local_imports(RECIPES / script):
            # a package's modules: the guide names its folder
            folder, _, module = name.rpartition("/")
            assert (f"recipes/{folder}/" if folder else f"recipes/{module}") in section, name
    assert "recipes/detect/" in section and "cpu.yaml" in section
    starters = sorted(p.name for p in (RECIPES / "starters").glob("*.py"))
    assert starters == ["cifar.py", "dpo.py", "grpo.py", "sft.py", "text_classification.py"]
    for text in (README.split("## Start your own project", 1)[1].split("\n## ", 1)[0], GUIDE):
        assert all(f"recipes/starters/{name}" in text for name in starters)


def function_source(script: Path, name: str) -> str:
    """The source of the function `name` in `script`, at any depth (save_checkpoint is nested in
    main)."""
    text = script.read_text()
    found = [
        node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    assert len(found) == 1, (script.name, name, len(found))
    return ast.get_source_segment(text, found[0])


def error_texts(script: Path) -> list[str]:
    """The literal text of every `raise SystemExit(...)` in `script`, its f-string fields left
    out."""
    texts = []
    for node in ast.walk(ast.parse(script.read_text())):
        if (
            isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", "") == "SystemExit"
        ):
            (message,) = node.exc.args
            parts = message.values if isinstance(message, ast.JoinedStr) else [message]
            texts.append("".join(p.value for p in parts if isinstance(p, ast.Constant)))
    return texts


def test_every_starter_keeps_the_shared_convention():
    """docs/template.md's "Starters share one convention", over every file in recipes/starters/: at
    most 250 lines; a docstring that names no Make target and no file of accelerate_configs/; bad
    input stops with one
    `error: <cause>; <fix>` line through SystemExit only; the same tracker and checkpoint functions;
    the step of a checkpoint read from its folder's name."""
    assert len(STARTERS) >= 4
    trackers, checkpoints = set(), set()
    for script in STARTERS:
        text = script.read_text()
        assert len(text.splitlines()) <= MAX_STARTER_LINES, (script.name, len(text.splitlines()))
        docstring = ast.get_docstring(ast.parse(text))
        assert "make " not in docstring and "accelerate_configs/" not in docstring, script.name
        assert "FlagError" not in text and "sys.exit(" not in text, script.name
        errors = error_texts(script)
        assert errors and all(e.startswith("error: ") and "; " in e for e in errors), (script.name, errors)
        trackers.add(function_source(script, "tracker_init_kwargs"))
        checkpoints.add(function_source(script, "save_checkpoint"))
        assert 'step = int(Path(resume).name.removeprefix("step_"))' in text, script.name
    assert len(trackers) == 1, "tracker_init_kwargs differs between starters"
    assert len(checkpoints) == 1, "save_checkpoint differs between starters"
    assert 'f"step_{step}"' in checkpoints.pop()


def test_the_starters_tracker_function_decides_without_swanlab(tmp_path, monkeypatch):
    """tracker_init_kwargs, run as the starters hold it: nothing for another tracker; for SwanLab
    the mode from $SWANLAB_MODE, else online once logged in (SWANLAB_API_KEY, or the .netrc `swanlab
    login` writes), else offline in output_dir/swanlog. It imports nothing, so swanlab is neither
    needed nor loaded to decide."""
    source = function_source(STARTERS[0], "tracker_init_kwargs")
    tree = ast.parse(source)
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert "swanlab." not in source
    namespace = {"os": os, "Path": Path}
    exec(compile(tree, str(STARTERS[0]), "exec"), namespace)
    tracker_init_kwargs = namespace["tracker_init_kwargs"]
    for key in ("SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_LOG_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = tmp_path / "out"

    def mode() -> str:
        return tracker_init_kwargs("swanlab", str(out), "run")["swanlab"]["mode"]

    assert (
        tracker_init_kwargs("none", str(out), "run")
        == tracker_init_kwargs("tensorboard", str(out), "run")
        == {}
    )
    offline = tracker_init_kwargs("swanlab", str(out), "run")["swanlab"]
    assert offline == {"mode": "offline", "name": "run", "log_dir": str((out / "swanlog").resolve())}
    monkeypatch.setenv("SWANLAB_API_KEY", "a-key")
    assert mode() == "online"
    monkeypatch.delenv("SWANLAB_API_KEY")
    (tmp_path / "home" / ".swanlab").mkdir(parents=True)
    (tmp_path / "home" / ".swanlab" / ".netrc").write_text(
        "machine api.swanlab.cn login user password a-key\n"
    )
    assert mode() == "online"
    monkeypatch.setenv("SWANLAB_MODE", "local")
    assert mode() == "local"


def assert_model_best(out: Path, metric: str, *files: str) -> None:
    """Two processes saved model_best together, at the best evaluation, and left no half-written
    folder."""
    results = read_results(out)
    values = [m[metric] for m in read_metrics(out) if metric in m]
    assert results["best_epoch"] == values.index(max(values)) + 1  # the first of equal ones
    for name in (*files, "best.json"):
        assert (out / "model_best" / name).is_file(), name
    assert not list(out.glob("model_best.*"))


def assert_copy_ran(two) -> None:
    """The copy ran from its own folder, on the installed library only, importing its modules from
    the copy."""
    check_isolated(two.folder, two.env)
    imported_from_copy(two.folder / Path(two.script).parent, two.modules)
    assert (two.out / "host_reads.json").is_file() and (two.out / "host_reads.rank1.json").is_file()


def test_cifar_copy_runs_on_two_processes(cifar_two):
    results = read_results(cifar_two.out)
    assert (results["world_size"], results["steps"], results["eval_samples"]) == (2, 8, 129)
    assert "eval_accuracy" in results
    assert_model_best(cifar_two.out, "eval/accuracy", "model.safetensors")
    assert_copy_ran(cifar_two)


def test_text_classification_copy_runs_on_two_processes(text_two):
    results = read_results(text_two.out)
    assert (results["world_size"], results["steps"], results["eval_samples"]) == (2, 32, 63)
    assert "eval_accuracy" in results and "eval_f1" in results
    assert_model_best(text_two.out, "eval/accuracy", "model.safetensors", "config.json", "tokenizer.json")
    assert_copy_ran(text_two)


def test_detect_folder_copy_runs_on_two_processes(detect_two):
    results = read_results(detect_two.out)
    assert (results["world_size"], results["steps"]) == (2, 6)
    validation = list((detect_two.folder / "data").glob("shapes-*/images/val/*"))
    assert "eval_map50_95" in results and results["eval_images"] == results["eval_unique_images"] == len(
        validation
    )
    assert_model_best(detect_two.out, "eval/map50_95", "model.safetensors", "detector.json")
    assert_copy_ran(detect_two)
