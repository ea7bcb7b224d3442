"""Every way users start the recipe forms one process group, and every shipped config starts what it promises."""

import subprocess

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from conftest import ACCELERATE, CIFAR_SCRIPT, CONFIGS, PYTHON, TINY, TORCHRUN, check, free_port, read_results, recipe_env, run

# file -> (processes in total, machines); what each config promises.
PROMISES = {"1gpu": (1, 1), "2gpu": (2, 1), "4gpu": (4, 1), "8gpu": (8, 1), "2node": (16, 2), "cpu": (2, 1),
            "fsdp": (8, 1), "deepspeed": (8, 1)}
DISTRIBUTED_TYPE = {"1gpu": "NO", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}  # the others: MULTI_GPU


def test_configs_are_the_ones_we_test():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(PROMISES)


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_config_is_valid_for_accelerate(name):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    processes, machines = PROMISES[name]
    assert (config.num_processes, config.num_machines) == (processes, machines)
    assert config.distributed_type.value == DISTRIBUTED_TYPE.get(name, "MULTI_GPU")
    assert config.mixed_precision == ("no" if name == "cpu" else "bf16")
    # Checkpoints are per-rank shards; save_pretrained gathers the whole model (FSDP2 always, ZeRO-3 with this flag).
    if name == "fsdp":
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    if name == "deepspeed":
        assert config.deepspeed_config["zero3_save_16bit_model"] is True
        # The launcher would export these over the recipe's --gradient_accumulation_steps and --max_grad_norm.
        assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(config.deepspeed_config)
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert "main_process_ip" not in raw, "the node's main address must come from the command line"


def launch_nodes(config: str, tmp_path, machines: int, processes: int, extra=(), timeout=420):
    """Start `machines` accelerate launchers on 127.0.0.1, as two nodes would, and wait for all of them."""
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true")
    port = free_port()
    out = tmp_path / "out"
    cmds = [
        [ACCELERATE, "launch", "--config_file", CONFIGS / f"{config}.yaml", "--num_processes", processes,
         "--num_cpu_threads_per_process", "1", "--machine_rank", rank, "--main_process_ip", "127.0.0.1",
         "--main_process_port", port, CIFAR_SCRIPT, *TINY, *extra, "--output_dir", out]
        for rank in range(machines)
    ]
    procs = [subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in cmds]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-5000:]
    return read_results(out), outputs


@pytest.mark.parametrize("name", ["1gpu", "2gpu", "4gpu", "8gpu", "cpu"])
def test_each_single_machine_config_launches_its_world_size(name, tmp_path):
    processes, _ = PROMISES[name]
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true")
    out = tmp_path / "out"
    check(run([ACCELERATE, "launch", "--config_file", CONFIGS / f"{name}.yaml", "--num_cpu_threads_per_process", "1",
               CIFAR_SCRIPT, *TINY, "--output_dir", out], env, timeout=400))
    results = read_results(out)
    assert (results["world_size"], results["num_machines"]) == (processes, 1)
    assert results["mixed_precision"] == ("no" if name == "cpu" else "bf16")
    assert results["samples_seen_per_process"] == [2 * 16 // processes] * processes


def test_2node_config_as_shipped_runs_16_processes_on_two_nodes(tmp_path):
    results, outputs = launch_nodes("2node", tmp_path, machines=2, processes=16)
    assert (results["world_size"], results["num_machines"]) == (16, 2)
    assert results["eval_samples"] == results["test_size"] == 32


def test_torchrun(tmp_path):
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="1")
    check(run([TORCHRUN, "--nproc_per_node", "2", "--master_port", free_port(), CIFAR_SCRIPT, *TINY,
               "--output_dir", tmp_path / "out"], env))
    assert read_results(tmp_path / "out")["world_size"] == 2


def test_deprecated_torch_distributed_launch_passes_local_rank(tmp_path):
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="1")
    # It appends --local-rank=N to the script's arguments; the recipe accepts and ignores it.
    check(run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", free_port(),
               CIFAR_SCRIPT, *TINY, "--output_dir", tmp_path / "out"], env))
    assert read_results(tmp_path / "out")["world_size"] == 2


def test_multi_gpu_launch_without_gpus_is_stopped_by_the_guard(tmp_path):
    env = recipe_env(tmp_path)  # no ACCELERATE_USE_CPU: the trap
    proc = run([ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", free_port(),
                "--num_cpu_threads_per_process", "1", CIFAR_SCRIPT, *TINY, "--output_dir", tmp_path / "out"], env)
    assert proc.returncode != 0
    assert "did not form one process group" in proc.output and "ACCELERATE_USE_CPU=true" in proc.output
    assert not (tmp_path / "out" / "results.json").exists()
