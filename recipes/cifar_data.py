"""Data code of recipes/cifar.py: its four data sources (CIFAR-10, CIFAR-100, generated CIFAR-shaped
images, your own image folders) and the two loaders that serve them, one that keeps small datasets
on the device and torch's DataLoader.

Copy this file together with cifar.py: the recipe imports it from its own folder.

Generated data (`synthetic_images`): each class has its own smooth colour template; an image is its
class template, shifted by a few pixels, with a random brightness and strong per-pixel noise. Train
and test sets share the templates, so accuracy on the test set measures learning, and a few hundred
steps separate the classes. It says nothing about real CIFAR accuracy.

The device data path (`DeviceImageLoader`): CIFAR-10's 50,000 training images are 150 MB as uint8,
so they fit on any GPU. Keeping them there removes the per-image Python work of a DataLoader (PIL
decode, transforms, collation, host-to-device copy), which on a fast GPU costs more time than the
network. Each batch is cropped, flipped, cut out and normalised on the device in a few tensor ops.

Both loaders offer the training loop one interface (`build_loaders`): the train loader's
set_epoch(epoch) sets the epoch's shuffle and augmentation, a resumed epoch skips its first batches
by epoch_batches, and the test loaders yield batches of one size, the last padded with label -1
rows that evaluation drops after gathering.
"""

import math
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from accelerate.data_loader import skip_first_batches
from PIL import Image
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision import transforms

from accelerate_recipes import RecipeError, cpu_threads_and_workers, first_line
from accelerate_recipes.seeding import SeededAugmentation

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
TEMPLATE_SEED = 20240601  # fixed, so every split and every process sees the same classes


# ------------------------------------------------------------------------------ data sources
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
            f"{name} not found or corrupt in {root / folder} ({reason}); download "
            f"{url.rsplit('/', 1)[1]} from {url} into {root} (it is unpacked on the next run), "
            "point --data_dir at a copy, or try the pipeline without data: --dataset synthetic"
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
        return (ArrayImages(train_x, train_y, train_tf), ArrayImages(test_x, test_y, test_tf), classes)
    # imagefolder: DIR/train/<class>/*.png and DIR/val/<class>/*.png
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise RecipeError(
                f"--dataset imagefolder expects {root / split}/<class name>/<images>; "
                f"{root / split} does not exist (set --data_dir to the folder holding train/ and "
                "val/)"
            )
    train = torchvision.datasets.ImageFolder(str(root / "train"), transform=train_tf)
    test = torchvision.datasets.ImageFolder(str(root / "val"), transform=test_tf)
    if train.classes != test.classes:
        raise RecipeError(
            f"class folders differ between {root / 'train'} and {root / 'val'}: {train.classes} vs "
            f"{test.classes}"
        )
    return train, test, list(train.classes)


def class_templates(num_classes: int, size: int = 32) -> np.ndarray:
    """(num_classes, size, size, 3) float templates in [0, 255], smooth 4x4 colour fields
    upsampled."""
    rng = np.random.default_rng(TEMPLATE_SEED + num_classes)
    coarse = torch.from_numpy(rng.uniform(0, 255, size=(num_classes, 3, 4, 4)).astype(np.float32))
    fine = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    return fine.permute(0, 2, 3, 1).numpy()


def synthetic_images(num_images: int, num_classes: int = 10, seed: int = 0, size: int = 32):
    """Return (images uint8 [N, size, size, 3], labels int64 [N]) with balanced, shuffled
    classes."""
    rng = np.random.default_rng(seed)
    templates = class_templates(num_classes, size)
    labels = rng.permutation(np.arange(num_images) % num_classes)
    images = np.empty((num_images, size, size, 3), dtype=np.uint8)
    for start in range(0, num_images, 4096):  # chunks keep the float buffers small
        chunk = labels[start : start + 4096]
        base = np.empty((len(chunk), size, size, 3), dtype=np.float32)
        for j, (label, (dy, dx)) in enumerate(zip(chunk, rng.integers(-4, 5, size=(len(chunk), 2)))):
            base[j] = np.roll(templates[label], shift=(dy, dx), axis=(0, 1))
        base *= rng.uniform(0.7, 1.2, size=(len(chunk), 1, 1, 1)).astype(np.float32)
        noise = rng.random(base.shape, dtype=np.float32) * 255
        images[start : start + len(chunk)] = np.clip(0.55 * base + 0.45 * noise, 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


def load_data(args, accelerator, image_size: int, mean, std):
    """(train set, test set, class names) of the recipe's flags `args`; the local main process of
    each node downloads first, the others then read its copy."""
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


# ----------------------------------------------------------------------------------- loaders
@dataclass(frozen=True)
class Loaders:
    """build_loaders' loaders, to give accelerator.prepare, and their kind."""

    train: "DeviceImageLoader | DataLoader | None"  # None when only evaluating
    test: "DeviceImageLoader | DataLoader"
    kind: str  # "device" or "torch": --loader, with auto decided


def build_loaders(args, accelerator, train_set, test_set, per_process: int, mean, std) -> Loaders:
    """The loaders of the recipe's flags `args`: the device loader when the images fit in device
    memory (--loader auto), else torch's DataLoader with a seeded augmentation. With no train set
    (evaluation only) there is no train loader."""
    arrays = [image_arrays(data) for data in (train_set, test_set) if data is not None]
    loader_kind = args.loader
    if loader_kind == "auto":
        in_memory = all(array is not None for array in arrays)
        fits = in_memory and fits_on_device(sum(array[0].nbytes for array in arrays), accelerator.device)
        loader_kind = "device" if fits else "torch"
    # on the CPU also torch's threads
    num_workers = cpu_threads_and_workers(accelerator, args.num_workers)
    eval_batch = per_process * args.gradient_accumulation_steps
    train_loader = None
    if loader_kind == "device":
        if any(array is None for array in arrays):
            raise RecipeError(
                f"--loader device needs the images in memory; --dataset {args.dataset} reads files "
                "one by one: use --loader torch"
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
        test_loader = DeviceImageLoader(*arrays[-1], eval_batch, train=False, full_batches=True, **common)
        return Loaders(train=train_loader, test=test_loader, kind=loader_kind)
    if args.cutout:
        raise RecipeError("--cutout runs in the device loader only; use --loader device or drop --cutout")
    loader_args = dict(
        num_workers=num_workers, pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0
    )
    if train_set is not None:
        # Augmentation seeded per (seed, epoch, image) and a shuffle generator of the loader's own:
        # a resumed run then sees the same batches, augmented the same way, as an uninterrupted one.
        train_loader = DataLoader(
            SeededAugmentation(train_set, args.seed),
            batch_size=per_process,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(args.seed),
            **loader_args,
        )
    # One process's first batch holds eval_batch images or the whole test set; on more processes
    # accelerate fills every batch up itself.
    full_batch = PaddedBatch(min(eval_batch, len(test_set)))
    test_loader = DataLoader(test_set, batch_size=eval_batch, collate_fn=full_batch, **loader_args)
    return Loaders(train=train_loader, test=test_loader, kind=loader_kind)


def epoch_seeded(train_loader):
    """The prepared train loader, with a set_epoch that reaches torch's seeded augmentation as well
    as its shuffle (accelerate's forwards the epoch to the dataset on one process only); the
    device loader, which seeds both itself, as it is."""
    if isinstance(getattr(train_loader, "dataset", None), SeededAugmentation):
        return EpochSeededLoader(train_loader)
    return train_loader


class EpochSeededLoader:
    """A prepared DataLoader over a SeededAugmentation whose set_epoch sets the epoch of both."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
        self.loader.dataset.set_epoch(epoch)

    def skip_first_batches(self, num_batches: int):
        """The loader without its first `num_batches` batches, as Accelerator.skip_first_batches
        makes it (resuming inside an epoch)."""
        return skip_first_batches(self.loader, num_batches)


def pad_batch(images: torch.Tensor, labels: torch.Tensor, size: int):
    """(images, labels) with rows added up to `size`: zero images in the batch's memory layout,
    label -1 (evaluation drops those rows after gathering).

    A smaller last batch padded to the full size keeps one batch shape: with --compile another
    batch size would compile the model once more (eval mode keeps the rows independent), and so
    would other strides.
    """
    count = len(labels)
    if count >= size:
        return images, labels
    channels_last = images.is_contiguous(memory_format=torch.channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    padded = images.new_zeros((size, *images.shape[1:])).contiguous(memory_format=layout)
    padded[:count] = images
    return padded, torch.cat([labels, labels.new_full((size - count,), -1)])


class PaddedBatch:
    """collate_fn of torch's test loader: default_collate's batch, padded to `size` rows by
    pad_batch."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, samples):
        images, labels = default_collate(samples)
        return pad_batch(images, labels, self.size)


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


class DeviceImageLoader:
    """Batches of (images, labels) from a uint8 [N, H, W, C] array copied once to `device`.

    Training (`train=True`): every epoch a permutation of all N images, the same on every process
    (it depends on the seed and the epoch only), cut into global batches of `batch_size x
    num_processes`; process r takes every num_processes-th image of it, so the processes share each
    global batch without overlap, as DistributedSampler shares an epoch. Incomplete global batches
    are dropped. Augmentation: random crop after zero-padding by `pad` pixels (torchvision's
    RandomCrop(padding=pad)), horizontal flip with probability 1/2, and an optional square cutout of
    side `cutout` (erased to zero after normalisation).

    Evaluation (`train=False`): process r takes images r, r + num_processes, ... in order; shards
    are padded to the same length with label -1 so every process runs the same number of batches
    (drop those rows after gathering). With `full_batches` every batch has the size of the first,
    the last padded by pad_batch.

    Yields float32 NCHW tensors in channels_last memory layout, normalised with `mean` and `std`.
    """

    def __init__(
        self,
        images,
        labels,
        batch_size: int,
        device,
        *,
        train: bool,
        mean,
        std,
        seed: int = 0,
        process_index: int = 0,
        num_processes: int = 1,
        pad: int = 4,
        flip: bool = True,
        cutout: int = 0,
        full_batches: bool = False,
    ):
        images = torch.as_tensor(np.asarray(images))
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
            raise ValueError(f"images must be uint8 [N, H, W, C]; got {images.dtype} {tuple(images.shape)}")
        self.device = torch.device(device)
        self.images = images.to(self.device)
        self.labels = torch.as_tensor(np.asarray(labels), dtype=torch.long).to(self.device)
        self.batch_size, self.train, self.seed = batch_size, train, seed
        self.rank, self.world = process_index, num_processes
        self.pad, self.flip, self.cutout = (pad, flip, cutout) if train else (0, False, 0)
        self.full_batches = full_batches
        # (x / 255 - mean) / std = x * scale + shift, one fused multiply-add per pixel
        std_t = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.scale, self.shift = 1 / (255 * std_t), -mean_t / std_t
        self.epoch = 0
        self._skip = 0

    def __len__(self) -> int:
        n = len(self.labels)
        if self.train:
            return n // (self.batch_size * self.world)
        return math.ceil(math.ceil(n / self.world) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_first_batches(self, num_batches: int) -> "DeviceImageLoader":
        """Make the next pass start after its first `num_batches` batches (resuming inside an
        epoch).

        The skipped batches still draw their augmentation, so the batches that follow are the ones
        an uninterrupted pass would give, bit for bit.
        """
        self._skip = num_batches
        return self

    def shard_indices(self, epoch: int) -> torch.Tensor:
        """Indices this process reads in `epoch`, in order; -1 marks evaluation padding."""
        n = len(self.labels)
        if self.train:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            order = order[: len(self) * self.batch_size * self.world]
            return order[self.rank :: self.world]
        shard = torch.arange(self.rank, n, self.world)
        length = math.ceil(n / self.world)
        return torch.cat([shard, torch.full((length - len(shard),), -1, dtype=torch.long)])

    def augment(self, batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Random crop (zero padding), flip and cutout of a uint8 [B, H, W, C] batch; returns uint8
        [B, H, W, C]."""
        b, h, w, _ = batch.shape
        if self.pad:
            # pads W and H, not C
            padded = F.pad(batch, (0, 0, self.pad, self.pad, self.pad, self.pad))
            dy = torch.randint(0, 2 * self.pad + 1, (b, 1, 1), device=self.device, generator=generator)
            dx = torch.randint(0, 2 * self.pad + 1, (b, 1, 1), device=self.device, generator=generator)
            rows = dy + torch.arange(h, device=self.device).view(1, h, 1)
            cols = dx + torch.arange(w, device=self.device).view(1, 1, w)
            batch = padded[torch.arange(b, device=self.device).view(b, 1, 1), rows, cols]
        if self.flip:
            flipped = torch.rand(b, device=self.device, generator=generator) < 0.5
            batch = torch.where(flipped.view(b, 1, 1, 1), batch.flip(2), batch)
        return batch

    def normalise(self, batch: torch.Tensor) -> torch.Tensor:
        # NHWC -> NCHW by permute: the result is already in channels_last layout, no copy.
        return batch.permute(0, 3, 1, 2).float() * self.scale + self.shift

    def erase(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Cutout: one random square of side `cutout` per image set to zero (the mean, after
        normalisation)."""
        b, _, h, w = images.shape
        y = torch.randint(0, h - self.cutout + 1, (b, 1, 1, 1), device=self.device, generator=generator)
        x = torch.randint(0, w - self.cutout + 1, (b, 1, 1, 1), device=self.device, generator=generator)
        ys = torch.arange(h, device=self.device).view(1, 1, h, 1)
        xs = torch.arange(w, device=self.device).view(1, 1, 1, w)
        inside = (ys >= y) & (ys < y + self.cutout) & (xs >= x) & (xs < x + self.cutout)
        return images.masked_fill(inside, 0.0)

    def __iter__(self):
        # drawn on the host: the same order on any device and world size
        indices = self.shard_indices(self.epoch)
        # from pinned memory the copy is queued and the host does not wait for it
        if self.device.type == "cuda":
            indices = indices.pin_memory()
        indices = indices.to(self.device, non_blocking=True)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed * 100_003 + self.epoch * 1_009 + self.rank + 1)
        self.epoch += 1  # the next pass is the next epoch, as accelerate's seedable sampler counts
        skip, self._skip = self._skip, 0
        first_batch = min(self.batch_size, len(indices))
        for number, start in enumerate(range(0, len(indices), self.batch_size)):
            batch_indices = indices[start : start + self.batch_size]
            if self.train and len(batch_indices) < self.batch_size:
                break
            valid = batch_indices >= 0
            safe = batch_indices.clamp(min=0)
            images = self.images[safe]
            if self.train:
                images = self.augment(images, generator)
            if number < skip:
                if self.cutout:
                    # the same draws as the kept batches
                    self.erase(images.permute(0, 3, 1, 2), generator)
                continue
            images = self.normalise(images)
            if self.cutout:
                images = self.erase(images, generator)
            labels = torch.where(valid, self.labels[safe], torch.full_like(safe, -1))
            if self.full_batches:
                images, labels = pad_batch(images, labels, first_batch)
            yield images, labels
