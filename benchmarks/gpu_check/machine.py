"""What a report records of the machine before the first step: what a later fix would need to
know."""

import datetime
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from .paths import REPO

# What a later fix may need to know about the machine: recorded before the first step.
PACKAGES = (
    "torch torchvision accelerate transformers peft datasets pyarrow fsspec huggingface-hub tokenizers "
    "safetensors numpy deepspeed hjson ninja triton gguf torchmetrics pycocotools swanlab fire psutil "
    "pyyaml trl liger-kernel"
).split()


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi ("" without it): torch would open a CUDA context in this
    process, which would hold GPU memory through the steps that follow."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout.strip().splitlines() or [""])[0]


def first_line(command: list[str], pick: str | None = None) -> str | None:
    """The first line of COMMAND's output (the one holding PICK, when given), or None when it does
    not run."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return next((line for line in lines if pick and pick in line), lines[0] if lines else None)


def machine_facts(gpus: int) -> dict:
    """What a later fix would need to know about this machine, recorded before the first step:
    Python and package versions, GPUs and driver, /dev/shm (DataLoader workers share tensors through
    it), make, gcc, nvcc and ninja (which DeepSpeed needs to build its CUDA ops), and whether
    deepspeed imports."""
    import torch

    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    facts = {
        "host": platform.node(),
        "recorded_at": now(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "accelerate": packages["accelerate"],
        "transformers": packages["transformers"],
        "packages": packages,
        "gpus": gpus,
        "cpus": f"{len(os.sched_getaffinity(0))} of {os.cpu_count()}",
    }
    smi = shutil.which("nvidia-smi")
    if gpus and smi:
        query = ["--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"]
        try:
            rows = subprocess.run(
                [smi, *query], capture_output=True, text=True, timeout=60
            ).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired):
            rows = []
        facts["nvidia_smi"] = [row.strip() for row in rows if row.strip()]
        # the names from nvidia-smi: torch would open a CUDA context here and hold its memory
        # through every step
        facts["devices"] = [row.split(",")[0] for row in facts["nvidia_smi"]][:gpus]
    if gpus and len(facts.get("devices", [])) != gpus:
        facts["devices"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    if not gpus:
        facts["devices"] = [f"CPU ({os.cpu_count()} cores)"]
    try:
        shm = shutil.disk_usage("/dev/shm")
        facts["dev_shm"] = f"{shm.total / 2**30:.1f} GiB, {shm.free / 2**30:.1f} GiB free"
    except OSError:
        facts["dev_shm"] = None
    nvcc = shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    facts["tools"] = {
        "make": first_line(["make", "--version"]),
        "gcc": first_line(["gcc", "--version"]),
        "nvcc": first_line([nvcc, "--version"], "release"),
        "ninja": first_line(["ninja", "--version"]),
        "nvidia-smi": first_line([smi], "Driver Version") if smi else None,
    }
    facts["deepspeed_import"] = deepspeed_imports() if gpus else None
    facts["commit"] = first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    return facts


def deepspeed_imports() -> str:
    """ "ok <version>", or why `import deepspeed` fails in this interpreter (a missing wheel such as
    hjson)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        return "deepspeed did not import within 180 s"
    if proc.returncode:
        return f"deepspeed does not import: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return f"ok {proc.stdout.strip().splitlines()[-1]}"
