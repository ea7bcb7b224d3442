"""The chat recipes' steps: SFT (LoRA, full, FSDP2), DPO and GRPO, each beside TRL's trainer on the
same inputs and device, and the SFT speed steps; on a chat model of Qwen2.5-0.5B's shape built here
(tiny in --quick and on the CPU)."""

import importlib.util
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

# benchmarks/
from chat_assets import ANIMAL_TRAITS, ANIMALS, QWEN25_05B, TINY_QWEN2, write_chat_assets

from ..machine import gpu_name
from ..paths import BENCHMARKS, RECIPES
from ..plan import DPO_STEPS, SFT_STEPS, SHARED_RUNS, SPEED_BATCH_TOKENS, SPEED_TOKEN_STEPS
from ..run_outputs import discard_weights, key_figures, logged, read_json, tail
from ..runner import StepRunner
from .chat_figures import (
    GRPO_PEER_FIGURES,
    dpo_figures,
    fell_back,
    grpo_comparison,
    grpo_figures,
    sft_figures,
    speed_comparison,
    trl_comparison,
    trl_figures,
)

SFT_BENCH = BENCHMARKS / "sft_bench.py"  # its trl_speed: TRL's SFTTrainer, measured as the recipe
DPO_BENCH = BENCHMARKS / "dpo_bench.py"  # its trl_speed: TRL's DPOTrainer, measured as the recipe
GRPO_BENCH = BENCHMARKS / "grpo_bench.py"  # its trl: TRL's GRPOTrainer, measured as the recipe
PACKED_ATTENTION_CHECK = BENCHMARKS / "packed_attention_check.py"
# varlen against sdpa's dense mask in bf16: the answer tokens' mean loss within 1% (bf16 keeps 8
# bits of mantissa; the two kernels sum the attention in other orders)
PACKED_ATTENTION_TOLERANCE = 1e-2
# recipes/chat/generation.py's: a static cache holds the prompt width rounded up to a multiple of it
PROMPT_BUCKET = 64
# The grpo step's training prompts by their length in buckets of PROMPT_BUCKET tokens: most in the
# first that the bare question fits, a few in the two beyond, so that batches of 8 reach different
# widths, as a user's prompts of many lengths do; the compiled decode is to serve them all in the
# one cache the recipe reserves
TRAIN_BUCKET_SHARES = (0.8, 0.12, 0.08)


class ChatSteps(StepRunner):
    """sft, dpo, grpo and the sft speed steps, on one chat model and its conversations built once
    per call."""

    _chat: dict | None = None  # the chat model, tokenizer and conversations, made at first use

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The sft step's runs on one device that a speed step of the same call takes instead of
        # running them again (the same command: lora, full, trl-lora, trl-full), each {"command",
        # "figures"}; only those that passed.
        self.shared: dict[str, dict] = {}

    def chat(self) -> dict:
        """The chat model (Qwen2.5-0.5B's shape; tiny in --quick and on the CPU), its tokenizer and
        generated conversations, which the sft, dpo and grpo steps share: built once per call (the
        0.5B model takes seconds to build and save)."""
        if self._chat is None:
            small = self.quick or not self.cuda
            folder = self.out / "chat-data"
            shutil.rmtree(folder, ignore_errors=True)
            self._chat = write_chat_assets(
                folder, TINY_QWEN2 if small else QWEN25_05B, *((32, 8) if small else (640, 64))
            )
        return self._chat

    def sft_runs(self) -> list[tuple[str, list[str], int]]:
        """(name, launch, processes) of each chat fine-tune: with 2+ GPUs LoRA and full under FSDP2
        on all of them; on one GPU (and the CPU) LoRA and full on one device, packed, each followed
        by TRL's SFTTrainer on the same device (trl-lora, trl-full: its own process, so its own
        memory peak), on one GPU LoRA in padded rows (lora-padded: the recipe's default rows), then
        LoRA under fsdp.yaml: one process on a GPU (unsharded), two gloo processes on the CPU (FSDP
        needs a process group there)."""
        if self.gpus >= 2:
            launch = self.launch("fsdp", self.gpus)
            return [("lora", launch, self.gpus), ("full", launch, self.gpus)]
        fsdp = 1 if self.cuda else 2
        trl = [sys.executable, SFT_BENCH, "trl_speed"]
        runs = [("lora", self.single(), 1), ("trl-lora", trl, 1), ("full", self.single(), 1)]
        runs += [("trl-full", trl, 1)]
        # on a GPU, LoRA as `make sft-1gpu` runs it too: padded rows (no --packing), compiled blocks
        runs += [("lora-padded", self.single(), 1)] if self.cuda and not self.quick else []
        return runs + [("lora-fsdp", self.launch("fsdp", fsdp), fsdp)]

    def sft_flags(self, assets: dict, run_dir: Path, steps: int | None = None, packing: bool = True) -> tuple:
        """The flags every sft run of gpu-check shares (packed rows of the generated chats unless
        not PACKING, 20 steps, 3 in --quick and on the CPU, or STEPS), and those of TRL's runs
        beside them: the same model, conversations, steps and device."""
        small = self.quick or not self.cuda
        # 20 x 16 conversations per GPU: half the 640 generated, read once (a run within one epoch,
        # whose end evaluates and saves)
        steps = str(steps or (3 if small else SFT_STEPS))
        log_every = "1" if small else "10"
        common = [RECIPES / "sft.py", "--model", assets["model"], "--train_file", assets["train"]]
        rows = ["--packing"] if packing else []  # without it, padded rows: the recipe's default
        common += ["--validation_file", assets["validation"], *rows, "--max_length", "1024"]
        common += [
            "--max_steps",
            steps,
            "--log_every",
            log_every,
            "--checkpoint_every",
            "0",
            "--eval_generate",
            "0",
        ]
        common += ["--tracker", "none", "--cache_dir", run_dir / "datasets-cache"]
        # On a GPU the configs' bf16; fp32 on the CPU, where
        # bf16 autocast is emulated (slowly) on some machines.
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        # TRL picks bf16 on a GPU and fp32 on the CPU alike.
        trl_common = ["--model", assets["model"], "--train_file", assets["train"], "--max_steps", steps]
        trl_common += [
            "--max_length",
            "1024",
            "--log_every",
            log_every,
            "--device",
            "cuda" if self.cuda else "cpu",
        ]
        return common, trl_common

    def sft_speed(self, method: str):
        """recipes/sft.py (LoRA r16 or full) on the sft step's model and chats, one device, in the
        ways it can run: the device's default at 16 conversations a step (compiled blocks on a GPU,
        eager on the CPU: 2 conversations there and in --quick), in rows of 16,384 tokens
        (--batch_tokens, compiled; 2,048 on the CPU and in --quick), and TRL's SFTTrainer at 16
        conversations; figures["speed"] puts tokens/s and MFU side by side, each over the default's,
        and names the fastest. Every run trains within one epoch (its end would evaluate and save in
        the middle of the measurement). The default's run and TRL's are the sft step's own commands:
        when that step made them in this call they are taken from it (figures[...]["from_step"]),
        not run again; TRL runs on the CPU only so."""

        def body(run_dir, timeout):
            small = self.quick or not self.cuda
            end = time.monotonic() + self.limit(timeout)[0]
            assets = self.chat()
            common, trl_common = self.sft_flags(assets, run_dir)
            rows_common, _ = self.sft_flags(assets, run_dir, None if small else SPEED_TOKEN_STEPS)
            lora = ["--lora_r", "16"] if method == "lora" else ["--lora_r", "0"]
            conversations = ["--batch_size", "2" if small else "16"]
            default = "compiled" if self.cuda else "eager"  # the recipe's own choice on this device
            rows = 2048 if small else SPEED_BATCH_TOKENS
            runs = [  # (name, flags, the sft step's run it repeats)
                (default, [*common, *conversations], method),
                (f"tokens-{rows // 1024}k", [*rows_common, "--batch_tokens", str(rows)], None),
            ]
            trl_run = f"trl-{method}"
            if importlib.util.find_spec("trl") is not None and (not small or trl_run in self.shared):
                runs.append(("trl", conversations, trl_run))
            # torch: imported when a step runs, not for --help
            from accelerate_recipes.meter import peak_tflops

            peak = peak_tflops(gpu_name()) if self.cuda else None
            shown, figures, problems = [], {}, []
            for name, flags, repeats in runs:
                if repeats in self.shared:
                    shown.append(self.shared[repeats]["command"])
                    figures[name] = {**self.shared[repeats]["figures"], "from_step": "sft"}
                    continue
                out = run_dir / name
                if name == "trl":
                    command = [
                        sys.executable,
                        SFT_BENCH,
                        "trl_speed",
                        *trl_common,
                        *flags,
                        *lora,
                        "--output_dir",
                        out,
                    ]
                else:
                    command = [*self.single(), *flags, *lora, "--output_dir", out]
                shown.append(" ".join(map(str, command)))
                code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
                results = read_json(out / "results.json")
                if name == "trl":
                    figures[name] = trl_figures(results, figures.get(default, {}), peak)
                else:
                    figures[name] = sft_figures(results)
                    figures[name].update(key_figures(results, "batch_tokens", "liger"))
                    epochs = logged(out, "train/epoch")
                    figures[name]["epochs"] = round(max(epochs), 3) if epochs else None
                # results.json read: the run's model and checkpoint are not needed
                discard_weights(out)
                if code != 0:
                    problems.append(
                        f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}"
                    )
                    if code == 124:
                        break
                elif name != "trl" and fell_back(results):
                    problems.append(f"{name}: {'; '.join(fell_back(results))}")
                elif not figures[name].get("train_tokens_per_second"):
                    problems.append(f"{name}: no train_tokens_per_second in {out / 'results.json'}")
                elif (figures[name].get("epochs") or 0) > 1:
                    problems.append(
                        f"{name}: trained {figures[name]['epochs']} epochs; a speed run stays within one"
                    )
            figures = {"speed": speed_comparison(figures, default), **figures}
            return ("fail" if problems else "pass"), shown, figures, "\n".join(problems)

        return body

    def sft_commands(self, assets: dict, run_dir: Path) -> list[tuple[str, int, list]]:
        """(name, processes, command) of each run of the sft step (sft_runs), in order, on the chat
        ASSETS."""
        small = self.quick or not self.cuda
        common, trl_common = self.sft_flags(assets, run_dir)
        padded, _ = self.sft_flags(assets, run_dir, packing=False)
        commands = []
        for name, launch, processes in self.sft_runs():
            method = name.removeprefix("trl-").split("-")[0]
            out = run_dir / name
            # a decent load per GPU: 16 conversations of ~450
            # tokens, packed into one row of ~7,000 tokens
            batch = ["--batch_size", str((2 if small else 16) * processes)]
            lora = ["--lora_r", "16"] if method == "lora" else []
            if name.startswith("trl-"):
                command = [*launch, *trl_common, *batch, *(lora or ["--lora_r", "0"]), "--output_dir", out]
            else:
                flags = padded if name.endswith("-padded") else common
                command = [*launch, *flags, *batch, *lora, "--output_dir", out]
            commands.append((name, processes, command))
        return commands

    def sft(self, run_dir, timeout):
        """recipes/sft.py on a chat model of Qwen2.5-0.5B's shape (tiny in --quick and on the CPU):
        a LoRA adapter and a full fine-tune, packed, each followed by TRL's SFTTrainer on the same
        inputs and device, and on one GPU LoRA in padded rows (the recipe's default rows, compiled
        as on any GPU) and LoRA under FSDP2 too; throughput, memory against the recipe's own plan,
        MFU, how often the compiled blocks compiled, and the recipe against TRL (figures["vs_trl"]).
        A run whose compiled blocks fell back to eager fails the step: it proved the eager path. A
        run the budget cuts keeps the figures of the runs before it."""
        # every run and the inputs within the step's time
        end = time.monotonic() + self.limit(timeout)[0]
        assets = self.chat()
        trl_missing = importlib.util.find_spec("trl") is None
        liger_imports = importlib.util.find_spec("liger_kernel") is not None
        # torch: imported when a step runs, not for --help
        from accelerate_recipes.meter import peak_tflops

        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems, notes = [], {}, [], []
        # the packed rows' attention: varlen's kernel
        # against sdpa's dense mask (CPU: tests/ hold it)
        if self.cuda:
            command = [sys.executable, PACKED_ATTENTION_CHECK, "--model", assets["model"], "--train_file"]
            command += [
                assets["train"],
                "--rows",
                "4",
                "--per_row",
                "16",
                "--output_dir",
                run_dir / "packed-attention",
            ]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), "packed-attention.txt")
            agreement = read_json(run_dir / "packed-attention" / "packed_attention.json")
            figures["packed_attention"] = agreement
            if code != 0:
                problems.append(f"packed-attention: exit {code}; last lines:\n{last}")
            elif agreement.get("relative_mean_loss_difference", 1) > PACKED_ATTENTION_TOLERANCE:
                problems.append(
                    f"packed-attention: varlen's mean loss is not sdpa's within bf16 tolerance: {agreement}"
                )
        for name, processes, command in self.sft_commands(assets, run_dir):
            method = name.removeprefix("trl-").split("-")[0]
            out = run_dir / name
            if name.startswith("trl-") and trl_missing:
                continue
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
            liger_failed = None
            if name.startswith("trl-") and code not in (0, 124) and self.cuda and liger_imports:
                # Liger patches the model's layers as training starts, and a release that does not
                # fit this transformers fails there; TRL without it is still the peer to compare
                # with: run it so, once.
                liger_failed = tail(run_dir / f"{name}.txt", 1)
                command += ["--liger", "false"]
                shown.append(" ".join(map(str, command)))
                code, last = self.execute(
                    command, run_dir, end - time.monotonic(), f"{name}-without-liger.txt"
                )
            results = read_json(out / "results.json")
            if name.startswith("trl-"):
                figures[name] = trl_figures(results, figures.get(method, {}), peak)
                losses = results.get("train_losses", [])
                if liger_failed is not None:
                    figures[name]["liger_kernel_failed"] = liger_failed
                    notes.append(f"{name}: failed with Liger Kernel ({liger_failed}); rerun without it")
            else:
                figures[name] = sft_figures(results)
                losses = logged(out, "train/loss")
            if method == "lora" and not name.startswith("trl-"):
                figures[name]["adapter_saved"] = (out / "adapter_model.safetensors").is_file()
            discard_weights(out)  # results.json read: the run's model and checkpoint are not needed
            problem = None
            if code != 0:
                problem = f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}"
            elif fell_back(results):
                problem = f"{name}: {'; '.join(fell_back(results))}"
            elif not losses:
                problem = f"{name}: no training loss in {out}"
            elif not all(math.isfinite(x) for x in losses):
                problem = f"{name}: a non-finite training loss among {losses}"
            elif not results.get("peak_memory_mb"):
                problem = f"{name}: no peak_memory_mb in {out / 'results.json'}"
            elif name == "lora" and not figures[name]["adapter_saved"]:
                problem = f"{name}: no adapter_model.safetensors in {out}"
            elif name.startswith("trl-") and results.get("train_tokens") != results.get("trl_num_tokens"):
                counted = (results.get(k) for k in ("train_tokens", "trl_num_tokens"))
                problem = "{}: {} tokens counted, TRL counted {}".format(name, *counted)
            elif name in SHARED_RUNS and processes == 1 and self.gpus < 2:
                # the speed steps' own command at 16 conversations (2 on the CPU): taken from here
                # in this call
                self.shared[name] = {"command": shown[-1], "figures": figures[name]}
            if problem:
                problems.append(problem)
                if code == 124:
                    break  # out of time: the runs after it would not fit either
        notes += [
            f"{name}: peak memory {f['peak_memory_mb']:,.0f} MB is {f['peak_over_plan']:.2f}x the plan's "
            "total"
            for name, f in figures.items()
            if f.get("peak_over_plan", 0) > 1.5
        ]
        if self.gpus >= 2:
            compared = "not run: the recipe shards over all GPUs here; the comparison runs on one GPU"
        elif trl_missing:
            compared = "not run: trl not installed (pip install trl)"
        else:
            compared = trl_comparison(figures)
        # the comparison first: what the report's table
        # shows of this step before the runs' own figures
        figures = {"vs_trl": compared, **figures}
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems + notes)

    def dpo_runs(self) -> list[str]:
        """The dpo step's runs, in order. On one device: LoRA in left-padded rows as `make dpo-1gpu`
        runs it (lora-padded: sdpa with a mask, the path whose gradients went NaN under cuDNN's
        kernel on an H100, cuDNN kept off since; compiled blocks and the 4 greedy answers of
        --eval_generate, whose decode is compiled, on a GPU), TRL's DPOTrainer on the same pairs
        (trl-lora, when trl imports: it pads its rows too, so the two compare like with like), then
        the rows packed (--packing, padding-free: varlen on a GPU): in full on a GPU (a frozen copy
        as reference), with LoRA on the CPU and in --quick, which keep to LoRA. With 2+ GPUs all
        three of the recipe's runs under FSDP2 (the full one with --precompute_ref), without TRL."""
        if self.gpus >= 2:
            return ["lora-padded", "lora", "full"]
        trl = ["trl-lora"] if importlib.util.find_spec("trl") is not None else []
        return ["lora-padded", *trl, "lora" if self.quick or not self.cuda else "full"]

    def dpo_commands(self, assets: dict, pairs: dict, run_dir: Path) -> list[tuple[str, str, list]]:
        """(name, method, command) of each run of dpo_runs, on the chat ASSETS' model and the
        preference PAIRS."""
        small = self.quick or not self.cuda
        steps = str(3 if small else DPO_STEPS)
        log_every = "1" if small else "10"
        common = [RECIPES / "dpo.py", "--model", assets["model"], "--train_file", pairs["train"]]
        common += ["--validation_file", pairs["validation"], "--max_length", "1024", "--max_steps", steps]
        common += ["--checkpoint_every", "0", "--tracker", "none", "--cache_dir", run_dir / "datasets-cache"]
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        ways = {
            # the recipe's defaults but for the run's length: compiled blocks on a GPU,
            # --eval_generate's answers (shorter on the CPU and in --quick); every step logged, to
            # see a loss go non-finite
            "padded": ["--log_every", "1", *(["--max_new_tokens", "8"] if small else [])],
            # chosen and rejected rows padding-free; no answers, which the padded run generates
            "packed": ["--packing", "--log_every", log_every, "--eval_generate", "0"],
        }
        # TRL's DPOTrainer on the same model, pairs, steps and device (one device only)
        trl = [sys.executable, DPO_BENCH, "trl_speed", "--model", assets["model"]]
        trl += ["--train_file", pairs["train"], "--max_steps", steps, "--max_length", "1024"]
        trl += ["--log_every", log_every, "--device", "cuda" if self.cuda else "cpu"]
        processes = max(self.gpus, 1)
        launch = self.launch("fsdp", self.gpus) if self.gpus >= 2 else self.single()
        # 8 pairs per GPU: 16 rows of ~450 tokens (prompt and answer) in each forward pass
        batch = ["--batch_size", str((2 if small else 8) * processes)]
        commands = []
        for name in self.dpo_runs():
            method, out = name.removeprefix("trl-").removesuffix("-padded"), run_dir / name
            if name.startswith("trl-"):
                command = [*trl, *batch, "--lora_r", "16" if method == "lora" else "0", "--output_dir", out]
            else:
                lora = (
                    ["--lora_r", "16"] if method == "lora" else ["--precompute_ref"] if self.gpus >= 2 else []
                )
                way = ways["padded" if name.endswith("-padded") else "packed"]
                command = [*launch, *common, *way, *batch, *lora, "--output_dir", out]
            commands.append((name, method, command))
        return commands

    def dpo(self, run_dir, timeout):
        """recipes/dpo.py on the sft step's model shape (tiny in --quick and on the CPU) and pairs
        made from its generated chats (the chat's own last answer chosen, another chat's rejected),
        the runs of
        dpo_runs: both ways its rows go (left-padded, the default, and packed), LoRA beside TRL's
        DPOTrainer and, on a GPU, in full. Throughput, peak memory, MFU, how often its compiled
        paths compiled; each run's loss finite at every logged step and its gradient norm at every
        step (the recipe's guard stops a run at a non-finite one; read from metrics.jsonl too when
        the recipe logs it). A run whose compiled blocks or decode fell back to eager fails the step
        (it proved the eager path); a non-finite loss of TRL's is TRL's, reported and not failed
        on."""
        end = time.monotonic() + self.limit(timeout)[0]
        assets = self.chat()
        (run_dir / "inputs").mkdir()
        pairs = {
            name: write_preference_pairs(assets[name], run_dir / "inputs" / f"{name}-pairs.jsonl")
            for name in ("train", "validation")
        }
        # torch: imported when a step runs, not for --help
        from accelerate_recipes.meter import peak_tflops

        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems, notes = [], {}, [], []
        for name, method, command in self.dpo_commands(assets, pairs, run_dir):
            out = run_dir / name
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
            results = read_json(out / "results.json")
            norms = []
            if name.startswith("trl-"):
                figures[name] = trl_figures(results, figures.get(f"{method}-padded", {}), peak)
                figures[name].update(key_figures(results, "sdpa_backends_off"))
                losses = results.get("train_losses", [])
            else:
                figures[name] = dpo_figures(results, assets, peak, method)
                figures[name].update(
                    key_figures(results, "packing", "attn_implementation", "compile", "sdpa_backends_off")
                )
                losses, norms = logged(out, "train/loss"), logged(out, "train/grad_norm")
                figures[name]["finite"] = finite_figures(losses, norms)
            discard_weights(out)  # results.json read: the run's model and checkpoint are not needed
            finite = bool(losses) and all(math.isfinite(x) for x in losses)
            if name.startswith("trl-"):
                figures[name]["loss"] = "finite" if finite else "not finite"
            if code != 0:
                problems.append(
                    f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}"
                )
                if code == 124:
                    break
            elif name.startswith("trl-") and losses and not finite:
                # TRL runs under the recipe's sdpa kernels
                # (cuDNN's off on CUDA): a NaN there is TRL's own
                notes.append(f"{name}: TRL's DPOTrainer logged a non-finite loss, not the recipe: {losses}")
            elif not finite:
                problems.append(f"{name}: no finite training loss in {out}: {losses}")
            elif fell_back(results):
                problems.append(f"{name}: {'; '.join(fell_back(results))}")
            elif not all(math.isfinite(x) for x in norms):
                problems.append(f"{name}: a non-finite gradient norm among {norms}")
            elif not results.get("peak_memory_mb"):
                problems.append(f"{name}: no peak_memory_mb in {out / 'results.json'}")
        # the comparison first, as in the sft step
        if any(name.startswith("trl-") for name in figures):
            figures = {"vs_trl": trl_comparison(figures, {"lora": "lora-padded"}), **figures}
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems + notes)

    def grpo_commands(self, assets: dict, prompts: dict, run_dir: Path) -> tuple[list, list]:
        """The grpo step's two commands: recipes/grpo.py with LoRA as `make grpo-1gpu` runs it, its
        defaults but for the sizes (on a GPU --decode auto's compiled decode, the evaluation's
        sampled answers, prompts up to 512 tokens), and TRL's GRPOTrainer on the same model, prompts
        and sizes."""
        small = self.quick or not self.cuda
        # a GPU's step: 8 prompts x 8 completions of 256
        # tokens, 64 rows generated at once, then one update
        batch, generations, new_tokens, steps = ["2", "2", "8", "2"] if small else ["8", "8", "256", "4"]
        sizes = ["--batch_size", batch, "--num_generations", generations, "--max_new_tokens", new_tokens]
        sizes += ["--max_steps", steps]
        ours = [*self.single(), RECIPES / "grpo.py", "--model", assets["model"]]
        ours += ["--train_file", prompts["train"], "--validation_file", prompts["validation"]]
        ours += ["--reward", "number", "--lora_r", "16", *sizes]
        ours += ["--log_every", "1", "--checkpoint_every", "0", "--tracker", "none"]
        ours += ["--cache_dir", run_dir / "datasets-cache", "--output_dir", run_dir / "lora"]
        ours += [] if self.cuda else ["--mixed_precision", "no"]
        trl = [sys.executable, GRPO_BENCH, "trl", "--model", assets["model"], "--train_file"]
        trl += [prompts["train"], *sizes, "--lora_r", "16", "--lora_alpha", "32", "--save", "False"]
        trl += ["--device", "cuda" if self.cuda else "cpu", "--output_dir", run_dir / "trl-lora"]
        return ours, trl

    def grpo(self, run_dir, timeout):
        """recipes/grpo.py with a LoRA adapter on the sft step's model shape (tiny in --quick and on
        the CPU), a few steps on generated arithmetic prompts whose lengths span several buckets of
        the static cache (PROMPT_BUCKET tokens each; figures["prompts_per_bucket"]), as users'
        prompts do, then TRL's GRPOTrainer on the same model, prompts, completions per prompt,
        completion length and steps (benchmarks/grpo_bench.py trl: its own generate, no vLLM):
        generation tokens/s of the steady steps, the first step's generation seconds (the decode
        step's compilation), update tokens/s, median step and peak memory of each, side by side
        (figures["vs_trl"]), and how often the decode compiled. The weights are random, so the
        rewards stay zero: the figures are speed only (every completion runs to --max_new_tokens,
        and the update still makes its full forward and backward passes). A run whose compiled
        decode fell back to eager fails the step."""
        small = self.quick or not self.cuda
        end = time.monotonic() + timeout
        assets = self.chat()
        (run_dir / "inputs").mkdir()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(assets["model"])
        prompts, buckets = {}, {}
        for name, count, seed in (("train", 64, 0), ("validation", 4 if small else 8, 1)):
            path = run_dir / "inputs" / f"{name}-prompts.jsonl"
            # the held-out prompts spread over the buckets
            # evenly; the training ones by TRAIN_BUCKET_SHARES
            spread = [index * len(TRAIN_BUCKET_SHARES) // count for index in range(count)]
            spread = spread if name == "validation" else None
            lengths = write_arithmetic_prompts(path, count, seed, tokenizer, spread)
            prompts[name] = path
            buckets[name] = per_bucket(lengths)
        command, trl = self.grpo_commands(assets, prompts, run_dir)
        code, last = self.execute(command, run_dir, end - time.monotonic(), "lora.txt")
        out = run_dir / "lora"
        results = read_json(out / "results.json")
        figures = {"lora": grpo_figures(results)}
        losses = logged(out, "train/loss")
        shown = [" ".join(map(str, command))]
        problems = []
        if code != 0:
            problems.append(f"exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
        elif not losses or not all(math.isfinite(x) for x in losses):
            problems.append(f"no finite training loss in {out / 'metrics.jsonl'}: {losses}")
        elif fell_back(results):
            problems.append("; ".join(fell_back(results)))
        elif not (results.get("generation_tokens_per_second") and results.get("train_tokens_per_second")):
            problems.append(
                f"no generation_tokens_per_second or train_tokens_per_second in {out / 'results.json'}"
            )
        if importlib.util.find_spec("trl") is None:
            figures["vs_trl"] = "not run: trl not installed (pip install trl)"
        elif code != 124:  # a budget cut leaves no time for the peer
            shown.append(" ".join(map(str, trl)))
            trl_code, trl_last = self.execute(trl, run_dir, end - time.monotonic(), "trl-lora.txt")
            figures["trl-lora"] = key_figures(
                read_json(run_dir / "trl-lora" / "results.json"), *GRPO_PEER_FIGURES
            )
            if trl_code != 0:
                problems.append(f"trl-lora: exit {trl_code}; last lines:\n{trl_last}")
            figures = {"vs_trl": grpo_comparison(figures["lora"], figures["trl-lora"]), **figures}
        figures["prompts_per_bucket"] = buckets
        if problems:
            return "fail", shown, figures, "\n".join(problems)
        return "pass", shown, figures, ""


def finite_figures(losses: list[float], norms: list[float]) -> dict:
    """What a run's metrics.jsonl says of its losses and gradient norms: how many steps logged a
    loss, and whether those and the logged gradient norms were finite. A run that logs no gradient
    norm had its norm checked at every step by the recipe's guard (accelerate_recipes/guard.py),
    which stops a run at the first non-finite one: a run that ended had none."""
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    grad_norm = (
        ("finite" if all(math.isfinite(x) for x in norms) else "not finite")
        if norms
        else "not logged; the recipe's guard checks it at every step"
    )
    return {"logged_steps": len(losses), "loss": "finite" if finite else "not finite", "grad_norm": grad_norm}


def write_preference_pairs(chats: Path, path: Path) -> Path:
    """Preference pairs from generated chats, in TRL's conversational form: the turns before a
    chat's last answer are the prompt, that answer is chosen and the next chat's last answer
    rejected."""
    conversations = [json.loads(line)["messages"] for line in Path(chats).read_text().splitlines()]
    rows = []
    for index, messages in enumerate(conversations):
        other = conversations[(index + 1) % len(conversations)][-1]
        if other["content"] != messages[-1]["content"]:
            rows.append({"prompt": messages[:-1], "chosen": messages[-1:], "rejected": [other]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_arithmetic_prompts(
    path: Path, count: int, seed: int, tokenizer, spread: list[int] | None = None
) -> list[int]:
    """COUNT prompts whose answers the grpo recipe's `number` reward checks (sums and products of
    two numbers), each after as many sentences of context as bring it, rendered as the recipe
    renders it (TOKENIZER's chat template with the generation prompt), into a bucket of
    PROMPT_BUCKET tokens: SPREAD[i] buckets beyond the first that the bare question fits for the
    i-th prompt, else a number drawn by TRAIN_BUCKET_SHARES. Returns each prompt's length in
    tokens."""
    rng = random.Random(seed)

    def length(text: str) -> int:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    rows, lengths = [], []
    for index in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        sign, answer = rng.choice([("+", a + b), ("x", a * b)])
        question = f"What is {a} {sign} {b}? Answer with the number only."
        drawn = rng.choices(range(len(TRAIN_BUCKET_SHARES)), TRAIN_BUCKET_SHARES)[0]
        beyond = spread[index] if spread else drawn
        bucket = -(-length(question) // PROMPT_BUCKET) + beyond
        # in the bucket's lower half: a sentence adds ~20
        # tokens, so the last one added stays inside the bucket
        target = (bucket - 1) * PROMPT_BUCKET + rng.randint(1, PROMPT_BUCKET // 2)
        context: list[str] = []
        while length(" ".join([*context, question])) < target:
            animal = rng.choice(ANIMALS)
            traits = ANIMAL_TRAITS[animal]
            context.append(f"A {traits['size']} {animal} {traits['habit']} near the {traits['home']}.")
        prompt = " ".join([*context, question])
        tokens = length(prompt)
        if -(-tokens // PROMPT_BUCKET) != bucket:
            missed = f"bucket {bucket} of {PROMPT_BUCKET} tokens each"
            raise RuntimeError(f"a prompt of {tokens} tokens missed {missed}")
        rows.append({"prompt": prompt, "answer": str(answer)})
        lengths.append(tokens)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return lengths


def per_bucket(lengths: list[int]) -> dict[str, int]:
    """How many of the prompt LENGTHS fall in each bucket of PROMPT_BUCKET tokens: {"up to 128": 51,
    ...}."""
    buckets = sorted({-(-n // PROMPT_BUCKET) for n in lengths})
    return {f"up to {b * PROMPT_BUCKET}": sum(-(-n // PROMPT_BUCKET) == b for n in lengths) for b in buckets}
