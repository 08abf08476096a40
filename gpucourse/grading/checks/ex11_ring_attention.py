"""Checks of exercise 11: ring attention — the online-softmax merge, one block, the ring forward and backward.

The learner's functions are called on every rank with that rank's blocks of
q, k, v (plain or zig-zag split, ``gpucourse.data.context_positions``); the
expected values are attention over the whole sequence on one device, in
float64, and its gradients by autograd.
"""

from __future__ import annotations

import math

import torch

from ...data import context_positions
from .. import contracts, generated
from ..contracts import Contract
from ..core import Exercise, Fail, describe_mismatch
from ..generated import DTYPES, Int, One, Space

EXERCISE = Exercise("ex11_ring_attention", "Ring attention", "notebooks/12_sequence_context_parallel.ipynb",
                    forbidden_collectives=("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                           "gather", "scatter", "all_to_all"),
                    refusal=("ring attention called {op}, which this exercise switches off: K and V travel "
                             "round the ring by point-to-point messages (isend/irecv) only"),
                    concept=("each rank attends its queries to one K/V block at a time as the blocks travel round the "
                             "ring, and merges the partial results with the online softmax (log-sum-exp)"),
                    section="§2 (context parallelism) and §3 (the ring on the timeline)")

B, H, D = 1, 2, 8

# What every caller relies on besides the values (gpucourse.grading.contracts): the inputs come back bit for bit,
# the outputs have q's dtype (out's, for the merge), and q, k, v (and dO) may be views with any strides.
MERGE = Contract("merge_partials", ("out", "lse", "out_j", "lse_j"), unchanged=("out", "lse", "out_j", "lse_j"),
                 dtype_of="out")
BLOCK = Contract("block_attention", ("q", "k", "v", "q_pos", "k_pos", "causal"),
                 unchanged=("q", "k", "v", "q_pos", "k_pos"), dtype_of="q", strided=("q", "k", "v"))
FORWARD = Contract("ring_attention_forward", ("q", "k", "v", "positions", "causal"), unchanged=("q", "k", "v"),
                   dtype_of="q", strided=("q", "k", "v"))
BACKWARD = Contract("ring_attention_backward", ("q", "k", "v", "out", "lse", "grad_out", "positions", "causal"),
                    unchanged=("q", "k", "v", "out", "lse", "grad_out"), dtype_of="q",
                    strided=("q", "k", "v", "grad_out"))
ATOL, RTOL = 1e-5, 1e-4
NEG_INF = float("-inf")


def _scores(q, k, q_pos, k_pos, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], NEG_INF)
    return s


def _attend(q, k, v, q_pos, k_pos, causal):
    """(out, lse) over these keys, in the dtype given; 0 and -inf on rows that see none of them."""
    s = _scores(q, k, q_pos, k_pos, causal)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
    return p @ v, lse


def _expect(what: str, got, want: torch.Tensor, known_wrong=(), why_not_finite: str = "") -> None:
    """Fail unless got == want; ``known_wrong``: (plausible wrong value, the sentence that explains it)."""
    # In the dtype the function was given (the contract has checked it kept it): float32 or float64.
    dtype = got.dtype if torch.is_tensor(got) and got.dtype in (torch.float32, torch.float64) else torch.float32
    problem = describe_mismatch(what, got, want.to(dtype), ATOL, RTOL)
    if problem is None:
        return
    if torch.is_tensor(got) and got.shape == want.shape:
        if not torch.isfinite(got).all() and torch.isfinite(want).all():
            bad = int((~torch.isfinite(got)).sum())
            problem += f"; {bad} of its elements are {'nan' if got.isnan().any() else 'inf'}{why_not_finite}"
        for value, sentence in known_wrong:
            if torch.allclose(got.double(), value.double(), atol=ATOL, rtol=RTOL, equal_nan=False):
                problem += f"; {sentence}"
                break
    raise Fail(problem)


def _pair(what: str, value) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise Fail(f"{what} returned {type(value).__name__} {str(value)[:60]}, not a pair (out, lse)")
    return tuple(value)


def _blocks(ctx, n: int, t: int, key, zigzag: bool = False, scale: float = 1.0, dtype=torch.float32) -> tuple:
    """Every rank's q, k, v (in ``dtype``) and positions; the whole sequence's, in float64, in position order."""
    T = n * t
    g = ctx.generator("qkv", key)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) * s for s in (scale, scale, 1.0))
    if scale > 1:  # whatever the seed, one score of √D·scale² (407 at 12): e^s overflows float32 past 88
        q[..., 0, :] = k[..., 0, :] = scale
    positions = [context_positions(T, r, n, zigzag) for r in range(n)]
    per_rank = [tuple(x[:, :, positions[r]].to(dtype) for x in (q, k, v)) for r in range(n)]
    return per_rank, positions, (q, k, v)


def _whole(q, k, v, causal: bool, grad_out=None) -> dict:
    """Attention over the whole sequence in float64: out, lse and, with ``grad_out``, the gradients."""
    pos = torch.arange(q.shape[-2])
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = _attend(q, k, v, pos, pos, causal)
    result = {"out": out.detach(), "lse": lse.detach()}
    if grad_out is not None:
        (out * grad_out).sum().backward()
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return result


# --- one process: the merge and one block ---------------------------------------------------------------


@EXERCISE.check("merge_partials is the softmax over both sets of keys", points=2, hint=(
    "Each part is normalised by its own denominator e^lse. Over both sets the denominator is "
    "e^lse + e^lse_j, so new_lse = log(e^lse + e^lse_j) and out = out·e^(lse − new_lse) + out_j·e^(lse_j − "
    "new_lse): each part re-weighted by its share of the whole, not simply added. Never compute e^lse itself "
    "(e^89 overflows float32): torch.logaddexp, or subtract the larger of the two first. A side that is -inf "
    "gets weight e^-inf = 0."))
def merge(ctx):
    g = ctx.generator("merge")
    rows, keys = 12, 10
    q, k = torch.randn(B, H, rows, D, generator=g, dtype=torch.float64), torch.randn(B, H, keys, D, generator=g,
                                                                                       dtype=torch.float64)
    v = torch.randn(B, H, keys, D, generator=g, dtype=torch.float64)
    q[..., :6, :] *= 60.0  # scores in the hundreds on these rows: e^lse overflows
    # Rows 0-1 see none of the first set (keys 0-4), rows 6-7 none of the second (keys 5-9), the rest both.
    hide = torch.zeros(rows, keys, dtype=torch.bool)
    hide[0:2, :5] = hide[6:8, 5:] = True
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(hide, NEG_INF)
    parts = []
    for cols in (slice(0, 5), slice(5, 10)):
        part = s[..., cols]
        lse = torch.logsumexp(part, -1)
        p = torch.exp(part - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
        parts.append((p @ v[..., cols, :], lse))
    (o1, l1), (o2, l2) = parts
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    for first, second, label in (((o1, l1), (o2, l2), ""), ((o2, l2), (o1, l1), " (the other way round)")):
        args = tuple(x.float() for x in (*first, *second))
        got_out, got_lse = _pair("merge_partials", ctx.call(MERGE.function, *args).value)
        added = first[0] + second[0]
        larger = torch.maximum(first[1], second[1])
        overflow = " (the log-sum-exps of rows 0-5 are in the hundreds: e^lse overflows float32 past 88)"
        _expect(f"the merged out{label}", got_out, out,
                [(added, "it is out + out_j: each part was normalised over its own keys only; re-weight each "
                         "by e^(its lse − the merged lse)")], overflow)
        _expect(f"the merged lse{label}", got_lse, lse,
                [(larger, "it is the larger of the two log-sum-exps, not the log of the sum of their "
                          "exponentials")], overflow)


@EXERCISE.check("block_attention masks by position", points=1, hint=(
    "Scores q·kᵀ/√d, -inf where the key's position is later than the query's (k_pos[None, :] > "
    "q_pos[:, None]), lse = logsumexp over the block's keys. A row whose every key is hidden has lse = -inf, "
    "and exp(score − lse) there is exp(-inf − (-inf)) = nan: give such rows out 0 (subtract 0 instead of lse "
    "there, or mask the result). Without causal, no key is hidden."))
def one_block(ctx):
    g = ctx.generator("block")
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (6, 4, 4))
    q_pos = torch.tensor([0, 1, 2, 13, 14, 15])   # a zig-zag rank's queries: an early chunk and a late one
    k_pos = torch.tensor([4, 5, 10, 11])          # a block between them: hidden from the first three entirely
    for causal in (True, False):
        out, lse = _attend(q, k, v, q_pos, k_pos, causal)
        args = (*(x.float() for x in (q, k, v)), q_pos, k_pos, causal)
        got_out, got_lse = _pair("block_attention", ctx.call(BLOCK.function, *args).value)
        label = " (causal)" if causal else " (no mask)"
        _expect(f"block_attention's out{label}", got_out, out,
                [(_attend(q, k, v, q_pos, k_pos, not causal)[0],
                  "it is the other masking: causal hides keys at later positions, only when causal is True")])
        _expect(f"block_attention's lse{label}", got_lse, lse)
    generated.for_all(ctx, BLOCKS, lambda case: _attends(ctx, case), count=12, describe=_block_words)


# One block drawn: 1 to 7 queries over 1 to 6 keys, heads of 1 to 8 dimensions, one (batch, head) or several, in any
# float dtype, causal or not, the keys before every query, anywhere, or after every one (causal: nothing seen) —
# each dtype with each of the three.
BLOCKS = Space(queries=Int(1, 7), keys=Int(1, 6), head_dim=One((8, 1, 3)), heads=One(((1, 2), (2, 3), (1, 1))),
               dtype=One(DTYPES), causal=One((True, False)), where=One(("anywhere", "before", "after")),
               pairs=("dtype", "where"))


def _drawn_block(case: dict) -> tuple:
    (b, h), d = case["heads"], case["head_dim"]
    q, k, v = (generated.tensor(case, (b, h, n, d), case["dtype"], name)
               for name, n in (("q", case["queries"]), ("k", case["keys"]), ("v", case["keys"])))
    g = generated.generator(case, "positions")
    q_pos = torch.randperm(20, generator=g)[:case["queries"]].sort().values + 10
    k_pos = {"anywhere": torch.randperm(40, generator=g)[:case["keys"]].sort().values,
             "before": torch.arange(case["keys"]), "after": torch.arange(case["keys"]) + 40}[case["where"]]
    return q, k, v, q_pos, k_pos, case["causal"] or case["where"] == "after"


def _block_words(case: dict) -> str:
    q, k, _, q_pos, k_pos, causal = _drawn_block(case)
    return (f"block_attention{' (causal)' * causal} of q {generated.shape_words(tuple(q.shape))} at positions "
            f"{q_pos.tolist()} over k {generated.shape_words(tuple(k.shape))} at {k_pos.tolist()}, in "
            f"{generated.name(q.dtype)}")


def _attends(ctx, case: dict) -> str | None:
    args = _drawn_block(case)
    q = args[0]
    got = ctx.call(BLOCK.function, *args).value
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"block_attention returned {generated.kind(got)}, not a pair (out, lse)"
    out, lse = _attend(*(x.double() for x in args[:3]), *args[3:])
    for what, mine, want in (("out", got[0], out), ("lse", got[1], lse)):
        dtype = q.dtype  # the values here, at the coarser of the two dtypes; q's dtype kept is the contract's check
        if torch.is_tensor(mine) and mine.is_floating_point():
            dtype = generated.coarser(mine.dtype, q.dtype)
            mine = mine.to(dtype)
        problem = generated.mismatch(f"block_attention's {what}", mine, want.to(dtype))
        if problem:
            return problem
    return None


# --- the ring ---------------------------------------------------------------------------------------------


def _owner_swapped(per_rank, positions, causal) -> list:
    """Each rank's out had it masked block rank - s with the positions of rank + s (the wrong direction)."""
    n = len(per_rank)
    outs = []
    for r in range(n):
        q = per_rank[r][0].double()
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=q.dtype)
        for s in range(n):
            _, k, v = (x.double() for x in per_rank[(r - s) % n])
            o_j, l_j = _attend(q, k, v, positions[r], positions[(r + s) % n], causal)
            new = torch.logaddexp(lse, l_j)
            ok = new > NEG_INF
            w1 = torch.where(ok, torch.exp(lse - new.masked_fill(~ok, 0)), 0.0)
            w2 = torch.where(ok, torch.exp(l_j - new.masked_fill(~ok, 0)), 0.0)
            out, lse = out * w1[..., None] + o_j * w2[..., None], new
        outs.append(out)
    return outs


def _call_all(ctx, contract: Contract, args: list, held: bool, strided: bool = False) -> list:
    """Every rank's call; ``held``: held to ``contract`` too (the contract checks), with ``strided`` inputs."""
    return contracts.call_all(ctx, contract, args, strided) if held else ctx.call_all(contract.function, args)


def _forward(ctx, t: int, causal: bool, zigzag: bool, key, held: bool = False, strided: bool = False,
             scale: float = 1.0, dtype=torch.float32) -> list:
    """Every rank's forward, checked against the whole sequence's attention (in bf16 only against its contract:
    its rounding is far above the tolerance); ``held``: against its contract too. The Outcomes."""
    n = ctx.world_size
    per_rank, positions, (q, k, v) = _blocks(ctx, n, t, key, zigzag, scale, dtype)
    whole = _whole(q, k, v, causal)
    outs = _call_all(ctx, FORWARD, [(*per_rank[r], positions, causal) for r in range(n)], held, strided)
    if dtype == torch.bfloat16:
        return outs
    split = "zig-zag" if zigzag else "plain"
    label = f"({'causal' if causal else 'no mask'}, {split} split, {n} ranks)"
    swapped = _owner_swapped(per_rank, positions, causal) if causal and n > 2 else None
    for o in outs:
        r = o.rank
        got_out, got_lse = _pair(f"rank {r}'s ring_attention_forward", o.value)
        mine = positions[r]
        own = _attend(*(x.double() for x in per_rank[r]), mine, mine, causal)[0]
        known = [(own, "it is attention over this rank's own keys only, as if no block had arrived")]
        if swapped is not None:
            known.append((swapped[r], "it masks each block with the positions of the wrong rank: after s hops "
                                      "a rank holds the block of rank − s (it came from rank − 1), not rank + s"))
        _expect(f"rank {r}'s out {label}", got_out, whole["out"][:, :, mine], known)
        _expect(f"rank {r}'s lse {label}", got_lse, whole["lse"][:, :, mine])
    return outs


@EXERCISE.check("the ring forward is attention over the whole sequence (2 ranks)", points=1, world_size=2, hint=(
    "Start from this rank's own block: out 0 and lse -inf for every query, then merge in block_attention "
    "over the K and V you hold. n − 1 times: send what you hold to rank + 1, receive rank − 1's block, and "
    "merge it in with the positions of the rank it came from — after s hops that is rank − s. Use "
    "dist.isend for the sends: every rank sends at once, and a blocking send that waits for its receiver "
    "deadlocks the ring."))
def ring_two(ctx):
    _forward(ctx, 3, causal=False, zigzag=False, key="plain")
    _forward(ctx, 3, causal=True, zigzag=False, key="causal")


def _backward(ctx, t: int, causal: bool, zigzag: bool, key, held: bool = False, strided: bool = False,
              dtype=torch.float32) -> None:
    n = ctx.world_size
    per_rank, positions, (q, k, v) = _blocks(ctx, n, t, key, zigzag, dtype=dtype)
    grad_out = torch.randn(q.shape, generator=ctx.generator("grad", key), dtype=torch.float64)
    whole = _whole(q, k, v, causal, grad_out)
    args = [(*per_rank[r], *(x[:, :, positions[r]].to(dtype) for x in (whole["out"], whole["lse"], grad_out)),
             positions, causal) for r in range(n)]
    # Softmax's backward without the - rowsum(dO∘O) term: a plausible slip, caught by name.
    pos = torch.arange(q.shape[-2])
    p = torch.softmax(_scores(q, k, pos, pos, causal), -1)
    ds_wrong = p * (grad_out @ v.transpose(-2, -1)) / math.sqrt(D)
    dq_wrong, dk_wrong = ds_wrong @ k, ds_wrong.transpose(-2, -1) @ q
    label = f"({'causal' if causal else 'no mask'}, {'zig-zag' if zigzag else 'plain'} split, {n} ranks)"
    for o in _call_all(ctx, BACKWARD, args, held, strided):
        r = o.rank
        mine = positions[r]
        if not isinstance(o.value, (tuple, list)) or len(o.value) != 3:
            raise Fail(f"rank {r}'s ring_attention_backward returned {type(o.value).__name__}, not (dq, dk, dv)")
        dq, dk, dv = o.value
        no_delta = "softmax's backward is dS = P ∘ (dP − rowsum(dO ∘ O)): the rowsum term is missing"
        _expect(f"rank {r}'s dq {label}", dq, whole["dq"][:, :, mine], [(dq_wrong[:, :, mine], no_delta)])
        nxt = positions[(r + 1) % n]
        short = (f"it is rank {(r + 1) % n}'s block's gradient: the gradients must make one more hop, home to "
                 f"their block's owner (n hops in all, one more than K and V make)")
        _expect(f"rank {r}'s dk {label}", dk, whole["dk"][:, :, mine],
                [(whole["dk"][:, :, nxt], short), (dk_wrong[:, :, mine], no_delta)])
        _expect(f"rank {r}'s dv {label}", dv, whole["dv"][:, :, mine], [(whole["dv"][:, :, nxt], short)])


@EXERCISE.check("the ring backward gives autograd's dq, dk, dv (2 ranks)", points=1, world_size=2, hint=(
    "Recompute each block's probabilities from the saved lse, P = exp(S − lse) (masked scores give 0), then "
    "dV += Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), dQ += dS·K/√d, dK += dSᵀ·Q/√d. dQ stays on this rank; "
    "dK and dV belong to the block's owner: pass them round the ring with the block, one hop after each "
    "block's work, so that after n hops they are home."))
def backward_two(ctx):
    _backward(ctx, 3, causal=False, zigzag=False, key="plain")
    _backward(ctx, 3, causal=True, zigzag=False, key="causal")


@EXERCISE.check("causal, plain and zig-zag split (3 ranks)", points=1, world_size=3, hint=(
    "The mask comes from positions, never from rank numbers: with the zig-zag split a rank holds an early "
    "chunk and a late one, so a block can be half hidden, and some queries see none of it (block_attention "
    "gives them lse -inf, which the merge must leave alone). After s hops a rank holds rank − s's block "
    "(modulo n): mask it with positions[(rank − s) % n]."))
def ring_three(ctx):
    _forward(ctx, 4, causal=True, zigzag=True, key="zigzag")
    _forward(ctx, 2, causal=True, zigzag=False, key="plain")


@EXERCISE.check("K and V go round the ring: n − 1 hops to rank + 1 (4 ranks)", points=1, world_size=4, hint=(
    "Each rank sends exactly the blocks it holds, K and V, to rank + 1 only, n − 1 times: (n − 1)/n of the "
    "sequence's K and V in all, the same bytes as an all-gather, in n − 1 steps a computation can hide. "
    "Sending your own block to every rank, or sending to rank − 1, is not a ring."))
def ring_traffic(ctx):
    n = ctx.world_size
    block = B * H * 4 * D * 4  # a (B, H, t=4, D) float32 block
    outs = _forward(ctx, 4, causal=True, zigzag=True, key="traffic")
    data, note = ctx.payloads(outs)  # by the kernel's count of the bytes on the wire
    for o in outs:
        # The sizes of the messages as the rank recorded them: their number and their sum are the kernel's.
        sizes = sorted(c["bytes"] for c in o.comm if c["op"] == "send")
        to = {s: b for (r, s), b in data.items() if r == o.rank}
        if sizes != [block] * (2 * (n - 1)) or sum(to.values()) != 2 * (n - 1) * block:
            raise Fail(f"rank {o.rank} sent {sum(to.values())} bytes in {len(sizes)} messages of {sizes} "
                       f"bytes{note}; the ring sends K and V, {block} bytes each, {n - 1} times: {2 * (n - 1)} "
                       f"messages, {2 * (n - 1) * block} bytes")
        others = sorted(set(to) - {(o.rank + 1) % n})
        if others:
            raise Fail(f"rank {o.rank} sent to rank{'s' * (len(others) > 1)} {', '.join(map(str, others))}{note}; "
                       f"in a ring each rank sends only to the next one, rank {(o.rank + 1) % n}")


@EXERCISE.check("causal backward, zig-zag split (4 ranks)", points=1, world_size=4, hint=(
    "With more than two ranks the order matters: the dK and dV a rank holds after step s belong to block "
    "rank − s, and they leave with it to rank + 1, which holds that block next. Mask with the positions of "
    "the block you hold, and count the hops: K and V make n − 1, their gradients n."))
def backward_four(ctx):
    _backward(ctx, 4, causal=True, zigzag=True, key="zigzag")


# --- the contract ----------------------------------------------------------------------------------------------


@EXERCISE.check("the contract: inputs as views, float64, scores in the hundreds (2 ranks)", points=1, world_size=2,
                hint=(
    "A caller may hand you q, k, v as views (a transpose of a larger tensor): receive into buffers of your own, "
    "torch.empty_like(t, memory_format=torch.contiguous_format), since irecv takes only contiguous tensors. Make "
    "every tensor you create in q's dtype (torch.zeros_like(q), dtype=q.dtype), never float32 by default. "
    "Scores in the hundreds overflow e^s: subtract each row's largest score before exp, or use logsumexp. "
    "And never write into an input: compute new tensors."))
def contract_two(ctx):
    _forward(ctx, 3, causal=True, zigzag=False, key="views", held=True, strided=True)
    _backward(ctx, 3, causal=True, zigzag=False, key="views", held=True, strided=True)
    _forward(ctx, 4, causal=True, zigzag=True, key="float64", held=True, dtype=torch.float64)
    _backward(ctx, 4, causal=True, zigzag=True, key="float64", held=True, dtype=torch.float64)
    _forward(ctx, 2, causal=False, zigzag=False, key="large", held=True, scale=12.0)  # scores of ±144 and beyond


@EXERCISE.check("one rank: a ring with no hop, in bf16 too", points=1, world_size=1, hint=(
    "With one rank the ring has no hop: the forward is block_attention over its own block, and the backward's "
    "dK and dV are already home (n hops of zero steps). Loops over range(n − 1) and (rank ± 1) % n allow that; "
    "a send to yourself does not. In bf16 (and float64) every tensor you create must have q's dtype, and "
    "merge_partials and block_attention keep their inputs as they were, and take views."))
def one_rank(ctx):
    _forward(ctx, 5, causal=True, zigzag=False, key="one", held=True)
    _backward(ctx, 5, causal=True, zigzag=False, key="one", held=True)
    _forward(ctx, 4, causal=True, zigzag=False, key="bf16", held=True, dtype=torch.bfloat16)
    # The two local functions under the same contract: float64, on views.
    g = ctx.generator("local")
    q, k, v = (torch.randn(B, H, 4, D, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(4)
    out, lse = _attend(q, k, v, pos, pos, True)
    got = _pair("block_attention", contracts.call(ctx, BLOCK, q, k, v, pos, pos, True, strided=True).value)
    _expect("block_attention's out (float64 views)", got[0], out)
    _expect("block_attention's lse (float64 views)", got[1], lse)
    halves = [_attend(q, k[..., keys, :], v[..., keys, :], pos, pos[keys], True) for keys in (slice(0, 2), slice(2, 4))]
    got = _pair("merge_partials", contracts.call(ctx, MERGE, *halves[0], *halves[1]).value)
    _expect("the merged out (float64)", got[0], out)
    _expect("the merged lse (float64)", got[1], lse)
