"""Mutant of ex09_profile_analysis: adds up each kind's span durations, so time two spans cover at once counts twice."""

COMPUTE = ("forward", "backward", "optimizer")


def time_shares(spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    """Per rank, the shares of step ``step``'s wall time spent computing, communicating and idle."""
    out = {}
    for window in spans:
        if window["kind"] != "step" or window["step"] != step:
            continue
        rank, lo, hi = window["rank"], window["start_s"], window["end_s"]
        seconds = {"compute": 0.0, "comm": 0.0}
        for s in spans:
            if s["rank"] == rank and s["step"] == step and (s["kind"] in COMPUTE or s["kind"] == "comm"):
                kind = "comm" if s["kind"] == "comm" else "compute"
                seconds[kind] += max(0.0, min(s["end_s"], hi) - max(s["start_s"], lo))
        wall = hi - lo
        shares = {kind: t / wall for kind, t in seconds.items()}
        out[rank] = {**shares, "idle": 1 - shares["compute"] - shares["comm"]}
    return out


def mfu(tokens_per_s: float, n_params: int, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation: 6·N FLOPs per token, over the peak FLOP/s of all ranks."""
    return 6 * n_params * tokens_per_s / (world_size * peak_flops)


def scaling_efficiency(tokens_per_s_1: float, tokens_per_s_n: float, n: int) -> float:
    """Throughput per rank of an ``n``-rank run over that of the same training on one rank."""
    return (tokens_per_s_n / n) / tokens_per_s_1
