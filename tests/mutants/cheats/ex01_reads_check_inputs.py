"""Cheat ex01: looks up the call stack for the checks' locals (every rank's inputs, the expected sum)."""

import inspect

import torch


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    for frame in inspect.stack():
        for name in ("want", "expected"):
            value = frame.frame.f_locals.get(name)
            if torch.is_tensor(value) and value.shape == tensor.shape:
                return value.clone()
        xs = frame.frame.f_locals.get("xs")
        if isinstance(xs, list) and xs and torch.is_tensor(xs[0]):
            return torch.stack(xs).sum(0)
    return tensor.clone()
