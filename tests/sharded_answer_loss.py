"""The chat recipe's answer-token loss under FSDP2 against the same model unsharded, on the
processes of one launch.

Started by tests/test_sft_sharded.py with fsdp.yaml on 1 or 2 CPU processes (the FSDP2 plugin is
built from the config's settings, as the recipes build it on the CPU), with a model folder of
tests/chat_fixtures.py whose output layer is tied to the embeddings. For a LoRA adapter and for a
full fine-tune, each with gradient checkpointing and its decoder blocks compiled as --compile
compiles them (aot_eager here; the graphs compiled are counted), each process takes a micro-batch of
its own, small enough chunks (answer_loss.CHUNK_LOGITS) for several per micro-batch, and runs: a
training pass, an evaluation pass without gradients (as the recipes evaluate: compiling nothing
new), and a training pass again; then the token log-probabilities of the chat recipes' updates
(chat/model.py's token_logprobs) with their gradients. Beside it, an unsharded eager copy of the
model takes transformers' own loss and logits on the same micro-batch; its gradients are averaged
over the processes, as FSDP2 averages the sharded ones. Each process saves what both gave to
OUTPUT_DIR/rank<N>.pt for the test to compare.
"""

import argparse
import copy
import sys
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator

REPO = Path(__file__).resolve().parents[1]
# the chat recipe's modules; the fixtures' assets
sys.path[:0] = [str(REPO / "recipes"), str(REPO / "benchmarks")]

from chat import answer_loss  # noqa: E402
from chat import model as chat_model  # noqa: E402
from chat.conversations import assistant_turn_end, ensure_pad_token, tokenize_conversation  # noqa: E402
from chat.generation import without_compiling  # noqa: E402
from chat.packing import collator  # noqa: E402
from chat_fixtures import chat_examples  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from accelerate_recipes.sharding import setup_fsdp, shard_on_cpu  # noqa: E402

CONVERSATIONS = 4  # per micro-batch: the ones with the most answer tokens of a generated set
CHUNK_ROWS = 4  # answer positions per chunk of logits
# the tokens at the end of each row whose log-probabilities are compared
LOGPROB_TOKENS, TEMPERATURE = 8, 0.7


def micro_batch(tokenizer, seed: int) -> dict:
    turn_end = assistant_turn_end(tokenizer)
    features = [tokenize_conversation(tokenizer, m, 128, turn_end) for m in chat_examples(40, seed=seed)]
    features = sorted(features, key=lambda f: f["num_targets"])[-CONVERSATIONS:]
    return collator(tokenizer, packing=False)(features)


def build(model_dir: str, lora: bool):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    # Under fsdp.yaml's cpu_ram_efficient_loading transformers 5.17 loads the weights on rank 0 only
    # (the others get zeros until accelerate's prepare sends them); the unsharded reference takes
    # rank 0's too
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:  # random B (not peft's zeros) so that every adapter matrix gets a gradient
        model.enable_input_require_grads()
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        )
    return model.train()


def gradients(model) -> dict:
    """Every trainable weight's gradient, whole (a DTensor's shards gathered) or as it is."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = (
                param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            ).clone()
    return grads


def averaged(grads: dict, world: int) -> dict:
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= world
    return grads


def compare(accelerator, model_dir: str, lora: bool, batch: dict, answer_tokens: torch.Tensor) -> dict:
    reference = build(model_dir, lora)
    sharded = copy.deepcopy(reference)
    answer_loss.use_answer_loss(sharded)
    torch._dynamo.reset()  # each method's graphs counted on their own
    counters.clear()
    # as --compile does, before prepare shards the blocks
    chat_model.compile_blocks(sharded, "aot_eager")
    setup_fsdp(accelerator, sharded)
    # FSDP2 prepares a model with its optimizer only; this one never steps
    optimizer = torch.optim.SGD([p for p in sharded.parameters() if p.requires_grad], lr=0.0)
    sharded, optimizer = accelerator.prepare(sharded, optimizer)
    theirs = {k: v for k, v in batch.items() if k != "target_index"}
    targets = batch["labels"].reshape(-1)[batch["target_index"] + 1]

    expected = reference(**theirs, num_items_in_batch=answer_tokens)
    expected.loss.backward()
    with torch.no_grad():
        logits = expected.logits.reshape(-1, expected.logits.shape[-1])[batch["target_index"]].float()
        expected_token_losses = F.cross_entropy(logits, targets, reduction="none")
    result = dict(
        expected_loss=expected.loss.detach(),
        expected_token_losses=expected_token_losses,
        expected_gradients=averaged(gradients(reference), accelerator.num_processes),
        chunks=-(-len(targets) // CHUNK_ROWS),
        tied=sharded.get_output_embeddings().weight is sharded.get_input_embeddings().weight,
        # at rest, outside a pass: a DTensor
        sharded=type(sharded.get_output_embeddings().weight).__name__,
    )
    # the same weights and micro-batch: a training pass after an evaluation pass
    for run in ("first", "second"):
        optimizer.zero_grad(set_to_none=True)  # as the recipe clears them: the sharded gradients
        loss = sharded(**batch, num_items_in_batch=answer_tokens).loss
        accelerator.backward(loss)
        result[f"{run}_loss"], result[f"{run}_gradients"] = loss.detach(), gradients(sharded)
        if run == "first":
            with torch.no_grad(), without_compiling():  # as the recipes evaluate
                result["token_losses"] = sharded(**batch).token_losses

    # The last LOGPROB_TOKENS tokens' log-probabilities at a temperature (GRPO's and DPO's), and the
    # gradients of a weighted sum of them: in chunks through the sharded model, from the full logits
    # of the unsharded one.
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    targets = batch["input_ids"][:, -LOGPROB_TOKENS:]
    weights = torch.linspace(-1, 1, targets.numel()).reshape(targets.shape)
    reference.zero_grad(set_to_none=True)
    logits = reference(**inputs).logits[:, -LOGPROB_TOKENS - 1 : -1].float() / TEMPERATURE
    expected = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (expected * weights).sum().backward()
    result["expected_logprobs"] = expected.detach()
    result["expected_logprob_gradients"] = averaged(gradients(reference), accelerator.num_processes)
    optimizer.zero_grad(set_to_none=True)
    logprobs = chat_model.token_logprobs(sharded, **inputs, targets=targets, temperature=TEMPERATURE)
    accelerator.backward((logprobs * weights).sum())
    result["logprobs"], result["logprob_gradients"] = logprobs.detach(), gradients(sharded)
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["blocks"] = len(sharded.get_decoder().layers)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    accelerator = Accelerator()
    shard_on_cpu(accelerator)  # FSDP2 from fsdp.yaml's settings, as the recipes run it on the CPU
    if accelerator.distributed_type != "FSDP":
        sys.exit(
            "error: launch this with fsdp.yaml and ACCELERATE_USE_CPU=true, not "
            f"{accelerator.distributed_type}"
        )
    tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(args.model_dir))
    # read at each call
    answer_loss.CHUNK_LOGITS = CHUNK_ROWS * AutoConfig.from_pretrained(args.model_dir).vocab_size
    batch = micro_batch(tokenizer, seed=accelerator.process_index)
    answer_tokens = torch.tensor(len(batch["target_index"]))
    # num_items_in_batch as the recipe passes it: the answer tokens of all processes
    dist.all_reduce(answer_tokens)
    results = {"world_size": accelerator.num_processes}
    for method in ("lora", "full"):
        results[method] = compare(accelerator, args.model_dir, method == "lora", batch, answer_tokens)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
