"""A grader that cannot run is never the learner's failure: ``check`` says so in its first line and shows no score,
the progress file records no try (the grader's failure apart, for the dashboard), and ``collect`` and ``grade``
write no grade and exit 3.

The grader is made unable to run for real, in two ways an instructor's machine can break it, each costing a few
milliseconds: ``PYTHONHOME`` pointing nowhere (the grading process, a fresh interpreter that inherits the
environment, dies before it can import anything: "Fatal Python error ... No module named 'encodings'"), and a
temporary folder that cannot hold the grader's working folder (``tempfile.tempdir`` under ``/dev/null``, which
even root cannot write into), so that grading fails before its process starts.
"""

from __future__ import annotations

import csv
import shutil
import tempfile
from pathlib import Path

import pytest

from gpucourse import cli, grading, progress
from gpucourse.grading import catalog, host, runner
from gpucourse.workshop import plan, processes
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
