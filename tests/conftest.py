"""Shared helpers: run the recipes as users do (subprocesses), write tiny data in real on-disk
formats."""

import fcntl
import functools
import getpass
import importlib.metadata
import json
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cifar_data import synthetic_images
from time_scale import MEASURED_BEFORE_THE_SUITE, time_scale

import accelerate_recipes

REPO = Path(__file__).resolve().parents[1]
CIFAR_SCRIPT = REPO / "recipes" / "cifar.py"
DETECT_SCRIPT = REPO / "recipes" / "detect" / "train.py"
AUDIT = REPO / "benchmarks" / "host_reads.py"
CONFIGS = REPO / "accelerate_configs"
BIN = Path(sys.executable).parent
ACCELERATE = str(BIN / "accelerate")
TORCHRUN = str(BIN / "torchrun")
PYTHON = sys.executable
# DeepSpeed compiles its CPU communication kernel on first use: kept in this user's cache (not a
# test's HOME), one folder per torch release, because the suite also runs under .venv-oldest and a
# kernel built for another torch fails to load there
# (each environment would rebuild it over the other's).
TORCH_EXTENSIONS = (
    Path.home() / ".cache" / "torch_extensions" / f"torch-{importlib.metadata.version('torch')}"
)

# A run whose pictures no test looks at draws none (about a second of each run's start-up and end).
NO_PLOTS = ["--plots", "False"]
# Small enough for 2 CPU cores, large enough that the network visibly learns.
TINY = [
    *NO_PLOTS,
    "--dataset",
    "synthetic",
    "--synthetic_size",
    "160",
    "--batch_size",
    "16",
    "--max_steps",
    "2",
    "--tracker",
    "none",
    "--num_workers",
    "0",
    "--log_every",
    "1",
]


TIME_SCALE = time_scale()


def time_limit(seconds: float) -> float:
    """A time limit written for the reference machine, on this one."""
    return seconds * TIME_SCALE


def pytest_report_header(config):
    source = "TEST_TIME_SCALE" if os.environ.get("TEST_TIME_SCALE") else "measured against the reference CPU"
    if MEASURED_BEFORE_THE_SUITE and not os.environ.get("TEST_TIME_SCALE"):
        source += ", before the suite and the second environment started"
    return f"time limits x {TIME_SCALE:.2f} ({source})"


def pytest_collection_modifyitems(config, items):
    """pytest-timeout's limit per test (pyproject's `timeout`, or a test's own mark) scaled like
    every other limit."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        seconds = (
            default
            if mark is None
            else float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default))
        )
        if seconds:
            item.add_marker(pytest.mark.timeout(time_limit(seconds)), append=False)


# torch.compile's on-disk cache does not tell kernels built under ATEN_CPU_CAPABILITY=avx2 (make
# test-portable) from native ones: a native run that loaded them crashed ("malloc(): unaligned
# fastbin chunk detected"). One cache per instruction-set limit, for every run the suite starts.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    isa_limit = "-".join(
        os.environ.get(name, "native") for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{isa_limit.lower()}"
    )


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port that is free now and that no other test of this session is given.

    The kernel's own choice (bind to port 0) comes from its ephemeral range, where it also puts the
    local end of every connection and where another pytest worker may be given the same number
    before a launcher binds it. So each worker draws from a block of its own below that range
    (20000-29999 split between up to 4 workers), never twice.
    TEST_PORT_BLOCK=4 gives a session that runs beside another (`make test-oldest` during the suite,
    say) 30000-32499.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 4
    worker = int(os.environ.get("TEST_PORT_BLOCK", worker))
    low = 20000 + 2500 * worker
    for port in random.Random().sample(range(low, low + 2500), 2500):
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{low + 2499}")


def recipe_env(tmp_path: Path, **extra) -> dict:
    """Environment of a user with no SwanLab login and no internet, one CPU thread per process."""
    env = dict(os.environ)
    for key in (
        "SWANLAB_MODE",
        "SWANLAB_API_KEY",
        "SWANLAB_LOG_DIR",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "ACCELERATE_USE_CPU",
        "ACCELERATE_MIXED_PRECISION",
        "CUDA_VISIBLE_DEVICES",
    ):
        env.pop(key, None)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=300, cwd=REPO, input=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=time_limit(timeout),
        input=input,
    )
    proc.output = proc.stdout + proc.stderr
    return proc


def check(proc) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.output[-6000:]}"
    return proc


def fails_with(proc, *fragments) -> str:
    """The run failed with exactly one `error: ...` line holding every fragment, and no
    traceback."""
    assert proc.returncode != 0, proc.output[-3000:]
    assert "Traceback" not in proc.output, proc.output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def stopped_with(proc, out, *fragments) -> list[str]:
    """A multi-process run stopped before writing results, with the one-line error holding every
    fragment.

    Every rank finds the same fault; the launcher stops the others as soon as one exits, so which
    ranks get to print their line ("error: ..." on rank 0, "error (rank 1): ..." elsewhere) is a
    race: each line that did must hold them.
    """
    assert proc.returncode != 0 and not (Path(out) / "results.json").exists(), proc.output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if re.match(r"error( \(rank \d+\))?: ", line)]
    assert errors, proc.stderr[-3000:]
    for fragment in fragments:
        assert all(fragment in line for line in errors), (fragment, errors)
    return errors


def read_results(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "results.json").read_text())


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(output_dir) if "train/loss" in m}


def check_png(path, min_width=400, min_height=300):
    """A real picture: a PNG at least this big with more than a few colours (not blank, not one flat
    colour)."""
    from PIL import Image

    image = Image.open(path)
    assert image.format == "PNG", path
    image = image.convert("RGB")
    assert image.width >= min_width and image.height >= min_height, (path, image.size)
    assert len(image.getcolors(maxcolors=1 << 20)) > 20, f"{path} is nearly a single colour"
    return image


def write_cifar10(root: Path, num_train: int, num_test: int, seed: int = 0) -> Path:
    """CIFAR-10 in its release's python format
    (root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta})."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name, images, labels):
        # N x 3072: all R, then G, then B
        rows = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
        entry = {
            "batch_label": name,
            "labels": labels.tolist(),
            "data": rows,
            "filenames": [f"{name}_{i}.png" for i in range(len(images))],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)

    train_x, train_y = synthetic_images(num_train, 10, seed=seed)
    test_x, test_y = synthetic_images(num_test, 10, seed=seed + 1)
    for i, (xs, ys) in enumerate(zip(np.array_split(train_x, 5), np.array_split(train_y, 5)), start=1):
        dump(f"data_batch_{i}", xs, ys)
    dump("test_batch", test_x, test_y)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(
            {"label_names": names, "num_cases_per_batch": num_train // 5, "num_vis": 3072}, f, protocol=2
        )
    return root


@pytest.fixture
def env(tmp_path):
    return recipe_env(tmp_path)


TEXT_SCRIPT = REPO / "recipes" / "text_classification.py"
POSITIVE = "good great fine superb lovely brilliant".split()
NEGATIVE = "bad awful poor dull boring terrible".split()
NEUTRAL = "the a movie film plot actor story was is and it very".split()


def tiny_bert(folder: Path) -> Path:
    """A 2-layer, hidden-32 BERT with random weights (seeded: every session trains the same network)
    and a word-level tokenizer over the test vocabulary."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POSITIVE + NEGATIVE + NEUTRAL
    BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)}).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def sentiment_rows(n: int, seed: int) -> list[dict]:
    """Learnable review-like rows: three sentiment words among three neutral ones; labels
    "positive"/"negative"."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["positive", "negative"])
        words = rng.sample(NEUTRAL, 3) + rng.sample(POSITIVE if label == "positive" else NEGATIVE, 3)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """rows as CSV (.csv) or JSON lines (.jsonl), the formats users hand the text recipe."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


# --------------------------------------------------------------------------------- the suite's disk
# pyproject.toml has pytest remove a test's tmp_path once it passes; a module's shared runs (a CIFAR
# run with its checkpoints is ~250 MB) go when the module is done. Kept to the session's end, they
# took ~10 GB at the peak.


class ModuleFolders:
    """tmp_path_factory's mktemp for one test module's shared runs, remembering what it made."""

    def __init__(self, factory):
        self.factory, self.made = factory, []

    def mktemp(self, name: str) -> Path:
        self.made.append(self.factory.mktemp(name))
        return self.made[-1]


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    """Folders for a module's shared runs, removed when its tests are done; kept for a look once any
    test failed."""
    folders = ModuleFolders(tmp_path_factory)
    yield folders
    if request.session.testsfailed == 0:
        for path in folders.made:
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------- session runs, built once for all workers
class SharedFolders:
    """mktemp as tmp_path_factory's, in a folder that every pytest-xdist worker of this run sees
    (pytest-N/shared, beside the workers' own popen-gwK folders, which a worker removes when it
    ends)."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))


def built_once_for_all_workers(fixture):
    """A session fixture (a shared recipe run, or the data and models it reads) built by the first
    worker that asks for it and read back by the others: without this each worker (one per core)
    trains the same run again. The worker that builds holds a lock on it meanwhile; the others wait
    for it (a run takes both cores anyway), then unpickle the value. Its folders come from
    SharedFolders instead of the worker's tmp_path_factory."""

    @functools.wraps(fixture)
    def shared(*args, tmp_path_factory, **kwargs):
        base = tmp_path_factory.getbasetemp()
        root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
        root.mkdir(exist_ok=True)
        value_file = root / f"{fixture.__name__}.pickle"
        with open(root / f"{fixture.__name__}.lock", "w") as lock:
            # released when the file closes, also if the build fails
            fcntl.flock(lock, fcntl.LOCK_EX)
            if value_file.is_file():
                return pickle.loads(value_file.read_bytes())
            value = fixture(*args, tmp_path_factory=SharedFolders(root), **kwargs)
            value_file.write_bytes(pickle.dumps(value))
            return value

    return shared


# ---------------------------------------------------------------------------------------- tiny BERT


@pytest.fixture(scope="session")
@built_once_for_all_workers
def tiny_bert_dir(tmp_path_factory) -> Path:
    """One tiny BERT for the whole session (the tests only read it)."""
    return tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
@built_once_for_all_workers
def text_data(tiny_bert_dir, tmp_path_factory) -> dict:
    """The tiny BERT and learnable reviews: 256 training rows (16 steps of 16 per epoch), 63
    validation rows (an odd
    count: with two processes the sampler pads one example, which must not be counted twice)."""
    root = tmp_path_factory.mktemp("text-data")
    return {
        "model": tiny_bert_dir,
        "train": write_rows(root / "reviews" / "train.csv", sentiment_rows(256, seed=0)),
        "validation": write_rows(root / "reviews" / "dev.csv", sentiment_rows(63, seed=1)),
        "root": root,
    }


# -------------------------------------------------------------------- a recipe copied as a template
LIBRARY = Path(accelerate_recipes.__file__).resolve().parent
RECIPES = REPO / "recipes"


def local_imports(script: Path) -> set[str]:
    """Modules `script` imports from its own folder or a package there (`from chat.model import
    ...`), and theirs in turn, relative imports inside the package included: their paths relative to
    the script's folder."""
    import ast

    root = script.parent
    found, todo = set(), [script]
    while todo:
        module = todo.pop()
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                paths = [root / f"{a.name.replace('.', '/')}.py" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = module.parent / (node.module or "").replace(".", "/")
                paths = (
                    [base.with_suffix(".py")] if node.module else [base / f"{a.name}.py" for a in node.names]
                )
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = root / node.module.replace(".", "/")
                paths = [base.with_suffix(".py"), *(base / f"{a.name}.py" for a in node.names)]
            else:
                continue
            for path in paths:
                name = path.relative_to(root).as_posix() if path.is_file() else None
                if name and name not in found:
                    found.add(name)
                    todo.append(path)
    return found


def template_project(tmp_path: Path) -> tuple[Path, dict]:
    """An empty project folder outside the repository, and the environment of a user who installed
    the library.

    PYTHONPATH holds only a folder with the library package in it (where this checkout is not
    pip-installed, that stands in for site-packages); the repository root, and with it recipes/, is
    not on it.
    """
    folder = tmp_path / "my_project"
    folder.mkdir()
    assert REPO not in folder.resolve().parents
    site = tmp_path / "site"
    site.mkdir()
    (site / "accelerate_recipes").symlink_to(LIBRARY, target_is_directory=True)
    env = recipe_env(tmp_path, PYTHONPATH=site, ACCELERATE_USE_CPU="true")
    # the copy's __pycache__ is the evidence of what was imported
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    shutil.copy(CONFIGS / "cpu.yaml", folder / "cpu.yaml")
    return folder, env


def copy_recipe(folder: Path, recipe: str) -> tuple[str, set[str]]:
    """Copy a recipe as README says: a one-file recipe and the modules beside it that it imports, or
    the detect/ folder. Returns the script to run, relative to the folder, and the modules it must
    import from the copy."""
    if recipe == "detect":
        shutil.copytree(RECIPES / "detect", folder / "detect", ignore=shutil.ignore_patterns("__pycache__"))
        return "detect/train.py", local_imports(folder / "detect" / "train.py")
    modules = local_imports(RECIPES / recipe)
    for name in {recipe} | modules:
        package = Path(name).parts[0] if "/" in name else None
        if package is None:
            shutil.copy(RECIPES / name, folder / name)
        # a package (the chat layer) is copied whole, as the guide says
        elif not (folder / package).exists():
            shutil.copytree(RECIPES / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    return recipe, modules


def launch_audited_copy(
    folder: Path, env: dict, script: str, *args, timeout=600
) -> subprocess.CompletedProcess:
    """`accelerate launch` on 2 gloo processes from the project folder, each process running the
    copied script under the host-read audit (benchmarks/host_reads.py runs the script as __main__
    with the script's folder first on sys.path, as `python script` would; recipes/ stays on no
    import path)."""
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        "cpu.yaml",
        "--num_processes",
        2,
        "--main_process_port",
        free_port(),
        "--num_cpu_threads_per_process",
        1,
        AUDIT,
        script,
        *args,
    ]
    return check(run(cmd, env, timeout=timeout, cwd=folder))


# What a starter may import besides the standard
# library: the public packages a user installs with pip.
STARTER_PACKAGES = {
    "accelerate",
    "torch",
    "torchvision",
    "transformers",
    "datasets",
    "peft",
    "swanlab",
    "fire",
}


def imported_packages(script: Path) -> set[str]:
    """The top-level packages a script imports (absolute imports only: a relative one fails
    here)."""
    import ast

    imported = set()
    for node in ast.walk(ast.parse(Path(script).read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import of {node.module} in {script}"
            imported.add(node.module.split(".")[0])
    return imported


def assert_public_imports_only(script: Path) -> set[str]:
    imported = imported_packages(script)
    assert imported - STARTER_PACKAGES - set(sys.stdlib_module_names) == set(), imported
    return imported


def without_library(tmp: Path) -> Path:
    """A folder to put first on PYTHONPATH so that this project's code cannot be imported: its
    library (installed in this environment) and the modules beside the recipes are shadowed by ones
    that raise ImportError."""
    decoys = tmp / "without-library"
    for package in ("accelerate_recipes", "chat"):
        (decoys / package).mkdir(parents=True, exist_ok=True)
    refuse = "raise ImportError('a starter imports public packages only')\n"
    for module in ("accelerate_recipes/__init__.py", "cifar_data.py", "chat/__init__.py"):
        (decoys / module).write_text(refuse)
    return decoys


def sharded_launch(root: Path, name: str, config: str, script: Path, *args, launcher=(), ok=True):
    """`script` under `accelerate launch` with `config` (cpu.yaml, fsdp.yaml, deepspeed.yaml) on 2
    CPU processes in fp32, as `make text-fsdp` / `make sft-fsdp` start it on a CPU box; output in
    root/name. Returns (proc, out)."""
    out = root / name
    env = recipe_env(root, ACCELERATE_USE_CPU="true", TORCH_EXTENSIONS_DIR=TORCH_EXTENSIONS)
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        CONFIGS / config,
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
    ]
    cmd += [
        "--num_cpu_threads_per_process",
        "1",
        "--main_process_port",
        free_port(),
        *launcher,
        script,
        *args,
    ]
    proc = run([*cmd, "--output_dir", out], env, timeout=300)
    return (check(proc) if ok else proc), out


def two_process_template_run(tmp_path_factory, recipe: str, *args) -> SimpleNamespace:
    """The recipe copied into an empty project folder, run there on 2 gloo processes under the
    host-read audit."""
    tmp = tmp_path_factory.mktemp(f"two-{recipe.split('.')[0]}")
    folder, env = template_project(tmp)
    script, modules = copy_recipe(folder, recipe)
    proc = launch_audited_copy(folder, env, script, *args, "--output_dir", "out")
    return SimpleNamespace(
        out=folder / "out", proc=proc, folder=folder, env=env, script=script, modules=modules
    )


def one_process_audited_run(tmp_path_factory, name: str, script: Path, *args, timeout=600) -> SimpleNamespace:
    """The recipe run with plain python on 1 process, under the host-read audit."""
    tmp = tmp_path_factory.mktemp(f"one-{name}")
    out = tmp / "out"
    proc = check(run([PYTHON, AUDIT, script, *args, "--output_dir", out], recipe_env(tmp), timeout=timeout))
    return SimpleNamespace(out=out, proc=proc)


# ------------------------------------------------ the shared runs: each recipe on 1 and 2 processes
# Each recipe runs once on 1 process and once on 2 for the whole session; the tests that only read a
# run's folder (results.json, pictures, host-read reports, models for --eval_only and --predict)
# share it, and a test that has to write into one copies it first. The 2-process run is the recipe
# copied into an empty project folder (the template test) and runs under the host-read audit, on the
# flags of the 1-process run (the 1 vs 2 processes comparison).

# 645 generated images (a test split of 129, which does not divide by 2), a global batch of 32, 8
# steps inside the first epoch. Augmentation is off: its random crops are drawn per process. Logs at
# steps 1, 2, 4, 6 and 8: the steps 3, 5 and 7 between them are the quiet ones the audit checks.
CIFAR_RUN = [
    "--dataset",
    "synthetic",
    "--synthetic_size",
    "645",
    "--batch_size",
    "32",
    "--max_steps",
    "8",
    "--tracker",
    "none",
    "--num_workers",
    "0",
    "--log_every",
    "2",
    "--checkpoint_every",
    "0",
    "--augment",
    "False",
    "--lr",
    "0.02",
]
# 256 rows at a global batch of 16: 16 steps per epoch, 2 epochs; lr 3e-3 suits a randomly
# initialised tiny model. Logs every 4 steps (epoch ends included): the steps between are quiet.
TEXT_FAST = [
    "--batch_size",
    "16",
    "--lr",
    "3e-3",
    "--tracker",
    "none",
    "--num_workers",
    "0",
    "--log_every",
    "4",
]
TEXT_RUN = [*TEXT_FAST, "--epochs", "2", "--checkpoint_every", "0"]
# The detector on 2 processes: 32 generated training images (8 steps of 4 per epoch), 6 steps inside
# the first epoch, logged at steps 1 and 6 only, to SwanLab offline (its pictures and every
# process's figures are read back).
DETECT_TWO = [
    "--data",
    "synthetic",
    "--synthetic_size",
    "32",
    "--data_dir",
    "data",
    "--image_size",
    "64",
    "--batch_size",
    "4",
    "--max_steps",
    "6",
    "--log_every",
    "1000",
    "--checkpoint_every",
    "0",
    "--tracker",
    "swanlab",
    "--swanlab_mode",
    "offline",
    "--num_workers",
    "0",
]


def text_files(data: dict) -> list:
    return ["--model", data["model"], "--train_file", data["train"], "--validation_file", data["validation"]]


@pytest.fixture(scope="session")
@built_once_for_all_workers
def cifar_one(tmp_path_factory):
    """The CIFAR recipe on 1 process with CIFAR_RUN, under the host-read audit."""
    return one_process_audited_run(tmp_path_factory, "cifar", CIFAR_SCRIPT, *CIFAR_RUN)


@pytest.fixture(scope="session")
@built_once_for_all_workers
def cifar_two(tmp_path_factory):
    """cifar.py copied into an empty project, on 2 processes with CIFAR_RUN, under the host-read
    audit."""
    return two_process_template_run(tmp_path_factory, "cifar.py", *CIFAR_RUN)


@pytest.fixture(scope="session")
@built_once_for_all_workers
def text_one(text_data, tmp_path_factory):
    """The text recipe on 1 process: the tiny BERT fine-tuned for 2 epochs, under the host-read
    audit."""
    return one_process_audited_run(tmp_path_factory, "text", TEXT_SCRIPT, *text_files(text_data), *TEXT_RUN)


@pytest.fixture(scope="session")
@built_once_for_all_workers
def text_two(text_data, tmp_path_factory):
    """text_classification.py copied into an empty project, on 2 processes with the flags of
    text_one, audited."""
    return two_process_template_run(
        tmp_path_factory, "text_classification.py", *text_files(text_data), *TEXT_RUN
    )


@pytest.fixture(scope="session")
@built_once_for_all_workers
def detect_two(tmp_path_factory):
    """The detect/ folder copied into an empty project, on 2 processes under the host-read audit;
    --data synthetic is the shapes set generated by the copied folder itself, in YOLO format under
    --data_dir."""
    return two_process_template_run(tmp_path_factory, "detect", *DETECT_TWO)


def read_audit(out: Path, rank: int = 0) -> dict:
    return json.loads(
        (Path(out) / ("host_reads.json" if rank == 0 else f"host_reads.rank{rank}.json")).read_text()
    )


def assert_quiet(report: dict, proc, steps: int, log_every: int) -> None:
    """The audit's verdict on a run of `steps` steps logged every `log_every` (no checkpoint between
    epoch ends): the steps between log steps are quiet and hold no read; the log step 1 reads the
    loss, so the counter is live."""
    assert report["exit_code"] == 0 and report["steps"] == steps, proc.output[-3000:]
    assert report["quiet_intervals"] == [s for s in range(2, steps) if s % log_every], report[
        "quiet_intervals"
    ]
    assert report["quiet_intervals"], "no quiet step to check"
    offenders = [
        f"{s['site']} {s['op']} x{s['quiet_count']} (via {s['via']})" for s in report["sites"] if s["fails"]
    ]
    assert report["quiet_violations"] == 0, "host reads between log steps:\n" + "\n".join(offenders)
    assert report["intervals"][1]["reads"] >= 1  # the loss logged at step 1
    assert "PASS: 0 read(s)" in proc.stdout


def assert_both_ranks_quiet(two, steps: int, log_every: int) -> None:
    """Each of the 2 gloo processes of a shared 2-process run wrote its own audit, and each holds no
    read between log steps."""
    for rank in (0, 1):
        report = read_audit(two.out, rank)
        assert report["world_size"] == 2 and report["rank"] == rank
        assert_quiet(report, two.proc, steps, log_every)


# The detector on 1 process: 96 training and 21 validation images of the generated shapes set (21
# divides neither by 2 processes nor by a batch of 4); 144 steps of batch 8 (12 epochs), evaluated
# once at the end: the shortest run measured here that finds the shapes at all (36 steps of batch 16
# left mAP50 at 0.000). Logs at step 1 and every 12 steps (the epoch ends); the steps between are
# the audit's quiet ones.
DETECT_SMALL = [
    "--image_size",
    "128",
    "--optimizer",
    "adamw",
    "--lr",
    "0.002",
    "--tracker",
    "none",
    "--num_workers",
    "0",
]
DETECT_RUN = [
    "--batch_size",
    "8",
    "--epochs",
    "12",
    "--eval_every",
    "12",
    "--seed",
    "0",
    "--log_every",
    "12",
    "--checkpoint_every",
    "0",
    *DETECT_SMALL,
]


@pytest.fixture(scope="session")
@built_once_for_all_workers
def detect_shapes(tmp_path_factory) -> Path:
    """The generated shapes set in YOLO format (its data.yaml)."""
    from synthetic_shapes import write_synthetic_dataset

    return write_synthetic_dataset(
        tmp_path_factory.mktemp("shapes"), num_train=96, num_val=21, image_size=128, seed=3
    )


@pytest.fixture(scope="session")
@built_once_for_all_workers
def detect_one(detect_shapes, tmp_path_factory):
    """The detector trained on 1 process with DETECT_RUN, under the host-read audit."""
    return one_process_audited_run(
        tmp_path_factory, "detect", DETECT_SCRIPT, "--data", detect_shapes, *DETECT_RUN
    )


# ---------------------------------------------------------------------------- tiny chat model (SFT)
@pytest.fixture(scope="session")
@built_once_for_all_workers
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a Llama-3-like chat template (no pad token), saved as a model
    folder."""
    from chat_fixtures import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-chat-llama"), "llama")


@pytest.fixture(scope="session")
@built_once_for_all_workers
def sft_data(tmp_path_factory) -> dict:
    """The learnable chat task in the messages JSONL format: 96 training and 32 validation
    conversations."""
    from chat_fixtures import chat_examples, write_chat_file

    root = tmp_path_factory.mktemp("sft-data")
    return {
        "train": write_chat_file(root / "train.jsonl", chat_examples(96, seed=0), "messages"),
        "validation": write_chat_file(root / "validation.jsonl", chat_examples(32, seed=1), "messages"),
        "root": root,
    }


# ----------------------------------------------------------------------- the shared SFT runs (chat)
SFT_SCRIPT = REPO / "recipes" / "sft.py"
# 96 conversations at a global batch of 8: 12 steps per epoch, 2 epochs, every step logged (the 1 vs
# 2 processes comparison reads each step's loss). LoRA
# without dropout: dropout masks are drawn per process.
SFT_COMMON = ["--batch_size", "8", "--lr", "1e-2", "--max_length", "128", "--max_new_tokens", "6"]
SFT_COMMON += ["--checkpoint_every", "0", "--num_workers", "0"]
SFT_RUN = [
    *SFT_COMMON,
    "--tracker",
    "none",
    "--lora_r",
    "8",
    "--lora_dropout",
    "0",
    "--epochs",
    "2",
    "--eval_generate",
    "8",
    "--log_every",
    "1",
]
# A full fine-tune that learns the task: 4 epochs, each
# evaluated with 16 greedy answers, tracked by SwanLab offline.
SFT_FULL = [
    *SFT_COMMON,
    "--epochs",
    "4",
    "--eval_generate",
    "16",
    "--log_every",
    "4",
    "--swanlab_mode",
    "offline",
]


def sft_files(model: Path, data: dict) -> list:
    return ["--model", model, "--train_file", data["train"], "--validation_file", data["validation"]]


def plain_run(tmp_path_factory, name: str, *args, timeout=300) -> SimpleNamespace:
    """A recipe run with plain python on 1 process."""
    tmp = tmp_path_factory.mktemp(name)
    out = tmp / "out"
    proc = check(run([PYTHON, *args, "--output_dir", out], recipe_env(tmp), timeout=timeout))
    return SimpleNamespace(out=out, proc=proc)


@pytest.fixture(scope="session")
@built_once_for_all_workers
def sft_one(tiny_chat_model, sft_data, tmp_path_factory):
    """The SFT recipe on 1 process: a LoRA adapter on the tiny chat model, 2 epochs, batches
    padded."""
    return plain_run(tmp_path_factory, "sft-one", SFT_SCRIPT, *sft_files(tiny_chat_model, sft_data), *SFT_RUN)


@pytest.fixture(scope="session")
@built_once_for_all_workers
def sft_two(tiny_chat_model, sft_data, tmp_path_factory):
    """sft.py copied into an empty project, on 2 processes with the flags of sft_one, packed rows
    through the varlen attention (chat/packed_attention.py; conversation by conversation on the CPU)
    and gradient checkpointing (none of which changes a number), under the host-read audit."""
    return two_process_template_run(
        tmp_path_factory,
        "sft.py",
        *sft_files(tiny_chat_model, sft_data),
        *SFT_RUN,
        *NO_PLOTS,
        "--packing",
        "--attn_implementation",
        "varlen",
        "--gradient_checkpointing",
    )


@pytest.fixture(scope="session")
@built_once_for_all_workers
def sft_accumulated(tiny_chat_model, sft_data, tmp_path_factory):
    """sft_one's flags on 1 process with 2 micro-batches per step in the shape `make sft-1gpu`
    trains on a GPU: padded rows of varying widths through compiled decoder blocks, and the
    evaluation's answers through the compiled decode step (--compile --decode compiled with the
    aot_eager backend: torch.compile's capture without code generation, which would take minutes
    here); none of which changes a number."""
    args = [*sft_files(tiny_chat_model, sft_data), *SFT_RUN, *NO_PLOTS, "--gradient_accumulation_steps", "2"]
    args += ["--compile", "--compile_backend", "aot_eager", "--decode", "compiled"]
    return plain_run(tmp_path_factory, "sft-accumulated", SFT_SCRIPT, *args)


@pytest.fixture(scope="session")
@built_once_for_all_workers
def sft_full(tiny_chat_model, sft_data, tmp_path_factory):
    """A full fine-tune of the tiny chat model on 1 process (SFT_FULL), under the host-read
    audit."""
    return one_process_audited_run(
        tmp_path_factory, "sft-full", SFT_SCRIPT, *sft_files(tiny_chat_model, sft_data), *SFT_FULL, *NO_PLOTS
    )


# ----------------------------------------------------------------------------- the shared GRPO runs
GRPO_SCRIPT = REPO / "recipes" / "grpo.py"
BREVITY = '''
def brevity(prompts, completions, **columns):
    """Shorter completions score higher."""
    return [-len(completion) / 40 for completion in completions]


def broken(prompts, completions, **columns):
    return [0.0]  # one value for many completions
'''
# 48 prompts at a global batch of 8 prompts x 4 completions: 6 steps per epoch; a checkpoint every 2
# steps, an evaluation at step 3 (--eval_every) and at the
# epoch's end. LoRA without dropout (its default here).
GRPO_RUN = [
    "--batch_size",
    "8",
    "--num_generations",
    "4",
    "--max_new_tokens",
    "8",
    "--lr",
    "1e-2",
    "--epochs",
    "1",
]
GRPO_RUN += ["--reward_weights", "1,1", "--lora_r", "8", "--tracker", "none"]
GRPO_RUN += ["--log_every", "1", "--checkpoint_every", "2", "--eval_every", "3"]


@pytest.fixture(scope="session")
@built_once_for_all_workers
def grpo_data(tiny_chat_model, tmp_path_factory) -> dict:
    """Colour prompts: training rows as `prompt` + `answer`, validation rows as conversations whose
    final assistant turn is the answer; the user's reward file beside them."""
    from chat_fixtures import COLOURS

    root = tmp_path_factory.mktemp("grpo-data")
    rng = random.Random(0)
    # Two prompt lengths, a quarter of them longer: a micro-batch of 4 often has none of those while
    # the batch of 8 it comes from has one, and a completion's draws must not depend on the padding
    # its batch gives it.
    rows = [
        {"prompt": f"{lead}what colour is the {thing}?".capitalize(), "answer": colour}
        for lead in ("", "", "", "and ")
        for thing, colour in COLOURS.items()
    ]
    rng.shuffle(rows)
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:48]))
    validation = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["answer"]},
            ]
        }
        for r in rows[48:]
    ]
    (root / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in validation))
    (root / "brevity.py").write_text(BREVITY)
    files = ["--model", tiny_chat_model, "--train_file", root / "train.jsonl"]
    files += ["--validation_file", root / "validation.jsonl"]
    return dict(root=root, files=files, reward=f"exact,{root / 'brevity.py'}:brevity")


def grpo(data: dict, name: str, *extra, reward=None, model=None, launcher=(), ok=True):
    """grpo.py with the data's files and model (or `model`), its rewards (or `reward`), GRPO_RUN and
    NO_PLOTS, then `extra` (later flags win); output in root/name."""
    out = data["root"] / name
    files = list(data["files"])
    files[files.index("--model") + 1] = model or files[files.index("--model") + 1]
    env = recipe_env(data["root"], TORCH_EXTENSIONS_DIR=TORCH_EXTENSIONS)
    if launcher:
        env["ACCELERATE_USE_CPU"] = "true"
    cmd = [*launcher, GRPO_SCRIPT, *files, "--reward", reward or data["reward"], *GRPO_RUN, *NO_PLOTS, *extra]
    proc = run([*(cmd if launcher else [PYTHON, *cmd]), "--output_dir", out], env, timeout=300)
    return (check(proc) if ok else proc), out


@pytest.fixture(scope="session")
@built_once_for_all_workers
def grpo_one(grpo_data, tmp_path_factory):
    """The GRPO recipe on 1 process with GRPO_RUN: a LoRA adapter on the tiny chat model, 6
    steps."""
    return grpo(grpo_data, "one", "--plots", "True")[1]


# ------------------------------------------------------------------------------ the shared DPO runs
DPO_SCRIPT = REPO / "recipes" / "dpo.py"
WRONG_COLOURS = ("purple", "green", "black", "orange")


def colour_pairs(seed: int = 0) -> list[dict]:
    """Preference pairs of the learnable colour task: 16 objects x 3 ways to ask, 48 in all. The
    chosen answer is the object's colour, the rejected one a wrong colour fixed per object; a third
    of the pairs answer in a sentence (both answers alike), so rows differ in length within a
    batch."""
    rng = random.Random(seed)
    from chat_fixtures import COLOURS

    wrong = {}
    for index, (thing, colour) in enumerate(sorted(COLOURS.items())):
        wrong[thing] = next(c for c in WRONG_COLOURS[index % 4 :] + WRONG_COLOURS if c != colour)
    pairs = []
    for lead in ("", "and ", "so "):
        for thing, colour in COLOURS.items():
            sentence = rng.random() < 1 / 3
            answer = (lambda c: f"The {thing} is {c}.") if sentence else (lambda c: c)
            question = f"{lead}what colour is the {thing}?".capitalize()
            pairs.append({"prompt": question, "chosen": answer(colour), "rejected": answer(wrong[thing])})
    rng.shuffle(pairs)
    return pairs


def as_conversations(pair: dict, system: str | None = None) -> dict:
    """A text pair in TRL's conversational format with an implicit prompt: two whole
    conversations."""
    head = [{"role": "system", "content": system}] if system else []
    head.append({"role": "user", "content": pair["prompt"]})
    return {name: head + [{"role": "assistant", "content": pair[name]}] for name in ("chosen", "rejected")}


@pytest.fixture(scope="session")
@built_once_for_all_workers
def dpo_data(tiny_chat_model, tmp_path_factory) -> dict:
    """The tiny chat model and 48 colour pairs: 32 training pairs in TRL's text format, 16
    validation pairs as whole conversations (a quarter of them with a system message); `files` are
    the data flags."""
    root = tmp_path_factory.mktemp("dpo-data")
    pairs = colour_pairs()
    train, validation = pairs[:32], pairs[32:]
    (root / "train.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in train))
    rows = [
        as_conversations(pair, "You answer in one word." if i % 4 == 0 else None)
        for i, pair in enumerate(validation)
    ]
    (root / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    files = ["--model", tiny_chat_model, "--train_file", root / "train.jsonl"]
    files += ["--validation_file", root / "validation.jsonl"]
    return dict(root=root, files=files, train=train, validation=validation, model=tiny_chat_model)


# 32 pairs at a global batch of 8: 4 steps per epoch, 2 epochs, every step logged (the comparisons
# read each step's loss). A fresh LoRA adapter (no dropout: its masks are drawn per process), whose
# reference is the base model itself.
# --max_grad_norm 0.05 clips some steps and not others (gradient norms 0.04-0.09 here): AdamW alone
# would take the same steps from a gradient twice or half as large, so the runs agree only if each
# has the global batch's gradient.
DPO_RUN = ["--batch_size", "8", "--lora_r", "8", "--lr", "1e-2", "--epochs", "2", "--max_length", "64"]
DPO_RUN += ["--max_grad_norm", "0.05"]
DPO_RUN += ["--max_new_tokens", "4", "--log_every", "1", "--checkpoint_every", "0", "--tracker", "none"]
DPO_RUN += ["--num_workers", "0"]


def dpo(data: dict, name: str, *extra, launcher=(), ok=True, timeout=300):
    """dpo.py with the data's files, DPO_RUN, NO_PLOTS and then `extra` (later flags win), on 1 process or
    under `launcher`; output in root/name. Returns (proc, out)."""
    out = data["root"] / name
    env = recipe_env(data["root"], TORCH_EXTENSIONS_DIR=TORCH_EXTENSIONS)
    if launcher:
        env["ACCELERATE_USE_CPU"] = "true"
    cmd = [*launcher, DPO_SCRIPT, *data["files"], *DPO_RUN, *NO_PLOTS, *extra]
    proc = run([*(cmd if launcher else [PYTHON, *cmd]), "--output_dir", out], env, timeout=timeout)
    return (check(proc) if ok else proc), out


@pytest.fixture(scope="session")
@built_once_for_all_workers
def dpo_one(dpo_data, tmp_path_factory):
    """The DPO recipe on 1 process with DPO_RUN: a LoRA adapter on the tiny chat model, 8 steps."""
    return dpo(dpo_data, "one", "--plots", "True")[1]


# ----------------------------------------------------- NaN gradients with a finite loss (the guard)
# Launchers that run a recipe as `python recipe.py` would, with NaN gradients at one step
# (nan_gradient.py) or in every step whose batch has a fully masked attention row (nan_attention.py,
# --attn_implementation nan_masked_rows).
NAN_GRADIENT = REPO / "tests" / "nan_gradient.py"
NAN_ATTENTION = REPO / "tests" / "nan_attention.py"
# what a run does with them: without --skip_nonfinite_steps, and with it
NONFINITE = ("stop", "skip")
SKIP_NONFINITE = {"stop": [], "skip": ["--skip_nonfinite_steps"]}


def steps_with_masked_rows(steps_file: Path) -> list[int]:
    """The optimizer steps whose training batch tests/nan_attention.py found a fully masked
    attention row in."""
    return sorted(int(step) for step in steps_file.read_text().split()) if steps_file.exists() else []


def assert_nonfinite_gradients_handled(behaviour: str, proc, out: Path, bad_steps: list[int]) -> None:
    """A run given NaN gradients (and a finite loss) at `bad_steps`: "stop" ends at the first of
    them with one error line naming it, before anything is saved after it; "skip" drops exactly
    those updates, exits 0 and saves finite weights whose evaluation is finite."""
    from safetensors.torch import load_file

    if behaviour == "stop":
        first = bad_steps[0]
        fails_with(proc, "the gradients are not finite", f"from step {first} on (seen at step {first})")
        assert not (out / "results.json").exists() and not list(out.glob("*.safetensors"))
        return
    check(proc)
    results = read_results(out)
    assert results["skipped_nonfinite_steps"] == len(bad_steps), (
        results["skipped_nonfinite_steps"],
        bad_steps,
    )
    weights = [tensor for path in out.glob("*.safetensors") for tensor in load_file(path).values()]
    assert weights and all(tensor.isfinite().all() for tensor in weights)
    evaluation = {k: v for k, v in results.items() if k.startswith("eval_") and isinstance(v, float)}
    assert evaluation and all(np.isfinite(v) for v in evaluation.values()), evaluation


# ---------------------------------------------------------- killed runs resumed (test_resume.py and
# the tests beside the shared runs: a SIGKILL test whose reference is a shared session run lives in
# the file that makes that run anyway, so that no pytest worker makes the run for it alone)
def start_in_own_session(cmd, env, log: Path) -> subprocess.Popen:
    """Start `cmd` with its output in `log`, in a session of its own: a kill of the group reaches
    every process."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        env=env,
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for_checkpoint(
    proc: subprocess.Popen, output_dir: Path, step: int, log: Path, timeout: float = 240
) -> None:
    marker = output_dir / "checkpoints" / f"step_{step:08d}" / "checkpoint.json"
    deadline = time.monotonic() + time_limit(timeout)
    while not marker.exists():
        assert proc.poll() is None, (
            f"the run ended (exit {proc.returncode}) before step {step}:\n{log.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"no checkpoint at step {step} after {timeout} s"
        time.sleep(0.02)


def processes_with(variable: str, value: str) -> dict[int, dict]:
    """pid -> environment of the running processes whose environment has variable=value."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pairs = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
        if env.get(variable) == value:
            found[int(entry.name)] = env
    return found


def saved_weights(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = saved_weights(a), saved_weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def assert_same_best(a: Path, b: Path) -> None:
    """The same best evaluation, and the same weights in model_best: the resumed run knew the best
    found before the interruption (it is part of the checkpoint), so an epoch after it replaced
    model_best only by doing better."""
    keys = ("best_metric", "best_epoch", "best_step")
    assert {k: read_results(a)[k] for k in keys} == {k: read_results(b)[k] for k in keys}
    assert_same_weights(a / "model_best", b / "model_best")


def sigkill_mid_epoch_then_resume(command: list, kill_after: int, reference: Path, tmp_path: Path) -> None:
    """`python *command` killed with SIGKILL once its checkpoint of step `kill_after` (inside an
    epoch) is on disk, then continued with --resume auto: it ends with the weights, best model and
    steps of `reference`, the same command run start to finish, and a metrics file that reads as one
    run."""
    import signal

    out, log = tmp_path / "out", tmp_path / "killed.log"
    env = recipe_env(tmp_path)
    proc = start_in_own_session([PYTHON, *command, "--output_dir", out], env, log)
    try:
        wait_for_checkpoint(proc, out, kill_after, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "results.json").exists(), "the run finished before it was killed"
    progress = json.loads((out / "checkpoints" / f"step_{kill_after:08d}" / "checkpoint.json").read_text())
    assert progress["batches_done"] > 0, "the checkpoint should sit inside an epoch"

    resumed = check(run([PYTHON, *command, "--output_dir", out, "--resume", "auto"], env, timeout=400))
    assert "resumed from" in resumed.stdout
    results = read_results(out)
    assert results["resumed_from"].startswith(str(out / "checkpoints" / "step_"))
    assert results["steps"] == read_results(reference)["steps"]
    assert_same_weights(out, reference)
    assert_same_best(out, reference)
    # The metrics file reads as one run: every step logged once, in order.
    steps = [m["step"] for m in read_metrics(out) if "train/loss" in m]
    assert steps == sorted(set(steps)) and steps[-1] == results["steps"]
    assert len(list((out / "checkpoints").iterdir())) == 2  # --keep_checkpoints 2
