"""What the chat recipes (sft.py, grpo.py, dpo.py) report of a run: the settings it derived for
run_config, an evaluation in one line, and the summary table at the end with what was saved where.

Each recipe names its own figures (GRPO_SCORES, DPO_SUMMARY, ...); the formatting is written once.
"""

from pathlib import Path

from accelerate_recipes import print_summary
from accelerate_recipes.compiling import compile_summary_keys

from .model import model_facts, print_saved

# the evaluation figures each recipe prints in one line, in this order (those it has)
GRPO_SCORES = ("eval_reward", "eval_accuracy", "eval_sampled_reward", "eval_pass_at_1", "eval_pass_at_k")
SFT_SCORES = ("eval_loss", "eval_perplexity", "eval_exact_match")
DPO_SCORES = ("eval_loss", "eval_reward_margin", "eval_reward_accuracy", "eval_logp_accuracy")

# the rows of each recipe's summary table; what the compiled blocks did follows them
RUN_ROWS = ("dataset", "model", "method")
LAUNCH_ROWS = ("world_size", "num_machines", "mixed_precision", "global_batch_size")
SFT_SUMMARY = (
    *RUN_ROWS,
    *LAUNCH_ROWS,
    "steps",
    "epochs",
    "eval_loss",
    "eval_perplexity",
    "eval_exact_match",
    "best_metric",
    "best_epoch",
    "train_tokens_per_second",
    "train_target_tokens_per_second",
    "peak_memory_mb",
    "wall_seconds",
)
GRPO_SUMMARY = (
    *RUN_ROWS,
    *LAUNCH_ROWS,
    "num_generations",
    "steps",
    "epochs",
    "eval_reward",
    "eval_accuracy",
    "eval_sampled_reward",
    "eval_pass_at_1",
    "eval_pass_at_k",
    "best_metric",
    "best_step",
    "decode_mode",
    "generation_tokens_per_second",
    "train_tokens_per_second",
    "first_step_generation_seconds",
    "peak_memory_mb",
    "wall_seconds",
)
DPO_SUMMARY = (
    *RUN_ROWS,
    "loss_type",
    "beta",
    *LAUNCH_ROWS,
    "steps",
    "epochs",
    "eval_loss",
    "eval_reward_margin",
    "eval_reward_accuracy",
    "eval_logp_accuracy",
    "best_metric",
    "best_epoch",
    "train_tokens_per_second",
    "peak_memory_mb",
    "wall_seconds",
)


def run_settings(args, dataset: str, model_name: str, lr: float, model, **own) -> dict:
    """What a run derived from its flags and data, for run_config (the tracker, checkpoints,
    results.json): the data's and the model's names, the model's facts (lora or full, its
    parameters, the library versions, the attention), the learning rate, then the recipe's `own`."""
    return dict(dataset=dataset, model=model_name, **model_facts(args, model), lr=lr, **own)


def scores_line(evaluation: dict, keys: tuple[str, ...]) -> str:
    """An evaluation in one line, the `keys` it has: `loss 0.6931, reward_margin 0.0000`."""
    return ", ".join(f"{k.removeprefix('eval_')} {evaluation[k]:.4f}" for k in keys if k in evaluation)


def print_run_summary(
    results: dict, path: Path, tracking, *, title: str, rows: tuple[str, ...], script: str
) -> None:
    """After training, on the main process: the summary table (`rows`, then what the compiled
    blocks did), what was saved where, and how to use it. `path`: the results.json written;
    `script`: the recipe's __file__."""
    print_summary(results, [*rows, *compile_summary_keys(results)], title=title)
    print_saved(results, path, tracking, script)
