"""Generation for the chat recipes: GRPO's rollouts, the generated evaluations of SFT, DPO and GRPO,
and --predict.

The ways to decode, chosen by --decode:

- eager: transformers' `generate` on the trained model itself, with a dynamic KV cache, every
  token's step run op by op. Works everywhere, sharded models included (see
  whole_weights_for_generation), and on a GPU it is bound by the host: a 0.5B model spends ~50 ms a
  token in Python and kernel launches for ~2 ms of GPU work (H100, 2026-11-27).
- static, compiled: a copy of the model for generation in the run's compute dtype, LoRA adapters
  merged into its weights (one matmul per layer instead of five extra kernels, and no fp32 adapter
  outside autocast), refreshed from the trained weights at every call; a static KV cache whose
  length is the prompt width rounded up to PROMPT_BUCKET plus --max_new_tokens, and rows rounded up
  to ROW_BUCKET, or a larger cache made before (reserve_cache: GRPO reserves its longest call's
  shape before the first rollout), so one shape serves a whole run. `compiled` also compiles the
  decode step (transformers' compiled `generate` path: torch.compile, CUDA graphs on a GPU); the
  first call of each shape pays the compilation, which the GRPO meter reports apart from the steady
  throughput.
- auto (default): compiled on a GPU for an unsharded model, eager otherwise (the CPU, FSDP2, ZeRO-3,
  --chat). A compiled decode that auto chose and that cannot compile (no toolchain for inductor, a
  backend error, a CUDA graph that cannot be captured, the recompile limit) decodes eagerly from
  that call on, said in one line (decode_path); --decode compiled makes the same an error.

Sampling is keyed (KeyedSampling): each row's draw at each position comes from a hash of (row key,
position), so the same keys give the same completions whatever the batch, the process count or the
way of decoding.
"""

import contextlib
import copy
import inspect
import math
import weakref
from dataclasses import dataclass

import peft
import torch
from accelerate.utils import DistributedType
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
)
from transformers.generation import CompileConfig

from accelerate_recipes import RecipeError
from accelerate_recipes.compiling import CompiledPath, fail_loudly_in_forward

PROMPT_BUCKET = 64  # static caches: prompt widths rounded up to a multiple of this, + --max_new_tokens
# rows rounded up to a multiple of this (repeated rows, dropped after): fewer shapes to compile
ROW_BUCKET = 8


def decode_mode(flag: str, device, distributed_type=DistributedType.NO) -> str:
    """The way to decode that --decode names on `device`: auto is compiled on CUDA for an unsharded
    model, else eager. static and compiled need the whole model on each process, which FSDP2 and
    ZeRO-3 do not give."""
    sharded = distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if flag == "auto":
        return "compiled" if torch.device(device).type == "cuda" and not sharded else "eager"
    if flag != "eager" and sharded:
        raise RecipeError(
            f"--decode {flag} generates with a whole copy of the model on each process; under "
            "FSDP2 or DeepSpeed use --decode eager (the default there)"
        )
    return flag


# -------------------------------------------------------------------------------------- keyed draws
def _signed(value: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN, MIX_1, MIX_2 = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # logical: torch's >> on int64 copies the sign bit
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele, Lea and Flood, 2014) on int64 tensors, whose arithmetic
    wraps."""
    x = x + GOLDEN
    x = (x ^ _shift_right(x, 30)) * MIX_1
    x = (x ^ _shift_right(x, 27)) * MIX_2
    return x ^ _shift_right(x, 31)


def hashed_uniform(keys: torch.Tensor, position) -> torch.Tensor:
    """Uniform numbers in (0, 1) from a counter-based hash of (row key, position): the same number
    for the same row wherever and in whatever batch it is generated. `position` an int, or a tensor
    that broadcasts with `keys`."""
    bits = _shift_right(splitmix64(splitmix64(keys) + position), 40)  # 24 random bits
    return (bits.float() + 0.5) / 2**24


@dataclass
class Sampling:
    """How rollouts are sampled: the temperature, then optional filters of the tokens drawn from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, args) -> "Sampling":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__ if hasattr(args, name)})


class KeyedSampling(LogitsProcessor):
    """Sampling through greedy decoding: each row draws its token from the softmax of logits /
    temperature by the inverse of its cumulative distribution at a uniform number that comes from
    the row's key and the token's position within the completion (never the padded prompt's width,
    which depends on the other prompts of the batch), not from the global RNG; the returned scores
    put the drawn token first (0) and every other at -inf. The uniforms of the whole completion are
    drawn up front, one tensor, not a hash per token.

    Before the draw, optionally: the repetition penalty on the tokens the completion has already
    written (not the prompt's), then top_k, top_p and min_p restrict the tokens drawn from."""

    def __init__(self, keys: torch.Tensor, prompt_width: int, sampling: Sampling, max_new_tokens: int):
        self.prompt_width, self.sampling = prompt_width, sampling
        positions = torch.arange(max_new_tokens, device=keys.device)
        self.uniforms = hashed_uniform(keys[:, None], positions[None])  # [rows, max_new_tokens]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sampling = self.sampling
        scores = scores.float()
        written = input_ids[:, self.prompt_width :]
        if sampling.repetition_penalty != 1.0 and written.shape[1]:
            # CTRL's penalty, as transformers applies it, on the completion only
            seen = scores.gather(-1, written)
            penalty = sampling.repetition_penalty
            penalised = torch.where(seen > 0, seen / penalty, seen * penalty)
            scores = scores.scatter(-1, written, penalised)
        scores = scores / sampling.temperature
        if sampling.top_k and sampling.top_k < scores.shape[-1]:
            kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if sampling.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probabilities = ordered.softmax(dim=-1)
            above = probabilities.cumsum(dim=-1) - probabilities  # the mass of the likelier tokens
            outside = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, above > sampling.top_p)
            scores = scores.masked_fill(outside, -math.inf)
        if sampling.min_p:
            probabilities = scores.softmax(dim=-1)
            floor = sampling.min_p * probabilities.max(dim=-1, keepdim=True).values
            scores = scores.masked_fill(probabilities < floor, -math.inf)
        cumulative = scores.softmax(dim=-1).cumsum(dim=-1)
        # scaled by the row's total so that float rounding of
        # the sum never leaves a draw past the last token
        position = input_ids.shape[1] - self.prompt_width  # 0 for the completion's first token
        target = self.uniforms[:, position, None] * cumulative[:, -1:]
        drawn = torch.searchsorted(cumulative, target).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(-1, drawn, 0.0)


# ----------------------------------------------------------------------------------- the eager path
def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a turn: the generation config's (Qwen's <|im_end|>, Llama 3's
    <|eot_id|>) and the tokenizer's eos."""
    configured = model.generation_config.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


@contextlib.contextmanager
def whole_weights_for_generation(accelerator, model, gather_once: bool = True):
    """Generation with the weights gathered once, not once per token: under FSDP2 every shard unit
    is unsharded and kept so until generation ends; under DeepSpeed ZeRO-3 the parameters are
    gathered for its duration. Each process then holds the whole model while it generates (the
    memory cost of sharded generation). gather_once=False leaves the blocks to gather at each
    forward pass, as in training: only FSDP2's root unit (embeddings, head) stays whole."""
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FSDPModule

        # One forward pass through the root first: peft's generate enters below it, and FSDP2 must
        # have set up the root (lazily, at its first forward) before any inner unit runs.
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=accelerator.device))
        units = [m for m in unwrapped.modules() if isinstance(m, FSDPModule)]
        if not gather_once:
            # peft's generate calls the model below the root, whose forward hook would have gathered
            # the root's own weights: those are gathered here; each block gathers its own in its
            # forward pass, as in training.
            units = [unwrapped] if isinstance(unwrapped, FSDPModule) else []
        # Each unit keeps its weights gathered for the duration, then goes back to its own setting:
        # accelerate makes the root and the tail (final norm, output layer) units keep theirs after
        # the forward pass, which the chunked loss and log-probabilities rely on (they read the
        # output layer's weight after its call).
        own = {unit: reshards_after_forward(unit) for unit in units}
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield unwrapped
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(own[unit], recurse=False)
    elif (
        gather_once
        and accelerator.distributed_type == DistributedType.DEEPSPEED
        and getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3
    ):
        import deepspeed

        # With the weights gathered, DeepSpeed's per-module hooks would still run their bookkeeping
        # at every layer of every token (most of generation's time on the CPU): they are taken off
        # for the duration and put back.
        optimizer = getattr(model, "optimizer", None)
        offload = getattr(optimizer, "parameter_offload", optimizer)
        detach_hooks = hasattr(offload, "forward_hooks")
        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
            if detach_hooks:
                for hook in offload.forward_hooks + offload.backward_hooks:
                    hook.remove()
                offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield unwrapped
            finally:
                if detach_hooks:
                    offload._register_deepspeed_module(offload.module)
    else:
        yield unwrapped


def reshards_after_forward(unit) -> bool:
    """Whether an FSDP2 unit frees its gathered weights after its forward pass. FSDP2 has a setter
    but no getter: read from its parameter groups (one, `_fsdp_param_group`, up to torch 2.13; a
    list from 2.14), True if none is found."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    groups = [group for group in groups if group is not None]
    return any(group.post_forward_mesh_info is not None for group in groups) if groups else True


def generation_config(max_new_tokens: int, pad: int, stop: list[int], **options) -> GenerationConfig:
    """Greedy decoding with the KV cache and nothing else, whatever the model's own
    generation_config holds: transformers fills every option a GenerationConfig leaves unset from
    the model's (Qwen2.5-Instruct's repetition penalty, n-gram bans, suppressed tokens), and
    rollouts would then follow a policy other than the one whose log-probabilities the update uses.
    Sampling, when asked for, is KeyedSampling's alone."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=pad,
        eos_token_id=stop,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        **options,
    )


@contextlib.contextmanager
def own_generation_config(policy, config: GenerationConfig):
    """`config` in place of the model's own generation_config for the duration (see
    generation_config), so that none of the model's options is filled in."""
    inner = inner_model(policy)
    own = inner.generation_config
    inner.generation_config = config
    try:
        yield config
    finally:
        inner.generation_config = own


# ------------------------------------------------------------------------------------ the fast path
def bucketed_rows(rows: int) -> int:
    """The rows a call of `rows` rows decodes in when no cache made before holds it: a multiple of
    ROW_BUCKET."""
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def cache_shape(rows: int, prompt_width: int, max_new_tokens: int) -> tuple[int, int]:
    """The static cache shape of a call of `rows` prompts at most `prompt_width` tokens wide, as
    FastDecoder.generate buckets it: rows rounded up to ROW_BUCKET, the width up to PROMPT_BUCKET,
    plus `max_new_tokens`."""
    return bucketed_rows(rows), -(-prompt_width // PROMPT_BUCKET) * PROMPT_BUCKET + max_new_tokens


def kv_layout(config) -> tuple[int, int]:
    """(key-value heads, head size) of a model's attention layers: what one position of its KV cache
    holds per layer, twice (keys and values)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads


class FastDecoder:
    """The static and compiled paths for one trained model: a plain copy of its architecture in
    `dtype` on its device, refreshed from it before every generation (merge_weights_from), and a
    static KV cache per shape."""

    def __init__(self, policy, dtype: torch.dtype, compiled: bool, own: bool = False):
        self.dtype, self.compiled, self.caches, self.own = dtype, compiled, {}, own
        self.backend = "inductor"  # the compiled step's: its decode_path's (use_decode_backend)
        if own:  # a model only used for generation (--predict): decoded itself, no copy
            self.model = policy
            return
        config = copy.deepcopy(inner_model(policy).config)
        config.use_cache = True
        with torch.device("meta"):
            copy_ = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.model = copy_.to_empty(device=policy.device).eval().requires_grad_(False)
        self.model.tie_weights()
        with torch.no_grad():  # the buffers (rotary frequencies) once; the weights at every call
            for name, buffer in self.model.named_buffers():
                buffer.copy_(inner_model(policy).get_buffer(name))

    @torch.no_grad()
    def merge_weights_from(self, policy) -> None:
        """Every weight of the copy from the trained model's, each LoRA adapter's update (peft's
        delta weight: B A x its scale) added to its base weight."""
        if self.own:
            return
        source = inner_model(policy)
        for name, module in self.model.named_modules():
            params = dict(module.named_parameters(recurse=False))
            if not params:
                continue
            trained = source.get_submodule(name)
            if isinstance(trained, peft.tuners.lora.LoraLayer):
                base = trained.get_base_layer()
                active = [
                    a for a in trained.active_adapters if a in trained.lora_A and not trained.disable_adapters
                ]
                weight = base.weight.float()
                for adapter in active:
                    weight = weight + trained.get_delta_weight(adapter).float()
                params["weight"].copy_(weight)
                if "bias" in params:
                    params["bias"].copy_(base.bias)
            else:
                for key, param in params.items():
                    param.copy_(getattr(trained, key))

    @property
    def cache_argument(self) -> str:
        """What `generate` calls a cache it is given: `cache` from transformers 5.2x (the model's
        forward takes it), `past_key_values` before."""
        return (
            "cache"
            if "cache" in inspect.signature(type(self.model).forward).parameters
            else "past_key_values"
        )

    def shape(self, rows: int, length: int) -> tuple[int, int]:
        """The cache shape (rows, length) a call of `rows` rows and `length` positions decodes in:
        the smallest one made (or reserved) before that holds it (decoding a few rows costs a GPU
        about as much as decoding many, and a new shape costs a compilation), else rows rounded up
        to ROW_BUCKET."""
        fitting = [shape for shape in self.caches if shape[0] >= rows and shape[1] >= length]
        return min(fitting) if fitting else (bucketed_rows(rows), length)

    def cache(self, rows: int, length: int) -> StaticCache:
        """The static KV cache of this shape, emptied (made at its first use or reserved; the same
        tensors for a compiled step that was captured with them)."""
        if (rows, length) not in self.caches:
            self.caches[rows, length] = StaticCache(config=self.model.config, max_cache_len=length)
        cache = self.caches[rows, length]
        cache.reset()
        return cache

    def reserve(self, rows: int, length: int) -> tuple[int, int]:
        """The cache every later call of up to `rows` rows and `length` positions decodes in (shape
        takes it), made now with its tensors: a run that reserves its largest call's shape first
        compiles its decode step for that one shape, and its memory is taken before training's.
        Returns the shape (rows rounded up to ROW_BUCKET)."""
        rows, length = self.shape(rows, length)
        kv_heads, head_dim = kv_layout(self.model.config)
        self.cache(rows, length).early_initialization(rows, kv_heads, head_dim, self.dtype, self.model.device)
        return rows, length

    def cache_bytes(self) -> int:
        """Bytes of the static caches' key and value tensors made so far."""
        layers = [layer for cache in self.caches.values() for layer in cache.layers]
        tensors = [getattr(layer, name, None) for layer in layers for name in ("keys", "values")]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def generate(
        self, input_ids, attention_mask, config: GenerationConfig, logits_processor=None, streamer=None
    ) -> torch.Tensor:
        """`generate` of the copy with a static cache of a bucketed shape, compiled or not; the
        output of the rows given."""
        rows, width = input_ids.shape
        padded_rows, length = self.shape(
            rows, -(-width // PROMPT_BUCKET) * PROMPT_BUCKET + config.max_new_tokens
        )
        if padded_rows > rows:  # the last row repeated; its copies are dropped below
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(padded_rows - rows, -1)])
            attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(padded_rows - rows, -1)])
            # copies of the caller's processors: an eager
            # retry after a failed compile gets them unpadded
            logits_processor = [
                padded_rows_of(processor, padded_rows) for processor in logits_processor or []
            ]
        options = dict(cache_implementation=None)
        if self.compiled:
            # the recompile limit an error the decode's net catches, not a silent slow run
            fail_loudly_in_forward()
            # inductor's mode: CUDA graphs on a GPU; another backend (aot_eager, to check the path
            # quickly) has none
            mode = "reduce-overhead" if self.backend == "inductor" else None
            compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=self.backend, mode=mode)
            # the CPU too (for tests; a GPU gets CUDA graphs)
            compile_config._compile_all_devices = True
            options["compile_config"] = compile_config
        else:
            options["disable_compile"] = True
        config = copy.deepcopy(config)
        for key, value in options.items():
            setattr(config, key, value)
        with own_generation_config(self.model, config):
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=logits_processor,
                streamer=streamer,
                **{self.cache_argument: self.cache(padded_rows, length)},
            )
        return output[:rows]


def padded_rows_of(processor, rows: int):
    """`processor` for a batch filled up to `rows` rows by repeating its last: a KeyedSampling's
    copy with the last row's draws repeated as well; any other processor as it is."""
    if not isinstance(processor, KeyedSampling):
        return processor
    padded = copy.copy(processor)
    uniforms = processor.uniforms
    padded.uniforms = torch.cat([uniforms, uniforms[-1:].expand(rows - len(uniforms), -1)])
    return padded


# trained model -> its FastDecoder
_fast_decoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# trained model -> its compiled decode
_decode_paths: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decode_path(policy) -> CompiledPath:
    """The compiled decode of `policy` (the trained model, or the model --predict decodes): whether
    it was asked for, whether it went eager for the rest of the run and why, and what it
    compiled."""
    policy = getattr(policy, "_orig_mod", policy)
    path = _decode_paths.get(policy)
    if path is None:
        path = CompiledPath(
            "the decode step", skip="--decode eager", insist="--decode compiled", attempted=False
        )
        # its copy and caches freed
        path.when_eager.append(lambda: _fast_decoders.pop(policy, None))
        _decode_paths[policy] = path
    return path


def decodes_compiled(policy, flag: str, device) -> bool:
    """Whether `policy` decodes through the compiled step, which decode_mode chose from `flag`: not
    once its path went eager; at the first call, only when inductor has what it needs on `device`
    (else eager from the start, said in one line, or an error for an explicit --decode compiled)."""
    path = decode_path(policy)
    if not path.attempted:
        path.attempted, path.explicit = True, flag == "compiled"
        path.check_toolchain(device, path.backend)
    return not path.eager


def use_decode_backend(policy, backend: str) -> None:
    """The backend `policy`'s compiled decode compiles with (the recipe's --compile_backend):
    inductor by default, aot_eager to run the compiled path quickly on a CPU."""
    decode_path(policy).backend = backend


def without_compiling():
    """A context in which compiled blocks run the graphs they have and run eagerly where none fits,
    never compiling again: evaluation and generation come in shapes (no gradients, a new length per
    token) that training never had, and compiling each would cost more than it saves."""
    return torch.compiler.set_stance("eager_on_recompile")


def inner_model(policy):
    """The causal LM under a peft adapter, or the model itself."""
    return policy.get_base_model() if isinstance(policy, peft.PeftModel) else policy


def fast_decoder(policy, dtype: torch.dtype, compiled: bool, own: bool = False) -> FastDecoder:
    """The FastDecoder of `policy` (made at its first use), with the trained model's current
    weights. `own`: decode `policy` itself (a model in `dtype` only used for generation)."""
    # the module under torch.compile's wrapper (sft.py --compile)
    policy = getattr(policy, "_orig_mod", policy)
    decoder = _fast_decoders.get(policy)
    if decoder is None or (decoder.dtype, decoder.compiled, decoder.own) != (dtype, compiled, own):
        decoder = _fast_decoders[policy] = FastDecoder(policy, dtype, compiled, own)
    decoder.backend = decode_path(policy).backend
    decoder.merge_weights_from(policy)
    return decoder


def reserve_cache(accelerator, model, rows: int, length: int, decode: str = "auto") -> FastDecoder | None:
    """The FastDecoder `generate` will use for `model` under --decode `decode`, made now with its
    static cache of `rows` x `length` reserved (FastDecoder.reserve), so that every later call that
    fits decodes in that one shape; None when the mode is eager, whose dynamic cache lives only as
    long as each call."""
    mode = decode_mode(decode, accelerator.device, accelerator.distributed_type)
    policy = accelerator.unwrap_model(model)
    if mode == "compiled" and not decodes_compiled(policy, decode, accelerator.device):
        mode = "eager"  # no toolchain for the compiled step: generate decodes eagerly too
    if mode == "eager":
        return None
    decoder = fast_decoder(policy, compute_dtype(accelerator, policy), compiled=mode == "compiled")
    decoder.reserve(rows, length)
    return decoder


def compute_dtype(accelerator, policy) -> torch.dtype:
    """The dtype generation computes in: the run's mixed precision, else the model's weights'."""
    precision = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))
    return precision or next(policy.parameters()).dtype


# ----------------------------------------------------------------------------------------- generate
@dataclass
class Completions:
    """Left-padded prompts and their completions, as generate returns them (one row per
    completion)."""

    prompt: torch.Tensor  # token ids, [rows, prompt width], left-padded
    prompt_mask: torch.Tensor  # 1 on the prompt's tokens, 0 on its padding
    completion: torch.Tensor  # token ids, [rows, completion width]
    mask: torch.Tensor  # 1 up to and with the token that ended the completion
    truncated: torch.Tensor  # bool per row: no end of turn within max_new_tokens

    def texts(self, tokenizer) -> list[str]:
        ids = (self.completion * self.mask).tolist()
        lengths = self.mask.sum(dim=1).tolist()
        return tokenizer.batch_decode([row[:n] for row, n in zip(ids, lengths)], skip_special_tokens=True)


@torch.no_grad()
def generate(
    accelerator,
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    decode: str = "auto",
    keys: torch.Tensor | None = None,
    sampling: Sampling | None = None,
    gather_once: bool = True,
) -> Completions:
    """Completions of left-padded prompts, decoded as `decode` (--decode) says: sampled with keyed
    draws when `keys` are given (one per row; `sampling` says how), else greedy. Returns the rows'
    prompt and completion ids, masks, and which were cut. Collective under FSDP2 and ZeRO-3: every
    process calls it."""
    width = max(map(len, prompt_ids))
    pad = tokenizer.pad_token_id
    device = accelerator.device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    stop = eos_ids(accelerator.unwrap_model(model), tokenizer)
    config = generation_config(max_new_tokens, pad, stop)
    processors = None
    if keys is not None:
        processors = LogitsProcessorList([KeyedSampling(keys, width, sampling or Sampling(), max_new_tokens)])
    mode = decode_mode(decode, device, accelerator.distributed_type)
    unwrapped = accelerator.unwrap_model(model)
    if mode == "compiled" and not decodes_compiled(unwrapped, decode, device):
        mode = "eager"

    def eager() -> torch.Tensor:
        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        with (
            whole_weights_for_generation(accelerator, model, gather_once) as policy,
            own_generation_config(policy, config),
            without_compiling(),  # blocks compiled for training: a new shape every token
        ):
            was_training = policy.training
            policy.eval()
            output = policy.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=processors,
                # sharded: every process keeps stepping until all
                # are done, as their forward passes are collective
                synced_gpus=sharded and accelerator.num_processes > 1,
            )
            policy.train(was_training)
        return output

    def fast() -> torch.Tensor:
        decoder = fast_decoder(unwrapped, compute_dtype(accelerator, unwrapped), compiled=mode == "compiled")
        return decoder.generate(input_ids, attention_mask, config, processors)

    if mode == "eager":
        output = eager()
    elif mode == "compiled":  # a compile failure: this call and the run's later ones decode eagerly
        output = decode_path(unwrapped).call(fast, eager)
    else:
        output = fast()
    return completions_of(input_ids, attention_mask, output, stop)


def completions_of(input_ids, attention_mask, output: torch.Tensor, stop: list[int]) -> Completions:
    """The Completions of `generate`'s output (prompts and completions, padded after the first end
    of turn)."""
    width = input_ids.shape[1]
    completion = output[:, width:]
    is_stop = torch.isin(completion, torch.tensor(stop, device=completion.device))
    ended = is_stop.any(dim=1)
    first_stop = torch.where(ended, is_stop.int().argmax(dim=1), completion.shape[1])
    mask = (torch.arange(completion.shape[1], device=completion.device)[None] <= first_stop[:, None]).long()
    return Completions(input_ids, attention_mask, completion, mask, truncated=~ended)


def greedy_config(model, max_new_tokens: int, pad: int) -> GenerationConfig:
    """Greedy decoding with the model's own generation options (its repetition penalty, its
    end-of-turn tokens): the answers a user of the model would get, for evaluations and
    --predict."""
    config = copy.deepcopy(inner_model(model).generation_config)
    config.update(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True, pad_token_id=pad
    )
    return config


@torch.no_grad()
def greedy_ids(
    model, input_ids, attention_mask, config: GenerationConfig, mode: str, dtype, streamer=None, own=False
):
    """`generate`'s output for left-padded prompts on one process, decoded as `mode` (decode_mode)
    says: `model` itself (eager), or its FastDecoder (a copy in `dtype`, or the model itself when
    `own`); a compiled decode that fails to compile goes on eagerly (decode_path)."""

    def eager() -> torch.Tensor:
        with without_compiling():  # blocks compiled for training: a new shape every token
            return model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                streamer=streamer,
            )

    def fast(compiled: bool = False) -> torch.Tensor:
        decoder = fast_decoder(model, dtype, compiled=compiled, own=own)
        return decoder.generate(input_ids, attention_mask, config, streamer=streamer)

    if mode == "eager" or (mode == "compiled" and not decodes_compiled(model, mode, model.device)):
        return eager()
    if mode == "compiled":  # a compile failure: this call and the run's later ones decode eagerly
        return decode_path(model).call(lambda: fast(compiled=True), eager)
    return fast()


def check_generation(accelerator, eval_generate: int) -> None:
    """At start-up, not after the first epoch: --eval_generate decodes with the whole model in each
    process, which FSDP and DeepSpeed ZeRO-3 split across them."""
    if eval_generate and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise RecipeError(
            "--eval_generate needs the whole model in each process, and this run shards it "
            f"({accelerator.distributed_type.value}); leave the flag out and evaluate the saved "
            "model with --eval_only --eval_generate N in one process instead"
        )
