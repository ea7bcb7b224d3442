"""Pretrained starts and small sets in the detection recipe: --init_weights by name and shape,
Ultralytics YOLOv8 weights converted and giving Ultralytics' outputs, every image in every epoch on
any number of processes, and mosaic closed for the last epochs."""

import re
from pathlib import PosixPath

import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from conftest import DETECT_SCRIPT, NO_PLOTS, PYTHON, REPO, check, fails_with, read_results, recipe_env, run
from detector_files import build_model, model_size, read_model_config, read_start
from safetensors.torch import save_file
from synthetic_shapes import write_synthetic_dataset
from torch.utils.data import DataLoader, Dataset
from ultralytics_weights import mapped_state
from yolo_data import FilledEpochSampler, YoloDataset, collate
from yolo_model import Detector, postprocess

from accelerate_recipes import RecipeError
from accelerate_recipes.seeding import SeededAugmentation

CONVERT = REPO / "recipes" / "detect" / "ultralytics_weights.py"


# ------------------------------------------------------------------------------- every image trains
class Indices(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def step_images(
    size: int, global_batch: int, processes: int, epoch: int, accumulation: int = 1
) -> list[list[int]]:
    """The images of each optimizer step of one epoch, as accelerate's prepared loaders hand them to
    `processes` processes (prepare_data_loader is what accelerator.prepare runs)."""
    per_process = global_batch // (processes * accumulation)
    shards = []
    for rank in range(processes):
        sampler = FilledEpochSampler(size, global_batch, seed=3)
        loader = DataLoader(Indices(size), batch_size=per_process, sampler=sampler, drop_last=True)
        prepared = prepare_data_loader(
            loader, num_processes=processes, process_index=rank, put_on_device=False
        )
        prepared.set_epoch(epoch)
        shards.append([batch.tolist() for batch in prepared])
    steps = []
    for s in range(len(shards[0]) // accumulation):
        micro = range(s * accumulation, (s + 1) * accumulation)
        steps.append(sorted(i for shard in shards for m in micro for i in shard[m]))
    return steps


@pytest.mark.parametrize("size, batch", [(30, 8), (30, 16), (31, 8), (7, 4)])
def test_every_image_trains_in_every_epoch_and_n_processes_equal_one(size, batch):
    for epoch in (0, 1):
        one = step_images(size, batch, processes=1, epoch=epoch)
        # the last batch is filled up, none is dropped
        assert all(len(step) == batch for step in one)
        assert set().union(*map(set, one)) == set(range(size))  # every image in the epoch
        assert len(one) == -(-size // batch)
        # the same images in each step
        assert step_images(size, batch, processes=2, epoch=epoch) == one
        assert step_images(size, batch, processes=2, epoch=epoch, accumulation=2) == one
    # reshuffled each epoch
    assert step_images(size, batch, 1, epoch=0) != step_images(size, batch, 1, epoch=1)


def same_items(a: list, b: list) -> bool:
    """Two lists of collated batches hold the same images and boxes."""
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


def test_close_mosaic_reaches_persistent_workers(detect_shapes):
    """set_mosaic(False) in the main process: the next epoch's items from a persistent worker are
    those of a set without mosaic (the same draws otherwise), and differ from the mosaic ones."""
    from yolo_data import load_data_config

    files = load_data_config(detect_shapes).train[:6]

    def loader(mosaic: float):
        dataset = SeededAugmentation(
            YoloDataset(files, 3, image_size=64, augment=True, mosaic=mosaic), seed=0
        )
        return dataset, DataLoader(
            dataset, batch_size=3, num_workers=1, persistent_workers=True, collate_fn=collate
        )

    mosaic_set, mosaic_loader = loader(1.0)
    _, plain_loader = loader(0.0)
    with_mosaic, plain = list(mosaic_loader), list(plain_loader)
    assert not same_items(with_mosaic, plain)
    # what train.py does at the start of the last --close_mosaic epochs
    mosaic_set.set_mosaic(False)
    assert same_items(list(mosaic_loader), plain)


# -------------------------------------------------------------------------- --init_weights by shape
def saved_detector(folder, num_classes: int, size: str = "n", seed: int = 0):
    torch.manual_seed(seed)
    model = Detector(num_classes, size)
    # BatchNorm statistics other than the defaults, so that they must carry over
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    return model.eval()


def test_init_weights_by_shape_keeps_all_but_the_class_outputs(tmp_path):
    source = saved_detector(tmp_path / "five", num_classes=5)
    model, info = build_model("n", 2, False, tmp_path / "five", flag="--init_weights", by_shape=True)
    model.eval()
    # the source's branch width (5 classes: YOLOv8's 64)
    assert model.cls_width == source.cls_width == 64
    left = [f"head.cls.{i}.2.{t}" for i in range(3) for t in ("weight", "bias")]
    assert re.search(
        r"loaded 348 of 354 tensors by name and shape \(3\.0\dM of 3\.0\dM parameters\)", info["loaded"]
    )
    assert "left at their initial values: " + ", ".join(left) in info["loaded"]
    assert "(5, 64, 1, 1) there, (2, 64, 1, 1) here" in info["loaded"]
    x = torch.rand(1, 3, 64, 96)
    with torch.no_grad():
        ours, theirs = model(x), source(x)
    for a, b in zip(ours, theirs):  # the box branch and everything under it are the source's
        assert torch.equal(a[:, :64], b[:, :64])
    assert ours[0].shape[1] == 64 + 2


def test_init_weights_takes_the_class_branch_width_of_the_source(tmp_path):
    saved_detector(tmp_path / "coco", num_classes=80)  # COCO's 80 classes: the branch is 80 wide
    model, info = build_model("n", 1, False, tmp_path / "coco", flag="--init_weights", by_shape=True)
    assert model.cls_width == 80 and "loaded 348 of 354 tensors" in info["loaded"]
    assert Detector(1, "n").cls_width == 64  # what a fresh 1-class model would have had


def test_init_weights_refuses_a_file_that_is_not_this_detector(tmp_path):
    saved_detector(tmp_path / "small", num_classes=3, size="s")
    (tmp_path / "small" / "detector.json").write_text('{"size": "s", "num_classes": 3}')
    refused = r"gives only \d+% of this yolo-n's weights.*\(it is a yolo-s\)"
    with pytest.raises(RecipeError, match=refused):
        build_model("n", 3, False, tmp_path / "small", flag="--init_weights", by_shape=True)
    save_file({"fc.weight": torch.zeros(3, 3)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(RecipeError, match="gives only 0% of this yolo-n's weights"):
        build_model("n", 3, False, tmp_path / "other.safetensors", flag="--init_weights", by_shape=True)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RecipeError, match="is not a safetensors file"):
        build_model("n", 3, False, tmp_path / "bad.safetensors", flag="--init_weights", by_shape=True)


# ----------------------------------------------------------------------------- Ultralytics' YOLOv8n
def offline_ultralytics(settings):
    """Ultralytics' package imported offline with its settings in `settings`, and PIL's Image.open
    given back: the import replaces it with one that installs a package when a file is not an image,
    which other tests of the same process would meet."""
    # Ultralytics reads its settings folder when imported
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("YOLO_OFFLINE", "1")
        patch.setenv("YOLO_CONFIG_DIR", str(settings))
        import ultralytics
        from PIL import Image
        from ultralytics.utils import patches

    Image.open = patches._image_open
    return ultralytics


@pytest.fixture(scope="module")
def yolov8n(tmp_path_factory):
    """A YOLOv8n that Ultralytics builds from its YAML (offline, random weights, BatchNorm
    statistics made random too, and the class outputs' biases), saved by Ultralytics as a .pt
    checkpoint, and the folder that ultralytics_weights.py made of it."""
    folder = tmp_path_factory.mktemp("yolov8n")
    env = recipe_env(folder, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(folder / "settings"))
    YOLO = offline_ultralytics(folder / "settings").YOLO

    yolo = YOLO("yolov8n.yaml")
    generator = torch.Generator().manual_seed(0)
    for module in yolo.model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.weight.data = torch.rand(module.weight.shape, generator=generator) + 0.5
            module.bias.data = torch.randn(module.bias.shape, generator=generator) * 0.1
            module.running_mean = torch.randn(module.running_mean.shape, generator=generator) * 0.1
            module.running_var = torch.rand(module.running_var.shape, generator=generator) + 0.5
    # class scores spread around 0.5, not at the prior's 1e-5: boxes survive
    for branch in yolo.model.model[-1].cv3:
        branch[-1].bias.data = torch.randn(branch[-1].bias.shape, generator=generator) - 2
    # Ultralytics' checkpoint: the model pickled (in fp16), as its releases are
    yolo.save(folder / "yolov8n.pt")
    proc = check(run([PYTHON, CONVERT, "--weights", folder / "yolov8n.pt", "--out", folder / "ours"], env))
    return folder, proc, env


def test_converted_yolov8n_gives_ultralytics_outputs_and_boxes(yolov8n):
    from ultralytics import YOLO
    from ultralytics.utils.nms import non_max_suppression

    folder, proc, _ = yolov8n
    assert "YOLOv8n, 80 classes, 354 tensors converted" in proc.output
    config = read_model_config(folder / "ours")
    assert (config["size"], config["num_classes"], config["cls_width"], len(config["names"])) == (
        "n",
        80,
        80,
        80,
    )
    ours, info = build_model("n", 80, False, folder / "ours", cls_width=config["cls_width"])
    # Ultralytics counts its fixed DFL projection (16 values) as a parameter; our decode computes it
    assert info["parameters"] + 16 == sum(p.numel() for p in YOLO(folder / "yolov8n.pt").model.parameters())
    theirs = YOLO(folder / "yolov8n.pt").model.float().eval()  # the same file, read by Ultralytics
    images = torch.rand(2, 3, 128, 160, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        decoded, raw = theirs(images)
        outputs = ours.eval()(images)
    flat = torch.cat([o.flatten(2) for o in outputs], dim=2)
    # the same layers on the same weights in the same order:
    # equal up to float32 rounding of the convolutions
    torch.testing.assert_close(flat[:, :64], raw["boxes"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat[:, 64:], raw["scores"], rtol=1e-5, atol=1e-5)
    # prediction (one class a box) and evaluation (every class above the threshold, as Ultralytics'
    # val runs it)
    for multi_label in (False, True):
        found = postprocess(
            outputs,
            ours.strides,
            ours.reg_max,
            conf_threshold=0.25,
            iou_threshold=0.7,
            multi_label=multi_label,
        )
        expected = non_max_suppression(
            decoded, conf_thres=0.25, iou_thres=0.7, max_det=300, multi_label=multi_label
        )
        for mine, their in zip(found, expected):
            assert len(mine["boxes"]) == len(their) > 0
            # Ultralytics clips when it scales the boxes back
            their[:, [0, 2]] = their[:, [0, 2]].clamp(0, 160)
            their[:, [1, 3]] = their[:, [1, 3]].clamp(0, 128)
            # the same detections, one to one: equal scores
            # (random weights give ties) may come in either order
            rows = torch.cat(
                (mine["boxes"], mine["scores"][:, None] * 1000, mine["labels"][:, None] * 1000.0), 1
            )
            their_rows = torch.cat((their[:, :4], their[:, 4:5] * 1000, their[:, 5:6] * 1000), dim=1)
            distance = torch.cdist(rows[None], their_rows[None], p=float("inf"))[0]
            nearest = distance.min(dim=1)
            assert nearest.values.max() < 1e-2 and len(set(nearest.indices.tolist())) == len(rows)
        if multi_label:  # some boxes count for two classes there
            assert sum(len(f["boxes"]) for f in found) > sum(
                len(f) for f in non_max_suppression(decoded, 0.25, 0.7)
            )


def test_a_yolov8n_pt_fine_tunes_as_it_is_on_a_one_class_set(yolov8n, tmp_path):
    """Ultralytics' .pt itself as --init_weights (converted on the fly) for a 1-class set of 6
    images, no --size: the size comes from the file, all but the class outputs load, the default
    --batch_size 64 is lowered to the set, and the run trains and evaluates."""
    folder, _, env = yolov8n
    data = write_synthetic_dataset(
        tmp_path / "one", num_train=6, num_val=3, image_size=64, num_classes=1, seed=2
    )
    out = tmp_path / "out"
    args = ["--data", data, "--init_weights", folder / "yolov8n.pt", "--image_size", 64, "--epochs", 2]
    args += ["--tracker", "none", "--num_workers", 0, "--checkpoint_every", 0, *NO_PLOTS, "--output_dir", out]
    proc = check(run([PYTHON, DETECT_SCRIPT, *args], env, timeout=400))
    lowered = "note: --batch_size 64 is larger than the training set (6 images): training with --batch_size 6"
    assert lowered in proc.output
    assert re.search(
        r"--init_weights \S+yolov8n\.pt: loaded 348 of 354 tensors by name and shape", proc.output
    )
    assert "left at their initial values: head.cls.0.2.weight" in proc.output
    # a model built from Ultralytics' YAML names its classes by number
    start_line = (
        "the start: Ultralytics' YOLOv8n, converted, 80 classes (0, 1, 2, 3, 4 and 75 more); --data has 1"
    )
    assert start_line in proc.output
    results = read_results(out)
    assert (results["global_batch_size"], results["steps"], results["num_classes"]) == (6, 2, 1)
    saved = read_model_config(out)
    # COCO's branch width carried over
    assert saved["cls_width"] == 80 and saved["num_classes"] == 1
    check(run([PYTHON, DETECT_SCRIPT, "--predict", data.parent / "images" / "val", "--model", out], env))


@pytest.fixture(scope="module")
def yolo_class(tmp_path_factory):
    """Ultralytics' YOLO, imported offline with its settings in a folder of the test's."""
    return offline_ultralytics(tmp_path_factory.mktemp("settings")).YOLO


@pytest.mark.parametrize("size", ["l", "x"])
def test_yolov8_l_and_x_convert_and_give_ultralytics_outputs(yolo_class, size):
    """YOLOv8l and x, built by Ultralytics from its YAML: the same layout as n/s/m with other
    multipliers."""
    theirs = yolo_class(f"yolov8{size}.yaml").model.float().eval()
    generator = torch.Generator().manual_seed(0)
    # BatchNorm statistics other than the defaults, so that they must carry over
    for module in theirs.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean = torch.randn(module.running_mean.shape, generator=generator) * 0.1
            module.running_var = torch.rand(module.running_var.shape, generator=generator) + 0.5
    found_size, state = mapped_state({k: v.float() for k, v in theirs.state_dict().items()})
    assert found_size == size
    ours = Detector(80, size, cls_width=state["head.cls.0.0.0.weight"].shape[0])
    ours.load_state_dict(state)
    assert sum(p.numel() for p in ours.parameters()) + 16 == sum(p.numel() for p in theirs.parameters())
    images = torch.rand(1, 3, 64, 96, generator=generator)
    with torch.no_grad():
        _, raw = theirs(images)
        flat = torch.cat([o.flatten(2) for o in ours.eval()(images)], dim=2)
    torch.testing.assert_close(flat[:, :64], raw["boxes"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(flat[:, 64:], raw["scores"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "yaml, what",
    [
        ("yolov8n-seg.yaml", "a YOLOv8 segmentation model (yolov8n-seg.yaml)"),
        ("yolov8n-pose.yaml", "a YOLOv8 pose model"),
        ("yolov8n-obb.yaml", "a YOLOv8 oriented-box (OBB) model"),
        ("yolov8n-cls.yaml", "a YOLOv8 classification model"),
        ("yolo11n.yaml", "a YOLO11 detection model (yolo11n.yaml)"),
        ("yolov5nu.yaml", "a YOLOv5u detection model"),
        ("yolov10n.yaml", "a YOLOv10 detection model"),
        ("yolo26n.yaml", "a YOLO26 detection model"),
    ],
)
def test_pt_files_of_other_tasks_and_families_are_refused_naming_what_they_are(
    yolo_class, yaml, what, tmp_path
):
    yolo_class(yaml).save(tmp_path / "model.pt")
    with pytest.raises(
        RecipeError, match=re.escape(f"model.pt is {what}") + ".*not YOLOv8 detection"
    ) as refused:
        read_start(tmp_path / "model.pt")
    assert "\n" not in str(refused.value)


def test_an_older_releases_pt_with_windows_paths_reads_as_ultralytics_reads_it(yolov8n, tmp_path):
    """A best.pt as older releases and Windows machines pickled it: a class under
    `ultralytics.yolo.utils` (the module path before 8.1) and a WindowsPath. A plain torch.load
    fails on both; the start reads it."""
    from ultralytics.utils import IterableSimpleNamespace

    folder, _, _ = yolov8n
    checkpoint = torch.load(folder / "yolov8n.pt", weights_only=False)
    checkpoint["train_args"] = IterableSimpleNamespace(imgsz=96, save_dir=PosixPath("C:/runs/detect/train"))
    plain = tmp_path / "plain.pt"
    # protocol 2: classes named as text
    torch.save(checkpoint, plain, _use_new_zipfile_serialization=False)
    old = plain.read_bytes()
    old = old.replace(
        b"cultralytics.utils\nIterableSimpleNamespace\n",
        b"cultralytics.yolo.utils\nIterableSimpleNamespace\n",
    )
    old = old.replace(b"cpathlib\nPosixPath\n", b"cpathlib\nWindowsPath\n")
    assert b"ultralytics.yolo.utils" in old and b"WindowsPath" in old
    (tmp_path / "best.pt").write_bytes(old)
    with pytest.raises(Exception):
        torch.load(tmp_path / "best.pt", weights_only=False)
    start = read_start(tmp_path / "best.pt")
    assert (start["size"], start["num_classes"], start["image_size"], start["cls_width"]) == ("n", 80, 96, 80)
    assert model_size(None, start) == "n"
    with pytest.raises(
        RecipeError, match="--size s, but --init_weights .*best.pt is a yolo-n; leave --size out"
    ):
        model_size("s", start)


def test_conversion_refuses_what_is_not_yolov8_detection_weights(tmp_path):
    env = recipe_env(tmp_path)
    missing = run([PYTHON, CONVERT, "--weights", tmp_path / "none.pt", "--out", tmp_path / "o"], env)
    fails_with(missing, "none.pt not found")
    torch.save({"model.0.conv.weight": torch.zeros(16, 3, 3, 3)}, tmp_path / "partial.pt")
    partial = run([PYTHON, CONVERT, "--weights", tmp_path / "partial.pt", "--out", tmp_path / "o"], env)
    fails_with(partial, "not YOLOv8 detection weights")
