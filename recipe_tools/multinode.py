"""Start a multi-node run from one terminal: `accelerate launch` on every host of a hostfile, over
ssh.

    # or python -m recipe_tools.multinode ...
    accelerate-recipes-hostfile --hostfile hosts.txt recipes/cifar.py --epochs 5
    make cifar-hostfile HOSTFILE=hosts.txt ARGS="--epochs 5"

The hostfile has one line per node, `hostname slots=N` (N processes, usually its GPU count), as
DeepSpeed's and Horovod's runners read it; `#` starts a comment. The first host is the main node
(machine rank 0). Each node runs

    cd <workdir> && accelerate launch --config_file <config> --num_machines M --num_processes <sum of slots>
        --machine_rank <its line> --main_process_ip <first host> --main_process_port <port> <script>
        <args>

`localhost` lines run here without ssh, so two "nodes" can share one machine. Other hosts need
passwordless ssh (`ssh-copy-id host`) and the project and its environment at the same path. Every
output line is prefixed with its node; when one node fails, the others are stopped and the launcher
exits with the failed node's code.
"""

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate_recipes.cli import RecipeError, port_in_use

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# Passed on to remote nodes (local ones inherit everything):
# network, accelerate, tracking and hub settings.
FORWARD_PREFIXES = ("NCCL_", "GLOO_", "ACCELERATE_", "SWANLAB_", "HF_", "TORCH_", "CUDA_", "OMP_", "PYTHON")
STOP_GRACE_SECONDS = 15


@dataclass
class Host:
    name: str
    slots: int

    @property
    def is_local(self) -> bool:
        return self.name in LOCAL_NAMES or self.name in (socket.gethostname(), socket.getfqdn())


def read_hostfile(path: str) -> list[Host]:
    """Parse `hostname slots=N` lines; every node must run the same number of processes, as
    accelerate requires."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"hostfile {file} does not exist; write one line per node: `hostname slots=<GPUs>`")
    hosts = []
    for number, raw in enumerate(file.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        slots = [o.split("=", 1)[1] for o in options if o.startswith("slots=")]
        if len(options) != 1 or not slots or not slots[0].isdigit() or int(slots[0]) < 1:
            raise RecipeError(
                f"{file}:{number}: cannot read {raw.strip()!r}; write `hostname slots=N`, e.g. `node1 "
                "slots=8`"
            )
        hosts.append(Host(name, int(slots[0])))
    if not hosts:
        raise RecipeError(f"hostfile {file} lists no hosts; write one line per node: `hostname slots=<GPUs>`")
    if len({h.slots for h in hosts}) > 1:
        raise RecipeError(
            f"hostfile {file} gives different slots per node "
            f"({', '.join(f'{h.name}={h.slots}' for h in hosts)}); accelerate runs num_processes / "
            "num_machines processes on every node, so give every node the same slots"
        )
    return hosts


def node_script(rank: int, hosts: list[Host], args, forward: dict) -> str:
    """The shell script one node runs. It stops its whole process tree when its stdin closes, i.e.
    when the launcher (or the ssh connection to it) goes away, so no training process outlives a
    stopped run."""
    launch = [
        *shlex.split(args.accelerate),
        "launch",
        "--config_file",
        args.config_file,
        "--num_machines",
        str(len(hosts)),
        "--num_processes",
        str(sum(h.slots for h in hosts)),
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        args.main_process_ip,
        "--main_process_port",
        str(args.main_process_port),
        "--rdzv_conf",
        f"timeout={args.startup_timeout}",  # a node left alone stops instead of waiting
        # --restarts: every node's elastic agent restarts its workers when one dies; c10d re-forms
        # the group
        *(["--max_restarts", str(args.restarts), "--rdzv_backend", "c10d"] if args.restarts else []),
        *shlex.split(args.launch_args),
        args.script,
        *args.script_args,
        *(["--resume", "auto"] if args.restarts and "--resume" not in args.script_args else []),
    ]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(forward.items()))
    return "\n".join(
        [
            f"cd {shlex.quote(args.workdir)} || exit 2",
            # background jobs get their own process group, so
            # one kill reaches torchrun and its workers
            "set -m",
            f"{'env ' + exports + ' ' if exports else ''}{shlex.join(launch)} &",
            "child=$!",
            f"( cat >/dev/null; kill -TERM -- -$child; sleep {STOP_GRACE_SECONDS}; kill -KILL -- -$child ) "
            "</dev/stdin >/dev/null 2>&1 &",
            "watcher=$!",
            "set +m",  # no "[1]+ Done" job notices in the output
            "wait $child; code=$?",
            "kill -- -$watcher 2>/dev/null",
            "exit $code",
        ]
    )


def node_command(rank: int, hosts: list[Host], args) -> list[str]:
    """argv that starts node `rank`: bash here, or bash through ssh on a remote host."""
    host = hosts[rank]
    if host.is_local:
        return ["bash", "-c", node_script(rank, hosts, args, dict(args.env))]
    forward = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES)}
    forward.update(args.env)
    remote = "bash -c " + shlex.quote(node_script(rank, hosts, args, forward))
    return [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={args.ssh_timeout}",
        *shlex.split(args.ssh_options),
        host.name,
        remote,
    ]


class Node:
    """One started node: its process and a thread that prints its output with a prefix."""

    print_lock = threading.Lock()

    def __init__(self, rank: int, host: Host, command: list[str], width: int):
        self.rank, self.host = rank, host
        self.label = f"[{host.name}:{rank}]".ljust(width + 4)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._relay, daemon=True)
        self.reader.start()

    def _relay(self):
        for raw in iter(self.process.stdout.readline, b""):
            # tqdm redraws with \r: keep only the last state of the line.
            text = raw.decode(errors="replace").rstrip("\n").split("\r")[-1]
            with Node.print_lock:
                print(f"{self.label} {text}", flush=True)

    def stop(self):
        """Close stdin: the node's script then stops its process tree (TERM, KILL after a grace
        period)."""
        if self.process.poll() is None and self.process.stdin and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except OSError:
                pass


def check_port_free(address: str, port: int) -> None:
    with socket.socket() as probe:
        try:
            probe.bind((address, port))
        except OSError:
            raise port_in_use(address, port) from None


def launch(args) -> int:
    hosts = read_hostfile(args.hostfile)
    if not Path(args.config_file).is_file():
        raise RecipeError(
            f"config {args.config_file} does not exist; pass --config_file accelerate_configs/2node.yaml"
        )
    main_host = hosts[0]
    args.main_process_ip = args.main_process_ip or (
        "127.0.0.1" if main_host.name in LOCAL_NAMES else main_host.name
    )
    if main_host.is_local:
        check_port_free("0.0.0.0", args.main_process_port)
    width = max(len(h.name) for h in hosts) + len(str(len(hosts)))
    total = sum(h.slots for h in hosts)
    print(
        f"starting {len(hosts)} node(s) x {main_host.slots} process(es) = {total}, main node "
        f"{args.main_process_ip}:{args.main_process_port}",
        flush=True,
    )
    nodes = [Node(rank, host, node_command(rank, hosts, args), width) for rank, host in enumerate(hosts)]

    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failed = None
    try:
        while True:
            codes = [n.process.poll() for n in nodes]
            failed = next((n for n, c in zip(nodes, codes) if c not in (None, 0)), None)
            if failed or stopping["signal"] or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
        if failed or stopping["signal"]:
            for node in nodes:
                node.stop()
            deadline = time.monotonic() + STOP_GRACE_SECONDS + 10
            for node in nodes:
                try:
                    node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(node.process.pid, signal.SIGKILL)
    finally:
        for node in nodes:
            node.reader.join(timeout=5)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping["signal"]:
        print(f"error: stopped by signal {stopping['signal']}; all nodes were stopped", file=sys.stderr)
        return 128 + stopping["signal"]
    if failed:
        code = failed.process.returncode
        hint = (
            " (ssh failed: check `ssh -o BatchMode=yes "
            + failed.host.name
            + " true` works without a password)"
            if code == 255 and not failed.host.is_local
            else ""
        )
        print(
            f"error: node {failed.host.name} (machine rank {failed.rank}) exited with code {code}{hint}; "
            "the other nodes were stopped",
            file=sys.stderr,
        )
        return code
    print(f"all {len(nodes)} node(s) finished", flush=True)
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="accelerate-recipes-hostfile",
        description="Run `accelerate launch` on every node of a hostfile (ssh; localhost runs here) with the "
        "right machine rank, main address and port; prefix output by node; stop all nodes when one fails.",
        epilog="hostfile example:\n  node1 slots=8   # main node (machine rank 0)\n  node2 slots=8\n\n"
        "example: accelerate-recipes-hostfile --hostfile hosts.txt recipes/cifar.py --epochs 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hostfile", required=True, help="file with one `hostname slots=N` line per node")
    parser.add_argument(
        "--config_file",
        default="accelerate_configs/2node.yaml",
        help="accelerate config used on every node; num_machines/num_processes come from the hostfile",
    )
    parser.add_argument(
        "--main_process_ip",
        default=None,
        help="address the other nodes reach the main node at (default: the first host's name)",
    )
    parser.add_argument(
        "--main_process_port",
        type=int,
        default=int(os.environ.get("MASTER_PORT", 29500)),
        help="rendezvous port on the main node (default: $MASTER_PORT or 29500)",
    )
    parser.add_argument(
        "--workdir", default=os.getcwd(), help="project folder on every node (default: this one)"
    )
    # absent where accelerate came with PYTHONPATH, not a venv
    script = Path(sys.executable).parent / "accelerate"
    parser.add_argument(
        "--accelerate",
        default=str(script) if script.exists() else f"{sys.executable} -m accelerate.commands.accelerate_cli",
        help="accelerate command on every node (default: the one beside this Python, else this Python "
        "with -m accelerate.commands.accelerate_cli)",
    )
    parser.add_argument(
        "--launch_args", default="", help='extra `accelerate launch` flags, e.g. "--mixed_precision bf16"'
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment variable for every node (repeatable); NCCL_*, GLOO_*, ACCELERATE_*, "
        "SWANLAB_*, HF_*, TORCH_*, CUDA_*, OMP_* and PYTHON* are passed on to remote nodes anyway",
    )
    parser.add_argument(
        "--ssh_options", default="", help='extra ssh options, e.g. "-p 2222 -i ~/.ssh/cluster"'
    )
    parser.add_argument("--ssh_timeout", type=int, default=10, help="seconds ssh waits to connect to a node")
    parser.add_argument(
        "--startup_timeout",
        type=int,
        default=int(os.environ.get("STARTUP_TIMEOUT", 300)),
        help="seconds each node waits for the others to join before it stops with an error "
        "(default: $STARTUP_TIMEOUT or 300)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="restart every worker of the run up to N times when one dies (a crash, an OOM kill, a rebooted "
        "node), each restart continuing from the last checkpoint (--resume auto is added)",
    )
    parser.add_argument("script", help="the training script, e.g. recipes/cifar.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="flags for the script")
    args = parser.parse_args(argv)
    pairs = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env {item!r}: write NAME=VALUE")
        pairs[name] = value
    args.env = pairs
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return launch(args)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
