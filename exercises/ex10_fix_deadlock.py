"""Exercise 10: fix a hanging trainer.

Taught in notebooks/09_troubleshooting.ipynb; check your work with
``from gpucourse import check; check("ex10")`` or ``gpucourse grade ex10``.

This file is not a stub: ``train`` below is a whole data-parallel training loop,
it runs, and on two or more ranks it hangs. See it happen first::

    python exercises/ex10_fix_deadlock.py

or, in a notebook, ``launch(ex10.demo, world_size=2, timeout=10)`` with the
module loaded from this file. After 10 s the launcher stops every rank and
raises a ``LaunchTimeout`` that says, for each rank, whether it finished, which
collective it is waiting in (``#7 all_reduce(float32[1,3])``: the 7th
collective this rank called, its tensor's dtype and shape) and the last one it
finished. Read it the way ``gpucourse troubleshoot desync`` does: which rank is
where, and why would the ranks disagree about the next collective? Then find
the line of ``train`` that lets them, and fix it.

What ``train(model, batches, lr, target_loss)`` must do:

- Every rank holds the same ``model``. ``batches`` is this rank's shard of
  each global batch: its own rows, as many on every rank.
- Each step: forward, mean squared error, backward, gradients averaged over
  the ranks (``average_gradients``, which is right as it is), SGD step.
- After each step, log the loss of the *global* batch — the mean over the
  ranks of their shards' losses, which is what one device training on the whole
  batch would see — and stop as soon as that loss is below ``target_loss``.
- Return the logged losses: the same list on every rank, and the same as one
  device training on the whole batches, step for step; the weights end the same
  as that device's too.

The rule behind every hang of this kind: all ranks must call the same
collectives, in the same order. Anything that decides whether a rank makes a
collective — a ``break``, an ``if``, a ``return`` — must come out the same on
every rank.
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
        logged.append(loss.item())
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
