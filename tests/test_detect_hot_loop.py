"""The detector's training step reads nothing back from the device: the fixed-shape loss gives the
values of the earlier boolean-indexed one, the EMA follows AveragedModel's formula, class-offset NMS
equals per-class NMS, and the per-class AP from one COCO evaluation equals torchmetrics' per-class
evaluations. All on CPU, tiny inputs."""

import io
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from coco_map import coco_map
from ema import ModelEMA
from torch.optim.swa_utils import AveragedModel
from torch.overrides import TorchFunctionMode
from torchmetrics.detection import MeanAveragePrecision
from yolo_loss import DetectionLoss, complete_box_iou_loss, distribution_focal_loss, pad_targets
from yolo_model import (
    Detector,
    class_aware_nms,
    dfl_distances,
    distances_to_boxes,
    flatten_outputs,
    make_anchors,
)


# ----------------------------------------------------------------------- the loss, before and after
def reference_loss(criterion: DetectionLoss, outputs: list[torch.Tensor], rows: torch.Tensor):
    """The loss as it was computed with boolean indexing: targets as [T, 6] rows (image, class, x1,
    y1, x2, y2) padded on the device, box and DFL terms on the foreground anchors gathered by mask,
    torchvision's CIoU loss."""
    box_logits, cls_logits = flatten_outputs(outputs, criterion.reg_max)
    batch_size = box_logits.shape[0]
    anchor_points, stride_tensor = make_anchors(outputs, criterion.strides)
    pred_boxes = distances_to_boxes(dfl_distances(box_logits) * stride_tensor, anchor_points)

    image = rows[:, 0].long()
    counts = torch.bincount(image, minlength=batch_size)
    num_gts = int(counts.max()) if rows.shape[0] else 0
    gt_labels = torch.zeros(batch_size, num_gts, dtype=torch.long)
    gt_boxes = torch.zeros(batch_size, num_gts, 4)
    gt_mask = torch.zeros(batch_size, num_gts, dtype=torch.bool)
    if num_gts:
        order = torch.argsort(image, stable=True)
        image, sorted_rows = image[order], rows[order]
        slot = torch.arange(rows.shape[0]) - (torch.cumsum(counts, 0) - counts)[image]
        gt_labels[image, slot] = sorted_rows[:, 1].long()
        gt_boxes[image, slot] = sorted_rows[:, 2:6]
        gt_mask[image, slot] = True

    _, target_boxes, target_scores, foreground, _ = criterion.assigner(
        cls_logits.detach().sigmoid(), pred_boxes.detach(), anchor_points, gt_labels, gt_boxes, gt_mask
    )
    target_scores_sum = target_scores.sum().clamp(min=1.0)
    cls_loss = (
        F.binary_cross_entropy_with_logits(cls_logits, target_scores, reduction="sum") / target_scores_sum
    )
    weight = target_scores.sum(-1)[foreground]
    box_loss = (
        torchvision.ops.complete_box_iou_loss(
            pred_boxes[foreground], target_boxes[foreground], reduction="none"
        )
        * weight
    ).sum() / target_scores_sum
    strides_fg = stride_tensor.expand(batch_size, -1, -1)[foreground]
    anchors_fg = anchor_points.expand(batch_size, -1, -1)[foreground]
    target_fg = target_boxes[foreground]
    target_distances = torch.cat((anchors_fg - target_fg[:, :2], target_fg[:, 2:] - anchors_fg), dim=-1)
    target_distances = (target_distances / strides_fg).clamp(0, criterion.reg_max - 1 - 0.01)
    dfl_loss = (
        distribution_focal_loss(box_logits[foreground], target_distances) * weight
    ).sum() / target_scores_sum
    box, cls, dfl = (
        criterion.box_weight * box_loss,
        criterion.cls_weight * cls_loss,
        criterion.dfl_weight * dfl_loss,
    )
    return box + cls + dfl, dict(box=box, cls=cls, dfl=dfl)


def random_batch(seed: int, counts: list[int], num_classes: int = 4, size: int = 96):
    """Random raw outputs of a batch of size x size images (logits of a trained-ish scale) and
    random objects, as per-image [n, 5] rows."""
    g = torch.Generator().manual_seed(seed)
    outputs = [
        torch.randn(len(counts), 4 * 16 + num_classes, size // s, size // s, generator=g) * 2
        for s in (8, 16, 32)
    ]
    per_image = []
    for n in counts:
        corner = torch.rand(n, 2, generator=g) * (size - 24)
        # 8 px up to the far edge
        extent = 8 + torch.rand(n, 2, generator=g) * (size - 8 - corner).clamp(min=1)
        classes = torch.randint(0, num_classes, (n, 1), generator=g).float()
        per_image.append(torch.cat((classes, corner, (corner + extent).clamp(max=size)), dim=1))
    return [o.requires_grad_(True) for o in outputs], per_image


@pytest.mark.parametrize("seed,counts", [(0, [3, 0, 1]), (1, [5, 2, 0, 7]), (2, [0, 0]), (3, [1])])
def test_dense_loss_equals_the_boolean_indexed_loss(seed, counts):
    outputs, per_image = random_batch(seed, counts)
    criterion = DetectionLoss(num_classes=4)
    rows = torch.cat([torch.cat((torch.full((len(r), 1), float(i)), r), 1) for i, r in enumerate(per_image)])
    loss, parts = criterion(outputs, pad_targets(per_image))
    expected, expected_parts = reference_loss(criterion, outputs, rows)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for name in ("box", "cls", "dfl"):
        assert parts[name].item() == pytest.approx(expected_parts[name].item(), rel=1e-5, abs=1e-7), name
    if sum(counts):
        assert parts["box"] > 0 and parts["dfl"] > 0  # the comparison covers matched objects
    grads = torch.autograd.grad(loss, outputs)
    expected_grads = torch.autograd.grad(expected, outputs)
    for got, want in zip(grads, expected_grads):
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)


def test_ciou_loss_equals_torchvision_with_its_gradients():
    g = torch.Generator().manual_seed(0)
    corners = torch.rand(2, 2000, 2, generator=g) * 60  # many pairs apart, many overlapping
    boxes = torch.cat((corners, corners + 0.5 + torch.rand(2, 2000, 2, generator=g) * 30), dim=-1)
    pred = boxes[0].clone().requires_grad_(True)
    ours = complete_box_iou_loss(pred, boxes[1])
    theirs = torchvision.ops.complete_box_iou_loss(pred, boxes[1], reduction="none")
    assert (ours > 1).any() and (ours < 1).any()  # both disjoint and overlapping pairs
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    (grad_ours,) = torch.autograd.grad(ours.sum(), pred)
    (grad_theirs,) = torch.autograd.grad(theirs.sum(), pred)
    assert torch.allclose(grad_ours, grad_theirs, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- EMA
def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 2, 1))


def train_a_little(model: torch.nn.Module, step: int) -> None:
    """Move the weights and the BatchNorm statistics (and its num_batches_tracked counter)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model(torch.randn(2, 3, 6, 6) + step)


def averaged_model_reference(model: torch.nn.Module, decay: float, ramp_steps: float) -> AveragedModel:
    """The EMA as AveragedModel computed it: a copy at the first update, then the ramped decay of
    the update count."""

    def update(averaged, current, num_updates):
        d = decay * (1 - math.exp(-float(num_updates) / ramp_steps))
        if torch.is_floating_point(averaged[0]):
            torch._foreach_lerp_(averaged, current, 1 - d)
        else:
            for a, c in zip(averaged, current):
                a.copy_(c)

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def test_ema_follows_the_averaged_model_formula_and_round_trips():
    model = small_model()
    ema = ModelEMA(model, decay=0.9, ramp_steps=3)
    reference = averaged_model_reference(model, decay=0.9, ramp_steps=3)
    for step in range(6):
        train_a_little(model, step)
        ema.update(model)
        reference.update_parameters(model)
    assert ema.updates == 6 and int(reference.n_averaged) == 6
    ours, theirs = ema.module.state_dict(), reference.module.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-7), key
    # the average is not simply the model: the decay was in effect
    assert not torch.allclose(ours["0.weight"], model.state_dict()["0.weight"])
    # copied
    assert torch.equal(ours["1.num_batches_tracked"], model.state_dict()["1.num_batches_tracked"])
    assert not any(p.requires_grad for p in ema.module.parameters())

    # save_state/load_state pickle the state_dict and
    # hand it back: a fresh EMA continues identically
    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)
    buffer.seek(0)
    restored = ModelEMA(small_model(), decay=0.9, ramp_steps=3)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.updates == 6 and restored.current_decay() == ema.current_decay()
    train_a_little(model, 7)
    ema.update(model)
    restored.update(model)
    for (key, a), b in zip(ema.module.state_dict().items(), restored.module.state_dict().values()):
        assert torch.equal(a, b), key
    with pytest.raises(ValueError, match="another architecture"):
        ModelEMA(model, 0.9).update(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- NMS
def per_class_nms(boxes, scores, labels, iou_threshold):
    kept = torch.cat(
        [
            torch.where(labels == c)[0][
                torchvision.ops.nms(boxes[labels == c], scores[labels == c], iou_threshold)
            ]
            for c in labels.unique()
        ]
    )
    return kept[scores[kept].argsort(descending=True)]


@pytest.mark.parametrize("iou_threshold", [0.3, 0.7])
def test_class_offset_nms_equals_per_class_nms(iou_threshold):
    g = torch.Generator().manual_seed(0)
    n, size = 1500, 64
    # coordinates on a 1/8 grid: exact in float
    corner = torch.randint(0, 8 * (size - 8), (n, 2), generator=g) / 8
    extent = torch.randint(8, 8 * 24, (n, 2), generator=g) / 8
    boxes = torch.cat((corner, (corner + extent).clamp(max=size)), dim=1)
    scores = torch.randperm(n, generator=g).float() / n  # distinct: one order
    labels = torch.randint(0, 6, (n,), generator=g)
    kept = class_aware_nms(boxes, scores, labels, iou_threshold, max_coordinate=size)
    expected = per_class_nms(boxes, scores, labels, iou_threshold)
    assert 50 < len(kept) < n  # NMS removed some boxes and kept many
    assert kept.tolist() == expected.tolist()
    assert class_aware_nms(boxes[:0], scores[:0], labels[:0], iou_threshold, size).numel() == 0


# ---------------------------------------------------------------------------------------------- mAP
def test_per_class_ap_from_one_evaluation_equals_per_class_evaluations():
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(8):
        n = int(torch.randint(1, 5, (), generator=g))
        corner = torch.rand(n, 2, generator=g) * 80
        true_boxes = torch.cat((corner, corner + 10 + torch.rand(n, 2, generator=g) * 40), dim=1)
        # classes 0-2 have ground truth, 3 never does
        true_labels = torch.randint(0, 3, (n,), generator=g)
        strays = torch.rand(3, 4, generator=g) * 60 + torch.tensor([0.0, 0.0, 60.0, 60.0])
        boxes = torch.cat((true_boxes + torch.randn(n, 4, generator=g) * 4, strays))
        labels = torch.cat((true_labels, torch.tensor([0, 3, 1])))
        records.append(
            dict(
                boxes=boxes,
                scores=torch.rand(n + 3, generator=g),
                labels=labels,
                true_boxes=true_boxes,
                true_labels=true_labels,
            )
        )
    names = ["a", "b", "c", "d"]
    result, _ = coco_map(records, names)

    metric = MeanAveragePrecision(
        box_format="xyxy", iou_type="bbox", class_metrics=True, backend="pycocotools"
    )
    metric.update(
        [dict(boxes=r["boxes"], scores=r["scores"], labels=r["labels"]) for r in records],
        [dict(boxes=r["true_boxes"], labels=r["true_labels"]) for r in records],
    )
    values = metric.compute()
    expected = {
        names[int(c)]: ap
        for c, ap in zip(values["classes"].tolist(), values["map_per_class"].tolist())
        if ap >= 0
    }
    # d: no ground truth, no AP
    assert set(result["eval_ap_per_class"]) == set(expected) == {"a", "b", "c"}
    for name, ap in expected.items():
        assert result["eval_ap_per_class"][name] == pytest.approx(ap, abs=1e-6), name
    # imperfect predictions: a real comparison
    assert 0 < min(expected.values()) and max(expected.values()) < 1
    assert result["eval_map50_95"] == pytest.approx(float(values["map"]), abs=1e-6)
    assert result["eval_map50"] == pytest.approx(float(values["map_50"]), abs=1e-6)


# --------------------------------------------------------------------------------------- host reads
HOST_READS = {
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
    "unique",
    "masked_select",
    "argwhere",
}


class CountHostReads(TorchFunctionMode):
    """Records every call that, on a GPU, would make the host wait for the device's value."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        mask_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in HOST_READS or mask_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_nothing_back_from_the_device():
    torch.manual_seed(0)
    model = Detector(num_classes=3, size="n")
    criterion = DetectionLoss(3, strides=model.strides, reg_max=model.reg_max)
    ema = ModelEMA(model, decay=0.9999)
    images = torch.rand(2, 3, 64, 64)
    targets = pad_targets([torch.tensor([[0.0, 8, 8, 40, 40], [2.0, 30, 20, 60, 50]]), torch.zeros(0, 5)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        counter = CountHostReads()
        with counter:
            for _ in range(2):  # the first EMA update (a copy) and a decayed one
                loss, parts = criterion([o.float() for o in model(images)], targets)
                loss.backward()
                ema.update(model)
                running = torch.stack([loss.detach(), parts["box"], parts["cls"], parts["dfl"]])
    finally:
        torch.set_num_threads(threads)
    assert counter.reads == []
    with counter:  # the counter does see a read
        assert bool(running[1] > 0)  # the object was matched: the step ran the whole loss
    assert counter.reads == ["__bool__"]
    assert ema.updates == 2
