"""A result in words: the dict an exercise's grading makes, and one sentence for whatever the learner's code raised.

An exercise's result is a plain dict (it travels as JSON)::

    {"exercise": "ex01", "module": "ex01_ring_allreduce", "title": ..., "notebook": ...,
     "concept": "the idea the checks test", "section": "where the notebook teaches it",
     "score": 7, "max_score": 10, "error": None | "why the whole exercise scored 0",
     "seed": 1234, "time_s": 4.2, "output": "what its code printed (head and tail)",
     "checks": [{"name", "points", "max_points", "status": "passed" | "failed",
                 "message": "what was seen", "hint": "what to think about", "world_size"}]}

and, when a rank had to import a slow module its exercise does not name (``Exercise.rank_imports``),
``"late_imports": ["torch._dynamo"]``; and where the grader is root but learner code could not run as an
unprivileged user, or the kernel's byte counters could not be read, ``"warning": "learner code ran as root, ...:
why"`` (one line each, the report's first lines); and where
the grader itself could not run, ``"grader_error": "why, in one sentence\nthe end of the grader's log"``
(:func:`grader_failed`): no grade at all, the grader's failure and not the learner's (the report's first line
says so).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from . import catalog

if TYPE_CHECKING:  # no torch for a kernel that only shows a result
    from . import core

OUTPUT_KEEP_BYTES = 8 * 1024  # of what an exercise printed, the head and tail we keep


def static_result(ex: core.Exercise, problem: str, seed: int, time_s: float) -> dict:
    """Every check failed for one reason found before running anything (missing, unparsable, reference code)."""
    checks = [{"name": c.name, "max_points": c.points, "points": 0, "status": "failed", "message": problem,
               "hint": c.hint, "world_size": c.world_size} for c in ex.checks]
    return {"exercise": ex.id, "module": ex.module, "title": ex.title, "notebook": ex.notebook, "score": 0,
            "max_score": ex.max_score, "error": problem, "checks": checks, "seed": seed,
            "time_s": round(time_s, 3), "output": "", "concept": ex.concept, "section": ex.section}


def grader_failed(exercises: list[str], why: str, seed: int = 0) -> list[dict]:
    """One result per exercise of ``exercises`` (ids like "ex03", or module names) saying that the grader could not
    run, and ``why``: one sentence, then, on the lines below it, whatever helps whoever runs the grader (the end of
    its log).

    Such a result is not a grade: the grader failed, not the learner. It has the keys of any exercise's result
    (above), with ``"grader_error": why`` (and ``"error"`` the same), a score of 0 out of the exercise's points, and
    no check listed, as none ran. The reports then say that the grader could not run instead of showing a score,
    :func:`gpucourse.grading.runner.record_progress` records no try, and class grading writes no grade for it.
    Neither torch nor the checks are imported, so it works where the grader's own code is what is broken; it
    raises only a KeyError for an exercise that does not exist.
    """
    out = []
    for key in exercises:
        ex_id, module = catalog.resolve(key)
        out.append({"exercise": ex_id, "module": module, "title": module, "notebook": "", "score": 0,
                    "max_score": catalog.POINTS, "error": why, "grader_error": why, "checks": [], "seed": int(seed),
                    "time_s": 0.0, "output": ""})
    return out


def untouched(exercise_result: dict) -> bool:
    """Whether every check of this exercise found the stub's NotImplementedError (nothing was attempted)."""
    checks = exercise_result["checks"]
    return bool(checks) and all(c["message"].startswith("not written yet") for c in checks)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?:[ \t]+(?P<code>[^\n]+))?')


def learner_frame(traceback_text: str, path: str) -> tuple[str, str, str] | None:
    """(line, function, code) of the innermost traceback frame in the learner's file."""
    frames = [m for m in _FRAME.finditer(traceback_text or "") if m["file"] == path]
    if not frames:
        return None
    m = frames[-1]
    return m["line"], m["fn"], (m["code"] or "").strip()


def describe_exception(exc_type: str, message: str, traceback_text: str, path: str) -> str:
    """One sentence for an exception raised by learner code, with the line of theirs it came from."""
    frame = learner_frame(traceback_text, path)
    where = f" (line {frame[0]}, in {frame[1]}: {frame[2]})" if frame and frame[2] else \
        (f" (line {frame[0]}, in {frame[1]})" if frame else "")
    if exc_type == "NotImplementedError":
        fn = message.strip() or (frame[1] if frame else "the function")
        return f"not written yet: {fn} raises NotImplementedError"
    if exc_type == "ForbiddenCall":
        return message + where
    if exc_type == "SystemExit":
        return f"the code called sys.exit({message}){where}; a function under test must return instead"
    if exc_type == "MemoryError" or "can't allocate memory" in message or "Cannot allocate memory" in message:
        return f"ran out of memory under the grader's limit (gpucourse grade --memory-gb){where}"
    if "File too large" in message:
        return f"printed more output than the grader keeps{where}"
    return f"{exc_type}: {message.strip()}{where}"
