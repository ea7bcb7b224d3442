"""Make targets expand to the accelerate commands the README promises."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, time_limit

# the environment running the tests; `make -n` only prints, so nothing is installed
VENV = Path(sys.prefix)


def make(*args):
    # -o: the install stamps count as up to date, so a target run for real (to see its check fail)
    # never reinstalls the package into the environment running the tests.
    extras = ("", "-text", "-detect", "-chat", "-deepspeed", "-bench", "-dev")
    stamps = [f"-o{VENV}/.installed{extra}" for extra in extras]
    return subprocess.run(
        ["make", "--no-print-directory", f"VENV={VENV}", *stamps, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=time_limit(60),
    )


def launch_line(proc):
    lines = [line for line in proc.stdout.splitlines() if "accelerate launch" in line]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


def test_gpu_targets_expand_to_accelerate_launch_with_their_config():
    for setup in ("1gpu", "2gpu", "4gpu", "8gpu"):
        line = launch_line(make("-n", f"cifar-{setup}", "ARGS=--epochs 1"))
        assert f"accelerate launch --config_file accelerate_configs/{setup}.yaml" in line
        assert line.rstrip().endswith("recipes/cifar.py --epochs 1")


def test_gpu_ids_and_precision_reach_the_launcher():
    line = launch_line(make("-n", "cifar-2gpu", "GPU_IDS=2,3", "PRECISION=fp16"))
    assert "--gpu_ids 2,3" in line and "--mixed_precision fp16" in line


def test_2node_target_passes_rank_address_and_port():
    line = launch_line(make("-n", "cifar-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=29600"))
    assert "accelerate launch --config_file accelerate_configs/2node.yaml" in line
    assert "--machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29600" in line
    # a node left alone stops after STARTUP_TIMEOUT seconds
    assert "--rdzv_conf timeout=300" in line
    assert "recipes/cifar.py" in line


def test_2node_without_master_addr_says_what_to_set():
    proc = make("cifar-2node", "NODE_RANK=1")
    assert proc.returncode != 0 and "set MASTER_ADDR" in proc.stderr


def test_cpu_target_runs_processes_on_the_cpu():
    line = launch_line(make("-n", "cifar-cpu", "NPROC=4"))
    assert line.startswith("ACCELERATE_USE_CPU=true") and "accelerate_configs/cpu.yaml" in line
    assert "--num_processes 4" in line and "--num_cpu_threads_per_process" in line


def test_help_lists_every_cifar_target():
    out = make("help").stdout
    for target in ("install", "test", "demo", "cifar-cpu", "cifar-1gpu", "cifar-2node"):
        assert f"  {target} " in out


def test_text_targets_use_the_same_configs_and_variables():
    line = launch_line(make("-n", "text-8gpu", "PRECISION=fp16", "ARGS=--task mrpc"))
    assert (
        "accelerate launch --config_file accelerate_configs/8gpu.yaml" in line
        and "--mixed_precision fp16" in line
    )
    assert line.rstrip().endswith("recipes/text_classification.py --task mrpc")
    line = launch_line(make("-n", "text-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"))
    assert "2node.yaml" in line and "--machine_rank 1 --main_process_ip 10.0.0.1" in line


def test_text_cpu_defaults_to_the_offline_data_and_args_replace_them():
    line = launch_line(make("-n", "text-cpu"))
    assert (
        line.startswith("ACCELERATE_USE_CPU=true") and "--train_file data/rotten_tomatoes/train.csv" in line
    )
    line = launch_line(make("-n", "text-cpu", "ARGS=--train_file mine.csv --validation_file dev.csv"))
    assert line.rstrip().endswith(
        "recipes/text_classification.py --train_file mine.csv --validation_file dev.csv"
    )


def test_sft_targets_launch_the_chat_recipe_and_sft_cpu_defaults_to_the_offline_task():
    line = launch_line(make("-n", "sft-1gpu", "ARGS=--train_file chats.jsonl --lora_r 16"))
    assert "accelerate launch --config_file accelerate_configs/1gpu.yaml" in line
    assert line.rstrip().endswith("recipes/sft.py --train_file chats.jsonl --lora_r 16")
    line = launch_line(make("-n", "sft-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"))
    assert (
        "2node.yaml" in line
        and "--machine_rank 1 --main_process_ip 10.0.0.1" in line
        and "recipes/sft.py" in line
    )
    proc = make("-n", "sft-cpu")
    assert "benchmarks/sft_bench.py write_data --output data/sft_rotten_tomatoes" in proc.stdout
    line = launch_line(proc)
    assert line.startswith("ACCELERATE_USE_CPU=true") and "recipes/sft.py --model $(" in line
    assert "--train_file data/sft_rotten_tomatoes/train.jsonl" in line and "--lora_r 16" in line
    line = launch_line(make("-n", "sft-cpu", "ARGS=--train_file mine.jsonl"))
    assert line.rstrip().endswith("recipes/sft.py --train_file mine.jsonl")
    out = make("help").stdout
    for target in ("sft-cpu", "sft-1gpu", "sft-2node", "sft-hostfile", "sft-data"):
        assert f"  {target} " in out


def test_grpo_targets_launch_the_grpo_recipe_and_grpo_cpu_defaults_to_the_offline_task():
    line = launch_line(make("-n", "grpo-8gpu", "ARGS=--train_file math.jsonl --lora_r 16"))
    assert "--config_file accelerate_configs/8gpu.yaml" in line
    assert line.rstrip().endswith("recipes/grpo.py --train_file math.jsonl --lora_r 16")
    line = launch_line(make("-n", "grpo-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"))
    assert (
        "2node.yaml" in line
        and "--machine_rank 1 --main_process_ip 10.0.0.1" in line
        and "recipes/grpo.py" in line
    )
    proc = make("-n", "grpo-cpu")
    assert "benchmarks/grpo_bench.py write_data --output data/grpo_arithmetic" in proc.stdout
    line = launch_line(proc)
    assert line.startswith("ACCELERATE_USE_CPU=true") and "recipes/grpo.py --model $(" in line
    assert "--train_file data/grpo_arithmetic/train.jsonl" in line and "--reward number" in line
    line = launch_line(make("-n", "grpo-fsdp", "GPUS=4", "ARGS=--train_file math.jsonl"))
    assert (
        "accelerate_configs/fsdp.yaml" in line and "--num_processes 4" in line and "recipes/grpo.py" in line
    )
    assert "accelerate_configs/deepspeed.yaml" in launch_line(make("-n", "grpo-deepspeed"))
    assert make("-n", "bench-grpo").stdout.splitlines()[-1].rstrip().endswith("benchmarks/grpo_bench.py run")
    last = make("-n", "bench-grpo-generation").stdout.splitlines()[-1].rstrip()
    assert last.endswith("benchmarks/grpo_bench.py generation")
    out = make("help").stdout
    for target in (
        "grpo-cpu",
        "grpo-1gpu",
        "grpo-2node",
        "grpo-hostfile",
        "grpo-fsdp",
        "grpo-deepspeed",
        "bench-grpo",
    ):
        assert f"  {target} " in out
    assert "  bench-grpo-generation " in out


def test_dpo_targets_launch_the_dpo_recipe_and_dpo_cpu_defaults_to_the_offline_pairs():
    line = launch_line(make("-n", "dpo-4gpu", "ARGS=--train_file pairs.jsonl --lora_r 16"))
    assert "--config_file accelerate_configs/4gpu.yaml" in line
    assert line.rstrip().endswith("recipes/dpo.py --train_file pairs.jsonl --lora_r 16")
    line = launch_line(make("-n", "dpo-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"))
    assert (
        "2node.yaml" in line
        and "--machine_rank 1 --main_process_ip 10.0.0.1" in line
        and "recipes/dpo.py" in line
    )
    proc = make("-n", "dpo-cpu")
    assert "benchmarks/dpo_bench.py write_data --output data/dpo_rotten_tomatoes" in proc.stdout
    line = launch_line(proc)
    assert line.startswith("ACCELERATE_USE_CPU=true") and "recipes/dpo.py --model $(" in line
    assert "--train_file data/dpo_rotten_tomatoes/train.jsonl" in line and "--eval_generate 4" in line
    line = launch_line(make("-n", "-o", "dpo-data", "dpo-cpu", "STARTER=1"))
    assert "recipes/starters/dpo.py" in line and "--eval_generate" not in line
    line = launch_line(make("-n", "dpo-fsdp", "GPUS=2", "ARGS=--train_file pairs.jsonl"))
    assert "accelerate_configs/fsdp.yaml" in line and "--num_processes 2" in line and "recipes/dpo.py" in line
    assert "accelerate_configs/deepspeed.yaml" in launch_line(make("-n", "dpo-deepspeed"))
    assert make("-n", "bench-dpo").stdout.splitlines()[-1].rstrip().endswith("benchmarks/dpo_bench.py run")
    out = make("help").stdout
    for target in (
        "dpo-cpu",
        "dpo-1gpu",
        "dpo-2node",
        "dpo-hostfile",
        "dpo-fsdp",
        "dpo-deepspeed",
        "dpo-data",
    ):
        assert f"  {target} " in out
    assert "  bench-dpo " in out


def test_sharded_targets_pick_their_config_and_gpu_count():
    line = launch_line(make("-n", "text-fsdp", "GPUS=4"))
    assert "--config_file accelerate_configs/fsdp.yaml" in line and "--num_processes 4" in line
    line = launch_line(make("-n", "text-deepspeed"))
    assert "accelerate_configs/deepspeed.yaml" in line and "--num_processes" not in line
    line = launch_line(make("-n", "sft-fsdp", "GPUS=4", "ARGS=--train_file chats.jsonl --lora_r 16"))
    assert "--config_file accelerate_configs/fsdp.yaml" in line and "--num_processes 4" in line
    assert line.rstrip().endswith("recipes/sft.py --train_file chats.jsonl --lora_r 16")
    proc = make("-n", "sft-deepspeed", "GPU_IDS=0,1", "ARGS=--train_file chats.jsonl")
    line = launch_line(proc)
    assert "--config_file accelerate_configs/deepspeed.yaml" in line and "--num_processes 2" in line
    assert line.rstrip().endswith("recipes/sft.py --train_file chats.jsonl")
    out = make("help").stdout
    assert "  sft-fsdp " in out and "  sft-deepspeed " in out
    # the concepts guide's "when the model does not fit" command
    lines = make("-n", "sharding", "ARGS=--processes 4").stdout.splitlines()
    assert lines[-1].endswith("benchmarks/sharding.py run --processes 4") and "  sharding " in out
    assert "make sharding" in (REPO / "docs" / "concepts.md").read_text()


def test_help_lists_every_text_target():
    out = make("help").stdout
    for target in ("text-cpu", "text-1gpu", "text-2node", "text-fsdp", "text-deepspeed", "bench-text"):
        assert f"  {target} " in out


def test_topo_target_passes_file_gpu_count_and_config():
    out = make("-n", "topo", "TOPO=saved.txt", "GPUS=4", "WRITE_CONFIG=best4.yaml").stdout
    assert "-m recipe_tools.topology --file saved.txt --gpus 4" in out and "--write_config best4.yaml" in out


def test_allreduce_targets_launch_the_benchmark_with_the_recipe_configs():
    line = launch_line(make("-n", "allreduce-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"))
    assert (
        "2node.yaml" in line
        and "--machine_rank 1" in line
        and line.rstrip().endswith("benchmarks/allreduce.py")
    )
    assert launch_line(make("-n", "allreduce-cpu")).startswith("ACCELERATE_USE_CPU=true")
    assert "  allreduce-8gpu " in make("help").stdout


def test_hostfile_targets_start_the_multinode_launcher_with_launch_options():
    proc = make(
        "-n",
        "cifar-hostfile",
        "HOSTFILE=hosts.txt",
        "GPU_IDS=0,1",
        "PRECISION=bf16",
        "MASTER_PORT=29700",
        "ARGS=--epochs 2",
    )
    line = next(line for line in proc.stdout.splitlines() if "recipe_tools.multinode" in line)
    assert (
        "--hostfile hosts.txt --config_file accelerate_configs/2node.yaml --main_process_port 29700" in line
    )
    assert '--launch_args "--gpu_ids 0,1 --mixed_precision bf16"' in line
    assert line.rstrip().endswith("recipes/cifar.py --epochs 2")
    assert "recipes/text_classification.py" in make("-n", "text-hostfile", "HOSTFILE=h").stdout
    missing = make("cifar-hostfile")
    assert (
        missing.returncode != 0
        and "set HOSTFILE to a file with one 'hostname slots=N' line" in missing.stderr
    )


def test_doctor_target_passes_the_node_settings():
    proc = make("-n", "doctor", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1", "CONFIG=8gpu", "ARGS=--timeout 60")
    text = " ".join(proc.stdout.replace("\\\n", " ").split())
    assert (
        "-m recipe_tools.doctor --config_file accelerate_configs/8gpu.yaml --machine_rank 1 "
        "--main_process_ip 10.0.0.1 --main_process_port 29500 --timeout 60"
    ) in text
    assert "set MASTER_ADDR" in make("doctor").stderr


def test_detect_targets_cover_every_setup_with_the_shared_variables():
    for setup in ("1gpu", "2gpu", "4gpu", "8gpu"):
        line = launch_line(make("-n", f"detect-{setup}", "ARGS=--data d/data.yaml", "GPU_IDS=0,1"))
        assert f"--config_file accelerate_configs/{setup}.yaml --gpu_ids 0,1" in line
        assert line.rstrip().endswith("recipes/detect/train.py --data d/data.yaml")
    line = launch_line(make("-n", "detect-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.2"))
    assert "--machine_rank 1 --main_process_ip 10.0.0.2" in line and "recipes/detect/train.py" in line
    proc = make("-n", "detect-cpu")  # no ARGS: the real tree-crown tiles, written first, offline
    assert "benchmarks/tree_crowns.py --out data/tree-crowns" in proc.stdout
    line = launch_line(proc)
    assert line.startswith("ACCELERATE_USE_CPU=true") and "train.py --data data/tree-crowns/data.yaml" in line
    # your data: the tree crowns are not needed
    proc = make("-n", "detect-cpu", "ARGS=--data mine/data.yaml")
    assert "tree_crowns.py" not in proc.stdout and "deepforest" not in proc.stdout
    assert launch_line(proc).rstrip().endswith("recipes/detect/train.py --data mine/data.yaml")
    out = make("help").stdout
    for target in ("detect-cpu", "detect-1gpu", "detect-2node", "bench-detect"):
        assert f"  {target} " in out


def test_gpu_ids_set_the_process_count_so_no_rank_lacks_a_gpu():
    # 8gpu.yaml says 8 processes; with 4 ids, ranks 4-7
    # would find no GPU ("invalid device ordinal").
    line = launch_line(make("-n", "cifar-8gpu", "GPU_IDS=0,1,2,3"))
    assert (
        "--config_file accelerate_configs/8gpu.yaml --gpu_ids 0,1,2,3" in line
        and "--num_processes 4 " in line
    )
    # without ids: the config's count
    assert "--num_processes" not in launch_line(make("-n", "cifar-8gpu"))
    line = launch_line(make("-n", "text-2node", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1", "GPU_IDS=0,1,2,3"))
    assert "--num_processes 8 " in line  # the same 4 ids on each of the 2 nodes
    assert "--num_processes 2 " in launch_line(make("-n", "text-fsdp", "GPU_IDS=4,5"))
    proc = make("cifar-1gpu", "GPU_IDS=0,1")
    assert proc.returncode == 2 and "accelerate launch" not in proc.stdout
    assert proc.stderr.splitlines()[0] == (
        "error: GPU_IDS=0,1 names 2 GPUs but cifar-1gpu runs one process: use one id or make cifar-2gpu "
        "GPU_IDS=0,1"
    )


def test_cpu_threads_follow_the_cores_make_may_use():
    # nproc counts the affinity mask (taskset, SLURM, cpusets): one allowed core gives one thread,
    # whatever the machine.
    first = min(os.sched_getaffinity(0))
    pinned = subprocess.run(
        ["make", "--no-print-directory", f"VENV={VENV}", "-n", "detect-cpu", "NPROC=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=time_limit(60),
        preexec_fn=lambda: os.sched_setaffinity(0, {first}),
    )
    assert "--num_processes 1 --num_cpu_threads_per_process 1 " in launch_line(pinned)
    line = launch_line(make("-n", "detect-cpu", "NPROC=1"))
    assert f"--num_cpu_threads_per_process {len(os.sched_getaffinity(0))} " in line
    # The default NPROC=2 on this machine's cores: each process gets its share, at least one thread.
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"--num_processes 2 --num_cpu_threads_per_process {share} " in launch_line(
        make("-n", "detect-cpu")
    )


def test_system_python_runs_every_target_as_it_is_without_venv_or_install():
    """PYTHON_ENV=system: the interpreter given, no venv, no pip; the install step is a check of
    what it lacks."""
    proc = make(
        "-n",
        "cifar-2gpu",
        "text-cpu",
        "gpu-check",
        "AFTER=docs/gpu-proof.json",
        "PYTHON_ENV=system",
        "PYTHON=/opt/py/bin/python3",
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert not any(".venv" in line or str(VENV) in line or "-m venv" in line for line in lines), proc.stdout
    assert "/opt/py/bin/python3 -m recipe_tools.wheelhouse check --extras 'text,detect'" in lines
    assert any(
        line.startswith(
            "/opt/py/bin/python3 -m accelerate.commands.accelerate_cli launch --config_file "
            "accelerate_configs/2gpu.yaml"
        )
        and line.rstrip().endswith("recipes/cifar.py")
        for line in lines
    ), proc.stdout
    assert "/opt/py/bin/python3 benchmarks/gpu_check --after docs/gpu-proof.json" in [
        line.strip() for line in lines
    ]
    # the checkout is on PYTHONPATH for the scripts, ahead of what the user had there
    proc = subprocess.run(
        ["make", "--no-print-directory", "-p", "-n", "help", "PYTHON_ENV=system"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=time_limit(60),
        env=dict(os.environ, PYTHONPATH="/extra"),
    )
    assert f"PYTHONPATH := {REPO}:/extra" in proc.stdout
    proc = make("help", "PYTHON_ENV=conda")
    assert proc.returncode != 0 and "choose venv (the default" in proc.stderr


def test_starter_runs_the_recipes_starter_with_the_same_launch_and_a_recipe_without_one_is_named():
    starters = {"cifar-8gpu": "cifar.py", "text-2gpu": "text_classification.py", "sft-1gpu": "sft.py"}
    for target, starter in starters.items():
        line = launch_line(make("-n", target, "STARTER=1", "ARGS=--epochs 1"))
        assert f"recipes/starters/{starter} --epochs 1" in line, line
        assert launch_line(make("-n", target)).split(" recipes/")[0] == line.split(" recipes/")[0]
    line = launch_line(make("-n", "sft-2node", "STARTER=1", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"))
    assert (
        "2node.yaml" in line
        and "--machine_rank 1" in line
        and line.rstrip().endswith("recipes/starters/sft.py")
    )
    # sft-cpu without ARGS: the starter's own defaults, without the full recipe's --eval_generate
    line = launch_line(make("-n", "-o", "sft-data", "sft-cpu", "STARTER=1"))
    assert "recipes/starters/sft.py --model" in line and "--eval_generate" not in line, line
    proc = make("-n", "detect-2gpu", "STARTER=1")
    assert proc.returncode != 0 and "recipes/detect/train.py has no starter" in proc.stderr, proc.stderr
    assert "recipes/starters/cifar.py" in proc.stderr


def test_restarts_launch_through_the_elastic_agent_and_continue_from_the_last_checkpoint():
    """RESTARTS=N on every <recipe>-<setup> target: the launcher restarts the workers up to N times,
    each start with --resume auto (unless ARGS names a --resume of its own); several nodes meet
    through c10d rendezvous. The launch itself is run with a killed worker in
    test_cifar_training.py."""
    for target in ("cifar-cpu", "cifar-1gpu", "sft-2gpu", "detect-8gpu"):
        line = launch_line(make("-n", target, "RESTARTS=2", "ARGS=--epochs 1"))
        assert "--max_restarts 2" in line and line.rstrip().endswith("--epochs 1 --resume auto"), line
    line = launch_line(
        make("-n", "cifar-2gpu", "RESTARTS=1", "ARGS=--resume outputs/x/checkpoints/step_00000008")
    )
    assert "--max_restarts 1" in line and line.count("--resume") == 1
    line = launch_line(make("-n", "cifar-2node", "RESTARTS=1", "MASTER_ADDR=10.0.0.1"))
    assert (
        "--max_restarts 1" in line
        and "--rdzv_backend c10d" in line
        and line.rstrip().endswith("--resume auto")
    )
    # without RESTARTS, as before
    assert "--max_restarts" not in launch_line(make("-n", "cifar-2gpu"))
    hostfile = make("-n", "cifar-hostfile", "HOSTFILE=hosts.txt", "RESTARTS=3").stdout
    assert "recipe_tools.multinode" in hostfile and "--restarts 3" in hostfile and "--resume auto" in hostfile
