"""What a run records about itself: bytes moved, memory held, and when communication happens."""

from __future__ import annotations

import pytest

from gpucourse import TrainConfig, run
from gpucourse.model import build_model
from gpucourse.modeled.memory import stage_units
from gpucourse.parallel.zero import memory_formula
from gpucourse.parallel.zero3 import memory_formula as zero3_formula

pytestmark = pytest.mark.timeout(240)
BASE = dict(batch_size=12, seq_len=32, steps=3)
P = sum(p.numel() for p in build_model(TrainConfig().model_config(), 0).parameters())


_RUNS: dict = {}


def _run(**kw):
    """Each layout trains once per session; the tests that read it share the result."""
    key = tuple(sorted(kw.items()))
    if key not in _RUNS:
        _RUNS[key] = run(TrainConfig(**BASE, **kw), timeout=180, quiet=True)
    return _RUNS[key]


def _bus_per_step(result, step):
    return sum(c["bus_bytes"] for c in result.comm if c["step"] == step)


@pytest.mark.parametrize("kw", [dict(dp=2), dict(dp=3, grad_accum=2), dict(dp=2, bucket_mb=0.05)], ids=str)
def test_data_parallel_moves_every_gradient_once_per_step(kw):
    result = _run(**kw)
    dp = kw["dp"]
    assert result.comm_bytes["per_step"] == [dp * 4 * P] * BASE["steps"]
    assert set(result.comm_bytes["per_op"]) == {"broadcast", "all_reduce"}  # broadcast: the start-up copy only


@pytest.mark.parametrize("dp", [2, 3])
def test_zero_moves_what_its_algorithm_must(dp):
    plain, z1, z2 = _run(dp=dp), _run(dp=dp, zero=1), _run(dp=dp, zero=2)
    padded = -(-P // dp) * dp
    assert z1.comm_bytes["per_step"] == [dp * (4 * padded + 4 * padded)] * BASE["steps"]  # all-reduce + all-gather
    assert z2.comm_bytes["per_step"] == [dp * (4 * padded + 4 * padded)] * BASE["steps"]  # reduce-scatter + all-gather
    ratio = _bus_per_step(z2, 1) / _bus_per_step(plain, 1)
    assert ratio == pytest.approx(padded / P, rel=1e-9), "ZeRO-2 moves what data parallelism moves (ring count)"


@pytest.mark.parametrize("dp,grad_accum", [(2, 1), (3, 2)])
def test_zero3_gathers_each_block_twice_and_reduce_scatters_it_once(dp, grad_accum):
    result = _run(dp=dp, zero=3, grad_accum=grad_accum)
    units = stage_units(TrainConfig().model_config(), 1, 0, 1)
    padded = {name: -(-n // dp) * dp for name, n in units.items()}
    blocks, root = sum(n for name, n in padded.items() if name != "root"), padded["root"]
    # Per microbatch: each block gathered before forward and before backward, the root once (kept between);
    # every unit's gradient reduce-scattered once. Counted per rank, summed over the dp ranks.
    per_microbatch = 4 * (2 * blocks + root) + 4 * (blocks + root)
    assert result.comm_bytes["per_step"] == [dp * grad_accum * per_microbatch] * BASE["steps"]
    plain = _run(dp=dp)
    ratio = _bus_per_step(result, 1) / _bus_per_step(plain, 1) / grad_accum
    assert ratio == pytest.approx((1.5 * blocks + root) / P, rel=1e-9), "1.5× DP's bytes, less on the root"
    assert ratio > 1.3


@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 0), (2, 1), (2, 2), (3, 1), (3, 2), (2, 3), (3, 3)])
def test_memory_per_rank_equals_the_formula(dp, zero):
    result = _run(dp=dp, zero=zero)
    if zero == 3:  # scratch ZeRO-3 pads each unit (block, root) to a multiple of dp on its own
        expected = zero3_formula(stage_units(TrainConfig().model_config(), 1, 0, 1), dp)
        assert result.extras["zero"]["gathered_peak_bytes"] == expected.pop("gathered")
    else:
        expected = memory_formula(P, dp, zero)
    assert len(result.memory) == dp
    for rank, measured in result.memory.items():
        assert {k: measured[k] for k in expected} == expected, f"rank {rank}"


def test_bucketed_communication_overlaps_backward():
    result = _run(dp=2, bucket_mb=0.02)
    for rank in (0, 1):
        spans = [s for s in result.timeline if s["rank"] == rank and s["step"] == 2]
        backward_end = max(s["end_s"] for s in spans if s["kind"] == "backward")
        comm = [s for s in spans if s["kind"] == "comm"]
        assert len(comm) == len(result.extras["buckets"]) > 3
        assert any(c["start_s"] < backward_end for c in comm), "no bucket was launched during backward"


def test_timeline_spans_are_well_formed():
    result = _run(dp=2)
    kinds = {s["kind"] for s in result.timeline}
    assert {"forward", "backward", "comm", "optimizer", "step"} <= kinds
    for s in result.timeline:
        assert s["end_s"] >= s["start_s"] >= 0
        assert set(s) >= {"rank", "kind", "name", "start_s", "end_s", "microbatch", "step"}
