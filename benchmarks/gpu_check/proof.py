"""What a report proves: the GPUs and software its steps hold for (its key), which earlier proofs --after carries
into a call, and --merge, which folds reports into docs/gpu-proof.json and .md."""

import json
import re
from pathlib import Path

from accelerate_recipes.cli import RecipeError

from .paths import REPO
from .plan import STEPS
from .report import compact, write_text
from .run_outputs import read_json

PROOF = REPO / "docs" / "gpu-proof.json"  # what has been proven on GPUs so far; docs/gpu-proof.md beside it
# The figures a step's proof must hold to be carried by --after: a step whose check grew is run again.
PROOF_NEEDS = {"sft": ("vs_trl",), "dpo": ("vs_trl", "lora-padded"), "grpo": ("vs_trl",)}
# The steps whose figures are the GPU's own (speed): re-measured on every kind of GPU, never carried to another.
PER_GPU = ("sft-speed-full", "sft-speed-lora", "bench")
SOFTWARE = ("torch", "cuda", "accelerate", "transformers", "peft")  # what a proof's key holds besides the GPUs


def proof_key(mode: str, quick: bool, machine: dict) -> dict:
    """What a proof holds for: the GPUs (kind and count) and the software the steps ran with."""
    packages = machine.get("packages", {})
    return {
        "mode": mode,
        "quick": quick,
        "devices": machine["devices"],
        **{name: machine.get(name) for name in ("torch", "cuda", "accelerate", "transformers")},
        "peft": packages.get("peft"),
    }


def gpus_of(machine: dict) -> list[tuple[str, float, str]]:
    """Each GPU's (name, memory in MiB, compute capability) from the rows nvidia-smi gave the machine's record
    ("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 9.0"); none where a row does not read so."""
    gpus = []
    for row in machine.get("nvidia_smi") or []:
        fields = [f.strip() for f in row.split(",")]
        try:
            gpus.append((fields[0], float(fields[2].split()[0]), fields[3]))
        except (IndexError, ValueError):
            return []
    return gpus


def carry_refusal(theirs: dict, machine_there: dict, key: dict, machine: dict | None) -> str | None:
    """Why a proof made under the key THEIRS on the machine MACHINE_THERE does not hold under KEY on MACHINE (one
    line), or None when it does. It holds on the same GPUs and software, and, for the steps whose figures are not the
    GPU's own, on as many GPUs of the same compute capability with at least as much memory each and the same
    software (an H100 80GB's proof holds on an H200: both Hopper, sm_90)."""
    if theirs == key:
        return None
    fields = ("mode", "quick", *SOFTWARE)
    differ = [f"{k} {theirs.get(k)!r} there, {key.get(k)!r} here" for k in fields if theirs.get(k) != key.get(k)]
    if differ:
        return "; ".join(differ)
    there, here = gpus_of(machine_there), gpus_of(machine or {})
    if key.get("mode") != "gpu" or not there or not here:
        return f"{describe_devices(theirs)} there, {describe_devices(key)} here"
    if len(there) != len(here):
        return f"{len(there)} GPU(s) there, {len(here)} here"
    for (name, memory, capability), (name_here, memory_here, capability_here) in zip(there, here):
        if capability != capability_here:
            return f"{name} (compute capability {capability}) there, {name_here} ({capability_here}) here"
        if memory_here < memory:
            return f"{name} ({memory:.0f} MiB) there, {name_here} with less memory ({memory_here:.0f} MiB) here"
    return None


def holding(earlier: dict, key: dict, machine: dict | None = None) -> tuple[list[tuple[dict, bool]], list[str]]:
    """The entries of EARLIER (a proof file's machines, or a report as one) whose proof holds for KEY on MACHINE,
    each with whether its GPUs are these (else only the steps whose figures are not per GPU hold), the same GPUs
    first; and why each other entry does not hold."""
    if "machines" in earlier:
        entries = earlier["machines"]
    else:
        records = {r["step"]: r for r in earlier.get("steps", []) if r["status"] == "pass"}
        entries = [{"key": earlier.get("key", {}), "machine": earlier.get("machine", {}), "steps": records}]
    held, refusals = [], []
    for entry in sorted(entries, key=lambda e: e["key"] != key):
        why = carry_refusal(entry["key"], entry.get("machine", {}), key, machine)
        if why:
            refusals.append(why)
        else:
            held.append((entry, entry["key"] == key))
    return held, refusals


def proven_steps(earlier: dict, key: dict, machine: dict | None = None) -> tuple[dict[str, dict], list[str]]:
    """The passed step records of EARLIER (a report, or a proof file such as docs/gpu-proof.json) that hold for KEY on
    MACHINE (its record, with nvidia-smi's rows), and, when none can, why EARLIER's GPUs or software do not hold here.
    A proof made on other GPUs of the same compute capability, with as much memory and the same software, holds too,
    but for the steps whose figures are per GPU (PER_GPU); such a record names the GPUs it was proven on
    ("proven_on"). A record without the figures its step records now (PROOF_NEEDS: an sft proof from before the
    comparison with TRL) proves too little and is left out."""
    held, refusals = holding(earlier, key, machine)
    proven: dict[str, dict] = {}
    for entry, same in held:
        for name, record in entry["steps"].items():
            if name in proven or (not same and name in PER_GPU):
                continue
            if set(PROOF_NEEDS.get(name, ())) <= set(record["figures"]):
                proven[name] = record if same else {"proven_on": describe_devices(entry["key"]), **record}
    if proven or not refusals:
        return proven, []
    return {}, [f"no entry for {describe_key(key)}"] if "machines" in earlier else refusals


def proven_too_little(earlier: dict, key: dict, machine: dict | None = None) -> list[str]:
    """The steps EARLIER proved for KEY on MACHINE before they recorded what they record now (PROOF_NEEDS): they run
    again."""
    held, _ = holding(earlier, key, machine)
    proven = proven_steps(earlier, key, machine)[0]
    stale = {
        name for entry, same in held for name in entry["steps"] if name not in proven and (same or name not in PER_GPU)
    }
    return [name for name in STEPS if name in stale]


def describe_devices(key: dict) -> str:
    devices = key.get("devices") or []
    return f"{len(devices)} x {devices[0] if devices else '?'}"


def describe_key(key: dict) -> str:
    return (
        f"{describe_devices(key)}, torch {key['torch']}, CUDA {key['cuda']}, "
        f"accelerate {key['accelerate']}, transformers {key['transformers']}, peft {key['peft']}"
        + (" (--quick)" if key.get("quick") else "")
        + (f" ({key['mode']})" if key.get("mode") != "gpu" else "")
    )


def read_earlier(path: str) -> dict:
    """--after PATH: a report.json of an earlier call (or its folder), or a proof file."""
    file = Path(path)
    file = file / "report.json" if file.is_dir() else file
    if not file.is_file():
        raise RecipeError(
            f"--after {path} not found: give the report.json an earlier call wrote (OUTPUT_DIR/report.json or "
            f"RESULTS_DIR/report.json), or {PROOF.relative_to(REPO)}"
        )
    try:
        earlier = json.loads(file.read_text())
        earlier["machines"] if "machines" in earlier else (earlier["key"], earlier["steps"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise RecipeError(
            f"--after {path} is neither a gpu-check report nor a proof file ({type(err).__name__}: {err}); give the "
            "report.json that gpu-check wrote"
        ) from None
    return earlier


PROOF_ABOUT = (
    "What has run on a GPU: every step of `make gpu-check` that passed on real GPUs, per kind of GPU and software, "
    "with the driver, the versions and the command of each figure. Only `python benchmarks/gpu_check --merge "
    "REPORT` writes it, from the report.json of a call on GPUs."
)


def markdown_proof(proof: dict) -> str:
    lines = [
        "# GPU proof",
        "",
        PROOF_ABOUT + " The command for a 15-minute GPU allocation, and how calls add up: "
        "[benchmarks.md](benchmarks.md#proving-the-gpu-paths-make-gpu-check). What is left to prove on some GPUs, "
        "in calls of a budget, each step's estimate part by part: `python3 benchmarks/gpu_check --plan --machine "
        "REPORT --budget 540` for the GPUs and software REPORT (a call's report.json) recorded "
        "([the call plan](benchmarks.md#calls-estimates-and-what-carries)). The same in JSON: "
        "[gpu-proof.json](gpu-proof.json).",
        "",
    ]
    if not proof["machines"]:
        lines += [
            "**Nothing has been proven on a GPU yet.** Every figure of this project so far comes from CPUs "
            '([benchmarks.md](benchmarks.md#measured-figures)); each row of the README that says "not measured yet" '
            "waits for an entry here.",
        ]
    if proof["machines"]:
        lines += [
            "## Which GPUs proved each step, and where it holds",
            "",
            "A step proven on some GPUs holds on as many GPUs of the same compute capability with at least as much "
            "memory each and the same torch, CUDA, accelerate, transformers and peft (an H100 80GB's proof holds on "
            "an H200: both Hopper, sm_90), and `--after` carries it there; its figures stay those of the GPUs that "
            f"made them. The speed steps ({', '.join(PER_GPU)}) hold on the GPUs that measured them only: their "
            "figures are those GPUs' own, so every kind of GPU measures them again.",
            "",
            "| step | proven on | when | holds on |",
            "|---|---|---|---|",
        ]
        for name in STEPS:
            for machine in proof["machines"]:
                if name in machine["steps"]:
                    record = machine["steps"][name]
                    lines.append(
                        f"| {name} | {describe_devices(machine['key'])} | {record.get('finished_at') or '?'} | "
                        f"{holds_on(name, machine, record)} |"
                    )
        lines.append("")
    for machine in proof["machines"]:
        key, m = machine["key"], machine["machine"]
        proven = [s for s in STEPS if s in machine["steps"]]
        lines += [
            f"## {describe_key(key)}",
            "",
            f"Driver and GPUs: {'; '.join(m.get('nvidia_smi', [])) or '-'}; Python {m.get('python')}; "
            f"deepspeed {m.get('deepspeed_import') or 'not installed'}; host {m.get('host')}.",
            "",
            f"Proven: {', '.join(proven) or 'nothing'}. Not yet: "
            f"{', '.join(s for s in STEPS if s not in proven) or 'nothing'}.",
            "",
            "| step | seconds | key figures | proven |",
            "|---|---:|---|---|",
        ]
        for name in proven:
            r = machine["steps"][name]
            figures = "; ".join(f"{k}: {compact(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",))
            lines.append(f"| {name} | {r['wall_seconds']} | {figures or '-'} | {r.get('finished_at') or '?'} |")
        lines += ["", "Commands:", ""]
        for name in proven:
            lines += [f"- {name}:", ""] + [f"      {c}" for c in machine["steps"][name]["commands"]] + [""]
    return "\n".join(lines).rstrip() + "\n"


def holds_on(name: str, machine: dict, record: dict) -> str:
    """Where the proof of step NAME in a proof file's MACHINE entry holds (proven_steps' rule), in words."""
    missing = [need for need in PROOF_NEEDS.get(name, ()) if need not in record["figures"]]
    if missing:
        return f"nowhere now: it has no {', '.join(missing)}, which the step records since; it runs again"
    if name in PER_GPU:
        return f"{describe_devices(machine['key'])} only (its figures are per GPU)"
    gpus = gpus_of(machine["machine"])
    if not gpus:
        return f"{describe_devices(machine['key'])}, with this software"
    memory = min(memory for _, memory, _ in gpus)
    capabilities = sorted({capability for _, _, capability in gpus})
    count = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
    return (
        f"{count} of compute capability {', '.join(capabilities)} with {memory:.0f} MiB or more each, with the "
        "software of its section below"
    )


# A path into the project as the GPU machine wrote it (`./recipes/...`, `/its/checkout/recipes/...`).
PROJECT_PATH = re.compile(r"(?<!\S)\S*?/(?=(?:recipes|benchmarks|accelerate_configs|tests)/)")


def portable_command(command: str, executable: str | None) -> str:
    """COMMAND as a user types it from the project's root: `accelerate launch` and `python3` instead of the GPU
    machine's interpreter, and paths into the project relative to its root."""
    if executable:
        command = command.replace(f"{executable} -m accelerate.commands.accelerate_cli ", "accelerate ")
        command = re.sub(rf"(?<!\S){re.escape(executable)}(?!\S)", "python3", command)
    return PROJECT_PATH.sub("", command)


def merge_reports(reports: list[str], proof_path: Path) -> int:
    """Fold the passed steps of REPORTS into PROOF_PATH (JSON) and the markdown beside it; runs no step, needs no
    GPU. A later proof of a step on the same GPUs and software replaces the earlier one."""
    proof = read_json(proof_path) or {"about": PROOF_ABOUT, "machines": []}
    for given in reports:
        path = Path(given) / "report.json" if Path(given).is_dir() else Path(given)
        if not path.is_file():
            raise RecipeError(f"--merge {given}: not found; give the report.json that a gpu-check call wrote")
        report = json.loads(path.read_text())
        if not {"key", "machine", "steps"} <= set(report):
            raise RecipeError(
                f"--merge {given} is not a gpu-check report (no key, machine and steps); give report.json"
            )
        if report["key"]["mode"] != "gpu" and proof_path.resolve() == PROOF.resolve():
            raise RecipeError(
                f"--merge {given} is a CPU smoke report (--device cpu); {PROOF.relative_to(REPO)} holds GPU proof "
                "only: merge it elsewhere with --proof OTHER.json"
            )
        machine = next((m for m in proof["machines"] if m["key"] == report["key"]), None)
        if machine is None:
            machine = {"key": report["key"], "machine": report["machine"], "steps": {}}
            proof["machines"].append(machine)
        # only what this report's own GPUs proved: the records it carried are folded in where they were proven
        passed = {r["step"]: r for r in report["steps"] if r["status"] == "pass" and not r.get("carried")}
        for name, record in passed.items():
            kept = {k: record.get(k) for k in ("commands", "wall_seconds", "figures", "detail", "finished_at")}
            kept.update({k: record[k] for k in ("estimate", "timing") if record.get(k)})
            kept["commands"] = [portable_command(c, report["machine"].get("executable")) for c in kept["commands"]]
            machine["steps"][name] = {**kept, "host": record.get("host", report["machine"]["host"])}
        machine["steps"] = {s: machine["steps"][s] for s in STEPS if s in machine["steps"]}
        for record in machine["steps"].values():  # proofs merged before commands were made portable
            record["commands"] = [portable_command(c, machine["machine"].get("executable")) for c in record["commands"]]
        print(f"gpu-check: {len(passed)} proven step(s) of {path} for {describe_key(report['key'])}", flush=True)
    proof_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(proof_path, json.dumps(proof, indent=2) + "\n")
    write_text(proof_path.with_suffix(".md"), markdown_proof(proof))
    print(f"saved {proof_path} and {proof_path.with_suffix('.md')}")
    return 0
