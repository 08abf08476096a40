"""Paged KV memory: the cache cut into fixed blocks of tokens, found through a block table per sequence.

A server does not know how long an answer will be. A contiguous cache (``kv_cache.KVCache``) must reserve
each sequence's longest possible length — prompt plus ``max_new_tokens`` — up front, and most of it stays
empty: an answer that stops after 50 of 512 allowed tokens leaves 462 reserved slots unused, and other
requests cannot use them either. Paging (vLLM's PagedAttention, Kwon et al. 2023) borrows the operating
system's answer to the same problem:

- the cache is a pool of ``num_blocks`` blocks of ``block_size`` tokens each (per layer: keys and values of
  shape (num_blocks, heads, block_size, head_dim));
- a sequence holds a **block table**, the list of its blocks in order: token p sits in block
  ``table[p // block_size]`` at slot ``p % block_size``. Its blocks need not be adjacent or in order;
- a block is taken from the free list when a sequence's last block is full, and every block goes back when
  the sequence finishes. The only memory wasted is the unused slots of each sequence's last block: fewer
  than ``block_size`` tokens per sequence (under 4 % in vLLM's measurements, against 60-80 % in systems that
  reserved the maximum length; on the bench's trace, ``gpucourse bench --only paged_kv_waste``, 3 % of the
  slots paging allocates stay empty, against 43 % had each running sequence reserved its maximum);
- when the free list is empty the allocator says so (:class:`OutOfBlocks`) and the scheduler decides
  what to do (``scheduler``: preempt a sequence).

Attention reads a sequence's keys through its table: here the blocks are gathered into one row and
attended with a mask (``kv_cache.attend_positions``); vLLM's kernel reads them in place, block by block.
"""

from __future__ import annotations

import torch

from .kv_cache import Cache


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than were asked for."""


class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens, a free list, and a block table per sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one token, not {num_blocks} blocks "
                             f"of {block_size}.")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks))[::-1]  # pop() hands out block 0 first
        self.tables: dict = {}                      # sequence -> its blocks, in token order

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens (the last one possibly part full)."""
        return -(-tokens // self.block_size)

    def missing(self, seq, tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``tokens`` tokens."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq, ())))

    def can_grow(self, seq, tokens: int) -> bool:
        """Whether enough blocks are free for ``seq`` to hold ``tokens`` tokens."""
        return self.missing(seq, tokens) <= len(self.free)

    def grow(self, seq, tokens: int) -> None:
        """Give ``seq`` the blocks it needs to hold ``tokens`` tokens; :class:`OutOfBlocks` if too few are free."""
        need = self.missing(seq, tokens)
        if need > len(self.free):
            raise OutOfBlocks(f"sequence {seq!r} needs {need} more KV blocks to hold {tokens} tokens; "
                              f"{len(self.free)} of {self.num_blocks} are free.")
        self.tables.setdefault(seq, []).extend(self.free.pop() for _ in range(need))

    def release(self, seq) -> None:
        """Give all of ``seq``'s blocks back to the end of the free list, in table order (exercise 14's
        ``release``)."""
        self.free.extend(self.tables.pop(seq, []))

    def used(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - len(self.free)

    def admit(self, seq, tokens) -> int | None:
        """Whether a new sequence's ``tokens`` fit the free blocks: the tokens of them already in memory, which it
        need not compute (none here: a block is freed with its sequence; ``prefix_cache`` keeps them), or None."""
        return 0 if self.can_grow(seq, len(tokens)) else None

    def commit(self, seq, tokens) -> None:
        """Hear that ``seq``'s first ``tokens`` are in the cache now: nothing to do here (``prefix_cache`` names
        their full blocks, for later sequences to find)."""


class PagedKVCache(Cache):
    """Keys and values in the blocks of a :class:`BlockAllocator`, read through each sequence's block table."""

    def __init__(self, cfg, blocks: BlockAllocator, heads: int | None = None, dtype=torch.float32, device=None):
        shape = (cfg.n_layer, blocks.num_blocks, heads or cfg.n_head, blocks.block_size, cfg.head_dim)
        # Zeros, not empty: a masked key still multiplies its value by a weight of 0, and 0 · NaN is NaN.
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        self.blocks = blocks

    def feed_chunks(self, model, chunks: list[tuple[object, int, list[int]]]) -> torch.Tensor:
        """Feed each (sequence, tokens it has cached, new tokens) chunk; logits (chunks, vocab) at each chunk's
        last new token. The sequences' tables grow to hold their new tokens."""
        device = self.k.device
        counts = torch.tensor([len(new) for _, _, new in chunks], device=device)
        starts = torch.tensor([start for _, start, _ in chunks], device=device)
        idx = torch.zeros(len(chunks), int(counts.max()), dtype=torch.long, device=device)
        for row, (seq, start, new) in enumerate(chunks):
            self.blocks.grow(seq, start + len(new))
            idx[row, :len(new)] = torch.tensor(new)
        widest = max(len(self.blocks.tables[seq]) for seq, _, _ in chunks)
        # Rows with fewer blocks repeat block 0: those columns lie past the row's positions, and are masked.
        self.table = torch.tensor([self.blocks.tables[seq] + [0] * (widest - len(self.blocks.tables[seq]))
                                   for seq, _, _ in chunks], device=device)
        return self.feed(model, idx, starts, counts)

    def write(self, layer, k, v):
        row, t = self.valid.nonzero(as_tuple=True)
        at = self.positions[row, t]
        block, slot = self.table[row, at // self.blocks.block_size], at % self.blocks.block_size
        self.k[layer][block, :, slot] = k[row, :, t]
        self.v[layer][block, :, slot] = v[row, :, t]

    def read(self, layer):
        # (B, blocks, heads, block_size, d) -> (B, heads, blocks · block_size, d): column j holds position j.
        def gather(store):
            B, n = self.table.shape
            rows = store[self.table]
            return rows.transpose(1, 2).reshape(B, rows.shape[2], n * self.blocks.block_size, -1)
        return gather(self.k[layer]), gather(self.v[layer])

