"""The detector with its box decoding and NMS inside, what `--export onnx` and `--export
torchscript` write: images in, detections out, so the file deploys without this recipe's Python.

    detections, counts = EndToEnd(model, conf_threshold=0.25, iou_threshold=0.7,
    max_detections=300)(images)

Input: images float32 [B, 3, H, W] in [0, 1], H and W multiples of 32. Outputs, a fixed layout per
image: `detections` [B, max_detections, 6], each row x1, y1, x2, y2 (input pixels, clipped to the
image), score, class id, best score first; the rows past `num_detections` [B] (int64) are zeros. The
same steps as yolo_model.postprocess for --predict: one class a box (its best), scores above
conf_threshold, NMS within each class at iou_threshold (one torchvision.ops.nms over class-offset
boxes, which ONNX writes as its NonMaxSuppression), the best max_detections of each image. Every
step is a tensor operation of the whole batch (no loop over images, no value read on the host), so
one trace serves any batch and image size.
"""

import torch
from yolo_model import class_aware_nms, decode


class EndToEnd(torch.nn.Module):
    """A Detector followed by decoding and NMS in the graph; see the module's doc for the
    outputs."""

    def __init__(self, detector, conf_threshold: float, iou_threshold: float, max_detections: int):
        super().__init__()
        self.detector = detector
        self.conf_threshold = conf_threshold
        self.iou_threshold = iou_threshold
        self.max_detections = max_detections

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        detector = self.detector
        # [B, A, 4] and [B, A, C]
        boxes, cls_logits = decode(detector(images), detector.strides, detector.reg_max)
        scores, labels = cls_logits.sigmoid().max(dim=-1)  # one class a box, as --predict
        height, width = images.shape[-2], images.shape[-1]
        image, anchor = (scores > self.conf_threshold).nonzero(as_tuple=True)
        candidate_boxes, candidate_scores = boxes[image, anchor], scores[image, anchor]
        candidate_labels = labels[image, anchor]
        # NMS within each (image, class): a group of its own, shifted clear of the others; a decoded
        # side reaches at most (reg_max - 1) strides beyond the image
        reach = (detector.reg_max - 1) * max(detector.strides)
        groups = image * cls_logits.shape[-1] + candidate_labels
        # the sizes as tensors, so that a trace follows
        # them (a Python max would freeze the traced size)
        width_height = torch.stack((images.new_full((), width), images.new_full((), height)))
        span = width_height.max() + 2 * reach
        kept = class_aware_nms(candidate_boxes + reach, candidate_scores, groups, self.iou_threshold, span)
        # clipped to the image after NMS, as postprocess does
        limits = width_height.repeat(2)
        kept_boxes = torch.minimum(candidate_boxes[kept].clamp(min=0), limits)
        # The kept boxes as rows (box, score, class) and max_detections rows of zeros; each image's
        # best rows by a top-k over a [B, rows] table holding each kept score in its own image's row
        # and -1 elsewhere.
        kept_labels = candidate_labels[kept, None].float()
        rows = torch.cat((kept_boxes, candidate_scores[kept, None], kept_labels), dim=1)
        rows = torch.cat((rows, rows.new_zeros(self.max_detections, 6)))
        table = scores.new_full((scores.shape[0], rows.shape[0]), -1.0)
        table[image[kept], torch.arange(kept.shape[0], device=kept.device)] = candidate_scores[kept]
        best, columns = table.topk(self.max_detections, dim=1)
        found = best >= 0
        detections = rows[columns] * found[..., None]
        return detections, found.sum(dim=1)
