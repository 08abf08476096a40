"""Exercise 14, a wrong answer: paged_attention turns each block table into a tensor in the caller's own list.

Contracts on some arguments only: the checks held q and the caches to 'inputs unchanged' but not the tables and
lengths a server passes, and this answer's values are right. The server's next grow() then appends to a tensor.
It scored 10/10 under the checks before the tables and lengths were held to the contract (seeds 1 to 5), and
fails the contract check now.
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
    return table[position // block_size], position % block_size


def paged_attention(q, k_cache, v_cache, tables, lengths, block_size):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)  # half precision adds up in fp32, float64 stays float64
    for b, length in enumerate(lengths):
        tables[b] = torch.as_tensor(tables[b], dtype=torch.long, device=q.device)  # index the caches with it
        blocks = tables[b][:-(-length // block_size)]
        # (blocks, heads, block_size, d) -> (heads, blocks · block_size, d): column j is position j
        keys = k_cache[blocks].transpose(0, 1).reshape(q.shape[1], -1, q.shape[2])[:, :length]
        values = v_cache[blocks].transpose(0, 1).reshape(q.shape[1], -1, q.shape[2])[:, :length]
        scores = torch.einsum("hd,htd->ht", q[b].to(acc), keys.to(acc)) * scale
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), values.to(acc)).to(q.dtype)
    return out
