"""A recipe is a template: copied into an empty folder outside the repository, it runs with the installed library only.

Each test follows README's "Copying a recipe as a template": copy the recipe (the script and the modules beside it
that it imports, or the whole detect/ folder) and accelerate_configs/cpu.yaml, then `accelerate launch` it from
that folder on 2 gloo processes. The repository's recipes/ folder is on no import path of those processes, so a
module the copy forgot fails the run; the copy's own __pycache__ shows its modules were the ones imported.
"""

import ast
import shutil
import subprocess
from pathlib import Path

import accelerate_recipes
from conftest import (ACCELERATE, CONFIGS, PYTHON, REPO, check, free_port, read_results, recipe_env, run,
                      sentiment_rows, tiny_bert, write_cifar10, write_rows)

RECIPES = REPO / "recipes"
LIBRARY = Path(accelerate_recipes.__file__).resolve().parent
README = (REPO / "README.md").read_text()


def local_imports(script: Path) -> set[str]:
    """Modules `script` imports from its own folder, and theirs in turn."""
    found, todo = set(), [script]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                path = script.parent / f"{name.split('.')[0]}.py"
                if path.is_file() and path.name not in found:
                    found.add(path.name)
                    todo.append(path)
    return found


def project(tmp_path: Path) -> tuple[Path, dict]:
    """An empty project folder outside the repository, and the environment of a user who installed the library.

    PYTHONPATH holds only a folder with the library package in it (where this checkout is not pip-installed, that
    stands in for site-packages); the repository root, and with it recipes/, is not on it.
    """
    folder = tmp_path / "my_project"
    folder.mkdir()
    assert REPO not in folder.resolve().parents
    site = tmp_path / "site"
    site.mkdir()
    (site / "accelerate_recipes").symlink_to(LIBRARY, target_is_directory=True)
    env = recipe_env(tmp_path, PYTHONPATH=site, ACCELERATE_USE_CPU="true")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the copy's __pycache__ is the evidence of what was imported
    shutil.copy(CONFIGS / "cpu.yaml", folder / "cpu.yaml")
    return folder, env


def check_isolated(folder: Path, env: dict) -> None:
    """From the project folder, the library imports from where it is installed and recipes/ is not importable."""
    probe = ("import importlib.util, sys, accelerate_recipes; print(accelerate_recipes.__file__); "
             "print(importlib.util.find_spec('recipes')); print(*sys.path, sep='\\n')")
    out = subprocess.run([PYTHON, "-c", probe], cwd=folder, env=env, capture_output=True, text=True, check=True)
    library, spec, *path = out.stdout.splitlines()
    assert Path(library).resolve().parent == LIBRARY
    assert spec == "None", spec
    assert not any(p and RECIPES in [Path(p).resolve(), *Path(p).resolve().parents] for p in path), path


def launch(folder: Path, env: dict, script: str, *args, timeout=300):
    cmd = [ACCELERATE, "launch", "--config_file", "cpu.yaml", "--num_processes", 2, "--main_process_port", free_port(),
           "--num_cpu_threads_per_process", 1, script, *args]
    return check(run(cmd, env, timeout=timeout, cwd=folder))


def imported_from_copy(folder: Path, modules: set[str]) -> None:
    cached = {p.name.split(".")[0] for p in (folder / "__pycache__").glob("*.pyc")}
    assert {m.removesuffix(".py") for m in modules} <= cached, (modules, cached)


def test_readme_names_every_file_a_copy_needs():
    section = README.split("## Copying a recipe as a template", 1)[1].split("\n## ", 1)[0]
    for script in ("cifar.py", "text_classification.py"):
        for name in {script} | local_imports(RECIPES / script):
            assert f"recipes/{name}" in section, name
    assert "recipes/detect/" in section and "cpu.yaml" in section


def assert_model_best(out: Path, *files: str) -> None:
    """Two processes saved model_best together (the only evaluation is the best) and left no half-written folder."""
    assert read_results(out)["best_epoch"] == 1
    for name in (*files, "best.json"):
        assert (out / "model_best" / name).is_file(), name
    assert not list(out.glob("model_best.*"))


def copy_recipe(folder, script: str) -> set[str]:
    """Copy a one-file recipe and the modules beside it that it imports; returns those modules."""
    modules = local_imports(RECIPES / script)
    for name in {script} | modules:
        shutil.copy(RECIPES / name, folder / name)
    return modules


def test_cifar_copy_runs_on_two_processes(tmp_path):
    folder, env = project(tmp_path)
    modules = copy_recipe(folder, "cifar.py")
    check_isolated(folder, env)
    write_cifar10(folder / "data", num_train=64, num_test=20)
    launch(folder, env, "cifar.py", "--dataset", "cifar10", "--data_dir", "data", "--download", "False",
           "--verify_data", "False", "--batch_size", 16, "--max_steps", 3, "--tracker", "none", "--num_workers", 0,
           "--output_dir", "out")
    results = read_results(folder / "out")
    assert (results["world_size"], results["steps"], results["eval_samples"]) == (2, 3, 20)
    assert "eval_accuracy" in results
    assert_model_best(folder / "out", "model.safetensors")
    imported_from_copy(folder, modules)


def test_text_classification_copy_runs_on_two_processes(tmp_path):
    folder, env = project(tmp_path)
    modules = copy_recipe(folder, "text_classification.py")
    check_isolated(folder, env)
    tiny_bert(folder / "tiny-bert")
    write_rows(folder / "data" / "train.csv", sentiment_rows(48, seed=0))
    write_rows(folder / "data" / "dev.csv", sentiment_rows(15, seed=1))
    launch(folder, env, "text_classification.py", "--model", "tiny-bert", "--train_file", "data/train.csv",
           "--validation_file", "data/dev.csv", "--batch_size", 8, "--max_steps", 3, "--tracker", "none",
           "--num_workers", 0, "--output_dir", "out")
    results = read_results(folder / "out")
    assert (results["world_size"], results["steps"], results["eval_samples"]) == (2, 3, 15)
    assert "eval_accuracy" in results and "eval_f1" in results
    assert_model_best(folder / "out", "model.safetensors", "config.json", "tokenizer.json")
    imported_from_copy(folder, modules)


def test_detect_folder_copy_runs_on_two_processes(tmp_path):
    folder, env = project(tmp_path)
    shutil.copytree(RECIPES / "detect", folder / "detect", ignore=shutil.ignore_patterns("__pycache__"))
    check_isolated(folder, env)
    # --data synthetic: the shapes set generated by the copied folder itself, in YOLO format under --data_dir.
    launch(folder, env, "detect/train.py", "--data", "synthetic", "--synthetic_size", 16, "--data_dir", "data",
           "--image_size", 64, "--batch_size", 4, "--max_steps", 2, "--tracker", "none", "--num_workers", 0,
           "--output_dir", "out")
    results = read_results(folder / "out")
    assert (results["world_size"], results["steps"]) == (2, 2)
    validation = list((folder / "data").glob("shapes-*/images/val/*"))
    assert "eval_map50_95" in results and results["eval_images"] == results["eval_unique_images"] == len(validation)
    assert_model_best(folder / "out", "model.safetensors", "detector.json")
    imported_from_copy(folder / "detect", local_imports(folder / "detect" / "train.py"))
