"""Mutant of ex15_fsdp: leaves the vectors' gradients as each rank computed them: only the sharded ones are reduced."""

import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn


class Shard:
    """One sharded parameter: its shape, and the sizes of its padded flat buffer and of each rank's piece."""

    def __init__(self, param: nn.Parameter, world: int, rank: int):
        self.param, self.shape, self.numel = param, param.shape, param.numel()
        self.size = math.ceil(self.numel / world)
        self.padded = self.size * world
        flat = torch.zeros(self.padded, dtype=param.dtype)
        flat[:self.numel] = param.detach().reshape(-1)
        param.data = flat[rank * self.size:(rank + 1) * self.size].clone()


class FullWeight:
    """The whole weight for one forward call of its submodule, in the compute dtype."""

    def __init__(self, shard: Shard, dtype: torch.dtype):
        self.shard = shard
        self.buffer = torch.empty(shard.padded, dtype=dtype)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        self.gather()
        # The memory under a version counter of its own: gathering into it again before backward is not an
        # in-place change of what autograd saved.
        self.tensor = self.buffer.data[:shard.numel].view(shard.shape)

    def gather(self) -> None:
        dist.all_gather_single(self.buffer, self.shard.param.detach().to(self.buffer.dtype))

    def regather(self) -> None:
        """Gather again for backward, once (a call with several outputs asks once for each)."""
        if self.buffer.untyped_storage().nbytes() == 0:
            self.buffer.untyped_storage().resize_(self.nbytes)
            self.gather()

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)


class Gather(torch.autograd.Function):
    """Forward: the whole weight. Backward: free it, and start the reduce-scatter of its gradient."""

    @staticmethod
    def forward(ctx, param, full: FullWeight, pending: list):
        ctx.full, ctx.pending = full, pending
        return full.tensor

    @staticmethod
    def backward(ctx, grad):
        full = ctx.full
        full.free()
        shard = full.shard
        flat = torch.zeros(shard.padded, dtype=shard.param.dtype)  # the sum over ranks is taken in fp32
        flat[:shard.numel] = grad.reshape(-1)
        piece = torch.empty(shard.size, dtype=shard.param.dtype)
        work = dist.reduce_scatter_single(piece, flat, async_op=True)
        ctx.pending.append((shard.param, piece, flat, work))
        return None, None, None


class FSDP(nn.Module):
    """Every matrix of ``module`` sharded over the ranks, gathered whole only while a submodule holding it runs."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        rank = dist.get_rank()
        self.compute_dtype = compute_dtype
        self.shards = {}
        self.replicated = []
        for _, p in module.named_parameters():
            if p.dim() >= 2:
                self.shards[id(p)] = Shard(p, self.world, rank)
            else:
                self.replicated.append(p)
        self.pending = []
        self.calls = {}  # id(submodule) -> the whole weights of its running forward
        for m in module.modules():
            held = [name for name, p in m._parameters.items() if p is not None and id(p) in self.shards]
            if held:
                m.register_forward_pre_hook(functools.partial(self._before_forward, held))
                m.register_forward_hook(functools.partial(self._after_forward, held))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _before_forward(self, held, module, args):
        fulls = []
        for name in held:
            shard = self.shards[id(module._parameters[name])]
            full = FullWeight(shard, self.compute_dtype or shard.param.dtype)
            module.__dict__[name] = Gather.apply(shard.param, full, self.pending)
            fulls.append(full)
        self.calls[id(module)] = fulls

    def _after_forward(self, held, module, args, out):
        fulls = self.calls.pop(id(module))
        for name in held:
            del module.__dict__[name]
        for full in fulls:
            full.free()
        outs = out if isinstance(out, (tuple, list)) else [out]
        for t in outs:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(functools.partial(self._before_backward, fulls))

    @staticmethod
    def _before_backward(fulls, grad):
        for full in fulls:
            full.regather()

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters and put each averaged piece in its shard's ``.grad``; all-reduce and
        average the replicated parameters' gradients."""
        for param, piece, _flat, work in self.pending:
            work.wait()
            piece /= self.world
            param.grad = piece if param.grad is None else param.grad + piece
        self.pending.clear()
