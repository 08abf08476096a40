"""Your progress through the course: exercises passed and quiz scores, kept in one local file.

The file is ``~/.gpucourse/progress.json``, or the path in the environment
variable ``GPUCOURSE_PROGRESS``. The grader calls :func:`record_exercise`
after each exercise, or, when the grader itself could not run,
:func:`record_grader_failure` (kept apart from the tries, for a workshop's
dashboard to show the instructor); the quizzes call :func:`record_quiz`, which also files
each answer for the spaced review (:func:`file_answers`); ``gpucourse
progress`` prints :func:`gpucourse.quiz.review.format_summary`. This module
knows nothing of the question bank: the quiz reads it, not the other way.

Two notebooks may record at the same moment. Each change is therefore a
read-modify-write done while holding an exclusive lock (``fcntl.flock`` on
``progress.json.lock`` next to the file), and the new content replaces the old
in one rename (:func:`gpucourse.files.write_atomic`): no record is lost, and
a crash mid-write leaves the previous file whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from datetime import datetime
from pathlib import Path

from ..files import write_atomic

ENV_VAR = "GPUCOURSE_PROGRESS"
FORMAT = 1
FAILED_TEXT_CHARS = 1000  # of each failed check's message and hint, what the record keeps


class ProgressError(ValueError):
    """The progress file cannot be read; the message says which file and how to start afresh."""


def progress_path() -> Path:
    """Where progress is kept: ``$GPUCOURSE_PROGRESS``, else ``~/.gpucourse/progress.json``."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".gpucourse" / "progress.json").expanduser()


def _empty() -> dict:
    return {"format": FORMAT, "exercises": {}, "quizzes": []}


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _empty()
    try:
        data = json.loads(text)
        if not (isinstance(data, dict) and isinstance(data.get("exercises"), dict)
                and isinstance(data.get("quizzes"), list) and isinstance(data.get("questions", {}), dict)
                and isinstance(data.get("grader_failures", {}), dict)):
            raise ValueError("not a progress record")
    except ValueError as e:
        raise ProgressError(f"the progress file {path} is not valid ({e}); fix it, or start afresh with "
                            f"'gpucourse progress --reset'.") from None
    return data


@contextlib.contextmanager
def _locked():
    """Hold the progress lock; yield the path (the file itself is read and written by the caller)."""
    path = progress_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def _update():
    """Read the record under the lock, let the caller change it, write it back atomically."""
    with _locked() as path:
        data = _read(path)
        yield data
        write_atomic(path, json.dumps(data, indent=1) + "\n")


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _clip(text: str) -> str:
    return text if len(text) <= FAILED_TEXT_CHARS else text[:FAILED_TEXT_CHARS - 1] + "…"


def load(path: str | os.PathLike | None = None) -> dict:
    """The raw record: ``{"format", "exercises": {name: {...}}, "quizzes": [{...}, ...]}``.

    ``path`` reads another learner's file (an instructor's class view) instead of your own.
    """
    return _read(Path(path) if path is not None else progress_path())


def record_exercise(name: str, score: float, max_score: float, failed: list[dict] | None = None) -> dict:
    """Record one graded attempt at exercise ``name``; return its entry.

    The entry keeps the latest score, the best, the number of attempts, and
    when it was first passed (score equal to ``max_score``). ``failed`` lists
    the checks this attempt failed, each ``{"check", "message", "hint"}``; the
    entry keeps those of the latest attempt (what the learner is stuck on now).
    Files written before this was recorded simply have no ``"failed"``. A grader
    failure recorded for ``name`` is cleared: the grader ran.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("an exercise needs a name.")
    if not 0 <= score <= max_score:
        raise ValueError(f"score {score} must be from 0 to max_score {max_score}.")
    with _update() as data:
        e = data["exercises"].setdefault(name, {"attempts": 0, "best": 0, "first_passed": None})
        e.update(score=score, max_score=max_score, last=_now(), attempts=e["attempts"] + 1,
                 best=max(e["best"], score) if e.get("max_score", max_score) == max_score else score)
        e["passed"] = e["best"] >= max_score
        if failed is not None:
            e["failed"] = [{k: _clip(str(f.get(k, ""))) for k in ("check", "message", "hint")} for f in failed]
        if e["passed"] and not e["first_passed"]:
            e["first_passed"] = e["last"]
        data.get("grader_failures", {}).pop(name, None)
        return dict(e)


def record_grader_failure(name: str, why: str) -> dict:
    """Record that the grader could not run for exercise ``name``, and ``why``; return the record ``{"why", "time"}``.

    Not an attempt: the exercise's tries and scores are left as they were, under
    ``"grader_failures"``, apart from them. The next grading of ``name`` that runs
    clears it (:func:`record_exercise`, :func:`clear_grader_failure`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError("an exercise needs a name.")
    with _update() as data:
        entry = {"why": _clip_log(str(why)), "time": _now()}
        data.setdefault("grader_failures", {})[name] = entry
        return dict(entry)


def clear_grader_failure(name: str) -> bool:
    """Forget the grader failure recorded for exercise ``name`` (the grader has run since); True if there was one."""
    with _locked() as path:
        data = _read(path)
        if name not in data.get("grader_failures", {}):
            return False  # nothing to write: an untouched stub graded on every Run All costs no write
        del data["grader_failures"][name]
        write_atomic(path, json.dumps(data, indent=1) + "\n")
        return True


def _clip_log(text: str) -> str:
    """The sentence that says why, and as much of the log's end below it as the record keeps."""
    if len(text) <= FAILED_TEXT_CHARS:
        return text
    sentence, _, log = text.partition("\n")
    room = FAILED_TEXT_CHARS - len(sentence) - 2
    end = log[-room:].partition("\n")[2] if room > 0 else ""  # from the first whole line
    return f"{sentence}\n…\n{end}" if end else _clip(sentence)


def record_quiz(topic: str, correct: int, total: int, by_topic: dict | None = None,
                answers: dict | None = None) -> dict:
    """Record one finished quiz: ``correct`` of ``total``; return its entry.

    ``topic`` is a quiz topic, ``"mixed"``, ``"review"`` or ``"mock-exam"``. A quiz
    across topics passes ``by_topic={topic: [correct, total], ...}`` so that the
    summary can tell which topic needs work. ``answers={question id: right}``
    files each question in its Leitner box under ``"questions"`` (see
    :mod:`gpucourse.quiz.review`); files written before that was recorded
    simply have no ``"questions"``.
    """
    if answers is not None and (len(answers) != total or sum(map(bool, answers.values())) != correct):
        raise ValueError(f"answers for {len(answers)} questions do not add up to {correct} of {total}.")
    if not isinstance(topic, str) or not topic:
        raise ValueError("a quiz needs a topic (a quiz topic, 'mixed' or 'mock-exam').")
    if not (isinstance(total, int) and total >= 1 and isinstance(correct, int) and 0 <= correct <= total):
        raise ValueError(f"correct={correct} of total={total}: total must be at least 1 and correct from 0 to it.")
    parts = {topic: [correct, total]} if by_topic is None else {t: list(ct) for t, ct in by_topic.items()}
    if sum(c for c, _ in parts.values()) != correct or sum(n for _, n in parts.values()) != total:
        raise ValueError(f"by_topic {by_topic} does not add up to {correct} of {total}.")
    entry = {"topic": topic, "correct": correct, "total": total, "time": _now(), "by_topic": parts}
    with _update() as data:
        data["quizzes"].append(entry)
        if answers:
            file_answers(data, answers, session=len(data["quizzes"]))
    return entry


def reset() -> bool:
    """Forget all progress (remove the file); True if there was any."""
    with _locked() as path:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True


def summary(path: str | os.PathLike | None = None) -> dict:
    """Progress in a few numbers (JSON-ready).

    ``{"file", "exercises": {name: {score, max_score, best, attempts, passed,
    first_passed, last}}, "exercises_passed", "exercises_tried", "quizzes":
    {topic label: {attempts, correct, total, score, best, last}}, "topics":
    {quiz topic: {correct, total, score}} over every question answered,
    "questions_answered", "questions_correct", "grader_failures": {name: {why,
    time}}}``: what the file holds, added up
    (``gpucourse progress`` adds mastery per exam topic from the bank:
    :func:`gpucourse.quiz.review.summary`). ``path`` as in :func:`load`.
    """
    data = load(path)
    quizzes, topics = {}, {}
    for q in data["quizzes"]:
        s = quizzes.setdefault(q["topic"], {"attempts": 0, "correct": 0, "total": 0, "best": 0.0})
        s["attempts"] += 1
        s["correct"] += q["correct"]
        s["total"] += q["total"]
        s["best"] = max(s["best"], q["correct"] / q["total"])
        s["last"] = q["correct"] / q["total"]
        for t, (c, n) in q.get("by_topic", {q["topic"]: [q["correct"], q["total"]]}).items():
            tt = topics.setdefault(t, {"correct": 0, "total": 0})
            tt["correct"] += c
            tt["total"] += n
    for s in list(quizzes.values()) + list(topics.values()):
        s["score"] = s["correct"] / s["total"]
    return {"file": str(path if path is not None else progress_path()), "exercises": data["exercises"],
            "exercises_passed": sum(bool(e.get("passed")) for e in data["exercises"].values()),
            "exercises_tried": len(data["exercises"]), "quizzes": quizzes, "topics": topics,
            "questions_answered": sum(t["total"] for t in topics.values()),
            "questions_correct": sum(t["correct"] for t in topics.values()),
            "grader_failures": data.get("grader_failures", {})}


# The spaced review (gpucourse.quiz.review) reads these boxes; the file keeps them.
INTERVALS = (1, 2, 4, 8, 16)  # sessions a question in box 1, 2, 3, 4, 5 waits before it comes back


def file_answers(record: dict, answers: dict, session: int) -> None:
    """File ``answers`` ({question id: right}) of session number ``session`` into ``record["questions"]``."""
    questions = record.setdefault("questions", {})
    for qid, right in answers.items():
        q = questions.setdefault(qid, {"box": 0, "answered": 0, "right": 0})
        q["answered"] += 1
        q["right"] += bool(right)
        q["last_right"] = bool(right)
        q["session"] = session
        if not right:
            q["box"] = 1
        elif q["box"]:
            q["box"] = min(q["box"] + 1, len(INTERVALS))
        if q["box"]:
            q["due"] = session + INTERVALS[q["box"] - 1]
