"""Mutant of ex04_zero1: hands the work to torch.distributed.optim.ZeroRedundancyOptimizer."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer


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
        self.optimizer = ZeroRedundancyOptimizer(self.params, optimizer_class=torch.optim.Adam, lr=lr)

    def step(self) -> None:
        """Update this rank's shard with Adam, then all-gather so that every rank holds every updated weight."""
        self.optimizer.step()
