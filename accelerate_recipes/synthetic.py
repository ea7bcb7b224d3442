"""Generated image-classification data of CIFAR's shape that a network can learn.

Each class has its own smooth colour template; an image is its class template, shifted by a few pixels, with a
random brightness and strong per-pixel noise. Train and test sets share the templates, so accuracy on the test
set measures learning, and a few hundred steps separate the classes. It says nothing about real CIFAR accuracy.
"""

import numpy as np
import torch
import torch.nn.functional as F

TEMPLATE_SEED = 20240601  # fixed, so every split and every process sees the same classes


def class_templates(num_classes: int, size: int = 32) -> np.ndarray:
    """(num_classes, size, size, 3) float templates in [0, 255], smooth 4x4 colour fields upsampled."""
    rng = np.random.default_rng(TEMPLATE_SEED + num_classes)
    coarse = torch.from_numpy(rng.uniform(0, 255, size=(num_classes, 3, 4, 4)).astype(np.float32))
    fine = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    return fine.permute(0, 2, 3, 1).numpy()


def synthetic_images(num_images: int, num_classes: int = 10, seed: int = 0, size: int = 32):
    """Return (images uint8 [N, size, size, 3], labels int64 [N]) with balanced, shuffled classes."""
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
