"""Start-up that cannot hang: a missing main node or rank, a busy port, GPU ids that do not exist,
and a SIGTERM sent to the launcher of a multi-process run."""

import signal
import socket
import subprocess
import time

from conftest import (
    ACCELERATE,
    CIFAR_SCRIPT,
    CONFIGS,
    PYTHON,
    REPO,
    TINY,
    fails_with,
    free_port,
    recipe_env,
    run,
    time_limit,
)


def lone_process(tmp_path, rank: int, port: int, timeout: int = 10) -> subprocess.Popen:
    """One process of a world of two, started the way torchrun starts it, whose partner never
    comes."""
    env = recipe_env(
        tmp_path,
        ACCELERATE_USE_CPU="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        WORLD_SIZE=2,
        RANK=rank,
        LOCAL_RANK=0,
        LOCAL_WORLD_SIZE=1,
    )
    return subprocess.Popen(
        [
            PYTHON,
            str(CIFAR_SCRIPT),
            *TINY,
            "--dist_timeout",
            str(timeout),
            "--output_dir",
            str(tmp_path / f"out{rank}"),
        ],
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_a_rank_that_never_joins_and_a_missing_main_node_end_within_the_timeout(tmp_path):
    # Both at once, on separate ports: rank 0 waits for a rank 1 that never comes, rank 1 for a main
    # that never comes.
    started = time.monotonic()
    main_alone = lone_process(tmp_path, 0, free_port())
    port = free_port()
    worker_alone = lone_process(tmp_path, 1, port)
    out0, err0 = main_alone.communicate(timeout=time_limit(180))
    out1, err1 = worker_alone.communicate(timeout=time_limit(180))
    # 10 s of waiting; the rest is importing torch and building the data on a loaded 2-core machine.
    assert time.monotonic() - started < 120
    for proc, stderr in ((main_alone, err0), (worker_alone, err1)):
        proc.stderr, proc.stdout, proc.output, proc.returncode = stderr, "", stderr, proc.returncode
    fails_with(
        main_alone,
        "only 1 of 2 processes joined the main process at 127.0.0.1:",
        "within 10 s",
        "--machine_rank",
        "--dist_timeout",
    )
    fails_with(
        worker_alone, f"process 1 of 2 could not reach the main process at 127.0.0.1:{port} within 10 s"
    )


def test_launcher_with_a_rendezvous_timeout_stops_a_lone_node(tmp_path):
    # What `make cifar-2node` runs on node 0 while node 1
    # never starts: the launcher gives up after the timeout.
    started = time.monotonic()
    proc = run(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            CONFIGS / "2node.yaml",
            "--num_processes",
            "2",
            "--machine_rank",
            "0",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            free_port(),
            "--rdzv_conf",
            "timeout=5",
            "--num_cpu_threads_per_process",
            "1",
            CIFAR_SCRIPT,
            *TINY,
            "--output_dir",
            tmp_path / "out",
        ],
        recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
        timeout=180,
    )
    assert proc.returncode != 0
    assert "1/2 clients joined" in proc.output
    assert time.monotonic() - started < 120


def test_busy_port_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = lone_process(tmp_path, 0, port)
        stdout, stderr = proc.communicate(timeout=time_limit(180))
    proc.stdout, proc.stderr, proc.output = stdout, stderr, stdout + stderr
    fails_with(proc, f"port {port} on 127.0.0.1 is in use", "--main_process_port")


def test_gpu_ids_that_do_not_exist_are_named(tmp_path):
    proc = run(
        [
            ACCELERATE,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--gpu_ids",
            "0,7",
            "--num_cpu_threads_per_process",
            "1",
            "--main_process_port",
            free_port(),
            CIFAR_SCRIPT,
            *TINY,
            "--output_dir",
            tmp_path / "out",
        ],
        recipe_env(tmp_path),
        timeout=180,
    )
    assert proc.returncode != 0
    # Each rank checks on its own; the first to exit makes the launcher stop the other, so one or
    # two lines come out.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert 1 <= len(errors) <= 2 and all(
        "CUDA_VISIBLE_DEVICES=0,7" in e and "nvidia-smi -L" in e for e in errors
    ), errors


def test_sigterm_to_the_launcher_stops_both_ranks_at_one_step_with_one_checkpoint(tmp_path):
    out, log = tmp_path / "out", tmp_path / "launch.log"
    args = [
        "--dataset",
        "synthetic",
        "--synthetic_size",
        "80",
        "--batch_size",
        "8",
        "--epochs",
        "2",
        "--checkpoint_every",
        "0",
        "--tracker",
        "none",
        "--num_workers",
        "0",
    ]
    proc = subprocess.Popen(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            str(CONFIGS / "cpu.yaml"),
            "--num_processes",
            "2",
            "--num_cpu_threads_per_process",
            "1",
            "--main_process_port",
            str(free_port()),
            str(CIFAR_SCRIPT),
            *args,
            "--output_dir",
            str(out),
        ],
        env=recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    marker = out / "checkpoints" / "step_00000010" / "checkpoint.json"  # the end of epoch 1
    deadline = time.monotonic() + time_limit(300)
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    # as SLURM or Kubernetes stop the job: the launcher passes it to its workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=time_limit(120)) != 0
    text = log.read_text()
    stops = [line for line in text.splitlines() if line.startswith("stopped:")]
    # rank 0 reports for both
    assert len(stops) == 1 and "SIGTERM at step" in stops[0], text[-3000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 2 and saved[-1] > "step_00000010" and saved[-1] in stops[0]
