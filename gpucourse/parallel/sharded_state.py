"""Checkpoints of a sharded optimizer: a flat shard's state, saved as every parameter's own.

A checkpoint names optimizer state by parameter ("blocks.0.ln1.weight.exp_avg"), whole, so that any layout can
load it. A rank's flat shard (ZeRO 1 and 2 in ``zero.py``, ZeRO-3's units in ``zero3.py``) holds pieces of several
parameters, cut wherever the shard boundary falls; saving all-gathers each field over dp and cuts it per parameter
(every dp rank then briefly holds its stage's whole moments; DCP writes each once); loading cuts this rank's shard
back out of the parameters' tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..optim import MasterWeightsAdamW, init_state


def _fields(optimizer, shard: torch.Tensor) -> dict:
    """The state ``optimizer`` keeps for ``shard`` by field (``exp_avg``, ``exp_avg_sq``, ``step``; ``master`` with
    fp32 master weights): ``optimizer`` is a torch optimizer, or the course's :class:`MasterWeightsAdamW`."""
    inner = optimizer.inner if isinstance(optimizer, MasterWeightsAdamW) else optimizer
    init_state(inner)  # fresh (about to load): make the tensors a load fills in
    if isinstance(optimizer, MasterWeightsAdamW):
        master = dict(zip(map(id, optimizer.params), optimizer.masters))[id(shard)]
        return {**inner.state[master], "master": master}
    return dict(inner.state[shard])


def sharded_optimizer_state(optimizer, shards, group) -> dict:
    """``{"name.field": tensor}`` of every parameter in ``shards``, from the ``optimizer`` that steps them.

    ``shards``: ``[(flat shard, [(name, offset, numel, shape)])]``.
    """
    dp, state = dist.get_world_size(group), {}
    for shard, entries in shards:
        for field, value in _fields(optimizer, shard).items():
            if value.dim() == 0:  # Adam's step count: one for the whole shard
                state.update({f"{name}.{field}": value.clone() for name, *_ in entries})
                continue
            whole = torch.empty(value.numel() * dp, dtype=value.dtype, device=value.device)
            comm.all_gather_flat(whole, value.detach().contiguous(), group=group)
            state.update({f"{name}.{field}": whole[offset:offset + n].view(shape)
                          for name, offset, n, shape in entries})
    return state


def load_sharded_optimizer_state(optimizer, shards, state: dict, group) -> None:
    """The reverse of :func:`sharded_optimizer_state`: this rank's shard of each field, cut from the parameters'."""
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    for shard, entries in shards:
        for field, target in _fields(optimizer, shard).items():
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
