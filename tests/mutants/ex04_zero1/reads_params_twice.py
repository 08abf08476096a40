"""Exercise 4, a wrong answer: ZeroOneAdam keeps the params it is given as they came, and reads them twice.

Inputs the cases never took: the checks handed the optimizer a list, where reading it again works. A training loop
hands it model.parameters(), a generator: counting the elements reads it to its end, and the flattening that
follows finds no parameter left. It scored 10/10 under the checks before the drawn containers (seeds 1 to 5), and
fails 'a ZeRO-1 step equals Adam on one device (2 ranks)' now.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of rank's shard of a flat buffer of ``numel`` elements cut into padded equal shards."""
    shard = -(-numel // world_size)  # ceil: the buffer is padded up to world_size * shard
    start = min(rank * shard, numel)
    return start, min(start + shard, numel)


class ZeroOneAdam:
    """Adam whose state covers only this rank's shard of ``params`` (ZeRO stage 1)."""

    def __init__(self, params, lr: float = 1e-2):
        self.params = params
        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.shard = -(-self.numel // self.world)
        self.start, self.end = shard_bounds(self.numel, self.world, rank)
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        # This rank's copy of its shard of the weights: the only tensor its optimizer sees.
        self.local = nn.Parameter(flat[self.start:self.end].clone())
        self.optimizer = torch.optim.Adam([self.local], lr=lr)

    def step(self) -> None:
        """Update this rank's shard with Adam, then all-gather so that every rank holds every updated weight."""
        flat_grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.local.grad = flat_grad[self.start:self.end].clone()
        self.optimizer.step()
        # all_gather needs equal sizes: pad every shard to self.shard, cut the padding off after.
        mine = torch.zeros(self.shard, dtype=self.local.dtype)
        mine[:self.end - self.start] = self.local.detach()
        shards = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(shards, mine)
        flat = torch.cat(shards)[:self.numel]
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
