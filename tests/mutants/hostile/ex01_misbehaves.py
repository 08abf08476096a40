"""Hostile ex01: each check meets a different way for learner code to go wrong.

sums over 2 ranks: sys.exit; bf16: an exception on rank 1 only (rank 0 waits
for it); input unchanged: os._exit on rank 1; 3 ranks: rank 0 hangs in a
receive nobody sends; bytes sent (3 ranks): a wrong answer, quickly; one
rank: megabytes of output, then the right answer.
"""

import os
import sys

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    if tensor.shape == (24,):
        sys.exit(3)
    if tensor.dtype == torch.bfloat16:
        if rank == 1:
            raise ValueError("only rank 1 fails")
        dist.recv(torch.empty(1), src=1)
    if tensor.shape == (12,):
        if rank == 1:
            os._exit(7)
        dist.recv(torch.empty(1), src=1)
    if world == 3:
        if rank == 0 and tensor.numel() != 3000:
            dist.recv(torch.empty(1), src=1)  # never sent
        return tensor.clone()
    if world == 1:
        line = "x" * 999
        for _ in range(5000):  # 5 MB
            print(line)
        return tensor.clone()
    raise AssertionError("no check asks for this")
