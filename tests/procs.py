"""Helpers for tests that start processes: free ports, clean environments, and
checking that a process is really gone (a reused pid does not count as alive)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from gpucourse.workshop.processes import alive  # noqa: F401 (the tests import it from here)
from gpucourse.workshop.processes import identity as _identity

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
BIN = Path(sys.executable).parent
# Set by torchrun / accelerate; a test run started under one must not leak them into children.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


# Run in a kernel: how it reaches its server, and how many TCP ports it listens on besides ipykernel's pipe for
# forked processes' output (which zmq binds at once, never picked first and bound later). Over IPC: "ipc tcp
# ports 0", so no other Jupyter server on the machine can be handed one of them.
KERNEL_TRANSPORT = ("import json, sys, psutil\n"
                    "from ipykernel.connect import get_connection_info\n"
                    "pipe = getattr(sys.stdout.pub_thread, '_pipe_port', None)\n"
                    "ports = [c.laddr.port for c in psutil.Process().net_connections('inet')\n"
                    "         if c.status == 'LISTEN' and c.laddr.port != pipe]\n"
                    "print(json.loads(get_connection_info())['transport'], 'tcp ports', len(ports))")


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it: bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    """os.environ without launcher variables, with tests/ importable (for ``rankfns``)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def identity(pid: int | None = None) -> list:
    """``[pid, start time]`` of a process (JSON-friendly), so a reused pid is not mistaken for it."""
    return _identity(pid or os.getpid())


def wait_gone(idents, within: float = 10.0) -> list:
    """Poll until none of ``idents`` runs; return those still running after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = [i for i in idents if alive(i)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def wait_for(condition, within: float, what: str) -> None:
    """Poll ``condition()`` until it is true; fail the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {within:g} s waiting for {what}")
        time.sleep(0.05)


def environment(pid: int) -> list[bytes]:
    """The ``NAME=value`` entries of a process's environment ([] if it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def processes_with(marker: str) -> list[int]:
    """Pids of processes (other than this one) whose environment holds ``marker`` ("NAME=value")."""
    needle = marker.encode()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and int(e) != os.getpid() and needle in environment(int(e))]


def read_identities(folder: Path) -> dict[int, list]:
    """The identities ranks wrote with :func:`rankfns.note_identity`, by rank."""
    import json

    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("rank-*.json")}
