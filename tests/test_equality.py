"""Equality is the oracle: every data-parallel layout reproduces the single-device run.

fp32, dropout 0, the same seed and the same global batch: the losses of every
step agree within 1e-5 relative and the exported weights within 1e-5 absolute.
Layouts train 4 steps: the forward at the starting weights, then three AdamW
updates from the state each layout keeps (a later step, at a constant learning
rate, runs the same code again). The single device also trains 20, to show it learns.
"""

from __future__ import annotations

import pytest
import torch

from gpucourse import TrainConfig, run
from gpucourse.model import MODELS, build_model

BASE = dict(batch_size=24, seq_len=32)
pytestmark = pytest.mark.timeout(240)


def _run(tmp_path, name, **kw):
    path = tmp_path / f"{name}.pt"
    result = run(TrainConfig(**BASE, **kw), timeout=180, export_weights=path, quiet=True)
    return result, torch.load(path)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The single-device run for 20 and for 4 steps (computed once)."""
    tmp = tmp_path_factory.mktemp("single")
    return {steps: _run(tmp, f"single{steps}", steps=steps) for steps in (20, 4)}


def assert_equal_to_single(result, weights, baseline):
    ref, ref_w = baseline
    assert len(result.losses) == len(ref.losses)
    for step, (a, b) in enumerate(zip(result.losses, ref.losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs single {b}"
    assert sorted(weights) == sorted(ref_w), "exported keys differ from the single-device model"
    for name, w in ref_w.items():
        diff = (weights[name] - w).abs().max().item()
        assert diff <= 1e-5, f"{name}: weights differ by {diff}"


def test_single_device_learns(baselines):
    result, weights = baselines[20]
    assert result.world_size == 1
    assert result.losses[-1] < result.losses[0] - 0.8, "tiny GPT should learn the generated corpus"
    assert sorted(weights) == sorted(build_model(MODELS["tiny"], 0).state_dict())


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("impl", ["scratch", "torch"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_data_parallel_equals_single(tmp_path, baselines, dp, impl, grad_accum):
    result, weights = _run(tmp_path, "dp", dp=dp, impl=impl, grad_accum=grad_accum, steps=4)
    assert result.world_size == dp
    assert_equal_to_single(result, weights, baselines[4])


def test_single_with_grad_accum_equals_single(tmp_path, baselines):
    result, weights = _run(tmp_path, "ga", grad_accum=4, steps=4)
    assert_equal_to_single(result, weights, baselines[4])


DATA_PARALLEL = [dict(dp=dp, impl=impl, grad_accum=ga) for dp in (2, 4) for impl in ("scratch", "torch") for ga in (1, 2)]
BUCKETED = [dict(dp=2, bucket_mb=0.02), dict(dp=3, bucket_mb=0.1, grad_accum=2), dict(dp=2, impl="torch", bucket_mb=0.05)]
ZERO = [dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=3, zero=1), dict(dp=3, zero=2), dict(dp=2, zero=2, grad_accum=2),
        dict(dp=2, zero=1, impl="torch"), dict(dp=2, zero=2, impl="torch"), dict(dp=3, zero=3, impl="torch"),
        dict(dp=2, zero=3), dict(dp=3, zero=3, grad_accum=2), dict(dp=2, zero=3, checkpoint_activations=True),
        # Selective recomputation of attention written out: the scores rebuilt in backward, bit for bit.
        dict(dp=2, zero=3, checkpoint_activations="selective", attention="math")]
ACCELERATE = [dict(dp=2, impl="accelerate", grad_accum=ga) for ga in (1, 2)]


@pytest.mark.parametrize("kw", BUCKETED, ids=str)
def test_bucketed_data_parallel_equals_single(tmp_path, baselines, kw):
    result, weights = _run(tmp_path, "bucketed", steps=4, **kw)
    assert_equal_to_single(result, weights, baselines[4])
    if kw.get("impl", "scratch") == "scratch":
        buckets = result.extras["buckets"]
        assert len(buckets) > 3, "a tiny bucket size must give several buckets"
        assert buckets[0][0] == "head.weight", "the head's gradient is ready first"
        assert buckets[-1][-1] == "wte.weight", "the embedding's gradient is ready last"


@pytest.mark.parametrize("kw", ZERO, ids=str)
def test_zero_equals_single(tmp_path, baselines, kw):
    result, weights = _run(tmp_path, "zero", steps=4, **kw)
    assert_equal_to_single(result, weights, baselines[4])


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_accelerate_equals_single_and_goes_distributed(tmp_path, baselines, grad_accum):
    result, weights = _run(tmp_path, "acc", dp=2, impl="accelerate", grad_accum=grad_accum, steps=4)
    assert result.extras["accelerate"]["num_processes"] == 2
    assert_equal_to_single(result, weights, baselines[4])
