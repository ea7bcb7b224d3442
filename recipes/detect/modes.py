"""What train.py does when it does not train: --eval_only, --predict and --export.

Each uses a saved model, the one in --model (default --output_dir): evaluate_saved_model measures
its COCO mAP with the recipe's own evaluation function (train.py's evaluate, handed in, so that
this module does not import the recipe), predict runs predict.py's detect_images and export runs
onnx_export.py's export_model.
"""

import json
import os
import time
from pathlib import Path

from accelerate.utils import set_seed
from detection_report import print_results
from detector_files import MODEL_CONFIG, build_model, read_model_config
from eval_pictures import save_eval_pictures
from flag_checks import PREDICT_CONF_THRESHOLD, check_flags, eval_conf_threshold

# imports onnx and onnxruntime (the export extra) when it runs
from onnx_export import export_model
from predict import detect_images
from torch.utils.data import DataLoader
from yolo_data import cache_in_memory
from yolo_loaders import loader_settings, read_dataset, validation_set

from accelerate_recipes import (
    RecipeError,
    check_launch_flags,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    finish_run,
    prepare_output_dir,
    setup_tracker,
)

# the file each --export writes in --output_dir
EXPORT_FILES = {"onnx": "model.onnx", "torchscript": "model.torchscript", "onnx-raw": "model_raw.onnx"}


def evaluate_saved_model(args, evaluate) -> None:
    """The model in --model (default --output_dir) on the val split of --data: COCO mAP in
    results.json, and the evaluation's pictures, in --output_dir. Any number of processes; each
    image is counted once. `evaluate` is train.py's: (model, loader, accelerator, names, args) ->
    (figures, pictures)."""
    started = time.perf_counter()
    output, model_dir = Path(args.output_dir), Path(args.model or args.output_dir)
    check_flags(args)
    saved = read_model_config(model_dir)
    image_size = args.image_size or saved["image_size"]
    tracking = setup_tracker(
        args.tracker, output, args.run_name or f"detect-{saved['size']}", args.swanlab_mode
    )
    accumulation = args.gradient_accumulation_steps
    accelerator = evaluation_accelerator(args, accumulation_steps=accumulation, tracking=tracking)
    per_process = check_launch_flags(accelerator, args)
    set_seed(args.seed)
    prepare_output_dir(output)

    data_yaml, dataset = read_dataset(args, image_size, accelerator)
    names = dataset.names
    if len(names) != saved["num_classes"]:
        raise RecipeError(
            f"--model {model_dir} detects {saved['num_classes']} classes and {data_yaml} has "
            f"{len(names)}: evaluate it on data with the same classes"
        )
    if args.split == "test" and not dataset.test:
        raise RecipeError(
            f"--split test: {data_yaml} has no test split; add one to it (test: images/test, a "
            "folder or a list of images like val), or evaluate --split val"
        )
    files = dataset.test if args.split == "test" else dataset.val
    cache = cache_in_memory(args.cache, len(files), image_size)
    val_set = validation_set(dataset, image_size, cache, args.split)
    val_loader = DataLoader(
        val_set,
        batch_size=per_process * args.gradient_accumulation_steps,
        **loader_settings(accelerator, args.num_workers),
    )
    model, info = build_model(
        saved["size"],
        len(names),
        args.channels_last,
        model_dir,
        flag="--model",
        cls_width=saved.get("cls_width"),
    )
    # on the device, no DDP wrapper: nothing to sync
    model = accelerator.prepare_model(model, evaluation_mode=True)
    # sharded, boxes on the host
    val_loader = accelerator.prepare_data_loader(val_loader, device_placement=False)

    config = eval_only_config(
        "detect",
        args,
        accelerator,
        dataset=str(data_yaml),
        model=f"yolo-{saved['size']}",
        model_dir=str(model_dir),
        per_process_batch_size=per_process,
        trainable_parameters=info["parameters"],
        gflops_at_640=info["gflops"],
        image_size=image_size,
        num_classes=len(names),
        conf_threshold=eval_conf_threshold(args),
        iou_threshold=args.iou_threshold,
        split=args.split,
        val_size=len(val_set),
        distributed_type=accelerator.distributed_type.value,
        synthetic_data=args.data == "synthetic",
    )
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs)
    model = accelerator.unwrap_model(model)
    evaluation, pictures = evaluate(model, val_loader, accelerator, names, args)
    accelerator.log(
        {"eval/map50": evaluation["eval_map50"], "eval/map50_95": evaluation["eval_map50_95"]}, step=0
    )
    results = eval_only_results(dict(config, epochs=0), accelerator, started, evaluation)
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        # the evaluated model's, as a run leaves it
        (output / MODEL_CONFIG).write_text(json.dumps(saved, indent=2))
        if args.plots:  # PR_curve, confusion_matrix, val_predictions (.png)
            save_eval_pictures(output, pictures, names)
        print_results(results, output, path, tracking)


def predict(args) -> None:
    """Detect objects with the model in --model (default --output_dir) in the images --predict
    names: one JSON line per image on stdout; each image drawn with its boxes, and detections.json,
    in --predict_dir. One process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("--predict runs in one process: start it with python, not a launcher")
    check_flags(args)
    detect_images(
        Path(args.model or args.output_dir),
        args.predict,
        out=args.predict_dir,
        conf_threshold=PREDICT_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold,
        iou_threshold=args.iou_threshold,
        image_size=args.image_size,
        device=args.predict_device,
    )


def export(args) -> None:
    """The model in --model (default --output_dir) as a file that deploys in --output_dir:
    model.onnx (end to end), model.torchscript (end to end) or model_raw.onnx (the network alone),
    checked against PyTorch. One process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("--export runs in one process: start it with python, not a launcher")
    check_flags(args)
    export_model(
        Path(args.model or args.output_dir),
        Path(args.output_dir) / EXPORT_FILES[args.export],
        args.export,
        image_size=args.image_size,
        conf_threshold=PREDICT_CONF_THRESHOLD if args.conf_threshold is None else args.conf_threshold,
        iou_threshold=args.iou_threshold,
    )
