"""The chat-model layer that the chat recipes share (sft.py, grpo.py and dpo.py import it; none
imports another): loading a model (a Hub name, a folder, a .gguf file, an adapter of ours, a merged
folder) with its tokenizer and chat template, LoRA, the reference policy of the preference and RL
recipes, saving (an adapter or the whole model, sharded or not), what a run records of its model and
says of what it saved, and greedy answers (evaluation's and those of the modes in modes.py).

The flags these read are ChatModelFlags'; each recipe's flags extend them.
"""

import contextlib
import copy
import dataclasses
import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import peft
import torch
import transformers
from accelerate.utils import DistributedType, extract_model_from_parallel, gather_object
from torch.nn.attention import SDPBackend
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from accelerate_recipes import RecipeError, TrainingFlags, explain_load_failure, model_to_save
from accelerate_recipes.compiling import CompiledPath, compile_modules

from .answer_loss import use_answer_loss
from .conversations import check_chat_template, ensure_pad_token, exact_match, generation_prompt
from .generation import (
    compute_dtype,
    decode_mode,
    decode_path,
    decodes_compiled,
    greedy_config,
    greedy_ids,
    inner_model,
    use_decode_backend,
)
from .memory_plan import meta_model, numel

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
SAMPLES_FILE = "samples.jsonl"  # sample answers of evaluations (and GRPO's rollouts), as text
SAMPLES_KEPT = 5  # of each evaluation or log step, in samples.jsonl and the tracker


@dataclass
class ChatModelFlags(TrainingFlags):
    """Flags every chat recipe has: the model, LoRA, and the modes that use a trained model.

    Args:
        lora_r: rank of a LoRA adapter (peft) trained on every linear layer instead of the whole
            model; 0: a full fine-tune. 8-64 are usual. With --model an adapter of one of these
            recipes, that adapter is trained on.
        lora_alpha: LoRA scale numerator (the update is scaled by alpha / r); default 2 x --lora_r.
        lora_dropout: dropout on the LoRA branch's input; 0 (default) lets peft skip it. Dropout
            draws a mask over every adapted layer's input and keeps the dropped copy for the
            backward pass (seven per block with all-linear): time and memory on every step, for a
            regularisation that matters on many epochs over little data, where QLoRA's 0.1 (models
            up to 13B) or 0.05 (33B and 65B) are the usual values.
        lora_target_modules: the layers that get adapters: all-linear (default, every linear layer
            but the output head) or comma-separated module names (q_proj,v_proj).
        gradient_checkpointing: recompute activations in the backward pass (non-reentrant): much
            less memory for long sequences, about a third slower.
        attn_implementation: sdpa (default), eager, flash_attention_2 (when installed) or
            flex_attention; sft.py and dpo.py also take varlen (packed rows through torch's
            variable-length kernel; their default for --packing on a GPU).
        max_new_tokens: longest generated answer (evaluation samples, --predict, --chat).
        decode: how answers are generated: auto (default: compiled on a GPU for a model that is not
            sharded, else eager; a compiled decode that cannot compile goes on eagerly, said in one
            line), eager (transformers' generate on the trained model, token by token), static (a
            copy of the model in the compute dtype, LoRA merged into its weights, with a static KV
            cache) or compiled (static, its decode step compiled: CUDA graphs on a GPU, the
            compilation paid once per shape; a failure to compile is an error). results.json:
            decode_graphs, decode_recompiles, decode_compile_seconds, decode_fallback. See
            chat/generation.py.
        cache_dir: cache of the `datasets` library (downloads and tokenised data).
        chat: talk to the model in --model in the terminal, answers streamed; an empty line or
            Ctrl-D ends.
        merge: write the model in --model as one plain transformers folder to this path: a LoRA
            adapter merged into its base, or a .gguf file converted; `from_pretrained` loads it
            without peft.
    """

    lora_r: int = 0
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    max_new_tokens: int = 128
    decode: Literal["auto", "eager", "static", "compiled"] = "auto"
    cache_dir: str | None = None
    chat: bool = False
    merge: str | None = None


# compiled blocks and packed rows: rows filled up to a multiple of this many tokens
COMPILE_ROW_MULTIPLE = 128


def row_multiple(accelerator, compiled_packed: bool = False) -> int | None:
    """The multiple of tokens a batch's rows are padded (a packed row: filled) up to: 8 under
    bf16/fp16, which tensor cores like; COMPILE_ROW_MULTIPLE for packed rows fed to compiled blocks
    (`compiled_packed`), which compile once per row length, so that a run's rows take a few lengths,
    not one each; else none."""
    if compiled_packed:
        return COMPILE_ROW_MULTIPLE
    return 8 if accelerator.mixed_precision != "no" else None


@dataclass
class KernelFlags:
    """How the decoder's blocks run in the recipes that train on whole sequences (sft.py and
    dpo.py): compiled, with Liger Kernel's fused kernels.

    Args:
        compile: compile each decoder block with torch.compile before training; default: on a CUDA
            GPU (not under DeepSpeed, nor with --liger), off elsewhere; --nocompile turns it off. By
            default a failure to compile (no C compiler or Python headers, a backend error, the
            recompile limit) lets the run go on eagerly with one line that says why; given
            --compile, it is an error. results.json: compile_graphs, compile_recompiles,
            compile_seconds, compile_fallback. The first steps take longer while it compiles
            (results.json: warmup_seconds, the steps left out of the throughput; compile_cache_hits:
            graphs that torch's own cache in /tmp/torchinductor_$USER, or $TORCHINDUCTOR_CACHE_DIR,
            gave a later run of the same shapes without compiling them). With --packing the rows are
            filled up to a multiple of 128 tokens (one more sequence, without loss), so that a run's
            rows take a few lengths and the blocks compile once or twice, not for every row.
            Evaluation and generation run the compiled graphs where their shapes match and eagerly
            where they do not, never compiling again.
        compile_backend: torch.compile's backend, for the blocks and the compiled decode: inductor
            (default: generates fused kernels) or aot_eager (traces and runs the graphs without
            generating code: quick, to find what does not compile).
        liger: put Liger Kernel's fused Triton kernels (pip install liger-kernel; a CUDA GPU) in the
            model's RMSNorm, SwiGLU MLP and rotary embedding, for the model types Liger patches
            (Llama, Qwen2/3, Mistral, ...); the loss stays this recipe's (the answer positions'
            logits only, in chunks). The other way to fuse those layers than compiled blocks: with
            --liger the blocks run eagerly, and --compile with it is refused. Off by default: it has
            not been measured against the compiled blocks on a GPU.
    """

    compile: bool | None = None
    compile_backend: str = "inductor"
    liger: bool = False


# Liger Kernel (0.8.5) and compiled blocks fuse the same layers two ways, and do not mix: its rotary
# embedding goes through a dispatcher marked torch.compiler.disable
# (liger_kernel/backends/dispatch.py), a graph break in every block; its RMSNorm and SwiGLU become
# opaque kernels that inductor fuses nothing into, where inductor fuses those layers itself
# (linkedin/Liger-Kernel#1330: its SwiGLU compiled ~3x slower than inductor's own); and inductor
# failures with its kernels patched in, before or after torch.compile, are still open there (#174).
LIGER_NOT_COMPILED = (
    "--liger and --compile fuse the same layers two ways, and Liger Kernel's are not compiled"
)


def compiles(flag: bool | None, accelerator, liger: bool = False) -> bool:
    """--compile as given, else on by default where it pays: on a CUDA GPU, where fewer and fused
    kernels shorten a step (on one H100 a 0.5B model's full fine-tune ran at 58,000 tokens/s
    compiled, 41,000 eager in another call), not under DeepSpeed, whose hooks on every weight break
    the graphs apart, and not with --liger (said in one line; --compile with --liger is refused:
    LIGER_NOT_COMPILED)."""
    if flag and liger:
        raise RecipeError(f"{LIGER_NOT_COMPILED} (a graph break in every block); give one of them")
    if flag is not None:
        return flag
    on = accelerator.device.type == "cuda" and accelerator.distributed_type != DistributedType.DEEPSPEED
    if on and liger:
        accelerator.print(
            f"the decoder blocks run eagerly, with Liger Kernel's kernels: {LIGER_NOT_COMPILED}"
        )
    return on and not liger


def compiled_blocks(
    flag: bool | None, accelerator, liger: bool = False, backend: str = "inductor"
) -> CompiledPath:
    """The decoder blocks' compiled path in this run: tried when compiles() says so and inductor has
    what it needs here (checked now, before the first step: else they run eagerly, said in one line;
    with --compile, an error)."""
    attempted = compiles(flag, accelerator, liger)
    path = CompiledPath(
        "the decoder blocks", "--nocompile", "--compile", explicit=bool(flag), attempted=attempted
    )
    if attempted:
        path.check_toolchain(accelerator.device, backend)
    return path


BLOCK_GRAPH_LIMIT = 16  # graphs of the blocks' code: the kinds of call times static and dynamic


def compile_blocks(model, backend, path: CompiledPath | None = None) -> None:
    """torch.compile each decoder block in place (the pattern torchtitan uses): the blocks are where
    the time goes, each compiles to the same graph, and FSDP2 still shards them one by one; the loss
    and the rest stay eager. Each block's call goes through `path` (compile_modules): a compile
    failure puts every block back to eager.

    Each kind of call (with and without gradients, with a padding mask and without one) compiles
    static at its first width and dynamic at the next: DPO's 3 kinds x 2 masks x 2 are 12 graphs (2
    processes of 2 pairs), more than torch's default limit of 8 a function, so the limit is raised to
    BLOCK_GRAPH_LIMIT."""
    causal_lm = inner_model(model)
    blocks = getattr(causal_lm.get_decoder(), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise RecipeError(f"--compile compiles the decoder's blocks, and {type(causal_lm).__name__} keeps "
                          "none in decoder.layers; drop --compile")  # fmt: skip
    if path is None:  # compiled on purpose: a failure is an error
        path = CompiledPath("the decoder blocks", "--nocompile", "--compile", explicit=True)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, BLOCK_GRAPH_LIMIT)
    compile_modules(blocks, backend, path)


def use_liger_kernels(model, device) -> None:
    """--liger: Liger Kernel's RMSNorm, SwiGLU and RoPE in place of the model's own, patched on this
    model (its modules and its modeling module's rotary function); the output layer and loss are
    left to answer_loss."""
    if torch.device(device).type != "cuda":
        raise RecipeError(
            "--liger runs Liger Kernel's Triton kernels, which need a CUDA GPU; leave --liger out here"
        )
    try:
        # the patcher TRL's trainers call
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise RecipeError("--liger needs Liger Kernel: pip install liger-kernel") from None
    causal_lm = inner_model(model)
    if causal_lm.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise RecipeError(
            f"Liger Kernel has no kernels for {causal_lm.config.model_type} models; leave --liger out"
        )
    kernels = dict(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    _apply_liger_kernel_to_instance(causal_lm, **kernels)


def compile_settled(args: KernelFlags, accelerator) -> tuple[KernelFlags, CompiledPath]:
    """(a copy of the flags with --compile as this run takes it, the blocks' path for use_kernels
    and results.json): compiled_blocks decides, by default on a CUDA GPU where inductor can work."""
    blocks = compiled_blocks(args.compile, accelerator, args.liger, args.compile_backend)
    return dataclasses.replace(args, compile=not blocks.eager), blocks


def use_kernels(model, args: KernelFlags, device, blocks: CompiledPath | None = None) -> None:
    """The kernels KernelFlags ask for, in place, before prepare: Liger Kernel's (--liger) or the
    compiled blocks (--compile, settled by compile_settled, which keeps the two apart; `blocks`:
    their path); and the backend the compiled decode compiles with, the blocks'
    (--compile_backend)."""
    if args.liger:
        use_liger_kernels(model, device)
    if args.compile:
        compile_blocks(model, args.compile_backend, blocks)
    use_decode_backend(model, args.compile_backend)


def compile_figures(blocks: CompiledPath | None, model, accelerator) -> dict:
    """What results.json records of the run's compilations in this process: the blocks'
    (compile_graphs, compile_recompiles, compile_seconds, compile_fallback), the decode step's
    (decode_graphs, ...), and the graphs torch's compile caches gave (compile_cache_hits)."""
    blocks = blocks or CompiledPath("the decoder blocks", "--nocompile", "--compile", attempted=False)
    decode = decode_path(accelerator.unwrap_model(model))
    figures = {
        **blocks.figures("compile", "compile_seconds"),
        **decode.figures("decode", "decode_compile_seconds"),
    }
    return dict(figures, compile_cache_hits=compile_cache_hits())


def compile_cache_hits() -> int:
    """Graphs that torch's compile caches (inductor's FX graph cache, AOTAutograd's) gave this
    process without compiling them: a second run of the same shapes finds its graphs there."""
    from torch._dynamo.utils import counters  # torch's own tally; no public getter

    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


# --------------------------------------------------------------------------------------------- load
def load_tokenizer(name: str):
    """The model's tokenizer, with its chat template and a pad token (a .gguf file carries both)."""
    path = Path(name).expanduser()
    with explain_load_failure(name, also=", a .gguf file"):
        if path.suffix == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(name)
    check_chat_template(tokenizer, name)
    ensure_pad_token(tokenizer)
    return tokenizer


def load_base_model(name: str, dtype=torch.float32, attn_implementation: str | None = None):
    """A causal LM from a Hub name, a folder, or a .gguf file.

    transformers dequantises a GGUF file to `dtype` but refuses to save or train a model loaded that
    way; its weights are therefore moved into the same architecture built from its config, which
    trains and saves as any other.
    """
    path = Path(name).expanduser()
    with explain_load_failure(name, also=", a .gguf file"):
        if path.suffix != ".gguf":
            return AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, attn_implementation=attn_implementation
            )
        if not path.is_file():
            raise RecipeError(f"--model {name}: no such .gguf file")
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        config.quantization_config = None
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        # an adapter's base: the file, not its folder
        model.name_or_path = model.config._name_or_path = str(path)
        return model


def is_adapter(folder) -> bool:
    return (Path(folder) / "adapter_config.json").is_file()


def load_fine_tuned(model_dir: str, dtype=torch.float32):
    """(model, tokenizer) of a finished run: a LoRA adapter on its base (read from where the adapter
    says), or a full model; a .gguf file or any chat model works too (--predict on the model before
    fine-tuning)."""
    path = Path(model_dir)
    if path.suffix != ".gguf" and not (path / "config.json").is_file() and not is_adapter(path):
        raise RecipeError(
            f"--model {model_dir} is not a fine-tuned model folder (no adapter_config.json or "
            "config.json); train first or point --model at the output_dir of a finished run"
        )
    tokenizer = load_tokenizer(model_dir)
    if not is_adapter(path):
        return load_base_model(model_dir, dtype), tokenizer
    base_name = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = load_base_model(base_name, dtype)
    return peft.PeftModel.from_pretrained(base, model_dir), tokenizer


def add_lora(model, args: ChatModelFlags):
    """Freeze the model and give it a LoRA adapter (peft) on the layers --lora_target_modules
    names."""
    targets = args.lora_target_modules
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_r,
        lora_alpha=args.lora_alpha or 2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
    )
    return peft.get_peft_model(model, config)


def build_model(args: ChatModelFlags, model_name: str, accelerator, meta: bool = False):
    """The model to train on the accelerator's device and in its mixed precision: the whole of it,
    or (--lora_r) frozen with a LoRA adapter; an adapter of ours in --model is trained on under
    --lora_r and merged into its base for a full fine-tune. Gradient checkpointing as the flags ask;
    sdpa kept to the kernels use_sdpa_backends allows.
    `meta`: the architecture alone, on the meta device (a memory plan)."""
    # A LoRA run keeps the frozen base in bf16 when it trains in bf16 (half the memory); full
    # fine-tunes keep fp32 master weights and let autocast compute in bf16.
    dtype = torch.bfloat16 if args.lora_r and accelerator.mixed_precision == "bf16" else torch.float32
    if meta:
        model = meta_model(model_name, dtype)
    elif is_adapter(model_name):
        model, _ = load_fine_tuned(model_name, dtype)
        if args.lora_r:  # go on training the adapter: its base stays the one the adapter names
            model = peft.PeftModel.from_pretrained(model.get_base_model(), model_name, is_trainable=True)
        else:
            model = model.merge_and_unload()
    else:
        model = load_base_model(model_name, dtype, args.attn_implementation)
    if not meta:
        use_sdpa_backends(accelerator.device)
        # a bad --decode stops here
        decode_mode(args.decode, accelerator.device, accelerator.distributed_type)
    # no cache in training; packed rows also need none to keep examples apart
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # the frozen embeddings' output must carry a gradient for the checkpointed blocks to get one
        if args.lora_r:
            model.enable_input_require_grads()
    if args.lora_r and not isinstance(model, peft.PeftModel):
        model = add_lora(model, args)
    if args.lora_r:
        for layer in model.modules():
            if isinstance(layer, peft.tuners.lora.LoraLayer):
                layer._cast_input_dtype = types.MethodType(cast_adapter_input_outside_autocast, layer)
    if not meta:
        use_answer_loss(
            model
            # the answer loss and token log-probabilities in
            # chunks (chat/answer_loss.py), before prepare
        )
    return model


# cuDNN's sdpa kernel, torch's first choice on Hopper GPUs from torch 2.11, has been reported to
# return NaN query gradients from its backward pass when an explicit mask leaves whole query rows
# masked: the left padding of every padded DPO and GRPO batch (their rows are left-padded, and sdpa
# gets the padding as a boolean mask). The loss stays finite while NaN reaches the weights. The chat
# recipes therefore never let torch pick it on CUDA: masked calls go to the memory-efficient kernel
# instead (flash takes no mask), unmasked ones to flash as before.
SDPA_SWITCHES = {  # torch's process-wide on/off switch of each CUDA sdpa kernel
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.enable_flash_sdp,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.enable_mem_efficient_sdp,
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.enable_cudnn_sdp,
    SDPBackend.MATH: torch.backends.cuda.enable_math_sdp,
}


def sdpa_backends_off(device) -> list[SDPBackend]:
    """The sdpa kernels a chat recipe keeps torch from choosing on `device`: cuDNN's on CUDA, none
    elsewhere (torch has no cuDNN kernel there)."""
    return [SDPBackend.CUDNN_ATTENTION] if torch.device(device).type == "cuda" else []


def use_sdpa_backends(device) -> None:
    """Turn off, for the rest of the process, the sdpa kernels sdpa_backends_off(device) names;
    every other kernel stays as it was, and torch still picks among those for each call."""
    for backend in sdpa_backends_off(device):
        SDPA_SWITCHES[backend](False)


def attention_settings(model) -> dict:
    """What results.json records of the attention: the implementation the model runs and the sdpa
    kernels turned off on its device."""
    unwrapped = extract_model_from_parallel(model)
    return dict(
        attn_implementation=unwrapped.config._attn_implementation,
        sdpa_backends_off=[backend.name for backend in sdpa_backends_off(unwrapped.device)],
    )


def model_facts(args: ChatModelFlags, model) -> dict:
    """What results.json records of the trained model: LoRA or full, its parameters (trainable, and
    all of them), the library versions and the attention it runs."""
    return dict(
        method="lora" if args.lora_r else "full",
        trainable_parameters=sum(numel(p) for p in model.parameters() if p.requires_grad),
        # whole, also where ZeRO-3 partitioned them at load
        parameters=sum(numel(p) for p in model.parameters()),
        transformers_version=transformers.__version__,
        peft_version=peft.__version__,
        **attention_settings(model),
    )


def cast_adapter_input_outside_autocast(layer, x, dtype):
    """peft casts an adapted layer's input to the adapter's dtype (fp32) before the adapter's
    matmuls; under bf16 autocast those matmuls cast it straight back to bf16: two copies of every
    adapted activation per pass, for the same numbers (bf16 -> fp32 -> bf16 is exact). Under
    autocast the input therefore goes in as it is; outside it (generation, a model in one dtype)
    peft casts as before. Installed on each LoRA layer by build_model."""
    if x is not None and torch.is_autocast_enabled(x.device.type):
        return x
    return type(layer)._cast_input_dtype(layer, x, dtype)


def adamw(model, lr: float, weight_decay: float, device) -> torch.optim.AdamW:
    """AdamW on the trainable weights, weight decay on matrices only (not on biases and norm
    weights); on a GPU the fused kernel, one launch for every tensor instead of several per
    tensor."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [p for p in trainable if p.ndim > 1], [p for p in trainable if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=torch.device(device).type == "cuda")


def load_any(model_dir: str, dtype=torch.float32):
    """(model, tokenizer) of a trained model (an adapter or a folder), a .gguf file, or a Hub name
    (a model before any fine-tuning, to evaluate or compare with)."""
    path = Path(model_dir)
    if path.suffix == ".gguf" or is_adapter(path) or (path / "config.json").is_file():
        return load_fine_tuned(model_dir, dtype)
    return load_base_model(model_dir, dtype), load_tokenizer(model_dir)


# ---------------------------------------------------------------------------------------- reference
# under an adapter given in --model: its frozen copy, beside the trained one
REFERENCE_ADAPTER = "reference"
BASE = "base"  # under a fresh adapter: the base model itself, the adapter switched off


def reference_policy(args: ChatModelFlags, accelerator, model, model_name: str):
    """The policy a KL term or a preference loss measures the model against: the one this run starts
    from. Under a fresh LoRA adapter (whose update starts at zero) the base itself, no second copy
    (BASE); under an adapter given in --model a frozen copy of that adapter, loaded beside it in the
    same peft model, a few MB (REFERENCE_ADAPTER); in a full fine-tune a frozen copy of the starting
    weights (a module). Called before prepare, so that sharding treats a second adapter as the
    first."""
    if args.lora_r:
        if not is_adapter(model_name):
            return BASE
        model.load_adapter(model_name, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        # the trained one stays active (and the only one with gradients)
        model.set_adapter("default")
        return REFERENCE_ADAPTER
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise RecipeError(
            "a full fine-tune's reference is a second, frozen copy of the model, which these "
            "recipes do not shard; use --lora_r (the reference is then the base itself)"
        )
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    return reference.to(accelerator.device)


@contextlib.contextmanager
def reference_model(accelerator, model, reference):
    """The module whose forward pass is the reference policy's, for the duration (see
    reference_policy): the model with its adapter off (BASE), the model with the frozen adapter
    active (REFERENCE_ADAPTER), or the frozen copy, under the run's autocast as the prepared model
    is. Use it under torch.no_grad()."""
    unwrapped = accelerator.unwrap_model(model)
    if reference == BASE:
        with unwrapped.disable_adapter():
            yield model
    elif reference == REFERENCE_ADAPTER:
        # peft runs one adapter at a time; setting the trained one back also restores its gradients
        # (and keeps the reference's off)
        unwrapped.set_adapter(REFERENCE_ADAPTER)
        try:
            yield model
        finally:
            unwrapped.set_adapter("default")
    else:
        with accelerator.autocast():
            yield reference


def token_logprobs(
    model, input_ids, attention_mask, targets, position_ids=None, temperature: float = 1.0, at=None, **packed
):
    """Log-probabilities of `targets`, the last targets.shape[1] tokens of each row of `input_ids`,
    under `model` (at `temperature`): fp32, [rows, targets]; or with `at` (flat positions of
    input_ids, any shape) the tokens that those positions predict, in at's shape. Only those
    positions' logits are computed, a chunk of rows at a time (target_logprobs): no tensor of the
    whole vocabulary's fp32 logits for every target. build_model swaps the forward pass that does it
    in before prepare (under autocast); a model built elsewhere gets it here. `packed`: a packed
    row's cumulative sequence lengths, passed on to the attention (chat/packed_attention.py)."""
    use_answer_loss(extract_model_from_parallel(model))
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logprob_targets=targets,
        logprob_index=at,
        temperature=temperature,
        **packed,
    )
    return output.logprobs


# --------------------------------------------------------------------------------------------- save
def share_tied_weights(state_dict: dict | None, model) -> None:
    """Point the names of one tied weight (a tied lm_head and input embeddings) at one tensor of
    `state_dict`.

    save_pretrained writes a tied weight once only when its names share storage; FSDP2's gathered
    state dict holds a copy per name, which would write the output head again (the size of the
    embeddings). ZeRO-3 gives None off the main process: nothing to do there."""
    if not state_dict:
        return
    first = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name and name in state_dict and kept in state_dict:
            state_dict[name] = state_dict[kept]


def save_model(accelerator, model, tokenizer, folder) -> None:
    """The adapter (LoRA) or the whole model, as from_pretrained / peft and --predict read it, with
    the tokenizer.
    Collective: every process calls it."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if accelerator.distributed_type == DistributedType.FSDP and isinstance(unwrapped, peft.PeftModel):
        # FSDP2: gather the adapter's shards only (all ranks, in the same order), not the whole
        # frozen base, which get_state_dict would copy to
        # the main process' RAM to keep a few MB of it.
        from torch.distributed.tensor import DTensor

        state_dict = {
            name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().cpu()
            for name, param in unwrapped.named_parameters()
            if param.requires_grad
        }
    else:
        # gathers the full weights under FSDP / DeepSpeed
        # ZeRO-3; peft keeps the adapter's weights of them
        state_dict = accelerator.get_state_dict(model_to_save(accelerator, model))
    share_tied_weights(state_dict, unwrapped)
    # the trained adapter only: another one beside it
    # (GRPO's frozen reference) is not part of the result
    adapters = (
        {"selected_adapters": [unwrapped.active_adapter]} if isinstance(unwrapped, peft.PeftModel) else {}
    )
    unwrapped.save_pretrained(
        folder,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
        **adapters,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(folder)


def write_samples(accelerator, output: Path, epoch: int, step: int, samples: list[dict], tracking) -> None:
    """The first answers of an evaluation, to samples.jsonl and to SwanLab as text (main
    process)."""
    if not accelerator.is_main_process or not samples:
        return
    with open(output / SAMPLES_FILE, "a") as file:
        for sample in samples[:SAMPLES_KEPT]:
            file.write(json.dumps({"epoch": epoch, **sample}, ensure_ascii=False) + "\n")
    if "swanlab" in tracking.log_with:
        import swanlab

        texts = [
            swanlab.Text(f"{s['prompt']} -> {s['answer']} (reference: {s['reference']})") for s in samples
        ]
        accelerator.get_tracker("swanlab").log({"eval/samples": texts[:SAMPLES_KEPT]}, step=step)


def print_saved(results: dict, path: Path, tracking, script: str) -> None:
    """After a run's summary table (main process): what was saved where, how to try it, and where
    the tracker keeps the run. `path`: the results.json written; `script`: the recipe's __file__."""
    what = "adapter" if results["method"] == "lora" else "model"
    best = f" (epoch {results['best_epoch']})" if results.get("best_epoch") is not None else ""
    print(
        f"{what}, tokenizer, model_best/{best} and {path.name} saved in {path.parent}; try it: "
        f"python {os.path.relpath(script)} --chat --model {path.parent}"
    )
    where = tracking.where()
    if where:
        print(where)


# ------------------------------------------------------------------------------ answers, greedy
@torch.no_grad()
def generate_answers(
    model, tokenizer, conversations, accelerator, max_new_tokens: int, batch_size: int, decode: str = "auto"
):
    """Greedy answers to the given validation conversations' last prompts, compared with their
    references: ({eval_exact_match, eval_generated}, [{prompt, reference, answer}, ...]), decoded as
    --decode says.

    Each process answers its share (accelerate's split_between_processes); the answers are gathered
    in order.
    """
    unwrapped = accelerator.unwrap_model(model)
    mode = decode_mode(decode, accelerator.device, accelerator.distributed_type)
    if mode == "compiled" and not decodes_compiled(unwrapped, decode, accelerator.device):
        mode = "eager"
    dtype = compute_dtype(accelerator, unwrapped)
    unwrapped.eval()
    pairs = [generation_prompt(messages) for messages in conversations]
    answers = []
    with accelerator.split_between_processes(list(range(len(pairs)))) as mine:
        for start in range(0, len(mine), batch_size):
            prompts = [pairs[i][0] for i in mine[start : start + batch_size]]
            replies = greedy(unwrapped, tokenizer, prompts, max_new_tokens, mode=mode, dtype=dtype)
            answers += list(zip(mine[start : start + batch_size], replies))
    unwrapped.train()
    answers = sorted(gather_object(answers))  # (index, answer) pairs of every process
    samples = [
        {"prompt": pairs[i][0][-1]["content"], "reference": pairs[i][1], "answer": answer}
        for i, answer in answers
    ]
    matches = [exact_match(s["answer"], s["reference"]) for s in samples]
    return {"eval_exact_match": sum(matches) / max(len(matches), 1), "eval_generated": len(matches)}, samples


def greedy(
    model,
    tokenizer,
    prompts: list[list[dict]],
    max_new_tokens: int,
    streamer=None,
    mode="eager",
    dtype=None,
    own=False,
) -> list[str]:
    """Greedy answers to conversations that end with a user turn, in one left-padded batch, with the
    model's own generation options; decoded as `mode` (generation.decode_mode) says."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    left_padding = copy.copy(tokenizer)  # a decoder continues from the last position of each row
    left_padding.padding_side = "left"
    inputs = left_padding(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    config = greedy_config(model, max_new_tokens, tokenizer.pad_token_id)
    output = greedy_ids(
        model, inputs["input_ids"], inputs["attention_mask"], config, mode, dtype, streamer, own
    )
    return tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
