"""The model of recipes/cifar.py: torchvision's ResNets with a CIFAR stem, or with torchvision's
ImageNet weights (downloaded into torch's hub cache, their SHA-256 checked), the inputs each takes,
and the files a saved model is rebuilt from (model.safetensors and model_config.json).

Copy this file together with cifar.py: the recipe and cifar_modes.py import it from their folder.
"""

import hashlib
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torchvision
from accelerate.utils import DistributedType

# beside this file: copy it with the recipe
from cifar_data import MEAN, STD

from accelerate_recipes import RecipeError, first_line

ARCHITECTURES = ("resnet18", "resnet34", "resnet50")  # --arch
# --pretrained: torchvision's ImageNet weights (their URL, file name and preprocessing) for each
# --arch
IMAGENET_WEIGHTS = {
    "resnet18": torchvision.models.ResNet18_Weights.DEFAULT,
    "resnet34": torchvision.models.ResNet34_Weights.DEFAULT,
    "resnet50": torchvision.models.ResNet50_Weights.DEFAULT,
}
# beside model.safetensors: what --predict and --eval_only rebuild the model from
MODEL_CONFIG = "model_config.json"


@dataclass(frozen=True)
class InputSettings:
    """The model the flags ask for and the inputs it takes: input_settings computes it once."""

    arch: str  # resnet18, resnet34 or resnet50
    # "cifar" (3x3, no max-pool, for 32 px) or "imagenet" (torchvision's own, for --pretrained)
    stem: str
    image_size: int  # side length of the images it trains on
    mean: tuple  # per-channel normalisation of its inputs
    std: tuple


def input_settings(args) -> InputSettings:
    """The model to train, its stem, and its inputs' size and normalisation (ImageNet's with
    --pretrained), from the recipe's flags."""
    if args.model is not None:
        raise RecipeError(
            f"--model {args.model}: --model is a finished run's folder, for --predict and "
            "--eval_only; choose the network to train with --arch (resnet18, resnet34 or resnet50)"
        )
    stem = "imagenet" if args.pretrained else "cifar"
    if args.pretrained and args.dataset != "imagefolder":
        raise RecipeError(
            "--pretrained fine-tunes ImageNet weights on --dataset imagefolder (224 px images); "
            f"--dataset {args.dataset} trains from scratch with the 32 px CIFAR stem: drop "
            "--pretrained"
        )
    # the preprocessing the ImageNet weights expect
    imagenet = IMAGENET_WEIGHTS[args.arch].transforms()
    mean, std = (tuple(imagenet.mean), tuple(imagenet.std)) if args.pretrained else (MEAN, STD)
    image_size = 32
    if args.dataset == "imagefolder":
        image_size = args.image_size or (imagenet.crop_size[0] if args.pretrained else 32)
    return InputSettings(arch=args.arch, stem=stem, image_size=image_size, mean=mean, std=std)


def build_model(name: str, num_classes: int, stem: str = "cifar", weights: Path | None = None) -> nn.Module:
    """A torchvision ResNet with a fresh `num_classes` classifier.

    stem "cifar": randomly initialised, with the usual CIFAR stem for 32x32 inputs. stem "imagenet":
    torchvision's own stem (for ~224 px images), with the ImageNet weights in `weights` (a
    torchvision checkpoint) when given.
    """
    if name not in ARCHITECTURES:  # a model_config.json written by hand or by another program
        raise RecipeError(f"unknown architecture {name!r}; choose {', '.join(ARCHITECTURES)}")
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
                f"{weights} is not torchvision's ImageNet {name} ({why(err)}); delete it and run "
                f"again to download it, or place the release from {IMAGENET_WEIGHTS[name].url} "
                "there"
            ) from None
    # the new task's classes replace ImageNet's 1000
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


def ready_model(args, accelerator, model: nn.Module) -> nn.Module:
    """SyncBatchNorm across processes (--sync_bn) and the channels-last layout (--channels_last)."""
    if args.sync_bn and accelerator.num_processes > 1:
        if accelerator.distributed_type != DistributedType.MULTI_GPU:
            raise RecipeError(
                "--sync_bn needs GPUs: torch's SyncBatchNorm runs on CUDA only; drop it on CPU runs"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(memory_format=torch.channels_last) if args.channels_last else model


def why(err: Exception) -> str:
    """The telling line of an error, short: load_state_dict's first line only says that loading
    failed."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."


# ------------------------------------------------------------------------- ImageNet weights
def pretrained_weights(args, accelerator, arch: str) -> Path | None:
    """torchvision's ImageNet weights file for --pretrained, else None: one process per node fetches
    it, the others wait, then read that copy."""
    if not args.pretrained:
        return None
    with accelerator.local_main_process_first():
        download = args.download and accelerator.is_local_main_process
        return imagenet_weights_file(arch, download=download, say=accelerator.print)


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
                f"--pretrained needs {file.name} (torchvision's ImageNet {name}), not found in "
                f"{folder}: {place}"
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
            f"warning: {file} is not torchvision's release (its SHA-256 does not start with "
            f"{expected}); using it as it is: delete it to download the release"
        )
    return file


def sha256_prefix(file_name: str) -> str | None:
    """The hash prefix torchvision puts in a weights file's name (resnet18-f37072fd.pth:
    f37072fd)."""
    found = torch.hub.HASH_REGEX.search(file_name)
    return found.group(1) if found else None


# ---------------------------------------------------------------------------- a saved model
def describe_model(args, settings: InputSettings, classes: list[str]) -> dict:
    """What --predict and --eval_only rebuild a saved model from (model_config.json beside its
    weights)."""
    return dict(
        model=settings.arch,  # the key saved runs have always had
        stem=settings.stem,
        num_classes=len(classes),
        classes=classes,
        image_size=settings.image_size,
        mean=list(settings.mean),
        std=list(settings.std),
        dataset=args.dataset,
        pretrained=args.pretrained,
    )


def write_model_config(folder: Path, model_config: dict) -> None:
    (Path(folder) / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2) + "\n")
