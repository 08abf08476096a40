"""A Unix user for every seat, when the hub runs as root: one learner's code cannot touch another's.

With generated seats (codes, not real accounts) and the hub started as root,
``workshop start`` gives each seat an account of its own, as The Littlest
JupyterHub does for its users: ``gc<workshop>-seat01`` (the workshop's id
keeps two workshops apart), a system account with no password and no login
shell, whose home is the seat's folder. The seat's folder is the account's and
0700; its server and every kernel and rank it starts run as that account
(:class:`.spawner.SeatSpawner`), never as root. The accounts stay across stop
and start (a seat's files are theirs); ``gpucourse workshop remove-users``
removes them and hands the folders back to the instructor, keeping every file.

Not as root, seats share the instructor's account: ``start`` says so, and so
does the dashboard.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from .errors import WorkshopError

SHELL = "/usr/sbin/nologin"
SHARED_NOTE = ("seats share this account (the hub is not root): a learner's code can read and change other seats' "
               "files; start the workshop as root to give each seat a Unix user of its own")


def account_name(workshop_id: str, seat: str) -> str:
    """``gc1a2b3c-seat01``: the seat's account (32 characters at most, as useradd requires)."""
    return f"gc{workshop_id[:6]}-{seat}"


def wanted(settings: dict) -> bool:
    """Whether this workshop's seats get accounts of their own: generated seats on this machine, hub as root."""
    return os.geteuid() == 0 and settings["login"] != "system" and not settings.get("slurm")


def lookup(account: str) -> tuple[int, int] | None:
    """(uid, gid) of ``account``, or None when there is no such account."""
    try:
        entry = pwd.getpwnam(account)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def missing_tools() -> str | None:
    """A sentence naming what this machine lacks to make accounts, or None."""
    absent = [tool for tool in ("useradd", "userdel") if shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin")
              is None]
    return f"{' and '.join(absent)} not found (the 'passwd' package)" if absent else None


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise WorkshopError(f"'{' '.join(argv)}' failed: {(done.stderr or done.stdout).strip()}")


def _hand_over(folder: Path, uid: int, gid: int) -> None:
    """``folder`` and everything in it owned by ``uid``; the folder itself 0700 (links are not followed)."""
    if folder.exists():
        if folder.stat().st_uid != uid:
            for path in [folder, *folder.rglob("*")]:
                os.chown(path, uid, gid, follow_symlinks=False)
        os.chmod(folder, 0o700)


def ensure(workshop_id: str, folders: dict[str, Path]) -> dict[str, str]:
    """Each seat's account (made where missing) owning its folder; ``{seat: account}``."""
    made = {}
    for seat, folder in folders.items():
        name = account_name(workshop_id, seat)
        if lookup(name) is None:
            _run([shutil.which("useradd", path="/usr/sbin:/usr/bin:/sbin:/bin") or "useradd", "--system",
                  "--user-group", "--no-create-home", "--home-dir", str(folder), "--shell", SHELL,
                  "--comment", f"gpucourse workshop {workshop_id[:8]} {seat}", name])
        uid, gid = lookup(name)
        _hand_over(folder, uid, gid)
        made[seat] = name
    return made


def remove(workshop_id: str, folders: dict[str, Path]) -> list[str]:
    """Remove the seats' accounts; each folder (every file kept) goes back to this process's account. The
    accounts removed."""
    if os.geteuid() != 0:
        raise WorkshopError("removing the seats' Unix users needs root; run it with sudo.")
    removed = []
    for seat, folder in folders.items():
        name = account_name(workshop_id, seat)
        if lookup(name) is None:
            continue
        if folder.exists():
            for path in [folder, *folder.rglob("*")]:
                os.chown(path, os.getuid(), os.getgid(), follow_symlinks=False)
        _run([shutil.which("userdel", path="/usr/sbin:/usr/bin:/sbin:/bin") or "userdel", name])
        removed.append(name)
    return removed
