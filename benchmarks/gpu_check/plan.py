"""The steps of a call, in order of value, with the seconds each is expected to take and may take, and what each
needs of the machine."""

# In order of value: what a user most needs proven comes first, so that a short call proves that much at least.
STEPS = [
    "sft",
    "dpo",
    "grpo",
    "sft-speed-full",
    "sft-speed-lora",
    "fast94",
    "text-fsdp",
    "detect-640",
    "preempt",
    "bench",
    "text-deepspeed",
    "audit-cifar",
    "audit-text",
    "audit-detect",
    "nccl-doctor",
    "ddp",
    "sync-bn",
    "allreduce",
    "dp-vs-ddp",
]
# Estimated seconds of each step on one H100 (two for the 2+ GPU steps), start-up and data generation included: the
# measured time on one H100 80GB (docs/gpu-proof.md), rounded up, where it ran; a guess for bench and the 2+ GPU steps.
# Estimates, not limits: a step starts only when its estimate fits in what is left of --budget (on a GPU).
ESTIMATED_SECONDS = {
    # the 0.5B model built and saved, 20 steps each of LoRA, full and (one GPU) LoRA under FSDP2: 207 s measured; plus
    # guesses: 55 s for each TRL run (start-up, TRL's tokenisation, Liger's kernels compiled at first use, 20 steps)
    # and 25 s for the packed-attention check (the model loaded twice, 5 rows forward and backward under each), and
    # 20 s of compilation in each of the recipe's three runs (compiled blocks, the GPU's default since)
    "sft": 405,
    # a guess: the 0.5B model built and saved, 20 steps each of LoRA and full with their reference, and TRL's two
    # runs (55 s each, as in sft)
    "dpo": 260,
    # eager, 149 s measured; now a guess: the 0.5B model built and saved, the decode step compiled, 4 steps of 64
    # completions of 256 tokens, one evaluation, then TRL's 4 steps (its eager generate: ~13 s a step)
    "grpo": 300,
    # guesses: the model built, then 5 runs of 20 steps (about 15 s of start-up, 20 s of compilation where compiled,
    # 5 s of steps) and TRL's (55 s); the two fit one call together
    "sft-speed-full": 250,
    "sft-speed-lora": 250,
    "fast94": 65,  # 58 s
    "text-fsdp": 45,  # 42 s
    "detect-640": 100,  # 96 s
    "preempt": 50,  # 46 s
    "bench": 240,
    "text-deepspeed": 60,  # 56 s, DeepSpeed's CUDA ops included
    "audit-cifar": 40,  # 36 s
    "audit-text": 40,  # 36 s
    "audit-detect": 75,  # 69 s
    "nccl-doctor": 30,
    "ddp": 60,
    "sync-bn": 60,
    "allreduce": 45,
    "dp-vs-ddp": 120,
}
# Each step's own time limit: over it the step failed (hung); when --budget ends first, it is incomplete instead.
TIMEOUTS = {
    "sft": 500,
    "dpo": 480,
    "grpo": 480,
    "sft-speed-full": 480,
    "sft-speed-lora": 480,
    "fast94": 300,
    "text-fsdp": 300,
    "detect-640": 420,
    "preempt": 420,
    "bench": 480,
    "text-deepspeed": 480,
    "audit-cifar": 300,
    "audit-text": 300,
    "audit-detect": 300,
    "nccl-doctor": 240,
    "ddp": 300,
    "sync-bn": 300,
    "allreduce": 300,
    "dp-vs-ddp": 480,
}
# One call within 9 minutes: the budget, then at most STOP_GRACE_SECONDS for a cut step to save and exit, and the
# report and logs written.
DEFAULT_BUDGET, STOP_GRACE_SECONDS = 510, 20
NEXT_CALL = "left for the next call"  # the detail of a step the budget did not reach


def requirements(
    gpus: int, deepspeed_problem: str | None = "deepspeed not installed", missing_for_sft: tuple[str, ...] = ()
) -> dict[str, str | None]:
    """Per step, why it cannot run on this machine (None: it runs). On the CPU two gloo processes stand in for two
    GPUs, and the recipes run FSDP2 over gloo (accelerate's launcher alone would not); SyncBatchNorm, DataParallel,
    NCCL and DeepSpeed's GPU path need CUDA. DEEPSPEED_PROBLEM: why deepspeed does not import here (None: it does).
    MISSING_FOR_SFT: the packages of the chat recipe (peft, datasets) that this interpreter lacks."""
    needs = dict.fromkeys(STEPS)
    if missing_for_sft:
        for step in ("sft", "dpo", "grpo", "sft-speed-full", "sft-speed-lora"):
            needs[step] = f"{', '.join(missing_for_sft)} not installed"
    two = None if gpus >= 2 else "needs 2+ GPUs" if gpus else "needs CUDA"
    needs.update({"sync-bn": two, "dp-vs-ddp": two, "text-deepspeed": deepspeed_problem if gpus else "needs CUDA"})
    if gpus:
        needs.update({"nccl-doctor": two, "ddp": two, "allreduce": two})
    return needs


def not_run(name: str, why: str) -> dict:
    return {"step": name, "status": "not run", "commands": [], "wall_seconds": 0.0, "figures": {}, "detail": why}
