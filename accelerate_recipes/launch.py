"""Checks on how the recipe was launched, and the global -> per-process batch arithmetic."""

import os
import re
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from accelerate_recipes.cli import address_in_use, port_in_use
from accelerate_recipes.errors import RecipeError
from accelerate_recipes.sharding import (
    check_accumulation,
    check_skip_nonfinite,
    hybrid_sharding_startup,
    set_gradient_clipping,
    shard_on_cpu,
)


def check_process_group(accelerator) -> None:
    """Stop when the launcher started several processes but they did not join one process group.

    `accelerate launch --multi_gpu` (or a multi-GPU config) on a machine where torch sees no GPU
    starts N processes that each fall back to a single-process run on the full data set: N
    independent, silently wrong trainings.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise RecipeError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but they did not "
            "form one process group, so each would train alone on all the data. torch sees no "
            "usable GPU here: to run these processes on the CPU set ACCELERATE_USE_CPU=true for "
            "`accelerate launch` or torchrun (they then join one group over gloo); on a GPU "
            "machine check `nvidia-smi` and CUDA_VISIBLE_DEVICES, and that `python -c 'import "
            "torch; print(torch.cuda.device_count())'` prints the GPU count."
        )
    # accelerate applies FSDP and DeepSpeed configs on accelerators only; on the CPU the same launch
    # would run plain DDP. FSDP2 and DeepSpeed run over gloo too, so such a run is switched to them;
    # a run still unsharded stops here.
    shard_on_cpu(accelerator)
    for variable, name in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        wanted = name.upper()
        if (
            os.environ.get(variable, "false").lower() in ("1", "true")
            and accelerator.distributed_type.value != wanted
        ):
            raise RecipeError(
                f"the accelerate config asks for {name}, but this run is "
                f"{accelerator.distributed_type.value}, so the model would not be sharded: on GPUs "
                "check that torch sees them; on the CPU launch it with ACCELERATE_USE_CPU=true "
                "and without --cpu (FSDP needs fsdp_version: 2 there), or launch it with a config "
                "that does not shard (plain DDP over gloo)"
            )


def check_launch(
    accelerator,
    global_batch_size: int,
    accumulation_steps: int,
    skip_nonfinite_steps: bool = False,
    max_grad_norm: float = 0.0,
) -> int:
    """Every start-up check, right after `Accelerator(...)`; prints the launch line and returns the
    per-process batch.

    The processes formed one group (else each would train alone), FSDP / DeepSpeed configs shard on
    CPUs too, the Accelerator accumulates what the flag says, DeepSpeed gets the clipping norm, and
    the global batch divides evenly.
    """
    check_process_group(accelerator)
    check_precision(accelerator)
    # a DeepSpeed config must not override the flag
    check_accumulation(accelerator, accumulation_steps)
    check_skip_nonfinite(accelerator, skip_nonfinite_steps)
    # DeepSpeed clips inside its engine, by its config
    set_gradient_clipping(accelerator, max_grad_norm)
    world = accelerator.num_processes
    per_process = per_process_batch_size(global_batch_size, world, accumulation_steps)
    accelerator.print(
        describe_launch(accelerator, num_machines(world), global_batch_size, per_process, accumulation_steps)
    )
    return per_process


def check_precision(accelerator) -> None:
    """fp16 where accelerate would not apply it: on a CPU it builds neither autocast nor a grad
    scaler (1.15), so the run would train in fp32 while its results say fp16."""
    from accelerate.utils import DistributedType

    if (
        accelerator.mixed_precision == "fp16"
        and not accelerator.native_amp
        and accelerator.distributed_type != DistributedType.DEEPSPEED
    ):  # DeepSpeed runs fp16 in its own engine
        raise RecipeError(
            f"--mixed_precision fp16 is not applied on {accelerator.device.type}: accelerate "
            f"trains it in fp32 there; use --mixed_precision {cpu_precision()} (bf16 where the CPU "
            "has it) or a GPU"
        )


def num_machines(num_processes: int) -> int:
    """Number of nodes in the run, from the variables torchrun (and so accelerate launch) sets on
    every process."""
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    return max(1, num_processes // max(1, local))


def per_process_batch_size(global_batch_size: int, num_processes: int, accumulation_steps: int) -> int:
    """Split the global batch (samples per optimizer step, all processes together) into the batch
    one process loads.

    global = per_process x num_processes x accumulation_steps, so the optimizer sees the same batch,
    and the learning rate means the same thing, on 1 GPU, 8 GPUs or 2 nodes.
    """
    if global_batch_size < 1 or accumulation_steps < 1:
        raise RecipeError(
            f"--batch_size ({global_batch_size}) and --gradient_accumulation_steps "
            f"({accumulation_steps}) must be >= 1"
        )
    shards = num_processes * accumulation_steps
    if global_batch_size % shards:
        lower = max(shards, global_batch_size // shards * shards)
        raise RecipeError(
            f"--batch_size {global_batch_size} (the global batch) does not divide evenly over "
            f"{num_processes} process(es) x {accumulation_steps} accumulation step(s) = {shards}; "
            f"use a multiple of {shards}, e.g. --batch_size {lower} or {lower + shards}"
        )
    return global_batch_size // shards


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask (taskset, SLURM, container cpusets), not
    the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def cores_per_local_process() -> int:
    """This process's share of the usable cores, when LOCAL_WORLD_SIZE processes of the run share
    this machine."""
    return max(1, usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def default_num_workers(limit: int = 8) -> int:
    """DataLoader workers per process: the CPU cores left per local process after the training
    thread, at most `limit`."""
    return min(limit, max(0, cores_per_local_process() - 1))


def cpu_threads_and_workers(accelerator, requested_workers: int | None = None, limit: int = 8) -> int:
    """DataLoader workers for this process; on the CPU also sets torch's thread count so both fit
    its cores.

    On a GPU the workers feed the device while it computes: the cores left after the training thread
    (at most `limit`). On the CPU the training threads are the compute, and workers compete with
    them for the same cores (2 threads + 1 worker on 2 cores ran 4-6x slower): no workers unless
    asked for, and torch gets the cores left. A lower OMP_NUM_THREADS (e.g. from
    --num_cpu_threads_per_process) is kept.
    """
    if accelerator.device.type != "cpu":
        return default_num_workers(limit) if requested_workers is None else requested_workers
    workers = 0 if requested_workers is None else requested_workers
    cores = cores_per_local_process()
    threads = max(1, cores - workers)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads = min(threads, int(os.environ["OMP_NUM_THREADS"]))
    torch.set_num_threads(threads)
    accelerator.print(
        f"CPU: {threads} torch thread(s) and {workers} DataLoader worker(s) per process "
        f"({cores} core(s) per local process)"
    )
    return workers


CPU_BF16_VARIABLE = "ACCELERATE_RECIPES_CPU_BF16"


def cpu_has_bf16() -> bool:
    """True when this CPU computes bf16 natively (AVX512-BF16 or AMX on x86, the BF16 extension on
    Arm).

    Without it torch emulates bf16 autocast on the CPU, ~40x slower than fp32: pick fp32 there. The
    CPU's flags are not enough: `ONEDNN_MAX_CPU_ISA=AVX2` keeps oneDNN (torch's bf16 kernels) off
    AVX-512, which makes bf16 as slow as on a CPU without it, and torch's own check follows that
    limit. ACCELERATE_RECIPES_CPU_BF16=0 or 1 overrides both (say what another machine has, or test
    the other path).
    """
    override = os.environ.get(CPU_BF16_VARIABLE, "").strip().lower()
    if override in ("0", "1", "false", "true", "no", "yes"):
        return override in ("1", "true", "yes")
    if override:
        raise RecipeError(
            f"{CPU_BF16_VARIABLE}={override!r}: set it to 1 (native bf16) or 0 (fp32), or unset it"
        )
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    if not flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return False
    mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return mkldnn_bf16 is None or bool(mkldnn_bf16())


def cpu_precision() -> str:
    """Mixed precision for a CPU run: bf16 where the CPU has it natively, otherwise no (fp32)."""
    return "bf16" if cpu_has_bf16() else "no"


def quiet_other_local_processes(accelerator) -> None:
    """One copy of transformers' and datasets' logs and progress bars per node, the local main
    process's: the others read what it wrote to the cache and would only repeat its lines."""
    if accelerator.is_local_main_process:
        return
    import datasets  # here, not at the top: a recipe without text data never imports them
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()


def describe_launch(
    accelerator, machines: int, global_batch_size: int, per_process: int, accumulation_steps: int
) -> str:
    """One start-up line: how many processes on how many machines, the device, precision and the
    batch split."""
    world = accelerator.num_processes
    return (
        f"{world} process(es) on {machines} machine(s), {accelerator.distributed_type.value}, "
        f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}; global batch "
        f"{global_batch_size} = {world} process(es) x {per_process} per process x "
        f"{accumulation_steps} accumulation step(s)"
    )


def prepare_output_dir(output_dir: str | Path) -> Path:
    """Create the output directory and check this process can write there, before anything is
    trained or loaded.

    Every process checks (each may write checkpoint parts), so none is left waiting for a process
    that stopped.
    """
    output = Path(output_dir)
    probe = output / f".write-test-{os.getpid()}"
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise RecipeError(
            f"cannot write to --output_dir {output} ({err.strerror or err}); choose a folder you "
            "can write to, with free space"
        ) from None
    return output


def check_visible_gpus() -> None:
    """GPU ids given to the launcher (--gpu_ids becomes CUDA_VISIBLE_DEVICES) must exist on this
    machine, and there must be one GPU for each process the launcher started on it."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return
    listed = [i for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip()]
    visible = torch.cuda.device_count()
    if listed and visible < len(listed):
        raise RecipeError(
            f"CUDA_VISIBLE_DEVICES={','.join(listed)} (what `accelerate launch --gpu_ids` sets) "
            f"names {len(listed)} GPU(s), but torch sees {visible} here: use ids that `nvidia-smi "
            "-L` lists on this machine, or leave --gpu_ids out"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    # Without GPUs the process-group check explains the run better (ACCELERATE_USE_CPU); here: too
    # few of them.
    if 0 < visible < local:
        ids = f"CUDA_VISIBLE_DEVICES={','.join(listed)}" if listed else "no CUDA_VISIBLE_DEVICES"
        raise RecipeError(
            f"the launcher started {local} processes on this machine (LOCAL_WORLD_SIZE={local}) "
            f"but torch sees {visible} GPU(s) ({ids}), one per process: start {visible} (the "
            f"launcher's --num_processes {visible}), or name as many GPUs as processes with "
            "--gpu_ids"
        )


def join_restarted_group(timeout_seconds: float) -> None:
    """Workers the elastic agent restarted (`--max_restarts`, make RESTARTS=N) join their process
    group under a key prefix of their own attempt. The agent keeps one store for the whole run, and
    each attempt's workers publish their addresses in it under the same keys: a restarted gloo
    worker would read an address of the attempt that died and fail to connect ("Connection
    refused"). The Accelerator then finds the group formed and uses it."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    backend = "nccl" if torch.cuda.is_available() and not use_cpu else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


@contextmanager
def explain_startup_failure(timeout_seconds: float):
    """Around `Accelerator(...)`: first check the GPUs the launcher was given exist; then a process
    group that does not form within the timeout becomes one line naming the main node's address and
    port and how many processes joined, instead of a traceback from torch's store."""
    check_visible_gpus()
    try:
        join_restarted_group(timeout_seconds)
        with hybrid_sharding_startup():  # an HSDP config's mesh: checked here, built later on CPUs
            yield
    except (dist.DistStoreError, dist.DistNetworkError) as err:
        address, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
        where = f"{address}:{port}"
        world, rank = os.environ.get("WORLD_SIZE", "?"), os.environ.get("RANK", "?")
        joined = re.search(r"(\d+)/(\d+) clients joined", str(err))
        if address_in_use(err):
            raise port_in_use(address, port) from None
        if joined:
            what = (
                f"only {joined[1]} of {joined[2]} processes joined the main process at {where} "
                f"within {timeout_seconds:g} s"
            )
        elif isinstance(err, dist.DistNetworkError):
            what = (
                f"process {rank} of {world} could not reach the main process at {where} "
                f"within {timeout_seconds:g} s"
            )
        else:
            what = f"not all {world} processes joined at {where} within {timeout_seconds:g} s"
        raise RecipeError(
            f"{what}: start every node (each with its own --machine_rank, the same "
            f"--main_process_ip and port), check that each reaches {where} (firewall, the main "
            "node's address), or wait longer with --dist_timeout"
        ) from None
