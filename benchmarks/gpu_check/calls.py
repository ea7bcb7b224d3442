"""One call of gpu-check: the machine recorded, the steps run in order of value within --budget, and the report
rewritten after every step, so that a call killed from outside still leaves every figure it reached."""

import importlib.util
import signal
import sys
import time
from pathlib import Path

from .machine import machine_facts
from .plan import ESTIMATED_SECONDS, NEXT_CALL, STEPS, TIMEOUTS, not_run, requirements
from .processes import Interrupted, interrupt
from .proof import proof_key, proven_steps
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
        """Each step's body by name: body(run_dir, timeout) -> (status, commands, figures, detail)."""
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
    """Run the CHOSEN steps (checked by the command line) on GPUS GPUs (0: the CPU smoke mode) within BUDGET seconds
    from STARTED, carrying what EARLIER (the report or proof --after names) proved; the exit status."""
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
    proven, differences = proven_steps(earlier, key) if earlier else ({}, [])
    if differences:
        print(f"note: --after {after} holds no proof for these GPUs and software ({'; '.join(differences)})")
    # steps proven before are carried into this report even when --steps names others, so the report says all it knows
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
    print(
        f"gpu-check: steps {', '.join(todo) or 'none'}"
        + (f" (estimated {sum(ESTIMATED_SECONDS[s] for s in todo) / 60:.1f} min)" if gpus else "")
        + (f"; proven before: {', '.join(proven)}" if proven else "")
        + f"; budget {budget:.0f} s; output {out}",
        flush=True,
    )
    stopped = False
    try:
        report()  # the machine first: a call that goes no further still says what it found
        for name in todo:
            left = check.deadline - time.monotonic()
            if left < 1:
                records[name] = not_run(name, f"{NEXT_CALL}: --budget spent")
            elif gpus and ESTIMATED_SECONDS[name] > left:
                records[name] = not_run(
                    name, f"{NEXT_CALL}: estimated {ESTIMATED_SECONDS[name]} s, {left:.0f} s of --budget left"
                )
            else:
                records[name] = check.step(name, bodies[name], TIMEOUTS[name])
                report()
    except Interrupted:
        stopped = True
        if check.results and records.get(check.results[-1]["step"]) is None:
            records[check.results[-1]["step"]] = check.results[-1]
    return print_summary(out, report(stopped), results)
