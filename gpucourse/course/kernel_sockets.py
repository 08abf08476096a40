"""How the course's Jupyter servers reach their kernels: Unix sockets in a private folder, never TCP ports.

By default a Jupyter server picks five "free" TCP ports on 127.0.0.1 for each
kernel (it binds port 0, reads the number, closes the socket), writes them into
the kernel's connection file, and the kernel binds them a second or more later.
Two servers on one machine — a workshop's seats, or two ``gpucourse lab`` of
one learner — can be handed the same port in that gap. Then one kernel cannot
bind it ("Address already in use"; the restarter retries the very same ports
five times and gives up) and the other receives the first server's messages
("Invalid Signature"). At 9:01, when a class opens its first notebook, that is
a learner's dead kernel.

With IPC transport a kernel's sockets are files named after its own connection
file (``kernel-<uuid>-ipc-1`` … ``-5``) in the server's runtime folder: nothing
is picked from a pool that other processes share, so nothing can collide, and a
restarted kernel binds its own files again. Only the server's user can open
them (the folder is 0700), which TCP on 127.0.0.1 never gave.

A Unix socket's path must fit in 108 bytes (104 on macOS), so the runtime
folder must be short; when Jupyter's default one is too long, the server is
given a private one under /tmp. Windows has no IPC transport in ZeroMQ: there
the servers keep TCP.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import uuid
from pathlib import Path

SUPPORTED = os.name == "posix"
# Everything a Jupyter app needs on its command line for it: KernelManager is the class every kernel manager of
# jupyter_client and jupyter_server derives from, so its setting reaches each kernel the server starts.
SERVER_ARGS = ["--KernelManager.transport=ipc"] if SUPPORTED else []
_SUN_PATH = 104 if sys.platform == "darwin" else 108  # bytes of a socket's path, its final NUL included
# What jupyter_client appends to the runtime folder for a kernel's socket: "/kernel-<uuid>-ipc-<n>", n < 1000.
_SOCKET_NAME = len(f"/kernel-{uuid.uuid4()}-ipc-") + 3


class KernelSocketError(RuntimeError):
    """A folder for kernels' sockets that cannot be used; the message says why and what to do."""


def fits(folder: str | os.PathLike) -> bool:
    """Whether a kernel's socket files in ``folder`` have paths short enough for a Unix socket."""
    return len(os.fsencode(str(folder))) + _SOCKET_NAME < _SUN_PATH


def _base() -> Path:
    """/tmp (short on every Unix), else the system's temporary folder."""
    tmp = Path("/tmp")
    return tmp if tmp.is_dir() and os.access(tmp, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


def private_folder_path(name: str, uid: int | None = None) -> Path:
    """``/tmp/gpucourse-<uid>/<name>``: where :func:`private_folder` puts ``name`` for the account ``uid``."""
    return _base() / f"gpucourse-{os.getuid() if uid is None else uid}" / name


def private_folder(name: str, uid: int | None = None, gid: int | None = None) -> Path:
    """Make (or reuse) :func:`private_folder_path` for ``uid``: both levels owned by it, mode 0700.

    An existing parent owned by someone else, or open to others, is refused
    rather than used: another account could then read or replace the sockets.
    Giving the folder to another account (``uid``) needs root.
    """
    folder = private_folder_path(name, uid)
    owner = os.getuid() if uid is None else uid
    for level in (folder.parent, folder):
        try:
            level.mkdir(mode=0o700)
            if owner != os.getuid():
                os.chown(level, owner, os.getgid() if gid is None else gid)
        except FileExistsError:
            pass
    problem = unusable(folder, uid)
    if problem:
        raise KernelSocketError(problem)
    return folder


def unusable(folder: Path, uid: int | None = None) -> str | None:
    """Why ``folder`` (from :func:`private_folder_path`) cannot hold ``uid``'s kernels' sockets, in one sentence; None
    when it can or does not exist yet. Its parent, or itself, owned by another account or open to others is refused:
    another account could then read or replace the sockets."""
    owner = os.getuid() if uid is None else uid
    if not fits(folder):
        return (f"kernels' sockets in {folder} would have paths too long for a Unix socket; make /tmp writable, or "
                f"set TMPDIR to a short folder.")
    for level in (folder.parent, folder):
        try:
            info = level.lstat()
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner or info.st_mode & 0o077:
            return (f"{level} is not a private folder of user {owner} (a folder owned by it, mode 0700); remove "
                    f"it, and kernels' sockets will be made there again.")
    return None


def runtime_folder(default: str | os.PathLike, name: str) -> Path | None:
    """The runtime folder a server should be given for its kernels' sockets: None when ``default`` (Jupyter's
    own) is short enough, else a private one under /tmp named ``name``. None where IPC is not supported."""
    if not SUPPORTED or fits(default):
        return None
    return private_folder(name)


def kernel_manager_options(folder: str | os.PathLike) -> dict:
    """Keyword arguments for a ``jupyter_client`` ``KernelManager`` run outside a server (nbclient): IPC
    sockets named after a connection file of its own in ``folder``, or in a private folder under /tmp when
    ``folder``'s path is too long for them."""
    if not SUPPORTED:
        return {}
    if not fits(folder):
        folder = private_folder("kernels")
    return {"transport": "ipc", "connection_file": str(Path(folder) / f"kernel-{uuid.uuid4()}.json")}
