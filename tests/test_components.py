"""The strategies as components of a training loop that is not the course's: a module to wrap, a call after
backward, an optimizer to wrap — and the loop, whatever it does, equals one device."""

from __future__ import annotations

import pytest
import torch

from gpucourse import launch

import rankfns

pytestmark = pytest.mark.timeout(240)
KINDS = ["dp", "buckets", "one-bucket", "accumulated", "sharded", "sharded-gradients", "flat-1", "flat-2"]


@pytest.fixture(scope="module")
def loops():
    """Every kind on 2 ranks in one launch, and the loop on one device."""
    per_rank = launch(rankfns.third_party_loops, KINDS, world_size=2, timeout=180, quiet=True)
    return per_rank, rankfns.third_party_loop("single")


@pytest.mark.parametrize("kind", KINDS)
def test_a_loop_of_ones_own_through_each_component_equals_one_device(loops, kind):
    per_rank, single = loops
    for rank, outputs in enumerate(per_rank):
        got = outputs[kind]
        assert got["losses"] == pytest.approx(single["losses"], rel=1e-5), (kind, rank)
        assert got["lr"] == single["lr"] == [0.2 * 0.5**3] * 2  # the scheduler drove the wrapped optimizer
        for name, want in single["weights"].items():
            assert (got["weights"][name] - want).abs().max().item() <= 1e-6, (kind, rank, name)


@pytest.mark.parametrize("kind", ["sharded", "sharded-gradients"])
def test_the_sharded_optimizer_keeps_a_share_of_the_state_and_reloads_it(loops, kind):
    per_rank, _ = loops
    shares = [outputs[kind] for outputs in per_rank]
    # Handed out greedily by size: the first weight (256 numbers) to rank 0, the second (128) and both biases
    # (32, 4) to rank 1, whose total stays under rank 0's: each tensor stepped by one rank.
    assert [s["held"] for s in shares] == [[0, 1], [1, 2]]
    assert all(s["reloaded"] for s in shares) and all(s["lr_reloaded"] == [0.2 * 0.5**3] * 2 for s in shares)


@pytest.mark.parametrize("kind", ["flat-1", "flat-2"])
def test_the_flat_sharded_optimizer_cuts_each_group_into_equal_shards_and_reloads_them(loops, kind):
    """Each parameter group in one flat buffer, cut in two: the weights (256 + 128 numbers) 192 a rank, the biases
    (32 + 4) 18 — one shard of each group per rank, stepped with that group's settings."""
    per_rank, _ = loops
    shares = [outputs[kind] for outputs in per_rank]
    assert [s["shard_sizes"] for s in shares] == [[192, 18], [192, 18]] and [s["held"] for s in shares] == [[1, 1]] * 2
    assert all(s["reloaded"] for s in shares) and all(s["lr_reloaded"] == [0.2 * 0.5**3] * 2 for s in shares)


def test_the_course_zero_trainer_steps_through_the_flat_sharded_optimizer():
    import torch.distributed as dist

    from gpucourse.parallel.zero import FlatShardedOptimizer, ZeroScratch

    dist.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
        trainer = ZeroScratch(model, dist.group.WORLD, stage=2, lr=0.1, optimizer_class=torch.optim.SGD)
        assert isinstance(trainer.optimizer, FlatShardedOptimizer) and trainer.optimizer.stage == 2
        assert isinstance(trainer.optimizer.inner, torch.optim.SGD)  # the trainer's optimizer steps the shards
        assert trainer.optimizer.parts[0].numel == sum(p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_zero2_as_an_optimizer_frees_every_gradient_and_holds_its_share(loops):
    """After backward no rank has a parameter's .grad (each went to its owner and was freed); between backward and
    step each rank holds the gradients of what it owns: rank 0 the first weight (256 floats), rank 1 the rest."""
    per_rank, _ = loops
    assert all(all(outputs["sharded-gradients"]["freed"]) for outputs in per_rank)
    assert [outputs["sharded-gradients"]["gradient_bytes"] for outputs in per_rank] == [256 * 4, (128 + 32 + 4) * 4]


def test_components_build_no_optimizer_and_one_bucket_means_one(loops):
    import torch.distributed as dist

    from gpucourse.parallel.data_parallel import DataParallel
    from gpucourse.parallel.data_parallel_buckets import DataParallelBuckets

    store = torch.distributed.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
        for component in (DataParallel(model), DataParallelBuckets(model), DataParallelBuckets(model, bucket_mb=1e-4)):
            assert not any(isinstance(v, torch.optim.Optimizer) for v in vars(component).values())
            assert list(component.parameters()) == list(model.parameters()) and component.module is model
        assert len(DataParallelBuckets(model).buckets) == 1 and len(DataParallelBuckets(model, bucket_mb=1e-4).buckets) == 4
    finally:
        dist.destroy_process_group()


def test_the_components_are_importable_from_gpucourse_parallel():
    """Another loop imports them as it imports DDP: from the package of strategies, by name."""
    import gpucourse.parallel as parallel
    from gpucourse.parallel.data_parallel import DataParallel
    from gpucourse.parallel.sharded_optimizer import ShardedGradientsOptimizer

    assert [getattr(parallel, name).__name__ for name in parallel.COMPONENTS] == list(parallel.COMPONENTS)
    assert parallel.DataParallel is DataParallel and parallel.ShardedGradientsOptimizer is ShardedGradientsOptimizer
