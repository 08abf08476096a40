"""Data parallelism: every rank holds the whole model and a slice of the batch.

Each of the ``dp`` ranks runs forward and backward on its own B/dp sequences.
Their gradients differ, so before the optimizer step they are averaged:

    g = (g_0 + g_1 + ... + g_{dp-1}) / dp        one all-reduce (sum) per parameter

Because every rank's loss is a mean over an equal share of the batch, the average
of their gradients is exactly the gradient of the mean loss over the whole batch:
the same step the single device takes. Weights start equal (same seed, and a
broadcast from rank 0 to be sure) and stay equal, since every rank applies the
same averaged gradient.

Communication per step: every gradient once, ``sum(p.numel())`` × 4 bytes of
all-reduce payload per rank in fp32 — whatever ``grad_accum`` is, because
accumulation adds up gradients locally and communicates once.

``DataParallelScratch`` is that, written out. ``TorchDDP`` is the production
version, ``torch.nn.parallel.DistributedDataParallel``, which buckets gradients
and overlaps their all-reduce with the rest of backward; a comm hook times its
buckets with the same recorder (``comm.counting`` counts its bytes).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import comm
from ..model import blocks_of
from ..readable import ConfigError
from .single import Trainer


def replica_group(p: torch.nn.Parameter, group):
    """The ranks holding copies of ``p``: ``group``, or for an expert's weight under expert parallelism the
    expert-data-parallel group it carries (``expert_parallel.py``)."""
    return getattr(p, "expert_group", group)


def broadcast_parameters(model: torch.nn.Module, group) -> None:
    """Copy the weights of ``group``'s first rank to every rank of ``group`` (each expert's, of its replicas')."""
    with torch.no_grad():
        for p in model.parameters():
            replicas = replica_group(p, group)
            src = dist.get_global_rank(replicas, 0)  # broadcast names its source by global rank
            comm.broadcast(p.data, src=src, group=replicas, name="broadcast weights")


def allreduce_gradients(module: torch.nn.Module, group) -> None:
    """Average every gradient over ``group``: one all-reduce (sum, then / size) per parameter.

    An expert's weight sums over its replicas only, and is divided by the size of
    ``group`` too: its gradient already holds its ep group's share of the batch.
    """
    size = dist.get_world_size(group)
    for name, p in module.named_parameters():
        if p.grad is None:  # frozen, or unused in this step on every rank
            continue
        comm.all_reduce(p.grad, group=replica_group(p, group), name=f"all_reduce {name}")
        p.grad /= size


class DataParallel(torch.nn.Module):
    """Data parallelism as a module any training loop can use: each rank runs the wrapped module on its share of
    the batch, and one all-reduce per parameter averages the gradients.

        ddp = DataParallel(model, group)         # every rank starts from rank 0's weights
        loss = my_loss(ddp(x), y)                # forward: the module's own
        loss.backward()
        ddp.finish_gradient_synchronization()    # the gradients of the whole batch, on every rank
        optimizer.step()                         # any optimizer, any scheduler, clipping, ...

    It builds no optimizer and changes no parameter: ``parameters()`` and ``state_dict()`` are the module's
    (under ``module.``). ``group``: the data-parallel process group (default: every rank).
    """

    def __init__(self, module: torch.nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group if group is not None else dist.group.WORLD
        broadcast_parameters(module, self.group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the group; call it after backward, before the optimizer's step."""
        allreduce_gradients(self.module, self.group)


class DataParallelScratch(Trainer):
    """Data parallel from scratch: one blocking all-reduce per gradient after backward (:class:`DataParallel`)."""

    def __init__(self, model, group, **options):
        self.group = group
        self.ddp = DataParallel(model, group)
        super().__init__(model, **options)

    def sync_gradients(self) -> None:
        self.ddp.finish_gradient_synchronization()


class TorchDDP(Trainer):
    """``DistributedDataParallel``: bucketed all-reduce overlapped with backward."""

    def __init__(self, model, group, bucket_mb: float | None = None, **options):
        self.group = group
        # Under a pipeline schedule a stage runs one backward per microbatch; DDP's bucket
        # rebuild after the first step would count every one of them (an internal assert),
        # so there DDP searches the graph for each step's parameters instead of rebuilding.
        device = next(model.parameters()).device
        under_pipeline = options.get("loop") is not None
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=25 if bucket_mb is None else bucket_mb, find_unused_parameters=under_pipeline)
        super().__init__(ddp, **options)
        ddp.register_comm_hook(state=(self.rec, group), hook=_recording_allreduce_hook)

    def accumulating(self, last: bool):
        # Only the last microbatch's backward communicates; the others accumulate locally.
        return contextlib.nullcontext() if last else self.model.no_sync()

    @property
    def module(self):
        return self.model.module  # without DDP's "module." in the names


class TorchReplicate(Trainer):
    """Data parallel over DTensor (tensor-parallel) parameters: PyTorch's composable ``replicate``.

    ``DistributedDataParallel`` takes plain tensors only. ``replicate`` does what
    DDP does — a whole copy on every dp rank, gradients all-reduced during
    backward — but is built on FSDP2's machinery, which understands DTensors, so
    it composes with DTensor tensor parallelism. Each block is one unit: its
    gradients are all-reduced as soon as its backward is done.
    """

    def __init__(self, model, dp_mesh, **options):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in blocks_of(model):
            replicate(block, mesh=dp_mesh)
        replicate(model, mesh=dp_mesh)
        super().__init__(model, **options)

    def accumulating(self, last: bool):
        self.model.set_requires_gradient_sync(last)  # all-reduce during the last microbatch's backward only
        return super().accumulating(last)


def _recording_allreduce_hook(state, bucket):
    """DDP's own averaging all-reduce, with its time recorded (its bytes are counted by comm.counting)."""
    rec, group = state
    tensor = bucket.buffer()
    name = f"all_reduce bucket {bucket.index()}"
    start, nvtx = rec.mark(), rec.open_range("comm", name)
    tensor.div_(dist.get_world_size(group))
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def done(f):
        rec.add_span("comm", name, start, rec.mark(), nvtx=nvtx)
        return f.value()[0]

    return fut.then(done)


# --- its rules (and those of ZeRO, FSDP, the precisions and the engines that run them) ------------------------------

def has_replicate() -> bool:
    """Whether this torch has the composable ``replicate`` built on FSDP2 (DDP that takes DTensor parameters)."""
    import importlib.util
    return importlib.util.find_spec("torch.distributed._composable.replicate_with_fsdp") is not None


def check(cfg, mc, runnable: bool = True) -> None:
    """What data parallelism, ZeRO and the precisions refuse, one sentence each; ``runnable``: also what this
    build does not run (an estimate on paper may still size it)."""
    if cfg.master_weights and cfg.precision == "fp32":
        raise ConfigError("master_weights keeps an fp32 copy of half-precision weights; "
                          "choose precision bf16 or fp16 with it.")
    if cfg.bucket_mb is not None:
        if not cfg.bucket_mb > 0:
            raise ConfigError(f"bucket_mb={cfg.bucket_mb} must be a positive number of megabytes.")
        if cfg.dp * cfg.cp == 1 or cfg.zero or cfg.impl == "accelerate":
            raise ConfigError("bucket_mb sets the gradient buckets of plain data parallelism "
                              "(dp × cp > 1, zero=0, impl scratch or torch).")
    if not runnable:
        return
    if cfg.precision != "fp32" and (cfg.tp > 1 or cfg.pp > 1 or cfg.impl == "accelerate"
                                    or (cfg.zero and cfg.impl != "scratch")):
        raise ConfigError(f"precision={cfg.precision} runs with single, data-parallel and scratch ZeRO "
                          f"layouts in this build, not {cfg.kind()} with impl={cfg.impl!r}.")
    if cfg.master_weights and cfg.impl == "torch" and cfg.zero:
        raise ConfigError("master_weights with impl='torch' is offered for DDP only (zero=0).")
    if cfg.zero == 1 and cfg.impl == "torch" and (cfg.tp > 1 or cfg.pp > 1):
        raise ConfigError("torch's ZeRO-1 (ZeroRedundancyOptimizer) runs with data parallelism alone (tp=1, pp=1); "
                          "use zero=2 or 3 (FSDP2), or impl='scratch'.")
    if cfg.impl == "torch" and cfg.tp > 1 and cfg.dp > 1 and not cfg.zero:
        if not has_replicate():
            raise ConfigError(f"data parallelism over DTensor (tensor-parallel) parameters needs PyTorch's "
                              f"composable replicate, which torch {torch.__version__} lacks; use zero=2 or 3 "
                              f"(FSDP2), or impl='scratch'.")
        if cfg.bucket_mb is not None:
            raise ConfigError("bucket_mb sets DistributedDataParallel's buckets; with DTensor tensor parallelism "
                              "data parallelism is PyTorch's replicate, which all-reduces block by block.")
    if cfg.impl == "accelerate":
        if cfg.tp > 1 or cfg.pp > 1:
            raise ConfigError("impl='accelerate' runs data parallelism only (tp=1, pp=1).")
        if cfg.zero not in (0, 3):
            raise ConfigError(f"impl='accelerate' offers DDP (zero=0) and FSDP (zero=3), not zero={cfg.zero}.")
