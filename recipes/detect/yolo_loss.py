"""Training targets and loss for the anchor-free detector in yolo_model.py.

- TaskAlignedAssigner: TOOD's task-aligned assignment (Feng et al. 2021, "TOOD: Task-aligned One-stage Object
  Detection"), as used by YOLOv8. Each ground-truth box picks the top-k anchors, among those whose centre lies inside
  it, by the alignment metric score^alpha * IoU^beta, so the anchors trained to fire are the ones that already both
  classify and localise the object well.
- DetectionLoss: BCE classification against the assigner's soft (IoU-aware) targets, CIoU box loss (Zheng et al.
  2020) and Distribution Focal Loss on the box sides (Li et al. 2020, "Generalized Focal Loss"), with YOLOv8's
  weights 7.5 / 0.5 / 1.5.

The loss is a per-batch mean-like scalar: every term is normalised by the sum of the target scores in the batch (about
the number of matched objects), not multiplied by the batch size, so DDP's gradient averaging across processes gives
the same step as one process with the whole batch. (Ultralytics returns this value times the per-process batch size;
learning rates tuned there are for that larger gradient when used with SGD.)
"""

import torch
import torch.nn.functional as F
from torchvision.ops import complete_box_iou_loss
from yolo_model import dfl_distances, distances_to_boxes, flatten_outputs, make_anchors


def pairwise_box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """IoU of every box of [B, M, 4] with every box of [B, A, 4] (xyxy) -> [B, M, A]."""
    a, b = boxes1[:, :, None, :], boxes2[:, None, :, :]
    w = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    h = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0)
    inter = w * h
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
    return inter / (area_a + area_b - inter + eps)


class TaskAlignedAssigner:
    """Task-aligned assignment of ground-truth boxes to anchors (no gradients flow through it).

    For each gt box: candidates are the anchors whose centre lies strictly inside it; their alignment metric is
    t = s^alpha * IoU^beta (s: the predicted probability of the gt's class, IoU: predicted box vs gt box); the topk
    candidates by t become positives. An anchor positive for several gts keeps the one its predicted box overlaps
    most. Target scores are t rescaled per gt so that the gt's best anchor gets that gt's best IoU (soft, quality-aware
    classification targets). IoU here is plain IoU as in TOOD (YOLOv8 uses CIoU clamped at 0 at this step).
    """

    def __init__(self, num_classes: int, topk: int = 10, alpha: float = 0.5, beta: float = 6.0, eps: float = 1e-9):
        self.num_classes = num_classes
        self.topk = topk
        self.alpha = alpha
        self.beta = beta
        self.eps = eps

    @torch.no_grad()
    def __call__(self, pred_scores: torch.Tensor, pred_boxes: torch.Tensor, anchor_points: torch.Tensor,
                 gt_labels: torch.Tensor, gt_boxes: torch.Tensor, gt_mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """pred_scores [B, A, C] sigmoid probabilities, pred_boxes [B, A, 4] xyxy pixels, anchor_points [A, 2] pixels,
        gt_labels [B, M] int64, gt_boxes [B, M, 4] xyxy pixels, gt_mask [B, M] bool (False for padding rows).

        Returns (target_labels [B, A] int64, target_boxes [B, A, 4], target_scores [B, A, C] float,
        foreground [B, A] bool, target_gt_index [B, A] int64); labels, boxes and indices are 0 where not foreground.
        """
        batch, num_anchors, num_classes = pred_scores.shape
        num_gts = gt_boxes.shape[1]
        device = pred_scores.device
        if num_gts == 0:
            return (torch.zeros(batch, num_anchors, dtype=torch.long, device=device),
                    torch.zeros(batch, num_anchors, 4, device=device),
                    torch.zeros(batch, num_anchors, num_classes, device=device),
                    torch.zeros(batch, num_anchors, dtype=torch.bool, device=device),
                    torch.zeros(batch, num_anchors, dtype=torch.long, device=device))
        pred_scores, pred_boxes, gt_boxes = pred_scores.float(), pred_boxes.float(), gt_boxes.float()
        gt_labels = gt_labels.long().clamp(0, num_classes - 1)  # padding rows may hold anything; gt_mask hides them

        # candidates: anchor centre strictly inside a real gt box, [B, M, A]
        x, y = anchor_points[:, 0], anchor_points[:, 1]
        g = gt_boxes[..., None, :]  # [B, M, 1, 4]
        margin = torch.minimum(torch.minimum(x - g[..., 0], y - g[..., 1]), torch.minimum(g[..., 2] - x, g[..., 3] - y))
        inside = margin > self.eps
        candidate = inside & gt_mask[..., None].bool()

        # alignment metric of each (gt, anchor) candidate pair
        iou = pairwise_box_iou(gt_boxes, pred_boxes) * candidate
        index = gt_labels[..., None].expand(batch, num_gts, num_anchors)
        class_score = pred_scores.transpose(1, 2).gather(1, index)  # [B, M, A]: predicted prob of the gt's class
        metric = class_score.pow(self.alpha) * iou.pow(self.beta) * candidate

        # top-k candidates per gt; non-candidates rank last (-1) and are removed again after the top-k
        k = min(self.topk, num_anchors)
        top = metric.masked_fill(~candidate, -1.0).topk(k, dim=-1).indices
        positive = torch.zeros_like(candidate).scatter_(-1, top, True) & candidate

        # an anchor positive for several gts keeps the one with the highest IoU among them
        multiple = positive.sum(1, keepdim=True) > 1  # [B, 1, A]
        best = (iou * positive).argmax(1, keepdim=True)  # [B, 1, A]
        only_best = torch.zeros_like(positive).scatter_(1, best, True)
        positive = torch.where(multiple, only_best & positive, positive)

        foreground = positive.any(1)  # [B, A]
        target_gt_index = positive.float().argmax(1) * foreground  # [B, A]; 0 for background
        target_labels = gt_labels.gather(1, target_gt_index) * foreground
        target_boxes = gt_boxes.gather(1, target_gt_index[..., None].expand(batch, num_anchors, 4))
        target_boxes = target_boxes * foreground[..., None]

        # soft targets: metric normalised per gt so that its best anchor reaches its best IoU
        metric = metric * positive
        max_metric = metric.amax(-1, keepdim=True)  # [B, M, 1]
        max_iou = (iou * positive).amax(-1, keepdim=True)
        quality = (metric * max_iou / (max_metric + self.eps)).amax(1)  # [B, A]; one positive gt per anchor
        target_scores = F.one_hot(target_labels, num_classes).float() * (quality * foreground)[..., None]
        return target_labels, target_boxes, target_scores, foreground, target_gt_index


def targets_to_padded(targets: torch.Tensor, batch_size: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, 6] rows (batch_index, class, x1, y1, x2, y2) -> (labels [B, M] int64, boxes [B, M, 4], mask [B, M] bool),
    M the most objects in one image (0 when T == 0); rows beyond an image's objects are padding (mask False)."""
    targets = targets.to(device=device, dtype=torch.float32).reshape(-1, 6)
    image = targets[:, 0].long()
    counts = torch.bincount(image, minlength=batch_size)
    if counts.numel() > batch_size:
        raise ValueError(f"targets name image {int(image.max())} but the batch has {batch_size} images")
    num_gts = int(counts.max()) if targets.shape[0] else 0
    labels = torch.zeros(batch_size, num_gts, dtype=torch.long, device=device)
    boxes = torch.zeros(batch_size, num_gts, 4, device=device)
    mask = torch.zeros(batch_size, num_gts, dtype=torch.bool, device=device)
    if num_gts:
        order = torch.argsort(image, stable=True)
        image, targets = image[order], targets[order]
        first = torch.cumsum(counts, 0) - counts  # row of each image's first object in sorted order
        slot = torch.arange(targets.shape[0], device=device) - first[image]
        labels[image, slot] = targets[:, 1].long()
        boxes[image, slot] = targets[:, 2:6]
        mask[image, slot] = True
    return labels, boxes, mask


def distribution_focal_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """DFL: cross-entropy towards the two bins around a continuous target, weighted by closeness.
    logits [N, 4, reg_max], target [N, 4] in bins (within [0, reg_max - 1)) -> [N] mean over the four sides."""
    left = target.long()
    right = left + 1
    weight_left = right.float() - target
    weight_right = 1.0 - weight_left
    reg_max = logits.shape[-1]
    flat = logits.reshape(-1, reg_max)
    loss = (F.cross_entropy(flat, left.reshape(-1), reduction="none").view(left.shape) * weight_left
            + F.cross_entropy(flat, right.reshape(-1), reduction="none").view(left.shape) * weight_right)
    return loss.mean(-1)


class DetectionLoss:
    """YOLOv8-style detection loss on Detector's raw outputs.

    loss, parts = DetectionLoss(num_classes)(outputs, targets); targets: [T, 6] rows (batch_index, class, x1, y1, x2,
    y2) in input-image pixels, T may be 0. `loss` = box_weight * box + cls_weight * cls + dfl_weight * dfl, a float32
    scalar; `parts` = dict(box, cls, dfl) holds those three weighted terms, detached (they sum to `loss`).
    """

    def __init__(self, num_classes: int, strides: tuple[int, ...] = (8, 16, 32), reg_max: int = 16,
                 box_weight: float = 7.5, cls_weight: float = 0.5, dfl_weight: float = 1.5):
        self.num_classes = num_classes
        self.strides = tuple(strides)
        self.reg_max = reg_max
        self.box_weight, self.cls_weight, self.dfl_weight = box_weight, cls_weight, dfl_weight
        self.assigner = TaskAlignedAssigner(num_classes, topk=10, alpha=0.5, beta=6.0)

    def __call__(self, outputs: list[torch.Tensor], targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # float32 throughout: the outputs may come from a bf16/fp16 autocast forward
        box_logits, cls_logits = flatten_outputs(outputs, self.reg_max)  # [B, A, 4, R], [B, A, C]
        batch_size = box_logits.shape[0]  # from the outputs: an image without objects has no row in targets
        anchor_points, stride_tensor = make_anchors(outputs, self.strides)  # pixels, [A, 2] and [A, 1]
        distances = dfl_distances(box_logits)  # [B, A, 4] in grid units of each anchor's level
        pred_boxes = distances_to_boxes(distances * stride_tensor, anchor_points)  # pixels

        gt_labels, gt_boxes, gt_mask = targets_to_padded(targets, batch_size, box_logits.device)
        classes = gt_labels[gt_mask]
        if classes.numel() and not (0 <= int(classes.min()) and int(classes.max()) < self.num_classes):
            raise ValueError(f"target classes must lie in [0, {self.num_classes}); got {classes.unique().tolist()}")
        _, target_boxes, target_scores, foreground, _ = self.assigner(
            cls_logits.detach().sigmoid(), pred_boxes.detach(), anchor_points, gt_labels, gt_boxes, gt_mask)
        target_scores_sum = target_scores.sum().clamp(min=1.0)

        cls_loss = F.binary_cross_entropy_with_logits(cls_logits, target_scores, reduction="sum") / target_scores_sum

        # box and DFL terms on foreground anchors, each weighted by its target score (its assignment quality)
        weight = target_scores.sum(-1)[foreground]  # [N]
        box_loss = (complete_box_iou_loss(pred_boxes[foreground], target_boxes[foreground], reduction="none")
                    * weight).sum() / target_scores_sum
        strides_fg = stride_tensor.expand(batch_size, -1, -1)[foreground]  # [N, 1]
        anchors_fg = anchor_points.expand(batch_size, -1, -1)[foreground]  # [N, 2]
        target_fg = target_boxes[foreground]
        target_distances = torch.cat((anchors_fg - target_fg[:, :2], target_fg[:, 2:] - anchors_fg), dim=-1)
        target_distances = (target_distances / strides_fg).clamp(0, self.reg_max - 1 - 0.01)  # right bin in range
        dfl = distribution_focal_loss(box_logits[foreground], target_distances)
        dfl_loss = (dfl * weight).sum() / target_scores_sum

        box_term = self.box_weight * box_loss
        cls_term = self.cls_weight * cls_loss
        dfl_term = self.dfl_weight * dfl_loss
        loss = box_term + cls_term + dfl_term
        return loss, dict(box=box_term.detach(), cls=cls_term.detach(), dfl=dfl_term.detach())

