#!/usr/bin/env python
"""A real detection set that installs offline: tree crowns boxed on aerial photographs, cut into
YOLO-format tiles.

    pip install --no-deps deepforest==2.1.0          # or: make detect-data (which also runs the line below)
    python benchmarks/tree_crowns.py --out data/tree-crowns
    make bench-detect ARGS="--data data/tree-crowns/data.yaml --image_size 416 --epochs 30 --batch_size 8"

The DeepForest package (Weinstein et al., MIT licence; github.com/weecology/DeepForest) ships, for
its own tests, a few RGB orthophotos of NEON's airborne observation platform (US National Ecological
Observatory Network) with every tree crown boxed by hand, as Pascal VOC files: two crops of
Yellowstone (2299 x 2472 and 1249 x 1035 pixels, 574 and 279 crowns) and two 400 x 400 plots
(Florida and California, 61 and 37 crowns). One class, `tree` (the California plot's `Alive` and
`Dead` are trees too). Crowns are small, 10 to 106 pixels across: the kind of set a user brings from
a drone or a satellite, where Ultralytics' COCO-trained start helps least.

Large photographs are cut into a grid of equal tiles as close to --tile pixels a side as whole tiles
allow (DeepForest's own 400 by default; 383 x 412 for the larger crop), without overlap, so that
every crown is counted once. A crown goes to the tile that holds at least half of its box, clipped
to the tile. Train: the larger Yellowstone crop and the two plots (38 tiles, 671 crowns); val: the
smaller Yellowstone crop, another place (9 tiles, 278 crowns). Written under --out:
images/{train,val}/*.png, labels/{train,val}/*.txt and data.yaml.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "detect"))
from convert import parse_voc, write_data_yaml, yolo_line  # noqa: E402

from accelerate_recipes import RecipeError, run  # noqa: E402

# annotation stem of the picture that is the val split
VALIDATION = "2019_YELL_2_541000_4977000_image_crop"
PACKAGE_HINT = "pip install --no-deps deepforest==2.1.0 (or make detect-data)"
MIN_INSIDE = 0.5  # a crown belongs to a tile holding at least this fraction of its box


def deepforest_data() -> Path:
    """The data folder of the installed deepforest package."""
    spec = importlib.util.find_spec("deepforest")
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"the deepforest package is not installed; {PACKAGE_HINT}")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def tile_spans(length: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) spans cutting [0, length) into equal parts as close to `tile` pixels as whole
    parts allow."""
    parts = max(1, round(length / tile))
    edges = [round(i * length / parts) for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def tile_boxes(objects, x0: int, y0: int, x1: int, y1: int) -> list[tuple[float, float, float, float]]:
    """The boxes (x1, y1, x2, y2 in the picture) at least MIN_INSIDE inside the tile [x0, x1) x [y0,
    y1), in its pixels and clipped to it."""
    kept = []
    for _, (bx1, by1, bx2, by2) in objects:
        cx1, cy1, cx2, cy2 = max(bx1, x0), max(by1, y0), min(bx2, x1), min(by2, y1)
        inside = max(0.0, cx2 - cx1) * max(0.0, cy2 - cy1)
        if inside > 0 and inside >= MIN_INSIDE * (bx2 - bx1) * (by2 - by1):
            kept.append((cx1 - x0, cy1 - y0, cx2 - x0, cy2 - y0))
    return kept


def write_tiles(annotation: dict, out: Path, split: str, tile: int) -> tuple[int, int]:
    """One annotated picture's tiles into out/images/<split> and out/labels/<split>; (tiles, boxes)
    written."""
    with Image.open(annotation["image"]) as opened:
        picture = opened.convert("RGB")
    width, height = picture.size
    stem = Path(annotation["image"]).stem
    images, labels = out / "images" / split, out / "labels" / split
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    tiles = boxes = 0
    for y0, y1 in tile_spans(height, tile):
        for x0, x1 in tile_spans(width, tile):
            name = f"{stem}_{x0:05d}_{y0:05d}"
            picture.crop((x0, y0, x1, y1)).save(images / f"{name}.png")
            kept = tile_boxes(annotation["objects"], x0, y0, x1, y1)
            (labels / f"{name}.txt").write_text("".join(yolo_line(0, box, x1 - x0, y1 - y0) for box in kept))
            tiles, boxes = tiles + 1, boxes + len(kept)
    return tiles, boxes


def main(out: str = "data/tree-crowns", tile: int = 400, source: str | None = None) -> None:
    """Write the tree-crown tiles and data.yaml under `out` (replacing the tiles there).

    Args:
        out: the dataset folder to write.
        tile: the side of a tile in pixels (the photographs are 0.1 m a pixel).
        source: a folder of VOC .xml files and their pictures; default the installed deepforest
            package's data.
    """
    if tile < 32:
        raise RecipeError(f"--tile {tile} is too small; use at least 32 pixels, e.g. --tile 400")
    folder = Path(source) if source else deepforest_data()
    annotations = sorted(folder.glob("*.xml"))
    if not annotations:
        raise RecipeError(f"no VOC .xml annotations in {folder}; {PACKAGE_HINT}")
    out_dir = Path(out)
    shutil.rmtree(out_dir / "images", ignore_errors=True)
    shutil.rmtree(out_dir / "labels", ignore_errors=True)
    counts = {"train": [0, 0], "val": [0, 0]}
    for xml_file in annotations:
        split = "val" if xml_file.stem == VALIDATION else "train"
        tiles, boxes = write_tiles(parse_voc(xml_file, folder), out_dir, split, tile)
        counts[split][0] += tiles
        counts[split][1] += boxes
    for split, (tiles, boxes) in counts.items():
        if tiles == 0:
            raise RecipeError(
                f"{folder} has no picture for the {split} split ({VALIDATION}.xml is val); {PACKAGE_HINT}"
            )
        data_yaml = write_data_yaml(out_dir, split, ["tree"])
        print(
            f"{split}: {tiles} tiles of about {tile} px, {boxes} tree crowns -> {out_dir / 'images' / split}"
        )
    print(f"wrote {data_yaml}")


if __name__ == "__main__":
    run(main)
