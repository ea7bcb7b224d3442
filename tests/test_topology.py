"""GPU choice from `nvidia-smi topo -m`, on saved outputs of four typical machines
(tests/fixtures/topo/)."""

import os

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import PYTHON, REPO, fails_with, run

from accelerate_recipes import RecipeError
from recipe_tools.topology import Topology, best_set, groups, link_score, parse, recommendations

TOPO = REPO / "tests" / "fixtures" / "topo"


def load(name):
    return parse((TOPO / f"{name}.txt").read_text())


def test_link_order_follows_the_legend():
    order = ["NV12", "NV4", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    assert sorted(order, key=link_score, reverse=True) == order


def test_parses_links_affinity_and_ignores_nics_and_legend():
    topo = load("dgx_8gpu_nvswitch")
    assert topo.gpus == list(range(8))
    assert topo.link(3, 6) == topo.link(6, 3) == "NV12"
    assert topo.cpu_affinity[5] == "64-127,192-255" and topo.numa_affinity[5] == "1"


def test_dgx_nvswitch_every_set_is_all_nvlink():
    topo = load("dgx_8gpu_nvswitch")
    assert groups(topo)["nvlink"] == [list(range(8))]
    assert [(gpus, reason) for gpus, reason in recommendations(topo)][1:] == [
        ((0, 1), "slowest link NV12: 12 bonded NVLinks"),
        ((0, 1, 2, 3), "slowest link NV12: 12 bonded NVLinks"),
        (tuple(range(8)), "slowest link NV12: 12 bonded NVLinks"),
    ]


def test_nvlink_pairs_on_two_sockets_the_articles_box():
    topo = load("nvlink_pairs_2socket")
    found = groups(topo)
    assert found["nvlink"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert found["socket"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert best_set(topo, 2) == (0, 1)  # an NVLink pair, never 0,4 across the sockets
    # two pairs on one socket (NODE) beat any set crossing sockets
    assert best_set(topo, 4) == (0, 1, 2, 3)
    assert topo.slowest(best_set(topo, 8))[0] == "SYS"


def test_four_pcie_gpus_on_one_socket():
    topo = load("pcie_4gpu_1socket")
    assert groups(topo) == {"nvlink": [], "pcie_switch": [[0, 1], [2, 3]], "socket": [[0, 1, 2, 3]]}
    assert best_set(topo, 2) in {(0, 1), (2, 3)} and topo.slowest(best_set(topo, 2))[0] == "PIX"


def test_eight_pcie_gpus_on_two_sockets_without_numa_column():
    topo = load("pcie_8gpu_2socket")
    assert groups(topo)["socket"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # from the SYS links
    assert best_set(topo, 2) == (0, 1) and best_set(topo, 4) == (0, 1, 2, 3)
    with pytest.raises(RecipeError, match="has 8 GPU"):
        best_set(topo, 9)


def test_command_prints_groups_recommendations_and_what_to_avoid(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = run(
        [PYTHON, "-m", "recipe_tools.topology", "--file", TOPO / "nvlink_pairs_2socket.txt"], env
    ).stdout
    assert "NVLink groups:      {0,1}  {2,3}  {4,5}  {6,7}" in out
    assert "--gpu_ids 0,1 " in out and "for 2 GPUs, avoid pairs like 0,4: SYS" in out


def test_write_config_gives_accelerate_a_config_with_the_best_gpus(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    config = tmp_path / "best4.yaml"
    proc = run(
        [
            PYTHON,
            "-m",
            "recipe_tools.topology",
            "--file",
            TOPO / "nvlink_pairs_2socket.txt",
            "--gpus",
            "4",
            "--write_config",
            config,
        ],
        env,
    )
    assert proc.returncode == 0, proc.output
    loaded = load_config_from_file(str(config))
    assert loaded.num_processes == 4 and str(loaded.gpu_ids) == "0,1,2,3"
    assert loaded.distributed_type.value == "MULTI_GPU"


def test_without_nvidia_smi_or_with_a_bad_file_the_error_says_what_to_do(tmp_path):
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=str(empty_path))
    fails_with(run([PYTHON, "-m", "recipe_tools.topology"], env), "nvidia-smi not found", "--file")
    (tmp_path / "bad.txt").write_text("No devices were found\n")
    fails_with(
        run([PYTHON, "-m", "recipe_tools.topology", "--file", tmp_path / "bad.txt"], env),
        "no GPU matrix found",
    )


def test_large_machine_uses_the_greedy_search_and_still_keeps_nvlink_groups_together():
    # 32 GPUs in NVLink groups of 4, eight groups per socket: too many sets to try them all.
    gpus = list(range(32))
    links = {
        (a, b): "NV8" if a // 4 == b // 4 else ("NODE" if a // 16 == b // 16 else "SYS")
        for a in gpus
        for b in gpus
        if a < b
    }
    topo = Topology(gpus, links)
    assert best_set(topo, 4) == (0, 1, 2, 3)
    assert topo.slowest(best_set(topo, 16))[0] == "NODE"
