"""Gantt charts: what each rank did when (a measured run), and what a pipeline schedule would do (simulated).

One lane per rank (or stage), one horizontal bar per span, coloured by kind and
labelled with its microbatch. Time inside a step in which a rank recorded
nothing is *idle* and is shaded: in a pipeline that is the bubble.
"""

from __future__ import annotations

import statistics

from ..measure import waiting
from .style import PALETTE, fit_title, kind_color, load_result, rank_color, rank_label, run_label

LANE = 0.7          # height of a span bar, in lanes
STEP_LANE = 0.1     # the thin bar under each lane that marks a rank's whole step
RING_NODE_PX = 40  # a rank's circle in viz.ring, in pixels
RING_UNIT_PX = 100  # viz.ring's scale: pixels per unit of its ring's radius (at least 1)
KIND_ORDER = ("forward", "backward", "comm", "optimizer", "idle", "step")
OP_WORDS = {"F": "forward", "B": "backward", "W": "weight gradient", "SEND_F": "send activation",
            "RECV_F": "receive activation", "SEND_B": "send gradient", "RECV_B": "receive gradient"}


def gaps(intervals, start: float, end: float) -> list[tuple[float, float]]:
    """The parts of ``[start, end]`` that no interval ``(a, b)`` covers."""
    out, cursor = [], start
    for a, b in sorted(intervals):
        if a > cursor:
            out.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if cursor < end:
        out.append((cursor, end))
    return [(a, b) for a, b in out if b > a]


def step_windows(spans) -> list[tuple[float, float]]:
    """When the steps ran: each step from its first rank in to its last rank out, overlapping steps merged."""
    windows = []
    for step in sorted({s["step"] for s in spans}):
        in_step = [s for s in spans if s["step"] == step]
        marks = [s for s in in_step if s["kind"] == "step"] or in_step
        windows.append((min(s["start_s"] for s in marks), max(s["end_s"] for s in marks)))
    merged: list[list[float]] = []
    for a, b in sorted(windows):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def busy_parts(span) -> list[tuple[float, float]]:
    """A span's time, less the part in which its rank only waited for another rank (see measure.waiting)."""
    w = waiting(span)
    if w is None:
        return [(span["start_s"], span["end_s"])]
    return [(a, b) for a, b in ((span["start_s"], w[0]), (w[1], span["end_s"])) if b > a]


def idle_intervals(spans) -> tuple[dict[int, list[tuple[float, float]]], float]:
    """Per rank, the times inside the steps in which it recorded nothing or only waited for another rank;
    and the steps' total length.

    A pipeline stage may start its next step while another still finishes the
    last, so a rank counts as busy in any of its spans, whatever their step.
    """
    windows = step_windows(spans)
    idle = {}
    for rank in sorted({s["rank"] for s in spans}):
        busy = [part for s in spans if s["rank"] == rank and s["kind"] != "step" for part in busy_parts(s)]
        idle[rank] = [g for a, b in windows for g in gaps(busy, a, b)]
    return idle, sum(b - a for a, b in windows)


def rank_activity(result) -> dict[int, dict[str, float]]:
    """Seconds each rank spent in each kind of span over the training steps, and idle inside them.

    Spans that overlap (a bucket's all-reduce during backward) count in both
    kinds, so a rank's kinds can add up to more than its step time.
    """
    r = load_result(result)
    spans = [s for s in r.timeline if 0 <= s["step"] < len(r.losses)]
    idle, _ = idle_intervals(spans)
    out: dict[int, dict[str, float]] = {rank: {"idle": sum(b - a for a, b in gs)} for rank, gs in idle.items()}
    for s in spans:
        if s["kind"] != "step":
            totals = out[s["rank"]]
            totals[s["kind"]] = totals.get(s["kind"], 0.0) + s["end_s"] - s["start_s"]
    return out


def _idle_trace(rects, name: str, text: str):
    """Shaded rectangles ``(lane, start, end)`` as one filled scatter trace (no WebGL, one legend entry)."""
    import plotly.graph_objects as go

    xs, ys = [], []
    for lane, a, b in rects:
        lo, hi = lane - LANE / 2, lane + LANE / 2
        xs += [a, b, b, a, a, None]
        ys += [lo, lo, hi, hi, lo, None]
    color = PALETTE["kind"]["idle"]
    return go.Scatter(x=xs, y=ys, mode="lines", fill="toself", name=name, legendrank=KIND_ORDER.index("idle"),
                      line=dict(width=0.5, color=color), fillcolor=color, opacity=0.45,
                      hoveron="fills", text=text, hoverinfo="name+text")


def _lanes_layout(fig, labels: list[str], title: str, xtitle: str) -> None:
    fig.update_layout(
        title=fit_title(title), barmode="overlay", bargap=0, template="plotly_white",
        height=140 + 46 * len(labels), legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
        uniformtext=dict(minsize=8, mode="hide"), hoverlabel=dict(namelength=-1),
        xaxis=dict(title=xtitle, zeroline=False),
        yaxis=dict(title="", tickvals=list(range(len(labels))), ticktext=labels, autorange="reversed",
                   zeroline=False, showgrid=False),
    )


def timeline(result, steps=None, title: str | None = None, on: str | None = None, gpus_per_node: int = 8,
             nodes: int | None = None):
    """A per-rank Gantt chart of a run: forward, backward, communication, optimizer, and idle time shaded.

    ``result`` is a RunResult or its JSON file path. ``steps`` picks which
    optimizer steps to show (an int or a list; default: every span the run
    recorded, set-up included). Each recorded span is one bar; the thin grey
    bar under a lane is that rank's whole step, and shaded time is idle —
    including the part of a communication span in which the rank only waited
    for another rank.

    ``on="h100"`` (any GPU of :mod:`gpucourse.modeled.gpus`) also replays the run on a
    modeled cluster of those GPUs, ``gpus_per_node`` to a server
    (:func:`gpucourse.modeled.replay.replay`), and draws that timeline under the measured
    one, labelled as modeled.
    """
    if on is None:
        return _timeline(result, steps, title)
    from plotly.subplots import make_subplots

    from ..modeled.replay import replay

    r = load_result(result)
    modeled = replay(r, on=on, gpus_per_node=gpus_per_node, nodes=nodes)
    top, bottom = _timeline(r, steps, None), _timeline(modeled, steps, None)
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.16,
                        subplot_titles=(top.layout.title.text, fit_title("MODELED: " + bottom.layout.title.text)))
    for row, part in ((1, top), (2, bottom)):
        for trace in part.data:
            if row == 2:
                trace.showlegend = False
            fig.add_trace(trace, row=row, col=1)
        fig.update_yaxes(tickvals=part.layout.yaxis.tickvals, ticktext=part.layout.yaxis.ticktext,
                         autorange="reversed", showgrid=False, zeroline=False, row=row, col=1)
        fig.update_xaxes(title_text=part.layout.xaxis.title.text, zeroline=False, row=row, col=1)
    fig.update_layout(barmode="overlay", bargap=0, template="plotly_white", height=top.layout.height * 2 + 60,
                      legend=dict(orientation="h", yanchor="bottom", y=1.04, xanchor="right", x=1),
                      uniformtext=dict(minsize=8, mode="hide"), hoverlabel=dict(namelength=-1),
                      title=fit_title(title or f"{run_label(r)}: measured on this machine, and replayed on "
                                               f"{modeled.extras['modeled']['cluster']} (modeled)"))
    return fig


def _timeline(result, steps=None, title: str | None = None):
    import plotly.graph_objects as go

    r = load_result(result)
    if not r.timeline:
        raise ValueError("this run recorded no timeline (it ran with record=False); run it again with "
                         "record=True to draw one.")
    wanted = None if steps is None else {steps} if isinstance(steps, int) else set(steps)
    spans = [s for s in r.timeline if wanted is None or s["step"] in wanted]
    if not spans:
        raise ValueError(f"the run has no spans in steps {sorted(wanted)}; it ran steps 0 to {len(r.losses) - 1}.")
    t0 = min(s["start_s"] for s in spans)
    ranks = sorted({s["rank"] for s in spans})
    lane = {rank: i for i, rank in enumerate(ranks)}
    stage_of = r.extras.get("stage_of_rank", {})
    labels = [rank_label(rank) + (f" · stage {stage_of[str(rank)]}" if str(rank) in stage_of else "")
              for rank in ranks]

    fig = go.Figure()
    kinds = sorted({s["kind"] for s in spans},
                   key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER))
    for kind in kinds:
        # A communication bar shows the transfer; the time its rank only waited is drawn as idle below.
        group = [dict(s, start_s=waiting(s)[1]) if kind == "comm" and waiting(s) and waiting(s)[0] == s["start_s"]
                 else s for s in spans if s["kind"] == kind]
        step_bar = kind == "step"
        fig.add_trace(go.Bar(
            orientation="h", name=kind, legendrank=KIND_ORDER.index(kind) if kind in KIND_ORDER else 9,
            y=[lane[s["rank"]] for s in group],
            base=[(s["start_s"] - t0) * 1e3 for s in group],
            x=[(s["end_s"] - s["start_s"]) * 1e3 for s in group],
            width=STEP_LANE if step_bar else LANE, offset=LANE / 2 if step_bar else -LANE / 2,
            marker=dict(color=kind_color(kind), line=dict(width=0)),
            text=None if step_bar else ["" if s["microbatch"] is None else str(s["microbatch"]) for s in group],
            textposition="inside", insidetextanchor="middle", textangle=0, textfont=dict(color="white"),
            customdata=[[s["rank"], s["name"], "–" if s["microbatch"] is None else s["microbatch"], s["step"],
                         (s["end_s"] - s["start_s"]) * 1e3] for s in group],
            hovertemplate=("rank %{customdata[0]}<br>%{customdata[1]}<br>microbatch %{customdata[2]}"
                           "<br>step %{customdata[3]}<br>%{customdata[4]:.3f} ms, from %{base:.3f} ms"
                           f"<extra>{kind}</extra>"),
        ))

    # Idle: inside the steps (first rank in to last rank out), the times a rank recorded nothing.
    idle, window_total = idle_intervals(spans)
    rects = [(lane[rank], (a - t0) * 1e3, (b - t0) * 1e3) for rank, gs in idle.items() for a, b in gs]
    idle_ms = sum(b - a for _, a, b in rects)
    share = idle_ms / (len(ranks) * window_total * 1e3) if window_total else 0.0
    if rects:
        fig.add_trace(_idle_trace(rects, "idle", f"{share:.1%} of rank-time inside the steps shown"))

    shown = "all steps" if wanted is None else f"step{'s' * (len(wanted) > 1)} {', '.join(map(str, sorted(wanted)))}"
    unit, scale = ("µs", 1e3) if r.backend == "modeled" else ("ms", 1.0)
    if scale != 1.0:  # a modeled GPU step takes microseconds
        for trace in fig.data:
            if trace.type == "bar":
                trace.base = [b * scale for b in trace.base]
                trace.x = [x * scale for x in trace.x]
                trace.customdata = [[*c[:4], c[4] * scale] for c in trace.customdata]
                trace.hovertemplate = trace.hovertemplate.replace(" ms", " µs")
            else:
                trace.x = [None if x is None else x * scale for x in trace.x]
    _lanes_layout(fig, labels, title or f"Timeline of {run_label(r)} on {r.world_size} {r.device} rank"
                  f"{'s' * (r.world_size > 1)} ({shown}): idle {share:.1%}",
                  f"time since the first span shown ({unit})")
    return fig


def _measured_costs(r, pp: int):
    """Each stage's median forward and backward span, in ms, from a pipeline run's timeline."""
    stage_of = {int(k): v for k, v in r.extras.get("stage_of_rank", {}).items()} or {i: i for i in range(pp)}
    costs = {}
    for kind in ("forward", "backward"):
        per_stage = []
        for stage in range(pp):
            times = [(s["end_s"] - s["start_s"]) * 1e3 for s in r.timeline
                     if s["kind"] == kind and s["step"] >= 0 and stage_of.get(s["rank"]) == stage]
            if not times:
                raise ValueError(f"the run recorded no {kind} spans on stage {stage}; give cost_f and cost_b.")
            per_stage.append(statistics.median(times))
        costs[kind] = per_stage
    return costs["forward"], costs["backward"]


def _schedule_traces(sim, pp: int, unit: str):
    """Five traces — forward, backward (B), weight gradients (W), transfers, idle — always in that order, so
    frames can swap them. An op of a rank's second or later chunk is labelled microbatch.chunk."""
    import plotly.graph_objects as go

    traces = []
    for kind, ops in (("forward", ("F",)), ("backward", ("B",)), ("weight gradient", ("W",)),
                      ("comm", ("SEND_F", "RECV_F", "SEND_B", "RECV_B"))):
        rows = [(s, op, a, b) for s, row in enumerate(sim.timeline) for op, a, b in row
                if op.kind in ops and b > a]
        color = kind_color("optimizer") if kind == "weight gradient" else kind_color(kind)
        traces.append(go.Bar(
            orientation="h", name=kind, legendrank=KIND_ORDER.index("backward") + 0.5 if kind == "weight gradient"
            else KIND_ORDER.index(kind),
            y=[s for s, *_ in rows], base=[a for *_, a, _ in rows],
            x=[b - a for *_, a, b in rows], width=LANE, offset=-LANE / 2,
            marker=dict(color=color, line=dict(width=0.5, color="white")),
            text=[str(op)[1:] if op.chunk else str(op.microbatch) for _, op, _, _ in rows] if kind != "comm" else None,
            textposition="inside", insidetextanchor="middle", textangle=0, textfont=dict(color="white"),
            customdata=[[s, OP_WORDS[op.kind], f"{op.microbatch}" + (f", chunk {op.chunk}" if op.chunk else ""), b - a]
                        for s, op, a, b in rows],
            hovertemplate=("stage %{customdata[0]}<br>%{customdata[1]} of microbatch %{customdata[2]}"
                           "<br>%{customdata[3]:.3g} " + unit + ", from %{base:.3g}<extra>" + kind + "</extra>"),
        ))
    rects = [(s, a, b) for s, row in enumerate(sim.timeline)
             for a, b in gaps([(x, y) for _, x, y in row], 0.0, sim.makespan)]
    waiting = sum(sim.idle) / (pp * sim.makespan) if sim.makespan else 0.0
    text = f"waiting: {waiting:.1%} of stage-time" + (
        f"; with the transfers, the bubble is {sim.bubble_fraction:.1%}" if any(sim.comm) else "")
    traces.append(_idle_trace(rects, "idle (bubble)", text))
    return traces


def schedule(result=None, *, pp: int = 4, microbatches: int = 8, schedule: str = "1f1b",
             cost_f=None, cost_b=None, cost_comm: float = 0.0, slider: bool = True, virtual_stages: int = 2,
             cost_w=None):
    """A pipeline schedule laid out by the simulator (no processes), with a slider over the number of microbatches.

    Give ``pp``, ``microbatches`` and ``schedule`` (naive, gpipe, 1f1b, or
    interleaved-1f1b with ``virtual_stages``, zb-h1, zbv, dualpipev), or a pipeline run's
    RunResult (or JSON path): then its layout is used and, unless ``cost_f`` /
    ``cost_b`` are given, each stage's measured median forward and backward
    time in ms. Default costs: forward 1, backward 2 time units (split
    schedules: B 1 and W ``cost_w``, 1 by default). The slider replays the same
    schedule with 1 … ``microbatches`` microbatches (multiples of pp when
    interleaved): watch the shaded bubble shrink as (p-1)/(m+p-1).
    """
    from ..parallel.schedule_table import get

    if get(schedule).virtual:
        return _virtual_schedule(pp, microbatches, schedule, virtual_stages, cost_f, cost_b, cost_w, cost_comm,
                                 slider)
    return _schedule(result, pp, microbatches, schedule, cost_f, cost_b, cost_comm, slider)


def _virtual_schedule(pp, microbatches, name, v, cost_f, cost_b, cost_w, cost_comm, slider):
    """:func:`schedule` for the schedules of ``schedules_virtual.py`` (simulated only)."""
    import plotly.graph_objects as go

    from ..parallel import schedules_virtual
    from ..parallel.schedule_table import get

    record = get(name)
    split = record.split_backward
    cost_f = 1.0 if cost_f is None else cost_f
    cost_b = (1.0 if split else 2.0) if cost_b is None else cost_b
    cost_w = (1.0 if split else 0.0) if cost_w is None else cost_w
    step = pp if record.multiple_of_pp else 1
    least = record.least_microbatches(pp)  # DualPipeV fills both chunks of every rank: m ≥ 2p
    counts = [m for m in range(least, microbatches + 1, step)] if slider else [microbatches]
    if not counts:
        raise ValueError(f"{name} on {pp} ranks needs at least {least} microbatches, not {microbatches}.")
    if len(counts) > 16:
        counts = counts[:: -(-len(counts) // 16)] + ([counts[-1]] if counts[-1] % step == 0 else [])
    frames, sims = [], {}
    for m in dict.fromkeys(counts):
        ops, layout = schedules_virtual.build(name, pp, m, v)
        sim = schedules_virtual.simulate(ops, layout, m, cost_f, cost_b, cost_w, cost_comm)
        sims[m] = sim
        title = fit_title(f"{name}, {pp} ranks × {layout.v} chunk{'s' * (layout.v > 1)}, {m} microbatches: bubble "
                          f"{sim.bubble_fraction:.1%} of the time, {sim.bubble_ratio:.1%} of the compute")
        frames.append(go.Frame(name=str(m), data=_schedule_traces(sim, pp, "time units"),
                               layout=dict(title_text=title)))
    last = frames[-1]
    fig = go.Figure(data=last.data, frames=frames if len(frames) > 1 else None)
    _lanes_layout(fig, [rank_label(s) for s in range(pp)], last.layout.title.text,
                  f"time (time units: a rank's forward {cost_f}, B {cost_b}, W {cost_w}, transfer {cost_comm})")
    _microbatch_slider(fig, frames, sims)
    final = sims[list(sims)[-1]]
    fig.layout.meta = {"bubble_fraction": final.bubble_fraction, "bubble_ratio": final.bubble_ratio,
                       "makespan": final.makespan, "peak_in_flight": final.peak_in_flight}
    return fig


def _microbatch_slider(fig, frames: list, sims: dict) -> None:
    """The x range of the longest simulation, and (with several frames) a slider over the microbatch counts."""
    fig.update_xaxes(range=[0, max(s.makespan for s in sims.values()) * 1.02])
    if len(frames) > 1:
        fig.update_layout(sliders=[dict(
            active=len(frames) - 1, currentvalue=dict(prefix="microbatches m = "), pad=dict(t=60),
            steps=[dict(label=f.name, method="animate",
                        args=[[f.name], dict(mode="immediate", frame=dict(duration=0, redraw=True),
                                             transition=dict(duration=0))]) for f in frames])],
            height=fig.layout.height + 90)


def _schedule(result, pp, microbatches, schedule, cost_f, cost_b, cost_comm, slider):
    import plotly.graph_objects as go

    from ..parallel import schedules

    unit = "time units"
    if result is not None:
        r = load_result(result)
        pp, microbatches, schedule = r.config["pp"], r.config["microbatches"], r.config["schedule"]
        if cost_f is None and cost_b is None:
            cost_f, cost_b = _measured_costs(r, pp)
            unit = "ms"
    cost_f = 1.0 if cost_f is None else cost_f
    cost_b = 2.0 if cost_b is None else cost_b
    if schedule not in schedules.SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(schedules.SCHEDULES)}.")
    if pp < 1 or microbatches < 1:
        raise ValueError(f"pp={pp} and microbatches={microbatches} must both be at least 1.")
    if not slider or microbatches <= 16:
        counts = list(range(1, microbatches + 1)) if slider else [microbatches]
    else:  # at most 16 frames: a frame holds every op of every stage
        counts = sorted({max(1, round(microbatches * i / 15)) for i in range(16)} | {1, microbatches})

    frames, sims = [], {}
    for m in counts:
        sim = schedules.simulate(schedules.build(schedule, pp, m), pp, m, cost_f, cost_b, cost_comm)
        sims[m] = sim
        formula = schedules.formula_bubble(schedule, pp, m)
        title = fit_title(f"{schedule} schedule, {pp} stage{'s' * (pp > 1)}, {m} microbatch{'es' * (m > 1)}: "
                          f"bubble {sim.bubble_fraction:.1%} (equal-cost formula {formula:.1%})<br>"
                          f"peak microbatches held per stage: {' '.join(map(str, sim.peak_in_flight))}")
        frames.append(go.Frame(name=str(m), data=_schedule_traces(sim, pp, unit), layout=dict(title_text=title)))
    last = frames[-1]
    fig = go.Figure(data=last.data, frames=frames if len(frames) > 1 else None)
    costs = "" if unit == "ms" else f": forward {cost_f}, backward {cost_b}, transfer {cost_comm}"
    _lanes_layout(fig, [rank_label(s, "stage") for s in range(pp)], last.layout.title.text,
                  f"time ({unit}{costs})")
    _microbatch_slider(fig, frames, sims)
    fig.layout.meta = {"bubble_fraction": sims[counts[-1]].bubble_fraction, "makespan": sims[counts[-1]].makespan,
                       "bubble_ratio": sims[counts[-1]].bubble_ratio}
    return fig



def _hop_text(sends: list[float], hop: int, hops: int) -> str:
    """What a rank did with the block of ``hop``: sent its K and V on (their measured time), or kept it (last hop)."""
    if hop >= hops:
        return "the last block: not sent on"
    if len(sends) < 2 * hop + 2:
        return "sent on"
    return f"sent K, V on: {1e3 * max(sends[2 * hop:2 * hop + 2]):.2f} ms"


def _label_side(x: float, y: float) -> str:
    """Where a node's label goes so that it points away from the ring: above the top, right of the right side..."""
    vertical = "top" if y > 0.5 else "bottom" if y < -0.5 else "middle"
    horizontal = "center" if vertical != "middle" and abs(x) < 0.5 else "right" if x > 0 else "left"
    return f"{vertical} {horizontal}"


def ring(result, step: int | None = None):
    """Ring attention, hop by hop, from a context-parallel run: which rank holds whose K/V block, and for how long.

    ``result``: a run with ``cp_algo="ring"``. One frame per hop of the first
    layer's forward in ``step`` (the last by default): the cp ranks on a circle,
    each circle coloured and numbered by the block it attends to at that hop
    (its own first, then its neighbours', passed along the arrows), and beside
    it, outside the ring, the rank and the hop's measured transfer time — the
    span of its K/V send in the run's timeline. A slider and a play button
    below the ring step through the hops.
    """
    import math

    import plotly.graph_objects as go

    r = load_result(result)
    cp = r.config.get("cp", 1)
    if cp < 2 or r.config.get("cp_algo") != "ring":
        raise ValueError("ring() draws a context-parallel run with cp_algo='ring' (cp > 1).")
    step = max(s["step"] for s in r.timeline) if step is None else step
    hops = cp - 1  # K/V sends per layer in forward
    sends = {}
    for s in sorted(r.timeline, key=lambda s: s["start_s"]):
        if s["step"] == step and s["kind"] == "comm" and s["name"] == "cp send K/V":
            sends.setdefault(s["rank"], []).append(s["end_s"] - s["start_s"])
    # The ring grows with cp so that an arrow of some length fits between neighbouring circles, and the figure with it,
    # so that a data unit stays about RING_UNIT_PX pixels and a circle and its label keep their room.
    radius = max(1.0, 0.2 * cp)
    angle = [math.pi / 2 - 2 * math.pi * k / cp for k in range(cp)]
    xs, ys = [radius * math.cos(a) for a in angle], [radius * math.sin(a) for a in angle]
    sides = [_label_side(math.cos(a), math.sin(a)) for a in angle]

    def frame(hop: int) -> list:
        owners = [(rank - hop) % cp for rank in range(cp)]
        text = [f"rank {rank}<br>holds block {owners[rank]}<br>" + _hop_text(sends.get(rank, []), hop, hops)
                for rank in range(cp)]
        return [go.Scatter(x=xs, y=ys, mode="markers+text", text=text, textposition=sides,
                           marker=dict(size=RING_NODE_PX, color=[rank_color(o) for o in owners]),
                           hovertext=text, hoverinfo="text", cliponaxis=False, showlegend=False),
                go.Scatter(x=xs, y=ys, mode="text", text=[str(o) for o in owners], textposition="middle center",
                           textfont=dict(color="white", size=15), hoverinfo="skip", cliponaxis=False,
                           showlegend=False)]

    # Each arrow is an arc of the ring from one circle to the next, stopping short of both.
    gap = (RING_NODE_PX / 2 + 10) / RING_UNIT_PX / radius  # radians: a circle's radius and some air
    arc_x, arc_y, heads = [], [], []
    for k in range(cp):
        a, b = angle[k] - gap, angle[k] - 2 * math.pi / cp + gap
        points = [a + (b - a) * i / 24 for i in range(25)]
        arc_x += [radius * math.cos(t) for t in points] + [None]
        arc_y += [radius * math.sin(t) for t in points] + [None]
        heads.append(dict(x=radius * math.cos(b), y=radius * math.sin(b), ax=radius * math.cos(points[-3]),
                          ay=radius * math.sin(points[-3]), xref="x", yref="y", axref="x", ayref="y", text="",
                          showarrow=True, arrowhead=3, arrowwidth=2, arrowcolor="#555"))
    ring_line = go.Scatter(x=arc_x, y=arc_y, mode="lines", line=dict(color="#555", width=2), hoverinfo="skip",
                           showlegend=False)
    frames = [go.Frame(data=frame(h), name=str(h), traces=[0, 1]) for h in range(cp)]
    fig = go.Figure(data=frame(0) + [ring_line], frames=frames)
    reach = radius + 0.85  # room for a label above the top circle and below the bottom one
    top, bottom = 50, 110  # the title; the slider and the play button
    fig.update_layout(
        title=fit_title(f"Ring attention on {cp} ranks, hop by hop"),
        xaxis=dict(visible=False, range=[-reach - 1.6, reach + 1.6]),
        yaxis=dict(visible=False, range=[-reach, reach], scaleanchor="x"),
        height=round(top + bottom + 2 * reach * RING_UNIT_PX), margin=dict(t=top, b=bottom, l=10, r=10),
        annotations=heads, plot_bgcolor="white",
        sliders=[dict(active=0, x=0.1, len=0.9, y=0, yanchor="top", pad=dict(t=50),
                      currentvalue=dict(prefix=f"step {step}, first layer's forward: "),
                      steps=[dict(method="animate", label=f"hop {h}", args=[[str(h)], dict(mode="immediate")])
                             for h in range(cp)])],
        updatemenus=[dict(type="buttons", showactive=False, x=0.1, y=0, xanchor="right", yanchor="top",
                          pad=dict(t=65, r=10),
                          buttons=[dict(label="▶ play", method="animate",
                                        args=[None, dict(frame=dict(duration=900), fromcurrent=True)])])],
        meta={"hops": hops, "send_s": sends})
    return fig

