"""The chat recipes' steps: SFT (LoRA, full, FSDP2), DPO and GRPO, each beside TRL's trainer on the same inputs and
device, and the SFT speed steps; on a chat model of Qwen2.5-0.5B's shape built here (tiny in --quick and on the CPU)."""

import importlib.util
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

from chat_assets import QWEN25_05B, TINY_QWEN2, write_chat_assets  # benchmarks/, beside this package

from ..machine import gpu_name
from ..paths import BENCHMARKS, RECIPES
from ..plan import DPO_STEPS, SFT_STEPS, SHARED_RUNS, SPEED_BATCH_TOKENS, SPEED_TOKEN_STEPS
from ..run_outputs import discard_weights, key_figures, logged, read_json, tail
from ..runner import StepRunner
from .chat_figures import (
    GRPO_PEER_FIGURES,
    dpo_figures,
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
# varlen against sdpa's dense mask in bf16: the answer tokens' mean loss within 1% (bf16 keeps 8 bits of mantissa;
# the two kernels sum the attention in other orders)
PACKED_ATTENTION_TOLERANCE = 1e-2


class ChatSteps(StepRunner):
    """sft, dpo, grpo and the sft speed steps, on one chat model and its conversations built once per call."""

    _chat: dict | None = None  # the chat model, tokenizer and conversations, made at first use

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The sft step's runs on one device that a speed step of the same call takes instead of running them again
        # (the same command: lora, full, trl-lora, trl-full), each {"command", "figures"}; only those that passed.
        self.shared: dict[str, dict] = {}

    def chat(self) -> dict:
        """The chat model (Qwen2.5-0.5B's shape; tiny in --quick and on the CPU), its tokenizer and generated
        conversations, which the sft, dpo and grpo steps share: built once per call (the 0.5B model takes seconds
        to build and save)."""
        if self._chat is None:
            small = self.quick or not self.cuda
            folder = self.out / "chat-data"
            shutil.rmtree(folder, ignore_errors=True)
            self._chat = write_chat_assets(
                folder, TINY_QWEN2 if small else QWEN25_05B, *((32, 8) if small else (640, 64))
            )
        return self._chat

    def sft_runs(self) -> list[tuple[str, list[str], int]]:
        """(name, launch, processes) of each chat fine-tune: with 2+ GPUs LoRA and full under FSDP2 on all of them;
        on one GPU (and the CPU) LoRA and full on one device, each followed by TRL's SFTTrainer on the same device
        (trl-lora, trl-full: its own process, so its own memory peak), then LoRA under fsdp.yaml: one process on a
        GPU (unsharded), two gloo processes on the CPU (FSDP needs a process group there)."""
        if self.gpus >= 2:
            launch = self.launch("fsdp", self.gpus)
            return [("lora", launch, self.gpus), ("full", launch, self.gpus)]
        fsdp = 1 if self.cuda else 2
        trl = [sys.executable, SFT_BENCH, "trl_speed"]
        return [
            ("lora", self.single(), 1),
            ("trl-lora", trl, 1),
            ("full", self.single(), 1),
            ("trl-full", trl, 1),
            ("lora-fsdp", self.launch("fsdp", fsdp), fsdp),
        ]

    def sft_flags(self, assets: dict, run_dir: Path, steps: int | None = None) -> tuple[list, list]:
        """The flags every sft run of gpu-check shares (packed rows of the generated chats, 20 steps, 3 in --quick
        and on the CPU, or STEPS), and those of TRL's runs beside them: the same model, conversations, steps and
        device."""
        small = self.quick or not self.cuda
        # 20 x 16 conversations per GPU: half the 640 generated, read once (a run within one epoch, whose end
        # evaluates and saves)
        steps = str(steps or (3 if small else SFT_STEPS))
        log_every = "1" if small else "10"
        common = [RECIPES / "sft.py", "--model", assets["model"], "--train_file", assets["train"]]
        common += ["--validation_file", assets["validation"], "--packing", "--max_length", "1024"]
        common += ["--max_steps", steps, "--log_every", log_every, "--checkpoint_every", "0", "--eval_generate", "0"]
        common += ["--tracker", "none", "--cache_dir", run_dir / "datasets-cache"]
        # On a GPU the configs' bf16; fp32 on the CPU, where bf16 autocast is emulated (slowly) on some machines.
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        # TRL picks bf16 on a GPU and fp32 on the CPU alike.
        trl_common = ["--model", assets["model"], "--train_file", assets["train"], "--max_steps", steps]
        trl_common += ["--max_length", "1024", "--log_every", log_every, "--device", "cuda" if self.cuda else "cpu"]
        return common, trl_common

    def sft_speed(self, method: str):
        """recipes/sft.py (LoRA r16 or full) on the sft step's model and chats, one device, in the ways it can run:
        the device's default at 16 conversations a step (compiled blocks on a GPU, eager on the CPU: 2 conversations
        there and in --quick), in rows of 16,384 tokens (--batch_tokens, compiled; 2,048 on the CPU and in --quick),
        and TRL's SFTTrainer at 16 conversations; figures["speed"] puts tokens/s and MFU side by side, each over the
        default's, and names the fastest. Every run trains within one epoch (its end would evaluate and save in the
        middle of the measurement). The default's run and TRL's are the sft step's own commands: when that step made
        them in this call they are taken from it (figures[...]["from_step"]), not run again; TRL runs on the CPU
        only so."""

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
            from accelerate_recipes.meter import peak_tflops  # torch: imported when a step runs, not for --help

            peak = peak_tflops(gpu_name()) if self.cuda else None
            shown, figures, problems = [], {}, []
            for name, flags, repeats in runs:
                if repeats in self.shared:
                    shown.append(self.shared[repeats]["command"])
                    figures[name] = {**self.shared[repeats]["figures"], "from_step": "sft"}
                    continue
                out = run_dir / name
                if name == "trl":
                    command = [sys.executable, SFT_BENCH, "trl_speed", *trl_common, *flags, *lora, "--output_dir", out]
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
                discard_weights(out)  # results.json read: the run's model and checkpoint are not needed
                if code != 0:
                    problems.append(f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
                    if code == 124:
                        break
                elif not figures[name].get("train_tokens_per_second"):
                    problems.append(f"{name}: no train_tokens_per_second in {out / 'results.json'}")
                elif (figures[name].get("epochs") or 0) > 1:
                    problems.append(f"{name}: trained {figures[name]['epochs']} epochs; a speed run stays within one")
            figures = {"speed": speed_comparison(figures, default), **figures}
            return ("fail" if problems else "pass"), shown, figures, "\n".join(problems)

        return body

    def sft(self, run_dir, timeout):
        """recipes/sft.py on a chat model of Qwen2.5-0.5B's shape (tiny in --quick and on the CPU): a LoRA adapter
        and a full fine-tune, packed, each followed by TRL's SFTTrainer on the same inputs and device, and on one GPU
        LoRA under FSDP2 too; throughput, memory against the recipe's own plan, MFU, and the recipe against TRL
        (figures["vs_trl"]). A run the budget cuts keeps the figures of the runs before it."""
        small = self.quick or not self.cuda
        end = time.monotonic() + self.limit(timeout)[0]  # every run and the inputs within the step's time
        assets = self.chat()
        common, trl_common = self.sft_flags(assets, run_dir)
        trl_missing = importlib.util.find_spec("trl") is None
        liger_imports = importlib.util.find_spec("liger_kernel") is not None
        from accelerate_recipes.meter import peak_tflops  # torch: imported when a step runs, not for --help

        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems, notes = [], {}, [], []
        if self.cuda:  # the packed rows' attention: varlen's kernel against sdpa's dense mask (CPU: tests/ hold it)
            command = [sys.executable, PACKED_ATTENTION_CHECK, "--model", assets["model"], "--train_file"]
            command += [assets["train"], "--rows", "4", "--per_row", "16", "--output_dir", run_dir / "packed-attention"]
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
        for name, launch, processes in self.sft_runs():
            method = name.removeprefix("trl-").split("-")[0]
            out = run_dir / name
            # a decent load per GPU: 16 conversations of ~450 tokens, packed into one row of ~7,000 tokens
            batch = ["--batch_size", str((2 if small else 16) * processes)]
            lora = ["--lora_r", "16"] if method == "lora" else []
            if name.startswith("trl-"):
                if trl_missing:
                    continue
                command = [*launch, *trl_common, *batch, *(lora or ["--lora_r", "0"]), "--output_dir", out]
            else:
                command = [*launch, *common, *batch, *lora, "--output_dir", out]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
            liger_failed = None
            if name.startswith("trl-") and code not in (0, 124) and self.cuda and liger_imports:
                # Liger patches the model's layers as training starts, and a release that does not fit this
                # transformers fails there; TRL without it is still the peer to compare with: run it so, once.
                liger_failed = tail(run_dir / f"{name}.txt", 1)
                command += ["--liger", "false"]
                shown.append(" ".join(map(str, command)))
                code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}-without-liger.txt")
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
                # the speed steps' own command at 16 conversations (2 on the CPU): taken from here in this call
                self.shared[name] = {"command": shown[-1], "figures": figures[name]}
            if problem:
                problems.append(problem)
                if code == 124:
                    break  # out of time: the runs after it would not fit either
        notes += [
            f"{name}: peak memory {f['peak_memory_mb']:,.0f} MB is {f['peak_over_plan']:.2f}x the plan's total"
            for name, f in figures.items()
            if f.get("peak_over_plan", 0) > 1.5
        ]
        if self.gpus >= 2:
            compared = "not run: the recipe shards over all GPUs here; the comparison runs on one GPU"
        elif trl_missing:
            compared = "not run: trl not installed (pip install trl)"
        else:
            compared = trl_comparison(figures)
        # the comparison first: what the report's table shows of this step before the runs' own figures
        figures = {"vs_trl": compared, **figures}
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems + notes)

    def dpo(self, run_dir, timeout):
        """recipes/dpo.py on the sft step's model shape (tiny in --quick and on the CPU) and pairs made from its
        generated chats (the chat's own last answer chosen, another chat's rejected), both ways its rows go: packed
        (--packing, padding-free: varlen on a GPU), a LoRA adapter (the base as reference) followed by TRL's
        DPOTrainer on the same inputs and device, and a full fine-tune (a frozen copy as reference; on a GPU only),
        and left-padded (sdpa with a mask, the path whose gradients went NaN under cuDNN's kernel on an H100; cuDNN
        is kept off since), LoRA, eager, every step logged. Throughput, peak memory and MFU; each run's loss finite at
        every logged step and its gradient norm at every step (the recipe's guard stops a run at a non-finite one;
        read from metrics.jsonl too when the recipe logs it)."""
        small = self.quick or not self.cuda
        end = time.monotonic() + self.limit(timeout)[0]
        assets = self.chat()
        (run_dir / "inputs").mkdir()
        pairs = {
            name: write_preference_pairs(assets[name], run_dir / "inputs" / f"{name}-pairs.jsonl")
            for name in ("train", "validation")
        }
        steps = 3 if small else DPO_STEPS
        log_every = "1" if small else "10"
        common = [RECIPES / "dpo.py", "--model", assets["model"], "--train_file", pairs["train"]]
        common += ["--validation_file", pairs["validation"], "--max_length", "1024", "--max_steps", str(steps)]
        common += ["--checkpoint_every", "0", "--eval_generate", "0", "--tracker", "none"]
        common += ["--cache_dir", run_dir / "datasets-cache"]
        common += [] if self.cuda else ["--mixed_precision", "no", "--num_workers", "0"]
        ways = {
            # chosen and rejected rows padding-free (varlen on a GPU), compiled blocks on a GPU
            "packed": ["--packing", "--log_every", log_every],
            # left-padded rows through sdpa with a mask, eagerly, as on the H100 where they went NaN
            "padded": ["--nocompile", "--log_every", "1"],
        }
        # TRL's DPOTrainer on the same model, pairs, batch, steps and device (one device only)
        trl_common = [sys.executable, DPO_BENCH, "trl_speed", "--model", assets["model"], "--train_file"]
        trl_common += [pairs["train"], "--max_steps", str(steps), "--max_length", "1024"]
        trl_common += ["--log_every", log_every, "--device", "cuda" if self.cuda else "cpu"]
        with_trl = self.gpus < 2 and importlib.util.find_spec("trl") is not None
        from accelerate_recipes.meter import peak_tflops  # torch: imported when a step runs, not for --help

        peak = peak_tflops(gpu_name()) if self.cuda else None
        shown, figures, problems = [], {}, []
        # the full fine-tune packed on a GPU; the CPU smoke and --quick keep to LoRA (the harness's paths)
        runs = ["lora", "trl-lora"] if with_trl else ["lora"]
        runs += ([] if small else ["full"]) + ["lora-padded"]
        for name in runs:
            method, out = name.removeprefix("trl-").removesuffix("-padded"), run_dir / name
            processes = max(self.gpus, 1)
            launch = self.launch("fsdp", self.gpus) if self.gpus >= 2 else self.single()
            # 8 pairs per GPU: 16 rows of ~450 tokens (prompt and answer) in each forward pass
            batch = ["--batch_size", str((2 if small else 8) * processes)]
            if name.startswith("trl-"):
                command = [*trl_common, *batch, "--lora_r", "16" if method == "lora" else "0", "--output_dir", out]
            else:
                lora = ["--lora_r", "16"] if method == "lora" else ["--precompute_ref"] if self.gpus >= 2 else []
                way = ways["padded" if name.endswith("-padded") else "packed"]
                command = [*launch, *common, *way, *batch, *lora, "--output_dir", out]
            shown.append(" ".join(map(str, command)))
            code, last = self.execute(command, run_dir, end - time.monotonic(), f"{name}.txt")
            results = read_json(out / "results.json")
            norms = []
            if name.startswith("trl-"):
                figures[name] = trl_figures(results, figures.get(method, {}), peak)
                losses = results.get("train_losses", [])
            else:
                figures[name] = dpo_figures(results, assets, peak, method)
                figures[name].update(
                    key_figures(results, "packing", "attn_implementation", "compile", "sdpa_backends_off")
                )
                losses, norms = logged(out, "train/loss"), logged(out, "train/grad_norm")
                figures[name]["finite"] = finite_figures(losses, norms)
            discard_weights(out)  # results.json read: the run's model and checkpoint are not needed
            if code != 0:
                problems.append(f"{name}: exit {code}{' (time limit)' if code == 124 else ''}; last lines:\n{last}")
                if code == 124:
                    break
            elif not losses or not all(math.isfinite(x) for x in losses):
                problems.append(f"{name}: no finite training loss in {out}: {losses}")
            elif not all(math.isfinite(x) for x in norms):
                problems.append(f"{name}: a non-finite gradient norm among {norms}")
            elif not results.get("peak_memory_mb"):
                problems.append(f"{name}: no peak_memory_mb in {out / 'results.json'}")
        if with_trl:  # the comparison first, as in the sft step
            figures = {"vs_trl": trl_comparison(figures), **figures}
        return ("fail" if problems else "pass"), shown, figures, "\n".join(problems)

    def grpo(self, run_dir, timeout):
        """recipes/grpo.py with a LoRA adapter on the sft step's model shape (tiny in --quick and on the CPU), a few
        steps on generated arithmetic prompts, then TRL's GRPOTrainer on the same model, prompts, completions per
        prompt, completion length and steps (benchmarks/grpo_bench.py trl: its own generate, no vLLM): generation
        tokens/s of the steady steps, the first step's generation seconds (the decode step's compilation), update
        tokens/s, median step and peak memory of each, side by side (figures["vs_trl"]). The weights are random, so
        the rewards stay zero: the figures are speed only (every completion runs to --max_new_tokens, and the update
        still makes its full forward and backward passes)."""
        small = self.quick or not self.cuda
        end = time.monotonic() + timeout
        assets = self.chat()
        (run_dir / "inputs").mkdir()
        prompts = {
            name: write_arithmetic_prompts(run_dir / "inputs" / f"{name}-prompts.jsonl", count, seed)
            for name, count, seed in (("train", 64, 0), ("validation", 4 if small else 8, 1))
        }
        # 8 prompts x 8 completions of 256 tokens per step on a GPU: 64 rows generated at once, then one update
        sizes = ["2", "2", "8", "2"] if small else ["8", "8", "256", "4"]
        command = [
            *self.single(),
            RECIPES / "grpo.py",
            "--model",
            assets["model"],
            "--train_file",
            prompts["train"],
            "--validation_file",
            prompts["validation"],
            "--reward",
            "number",
            "--lora_r",
            "16",
            *("--batch_size", sizes[0], "--num_generations", sizes[1], "--max_new_tokens", sizes[2]),
            *("--max_steps", sizes[3], "--max_prompt_length", "128", "--eval_num_samples", "0"),
            *("--log_every", "1", "--checkpoint_every", "0", "--tracker", "none"),
            *("--cache_dir", run_dir / "datasets-cache", "--output_dir", run_dir / "lora"),
        ]
        command += [] if self.cuda else ["--mixed_precision", "no"]
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
        elif not (results.get("generation_tokens_per_second") and results.get("train_tokens_per_second")):
            problems.append(f"no generation_tokens_per_second or train_tokens_per_second in {out / 'results.json'}")
        if importlib.util.find_spec("trl") is None:
            figures["vs_trl"] = "not run: trl not installed (pip install trl)"
        elif code != 124:  # a budget cut leaves no time for the peer
            trl = [sys.executable, GRPO_BENCH, "trl", "--model", assets["model"], "--train_file", prompts["train"]]
            trl += ["--batch_size", sizes[0], "--num_generations", sizes[1], "--max_new_tokens", sizes[2]]
            trl += ["--max_steps", sizes[3], "--lora_r", "16", "--lora_alpha", "32", "--save", "False"]
            trl += ["--device", "cuda" if self.cuda else "cpu", "--output_dir", run_dir / "trl-lora"]
            shown.append(" ".join(map(str, trl)))
            trl_code, trl_last = self.execute(trl, run_dir, end - time.monotonic(), "trl-lora.txt")
            figures["trl-lora"] = key_figures(read_json(run_dir / "trl-lora" / "results.json"), *GRPO_PEER_FIGURES)
            if trl_code != 0:
                problems.append(f"trl-lora: exit {trl_code}; last lines:\n{trl_last}")
            figures = {"vs_trl": grpo_comparison(figures["lora"], figures["trl-lora"]), **figures}
        if problems:
            return "fail", shown, figures, "\n".join(problems)
        return "pass", shown, figures, ""


def finite_figures(losses: list[float], norms: list[float]) -> dict:
    """What a run's metrics.jsonl says of its losses and gradient norms: how many steps logged a loss, and whether
    those and the logged gradient norms were finite. A run that logs no gradient norm had its norm checked at every
    step by the recipe's guard (accelerate_recipes/guard.py), which stops a run at the first non-finite one: a run
    that ended had none."""
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    grad_norm = (
        ("finite" if all(math.isfinite(x) for x in norms) else "not finite")
        if norms
        else "not logged; the recipe's guard checks it at every step"
    )
    return {"logged_steps": len(losses), "loss": "finite" if finite else "not finite", "grad_norm": grad_norm}


def write_preference_pairs(chats: Path, path: Path) -> Path:
    """Preference pairs from generated chats, in TRL's conversational form: the turns before a chat's last answer are
    the prompt, that answer is chosen and the next chat's last answer rejected."""
    conversations = [json.loads(line)["messages"] for line in Path(chats).read_text().splitlines()]
    rows = []
    for index, messages in enumerate(conversations):
        other = conversations[(index + 1) % len(conversations)][-1]
        if other["content"] != messages[-1]["content"]:
            rows.append({"prompt": messages[:-1], "chosen": messages[-1:], "rejected": [other]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_arithmetic_prompts(path: Path, count: int, seed: int) -> Path:
    """COUNT prompts whose answers the grpo recipe's `number` reward checks: sums and products of two numbers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        sign, answer = rng.choice([("+", a + b), ("x", a * b)])
        rows.append({"prompt": f"What is {a} {sign} {b}? Answer with the number only.", "answer": str(answer)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
