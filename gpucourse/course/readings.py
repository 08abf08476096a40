"""The benchmark toolkit: a figure is a number with a target, measured side by side.

Each figure is a number, usually a ratio "ours over theirs", and a target it
should meet (``"<= 1.10"``) or ``"report"`` when the number is only shown. Every
ratio is measured side by side in one run: the two sides take turns
(A B B A A B B A …) and each side's median is used, so a machine that gets
slower or busier during the run (a laptop warming up, a neighbour's job on a
shared box) slows both sides alike, and a few outliers do not move the result.

This module imports nothing else from gpucourse, so any module that measures
something (bandwidth, troubleshoot, the figures in ``gpucourse.bench``) can
hand back a :class:`Reading` without depending on the benchmarks themselves.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Callable

# Steps at the start of every run that are left out of step-time medians: the
# first steps pay for allocator growth, lazy initialisation and DDP's bucket set-up.
WARMUP_STEPS = 3
@dataclass
class Reading:
    """What one figure measured: its ``value``, the raw timings, and a line for people."""

    value: float
    detail: dict
    summary: str = ""


@dataclass(frozen=True)
class Figure:
    """A registered benchmark: ``measure(**quick)`` or ``measure(**full)`` returns a :class:`Reading`."""

    key: str
    target: str
    measure: Callable[..., Reading]
    quick: dict = field(default_factory=dict)
    full: dict = field(default_factory=dict)


FIGURES: list[Figure] = []


def figure(key: str, target: str = "report", *, quick: dict, full: dict):
    """Register the decorated function as the figure ``key`` (see the module docstring)."""
    parse_target(target)

    def register(fn):
        FIGURES.append(Figure(key, target, fn, quick, full))
        return fn
    return register


_COMPARE = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def parse_target(target: str):
    """``"<= 1.10"`` -> (operator.le, 1.10); ``"0.8..1.25"`` -> a closed range; ``"report"`` -> None."""
    if target == "report":
        return None
    if ".." in target:
        lo, _, hi = target.partition("..")
        return _within, (float(lo), float(hi))
    op, _, limit = target.partition(" ")
    if op not in _COMPARE:
        raise ValueError(f"target {target!r} must be 'report' or '<op> <number>' with op one of {', '.join(_COMPARE)}.")
    return _COMPARE[op], float(limit)


def passed(value: float | None, target: str) -> bool | None:
    """Whether ``value`` meets ``target``; None for a figure that is only reported."""
    parsed = parse_target(target)
    if parsed is None:
        return None
    compare, limit = parsed
    return value is not None and math.isfinite(value) and bool(compare(value, limit))


def interleave(sides: dict[str, Callable[[], object]], reps: int) -> dict[str, list]:
    """Call each side ``reps`` times, taking turns A B B A A B …; return each side's results in order.

    Reversing the order every round means neither side always runs first (after
    the other has warmed the caches) and a slow drift of the machine's speed
    falls equally on both.
    """
    names = list(sides)
    out: dict[str, list] = {n: [] for n in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            out[name].append(sides[name]())
    return out


def ratio(a: float, b: float) -> float:
    """a / b, refusing what would not be a meaningful positive ratio."""
    if not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"cannot form a ratio of {a!r} over {b!r}: both must be positive and finite.")
    return a / b
