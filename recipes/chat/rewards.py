"""Verifiable rewards for the GRPO recipe (recipes/grpo.py): the built-in checks, the user's own
functions, and the prompts they score.

A reward function takes `(prompts, completions, **columns)` and returns one float per completion, as
TRL's GRPOTrainer calls them: `prompts` as the data gave them (a string, or a list of messages),
`completions` the decoded answers (for a prompt given as messages, a list of one assistant message,
`[{"role": "assistant", "content": ...}]`, as TRL passes conversational completions),
`completion_ids` their token ids, and every other column of the data (`answer`, ...) as a list of
the same length, plus `truncated` (True where the answer hit --max_new_tokens before its end-of-turn
token). A value of None means the reward does not apply to that completion: it is left out of the
weighted sum (TRL counts it as NaN, which its sum skips) and of the reward's mean. The recipe names
its rewards with `--reward number,format` or `--reward my_rewards.py:brevity` and weighs them with
`--reward_weights`.
"""

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path

import datasets

from accelerate_recipes import RecipeError
from accelerate_recipes.errors import first_line

from .conversations import exact_match, hold_out, listed_messages, read_split_files, short

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
GSM8K_ANSWER = "####"  # GSM8K's answers end with "#### 42"


# --------------------------------------------------------------------------------------- the checks
def text_of(completion) -> str:
    """A completion as text: itself, or the content of the last message of a conversational
    completion."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion or "")


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed: "1,234.5"), or None."""
    found = NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def tagged(text: str, tag: str) -> str | None:
    """What the last <tag>...</tag> of `text` holds, or None."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text or "", flags=re.DOTALL)
    return found[-1].strip() if found else None


def number(prompts, completions, answer, **columns) -> list[float]:
    """1.0 when the last number of the completion equals the answer's number (GSM8K's `#### 42`
    included), else 0."""
    scores = []
    for completion, reference in zip(completions, answer):
        expected, given = last_number(str(reference)), last_number(text_of(completion))
        scores.append(
            float(expected is not None and given is not None and math.isclose(given, expected, abs_tol=1e-6))
        )
    return scores


def tag(prompts, completions, answer, answer_tag="answer", **columns) -> list[float]:
    """1.0 when the completion holds <answer>X</answer> and X equals the answer (as a number when
    both are numbers, else as text up to case and surrounding punctuation), else 0."""
    scores = []
    for completion, reference in zip(completions, answer):
        inside = tagged(text_of(completion), answer_tag)
        if inside is None:
            scores.append(0.0)
            continue
        expected, given = last_number(str(reference)), last_number(inside)
        if expected is not None and given is not None and NUMBER.fullmatch(inside.strip()):
            scores.append(float(math.isclose(given, expected, abs_tol=1e-6)))
        else:
            scores.append(float(exact_match(inside, str(reference))))
    return scores


def exact(prompts, completions, answer, **columns) -> list[float]:
    """1.0 when the whole completion equals the short answer up to case, whitespace and surrounding
    punctuation."""
    return [float(exact_match(text_of(c), str(reference))) for c, reference in zip(completions, answer)]


def format(prompts, completions, answer_tag="answer", **columns) -> list[float]:  # noqa: A001 (the reward's name)
    """1.0 when the completion holds exactly one <answer>...</answer> pair, not empty, and nothing
    after it, else 0."""
    tags = rf"</?{answer_tag}>"  # neither tag may appear anywhere but in the one pair
    pattern = rf"^(?:(?!{tags}).)*<{answer_tag}>(?:(?!{tags}).)+</{answer_tag}>\s*$"
    return [float(bool(re.match(pattern, text_of(c), flags=re.DOTALL))) for c in completions]


def length(prompts, completions, truncated, **columns) -> list[float]:
    """1.0 when the completion ended by itself (its end-of-turn token) before --max_new_tokens, else
    0."""
    return [0.0 if cut else 1.0 for cut in truncated]


BUILT_IN = {"number": number, "tag": tag, "exact": exact, "format": format, "length": length}
NEEDS_ANSWER = {"number", "tag", "exact"}


# ----------------------------------------------------------------------------------- user's rewards
def load_reward(spec: str):
    """A built-in reward by name, or the user's `path/to/file.py:function` or
    `package.module:function`."""
    spec = spec.strip()
    if spec in BUILT_IN:
        return spec, BUILT_IN[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise RecipeError(
            f"--reward {spec}: not a built-in reward ({', '.join(BUILT_IN)}) nor file.py:function "
            "/ module:function"
        )
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise RecipeError(f"--reward {spec}: {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.path.insert(0, str(path.resolve().parent))  # so the file may import its neighbours
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RecipeError:
        raise
    except Exception as err:
        raise RecipeError(
            f"--reward {spec}: importing {where} failed ({type(err).__name__}: {first_line(err)})"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RecipeError(f"--reward {spec}: {where} has no function {name!r}")
    return spec, function


class Rewards:
    """The run's reward functions and weights: `score(prompts, completions, columns)` -> per
    function, one list of floats per completion, each checked; `total(scores)` the weighted sum per
    completion."""

    def __init__(self, specs, weights=None, answer_tag: str = "answer"):
        specs = [s for s in (specs.split(",") if isinstance(specs, str) else list(specs)) if str(s).strip()]
        if not specs:
            raise RecipeError("--reward names no reward; give one or more of " + ", ".join(BUILT_IN))
        self.functions = [load_reward(str(s)) for s in specs]
        if weights is None:
            weights = [1.0] * len(specs)
        elif isinstance(weights, str):
            weights = [w for w in weights.split(",") if w.strip()]
        elif not isinstance(weights, (list, tuple)):
            weights = [weights]
        try:
            self.weights = [float(w) for w in weights]
        except ValueError:
            raise RecipeError(f"--reward_weights {weights}: give numbers, one per --reward") from None
        if len(self.weights) != len(self.functions):
            raise RecipeError(
                f"--reward_weights gives {len(self.weights)} weight(s) for {len(self.functions)} "
                f"reward(s) ({', '.join(n for n, _ in self.functions)}); give one per reward"
            )
        self.answer_tag = answer_tag
        self.names = [name.rsplit(":", 1)[-1] for name, _ in self.functions]

    @property
    def needs_answer(self) -> bool:
        return any(name in NEEDS_ANSWER for name, _ in self.functions)

    def score(self, prompts: list, completions: list[str], columns: dict) -> list[list[float | None]]:
        """Each function's values, one per completion: a float, or None where it does not apply. A
        completion of a prompt given as messages reaches the functions as a list of one assistant
        message, as in TRL."""
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(prompts, completions)
        ]
        scores = []
        for name, function in self.functions:
            extra = dict(columns, answer_tag=self.answer_tag) if name in BUILT_IN else columns
            try:
                values = function(prompts=prompts, completions=completions, **extra)
            except Exception as err:
                raise RecipeError(
                    f"reward {name} raised {type(err).__name__}: {first_line(err)}; fix the "
                    "function (it is called as f(prompts, completions, **columns))"
                ) from None
            try:
                values = [None if v is None else float(v) for v in values]
            except (TypeError, ValueError):
                raise RecipeError(
                    f"reward {name} returned {short(values)}; return one float (or None) per completion"
                ) from None
            if len(values) != len(completions):
                raise RecipeError(
                    f"reward {name} returned {len(values)} value(s) for {len(completions)} "
                    "completions; return one float per completion"
                )
            if not all(v is None or math.isfinite(v) for v in values):
                raise RecipeError(
                    f"reward {name} returned a NaN or infinite value; return finite floats, or "
                    "None where the reward does not apply"
                )
            scores.append(values)
        return scores

    def total(self, scores: list[list[float | None]]) -> list[float]:
        """The weighted sum per completion, over the rewards that apply to it; NaN where none does
        (unscored)."""
        return [
            sum(w * s for w, s in zip(self.weights, per) if s is not None)
            if any(s is not None for s in per)
            else math.nan
            for per in zip(*scores)
        ]


def mean_scored(values: list[float | None]) -> float:
    """The mean over the completions that were scored: a reward's values without its Nones (does not
    apply), or the weighted totals without their NaNs (no reward applies); 0 where none was."""
    scored = [v for v in values if v is not None and not math.isnan(v)]
    return sum(scored) / len(scored) if scored else 0.0


def is_correct(value: float | None) -> bool:
    """The first reward, the correctness check, says right (1 or more)."""
    return value is not None and value >= 1.0


def reward_columns(rows: list[dict]) -> dict:
    """The data's columns as lists, for the reward functions' **columns (prompt, messages and ids
    left out)."""
    names = {k for row in rows for k in row} - {"prompt", "messages", "prompt_ids"}
    return {name: [row.get(name) for row in rows] for name in sorted(names)}


def score_texts(
    rewards: Rewards, rows: list[dict], texts: list[str], truncated: list[bool], ids=None
) -> tuple:
    """(per function: one value or None per completion, the weighted totals) of completions of
    `rows`' prompts."""
    columns = dict(reward_columns(rows), truncated=truncated)
    if ids is not None:
        columns["completion_ids"] = ids
    per_function = rewards.score([row["prompt"] for row in rows], texts, columns)
    return per_function, rewards.total(per_function)


# ------------------------------------------------------------------------------------------ prompts
def gsm8k_answer(text) -> str:
    """GSM8K's reference ("... reasoning ... #### 1,234") as its final answer ("1234")."""
    text = str(text)
    return text.rsplit(GSM8K_ANSWER, 1)[-1].strip().replace(",", "") if GSM8K_ANSWER in text else text.strip()


def as_prompt_row(row: dict, where: str) -> dict:
    """One row of prompt data as {prompt: str | messages, messages: [...], answer?, other columns}:
    a `prompt` (text), `messages` (a conversation to continue: an assistant turn at its end is taken
    as the answer when there is no `answer` column), or GSM8K's `question` + `answer`."""
    row = dict(row)
    if row.get("prompt") is not None:
        prompt = row.pop("prompt")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = listed_messages(prompt, row, where)
    elif row.get("messages") is not None:
        prompt = messages = listed_messages(row.pop("messages"), row, where)
        if messages and messages[-1]["role"] == "assistant":
            if row.get("answer") is None:
                row["answer"] = messages[-1]["content"]
            prompt = messages = messages[:-1]
        if not messages:
            raise RecipeError(f"{where}: a conversation with nothing to continue: {short(row)}")
    elif row.get("question") is not None:  # GSM8K's layout
        prompt = row.pop("question")
        messages = [{"role": "user", "content": prompt}]
        if row.get("answer") is not None:
            row["answer"] = gsm8k_answer(row["answer"])
    else:
        raise RecipeError(
            f"{where}: a row without `prompt`, `messages` or `question`: {short(row)}; give one of "
            "them per row"
        )
    return dict(row, prompt=prompt, messages=messages)


def read_prompt_rows(rows, where: str) -> list[dict]:
    return [as_prompt_row(row, f"{where}, row {i + 1}") for i, row in enumerate(rows)]


def load_prompts(train_file, validation_file, dataset, cache_dir, validation_size: float, seed: int):
    """(training prompts, validation prompts, name): from .json/.jsonl files, or a Hub dataset
    (`name` or `name:config`, its train split and its test/validation split), else --validation_size
    held out. A validation file alone (--eval_only) gives no training prompts."""
    if dataset:
        name, _, config = dataset.partition(":")
        try:
            splits = datasets.load_dataset(name, config or None, cache_dir=cache_dir)
        except Exception as err:
            raise RecipeError(
                f"--dataset {dataset}: could not load it ({first_line(err)}); check the name (name "
                "or name:config) and the network, or give --train_file"
            ) from None
        held = next((s for s in ("validation", "test") if s in splits), None)
        train = read_prompt_rows(splits["train"], f"--dataset {dataset}")
        validation = read_prompt_rows(splits[held], f"--dataset {dataset}") if held else None
    else:
        train, validation = read_split_files(
            train_file, validation_file, cache_dir, read_prompt_rows, "prompts"
        )
    if validation is None:
        train, validation = hold_out(train, validation_size, seed, "prompt(s)")
    return train, validation


def check_columns(rewards: Rewards, rows: list[dict], where: str) -> None:
    """Every reward that compares with an answer finds one in every row."""
    if rewards.needs_answer:
        missing = next((i for i, row in enumerate(rows) if row.get("answer") in (None, "")), None)
        if missing is not None:
            raise RecipeError(
                f"{where}: row {missing + 1} has no `answer`, which --reward "
                f"{','.join(rewards.names)} compares with: {short(rows[missing]['prompt'])}; add "
                "an answer column or use rewards that need none"
            )
