"""From --data to the DataLoaders: the data.yaml (a file, the generated shapes set, or a dataset
downloaded on first use), the augmented training split and the validation split, the batch fitted
to a small set, and the loaders train.py prepares and modes.py's --eval_only reads."""

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from synthetic_shapes import write_synthetic_dataset
from torch.utils.data import DataLoader, Dataset
from yolo_data import (
    DataConfig,
    FilledEpochSampler,
    YoloDataset,
    cache_in_memory,
    collate,
    download_dataset,
    load_data_config,
)

from accelerate_recipes import RecipeError, cpu_threads_and_workers
from accelerate_recipes.seeding import SeededAugmentation


@dataclass(frozen=True)
class TrainingData:
    """What a training run reads: --data's data.yaml, its class names, the augmented training split
    and the validation split."""

    data_yaml: Path
    names: list[str]
    train_set: Dataset
    val_set: YoloDataset


def resolve_data(
    data: str, data_dir: str, synthetic_size: int, image_size: int, seed: int, accelerator
) -> Path:
    """Path of the data.yaml for --data: a file, `synthetic` (generated here) or a dataset we know
    how to download."""
    if data == "synthetic":
        folder = Path(data_dir) / f"shapes-{synthetic_size}-{image_size}px-seed{seed}"
        # one writer per node; the others then read its files
        with accelerator.local_main_process_first():
            if not (folder / "data.yaml").exists() and accelerator.is_local_main_process:
                write_synthetic_dataset(
                    folder,
                    num_train=synthetic_size,
                    num_val=max(8, synthetic_size // 4),
                    image_size=image_size,
                    seed=seed,
                )
        return folder / "data.yaml"
    if not data.endswith((".yaml", ".yml")):
        with accelerator.local_main_process_first():
            return download_dataset(data, Path(data_dir), download=accelerator.is_local_main_process)
    return Path(data)


def read_dataset(args, image_size: int, accelerator) -> tuple[Path, DataConfig]:
    """--data's data.yaml and what it says: each split's images and the class names. Says so loudly
    for generated shapes."""
    data_yaml = resolve_data(
        args.data, args.data_dir, args.synthetic_size, image_size, args.seed, accelerator
    )
    dataset = load_data_config(data_yaml)
    if args.data == "synthetic":
        accelerator.print(
            "!" * 100 + "\n!! SYNTHETIC DATA: generated shapes, not a real dataset. mAP here measures "
            "the pipeline, not the detector on real images.\n" + "!" * 100
        )
    return data_yaml, dataset


def training_data(args, image_size: int, accelerator) -> TrainingData:
    """--data's data.yaml, its class names, the augmented training split and the validation
    split."""
    data_yaml, dataset = read_dataset(args, image_size, accelerator)
    names = dataset.names
    cache = cache_in_memory(args.cache, len(dataset.train) + len(dataset.val), image_size)
    # Augmentation seeded per (seed, epoch, image): a resumed
    # run, or one with another worker count, augments alike.
    train_set = SeededAugmentation(
        YoloDataset(
            dataset.train,
            len(names),
            image_size=image_size,
            augment=True,
            mosaic=args.mosaic,
            flip_lr=args.flip_lr,
            flip_ud=args.flip_ud,
            hsv=tuple(float(v) for v in args.hsv),
            scale=args.scale,
            cache=cache,
        ),
        args.seed,
    )
    return TrainingData(data_yaml, names, train_set, validation_set(dataset, image_size, cache))


def fit_batch_to_data(args, per_process: int, train_size: int, accelerator) -> tuple:
    """--batch_size larger than the training set is lowered to the set's size (rounded down to a
    multiple of the processes x accumulation steps), with a note; the flags with the batch trained
    on (a copy: the parsed flags stay as they are), and its per-process share."""
    shards = accelerator.num_processes * args.gradient_accumulation_steps
    if args.batch_size <= train_size:
        return args, per_process
    lowered = train_size // shards * shards
    if lowered == 0:
        raise RecipeError(
            f"the training set ({train_size} images) is smaller than {shards} (processes x "
            "accumulation steps); use more images, fewer processes or fewer "
            "--gradient_accumulation_steps"
        )
    accelerator.print(
        f"note: --batch_size {args.batch_size} is larger than the training set ({train_size} "
        f"images): training with --batch_size {lowered}"
    )
    return replace(args, batch_size=lowered), lowered // shards


def data_loaders(
    args, train_set: Dataset, val_set: Dataset, per_process: int, accelerator
) -> tuple[DataLoader, DataLoader]:
    """The training loader (every image once an epoch, shuffled by seed and epoch, the last batch
    filled up: FilledEpochSampler) and the validation loader (a whole optimizer step's images per
    batch)."""
    loader_args = loader_settings(accelerator, args.num_workers)
    train_loader = DataLoader(
        train_set,
        batch_size=per_process,
        sampler=FilledEpochSampler(len(train_set), args.batch_size, args.seed),
        drop_last=True,  # never drops: the sampler's length is a multiple of the global batch
        **loader_args,
    )
    val_loader = DataLoader(val_set, batch_size=per_process * args.gradient_accumulation_steps, **loader_args)
    return train_loader, val_loader


def validation_set(dataset: DataConfig, image_size: int, cache: bool, split: str = "val") -> YoloDataset:
    """The val (or test) split, letterboxed to image_size and not augmented; every label is checked
    here, up front."""
    files = dataset.test if split == "test" else dataset.val
    return YoloDataset(files, len(dataset.names), image_size=image_size, augment=False, cache=cache)


def loader_settings(accelerator, num_workers: int | None) -> dict:
    """The DataLoader arguments every loader here shares (on the CPU this also gives torch's threads
    the cores)."""
    num_workers = cpu_threads_and_workers(accelerator, num_workers)
    return dict(
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
