#!/usr/bin/env python
"""Packed rows through `varlen` against sdpa's dense mask, on one device: the same losses, and what
each costs.

    python benchmarks/packed_attention_check.py --model DIR --train_file chats.jsonl --output_dir OUT
    python benchmarks/packed_attention_check.py ... --rows 4 --per_row 16 --device cuda

The conversations of --train_file (the recipe's `messages` JSONL) are tokenised with the chat
recipe's answer mask and packed --per_row to a row, as `recipes/sft.py --packing` packs a
micro-batch. The model in --model (bf16 on a GPU, fp32 on the CPU) runs each row forward and
backward with the answer-token loss twice: attention `sdpa` (transformers' block-diagonal mask over
the whole row) and `varlen` (recipes/chat/packed_attention.py: torch's variable-length flash kernel
on a GPU of compute capability 8.0+, conversation by conversation elsewhere). Printed and written to
OUTPUT_DIR/packed_attention.json: the largest and the mean absolute difference of the answer tokens'
losses, the relative difference of the rows' mean losses, and the median forward + backward
milliseconds of a row under each (one warm-up row first; CUDA events on a GPU). gpu-check's sft step
runs it before the training runs.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import fire
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))  # the chat recipe's modules, as sft.py imports them

from chat import packed_attention  # noqa: E402
from chat.answer_loss import use_answer_loss  # noqa: E402
from chat.conversations import assistant_turn_end, ensure_pad_token, tokenize_conversation  # noqa: E402
from chat.packing import check_packing, collator  # noqa: E402


def packed_rows(tokenizer, train_file: str, rows: int, per_row: int, max_length: int) -> list[dict]:
    turn_end = assistant_turn_end(tokenizer)
    lines = Path(train_file).read_text().splitlines()[: rows * per_row]
    if len(lines) < rows * per_row:
        sys.exit(
            f"error: {train_file} holds {len(lines)} conversations, fewer than --rows x --per_row; lower them"
        )
    features = [
        tokenize_conversation(tokenizer, json.loads(line)["messages"], max_length, turn_end) for line in lines
    ]
    pack = collator(tokenizer, packing=True)
    return [pack(features[i * per_row : (i + 1) * per_row]) for i in range(rows)]


def timed_pass(model, batch: dict, device: torch.device) -> tuple[torch.Tensor, float]:
    """The answer tokens' losses of one forward + backward pass, and its milliseconds."""
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    out = model(**batch)
    out.loss.backward()
    if device.type == "cuda":
        end.record()
        end.synchronize()
        return out.token_losses.detach().float().cpu(), start.elapsed_time(end)
    return out.token_losses.detach().float(), (time.perf_counter() - began) * 1000


def main(
    model: str,
    train_file: str,
    output_dir: str = "outputs/packed-attention",
    rows: int = 4,
    per_row: int = 16,
    max_length: int = 1024,
    device: str | None = None,
):
    """Compare sdpa's dense mask and varlen on the same packed rows; see the module's
    description."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(model))
    # one more: the warm-up row
    batches = packed_rows(tokenizer, train_file, rows + 1, per_row, max_length)
    packed_attention.register()
    losses, milliseconds = {}, {}
    for attention in ("sdpa", "varlen"):
        torch.manual_seed(0)
        network = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=attention).to(
            device
        )
        check_packing(network)
        use_answer_loss(network)
        network.train()
        passes = [timed_pass(network, batch, device) for batch in batches]
        losses[attention] = torch.cat([token_losses for token_losses, _ in passes[1:]])
        milliseconds[attention] = statistics.median(ms for _, ms in passes[1:])
        del network
        if device.type == "cuda":
            torch.cuda.empty_cache()
    difference = (losses["varlen"] - losses["sdpa"]).abs()
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "kernel": packed_attention.kernel_runs_on(device) and dtype != torch.float32,
        "rows": rows,
        "conversations_per_row": per_row,
        "mean_row_tokens": round(statistics.mean(b["input_ids"].shape[1] for b in batches[1:]), 1),
        "answer_tokens": len(difference),
        "max_abs_token_loss_difference": difference.max().item(),
        "mean_abs_token_loss_difference": difference.mean().item(),
        "relative_mean_loss_difference": abs(losses["varlen"].mean() / losses["sdpa"].mean() - 1).item(),
        "sdpa_row_ms": round(milliseconds["sdpa"], 2),
        "varlen_row_ms": round(milliseconds["varlen"], 2),
        "varlen_speedup": round(milliseconds["sdpa"] / milliseconds["varlen"], 3),
    }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packed_attention.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    fire.Fire(main)
