"""Predict, then run: a learner's guess beside the formula's value and the run's, in the notebooks' Change cells.

Each Change cell asks for a number before it runs (bytes a collective sends, a rank's memory, the all-reduce
traffic of a step, a pipeline's bubble) and prints, after the run, the three side by side and whether the guess
came close enough to what was measured — within 5 % of it unless the cell states another tolerance::

    check_prediction("rank 0's model states", guess_box.value, formula_mib, measured_mib, "MiB")
    check_prediction("bubble", guess_box.value, 33.3, simulated, "%", tolerance=3,
                     against="simulated with the run's costs")
"""

from __future__ import annotations

NEAR = 0.05  # a prediction within 5 % of the measured value counts as right, unless a tolerance is given
WIDTH = 100  # a longer line is broken after the name of what was predicted (notebook output wraps past ~110)


def parse(typed: str) -> float | None:
    """The number a learner typed (thousands commas and a trailing % allowed), or None when the box is empty;
    ValueError if it is not a number."""
    text = typed.replace(",", "").strip().removesuffix("%").strip()
    return float(text) if text else None


def tolerance_text(tolerance: float | None, unit: str) -> str:
    """How close counts as right, in words: '5 %' (relative) or '±3 percentage points' / '±0.1 MiB'."""
    if tolerance is None:
        return f"{NEAR:.0%}".replace("%", " %")
    return f"±{tolerance:g} " + ("percentage points" if unit == "%" else unit)


def check_prediction(what: str, typed: str, formula: float, measured: float, unit: str, *,
                     tolerance: float | None = None, against: str = "measured in the run") -> bool | None:
    """Print the learner's prediction of ``what`` (typed in ``unit``; empty: none), the formula's value and the
    run's, side by side, and whether the prediction is close enough to the measured value (returned; None
    without one).

    Close enough is within 5 % of the measured value, or within ``tolerance`` of it (in ``unit``) when given.
    ``against`` names the measured value where it is not a plain measurement (a simulation with the run's
    costs, say).
    """
    try:
        guess = parse(typed)
    except ValueError:
        print(f"'{typed}' is not a number, so there is no prediction to compare.")
        guess = None
    values = {"your prediction": guess, "the formula": formula, against: measured}
    shown = " | ".join(f"{name} {v:,.4g} {unit}" for name, v in values.items() if v is not None)
    line = f"{what}: {shown}"
    print(line if len(line) <= WIDTH else f"{what}:\n  {shown}")
    if guess is None:
        print("Type your prediction before the next Run to see how close it comes.")
        return None
    limit = NEAR * abs(measured) if tolerance is None else tolerance
    near = abs(guess - measured) <= limit + 1e-12 * abs(measured)
    value = "the measured value" if against == "measured in the run" else f"the value {against}"
    print(f"Your prediction is {'within' if near else 'NOT within'} {tolerance_text(tolerance, unit)} of {value}.")
    return near
