"""A deliberately awkward model and rank functions that train it with each strategy.

Tied weights (one Parameter used twice), a frozen layer, a parameter that never
receives a gradient, and a parameter whose size no dp divides: the cases where
hand-written data parallelism and ZeRO usually go wrong.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpucourse.runtime import current

VOCAB, WIDTH = 16, 8


class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.emb.weight            # tied: one Parameter, two uses
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)           # frozen: must never change
        self.unused = nn.Parameter(torch.randn(5))  # no gradient ever
        self.odd = nn.Parameter(torch.randn(7))     # 7 elements: uneven shards

    def forward(self, idx):
        h = self.frozen(self.emb(idx)) * self.odd.mean()
        return self.out(torch.tanh(h))


def make_model() -> Awkward:
    torch.manual_seed(0)
    return Awkward()


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (12, 5), generator=g)
    return x, (x * 3 + 1) % VOCAB


# A learner's own optimizers: any torch.optim.Optimizer class with its keyword arguments.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"betas": (0.9, 0.99), "weight_decay": 0.1}),
}


def train_each(strategies: list[str], optimizers: list[str], steps: int = 4) -> dict:
    """Every strategy with every optimizer, in one launch: ``{"strategy optimizer": final weights}``."""
    return {f"{s} {o}": train(s, steps, optimizer=o) for s in strategies for o in optimizers}


def train(strategy: str, steps: int = 4, optimizer: str | None = None, **kw) -> dict:
    """Train the awkward model with ``strategy`` on this rank's share; return the final weights.

    No Recorder is given: a strategy records nothing unless asked. ``optimizer``
    names one of :data:`OPTIMIZERS` (the course's AdamW when None).
    """
    import torch.distributed as dist

    from gpucourse.parallel.data_parallel import DataParallelScratch
    from gpucourse.parallel.data_parallel_buckets import BucketedDataParallel
    from gpucourse.parallel.single import Trainer
    from gpucourse.parallel.zero import ZeroScratch
    from gpucourse.parallel.zero3 import Zero3Scratch

    model = make_model()
    rank, world = (current().rank, dist.get_world_size()) if dist.is_initialized() else (0, 1)
    group = dist.group.WORLD if dist.is_initialized() else None
    opt = {}
    if optimizer is not None:
        opt = {"optimizer_class": OPTIMIZERS[optimizer][0], "optimizer_kwargs": OPTIMIZERS[optimizer][1]}
    trainer = {
        "single": lambda: Trainer(model, lr=0.05, **opt),
        "dp": lambda: DataParallelScratch(model, group, lr=0.05, **opt),
        "buckets": lambda: BucketedDataParallel(model, group, bucket_mb=kw.get("bucket_mb", 1e-4), lr=0.05, **opt),
        "zero1": lambda: ZeroScratch(model, group, stage=1, lr=0.05, **opt),
        "zero2": lambda: ZeroScratch(model, group, stage=2, lr=0.05, **opt),
        "zero3": lambda: Zero3Scratch(model, group, lr=0.05, **opt),
    }[strategy]()
    for step in range(steps):
        x, y = batch(step)
        rows = x.shape[0] // world
        trainer.step(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
    return {k: v.clone() for k, v in trainer.local_state_dict().items()}  # ZeRO-3 gathers its shards for this
