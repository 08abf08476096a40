"""``check("ex03")``: grade one exercise from a notebook cell and show what passed.

The grading runs in a separate process (see :mod:`gpucourse.grading.runner`),
so the kernel's variables, its CUDA context and its imported modules are left
as they were, and the exercise file is read afresh from disk every time: edit,
save, check again.
"""

from __future__ import annotations

from .report import html_report, text_report
from .runner import DEFAULT_TIMEOUT_S, grade, record_progress, stop_all, tries


def check(exercise: str, path=None, *, timeout: float = DEFAULT_TIMEOUT_S, seed: int | None = None) -> None:
    """Grade ``exercise`` ("ex03") from ``exercises/`` and show each check, its hint and the score.

    ``exercises/`` is looked for in and above the current folder, then in the
    repository; ``path`` names another folder. In a notebook the summary is
    HTML; elsewhere it is printed as text. Grading your own ``exercises/``
    (no ``path``) records the score in your progress file (``gpucourse progress``).
    Where the grader itself cannot run, the first line says so and why: that is
    not your code, no score is shown or recorded, and the instructor is told.
    """
    try:
        result = grade(path, [exercise], timeout=timeout, seed=seed)
    except KeyboardInterrupt:
        stop_all()
        raise
    # Your own exercises: the hints climb a rung with your tries (report.LADDER); another folder shows them all.
    attempt = tries(result) if path is None else None
    note = record_progress(result) if path is None else ""
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(HTML(html_report(result, attempt) + (f"<p><i>{note}</i></p>" if note else "")))
    else:
        print(text_report(result, show_passed=True, tries=attempt) + (f"\n{note}" if note else ""))
