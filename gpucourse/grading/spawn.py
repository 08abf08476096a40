"""Starting the sandbox process: as whom, and with what it may keep reading.

When the grader is root, learner code runs as ``nobody``. The sandbox process
starts as root, raises its walls (:mod:`.wall`) and only then becomes
``nobody``: inside its own mount namespace the walls also open a path to what
it needs (the interpreter, torch, the course's package, its own folder)
through folders ``nobody`` may not enter — a private home (``/root/.pyenv``),
a clone in a 0700 folder — without copying anything or changing a mode.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig

NOBODY = 65534


def sandbox_user() -> int | None:
    """The unprivileged user learner code runs as when this process is root (``nobody``), or None (run as
    ourselves: the walls' user namespace and the audit hook are then what stands between learner code and the
    rest)."""
    return NOBODY if os.geteuid() == 0 else None


def library_paths() -> list[str]:
    """Where this process's packages live: the sandbox keeps them readable even when they are inside a folder it
    hides (a virtual environment in the course's repository)."""
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, *sysconfig.get_paths().values())})


def spawn_sandbox(spec: dict, private: str, output: str, user: int | None) -> tuple[subprocess.Popen, socket.socket]:
    """Start the sandbox process (:mod:`.wall`, then :mod:`.sandbox`) as ``user``; it and our end of its channel."""
    ours, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCOURSE_GRADE", "TORCHELASTIC_"))}
    # torch's caches go to the sandbox's own folder.
    env.update(TMPDIR=os.path.join(private, "tmp"), HOME=private,
               TORCHINDUCTOR_CACHE_DIR=os.path.join(private, "tmp", "torchinductor"))
    # It starts as root where ``user`` is given: the walls it raises first need root; then it becomes ``user``.
    walls = {"hidden_paths": spec["hidden_paths"], "private": private, "library": library_paths(), "user": user}
    with open(output, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpucourse.grading.wall", str(theirs.fileno()), json.dumps(walls)],
            pass_fds=[theirs.fileno()], cwd=private, env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    theirs.close()
    with open(os.path.join(spec["work"], "pgids"), "a") as f:
        f.write(f"{proc.pid}\n")
    return proc, ours


def become_subreaper() -> None:
    """Orphans below this process become its children (so it can kill them all); its /proc files are closed to
    the learner's user; it dies with the process that started it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        libc.prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE 0
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


