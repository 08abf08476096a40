"""What every figure shares: one palette, units, labels, and reading a run from disk.

Nothing here imports plotly, so the simulations and the tour can use it on a
node that only has torch.
"""

from __future__ import annotations

import json
import os

from ..readable import byte_unit, human_bytes  # noqa: F401 (for the figures: the one byte formatter)

# One colour per kind of span, per rank, per memory category, per collective and per
# compared run — the same in every figure, so "orange" always means backward.
PALETTE = {
    "kind": {
        "forward": "#4C78A8",
        "backward": "#F58518",
        "comm": "#54A24B",
        "optimizer": "#B279A2",
        "idle": "#BAB0AC",
        "step": "#79706E",
    },
    "rank": ("#1F77B4", "#D62728", "#2CA02C", "#9467BD", "#8C564B", "#E377C2", "#17BECF", "#BCBD22",
             "#393B79", "#AD494A", "#637939", "#7B4173", "#843C39", "#3182BD", "#E6550D", "#31A354"),
    "memory": {
        "weights": "#4C78A8",
        "gradients": "#F58518",
        "optimizer": "#B279A2",   # the optimizer's state: the colour of its span
        "activations": "#54A24B",
        "temporaries": "#EECA3B",  # what backward makes and drops: activations' gradients, gradients on their way
        "other": "#BAB0AC",
    },
    "op": {
        "all_reduce": "#E45756",
        "reduce_scatter": "#72B7B2",
        "all_gather": "#EECA3B",
        "broadcast": "#9D755D",
        "send": "#FF9DA6",
        "recv": "#FF9DA6",
    },
    "series": ("#222222", "#E45756", "#4C78A8", "#54A24B", "#F58518", "#B279A2", "#72B7B2", "#EECA3B",
               "#9D755D", "#FF9DA6", "#17BECF", "#BCBD22", "#7F3C8D", "#11A579", "#3969AC", "#F2B701",
               "#E73F74", "#80BA5A", "#E68310", "#008695", "#CF1C90", "#A5AA99"),
    "ideal": "#888888",
}

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}


TITLE_CHARS = 80  # a longer title line runs past the right edge of a figure in a notebook beside the file browser


def fit_title(text: str, width: int = TITLE_CHARS) -> str:
    """``text`` broken into lines of at most ``width`` characters by ``<br>``: plotly never wraps a title, and cuts
    what runs past the figure. Breaks after '; ', then ': ', then ', ' in the second half of a line, else at a
    space; a line already broken by ``<br>`` is fitted line by line, and one with other markup is left as it is."""
    if "<br>" in text:
        return "<br>".join(fit_title(part, width) for part in text.split("<br>"))
    if "<" in text:
        return text
    lines = []
    while len(text) > width:
        cut = next((text.rfind(mark, width // 2, width) + len(mark) - 1 for mark in ("; ", ": ", ", ")
                    if text.rfind(mark, width // 2, width) >= 0), text.rfind(" ", 0, width + 1))
        if cut <= 0:
            break
        lines.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    return "<br>".join(lines + [text])


def kind_color(kind: str) -> str:
    """The colour of a span kind (an unknown kind gets the colour of ``step``)."""
    return PALETTE["kind"].get(kind, PALETTE["kind"]["step"])


def rank_color(rank: int) -> str:
    """The colour of a rank (the palette repeats after 16 ranks)."""
    ranks = PALETTE["rank"]
    return ranks[int(rank) % len(ranks)]


def series_color(i: int) -> str:
    """The colour of the i-th compared run; the first (the baseline) is black, and only it."""
    series = PALETTE["series"]
    return series[0] if i == 0 else series[1 + (i - 1) % (len(series) - 1)]


def rank_label(rank: int, word: str = "rank") -> str:
    """An axis label for a rank, written in the rank's colour."""
    return f'<span style="color:{rank_color(rank)}">{word} {rank}</span>'


def size_label(n: int) -> str:
    """A message size for an axis: binary units for powers of two (``4 KiB``), else decimal."""
    n = int(n)
    return human_bytes(n, binary=n > 0 and n & (n - 1) == 0)


def step_ticks(steps: int) -> dict:
    """Axis settings that label optimizer steps with whole numbers, about ten of them."""
    return {"tick0": 0, "dtick": max(1, round(steps / 10))}


def load_result(result):
    """A :class:`~gpucourse.measure.RunResult` from itself, its dict, or its JSON file path."""
    from ..measure import RunResult

    return RunResult.load(result)


def load_json(value):
    """Plain data from itself or from a JSON file path."""
    if isinstance(value, (str, os.PathLike)):
        with open(value) as f:
            return json.load(f)
    return value


def layout_label(config) -> str:
    """A layout's short name: degrees, ZeRO stage, schedule and buckets, e.g. ``dp2 zero1`` or ``pp2 1f1b m=4``."""
    from ..config import TrainConfig

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    parts = [cfg.layout()]
    if cfg.zero:
        parts.append(f"zero{cfg.zero}")
    if cfg.pp > 1:
        parts.append(f"{cfg.schedule} m={cfg.microbatches}")
    if cfg.bucket_mb:
        parts.append(f"buckets {cfg.bucket_mb:g} MB")
    mc = cfg.model_config()
    if mc.moe_experts:
        parts.append(f"MoE {mc.moe_experts}×top{mc.moe_top_k}")
    return " ".join(parts)


def run_label(result) -> str:
    """A short name for a run: its layout and impl, e.g. ``dp2 zero1 scratch``."""
    return f"{layout_label(result.config)} {result.config['impl']}"
