"""The text-classification recipe fine-tunes a real (tiny) BERT on CSV / JSONL files, alone and over
gloo."""

import json

import pytest
import torch
from conftest import (
    ACCELERATE,
    CONFIGS,
    NAN_GRADIENT,
    NO_PLOTS,
    PYTHON,
    TEXT_FAST,
    TEXT_RUN,
    TEXT_SCRIPT,
    assert_both_ranks_quiet,
    assert_nonfinite_gradients_handled,
    assert_quiet,
    check,
    check_png,
    fails_with,
    losses,
    read_audit,
    read_metrics,
    read_results,
    recipe_env,
    run,
    sentiment_rows,
    sigkill_mid_epoch_then_resume,
    text_files,
    write_rows,
)
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode
from transformers import AttentionMaskInterface, AutoModelForSequenceClassification, AutoTokenizer

from accelerate_recipes import always_build_attention_masks

# 256 training rows at a global batch of 16: 16 steps per epoch; lr 3e-3 suits a randomly
# initialised tiny model.
FAST = [*TEXT_FAST, *NO_PLOTS]
CONTRACT = [
    "recipe",
    "world_size",
    "num_machines",
    "mixed_precision",
    "global_batch_size",
    "steps",
    "wall_seconds",
    "train_samples_per_second",
    "median_step_seconds",
    "peak_memory_mb",
    "eval_accuracy",
    "eval_f1",
]


def files(data):
    return text_files(data)


@pytest.fixture(scope="module")
def single_run(text_one):
    """conftest's text_one: the tiny BERT fine-tuned for 2 epochs on 1 process (text_data,
    TEXT_RUN)."""
    return text_one.out, text_one.proc


def test_fine_tune_learns_and_writes_the_contract(single_run):
    out, proc = single_run
    results = read_results(out)
    for key in CONTRACT:
        assert key in results, key
    assert results["recipe"] == "text_classification" and results["dataset"] == "reviews-train"
    assert results["world_size"] == 1 and results["steps"] == 32 and results["num_labels"] == 2
    assert results["eval_samples"] == results["validation_size"] == 63
    assert results["eval_accuracy"] >= 0.8 and results["eval_f1"] >= 0.8  # chance is 0.5
    steps = losses(out)
    assert steps[32] < steps[1] - 0.1, steps
    assert "global batch 16 = 1 process(es) x 16 per process" in proc.output
    # 256 examples / 16 x 2 epochs: a planned run this short is told how to get more updates
    warning = next(
        line for line in proc.output.splitlines() if line.startswith("warning: 32 optimizer steps")
    )
    assert all(flag in warning for flag in ("--epochs", "--batch_size", "--lr"))
    check_png(out / "results.png", 800, 600)


def test_saved_model_reloads_with_from_pretrained_and_keeps_string_labels(single_run):
    out, _ = single_run
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.id2label == {0: "negative", 1: "positive"}
    texts = ["the film was great superb lovely", "the plot was awful dull boring"]
    with torch.no_grad():
        ids = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    assert [model.config.id2label[i] for i in ids] == ["positive", "negative"]


def test_predict_classifies_a_text_file_and_a_literal_text(single_run, tmp_path):
    out, _ = single_run
    texts = tmp_path / "texts.txt"
    texts.write_text("a lovely brilliant film\n\nboring terrible poor plot\n")
    # A file and a literal text in one call. Without --model, --predict uses --output_dir: the run
    # just trained (the model_best test below gives --model).
    proc = check(
        run(
            [PYTHON, TEXT_SCRIPT, "--predict", texts, "--predict", "superb great movie", "--output_dir", out],
            recipe_env(tmp_path),
        )
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["text"], r["label"]) for r in rows] == [
        ("a lovely brilliant film", "positive"),
        ("boring terrible poor plot", "negative"),
        ("superb great movie", "positive"),
    ]
    assert all(0.5 < r["score"] <= 1 for r in rows)


def same_weights(a, b) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_model_best_is_the_best_epochs_model_and_predict_reads_it(single_run, tmp_path):
    out, proc = single_run
    results = read_results(out)
    accuracy = [m["eval/accuracy"] for m in read_metrics(out) if "eval/accuracy" in m]
    assert len(accuracy) == 2 and results["best_metric"] == max(accuracy)
    assert results["best_epoch"] == accuracy.index(max(accuracy)) + 1 and results["stopped_early"] is False
    best = out / "model_best"
    # the last epoch's model only when it was the best
    assert same_weights(best, out) == (results["best_epoch"] == 2)
    assert AutoTokenizer.from_pretrained(best).vocab == AutoTokenizer.from_pretrained(out).vocab
    rows = [
        json.loads(line)
        for line in check(
            run(
                [PYTHON, TEXT_SCRIPT, "--predict", "a lovely brilliant film", "--model", best],
                recipe_env(tmp_path),
            )
        ).stdout.splitlines()
    ]
    assert len(rows) == 1 and rows[0]["label"] in ("positive", "negative")
    assert f"--model {best}" in proc.stdout


def test_patience_stops_a_run_that_cannot_improve_and_a_resume_stays_stopped(text_data, tmp_path):
    """Learning rate 0: the weights never change (AdamW's decay is scaled by the learning rate too),
    so the second evaluation ties the first and patience 1 ends the run after 2 of 3 epochs, as a
    normal end."""
    out, env = tmp_path / "out", recipe_env(tmp_path)
    command = [
        PYTHON,
        TEXT_SCRIPT,
        *files(text_data),
        *FAST,
        "--lr",
        "0",
        "--epochs",
        "3",
        "--early_stopping_patience",
        "1",
        "--output_dir",
        out,
    ]
    proc = check(run(command, env, timeout=300))
    results = read_results(out)
    accuracy = [m["eval/accuracy"] for m in read_metrics(out) if "eval/accuracy" in m]
    assert len(accuracy) == 2 and accuracy[0] == accuracy[1]
    assert (
        results["steps"] == 32
        and results["stopped_early"] is True
        and results["early_stopping_patience"] == 1
    )
    assert (results["best_epoch"], results["best_step"], results["best_metric"]) == (1, 16, accuracy[0])
    line = (
        "stopped early after epoch 2 of 3 (step 32 of 48): eval_accuracy did not improve in 1 evaluation(s) "
        f"in a row (--early_stopping_patience 1); best eval_accuracy {accuracy[0]:.4f} at epoch 1, its model "
        f"in {out / 'model_best'}"
    )
    assert line in proc.stdout.splitlines()
    # nothing was learnt: the best and the last are the same model
    assert same_weights(out / "model_best", out)
    # the epoch-end checkpoint, written before stopping
    assert (out / "checkpoints" / f"step_{32:08d}").is_dir()
    # The patience count is part of the checkpoint: continuing the run trains no further.
    resumed = check(run([*command, "--resume", "auto"], env, timeout=300))
    again = read_results(out)
    assert "resumed from" in resumed.stdout and line in resumed.stdout.splitlines()
    assert (again["steps"], again["stopped_early"], again["best_epoch"]) == (32, True, 1)


def test_two_processes_over_gloo_count_each_validation_example_once(text_two):
    # the recipe copied into an empty project, on 2 processes, with the flags of text_one
    out = text_two.out
    results = read_results(out)
    assert results["world_size"] == 2 and results["per_process_batch_size"] == 8
    assert results["samples_seen_per_process"] == [256, 256]
    assert results["eval_samples"] == 63
    assert results["eval_accuracy"] >= 0.8
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 2


def test_text_loop_reads_nothing_between_log_steps_on_one_and_two_processes(text_one, text_two):
    """The host-read audit (benchmarks/host_reads.py) of the shared runs, on 1 process and on each
    of the 2; two
    epochs: the epoch end (step 16) is a log step."""
    assert_quiet(read_audit(text_one.out), text_one.proc, steps=32, log_every=4)
    assert_both_ranks_quiet(text_two, steps=32, log_every=4)


def test_eval_only_on_two_processes_reproduces_the_runs_evaluation(single_run, text_data, tmp_path):
    """--eval_only of single_run's model on 2 gloo processes: the run's own evaluation (trained on 1
    process), the odd example out counted once, nothing trained or saved."""
    out, _ = single_run
    common = ["--eval_only", "--model", out, "--train_file", text_data["train"]]
    common += ["--validation_file", text_data["validation"], "--batch_size", "16", "--tracker", "none"]
    common += ["--num_workers", "0"]
    env = recipe_env(tmp_path)
    launch = [
        ACCELERATE,
        "launch",
        "--config_file",
        CONFIGS / "cpu.yaml",
        "--num_cpu_threads_per_process",
        "1",
    ]
    two = tmp_path / "two"
    proc = check(
        run(
            [*launch, TEXT_SCRIPT, *common, "--output_dir", two],
            dict(env, ACCELERATE_USE_CPU="true"),
            timeout=300,
        )
    )
    trained, r2 = read_results(out), read_results(two)
    assert r2["world_size"] == 2 and r2["eval_only"] is True and r2["steps"] == 0
    assert r2["eval_samples"] == 63  # the odd example out counted once on 2 processes
    assert r2["eval_accuracy"] == trained["eval_accuracy"] and r2["eval_f1"] == trained["eval_f1"]
    assert r2["eval_loss"] == pytest.approx(trained["eval_loss"], abs=1e-5)
    assert f"accuracy {r2['eval_accuracy']:.4f}" in proc.stdout
    assert not (two / "model.safetensors").exists()  # evaluated, not trained or saved
    # data with other labels, and a folder that holds no fine-tuned model, are refused in one line
    relabelled = [
        dict(row, label={"positive": "good", "negative": "bad"}[row["label"]])
        for row in sentiment_rows(32, seed=5)
    ]
    other = write_rows(tmp_path / "other" / "train.csv", relabelled)
    fails_with(
        run(
            [
                PYTHON,
                TEXT_SCRIPT,
                "--eval_only",
                "--model",
                out,
                "--train_file",
                other,
                "--validation_file",
                other,
                "--output_dir",
                tmp_path / "o",
            ],
            env,
        ),
        "was fine-tuned on the labels",
        "data flags",
    )
    fails_with(
        run(
            [
                PYTHON,
                TEXT_SCRIPT,
                "--eval_only",
                "--model",
                tmp_path / "other",
                "--task",
                "sst2",
                "--output_dir",
                tmp_path / "o2",
            ],
            env,
        ),
        "not a fine-tuned model directory",
    )


def test_sigkill_mid_epoch_then_resume_auto_ends_with_the_same_weights(text_one, text_data, tmp_path):
    """text_one's flags with a checkpoint every 3 steps (2 epochs of 16 steps), killed with SIGKILL
    once step 18's checkpoint is on disk, then --resume auto: the weights, best model and steps of
    text_one (the checkpoints change no number the run computes; dropout draws from the global RNG
    that checkpoints restore). The other recipes' killed runs are test_resume.py's; this one sits
    beside the run it continues to."""
    command = [TEXT_SCRIPT, *text_files(text_data), *TEXT_RUN, *NO_PLOTS, "--checkpoint_every", "3"]
    sigkill_mid_epoch_then_resume(command, 18, text_one.out, tmp_path)


def test_text_pairs_integer_labels_jsonl_and_accumulation(text_data, tmp_path):
    # Three classes from the pair: 0 both positive, 1 both negative, 2 mixed.
    firsts, seconds = sentiment_rows(96, seed=2), sentiment_rows(96, seed=3)

    def pair_rows(a, b):
        return [
            {
                "premise": x["text"],
                "hypothesis": y["text"],
                "label": 0
                if x["label"] == y["label"] == "positive"
                else 1
                if x["label"] == y["label"]
                else 2,
            }
            for x, y in zip(a, b)
        ]

    train = write_rows(tmp_path / "pairs" / "train.jsonl", pair_rows(firsts[:80], seconds[:80]))
    dev = write_rows(tmp_path / "pairs" / "dev.jsonl", pair_rows(firsts[80:], seconds[80:]))
    out = tmp_path / "out"
    proc = check(
        run(
            [
                PYTHON,
                TEXT_SCRIPT,
                "--model",
                text_data["model"],
                "--train_file",
                train,
                "--validation_file",
                dev,
                "--text_column",
                "premise",
                "--text_pair_column",
                "hypothesis",
                *FAST,
                "--gradient_accumulation_steps",
                "2",
                "--max_steps",
                "3",
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path),
        )
    )
    # --max_steps asks for a short run: no warning
    assert "optimizer steps in all" not in proc.output
    results = read_results(out)
    assert results["num_labels"] == 3 and results["steps"] == 3 and results["eval_samples"] == 16
    assert results["samples_seen_per_process"] == [3 * 16]
    assert 0 <= results["eval_f1"] <= 1
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "0", "1": "1", "2": "2"}


def test_missing_label_column_is_one_clear_line(text_data, tmp_path):
    proc = run(
        [
            PYTHON,
            TEXT_SCRIPT,
            *files(text_data),
            *FAST,
            "--label_column",
            "sentiment",
            "--output_dir",
            tmp_path / "out",
        ],
        recipe_env(tmp_path),
    )
    fails_with(proc, "no column 'sentiment'", "--label_column", "text, label")
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.fixture(scope="module")
def recipe():
    """The recipe's data module, where its data flags are read."""
    import text_classification_data

    return text_classification_data


def load(recipe, train, validation, **columns):
    args = dict(text_column="text", text_pair_column=None, label_column="label") | columns
    return recipe.load_text_data(
        None, str(train), str(validation), cache_dir=str(train.parent / "cache"), **args
    )


def test_unseen_validation_label_is_refused(recipe, text_data, tmp_path):
    dev = write_rows(
        tmp_path / "dev.csv",
        [{"text": "good film", "label": "positive"}, {"text": "meh film", "label": "neutral"}],
    )
    with pytest.raises(recipe.RecipeError, match="'neutral'.*never occur"):
        load(recipe, text_data["train"], dev)


def test_file_errors_name_the_file_and_the_fix(recipe, text_data, tmp_path):
    with pytest.raises(recipe.RecipeError, match="does not exist"):
        load(recipe, tmp_path / "missing.csv", text_data["validation"])
    with pytest.raises(recipe.RecipeError, match="unknown format '.xlsx'"):
        load(recipe, tmp_path / "train.xlsx", text_data["validation"])
    empty_labels = write_rows(
        tmp_path / "train.csv", [{"text": "good", "label": "positive"}, {"text": "bad", "label": ""}]
    )
    with pytest.raises(recipe.RecipeError, match="no value in the label column"):
        load(recipe, empty_labels, text_data["validation"])
    one_label = write_rows(tmp_path / "one.csv", [{"text": "good", "label": "positive"}] * 3)
    with pytest.raises(recipe.RecipeError, match="two or more labels"):
        load(recipe, one_label, text_data["validation"])
    with pytest.raises(recipe.RecipeError, match="no column 'premise'"):
        load(recipe, text_data["train"], text_data["validation"], text_pair_column="premise")


def test_glue_task_names_and_offline_error(recipe, monkeypatch, tmp_path):
    with pytest.raises(recipe.RecipeError, match="regression"):
        recipe.load_text_data("stsb", None, None, "text", None, "label", None)
    with pytest.raises(recipe.RecipeError, match="unknown --task 'sst-2'"):
        recipe.load_text_data("sst-2", None, None, "text", None, "label", None)
    # As on a machine without internet and without a cached copy.
    monkeypatch.setattr(recipe.datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(recipe.RecipeError, match="could not load GLUE mrpc.*--train_file"):
        recipe.load_text_data("mrpc", None, None, "text", None, "label", str(tmp_path / "cache"))


class HostChecks(TorchFunctionMode):
    """Counts bool(tensor): each one makes the host wait for the device on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") == "__bool__"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_masks_built_without_a_host_read_keep_logits_and_loss(recipe, text_data, attention):
    tokenizer = AutoTokenizer.from_pretrained(text_data["model"])
    batch = tokenizer(
        ["good film", "the plot was awful dull and boring", "a superb story"],
        padding=True,
        return_tensors="pt",
    )
    assert not batch["attention_mask"].all()  # padded, as the collator pads
    model = AutoModelForSequenceClassification.from_pretrained(
        text_data["model"], attn_implementation=attention
    ).eval()

    def forward():
        checks = HostChecks()
        with torch.no_grad(), checks:
            out = model(**batch, labels=torch.tensor([1, 0, 1]))
        return out.logits, out.loss, checks.count

    stock = {name: AttentionMaskInterface()[name] for name in ("sdpa", "eager")}
    *before, checks_before = forward()
    try:
        always_build_attention_masks()
        *after, checks_after = forward()
    finally:  # the stock mask builders again for the rest of this process
        for name, build in stock.items():
            AttentionMaskInterface.register(name, build)
    assert (checks_before, checks_after) == (1, 0)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-7)


def test_nan_gradients_with_a_finite_loss_are_skipped_with_skip_nonfinite_steps(text_data, tmp_path):
    # NaN gradients in step 2 of 3 (tests/nan_gradient.py), the loss finite: the update of step 2 is
    # skipped. That the run stops at that step without the flag is the guard's own logic
    # (test_guard.py) and the chat recipes' runs.
    out = tmp_path / "out"
    args = [TEXT_SCRIPT, *text_files(text_data), *TEXT_FAST, "--max_steps", "3", "--log_every", "1"]
    args += ["--checkpoint_every", "0", "--skip_nonfinite_steps", "--output_dir", out]
    proc = run([PYTHON, NAN_GRADIENT, 2, *args], recipe_env(tmp_path), timeout=300)
    assert_nonfinite_gradients_handled("skip", proc, out, bad_steps=[2])
