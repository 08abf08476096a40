"""Exercise 11: ring attention — the online-softmax merge, then the ring, forward and backward.

Taught in notebooks/12_sequence_context_parallel.ipynb; check your work with
``from gpucourse import check; check("ex11")`` or ``gpucourse grade ex11``.
Compare with the reference, gpucourse/parallel/context_parallel_ring.py, once yours passes.

Under context parallelism each of n ranks (all ranks of the default process
group) holds a block of every sequence: its queries ``q`` and its keys and
values ``k``, ``v``, each of shape (B, H, t, d), and ``positions[r]``, the
token positions rank r holds (a 1-D tensor of t ints; every rank gets the
same list). The blocks may be plain (rank r holds r*t … (r+1)*t - 1) or
zig-zag (two chunks far apart): work from ``positions``, never from rank
numbers. Attention is softmax(q kᵀ / √d) v over every rank's keys; with
``causal`` a query at position i sees only keys at positions ≤ i.

``merge_partials(out, lse, out_j, lse_j)``
    ``out`` is the attention of some queries over one set of keys and ``lse``
    its log-sum-exp (the log of the softmax's denominator, one per query,
    shape (..., t)); ``out_j``, ``lse_j`` the same over a second, disjoint set
    of keys. Return ``(out, lse)`` over both sets together, exactly. The
    log-sum-exps can be large (hundreds: e^lse overflows float32), and one of
    the two may be ``-inf`` on a row (that row saw no key in that set; its
    ``out`` there is 0) — never both on the same row.

``block_attention(q, k, v, q_pos, k_pos, causal)``
    The queries at positions ``q_pos`` over this one block of keys at
    ``k_pos``: ``(out_j, lse_j)``. A query the mask hides the whole block
    from gets ``out_j`` 0 and ``lse_j`` ``-inf`` on its row (not nan).

``ring_attention_forward(q, k, v, positions, causal)``
    This rank's ``(out, lse)`` over every rank's keys. K and V travel round
    the ring by point-to-point messages only (``dist.isend`` / ``dist.irecv``;
    collectives are switched off): at each of n - 1 hops every rank sends the
    block it holds to rank + 1 and receives rank - 1's, so after s hops it
    holds rank - s's block. Start the next hop before computing on the block
    you hold, so the transfer overlaps the compute.

``ring_attention_backward(q, k, v, out, lse, grad_out, positions, causal)``
    ``(dq, dk, dv)`` of this rank's block, given the forward's ``out`` and
    ``lse`` and the gradient of the loss with respect to ``out``. ``dk`` and
    ``dv`` are the gradients of this rank's own keys and values, summed over
    every rank's queries that saw them: let them travel round the ring with
    their block, and come home.

``RingAttention`` (below, given) joins the two into one op autograd can use.

The contract every function here keeps, checked on its own besides the values:

- the input tensors come back bit for bit (no in-place change, after the
  forward nor after the backward);
- every tensor returned has q's dtype (``out``'s for the merge): float32,
  float64 and bfloat16 are all tried;
- q, k, v and grad_out may be views with any strides (a caller's transpose);
- it works on one rank too (a ring with no hop), and with scores in the
  hundreds.
"""

import math

import torch
import torch.distributed as dist


def merge_partials(out, lse, out_j, lse_j):
    """Attention over two disjoint sets of keys, from each set's own (out, lse): the merged (out, lse)."""
    raise NotImplementedError("merge_partials")


def block_attention(q, k, v, q_pos, k_pos, causal):
    """The queries over this block of keys alone: (out_j, lse_j), 0 and -inf on rows that see none of it."""
    raise NotImplementedError("block_attention")


def ring_attention_forward(q, k, v, positions, causal):
    """This rank's queries over every rank's keys, K and V passed round the ring: (out, lse)."""
    raise NotImplementedError("ring_attention_forward")


def ring_attention_backward(q, k, v, out, lse, grad_out, positions, causal):
    """(dq, dk, dv): dk and dv of this rank's own block, summed over every rank's queries."""
    raise NotImplementedError("ring_attention_backward")


class RingAttention(torch.autograd.Function):
    """Ring attention as one differentiable op: ``RingAttention.apply(q, k, v, positions, causal)``."""

    @staticmethod
    def forward(ctx, q, k, v, positions, causal):
        out, lse = ring_attention_forward(q, k, v, positions, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.causal = positions, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, grad_out.contiguous(), ctx.positions, ctx.causal)
        return dq, dk, dv, None, None

