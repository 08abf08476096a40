"""The quiz in a terminal: ``gpucourse quiz`` reads answers with input() and prints the feedback."""

from __future__ import annotations

import sys
import textwrap

from ..course import progress
from .bank import grade, letter, parse_response
from .exam import Exam, format_report, score_exam

WIDTH = 100


def _say(text: str = "", indent: str = "", hang: str = "") -> None:
    """Print ``text`` wrapped; continuation lines get ``hang`` more indentation."""
    for para in text.split("\n"):
        print(textwrap.fill(para, WIDTH, initial_indent=indent, subsequent_indent=indent + hang) if para else "")
    sys.stdout.flush()


def _show(q: dict, number: int, total: int) -> None:
    _say(f"\nQ{number}/{total}  [{q['topic']} · notebook {q['notebook']}]")
    _say(q["question"])
    if q["kind"] == "multiple":
        _say("(select all that apply: letters such as 'a c')")
    for i, choice in enumerate(q.get("choices", [])):
        _say(f"{letter(i)}) {choice}", indent="   ", hang="   ")


def _read_answer(q: dict):
    """The learner's parsed response, asking again until it can be read; None at end of input."""
    prompt = f"answer{' (' + q['unit'] + ')' if q['kind'] == 'numeric' and q.get('unit') else ''}: "
    while True:
        try:
            text = input(prompt)
        except EOFError:
            print()
            return None
        if not sys.stdin.isatty():
            print(text)  # piped answers: show them, so the transcript reads like a session
        try:
            return parse_response(q, text)
        except ValueError as e:
            print(f"  {e}")


def _record(label: str, by_topic: dict, answers: dict) -> None:
    correct = sum(c for c, _ in by_topic.values())
    total = sum(n for _, n in by_topic.values())
    try:
        progress.record_quiz(label, correct, total, by_topic=by_topic, answers=answers)
    except (OSError, ValueError) as e:
        print(f"(not recorded: {e})", file=sys.stderr)
        return
    print(f"recorded in {progress.progress_path()}")


def run_quiz(questions: list[dict], label: str) -> dict:
    """Ask each question, say at once whether it was right and why; record the score under ``label``.

    End of input (Ctrl-D) stops early; the questions answered so far count.
    Returns ``{"correct", "answered", "total"}``.
    """
    by_topic: dict[str, list[int]] = {}
    answers: dict[str, bool] = {}
    correct = answered = 0
    print(f"{len(questions)} question{'s' * (len(questions) != 1)}. Answer with a letter (several for 'select "
          f"all'), or a number; Ctrl-D stops.")
    for n, q in enumerate(questions, 1):
        _show(q, n, len(questions))
        response = _read_answer(q)
        if response is None:
            print("stopped.")
            break
        ok, why = grade(q, response)
        answers[q["id"]] = ok
        answered += 1
        correct += ok
        t = by_topic.setdefault(q["topic"], [0, 0])
        t[0] += ok
        t[1] += 1
        _say(("✓ " if ok else "✗ ") + why, indent="  ")
    if answered:
        print(f"\nscore: {correct}/{answered}" + (f" answered of {len(questions)}" if answered < len(questions)
                                                 else "") + f" ({100 * correct / answered:.0f}%)")
        _record(label, by_topic, answers)
    return {"correct": correct, "answered": answered, "total": len(questions)}


def run_exam(exam: Exam) -> dict:
    """Ask every question of a mock exam without feedback, then print the marked sheet and record it."""
    print(f"mock exam: {len(exam)} questions across all topics, {exam.time_limit_s / 60:g} minutes "
          f"({exam.time_limit_s / len(exam):g} s a question). No feedback until the end; Ctrl-D hands in early.")
    answers = [None] * len(exam)
    for n, q in enumerate(exam, 1):
        _show(q, n, len(exam))
        answers[n - 1] = _read_answer(q)
        if answers[n - 1] is None:
            print("handed in early; unanswered questions count as wrong.")
            break
    result = score_exam(exam, answers)
    print()
    _say(format_report(result))
    missed = {wrong["id"] for wrong in result["wrong"]}
    _record("mock-exam", {t: [s["correct"], s["total"]] for t, s in result["by_topic"].items()},
            {q["id"]: q["id"] not in missed for q in exam})
    return result
