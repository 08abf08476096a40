"""Collectives, step by step: a small pure simulation of the ring algorithms, its animation, and bandwidth curves.

:func:`simulate_collective` runs the ring algorithm on concrete numbers, one
rank per row and one chunk (1/n of the buffer) per column. Every step, all ranks
send at once:

- **reduce-scatter** (n-1 steps): rank r sends chunk ``r-k-1`` to rank r+1,
  which adds it to its own. After n-1 steps rank r holds the sum of chunk r.
- **all-gather** (n-1 steps): rank r sends chunk ``r-k`` (complete) to rank r+1,
  which keeps it. After n-1 steps every rank holds every chunk.
- **all-reduce** = reduce-scatter then all-gather: 2(n-1) steps, and each rank
  sends 2(n-1) chunks of 1/n of the buffer — the 2(n-1)/n of ``gpucourse.comm``.
- **broadcast**: the root's buffer flows down the ring as a pipeline, chunk
  after chunk; rank j of the chain forwards chunk c at step j + c (2n-2 steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from .style import PALETTE, load_json, rank_color, rank_label, size_label

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
ALGORITHMS = ("ring",)


@dataclass
class CollectiveSimulation:
    """A collective run step by step.

    - ``states[k][rank][chunk]``: the value each rank holds after step k (k = 0 is
      the start; None where the rank holds nothing yet).
    - ``contributors[k][rank][chunk]``: the ranks whose inputs that value sums.
    - ``transfers[k - 1]``: what step k moved, as ``(src, dst, chunk, value)``.
    - ``phases[k - 1]``: a sentence saying what step k does.
    - ``output[rank][chunk]``: whether that cell is part of the operation's result.
    - ``expected[rank][chunk]``: the result, computed directly (None outside it).
    """

    op: str
    world_size: int
    algorithm: str
    root: int
    states: list
    contributors: list
    transfers: list
    phases: list
    output: list
    expected: list


def default_data(world_size: int) -> list[list[float]]:
    """Rank r's input: chunk c holds ``10·(r+1) + c``, so each sum is easy to check by eye."""
    return [[10 * (r + 1) + c for c in range(world_size)] for r in range(world_size)]


def _expected(op: str, data, n: int, root: int):
    sums = [sum(data[r][c] for r in range(n)) for c in range(n)]
    if op == "all_reduce":
        return [list(sums) for _ in range(n)]
    if op == "reduce_scatter":
        return [[sums[c] if c == r else None for c in range(n)] for r in range(n)]
    if op == "all_gather":
        return [[data[c][c] for c in range(n)] for _ in range(n)]
    return [list(data[root]) for _ in range(n)]


def simulate_collective(op: str, world_size: int, algorithm: str = "ring", data=None,
                        root: int = 0) -> CollectiveSimulation:
    """Run ``op`` (all_reduce, reduce_scatter, all_gather, broadcast) on ``world_size`` ranks, step by step.

    ``data[rank][chunk]`` are the inputs (default :func:`default_data`). For
    all_gather, rank r's input is its chunk r; for broadcast, the root's row.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}.")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)} in this build.")
    n = world_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size={n!r} must be a whole number of at least 1.")
    if not 0 <= root < n:
        raise ValueError(f"root={root} must be a rank, 0 to {n - 1}.")
    data = default_data(n) if data is None else [list(row) for row in data]
    if len(data) != n or any(len(row) != n for row in data):
        raise ValueError(f"data must hold {n} rows (one per rank) of {n} chunks each.")

    if op in ("all_reduce", "reduce_scatter"):
        state = [list(row) for row in data]
        who = [[{r} for _ in range(n)] for r in range(n)]
    elif op == "all_gather":
        state = [[data[r][c] if c == r else None for c in range(n)] for r in range(n)]
        who = [[{r} if c == r else set() for c in range(n)] for r in range(n)]
    else:
        state = [list(data[r]) if r == root else [None] * n for r in range(n)]
        who = [[{r} if r == root else set() for _ in range(n)] for r in range(n)]

    plan: list[tuple[str, list[tuple[int, int, int]], bool]] = []  # (phase, sends, add?)
    if op in ("all_reduce", "reduce_scatter"):
        for k in range(n - 1):
            plan.append((f"reduce-scatter {k + 1}/{n - 1}: each rank sends a chunk to the next, which adds it", [(r, (r + 1) % n, (r - k - 1) % n) for r in range(n)], True))
    if op in ("all_reduce", "all_gather"):
        for k in range(n - 1):
            plan.append((f"all-gather {k + 1}/{n - 1}: each rank passes a finished chunk on; the next keeps it", [(r, (r + 1) % n, (r - k) % n) for r in range(n)], False))
    if op == "broadcast":
        chain = [(root + j) % n for j in range(n)]
        for t in range(2 * n - 2 if n > 1 else 0):
            sends = [(chain[j], chain[j + 1], t - j) for j in range(n - 1) if 0 <= t - j < n]
            plan.append((f"chunks flow down the ring from rank {root}; each rank forwards what it just got",
                         sends, False))

    states, contributors, transfers, phases = [_copy(state)], [_copy(who)], [], []
    for phase, sends, add in plan:
        moved = [(src, dst, c, state[src][c], set(who[src][c])) for src, dst, c in sends]
        for _, dst, c, value, origin in moved:  # every rank sends before any receives
            if add:
                state[dst][c] += value
                who[dst][c] |= origin
            else:
                state[dst][c] = value
                who[dst][c] = origin
        states.append(_copy(state))
        contributors.append(_copy(who))
        transfers.append([(src, dst, c, value) for src, dst, c, value, _ in moved])
        phases.append(phase)
    expected = _expected(op, data, n, root)
    output = [[v is not None for v in row] for row in expected]
    return CollectiveSimulation(op, n, algorithm, root, states, contributors, transfers, phases, output, expected)


def _copy(grid):
    return [[set(v) if isinstance(v, set) else v for v in row] for row in grid]


ARROW_X = 0.32  # arrows run beside the cells, not over their numbers


def _frame_traces(sim: CollectiveSimulation, k: int):
    import plotly.graph_objects as go

    n = sim.world_size
    state, who = sim.states[k], sim.contributors[k]
    xs, ys, text, colors, opacity, widths, custom = [], [], [], [], [], [], []
    for r in range(n):
        for c in range(n):
            value, origin = state[r][c], who[r][c]
            xs.append(c)
            ys.append(r)
            text.append("·" if value is None else f"{value:g}")
            if not origin:
                colors.append("#FFFFFF")
                opacity.append(1.0)
            elif len(origin) == 1:
                colors.append(rank_color(next(iter(origin))))
                opacity.append(0.55)
            else:  # a partial or full sum: darker the more ranks it holds
                colors.append(PALETTE["op"][sim.op])
                opacity.append(0.3 + 0.7 * len(origin) / n)
            widths.append(3 if sim.output[r][c] else 0.5)
            custom.append([r, c, "nothing yet" if not origin else
                           "sum of ranks " + ", ".join(map(str, sorted(origin))) if len(origin) > 1 else
                           f"from rank {next(iter(origin))}", "yes" if sim.output[r][c] else "no"])
    cells = go.Scatter(
        x=xs, y=ys, mode="markers+text", text=text, name="buffers", showlegend=False,
        textfont=dict(size=13, color="black"),
        marker=dict(symbol="square", size=44, color=colors, opacity=opacity, line=dict(width=widths, color="black")),
        customdata=custom,
        hovertemplate="rank %{customdata[0]}, chunk %{customdata[1]}: %{text}<br>%{customdata[2]}"
                      "<br>part of the result: %{customdata[3]}<extra></extra>")
    ax, ay, heads, hover = [], [], [], []
    for src, dst, c, value in (sim.transfers[k - 1] if k else []):
        x = c + ARROW_X
        what = f"rank {src} → rank {dst}: chunk {c} ({value:g})"
        # Round the ring: rank n-1 sends to rank 0 off the bottom edge, and it comes back in at the top.
        legs = [(src, dst)] if dst == src + 1 else [(src, n - 0.45), (-0.45, dst)]
        for a, b in legs:
            ax += [x, x, None]
            ay += [a, b, None]
            heads += [rank_color(src)] * 3
            hover += ["", what, ""]
    sizes = [0, 14, 0] * (len(ax) // 3)
    arrows = go.Scatter(
        x=ax, y=ay, mode="lines+markers", name="sent this step", showlegend=False, hovertext=hover, hoverinfo="text",
        line=dict(color=PALETTE["op"][sim.op], width=2),
        marker=dict(symbol="arrow", angleref="previous", size=sizes, color=heads))
    return [cells, arrows]


def collective(op: str = "all_reduce", world_size: int = 4, algorithm: str = "ring", data=None, root: int = 0):
    """Step-by-step frames of a collective: each rank's chunks, and the chunks moving round the ring.

    Press play or drag the slider. A cell is a chunk of a rank's buffer: its
    number is the value, its colour the rank it came from (or, for sums, darker
    the more ranks it holds); a thick border marks the cells that are the
    operation's result. The last frame holds the result.
    """
    import plotly.graph_objects as go

    sim = simulate_collective(op, world_size, algorithm, data, root)
    n = sim.world_size
    sent = sum(1 for step in sim.transfers for src, *_ in step if src == sim.root)
    name = op.replace("_", "-")
    head = f"Ring {name} on {n} rank{'s' * (n > 1)}"
    titles = [f"{head}: the start<br><sup>a thick border marks the cells that will hold the result</sup>"] + [
        f"{head}, step {k + 1} of {len(sim.phases)}<br><sup>{phase}</sup>" for k, phase in enumerate(sim.phases)]
    if n > 1:
        titles[-1] = (f"{head}: done<br><sup>rank {sim.root} sent {sent} chunk{'s' * (sent != 1)} of 1/{n} "
                      f"of its buffer; the thick cells hold the result</sup>")

    frames = [go.Frame(name=str(k), data=_frame_traces(sim, k), layout=dict(title_text=titles[k]))
              for k in range(len(sim.states))]
    fig = go.Figure(data=frames[0].data, frames=frames if len(frames) > 1 else None)
    fig.update_layout(
        title=titles[0], template="plotly_white", height=170 + 70 * n, width=max(640, 150 + 90 * n),
        xaxis=dict(title=f"chunk (1/{n} of each rank's buffer)", tickvals=list(range(n)), range=[-0.6, n - 0.2],
                   showgrid=False, zeroline=False),
        yaxis=dict(title="", tickvals=list(range(n)), ticktext=[rank_label(r) for r in range(n)],
                   range=[n - 0.4, -0.6], showgrid=False, zeroline=False),
        margin=dict(t=100))
    if len(frames) > 1:
        step_args = dict(mode="immediate", frame=dict(duration=0, redraw=True), transition=dict(duration=0))
        fig.update_layout(
            updatemenus=[dict(type="buttons", showactive=False, x=0.1, y=0, xanchor="right", yanchor="top",
                              pad=dict(t=75, r=10),
                              buttons=[dict(label="▶ play", method="animate",
                                            args=[None, dict(mode="immediate", fromcurrent=True,
                                                             frame=dict(duration=900, redraw=True),
                                                             transition=dict(duration=0))])])],
            sliders=[dict(active=0, x=0.1, len=0.9, y=0, yanchor="top", pad=dict(t=60),
                          currentvalue=dict(prefix="step "),
                          steps=[dict(label=f.name, method="animate", args=[[f.name], step_args]) for f in frames])],
            height=fig.layout.height + 80)
    fig.layout.meta = {"expected": sim.expected}
    return fig


def _rows(value) -> list[dict]:
    rows = load_json(value)
    if isinstance(rows, dict):
        rows = rows.get("rows", rows.get("bandwidth"))
    if not isinstance(rows, list) or not rows:
        raise ValueError("give bandwidth rows: a list of {op, bytes, algbw_GBps, busbw_GBps}, a dict holding "
                         "them under 'rows', or a JSON file of either.")
    missing = {"op", "bytes", "algbw_GBps", "busbw_GBps"} - set(rows[0])
    if missing:
        raise ValueError(f"bandwidth rows need {', '.join(sorted(missing))} too.")
    return rows


def bandwidth(rows, title: str | None = None):
    """Bus bandwidth (solid) and algorithm bandwidth (dotted) against message size, one colour per collective.

    ``rows``: ``[{op, bytes, algbw_GBps, busbw_GBps}, …]`` (as nccl-tests reports
    them: algbw = bytes / time, busbw = algbw × the ring factor, so it is
    comparable with the link's speed), a dict with them under ``rows``, or a JSON path.
    """
    import plotly.graph_objects as go

    rows = _rows(rows)
    fig = go.Figure()
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for op in ops:
        pts = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        color = PALETTE["op"].get(op, PALETTE["ideal"])
        sizes = [size_label(r["bytes"]) for r in pts]
        for key, dash, label in (("busbw_GBps", "solid", "bus"), ("algbw_GBps", "dot", "algorithm")):
            fig.add_trace(go.Scatter(
                x=[r["bytes"] for r in pts], y=[r[key] for r in pts], name=f"{op} ({label})", legendgroup=op,
                mode="lines+markers", line=dict(color=color, dash=dash), marker=dict(color=color, size=7),
                text=sizes, hovertemplate=f"{op}<br>%{{text}}<br>{label} bandwidth %{{y:.3f}} GB/s<extra></extra>"))
    sizes = sorted({r["bytes"] for r in rows})
    ticks = [s for i, s in enumerate(sizes) if i % max(1, len(sizes) // 8) == 0]
    fig.update_layout(
        template="plotly_white", height=460,
        title=title or "Bandwidth against message size: bus bandwidth (solid) is what the links carry",
        xaxis=dict(title="message size (bytes, log scale)", type="log", tickvals=ticks,
                   ticktext=[size_label(s) for s in ticks]),
        yaxis=dict(title="bandwidth (GB/s)", rangemode="tozero"))
    return fig
