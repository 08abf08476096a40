"""The course's notebooks and exercises as files a learner works in, wherever the course was installed from.

In a checkout they are the repository's ``notebooks/`` and ``exercises/``. A wheel (``make dist``) carries them in
the package, at ``gpucourse/course/packaged/``, for a learner on Colab, Kaggle or a JupyterHub the course did not
set up: ``gpucourse fetch-course DIR`` copies them out (the exercises as stubs: the wheel holds no solutions), and
``check("exNN")`` then grades ``DIR/exercises`` as it grades a checkout's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..files import write_atomic

PARTS = {"notebooks": "*.ipynb", "exercises": "ex[0-9][0-9]_*.py"}
PACKAGED = Path(__file__).resolve().parent / "packaged"  # where a wheel keeps them
CHECKOUT = Path(__file__).resolve().parents[2]           # the repository, when the package runs from one


class FetchError(ValueError):
    """Why the course's files cannot be copied, in one sentence."""


def source() -> Path | None:
    """The folder holding ``notebooks/`` and ``exercises/``: the wheel's own copy, else the checkout's; None when
    neither has them (a package installed without them)."""
    for root in (PACKAGED, CHECKOUT):
        if all(any((root / part).glob(pattern)) for part, pattern in PARTS.items()):
            return root
    return None


def files(root: Path) -> list[Path]:
    """The course's files under ``root``, relative to it, in order."""
    return sorted(p.relative_to(root) for part, pattern in PARTS.items() for p in (root / part).glob(pattern))


def fetch(dest: str | Path) -> list[Path]:
    """Copy the notebooks and exercises into ``dest`` (made if missing); the files written.

    Refused, with nothing written, when there is nothing to copy or ``dest`` already holds one of the files (a
    learner's work is never overwritten) or is not a folder."""
    root = source()
    if root is None:
        raise FetchError("this installation of gpucourse holds no notebooks or exercises: install the course's "
                         "wheel (make dist), or work in a checkout of the repository.")
    dest = Path(dest).expanduser()
    if dest.exists() and not dest.is_dir():
        raise FetchError(f"{dest} is a file, not a folder: give the folder to copy the course into.")
    wanted = files(root)
    there = [str(rel) for rel in wanted if (dest / rel).exists()]
    if there:
        raise FetchError(f"{dest} already holds {there[0]}{f' and {len(there) - 1} more' if len(there) > 1 else ''}"
                         f" of the course's files: give an empty folder (nothing was copied).")
    written = []
    for rel in wanted:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dest / rel, (root / rel).read_bytes())
        written.append(dest / rel)
    return written


def stage(repo: Path, into: Path) -> None:
    """Lay the repository's package out in ``into`` for a wheel: the tracked files, with the notebooks and the
    exercises copied into the package's ``packaged`` folder (what ``scripts/build-wheel`` builds from)."""
    target = into / "gpucourse" / "course" / "packaged"
    for part, pattern in PARTS.items():
        (target / part).mkdir(parents=True, exist_ok=True)
        for path in sorted((repo / part).glob(pattern)):
            shutil.copy2(path, target / part / path.name)
