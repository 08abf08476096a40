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
    ourselves: the walls' user namespaces, the sandbox's and each rank's own, and the audit hook are then what
    stands between learner code and the rest). Whether ranks can be walled in at all: :func:`isolation_problem`."""
    return NOBODY if os.geteuid() == 0 else None


def isolation_problem() -> str | None:
    """Why learner ranks cannot be walled in by the operating system here, or None where they can: the sandbox's
    user (:func:`sandbox_user`, or this one) must be able to make user, mount, PID and IPC namespaces (see
    :func:`gpucourse.grading.wall.rank_walls`). Asked of the kernel by a child process, as that user."""
    if not sys.platform.startswith("linux"):
        return "learner ranks are isolated by Linux's namespaces, and this is not Linux"
    user = sandbox_user()
    libc = ctypes.CDLL(None, use_errno=True)
    flags = 0x10000000 | 0x00020000 | 0x20000000 | 0x08000000  # CLONE_NEWUSER | NEWNS | NEWPID | NEWIPC
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if user is not None:
                os.setgroups([])
                os.setresgid(user, user, user)
                os.setresuid(user, user, user)
            code = 0 if libc.unshare(flags) == 0 else ctypes.get_errno() or 1
        finally:
            os._exit(min(code, 255))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code == 0:
        return None
    who = f"the sandbox's user (uid {user})" if user is not None else f"this user (uid {os.geteuid()})"
    return (f"{who} may not make the user, mount, PID and IPC namespaces that wall each learner rank in "
            f"({os.strerror(code) if code > 0 else f'signal {-code}'}); allow unprivileged user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)")


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


