"""A grader that cannot run is never the learner's failure: ``check`` says so in its first line and shows no score,
the progress file records no try (the grader's failure apart, for the dashboard), the class report asks the
instructor to see to it instead of calling the seat stuck, and ``collect`` and ``grade`` write no grade and exit 3.

The grader is made unable to run for real, in two ways an instructor's machine can break it, each costing a few
milliseconds: ``PYTHONHOME`` pointing nowhere (the grading process, a fresh interpreter that inherits the
environment, dies before it can import anything: "Fatal Python error ... No module named 'encodings'"), and a
temporary folder that cannot hold the grader's working folder (``tempfile.tempdir`` under ``/dev/null``, which
even root cannot write into), so that grading fails before its process starts.
"""

from __future__ import annotations

import csv
import html
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

import pytest

from gpucourse import cli, grading
from gpucourse.course import progress
from gpucourse.grading import catalog, host, runner
from gpucourse.workshop import dashboard, plan, processes, report
from gpucourse.workshop.folder import Workshop

REPO = Path(__file__).resolve().parents[1]
HOST_DIED = "the grader's own process ended with status 1 before it graded this exercise"
NOT_YOURS = "not your code; tell the instructor"


@pytest.fixture
def broken_python(monkeypatch, tmp_path):
    """Every interpreter started from here on, the grading process first, dies at its start."""
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "no-python-here"))


def _exercises_here(folder: Path, monkeypatch) -> None:
    (folder / "exercises").mkdir()
    for name in ("ex01_ring_allreduce", "ex02_data_parallel"):
        shutil.copy(REPO / "exercises" / f"{name}.py", folder / "exercises")
    monkeypatch.chdir(folder)


def test_check_says_the_grader_could_not_run_and_records_no_try(tmp_path, monkeypatch, capsys, broken_python):
    _exercises_here(tmp_path, monkeypatch)
    progress.record_exercise("ex02_data_parallel", 4, 10, [{"check": "averages", "message": "m", "hint": "h"}])
    grading.check("ex02")
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith(f"the grader could not run (ex02_data_parallel not graded): {HOST_DIED}"), out
    assert first.endswith(NOT_YOURS) and "No module named 'encodings'" in out  # the end of the grader's log
    assert "0/10" not in out and "FAIL" not in out
    record = progress.load()
    assert record["exercises"]["ex02_data_parallel"]["attempts"] == 1  # the try before, and none for this
    assert record["grader_failures"]["ex02_data_parallel"]["why"].startswith(HOST_DIED)
    # In a notebook: the same first line, in HTML.
    import IPython
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", shown.append)
    grading.check("ex01")
    page = shown[0].data
    assert page.index("the grader could not run") < page.index("ex01_ring_allreduce — not graded")
    assert NOT_YOURS in page and "0 / 10" not in page
    assert "ex01_ring_allreduce" not in progress.load()["exercises"]
    # The next grading that runs clears it; a stub graded untouched (a Run All) ran too.
    progress.record_exercise("ex02_data_parallel", 10, 10, [])
    assert progress.clear_grader_failure("ex01_ring_allreduce") and not progress.load()["grader_failures"]


def test_grading_that_fails_before_its_process_starts_raises_nothing(tmp_path, monkeypatch, capsys):
    _exercises_here(tmp_path, monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", "/dev/null/tmp")
    result = runner.grade(None, ["ex01", "ex02"], seed=3)
    assert (result["score"], result["max_score"]) == (0, 0)
    assert [(e["exercise"], e["seed"], e["score"], e["max_score"]) for e in result["exercises"]] == \
        [("ex01", 3, 0, catalog.POINTS), ("ex02", 3, 0, catalog.POINTS)]
    assert all(e["grader_error"].startswith("the grader could not make its working folder (NotADirectoryError")
               for e in result["exercises"])
    grading.check("ex01")
    assert capsys.readouterr().out.startswith("the grader could not run (ex01_ring_allreduce not graded): "
                                              "the grader could not make its working folder")
    assert list(progress.load()["grader_failures"]) == ["ex01_ring_allreduce"]


def test_cli_grade_exits_3_and_writes_no_results(tmp_path, monkeypatch, capsys, broken_python):
    _exercises_here(tmp_path, monkeypatch)
    out = tmp_path / "results.json"
    assert cli.main(["grade", "ex01", "--json", str(out)]) == 3
    printed = capsys.readouterr().out
    assert printed.startswith(f"the grader could not run (ex01_ring_allreduce not graded): {HOST_DIED}")
    assert f"results not written to {out}" in printed and not out.exists()


def test_ranks_that_never_start_are_the_graders_failure(tmp_path):
    """Inside the grading process: ranks that do not start, twice, before any learner code ran in them."""
    class NoRanks(host.Sandbox):
        def start_batch(self, ex, world_size, file, limit_s):
            raise host.RankDied("the grader's ranks did not start: PermissionError: [Errno 1] Operation not permitted")

    ex = grading.exercises()["ex01"]
    private = tmp_path / "sandbox"
    private.mkdir()
    spec = {"seed": 5, "timeout_scale": 1.0, "load": 1.0}
    result = host.grade_exercise(ex, str(REPO / "solutions" / f"{ex.module}.py"), spec,
                                 NoRanks(spec, str(private), str(tmp_path / "output.txt"), None))
    assert result["grader_error"].startswith("the grader's ranks did not start: PermissionError")
    assert f"for the check {ex.checks[0].name!r}, tried twice" in result["grader_error"]
    assert result["seed"] == 5 and result["checks"] == []


def _workshop(root: Path, seats: int) -> tuple[Workshop, dict[str, Path]]:
    ws = Workshop(root)
    ws.hub_dir.mkdir(parents=True)
    names = plan.seat_names(seats)
    ws.save_settings(Workshop.new_settings("x", names, "codes", None, "instructor"))
    folders = ws.seat_folders(ws.settings())
    ws.save_plan(plan.make_plan(folders, [], cores=2), processes.marker_env("x"))
    for folder in folders.values():
        (folder / "exercises").mkdir(parents=True)
        shutil.copy(REPO / "exercises" / "ex01_ring_allreduce.py", folder / "exercises")
    return ws, folders


def test_the_class_report_asks_the_instructor_to_see_to_broken_grading(tmp_path, monkeypatch, broken_python):
    ws, folders = _workshop(tmp_path / "ws", 3)
    tried = lambda score, failed: {"attempts": 3, "best": score, "score": score, "max_score": 10,  # noqa: E731
                                   "passed": score == 10, "first_passed": None, "last": "2026-01-01T10:00:00+00:00",
                                   "failed": failed}
    averages = [{"check": "averages", "message": "wrong", "hint": "divide by the world size"}]
    for name, exercises in {"seat01": {"ex01_ring_allreduce": tried(10, [])},
                            "seat02": {"ex01_ring_allreduce": tried(10, []), "ex02_data_parallel": tried(0, averages)},
                            "seat03": {"ex01_ring_allreduce": tried(10, []), "ex02_data_parallel": tried(0, averages)}
                            }.items():
        path = folders[name] / ".gpucourse" / "progress.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"format": 1, "exercises": exercises, "quizzes": []}))
    # seat02 checks ex02 again in its notebook, and the grader cannot run.
    monkeypatch.setenv("GPUCOURSE_PROGRESS", str(folders["seat02"] / ".gpucourse" / "progress.json"))
    monkeypatch.chdir(folders["seat02"])
    grading.check("ex02")
    # A machine without GPUs, as NVML says it.
    no_library = type("NVMLError_LibraryNotFound", (Exception,), {})

    def init():
        raise no_library("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=init))
    found = report.class_report(ws)
    seats = {s["name"]: s for s in found["seats"]}
    assert seats["seat02"]["grading_broken"] == {"ex02_data_parallel": HOST_DIED}
    assert seats["seat02"]["stuck"] is None and seats["seat03"]["stuck"]["exercise"] == "ex02_data_parallel"
    assert found["grading_broken"] == [f"grading broken for seat02: ex02_data_parallel: {HOST_DIED}"]
    # What to explain next: seat03's failing check; seat02's says nothing of what its learner understood.
    assert [(f["exercise"], f["seats"]) for f in found["common_failures"]] == [("ex02_data_parallel", ["seat03"])]
    # One denominator for every seat: the whole course.
    assert {s["max_score"] for s in found["seats"]} == {catalog.POINTS * len(report.course_exercises())}
    assert found["gpu"]["note"] == "no GPU visible"
    text = report.format_report(found)
    assert f"grading broken for seat02: ex02_data_parallel: {HOST_DIED}" in " ".join(text.split())
    assert "score (of the whole course)" in text and f"10/{seats['seat01']['max_score']}" in text
    assert "ex02_data_parallel (3 tries; sees where it is taught)" not in text.split("seat03")[0]  # seat02: not stuck
    assert "GPU use: no GPU visible" in text and "NVMLError" not in text
    page = html.unescape(dashboard.render(found, report.course_exercises()))
    assert f"grading broken for seat02: ex02_data_parallel: {HOST_DIED}" in page and "NVMLError" not in page
    assert page.count("(3 tries; sees where it is taught)") == 1  # seat03 alone is stuck


def test_collect_names_what_it_could_not_grade_and_writes_no_grade(tmp_path, capsys, broken_python):
    ws, _ = _workshop(tmp_path / "ws", 2)
    grades, gradescope = tmp_path / "grades.csv", tmp_path / "gradescope"
    stale = gradescope / "seat01" / "results.json"  # from an earlier collect: not to be mistaken for this one's
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    argv = ["workshop", "collect", "ex01", "ex02", "--out", str(grades), "--gradescope", str(gradescope),
            "--dir", str(ws.root)]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err.splitlines()
    assert err[:4] == [f"gpucourse: could not grade {seat} {module}: {HOST_DIED}" for seat in ("seat01", "seat02")
                       for module in ("ex01_ring_allreduce", "ex02_data_parallel")]
    assert "the grader could not run for 2 seats" in err[4]
    rows = list(csv.DictReader(grades.open()))
    assert [(r["learner"], r["ex01"], r["ex02"], r["total"]) for r in rows] == \
        [("seat01", "", "", ""), ("seat02", "", "", "")]
    assert not stale.exists() and not list((tmp_path / "grades-results").iterdir())
