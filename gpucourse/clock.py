"""One clock for work with dependencies: tasks on ranks, collectives that start together, messages that meet.

Both the pipeline simulator (:mod:`gpucourse.parallel.schedules`) and the replay of
a recorded run on a modeled cluster (:mod:`gpucourse.modeled.replay`) lay their work out
here. A :class:`Task` is something one rank does for a known number of seconds:

- it starts when every task in its ``deps`` has ended (on its own rank: the
  previous op of the same stream, the computation whose result a collective
  sends, the collective a computation waits for);
- tasks with the same ``match`` key are one collective (or one message: a send
  and its receive). None of them starts before all have arrived — whoever
  arrives first *waits*, and that wait is idle time, not communication — then
  they start together and each takes its own ``seconds``;
- ``eager``: a send that does not wait for its receive (a buffered ``isend``):
  it ends where it starts, and the data reach the receiver ``seconds`` later;
  the receive ends when it is posted and the data are there.

Tasks are given in each rank's issue order (the order the program called them).
A rank's tasks are visited in that order, and a task waits only for its ``deps``:
an asynchronous collective is issued and the rank goes on; what uses its result
lists it in ``deps``. Each task is visited once, so a million tasks take
seconds, not minutes. Work that can never start (two ranks each waiting for the
other) raises :class:`ClockError` naming where each rank is stuck.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass


class ClockError(ValueError):
    """The tasks cannot all run: some wait for each other (a deadlock) or for a task that does not exist.

    ``waiting``: for each rank that could not finish, the first of its tasks that never ended.
    """

    def __init__(self, message: str, waiting: dict[int, int] | None = None):
        super().__init__(message)
        self.waiting = waiting or {}


@dataclass(slots=True)
class Task:
    rank: int
    seconds: float
    deps: tuple[int, ...] = ()
    match: tuple | None = None      # same key: start together (a collective; a send and its receive)
    members: int = 1                # how many tasks share ``match``
    eager: bool = False             # a send that does not wait for its receive
    kind: str = ""
    name: str = ""
    data: dict | None = None        # anything the caller wants back with the task


@dataclass
class Layout:
    """Where each task ran: ``start[i]``, ``end[i]`` and ``ready[i]`` (when its deps had ended; for a collective,
    ``start - ready`` is the time it waited for the others)."""

    start: list[float]
    end: list[float]
    ready: list[float]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)


@contextlib.contextmanager
def no_gc_pauses():
    """Collect no garbage while many small objects are made (the collector's passes over them cost more than
    the work itself, and none of them is garbage yet)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@no_gc_pauses()
def run(tasks: list[Task]) -> Layout:
    """Lay ``tasks`` out on the clock (see the module docstring)."""
    n = len(tasks)
    start, end, ready = [0.0] * n, [None] * n, [0.0] * n
    by_rank: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        by_rank.setdefault(t.rank, []).append(i)
        for d in t.deps:
            if d >= i or d < 0:
                raise ClockError(f"task {i} ({t.kind} {t.name!r} on rank {t.rank}) depends on a later task.")
    pc = dict.fromkeys(by_rank, 0)
    arrived: dict[tuple, list[int]] = {}
    blocked: dict[int, list[int]] = {}   # task -> ranks waiting for it to end
    movable = list(by_rank)

    def finish(i: int, at: float) -> None:
        t = tasks[i]
        start[i], end[i] = at, at if t.eager else at + t.seconds
        if i in blocked:
            movable.extend(blocked.pop(i))

    while movable:
        r = movable.pop()
        order = by_rank[r]
        k = pc[r]
        while k < len(order):
            i = order[k]
            t = tasks[i]
            at, missing = 0.0, None
            for d in t.deps:
                e = end[d]
                if e is None:
                    missing = d
                    break
                if e > at:
                    at = e
            if missing is not None:
                blocked.setdefault(missing, []).append(r)
                break
            ready[i] = at
            k += 1
            if t.match is None:
                finish(i, at)
                continue
            group = arrived.setdefault(t.match, [])
            group.append(i)
            if t.eager:
                finish(i, at)  # the send is posted and the rank goes on
            if len(group) < t.members:
                continue
            del arrived[t.match]
            sends = [j for j in group if tasks[j].eager]
            if sends:  # a buffered message: the receive ends once posted and the data have come
                s = sends[0]
                for j in group:
                    if j != s:
                        finish(j, max(ready[j], ready[s] + tasks[s].seconds))
                continue
            together = max(ready[j] for j in group)
            for j in group:
                finish(j, together)
        pc[r] = k
    waiting = {r: next(i for i in order if end[i] is None) for r, order in by_rank.items()
               if any(end[i] is None for i in order)}
    if waiting:
        where = "; ".join(f"rank {r} waits in {tasks[i].kind} {tasks[i].name!r}" for r, i in waiting.items())
        raise ClockError(f"the tasks cannot all run: {where}.", waiting)
    return Layout(start, [float(e) for e in end], ready)
