"""Context parallelism: every rank holds a part of every sequence, through the whole model.

Tensor parallelism cuts the weights, sequence parallelism the activations
*between* sub-layers; with long sequences the activations *inside* — above all
attention's — still grow with the sequence. Context parallelism gives each of
``cp`` ranks T/cp tokens of every sequence for the whole forward and backward:
embeddings, LayerNorms, MLPs and projections work token by token, so they need
nothing from other ranks. Attention is the one place tokens meet: a query must
see the keys and values of every earlier token, wherever they are held. Three
ways to bring them together (``--cp-algo``):

- ``allgather`` (Llama 3's choice): all-gather K and V once per layer, attend the
  rank's own queries over all of them; backward reduce-scatters their gradients.
  Simple; every rank briefly holds the whole sequence's K and V.
- ``ring`` (Liu et al., 2023): K and V blocks travel around the ring of cp ranks
  by point-to-point, one hop per step; each rank attends its queries to the
  block it holds and merges the partial results with the online softmax
  (log-sum-exp), while the next block is already on its way. Backward is a ring
  too: the blocks travel again, carrying the gradients of K and V home.
- ``ulysses`` (DeepSpeed-Ulysses): an all-to-all turns sequence-sharded q, k, v
  into head-sharded ones — every rank then holds the *whole sequence* for
  n_head/cp heads and attends as one device would — and a second all-to-all
  turns the output back. Needs cp to divide the heads.

**Causal load balance.** With a causal mask a query attends only to earlier
keys. Cut the sequence in cp plain chunks and rank 0's queries see one block,
the last rank's see all of them: the last rank does cp times rank 0's work. The
zig-zag split cuts it into 2·cp chunks and gives rank i chunks i and
2·cp − 1 − i, an early one and a late one, so every rank does the same work
(``data.context_positions``). Positions travel with the tokens: each rank embeds
its tokens at their true positions, and every mask is built from positions.

Gradients: each rank's loss is the mean over its tokens, and every rank holds as
many tokens, so the global loss is the mean over cp ranks, and the gradients of
the (replicated) weights are averaged over dp × cp together — data parallelism
over the flattened dp×cp mesh (``parallelize`` hands it that group).

Communication per layer, forward, each rank, for K and V of b sequences, H
heads of size d, T tokens, in fp32 (bytes as counted in ``gpucourse.comm``):
allgather: all-gather payload 2 · 4·b·H·T·d (the whole K and V);
ring: cp − 1 sends of K and V blocks, 2 · 4·b·H·(T/cp)·d each;
ulysses: four all-to-alls of q, k, v and the output, 4·b·H·(T/cp)·d each.
Backward moves the same again (ring: cp sends of the gradients, which also
come home, and cp − 1 of K and V).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..data import context_positions
from ..model import blocks_of
from .sequence_parallel import GatherSequence, conjugate

ALGORITHMS = ("ring", "allgather", "ulysses")


def apply_context_parallel(module: torch.nn.Module, cp_group, seq_len: int, algo: str = "ring",
                           zigzag: bool = False) -> torch.nn.Module:
    """Make ``module`` (a GPT or a pipeline stage) work on this rank's tokens; return it.

    Its position embedding looks up this rank's true positions, and each block's
    attention attends over every rank's keys with ``algo``.
    """
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    every = [context_positions(seq_len, r, cp, zigzag) for r in range(cp)]  # each rank's positions
    mine = every[rank]
    if hasattr(module, "wpe"):  # the first stage embeds: at this rank's positions, not 0..T/cp-1
        module.wpe.register_forward_pre_hook(lambda m, args: (mine.to(args[0].device),))
    attend = {"ring": RingAttention.apply, "allgather": allgather_attention, "ulysses": ulysses_attention}[algo]
    for block in blocks_of(module):
        block.attn.attend = lambda q, k, v: attend(q, k, v, cp_group, every)
    return module


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """True where query position may see key position (the key is not later)."""
    return k_pos[None, :] <= q_pos[:, None]


# --- allgather: the whole K and V, once per layer ------------------------------------------------

def allgather_attention(q, k, v, group, every: list[torch.Tensor]) -> torch.Tensor:
    """This rank's queries over every rank's keys: K and V all-gathered, the mask from positions."""
    # (B, H, T/cp, d) → (B, T/cp, H, d) → gathered along the sequence; backward reduce-scatters the gradients.
    k_all, v_all = (GatherSequence.apply(t.transpose(1, 2), group, f"cp {name}").transpose(1, 2)
                    for t, name in ((k, "K"), (v, "V")))
    mask = causal_mask(every[dist.get_rank(group)], torch.cat(every)).to(q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


# --- ulysses: from sequence-sharded to head-sharded and back --------------------------------------

def _heads_to_sequence(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """(B, H, T/cp, d) on each rank → (B, H/cp, T, d): every rank's tokens, this rank's heads (an all-to-all)."""
    n = dist.get_world_size(group)
    B, H, t, d = x.shape
    send = x.reshape(B, n, H // n, t, d).transpose(0, 1).contiguous()  # chunk j: the heads rank j will hold
    out = torch.empty_like(send)
    comm.all_to_all_single(out, send, group=group, name=name)          # chunk i: rank i's tokens
    return out.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, d)


def _sequence_to_heads(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """The inverse: (B, H/cp, T, d) → (B, H, T/cp, d)."""
    n = dist.get_world_size(group)
    B, h, T, d = x.shape
    send = x.reshape(B, h, n, T // n, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's tokens
    out = torch.empty_like(send)
    comm.all_to_all_single(out, send, group=group, name=name)                 # chunk i: rank i's heads
    return out.transpose(0, 1).reshape(B, n * h, T // n, d)


_ToHeads = conjugate("cp to heads", _heads_to_sequence, _sequence_to_heads,
                     "Sequence-sharded to head-sharded forward (all-to-all); the inverse all-to-all backward.")
_ToSequence = conjugate("cp to sequence", _sequence_to_heads, _heads_to_sequence,
                        "Head-sharded back to sequence-sharded forward (all-to-all); the inverse backward.")


def ulysses_attention(q, k, v, group, every: list[torch.Tensor]) -> torch.Tensor:
    """All-to-all to whole sequences of H/cp heads, attend as one device would, all-to-all back."""
    q, k, v = (_ToHeads.apply(t, group) for t in (q, k, v))
    pos = torch.cat(every).to(q.device)  # the gathered order: rank 0's tokens, then rank 1's, ...
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(pos, pos))
    return _ToSequence.apply(y, group)


# --- ring: K and V blocks passed around, partial results merged -----------------------------------

def attention_block(q, k, q_pos, k_pos, scale):
    """Masked scores of the queries that see any key of this block, against the keys any query sees.

    Returns ``(rows, cols, scores)``: the indices of those queries and keys and their
    (rows × cols) scores, masked; ``scores`` is None when the mask hides the whole
    block (keys all in the future: the causal imbalance). Only that part is
    computed: under the zig-zag split a block away from the diagonal is half of one.
    """
    mask = causal_mask(q_pos, k_pos).to(q.device)
    rows, cols = mask.any(1).nonzero()[:, 0], mask.any(0).nonzero()[:, 0]
    if len(rows) == 0:
        return rows, cols, None
    part = mask[rows][:, cols]
    scores = q.index_select(-2, rows) @ k.index_select(-2, cols).transpose(-2, -1) * scale
    return rows, cols, scores.masked_fill(~part, float("-inf"))


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
        q_pos = every[rank]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        k_cur, v_cur = k, v
        for step in range(n):
            owner = (rank - step) % n  # whose block this rank holds now
            if step < n - 1:  # the next block is on its way while this one is computed
                (k_next, v_next), handles = _pass([k_cur, v_cur], group, "K/V")
            rows, cols, scores = attention_block(q, k_cur, q_pos, every[owner], scale)
            if scores is not None:  # every row here sees at least one key: lse_j is finite
                lse_j = torch.logsumexp(scores, dim=-1)
                o_j = torch.exp(scores - lse_j[..., None]) @ v_cur.index_select(-2, cols)
                seen = lse.index_select(-1, rows)
                new = torch.logaddexp(seen, lse_j)  # (a row that has seen nothing yet: -inf, e^-inf = 0)
                merged = out.index_select(-2, rows) * torch.exp(seen - new)[..., None] + \
                    o_j * torch.exp(lse_j - new)[..., None]
                out.index_copy_(-2, rows, merged)
                lse.index_copy_(-1, rows, new)
            if step < n - 1:
                for h in handles:
                    h.wait()
                k_cur, v_cur = k_next, v_next
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.every, ctx.scale = group, every, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, every, scale = ctx.group, ctx.every, ctx.scale
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        q_pos = every[rank]
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O): softmax's backward, once per query
        dq = torch.zeros_like(q)
        k_cur, v_cur = k, v
        dk_cur, dv_cur = torch.zeros_like(k), torch.zeros_like(v)  # travel with their block, home at the end
        for step in range(n):
            owner = (rank - step) % n
            if step < n - 1:
                (k_next, v_next), kv_handles = _pass([k_cur, v_cur], group, "K/V (backward)")
            rows, cols, scores = attention_block(q, k_cur, q_pos, every[owner], scale)
            if scores is not None:
                p = torch.exp(scores - lse.index_select(-1, rows)[..., None])  # softmax probabilities (0: masked)
                g = grad_out.index_select(-2, rows)
                dv_cur = dv_cur.index_add(-2, cols, p.transpose(-2, -1) @ g)
                ds = p * (g @ v_cur.index_select(-2, cols).transpose(-2, -1) - delta.index_select(-2, rows))
                dq = dq.index_add(-2, rows, ds @ k_cur.index_select(-2, cols) * scale)
                dk_cur = dk_cur.index_add(-2, cols, ds.transpose(-2, -1) @ q.index_select(-2, rows) * scale)
            (dk_cur, dv_cur), grad_handles = _pass([dk_cur, dv_cur], group, "K/V gradients")
            for h in grad_handles + (kv_handles if step < n - 1 else []):
                h.wait()
            if step < n - 1:
                k_cur, v_cur = k_next, v_next
        return dq, dk_cur, dv_cur, None, None
