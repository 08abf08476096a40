"""Mutant of ex04_zero1: every rank keeps an Adam for every shard and steps them all (no all-gather), so each
rank holds the optimizer state of all the parameters."""

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
        self.params = list(params)
        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.shard = -(-self.numel // self.world)
        self.bounds = [shard_bounds(self.numel, self.world, r) for r in range(self.world)]
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        # One Adam per shard: every rank can update every shard itself, and no all-gather is needed.
        self.locals = [nn.Parameter(flat[s:e].clone()) for s, e in self.bounds]
        self.optimizers = [torch.optim.Adam([local], lr=lr) for local in self.locals]
        self.optimizer = self.optimizers[rank]

    def step(self) -> None:
        """Update this rank's shard with Adam, then all-gather so that every rank holds every updated weight."""
        flat_grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        for (s, e), local, optimizer in zip(self.bounds, self.locals, self.optimizers):
            local.grad = flat_grad[s:e].clone()
            optimizer.step()
        flat = torch.cat([local.detach() for local in self.locals])
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
