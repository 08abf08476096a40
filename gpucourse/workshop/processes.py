"""Finding and ending every process a workshop started, however it was started.

The hub, its proxy, each seat's JupyterLab, the kernels those start and the
ranks the kernels launch all inherit one environment variable,
``GPUCOURSE_WORKSHOP_ID=<the workshop's id>``. Stopping a workshop asks the hub
to stop first (it stops the seats' servers and its proxy itself), then looks in
``/proc`` for any process still carrying the marker — a kernel that did not
die, a rank a learner detached with ``setsid`` — ends those, and checks that
none is left. A pid is compared with its start time, so a pid the system has
since reused for something else is never mistaken for ours.
"""

from __future__ import annotations

import os
import signal
import time

MARKER = "GPUCOURSE_WORKSHOP_ID"


def marker_env(workshop_id: str) -> dict[str, str]:
    """The variable that tags every process of the workshop ``workshop_id``."""
    return {MARKER: workshop_id}


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # from field 3 (state) on; the name may hold spaces or ')'


def identity(pid: int) -> list | None:
    """``[pid, start time]``, what tells this process from a later one given the same pid; None if gone."""
    fields = _stat(pid)
    return None if fields is None else [pid, fields[19]]


def alive(ident) -> bool:
    """Whether that very process still runs (a zombie has exited, so it does not)."""
    fields = _stat(ident[0]) if ident else None
    return fields is not None and fields[19] == ident[1] and fields[0] != "Z"


def marked(workshop_id: str) -> list[int]:
    """Pids of the running processes (this one excepted) tagged with ``workshop_id``."""
    tag = f"{MARKER}={workshop_id}".encode()
    found = []
    if not os.path.isdir("/proc"):  # not Linux: only the hub's own stopping can be relied on
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                tagged = tag in f.read().split(b"\0")
        except OSError:
            continue
        fields = _stat(int(entry))
        if tagged and fields is not None and fields[0] != "Z":
            found.append(int(entry))
    return found


def hubs() -> list[str]:
    """The folders of the workshops whose hub runs on this machine (those this account may look into), from each
    hub's command line: ``python -m jupyterhub -f <folder>/hub/jupyterhub_config.py``, with the marker."""
    found = []
    if not os.path.isdir("/proc"):
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"jupyterhub" not in argv or b"-f" not in argv[:-1]:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                tagged = any(v.startswith(f"{MARKER}=".encode()) for v in f.read().split(b"\0"))
        except OSError:
            continue
        if tagged:
            found.append(os.path.dirname(os.path.dirname(os.fsdecode(argv[argv.index(b"-f") + 1]))))
    return found


def wait_until(condition, within: float, step: float = 0.1) -> bool:
    """Poll ``condition()`` until it holds or ``within`` seconds pass; whether it held."""
    deadline = time.monotonic() + within
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def reap(pid: int) -> None:
    """Collect the exit status of ``pid`` if it is this process's child (no zombie left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def end(pids: list[int], grace: float = 5.0) -> list[int]:
    """SIGTERM, then after ``grace`` seconds SIGKILL, each of ``pids``; return those still running after that."""
    idents = [i for i in (identity(p) for p in pids) if i is not None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in [i for i in idents if alive(i)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for pid, _ in idents:
            reap(pid)
        if wait_until(lambda: not any(alive(i) for i in idents), grace):
            return []
    return [i[0] for i in idents if alive(i)]
