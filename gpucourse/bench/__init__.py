"""Benchmarks: gpucourse's runtime and strategies against their PyTorch and Accelerate counterparts.

``gpucourse bench`` measures a list of *figures* (see :mod:`gpucourse.course.readings`
for what a figure is and how two sides are timed in turns). Adding a figure is
one function::

    @figure("my_ratio", target="<= 1.05", quick=dict(reps=3), full=dict(reps=9))
    def my_ratio(reps: int) -> Reading:
        # seconds of ours over seconds of theirs, each side's median
        times = interleave({"ours": time_ours, "theirs": time_theirs}, reps)
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
        return Reading(ratio(ours, theirs), {"ours_s": times["ours"], "theirs_s": times["theirs"]})

``quick`` and ``full`` are the keyword arguments the function gets under
``gpucourse bench --quick`` and ``gpucourse bench``; :func:`.harness.compare_runs`
does the interleaving for two or more training configs. :func:`main` runs every
registered figure (or only those named), prints a table and can write them as
one JSON object. The figures live with their topic: ``parallel_figures`` (the
strategies), ``memory_figures``, ``course_figures`` (bandwidth, grading, the
live view, the tour, starting ranks), ``replay_figures`` (the modeled clock),
``quiz_figures``, ``workshop_figures`` and ``serving_figures``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback

import torch

from ..files import write_atomic
from ..runtime.launcher import plan_device, preimport, visible_gpus
from ..course.readings import FIGURES, WARMUP_STEPS, Figure, Reading, figure, interleave, parse_target, passed, ratio
from .harness import RANKS, RUN_TIMEOUT_S, bench_config, compare_runs


# --- the suite -------------------------------------------------------------------------


def machine() -> dict:
    """Where the figures were measured (found without initialising CUDA)."""
    plan = plan_device("auto", RANKS)
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "device": plan.device, "backend": plan.backend, "gpus": visible_gpus(), "cpu_count": os.cpu_count()}


def measure(fig: Figure, quick: bool) -> dict:
    """Run one figure; its JSON entry. A figure that raises is recorded as failed, with the error."""
    try:
        reading = fig.measure(**(fig.quick if quick else fig.full))
        value = float(reading.value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"figure {fig.key} measured {value!r}, not a positive finite number.")
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return {"value": None, "target": fig.target, "passed": False,
                "detail": {"error": f"{type(e).__name__}: {e}"}}
    detail = {**reading.detail, "summary": reading.summary}
    return {"value": value, "target": fig.target, "passed": passed(value, fig.target), "detail": detail}


def format_table(results: dict) -> str:
    """The table ``gpucourse bench`` prints: figure, value, target, result, and what was measured."""
    rows = [("figure", "value", "target", "result", "measured")]
    for key, entry in results.items():
        if key == "machine":
            continue
        if entry["value"] is None:
            value, result = "-", "error"
        else:
            value, result = f"{entry['value']:.3f}", {True: "pass", False: "FAIL", None: "report"}[entry["passed"]]
        note = entry["detail"].get("error") or entry["detail"].get("summary", "")
        rows.append((key, value, entry["target"], result, note))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    m = results.get("machine", {})
    if m:
        lines.append(f"(torch {m['torch']}, {RANKS} ranks on {m['device']} ({m['backend']}), {m['cpu_count']} CPUs, "
                     f"{m['gpus']} GPUs)")
    return "\n".join(line.rstrip() for line in lines)


def select(only=None) -> list[Figure]:
    """The figures named in ``only`` (keys, in the registry's order), or all of them; an unknown key is refused."""
    if only is None:
        return list(FIGURES)
    known = [f.key for f in FIGURES]
    unknown = [k for k in only if k not in known]
    if unknown or not only:
        raise ValueError(f"no figure called {', '.join(unknown) or 'nothing'}; the figures are: {', '.join(known)}.")
    return [f for f in FIGURES if f.key in only]


def main(quick: bool = False, json_path: str | None = None, only=None) -> dict:
    """Measure every registered figure (or those keyed in ``only``), print the table, optionally write the JSON.

    The JSON object has one entry per figure key, ``{"value", "target",
    "passed", "detail"}``, and ``"machine"``. It is written once, at the end,
    atomically: an interrupted bench leaves the previous file as it was.
    Returns the results.
    """
    figures = select(only)
    results: dict = {}
    preimport()
    for fig in figures:
        print(f"gpucourse bench: measuring {fig.key} ({'quick' if quick else 'full'}) …", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results[fig.key] = measure(fig, quick)
        results[fig.key]["detail"]["wall_s"] = time.perf_counter() - start
    results["machine"] = {**machine(), "suite": "quick" if quick else "full"}
    print(format_table(results), flush=True)
    if json_path:
        write_atomic(json_path, json.dumps(results, indent=1))
        print(f"figures written to {json_path}", flush=True)
    return results


from . import quiz_figures  # noqa: E402,F401 (registers the question bank's figures)
from . import workshop_figures  # noqa: E402,F401 (registers the workshop's figures)
from . import replay_figures  # noqa: E402,F401 (registers the modeled clock's figures)
from . import parallel_figures  # noqa: E402,F401 (registers the strategies' figures)
from . import memory_figures  # noqa: E402,F401 (registers the memory figures)
from . import course_figures  # noqa: E402,F401 (registers the course's figures)
from . import serving_figures  # noqa: E402,F401 (registers the serving figures)
from . import serving_published_figures  # noqa: E402,F401 (registers the serving model against published figures)
