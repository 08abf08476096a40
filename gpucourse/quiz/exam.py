"""A timed mock exam across the four topics, and its score sheet.

``mock_exam(40)`` draws 40 single- and multiple-choice questions (typed-number
questions stay practice: the exam has none), each topic by its weight in
:data:`EXAM_WEIGHTS`, at a pace of :data:`SECONDS_PER_QUESTION` (60 minutes
for 40). ``score_exam(exam, answers)`` marks the sheet: the score, the score per
topic, every wrong answer with its explanation and the notebook to revisit, and
whether it was finished within the time limit.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from datetime import datetime

from .bank import TOPICS, format_answer, format_response, is_correct, load_bank, shuffled

SECONDS_PER_QUESTION = 90

# The share of each topic in a mock exam. Source: NVIDIA's page for the NVIDIA-Certified Professional: Generative
# AI LLMs exam (NCP-GENL), nvidia.com/en-us/learn/certification/generative-ai-llm-professional, read in December
# 2026 through the study guides that quote it: "GPU Acceleration and Optimization" is 14% of the exam, and its four
# parts (these topics) have no weights of their own, so each gets an equal quarter. NVIDIA may change its weights;
# README.md says so where it states them.
EXAM_WEIGHTS = {"distributed-setups": 0.25, "parallelism": 0.25, "memory-batch": 0.25,
                "profiling-troubleshooting": 0.25}
EXAM_KINDS = ("single", "multiple")


@dataclass
class Exam:
    """The questions of one mock exam, when it started and how long it may take."""

    questions: list[dict]
    time_limit_s: float
    seed: int | None = None
    started: float = field(default_factory=time.time)

    def __len__(self) -> int:
        return len(self.questions)

    def __iter__(self):
        return iter(self.questions)

    def __getitem__(self, i):
        return self.questions[i]

    def score(self, answers, finished: float | None = None) -> dict:
        """Mark ``answers`` now (or at ``finished``): see :func:`score_exam`."""
        return score_exam(self, answers, finished=finished)


def quotas(count: int, sizes: dict[str, float]) -> dict[str, int]:
    """Split ``count`` questions between topics in proportion to ``sizes`` (largest remainders)."""
    total = sum(sizes.values())
    exact = {t: count * n / total for t, n in sizes.items()}
    out = {t: int(x) for t, x in exact.items()}
    for t in sorted(exact, key=lambda t: (out[t] - exact[t], t))[:count - sum(out.values())]:
        out[t] += 1
    return out


def _exam_pool() -> dict[str, list[dict]]:
    """The questions a mock exam may draw, by topic: single and multiple choice only."""
    return {t: [q for q in load_bank(t) if q["kind"] in EXAM_KINDS] for t in EXAM_WEIGHTS}


def most_questions() -> int:
    """The longest mock exam the bank can fill at :data:`EXAM_WEIGHTS`: every shorter one can be drawn too."""
    available = {t: len(qs) for t, qs in _exam_pool().items()}
    count = 0
    while count < sum(available.values()) and all(
            n <= available[t] for t, n in quotas(count + 1, EXAM_WEIGHTS).items()):
        count += 1
    return count


def mock_exam(count: int = 40, seed: int | None = None) -> Exam:
    """A mock exam of ``count`` single- and multiple-choice questions, topics by :data:`EXAM_WEIGHTS`, shuffled.

    Each question's choices are shuffled too (see :func:`~gpucourse.quiz.bank.shuffled`).
    The time limit is :data:`SECONDS_PER_QUESTION` per question (60 minutes for
    40); the clock starts now. The same ``seed`` draws the same exam, choice
    orders included. More than :func:`most_questions` is refused (ValueError, one sentence).
    """
    limit = most_questions()
    if not 1 <= count <= limit:
        raise ValueError(f"a mock exam holds from 1 to {limit} questions (the bank's single- and multiple-choice "
                          f"questions at the exam's topic weights), not {count}.")
    rng = random.Random(seed)
    pool = _exam_pool()
    questions = []
    for t, n in quotas(count, EXAM_WEIGHTS).items():
        questions += rng.sample(pool[t], n)
    rng.shuffle(questions)
    return Exam([shuffled(q, seed) for q in questions], time_limit_s=count * SECONDS_PER_QUESTION, seed=seed)


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m and s else f"{m} min" if m else f"{s} s"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def score_exam(questions, answers, *, started: float | None = None, finished: float | None = None,
               time_limit_s: float | None = None) -> dict:
    """Mark an answer sheet.

    ``questions``: an :class:`Exam` (its start and time limit are used) or a
    list of questions. ``answers``: one response per question in the same order
    (``None`` for unanswered), or a dict ``{question id: response}``. Responses
    are what :func:`~gpucourse.quiz.grade` takes.

    Returns ``{"correct", "total", "score" (0-1), "percent", "by_topic":
    {topic: {"correct", "total", "score"}}, "wrong": [{"id", "topic",
    "notebook", "question", "your_answer", "answer", "explanation"}],
    "revisit": [notebooks], "timing": {...} or None}``. Timing, when the start
    is known: ``started`` and ``finished`` (ISO 8601), ``elapsed_s``,
    ``time_limit_s``, ``over_time`` and a sentence, ``verdict``.
    """
    if isinstance(questions, Exam):
        started = questions.started if started is None else started
        time_limit_s = questions.time_limit_s if time_limit_s is None else time_limit_s
        questions = questions.questions
    if isinstance(answers, dict):
        unknown = set(answers) - {q["id"] for q in questions}
        if unknown:
            raise ValueError(f"answers for questions not in this exam: {', '.join(sorted(unknown))}.")
        answers = [answers.get(q["id"]) for q in questions]
    answers = list(answers)
    if len(answers) != len(questions):
        raise ValueError(f"{len(answers)} answers for {len(questions)} questions; give None for a skipped one.")
    by_topic = {}
    wrong = []
    for q, a in zip(questions, answers):
        ok = is_correct(q, a)
        t = by_topic.setdefault(q["topic"], {"correct": 0, "total": 0})
        t["total"] += 1
        t["correct"] += ok
        if not ok:
            wrong.append({"id": q["id"], "topic": q["topic"], "notebook": q["notebook"], "question": q["question"],
                          "your_answer": format_response(q, a), "answer": format_answer(q),
                          "explanation": q["explanation"]})
    for t in by_topic.values():
        t["score"] = t["correct"] / t["total"]
    correct = len(questions) - len(wrong)
    timing = None
    if started is not None:
        finished = time.time() if finished is None else finished
        elapsed = finished - started
        timing = {"started": _iso(started), "finished": _iso(finished), "elapsed_s": elapsed,
                  "time_limit_s": time_limit_s, "over_time": None, "verdict": f"took {_minutes(elapsed)}"}
        if time_limit_s is not None:
            over = elapsed > time_limit_s
            timing["over_time"] = over
            timing["verdict"] = (f"took {_minutes(elapsed)}: {'over' if over else 'under'} the "
                                 f"{_minutes(time_limit_s)} limit"
                                 + (f" by {_minutes(elapsed - time_limit_s)}" if over else ""))
    total = len(questions)
    return {"correct": correct, "total": total, "score": correct / total if total else 0.0,
            "percent": round(100 * correct / total, 1) if total else 0.0,
            "by_topic": {t: by_topic[t] for t in TOPICS if t in by_topic}, "wrong": wrong,
            "revisit": sorted({w["notebook"] for w in wrong}), "timing": timing}


def format_report(result: dict) -> str:
    """The score sheet as text: total, per topic, time, then each wrong answer with its explanation."""
    lines = [f"score: {result['correct']}/{result['total']} ({result['percent']:g}%)"]
    width = max((len(t) for t in result["by_topic"]), default=0)
    for t, s in result["by_topic"].items():
        lines.append(f"  {t:<{width}}  {s['correct']:>2}/{s['total']:<2} {100 * s['score']:5.1f}%")
    if result["timing"]:
        lines.append(f"time: {result['timing']['verdict']}")
    if result["wrong"]:
        lines.append("")
        lines.append(f"to review ({len(result['wrong'])}):")
        for w in result["wrong"]:
            lines += [f"- [{w['topic']} · notebook {w['notebook']}] {w['question']}",
                      f"  you: {w['your_answer']}   answer: {w['answer']}",
                      f"  why: {w['explanation']}"]
        lines.append("revisit: " + ", ".join(result["revisit"]))
    return "\n".join(lines)
