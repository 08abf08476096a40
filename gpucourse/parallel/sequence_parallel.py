"""Sequence parallelism (Korthikanti et al., 2022): tensor parallelism's replicated activations, cut along the sequence.

Between the sub-layers, tensor parallelism leaves every rank holding the same whole activations:
the residual stream, LayerNorm's inputs and outputs, dropout's masks — computed tp times over.
Sequence parallelism cuts those along the *sequence* instead: each rank keeps T/tp tokens of them.
Two collectives change:

  entry of a sub-layer  (was f: identity, backward all-reduce)
      all-gather along the sequence; backward reduce-scatter          → the column layers see all tokens
  exit of a row layer   (was g: all-reduce, backward identity)
      reduce-scatter along the sequence; backward all-gather          → each rank keeps its tokens' sum

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes are the same as tensor
parallelism's. Where the region starts (before the first block) each rank takes its own tokens
(backward: all-gather); where it ends (after the last block) they are gathered again for the
replicated head (backward: each rank keeps its tokens' gradient). LayerNorm weights and the
row layers' biases now see only a rank's tokens, so their gradients are summed over tp.

``tensor_parallel.apply_tensor_parallel(..., sequence_parallel=True)`` puts these in; the
same gather and reduce-scatter (``gather_sequence``, ``conjugate``) serve context parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


def gather_sequence(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """(B, T/n, C) on each of n ranks → (B, T, C), the ranks' pieces in rank order along the sequence."""
    n = dist.get_world_size(group)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x.contiguous(), group=group, name=name)
    return out.view(n, *x.shape).transpose(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])


def reduce_scatter_sequence(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """(B, T, C) on each of n ranks → (B, T/n, C): this rank's tokens, summed over the ranks."""
    n, B, T = dist.get_world_size(group), x.shape[0], x.shape[1]
    pieces = x.reshape(B, n, T // n, *x.shape[2:]).transpose(0, 1).reshape(n * B, T // n, *x.shape[2:])
    out = torch.empty(pieces.shape[0] // n, *pieces.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, pieces, group=group, name=name)
    return out


def my_tokens(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """This rank's T/n tokens of a whole (B, T, C) tensor (no communication: ``name`` is unused)."""
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


def conjugate(name: str, forward, backward, doc: str):
    """An autograd Function: ``forward(x, group, label)`` forward, ``backward(grad, group, label)`` backward.

    ``Function.apply(x, group, label)``: the label names its collectives on the timeline.
    """
    def fwd(ctx, x, group, label=name):
        ctx.group, ctx.label = group, label
        return forward(x, group, f"{label} (forward)")

    def bwd(ctx, grad):
        return backward(grad, ctx.group, f"{ctx.label} (backward)"), None, None

    cls = "".join(word.capitalize() for word in name.split())  # "sp entry" → SpEntry
    return type(cls, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd),
                                                  "__doc__": doc})


# The four pairs, each forward beside its backward.
GatherSequence = conjugate("sp entry", gather_sequence, reduce_scatter_sequence,
                           "Entry of a sub-layer: all-gather along the sequence forward; reduce-scatter backward.")
ReduceScatterSequence = conjugate("sp exit", reduce_scatter_sequence, gather_sequence,
                                  "Exit of a row layer: reduce-scatter along the sequence forward; all-gather "
                                  "backward.")
SplitSequence = conjugate("sp region start", my_tokens, gather_sequence,
                          "Into the region: keep this rank's tokens; backward all-gathers their gradients.")
UnsplitSequence = conjugate("sp region end", gather_sequence, my_tokens,  # backward: every rank has the whole gradient
                            "Out of the region, into replicated layers: all-gather forward; backward keeps this "
                            "rank's tokens.")


def enter_sequence_region(group, module, args):
    """Forward pre-hook of a sub-layer: its input, T/tp tokens a rank, is all-gathered along the sequence once."""
    return (GatherSequence.apply(args[0], group), *args[1:])


def _sum_over(group, name: str):
    """A gradient hook: the parameter's gradient summed over ``group`` (each rank saw only its tokens)."""
    def hook(grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group, name=name)
        return grad
    return hook


def mark_sequence_region(blocks, tp_group) -> None:
    """The region's two ends around ``blocks``, and the gradient sums of what sees only a rank's tokens.

    The first block takes this rank's tokens, the last gathers them again; the
    LayerNorms' weights and the row layers' biases have their gradients summed over tp.
    """
    for block in blocks:
        partial = [p for m in (block.ln1, block.ln2) for p in m.parameters()] + \
                  [layer.bias for layer in (block.attn.proj, block.mlp.proj) if layer.bias is not None]
        for p in partial:
            if p.requires_grad:
                p.register_hook(_sum_over(tp_group, "sp all_reduce gradients (layernorm, row bias)"))
    if blocks:
        blocks[0].register_forward_pre_hook(lambda m, args: (SplitSequence.apply(args[0], tp_group), *args[1:]))
        blocks[-1].register_forward_hook(lambda m, args, out: UnsplitSequence.apply(out, tp_group))
