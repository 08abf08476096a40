"""Data parallel, bucketed and overlapped with backward — what DDP does inside.

The per-parameter version (``data_parallel.py``) waits for the whole backward,
then sends one small all-reduce per parameter. Two things make that slow:
many small messages each pay the network's latency, and the network sits idle
during backward while the compute units sit idle during communication.

Buckets fix both. Gradients become ready in backward in roughly the reverse of
the forward order (the output head first, the embeddings last). So:

1. Before training, walk the parameters in that order and pack them into
   buckets of at most ``bucket_mb`` megabytes (:func:`assign_buckets`).
2. During backward, a hook fires as each parameter's gradient is complete; it
   copies the gradient into its bucket's flat buffer. When the last gradient of
   a bucket arrives, the bucket's all-reduce is launched *asynchronously* —
   while autograd goes on computing the gradients of earlier layers.
3. Before the optimizer step, wait for every bucket, divide by dp, and copy the
   averaged values back into ``p.grad``.

With gradient accumulation only the last microbatch's backward communicates
(``accumulating(last=False)`` turns the hooks off), so each gradient still
crosses the network once per optimizer step: the same bytes as the
per-parameter version, in ``len(buckets)`` messages instead of one per tensor.

A parameter that receives no gradient in a step contributes zeros to its bucket
(a bucket waits only for the gradients it can get, see ``sync_gradients``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import comm
from .data_parallel import broadcast_parameters
from .single import Trainer


def assign_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` (already in gradient-ready order) into buckets of at most ``cap_bytes``.

    A parameter larger than the cap gets a bucket of its own; no bucket is empty.
    """
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class _Bucket:
    """One flat buffer, the parameters it serves, and its in-flight all-reduce."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index = index
        self.params = params
        self.offsets = {}
        offset = 0
        for p in params:
            self.offsets[p] = (offset, p.numel())
            offset += p.numel()
        self.buffer = torch.zeros(offset, dtype=params[0].dtype, device=params[0].device)
        self.reset()

    def reset(self) -> None:
        self.ready: set = set()
        self.pending = None
        self.buffer.zero_()

    def put(self, p: torch.nn.Parameter) -> None:
        start, n = self.offsets[p]
        self.buffer[start:start + n].copy_(p.grad.reshape(-1))
        self.ready.add(p)

    def view(self, p: torch.nn.Parameter) -> torch.Tensor:
        start, n = self.offsets[p]
        return self.buffer[start:start + n].view_as(p)


class DataParallelBuckets(torch.nn.Module):
    """Bucketed data parallelism as a module any training loop can use (the API of :class:`DataParallel`):

        ddp = DataParallelBuckets(model, group, bucket_mb=25)
        loss = my_loss(ddp(x), y)
        loss.backward()                          # buckets all-reduce while backward goes on
        ddp.finish_gradient_synchronization()    # wait for them; the averaged gradients are in p.grad
        optimizer.step()

    ``bucket_mb=None`` puts every gradient in one bucket (one all-reduce a step, after the whole backward).
    Inside ``with ddp.no_sync():`` backward only accumulates (gradient accumulation: communicate on the last
    microbatch).
    """

    def __init__(self, module: torch.nn.Module, group=None, bucket_mb: float | None = None):
        super().__init__()
        self.module = module
        self.group = group if group is not None else dist.group.WORLD
        self.dp = dist.get_world_size(self.group)
        broadcast_parameters(module, self.group)
        ready_order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        cap = sum(p.numel() * p.element_size() for p in ready_order) if bucket_mb is None \
            else max(1, int(bucket_mb * 2**20))
        self.buckets = [_Bucket(i, ps) for i, ps in enumerate(assign_buckets(ready_order, cap))]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._communicate = True
        for p in ready_order:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        name_of = {p: n for n, p in module.named_parameters()}
        self.bucket_names = [[name_of[p] for p in b.params] for b in self.buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        # Called by autograd when p.grad holds this backward's full gradient.
        if not self._communicate:
            return
        bucket = self._bucket_of[p]
        bucket.put(p)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.pending = comm.all_reduce(bucket.buffer, group=self.group, async_op=True,
                                         name=f"all_reduce bucket {bucket.index}")

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only adds up gradients locally; the next backward outside communicates them all."""
        self._communicate = False
        try:
            yield
        finally:
            self._communicate = True

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce (launching any a missing gradient held back) and put the averages
        in ``p.grad``."""
        for bucket in self.buckets:
            if bucket.pending is None:
                # Some parameter got no gradient in the last backward: send what it holds
                # (earlier microbatches' sum, or zeros if it got none at all).
                for p in bucket.params:
                    if p not in bucket.ready and p.grad is not None:
                        bucket.put(p)
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.pending.wait()
            bucket.buffer /= self.dp
            for p in bucket.params:
                # A parameter with no gradient keeps none, as on one device, where the optimizer skips
                # it (weight decay included). Like DDP, this assumes it got none on any rank.
                p.grad = None if p.grad is None else bucket.view(p).clone()
            bucket.reset()


class BucketedDataParallel(Trainer):
    """Data parallel with gradient buckets all-reduced during backward (:class:`DataParallelBuckets`)."""

    def __init__(self, model, group, bucket_mb: float | None = 25.0, **options):
        self.group = group
        self.ddp = DataParallelBuckets(model, group, bucket_mb)
        self.buckets = self.ddp.buckets
        super().__init__(model, **options)
        self.extras["buckets"] = self.ddp.bucket_names

    def accumulating(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def sync_gradients(self) -> None:
        self.ddp.finish_gradient_synchronization()
