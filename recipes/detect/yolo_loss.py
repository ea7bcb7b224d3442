"""Training targets and loss for the anchor-free detector in yolo_model.py.

- TaskAlignedAssigner: TOOD's task-aligned assignment (Feng et al. 2021, "TOOD: Task-aligned
  One-stage Object Detection"), as used by YOLOv8. Each ground-truth box picks the top-k anchors,
  among those whose centre lies inside it, by the alignment metric score^alpha * IoU^beta, so the
  anchors trained to fire are the ones that already both classify and localise the object well.
- DetectionLoss: BCE classification against the assigner's soft (IoU-aware) targets, CIoU box loss
  (Zheng et al. 2020) and Distribution Focal Loss on the box sides (Li et al. 2020, "Generalized
  Focal Loss"), with YOLOv8's weights 7.5 / 0.5 / 1.5.

The loss is a per-batch mean-like scalar: every term is normalised by the sum of the target scores
in the batch (about the number of matched objects), not multiplied by the batch size, so DDP's
gradient averaging across processes gives the same step as one process with the whole batch.
(Ultralytics returns this value times the per-process batch size; learning rates tuned there are for
that larger gradient when used with SGD.)
"""

import ctypes
import math
import os
import sys

import torch
import torch.nn.functional as F
from yolo_model import distances_to_boxes, flatten_outputs, make_anchors


def pairwise_box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """IoU of every box of [B, M, 4] with every box of [B, A, 4] (xyxy) -> [B, M, A]."""
    a, b = boxes1[:, :, None, :], boxes2[:, None, :, :]
    w = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    h = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0)
    inter = w * h
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
    return inter / (area_a + area_b - inter + eps)


def complete_box_iou_loss(boxes1: torch.Tensor, boxes2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """CIoU loss of matching xyxy boxes [..., 4] -> [...], the values of
    torchvision.ops.complete_box_iou_loss (reduction none): 1 - IoU + centre distance^2 / enclosing
    diagonal^2 + alpha * v, v the aspect-ratio term.

    Written out because torchvision's version finds the overlapping pairs by boolean-mask indexing,
    which on a GPU reads the mask's size back to the host at every call; torch.where keeps the
    shapes fixed."""
    x1, y1, x2, y2 = boxes1.unbind(-1)
    x1g, y1g, x2g, y2g = boxes2.unbind(-1)
    w_inter = torch.minimum(x2, x2g) - torch.maximum(x1, x1g)
    h_inter = torch.minimum(y2, y2g) - torch.maximum(y1, y1g)
    inter = torch.where((w_inter > 0) & (h_inter > 0), w_inter * h_inter, 0.0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    enclosing_w = torch.maximum(x2, x2g) - torch.minimum(x1, x1g)
    enclosing_h = torch.maximum(y2, y2g) - torch.minimum(y1, y1g)
    diagonal = enclosing_w**2 + enclosing_h**2
    centres = ((x1 + x2 - x1g - x2g) / 2) ** 2 + ((y1 + y2 - y1g - y2g) / 2) ** 2
    v = (4 / math.pi**2) * (torch.atan((x2g - x1g) / (y2g - y1g)) - torch.atan((x2 - x1) / (y2 - y1))) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return 1 - iou + centres / (diagonal + eps) + alpha * v


class TaskAlignedAssigner:
    """Task-aligned assignment of ground-truth boxes to anchors (no gradients flow through it).

    For each gt box: candidates are the anchors whose centre lies strictly inside it (a box with a
    side under `min_side` pixels is widened to min_side about its centre for this choice only, so
    that an object smaller than a grid cell still gets candidates; Ultralytics 8.4 does the same
    with its middle stride, 16); their alignment metric is t = s^alpha * IoU^beta (s: the predicted
    probability of the gt's class, IoU: predicted box vs gt box); the topk candidates by t become
    positives. An anchor positive for several gts keeps the one its predicted box overlaps most.
    Target scores are t rescaled per gt so that the gt's best anchor gets that gt's best IoU (soft,
    quality-aware classification targets). IoU here is plain IoU as in TOOD (YOLOv8 uses CIoU
    clamped at 0 at this step).
    """

    def __init__(
        self,
        num_classes: int,
        topk: int = 10,
        alpha: float = 0.5,
        beta: float = 6.0,
        eps: float = 1e-9,
        min_side: float = 16.0,
    ):
        self.num_classes = num_classes
        self.min_side = min_side
        self.topk = topk
        self.alpha = alpha
        self.beta = beta
        self.eps = eps

    @torch.no_grad()
    def __call__(
        self,
        pred_scores: torch.Tensor,
        pred_boxes: torch.Tensor,
        anchor_points: torch.Tensor,
        gt_labels: torch.Tensor,
        gt_boxes: torch.Tensor,
        gt_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """pred_scores [B, A, C] sigmoid probabilities, pred_boxes [B, A, 4] xyxy pixels,
        anchor_points [A, 2] pixels, gt_labels [B, M] int64, gt_boxes [B, M, 4] xyxy pixels, gt_mask
        [B, M] bool (False for padding rows).

        Returns (target_labels [B, A] int64, target_boxes [B, A, 4], target_scores [B, A, C] float,
        foreground [B, A] bool, target_gt_index [B, A] int64); labels, boxes and indices are 0 where
        not foreground.
        """
        batch, num_anchors, num_classes = pred_scores.shape
        num_gts = gt_boxes.shape[1]
        device = pred_scores.device
        if num_gts == 0:
            return (
                torch.zeros(batch, num_anchors, dtype=torch.long, device=device),
                torch.zeros(batch, num_anchors, 4, device=device),
                torch.zeros(batch, num_anchors, num_classes, device=device),
                torch.zeros(batch, num_anchors, dtype=torch.bool, device=device),
                torch.zeros(batch, num_anchors, dtype=torch.long, device=device),
            )
        pred_scores, pred_boxes, gt_boxes = pred_scores.float(), pred_boxes.float(), gt_boxes.float()
        # padding rows may hold anything; gt_mask hides them
        gt_labels = gt_labels.long().clamp(0, num_classes - 1)

        # candidates: anchor centre strictly inside a real gt box (tiny boxes widened to min_side),
        # [B, M, A]
        x, y = anchor_points[:, 0], anchor_points[:, 1]
        centre = (gt_boxes[..., :2] + gt_boxes[..., 2:]) / 2
        half = (gt_boxes[..., 2:] - gt_boxes[..., :2]).clamp(min=self.min_side) / 2
        g = torch.cat((centre - half, centre + half), dim=-1)[..., None, :]  # [B, M, 1, 4]
        margin = torch.minimum(
            torch.minimum(x - g[..., 0], y - g[..., 1]), torch.minimum(g[..., 2] - x, g[..., 3] - y)
        )
        inside = margin > self.eps
        candidate = inside & gt_mask[..., None].bool()

        # alignment metric of each (gt, anchor) candidate pair
        iou = pairwise_box_iou(gt_boxes, pred_boxes) * candidate
        index = gt_labels[..., None].expand(batch, num_gts, num_anchors)
        # [B, M, A]: predicted prob of the gt's class
        class_score = pred_scores.transpose(1, 2).gather(1, index)
        metric = class_score.pow(self.alpha) * iou.pow(self.beta) * candidate

        # top-k candidates per gt; non-candidates rank
        # last (-1) and are removed again after the top-k
        k = min(self.topk, num_anchors)
        top = metric.masked_fill(~candidate, -1.0).topk(k, dim=-1).indices
        positive = torch.zeros_like(candidate).scatter_(-1, top, True) & candidate

        # an anchor positive for several gts keeps the one with the highest IoU among them
        # (max(dim).indices is argmax, first index on ties included, without argmax's slow strided
        # path on a CPU)
        multiple = positive.sum(1, keepdim=True) > 1  # [B, 1, A]
        best = (iou * positive).max(1, keepdim=True).indices  # [B, 1, A]
        only_best = torch.zeros_like(positive).scatter_(1, best, True)
        positive = torch.where(multiple, only_best & positive, positive)

        foreground = positive.any(1)  # [B, A]
        # [B, A]; 0 for background
        target_gt_index = positive.to(torch.uint8).max(1).indices * foreground
        target_labels = gt_labels.gather(1, target_gt_index) * foreground
        target_boxes = gt_boxes.gather(1, target_gt_index[..., None].expand(batch, num_anchors, 4))
        target_boxes = target_boxes * foreground[..., None]

        # soft targets: metric normalised per gt so that its best anchor reaches its best IoU
        metric = metric * positive
        max_metric = metric.amax(-1, keepdim=True)  # [B, M, 1]
        max_iou = (iou * positive).amax(-1, keepdim=True)
        # [B, A]; one positive gt per anchor
        quality = (metric * max_iou / (max_metric + self.eps)).amax(1)
        target_scores = F.one_hot(target_labels, num_classes).float() * (quality * foreground)[..., None]
        return target_labels, target_boxes, target_scores, foreground, target_gt_index


_MEMORY_KEPT = []  # [True] once keep_freed_memory has set this process's allocator


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep freed memory for reuse instead of handing it back to the kernel;
    True when set.

    A training step on the CPU frees and allocates its activations again, hundreds of MB at 640 px.
    By default glibc serves blocks of over 32 MB (and, as its threshold adapts, many smaller ones)
    with fresh mmap pages and returns them on free, so every step page-faults the same memory in
    again and the kernel zeroes it: about 150,000 faults and 0.3 s of system time a step for the
    nano model at 640 px and batch 8 on one thread. Without mmap and with a high trim threshold,
    freed blocks stay in the heap and the next step reuses them (PyTorch's CPU tuning guide gets the
    same from jemalloc or tcmalloc). The cost: the process's resident memory stays near its peak
    until it exits. Other C libraries and systems are left as they are."""
    if _MEMORY_KEPT:
        return True
    if not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h's option numbers
    if mallopt(m_mmap_max, 0) != 1 or mallopt(m_trim_threshold, 2**31 - 1) != 1:
        return False
    _MEMORY_KEPT.append(True)
    return True


def pad_targets(per_image: list[torch.Tensor]) -> torch.Tensor:
    """Per-image [n_i, 5] rows (class, x1, y1, x2, y2) -> the loss's targets [B, M, 5], M the most
    objects in one image (0 when no image has any); rows beyond an image's objects are padding with
    class -1 and a zero box.

    Run it where the rows are (the DataLoader's collate, on the CPU): the object counts are known
    there, so the training step never reads a count back from the GPU to size a tensor."""
    most = max((len(rows) for rows in per_image), default=0)
    targets = torch.zeros(len(per_image), most, 5)
    targets[..., 0] = -1
    for i, rows in enumerate(per_image):
        targets[i, : len(rows)] = rows
    return targets


def distribution_focal_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """DFL: cross-entropy towards the two bins around a continuous target, weighted by closeness.
    logits [..., 4, reg_max], target [..., 4] in bins (within [0, reg_max - 1)) -> [...] mean over
    the four sides."""
    return _dfl_from_log_probs(logits.log_softmax(-1), target)


def _dfl_from_log_probs(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """distribution_focal_loss from the bins' log-probabilities: cross-entropy is minus the target
    bin's log-probability, so one log-softmax serves both bins (and the expected distances too)."""
    left = target.long()
    weight_left = (left + 1).to(target.dtype) - target
    # [..., 4, 2]: the left and right bins
    picked = log_probs.gather(-1, torch.stack((left, left + 1), dim=-1))
    return -(picked[..., 0] * weight_left + picked[..., 1] * (1.0 - weight_left)).mean(-1)


class DetectionLoss:
    """YOLOv8-style detection loss on Detector's raw outputs.

    loss, parts = DetectionLoss(num_classes)(outputs, targets); targets: [B, M, 5] rows (class, x1,
    y1, x2, y2) in input-image pixels, padded with class -1 rows (pad_targets; M may be 0). `loss` =
    box_weight * box + cls_weight * cls + dfl_weight * dfl, a float32 scalar; `parts` = dict(box,
    cls, dfl) holds those three weighted terms, detached (they sum to `loss`).

    Every tensor has a shape known before the step runs and nothing is read back to the host: the
    box and DFL terms are computed on every anchor and weighted by zero off the foreground, instead
    of being gathered by a boolean mask (whose size only the GPU knows). Class ids are not checked
    here; the data loader checks every label at start-up.
    """

    def __init__(
        self,
        num_classes: int,
        strides: tuple[int, ...] = (8, 16, 32),
        reg_max: int = 16,
        box_weight: float = 7.5,
        cls_weight: float = 0.5,
        dfl_weight: float = 1.5,
    ):
        self.num_classes = num_classes
        self.strides = tuple(strides)
        self.reg_max = reg_max
        self.box_weight, self.cls_weight, self.dfl_weight = box_weight, cls_weight, dfl_weight
        # tiny boxes widened to the middle stride when choosing candidates, as Ultralytics 8.4 does
        self.assigner = TaskAlignedAssigner(
            num_classes, topk=10, alpha=0.5, beta=6.0, min_side=self.strides[1]
        )

    def __call__(self, outputs: list[torch.Tensor], targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # float32 throughout: the outputs may come from a bf16/fp16 autocast forward
        box_logits, cls_logits = flatten_outputs(outputs, self.reg_max)  # [B, A, 4, R], [B, A, C]
        # pixels, [A, 2] and [A, 1]
        anchor_points, stride_tensor = make_anchors(outputs, self.strides)
        # one log-softmax over the bins for the expected distances (dfl_distances' values) and DFL
        log_probs = box_logits.log_softmax(-1)
        bins = torch.arange(self.reg_max, device=log_probs.device, dtype=log_probs.dtype)
        distances = log_probs.exp() @ bins  # [B, A, 4] in grid units of each anchor's level
        pred_boxes = distances_to_boxes(distances * stride_tensor, anchor_points)  # pixels

        if targets.ndim != 3 or targets.shape[0] != box_logits.shape[0] or targets.shape[-1] != 5:
            raise ValueError(
                f"targets must be [{box_logits.shape[0]}, M, 5] (class, x1, y1, x2, y2; pad_targets); "
                f"got {tuple(targets.shape)}"
            )
        targets = targets.to(device=box_logits.device, dtype=torch.float32)
        gt_mask = targets[..., 0] >= 0  # padding rows have class -1
        _, target_boxes, target_scores, foreground, _ = self.assigner(
            cls_logits.detach().sigmoid(),
            pred_boxes.detach(),
            anchor_points,
            targets[..., 0].long(),
            targets[..., 1:],
            gt_mask,
        )
        target_scores_sum = target_scores.sum().clamp(min=1.0)

        cls_loss = (
            F.binary_cross_entropy_with_logits(cls_logits, target_scores, reduction="sum") / target_scores_sum
        )

        # box and DFL terms, each weighted by the anchor's target score (its assignment quality; 0
        # off the foreground)
        weight = target_scores.sum(-1)  # [B, A]
        # Off the foreground the target box is all zeros, where CIoU's aspect term is 0/0: both
        # boxes there become the same small box around the anchor, whose loss is finite and then
        # weighted by 0 (a NaN would survive x 0).
        fg = foreground[..., None]
        stand_in = torch.cat((anchor_points - 1.0, anchor_points + 1.0), dim=-1)  # [A, 4]
        ciou = complete_box_iou_loss(
            torch.where(fg, pred_boxes, stand_in), torch.where(fg, target_boxes, stand_in)
        )
        box_loss = (ciou * weight).sum() / target_scores_sum
        target_distances = torch.cat(
            (anchor_points - target_boxes[..., :2], target_boxes[..., 2:] - anchor_points), dim=-1
        )
        # right bin in range
        target_distances = (target_distances / stride_tensor).clamp(0, self.reg_max - 1 - 0.01)
        dfl = _dfl_from_log_probs(log_probs, target_distances)  # [B, A]
        dfl_loss = (dfl * weight).sum() / target_scores_sum

        box_term = self.box_weight * box_loss
        cls_term = self.cls_weight * cls_loss
        dfl_term = self.dfl_weight * dfl_loss
        loss = box_term + cls_term + dfl_term
        return loss, dict(box=box_term.detach(), cls=cls_term.detach(), dfl=dfl_term.detach())
