"""Wrong answer for ex06: the row-parallel g sums the partial outputs in float32 and returns them so: right
for a float32 layer, but a bf16 layer's output comes back float32."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class CopyToParallel(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over ranks (each rank holds a part of it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # autograd may hand the same buffer to others
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """g: forward sums the partial outputs over ranks; backward is the identity (every rank needs all of it)."""

    @staticmethod
    def forward(ctx, x):
        x = x.float()  # the sum in float32, the more accurate
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _rank_world():
    return dist.get_rank(), dist.get_world_size()


class ColumnParallelLinear(nn.Module):
    """This rank's slice of ``full``'s output features; takes the whole input, returns its slice of the output."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        rank, world = _rank_world()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=0)[rank].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().chunk(world, dim=0)[rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToParallel.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of ``full``'s input features; takes its slice of the input, returns the whole output."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        rank, world = _rank_world()
        self.weight = nn.Parameter(full.weight.detach().chunk(world, dim=1)[rank].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromParallel.apply(F.linear(x, self.weight))
        # After the sum, once: added to each partial product it would be counted world_size times.
        return y if self.bias is None else y + self.bias
