"""Figures of the serving model against published serving measurements (gpucourse.modeled.serve_published)."""

from __future__ import annotations

from ..course.readings import Reading, figure


@figure("serve_model_vs_published_max_error", target="<= 0.30", quick=dict(), full=dict())
def serve_model_vs_published_max_error() -> Reading:
    """The largest relative error of the modeled decode and prefill (gpucourse.modeled.serve_plan) over the published
    serving measurements of Llama-class models, GPT-J and Mixtral on A100, H100 and H200 in
    gpucourse.modeled.serve_published; the details list each row's setting, published and modeled value (modeled)."""
    from ..modeled.serve_published import compare, errors

    rows = compare()
    e = errors(rows)
    detail = {r["name"]: {"setting": r["setting"], "split": r["split"], "metric": r["metric"],
                          "published": r["reported"], "modeled": r["modeled"], "error": r["error"],
                          "source": r["url"]} for r in rows}
    return Reading(e["max"], detail, f"modeled; worst: {e['worst']} "
                                     f"({next(r['error'] for r in rows if r['name'] == e['worst']):+.1%}), "
                                     f"held-out median {e['heldout_median']:.1%} over {len(rows)} rows")


@figure("serve_model_heldout_median_error", target="<= 0.10", quick=dict(), full=dict())
def serve_model_heldout_median_error() -> Reading:
    """The median relative error of the serving model over the held-out rows of gpucourse.modeled.serve_published
    (never used to tune anything)."""
    return _split_reading("heldout", "heldout_median")


@figure("serve_model_heldout_max_error", target="<= 0.30", quick=dict(), full=dict())
def serve_model_heldout_max_error() -> Reading:
    """The largest relative error of the serving model over the held-out rows of gpucourse.modeled.serve_published."""
    return _split_reading("heldout", "heldout_max")


@figure("serve_model_fit_max_error", quick=dict(), full=dict())
def serve_model_fit_max_error() -> Reading:
    """The largest relative error of the serving model over the fitting rows of gpucourse.modeled.serve_published
    (the rows serve_plan's constants were fitted on)."""
    return _split_reading("fit", "fit_max")


def _split_reading(split: str, key: str) -> Reading:
    from ..modeled.serve_published import compare, errors

    rows = compare()
    mine = [r for r in rows if r["split"] == split]
    worst = max(mine, key=lambda r: abs(r["error"]))
    return Reading(errors(rows)[key], {r["name"]: {"setting": r["setting"], "published": r["reported"],
                                                   "modeled": r["modeled"], "error": r["error"]} for r in mine},
                   f"modeled; {len(mine)} {split} rows; worst: {worst['name']} ({worst['error']:+.1%})")
