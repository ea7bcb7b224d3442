"""The steps of a call, in order of value, with the seconds each is expected to take and may take,
and what each needs of the machine."""

# In order of value: what a user most needs proven comes first, so that a short call proves that
# much at least.
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
# What a step's estimate is made of, measured on one H100 80GB on 2026-11-27
# (../shared/gpu-runs/2026-11-27-h100 and docs/gpu-proof.json; the recorded reports hold each run's
# results.json), in seconds. A step's estimate adds up its runs, each from the parts below; a report
# records the estimate beside the measured time of every step and the measured parts of every run
# (its "timing"), which are what these constants are to be corrected from. the interpreter, torch
# and the machine's record, before the first step: a call of one 149.2 s step
CALL_START = 10
# took 157.8 s
# the 0.5B chat model built and saved with its chats,
# once per call: the grpo step's 149.2 s less its
CHAT_ASSETS = 20
# run's own 104.4 s and a launch
# A process started until the run's own clock starts, and its exit: the launcher, the imports, the
# data read and the model loaded. sft: the sft step's 264.5 s less its runs' own times, the chat
# model and the packed-attention check, over its five processes; dpo: its two runs' 82.7 s less the
# ten steps each ran before it stopped (the reference
# model loaded too); TRL's harness and grpo as sft
LAUNCH = {"sft": 24, "dpo": 32, "grpo": 24, "trl": 24}
# the model loaded twice, 4 packed rows forward and backward under each kernel
PACKED_ATTENTION_CHECK_SECONDS = 20
# Inductor's compilation of one graph of the decoder blocks (a run compiles two: its first row
# length, then one dynamic in the length): full 22.5 s of warm-up for two, LoRA two steps of 19 s
# each (sft --compile, 2026-11-27); padded rows, whose
# width changes every step, compile as packed ones do
COMPILE_GRAPH = {"full": 11.0, "lora": 19.0}
# a forward-only graph (DPO's reference) against one with its backward pass: a guess
REFERENCE_GRAPH_SHARE = 0.5
# The compiled decode (--decode auto on a GPU: transformers' compiled step, CUDA graphs), not yet
# run on a GPU: each cache shape it meets compiles once, a forward of the whole model whose 24
# blocks share their kernels (a guess from a block's 19 s with its backward pass); then a token of a
# batch in about 8 ms (a guess: 2 s for 256 tokens)
DECODE_COMPILE, DECODE_TOKEN_SECONDS = 30.0, 0.008
# One optimizer step of 16 conversations (~7,300 tokens), compiled: full 0.118 s (58,200 tokens/s),
# LoRA about 0.13 s (its progress bar); eager: full 0.173 s, LoRA 0.275 s (the sft step, 2026-11-27)
STEP_SECONDS = {("full", True): 0.118, ("lora", True): 0.13, ("full", False): 0.173, ("lora", False): 0.275}
# padded rows' step against packed ones': each conversation padded to the batch's longest, a guess
PADDED_SHARE = 1.3
# the generated chats' mean, measured (mean_tokens_per_conversation)
TOKENS_PER_CONVERSATION = 454.5
TRAIN_CONVERSATIONS = 640  # the chats the chat steps train on: 290,880 tokens, one epoch
# the 64 validation chats, evaluated once: the eager LoRA run's 6.5 s after training less
EVALUATION_SECONDS = 4.0
# its saves (compiled blocks evaluate eagerly where a shape is new, so the same)
# Saving after training: full, the epoch's checkpoint (fp32 weights and AdamW's two states, ~6 GB),
# model_best and the model (~2 GB each): 9 s eager and 22 s compiled after the epoch (2026-11-27),
# their mean; LoRA the adapter, ~2.5 s
SAVE_SECONDS = {"full": 16.0, "lora": 2.5}
# TRL's harnesses (benchmarks/*_bench.py), their own wall_seconds: SFTTrainer LoRA 42.4 s and full
# 29.2 s (20 steps, 2026-11-27); DPOTrainer, not measured: its set-up as SFTTrainer's (~25 s) and 20
# steps of padded rows with the reference's forward pass at a guessed 0.6 s; GRPOTrainer: its set-up
# (a guess, 20 s) and 4 steps of eager generate at the
# 13.85 s a step the recipe's eager decoding took
TRL_SECONDS = {"sft-lora": 42.4, "sft-full": 29.2, "dpo": 25 + 20 * 0.6, "grpo": 20 + 4 * 13.85}
# DPO: 8 pairs a step (16 rows of ~450 tokens) and the reference's forward pass, compiled blocks;
# packed, a guess from the sft steps; padded, the eager 0.45 s a step of 2026-11-27 (the LoRA run,
# steps 2 to 10, before its NaN) less what compiling saved the sft steps (a guess)
DPO_STEP_SECONDS = {("lora", "packed"): 0.17, ("full", "packed"): 0.15, ("lora", "padded"): 0.25}
# --eval_generate's default: 4 greedy answers of up to 128 tokens (--max_new_tokens), before
# training and after the evaluation, in one cache shape (compiled once)
DPO_ANSWER_CALLS, DPO_ANSWER_TOKENS = 2, 128
# GRPO: the cache shapes its compiled decode compiles for: one, although its prompts span three
# buckets of 64 tokens, since the recipe reserves the cache of the data's longest prompt before
# training (chat/generation.py reserve_cache); a step generates 64 completions of 256 tokens
# (compiled: 2 s) and updates on them (0.75 s: 32,600 tokens/s measured); the evaluation answers the
# 8 held-out prompts greedily and samples 4 completions
# of each (--eval_num_samples): two calls of 64 rows
GRPO_DECODE_SHAPES, GRPO_STEP_SECONDS, GRPO_EVALUATION_CALLS = 1, 2.75, 2
# The measured time of the other steps on one H100 (docs/gpu-proof.md), rounded up; a guess for
# bench and the 2+ GPU steps.
MEASURED_SECONDS = {
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
# never run on one H100 yet
GUESSED = ("bench", "nccl-doctor", "ddp", "sync-bn", "allreduce", "dp-vs-ddp")
CHAT_STEPS = ("sft", "dpo", "grpo", "sft-speed-full", "sft-speed-lora")
SPEED_STEPS = {"sft-speed-full": "full", "sft-speed-lora": "lora"}
# The speed steps' rows of a token budget: as many steps as fit in one epoch of the 640 chats
# (290,880 tokens: 17 full rows of 16,384 tokens), so that no epoch's end evaluates and saves in the
# middle of the measurement
SPEED_BATCH_TOKENS, SPEED_TOKEN_STEPS = 16384, 12
SFT_STEPS, DPO_STEPS, GRPO_STEPS, GRPO_MAX_NEW_TOKENS = 20, 20, 4, 256


def recipe_run(
    method: str, launch: float, graphs: float, steps: int, step_seconds: float, save: bool = True
) -> dict[str, float]:
    """One run of a chat recipe, part by part: launch, compilation (GRAPHS graphs of METHOD's
    blocks), its steps, one evaluation and the saves after it."""
    return {
        "launch": launch,
        "compile": round(graphs * COMPILE_GRAPH[method], 1),
        "steps": round(steps * step_seconds, 1),
        "evaluation": EVALUATION_SECONDS,
        "save": SAVE_SECONDS[method] if save else 0.0,
    }


def sft_run(method: str, compiled: bool = True, padded: bool = False) -> dict[str, float]:
    """An sft run of 20 steps of 16 conversations (the sft step's, the speed steps' default), packed
    or PADDED."""
    step = STEP_SECONDS[method, compiled] * (PADDED_SHARE if padded else 1.0)
    return recipe_run(method, LAUNCH["sft"], 2 if compiled else 0, SFT_STEPS, step)


def token_rows_run(method: str) -> dict[str, float]:
    """An sft run in rows of SPEED_BATCH_TOKENS tokens, compiled, within one epoch."""
    seconds = STEP_SECONDS[method, True] * SPEED_BATCH_TOKENS / (16 * TOKENS_PER_CONVERSATION)
    return recipe_run(method, LAUNCH["sft"], 2, SPEED_TOKEN_STEPS, seconds)


def chat_runs(name: str, shared: frozenset[str] | set[str] = frozenset()) -> dict[str, dict[str, float]]:
    """The runs of a chat step on one GPU, each part by part. SHARED: the sft step's runs that this
    call has made already (lora, full, trl-lora, trl-full), which a speed step takes instead of
    running them again."""
    trl = LAUNCH["trl"]
    if name == "sft":
        return {
            "packed-attention": {"check": PACKED_ATTENTION_CHECK_SECONDS},
            "lora": sft_run("lora"),
            "trl-lora": {"launch": trl, "run": TRL_SECONDS["sft-lora"]},
            "full": sft_run("full"),
            "trl-full": {"launch": trl, "run": TRL_SECONDS["sft-full"]},
            "lora-padded": sft_run("lora", padded=True),
            # FSDP2's step: as the plain one (one process, unsharded), compiled blocks too
            "lora-fsdp": sft_run("lora"),
        }
    if name == "dpo":

        def dpo_run(method: str, way: str) -> dict[str, float]:
            graphs = 2 * (1 + REFERENCE_GRAPH_SHARE)  # the policy's two and the reference's
            run = recipe_run(method, LAUNCH["dpo"], graphs, DPO_STEPS, DPO_STEP_SECONDS[method, way])
            if way == "padded":  # --eval_generate's answers, in a compiled decode
                run["decode compile"] = DECODE_COMPILE
                run["answers"] = round(DPO_ANSWER_CALLS * DPO_ANSWER_TOKENS * DECODE_TOKEN_SECONDS, 1)
            return run

        # the runs of ChatSteps.dpo_runs on one GPU
        return {
            "lora-padded": dpo_run("lora", "padded"),
            "trl-lora": {"launch": trl, "run": TRL_SECONDS["dpo"]},
            "full": dpo_run("full", "packed"),
        }
    if name == "grpo":
        decode = GRPO_MAX_NEW_TOKENS * DECODE_TOKEN_SECONDS
        return {
            "lora": {
                "launch": LAUNCH["grpo"],
                "decode compile": round(GRPO_DECODE_SHAPES * DECODE_COMPILE, 1),
                "steps": round(GRPO_STEPS * GRPO_STEP_SECONDS, 1),
                "evaluation": round(GRPO_EVALUATION_CALLS * decode, 1),
                "save": SAVE_SECONDS["lora"],
            },
            "trl-lora": {"launch": trl, "run": TRL_SECONDS["grpo"]},
        }
    method = SPEED_STEPS[name]
    runs = {}
    if method not in shared:
        runs["compiled"] = sft_run(method)
    if f"trl-{method}" not in shared:
        runs["trl"] = {"launch": trl, "run": TRL_SECONDS[f"sft-{method}"]}
    runs[f"tokens-{SPEED_BATCH_TOKENS // 1024}k"] = token_rows_run(method)
    return runs


def estimate(name: str, assets_ready: bool = False, shared: frozenset[str] | set[str] = frozenset()) -> dict:
    """A step's estimated seconds on one GPU and what they are made of: {"seconds": total, "parts":
    {part: seconds}}, a chat step's parts being its runs (each {part: seconds}) and, when
    ASSETS_READY is false, the chat model built.
    SHARED: the sft step's runs this call has made (chat_runs)."""
    if name not in CHAT_STEPS:
        seconds = float(MEASURED_SECONDS[name])
        return {
            "seconds": seconds,
            "parts": {"a guess" if name in GUESSED else "measured, rounded up": seconds},
        }
    parts: dict = {} if assets_ready else {"chat model": float(CHAT_ASSETS)}
    parts.update(chat_runs(name, shared))
    seconds = sum(sum(p.values()) if isinstance(p, dict) else p for p in parts.values())
    return {"seconds": round(seconds, 1), "parts": parts}


def describe_estimate(guess: dict) -> str:
    """An estimate() in one line: "412 s: chat model 20, lora 71 (launch 24, compile 38, ...),
    ..."."""

    def number(x: float) -> str:
        return f"{x:.1f}".removesuffix(".0")

    parts = []
    for name, part in guess["parts"].items():
        if isinstance(part, dict):
            inner = ", ".join(f"{k} {number(v)}" for k, v in part.items() if v)
            parts.append(f"{name} {number(sum(part.values()))} ({inner})")
        else:
            parts.append(f"{name} {number(part)}")
    return f"{guess['seconds']:.0f} s: {', '.join(parts)}"


def plan_calls(todo: list[str], budget: float, gpus: int = 1) -> tuple[list[dict], list[str]]:
    """The calls of BUDGET seconds that run the steps TODO (in order of value) on GPUS GPUs, as a
    call runs them: each takes, in order, every step whose estimate fits in what is left of its
    budget, the chat model built once per call and, on one GPU, the sft step's runs taken by the
    speed steps of the same call. Returns the calls, each {"steps": {name: estimate()}, "seconds":
    its estimated length, the start included}, and the steps that fit in no call of BUDGET
    seconds."""
    calls, todo = [], list(todo)
    while todo:
        left, steps, shared = budget - CALL_START, {}, set()
        for name in todo:
            guess = estimate(name, any(s in CHAT_STEPS for s in steps), shared)
            if guess["seconds"] <= left:
                steps[name], left = guess, left - guess["seconds"]
                shared |= set(SHARED_RUNS) if name == "sft" and gpus == 1 else set()
        if not steps:
            break
        calls.append({"steps": steps, "seconds": round(budget - left, 1)})
        todo = [name for name in todo if name not in steps]
    return calls, todo


# Each step on its own in a call (the chat model built by it, no run of another step to take): what
# decides whether it fits in what is left of --budget (on a GPU) is estimate() with what the call
# has made so far.
ESTIMATED_SECONDS = {name: estimate(name)["seconds"] for name in STEPS}
# The sft runs a speed step takes from the sft step of the
# same call: the same command, so the same measurement.
SHARED_RUNS = ("lora", "full", "trl-lora", "trl-full")
# Free disk a step needs (GB) when it starts on a GPU: the most it holds at once, its runs' weights
# removed after each (a full fine-tune of the 0.5B model writes a checkpoint of ~6 GB and two models
# of ~2 GB), the chat model (1 GB) and torch's compile
# cache included; on the CPU and in --quick, tiny models.
DISK_GB = {"sft": 12, "dpo": 12, "grpo": 4, "sft-speed-full": 12, "sft-speed-lora": 4, "bench": 4}
DISK_GB_OTHER, DISK_GB_SMALL = 2, 0.5


def disk_needed(name: str, small: bool) -> float:
    """GB of free disk a step needs to start."""
    return DISK_GB_SMALL if small else float(DISK_GB.get(name, DISK_GB_OTHER))


def disk_refusal(name: str, small: bool, free_bytes: int, where) -> str | None:
    """Why a step does not start for want of disk (one line), or None when FREE_BYTES in WHERE are
    enough."""
    needed, free = disk_needed(name, small), free_bytes / 2**30
    if free >= needed:
        return None
    return (
        f"needs {needed:g} GB of free disk in {where} (what it writes at once), {free:.1f} GB free: free "
        "some, or give --output_dir on a larger disk"
    )


# Each step's own time limit: over it the step failed (hung);
# when --budget ends first, it is incomplete instead.
TIMEOUTS = {
    "sft": 510,
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
# One call within 9 minutes: the budget, then at most STOP_GRACE_SECONDS for a cut step to save and
# exit, and the report and logs written.
DEFAULT_BUDGET, STOP_GRACE_SECONDS = 510, 20
NEXT_CALL = "left for the next call"  # the detail of a step the budget did not reach


def requirements(
    gpus: int,
    deepspeed_problem: str | None = "deepspeed not installed",
    missing_for_sft: tuple[str, ...] = (),
) -> dict[str, str | None]:
    """Per step, why it cannot run on this machine (None: it runs). On the CPU two gloo processes
    stand in for two GPUs, and the recipes run FSDP2 over gloo (accelerate's launcher alone would
    not); SyncBatchNorm, DataParallel, NCCL and DeepSpeed's GPU path need CUDA. DEEPSPEED_PROBLEM:
    why deepspeed does not import here (None: it does).
    MISSING_FOR_SFT: the packages of the chat recipe (peft, datasets) that this interpreter
    lacks."""
    needs = dict.fromkeys(STEPS)
    if missing_for_sft:
        for step in ("sft", "dpo", "grpo", "sft-speed-full", "sft-speed-lora"):
            needs[step] = f"{', '.join(missing_for_sft)} not installed"
    two = None if gpus >= 2 else "needs 2+ GPUs" if gpus else "needs CUDA"
    needs.update(
        {"sync-bn": two, "dp-vs-ddp": two, "text-deepspeed": deepspeed_problem if gpus else "needs CUDA"}
    )
    if gpus:
        needs.update({"nccl-doctor": two, "ddp": two, "allreduce": two})
    return needs


def not_run(name: str, why: str) -> dict:
    return {
        "step": name,
        "status": "not run",
        "commands": [],
        "wall_seconds": 0.0,
        "figures": {},
        "detail": why,
    }
