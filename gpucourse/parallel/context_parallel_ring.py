"""Ring attention (``--cp-algo ring``, Liu et al. 2023): context-parallel attention as K and V blocks passed round.

Each of the cp ranks holds T/cp tokens of every sequence (``context_parallel.py``). Attention needs every earlier
key: the ring gets them to each rank one block at a time. At step s a rank attends its queries to the K and V
block it holds — its own at step 0, then the block of the rank s places before it — while it already sends that
block on to the next rank and receives the next one (point to point, overlapping the attention). The partial
results of the blocks are merged exactly with the online softmax: each block's output comes with the log of its
softmax denominator (the log-sum-exp), and two partials combine as weights ``exp(lse_i − lse)``. Backward is a
ring too: the blocks travel again, each attention block's gradient computed from the saved log-sum-exp, and the
gradients of K and V travel with them until they are home.

A query may see a key only at its own position or before (causal), so each block is attended with a mask built
from the tokens' true positions, whole (every key earlier), partial, or not at all (skipped: no work, no NaN).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """True where query position may see key position (the key is not later)."""
    return k_pos[None, :] <= q_pos[:, None]


def visible_part(q_pos: torch.Tensor, k_pos: torch.Tensor):
    """The part of a block the causal mask lets any query see: ``(rows, cols, bias, causal)``, or None if none.

    ``rows``: the queries that see at least one key of the block; ``cols``: the keys
    at least one of them sees. Over rows × cols, ``causal``: query i sees keys 0..i
    (the rank's own block, its positions in order), else ``bias``: 0 where a query
    sees a key and −inf where not (None where each sees all). Only that part is
    computed: under the zig-zag split a block away from the diagonal is half of one,
    and a block in the future of every query (the causal imbalance) is skipped.
    """
    mask = causal_mask(q_pos, k_pos)
    rows, cols = mask.any(1).nonzero()[:, 0], mask.any(0).nonzero()[:, 0]
    if len(rows) == 0:
        return None
    part = mask[rows][:, cols]
    if part.all():
        return rows, cols, None, False
    if part.shape[0] == part.shape[1] and torch.equal(part, torch.ones_like(part).tril()):
        return rows, cols, None, True
    return rows, cols, torch.zeros(part.shape, device=part.device).masked_fill(~part, float("-inf")), False


def block_attention(q, k, v, bias, causal, scale):
    """softmax(q·kᵀ·scale + bias)·v, and each query's log-sum-exp of its scores: ``(o, lse)``.

    On CPU the fused (flash) kernel SDPA itself uses returns both in one pass,
    never holding the scores; elsewhere the same written out, scores held (as
    exercise ex11 writes it).
    """
    bias = None if bias is None else bias.to(q.device, q.dtype)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, attn_mask=bias,
                                                                          scale=scale)
    return written_out(q, k, v, _causal_bias(q, k) if causal else bias, scale)


def block_attention_backward(grad_out, q, k, v, out, lse, bias, causal, scale):
    """The gradients ``(dq, dk, dv)`` of one block, given the *whole* attention's output and log-sum-exp.

    With the final ``out`` and ``lse`` (not the block's own), exp(scores − lse) is
    this block's share of the true softmax and rowsum(dO ∘ O) the true delta, so
    the blocks' gradients add up to full attention's (as FlashAttention's backward).
    """
    bias = None if bias is None else bias.to(q.device, q.dtype)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    return written_out_backward(grad_out, q, k, v, out, lse, _causal_bias(q, k) if causal else bias, scale)


def _causal_bias(q, k):
    return torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device).masked_fill(
        causal_mask(torch.arange(q.shape[-2]), torch.arange(k.shape[-2])).logical_not().to(q.device), float("-inf"))


def written_out(q, k, v, bias, scale):
    """:func:`block_attention` with the scores held: the math the fused kernel does in tiles."""
    scores = q @ k.transpose(-2, -1) * scale + (0 if bias is None else bias)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def written_out_backward(grad_out, q, k, v, out, lse, bias, scale):
    """:func:`block_attention_backward` with the scores held."""
    scores = q @ k.transpose(-2, -1) * scale + (0 if bias is None else bias)
    p = torch.exp(scores - lse[..., None]).to(q.dtype)  # softmax probabilities (0: masked)
    delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O): softmax's backward
    ds = p * (grad_out @ v.transpose(-2, -1) - delta)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ grad_out


def _pass(tensors: list[torch.Tensor], group, name: str) -> tuple[list[torch.Tensor], list]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = (dist.get_global_rank(group, (rank + d) % n) for d in (1, -1))
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    handles = [comm.isend(t.contiguous(), nxt, group=group, name=f"cp send {name}") for t in tensors]
    handles += [comm.irecv(r, prev, group=group, name=f"cp recv {name}") for r in received]
    return received, handles


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys, the K/V blocks passed around a ring.

    Forward keeps, per query, the running output and log-sum-exp of the blocks
    seen so far; a new block's partial result (o_j, lse_j) merges in as

        lse = log(e^lse + e^lse_j),   o = o · e^(old lse − lse) + o_j · e^(lse_j − lse)

    which is exactly the softmax over all the keys, whatever order they came in.
    Backward recomputes each block's probabilities from the saved log-sum-exp
    (as FlashAttention does) and sends the K/V gradients around with their block.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, every):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)  # half precision merges in fp32, as the kernels' lse is
        out = torch.zeros_like(q, dtype=acc)  # q's layout, (B, T, H, d) in memory: the projection needs no copy
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        # What each block shows this rank's queries, worked out once (on q's device, as index_select needs).
        parts = [visible_part(every[rank].to(q.device), every[owner].to(q.device)) for owner in range(n)]
        k_cur, v_cur = k, v
        for step in range(n):
            owner = (rank - step) % n  # whose block this rank holds now
            if step < n - 1:  # the next block is on its way while this one is computed
                (k_next, v_next), handles = _pass([k_cur, v_cur], group, "K/V")
            part = parts[owner]
            if part is not None:  # every row here sees at least one key: lse_j is finite
                rows, cols, bias, causal = part
                o_j, lse_j = block_attention(q.index_select(-2, rows), k_cur.index_select(-2, cols),
                                             v_cur.index_select(-2, cols), bias, causal, scale)
                seen = lse.index_select(-1, rows)
                new = torch.logaddexp(seen, lse_j.to(lse.dtype))  # (a row that has seen nothing: -inf, e^-inf = 0)
                merged = out.index_select(-2, rows) * torch.exp(seen - new)[..., None] + \
                    o_j * torch.exp(lse_j - new)[..., None]
                out.index_copy_(-2, rows, merged.to(acc))
                lse.index_copy_(-1, rows, new)
            if step < n - 1:
                for h in handles:
                    h.wait()
                k_cur, v_cur = k_next, v_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.parts, ctx.scale = group, parts, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, parts, scale = ctx.group, ctx.parts, ctx.scale
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        k_cur, v_cur = k, v
        dk_cur, dv_cur = torch.zeros_like(k), torch.zeros_like(v)  # travel with their block, home at the end
        for step in range(n):
            owner = (rank - step) % n
            if step < n - 1:
                (k_next, v_next), kv_handles = _pass([k_cur, v_cur], group, "K/V (backward)")
            part = parts[owner]
            if part is not None:
                rows, cols, bias, causal = part
                dq_j, dk_j, dv_j = block_attention_backward(
                    grad_out.index_select(-2, rows), q.index_select(-2, rows), k_cur.index_select(-2, cols),
                    v_cur.index_select(-2, cols), out.index_select(-2, rows), lse.index_select(-1, rows), bias,
                    causal, scale)
                dq = dq.index_add(-2, rows, dq_j)
                dk_cur, dv_cur = dk_cur.index_add(-2, cols, dk_j), dv_cur.index_add(-2, cols, dv_j)
            (dk_cur, dv_cur), grad_handles = _pass([dk_cur, dv_cur], group, "K/V gradients")
            for h in grad_handles + (kv_handles if step < n - 1 else []):
                h.wait()
            if step < n - 1:
                k_cur, v_cur = k_next, v_next
        return dq, dk_cur, dv_cur, None, None
