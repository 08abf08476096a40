"""Auto-graded exercises: the checks, the grader, and ``check`` for notebooks.

    from gpucourse.grading import check, grade, grade_class
    check("ex03")                              # in a notebook: HTML summary of exercise 3
    result = grade("exercises")                # every exercise; a dict with score, max_score, checks
    grade_class("submissions", "grades.csv", jobs=2)

Each exercise is a module in ``exercises/`` (stubs), solved in ``solutions/``,
with its checks in ``gpucourse/grading/checks/`` and the code that drives the
learner's functions in ``gpucourse/grading/probes/``. The checks run in a
trusted process; learner code runs only in sandboxed worker processes that
get inputs and send back outputs (see ``host`` and ``sandbox``).

Names are imported when first used, so the sandbox, which imports
``gpucourse.grading.sandbox``, never loads the checks.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Exercise": "core", "Fail": "core", "exercises": "core", "find_exercise": "core", "check": "notebook",
    "gradescope": "report", "html_report": "report", "text_report": "report", "DEFAULT_TIMEOUT_S": "runner",
    "grade": "runner", "grade_class": "runner", "grader_failed": "results", "time_grade_class": "timing",
    "time_grade_one_exercise": "timing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpucourse.grading' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
