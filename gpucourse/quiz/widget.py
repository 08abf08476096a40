"""The quiz in a notebook: one card per question, checked as you go; a mock exam marked at the end.

ipywidgets is imported only when a quiz is drawn, so the rest of the package
runs on a node without it.
"""

from __future__ import annotations

import html

from ..course import progress
from .bank import ask, grade, letter, parse_response
from .exam import format_report, mock_exam


def _input(q: dict, w):
    """The widget a learner answers ``q`` with, and a function reading its value as a response (None if blank)."""
    layout = w.Layout(width="auto")
    if q["kind"] == "single":
        box = w.RadioButtons(options=[(f"{letter(i)}) {c}", i) for i, c in enumerate(q["choices"])], value=None,
                             layout=layout)
        return box, lambda: box.value
    if q["kind"] == "multiple":
        boxes = [w.Checkbox(value=False, description=f"{letter(i)}) {c}", indent=False, layout=layout)
                 for i, c in enumerate(q["choices"])]
        return w.VBox(boxes), lambda: [i for i, b in enumerate(boxes) if b.value] or None
    box = w.Text(placeholder=f"a number{' in ' + q['unit'] if q.get('unit') else ''} (0.25, 25%, 1/4, 1.5e9)")
    return box, lambda: (parse_response(q, box.value) if box.value.strip() else None)


def _header(q: dict, n: int, total: int) -> str:
    select = " <i>(select all that apply)</i>" if q["kind"] == "multiple" else ""
    return (f"<b>Q{n}/{total}</b> <span style='color:gray'>{q['topic']} · notebook {q['notebook']}</span>"
            f"<br>{html.escape(q['question'])}{select}")


def _frame(q: dict, n: int, total: int, parts: list, w):
    """One question's card: its header, then ``parts``."""
    return w.VBox([w.HTML(_header(q, n, total))] + parts,
                  layout=w.Layout(border="1px solid #ddd", padding="6px", margin="4px 0"))


def _disable(widget) -> None:
    for child in getattr(widget, "children", ()):
        _disable(child)
    if hasattr(widget, "disabled"):
        widget.disabled = True


def _record(label: str, by_topic: dict, answers: dict) -> str:
    correct = sum(c for c, _ in by_topic.values())
    total = sum(n for _, n in by_topic.values())
    try:
        progress.record_quiz(label, correct, total, by_topic=by_topic, answers=answers)
        return ""
    except (OSError, ValueError) as e:
        return f" <i>(not recorded: {html.escape(str(e))})</i>"


def quiz(topic: str | None = None, count: int = 5, seed: int | None = None, notebook: str | None = None):
    """A quiz of ``count`` questions (one ``topic``, one ``notebook``'s, or all): check each one, read why, get a score.

    Each Check marks the question at once and explains the answer; when every
    question is checked the score is shown and recorded in your progress file
    (see ``gpucourse progress``). Each question's choices are shuffled; the
    same ``seed`` draws the same questions with the same choice orders.
    Returns the widget: put the call last in a cell, or pass it to ``display()``.
    """
    import ipywidgets as w

    questions = ask(topic, count, seed, notebook)
    label = topic or notebook or "mixed"
    by_topic: dict[str, list[int]] = {}
    answers: dict[str, bool] = {}
    score = w.HTML()
    cards = []

    def checker(q, answer, read, feedback, button):
        def check(_):
            try:
                response = read()
            except ValueError as e:
                feedback.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
                return
            if response is None:
                feedback.value = "<span style='color:#b00'>Choose or type an answer first.</span>"
                return
            ok, why = grade(q, response)
            answers[q["id"]] = ok
            t = by_topic.setdefault(q["topic"], [0, 0])
            t[0] += ok
            t[1] += 1
            colour, mark = ("#070", "✓") if ok else ("#b00", "✗")
            feedback.value = f"<span style='color:{colour}'><b>{mark}</b></span> {html.escape(why)}"
            _disable(answer)
            button.disabled = True
            done = sum(n for _, n in by_topic.values())
            right = sum(c for c, _ in by_topic.values())
            if done == len(questions):
                score.value = (f"<b>score: {right}/{done} ({100 * right / done:.0f}%)</b>"
                               + _record(label, by_topic, answers))
            else:
                score.value = f"{right}/{done} so far"
        return check

    for n, q in enumerate(questions, 1):
        answer, read = _input(q, w)
        feedback = w.HTML()
        button = w.Button(description="Check", button_style="primary")
        button.on_click(checker(q, answer, read, feedback, button))
        cards.append(_frame(q, n, len(questions), [answer, button, feedback], w))
    return w.VBox(cards + [score])


def exam(count: int = 40, seed: int | None = None):
    """A timed mock exam (see :func:`~gpucourse.quiz.mock_exam`): answer everything, then Hand in.

    No feedback until you hand in; then the score per topic, the time against
    the limit and every wrong answer with its explanation appear, and the
    result is recorded in your progress file. Returns the widget.
    """
    import ipywidgets as w

    sheet = mock_exam(count, seed)
    readers, inputs = [], []
    cards = []
    for n, q in enumerate(sheet, 1):
        answer, read = _input(q, w)
        readers.append(read)
        inputs.append(answer)
        cards.append(_frame(q, n, len(sheet), [answer], w))
    hand_in = w.Button(description="Hand in", button_style="warning")
    report = w.HTML()

    def submit(_):
        answers = []
        for read in readers:
            try:
                answers.append(read())
            except ValueError:
                answers.append(None)  # an unreadable number counts as unanswered
        result = sheet.score(answers)
        for answer in inputs:
            _disable(answer)
        hand_in.disabled = True
        missed = {wrong["id"] for wrong in result["wrong"]}
        report.value = (f"<pre style='white-space:pre-wrap'>{html.escape(format_report(result))}</pre>"
                        + _record("mock-exam", {t: [s["correct"], s["total"]] for t, s in result["by_topic"].items()},
                                  {q["id"]: q["id"] not in missed for q in sheet}))

    hand_in.on_click(submit)
    intro = w.HTML(f"<b>Mock exam</b>: {len(sheet)} questions across all topics, "
                   f"{sheet.time_limit_s / 60:g} minutes from now. Hand in when done.")
    return w.VBox([intro] + cards + [hand_in, report])
