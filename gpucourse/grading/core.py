"""What an exercise's checks are made of: an :class:`Exercise`, its :class:`Check`s, and :class:`Fail`.

An exercise is one learner module (``exercises/ex03_gradient_buckets.py``) and
a checks module of the same name in ``gpucourse/grading/checks/``, which makes
one ``EXERCISE`` and registers its checks with a decorator::

    EXERCISE = Exercise("ex03_gradient_buckets", "Gradient buckets", "notebooks/02_data_parallelism.ipynb")

    @EXERCISE.check("buckets follow gradient-ready order", points=2, hint="...")
    def ready_order(ctx):
        buckets = ctx.load().assign_buckets(model, cap)
        if buckets != expected:
            raise Fail("the first bucket holds ...")

A check with ``world_size=n`` runs on n gloo ranks (every rank calls it; it
passes when it passes on all of them); without one it runs once, in the
exercise's own process. A check says what it saw by raising :class:`Fail`; any
other exception comes from the learner's code and is reported as such.
Adding an exercise is dropping in those two modules (and the solved one in
``solutions/``): :func:`exercises` finds every ``exNN_*`` checks module.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import types
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch


class Fail(Exception):
    """A wrong answer: the message says what the check saw (not how to fix it: that is the hint)."""


class ForbiddenCall(BaseException):
    """The learner called something the exercise forbids.

    A BaseException, so that ``except Exception`` in learner code does not hide it.
    """


@dataclass(frozen=True)
class Check:
    """One graded property: ``name``, ``points``, a ``hint`` that teaches, and the function that checks it."""

    name: str
    points: int
    hint: str
    fn: Callable[["CheckContext"], None]
    world_size: int | None = None  # None: once, in the exercise's process; n: on n gloo ranks


@dataclass
class Exercise:
    """A learner module (``module``.py) and the checks that grade it."""

    module: str          # "ex01_ring_allreduce": the file name without .py
    title: str
    notebook: str        # the notebook that teaches it
    checks: list[Check] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.module[:4]

    @property
    def max_score(self) -> int:
        return sum(c.points for c in self.checks)

    def check(self, name: str, *, points: int, hint: str, world_size: int | None = None):
        """Register the decorated function as a check of this exercise (in the order written)."""
        def register(fn):
            if any(c.name == name for c in self.checks):
                raise ValueError(f"{self.module} has two checks called {name!r}")
            self.checks.append(Check(name, points, hint, fn, world_size))
            return fn
        return register

    def by_name(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)


@dataclass
class CheckContext:
    """What a check function gets: the learner's file, the run's seed, and who this rank is."""

    exercise: Exercise
    check: Check
    path: str
    seed: int
    rank: int = 0
    world_size: int = 1

    def load(self) -> types.ModuleType:
        """Import the learner's file afresh (so a check sees no state another check left).

        Compiled from source, so no ``__pycache__`` appears in the learner's folder.
        """
        with open(self.path, encoding="utf-8") as f:
            source = f.read()
        module = types.ModuleType(self.exercise.module)
        module.__file__ = self.path
        sys.modules[self.exercise.module] = module  # dataclasses and pickling look modules up here
        exec(compile(source, self.path, "exec"), module.__dict__)
        return module

    def generator(self, *key) -> torch.Generator:
        """A torch RNG seeded from the run's seed, this check and ``key``: every rank can rebuild any rank's inputs."""
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, self.check.name, *key))
        return g


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
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ (first at index {at}: "
            f"got {g[tuple(idx)].item():.6g}, expected {w[tuple(idx)].item():.6g})")


def expect_close(what: str, got, want: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Raise :class:`Fail` unless ``got`` equals ``want`` to tolerance."""
    problem = describe_mismatch(what, got, want, atol, rtol)
    if problem:
        raise Fail(problem)


def exercises() -> dict[str, Exercise]:
    """Every exercise the grader knows, by id ("ex01"), in order."""
    from . import checks

    found = {}
    for info in sorted(pkgutil.iter_modules(checks.__path__), key=lambda m: m.name):
        if re.fullmatch(r"ex\d\d_\w+", info.name):
            ex = importlib.import_module(f"{checks.__name__}.{info.name}").EXERCISE
            found[ex.id] = ex
    return found


def find_exercise(key: str) -> Exercise:
    """The exercise named by ``key``: "ex03", "3", "03" or "ex03_gradient_buckets"; KeyError if none."""
    known = exercises()
    k = key.strip().lower().removesuffix(".py")
    if k.isdigit():
        k = f"ex{int(k):02d}"
    for ex in known.values():
        if k in (ex.id, ex.module):
            return ex
    raise KeyError(f"no exercise called {key!r}; there are {', '.join(known)}")


_DIST_HOMES = ("torch.distributed", "torch.distributed.distributed_c10d")


class replaced_dist:
    """Within this ``with`` block, ``torch.distributed.<name>`` is ``fn`` (for each name, fn in ``replacements``).

    Load the learner's module inside the block, so that ``from torch.distributed
    import all_reduce`` binds the replacement too.
    """

    def __init__(self, replacements: dict[str, Callable]):
        self.replacements = replacements
        self.saved: list = []

    def __enter__(self):
        for home in _DIST_HOMES:
            module = sys.modules[home] if home in sys.modules else importlib.import_module(home)
            for name, fn in self.replacements.items():
                if hasattr(module, name):
                    self.saved.append((module, name, getattr(module, name)))
                    setattr(module, name, fn)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self.saved):
            setattr(module, name, original)
        self.saved.clear()
