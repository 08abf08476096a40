"""Data parallel and ZeRO on a model with tied, frozen, unused and odd-sized parameters."""

from __future__ import annotations

import pytest
import torch

from gpucourse import launch

import awkward_models

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def single():
    return awkward_models.train("single")


@pytest.mark.parametrize("strategy", ["dp", "buckets", "zero1", "zero2"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_awkward_model_matches_single_device(single, strategy, world_size):
    results = launch(awkward_models.train, strategy, world_size=world_size, timeout=60, quiet=True)
    start = awkward_models.make_model().state_dict()
    for rank, weights in enumerate(results):
        for name, w in single.items():
            diff = (weights[name] - w).abs().max().item()
            assert diff <= 1e-5, f"{strategy} dp={world_size} rank {rank}: {name} differs by {diff}"
        assert torch.equal(weights["frozen.weight"], start["frozen.weight"]), "a frozen parameter moved"
        assert torch.equal(weights["unused"], start["unused"]), "a parameter with no gradient moved"
        assert weights["emb.weight"].data_ptr() != 0 and torch.equal(weights["emb.weight"], weights["out.weight"])


def test_single_device_actually_trains(single):
    start = awkward_models.make_model().state_dict()
    assert not torch.allclose(single["emb.weight"], start["emb.weight"])
    assert not torch.allclose(single["odd"], start["odd"])
