"""How long grading takes, for the benchmark suite (``grade_one_exercise_s``, ``grade_class_20_s``)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from .runner import REPO, grade, grade_class


def _solutions() -> Path:
    folder = REPO / "solutions"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing: timing the grader needs the repository's solutions/")
    return folder


def time_grade_one_exercise(exercise: str = "ex01") -> float:
    """Seconds to grade one distributed exercise (solved, so every check runs), from the call to the result."""
    start = time.perf_counter()
    result = grade(_solutions(), [exercise])
    elapsed = time.perf_counter() - start
    if result["score"] != result["max_score"]:
        raise RuntimeError(f"the solution of {exercise} did not get full marks: {result['exercises']}")
    return elapsed


def time_grade_class(learners: int = 20, jobs: int = 2) -> float:
    """Seconds to grade a class of ``learners`` copies of solutions/, ``jobs`` learners at a time."""
    with tempfile.TemporaryDirectory(prefix="gpucourse-class-") as tmp:
        root = Path(tmp) / "submissions"
        for i in range(learners):
            shutil.copytree(_solutions(), root / f"learner{i:02d}")
        start = time.perf_counter()
        grade_class(root, Path(tmp) / "grades.csv", jobs=jobs)
        return time.perf_counter() - start
