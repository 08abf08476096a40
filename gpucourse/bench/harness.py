"""What every figure that trains uses: its ranks, its time limit, its layout, and training configs timed side by
side."""

from __future__ import annotations

import statistics

from ..config import TrainConfig
from ..train import run
from ..course.readings import WARMUP_STEPS, interleave

# Ranks of every figure: the smallest group that communicates.
RANKS = 2
RUN_TIMEOUT_S = 600


# --- step times of whole training runs -------------------------------------------------


def steady_step_times(config: TrainConfig) -> list[float]:
    """Train ``config`` once; return its step times without the warm-up steps."""
    result = run(config, timeout=RUN_TIMEOUT_S, quiet=True)
    return result.step_times_s[WARMUP_STEPS:]


def compare_runs(configs: dict[str, TrainConfig], reps: int) -> tuple[dict, dict[str, float]]:
    """Train each config ``reps`` times, interleaved; return the raw step times and each one's median.

    The median is over every steady step of every repetition of that config.
    """
    runs = interleave({name: (lambda c=c: steady_step_times(c)) for name, c in configs.items()}, reps)
    medians = {name: statistics.median(t for r in rs for t in r) for name, rs in runs.items()}
    detail = {name: {"config": configs[name].to_dict(), "median_step_s": medians[name],
                     "run_medians_s": [statistics.median(r) for r in rs], "step_times_s": rs}
              for name, rs in runs.items()}
    return detail, medians


def bench_config(**changes) -> TrainConfig:
    """The layout the step-time figures train: tiny GPT, 2 data-parallel ranks, 16 sequences a step."""
    return TrainConfig(**{"model": "tiny", "dp": RANKS, "batch_size": 16, "impl": "torch", **changes})


def memory_ratios(configs: list[TrainConfig], expected) -> dict:
    ratios = {}
    for cfg in configs:
        measured = run(cfg, timeout=RUN_TIMEOUT_S, quiet=True).memory
        for rank, mem in measured.items():
            want = expected(cfg, int(rank))
            for k in ("weights", "gradients", "optimizer"):
                ratios[f"{cfg.layout()} zero{cfg.zero} rank{rank} {k}"] = mem[k] / want[k]
    return ratios


def worst_ratio(ratios: dict) -> float:
    return max(ratios.values(), key=lambda r: abs(r - 1.0))
