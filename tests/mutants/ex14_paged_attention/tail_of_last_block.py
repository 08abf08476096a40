"""Exercise 14, a wrong answer: the tokens are counted from the table's last block, taken to be the sequence's.

Inputs the cases never took: every table the checks made held exactly the blocks its length needs, where cutting
the last block's empty tail (``length % block_size`` tokens kept in it) leaves the sequence's tokens. A server grows
a table ahead of its tokens; then whole blocks that hold nothing of the sequence enter the softmax. It scored 10/10
under the checks before the drawn tables (seeds 1 to 5), and fails the values check now.
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
    for b, (table, length) in enumerate(zip(tables, lengths)):
        blocks = torch.tensor(table, dtype=torch.long, device=q.device)
        # (blocks, heads, block_size, d) -> (heads, blocks · block_size, d), less the last block's empty tail
        keep = len(table) * block_size - block_size + (length % block_size or block_size)
        keys = k_cache[blocks].transpose(0, 1).reshape(q.shape[1], -1, q.shape[2])[:, :keep]
        values = v_cache[blocks].transpose(0, 1).reshape(q.shape[1], -1, q.shape[2])[:, :keep]
        scores = torch.einsum("hd,htd->ht", q[b].to(acc), keys.to(acc)) * scale
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), values.to(acc)).to(q.dtype)
    return out
