"""What text_classification.py does when it does not train: --eval_only and --predict; and an
evaluation in one line, which training prints too."""

import json
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from text_classification_data import (
    FILE_FORMATS,
    data_loaders,
    dataset_name,
    glue_task,
    load_data,
    load_file,
    load_model,
)
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from accelerate_recipes import (
    RecipeError,
    check_launch_flags,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    finish_run,
    prepare_output_dir,
)


def scores_line(evaluation: dict) -> str:
    """An evaluation in one line: `accuracy 0.8125, loss 0.4312, f1 0.8000`."""
    return ", ".join(
        f"{k.removeprefix('eval_')} {v:.4f}" for k, v in evaluation.items() if k != "eval_samples"
    )


def read_texts(source, text_column: str, text_pair_column: str | None) -> list[tuple[str, str | None]]:
    """Texts to classify: a .txt file (one per line), a .csv/.tsv/.json/.jsonl file (its text
    column), or the text itself."""
    items = source if isinstance(source, (list, tuple)) else [source]
    texts = []
    for item in map(str, items):
        path = Path(item).expanduser()
        if path.suffix.lower() in FILE_FORMATS and path.is_file():
            data = load_file(str(path), "predict", cache_dir=None, flag="--predict")
            for column in filter(None, (text_column, text_pair_column)):
                if column not in data.column_names:
                    raise RecipeError(
                        f"{path} has no column {column!r} to classify; its columns are "
                        f"{', '.join(data.column_names)} (set --text_column)"
                    )
            pairs = data[text_pair_column] if text_pair_column else [None] * len(data)
            texts += list(zip(data[text_column], pairs))
        elif path.suffix.lower() == ".txt" and path.is_file():
            texts += [(line, None) for line in path.read_text().splitlines() if line.strip()]
        else:
            texts.append((item, None))
    return texts


def check_fine_tuned(model_dir: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        raise RecipeError(
            f"--model {model_dir} is not a fine-tuned model directory (no config.json); train first "
            "or point --model at the output_dir of a finished run"
        )


def check_labels(model_dir: str, label_names: list[str]) -> None:
    """--eval_only: the data's labels, in id order, must be the ones the model was fine-tuned on."""
    trained = [str(name) for _, name in sorted(AutoConfig.from_pretrained(model_dir).id2label.items())]
    if trained != label_names:
        raise RecipeError(
            f"--model {model_dir} was fine-tuned on the labels {trained[:10]} and the data has "
            f"{label_names[:10]}; evaluate it with the data flags of its training run"
        )


def predict(args) -> None:
    """--predict: classify texts with the fine-tuned model in --model (default --output_dir) in this
    one process and print one JSON line per text: text, label, score."""
    model_dir = args.model or args.output_dir
    check_fine_tuned(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(device).eval()
    texts = read_texts(args.predict, args.text_column, args.text_pair_column)
    with torch.no_grad():  # inference only: no graph kept for a backward pass
        for start in range(0, len(texts), args.batch_size):
            chunk = texts[start : start + args.batch_size]
            firsts = [t for t, _ in chunk]
            seconds = [p for _, p in chunk] if args.text_pair_column else None
            inputs = tokenizer(
                firsts,
                seconds,
                truncation=True,
                max_length=args.max_length,
                padding=True,
                return_tensors="pt",
            )
            probabilities = model(**inputs.to(device)).logits.float().softmax(dim=-1)
            scores, ids = probabilities.max(dim=-1)
            for (text, pair), label_id, score in zip(chunk, ids.tolist(), scores.tolist()):
                row = {
                    "text": text,
                    **({"text_pair": pair} if pair is not None else {}),
                    "label": model.config.id2label[label_id],
                    "score": round(score, 4),
                }
                print(json.dumps(row, ensure_ascii=False))


def evaluate_saved_model(args, evaluate) -> None:
    """--eval_only: the fine-tuned model in --model (default --output_dir) on the whole validation
    split of the data flags, each example counted once, on any number of processes; results.json
    goes to --output_dir. `evaluate`: text_classification.py's, the evaluation of training."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    model_dir = args.model or args.output_dir
    check_fine_tuned(model_dir)
    task = glue_task(args)
    # No tracker: the results are in results.json and the output.
    accelerator = evaluation_accelerator(args, accumulation_steps=args.gradient_accumulation_steps)
    per_process = check_launch_flags(accelerator, args)
    set_seed(args.seed)
    prepare_output_dir(output)

    data = load_data(accelerator, args, task, model_dir)
    check_labels(model_dir, data.label_names)
    model = load_model(model_dir, data.label_names, task)
    _, eval_loader = data_loaders(accelerator, args, data, per_process)
    model, eval_loader = accelerator.prepare(model, eval_loader)
    evaluation = evaluate(model, eval_loader, accelerator, data.extra_metric, len(data.label_names))
    accelerator.print(f"{scores_line(evaluation)} on {evaluation['eval_samples']} validation examples")

    config = eval_only_config(
        "text_classification",
        args,
        accelerator,
        dataset=dataset_name(args),
        model=model_dir,
        validation_size=len(data.raw["validation"]),
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print(f"{path.name} saved in {output}")
