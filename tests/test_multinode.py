"""One-command multi-node launch from a hostfile, and the SLURM per-node script, on two "nodes" on
127.0.0.1."""

import os
import shlex
import signal
import socket
import subprocess
import time

import pytest
from conftest import (
    ACCELERATE,
    CIFAR_SCRIPT,
    CONFIGS,
    PYTHON,
    REPO,
    TINY,
    check,
    fails_with,
    free_port,
    processes_with,
    read_metrics,
    read_results,
    recipe_env,
    run,
    start_in_own_session,
    time_limit,
)

from accelerate_recipes.meter import FIGURES, SLOW_LOG_STEPS, SLOW_MARGIN
from recipe_tools import multinode

LAUNCHER = [PYTHON, "-m", "recipe_tools.multinode"]


def two_local_nodes(tmp_path, slots=(1, 1)):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two nodes on this machine\n" + "".join(f"localhost slots={s}\n" for s in slots))
    return hostfile


def test_hostfile_with_two_localhost_nodes_trains_the_recipe(tmp_path):
    out = tmp_path / "out"
    proc = check(
        run(
            [
                *LAUNCHER,
                "--hostfile",
                two_local_nodes(tmp_path),
                "--main_process_port",
                free_port(),
                "--launch_args",
                "--num_cpu_threads_per_process 1",
                CIFAR_SCRIPT,
                *TINY,
                "--output_dir",
                out,
            ],
            recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
            timeout=300,
        )
    )
    results = read_results(out)
    assert (results["world_size"], results["num_machines"]) == (2, 2)
    assert results["samples_seen_per_process"] == [16, 16]
    # each node's figures: here those of its one process, told apart by the node rank torchrun gives
    assert results["node_of_process"] == [0, 1]
    for name in FIGURES:
        assert results[f"{name}_per_node"] == pytest.approx(results[f"{name}_per_process"]), name
    logged = [m for m in read_metrics(out) if "train/loss" in m]
    assert [m["step"] for m in logged] == [1, 2]
    assert all(f"node/{name}/node{n}" in m for m in logged for name in FIGURES for n in (0, 1))
    lines = proc.stdout.splitlines()
    assert any(line.startswith("[localhost:0]") and "2 process(es) on 2 machine(s)" in line for line in lines)
    assert any(line.startswith("[localhost:1]") for line in lines)
    assert lines[-1] == "all 2 node(s) finished"


def throttle(pid: int, until) -> None:
    """Hold the process `pid` stopped 60 ms of every 100 until `until()` holds: 40% of a CPU, as a
    quota or a card that throttles its clocks leaves a worker."""
    try:
        while not until():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.06)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.04)
    except ProcessLookupError:
        pass  # it ended
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)


def test_a_throttled_process_is_named_once_and_the_others_wait_for_it(tmp_path):
    """DDP on 2 gloo processes, rank 1 throttled to 40% of a CPU from the first log step on: every
    process's figures show the others waiting for it (rank 0's communication wait is about rank 1's
    extra compute), and after SLOW_LOG_STEPS slow log steps in a row one warning line names it;
    results.json lists it."""
    out, log = tmp_path / "out", tmp_path / "run.log"
    flags = [*TINY]
    flags[flags.index("--max_steps") + 1] = "5"  # logged at every step; step 1 is never judged
    launch = [ACCELERATE, "launch", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2"]
    launch += ["--num_cpu_threads_per_process", "1", "--main_process_port", free_port()]
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true", SLOW_TEST_RUN=str(tmp_path))
    proc = start_in_own_session([*launch, CIFAR_SCRIPT, *flags, "--output_dir", out], env, log)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + time_limit(120)
        while not (metrics.is_file() and metrics.stat().st_size) and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        running = processes_with("SLOW_TEST_RUN", str(tmp_path)).items()
        rank1 = [pid for pid, e in running if e.get("RANK") == "1"]
        assert len(rank1) == 1, log.read_text()[-3000:]

        def ended_or_warned() -> bool:
            return proc.poll() is not None or "warning: process" in log.read_text()

        throttle(rank1[0], until=ended_or_warned)
        assert proc.wait(timeout=time_limit(120)) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = log.read_text().splitlines()
    warnings = [line for line in lines if line.startswith("warning: process")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("warning: process 1 (node 0) is the slowest"), warnings
    warned_at = int(warnings[0].split("(step ")[1].split(")")[0])
    assert read_results(out)["slow_processes"] == [1]
    rows = {m["step"]: m for m in read_metrics(out) if "train/loss" in m}
    judged = range(warned_at - SLOW_LOG_STEPS + 1, warned_at + 1)
    assert judged[0] >= 2, warned_at
    for step in judged:
        row = rows[step]
        busy = [row[f"process/compute_seconds/rank{r}"] for r in (0, 1)]
        busy = [b + row[f"process/data_seconds/rank{r}"] for r, b in enumerate(busy)]
        waits = [row[f"process/comm_seconds/rank{r}"] for r in (0, 1)]
        assert busy[1] > (1 + SLOW_MARGIN) * busy[0], (step, busy)
        # DDP's lockstep: rank 0 waits in the all-reduce for most of what rank 1 computes longer
        assert waits[0] > waits[1] and waits[0] > 0.5 * (busy[1] - busy[0]), (step, busy, waits)
        steps = [row[f"process/step_seconds/rank{r}"] for r in (0, 1)]
        assert abs(steps[0] - steps[1]) < 0.25 * max(steps), (step, steps)


def test_one_failing_node_stops_the_others(tmp_path):
    # Node 1 fails after two seconds; node 0 would run for ten minutes unless the launcher stops it.
    script = tmp_path / "fail_on_node_1.py"
    script.write_text(
        "import os, sys, time\n"
        "node = int(os.environ['GROUP_RANK'])\n"
        f"open(r'{tmp_path}' + f'/node{{node}}.pid', 'w').write(str(os.getpid()))\n"
        "if node == 1:\n    time.sleep(2)\n    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    proc = run(
        [*LAUNCHER, "--hostfile", two_local_nodes(tmp_path), "--main_process_port", free_port(), script],
        recipe_env(tmp_path, ACCELERATE_USE_CPU="true"),
        timeout=120,
    )
    assert proc.returncode != 0
    assert (
        "error: node localhost (machine rank 1) exited with code 1; the other nodes were stopped"
        in proc.stderr
    )
    assert time.monotonic() - started < 90
    for node in (0, 1):
        pid = int((tmp_path / f"node{node}.pid").read_text())
        assert not os.path.exists(f"/proc/{pid}"), f"node {node}'s training process {pid} is still running"


def test_hostfile_and_port_errors(tmp_path):
    env = recipe_env(tmp_path)
    bad = tmp_path / "bad.txt"
    bad.write_text("node1 slots=8\nnode2 8\n")
    fails_with(
        run([*LAUNCHER, "--hostfile", bad, CIFAR_SCRIPT], env),
        "bad.txt:2: cannot read 'node2 8'",
        "`node1 slots=8`",
    )
    fails_with(
        run([*LAUNCHER, "--hostfile", two_local_nodes(tmp_path, (2, 1)), CIFAR_SCRIPT], env),
        "different slots per node (localhost=2, localhost=1)",
    )
    fails_with(
        run([*LAUNCHER, "--hostfile", tmp_path / "none.txt", CIFAR_SCRIPT], env), "none.txt does not exist"
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        fails_with(
            run(
                [
                    *LAUNCHER,
                    "--hostfile",
                    two_local_nodes(tmp_path),
                    "--main_process_port",
                    port,
                    CIFAR_SCRIPT,
                ],
                env,
            ),
            f"port {port} on 0.0.0.0 is in use",
            "--main_process_port",
        )


def test_remote_nodes_get_ssh_with_rank_address_and_forwarded_network_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("gpu-a slots=8\ngpu-b slots=8\n")
    args = multinode.parse_args(
        [
            "--hostfile",
            str(hostfile),
            "--main_process_ip",
            "10.0.0.1",
            "--workdir",
            "/srv/my proj",
            "--env",
            "SWANLAB_MODE=offline",
            "recipes/cifar.py",
            "--epochs",
            "5",
        ]
    )
    hosts = multinode.read_hostfile(args.hostfile)
    command = multinode.node_command(1, hosts, args)
    assert command[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"] and command[5] == "gpu-b"
    shell, flag, script = shlex.split(command[6])  # what the remote login shell runs
    assert (shell, flag) == ("bash", "-c")
    assert script.startswith("cd '/srv/my proj' || exit 2")
    launch = next(line for line in script.splitlines() if " launch " in line)
    assert "NCCL_SOCKET_IFNAME=eth0" in launch and "SWANLAB_MODE=offline" in launch
    assert (
        "--num_machines 2 --num_processes 16 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port "
        "29500"
    ) in launch
    assert launch.rstrip(" &").endswith("recipes/cifar.py --epochs 5")

    # --restarts 2 (make <recipe>-hostfile RESTARTS=2): each node's elastic agent restarts its
    # workers, the group re-formed through c10d, every start continuing from the last checkpoint
    args = multinode.parse_args(
        ["--hostfile", str(hostfile), "--restarts", "2", "recipes/cifar.py", "--epochs", "5"]
    )
    script = shlex.split(multinode.node_command(1, hosts, args)[6])[2]
    launch = next(line for line in script.splitlines() if " launch " in line)
    assert "--max_restarts 2 --rdzv_backend c10d" in launch
    assert launch.rstrip(" &").endswith("recipes/cifar.py --epochs 5 --resume auto")


def wait_for_listener(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + time_limit(timeout)
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def test_slurm_node_script_joins_two_nodes_through_c10d(tmp_path):
    # What srun runs on each node of multi_node.sbatch, with the variables SLURM sets. On one
    # machine both nodes could host the rendezvous; on a cluster only the first node owns
    # MASTER_ADDR, so node 0 starts first here.
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            env = recipe_env(
                tmp_path,
                ACCELERATE_USE_CPU="true",
                SLURM_NNODES=2,
                SLURM_NODEID=node,
                GPUS_PER_NODE=1,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                ACCELERATE=ACCELERATE,
                LAUNCH_ARGS="--num_cpu_threads_per_process 1",
            )
            procs.append(
                subprocess.Popen(
                    [
                        str(REPO / "slurm" / "node_launch.sh"),
                        str(REPO / "benchmarks" / "allreduce.py"),
                        "--max_bytes",
                        "4096",
                        "--output_dir",
                        str(tmp_path / f"out{node}"),
                    ],
                    env=env,
                    cwd=REPO,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
            if node == 0:
                wait_for_listener(port)
        outputs = [p.communicate(timeout=time_limit(180))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    assert "node 1 of 2" in outputs[1] and "rendezvous 127.0.0.1" in outputs[0]
    # c10d hands out ranks itself: exactly one node hosts global rank 0 and writes the report.
    written = [path for node in (0, 1) if (path := tmp_path / f"out{node}" / "allreduce.json").exists()]
    assert len(written) == 1
    assert '"world_size": 2' in written[0].read_text()


def test_slurm_node_script_outside_slurm_says_how_to_run_it(tmp_path):
    proc = run([REPO / "slurm" / "node_launch.sh", CIFAR_SCRIPT], recipe_env(tmp_path))
    assert (
        proc.returncode != 0 and "run this through srun inside an sbatch or salloc allocation" in proc.stderr
    )


def test_sbatch_script_passes_the_stop_signal_on_and_requeues_with_resume_auto(tmp_path):
    # SLURM does not run here: `srun` and `scontrol` are small stand-ins that record what the script
    # asks of them. What is tested is the script's own logic: USR1 from SLURM -> SIGTERM to the
    # training step -> wait -> requeue.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$@" > {tmp_path}/srun_args\n'
        f"trap 'kill $sleeper; echo TERM > {tmp_path}/srun_signal; exit 75' TERM\n"
        "sleep 60 >/dev/null 2>&1 & sleeper=$!\n"
        "wait $sleeper\n"
    )
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\nif [ "$1" = show ]; then echo node-a; exit 0; fi\necho "$@" > '
        f"{tmp_path}/scontrol_args\n"
    )
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = recipe_env(
        tmp_path, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-a,node-b", SLURM_CPUS_PER_TASK="64"
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    job = subprocess.Popen(
        ["bash", str(REPO / "slurm" / "multi_node.sbatch"), "recipes/cifar.py", "--epochs", "5"],
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + time_limit(30)
    while not (tmp_path / "srun_args").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@180` sends to the batch script
    output = job.communicate(timeout=time_limit(30))[0]
    assert job.returncode == 0, output
    assert (tmp_path / "srun_signal").read_text().strip() == "TERM"
    assert (tmp_path / "scontrol_args").read_text().split() == ["requeue", "4242"]
    assert (tmp_path / "srun_args").read_text().split()[-4:] == ["--epochs", "5", "--resume", "auto"]
    # SLURM >= 22.05 gives srun's task one core unless srun itself asks for the batch job's
    # --cpus-per-task.
    assert "--cpus-per-task=64" in (tmp_path / "srun_args").read_text().split()
