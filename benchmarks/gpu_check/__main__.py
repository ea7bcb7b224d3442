"""One command that proves the GPU paths on whatever NVIDIA GPUs this machine has, and writes a
report.

    make gpu-check                                        # every step that fits in one call of 9 minutes
    # only what is not yet proven on these GPUs and software; report and logs into DIR
    python benchmarks/gpu_check --after docs/gpu-proof.json --results_dir DIR
    python benchmarks/gpu_check --merge DIR/report.json   # fold a report into docs/gpu-proof.md and .json
    python benchmarks/gpu_check --steps sft,fast94        # some steps only
    python benchmarks/gpu_check --device cpu --quick      # the harness itself: tiny sizes, gloo CPU processes
    # the calls that would prove what is left for the GPUs REPORT recorded, each step's estimate part
    # by part
    python benchmarks/gpu_check --plan --machine REPORT --budget 540

It runs from a plain checkout: an interpreter that holds torch, accelerate and transformers is
enough (this package need not be installed); the checkout's own modules are put first on every
step's PYTHONPATH.

One call is made to fit a short GPU allocation (15 minutes, a command limited to 10): --budget
defaults to 510 s, so that the call, report included, ends within 9 minutes. It first records the
machine (GPUs, driver, Python and package versions, /dev/shm, make, gcc, nvcc), then runs the steps
in order of value, each a subprocess with its own time limit and a fresh folder under
OUTPUT_DIR/<step>/, and rewrites OUTPUT_DIR/report.md and report.json after every step, so that a
call killed from outside still leaves every figure it reached; with --after, the steps no GPU has
run with their defaults yet come first (dpo and grpo, until a GPU proves them). A step whose
estimated time no longer fits is left for the next call (each estimate adds up its runs' measured
parts: launch, compilation, steps, evaluation, saving; the report records it beside the measured
time, and each command's time with its parts); a step whose disk needs exceed the free disk is not
run, said in one line; a running step that the budget cuts short is stopped (SIGTERM to its
launcher, so that the recipes save a checkpoint, then its whole process tree) and reported as
incomplete, with the figures it reached. The runs measure and keep no weights: once a run's
results.json is read its checkpoints and models are removed. --after REPORT skips the steps that
REPORT (or docs/gpu-proof.json) already proved with the same software on the same GPUs, or on as
many GPUs of the same compute capability with no more memory each (an H100's proof holds on an H200)
but for the speed steps, whose figures are each GPU's own; so calls add up until every step is
proven. A proof holds for the code it ran: each step's record keeps a digest of the files the step
runs (proof.py STEP_FILES), and a step whose files changed since, or whose proof has no digest, runs
again. --plan --machine REPORT prints those calls for the GPUs REPORT recorded, and runs nothing.

Steps, in the order they run:
  sft          recipes/sft.py, LoRA and full, packed, on a chat model of Qwen2.5-0.5B's shape built
               here: tokens/s, peak memory against the recipe's memory plan, MFU. On a GPU it first
               runs benchmarks/packed_attention_check.py: the varlen attention's losses against
               sdpa's dense mask on the same packed rows (bf16, mean loss within 1%) and each one's
               milliseconds per row. On one device each run is followed by TRL's SFTTrainer on the
               same model, conversations, batch and steps (trl_speed of benchmarks/sft_bench.py:
               padding-free rows, fused AdamW, Liger Kernel when it imports), and the figures put
               the two side by side: tokens/s and their ratio, MFU from the recipe's FLOPs per
               token, peak memory. Then, on one GPU, LoRA under fsdp.yaml on one process (FSDP2
               unsharded: bf16 frozen base, fp32 adapter, the adapter gathered on save); on one GPU
               also LoRA in padded rows, as `make sft-1gpu` trains (compiled blocks); with 2+ GPUs
               LoRA and full under FSDP2 on all of them, without TRL
  dpo          recipes/dpo.py on pairs built from the same generated chats and model, both ways its
               rows go: left-padded with the recipe's defaults, as `make dpo-1gpu` trains (sdpa with
               a mask: the path that went NaN on an H100 under cuDNN's kernel, kept off since; on a
               GPU compiled blocks and the --eval_generate answers through the compiled decode),
               LoRA, every step logged, followed by TRL's DPOTrainer on the same model, pairs, batch
               and steps (trl_speed of benchmarks/dpo_bench.py, under the same sdpa kernels; side by
               side as in the sft step, figures["vs_trl"]); then packed (--packing: chosen and
               rejected rows padding-free), in full on a GPU (a frozen copy as reference), LoRA on
               the CPU: tokens/s, peak memory, MFU, and each run's loss and gradient norm finite
  grpo         recipes/grpo.py, LoRA, a few steps on the same model shape with arithmetic prompts
               whose lengths span three buckets of the static cache, its defaults but for the sizes
               (on a GPU its compiled decode step, --decode auto), then TRL's GRPOTrainer on the
               same inputs (benchmarks/grpo_bench.py trl): generation tokens/s of the steady steps,
               the first step's generation seconds, update tokens/s, median step and peak memory
               side by side (speed only: the random weights earn no reward)
  The chat runs' figures carry how often their compiled paths compiled (compile_graphs,
  decode_graphs, ... of results.json); a run whose compiled blocks or decode fell back to eager
  fails its step: it proved the eager path
  sft-speed-full, sft-speed-lora   recipes/sft.py in full and with LoRA r16 on the sft step's model
               and chats, on one GPU: compiled at 16 conversations a step, compiled in rows of
               16,384 tokens (--batch_tokens, within one epoch) and TRL's SFTTrainer at 16
               conversations: tokens/s and MFU side by side, each over the default's, the fastest
               and the fastest over TRL (figures["speed"]). The compiled and TRL runs are the sft
               step's own: after it in the same call they are taken from it, not run again. On the
               CPU: eager and rows of 2,048 tokens
  fast94       recipes/cifar.py --preset fast94 on 50,000 generated CIFAR-sized images: epoch time,
               accuracy
  text-fsdp    recipes/text_classification.py with accelerate_configs/fsdp.yaml on all GPUs (a small
               BERT built here); on one GPU it runs unsharded (world size 1, no NCCL traffic): the
               FSDP code path, not sharding
  detect-640   recipes/detect/train.py at 640 px on generated shapes
  preempt      a CIFAR run stopped by SIGTERM (exit 75, checkpoint) and resumed with --resume auto
               to the end
  bench        benchmarks/bench.py (what `make bench` runs): recipe vs article loop vs bare loop,
               --compile, MFU
  text-deepspeed   the text recipe with deepspeed.yaml (ZeRO-3) when deepspeed imports; unsharded on
               one GPU; its CUDA ops build at first use (nvcc and ninja), which its estimate
               includes
  audit-cifar, audit-text, audit-detect   benchmarks/host_reads.py on each recipe, under CUDA sync
               debug mode: no host read and no synchronisation between log steps
  with 2+ GPUs:
  nccl-doctor  two `python -m recipe_tools.doctor` processes playing two nodes of one GPU each:
               rendezvous, gloo and an NCCL all-reduce between two GPUs
  ddp, sync-bn, allreduce, dp-vs-ddp   2gpu.yaml on all GPUs, --sync_bn, `make allreduce-<N>gpu`,
               and torch's DataParallel against DDP (benchmarks/scaling.py gpu:1,gpu:N,dp:N)
Nothing is downloaded: data is generated, the text model is built here (all-MiniLM-L6-v2 when its
package is installed), the chat model and its tokenizer too.

The verdict of a report:
  PASS        every step passed (in this call or, with --after, an earlier one)
  PARTIAL     nothing failed or was cut, but some steps could not run here (2+ GPUs, deepspeed,
              CUDA) or were left out of --steps, or ran unsharded on one process: the report names
              them
  INCOMPLETE  the budget cut a step short or left steps for the next call: run again with --after
              OUTPUT_DIR/report.json
  FAIL        a step failed
The exit status is 0 for PASS and PARTIAL, 1 for FAIL and INCOMPLETE, 2 for a usage error or no GPU
(and no --device cpu).
"""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
# Run as a folder (python3 benchmarks/gpu_check), Python puts this package's own folder first on the
# path, which would expose its modules as top-level ones (`report`, `text`): it goes, and the
# checkout and benchmarks/ come first, so that a plain checkout finds the project's packages without
# installing them, and this package beside chat_assets.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]
sys.path[:0] = [str(BENCHMARKS.parent), str(BENCHMARKS)]


import time

from accelerate_recipes.cli import RecipeError, run
from gpu_check.calls import print_plan, read_machine, run_call
from gpu_check.paths import REPO
from gpu_check.plan import DEFAULT_BUDGET, STEPS
from gpu_check.proof import PROOF, merge_reports, read_earlier


def main(
    device: str = "auto",
    quick: bool = False,
    steps: str | None = None,
    after: str | None = None,
    merge: str | None = None,
    proof: str | None = None,
    output_dir: str = "outputs/gpu-check",
    results_dir: str | None = None,
    budget: float = DEFAULT_BUDGET,
    plan: bool = False,
    machine: str | None = None,
):
    """Run the GPU paths of the project on this machine's GPUs, in order of value, and write
    OUTPUT_DIR/report.md and report.json after every step.

    The verdict: PASS (every step passed), PARTIAL (nothing failed, but the report names steps that
    did not run
    here: 2+ GPUs, deepspeed or CUDA missing, steps left out of --steps, and sharded paths on one
    GPU, which run unsharded), INCOMPLETE (the budget cut a step short or left steps for the next
    call), FAIL. Exit status 0 for PASS and PARTIAL, 1 for INCOMPLETE and FAIL, 2 without a GPU
    (unless --device cpu) or for a wrong flag.

    Args:
        device: auto (all visible NVIDIA GPUs; exit 2 when there are none) or cpu (the same
            orchestration on gloo CPU processes with tiny sizes; steps that need CUDA are reported
            as not run).
        quick: tiny sizes everywhere (seconds per step), to check the harness rather than the
            hardware.
        steps: comma-separated subset of: sft, dpo, grpo, fast94, text-fsdp, detect-640, preempt,
            bench, text-deepspeed, audit-cifar, audit-text, audit-detect, nccl-doctor, ddp, sync-bn,
            allreduce, dp-vs-ddp (the order they run in, most valuable first); default all. sft
            includes the comparison with TRL's SFTTrainer on the same GPU (needs trl; Liger Kernel
            is used when it imports).
        after: an earlier call's report.json (or its folder), or docs/gpu-proof.json: the steps it
            proved on GPUs of the same kind and count with the same torch, CUDA, accelerate,
            transformers and peft, on the code this checkout has, are not run again but carried into
            this report, so that calls of a few minutes each add up to the whole check; the steps no
            GPU has run with their defaults run first.
        merge: report.json files (comma-separated, or their folders) to fold into --proof: the steps
            they proved, per GPU kind and software, with driver, versions and commands; runs no step
            and needs no GPU.
        proof: the proof file --merge writes, with its markdown beside it (default
            docs/gpu-proof.json; it takes reports of GPU calls only).
        output_dir: where the report and one fresh folder per step go.
        results_dir: a folder that receives, after every step, only report.md, report.json and
            logs.tar.gz (the steps' logs and small result files, no model or checkpoint): what to
            keep of a machine that goes away.
        budget: seconds for the steps of this call (default 510: with the stop of a cut step and the
            report, the call ends within 9 minutes). On a GPU a step starts only if its estimated
            time fits in what is left (else it is left for the next call); a running step is stopped
            when the budget ends and reported as incomplete. A step also starts only with the free
            disk it writes at once (the models it writes are removed once read); else it is not run,
            said in one line.
        plan: print the calls of --budget seconds that would prove what --after (default
            docs/gpu-proof.json) has not proven yet for the GPUs and software of --machine, each
            step's estimate part by part (launch, compilation, steps, evaluation, saving), and run
            nothing. Proof made on other GPUs of the same compute capability, with as much memory
            and the same software, counts, but for the speed steps.
        machine: with --plan, the report.json (or its folder) of a call on the GPUs to plan for;
            default this machine's own GPUs.
    """
    started = time.monotonic()
    out = Path(output_dir)
    if merge is not None:
        reports = [r.strip() for r in str(merge).split(",") if r.strip()]
        if not reports or merge is True:
            raise RecipeError(
                "--merge needs the report.json files to fold in, e.g. --merge outputs/gpu-check"
            )
        sys.exit(merge_reports(reports, Path(proof) if proof else PROOF))
    if proof is not None:
        raise RecipeError("--proof names where --merge writes; give it together with --merge REPORT")
    if device not in ("auto", "cpu"):
        raise RecipeError(f"unknown --device {device!r}; choose auto (the GPUs) or cpu (harness smoke run)")
    chosen = STEPS if steps is None else [s.strip() for s in str(steps).split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        raise RecipeError(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    chosen = sorted(dict.fromkeys(chosen), key=STEPS.index)
    budget = float(budget)
    if budget <= 0:
        raise RecipeError(f"--budget {budget:g} must be a positive number of seconds")
    if machine is not None and not plan:
        raise RecipeError("--machine names the GPUs --plan plans for; give it together with --plan")
    if plan:
        source = after or str(PROOF.relative_to(REPO))
        earlier = read_earlier(after or str(PROOF))
        if machine is None:
            import torch

            from gpu_check.machine import machine_facts

            if not torch.cuda.device_count():
                raise RecipeError(
                    "--plan plans for this machine's GPUs without --machine, and torch sees none here; give "
                    "--machine REPORT, the report.json of a call on the GPUs to plan for"
                )
            facts = machine_facts(torch.cuda.device_count())
        else:
            facts = read_machine(str(machine))
        sys.exit(print_plan(facts, earlier, source, chosen, budget))
    results = Path(results_dir) if results_dir else None
    if results and results.resolve() == out.resolve():
        raise RecipeError(
            "--results_dir must be another folder than --output_dir: it receives the report and logs only"
        )
    earlier = read_earlier(after) if after else None
    import torch

    gpus = torch.cuda.device_count()
    if device == "auto" and not gpus:
        raise RecipeError(
            "no NVIDIA GPU visible to torch here (torch.cuda.device_count() == 0); gpu-check proves "
            "the GPU paths, run it on a GPU machine (or try the harness with --device cpu --quick)"
        )
    if device == "cpu":
        gpus = 0
    sys.exit(run_call(out, results, chosen, earlier, after, quick, gpus, budget, started))


if __name__ == "__main__":
    run(main)
