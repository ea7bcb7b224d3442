"""Which GPUs to train on: read `nvidia-smi topo -m`, group the GPUs, recommend the best set for 1,
2, 4, ... GPUs.

    accelerate-recipes-topo                       # this machine (make topo)
    accelerate-recipes-topo --file saved.txt      # a saved `nvidia-smi topo -m` (make topo TOPO=saved.txt)
    accelerate-recipes-topo --gpus 4 --write_config accelerate_configs/best4.yaml

(`python -m recipe_tools.topology` is the same program.)

DDP's all-reduce runs around a ring of all the GPUs, so a step waits for the slowest link in the
set: two GPUs joined by NVLink exchange gradients many times faster than two GPUs whose traffic
crosses the CPU sockets (SYS), which can train slower than one GPU alone. The recommendation
therefore maximises the slowest link of the set.
"""

import itertools
import math
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from accelerate_recipes.cli import RecipeError, run

# Connection kinds of `nvidia-smi topo -m`, fastest first (its legend); NV# is a bond of # NVLinks.
LINK_MEANING = {
    "PIX": "at most one PCIe bridge (same PCIe switch)",
    "PXB": "several PCIe bridges, no host bridge",
    "PHB": "through a PCIe host bridge (the CPU's root complex)",
    "NODE": "across PCIe host bridges within one NUMA node (same socket)",
    "SYS": "across NUMA nodes / CPU sockets (QPI, UPI, Infinity Fabric)",
}
PCIE_SCORE = {"PIX": 50, "PXB": 40, "PHB": 30, "NODE": 20, "SYS": 10}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def link_score(link: str) -> int:
    """Higher is faster: NV# above every PCIe path (more NVLinks higher), then PIX > PXB > PHB >
    NODE > SYS."""
    if link.startswith("NV") and link[2:].isdigit():
        return 100 + int(link[2:])
    return PCIE_SCORE.get(link, 0)


def describe(link: str) -> str:
    """The link's code and what it means, e.g. 'NV4: 4 bonded NVLinks'."""
    if link.startswith("NV") and link[2:].isdigit():
        return f"{link}: {link[2:]} bonded NVLinks"
    return f"{link}: {LINK_MEANING.get(link, 'unknown connection')}"


@dataclass
class Topology:
    gpus: list[int]
    links: dict[tuple[int, int], str]  # (i, j) with i < j -> connection kind
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    numa_affinity: dict[int, str] = field(default_factory=dict)

    def link(self, a: int, b: int) -> str:
        return self.links[(min(a, b), max(a, b))]

    def slowest(self, gpus) -> tuple[str, tuple[int, int]] | None:
        """The slowest link among the pairs of `gpus` and the pair it joins (None for a single
        GPU)."""
        pairs = list(itertools.combinations(sorted(gpus), 2))
        if not pairs:
            return None
        pair = min(pairs, key=lambda p: (link_score(self.link(*p)), p))
        return self.link(*pair), pair


def parse(text: str, source: str = "nvidia-smi topo -m") -> Topology:
    """Parse the matrix printed by `nvidia-smi topo -m` (tab-separated; NIC rows and the legend are
    ignored)."""
    lines = [ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_index = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_index is None:
        raise RecipeError(
            f"no GPU matrix found in {source}; give the output of `nvidia-smi topo -m` as it prints it"
        )
    header = [cell.strip() for cell in lines[header_index].strip().split("\t")]
    gpus, links, cpu, numa = [], {}, {}, {}
    for line in lines[header_index + 1 :]:
        match = re.match(r"^GPU(\d+)\t", line)
        if not match:
            continue
        cells = [cell.strip() for cell in line.split("\t")[1:]]
        row = dict(zip(header, cells))
        gpu = int(match.group(1))
        gpus.append(gpu)
        for column, value in row.items():
            other = re.fullmatch(r"GPU(\d+)", column)
            if other and int(other.group(1)) != gpu:
                a, b = sorted((gpu, int(other.group(1))))
                links[(a, b)] = value
        cpu[gpu], numa[gpu] = row.get("CPU Affinity", ""), row.get("NUMA Affinity", "")
    missing = [(a, b) for a, b in itertools.combinations(sorted(gpus), 2) if (a, b) not in links]
    if not gpus or missing:
        raise RecipeError(
            f"the GPU matrix in {source} is incomplete (pairs without a link: {missing[:3]}); "
            "save the whole output of `nvidia-smi topo -m`"
        )
    return Topology(sorted(gpus), links, cpu, numa)


def components(topo: Topology, joined) -> list[list[int]]:
    """Groups of GPUs connected through links for which joined(link) holds."""
    groups: list[set[int]] = []
    for gpu in topo.gpus:
        linked = [g for g in groups if any(joined(topo.link(gpu, other)) for other in g)]
        merged = {gpu}.union(*linked)
        groups = [g for g in groups if g not in linked] + [merged]
    return sorted(sorted(g) for g in groups)


def groups(topo: Topology) -> dict[str, list[list[int]]]:
    """NVLink groups, PCIe-switch groups and sockets (NUMA nodes) of the GPUs."""
    if any(topo.numa_affinity.get(g, "N/A") not in ("", "N/A") for g in topo.gpus):
        by_node: dict[str, list[int]] = {}
        for gpu in topo.gpus:
            by_node.setdefault(topo.numa_affinity.get(gpu, "?"), []).append(gpu)
        sockets = sorted(by_node.values())
    else:  # no NUMA column: GPUs that reach each other without crossing the socket interconnect
        sockets = components(topo, lambda link: link != "SYS")
    return {
        "nvlink": [g for g in components(topo, lambda link: link.startswith("NV")) if len(g) > 1],
        "pcie_switch": [g for g in components(topo, lambda link: link in ("PIX", "PXB")) if len(g) > 1],
        "socket": sockets,
    }


def best_set(topo: Topology, k: int) -> tuple[int, ...]:
    """The k GPUs whose slowest mutual link is fastest (then the fastest links in total, then the
    lowest ids)."""
    if not 1 <= k <= len(topo.gpus):
        raise RecipeError(f"--gpus {k}: this machine has {len(topo.gpus)} GPU(s)")

    def quality(gpus):
        scores = [link_score(topo.link(a, b)) for a, b in itertools.combinations(gpus, 2)] or [0]
        return (min(scores), sum(scores), [-g for g in gpus])

    if math.comb(len(topo.gpus), k) <= 50_000:  # every set up to 16 GPUs: exact
        return max(itertools.combinations(topo.gpus, k), key=quality)
    # bigger boxes: grow the best pair greedily
    chosen = list(max(itertools.combinations(topo.gpus, 2), key=quality))
    while len(chosen) < k:
        chosen = max((sorted(chosen + [g]) for g in topo.gpus if g not in chosen), key=quality)
    return tuple(chosen)


def why(topo: Topology, gpus) -> str:
    """What limits the gradient exchange of this GPU set: its slowest link."""
    slowest = topo.slowest(gpus)
    return "one GPU: no gradient exchange" if slowest is None else f"slowest link {describe(slowest[0])}"


def recommendations(topo: Topology) -> list[tuple[tuple[int, ...], str]]:
    """(GPU set, reason) for k = 1, 2, 4, 8, ... up to every GPU."""
    sizes = [k for k in (1, 2, 4, 8, 16, 32, 64) if k < len(topo.gpus)] + [len(topo.gpus)]
    rows = []
    for k in sizes:
        gpus = best_set(topo, k)
        rows.append((gpus, why(topo, gpus)))
    return rows


def avoid(topo: Topology) -> str | None:
    """The pair of GPUs to avoid together, when some pairs are much slower than the best ones."""
    link, pair = topo.slowest(topo.gpus) or (None, None)
    best = (
        max(link_score(topo.link(*p)) for p in itertools.combinations(topo.gpus, 2))
        if len(topo.gpus) > 1
        else 0
    )
    if link is None or link_score(link) == best:
        return None
    return f"for 2 GPUs, avoid pairs like {pair[0]},{pair[1]}: {describe(link)}"


def report(topo: Topology) -> str:
    found = groups(topo)
    fmt = lambda gs: "  ".join("{" + ",".join(map(str, g)) + "}" for g in gs) or "none"  # noqa: E731
    lines = [
        f"{len(topo.gpus)} GPU(s)",
        f"  NVLink groups:      {fmt(found['nvlink'])}",
        f"  PCIe switch groups: {fmt(found['pcie_switch'])}",
        f"  sockets/NUMA nodes: {fmt(found['socket'])}",
        "",
        "recommended GPU sets (the slowest link decides the all-reduce speed):",
    ]
    for gpus, reason in recommendations(topo):
        lines.append(f"  {len(gpus):>2} GPU(s): --gpu_ids {','.join(map(str, gpus)):<16} {reason}")
    warning = avoid(topo)
    if warning:
        lines += ["", warning]
    return "\n".join(lines)


CONFIG_TEMPLATE = """\
# Written by `accelerate-recipes-topo --gpus {k}`: the {k} GPU(s) of this machine whose slowest link
# is fastest ({reason}).
compute_environment: LOCAL_MACHINE
distributed_type: {distributed_type}
num_machines: 1
num_processes: {k}
machine_rank: 0
gpu_ids: '{gpu_ids}'
mixed_precision: bf16
main_training_function: main
downcast_bf16: 'no'
rdzv_backend: static
same_network: true
use_cpu: false
debug: false
"""


def read_topology(file: str | None) -> tuple[Topology, str]:
    if file:
        path = Path(file)
        if not path.is_file():
            raise RecipeError(
                f"--file {file} does not exist; save one with `nvidia-smi topo -m > {path.name}`"
            )
        return parse(path.read_text(), source=str(path)), str(path)
    if shutil.which("nvidia-smi") is None:
        raise RecipeError(
            "nvidia-smi not found: this machine has no NVIDIA driver (or it is not on PATH); run this on "
            "the GPU machine, or pass a saved `nvidia-smi topo -m` output with --file"
        )
    try:
        output = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise RecipeError(
            "`nvidia-smi topo -m` did not answer within 60 s; check the driver with `nvidia-smi`"
        ) from None
    if output.returncode != 0:
        raise RecipeError(f"`nvidia-smi topo -m` failed: {(output.stderr or output.stdout).strip()[:200]}")
    return parse(output.stdout), "nvidia-smi topo -m"


def main(file: str | None = None, gpus: int | None = None, write_config: str | None = None):
    """Print GPU groups and the recommended GPU sets; optionally write an accelerate config for the
    best set.

    Args:
        file: a saved `nvidia-smi topo -m` output; default: run nvidia-smi on this machine.
        gpus: only the best set of this many GPUs (needed with --write_config).
        write_config: write an accelerate config file (like accelerate_configs/2gpu.yaml) with the
            best --gpus set.
    """
    topo, source = read_topology(file)
    if gpus is None:
        if write_config:
            raise RecipeError("--write_config needs --gpus N: how many GPUs the config should use")
        print(f"from {source}: {report(topo)}")
        return
    chosen = best_set(topo, gpus)
    reason = why(topo, chosen)
    print(f"best {gpus} GPU(s): {','.join(map(str, chosen))} ({reason})")
    if write_config:
        path = Path(write_config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            CONFIG_TEMPLATE.format(
                k=gpus,
                reason=reason,
                distributed_type="NO" if gpus == 1 else "MULTI_GPU",
                gpu_ids=",".join(map(str, chosen)),
            )
        )
        print(f"wrote {path}: accelerate launch --config_file {path} recipes/cifar.py")


def cli() -> None:
    """Console entry point `accelerate-recipes-topo`."""
    run(main)


if __name__ == "__main__":
    cli()
