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


@pytest.mark.parametrize("strategy", ["dp", "buckets", "zero1", "zero2", "zero3"])
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


def test_a_learners_optimizer_with_its_own_settings_matches_single_device():
    # SGD with momentum and AdamW(betas=(0.9, 0.99), weight_decay=0.1), each strategy, in one launch of 2 ranks.
    strategies, optimizers = ["dp", "buckets", "zero1", "zero2", "zero3"], list(awkward_models.OPTIMIZERS)
    single = {o: awkward_models.train("single", optimizer=o) for o in optimizers}
    assert not torch.allclose(single["sgd"]["odd"], single["adamw"]["odd"]), "the two optimizers must differ"
    for rank, runs in enumerate(launch(awkward_models.train_each, strategies, optimizers, world_size=2, timeout=90,
                                       quiet=True)):
        for run_name, weights in runs.items():
            want = single[run_name.split()[1]]
            for name, w in want.items():
                diff = (weights[name] - w).abs().max().item()
                assert diff <= 1e-5, f"{run_name} rank {rank}: {name} differs by {diff}"


def test_single_device_actually_trains(single):
    start = awkward_models.make_model().state_dict()
    assert not torch.allclose(single["emb.weight"], start["emb.weight"])
    assert not torch.allclose(single["odd"], start["odd"])
