"""The SFT recipe's data side on real tokenizers and tiny real models: chat files in every format,
the assistant-only loss mask under three chat templates, truncation, padding and packing."""

import collections
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from chat import model as chat_model
from chat.conversations import (
    assistant_turn_end,
    check_chat_template,
    ensure_pad_token,
    exact_match,
    generation_prompt,
    load_conversations,
    to_messages,
    tokenize_conversation,
    tokenize_splits,
)
from chat.packing import check_packing, collator, token_budget_rows
from chat_fixtures import build_chat_tokenizer, chat_examples, single_turn, write_chat_file
from conftest import PYTHON, REPO, recipe_env, run
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from accelerate_recipes.errors import RecipeError

TEMPLATES = ("chatml", "llama3", "qwen3")


@pytest.fixture(scope="module")
def tokenizers(module_tmp) -> dict:
    root = module_tmp.mktemp("chat-tokenizers")
    return {template: build_chat_tokenizer(root / template, template) for template in TEMPLATES}


def load(train, validation=None, tmp_path=None, validation_size=0.25, seed=0, dataset=None):
    cache = str(tmp_path / "cache") if tmp_path else None
    return load_conversations(train, validation, dataset, cache, validation_size, seed)


def one_line_error(call, *fragments) -> str:
    with pytest.raises(RecipeError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def target_runs(tokenizer, encoded: dict) -> list[str]:
    """The decoded text of each run of consecutive target tokens."""
    runs, current = [], []
    for label in encoded["labels"] + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


# ------------------------------------------------------------------------------------------ formats
def test_every_file_format_reads_to_the_same_messages(tmp_path):
    examples = chat_examples(64, seed=3)
    single = single_turn(examples)
    # the multi-turn and system ones are left to the rest
    assert len(single) >= 20 and len(single) < len(examples)
    for fmt, rows in (
        ("messages", examples),
        ("sharegpt", examples),
        ("alpaca", single),
        ("prompt_completion", single),
    ):
        for suffix in (".json", ".jsonl"):
            train = write_chat_file(tmp_path / f"{fmt}-train{suffix}", rows, fmt)
            validation = write_chat_file(tmp_path / f"{fmt}-dev{suffix}", rows[:5], fmt)
            raw = load(train, validation, tmp_path)
            assert raw["train"].column_names == ["messages"] and raw["validation"].column_names == [
                "messages"
            ]
            assert list(raw["train"]["messages"]) == rows, (fmt, suffix)
            assert list(raw["validation"]["messages"]) == rows[:5], (fmt, suffix)

    # TRL's conversational prompt/completion, and Alpaca's input joined to the instruction
    trl = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is it red?"}],
        "completion": [{"role": "assistant", "content": "yes"}],
    }
    assert to_messages(trl) == trl["prompt"] + trl["completion"]
    alpaca = {"instruction": "Name the colour.", "input": "the sky", "output": "blue"}
    assert to_messages(alpaca) == [
        {"role": "user", "content": "Name the colour.\n\nthe sky"},
        {"role": "assistant", "content": "blue"},
    ]


def test_validation_is_held_out_of_train_without_a_validation_file(tmp_path):
    rows = chat_examples(40, seed=4)
    train = write_chat_file(tmp_path / "train.jsonl", rows, "messages")
    first = load(train, tmp_path=tmp_path, validation_size=0.25, seed=7)
    again = load(train, tmp_path=tmp_path, validation_size=0.25, seed=7)
    assert (len(first["train"]), len(first["validation"])) == (30, 10)
    # the seed decides
    assert list(first["validation"]["messages"]) == list(again["validation"]["messages"])
    held = [json.dumps(m) for m in first["validation"]["messages"]]
    kept = [json.dumps(m) for m in first["train"]["messages"]]
    assert sorted(held + kept) == sorted(json.dumps(m) for m in rows)


def test_a_dataset_folder_uses_its_test_split_for_validation(tmp_path):
    folder = tmp_path / "chats"
    write_chat_file(folder / "train.jsonl", chat_examples(20, seed=0), "sharegpt")
    write_chat_file(folder / "test.jsonl", chat_examples(7, seed=1), "sharegpt")
    raw = load(None, tmp_path=tmp_path, dataset=str(folder))
    assert list(raw["validation"]["messages"]) == chat_examples(7, seed=1)
    assert len(raw["train"]) == 20


def test_an_unreachable_hub_dataset_says_connect_or_give_files(tmp_path):
    code = (
        "from chat import conversations\ntry:\n"
        "    conversations.load_conversations(None, None, 'no-such-user/no-such-chats', None, 0.1, 0)\n"
        "except conversations.RecipeError as err:\n"
        "    print('error:', err)\n"
    )
    proc = run(
        [PYTHON, "-c", code], recipe_env(tmp_path, PYTHONPATH=f"{REPO}:{REPO / 'recipes'}"), timeout=120
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.output[-3000:]
    assert (
        "no-such-user/no-such-chats" in lines[0] and "connect once" in lines[0] and "--train_file" in lines[0]
    )


# ----------------------------------------------------------------------------------------- the mask
@pytest.mark.parametrize("template", TEMPLATES)
def test_the_mask_covers_each_assistant_turn_and_its_end_and_nothing_else(tokenizers, template):
    tokenizer = tokenizers[template]
    turn_end = assistant_turn_end(tokenizer)
    assert turn_end == {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}[template]
    examples = chat_examples(40, seed=5)
    kinds = {(m[0]["role"] == "system", sum(t["role"] == "assistant" for t in m)) for m in examples}
    # system messages and two-answer conversations are covered
    assert {(True, 1), (False, 1), (False, 2)} <= kinds
    for messages in examples:
        encoded = tokenize_conversation(tokenizer, messages, 512, turn_end)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert encoded["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        answers = [m["content"] + turn_end for m in messages if m["role"] == "assistant"]
        assert target_runs(tokenizer, encoded) == answers, text
        assert encoded["num_targets"] == sum(label != -100 for label in encoded["labels"])
        assert encoded["num_tokens"] == len(encoded["input_ids"]) and not encoded["truncated"]


def test_qwen3_masks_the_earlier_answer_that_a_prefix_rendering_gets_wrong(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = [
        {"role": "user", "content": "What colour is the plum?"},
        {"role": "assistant", "content": "purple"},
        {"role": "user", "content": "And what colour is the snow?"},
        {"role": "assistant", "content": "white"},
    ]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    prefix = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    # the last answer's thinking block moves: prefix-and-diff masks break here
    assert not whole.startswith(prefix)
    encoded = tokenize_conversation(tokenizer, messages, 512, assistant_turn_end(tokenizer))
    assert target_runs(tokenizer, encoded) == ["purple<|im_end|>", "white<|im_end|>"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_answers_equal_to_earlier_text_are_found_in_their_own_turn(tokenizers, template):
    tokenizer = tokenizers[template]
    turn_end = assistant_turn_end(tokenizer)
    # the answer repeats the question; then contents equal to the template's own words (a role name,
    # the words of ChatML's default system message), which
    # a search from the start would find in the headers
    for messages in (
        [{"role": "user", "content": "fresh"}, {"role": "assistant", "content": "fresh"}],
        [
            {"role": "user", "content": "You are a helpful assistant."},
            {"role": "assistant", "content": "assistant"},
        ],
        [{"role": "user", "content": "user"}, {"role": "assistant", "content": "user"}],
    ):
        encoded = tokenize_conversation(tokenizer, messages, 512, turn_end)
        assert target_runs(tokenizer, encoded) == [messages[1]["content"] + turn_end]
        # the targets are the last tokens: the answer and its
        # end, with only trailing template text after them
        last_target = max(i for i, label in enumerate(encoded["labels"]) if label != -100)
        assert tokenizer.decode(encoded["input_ids"][last_target + 1 :]).strip() == ""


# --------------------------------------------------------------------------------------- truncation
def test_examples_cut_before_their_answer_are_dropped_and_counted(tmp_path, tokenizers):
    tokenizer = tokenizers["llama3"]
    turn_end = assistant_turn_end(tokenizer)
    rows = chat_examples(48, seed=6)
    raw = load(write_chat_file(tmp_path / "train.jsonl", rows, "messages"), tmp_path=tmp_path)
    full = [tokenize_conversation(tokenizer, m, 512, turn_end) for m in raw["train"]["messages"]]
    first_targets = sorted(next(i for i, label in enumerate(e["labels"]) if label != -100) for e in full)
    # about half the examples lose every answer token
    max_length = first_targets[len(first_targets) // 2]
    cut_off = sum(first >= max_length for first in first_targets)
    assert 0 < cut_off < len(full)

    tokenized, stats = tokenize_splits(raw, tokenizer, max_length)
    train = stats["train"]
    assert train["examples"] == len(full) and train["without_targets"] == cut_off
    assert train["truncated"] == sum(len(e["input_ids"]) > max_length for e in full)
    assert len(tokenized["train"]) == len(full) - cut_off
    assert tokenized["train"].column_names == ["input_ids", "labels", "num_tokens", "num_targets"]
    assert all(0 < n for n in tokenized["train"]["num_targets"])
    assert max(len(ids) for ids in tokenized["train"]["input_ids"]) <= max_length
    assert train["tokens"] == sum(tokenized["train"]["num_tokens"])
    assert train["target_tokens"] == sum(tokenized["train"]["num_targets"])

    message = one_line_error(lambda: tokenize_splits(raw, tokenizer, 3), "raise --max_length")
    assert message == "no example of train keeps an assistant token within --max_length 3; raise --max_length"


# -------------------------------------------------------------------------- batches on a real model
@pytest.fixture(scope="module")
def chat_batch(tiny_chat_model, sft_data, module_tmp):
    """The tiny Llama's tokenizer (pad token set) and 5 tokenised examples of different lengths."""
    tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(tiny_chat_model))
    raw = load(sft_data["train"], sft_data["validation"], module_tmp.mktemp("sft-cache"))
    tokenized, _ = tokenize_splits(raw, tokenizer, 256)
    features = list(tokenized["train"].select(range(12)))
    # distinct lengths, so padding and packing both matter
    by_length = {f["num_tokens"]: f for f in features}
    features = list(by_length.values())[:5]
    assert len(features) >= 4
    return tokenizer, features


def own_logits(model, feature) -> torch.Tensor:
    return model(input_ids=torch.tensor([feature["input_ids"]])).logits[0]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_examples_attend_only_within_themselves(tiny_chat_model, chat_batch, attention):
    tokenizer, features = chat_batch
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation=attention).eval()
    check_packing(model)
    assert model.config.use_cache is False
    batch = collator(tokenizer, packing=True)(features)
    # no mask: positions tell; the cumulative lengths are for
    # a variable-length kernel (chat/packed_attention.py)
    flash_kwargs = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert set(batch) == {"input_ids", "labels", "position_ids", "target_index", *flash_kwargs}
    lengths = [f["num_tokens"] for f in features]
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert batch["cu_seq_lens_q"].tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert batch["max_length_q"] == max(lengths)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k not in ("labels", "target_index")}).logits[0]
        start = 0
        for feature, length in zip(features, lengths):
            assert batch["position_ids"][0, start : start + length].tolist() == list(range(length))
            # each example's first label is dropped: it would be predicted from the previous
            # example's last token
            assert batch["labels"][0, start : start + length].tolist() == [-100] + feature["labels"][1:]
            torch.testing.assert_close(
                packed[start : start + length], own_logits(model, feature), atol=1e-5, rtol=0
            )
            start += length
        # without restarting positions the later examples see
        # the earlier ones: the comparison above can fail
        flat = model(input_ids=batch["input_ids"]).logits[0]
    assert (flat[lengths[0] :] - packed[lengths[0] :]).abs().max() > 1e-3


def answer_losses_and_gradients(model, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.token_losses.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_varlen_attention_gives_the_dense_masks_losses_and_gradients(tiny_chat_model, chat_batch):
    """Packed rows through `varlen` (on the CPU conversation by conversation, from the collator's
    cumulative lengths) give every answer token the loss, and every weight the gradient, that sdpa's
    block-diagonal mask over the whole row gives, within fp32 rounding; padded batches and
    generation are sdpa's, to the bit."""
    from chat import packed_attention
    from chat.answer_loss import use_answer_loss

    tokenizer, features = chat_batch
    packed_attention.register()
    dense = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation="sdpa")
    varlen = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation="varlen")
    # grouped-query attention
    assert varlen.config.num_key_value_heads < varlen.config.num_attention_heads
    for model in (dense, varlen):
        # also turns the cache off, without which sdpa's packed mask is not built
        check_packing(model)
        use_answer_loss(model)
    batch = collator(tokenizer, packing=True)(features)
    expected_losses, expected_gradients = answer_losses_and_gradients(dense, batch)
    losses, gradients = answer_losses_and_gradients(varlen, batch)
    torch.testing.assert_close(losses, expected_losses, atol=1e-6, rtol=1e-5)
    assert gradients.keys() == expected_gradients.keys() and len(gradients) > 0
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], atol=1e-6, rtol=1e-5, msg=name)
    # the lengths decide: told the row is one conversation,
    # varlen attends across them and the losses change
    whole_row = dict(batch, cu_seq_lens_q=torch.tensor([0, batch["input_ids"].shape[1]], dtype=torch.int32))
    with torch.no_grad():
        assert (varlen(**whole_row).token_losses - expected_losses).abs().max() > 1e-3

        padded = collator(tokenizer, packing=False)(features)
        theirs = {k: v for k, v in padded.items() if k != "target_index"}
        assert torch.equal(varlen(**theirs).logits, dense(**theirs).logits)
    prompt = tokenizer(["hello there", "a longer prompt than that"], return_tensors="pt", padding=True)
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(varlen.generate(**prompt, **greedy), dense.generate(**prompt, **greedy))


def test_a_packed_row_under_varlen_builds_no_mask_and_reads_nothing_on_the_host(
    tiny_chat_model, chat_batch, monkeypatch
):
    """A packed row's training pass (forward and backward) under `varlen`, on the path a GPU takes
    (torch's variable-length kernel; a stand-in of the same call here: tests/varlen_stand_in.py):
    transformers builds no mask and does not look for packed sequences in the positions, and nothing
    in the pass reads a tensor's value on the host (the host-read audit's counter; on a GPU each
    read waits for the queue). The same row under sdpa looks for them, reads on the host that it
    found some, and builds its block-diagonal mask: what the counters see. The answer tokens' losses
    are sdpa's."""
    from chat import packed_attention
    from chat.answer_loss import use_answer_loss
    from host_reads import Audit
    from transformers import AttentionMaskInterface, masking_utils
    from varlen_stand_in import use_stand_in

    tokenizer, features = chat_batch
    packed_attention.register()
    batch = collator(tokenizer, packing=True)(features)
    built = collections.Counter()

    def counted(name, function):
        def counting(*args, **kwargs):
            built[name] += 1
            return function(*args, **kwargs)

        return counting

    # where transformers looks for packed sequences, and the
    # mask builder sdpa's and varlen's masks come from
    finder = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(
        masking_utils, "find_packed_sequence_indices", counted("packed sequences found", finder)
    )
    builder = AttentionMaskInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "sdpa", counted("masks built", builder))

    def training_pass(attention: str) -> tuple[torch.Tensor, dict, int]:
        model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation=attention)
        check_packing(model)
        use_answer_loss(model)
        built.clear()
        audit = Audit(Path(__file__))
        try:
            with audit.mode():
                output = model(**batch)
                output.loss.backward()
        finally:
            audit.hook.remove()
        reads = sum(sum(per.values()) for (kind, *_), per in audit.sites.items() if kind in ("read", "shape"))
        return output.token_losses, dict(built), reads

    dense_losses, dense_built, dense_reads = training_pass("sdpa")
    assert dense_built == {"packed sequences found": 1, "masks built": 1} and dense_reads >= 1
    with use_stand_in(monkeypatch):
        losses, varlen_built, varlen_reads = training_pass("varlen")
    assert (varlen_built, varlen_reads) == ({}, 0)
    torch.testing.assert_close(losses, dense_losses, atol=1e-6, rtol=1e-5)


def test_a_filled_packed_row_changes_no_loss_and_compiled_blocks_compile_once_per_length(
    tiny_chat_model, chat_batch
):
    """fill_packed_row lengthens a packed row to a multiple of 128 with one more sequence of its own
    (positions from 0, no labels, its own span in the cumulative lengths): no answer token's loss
    changes, under sdpa's mask and under varlen. The decoder blocks compiled as --compile does (here
    with the aot_eager backend: the same capture, no code generation) give the eager losses, and two
    rows of other lengths in one multiple of 128 compile once."""
    from chat.answer_loss import use_answer_loss

    tokenizer, features = chat_batch
    rows = [features[:3], features[1:4]]
    lengths = [sum(f["num_tokens"] for f in row) for row in rows]
    assert lengths[0] != lengths[1] and -(-lengths[0] // 128) == -(-lengths[1] // 128)
    plain, filled = (
        collator(tokenizer, packing=True),
        collator(tokenizer, packing=True, pad_to_multiple_of=128),
    )
    batch = filled(rows[0])
    width = -(-lengths[0] // 128) * 128
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, width)
    assert batch["cu_seq_lens_q"].tolist() == [*plain(rows[0])["cu_seq_lens_q"].tolist(), width]
    assert batch["position_ids"][0, lengths[0] :].tolist() == list(range(width - lengths[0]))
    fill = batch["input_ids"][0, lengths[0] :]
    assert (batch["labels"][0, lengths[0] :] == -100).all() and (fill == tokenizer.pad_token_id).all()
    assert torch.equal(batch["target_index"], plain(rows[0])["target_index"])

    from chat import packed_attention

    packed_attention.register()
    for attention in ("sdpa", "varlen"):
        model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation=attention)
        check_packing(model)
        use_answer_loss(model)
        with torch.no_grad():
            expected = model(**plain(rows[0])).token_losses
            torch.testing.assert_close(model(**batch).token_losses, expected, atol=1e-6, rtol=1e-5)
    eager = [model(**filled(row)).loss for row in rows]  # varlen, not compiled
    chat_model.compile_blocks(model, "aot_eager")
    torch._dynamo.reset()
    torch.testing.assert_close(model(**filled(rows[0])).loss, eager[0], atol=1e-6, rtol=1e-5)
    # the second row's length compiles nothing new
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(model(**filled(rows[1])).loss, eager[1], atol=1e-6, rtol=1e-5)
    torch._dynamo.reset()


# What choose_attention reads of an Accelerator: its device and mixed precision.
ON_THE_CPU = SimpleNamespace(device=torch.device("cpu"), mixed_precision="bf16")


def reference_kernel(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale=None, enable_gqa=False
):
    """What torch's variable-length flash kernel computes (its documented contract), in plain sdpa
    on the CPU: the kernel itself runs on CUDA only. [T, heads, head_dim] in and out."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    assert enable_gqa or key.shape[1] == query.shape[1], (
        "a kernel without enable_gqa needs one K/V head per Q head"
    )
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    assert max_q == max(lengths)
    pieces = [
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)
        for q, k, v in zip(*(x.transpose(0, 1).split(lengths, dim=1) for x in (query, key, value)))
    ]
    return torch.cat(pieces, dim=1).transpose(0, 1)


def kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)


def kernel_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None
):
    return reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale)


def kernel_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                enable_gqa=False):  # fmt: skip
    assert window_size in ((-1, -1), (-1, 0))
    causal = window_size == (-1, 0)
    return reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, enable_gqa)


@pytest.mark.parametrize("kernel", [kernel_2_10, kernel_2_11, kernel_2_12], ids=["2.10", "2.11", "2.12"])
@pytest.mark.parametrize("scaling", [None, 0.1], ids=["default-scale", "own-scale"])
def test_the_kernel_call_fits_each_torch_signature(kernel, scaling, monkeypatch):
    """The GPU path's call of torch.nn.attention.varlen.varlen_attn, whose keywords changed between
    releases (causal as is_causal or as a window, scale and grouped-query support or not), computes
    what the CPU path computes. A stand-in with each release's documented signature takes the
    kernel's place: the kernel itself needs CUDA."""
    import inspect

    from chat import packed_attention

    monkeypatch.setattr(packed_attention, "varlen_attn", kernel)
    monkeypatch.setattr(packed_attention, "KERNEL_KEYWORDS", set(inspect.signature(kernel).parameters))
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    cu_seq_lens = torch.tensor([0, 5, 6, 15, 18])  # int64, as the collator makes them
    query = torch.randn(1, 4, sum(lengths), 8)
    key, value = torch.randn(2, 1, 2, sum(lengths), 8)  # 2 key/value heads for 4 query heads
    scale = 8**-0.5 if scaling is None else scaling
    expected = packed_attention.per_conversation(query, key, value, cu_seq_lens, scale, dropout=0.0)
    got = packed_attention.flash_varlen(query, key, value, cu_seq_lens, max(lengths), scale)
    assert got.shape == (sum(lengths), 4, 8)
    torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=1e-5)
    # the kernel needs a GPU
    assert packed_attention.choose_attention(None, True, ON_THE_CPU) is None
    assert packed_attention.choose_attention("eager", True, ON_THE_CPU) == "eager"


def test_under_autocast_the_kernel_gets_the_autocast_dtype(monkeypatch):
    """In a full fine-tune under bf16 autocast, RoPE leaves queries and keys in fp32 (fp32 master
    weights, fp32 cos/sin) and values in bf16; the kernel, which takes bf16/fp16 only, gets all
    three in bf16, as sdpa would."""
    from chat import packed_attention

    seen = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        seen.append({x.dtype for x in (query, key, value)})
        return reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, True, scale)

    monkeypatch.setattr(packed_attention, "varlen_attn", kernel)
    monkeypatch.setattr(packed_attention, "KERNEL_KEYWORDS", {"scale", "window_size"})
    # as on an A100 or H100
    monkeypatch.setattr(packed_attention, "kernel_runs_on", lambda device: True)
    query, key = torch.randn(2, 1, 2, 10, 8)
    value = torch.randn(1, 2, 10, 8, dtype=torch.bfloat16)
    cu_seq_lens = torch.tensor([0, 4, 10], dtype=torch.int32)
    module = torch.nn.Module()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_attention.varlen_attention(module, query, key, value, None, cu_seq_lens_q=cu_seq_lens,
                                                   max_length_q=6)  # fmt: skip
    assert seen == [{torch.bfloat16}] and out.shape == (1, 10, 2, 8) and out.dtype == torch.bfloat16
    expected = packed_attention.per_conversation(query, key, value.float(), cu_seq_lens, 8**-0.5, 0.0)
    # bf16 inputs: bf16 tolerance
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


class CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the copies made to fp32 (aten._to_copy to float32) while active."""

    def __init__(self):
        super().__init__()
        self.to_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.to_fp32 += func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32
        return func(*args, **kwargs)


def test_lora_inputs_stay_in_the_autocast_dtype_with_the_same_numbers(tiny_chat_model, chat_batch):
    """A LoRA model as the chat recipes build it for bf16 (bf16 base, fp32 adapters): under autocast
    no adapted layer's input is copied to fp32 and back any more, and the loss and every adapter
    gradient are the same to the bit; without autocast (generation) the input is cast and the model
    runs."""
    import peft

    tokenizer, features = chat_batch
    args = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear")
    batch = collator(tokenizer, packing=False)(features[:2])
    theirs = {k: v for k, v in batch.items() if k != "target_index"}

    def loss_gradients_and_casts(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), CastCounter() as counter:
            loss = model(**theirs).loss
            loss.backward()
        gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), gradients, counter.to_fp32

    models = []
    for installed in (False, True):
        base = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.bfloat16)
        torch.manual_seed(0)
        model = chat_model.add_lora(base, args)
        if installed:  # what build_model installs on each LoRA layer
            for layer in model.modules():
                if isinstance(layer, peft.tuners.lora.LoraLayer):
                    layer._cast_input_dtype = chat_model.cast_adapter_input_outside_autocast.__get__(layer)
        # random B (not peft's zeros), the same in both models
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1
        models.append(model)
    layers = sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in models[1].modules())
    assert (
        layers == 14
        and next(p for n, p in models[1].named_parameters() if "lora_A" in n).dtype == torch.float32
    )
    stock_loss, stock_gradients, stock_casts = loss_gradients_and_casts(models[0])
    loss, gradients, casts = loss_gradients_and_casts(models[1])
    # gone: the forward copy of each adapted input, and the backward copy of its gradient (but for
    # the first block's q/k/v projections, whose input,
    # the frozen embeddings' output, needs no gradient)
    assert stock_casts - casts == layers + (layers - 3)
    assert torch.equal(loss, stock_loss)
    assert gradients.keys() == stock_gradients.keys() and len(gradients) == 2 * layers
    for name, gradient in gradients.items():
        assert torch.equal(gradient, stock_gradients[name]), name
    prompt = tokenizer(["hello there"], return_tensors="pt")
    # outside autocast the bf16 input meets fp32 adapters: peft's cast is still needed
    with torch.no_grad():
        models[1].generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)


def test_packing_refuses_attention_that_would_mix_examples(tiny_chat_model):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # a user's own kernel registered by name: nothing tells it where packed examples start
    AttentionInterface.register("my_kernel", sdpa_attention_forward)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation="my_kernel")
    one_line_error(lambda: check_packing(model), "--packing", "'my_kernel'", "sdpa", "drop --packing")


def test_padded_batch_masks_padding_and_matches_examples_one_by_one(tiny_chat_model, chat_batch):
    tokenizer, features = chat_batch
    # Llama 3 has no pad token of its own
    assert tokenizer.pad_token == tokenizer.eos_token == "<|eot_id|>"
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation="sdpa").eval()
    batch = collator(tokenizer, packing=False, pad_to_multiple_of=8)(features)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "target_index"}
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width >= max(f["num_tokens"] for f in features)
    for row, feature in enumerate(features):
        length = feature["num_tokens"]
        # padded on the right
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (width - length)
        assert batch["labels"][row].tolist() == feature["labels"] + [-100] * (width - length)

    def summed_loss(logits, labels):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")

    with torch.no_grad():
        # transformers' own loss
        out = model(**{k: v for k, v in batch.items() if k != "target_index"})
        together = summed_loss(out.logits, batch["labels"])
        one_by_one = sum(
            summed_loss(own_logits(model, f)[None], torch.tensor([f["labels"]])) for f in features
        )
    torch.testing.assert_close(together, one_by_one, atol=1e-4, rtol=1e-5)
    targets = (batch["labels"][:, 1:] != -100).sum()
    # position 0 is never a target (the template's header)
    assert targets == sum(f["num_targets"] for f in features)
    # transformers' mean is over the same targets
    torch.testing.assert_close(out.loss, together / targets)

    # a tokenizer that pads on the left (some do, for
    # generation) still gets right-padded training batches
    tokenizer.padding_side = "left"
    try:
        again = collator(tokenizer, packing=False)(features)
    finally:
        tokenizer.padding_side = "right"
    assert again["attention_mask"][:, 0].all()


def loss_and_gradients(model, batch: dict, targets: int) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    # num_items_in_batch as the recipe passes it: the answer
    # tokens of the whole step (here 3x this micro-batch's)
    loss = model(**batch, num_items_in_batch=torch.tensor(3 * targets)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_answer_loss_is_transformers_loss(tiny_chat_model, chat_batch, packing, lora, monkeypatch):
    """answer_loss's forward pass (the answer positions' logits only, in chunks of 5 here, each made
    again in the backward pass) gives transformers' loss and gradients within fp32 rounding, for
    every target the collator found; without labels the model is its own (generation)."""
    import copy

    import peft
    from chat import answer_loss

    tokenizer, features = chat_batch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, attn_implementation="sdpa")
    if lora:  # random B (not peft's zeros) so that the adapter changes the loss
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        )
    batch = collator(tokenizer, packing=packing)(features)
    # an example's first token is never one (the template's header)
    targets = sum(f["num_targets"] for f in features)
    assert len(batch["target_index"]) == targets == (batch["labels"][:, 1:] != -100).sum()
    theirs = {k: v for k, v in batch.items() if k != "target_index"}
    expected_loss, expected_gradients = loss_and_gradients(model, theirs, targets)

    swapped = copy.deepcopy(model)
    # several chunks, the last short
    monkeypatch.setattr(answer_loss, "CHUNK_LOGITS", 5 * swapped.config.vocab_size)
    assert answer_loss.use_answer_loss(swapped)
    loss, gradients = loss_and_gradients(swapped, batch, targets)
    assert abs(loss - expected_loss) <= 1e-6 * expected_loss, (loss, expected_loss)
    assert gradients.keys() == expected_gradients.keys() and len(gradients) > 0
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        out = swapped(**batch)
        assert out.token_losses.shape == (targets,) and out.token_losses.dtype == torch.float32
        # no num_items_in_batch: their mean
        torch.testing.assert_close(out.loss, out.token_losses.mean())
        # without target_index: its own
        torch.testing.assert_close(swapped(**theirs).logits, model(**theirs).logits)


def test_logits_a_model_transforms_come_from_its_own_forward_pass(chat_batch):
    """Gemma 2 soft-caps its logits (tanh), which the output layer's product alone would miss: its
    loss is taken from its own logits at the answer positions, and still equals transformers'."""
    from chat.answer_loss import use_answer_loss
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer, features = chat_batch
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2
    )
    config.update(
        dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5)
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    batch = collator(tokenizer, packing=False)(features)
    with torch.no_grad():
        expected = model(**{k: v for k, v in batch.items() if k != "target_index"}).loss
        assert use_answer_loss(model) is False  # not a plain product: its own forward pass
        torch.testing.assert_close(model(**batch).loss, expected, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------- evaluation
def test_generation_prompt_and_exact_match():
    messages = chat_examples(40, seed=8)
    two_answers = next(m for m in messages if sum(t["role"] == "assistant" for t in m) == 2)
    prompt, reference = generation_prompt(two_answers)
    assert (
        prompt == two_answers[:-1]
        and prompt[-1]["role"] == "user"
        and reference == two_answers[-1]["content"]
    )
    assert exact_match("  Fresh. ", "fresh")
    assert exact_match("The review   is\nfresh.", "the review is fresh")
    assert not exact_match("not fresh", "fresh")
    assert not exact_match("rotten", "fresh")


# --------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_are_one_line_errors_naming_the_fix(tmp_path, tokenizers):
    missing = tmp_path / "nowhere.jsonl"
    one_line_error(lambda: load(missing, tmp_path=tmp_path), str(missing), "does not exist", ".jsonl")
    csv = tmp_path / "chats.csv"
    csv.write_text("prompt,completion\nhi,hello\n")
    one_line_error(lambda: load(csv, tmp_path=tmp_path), "'.csv'", ".json or .jsonl")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"messages": [')
    one_line_error(
        lambda: load(broken, tmp_path=tmp_path), "could not read --train_file", "check the file's format"
    )

    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "a warm film"}\n')
    expected = (
        f"--train_file {texts} row 1",
        "fits no chat format",
        "'messages'",
        "'conversations'",
        "'prompt'",
    )
    one_line_error(lambda: load(texts, tmp_path=tmp_path), *expected)
    roles = tmp_path / "roles.jsonl"
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    odd = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "hello"}]}
    roles.write_text(json.dumps(ok) + "\n" + json.dumps(odd) + "\n")
    one_line_error(lambda: load(roles, tmp_path=tmp_path), "row 2", "'robot'", "system, user, assistant")
    one_line_error(
        lambda: to_messages({"messages": [{"role": "user", "content": "hi"}]}), "no assistant turn"
    )

    base = build_chat_tokenizer(tmp_path / "base", "chatml")
    base.chat_template = None
    one_line_error(
        lambda: check_chat_template(base, "tiny-base"), "tiny-base", "no chat template", "-Instruct"
    )
    check_chat_template(tokenizers["chatml"], "tiny-chat")

    train = write_chat_file(tmp_path / "train.jsonl", chat_examples(8, seed=0), "messages")
    one_line_error(lambda: load(train, tmp_path=tmp_path, validation_size=1.5), "--validation_size 1.5")
    one_line_error(lambda: load(None, train, tmp_path=tmp_path), "--validation_file needs --train_file")


def test_rows_of_a_token_budget_hold_every_conversation_once_and_come_near_full():
    """Best-fit decreasing over 2,000 lengths of 20-600 tokens into rows of 4,096: each conversation
    in exactly one row, no row over the budget, and within 2% of the fewest rows the tokens need; a
    conversation longer than the budget is refused by name."""
    import random

    draw = random.Random(0)
    lengths = [draw.randint(20, 600) for _ in range(2000)]
    rows = token_budget_rows(lengths, 4096)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 4096
    fewest = -(-sum(lengths) // 4096)
    assert len(rows) <= fewest * 1.02 + 1
    assert token_budget_rows(lengths, 4096) == rows  # the same rows on every process
    with pytest.raises(RecipeError, match="--batch_tokens 500"):
        token_budget_rows([100, 600], 500)


def test_liger_kernels_are_refused_by_name_off_a_gpu(tiny_chat_model):
    """--liger patches Triton kernels, which run on CUDA alone: on the CPU the run stops before
    training, in one line naming the flag."""
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    with pytest.raises(RecipeError, match="--liger .* need a CUDA GPU"):
        chat_model.use_liger_kernels(model, "cpu")


def test_liger_kernels_keep_the_decoder_blocks_eager():
    """--liger and compiled blocks fuse the same layers two ways, and Liger Kernel's are not
    compiled (0.8.5 marks its rotary embedding torch.compiler.disable: a graph break in every
    block): on a GPU the blocks compile by default without --liger and not with it, which one line
    says, and --compile with --liger is refused in one line, as sft.py settles its flags."""
    import sft
    import sft_data
    from accelerate.utils import DistributedType

    printed = []
    on_a_gpu = SimpleNamespace(
        device=torch.device("cuda"), distributed_type=DistributedType.NO, print=printed.append
    )
    assert chat_model.compiles(None, on_a_gpu) is True and not printed
    assert chat_model.compiles(None, on_a_gpu, liger=True) is False
    assert len(printed) == 1 and "\n" not in printed[0] and "Liger" in printed[0]
    one_line_error(lambda: chat_model.compiles(True, on_a_gpu, liger=True), "--liger and --compile")
    one_line_error(
        lambda: sft_data.launch_flags(sft.SftFlags(liger=True, compile=True), on_a_gpu),
        "--liger and --compile",
    )
    args = sft.SftFlags(liger=True)
    settled, _ = sft_data.launch_flags(args, on_a_gpu)
    assert settled.compile is False and args.compile is None  # a settled copy; the flags as given
