#!/usr/bin/env python
"""Convert COCO or Pascal VOC detection annotations to Ultralytics' YOLO format, which train.py
reads.

    python recipes/detect/convert.py coco --annotations annotations/instances_val2017.json --images val2017 \\
        --out data/coco-yolo --split val
    python recipes/detect/convert.py voc --root VOCdevkit/VOC2012 --out data/voc-yolo --split train \\
        --image_set train

Output (docs.ultralytics.com/datasets/detect): out/images/<split>/ (symbolic links to the images, or
copies with --link False), out/labels/<split>/<image stem>.txt (one `class cx cy w h` line per box,
normalised to [0, 1]; an empty file for an image without boxes) and out/data.yaml (path, the splits
converted so far, names). Converting a second split into the same out adds it to data.yaml; class
ids already there keep their numbers, and classes new to this split are appended.

Input formats:
* COCO (cocodataset.org/#format-data, "Object Detection"): a JSON with `images` (id, file_name,
  width, height), `annotations` (image_id, category_id, bbox [x, y, width, height] in pixels from
  the top-left corner, iscrowd) and `categories` (id, name). Class ids follow the category ids in
  increasing order (COCO's 1..90 with gaps become 0..79). Annotations with iscrowd = 1 mark a crowd
  region, not one object, and are skipped, as detection training usually does. Boxes of zero width
  or height are skipped.
* Pascal VOC (the VOC2012 devkit's layout and XML): root/Annotations/<id>.xml with
  <size><width><height> and one <object> per box (<name>, <difficult>,
  <bndbox><xmin><ymin><xmax><ymax>), images in root/JPEGImages, optional id lists in
  root/ImageSets/Main/<image_set>.txt. VOC numbers pixels from 1 and its boxes include the pixels
  xmax and ymax, so the box in 0-based continuous coordinates is (xmin - 1, ymin - 1, xmax, ymax),
  the customary conversion. Class names are sorted alphabetically. Objects marked difficult are kept
  (YOLO labels have no such flag).

Boxes that stick out of the image by up to one pixel are clipped (rounding in the annotation tools);
further out is an error naming the annotation.
"""

import json
import os
import shutil
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import yaml
from PIL import Image

from accelerate_recipes import RecipeError, run

PIXEL_TOLERANCE = 1.0


# ------------------------------------------------------------------------------------------- output
def _place_image(source: Path, target: Path, link: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    if link:
        try:
            # absolute, so the link works from any working directory; labels sit beside the link,
            # not the target
            target.symlink_to(os.path.abspath(source))
            return
        except OSError:  # file systems without symbolic links: copy instead
            pass
    shutil.copy2(source, target)


def yolo_line(cls: int, box, width: float, height: float) -> str:
    """A label file's line for the pixel box (x1, y1, x2, y2) of class `cls` in a width x height
    image."""
    x1, y1, x2, y2 = box
    return (
        f"{cls} {(x1 + x2) / 2 / width:.6f} {(y1 + y2) / 2 / height:.6f} {(x2 - x1) / width:.6f} "
        f"{(y2 - y1) / height:.6f}\n"
    )


def _clip_box(box, width: float, height: float, where: str):
    """Clip a pixel box that leaves the image by at most PIXEL_TOLERANCE; further out is an
    error."""
    x1, y1, x2, y2 = box
    if (
        x1 < -PIXEL_TOLERANCE
        or y1 < -PIXEL_TOLERANCE
        or x2 > width + PIXEL_TOLERANCE
        or y2 > height + PIXEL_TOLERANCE
    ):
        raise RecipeError(
            f"{where}: box (x1 {x1:g}, y1 {y1:g}, x2 {x2:g}, y2 {y2:g}) extends past the "
            f"{width:g}x{height:g} image; fix the annotation or the image size"
        )
    return max(x1, 0.0), max(y1, 0.0), min(x2, float(width)), min(y2, float(height))


def _existing_names(data_yaml: Path) -> tuple[dict, list[str]]:
    if not data_yaml.is_file():
        return {}, []
    try:
        config = yaml.safe_load(data_yaml.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(
            f"{data_yaml}: not valid YAML ({err}); fix it or convert into a new --out"
        ) from None
    names = config.get("names") or []
    if isinstance(names, dict):
        names = [names[k] for k in sorted(names, key=int)]
    return config, [str(n) for n in names]


def _merged_names(out: Path, new_names: list[str]) -> list[str]:
    """Names already in out/data.yaml keep their ids (their label files use them); new ones are
    appended."""
    _, names = _existing_names(out / "data.yaml")
    return names + [n for n in new_names if n not in names]


def write_data_yaml(out: Path, split: str, names: list[str]) -> Path:
    """out/data.yaml with `split` at images/<split> added to what is there, and `names`."""
    data_yaml = out / "data.yaml"
    config, _ = _existing_names(data_yaml)
    # absolute: Ultralytics reads a relative path against its datasets dir
    config["path"] = os.path.abspath(out)
    config[split] = f"images/{split}"
    config.pop("nc", None)
    config["names"] = dict(enumerate(names))
    ordered = {key: config[key] for key in ("path", "train", "val", "test") if key in config}
    ordered.update({key: value for key, value in config.items() if key not in ordered})
    data_yaml.write_text(yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True))
    return data_yaml


def _report(
    out: Path, split: str, images: int, boxes: int, empty: int, skipped: str, data_yaml: Path
) -> None:
    print(f"{split}: {images} images, {boxes} boxes, {empty} images without boxes{skipped} -> {out}")
    config, _ = _existing_names(data_yaml)
    if "val" not in config or "train" not in config:
        missing = "val" if "train" in config else "train"
        print(
            f"note: {data_yaml} has no {missing} split yet; convert one with --split {missing} or set "
            f"`{missing}`"
        )


# --------------------------------------------------------------------------------------------- COCO
def _load_json(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(
            f"annotations file {path} not found; pass --annotations the COCO instances JSON (e.g. "
            "annotations/instances_val2017.json)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError(
            f"{path} line {err.lineno}: not valid JSON ({err.msg}); re-download or fix the file"
        ) from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not a text (JSON) file ({err}); pass the COCO instances JSON") from None
    if not isinstance(data, dict) or not all(key in data for key in ("images", "annotations", "categories")):
        raise RecipeError(
            f"{path}: not a COCO detection file (needs images, annotations and categories); pass "
            "the instances_*.json, not captions or keypoints"
        )
    return data


def coco_to_yolo(annotations: str, images: str, out: str, split: str = "train", link: bool = True) -> Path:
    """Convert a COCO instances JSON and its image folder into out/images/<split>,
    out/labels/<split>, data.yaml.

    Args:
        annotations: the COCO instances JSON (images, annotations with bbox [x, y, w, h] in pixels,
            categories).
        images: the folder holding the images named by file_name in the JSON (e.g. val2017).
        out: the YOLO dataset folder to write; an existing data.yaml there gains this split.
        split: name of the split (train, val, test): images/<split> and labels/<split>.
        link: symbolic links to the images (default) rather than copies.
    Returns:
        the path of data.yaml.
    """
    annotations_file, image_dir, out_dir = Path(annotations), Path(images), Path(out)
    data = _load_json(annotations_file)
    if not image_dir.is_dir():
        raise RecipeError(
            f"image folder {image_dir} not found; pass --images the folder of the JSON's file_name "
            "entries (e.g. val2017)"
        )
    try:
        categories = sorted(data["categories"], key=lambda c: int(c["id"]))
        category_names = {int(c["id"]): str(c["name"]) for c in categories}
    except (KeyError, TypeError, ValueError):
        raise RecipeError(f"{annotations_file}: every category needs an integer id and a name") from None
    if not categories:
        raise RecipeError(f"{annotations_file}: `categories` is empty; a detection set needs class names")
    names = _merged_names(out_dir, [category_names[i] for i in sorted(category_names)])
    class_of = {cid: names.index(name) for cid, name in category_names.items()}

    entries = {}
    for entry in data["images"]:
        try:
            entries[entry["id"]] = dict(
                file=str(entry["file_name"]), width=entry.get("width"), height=entry.get("height"), lines=[]
            )
        except (KeyError, TypeError):
            raise RecipeError(
                f"{annotations_file}: an image entry lacks id or file_name ({str(entry)[:120]})"
            ) from None
    for entry in entries.values():
        source = image_dir / entry["file"]
        if not source.is_file():
            raise RecipeError(
                f"image {source} (file_name {entry['file']!r} in {annotations_file}) not found; pass "
                "--images the folder that holds the JSON's images"
            )
        # optional in some exports: read it from the file
        if not entry["width"] or not entry["height"]:
            with Image.open(source) as image:
                entry["width"], entry["height"] = image.size

    crowd = zero = 0
    for ann in data["annotations"]:
        ident = ann.get("id", "?")
        where = f"{annotations_file}: annotation id {ident}"
        if ann.get("iscrowd", 0):
            crowd += 1
            continue
        if ann.get("image_id") not in entries:
            raise RecipeError(
                f"{where}: image_id {ann.get('image_id')} is not in `images`; fix the annotation"
            )
        if ann.get("category_id") not in class_of:
            raise RecipeError(
                f"{where}: category_id {ann.get('category_id')} is not in `categories` (ids "
                f"{', '.join(map(str, sorted(class_of)))}); fix the annotation or add the category"
            )
        entry = entries[ann["image_id"]]
        try:
            x, y, w, h = (float(v) for v in ann["bbox"])
        except (KeyError, TypeError, ValueError):
            raise RecipeError(
                f"{where}: bbox must be [x, y, width, height] numbers; got {ann.get('bbox')!r}"
            ) from None
        box = _clip_box(
            (x, y, x + w, y + h), entry["width"], entry["height"], f"{where} (image {entry['file']})"
        )
        if box[2] - box[0] <= 0 or box[3] - box[1] <= 0:
            zero += 1
            continue
        entry["lines"].append(yolo_line(class_of[ann["category_id"]], box, entry["width"], entry["height"]))

    image_out, label_out = out_dir / "images" / split, out_dir / "labels" / split
    for entry in entries.values():
        _place_image(image_dir / entry["file"], image_out / entry["file"], link)
        label = (label_out / entry["file"]).with_suffix(".txt")
        label.parent.mkdir(parents=True, exist_ok=True)
        label.write_text("".join(entry["lines"]))
    data_yaml = write_data_yaml(out_dir, split, names)
    skipped = "".join(
        f", {n} {what} skipped" for n, what in ((crowd, "crowd annotations"), (zero, "zero-size boxes")) if n
    )
    _report(
        out_dir,
        split,
        len(entries),
        sum(len(e["lines"]) for e in entries.values()),
        sum(not e["lines"] for e in entries.values()),
        skipped,
        data_yaml,
    )
    return data_yaml


# ---------------------------------------------------------------------------------------------- VOC
def _text(node, tag: str, where: str) -> str:
    found = node.find(tag)
    if found is None or found.text is None or not found.text.strip():
        raise RecipeError(f"{where}: <{tag}> is missing; fix the annotation")
    return found.text.strip()


def _number(node, tag: str, where: str) -> float:
    value = _text(node, tag, where)
    try:
        return float(value)
    except ValueError:
        raise RecipeError(f"{where}: <{tag}> {value!r} is not a number; fix the annotation") from None


def parse_voc(xml_file: Path, image_dir: Path) -> dict:
    """One VOC annotation file: dict(image (its path), width, height, objects [(name, (x1, y1, x2,
    y2)), ...]) with boxes in 0-based pixel edges, clipped to the image."""
    try:
        tree = ElementTree.parse(xml_file)
    except ElementTree.ParseError as err:
        raise RecipeError(
            f"{xml_file} line {err.position[0]}: not valid XML ({err}); fix or remove the file"
        ) from None
    root = tree.getroot()
    name = (root.findtext("filename") or "").strip()
    image = image_dir / name if name else None
    if image is None or not image.is_file():  # some exports omit the suffix or the file name
        found = [
            image_dir / f"{xml_file.stem}{s}" for s in (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")
        ]
        image = next((p for p in found if p.is_file()), None)
        if image is None:
            raise RecipeError(
                f"{xml_file}: its image {name or xml_file.stem + '.jpg'} is not in {image_dir}; "
                "restore the image or remove the annotation"
            )
    size = root.find("size")
    width = _number(size, "width", f"{xml_file} <size>") if size is not None else 0
    height = _number(size, "height", f"{xml_file} <size>") if size is not None else 0
    if width <= 0 or height <= 0:  # some exports write 0 x 0: the image knows
        with Image.open(image) as opened:
            width, height = opened.size
    objects = []
    for number, obj in enumerate(root.iter("object"), start=1):
        where = f"{xml_file} object {number}"
        label = _text(obj, "name", where)
        box = obj.find("bndbox")
        if box is None:
            raise RecipeError(f"{where} ({label}): <bndbox> is missing; fix the annotation")
        # VOC pixels are numbered from 1 and xmax, ymax are
        # included: 0-based edges are xmin - 1 .. xmax
        corners = (
            _number(box, "xmin", where) - 1,
            _number(box, "ymin", where) - 1,
            _number(box, "xmax", where),
            _number(box, "ymax", where),
        )
        objects.append((label, _clip_box(corners, width, height, f"{where} ({label})")))
    return dict(image=image, width=width, height=height, objects=objects)


def voc_to_yolo(
    root: str, out: str, split: str = "train", image_set: str | None = None, link: bool = True
) -> Path:
    """Convert a Pascal VOC folder (Annotations/, JPEGImages/) into out/images/<split>,
    out/labels/<split>, data.yaml.

    Args:
        root: the VOC folder holding Annotations/ and JPEGImages/ (e.g. VOCdevkit/VOC2012).
        out: the YOLO dataset folder to write; an existing data.yaml there gains this split.
        split: name of the split (train, val, test): images/<split> and labels/<split>.
        image_set: convert only the ids listed in ImageSets/Main/<image_set>.txt (e.g. train, val,
            trainval); default: every file in Annotations/.
        link: symbolic links to the images (default) rather than copies.
    Returns:
        the path of data.yaml.
    """
    voc, out_dir = Path(root), Path(out)
    annotation_dir, image_dir = voc / "Annotations", voc / "JPEGImages"
    for folder in (annotation_dir, image_dir):
        if not folder.is_dir():
            raise RecipeError(
                f"{folder} not found; --root must be a Pascal VOC folder with Annotations/ and "
                "JPEGImages/ (e.g. VOCdevkit/VOC2012)"
            )
    if image_set:
        list_file = voc / "ImageSets" / "Main" / f"{image_set}.txt"
        if not list_file.is_file():
            present = sorted(p.stem for p in list_file.parent.glob("*.txt") if "_" not in p.stem)
            raise RecipeError(
                f"{list_file} not found; choose --image_set among: {', '.join(present) or 'none'}, or "
                "leave it out to convert every annotation"
            )
        ids = [line.split()[0] for line in list_file.read_text().splitlines() if line.strip()]
        xml_files = [annotation_dir / f"{i}.xml" for i in ids]
        for number, xml_file in enumerate(xml_files, start=1):
            if not xml_file.is_file():
                raise RecipeError(
                    f"{list_file} line {number}: {xml_file} not found; fix the list or restore the annotation"
                )
    else:
        xml_files = sorted(annotation_dir.glob("*.xml"))
    if not xml_files:
        raise RecipeError(f"no annotations (*.xml) in {annotation_dir}; point --root at a Pascal VOC folder")

    parsed = [parse_voc(xml_file, image_dir) for xml_file in xml_files]
    names = _merged_names(out_dir, sorted({label for p in parsed for label, _ in p["objects"]}))
    image_out, label_out = out_dir / "images" / split, out_dir / "labels" / split
    label_out.mkdir(parents=True, exist_ok=True)
    boxes = empty = zero = 0
    for p in parsed:
        lines = []
        for label, box in p["objects"]:
            if box[2] - box[0] <= 0 or box[3] - box[1] <= 0:
                zero += 1
                continue
            lines.append(yolo_line(names.index(label), box, p["width"], p["height"]))
        _place_image(p["image"], image_out / p["image"].name, link)
        (label_out / p["image"].name).with_suffix(".txt").write_text("".join(lines))
        boxes, empty = boxes + len(lines), empty + (not lines)
    data_yaml = write_data_yaml(out_dir, split, names)
    _report(
        out_dir,
        split,
        len(parsed),
        boxes,
        empty,
        f", {zero} zero-size boxes skipped" if zero else "",
        data_yaml,
    )
    return data_yaml


if __name__ == "__main__":
    run({"coco": coco_to_yolo, "voc": voc_to_yolo})
