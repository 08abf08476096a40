"""Cheat ex01: sums with the process group's own allreduce method, not dist.all_reduce."""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    _get_default_group().allreduce([out]).wait()
    return out
