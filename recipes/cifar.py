#!/usr/bin/env python
"""Train ResNet18 on CIFAR-10 / CIFAR-100 with Hugging Face Accelerate: one script for 1 GPU, N GPUs
and N nodes.

    python recipes/cifar.py --dataset synthetic --epochs 1              # one process, any machine
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/cifar.py
    make cifar-2node NODE_RANK=1 MASTER_ADDR=10.0.0.1                   # on the second of two nodes
    python recipes/cifar.py --predict photo.jpg --model outputs/cifar   # classify with a trained model
    # fine-tune ImageNet weights on your own images
    python recipes/cifar.py --dataset imagefolder --data_dir my_images --pretrained

The script reads top to bottom: config -> data -> model -> prepare -> loop -> eval -> save.
`--batch_size` is the GLOBAL batch (all processes together), so the same flags give the same
training on any number of GPUs.

Install: `pip install -e .` from a clone of accelerate-recipes (the runtime; this recipe needs no
extra). To start a project of your own, copy this file and cifar_data.py (generated data and the
on-device loader) beside it.
"""

import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torchvision
from accelerate.utils import DistributedType, set_seed

# beside this file: copy it with the recipe
from cifar_data import DeviceImageLoader, synthetic_images
from PIL import Image
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets.folder import IMG_EXTENSIONS
from transformers import get_scheduler

from accelerate_recipes import (
    BestModel,
    Checkpoints,
    RecipeError,
    RunState,
    TrainingFlags,
    check_launch,
    check_launch_flags,
    clip_norm,
    cpu_threads_and_workers,
    epoch_batches,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    first_line,
    keeps_update,
    model_to_save,
    prepare_output_dir,
    print_summary,
    run,
    run_config,
    saving_checkpoint,
    setup_tracker,
    training_accelerator,
    training_progress,
    write_results,
)
from accelerate_recipes.compiling import compile_results, compile_summary_keys, process_compile_counts
from accelerate_recipes.plots import plot_results, save_confusion_matrix
from accelerate_recipes.seeding import SeededAugmentation
from accelerate_recipes.tracking import log_image_files

CIFAR = {  # torchvision class, folder it extracts to, archive to place by hand when offline
    "cifar10": (
        torchvision.datasets.CIFAR10,
        "cifar-10-batches-py",
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    ),
    "cifar100": (
        torchvision.datasets.CIFAR100,
        "cifar-100-python",
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    ),
}
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 training-set statistics
MODELS = ("resnet18", "resnet34", "resnet50")
# --pretrained: torchvision's ImageNet weights (their URL, file name and preprocessing) for each
# --model
IMAGENET_WEIGHTS = {
    "resnet18": torchvision.models.ResNet18_Weights.DEFAULT,
    "resnet34": torchvision.models.ResNet34_Weights.DEFAULT,
    "resnet50": torchvision.models.ResNet50_Weights.DEFAULT,
}
# beside model.safetensors: what --predict and --eval_only rebuild the model from
MODEL_CONFIG = "model_config.json"
PRESETS = {
    # ResNet-18 to 94% fast: the settings of the time-to-94% ResNet-18 baseline in
    # KellerJordan/cifar10-zoo (airbench/baselines/train_resnet18_94.py: 26 epochs, batch 500, SGD
    # nesterov lr 0.2 momentum 0.9 wd 5e-4, lr warmup over the first 20% of steps then linear decay
    # to 0, flip + 4-pixel translate + 12-pixel cutout, no label smoothing, flip test-time
    # augmentation; its notes give 94.0% mean accuracy, 51 s on one A100). Batch 512 here, so it
    # divides over 1, 2, 4, 8 and 16 processes.
    "fast94": dict(
        epochs=26,
        batch_size=512,
        lr=0.2,
        momentum=0.9,
        weight_decay=5e-4,
        warmup_ratio=0.2,
        schedule="linear",
        label_smoothing=0.0,
        cutout=12,
        tta_flip=True,
    ),
}


# -------------------------------------------------------------------------------------------- flags
@dataclass
class CifarFlags(TrainingFlags):
    """Train a CIFAR-stem ResNet on CIFAR-10/100, generated data or your own image folders (or
    fine-tune ImageNet weights on them), evaluate a trained model, or classify images with it.

    Args:
        dataset: cifar10, cifar100, synthetic (generated, learnable, CIFAR-shaped; no download) or
            imagefolder.
        data_dir: where CIFAR is (or is downloaded to); for imagefolder the folder holding train/
            and val/.
        synthetic_size: training images generated for --dataset synthetic (the test split gets a
            fifth as many).
        download: download CIFAR when it is not in --data_dir, and --pretrained's weights when not
            in torch's cache.
        verify_data: check the CIFAR files against the release's MD5 sums; turn off for a re-packed
            subset.
        image_size: side length images are resized to for --dataset imagefolder (CIFAR is 32);
            default 32, or 224 with --pretrained (the size the ImageNet weights were trained at).
        loader: device (the whole dataset in device memory as uint8, batches cropped, flipped and
            normalised there: no DataLoader, no per-image Python), torch (DataLoader with
            torchvision transforms), or auto: device for CIFAR and generated data when it takes
            under a quarter of the free device memory, else torch.
        model: resnet18, resnet34 or resnet50 from torchvision, with a 3x3 stride-1 stem and no
            max-pool (default resnet18). For --predict and --eval_only: the output directory of a
            finished run (model.safetensors and model_config.json), default --output_dir.
        pretrained: fine-tune torchvision's ImageNet weights of --model (--dataset imagefolder
            only): torchvision's own 7x7 stem and max-pool, 224 px images unless --image_size says
            otherwise, ImageNet mean/std, a new final layer for your classes. The weights are read
            from torch's hub cache (torch.hub.get_dir()/checkpoints, e.g. resnet18-f37072fd.pth;
            TORCH_HOME moves it) and downloaded there first when missing, by one process per node.
            CIFAR and generated data always train from scratch.
        lr: peak learning rate of SGD (nesterov momentum), reached after warmup, then decayed to
            zero (--schedule); default 0.1 x batch_size / 128 (the linear scaling rule), so 0.4 for
            the default global batch of 512.
        momentum: SGD momentum.
        label_smoothing: label smoothing of the cross-entropy loss.
        warmup_ratio: fraction of the optimizer steps spent warming the learning rate up linearly.
        schedule: decay after warmup: cosine (to zero) or linear (to zero).
        max_grad_norm: clip the gradients' global L2 norm to this before each update (0, the
            default: no clipping, as in torchvision's ResNet reference; BatchNorm keeps ResNet's
            gradients tame).
        sync_bn: synchronise BatchNorm statistics across processes (GPUs only). Off by default, as
            in torchvision's and timm's references: each GPU normalises over its own share of the
            batch.
        channels_last: NHWC memory layout, faster for convolutions with tensor cores.
        augment: random pad-4 crop and horizontal flip on training images.
        cutout: side of a random square erased from each training image (0: off); --loader device
            only.
        tta_flip: evaluate on each test image and its mirror image, averaging the logits.
        compile: compile the model with torch.compile
            (Accelerator(dynamo_backend=--compile_backend): prepare() wraps it); the first steps and
            the first evaluation take longer while it compiles. The saved models hold the plain
            ResNet's weights, which --predict and --eval_only load as any others, and a checkpoint
            resumes with or without --compile.
        compile_backend: torch.compile's backend under --compile: inductor (default: generates fused
            kernels) or aot_eager (traces and runs torch's own kernels: no code generation, for
            checking a compiled run quickly).
        skip_nonfinite_steps: drop the update of a step whose loss is NaN or infinite and go on,
            instead of stopping (the optimizer skips it; BatchNorm statistics of that forward pass
            are kept).
        run_name: tracker run name; default cifar-<dataset>.
        preset: a named set of the flags above; flags you also give keep your value. fast94: the
            settings of a public ResNet-18 time-to-94% baseline (26 epochs, batch 512, lr 0.2, 20%
            warmup then linear decay, cutout 12, flip test-time augmentation); see PRESETS in this
            file for the source.
        eval_only: evaluate the model in --model (default --output_dir) on the test split of the
            data flags (--dataset, --data_dir, ...) and write results.json to --output_dir, without
            training; the model's classes, image size and normalisation come from its
            model_config.json. Runs on any number of processes. With --output_dir the model's folder
            (the default), the training run's results.json is replaced.
        predict: classify instead of training: an image file or a folder of images (subfolders
            included), with the model in --model (default --output_dir). Prints one JSON line per
            image, {"image", "label", "score"} (the class name and its probability), and nothing
            else; give --predict several times for several.
    """

    dataset: Literal["cifar10", "cifar100", "synthetic", "imagefolder"] = "cifar10"
    data_dir: str = "data"
    synthetic_size: int = 50_000
    download: bool = True
    verify_data: bool = True
    image_size: int | None = None
    loader: Literal["auto", "device", "torch"] = "auto"
    model: str | None = None
    pretrained: bool = False
    batch_size: int = 512
    epochs: int = 30
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.1
    warmup_ratio: float = 0.05
    schedule: Literal["cosine", "linear"] = "cosine"
    sync_bn: bool = False
    channels_last: bool = True
    augment: bool = True
    cutout: int = 0
    tta_flip: bool = False
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    output_dir: str = "outputs/cifar"
    preset: str | None = None


# --------------------------------------------------------------------------------------------- data
class ArrayImages(Dataset):
    """Images held as a uint8 [N, H, W, 3] array, served like torchvision's CIFAR datasets (PIL
    image, label)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform=None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = Image.fromarray(self.images[index])
        return (self.transform(image) if self.transform else image), int(self.labels[index])


def load_cifar(name: str, root: Path, train_tf, test_tf, download: bool, verify: bool):
    """CIFAR-10/100 through torchvision: downloaded when online, else read from `root`."""
    dataset_cls, folder, url = CIFAR[name]
    # A copy you re-packed or subsetted yourself: the same files, other checksums (torchvision skips
    # the check of an md5 that is None).
    if not verify:
        dataset_cls = type(
            dataset_cls.__name__,
            (dataset_cls,),
            {
                "train_list": [[file, None] for file, _ in dataset_cls.train_list],
                "test_list": [[file, None] for file, _ in dataset_cls.test_list],
                "meta": {**dataset_cls.meta, "md5": None},
            },
        )
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)  # an unreachable mirror fails within a minute instead of hanging
    try:
        train = dataset_cls(str(root), train=True, transform=train_tf, download=download)
        test = dataset_cls(str(root), train=False, transform=test_tf, download=False)
    # torchvision raises RuntimeError, URLError, OSError or pickle errors here
    except Exception as err:
        reason = first_line(err)
        raise RecipeError(
            f"{name} not found or corrupt in {root / folder} ({reason}); download {url.rsplit('/', 1)[1]} "
            f"from {url} "
            f"into {root} (it is unpacked on the next run), point --data_dir at a copy, "
            "or try the pipeline without data: --dataset synthetic"
        ) from None
    finally:
        socket.setdefaulttimeout(previous_timeout)
    return train, test, list(train.classes)


def build_datasets(
    dataset, data_dir, synthetic_size, image_size, augment, download, verify, seed, mean=MEAN, std=STD
):
    """Return (train set, test set, class names) for --dataset, with pad-and-crop + flip
    augmentation on train."""
    size = image_size if dataset == "imagefolder" else 32
    normalize = [transforms.ToTensor(), transforms.Normalize(mean, std)]
    resize = [transforms.Resize((size, size))] if dataset == "imagefolder" else []
    augmentation = (
        [transforms.RandomCrop(size, padding=size // 8), transforms.RandomHorizontalFlip()] if augment else []
    )
    train_tf = transforms.Compose(resize + augmentation + normalize)
    test_tf = transforms.Compose(resize + normalize)
    root = Path(data_dir).expanduser()

    if dataset in CIFAR:
        return load_cifar(dataset, root, train_tf, test_tf, download, verify)
    if dataset == "synthetic":
        if synthetic_size < 10:
            raise RecipeError(
                f"--synthetic_size {synthetic_size} is too small; use at least 10 (one image per class)"
            )
        # Same train:test proportion as CIFAR (50,000 : 10,000).
        train_x, train_y = synthetic_images(synthetic_size, num_classes=10, seed=seed)
        test_x, test_y = synthetic_images(max(10, synthetic_size // 5), num_classes=10, seed=seed + 1)
        classes = [f"class_{i}" for i in range(10)]
        return ArrayImages(train_x, train_y, train_tf), ArrayImages(test_x, test_y, test_tf), classes
    # imagefolder: DIR/train/<class>/*.png and DIR/val/<class>/*.png
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise RecipeError(
                f"--dataset imagefolder expects {root / split}/<class name>/<images>; "
                f"{root / split} does not exist (set --data_dir to the folder holding train/ and val/)"
            )
    train = torchvision.datasets.ImageFolder(str(root / "train"), transform=train_tf)
    test = torchvision.datasets.ImageFolder(str(root / "val"), transform=test_tf)
    if train.classes != test.classes:
        raise RecipeError(
            f"class folders differ between {root / 'train'} and {root / 'val'}: {train.classes} vs "
            f"{test.classes}"
        )
    return train, test, list(train.classes)


def image_arrays(dataset):
    """(uint8 [N, H, W, 3] images, labels) of an in-memory dataset, or None for files read one by
    one (imagefolder)."""
    if isinstance(dataset, ArrayImages):
        return dataset.images, dataset.labels
    if isinstance(dataset, torchvision.datasets.CIFAR10):  # CIFAR100 is a subclass
        return dataset.data, np.asarray(dataset.targets)
    return None


def fits_on_device(num_bytes: int, device: torch.device) -> bool:
    """The device loader keeps the uint8 images in device memory: allow it up to a quarter of what
    is free."""
    if device.type != "cuda":
        return True  # host memory: the dataset is in RAM already
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes < free / 4


# -------------------------------------------------------------------------------------------- model
def check_model_name(name: str) -> str:
    if name not in MODELS:
        hint = " (a run's output directory is for --predict and --eval_only)" if Path(name).is_dir() else ""
        raise RecipeError(f"unknown --model {name!r}; choose {', '.join(MODELS)}{hint}")
    return name


def imagenet_weights_file(name: str, download: bool, say=print) -> Path:
    """Path of torchvision's ImageNet weights for `name` in torch's hub cache, downloaded there when
    missing.

    The file name and folder are the ones torchvision itself uses (torch.hub.get_dir()/checkpoints),
    so weights any torchvision program fetched are reused, and offline you can place the file there
    by hand.
    """
    weights = IMAGENET_WEIGHTS[name]
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    file = folder / weights.url.rsplit("/", 1)[1]  # e.g. resnet18-f37072fd.pth
    place = (
        f"download {weights.url} and place it as {file.name} in {folder} (torch.hub.get_dir()/checkpoints)"
    )
    if not file.is_file():
        if not download:
            raise RecipeError(
                f"--pretrained needs {file.name} (torchvision's ImageNet {name}), not found in {folder}: "
                f"{place}"
            )
        previous_timeout = socket.getdefaulttimeout()
        # an unreachable server fails within a minute instead of hanging
        socket.setdefaulttimeout(60)
        try:
            say(f"downloading {weights.url} to {file}")
            folder.mkdir(parents=True, exist_ok=True)
            # Written to a temporary file and moved into place
            # once its SHA-256 matches the name's prefix.
            torch.hub.download_url_to_file(
                weights.url, str(file), hash_prefix=sha256_prefix(file.name), progress=False
            )
        except Exception as err:  # URLError, OSError, or the RuntimeError of a hash mismatch
            reason = first_line(err)
            raise RecipeError(f"--pretrained could not download {file.name} ({reason}); {place}") from None
        finally:
            socket.setdefaulttimeout(previous_timeout)
        return file
    # torchvision checks the hash only while downloading and loads a cached file as it is; say so
    # when it differs.
    expected = sha256_prefix(file.name)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    if expected and not digest.startswith(expected):
        say(
            f"warning: {file} is not torchvision's release (its SHA-256 does not start with {expected}); "
            "using it as it is: delete it to download the release"
        )
    return file


def sha256_prefix(file_name: str) -> str | None:
    """The hash prefix torchvision puts in a weights file's name (resnet18-f37072fd.pth:
    f37072fd)."""
    found = torch.hub.HASH_REGEX.search(file_name)
    return found.group(1) if found else None


def build_model(name: str, num_classes: int, stem: str = "cifar", weights: Path | None = None) -> nn.Module:
    """A torchvision ResNet with a fresh `num_classes` classifier.

    stem "cifar": randomly initialised, with the usual CIFAR stem for 32x32 inputs. stem "imagenet":
    torchvision's own stem (for ~224 px images), with the ImageNet weights in `weights` (a
    torchvision checkpoint) when given.
    """
    check_model_name(name)
    if stem == "cifar":
        model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
        # The ImageNet stem (7x7 stride-2 conv + max-pool)
        # would shrink 32x32 to 8x8 before the first block.
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model
    # 1000 ImageNet classes, as the checkpoint holds
    model = getattr(torchvision.models, name)(weights=None)
    if weights is not None:
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except Exception as err:  # a truncated or foreign file: unpickling or key/shape errors
            raise RecipeError(
                f"{weights} is not torchvision's ImageNet {name} ({why(err)}); delete it and run again "
                f"to download it, or place the release from {IMAGENET_WEIGHTS[name].url} there"
            ) from None
    # the new task's classes replace ImageNet's 1000
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


def why(err: Exception) -> str:
    """The telling line of an error, short: load_state_dict's first line only says that loading
    failed."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def short(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def write_model_config(folder: Path, model_config: dict) -> None:
    (Path(folder) / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2) + "\n")


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


@torch.no_grad()
def evaluate(
    model, loader, accelerator, num_classes: int, tta_flip: bool = False
) -> tuple[dict, torch.Tensor]:
    """Top-1 accuracy and mean loss over the whole test set, each sample counted once whatever the
    world size, and the confusion matrix (counts, rows: true class, columns: predicted class).

    tta_flip averages the logits of each image and its mirror image (test-time augmentation). The
    counts and the loss are summed on the device and read once, after the last batch.
    """
    model.eval()
    counts = torch.zeros(num_classes * num_classes, dtype=torch.long, device=accelerator.device)
    loss_sum = torch.zeros((), device=accelerator.device)
    full = None
    for images, labels in loader:
        # A smaller last batch is padded to the full size for the forward pass and its logits cut
        # back: with --compile another batch size would compile the model once more (eval mode keeps
        # the rows independent).
        count = len(images)
        full = full or count
        # in the batches' memory layout too: other strides would also compile again
        if count < full:
            channels_last = images.is_contiguous(memory_format=torch.channels_last)
            layout = torch.channels_last if channels_last else torch.contiguous_format
            padded = images.new_zeros((full, *images.shape[1:])).contiguous(memory_format=layout)
            padded[:count] = images
            images = padded
        logits = model(images)
        if tta_flip:
            logits = (logits + model(images.flip(3))) / 2
        logits = logits[:count]
        losses = nn.functional.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
        # gather_for_metrics drops the samples the sampler
        # repeated to give every process an equal share.
        preds, labels, losses = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels, losses))
        keep = labels >= 0  # the device loader pads the last shards with label -1
        preds, labels, losses = preds[keep], labels[keep], losses[keep]
        counts += torch.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
        loss_sum += losses.sum()
    model.train()
    counts = counts.view(num_classes, num_classes).cpu()
    seen = int(counts.sum())
    correct = int(counts.diagonal().sum())
    loss = loss_sum.item() / max(seen, 1)
    return {"eval_accuracy": correct / max(seen, 1), "eval_loss": loss, "eval_samples": seen}, counts


# ------------------------------------------------------------------------------------------ predict
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
def predict(args: CifarFlags) -> None:
    """Classify images with a trained model; print one JSON line per image (image, label, score) and
    nothing else."""
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


# ------------------------------------------------------------------------------- set-up, both modes
def input_settings(args: CifarFlags) -> tuple[str, str, int, tuple, tuple]:
    """The model to train, its stem, and its inputs' size and normalisation (ImageNet's with
    --pretrained)."""
    model, stem = check_model_name(args.model or "resnet18"), "imagenet" if args.pretrained else "cifar"
    if args.pretrained and args.dataset != "imagefolder":
        raise RecipeError(
            f"--pretrained fine-tunes ImageNet weights on --dataset imagefolder (224 px images); "
            f"--dataset {args.dataset} trains from scratch with the 32 px CIFAR stem: drop --pretrained"
        )
    imagenet = IMAGENET_WEIGHTS[model].transforms()  # the preprocessing the ImageNet weights expect
    mean, std = (tuple(imagenet.mean), tuple(imagenet.std)) if args.pretrained else (MEAN, STD)
    image_size = 32
    if args.dataset == "imagefolder":
        image_size = args.image_size or (imagenet.crop_size[0] if args.pretrained else 32)
    return model, stem, image_size, mean, std


def load_data(args: CifarFlags, accelerator, image_size: int, mean, std):
    """(train set, test set, class names); the local main process of each node downloads first, the
    others then read its copy."""
    with accelerator.local_main_process_first():
        train_set, test_set, classes = build_datasets(
            args.dataset,
            args.data_dir,
            args.synthetic_size,
            image_size,
            args.augment,
            download=args.download and accelerator.is_local_main_process,
            verify=args.verify_data,
            seed=args.seed,
            mean=mean,
            std=std,
        )
    if args.dataset == "synthetic":
        accelerator.print(
            "!" * 100 + "\n!! SYNTHETIC DATA: generated images, not CIFAR. Accuracy here measures the "
            "pipeline, not the model on real data.\n" + "!" * 100
        )
    return train_set, test_set, classes


def build_loaders(args: CifarFlags, accelerator, train_set, test_set, per_process: int, mean, std):
    """(train set, train loader, test loader, loader kind): the device loader when the images fit in
    device memory (--loader auto), else torch's DataLoader with a seeded augmentation (the train set
    comes back wrapped in it). With no train set (evaluation only) there is no train loader."""
    arrays = [image_arrays(data) for data in (train_set, test_set) if data is not None]
    loader = args.loader
    if loader == "auto":
        in_memory = all(array is not None for array in arrays)
        fits = in_memory and fits_on_device(sum(array[0].nbytes for array in arrays), accelerator.device)
        loader = "device" if fits else "torch"
    # on the CPU also torch's threads
    num_workers = cpu_threads_and_workers(accelerator, args.num_workers)
    eval_batch = per_process * args.gradient_accumulation_steps
    train_loader = None
    if loader == "device":
        if any(array is None for array in arrays):
            raise RecipeError(
                f"--loader device needs the images in memory; --dataset {args.dataset} reads files one "
                "by one: use --loader torch"
            )
        # Each process reads its own share straight from
        # device memory; nothing for prepare() to shard.
        common = dict(
            device=accelerator.device,
            mean=mean,
            std=std,
            seed=args.seed,
            process_index=accelerator.process_index,
            num_processes=accelerator.num_processes,
        )
        if train_set is not None:
            train_loader = DeviceImageLoader(
                *arrays[0],
                per_process,
                train=True,
                pad=4 if args.augment else 0,
                flip=args.augment,
                cutout=args.cutout,
                **common,
            )
        return (
            train_set,
            train_loader,
            DeviceImageLoader(*arrays[-1], eval_batch, train=False, **common),
            loader,
        )
    if args.cutout:
        raise RecipeError("--cutout runs in the device loader only; use --loader device or drop --cutout")
    loader_args = dict(
        num_workers=num_workers, pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0
    )
    if train_set is not None:
        # Augmentation seeded per (seed, epoch, image) and a shuffle generator of the loader's own:
        # a resumed run then sees the same batches, augmented the same way, as an uninterrupted one.
        train_set = SeededAugmentation(train_set, args.seed)
        train_loader = DataLoader(
            train_set,
            batch_size=per_process,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(args.seed),
            **loader_args,
        )
    return train_set, train_loader, DataLoader(test_set, batch_size=eval_batch, **loader_args), loader


def ready_model(args: CifarFlags, accelerator, model: nn.Module) -> nn.Module:
    """SyncBatchNorm across processes (--sync_bn) and the channels-last layout (--channels_last)."""
    if args.sync_bn and accelerator.num_processes > 1:
        if accelerator.distributed_type != DistributedType.MULTI_GPU:
            raise RecipeError(
                "--sync_bn needs GPUs: torch's SyncBatchNorm runs on CUDA only; drop it on CPU runs"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(memory_format=torch.channels_last) if args.channels_last else model


def optimizer_for(args: CifarFlags, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Nesterov SGD, with weight decay on conv and linear weights only (not on BatchNorm weights or
    biases)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        momentum=args.momentum,
        nesterov=True,
    )


def save_trained_model(accelerator, model, folder: Path, model_config: dict) -> None:
    """The weights under the plain model's names (compiled or not), and what --predict and
    --eval_only rebuild it from. Collective."""
    accelerator.save_model(model_to_save(accelerator, model), folder)
    if accelerator.is_main_process:
        write_model_config(folder, model_config)


def pretrained_weights(args: CifarFlags, accelerator, model_name: str) -> Path | None:
    """torchvision's ImageNet weights file for --pretrained, else None: one process per node fetches
    it, the others wait, then read that copy."""
    if not args.pretrained:
        return None
    with accelerator.local_main_process_first():
        download = args.download and accelerator.is_local_main_process
        return imagenet_weights_file(model_name, download=download, say=accelerator.print)


def describe_model(args: CifarFlags, model_name: str, stem: str, image_size: int, mean, std, classes) -> dict:
    """What --predict and --eval_only rebuild a saved model from (model_config.json beside its
    weights)."""
    return dict(
        model=model_name,
        stem=stem,
        num_classes=len(classes),
        classes=classes,
        image_size=image_size,
        mean=list(mean),
        std=list(std),
        dataset=args.dataset,
        pretrained=args.pretrained,
    )


def epoch_line(state: RunState, num_epochs: int, seconds: float, samples_per_second: float) -> str:
    """What each epoch's evaluation prints."""
    evaluation = state.last_eval
    return (
        f"epoch {state.epoch + 1}/{num_epochs}: eval accuracy {evaluation['eval_accuracy']:.4f}, "
        f"loss {evaluation['eval_loss']:.4f}, {seconds:.1f} s, {samples_per_second:.0f} samples/s"
    )


def print_run_summary(results: dict, output: Path, path: Path, tracking) -> None:
    """The end of a training run: its summary table, where its files are, how to use the model."""
    keys = [
        "dataset",
        "world_size",
        "num_machines",
        "mixed_precision",
        "global_batch_size",
        "loader",
        "steps",
        "epochs",
        "eval_accuracy",
        "best_metric",
        "best_epoch",
        "train_samples_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "wall_seconds",
        *compile_summary_keys(results),
    ]
    print_summary(results, keys, title="cifar: summary")
    print(
        f"model, model_best/ (epoch {results['best_epoch']}), {MODEL_CONFIG} and {path.name} saved in "
        f"{output}; "
        f"classify images with: python {os.path.relpath(__file__)} --predict IMAGE_OR_FOLDER --model {output}"
    )
    if tracking.where():
        print(tracking.where())


# -------------------------------------------------------------------------------------------- train
def train(args: CifarFlags) -> None:
    """Train --model on --dataset; the model, model_best/, results.json and the pictures go to
    --output_dir."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    # from the global batch, not the GPU count
    lr = args.lr if args.lr is not None else 0.1 * args.batch_size / 128
    model_name, stem, image_size, mean, std = input_settings(args)

    # ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"cifar-{args.dataset}", args.swanlab_mode
    )
    dynamo_backend = args.compile_backend if args.compile else None  # prepare() then compiles it
    accelerator = training_accelerator(args, tracking, dynamo_backend=dynamo_backend)
    per_process = check_launch_flags(accelerator, args)
    set_seed(args.seed)
    # every training batch has the same shape: pick the fastest kernels once
    torch.backends.cudnn.benchmark = True
    prepare_output_dir(output)
    checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
    resume_from = checkpoints.resolve(args.resume)  # None: a fresh start

    # ---- data
    train_set, test_set, classes = load_data(args, accelerator, image_size, mean, std)
    train_set, train_loader, test_loader, loader = build_loaders(
        args, accelerator, train_set, test_set, per_process, mean, std
    )

    # ---- model and optimizer
    weights_file = pretrained_weights(args, accelerator, model_name)
    model = ready_model(
        args, accelerator, build_model(model_name, len(classes), stem=stem, weights=weights_file)
    )
    # their fp32 gradients are what DDP all-reduces
    trainable = sum(p.numel() for p in model.parameters())
    optimizer = optimizer_for(args, model, lr)

    # ---- prepare: wrap for DDP, shard the loaders across processes (the device loader shards
    # itself and passes
    # through), move to the device, add autocast; then the schedule on the prepared optimizer
    # --compile: results.json counts what the run compiles
    compiled_before = process_compile_counts()
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    # per process, after sharding
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise RecipeError(
            f"the training set ({len(train_set)} images) is smaller than one global batch "
            f"({args.batch_size}); lower --batch_size or use more data"
        )
    total_steps = args.max_steps if args.max_steps else args.epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(args.warmup_ratio * total_steps)
    # Linear warmup over optimizer steps, then cosine or linear decay to zero.
    scheduler = accelerator.prepare(get_scheduler(args.schedule, optimizer, warmup_steps, total_steps))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    config = run_config(
        "cifar",
        args,
        accelerator,
        model=model_name,
        image_size=image_size,
        per_process_batch_size=per_process,
        trainable_parameters=trainable,
        lr=lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        epochs=num_epochs,
        loader=loader,
        train_size=len(train_set),
        test_size=len(test_set),
        synthetic_data=args.dataset == "synthetic",
    )
    # saved beside each model (the last and model_best):
    # what --predict and --eval_only rebuild it from
    model_config = describe_model(args, model_name, stem, image_size, mean, std, classes)

    # ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
    state = RunState(accelerator.device)
    # save_state / load_state carry the position with the weights
    accelerator.register_for_checkpointing(state)
    if resume_from is not None:
        checkpoints.check_compatible(resume_from, config)
        accelerator.load_state(resume_from)
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
    best = BestModel(accelerator, state, output, "eval_accuracy", patience=args.early_stopping_patience)
    progress = training_progress(
        accelerator,
        args,
        state,
        best,
        resume_from,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        batches_per_epoch=len(train_loader),
    )
    guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all

    # ---- training loop
    while state.epoch < num_epochs and not progress.finished:
        progress.start_epoch()
        model.train()
        if isinstance(train_set, SeededAugmentation):
            train_set.set_epoch(state.epoch)
        batches = epoch_batches(accelerator, train_loader, state.epoch, state.batches_done)
        for images, labels in progress.timed(batches):  # each batch's wait timed
            state.batches_done += 1
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            # skips the gradient all-reduce on accumulation micro-steps
            with accelerator.accumulate(model):
                loss = criterion(model(images), labels)
                accelerator.backward(loss)
                # a non-finite loss is noted on the device, read at the next log step
                guard.observe(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
                    # --skip_nonfinite_steps drops a non-finite one
                    if keeps_update(progress, grad_norm):
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # summed on the device, read at log steps only
            state.add(loss.detach(), samples=labels.shape[0])
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            if progress.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
                with saving_checkpoint(checkpoints, progress, config) as folder:
                    accelerator.save_state(folder)
            if progress.finished:
                break

        # ---- evaluation once per epoch, on the whole validation split
        # nothing non-finite since the last log step, before evaluating and saving
        guard.check(state.step)
        state.last_eval, confusion = evaluate(model, test_loader, accelerator, len(classes), args.tta_flip)
        seconds = progress.epoch_done(state.last_eval)
        if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
            with best.saving() as folder:
                save_trained_model(accelerator, model, folder, model_config)
        # results.png and confusion_matrix.csv every epoch; its picture at the end
        if accelerator.is_main_process:
            plot_results(progress.metrics.path, output / "results.png")
            save_confusion_matrix(confusion, classes, output, draw=progress.finished)
            if progress.finished:  # to the trackers that take images
                picture = output / "confusion_matrix.png"
                log_image_files(accelerator, {"eval/confusion_matrix": picture}, state.step)
        accelerator.print(epoch_line(state, num_epochs, seconds, progress.meter.samples_per_second))
        state.epoch, state.batches_done = state.epoch + 1, 0
        with saving_checkpoint(checkpoints, progress, config) as folder:
            accelerator.save_state(folder)
    progress.close()

    # ---- save the model and the run's results
    accelerator.wait_for_everyone()
    save_trained_model(accelerator, model, output, model_config)
    results = dict(config, **progress.results(started))
    # what --compile (or --dynamo_backend) compiled
    results.update(compile_results(compiled_before))
    # all ranks tear the process group down together, none while others still talk
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        path = write_results(output, results)
        print_run_summary(results, output, path, tracking)


# ----------------------------------------------------------------------------------------- evaluate
def evaluate_saved_model(args: CifarFlags) -> None:
    """The model in --model (default --output_dir) on the whole test split, each image counted once
    on any number of processes; results.json and the confusion matrix go to --output_dir. Nothing is
    trained."""
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
    _, _, test_loader, loader = build_loaders(args, accelerator, None, test_set, per_process, mean, std)
    model, test_loader = accelerator.prepare(ready_model(args, accelerator, model), test_loader)
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
        loader=loader,
        tta_flip=args.tta_flip,
        test_size=len(test_set),
        distributed_type=accelerator.distributed_type.value,
        synthetic_data=args.dataset == "synthetic",
        epochs=0,
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        path = write_results(output, results)
        save_confusion_matrix(confusion, classes, output, draw=True)
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


# --------------------------------------------------------------------------------------------- main
def main(args: CifarFlags) -> None:
    """Train, or evaluate a saved model (--eval_only), or use it (--predict): a function per mode."""
    if args.predict is not None and args.eval_only:
        raise RecipeError("give --predict or --eval_only, not both")
    if args.predict is not None:
        return predict(args)
    if args.eval_only:
        return evaluate_saved_model(args)
    return train(args)


if __name__ == "__main__":
    run(main, presets=PRESETS)
