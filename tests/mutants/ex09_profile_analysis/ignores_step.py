"""Mutant of ex09_profile_analysis: takes every span of the rank that falls in the window, whatever its step,
so a collective of the previous step still running in this step's window counts here."""

import itertools

COMPUTE = ("forward", "backward", "optimizer")


def _classify(open_spans: list[dict]) -> str:
    if any(s["kind"] == "comm" and s.get("blocking") for s in open_spans):
        return "comm"
    if any(s["kind"] in COMPUTE for s in open_spans):
        return "compute"
    if any(s["kind"] == "comm" for s in open_spans):
        return "comm"
    return "idle"


def time_shares(spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    """Per rank, the shares of step ``step``'s wall time spent computing, communicating and idle."""
    out = {}
    for window in spans:
        if window["kind"] != "step" or window["step"] != step:
            continue
        rank, lo, hi = window["rank"], window["start_s"], window["end_s"]
        mine = [s for s in spans if s["rank"] == rank and s["kind"] != "step"]
        cuts = sorted({lo, hi} | {min(max(t, lo), hi) for s in mine for t in (s["start_s"], s["end_s"])})
        seconds = {"compute": 0.0, "comm": 0.0, "idle": 0.0}
        for a, b in itertools.pairwise(cuts):
            middle = (a + b) / 2
            seconds[_classify([s for s in mine if s["start_s"] < middle < s["end_s"]])] += b - a
        wall = hi - lo
        out[rank] = {kind: t / wall if wall > 0 else 0.0 for kind, t in seconds.items()}
    return out


def mfu(tokens_per_s: float, n_params: int, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation: 6·N FLOPs per token, over the peak FLOP/s of all ranks."""
    return 6 * n_params * tokens_per_s / (world_size * peak_flops)


def scaling_efficiency(tokens_per_s_1: float, tokens_per_s_n: float, n: int) -> float:
    """Throughput per rank of an ``n``-rank run over that of the same training on one rank."""
    return (tokens_per_s_n / n) / tokens_per_s_1
