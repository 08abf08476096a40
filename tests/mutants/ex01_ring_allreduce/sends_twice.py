"""Wrong answer for ex01: the ring, with every chunk sent twice (the second copy received and thrown away). The sum
is right, to the right rank, in the ring's order; the bytes on the wire are twice the ring's."""

import torch
import torch.distributed as dist


def _pass_on(chunk: torch.Tensor, into: torch.Tensor, right: int, left: int) -> None:
    for _ in range(2):
        pending = dist.isend(chunk, right)
        dist.recv(into, left)
        pending.wait()


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks, as a new tensor of the same shape and dtype."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = tensor.detach().clone().reshape(-1)
    chunks = list(result.tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send, recv = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv])
        _pass_on(chunks[send], incoming, right, left)
        chunks[recv] += incoming
    for step in range(world - 1):
        send, recv = (rank - step + 1) % world, (rank - step) % world
        _pass_on(chunks[send], chunks[recv], right, left)
    return result.view(tensor.shape)
