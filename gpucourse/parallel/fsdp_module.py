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

**Units.** The weights are gathered a *unit* at a time: a submodule that gathers, in one all-gather, every sharded
parameter it holds or encloses that no smaller unit takes. By default each submodule holding a sharded parameter is
a unit of its own (a gather per matrix, the easiest to follow); ``unit(name, submodule) -> bool`` picks them
instead, e.g. each transformer block, as FSDP2 users call ``fully_shard`` on each block. A collective costs a
latency however small it is: on 2 CPU ranks the tiny GPT's step takes twice as long with a gather per matrix as
with one a block (``gpucourse bench --only fsdp_module_vs_torch_fsdp2``). The price is memory: a whole block is
gathered at once, not a matrix. The wrapped module is always a unit too, for whatever no other unit takes.

**When a unit runs**, hooks put the whole weights where the ``forward`` of each submodule holding one looks:

    forward pre-hook     all-gather the unit's shards, laid end to end on each rank, into one buffer: dp rows,
                         one a rank, each matrix a block of columns (a unit of one matrix: the buffer is the padded
                         matrix); copy each matrix out into memory of its own and set it as an instance attribute
                         of its submodule (``fc.weight``): Python finds it before the shard that
                         ``module._parameters`` holds. The copies are the outputs of ``_Unshard``, an autograd
                         Function, so the weights' gradients flow back through it.
    forward hook         take the attributes away again and free the copies' memory (autograd still refers to
                         them, but they hold nothing); hook the unit's outputs.
    an output's gradient the unit's backward is next: all-gather the copies again, into the same memory.
    _Unshard.backward    autograd calls it once every weight of the unit has its gradient: free the copies, finish
                         the reduce-scatter started before this one, and start (asynchronously) one reduce-scatter
                         of all the unit's gradients, laid out as the gather was, so that rank r receives the sum
                         of its pieces.

Finishing a reduce-scatter means waiting for it, dividing by dp and putting this rank's pieces in ``p.grad`` (each
shard's shape and dtype); then the whole gradients they were cut from are dropped. One reduce-scatter is in flight
at a time, as in FSDP2: a rank never holds every whole gradient at once, which would undo the sharding of
gradients. ``finish_gradient_synchronization()`` finishes the last one, then all-reduces the replicated parameters'
gradients in one message (dozens of small vectors, one collective's latency). So a weight is whole in forward only
while its unit runs, and in backward from the arrival of its unit's output gradient to the completion of the unit's
weights' gradients (a matrix the model itself holds is whole for all of backward; a frozen one until backward
ends).

**Mixed precision**: with ``compute_dtype`` (torch.bfloat16 or torch.float16), each shard is cast before the
all-gather, so the gather moves half the bytes and forward and backward compute in that dtype. The shards (the
master weights the optimizer steps) stay fp32, and so do the gradients: a gradient is cast to the shard's dtype
*before* the reduce-scatter, so the sum over ranks is taken in fp32 (torchtitan's default, ``reduce_dtype``).
Replicated parameters keep their own dtype, so a module must accept, say, a bf16 product plus an fp32 bias (``x
@ w.t() + b`` promotes to fp32; ``torch.nn.Linear``'s fused bias refuses the mix: shard its bias too, or leave
``compute_dtype`` out).

**Bytes per step**, per sharded parameter of ``N = S·dp`` padded values, for each forward call of a unit holding
it (a tied weight held by two units counts twice, by two submodules of one unit once): an all-gather of N values in forward and another
before backward (in the compute dtype, even where backward does not read the weight, as an embedding's does not),
and a reduce-scatter of N values in the shard's dtype; plus one all-reduce of all the replicated gradients. In fp32
that is 1.5× data parallel's all-reduce for the sharded part, as in ``zero3.py``.

**Equality**: on one rank every step equals the unwrapped module's bit for bit. On dp ranks each rank's gradient
is a sum over its share of the batch, and the shares' sums are added by the reduce-scatter: the same numbers
added in another order than one device's single matrix product over the whole batch, so the weights agree to
float rounding (the tests hold them within 1e-6), not bit for bit. With a compute dtype the one-device run to
compare with casts each matrix at each use and takes the batch in dp parts whose gradients add in fp32: a bf16
gradient of the whole batch, rounded once, is not the sum of dp rounded ones (they differ by about 2⁻⁸ of it). A
tied weight that one unit holds twice is cast once, so its two uses' gradients add in the compute dtype, as
autograd adds any tensor's.

**What it asks of the model**: a sharded parameter is whole only inside the ``forward`` of its unit, so it must be
read there; every rank must run the same units in the same order (a gather is a collective), so a mixture of
experts whose experts run only when tokens reach them is not for this module; and backward must reach a unit's
weights through its outputs.
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

    def full(self) -> torch.Tensor:
        """The whole parameter in its own dtype and shape (a collective: every rank must call it)."""
        flat = torch.empty(self.padded, dtype=self.param.dtype, device=self.param.device)
        comm.all_gather_into_tensor(flat, self.param.detach(), group=self.group, name=f"all_gather {self.name}")
        return flat[:self.numel].view(self.shape)


class Unit:
    """The sharded parameters gathered together, in one all-gather, and whose gradients are reduce-scattered
    together, in one reduce-scatter. Each rank's part of the message is its shards laid end to end, so the
    gathered buffer is dp rows of ``size`` values, one row a rank, and parameter i is column block
    ``[offset_i, offset_i + shard_size_i)`` of every row (its pieces in rank order). One parameter: the buffer
    *is* the padded parameter."""

    def __init__(self, name: str, params: list[ShardedParameter]):
        self.name, self.params = name, params
        first = params[0]
        self.group, self.dp = first.group, first.dp
        self.dtype, self.compute_dtype, self.device = first.param.dtype, first.compute_dtype, first.param.device
        self.offsets = [0]
        for sharded in params:
            self.offsets.append(self.offsets[-1] + sharded.shard_size)
        self.size = self.offsets[-1]

    def gather(self) -> FullCopy:
        """Every rank's shards, cast to the compute dtype and all-gathered: the whole weights, for one call."""
        return FullCopy(self)

    def columns(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's pieces in a dp × size buffer: a (dp, shard_size) view, row r rank r's piece."""
        return flat.view(self.dp, self.size)[:, self.offsets[i]:self.offsets[i + 1]]

    def reduce_scatter(self, grads: list) -> tuple:
        """Start summing ``grads`` (each parameter's whole gradient on this rank, None where it has none) over the
        ranks, each keeping its pieces: returns (the pieces, the flat input, which must live until the collective
        ends, the pending collective)."""
        flat = torch.zeros(self.dp * self.size, dtype=self.dtype, device=self.device)
        for i, (sharded, grad) in enumerate(zip(self.params, grads)):
            if grad is not None:  # cast to the shard's dtype before the sum
                padded = torch.zeros(sharded.padded, dtype=self.dtype, device=self.device)
                padded[:sharded.numel] = grad.reshape(-1)
                self.columns(flat, i).copy_(padded.view(self.dp, sharded.shard_size))
        piece = torch.empty(self.size, dtype=self.dtype, device=self.device)
        pending = comm.reduce_scatter_tensor(piece, flat, group=self.group, async_op=True,
                                             name=f"reduce_scatter {self.name} gradient")
        return piece.split([s.shard_size for s in self.params]), flat, pending


class FullCopy:
    """The whole weights of one unit for one forward call: gathered, freed after forward, gathered again for
    backward into the same memory, freed when their gradients are out."""

    def __init__(self, unit: Unit):
        self.unit = unit
        one = len(unit.params) == 1
        self.buffer = torch.empty(unit.dp * unit.size, dtype=unit.compute_dtype, device=unit.device)
        # A parameter alone is a view of the buffer; several are copied out of it (their pieces are interleaved
        # with the others'), each into memory of its own, and the buffer is freed once they are.
        self.fulls = [self.buffer[:s.numel].view(s.shape) if one else
                      torch.empty(s.shape, dtype=unit.compute_dtype, device=unit.device) for s in unit.params]
        self.nbytes = [t.untyped_storage().nbytes() for t in self.fulls]
        self.buffer_nbytes = self.buffer.untyped_storage().nbytes()
        self.fill()
        # What the submodules compute with: the same memory under a version counter of its own (``.data``),
        # so that filling the memory again before backward is not an in-place change autograd would refuse.
        self.tensors = [t.data for t in self.fulls]

    def fill(self) -> None:
        unit = self.unit
        shards = [s.param.detach().to(unit.compute_dtype) for s in unit.params]
        comm.all_gather_into_tensor(self.buffer, shards[0] if len(shards) == 1 else torch.cat(shards),
                                    group=unit.group, name=f"all_gather {unit.name}")
        if len(unit.params) > 1:
            for i, (sharded, full) in enumerate(zip(unit.params, self.fulls)):
                full.view(-1).copy_(unit.columns(self.buffer, i).reshape(-1)[:sharded.numel])
            self.buffer.untyped_storage().resize_(0)

    def refill(self) -> None:
        """Gather again if freed (several outputs of one call each ask)."""
        if any(t.untyped_storage().nbytes() == 0 for t in self.fulls):
            for t, nbytes in zip(self.fulls, self.nbytes):
                t.untyped_storage().resize_(nbytes)
            self.buffer.untyped_storage().resize_(self.buffer_nbytes)
            self.fill()

    def free(self, which=None) -> None:
        """Free the whole copies (``which``: their indices; default all). Every tensor on their memory
        (autograd's saved ones) then holds nothing."""
        for i, t in enumerate(self.fulls):
            if which is None or i in which:
                t.untyped_storage().resize_(0)


class _Unshard(torch.autograd.Function):
    """Forward: a unit's whole weights, from its shards. Backward: their gradients, reduce-scattered to the shards,
    once autograd has every one of them (one node for the unit, so one collective)."""

    @staticmethod
    def forward(ctx, copy: FullCopy, fsdp: FullyShardedDataParallel, *shards: torch.Tensor):
        ctx.copy, ctx.fsdp = copy, fsdp
        ctx.set_materialize_grads(False)
        frozen = [t for s, t in zip(shards, copy.tensors) if not s.requires_grad]
        ctx.mark_non_differentiable(*frozen)
        ctx.trainable = [i for i, s in enumerate(shards) if s.requires_grad]
        return tuple(copy.tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.copy.free(ctx.trainable)  # a frozen weight stays whole: its submodule's backward may still read it
        ctx.fsdp._finish_reduction()  # the one before: one unit's whole gradients at most on the wire
        unit = ctx.copy.unit
        got = [i for i, g in enumerate(grads) if g is not None]
        ctx.fsdp._reduction = (unit, got, *unit.reduce_scatter(list(grads)))
        # Nothing for autograd to add to the shards' .grad: _finish_reduction puts the pieces there.
        return (None, None, *(None for _ in grads))


class FullyShardedDataParallel(torch.nn.Module):
    """ZeRO-3 as a module for any training loop: each rank keeps a shard of every parameter ``shard`` picks, and
    gathers it whole only while a submodule holding it computes (see the module's docstring).

    ``group``: the data-parallel process group (default: every rank). ``compute_dtype``: None (compute in the
    parameters' dtype), torch.bfloat16 or torch.float16. ``shard(name, parameter)``: whether to shard a parameter
    (default :func:`matrices`). ``unit(name, submodule)``: whether a submodule gathers, in one all-gather, every
    sharded parameter inside it that no unit within it gathers (default None: each submodule that holds sharded
    parameters is a unit of its own; the wrapped module always is one, for what is left). Every rank starts from
    rank 0's weights. Call ``finish_gradient_synchronization()`` after backward; ``gather_full_params()`` gives the
    whole weights, named as the module named them.
    """

    def __init__(self, module: torch.nn.Module, group=None, compute_dtype: torch.dtype | None = None,
                 shard: Callable[[str, torch.nn.Parameter], bool] = matrices,
                 unit: Callable[[str, torch.nn.Module], bool] | None = None):
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
        self._calls: dict[int, FullCopy] = {}  # id(unit) -> its running forward's full copies
        self.units: list[Unit] = []
        for (name, owner), held in self._placements(unit).items():
            # One unit a dtype: a message has one (parameters of two dtypes in one submodule make two units).
            by_dtype: dict[tuple, list] = {}
            for sub, attr, sharded in held:
                by_dtype.setdefault((sharded.param.dtype, sharded.compute_dtype), []).append((sub, attr, sharded))
            for part in by_dtype.values():
                params = list({id(s.param): s for _, _, s in part}.values())  # a tied one once in its unit
                u = Unit(name or "model", params)
                where = [(sub, attr, params.index(s)) for sub, attr, s in part]
                self.units.append(u)
                owner.register_forward_pre_hook(functools.partial(self._before_forward, u, where))
                owner.register_forward_hook(functools.partial(self._after_forward, u, where))

    def _placements(self, unit) -> dict:
        """{(name, unit module): [(submodule, attribute, sharded parameter), ...]}: every place a sharded parameter
        is held, under the nearest unit at or above the submodule holding it."""
        named = dict(self.module.named_modules())
        nearest: dict[str, str] = {}
        for name, m in named.items():  # parents come before their children
            direct = any(p is not None and id(p) in self.sharded for p in m._parameters.values())
            picked = name == "" or (unit(name, m) if unit is not None else direct)
            nearest[name] = name if picked else nearest[name.rpartition(".")[0]]
        places: dict[tuple, list] = {}
        for name, m in named.items():
            for attr, p in m._parameters.items():
                if p is not None and id(p) in self.sharded:
                    owner = nearest[name]
                    places.setdefault((owner, named[owner]), []).append((m, attr, self.sharded[id(p)]))
        return places

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _before_forward(self, u: Unit, where: list, module: torch.nn.Module, args) -> None:
        copy = u.gather()
        fulls = _Unshard.apply(copy, self, *(s.param for s in u.params))
        for sub, attr, i in where:
            sub.__dict__[attr] = fulls[i]
        self._calls[id(u)] = copy

    def _after_forward(self, u: Unit, where: list, module: torch.nn.Module, args, out) -> None:
        copy = self._calls.pop(id(u))
        for sub, attr, _ in where:
            del sub.__dict__[attr]  # sub.weight is the shard again
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside backward (activation checkpointing): its backward comes at once
        copy.free()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, copy=copy: copy.refill())

    def _finish_reduction(self) -> None:
        """Wait for the pending reduce-scatter, if any, and put this rank's averaged pieces in their shards'
        ``.grad`` (added to what is there); the whole gradients they were cut from are dropped."""
        if self._reduction is None:
            return
        unit, got, pieces, _flat, pending = self._reduction
        self._reduction = None
        pending.wait()
        for i in got:
            piece = pieces[i] / self.dp
            p = unit.params[i].param
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
