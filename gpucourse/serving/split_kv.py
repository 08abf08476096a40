"""Split-KV decode attention (Flash-Decoding): one query over a long cache, the cache cut into chunks done at once.

A decode step attends one new query per sequence and head over everything the sequence has cached. FlashAttention
gives each (sequence, head) — each block of 128 queries of it — one thread block, and a thread block runs on one SM.
At a decode step the query block is one token, and FlashAttention packs the query heads that share a K/V head into
it, so there is one thread block per sequence and K/V head: at batch 1, Llama 3 8B's 8 thread blocks on a GPU of
132 SMs. Each reads its head's whole cache alone while the other SMs idle, and the step waits for the slowest.

**The split** (Flash-Decoding, Dao, Haziza, Massa and Sizov, 2023). Cut each sequence's keys and values into
chunks, attend the query to every chunk at once — more thread blocks than SMs again — and keep, per chunk, its
partial output and the log-sum-exp of its scores. A second, small step combines the chunks. It is exact: with
scores s_j = q·k_j / √d, chunk c gives

    o_c = Σ_{j∈c} e^{s_j} v_j / Σ_{j∈c} e^{s_j}     and     lse_c = log Σ_{j∈c} e^{s_j},

and softmax over all the keys is Σ_c e^{lse_c} o_c / Σ_c e^{lse_c} = Σ_c w_c o_c with w_c = e^{lse_c − lse},
lse = log Σ_c e^{lse_c} (computed from the largest lse_c, as a softmax subtracts its maximum). The same merge
runs inside FlashAttention (its online softmax, block after block) and across GPUs in ring attention
(``parallel/context_parallel_ring``), whose :func:`written_out` gives each chunk's (o_c, lse_c) here.

**How many chunks** (:func:`num_splits`, FlashAttention 2's own choice in ``flash_api.cpp``): none when the thread
blocks already fill most of the GPU (80 % of two per SM); else the fewest splits whose waves of thread blocks are at
least 85 % as full as the best count's, at most 128 and never more than the cache's blocks of keys (128 keys each
for head_dim 128). More chunks than needed only write and re-read more partial outputs.

:func:`split_kv_attention` is the computation; :class:`SplitKVCache` is a KV cache whose decode steps attend
through it, so the course's model generates with it. What the split is worth on a GPU — the work per SM with and
without it, at batch 1 and long contexts — is ``serve_plan.split_kv_decode``, on the serving cost model.
"""

from __future__ import annotations

import math

import torch

from ..parallel.context_parallel_ring import written_out
from .kv_cache import KVCache, LayerCache


def combine(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The softmax over every chunk's keys, from each chunk's output (..., q, d) and log-sum-exp (..., q)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(torch.exp(part - lse)[..., None] * out for out, part in zip(outs, lses))


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int) -> torch.Tensor:
    """Attention of queries (B, H, T, d) over every key and value (B, H, S, d), the keys cut into ``splits``
    chunks of ⌈S / splits⌉ (the last one shorter; fewer chunks when ``splits`` does not divide S evenly enough);
    each chunk attended alone, then combined. Every query sees every key: a decode step's one query, whose cache
    holds exactly the tokens up to its position."""
    if splits < 1:
        raise ValueError(f"splits={splits}: the keys are cut into at least one chunk.")
    size = math.ceil(k.shape[-2] / splits)
    scale = q.shape[-1] ** -0.5
    parts = [written_out(q, k_c, v_c, None, scale) for k_c, v_c in zip(k.split(size, -2), v.split(size, -2))]
    return combine([o for o, _ in parts], [lse for _, lse in parts])


def num_splits(blocks: int, slots: int, key_blocks: int, max_splits: int = 128) -> int:
    """How many chunks FlashAttention 2 cuts the keys into: ``blocks`` thread blocks without a split (sequences ×
    K/V heads at decode), ``slots`` thread blocks the GPU runs at once (two per SM), ``key_blocks`` blocks of keys
    in a sequence. The smallest count whose waves are at least 85 % as full as the best count's."""
    if blocks >= 0.8 * slots:
        return 1
    limit = min(max_splits, slots, key_blocks)

    def fullness(n):
        waves = blocks * n / slots
        return waves / math.ceil(waves)

    # A count that leaves as many keys in each chunk as one fewer chunks does is that count (64 blocks of keys in
    # 11 or 12 chunks are 6 a chunk either way): not a choice of its own.
    counts = [n for n in range(1, limit + 1) if n == 1 or -(-key_blocks // n) != -(-key_blocks // (n - 1))]
    best = max(fullness(n) for n in counts)
    return next(n for n in counts if fullness(n) >= 0.85 * best)


class SplitKVCache(KVCache):
    """A contiguous KV cache whose decode steps (one new token a row) attend with :func:`split_kv_attention`, each
    row's cache up to its own position cut into ``splits`` chunks; a prompt's prefill attends as usual."""

    def __init__(self, cfg, batch: int, max_len: int, splits: int, **kwargs):
        super().__init__(cfg, batch, max_len, **kwargs)
        self.splits = splits

    def layer(self, i: int) -> LayerCache:
        return SplitKVLayer(self, i)


class SplitKVLayer(LayerCache):
    """One block's view of a :class:`SplitKVCache`."""

    def attend(self, q, k, v):
        if q.shape[-2] > 1:
            return super().attend(q, k, v)
        self.cache.write(self.index, k, v)
        keys, values = self.cache.read(self.index)
        # Each row over its own tokens: rows of a batch hold different lengths (a GPU kernel reads each
        # sequence's length and splits that).
        return torch.cat([split_kv_attention(q[b:b + 1], keys[b:b + 1, :, :end + 1], values[b:b + 1, :, :end + 1],
                                             self.cache.splits)
                          for b, end in enumerate(self.cache.positions[:, 0].tolist())])
