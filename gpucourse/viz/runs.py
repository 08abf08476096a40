"""Figures that put runs side by side: loss curves (the equality proof), memory per rank, scaling."""

from __future__ import annotations

from .style import (PALETTE, byte_unit, fit_title, human_bytes, load_json, load_result, rank_label, run_label,
                    series_color, step_ticks)

MEMORY_ORDER = ("weights", "gradients", "optimizer", "activations")


def _named_results(results, labels=None) -> list[tuple[str, object]]:
    """``[(label, RunResult)]`` from a list of results/paths or a dict ``{label: result}``."""
    if isinstance(results, dict):
        pairs = [(str(k), load_result(v)) for k, v in results.items()]
    else:
        loaded = [load_result(v) for v in results]
        pairs = list(zip(labels or [run_label(r) for r in loaded], loaded))
    if not pairs:
        raise ValueError("give at least one run.")
    names = [n for n, _ in pairs]
    # Two runs of the same layout (a rerun, another seed) still need two legend entries.
    return [(n if names.count(n) == 1 else f"{n} #{names[:i + 1].count(n)}", r) for i, (n, r) in enumerate(pairs)]


def loss_differences(baseline, other) -> list[float]:
    """``|loss - baseline loss|`` at each step the two runs share."""
    return [abs(a - b) for a, b in zip(other.losses, baseline.losses)]


def compare(results, labels=None, title: str | None = None):
    """Loss curves of several runs overlaid, above a panel of each one's distance from the first: the equality proof.

    ``results``: RunResults or JSON paths (the first is the baseline, usually
    the single-device run), or a dict ``{label: result}``. The lower panel is
    ``|loss − baseline loss|`` per step; its title names the largest difference.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    runs = _named_results(results, labels)
    (base_name, base), others = runs[0], runs[1:]
    diffs = {name: loss_differences(base, r) for name, r in others}
    largest = max((d for ds in diffs.values() for d in ds), default=0.0)
    relative = max((d / abs(b) for ds in diffs.values() for d, b in zip(ds, base.losses) if b), default=0.0)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.1,
                        subplot_titles=("training loss", f"distance from {base_name}: largest {largest:.3g} "
                                                         f"(relative {relative:.2g})"))
    for i, (name, r) in enumerate(runs):
        color = series_color(i)
        fig.add_trace(go.Scatter(
            x=list(range(len(r.losses))), y=r.losses, name=name, legendgroup=name, mode="lines+markers",
            line=dict(color=color, width=3 if i == 0 else 1.5, dash="solid" if i == 0 else "dot"),
            marker=dict(size=5, color=color),
            hovertemplate=f"{name}<br>step %{{x}}<br>loss %{{y:.7f}} nats<extra></extra>"), row=1, col=1)
        if i:
            fig.add_trace(go.Scatter(
                x=list(range(len(diffs[name]))), y=diffs[name], name=name, legendgroup=name, showlegend=False,
                mode="lines+markers", line=dict(color=color, width=1.5), marker=dict(size=5, color=color),
                hovertemplate=f"{name}<br>step %{{x}}<br>|Δ loss| %{{y:.3g}} nats<extra></extra>"), row=2, col=1)
    fig.update_yaxes(title_text="loss (nats)", row=1, col=1)
    fig.update_yaxes(title_text="|Δ loss| (nats)", exponentformat="e", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(step_ticks(max(len(r.losses) for _, r in runs)))
    fig.update_xaxes(title_text="optimizer step", row=2, col=1)
    fig.update_layout(template="plotly_white", height=620, hovermode="closest",
                      title=fit_title(title or f"{len(runs)} runs, one loss trajectory: largest difference "
                                               f"{largest:.3g} nats"))
    fig.layout.meta = {"max_difference": largest, "max_relative_difference": relative}
    return fig


def _is_estimate(value) -> bool:
    """A plain ``{category: bytes}`` or ``{rank: {...}}``, not a RunResult's dict."""
    return isinstance(value, dict) and "losses" not in value


def _per_rank(memory: dict, ranks=None) -> dict[str, dict]:
    """``{rank: {category: bytes}}`` from itself or from one ``{category: bytes}`` that every rank holds."""
    if memory and all(isinstance(v, (int, float)) for v in memory.values()):
        return {str(r): dict(memory) for r in (ranks or ["each"])}
    return {str(k): dict(v) for k, v in memory.items()}


def memory(measured=None, predicted=None, title: str | None = None):
    """Memory per rank as stacked bars by category (weights, gradients, optimizer state, activations…).

    ``measured``: a RunResult or JSON path (its ``memory``), or, with ``predicted``,
    ``{rank: {category: bytes}}`` measured another way (each rank's
    :func:`gpucourse.profiling.peak_memory`). ``predicted``: an
    estimate, ``{category: bytes}`` (the same on every rank) or
    ``{rank: {category: bytes}}`` (or a JSON file of one); drawn hatched beside
    the measured bar of each rank.
    Either alone works: ``memory(estimate)`` draws the estimate. A category whose
    name contains ``peak`` (the device's own peak) is a marker, not a block.
    """
    import plotly.graph_objects as go

    measured, predicted = load_json(measured), load_json(predicted)  # a path holds a RunResult or an estimate
    if predicted is None and _is_estimate(measured):
        measured, predicted = None, measured
    if measured is None and predicted is None:
        raise ValueError("give a run's result, an estimate, or both.")
    columns: dict[str, dict] = {}
    name = "estimate"
    if measured is not None and _is_estimate(measured):  # bytes per rank, measured without a run's record
        columns["measured"], name = _per_rank(measured), "measured"
    elif measured is not None:
        r = load_result(measured)
        if not r.memory:
            raise ValueError("this run recorded no memory.")
        columns["measured"] = _per_rank(r.memory)
        name = run_label(r)
    if predicted is not None:
        columns["predicted"] = _per_rank(predicted, list(columns["measured"]) if columns else None)
    ranks = sorted({k for c in columns.values() for k in c}, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0))
    cats = sorted({c for col in columns.values() for rank in col.values() for c in rank if "peak" not in c},
                  key=lambda c: (MEMORY_ORDER.index(c) if c in MEMORY_ORDER else len(MEMORY_ORDER), c))
    largest = max(sum(v for c, v in rank.items() if "peak" not in c) for col in columns.values()
                  for rank in col.values())
    peaks = [v for col in columns.values() for rank in col.values() for c, v in rank.items() if "peak" in c]
    # Memory in binary units, as every number the course prints: a bar of 2**20 bytes stands 1 MiB tall.
    scale, unit = byte_unit(max([largest] + peaks), binary=True)

    def size(n):
        return human_bytes(n, binary=True)

    def where(rank, source):
        return [rank_label(int(rank)) if rank.isdigit() else f"{rank} rank", source]

    fig = go.Figure()
    for cat in cats:
        cells = [(where(rank, source), source, col[rank][cat]) for source, col in columns.items() for rank in ranks
                 if rank in col and cat in col[rank]]
        fig.add_trace(go.Bar(
            x=[[c[0][0] for c in cells], [c[0][1] for c in cells]], y=[c[2] / scale for c in cells], name=cat,
            hovertext=[f"{c[0][0]}, {c[1]}<br>{cat}: {size(c[2])}" for c in cells], hoverinfo="text",
            marker=dict(color=PALETTE["memory"].get(cat, PALETTE["memory"]["other"]),
                        pattern=dict(shape=["/" if c[1] == "predicted" else "" for c in cells]))))
    for source, col in columns.items():
        pts = [(where(rank, source), c, v) for rank in ranks if rank in col for c, v in col[rank].items() if "peak" in c]
        if pts:
            fig.add_trace(go.Scatter(x=[[p[0][0] for p in pts], [p[0][1] for p in pts]], y=[p[2] / scale for p in pts],
                                     mode="markers", name=f"{source} device peak",
                                     marker=dict(symbol="line-ew-open", size=30, line=dict(width=3, color="black")),
                                     hovertext=[f"{p[0][0]}, {source}<br>{p[1]}: {size(p[2])}" for p in pts],
                                     hoverinfo="text"))
    fig.update_layout(barmode="stack", template="plotly_white", height=460,
                      title=fit_title(title or f"Memory per rank by category: {name}"
                                      + (" (measured beside predicted)" if len(columns) == 2 else "")),
                      yaxis=dict(title=f"memory ({unit})"), xaxis=dict(title="rank, source"))
    return fig


def _family(r) -> str:
    """Which scaling line a run belongs on: its layout kind (dp, zero1, tp, pp, dp×tp…) and impl."""
    from ..config import TrainConfig

    cfg = TrainConfig.from_dict(r.config)
    return f"{cfg.kind()} {cfg.impl}"


def scaling(results, title: str | None = None, on: str | None = None, gpus_per_node: int = 8):
    """Throughput and scaling efficiency against world size, with the ideal (linear) line.

    ``results``: RunResults or JSON paths. The baseline is the run on one rank
    (else the smallest): ideal throughput is its tokens/s × world size / its
    world size, efficiency is measured over ideal. Runs are grouped into lines by
    layout kind and impl; the baseline starts every line.

    ``on="h100"``: a second row, the same runs replayed on a modeled cluster of
    those GPUs (:func:`gpucourse.modeled.replay.replay`) — what the same work scales like
    where ranks do not share two cores.
    """
    from plotly.subplots import make_subplots

    runs = [load_result(v) for v in results]
    if not runs:
        raise ValueError("give at least one run.")
    rows = [("this machine", runs)]
    if on is not None:
        from ..modeled.replay import replay

        modeled = [replay(r, on=on, gpus_per_node=gpus_per_node) for r in runs]
        rows.append((f"modeled {on.upper()}, {gpus_per_node} per server", modeled))
    fig = make_subplots(rows=len(rows), cols=2, horizontal_spacing=0.12, vertical_spacing=0.2,
                        subplot_titles=[f"{what} ({where})" for where, _ in rows
                                        for what in ("throughput", "scaling efficiency (measured / ideal)")])
    for row, (_, these) in enumerate(rows, start=1):
        _scaling_row(fig, these, row, show_legend=row == 1)
    base = min(runs, key=lambda r: (r.world_size, r is not runs[0]))
    fig.update_layout(template="plotly_white", height=460 * len(rows),
                      title=fit_title(title or f"Scaling from {run_label(base)} ({base.tokens_per_s:,.0f} "
                                               f"tokens/s on {base.world_size} rank{'s' * (base.world_size > 1)}, "
                                               f"{base.device})"))
    return fig


def _scaling_row(fig, runs, row: int, show_legend: bool):
    """One row of :func:`scaling`: throughput and efficiency of ``runs`` against their smallest run."""
    import plotly.graph_objects as go

    base = min(runs, key=lambda r: (r.world_size, r is not runs[0]))
    per_rank = base.tokens_per_s / base.world_size
    worlds = sorted({r.world_size for r in runs})
    ideal_x = list(range(1, max(worlds) + 1)) if max(worlds) <= 64 else worlds
    fig.add_trace(go.Scatter(x=ideal_x, y=[per_rank * w for w in ideal_x], name="ideal (linear)", mode="lines",
                             line=dict(color=PALETTE["ideal"], dash="dash"), showlegend=show_legend,
                             legendgroup="ideal",
                             hovertemplate="ideal<br>%{x} ranks: %{y:,.0f} tokens/s<extra></extra>"), row=row, col=1)
    fig.add_trace(go.Scatter(x=[min(ideal_x), max(ideal_x)], y=[100, 100], name="ideal", showlegend=False,
                             mode="lines", line=dict(color=PALETTE["ideal"], dash="dash"), hoverinfo="skip"),
                  row=row, col=2)
    families: dict[str, list] = {}
    for r in runs:
        if r is not base:
            families.setdefault(_family(r), []).append(r)
    for i, (fam, members) in enumerate(families.items(), start=1):
        points = sorted([base] + members, key=lambda r: r.world_size)
        color = series_color(i)
        xs = [r.world_size for r in points]
        eff = [100 * r.tokens_per_s / (per_rank * r.world_size) for r in points]
        names = [run_label(r) for r in points]
        for col, ys, fmt in ((1, [r.tokens_per_s for r in points], "%{y:,.0f} tokens/s"), (2, eff, "%{y:.1f}%")):
            fig.add_trace(go.Scatter(x=xs, y=ys, name=fam, legendgroup=fam, showlegend=show_legend and col == 1,
                                     text=names, mode="lines+markers", line=dict(color=color),
                                     marker=dict(size=8, color=color),
                                     hovertemplate=f"%{{text}}<br>%{{x}} ranks: {fmt}<extra></extra>"),
                          row=row, col=col)
    for col in (1, 2):
        fig.update_xaxes(title_text="world size (ranks)", tickvals=worlds, row=row, col=col)
    fig.update_yaxes(title_text="throughput (tokens/s)", rangemode="tozero", row=row, col=1)
    fig.update_yaxes(title_text="efficiency (%)", rangemode="tozero", row=row, col=2)
    return base
