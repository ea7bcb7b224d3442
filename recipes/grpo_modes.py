"""What grpo.py does when it does not train: --eval_only (--predict, --chat and --merge are the chat
recipes' shared ones, in chat/modes.py).

evaluate_saved_model takes the recipe's evaluation function, so that --eval_only and the
evaluations of a training run score the same way; this module does not import the recipe.
"""

import json
import time
from pathlib import Path

from accelerate.utils import set_seed
from chat import generation
from chat.conversations import dataset_name
from chat.grpo_setup import check_flags, load_validation_prompts, longest_prompt
from chat.model import SAMPLES_KEPT, load_any
from chat.rewards import Rewards
from chat.run_summary import GRPO_SCORES, scores_line

from accelerate_recipes import (
    check_launch,
    eval_only_config,
    eval_only_results,
    evaluation_accelerator,
    finish_run,
    prepare_output_dir,
)


def evaluate_saved_model(args, evaluate) -> None:
    """--eval_only: --model (default --output_dir; also a model before any GRPO) answers every
    validation prompt greedily; mean reward and accuracy to results.json in --output_dir. Any number
    of processes. `evaluate`: the recipe's evaluation, (accelerator, model, tokenizer, rows, rewards,
    args, batch) -> (scores, samples)."""
    started = time.perf_counter()
    args = check_flags(args)
    output = Path(args.output_dir)
    model_dir = args.model or args.output_dir
    rewards = Rewards(args.reward, args.reward_weights, args.answer_tag)
    accelerator = evaluation_accelerator(args)
    per_process = check_launch(accelerator, args.batch_size, args.gradient_accumulation_steps)
    set_seed(args.seed)
    prepare_output_dir(output)
    model, tokenizer = load_any(model_dir)  # a trained model, or one before any GRPO
    validation_rows = load_validation_prompts(accelerator, args, tokenizer, rewards)
    model = accelerator.prepare_model(model, evaluation_mode=True)
    rows = per_process * args.num_generations  # answered at once, as in training
    shape = generation.cache_shape(rows, longest_prompt(validation_rows), args.max_new_tokens)
    # one cache, one compilation, for them all
    generation.reserve_cache(accelerator, model, *shape, args.decode)
    evaluation, samples = evaluate(accelerator, model, tokenizer, validation_rows, rewards, args, rows)
    accelerator.print("\n".join(json.dumps(s, ensure_ascii=False) for s in samples[:SAMPLES_KEPT]))
    accelerator.print(
        f"{scores_line(evaluation, GRPO_SCORES)} on {evaluation['eval_samples']} validation prompts"
    )
    config = eval_only_config(
        "grpo",
        args,
        accelerator,
        dataset=dataset_name(args),
        model=model_dir,
        rewards=rewards.names,
        max_new_tokens=args.max_new_tokens,
    )
    results = eval_only_results(config, accelerator, started, evaluation)
    path = finish_run(accelerator, output, results)
    if accelerator.is_main_process:
        print(f"{path.name} saved in {output}")
