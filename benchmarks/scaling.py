#!/usr/bin/env python
"""Scaling report: how training throughput grows with the number of processes on YOUR hardware, and
why.

    python benchmarks/scaling.py run                        # 1, 2, 4, 8 GPUs (or 1 and 2 CPU processes)
    # an NVLink pair vs a pair across sockets
    python benchmarks/scaling.py run --setups gpu:1,ids:0,1,ids:0,4
    python benchmarks/scaling.py run --setups gpu:1,gpu:2,dp:2   # DDP against torch's DataParallel, 2 GPUs
    # a table from finished runs
    python benchmarks/scaling.py report outputs/scaling/gpu-1 outputs/my-2node-run
    make scaling                                            # the CPU list here, the GPU list on a GPU box
    python benchmarks/scaling.py run --layouts ddp,fsdp,hsdp --machine_rank R --main_process_ip IP \
        --recipe sft --recipe_args "--model M --train_file chats.jsonl"   # on every node: DDP, FSDP, HSDP

Each setup trains recipes/cifar.py in throughput mode: generated CIFAR-shaped data, the SAME batch
per process in every setup (so N processes do N times the work per step), a few steps, warm-up steps
left out. Setups with more than one process first run benchmarks/allreduce.py at DDP's bucket size
with the same launch, to measure the bus bandwidth. A dp:N setup trains the same model and global
batch with torch.nn.DataParallel instead (benchmarks/dataparallel.py: one process drives N GPUs),
the comparison DDP is usually introduced with; the ring model does not apply to it.

The report (scaling.md, scaling.json, scaling.png in the output folder) gives per setup: samples/s,
speed-up and scaling efficiency (speed-up / processes), and the efficiency the ring all-reduce model
predicts:
    t_comm = 2(n-1)/n x K / busbw      K = gradient bytes (fp32: 4 x parameters), busbw as nccl-tests
                                       define it
    predicted efficiency = t1 / (t1 + t_comm)      t1 = measured step time of the 1-process setup
The model assumes no overlap of gradient exchange with the backward pass; DDP overlaps part of it,
so a measured efficiency above the prediction is normal. Well below it means something else is
shared: CPU cores, memory bandwidth, PCIe lanes, or the data loader.

--layouts compares how a model is spread over several nodes instead: the same recipe, flags and
global batch on all processes of all nodes under 2node.yaml (ddp), fsdp.yaml across the nodes (fsdp)
and 2node-hsdp.yaml (hsdp: sharded within each node, replicated across). Every node runs the same
command with its own --machine_rank; node 0 writes the report, with each layout's bytes per
optimizer step derived from the ring arithmetic (docs/multinode.md, "Sharding across nodes: HSDP")
beside the measured throughput:
    ddp   over the network, per node: 2(N-1)/N x G              G = gradient bytes, N = all processes
    fsdp  over the network, per node: (N-1)/N x (2A x P + G)    P = parameter bytes, A = micro-batches a step
    hsdp  over the network, per node: 2(M-1)/M x G              M nodes of n processes; within each node
          (n-1)/n x (2A x P + G)
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import fire

from accelerate_recipes.launch import usable_cores

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
# torch DDP's default bucket_cap_mb: gradients are all-reduced in 25 MB pieces
DDP_BUCKET_BYTES = 25 * 2**20


def fail(message: str):
    sys.exit(f"error: {message}")


# ------------------------------------------------------------------------------------------- setups
def parse_setup(spec: str) -> dict:
    """'cpu:2' -> 2 CPU processes over gloo; 'gpu:4' -> 4 GPUs; 'ids:0,4' -> GPUs 0 and 4; 'dp:2' ->
    DataParallel."""
    kind, _, value = spec.partition(":")
    try:
        if kind == "cpu":
            return {"name": f"cpu-{int(value)}", "kind": "cpu", "processes": int(value), "gpu_ids": None}
        if kind == "gpu":
            return {"name": f"gpu-{int(value)}", "kind": "gpu", "processes": int(value), "gpu_ids": None}
        if kind == "dp":  # one process, N GPUs
            return {
                "name": f"dp-{int(value)}",
                "kind": "dp",
                "processes": 1,
                "devices": int(value),
                "gpu_ids": None,
            }
        if kind == "ids":
            ids = [int(i) for i in value.split(",")]
            return {
                "name": "gpus-" + "-".join(map(str, ids)),
                "kind": "gpu",
                "processes": len(ids),
                "gpu_ids": ",".join(map(str, ids)),
            }
    except ValueError:
        pass
    fail(
        f"cannot read setup {spec!r}; write cpu:N (N CPU processes), gpu:N (N GPUs), ids:0,4 (those GPUs) or "
        "dp:N (DataParallel over N GPUs)"
    )


def split_setups(setups) -> list[dict]:
    """fire turns 'gpu:1,ids:0,1' into a tuple; rejoin and split at each kind prefix so ids keep
    their commas."""
    text = ",".join(map(str, setups)) if isinstance(setups, (list, tuple)) else str(setups)
    specs, current = [], ""
    for part in text.split(","):
        if ":" in part or not current:
            if current:
                specs.append(current)
            current = part
        else:
            current += "," + part
    specs.append(current)
    parsed = [parse_setup(s.strip()) for s in specs if s.strip()]
    if any(p["processes"] < 1 or p.get("devices", 1) < 1 for p in parsed):
        fail("every setup needs at least one process")
    return parsed


def default_setups() -> str:
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        return ",".join(f"gpu:{n}" for n in (1, 2, 4, 8, 16) if n <= gpus)
    return "cpu:1,cpu:2"


def launch_command(setup: dict, threads: int, precision: str | None) -> tuple[list[str], dict]:
    """`accelerate launch` argv and environment for a setup, with the configs `make` uses."""
    n = setup["processes"]
    env = dict(os.environ)
    # Through this interpreter: its `accelerate` console
    # script need not sit beside it (pip --target installs).
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    if setup["kind"] == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
        config = "cpu"
    else:
        config = "1gpu" if n == 1 else "2gpu"
    command += [
        "--config_file",
        str(CONFIGS / f"{config}.yaml"),
        "--num_processes",
        str(n),
        "--num_cpu_threads_per_process",
        str(threads),
    ]
    if setup["gpu_ids"]:
        command += ["--gpu_ids", setup["gpu_ids"]]
    if precision:
        command += ["--mixed_precision", precision]
    return command, env


def run_logged(command: list[str], env: dict, log: Path) -> None:
    """Run one launch, its output into LOG; on failure show the log's tail and stop."""
    print("$ " + " ".join(command), flush=True)
    with log.open("w") as out:
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        fail(f"this setup failed (exit {code}); last lines of {log}:\n{tail}")


# ------------------------------------------------------------------------------------------ figures
def throughput(run_dir: Path, warmup: int) -> dict:
    """Samples/s and step time of one run from its results.json and per-step metrics.jsonl, warm-up
    steps left out."""
    results_file = run_dir / "results.json"
    if not results_file.is_file():
        fail(f"{results_file} does not exist: point `report` at the output_dir of finished recipe runs")
    results = json.loads(results_file.read_text())
    steps = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            record = json.loads(line)
            if "perf/step_seconds" in record:
                steps.append((record["step"], record["perf/step_seconds"]))
    measured = [seconds for step, seconds in steps if step > warmup]
    if len(measured) >= 2:
        step_seconds = statistics.fmean(measured)
        source = f"mean of {len(measured)} logged steps after {warmup} warm-up"
    else:  # logged too sparsely: the recipe's own figure (first step excluded)
        step_seconds = results["global_batch_size"] / results["train_samples_per_second"]
        source = "results.json train_samples_per_second"
    busbw = None
    allreduce_file = run_dir / "allreduce.json"
    if allreduce_file.is_file():
        sizes = json.loads(allreduce_file.read_text())["sizes"]
        busbw = min(sizes, key=lambda row: abs(row["bytes"] - DDP_BUCKET_BYTES))["busbw_gbps"]
    layout_file = run_dir / "layout.json"  # written by run --layouts beside each layout's run
    layout = json.loads(layout_file.read_text()) if layout_file.is_file() else None
    return {
        "setup": run_dir.name,
        "layout": layout,
        "parameters": results.get("parameters"),
        "gradient_accumulation_steps": results.get("gradient_accumulation_steps", 1),
        "world_size": results["world_size"],
        "devices": results.get("devices", results["world_size"]),  # DataParallel: 1 process, N GPUs
        "parallelism": results.get("parallelism", "DDP"),
        "num_machines": results.get("num_machines", 1),
        "device": results.get("device", "?"),
        "mixed_precision": results.get("mixed_precision"),
        "global_batch_size": results["global_batch_size"],
        "per_process_batch_size": results["per_process_batch_size"],
        "trainable_parameters": results.get("trainable_parameters"),
        "step_seconds": step_seconds,
        "samples_per_second": results["global_batch_size"] / step_seconds,
        "step_time_source": source,
        "busbw_gbps": busbw,
    }


def analyse(rows: list[dict]) -> list[dict]:
    """Speed-up and efficiency against the 1-process row, and the ring all-reduce model's
    prediction."""
    base = next((r for r in rows if r["devices"] == 1), None)
    per_process = {r["per_process_batch_size"] for r in rows}
    if len(per_process) > 1:
        print(
            f"warning: the runs use different batches per process {sorted(per_process)}; speed-ups compare "
            "unlike work"
        )
    for row in rows:
        n = row["devices"]
        row.update(
            speedup=None,
            efficiency=None,
            comm_seconds=None,
            predicted_efficiency=None,
            prediction_error=None,
            limited_by=None,
        )
        if base is None:
            continue
        row["speedup"] = row["samples_per_second"] / base["samples_per_second"]
        row["efficiency"] = row["speedup"] / n
        if n == 1:  # nothing to exchange
            row.update(comm_seconds=0.0, predicted_efficiency=1.0, limited_by="compute")
            continue
        if row["parallelism"] == "DataParallel":
            # weights broadcast and gradients reduced to GPU 0 every step: not the ring model
            continue
        if row["busbw_gbps"] and row["trainable_parameters"]:
            gradient_bytes = 4 * row["trainable_parameters"]
            comm = 2 * (n - 1) / n * gradient_bytes / (row["busbw_gbps"] * 1e9)
            t1 = base["step_seconds"]
            row["comm_seconds"] = comm
            row["predicted_efficiency"] = t1 / (t1 + comm)
            row["prediction_error"] = row["efficiency"] - row["predicted_efficiency"]
            if comm > t1:
                row["limited_by"] = "interconnect"
            elif row["efficiency"] < row["predicted_efficiency"] - 0.15:
                # neither compute per process nor the all-reduce explains it
                row["limited_by"] = "shared resources"
            else:
                row["limited_by"] = "compute"
    return rows


def _f(value, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def processes(row: dict) -> str:
    if row["parallelism"] == "DataParallel":
        return f"1 (DataParallel, {row['devices']} GPUs)"
    return str(row["world_size"])


def markdown(rows: list[dict]) -> str:
    lines = [
        "| setup | processes | nodes | samples/s | speed-up | efficiency | busbw GB/s | all-reduce ms/step "
        "| predicted efficiency | error | limited by |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        comm_ms = None if r["comm_seconds"] is None else r["comm_seconds"] * 1e3
        lines.append(
            f"| {r['setup']} | {processes(r)} | {r['num_machines']} | {r['samples_per_second']:.1f} | "
            f"{_f(r['speedup'], '.2f')} | {_f(r['efficiency'], '.0%')} | {_f(r['busbw_gbps'], '.3g')} | "
            f"{_f(comm_ms, '.1f')} | {_f(r['predicted_efficiency'], '.0%')} | "
            f"{_f(None if r['prediction_error'] is None else r['prediction_error'] * 100, '+.0f')} | "
            f"{r['limited_by'] or '-'} |"
        )
    first = rows[0]
    notes = [
        "",
        f"Per-process batch {first['per_process_batch_size']}, mixed precision {first['mixed_precision']}, "
        f"device {first['device']}; {first['trainable_parameters'] or '?'} trainable parameters, so "
        f"{_f(first['trainable_parameters'] and 4 * first['trainable_parameters'] / 1e6, '.1f')} MB of fp32 "
        "gradients all-reduced per step.",
        "Efficiency = speed-up / processes. Predicted = t1 / (t1 + t_comm), t_comm = 2(n-1)/n x gradient "
        "bytes / busbw "
        "(ring all-reduce, no overlap with the backward pass); error = measured - predicted, in points.",
        "Limited by: interconnect when the all-reduce takes longer than the compute of a step; shared "
        "resources when "
        "the run is more than 15 points below the prediction (cores, memory bandwidth, PCIe or data loading "
        "shared between processes); otherwise compute.",
    ]
    return "\n".join(lines + notes) + "\n"


def chart(rows: list[dict], path: Path) -> Path | None:
    """Samples/s against processes with the linear ideal, and measured vs predicted efficiency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: matplotlib is not installed (pip install 'accelerate-recipes[bench]')")
        return None
    names = [r["setup"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [r["samples_per_second"] for r in rows], color="tab:blue", label="measured")
    base = next((r for r in rows if r["world_size"] == 1), None)
    if base:
        left.plot(
            names,
            [base["samples_per_second"] * r["world_size"] for r in rows],
            "k--",
            marker="o",
            label="linear (n x 1 process)",
        )
    left.set_ylabel("training samples/s")
    left.set_title("throughput")
    left.legend()
    positions = range(len(rows))
    right.bar(
        [p - 0.2 for p in positions],
        [100 * (r["efficiency"] or 0) for r in rows],
        width=0.4,
        color="tab:blue",
        label="measured",
    )
    right.bar(
        [p + 0.2 for p in positions],
        [100 * (r["predicted_efficiency"] or 0) for r in rows],
        width=0.4,
        color="tab:orange",
        label="ring all-reduce model",
    )
    right.set_xticks(list(positions), names)
    right.set_ylabel("scaling efficiency (%)")
    right.set_ylim(0, 110)
    right.set_title("efficiency: measured vs predicted")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# ------------------------------------------------------------------------------------------ layouts
# layout -> the accelerate config it runs
LAYOUTS = {"ddp": "2node", "fsdp": "fsdp", "hsdp": "2node-hsdp"}
RECIPES = {"text": "text_classification.py", "sft": "sft.py", "dpo": "dpo.py", "grpo": "grpo.py"}


def layout_traffic(row: dict) -> dict:
    """Bytes one optimizer step moves under the row's layout: derived from the ring arithmetic, not
    measured.

    A ring all-reduce of K bytes over n processes sends 2(n-1)/n x K from every process; an
    all-gather or a reduce-scatter sends half that, (n-1)/n x K. A ring over several nodes crosses
    from one node to the next once, so what a process sends is also what its node sends over the
    network. DDP all-reduces the fp32 gradients; FSDP2 all-gathers the weights in the forward and
    again in the backward pass of every micro-batch and reduce-scatters the gradients (both in the
    precision's dtype); HSDP does that within a node and all-reduces each process's 1/n of the
    gradients with its counterparts on the other nodes.
    """
    layout, nodes = row["layout"], row["num_machines"]
    total = row["world_size"]
    # FSDP2's param_dtype and reduce_dtype
    width = 2 if row["mixed_precision"] in ("bf16", "fp16") else 4
    gathers = 2 * row["gradient_accumulation_steps"] * width * (row["parameters"] or 0)
    if layout["name"] == "ddp":  # one ring over every process: each of its links carries the same
        ring = 2 * (total - 1) / total * 4 * row["trainable_parameters"]
        return {"network": ring, "within_node": ring}
    gradients = width * row["trainable_parameters"]
    if layout["name"] == "fsdp":
        ring = (total - 1) / total * (gathers + gradients)
        return {"network": ring, "within_node": ring}
    shard = layout["shard"]
    across = 2 * (nodes - 1) / nodes * gradients
    return {"network": across, "within_node": (shard - 1) / shard * (gathers + gradients)}


def size(count: float) -> str:
    """Bytes in the unit that reads best: 49.2 kB, 15.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"


def layouts_markdown(rows: list[dict]) -> str:
    """The layouts' table: measured throughput, and against DDP's, beside each layout's derived
    traffic."""
    ddp = next((r for r in rows if r["layout"]["name"] == "ddp"), None)
    lines = [
        "| layout | processes | nodes | shard group | samples/s | vs DDP "
        "| network bytes/step per node (derived) | within a node bytes/step per process (derived) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        traffic = layout_traffic(r)
        versus = r["samples_per_second"] / ddp["samples_per_second"] if ddp else None
        lines.append(
            f"| {r['layout']['name']} | {r['world_size']} | {r['num_machines']} | {r['layout']['shard']} | "
            f"{r['samples_per_second']:.1f} | {_f(versus, '.2f')} | {size(traffic['network'])} | "
            f"{size(traffic['within_node'])} |"
        )
    first = rows[0]
    lines += [
        "",
        f"{first['parameters'] or '?'} parameters, {first['trainable_parameters'] or '?'} trainable, mixed "
        f"precision {first['mixed_precision']}, global batch {first['global_batch_size']}. Traffic from the "
        "ring arithmetic (docs/multinode.md): DDP 2(N-1)/N x the fp32 gradients; FSDP (N-1)/N x (2 "
        "all-gathers of the weights per micro-batch + a reduce-scatter of the gradients), all of it across "
        "the nodes; HSDP the same within a node and 2(M-1)/M x the gradients across. Shard group: the "
        "processes that hold one copy of the model between them.",
    ]
    return "\n".join(lines) + "\n"


def layout_command(layout: str, nodes: int, per_node: int, node: dict, settings: dict):
    """`accelerate launch` argv and environment of one layout on this node (every node runs the same
    one)."""
    env = dict(os.environ)
    if settings["on_cpu"]:
        env["ACCELERATE_USE_CPU"] = "true"
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    command += ["--config_file", str(CONFIGS / f"{LAYOUTS[layout]}.yaml")]
    command += ["--num_machines", str(nodes), "--num_processes", str(nodes * per_node)]
    command += ["--machine_rank", str(node["rank"]), "--main_process_ip", node["address"]]
    command += ["--main_process_port", str(node["port"]), "--rdzv_conf", f"timeout={node['timeout']}"]
    command += ["--num_cpu_threads_per_process", str(settings["threads"])]
    if layout == "hsdp":  # the config's mesh, sized to these nodes: one shard group per node
        command += ["--parallelism_config_dp_replicate_size", str(nodes)]
        command += ["--parallelism_config_dp_shard_size", str(per_node)]
    command += ["--mixed_precision", settings["precision"]]
    return command, env


def run_layouts(names, recipe: str, nodes: int, per_node: int, node: dict, settings: dict) -> None:
    """Each layout in turn on every node (the same command there), then node 0's report."""
    listed = names if isinstance(names, (list, tuple)) else str(names).split(",")
    chosen = [str(name).strip() for name in listed if str(name).strip()]
    unknown = [name for name in chosen if name not in LAYOUTS]
    if unknown or not chosen:
        fail(f"--layouts {','.join(chosen)}: use some of {','.join(LAYOUTS)}, e.g. --layouts ddp,fsdp,hsdp")
    if recipe not in RECIPES:
        fail(f"--recipe {recipe}: use one of {', '.join(RECIPES)}")
    if nodes < 2 or per_node < 2:
        fail(f"--layouts needs 2+ nodes of 2+ processes (got --num_machines {nodes}, --per_node {per_node})")
    if not node["address"]:
        fail("--layouts runs on every node: pass node 0's --main_process_ip and each node's --machine_rank")
    # fire read `--recipe_args --model M` as a switch
    if not isinstance(settings["recipe_args"], str):
        fail("write the recipe's flags after an = sign: --recipe_args='--model M --train_file chats.jsonl'")
    out = Path(settings["output_dir"])
    run_dirs = []
    for index, layout in enumerate(chosen):
        run_dir = out / layout
        # Node 0 owns the run's folder (on a shared file system the nodes see one): it starts it
        # fresh, as a recipe does not start over an earlier run; the other nodes log beside it.
        log = run_dir / "train.log" if not node["rank"] else out / f"{layout}-node{node['rank']}.log"
        if not node["rank"]:
            shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        # a port per layout: the last one's may still be closing
        this = dict(node, port=node["port"] + index)
        command, env = layout_command(layout, nodes, per_node, this, settings)
        print(f"\n== {layout}: {nodes} node(s) x {per_node} process(es), {LAYOUTS[layout]}.yaml", flush=True)
        flags = [str(REPO / "recipes" / RECIPES[recipe]), *settings["recipe_args"].split()]
        flags += ["--batch_size", str(settings["per_device_batch"] * nodes * per_node)]
        flags += ["--max_steps", str(settings["steps"]), "--log_every", "1", "--checkpoint_every", "0"]
        flags += ["--tracker", "none", "--output_dir", str(run_dir)]
        run_logged(command + flags, env, log)
        if not node["rank"]:
            shard = {"ddp": 1, "fsdp": nodes * per_node, "hsdp": per_node}[layout]
            (run_dir / "layout.json").write_text(json.dumps({"name": layout, "shard": shard}) + "\n")
        run_dirs.append(str(run_dir))
    if node["rank"]:
        print(f"\nnode {node['rank']} done: node 0 writes the report ({out / 'layouts.md'} there)")
        return
    rows = [throughput(Path(d), settings["warmup"]) for d in run_dirs]
    table = layouts_markdown(rows)
    (out / "layouts.md").write_text("# Layouts over several nodes\n\n" + table)
    (out / "layouts.json").write_text(json.dumps({"benchmark": "layouts", "rows": rows}, indent=2) + "\n")
    print("\n" + table)
    print(f"saved {out / 'layouts.md'}, {out / 'layouts.json'}")


def report(*run_dirs: str, output_dir: str = "outputs/scaling", warmup: int = 3) -> None:
    """Build the table, chart and JSON from finished runs (each a recipe output_dir with
    results.json).

    Args:
        run_dirs: output folders of recipe runs; an allreduce.json beside results.json gives that
            setup's busbw.
        output_dir: where scaling.md, scaling.json and scaling.png go.
        warmup: logged steps left out of each run's step time.
    """
    if not run_dirs:
        fail("name the run folders to compare, e.g. report outputs/scaling/cpu-1 outputs/scaling/cpu-2")
    rows = analyse([throughput(Path(d), warmup) for d in run_dirs])
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    (out / "scaling.md").write_text("# Scaling report\n\n" + table)
    (out / "scaling.json").write_text(json.dumps({"benchmark": "scaling", "rows": rows}, indent=2) + "\n")
    png = chart(rows, out / "scaling.png")
    print("\n" + table)
    print(f"saved {out / 'scaling.md'}, {out / 'scaling.json'}" + (f", {png}" if png else ""))


# ---------------------------------------------------------------------------------------------- run
def run(  # noqa: PLR0913
    setups: str | None = None,
    per_device_batch: int | None = None,
    steps: int = 30,
    warmup: int = 5,
    arch: str = "resnet18",
    precision: str | None = None,
    output_dir: str = "outputs/scaling",
    recipe_args: str = "",
    layouts: str | None = None,
    recipe: str = "sft",
    num_machines: int = 2,
    per_node: int | None = None,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
    startup_timeout: int = 300,
):
    """Train recipes/cifar.py in throughput mode on each setup, then write the scaling report.

    Args:
        setups: comma-separated list of cpu:N (N CPU processes over gloo), gpu:N (N GPUs), ids:a,b
            (those GPUs) and dp:N (torch.nn.DataParallel: one process, N GPUs, same global batch as
            gpu:N); default gpu:1,gpu:2,gpu:4,gpu:8 up to the GPUs present, else cpu:1,cpu:2.
        per_device_batch: batch per process, the same in every setup; default 256 on GPUs, 16 on the
            CPU.
        steps: optimizer steps per run (every step is logged).
        warmup: first steps left out of the step time (start-up, cuDNN autotuning, allocator
            growth).
        arch: resnet18, resnet34 or resnet50 (the gradient size the all-reduce moves grows with
            it).
        precision: no, bf16 or fp16; default bf16 on GPUs, no on the CPU.
        output_dir: each setup writes OUTPUT_DIR/<setup>/; the report goes to OUTPUT_DIR.
        recipe_args: extra flags for recipes/cifar.py, e.g. "--channels_last False"; with --layouts,
            the flags of --recipe (model and data: "--model M --train_file chats.jsonl --lora_r
            16").
        layouts: instead of the setups, compare these layouts over several nodes: some of ddp, fsdp,
            hsdp (the same command on every node, each with its --machine_rank); the report is
            OUTPUT_DIR/layouts.md.
        recipe: with --layouts, the recipe to train: text, sft, dpo or grpo.
        num_machines: with --layouts, the number of nodes.
        per_node: with --layouts, processes per node; default the GPUs here (2 CPU processes without
            GPUs).
        machine_rank: with --layouts, this node's rank (0 on the main node).
        main_process_ip: with --layouts, node 0's address, the same on every node.
        main_process_port: with --layouts, the first layout's port (the next layouts take the next
            ports).
        startup_timeout: with --layouts, seconds a node waits for the others at each start.
    """
    if layouts:
        import torch

        gpus = torch.cuda.device_count()
        per_node = per_node or gpus or 2
        on_cpu = not gpus
        settings = {
            "on_cpu": on_cpu,
            "output_dir": output_dir,
            "threads": max(1, usable_cores() // per_node),
            "precision": precision or ("no" if on_cpu else "bf16"),
            "per_device_batch": per_device_batch or (2 if on_cpu else 8),
            "steps": steps,
            "warmup": warmup,
            "recipe_args": recipe_args,
        }
        if steps <= warmup + 1:
            fail(f"--steps {steps} leaves fewer than 2 measured steps after --warmup {warmup}")
        node = {"rank": machine_rank, "address": main_process_ip, "port": main_process_port}
        node["timeout"] = startup_timeout
        run_layouts(layouts, recipe, num_machines, per_node, node, settings)
        return
    chosen = split_setups(setups or default_setups())
    on_cpu = all(s["kind"] == "cpu" for s in chosen)
    if any(s["kind"] == "cpu" for s in chosen) and not on_cpu:
        fail("mix of cpu and gpu setups: compare like with like, one kind per report")
    wanted = max((s["devices"] for s in chosen if s["kind"] == "dp"), default=0)
    if wanted:
        import torch

        if torch.cuda.device_count() < wanted:
            fail(
                f"dp:{wanted} needs {wanted} GPUs (DataParallel drives GPUs only); "
                f"{torch.cuda.device_count()} visible"
            )
    per_device_batch = per_device_batch or (16 if on_cpu else 256)
    precision = precision or ("no" if on_cpu else "bf16")
    if steps <= warmup + 1:
        fail(f"--steps {steps} leaves fewer than 2 measured steps after --warmup {warmup}")
    cores = usable_cores()  # the affinity mask (taskset, SLURM), not the machine's core count
    # Every process gets the same number of cores in every setup, as every GPU process gets one GPU:
    # on the CPU the cores are the "device", and a 1-process run with all cores would not be the
    # unit the others are compared to.
    threads = max(1, cores // max(s["processes"] for s in chosen))
    workers = min(8, threads - 1)  # DataLoader workers per process, also the same everywhere
    out = Path(output_dir)
    run_dirs = []
    for setup in chosen:
        run_dir = out / setup["name"]
        # fresh: the recipe will not start over an earlier run's checkpoints
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        n = setup["processes"]
        if setup["kind"] == "dp":
            devices = setup["devices"]
            print(
                f"\n== {setup['name']}: 1 process, DataParallel over {devices} GPUs, batch "
                f"{per_device_batch} per GPU",
                flush=True,
            )
            run_logged(
                [
                    sys.executable,
                    str(REPO / "benchmarks" / "dataparallel.py"),
                    "--gpus",
                    str(devices),
                    "--batch_size",
                    str(per_device_batch * devices),
                    "--steps",
                    str(steps),
                    "--arch",
                    arch,
                    "--precision",
                    precision,
                    "--output_dir",
                    str(run_dir),
                ],
                dict(os.environ),
                run_dir / "train.log",
            )
            run_dirs.append(str(run_dir))
            continue
        command, env = launch_command(setup, threads, precision)
        print(f"\n== {setup['name']}: {n} process(es), batch {per_device_batch} per process", flush=True)
        if n > 1:
            run_logged(
                command
                + [
                    str(REPO / "benchmarks" / "allreduce.py"),
                    "--min_bytes",
                    str(DDP_BUCKET_BYTES),
                    "--max_bytes",
                    str(DDP_BUCKET_BYTES),
                    "--output_dir",
                    str(run_dir),
                ],
                env,
                run_dir / "allreduce.log",
            )
        global_batch = per_device_batch * n
        recipe = [
            str(REPO / "recipes" / "cifar.py"),
            "--dataset",
            "synthetic",
            "--arch",
            arch,
            "--synthetic_size",
            str(global_batch * steps),
            "--batch_size",
            str(global_batch),
            "--max_steps",
            str(steps),
            "--log_every",
            "1",
            "--num_workers",
            str(workers),
            "--tracker",
            "none",
            "--output_dir",
            str(run_dir),
        ]
        run_logged(command + recipe + recipe_args.split(), env, run_dir / "train.log")
        run_dirs.append(str(run_dir))
    report(*run_dirs, output_dir=output_dir, warmup=warmup)


if __name__ == "__main__":
    fire.Fire({"run": run, "report": report})
