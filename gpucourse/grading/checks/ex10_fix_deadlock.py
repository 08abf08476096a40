"""Checks of exercise 10: the data-parallel loop, fixed, ends on 2 and 3 ranks and trains as one device does.

The learner's ``train`` runs on the sandbox's ranks through the probe
``run_training`` (``gpucourse/grading/probes/ex10_fix_deadlock.py``), each rank
given only its own rows of each batch; the one-device run it is compared with
runs here. A hang is the bug this exercise is about: the host stops the ranks
once those left sit still in a collective that a finished rank would have to
join (about 2 s), or when the check's budget is spent and they have stopped
moving, and the check turns what each rank was waiting in into a diagnosis. One run per world size serves every check that reads it,
so the untouched file costs two hangs, not four.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...runtime.collective_status import diagnose_hang, waiting_in
from .. import host
from ..core import Exercise, Fail, derive_seed, describe_mismatch

EXERCISE = Exercise("ex10_fix_deadlock", "Fix a hanging trainer", "notebooks/09_troubleshooting.ipynb",
                    concept=("every rank must call the same collectives in the same order; a decision only some ranks "
                             "can see makes them part ways"),
                    section="§2 (a hang, caught by the launcher's timeout) and §3 (DETAIL turns it into an error)")

ROWS, FEATURES, STEPS, LR, NOISE = 24, 3, 8, 0.1, 2.0  # 24 rows: 2 and 3 ranks both divide them
MARGIN = 0.02   # how far every loss of the one-device run stays from target_loss (relative)
# A fixed run takes milliseconds once its ranks are up (their start is not counted). The host calls the ranks
# hung PROGRESS_GRACE_S (3 s) after this budget, if none of them moved meanwhile: about 7 s in all (a hang in
# which the ranks left wait for one that has finished is called sooner: host.DEADLOCK_S).
BUDGET_S = 4.0


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


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _hang(e, world: int, seconds: float) -> str:
    """The diagnosis of a run that the host stopped after ``seconds`` (a ``host.Stuck``: ``done``, ``pending``,
    ``waiting``)."""
    waiting = {r: e.waiting.get(r, "") or "no collective recorded" for r in e.pending}
    stuck = {r: waiting_in(waiting[r]) for r in e.pending}
    if e.done and all(call and call[1].startswith("all_reduce") for call in stuck.values()):
        head = (f"the fix is not written yet: on {world} ranks train still hangs as shipped: {_ranks(e.done)} "
                f"left the training loop and finished, while {_ranks(e.pending)} went on into the next step's "
                f"all-reduce and waited there")
    else:
        everyone = {**{r: "not in a collective — train returned" for r in e.done}, **waiting}
        head = f"on {world} ranks train hangs. {diagnose_hang(everyone)}"
    report = "; ".join([f"rank {r}: train returned" for r in e.done] + [f"rank {r}: {waiting[r]}" for r in e.pending])
    return f"{head} (the grader stopped the ranks after {seconds:.0f} s: {report})"


def _losses(value, world: int, rank: int) -> list[float]:
    """What train returned on ``rank``, as a list of floats; Fail if it is not a list of losses."""
    if torch.is_tensor(value) and value.dim() <= 1:
        value = value.reshape(-1).tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            if torch.is_tensor(v) and v.numel() == 1:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                break
            out.append(float(v))
        else:
            return out
    shown = f"a {value['__type__']}" if isinstance(value, dict) and "__type__" in value else repr(value)[:80]
    raise Fail(f"on {world} ranks, rank {rank}'s train returned {shown}, not the list of the losses it logged "
               f"(one float per step)")


_RUNS: dict = {}  # (file, seed, world size) -> each rank's result, or the sentence that fails the checks


def _run(ctx, world: int) -> tuple[Data, list[dict]]:
    """The learner's training on ``world`` ranks (run once per world size, then remembered)."""
    data = _data(ctx.seed)
    key = (ctx.path, ctx.seed, world)
    if key not in _RUNS:
        args = [(data.weight, data.bias, [(x[_shard(r, world)].clone(), y[_shard(r, world)].clone())
                                          for x, y in data.batches], LR, data.target) for r in range(world)]
        start = time.monotonic()
        try:
            outs = ctx.probe_all("run_training", args)
            _RUNS[key] = [{"losses": _losses(out.value["losses"], world, out.rank),
                           "weights": out.value["weights"]} for out in outs]
        except Fail as e:
            _RUNS[key] = str(e)
        except host.Stuck as e:
            _RUNS[key] = _hang(e, world, time.monotonic() - start)
        except host.LearnerError as e:
            _RUNS[key] = e.sentence if e.exc_type == "NotImplementedError" else f"on {world} ranks, {e.sentence}"
        except host.RankDied as e:
            _RUNS[key] = f"on {world} ranks: {e}"
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
        problem = describe_mismatch(f"on {world} ranks, rank {rank}'s final weights", out["weights"], weights)
        if problem:
            raise Fail(problem)


@EXERCISE.check("2 ranks finish the training", points=3, world_size=2, budget_s=BUDGET_S, hint=(
    "A hang is ranks disagreeing about the next collective. Read the grader's report: which rank finished, "
    "which waits, and in which call. Every rank must call every collective, so whatever decides whether a rank "
    "calls one (here the break that ends the loop) must come out the same on all of them; each rank's own loss "
    "is different, so decide on a number they all share. A barrier on the ranks that stop does not help: the "
    "others are in an all-reduce, not in a barrier."))
def finishes(ctx):
    _run(ctx, 2)


@EXERCISE.check("every rank logs the same mean loss (2 ranks)", points=2, world_size=2, budget_s=BUDGET_S, hint=(
    "Each rank's loss is the mean over its own shard only. The global batch's loss is the mean of the ranks' "
    "losses (the shards are equal in size): all-reduce a detached copy of the loss (a sum) and divide it by "
    "dist.get_world_size(), on every rank. Log that number and decide on it."))
def same_loss(ctx):
    data, results = _run(ctx, 2)
    _same_on_every_rank(data, results, 2)


@EXERCISE.check("2 ranks train as one device does", points=3, world_size=2, budget_s=BUDGET_S, hint=(
    "One device computes the loss of the whole global batch and stops at the first step where it is below "
    "target_loss. The ranks must log that same loss and stop at that same step: not when any one rank's "
    "own loss is low enough, not on rank 0's loss, not on the sum of the losses. average_gradients is right "
    "as shipped: the gradients need no change."))
def as_one_device(ctx):
    data, results = _run(ctx, 2)
    _as_one_device(data, results, 2)


@EXERCISE.check("3 ranks train as one device does", points=2, world_size=3, budget_s=BUDGET_S, hint=(
    "With 3 ranks the mean is the sum over 3, and there are two ranks that can disagree with rank 0: use "
    "dist.get_world_size() rather than a number, and make every rank, not only a neighbour, take part."))
def three_ranks(ctx):
    data, results = _run(ctx, 3)
    _same_on_every_rank(data, results, 3)
    _as_one_device(data, results, 3)
