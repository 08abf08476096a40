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


def step(learner, inputs: torch.Tensor, targets: torch.Tensor, weights: dict, stale: dict, lr: float) -> dict:
    """One ``data_parallel_step`` with plain SGD and the mean squared error, on a model whose gradients hold
    ``stale`` (left from "an earlier step"), given ``inputs`` and ``targets`` as they came (views stay views).
    What the model's forward saw, the weights and gradients afterwards, when the optimizer stepped (the clock of
    the collectives' records), and under ``"contract"`` what the call returned and left of its inputs."""
    model = build_net(weights)
    for name, p in model.named_parameters():
        if name in stale:
            p.grad = stale[name].clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    steps: list[float] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(elapsed()))
    value = learner.data_parallel_step(model, optimizer, F.mse_loss, inputs, targets)
    return {**_state(model), "seen": list(model.seen), "steps": steps,
            "contract": {"value": value, "after": {"step": (inputs, targets)}}}
