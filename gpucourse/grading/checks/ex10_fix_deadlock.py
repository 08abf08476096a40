"""Checks of exercise 10: the data-parallel loop, fixed, ends on 2 and 3 ranks and trains as one device does.

The checks run the learner's ``train`` in launches of their own, started from
the exercise process with a short timeout (:data:`HANG_S`): a hang is the bug
this exercise is about, so it must cost seconds and come back as a failed check
that carries the launcher's report, not as a check the grader has to kill. One
launch per world size serves every check that reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...runtime import LaunchTimeout, WorkerError, launch
from ...runtime.collective_status import waiting_in
from ...troubleshoot import diagnose_hang
from ..core import Exercise, Fail, derive_seed, describe_mismatch
from ..results import describe_launch_error

EXERCISE = Exercise("ex10_fix_deadlock", "Fix a hanging trainer", "notebooks/09_troubleshooting.ipynb")

ROWS, FEATURES, STEPS, LR, NOISE = 24, 3, 8, 0.1, 2.0  # 24 rows: 2 and 3 ranks both divide them
MARGIN = 0.02   # how far every loss of the one-device run stays from target_loss (relative)
# A fixed run takes one or two seconds, most of it starting the ranks; a run still going after this hangs.
HANG_S = 10.0


@dataclass
class Data:
    """One training problem: the initial weights, the global batches and the loss to stop below."""

    weight: torch.Tensor
    bias: torch.Tensor
    batches: list
    target: float


def _shard(rank: int, world: int) -> slice:
    return slice(rank * ROWS // world, (rank + 1) * ROWS // world)


def _model(data: Data) -> nn.Linear:
    model = nn.Linear(FEATURES, 1)
    with torch.no_grad():
        model.weight.copy_(data.weight)
        model.bias.copy_(data.bias)
    return model


def _trajectory(data: Data, stop: bool = True) -> tuple[list[float], list[dict[int, list[float]]], torch.Tensor]:
    """One device on the whole batches: its losses, each shard's loss at each step (for 2 and 3 ranks), and
    its final weights. ``stop=False`` trains every batch, ignoring the target."""
    model = _model(data)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, shards = [], []
    for x, y in data.batches:
        optimizer.zero_grad()
        out = model(x)
        loss = F.mse_loss(out, y)
        shards.append({w: [F.mse_loss(out[_shard(r, w)], y[_shard(r, w)]).item() for r in range(w)]
                       for w in (2, 3)})
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if stop and losses[-1] < data.target:
            break
    return losses, shards, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _data(seed: int) -> Data:
    """A problem on which the shipped bug shows on 2 and on 3 ranks, and no rounding can change a decision.

    Half of the rows have noisy labels, so the shards' losses differ a lot: some rank's own loss falls below
    the target steps before the global batch's loss (the mean of the ranks' losses) does.
    """
    for attempt in range(100):
        g = torch.Generator().manual_seed(derive_seed(seed, "ex10 data", attempt))
        true_weight = torch.randn(1, FEATURES, generator=g) * 1.5
        weight, bias = torch.randn(1, FEATURES, generator=g) * 0.3, torch.zeros(1)
        batches = []
        for _ in range(STEPS):
            x = torch.randn(ROWS, FEATURES, generator=g)
            y = x @ true_weight.T
            y[ROWS // 2:] += NOISE * torch.randn(ROWS - ROWS // 2, 1, generator=g)
            batches.append((x, y))
        data = Data(weight, bias, batches, math.inf)
        losses, shards, _ = _trajectory(data, stop=False)
        for k in range(3, STEPS):  # one device stops after step k, the 4th step or later
            high, low = min(losses[:k]), losses[k]
            if high - low < 2 * MARGIN * high:
                continue
            target = (high + low) / 2
            if all(min(min(s[w]) for s in shards[:k]) < target * (1 - MARGIN) for w in (2, 3)):
                data.target = target
                return data
    raise RuntimeError("could not build the training problem of exercise 10")  # never seen in practice


def _rank_train(ctx, data: Data) -> dict:
    """On each rank: the learner's ``train`` on this rank's shards; the logged losses and final weights."""
    module = ctx.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = _shard(rank, world)
    model = _model(data)
    logged = module.train(model, [(x[rows].clone(), y[rows].clone()) for x, y in data.batches], lr=LR,
                          target_loss=data.target)
    return {"losses": [float(v) for v in logged],
            "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _hang(e: LaunchTimeout, world: int) -> str:
    report = "; ".join(f"rank {r}: {what}" for r, what in sorted(e.waiting.items()))
    stuck = {r: waiting_in(e.waiting.get(r, "")) for r in e.pending}
    if e.finished and all(call and call[1].startswith("all_reduce") for call in stuck.values()):
        head = (f"the fix is not written yet: on {world} ranks train still hangs as shipped: {_ranks(e.finished)} "
                f"left the training loop and finished, while {_ranks(e.pending)} went on into the next step's "
                f"all-reduce and waited there")
    else:
        head = f"on {world} ranks train hangs. {diagnose_hang(e.waiting)}"
    return f"{head} (the launcher stopped the ranks after {HANG_S:g} s: {report})"


_RUNS: dict = {}  # (file, seed, world size) -> each rank's result, or why there is none


def _run(ctx, world: int) -> tuple[Data, list[dict]]:
    """The learner's training on ``world`` ranks (launched once per world size, then remembered)."""
    data = _data(ctx.seed)
    key = (ctx.path, ctx.seed, world)
    if key not in _RUNS:
        try:
            _RUNS[key] = launch(_rank_train, ctx, data, world_size=world, timeout=HANG_S, device="cpu", quiet=True)
        except LaunchTimeout as e:
            _RUNS[key] = _hang(e, world)
        except WorkerError as e:
            _RUNS[key] = f"on {world} ranks: {describe_launch_error(e, ctx.path)}"
    if isinstance(_RUNS[key], str):
        raise Fail(_RUNS[key])
    return data, _RUNS[key]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def _same_on_every_rank(data: Data, results: list[dict], world: int) -> None:
    first = results[0]["losses"]
    for rank, out in enumerate(results[1:], start=1):
        got = out["losses"]
        if len(got) != len(first):
            raise Fail(f"on {world} ranks, rank 0 logged {len(first)} steps and rank {rank} {len(got)}: the ranks "
                       f"left the loop at different steps")
        for step, (a, b) in enumerate(zip(first, got)):
            if not _close(a, b):
                _, shards, _ = _trajectory(data)
                own = step < len(shards) and all(_close(v, shards[step][world][r])
                                                 for r, v in ((0, a), (rank, b)))
                raise Fail(f"on {world} ranks, at step {step} rank 0 logged {a:.6g} and rank {rank} {b:.6g}"
                           + (": each rank logs the loss of its own shard" if own else ""))


def _as_one_device(data: Data, results: list[dict], world: int) -> None:
    want, shards, weights = _trajectory(data)
    for rank, out in enumerate(results):
        got = out["losses"]
        for step, (a, b) in enumerate(zip(got, want)):
            if not _close(a, b):
                extra = ""
                if _close(a, shards[step][world][rank]):
                    extra = f": that is the loss of rank {rank}'s own shard, not of the global batch"
                else:
                    divisor = next((d for d in range(1, 9) if d != world and _close(a * d, b * world)), None)
                    if divisor == 1:
                        extra = f": {world} times too large, a sum over the ranks not divided by their number"
                    elif divisor:
                        extra = f": that is the sum over the ranks divided by {divisor}, but there are {world} ranks"
                    elif b:
                        extra = f" ({a / b:.4g} times as much)"
                raise Fail(f"on {world} ranks, rank {rank} logged {a:.6g} at step {step}; one device training on "
                           f"the whole batch has a loss of {b:.6g}{extra}")
        if len(got) != len(want):
            raise Fail(f"on {world} ranks, rank {rank} trained {len(got)} steps; one device trains {len(want)}, "
                       f"stopping at the first step whose loss is below target_loss = {data.target:.4g}")
        problem = describe_mismatch(f"on {world} ranks, rank {rank}'s final weights", torch.tensor(out["weights"]),
                                    weights)
        if problem:
            raise Fail(problem)


@EXERCISE.check("2 ranks finish the training", points=3, hint=(
    "A hang is ranks disagreeing about the next collective. Read the launcher's report: which rank finished, "
    "which waits, and in which call. Every rank must call every collective, so whatever decides whether a rank "
    "calls one (here the break that ends the loop) must come out the same on all of them; each rank's own loss "
    "is different, so decide on a number they all share. A barrier on the ranks that stop does not help: the "
    "others are in an all-reduce, not in a barrier."))
def finishes(ctx):
    _run(ctx, 2)


@EXERCISE.check("every rank logs the same mean loss (2 ranks)", points=2, hint=(
    "Each rank's loss is the mean over its own shard only. The global batch's loss is the mean of the ranks' "
    "losses (the shards are equal in size): all-reduce a detached copy of the loss (a sum) and divide it by "
    "dist.get_world_size(), on every rank. Log that number and decide on it."))
def same_loss(ctx):
    data, results = _run(ctx, 2)
    _same_on_every_rank(data, results, 2)


@EXERCISE.check("2 ranks train as one device does", points=3, hint=(
    "One device computes the loss of the whole global batch and stops at the first step where it is below "
    "target_loss. The ranks must log that same loss and stop at that same step: not when any one rank's "
    "own loss is low enough, not on rank 0's loss, not on the sum of the losses. average_gradients is right "
    "as shipped: the gradients need no change."))
def as_one_device(ctx):
    data, results = _run(ctx, 2)
    _as_one_device(data, results, 2)


@EXERCISE.check("3 ranks train as one device does", points=2, hint=(
    "With 3 ranks the mean is the sum over 3, and there are two ranks that can disagree with rank 0: use "
    "dist.get_world_size() rather than a number, and make every rank, not only a neighbour, take part."))
def three_ranks(ctx):
    data, results = _run(ctx, 3)
    _same_on_every_rank(data, results, 3)
    _as_one_device(data, results, 3)
