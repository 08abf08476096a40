"""Progress is one local file: records add up, two processes writing at once lose nothing, a broken file is
refused with a sentence (never overwritten), and `gpucourse progress` prints and resets it."""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter

import pytest

from gpucourse import cli, quiz
from gpucourse.course import progress
from gpucourse.quiz import bank as quiz_bank
from gpucourse.quiz.exam import EXAM_WEIGHTS
from gpucourse.quiz import review

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
    text = review.format_summary(s)
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


# --- mastery per exam topic and the spaced review -------------------------------------------------------------

def quiz_record(progress_file, quizzes: int, questions: dict) -> None:
    """A synthetic progress file: ``quizzes`` finished sessions and the per-question boxes ``questions``."""
    progress_file.parent.mkdir(parents=True, exist_ok=True)
    entry = {"topic": "mixed", "correct": 0, "total": 1, "time": "2025-01-01T00:00:00+00:00",
             "by_topic": {"parallelism": [0, 1]}}
    progress_file.write_text(json.dumps({"format": progress.FORMAT, "exercises": {}, "quizzes": [entry] * quizzes,
                                         "questions": questions}))


def filed(box: int, last_right: bool, due: int | None = None) -> dict:
    return {"box": box, "answered": 1, "right": int(last_right), "last_right": last_right, "session": 1,
            **({"due": due} if box else {})}


def test_mastery_per_topic_from_a_progress_file(progress_file, capsys):
    bank = quiz.load_bank()
    size = Counter(q["topic"] for q in bank)
    quiz_record(progress_file, 3, {
        "setup-allreduce-semantics": filed(0, True), "setup-ring-phases": filed(2, True, 5),
        "setup-ring-allreduce-bytes": filed(1, False, 4),
        "par-dp-average": filed(1, False, 4), "par-dp-buckets": filed(1, False, 2),
        "mem-bytes-mixed": filed(0, True),
        "retired-question": filed(1, False, 1),  # no longer in the bank: ignored
    })
    m = review.summary()["mastery"]
    assert m["topics"]["distributed-setups"] == {"mastered": 2, "answered": 3, "total": size["distributed-setups"],
                                                 "score": 2 / size["distributed-setups"], "weight": 0.25}
    assert m["topics"]["parallelism"]["mastered"] == 0 and m["topics"]["parallelism"]["answered"] == 2
    assert m["topics"]["profiling-troubleshooting"] == {"mastered": 0, "answered": 0,
                                                        "total": size["profiling-troubleshooting"], "score": 0.0,
                                                        "weight": 0.25}
    # Weighed as the mock exam weighs its topics (a quarter each): what a drawn exam would expect.
    assert m["weighted"] == pytest.approx(sum(EXAM_WEIGHTS[t] * m["topics"][t]["score"] for t in EXAM_WEIGHTS))
    assert m["weighted"] == pytest.approx((2 / size["distributed-setups"] + 1 / size["memory-batch"]) / 4)
    assert m["weakest"][:2] == ["parallelism", "profiling-troubleshooting"] and m["answered"] == 6
    assert m["revisit"] == [{"notebook": "02_data_parallelism", "section": None, "missed": 2},
                            {"notebook": "01_collectives", "section": None, "missed": 1}]
    assert m["due"] == 3  # due at session 4 or before: the next is session 4
    text = review.format_summary()
    assert "mastery by exam topic" in text and "weakest: parallelism (0%), profiling-troubleshooting (0%)" in text
    assert "weighed as the exam" in text and f"{100 * m['weighted']:.1f}%" in text and "25% of a mock exam" in text
    assert "revisit: notebook 02_data_parallelism (2 missed), notebook 01_collectives (1 missed)" in text
    assert "due for review: 3 questions" in text
    assert cli.main(["progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mastery"]["topics"]["memory-batch"]["mastered"] == 1


def test_a_file_without_per_question_answers_is_still_read(progress_file):
    progress_file.parent.mkdir(parents=True)
    progress_file.write_text(json.dumps({"format": 1, "exercises": {}, "quizzes": [
        {"topic": "parallelism", "correct": 1, "total": 2, "time": "t", "by_topic": {"parallelism": [1, 2]}}]}))
    s = review.summary()
    assert s["mastery"]["answered"] == 0 and s["topics"]["parallelism"]["score"] == 0.5
    assert "mastery" not in review.format_summary(s) and "not tried yet" in review.format_summary(s)
    progress.record_quiz("memory-batch", 1, 1, answers={"mem-bytes-mixed": True})  # the old file grows the record
    assert progress.load()["questions"]["mem-bytes-mixed"]["box"] == 0 and len(progress.load()["quizzes"]) == 2


def test_leitner_boxes_over_sessions(progress_file):
    """Missed: box 1, back next session; each right answer: one box up, waiting 1, 2, 4, 8, 16 sessions."""
    qid = "par-dp-average"
    progress.record_quiz("parallelism", 0, 1, answers={qid: False})                        # session 1
    assert progress.load()["questions"][qid] == {"box": 1, "answered": 1, "right": 0, "last_right": False,
                                                 "session": 1, "due": 2}
    assert review.due(progress.load()) == [qid]
    expected = {2: (2, 4), 3: (3, 7), 4: (4, 12), 5: (5, 21), 6: (5, 22)}                  # session: (box, due)
    for session, (box, due) in expected.items():
        progress.record_quiz("review", 1, 1, answers={qid: True})
        q = progress.load()["questions"][qid]
        assert (q["box"], q["due"], q["session"]) == (box, due, session)
    assert review.due(progress.load()) == []
    progress.record_quiz("review", 0, 1, answers={qid: False})                             # session 7
    assert (progress.load()["questions"][qid]["box"], progress.load()["questions"][qid]["due"]) == (1, 8)
    progress.record_quiz("mixed", 1, 1, answers={"par-dp-buckets": True})                  # never missed: no box
    assert progress.load()["questions"]["par-dp-buckets"]["box"] == 0
    assert progress.INTERVALS == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="add up"):
        progress.record_quiz("mixed", 1, 2, answers={qid: True})


def test_review_draws_only_due_questions_in_a_seeded_order(progress_file):
    due_now = ["setup-ring-phases", "par-dp-average", "par-dp-buckets", "mem-bytes-mixed", "prof-mfu"]
    quiz_record(progress_file, 4, {
        **{qid: filed(1, False, 5) for qid in due_now[:3]}, "mem-bytes-mixed": filed(2, True, 3),
        "prof-mfu": filed(3, True, 5),
        "par-bucket-order": filed(2, True, 6),   # due after the next session
        "par-zero1": filed(0, True),             # never missed
    })
    record = progress.load()
    drawn = [q["id"] for q in review.draw(record, seed=11)]
    assert sorted(drawn) == sorted(due_now)
    assert drawn == [q["id"] for q in review.draw(record, seed=11)]
    assert any([q["id"] for q in review.draw(record, seed=s)] != drawn for s in range(12, 20))
    assert review.draw(record, seed=11, count=2) == review.draw(record, seed=11)[:2]
    assert [q["id"] for q in review.draw(record, "parallelism", seed=1)] in (["par-dp-average", "par-dp-buckets"],
                                                                           ["par-dp-buckets", "par-dp-average"])
    q = review.draw(record, seed=11)[0]
    assert q == quiz_bank.shuffled(next(b for b in quiz.load_bank() if b["id"] == q["id"]), 11)
    # The weakest topic's due questions come first (distributed-setups: none of its questions mastered), whatever
    # the seed.
    weakest = review.mastery(record)["weakest"]
    for s in range(11, 16):
        topics = [q["topic"] for q in review.draw(record, seed=s)]
        assert topics == sorted(topics, key=weakest.index) and topics[0] == weakest[0] == "distributed-setups"
    assert review.draw(record, seed=3, count=1)[0]["id"] == "setup-ring-phases"


def test_quiz_review_from_the_command_line(progress_file, capsys, monkeypatch):
    assert cli.main(["quiz", "--review"]) == 2                          # nothing recorded yet: one sentence
    [line] = capsys.readouterr().err.splitlines()
    assert "no quiz answers are recorded yet" in line and "'gpucourse quiz'" in line
    assert cli.main(["quiz", "--review", "--exam"]) == 2
    assert "leave out --exam" in capsys.readouterr().err
    quiz_record(progress_file, 1, {"par-zero1": filed(0, True), "par-dp-buckets": filed(2, True, 4)})
    assert cli.main(["quiz", "--review"]) == 0                          # missed, but not due yet
    assert "comes back after 2 more sessions" in capsys.readouterr().out
    quiz_record(progress_file, 1, {"par-dp-buckets": filed(1, False, 2)})
    right = review.draw(progress.load(), seed=0)[0]
    monkeypatch.setattr("builtins.input", lambda prompt="": "abcd"[right["answer"]])
    assert cli.main(["quiz", "--review", "--seed", "0"]) == 0
    assert "score: 1/1" in capsys.readouterr().out
    entry = progress.load()
    assert entry["quizzes"][-1]["topic"] == "review" and entry["questions"]["par-dp-buckets"]["box"] == 2
    assert cli.main(["quiz", "--review"]) == 0 and "nothing is due" in capsys.readouterr().out
