"""ZeRO stage 1 as an optimizer, for a training loop that is not the course's (``zero.py`` has the stages inside
the course's trainer, on one flat buffer).

Sharding the optimizer state needs nothing from the loop but gradients that are already the same on every rank:
each rank owns some whole parameters, steps only those with its own optimizer (so it keeps only their state),
and broadcasts their new values to the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..measure import optimizer_state_bytes


class ShardedOptimizer(torch.optim.Optimizer):
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

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its share)."""
        return optimizer_state_bytes(self.inner)
