"""Grading a whole workshop at once: every seat's exercises, with the course's own grader, into one CSV.

This is ``gpucourse grade --class`` pointed at the seats: each seat is a
learner, its ``exercises/`` folder its submission. The grader
(:func:`gpucourse.grading.runner.grade_class`) copies every seat's files before
any learner code runs, grades them in isolated, time-limited processes, several
at a time, and writes the CSV and each seat's Gradescope ``results.json`` only
once the whole class is graded. The seats' live folders are hidden from the
code being graded, so one learner's code cannot read another's answers. It
works on a running workshop or a stopped one: the seats' files are all it needs.
An exercise the grader could not run for a seat gets no grade: an empty cell,
an empty total, no results JSON for that seat; the result names them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..grading import core
from ..grading.report import gradescope as gradescope_json
from ..grading.runner import DEFAULT_TIMEOUT_S, grade_class, results_folder
from ..files import write_atomic
from .errors import WorkshopError
from .folder import Workshop


def default_jobs() -> int:
    """Seats graded at a time: about a quarter of the cores, as a distributed check runs up to 4 ranks."""
    return max(1, (os.cpu_count() or 1) // 4)


def _check_outputs(out_csv: Path, gradescope: Path | None) -> None:
    """Refuse outputs that could not be written, before anything is graded."""
    if out_csv.is_dir():
        raise WorkshopError(f"--out {out_csv} is a folder; give a file name such as grades.csv.")
    if not out_csv.parent.is_dir():
        raise WorkshopError(f"--out {out_csv} cannot be written: the folder {out_csv.parent} does not exist.")
    if not os.access(out_csv.parent, os.W_OK):
        raise WorkshopError(f"--out {out_csv} cannot be written: permission denied.")
    results = results_folder(out_csv)
    if results.exists() and not results.is_dir():
        raise WorkshopError(f"{results} is a file; each seat's results JSON goes in a folder of that name.")
    if gradescope is not None:
        if gradescope.exists() and not gradescope.is_dir():
            raise WorkshopError(f"--gradescope {gradescope} is a file; give a folder.")
        if not gradescope.exists() and not gradescope.parent.is_dir():
            raise WorkshopError(f"--gradescope {gradescope} cannot be created: the folder {gradescope.parent} "
                                f"does not exist.")


def collect(root=None, out_csv: str | os.PathLike = "grades.csv", *, gradescope: str | os.PathLike | None = None,
            exercises: list[str] | None = None, jobs: int | None = None, timeout: float | None = None,
            on_seat=None) -> dict:
    """Grade every seat of the workshop in ``root``; write ``out_csv`` and, with ``gradescope``, one
    ``DIR/<seat>/results.json`` per seat graded whole. Returns grade_class's result (its ``"not_graded"``: each
    seat's exercises the grader could not run, and why) plus ``"gradescope"`` (the files).

    ``exercises`` limits grading to those ids ("ex01"); ``on_seat(name, result)``
    is called as each seat is done.
    """
    ws = Workshop(root)
    settings = ws.settings()  # a sentence when there is no workshop
    out_csv = Path(out_csv).expanduser().resolve()
    target = Path(gradescope).expanduser().resolve() if gradescope is not None else None
    _check_outputs(out_csv, target)
    for e in exercises or []:
        try:
            core.find_exercise(e)
        except KeyError as err:
            raise WorkshopError(f"{err.args[0]}.") from None
    if jobs is not None and jobs < 1:
        raise WorkshopError(f"--jobs {jobs} must be at least 1.")
    if timeout is not None and timeout <= 0:
        raise WorkshopError(f"--timeout {timeout:g} must be more than 0.")
    folders = ws.seat_folders(settings)
    # The class, as the grader expects it: one folder per learner holding their exercise files. Links to
    # each seat's exercises/ (the grader copies the files before grading), so nothing is duplicated here.
    view = ws.hub_dir / "class"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for name, folder in folders.items():
        (view / name).symlink_to(folder / "exercises", target_is_directory=True)
    try:
        result = grade_class(view, out_csv, jobs=jobs or default_jobs(), timeout=timeout or DEFAULT_TIMEOUT_S,
                             exercises=exercises, on_learner=on_seat,
                             hidden_paths=(str(ws.root), *map(str, folders.values())))
    finally:
        shutil.rmtree(view, ignore_errors=True)
    written = []
    if target is not None:
        for name, seat_result in sorted(result["learners"].items()):
            path = target / name / "results.json"
            if name in result["not_graded"]:  # no grade to upload: not even one left by an earlier run
                path.unlink(missing_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(gradescope_json(seat_result), indent=1))
            written.append(str(path))
    return {**result, "gradescope": written}
