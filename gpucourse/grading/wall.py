"""The sandbox's walls, raised before it imports anything: ``python -m gpucourse.grading.wall CONTROL_FD SPEC``.

On Linux the sandbox process moves into a mount namespace of its own (with a
user namespace when it is not root) in which:

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
hook (see :mod:`gpucourse.grading.sandbox`), is in that namespace too. Where
namespaces are not allowed, nothing is changed and the audit hook stands alone.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

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
    targets = covered(hidden, private, library)
    for path in targets:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
        else:
            _mount(libc, os.devnull, path, None, MS_BIND)
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
    raise_walls(spec["hidden_paths"], spec["private"], library)
    from .sandbox import main as sandbox_main

    return sandbox_main(int(argv[0]), sources, library)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
