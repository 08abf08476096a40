"""Exercise 4: a ZeRO stage-1 optimizer step.

Taught in notebooks/03_zero_fsdp.ipynb; check your work with
``from gpucourse import check; check("ex04")`` or ``gpucourse grade ex04``.
Compare with the reference, gpucourse/parallel/zero.py, once yours passes.

Adam keeps two numbers per parameter (8 bytes in fp32), and plain data
parallelism keeps them on every rank. ZeRO stage 1 cuts them into shards:

``shard_bounds(numel, world_size, rank)``
    Think of all parameters laid end to end in one flat buffer of ``numel``
    elements, padded up to a multiple of ``world_size`` and cut into equal
    shards of ``ceil(numel / world_size)``. Return ``(start, end)``, the part of
    the *real* (unpadded) elements rank owns: ``start`` is ``rank * shard``
    and ``end`` is ``start + shard``, both kept at most ``numel``; so the last
    shards may be shorter, or empty.

``ZeroOneAdam(params, lr)``
    ``params`` as ``torch.optim`` takes them: a list, or ``model.parameters()``,
    a generator that can be read only once. On construction, each rank takes a
    copy of its shard of the flattened parameters and makes
    ``self.optimizer``, a ``torch.optim.Adam(..., lr=lr)``
    over that copy only: Adam's state then exists for 1/n of the parameters.
    ``step()`` is called when every ``p.grad`` already holds the gradient
    averaged over the ranks (the same on every rank): take this rank's part of
    the flattened gradient, let Adam update the shard, then all-gather every
    rank's updated shard and copy the result into every parameter, so that
    every rank ends with the same weights one Adam step on one device would give.

Besides the weights, the grader holds ``ZeroOneAdam.step`` to the contract every
caller of an optimizer relies on (a broken promise fails its own check, in one
line naming it):

- *inputs unchanged*: the gradients it reads come back bit for bit (zeroing
  them is the training loop's job);
- *any strides*: a parameter may be a view (a transposed matrix);
- *keeps the dtype*: a float64 model is stepped in float64 (a buffer made
  without ``dtype=`` is float32, and rounds the weights that pass through it).
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of rank's shard of a flat buffer of ``numel`` elements cut into padded equal shards."""
    raise NotImplementedError("shard_bounds")


class ZeroOneAdam:
    """Adam whose state covers only this rank's shard of ``params`` (ZeRO stage 1)."""

    def __init__(self, params, lr: float = 1e-2):
        raise NotImplementedError("ZeroOneAdam.__init__")

    def step(self) -> None:
        """Update this rank's shard with Adam, then all-gather so that every rank holds every updated weight."""
        raise NotImplementedError("ZeroOneAdam.step")
