"""Wrong answer for ex03: each bucket's buffer is made with torch.zeros(n), without dtype=: float32. Right for
a float32 model; a float64 model's gradients come back rounded to float32."""

import torch
import torch.distributed as dist
import torch.nn as nn


def assign_buckets(model: nn.Module, cap_bytes: int) -> list[list[str]]:
    """Names of the trainable parameters, in gradient-ready order, in buckets of at most ``cap_bytes``."""
    buckets: list[list[str]] = []
    size = 0
    # Backward runs the layers last to first, so gradients arrive in reverse definition order.
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


class BucketedGradientSync:
    """Averages a model's gradients over all ranks, one asynchronous all-reduce per bucket, during backward."""

    def __init__(self, model: nn.Module, cap_bytes: int):
        self.world = dist.get_world_size()
        self.buckets = assign_buckets(model, cap_bytes)
        by_name = dict(model.named_parameters())
        self._params = [[by_name[n] for n in names] for names in self.buckets]
        self._buffers = [torch.zeros(sum(p.numel() for p in ps)) for ps in self._params]
        self._where = {}  # parameter -> (its bucket, its offset in the bucket's buffer)
        for b, ps in enumerate(self._params):
            offset = 0
            for p in ps:
                self._where[p] = (b, offset)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._ready = [0] * len(self.buckets)
        self._pending = [None] * len(self.buckets)

    def _grad_ready(self, p: torch.Tensor) -> None:
        # Autograd calls this as soon as p.grad holds this backward's gradient.
        b, offset = self._where[p]
        self._buffers[b][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self._ready[b] += 1
        if self._ready[b] == len(self._params[b]):
            self._pending[b] = dist.all_reduce(self._buffers[b], async_op=True)

    def finish(self) -> None:
        """Wait for every bucket, and put the averaged gradients into ``p.grad``; ready for the next backward."""
        for b, ps in enumerate(self._params):
            self._pending[b].wait()
            self._buffers[b] /= self.world
            for p in ps:
                offset = self._where[p][1]
                p.grad.copy_(self._buffers[b][offset:offset + p.numel()].view_as(p))
            self._ready[b], self._pending[b] = 0, None
