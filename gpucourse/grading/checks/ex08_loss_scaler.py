"""Checks of exercise 8: the fp16 dynamic loss scaler, against the course's scaler and torch.amp.GradScaler."""

from __future__ import annotations

import torch
import torch.nn as nn

from ...parallel.precision import DynamicLossScaler
from ..core import Exercise, Fail, describe_mismatch

EXERCISE = Exercise("ex08_loss_scaler", "Dynamic loss scaler", "notebooks/07_memory_batch.ipynb")

S = 1024.0  # a power of two: dividing by it is exact, so the checks can compare bit for bit


def _found(value, call: str) -> bool:
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise Fail(f"{call} returned {type(value).__name__}, not True or False")
    return bool(value)


@EXERCISE.check("scale multiplies the loss, unscale_ divides in place", points=2, hint=(
    "scale(loss) is loss * S, so backward produces S times the true gradients; unscale_ must undo exactly "
    "that, g.div_(S) on each gradient tensor itself (the optimizer reads those very tensors, so a new "
    "tensor does not help). inf / S is still inf and NaN stays NaN: after the division, "
    "(~torch.isfinite(g)).any() says whether this step overflowed; torch.isinf alone misses NaN."))
def unscale(ctx):
    scaler = ctx.load().LossScaler(init_scale=S)
    loss = torch.tensor(0.75, requires_grad=True)
    scaled = scaler.scale(loss)
    if not torch.is_tensor(scaled) or scaled.item() != 0.75 * S:
        raise Fail(f"with a scale of {S:g}, scale(tensor(0.75)) = {scaled!r}; expected tensor({0.75 * S:g})")
    g = ctx.generator()
    grads = [torch.randn(3, 4, generator=g) * S, (torch.randn(5, generator=g) * S).half(), torch.randn(2, 2)]
    before = [t.clone() for t in grads]
    found = _found(scaler.unscale_(grads), "unscale_ of finite gradients")
    for i, (t, was) in enumerate(zip(grads, before)):
        if torch.equal(t, was):
            raise Fail(f"after unscale_, gradient {i} is unchanged; it should have been divided by the scale "
                       f"{S:g} in place")
        if torch.equal(t, was * S):
            raise Fail(f"after unscale_, gradient {i} was multiplied by the scale {S:g}, not divided by it")
        problem = describe_mismatch(f"gradient {i} after unscale_", t, was / S, 0.0, 1e-6)
        if problem:
            raise Fail(problem)
    if found:
        raise Fail("unscale_ of finite gradients returned True (an overflow)")
    if scaler.loss_scale != S:
        raise Fail(f"unscale_ changed the scale to {scaler.loss_scale!r}; only update changes it")
    for what, bad in (("an inf", float("inf")), ("a NaN", float("nan")), ("a -inf", -float("inf"))):
        for where in (0, 1):
            grads = [torch.randn(4, generator=g), torch.randn(3, generator=g).half()]
            grads[where][int(torch.randint(0, 3, (1,), generator=g))] = bad
            call = f"unscale_ of gradients holding {what} (in a {grads[where].dtype} tensor)"
            if not _found(scaler.unscale_(grads), call):
                raise Fail(f"{call} returned False: the overflow went unnoticed")


def _history(scaler, found: list[bool], attribute: str) -> list[float]:
    out = []
    for f in found:
        scaler.update(f)
        out.append(float(getattr(scaler, attribute)))
    return out


def _compare_history(ctx, found: list[bool]) -> None:
    kw = dict(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    got = _history(ctx.load().LossScaler(**kw), found, "loss_scale")
    want = _history(DynamicLossScaler(**kw), found, "scale")
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    events = ", ".join("overflow" if f else "good" for f in found[:i + 1])
    since = next((k for k in range(i, -1, -1) if found[k]), None)
    extra = ""
    if since is not None and got[i] > want[i]:
        extra = (f"; it grew {i - since} good step{'s' * (i - since != 1)} after the overflow, with "
                 f"growth_interval=3")
    raise Fail(f"LossScaler({', '.join(f'{k}={v:g}' for k, v in kw.items())}): after the updates {events}, "
               f"the scale is {got[i]:g}; expected {want[i]:g}{extra}")


@EXERCISE.check("the scale grows after growth_interval good steps", points=1, hint=(
    "Count good steps (update(False)); when the count reaches growth_interval, multiply the scale by "
    "growth_factor and start counting from 0 again, so that it grows once per growth_interval good steps, "
    "not on every step after the first interval."))
def grows(ctx):
    _compare_history(ctx, [False] * 10)


@EXERCISE.check("an overflow backs off and restarts the count", points=1, hint=(
    "update(True) multiplies the scale by backoff_factor at once and sets the count of good steps back to "
    "0: the scale that just overflowed must earn growth_interval good steps in a row before it grows "
    "again. Keep the old count and the scale climbs straight back to the value that overflowed."))
def backs_off(ctx):
    _compare_history(ctx, [False, False, True, False, False, False, False, True, True, False, False, False])


def _model(ctx, key) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=ctx.generator("model", key))))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model


@EXERCISE.check("a skipped step changes no weight and no optimizer state", points=2, hint=(
    "When unscale_ finds an inf or a NaN, the gradients are garbage: step must not call optimizer.step() "
    "at all (one inf in SGD's momentum, or in Adam's moments, poisons every later step), and must still "
    "update the scale. Parameters whose .grad is None are left out of the unscaling."))
def skipped(ctx):
    model = _model(ctx, "skip")
    frozen = nn.Parameter(torch.ones(2))  # in the optimizer, but never gets a gradient
    opt = torch.optim.SGD(list(model.parameters()) + [frozen], lr=0.1, momentum=0.9)
    scaler = ctx.load().LossScaler(init_scale=S, growth_interval=100)
    x = torch.randn(6, 4, generator=ctx.generator("x"))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(x).pow(2).mean()).backward()
    model[2].bias.grad[1] = float("inf")
    stepped = _found(scaler.step(opt), "step")
    for name, (p, was) in zip([n for n, _ in model.named_parameters()], zip(model.parameters(), before)):
        if not torch.equal(p.detach(), was):
            raise Fail(f"after a step whose gradients held an inf, parameter {name} changed (now "
                       f"{p.detach().reshape(-1)[:3].tolist()}…): the optimizer stepped")
    if opt.state:
        raise Fail("after a step whose gradients held an inf, SGD has momentum buffers: the optimizer stepped")
    if stepped:
        raise Fail("step returned True (stepped) for gradients holding an inf")
    if scaler.loss_scale != S * 0.5:
        raise Fail(f"after the overflow the scale is {scaler.loss_scale!r}; expected {S * 0.5:g}")
    opt.zero_grad()
    reference = _model(ctx, "skip")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference(x).pow(2).mean().backward()
    ref_opt.step()
    scaler.scale(model(x).pow(2).mean()).backward()
    if not _found(scaler.step(opt), "step"):
        raise Fail("step returned False (skipped) for finite gradients")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        problem = describe_mismatch(f"after the next, finite step, {name}", p.detach(), q.detach(), 1e-6, 1e-5)
        if problem:
            raise Fail(problem)


@EXERCISE.check("training with overflows follows torch.amp.GradScaler", points=1, hint=(
    "PyTorch's GradScaler does the same: scale(loss), then step(optimizer) unscales the gradients (by "
    "multiplying with 1/S), skips optimizer.step() if any is inf or NaN, and update() backs off or counts "
    "towards growth. Same numbers in, same weights and same scale out, step after step."))
def follows_grad_scaler(ctx):
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    mine, theirs = _model(ctx, "sequence"), _model(ctx, "sequence")
    opt = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    scaler, grad_scaler = ctx.load().LossScaler(**kw), torch.amp.GradScaler("cpu", **kw)
    g = ctx.generator("batches")
    overflow = {2, 3, 6}
    for step in range(9):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        for model, sc, o in ((mine, scaler, opt), (theirs, grad_scaler, ref_opt)):
            o.zero_grad()
            sc.scale(nn.functional.mse_loss(model(x), y)).backward()
            if step in overflow:
                model[0].weight.grad[step % 4, 1] = float("inf")
        scaler.step(opt)
        grad_scaler.step(ref_opt)
        grad_scaler.update()
        say = f"step {step}{' (an inf in a gradient)' if step in overflow else ''}"
        if float(scaler.loss_scale) != grad_scaler.get_scale():
            raise Fail(f"after {say} the scale is {scaler.loss_scale!r}; GradScaler's is {grad_scaler.get_scale():g}")
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            problem = describe_mismatch(f"after {say}, {name}", p.detach(), q.detach(), 1e-6, 1e-5)
            if problem:
                raise Fail(f"{problem}, against GradScaler")


@EXERCISE.check("small fp16 gradients survive with scaling", points=1, hint=(
    "A gradient computed in fp16 below about 3e-8 rounds to 0 on the way back. Scaled by S, the same "
    "gradient is S times larger and representable; the division by S must then happen where the gradient "
    "is fp32 (here, the .grad of an fp32 parameter) so that it stays non-zero."))
def underflow(ctx):
    g = ctx.generator()
    a = ((1 + 0.4 * torch.rand(8, generator=g)) * 2.0**-13).half()   # a * b < 2**-25: 0 in fp16
    b = ((1 + 0.4 * torch.rand(8, generator=g)) * 2.0**-13).half()
    want = a.float() * b.float()

    def grad_of_w(scaler):
        w = nn.Parameter(torch.ones(8))
        loss = ((w.half() * a) * b).float().sum()   # the backward multiplies in fp16
        (scaler.scale(loss) if scaler else loss).backward()
        return w

    plain = grad_of_w(None).grad
    scaler = ctx.load().LossScaler(init_scale=2.0**12)
    w = grad_of_w(scaler)
    found = _found(scaler.unscale_([w.grad]), "unscale_")
    if found:
        raise Fail(f"unscale_ reported an overflow for gradients of about {want.mean():.2g}")
    zeros = int((w.grad == 0).sum())
    if zeros:
        raise Fail(f"with a scale of 2**12, {zeros} of 8 gradients of about {want.mean():.2g} are 0 after "
                   f"unscale_ (without scaling {int((plain == 0).sum())} of 8 are): they underflowed in fp16")
    problem = describe_mismatch("the unscaled gradient", w.grad, want, 1e-12, 2e-3)
    if problem:
        raise Fail(problem)


@EXERCISE.check("ranks agree on skipping a step (2 ranks)", points=2, world_size=2, hint=(
    "With ZeRO or tensor parallelism each rank checks different gradients, and one rank can overflow alone. "
    "If only that rank skips, the ranks' weights (and scales) part ways for good. All-reduce the found-inf "
    "flag with ReduceOp.MAX before deciding, so every rank skips when any rank overflowed."))
def ranks_agree(ctx):
    g = ctx.generator("shard", ctx.rank)  # each rank holds its own shard of the parameters
    shard = nn.Parameter(torch.randn(6, generator=g))
    opt = torch.optim.SGD([shard], lr=0.1, momentum=0.9)
    scaler = ctx.load().LossScaler(init_scale=S, growth_interval=100)
    before = shard.detach().clone()
    shard.grad = torch.randn(6, generator=g) * S
    if ctx.rank == 1:
        shard.grad[2] = float("inf")
    stepped = _found(scaler.step(opt), "step")
    mine = "its own gradients overflowed" if ctx.rank == 1 else "its own gradients were finite but rank 1's overflowed"
    if stepped or not torch.equal(shard.detach(), before):
        raise Fail(f"rank {ctx.rank}: {mine}; rank {ctx.rank} stepped anyway, so the ranks no longer hold "
                   f"the weights of one model")
    if scaler.loss_scale != S / 2:
        raise Fail(f"rank {ctx.rank}: {mine}; its scale is {scaler.loss_scale!r}, expected {S / 2:g} on "
                   f"every rank")
    shard.grad = torch.randn(6, generator=g) * (S / 2)
    if not _found(scaler.step(opt), "step"):
        raise Fail(f"rank {ctx.rank}: no rank's gradients overflowed, yet step skipped")
