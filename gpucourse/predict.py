"""Predict, then run: a learner's guess beside the formula's value and the run's, in the notebooks' Change cells.

Each Change cell asks for a number before it runs (bytes a collective sends, a rank's memory, the all-reduce
traffic of a step) and prints, after the run, the three side by side and whether the guess came within 5 % of
what was measured::

    check_prediction("rank 0's model states", guess_box.value, formula_mib, measured_mib, "MiB")
"""

from __future__ import annotations

NEAR = 0.05  # a prediction within 5 % of the measured value counts as right


def parse(typed: str) -> float | None:
    """The number a learner typed (thousands commas allowed), or None when the box is empty; ValueError if it is
    not a number."""
    return float(typed.replace(",", "")) if typed.strip() else None


def check_prediction(what: str, typed: str, formula: float, measured: float, unit: str) -> bool | None:
    """Print the learner's prediction of ``what`` (typed in ``unit``; empty: none), the formula's value and the
    run's, side by side, and whether the prediction is within 5 % of the measured value (returned; None without
    one)."""
    try:
        guess = parse(typed)
    except ValueError:
        print(f"'{typed}' is not a number, so there is no prediction to compare.")
        guess = None
    values = {"your prediction": guess, "the formula": formula, "measured in the run": measured}
    print(f"{what}: " + " | ".join(f"{name} {v:,.4g} {unit}" for name, v in values.items() if v is not None))
    if guess is None:
        print("Type your prediction before the next Run to see how close it comes.")
        return None
    near = abs(guess - measured) <= NEAR * abs(measured)
    print(f"Your prediction is {'within' if near else 'NOT within'} 5 % of the measured value.")
    return near
