"""What sft.py does when it does not train: --eval_only and --plan_only (--predict, --chat and
--merge are the chat recipes' shared ones, in chat/modes.py)."""

import json
import time
from pathlib import Path

from accelerate.utils import set_seed
from chat.answer_loss import use_answer_loss
from chat.generation import check_generation
from chat.memory_plan import print_plan
from chat.model import DEFAULT_MODEL, SAMPLES_KEPT, build_model, generate_answers, load_fine_tuned
from chat.run_summary import SFT_SCORES, scores_line
from sft_data import data_loaders, dataset_name, launch_flags, load_data

from accelerate_recipes import (
    check_launch,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    finish_run,
    prepare_output_dir,
)


def evaluate_saved_model(args, evaluate) -> None:
    """--eval_only: the model in --model (default --output_dir) on the whole validation split of the
    data flags, each conversation counted once, on any number of processes; results.json goes to
    --output_dir. `evaluate`: sft.py's, the evaluation of training."""
    started = time.perf_counter()
    output = Path(args.output_dir)
    model_dir = args.model or args.output_dir
    accelerator = evaluation_accelerator(args)
    per_process = check_launch(accelerator, args.batch_size, args.gradient_accumulation_steps)
    check_generation(accelerator, args.eval_generate)
    set_seed(args.seed)
    prepare_output_dir(output)

    model, tokenizer = load_fine_tuned(model_dir)
    use_answer_loss(model)
    raw, tokenized, _ = load_data(accelerator, args, tokenizer)
    _, eval_loader, _ = data_loaders(accelerator, args, tokenizer, tokenized, per_process)
    # evaluation_mode: no DDP wrapper, which refuses a
    # model without trainable weights (a loaded adapter)
    model, eval_loader = (
        accelerator.prepare_model(model, evaluation_mode=True),
        accelerator.prepare(eval_loader),
    )
    evaluation = evaluate(model, eval_loader, accelerator)
    if args.eval_generate:
        conversations = raw["validation"]["messages"][: args.eval_generate]
        answering = (model, tokenizer, conversations, accelerator, args.max_new_tokens, 8, args.decode)
        scores, samples = generate_answers(*answering)
        evaluation.update(scores)
        accelerator.print("\n".join(json.dumps(s, ensure_ascii=False) for s in samples[:SAMPLES_KEPT]))
    accelerator.print(
        f"{scores_line(evaluation, SFT_SCORES)} on {evaluation['eval_samples']} validation conversations"
    )

    config = eval_only_config(
        "sft",
        args,
        accelerator,
        dataset=dataset_name(args),
        model=model_dir,
        validation_size=len(tokenized["validation"]),
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print(f"{path.name} saved in {output}")


def plan_only(args) -> None:
    """--plan_only: the memory plan of the run these flags describe, on its launch (or the one
    --plan_* assume), from the model's config alone; nothing is loaded, trained or written."""
    accelerator = evaluation_accelerator(args)
    args, _ = launch_flags(args, accelerator)
    per_process = check_launch(accelerator, args.batch_size, args.gradient_accumulation_steps)
    model = build_model(args, args.model or DEFAULT_MODEL, accelerator, meta=True)
    print_plan(accelerator, args, model, per_process)
    accelerator.end_training()
