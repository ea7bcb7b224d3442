"""One call of gpu-check: the machine recorded, the steps run in order of value within --budget (and
the free disk), and the report rewritten after every step, so that a call killed from outside still
leaves every figure it reached. Also --plan: the calls that would prove what is left, for the GPUs a
report recorded, printed without running any."""

import importlib.util
import json
import shutil
import signal
import sys
import time
from pathlib import Path

from accelerate_recipes.cli import RecipeError

from .machine import machine_facts
from .plan import (
    CALL_START,
    ESTIMATED_SECONDS,
    NEXT_CALL,
    SPEED_STEPS,
    STEPS,
    TIMEOUTS,
    describe_estimate,
    disk_refusal,
    estimate,
    not_run,
    plan_calls,
    requirements,
)
from .processes import Interrupted, interrupt
from .proof import (
    code_digests,
    describe_key,
    describe_stale,
    first_order,
    new_to_gpus,
    proof_key,
    proven_steps,
    stale_proofs,
)
from .report import RESULT_FILES, assess, print_summary, write_report
from .steps.chat import ChatSteps
from .steps.measurements import MeasurementSteps
from .steps.multi_gpu import MultiGpuSteps
from .steps.preemption import PreemptionSteps
from .steps.text import TextSteps
from .steps.vision import VisionSteps


class Check(ChatSteps, VisionSteps, MeasurementSteps, TextSteps, PreemptionSteps, MultiGpuSteps):
    """Every family of steps on one runner: what one call runs."""

    def bodies(self) -> dict:
        """Each step's body by name: body(run_dir, timeout) -> (status, commands, figures,
        detail)."""
        return {
            "sft": self.sft,
            "sft-speed-full": self.sft_speed("full"),
            "sft-speed-lora": self.sft_speed("lora"),
            "dpo": self.dpo,
            "grpo": self.grpo,
            "fast94": self.fast94,
            "text-fsdp": self.text_sharded("fsdp"),
            "detect-640": self.detect,
            "preempt": self.preempt,
            "bench": self.bench,
            "text-deepspeed": self.text_sharded("deepspeed"),
            "audit-cifar": self.audit("cifar"),
            "audit-text": self.audit("text"),
            "audit-detect": self.audit("detect"),
            "nccl-doctor": self.nccl_doctor,
            "ddp": self.ddp(sync_bn=False),
            "sync-bn": self.ddp(sync_bn=True),
            "allreduce": self.allreduce,
            "dp-vs-ddp": self.dp_vs_ddp,
        }


def run_call(
    out: Path,
    results: Path | None,
    chosen: list[str],
    earlier: dict | None,
    after: str | None,
    quick: bool,
    gpus: int,
    budget: float,
    started: float,
) -> int:
    """Run the CHOSEN steps (checked by the command line) on GPUS GPUs (0: the CPU smoke mode)
    within BUDGET seconds from STARTED, carrying what EARLIER (the report or proof --after names)
    proved; the exit status."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, interrupt)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("report.md", "report.json"):
        (out / stale).unlink(missing_ok=True)
    if results:
        results.mkdir(parents=True, exist_ok=True)
        for stale in RESULT_FILES:
            (results / stale).unlink(missing_ok=True)
    print(f"gpu-check: {gpus} GPU(s); recording the machine ...", flush=True)
    machine = machine_facts(gpus)
    mode = "gpu" if gpus else "cpu smoke"
    key = proof_key(mode, quick, machine)
    deepspeed = machine["deepspeed_import"]
    needs = requirements(
        gpus,
        None if deepspeed and deepspeed.startswith("ok") else deepspeed,
        tuple(p for p in ("peft", "datasets") if importlib.util.find_spec(p) is None),
    )
    digests = code_digests()  # the code this call's steps run: each record keeps its own
    proven, differences = proven_steps(earlier, key, machine, digests) if earlier else ({}, [])
    if differences:
        print(f"note: --after {after} holds no proof for these GPUs and software ({'; '.join(differences)})")
    stale = stale_proofs(earlier, key, machine, digests) if earlier else {}
    if stale:
        print(f"note: stale proofs in --after {after}, run again: {describe_stale(stale)}")
    # steps proven before are carried into this report even when --steps names others, so the report
    # says all it knows
    chosen = sorted(dict.fromkeys([*chosen, *proven]), key=STEPS.index)
    records: dict[str, dict | None] = {}
    for name in chosen:
        if name in proven:
            records[name] = {**proven[name], "step": name, "status": "pass", "carried": True}
        else:
            records[name] = not_run(name, needs[name]) if needs[name] else None
    check = Check(out, gpus, quick, started + budget)
    absent = {s: "not in --steps" for s in STEPS if s not in chosen}
    command = " ".join([Path(sys.executable).name, *sys.argv])

    def report(reached: bool = False) -> dict:
        """The report as it stands: the steps not run yet are left for the next call."""
        why = f"{NEXT_CALL}: not reached" + (" (gpu-check was stopped by a signal)" if reached else "")
        held = [records[name] or not_run(name, why) for name in chosen]
        whole = {
            **assess(held, absent),
            "mode": mode,
            "quick": quick,
            "key": key,
            "machine": machine,
            "code": digests,
            "command": command,
            "after": after,
            "started_at": machine["recorded_at"],
            "budget": budget,
            "wall_seconds": round(time.monotonic() - started, 1),
            "steps": held,
        }
        write_report(out, whole, results)
        return whole

    bodies = check.bodies()
    todo = [name for name in chosen if records[name] is None]
    # on GPUs, what no GPU has run yet comes first: a short call is worth most there
    todo = first_order(todo, earlier) if gpus else todo
    fits = plan_calls(todo, budget, gpus)[0][:1] if gpus else []
    print(
        f"gpu-check: steps {', '.join(todo) or 'none'}"
        + (
            f" (this call: {', '.join(fits[0]['steps'])}, estimated {fits[0]['seconds']:.0f} s)"
            if fits
            else ""
        )
        + (f"; proven before: {', '.join(proven)}" if proven else "")
        + f"; budget {budget:.0f} s; output {out}",
        flush=True,
    )
    stopped = False
    try:
        report()  # the machine first: a call that goes no further still says what it found
        for name in todo:
            left = check.deadline - time.monotonic()
            # what it takes now: the chat model built already
            # or not, the sft step's runs this call made
            guess = estimate(name, check._chat is not None, set(check.shared) if gpus == 1 else set())
            short_of_disk = disk_refusal(name, quick or not gpus, shutil.disk_usage(out).free, out)
            if left < 1:
                records[name] = not_run(name, f"{NEXT_CALL}: --budget spent")
            elif gpus and guess["seconds"] > left:
                records[name] = not_run(
                    name, f"{NEXT_CALL}: estimated {guess['seconds']:.0f} s, {left:.0f} s of --budget left"
                )
            elif short_of_disk:
                print(f"gpu-check: {name} not started: it {short_of_disk}", flush=True)
                records[name] = not_run(name, short_of_disk)
            else:
                records[name] = check.step(name, bodies[name], TIMEOUTS[name])
                records[name]["code"] = digests[name]
                if gpus:  # beside the measured time: what the next estimate is corrected from
                    records[name]["estimate"] = guess
                report()
    except Interrupted:
        stopped = True
        if check.results and records.get(check.results[-1]["step"]) is None:
            records[check.results[-1]["step"]] = check.results[-1]
    return print_summary(out, report(stopped), results)


def read_machine(path: str) -> dict:
    """--machine PATH: the machine a report.json (or its folder) recorded, or a machine's record
    alone (a report's "machine": devices, nvidia_smi, versions)."""
    file = Path(path)
    file = file / "report.json" if file.is_dir() else file
    try:
        facts = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecipeError(
            f"--machine {path}: {type(err).__name__}; give the report.json of a call on the GPUs to plan "
            "for, or no --machine on the GPU machine itself"
        ) from None
    facts = facts.get("machine", facts)
    if not isinstance(facts, dict) or not {"devices", "gpus", "torch"} <= set(facts) or not facts["gpus"]:
        raise RecipeError(
            f"--machine {path} holds no GPU machine's record (devices, gpus, torch); give the report.json of "
            "a call on the GPUs to plan for"
        )
    return facts


def print_plan(machine: dict, earlier: dict, source: str, chosen: list[str], budget: float) -> int:
    """--plan: for the GPUs and software of MACHINE, the calls of BUDGET seconds that prove what
    EARLIER (a proof file or report, named SOURCE) has not proven yet of CHOSEN, each step with its
    estimate part by part."""
    gpus = machine["gpus"]
    key = proof_key("gpu", False, machine)
    proven, differences = proven_steps(earlier, key, machine)
    deepspeed = machine.get("deepspeed_import")
    packages = machine.get("packages", {})
    needs = requirements(
        gpus,
        None if deepspeed and deepspeed.startswith("ok") else deepspeed or "deepspeed not installed",
        tuple(p for p in ("peft", "datasets") if not packages.get(p)),
    )
    todo = first_order([name for name in chosen if name not in proven and not needs[name]], earlier)
    calls, unfit = plan_calls(todo, budget, gpus)
    print(f"gpu-check plan for {describe_key(key)}; {'; '.join(machine.get('nvidia_smi', []))}")
    print(f"calls of --budget {budget:.0f} s, after {source}")
    if differences:
        print(f"nothing of {source} holds here: {'; '.join(differences)}")
    by_gpus: dict[str | None, list[str]] = {}
    for name, record in proven.items():
        if name in chosen:
            by_gpus.setdefault(record.get("proven_on"), []).append(name)
    for where, names in by_gpus.items():
        alike = " (the same compute capability and software, no more memory than these)"
        print(f"proven on {where or 'these GPUs'}{alike if where else ''}: {', '.join(names)}")
    again = {name: why for name, why in stale_proofs(earlier, key, machine).items() if name in todo}
    if again:
        print(f"stale, so run again: {describe_stale(again)}")
    new = [name for name in new_to_gpus(earlier) if name in todo]
    if new:
        print(f"never run on a GPU with their defaults, so first: {', '.join(new)}")
    if not todo:
        print("nothing left to prove that these GPUs can run")
    for number, call in enumerate(calls, 1):
        print(
            f"call {number}: {', '.join(call['steps'])}: estimated {call['seconds']:.0f} s of {budget:.0f} "
            f"(start {CALL_START} s)"
        )
        for name, guess in call["steps"].items():
            taken = [way for way in ("compiled", "trl") if name in SPEED_STEPS and way not in guess["parts"]]
            taken = f"; {' and '.join(taken)}: the sft step's runs of this call" if taken else ""
            print(f"  {name:15} {describe_estimate(guess)}{taken}")
    if unfit:
        print(
            f"in no call of {budget:.0f} s: "
            + ", ".join(f"{n} (estimated {ESTIMATED_SECONDS[n]:.0f} s)" for n in unfit)
        )
    cannot = [f"{name} ({needs[name]})" for name in chosen if needs[name] and name not in proven]
    if cannot:
        print(f"not on these GPUs: {', '.join(cannot)}")
    if calls:
        print(
            f"each call: python3 benchmarks/gpu_check --after docs/gpu-proof.json --budget {budget:.0f} "
            "--results_dir "
            '"$OUT"; then python3 benchmarks/gpu_check --merge OUT/report.json before the next'
        )
    return 0
