"""A generated object-detection set of coloured shapes on textured backgrounds, written in
Ultralytics' YOLO format.

The layout is the one Ultralytics documents for detection datasets
(docs.ultralytics.com/datasets/detect):

    out/data.yaml                 path (absolute), train, val, names
    out/images/{train,val}/000000.jpg
    out/labels/{train,val}/000000.txt   one `class cx cy w h` line per object, normalised to [0, 1]

Each image has a smooth-noise, gradient or striped background and 0 to 6 shapes (circle, square,
triangle, cross,
ring: the first `num_classes` of them) of random colour, 8% to 50% of the shorter image side, partly
overlapping at most. A box is the tight box of the pixels its shape was drawn on (PIL draws without
anti-aliasing, so the edge is exact); a later shape may hide part of an earlier one, whose box still
covers its whole shape, as annotators do. About `background_fraction` of the images have no shapes,
and some are 3:4 or 4:3 rather than square, so letterboxing is exercised. Shapes differ from their
background by a clear colour distance, so a small detector learns the set in minutes; it says
nothing about accuracy on photographs. The same seed gives the same files on every machine.

    python recipes/detect/synthetic_shapes.py --out data/shapes --num_train 512 --num_val 128

train.py writes it for `--data synthetic`.
"""

import argparse
import os
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw

from accelerate_recipes import RecipeError

SHAPES = ("circle", "square", "triangle", "cross", "ring")
MAX_OBJECTS = 6
# Euclidean RGB distance between a shape's colour and the mean of the pixels under it
MIN_CONTRAST = 110.0
JPEG_QUALITY = 95


def _background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """float32 [height, width, 3]: a base colour with a smooth, gradient or striped variation and
    faint pixel noise."""
    base = rng.uniform(40, 215, size=3).astype(np.float32)
    kind = rng.integers(3)
    if kind == 0:  # smooth noise: a coarse random grid, bilinearly upsampled
        cells = int(rng.integers(3, 8))
        coarse = rng.uniform(-35, 35, size=(cells, cells, 3)).astype(np.float32)
        layers = [
            np.asarray(Image.fromarray(coarse[..., c]).resize((width, height), Image.BILINEAR))
            for c in range(3)
        ]
        variation = np.stack(layers, axis=-1)
    else:
        ys = np.arange(height, dtype=np.float32)[:, None]
        xs = np.arange(width, dtype=np.float32)[None, :]
        angle = rng.uniform(0, np.pi)
        along = (xs * np.cos(angle) + ys * np.sin(angle)) / max(width, height)
        amplitude = rng.uniform(-35, 35, size=3).astype(np.float32)
        if kind == 1:  # linear gradient across the image
            profile = along - 0.5
        else:  # stripes of random period and direction
            profile = 0.5 * np.sin(2 * np.pi * along * rng.uniform(3, 12) + rng.uniform(0, 2 * np.pi))
        variation = profile[..., None] * 2 * amplitude
    noise = rng.standard_normal(size=(height, width, 3), dtype=np.float32) * 4
    return base + variation + noise


def _shape_mask(shape: str, width: int, height: int) -> Image.Image:
    """An L-mode mask of `shape` drawn to touch every edge of a width x height box."""
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    right, bottom = width - 1, height - 1  # ImageDraw's coordinates are inclusive pixel indices
    if shape == "circle":
        draw.ellipse((0, 0, right, bottom), fill=255)
    elif shape == "square":
        draw.rectangle((0, 0, right, bottom), fill=255)
    elif shape == "triangle":
        draw.polygon([(right / 2, 0), (right, bottom), (0, bottom)], fill=255)
    elif shape == "cross":  # a plus sign with arms a third of the side thick
        tx, ty = max(1, round(width / 3)), max(1, round(height / 3))
        draw.rectangle(((width - tx) // 2, 0, (width - tx) // 2 + tx - 1, bottom), fill=255)
        draw.rectangle((0, (height - ty) // 2, right, (height - ty) // 2 + ty - 1), fill=255)
    elif shape == "ring":
        draw.ellipse((0, 0, right, bottom), outline=255, width=max(2, round(min(width, height) * 0.16)))
    return mask


def _overlaps_too_much(box, placed: list) -> bool:
    """Partial overlap is fine; a shape hiding most of another (or being hidden) is not."""
    x1, y1, x2, y2 = box
    area = (x2 - x1) * (y2 - y1)
    for px1, py1, px2, py2 in placed:
        inter = max(0, min(x2, px2) - max(x1, px1)) * max(0, min(y2, py2) - max(y1, py1))
        if inter > 0.35 * min(area, (px2 - px1) * (py2 - py1)):
            return True
    return False


def _contrasting_colour(rng: np.random.Generator, under: np.ndarray) -> tuple:
    """A random colour far from the mean of the pixels `under` it [N, 3] and clearly apart from each
    of them."""
    mean = under.mean(axis=0)
    for _ in range(50):
        colour = rng.integers(0, 256, size=3)
        if (
            np.linalg.norm(colour - mean) >= MIN_CONTRAST
            and np.linalg.norm(under - colour, axis=1).min() >= MIN_CONTRAST / 2
        ):
            return tuple(int(c) for c in colour)
    return tuple(int(c) for c in np.where(mean > 127, 0, 255))  # the far corner of the colour cube


def synthetic_image(rng: np.random.Generator, image_size: int, num_classes: int, background: bool):
    """One image: (PIL RGB image, list of (class, x1, y1, x2, y2) tight pixel boxes)."""
    width = height = image_size
    aspect = rng.random()
    if aspect < 0.15:
        width = round(image_size * 0.75)
    elif aspect < 0.3:
        height = round(image_size * 0.75)
    pixels = _background(rng, width, height)
    count = 0 if background else int(rng.integers(1, MAX_OBJECTS + 1))
    side = min(width, height)
    objects, placed = [], []
    for _ in range(count):
        for _attempt in range(20):
            cls = int(rng.integers(num_classes))
            # log-uniform size: as many small shapes as
            # large ones, which is where detectors struggle
            size = side * float(np.exp(rng.uniform(np.log(0.08), np.log(0.5))))
            stretch = float(rng.uniform(0.75, 1.33))
            w = max(4, min(width, round(size * stretch)))
            h = max(4, min(height, round(size / stretch)))
            x1, y1 = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            if not _overlaps_too_much((x1, y1, x1 + w, y1 + h), placed):
                break
        else:
            continue  # no room left for another shape
        mask = _shape_mask(SHAPES[cls], w, h)
        # the drawn pixels, exclusive right/bottom: the tight box
        left, top, right, bottom = mask.getbbox()
        # every 3rd: cheap
        colour = _contrasting_colour(rng, pixels[y1 : y1 + h : 3, x1 : x1 + w : 3].reshape(-1, 3))
        region = np.asarray(mask, dtype=bool)
        pixels[y1 : y1 + h, x1 : x1 + w][region] = colour
        placed.append((x1, y1, x1 + w, y1 + h))
        objects.append((cls, x1 + left, y1 + top, x1 + right, y1 + bottom))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return image, objects


def _write_split(
    out: Path,
    split: str,
    count: int,
    image_size: int,
    num_classes: int,
    seed: int,
    background_fraction: float,
) -> None:
    images, labels = out / "images" / split, out / "labels" / split
    for folder, suffix in ((images, ".jpg"), (labels, ".txt")):
        folder.mkdir(parents=True, exist_ok=True)
        # a smaller set written over a larger one must not keep extra files
        for stale in folder.glob(f"*{suffix}"):
            stale.unlink()
    split_id = {"train": 0, "val": 1}[split]
    # exactly round(count x fraction) background images, so the fraction holds for small sets too
    backgrounds = set(
        np.random.default_rng([seed, split_id, 99])
        .permutation(count)[: round(count * background_fraction)]
        .tolist()
    )
    for i in range(count):
        # one stream per image: stable if counts change
        rng = np.random.default_rng([seed, split_id, i])
        image, objects = synthetic_image(rng, image_size, num_classes, background=i in backgrounds)
        # 4:4:4 chroma keeps the shapes' colour edges sharp;
        # quality 95 is what photo datasets typically hold
        image.save(images / f"{i:06d}.jpg", quality=JPEG_QUALITY, subsampling=0)
        w, h = image.size
        lines = [
            f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} {(y2 - y1) / h:.6f}"
            for c, x1, y1, x2, y2 in objects
        ]
        (labels / f"{i:06d}.txt").write_text("".join(line + "\n" for line in lines))


def write_synthetic_dataset(
    out: str | Path,
    num_train: int = 256,
    num_val: int = 64,
    image_size: int = 256,
    num_classes: int = 3,
    seed: int = 0,
    background_fraction: float = 0.1,
) -> Path:
    """Write the generated set under `out` and return its data.yaml (written last: its presence
    means complete)."""
    if not 1 <= num_classes <= len(SHAPES):
        raise RecipeError(
            f"num_classes {num_classes} is not supported by the generated set; choose 1 to "
            f"{len(SHAPES)} ({', '.join(SHAPES)})"
        )
    if image_size < 32:
        raise RecipeError(f"image_size {image_size} is too small for the generated set; use at least 32")
    if num_train < 1 or num_val < 1:
        raise RecipeError(f"num_train ({num_train}) and num_val ({num_val}) must both be at least 1")
    if not 0 <= background_fraction <= 1:
        raise RecipeError(f"background_fraction {background_fraction} must lie in [0, 1]")
    out = Path(out)
    data_yaml = out / "data.yaml"
    if data_yaml.exists():
        data_yaml.unlink()
    _write_split(out, "train", num_train, image_size, num_classes, seed, background_fraction)
    _write_split(out, "val", num_val, image_size, num_classes, seed, background_fraction)
    config = {
        # absolute: Ultralytics reads a relative path against its own datasets dir
        "path": os.path.abspath(out),
        "train": "images/train",
        "val": "images/val",
        "nc": num_classes,
        "names": {i: name for i, name in enumerate(SHAPES[:num_classes])},
    }
    header = f"# Generated by synthetic_shapes.py of recipes/detect (seed {seed}); YOLO format.\n"
    data_yaml.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return data_yaml


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python recipes/detect/synthetic_shapes.py",
        description="Write a generated YOLO-format detection set (shapes on textured backgrounds) and print "
        "the path of its data.yaml.",
    )
    parser.add_argument("--out", required=True, help="folder to write (images/, labels/, data.yaml)")
    parser.add_argument("--num_train", type=int, default=256, help="training images (default 256)")
    parser.add_argument("--num_val", type=int, default=64, help="validation images (default 64)")
    parser.add_argument(
        "--image_size",
        type=int,
        default=256,
        help="longer image side in pixels; some images are 3:4 or 4:3 (default 256)",
    )
    parser.add_argument(
        "--num_classes",
        type=int,
        default=3,
        help=f"shape classes, 1 to {len(SHAPES)}: {', '.join(SHAPES)} in that order (default 3)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same files (default 0)")
    parser.add_argument(
        "--background_fraction",
        type=float,
        default=0.1,
        help="fraction of images with no objects (default 0.1)",
    )
    args = parser.parse_args(argv)
    try:
        path = write_synthetic_dataset(
            args.out,
            args.num_train,
            args.num_val,
            args.image_size,
            args.num_classes,
            args.seed,
            args.background_fraction,
        )
    except RecipeError as err:
        parser.exit(2, f"error: {err}\n")
    print(path)


if __name__ == "__main__":
    main()
