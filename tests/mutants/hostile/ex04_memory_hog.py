"""Hostile ex04: shard_bounds asks for 6 GiB (the grader allows 4 GiB of address space), then answers."""

import math

import torch


def shard_bounds(numel, world_size, rank):
    torch.empty(6 << 30, dtype=torch.uint8)  # never touched: only the address-space limit can refuse it
    shard = math.ceil(numel / world_size)
    start = min(rank * shard, numel)
    return start, min(start + shard, numel)


class ZeroOneAdam:
    def __init__(self, params, lr=1e-2):
        raise NotImplementedError("ZeroOneAdam")
