"""The report of a call: its verdict, report.md and report.json, and the logs tar that --results_dir
receives."""

import json
import re
import tarfile
from pathlib import Path

from .plan import NEXT_CALL, STEPS, describe_estimate

UNSHARDED = "unsharded: world size 1, no NCCL traffic; proves the sharded code path, not sharding"
RESULT_FILES = ("report.md", "report.json", "logs.tar.gz")  # all that --results_dir receives
# What the logs tar leaves out: models, checkpoints and generated inputs (a full fine-tune writes
# about 10 GB).
LOG_SUFFIXES, LOG_MAX_BYTES = (".txt", ".jsonl", ".json", ".md", ".log"), 2_000_000
NOT_LOGS = {"checkpoints", "inputs", "data", "datasets-cache", "text-data", "chat-data", "bert", "model"}
MODEL_FILES = re.compile(
    r"(config|tokenizer.*|vocab|merges|special_tokens_map|generation_config|.*\.index)\.(json|txt)"
)


def assess(steps: list[dict], absent: dict[str, str] | None = None) -> dict:
    """The verdict over step records (status pass, fail, incomplete or not run), with ABSENT the
    steps this report does not hold and why ("not in --steps"): {"verdict", "not_proved": ["step:
    why"], "notes": {step: note}}.

    FAIL when a step failed; INCOMPLETE when the budget cut a step short or left it for the next
    call; PARTIAL when nothing failed but not every path was proved here (no 2+ GPUs, no deepspeed,
    no CUDA, a sharded path on one process, steps left out); PASS otherwise. The verdict names every
    step that is not PASS, grouped by why."""
    failed = [r["step"] for r in steps if r["status"] == "fail"]
    left_out = [
        f"{r['step']}: {r['detail'].splitlines()[0] if r['status'] == 'not run' else 'cut short by --budget'}"
        for r in steps
        if r["status"] == "incomplete" or (r["status"] == "not run" and r["detail"].startswith(NEXT_CALL))
    ]
    not_proved = [
        f"{r['step']}: {r['detail']}"
        for r in steps
        if r["status"] == "not run" and r["step"] not in {line.split(": ")[0] for line in left_out}
    ]
    not_proved += [f"{name}: {why}" for name, why in (absent or {}).items()]
    notes = {}
    for r in steps:
        # sft ran without its peer
        if r["status"] == "pass" and isinstance(r["figures"].get("vs_trl"), str):
            not_proved.append(f"{r['step']} against TRL: {r['figures']['vs_trl'].removeprefix('not run: ')}")
        if r["status"] == "pass" and unsharded(r["figures"]):
            notes[r["step"]] = f"{', '.join(unsharded(r['figures']))} {UNSHARDED}"
            not_proved.append(f"sharding in {r['step']}: {UNSHARDED}")
        if r["step"] == "nccl-doctor" and r["status"] == "pass" and not r["figures"].get("busbw_gbps"):
            notes[r["step"]] = "gloo only; " + (r["figures"].get("nccl") or "the NCCL all-reduce did not run")
    verdict = [f"FAIL: {', '.join(failed)}"] if failed else []
    verdict += [f"INCOMPLETE: {_grouped(left_out)}"] if left_out else []
    if not_proved:
        verdict.append(("not proved: " if verdict else "PARTIAL: not proved: ") + _grouped(not_proved))
    return {"verdict": "; ".join(verdict) or "PASS", "not_proved": not_proved, "notes": notes}


def unsharded(figures: dict) -> list[str]:
    """The runs in a step's FIGURES that took a sharded path (FSDP, DeepSpeed) on one process: "ran"
    for the step's own run, or the names of its runs (sft's lora-fsdp)."""

    def one(f):
        return f.get("world_size") == 1 and f.get("distributed_type") in ("FSDP", "DEEPSPEED")

    if one(figures):
        return ["ran"]
    runs = [name for name, f in figures.items() if isinstance(f, dict) and one(f)]
    return [f"{', '.join(runs)} ran"] if runs else []


def _grouped(lines: list[str]) -> str:
    """["a: why", "b: why", "c: other"] as "a, b (why); c (other)", for a verdict of one line."""
    reasons: dict[str, list[str]] = {}
    for line in lines:
        what, why = line.split(": ", 1)
        if what.startswith("sharding in "):
            what, why = f"sharding in {what[12:]}", "one process"
        reasons.setdefault(why, []).append(what)
    return "; ".join(f"{', '.join(names)} ({why})" for why, names in reasons.items())


def exit_status(verdict: str) -> int:
    """0 when nothing failed (PASS, PARTIAL), 1 when a step failed or was left out (FAIL,
    INCOMPLETE)."""
    return 1 if verdict.startswith(("FAIL", "INCOMPLETE")) else 0


def markdown(report: dict) -> str:
    m = report["machine"]
    tools = m.get("tools", {})
    packages = m.get("packages", {})
    lines = [
        f"# GPU check: {report['verdict']}",
        "",
        f"{', '.join(m['devices'])}; torch {m['torch']}, CUDA {m['cuda']}, accelerate {m['accelerate']}, "
        f"transformers {m['transformers']}, Python {m['python']}; host {m['host']}; mode {report['mode']}"
        f"{' (--quick)' if report.get('quick') else ''}; started {report.get('started_at', '?')}, "
        f"{report['wall_seconds']:.0f} s so far of a --budget of {report.get('budget', 0):.0f} s.",
        "",
        f"Driver and GPUs: {'; '.join(m.get('nvidia_smi', [])) or '-'}. /dev/shm: {m.get('dev_shm')}. "
        + ", ".join(f"{k}: {v}" for k, v in tools.items() if k != "nvidia-smi")
        + f". deepspeed: {m.get('deepspeed_import') or packages.get('deepspeed') or 'not installed'}. "
        "Packages: "
        + ", ".join(f"{k} {v}" for k, v in packages.items() if v)
        + f"; not installed: {', '.join(k for k, v in packages.items() if not v) or 'none'}.",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        "| step | status | seconds | key figures |",
        "|---|---|---:|---|",
    ]
    notes = report.get("notes", {})
    for r in report["steps"]:
        figures = "; ".join(
            f"{k}: {compact(v)}" for k, v in r["figures"].items() if k not in ("quiet_sites",)
        )
        status = r["status"] + (
            f" ({r['detail'].splitlines()[0]})" if r["status"] == "not run" and r["detail"] else ""
        )
        if r.get("carried"):
            where = f"proven on {r['proven_on']}" if r.get("proven_on") else "earlier call"
            status += f" ({where}, {r.get('finished_at', '?')})"
        status += f" ({notes[r['step']].split(';')[0]})" if r["step"] in notes else ""
        estimated = r.get("estimate") and not r.get("carried")
        seconds = f"{r['wall_seconds']}" + (f" (est. {r['estimate']['seconds']:.0f})" if estimated else "")
        lines.append(f"| {r['step']} | {status} | {seconds} | {figures or '-'} |")
    if report.get("not_proved"):
        lines += ["", "## Not proved by this report", ""] + [f"- {line}" for line in report["not_proved"]]
    for r in report["steps"]:
        if r["status"] == "not run":
            continue
        lines += ["", f"## {r['step']}: {r['status']}", ""]
        if r["step"] in notes:
            lines += [notes[r["step"]], ""]
        lines += [f"    {c}" for c in r["commands"]]
        if r.get("estimate") and not r.get("carried"):
            lines += ["", f"Estimated {describe_estimate(r['estimate'])}; took {r['wall_seconds']} s."]
        if r.get("timing") and not r.get("carried"):
            timing = "; ".join(f"{name}: {compact(parts)}" for name, parts in r["timing"].items())
            lines += ["", f"Measured, per command (seconds): {timing}."]
        if r["figures"]:
            lines += ["", "```json", json.dumps(r["figures"], indent=2), "```"]
        if r["detail"]:
            lines += ["", "```", r["detail"], "```"]
    return "\n".join(lines) + "\n"


def compact(value) -> str:
    """A figure as the tables show it: floats to 4 significant digits, dicts and lists item by
    item."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(compact(v) for v in value) + "]"
    return str(value)


def write_text(path: Path, text: str) -> None:
    """Whole or not at all: a call killed while writing leaves the previous version."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)


def write_report(out: Path, report: dict, results_dir: Path | None = None) -> None:
    """OUTPUT_DIR/report.json and report.md; with RESULTS_DIR, those two and logs.tar.gz there as
    well."""
    text = markdown(report)
    for folder in [out] + ([results_dir] if results_dir else []):
        write_text(folder / "report.json", json.dumps(report, indent=2) + "\n")
        write_text(folder / "report.md", text)
    if results_dir:
        part = results_dir / "logs.tar.gz.part"
        with tarfile.open(part, "w:gz") as tar:
            for path in log_files(out):
                tar.add(path, arcname=str(path.relative_to(out)))
        part.replace(results_dir / "logs.tar.gz")


def log_files(out: Path) -> list[Path]:
    """The steps' logs and small result files under OUT: no model, checkpoint or generated input."""
    files = []
    for step in STEPS:
        for path in sorted((out / step).rglob("*")):
            relative = path.relative_to(out / step)
            if (
                path.is_file()
                and path.suffix in LOG_SUFFIXES
                and not NOT_LOGS.intersection(relative.parts[:-1])
                and not MODEL_FILES.fullmatch(path.name)
                and path.stat().st_size <= LOG_MAX_BYTES
            ):
                files.append(path)
    return files


def print_summary(out: Path, report: dict, results_dir: Path | None) -> int:
    print("\n" + markdown(report).split("\n## ")[0].rstrip())
    if report["not_proved"]:
        print("not proved by this report:\n" + "\n".join(f"  {line}" for line in report["not_proved"]))
    print(f"saved {out / 'report.md'} and {out / 'report.json'}")
    if results_dir:
        print(f"and {', '.join(RESULT_FILES)} in {results_dir}")
    if report["verdict"].startswith("INCOMPLETE"):
        print(
            f"next call: the same command with --after {out / 'report.json'} runs only what is still unproven"
        )
    return exit_status(report["verdict"])
