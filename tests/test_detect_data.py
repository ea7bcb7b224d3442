"""Detection data: the generated shapes set, data.yaml and label checks, letterboxing, the dataset
and the converters.

Every test writes real files (JPEG/PNG images, YOLO label files, COCO JSON, VOC XML) under tmp_path
and reads them back through the code the recipe uses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import convert
import numpy as np
import pytest
import torch
import yaml
from conftest import time_limit
from PIL import Image, ImageDraw
from synthetic_shapes import main, write_synthetic_dataset
from yolo_data import (
    CACHE_AUTO_BYTES,
    YoloDataset,
    cache_in_memory,
    collate,
    download_dataset,
    label_path,
    letterbox,
    load_data_config,
    scale_boxes_back,
)

from accelerate_recipes import RecipeError

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers
def label_rows(path: Path) -> list[list[float]]:
    return [[float(v) for v in line.split()] for line in path.read_text().splitlines() if line.strip()]


def pixel_boxes(label_file: Path, width: int, height: int) -> np.ndarray:
    """(class, x1, y1, x2, y2) in pixels from a YOLO label file."""
    rows = np.array(label_rows(label_file), dtype=np.float64).reshape(-1, 5)
    c, cx, cy, w, h = rows.T
    return np.stack(
        [c, (cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height], 1
    )


def save_image(path: Path, width: int, height: int, rects=(), colour=(255, 255, 255), background=(0, 0, 0)):
    """An image with filled rectangles (x1, y1, x2, y2 in continuous pixel edges) drawn exactly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    for x1, y1, x2, y2 in rects:
        # ImageDraw's corners are inclusive pixels
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=colour)
    image.save(path)
    return path


def write_labels(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def yolo_line(cls, box, width, height) -> str:
    x1, y1, x2, y2 = box
    return f"{cls} {(x1 + x2) / 2 / width} {(y1 + y2) / 2 / height} {(x2 - x1) / width} {(y2 - y1) / height}"


def write_yaml(path: Path, config: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def small_set(root: Path, split: str, count: int, size=(64, 48)) -> list[Path]:
    """`count` images with one labelled rectangle each under root/images/<split>, labels beside in
    labels/."""
    files = []
    for i in range(count):
        box = (4 + i, 6, 30 + i, 40)
        files.append(save_image(root / "images" / split / f"{i}.png", *size, rects=[box]))
        write_labels(root / "labels" / split / f"{i}.txt", [yolo_line(i % 2, box, *size)])
    return files


@pytest.fixture(scope="module")
def shapes(module_tmp) -> Path:
    return write_synthetic_dataset(
        module_tmp.mktemp("shapes"), num_train=40, num_val=12, image_size=128, num_classes=4, seed=3
    )


# ------------------------------------------------------------------------------------ generated set
def test_generated_set_is_complete_valid_yolo(shapes):
    root = shapes.parent
    config = yaml.safe_load(shapes.read_text())
    assert config["names"] == {0: "circle", 1: "square", 2: "triangle", 3: "cross"}
    assert (
        Path(config["path"]) == root and config["train"] == "images/train" and config["val"] == "images/val"
    )
    sizes, classes = set(), set()
    for split, count in (("train", 40), ("val", 12)):
        images = sorted((root / "images" / split).glob("*.jpg"))
        labels = sorted((root / "labels" / split).glob("*.txt"))
        assert len(images) == len(labels) == count
        backgrounds = 0
        for image in images:
            with Image.open(image) as opened:
                width, height = opened.size
            sizes.add((width, height))
            rows = label_rows(label_path(image))
            backgrounds += not rows
            assert len(rows) <= 6
            for c, cx, cy, w, h in rows:
                classes.add(int(c))
                assert c == int(c) and 0 <= c < 4
                assert (
                    0 <= cx - w / 2 and cx + w / 2 <= 1 + 1e-6 and 0 <= cy - h / 2 and cy + h / 2 <= 1 + 1e-6
                )
                # 8%..50% of the side
                assert 0.05 <= max(w * width, h * height) / min(width, height) <= 0.7
        assert backgrounds == round(count * 0.1)
    assert classes == {0, 1, 2, 3}
    assert (128, 128) in sizes and len(sizes) > 1  # some images are not square


def test_generated_boxes_are_tight_around_the_drawn_shape(shapes):
    """Isolated shapes: the pixels of the shape's colour near its box span exactly the box (JPEG:
    within 1.5 px)."""
    root, checked = shapes.parent, 0
    for image_file in sorted((root / "images" / "train").glob("*.jpg")):
        pixels = np.asarray(Image.open(image_file).convert("RGB")).astype(np.float32)
        height, width = pixels.shape[:2]
        boxes = pixel_boxes(label_path(image_file), width, height)
        for k, (c, x1, y1, x2, y2) in enumerate(boxes):
            others = np.delete(boxes, k, axis=0)
            margin = 4
            if any(
                ox1 < x2 + margin and ox2 > x1 - margin and oy1 < y2 + margin and oy2 > y1 - margin
                for _, ox1, oy1, ox2, oy2 in others
            ):
                continue  # overlapping or touching shapes hide each other's edges
            # a point inside every shape kind: the centre (circle,
            # square, cross), low in the middle (triangle)
            px, py = int((x1 + x2) / 2), int(y1 + (0.75 if c == 2 else 0.5) * (y2 - y1))
            colour = np.median(pixels[py - 1 : py + 2, px - 1 : px + 2].reshape(-1, 3), axis=0)
            top, left = max(0, int(y1) - margin), max(0, int(x1) - margin)
            region = pixels[top : int(y2) + margin, left : int(x2) + margin]
            ys, xs = np.nonzero(np.linalg.norm(region - colour, axis=-1) < 40)
            found = (xs.min() + left, ys.min() + top, xs.max() + left + 1, ys.max() + top + 1)
            assert np.allclose(found, (x1, y1, x2, y2), atol=1.5), (image_file, found, (x1, y1, x2, y2))
            checked += 1
    assert checked >= 10


def test_generated_set_is_deterministic_for_a_seed(tmp_path):
    first = write_synthetic_dataset(tmp_path / "a", num_train=5, num_val=2, image_size=64, seed=7).parent
    again = write_synthetic_dataset(tmp_path / "b", num_train=5, num_val=2, image_size=64, seed=7).parent
    other = write_synthetic_dataset(tmp_path / "c", num_train=5, num_val=2, image_size=64, seed=8).parent
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file() and p.name != "data.yaml")
    assert len(files) == 14
    assert all((first / f).read_bytes() == (again / f).read_bytes() for f in files)
    assert any((first / f).read_bytes() != (other / f).read_bytes() for f in files)


def test_generator_command_line(tmp_path, capsys):
    out = tmp_path / "s"
    main(
        ["--out", str(out), "--num_train", "3", "--num_val", "2", "--image_size", "64", "--num_classes", "5"]
    )
    assert capsys.readouterr().out.strip() == str(out / "data.yaml")
    assert load_data_config(out / "data.yaml").names == ["circle", "square", "triangle", "cross", "ring"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(out), "--num_classes", "6"])
    assert exit_info.value.code == 2
    assert "error: num_classes 6 is not supported" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- data.yaml
def test_data_yaml_folders_lists_and_relative_path(tmp_path, monkeypatch):
    root = tmp_path / "sets" / "ds"
    a, b = small_set(root, "a", 3), small_set(root, "b", 2)
    val = small_set(root, "val", 2)
    # relative to the list, and absolute
    (root / "val.txt").write_text(f"./images/val/0.png\n\n{val[1]}\n")
    yaml_file = write_yaml(
        tmp_path / "sets" / "data.yaml",
        {"path": "ds", "train": ["images/a", "images/b"], "val": "val.txt", "names": {0: "box", 1: "other"}},
    )
    # `path` is read against the yaml's folder, not the working directory
    monkeypatch.chdir(tmp_path)
    config = load_data_config(yaml_file)
    assert config.root == root
    assert config.train == a + b and config.val == val
    assert config.names == ["box", "other"] and config.test == []

    write_yaml(
        yaml_file,
        {"train": "images/a", "val": "images/val", "names": ["box", "other"], "nc": 2, "path": str(root)},
    )
    config = load_data_config(yaml_file)
    assert config.train == a and config.names == ["box", "other"]

    write_yaml(root / "data.yaml", {"train": "images/a", "val": "images/val", "names": ["box", "other"]})
    assert load_data_config(root / "data.yaml").root == root  # no `path`: the yaml's folder


def test_data_yaml_errors(tmp_path):
    root = tmp_path / "ds"
    small_set(root, "train", 2)
    with pytest.raises(RecipeError, match="nowhere.yaml not found"):
        load_data_config(tmp_path / "nowhere.yaml")

    cases = [
        (
            {"path": ".", "train": "images/train", "val": "images/valid", "names": ["a", "b"]},
            r"val split images/valid not found .*ds/images/valid",
        ),
        ({"path": ".", "train": "images/train", "names": ["a", "b"]}, "no `val` split"),
        ({"path": ".", "train": "images/train", "val": "images/train", "names": []}, "names"),
        (
            {"path": ".", "train": "images/train", "val": "images/train", "names": ["a", "b"], "nc": 3},
            "nc is 3 but `names` has 2",
        ),
        (
            {"path": "missing", "train": "images/train", "val": "images/train", "names": ["a"]},
            "missing.* not found",
        ),
    ]
    for config, message in cases:
        with pytest.raises(RecipeError, match=message):
            load_data_config(write_yaml(root / "data.yaml", config))

    (root / "images" / "empty").mkdir()
    with pytest.raises(RecipeError, match="has no images"):
        load_data_config(
            write_yaml(
                root / "data.yaml", {"train": "images/empty", "val": "images/train", "names": ["a", "b"]}
            )
        )
    (root / "data.yaml").write_text("train: [images/train\nval: x\n")
    with pytest.raises(RecipeError, match="data.yaml line .*not valid YAML"):
        load_data_config(root / "data.yaml")


def test_missing_image_in_a_list_is_named(tmp_path):
    root = tmp_path / "ds"
    small_set(root, "train", 2)
    (root / "train.txt").write_text("./images/train/0.png\n./images/train/7.png\n")
    yaml_file = write_yaml(
        root / "data.yaml", {"train": "train.txt", "val": "images/train", "names": ["a", "b"]}
    )
    with pytest.raises(RecipeError, match=r"train.txt line 2: image ./images/train/7.png not found"):
        load_data_config(yaml_file)


# ------------------------------------------------------------------------------------------- labels
def test_label_errors_name_file_line_and_fix(tmp_path):
    [image] = small_set(tmp_path, "train", 1)
    label = label_path(image)
    assert label == tmp_path / "labels" / "train" / "0.txt"
    cases = [
        (
            ["0 0.5 0.5 0.2 0.2", "7 0.5 0.5 0.1 0.1"],
            "line 2: class 7 is out of range for the 3 names in data.yaml",
        ),
        (["-1 0.5 0.5 0.2 0.2"], "line 1: class -1 is out of range"),
        (["1.5 0.5 0.5 0.2 0.2"], "line 1: class 1.5 is not a whole number"),
        (["0 0.5 1.2 0.2 0.2"], r"line 1: cy = 1.2 is outside \[0, 1\]"),
        (["0 0.5 0.5 0.2 -0.1"], r"line 1: h = -0.1 is outside \[0, 1\]"),
        (["0 0.5 0.5 0.2"], "line 1: 4 values"),
        (["0 0.5 0.5 0.2 wide"], "line 1: 'wide' is not a number"),
        (["0 0.5 nan 0.2 0.2"], "line 1: 'nan' is not a finite number"),
    ]
    for lines, message in cases:
        write_labels(label, lines)
        with pytest.raises(RecipeError, match=message) as err:
            YoloDataset([image], num_classes=3, verbose=False)
        assert str(label) in str(err.value)
        assert "fix" in str(err.value)


def test_label_tolerance_zero_size_boxes_backgrounds_and_polygons(tmp_path, capsys):
    files = small_set(tmp_path, "train", 4)
    write_labels(label_path(files[0]), ["0 0.5 0.5 1.0005 0.2"])  # within the tolerance: clipped
    # zero width: dropped, warned
    write_labels(label_path(files[1]), ["0 0.5 0.5 0 0.2", "1 0.25 0.5 0.2 0.2"])
    write_labels(label_path(files[2]), [])  # empty: a background image
    label_path(files[3]).unlink()  # missing: a background image too
    dataset = YoloDataset(files, num_classes=2, image_size=64)
    out = capsys.readouterr().out
    assert "4 images, 2 boxes, 2 background images" in out
    assert f"dropped 1 zero-size boxes (width or height 0), first at {label_path(files[1])} line 1" in out
    assert dataset.counts == dict(images=4, boxes=2, backgrounds=2, dropped_boxes=1, label_files=3)
    boxes = dataset[0][1]
    # clipped to the image (64 wide)
    assert boxes.shape == (1, 5) and boxes[0, 1] == 0 and boxes[0, 3] == 64
    assert dataset[1][1][:, 0].tolist() == [1.0]
    for index in (2, 3):
        image, boxes, meta = dataset[index]
        assert image.shape == (3, 64, 64) and boxes.shape == (0, 5)

    # a segmentation polygon stands for its bounding box
    write_labels(label_path(files[2]), ["1 0.25 0.25 0.75 0.25 0.5 0.75"])
    boxes = YoloDataset(files[2:3], num_classes=2, image_size=64, verbose=False)[0][1]
    pad_y = (64 - 48) // 2  # a 64 x 48 image letterboxed to 64: scale 1, rows added above and below
    assert torch.allclose(
        boxes, torch.tensor([[1, 16, 12 + pad_y, 48, 36 + pad_y]], dtype=torch.float32), atol=1e-3
    )


def test_corrupt_and_missing_images_are_named(tmp_path):
    files = small_set(tmp_path, "train", 3)
    files[0].write_bytes(b"this is not a picture")
    with pytest.raises(RecipeError, match=f"cannot read image {files[0]}"):
        YoloDataset(files, num_classes=2, verbose=False)
    with pytest.raises(RecipeError, match=f"image {tmp_path / 'gone.png'} not found"):
        YoloDataset([tmp_path / "gone.png"], num_classes=2, verbose=False)
    # a JPEG whose header is intact but whose data is cut short: caught when the pixels are decoded
    jpeg = tmp_path / "images" / "train" / "cut.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (128, 128, 3), dtype=np.uint8)).save(
        jpeg, quality=95
    )
    jpeg.write_bytes(jpeg.read_bytes()[: len(jpeg.read_bytes()) // 2])
    dataset = YoloDataset([jpeg, files[1]], num_classes=2, image_size=64, verbose=False)
    with pytest.raises(RecipeError, match=f"cannot read image {jpeg}"):
        dataset[0]
    assert dataset[1][0].shape == (3, 64, 64)


# ---------------------------------------------------------------------------------------- letterbox
@pytest.mark.parametrize("as_tensor", [False, True])
def test_letterbox_and_scale_back_round_trip(as_tensor):
    height, width, size = 90, 160, 128
    original = np.zeros((height, width, 3), np.uint8)
    box = (37, 21, 121, 70)  # x1, y1, x2, y2 edges
    original[box[1] : box[3], box[0] : box[2]] = 255
    boxed, ratio, pad = letterbox(torch.from_numpy(original) if as_tensor else original, size)
    assert isinstance(boxed, torch.Tensor) == as_tensor
    boxed = np.asarray(boxed)
    assert boxed.shape == (size, size, 3) and boxed.dtype == np.uint8
    assert ratio == pytest.approx(size / width) and pad == (0, (size - round(height * ratio)) // 2)
    assert (boxed[: pad[1]] == 114).all() and (boxed[pad[1] + round(height * ratio) :] == 114).all()
    # where the white rectangle landed, mapped back, is the rectangle
    ys, xs = np.nonzero(boxed[..., 0] > 127)
    found = torch.tensor([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], dtype=torch.float32)
    back = scale_boxes_back(found, ratio, pad, (height, width))
    assert torch.allclose(back, torch.tensor([box], dtype=torch.float32), atol=1.0), back
    # exact inverse of the forward mapping, for tensors and arrays, clipped to the image
    forward = np.array([[37, 21, 121, 70], [-5, 0, 170, 95]], np.float64) * ratio + [pad[0], pad[1]] * 2
    assert np.allclose(
        scale_boxes_back(forward, ratio, pad, (height, width)), [[37, 21, 121, 70], [0, 0, 160, 90]]
    )
    assert scale_boxes_back(torch.zeros((0, 4)), ratio, pad, (height, width)).shape == (0, 4)


# ------------------------------------------------------------------------------------------ dataset
def test_dataset_items_without_augmentation_follow_the_letterbox(shapes):
    config = load_data_config(shapes)
    dataset = YoloDataset(config.val, len(config.names), image_size=96, augment=False, verbose=False)
    non_square = 0
    for index in range(len(dataset)):
        image, boxes, meta = dataset[index]
        assert image.dtype == torch.uint8 and image.shape == (3, 96, 96)
        assert meta["path"] == str(config.val[index])
        with Image.open(config.val[index]) as opened:
            assert meta["orig_shape"] == (opened.height, opened.width)
        height, width = meta["orig_shape"]
        expected = pixel_boxes(label_path(config.val[index]), width, height)
        assert meta["ratio"] == pytest.approx(96 / max(height, width))
        letterboxed = expected.copy()
        letterboxed[:, 1:] = expected[:, 1:] * meta["ratio"] + np.tile(meta["pad"], 2)
        assert np.allclose(boxes.numpy(), letterboxed, atol=1.0)
        back = scale_boxes_back(boxes[:, 1:], meta["ratio"], meta["pad"], meta["orig_shape"])
        assert np.allclose(back.numpy(), expected[:, 1:], atol=1.0)
        reference, _, _ = letterbox(np.asarray(Image.open(config.val[index]).convert("RGB")), 96)
        assert np.abs(image.permute(1, 2, 0).numpy().astype(int) - reference).mean() < 2
        non_square += height != width
    assert non_square > 0


def test_exif_rotated_jpeg_loads_upright(tmp_path):
    """Labels describe the upright picture; a phone JPEG stores it turned, with an EXIF orientation
    tag."""
    # upright: portrait, rectangle near the bottom
    width, height, box = 100, 200, (10, 120, 60, 190)
    upright = Image.new("RGB", (width, height))
    ImageDraw.Draw(upright).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=(255, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    stored = tmp_path / "images" / "phone.jpg"
    stored.parent.mkdir()
    # kept landscape on disk
    upright.transpose(Image.Transpose.ROTATE_90).save(stored, quality=95, exif=exif)
    write_labels(tmp_path / "labels" / "phone.txt", [yolo_line(0, box, width, height)])
    # 1/3 scale: JPEG draft decode
    image, boxes, meta = YoloDataset([stored], 1, image_size=64, verbose=False)[0]
    assert meta["orig_shape"] == (height, width)
    _, x1, y1, x2, y2 = boxes[0].tolist()
    assert (image[0, int(y1) + 1 : int(y2) - 1, int(x1) + 1 : int(x2) - 1] > 200).all()
    back = scale_boxes_back(boxes[:, 1:], meta["ratio"], meta["pad"], meta["orig_shape"])
    assert torch.allclose(back, torch.tensor([box], dtype=torch.float32), atol=1.0)


def test_augmented_items_keep_boxes_on_their_objects(tmp_path):
    """White rectangles on black: after mosaic, zoom, shift and flips, every box still covers white
    pixels."""
    files = []
    for i, (width, height) in enumerate([(80, 60), (60, 80), (70, 70), (90, 50)]):
        box = (8 + 5 * i, 10 + 3 * i, 40 + 6 * i, 36 + 4 * i)
        files.append(save_image(tmp_path / "images" / f"{i}.png", width, height, rects=[box]))
        write_labels(tmp_path / "labels" / f"{i}.txt", [yolo_line(i % 3, box, width, height)])
    dataset = YoloDataset(
        files,
        num_classes=3,
        image_size=64,
        augment=True,
        mosaic=1.0,
        flip_lr=0.5,
        flip_ud=0.5,
        hsv=(0, 0, 0),
        scale=0.5,
        verbose=False,
    )
    torch.manual_seed(0)
    items = [dataset[i % 4] for i in range(16)]
    total = 0
    for image, boxes, meta in items:
        assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
        assert boxes.dtype == torch.float32 and boxes.shape[1] == 5
        assert ((boxes[:, 1:] >= 0) & (boxes[:, 1:] <= 64)).all()
        assert ((boxes[:, 3] - boxes[:, 1] >= 2) & (boxes[:, 4] - boxes[:, 2] >= 2)).all()
        assert set(boxes[:, 0].tolist()) <= {0.0, 1.0, 2.0}
        grey = image[0].float()
        for _, x1, y1, x2, y2 in boxes.tolist():
            inside = grey[int(np.ceil(y1)) + 1 : int(y2) - 1, int(np.ceil(x1)) + 1 : int(x2) - 1]
            if inside.numel():
                assert (inside > 200).float().mean() > 0.9, (x1, y1, x2, y2)
        total += len(boxes)
    assert total >= 16  # mosaics hold several objects

    torch.manual_seed(0)
    again = [dataset[i % 4] for i in range(16)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(items, again))


def test_colour_jitter_and_collate(shapes):
    config = load_data_config(shapes)
    dataset = YoloDataset(config.train, len(config.names), image_size=64, augment=True, verbose=False)
    torch.manual_seed(1)
    batch = [dataset[i] for i in range(5)]
    assert all(((item[1][:, 0] >= 0) & (item[1][:, 0] < 4)).all() for item in batch)
    images, targets, metas = collate(batch)
    assert images.shape == (5, 3, 64, 64) and images.dtype == torch.uint8
    counts = [len(item[1]) for item in batch]
    assert len(set(counts)) > 1  # the padding is exercised
    assert targets.dtype == torch.float32 and targets.shape == (5, max(counts), 5)
    # each image's rows, then padding rows of class -1 and a zero box
    for i, item in enumerate(batch):
        assert torch.equal(targets[i, : counts[i]], item[1])
        assert (targets[i, counts[i] :, 0] == -1).all() and (targets[i, counts[i] :, 1:] == 0).all()
    assert [m["path"] for m in metas] == [str(p) for p in config.train[:5]]
    empty = collate([(torch.zeros(3, 8, 8, dtype=torch.uint8), torch.zeros(0, 5), {})] * 2)
    assert empty[0].shape == (2, 3, 8, 8) and empty[1].shape == (2, 0, 5)


@pytest.mark.parametrize("augment", [True, False])
def test_cached_images_give_the_same_items(shapes, augment):
    config = load_data_config(shapes)
    read, cached = (
        YoloDataset(
            config.train, len(config.names), image_size=96, augment=augment, verbose=False, cache=cache
        )
        for cache in (False, True)
    )
    # twice over: mosaic draws three more images an item,
    # so a cached picture changed in place would show
    for index in list(range(12)) * 2:
        items = []
        for dataset in (read, cached):
            torch.manual_seed(index)
            items.append(dataset[index])
        assert torch.equal(items[0][0], items[1][0]) and torch.equal(items[0][1], items[1][1])
        assert items[0][2] == items[1][2]


def test_cache_choice():
    assert cache_in_memory("auto", 100, 640) and not cache_in_memory("off", 100, 640)
    # past 1 GiB: read from disk
    assert not cache_in_memory("auto", CACHE_AUTO_BYTES // (640 * 640 * 3) + 1, 640)
    assert cache_in_memory("ram", CACHE_AUTO_BYTES // (640 * 640 * 3) + 1, 640)
    with pytest.raises(RecipeError, match="--cache ram needs .* GiB .* use --cache off"):
        cache_in_memory("ram", 10**7, 640)  # 12 TB
    with pytest.raises(RecipeError, match="unknown --cache 'disk'; choose auto, ram or off"):
        cache_in_memory("disk", 10, 640)


def test_the_choice_flags_offer_what_the_detector_modules_take():
    """--size, --export and --cache list the choices yolo_model, onnx_export and yolo_data take."""
    import typing

    from onnx_export import EXPORTS
    from train import DetectFlags
    from yolo_data import CACHE_MODES
    from yolo_model import SIZES

    from accelerate_recipes.flags import choices_of

    hints = typing.get_type_hints(DetectFlags)
    assert choices_of(hints["size"]) == tuple(SIZES)
    assert choices_of(hints["export"]) == EXPORTS
    assert choices_of(hints["cache"]) == CACHE_MODES
    with pytest.raises(RecipeError, match="^unknown --cache 'disk'; choose one of auto, ram, off$"):
        DetectFlags(cache="disk")


def test_download_dataset_offline_paths(tmp_path):
    with pytest.raises(RecipeError, match="'imagenet' is not a data.yaml"):
        download_dataset("imagenet", tmp_path)
    with pytest.raises(RecipeError, match="coco128/data.yaml is missing"):
        download_dataset("coco128", tmp_path, download=False)
    present = write_yaml(tmp_path / "coco128" / "data.yaml", {"train": "x"})
    assert download_dataset("coco128", tmp_path, download=False) == present
    assert download_dataset(str(tmp_path / "coco128"), tmp_path) == present


# --------------------------------------------------------------------------------------- converters
def coco_files(folder: Path, images: list[tuple], boxes: list[tuple]) -> Path:
    """A COCO instances JSON over `images` (id, file, width, height) with `boxes` (image id,
    category, x, y, w, h, iscrowd); the image files are written with a white rectangle per box."""
    for ident, name, width, height in images:
        rects = [(x, y, x + w, y + h) for i, _, x, y, w, h, crowd in boxes if i == ident and not crowd]
        save_image(
            folder / "pictures" / name, width, height, rects=[tuple(round(v) for v in r) for r in rects]
        )
    data = {
        "images": [{"id": i, "file_name": n, "width": w, "height": h} for i, n, w, h in images],
        "annotations": [
            {
                "id": 100 + k,
                "image_id": i,
                "category_id": c,
                "bbox": [x, y, w, h],
                "iscrowd": crowd,
                "area": w * h,
            }
            for k, (i, c, x, y, w, h, crowd) in enumerate(boxes)
        ],
        "categories": [{"id": 7, "name": "bird"}, {"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}],
    }
    annotations = folder / "instances.json"
    annotations.write_text(json.dumps(data))
    return annotations


def test_coco_to_yolo_round_trip_and_training_data(tmp_path):
    images = [(1, "a.jpg", 64, 48), (2, "b.png", 50, 70), (3, "empty.jpg", 40, 40)]
    boxes = [
        (1, 3, 10.5, 4.25, 30.0, 20.5, 0),
        (1, 7, 0.0, 0.0, 12.0, 48.0, 0),
        (2, 1, 5.0, 6.0, 40.0, 60.0, 0),
        (2, 3, 0.0, 0.0, 50.0, 70.0, 1),
    ]  # the last: a crowd region, skipped
    annotations = coco_files(tmp_path / "coco", images, boxes)
    out = tmp_path / "yolo"
    data_yaml = convert.coco_to_yolo(
        str(annotations), str(tmp_path / "coco" / "pictures"), str(out), split="train"
    )
    assert data_yaml == out / "data.yaml"
    # by category id
    assert yaml.safe_load(data_yaml.read_text())["names"] == {0: "cat", 1: "dog", 2: "bird"}
    classes = {1: 0, 3: 1, 7: 2}
    for ident, name, width, height in images:
        label = out / "labels" / "train" / Path(name).with_suffix(".txt")
        assert (out / "images" / "train" / name).is_symlink()
        got = pixel_boxes(label, width, height)
        want = [
            (classes[c], x, y, x + w, y + h) for i, c, x, y, w, h, crowd in boxes if i == ident and not crowd
        ]
        assert np.allclose(got, np.array(want).reshape(-1, 5), atol=0.5), (name, got, want)
    assert (out / "labels" / "train" / "empty.txt").read_text() == ""

    # a second split joins the same data.yaml, and the result is training data
    val = coco_files(tmp_path / "coco-val", [(5, "v.jpg", 60, 40)], [(5, 7, 2.0, 3.0, 20.0, 30.0, 0)])
    convert.coco_to_yolo(str(val), str(tmp_path / "coco-val" / "pictures"), str(out), split="val", link=False)
    assert not (out / "images" / "val" / "v.jpg").is_symlink()
    config = load_data_config(data_yaml)
    assert config.names == ["cat", "dog", "bird"] and len(config.train) == 3 and len(config.val) == 1
    dataset = YoloDataset(config.train, len(config.names), image_size=64, verbose=False)
    assert dataset.counts["boxes"] == 3 and dataset.counts["backgrounds"] == 1
    image, item_boxes, meta = dataset[config.train.index(out / "images" / "train" / "a.jpg")]
    back = scale_boxes_back(item_boxes[:, 1:], meta["ratio"], meta["pad"], meta["orig_shape"])
    assert np.allclose(sorted(back.tolist()), sorted([[10.5, 4.25, 40.5, 24.75], [0, 0, 12, 48]]), atol=1.0)


def test_coco_errors(tmp_path):
    images = [(1, "a.jpg", 64, 48)]
    pictures = tmp_path / "coco" / "pictures"
    cases = [
        ([(1, 99, 1.0, 1.0, 5.0, 5.0, 0)], "annotation id 100: category_id 99 is not in `categories`"),
        (
            [(1, 1, 40.0, 10.0, 30.0, 5.0, 0)],
            r"annotation id 100 \(image a.jpg\): box .* extends past the 64x48",
        ),
    ]
    for boxes, message in cases:
        annotations = coco_files(tmp_path / "coco", images, boxes)
        with pytest.raises(RecipeError, match=message):
            convert.coco_to_yolo(str(annotations), str(pictures), str(tmp_path / "out"))
    with pytest.raises(RecipeError, match="annotations file .*nope.json not found"):
        convert.coco_to_yolo(str(tmp_path / "nope.json"), str(pictures), str(tmp_path / "out"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [\n  {"id": 1,}\n]}')
    with pytest.raises(RecipeError, match="broken.json line 2: not valid JSON"):
        convert.coco_to_yolo(str(broken), str(pictures), str(tmp_path / "out"))


def voc_xml(folder: Path, ident: str, width: int, height: int, objects) -> None:
    """root/Annotations/<ident>.xml in the VOC devkit's layout; objects: (name, xmin, ymin, xmax,
    ymax, difficult)."""
    parts = [
        f"<annotation><folder>VOC2012</folder><filename>{ident}.jpg</filename>",
        f"<size><width>{width}</width><height>{height}</height><depth>3</depth></size>",
    ]
    for name, xmin, ymin, xmax, ymax, difficult in objects:
        parts.append(
            f"<object><name>{name}</name><pose>Unspecified</pose><truncated>0</truncated>"
            f"<difficult>{difficult}</difficult><bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin>"
            f"<xmax>{xmax}</xmax><ymax>{ymax}</ymax></bndbox></object>"
        )
    (folder / "Annotations").mkdir(parents=True, exist_ok=True)
    (folder / "Annotations" / f"{ident}.xml").write_text("".join(parts) + "</annotation>")
    save_image(folder / "JPEGImages" / f"{ident}.jpg", width, height)


def test_voc_to_yolo_round_trip_image_sets_and_cli(tmp_path):
    voc = tmp_path / "VOC2012"
    objects = {
        "2008_000001": (64, 48, [("person", 1, 1, 64, 48, 0), ("dog", 10, 12, 30, 40, 1)]),
        "2008_000002": (50, 70, [("cat", 5, 6, 45, 66, 0)]),
        "2008_000003": (40, 40, []),
        "2008_000004": (40, 40, [("bird", 3, 3, 9, 9, 0)]),
    }
    for ident, (width, height, objs) in objects.items():
        voc_xml(voc, ident, width, height, objs)
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    (voc / "ImageSets" / "Main" / "train.txt").write_text("2008_000001\n2008_000002\n2008_000003\n")
    (voc / "ImageSets" / "Main" / "val.txt").write_text("2008_000004\n")
    out = tmp_path / "yolo"
    data_yaml = convert.voc_to_yolo(str(voc), str(out), split="train", image_set="train")
    names = ["cat", "dog", "person"]  # sorted; the val-only bird is not in this image set
    assert yaml.safe_load(data_yaml.read_text())["names"] == dict(enumerate(names))
    assert sorted(p.name for p in (out / "labels" / "train").iterdir()) == [
        f"2008_00000{i}.txt" for i in (1, 2, 3)
    ]
    for ident in ("2008_000001", "2008_000002", "2008_000003"):
        width, height, objs = objects[ident]
        got = pixel_boxes(out / "labels" / "train" / f"{ident}.txt", width, height)
        # difficult kept
        want = [(names.index(n), x1 - 1, y1 - 1, x2, y2) for n, x1, y1, x2, y2, _ in objs]
        assert np.allclose(got, np.array(want).reshape(-1, 5), atol=0.5), (ident, got, want)
    assert (out / "labels" / "train" / "2008_000003.txt").read_text() == ""

    # the command line, as users run it: the val split adds `bird` after the names already in use
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "detect" / "convert.py"),
            "voc",
            "--root",
            str(voc),
            "--out",
            str(out),
            "--split",
            "val",
            "--image_set",
            "val",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=time_limit(120),
    )
    assert proc.returncode == 0, proc.stderr
    assert str(data_yaml) in proc.stdout and "val: 1 images, 1 boxes" in proc.stdout
    config = load_data_config(data_yaml)
    assert config.names == names + ["bird"] and len(config.train) == 3 and len(config.val) == 1
    dataset = YoloDataset(config.val, len(config.names), image_size=64, verbose=False)
    assert dataset[0][1][:, 0].tolist() == [3.0]

    with pytest.raises(RecipeError, match="test.txt not found; choose --image_set among: train, val"):
        convert.voc_to_yolo(str(voc), str(out), image_set="test")


def test_voc_errors(tmp_path):
    voc = tmp_path / "VOC"
    voc_xml(voc, "a", 40, 30, [("cat", 5, 5, 45, 20, 0)])
    with pytest.raises(RecipeError, match=r"a.xml object 1 \(cat\): box .* extends past the 40x30 image"):
        convert.voc_to_yolo(str(voc), str(tmp_path / "out"))
    (voc / "Annotations" / "a.xml").write_text("<annotation><size><width>40</width>\n<height>30</size>")
    with pytest.raises(RecipeError, match="a.xml line 2: not valid XML"):
        convert.voc_to_yolo(str(voc), str(tmp_path / "out"))
    with pytest.raises(RecipeError, match="Annotations not found"):
        convert.voc_to_yolo(str(tmp_path / "nothing"), str(tmp_path / "out"))


def test_converted_labels_sit_beside_symlinked_images(tmp_path):
    """Linked images keep their own path, so images/ -> labels/ finds the converted labels, not the
    source's."""
    annotations = coco_files(tmp_path / "coco", [(1, "a.jpg", 32, 32)], [(1, 1, 4.0, 4.0, 8.0, 8.0, 0)])
    for split in ("train", "val"):
        data_yaml = convert.coco_to_yolo(
            str(annotations), str(tmp_path / "coco" / "pictures"), str(tmp_path / "y"), split=split
        )
    config = load_data_config(data_yaml)
    assert config.train == [tmp_path / "y" / "images" / "train" / "a.jpg"]
    assert os.path.realpath(config.train[0]) == str((tmp_path / "coco" / "pictures" / "a.jpg").resolve())
    assert label_path(config.train[0]) == tmp_path / "y" / "labels" / "train" / "a.txt"


def test_tree_crown_tiles_cover_each_picture_once_and_keep_each_crown_once(tmp_path):
    import tree_crowns

    # DeepForest's layout: VOC files beside their pictures; the validation picture by its name
    source = tmp_path / "deepforest-data"
    crowns = {
        # the second one straddles x = 200
        "plot": [("Alive", 11, 11, 40, 40, 0), ("Dead", 190, 30, 230, 70, 0)],
        tree_crowns.VALIDATION: [("Tree", 101, 101, 130, 140, 0)],
    }
    for stem, objects in crowns.items():
        voc_xml(source, stem, 400, 260, objects)
        (source / "Annotations" / f"{stem}.xml").rename(source / f"{stem}.xml")
        (source / "JPEGImages" / f"{stem}.jpg").rename(source / f"{stem}.jpg")
    tree_crowns.main(out=str(tmp_path / "trees"), tile=200, source=str(source))

    config = load_data_config(tmp_path / "trees" / "data.yaml")
    assert config.names == ["tree"]
    for split, picture, count in (("train", "plot", 2), ("val", tree_crowns.VALIDATION, 1)):
        files = sorted(config.train if split == "train" else config.val)
        assert len(files) == 2  # 400 x 260 at about 200 px: two tiles of 200 x 260, side by side
        whole = np.asarray(Image.open(source / f"{picture}.jpg").convert("RGB"))
        assert np.array_equal(np.concatenate([np.asarray(Image.open(f)) for f in files], axis=1), whole)
        # the recipe's loader reads every tile
        dataset = YoloDataset(files, 1, image_size=320, verbose=False)
        assert dataset.counts["boxes"] == count
    left = label_rows(label_path(sorted(config.train)[0]))
    right = label_rows(label_path(sorted(config.train)[1]))
    # VOC's 1-based inclusive edges: (11, 11, 40, 40) is (10, 10, 40, 40) in a 200 x 260 tile
    assert left == [pytest.approx([0, 25 / 200, 25 / 260, 30 / 200, 30 / 260], abs=1e-6)]
    # 189..230 straddles the cut at 200: 30 of its 41 pixels lie right of it, so the right tile
    # keeps it, clipped
    assert right == [pytest.approx([0, 15 / 200, 49.5 / 260, 30 / 200, 41 / 260], abs=1e-6)]
    with pytest.raises(RecipeError, match="no VOC .xml annotations in .*deepforest==2.1.0"):
        tree_crowns.main(out=str(tmp_path / "none"), source=str(tmp_path))
