"""Checks of exercise 1: ring all-reduce from send/recv."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import Exercise, Fail, ForbiddenCall, describe_mismatch, replaced_dist

EXERCISE = Exercise("ex01_ring_allreduce", "Ring all-reduce from send/recv", "notebooks/01_collectives.ipynb")

COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single")


def _forbidden(name):
    def refuse(*args, **kwargs):
        raise ForbiddenCall(f"ring_all_reduce called torch.distributed.{name}, which this exercise switches "
                            f"off: build the sum from point-to-point messages (send/recv, isend/irecv) only")
    return refuse


def _inputs(ctx, shape, dtype, key) -> list[torch.Tensor]:
    """Every rank's input, rebuilt from the seed on each rank. bf16 inputs are small whole numbers,
    whose sum is exact in any order, so bf16 results can be compared exactly."""
    xs = []
    for r in range(ctx.world_size):
        g = ctx.generator(key, r)
        if dtype == torch.bfloat16:
            xs.append(torch.randint(-8, 9, shape, generator=g).to(dtype))
        else:
            xs.append(torch.randn(shape, generator=g, dtype=dtype))
    return xs


def _diagnose(ctx, got, want: torch.Tensor, own: torch.Tensor) -> None:
    problem = describe_mismatch(f"rank {ctx.rank}'s result", got, want)
    if problem is None:
        return
    if not torch.is_tensor(got) or got.shape != want.shape or got.dtype != want.dtype:
        raise Fail(problem)
    n, g, w = ctx.world_size, got.detach().reshape(-1).double(), want.reshape(-1).double()
    if n > 1 and torch.equal(got, own):
        raise Fail(f"{problem}; it is this rank's own input, as if nothing had been received")
    ok = [bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5)) for a, b in zip(g.tensor_split(n), w.tensor_split(n))
          if a.numel()]
    if ok.count(True) == 1:
        raise Fail(f"{problem}; only one of the {n} chunks holds the full sum, the others hold partial sums")
    tail = g.numel() % n
    if tail and torch.allclose(g[:-tail], w[:-tail], atol=1e-5, rtol=1e-5):
        raise Fail(f"{problem}; only the last {tail} element{'s' * (tail > 1)} are wrong: "
                   f"{g.numel()} elements on {n} ranks do not cut into equal chunks")
    raise Fail(problem)


def _check_sum(ctx, shape, dtype=torch.float32, key="") -> None:
    xs = _inputs(ctx, shape, dtype, key)
    mine = xs[ctx.rank].clone()
    with replaced_dist({name: _forbidden(name) for name in COLLECTIVES}):
        got = ctx.load().ring_all_reduce(mine)
    want = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
    _diagnose(ctx, got, want, xs[ctx.rank])


@EXERCISE.check("sums over 2 ranks", points=3, world_size=2, hint=(
    "A ring all-reduce is two phases of n-1 steps: a reduce-scatter, after which each rank holds the "
    "complete sum of one chunk, then an all-gather, in which the finished chunks travel round the ring "
    "until every rank has them all. At each step a rank sends to rank+1 and receives from rank-1; work "
    "out on paper which chunk each rank sends at step k of each phase. A send blocks until its receiver "
    "receives, so if every rank sends first, nobody receives: start the send with dist.isend, receive, then "
    "wait for the send."))
def sums_two_ranks(ctx):
    _check_sum(ctx, (24,), key="flat")
    _check_sum(ctx, (4, 6), key="2d")


@EXERCISE.check("keeps bf16 as bf16", points=1, world_size=2, hint=(
    "The result must have the input's dtype: receive into buffers made like the chunk you expect "
    "(torch.empty_like), and add in place, rather than building float32 tensors."))
def keeps_bf16(ctx):
    _check_sum(ctx, (10,), dtype=torch.bfloat16, key="bf16")


@EXERCISE.check("leaves its input unchanged", points=1, world_size=2, hint=(
    "The caller still owns the tensor it passed in: reduce into a copy (tensor.clone()) and return that."))
def input_unchanged(ctx):
    x = torch.randn(12, generator=ctx.generator(ctx.rank))
    before = x.clone()
    with replaced_dist({name: _forbidden(name) for name in COLLECTIVES}):
        ctx.load().ring_all_reduce(x)
    if not torch.equal(x, before):
        raise Fail(f"rank {ctx.rank}: the tensor passed in was changed by the call")


@EXERCISE.check("3 ranks, lengths not divisible by 3", points=3, world_size=3, hint=(
    "When n does not divide the length, cut it into n chunks whose sizes differ by at most one (some are "
    "empty when there are fewer elements than ranks), and make every rank cut it the same way. A chunk "
    "size computed with // alone leaves the remainder out."))
def three_ranks_odd(ctx):
    for shape in ((7,), (2,), (1,), (11,), (2, 5)):
        _check_sum(ctx, shape, key=shape)


@EXERCISE.check("each rank sends 2(n-1)/n of the tensor (3 ranks)", points=1, world_size=3, hint=(
    "The ring is bandwidth-optimal: each of its 2(n-1) steps sends one chunk, 1/n of the tensor, so a rank "
    "sends 2(n-1)/n of it in all, whatever n is. Sending the whole tensor to every other rank, or gathering "
    "everything on one rank and sending it back out, gets the sum too but moves far more bytes."))
def bytes_sent(ctx):
    sent = []
    originals = {name: getattr(dist, name) for name in ("send", "isend")}

    def counting(name):
        def call(tensor, *args, **kwargs):
            sent.append(tensor.numel() * tensor.element_size())
            return originals[name](tensor, *args, **kwargs)
        return call

    with replaced_dist({name: counting(name) for name in originals}):
        _check_sum(ctx, (3000,), key="bytes")
    n, size = ctx.world_size, 3000 * 4
    ring = 2 * (n - 1) * size // n
    if sum(sent) > ring:
        raise Fail(f"rank {ctx.rank} sent {sum(sent)} bytes in {len(sent)} messages for a tensor of {size} bytes "
                   f"on {n} ranks; the ring sends {ring}")


@EXERCISE.check("one rank", points=1, world_size=1, hint=(
    "With one rank there is nobody to talk to: both phases have zero steps, and the sum is a copy of "
    "the tensor. Check that your loops and your rank+1 / rank-1 arithmetic (modulo n) allow that."))
def one_rank(ctx):
    _check_sum(ctx, (5,), key="one")


