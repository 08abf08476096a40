"""Checks of exercise 2: data-parallel gradient averaging, against one device taking the same step."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core import Exercise, Fail, describe_mismatch

EXERCISE = Exercise("ex02_data_parallel", "Data-parallel gradient averaging", "notebooks/02_data_parallelism.ipynb")

BATCH, LR = 6, 0.5  # 6 rows: 2 and 3 ranks both divide it
STALE = 3.0         # the value of the gradients left over from "an earlier step"


class Net(nn.Module):
    """A small awkward model: two layers, a frozen parameter and one the forward never uses.

    It records each input it sees, so a check can tell which rows a rank trained on.
    """

    def __init__(self, g: torch.Generator):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(7), requires_grad=False)  # frozen
        self.unused = nn.Parameter(torch.zeros(2))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p is self.scale else 0.0))
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return self.fc2(torch.tanh(self.fc1(x) * self.scale))


def _model(ctx) -> Net:
    return Net(ctx.generator("weights"))  # the same weights on every rank


def _batch(ctx):
    g = ctx.generator("batch")
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and n != "unused"]


def _rank_gradients(ctx, model, rank):
    g = ctx.generator("grads", rank)
    return {n: torch.randn(p.shape, generator=g) for n, p in _trainable(model)}


def _diagnose_scale(what: str, got: torch.Tensor, want: torch.Tensor, n: int, base: torch.Tensor | None = None):
    """A sentence for ``got`` being n or 1/n times ``want`` (both measured from ``base``)."""
    got_d, want_d = (got - base, want - base) if base is not None else (got, want)
    if torch.allclose(got_d, want_d * n, atol=1e-5, rtol=1e-4):
        return f"{what} is {n} times what it should be: summed over ranks, but not divided by their number"
    if torch.allclose(got_d, want_d / n, atol=1e-6, rtol=1e-4):
        return f"{what} is 1/{n} of what it should be: divided by the number of ranks twice"
    return None


@EXERCISE.check("average_gradients averages over 2 ranks", points=3, world_size=2, hint=(
    "dist.all_reduce sums a tensor over the ranks, in place. The average is that sum divided by the world "
    "size, once. Each rank must end with the same gradients, and only .grad may change."))
def averages(ctx):
    model = _model(ctx)
    grads = [_rank_gradients(ctx, model, r) for r in range(ctx.world_size)]
    for n, p in _trainable(model):
        p.grad = grads[ctx.rank][n].clone()
    ctx.load().average_gradients(model)
    for n, p in _trainable(model):
        want = sum(g[n] for g in grads) / ctx.world_size
        problem = describe_mismatch(f"rank {ctx.rank}: {n}.grad", p.grad, want)
        if problem:
            if torch.is_tensor(p.grad) and p.grad.shape == want.shape:
                if torch.equal(p.grad, grads[ctx.rank][n]):
                    problem += "; it is still this rank's own gradient"
                else:
                    problem = _diagnose_scale(f"rank {ctx.rank}: {n}.grad", p.grad, want, ctx.world_size) or problem
            raise Fail(problem)


def _step_alone(ctx, x, y) -> Net:
    model = _model(ctx)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    return model


def _step_dp(ctx):
    x, y = _batch(ctx)
    model = _model(ctx)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _, p in _trainable(model):  # gradients left over from an earlier step
        p.grad = torch.full_like(p, STALE)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = x.clone(), y.clone()
    ctx.load().data_parallel_step(model, opt, F.mse_loss, xs, ys)
    if not (torch.equal(xs, x) and torch.equal(ys, y)):
        raise Fail(f"rank {ctx.rank}: data_parallel_step changed the inputs or targets it was given")
    return model, before, x, y


@EXERCISE.check("each rank trains on its own share of the batch", points=2, world_size=2, hint=(
    "Data parallelism splits the global batch: with n ranks, rank r takes rows r*B/n to (r+1)*B/n and runs "
    "the model on those only. Running every rank on the whole batch gives the right weights at n times "
    "the cost, which is exactly what data parallelism is there to avoid."))
def own_share(ctx):
    model, _, x, _ = _step_dp(ctx)
    share = BATCH // ctx.world_size
    want = x[ctx.rank * share:(ctx.rank + 1) * share]
    if len(model.seen) != 1:
        raise Fail(f"rank {ctx.rank} ran the model's forward {len(model.seen)} times in one step, not once")
    seen = model.seen[0]
    if seen.shape == x.shape:
        raise Fail(f"rank {ctx.rank} ran forward on all {BATCH} rows, the whole global batch, not its {share}")
    if seen.shape != want.shape or not torch.equal(seen, want):
        rows = [i for i in range(BATCH) if any(torch.equal(x[i], s) for s in seen)]
        raise Fail(f"rank {ctx.rank} trained on rows {rows} of the batch; its share is rows "
                   f"{list(range(ctx.rank * share, (ctx.rank + 1) * share))}")


def _equals_single_device(ctx):
    model, before, x, y = _step_dp(ctx)
    alone = dict(_step_alone(ctx, x, y).named_parameters())
    for n, p in model.named_parameters():
        problem = describe_mismatch(f"rank {ctx.rank}: {n} after the step", p.detach(), alone[n].detach())
        if problem:
            scale = _diagnose_scale(f"rank {ctx.rank}: the change of {n}", p.detach(), alone[n].detach(),
                                    ctx.world_size, base=before[n])
            if not scale and p.requires_grad and torch.allclose(p.detach(), alone[n].detach() - LR * STALE,
                                                                atol=1e-5, rtol=1e-4):
                scale = (f"rank {ctx.rank}: {n} moved as if the gradient left over from an earlier step had "
                         f"been added to this step's")
            raise Fail(scale or problem + " (compared with one device taking the step on the whole batch)")


@EXERCISE.check("one step on 2 ranks equals the single-device step", points=2, world_size=2, hint=(
    "Every rank's loss is a mean over its share, so averaging the ranks' gradients (dividing the sum by n "
    "once) gives the gradient of the mean over the whole batch. Clear the gradients left from an earlier "
    "step before backward (optimizer.zero_grad()), or they are added in."))
def equals_single_2(ctx):
    _equals_single_device(ctx)


@EXERCISE.check("average_gradients skips parameters without a gradient", points=1, world_size=3, hint=(
    "A frozen parameter (requires_grad=False), or one the forward did not use, has .grad None on every "
    "rank: there is nothing to average, so leave it None rather than giving it a gradient."))
def skips_none(ctx):
    model = _model(ctx)
    grads = [_rank_gradients(ctx, model, r) for r in range(ctx.world_size)]
    for n, p in _trainable(model):
        p.grad = grads[ctx.rank][n].clone()
    ctx.load().average_gradients(model)
    for name in ("scale", "unused"):
        if getattr(model, name).grad is not None:
            raise Fail(f"rank {ctx.rank}: {name} had no gradient, but has one after average_gradients")
    for n, p in _trainable(model):
        problem = describe_mismatch(f"rank {ctx.rank}: {n}.grad", p.grad, sum(g[n] for g in grads) / ctx.world_size)
        if problem:
            raise Fail(problem)


@EXERCISE.check("one step on 3 ranks equals the single-device step", points=2, world_size=3, hint=(
    "The same step on 3 ranks: each takes 2 of the 6 rows. Divide by the world size you are running on "
    "(dist.get_world_size()), not by a number written into the code."))
def equals_single_3(ctx):
    _equals_single_device(ctx)
