"""Exercise 14, a wrong answer: slot_of answers with a 0-d tensor for the block id, where an int is specified.

Contracts on some results only: the check compared (block, offset) with ``==``, and ``tensor(9) == 9`` is truthy;
a caller that indexes a list, or a dict of blocks, with it gets a TypeError or a miss. It scored 10/10 under the
checks before the result's types were held exactly (seeds 1 to 5), and fails 'slot_of finds a token's block and
offset' now.
"""

import math

import torch


def grow(table: list, free: list, tokens: int, block_size: int) -> bool:
    need = -(-tokens // block_size) - len(table)  # ceil(tokens / block_size) blocks in all
    if need > len(free):
        return False
    for _ in range(max(0, need)):
        table.append(free.pop())
    return True


def release(table: list, free: list) -> None:
    free.extend(table)
    table.clear()


def slot_of(table: list, position: int, block_size: int) -> tuple:
    blocks = torch.tensor(table)
    return blocks[position // block_size], position % block_size


def paged_attention(q, k_cache, v_cache, tables, lengths, block_size):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)  # half precision adds up in fp32, float64 stays float64
    for b, (table, length) in enumerate(zip(tables, lengths)):
        blocks = torch.tensor(table[:-(-length // block_size)], dtype=torch.long, device=q.device)
        # (blocks, heads, block_size, d) -> (heads, blocks · block_size, d): column j is position j
        keys = k_cache[blocks].transpose(0, 1).reshape(q.shape[1], -1, q.shape[2])[:, :length]
        values = v_cache[blocks].transpose(0, 1).reshape(q.shape[1], -1, q.shape[2])[:, :length]
        scores = torch.einsum("hd,htd->ht", q[b].to(acc), keys.to(acc)) * scale
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), values.to(acc)).to(q.dtype)
    return out
