"""Two figures of ``gpucourse workshop``: how long a class waits for its seats, and the instructor for the grades.

``workshop_start_s``: from the command ``gpucourse workshop start --seats 3`` (a new workshop, CPU seats, in a
fresh folder) to all three seats' JupyterLab servers answering through the hub's proxy — the command returns
then. It counts what the instructor waits for: Python and torch starting, the course copied three times, the
hub, its proxy and dashboard, and three JupyterLab servers starting side by side.

``workshop_collect_s``: ``gpucourse workshop collect`` on a stopped workshop of three seats, one with every
exercise solved (``solutions/`` copied in) and two untouched, as at the end of a day. ``quick`` grades ex01
only; ``full`` grades every exercise. Seats are graded ``--jobs`` at a time (its default: cores ÷ 4).

``workshop_start_30_s``: the same for a class of 30 seats, the target being under a minute. Run as root, it
includes making each seat's Unix user (:mod:`gpucourse.workshop.accounts`); the users are removed afterwards.

All need JupyterHub and its proxy (``make workshop-deps``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..workshop import collect, hub
from ..course.readings import Reading, figure

SEATS = 3


def _start(folder: str, seats: int = SEATS) -> float:
    """Run ``gpucourse workshop start`` for a new workshop of CPU seats in ``folder``; its wall time in seconds."""
    argv = [sys.executable, "-m", "gpucourse", "workshop", "start", "--seats", str(seats), "--gpus-per-seat", "0",
            "--port", str(hub.free_port()), "--dir", folder]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=hub.START_TIMEOUT_S + 60)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"gpucourse workshop start failed: {done.stderr.strip()[-1000:]}")
    return wall


def _stop(folder) -> None:
    """Stop the workshop in ``folder`` if it was made, and remove its seats' users (as root)."""
    if Path(folder, "workshop.json").exists():
        hub.stop(folder)
        if os.geteuid() == 0:
            hub.remove_users(folder)


def _time_start(seats: int) -> Reading:
    with tempfile.TemporaryDirectory(prefix="gpucourse-workshop-") as tmp:
        folder = str(Path(tmp) / "workshop")
        try:
            wall = _start(folder, seats)
        finally:
            _stop(folder)
    users = os.geteuid() == 0
    return Reading(wall, {"seats": seats, "seat_users": users},
                   f"{wall:.1f} s until {seats} CPU seats answered" + (", each its own Unix user" if users else ""))


@figure("workshop_start_s", quick=dict(), full=dict())
def workshop_start_s() -> Reading:
    """Seconds from ``gpucourse workshop start --seats 3`` to every seat answering."""
    return _time_start(SEATS)


@figure("workshop_start_30_s", "< 60", quick=dict(), full=dict())
def workshop_start_30_s() -> Reading:
    """Seconds from ``gpucourse workshop start --seats 30`` to every seat answering (users included as root)."""
    return _time_start(30)


@figure("workshop_collect_s", quick=dict(exercises=["ex01"]), full=dict(exercises=None))
def workshop_collect_s(exercises: list[str] | None) -> Reading:
    """Seconds for ``gpucourse workshop collect`` to grade 3 seats (one solved, two untouched)."""
    solutions = Path(__file__).resolve().parents[2] / "solutions"
    with tempfile.TemporaryDirectory(prefix="gpucourse-workshop-") as tmp:
        folder = Path(tmp) / "workshop"
        try:
            _start(str(folder))
        finally:
            _stop(folder)
        for solved in solutions.glob("ex[0-9][0-9]_*.py"):
            shutil.copyfile(solved, folder / "seats" / "seat01" / "exercises" / solved.name)
        t0 = time.perf_counter()
        out = collect.collect(folder, Path(tmp) / "grades.csv", exercises=exercises)
        wall = time.perf_counter() - t0
    scores = {name: f"{r['score']}/{r['max_score']}" for name, r in sorted(out["learners"].items())}
    return Reading(wall, {"scores": scores, "jobs": collect.default_jobs(), "exercises": exercises or "all"},
                   f"{wall:.1f} s for {SEATS} seats ({', '.join(f'{k} {v}' for k, v in scores.items())}), "
                   f"{collect.default_jobs()} at a time")
