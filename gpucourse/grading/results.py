"""From the events checks leave behind to a result: which check passed, which failed, and why, in words.

An exercise's result is a plain dict (it travels as JSON)::

    {"exercise": "ex01", "module": "ex01_ring_allreduce", "title": ..., "notebook": ...,
     "score": 7, "max_score": 10, "error": None | "why the whole exercise scored 0",
     "seed": 1234, "time_s": 4.2, "output": "what its code printed (head and tail)",
     "checks": [{"name", "points", "max_points", "status": "passed" | "failed",
                 "message": "what was seen", "hint": "what to think about", "world_size"}]}
"""

from __future__ import annotations

import json
import re

from . import core

OUTPUT_KEEP_BYTES = 8 * 1024  # of what an exercise printed, the head and tail we keep


def read_events(path: str) -> list[dict]:
    """The events in one event file (lines cut short by a killed writer are skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def _verdicts(ex: core.Exercise, events: list[dict]) -> dict[str, tuple[str, str]]:
    """check name -> ("passed" | "failed", message), for the checks these events decide.

    A check is decided by an error, or once every rank has passed or failed it:
    a rank's failure while another rank is still inside the check leaves it open
    (that rank may hang, and the hang is what to report).
    """
    seen: dict[str, dict] = {}
    for e in events:
        if e.get("check") is None:
            continue
        s = seen.setdefault(e["check"], {"pass": set(), "fail": {}, "error": []})
        if e["event"] == "pass":
            s["pass"].add(e["rank"])
        elif e["event"] == "fail":
            s["fail"].setdefault(e["rank"], e["message"])
        elif e["event"] == "error":
            s["error"].append(e["message"])
    out = {}
    for c in ex.checks:
        s = seen.get(c.name)
        if not s:
            continue
        if s["error"]:
            out[c.name] = ("failed", s["error"][0])
        elif len(s["pass"] | set(s["fail"])) >= (c.world_size or 1):
            out[c.name] = ("failed", s["fail"][min(s["fail"], key=lambda r: r or 0)]) if s["fail"] else ("passed", "")
    return out


def crash(events: list[dict]) -> str | None:
    """The last line of the grader's own error in an exercise process, if it had one."""
    for e in events:
        if e.get("event") == "crash":
            return (e.get("message") or "").strip().splitlines()[-1:][0] if e.get("message") else "unknown error"
    return None


def in_progress(ex: core.Exercise, events: list[dict], names: list[str] | None = None) -> str | None:
    """The first check (of ``names``) that these events show started but not decided."""
    decided = _verdicts(ex, events)
    started = {e["check"] for e in events if e.get("event") == "start"}
    for c in ex.checks:
        if (names is None or c.name in names) and c.name in started and c.name not in decided:
            return c.name
    return None


def who_finished(check: core.Check, events: list[dict]) -> str:
    """For a distributed check that was stopped: which ranks had got through it, in words ("" if local)."""
    n = check.world_size or 1
    if n == 1:
        return ""
    done = sorted({e["rank"] for e in events if e.get("check") == check.name and e["event"] in ("pass", "fail")
                   and e["rank"] is not None})
    stuck = [r for r in range(n) if r not in done]
    if not done:
        return f" (none of the {n} ranks finished it)"
    return (f" (rank{'s' * (len(done) > 1)} {', '.join(map(str, done))} finished it, rank{'s' * (len(stuck) > 1)} "
            f"{', '.join(map(str, stuck))} did not)")


def compile_exercise(ex: core.Exercise, attempts: list[list[dict]], reasons: dict[str, str],
                     not_run: str = "not run") -> dict:
    """The result of ``ex`` from the events of each attempt and the reasons attempts ended early.

    A check without a verdict is ``"not run"`` (with ``not_run`` as its message).
    """
    decided: dict[str, tuple[str, str]] = {}
    for events in attempts:
        for name, verdict in _verdicts(ex, events).items():
            decided.setdefault(name, verdict)
    checks = []
    for c in ex.checks:
        status, message = decided.get(c.name) or (("failed", reasons[c.name]) if c.name in reasons
                                                  else ("not run", not_run))
        checks.append({"name": c.name, "max_points": c.points, "points": c.points if status == "passed" else 0,
                       "status": status, "message": message, "hint": c.hint, "world_size": c.world_size})
    return {"exercise": ex.id, "module": ex.module, "title": ex.title, "notebook": ex.notebook,
            "score": sum(c["points"] for c in checks), "max_score": ex.max_score, "error": None, "checks": checks}


def finalize(result: dict) -> dict:
    """Checks still not run at the end count as failed (their message says why they did not run)."""
    for c in result["checks"]:
        if c["status"] == "not run":
            c["status"] = "failed"
    return result


def static_result(ex: core.Exercise, problem: str, seed: int, time_s: float) -> dict:
    """Every check failed for one reason found before running anything (missing, unparsable, reference code)."""
    result = compile_exercise(ex, [], {c.name: problem for c in ex.checks})
    result.update(error=problem, seed=seed, time_s=round(time_s, 3), output="")
    return result


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


def describe_launch_error(e: BaseException, path: str) -> str:
    """One sentence for a launch that failed: which rank raised what, or which ranks hung."""
    from ..runtime.launcher import LaunchTimeout, WorkerError

    if isinstance(e, WorkerError):
        if e.exc_type == "ProcessExit":
            return f"rank {e.rank}: {e.message} — a check's function must return, not end its process"
        what = describe_exception(e.exc_type, e.message, e.remote_traceback, path)
        return what if e.exc_type == "NotImplementedError" else f"rank {e.rank}: {what}"
    if isinstance(e, LaunchTimeout):
        return (f"{e} — a hang: a send or receive with no partner, a collective that not every rank "
                f"reached, or an endless loop")
    return str(e)
