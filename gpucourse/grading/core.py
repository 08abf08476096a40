"""What an exercise's checks are made of: an :class:`Exercise`, its :class:`Check`s, and :class:`Fail`.

An exercise is one learner module (``exercises/ex03_gradient_buckets.py``) and
a checks module of the same name in ``gpucourse/grading/checks/``, which makes
one ``EXERCISE`` and registers its checks with a decorator::

    EXERCISE = Exercise("ex03_gradient_buckets", "Gradient buckets", "notebooks/02_data_parallelism.ipynb")

    @EXERCISE.check("buckets follow gradient-ready order", points=2, hint="...")
    def ready_order(ctx):
        got = ctx.call("assign_buckets", model, cap).value   # run in the sandbox; a copy comes back
        if got != expected:
            raise Fail("the first bucket holds ...")

The check itself runs in the grader's trusted process and holds the inputs
and the expected values; the learner's code runs only in the sandbox
(:mod:`gpucourse.grading.sandbox`). A check with ``world_size=n`` gets n gloo
ranks and hands each its own inputs (``ctx.call_all``, ``ctx.probe_all``);
without one it gets a single sandboxed process. A check says what it saw by
raising :class:`Fail`; an exception in the learner's code fails it with that
exception's sentence.
Adding an exercise is dropping in those two modules (and the solved one in
``solutions/``): :func:`exercises` finds every ``exNN_*`` checks module.
"""

from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .traffic import payloads, unexplained


class Fail(Exception):
    """A wrong answer: the message says what the check saw (not how to fix it: that is the hint)."""


@dataclass(frozen=True)
class Check:
    """One graded property: ``name``, ``points``, a ``hint`` that teaches, and the function that checks it."""

    name: str
    points: int
    hint: str
    fn: Callable[["CheckContext"], None]
    world_size: int | None = None  # None: on one sandboxed process; n: on n gloo ranks
    budget_s: float = 20.0         # seconds the learner's code may take in this check, on a quiet machine


@dataclass
class Exercise:
    """A learner module (``module``.py) and the checks that grade it."""

    module: str          # "ex01_ring_allreduce": the file name without .py
    title: str
    notebook: str        # the notebook that teaches it
    checks: list[Check] = field(default_factory=list)
    # What the sandbox refuses while this exercise's code runs: collectives (by
    # torch.distributed's name, however they are issued), dotted names of
    # library classes and functions, and modules (on top of the course's own).
    forbidden_collectives: tuple[str, ...] = ()
    forbidden_names: tuple[str, ...] = ()
    hidden_modules: tuple[str, ...] = ()
    refusal: str = "this exercise switches off {op}: write it yourself"
    # Modules its ranks import anyway (an optimizer's step imports torch._dynamo, a second and more of CPU): the
    # sandbox imports them once, before it forks a batch's ranks, instead of each rank paying (see sandbox.main).
    rank_imports: tuple[str, ...] = ()
    # The hint ladder's first two rungs (gpucourse.grading.report.LADDER): the idea the checks test, named without
    # the fix, and where the notebook teaches it. Each check's own hint is the last rung: the fix.
    concept: str = ""
    section: str = ""

    @property
    def id(self) -> str:
        return self.module[:4]

    @property
    def max_score(self) -> int:
        return sum(c.points for c in self.checks)

    def check(self, name: str, *, points: int, hint: str, world_size: int | None = None, budget_s: float = 20.0):
        """Register the decorated function as a check of this exercise (in the order written)."""
        def register(fn):
            if any(c.name == name for c in self.checks):
                raise ValueError(f"{self.module} has two checks called {name!r}")
            self.checks.append(Check(name, points, hint, fn, world_size, budget_s))
            return fn
        return register

    def by_name(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)


@dataclass
class Outcome:
    """What one rank's call returned: ``value``, the ``args`` as they were after it, and what it sent."""

    rank: int
    value: object
    args: tuple
    aliases: int | None   # the argument whose memory the value shares (an in-place answer)
    comm: list            # each collective, as the rank recorded it: {"op", "bytes", "group", "async", "t", "peer"?}
    time_s: float
    # What went between the ranks during the call, by the kernel's count (gpucourse.grading.traffic.Traffic; the
    # same for every rank's Outcome); None where it could not be counted (see CheckContext.wire).
    traffic: object = None


@dataclass
class CheckContext:
    """What a check function gets: the run's seed, how many ranks, and a way to run the learner's code.

    The check runs here, in the grader's own process; the learner's code runs
    only on the sandbox's ranks. :meth:`call_all` hands rank r its own
    arguments (tensors and plain data) and returns what each rank's call gave
    back; :meth:`probe_all` runs a function of the exercise's probe module
    (``gpucourse/grading/probes/<module>.py``), which drives the learner's code
    through a longer scenario and reports what it observed. A check never sees
    the learner's objects, only copies of what they returned.
    """

    exercise: Exercise
    check: Check
    path: str
    seed: int
    world_size: int = 1
    batch: object = None   # the ranks (gpucourse.grading.host.Batch)
    budget_s: float = 20.0

    def generator(self, *key) -> torch.Generator:
        """A torch RNG seeded from the run's seed, this check and ``key``."""
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, self.check.name, *key))
        return g

    def load(self) -> None:
        """Load the learner's file afresh on every rank (so a check sees no state another check left)."""
        self.batch.request([{"op": "load"}] * self.world_size, self.budget_s, self.path)

    def _run(self, op: str, name: str, args_per_rank, kwargs_per_rank) -> list:
        n = self.world_size
        args_per_rank = list(args_per_rank) if args_per_rank is not None else [()] * n
        kwargs_per_rank = list(kwargs_per_rank) if kwargs_per_rank is not None else [{}] * n
        if len(args_per_rank) != n or len(kwargs_per_rank) != n:
            raise ValueError(f"{self.check.name}: {n} ranks need {n} sets of arguments")
        replies = self.batch.request([{"op": op, "name": name, "args": tuple(a), "kwargs": k}
                                      for a, k in zip(args_per_rank, kwargs_per_rank)], self.budget_s, self.path,
                                     measure=n > 1)
        traffic = self.batch.traffic if n > 1 else None
        if isinstance(traffic, str):
            raise Fail(f"the grader could not count what the ranks sent each other during {name}, as it could "
                       f"before: {traffic}")
        outs = [Outcome(r, rep.get("value"), tuple(rep.get("args") or ()), rep.get("aliases"), rep.get("comm") or [],
                        float(rep.get("time_s") or 0.0), traffic) for r, rep in enumerate(replies)]
        if traffic is not None and self.exercise.forbidden_collectives:
            self._account(name, outs, traffic)
        return outs

    def _account(self, name: str, outs: list, traffic) -> None:
        """In an exercise that switches collectives off, every byte on the wire must be one the allowed operations
        the ranks called put there: a collective called below the dispatcher (a process group's backend object),
        which the ranks' recorder neither refuses nor sees, still shows in the kernel's count."""
        problem = unexplained(traffic, {o.rank: o.comm for o in outs})
        if problem:
            raise Fail(f"{problem}. {name} may communicate only as the exercise allows: a collective reached "
                       f"through a process group's backend object, or anything else torch.distributed does not see, "
                       f"is still communication, and the kernel counts it")

    def wire(self, outs: list) -> tuple[object, str]:
        """The kernel's count of what went between the ranks in the call that gave ``outs``, and ``""``; or, where
        the counters cannot be read, None and a note for a check's message saying that its verdict rests on the
        ranks' own records (the grade carries a warning line too)."""
        traffic = outs[0].traffic if outs else None
        if traffic is not None:
            return traffic, ""
        why = getattr(self.batch, "unmeasured", "") or "no counter was read"
        return None, f" (by the ranks' own records: the kernel's byte counters could not be read here — {why})"

    def payloads(self, outs: list) -> tuple[dict[tuple[int, int], int], str]:
        """The bytes of data each rank sent each other rank in the call that gave ``outs`` (``{(rank, peer):
        bytes}``, pairs that carried none left out), and the note of :meth:`wire`.

        By the kernel's count, with gloo's framing taken off, in an exercise whose calls :meth:`_account` has
        held to the operations the ranks recorded; by those records (their sends and all-to-alls) where the
        counters cannot be read."""
        counted, note = self.wire(outs)
        records = {o.rank: o.comm for o in outs}
        if counted is not None:
            return payloads(counted, records), note
        data: dict[tuple[int, int], int] = {}
        for r, recs in records.items():
            for c in recs:
                to = {c.get("peer"): c["bytes"]} if c["op"] == "send" else c.get("to") or {}
                for s, n in to.items():
                    if s != r and n:
                        data[(r, s)] = data.get((r, s), 0) + n
        return data, note

    def call_all(self, name: str, args_per_rank=None, kwargs_per_rank=None) -> list:
        """``learner.name(*args_per_rank[r], **kwargs_per_rank[r])`` on every rank r at once; their Outcomes."""
        return self._run("call", name, args_per_rank, kwargs_per_rank)

    def call(self, name: str, *args, **kwargs):
        """``learner.name(*args, **kwargs)`` on the one rank of a local check; its Outcome."""
        return self._run("call", name, [args], [kwargs])[0]

    def probe_all(self, name: str, args_per_rank=None, kwargs_per_rank=None) -> list:
        """``probes.<module>.name(learner, *args_per_rank[r], ...)`` on every rank r at once; their Outcomes."""
        return self._run("probe", name, args_per_rank, kwargs_per_rank)

    def probe(self, name: str, *args, **kwargs):
        """The probe ``name`` on the one rank of a local check; its Outcome."""
        return self._run("probe", name, [args], [kwargs])[0]


def derive_seed(seed: int, *key) -> int:
    return zlib.crc32(repr((seed,) + key).encode()) & 0x7FFFFFFF


def describe_mismatch(what: str, got, want: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> str | None:
    """None if ``got`` is a tensor equal to ``want`` (to tolerance), else a sentence saying how it differs."""
    if not torch.is_tensor(got):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    g, w = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol)
    if not bad.any():
        return None
    idx = bad.nonzero()[0].tolist()
    at = idx[0] if len(idx) == 1 else tuple(idx)
    got_s, want_s = apart(g[tuple(idx)].item(), w[tuple(idx)].item())
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ (first at index {at}: "
            f"got {got_s}, expected {want_s})")


def apart(got: float, want: float, digits: int = 6) -> tuple[str, str]:
    """The two numbers with as many significant digits as tell them apart (``digits`` at least): a float64 result
    computed in float32 differs in its eighth digit, and "got 0.0174646, expected 0.0174646" says nothing."""
    for n in range(digits, 18):
        shown = f"{got:.{n}g}", f"{want:.{n}g}"
        if shown[0] != shown[1]:
            break
    return shown


def expect_close(what: str, got, want: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Raise :class:`Fail` unless ``got`` equals ``want`` to tolerance."""
    problem = describe_mismatch(what, got, want, atol, rtol)
    if problem:
        raise Fail(problem)


def exercises() -> dict[str, Exercise]:
    """Every exercise the grader knows, by id ("ex01"), in order."""
    from . import catalog, checks

    return {ex_id: importlib.import_module(f"{checks.__name__}.{module}").EXERCISE
            for ex_id, module in catalog.modules().items()}


def find_exercise(key: str) -> Exercise:
    """The exercise named by ``key``: "ex03", "3", "03" or "ex03_gradient_buckets"; KeyError if none."""
    from . import catalog, checks

    return importlib.import_module(f"{checks.__name__}.{catalog.resolve(key)[1]}").EXERCISE
