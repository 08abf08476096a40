"""Context parallelism equals one device, its attention equals full attention, and it moves what its formulas say.

Oracle: fp32, dropout 0, the same seed and global batch, 10 steps; losses within
1e-5 relative and exported weights within 5e-5 absolute of the single-device run.
Several layouts of one world size train in one launch, one after the other.
"""

from __future__ import annotations

import pytest
import torch

from gpucourse import launch
from gpucourse.data import context_positions
from gpucourse.model import build_model

import rankfns
from launches import assert_equal, train_launches

BASE = dict(steps=10, seq_len=32, batch_size=8)
ALGOS = ("ring", "allgather", "ulysses")
pytestmark = pytest.mark.timeout(600)

# One launch per world size; the names are the tests' ids.
LAUNCHES = {
    2: {f"cp2-{a}{'-zigzag' if z else ''}": dict(cp=2, cp_algo=a, zigzag=z) for a in ALGOS for z in (False, True)},
    4: {**{f"cp4-{a}{'-zigzag' if z else ''}": dict(cp=4, cp_algo=a, zigzag=z) for a in ALGOS for z in (False, True)},
        "dp2×cp2": dict(dp=2, cp=2), "cp2×tp2-sp": dict(cp=2, tp=2, sequence_parallel=True),
        "cp2×pp2": dict(cp=2, pp=2, microbatches=2), "zero2-dp2×cp2": dict(dp=2, cp=2, zero=2, cp_algo="allgather"),
        "zero1-dp2×cp2": dict(dp=2, cp=2, zero=1), "zero3-dp2×cp2": dict(dp=2, cp=2, zero=3, cp_algo="ulysses"),
        "dp2×cp2-buckets": dict(dp=2, cp=2, bucket_mb=0.02)},
}
LAYOUTS = {name: kw for layouts in LAUNCHES.values() for name, kw in layouts.items()}
_RUNS: dict = {}


def _results(tmp_path_factory) -> dict:
    """``{name: (config, RunResult, exported weights)}`` for every layout, and the single-device run."""
    if not _RUNS:
        _RUNS.update(train_launches(tmp_path_factory.mktemp("cp"), BASE, {1: {"single": {}}, **LAUNCHES}))
    return _RUNS


@pytest.mark.parametrize("name", LAYOUTS)
def test_equals_the_single_device_run(name, tmp_path_factory):
    runs = _results(tmp_path_factory)
    assert_equal(runs[name], runs["single"], BASE["steps"])


@pytest.mark.parametrize("algo", ALGOS)
def test_each_algorithm_moves_what_its_formula_says(algo, tmp_path_factory):
    cfg, result, _ = _results(tmp_path_factory)[f"cp2-{algo}"]
    mc, cp = cfg.model_config(), cfg.cp
    block = cfg.batch_size * (cfg.seq_len // cp) * mc.n_embd * 4  # one rank's K (or V, q, output): B·T/cp·C fp32
    params = sum(p.numel() for p in build_model(mc, 0).parameters())
    for rank in range(cp):
        ops = {c["op"]: c["bytes"] for c in result.comm if c["step"] == 1 and c["rank"] == rank and c["bytes"]}
        assert ops.pop("all_reduce") == 4 * params, "gradients averaged over dp × cp once a step"
        per_layer = {
            # K and V gathered whole forward, their gradients reduce-scattered whole backward.
            "allgather": {"all_gather": 2 * cp * block, "reduce_scatter": 2 * cp * block},
            # Forward: cp − 1 hops of K and V. Backward: cp − 1 hops of K and V, cp of their gradients.
            "ring": {"send": (cp - 1) * 2 * block + ((cp - 1) * 2 + cp * 2) * block},
            # q, k, v to heads and the output back, forward; the same four backward.
            "ulysses": {"all_to_all": 8 * block},
        }[algo]
        assert ops == {op: b * mc.n_layer for op, b in per_layer.items()}, rank


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    for cp in (2, 3, 4):
        plain = [context_positions(48, r, cp) for r in range(cp)]
        zigzag = [context_positions(48, r, cp, zigzag=True) for r in range(cp)]
        for split in (plain, zigzag):
            assert sorted(torch.cat(split).tolist()) == list(range(48))
        # Causal work of a rank: the keys each of its queries sees, summed. Equal under zig-zag only.
        work = [[int((pos + 1).sum()) for pos in split] for split in (plain, zigzag)]
        assert len(set(work[1])) == 1 and max(work[0]) > 2 * min(work[0])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_allgather_and_ulysses_equal_full_attention_forward_and_backward(world):
    # Random shapes, and tokens dealt to ranks in a random order: the masks come from positions only.
    per_rank = launch(rankfns.attention_against_full, 8, 1000 + world, world_size=world, timeout=240, quiet=True)
    for rank, cases in enumerate(per_rank):
        for case in cases:
            assert case["finite"] and case["diff"] < 1e-10, (rank, case)
