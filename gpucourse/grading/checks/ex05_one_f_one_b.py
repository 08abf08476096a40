"""Checks of exercise 5: the 1F1B schedule as a pure function, and its bubble.

The learner's functions run in the sandbox (where ``gpucourse.parallel.schedules`` is a copy without the
reference schedules); a schedule comes back as plain data, lists of (kind, microbatch) tuples, and is
validated, simulated and compared here with the real module.
"""

from __future__ import annotations

import torch

from ...parallel import schedules
from ...parallel.schedules import B, F, PARTNER, PEER, RECV_B, SEND_B, SEND_F, Op, ScheduleError
from ..core import Exercise, Fail

EXERCISE = Exercise("ex05_one_f_one_b", "The 1F1B pipeline schedule", "notebooks/04_pipeline_parallelism.ipynb",
                    concept=("1F1B warms a stage up with forwards, then alternates one forward and one backward, then "
                             "drains the backwards; each send meets its neighbour's receive, in the same order on "
                             "both sides"),
                    section="§3 (1F1B) and §4 (a schedule is data); §6 shows a schedule that deadlocks")

# Fixed cases, so that each mistake is caught on every seed: one stage; one microbatch; fewer microbatches
# than stages (the warm-up capped at m, no steady state on the first stages: (4, 2), (5, 1), (8, 3)); m = pp;
# m = pp - 1 (stage 0's warm-up is all of m); many microbatches; 64 stages (it must be quick there too).
FIXED = [(1, 1), (1, 4), (2, 1), (2, 2), (3, 2), (3, 5), (4, 2), (4, 8), (5, 1), (8, 3), (16, 64), (64, 16)]


def _cases(ctx) -> list[tuple[int, int]]:
    g = ctx.generator()
    return FIXED + [(int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g)))
                    for _ in range(4)]


def _op(op) -> Op:
    """One op as the sandbox sent it back: an Op comes as a (kind, microbatch, chunk) tuple (chunk 0: this
    schedule gives each stage one chunk), a plain (kind, microbatch) tuple is accepted, an object as a dict."""
    if isinstance(op, dict) and "kind" in op and "microbatch" in op:
        op = (op["kind"], op["microbatch"])
    if isinstance(op, (tuple, list)) and len(op) == 3 and op[2] == 0 and not isinstance(op[2], bool):
        op = op[:2]
    if not isinstance(op, (tuple, list)) or len(op) != 2 or not isinstance(op[0], str) \
            or not isinstance(op[1], int) or isinstance(op[1], bool):
        raise TypeError
    return Op(*op)


def _schedule(ctx, pp: int, m: int) -> list[list[Op]]:
    """The learner's schedule for (pp, m), each op as an Op (a plain (kind, microbatch) tuple is accepted)."""
    out = ctx.call("one_f_one_b", pp, m).value
    if not isinstance(out, (list, tuple)) or len(out) != pp:
        raise Fail(f"one_f_one_b({pp}, {m}) returned {type(out).__name__}"
                   f"{f' of length {len(out)}' if isinstance(out, (list, tuple, dict, str)) else ''}, "
                   f"not a list of {pp} stages")
    try:
        return [[_op(op) for op in stage] for stage in out]
    except TypeError:
        raise Fail(f"one_f_one_b({pp}, {m}): every stage must be a list, and every op an Op(kind, microbatch) "
                   f"of a kind (a str) and a microbatch (an int)") from None


def _compute(stage: list[Op]) -> list[Op]:
    return [op for op in stage if op.kind in (F, B)]


def _order(ops: list[Op], limit: int = 12) -> str:
    return " ".join(map(str, ops[:limit])) + (" …" if len(ops) > limit else "")


def _stuck(schedule: list[list[Op]], pp: int) -> dict[int, Op]:
    """The op each stage waits in forever when sends block until their receive (validate's rule), by stage."""
    pc = [0] * pp
    moved = True
    while moved:
        moved = False
        for s in range(pp):
            while pc[s] < len(schedule[s]):
                op = schedule[s][pc[s]]
                if op.kind in (F, B):
                    pc[s] += 1
                    moved = True
                    continue
                peer = s + PEER[op.kind]
                theirs = schedule[peer][pc[peer]] if 0 <= peer < pp and pc[peer] < len(schedule[peer]) else None
                if theirs != Op(PARTNER[op.kind], op.microbatch):
                    break
                pc[s] += 1
                pc[peer] += 1
                moved = True
    return {s: schedule[s][pc[s]] for s in range(pp) if pc[s] < len(schedule[s])}


def _deadlock(schedule: list[list[Op]], pp: int) -> str:
    """A sentence naming two neighbours that each wait in a send to the other, if that is the deadlock."""
    stuck = _stuck(schedule, pp)
    for s in range(pp - 1):
        a, b = stuck.get(s), stuck.get(s + 1)
        if a is not None and b is not None and a.kind == SEND_F and b.kind == SEND_B:
            return (f" — stage {s} waits in {a} to stage {s + 1} while stage {s + 1} waits in {b} to stage {s}: "
                    f"each waits in a send to the other. Stage {s + 1} sends gradient {b.microbatch} before it "
                    f"receives activation {a.microbatch}, so stage {s} must take {RECV_B}{b.microbatch} in "
                    f"before its {a}")
    return ""


@EXERCISE.check("the schedule is valid and does not deadlock", points=3, hint=(
    "Every stage forwards and backwards each microbatch once, receives an activation before its forward and "
    "a gradient before its backward, and sends what it computed after. Sends block until the neighbour "
    "receives: in the steady state the next stage returns gradient k before it asks for activation w+k, "
    "so take the gradient in before you hand the activation on. schedules.validate tells you where it "
    "breaks."))
def valid(ctx):
    for pp, m in _cases(ctx):
        schedule = _schedule(ctx, pp, m)
        try:
            schedules.validate(schedule, pp, m)
        except ScheduleError as e:
            why = _deadlock(schedule, pp) if "deadlock" in str(e) else ""
            raise Fail(f"pp={pp}, m={m}: {e}{why}") from None


def _warmup_signature(pp: int, m: int, counts: list[int]) -> str:
    """What the forwards each stage runs before its first backward say about the learner's warm-up."""
    wants = [min(pp - s, m) for s in range(pp)]
    wrong = [s for s in range(pp) if counts[s] != wants[s]]
    if all(c == m for c in counts) and any(w < m for w in wants):
        return " — every stage runs all m forwards before any backward: that is GPipe, not 1F1B"
    if pp > 1 and all(c == 1 for c in counts) and any(w > 1 for w in wants):
        return (" — every stage runs each forward's backward right after it: no warm-up at all (the last "
                "stage's pattern on every stage)")
    if pp > 2 and all(counts[s] == min(s + 1, m) for s in range(pp)):
        return (" — stage s runs s warm-up forwards, the number of stages before it; it needs one for each "
                "stage after it, pp - s - 1: the first stage warms up the most")
    if any(counts[s] > m for s in range(pp)):
        return (f" — more forwards than there are microbatches ({m}): the warm-up is min(pp - s - 1, m), "
                f"capped at m")
    if all(counts[s] == min(pp - s + 1, m) for s in range(pp)):
        return (" — one forward too many on every stage that has a steady state: a warm-up of pp - s, "
                "not pp - s - 1")
    if all(counts[s] == max(min(pp - s - 1, m), 1) for s in range(pp)) and wrong:
        return (" — one forward fewer than 1F1B on every stage that has a steady state: the steady state starts "
                "with a forward, after pp - s - 1 warm-up forwards")
    return ""


@EXERCISE.check("stage s warms up with min(pp - s - 1, m) forwards", points=2, hint=(
    "The warm-up fills the pipeline: stage s must have forwarded enough microbatches that, by the time the "
    "first gradient comes back to it, every stage below it is busy. Count the stages after s. The last "
    "stage needs no warm-up at all: it starts each backward right after its forward."))
def warmup(ctx):
    for pp, m in _cases(ctx):
        schedule = _schedule(ctx, pp, m)
        counts = []
        for stage in schedule:
            kinds = [op.kind for op in _compute(stage)]
            counts.append(kinds.index(B) if B in kinds else len(kinds))
        for s, got in enumerate(counts):
            # The warm-up's forwards, then the steady state's first forward (when there is a steady state).
            want = min(pp - s, m)
            if got != want:
                raise Fail(f"pp={pp}, m={m}: stage {s} runs {got} forward{'s' * (got != 1)} before its first "
                           f"backward; 1F1B runs {want} there: a warm-up of {min(pp - s - 1, m)}"
                           f"{', then the first forward of the steady state' if m > pp - s - 1 else ''}"
                           f"{_warmup_signature(pp, m, counts)}")


def _order_signature(pp: int, m: int, s: int, got: list[Op], want: list[Op]) -> str:
    """What a stage's F/B order that is not 1F1B's looks like."""
    for name, other in (("GPipe's: all forwards, then all backwards", schedules.gpipe),
                        ("the naive schedule's: each microbatch forward and back before the next", schedules.naive)):
        if got == _compute(other(pp, m)[s]):
            return f" — that is {name}"
    forwards = [op.microbatch for op in got if op.kind == F]
    backwards = [op.microbatch for op in got if op.kind == B]
    if sorted(forwards) == list(range(m)) and forwards != list(range(m)):
        return (f" — it forwards the microbatches in the order {', '.join(map(str, forwards[:12]))}: 1F1B takes "
                f"them 0, 1, 2, …")
    if sorted(backwards) == sorted(forwards) and backwards != forwards:
        return (f" — it backwards the microbatches in the order {', '.join(map(str, backwards[:12]))}, not in "
                f"the order it forwarded them ({', '.join(map(str, forwards[:12]))}): 1F1B backwards the oldest "
                f"microbatch still waiting, first in first out")
    return ""


@EXERCISE.check("then one forward, one backward, in turn", points=2, hint=(
    "After the warm-up each stage alternates: the forward of the next new microbatch, then the backward of "
    "the oldest microbatch still waiting for one (microbatches are backwarded in the order they were "
    "forwarded). When no forwards are left, the remaining backwards drain the pipeline."))
def alternates(ctx):
    for pp, m in _cases(ctx):
        reference = schedules.one_f_one_b(pp, m)
        for s, stage in enumerate(_schedule(ctx, pp, m)):
            got, want = _compute(stage), _compute(reference[s])
            if got != want:
                k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                says = str(got[k]) if k < len(got) else "nothing"
                raise Fail(f"pp={pp}, m={m}: compute op {k} of stage {s} is {says}; 1F1B runs "
                           f"{want[k] if k < len(want) else 'nothing'} there (stage {s}'s F/B order: "
                           f"{_order(got)}; 1F1B's: {_order(want)}){_order_signature(pp, m, s, got, want)}")


@EXERCISE.check("stage s holds at most pp - s microbatches", points=1, hint=(
    "1F1B's reason to exist is memory: a stage keeps a microbatch's activations from its forward to its "
    "backward. Stage s never has more than pp - s in flight, however large m is; GPipe holds all m."))
def memory(ctx):
    for pp, m in _cases(ctx):
        schedule = _schedule(ctx, pp, m)
        try:
            peak = schedules.simulate(schedule, pp, m, 1.0, 1.0, 0.0).peak_in_flight
        except ScheduleError as e:
            raise Fail(f"pp={pp}, m={m}: the schedule cannot run ({e})") from None
        for s, held in enumerate(peak):
            if held > min(pp - s, m):
                why = ""
                if all(p == m for p in peak):
                    why = " — every stage holds all m, as GPipe does: its backwards wait for all the forwards"
                elif held == pp - s + 1:
                    why = " — one more than 1F1B: a warm-up forward too many"
                raise Fail(f"pp={pp}, m={m}: stage {s} holds {held} microbatches at once; at most "
                           f"{min(pp - s, m)}{why}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@EXERCISE.check("bubble_fraction", points=2, hint=(
    "Time the first microbatch takes to reach the last stage, and the last gradient to come back, is time "
    "the other stages idle: p-1 slots of F+B out of a makespan of (m + p - 1) slots. The bubble is the idle "
    "share of all stage-time, so it shrinks as m grows; 1F1B's equals GPipe's."))
def bubble(ctx):
    cases = []
    for pp, m in _cases(ctx):
        got = ctx.call("bubble_fraction", pp, m).value
        want = schedules.simulate(schedules.one_f_one_b(pp, m), pp, m, 1.0, 1.0, 0.0).bubble_fraction
        cases.append((pp, m, got, want))
    wrong = [(pp, m, got, want) for pp, m, got, want in cases if not (_number(got) and abs(got - want) <= 1e-9)]
    if not wrong:
        return
    # A known wrong formula is named when it gives every answer the learner gave, right and wrong alike.
    known = {" — that is the naive schedule's (p-1)/p, as if one microbatch ran at a time":
             lambda pp, m, want: (pp - 1) / pp,
             " — that is (p-1)/m, the bubble over the compute time alone; the share asked for is over all "
             "stage-time, the whole makespan of m + p - 1 slots": lambda pp, m, want: (pp - 1) / m,
             " — that is the busy share; the bubble is the idle share, 1 minus it": lambda pp, m, want: 1 - want,
             " — a percentage; return the fraction": lambda pp, m, want: 100 * want}
    named = [text for text, formula in known.items()
             if all(_number(got) and abs(got - formula(pp, m, want)) <= 1e-9 for pp, m, got, want in cases)]
    pp, m, got, want = wrong[0]
    raise Fail(f"bubble_fraction({pp}, {m}) = {got!r}; the simulated 1F1B idles {want:.6g}"
               f"{named[0] if len(named) == 1 else ''}")
