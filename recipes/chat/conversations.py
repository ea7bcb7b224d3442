"""Conversations for the chat recipes: chat files and hub datasets to conversations, conversations
to token ids with the loss on the assistant's turns only (packing.py batches them).

The assistant mask is found from the rendered text itself: the chat template renders the whole
conversation once, each message's content is located in that text in order, and a token is a target
when it carries characters of an assistant's content or of the turn end right after it. That needs
no `{% generation %}` markers in the template (few templates have them) and no rendering of prefixes
(Qwen3's template writes the last assistant turn differently from earlier ones, so a prefix's
rendering is not a prefix of the whole).
"""

import random
import string
from pathlib import Path

import datasets

from accelerate_recipes.errors import RecipeError, first_line

from .answer_loss import IGNORE_INDEX

FILE_SUFFIXES = (".json", ".jsonl")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
FORMATS = (
    "'messages' (role/content), 'conversations' (ShareGPT from/value), "
    "'instruction'/'input'/'output' (Alpaca) or 'prompt'/'completion'"
)
# Characters no chat text holds (Unicode private use): placeholders
# for contents when rendering the template's skeleton.
PLACEHOLDER = "\ue000{}\ue001"


# ---------------------------------------------------------------------------- rows to conversations
def short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checked_message(role, content, row: dict) -> dict:
    if role not in ROLES:
        raise RecipeError(
            f"row {short(row)} has a message of role {role!r}; the roles accepted are {', '.join(ROLES)}"
        )
    if not isinstance(content, str):
        raise RecipeError(
            f"row {short(row)} has a {role} message whose content is {short(content)}; give text"
        )
    return {"role": role, "content": content}


def listed_messages(messages, row: dict, what: str) -> list[dict]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RecipeError(f"row {short(row)}: {what} must be a list of {{'role', 'content'}} objects")
    return [checked_message(m.get("role"), m.get("content"), row) for m in messages]


def to_messages(example: dict) -> list[dict]:
    """One row of a supported format as a conversation: a list of {"role", "content"} (system / user
    / assistant).

    The formats: `messages` (role/content, any number of turns), ShareGPT `conversations` (from
    system / human / user / gpt / assistant, with `value`), Alpaca (`instruction`, an optional
    `input` joined to it after a blank line, and `output`), and `prompt`/`completion` (two strings,
    or TRL's conversational form: two lists of messages). Columns other formats leave empty (None,
    as `datasets` fills them) are ignored.
    """
    if example.get("messages") is not None:
        messages = listed_messages(example["messages"], example, "'messages'")
    elif example.get("conversations") is not None:
        turns = example["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise RecipeError(
                f"row {short(example)}: 'conversations' must be a list of {{'from', 'value'}} objects"
            )
        messages = []
        for turn in turns:
            speaker = turn.get("from")
            if speaker not in SHAREGPT_ROLES:
                raise RecipeError(
                    f"row {short(example)} has a turn from {speaker!r}; ShareGPT turns are from "
                    f"{', '.join(SHAREGPT_ROLES)}"
                )
            messages.append(checked_message(SHAREGPT_ROLES[speaker], turn.get("value"), example))
    elif example.get("prompt") is not None and example.get("completion") is not None:
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [
                checked_message("user", prompt, example),
                checked_message("assistant", completion, example),
            ]
        else:  # TRL's conversational prompt-completion: both lists of messages
            messages = listed_messages(prompt, example, "'prompt'") + listed_messages(
                completion, example, "'completion'"
            )
    elif example.get("instruction") is not None and example.get("output") is not None:
        instruction, extra = example["instruction"], example.get("input")
        if isinstance(instruction, str) and isinstance(extra, str) and extra.strip():
            instruction = f"{instruction}\n\n{extra}"
        messages = [
            checked_message("user", instruction, example),
            checked_message("assistant", example["output"], example),
        ]
    else:
        columns = ", ".join(k for k, v in example.items() if v is not None)
        raise RecipeError(f"row {short(example)} (columns {columns}) fits no chat format; give {FORMATS}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecipeError(
            f"row {short(example)} has no assistant turn; every conversation needs an answer to learn"
        )
    return messages


# ------------------------------------------------------------------------------------------ loading
def hold_out(rows: list, validation_size: float, seed: int, what: str) -> tuple[list, list]:
    """(training rows, validation rows): --validation_size of `rows` held out at random (by `seed`),
    both in their file order; `what` names the rows in the error."""
    held_out = max(1, round(validation_size * len(rows)))
    if held_out >= len(rows):
        raise RecipeError(f"{len(rows)} {what} leave none to train on after holding out --validation_size")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in sorted(order[held_out:])], [rows[i] for i in sorted(order[:held_out])]


def load_file(path, split: str, cache_dir: str | None, flag: str | None = None) -> datasets.Dataset:
    """One .json (a list of objects) or .jsonl (one object per line) file through the `datasets`
    JSON loader; errors name `flag` (default --<split>_file)."""
    file = Path(path).expanduser()
    flag = flag or f"--{split}_file"
    if file.suffix.lower() not in FILE_SUFFIXES:
        raise RecipeError(
            f"{flag} {path}: unknown format {file.suffix!r}; give a .json or .jsonl file of chats"
        )
    if not file.is_file():
        raise RecipeError(f"{flag} {path} does not exist; give the path of a .json or .jsonl file")
    try:
        rows = datasets.load_dataset(
            "json", data_files={split: str(file.resolve())}, split=split, cache_dir=cache_dir
        )
    except Exception as err:  # pyarrow / json parse errors of every kind
        reason = first_line(err)
        raise RecipeError(
            f"could not read {flag} {path} as JSON ({reason}); check the file's format"
        ) from None
    if len(rows) == 0:
        raise RecipeError(f"{flag} {path} holds no rows; give a file with one chat per row")
    return rows


def read_split_files(train_file, validation_file, cache_dir, read, what: str) -> tuple[list, list | None]:
    """--train_file and --validation_file (.json or .jsonl), each read into rows by `read(rows,
    where)`; the errors name `what` the files hold ("preference pairs", "prompts"). The validation
    rows are None without a file."""
    if not train_file and not validation_file:
        raise RecipeError(f"give --train_file (a .json/.jsonl of {what}) or --dataset (a Hub dataset)")
    for path, flag in ((train_file, "--train_file"), (validation_file, "--validation_file")):
        if path and Path(path).suffix.lower() not in FILE_SUFFIXES:
            raise RecipeError(f"{flag} {path}: unknown format; give a .json or .jsonl file of {what}")
    train = read(load_file(train_file, "train", cache_dir), str(train_file)) if train_file else []
    validation = None
    if validation_file:
        validation = read(load_file(validation_file, "validation", cache_dir), str(validation_file))
    return train, validation


def as_conversations(rows: datasets.Dataset, source: str) -> datasets.Dataset:
    """The rows with one column, "messages"; a bad row's error says which source and row it is."""

    def convert(example, index):
        try:
            return {"messages": to_messages(example)}
        except RecipeError as err:
            raise RecipeError(f"{source} row {index + 1}: {err}") from None

    return rows.map(convert, with_indices=True, remove_columns=rows.column_names, desc="read chats")


def first_split(splits, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:
        for name in splits:
            if name.startswith(prefix):
                return name
    return None


def dataset_name(args) -> str:
    """The data of a DPO or GRPO run in a name (for the run's name and results.json): a Hub
    --dataset's (name or name:config), or <folder>-<name> of --train_file, or under --eval_only,
    which needs no training data, of --validation_file. Refuses a run without data."""
    if args.dataset:
        return args.dataset.split(":")[0].rsplit("/", 1)[-1]
    file = args.train_file or (args.validation_file if args.eval_only else None)
    if not file:
        also = " (or, with --eval_only, --validation_file)" if args.eval_only else ""
        raise RecipeError(f"give --train_file (a .json or .jsonl file) or --dataset (a Hub dataset){also}")
    return f"{Path(file).resolve().parent.name}-{Path(file).stem}"


def load_hub_dataset(
    dataset: str, cache_dir: str | None
) -> tuple[datasets.Dataset, datasets.Dataset | None, str]:
    try:
        loaded = datasets.load_dataset(dataset, cache_dir=cache_dir)
    except Exception as err:  # offline, unknown names, hub errors, a missing cache
        reason = first_line(err)
        raise RecipeError(
            f"could not load --dataset {dataset} ({reason}); connect once to download it (it is "
            "cached under ~/.cache/huggingface/datasets), or give your own chats with --train_file"
        ) from None
    # "train" / "validation" / "test", and the "train_sft"
    # / "test_sft" of chat sets such as UltraChat
    train = first_split(loaded, ("train",))
    if train is None:
        splits = ", ".join(loaded)
        raise RecipeError(f"--dataset {dataset} has no train split (its splits: {splits}); give --train_file")
    validation = first_split(loaded, ("validation", "valid", "dev", "test"))
    return loaded[train], (loaded[validation] if validation else None), train


def load_conversations(
    train_file, validation_file, dataset, cache_dir, validation_size: float, seed: int
) -> datasets.DatasetDict:
    """Train and validation conversations, each split with one column "messages" (lists of {"role",
    "content"}).

    From --train_file (and --validation_file), .json or .jsonl in any format to_messages reads, or
    from a hub --dataset (its train split, and its validation or test split when it has one); give
    one source, not both. Without a validation file or split, `validation_size` (a fraction) of the
    training rows is held out, drawn with `seed`.
    """
    if train_file is not None and dataset is not None:
        raise RecipeError("give --train_file or --dataset, not both")
    if train_file is not None:
        train = as_conversations(load_file(train_file, "train", cache_dir), f"--train_file {train_file}")
        validation = None
        if validation_file is not None:
            rows = load_file(validation_file, "validation", cache_dir)
            validation = as_conversations(rows, f"--validation_file {validation_file}")
    elif validation_file is not None:
        raise RecipeError("--validation_file needs --train_file; give both")
    elif dataset is not None:
        train_rows, validation_rows, train_split = load_hub_dataset(dataset, cache_dir)
        train = as_conversations(train_rows, f"--dataset {dataset} ({train_split})")
        validation = as_conversations(validation_rows, f"--dataset {dataset}") if validation_rows else None
    else:
        raise RecipeError("give your chats with --train_file (.json or .jsonl), or a hub --dataset")
    if validation is not None:
        return datasets.DatasetDict(train=train, validation=validation)
    if not 0 < validation_size < 1:
        raise RecipeError(
            f"--validation_size {validation_size} must be a fraction between 0 and 1, e.g. 0.05"
        )
    try:
        held_out = train.train_test_split(test_size=validation_size, seed=seed)
    except ValueError as err:  # too few rows for the fraction to leave both sides non-empty
        reason = first_line(err)
        raise RecipeError(
            f"cannot hold out --validation_size {validation_size} ({reason}); give --validation_file"
        )
    return datasets.DatasetDict(train=held_out["train"], validation=held_out["test"])


# ------------------------------------------------------------------------------------ chat template
def check_chat_template(tokenizer, model_name) -> None:
    """A base model's tokenizer has no chat template, and SFT on chats needs one to write the
    turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"{model_name} has no chat template (a base model); fine-tune an -Instruct or chat "
            "model, or put a chat template in the model's folder (chat_template.jinja)"
        )


def render(tokenizer, messages: list[dict], **options) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **options)
    # jinja's raise_exception(...) of templates that refuse a conversation's shape
    except Exception as err:
        roles = "/".join(m["role"] for m in messages)
        reason = first_line(err)
        raise RecipeError(
            f"the chat template refuses a conversation {roles} ({reason}); reshape the chats"
        ) from None


def assistant_turn_end(tokenizer) -> str:
    """What the template writes right after an assistant's content to close the turn ("<|im_end|>"
    for ChatML, "<|eot_id|>" for Llama 3), trailing whitespace left out. It stops generation, so it
    is a training target."""
    sentinel = "Sentinel-7Qz"
    text = render(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": sentinel}])
    if sentinel not in text:
        raise RecipeError(
            "the chat template does not write the assistant's content as given; use a standard template"
        )
    return text[text.index(sentinel) + len(sentinel) :].rstrip()


def template_gaps(tokenizer, messages: list[dict]) -> list[int]:
    """For each message, how many characters of the template's own text (headers, a default system
    message, a thinking block) come between the previous message's content and its own: the
    rendering with placeholders for contents tells. The ordered search skips them, so a content
    equal to a role name or to words of the default system message is not found in the template's
    text. 0s where the template refuses placeholders."""
    holders = [PLACEHOLDER.format(i) for i in range(len(messages))]
    try:
        skeleton = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": h} for m, h in zip(messages, holders)], tokenize=False
        )
    # the template refuses this shape with placeholders; the plain ordered search still works
    except Exception:
        return [0] * len(messages)
    gaps, previous_end = [], 0
    for holder in holders:
        at = skeleton.find(holder, previous_end)
        # the template drops a message (e.g. an earlier
        # thinking turn): nothing to learn from the skeleton
        if at < 0:
            return [0] * len(messages)
        gaps.append(at - previous_end)
        previous_end = at + len(holder)
    return gaps


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, turn_end: str) -> dict:
    """Token ids of the rendered conversation and labels that are the ids on the assistant's turns,
    -100 elsewhere.

    The template renders the whole conversation once; each message's content (stripped, as many
    templates strip it) is found in the text in order, so an answer equal to its question is found
    after it. A token is a target when it carries characters of an assistant's content or of the
    `turn_end` right after it. Tokens past `max_length` are cut. Returns input_ids, labels,
    truncated, num_tokens and num_targets (target tokens kept).
    """
    text = render(tokenizer, messages)
    spans, cursor = [], 0
    for message, gap in zip(messages, template_gaps(tokenizer, messages)):
        content = message["content"].strip()
        # past the template's text before this content; where a template writes contents its own way
        # (the skeleton then misleads), the nearest occurrence after the previous content
        at = text.find(content, cursor + gap)
        if at < 0:
            at = text.find(content, cursor)
        if at < 0:
            raise RecipeError(
                f"a {message['role']} message ({short(content, 40)}) is not in the chat template's "
                "rendering: the template rewrites message contents; use a model whose template "
                "writes them as given"
            )
        end = at + len(content)
        if message["role"] == "assistant":
            if turn_end and text.startswith(turn_end, end):
                end += len(turn_end)
            spans.append((at, end))
        cursor = at + len(content)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    is_target = bytearray(len(text))
    for start, end in spans:
        is_target[start:end] = b"\x01" * (end - start)
    labels = [
        token if end > start and any(is_target[start:end]) else IGNORE_INDEX
        for token, (start, end) in zip(ids, encoding["offset_mapping"])
    ]
    truncated = len(ids) > max_length
    ids, labels = ids[:max_length], labels[:max_length]
    return {
        "input_ids": ids,
        "labels": labels,
        "truncated": truncated,
        "num_tokens": len(ids),
        "num_targets": sum(label != IGNORE_INDEX for label in labels),
    }


def tokenize_row(example: dict, tokenizer, max_length: int, turn_end: str) -> dict:
    return tokenize_conversation(tokenizer, example["messages"], max_length, turn_end)


def tokenize_splits(
    raw: datasets.DatasetDict, tokenizer, max_length: int, num_proc: int | None = None
) -> tuple[datasets.DatasetDict, dict]:
    """Both splits tokenised (columns input_ids, labels, num_tokens, num_targets), and per split the
    counts the recipe
    reports: examples, truncated (longer than max_length), without_targets (dropped: no assistant
    token left within max_length), tokens and target_tokens (of the examples kept)."""
    turn_end = assistant_turn_end(tokenizer)
    tokenized, stats = {}, {}
    for split, conversations in raw.items():
        rows = conversations.map(
            tokenize_row,
            fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "turn_end": turn_end},
            remove_columns=conversations.column_names,
            num_proc=num_proc,
            desc="tokenize",
        )
        kept = rows.filter(lambda count: count > 0, input_columns="num_targets", num_proc=num_proc)
        if len(kept) == 0:
            raise RecipeError(
                f"no example of {split} keeps an assistant token within --max_length {max_length}; "
                "raise --max_length"
            )
        stats[split] = {
            "examples": len(rows),
            "truncated": sum(rows["truncated"]),
            "without_targets": len(rows) - len(kept),
            "tokens": sum(kept["num_tokens"]),
            "target_tokens": sum(kept["num_targets"]),
        }
        tokenized[split] = kept.remove_columns("truncated")
    return datasets.DatasetDict(tokenized), stats


# --------------------------------------------------------------------------------------- evaluation
def generation_prompt(messages: list[dict]) -> tuple[list[dict], str]:
    """The conversation before its last assistant turn (the prompt to answer greedily) and that
    turn's content (the reference the answer is compared with)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise RecipeError(f"conversation {short(messages)} has no assistant turn to compare an answer with")
    return messages[:last], messages[last]["content"]


def normalized(text: str) -> str:
    return " ".join(text.split()).strip(string.punctuation + string.whitespace).casefold()


def exact_match(answer: str, reference: str) -> bool:
    """The answer equals the reference up to case, runs of whitespace and punctuation around it
    ("Fresh." matches "fresh")."""
    return normalized(answer) == normalized(reference)


def ensure_pad_token(tokenizer):
    """Give a tokenizer without a pad token (Llama 3's) its eos token as pad token: padded positions
    are masked out of attention and of the loss, so which id fills them does not matter. Returns the
    tokenizer."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise RecipeError(
                "the tokenizer has neither a pad nor an eos token; give a chat model's tokenizer"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
