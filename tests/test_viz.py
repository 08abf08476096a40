"""Figures are data too: their structure says what they show.

Each figure is checked against the numbers it draws — a bar per span, the
shaded idle area against the simulator's own count, the collective's last frame
against the reduction computed directly, the difference panel against the
largest difference — and against the rules every figure keeps: no WebGL
trace, one palette, axis titles with units, hover text that names things.
The live view runs in a real notebook kernel under nbclient.
"""

import json
import math
import os
import random
import subprocess
import sys
import time

import nbformat
import pytest

from gpucourse import TrainConfig, bench, run, viz
from gpucourse.course import lab
from gpucourse.parallel.schedules import SCHEDULES, build, simulate
from gpucourse.viz import PALETTE
from gpucourse.viz.live import MIME, LiveView

pytestmark = pytest.mark.timeout(240)
QUICK = dict(steps=3, seq_len=32, batch_size=8)
DRAWN_TYPES = {"bar", "scatter"}  # SVG only: nothing that needs WebGL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A single-device, a data-parallel and a pipeline run, and the pipeline's JSON file."""
    folder = tmp_path_factory.mktemp("runs")
    out = {
        "single": run(TrainConfig(**QUICK), timeout=120, quiet=True),
        "dp": run(TrainConfig(dp=2, bucket_mb=0.05, **QUICK), timeout=120, quiet=True),
        "pp": run(TrainConfig(pp=2, microbatches=4, **QUICK), timeout=120, quiet=True),
    }
    out["pp_path"] = str(folder / "pp.json")
    out["pp"].save(out["pp_path"])
    return out


def _bars(fig):
    return [t for t in fig.data if t.type == "bar"]


def _all_figures(runs):
    rows = [{"op": "all_reduce", "bytes": 2 ** k, "algbw_GBps": 0.1 * k, "busbw_GBps": 0.1 * k} for k in range(10, 16)]
    return {
        "timeline": viz.timeline(runs["pp"]), "schedule": viz.schedule(pp=4, microbatches=8),
        "compare": viz.compare([runs["single"], runs["dp"], runs["pp"]]), "memory": viz.memory(runs["dp"]),
        "collective": viz.collective("all_reduce", world_size=4), "scaling": viz.scaling([runs["single"], runs["dp"]]),
        "bandwidth": viz.bandwidth(rows), "final": viz.final_figure(runs["pp"]),
    }


# --- timeline ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["pp", "dp", "pp_path"])
def test_timeline_has_one_bar_per_span(runs, which):
    fig = viz.timeline(runs[which])
    result = runs["pp"] if which == "pp_path" else runs[which]
    assert sum(len(t.x) for t in _bars(fig)) == len(result.timeline)
    by_kind = {t.name: len(t.x) for t in _bars(fig)}
    for kind in {s["kind"] for s in result.timeline}:
        assert by_kind[kind] == sum(s["kind"] == kind for s in result.timeline)


def test_timeline_of_chosen_steps_and_its_idle_area(runs):
    r = runs["pp"]
    fig = viz.timeline(r, steps=[1, 2])
    spans = [s for s in r.timeline if s["step"] in (1, 2)]
    assert sum(len(t.x) for t in _bars(fig)) == len(spans)
    # Shaded time lies inside the steps, and no rank is shaded while one of its spans runs, but for the part of a
    # communication span in which it only waited for another rank (that is idle, and shaded).
    t0 = min(s["start_s"] for s in spans)
    idle = next(t for t in fig.data if t.name == "idle")
    rects = [(round(idle.y[i] + viz.gantt.LANE / 2), idle.x[i], idle.x[i + 1]) for i in range(0, len(idle.x), 6)]
    marks = [s for s in spans if s["kind"] == "step"]
    start, end = (min(s["start_s"] for s in marks) - t0) * 1e3, (max(s["end_s"] for s in marks) - t0) * 1e3
    assert rects
    for lane, a, b in rects:
        assert start - 1e-9 <= a < b <= end + 1e-9
        for s in spans:
            if s["rank"] == lane and s["kind"] != "step":
                for lo, hi in viz.gantt.busy_parts(s):
                    assert b <= (lo - t0) * 1e3 + 1e-9 or a >= (hi - t0) * 1e3 - 1e-9
    assert any(s.get("wait_s") for s in spans)  # the stages waited for each other, and that is drawn as idle


def test_timeline_bars_say_rank_op_microbatch_and_duration(runs):
    fig = viz.timeline(runs["pp"])
    forward = next(t for t in _bars(fig) if t.name == "forward")
    for word in ("rank", "microbatch", "ms"):
        assert word in forward.hovertemplate
    assert "%{customdata[1]}" in forward.hovertemplate  # the span's name: "send activation 2", "forward"
    assert set(forward.text) <= {str(i) for i in range(4)}
    assert "(ms)" in fig.layout.xaxis.title.text


def test_timeline_refuses_a_run_without_spans(runs):
    d = runs["single"].to_dict() | {"timeline": []}
    with pytest.raises(ValueError, match="record=True"):
        viz.timeline(d)


# --- schedule ---------------------------------------------------------------------------


def _idle_area(fig_data):
    idle = next(t for t in fig_data if t.name.startswith("idle"))
    xs = [x for x in idle.x if x is not None]
    return sum(xs[i + 1] - xs[i] for i in range(0, len(xs), 5))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 3), (4, 8), (5, 2)])
def test_schedule_idle_area_is_the_bubble(name, pp, m):
    fig = viz.schedule(pp=pp, microbatches=m, schedule=name)
    sim = simulate(build(name, pp, m), pp, m, 1.0, 2.0, 0.0)
    assert _idle_area(fig.data) / (pp * sim.makespan) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    compute = sum(sum(t.x) for t in _bars(fig))
    assert compute == pytest.approx(sum(sim.busy))
    # Every slider position is the simulation of that many microbatches.
    if m == 1:
        assert not fig.frames
    else:
        assert [int(f.name) for f in fig.frames] == list(range(1, m + 1))
    for f in fig.frames:
        s = simulate(build(name, pp, int(f.name)), pp, int(f.name), 1.0, 2.0, 0.0)
        assert _idle_area(f.data) / (pp * s.makespan) == pytest.approx(s.bubble_fraction, abs=1e-12)


def test_schedule_with_costly_transfers_shades_only_the_waiting():
    fig = viz.schedule(pp=4, microbatches=6, schedule="gpipe", cost_comm=0.5)
    sim = simulate(build("gpipe", 4, 6), 4, 6, 1.0, 2.0, 0.5)
    assert _idle_area(fig.data) == pytest.approx(sum(sim.idle))
    comm = next(t for t in fig.data if t.name == "comm")
    assert sum(comm.x) == pytest.approx(sum(sim.comm))


def test_schedule_of_a_run_uses_its_layout_and_measured_costs(runs):
    fig = viz.schedule(runs["pp_path"])
    assert "2 stages, 4 microbatches" in fig.layout.title.text
    assert fig.layout.xaxis.title.text.startswith("time (ms")


def test_schedule_slider_is_capped_for_many_microbatches():
    fig = viz.schedule(pp=4, microbatches=64)
    names = [int(f.name) for f in fig.frames]
    assert len(names) <= 17 and names[0] == 1 and names[-1] == 64
    assert fig.layout.sliders[0].active == len(names) - 1


# --- collectives ------------------------------------------------------------------------


def _direct(op, data, n, root):
    sums = [sum(data[r][c] for r in range(n)) for c in range(n)]
    if op == "all_reduce":
        return {(r, c): sums[c] for r in range(n) for c in range(n)}
    if op == "reduce_scatter":
        return {(r, r): sums[r] for r in range(n)}
    if op == "all_gather":
        return {(r, c): data[c][c] for r in range(n) for c in range(n)}
    return {(r, c): data[root][c] for r in range(n) for c in range(n)}


@pytest.mark.parametrize("op", viz.collectives.OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_collective_last_frame_holds_the_result(op, n):
    rng = random.Random(n)
    data = [[rng.randint(-50, 50) for _ in range(n)] for _ in range(n)]
    root = n - 1
    fig = viz.collective(op, world_size=n, data=data, root=root)
    last = (fig.frames[-1].data if fig.frames else fig.data)[0]
    held = {(rank, chunk): text for (rank, chunk, *_), text in zip(last.customdata, last.text)}
    for (rank, chunk), value in _direct(op, data, n, root).items():
        assert held[(rank, chunk)] == f"{value:g}", f"{op}: rank {rank}, chunk {chunk}"


@pytest.mark.parametrize("op", viz.collectives.OPS)
def test_collective_steps_and_traffic_are_the_ring_algorithm(op):
    n = 4
    sim = viz.simulate_collective(op, n)
    steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1, "broadcast": 2 * n - 2}[op]
    assert len(sim.transfers) == steps
    sent = [sum(1 for step in sim.transfers for t in step if t[0] == r) for r in range(n)]
    if op != "broadcast":
        # Each rank sends (n-1) or 2(n-1) chunks of 1/n: gpucourse.comm's ring factors.
        assert sent == [steps] * n
        assert all(dst == (src + 1) % n for step in sim.transfers for src, dst, *_ in step)
    else:
        assert sent[sim.root] == n and sent[(sim.root - 1) % n] == 0
    fig = viz.collective(op, world_size=n)
    assert len(fig.frames) == steps + 1
    assert fig.layout.sliders and fig.layout.updatemenus


def test_collective_refuses_what_it_cannot_simulate():
    with pytest.raises(ValueError, match="op="):
        viz.collective("all_to_all")
    with pytest.raises(ValueError, match="algorithm="):
        viz.collective("all_reduce", algorithm="tree")
    with pytest.raises(ValueError, match="rows"):
        viz.collective("all_reduce", world_size=2, data=[[1, 2]])


# --- compare, memory, scaling, bandwidth ------------------------------------------------


def test_compare_difference_panel_is_the_largest_difference(runs):
    results = [runs["single"], runs["dp"], runs["pp"]]
    fig = viz.compare(results)
    expected = max(abs(a - b) for r in results[1:] for a, b in zip(r.losses, results[0].losses))
    panel = [t for t in fig.data if t.yaxis == "y2"]
    assert len(panel) == 2
    assert max(max(t.y) for t in panel) == expected
    assert fig.layout.meta["max_difference"] == expected
    assert f"{expected:.3g}" in fig.layout.title.text


def test_compare_of_made_up_runs(runs):
    base = runs["single"].to_dict()
    off = base | {"losses": [x + d for x, d in zip(base["losses"], (0.0, 0.25, -0.5))]}
    fig = viz.compare({"baseline": base, "off": off})
    assert list(next(t for t in fig.data if t.yaxis == "y2").y) == pytest.approx([0.0, 0.25, 0.5])
    assert [t.name for t in fig.data if t.yaxis == "y"] == ["baseline", "off"]


def _stacks(fig):
    totals = {}
    for t in _bars(fig):
        for rank, source, y in zip(t.x[0], t.x[1], t.y):
            totals[(rank, source)] = totals.get((rank, source), 0) + y
    return totals


def test_memory_stacks_each_rank_by_category_beside_the_estimate(runs):
    r = runs["dp"]
    estimate = {"weights": 1_000_000, "gradients": 1_000_000, "optimizer": 2_000_000}
    fig = viz.memory(r, predicted=estimate)
    assert fig.layout.yaxis.title.text == "memory (MiB)"
    measured = {c for m in r.memory.values() for c in m if "peak" not in c}
    assert {t.name for t in _bars(fig)} == measured | set(estimate)
    totals = _stacks(fig)
    assert len(totals) == 2 * r.world_size  # measured and predicted, per rank
    for (rank, source), mb in totals.items():
        rank_id = next(k for k in r.memory if f"rank {k}<" in rank)
        expected = (sum(v for c, v in r.memory[rank_id].items() if "peak" not in c) if source == "measured"
                    else sum(estimate.values()))
        assert mb == pytest.approx(expected / 2**20)
    for t in _bars(fig):
        assert t.marker.color == PALETTE["memory"].get(t.name, PALETTE["memory"]["other"])


def test_memory_of_an_estimate_alone_in_both_shapes(tmp_path):
    path = tmp_path / "estimate.json"
    path.write_text(json.dumps({"weights": 4e9, "optimizer": 8e9}))
    assert _stacks(viz.memory(str(path))) == _stacks(viz.memory({"weights": 4e9, "optimizer": 8e9}))
    one = viz.memory({"weights": 4e9, "optimizer": 8e9})
    assert one.layout.yaxis.title.text == "memory (GiB)" and len(_stacks(one)) == 1
    per_rank = viz.memory({0: {"weights": 10, "peak_allocated": 40}, 1: {"weights": 20}})
    assert sorted(_stacks(per_rank).values()) == [10, 20]
    assert any(t.type == "scatter" and list(t.y) == [40] for t in per_rank.data)


def test_memory_charts_draw_mib_as_every_printed_number_is():
    """Notebooks 03 and 07 print memory in MiB (2**20 bytes): the bars beside them are MiB too, not 10**6 bytes."""
    MiB = 2**20
    result = {"config": TrainConfig(dp=2).to_dict(), "world_size": 2, "device": "cpu", "backend": "gloo",
              "losses": [], "step_times_s": [], "tokens_per_s": 0.0,
              "memory": {"0": {"weights": 864_768, "gradients": 864_768, "optimizer": 1_729_536},
                         "1": {"weights": 864_768, "gradients": 432_384, "optimizer": 864_768}}}
    estimate = {"weights": 864_768, "gradients": 432_384, "optimizer": 864_768}
    fig = viz.memory(result, predicted=estimate)
    assert fig.layout.yaxis.title.text == "memory (MiB)"
    weights = next(t for t in _bars(fig) if t.name == "weights")
    assert list(weights.y) == [864_768 / MiB] * 4 and weights.y[0] == pytest.approx(0.8247, abs=1e-4)
    assert weights.hovertext[0].endswith("weights: 844.50 KiB")  # 864,768 / 2**10, not 864.77 KB
    stacks = sorted(_stacks(fig).values())
    assert stacks == pytest.approx(sorted(b / MiB for b in (3_459_072, 2_161_920, 2_161_920, 2_161_920)))


def test_scaling_draws_ideal_and_efficiency(runs):
    fig = viz.scaling([runs["single"], runs["dp"], runs["pp"]])
    ideal = next(t for t in fig.data if t.name == "ideal (linear)")
    assert list(ideal.y) == pytest.approx([runs["single"].tokens_per_s * w for w in ideal.x])
    eff = [t for t in fig.data if t.xaxis == "x2" and t.name != "ideal"]
    assert {t.name for t in eff} == {"dp scratch", "pp scratch"}
    for t in eff:
        assert t.y[0] == pytest.approx(100)
        assert t.y[1] == pytest.approx(100 * runs[t.name[:2]].tokens_per_s / (2 * runs["single"].tokens_per_s))
    assert fig.layout.xaxis.title.text == "world size (ranks)"


def test_bandwidth_accepts_rows_a_dict_or_a_file(tmp_path):
    rows = [{"op": op, "bytes": 2 ** k, "algbw_GBps": k / 10, "busbw_GBps": k / 5}
            for op in ("all_reduce", "broadcast") for k in range(10, 20)]
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"rows": rows}))
    for given in (rows, {"rows": rows}, str(path)):
        fig = viz.bandwidth(given)
        assert len(fig.data) == 4 and fig.layout.xaxis.type == "log"
        bus = next(t for t in fig.data if t.name == "all_reduce (bus)")
        assert list(bus.y) == [k / 5 for k in range(10, 20)]
    with pytest.raises(ValueError, match="busbw_GBps"):
        viz.bandwidth([{"op": "x", "bytes": 1}])


# --- rules every figure keeps -----------------------------------------------------------


def test_every_figure_is_svg_only_with_titled_axes(runs):
    for name, fig in _all_figures(runs).items():
        types = {t.type for t in fig.data} | {t.type for f in (fig.frames or []) for t in f.data}
        assert types <= DRAWN_TYPES, f"{name} uses {types - DRAWN_TYPES}"
        axes = [fig.layout[k] for k in fig.layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]
        titles = [ax.title.text for ax in axes if ax.title.text]
        assert any("(" in t for t in titles), f"{name}: no axis says its unit: {titles}"
        assert fig.layout.title.text, f"{name} has no title"


def test_one_palette_in_every_figure(runs):
    fig, sched, final = viz.timeline(runs["pp"]), viz.schedule(pp=2, microbatches=2), viz.final_figure(runs["pp"])
    for f in (fig, sched, final):
        for t in _bars(f):
            if t.name in PALETTE["kind"]:
                assert t.marker.color == PALETTE["kind"][t.name]
    assert PALETTE["memory"]["optimizer"] == PALETTE["kind"]["optimizer"]


def test_figures_take_a_json_path(runs):
    path = runs["pp_path"]
    assert sum(len(t.x) for t in _bars(viz.timeline(path))) == len(runs["pp"].timeline)
    viz.compare([path, path])
    viz.memory(path)
    viz.scaling([path])
    viz.final_figure(path)


def test_figures_render_offline_in_html(runs, tmp_path):
    import plotly.io as pio

    for name, fig in _all_figures(runs).items():
        page = pio.to_html(fig, include_plotlyjs=True, full_html=True)
        assert '<script src="http' not in page and "cdn.plot.ly/plotly" not in page.split("</script>")[-1], name


# --- live view --------------------------------------------------------------------------


def test_live_view_throttles_by_time():
    bundles = []
    view = LiveView(TrainConfig(steps=400), interval_s=0.25, sink=bundles.append)
    for step in range(200):  # fast steps: 200 in well under a second
        view.on_step({"step": step, "steps": 400, "loss": 1.0 / (step + 1), "time_s": 0.001})
    time.sleep(0.6)
    assert 1 <= view.redraws <= 3, "fast steps must not each be drawn"
    drawn = view.redraws
    for step in range(200, 212):  # slow steps: one every 0.1 s; each second still sees several redraws
        view.on_step({"step": step, "steps": 400, "loss": 0.1, "time_s": 0.1})
        time.sleep(0.1)
    time.sleep(0.3)
    assert view.redraws - drawn >= 3
    view.close()
    last = bundles[-1][MIME]
    assert list(last["data"][0]["x"])[-1] == 211
    json.dumps(bundles[-1])  # plain JSON, as the kernel sends it


def test_live_view_shows_ranks_activity_when_reported():
    bundles = []
    view = LiveView(TrainConfig(dp=2, steps=5), interval_s=0.05, sink=bundles.append)
    handle = view.on_message
    handle({"kind": "activity", "rank": 1, "step": 0, "busy_s": {"forward": 0.01, "comm": 0.02}, "time_s": 0.03})
    handle({"kind": "activity", "rank": 0, "step": 0, "busy_s": {"forward": 0.01, "backward": 0.02}, "time_s": 0.03})
    time.sleep(0.3)
    view.close()
    bars = [t for t in bundles[-1][MIME]["data"] if t["type"] == "bar"]
    forward = next(t for t in bars if t["name"] == "forward")
    assert forward["x"] == [10.0, 10.0] and forward["marker"]["color"] == PALETTE["kind"]["forward"]


def test_live_run_outside_a_notebook_degrades_to_a_final_figure(runs):
    view = LiveView(TrainConfig(**QUICK))
    assert view._sink is None and view._thread is None  # plain python: nothing to draw into
    fig = view.finish(runs["single"])
    assert "final loss" in fig.layout.title.text
    result = viz.watch(TrainConfig(dp=2, **QUICK), timeout=120, quiet=True)
    assert result.losses == pytest.approx(runs["single"].losses, rel=1e-5)


KERNEL = "gpucourse-viz-test"


def test_live_mode_in_a_notebook_leaves_one_figure(tmp_path):
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gpucourse viz test", "language": "python"}))
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "gpucourse viz test", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("from gpucourse import TrainConfig, run, viz\n"
                                  "r = viz.watch(TrainConfig(dp=2, steps=40, seq_len=32), quiet=True)"),
        nbformat.v4.new_code_cell("from gpucourse.viz import LiveView\n"
                                  "cfg = TrainConfig(dp=2, steps=40, seq_len=32)\n"
                                  "view = LiveView(cfg, interval_s=0.05)\n"
                                  "view.finish(run(cfg, quiet=True, on_step=view.on_step))\n"
                                  "print('redraws', view.redraws)"),
    ]
    lab.execute(nb, tmp_path / "live.ipynb", spec.parent, name=KERNEL, cell_timeout=180, smoke=False,
                env={"JUPYTER_PATH": str(tmp_path)})

    live, direct = nb.cells
    figures = [o for o in live.outputs if o.output_type == "display_data" and MIME in o.data]
    assert len(figures) == 1, [o.output_type for o in live.outputs]
    assert len([o for o in live.outputs if o.output_type == "display_data"]) == 1  # the live widget was replaced
    assert "final loss" in figures[0].data[MIME]["layout"]["title"]["text"]
    assert not [o for o in live.outputs if o.output_type == "error"]
    # Drawn while it trained (a redraw every 0.05 s at most), then replaced by the final figure.
    assert len([o for o in direct.outputs if o.output_type == "display_data"]) == 1
    printed = "".join(o.get("text", "") for o in direct.outputs if o.output_type == "stream")
    assert int(printed.split("redraws")[1].split()[0]) >= 1


def test_live_view_overhead_is_measurable():
    reading = bench.course_figures.live_view_overhead(reps=1, steps=8, interval_s=0.05)
    assert reading.value > 0 and reading.detail["bundles_sent"] >= 1


def test_viz_imports_no_plotly_until_drawing():
    code = ("import sys, gpucourse, gpucourse.viz, gpucourse.course.tour, gpucourse.cli;"
            "from gpucourse.viz import simulate_collective; simulate_collective('all_reduce', 3);"
            "bad = [m for m in ('plotly', 'ipywidgets', 'IPython') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ring_animation_follows_the_blocks_of_a_real_ring_run():
    result = run(TrainConfig(cp=3, **{**QUICK, "seq_len": 48}), timeout=120, quiet=True)
    fig = viz.ring(result)
    assert len(fig.frames) == 3 and fig.layout.meta["hops"] == 2
    for hop, frame in enumerate(fig.frames):
        for rank, label in enumerate(frame.data[0].text):
            assert label.startswith(f"rank {rank}<br>holds block {(rank - hop) % 3}<br>")
    # Each rank sent K and V once per hop in every block's forward: 4 blocks × 2 hops × 2 tensors.
    assert all(len(times) == 4 * 2 * 2 and min(times) > 0 for times in fig.layout.meta["send_s"].values())
    assert {t.type for t in fig.data} <= DRAWN_TYPES
    # Readable: a one-line title clear of the toolbar, the play button below the ring beside the slider, each label
    # outside its circle, and the arrows (arcs of the ring) clear of every circle.
    from gpucourse.viz.gantt import RING_NODE_PX, RING_UNIT_PX

    title, (labels, numbers, arcs) = fig.layout.title.text, fig.data
    assert "<br>" not in title and len(title) <= 40, title
    assert (fig.layout.updatemenus[0].y, fig.layout.updatemenus[0].yanchor) == (0, "top") == (
        fig.layout.sliders[0].y, fig.layout.sliders[0].yanchor)
    assert "middle center" not in labels.textposition and numbers.textposition == "middle center"
    centres = list(zip(labels.x, labels.y))
    on_arcs = [(x, y) for x, y in zip(arcs.x, arcs.y) if x is not None]
    assert min(math.dist(p, c) for p in on_arcs for c in centres) > RING_NODE_PX / 2 / RING_UNIT_PX
    with pytest.raises(ValueError, match="cp_algo='ring'"):
        viz.ring(run(TrainConfig(cp=2, cp_algo="allgather", **QUICK), timeout=120, quiet=True))


def test_expert_figures_draw_a_real_runs_router_counts():
    result = run(TrainConfig(dp=2, ep=2, moe_experts=4, moe_every=2, **QUICK), timeout=120, quiet=True)
    moe = result.extras["moe"]
    fig = viz.all_to_all(result)
    rows, counts = fig.layout.meta["rows"], fig.layout.meta["counts"]
    # Rank i sends rank j the token choices for j's experts (2 each): every choice goes somewhere, once.
    assert rows == [[sum(counts[i][2 * j:2 * j + 2]) for j in range(2)] for i in range(2)]
    assert sum(map(sum, rows)) == sum(moe["tokens_per_expert"][-1][0]) == 8 * 32 * 2  # batch × seq × top-2
    assert [f.name for f in fig.frames] == ["route", "counts", "dispatch", "compute", "combine"]
    load = viz.expert_load(result)
    want = [[max(c) / (sum(c) / len(c)) for c in step] for step in moe["tokens_per_expert"]]
    assert load.layout.meta["imbalance"] == want and len(moe["layers"]) == 2  # blocks 1 and 3
    with pytest.raises(ValueError, match="ep > 1"):
        viz.all_to_all(run(TrainConfig(moe_experts=4, **QUICK), timeout=120, quiet=True))
    with pytest.raises(ValueError, match="no mixture of experts"):
        viz.expert_load(run(TrainConfig(**QUICK), timeout=120, quiet=True))


def test_schedule_figure_draws_the_virtual_schedules_and_both_bubbles():
    from gpucourse.parallel import schedules_virtual

    for name, v in (("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)):
        fig = viz.schedule(pp=4, microbatches=8, schedule=name)
        ops, layout = schedules_virtual.build(name, 4, 8, 2)
        sim = schedules_virtual.simulate(ops, layout, 8, 1.0, 1.0 if name != "interleaved-1f1b" else 2.0,
                                         1.0 if name != "interleaved-1f1b" else 0.0)
        assert fig.layout.meta["bubble_ratio"] == pytest.approx(sim.bubble_ratio)
        weights = next(t for t in fig.data if t.name == "weight gradient")
        assert (len(weights.x) == 4 * 8 * layout.v) == (name != "interleaved-1f1b")
    interleaved = viz.schedule(pp=4, microbatches=12, schedule="interleaved-1f1b")
    assert [f.name for f in interleaved.frames] == ["4", "8", "12"]  # multiples of pp only


# --- titles: plotly never wraps one, and cuts what runs past the figure ------------------------------------------

def test_fit_title_breaks_at_clauses_and_keeps_markup():
    from gpucourse.viz.style import TITLE_CHARS, fit_title

    assert fit_title("short title") == "short title"
    long = "gpipe schedule, 4 stages, 8 microbatches: bubble 27.3% (equal-cost formula 27.3%); and a clause more"
    lines = fit_title(long).split("<br>")
    assert lines[0].endswith("microbatches:") and all(len(line) <= TITLE_CHARS for line in lines)
    assert " ".join(lines) == long
    marked = "head<br><sup>" + "word " * 30 + "</sup>"
    assert fit_title(marked) == marked  # a line with markup is not cut inside its tags


def test_schedule_and_timeline_titles_fit_the_figure(runs):
    from gpucourse.parallel import schedules_virtual
    from gpucourse.viz.style import TITLE_CHARS

    figures = [viz.timeline(runs["pp"]), viz.timeline(runs["pp"], steps=2, on="h100"), viz.schedule(runs["pp"])]
    figures += [viz.schedule(pp=p, microbatches=m, schedule=s) for s in ("naive", "gpipe", "1f1b")
                for p, m in ((4, 16), (8, 64))]
    figures += [viz.schedule(pp=4, microbatches=8, schedule=s, slider=False) for s in schedules_virtual.SCHEDULES]
    for fig in figures:
        texts = [fig.layout.title.text] + [a.text for a in fig.layout.annotations]
        texts += [f.layout.title.text for f in fig.frames or () if f.layout.title.text]
        for line in (line for text in texts for line in text.split("<br>")):
            assert len(line) <= TITLE_CHARS, line


def test_memory_measured_another_way_per_rank_beside_the_estimate():
    """A peak measured by profiling.peak_memory on each rank, {rank: {kind: bytes}}, drawn beside the estimate."""
    peaks = {0: {"weights": 10, "temporaries": 5}, 1: {"weights": 10, "temporaries": 7}}
    fig = viz.memory(peaks, predicted={0: {"weights": 12}, 1: {"weights": 12}})
    assert sorted(_stacks(fig).values()) == [12, 12, 15, 17]
    assert {t.name for t in _bars(fig)} == {"weights", "temporaries"}
    assert next(t for t in _bars(fig) if t.name == "temporaries").marker.color == PALETTE["memory"]["temporaries"]
