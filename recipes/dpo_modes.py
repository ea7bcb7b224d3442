"""What dpo.py does when it does not train: --eval_only (--predict, --chat and --merge are the chat
recipes' shared ones, in chat/modes.py).

evaluate_saved_model takes the recipe's evaluation function, so that --eval_only and the
evaluations of a training run measure the same figures; this module does not import the recipe.
"""

import json
import time
from pathlib import Path

from accelerate.utils import set_seed
from chat.conversations import dataset_name
from chat.dpo_setup import check_flags, load_pair_splits, pair_loaders, validation_answers
from chat.model import BASE, SAMPLES_KEPT, is_adapter, load_any
from chat.packing import check_packing
from chat.run_summary import DPO_SCORES, scores_line

from accelerate_recipes import (
    RecipeError,
    check_launch,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    finish_run,
    prepare_output_dir,
)


def evaluate_saved_model(args, evaluate) -> None:
    """--eval_only: --model (default --output_dir) on every validation pair against
    --reference_model (default: an adapter's base); the figures to results.json in --output_dir. Any
    number of processes, each pair once. `evaluate`: the recipe's evaluation, (accelerator, model,
    reference, loader, args, stored reference) -> {eval_<figure>: value}."""
    started = time.perf_counter()
    check_flags(args)
    output = Path(args.output_dir)
    model_dir = args.model or args.output_dir
    accelerator = evaluation_accelerator(args)
    per_process = check_launch(accelerator, args.batch_size, args.gradient_accumulation_steps)
    set_seed(args.seed)
    prepare_output_dir(output)
    if not args.reference_model and not is_adapter(model_dir):
        raise RecipeError(
            f"--model {model_dir} is a whole model: give --reference_model (the model it was tuned "
            "from) to measure its rewards against"
        )
    model, tokenizer = load_any(model_dir)
    splits, _ = load_pair_splits(accelerator, args, tokenizer)
    _, eval_loader = pair_loaders(accelerator, args, tokenizer, splits, per_process)
    reference = BASE
    if args.reference_model:
        reference = load_any(args.reference_model)[0].eval().requires_grad_(False).to(accelerator.device)
    # the loaded models' attention (sdpa unless saved otherwise) must keep packed sequences apart
    if args.packing:
        check_packing(model)
        if reference is not BASE:
            check_packing(reference)
    # evaluation_mode: no DDP wrapper, which refuses a
    # model without trainable weights (a loaded adapter)
    model, eval_loader = (
        accelerator.prepare_model(model, evaluation_mode=True),
        accelerator.prepare(eval_loader),
    )
    evaluation = evaluate(accelerator, model, reference, eval_loader, args, None)
    if args.eval_generate:
        samples = validation_answers(accelerator, model, tokenizer, splits["validation"], args)
        accelerator.print("\n".join(json.dumps(s, ensure_ascii=False) for s in samples[:SAMPLES_KEPT]))
    accelerator.print(
        f"{scores_line(evaluation, DPO_SCORES)} on {evaluation['eval_samples']} validation pairs"
    )
    config = eval_only_config(
        "dpo",
        args,
        accelerator,
        dataset=dataset_name(args),
        model=model_dir,
        reference_model=args.reference_model or "the adapter's base",
        loss_type=args.loss_type,
        beta=args.beta,
        validation_size=len(splits["validation"]),
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print(f"{path.name} saved in {output}")
