"""Probes of exercise 3: build the model a check describes, bucket it, and train it through the learner's sync.

Nothing here knows the right answer: the probes report the buckets, the
gradients after each ``finish()``, and when each gradient came into being (the
same clock as the records of the collectives), and the check judges them.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from ..sandbox import elapsed


def build_model(spec: dict) -> nn.Sequential:
    """Linear layers of ``spec["widths"]`` with tanh between them, holding ``spec["weights"]`` (name -> tensor, in
    their dtype); the parameters named in ``spec["frozen"]`` have requires_grad False."""
    widths = spec["widths"]
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(widths[i], widths[i + 1]))
    model = nn.Sequential(*layers).to(spec["weights"]["0.weight"].dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(spec["weights"][name])
            p.requires_grad_(name not in spec["frozen"])
    return model


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).mean()


class Drawn(nn.Module):
    """Parameters of drawn shapes and dtypes, named p0, p1, ...: the model of a drawn case. A matrix may be stored
    transposed (column-major, as a weight converted from an (in, out) checkpoint is): autograd then makes its
    gradient with the same strides."""

    def __init__(self, weights: list, frozen: list | tuple = (), transposed: bool = False):
        super().__init__()
        for i, w in enumerate(weights):
            kept = w.t().contiguous().t() if transposed and w.dim() == 2 else w.clone()
            self.register_parameter(f"p{i}", nn.Parameter(kept, requires_grad=i not in frozen))


def drawn_loss(model: Drawn, xs: list) -> torch.Tensor:
    """The sum over the parameters of ``tanh(p * x)``, with this rank's ``xs`` (one tensor per parameter)."""
    return sum((torch.tanh(p * x)).sum() for p, x in zip(model.parameters(), xs))


def buckets_drawn(learner, weights: list, frozen: list, caps: list) -> list:
    """What ``assign_buckets`` returns for a :class:`Drawn` model, for each cap."""
    model = Drawn(weights, frozen)
    return [learner.assign_buckets(model, cap) for cap in caps]


def train_drawn(learner, weights: list, transposed: bool, cap: int, steps: list) -> list:
    """A ``BucketedGradientSync`` on a :class:`Drawn` model; for each step's ``xs``: clear the gradients, backward of
    :func:`drawn_loss`, ``finish()``. Every parameter's gradient after each step."""
    model = Drawn(weights, (), transposed)
    sync = learner.BucketedGradientSync(model, cap)
    out = []
    for xs in steps:
        model.zero_grad(set_to_none=True)
        drawn_loss(model, xs).backward()
        sync.finish()
        out.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def buckets(learner, spec: dict, caps: list) -> list:
    """What ``assign_buckets`` returns for the model of ``spec``, for each cap."""
    model = build_model(spec)
    return [learner.assign_buckets(model, cap) for cap in caps]


def train(learner, spec: dict, cap: int, inputs: list, hold_s: float = 0.0) -> dict:
    """Build a ``BucketedGradientSync`` on the model of ``spec``; for each batch in ``inputs``: clear the
    gradients, backward, ``finish()``. Reports the sync's buckets and, for each step, when it began, when
    each trainable parameter's gradient was computed (the first hook on it, registered before the
    learner's) and accumulated, when backward returned and when finish() returned, and every gradient
    afterwards. With ``hold_s``, this rank pauses that long when its first gradient of the first step has
    been computed, before the learner's hooks see it (so that another rank waiting for an all-reduce
    with this one shows it)."""
    model = build_model(spec)
    computed: dict[str, float] = {}
    ready: dict[str, float] = {}
    held = [not hold_s]

    def on_computed(name: str) -> None:
        if not held[0]:
            held[0] = True
            time.sleep(hold_s)
        computed[name] = elapsed()

    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad, name=name: on_computed(name))
            p.register_post_accumulate_grad_hook(lambda _, name=name: ready.__setitem__(name, elapsed()))
    sync = learner.BucketedGradientSync(model, cap)
    steps = []
    for x in inputs:
        computed.clear()
        ready.clear()
        model.zero_grad(set_to_none=True)
        start = elapsed()
        loss = loss_of(model, x)
        loss.backward()
        backward_end = elapsed()
        sync.finish()
        steps.append({"start": start, "computed": dict(computed), "ready": dict(ready),
                      "backward_end": backward_end, "finish_end": elapsed(),
                      "grads": {n: None if p.grad is None else p.grad.detach().clone()
                                for n, p in model.named_parameters()}})
    return {"buckets": getattr(sync, "buckets", None), "steps": steps}
