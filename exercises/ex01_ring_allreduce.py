"""Exercise 1: ring all-reduce from point-to-point messages.

Taught in notebooks/01_collectives.ipynb; check your work with
``from gpucourse import check; check("ex01")`` or ``gpucourse grade ex01``.

Write ``ring_all_reduce(tensor)``. Every rank calls it with its own tensor
(same shape and dtype on every rank) and gets back a **new** tensor holding the
element-wise sum over all ranks of the default process group; ``tensor`` itself
must not change. Use point-to-point messages only — ``dist.send``,
``dist.recv``, ``dist.isend``, ``dist.irecv`` — no collective
(``dist.all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast`` … are
switched off while grading). It must work for any world size from 1, any shape,
and any number of elements, also one that the world size does not divide, or
fewer elements than ranks; the result keeps the input's dtype (bf16 too).

The ring algorithm: cut the flat tensor into world_size chunks; in a first
phase of world_size - 1 steps each rank sends one chunk to rank + 1, receives
one from rank - 1 and adds it (a reduce-scatter: each rank ends up with the
finished sum of one chunk); in a second phase of world_size - 1 steps the
finished chunks travel round the ring (an all-gather). Every rank sends
2 (n - 1) / n times the tensor's size, whatever n is: that is why NCCL uses it.

Besides the sum, the grader holds ``ring_all_reduce`` to the contract every
caller relies on (a broken promise fails its own check, in one line naming it):

- *a new tensor*: the result shares no memory with ``tensor`` (1 rank too);
- *inputs unchanged*: ``tensor`` comes back bit for bit as it was;
- *keeps the dtype*: bf16 in, bf16 out; float64 in, float64 out;
- *any strides*: ``tensor`` may be a view (a transposed matrix).
"""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks, as a new tensor of the same shape and dtype."""
    raise NotImplementedError("ring_all_reduce")
