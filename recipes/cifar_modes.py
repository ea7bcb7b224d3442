"""What cifar.py does when it does not train: --eval_only and --predict.

--eval_only evaluates a saved model on the test split of the data flags, with the evaluation of
training (cifar.py's evaluate, passed in); --predict classifies image files. Both rebuild the model
from the folder a finished run saved (model.safetensors and model_config.json).
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
from accelerate.utils import set_seed

# beside this file: copy them with the recipe
from cifar_data import build_loaders, load_data
from cifar_model import MODEL_CONFIG, build_model, ready_model, why
from PIL import Image
from safetensors.torch import load_file
from torchvision import transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

from accelerate_recipes import (
    RecipeError,
    check_launch,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    finish_run,
    prepare_output_dir,
    print_summary,
)
from accelerate_recipes.plots import save_confusion_matrix


# ---------------------------------------------------------------------------------- --eval_only
def evaluate_saved_model(args, evaluate) -> None:
    """--eval_only: the model in --model (default --output_dir) on the whole test split, each image
    counted once on any number of processes; results.json and the confusion matrix go to
    --output_dir. Nothing is trained. `evaluate`: cifar.py's, the evaluation of training."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    model_dir = args.model or args.output_dir
    model, saved = load_trained_model(model_dir)
    # what the model was trained with
    image_size, mean, std = saved["image_size"], saved["mean"], saved["std"]
    if args.dataset != "imagefolder" and image_size != 32:
        raise RecipeError(
            f"--model {model_dir} takes {image_size} px images and --dataset {args.dataset} has 32 px "
            "ones: evaluate it on --dataset imagefolder"
        )
    accelerator = evaluation_accelerator(args)
    per_process = check_launch(accelerator, args.batch_size, 1, False, 0.0)
    set_seed(args.seed)
    prepare_output_dir(output)
    _, test_set, classes = load_data(args, accelerator, image_size, mean, std)
    if classes != saved["classes"]:
        raise RecipeError(
            f"--model {model_dir} was trained on {len(saved['classes'])} classes ({short(saved['classes'])})"
            f" and --dataset {args.dataset} has {len(classes)} ({short(classes)}): evaluate it on data "
            "with the same classes"
        )
    loaders = build_loaders(args, accelerator, None, test_set, per_process, mean, std)
    model, test_loader = accelerator.prepare(ready_model(args, accelerator, model), loaders.test)
    evaluation, confusion = evaluate(model, test_loader, accelerator, len(classes), args.tta_flip)
    accelerator.print(
        f"eval accuracy {evaluation['eval_accuracy']:.4f}, loss {evaluation['eval_loss']:.4f} on "
        f"{evaluation['eval_samples']} test images"
    )
    config = eval_only_config(
        "cifar",
        args,
        accelerator,
        dataset=args.dataset,
        model=saved["model"],
        model_dir=str(model_dir),
        per_process_batch_size=per_process,
        image_size=image_size,
        loader=loaders.kind,
        tta_flip=args.tta_flip,
        test_size=len(test_set),
        distributed_type=accelerator.distributed_type.value,
        synthetic_data=args.dataset == "synthetic",
        epochs=0,
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        save_confusion_matrix(confusion, classes, output, draw=args.plots)
        print_summary(
            results,
            [
                "dataset",
                "model",
                "world_size",
                "mixed_precision",
                "loader",
                "eval_accuracy",
                "eval_loss",
                "eval_samples",
                "wall_seconds",
            ],
            title="cifar: evaluation",
        )
        print(f"{path.name} and the confusion matrix saved in {output}")


def load_trained_model(model_dir: str) -> tuple[nn.Module, dict]:
    """The model a finished run saved in `model_dir` (model.safetensors), rebuilt from its
    model_config.json."""
    folder = Path(model_dir)
    missing = [name for name in (MODEL_CONFIG, "model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise RecipeError(
            f"--model {folder} is not the output of a finished cifar run (no {' or '.join(missing)} "
            "there); train first, or point --model at the --output_dir of a finished run"
        )
    try:
        config = json.loads((folder / MODEL_CONFIG).read_text())
        net = build_model(config["model"], config["num_classes"], stem=config["stem"])
        net.load_state_dict(load_file(str(folder / "model.safetensors")))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as err:
        raise RecipeError(
            f"--model {folder}: {MODEL_CONFIG} and model.safetensors do not make a model ({why(err)}); "
            "point --model at the --output_dir of a finished run"
        ) from None
    return net, config


def short(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


# ------------------------------------------------------------------------------------ --predict
def image_files(sources) -> list[Path]:
    """The images to classify: files as given, and every image file under a folder (sorted,
    subfolders included)."""
    files = []
    for item in map(str, sources if isinstance(sources, (list, tuple)) else [sources]):
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
            if not found:
                raise RecipeError(
                    f"--predict {path}: the folder holds no images ({', '.join(IMG_EXTENSIONS)}, "
                    "subfolders included); give image files or a folder of them"
                )
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise RecipeError(
                f"--predict {path}: no such file or folder; give image files or folders of images"
            )
    return files


def read_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    # PIL's UnidentifiedImageError is an OSError
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise RecipeError(
            f"--predict {path} cannot be read as an image ({why(err)}); give PNG, JPEG or another "
            "format PIL reads, or leave the file out"
        ) from None


@torch.no_grad()
def predict(args) -> None:
    """--predict: classify images with a trained model; print one JSON line per image (image, label,
    score) and nothing else."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("--predict runs in one process: start it with python, not a launcher")
    model, config = load_trained_model(args.model or args.output_dir)
    files = image_files(args.predict)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    size = config["image_size"]  # the test-time preprocessing of the run that trained the model
    preprocess = transforms.Compose(
        [
            transforms.Resize((size, size)),
            transforms.ToTensor(),
            transforms.Normalize(config["mean"], config["std"]),
        ]
    )
    for start in range(0, len(files), args.batch_size):
        chunk = files[start : start + args.batch_size]
        images = torch.stack([preprocess(read_image(path)) for path in chunk]).to(device)
        scores, ids = model(images).float().softmax(dim=-1).max(dim=-1)
        for path, label_id, score in zip(chunk, ids.tolist(), scores.tolist()):
            print(
                json.dumps(
                    {"image": str(path), "label": config["classes"][label_id], "score": round(score, 4)}
                )
            )
