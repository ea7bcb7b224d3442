"""Detection data in Ultralytics' YOLO format: data.yaml, label files, letterboxing, augmentation,
batching.

The format is the one documented at docs.ultralytics.com/datasets/detect:

* data.yaml holds `path` (the dataset root), `train` and `val` (and optionally `test`), each a
  folder of images, a .txt file listing image paths, or a list of those, relative to `path`; `names`
  (a list, or a dict {0: "person", ...}); optionally `nc`, which must then equal the number of
  names. One rule here differs from Ultralytics: a relative `path` is read against the folder
  holding data.yaml (then, if nothing is there, against the current directory), not against
  Ultralytics' settings folder; without `path`, the root is data.yaml's folder, as there.
* Each image has a label file: its path with the last `images` folder replaced by `labels` and the
  suffix by .txt (data/images/train/a.jpg -> data/labels/train/a.txt). One line per object, `class
  cx cy w h`, the box centre and size divided by the image width and height. A missing or empty
  label file marks a background image (no objects). A line of `class x1 y1 x2 y2 ...` (3 or more
  points: a segmentation polygon) stands for the polygon's box.

Checks, all at start-up (YoloDataset's constructor reads every label once), raising RecipeError with
the file, line and fix: a class id that is not a whole number in [0, number of names); a value that
is not a number; a coordinate or size outside [0, 1] by more than 1e-3 (values within that tolerance
are clipped; box corners that stick out of the image are clipped silently, as Ultralytics does); an
image that is missing or whose header cannot be read. Boxes of zero width or height carry no object:
they are dropped with a warning, not an error. An image whose pixels turn out to be corrupt past its
header raises RecipeError when it is loaded.

Images are decoded with PIL (JPEG ones at reduced size when they are much larger than the network
input, through the decoder's draft mode) and rotated by their EXIF orientation, as OpenCV-based
loaders do, so labels drawn on the upright picture match.
"""

import math
import os
import random
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch
import yaml
from PIL import Image
from tqdm.auto import tqdm
from yolo_loss import pad_targets

from accelerate_recipes import RecipeError
from accelerate_recipes.launch import usable_cores

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})
PAD_VALUE = 114  # YOLO's grey for letterbox borders and empty mosaic areas
TOLERANCE = 1e-3  # normalised coordinates this far outside [0, 1] are clipped; further is an error
MIN_BOX_PIXELS = 2.0  # after augmentation, boxes narrower or lower than this are dropped
# ... and so are boxes keeping less than this fraction of their area inside the crop
MIN_VISIBLE_AREA = 0.1
TRANSLATE = 0.1  # random shift of the augmented crop, as a fraction of its side

# EXIF orientation tag values (EXIF 2.3, tag 0x0112) ->
# the PIL transpose that makes the picture upright
EXIF_ORIENTATION = 0x0112
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}

# RGB -> YIQ (NTSC): Y is the brightness, I and Q span
# the chroma plane in which a rotation turns the hue
RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
YIQ_TO_RGB = np.linalg.inv(RGB_TO_YIQ)

COCO_NAMES = [
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
]
# Small public YOLO-format sets that Ultralytics hosts (the
# `download` URLs of its coco128.yaml and coco8.yaml).
DOWNLOADS = {
    "coco128": dict(
        url="https://github.com/ultralytics/assets/releases/download/v0.0.0/coco128.zip",
        train="images/train2017",
        val="images/train2017",
        names=COCO_NAMES,
    ),
    "coco8": dict(
        url="https://github.com/ultralytics/assets/releases/download/v0.0.0/coco8.zip",
        train="images/train",
        val="images/val",
        names=COCO_NAMES,
    ),
}


# ---------------------------------------------------------------------------------------- data.yaml
@dataclass
class DataConfig:
    """A parsed data.yaml: the dataset root, the image files of each split (absolute paths) and the
    class names."""

    root: Path
    train: list[Path]
    val: list[Path]
    names: list[str]
    test: list[Path] = field(default_factory=list)
    yaml_file: Path | None = None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(
            f"{path} not found; give the data.yaml of a YOLO-format dataset (keys path, train, val, names)"
        )
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        where = f" line {err.problem_mark.line + 1}" if getattr(err, "problem_mark", None) else ""
        raise RecipeError(
            f"{path}{where}: not valid YAML ({getattr(err, 'problem', None) or err}); fix the syntax"
        ) from None
    if not isinstance(config, dict):
        raise RecipeError(
            f"{path}: expected a mapping with keys path, train, val, names; got {type(config).__name__}"
        )
    return config


def _parse_names(config: dict, path: Path) -> list[str]:
    names = config.get("names")
    if names is None and isinstance(config.get("nc"), int) and config["nc"] > 0:
        # Ultralytics' default when only nc is given
        names = [f"class_{i}" for i in range(config["nc"])]
    if names is None:
        raise RecipeError(f"{path}: no `names`; add the class names, e.g. names: {{0: person, 1: car}}")
    if isinstance(names, dict):
        try:
            ids = sorted(int(k) for k in names)
        except (TypeError, ValueError):
            raise RecipeError(
                f"{path}: the keys of `names` must be class ids 0, 1, 2, ...; got {list(names)[:5]}"
            ) from None
        if ids != list(range(len(ids))):
            raise RecipeError(
                f"{path}: the ids in `names` must run 0..{len(ids) - 1} without gaps; got "
                f"{ids[:10]}; renumber the classes (and their labels)"
            )
        names = [names.get(i, names.get(str(i))) for i in ids]
    if not isinstance(names, list) or not names:
        raise RecipeError(
            f"{path}: `names` is empty or not a list/dict; list the class names, e.g. names: [person, car]"
        )
    names = [str(n) for n in names]
    if "nc" in config and config["nc"] != len(names):
        raise RecipeError(
            f"{path}: nc is {config['nc']} but `names` has {len(names)} entries; fix nc or names "
            "(nc may be left out)"
        )
    return names


def _resolve_root(config: dict, yaml_path: Path) -> Path:
    folder = Path(os.path.abspath(yaml_path)).parent
    if config.get("path") in (None, ""):
        return folder
    given = Path(os.path.expanduser(str(config["path"])))
    if given.is_absolute():
        candidates = [given]
    else:
        candidates = [Path(os.path.abspath(folder / given)), Path(os.path.abspath(given))]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    looked = " or ".join(str(c) for c in candidates)
    raise RecipeError(
        f"{yaml_path}: dataset folder `path: {config['path']}` not found (looked in {looked}); fix "
        "`path` (relative paths are read against the data.yaml folder) or remove it to use the "
        "data.yaml folder"
    )


def _images_in(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )


def _images_listed(list_file: Path, root: Path) -> list[Path]:
    """Image paths listed one per line; relative ones are read against the list's folder, then the
    dataset root."""
    images = []
    for number, line in enumerate(list_file.read_text().splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        given = Path(entry)
        candidates = [given] if given.is_absolute() else [list_file.parent / given, root / given]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise RecipeError(
                f"{list_file} line {number}: image {entry} not found (looked for "
                f"{' and '.join(os.path.abspath(c) for c in candidates)}); fix the path or remove "
                "the line"
            )
        if found.suffix.lower() not in IMAGE_SUFFIXES:
            raise RecipeError(
                f"{list_file} line {number}: {entry} is not an image "
                f"({', '.join(sorted(IMAGE_SUFFIXES))}); list image files only"
            )
        images.append(Path(os.path.abspath(found)))
    return images


def _split_images(config: dict, key: str, root: Path, yaml_path: Path) -> list[Path]:
    entries = config[key] if isinstance(config[key], list) else [config[key]]
    images = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise RecipeError(
                f"{yaml_path}: `{key}: {entry!r}` must be a folder, a .txt list of images or a list of those"
            )
        given = Path(os.path.expanduser(entry))
        where = given if given.is_absolute() else root / given
        # abspath, not resolve: a symlinked image keeps the
        # path whose images/ -> labels/ twin holds its labels
        where = Path(os.path.abspath(where))
        if where.is_dir():
            found = _images_in(where)
        elif where.is_file() and where.suffix.lower() == ".txt":
            found = _images_listed(where, root)
        elif where.is_file() and where.suffix.lower() in IMAGE_SUFFIXES:
            found = [where]
        else:
            raise RecipeError(
                f"{yaml_path}: {key} split {entry} not found (looked for {where}); fix `{key}` (a "
                f"folder of images or a .txt list, relative to path {root}) or create it"
            )
        if not found:
            raise RecipeError(
                f"{yaml_path}: {key} split {where} has no images "
                f"({', '.join(sorted(IMAGE_SUFFIXES))}); put the images there or fix `{key}`"
            )
        images += found
    return images


def load_data_config(path: str | Path) -> DataConfig:
    """Read a data.yaml in Ultralytics' format (see the module docstring) and list each split's
    image files."""
    path = Path(path)
    config = _read_yaml(path)
    for key in ("train", "val"):
        if config.get(key) in (None, "", []):
            raise RecipeError(
                f"{path}: no `{key}` split; add `{key}: images/{key}` (a folder of images, a .txt "
                "list of images, or a list of those, relative to `path`)"
            )
    names = _parse_names(config, path)
    root = _resolve_root(config, path)
    test = _split_images(config, "test", root, path) if config.get("test") else []
    return DataConfig(
        root=root,
        train=_split_images(config, "train", root, path),
        val=_split_images(config, "val", root, path),
        names=names,
        test=test,
        yaml_file=Path(os.path.abspath(path)),
    )


def download_dataset(name: str, data_dir: Path, download: bool = True) -> Path:
    """The data.yaml of a small public set (coco128, coco8) under data_dir/<name>, downloaded on
    first use.

    `name` may also be a folder holding a data.yaml. With download=False (the other processes of a
    node, after the first one downloaded), a missing set is an error rather than a second download.
    """
    if Path(name).is_dir() and (Path(name) / "data.yaml").is_file():
        return Path(name) / "data.yaml"
    if name not in DOWNLOADS:
        raise RecipeError(
            f"--data {name!r} is not a data.yaml, a folder holding one, synthetic, or a dataset we "
            f"download ({', '.join(DOWNLOADS)}); give the path of your data.yaml"
        )
    spec, folder = DOWNLOADS[name], Path(data_dir) / name
    data_yaml = folder / "data.yaml"
    if data_yaml.is_file():
        return data_yaml
    if not download:
        raise RecipeError(
            f"{data_yaml} is missing after the download on this node's first process; check that "
            f"{data_dir} is writable and that process's error"
        )
    archive = Path(data_dir) / f"{name}.zip"
    partial = archive.with_suffix(".zip.part")
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    print(f"downloading {name} from {spec['url']} into {data_dir}", flush=True)
    try:
        torch.hub.download_url_to_file(spec["url"], str(partial), progress=True)
        partial.replace(archive)
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(data_dir)
    except (OSError, zipfile.BadZipFile) as err:
        raise RecipeError(
            f"could not download {name} ({err}); download {spec['url']} by hand, unzip it into "
            f"{data_dir} and run again, or pass --data path/to/data.yaml"
        ) from None
    finally:
        partial.unlink(missing_ok=True)
    if not (folder / spec["train"]).is_dir():
        shutil.rmtree(folder, ignore_errors=True)
        raise RecipeError(f"{archive} did not unpack to {folder / spec['train']}; delete it and run again")
    archive.unlink()
    config = {
        "path": os.path.abspath(folder),
        "train": spec["train"],
        "val": spec["val"],
        "names": dict(enumerate(spec["names"])),
    }
    data_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
    return data_yaml


# ------------------------------------------------------------------------------------------- labels
def label_path(image: str | Path) -> Path:
    """Ultralytics' rule: the last `images` folder of the path becomes `labels`, the suffix becomes
    .txt."""
    parts = list(Path(image).parts)
    for i in range(len(parts) - 2, -1, -1):  # folders only, never the file name itself
        if parts[i] == "images":
            parts[i] = "labels"
            break
    return Path(*parts).with_suffix(".txt")


def _number(token: str, where: str) -> float:
    try:
        value = float(token)
    except ValueError:
        raise RecipeError(
            f"{where}: {token!r} is not a number; fix the line: it is `class cx cy w h`, numbers only"
        ) from None
    if not math.isfinite(value):
        raise RecipeError(f"{where}: {token!r} is not a finite number; fix the label")
    return value


def _unit(value: float, what: str, where: str) -> float:
    if -TOLERANCE <= value <= 1 + TOLERANCE:
        return min(max(value, 0.0), 1.0)
    raise RecipeError(
        f"{where}: {what} = {value:g} is outside [0, 1]; YOLO labels are normalised (pixel x and "
        "width divided by the image width, y and height by its height): fix the label"
    )


def parse_label_file(path: Path, num_classes: int) -> tuple[np.ndarray, list[str]]:
    """(float32 [N, 5] rows class, cx, cy, w, h in [0, 1]; 'file line N' of each zero-size box
    dropped).

    A missing file is a background image: no rows.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return np.zeros((0, 5), np.float32), []
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"cannot read label file {path} ({err}); fix or delete it") from None
    rows, dropped = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        tokens = line.split()
        if not tokens:
            continue
        where = f"{path} line {number}"
        if len(tokens) != 5 and (len(tokens) < 7 or len(tokens) % 2 == 0):
            raise RecipeError(
                f"{where}: {len(tokens)} values; a line is `class cx cy w h` (5 values, normalised "
                "to 0-1) or a polygon `class x1 y1 x2 y2 x3 y3 ...`: fix the line"
            )
        values = [_number(t, where) for t in tokens]
        cls = values[0]
        if cls != int(cls):
            raise RecipeError(
                f"{where}: class {tokens[0]} is not a whole number; fix the label: class ids are "
                "0-based indices into names in data.yaml"
            )
        if not 0 <= cls < num_classes:
            raise RecipeError(
                f"{where}: class {int(cls)} is out of range for the {num_classes} names in "
                f"data.yaml (0..{num_classes - 1}); fix the label or add the class to names"
            )
        if len(tokens) == 5:
            cx, cy = _unit(values[1], "cx", where), _unit(values[2], "cy", where)
            w, h = _unit(values[3], "w", where), _unit(values[4], "h", where)
            x1, y1, x2, y2 = (
                max(cx - w / 2, 0.0),
                max(cy - h / 2, 0.0),
                min(cx + w / 2, 1.0),
                min(cy + h / 2, 1.0),
            )
        else:  # a polygon: its bounding box
            xs = [_unit(v, "x", where) for v in values[1::2]]
            ys = [_unit(v, "y", where) for v in values[2::2]]
            x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
        if x2 - x1 <= 0 or y2 - y1 <= 0:
            dropped.append(where)
            continue
        rows.append((cls, (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1))
    return np.array(rows, np.float32).reshape(-1, 5), dropped


def _check_image_header(path: Path) -> None:
    """Opening reads only the header: cheap, and it catches missing files and files that are not
    images."""
    try:
        with Image.open(path) as image:
            width, height = image.size
    except FileNotFoundError:
        raise RecipeError(f"image {path} not found; restore it or remove it from the split") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise RecipeError(
            f"cannot read image {path} ({err}); replace it with a valid image or remove it from the split"
        ) from None
    if width < 1 or height < 1:
        raise RecipeError(f"image {path} is {width}x{height} pixels; replace it or remove it from the split")


def _scan(image: Path, num_classes: int) -> tuple[np.ndarray, list[str], bool]:
    _check_image_header(image)
    label_file = label_path(image)
    labels, dropped = parse_label_file(label_file, num_classes)
    return labels, dropped, label_file.is_file()


# ---------------------------------------------------------------------------------------- letterbox
def _load_image(path: Path, size: int) -> tuple[Image.Image, tuple[int, int], float]:
    """(RGB image upright and resized so its longer side is `size`, original (h, w) upright, the
    scale used)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            orientation = (
                image.getexif().get(EXIF_ORIENTATION, 1) if image.format in ("JPEG", "TIFF", "WEBP") else 1
            )
            # a quarter turn: the upright picture is height x width
            turned = orientation in (5, 6, 7, 8)
            if turned:
                width, height = height, width
            ratio = size / max(width, height)
            new_size = (max(1, round(width * ratio)), max(1, round(height * ratio)))
            # decode at 1/2, 1/4 or 1/8 scale: much less work
            if image.format == "JPEG" and ratio < 0.5:
                image.draft("RGB", new_size[::-1] if turned else new_size)
            image.load()  # decode now, while the file is open
            if image.mode != "RGB":
                image = image.convert("RGB")
    except FileNotFoundError:
        raise RecipeError(f"image {path} not found; restore it or remove it from the split") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise RecipeError(
            f"cannot read image {path} ({err}); replace it with a valid image or remove it from the split"
        ) from None
    if orientation in UPRIGHT:
        image = image.transpose(UPRIGHT[orientation])
    if image.size != new_size:
        image = image.resize(new_size, Image.Resampling.BILINEAR)
    return image, (height, width), ratio


def _pad_square(image: Image.Image, size: int) -> tuple[Image.Image, tuple[int, int]]:
    """`image` (sides <= size) centred on a size x size grey canvas; returns it and the (left, top)
    offset."""
    pad = ((size - image.width) // 2, (size - image.height) // 2)
    if image.size == (size, size):
        return image, (0, 0)
    canvas = Image.new("RGB", (size, size), (PAD_VALUE,) * 3)
    canvas.paste(image, pad)
    return canvas, pad


def letterbox(image, size: int):
    """Resize keeping the aspect ratio so the longer side is `size`, and pad to size x size with
    grey (114).

    `image` is uint8 [H, W, 3] (numpy or torch; [H, W] greyscale and [H, W, 4] are accepted).
    Returns (letterboxed image [size, size, 3] uint8 of the input's kind, ratio, (pad_x, pad_y)): a
    point (x, y) of the input lands at (x * ratio + pad_x, y * ratio + pad_y). scale_boxes_back
    undoes it.
    """
    is_tensor = isinstance(image, torch.Tensor)
    array = image.detach().cpu().numpy() if is_tensor else np.asarray(image)
    if array.dtype != np.uint8:
        raise ValueError(f"letterbox expects a uint8 image; got {array.dtype}")
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"letterbox expects an [H, W, 3] image; got shape {tuple(array.shape)}")
    picture = Image.fromarray(np.ascontiguousarray(array[..., :3]))
    ratio = size / max(picture.width, picture.height)
    new_size = (max(1, round(picture.width * ratio)), max(1, round(picture.height * ratio)))
    if picture.size != new_size:
        picture = picture.resize(new_size, Image.Resampling.BILINEAR)
    boxed, pad = _pad_square(picture, size)
    out = np.array(boxed)  # a writable copy
    return (torch.from_numpy(out) if is_tensor else out), ratio, pad


def scale_boxes_back(boxes_xyxy, ratio: float, pad, original_shape):
    """Map [N, 4] x1, y1, x2, y2 boxes from the letterboxed image to the original image's pixels
    (clipped to it).

    `ratio` and `pad` are what letterbox (or a dataset item's meta) returned; original_shape is
    (height, width). Takes and returns a torch tensor or a numpy array.
    """
    height, width = int(original_shape[0]), int(original_shape[1])
    pad_x, pad_y = float(pad[0]), float(pad[1])
    if isinstance(boxes_xyxy, torch.Tensor):
        shift = torch.tensor([pad_x, pad_y, pad_x, pad_y], dtype=boxes_xyxy.dtype, device=boxes_xyxy.device)
        out = (boxes_xyxy - shift) / ratio
        out[:, 0::2] = out[:, 0::2].clamp(0, width)
        out[:, 1::2] = out[:, 1::2].clamp(0, height)
        return out
    out = (np.asarray(boxes_xyxy, dtype=np.float64).reshape(-1, 4) - [pad_x, pad_y, pad_x, pad_y]) / ratio
    out[:, 0::2] = out[:, 0::2].clip(0, width)
    out[:, 1::2] = out[:, 1::2].clip(0, height)
    return out


def _to_pixels(labels: np.ndarray, original_shape, ratio: float, pad) -> np.ndarray:
    """Normalised (class, cx, cy, w, h) rows -> (class, x1, y1, x2, y2) in the letterboxed image's
    pixels."""
    height, width = original_shape
    out = np.empty_like(labels)
    out[:, 0] = labels[:, 0]
    half_w, half_h = labels[:, 3] / 2, labels[:, 4] / 2
    out[:, 1] = (labels[:, 1] - half_w) * width * ratio + pad[0]
    out[:, 2] = (labels[:, 2] - half_h) * height * ratio + pad[1]
    out[:, 3] = (labels[:, 1] + half_w) * width * ratio + pad[0]
    out[:, 4] = (labels[:, 2] + half_h) * height * ratio + pad[1]
    return out


# ------------------------------------------------------------------------------------------ dataset
CACHE_MODES = ("auto", "ram", "off")
# --cache auto keeps the images in memory when they take at most this much per process
CACHE_AUTO_BYTES = 2**30


def cache_in_memory(mode: str, num_images: int, image_size: int) -> bool:
    """--cache's answer for `num_images` images at `image_size` (each at most image_size^2 x 3 bytes
    once resized): ram always (refused when this machine's available memory, shared by the processes
    on it, cannot hold them), off never, auto when they fit CACHE_AUTO_BYTES and a quarter of this
    process's share of the available memory."""
    if mode not in CACHE_MODES:
        raise RecipeError(f"unknown --cache {mode!r}; choose auto, ram or off")
    if mode == "off":
        return False
    needed = num_images * image_size * image_size * 3
    share = psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if mode == "ram" and needed > share:
        raise RecipeError(
            f"--cache ram needs up to {needed / 2**30:.1f} GiB for {num_images} images at "
            f"{image_size} px, and this process's share of the available memory is "
            f"{share / 2**30:.1f} GiB; use --cache off"
        )
    return mode == "ram" or needed <= min(CACHE_AUTO_BYTES, share // 4)


def _on_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


class YoloDataset(torch.utils.data.Dataset):
    """Images and boxes of one split, letterboxed to image_size x image_size; augmented for
    training.

    Item: (image uint8 [3, S, S], boxes float32 [N, 5] rows class, x1, y1, x2, y2 in pixels of the S
    x S image, meta {path: str, orig_shape: (h, w), ratio: float, pad: (pad_x, pad_y)}). Without
    augmentation the image is letterboxed and meta maps boxes back to the original
    (scale_boxes_back). With augmentation meta describes the item's first image before augmentation;
    the boxes no longer map back to it.

    Augmentation (training): with probability `mosaic`, four images (this one and three drawn at
    random) around a random centre of a 2S x 2S canvas; then a crop of that canvas (or of the
    letterboxed image) zoomed by a random factor in [1 - scale, 1 + scale] and shifted by up to 10%,
    resized to S x S; horizontal and vertical flips with probabilities flip_lr and flip_ud; colour
    jitter with YOLO's hsv gains: hue turned by up to +/- hsv[0] of the colour circle, saturation
    and value multiplied by factors in [1 - hsv[1], 1 + hsv[1]] and [1 - hsv[2], 1 + hsv[2]]
    (applied as one colour matrix, in YIQ space for hue and saturation). Boxes are clipped to the
    image; boxes under 2 pixels wide or high, or keeping under 10% of their area, are dropped. The
    random draws come from torch's random generator (one draw per item), so they repeat under
    torch.manual_seed and, in DataLoader workers, follow the loader's seed.

    Every label file is read and checked here, once: a bad one stops the program now, not mid-epoch.
    `set_mosaic` turns mosaic off and on (train.py's --close_mosaic) through shared memory, so
    persistent loader workers follow.

    cache: decode and resize every image once, here, and keep it in memory (train.py's --cache).
    Items are the same with and without it; mosaic reads four images per item, so decoding is most
    of a small model's data time on a CPU. Loader workers started later share the cached pictures
    with this process (fork copies pages only on write).
    """

    def __init__(
        self,
        image_files,
        num_classes: int,
        image_size: int = 640,
        augment: bool = False,
        mosaic: float = 1.0,
        flip_lr: float = 0.5,
        flip_ud: float = 0.0,
        hsv=(0.015, 0.7, 0.4),
        scale: float = 0.5,
        verbose: bool = True,
        cache: bool = False,
    ):
        self.image_files = [Path(p) for p in image_files]
        if not self.image_files:
            raise RecipeError("the dataset has no images; check the split in data.yaml")
        self.num_classes, self.image_size, self.augment = int(num_classes), int(image_size), augment
        self.mosaic, self.flip_lr, self.flip_ud = float(mosaic), float(flip_lr), float(flip_ud)
        self.scale = float(scale)
        self.hsv = tuple(float(v) for v in hsv)
        if len(self.hsv) != 3:
            raise RecipeError(f"hsv must be three gains (hue, saturation, value); got {hsv}")
        if not 0 <= self.scale < 1:
            raise RecipeError(
                f"scale {scale} must lie in [0, 1): the zoom is drawn from [1 - scale, 1 + scale]"
            )
        self._mosaic_on = torch.ones((), dtype=torch.bool).share_memory_()
        workers = min(32, usable_cores() + 4)  # file reads wait on storage, so threads overlap them
        with ThreadPoolExecutor(workers) as pool:
            scanned = list(pool.map(lambda p: _scan(p, self.num_classes), self.image_files))
        self.labels = [labels for labels, _, _ in scanned]
        dropped = [where for _, drop, _ in scanned for where in drop]
        label_files = sum(found for _, _, found in scanned)
        self.counts = dict(
            images=len(self.labels),
            boxes=sum(len(lb) for lb in self.labels),
            backgrounds=sum(len(lb) == 0 for lb in self.labels),
            dropped_boxes=len(dropped),
            label_files=label_files,
        )
        if verbose and _on_rank_zero():
            print(self.summary(), flush=True)
            if dropped:
                print(
                    f"warning: dropped {len(dropped)} zero-size boxes (width or height 0), first "
                    f"at {dropped[0]}; fix or delete those lines",
                    flush=True,
                )
            if label_files == 0:
                print(
                    f"warning: no label files found; for {self.image_files[0]} the labels would be "
                    f"in {label_path(self.image_files[0])} (the last images/ folder becomes "
                    "labels/); every image is treated as background",
                    flush=True,
                )
        self._cached = self._decode_all(verbose and _on_rank_zero()) if cache else None

    def summary(self) -> str:
        c = self.counts
        return (
            f"{self.image_files[0].parent}: {c['images']} images, {c['boxes']} boxes, "
            f"{c['backgrounds']} background images (no boxes)"
        )

    def __len__(self) -> int:
        return len(self.image_files)

    def set_mosaic(self, on: bool) -> None:
        """Mosaic (at probability `mosaic`) on or off from the next item on, in every loader worker
        too."""
        self._mosaic_on.fill_(on)

    def _decode_all(self, progress: bool) -> list:
        with ThreadPoolExecutor(usable_cores()) as pool:  # PIL decodes and resizes outside the GIL
            loaded = pool.map(lambda p: _load_image(p, self.image_size), self.image_files)
            bar = tqdm(
                loaded, total=len(self), desc="caching images", unit="image", disable=not progress, delay=1
            )
            return list(bar)

    def _image(self, index: int) -> tuple[Image.Image, tuple[int, int], float]:
        """Image `index` upright, its longer side image_size; its original (h, w) and the scale
        (_load_image)."""
        if self._cached is not None:
            # never changed in place: every step after this makes a new picture
            return self._cached[index]
        return _load_image(self.image_files[index], self.image_size)

    def __getitem__(self, index: int):
        path = self.image_files[index]
        image, orig_shape, ratio = self._image(index)
        pad = ((self.image_size - image.width) // 2, (self.image_size - image.height) // 2)
        meta = dict(path=str(path), orig_shape=orig_shape, ratio=ratio, pad=pad)
        if self.augment:
            rng = random.Random(int(torch.randint(0, 2**62, ()).item()))
            boxes = _to_pixels(self.labels[index], orig_shape, ratio, (0, 0))
            image, boxes = self._augmented(index, image, boxes, rng)
        else:
            image, pad = _pad_square(image, self.image_size)
            boxes = _to_pixels(self.labels[index], orig_shape, ratio, pad)
        # CHW, in numpy: faster
        tensor = torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))
        return tensor, torch.from_numpy(np.ascontiguousarray(boxes, dtype=np.float32)).reshape(-1, 5), meta

    # ---- augmentation
    def _mosaic(self, index: int, first: Image.Image, first_boxes: np.ndarray, rng: random.Random):
        """Four images around a random centre of a 2S x 2S canvas; boxes clipped to the visible part
        of each."""
        size = self.image_size
        cx, cy = round(rng.uniform(size / 2, 1.5 * size)), round(rng.uniform(size / 2, 1.5 * size))
        canvas = Image.new("RGB", (2 * size, 2 * size), (PAD_VALUE,) * 3)
        all_boxes, all_areas = [], []
        others = [rng.randrange(len(self)) for _ in range(3)]
        for quadrant, i in enumerate([index] + others):
            if quadrant == 0:
                image, boxes = first, first_boxes
            else:
                image, orig_shape, ratio = self._image(i)
                boxes = _to_pixels(self.labels[i], orig_shape, ratio, (0, 0))
            w, h = image.size
            # top-left, top-right, bottom-left, bottom-right
            x = cx - w if quadrant in (0, 2) else cx
            y = cy - h if quadrant in (0, 1) else cy
            canvas.paste(image, (x, y))  # PIL clips what falls off the canvas
            boxes = boxes.copy()
            boxes[:, [1, 3]] += x
            boxes[:, [2, 4]] += y
            all_areas.append((boxes[:, 3] - boxes[:, 1]) * (boxes[:, 4] - boxes[:, 2]))
            boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(max(x, 0), min(x + w, 2 * size))
            boxes[:, [2, 4]] = boxes[:, [2, 4]].clip(max(y, 0), min(y + h, 2 * size))
            all_boxes.append(boxes)
        return canvas, np.concatenate(all_boxes), np.concatenate(all_areas)

    def _augmented(self, index: int, image: Image.Image, boxes: np.ndarray, rng: random.Random):
        """`image` resized (longer side S) but not padded, `boxes` in its pixels -> the augmented S
        x S item."""
        size = self.image_size
        # the draw is made either way: the rest repeats
        if rng.random() < self.mosaic and bool(self._mosaic_on):
            canvas, boxes, areas = self._mosaic(index, image, boxes, rng)
        else:
            canvas, pad = _pad_square(image, size)
            boxes = boxes.copy()
            boxes[:, [1, 3]] += pad[0]
            boxes[:, [2, 4]] += pad[1]
            areas = (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 4] - boxes[:, 2])
        # a square window of the canvas, zoomed by `zoom` and shifted, becomes the S x S output
        zoom = rng.uniform(1 - self.scale, 1 + self.scale)
        side = size / zoom
        x0 = canvas.width / 2 - side / 2 + rng.uniform(-TRANSLATE, TRANSLATE) * side
        y0 = canvas.height / 2 - side / 2 + rng.uniform(-TRANSLATE, TRANSLATE) * side
        image = canvas.transform(
            (size, size),
            Image.Transform.EXTENT,
            (x0, y0, x0 + side, y0 + side),
            resample=Image.Resampling.BILINEAR,
            fillcolor=(PAD_VALUE,) * 3,
        )
        boxes = boxes.copy()
        boxes[:, [1, 3]] = (boxes[:, [1, 3]] - x0) * zoom
        boxes[:, [2, 4]] = (boxes[:, [2, 4]] - y0) * zoom
        areas = areas * zoom * zoom
        boxes[:, 1:] = boxes[:, 1:].clip(0, size)
        w, h = boxes[:, 3] - boxes[:, 1], boxes[:, 4] - boxes[:, 2]
        keep = (
            (w >= MIN_BOX_PIXELS)
            & (h >= MIN_BOX_PIXELS)
            & (w * h >= MIN_VISIBLE_AREA * np.maximum(areas, 1e-9))
        )
        boxes = boxes[keep]
        if rng.random() < self.flip_lr:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            boxes[:, [1, 3]] = size - boxes[:, [3, 1]]
        if rng.random() < self.flip_ud:
            image = image.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
            boxes[:, [2, 4]] = size - boxes[:, [4, 2]]
        return self._jitter_colour(image, rng), boxes

    def _jitter_colour(self, image: Image.Image, rng: random.Random) -> Image.Image:
        hue, saturation, value = self.hsv
        if not (hue or saturation or value):
            return image
        # one 3x3 colour matrix: turn the hue in YIQ's chroma plane, scale the chroma (saturation)
        # and then all of R, G, B (value); a single PIL pass, several times cheaper than converting
        # to HSV and back
        angle = rng.uniform(-hue, hue) * 2 * math.pi
        chroma = rng.uniform(1 - saturation, 1 + saturation)
        brightness = rng.uniform(1 - value, 1 + value)
        cos, sin = math.cos(angle) * chroma, math.sin(angle) * chroma
        turn = np.array([[1.0, 0.0, 0.0], [0.0, cos, -sin], [0.0, sin, cos]])
        matrix = brightness * YIQ_TO_RGB @ turn @ RGB_TO_YIQ
        return image.convert("RGB", tuple(np.hstack([matrix, np.zeros((3, 1))]).ravel().tolist()))


def collate(batch):
    """Stack dataset items: (images uint8 [B, 3, S, S], targets float32 [B, M, 5] rows class, x1,
    y1, x2, y2 in pixels padded with class -1 rows (yolo_loss.pad_targets), metas: list of B
    dicts)."""
    images = torch.stack([item[0] for item in batch])
    return images, pad_targets([item[1].float() for item in batch]), [item[2] for item in batch]


class FilledEpochSampler(torch.utils.data.Sampler):
    """Every image once per epoch, in an order shuffled by (seed, epoch) alone, the last global
    batch filled up with the first images of that order: no image is left out of an epoch, every
    batch is whole (the training step keeps one shape), and each optimizer step trains on the same
    images on any number of processes.

    `multiple` is the global batch (per-process batch x processes x accumulation steps): accelerate
    hands process i the batches i, i + N, ..., so the images of optimizer step s are the positions
    [s x multiple, (s + 1) x multiple) of this order whatever N is. Call `set_epoch` before each
    epoch (accelerate's loader's set_epoch does)."""

    def __init__(self, size: int, multiple: int, seed: int):
        self.size, self.multiple, self.seed, self.epoch = size, multiple, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.size / self.multiple) * self.multiple

    def __iter__(self):
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch)) & (2**63 - 1))
        order = torch.randperm(self.size, generator=generator).tolist()
        filled = order * math.ceil(len(self) / self.size)
        return iter(filled[: len(self)])
