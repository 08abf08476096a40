"""Checks of exercise 3: gradient buckets in gradient-ready order, one async all-reduce each, during backward."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from ...parallel.data_parallel_buckets import assign_buckets as reference_buckets
from ..core import Exercise, Fail, describe_mismatch, replaced_dist

EXERCISE = Exercise("ex03_gradient_buckets", "Gradient buckets overlapped with backward",
                    "notebooks/02_data_parallelism.ipynb")


def _model(ctx) -> nn.Sequential:
    """Three linear layers of random widths; the middle one's weight is frozen."""
    g = ctx.generator("model")
    widths = torch.randint(3, 10, (4,), generator=g).tolist()
    model = nn.Sequential(nn.Linear(widths[0], widths[1]), nn.Tanh(), nn.Linear(widths[1], widths[2]), nn.Tanh(),
                          nn.Linear(widths[2], widths[3]))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model[2].weight.requires_grad_(False)
    return model


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _caps(model) -> list[int]:
    sizes = [_nbytes(p) for p in model.parameters() if p.requires_grad]
    ready = sizes[::-1]
    # Smaller than any parameter, exactly two neighbours' worth (a bucket that fills the cap exactly),
    # a middling one, and one that holds everything.
    return [min(sizes) - 1, ready[0] + ready[1], sum(sizes) // 2, sum(sizes) * 2]


def _as_names(buckets, what: str) -> list[list[str]]:
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in buckets):
        raise Fail(f"{what} returned {type(buckets).__name__}, not a list of lists of parameter names")
    return [list(b) for b in buckets]


@EXERCISE.check("buckets follow gradient-ready order", points=2, hint=(
    "Backward computes gradients from the loss backwards: the last layer's parameters are ready first, the "
    "first layer's last. A bucket can only be sent once all of its gradients exist, so fill buckets in that "
    "order — the reverse of model.named_parameters() — and leave out parameters that get no gradient."))
def ready_order(ctx):
    model = _model(ctx)
    assign = ctx.load().assign_buckets
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    for cap in _caps(model):
        flat = [n for b in _as_names(assign(model, cap), "assign_buckets") for n in b]
        if flat == names[::-1]:
            continue
        if flat == names:
            raise Fail(f"with a cap of {cap} bytes the buckets list the parameters in forward order, "
                       f"{names[0]} first; backward makes {names[-1]}'s gradient first")
        if any(n in flat for n in frozen):
            raise Fail(f"the buckets include the frozen parameter {frozen[0]} (requires_grad is False)")
        raise Fail(f"with a cap of {cap} bytes the parameters come in the order {flat}; gradient-ready "
                   f"order is {names[::-1]}")


@EXERCISE.check("buckets respect the size cap", points=2, hint=(
    "Walk the parameters once, keeping the current bucket's size in bytes (numel * element_size). A "
    "parameter joins the current bucket if the bucket stays at or under the cap with it; otherwise it starts "
    "a new one. A parameter larger than the cap still needs a bucket: its own. A bucket may be exactly full."))
def size_cap(ctx):
    model = _model(ctx)
    assign = ctx.load().assign_buckets
    params = dict(model.named_parameters())
    for cap in _caps(model):
        got = _as_names(assign(model, cap), "assign_buckets")
        unknown = [n for b in got for n in b if n not in params]
        if unknown:
            raise Fail(f"the buckets name {unknown[0]!r}, which is not a parameter of the model")
        if any(not b for b in got):
            raise Fail(f"with a cap of {cap} bytes one of the buckets is empty")
        # Judged in the learner's own order, so that a wrong order costs only the check above.
        want = [[n for n in b] for b in _name_buckets(params, [n for b in got for n in b], cap)]
        if got != want:
            sizes = [sum(_nbytes(params[n]) for n in b) for b in got]
            over = [i for i, (b, s) in enumerate(zip(got, sizes)) if s > cap and len(b) > 1]
            if over:
                raise Fail(f"with a cap of {cap} bytes bucket {over[0]} holds {sizes[over[0]]} bytes "
                           f"({', '.join(got[over[0]])})")
            raise Fail(f"with a cap of {cap} bytes the buckets are {got} (sizes {sizes} bytes); "
                       f"filling each as far as the cap allows gives {want}")


def _name_buckets(params: dict, order: list[str], cap: int) -> list[list[str]]:
    name_of = {id(params[n]): n for n in order}
    return [[name_of[id(p)] for p in b] for b in reference_buckets([params[n] for n in order], cap)]


def _close(got, want) -> bool:
    return torch.is_tensor(got) and got.shape == want.shape and bool(torch.allclose(got, want, atol=1e-6))


def _inputs(ctx, model, rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, model[0].in_features, generator=ctx.generator("x", rank, step))


def _loss(model, x):
    return (model(x) ** 2).mean()


def _gradients(ctx, model, step: int) -> tuple[dict, dict]:
    """The average over ranks of each rank's gradient (computed here from every rank's inputs), and this rank's own."""
    total: dict[str, torch.Tensor] = {}
    own: dict[str, torch.Tensor] = {}
    for r in range(ctx.world_size):
        m = copy.deepcopy(model)
        _loss(m, _inputs(ctx, m, r, step)).backward()
        for n, p in m.named_parameters():
            if p.grad is not None:
                total[n] = total.get(n, 0) + p.grad / ctx.world_size
                if r == ctx.rank:
                    own[n] = p.grad
    return total, own


def _train(ctx, steps: int, spy: list | None = None):
    """Run ``steps`` backward passes through the learner's sync; check the gradients after each finish()."""
    model = _model(ctx)
    cap = _caps(model)[2]
    calls = spy if spy is not None else []
    state = {"backward": False}
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        calls.append({"numel": tensor.numel(), "async": bool(async_op), "backward": state["backward"]})
        return original(tensor, *args, **kwargs)

    # Before the learner's hooks are on the parameters (a copy of the model would carry them).
    grads = [_gradients(ctx, model, step) for step in range(steps)]
    with replaced_dist({"all_reduce": all_reduce}):
        sync = ctx.load().BucketedGradientSync(model, cap)
        for step, (want, own) in enumerate(grads):
            model.zero_grad(set_to_none=True)
            loss = _loss(model, _inputs(ctx, model, ctx.rank, step))
            state["backward"] = True
            loss.backward()
            state["backward"] = False
            sync.finish()
            for n, p in model.named_parameters():
                if n not in want:
                    if p.grad is not None:
                        raise Fail(f"rank {ctx.rank}: the frozen parameter {n} has a gradient after finish()")
                    continue
                problem = describe_mismatch(f"rank {ctx.rank}, step {step + 1}: {n}.grad after finish()",
                                            p.grad, want[n])
                if problem:
                    if step > 0 and _close(p.grad, grads[0][0][n]):
                        problem += "; it is the first step's average"
                    elif ctx.world_size > 1 and _close(p.grad, own[n] / ctx.world_size):
                        problem += ("; it is this rank's own gradient divided by the world size: no all-reduce "
                                    "of it ran in this step")
                    raise Fail(problem)
    return sync, model, cap


@EXERCISE.check("finish() leaves the averaged gradients", points=2, world_size=2, hint=(
    "Each hook copies p.grad into its place in the bucket's flat buffer; the all-reduce sums the buffers of "
    "all ranks in place. After waiting for it, divide by the world size and copy each parameter's slice back "
    "into p.grad, shaped like the parameter."))
def averages(ctx):
    _train(ctx, 1)


@EXERCISE.check("one async all-reduce per bucket, during backward", points=2, world_size=2, hint=(
    "The point of buckets is overlap: a bucket's all-reduce should start inside backward, from the hook "
    "that brings its last gradient, with async_op=True so that backward carries on while it travels. "
    "finish() only waits for the handles. One message per bucket, not per parameter."))
def async_during_backward(ctx):
    calls: list = []
    sync, model, cap = _train(ctx, 1, calls)
    params = dict(model.named_parameters())
    # One per bucket of the learner's own buckets: a wrong order costs only the order check.
    buckets = _as_names(getattr(sync, "buckets", None), "BucketedGradientSync.buckets")
    if any(n not in params for b in buckets for n in b):
        raise Fail("BucketedGradientSync.buckets names something that is not a parameter of the model")
    if not calls:
        raise Fail("dist.all_reduce was never called")
    late = [c for c in calls if not c["backward"]]
    if late:
        raise Fail(f"{len(late)} of the {len(calls)} all-reduces were started after backward had returned "
                   f"(in finish()?), so none of the communication overlaps backward")
    blocking = [c for c in calls if not c["async"]]
    if blocking:
        raise Fail(f"{len(blocking)} all-reduce{'s were' if len(blocking) > 1 else ' was'} called without "
                   f"async_op=True: backward stops until it is done")
    want = sorted(sum(params[n].numel() for n in b) for b in buckets)
    if sorted(c["numel"] for c in calls) != want:
        raise Fail(f"{len(calls)} all-reduces of {sorted(c['numel'] for c in calls)} elements were started; "
                   f"the {len(buckets)} buckets hold {want} elements")


@EXERCISE.check("a second step works too", points=1, world_size=2, hint=(
    "After finish() the sync must be ready for the next backward: reset whatever counts the gradients that "
    "have arrived, and forget the finished handles. Training calls backward and finish() once per step."))
def second_step(ctx):
    _train(ctx, 2)


@EXERCISE.check("3 ranks", points=1, world_size=3, hint=(
    "Divide by dist.get_world_size(), whatever it is; nothing in the buckets depends on the number of ranks."))
def three_ranks(ctx):
    _train(ctx, 1)
