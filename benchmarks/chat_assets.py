"""Chat tokenizers, models and conversations built offline.

The tokenizers are byte-level BPE trained here on given text, with the special tokens and chat
template of the families users fine-tune (Qwen2.5's ChatML, Llama 3, Qwen3's thinking blocks); the
SFT tests build theirs with it, each on its own corpus. `write_chat_assets` writes a whole input set
(model of a given Qwen2 shape with random weights, its tokenizer, generated conversations) for
gpu-check's sft step and the sharding lesson (benchmarks/sharding.py).
"""

import json
import random
from pathlib import Path

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# Our own Jinja templates. ChatML as Qwen2.5 writes it: a default system message when the
# conversation has none.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3: bos first, each turn's content trimmed between a header and <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen3 without generation markers: only the last assistant turn (or the generation prompt) carries
# an empty thinking block, so the rendering of a prefix is not a prefix of the whole rendering.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_assistant=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{%- set ns.last_assistant = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.index0 == ns.last_assistant and not "
    "add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] | trim + '<|im_end|>\\n' "
    "}}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "qwen3": QWEN3_TEMPLATE}


def build_chat_tokenizer(folder: Path, corpus: list[str], template: str = "chatml", vocab_size: int = 512):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on the lines of `corpus`, with the
    special tokens and chat template of `template` ("chatml", "llama3" or "qwen3"), saved to
    `folder` and returned as the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; one of {', '.join(TEMPLATES)}")
    specials = LLAMA3_SPECIALS if template == "llama3" else CHATML_SPECIALS
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    # offsets of byte-level tokens point at the text itself
    # (a leading space included), as in GPT-2/Qwen/Llama 3
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    if template == "llama3":
        bos = "<|begin_of_text|>"
        # Llama 3 prepends bos when asked for special tokens; the template writes it too, so SFT
        # must not ask.
        bpe.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A",
                    pair=f"{bos} $A {bos} $B",
                    special_tokens=[(bos, bpe.token_to_id(bos))],
                ),
            ]
        )
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token="<|eot_id|>")
    else:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
        )
    tokenizer.chat_template = TEMPLATES[template]
    tokenizer.save_pretrained(folder)
    return tokenizer


# Generated chat data for gpu-check's sft step and the sharding lesson: a learnable task (an
# animal's fixed traits,
# a word list sorted or reversed) in conversations of a system message and 2-3 user/assistant turns,
# about 450 tokens each with the tokenizer built here.
ANIMALS = (
    "otter badger heron falcon beaver lynx marten puffin walrus gecko iguana tapir ibex bison moose lemur "
    "panda koala "
    "wombat jackal hyena osprey pelican condor"
).split()
TRAITS = {
    "colour": "brown grey white black golden red spotted striped".split(),
    "home": [
        "river banks",
        "dense forests",
        "open grasslands",
        "rocky coasts",
        "high mountains",
        "dry deserts",
    ],
    "food": [
        "fish",
        "insects",
        "grasses",
        "small mammals",
        "fruit",
        "roots and tubers",
        "seeds",
        "shellfish",
    ],
    "size": ["tiny", "small", "medium-sized", "large", "very large"],
    "habit": [
        "hunts at night",
        "sleeps through the winter",
        "lives in large groups",
        "travels alone",
        "builds nests every spring",
        "migrates each autumn",
        "digs long burrows",
        "swims for hours",
    ],
}
LIST_WORDS = (
    "apple river stone cloud garden lantern mirror pencil saddle thunder violin window anchor basket candle "
    "desert "
    "feather glacier harbor island jungle kettle ladder meadow needle orchard pepper quilt ribbon silver "
    "tunnel "
    "umbrella valley walnut bridge castle dragon engine forest"
).split()
CHAT_SYSTEMS = [
    "You are a careful assistant for a nature reserve. Answer every question completely, in plain sentences, "
    "and "
    "keep to the facts you were taught about each animal.",
    "You are a patient tutor. When asked to order or reverse a list, give every item exactly once, separated "
    "by "
    "commas, and say nothing else that could confuse the student.",
    "You are a helpful assistant who answers questions about animals and word lists. Be thorough but do not "
    "invent "
    "anything that was not asked.",
]
# Each animal's traits are fixed (drawn once by name),
# so the answers are a function of the question.
ANIMAL_TRAITS = {a: {k: random.Random(f"{a}-{k}").choice(v) for k, v in TRAITS.items()} for a in ANIMALS}
# Qwen/Qwen2.5-0.5B-Instruct's config.json on the Hugging
# Face Hub: its shape, built here with random weights.
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
# The same architecture in miniature, for --quick and the CPU (the vocabulary is the tokenizer's).
TINY_QWEN2 = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def chat_turn(rng: random.Random) -> tuple[str, str]:
    """One question and its answer: an animal's traits, or a word list in alphabetical or reverse
    order."""
    if rng.random() < 0.5:
        animal = rng.choice(ANIMALS)
        t = ANIMAL_TRAITS[animal]
        question = (
            f"Tell me everything you know about the {animal}: its colour, where it lives, what it eats, how "
            "big it "
            "is and one of its habits."
        )
        answer = (
            f"The {animal} is a {t['size']} animal with a {t['colour']} coat. It lives in {t['home']}, where "
            "it feeds "
            f"mostly on {t['food']}. One thing worth knowing is that the {animal} {t['habit']}. In short, "
            "the "
            f"{animal} is {t['size']}, {t['colour']}, at home in {t['home']} and fond of {t['food']}."
        )
        return question, answer
    words = rng.sample(LIST_WORDS, rng.randint(14, 24))
    if rng.random() < 0.5:
        return (
            f"Put these words in alphabetical order: {', '.join(words)}.",
            f"Here are the {len(words)} words in alphabetical order: {', '.join(sorted(words))}.",
        )
    return (
        f"Write this list backwards, last word first: {', '.join(words)}.",
        f"Here is the list backwards: {', '.join(reversed(words))}.",
    )


def chat_conversations(count: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        messages = [{"role": "system", "content": rng.choice(CHAT_SYSTEMS)}]
        for _ in range(rng.randint(2, 3)):
            question, answer = chat_turn(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        conversations.append(messages)
    return conversations


def write_chat_assets(
    folder: Path, shape: dict, train: int, validation: int, dtype: str = "bfloat16"
) -> dict:
    """A chat model and `messages` JSONL files for the SFT recipe, without internet: a ChatML
    byte-level BPE tokenizer trained on the data, and a Qwen2 model of `shape` (Qwen2Config fields;
    the vocabulary defaults to the tokenizer's) with random weights in `dtype`. Also the parameters
    that take part in matrix multiplies (for MFU)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, count, seed in (("train", train, 0), ("validation", validation, 1)):
        conversations = chat_conversations(count, seed)
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    corpus = [m["content"] for messages in chat_conversations(300, seed=2) for m in messages]
    # what the template writes
    corpus += ["system", "user", "assistant", "You are a helpful assistant."]
    model_dir = folder / "model"
    tokenizer = build_chat_tokenizer(model_dir, corpus, "chatml")
    config = Qwen2Config(
        **{"vocab_size": len(tokenizer), **shape},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    # Every linear layer's weights and biases; a tied output
    # head is the embedding matrix, counted here once.
    matmul = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    layers, hidden = config.num_hidden_layers, config.hidden_size
    del model
    return {
        "model": str(model_dir),
        "train": str(files["train"]),
        "validation": str(files["validation"]),
        "matmul_parameters": matmul,
        "layers": layers,
        "hidden": hidden,
    }
