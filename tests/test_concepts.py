"""The concepts guide's multi-node command runs as written and shows ranks, local ranks and the data
split."""

import re
import subprocess

from conftest import BIN, REPO, free_port, recipe_env, time_limit

GUIDE = REPO / "docs" / "concepts.md"


def test_guide_ranks_loop_on_two_local_nodes(tmp_path):
    loop = re.search(
        r"```bash\n(for node in 0 1 2 3 4; do\n.*?done; wait)\n```", GUIDE.read_text(), re.S
    ).group(1)
    # The guide's five nodes x 4 processes, shrunk to
    # two nodes x 2 processes to keep the test short.
    assert "--num_machines 5 --num_processes 20" in loop and "--main_process_port 29500" in loop
    loop = (
        loop.replace("0 1 2 3 4", "0 1")
        .replace("--num_machines 5 --num_processes 20", "--num_machines 2 --num_processes 4")
        .replace("29500", str(free_port()))
        .replace("accelerate launch", f"{BIN}/accelerate launch")
    )
    proc = subprocess.run(
        ["bash", "-c", loop],
        cwd=REPO,
        env=recipe_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=time_limit(180),
    )
    lines = sorted(
        re.findall(
            r"node (\d) \| rank +(\d+) of world size (\d+) \| local rank (\d) \| samples \[(.*?)\] "
            r"\| all-reduce sum (\d+)",
            proc.stdout,
        )
    )
    assert lines == [
        ("0", "0", "4", "0", ", ".join(map(str, range(0, 40, 4))), "10"),
        ("0", "1", "4", "1", ", ".join(map(str, range(1, 40, 4))), "10"),
        ("1", "2", "4", "0", ", ".join(map(str, range(2, 40, 4))), "10"),
        ("1", "3", "4", "1", ", ".join(map(str, range(3, 40, 4))), "10"),
    ], proc.stdout + proc.stderr
    assert "world size 4 = 2 node(s) x 2 process(es) per node; the sum 1 + ... + 4 = 10" in proc.stdout
