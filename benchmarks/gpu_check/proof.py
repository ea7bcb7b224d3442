"""What a report proves: the GPUs and software its steps hold for (its key) and the code each step
ran (its digest), which earlier proofs --after carries into a call, which steps no GPU has run yet
(a call runs them first), and --merge, which folds reports into docs/gpu-proof.json and .md."""

import hashlib
import json
import re
from pathlib import Path

from accelerate_recipes.cli import RecipeError

from .paths import REPO
from .plan import STEPS
from .report import compact, write_text
from .run_outputs import read_json

# what has been proven on GPUs so far; docs/gpu-proof.md beside it
PROOF = REPO / "docs" / "gpu-proof.json"
# The figures a step's proof must hold to be carried
# by --after: a step whose check grew is run again.
PROOF_NEEDS = {"sft": ("vs_trl",), "dpo": ("vs_trl", "lora-padded"), "grpo": ("vs_trl",)}
# The steps whose figures are the GPU's own (speed):
# re-measured on every kind of GPU, never carried to another.
PER_GPU = ("sft-speed-full", "sft-speed-lora", "bench")
# what a proof's key holds besides the GPUs
SOFTWARE = ("torch", "cuda", "accelerate", "transformers", "peft")
# The GPU defaults a step runs that an older proof of it may not show, as (run, figure, value) among
# its figures: a step that no GPU has passed showing them (nor at all) is new to GPUs, and a call on
# GPUs runs it first. sft has none: its compiled blocks ran on an H100 on 2026-11-27 (docs/sft.md),
# only outside gpu-check.
GPU_DEFAULTS = {"dpo": (("lora-padded", "compile", True),), "grpo": (("lora", "decode_mode", "compiled"),)}

# The files each step runs, as globs from the project's root: its recipe and what that imports of
# the project, the runtime and the configs it is launched with, the harness beside it, and the
# module of steps/ that builds its commands and judges them. A proof holds for the code it ran: once
# one of these files changes, the step runs again.
RUNTIME = ("accelerate_recipes/*.py", "accelerate_configs/*.yaml")
CHAT = ("recipes/chat/*.py", "benchmarks/chat_assets.py", "benchmarks/gpu_check/steps/chat.py")
SFT = (*CHAT, "recipes/sft*.py", "benchmarks/sft_bench.py")
CIFAR = ("recipes/cifar.py", "recipes/cifar_*.py")  # the recipe and the modules beside it
TEXT = ("recipes/text_classification*.py", "benchmarks/gpu_check/steps/text.py")
DETECT = ("recipes/detect/*.py", "benchmarks/gpu_check/steps/vision.py")
AUDIT = ("benchmarks/host_reads.py", "benchmarks/gpu_check/steps/measurements.py")
MULTI_GPU = "benchmarks/gpu_check/steps/multi_gpu.py"
GRPO_BENCH = ("benchmarks/grpo_bench.py",)
STEP_FILES = {
    "sft": (*SFT, "benchmarks/packed_attention_check.py"),
    # dpo_bench.py and grpo_bench.py import functions of
    # sft_bench.py, dpo_bench.py grpo_bench.py's report too
    "dpo": (*CHAT, "recipes/dpo*.py", "benchmarks/dpo_bench.py", "benchmarks/sft_bench.py", *GRPO_BENCH),
    "grpo": (*CHAT, "recipes/grpo*.py", "benchmarks/sft_bench.py", *GRPO_BENCH),
    "sft-speed-full": SFT,
    "sft-speed-lora": SFT,
    "fast94": (*CIFAR, "benchmarks/gpu_check/steps/vision.py"),
    "text-fsdp": TEXT,
    "detect-640": DETECT,
    "preempt": (*CIFAR, "benchmarks/gpu_check/steps/preemption.py"),
    "bench": (*CIFAR, *TEXT, "benchmarks/bench.py", "benchmarks/gpu_check/steps/measurements.py"),
    "text-deepspeed": TEXT,
    "audit-cifar": (*CIFAR, *AUDIT),
    "audit-text": (*TEXT, *AUDIT),
    "audit-detect": (*DETECT, *AUDIT),
    "nccl-doctor": ("recipe_tools/*.py", MULTI_GPU),
    "ddp": (*CIFAR, MULTI_GPU),
    "sync-bn": (*CIFAR, MULTI_GPU),
    "allreduce": ("benchmarks/allreduce.py", "Makefile", MULTI_GPU),
    "dp-vs-ddp": (*CIFAR, "benchmarks/scaling.py", "benchmarks/dataparallel.py", MULTI_GPU),
}


def step_files(name: str, root: Path = REPO) -> list[Path]:
    """The files step NAME runs (STEP_FILES and the runtime) under ROOT, each once, in a fixed
    order."""
    patterns = (*RUNTIME, *STEP_FILES[name])
    found = {path for pattern in patterns for path in root.glob(pattern) if path.is_file()}
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def code_digest(name: str, root: Path = REPO) -> str:
    """What step NAME runs, in 16 hex digits: a hash of its files' paths and contents under ROOT (a
    checkout, git or not), so that the same tree gives the same digest on any machine."""
    digest = hashlib.sha256()
    for path in step_files(name, root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def code_digests(root: Path = REPO) -> dict[str, str]:
    """Every step's code_digest for the tree at ROOT."""
    return {name: code_digest(name, root) for name in STEPS}


def proof_key(mode: str, quick: bool, machine: dict) -> dict:
    """What a proof holds for: the GPUs (kind and count) and the software the steps ran with. Each
    step's record adds the code it ran ("code": code_digest), which must be the tree's for its proof
    to hold."""
    packages = machine.get("packages", {})
    return {
        "mode": mode,
        "quick": quick,
        "devices": machine["devices"],
        **{name: machine.get(name) for name in ("torch", "cuda", "accelerate", "transformers")},
        "peft": packages.get("peft"),
    }


def gpus_of(machine: dict) -> list[tuple[str, float, str]]:
    """Each GPU's (name, memory in MiB, compute capability) from the rows nvidia-smi gave the
    machine's record ("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 9.0"); none where a row does
    not read so."""
    gpus = []
    for row in machine.get("nvidia_smi") or []:
        fields = [f.strip() for f in row.split(",")]
        try:
            gpus.append((fields[0], float(fields[2].split()[0]), fields[3]))
        except (IndexError, ValueError):
            return []
    return gpus


def carry_refusal(theirs: dict, machine_there: dict, key: dict, machine: dict | None) -> str | None:
    """Why a proof made under the key THEIRS on the machine MACHINE_THERE does not hold under KEY on
    MACHINE (one line), or None when it does. It holds on the same GPUs and software, and, for the
    steps whose figures are not the GPU's own, on as many GPUs of the same compute capability with
    at least as much memory each and the same software (an H100 80GB's proof holds on an H200: both
    Hopper, sm_90)."""
    if theirs == key:
        return None
    fields = ("mode", "quick", *SOFTWARE)
    differ = [
        f"{k} {theirs.get(k)!r} there, {key.get(k)!r} here" for k in fields if theirs.get(k) != key.get(k)
    ]
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
            return (
                f"{name} ({memory:.0f} MiB) there, {name_here} with less memory ({memory_here:.0f} MiB) here"
            )
    return None


def holding(
    earlier: dict, key: dict, machine: dict | None = None
) -> tuple[list[tuple[dict, bool]], list[str]]:
    """The entries of EARLIER (a proof file's machines, or a report as one) whose proof holds for
    KEY on MACHINE, each with whether its GPUs are these (else only the steps whose figures are not
    per GPU hold), the same GPUs first; and why each other entry does not hold."""
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


def why_stale(name: str, record: dict, digests: dict[str, str]) -> str | None:
    """Why the passed record of step NAME proves too little for the tree whose code DIGESTS are
    given (one line), or None when it holds: it lacks a figure the step records now (PROOF_NEEDS),
    or it ran other code than the tree's (a record made before proofs recorded their code counts as
    other code)."""
    missing = [need for need in PROOF_NEEDS.get(name, ()) if need not in record["figures"]]
    reasons = [f"it has no {', '.join(missing)}, which the step records since"] if missing else []
    if "code" not in record:
        reasons.append("it predates the code digests proofs record, so it ran older code")
    elif record["code"] != digests.get(name):
        there, here = record["code"], digests.get(name)
        reasons.append(f"its code changed since (digest {there} there, {here} in this tree)")
    return "; ".join(reasons) or None


def proven_steps(
    earlier: dict, key: dict, machine: dict | None = None, digests: dict[str, str] | None = None
) -> tuple[dict[str, dict], list[str]]:
    """The passed step records of EARLIER (a report, or a proof file such as docs/gpu-proof.json)
    that hold for KEY on MACHINE (its record, with nvidia-smi's rows) and the code DIGESTS (default:
    this checkout's), and, when none can, why EARLIER's GPUs or software do not hold here. A proof
    made on other GPUs of the same compute capability, with as much memory and the same software,
    holds too, but for the steps whose figures are per GPU (PER_GPU); such a record names the GPUs
    it was proven on ("proven_on"). A record that is stale (why_stale: made on other code, or
    without a figure its step records now) proves too little and is left out."""
    digests = code_digests() if digests is None else digests
    held, refusals = holding(earlier, key, machine)
    proven: dict[str, dict] = {}
    for entry, same in held:
        for name, record in entry["steps"].items():
            if name in proven or (not same and name in PER_GPU):
                continue
            if why_stale(name, record, digests) is None:
                proven[name] = record if same else {"proven_on": describe_devices(entry["key"]), **record}
    if proven or not refusals:
        return proven, []
    return {}, [f"no entry for {describe_key(key)}"] if "machines" in earlier else refusals


def stale_proofs(
    earlier: dict, key: dict, machine: dict | None = None, digests: dict[str, str] | None = None
) -> dict[str, str]:
    """The steps EARLIER proved for KEY on MACHINE whose proof is stale for the code DIGESTS
    (default: this checkout's), in order of value, each with why (why_stale): they run again."""
    digests = code_digests() if digests is None else digests
    held, _ = holding(earlier, key, machine)
    proven = proven_steps(earlier, key, machine, digests)[0]
    stale = {}
    for entry, same in held:
        for name, record in entry["steps"].items():
            if name not in proven and name not in stale and (same or name not in PER_GPU):
                stale[name] = why_stale(name, record, digests)
    return {name: stale[name] for name in STEPS if name in stale}


def describe_stale(stale: dict[str, str]) -> str:
    """stale_proofs' answer in one line, the steps grouped by why: "sft, grpo (why); dpo (other
    why)"."""
    grouped: dict[str, list[str]] = {}
    for name, why in stale.items():
        grouped.setdefault(why, []).append(name)
    return "; ".join(f"{', '.join(names)} ({why})" for why, names in grouped.items())


def shows_gpu_defaults(name: str, record: dict) -> bool:
    """Whether a passed record of step NAME shows the GPU defaults the step runs now
    (GPU_DEFAULTS)."""
    figures = record.get("figures", {})
    shown = GPU_DEFAULTS.get(name, ())
    return all((figures.get(run) or {}).get(figure) == value for run, figure, value in shown)


def new_to_gpus(earlier: dict | None) -> list[str]:
    """The steps that no GPU has passed running their GPU defaults, by EARLIER (a proof file or a
    report of GPUs), whatever its GPUs, software and code: what a call on GPUs runs first. The speed
    steps (PER_GPU) are not among them: they measure paths the other steps prove, and a GPU of their
    own kind measures them once those hold."""
    if earlier is None:
        return []
    if "machines" in earlier:
        records = [(m["key"], m["steps"]) for m in earlier["machines"]]
    else:
        passed = {r["step"]: r for r in earlier.get("steps", []) if r["status"] == "pass"}
        records = [(earlier.get("key", {}), passed)]
    ran = {
        name
        for key, steps in records
        if key.get("mode") == "gpu"
        for name, record in steps.items()
        if shows_gpu_defaults(name, record)
    }
    return [name for name in STEPS if name not in ran and name not in PER_GPU]


def first_order(todo: list[str], earlier: dict | None) -> list[str]:
    """TODO (in order of value) with the steps new to GPUs (new_to_gpus of EARLIER) first, each part
    in order of value: the order a call on GPUs runs them in, and --plan fills its calls in."""
    new = set(new_to_gpus(earlier))
    return [name for name in todo if name in new] + [name for name in todo if name not in new]


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
            f"--after {path} not found: give the report.json an earlier call wrote (OUTPUT_DIR/report.json "
            f"or RESULTS_DIR/report.json), or {PROOF.relative_to(REPO)}"
        )
    try:
        earlier = json.loads(file.read_text())
        earlier["machines"] if "machines" in earlier else (earlier["key"], earlier["steps"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise RecipeError(
            f"--after {path} is neither a gpu-check report nor a proof file ({type(err).__name__}: {err}); "
            "give the report.json that gpu-check wrote"
        ) from None
    return earlier


PROOF_ABOUT = (
    "What has run on a GPU: every step of `make gpu-check` that passed on real GPUs, per kind of GPU and "
    "software, with the driver, the versions and the command of each figure. Only `python "
    "benchmarks/gpu_check --merge REPORT` writes it, from the report.json of a call on GPUs."
)


def markdown_proof(proof: dict) -> str:
    """PROOF (docs/gpu-proof.json) as docs/gpu-proof.md: which GPUs proved each step, where that
    holds, and which proofs are stale against the tree --merge last wrote it from (its "tree_code",
    the steps' code digests then)."""
    lines = [
        "# GPU proof",
        "",
        PROOF_ABOUT + " The command for a 15-minute GPU allocation, and how calls add up: "
        "[benchmarks.md](benchmarks.md#proving-the-gpu-paths-make-gpu-check). What is left to prove on some "
        "GPUs, in calls of a budget, each step's estimate part by part: `python3 benchmarks/gpu_check --plan "
        "--machine REPORT --budget 540` for the GPUs and software REPORT (a call's report.json) recorded "
        "([the call plan](benchmarks.md#calls-estimates-and-what-carries)). The same in JSON: "
        "[gpu-proof.json](gpu-proof.json).",
        "",
    ]
    # the code digests --merge judged by; none in a file
    # from before them, where every proof counts as stale
    tree_code = proof.get("tree_code", {})
    if not proof["machines"]:
        lines += [
            "**Nothing has been proven on a GPU yet.** Every figure of this project so far comes from CPUs "
            '([benchmarks.md](benchmarks.md#measured-figures)); each row of the README that says "not '
            'measured yet" '
            "waits for an entry here.",
        ]
    if proof["machines"]:
        lines += [
            "## Which GPUs proved each step, and where it holds",
            "",
            "A step proven on some GPUs holds on as many GPUs of the same compute capability with at least "
            "as much memory each and the same torch, CUDA, accelerate, transformers and peft (an H100 "
            "80GB's proof holds on an H200: both Hopper, sm_90), and `--after` carries it there; its "
            f"figures stay those of the GPUs that made them. The speed steps ({', '.join(PER_GPU)}) hold on "
            "the GPUs that measured them only: their figures are those GPUs' own, so every kind of GPU "
            "measures them again. A proof holds for the code it ran, too: each record keeps a digest of the "
            "files its step runs (the recipe, the chat layer, accelerate_recipes, the configs, the step's "
            "harness: `STEP_FILES` in benchmarks/gpu_check/proof.py), and a step whose files changed since, "
            "or whose proof predates those digests, is stale: `--after` runs it again. Stale here means "
            "against the tree this file was last written from; `--plan` says it for the tree at hand.",
            "",
            "| step | proven on | when | holds on |",
            "|---|---|---|---|",
        ]
        for name in STEPS:
            for machine in proof["machines"]:
                if name in machine["steps"]:
                    record = machine["steps"][name]
                    lines.append(
                        f"| {name} | {describe_devices(machine['key'])} | {record.get('finished_at') or '?'} "
                        f"| {holds_on(name, machine, record, tree_code)} |"
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
            f"{', '.join(s for s in STEPS if s not in proven) or 'nothing'}. Stale, so run again: "
            f"{', '.join(s for s in proven if why_stale(s, machine['steps'][s], tree_code)) or 'none'}.",
            "",
            "| step | seconds | key figures | proven |",
            "|---|---:|---|---|",
        ]
        for name in proven:
            r = machine["steps"][name]
            figures = "; ".join(
                f"{k}: {compact(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",)
            )
            lines.append(
                f"| {name} | {r['wall_seconds']} | {figures or '-'} | {r.get('finished_at') or '?'} |"
            )
        lines += ["", "Commands:", ""]
        for name in proven:
            lines += [f"- {name}:", ""] + [f"      {c}" for c in machine["steps"][name]["commands"]] + [""]
    return "\n".join(lines).rstrip() + "\n"


def holds_on(name: str, machine: dict, record: dict, digests: dict[str, str]) -> str:
    """Where the proof of step NAME in a proof file's MACHINE entry holds (proven_steps' rule) for
    the tree whose code DIGESTS are given, in words."""
    stale = why_stale(name, record, digests)
    if stale:
        return f"nowhere now, stale: {stale}; it runs again"
    if name in PER_GPU:
        return f"{describe_devices(machine['key'])} only (its figures are per GPU)"
    gpus = gpus_of(machine["machine"])
    if not gpus:
        return f"{describe_devices(machine['key'])}, with this software"
    memory = min(memory for _, memory, _ in gpus)
    capabilities = sorted({capability for _, _, capability in gpus})
    count = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
    return (
        f"{count} of compute capability {', '.join(capabilities)} with {memory:.0f} MiB or more each, with "
        "the software of its section below"
    )


# A path into the project as the GPU machine wrote it
# (`./recipes/...`, `/its/checkout/recipes/...`).
PROJECT_PATH = re.compile(r"(?<!\S)\S*?/(?=(?:recipes|benchmarks|accelerate_configs|tests)/)")


def portable_command(command: str, executable: str | None) -> str:
    """COMMAND as a user types it from the project's root: `accelerate launch` and `python3` instead
    of the GPU machine's interpreter, and paths into the project relative to its root."""
    if executable:
        command = command.replace(f"{executable} -m accelerate.commands.accelerate_cli ", "accelerate ")
        command = re.sub(rf"(?<!\S){re.escape(executable)}(?!\S)", "python3", command)
    return PROJECT_PATH.sub("", command)


def merge_reports(reports: list[str], proof_path: Path) -> int:
    """Fold the passed steps of REPORTS into PROOF_PATH (JSON) and the markdown beside it; runs no
    step, needs no GPU. A later proof of a step on the same GPUs and software replaces the earlier
    one."""
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
                f"--merge {given} is a CPU smoke report (--device cpu); {PROOF.relative_to(REPO)} holds GPU "
                "proof only: merge it elsewhere with --proof OTHER.json"
            )
        machine = next((m for m in proof["machines"] if m["key"] == report["key"]), None)
        if machine is None:
            machine = {"key": report["key"], "machine": report["machine"], "steps": {}}
            proof["machines"].append(machine)
        # only what this report's own GPUs proved: the records
        # it carried are folded in where they were proven
        passed = {r["step"]: r for r in report["steps"] if r["status"] == "pass" and not r.get("carried")}
        for name, record in passed.items():
            kept = {
                k: record.get(k) for k in ("commands", "wall_seconds", "figures", "detail", "finished_at")
            }
            kept.update({k: record[k] for k in ("code", "estimate", "timing") if record.get(k)})
            kept["commands"] = [
                portable_command(c, report["machine"].get("executable")) for c in kept["commands"]
            ]
            machine["steps"][name] = {**kept, "host": record.get("host", report["machine"]["host"])}
        machine["steps"] = {s: machine["steps"][s] for s in STEPS if s in machine["steps"]}
        for record in machine["steps"].values():  # proofs merged before commands were made portable
            record["commands"] = [
                portable_command(c, machine["machine"].get("executable")) for c in record["commands"]
            ]
        print(
            f"gpu-check: {len(passed)} proven step(s) of {path} for {describe_key(report['key'])}", flush=True
        )
    proof["tree_code"] = code_digests()  # what the markdown's stale proofs are judged against
    proof_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(proof_path, json.dumps(proof, indent=2) + "\n")
    write_text(proof_path.with_suffix(".md"), markdown_proof(proof))
    print(f"saved {proof_path} and {proof_path.with_suffix('.md')}")
    return 0
