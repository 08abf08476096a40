"""Fully sharded data parallel (ZeRO-3) as a module any training loop can use.

``zero3.py`` shards the course's own GPT, block by block, inside the course's trainer. This file does the same
for a model it has never seen, under a loop it does not own, the way PyTorch's FSDP2 (``fully_shard``) does:

    fsdp = FullyShardedDataParallel(model)               # every rank keeps 1/dp of each matrix
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)  # the optimizer steps (and keeps state for) the shards
    loss = my_loss(fsdp(x), y)                           # each matrix gathered whole just before it is used
    loss.backward()                                      # ... and again for backward; gradients reduce-scattered
    fsdp.finish_gradient_synchronization()               # wait for them; vectors' gradients all-reduced
    opt.step()

**What is sharded** is a rule, ``shard(name, parameter) -> bool``: by default every parameter with two or more
dimensions (:func:`matrices`). Those hold almost all of a transformer's numbers; the vectors (norm gains,
biases) are small, so they stay whole on every rank and their gradients are all-reduced, as in data parallel.

**A sharded parameter** stays the module's own ``nn.Parameter``, but after construction its ``.data`` is this
rank's flat shard: the parameter flattened, zero-padded to a multiple of dp, cut into dp equal pieces of
``S = ceil(numel / dp)`` values, piece r on rank r. So ``named_parameters()`` yields the shards and any
optimizer steps them; the padding's gradient is always zero, so it stays zero.

**When a submodule runs**, hooks put the whole weight where its ``forward`` looks for it:

    forward pre-hook     all-gather each of its sharded parameters into a full copy, and set the full copy as an
                         instance attribute (``module.weight``): Python finds it before the shard that
                         ``module._parameters`` holds. The copy is the output of ``_Unshard``, an autograd Function,
                         so the gradient of the weight flows back through it.
    forward hook         take the attribute away again and free the copy's memory (autograd still refers to it,
                         but it holds nothing); hook the submodule's outputs.
    an output's gradient the submodule's backward is next: all-gather the copy again, into the same memory.
    _Unshard.backward    the weight's gradient is complete: free the copy, finish the reduce-scatter started
                         before this one, and start (asynchronously) a reduce-scatter of this gradient, so that
                         rank r receives the sum of piece r.

Finishing a reduce-scatter means waiting for it, dividing by dp and putting this rank's piece in ``p.grad`` (the
shard's shape and dtype); then the whole gradient it was cut from is dropped. One reduce-scatter is in flight at a
time, as in FSDP2: a rank never holds every whole gradient at once, which would undo the sharding of gradients.
``finish_gradient_synchronization()`` finishes the last one, then all-reduces the replicated parameters' gradients
in one message (dozens of small vectors, one collective's latency). So a weight is whole in forward only while a
submodule holding it runs (a submodule and the ones it encloses), and in backward from the arrival of its
submodule's output gradient to the completion of its own (a matrix the model itself holds is whole for all of
backward; a frozen one until backward ends).

**Mixed precision**: with ``compute_dtype`` (torch.bfloat16 or torch.float16), each shard is cast before the
all-gather, so the gather moves half the bytes and forward and backward compute in that dtype. The shards (the
master weights the optimizer steps) stay fp32, and so do the gradients: a gradient is cast to the shard's dtype
*before* the reduce-scatter, so the sum over ranks is taken in fp32 (torchtitan's default, ``reduce_dtype``).
Replicated parameters keep their own dtype, so a module must accept, say, a bf16 product plus an fp32 bias (``x
@ w.t() + b`` promotes to fp32; ``torch.nn.Linear``'s fused bias refuses the mix: shard its bias too, or leave
``compute_dtype`` out).

**Bytes per step**, per sharded parameter of ``N = S·dp`` padded values, for each forward call of a submodule
holding it (a tied weight held by two submodules counts twice): an all-gather of N values in forward and another
before backward (in the compute dtype, even where backward does not read the weight, as an embedding's does not),
and a reduce-scatter of N values in the shard's dtype; plus one all-reduce of all the replicated gradients. In fp32
that is 1.5× data parallel's all-reduce for the sharded part, as in ``zero3.py``.

**Equality**: on one rank every step equals the unwrapped module's bit for bit. On dp ranks each rank's gradient
is a sum over its share of the batch, and the shares' sums are added by the reduce-scatter: the same numbers
added in another order than one device's single matrix product over the whole batch, so the weights agree to
float rounding (the tests hold them within 1e-6), not bit for bit. With a compute dtype the one-device run to
compare with casts each matrix at each use and takes the batch in dp parts whose gradients add in fp32: a bf16
gradient of the whole batch, rounded once, is not the sum of dp rounded ones (they differ by about 2⁻⁸ of it).

**What it asks of the model**: a sharded parameter is whole only inside the ``forward`` of a module holding it
(``m._parameters``), so it must be read there; every rank must run the same submodules in the same order (a
gather is a collective), so a mixture of experts whose experts run only when tokens reach them is not for this
module; and backward must reach a submodule's weights through its outputs.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from .. import comm
from .data_parallel import broadcast_parameters


def matrices(name: str, p: torch.nn.Parameter) -> bool:
    """The default sharding rule: every parameter with two or more dimensions (weights, embeddings) is sharded;
    vectors (norm gains, biases) stay whole on every rank."""
    return p.dim() >= 2


class ShardedParameter:
    """One sharded parameter: its original shape, and the shard (``param.data``) this rank keeps."""

    def __init__(self, name: str, param: torch.nn.Parameter, group, compute_dtype: torch.dtype | None):
        self.name, self.param, self.group = name, param, group
        self.dp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shape, self.numel = param.shape, param.numel()
        self.shard_size = math.ceil(self.numel / self.dp)
        self.padded = self.shard_size * self.dp
        self.compute_dtype = compute_dtype or param.dtype
        flat = torch.zeros(self.padded, dtype=param.dtype, device=param.device)
        flat[:self.numel] = param.detach().reshape(-1)
        param.data = flat[rank * self.shard_size:(rank + 1) * self.shard_size].clone()  # storage of its own

    def gather(self) -> FullCopy:
        """Every rank's shard, cast to the compute dtype and all-gathered: the whole weight, for one call."""
        return FullCopy(self)

    def full(self) -> torch.Tensor:
        """The whole parameter in its own dtype and shape (a collective: every rank must call it)."""
        flat = torch.empty(self.padded, dtype=self.param.dtype, device=self.param.device)
        comm.all_gather_into_tensor(flat, self.param.detach(), group=self.group, name=f"all_gather {self.name}")
        return flat[:self.numel].view(self.shape)

    def reduce_scatter(self, grad: torch.Tensor) -> tuple:
        """Start summing ``grad`` (the whole weight's gradient on this rank) over the ranks, each keeping its piece:
        returns (the piece, the flat input, which must live until the collective ends, the pending collective)."""
        flat = torch.zeros(self.padded, dtype=self.param.dtype, device=grad.device)
        flat[:self.numel] = grad.reshape(-1)  # cast to the shard's dtype before the sum
        piece = torch.empty(self.shard_size, dtype=self.param.dtype, device=grad.device)
        pending = comm.reduce_scatter_tensor(piece, flat, group=self.group, async_op=True,
                                             name=f"reduce_scatter {self.name} gradient")
        return piece, flat, pending


class FullCopy:
    """The whole weight of one sharded parameter for one forward call of its submodule: gathered, freed after
    forward, gathered again for backward into the same memory, freed when its gradient is out."""

    def __init__(self, sharded: ShardedParameter):
        self.sharded = sharded
        self.buffer = torch.empty(sharded.padded, dtype=sharded.compute_dtype, device=sharded.param.device)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        self.fill()
        # What the submodule computes with: the buffer's memory under a version counter of its own (``.data``),
        # so that filling the memory again before backward is not an in-place change autograd would refuse.
        self.tensor = self.buffer.data[:sharded.numel].view(sharded.shape)

    def fill(self) -> None:
        sharded = self.sharded
        comm.all_gather_into_tensor(self.buffer, sharded.param.detach().to(sharded.compute_dtype),
                                    group=sharded.group, name=f"all_gather {sharded.name}")

    def refill(self) -> None:
        """Gather again if freed (several outputs of one call each ask)."""
        if self.buffer.untyped_storage().nbytes() == 0:
            self.buffer.untyped_storage().resize_(self.nbytes)
            self.fill()

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)  # every tensor on this memory (autograd's saved ones) now holds nothing


class _Unshard(torch.autograd.Function):
    """Forward: the whole weight, from the shard. Backward: its gradient, reduce-scattered to the shards."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, copy: FullCopy, fsdp: FullyShardedDataParallel) -> torch.Tensor:
        ctx.copy, ctx.fsdp = copy, fsdp
        return copy.tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.copy.free()
        ctx.fsdp._finish_reduction()  # the one before: one whole gradient at most on the wire
        sharded = ctx.copy.sharded
        ctx.fsdp._reduction = (sharded, *sharded.reduce_scatter(grad))
        # Nothing for autograd to add to the shard's .grad: _finish_reduction puts the piece there.
        return None, None, None


class FullyShardedDataParallel(torch.nn.Module):
    """ZeRO-3 as a module for any training loop: each rank keeps a shard of every parameter ``shard`` picks, and
    gathers it whole only while a submodule holding it computes (see the module's docstring).

    ``group``: the data-parallel process group (default: every rank). ``compute_dtype``: None (compute in the
    parameters' dtype), torch.bfloat16 or torch.float16. ``shard(name, parameter)``: whether to shard a parameter
    (default :func:`matrices`). Every rank starts from rank 0's weights. Call ``finish_gradient_synchronization()``
    after backward; ``gather_full_params()`` gives the whole weights, named as the module named them.
    """

    def __init__(self, module: torch.nn.Module, group=None, compute_dtype: torch.dtype | None = None,
                 shard: Callable[[str, torch.nn.Parameter], bool] = matrices):
        super().__init__()
        self.module = module
        self.group = group if group is not None else dist.group.WORLD
        self.dp = dist.get_world_size(self.group)
        broadcast_parameters(module, self.group)
        self.sharded: dict[int, ShardedParameter] = {}  # by id(parameter): a tied parameter is sharded once
        self.replicated: list[torch.nn.Parameter] = []
        for name, p in module.named_parameters():
            if shard(name, p):
                self.sharded[id(p)] = ShardedParameter(name, p, self.group, compute_dtype)
            else:
                self.replicated.append(p)
        self._reduction = None  # the reduce-scatter started in backward, not yet waited for
        self._calls: dict[int, list] = {}  # id(submodule) -> its running forward's full copies
        for m in module.modules():
            held = [(name, self.sharded[id(p)]) for name, p in m._parameters.items()
                    if p is not None and id(p) in self.sharded]
            if held:
                m.register_forward_pre_hook(functools.partial(self._before_forward, held))
                m.register_forward_hook(functools.partial(self._after_forward, held))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _before_forward(self, held: list, module: torch.nn.Module, args) -> None:
        copies = []
        for name, sharded in held:
            copy = sharded.gather()
            module.__dict__[name] = _Unshard.apply(sharded.param, copy, self)
            copies.append(copy)
        self._calls[id(module)] = copies

    def _after_forward(self, held: list, module: torch.nn.Module, args, out) -> None:
        copies = self._calls.pop(id(module))
        for name, _ in held:
            del module.__dict__[name]  # module.weight is the shard again
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside backward (activation checkpointing): its backward comes at once
        for copy in copies:
            copy.free()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, copies=copies: self._before_backward(copies))

    @staticmethod
    def _before_backward(copies: list) -> None:
        for copy in copies:
            copy.refill()

    def _finish_reduction(self) -> None:
        """Wait for the pending reduce-scatter, if any, and put this rank's averaged piece in its shard's ``.grad``
        (added to what is there); the whole gradient it was cut from is dropped."""
        if self._reduction is None:
            return
        sharded, piece, _flat, pending = self._reduction
        self._reduction = None
        pending.wait()
        piece /= self.dp
        p = sharded.param
        p.grad = piece if p.grad is None else p.grad + piece

    def finish_gradient_synchronization(self) -> None:
        """Finish the last reduce-scatter; average the replicated parameters' gradients, laid end to end in one
        buffer per dtype, with one all-reduce each. Call it after backward, before the optimizer's step."""
        self._finish_reduction()
        by_dtype: dict[torch.dtype, list] = {}
        for p in self.replicated:
            if p.grad is not None:  # frozen, or unused in this step on every rank
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group=self.group, name="all_reduce replicated gradients")
            flat /= self.dp
            for g, average in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(average.view_as(g))

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """``{name: whole parameter}``, named as the wrapped module's ``named_parameters()`` named them before it
        was wrapped (a collective: every rank must call it)."""
        full = {}
        for name, p in self.module.named_parameters():
            sharded = self.sharded.get(id(p))
            full[name] = p.detach().clone() if sharded is None else sharded.full()
        return full
