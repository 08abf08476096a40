"""The live view draws a run while it trains, not after.

In a browser the first plotly figure of a page waits for plotly.js to load (seconds on a small machine,
more while the ranks hold its cores), and a short CPU run trains in a few seconds: so the view sends its
empty figure before any rank starts, and draws the first step the moment it arrives. Checked by the order
of events (how many steps had arrived when each frame was sent), not by sleeps or wall-clock bounds.
"""

import pytest

from gpucourse import TrainConfig, run
from gpucourse.viz.live import MIME, LiveView

pytestmark = pytest.mark.timeout(120)


def test_the_first_step_is_drawn_while_the_run_trains():
    cfg = TrainConfig(dp=2, steps=6, seq_len=32, batch_size=8)
    arrived = []  # steps given to the view, in order
    frames = []   # per frame sent: (steps arrived by then, last step it shows or None)

    def sink(bundle):
        shown = bundle[MIME]["data"][0]["x"]
        frames.append((len(arrived), shown[-1] if shown else None))

    def on_step(msg):
        arrived.append(msg["step"])
        view.on_step(msg)

    # An interval longer than the run: any frame drawn while it trains is the first step's own, drawn at once.
    view = LiveView(cfg, interval_s=600, sink=sink)
    assert frames == [(0, None)], "the empty figure is sent before any rank starts"
    try:
        result = run(cfg, timeout=120, quiet=True, on_step=on_step, on_message=view.on_message)
    finally:
        during = list(frames)
        view.close()
    assert arrived == list(range(cfg.steps)) and len(result.losses) == cfg.steps
    drawn = [f for f in during[1:] if f[1] is not None]
    assert drawn, f"no step was drawn before the run returned (frames: {during})"
    steps_by_then, shown = drawn[0]
    assert shown <= 1 and steps_by_then < cfg.steps, f"the first step's frame came late: {during}"
    assert frames[-1] == (cfg.steps, cfg.steps - 1)  # closing draws every step that arrived
