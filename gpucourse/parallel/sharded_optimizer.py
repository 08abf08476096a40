"""ZeRO stages 1 and 2 as optimizers that shard by whole parameters (``zero.py``'s ``FlatShardedOptimizer``, which
the course's trainer uses, cuts flat buffers into equal shards instead).

Stage 1, sharding the optimizer state, needs nothing from the loop but gradients that are already the same on
every rank: each rank owns some whole parameters, steps only those with its own optimizer (so it keeps only their
state), and broadcasts their new values to the others.

Stage 2 shards the gradients too, so it takes over their averaging (no data-parallel wrapper around the model):
as soon as backward has a parameter's gradient, it is reduced to the rank that owns the parameter and freed on
every rank, so during backward a rank holds its own share of the gradients and the few on their way. A rank
can then no longer clip gradients alone — the norm is everyone's — so the optimizer does it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..measure import optimizer_state_bytes


class RankShare:
    """``state_dict`` and ``load_state_dict`` of a sharded optimizer: its ``inner`` optimizer holds this rank's share
    of the state (rank ``rank`` of ``size``), saved beside every parameter group's settings; each rank loads its
    own."""

    def state_dict(self) -> dict:
        return {"rank": self.rank, "size": self.size, "inner": self.inner.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        if (state_dict["rank"], state_dict["size"]) != (self.rank, self.size):
            raise ValueError(f"this state is rank {state_dict['rank']} of {state_dict['size']}'s share; this is rank "
                             f"{self.rank} of {self.size}: load each rank's own.")
        self.inner.load_state_dict(state_dict["inner"])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)


class ShardedOptimizer(RankShare, torch.optim.Optimizer):
    """ZeRO stage 1 as an optimizer for any loop: the optimizer state sharded by whole parameters over ``group``.

        ddp = DataParallel(model)                                  # the gradients averaged on every rank
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        ... loss.backward(); ddp.finish_gradient_synchronization(); opt.step(); sched.step()

    Each parameter belongs to one rank, handed out greedily to the rank holding the fewest elements so far (in
    the order given, group by group); that rank's ``optimizer_class`` steps it, with the group's settings as they
    are at the step (a scheduler's learning rate included), and then broadcasts the new values. So each rank keeps
    1/dp of the optimizer state, and every rank ends the step with the same weights. Parameter groups,
    ``add_param_group``, ``zero_grad`` and learning-rate schedulers work as on any optimizer; ``state_dict`` holds
    this rank's share of the state (save one per rank, as a distributed checkpoint does).
    """

    def __init__(self, params, optimizer_class: type, group=None, **defaults):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.optimizer_class, self.inner = optimizer_class, None
        self.owner: dict = {}                 # parameter -> the group rank that steps it
        self.held = [0] * self.size           # elements each rank owns so far
        super().__init__(params, defaults)    # calls add_param_group once a group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            rank = min(range(self.size), key=lambda r: (self.held[r], r))
            self.held[rank] += p.numel()
            self.owner[p] = rank
            if rank == self.rank:
                mine.append(p)
        local = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.inner is None:
            self.inner = self.optimizer_class([local])
        else:
            self.inner.add_param_group(local)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, local in zip(self.param_groups, self.inner.param_groups):
            local.update({k: v for k, v in outer.items() if k != "params"})  # what a scheduler set
        self.inner.step()
        for p, rank in self.owner.items():
            comm.broadcast(p.data, src=dist.get_global_rank(self.group, rank), group=self.group,
                           name="broadcast updated parameter")
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its share)."""
        return optimizer_state_bytes(self.inner)


class ShardedGradientsOptimizer(ShardedOptimizer):
    """ZeRO stage 2 as an optimizer for any loop: the optimizer state *and the gradients* sharded over ``group``.

        opt = ShardedGradientsOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)  # no DataParallel wrapper
        ... loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); sched.step()

    Every rank starts from group rank 0's weights (copied here). Each backward reduces every gradient to its owner
    the moment it is complete (a hook on the parameter) and frees it, so ``p.grad`` stays None between backward
    and step; the owner adds it to its share of the gradients (several backwards accumulate, as
    ``loss.backward()`` twice would) and steps with the average. The reduce costs what a reduce-scatter of the same
    gradients would: each byte crosses each link once. ``clip_grad_norm_`` clips as
    ``torch.nn.utils.clip_grad_norm_`` would on the averaged gradients, with the norm summed over the ranks.
    """

    def __init__(self, params, optimizer_class: type, group=None, **defaults):
        self.summed: dict = {}  # parameter -> the sum of every rank's gradients, on its owner only
        self.hooks: list = []
        super().__init__(params, optimizer_class, group, **defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            comm.broadcast(p.data, src=dist.get_global_rank(self.group, 0), group=self.group,
                           name="broadcast initial parameter")
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._reduce_to_owner))

    @torch.no_grad()
    def _reduce_to_owner(self, p: torch.Tensor) -> None:
        owner = self.owner[p]
        comm.reduce(p.grad, dst=dist.get_global_rank(self.group, owner), group=self.group, name="reduce gradient")
        if owner == self.rank:
            self.summed[p] = p.grad if p not in self.summed else self.summed[p].add_(p.grad)
        p.grad = None  # on every rank: the next backward starts this gradient from zero again

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradients so that their total 2-norm, over every rank's share, is at most
        ``max_norm``; return the norm before clipping (as ``torch.nn.utils.clip_grad_norm_``)."""
        squares = torch.zeros((), dtype=torch.float64)
        for g in self.summed.values():
            squares += (g.double() / self.size).pow(2).sum()
        comm.all_reduce(squares, group=self.group, name="all_reduce gradient norm")
        norm = squares.sqrt().to(torch.float32)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in self.summed.values():
            g.mul_(scale)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # its backward reduces its gradients here like any other
            with torch.enable_grad():
                loss = closure()
        for p, g in self.summed.items():  # this rank's share, averaged, where the inner optimizer looks for it
            p.grad = g.div_(self.size)
        self.summed = {}
        super().step()
        for p in self.owner:
            p.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.summed = {}
        super().zero_grad(set_to_none)

    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank holds between backward and step (its share)."""
        return sum(g.numel() * g.element_size() for g in self.summed.values())
