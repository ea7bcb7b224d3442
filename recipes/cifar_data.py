"""Data code of recipes/cifar.py: generated CIFAR-shaped images, and a loader that keeps small
datasets on the device.

Copy this file together with cifar.py: the recipe imports it from its own folder.

Generated data (`synthetic_images`): each class has its own smooth colour template; an image is its
class template, shifted by a few pixels, with a random brightness and strong per-pixel noise. Train
and test sets share the templates, so accuracy on the test set measures learning, and a few hundred
steps separate the classes. It says nothing about real CIFAR accuracy.

The device data path (`DeviceImageLoader`): CIFAR-10's 50,000 training images are 150 MB as uint8,
so they fit on any GPU. Keeping them there removes the per-image Python work of a DataLoader (PIL
decode, transforms, collation, host-to-device copy), which on a fast GPU costs more time than the
network. Each batch is cropped, flipped, cut out and normalised on the device in a few tensor ops.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

TEMPLATE_SEED = 20240601  # fixed, so every split and every process sees the same classes


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
    (drop those rows after gathering).

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
            yield images, labels
