"""Exercise 14: paged KV memory — a block allocator and attention read through a block table.

Taught in notebooks/14_serving.ipynb; check your work with
``from gpucourse import check; check("ex14")`` or ``gpucourse grade ex14``.
Compare with the reference, gpucourse/serving/paged.py, once yours passes.

A server's KV cache is a pool of blocks of ``block_size`` tokens each: for every layer, keys and values of shape
(num_blocks, heads, block_size, head_dim). A sequence holds a **block table**, the ids of its blocks in token
order: the token at position p sits in block ``table[p // block_size]``, at offset ``p % block_size``. Blocks are
taken from a free list as the sequence grows and all given back when it finishes, so the only memory a sequence
wastes is the empty end of its last block.

``grow(table, free, tokens, block_size)``
    Give the sequence whose blocks are ``table`` (a list of block ids) enough blocks to hold ``tokens`` tokens:
    ceil(tokens / block_size) in all. Take each new block from the END of ``free`` (``free.pop()``) and append it to
    ``table``, changing both lists in place, and return True. If ``free`` holds too few blocks, return False and
    change neither list. A table that already holds enough blocks is left as it is (True).

``release(table, free)``
    The sequence has finished: append its blocks to ``free`` in table order and empty ``table``, in place.

``slot_of(table, position, block_size)``
    Where the token at ``position`` lives: ``(block id, offset in the block)``, a tuple of two ints.

``paged_attention(q, k_cache, v_cache, tables, lengths, block_size)``
    One decode step of B sequences. ``q`` (B, heads, head_dim): each sequence's newest query. ``k_cache``,
    ``v_cache`` (num_blocks, heads, block_size, head_dim): the pool. ``tables``: B lists of block ids;
    ``lengths``: B ints, the tokens each sequence holds (its newest included). Return (B, heads, head_dim):
    for each sequence, softmax(q · kᵀ / sqrt(head_dim)) · v over its first ``lengths[b]`` tokens, read through its
    table — the slots after them in its last block hold nothing of it, and a table may hold more blocks than its
    tokens need (a server grows it ahead). The caches may be in another dtype than q. The contract every caller
    relies on: leave every input as it was (the tables and lengths too), return q's dtype, and accept caches with
    any strides (a view of a larger pool).
"""


def grow(table: list, free: list, tokens: int, block_size: int) -> bool:
    """Blocks from the end of ``free`` onto ``table`` until it holds ``tokens`` tokens; False (nothing changed) if
    too few are free."""
    raise NotImplementedError("grow")


def release(table: list, free: list) -> None:
    """Every block of ``table`` back onto ``free`` (in table order); ``table`` emptied."""
    raise NotImplementedError("release")


def slot_of(table: list, position: int, block_size: int) -> tuple:
    """(block id, offset) of the token at ``position``."""
    raise NotImplementedError("slot_of")


def paged_attention(q, k_cache, v_cache, tables, lengths, block_size):
    """Each sequence's query over its ``lengths[b]`` keys and values, read through its block table."""
    raise NotImplementedError("paged_attention")
