"""The multi-node preflight, with real doctor processes playing the nodes on 127.0.0.1 (CPU, gloo,
offline)."""

import inspect
import re
import socket
import subprocess
import time

import pytest
import torch
from conftest import PYTHON, REPO, fails_with, free_port, recipe_env, run, time_limit

from recipe_tools import doctor
from recipe_tools.doctor import missing_interfaces

# Two nodes of one process each: the smallest multi-node run.
CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 2
num_processes: 2
machine_rank: 0
main_process_port: 29500
gpu_ids: all
mixed_precision: 'no'
main_training_function: main
rdzv_backend: static
same_network: true
use_cpu: false
debug: false
"""


def doctor_cmd(config, rank, port, *args, ip="127.0.0.1", timeout=20):
    return [
        PYTHON,
        "-m",
        "recipe_tools.doctor",
        "--config_file",
        config,
        "--machine_rank",
        rank,
        "--main_process_ip",
        ip,
        "--main_process_port",
        port,
        "--timeout",
        timeout,
        *args,
    ]


def node_env(tmp_path, **extra):
    env = recipe_env(tmp_path, ACCELERATE_USE_CPU="true", **extra)
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        if key not in extra:
            env.pop(key, None)
    return env


def write_config(tmp_path):
    path = tmp_path / "2node.yaml"
    path.write_text(CONFIG)
    return path


def test_two_nodes_on_one_machine_pass_and_list_both(tmp_path):
    config, port, env = write_config(tmp_path), free_port(), node_env(tmp_path)
    cmds = [doctor_cmd(config, rank, port) for rank in (0, 1)]
    nodes = [
        subprocess.Popen(
            [str(c) for c in cmd],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd in cmds
    ]
    try:
        outputs = [node.communicate(timeout=time_limit(90)) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out + err
        assert "doctor: all checks passed on 2 node(s)" in out
        assert "ok  gloo all_reduce across 2 node(s) gave the right sum" in out
        assert "--  NCCL all-reduce not run: CPU run" in out  # one line saying why, no GPU here
        rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[01]\s", line)]
        assert [row[0] for row in rows] == ["0", "1"], out
        assert all(row[2] == torch.__version__ for row in rows), out
    # the same table on every node
    assert outputs[0][0].split("nodes:")[1] == outputs[1][0].split("nodes:")[1]


def test_unreachable_main_node_fails_after_the_timeout(tmp_path):
    port = free_port()  # nobody listens there
    start = time.monotonic()
    proc = run(doctor_cmd(write_config(tmp_path), 1, port, timeout=3), node_env(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    fails_with(proc, f"127.0.0.1:{port}", "within 3s", "firewall", "--main_process_port")
    assert proc.returncode == 2
    assert 3 <= elapsed < 25, elapsed  # waited for the timeout, not for torch's default of minutes


def test_main_node_alone_says_how_many_nodes_joined(tmp_path):
    port = free_port()
    proc = run(doctor_cmd(write_config(tmp_path), 0, port, timeout=3), node_env(tmp_path), timeout=60)
    fails_with(proc, "only 1 of 2 nodes joined", f"127.0.0.1:{port}", "ranks seen: [0]", "--machine_rank")
    assert proc.returncode == 2


def test_busy_port_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run(doctor_cmd(write_config(tmp_path), 0, port, timeout=3), node_env(tmp_path), timeout=60)
    fails_with(proc, f"port {port} on 127.0.0.1 is in use", "--main_process_port", f"ss -ltnp | grep :{port}")
    assert proc.returncode == 2


def test_num_processes_must_divide_over_the_nodes(tmp_path):
    proc = run(
        doctor_cmd(write_config(tmp_path), 1, free_port(), "--num_processes", 3),
        node_env(tmp_path),
        timeout=60,
    )
    fails_with(proc, "num_processes 3 is not divisible by num_machines 2", "set num_processes to 2 or 4")
    assert proc.returncode == 2


def test_unknown_gloo_interface_lists_the_real_ones(tmp_path):
    proc = run(
        doctor_cmd(write_config(tmp_path), 1, free_port()),
        node_env(tmp_path, GLOO_SOCKET_IFNAME="nosuch0"),
        timeout=60,
    )
    names = [name for _, name in socket.if_nameindex()]
    fails_with(proc, "GLOO_SOCKET_IFNAME='nosuch0'", "nosuch0 not found", ", ".join(names))
    assert proc.returncode == 2


def test_interface_lists_follow_nccl_and_gloo_syntax():
    names = [name for _, name in socket.if_nameindex()]
    first = names[0]
    assert missing_interfaces("^docker", names) == []  # exclusion: nothing has to exist
    assert missing_interfaces("^=docker0,lo", names) == []
    assert missing_interfaces(first[:-1] or first, names) == []  # NCCL: a prefix (eth matches eth0)
    assert missing_interfaces(f"{first},nosuch", names) == ["nosuch"]
    assert missing_interfaces(f"={first}", names) == []
    if first[:-1] not in names and len(first) > 1:
        assert missing_interfaces(f"={first[:-1]}", names) == [first[:-1]]  # `=`: exact names only
    assert missing_interfaces(first, names, exact=True) == []  # GLOO_SOCKET_IFNAME: exact names
    assert missing_interfaces(f"{first}, nosuch0", names, exact=True) == ["nosuch0"]
    if "lo" in names:
        assert missing_interfaces("lo", names) == missing_interfaces("l", names) == []


def test_comparison_names_the_node_that_differs():
    def node(rank, torch_version="2.14.1", gpus=8, **extra):
        return {
            "rank": rank,
            "hostname": f"gpu{rank}",
            "torch": torch_version,
            "accelerate": "1.15.0",
            "gpus": gpus,
            "use_cpu": False,
            "num_machines": 2,
            "num_processes": 16,
            **extra,
        }

    assert doctor.compare([node(0), node(1)]) is None
    verdict = doctor.compare([node(0), node(1, "2.13.0", gpus=4)])
    assert "torch differs between nodes: 2.13.0 on rank 1 (gpu1); 2.14.1 on rank 0 (gpu0)" in verdict
    assert "GPU count differs between nodes: 4 on rank 1 (gpu1); 8 on rank 0 (gpu0)" in verdict
    differ = doctor.compare([node(0), node(1, num_processes=8)])
    assert "num_processes 16 on rank 0 (gpu0) but 8 on rank 1 (gpu1)" in differ
    # CPU runs over gloo do not use the GPUs, so their count may differ.
    assert doctor.compare([node(0, use_cpu=True), node(1, gpus=0, use_cpu=True)]) is None


def test_help_explains_every_flag(tmp_path):
    proc = run([PYTHON, "-m", "recipe_tools.doctor", "--help"], node_env(tmp_path, PAGER="cat"), timeout=60)
    assert proc.returncode == 0, proc.output
    for name in inspect.signature(doctor.main).parameters:
        assert re.search(rf"--{name}\b", proc.output), f"--{name} missing from --help"
        assert re.search(rf"^\s+{name}:\s+\S", doctor.main.__doc__, re.MULTILINE), (
            f"{name} has no description"
        )


# NCCL_DEBUG=INFO output of a 2-node all-reduce, as NCCL
# 2.2x prints it (host:pid:tid [device] NCCL INFO ...).
NCCL_OVER_IB = """\
gpu-a:81234:81234 [0] NCCL INFO Bootstrap : Using ibp12s0:10.10.0.11<0>
gpu-a:81234:81234 [0] NCCL INFO cudaDriverVersion 12040
NCCL version 2.21.5+cuda12.4
gpu-a:81234:81301 [0] NCCL INFO Plugin Path : /opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so
gpu-a:81234:81301 [0] NCCL INFO P2P plugin IBext_v8
gpu-a:81234:81301 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ; OOB ibp12s0:10.10.0.11<0>
gpu-a:81234:81301 [0] NCCL INFO Using network IB
gpu-a:81234:81301 [0] NCCL INFO comm 0x55d0c2a0 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
gpu-a:81234:81301 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-a:81234:81301 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/IB/1/GDRDMA
gpu-a:81234:81301 [0] NCCL INFO Connected all rings
"""
NCCL_OVER_SOCKETS = """\
node1:4711:4711 [0] NCCL INFO Bootstrap : Using eno1:192.168.1.21<0>
node1:4711:4760 [0] NCCL INFO Failed to open libibverbs.so[.1]
node1:4711:4760 [0] NCCL INFO NET/IB : No device found.
node1:4711:4760 [0] NCCL INFO NET/Socket : Using [0]eno1:192.168.1.21<0>
node1:4711:4760 [0] NCCL INFO Using network Socket
node1:4711:4760 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
node1:4711:4760 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
"""
NCCL_OVER_ROCE_WITHOUT_GDR = """\
h1:900:950 [0] NCCL INFO NET/IB : Using [0]mlx5_bond_0:1/RoCE [RO]; OOB bond0:10.1.1.5<0>
h1:900:950 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0
"""


def test_nccl_info_lines_tell_infiniband_from_sockets():
    assert doctor.nccl_transport(NCCL_OVER_IB) == {
        "network": "IB",
        "devices": "[0]mlx5_0:1/IB [1]mlx5_3:1/IB",
        "gdr": True,
    }
    # "NET/IB : No device found." must not count as InfiniBand.
    assert doctor.nccl_transport(NCCL_OVER_SOCKETS) == {
        "network": "Socket",
        "devices": "[0]eno1:192.168.1.21<0>",
        "gdr": False,
    }
    assert doctor.nccl_transport(NCCL_OVER_ROCE_WITHOUT_GDR) == {
        "network": "IB",
        "devices": "[0]mlx5_bond_0:1/RoCE [RO]",
        "gdr": False,
    }
    assert doctor.nccl_transport("NCCL version 2.21.5+cuda12.4\nsome other output\n")["network"] is None


def test_without_gpus_the_nccl_check_says_why_it_did_not_run():
    plan = doctor.Plan(
        machine_rank=0, num_machines=2, num_processes=2, main_ip="127.0.0.1", port=1, timeout=5, use_cpu=False
    )
    assert doctor.check_nccl(plan, gpus=0, size_mb=256) == (
        "NCCL all-reduce not run: this node has no GPU; only gloo was checked"
    )
    plan.use_cpu = True
    assert "not run: CPU run" in doctor.check_nccl(plan, gpus=0, size_mb=256)


def test_nccl_check_uses_this_process_gpu_as_the_launcher_maps_gpu_ids(tmp_path):
    # gpu_ids as accelerate reads them from a config file; the launcher makes them
    # CUDA_VISIBLE_DEVICES, and the process of LOCAL_RANK r uses the r-th GPU it then sees.
    config = tmp_path / "2node.yaml"
    config.write_text(
        CONFIG.replace("gpu_ids: all", "gpu_ids: 2,3").replace("num_processes: 2", "num_processes: 4")
    )
    plan = doctor.make_plan(doctor.load_config(config), 1, "10.0.0.1", None, None, None, 30)
    assert plan.gpu_ids == "2,3"
    env, index, where = doctor.nccl_device(plan.gpu_ids, 8, environ={})
    assert (env, index) == ({"CUDA_VISIBLE_DEVICES": "2,3"}, 0) and where.startswith("GPU 2 (cuda:0 "), where
    env, index, where = doctor.nccl_device(
        plan.gpu_ids, 8, environ={"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"}
    )
    assert (env, index) == ({"CUDA_VISIBLE_DEVICES": "2,3"}, 1) and where.startswith("GPU 3 (cuda:1 "), where
    # A single id, which YAML reads as a number.
    config.write_text(CONFIG.replace("gpu_ids: all", "gpu_ids: 5"))
    plan = doctor.make_plan(doctor.load_config(config), 0, "10.0.0.1", None, None, None, 30)
    assert doctor.nccl_device(plan.gpu_ids, 8, environ={})[:2] == ({"CUDA_VISIBLE_DEVICES": "5"}, 0)
    # All GPUs: the environment stays as it is and LOCAL_RANK picks among the GPUs it shows.
    plan = doctor.make_plan(doctor.load_config(write_config(tmp_path)), 0, "10.0.0.1", None, None, None, 30)
    assert doctor.nccl_device(plan.gpu_ids, 4, environ={})[:2] == ({}, 0)
    environ = {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert doctor.nccl_device(plan.gpu_ids, 4, environ) == ({}, 3, "cuda:3 (CUDA_VISIBLE_DEVICES=4,5,6,7)")
    for gpu_ids, visible, local_rank, message in (
        ("2,3", 8, "2", "LOCAL_RANK 2 has no GPU among the config's gpu_ids 2,3"),
        ("all", 4, "4", "this node sees 4 GPU(s)"),
        ("all", 4, "-1", "LOCAL_RANK='-1' is not a process index"),
    ):
        with pytest.raises(doctor.RecipeError, match=re.escape(message)):
            doctor.nccl_device(gpu_ids, visible, environ={"LOCAL_RANK": local_rank})
