"""Shared helpers: run the recipes as users do (subprocesses), write tiny data in real on-disk formats."""

import json
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cifar_data import synthetic_images

REPO = Path(__file__).resolve().parents[1]
CIFAR_SCRIPT = REPO / "recipes" / "cifar.py"
CONFIGS = REPO / "accelerate_configs"
BIN = Path(sys.executable).parent
ACCELERATE = str(BIN / "accelerate")
TORCHRUN = str(BIN / "torchrun")
PYTHON = sys.executable

# Small enough for 2 CPU cores, large enough that the network visibly learns.
TINY = ["--dataset", "synthetic", "--synthetic_size", "160", "--batch_size", "16", "--max_steps", "2",
        "--tracker", "none", "--num_workers", "0", "--log_every", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_env(tmp_path: Path, **extra) -> dict:
    """Environment of a user with no SwanLab login and no internet, one CPU thread per process."""
    env = dict(os.environ)
    for key in ("SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_LOG_DIR", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=300, cwd=REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    proc.output = proc.stdout + proc.stderr
    return proc


def check(proc) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.output[-6000:]}"
    return proc


def fails_with(proc, *fragments) -> str:
    """The run failed with exactly one `error: ...` line holding every fragment, and no traceback."""
    assert proc.returncode != 0, proc.output[-3000:]
    assert "Traceback" not in proc.output, proc.output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def stopped_with(proc, out, *fragments) -> list[str]:
    """A multi-process run stopped before writing results, with the one-line error holding every fragment.

    Every rank finds the same fault; the launcher stops the others as soon as one exits, so which ranks get to print
    their line ("error: ..." on rank 0, "error (rank 1): ..." elsewhere) is a race: each line that did must hold them.
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
    """A real picture: a PNG at least this big with more than a few colours (not blank, not one flat colour)."""
    from PIL import Image

    image = Image.open(path)
    assert image.format == "PNG", path
    image = image.convert("RGB")
    assert image.width >= min_width and image.height >= min_height, (path, image.size)
    assert len(image.getcolors(maxcolors=1 << 20)) > 20, f"{path} is nearly a single colour"
    return image


def write_cifar10(root: Path, num_train: int, num_test: int, seed: int = 0) -> Path:
    """CIFAR-10 in its release's python format (root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta})."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name, images, labels):
        rows = images.transpose(0, 3, 1, 2).reshape(len(images), -1)  # N x 3072: all R, then G, then B
        entry = {"batch_label": name, "labels": labels.tolist(), "data": rows,
                 "filenames": [f"{name}_{i}.png" for i in range(len(images))]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)

    train_x, train_y = synthetic_images(num_train, 10, seed=seed)
    test_x, test_y = synthetic_images(num_test, 10, seed=seed + 1)
    for i, (xs, ys) in enumerate(zip(np.array_split(train_x, 5), np.array_split(train_y, 5)), start=1):
        dump(f"data_batch_{i}", xs, ys)
    dump("test_batch", test_x, test_y)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": num_train // 5, "num_vis": 3072}, f, protocol=2)
    return root


@pytest.fixture
def env(tmp_path):
    return recipe_env(tmp_path)


TEXT_SCRIPT = REPO / "recipes" / "text_classification.py"
POSITIVE = "good great fine superb lovely brilliant".split()
NEGATIVE = "bad awful poor dull boring terrible".split()
NEUTRAL = "the a movie film plot actor story was is and it very".split()


def tiny_bert(folder: Path) -> Path:
    """A 2-layer, hidden-32 BERT with random weights and a word-level tokenizer over the test vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POSITIVE + NEGATIVE + NEUTRAL
    BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)}).save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def sentiment_rows(n: int, seed: int) -> list[dict]:
    """Learnable review-like rows: three sentiment words among three neutral ones; labels "positive"/"negative"."""
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
