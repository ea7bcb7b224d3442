"""Preflight for multi-node runs: run it on every node, with the flags you will give `accelerate
launch`.

    accelerate-recipes-doctor --machine_rank 0 --main_process_ip 10.0.0.1   # on the main node (owns 10.0.0.1)
    accelerate-recipes-doctor --machine_rank 1 --main_process_ip 10.0.0.1   # on node 1, and so on
    # 2 nodes x 4 GPUs, another port, a longer wait (`python -m recipe_tools.doctor` is the same
    program): accelerate-recipes-doctor --config_file accelerate_configs/2node.yaml --num_processes
    8
        --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29501 --timeout 60

It checks, in seconds instead of a hang at `accelerator.prepare`: the config's arithmetic, that the
main address resolves, the network interface variables, the GPUs of this node, the rendezvous at
main_process_ip:main_process_port (address, port, firewall, one machine_rank per node), that every
node runs the same torch and accelerate, a gloo all_reduce between the nodes (the data path, where a
wrong network interface shows up), and with GPUs an NCCL all-reduce between them (busbw, and whether
NCCL went over InfiniBand/RoCE or plain sockets). Every wait ends after --timeout seconds with one
line naming the cause and the fix.
"""

import ipaddress
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from accelerate_recipes.cli import RecipeError, address_in_use, port_in_use, run

DEFAULT_PORT = 29500
KEY = "doctor/"  # prefix of the doctor's keys in the store
POLL = 0.1  # seconds between looks at the store


@dataclass
class Plan:
    """What this node takes part in, after the flags override the config."""

    machine_rank: int
    num_machines: int
    num_processes: int
    main_ip: str
    port: int
    timeout: float
    use_cpu: bool
    # the config's: this machine's GPU ids, which the launcher turns into CUDA_VISIBLE_DEVICES
    gpu_ids: str = "all"

    @property
    def where(self) -> str:
        return f"{self.main_ip}:{self.port}"


def load_config(config_file: str):
    """The config as `accelerate launch` reads it (accelerate's own loader)."""
    import yaml  # a dependency of accelerate, which reads its configs with it
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    try:
        config = load_config_from_file(str(config_file))
    except FileNotFoundError:
        raise RecipeError(
            f"--config_file {config_file} does not exist; use one of accelerate_configs/*.yaml "
            "(accelerate_configs/2node.yaml for two nodes), the same file on every node"
        ) from None
    # syntax, keys, values
    except (ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError) as err:
        raise RecipeError(
            f"--config_file {config_file} is not a valid accelerate config: "
            f"{' '.join(str(err).split())[:300]}"
        ) from None
    if not isinstance(config, ClusterConfig):
        raise RecipeError(
            f"--config_file {config_file} is a SageMaker config; the doctor checks machines you launch "
            "yourself (compute_environment: LOCAL_MACHINE)"
        )
    return config


def cpu_requested(config) -> bool:
    from accelerate.utils import parse_flag_from_env

    try:
        from_env = parse_flag_from_env("ACCELERATE_USE_CPU")
    except ValueError:
        raise RecipeError(
            f"ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']!r} is not a truth value; use true or false"
        ) from None
    return from_env or bool(config.use_cpu) or config.distributed_type.value == "MULTI_CPU"


def number(name: str, value, kind=int):
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise RecipeError(f"--{name} {value!r} is not a number") from None


def make_plan(
    config, machine_rank, main_process_ip, main_process_port, num_machines, num_processes, timeout
) -> Plan:
    """Check 1: the flags and the config agree with themselves."""
    machines = number("num_machines", num_machines if num_machines is not None else config.num_machines)
    processes = number("num_processes", num_processes if num_processes is not None else config.num_processes)
    rank = number("machine_rank", machine_rank if machine_rank is not None else config.machine_rank)
    if machines < 1:
        raise RecipeError(f"num_machines {machines} must be at least 1")
    if processes < machines:
        raise RecipeError(
            f"num_processes {processes} must be at least num_machines {machines}: it counts the "
            "processes of ALL nodes together (e.g. 16 for 2 nodes x 8 GPUs)"
        )
    if processes % machines:
        per_node = max(1, processes // machines)
        raise RecipeError(
            f"num_processes {processes} is not divisible by num_machines {machines}: each node runs "
            f"num_processes/num_machines processes; set num_processes to {per_node * machines} or "
            f"{(per_node + 1) * machines} (processes per node x {machines} nodes)"
        )
    if not 0 <= rank < machines:
        raise RecipeError(
            f"machine_rank {rank} is out of range for num_machines {machines}: give each node its "
            f"own --machine_rank from 0 to {machines - 1}, 0 on the main node"
        )
    ip = main_process_ip if main_process_ip is not None else config.main_process_ip
    if not ip and machines == 1:
        ip = "127.0.0.1"
    if not ip:
        raise RecipeError(
            "main_process_ip is not set (not in the config either): pass --main_process_ip <address of "
            "the machine_rank 0 node, as the other nodes reach it>, the same on every node"
        )
    port = number("main_process_port", main_process_port or config.main_process_port or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise RecipeError(f"--main_process_port {port} is not a TCP port (1-65535)")
    if number("timeout", timeout, float) <= 0:
        raise RecipeError(f"--timeout {timeout} must be a positive number of seconds")
    gpu_ids = str(config.gpu_ids).strip() if config.gpu_ids is not None else "all"
    return Plan(
        rank, machines, processes, str(ip), port, float(timeout), cpu_requested(config), gpu_ids or "all"
    )


def resolve(plan: Plan) -> list[str]:
    """Check 2: the main address resolves here."""
    try:
        infos = socket.getaddrinfo(plan.main_ip, plan.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise RecipeError(
            f"main_process_ip {plan.main_ip!r} does not resolve on this node ({err}): pass the main "
            "node's IP address (`hostname -I` on it), or add its name to /etc/hosts or DNS"
        ) from None
    # the resolver's order, without repeats
    return list(dict.fromkeys(info[4][0] for info in infos))


def missing_interfaces(value: str, names: list[str], exact: bool = False) -> list[str]:
    """The entries of a NCCL_SOCKET_IFNAME-style list that match no interface in `names`.

    NCCL's syntax: comma-separated; a leading `^` excludes (nothing has to exist), a leading `=`
    asks for exact names, otherwise every entry is a prefix (`eth` matches eth0). GLOO_SOCKET_IFNAME
    takes exact names: exact=True.
    """
    value = value.strip()
    if value.startswith("^"):
        return []
    if value.startswith("="):
        value, exact = value[1:], True
    entries = [entry.strip() for entry in value.split(",") if entry.strip()]
    if exact:
        return [entry for entry in entries if entry not in names]
    return [entry for entry in entries if not any(name.startswith(entry) for name in names)]


def interface_address(name: str) -> str | None:
    """IPv4 address of a network interface (Linux), None when it has none or cannot be asked."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            # SIOCGIFADDR
            answer = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(answer[20:24])
    except (ImportError, OSError):
        return None


def route_to(address: str) -> tuple[str | None, str | None]:
    """(local address, interface) this node uses to reach `address`; no packet is sent."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            local = s.getsockname()[0]
    except OSError:
        return None, None
    names = [name for _, name in socket.if_nameindex()]
    return local, next((name for name in names if interface_address(name) == local), None)


def gloo_default_address() -> str | None:
    """The address gloo listens on when GLOO_SOCKET_IFNAME is unset: the first bindable address of
    the hostname."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return sockaddr[0]
        except OSError:
            continue
    return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def check_interfaces(plan: Plan, main_addresses: list[str]) -> str:
    """Check 3: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces of this node, and gloo is
    not on loopback."""
    names = [name for _, name in socket.if_nameindex()]
    found = []
    for variable, exact in (("NCCL_SOCKET_IFNAME", False), ("GLOO_SOCKET_IFNAME", True)):
        value = os.environ.get(variable)
        if value is None:
            continue
        missing = missing_interfaces(value, names, exact)
        if missing or not value.strip():
            kind = "exact interface names" if exact else "interface names or prefixes (eth matches eth0)"
            raise RecipeError(
                f"{variable}={value!r} names no interface of this node ({', '.join(missing) or 'empty'} not "
                f"found; it takes {kind}); this node has: {', '.join(names)}. Set it to the interface of the "
                "network that joins the nodes (`ip -brief addr`), or unset it"
            )
        if exact:  # gloo binds the interface's address: show it (none means gloo will fail on it)
            value += (
                " ("
                + ", ".join(
                    f"{name.strip()} {interface_address(name.strip()) or 'no IPv4 address'}"
                    for name in value.split(",")
                    if name.strip()
                )
                + ")"
            )
        found.append(f"{variable}={value}")
    remote = not all(is_loopback(address) for address in main_addresses)
    if "GLOO_SOCKET_IFNAME" not in os.environ and remote and plan.num_machines > 1:
        # gloo listens on the address of the hostname; a hostname mapped to 127.0.1.1 in /etc/hosts
        # (Ubuntu's default) makes every other node connect to
        # itself, and the run hangs after the rendezvous.
        address = gloo_default_address()
        if address is None or is_loopback(address):
            local, interface = route_to(main_addresses[0])
            fix = (
                f"GLOO_SOCKET_IFNAME={interface} (this node reaches {plan.main_ip} from {local} on "
                f"{interface})"
                if interface
                else f"GLOO_SOCKET_IFNAME to one of: {', '.join(names)}"
            )
            raise RecipeError(
                f"hostname {socket.gethostname()!r} resolves to {address or 'nothing'} on this node, so gloo "
                f"would listen there and the other nodes could not reach it: set {fix}, and on every other "
                "node its own interface; or map the hostname to the node's network address in /etc/hosts"
            )
        found.append(f"gloo uses {address} (hostname {socket.gethostname()})")
    return "; ".join(found) or "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME unset (chosen automatically)"


def check_gpus(plan: Plan, config) -> tuple[int, str]:
    """Check 4: this node sees the GPUs its processes need. Returns (GPUs visible, report line)."""
    import torch

    visible = torch.cuda.device_count()
    per_node = plan.num_processes // plan.num_machines
    if plan.use_cpu:
        return visible, f"GPUs: not used (CPU run, gloo); {per_node} process(es) per node"
    ids = plan.gpu_ids
    usable = visible
    if ids.lower() != "all":
        wanted = [part.strip() for part in ids.split(",") if part.strip()]
        usable = sum(1 for part in wanted if part.isdigit() and int(part) < visible)
    if usable < per_node:
        cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = (
            f"CUDA_VISIBLE_DEVICES={cuda_visible}"
            if cuda_visible is not None
            else "CUDA_VISIBLE_DEVICES unset"
        )
        of_ids = "" if ids.lower() == "all" else f", {usable} of them among the config's gpu_ids {ids}"
        raise RecipeError(
            f"this node sees {visible} GPU(s) (torch.cuda.device_count(), {seen}{of_ids}) but runs "
            f"{per_node} process(es) (num_processes {plan.num_processes} / num_machines "
            f"{plan.num_machines}), one per GPU: check `nvidia-smi` and CUDA_VISIBLE_DEVICES on this node, "
            "or lower num_processes; without GPUs set ACCELERATE_USE_CPU=true"
        )
    # a LOCAL_RANK without a GPU stops here, before the others wait
    _, _, where = nccl_device(plan.gpu_ids, visible)
    return visible, f"GPUs: {visible} visible, {per_node} needed per node; this process's GPU: {where}"


def nccl_device(gpu_ids: str, visible: int, environ=None) -> tuple[dict, int, str]:
    """This process's GPU, picked as `accelerate launch` and the Accelerator pick it for a process
    of the run.

    The launcher turns the config's gpu_ids (ids of this machine's GPUs) into CUDA_VISIBLE_DEVICES,
    and the process with LOCAL_RANK r then uses the r-th GPU it sees, cuda:r. LOCAL_RANK is unset
    (0) when the doctor runs once per node. Returns (environment for a child process, its CUDA
    device index, the GPU in words).
    """
    environ = os.environ if environ is None else environ
    local = environ.get("LOCAL_RANK", "").strip() or "0"
    if not local.isdigit():
        raise RecipeError(
            f"LOCAL_RANK={local!r} is not a process index (0, 1, ...); unset it to check the first GPU"
        )
    index = int(local)
    if str(gpu_ids).strip().lower() in ("", "all"):
        if index >= visible:
            raise RecipeError(
                f"LOCAL_RANK {index} names GPU cuda:{index}, but this node sees {visible} GPU(s): "
                f"unset LOCAL_RANK or give it a value below {visible}"
            )
        listed = environ.get("CUDA_VISIBLE_DEVICES")
        return (
            {},
            index,
            f"cuda:{index}" + (f" (CUDA_VISIBLE_DEVICES={listed})" if listed is not None else ""),
        )
    ids = [part.strip() for part in str(gpu_ids).split(",") if part.strip()]
    if index >= len(ids):
        raise RecipeError(
            f"LOCAL_RANK {index} has no GPU among the config's gpu_ids {','.join(ids)} (one per local "
            f"process): unset LOCAL_RANK or give it a value below {len(ids)}"
        )
    listed = ",".join(ids)
    return (
        {"CUDA_VISIBLE_DEVICES": listed},
        index,
        f"GPU {ids[index]} (cuda:{index} with CUDA_VISIBLE_DEVICES={listed}, from gpu_ids; LOCAL_RANK "
        f"{index})",
    )


def node_facts(plan: Plan, gpus: int) -> dict:
    import accelerate
    import torch

    return {
        "rank": plan.machine_rank,
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "use_cpu": plan.use_cpu,
        "num_machines": plan.num_machines,
        "num_processes": plan.num_processes,
    }


def label(facts: dict) -> str:
    return f"rank {facts['rank']} ({facts['hostname']})"


def deadline_wait(condition, seconds: float):
    """Poll condition() until it returns something truthy or `seconds` pass; returns its last
    value."""
    end = time.monotonic() + seconds
    while True:
        value = condition()
        if value or time.monotonic() >= end:
            return value
        time.sleep(POLL)


def host_store(plan: Plan, main_addresses: list[str]):
    """Rank 0: own the main address and serve the rendezvous store on the port."""
    import torch.distributed as dist

    local = []
    for address in main_addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address, 0))
            local.append(address)
        except OSError:
            continue
    if not local:
        raise RecipeError(
            f"machine_rank 0 must run on the main node {plan.main_ip}; this machine is "
            f"{socket.gethostname()} and "
            "does not own that address: run machine_rank 0 there and give this node its own --machine_rank "
            "(did two nodes use machine_rank 0?)"
        )
    try:
        return dist.TCPStore(
            plan.main_ip, plan.port, None, True, timedelta(seconds=plan.timeout), wait_for_workers=False
        )
    except (RuntimeError, OSError) as err:  # torch's DistNetworkError is a RuntimeError
        text = str(err)
        if address_in_use(err):
            raise port_in_use(plan.main_ip, plan.port) from None
        raise RecipeError(
            f"cannot serve the rendezvous on {plan.where}: {' '.join(text.split())[:300]}"
        ) from None


def join_store(plan: Plan, deadline: float):
    """Other ranks: reach the main node's port (retrying until the deadline), then open the store as
    a client."""
    import torch.distributed as dist

    fixes = (
        f"is the doctor (or run) on the main node started with the same --main_process_port? does a firewall "
        f"block TCP port {plan.port} (and the ports gloo/NCCL pick)? do all nodes use the same "
        f"--main_process_ip / MASTER_ADDR {plan.main_ip}?"
    )
    last = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RecipeError(
                f"cannot reach the main node at {plan.where} within {plan.timeout:g}s ({last}): {fixes}"
            )
        try:
            # Our own connect first: it keeps to the deadline and names the OS error (refused, timed
            # out, no route).
            socket.create_connection((plan.main_ip, plan.port), timeout=min(remaining, 5)).close()
            break
        except OSError as err:
            last = err.strerror or type(err).__name__
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    try:
        remaining = max(1.0, deadline - time.monotonic())
        return dist.TCPStore(plan.main_ip, plan.port, None, False, timedelta(seconds=remaining))
    except (RuntimeError, OSError) as err:
        raise RecipeError(
            f"something answers on {plan.where} but the rendezvous store did not "
            f"({' '.join(str(err).split())[:200]}): {fixes}"
        ) from None


def store_call(plan: Plan, call):
    """A store operation; the main node stopping shows up here as a connection error."""
    try:
        return call()
    except (RuntimeError, OSError) as err:
        raise RecipeError(
            f"lost the connection to the main node's store at {plan.where} "
            f"({' '.join(str(err).split())[:160]}): the doctor on the main node stopped; see its output"
        ) from None


def claim(plan: Plan, store, facts: dict) -> None:
    """Register this node's rank and facts; a second node with the same machine_rank learns it
    here."""
    count = store_call(plan, lambda: store.add(f"{KEY}rank{plan.machine_rank}", 1))
    store_call(plan, lambda: store.set(f"{KEY}facts{plan.machine_rank}.{count}", json.dumps(facts)))
    if count > 1:
        store_call(plan, lambda: store.set(f"{KEY}duplicate", json.dumps(facts)))
        first_key = f"{KEY}facts{plan.machine_rank}.1"
        first = "another node"
        if deadline_wait(lambda: store.check([first_key]), min(plan.timeout, 3)):
            first = json.loads(store.get(first_key))["hostname"]
        raise RecipeError(
            f"machine_rank {plan.machine_rank} was already claimed by {first}: every node needs its "
            f"own --machine_rank from 0 to {plan.num_machines - 1} (0 on the main node)"
        )


def compare(nodes: list[dict]) -> str | None:
    """Check 7: same torch, accelerate, run shape and GPU count everywhere; None when they agree."""
    main = nodes[0]
    problems = []
    shape = []
    for key, what in (
        ("num_machines", "num_machines"),
        ("num_processes", "num_processes"),
        ("use_cpu", "CPU mode"),
    ):
        differ = [node for node in nodes if node[key] != main[key]]
        if differ:
            shape.append(
                f"{what} {main[key]} on {label(main)} but "
                + ", ".join(f"{node[key]} on {label(node)}" for node in differ)
            )
    if shape:
        problems.append(
            "the nodes disagree on the run: "
            + ", ".join(shape)
            + " (use the same config, flags and ACCELERATE_USE_CPU on every node)"
        )
    keys = [("torch", "torch"), ("accelerate", "accelerate")] + (
        [] if main["use_cpu"] else [("gpus", "GPU count")]
    )
    for key, what in keys:
        values = sorted({str(node[key]) for node in nodes})
        if len(values) > 1:
            groups = "; ".join(
                f"{value} on " + ", ".join(label(n) for n in nodes if str(n[key]) == value)
                for value in values
            )
            fix = (
                "install the same versions on every node"
                if key != "gpus"
                else "give every node the same GPUs"
            )
            problems.append(f"{what} differs between nodes: {groups} ({fix})")
    return "; ".join(problems) or None


def rendezvous(plan: Plan, store, facts: dict, deadline: float) -> list[dict]:
    """Check 5 (and 7): every node registers; rank 0 waits for all, compares them and publishes the
    verdict."""
    claim(plan, store, facts)
    verdict_key = f"{KEY}verdict"
    if plan.machine_rank != 0:
        # Rank 0 publishes within its own timeout, which began before this node could connect.
        found = deadline_wait(lambda: store_call(plan, lambda: store.check([verdict_key])), plan.timeout + 2)
        if not found:
            raise RecipeError(
                f"reached {plan.where} but the main node gave no verdict within {plan.timeout:g}s: is "
                "a doctor with machine_rank 0 running there, with the same --num_machines?"
            )
        verdict = json.loads(store_call(plan, lambda: store.get(verdict_key)))
        if verdict["error"] or verdict["num_machines"] != plan.num_machines:
            store_call(plan, lambda: store.add(f"{KEY}bye", 1))
            main = verdict["nodes"][0] if verdict["nodes"] else {"rank": 0, "hostname": "?"}
            error = verdict["error"] or (
                f"num_machines differs: {verdict['num_machines']} on {label(main)} but "
                f"{plan.num_machines} here (use the same config and flags on every node)"
            )
            raise RecipeError(f"the main node {main['hostname']} reports: {error}")
        return verdict["nodes"]

    def joined():
        if store.check([f"{KEY}duplicate"]):
            return "duplicate"
        return all(store.check([f"{KEY}rank{r}"]) for r in range(plan.num_machines))

    status = deadline_wait(joined, max(0.0, deadline - time.monotonic()))
    seen = [r for r in range(plan.num_machines) if store.check([f"{KEY}rank{r}"])]
    nodes = [json.loads(store.get(f"{KEY}facts{r}.1")) for r in seen]
    if status == "duplicate":
        twin = json.loads(store.get(f"{KEY}duplicate"))
        first = next((n for n in nodes if n["rank"] == twin["rank"]), {"hostname": "another node"})
        error = (
            f"machine_rank {twin['rank']} was claimed twice, by {first['hostname']} and {twin['hostname']}: "
            f"every node needs its own --machine_rank from 0 to {plan.num_machines - 1} (0 on the main node)"
        )
    elif not status:
        error = (
            f"only {len(seen)} of {plan.num_machines} nodes joined {plan.where} within {plan.timeout:g}s "
            f"(ranks seen: {seen}); start the doctor on every node with its own --machine_rank"
        )
    else:
        error = compare(nodes)
    store.set(verdict_key, json.dumps({"error": error, "nodes": nodes, "num_machines": plan.num_machines}))
    if error:
        # Keep serving the store until the other nodes have read the verdict, so they print it too.
        deadline_wait(lambda: store.add(f"{KEY}bye", 0) >= len(seen) - 1, min(plan.timeout, 10))
        raise RecipeError(error)
    return nodes


def check_data_path(plan: Plan, store) -> float:
    """Check 6: one gloo all_reduce between the nodes; returns its milliseconds."""
    import torch
    import torch.distributed as dist

    where = (
        "GLOO_SOCKET_IFNAME=" + os.environ["GLOO_SOCKET_IFNAME"]
        if "GLOO_SOCKET_IFNAME" in os.environ
        else f"gloo picked the address of hostname {socket.gethostname()}"
    )
    fix = (
        f"the rendezvous at {plan.where} works but the nodes' data connections do not ({where}): set "
        "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME for GPU runs) on every node to the interface of the "
        "network "
        "that joins them (`ip -brief addr`), and let the firewall pass TCP between the nodes on all ports"
    )
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg", store),
            rank=plan.machine_rank,
            world_size=plan.num_machines,
            timeout=timedelta(seconds=plan.timeout),
        )
    except (RuntimeError, OSError, ValueError) as err:
        raise RecipeError(
            f"gloo could not connect the nodes ({' '.join(str(err).split())[:160]}); {fix}"
        ) from None
    try:
        value = torch.tensor([float(plan.machine_rank + 1)])
        start = time.perf_counter()
        dist.all_reduce(value)
        elapsed = (time.perf_counter() - start) * 1000
        expected = plan.num_machines * (plan.num_machines + 1) / 2
        if value.item() != expected:
            raise RecipeError(
                f"gloo all_reduce summed to {value.item():g} instead of {expected:g}: the nodes do not "
                "form one group; check that each node has its own --machine_rank"
            )
        return elapsed
    except (RuntimeError, OSError, ValueError) as err:
        raise RecipeError(f"gloo all_reduce failed ({' '.join(str(err).split())[:160]}); {fix}") from None
    finally:
        dist.destroy_process_group()


NCCL_RESULT = "doctor-nccl-result "  # prefix of the child's one result line among NCCL's own output


def nccl_transport(log: str) -> dict:
    """What NCCL's INFO output (NCCL_DEBUG=INFO) says about the network between nodes.

    Returns {"network": "IB" | "Socket" | None, "devices": str, "gdr": bool}. NCCL names the plugin
    it picked ("NCCL INFO Using network IB"), the devices it opened ("NET/IB : Using [0]mlx5_0:1/IB
    ..." or "NET/Socket : Using [0]eth0:10.0.0.1<0>"), and per channel the path ("via
    NET/IB/0/GDRDMA"); "NET/IB : No device found." means no IB. RoCE cards show up as IB (the same
    verbs plugin), with /RoCE after the device.
    """
    network, devices, gdr = None, "", False
    for line in log.splitlines():
        if "NCCL INFO" not in line:
            continue
        text = line.split("NCCL INFO", 1)[1].strip()
        picked = re.match(r"Using network (\w+)", text)
        if picked:
            network = (
                "IB"
                if picked[1].upper() == "IB"
                else "Socket"
                if picked[1].lower() == "socket"
                else picked[1]
            )
        opened = re.match(r"NET/(IB|Socket)\s*:\s*Using\s+(.*)", text)
        if opened:
            devices = opened[2].split(";")[0].strip()
            if network is None:
                network = opened[1]
        via = re.search(r"via NET/(IB|Socket)(/\d+)?(/GDRDMA)?", text)
        if via:
            network = via[1]
            gdr = gdr or bool(via[3])
    return {"network": network, "devices": devices, "gdr": gdr}


def nccl_child(spec: str) -> None:
    """One node's side of the NCCL all-reduce, in a process of its own so NCCL_DEBUG=INFO is set
    before NCCL loads."""
    import torch
    import torch.distributed as dist

    job = json.loads(spec)
    n, rank = job["world"], job["rank"]
    store = dist.TCPStore(job["host"], job["port"], None, False, timedelta(seconds=job["timeout"]))
    # this process's GPU among those CUDA_VISIBLE_DEVICES shows
    device = torch.device("cuda", job["device"])
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        store=dist.PrefixStore("nccl", store),
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=job["timeout"]),
        device_id=device,
    )
    numel = job["bytes"] // 4
    tensor = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(tensor)  # also NCCL's connection set-up, left out of the timing
    correct = bool(torch.all(tensor == n * (n + 1) / 2).item())
    for _ in range(2):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(job["iters"]):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    seconds = torch.tensor([(time.perf_counter() - start) / job["iters"]], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest node's time is the collective's
    dist.destroy_process_group()
    algbw = numel * 4 / seconds.item() / 1e9
    print(
        NCCL_RESULT
        + json.dumps(
            {
                "seconds": seconds.item(),
                "algbw_gbps": algbw,
                "correct": correct,
                "busbw_gbps": algbw * 2 * (n - 1) / n,
            }
        ),
        flush=True,
    )


def check_nccl(plan: Plan, gpus: int, size_mb: int) -> str:
    """Check 8: an NCCL all-reduce of SIZE_MB between the nodes (one GPU each): busbw and whether it
    went over InfiniBand/RoCE or plain sockets. Returns the report line; the reason in one line when
    it cannot run."""
    if size_mb <= 0:
        return "NCCL all-reduce not run (--nccl_mb 0)"
    if plan.use_cpu or gpus == 0:
        why = "CPU run (ACCELERATE_USE_CPU or a CPU config)" if plan.use_cpu else "this node has no GPU"
        return f"NCCL all-reduce not run: {why}; only gloo was checked"
    if plan.num_machines < 2:
        return "NCCL all-reduce not run: one node, so there is no network between nodes to measure"
    visible_devices, device, where = nccl_device(plan.gpu_ids, gpus)
    spec = json.dumps(
        {
            "host": plan.main_ip,
            "port": plan.port,
            "rank": plan.machine_rank,
            "world": plan.num_machines,
            "bytes": size_mb * 2**20,
            "iters": 5,
            "timeout": plan.timeout,
            "device": device,
        }
    )
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", **visible_devices)
    env.pop("NCCL_DEBUG_FILE", None)  # the lines are read from the child's output
    command = [sys.executable, "-c", f"from recipe_tools.doctor import nccl_child; nccl_child({spec!r})"]
    fix = (
        "set NCCL_SOCKET_IFNAME to the interface that joins the nodes on every node; without InfiniBand also "
        "NCCL_IB_DISABLE=1; let the firewall pass TCP between the nodes on all ports"
    )
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3 * plan.timeout + 60)
    except subprocess.TimeoutExpired:
        raise RecipeError(
            f"the NCCL all-reduce between the nodes did not finish within {3 * plan.timeout + 60:g}s "
            f"while gloo worked: {fix}"
        ) from None
    log = proc.stdout + proc.stderr
    results = [line[len(NCCL_RESULT) :] for line in proc.stdout.splitlines() if line.startswith(NCCL_RESULT)]
    if proc.returncode or not results:
        last = next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "no output")
        raise RecipeError(
            f"the NCCL all-reduce between the nodes failed (exit {proc.returncode}: {last[:200]}): {fix}"
        )
    result = json.loads(results[-1])
    if not result["correct"]:
        raise RecipeError(
            "the NCCL all-reduce between the nodes gave a wrong sum: a NIC, driver or GPUDirect RDMA "
            "problem; try NCCL_IB_DISABLE=1 or NCCL_NET_GDR_LEVEL=0 to find which"
        )
    transport = nccl_transport(log)
    if transport["network"] == "IB":
        over = "InfiniBand/RoCE" + (", GPUDirect RDMA" if transport["gdr"] else "")
    elif transport["network"] == "Socket":
        over = "TCP sockets (no InfiniBand/RoCE in use: expect at most the NIC's line rate)"
    else:
        over = "a network NCCL did not name (look for NET/ lines with NCCL_DEBUG=INFO)"
    devices = f" via {transport['devices']}" if transport["devices"] else ""
    return (
        f"NCCL all-reduce of {size_mb} MB across {plan.num_machines} node(s): busbw "
        f"{result['busbw_gbps']:.2f} GB/s (algbw {result['algbw_gbps']:.2f} GB/s), over {over}{devices}; "
        f"this node's GPU: {where}"
    )


def table(nodes: list[dict]) -> str:
    header = ("rank", "hostname", "torch", "accelerate", "python", "GPUs visible")
    rows = [header] + [
        (
            str(n["rank"]),
            n["hostname"],
            n["torch"],
            n["accelerate"],
            n["python"],
            str(n["gpus"])
            + (
                f" (CUDA_VISIBLE_DEVICES={n['cuda_visible_devices']})"
                if n["cuda_visible_devices"] is not None
                else ""
            ),
        )
        for n in sorted(nodes, key=lambda n: n["rank"])
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )


def ok(line: str) -> None:
    print(f"ok  {line}", flush=True)


def main(
    config_file: str = "accelerate_configs/2node.yaml",
    machine_rank: int | None = None,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
    num_machines: int | None = None,
    num_processes: int | None = None,
    timeout: float = 30,
    nccl_mb: int = 256,
):
    """Check that the nodes of a multi-node run can train together; run it on every node with the
    same flags.

    Args:
        config_file: the accelerate config the run will use (the same file on every node).
        machine_rank: this node's rank, 0 on the main node and 1..num_machines-1 on the others;
            default: the config's.
        main_process_ip: the machine_rank 0 node's address (MASTER_ADDR) as all nodes reach it;
            default: the config's.
        main_process_port: TCP port on the main node for the rendezvous (MASTER_PORT); default: the
            config's, or 29500.
        num_machines: number of nodes; default: the config's.
        num_processes: processes of all nodes together (e.g. 16 for 2 nodes x 8 GPUs); default: the
            config's.
        timeout: seconds every wait (connect, other nodes joining, gloo) may last before the doctor
            gives up.
        nccl_mb: size of the NCCL all-reduce between the nodes' GPUs (one per node), in MB; 0 skips
            it.
    """
    config = load_config(config_file)
    plan = make_plan(
        config, machine_rank, main_process_ip, main_process_port, num_machines, num_processes, timeout
    )
    per_node = plan.num_processes // plan.num_machines
    ok(
        f"config {config_file}: {plan.num_machines} node(s) x {per_node} process(es) = {plan.num_processes}, "
        f"this node is machine_rank {plan.machine_rank}"
    )
    addresses = resolve(plan)
    ok(f"main node {plan.main_ip} resolves to {', '.join(addresses)}")
    ok(f"network interfaces: {check_interfaces(plan, addresses)}")
    gpus, gpu_line = check_gpus(plan, config)
    ok(gpu_line)
    facts = node_facts(plan, gpus)

    deadline = time.monotonic() + plan.timeout
    if plan.machine_rank == 0:
        store = host_store(plan, addresses)
        print(
            f"..  serving the rendezvous on {plan.where}; waiting up to {plan.timeout:g}s for "
            f"{plan.num_machines} node(s)",
            flush=True,
        )
    else:
        print(f"..  connecting to the main node at {plan.where} (up to {plan.timeout:g}s)", flush=True)
        store = join_store(plan, deadline)
    nodes = rendezvous(plan, store, facts, deadline)
    ok(f"rendezvous: {len(nodes)} of {plan.num_machines} node(s) joined {plan.where}, one per machine_rank")
    # Compared before the data path: a different torch on
    # one node can make gloo's handshake itself fail.
    ok("same torch and accelerate on every node" + ("" if plan.use_cpu else ", same GPU count"))
    elapsed = check_data_path(plan, store)
    ok(f"gloo all_reduce across {plan.num_machines} node(s) gave the right sum ({elapsed:.1f} ms)")
    nccl_line = check_nccl(plan, gpus, nccl_mb)
    print(("ok  " if nccl_line.startswith("NCCL all-reduce of") else "--  ") + nccl_line, flush=True)
    if plan.machine_rank == 0:
        deadline_wait(lambda: store.add(f"{KEY}bye", 0) >= plan.num_machines - 1, min(plan.timeout, 10))
        if store.check([f"{KEY}duplicate"]):
            twin = json.loads(store.get(f"{KEY}duplicate"))
            raise RecipeError(
                f"machine_rank {twin['rank']} was also claimed by {twin['hostname']} after the others "
                "joined: every node needs its own --machine_rank"
            )
    else:
        store_call(plan, lambda: store.add(f"{KEY}bye", 1))
    print("nodes:")
    print(table(nodes))
    print(f"doctor: all checks passed on {plan.num_machines} node(s)")


def cli() -> None:
    """Console entry point `accelerate-recipes-doctor`."""
    run(main)


if __name__ == "__main__":
    cli()
