"""What a laid-out pipeline schedule holds, counted from its timeline (shared by the tests of the notebooks' and the
bank's figures)."""

from __future__ import annotations

from gpucourse.parallel import schedules


def awaiting_b(sim: schedules.Simulation) -> list[int]:
    """Per rank, the most microbatches forwarded whose B (input gradient) has not run yet."""
    peaks = []
    for row in sim.timeline:
        held = peak = 0
        for op, _, _ in row:
            held += (op.kind == schedules.F) - (op.kind == schedules.B)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
