"""The sandbox's walls, raised before it imports anything: ``python -m gpucourse.grading.wall CONTROL_FD SPEC``.

On Linux the sandbox process moves into a mount namespace of its own (with a
user namespace when it is not root) in which:

- what it runs (the interpreter, the packages, the course's package, its own
  folder) can be reached by the user it becomes even where a folder above them
  is closed to that user (``/root``, a clone in a 0700 folder): that folder is
  covered by an empty one holding only those paths, bound back in place;

- the repository is hidden except for the Python environment that may live
  in it, and of the package only what the sandbox itself runs is left
  (``__init__``, ``readable``, ``clock``, ``runtime``, and of ``grading`` the sandbox,
  its channel and the probes) — ``solutions/``, the checks, the reference
  strategies and their compiled ``__pycache__`` are covered by empty folders;
- the grader's folder and the folders being graded are covered too, except
  the sandbox's own private folder;
- every file system is read-only, except that private folder (and ``/dev``,
  ``/proc``, ``/sys``).

Every process the learner's code could start, even one that escaped the audit
hook (see :mod:`gpucourse.grading.sandbox`), is in that namespace too. Each
learner rank then raises walls of its own inside it (:func:`rank_walls`): its
own mount, PID and IPC namespaces, so that no rank sees another's files,
shared memory or processes, and no capability. Started
as root, the process becomes the unprivileged user once the walls are up. Where
namespaces are not allowed, nothing is changed and the audit hook stands alone;
as root it still becomes that user if the user can reach what it runs, and
otherwise stays root and says why in every result (:func:`drop_to`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import stat
import sys
import tempfile

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
_LIVE = ("/proc", "/sys", "/dev")  # left as they are: the kernel's views, not files

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the sandbox runs, relative to the package: everything else in it is covered.
KEEP = {"": {"__init__.py", "readable.py", "clock.py", "runtime", "grading"},
        "grading": {"__init__.py", "sandbox.py", "wire.py", "wall.py", "probes"}}


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def empty_file() -> str:
    """A file that reads as empty, to bind over one that must: /dev/null where it is the null device (character
    device 1, 3), else an empty read-only file of the grader's own. A /dev/null that a mistake has made a file or a
    link would show its content, or its target's, in place of what it covers."""
    try:
        found = os.stat(os.devnull, follow_symlinks=False)
        if stat.S_ISCHR(found.st_mode) and (os.major(found.st_rdev), os.minor(found.st_rdev)) == (1, 3):
            return os.devnull
    except OSError:
        pass
    fd, path = tempfile.mkstemp(prefix="gpucourse-empty-")
    os.close(fd)
    os.chmod(path, 0o444)
    return path


def _mount(libc, source, target, fstype, flags, data=None) -> bool:
    enc = (lambda s: s.encode() if isinstance(s, str) else s)
    return libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) == 0


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def covered(hidden: list[str], private: str, library: tuple = ()) -> list[str]:
    """The folders and files to cover: the repository and package (but what the sandbox runs and the Python
    environment: this interpreter's and ``library``, the grader's packages), the hidden paths (but the private
    folder), and every ``__pycache__`` of the package."""
    out: list[str] = []
    keep_open = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, private, *library)}

    def cover_children(folder: str, keep: set[str]) -> None:
        try:
            names = sorted(os.listdir(folder))
        except PermissionError:
            return  # a folder we may pass through but not list (the grader's): its files are closed to us anyway
        for name in names:
            path = os.path.join(folder, name)
            if name in keep:
                continue
            if any(_under(k, path) for k in keep_open):
                if os.path.isdir(path) and not any(k == path for k in keep_open):
                    cover_children(path, set())
                continue
            out.append(path)

    package = os.path.realpath(PACKAGE)
    repository = os.path.dirname(package)
    if os.path.exists(os.path.join(repository, "pyproject.toml")):
        cover_children(repository, {os.path.basename(package)})
    cover_children(package, KEEP[""])
    cover_children(os.path.join(package, "grading"), KEEP["grading"])
    for folder, dirs, _ in os.walk(package):
        if "__pycache__" in dirs:
            out.append(os.path.join(folder, "__pycache__"))
    for path in hidden:
        path = os.path.realpath(path)
        if _under(package, path) or _under(repository, path) and path == repository:
            continue
        if any(_under(k, path) for k in keep_open):
            if os.path.isdir(path):
                cover_children(path, set())
        elif os.path.exists(path):
            out.append(path)
    return sorted(set(out))


def needed(private: str, library: tuple = ()) -> list[str]:
    """The folders the sandbox runs from: the interpreter's prefixes, the packages, the course's package, the
    folders on ``sys.path`` and its own private folder."""
    paths = (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, PACKAGE, private, *library, *sys.path)
    return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


def _closed_above(path: str) -> str | None:
    """The topmost folder above ``path`` that others may not pass through, or None."""
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        folder = os.sep.join(parts[:i])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _make_open_folders(path: str) -> None:
    """``path`` and the folders above it, made where missing, each 0755 whatever the umask."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        _make_open_folders(parent)
    if not os.path.isdir(path):
        os.mkdir(path)
        os.chmod(path, 0o755)


def reveal(libc, paths: list[str]) -> None:
    """Open a way to ``paths`` through the folders above them that others may not pass: the topmost such folder
    is covered by an empty one that anyone may pass through, holding only those paths, each bound back in place
    (so every path, and every path written into the environment, stays what it was)."""
    closed: dict[str, list[str]] = {}
    for path in paths:
        top = _closed_above(path)
        if top is not None:
            closed.setdefault(top, []).append(path)
    for top, inside in sorted(closed.items()):
        handles = {path: os.open(path, os.O_PATH) for path in inside}  # the real folders, before the cover hides them
        _mount(libc, "tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=16k,mode=755")
        bound: list[str] = []
        for path in sorted(inside):
            if not any(_under(path, b) for b in bound):  # a path inside one bound already came back with it
                _make_open_folders(path)
                _mount(libc, f"/proc/self/fd/{handles[path]}", path, None, MS_BIND | MS_REC)
                bound.append(path)
            os.close(handles[path])


def seat_view(needed_paths: list[str], hidden: list[str]) -> bool:
    """A mount namespace of its own for a process about to become an unprivileged user (a workshop seat's
    server): ``needed_paths`` reachable through closed folders (:func:`reveal`), each of ``hidden`` covered by an
    empty read-only folder (a file by an empty one); nothing else changes, every file system stays writable as
    its modes say. False, and nothing changed, where the machine does not allow it. Needs root."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False
    libc = _libc()
    if libc.unshare(CLONE_NEWNS) != 0 or not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):
        return False
    reveal(libc, needed_paths)
    empty = empty_file()
    for path in hidden:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
        elif os.path.exists(path):
            _mount(libc, empty, path, None, MS_BIND)
    return True


def _unreachable(user: int, private: str) -> list[str]:
    """What ``user`` could not read (or, for its own folder, write) of what the sandbox runs, asked of the kernel
    with that user's identity for a moment."""
    spec = importlib.util.find_spec("torch")
    wanted = [(sys.executable, os.X_OK), (os.__file__, os.R_OK), (os.path.join(PACKAGE, "__init__.py"), os.R_OK),
              (private, os.W_OK | os.X_OK)] + ([(spec.origin, os.R_OK)] if spec and spec.origin else [])
    os.setegid(user)
    os.seteuid(user)
    try:
        return [path for path, mode in wanted if not os.access(path, mode, effective_ids=True)]
    finally:
        os.seteuid(0)
        os.setegid(0)


def drop_to(user: int, private: str, walled: bool = False) -> str:
    """Become ``user`` for good (no way back to root), or say why this process stays root ("" once it is
    ``user``): it is better to grade as root and say so than not to grade at all."""
    missing = _unreachable(user, private)
    if missing:
        return f"the sandbox's user (uid {user}) cannot reach {missing[0]}" + (
            "" if walled else " and this machine allows no mount namespace to open a way to it")
    os.setgroups([])
    os.setresgid(user, user, user)
    os.setresuid(user, user, user)
    _libc().prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, which changing user cleared: as if it had started as the user
    return ""


def raise_walls(hidden: list[str], private: str, library: tuple = ()) -> bool:
    """Move this process into its own mount namespace with the repository hidden and the files read-only
    (but ``private``). False, and nothing changed, where the machine does not allow it."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        if libc.unshare(CLONE_NEWNS) != 0:
            return False
    else:
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            return False
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError:
            return False
    if not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):
        return False
    if uid == 0:
        reveal(libc, needed(private, library))
    targets = covered(hidden, private, library)
    empty = empty_file()
    for path in targets:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
        else:
            _mount(libc, empty, path, None, MS_BIND)
    _mount(libc, private, private, None, MS_BIND | MS_REC)
    for point, options in _mount_points():
        if any(_under(point, live) for live in _LIVE) or _under(point, private) or point in targets:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for name, bit in _FLAGS.items():
            if name in options:
                flags |= bit
        _mount(libc, None, point, None, flags)
    return True


def _read_only(libc, point: str, options: set[str]) -> bool:
    """Make the mount at ``point`` read-only, keeping the flags it has (a namespace that is not the mount's owner
    may not clear them)."""
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    for name, bit in _FLAGS.items():
        if name in options:
            flags |= bit
    return _mount(libc, None, point, None, flags)


_LAST_CAPABILITY = 63
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4


def drop_capabilities(libc) -> bool:
    """Give up every capability, for good: the bounding and ambient sets emptied, the effective, permitted and
    inheritable sets zero, and no program may raise them again (no_new_privs). Whether the kernel agreed."""
    for cap in range(_LAST_CAPABILITY + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two of {effective, permitted, inheritable}, all zero
    return libc.capset(header, data) == 0 and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


def rank_walls(own: str, readable: list[str], private: str, tmp_bytes: int, library: tuple = ()) -> str:
    """The walls of one learner rank, raised before its code runs, in the PID namespace of its own that the
    launcher gave it (``launch(isolate=True)``): a mount namespace of its own in which

    - ``/proc`` is a fresh one, which shows no process but this rank's own (or, where the kernel refuses a fresh
      one, an empty folder);
    - ``/tmp`` and ``/dev/shm`` are empty and its own (``tmp_bytes`` each), so no file or POSIX shared memory
      reaches another rank, but for what it runs from (:func:`needed`, with ``library``) where that lies in them
      (a clone in /tmp), bound back as the sandbox's walls left it;
    - of the sandbox's ``private`` folder, which holds every rank's, only ``own`` (this rank's folder, writable)
      and ``readable`` (the learner's file, read-only) are left;
    - the rest is read-only, as the sandbox's walls (:func:`raise_walls`) left it;

    and then it gives up every capability (:func:`drop_capabilities`). "" once raised; else why not."""
    if not sys.platform.startswith("linux"):
        return "mount namespaces are Linux's"
    libc = _libc()
    if libc.unshare(CLONE_NEWNS) != 0 or not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):
        return f"this machine gave the rank no mount namespace ({os.strerror(ctypes.get_errno())})"
    emptied = [point for point in ("/tmp", "/dev/shm") if os.path.isdir(point)]
    runs_from: list[str] = []  # the outermost of the folders it runs from that lie in those
    for path in needed(private, library):
        if any(_under(path, point) for point in emptied) and not _under(path, private) and \
                not any(_under(path, outer) for outer in runs_from):
            runs_from.append(path)
    # Opened before the covers hide them; bound back through this process's own descriptors.
    handles = {path: os.open(path, os.O_PATH) for path in [*runs_from, own, *readable]}
    try:
        # First /tmp and /dev/shm, which may hold the sandbox's folder (the grader's work folder is in /tmp).
        for point in emptied:
            if not _mount(libc, "tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=1777"):
                return f"{point} could not be made the rank's own ({os.strerror(ctypes.get_errno())})"
        for path in runs_from:  # with what the sandbox's walls cover inside them (MS_REC)
            _make_open_folders(path)
            if not _mount(libc, f"/proc/self/fd/{handles[path]}", path, None, MS_BIND | MS_REC):
                return f"{path} could not be bound back ({os.strerror(ctypes.get_errno())})"
        _make_open_folders(private)
        if not _mount(libc, "tmpfs", private, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755"):
            return f"the sandbox's folder could not be covered ({os.strerror(ctypes.get_errno())})"
        for path in [own, *readable]:
            handle = handles[path]
            if os.path.isdir(f"/proc/self/fd/{handle}"):
                _make_open_folders(path)
            else:
                _make_open_folders(os.path.dirname(path))
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            if not _mount(libc, f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC):
                return f"{path} could not be bound back ({os.strerror(ctypes.get_errno())})"
    finally:
        for handle in handles.values():
            os.close(handle)
    points = dict(_mount_points())
    for path in [*readable, private]:
        _read_only(libc, path, points.get(path, set()))
    if not _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC):
        _mount(libc, "tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    for point in ("/dev", "/sys"):
        _read_only(libc, point, points.get(point, set()))
    if not drop_capabilities(libc):
        return f"the rank could not give up its capabilities ({os.strerror(ctypes.get_errno())})"
    return ""


def _mount_points() -> list[tuple[str, set[str]]]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            points.append((fields[4].replace("\\040", " "), set(fields[5].split(","))))
    return points


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    # Read before the walls go up: the op format, layouts and checkers of the schedules (exercises 5 and 13 may
    # import them; the sandbox censors the reference schedules out of them, and empties this dict).
    sources = {}
    for name in ("schedules", "schedules_virtual"):
        with open(os.path.join(PACKAGE, "parallel", f"{name}.py"), encoding="utf-8") as f:
            sources[name] = f.read()
    library = tuple(spec.get("library", ()))
    walled = raise_walls(spec["hidden_paths"], spec["private"], library)
    as_root = drop_to(spec["user"], spec["private"], walled) if spec.get("user") is not None else ""
    from .sandbox import main as sandbox_main

    return sandbox_main(int(argv[0]), sources, library, as_root, rank_walls)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
