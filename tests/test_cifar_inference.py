"""The CIFAR recipe after training: --predict classifies image files, --eval_only evaluates a saved
model on 1 and 2 processes, and --pretrained fine-tunes torchvision's ImageNet weights read from
torch's hub cache."""

import json
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import (
    ACCELERATE,
    CIFAR_SCRIPT,
    CONFIGS,
    PYTHON,
    check,
    fails_with,
    free_port,
    read_results,
    recipe_env,
    run,
)
from PIL import Image
from safetensors.torch import load_file

from accelerate_recipes.plots import read_confusion_matrix_csv

CLASSES = ["cat", "dog", "fox"]
# the file name torchvision's ResNet18_Weights.DEFAULT downloads to
WEIGHTS_NAME = "resnet18-f37072fd.pth"


def write_image_folder(root: Path, num_images: int, size: int, seed: int, classes=CLASSES) -> Path:
    """Learnable generated images as PNGs in root/train/<class>/ and root/val/<class>/ (every fifth
    one in val)."""
    from cifar_data import synthetic_images

    images, labels = synthetic_images(num_images, num_classes=len(classes), seed=seed, size=size)
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = root / ("val" if i % 5 == 0 else "train") / classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i}.png")
    assert {p.name for p in (root / "val").iterdir()} == set(classes), (
        "pick a seed that puts every class in val"
    )
    return root


def json_lines(stdout: str) -> list[dict]:
    """Every line of stdout, each of which must be a JSON object."""
    return [json.loads(line) for line in stdout.splitlines()]


@pytest.fixture(scope="module")
def trained(module_tmp):
    """A resnet18 trained for 24 steps (3 epochs and a half) on 124 training PNGs of 3 classes (31
    in val, so 2 processes split them unevenly), resized to 16 px: it learns them. After 15 steps
    the accuracy still depended on the CPU's kernels (0.58 with AVX-512, 0.84 with AVX2); after 24
    it was 0.97 with both."""
    tmp = module_tmp.mktemp("cifar_inference")
    data = write_image_folder(tmp / "imgs", 155, size=24, seed=3)
    out = tmp / "out"
    check(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--dataset",
                "imagefolder",
                "--data_dir",
                data,
                "--image_size",
                "16",
                "--batch_size",
                "16",
                "--max_steps",
                "24",
                "--lr",
                "0.05",
                "--augment",
                "False",
                "--tracker",
                "none",
                "--num_workers",
                "0",
                "--output_dir",
                out,
            ],
            recipe_env(tmp),
            timeout=300,
        )
    )
    return data, out


def test_a_finished_run_saves_what_inference_needs(trained):
    _, out = trained
    config = json.loads((out / "model_config.json").read_text())
    assert config == dict(
        model="resnet18",
        stem="cifar",
        num_classes=3,
        classes=CLASSES,
        image_size=16,
        mean=[0.4914, 0.4822, 0.4465],
        std=[0.2470, 0.2435, 0.2616],
        dataset="imagefolder",
        pretrained=False,
    )
    assert (out / "model.safetensors").is_file()
    assert read_results(out)["eval_accuracy"] > 0.6  # chance is 1/3
    # model_best is a model folder like the last one: --predict and --eval_only take it as --model
    assert json.loads((out / "model_best" / "model_config.json").read_text()) == config
    assert (out / "model_best" / "model.safetensors").is_file()


def test_predict_prints_one_json_line_per_image(trained, tmp_path):
    data, out = trained
    val = sorted((data / "val").rglob("*.png"))
    single = data / "train" / "dog" / sorted(p.name for p in (data / "train" / "dog").iterdir())[0]
    proc = check(
        run(
            [PYTHON, CIFAR_SCRIPT, "--predict", data / "val", "--predict", single, "--model", out],
            recipe_env(tmp_path),
            timeout=120,
        )
    )
    rows = json_lines(proc.stdout)  # nothing but the JSON lines on stdout
    assert len(rows) == len(val) + 1 == 32
    assert [row["image"] for row in rows] == [str(p) for p in val] + [str(single)]
    for row in rows:
        assert set(row) == {"image", "label", "score"}
        # the top class of 3 has at least 1/3
        assert row["label"] in CLASSES and 0.33 <= row["score"] <= 1
    # The predictions are the ones the run's own evaluation
    # counted: the same accuracy on the val folder.
    correct = sum(row["label"] == Path(row["image"]).parent.name for row in rows[:-1])
    assert correct / len(val) == pytest.approx(read_results(out)["eval_accuracy"], abs=1.5 / len(val))
    assert correct / len(val) > 0.6
    # the best evaluation's model predicts with the accuracy the run recorded for it
    best = json_lines(
        check(
            run(
                [PYTHON, CIFAR_SCRIPT, "--predict", data / "val", "--model", out / "model_best"],
                recipe_env(tmp_path),
                timeout=120,
            )
        ).stdout
    )
    correct = sum(row["label"] == Path(row["image"]).parent.name for row in best)
    assert correct / len(val) == pytest.approx(read_results(out)["best_metric"], abs=1.5 / len(val))


def test_eval_only_gives_the_same_accuracy_on_one_and_two_processes(trained, tmp_path):
    data, out = trained
    common = [
        "--eval_only",
        "--model",
        out,
        "--dataset",
        "imagefolder",
        "--data_dir",
        data,
        "--batch_size",
        "8",
        "--num_workers",
        "0",
    ]
    env = recipe_env(tmp_path)
    one = check(run([PYTHON, CIFAR_SCRIPT, *common, "--output_dir", tmp_path / "one"], env, timeout=120))
    check(
        run(
            [
                ACCELERATE,
                "launch",
                "--config_file",
                CONFIGS / "cpu.yaml",
                "--num_processes",
                "2",
                "--main_process_port",
                free_port(),
                "--num_cpu_threads_per_process",
                "1",
                CIFAR_SCRIPT,
                *common,
                "--output_dir",
                tmp_path / "two",
            ],
            dict(env, ACCELERATE_USE_CPU="true"),
            timeout=180,
        )
    )
    r1, r2 = read_results(tmp_path / "one"), read_results(tmp_path / "two")
    assert (r1["world_size"], r2["world_size"], r2["distributed_type"]) == (1, 2, "MULTI_CPU")
    # 31 images over 2 processes: the sampler repeats one, gather_for_metrics drops it again
    assert r1["eval_samples"] == r2["eval_samples"] == 31
    assert r1["eval_accuracy"] == r2["eval_accuracy"] == read_results(out)["eval_accuracy"]
    assert r1["eval_loss"] == pytest.approx(r2["eval_loss"], abs=1e-5)
    assert r1["eval_only"] is True and r1["steps"] == 0 and r1["model_dir"] == str(out)
    assert not (tmp_path / "one" / "model.safetensors").exists()  # evaluated, not trained or saved
    assert f"eval accuracy {r1['eval_accuracy']:.4f}" in one.stdout
    # the confusion counts of both: each image once, the diagonal is the accuracy
    for folder in ("one", "two"):
        _, counts = read_confusion_matrix_csv(tmp_path / folder / "confusion_matrix.csv")
        assert sum(map(sum, counts)) == 31
        assert sum(counts[i][i] for i in range(len(counts))) == round(r1["eval_accuracy"] * 31)
    assert (tmp_path / "one" / "confusion_matrix.png").is_file()


def test_predict_errors(trained, tmp_path):
    data, out = trained
    env = recipe_env(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "--predict", data / "val", "--model", empty], env),
        f"--model {empty} is not the output of a finished cifar run",
        "model_config.json",
        "--output_dir",
    )
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "--predict", data / "val", "--predict", broken, "--model", out], env),
        f"--predict {broken} cannot be read as an image",
    )
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "--predict", empty, "--model", out], env),
        f"--predict {empty}: the folder holds no images",
    )
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "--predict", tmp_path / "missing.png", "--model", out], env),
        "missing.png: no such file or folder",
    )


def test_eval_only_errors(trained, tmp_path):
    data, out = trained
    env = recipe_env(tmp_path)
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "--eval_only", "--model", data, "--output_dir", tmp_path / "o"], env),
        f"--model {data} is not the output of a finished cifar run",
    )
    other = write_image_folder(tmp_path / "other", 30, size=16, seed=0, classes=["ant", "bee"])
    fails_with(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--eval_only",
                "--model",
                out,
                "--dataset",
                "imagefolder",
                "--data_dir",
                other,
                "--batch_size",
                "2",
                "--output_dir",
                tmp_path / "o",
            ],
            env,
        ),
        "was trained on 3 classes (cat, dog, fox)",
        "has 2 (ant, bee)",
    )
    fails_with(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--eval_only",
                "--model",
                out,
                "--dataset",
                "synthetic",
                "--output_dir",
                tmp_path / "o",
            ],
            env,
        ),
        "takes 16 px images",
    )


def imagenet_like_file(torch_home: Path) -> dict:
    """A resnet18 state dict (seed 0, not torchvision's release) under the name torchvision caches
    its weights as."""
    torch.manual_seed(0)
    state = torchvision.models.resnet18().state_dict()
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(state, folder / WEIGHTS_NAME)
    return state


def test_pretrained_fine_tunes_the_weights_in_torchs_cache(tmp_path):
    assert torchvision.models.ResNet18_Weights.DEFAULT.url.endswith("/" + WEIGHTS_NAME)
    state = imagenet_like_file(tmp_path / "torch")
    data = write_image_folder(tmp_path / "imgs", 15, size=24, seed=0)  # 12 train, 3 val
    out = tmp_path / "out"
    env = recipe_env(tmp_path, TORCH_HOME=tmp_path / "torch")
    # --lr 0: the saved weights are exactly those the run started from
    proc = check(
        run(
            [
                PYTHON,
                CIFAR_SCRIPT,
                "--dataset",
                "imagefolder",
                "--data_dir",
                data,
                "--pretrained",
                "--batch_size",
                "4",
                "--max_steps",
                "1",
                "--lr",
                "0",
                "--tracker",
                "none",
                "--num_workers",
                "0",
                "--output_dir",
                out,
            ],
            env,
            timeout=200,
        )
    )
    # torchvision checks a file's hash only when it downloads
    # it; the recipe says this one is not the release
    assert f"{WEIGHTS_NAME} is not torchvision's release" in proc.stdout
    saved = load_file(str(out / "model.safetensors"))
    parameters = [
        k for k in state if k != "fc.weight" and k != "fc.bias" and "running" not in k and "batches" not in k
    ]
    assert saved["conv1.weight"].shape == (64, 3, 7, 7)  # torchvision's stem, not the 3x3 CIFAR one
    for key in parameters:
        assert torch.equal(saved[key], state[key]), key
    assert saved["fc.weight"].shape == (3, 512)  # the final layer replaced for the 3 classes
    config = json.loads((out / "model_config.json").read_text())
    assert (config["stem"], config["image_size"], config["pretrained"]) == ("imagenet", 224, True)
    assert (config["mean"], config["std"]) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    # and --predict rebuilds that model: torchvision's stem, 224 px input
    rows = json_lines(
        check(run([PYTHON, CIFAR_SCRIPT, "--predict", data / "val", "--model", out], env)).stdout
    )
    assert len(rows) == 3 and all(row["label"] in CLASSES for row in rows)


def test_pretrained_without_the_weights_offline_names_the_file_and_folder(tmp_path):
    data = write_image_folder(tmp_path / "imgs", 15, size=24, seed=0)
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    env = recipe_env(tmp_path, TORCH_HOME=tmp_path / "torch")
    base = [
        PYTHON,
        CIFAR_SCRIPT,
        "--dataset",
        "imagefolder",
        "--data_dir",
        data,
        "--pretrained",
        "--batch_size",
        "4",
        "--tracker",
        "none",
        "--output_dir",
        tmp_path / "out",
    ]
    url = f"https://download.pytorch.org/models/{WEIGHTS_NAME}"
    # no internet here: the download fails at once and says where the file goes
    fails_with(run(base, env, timeout=120), f"could not download {WEIGHTS_NAME}", url, f"in {folder} ")
    fails_with(
        run([*base, "--download", "False"], env, timeout=120),
        f"--pretrained needs {WEIGHTS_NAME}",
        url,
        f"in {folder} ",
    )
    assert not list(folder.glob("*"))  # no partial file left to be taken for the weights next time
    fails_with(
        run(
            [PYTHON, CIFAR_SCRIPT, "--dataset", "synthetic", "--pretrained", "--output_dir", tmp_path / "o"],
            env,
        ),
        "--pretrained fine-tunes ImageNet weights on --dataset imagefolder",
    )
