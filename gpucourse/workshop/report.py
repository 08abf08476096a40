"""The class at a glance: what each seat has passed, where it is stuck, what to explain next, and what to see to.

Everything comes from files and services that are already there: each seat's
progress file (``check("ex03")`` in a notebook records the score and the checks
that failed, with their hints, or that the grader itself could not run: that
is for the instructor to see to, not a learner stuck), the hub's REST API (is the seat's server
running, when was it last used), NVML (how busy each seat's GPUs are) and,
for seats that are SLURM jobs, SLURM's queue (pending, or running on which node).
:func:`class_report` gathers it as plain data; ``gpucourse workshop status``
prints it with :func:`format_report` and the dashboard draws it as a page.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from ..grading import catalog
from ..grading.report import LADDER, first_line
from .errors import WorkshopError
from .folder import REPO, Workshop
from .kernels import seat_kernels
from .plan import Plan
from .slurm_seats import describe_job, seat_jobs

NVDASHBOARD = ("for each learner's own view of their GPUs, install jupyterlab-nvdashboard "
               "(pip install jupyterlab-nvdashboard): a GPU panel in JupyterLab's left bar")
# What NVML raises where there is simply no GPU to see: no NVIDIA library, no driver loaded.
NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")


def course_exercises() -> list[str]:
    """The exercise modules every seat has (``ex01_ring_allreduce`` …), in course order."""
    return sorted(p.stem for p in (REPO / "exercises").glob("ex[0-9][0-9]_*.py"))


def course_points() -> int:
    """The whole course's points: every seat's score is out of these, whatever it has tried."""
    return catalog.POINTS * len(course_exercises())


def tries(n: int) -> str:
    """``"1 try"``, ``"3 tries"``."""
    return f"{n} {'try' if n == 1 else 'tries'}"


def rung(n: int) -> str:
    """How far up the hint ladder (:data:`gpucourse.grading.report.LADDER`) a learner's last of ``n`` tries saw:
    ``"sees the idea"``, ``"sees where it is taught"`` or ``"sees the fix"``."""
    return "sees " + ("the fix" if n >= LADDER["fix"] else "where it is taught" if n >= LADDER["section"]
                      else "the idea")


def _when(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def ago(text: str | None, now: datetime | None = None) -> str:
    """``"4 min ago"`` for an ISO time; ``"never"`` for none."""
    when = _when(text)
    if when is None:
        return "never"
    seconds = max(0, ((now or datetime.now(timezone.utc)) - when).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def seat_progress(progress_file: Path) -> dict:
    """One seat's record in a few numbers: passed, score (the best of each exercise, added up), quiz per topic,
    latest time, where it is stuck, and where its grading broke.

    ``stuck`` is the first failing check of the exercise this learner graded
    last without passing it: what they are most likely looking at now.
    ``grading_broken`` is ``{exercise: why}`` for each exercise the grader
    could not run when this seat last asked: the instructor's to see to, so
    such an exercise is not where the seat is stuck.
    """
    from ..course import progress

    try:
        s = progress.summary(progress_file)
    except (OSError, progress.ProgressError) as e:
        return {"problem": str(e), "exercises": {}, "passed": 0, "score": 0, "quiz": {}, "last": None,
                "stuck": None, "grading_broken": {}}
    exercises = s["exercises"]
    broken = {name: first_line(f.get("why", "")) for name, f in sorted(s["grader_failures"].items())}
    quizzes = progress.load(progress_file)["quizzes"]
    times = [e.get("last") for e in exercises.values()] + [q.get("time") for q in quizzes]
    open_ones = [(name, e) for name, e in exercises.items() if not e.get("passed") and name not in broken]
    stuck = None
    if open_ones:
        name, e = max(open_ones, key=lambda item: item[1].get("last") or "")
        failed = e.get("failed") or [{}]
        stuck = {"exercise": name, "attempts": e.get("attempts", 0), "score": e.get("score"),
                 "max_score": e.get("max_score"), "check": failed[0].get("check"), "hint": failed[0].get("hint")}
    return {"problem": None, "exercises": exercises, "passed": s["exercises_passed"],
            "score": sum(e.get("best", 0) for e in exercises.values()),
            "quiz": {t: [v["correct"], v["total"]] for t, v in s["topics"].items()},
            "last": max((t for t in times if _when(t)), key=_when, default=None), "stuck": stuck,
            "grading_broken": broken}


def common_failures(seats: list[dict], top: int = 5) -> list[dict]:
    """The checks failing for the most seats right now, each with its hint: what to explain next (not an exercise
    whose grading broke for that seat: its checks say nothing of what the learner understood)."""
    count: Counter = Counter()
    hints, who = {}, {}
    for seat in seats:
        for name, e in seat["exercises"].items():
            if e.get("passed") or name in seat.get("grading_broken", {}):
                continue
            for f in e.get("failed") or []:
                key = (name, f.get("check", ""))
                count[key] += 1
                hints.setdefault(key, f.get("hint", ""))
                who.setdefault(key, []).append(seat["name"])
    return [{"exercise": ex, "check": check, "seats": who[(ex, check)], "count": n, "hint": hints[(ex, check)]}
            for (ex, check), n in count.most_common(top)]


def gpu_use(plan: Plan) -> dict:
    """Each seat's GPUs, as NVML sees them now: ``{"available", "note", "seats": {name: [gpu, ...]}}``.

    Without a GPU driver (NVML's library not found: a machine with no GPU) or
    without NVML's bindings (``pynvml``, from nvidia-ml-py), ``available`` is
    False and the note says "no GPU visible", and what else NVML said, if
    anything, in words.
    """
    try:
        import pynvml
    except ImportError:
        return {"available": False, "note": "no GPU visible (NVML's Python bindings are not installed: pip install "
                                            "nvidia-ml-py)", "seats": {}, "hint": NVDASHBOARD}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 -- whatever NVML raises, no GPU can be seen from here
        said = "" if type(e).__name__ in NO_DRIVER else f" (NVML: {e})" if str(e) else f" ({type(e).__name__})"
        return {"available": False, "note": f"no GPU visible{said}", "seats": {}, "hint": NVDASHBOARD}
    try:
        seats = {}
        for seat in plan.seats:
            rows = []
            for gpu in seat.gpus:
                try:
                    h = (pynvml.nvmlDeviceGetHandleByIndex(int(gpu)) if gpu.isdigit()
                         else pynvml.nvmlDeviceGetHandleByUUID(gpu))
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                    rows.append({"gpu": gpu, "name": _text(pynvml.nvmlDeviceGetName(h)),
                                 "utilization": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                                 "memory_used": mem.used, "memory_total": mem.total})
                except pynvml.NVMLError as e:
                    rows.append({"gpu": gpu, "error": str(e)})
            seats[seat.name] = rows
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    return {"available": True, "note": f"{count} GPU{'s' * (count != 1)} on this machine", "seats": seats,
            "hint": NVDASHBOARD}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def class_report(ws: Workshop, hub_users: dict | None = None, running: bool = False) -> dict:
    """Every seat of the workshop in ``ws`` and the class's common failures (JSON-ready).

    ``hub_users`` are the hub's user models (``hub.hub_users``), when it answers.
    """
    plan = ws.saved_plan()
    total, points = len(course_exercises()), course_points()
    jobs, unknown = {}, None
    if any(s.job for s in plan.seats):
        try:
            jobs = seat_jobs(plan)
        except WorkshopError as e:
            unknown = f"unknown ({e})"
    seats = []
    for seat in plan.seats:
        row = {"name": seat.name, "resources": seat.describe(), "gpus": list(seat.gpus),
               "folder": str(seat.folder), **seat_progress(seat.progress_file), "exercises_total": total,
               "max_score": points}
        user = (hub_users or {}).get(seat.name)
        server = (user or {}).get("servers", {}).get("")
        row["server"] = ("running" if server and server.get("ready") else "starting" if server else "stopped") \
            if hub_users is not None else ("unknown" if running else "stopped")
        row["job"] = (unknown or describe_job(jobs.get(seat.name))) if seat.job else None
        row["kernels"] = seat_kernels(ws, seat.name)
        hub_seen = (user or {}).get("last_activity")
        row["last_activity"] = max((t for t in (row["last"], hub_seen) if _when(t)), key=_when, default=None)
        seats.append(row)
    return {"workshop": str(ws.root), "running": running, "notes": plan.notes, "seats": seats,
            "max_score": points, "grading_broken": grading_broken(seats), "common_failures": common_failures(seats),
            "gpu": gpu_use(plan)}


def grading_broken(seats: list[dict]) -> list[str]:
    """One line for each seat whose grading broke: for the instructor to see to (the grader, not the learner)."""
    return [f"grading broken for {s['name']}: {ex}: {why}" for s in seats
            for ex, why in s.get("grading_broken", {}).items()]


def status(root=None) -> dict:
    """The class report of the workshop in ``root``, with the hub's view when it runs; ``"url"`` where it is."""
    from . import hub

    ws = Workshop(root)
    ws.settings()  # a sentence if there is no workshop there
    state = hub.running(ws)
    report = class_report(ws, hub.hub_users(ws, state) if state else None, running=state is not None)
    report["url"] = state["url"] if state else None
    return report


def format_report(report: dict) -> str:
    """The report as the terminal shows it (``gpucourse workshop status``)."""
    lines = [f"workshop {report['workshop']}: " + (f"running at {report.get('url')}" if report["running"]
                                                   else "stopped")]
    lines += [f"  {n}" for n in report["notes"]]
    on_slurm = any(s.get("job") for s in report["seats"])
    head = ("seat", "resources", *(("SLURM job",) if on_slurm else ()), "server", "kernels", "last activity",
            "passed", "score (of the whole course)", "quiz (right/asked)", "stuck on")
    rows = [head]
    for s in report["seats"]:
        quiz = ", ".join(f"{t} {c}/{n}" for t, (c, n) in sorted(s["quiz"].items())) or "-"
        stuck = "-"
        if s["problem"]:
            stuck = f"progress file unreadable: {s['problem']}"
        elif s["grading_broken"]:
            stuck = f"grading broken: {', '.join(s['grading_broken'])} (see below)"
        elif s["stuck"]:
            stuck = f"{s['stuck']['exercise']}" + (f": {s['stuck']['check']}" if s["stuck"]["check"] else "") + \
                f" ({tries(s['stuck']['attempts'])}; {rung(s['stuck']['attempts'])})"
        rows.append((s["name"], s["resources"], *((s["job"],) if on_slurm else ()), s["server"],
                     s["kernels"]["state"], ago(s["last_activity"]),
                     f"{s['passed']}/{s['exercises_total']}",
                     "-" if s["problem"] else f"{s['score']:g}/{s['max_score']:g}",
                     quiz, stuck))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head) - 1)]
    lines.append("")
    lines += ["  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)) + "  " + str(r[-1]) for r in rows]
    lines.append("")
    trouble = [s for s in report["seats"] if s["kernels"]["problem"]]
    if trouble:
        lines.append("kernels in trouble (see to them before the learner has to ask):")
        for s in trouble:
            lines.append(textwrap.fill(f"{s['name']}: {s['kernels']['problem']}", 110, initial_indent="  ",
                                       subsequent_indent=" " * 6))
            lines.append("    its server's log ends with:")
            lines += [f"      {line}" for line in s["kernels"]["log"].splitlines()]
        lines.append("")
    if report["grading_broken"]:
        lines.append("grading broken (the grader could not run, not the learners' code: see to it, then they check "
                     "again):")
        lines += [textwrap.fill(line, 110, initial_indent="  ", subsequent_indent=" " * 6)
                  for line in report["grading_broken"]]
        lines.append("")
    if report["common_failures"]:
        lines.append("what to explain next (checks failing for the most seats):")
        for f in report["common_failures"]:
            lines.append(f"  {f['count']}× {f['exercise']}: {f['check']}  ({', '.join(f['seats'])})")
            lines.append(textwrap.fill(f"hint: {f['hint']}", 110, initial_indent=" " * 6, subsequent_indent=" " * 12))
    else:
        lines.append("what to explain next: no failing check recorded yet.")
    gpu = report["gpu"]
    lines.append("")
    lines.append(f"GPU use: {gpu['note']}")
    for name, rows_ in gpu["seats"].items():
        for g in rows_:
            lines.append(f"  {name} GPU {g['gpu']}: " + (g["error"] if "error" in g else
                         f"{g['utilization']}% busy, {g['memory_used'] / 2**30:.1f}/{g['memory_total'] / 2**30:.1f} "
                         f"GiB ({g['name']})"))
    lines.append(f"  ({gpu['hint']})")
    return "\n".join(line.rstrip() for line in lines)
