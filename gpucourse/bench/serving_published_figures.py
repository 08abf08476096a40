"""Figure of the serving model against published serving measurements (gpucourse.modeled.serve_published)."""

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
