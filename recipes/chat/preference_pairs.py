"""Preference pairs for the DPO recipe (dpo.py): reading them, rendering them with the chat
template, and batching.

A pair is a prompt (a conversation that ends with a user turn) and two answers to it, `chosen` (the
better one) and `rejected`. Rows come in TRL's preference formats:

- text: {"prompt": "...", "chosen": "...", "rejected": "..."} (the prompt becomes one user turn);
- conversational, explicit prompt: {"prompt": [messages], "chosen": [assistant messages],
  "rejected": [...]};
- conversational, implicit prompt: {"chosen": [whole conversation], "rejected": [whole
  conversation]}; the turns the two share from the start are the prompt, the rest of each is its
  answer.

Each answer is rendered after the prompt by the model's own chat template, so its tokens are exactly
those the model reads at inference, with the token that ends the turn.
"""

from dataclasses import dataclass

import datasets
import torch

from accelerate_recipes import RecipeError
from accelerate_recipes.errors import first_line

from .answer_loss import IGNORE_INDEX
from .conversations import hold_out, listed_messages, read_split_files, short
from .packing import ChatCollator, collator


def as_messages(value, role: str, row: dict, column: str) -> list[dict]:
    """A column as a list of messages: text becomes one turn of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return listed_messages(value, row, f"'{column}'")


def as_pair(row: dict, where: str) -> dict:
    """One row of any supported format as {prompt: messages, chosen: messages, rejected:
    messages}."""
    missing = [c for c in ("chosen", "rejected") if row.get(c) is None]
    if missing:
        raise RecipeError(
            f"{where}: no {' or '.join(repr(c) for c in missing)} column; a preference pair needs "
            "'chosen' and 'rejected' (and 'prompt', unless both answers are whole conversations)"
        )
    try:
        chosen = as_messages(row["chosen"], "assistant", row, "chosen")
        rejected = as_messages(row["rejected"], "assistant", row, "rejected")
        if row.get("prompt") is not None:
            prompt = as_messages(row["prompt"], "user", row, "prompt")
        else:  # implicit prompt: the turns both conversations share from the start
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None
    if not prompt or prompt[-1]["role"] != "user":
        raise RecipeError(
            f"{where}: the prompt must end with a user turn; give a 'prompt' column or whole conversations"
        )
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if (
            any(m["role"] != "assistant" for m in answer)
            or not "".join(str(m["content"]) for m in answer).strip()
        ):
            raise RecipeError(
                f"{where}: the {name} answer is empty or not the assistant's; give each pair two answers"
            )
    if chosen == rejected:
        raise RecipeError(
            f"{where}: the chosen and rejected answers are the same; a pair needs two different answers"
        )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "row": where}


def read_pairs(rows, source: str) -> list[dict]:
    return [as_pair(dict(row), f"{source} row {index + 1}") for index, row in enumerate(rows)]


def load_pairs(train_file, validation_file, dataset, cache_dir, validation_size: float, seed: int):
    """(training pairs, validation pairs): from .json/.jsonl files, or a Hub dataset (`name` or
    `name:config`: its train split and its test/validation split), else --validation_size of the
    training pairs held out. A validation file alone (--eval_only) gives no training pairs."""
    if dataset:
        name, _, config = dataset.partition(":")
        try:
            splits = datasets.load_dataset(name, config or None, cache_dir=cache_dir)
        except Exception as err:
            raise RecipeError(
                f"--dataset {dataset}: could not load it ({first_line(err)}); check the name (name "
                "or name:config) and the network, or give --train_file"
            ) from None
        train_split = next((s for s in splits if s.startswith("train")), None)
        if train_split is None:
            raise RecipeError(
                f"--dataset {dataset} has no train split (it has {', '.join(splits)}); give --train_file"
            )
        held = next((s for s in splits if s.startswith(("validation", "test"))), None)
        train = read_pairs(splits[train_split], f"--dataset {dataset}")
        validation = read_pairs(splits[held], f"--dataset {dataset} {held}") if held else None
    else:
        train, validation = read_split_files(
            train_file, validation_file, cache_dir, read_pairs, "preference pairs"
        )
    if validation is None:
        train, validation = hold_out(train, validation_size, seed, "pair(s)")
    return train, validation


def render_answer(tokenizer, prompt: list[dict], prompt_text: str, answer: list[dict], where: str) -> str:
    """The text the chat template adds after the prompt's generation prompt for `answer` (with its
    end of turn)."""
    try:
        whole = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
    except Exception as err:
        raise RecipeError(
            f"{where}: the chat template cannot render it ({first_line(err)}); fix the row"
        ) from None
    if not whole.startswith(prompt_text):
        raise RecipeError(
            f"{where}: the chat template renders the prompt differently when an answer follows it, "
            "so the answer's tokens cannot be told apart; use a model whose template keeps "
            "earlier turns as they are"
        )
    return whole[len(prompt_text) :]


def tokenize_pairs(
    tokenizer, pairs: list[dict], max_length: int, too_long: str, split: str
) -> tuple[list, dict]:
    """Each pair as token ids: prompt_ids, chosen_ids, rejected_ids, and its index. A pair whose
    prompt and longer answer exceed --max_length is dropped, or with --too_long truncate has its
    answers cut to fit (a prompt that leaves no room, or answers the same once cut, are dropped
    either way); both counted. Errors name the pair's row in its file."""
    rows, counts = [], {"pairs": len(pairs), "dropped": 0, "truncated": 0}
    for number, pair in enumerate(pairs, 1):
        where = f"{pair.get('row', f'{split} pair {number}')} ({short(pair['prompt'][-1]['content'], 40)})"
        try:
            prompt_text = tokenizer.apply_chat_template(
                pair["prompt"], tokenize=False, add_generation_prompt=True
            )
        except Exception as err:
            raise RecipeError(
                f"{where}: the chat template cannot render it ({first_line(err)}); fix the row"
            ) from None
        ids = {"prompt_ids": tokenizer(prompt_text, add_special_tokens=False)["input_ids"]}
        for name in ("chosen", "rejected"):
            text = render_answer(tokenizer, pair["prompt"], prompt_text, pair[name], where)
            ids[f"{name}_ids"] = tokenizer(text, add_special_tokens=False)["input_ids"]
        room = max_length - len(ids["prompt_ids"])
        if len(ids["prompt_ids"]) + max(len(ids["chosen_ids"]), len(ids["rejected_ids"])) > max_length:
            cut = dict(chosen_ids=ids["chosen_ids"][:room], rejected_ids=ids["rejected_ids"][:room])
            # what is left of two answers that differ only past
            # the cut teaches nothing: dropped as too long
            if too_long == "drop" or room < 1 or cut["chosen_ids"] == cut["rejected_ids"]:
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            ids.update(cut)
        if ids["chosen_ids"] == ids["rejected_ids"]:
            raise RecipeError(
                f"{where}: chosen and rejected are the same tokens; give each pair two different answers"
            )
        rows.append(dict(ids, index=len(rows), prompt=pair["prompt"], chosen=pair["chosen"]))
    if not rows:
        raise RecipeError(
            f"{split}: no pair fits in --max_length {max_length}; raise it or use --too_long truncate"
        )
    return rows, counts


@dataclass
class PairCollator:
    """A micro-batch of pairs as one batch of 2 x pairs rows, chosen answers first, each row its
    prompt and answer, left-padded, so that every answer ends at the last column: the forward pass
    then computes logits for the last `answer_width + 1` positions only. `answer_mask` marks each
    row's answer tokens in those columns."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        prompts = [e["prompt_ids"] for e in examples] * 2
        answers = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        answer_width = max(map(len, answers))
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(answers), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(answers), width), dtype=torch.long)
        answer_mask = torch.zeros((len(answers), answer_width), dtype=torch.long)
        for row, (prompt, answer) in enumerate(zip(prompts, answers)):
            tokens = prompt + answer
            input_ids[row, width - len(tokens) :] = torch.tensor(tokens)
            attention_mask[row, width - len(tokens) :] = 1
            answer_mask[row, answer_width - len(answer) :] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "answer_mask": answer_mask,
            "index": torch.tensor([e["index"] for e in examples]),
        }


@dataclass
class PackedPairCollator:
    """--packing: a micro-batch of pairs as one row without padding, made by the chat recipe's
    packing collator (packing.collator): the 2 x pairs sequences, each a prompt and one of its
    answers, chosen answers first, one after another, position_ids restarting at 0 for each, with
    the cumulative lengths a variable-length kernel reads, so that each sequence attends to itself
    only (chat/packed_attention.py). `answer_mask` is PairCollator's, and `answer_index` holds in
    the same places the position of the row that predicts each answer token: the row's next-token
    log-probabilities, picked at `answer_index`, are laid out as a padded batch's
    (dpo.answer_logprobs)."""

    rows: ChatCollator

    def __call__(self, examples: list[dict]) -> dict:
        prompts = [e["prompt_ids"] for e in examples] * 2
        answers = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
        sequences = [
            {"input_ids": p + a, "labels": [IGNORE_INDEX] * len(p) + a} for p, a in zip(prompts, answers)
        ]
        batch = self.rows(sequences)
        del batch["labels"], batch["target_index"]  # the answers' places are answer_index
        answer_width = max(map(len, answers))
        answer_mask = torch.zeros((len(answers), answer_width), dtype=torch.long)
        answer_index = torch.zeros((len(answers), answer_width), dtype=torch.long)
        # each sequence ends with its answer; a filler
        # sequence (fill_packed_row) comes after them all
        for row, (answer, end) in enumerate(zip(answers, batch["cu_seq_lens_q"][1:].tolist())):
            answer_mask[row, answer_width - len(answer) :] = 1
            answer_index[row, answer_width - len(answer) :] = torch.arange(end - len(answer) - 1, end - 1)
        index = torch.tensor([e["index"] for e in examples])
        return dict(batch, answer_mask=answer_mask, answer_index=answer_index, index=index)


def pair_collator(
    tokenizer, packing: bool, pad_to_multiple_of: int | None = None, longest: int | None = None
):
    """Batches of tokenised pairs: left-padded rows (PairCollator), or with `packing` one packed row
    (PackedPairCollator); their length rounded up to a multiple of `pad_to_multiple_of` (a packed
    row by one more
    sequence: packing.fill_packed_row); a packed row's longest sequence given as `longest`
    (packing.one_bound)."""
    if packing:
        return PackedPairCollator(collator(tokenizer, True, pad_to_multiple_of, longest))
    return PairCollator(tokenizer.pad_token_id, pad_to_multiple_of)
