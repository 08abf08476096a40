"""Starting the sandbox process: as whom, with which interpreter, with what it may keep reading.

When the grader is root, learner code runs as ``nobody``, and ``nobody`` must be
able to run Python. Where the only Python lives in a private folder
(``/root/.pyenv``, mode 0700), the sandbox runs a copy of that interpreter,
made once in a folder only root may write (``/var/cache/gpucourse``): its
program, its shared library and its standard library; the packages (torch) come
from the environment as they are, which must be readable by everyone (a virtual
environment in the course's folder is).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile

NOBODY = 65534
COPIES = "/var/cache/gpucourse"
# What the copy leaves out of the standard library: none of it is imported by a sandbox.
_NOT_COPIED = ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "config-*")
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"  # the program's name, and its library's


def _open_to_others(path: str) -> bool:
    """Whether a user with no relation to the files can read ``path`` (and pass through every folder above it)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o004)


def _interpreter_open() -> bool:
    """Whether anyone may run this interpreter and read its standard library where they are."""
    return _open_to_others(sys.executable) and _open_to_others(os.__file__)


def _torch_file() -> str:
    spec = importlib.util.find_spec("torch")
    return spec.origin if spec is not None and spec.origin else ""


def sandbox_user() -> int | None:
    """The unprivileged user the sandbox runs as when this process is root, or None (run as ourselves: the audit
    hook and the walls are then what stands between learner code and the rest).

    ``nobody`` must be able to read torch as installed; the interpreter itself may be a copy (:func:`interpreter`).
    """
    if os.geteuid() != 0:
        return None
    torch_file = _torch_file()
    if not torch_file or not _open_to_others(torch_file):
        return None
    return NOBODY if _interpreter_open() or interpreter_copy() is not None else None


def interpreter_copy() -> str | None:
    """A copy of this interpreter that everyone may run (its prefix), made once; None where none can be made.

    The copy is root's, in a folder only root may write, built beside its final name and renamed into place, so a
    half-made copy is never used and nobody can change what a later grading runs."""
    base = os.path.realpath(sys.base_prefix)
    key = hashlib.sha256(f"{base}|{sys.version}|{os.stat(sys.executable).st_mtime_ns}".encode()).hexdigest()[:12]
    final = os.path.join(COPIES, f"{VERSION}-{key}")
    if os.path.isfile(os.path.join(final, "complete")):
        return final if _trusted(final) else None
    try:
        os.makedirs(COPIES, mode=0o755, exist_ok=True)
        if not _trusted(COPIES):
            return None
        work = tempfile.mkdtemp(prefix=f".{VERSION}-", dir=COPIES)
        os.chmod(work, 0o755)
        os.makedirs(os.path.join(work, "bin"), mode=0o755)
        shutil.copy2(os.path.realpath(sys.executable), os.path.join(work, "bin", VERSION))
        lib = os.path.join(base, "lib")
        os.makedirs(os.path.join(work, "lib"), mode=0o755)
        for name in os.listdir(lib):
            if name.startswith("libpython"):
                shutil.copy2(os.path.join(lib, name), os.path.join(work, "lib", name), follow_symlinks=False)
        shutil.copytree(sysconfig.get_paths()["stdlib"], os.path.join(work, "lib", VERSION), symlinks=True,
                        ignore=shutil.ignore_patterns(*_NOT_COPIED))
        with open(os.path.join(work, "complete"), "w") as f:
            f.write(base + "\n")
        for folder, dirs, files in os.walk(work):
            os.chmod(folder, 0o755)
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
        try:
            os.rename(work, final)
        except OSError:  # another grading made it first
            shutil.rmtree(work, ignore_errors=True)
    except OSError:
        return None
    return final if os.path.isfile(os.path.join(final, "complete")) and _trusted(final) else None


def _trusted(folder: str) -> bool:
    st = os.stat(folder)
    return st.st_uid == 0 and not st.st_mode & 0o022


def interpreter(user: int | None) -> tuple[str, dict]:
    """The program that runs the sandbox as ``user``, and what its environment needs on top of ours."""
    if user is None or _interpreter_open():
        return sys.executable, {}
    prefix = interpreter_copy()
    # The copy's program finds its standard library beside it (its libpython before the one its RUNPATH names);
    # the packages are ours, on the path.
    packages = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    paths = {"LD_LIBRARY_PATH": [os.path.join(prefix, "lib"), os.environ.get("LD_LIBRARY_PATH", "")],
             "PYTHONPATH": [os.environ.get("PYTHONPATH", ""), *packages]}
    return os.path.join(prefix, "bin", VERSION), {
        **{name: os.pathsep.join(p for p in parts if p) for name, parts in paths.items()}, "PYTHONNOUSERSITE": "1"}


def library_paths() -> list[str]:
    """Where this process's packages live: the sandbox keeps them readable even when they are inside a folder it
    hides (a virtual environment in the course's repository)."""
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, *sysconfig.get_paths().values())})


def spawn_sandbox(spec: dict, private: str, output: str, user: int | None) -> tuple[subprocess.Popen, socket.socket]:
    """Start the sandbox process (:mod:`.wall`, then :mod:`.sandbox`) as ``user``; it and our end of its channel."""
    ours, theirs = socket.socketpair()
    program, extra = interpreter(user)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCOURSE_GRADE", "TORCHELASTIC_"))}
    # torch's caches go to the sandbox's own folder.
    env.update(extra, TMPDIR=os.path.join(private, "tmp"), HOME=private,
               TORCHINDUCTOR_CACHE_DIR=os.path.join(private, "tmp", "torchinductor"))
    walls = {"hidden_paths": spec["hidden_paths"], "private": private, "library": library_paths()}
    with open(output, "ab") as out:
        proc = subprocess.Popen(
            [program, "-m", "gpucourse.grading.wall", str(theirs.fileno()), json.dumps(walls)],
            pass_fds=[theirs.fileno()], cwd=private, env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
            user=user, group=user, extra_groups=[] if user is not None else None)
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


