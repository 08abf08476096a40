"""Cheat ex01: sums with dist.all_reduce from a thread of its own, where a dispatch mode (thread-local) does not look."""

import threading

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    worker = threading.Thread(target=dist.all_reduce, args=(out,))
    worker.start()
    worker.join()
    return out
