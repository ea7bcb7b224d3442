"""The command line every script shares: -h/--help show every flag in full, one-letter flags are
refused, and a text flag gets exactly what the user typed (fire would read "great, fun" as a tuple
and "1e-3" as a number)."""

import json
import re
import sys
from importlib.util import module_from_spec, spec_from_file_location
from types import SimpleNamespace

import fire
import pytest
from conftest import (
    CIFAR_SCRIPT,
    DETECT_SCRIPT,
    PYTHON,
    REPO,
    TEXT_SCRIPT,
    check,
    fails_with,
    recipe_env,
    run,
)

from accelerate_recipes.cli import RecipeError, as_command, parse_arg_docs, prepare_argv, run_mode
from accelerate_recipes.cli import run as run_cli

SCRIPTS = {
    "cifar": CIFAR_SCRIPT,
    "text": TEXT_SCRIPT,
    "detect": DETECT_SCRIPT,
    "sft": REPO / "recipes" / "sft.py",
}
SCRIPTS["grpo"] = REPO / "recipes" / "grpo.py"
SCRIPTS["dpo"] = REPO / "recipes" / "dpo.py"


@pytest.fixture(scope="module")
def mains():
    found = {}
    for key, path in SCRIPTS.items():
        spec = spec_from_file_location(f"cli_test_{key}", path)
        module = module_from_spec(spec)
        spec.loader.exec_module(module)
        # for main(args: SomeFlags): the flags of the dataclass
        found[key] = as_command(module.main)
    return found


def documented(doc: str) -> dict[str, str]:
    """Each argument's text in the docstring, whitespace-normalised: from `name:` to the next entry
    at its indent."""
    block = doc.split("Args:", 1)[1]
    entries = re.findall(r"^( +)(\w+): (.*?)(?=^\1\w+: |\Z)", block, re.M | re.S)
    return {name: " ".join(text.split()) for _, name, text in entries}


def flag_texts(help_text: str) -> dict[str, str]:
    """Each flag's description in the help output, whitespace-normalised."""
    blocks = re.split(r"^  --(\w+) .*$", help_text.split("\nflags:\n", 1)[1], flags=re.M)
    return {name: " ".join(text.split()) for name, text in zip(blocks[1::2], blocks[2::2])}


def check_help(output: str, main) -> None:
    import inspect

    assert output.startswith("usage: "), output[:300]
    shown = flag_texts(output)
    assert list(shown) == list(inspect.signature(main).parameters), (
        "help lists other flags than the signature"
    )
    for name, text in documented(main.__doc__).items():
        assert shown[name] == text, f"--{name}: help {shown[name]!r} != docstring {text!r}"


# From the command line: a script beside its library (cifar) and one that imports its folder's
# modules (detect); the others answer -h through the same cli.run, read in process below.
@pytest.mark.parametrize("script", ["cifar", "detect"])
def test_short_help_from_the_command_line_shows_every_flag_in_full(script, mains, tmp_path):
    proc = check(run([PYTHON, SCRIPTS[script], "-h"], recipe_env(tmp_path), timeout=120))
    check_help(proc.stdout, mains[script])


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_long_help_in_every_script_shows_every_flag_in_full(script, mains, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [SCRIPTS[script].name, "--help"])
    run_cli(mains[script])
    output = capsys.readouterr().out
    check_help(output, mains[script])
    if script == "detect":
        assert (
            "--seed INT  (default: 42)" in output
            and "--hsv FLOAT,FLOAT,FLOAT  (default: 0.015,0.7,0.4)" in output
        )


def test_wrapped_lines_with_a_colon_stay_in_their_entry():
    _, docs = parse_arg_docs("""Do it.

    Args:
        resume: auto (continue) or the path of a checkpoint;
            default: start fresh.
        loader: device: the whole set
            torch: a DataLoader
    Returns:
        nothing.
    """)
    assert docs == {
        "resume": "auto (continue) or the path of a checkpoint; default: start fresh.",
        "loader": "device: the whole set torch: a DataLoader",
    }


def test_an_unrequested_one_letter_flag_is_refused_in_one_line(tmp_path, mains):
    fails_with(
        run([PYTHON, CIFAR_SCRIPT, "-v"], recipe_env(tmp_path), timeout=120),
        "unknown flag -v",
        "flags are spelled out, e.g. --verify_data",
    )
    for key, flag, guess in (
        ("text", "-v", "--validation_file"),
        ("detect", "-s", "--synthetic_size"),
        ("detect", "-x=1", "--data"),
    ):
        with pytest.raises(
            RecipeError, match=f"unknown flag {flag[:2]}; flags are spelled out, e.g. {guess}$"
        ):
            prepare_argv(mains[key], [flag])
    with pytest.raises(RecipeError, match="unknown flag --epoch; did you mean --epochs"):
        prepare_argv(mains["cifar"], ["--epoch", "3"])
    with pytest.raises(RecipeError, match="unexpected argument 'fun'"):
        prepare_argv(mains["text"], ["--predict", "great,", "fun"])


def parsed(main, argv):
    """What fire hands `main` after prepare_argv."""
    got = {}

    def capture(**kwargs):
        got.update(kwargs)

    fire.Fire(lambda **kwargs: capture(**kwargs), command=prepare_argv(main, argv))
    return got


def test_text_flags_arrive_as_typed(mains):
    text = mains["text"]
    # prepare_argv reads the real signature; fire then parses the rewritten line (a keyword-only
    # capture shows it).
    rewritten = prepare_argv(
        text,
        [
            "--predict",
            "great, fun",
            "--run_name=1e-3",
            "--model",
            "007",
            "--lr",
            "1e-3",
            "--gradient_checkpointing",
            "no",
        ],
    )
    assert rewritten == [
        "--predict='great, fun'",
        "--run_name='1e-3'",
        "--model='007'",
        "--lr=1e-3",
        "--gradient_checkpointing=False",
    ]
    got = parsed(
        text,
        [
            "--predict=great, fun",
            "--run_name",
            "1e-3",
            "--project",
            "[1, 2]",
            "--text_column",
            'it\'s "quoted"',
            "--lr",
            "1e-3",
            "--max_steps",
            "None",
            "--gradient_checkpointing",
        ],
    )
    assert got == {
        "predict": "great, fun",
        "run_name": "1e-3",
        "project": "[1, 2]",
        "text_column": 'it\'s "quoted"',
        "lr": 1e-3,
        "max_steps": None,
        "gradient_checkpointing": True,
    }
    assert parsed(text, ["--predict", "great, fun", "--predict", "1e-3"]) == {
        "predict": ["great, fun", "1e-3"]
    }
    detect = mains["detect"]
    assert parsed(detect, ["--hsv", "0.1,0.2,0.3", "--nochannels_last", "--seed", "-1"]) == {
        "hsv": (0.1, 0.2, 0.3),
        "channels_last": False,
        "seed": -1,
    }
    with pytest.raises(RecipeError, match="--resume needs a value"):
        prepare_argv(detect, ["--resume", "--seed", "1"])
    with pytest.raises(RecipeError, match="--eval_only takes True or False"):
        prepare_argv(detect, ["--eval_only", "maybe"])


@pytest.fixture(scope="module")
def tiny_classifier(tiny_bert_dir):
    return tiny_bert_dir


def test_predict_gets_one_text_with_its_comma(tiny_classifier, tmp_path):
    proc = check(
        run(
            [PYTHON, TEXT_SCRIPT, "--predict", "great, fun", "--model", tiny_classifier],
            recipe_env(tmp_path),
            timeout=120,
        )
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [row["text"] for row in rows] == ["great, fun"], proc.output[-2000:]


def test_predict_repeated_classifies_each_text_as_typed(tiny_classifier, mains, monkeypatch, capsys):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "text_classification.py",
            "--predict",
            "great, fun",
            "--predict",
            "1e-3",
            "--model",
            str(tiny_classifier),
        ],
    )
    run_cli(mains["text"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [row["text"] for row in rows] == ["great, fun", "1e-3"]


def test_a_script_of_sub_commands_lists_them_and_helps_each(tmp_path):
    convert = REPO / "recipes" / "detect" / "convert.py"
    env = recipe_env(tmp_path)
    listing = check(run([PYTHON, convert, "-h"], env))
    assert "convert.py {coco,voc}" in listing.stdout
    voc = check(run([PYTHON, convert, "voc", "--help"], env))
    assert "usage: convert.py voc --root" in voc.stdout and "--image_set" in voc.stdout
    fails_with(run([PYTHON, convert, "yolo"], env), "unknown command 'yolo'", "coco, voc")


def test_a_run_takes_the_one_mode_its_flags_name_and_two_modes_stop_it(mains, monkeypatch, capsys):
    ran = []
    modes = {"predict": lambda flags: ran.append("predict"), "eval_only": lambda flags: ran.append("eval")}
    for flags in (
        SimpleNamespace(predict=None, eval_only=False),
        SimpleNamespace(predict="photo.jpg", eval_only=False),
        SimpleNamespace(predict="", eval_only=False),  # given, if empty: predict says what is wrong
        SimpleNamespace(predict=None, eval_only=True),
    ):
        run_mode(flags, modes, otherwise=lambda flags: ran.append("train"))
    assert ran == ["train", "predict", "predict", "eval"]
    with pytest.raises(RecipeError, match=r"^give --predict or --eval_only, not both$"):
        run_mode(SimpleNamespace(predict="x", eval_only=True), modes, otherwise=print)
    # each recipe's main, before any data or model loads
    for recipe, argv, message in (
        ("cifar", ["--predict", "photo.jpg", "--eval_only"], "give --predict or --eval_only, not both"),
        (
            "dpo",
            ["--chat", "--merge", "merged", "--eval_only"],
            "give one of --predict, --eval_only, --chat and --merge, not --eval_only and --chat and --merge",
        ),
    ):
        monkeypatch.setattr(sys, "argv", [str(SCRIPTS[recipe]), *argv])
        with pytest.raises(SystemExit) as stop:
            run_cli(mains[recipe])
        assert stop.value.code == 2 and capsys.readouterr().err.strip() == f"error: {message}"
