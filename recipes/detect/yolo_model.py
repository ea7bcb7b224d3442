"""A YOLO-style anchor-free object detector in plain PyTorch: model, box decoding, NMS
post-processing, size/FLOPs.

The architecture follows the published layout of YOLOv8 (Ultralytics, 2023): a CSP backbone of C2f
blocks ending in SPPF, a PAN-FPN neck, and a decoupled anchor-free head on strides 8/16/32 whose box
branch predicts each side's distance from the anchor point as a discrete distribution over `reg_max`
bins (Distribution Focal Loss, Li et al. 2020, "Generalized Focal Loss"). The depth/width
multipliers and channel counts are YOLOv8's, so `size="n"` has the same 3.16M parameters at 80
classes; the code itself is written here from those published facts.

    model = Detector(num_classes=80, size="n")
    outputs = model(images)  # images: float [B, 3, H, W] in [0, 1], H and W multiples of 32
    # per image: boxes (xyxy, pixels), scores, labels
    detections = postprocess(outputs, model.strides, model.reg_max)

Conventions: boxes are (x1, y1, x2, y2) in input-image pixels; anchor points are in input-image
pixels too (the centre of a grid cell, (i + 0.5) * stride); anchors are ordered level by level
(stride 8 first), row-major inside a level, which is the order of `torch.cat([o.flatten(2) for o in
outputs], 2)`.
"""

import copy
import math

import torch
import torch.nn as nn
import torchvision
from torch.utils.flop_counter import FlopCounterMode

# YOLOv8's compound-scaling multipliers (the scales of Ultralytics' yolov8.yaml): depth scales the
# number of bottlenecks per C2f, width the channels, and channels are capped at max_channels before
# scaling.
SIZES = {
    "n": dict(depth=0.33, width=0.25, max_channels=1024),
    "s": dict(depth=0.33, width=0.50, max_channels=1024),
    "m": dict(depth=0.67, width=0.75, max_channels=768),
    "l": dict(depth=1.00, width=1.00, max_channels=512),
    "x": dict(depth=1.00, width=1.25, max_channels=512),
}

# Our blocks in YOLOv8's layer order: the index of each in Ultralytics' model (model.<index>, its
# detection YAML). Indices 10, 11, 13, 14, 17 and 20 are Upsample and Concat layers, without
# weights; 22 is the head.
YOLOV8_LAYERS = {
    "backbone.stem.0": 0,
    "backbone.stem.1": 1,
    "backbone.stem.2": 2,
    "backbone.stage3.0": 3,
    "backbone.stage3.1": 4,
    "backbone.stage4.0": 5,
    "backbone.stage4.1": 6,
    "backbone.stage5.0": 7,
    "backbone.stage5.1": 8,
    "backbone.stage5.2": 9,
    "neck.top_down4": 12,
    "neck.top_down3": 15,
    "neck.down3": 16,
    "neck.bottom_up4": 18,
    "neck.down4": 19,
    "neck.bottom_up5": 21,
    "head.box": "22.cv2",  # the box branch of each level
    "head.cls": "22.cv3",  # the classification branch of each level
}
FREEZABLE = 22  # --freeze counts YOLOv8's layers: at most every layer before the head


class Conv(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm -> SiLU, 'same' padding for odd kernels."""

    def __init__(self, c_in: int, c_out: int, k: int = 1, s: int = 1):
        super().__init__(
            nn.Conv2d(c_in, c_out, k, s, padding=k // 2, bias=False),
            # YOLO's BatchNorm settings: eps 1e-3 and a slow running-stat momentum suit small
            # per-GPU batches
            nn.BatchNorm2d(c_out, eps=1e-3, momentum=0.03),
            nn.SiLU(inplace=True),
        )


class Bottleneck(nn.Module):
    """Two 3x3 convs with an optional residual connection."""

    def __init__(self, c: int, shortcut: bool):
        super().__init__()
        self.cv1 = Conv(c, c, 3)
        self.cv2 = Conv(c, c, 3)
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """CSP block: a 1x1 conv splits into two halves, n bottlenecks run on one half and every
    intermediate output is concatenated (richer gradient paths than the older C3 block) before a 1x1
    fusing conv."""

    def __init__(self, c_in: int, c_out: int, n: int, shortcut: bool):
        super().__init__()
        self.c = c_out // 2
        self.cv1 = Conv(c_in, 2 * self.c, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))
        self.cv2 = Conv((2 + n) * self.c, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = list(self.cv1(x).split((self.c, self.c), dim=1))
        for block in self.m:
            ys.append(block(ys[-1]))
        return self.cv2(torch.cat(ys, dim=1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max-pools equal pooling at 5, 9 and 13 in
    one pass."""

    def __init__(self, c_in: int, c_out: int, k: int = 5):
        super().__init__()
        hidden = c_in // 2
        self.cv1 = Conv(c_in, hidden, 1)
        self.cv2 = Conv(hidden * 4, c_out, 1)
        self.pool = nn.MaxPool2d(k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.pool(x)
        y2 = self.pool(y1)
        return self.cv2(torch.cat((x, y1, y2, self.pool(y2)), dim=1))


class Backbone(nn.Module):
    """Strided convs and C2f blocks; returns the stride 8, 16 and 32 feature maps."""

    def __init__(self, ch: list[int], n3: int, n6: int):
        super().__init__()
        c1, c2, c3, c4, c5 = ch
        # stride 4
        self.stem = nn.Sequential(Conv(3, c1, 3, 2), Conv(c1, c2, 3, 2), C2f(c2, c2, n3, True))
        self.stage3 = nn.Sequential(Conv(c2, c3, 3, 2), C2f(c3, c3, n6, True))  # stride 8
        self.stage4 = nn.Sequential(Conv(c3, c4, 3, 2), C2f(c4, c4, n6, True))  # stride 16
        # stride 32
        self.stage5 = nn.Sequential(Conv(c4, c5, 3, 2), C2f(c5, c5, n3, True), SPPF(c5, c5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p3 = self.stage3(self.stem(x))
        p4 = self.stage4(p3)
        return p3, p4, self.stage5(p4)


class Neck(nn.Module):
    """PAN-FPN: a top-down path carries semantics to the fine levels, a bottom-up path carries
    localisation back."""

    def __init__(self, c3: int, c4: int, c5: int, n: int):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.top_down4 = C2f(c5 + c4, c4, n, False)
        self.top_down3 = C2f(c4 + c3, c3, n, False)
        self.down3 = Conv(c3, c3, 3, 2)
        self.bottom_up4 = C2f(c3 + c4, c4, n, False)
        self.down4 = Conv(c4, c4, 3, 2)
        self.bottom_up5 = C2f(c4 + c5, c5, n, False)

    def forward(self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor) -> list[torch.Tensor]:
        t4 = self.top_down4(torch.cat((self.up(p5), p4), dim=1))
        n3 = self.top_down3(torch.cat((self.up(t4), p3), dim=1))
        n4 = self.bottom_up4(torch.cat((self.down3(n3), t4), dim=1))
        n5 = self.bottom_up5(torch.cat((self.down4(n4), p5), dim=1))
        return [n3, n4, n5]


class Head(nn.Module):
    """Decoupled anchor-free head: per level, a box branch (4 * reg_max DFL logits) and a class
    branch (logits)."""

    def __init__(
        self,
        channels: list[int],
        num_classes: int,
        strides: tuple[int, ...],
        reg_max: int,
        cls_width: int | None,
    ):
        super().__init__()
        box_c = max(16, channels[0] // 4, 4 * reg_max)
        cls_c = cls_width or class_branch_width(channels[0], num_classes)
        self.box = nn.ModuleList(
            nn.Sequential(Conv(c, box_c, 3), Conv(box_c, box_c, 3), nn.Conv2d(box_c, 4 * reg_max, 1))
            for c in channels
        )
        self.cls = nn.ModuleList(
            nn.Sequential(Conv(c, cls_c, 3), Conv(cls_c, cls_c, 3), nn.Conv2d(cls_c, num_classes, 1))
            for c in channels
        )
        for box, cls, s in zip(self.box, self.cls, strides):
            nn.init.constant_(box[-1].bias, 1.0)
            # Start every class probability near the prior "about 5 objects per 640x640 image,
            # spread over the (640/s)^2 cells of this level and the classes", so the many background
            # anchors don't swamp the early classification loss (the focal-loss paper's
            # prior-probability init, Lin et al. 2017).
            nn.init.constant_(cls[-1].bias, math.log(5 / num_classes / (640 / s) ** 2))

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat((box(x), cls(x)), dim=1) for x, box, cls in zip(features, self.box, self.cls)]


def class_branch_width(channels: int, num_classes: int) -> int:
    """YOLOv8's hidden width of the classification branch: the finest level's channels, or the class
    count (up to 100) when that is larger; 80 for the nano model on COCO's 80 classes, 64 for it on
    3 classes."""
    return max(channels, min(num_classes, 100))


def _channels(c: int, width: float, max_channels: int) -> int:
    return int(math.ceil(min(c, max_channels) * width / 8) * 8)  # multiples of 8 suit tensor cores


def size_of_weights(state: dict) -> str | None:
    """The size (n, s, m, l, x) of a state dict of this detector, read from the first convolution's
    width (16, 32, 48, 64, 80 channels); None when it has no such layer or another width."""
    first = state.get("backbone.stem.0.0.weight")
    if first is None:
        return None
    widths = {_channels(64, v["width"], v["max_channels"]): size for size, v in SIZES.items()}
    return widths.get(int(first.shape[0]))


class Detector(nn.Module):
    """YOLOv8-layout detector. forward(images [B, 3, H, W] float in [0, 1], H and W multiples of 32)
    returns a list of 3 raw tensors [B, 4 * reg_max + num_classes, H / s, W / s] for s in strides,
    in train and eval mode alike: channels [0, 4 * reg_max) are the box-side DFL logits (left, top,
    right, bottom; reg_max bins each), the rest are class logits. Use `decode` or `postprocess` to
    turn them into boxes.

    cls_width: the hidden width of the classification branch; default YOLOv8's rule
    (class_branch_width). A model fine-tuned from another keeps that model's width (80 for COCO
    weights), so all of its branch carries over."""

    strides = (8, 16, 32)
    reg_max = 16

    def __init__(self, num_classes: int, size: str = "n", cls_width: int | None = None):
        super().__init__()
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be at least 1, got {num_classes}")
        self.num_classes = num_classes
        self.size = size
        depth, width, max_channels = SIZES[size]["depth"], SIZES[size]["width"], SIZES[size]["max_channels"]
        ch = [_channels(c, width, max_channels) for c in (64, 128, 256, 512, 1024)]
        n3, n6 = (max(round(n * depth), 1) for n in (3, 6))
        self.backbone = Backbone(ch, n3, n6)
        self.neck = Neck(ch[2], ch[3], ch[4], n3)
        self.head = Head([ch[2], ch[3], ch[4]], num_classes, self.strides, self.reg_max, cls_width)
        self.cls_width = self.head.cls[0][0][0].out_channels

    frozen_blocks: tuple[str, ...] = ()  # what freeze() fixed: kept in eval mode by train()

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        return self.head(self.neck(*self.backbone(images)))

    def freeze(self, layers: int) -> tuple[str, ...]:
        """Fix YOLOv8's first `layers` layers (Ultralytics' freeze: 10 is the backbone): their
        parameters get no gradient and their BatchNorm layers stay in eval mode, so their running
        statistics do not move either. Returns the names of the blocks fixed."""
        if not 0 <= layers <= FREEZABLE:
            raise ValueError(f"layers must be 0 to {FREEZABLE} (the layers before the head), got {layers}")
        self.frozen_blocks = tuple(n for n, i in YOLOV8_LAYERS.items() if isinstance(i, int) and i < layers)
        for name in self.frozen_blocks:
            self.get_submodule(name).requires_grad_(False)
        return self.train(self.training).frozen_blocks

    def train(self, mode: bool = True) -> "Detector":
        super().train(mode)
        # frozen BatchNorm statistics: also under model.train() and DDP's
        for name in self.frozen_blocks:
            self.get_submodule(name).eval()
        return self


def make_anchors(
    outputs: list[torch.Tensor], strides: tuple[int, ...], offset: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor points of all levels: (anchor_points [A, 2] as (x, y) in input-image PIXELS, i.e.
    (cell + offset) * stride; stride_tensor [A, 1]). Level by level, row-major inside a level.
    Float32 on the outputs' device."""
    points, stride_rows = [], []
    for out, s in zip(outputs, strides):
        h, w = out.shape[-2:]
        ys = (torch.arange(h, device=out.device, dtype=torch.float32) + offset) * s
        xs = (torch.arange(w, device=out.device, dtype=torch.float32) + offset) * s
        gy, gx = torch.meshgrid(ys, xs, indexing="ij")
        points.append(torch.stack((gx, gy), dim=-1).reshape(-1, 2))
        stride_rows.append(torch.full((h * w, 1), float(s), device=out.device, dtype=torch.float32))
    return torch.cat(points), torch.cat(stride_rows)


def flatten_outputs(outputs: list[torch.Tensor], reg_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw per-level outputs -> (box DFL logits [B, A, 4, reg_max], class logits [B, A, C]),
    float32."""
    # [B, A, 4 * reg_max + C]
    x = torch.cat([o.flatten(2) for o in outputs], dim=2).float().transpose(1, 2)
    box, cls = x.split((4 * reg_max, x.shape[-1] - 4 * reg_max), dim=-1)
    return box.reshape(*box.shape[:2], 4, reg_max), cls


def dfl_distances(box_logits: torch.Tensor) -> torch.Tensor:
    """DFL logits [..., 4, reg_max] -> expected distance per side [..., 4] in bins (grid units of
    the level)."""
    bins = torch.arange(box_logits.shape[-1], device=box_logits.device, dtype=box_logits.dtype)
    return box_logits.softmax(-1) @ bins


def distances_to_boxes(distances: torch.Tensor, anchor_points: torch.Tensor) -> torch.Tensor:
    """(left, top, right, bottom) distances from anchor points -> xyxy boxes, in the units of both
    inputs."""
    lt, rb = distances.chunk(2, dim=-1)
    return torch.cat((anchor_points - lt, anchor_points + rb), dim=-1)


def decode(
    outputs: list[torch.Tensor], strides: tuple[int, ...], reg_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw outputs -> (boxes_xyxy [B, A, 4] in input-image pixels, class_logits [B, A, C]), both
    float32.

    Each side's distance is the expectation of its softmax over reg_max bins, in units of the
    level's stride."""
    anchor_points, stride_tensor = make_anchors(outputs, strides)
    box_logits, cls_logits = flatten_outputs(outputs, reg_max)
    boxes = distances_to_boxes(dfl_distances(box_logits) * stride_tensor, anchor_points)
    return boxes, cls_logits


def class_aware_nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    labels: torch.Tensor,
    iou_threshold: float,
    max_coordinate: float,
) -> torch.Tensor:
    """NMS within each class, as one torchvision.ops.nms call: every class's boxes are shifted by
    class x (max_coordinate + 1), so boxes of different classes never overlap. Returns the kept
    indices, best score first.

    boxes [N, 4] xyxy with every coordinate in [0, max_coordinate]. torchvision's batched_nms shifts
    the same way for small inputs, but above a size threshold it loops over the classes with a
    device read for each."""
    shifted = boxes + (labels.to(boxes.dtype) * (max_coordinate + 1))[:, None]
    return torchvision.ops.nms(shifted, scores, iou_threshold)


@torch.no_grad()
def postprocess(
    outputs: list[torch.Tensor],
    strides: tuple[int, ...],
    reg_max: int,
    conf_threshold: float = 0.001,
    iou_threshold: float = 0.7,
    max_detections: int = 300,
    max_candidates: int = 30000,
    multi_label: bool = False,
) -> list[dict]:
    """Raw outputs -> per image dict(boxes [N, 4] float xyxy input pixels clipped to the image,
    scores [N], labels [N] int64), sorted by score, N <= max_detections.

    multi_label False (prediction): one label per anchor, its best class. True (evaluation, as
    Ultralytics' val scores): every class of an anchor above conf_threshold is a candidate of its
    own, so a box may count for two classes. Candidates scoring <= conf_threshold are dropped, at
    most max_candidates of the best go into class-aware NMS (class_aware_nms) at iou_threshold, on
    the boxes as decoded; the kept ones are then clipped to the image (the order Ultralytics
    follows, so that the same raw outputs give the same boxes)."""
    boxes, cls_logits = decode(outputs, strides, reg_max)
    height, width = outputs[0].shape[-2] * strides[0], outputs[0].shape[-1] * strides[0]
    # a decoded side reaches at most (reg_max - 1) strides
    # from its anchor: the span class_aware_nms must clear
    reach = (reg_max - 1) * max(strides)
    probabilities = cls_logits.sigmoid()
    best_scores, best_labels = probabilities.max(dim=-1)
    results = []
    for b in range(boxes.shape[0]):
        if multi_label:
            anchors, img_labels = (probabilities[b] > conf_threshold).nonzero(as_tuple=True)
            img_scores = probabilities[b][anchors, img_labels]
        else:
            anchors = (best_scores[b] > conf_threshold).nonzero(as_tuple=True)[0]
            img_scores, img_labels = best_scores[b][anchors], best_labels[b][anchors]
        img_boxes = boxes[b][anchors]
        # bounds NMS time when an untrained model fires everywhere
        if img_scores.numel() > max_candidates:
            top = img_scores.topk(max_candidates).indices
            img_boxes, img_scores, img_labels = img_boxes[top], img_scores[top], img_labels[top]
        kept = class_aware_nms(
            img_boxes + reach,
            img_scores,
            img_labels,
            iou_threshold,
            max_coordinate=max(width, height) + 2 * reach,
        )[:max_detections]
        kept_boxes = img_boxes[kept]
        kept_boxes[:, 0::2] = kept_boxes[:, 0::2].clamp(0, width)
        kept_boxes[:, 1::2] = kept_boxes[:, 1::2].clamp(0, height)
        results.append(dict(boxes=kept_boxes, scores=img_scores[kept], labels=img_labels[kept].long()))
    return results


def model_info(model: nn.Module, image_size: int = 640) -> dict:
    """dict(parameters=number of parameters, gflops=GFLOPs of one forward of a 1 x 3 x image_size x
    image_size image).

    FLOPs are counted by torch.utils.flop_counter.FlopCounterMode, which counts a multiply-add as 2
    FLOPs (convolutions and matmuls; BatchNorm, activations and pooling are not counted).
    Ultralytics' "GFLOPs" are 2 x MACs too, e.g.
    YOLOv8n: 3.2M parameters, 8.7 GFLOPs at 640. The count runs on a copy of the model on the meta
    device, so it computes nothing and leaves the model (its BatchNorm statistics included)
    untouched.
    """
    parameters = sum(p.numel() for p in model.parameters())
    probe = copy.deepcopy(model).to("meta").eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        probe(torch.zeros(1, 3, image_size, image_size, device="meta"))
    return dict(parameters=parameters, gflops=counter.get_total_flops() / 1e9)
