"""Exercise 10: fix a hanging trainer — solved.

Taught in notebooks/09_troubleshooting.ipynb. The shipped loop logged each
rank's own loss and stopped on it: a rank whose shard was easy left the loop
while the others went on into the next step's gradient all-reduce, and waited
there for it forever. The fix makes the stopping decision on a value every rank
shares, the global batch's loss (an all-reduce of the ranks' losses, divided
by their number), so every rank stops at the same step, the one where a single
device training on the whole batch would stop.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def average_gradients(model: nn.Module) -> None:
    """Replace every parameter's gradient by its mean over the ranks."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def train(model: nn.Module, batches: list, lr: float, target_loss: float) -> list[float]:
    """Data-parallel SGD on this rank's shards until the global batch's loss is below ``target_loss``.

    Returns the logged loss of every step it ran.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    logged = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        average_gradients(model)
        optimizer.step()
        # Every rank must leave the loop at the same step: decide on the global loss, which all ranks share.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        logged.append(global_loss.item() / dist.get_world_size())
        if logged[-1] < target_loss:  # good enough: stop early
            break
    return logged


def demo(target_loss: float = 2.5, steps: int = 10) -> list[float]:
    """Train a small linear regression with ``train`` on this rank (start it with ``launch``)."""
    from gpucourse import current

    rank, world, device = dist.get_rank(), dist.get_world_size(), current().device
    g = torch.Generator().manual_seed(4)  # the same weights and data on every rank
    true_weight = torch.randn(1, 3, generator=g) * 1.5
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 3, generator=g) * 0.3)
        model.bias.zero_()
    rows = slice(rank * 24 // world, (rank + 1) * 24 // world)  # this rank's shard of each batch of 24
    batches = []
    for _ in range(steps):
        x = torch.randn(24, 3, generator=g)
        y = x @ true_weight.T
        y[12:] += 2.0 * torch.randn(12, 1, generator=g)  # the second half of the data has noisy labels
        batches.append((x[rows].to(device), y[rows].to(device)))
    logged = train(model.to(device), batches, lr=0.1, target_loss=target_loss)
    if rank == 0:
        print(f"{len(logged)} steps, logged losses: {', '.join(f'{v:.3f}' for v in logged)}")
    return logged


if __name__ == "__main__":
    from gpucourse import launch

    launch(demo, world_size=2, timeout=10)
