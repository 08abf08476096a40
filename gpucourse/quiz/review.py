"""What to study next: mastery per exam topic, and the questions you missed, asked again spaced over sessions.

Every finished quiz, review or mock exam is one *session* (the n-th quiz recorded in your progress file is
session n), and each question answered in it is filed in a Leitner box:

- a question you miss goes to box 1 and comes back in the next session;
- each right answer moves a missed question up one box, and boxes 1, 2, 3, 4, 5 wait 1, 2, 4, 8, 16 sessions
  (:data:`gpucourse.course.progress.INTERVALS`) before it comes back;
- a question you have never missed is in no box: it is not reviewed.

``gpucourse quiz --review`` (or :func:`draw`) asks the questions that are due. *Mastery* of a topic is the share
of the bank's questions in that topic whose last answer was right, so an unanswered question counts as not yet
mastered.

This module reads a progress record (:func:`gpucourse.course.progress.load`); the progress module stores it and files
each answer into its box (:func:`gpucourse.course.progress.file_answers`).
"""

from __future__ import annotations

import random

from ..course import progress
from .bank import NOTEBOOKS, TOPICS, load_bank, shuffled
from .exam import EXAM_WEIGHTS


def next_session(record: dict) -> int:
    """The number the next finished quiz will have."""
    return len(record.get("quizzes", [])) + 1


def due(record: dict, topic: str | None = None) -> list[str]:
    """Ids of the bank's questions due for review in the next session (of one ``topic``), in bank order."""
    filed = record.get("questions", {})
    now = next_session(record)
    return [q["id"] for q in load_bank(topic) if filed.get(q["id"], {}).get("box") and filed[q["id"]]["due"] <= now]


def draw(record: dict, topic: str | None = None, count: int | None = None, seed: int | None = None) -> list[dict]:
    """The questions due for review (at most ``count``), the weakest topic's first (:func:`mastery`'s order), each
    topic's in an order drawn from ``seed``, choices shuffled.

    ValueError (one sentence) when nothing has been answered yet. An empty list means nothing is due now.
    """
    if not record.get("questions"):
        raise ValueError("no quiz answers are recorded yet, so there is nothing to review: take a quiz first "
                         "('gpucourse quiz').")
    if count is not None and count < 1:
        raise ValueError(f"count={count} must be at least 1.")
    ids = due(record, topic)
    ids = random.Random(seed).sample(ids, len(ids))
    bank = {q["id"]: q for q in load_bank(topic)}
    order = {t: i for i, t in enumerate(mastery(record)["weakest"])}
    ids = sorted(ids, key=lambda qid: order.get(bank[qid]["topic"], len(order)))[:count]  # stable: seeded within
    return [shuffled(bank[qid], seed) for qid in ids]


def nothing_due(record: dict, topic: str | None = None) -> str:
    """The sentence to show when :func:`draw` finds nothing due."""
    dues = [q["due"] for q in record.get("questions", {}).values() if q.get("box")]
    if not dues:
        return "nothing to review: you have not missed a question yet."
    later = min(dues) - next_session(record)
    where = f" in {topic}" if topic else ""
    return (f"nothing is due for review{where} now; the next missed question comes back after {later} more "
            f"session{'s' * (later != 1)} (a quiz or mock exam you finish)." if later > 0
            else f"nothing is due for review{where} now.")


def mastery(record: dict) -> dict:
    """Per topic and overall: which of the bank's questions you answered, and got right on your last try.

    ``{"topics": {topic: {"mastered", "answered", "total", "score", "weight"}}, "weighted", "weakest": [topics,
    weakest first, below full mastery], "revisit": [{"notebook", "section", "missed"}], "due", "answered"}``;
    ``weight`` is the topic's share of a mock exam (:data:`gpucourse.quiz.exam.EXAM_WEIGHTS`) and ``weighted`` the
    topics' scores weighed so, what a mock exam drawn from the bank would expect you to score; ``revisit`` lists
    where the questions whose last answer was wrong are taught, most missed first (``section`` is None when the
    bank records none).
    """
    filed = record.get("questions", {})
    topics = {t: {"mastered": 0, "answered": 0, "total": 0} for t in TOPICS}
    places: dict[tuple, int] = {}
    for q in load_bank():
        t = topics[q["topic"]]
        t["total"] += 1
        state = filed.get(q["id"])
        if state:
            t["answered"] += 1
            t["mastered"] += state["last_right"]
            if not state["last_right"]:
                place = (q["notebook"], q.get("section"))
                places[place] = places.get(place, 0) + 1
    for name, t in topics.items():
        t["score"] = t["mastered"] / t["total"] if t["total"] else 0.0
        t["weight"] = EXAM_WEIGHTS.get(name, 0.0)
    weights = sum(t["weight"] for t in topics.values())
    weighted = sum(t["weight"] * t["score"] for t in topics.values()) / weights if weights else 0.0
    # Weakest first, a topic the exam weighs more before one it weighs less at the same score.
    weakest = sorted((t for t in TOPICS if topics[t]["score"] < 1),
                     key=lambda t: (topics[t]["score"], -topics[t]["weight"], t))
    revisit = [{"notebook": nb, "section": sec, "missed": n}
               for (nb, sec), n in sorted(places.items(), key=lambda kv: (-kv[1], NOTEBOOKS.index(kv[0][0])))]
    return {"topics": topics, "weighted": weighted, "weakest": weakest, "revisit": revisit, "due": len(due(record)),
            "answered": sum(t["answered"] for t in topics.values())}


def format_mastery(m: dict) -> list[str]:
    """:func:`mastery` as lines for ``gpucourse progress``."""
    if not m["answered"]:
        return []
    width = max(len(t) for t in m["topics"])
    lines = ["mastery by exam topic (questions whose last answer was right, of the bank's):"]
    for topic, t in m["topics"].items():
        lines.append(f"  {topic:<{width}}  {t['mastered']:>3}/{t['total']:<3} {100 * t['score']:5.1f}%  "
                     f"({t['answered']} answered; {100 * t['weight']:.0f}% of a mock exam)")
    lines.append(f"  {'weighed as the exam':<{width}}  {100 * m['weighted']:13.1f}%")
    if m["weakest"]:
        shown = m["weakest"][:2]
        lines.append("weakest: " + ", ".join(f"{t} ({100 * m['topics'][t]['score']:.0f}%)" for t in shown)
                     + f" — 'gpucourse quiz --topic {shown[0]}'")
    if m["revisit"]:
        lines.append("revisit: " + ", ".join(
            f"notebook {r['notebook']}" + (f", {r['section']}" if r["section"] else "") + f" ({r['missed']} missed)"
            for r in m["revisit"]))
    if m["due"]:
        lines.append(f"due for review: {m['due']} question{'s' * (m['due'] > 1)} — 'gpucourse quiz --review'")
    return lines


def summary(path=None) -> dict:
    """:func:`gpucourse.course.progress.summary` of the progress file at ``path`` (default: yours) with ``"mastery"`` per
    exam topic, from the answers recorded per question (:func:`mastery`)."""
    return {**progress.summary(path), "mastery": mastery(progress.load(path))}


def format_summary(s: dict | None = None) -> str:
    """:func:`summary` as a few readable lines."""
    s = summary() if s is None else s
    lines = [f"progress ({s['file']})"]
    if not s["exercises"] and not s["quizzes"]:
        return "\n".join(lines + ["  nothing recorded yet: run 'gpucourse grade' or 'gpucourse quiz'."])
    lines.append(f"exercises: {s['exercises_passed']} of {s['exercises_tried']} tried passed" if s["exercises"]
                 else "exercises: none graded yet ('gpucourse grade')")
    width = max((len(n) for n in s["exercises"]), default=0)
    for name, e in sorted(s["exercises"].items()):
        mark = "passed" if e["passed"] else f"best {e['best']:g}/{e['max_score']:g}"
        lines.append(f"  {name:<{width}}  {e['score']:g}/{e['max_score']:g}  {mark}, "
                     f"{e['attempts']} attempt{'s' * (e['attempts'] != 1)}")
    if s["quizzes"]:
        taken = sum(q["attempts"] for q in s["quizzes"].values())
        lines.append(f"quizzes: {taken} taken, {s['questions_correct']}/{s['questions_answered']} questions right")
        width = max(len(t) for t in list(s["quizzes"]) + list(s["topics"]))
        for label, q in sorted(s["quizzes"].items()):
            lines.append(f"  {label:<{width}}  {q['attempts']:>3}×  last {100 * q['last']:5.1f}%  "
                         f"best {100 * q['best']:5.1f}%")
        lines.append("by topic, over every question answered:")
        for t in [t for t in TOPICS if t in s["topics"]] + sorted(set(s["topics"]) - set(TOPICS)):
            v = s["topics"][t]
            lines.append(f"  {t:<{width}}  {v['correct']:>3}/{v['total']:<3}  {100 * v['score']:5.1f}%")
        weakest = min((t for t in s["topics"] if t in TOPICS), key=lambda t: s["topics"][t]["score"], default=None)
        untried = [t for t in TOPICS if t not in s["topics"]]
        if untried:
            lines.append("not tried yet: " + ", ".join(untried))
        if s.get("mastery", {}).get("answered"):  # answers recorded per question: mastery, weakest, what to revisit
            lines += format_mastery(s["mastery"])
        elif not untried and weakest is not None and s["topics"][weakest]["score"] < 1:
            lines.append(f"weakest: {weakest} — 'gpucourse quiz --topic {weakest}'")
    return "\n".join(lines)
