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

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..data import context_positions
from ..model import blocks_of
from ..readable import ConfigError
from .context_parallel_ring import RingAttention, causal_mask
from .sequence_parallel import GatherSequence, conjugate

def apply_context_parallel(module: torch.nn.Module, cp_group, seq_len: int, algo: str = "ring",
                           zigzag: bool = False) -> torch.nn.Module:
    """Make ``module`` (a GPT or a pipeline stage) work on this rank's tokens; return it.

    Its position embedding looks up this rank's true positions, and each block's
    attention attends over every rank's keys with ``algo``.
    """
    every = embed_at_positions(module, cp_group, seq_len, zigzag)
    attend = ATTENTIONS[algo].attend
    for block in blocks_of(module):
        block.attn.attend = lambda q, k, v: attend(q, k, v, cp_group, every)
    return module


def embed_at_positions(module: torch.nn.Module, cp_group, seq_len: int, zigzag: bool) -> list[torch.Tensor]:
    """Embed this rank's tokens at their true positions; return every cp rank's positions."""
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    every = [context_positions(seq_len, r, cp, zigzag) for r in range(cp)]
    mine = every[rank]
    if hasattr(module, "wpe"):  # the first stage embeds: at this rank's positions, not 0..T/cp-1
        module.wpe.register_forward_pre_hook(lambda m, args: (mine.to(args[0].device),))
    return every


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


# --- the algorithms, one record each ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Attention:
    """One way context-parallel attention meets the other ranks' keys, and what the rest of the package needs to
    know about it: ``attend(q, k, v, cp_group, every_position)``; ``kept(b, t, T, width)``, the bytes it keeps for
    backward beyond one device's attention (fp32; t tokens a rank holds of T, width C/tp) for ``gpucourse
    memory``; ``whole_heads``, whether it hands each rank whole heads (cp must divide the heads a tensor-parallel
    rank holds); the names other tools give it: Megatron-LM's ``--cp-comm-type``, PyTorch's context-parallel
    rotate method (None: PyTorch has none), whether DeepSpeed runs it. A new algorithm is its function and one
    record here."""

    name: str
    attend: Callable
    kept: Callable[[int, int, int, float], float]
    whole_heads: bool
    megatron: str
    torch_rotate: str | None
    deepspeed: bool
    summary: str


ATTENTIONS = {a.name: a for a in (
    # Nothing more kept: its blocks are recomputed in backward from the saved log-sum-exp.
    Attention("ring", RingAttention.apply, lambda b, t, T, width: 0.0, False, "p2p", "alltoall", False,
              "K and V blocks passed round the ranks, partial results merged"),
    # The whole sequence's K and V in place of the rank's own, and the mask as floats.
    Attention("allgather", allgather_attention, lambda b, t, T, width: 2 * 4 * b * (T - t) * width + 4 * t * T,
              False, "all_gather", "allgather", False, "the whole K and V gathered once a layer"),
    # The mask over the whole sequence as floats. (A ulysses run measures one more (b, t, C) tensor per block
    # than this finds, about 1.4 % of the tiny model's activations.)
    Attention("ulysses", ulysses_attention, lambda b, t, T, width: 4 * T * T, True, "a2a", None, True,
              "all-to-all from sequence shards to head shards and back"),
)}
ALGORITHMS = tuple(ATTENTIONS)


# --- how the engine applies it ---------------------------------------------------------------------------------------

def apply(model, mesh, cfg, built):
    """Each rank works on its tokens of every sequence and attends over the other cp ranks' keys with
    ``cfg.cp_algo``, on the cp slice of ``mesh`` (impl "torch": ``context_parallel_torch.apply``)."""
    if cfg.cp == 1 or cfg.impl == "torch":
        return model
    return apply_context_parallel(model, mesh["cp"].get_group(), cfg.seq_len, cfg.cp_algo, cfg.zigzag)


# --- its rules -----------------------------------------------------------------------------------------------------

def check(cfg, mc, runnable: bool = True) -> None:
    """What context parallelism refuses, one sentence each (:meth:`gpucourse.TrainConfig.validate` asks)."""
    if cfg.cp == 1 and not cfg.zigzag:
        return
    if cfg.cp_algo not in ALGORITHMS:
        raise ConfigError(f"cp_algo={cfg.cp_algo!r} is not one of {', '.join(ALGORITHMS)}.")
    if cfg.cp == 1:
        raise ConfigError("zigzag orders the tokens of context-parallel ranks; it needs cp > 1.")
    chunks = 2 * cfg.cp if cfg.zigzag else cfg.cp
    if cfg.seq_len % chunks:
        split = f"2 × cp = {chunks} zig-zag chunks" if cfg.zigzag else f"cp = {chunks} chunks"
        raise ConfigError(f"seq_len={cfg.seq_len} must divide into {split} of equal length.")
    heads = mc.n_head // cfg.tp
    if ATTENTIONS[cfg.cp_algo].whole_heads and heads % cfg.cp:
        raise ConfigError(f"{cfg.cp_algo} gives each of cp={cfg.cp} ranks whole heads: cp must divide the "
                          f"{heads} heads each tensor-parallel rank holds (n_head={mc.n_head}, tp={cfg.tp}).")
    if cfg.dropout:
        raise ConfigError(f"dropout={cfg.dropout} inside context-parallel attention is not written: "
                          f"use dropout=0 with cp > 1.")
    if cfg.attention != "flash":
        raise ConfigError(f"attention={cfg.attention!r} is one device's kernel; with cp > 1 attention is "
                          f"context parallelism's own ({cfg.cp_algo}): leave attention='flash'.")
    if cfg.recompute == "selective":
        raise ConfigError("selective recomputation with cp > 1 is not written: recomputing context-parallel "
                          "attention would run its communication again in backward; use 'full' or none.")
    if cfg.impl not in ("scratch", "torch"):  # (PyTorch's own refuses more: context_parallel_torch.check)
        raise ConfigError(f"context parallelism runs with impl='scratch' or 'torch', not impl={cfg.impl!r}.")
