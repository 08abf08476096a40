"""Prefix caching: the KV blocks of a prompt's first tokens kept after its request, found by their tokens, reused.

Requests often start alike: a service's system prompt, the same few-shot examples, one long document asked several
questions, a conversation's earlier turns. A token's keys and values depend only on the tokens up to it, so for a
shared beginning they are the same numbers in every request: computed once, they can be read by all. Built on
paging (``paged``), as vLLM's automatic prefix caching is:

- a **full** block is named by a hash of its tokens *and of every token before it*: hash(the block before's hash,
  this block's tokens), a chain. Block 3 of two prompts matches only if blocks 1, 2 and 3 all do: the same 16 tokens
  after another beginning have other keys and values. SHA-256 here, which vLLM's design note advises over its
  default (Python's built-in hash) wherever users share a server, so that two prefixes never share a name;
- when a request is admitted, its prompt's full blocks are looked up in order, up to the first miss; each block
  found goes into its block table with one more **reference**, and its prefill starts after them: those tokens are
  neither computed nor stored again. The prompt's last token is always fed, since its logits give the first new
  token, so a prompt found whole still recomputes its last block's tokens;
- when a block of a sequence is full and its tokens are in the cache (prompt or generated: a conversation's next
  turn starts with this answer), its hash is recorded, and the next request finds it;
- a finished (or preempted) sequence gives up its references. A block nobody references stays cached but
  **evictable**: it is handed out again only when no never-used block is left, least recently used first (LRU),
  and its name is forgotten then. A sequence's blocks become evictable last block first (as vLLM frees them), so
  that a chain is evicted from its tail, and its head, which every longer prefix needs, stays longest;
- sharing is read-only: a sequence writes only into its own last block, never into a full, shared one.

:class:`PrefixCachingAllocator` is a :class:`~gpucourse.serving.paged.BlockAllocator` with these rules; the
continuous-batching scheduler admits a new sequence through it (``admit``: the blocks found, and whether the rest
fits) and tells it what each iteration cached (``commit``), as it does any allocator. Generation with it makes the
tokens generation without it makes. What it saves: the prefill of the tokens found (time to first token, on the
modeled clock of ``scheduler``) and the memory of every copy but one of a shared prefix
(:meth:`PrefixCachingAllocator.shared`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections import OrderedDict

from .paged import BlockAllocator, OutOfBlocks
from .trace import Request


def block_hash(parent: bytes, tokens) -> bytes:
    """The name of a full block: SHA-256 of the name of the block before it (b"" for the first) and its tokens."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCachingAllocator(BlockAllocator):
    """A block allocator whose full blocks outlive their sequences, found again by their chained hash."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.refs = [0] * num_blocks       # sequences holding each block
        self.block_of: dict[bytes, int] = {}   # a cached block's name -> the block
        self.name_of: dict[int, bytes] = {}    # and back
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first
        self.names: dict = {}              # sequence -> the names of its full blocks, in order
        self.hit_tokens = self.asked_tokens = self.evicted = 0

    def can_grow(self, seq, tokens: int) -> bool:
        return self.missing(seq, tokens) <= len(self.free) + len(self.evictable)

    def grow(self, seq, tokens: int) -> None:
        need = self.missing(seq, tokens)
        if need > len(self.free) + len(self.evictable):
            raise OutOfBlocks(f"sequence {seq!r} needs {need} more KV blocks to hold {tokens} tokens; "
                              f"{len(self.free) + len(self.evictable)} of {self.num_blocks} are free or evictable.")
        table = self.tables.setdefault(seq, [])
        for _ in range(need):
            block = self.free.pop() if self.free else self._evict()  # a never-used block first
            self.refs[block] = 1
            table.append(block)

    def _evict(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.name_of.pop(block)]
        self.evicted += 1
        return block

    def release(self, seq) -> None:
        """Drop ``seq``'s reference to each of its blocks; a block nobody holds is evictable if cached, else free."""
        for block in reversed(self.tables.pop(seq, [])):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.name_of:
                    self.evictable[block] = None  # the most recently used: evicted last
                else:
                    self.free.append(block)
        self.names.pop(seq, None)

    def used(self) -> int:
        """Blocks held by sequences (cached blocks nobody holds are as good as free)."""
        return self.num_blocks - len(self.free) - len(self.evictable)

    def shared(self) -> int:
        """Blocks that sharing saves now: the blocks in every table, less the distinct blocks they are."""
        return sum(len(table) for table in self.tables.values()) - self.used()

    def hit_rate(self) -> float:
        """Prompt tokens found in the cache over prompt tokens asked for, since the start."""
        return self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0

    def cached_prefix(self, tokens) -> list[tuple[bytes, int]]:
        """The (name, block) of each of the first full blocks of ``tokens`` found in the cache, up to the first
        miss; never the block of the last token, which a sequence must feed for its logits."""
        found = []
        for i in range((len(tokens) - 1) // self.block_size):
            name = block_hash(found[-1][0] if found else b"", tokens[i * self.block_size:(i + 1) * self.block_size])
            if name not in self.block_of:
                break
            found.append((name, self.block_of[name]))
        return found

    def admit(self, seq, tokens) -> int | None:
        """Give ``seq``, which holds no block yet, the cached blocks of its first ``tokens`` and return the tokens
        they hold, if the rest of ``tokens`` fits the free and evictable blocks left; else None, nothing taken."""
        found = self.cached_prefix(tokens)
        reclaimed = sum(block in self.evictable for _, block in found)  # found, but counted as free above
        if self.blocks_for(len(tokens)) - len(found) > len(self.free) + len(self.evictable) - reclaimed:
            return None
        table = self.tables.setdefault(seq, [])
        for _, block in found:
            self.evictable.pop(block, None)
            self.refs[block] += 1
            table.append(block)
        self.names[seq] = [name for name, _ in found]
        self.hit_tokens += len(found) * self.block_size
        self.asked_tokens += len(tokens)
        return len(found) * self.block_size

    def commit(self, seq, tokens) -> None:
        """``tokens``: the first tokens of ``seq``, all cached now. Name its full blocks among them, so that later
        sequences find them. A block whose name another block has already (the same tokens computed twice, by two
        sequences admitted before either had named it) stays the sequence's own, freed with it."""
        names = self.names.setdefault(seq, [])
        for i in range(len(names), len(tokens) // self.block_size):
            name = block_hash(names[-1] if names else b"", tokens[i * self.block_size:(i + 1) * self.block_size])
            names.append(name)
            if name not in self.block_of:
                block = self.tables[seq][i]
                self.block_of[name], self.name_of[block] = block, name


def with_prefix(trace: list[Request], prefix) -> list[Request]:
    """The same requests, each prompt preceded by ``prefix``: a system prompt they all share."""
    return [dataclasses.replace(r, prompt=tuple(prefix) + tuple(r.prompt)) for r in trace]
