"""Chat tokenizers built offline: byte-level BPE trained here on given text, with the special tokens and chat template
of the families users fine-tune (Qwen2.5's ChatML, Llama 3, Qwen3's thinking blocks). The SFT tests and gpu-check's
sft step build their tokenizers with it; each passes its own corpus.
"""

from pathlib import Path

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Our own Jinja templates. ChatML as Qwen2.5 writes it: a default system message when the conversation has none.
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
# Qwen3 without generation markers: only the last assistant turn (or the generation prompt) carries an empty thinking
# block, so the rendering of a prefix is not a prefix of the whole rendering.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_assistant=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{%- set ns.last_assistant = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.index0 == ns.last_assistant and not add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "qwen3": QWEN3_TEMPLATE}


def build_chat_tokenizer(folder: Path, corpus: list[str], template: str = "chatml", vocab_size: int = 512):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on the lines of `corpus`, with the special tokens and
    chat template of `template` ("chatml", "llama3" or "qwen3"), saved to `folder` and returned as the transformers
    tokenizer."""
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
    # offsets of byte-level tokens point at the text itself (a leading space included), as in GPT-2/Qwen/Llama 3
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    if template == "llama3":
        bos = "<|begin_of_text|>"
        # Llama 3 prepends bos when asked for special tokens; the template writes it too, so SFT must not ask.
        bpe.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
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
