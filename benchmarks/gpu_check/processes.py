"""Starting and stopping process trees: a step's commands run in sessions of their own, so that a
signal to gpu-check reaches only gpu-check, which then stops each step's whole tree itself."""

import os
import signal
import socket
import subprocess
import time

import psutil  # a dependency of accelerate

from .plan import STOP_GRACE_SECONDS


class Interrupted(Exception):
    """SIGTERM or SIGINT reached gpu-check itself: stop the running step, write the report, end."""


def interrupt(signum, frame):
    # once: the clean-up that follows must not be cut short itself
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    raise Interrupted


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """End a step's command and every process it started, as a user would: SIGTERM to the launcher's
    process group first (torchrun passes it on to its workers, and the recipes save a checkpoint and
    exit 75), then, after at most GRACE seconds, SIGKILL to whatever is left of the process tree.
    torchrun starts each worker in a session of its own, outside the launcher's group, and a worker
    whose launcher has ended is no longer its child: so the tree is collected before the signal and
    again while it ends, and each process in it is killed by identity (PID and start time, so that a
    reused PID is left alone)."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end:
        tree |= descendants(proc.pid)
        if proc.poll() is not None and not any(alive(p) for p in tree):
            break
        time.sleep(0.1)
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    psutil.wait_procs(list(tree), timeout=5)


def descendants(pid: int) -> set:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return set()


def alive(process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
