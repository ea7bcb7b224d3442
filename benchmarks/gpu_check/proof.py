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
PROOF_NEEDS = {"sft": ("vs_trl",), "dpo": ("vs_trl",), "grpo": ("vs_trl",)}


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


def proven_steps(earlier: dict, key: dict) -> tuple[dict[str, dict], list[str]]:
    """The passed step records of EARLIER (a report, or a proof file such as docs/gpu-proof.json) that hold for KEY,
    and, when none can, how EARLIER's GPUs or software differ from these. A record without the figures its step
    records now (PROOF_NEEDS: an sft proof from before the comparison with TRL) proves too little and is left out."""
    if "machines" in earlier:
        machine = next((m for m in earlier["machines"] if m["key"] == key), None)
        if machine is None:
            return {}, [f"no entry for {describe_key(key)}"]
        records = dict(machine["steps"])
    elif earlier.get("key") != key:
        theirs = earlier.get("key", {})
        return {}, [f"{k} {theirs.get(k)!r} there, {v!r} here" for k, v in key.items() if theirs.get(k) != v]
    else:
        records = {r["step"]: r for r in earlier.get("steps", []) if r["status"] == "pass"}
    return {name: r for name, r in records.items() if set(PROOF_NEEDS.get(name, ())) <= set(r["figures"])}, []


def describe_key(key: dict) -> str:
    devices = key["devices"]
    return (
        f"{len(devices)} x {devices[0] if devices else '?'}, torch {key['torch']}, CUDA {key['cuda']}, "
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
        "[benchmarks.md](benchmarks.md#proving-the-gpu-paths-make-gpu-check). The same in JSON: "
        "[gpu-proof.json](gpu-proof.json).",
        "",
    ]
    if not proof["machines"]:
        lines += [
            "**Nothing has been proven on a GPU yet.** Every figure of this project so far comes from CPUs "
            '([benchmarks.md](benchmarks.md#measured-figures)); each row of the README that says "not measured yet" '
            "waits for an entry here.",
        ]
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
            lines.append(f"| {name} | {r['wall_seconds']} | {figures or '-'} | {r.get('finished_at', '?')} |")
        lines += ["", "Commands:", ""]
        for name in proven:
            lines += [f"- {name}:", ""] + [f"      {c}" for c in machine["steps"][name]["commands"]] + [""]
    return "\n".join(lines).rstrip() + "\n"


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
        passed = {r["step"]: r for r in report["steps"] if r["status"] == "pass"}
        for name, record in passed.items():
            kept = {k: record.get(k) for k in ("commands", "wall_seconds", "figures", "detail", "finished_at")}
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
