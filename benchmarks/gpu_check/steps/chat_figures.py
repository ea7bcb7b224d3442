"""What the chat steps read out of a run's results.json, and the recipe's runs put side by side with
TRL's."""

from ..run_outputs import key_figures

# What a run's results.json counts of its compiled paths (absent from runs made before the counts):
# the compiled blocks of training (graphs, recompiles, seconds, and the one-line cause when they
# fell back to eager), and the compiled decode's, so that a call says how often each path compiled.
COMPILE_FIGURES = (
    "compile_graphs",
    "compile_recompiles",
    "compile_seconds",
    "compile_fallback",
    "decode_graphs",
    "decode_recompiles",
    "decode_compile_seconds",
    "decode_fallback",
)
FALLBACKS = {"compile_fallback": "its compiled blocks", "decode_fallback": "its compiled decode"}


def fell_back(results: dict) -> list[str]:
    """Each compiled path of a run that fell back to eager, with the cause the run gave: such a run
    proves the eager path, not the compiled default it was to prove, so its step fails."""
    return [
        f"{what} fell back to eager ({results[key]}): it proved the eager path, not the compiled default"
        for key, what in FALLBACKS.items()
        if results.get(key)
    ]


def sft_figures(results: dict) -> dict:
    """An sft run's figures from its results.json: throughput, memory against the plan, and the
    model FLOP utilisation with the FLOPs per token it counted (the recipe's own: recipes/sft.py,
    model_flops_per_token)."""
    figures = key_figures(
        results,
        "method",
        "distributed_type",
        "world_size",
        "mixed_precision",
        "steps",
        "train_tokens_per_second",
        "train_target_tokens_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "peak_memory_kind",
        "memory_plan_mb",
        "flops_per_token",
        "attn_implementation",
        "compile",
        "warmup_seconds",
        *COMPILE_FIGURES,
    )
    planned = (results.get("memory_plan_mb") or {}).get("total")
    # The plan counts device memory; on the CPU the peak is
    # the process's whole resident memory, not comparable.
    if planned and results.get("peak_memory_mb") and results.get("peak_memory_kind") == "cuda_max_allocated":
        figures["peak_over_plan"] = round(results["peak_memory_mb"] / planned, 3)
    if results.get("train_tokens_per_second") and results.get("train_samples_per_second"):
        mean_length = results["train_tokens_per_second"] / results["train_samples_per_second"]
        figures["mean_tokens_per_conversation"] = round(mean_length, 1)
    if results.get("model_flops_utilisation") is not None:  # None off a GPU: no peak to divide by
        figures["model_flops_utilisation"] = round(results["model_flops_utilisation"], 4)
    return figures


def trl_figures(results: dict, ours: dict, peak: float | None) -> dict:
    """A TRL run's figures from its results.json (benchmarks/sft_bench.py trl_speed), as sft_figures
    gives the recipe's; its model FLOP utilisation counts the FLOPs per token of OURS (the recipe's
    matching run), so that the two MFUs differ by speed alone. PEAK: the GPU's peak TFLOPS (None on
    the CPU: no MFU)."""
    figures = key_figures(
        results,
        "trainer",
        "method",
        "world_size",
        "mixed_precision",
        "weights_dtype",
        "steps",
        "padding_free",
        "liger_kernel",
        "attn_implementation",
        "optim",
        "train_tokens_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "peak_memory_kind",
        "mean_tokens_per_conversation",
    )
    flops, tokens_per_second = ours.get("flops_per_token"), results.get("train_tokens_per_second")
    if flops and tokens_per_second:
        figures["flops_per_token"] = flops
        if peak:
            world = results.get("world_size", 1)
            figures["model_flops_utilisation"] = round(flops * tokens_per_second / (peak * 1e12 * world), 4)
    return figures


def speed_comparison(figures: dict, default: str) -> dict:
    """The runs of an sft speed step side by side: each one's tokens/s and MFU, each over the
    tokens/s of the run named DEFAULT (the recipe's own way on the device: compiled on a GPU, eager
    on the CPU), the fastest of the recipe's runs, and that one over TRL's (above 1: the recipe
    trains faster)."""
    rates = {
        name: f["train_tokens_per_second"] for name, f in figures.items() if f.get("train_tokens_per_second")
    }
    kept = ("train_tokens_per_second", "model_flops_utilisation")
    compared = {name: {k: figures[name][k] for k in kept if k in figures[name]} for name in rates}
    if default in rates:
        compared["default"] = default
        for name in rates:
            compared[name]["over_default"] = round(rates[name] / rates[default], 3)
    ours = {name: rate for name, rate in rates.items() if name != "trl"}
    if ours:
        fastest = max(ours, key=ours.get)
        compared["fastest"] = fastest
        if "trl" in rates:
            compared["fastest_over_trl"] = round(ours[fastest] / rates["trl"], 3)
    return compared


def trl_comparison(figures: dict, ours_runs: dict[str, str] | None = None) -> dict:
    """Per method, the recipe's run (FIGURES[method], or the run OURS_RUNS names for it) beside
    TRL's (FIGURES["trl-" + method]) on the same device: tokens/s and ours_over_trl (above 1: the
    recipe trains faster), MFU, median step, peak memory and the attention each used, as {"ours":
    ..., "trl": ...}, and which run of ours it was; a method missing either run's tokens/s is left
    out."""
    ours_runs = {"lora": "lora", "full": "full", **(ours_runs or {})}
    compared = {}
    for method in ("lora", "full"):
        ours, trl = figures.get(ours_runs[method], {}), figures.get(f"trl-{method}", {})
        if not ours.get("train_tokens_per_second") or not trl.get("train_tokens_per_second"):
            continue
        row = {"ours_over_trl": round(ours["train_tokens_per_second"] / trl["train_tokens_per_second"], 3)}
        for key, digits in (
            ("train_tokens_per_second", 1),
            ("model_flops_utilisation", 4),
            ("median_step_seconds", 4),
            ("peak_memory_mb", 1),
        ):
            if key in ours or key in trl:
                row[key] = side_by_side(ours, trl, key, digits)
        if "attn_implementation" in ours or "attn_implementation" in trl:
            row["attn_implementation"] = {
                "ours": ours.get("attn_implementation"),
                "trl": trl.get("attn_implementation"),
            }
        row["trl_liger_kernel"] = trl.get("liger_kernel")
        if ours_runs[method] != method:
            row["ours"] = ours_runs[method]
        compared[method] = row
    return compared


def dpo_figures(results: dict, assets: dict, peak: float | None, method: str) -> dict:
    """A dpo run's figures from its results.json: throughput, peak memory and, with PEAK, the model
    FLOP utilisation: per token the update's FLOPs as in sft_figures (4N LoRA, 6N full) plus 2N for
    the reference's forward pass (none with --precompute_ref), and attention over each row's
    length."""
    figures = key_figures(
        results,
        "method",
        "distributed_type",
        "world_size",
        "mixed_precision",
        "steps",
        "precompute_ref",
        "train_tokens_per_second",
        "median_step_seconds",
        "peak_memory_mb",
        "peak_memory_kind",
        *COMPILE_FIGURES,
    )
    tokens_per_second, pairs_per_second = (
        results.get("train_tokens_per_second"),
        results.get("train_samples_per_second"),
    )
    if tokens_per_second and pairs_per_second:
        row_length = tokens_per_second / pairs_per_second / 2  # a pair is two rows
        passes = (4 if method == "lora" else 6) + (0 if results.get("precompute_ref") else 2)
        flops_per_token = (
            passes * assets["matmul_parameters"] + 12 * assets["layers"] * assets["hidden"] * row_length
        )
        figures["mean_tokens_per_row"] = round(row_length, 1)
        figures["flops_per_token"] = round(flops_per_token)
        if peak:
            world = results.get("world_size", 1)
            figures["model_flops_utilisation"] = round(
                flops_per_token * tokens_per_second / (peak * 1e12 * world), 4
            )
    return figures


# What the grpo step keeps of TRL's run
# (benchmarks/grpo_bench.py trl) and compares with the recipe's.
GRPO_PEER_FIGURES = (
    "trainer",
    "steps",
    "mixed_precision",
    "generation_tokens_per_second",
    "first_step_generation_seconds",
    "train_tokens_per_second",
    "median_step_seconds",
    "peak_memory_mb",
)


def grpo_comparison(ours: dict, trl: dict) -> dict:
    """The recipe's GRPO run beside TRL's on the same device: generation tokens/s of the steady
    steps and ours_over_trl_generation (above 1: the recipe generates faster), the median step and
    trl_over_ours_step (above 1: the recipe's step is shorter), the first step's generation seconds,
    update tokens/s and peak memory, each as {"ours": ..., "trl": ...}."""
    row = {}
    if ours.get("generation_tokens_per_second") and trl.get("generation_tokens_per_second"):
        row["ours_over_trl_generation"] = round(
            ours["generation_tokens_per_second"] / trl["generation_tokens_per_second"], 3
        )
    if ours.get("median_step_seconds") and trl.get("median_step_seconds"):
        row["trl_over_ours_step"] = round(trl["median_step_seconds"] / ours["median_step_seconds"], 3)
    for key in ("generation_tokens_per_second", "first_step_generation_seconds", "median_step_seconds"):
        row[key] = side_by_side(ours, trl, key, 3)
    row["update_tokens_per_second"] = side_by_side(
        ours, trl, "update_tokens_per_second", 3, "train_tokens_per_second"
    )
    row["peak_memory_mb"] = side_by_side(ours, trl, "peak_memory_mb", 3)
    return row


def side_by_side(ours: dict, trl: dict, key: str, digits: int, trl_key: str | None = None) -> dict:
    """{"ours": ours[key], "trl": trl[trl_key or key]}, rounded to `digits`; None where a run lacks
    the figure."""
    pairs = (("ours", ours, key), ("trl", trl, trl_key or key))
    return {who: None if f.get(k) is None else round(f[k], digits) for who, f, k in pairs}


def grpo_figures(results: dict) -> dict:
    """A grpo run's figures from its results.json: generation tokens/s (completion tokens over the
    time in generate) and update tokens/s (prompt and completion tokens over the time of the
    updates; the recipe's train_tokens_per_second), both of the steps after the first, the first
    step's generation seconds (compilation included), how it decoded, and peak memory."""
    figures = key_figures(
        results,
        "method",
        "distributed_type",
        "world_size",
        "mixed_precision",
        "steps",
        "global_batch_size",
        "num_generations",
        "max_new_tokens",
        "decode_mode",
        "generation_tokens_per_second",
        "first_step_generation_seconds",
    )
    if "train_tokens_per_second" in results:
        figures["update_tokens_per_second"] = results["train_tokens_per_second"]
    figures.update(
        key_figures(results, "median_step_seconds", "peak_memory_mb", "peak_memory_kind", "wall_seconds")
    )
    figures.update(key_figures(results, *COMPILE_FIGURES))
    return figures
