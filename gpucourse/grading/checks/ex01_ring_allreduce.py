"""Checks of exercise 1: ring all-reduce from send/recv."""

from __future__ import annotations

import torch

from .. import contracts, generated
from ..core import Exercise, Fail, describe_mismatch
from ..generated import DTYPES, One, Shape, Space

EXERCISE = Exercise("ex01_ring_allreduce", "Ring all-reduce from send/recv", "notebooks/01_collectives.ipynb",
                    forbidden_collectives=("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                           "gather", "scatter", "all_to_all"),
                    refusal=("ring_all_reduce called {op}, which this exercise switches off: build the sum from "
                             "point-to-point messages (send/recv, isend/irecv) only"),
                    concept=("a ring all-reduce is a reduce-scatter then an all-gather, n − 1 steps each: in every "
                             "step each rank sends one chunk to one neighbour and receives one from the other, so "
                             "every rank ends with the sum of every chunk"),
                    section="§3 (the ring, step by step) and §4 (2(n−1)/n)")

# What every caller relies on besides the sum (gpucourse.grading.contracts): a new tensor comes back, the one passed
# in is left bit for bit as it was, the result has its dtype, and it may be a view with any strides.
RING = contracts.Contract("ring_all_reduce", ("tensor",), unchanged=("tensor",), dtype_of="tensor",
                          strided=("tensor",), fresh=True)


def _inputs(ctx, shape, dtype, key) -> list[torch.Tensor]:
    """Every rank's input. bf16 inputs are small whole numbers, whose sum is exact in any order, so bf16
    results can be compared exactly. Each input ends in a large value at a place no other rank has, so a
    result that holds any rank's own number where the sum belongs is caught on every seed."""
    xs = []
    for r in range(ctx.world_size):
        g = ctx.generator(key, r)
        if dtype == torch.bfloat16:
            xs.append(torch.randint(-8, 9, shape, generator=g).to(dtype))
        else:
            xs.append(torch.randn(shape, generator=g, dtype=dtype) + 10.0 * (r + 1))
    return xs


def _diagnose(rank: int, n: int, got, want: torch.Tensor, own: torch.Tensor) -> None:
    problem = describe_mismatch(f"rank {rank}'s result", got, want)
    if problem is None:
        return
    if not torch.is_tensor(got) or got.shape != want.shape or got.dtype != want.dtype:
        raise Fail(problem)
    g, w = got.detach().reshape(-1).double(), want.reshape(-1).double()
    if n > 1 and torch.equal(got, own):
        raise Fail(f"{problem}; it is this rank's own input, as if nothing had been received")
    if n > 1 and torch.allclose(g * n, w, atol=1e-4, rtol=1e-5):
        raise Fail(f"{problem}; it is 1/{n} of the sum: the mean, where the sum is asked for")
    ok = [bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5)) for a, b in zip(g.tensor_split(n), w.tensor_split(n))
          if a.numel()]
    if ok.count(True) == 1 and len(ok) > 1:
        raise Fail(f"{problem}; only one of the {n} chunks holds the full sum, the others hold partial sums")
    tail = g.numel() % n
    if tail and torch.allclose(g[:-tail], w[:-tail], atol=1e-5, rtol=1e-5):
        raise Fail(f"{problem}; only the last {tail} element{'s' * (tail > 1)} are wrong: "
                   f"{g.numel()} elements on {n} ranks do not cut into equal chunks")
    raise Fail(problem)


def _check_sum(ctx, shape, dtype=torch.float32, key="", held: bool = False, strided: bool = False) -> list:
    """Every rank's call on its own input; fails unless each returns the sum (``held``: and keeps its contract,
    with ``strided`` inputs passed as views). Returns the Outcomes (with what each rank sent)."""
    xs = _inputs(ctx, shape, dtype, key)
    args = [(x.clone(),) for x in xs]
    outs = contracts.call_all(ctx, RING, args, strided) if held else ctx.call_all(RING.function, args)
    want = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
    for out, x in zip(outs, xs):
        _diagnose(out.rank, ctx.world_size, out.value, want, x)
    return outs


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


@EXERCISE.check("the contract: bf16 stays bf16, float64 stays float64 (2 ranks)", points=1, world_size=2, hint=(
    "The result must have the input's dtype: receive into buffers made like the chunk you expect "
    "(torch.empty_like), and add in place, rather than building tensors in the default dtype, float32."))
def keeps_dtype(ctx):
    _check_sum(ctx, (10,), dtype=torch.bfloat16, key="bf16", held=True)
    _check_sum(ctx, (2, 5), dtype=torch.float64, key="float64", held=True)


@EXERCISE.check("the contract: a new tensor, the input unchanged, a view accepted (2 ranks)", points=1, world_size=2,
                hint=(
    "The caller still owns the tensor it passed in: reduce into a copy (tensor.clone()) and return that, a "
    "tensor of its own, not the input nor a view of it. The caller may pass a view (a transposed matrix): "
    "flatten a copy with .reshape(-1), which copies when it must, where .view(-1) refuses, and send and "
    "receive contiguous chunks of that flat copy."))
def input_unchanged(ctx):
    _check_sum(ctx, (12,), key="fresh", held=True)
    _check_sum(ctx, (4, 6), key="view", held=True, strided=True)


@EXERCISE.check("3 ranks, lengths not divisible by 3", points=3, world_size=3, hint=(
    "When n does not divide the length, cut it into n chunks whose sizes differ by at most one (some are "
    "empty when there are fewer elements than ranks), and make every rank cut it the same way. A chunk "
    "size computed with // alone leaves the remainder out."))
def three_ranks_odd(ctx):
    for shape in ((7,), (2,), (1,), (11,), (2, 5)):
        _check_sum(ctx, shape, key=shape)
    generated.for_all(ctx, TENSORS, lambda case: _sums(ctx, case), count=5,
                      describe=lambda case: f"ring_all_reduce on {ctx.world_size} ranks of "
                                            f"{generated.shape_words(case['shape'])} {generated.name(case['dtype'])}")


# A tensor drawn: 0-d, one element, an odd length, an odd matrix, or no element at all, in any float dtype.
TENSORS = Space(shape=Shape(), dtype=One(DTYPES))


def _sums(ctx, case: dict) -> str | None:
    """Every rank's sum of a drawn tensor. Half-precision inputs are small whole numbers (their sum is exact in any
    order); the values are compared at the coarser of the result's and the input's dtype, since the dtype kept is
    the contract's check."""
    dtype, shape = case["dtype"], case["shape"]
    if dtype.itemsize == 2:
        xs = [generated.tensor(case, shape, torch.float64, r).mul(4).round().to(dtype) for r in range(ctx.world_size)]
    else:
        xs = [generated.tensor(case, shape, dtype, r) + 10.0 * (r + 1) for r in range(ctx.world_size)]
    outs = ctx.call_all(RING.function, [(x.clone(),) for x in xs])
    want = torch.stack([x.double() for x in xs]).sum(0)
    for o in outs:
        got, at = o.value, dtype
        if torch.is_tensor(got) and got.is_floating_point():
            at = generated.coarser(got.dtype, dtype)
            got = got.to(at)
        problem = generated.mismatch(f"rank {o.rank}'s result", got, want.to(at))
        if problem:
            return problem
    return None


@EXERCISE.check("each rank sends 2(n-1)/n of the tensor, to rank+1 (3 ranks)", points=1, world_size=3, hint=(
    "The ring is bandwidth-optimal: each of its 2(n-1) steps sends one chunk, 1/n of the tensor, to the next "
    "rank, so a rank sends 2(n-1)/n of it in all, whatever n is. Sending the whole tensor to every other rank, "
    "or gathering everything on one rank and sending it back out, gets the sum too but moves far more bytes."))
def bytes_sent(ctx):
    n, numel = ctx.world_size, 3000
    size = numel * 4
    ring = 2 * (n - 1) * size // n
    outs = _check_sum(ctx, (numel,), key="bytes")
    data, note = ctx.payloads(outs)  # by the kernel's count of the bytes on the wire
    for out in outs:
        to = {s: b for (r, s), b in data.items() if r == out.rank}
        sent, messages = sum(to.values()), sum(c["op"] == "send" for c in out.comm)
        if sent != ring:
            raise Fail(f"rank {out.rank} sent {sent} bytes in {messages} messages for a tensor of {size} bytes on "
                       f"{n} ranks{note}; the ring sends exactly {ring}, in {2 * (n - 1)} messages of {size // n}")
        others = sorted(set(to) - {(out.rank + 1) % n})
        if others:
            raise Fail(f"rank {out.rank} sent to rank{'s' * (len(others) > 1)} {', '.join(map(str, others))}{note}; "
                       f"in a ring each rank sends only to the next one, rank {(out.rank + 1) % n}")


@EXERCISE.check("one rank", points=1, world_size=1, hint=(
    "With one rank there is nobody to talk to: both phases have zero steps, and the sum is a copy of "
    "the tensor. Check that your loops and your rank+1 / rank-1 arithmetic (modulo n) allow that."))
def one_rank(ctx):
    _check_sum(ctx, (5,), key="one", held=True)
