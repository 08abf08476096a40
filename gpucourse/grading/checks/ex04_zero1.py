"""Checks of exercise 4: ZeRO-1 — shard, update the local shard, all-gather — against Adam on one device."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..core import Exercise, Fail, describe_mismatch

EXERCISE = Exercise("ex04_zero1", "ZeRO-1 optimizer step", "notebooks/03_zero_fsdp.ipynb")

LR, STEPS = 1e-2, 2


def _bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    shard = math.ceil(numel / world)
    start = min(rank * shard, numel)
    return start, min(start + shard, numel)


@EXERCISE.check("shard_bounds cuts a buffer into padded shards", points=2, hint=(
    "Every element must belong to exactly one rank, and every shard has the same padded size "
    "ceil(numel / world_size), so that an all-gather of equal pieces can put them back together. Rounding "
    "the shard size down leaves the last elements to nobody; clip both ends at numel, as the last shards "
    "can be short or even empty."))
def bounds(ctx):
    shard_bounds = ctx.load().shard_bounds
    g = ctx.generator()
    cases = [(10, 4), (2, 3), (1, 1), (7, 7), (5, 8)]
    cases += [(int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
              for _ in range(20)]
    for numel, world in cases:
        got = [tuple(shard_bounds(numel, world, r)) for r in range(world)]
        want = [_bounds(numel, world, r) for r in range(world)]
        if got != want:
            covered = sum(max(0, e - s) for s, e in got)
            extra = ""
            if covered < numel:
                extra = f"; they cover {covered} of the {numel} elements"
            elif any(e - s > math.ceil(numel / world) for s, e in got):
                extra = f"; a shard is longer than ceil({numel} / {world}) = {math.ceil(numel / world)}"
            raise Fail(f"for {numel} elements on {world} ranks the shards are {got}, expected {want}{extra}")


def _params(ctx, sizes) -> list[nn.Parameter]:
    g = ctx.generator("weights", tuple(sizes))
    return [nn.Parameter(torch.randn(s, generator=g)) for s in sizes]


def _grads(ctx, params, step) -> list[torch.Tensor]:
    g = ctx.generator("grads", step)  # the same on every rank: already averaged
    return [torch.randn(p.shape, generator=g) for p in params]


def _compare(ctx, sizes):
    mine, alone = _params(ctx, sizes), _params(ctx, sizes)
    start_weights = torch.cat([p.detach().reshape(-1) for p in mine])
    opt = ctx.load().ZeroOneAdam(mine, lr=LR)
    reference = torch.optim.Adam(alone, lr=LR)
    numel = sum(p.numel() for p in mine)
    for step in range(STEPS):
        for p, q, grad in zip(mine, alone, _grads(ctx, mine, step)):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
        got = torch.cat([p.detach().reshape(-1) for p in mine])
        want = torch.cat([q.detach().reshape(-1) for q in alone])
        problem = describe_mismatch(f"rank {ctx.rank}: the weights after step {step + 1}", got, want, 1e-6, 1e-5)
        if problem:
            if step == 0:
                moved = (got != start_weights).nonzero().reshape(-1)
                lo, hi = _bounds(numel, ctx.world_size, ctx.rank)
                if ctx.world_size > 1 and len(moved) and moved.min() >= lo and moved.max() < hi:
                    problem += (f"; only elements {lo} to {hi - 1}, this rank's own shard, changed: the "
                                f"other ranks' updated shards never arrived")
                elif not len(moved):
                    problem += "; no weight changed at all"
            raise Fail(problem)
    return opt, numel


@EXERCISE.check("a ZeRO-1 step equals Adam on one device (2 ranks)", points=3, world_size=2, hint=(
    "Three moves: slice this rank's part of the flattened gradient, let Adam update this rank's copy of its "
    "shard, then all-gather every rank's shard (padded to equal size) and copy the gathered values back "
    "into the parameters. Adam is element-wise, so updating the shards separately gives the same numbers."))
def equals_adam(ctx):
    _compare(ctx, [(3, 4), (5,), (2, 3)])


@EXERCISE.check("Adam's state lives only on this rank's shard", points=2, world_size=2, hint=(
    "The memory ZeRO-1 saves is Adam's two moments: build self.optimizer over this rank's shard of the "
    "weights (one tensor of about numel / world_size elements), not over the model's parameters."))
def state_sharded(ctx):
    opt, numel = _compare(ctx, [(8, 4), (6,)])
    inner = getattr(opt, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise Fail("the ZeroOneAdam has no self.optimizer (the torch.optim.Adam over this rank's shard)")
    held = sum(t.numel() for state in inner.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)
    shard = math.ceil(numel / ctx.world_size)
    if held > 2 * shard:
        raise Fail(f"rank {ctx.rank}'s optimizer holds {held} numbers of state for {numel} parameters on "
                   f"{ctx.world_size} ranks; a shard's two moments are {2 * shard}")


@EXERCISE.check("3 ranks, sizes not divisible by 3", points=2, world_size=3, hint=(
    "With 3 ranks, 31 elements make shards of 11, 11 and 9, and 2 elements make 1, 1 and an empty one. "
    "Pad every rank's shard to the same length before the all-gather, and drop the padding after."))
def three_ranks(ctx):
    _compare(ctx, [(4, 5), (7,), (2, 2)])   # 31 elements
    _compare(ctx, [(2,)])                   # fewer elements than ranks


@EXERCISE.check("one rank", points=1, world_size=1, hint=(
    "With one rank the shard is the whole buffer, and the all-gather hands it back unchanged: the step is "
    "plain Adam."))
def one_rank(ctx):
    _compare(ctx, [(3, 3), (4,)])
