"""Tiny chat models and chat data for the SFT recipe's tests, built offline in well under a second.

The tokenizers are byte-level BPE models trained here on a generated corpus, with chat templates
written to behave like the families users fine-tune (Qwen2.5's ChatML, Llama 3, Qwen3's thinking
blocks; built by benchmarks/chat_assets.py); the models are randomly initialised Llama / Qwen2
networks of a few thousand parameters, saved as folders the Auto classes load.
"""

import json
import random
from pathlib import Path

# benchmarks/: the templates and the tokenizer builder gpu-check's sft step uses too
import chat_assets

# ------------------------------------------------------------------------------- the learnable task
# Colours are a fixed mapping (object -> colour), reviews are fresh when their adjectives are
# positive: both learnable by a tiny model, with answers
# of different token lengths and short references.
COLOURS = {
    "banana": "yellow",
    "lemon": "yellow",
    "tomato": "red",
    "cherry": "red",
    "grass": "green",
    "leaf": "green",
    "sky": "blue",
    "ocean": "blue",
    "plum": "purple",
    "grape": "purple",
    "carrot": "orange",
    "pumpkin": "orange",
    "snow": "white",
    "cloud": "white",
    "coal": "black",
    "crow": "black",
}
POSITIVE_WORDS = "warm funny charming clever moving brilliant lovely gripping".split()
NEGATIVE_WORDS = "dull boring clumsy tedious awful flat bland messy".split()
NOUNS = "film movie story show drama comedy".split()
SYSTEM_PROMPTS = ["You answer in one word.", "You are a film critic.", "Be brief."]
# Words the templates themselves write, which the corpus covers so they are few tokens each.
TEMPLATE_WORDS = "system user assistant You are a helpful assistant. think".split()

ARCH_TEMPLATES = {"llama": "llama3", "qwen2": "chatml"}


def review(rng: random.Random, fresh: bool) -> str:
    words = POSITIVE_WORDS if fresh else NEGATIVE_WORDS
    first, second = rng.sample(words, 2)
    return f"a {first}, {second} {rng.choice(NOUNS)}"


def colour_turn(rng: random.Random, follow_up: bool = False) -> tuple[str, str]:
    thing = rng.choice(sorted(COLOURS))
    question = f"And what colour is the {thing}?" if follow_up else f"What colour is the {thing}?"
    return question, COLOURS[thing]


def review_turn(rng: random.Random) -> tuple[str, str]:
    fresh = rng.random() < 0.5
    verdict = "fresh" if fresh else "rotten"
    if rng.random() < 0.3:  # the longer answer: a whole sentence
        return f"In a sentence: is '{review(rng, fresh)}' fresh or rotten?", f"The review is {verdict}."
    return f"Is '{review(rng, fresh)}' fresh or rotten?", verdict


def chat_examples(n: int, seed: int) -> list[list[dict]]:
    """n conversations of the learnable task: single-turn colour or review questions, a third with a
    system message, a quarter with two assistant turns (a colour question, then a follow-up)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.25:
            for follow_up in (False, True):
                question, answer = colour_turn(rng, follow_up)
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        else:
            question, answer = colour_turn(rng) if rng.random() < 0.5 else review_turn(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        examples.append(messages)
    return examples


# ---------------------------------------------------------------------------------------- tokenizer
def corpus(rng: random.Random, lines: int = 600) -> list[str]:
    """English-ish lines using every word the task and the templates write, so BPE merges them into
    few tokens."""
    words = (
        list(COLOURS)
        + list(COLOURS.values())
        + POSITIVE_WORDS
        + NEGATIVE_WORDS
        + NOUNS
        + TEMPLATE_WORDS
        + " ".join(SYSTEM_PROMPTS).split()
        + "the is what colour and in sentence or fresh rotten review one word brief critic film".split()
    )
    # contents one per line, as the templates write them:
    # answers start a line, with no space before them
    examples = chat_examples(lines // 2, seed=rng.randrange(1 << 30))
    text = ["\n".join(["user", *(m["content"] for m in example), "assistant"]) for example in examples]
    text += [" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines // 2)]
    text += [
        "\n".join(words),
        "\n".join(word.capitalize() for word in words),
        "system\nYou are a helpful assistant.",
    ]
    return text


def build_chat_tokenizer(folder: Path, template: str = "chatml"):
    """A byte-level BPE tokenizer (vocabulary 512) trained on `corpus`, with the special tokens and
    chat template of `template` ("chatml", "llama3" or "qwen3"), saved to `folder` and returned as
    the transformers tokenizer."""
    return chat_assets.build_chat_tokenizer(folder, corpus(random.Random(0)), template)


# -------------------------------------------------------------------------------------------- model
def build_tiny_causal_lm(
    folder: Path, arch: str = "llama", template: str | None = None, seed: int = 0
) -> Path:
    """A randomly initialised 2-layer causal LM ("llama" or "qwen2": hidden 32, 4 heads, 2 KV heads,
    no dropout) and its chat tokenizer (llama: "llama3", qwen2: "chatml" unless `template`), saved
    together in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCH_TEMPLATES:
        raise ValueError(f"unknown arch {arch!r}; one of {', '.join(ARCH_TEMPLATES)}")
    folder = Path(folder)
    tokenizer = build_chat_tokenizer(folder, template or ARCH_TEMPLATES[arch])
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_dropout=0.0,
        tie_word_embeddings=True,  # as the small Qwen2.5 and Llama 3.2 checkpoints do
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_class, model_class = (
        (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    )
    torch.manual_seed(seed)
    model = model_class(config_class(**shape))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    return folder


# -------------------------------------------------------------------------------------------- files
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}
CHAT_FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")


def as_row(messages: list[dict], fmt: str) -> dict:
    if fmt == "messages":
        return {"messages": messages}
    if fmt == "sharegpt":
        return {
            "conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in messages]
        }
    user = [m["content"] for m in messages if m["role"] == "user"]
    answer = [m["content"] for m in messages if m["role"] == "assistant"]
    if len(user) != 1 or len(answer) != 1 or messages[0]["role"] == "system":
        raise ValueError(f"{fmt} holds one user turn and one answer without a system message, not {messages}")
    if fmt == "alpaca":
        return {"instruction": user[0], "input": "", "output": answer[0]}
    if fmt == "prompt_completion":
        return {"prompt": user[0], "completion": answer[0]}
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(CHAT_FORMATS)}")


def write_chat_file(path: Path, examples: list[list[dict]], fmt: str) -> Path:
    """Conversations in one on-disk format ("messages", "sharegpt", "alpaca", "prompt_completion"):
    a JSON list for .json, one object per line for .jsonl. Alpaca and prompt/completion take
    single-turn examples without system."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [as_row(messages, fmt) for messages in examples]
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def single_turn(examples: list[list[dict]]) -> list[list[dict]]:
    """The examples alpaca and prompt/completion can hold: one user turn, one answer, no system
    message."""
    return [m for m in examples if len(m) == 2 and m[0]["role"] == "user"]
