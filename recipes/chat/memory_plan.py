"""The memory plan of a chat fine-tune: per-process bytes of weights, gradients, optimizer states
and activations, computed from the model (or its config, on the meta device) and the launch, before
anything is trained.

What one process keeps, by strategy (N processes in a shard group: all of them, or under hybrid
sharding (HSDP, 2node-hsdp.yaml) the dp_shard_size processes of a node, the nodes holding replicas):

    ddp / no   the whole model, gradients and AdamW states (DDP adds a second copy of the
               gradients: its buckets)
    zero1      the AdamW states divided by N
    zero2      gradients and AdamW states divided by N (DeepSpeed ZeRO-2, FSDP's SHARD_GRAD_OP)
    fsdp/zero3 weights, gradients and AdamW states divided by N, plus one block's weights
               gathered at a time

Bytes per parameter: a trainable one costs its weight, its gradient and AdamW's two moments in its
own dtype (fp32: 4 + 4 + 8 = 16 B; the full fine-tune's master weights and LoRA's adapters are
fp32); a frozen one (LoRA's base) only its weight (2 B in bf16 runs, 4 B in fp32 runs). The counts
and dtypes are read from the model itself, so these parts hold for any architecture; the activation
estimate assumes a Llama-like decoder block (see activations()).
"""

import dataclasses
import os
from dataclasses import dataclass, field

import psutil
import torch
from accelerate.utils import DistributedType
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

from accelerate_recipes import RecipeError, first_line
from accelerate_recipes.launch import per_process_batch_size

from .answer_loss import CHUNK_LOGITS, PLAIN_LOGITS
from .generation import cache_shape, compute_dtype, decode_mode, kv_layout

MB = 2**20
# a plan fits in 90% of the memory: the CUDA context, the allocator's fragmentation, the runtime
HEADROOM = 0.9
# Which of (weights, gradients, optimizer states) each strategy divides over the processes.
SHARDED = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "fsdp": (True, True, True),
    "zero3": (True, True, True),
}


def numel(parameter) -> int:
    """Elements of a parameter, whole: DeepSpeed ZeRO-3 may have partitioned it at load, leaving it
    empty."""
    return getattr(parameter, "ds_numel", None) or parameter.numel()


@dataclass(frozen=True)
class ModelSize:
    """What the plan needs of a model, read from the model object (real or on the meta device)."""

    parameters: int
    trainable: int
    trainable_bytes: int  # bytes of one trainable element (4: fp32 master weights, fp32 adapters)
    frozen_bytes: int  # all frozen weights together
    residual_bytes: int  # the dtype of the hidden states between blocks: that of the embeddings
    hidden: int
    intermediate: int
    q_dim: int  # attention heads x head size: the width of the queries and of the attention output
    kv_dim: int
    layers: int
    vocab: int
    block_bytes: int  # one decoder block's weights: what FSDP / ZeRO-3 gather at a time
    # adapter parameters per unit of rank on every linear layer but the head (0 if LoRA already)
    lora_per_rank: int
    # the loss makes logits for answer positions only, a chunk at a time (answer_loss.PLAIN_LOGITS)
    chunked_loss: bool

    @classmethod
    def of(cls, model) -> "ModelSize":
        config = model.config
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in block_names]
        head = model.get_output_embeddings()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        is_lora = any("lora_" in name for name, _ in model.named_parameters())
        return cls(
            parameters=sum(numel(p) for p in params),
            trainable=sum(numel(p) for p in trainable),
            trainable_bytes=trainable[0].element_size() if trainable else 4,
            frozen_bytes=sum(numel(p) * p.element_size() for p in params if not p.requires_grad),
            residual_bytes=model.get_input_embeddings().weight.element_size(),
            hidden=config.hidden_size,
            # configs without the name (GPT-2's n_inner, often None) mean the classic 4 x hidden
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            q_dim=heads * head_dim,
            kv_dim=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
            layers=config.num_hidden_layers,
            vocab=config.vocab_size,
            block_bytes=max(
                (sum(numel(p) * p.element_size() for p in b.parameters()) for b in blocks), default=0
            ),
            # LoRA adds r x (in + out) parameters to a linear layer (its A and B matrices)
            lora_per_rank=0 if is_lora else sum(m.in_features + m.out_features for m in linears),
            chunked_loss=config.model_type in PLAIN_LOGITS,
        )

    def as_lora(self, rank: int, base_bytes: int) -> "ModelSize":
        """The same model frozen in `base_bytes` per weight with a rank-`rank` fp32 adapter on every
        linear layer."""
        adapter = rank * self.lora_per_rank
        return ModelSize(
            **{
                **self.__dict__,
                "parameters": self.parameters + adapter,
                "trainable": adapter,
                "trainable_bytes": 4,
                "frozen_bytes": self.parameters * base_bytes,
                "residual_bytes": base_bytes,
                "block_bytes": self.block_bytes * base_bytes // max(self.trainable_bytes, 1),
                "lora_per_rank": 0,
            }
        )


@dataclass(frozen=True)
class Launch:
    """How the run is launched, as far as memory goes."""

    strategy: str
    processes: int
    micro_batch: int  # conversations per process per forward pass
    accumulation: int
    max_length: int
    checkpointing: bool
    compute_bytes: int  # 2 under bf16/fp16 autocast, 4 in fp32
    lora_r: int
    device_mb: float  # memory one process may use
    device_note: str = field(default="")
    shard_processes: int = 0  # the processes a sharded part is split over (0: all; HSDP: a node's)

    def layout(self) -> str:
        """The strategy and the processes, as the plan's first line names them."""
        shards = f", sharded in groups of {self.shard_processes}" if self.shard_processes else ""
        return f"{self.strategy} on {self.processes} process(es){shards}"


def parts(size: ModelSize, launch: Launch) -> dict[str, float]:
    """Per-process megabytes of each part and their total."""
    n = launch.shard_processes or launch.processes
    weights_div, grads_div, states_div = (n if sharded else 1 for sharded in SHARDED[launch.strategy])
    trainable = size.trainable * size.trainable_bytes
    weights = (size.frozen_bytes + trainable) / weights_div
    if weights_div > 1:
        weights += size.block_bytes  # the block being computed is gathered whole
    gradients = trainable / grads_div
    if launch.strategy == "ddp" and n > 1:
        # DDP all-reduces through buckets that copy the gradients (gradient_as_bucket_view off)
        gradients *= 2
    # AdamW's exp_avg and exp_avg_sq, in the parameter's dtype
    optimizer = 2 * trainable / states_div
    blocks, logits = activations(size, launch)
    result = dict(
        weights=weights, gradients=gradients, optimizer=optimizer, activations=blocks, logits=logits
    )
    result = {k: v / MB for k, v in result.items()}
    result["total"] = sum(result.values())
    return result


def activations(size: ModelSize, launch: Launch) -> tuple[float, float]:
    """(decoder blocks, logits) in bytes for one micro-batch of --max_length tokens per conversation
    (padding to the longest conversation of a batch makes --max_length the worst case).

    A Llama / Qwen2 block keeps for its backward pass, per token, in the compute dtype e: the inputs
    and outputs of its two norms (4h), the queries and the attention output (2 q_dim, = 2h in most
    models), the keys and values (2 kv_dim), and in the gated MLP the gate and up outputs, the
    activation and the product fed to down_proj (4 x intermediate). This follows the per-tensor
    count of Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer
    Models": 34 s b h bytes per GPT block with a 4h MLP in 16-bit), adapted to the gated MLP and to
    sdpa / flash attention, which keep no s x s score matrix. With gradient checkpointing only each
    block's input stays (h per token in the hidden states' dtype), plus one block's activations
    while it is recomputed. The loss comes on top (answer_loss.py): the hidden states of the answer
    positions picked out and their gradient (at most every token: 2 h e per token), and one chunk of
    logits at a time (CHUNK_LOGITS values at most, or every token's when fewer) whose gradient is
    made in the forward pass: in the compute dtype, their fp32 copy (the softmax and its gradient
    are made in it) and the gradient cast back (2e + 4 bytes per value under bf16, 4 in fp32 runs,
    where the copy is the same tensor). A trained output layer (a full fine-tune) adds its weight's
    gradient, summed over the chunks in fp32 and kept from the forward pass to the backward (4 bytes
    per weight), and under autocast the weight's copy in the compute dtype (e). Under ZeRO-3 each
    chunk is made again in the backward pass instead: the fp32 log-probabilities and gradient on top
    (2e + 12 bytes per value, 12 in fp32). Models whose logits are more than the output layer's
    product (answer_loss.PLAIN_LOGITS lists the others) make every position's logits at once: e + 8
    bytes per value (the model's own and the fp32 copy and log-probabilities of the loss).
    """
    tokens = launch.micro_batch * launch.max_length
    e = launch.compute_bytes
    per_block = tokens * e * (4 * size.hidden + 2 * size.q_dim + 2 * size.kv_dim + 4 * size.intermediate)
    if launch.checkpointing:
        blocks = size.layers * tokens * size.hidden * size.residual_bytes + per_block
    else:
        blocks = size.layers * per_block
    if not size.chunked_loss:
        return blocks, tokens * size.vocab * (e + 8 if e < 4 else 8)
    chunk = min(tokens, max(1, CHUNK_LOGITS // size.vocab))
    picked = 2 * tokens * size.hidden * e
    if launch.strategy == "zero3":
        return blocks, picked + chunk * size.vocab * (2 * e + 12 if e < 4 else 12)
    output_layer = (
        size.vocab * size.hidden * (4 + e if e < 4 else 4) if size.trainable == size.parameters else 0
    )
    return blocks, picked + chunk * size.vocab * (2 * e + 4 if e < 4 else 4) + output_layer


# --------------------------------------------------------------------------------------- the launch
def launched_strategy(accelerator) -> str:
    """The strategy of `accelerator`'s launch, by what each process keeps (see the module's
    docstring)."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return {0: "ddp", 1: "zero1", 2: "zero2"}.get(accelerator.state.deepspeed_plugin.zero_stage, "zero3")
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        how = plugin.reshard_after_forward if plugin.fsdp_version == 2 else plugin.sharding_strategy
        name = getattr(how, "name", str(how)).upper()
        if name in ("FALSE", "SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"):
            # weights kept whole after the forward pass, gradients and states sharded
            return "zero2"
        return "ddp" if name == "NO_SHARD" else "fsdp"
    return "ddp"


def shard_group_size(accelerator) -> int:
    """The processes of one shard group: under hybrid sharding (a parallelism_config's mesh)
    dp_shard_size, the replicas holding the same shards; otherwise 0, every process."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or accelerator.distributed_type != DistributedType.FSDP:
        return 0
    return config.dp_shard_size if config.dp_shard_size < accelerator.num_processes else 0


def device_memory(accelerator) -> tuple[float, str]:
    """(MB one process may use, what that is): free GPU memory, or the host's available memory
    shared by the node's processes."""
    if accelerator.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(accelerator.device)
        return free / MB, f"free on {torch.cuda.get_device_name(accelerator.device)}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    available = psutil.virtual_memory().available / MB
    return available / local, f"host memory available / {local} local process(es)"


def launch_of(accelerator, args, per_process: int) -> Launch:
    """The run's launch, or the one --plan_devices / --plan_device_gb / --plan_sharding assume
    instead."""
    if args.plan_devices < 0 or args.plan_device_gb < 0:
        raise RecipeError("--plan_devices and --plan_device_gb must be >= 0 (0: those of this launch)")
    strategy = args.plan_sharding or launched_strategy(accelerator)
    processes = args.plan_devices or accelerator.num_processes
    shard = 0 if args.plan_devices or args.plan_sharding else shard_group_size(accelerator)
    if args.plan_devices and not args.batch_tokens:
        per_process = per_process_batch_size(args.batch_size, processes, args.gradient_accumulation_steps)
    if args.plan_device_gb:
        device_mb, note = args.plan_device_gb * 1024, f"assumed: --plan_device_gb {args.plan_device_gb:g}"
    else:
        device_mb, note = device_memory(accelerator)
    return Launch(
        strategy=strategy,
        processes=processes,
        # --batch_tokens: one row of that many tokens
        micro_batch=1 if args.batch_tokens else per_process,
        accumulation=args.gradient_accumulation_steps,
        max_length=args.batch_tokens or args.max_length,
        checkpointing=args.gradient_checkpointing,
        compute_bytes=2 if accelerator.mixed_precision in ("bf16", "fp16") else 4,
        lora_r=args.lora_r,
        device_mb=device_mb,
        device_note=note,
        shard_processes=shard,
    )


def meta_model(name: str, dtype):
    """The architecture of --model built on the meta device from its config alone: shapes and
    dtypes, no memory."""
    path = os.path.expanduser(name)
    try:
        if path.endswith(".gguf"):
            config = AutoConfig.from_pretrained(
                os.path.dirname(path) or ".", gguf_file=os.path.basename(path)
            )
        else:
            config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise RecipeError(f"could not read the config of --model {name!r}: {first_line(err)}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# ----------------------------------------------------------------------------------------- the plan
def fits(total_mb: float, launch: Launch) -> bool:
    return total_mb <= HEADROOM * launch.device_mb


def advice(size: ModelSize, launch: Launch, fixed_mb: float = 0.0) -> str:
    """One line naming the change that makes the run fit: the first candidate whose plan fits, in
    this order: what keeps the method and the devices (checkpointing, smaller micro-batches, FSDP
    over the processes there are), LoRA, these together, then FSDP over more devices of the same
    memory. `fixed_mb`: what the run keeps besides training's parts, whatever the change (GRPO's
    reference, decode copy and KV cache)."""
    base_bytes = 2 if launch.compute_bytes == 2 else 4
    lora = size.as_lora(16, base_bytes) if not launch.lora_r and size.lora_per_rank else None
    candidates = []
    if not launch.checkpointing:
        candidates.append(("--gradient_checkpointing", size, dict(checkpointing=True)))
    micro = launch.micro_batch
    while micro > 1:
        micro //= 2
        steps = launch.accumulation * launch.micro_batch // micro
        what = f"--gradient_accumulation_steps {steps} (micro-batch {micro})"
        candidates.append((what, size, dict(micro_batch=micro)))

    def sharded(n: int) -> list:
        """FSDP over n processes (the same global batch, so a smaller micro-batch each), alone and
        with the rest."""
        if launch.strategy == "fsdp" or n < max(2, launch.processes):
            return []
        where = f"these {n} processes" if n == launch.processes else f"{n} processes of this memory"
        what = f"FSDP (full shard) on {where}"
        per = max(1, launch.micro_batch * launch.processes // n)
        return [
            (what, size, dict(strategy="fsdp", processes=n, micro_batch=per, shard_processes=0)),
            (
                " and ".join([what, *named]),
                lora or size,
                dict(together, strategy="fsdp", processes=n, shard_processes=0),
            ),
        ]

    together = dict(checkpointing=True, micro_batch=1)
    named = ["--lora_r 16"] if lora else []
    named += [] if launch.checkpointing else ["--gradient_checkpointing"]
    if launch.micro_batch > 1:
        named.append(
            f"micro-batch 1 (--gradient_accumulation_steps {launch.accumulation * launch.micro_batch})"
        )
    candidates += sharded(launch.processes)[:1]
    if lora:
        candidates.append(("--lora_r 16", lora, {}))
    if len(named) > 1:
        candidates.append((" and ".join(named), lora or size, together))
    candidates += sharded(launch.processes)[1:]
    for n in (2, 4, 8, 16, 32, 64):
        if n > launch.processes:
            candidates += sharded(n)
    for what, candidate_size, changes in candidates:
        changed = Launch(**{**launch.__dict__, **changes})
        total = parts(candidate_size, changed)["total"] + fixed_mb
        if fits(total, changed):
            return f"would fit with {what}: {total:,.0f} MB per process"
    return "no change tried fits: use devices with more memory or a smaller model"


def largest_token_budget(size: ModelSize, launch: Launch, step: int = 256) -> int:
    """The most tokens one micro-batch of packed rows may hold and still fit (a multiple of `step`;
    0: not even that many): what --packing --batch_tokens may ask for on this launch."""
    low, high = 0, 1 << 24  # every plan is linear in the tokens: the fit ends at one budget
    while high - low > step:
        middle = (low + high) // 2 // step * step
        changed = Launch(**{**launch.__dict__, "micro_batch": 1, "max_length": middle})
        low, high = (middle, high) if fits(parts(size, changed)["total"], changed) else (low, middle)
    return low


@dataclass(frozen=True)
class MemoryPlan:
    size: ModelSize
    launch: Launch
    mb: dict

    @classmethod
    def of(cls, model, launch: Launch) -> "MemoryPlan":
        size = ModelSize.of(model)
        return cls(size, launch, parts(size, launch))

    @property
    def fits(self) -> bool:
        return fits(self.mb["total"], self.launch)

    def table(self) -> str:
        launch, size = self.launch, self.size
        method = f"LoRA r{launch.lora_r}" if launch.lora_r else "full fine-tune"
        precision = "bf16/fp16 compute" if launch.compute_bytes == 2 else "fp32"
        lines = [
            f"memory plan per process: {method}, {launch.layout()}, micro-batch "
            f"{launch.micro_batch} x {launch.max_length} tokens, {precision}"
            f"{', gradient checkpointing' if launch.checkpointing else ''}",
            f"  parameters      {size.parameters:>14,} ({size.trainable:,} trainable)",
        ]
        lines += [f"  {name:<15} {self.mb[name]:>11,.0f} MB" for name in self.mb]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  available       {launch.device_mb:>11,.0f} MB ({launch.device_note}): {verdict}")
        if not self.fits:
            lines.append(f"  {advice(size, launch)}")
        budget = largest_token_budget(size, launch)
        if budget:  # how far the micro-batch could grow: fuller steps keep a GPU busier
            lines.append(
                f"  a micro-batch of up to {budget:,} tokens fits: --packing --batch_tokens {budget}"
            )
        return "\n".join(lines)


def print_plan(accelerator, args, model, per_process: int) -> MemoryPlan:
    """The plan of this run (or of the launch --plan_* assume), printed by the main process."""
    plan = MemoryPlan.of(model, launch_of(accelerator, args, per_process))
    accelerator.print(plan.table())
    return plan


# ---------------------------------------------------------------------------------- GRPO's rollouts
def kv_cache_bytes(config, rows: int, length: int, element_bytes: int) -> int:
    """Bytes of a static KV cache of `rows` rows x `length` positions as transformers' StaticCache
    allocates it: the keys and values of every layer, 2 x layers x kv_heads x head_dim x rows x
    length x bytes (a sliding-window layer holds its window at most)."""
    kv_heads, head_dim = kv_layout(config)
    # their lengths only: no allocation
    layers = StaticCache(config=config, max_cache_len=length).layers
    positions = sum(getattr(layer, "max_cache_len", 0) for layer in layers)
    return 2 * kv_heads * head_dim * rows * positions * element_bytes


def reference_parameters(model, reference) -> list:
    """The weights the reference policy adds (chat.model.reference_policy): a frozen copy's, a
    frozen adapter's inside `model` (named `reference`), or none (the base with the adapter off; no
    reference)."""
    if isinstance(reference, torch.nn.Module):
        return list(reference.parameters())
    if isinstance(reference, str):
        return [p for name, p in model.named_parameters() if "lora_" in name and reference in name.split(".")]
    return []


@dataclass(frozen=True)
class RolloutPlan(MemoryPlan):
    """GRPO's plan: training's parts for an update pass of `launch.micro_batch` completions, and
    what the rollouts keep for the whole run besides: the reference policy (--beta), and under
    --decode static or compiled the decode copy (the model in the compute dtype, LoRA merged) and
    its one static KV cache of `cache` (rows, positions)."""

    decode: str = "eager"
    cache: tuple[int, int] = (0, 0)

    def table(self) -> str:
        launch, size, mb = self.launch, self.size, self.mb
        method = f"LoRA r{launch.lora_r}" if launch.lora_r else "full fine-tune"
        precision = "bf16/fp16 compute" if launch.compute_bytes == 2 else "fp32"
        rows, length = self.cache
        if self.decode == "eager":
            decode = "a dynamic KV cache per generation, freed before the update"
        else:
            decode = f"one static KV cache of {rows} rows x {length} positions for every generation"
        lines = [
            f"memory plan per process: {method}, {launch.layout()}, "
            f"update passes of {launch.micro_batch} completions x {launch.max_length} tokens, {precision}"
            f"{', gradient checkpointing' if launch.checkpointing else ''}",
            f"  decode {self.decode}: {decode}",
            f"  parameters      {size.parameters:>14,} ({size.trainable:,} trainable)",
        ]
        lines += [f"  {name:<15} {mb[name]:>11,.0f} MB" for name in mb]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  available       {launch.device_mb:>11,.0f} MB ({launch.device_note}): {verdict}")
        if not self.fits and fits(mb["total"] - mb["kv_cache"], launch):
            # More, shorter caches never need less: the longest
            # prompts' calls need this one besides them.
            lines.append(
                f"  it would fit without the static KV cache ({mb['kv_cache']:,.0f} MB), and no split into "
                "more cache lengths needs less: lower --num_generations or --max_new_tokens, or use "
                "--decode eager"
            )
        elif not self.fits:
            kept = mb["reference"] + mb["decode_copy"] + mb["kv_cache"]
            lines.append(f"  {advice(size, launch, kept)}")
        return "\n".join(lines)


def rollout_plan(accelerator, args, model, reference, rows: int, longest_prompt: int) -> RolloutPlan:
    """GRPO's plan for `rows` completions per process per micro-batch (an update pass takes
    --update_rows of them when fewer) of prompts up to `longest_prompt` tokens: every generation
    decodes in the cache of `rows` such prompts (generation.cache_shape), an evaluation's batches
    being no larger."""
    mode = decode_mode(args.decode, accelerator.device, accelerator.distributed_type)
    shape = cache_shape(rows, longest_prompt, args.max_new_tokens)
    element_bytes = compute_dtype(accelerator, model).itemsize
    own = reference_parameters(model, reference)
    reference_bytes = sum(numel(p) * p.element_size() for p in own)
    size = ModelSize.of(model)
    # the frozen adapter sits in the model: the reference's part
    if isinstance(reference, str) and own:
        parameters, frozen = size.parameters - sum(map(numel, own)), size.frozen_bytes - reference_bytes
        size = dataclasses.replace(size, parameters=parameters, frozen_bytes=frozen)
    device_mb, note = device_memory(accelerator)
    if own and own[0].device.type == "cuda":  # a frozen copy already on the GPU: planned, not free
        device_mb += reference_bytes / MB
    launch = Launch(
        strategy=launched_strategy(accelerator),
        processes=accelerator.num_processes,
        micro_batch=args.update_rows if 0 < args.update_rows < rows else rows,
        accumulation=args.gradient_accumulation_steps,
        # prompts padded to a batch's widest, then answers
        max_length=longest_prompt + args.max_new_tokens,
        checkpointing=args.gradient_checkpointing,
        compute_bytes=2 if accelerator.mixed_precision in ("bf16", "fp16") else 4,
        lora_r=args.lora_r,
        device_mb=device_mb,
        device_note=note,
        shard_processes=shard_group_size(accelerator),
    )
    training = parts(size, launch)
    static = mode != "eager"
    # the copy's
    base = sum(numel(p) for name, p in model.named_parameters() if "lora_" not in name)
    mb = {name: training[name] for name in ("weights", "gradients", "optimizer")}
    mb["reference"] = reference_bytes / MB
    mb["decode_copy"] = base * element_bytes / MB if static else 0.0
    mb["kv_cache"] = kv_cache_bytes(model.config, *shape, element_bytes) / MB if static else 0.0
    mb.update(activations=training["activations"], logits=training["logits"])
    mb["total"] = sum(mb.values())
    return RolloutPlan(size, launch, mb, decode=mode, cache=shape)


def print_rollout_plan(accelerator, args, model, reference, rows: int, longest_prompt: int) -> RolloutPlan:
    """GRPO's plan (rollout_plan), printed by the main process."""
    plan = rollout_plan(accelerator, args, model, reference, rows, longest_prompt)
    accelerator.print(plan.table())
    return plan
