"""Cheat ex05: takes the reference schedule out of the globals of a function the exercise lets it import."""

from gpucourse.parallel.schedules import Op, validate  # noqa: F401


def one_f_one_b(pp: int, m: int):
    return validate.__globals__["one_f_one_b"](pp, m)


def bubble_fraction(pp: int, m: int) -> float:
    return validate.__globals__["formula_bubble"]("1f1b", pp, m)
