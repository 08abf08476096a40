"""A live view of a training run in the notebook: the loss and what each rank is doing, while it trains.

:func:`watch` runs a config like :func:`gpucourse.run` and builds a
:class:`LiveView` that it feeds: the run's step callback and each rank's
activity reports. The callbacks only append to a list (they run in the
launcher's message thread, between steps); a drawing thread draws a step as
soon as it arrives, then waits ``interval_s`` seconds before the next frame
(which shows all that arrived meanwhile), so fast steps are not slowed by
drawing. The empty figure is drawn before the ranks start: the first plotly
figure of a browser page waits for plotly.js to load, seconds on a small
machine and more while the ranks hold its cores, longer than a short CPU run
trains. Each redraw replaces one notebook output in place
(:class:`NotebookSink`; plotly's FigureWidget would need anywidget). When the
run ends the live figure is replaced by a final static one built from the
RunResult.

Outside a Jupyter kernel (plain python, a terminal IPython) there is nothing to
draw into: the view only collects, and :meth:`LiveView.finish` returns the
final figure without displaying it.
"""

from __future__ import annotations

import json
import sys
import threading

from .style import PALETTE, PLOTLY_CONFIG, kind_color, layout_label, rank_label, run_label, step_ticks

MIME = "application/vnd.plotly.v1+json"
ACTIVITY_KINDS = ("forward", "backward", "comm", "optimizer", "idle")


class NotebookSink:
    """One notebook output that each bundle replaces: an ipywidgets Output while training, the final figure after.

    Why not a display handle alone: JupyterLab hands an updated output to its
    existing renderer when the mimetype is unchanged, and plotly's renderer
    ignores a second figure. Replacing the Output widget's outputs makes a new
    renderer each time; the final figure then replaces the widget itself, so
    the notebook keeps one plain plotly output (also where no widget manager runs).
    """

    def __init__(self):
        from IPython.display import display
        from ipywidgets import Output

        self._out = Output()
        self._handle = display(self._out, display_id=True)

    def __call__(self, bundle: dict) -> None:
        self._out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def finish(self, bundle: dict) -> None:
        self._handle.update(bundle, raw=True)
        self._out.close()


def notebook_sink():
    """Where a live view draws: a :class:`NotebookSink` inside a Jupyter kernel, None anywhere else."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    return NotebookSink()


class LiveView:
    """Collects step reports from a run and keeps one notebook figure up to date with them.

    - ``config``: the TrainConfig (or its dict) being trained, for the axes and title.
    - ``interval_s``: the least time between two redraws; the first step is drawn at once. The
      default, 0.75 s, keeps the figure under a second old and the browser's work
      small: each redraw is a new plot there (about 1.3 per second).
    - ``sink``: a function each MIME bundle is given to (its ``finish`` method, if
      it has one, gets the final figure); ``"auto"`` is the notebook, or nowhere outside one.
    - ``on_step``: another step callback to call too (e.g. a progress bar).
    """

    def __init__(self, config, *, interval_s: float = 0.75, sink="auto", on_step=None):
        self.config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        self.interval_s = interval_s
        self.steps: list[dict] = []
        self.activity: dict[int, dict] = {}   # rank -> its latest per-step report
        self.redraws = 0
        self._chain = on_step
        self._lock = threading.Lock()
        self._dirty = False
        self._stepped = threading.Event()  # a step arrived since the last frame
        self._stop = threading.Event()
        self._sink = notebook_sink() if sink == "auto" else sink
        self._thread = None
        if self._sink is not None:
            self._sink(self._bundle([], {}))  # the axes, drawn while the ranks start
            self._thread = threading.Thread(target=self._loop, name="gpucourse-live-view", daemon=True)
            self._thread.start()

    def on_step(self, msg: dict) -> None:
        """The run's step callback: ``{step, steps, loss, time_s}``."""
        with self._lock:
            self.steps.append(dict(msg))
            self._dirty = True
        self._stepped.set()
        if self._chain is not None:
            self._chain(msg)

    def on_message(self, msg: dict) -> None:
        """A run's message callback: keeps each rank's latest ``activity`` report
        (``{rank, step, busy_s: {kind: seconds}, time_s}``), drawn with the next step, and ignores the rest."""
        if msg.get("kind") != "activity":
            return
        with self._lock:
            self.activity[msg["rank"]] = dict(msg)
            self._dirty = True

    def _loop(self) -> None:
        # Woken by a step, not by a clock: a tick would draw the first step up to interval_s late.
        while True:
            self._stepped.wait()
            if self._stop.is_set():
                return
            self._stepped.clear()
            self._draw()
            if self._stop.wait(self.interval_s):
                return

    def _draw(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            steps, activity = list(self.steps), {r: dict(a) for r, a in self.activity.items()}
        self._sink(self._bundle(steps, activity))
        self.redraws += 1

    def _bundle(self, steps: list[dict], activity: dict) -> dict:
        last = steps[-1] if steps else None
        note = f"step {last['step'] + 1}/{last['steps']}, loss {last['loss']:.4f}" if last else "starting"
        return {MIME: live_figure_dict(self.config, steps, activity), "text/plain": f"gpucourse live: {note}"}

    def _stop_drawing(self) -> None:
        self._stop.set()
        self._stepped.set()  # wakes the drawing thread to see the stop
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop redrawing (the run failed or was interrupted), after drawing every step that arrived."""
        self._stop_drawing()
        if self._sink is not None:
            self._draw()

    def finish(self, result):
        """Replace the live figure by the final one, built from the run's result; return that figure."""
        self._stop_drawing()
        fig = final_figure(result)
        if self._sink is not None:
            show = getattr(self._sink, "finish", self._sink)
            show({MIME: json.loads(fig.to_json()) | {"config": PLOTLY_CONFIG},
                  "text/plain": f"gpucourse: {run_label(result)}, final loss {result.losses[-1]:.4f}"})
        return fig


def watch(config, *, interval_s: float = 0.75, on_step=None, **run_options):
    """Train ``config`` as :func:`gpucourse.run` does, drawing it in the notebook while it trains.

    The loss and step time, and each rank's time by kind of span when the ranks
    record, are redrawn at most every ``interval_s`` seconds; at the end the
    final figure replaces them. ``on_step`` and every other option (``timeout``,
    ``export_weights``, ``quiet``, ...) are :func:`gpucourse.run`'s. Returns the
    RunResult.
    """
    from ..train import run

    view = LiveView(config, interval_s=interval_s, on_step=on_step)
    try:
        result = run(config, on_step=view.on_step, on_message=view.on_message, **run_options)
    except BaseException:
        view.close()  # keeps the steps drawn so far
        raise
    view.finish(result)
    return result


def live_figure_dict(config: dict, steps: list[dict], activity: dict) -> dict:
    """The live figure as plain plotly JSON: built without plotly's validation, so a redraw costs little."""
    total = config["steps"]
    grid = {"gridcolor": "#EBF0F8", "zeroline": False}
    layout = {
        "height": 360, "showlegend": bool(activity), "plot_bgcolor": "white", "barmode": "stack", "margin": {"t": 60},
        "title": {"text": f"training {layout_label(config)} {config['impl']} ({config['model']}) on "
                          f"{config['dp'] * config['tp'] * config['pp']} ranks"
                          + (f": step {steps[-1]['step'] + 1} of {total}, loss {steps[-1]['loss']:.4f}"
                             if steps else ": starting")},
        "xaxis": {"domain": [0, 0.45], "title": {"text": "optimizer step"}, "range": [-0.5, total - 0.5],
                  **step_ticks(total), **grid},
        "yaxis": {"title": {"text": "loss (nats)"}, **grid},
        "xaxis2": {"domain": [0.58, 1], "anchor": "y2", **grid},
        "yaxis2": {"anchor": "x2", **grid},
    }
    data = [{"type": "scatter", "mode": "lines+markers", "name": "loss", "showlegend": False,
             "x": [s["step"] for s in steps], "y": [s["loss"] for s in steps],
             "line": {"color": PALETTE["series"][0]},
             "hovertemplate": "step %{x}<br>loss %{y:.5f} nats<extra></extra>"}]
    if activity:
        ranks = sorted(activity)
        for kind in ACTIVITY_KINDS:
            data.append({"type": "bar", "orientation": "h", "name": kind, "xaxis": "x2", "yaxis": "y2",
                         "y": [rank_label(r) for r in ranks], "marker": {"color": kind_color(kind)},
                         "x": [activity[r]["busy_s"].get(kind, 0.0) * 1e3 for r in ranks],
                         "hovertemplate": f"%{{y}}<br>{kind} %{{x:.2f}} ms in its latest step<extra></extra>"})
        layout["xaxis2"]["title"] = {"text": "time in the rank's latest step (ms)"}
        layout["yaxis2"]["autorange"] = "reversed"
    else:
        data.append({"type": "scatter", "mode": "lines+markers", "name": "step time", "showlegend": False,
                     "xaxis": "x2", "yaxis": "y2", "x": [s["step"] for s in steps],
                     "y": [s["time_s"] * 1e3 for s in steps], "line": {"color": PALETTE["kind"]["step"]},
                     "hovertemplate": "step %{x}<br>%{y:.1f} ms (slowest rank)<extra></extra>"})
        layout["xaxis2"].update(title={"text": "optimizer step"}, range=[-0.5, total - 0.5], **step_ticks(total))
        layout["yaxis2"]["title"] = {"text": "step time (ms)"}
    return {"data": data, "layout": layout, "config": PLOTLY_CONFIG}


def final_figure(result):
    """A finished run at a glance: its loss curve, and each rank's time by kind of span (or its step times)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from .gantt import rank_activity
    from .style import load_result

    r = load_result(result)
    activity = rank_activity(r) if r.timeline else {}
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14,
                        subplot_titles=("loss", "each rank's time, all steps" if activity else "step time"))
    fig.add_trace(go.Scatter(x=list(range(len(r.losses))), y=r.losses, mode="lines+markers", name="loss",
                             showlegend=False, line=dict(color=PALETTE["series"][0]),
                             hovertemplate="step %{x}<br>loss %{y:.5f} nats<extra></extra>"), row=1, col=1)
    if activity:
        ranks = sorted(activity)
        for kind in ACTIVITY_KINDS:
            fig.add_trace(go.Bar(orientation="h", name=kind, y=[rank_label(k) for k in ranks],
                                 x=[activity[k].get(kind, 0.0) * 1e3 for k in ranks],
                                 marker=dict(color=kind_color(kind)),
                                 hovertemplate=f"%{{y}}<br>{kind} %{{x:.1f}} ms over the run<extra></extra>"),
                          row=1, col=2)
        fig.update_xaxes(title_text="time (ms; overlapping spans count in each kind)", row=1, col=2)
        fig.update_yaxes(autorange="reversed", row=1, col=2)
    else:
        fig.add_trace(go.Scatter(x=list(range(len(r.step_times_s))), y=[t * 1e3 for t in r.step_times_s],
                                 mode="lines+markers", name="step time", showlegend=False,
                                 line=dict(color=PALETTE["kind"]["step"]),
                                 hovertemplate="step %{x}<br>%{y:.1f} ms<extra></extra>"), row=1, col=2)
        fig.update_xaxes(title_text="optimizer step", **step_ticks(len(r.losses)), row=1, col=2)
        fig.update_yaxes(title_text="step time (ms)", row=1, col=2)
    fig.update_xaxes(title_text="optimizer step", **step_ticks(len(r.losses)), row=1, col=1)
    fig.update_yaxes(title_text="loss (nats)", row=1, col=1)
    fig.update_layout(template="plotly_white", height=380, barmode="stack",
                      title=f"{run_label(r)} on {r.world_size} {r.device} rank{'s' * (r.world_size > 1)}: "
                            f"final loss {r.losses[-1]:.4f}, {r.tokens_per_s:,.0f} tokens/s")
    return fig
