"""FSDP and DeepSpeed set-up the recipes share: FSDP2 on CPU processes, hybrid sharding (HSDP) on a
2-D device mesh, the block class FSDP shards by, and the flags (accumulation, clipping, the NaN
guard) that must mean the same under DDP, FSDP and DeepSpeed."""

import os
from contextlib import contextmanager

import torch
from accelerate import ParallelismConfig, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

from accelerate_recipes.errors import RecipeError

# What `accelerate launch` exports for a config's parallelism_config (accelerate 1.15);
# ParallelismConfig() reads the sizes from PARALLELISM_CONFIG_<NAME>_SIZE.
PARALLELISM = "ACCELERATE_USE_PARALLELISM_CONFIG"
MESH_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def _asked_for(variable: str) -> bool:
    return os.environ.get(variable, "false").lower() in ("1", "true")


def parallelism_sizes() -> dict[str, int] | None:
    """The mesh sizes of the config's parallelism_config, as the launcher exported them; None
    without one."""
    if not _asked_for(PARALLELISM):
        return None
    return {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")) for name in MESH_SIZES}


def check_hybrid_sharding() -> None:
    """Before `Accelerator(...)`: stop when the config's mesh does not fit the launch, naming sizes
    that do.

    Every process stays a data-parallel rank (--batch_size splits over all of them), so only
    dp_replicate and dp_shard may be set, and their product must count the processes launched. With
    replicas, a shard group must lie within one node: torchrun numbers the ranks node by node and
    the mesh puts neighbouring ranks in one shard group, and a group across nodes would all-gather
    every layer over the network.
    """
    sizes = parallelism_sizes()
    if sizes is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local)
    fix = (
        f"for {nodes} node(s) x {local} process(es) launch with "
        f"--parallelism_config_dp_replicate_size {nodes} --parallelism_config_dp_shard_size {local}"
    )
    if local == 1:  # nothing to shard within a node
        fix = "with one process per node launch with 2node.yaml (DDP) instead"
    others = [f"{name}_size {sizes[name]}" for name in MESH_SIZES[2:] if sizes[name] > 1]
    if others:
        raise RecipeError(
            f"the accelerate config's parallelism_config sets {', '.join(others)}, but the recipes "
            "train data parallel only (--batch_size splits over every process); set those sizes "
            f"to 1 and {fix}"
        )
    replicate, shard = sizes["dp_replicate"], sizes["dp_shard"]
    if replicate * shard != world:
        raise RecipeError(
            f"the accelerate config's parallelism_config has dp_replicate_size {replicate} x "
            f"dp_shard_size {shard} = {replicate * shard} processes, but {world} were launched; "
            f"{fix}"
        )
    if shard == 1:
        raise RecipeError(
            "dp_shard_size 1 in the accelerate config's parallelism_config shards nothing: every "
            f"process would hold the whole model, as 2node.yaml's DDP does with less traffic; {fix}"
        )
    if replicate > 1 and local % shard:
        raise RecipeError(
            f"dp_shard_size {shard} does not divide the {local} process(es) of a node, so a shard "
            f"group would span nodes and all-gather every layer over the network; {fix}"
        )


@contextmanager
def hybrid_sharding_startup():
    """Around `Accelerator(...)`: check the config's mesh; on the CPU have shard_on_cpu build it
    instead.

    accelerate 1.15 builds a parallelism_config's mesh in Accelerator() and refuses it there unless the run is
    FSDP2 or multi-GPU; on the CPU the run is MULTI_CPU until shard_on_cpu switches it to FSDP2. So
    the launcher's variable is hidden from the constructor alone, and restored after it.
    """
    check_hybrid_sharding()
    deferred = _asked_for(PARALLELISM)
    if deferred:  # on the CPU only; asked only then, as most runs have no mesh
        deferred = _asked_for("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    if deferred:
        os.environ[PARALLELISM] = "false"
    try:
        yield
    finally:
        if deferred:
            os.environ[PARALLELISM] = "true"


def shard_on_cpu(accelerator) -> None:
    """Turn a MULTI_CPU run launched with an FSDP or DeepSpeed config into FSDP2 or DeepSpeed over
    gloo.

    `accelerate launch` with fsdp.yaml or deepspeed.yaml and ACCELERATE_USE_CPU still exports the
    config's settings (ACCELERATE_USE_FSDP and FSDP_*, ACCELERATE_USE_DEEPSPEED and
    ACCELERATE_DEEPSPEED_*), but accelerate applies them on accelerators only and runs plain DDP.
    FSDP2 and DeepSpeed's CPU accelerator both work over gloo, so the plugin is built from those
    settings, as accelerate builds it on GPUs, and the run shards on the CPU too.
    """
    fsdp, deepspeed = _asked_for("ACCELERATE_USE_FSDP"), _asked_for("ACCELERATE_USE_DEEPSPEED")
    if not (fsdp or deepspeed) or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    precision = accelerator.mixed_precision
    if fsdp:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables
        if plugin.fsdp_version != 2:
            # FSDP1's flat parameters need an accelerator; check_process_group then stops the run
            return
        if precision != "no":
            plugin.set_mixed_precision(precision)
        accelerator.state.fsdp_plugin = plugin
        kind = DistributedType.FSDP
        if _asked_for(PARALLELISM) and accelerator.parallelism_config is None:
            # HSDP: the mesh Accelerator() builds from the config on GPUs (hybrid_sharding_startup
            # held it back); accelerate's FSDP2 prepare shards over its dp_shard dimension and
            # replicates over dp_replicate.
            config = ParallelismConfig()  # reads the PARALLELISM_CONFIG_* variables
            accelerator.state.parallelism_config = config
            accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
    else:
        plugin = DeepSpeedPlugin()  # reads the ACCELERATE_DEEPSPEED_* variables
        # DeepSpeed casts itself: no autocast around the model
        plugin.set_mixed_precision(precision)
        plugin.select(_from_accelerator_state=True)
        accelerator.state.deepspeed_plugins = plugin
        # Private state (accelerate 1.15): no public call changes the precision after Accelerator()
        # is built, and DeepSpeed casts the model itself, so accelerate's autocast must be off, as
        # its __init__ sets it on GPUs.
        accelerator.state._mixed_precision = "no"
        accelerator.native_amp = False
        kind = DistributedType.DEEPSPEED
    # Both shared states, as accelerate sets them on GPUs: AcceleratorState() re-reads
    # PartialState's type. accelerate 1.15 decides the type once, from the launcher's variables, and
    # has no public setter; on a CPU it never picks FSDP or DeepSpeed, so the type the plugin needs
    # is written here.
    accelerator.state.distributed_type = PartialState().distributed_type = kind


def shard_blocks(model) -> list[str]:
    """Names of the classes FSDP should shard one by one: the model's `_no_split_modules` without
    the embeddings.

    transformers lists the embeddings module there too (BertEmbeddings, RobertaEmbeddings, ...);
    wrapped as a unit of its own, with the word embeddings inside it, it breaks FSDP2's prepare. A
    class counts as embeddings when it holds the model's input embedding table.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    blocks = set()
    for module in model.modules():
        name = type(module).__name__
        if name in names and not any(sub is table for sub in module.modules()):
            blocks.add(name)
    return sorted(blocks)


def setup_fsdp(accelerator, model) -> None:
    """Before `accelerator.prepare`: under FSDP with TRANSFORMER_BASED_WRAP and no layer class named
    in the config (fsdp_transformer_layer_cls_to_wrap), shard by the model's repeated blocks. Does
    nothing otherwise."""
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    if plugin is None or plugin.transformer_cls_names_to_wrap:
        return
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if getattr(policy, "__name__", "") != "transformer_auto_wrap_policy":
        return
    blocks = shard_blocks(model)
    if not blocks:
        raise RecipeError(
            "FSDP's TRANSFORMER_BASED_WRAP needs the model's block class, and "
            f"{type(model).__name__} names none besides its embeddings (_no_split_modules); name "
            "it with --fsdp_transformer_layer_cls_to_wrap, or use --fsdp_auto_wrap_policy "
            "SIZE_BASED_WRAP"
        )
    plugin.transformer_cls_names_to_wrap = blocks


def check_accumulation(accelerator, gradient_accumulation_steps: int) -> None:
    """Stop when the Accelerator accumulates over another number of micro-batches than the recipe's
    flag.

    The recipe splits the global batch by its flag; a DeepSpeed config's
    gradient_accumulation_steps, which the launcher exports, overrides the Accelerator's and would
    silently train another global batch.
    """
    configured = accelerator.gradient_accumulation_steps
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # A DeepSpeed JSON config's value wins at prepare time; "auto" takes the Accelerator's.
        in_file = accelerator.state.deepspeed_plugin.deepspeed_config.get(
            "gradient_accumulation_steps", "auto"
        )
        configured = configured if in_file == "auto" else int(in_file)
    if configured != gradient_accumulation_steps:
        raise RecipeError(
            f"--gradient_accumulation_steps is {gradient_accumulation_steps} but the accelerate or "
            f"DeepSpeed config sets {configured}, which would win and train another global batch "
            "than --batch_size; remove gradient_accumulation_steps from the config (or set it to "
            "auto in a DeepSpeed JSON file)"
        )


def check_skip_nonfinite(accelerator, skip_nonfinite_steps: bool) -> None:
    """--skip_nonfinite_steps drops an update by not calling optimizer.step(); under DeepSpeed
    `accelerator.backward` already steps the engine, so the bad update would be applied anyway."""
    if skip_nonfinite_steps and accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise RecipeError(
            "--skip_nonfinite_steps cannot work under DeepSpeed: accelerator.backward() already "
            "steps DeepSpeed's engine, so a NaN update cannot be skipped; leave the flag out "
            "(DeepSpeed's fp16 loss scaler skips overflowing steps itself) or use FSDP or DDP"
        )


def set_gradient_clipping(accelerator, max_grad_norm: float) -> None:
    """Make --max_grad_norm reach DeepSpeed, before `accelerator.prepare`.

    Under DeepSpeed `accelerator.clip_grad_norm_` does not clip: the engine clips inside its step,
    by its config's gradient_clipping. Under DDP and FSDP2 the recipe's own clip_grad_norm_ call
    clips (FSDP2 over the full norm of the sharded gradients). 0 turns clipping off in both.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    if max_grad_norm < 0:
        raise RecipeError(f"--max_grad_norm {max_grad_norm} must be >= 0 (0 turns clipping off)")
    plugin = accelerator.state.deepspeed_plugin
    plugin.gradient_clipping = max_grad_norm
    plugin.deepspeed_config["gradient_clipping"] = max_grad_norm
