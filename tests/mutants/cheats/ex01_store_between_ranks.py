"""Cheat ex01: no collective at all: each rank puts its tensor in the rendezvous store (the key-value service that
brought the ranks together) and reads the others' back, then adds them up."""

import pickle
import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    rank, n = dist.get_rank(), dist.get_world_size()
    key = f"cheat/{tensor.numel()}/{tensor.dtype}"
    store.set(f"{key}/{rank}", pickle.dumps(tensor.detach().clone()))
    total = torch.zeros_like(tensor)
    for r in range(n):
        total += pickle.loads(store.get(f"{key}/{r}"))
    return total
