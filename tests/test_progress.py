"""Progress is one local file: records add up, two processes writing at once lose nothing, a broken file is
refused with a sentence (never overwritten), and `gpucourse progress` prints and resets it."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from gpucourse import cli, progress

WRITES = 50


@pytest.fixture
def progress_file(tmp_path, monkeypatch):
    path = tmp_path / "deeper" / "progress.json"  # the folder is created on the first write
    monkeypatch.setenv(progress.ENV_VAR, str(path))
    return path


def test_default_path_is_in_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(progress.ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert progress.progress_path() == tmp_path / ".gpucourse" / "progress.json"


def test_records_add_up(progress_file):
    assert progress.summary()["exercises_tried"] == 0
    progress.record_exercise("ex01_ring_allreduce", 6, 10)
    progress.record_exercise("ex01_ring_allreduce", 10, 10)
    last = progress.record_exercise("ex01_ring_allreduce", 8, 10)
    assert (last["score"], last["best"], last["attempts"], last["passed"]) == (8, 10, 3, True)
    progress.record_exercise("ex02_data_parallel", 3, 10)
    progress.record_quiz("parallelism", 4, 5)
    progress.record_quiz("mixed", 3, 5, by_topic={"parallelism": [1, 2], "memory-batch": [2, 3]})
    progress.record_quiz("parallelism", 2, 5)
    s = progress.summary()
    assert (s["exercises_passed"], s["exercises_tried"]) == (1, 2)
    assert s["quizzes"]["parallelism"] == {"attempts": 2, "correct": 6, "total": 10, "best": 0.8, "last": 0.4,
                                           "score": 0.6}
    assert s["topics"]["parallelism"] == {"correct": 7, "total": 12, "score": 7 / 12}
    assert s["topics"]["memory-batch"]["correct"] == 2
    assert (s["questions_correct"], s["questions_answered"]) == (9, 15)
    text = progress.format_summary(s)
    assert "1 of 2 tried passed" in text and "ex02_data_parallel" in text and "not tried yet" in text
    assert json.loads(progress_file.read_text())["format"] == progress.FORMAT


def test_bad_records_are_refused(progress_file):
    for args in [("parallelism", 6, 5), ("parallelism", 1, 0), ("", 1, 1)]:
        with pytest.raises(ValueError):
            progress.record_quiz(*args)
    with pytest.raises(ValueError, match="add up"):
        progress.record_quiz("mixed", 2, 3, by_topic={"parallelism": [1, 3]})
    with pytest.raises(ValueError):
        progress.record_exercise("ex01", 11, 10)
    assert not progress_file.exists()


def _writer(worker: int, path: str) -> None:
    import os

    os.environ[progress.ENV_VAR] = path
    for i in range(WRITES):
        if i % 2:
            progress.record_quiz(f"worker-{worker}", i % 3, 3)
        else:
            progress.record_exercise("shared", i % 5, 4 + 1)


def test_two_processes_writing_at_once_lose_nothing(progress_file):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(w, str(progress_file))) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    data = progress.load()
    assert data["exercises"]["shared"]["attempts"] == 2 * (WRITES // 2)
    per_worker = {w: sum(q["topic"] == f"worker-{w}" for q in data["quizzes"]) for w in range(2)}
    assert per_worker == {0: WRITES // 2, 1: WRITES // 2}
    assert sorted(p.name for p in progress_file.parent.iterdir()) == ["progress.json", "progress.json.lock"]


def test_a_broken_file_is_refused_not_overwritten(progress_file, capsys):
    progress_file.parent.mkdir()
    progress_file.write_text("{not json")
    with pytest.raises(progress.ProgressError, match="--reset"):
        progress.record_quiz("parallelism", 1, 1)
    assert progress_file.read_text() == "{not json"
    assert cli.main(["progress"]) == 2
    assert "is not valid" in capsys.readouterr().err
    assert cli.main(["progress", "--reset"]) == 0
    assert not progress_file.exists()


def test_cli_prints_json_and_resets(progress_file, capsys):
    assert cli.main(["progress"]) == 0
    assert "nothing recorded yet" in capsys.readouterr().out
    progress.record_quiz("memory-batch", 3, 4)
    assert cli.main(["progress", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["quizzes"]["memory-batch"]["correct"] == 3 and s["file"] == str(progress_file)
    assert cli.main(["progress", "--reset"]) == 0
    assert "removed" in capsys.readouterr().out
    assert progress.summary()["quizzes"] == {}
