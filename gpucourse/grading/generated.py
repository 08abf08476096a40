"""Cases drawn, not listed: the grader's own seeded generators, comparison at each dtype's precision, a shrinker.

A check that lists its cases tests the mistakes its author thought of. A check that draws them states a property
("the gradients come back divided by the scale") and tries it on cases drawn over everything the exercise allows:
dtypes, shapes (0-d, one element, odd sizes, empty), containers (a list, a tuple, a generator, several parameter
groups), hyper-parameters, zeros, several backwards; views with other strides are the contracts' to make
(``contracts.call(..., strided=True)``). A check declares the space of its cases as knobs, each with its values
from the simplest on::

    SPACE = Space(dtype=One(DTYPES), shape=Shape(), container=One(("list", "tuple", "generator")), n=Int(0, 4))

    @EXERCISE.check(...)
    def divides(ctx):
        for_all(ctx, SPACE, lambda case: problem_or_none(ctx, case), count=12)

:func:`for_all` draws ``count`` cases from a seed derived from the grader's (so every learner graded under one
seed gets the same cases, and a grade can be reproduced), runs the property on each, and on the first that fails
shrinks it — each knob in turn set to a simpler value while the property still fails — and fails the check with the
property's sentence and the smallest case found, in words. So that no verdict depends on the seed, each value of
every :class:`One` (and each kind of :class:`Shape`) is taken by at least one of the ``count`` cases whatever the
seed; the seed decides only how they combine and the numbers in the tensors.

No third-party generator: hypothesis is a development dependency, and the grader runs where the course does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from .core import Fail, apart, derive_seed

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # the simplest first

# (atol, rtol) against a reference computed in float64 and rounded to the result's dtype: a few units in the last
# place of each. float64 is held to float64's own rounding, so a computation that went through float32 fails it.
TOLERANCE = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2), torch.float32: (1e-5, 1e-5),
             torch.float64: (1e-12, 1e-10)}

# --- knobs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class One:
    """One of ``values``, the simplest first: drawn so that each is taken at least once in len(values) cases."""

    values: tuple

    def cover(self, rng: random.Random, count: int) -> list:
        order = list(self.values)
        rng.shuffle(order)
        return [order[i % len(order)] for i in range(count)]

    def simpler(self, value) -> list:
        return [v for v in self.values[:self.values.index(value)]] if value in self.values else []


@dataclass(frozen=True)
class Int:
    """A whole number from ``lo`` to ``hi``: both ends are drawn, then numbers between; it shrinks towards lo."""

    lo: int
    hi: int

    def cover(self, rng: random.Random, count: int) -> list:
        ends = [self.lo, self.hi]
        rng.shuffle(ends)
        return [ends[i] if i < 2 else rng.randint(self.lo, self.hi) for i in range(count)]

    def simpler(self, value: int) -> list:
        return list(dict.fromkeys(v for v in (self.lo, (self.lo + value) // 2, value - 1) if self.lo <= v < value))


SHAPE_KINDS = ("one", "odd", "matrix", "0-d", "empty")


@dataclass(frozen=True)
class Shape:
    """A tensor's shape of one of ``kinds``: "0-d" (), "one" (1,), "odd" (an odd length up to 9), "matrix" (two odd
    sides up to 7), "empty" (no element: (0,) or (0, odd)). Each kind is drawn at least once in len(kinds) cases;
    it shrinks towards fewer, then smaller, dimensions."""

    kinds: tuple = SHAPE_KINDS

    def cover(self, rng: random.Random, count: int) -> list:
        return [self._make(kind, rng) for kind in One(self.kinds).cover(rng, count)]

    @staticmethod
    def _make(kind: str, rng: random.Random) -> tuple:
        odd = lambda top: rng.randrange(3, top + 1, 2)  # noqa: E731
        return {"0-d": (), "one": (1,), "odd": (odd(9),), "matrix": (odd(7), odd(5)),
                "empty": rng.choice([(0,), (0, odd(5))])}[kind]

    def simpler(self, value: tuple) -> list:
        found = []
        if len(value) > 1:
            found.append(value[1:])
        found += [value[:i] + (s,) + value[i + 1:] for i, n in enumerate(value) for s in (1, n // 2, n - 1)
                  if 0 < s < n]
        return [s for s in dict.fromkeys(found) if self._kind(s) in self.kinds]

    @staticmethod
    def _kind(shape: tuple) -> str:
        if not shape:
            return "0-d"
        if 0 in shape:
            return "empty"
        return "one" if shape == (1,) else "odd" if len(shape) == 1 else "matrix"


@dataclass(frozen=True)
class Many:
    """A list of ``lo`` to ``hi`` values of ``knob`` (its length covered as :class:`Int`'s is); it shrinks to
    shorter lists, then simpler items."""

    knob: object
    lo: int
    hi: int

    def cover(self, rng: random.Random, count: int) -> list:
        lengths = Int(self.lo, self.hi).cover(rng, count)
        items = self.knob.cover(rng, max(1, sum(lengths)))
        out, at = [], 0
        for n in lengths:
            out.append(items[at:at + n])
            at += n
        return out

    def simpler(self, value: list) -> list:
        found = [value[:i] + value[i + 1:] for i in range(len(value))] if len(value) > self.lo else []
        return found + [value[:i] + [s] + value[i + 1:] for i, v in enumerate(value) for s in self.knob.simpler(v)]


class Space:
    """The cases of a property: a knob per name (:class:`One`, :class:`Int`, :class:`Shape`, :class:`Many`).

    A case is a dict of the knobs' values plus ``"seed"``, the seed of its tensors' numbers (kept while it
    shrinks, so that a smaller case holds numbers drawn the same way). ``pairs`` names two :class:`One` knobs
    whose values are drawn together, every combination of them in as many cases (a mistake that shows only in
    fp16 on a row that sees no key is then found whatever the seed)."""

    def __init__(self, pairs: tuple[str, str] | None = None, **knobs):
        self.knobs, self.pairs = knobs, pairs

    def draw(self, seed: int, count: int) -> list[dict]:
        """``count`` cases from ``seed``: each value of each knob's cover in at least one of them."""
        rng = random.Random(seed)
        columns = {name: knob.cover(rng, count) for name, knob in self.knobs.items()}
        if self.pairs:
            a, b = self.pairs
            both = [(x, y) for x in self.knobs[a].values for y in self.knobs[b].values]
            rng.shuffle(both)
            columns[a], columns[b] = ([both[i % len(both)][j] for i in range(count)] for j in (0, 1))
        return [{**{name: col[i] for name, col in columns.items()}, "seed": rng.randrange(2**31)}
                for i in range(count)]

    def simpler(self, case: dict) -> list[dict]:
        """Cases one step simpler than ``case``: one knob at a time, in the order the knobs were declared."""
        return [{**case, name: v} for name, knob in self.knobs.items() for v in knob.simpler(case[name])]


def shrink(space: Space, case: dict, fails: Callable[[dict], str | None], problem: str,
           tries: int = 40) -> tuple[dict, str]:
    """The simplest case found that still fails, and its problem: greedily, the first simpler case that fails
    replaces the case, until none does or ``tries`` cases have been run."""
    progress = True
    while progress and tries > 0:
        progress = False
        for smaller in space.simpler(case):
            if tries <= 0:
                break
            tries -= 1
            found = fails(smaller)
            if found:
                case, problem, progress = smaller, found, True
                break
    return case, problem


def for_all(ctx, space: Space, prop: Callable[[dict], str | None], count: int,
            describe: Callable[[dict], str]) -> None:
    """Hold ``prop`` on ``count`` cases drawn from ``space`` (seeded from the grader's seed and this check);
    ``prop(case)`` returns None or a sentence saying what went wrong. Fail on the first case that goes wrong,
    shrunk, saying what it was in words (``describe(case)``)."""
    seed = derive_seed(ctx.seed, ctx.check.name, "generated")
    for case in space.draw(seed, count):
        problem = _run(prop, case)
        if problem:
            case, problem = shrink(space, case, lambda c: _run(prop, c), problem)
            raise Fail(f"{problem} (the smallest case found that fails: {describe(case)})")


def failure(check: Callable, *args) -> str | None:
    """What ``check(*args)`` raised as :class:`Fail`, or None: a check's own steps as a property of a case."""
    try:
        check(*args)
    except Fail as e:
        return str(e)
    return None


def _run(prop, case: dict) -> str | None:
    """``prop(case)``; a :class:`Fail`, or an error the learner's code raised on this case (the sandbox's
    sentence), as the sentence to shrink. An exercise not written yet is said as such, not shrunk."""
    try:
        return prop(case)
    except Fail as e:
        return str(e)
    except Exception as e:
        if getattr(e, "sentence", None) is None or getattr(e, "exc_type", "") == "NotImplementedError":
            raise
        return e.sentence


# --- what a case is made of ----------------------------------------------------------------------------------


def generator(case: dict, *key) -> torch.Generator:
    """A torch RNG for the numbers of ``case`` (and ``key``, to draw several tensors apart)."""
    return torch.Generator().manual_seed(derive_seed(case["seed"], *key))


def tensor(case: dict, shape: tuple, dtype: torch.dtype, *key, scale: float = 1.0) -> torch.Tensor:
    """Normal numbers times ``scale`` of ``shape``, drawn in float64 and rounded to ``dtype``."""
    return (torch.randn(shape, generator=generator(case, *key), dtype=torch.float64) * scale).to(dtype)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_words(shape: tuple) -> str:
    """A shape as a learner reads it: "0-d", "1 element", "7", "3×5", "empty (0×3)"."""
    if not shape:
        return "0-d"
    text = "×".join(map(str, shape))
    return f"empty ({text})" if 0 in shape else text


# --- comparison ----------------------------------------------------------------------------------------------


def mismatch(what: str, got, want: torch.Tensor) -> str | None:
    """None if ``got`` is a tensor of exactly ``want``'s dtype and shape whose values equal ``want``'s to that
    dtype's tolerance (:data:`TOLERANCE`; NaN where NaN, infinities where they are), else a sentence."""
    if not torch.is_tensor(got):
        return f"{what} is {kind(got)}, not a tensor"
    if got.dtype != want.dtype:
        return f"{what} is {name(got.dtype)}, expected {name(want.dtype)}"
    if got.shape != want.shape:
        return f"{what} has shape {shape_words(tuple(got.shape))}, expected {shape_words(tuple(want.shape))}"
    atol, rtol = TOLERANCE.get(want.dtype, (0.0, 0.0))
    g, w = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True)
    if not bad.any():
        return None
    at = bad.nonzero()[0].tolist()
    got_s, want_s = apart(g[tuple(at)].item(), w[tuple(at)].item(), 10)
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ (first at index {tuple(at) or '()'}: got "
            f"{got_s}, expected {want_s}, to {name(want.dtype)}'s tolerance {rtol:g})")


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """Of two float dtypes, the one with the looser tolerance (float16 of float16 and float64)."""
    return max((a, b), key=lambda d: TOLERANCE.get(d, (0.0, 0.0))[1])


def exactly(what: str, got, *types: type) -> str | None:
    """None if ``got``'s type is one of ``types`` itself (not a subclass: True is no int; nor a 0-d tensor, which
    ``== 4`` calls equal to 4), else a sentence."""
    if type(got) in types:
        return None
    names = [("an " if t.__name__[0] in "aeiou" else "a ") + t.__name__ for t in types]
    return f"{what} is {kind(got)}, where {' or '.join(names)} is specified"


def kind(value) -> str:
    """What ``value`` is, in words: "a 0-d tensor", "the float 2.0", "a list of 3"."""
    if torch.is_tensor(value):
        return "a 0-d tensor" if value.dim() == 0 else f"a tensor of shape {shape_words(tuple(value.shape))}"
    if isinstance(value, dict) and "__type__" in value:
        return f"a {value['__type__']}"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return f"the {type(value).__name__} {value!r}" if value is not None else "None"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
