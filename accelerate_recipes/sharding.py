"""FSDP and DeepSpeed set-up the recipes share: FSDP2 on CPU processes, the block class FSDP shards by, and the
flags (accumulation, clipping, the NaN guard) that must mean the same under DDP, FSDP and DeepSpeed."""

import os

from accelerate import PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

from accelerate_recipes.errors import RecipeError


def _asked_for(variable: str) -> bool:
    return os.environ.get(variable, "false").lower() in ("1", "true")


def shard_on_cpu(accelerator) -> None:
    """Turn a MULTI_CPU run launched with an FSDP or DeepSpeed config into FSDP2 or DeepSpeed over gloo.

    `accelerate launch` with fsdp.yaml or deepspeed.yaml and ACCELERATE_USE_CPU still exports the config's settings
    (ACCELERATE_USE_FSDP and FSDP_*, ACCELERATE_USE_DEEPSPEED and ACCELERATE_DEEPSPEED_*), but accelerate applies
    them on accelerators only and runs plain DDP. FSDP2 and DeepSpeed's CPU accelerator both work over gloo, so the
    plugin is built from those settings, as accelerate builds it on GPUs, and the run shards on the CPU too.
    """
    fsdp, deepspeed = _asked_for("ACCELERATE_USE_FSDP"), _asked_for("ACCELERATE_USE_DEEPSPEED")
    if not (fsdp or deepspeed) or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    precision = accelerator.mixed_precision
    if fsdp:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables
        if plugin.fsdp_version != 2:
            return  # FSDP1's flat parameters need an accelerator; check_process_group then stops the run
        if precision != "no":
            plugin.set_mixed_precision(precision)
        accelerator.state.fsdp_plugin = plugin
        kind = DistributedType.FSDP
    else:
        plugin = DeepSpeedPlugin()  # reads the ACCELERATE_DEEPSPEED_* variables
        plugin.set_mixed_precision(precision)  # DeepSpeed casts itself: no autocast around the model
        plugin.select(_from_accelerator_state=True)
        accelerator.state.deepspeed_plugins = plugin
        # Private state (accelerate 1.15): no public call changes the precision after Accelerator() is built, and
        # DeepSpeed casts the model itself, so accelerate's autocast must be off, as its __init__ sets it on GPUs.
        accelerator.state._mixed_precision = "no"
        accelerator.native_amp = False
        kind = DistributedType.DEEPSPEED
    # Both shared states, as accelerate sets them on GPUs: AcceleratorState() re-reads PartialState's type. accelerate
    # 1.15 decides the type once, from the launcher's variables, and has no public setter; on a CPU it never picks
    # FSDP or DeepSpeed, so the type the plugin needs is written here.
    accelerator.state.distributed_type = PartialState().distributed_type = kind


def shard_blocks(model) -> list[str]:
    """Names of the classes FSDP should shard one by one: the model's `_no_split_modules` without the embeddings.

    transformers lists the embeddings module there too (BertEmbeddings, RobertaEmbeddings, ...); wrapped as a unit of
    its own, with the word embeddings inside it, it breaks FSDP2's prepare. A class counts as embeddings when it holds
    the model's input embedding table.
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
    """Before `accelerator.prepare`: under FSDP with TRANSFORMER_BASED_WRAP and no layer class named in the config
    (fsdp_transformer_layer_cls_to_wrap), shard by the model's repeated blocks. Does nothing otherwise."""
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    if plugin is None or plugin.transformer_cls_names_to_wrap:
        return
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if getattr(policy, "__name__", "") != "transformer_auto_wrap_policy":
        return
    blocks = shard_blocks(model)
    if not blocks:
        raise RecipeError(
            f"FSDP's TRANSFORMER_BASED_WRAP needs the model's block class, and {type(model).__name__} names none "
            "besides its embeddings (_no_split_modules); name it with --fsdp_transformer_layer_cls_to_wrap, or use "
            "--fsdp_auto_wrap_policy SIZE_BASED_WRAP"
        )
    plugin.transformer_cls_names_to_wrap = blocks


def check_accumulation(accelerator, gradient_accumulation_steps: int) -> None:
    """Stop when the Accelerator accumulates over another number of micro-batches than the recipe's flag.

    The recipe splits the global batch by its flag; a DeepSpeed config's gradient_accumulation_steps, which the launcher
    exports, overrides the Accelerator's and would silently train another global batch.
    """
    configured = accelerator.gradient_accumulation_steps
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # A DeepSpeed JSON config's value wins at prepare time; "auto" takes the Accelerator's.
        in_file = accelerator.state.deepspeed_plugin.deepspeed_config.get("gradient_accumulation_steps", "auto")
        configured = configured if in_file == "auto" else int(in_file)
    if configured != gradient_accumulation_steps:
        raise RecipeError(
            f"--gradient_accumulation_steps is {gradient_accumulation_steps} but the accelerate or DeepSpeed config "
            f"sets {configured}, which would win and train another global batch than --batch_size; remove "
            "gradient_accumulation_steps from the config (or set it to auto in a DeepSpeed JSON file)"
        )


def check_skip_nonfinite(accelerator, skip_nonfinite_steps: bool) -> None:
    """--skip_nonfinite_steps drops an update by not calling optimizer.step(); under DeepSpeed `accelerator.backward`
    already steps the engine, so the bad update would be applied anyway."""
    if skip_nonfinite_steps and accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise RecipeError(
            "--skip_nonfinite_steps cannot work under DeepSpeed: accelerator.backward() already steps DeepSpeed's "
            "engine, so a NaN update cannot be skipped; leave the flag out (DeepSpeed's fp16 loss scaler skips "
            "overflowing steps itself) or use FSDP or DDP"
        )


def set_gradient_clipping(accelerator, max_grad_norm: float) -> None:
    """Make --max_grad_norm reach DeepSpeed, before `accelerator.prepare`.

    Under DeepSpeed `accelerator.clip_grad_norm_` does not clip: the engine clips inside its step, by its config's
    gradient_clipping. Under DDP and FSDP2 the recipe's own clip_grad_norm_ call clips (FSDP2 over the full norm of
    the sharded gradients). 0 turns clipping off in both.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    if max_grad_norm < 0:
        raise RecipeError(f"--max_grad_norm {max_grad_norm} must be >= 0 (0 turns clipping off)")
    plugin = accelerator.state.deepspeed_plugin
    plugin.gradient_clipping = max_grad_norm
    plugin.deepspeed_config["gradient_clipping"] = max_grad_norm
