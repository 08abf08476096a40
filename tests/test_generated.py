"""The grader's generated cases (gpucourse.grading.generated): every value of every knob drawn whatever the seed,
the same cases for the same seed, a failing case shrunk to its smallest, results compared at their dtype's own
precision and types held exactly. Pure functions: no sandbox, no ranks. (Plain arguments held unchanged are
tests/test_contracts.py's.)"""

from __future__ import annotations

import types

import pytest
import torch

from gpucourse.grading import generated
from gpucourse.grading.core import Fail
from gpucourse.grading.generated import DTYPES, Int, Many, One, Shape, Space

SPACE = Space(dtype=One(DTYPES), shape=Shape(), n=Int(0, 9), items=Many(Int(1, 5), 0, 3),
              container=One(("list", "tuple", "generator")))


@pytest.mark.parametrize("seed", range(20))
def test_each_value_of_each_knob_is_drawn_whatever_the_seed(seed):
    cases = SPACE.draw(seed, 5)
    assert {c["dtype"] for c in cases} == set(DTYPES)
    assert {c["container"] for c in cases} == {"list", "tuple", "generator"}
    assert {Shape._kind(c["shape"]) for c in cases} == set(generated.SHAPE_KINDS)
    assert {0, 9} <= {c["n"] for c in cases} and {0, 3} <= {len(c["items"]) for c in cases}
    assert cases == SPACE.draw(seed, 5)  # a grade can be reproduced


def test_a_failing_case_is_shrunk_to_the_smallest_that_still_fails():
    # Fails for a float64 tensor of at least 3 elements, whatever else the case holds.
    def prop(case):
        t = generated.tensor(case, case["shape"], case["dtype"])
        return "too precise" if t.dtype == torch.float64 and t.numel() >= 3 else None

    big = {"dtype": torch.float64, "shape": (7, 5), "n": 9, "items": [5, 4, 3], "container": "generator", "seed": 1}
    case, problem = generated.shrink(SPACE, big, prop, prop(big))
    assert problem == "too precise"
    assert case == {"dtype": torch.float64, "shape": (3,), "n": 0, "items": [], "container": "list", "seed": 1}

    ctx = types.SimpleNamespace(seed=3, check=types.SimpleNamespace(name="a property"))
    with pytest.raises(Fail, match=r"too precise \(the smallest case found that fails: float64 \(3,\)\)"):
        generated.for_all(ctx, SPACE, prop, count=6, describe=lambda c: f"{generated.name(c['dtype'])} {c['shape']}")
    generated.for_all(ctx, SPACE, lambda case: None, count=6, describe=str)


def test_float64_is_compared_at_float64_precision_and_the_dtype_exactly():
    want = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) / 3
    assert generated.mismatch("x", want.clone(), want) is None
    assert "float64's tolerance" in generated.mismatch("x", want.float().double(), want)  # went through float32
    assert generated.mismatch("x", want.float(), want) == "x is float32, expected float64"
    half = want.half()
    assert generated.mismatch("x", (half.float() + 1e-4).half(), half) is None  # fp16's own rounding
    assert generated.mismatch("x", torch.full((1,), float("nan")), torch.full((1,), float("nan"))) is None


def test_types_are_exact():
    assert generated.exactly("n", 4, int) is None
    assert generated.exactly("n", torch.tensor(4), int) == "n is a 0-d tensor, where an int is specified"
    assert "the bool True" in generated.exactly("n", True, int)


@pytest.mark.parametrize("seed", range(10))
def test_paired_knobs_take_every_combination_whatever_the_seed(seed):
    where = ("before", "after", "anywhere")
    space = Space(dtype=One(DTYPES), where=One(where), n=Int(0, 3), pairs=("dtype", "where"))
    cases = space.draw(seed, 12)
    assert {(c["dtype"], c["where"]) for c in cases} == {(d, w) for d in DTYPES for w in where}


def test_a_mismatch_shows_the_two_numbers_with_the_digits_that_tell_them_apart():
    """A float64 result computed in float32 differs in its eighth digit: the sentence must not read "got 0.0174646,
    expected 0.0174646"."""
    import torch

    from gpucourse.grading.core import apart, describe_mismatch
    from gpucourse.grading.generated import mismatch

    want = torch.tensor([0.01746463384], dtype=torch.float64)
    got = want.float().double() + 3e-10
    for sentence in (describe_mismatch("r", got, want, atol=0, rtol=1e-12), mismatch("r", got, want)):
        shown = sentence.split("got ")[1].split(", expected ")
        assert shown[0] != shown[1].split(",")[0].rstrip(")"), sentence
    assert apart(1.0, 2.0) == ("1", "2") and apart(0.5, 0.5) == ("0.5", "0.5")
