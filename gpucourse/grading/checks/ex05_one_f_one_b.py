"""Checks of exercise 5: the 1F1B schedule as a pure function, and its bubble."""

from __future__ import annotations

import torch

from ...parallel import schedules
from ...parallel.schedules import B, F, Op, ScheduleError
from ..core import Exercise, Fail

EXERCISE = Exercise("ex05_one_f_one_b", "The 1F1B pipeline schedule", "notebooks/04_pipeline_parallelism.ipynb")


def _cases(ctx) -> list[tuple[int, int]]:
    g = ctx.generator()
    fixed = [(1, 1), (1, 4), (2, 1), (2, 2), (3, 5), (4, 2), (4, 8), (16, 64)]
    return fixed + [(int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g)))
                    for _ in range(4)]


def _schedule(fn, pp: int, m: int) -> list[list[Op]]:
    """The learner's schedule with each op as an Op (a plain (kind, microbatch) tuple is accepted)."""
    out = fn(pp, m)
    if not isinstance(out, (list, tuple)) or len(out) != pp:
        raise Fail(f"one_f_one_b({pp}, {m}) returned {type(out).__name__}"
                   f"{f' of length {len(out)}' if hasattr(out, '__len__') else ''}, not a list of {pp} stages")
    try:
        return [[Op(*op) for op in stage] for stage in out]
    except TypeError:
        raise Fail(f"one_f_one_b({pp}, {m}): every op must be an Op(kind, microbatch)") from None


def _compute(stage: list[Op]) -> list[Op]:
    return [op for op in stage if op.kind in (F, B)]


@EXERCISE.check("the schedule is valid and does not deadlock", points=3, hint=(
    "Every stage forwards and backwards each microbatch once, receives an activation before its forward and "
    "a gradient before its backward, and sends what it computed after. Sends block until the neighbour "
    "receives: in the steady state the next stage returns gradient k before it asks for activation w+k, "
    "so take the gradient in before you hand the activation on. schedules.validate tells you where it "
    "breaks."))
def valid(ctx):
    fn = ctx.load().one_f_one_b
    for pp, m in _cases(ctx):
        try:
            schedules.validate(_schedule(fn, pp, m), pp, m)
        except ScheduleError as e:
            raise Fail(f"pp={pp}, m={m}: {e}") from None


@EXERCISE.check("stage s warms up with min(pp - s - 1, m) forwards", points=2, hint=(
    "The warm-up fills the pipeline: stage s must have forwarded enough microbatches that, by the time the "
    "first gradient comes back to it, every stage below it is busy. Count the stages after s. The last "
    "stage needs no warm-up at all: it starts each backward right after its forward."))
def warmup(ctx):
    fn = ctx.load().one_f_one_b
    for pp, m in _cases(ctx):
        for s, stage in enumerate(_schedule(fn, pp, m)):
            kinds = [op.kind for op in _compute(stage)]
            got = kinds.index(B) if B in kinds else len(kinds)
            # The warm-up's forwards, then the steady state's first forward (when there is a steady state).
            want = min(pp - s, m)
            if got != want:
                raise Fail(f"pp={pp}, m={m}: stage {s} runs {got} forward{'s' * (got != 1)} before its first "
                           f"backward; 1F1B runs {want} there: a warm-up of {min(pp - s - 1, m)}"
                           f"{', then the first forward of the steady state' if m > pp - s - 1 else ''}")


@EXERCISE.check("then one forward, one backward, in turn", points=2, hint=(
    "After the warm-up each stage alternates: the forward of the next new microbatch, then the backward of "
    "the oldest microbatch still waiting for one (microbatches are backwarded in the order they were "
    "forwarded). When no forwards are left, the remaining backwards drain the pipeline."))
def alternates(ctx):
    fn = ctx.load().one_f_one_b
    for pp, m in _cases(ctx):
        reference = schedules.one_f_one_b(pp, m)
        for s, stage in enumerate(_schedule(fn, pp, m)):
            got, want = _compute(stage), _compute(reference[s])
            if got != want:
                k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                says = str(got[k]) if k < len(got) else "nothing"
                raise Fail(f"pp={pp}, m={m}: compute op {k} of stage {s} is {says}; 1F1B runs "
                           f"{want[k] if k < len(want) else 'nothing'} there "
                           f"(its F/B order: {' '.join(map(str, want[:12]))}{' …' if len(want) > 12 else ''})")


@EXERCISE.check("stage s holds at most pp - s microbatches", points=1, hint=(
    "1F1B's reason to exist is memory: a stage keeps a microbatch's activations from its forward to its "
    "backward. Stage s never has more than pp - s in flight, however large m is; GPipe holds all m."))
def memory(ctx):
    fn = ctx.load().one_f_one_b
    for pp, m in _cases(ctx):
        try:
            peak = schedules.simulate(_schedule(fn, pp, m), pp, m, 1.0, 1.0, 0.0).peak_in_flight
        except ScheduleError as e:
            raise Fail(f"pp={pp}, m={m}: the schedule cannot run ({e})") from None
        for s, held in enumerate(peak):
            if held > min(pp - s, m):
                raise Fail(f"pp={pp}, m={m}: stage {s} holds {held} microbatches at once; at most "
                           f"{min(pp - s, m)}")


@EXERCISE.check("bubble_fraction", points=2, hint=(
    "Time the first microbatch takes to reach the last stage, and the last gradient to come back, is time "
    "the other stages idle: p-1 slots of F+B out of a makespan of (m + p - 1) slots. The bubble is the idle "
    "share of all stage-time, so it shrinks as m grows; 1F1B's equals GPipe's."))
def bubble(ctx):
    fn = ctx.load().bubble_fraction
    for pp, m in _cases(ctx):
        got = fn(pp, m)
        want = schedules.simulate(schedules.one_f_one_b(pp, m), pp, m, 1.0, 1.0, 0.0).bubble_fraction
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
            extra = " — that is the naive schedule's (one microbatch at a time)" \
                if isinstance(got, (int, float)) and pp > 1 and abs(got - (pp - 1) / pp) < 1e-9 else ""
            raise Fail(f"bubble_fraction({pp}, {m}) = {got!r}; the simulated 1F1B idles {want:.6g}{extra}")
