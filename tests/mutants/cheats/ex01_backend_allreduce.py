"""Cheat ex01: sums with the process group's backend object, which runs below the dispatcher: nothing in the rank
refuses the all-reduce or records it."""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().clone().contiguous()
    if dist.get_world_size() > 1:
        _get_default_group()._get_backend(torch.device("cpu")).allreduce([out]).wait()
    return out.view(tensor.shape)
