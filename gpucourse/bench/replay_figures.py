"""Figures of the modeled clock: how close the cost model is to published runs, whether a measured naive
pipeline idles as the formula says once waiting counts as idle, and how fast a replay is."""

from __future__ import annotations

import time

from ..config import TrainConfig
from ..train import run
from ..course.readings import Reading, figure


@figure("model_vs_published_max_error", target="<= 0.30", quick=dict(), full=dict())
def model_vs_published_max_error() -> Reading:
    """The largest relative error of the cost model over the published runs of gpucourse.modeled.published."""
    from ..modeled.published import compare

    rows = compare()
    worst = max(rows, key=lambda r: abs(r["error"]))
    return Reading(abs(worst["error"]), {r["name"]: {"reported": r["reported"], "modeled": r["predicted"],
                                                     "error": r["error"]} for r in rows},
                   f"worst: {worst['name']} ({worst['error']:+.1%})")


@figure("model_fit_max_error", target="<= 0.15", quick=dict(), full=dict())
def model_fit_max_error() -> Reading:
    """The largest relative error of the cost model over the fitting set of gpucourse.modeled.published (the runs its
    fitted constants were tuned on)."""
    return _split_reading("fit", "fit_max")


@figure("model_heldout_max_error", target="<= 0.20", quick=dict(), full=dict())
def model_heldout_max_error() -> Reading:
    """The largest relative error over the held-out set of gpucourse.modeled.published (never used to tune anything)."""
    return _split_reading("heldout", "heldout_max")


@figure("model_heldout_median_error", target="<= 0.08", quick=dict(), full=dict())
def model_heldout_median_error() -> Reading:
    """The median relative error over the held-out set of gpucourse.modeled.published."""
    return _split_reading("heldout", "heldout_median")


@figure("model_heldout_max_error_b200_fp8", target="<= 0.20", quick=dict(), full=dict())
def model_heldout_max_error_b200_fp8() -> Reading:
    """The largest relative error over the held-out B200 runs with fp8 matmuls of gpucourse.modeled.published (NVIDIA's
    NeMo and Megatron-Bridge tables), timed with B200's own efficiencies."""
    return _split_reading("heldout", "heldout_max_b200_fp8", lambda r: r["gpu"] == "b200" and r["fp8"])


def _split_reading(split: str, key: str, which=lambda r: True) -> Reading:
    from ..modeled.published import compare, errors

    rows = compare()
    value = errors(rows)[key]
    mine = [r for r in rows if r["split"] == split and which(r)]
    worst = max(mine, key=lambda r: abs(r["error"]))
    return Reading(value, {r["name"]: {"reported": r["reported"], "modeled": r["predicted"], "error": r["error"]}
                           for r in mine},
                   f"{len(mine)} runs; worst: {worst['name']} ({worst['error']:+.1%})")


@figure("planner_agrees_with_published", target=">= 0.8", quick=dict(), full=dict())
def planner_agrees_with_published() -> Reading:
    """The share of published runs whose source chose a layout at scale where `gpucourse plan` puts that layout
    first or within 5 % of its first (gpucourse.modeled.published.agreement)."""
    from ..modeled.published import agreement

    rows = agreement()
    share = sum(r["agrees"] for r in rows) / len(rows)
    return Reading(share, {r["name"]: {"chosen": r["chosen"], "first": r["first"], "ratio": r["ratio"]}
                           for r in rows},
                   f"{sum(r['agrees'] for r in rows)} of {len(rows)}; disagreeing: "
                   + ", ".join(f"{r['name']} ({r['ratio']:.2f}×)" for r in rows if not r["agrees"]))


@figure("naive_idle_measured_vs_formula", target="0.8..1.1", quick=dict(steps=4), full=dict(steps=10))
def naive_idle_measured_vs_formula(steps: int) -> Reading:
    """Measured idle share of a naive 4-stage pipeline (waiting counted as idle) over (p−1)/p."""
    from ..profiling import time_shares

    pp = 4
    result = run(TrainConfig(pp=pp, schedule="naive", microbatches=4, batch_size=8, seq_len=32, steps=steps),
                 timeout=600, quiet=True)
    shares = time_shares(result.timeline, list(range(1, steps)))
    idle = sum(s["idle"] for s in shares.values()) / pp
    formula = (pp - 1) / pp
    return Reading(idle / formula, {"measured_idle": idle, "formula": formula},
                   f"measured idle {idle:.3f}, (p-1)/p = {formula:.3f}")


@figure("replay_s_per_1k_ops", quick=dict(), full=dict())
def replay_s_per_1k_ops() -> Reading:
    """Seconds per 1000 ops of laying a 64-stage × 256-microbatch 1F1B schedule out on the clock."""
    from ..parallel.schedules import build, simulate

    schedule = build("1f1b", 64, 256)
    ops = sum(len(s) for s in schedule)
    start = time.perf_counter()
    simulate(schedule, 64, 256)
    seconds = time.perf_counter() - start
    return Reading(seconds / ops * 1e3, {"ops": ops, "seconds": seconds},
                   f"{ops} ops in {seconds:.2f} s (must stay under 1 s)")
