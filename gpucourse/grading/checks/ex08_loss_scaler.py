"""Checks of exercise 8: the fp16 dynamic loss scaler, against the course's scaler and torch.amp.GradScaler.

The learner's scaler runs in the sandbox, driven by the probes of
``gpucourse/grading/probes/ex08_loss_scaler.py``; the references (the course's
``DynamicLossScaler``, ``torch.amp.GradScaler``, plain SGD) run here. In the
sandbox PyTorch's scaler and its fused kernels are switched off.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...parallel.precision import DynamicLossScaler
from .. import contracts, generated
from ..core import Exercise, Fail, describe_mismatch
from ..generated import DTYPES, Int, Many, One, Shape, Space
from ..probes.ex08_loss_scaler import model_with

EXERCISE = Exercise("ex08_loss_scaler", "Dynamic loss scaler", "notebooks/07_memory_batch.ipynb",
                    forbidden_names=("torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler",
                                     "torch.cuda.amp.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
                                     "torch.cpu.amp.GradScaler", "torch.cpu.amp.grad_scaler.GradScaler",
                                     "torch._amp_update_scale_", "torch._amp_foreach_non_finite_check_and_unscale_"),
                    refusal=("the code used {op}, which this exercise switches off: write the scaler yourself "
                             "(compare yours with torch.amp.GradScaler outside the grader, once it passes)"),
                    rank_imports=("torch._dynamo",),  # the checks' optimizer steps import it
                    concept=("a dynamic loss scaler multiplies the loss so that small fp16 gradients survive, skips a "
                             "step whose gradients overflowed, and moves the scale by its own rules"),
                    section="§2 (fp16 and loss scaling)")

S = 1024.0  # a power of two: dividing by it is exact, so the checks can compare bit for bit
LR, MOMENTUM = 0.1, 0.9
SHAPES = {"0.weight": (5, 4), "0.bias": (5,), "2.weight": (3, 5), "2.bias": (3,)}  # the probes' model

# What every caller relies on besides the values (gpucourse.grading.contracts): scale leaves the loss it is given as
# it was (the loop may log it) and returns the loss's dtype; unscale_ takes gradients that are views with any
# strides (it divides them in place: that they change is its job).
SCALE = contracts.Contract("LossScaler.scale", ("loss",), unchanged=("loss",), dtype_of="loss")
UNSCALE = contracts.Contract("LossScaler.unscale_", ("grads",), strided=("grads",))


def _found(value, call: str) -> bool:
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise Fail(f"{call} returned {_kind(value)}, not True or False")
    return bool(value)


def _scale(value, when: str) -> float:
    """The ``loss_scale`` attribute the probe read, as a float; Fail if it is not a number."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Fail(f"{when}, loss_scale is {_kind(value)}; it should be a number (a Python float)")
    return float(value)


def _kind(value) -> str:
    if isinstance(value, dict) and "__type__" in value:
        return f"a {value['__type__']}"
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{value!r}" if isinstance(value, (str, int, float, type(None))) else f"a {type(value).__name__}"


def _weights(ctx, key) -> dict[str, torch.Tensor]:
    g = ctx.generator("model", key)
    return {name: torch.randn(shape, generator=g) * 0.5 for name, shape in SHAPES.items()}


def _compare_weights(got: dict, model: nn.Module, when: str, against: str = "") -> None:
    for name, p in model.named_parameters():
        problem = describe_mismatch(f"{when}, {name}", got.get(name) if isinstance(got, dict) else None,
                                    p.detach(), 1e-6, 1e-5)
        if problem:
            raise Fail(problem + against)


@EXERCISE.check("scale multiplies the loss, unscale_ divides in place", points=2, hint=(
    "scale(loss) is loss * S, so backward produces S times the true gradients; unscale_ must undo exactly "
    "that, g.div_(S) on each gradient tensor itself (the optimizer reads those very tensors, so a new "
    "tensor does not help). inf / S is still inf and NaN stays NaN: after the division, "
    "(~torch.isfinite(g)).any() says whether this step overflowed; torch.isinf alone misses NaN."))
def unscale(ctx):
    g = ctx.generator()
    grads = [torch.randn(3, 4, generator=g) * S, (torch.randn(5, generator=g) * S).half(),
             torch.randn(2, 2, generator=g)]
    cases = []
    # Each kind of overflow, in the first and in the second (fp16) tensor of the list.
    for what, bad in (("an inf", math.inf), ("a NaN", math.nan), ("a -inf", -math.inf)):
        for where in (0, 1):
            case = [torch.randn(4, generator=g), torch.randn(3, generator=g).half()]
            case[where][int(torch.randint(0, 3, (1,), generator=g))] = bad
            cases.append((f"unscale_ of gradients holding {what} (in a {case[where].dtype} tensor)", case))
    out = ctx.probe("unscale", S, 0.75, [t.clone() for t in grads], [c for _, c in cases]).value

    scaled = out["scaled"]
    if not torch.is_tensor(scaled) or scaled.numel() != 1 or scaled.item() != 0.75 * S:
        seen = f"tensor({scaled.item():g})" if torch.is_tensor(scaled) and scaled.numel() == 1 else _kind(scaled)
        raise Fail(f"with a scale of {S:g}, scale(tensor(0.75)) = {seen}; expected tensor({0.75 * S:g})")
    if not isinstance(out["grads"], list) or len(out["grads"]) != len(grads):
        raise Fail("unscale_ replaced the list of gradients it was given")
    for i, (t, was) in enumerate(zip(out["grads"], grads)):
        if torch.is_tensor(t) and t.shape == was.shape and t.dtype == was.dtype:
            if torch.equal(t, was):
                raise Fail(f"after unscale_, gradient {i} is unchanged; it should have been divided by the scale "
                           f"{S:g} in place")
            if torch.equal(t, was * S):
                raise Fail(f"after unscale_, gradient {i} was multiplied by the scale {S:g}, not divided by it")
        problem = describe_mismatch(f"gradient {i} after unscale_", t, was / S, 0.0, 1e-6)
        if problem:
            raise Fail(problem)
    if _found(out["found"], "unscale_ of finite gradients"):
        raise Fail("unscale_ of finite gradients returned True (an overflow)")
    scale = _scale(out["scale"], "after unscale_")
    if scale != S:
        raise Fail(f"unscale_ changed the scale to {scale:g}; only update changes it")
    found = out["overflow_found"]
    for (call, _), f in zip(cases, found if isinstance(found, list) else []):
        if not _found(f, call):
            raise Fail(f"{call} returned False: the overflow went unnoticed")
    generated.for_all(ctx, UNSCALE_CASES, lambda case: _unscales(ctx, case), count=8, describe=_unscale_case)


# unscale_ of a list of gradients drawn over dtypes and shapes (0-d, one element, empty ones, an empty list), with
# zeros, and an inf or a NaN in one of them or none.
UNSCALE_CASES = Space(shapes=Many(Shape(), 0, 4), dtypes=Many(One(DTYPES), 4, 4), bad=One(("none", "inf", "nan")),
                      where=Int(0, 3), zeros=One((False, True)), scale=One((S, 2.0**16, 1.0)))


def _unscale_grads(case: dict) -> list:
    grads = [generated.tensor(case, shape, dtype, i, scale=100.0)
             for i, (shape, dtype) in enumerate(zip(case["shapes"], case["dtypes"]))]
    if case["zeros"] and grads:
        grads[-1].zero_()
    full = [t for t in grads if t.numel()]
    if case["bad"] != "none" and full:
        t = full[case["where"] % len(full)]
        t.reshape(-1)[case["seed"] % t.numel()] = math.inf if case["bad"] == "inf" else math.nan
    return grads


def _unscale_case(case: dict) -> str:
    grads = _unscale_grads(case)
    listed = ", ".join(f"{generated.shape_words(tuple(t.shape))} {generated.name(t.dtype)}" for t in grads)
    bad = "" if case["bad"] == "none" or not any(t.numel() for t in grads) else f" with a {case['bad']} in one"
    return f"unscale_ with a scale of {case['scale']:g} of [{listed}]{bad}" + (" (the last all zeros)" * case["zeros"])


def _unscales(ctx, case: dict) -> str | None:
    grads = _unscale_grads(case)
    out = ctx.probe("unscale_grads", [t.clone() for t in grads], case["scale"]).value
    problem = generated.exactly("what unscale_ returned", out["found"], bool)
    if problem:
        return problem
    bad = case["bad"] != "none" and any(t.numel() for t in grads)
    if out["found"] != bad:
        return f"unscale_ returned {out['found']}" + (": the overflow went unnoticed" if bad else "")
    after = out["grads"]
    if not isinstance(after, list) or len(after) != len(grads):
        return f"unscale_ left the list of {len(grads)} gradients as {generated.kind(after)}"
    for i, (t, was) in enumerate(zip(after, grads)):
        problem = generated.mismatch(f"gradient {i} after unscale_", t, was / case["scale"])
        if problem:
            return problem
    return None


def _compare_history(ctx, found: list[bool]) -> None:
    kw = dict(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    values = ctx.probe("history", kw, found).value
    reference = DynamicLossScaler(**kw)
    got, want = [], []
    for i, f in enumerate(found):
        reference.update(f)
        want.append(reference.scale)
        got.append(_scale(values[i], f"after update {i + 1}"))
        if got[i] == want[i]:
            continue
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


@EXERCISE.check("a skipped step changes no weight and no optimizer state", points=1, hint=(
    "When unscale_ finds an inf or a NaN, the gradients are garbage: step must not call optimizer.step() "
    "at all (one inf in SGD's momentum, or in Adam's moments, poisons every later step), and must still "
    "update the scale. Parameters whose .grad is None are left out of the unscaling."))
def skipped(ctx):
    weights = _weights(ctx, "skip")
    x = torch.randn(6, 4, generator=ctx.generator("x"))
    steps = ctx.probe("skipped_step", weights, torch.ones(2), x, LR, MOMENTUM, S, 100, ("2.bias", 1)).value["steps"]
    first, second = steps
    say = "after a step whose gradients held an inf"
    for name, was in weights.items():
        now = first["weights"][name]
        if not torch.equal(now, was):
            raise Fail(f"{say}, parameter {name} changed (now {now.reshape(-1)[:3].tolist()}…): the optimizer "
                       f"stepped")
    if first["buffers"]:
        raise Fail(f"{say}, SGD has momentum buffers: the optimizer stepped")
    if _found(first["stepped"], "step"):
        raise Fail("step returned True (stepped) for gradients holding an inf")
    scale = _scale(first["scale"], "after the overflow")
    if scale != S * 0.5:
        raise Fail(f"after the overflow the scale is {scale:g}; expected {S * 0.5:g}")
    reference = model_with(weights)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    reference(x).pow(2).mean().backward()
    optimizer.step()
    if not _found(second["stepped"], "step"):
        raise Fail("step returned False (skipped) for finite gradients")
    _compare_weights(second["weights"], reference, "after the next, finite step")


@EXERCISE.check("training with overflows follows torch.amp.GradScaler", points=1, hint=(
    "PyTorch's GradScaler does the same: scale(loss), then step(optimizer) unscales the gradients (by "
    "multiplying with 1/S), skips optimizer.step() if any is inf or NaN, and update() backs off or counts "
    "towards growth. Same numbers in, same weights and same scale out, step after step."))
def follows_grad_scaler(ctx):
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    weights = _weights(ctx, "sequence")
    g = ctx.generator("batches")
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(9)]
    poison = {step: ("0.weight", (step % 4) * 4 + 1) for step in (2, 3, 6)}  # weight[step % 4, 1]
    got = ctx.probe("training", weights, batches, 0.05, MOMENTUM, kw, poison).value

    model = model_with(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=MOMENTUM)
    grad_scaler = torch.amp.GradScaler("cpu", **kw)
    for step, ((x, y), mine) in enumerate(zip(batches, got)):
        optimizer.zero_grad()
        grad_scaler.scale(F.mse_loss(model(x), y)).backward()
        if step in poison:
            name, index = poison[step]
            dict(model.named_parameters())[name].grad.view(-1)[index] = math.inf
        grad_scaler.step(optimizer)
        grad_scaler.update()
        say = f"step {step}{' (an inf in a gradient)' if step in poison else ''}"
        scale = _scale(mine["scale"], f"after {say}")
        if scale != grad_scaler.get_scale():
            raise Fail(f"after {say} the scale is {scale:g}; GradScaler's is {grad_scaler.get_scale():g}")
        _compare_weights(mine["weights"], model, f"after {say}", ", against GradScaler")
    generated.for_all(ctx, OPTIMIZERS, lambda case: _trains(ctx, case), count=6, describe=_optimizer_case)


# The optimizer a training loop hands step: several parameter groups with their own learning rates, momentum or
# none, a parameter without a gradient, gradients accumulated over several backwards, a model in float64, other
# scaler settings; an inf or a NaN at the second step, in the last group.
OPTIMIZERS = Space(groups=Int(1, 4), accumulate=Int(1, 3), lr=One((0.05, 0.2, 0.01)), momentum=One((0.0, MOMENTUM)),
                   frozen=One((False, True)), dtype=One((torch.float32, torch.float64)),
                   bad=One(("none", "inf", "nan")), growth_factor=One((2.0, 4.0)), backoff_factor=One((0.5, 0.25)))
STEPS = 3


def _optimizer_setup(case: dict) -> tuple:
    names = list(SHAPES)
    cut = [round(i * len(names) / case["groups"]) for i in range(case["groups"] + 1)]
    groups = [{"params": names[cut[i]:cut[i + 1]], "lr": case["lr"] / (i + 1), "momentum": case["momentum"]}
              for i in range(case["groups"])]
    dtype = case["dtype"]
    weights = {n: generated.tensor(case, shape, torch.float32, n, scale=0.5) for n, shape in SHAPES.items()}
    batches = [[(generated.tensor(case, (4, 4), dtype, "x", s, k), generated.tensor(case, (4, 3), dtype, "y", s, k))
                for k in range(case["accumulate"])] for s in range(STEPS)]
    # growth_interval 2 with an overflow at step 1 of 3: the count must restart there, or the scale grows at step 2.
    kwargs = dict(init_scale=2.0**10, growth_factor=case["growth_factor"], backoff_factor=case["backoff_factor"],
                  growth_interval=2)
    target = groups[-1]["params"][0]
    poison = {} if case["bad"] == "none" else {1: (target, 1, math.inf if case["bad"] == "inf" else math.nan)}
    return weights, groups, batches, kwargs, poison


def _optimizer_case(case: dict) -> str:
    _, groups, _, kwargs, poison = _optimizer_setup(case)
    lrs = ", ".join(f"{g['lr']:g}" for g in groups)
    return (f"SGD in {generated.name(case['dtype'])} over {case['groups']} parameter group"
            f"{'s' * (case['groups'] > 1)} (lr {lrs}, momentum {case['momentum']:g})"
            f"{', one parameter never getting a gradient' * case['frozen']}, {case['accumulate']} backward"
            f"{'s' * (case['accumulate'] > 1)} a step, LossScaler({', '.join(f'{k}={v:g}' for k, v in kwargs.items())})"
            + (f", a {case['bad']} in {groups[-1]['params'][0]}'s gradient at step 1" if poison else ""))


def _trains(ctx, case: dict) -> str | None:
    weights, groups, batches, kwargs, poison = _optimizer_setup(case)
    dtype = case["dtype"]
    got = ctx.probe("grouped_training", weights, generated.name(dtype), groups, batches, kwargs, poison,
                    case["frozen"]).value
    model = model_with(weights).to(dtype)
    named = dict(model.named_parameters())
    param_groups = [{"params": [named[n] for n in g["params"]], "lr": g["lr"], "momentum": g["momentum"]}
                    for g in groups]
    if case["frozen"]:
        param_groups[-1]["params"].append(nn.Parameter(torch.zeros(2, dtype=dtype)))
    optimizer = torch.optim.SGD(param_groups)
    grad_scaler = torch.amp.GradScaler("cpu", **kwargs)
    if not isinstance(got, list) or len(got) != STEPS:
        return f"the training loop did not run its {STEPS} steps"
    for step, (micro, mine) in enumerate(zip(batches, got)):
        optimizer.zero_grad()
        for x, y in micro:
            grad_scaler.scale(F.mse_loss(model(x), y) / len(micro)).backward()
        if step in poison:
            name, index, value = poison[step]
            named[name].grad.view(-1)[index] = value
        grad_scaler.step(optimizer)
        grad_scaler.update()
        stepped = step not in poison
        problem = generated.exactly(f"what step returned at step {step}", mine["stepped"], bool)
        if problem:
            return problem
        if mine["stepped"] != stepped:
            did = "stepped" if stepped else "skipped"
            return f"at step {step} step returned {mine['stepped']}, where GradScaler {did}"
        scale = _scale(mine["scale"], f"after step {step}")
        if scale != grad_scaler.get_scale():
            return f"after step {step} the scale is {scale:g}; GradScaler's is {grad_scaler.get_scale():g}"
        for n, p in named.items():
            theirs = mine["weights"].get(n) if isinstance(mine["weights"], dict) else None
            problem = generated.mismatch(f"after step {step}, {n}", theirs, p.detach())
            if problem:
                return problem + ", against GradScaler"
    return None


@EXERCISE.check("small fp16 gradients survive with scaling", points=1, hint=(
    "A gradient computed in fp16 below about 3e-8 rounds to 0 on the way back. Scaled by S, the same "
    "gradient is S times larger and representable; the division by S must then happen where the gradient "
    "is fp32 (here, the .grad of an fp32 parameter) so that it stays non-zero."))
def underflow(ctx):
    g = ctx.generator()
    a = ((1 + 0.4 * torch.rand(8, generator=g)) * 2.0**-13).half()   # a * b < 2**-25: 0 in fp16
    b = ((1 + 0.4 * torch.rand(8, generator=g)) * 2.0**-13).half()
    want = a.float() * b.float()
    w = nn.Parameter(torch.ones(8))
    ((w.half() * a) * b).float().sum().backward()  # unscaled, for comparison
    out = ctx.probe("fp16_gradient", a, b, 2.0**12).value
    if _found(out["found"], "unscale_"):
        raise Fail(f"unscale_ reported an overflow for gradients of about {want.mean():.2g}")
    grad = out["grad"]
    if torch.is_tensor(grad) and grad.shape == want.shape:
        zeros = int((grad == 0).sum())
        if zeros:
            raise Fail(f"with a scale of 2**12, {zeros} of 8 gradients of about {want.mean():.2g} are 0 after "
                       f"unscale_ (without scaling {int((w.grad == 0).sum())} of 8 are): they underflowed in fp16")
    problem = describe_mismatch("the unscaled gradient", grad, want, 1e-12, 2e-3)
    if problem:
        raise Fail(problem)


@EXERCISE.check("the contract: the loss left as it was, its dtype kept; gradients as views (1 rank)", points=1,
                hint=(
    "The training loop may log the loss after scaling it: return a new tensor, loss * self.loss_scale, never "
    "loss.mul_(...). Multiplying by a Python float keeps the loss's dtype (fp16 in, fp16 out); .float() does not. "
    "unscale_ divides each gradient in place, whatever its strides (a gradient can be a view): g.div_(S) and "
    "torch.isfinite(g) work on any tensor, where g.view(-1) refuses a transposed one."))
def contract(ctx):
    g = ctx.generator()
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.float32):
        loss = (torch.rand((), generator=g) + 0.5).to(dtype)
        got = contracts.probe(ctx, SCALE, "scale_loss", loss, S).value["contract"]["value"]
        if not torch.is_tensor(got) or got.shape != () or got.item() != loss.item() * S:
            raise Fail(f"with a scale of {S:g}, scale of a {dtype} loss {loss.item():g} returned {_kind(got)}; "
                       f"expected a 0-d tensor {loss.item() * S:g}")
    # Contiguous first, so that an error there is not blamed on the views; then views, with an inf in one.
    for strided, bad in ((False, False), (True, False), (True, True)):
        grads = [torch.randn(3, 4, generator=g) * S, (torch.randn(6, generator=g) * S).half(),
                 torch.randn(2, 5, generator=g).double() * S]
        if bad:
            grads[0][1, 2] = math.inf
        out = contracts.probe(ctx, UNSCALE, "unscale_grads", grads, S, strided=strided).value
        call = f"unscale_ of gradients{' passed as views' if strided else ''}{' (an inf in one)' if bad else ''}"
        for i, (got, was) in enumerate(zip(out["grads"], grads)):
            problem = describe_mismatch(f"{call}: gradient {i}", got, was / S, 0.0, 1e-6)
            if problem:
                raise Fail(problem)
        if _found(out["found"], call) != bad:
            raise Fail(f"{call} returned {not bad}")


def _judge_shards(outs, shards, stepped, why) -> None:
    """Fail unless rank r stepped at step k exactly when ``stepped[k][r]`` (its weights changed, and step
    said so) and its scale followed; ``why(k, r)`` says what it means that rank r did the opposite at step k.
    What the weights became is the business of the local checks."""
    for out in outs:
        r, steps = out.rank, out.value["steps"]
        scale, before = S, shards[r]
        for k, step in enumerate(steps):
            did = _found(step["stepped"], "step")
            changed = not (torch.is_tensor(step["shard"]) and torch.equal(step["shard"], before))
            if stepped[k][r] != changed:
                raise Fail(why(k, r))
            if did != changed:
                raise Fail(f"rank {r}: at step {k} the optimizer {'stepped' if changed else 'did not step'}, yet "
                           f"step returned {did}: it returns whether the optimizer stepped")
            if not stepped[k][r]:
                scale /= 2
            got = _scale(step["scale"], f"on rank {r}, after step {k}")
            if got != scale:
                raise Fail(f"rank {r}: after step {k} its scale is {got:g}; expected {scale:g}")
            before = step["shard"]


@EXERCISE.check("ranks agree on skipping a step (2 ranks)", points=1, world_size=2, hint=(
    "With ZeRO or tensor parallelism each rank checks different gradients, and one rank can overflow alone. "
    "If only that rank skips, the ranks' weights (and scales) part ways for good. All-reduce the found-inf "
    "flag with ReduceOp.MAX before deciding, so every rank skips when any rank overflowed."))
def ranks_agree(ctx):
    shards, grads = [], []
    for r in range(2):  # each rank holds its own shard of the parameters
        g = ctx.generator("shard", r)
        shards.append(torch.randn(6, generator=g))
        grads.append([torch.randn(6, generator=g) * S, torch.randn(6, generator=g) * (S / 2)])
    grads[1][0][2] = math.inf  # rank 1 overflows alone
    outs = ctx.probe_all("shard_steps", [(shards[r], grads[r], LR, MOMENTUM, S, 100) for r in range(2)])

    def why(k, r):
        if k == 1:
            return f"rank {r}: no rank's gradients overflowed, yet step skipped"
        mine = "its own gradients overflowed" if r == 1 else "its own gradients were finite but rank 1's overflowed"
        return f"rank {r}: {mine}; rank {r} stepped anyway, so the ranks no longer hold the weights of one model"

    _judge_shards(outs, shards, [[False, False], [True, True]], why)


GROUPS = [[0, 2], [1]]  # the groups of the 3-rank check: one of two ranks, one of rank 1 alone


def _group_of(rank: int) -> list[int]:
    return next(m for m in GROUPS if rank in m)


def _ranks(ranks) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


@EXERCISE.check("collectives use the group passed in (3 ranks)", points=1, world_size=3, hint=(
    "With tensor or pipeline parallelism, the ranks that must agree on skipping are one group of the "
    "job, not all of it: step(optimizer, group) passes its group on to unscale_, and every collective "
    "takes group=group. A collective on the default group makes the other groups skip steps that were "
    "fine for them (and waits for ranks that may never make that call)."))
def uses_group(ctx):
    shards, grads = [], []
    for r in range(3):
        g = ctx.generator("shard", r)
        shards.append(torch.randn(6, generator=g))
        grads.append([torch.randn(6, generator=g) * S, torch.randn(6, generator=g) * S])
    grads[2][0][4] = math.inf  # step 0: rank 2 overflows, so its group (ranks 0 and 2) skips; rank 1 does not
    grads[1][1][0] = math.inf  # step 1: rank 1 overflows alone in its group; ranks 0 and 2 step
    ctx.probe_all("make_groups", [(GROUPS,)] * 3)
    outs = ctx.probe_all("shard_steps", [(shards[r], grads[r], LR, MOMENTUM, S, 100, _group_of(r))
                                         for r in range(3)])
    for out in outs:
        mine = _group_of(out.rank)
        for c in out.comm:
            if c["group"] != mine:
                on = ("the default group (every rank)" if c["group"] == list(range(ctx.world_size))
                      else f"the group of {_ranks(c['group'] or [])}")
                raise Fail(f"rank {out.rank}: step(optimizer, group=<the group of {_ranks(mine)}>) issued "
                           f"{c['op']} on {on}, not on the group it was given")
    # Whatever the ranks recorded, no byte may pass between ranks that share no group (rank 1 is alone in its own).
    counted, _ = ctx.wire(outs)
    for (r, s), sent in (counted.pairs() if counted is not None else {}).items():
        if _group_of(r) != _group_of(s):
            raise Fail(f"rank {r} sent rank {s} {sent} bytes by the kernel's count, though no group it was given "
                       f"holds both: a collective on another group (the default one?), seen by torch.distributed "
                       f"or not")
    stepped = [[False, True, False], [True, False, True]]

    def why(k, r):
        mine = _group_of(r)
        bad = 2 if k == 0 else 1
        if r == bad:
            return f"rank {r}: its own gradients overflowed at step {k}, yet it stepped"
        if bad in mine:
            return (f"rank {r}: at step {k} rank {bad}, in its group ({_ranks(mine)}), overflowed, yet rank {r} "
                    f"stepped: the group did not agree on skipping")
        return (f"rank {r}: at step {k} no gradient of its group ({_ranks(mine)}) overflowed, yet it skipped: "
                f"rank {bad}'s overflow, outside its group, reached it")

    _judge_shards(outs, shards, stepped, why)
