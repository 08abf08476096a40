"""Pipeline schedules as data: what each stage does, in order, and what that costs.

A pipeline cuts the model into ``pp`` stages, one per rank, and the batch into
``m`` microbatches. A *schedule* says, for every stage, the order of its
operations; it is a plain list the engine in ``pipeline.py`` executes one op at
a time, and that :func:`simulate` can lay out on a clock for any ``pp`` and
``m`` — far past what one machine can run.

An :class:`Op` is a kind and a microbatch. Stage ``s`` talks only to its
neighbours, so the kind names the peer too:

    F i       forward of microbatch i     B i       backward of microbatch i
    RECV_F i  activation from s-1         SEND_F i  activation to s+1
    RECV_B i  output gradient from s+1    SEND_B i  input gradient to s-1

**Sends block.** A send and its receive are one *rendezvous*: whichever side
arrives first waits for the other, then both take ``cost_comm``. That is the
safe rule for real hardware (gloo's send of a large tensor waits for the
receiver) and it makes deadlock visible: two neighbours that each wait in a send
to the other never finish. :func:`validate` simulates exactly that and names
where a schedule gets stuck. It is why 1F1B below takes the next stage's
gradient *before* handing it the next activation — the order the next stage
wants them in. (Megatron-LM fuses the two into one ``send_forward_recv_backward``
so it never has to choose.)

The three schedules, with equal costs F = B and free communication:

    naive   one microbatch at a time through all stages and back:
            only one stage is ever busy, bubble (p-1)/p
    gpipe   all forwards, then all backwards: bubble (p-1)/(m+p-1), but every
            stage holds the activations of all m microbatches
    1f1b    p-s-1 warm-up forwards, then one forward / one backward in turn:
            the same bubble as GPipe, while stage s holds at most p-s microbatches

The bubble fraction is the share of all stage-time not spent computing,
``1 - sum(busy) / (pp × makespan)``: waiting, and transferring when that costs.
In GPipe and 1F1B each stage idles while the first microbatch reaches it and
while the last gradient comes back — (p-1)(F+B) — out of a makespan of
(m+p-1)(F+B); that holds for any F and B as long as every stage costs the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import clock
from ..clock import Task
from ..readable import Readable

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
KINDS = (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)
COMPUTE = (F, B, W)
# Each communication op: which neighbour it talks to (+1 next, -1 previous), and the op it pairs with there.
PEER = {SEND_F: +1, RECV_F: -1, SEND_B: -1, RECV_B: +1}
PARTNER = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}


class Op(NamedTuple):
    """One step of a stage: ``kind`` (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B) on ``microbatch``.

    ``chunk``: which of the rank's model chunks (0 unless the schedule gives each
    rank several, see ``schedules_virtual.py``). ``W`` is a weight gradient, for
    schedules that split the backward in two. A named tuple: immutable, compared
    by value, and cheap to make by the million.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(Readable, ValueError):
    """A schedule that cannot run; the message says which stage and op, and why."""


# A stage's forward and backward of one microbatch, with the communication around
# them. Each stage receives before it computes and sends after.
def _forward(stage: int, pp: int, i: int) -> list[Op]:
    return ([Op(RECV_F, i)] if stage > 0 else []) + [Op(F, i)] + ([Op(SEND_F, i)] if stage < pp - 1 else [])


def _backward(stage: int, pp: int, i: int) -> list[Op]:
    return ([Op(RECV_B, i)] if stage < pp - 1 else []) + [Op(B, i)] + ([Op(SEND_B, i)] if stage > 0 else [])


def naive(pp: int, m: int) -> list[list[Op]]:
    """Microbatch after microbatch, each all the way forward and back before the next starts."""
    return [[op for i in range(m) for op in _forward(s, pp, i) + _backward(s, pp, i)] for s in range(pp)]


def gpipe(pp: int, m: int) -> list[list[Op]]:
    """GPipe: every stage runs all m forwards, then all m backwards (in the same order)."""
    return [[op for i in range(m) for op in _forward(s, pp, i)] + [op for i in range(m) for op in _backward(s, pp, i)]
            for s in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Op]]:
    """1F1B (PipeDream-Flush): warm up, then alternate one forward and one backward, then drain.

    Stage s runs ``w = min(pp - s - 1, m)`` warm-up forwards: just enough to fill
    the pipeline, so that the last stage starts each backward right after its
    forward and every gradient finds its stage ready for it. Then stage s
    alternates forward of microbatch w + k with backward of k — never more than
    w + 1 microbatches in flight, the activations of ``pp - s`` at most instead
    of GPipe's m — and finishes with the w backwards still owed.
    """
    schedule = []
    for s in range(pp):
        w = min(pp - s - 1, m)
        ops = [op for i in range(w) for op in _forward(s, pp, i)]
        for k in range(m - w):
            fwd, bwd = _forward(s, pp, w + k), _backward(s, pp, k)
            if s < pp - 1:
                # fwd ends in SEND_F(w+k) and bwd starts with RECV_B(k). Stage s+1 sends
                # gradient k before it asks for activation w+k, so receive first: sending
                # first would leave both stages blocked in a send to each other.
                fwd, bwd = fwd[:-1] + [bwd[0], fwd[-1]], bwd[1:]
            ops += fwd + bwd
        ops += [op for k in range(m - w, m) for op in _backward(s, pp, k)]
        schedule.append(ops)
    return schedule


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def build(name: str, pp: int, m: int) -> list[list[Op]]:
    """The schedule called ``name`` for ``pp`` stages and ``m`` microbatches."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}.")
    if pp < 1 or m < 1:
        raise ScheduleError(f"pp={pp} and microbatches={m} must both be at least 1.")
    return SCHEDULES[name](pp, m)


@dataclass
class Simulation:
    """A schedule laid out on a clock.

    - ``timeline[s]``: stage s's ops as ``(op, start, end)``; a communication op
      starts when both sides have reached it.
    - ``makespan``: when the last stage finishes.
    - ``busy[s]`` / ``comm[s]`` / ``idle[s]``: time stage s computes (F, B, W), transfers,
      and waits; the three add up to ``makespan``.
    - ``bubble_fraction``: ``(sum(idle) + sum(comm)) / (pp × makespan)``, the share
      of stage-time not spent computing — idle over *total* time, the (p−1)/(m+p−1)
      of GPipe and 1F1B.
    - ``bubble_ratio``: the same idle time over the *compute* time,
      ``(sum(idle) + sum(comm)) / sum(busy)`` — Megatron-LM's definition, (p−1)/m
      for GPipe and 1F1B, (p−1)/(v·m) interleaved. The two say the same thing:
      ratio = fraction / (1 − fraction).
    - ``peak_in_flight[s]``: most microbatches forwarded but not yet backwarded on
      stage s — how many microbatches' activations it holds at once (a chunk's
      microbatch counts as one; with W ops, held until its W).
    """

    timeline: list[list[tuple[Op, float, float]]]
    makespan: float
    busy: list[float]
    comm: list[float]
    idle: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    bubble_ratio: float = 0.0


def per_stage_costs(cost, pp: int, name: str) -> list[float]:
    costs = [float(cost)] * pp if isinstance(cost, (int, float)) else [float(c) for c in cost]
    if len(costs) != pp or any(c < 0 for c in costs):
        raise ScheduleError(f"{name} must be one non-negative number or one per stage ({pp}).")
    return costs


def simulate(schedule: list[list[Op]], pp: int, m: int, cost_f=1.0, cost_b=2.0, cost_comm=0.0,
             op_costs=None) -> Simulation:
    """Run ``schedule`` on a clock: compute ops take their cost, each send/recv pair is a rendezvous.

    ``cost_f`` and ``cost_b`` are one number or one per stage; ``cost_comm`` is the
    time one transfer takes. ``op_costs`` (see :func:`run_clock`) gives each compute
    op its own time instead. Raises :class:`ScheduleError` if the schedule is
    malformed or deadlocks. Each op is visited once: 64 stages × 256
    microbatches take under a second.
    """
    _check_ops(schedule, pp, m)
    return run_clock(schedule, pp, per_stage_costs(cost_f, pp, "cost_f"), per_stage_costs(cost_b, pp, "cost_b"),
                     float(cost_comm), op_costs=op_costs)


def _neighbour(s: int, op: Op) -> tuple[int, Op]:
    """The stage a communication op talks to, and the op it pairs with there (one chunk per stage)."""
    return s + PEER[op.kind], Op(PARTNER[op.kind], op.microbatch, op.chunk)


@clock.no_gc_pauses()  # many small tasks are made here, none of them garbage yet
def run_clock(schedule, pp: int, cost_f: list[float], cost_b: list[float], cost_comm: float,
              cost_w: list[float] | None = None, route=_neighbour, share: float = 1.0,
              async_sends: bool = False, op_costs: list[list[float]] | None = None) -> Simulation:
    """Lay ``schedule`` out on a clock. ``route(stage, op) -> (peer, partner op)`` pairs the transfers;
    each compute op costs ``share`` × its stage's cost (a chunk's share of the stage's blocks).

    ``op_costs``: instead, each stage's compute ops' own times, in the stage's order
    (a recorded run's ops, each as long as it took).

    ``async_sends``: a send is posted and the stage goes on (an ``isend``); its data
    reaches the receiver ``cost_comm`` later, and only a receive waits. Otherwise
    every send is a rendezvous with its receive.

    The clock is :mod:`gpucourse.clock`'s, the one a recorded run is replayed on: each
    stage is a rank whose ops run one after another, a send and its receive one match.
    """
    cost_w = cost_w or [0.0] * pp
    costs = {F: cost_f, B: cost_b, W: cost_w}
    if op_costs is not None and [len(c) for c in op_costs] != [sum(op.kind in COMPUTE for op in o) for o in schedule]:
        raise ScheduleError("op_costs must give every stage one time per compute op of its schedule.")
    tasks, ops_of, index_of = [], [], []    # the tasks, and each one's op and its place in its stage's list
    for s, ops in enumerate(schedule):
        own = iter(op_costs[s]) if op_costs is not None else None
        for k, op in enumerate(ops):
            after = (len(tasks) - 1,) if k else ()
            ops_of.append(op)
            index_of.append(k)
            if op.kind in COMPUTE:
                tasks.append(Task(s, next(own) if own is not None else share * costs[op.kind][s], after, kind=op.kind))
                continue
            peer, partner = route(s, op)
            sends = op.kind in (SEND_F, SEND_B)
            pair = (s, op, peer) if sends else (peer, partner, s)  # the same key on both sides
            seconds = 0.0 if async_sends and not sends else cost_comm
            tasks.append(Task(s, seconds, after, match=pair, members=2, eager=async_sends and sends, kind=op.kind))
    try:
        layout = clock.run(tasks)
    except clock.ClockError as e:
        where = "; ".join(f"stage {s} waits in op {index_of[i]} ({ops_of[i]})" for s, i in sorted(e.waiting.items()))
        raise ScheduleError(f"deadlock: {where}.") from None
    timeline: list[list] = [[] for _ in range(pp)]
    busy, comm = [0.0] * pp, [0.0] * pp
    in_flight, peak = [0] * pp, [0] * pp
    # Activations are freed by a microbatch's last use on that stage: its W where the backward is split.
    frees = [W if any(op.kind == W for op in ops) else B for ops in schedule]
    for i, t in enumerate(tasks):
        s, op = t.rank, ops_of[i]
        timeline[s].append((op, layout.start[i], layout.end[i]))
        if op.kind in COMPUTE:
            busy[s] += t.seconds
            in_flight[s] += 1 if op.kind == F else -1 if op.kind == frees[s] else 0
            peak[s] = max(peak[s], in_flight[s])
        elif not async_sends:
            comm[s] += t.seconds
    makespan = layout.makespan
    idle = [makespan - busy[s] - comm[s] for s in range(pp)]
    bubble = 1 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    ratio = (pp * makespan - sum(busy)) / sum(busy) if sum(busy) > 0 else 0.0
    return Simulation(timeline, makespan, busy, comm, idle, bubble, peak, ratio)


def _check_ops(schedule: list[list[Op]], pp: int, m: int) -> None:
    """The per-stage rules, without a clock (see :func:`validate`)."""
    if len(schedule) != pp:
        raise ScheduleError(f"the schedule has {len(schedule)} stages, not pp={pp}.")
    for s, ops in enumerate(schedule):
        # What must already have happened on this stage for an op to have its data.
        needs = {F: (RECV_F,) if s > 0 else (), SEND_F: (F,), RECV_B: (F,),
                 B: (F, RECV_B) if s < pp - 1 else (F,), SEND_B: (B,), RECV_F: (), W: (B,)}
        done: set[Op] = set()
        for n, op in enumerate(ops):
            if op.kind not in KINDS or not 0 <= op.microbatch < m:
                raise ScheduleError(f"stage {s}, op {n} ({op}): not an op of this schedule "
                                    f"(kinds {', '.join(KINDS)}, microbatches 0..{m - 1}).")
            if op.kind in PEER and not 0 <= s + PEER[op.kind] < pp:
                raise ScheduleError(f"stage {s}, op {n} ({op}): stage {s} has no neighbour there.")
            if op in done:
                raise ScheduleError(f"stage {s}, op {n} ({op}): done twice.")
            for need in needs[op.kind]:
                if Op(need, op.microbatch) not in done:
                    raise ScheduleError(f"stage {s}, op {n} ({op}): comes before {Op(need, op.microbatch)}.")
            done.add(op)
        for kind in (F, B, W) if any(op.kind == W for op in ops) else (F, B):
            missing = [i for i in range(m) if Op(kind, i) not in done]
            if missing:
                raise ScheduleError(f"stage {s} never runs {kind} of microbatch{'es' * (len(missing) > 1)} "
                                    f"{', '.join(map(str, missing[:5]))}{'…' if len(missing) > 5 else ''}.")


def validate(schedule: list[list[Op]], pp: int, m: int) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` can run on ``pp`` stages with ``m`` microbatches.

    Per stage: every microbatch is forwarded and backwarded exactly once, forward
    before backward, each op after what it needs (a forward after its
    activation arrived, a send after what it sends was computed), and there is no
    communication with a stage that does not exist. Between stages: each send
    meets its receive on the neighbour, in the same order; and, with every send
    blocking until its receive (a rendezvous), the whole schedule finishes — a
    deadlock is reported with the op each stuck stage waits in.
    """
    _check_ops(schedule, pp, m)
    for s in range(pp - 1):
        for send, recv, a, b in ((SEND_F, RECV_F, s, s + 1), (SEND_B, RECV_B, s + 1, s)):
            sent = [op.microbatch for op in schedule[a] if op.kind == send]
            got = [op.microbatch for op in schedule[b] if op.kind == recv]
            if sent != got:
                n = next((n for n, (x, y) in enumerate(zip(sent, got)) if x != y), min(len(sent), len(got)))
                says = [f"microbatch {seq[n]}" if n < len(seq) else "nothing" for seq in (sent, got)]
                raise ScheduleError(f"transfer {n} from stage {a} to stage {b} does not match: stage {a}'s "
                                    f"{send} sends {says[0]} but stage {b}'s {recv} expects {says[1]}.")
    run_clock(schedule, pp, [1.0] * pp, [1.0] * pp, 0.0)


def formula_bubble(name: str, pp: int, m: int) -> float:
    """The textbook bubble fraction (idle over total time) with equal stage costs and free communication."""
    return (pp - 1) / pp if name == "naive" else (pp - 1) / (m + pp - 1)


def formula_bubble_ratio(name: str, pp: int, m: int) -> float:
    """The same idle time over the compute time (Megatron-LM's definition): (p−1)/m for GPipe and 1F1B."""
    fraction = formula_bubble(name, pp, m)
    return fraction / (1 - fraction)


def gantt(sim: Simulation, max_cells: int = 160) -> str:
    """A text picture of a simulation: one row per stage, one cell per time unit.

    ``..`` is idle time and ``<>`` a transfer that costs time; an op that takes
    two units fills two cells. Costs should be whole numbers for the cells to
    line up. Past ``max_cells`` time units each row lists its F and B ops in
    order instead, the middle left out.
    """
    compute = [[(o, b, e) for o, b, e in row if o.kind in COMPUTE] for row in sim.timeline]
    cell = max([2] + [len(str(o)) for row in compute for o, _, _ in row])
    label = [f"stage {s:>{len(str(len(compute) - 1))}} | " for s in range(len(compute))]
    slots = round(sim.makespan)
    if slots > max_cells:
        def order(row):
            names = [str(o) for o, _, _ in row]
            return " ".join(names if len(names) <= 24 else names[:16] + ["…"] + names[-4:])
        return "\n".join(label[s] + order(row) for s, row in enumerate(compute))
    lines = []
    for s, row in enumerate(sim.timeline):
        cells = ["..".ljust(cell)] * slots
        for op, start, end in row:
            for t in range(round(start), round(end)):
                cells[t] = (str(op) if op.kind in COMPUTE else "<>").ljust(cell)
        lines.append(label[s] + " ".join(cells).rstrip())
    return "\n".join(lines)
