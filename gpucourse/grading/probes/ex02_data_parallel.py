"""Probes of exercise 2: build the awkward model from the weights a check sent, run the learner's code on it.

Nothing here knows the right answer: each probe reports the gradients, weights,
inputs seen and collectives' timing it observed, and the check judges them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..sandbox import elapsed


class Net(nn.Module):
    """A small awkward model: two layers, a frozen parameter and one the forward never uses.

    It records each input its forward sees, so that a check can tell which rows a rank trained on.
    """

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(7), requires_grad=False)  # frozen
        self.unused = nn.Parameter(torch.zeros(2))                      # never in the forward
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return self.fc2(torch.tanh(self.fc1(x) * self.scale))


def build_net(weights: dict) -> Net:
    """A :class:`Net` holding ``weights`` (name -> tensor), in their dtype."""
    model = Net().to(weights["fc1.weight"].dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model


def _state(model: Net) -> dict:
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}}


def average(learner, weights: dict, grads: dict) -> dict:
    """Give the model the gradients ``grads`` (name -> tensor; the others stay None), call
    ``average_gradients`` on it; every parameter's weight and gradient afterwards."""
    model = build_net(weights)
    for name, p in model.named_parameters():
        if name in grads:
            p.grad = grads[name].clone()
    learner.average_gradients(model)
    return _state(model)


class Drawn(nn.Module):
    """Parameters of drawn shapes and one dtype, named p0, p1, ...: the model of a drawn case."""

    def __init__(self, weights: list, transposed: bool):
        super().__init__()
        for i, w in enumerate(weights):
            # A matrix stored transposed (column-major, as a weight converted from a (in, out) checkpoint is): its
            # gradient has the same strides, as autograd gives it.
            kept = w.t().contiguous().t() if transposed and w.dim() == 2 else w.clone()
            self.register_parameter(f"p{i}", nn.Parameter(kept))


def average_drawn(learner, weights: list, grads: list, transposed: bool) -> dict:
    """``average_gradients`` on a :class:`Drawn` model whose parameter i holds ``grads[i]`` (None: no gradient),
    laid out like the parameter; every parameter's weight and gradient afterwards."""
    model = Drawn(weights, transposed)
    for p, g in zip(model.parameters(), grads):
        if g is not None:
            p.grad = torch.empty_like(p).copy_(g)
    learner.average_gradients(model)
    return _state(model)


def make_optimizer(model: Net, lr: float, spec: dict | None = None) -> torch.optim.Optimizer:
    """Plain SGD at ``lr``; or as ``spec`` says: ``{"kind": "SGD" | "SGD with Nesterov momentum" | "Adam", "groups": 1
    or 2}``, two groups putting fc1's parameters at ``lr`` and the others at ``lr / 5``."""
    spec = spec or {"kind": "SGD", "groups": 1}
    named = list(model.named_parameters())
    groups = ([{"params": [p for _, p in named]}] if spec["groups"] == 1 else
              [{"params": [p for n, p in named if n.startswith("fc1")]},
               {"params": [p for n, p in named if not n.startswith("fc1")], "lr": lr / 5}])
    if spec["kind"] == "Adam":
        return torch.optim.Adam(groups, lr=lr)
    if spec["kind"] == "SGD with Nesterov momentum":  # its first step differs from plain SGD's, as momentum's does not
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    return torch.optim.SGD(groups, lr=lr)


def step(learner, inputs: torch.Tensor, targets: torch.Tensor, weights: dict, stale: dict, lr: float,
         optimizer: dict | None = None) -> dict:
    """One ``data_parallel_step`` with the mean squared error and plain SGD (or the optimizer ``optimizer`` describes,
    see :func:`make_optimizer`), on a model whose gradients hold ``stale`` (left from "an earlier step"), given
    ``inputs`` and ``targets`` as they came (views stay views).
    What the model's forward saw, the weights and gradients afterwards, when the optimizer stepped (the clock of
    the collectives' records), and under ``"contract"`` what the call returned and left of its inputs."""
    model = build_net(weights)
    for name, p in model.named_parameters():
        if name in stale:
            p.grad = stale[name].clone()
    opt = make_optimizer(model, lr, optimizer)
    steps: list[float] = []
    opt.register_step_pre_hook(lambda *_: steps.append(elapsed()))
    value = learner.data_parallel_step(model, opt, F.mse_loss, inputs, targets)
    return {**_state(model), "seen": list(model.seen), "steps": steps,
            "contract": {"value": value, "after": {"step": (inputs, targets)}}}
