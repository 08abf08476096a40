"""Checks of exercise 4: ZeRO-1 — shard, update the local shard, all-gather — against Adam on one device.

The learner's ``ZeroOneAdam`` runs in the sandbox under the probe
``probes/ex04_zero1.py:steps``, which reports the weights after every step and a
census of the optimizer state the rank holds; the expected weights (Adam on one
device, over the same steps) are computed here.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import contracts, generated
from ..core import Exercise, Fail, describe_mismatch
from ..generated import Many, One, Shape, Space

EXERCISE = Exercise(
    "ex04_zero1", "ZeRO-1 optimizer step", "notebooks/03_zero_fsdp.ipynb",
    forbidden_names=("torch.distributed.optim.ZeroRedundancyOptimizer",
                     "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer",
                     "torch.distributed.fsdp.FullyShardedDataParallel",
                     "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
                     "torch.distributed.fsdp.fully_shard", "torch.distributed._composable.fsdp.fully_shard"),
    refusal=("{op} is switched off in this exercise: build the sharded step yourself, from a "
             "torch.optim.Adam over this rank's shard and dist.all_gather"),
    rank_imports=("torch._dynamo",),  # every Adam step imports it
    concept=("each rank keeps the optimizer state of its own shard only, yet after the step every rank holds the "
             "same full parameters the unsharded optimizer gives"),
    section="§1 (sixteen bytes per parameter) and §2 (ZeRO-1 and ZeRO-2 from scratch)")

LR, STEPS = 1e-2, 3
TINY = 1e-8  # a gradient this small is comparable to Adam's eps: its update depends on its scale

# What every caller of an optimizer relies on besides the update (gpucourse.grading.contracts): the gradients it
# reads come back as they were, its parameters may be views with any strides (the probe "steps" makes them from
# the weights as they came), and a float64 model is stepped in float64.
STEP = contracts.Contract("ZeroOneAdam.step", ("params", "grads"), unchanged=("grads",), strided=("params",))


def _bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    shard = math.ceil(numel / world)
    start = min(rank * shard, numel)
    return start, min(start + shard, numel)


def _as_bounds(value) -> tuple | None:
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError, RuntimeError):
        return None


@EXERCISE.check("shard_bounds cuts a buffer into padded shards", points=2, hint=(
    "Every element must belong to exactly one rank, and every shard has the same padded size "
    "ceil(numel / world_size), so that an all-gather of equal pieces can put them back together. Rounding "
    "the shard size down leaves the last elements to nobody; clip both ends at numel, as the last shards "
    "can be short or even empty."))
def bounds(ctx):
    g = ctx.generator()
    cases = [(10, 4), (2, 3), (1, 1), (7, 7), (5, 8), (31, 3), (9, 2)]
    cases += [(int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
              for _ in range(20)]
    answers = ctx.probe("bounds", cases).value
    for (numel, world), answer in zip(cases, answers):
        got = [_as_bounds(b) for b in answer]
        want = [_bounds(numel, world, r) for r in range(world)]
        if got != want:
            shown = [b if b is not None else a for b, a in zip(got, answer)]
            if any(b is None or len(b) != 2 for b in got):
                raise Fail(f"for {numel} elements on {world} ranks shard_bounds returned {shown}; each rank's "
                           f"answer must be a pair (start, end), expected {want}")
            covered = sum(max(0, e - s) for s, e in got)
            extra = ""
            if covered < numel:
                extra = f"; they cover {covered} of the {numel} elements"
            elif any(e - s > math.ceil(numel / world) for s, e in got):
                extra = f"; a shard is longer than ceil({numel} / {world}) = {math.ceil(numel / world)}"
            elif any(e > numel or s > numel for s, e in got):
                extra = f"; a shard reaches past the {numel} real elements (into the padding)"
            raise Fail(f"for {numel} elements on {world} ranks the shards are {shown}, expected {want}{extra}")


def _weights(ctx, sizes, key) -> list[torch.Tensor]:
    g = ctx.generator("weights", key, tuple(sizes))
    return [torch.randn(s, generator=g) for s in sizes]


def _grads(ctx, sizes, key) -> list[list[torch.Tensor]]:
    """Each step's gradients, the same on every rank (already averaged). Every fourth element of the flattened
    gradients is tiny (about Adam's eps), so that Adam's update there depends on the gradient's scale: a step
    on gradients summed over ranks, instead of averaged, moves those elements differently."""
    g = ctx.generator("grads", key, tuple(sizes))
    numel = sum(math.prod(s) for s in sizes)
    scale = torch.where(torch.arange(numel) % 4 == 3, TINY, 1.0)
    out = []
    for _ in range(STEPS):
        flat = torch.randn(numel, generator=g) * scale
        out.append([piece.reshape(s).clone() for piece, s in
                    zip(flat.split([math.prod(s) for s in sizes]), sizes)])
    return out


def _adam(weights, grads, factor: float = 1.0, fresh: bool = False, lr: float = LR) -> list[torch.Tensor]:
    """The flattened weights after each step of torch.optim.Adam on one device (gradients times ``factor``;
    with ``fresh``, a new Adam at every step: its state forgotten between steps)."""
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.Adam(params, lr=lr)
    out = []
    for step_grads in grads:
        if fresh:
            opt = torch.optim.Adam(params, lr=lr)
        for p, g in zip(params, step_grads):
            p.grad = g.clone() * factor
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return out


def _close(a, b) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and a.dtype == b.dtype and \
        bool(torch.allclose(a, b, atol=1e-6, rtol=1e-5))


def _misplaced(got: torch.Tensor, expected: torch.Tensor, numel: int, n: int) -> str:
    """A sentence if some rank's updated shard is in ``got`` whole, but not where it belongs; else ""."""
    for q in range(n):
        lo, hi = _bounds(numel, n, q)
        if hi - lo < 2 or _close(got[lo:hi], expected[lo:hi]):
            continue
        for at in range(numel - (hi - lo) + 1):
            if _close(got[at:at + hi - lo], expected[lo:hi]):
                return (f"rank {q}'s updated shard (elements {lo} to {hi - 1}) came back at elements {at} to "
                        f"{at + hi - lo - 1}: the gathered shards were put back in the wrong places (rank r's "
                        f"shard starts at r * ceil(numel / world_size))")
    return ""


def _run(ctx, sizes, key, held: bool = False, strided: bool = False, dtype=torch.float32, lr: float = LR,
         container: str = "list") -> tuple[list, tuple]:
    """Every rank's probe of ZeroOneAdam over ``STEPS`` steps (``held``: held to its contract too, with
    ``strided`` parameters), in ``dtype``, its parameters handed over as a ``container``; the outcomes, and the
    weights and gradients sent."""
    weights = [w.to(dtype) for w in _weights(ctx, sizes, key)]
    grads = [[g.to(dtype) for g in step] for step in _grads(ctx, sizes, key)]
    args = [(weights, grads, lr, container)] * ctx.world_size
    outs = contracts.probe_all(ctx, STEP, "steps", args, strided) if held else ctx.probe_all("steps", args)
    return outs, (weights, grads)


def _compare(ctx, sizes, key="", lr: float = LR, container: str = "list"):
    """Fails unless every rank's weights after each step are those of Adam on one device."""
    outs, (weights, grads) = _run(ctx, sizes, key, lr=lr, container=container)
    n = ctx.world_size
    numel = sum(w.numel() for w in weights)
    start = torch.cat([w.reshape(-1) for w in weights])
    want = _adam(weights, grads, lr=lr)
    for out in outs:
        got_steps = out.value["weights"]
        for step, (got, expected) in enumerate(zip(got_steps, want)):
            problem = describe_mismatch(f"rank {out.rank}: the weights after step {step + 1} of {STEPS}", got,
                                        expected, 1e-6, 1e-5)
            if problem is None:
                continue
            if not torch.is_tensor(got) or got.shape != expected.shape or got.dtype != expected.dtype:
                raise Fail(problem)
            before = start if step == 0 else got_steps[step - 1]
            lo, hi = _bounds(numel, n, out.rank)
            moved = (got != before).nonzero().reshape(-1)
            own = torch.zeros(numel, dtype=torch.bool)
            own[lo:hi] = True
            if not len(moved):
                problem += "; no weight changed at all in this step"
            elif n > 1 and bool(own[moved].all()) and _close(got[lo:hi], expected[lo:hi]):
                problem += (f"; only elements {lo} to {hi - 1}, this rank's own shard, changed: the other ranks' "
                            f"updated shards never arrived")
            elif lr != LR and _close(got, _adam(weights, grads)[step]):
                problem += (f"; they are Adam's weights at lr={LR:g}, the default, where this ZeroOneAdam was made "
                            f"with lr={lr:g}: the shard's optimizer must step at the learning rate it was given")
            elif n > 1 and _close(got, _adam(weights, grads, factor=n, lr=lr)[step]):
                problem += (f"; they are Adam's weights for gradients {n} times as large: the gradients were "
                            f"summed over the ranks, but they arrive already averaged (the same on every rank), "
                            f"and Adam's update depends on their scale where they are as small as its eps")
            elif step > 0 and _close(got, _adam(weights, grads, fresh=True, lr=lr)[step]):
                problem += (f"; step 1 was right, but step {step + 1} is what a fresh Adam's first step gives: "
                            f"Adam's moments and step count were not kept from one step to the next")
            elif n > 1 and _misplaced(got, expected, numel, n):
                problem += "; " + _misplaced(got, expected, numel, n)
            elif n > 1 and hi > lo and _close(got[lo:hi], expected[lo:hi]):
                problem += (f"; this rank's own shard (elements {lo} to {hi - 1}) is right, the rest is not: "
                            f"the other ranks' shards came back wrong, or were put back in the wrong places")
            raise Fail(problem)
        if len(got_steps) != STEPS:
            raise Fail(f"rank {out.rank}: the probe saw {len(got_steps)} steps of {STEPS}")
    return outs, numel


@EXERCISE.check("a ZeRO-1 step equals Adam on one device (2 ranks)", points=2, world_size=2, hint=(
    "Three moves: slice this rank's part of the flattened gradient, let Adam update this rank's copy of its "
    "shard, then all-gather every rank's shard (padded to equal size) and copy the gathered values back "
    "into the parameters. Adam is element-wise, so updating the shards separately gives the same numbers, "
    "step after step, as long as the same Adam (with its moments) updates the shard every step. The "
    "gradients arrive already averaged: use them as they are."))
def equals_adam(ctx):
    _compare(ctx, [(3, 4), (5,), (2, 3)])
    def steps_like_adam(case):
        return generated.failure(_compare, ctx, case["sizes"], ("drawn", case["seed"]), case["lr"], case["container"])

    generated.for_all(ctx, OPTIMIZERS, steps_like_adam, count=3, describe=_optimizer_words)


# The parameters a training loop hands an optimizer: a list, a tuple, or model.parameters(), a generator that can be
# read once; 1 to 3 of them, 0-d, of one element, odd or odd matrices; another learning rate than the default.
OPTIMIZERS = Space(container=One(("list", "generator", "tuple")), sizes=Many(Shape(("one", "odd", "matrix", "0-d")),
                                                                             1, 3), lr=One((LR, 0.1, 1e-3)))


def _optimizer_words(case: dict) -> str:
    sizes = ", ".join(generated.shape_words(s) for s in case["sizes"])
    return f"ZeroOneAdam(params as a {case['container']} of [{sizes}], lr={case['lr']:g})"



def _judge_census(rank: int, census: list, numel: int, n: int) -> None:
    lo, hi = _bounds(numel, n, rank)
    shard = math.ceil(numel / n)
    if not any(census[1:]):
        raise Fail(f"rank {rank}: no torch.optim.Optimizer could be found in the ZeroOneAdam after a step "
                   f"(the exercise keeps one as self.optimizer: a torch.optim.Adam over this rank's shard)")
    for when, optimizers in enumerate(census):
        moment = "after it was made" if when == 0 else f"after step {when}"
        total = sum(int(o["state_elements"]) for o in optimizers)
        names = ", ".join(o["type"] for o in optimizers)
        count = f"{len(optimizers)} optimizers ({names})" if len(optimizers) > 1 else f"its {names}"
        if total > 2 * shard:
            why = ""
            if total >= 2 * numel:
                why = (": as much as Adam over all the parameters — every rank keeps, and steps, the state of "
                       "every shard" + (", in several optimizers" if len(optimizers) > 1 else ""))
            raise Fail(f"rank {rank} holds {total} numbers of state {moment}, in {count}, for {numel} "
                       f"parameters on {n} ranks; its shard's two moments are {2 * (hi - lo)} "
                       f"(at most {2 * shard} with padding){why}")
        for o in optimizers:
            for size, start, end, held in o["tensors"].tolist():
                if held > 0 and start >= 0 and (start < lo or end > hi):
                    owners = sorted({r for r in range(n) if _bounds(numel, n, r)[0] < end and
                                     _bounds(numel, n, r)[1] > start} - {rank})
                    raise Fail(f"rank {rank} holds {held} numbers of state {moment} for elements {start} to "
                               f"{end - 1} of the flattened parameters, outside its shard ({lo} to {hi - 1}): "
                               f"they belong to rank{'s' * (len(owners) > 1)} {', '.join(map(str, owners))}")
        if when > 0 and hi > lo and total < 2 * (hi - lo):
            raise Fail(f"rank {rank} holds only {total} numbers of state {moment}, in {count}; Adam's two moments "
                       f"of its shard are {2 * (hi - lo)}: this rank's shard is not stepped by an Adam it keeps")


@EXERCISE.check("Adam's state lives only on this rank's shard", points=2, world_size=2, hint=(
    "The memory ZeRO-1 saves is Adam's two moments: build self.optimizer over this rank's shard of the "
    "weights (one tensor of about numel / world_size elements), not over the model's parameters, and keep "
    "no other optimizer — a rank that also steps the other shards (to skip the all-gather) holds their "
    "state too, which is exactly what ZeRO-1 removes."))
def state_sharded(ctx):
    for sizes in ([(8, 4), (6,)], [(3, 2), (2,)]):
        outs, _ = _run(ctx, sizes, "state")
        numel = sum(math.prod(s) for s in sizes)
        for out in outs:
            _judge_census(out.rank, out.value["census"], numel, ctx.world_size)


@EXERCISE.check("the contract: gradients left as they were, parameters as views, float64 kept (2 ranks)", points=1,
                world_size=2, hint=(
    "A step reads the gradients and leaves them as they were: zeroing them is the training loop's job "
    "(optimizer.zero_grad()). A parameter may be a view with any strides (a transposed matrix): flatten with "
    ".reshape(-1), and copy the gathered values back with p.copy_(piece.view_as(p)), where p.view(-1) refuses. "
    "Make every buffer in the parameters' dtype (torch.zeros(n, dtype=...)): a float32 buffer rounds a float64 "
    "model's weights."))
def contract(ctx):
    sizes = [(3, 4), (5,), (2, 3)]
    for strided in (False, True):  # contiguous first, so that an error there is not blamed on the views
        outs, (weights, grads) = _run(ctx, sizes, "contract", held=True, strided=strided, dtype=torch.float64)
        sent = [contracts.as_strided_view(w) for w in weights] if strided else weights
        case = contracts.describe_case(STEP, (sent, grads[0]), ctx.world_size)
        for out in outs:
            for step, (got, want) in enumerate(zip(out.value["weights"], _adam(weights, grads))):
                contracts.expect_precision(STEP, f"rank {out.rank}'s weights after step {step + 1} of {STEPS}", got,
                                           want, case, 1e-6, 1e-5)


@EXERCISE.check("3 ranks, sizes not divisible by 3", points=2, world_size=3, hint=(
    "With 3 ranks, 31 elements make shards of 11, 11 and 9, and 2 elements make 1, 1 and an empty one. "
    "Pad every rank's shard to the same length before the all-gather, and drop the padding after."))
def three_ranks(ctx):
    _compare(ctx, [(4, 5), (7,), (2, 2)], "31")   # 31 elements
    _compare(ctx, [(2,)], "2")                    # fewer elements than ranks


@EXERCISE.check("one rank", points=1, world_size=1, hint=(
    "With one rank the shard is the whole buffer, and the all-gather hands it back unchanged: the step is "
    "plain Adam."))
def one_rank(ctx):
    _compare(ctx, [(3, 3), (4,)])
