"""The detector's flag values no mode can start with, refused before anything else happens, and
--conf_threshold's default in each mode: what train.py and modes.py both check and read."""

from yolo_model import FREEZABLE

from accelerate_recipes import RecipeError

# --conf_threshold's default: low for mAP, higher for use
EVAL_CONF_THRESHOLD, PREDICT_CONF_THRESHOLD = 0.001, 0.25


def eval_conf_threshold(args) -> float:
    """--conf_threshold of an evaluation (a training run's or --eval_only's): EVAL_CONF_THRESHOLD
    unless given."""
    return EVAL_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold


def check_flags(args) -> None:
    """The flags' values (train.py's DetectFlags) a run cannot start with, refused before anything
    else happens."""
    if args.image_size is not None and (args.image_size % 32 or args.image_size < 64):
        raise RecipeError(
            f"--image_size {args.image_size} must be a multiple of 32 and at least 64 (the head's "
            "largest stride is 32); e.g. --image_size 640"
        )
    if args.close_mosaic < 0:
        raise RecipeError(
            f"--close_mosaic {args.close_mosaic} must be >= 0 (epochs at the end without mosaic)"
        )
    if isinstance(args.freeze, bool) or not isinstance(args.freeze, int) or not 0 <= args.freeze <= FREEZABLE:
        raise RecipeError(
            f"--freeze {args.freeze}: give the number of YOLOv8 layers to keep fixed, 0 to "
            f"{FREEZABLE} (10: the backbone)"
        )
    if args.patience is not None and args.early_stopping_patience:
        raise RecipeError(
            "give --patience (epochs) or --early_stopping_patience (evaluations), not both; e.g. "
            "--patience 50"
        )
    whole = isinstance(args.patience, int) and not isinstance(args.patience, bool) and args.patience >= 0
    if args.patience is not None and not whole:
        raise RecipeError(
            f"--patience {args.patience}: give a whole number of epochs, 0 to turn early stopping off"
        )
    if args.max_grad_norm < 0:
        raise RecipeError(
            f"--max_grad_norm {args.max_grad_norm} must be >= 0 (0 turns clipping off); e.g. "
            "--max_grad_norm 10"
        )
