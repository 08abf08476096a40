"""Cheat ex01: takes every dispatch mode off the stack (where a grader might watch collectives), then all-reduces."""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    while _get_current_dispatch_mode_stack():
        _pop_mode()
    out = tensor.clone()
    dist.all_reduce(out)
    return out
