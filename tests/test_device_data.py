"""The device data path crops, flips and normalises like torchvision, and shards every epoch without
overlap."""

import numpy as np
import pytest
import torch
from cifar_data import DeviceImageLoader
from torchvision import transforms
from torchvision.transforms import functional as TF

# normalisation that leaves the uint8 values
RAW = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))


def coded_image() -> np.ndarray:
    """32x32 RGB where red encodes the row and green the column, so any crop or flip is
    recognisable."""
    image = np.zeros((32, 32, 3), np.uint8)
    image[:, :, 0] = (np.arange(32)[:, None] + 1) * 7
    image[:, :, 1] = (np.arange(32)[None, :] + 1) * 7
    image[:, :, 2] = 255
    return image


def torchvision_candidates(image: np.ndarray) -> dict[bytes, tuple]:
    """Every output of RandomCrop(32, padding=4) + RandomHorizontalFlip, computed with torchvision's
    functional ops."""
    padded = TF.pad(torch.from_numpy(image).permute(2, 0, 1), [4])
    outputs = {}
    for dy in range(9):
        for dx in range(9):
            crop = TF.crop(padded, dy, dx, 32, 32)
            for flip in (False, True):
                out = TF.hflip(crop) if flip else crop
                outputs[out.permute(1, 2, 0).contiguous().numpy().tobytes()] = (dy, dx, flip)
    return outputs


def test_device_crops_and_flips_match_torchvision_and_cover_every_offset():
    image = coded_image()
    candidates = torchvision_candidates(image)
    assert len(candidates) == 9 * 9 * 2

    n = 4096
    loader = DeviceImageLoader(
        np.repeat(image[None], n, 0), np.zeros(n), 512, "cpu", train=True, seed=1, **RAW
    )
    device_seen = []
    for images, _ in loader:
        assert images.shape == (512, 3, 32, 32) and images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert 0 <= images.min() and images.max() <= 255
        for out in images.round().to(torch.uint8).permute(0, 2, 3, 1):
            # KeyError: not a torchvision output
            device_seen.append(candidates[out.contiguous().numpy().tobytes()])

    reference = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()])
    torch.manual_seed(0)
    source = torch.from_numpy(image).permute(2, 0, 1)
    torchvision_seen = [
        candidates[reference(source).permute(1, 2, 0).contiguous().numpy().tobytes()] for _ in range(n)
    ]

    for seen in (device_seen, torchvision_seen):
        counts = {combo: seen.count(combo) for combo in candidates.values()}
        # expected 25 each
        assert min(counts.values()) >= 5, "some offset/flip never or rarely occurs"
        assert max(counts.values()) <= 60
        flips = sum(flip for _, _, flip in seen) / n
        assert 0.45 < flips < 0.55


def test_evaluation_batches_equal_torchvision_to_tensor_and_normalize():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    loader = DeviceImageLoader(images, np.arange(10), 4, "cpu", train=False, mean=mean, std=std)
    batches = list(loader)
    got = torch.cat([b for b, _ in batches])
    expected = torch.stack([transforms.Normalize(mean, std)(transforms.ToTensor()(img)) for img in images])
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.cat([labels for _, labels in batches]).tolist() == list(range(10))


def test_cutout_erases_one_square_per_image():
    images = np.full((64, 32, 32, 3), 255, np.uint8)
    loader = DeviceImageLoader(
        images, np.zeros(64), 64, "cpu", train=True, pad=0, flip=False, cutout=12, **RAW
    )
    batch, _ = next(iter(loader))
    erased = batch[:, 0] == 0
    assert erased.sum(dim=(1, 2)).tolist() == [144] * 64
    rows, cols = erased.any(dim=2), erased.any(dim=1)
    # a square, not scattered
    assert rows.sum(dim=1).tolist() == [12] * 64 and cols.sum(dim=1).tolist() == [12] * 64


@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_shards_are_disjoint_and_each_global_batch_is_the_same_for_any_world_size(world):
    n, global_batch = 103, 20

    def batches(world_size):
        loaders = [
            DeviceImageLoader(
                np.zeros((n, 2, 2, 3), np.uint8),
                np.arange(n),
                global_batch // world_size,
                "cpu",
                train=True,
                seed=7,
                process_index=r,
                num_processes=world_size,
                **RAW,
            )
            for r in range(world_size)
        ]
        epochs = []
        for _ in range(2):
            per_rank = [[labels.tolist() for _, labels in loader] for loader in loaders]
            epochs.append(
                [sorted(sum((rank[step] for rank in per_rank), [])) for step in range(len(per_rank[0]))]
            )
        return epochs

    epochs = batches(world)
    for steps in epochs:
        flat = sum(steps, [])
        # disjoint; remainder dropped
        assert len(steps) == n // global_batch and len(flat) == len(set(flat)) == 100
    assert epochs[0] != epochs[1]  # a new order every epoch
    assert epochs == batches(1)  # the same global batches as one process


def test_evaluation_shards_cover_every_image_once():
    n, world = 103, 4
    labels = []
    lengths = set()
    for rank in range(world):
        loader = DeviceImageLoader(
            np.zeros((n, 2, 2, 3), np.uint8),
            np.arange(n),
            8,
            "cpu",
            train=False,
            process_index=rank,
            num_processes=world,
            **RAW,
        )
        got = torch.cat([lab for _, lab in loader]).tolist()
        lengths.add(len(got))
        labels += got
    assert len(lengths) == 1  # every process runs the same number of evaluation batches
    assert sorted(x for x in labels if x >= 0) == list(range(n)) and labels.count(-1) == 4 * 26 - n
