"""A mixture of experts, seen: where the router sends tokens, and what expert parallelism's all-to-all moves.

Both figures read the router's counts a run records (``extras["moe"]``): token
choices per expert, per MoE block and step — summed over the ranks, and each
routing rank's own.
"""

from __future__ import annotations

import math

from .style import load_result, rank_color, step_ticks


def _moe(r) -> dict:
    moe = r.extras.get("moe")
    if not moe:
        raise ValueError("this run has no mixture of experts: train with moe_experts > 0 (--moe-experts E).")
    return moe


def imbalance(counts: list) -> float:
    """Most over mean tokens per expert: 1 is perfectly even; E when one expert gets them all."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 1.0


def expert_load(result, step: int | None = None, compare=None, names=("this run", "other")):
    """Tokens per expert in each MoE block at ``step`` (the last by default), and each block's imbalance
    (most / mean tokens per expert) over the steps; ``compare``: a second run drawn beside it (dashed)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    r = load_result(result)
    moe = _moe(r)
    steps = len(moe["tokens_per_expert"])
    step = steps - 1 if step is None else step
    counts = moe["tokens_per_expert"][step]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.12,
                        subplot_titles=(f"token choices per expert, step {step}",
                                        "imbalance: most / mean tokens per expert"))
    experts = len(counts[0])
    fig.add_trace(go.Heatmap(z=counts, x=[f"expert {e}" for e in range(experts)], y=moe["layers"],
                             colorscale="Blues", text=counts, texttemplate="%{text}", showscale=False,
                             hovertemplate="%{y}, %{x}: %{z} token choices<extra></extra>"), row=1, col=1)
    runs = [(r, names[0], "solid")]
    if compare is not None:
        runs.append((load_result(compare), names[1], "dash"))
    for run, name, dash in runs:
        m = _moe(run)
        for i, layer in enumerate(m["layers"]):
            fig.add_trace(go.Scatter(x=list(range(len(m["tokens_per_expert"]))),
                                     y=[imbalance(s[i]) for s in m["tokens_per_expert"]],
                                     mode="lines", name=f"{name}: {layer}", line=dict(color=rank_color(i), dash=dash)),
                          row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=2, **step_ticks(steps))
    fig.update_yaxes(title_text="most / mean", rangemode="tozero", row=1, col=2)
    dropped = sum(sum(s) for s in moe["dropped"])
    fig.update_layout(height=360, margin=dict(t=60),
                      title=f"the router: {experts} experts, {len(moe['layers'])} MoE blocks"
                            + (f"; {dropped} token choices dropped over the run (capacity)" if dropped else ""),
                      meta={"imbalance": [[imbalance(c) for c in s] for s in moe["tokens_per_expert"]]})
    return fig


def dispatch_matrix(counts_by_rank: list, ep: int) -> list[list[int]]:
    """``rows[i][j]``: token choices rank i sends to rank j's experts (rank j holds experts j·E/ep … (j+1)·E/ep−1)."""
    experts = len(counts_by_rank[0])
    per = experts // ep
    return [[sum(counts_by_rank[i][j * per:(j + 1) * per]) for j in range(ep)] for i in range(ep)]


def all_to_all(result, step: int | None = None, block: int = 0):
    """Expert parallelism's exchange in one MoE block from a real run's router counts, as frames: route (each
    rank's token choices per expert), counts (E numbers to every rank), dispatch (rows to the experts' ranks,
    lines as thick as the rows), compute (each rank's experts and what they received), combine (the rows back).

    Drawn for the first ep group; ``result``: a run with ep > 1.
    """
    import plotly.graph_objects as go

    r = load_result(result)
    moe = _moe(r)
    ep = r.config.get("ep", 1)
    if ep < 2:
        raise ValueError("all_to_all() draws an expert-parallel run (ep > 1); this one keeps every expert on "
                         "every rank.")
    step = len(moe["tokens_per_expert"]) - 1 if step is None else step
    counts = moe["tokens_by_rank"][step][block][:ep]  # the first ep routing ranks: one ep group
    experts = len(counts[0])
    per = experts // ep
    rows = dispatch_matrix(counts, ep)
    angle = [math.pi / 2 - 2 * math.pi * k / ep for k in range(ep)]
    xs, ys = [1.25 * math.cos(a) for a in angle], [1.25 * math.sin(a) for a in angle]
    most = max(max(row) for row in rows) or 1
    R = 0.36  # a rank's circle, in the figure's units

    def lines(kind: str) -> list:
        out = []
        for i in range(ep):
            for j in range(ep):
                # A rank's rows to itself never leave it: drawn as nothing. i → j sits a little to one side,
                # from the edge of one rank's circle to the edge of the other's.
                src, dst = (i, j) if kind != "combine" else (j, i)
                dx, dy = xs[dst] - xs[src], ys[dst] - ys[src]
                length = math.hypot(dx, dy) or 1.0
                ux, uy = dx / length, dy / length
                side = 0.08  # to the left of the direction of travel: the two directions lie apart
                n = rows[i][j]
                show = kind in ("dispatch", "combine", "counts") and i != j
                width = (1.5 if kind == "counts" else 1 + 10 * n / most) if show else 0.1
                label = f"{experts} counts" if kind == "counts" else f"{n} rows"
                ends = [(xs[src] + R * ux - side * uy, ys[src] + R * uy + side * ux),
                        (xs[dst] - R * ux - side * uy, ys[dst] - R * uy + side * ux)]
                out.append(go.Scatter(
                    x=[e[0] for e in ends], y=[e[1] for e in ends],
                    mode="lines+markers", opacity=1.0 if show else 0.0,
                    line=dict(width=width, color=rank_color(src)),
                    marker=dict(size=[0, 10 if show else 0], symbol="arrow", angleref="previous"),
                    hovertext=f"rank {src} → rank {dst}: {label}", hoverinfo="text", showlegend=False))
        return out

    def nodes(kind: str) -> go.Scatter:
        text = []
        for j in range(ep):
            mine = list(range(j * per, (j + 1) * per))
            if kind == "route":
                body = "<br>".join(f"e{e}: {counts[j][e]}" for e in range(experts))
            elif kind == "compute":
                got = [sum(counts[i][e] for i in range(ep)) for e in mine]
                body = "<br>".join(f"e{e} runs {g}" for e, g in zip(mine, got))
            else:
                body = f"sends {sum(rows[j]) - rows[j][j]}<br>keeps {rows[j][j]}" if kind != "counts" else \
                    f"learns {sum(rows[i][j] for i in range(ep))} rows<br>will arrive"
            text.append(f"<b>rank {j}</b> (e{mine[0]}–e{mine[-1]})<br>{body}")
        return go.Scatter(x=xs, y=ys, mode="markers+text", text=text, textposition="middle center",
                          marker=dict(size=118, color=[rank_color(j) for j in range(ep)], opacity=0.3),
                          hoverinfo="text", showlegend=False)

    kinds = ("route", "counts", "dispatch", "compute", "combine")
    frames = [go.Frame(data=[*lines(k), nodes(k)], name=k) for k in kinds]
    fig = go.Figure(data=frames[0].data, frames=frames)
    fig.update_layout(
        title=f"expert parallelism, {ep} ranks, {experts} experts: {moe['layers'][block]} at step {step}",
        xaxis=dict(visible=False, range=[-1.8, 1.8]), yaxis=dict(visible=False, range=[-1.75, 1.75], scaleanchor="x"),
        height=520, margin=dict(t=50),
        sliders=[dict(steps=[dict(method="animate", label=k, args=[[k], dict(mode="immediate")]) for k in kinds])],
        updatemenus=[dict(type="buttons", showactive=False, buttons=[dict(label="Play", method="animate",
                                                                          args=[None, dict(frame=dict(duration=1200))])])],
        meta={"rows": rows, "counts": counts})
    return fig
