"""The course's wrong answers, each kept as edits to its exercise's solution, made into a module when a test needs it.

``tests/mutants/exNN_name.edits`` holds one exercise's wrong answers as a Python literal, read without importing:

    {"sums_own_only": {"teaches": DOCSTRING, "replace": [(OLD, NEW), ...]}, ...}

``DOCSTRING`` (what the wrong answer teaches, as its module's docstring) takes the place of the solution's, and
each ``OLD`` occurs exactly once in the rest of ``solutions/exNN_name.py``: replacing each in turn gives the wrong
answer. Which checks each must fail is ``tests/test_grading.py``'s
``WRONG_ANSWERS``. A wrong answer still kept whole, as ``tests/mutants/exNN_name/<answer>.py``, is taken as it is
(``scripts/mutants-as-edits`` turns such files into edits). The cheats and hostile files are not answers to an
exercise and stay files (``tests/mutants/cheats``, ``tests/mutants/hostile``).
"""

from __future__ import annotations

import ast
import atexit
import functools
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "tests" / "mutants"
SOLUTIONS = REPO / "solutions"
KEPT_AS_FILES = ("cheats", "hostile")


class EditError(ValueError):
    """A wrong answer's edit that no longer applies to its solution, in one sentence."""


def read(exercise: str, root: Path = ROOT) -> dict:
    """The wrong answers of ``exercise`` (its module name, e.g. ``ex01_ring_allreduce``) kept as edits."""
    path = root / f"{exercise}.edits"
    return ast.literal_eval(path.read_text(encoding="utf-8")) if path.exists() else {}


def split_docstring(source: str) -> tuple[str, str]:
    """``source`` as its module docstring's lines (with the line break after them) and the rest."""
    tree = ast.parse(source)
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return "", source
    lines = source.splitlines(keepends=True)
    return "".join(lines[:first.end_lineno]), "".join(lines[first.end_lineno:])


def wrong_answer(solution: str, record: dict, where: str = "") -> str:
    """The wrong answer ``record`` makes of ``solution``: its docstring, then its edits of the rest."""
    doc, rest = split_docstring(solution)
    return record.get("teaches", doc) + apply(rest, record["replace"], where)


def apply(solution: str, replace, where: str = "") -> str:
    """``solution`` with each ``(old, new)`` of ``replace`` applied in turn, each ``old`` found exactly once."""
    text = solution
    for i, (old, new) in enumerate(replace):
        found = text.count(old)
        if found != 1:
            first = old.strip().splitlines()[0] if old.strip() else repr(old)
            raise EditError(f"{where}: edit {i + 1} ({first[:60]!r}) is found {found} times in the solution, "
                            f"not once: the solution changed under it; rewrite the edit.")
        text = text.replace(old, new)
    return text


def exercises(root: Path = ROOT) -> list[str]:
    """Every exercise with wrong answers, as edits or as files."""
    return sorted({p.stem for p in root.glob("ex*.edits")} | {p.name for p in root.glob("ex*") if p.is_dir()})


def materialise(into: Path, root: Path = ROOT, solutions: Path = SOLUTIONS) -> dict[str, Path]:
    """Write every wrong answer as a module, ``into/exNN_name/<answer>.py``, and copy the cheats and hostile files
    beside them; ``{"exNN_name/<answer>": path}``."""
    made = {}
    for exercise in exercises(root):
        folder = into / exercise
        folder.mkdir(parents=True, exist_ok=True)
        records = read(exercise, root)
        if records:
            solution = (solutions / f"{exercise}.py").read_text(encoding="utf-8")
            for name, record in records.items():
                path = folder / f"{name}.py"
                path.write_text(wrong_answer(solution, record, f"{exercise}/{name}"), encoding="utf-8")
                made[f"{exercise}/{name}"] = path
        for kept in sorted((root / exercise).glob("*.py")) if (root / exercise).is_dir() else []:
            if kept.stem in records:
                raise EditError(f"{exercise}/{kept.stem} is kept both as edits and as a file: keep one.")
            made[f"{exercise}/{kept.stem}"] = Path(shutil.copy2(kept, folder / kept.name))
    for name in KEPT_AS_FILES:
        shutil.copytree(root / name, into / name, dirs_exist_ok=True)
    return made


@functools.cache
def folder() -> Path:
    """A folder, made once a process, holding every wrong answer as a module (and the cheats and hostile files),
    laid out as ``tests/mutants`` was: ``folder() / "ex01_ring_allreduce" / "sums_own_only.py"``."""
    into = Path(tempfile.mkdtemp(prefix="gpucourse-wrong-answers-"))
    into.chmod(0o755)  # the grader copies from here; learner code never reads it
    atexit.register(shutil.rmtree, into, ignore_errors=True)
    materialise(into)
    return into
