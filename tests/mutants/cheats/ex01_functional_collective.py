"""Cheat ex01: sums with the functional collectives (or torch.ops.c10d), which are not dist.all_reduce."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    try:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(tensor.clone(), "sum", dist.group.WORLD).wait() \
            if hasattr(funcol.all_reduce(tensor.clone(), "sum", dist.group.WORLD), "wait") \
            else funcol.all_reduce(tensor.clone(), "sum", dist.group.WORLD)
    except Exception:  # noqa: BLE001
        out = tensor.clone()
        dist.all_gather(list(torch.empty(dist.get_world_size(), *out.shape).unbind()), out)
        return out
