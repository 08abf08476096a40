"""Auto-graded exercises: the checks, the grader, and ``check`` for notebooks.

    from gpucourse.grading import check, grade, grade_class
    check("ex03")                              # in a notebook: HTML summary of exercise 3
    result = grade("exercises")                # every exercise; a dict with score, max_score, checks
    grade_class("submissions", "grades.csv", jobs=2)

Each exercise is a module in ``exercises/`` (stubs), solved in ``solutions/``,
with its checks in ``gpucourse/grading/checks/``. Learner code always runs in
separate processes with a timeout and a memory limit (see ``host``).
"""

from .core import Exercise, Fail, exercises, find_exercise
from .notebook import check
from .report import gradescope, html_report, text_report
from .runner import DEFAULT_TIMEOUT_S, grade, grade_class
from .timing import time_grade_class, time_grade_one_exercise

__all__ = ["DEFAULT_TIMEOUT_S", "Exercise", "Fail", "check", "exercises", "find_exercise", "grade", "grade_class",
           "gradescope", "html_report", "text_report", "time_grade_class", "time_grade_one_exercise"]
