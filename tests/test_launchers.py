"""Every way users start the recipe forms one process group, and every shipped config starts what it
promises."""

import json
import subprocess

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from conftest import (
    ACCELERATE,
    CIFAR_SCRIPT,
    CONFIGS,
    PYTHON,
    REPO,
    TINY,
    TORCHRUN,
    check,
    free_port,
    read_results,
    recipe_env,
    run,
    time_limit,
)

# file -> (processes in total, machines); what each config promises.
PROMISES = {
    "1gpu": (1, 1),
    "2gpu": (2, 1),
    "4gpu": (4, 1),
    "8gpu": (8, 1),
    "2node": (16, 2),
    "2node-hsdp": (16, 2),
    "cpu": (2, 1),
    "fsdp": (8, 1),
    "deepspeed": (8, 1),
}
# the others: MULTI_GPU
DISTRIBUTED_TYPE = {"1gpu": "NO", "fsdp": "FSDP", "2node-hsdp": "FSDP", "deepspeed": "DEEPSPEED"}


def test_configs_are_the_ones_we_test():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(PROMISES)


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_config_is_valid_for_accelerate(name):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    processes, machines = PROMISES[name]
    assert (config.num_processes, config.num_machines) == (processes, machines)
    assert config.distributed_type.value == DISTRIBUTED_TYPE.get(name, "MULTI_GPU")
    assert config.mixed_precision == ("no" if name == "cpu" else "bf16")
    # Checkpoints are per-rank shards; save_pretrained gathers the whole model (FSDP2 always, ZeRO-3
    # with this flag).
    if name == "fsdp":
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    if name == "deepspeed":
        assert config.deepspeed_config["zero3_save_16bit_model"] is True
        # The launcher would export these over the recipe's --gradient_accumulation_steps and
        # --max_grad_norm.
        assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(config.deepspeed_config)
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert "main_process_ip" not in raw, "the node's main address must come from the command line"


PROBE = REPO / "tests" / "probe_ranks.py"


def probe_records(out, processes: int) -> list[dict]:
    """What each launched process of tests/probe_ranks.py saw, by rank; every rank wrote once and
    joined one group."""
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"rank{rank}.json" for rank in range(processes))
    assert [r["rank"] for r in records] == list(range(processes))
    assert {r["world_size"] for r in records} == {r["joined"] for r in records} == {processes}
    return records


def launch_nodes(config: str, tmp_path, machines: int, processes: int, timeout=300):
    """Start `machines` accelerate launchers of the probe on 127.0.0.1, as two nodes would, and wait
    for all of them."""
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true")
    port = free_port()
    out = tmp_path / "out"
    cmds = [
        [
            ACCELERATE,
            "launch",
            "--config_file",
            CONFIGS / f"{config}.yaml",
            "--num_processes",
            processes,
            "--num_cpu_threads_per_process",
            "1",
            "--machine_rank",
            rank,
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            PROBE,
            out,
        ]
        for rank in range(machines)
    ]
    procs = [
        subprocess.Popen(
            [str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd in cmds
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=time_limit(timeout))[0])
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-5000:]
    return probe_records(out, processes)


# The launchers are proven with a probe that only forms the process group: a recipe under every
# config would start ~37 processes importing torchvision and transformers. The recipe itself runs on
# two nodes in test_multinode.py, under torch.distributed.launch
# below, and on 2-4 processes across the suite.
@pytest.mark.parametrize("name", ["1gpu", "2gpu", "4gpu", "8gpu", "cpu"])
def test_each_single_machine_config_launches_its_world_size(name, tmp_path):
    processes, _ = PROMISES[name]
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true")
    out = tmp_path / "out"
    port = [] if name == "1gpu" else ["--main_process_port", free_port()]
    check(
        run(
            [
                ACCELERATE,
                "launch",
                "--config_file",
                CONFIGS / f"{name}.yaml",
                *port,
                "--num_cpu_threads_per_process",
                "1",
                PROBE,
                out,
            ],
            env,
            timeout=300,
        )
    )
    records = probe_records(out, processes)
    assert [r["local_rank"] for r in records] == list(range(processes))
    assert {r["machine_rank"] for r in records} == {0}
    assert {r["distributed_type"] for r in records} == {"NO" if processes == 1 else "MULTI_CPU"}
    assert {r["mixed_precision"] for r in records} == {"no" if name == "cpu" else "bf16"}


def test_2node_config_as_shipped_runs_16_processes_on_two_nodes(tmp_path):
    records = launch_nodes("2node", tmp_path, machines=2, processes=16)
    # Ranks 0-7 on node 0 and 8-15 on node 1, each node numbering its processes 0-7.
    assert [r["machine_rank"] for r in records] == [0] * 8 + [1] * 8
    assert [r["local_rank"] for r in records] == list(range(8)) * 2
    assert {r["distributed_type"] for r in records} == {"MULTI_CPU"}
    assert {r["mixed_precision"] for r in records} == {"bf16"}


def test_torchrun(tmp_path):
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="1")
    check(
        run([TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(), PROBE, tmp_path / "out"], env)
    )
    records = probe_records(tmp_path / "out", 2)
    assert [r["local_rank"] for r in records] == [0, 1]
    assert {r["distributed_type"] for r in records} == {"MULTI_CPU"}


def test_deprecated_torch_distributed_launch_passes_local_rank(tmp_path):
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="1")
    # It appends --local-rank=N to the script's arguments; the recipe accepts and ignores it.
    check(
        run(
            [
                PYTHON,
                "-m",
                "torch.distributed.launch",
                "--nproc_per_node",
                "2",
                "--master_port",
                free_port(),
                CIFAR_SCRIPT,
                *TINY,
                "--output_dir",
                tmp_path / "out",
            ],
            env,
        )
    )
    assert read_results(tmp_path / "out")["world_size"] == 2


def test_multi_gpu_launch_without_gpus_is_stopped_by_the_guard(tmp_path):
    env = recipe_env(tmp_path)  # no ACCELERATE_USE_CPU: the trap
    proc = run(
        [
            ACCELERATE,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--main_process_port",
            free_port(),
            "--num_cpu_threads_per_process",
            "1",
            CIFAR_SCRIPT,
            *TINY,
            "--output_dir",
            tmp_path / "out",
        ],
        env,
    )
    assert proc.returncode != 0
    assert "did not form one process group" in proc.output and "ACCELERATE_USE_CPU=true" in proc.output
    assert not (tmp_path / "out" / "results.json").exists()
