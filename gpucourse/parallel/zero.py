"""ZeRO: data parallelism without keeping everything on every rank.

Plain data parallelism stores, on each of the dp ranks, the weights, the
gradients and Adam's two moments: 4 + 4 + 8 = 16 bytes per parameter in fp32,
all of it identical on every rank. ZeRO (Rajbhandari et al., 2020) removes the
copies in stages:

- **Stage 1** shards the optimizer state. All parameters live in one flat
  buffer, padded to a multiple of dp and cut into dp equal shards; rank r owns
  shard r. After backward the gradient is all-reduced as usual, but each rank
  runs Adam only on its own shard, then an all-gather gives everyone the
  updated weights. Optimizer memory falls from 8·P to 8·P/dp bytes.
- **Stage 2** also shards the gradients: a reduce-scatter (instead of the
  all-reduce) leaves each rank with the averaged gradient of its shard only, so
  gradient memory falls from 4·P to 4·P/dp. For clarity this file
  reduce-scatters after the whole backward, so the full gradient still exists
  once, briefly; production code does it bucket by bucket during backward.
- **Stage 3** shards the weights too and gathers each block just before use:
  that is FSDP; ``zero3.py`` writes it from scratch, and PyTorch's
  ``fully_shard`` runs it with ``impl="torch"``.

Memory kept per rank at the optimizer step, with S = ceil(P / dp) and padded
P' = S·dp (see :func:`memory_formula`): weights 4·P' bytes; gradients 4·P'
(stage 1) or 4·S (stage 2); optimizer state 8·S.

Communication per step (payload, see ``gpucourse.comm``): stage 1 all-reduces
P' floats and all-gathers P'; stage 2 reduce-scatters P' and all-gathers P'.
Counted the ring way, a reduce-scatter plus an all-gather is exactly one
all-reduce: stage 2 moves what plain data parallelism moves.

For a training loop of your own, ``sharded_optimizer.ShardedOptimizer`` is stage 1 as a ``torch.optim.Optimizer``:
it wraps any optimizer class, and each rank keeps the state of whole parameters of its own (like PyTorch's
``ZeroRedundancyOptimizer``, not one flat buffer) and sends them to the others after its step.

``impl="torch"``: stage 1 is ``ZeroRedundancyOptimizer`` (it shards whole
parameters between ranks, not one flat buffer) under DDP; stages 2 and 3 are
FSDP2's ``fully_shard``, keeping the gathered weights between forward and
backward for stage 2 (``reshard_after_forward=False``) and freeing them for 3.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm
from ..measure import optimizer_state_bytes, tensor_bytes
from ..model import blocks_of
from .data_parallel import TorchDDP, broadcast_parameters, replica_group
from ..optim import ADAMW, MasterWeightsAdamW, init_state
from .single import Trainer


def memory_formula(num_params: int, dp: int, stage: int) -> dict:
    """Bytes per rank that ZeRO ``stage`` keeps at the optimizer step (fp32, Adam)."""
    if stage == 0:
        return {"weights": 4 * num_params, "gradients": 4 * num_params, "optimizer": 8 * num_params}
    shard = math.ceil(num_params / dp)
    padded = shard * dp
    return {"weights": 4 * padded, "gradients": 4 * (padded if stage == 1 else shard), "optimizer": 8 * shard}


# --- Checkpoints: a flat shard's optimizer state, as every parameter's own ----------------------
#
# A checkpoint names optimizer state by parameter ("blocks.0.ln1.weight.exp_avg"), whole, so that
# any layout can load it. A rank's flat shard holds pieces of several parameters, cut wherever the
# shard boundary falls; saving all-gathers each field over dp and cuts it per parameter (every dp
# rank then briefly holds its stage's whole moments; DCP writes each once); loading cuts this rank's
# shard back out of the parameters' tensors.

def _fields(trainer: Trainer, shard: torch.Tensor) -> dict:
    """The optimizer state of ``shard`` by field (``exp_avg``, ``exp_avg_sq``, ``step``; ``master`` with masters)."""
    optimizer = trainer.torch_optimizer()
    init_state(optimizer)  # fresh (about to load): make the tensors a load fills in
    if isinstance(trainer.optimizer, MasterWeightsAdamW):
        master = dict(zip(map(id, trainer.optimizer.params), trainer.optimizer.masters))[id(shard)]
        return {**optimizer.state[master], "master": master}
    return dict(optimizer.state[shard])


def sharded_optimizer_state(trainer: Trainer, shards, group) -> dict:
    """``{"name.field": tensor}`` of every parameter in ``shards``.

    ``shards``: ``[(flat shard, [(name, offset, numel, shape)])]``.
    """
    dp, state = dist.get_world_size(group), {}
    for shard, entries in shards:
        for field, value in _fields(trainer, shard).items():
            if value.dim() == 0:  # Adam's step count: one for the whole shard
                state.update({f"{name}.{field}": value.clone() for name, *_ in entries})
                continue
            whole = torch.empty(value.numel() * dp, dtype=value.dtype, device=value.device)
            comm.all_gather_flat(whole, value.detach().contiguous(), group=group)
            state.update({f"{name}.{field}": whole[offset:offset + n].view(shape)
                          for name, offset, n, shape in entries})
    return state


def load_sharded_optimizer_state(trainer: Trainer, shards, state: dict, group) -> None:
    """The reverse of :func:`sharded_optimizer_state`: this rank's shard of each field, cut from the parameters'."""
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    for shard, entries in shards:
        for field, target in _fields(trainer, shard).items():
            present = [(f"{name}.{field}", offset, n) for name, offset, n, _ in entries if f"{name}.{field}" in state]
            with torch.no_grad():
                if target.dim() == 0:
                    if present:
                        target.copy_(state[present[0][0]])
                    continue
                whole = torch.zeros(target.numel() * dp, dtype=target.dtype, device=target.device)
                for key, offset, n in present:  # a parameter without state there: zeros (it never got a gradient)
                    whole[offset:offset + n] = state[key].reshape(-1)
                target.copy_(whole[rank * target.numel():(rank + 1) * target.numel()])


class FlatShards:
    """Trainable parameters replicated over one group, in one flat buffer cut into that group's equal shards.

    Each parameter becomes a view into the buffer, so an all-gather into the buffer
    updates the model at once; ``local`` is this rank's shard (a view too, so Adam
    updates the buffer in place).
    """

    def __init__(self, params: list, group):
        self.params, self.group = params, group
        n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(self.numel / n)
        self.flat = torch.zeros(self.shard_size * n, dtype=params[0].dtype, device=params[0].device)
        self.slices, offset = [], 0
        for p in params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            self.slices.append((offset, p.numel()))
            offset += p.numel()
        self.lo = self.rank * self.shard_size
        self.local = torch.nn.Parameter(self.flat[self.lo:self.lo + self.shard_size])
        self.full_grad = None
        self.no_grad: list[tuple[int, int]] = []

    def flat_gradient(self) -> torch.Tensor:
        """Every parameter's gradient copied into one flat buffer (zeros where there is none); .grad released."""
        flat_grad = torch.zeros_like(self.flat)
        self.no_grad = []  # parameters that got no gradient (on any rank, as DDP assumes too)
        for p, (offset, n) in zip(self.params, self.slices):
            if p.grad is not None:
                flat_grad[offset:offset + n].copy_(p.grad.reshape(-1))
            else:
                self.no_grad.append((offset, n))
            p.grad = None  # the flat buffer now holds it
        return flat_grad

    def untouched(self) -> list:
        """``(start, values)`` of the parts of this shard that got no gradient, to put back after the step."""
        kept = []
        for offset, n in self.no_grad:  # the part of each such parameter that lies in this rank's shard
            start, end = max(offset - self.lo, 0), min(offset + n - self.lo, self.shard_size)
            if start < end:
                kept.append((start, self.local[start:end].clone()))
        return kept


class ZeroScratch(Trainer):
    """ZeRO stage 1 or 2 over the data-parallel ``group``, from scratch.

    Under expert parallelism the experts' weights are replicated over a smaller
    group (``expert_group``): they get a flat buffer of their own, sharded over
    that group, beside the one for everything else — as Megatron-Core's
    distributed optimizer keeps separate expert buffers.
    """

    def __init__(self, model, group, stage: int = 1, **options):
        self.group, self.stage = group, stage
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        broadcast_parameters(model, group)
        by_group = {}
        for p in model.parameters():
            if p.requires_grad:
                replicas = replica_group(p, group)
                by_group.setdefault(id(replicas), (replicas, []))[1].append(p)
        self.parts = [FlatShards(params, replicas) for replicas, params in by_group.values()]
        super().__init__(model, **options)
        dense = self.parts[0]
        self.extras["zero"] = {"stage": stage, "num_params": dense.numel, "shard_size": dense.shard_size}
        if len(self.parts) > 1:
            self.extras["zero"]["expert_shards"] = [{"num_params": part.numel, "shard_size": part.shard_size}
                                                    for part in self.parts[1:]]

    def make_optimizer(self, lr):
        return self.optimizer_for([part.local for part in self.parts], lr)

    def gradients(self):
        return [part.local.grad for part in self.parts]

    def sync_gradients(self) -> None:
        for part in self.parts:
            flat_grad = part.flat_gradient()
            if self.stage == 1:
                comm.all_reduce(flat_grad, group=part.group, name="all_reduce gradients")
                part.full_grad = flat_grad  # stage 1 keeps the whole (averaged) gradient
                part.local.grad = flat_grad[part.lo:part.lo + part.shard_size]
            else:
                shard_grad = torch.empty(part.shard_size, dtype=flat_grad.dtype, device=flat_grad.device)
                comm.reduce_scatter_tensor(shard_grad, flat_grad, group=part.group, name="reduce_scatter gradients")
                part.local.grad = shard_grad
            part.local.grad /= self.dp  # the mean over every dp rank's tokens, experts' included

    def optimizer_step(self) -> None:
        # On one device the optimizer skips a parameter without a gradient; inside the shard it
        # cannot (weight decay would still shrink it), so those values are put back after the step.
        kept = [part.untouched() for part in self.parts]
        with self.rec.span("optimizer"):
            self.optimizer.step()
        masters = getattr(self.optimizer, "masters", [None] * len(self.parts))  # fp32 master weights
        with torch.no_grad():
            for part, master, values_kept in zip(self.parts, masters, kept):
                for start, values in values_kept:
                    part.local[start:start + len(values)] = values
                    if master is not None:
                        master[start:start + len(values)] = values
        for part in self.parts:
            # The all-gather's input must not alias its output, so send a copy of our shard.
            comm.all_gather_into_tensor(part.flat, part.local.detach().clone(), group=part.group,
                                        name="all_gather weights")
        self.measure_memory()
        self.optimizer.zero_grad(set_to_none=True)
        for part in self.parts:
            part.full_grad = None

    def weight_bytes(self) -> int:
        return tensor_bytes([part.flat for part in self.parts])

    def _shards(self, part: FlatShards) -> list:
        names = self.parameter_names()
        return [(part.local, [(names[p], offset, n, p.shape) for p, (offset, n) in zip(part.params, part.slices)])]

    def optimizer_state(self) -> dict:
        state = {}
        for part in self.parts:
            state.update(sharded_optimizer_state(self, self._shards(part), part.group))
        return state

    def load_optimizer_state(self, state: dict) -> None:
        for part in self.parts:
            load_sharded_optimizer_state(self, self._shards(part), state, part.group)

    def gradient_bytes(self) -> int:
        return tensor_bytes([part.full_grad if part.full_grad is not None else part.local.grad
                             for part in self.parts])


class TorchZero1(TorchDDP):
    """ZeRO-1 the PyTorch way: DDP for gradients, ZeroRedundancyOptimizer for the step."""

    def make_optimizer(self, lr):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer_class, kwargs = self.optimizer_class, self.optimizer_kwargs
        if optimizer_class is None:  # the course's AdamW
            optimizer_class, kwargs = torch.optim.AdamW, ADAMW
        return ZeroRedundancyOptimizer(
            [p for p in self.model.parameters() if p.requires_grad], optimizer_class=optimizer_class,
            process_group=self.group, lr=lr, **kwargs)

    def optimizer_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer.optim)

    def torch_optimizer(self):
        return self.optimizer.optim  # the optimizer over this rank's own parameters: it holds their state


class TorchFSDP(Trainer):
    """FSDP2: each block (then the whole model) wrapped by ``fully_shard`` over the dp mesh."""

    def __init__(self, model, dp_mesh, stage: int = 3, **options):
        from torch.distributed.fsdp import fully_shard

        reshard = stage == 3
        for block in blocks_of(model):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
        super().__init__(model, **options)

    def accumulating(self, last: bool):
        # Skip the reduce-scatter on all but the last microbatch, as DDP's no_sync does.
        self.model.set_requires_gradient_sync(last)
        return super().accumulating(last)
