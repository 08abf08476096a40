"""The optimizer every layout uses: AdamW with one recipe, and its fp32 master-weights form.

Every layout must reproduce the single-device run, so every layout builds the
same optimizer from here. Strategies that shard the optimizer (ZeRO) or keep
master weights call :func:`make_optimizer` on the tensors they own.
"""

from __future__ import annotations

import torch

from .measure import optimizer_state_bytes, tensor_bytes

ADAMW = {"betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.0}


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW, the same settings in every layout (so every layout can be compared).

    ``eps=1e-6`` rather than 1e-8: Adam divides by the root of the squared
    gradient, so a parameter whose gradient is almost zero (a neuron GELU has
    switched off) would otherwise turn float rounding into a full-size update,
    and two equal layouts would drift apart in exactly those weights.
    """
    return torch.optim.AdamW(params, lr=lr, **ADAMW)


class MasterWeightsAdamW:
    """AdamW (or the optimizer ``make`` builds) on fp32 master copies of half-precision parameters.

    See ``parallel/precision.py`` for why: the update is computed and kept in
    fp32, and only its rounded result is written back to the model.
    """

    def __init__(self, params, lr: float, make=make_optimizer):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = make(self.masters, lr)

    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.copy_(master)  # round the updated master back to half precision

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.params + self.masters:
            t.grad = None

    def state_bytes(self) -> int:
        """Optimizer memory: the fp32 masters plus Adam's two moments."""
        return tensor_bytes(self.masters) + optimizer_state_bytes(self.inner)


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a fresh ``optimizer`` its state (zeros), without changing any parameter.

    A checkpoint is loaded *into* tensors, so a freshly built optimizer needs its
    moments to exist first: one step with zero gradients and a learning rate of 0
    makes them (torch.distributed.checkpoint's own ``get_optimizer_state_dict``
    does the same). The loaded values replace them all. An optimizer that has
    state already is left as it is.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is None]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None
