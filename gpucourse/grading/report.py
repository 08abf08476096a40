"""A graded folder, shown: a table for the terminal, HTML for a notebook, JSON for Gradescope.

An exercise the grader could not run (its result holds ``grader_error``) has no
score to show: the first line says that the grader could not run and why, and
that it is not the learner's code.
"""

from __future__ import annotations

import html
import textwrap


def _not_started(ex: dict) -> bool:
    """Every check found the stub's NotImplementedError (the rule progress uses too). A check whose message only
    mentions a fix not written yet (ex10's shipped file hangs: it raises nothing) shows its own message."""
    from .results import untouched

    return ex["error"] is None and ex["score"] == 0 and untouched(ex)


def _indent(text: str, prefix: str, width: int = 100) -> str:
    lines = []
    for para in text.splitlines() or [""]:
        lines += textwrap.wrap(para, width - len(prefix), break_on_hyphens=False, break_long_words=False) or [""]
    return "\n".join(prefix + line for line in lines)


def warnings(result: dict) -> list[str]:
    """What the grader says of how it graded (learner code run as root, bytes taken from the ranks' own records),
    each once, whatever the exercise."""
    return list(dict.fromkeys(line for ex in result["exercises"] if ex.get("warning")
                              for line in ex["warning"].splitlines()))


def grader_failures(result: dict) -> list[tuple[str, str]]:
    """``(module, why)`` for each exercise the grader could not run (no grade: the grader's failure, not the
    learner's); ``why`` is the sentence alone, without the grader's log below it."""
    return [(ex["module"], first_line(ex["grader_error"])) for ex in result["exercises"] if ex.get("grader_error")]


def first_line(text: str) -> str:
    """The sentence that says why, without the log lines below it."""
    return (text.strip().splitlines() or [""])[0]


def _grader_lines(result: dict) -> list[tuple[str, str]]:
    """What the report's first lines say when the grader could not run: (exercises not graded, why), once per why."""
    by_why: dict[str, list[str]] = {}
    for module, why in grader_failures(result):
        by_why.setdefault(why, []).append(module)
    return [(", ".join(modules), why) for why, modules in by_why.items()]


# A hint ladder, as tutoring systems give one: a failed check first shows what was seen and the idea the exercise
# tests; from the learner's second try at the exercise, also where the notebook teaches it; from the fourth, the
# fix (each check's hint). The try from which each rung shows:
LADDER = {"section": 2, "fix": 4}


def rungs(ex: dict, tries: dict | None) -> tuple[bool, bool]:
    """(show where it is taught, show the fix) for exercise result ``ex`` at ``tries`` (module -> this grading's
    try, 1 for the first); None is the instructor's view: everything."""
    if tries is None:
        return True, True
    n = tries.get(ex["module"], 1)
    return n >= LADDER["section"], n >= LADDER["fix"]


def ladder_lines(ex: dict, tries: dict | None) -> tuple[list[str], bool]:
    """What an exercise with a failed check says under its checks, by rung, and whether each check's fix shows."""
    section, fix = rungs(ex, tries)
    lines = [f"the idea: {ex['concept']}"] if ex.get("concept") else []
    if section and ex.get("section"):
        lines.append(f"where it is taught: {ex['section']} of {ex['notebook']}")
    if tries is not None and not fix:
        later = ([f"where it is taught from try {LADDER['section']}"] if not section else []) + \
            [f"each check's fix from try {LADDER['fix']}"]
        lines.append(f"(this was try {tries.get(ex['module'], 1)}; {' and '.join(later)})")
    return lines, fix


def text_report(result: dict, show_passed: bool = False, tries: dict | None = None) -> str:
    """The terminal table: one line per exercise, and under it each failing check and what was seen, with the hint
    ladder's rungs for ``tries`` (module -> this grading's try at it; None: every rung, the instructor's view)."""
    rows = [f"the grader could not run ({modules} not graded): {why} — not your code; tell the instructor"
            for modules, why in _grader_lines(result)] + [f"warning: {w}" for w in warnings(result)] + \
        [f"graded {result['folder']}  (seed {result['seed']})", ""]
    width = max([len(e["module"]) for e in result["exercises"]] + [8])
    for ex in result["exercises"]:
        if ex.get("grader_error"):
            rows.append(f"{ex['module']:<{width}}  not graded: the grader could not run (not your code)")
            rows.append(_indent(ex["grader_error"], "    "))
            continue
        rows.append(f"{ex['module']:<{width}}  {ex['score']:>3}/{ex['max_score']:<3} {ex['title']}")
        if ex["error"]:
            rows.append(_indent(ex["error"], "    "))
            continue
        if _not_started(ex):
            rows.append(f"    not written yet: every function still raises NotImplementedError "
                        f"({ex['notebook']} teaches it)")
            continue
        ladder, fix = ladder_lines(ex, tries)
        for c in ex["checks"]:
            if c["status"] == "passed":
                if show_passed:
                    rows.append(f"  ok   {c['name']} ({c['points']}/{c['max_points']})")
                continue
            rows.append(f"  FAIL {c['name']} (0/{c['max_points']})")
            rows.append(_indent(c["message"], "         "))
            if fix:
                rows.append(_indent("hint: " + c["hint"], "         "))
        if ex["score"] < ex["max_score"]:
            rows += [_indent(line, "    ") for line in ladder]
    failures = grader_failures(result)
    graded = len(result["exercises"]) - len(failures)
    rows += ["", f"{'total':<{width}}  " + ("not graded" if failures and not graded else
                                            f"{result['score']:>3}/{result['max_score']}"
                                            + (" (of the exercises graded)" if failures else ""))]
    if result["score"] < result["max_score"]:
        rows.append(f"(the same inputs again: --seed {result['seed']})")
    return "\n".join(rows)


def html_report(result: dict, tries: dict | None = None) -> str:
    """The notebook summary: per exercise, each check passed or failed, what was seen, the hint ladder's rungs for
    ``tries`` (as :func:`text_report`), the score."""
    esc = html.escape
    parts = ['<div class="gpucourse-grade" style="font-family: sans-serif; line-height: 1.4">']
    parts += [f'<div style="color: #b31d28"><b>the grader could not run</b> ({esc(modules)} not graded): '
              f'{esc(why)} — <b>not your code; tell the instructor</b></div>'
              for modules, why in _grader_lines(result)]
    parts += [f'<div style="color: #b31d28"><b>warning:</b> {esc(w)}</div>' for w in warnings(result)]
    for ex in result["exercises"]:
        if ex.get("grader_error"):
            parts.append(f'<h4 style="margin: 0.6em 0 0.3em">{esc(ex["module"])} — not graded: the grader could '
                         f'not run (not your code)</h4>'
                         f'<pre style="white-space: pre-wrap; color: #555">{esc(ex["grader_error"])}</pre>')
            continue
        full = ex["score"] == ex["max_score"]
        parts.append(f'<h4 style="margin: 0.6em 0 0.3em">{esc(ex["module"])}: {esc(ex["title"])} — '
                     f'<span style="color: {"#1a7f37" if full else "#b35900"}">{ex["score"]} / '
                     f'{ex["max_score"]}</span></h4>')
        if ex["error"]:
            parts.append(f'<pre style="white-space: pre-wrap; color: #b31d28">{esc(ex["error"])}</pre>')
            continue
        parts.append('<table style="border-collapse: collapse">')
        ladder, fix = ladder_lines(ex, tries)
        for c in ex["checks"]:
            ok = c["status"] == "passed"
            detail = "" if ok else (f'<div>{esc(c["message"])}</div>' + (
                f'<div style="color: #555"><b>hint:</b> {esc(c["hint"])}</div>' if fix else ""))
            parts.append(
                f'<tr style="vertical-align: top; border-top: 1px solid #ddd">'
                f'<td style="padding: 2px 8px; color: {"#1a7f37" if ok else "#b31d28"}">{"✔" if ok else "✘"}</td>'
                f'<td style="padding: 2px 8px; text-align: left"><b>{esc(c["name"])}</b>{detail}</td>'
                f'<td style="padding: 2px 8px; white-space: nowrap">{c["points"]} / {c["max_points"]}</td></tr>')
        parts.append("</table>")
        if not full:
            parts += [f'<div style="color: #555">{esc(line)}</div>' for line in ladder]
            parts.append(f'<div style="color: #555; font-size: 90%">taught in {esc(ex["notebook"])}; '
                         f'seed {ex["seed"]}</div>')
    parts.append("</div>")
    return "".join(parts)


def gradescope(result: dict) -> dict:
    """The result in Gradescope's autograder format (results.json)."""
    tests = []
    for i, ex in enumerate(result["exercises"], 1):
        for j, c in enumerate(ex["checks"], 1):
            ok = c["status"] == "passed"
            out = "" if ok else f"{ex['error'] or c['message']}\nHint: {c['hint']}\n(seed {ex['seed']})"
            tests.append({"name": f"{ex['module']}: {c['name']}", "number": f"{i}.{j}", "score": c["points"],
                          "max_score": c["max_points"], "status": "passed" if ok else "failed", "output": out,
                          "visibility": "visible"})
    return {"score": result["score"], "max_score": result["max_score"], "execution_time": result["time_s"],
            "output": f"graded with seed {result['seed']}", "visibility": "visible",
            "stdout_visibility": "hidden", "tests": tests}
