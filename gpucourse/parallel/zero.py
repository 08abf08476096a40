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

The stages are an optimizer, :class:`FlatShardedOptimizer`: the course's trainer (:class:`ZeroScratch`) steps
through it, and so can a training loop of your own, with any optimizer class. ``sharded_optimizer.py`` has the
other way to cut the state, by whole parameters (like PyTorch's ``ZeroRedundancyOptimizer``), and ZeRO-2 that
reduces each gradient during backward. ``impl="torch"``: ``zero_torch.py`` (``ZeroRedundancyOptimizer`` under DDP
for stage 1, FSDP2's ``fully_shard`` for stages 2 and 3); checkpoints: ``sharded_state.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm
from ..measure import optimizer_state_bytes, tensor_bytes
from ..optim import MasterWeightsAdamW
from .data_parallel import replica_group
from .sharded_optimizer import RankShare
from .sharded_state import load_sharded_optimizer_state, sharded_optimizer_state
from .single import Trainer


def memory_formula(num_params: int, dp: int, stage: int) -> dict:
    """Bytes per rank that ZeRO ``stage`` keeps at the optimizer step (fp32, Adam)."""
    if stage == 0:
        return {"weights": 4 * num_params, "gradients": 4 * num_params, "optimizer": 8 * num_params}
    shard = math.ceil(num_params / dp)
    padded = shard * dp
    return {"weights": 4 * padded, "gradients": 4 * (padded if stage == 1 else shard), "optimizer": 8 * shard}


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


class FlatShardedOptimizer(RankShare, torch.optim.Optimizer):
    """ZeRO stage 1 or 2 as an optimizer, on flat buffers as the ZeRO paper and Megatron-Core's distributed optimizer
    keep them — the course's trainer (:class:`ZeroScratch`) and any other loop use it alike:

        opt = FlatShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)  # no DataParallel
        ... loss.backward(); opt.reduce_gradients(); opt.clip_grad_norm_(1.0); opt.step(); sched.step()

    Each parameter group becomes one :class:`FlatShards` (two under expert parallelism: the experts' weights are
    replicated over a smaller group, so they get a buffer of their own, as Megatron-Core keeps separate expert
    buffers), and ``optimizer_class`` steps only this rank's shards, each with its group's settings as they are at
    the step (a scheduler's learning rate included). Every rank starts from its group's first rank's weights.
    ``reduce_gradients()`` averages the gradients over ``group`` into each shard — stage 1 all-reduces the whole
    flat gradient and keeps it, stage 2 reduce-scatters it so a rank keeps only its shard — and ``step()`` calls it
    when the loop has not. ``make``: instead of ``optimizer_class``, a function from the shards' parameter groups
    to the optimizer that steps them (the course's trainer passes one that keeps fp32 master weights).
    ``state_dict`` holds this rank's share of the state.
    """

    def __init__(self, params, optimizer_class: type | None = None, group=None, stage: int = 1, make=None,
                 **defaults):
        self.group = group if group is not None else dist.group.WORLD
        self.stage = stage
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)  # the share this rank holds
        self.parts: list[FlatShards] = []
        self.part_group: list[int] = []  # for each part, the index of its parameter group
        self.reduced = False
        super().__init__(params, defaults)  # calls add_param_group once a group
        local = [{**self._settings(self.param_groups[g]), "params": [part.local]}
                 for part, g in zip(self.parts, self.part_group)]
        self.inner = make(local) if make is not None else optimizer_class(local)

    @staticmethod
    def _settings(group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        by_replicas = {}
        for p in self.param_groups[-1]["params"]:
            replicas = replica_group(p, self.group)
            comm.broadcast(p.data, src=dist.get_global_rank(replicas, 0), group=replicas, name="broadcast weights")
            if p.requires_grad:
                by_replicas.setdefault(id(replicas), (replicas, []))[1].append(p)
        for replicas, params in by_replicas.values():
            self.parts.append(FlatShards(params, replicas))
            self.part_group.append(len(self.param_groups) - 1)
            if hasattr(self, "inner"):  # a group added after construction
                self.inner.add_param_group({**self._settings(self.param_groups[-1]), "params": [self.parts[-1].local]})

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average every gradient over the group into this rank's shards (stage 1: the whole flat gradient too)."""
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
            part.local.grad /= self.size  # the mean over every rank's tokens, experts' included
        self.reduced = True

    def shard_gradients(self) -> list[torch.Tensor]:
        """The averaged gradients of this rank's shards (what the step reads; a loss scaler unscales them)."""
        return [part.local.grad for part in self.parts]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradients so that their total 2-norm is at most ``max_norm``; return the norm before
        clipping. Each element lives in exactly one rank's shard, so the squares summed over the group are the
        norm's square (an expert's shard over all of the group too: other ranks hold other experts)."""
        if not self.reduced:
            self.reduce_gradients()
        squares = sum((g.double().pow(2).sum() for g in self.shard_gradients()), torch.zeros((), dtype=torch.float64))
        comm.all_reduce(squares, group=self.group, name="all_reduce gradient norm")
        norm = squares.sqrt().to(torch.float32)
        for g in self.shard_gradients():
            g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    @torch.no_grad()
    def step_shards(self) -> None:
        """The inner optimizer's step on this rank's shards, each with its group's current settings. On one device
        the optimizer skips a parameter without a gradient; inside the shard it cannot (weight decay would still
        shrink it), so those values are put back after the step (in the fp32 master weights too, if any)."""
        if not self.reduced:
            self.reduce_gradients()
        inner_groups = getattr(self.inner, "param_groups", [])
        for local, g in zip(inner_groups, self.part_group):
            local.update(self._settings(self.param_groups[g]))  # what a scheduler set
        kept = [part.untouched() for part in self.parts]
        self.inner.step()
        masters = getattr(self.inner, "masters", [None] * len(self.parts))
        for part, master, values_kept in zip(self.parts, masters, kept):
            for start, values in values_kept:
                part.local[start:start + len(values)] = values
                if master is not None:
                    master[start:start + len(values)] = values

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every rank's updated shard to every rank: the flat buffers, and so the parameters, whole again."""
        for part in self.parts:
            # The all-gather's input must not alias its output, so send a copy of our shard.
            comm.all_gather_into_tensor(part.flat, part.local.detach().clone(), group=part.group,
                                        name="all_gather weights")

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_shards()
        self.gather_weights()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.full_grad = None
            part.local.grad = None
            for p in part.params:
                p.grad = None
        self.reduced = False

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shards'; fp32 master weights included)."""
        return self.inner.state_bytes() if hasattr(self.inner, "state_bytes") else optimizer_state_bytes(self.inner)

    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank holds at the step: the whole flat gradient (stage 1) or its shard (2)."""
        return tensor_bytes([part.full_grad if part.full_grad is not None else part.local.grad
                             for part in self.parts])


class ZeroScratch(Trainer):
    """ZeRO stage 1 or 2 over the data-parallel ``group``, from scratch: the course's trainer around a
    :class:`FlatShardedOptimizer`, with the trainer's optimizer (the course's AdamW, fp32 master weights in half
    precision) stepping the shards."""

    def __init__(self, model, group, stage: int = 1, **options):
        self.group, self.stage = group, stage
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        super().__init__(model, **options)
        parts = self.optimizer.parts
        self.extras["zero"] = {"stage": stage, "num_params": parts[0].numel, "shard_size": parts[0].shard_size}
        if len(parts) > 1:
            self.extras["zero"]["expert_shards"] = [{"num_params": part.numel, "shard_size": part.shard_size}
                                                    for part in parts[1:]]

    def make_optimizer(self, lr):
        return FlatShardedOptimizer(self.model.parameters(), group=self.group, stage=self.stage,
                                    make=lambda groups: self.optimizer_for([g["params"][0] for g in groups], lr))

    def gradients(self):
        return self.optimizer.shard_gradients()

    def sync_gradients(self) -> None:
        self.optimizer.reduce_gradients()

    def optimizer_step(self) -> None:
        with self.rec.span("optimizer"):
            self.optimizer.step_shards()
        self.optimizer.gather_weights()
        self.measure_memory()
        self.optimizer.zero_grad(set_to_none=True)

    def weight_bytes(self) -> int:
        return tensor_bytes([part.flat for part in self.optimizer.parts])

    def gradient_bytes(self) -> int:
        return self.optimizer.gradient_bytes()

    def torch_optimizer(self):
        inner = self.optimizer.inner
        return inner.inner if isinstance(inner, MasterWeightsAdamW) else inner

    def _shards(self, part: FlatShards) -> list:
        names = self.parameter_names()
        return [(part.local, [(names[p], offset, n, p.shape) for p, (offset, n) in zip(part.params, part.slices)])]

    def optimizer_state(self) -> dict:
        state = {}
        for part in self.optimizer.parts:
            state.update(sharded_optimizer_state(self.optimizer.inner, self._shards(part), part.group))
        return state

    def load_optimizer_state(self, state: dict) -> None:
        for part in self.optimizer.parts:
            load_sharded_optimizer_state(self.optimizer.inner, self._shards(part), state, part.group)
