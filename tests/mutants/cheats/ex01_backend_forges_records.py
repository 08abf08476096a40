"""Cheat ex01: sums with the backend's all-reduce (unseen by the dispatcher), then writes into the grader's
recorder the sends and receives an honest ring would have made, so that the records tell a ring's story."""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().clone().contiguous()
    n, rank = dist.get_world_size(), dist.get_rank()
    if n > 1:
        _get_default_group()._get_backend(torch.device("cpu")).allreduce([out]).wait()
        chunks = out.reshape(-1).tensor_split(n)
        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "records"):
                for step in range(2 * (n - 1)):
                    sent, got = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
                    mode.records.append({"op": "send", "bytes": sent.numel() * sent.element_size(),
                                         "group": list(range(n)), "async": True, "t": 0.0, "peer": (rank + 1) % n})
                    mode.records.append({"op": "recv", "bytes": got.numel() * got.element_size(),
                                         "group": list(range(n)), "async": False, "t": 0.0, "peer": (rank - 1) % n})
    return out.view(tensor.shape)
