"""Wrong answer for ex01: it flattens its copy with .view(-1), which refuses a tensor whose strides are not
contiguous (a transposed matrix): right on every contiguous input, an error on a view."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks, as a new tensor of the same shape and dtype."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = tensor.detach().clone().view(-1)
    # n chunks whose sizes differ by at most one (some empty if there are fewer elements than ranks);
    # each is a view into result, so finishing a chunk finishes that part of the answer.
    chunks = list(result.tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world

    # Reduce-scatter: at step k, pass chunk rank-k on and add the incoming chunk rank-k-1.
    # After n-1 steps this rank holds the complete sum of chunk rank+1.
    for step in range(world - 1):
        send, recv = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv])
        # isend, not send: if every rank blocked in a send to its right, nobody would be receiving.
        pending = dist.isend(chunks[send], right)
        dist.recv(incoming, left)
        pending.wait()
        chunks[recv] += incoming

    # All-gather: pass the finished chunks round the ring, each overwriting the stale copy.
    for step in range(world - 1):
        send, recv = (rank - step + 1) % world, (rank - step) % world
        pending = dist.isend(chunks[send], right)
        dist.recv(chunks[recv], left)
        pending.wait()
    return result.view(tensor.shape)
