"""Exercise 14, a wrong answer: blocks given back in reverse table order.

Taught in notebooks/14_serving.ipynb. The package's own allocator and paged cache are in
gpucourse/serving/paged.py.
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
    free.extend(reversed(table))
    table.clear()


def slot_of(table: list, position: int, block_size: int) -> tuple:
    return table[position // block_size], position % block_size


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
