"""What the chat recipes (sft.py, grpo.py, dpo.py) do with a trained model besides evaluating it:
--predict (answers as JSON lines), --chat (a conversation in the terminal) and --merge (an adapter
merged into its base, or a .gguf file converted, as one plain transformers folder).
"""

import json
import sys
from pathlib import Path

import peft
import torch
from transformers import TextStreamer

from .conversations import FILE_SUFFIXES, as_conversations, generation_prompt, load_file
from .generation import decode_mode, decodes_compiled
from .model import ChatModelFlags, greedy, load_fine_tuned


def read_prompts(source) -> list[list[dict]]:
    """Conversations to answer: the prompt itself, a .txt file (one prompt per line) or a
    .json/.jsonl file of conversations in the training formats (answered after their last user
    turn)."""
    prompts = []
    for item in map(str, source if isinstance(source, (list, tuple)) else [source]):
        path = Path(item).expanduser()
        if path.suffix.lower() in FILE_SUFFIXES and path.is_file():
            rows = as_conversations(load_file(path, "predict", None, flag="--predict"), f"--predict {path}")
            for messages in rows["messages"]:
                prompts.append(
                    generation_prompt(messages)[0] if messages[-1]["role"] == "assistant" else messages
                )
        elif path.suffix.lower() == ".txt" and path.is_file():
            prompts += [
                [{"role": "user", "content": line}] for line in path.read_text().splitlines() if line.strip()
            ]
        else:
            prompts.append([{"role": "user", "content": item}])
    return prompts


def inference_model(args: ChatModelFlags, decode: str = "eager"):
    """(model, tokenizer, decoding mode) of --model (default --output_dir) on the GPU when there is
    one, in bf16 there; an adapter merged into its base when the mode is not eager (the static and
    compiled paths decode a plain model)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    mode = decode_mode(decode, device)
    model, tokenizer = load_fine_tuned(args.model or args.output_dir, dtype)
    if mode != "eager" and isinstance(model, peft.PeftModel):
        model = model.merge_and_unload()
    model = model.to(device).eval()
    if mode == "compiled" and not decodes_compiled(model, decode, device):
        mode = "eager"
    return model, tokenizer, mode


def predict(args: ChatModelFlags) -> None:
    """--predict: answer prompts greedily with the model in --model (default --output_dir) in this
    one process and print one JSON line per prompt: prompt, answer."""
    model, tokenizer, mode = inference_model(args, args.decode)
    prompts = read_prompts(args.predict)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for start in range(0, len(prompts), args.batch_size):
            chunk = prompts[start : start + args.batch_size]
            answers = greedy(model, tokenizer, chunk, args.max_new_tokens, mode=mode, dtype=dtype, own=True)
            for prompt, answer in zip(chunk, answers):
                print(
                    json.dumps({"prompt": prompt[-1]["content"], "answer": answer}, ensure_ascii=False),
                    flush=True,
                )


def chat(args: ChatModelFlags) -> None:
    """--chat: a conversation in the terminal with the model in --model, each answer streamed as it
    is generated (eager unless --decode says otherwise: a compiled decode step would hold the first
    answer for its compilation)."""
    model, tokenizer, mode = inference_model(args, "eager" if args.decode == "auto" else args.decode)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    dtype = next(model.parameters()).dtype
    messages = []
    print(f"chatting with {args.model or args.output_dir}; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("you> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        with torch.no_grad():
            answer = greedy(
                model, tokenizer, [messages], args.max_new_tokens, streamer, mode, dtype, own=True
            )[0]
        messages.append({"role": "assistant", "content": answer})


def merge(args: ChatModelFlags) -> None:
    """--merge DIR: the model in --model as one plain transformers folder: an adapter merged into
    its base weights, or a .gguf file converted. Loads with from_pretrained alone."""
    model, tokenizer = load_fine_tuned(args.model or args.output_dir)
    if isinstance(model, peft.PeftModel):
        model = model.merge_and_unload()
    model.save_pretrained(args.merge)
    tokenizer.save_pretrained(args.merge)
    print(
        f"merged model saved in {args.merge}; load it with "
        f"AutoModelForCausalLM.from_pretrained({args.merge!r})"
    )
