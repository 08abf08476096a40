"""Probes of exercise 8: drive the learner's LossScaler through backward passes and optimizer steps.

Each function builds its fixtures (a small model, an SGD optimizer, gradients)
from the tensors a check sent, runs the learner's scaler on them and reports
what it saw: the gradients after ``unscale_``, what ``step`` returned, the
weights and the scale after each step. The verdicts are made by the checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def model_with(weights: dict) -> nn.Sequential:
    """A small MLP (4 -> 5 -> 3, tanh) holding the weights sent (names as ``named_parameters`` gives them)."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model


def _poison(model: nn.Module, where) -> None:
    """Put an inf into the gradient of parameter ``where[0]`` at flat index ``where[1]``."""
    name, index = where
    dict(model.named_parameters())[name].grad.view(-1)[index] = float("inf")


def _weights(model: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _with_graph(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` with a graph behind it, as a training step's loss has (an in-place change of it is then allowed)."""
    return loss * torch.ones((), dtype=loss.dtype, requires_grad=True)


def unscale(learner, init_scale: float, loss: float, grads: list, overflowing: list) -> dict:
    """scale() of a 0-d loss, unscale_ of finite gradients (in place), then unscale_ of each list of
    ``overflowing`` gradients: what each returned, the gradients afterwards and the scale."""
    scaler = learner.LossScaler(init_scale=init_scale)
    scaled = scaler.scale(_with_graph(torch.tensor(loss)))
    found = scaler.unscale_(grads)
    scale_after = scaler.loss_scale
    return {"scaled": scaled, "found": found, "grads": grads, "scale": scale_after,
            "overflow_found": [scaler.unscale_(case) for case in overflowing]}


def scale_loss(learner, loss: torch.Tensor, init_scale: float) -> dict:
    """scale() of ``loss`` (0-d, in its dtype, with a graph behind it): under ``"contract"`` what it returned and
    the loss as it left it."""
    mine = _with_graph(loss)
    value = learner.LossScaler(init_scale=init_scale).scale(mine)
    return {"contract": {"value": value, "after": {"scale": (mine.detach(),)}}}


def unscale_grads(learner, grads: list, init_scale: float) -> dict:
    """unscale_ of ``grads`` as they came (views stay views): what it returned, and the gradients after it."""
    found = learner.LossScaler(init_scale=init_scale).unscale_(grads)
    return {"found": found, "grads": grads, "contract": {"value": None, "after": {"unscale_": (grads,)}}}


def history(learner, kwargs: dict, found: list) -> list:
    """``loss_scale`` after each ``update(found[i])``."""
    scaler = learner.LossScaler(**kwargs)
    out = []
    for f in found:
        scaler.update(f)
        out.append(scaler.loss_scale)
    return out


def skipped_step(learner, weights: dict, frozen: torch.Tensor, x: torch.Tensor, lr: float, momentum: float,
                 init_scale: float, growth_interval: int, poison) -> dict:
    """One step whose scaled gradients hold an inf (at ``poison``), then one finite step, with SGD over the
    model's parameters and a ``frozen`` one that never gets a gradient: what step returned, the weights,
    the momentum buffers and the scale after each."""
    model = model_with(weights)
    optimizer = torch.optim.SGD(list(model.parameters()) + [nn.Parameter(frozen.clone())], lr=lr,
                                momentum=momentum)
    scaler = learner.LossScaler(init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for step in range(2):
        optimizer.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if step == 0:
            _poison(model, poison)
        stepped = scaler.step(optimizer)
        out.append({"stepped": stepped, "weights": _weights(model), "scale": scaler.loss_scale,
                    "buffers": sum(1 for s in optimizer.state.values() if s)})
    return {"steps": out}


def training(learner, weights: dict, batches: list, lr: float, momentum: float, kwargs: dict,
             poison: dict) -> list:
    """A training loop with MSE loss and SGD: scale, backward, an inf put into the gradients at the steps of
    ``poison`` (step -> where), step. The scale, what step returned and the weights after each step."""
    model = model_with(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scaler = learner.LossScaler(**kwargs)
    out = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if step in poison:
            _poison(model, poison[step])
        stepped = scaler.step(optimizer)
        out.append({"stepped": stepped, "scale": scaler.loss_scale, "weights": _weights(model)})
    return out


def grouped_training(learner, weights: dict, dtype: str, groups: list, batches: list, kwargs: dict, poison: dict,
                     frozen: bool) -> list:
    """:func:`training` with the optimizer a case drew: the model in ``dtype``, SGD over ``groups`` (each
    ``{"params": [names], "lr", "momentum"}``, one more parameter that never gets a gradient in the last if
    ``frozen``), each step's gradients accumulated over its microbatches (``batches[step]``, a list of (x, y); the
    loss divided by their number), an inf or a NaN put in at the steps of ``poison`` (step -> (name, index,
    value)). What step returned, the scale and the weights after each step."""
    model = model_with(weights).to(getattr(torch, dtype))
    named = dict(model.named_parameters())
    param_groups = [{"params": [named[n] for n in g["params"]], "lr": g["lr"], "momentum": g["momentum"]}
                    for g in groups]
    if frozen:
        param_groups[-1]["params"].append(nn.Parameter(torch.zeros(2, dtype=getattr(torch, dtype))))
    optimizer = torch.optim.SGD(param_groups)
    scaler = learner.LossScaler(**kwargs)
    out = []
    for step, micro in enumerate(batches):
        optimizer.zero_grad()
        for x, y in micro:
            scaler.scale(F.mse_loss(model(x), y) / len(micro)).backward()
        if step in poison:
            name, index, value = poison[step]
            named[name].grad.view(-1)[index] = value
        stepped = scaler.step(optimizer)
        out.append({"stepped": stepped, "scale": scaler.loss_scale, "weights": _weights(model)})
    return out


def fp16_gradient(learner, a: torch.Tensor, b: torch.Tensor, init_scale: float) -> dict:
    """The gradient of sum(w * a * b), computed in fp16, for fp32 w = 1, with the loss scaled, after
    unscale_ (and what unscale_ returned)."""
    scaler = learner.LossScaler(init_scale=init_scale)
    w = nn.Parameter(torch.ones(a.shape))
    loss = ((w.half() * a) * b).float().sum()  # the backward multiplies in fp16
    scaler.scale(loss).backward()
    found = scaler.unscale_([w.grad])
    return {"grad": w.grad, "found": found}


# The process groups make_groups made, by their ranks: kept in this rank's process so that the call that
# uses them records only the learner's collectives, not the ones that made the groups.
_GROUPS: dict = {}


def make_groups(learner, groups: list) -> None:
    """``dist.new_group`` of each list of global ranks in ``groups`` (every rank calls it, the same lists)."""
    for ranks in groups:
        _GROUPS[tuple(ranks)] = dist.new_group(ranks)


def shard_steps(learner, shard: torch.Tensor, grads: list, lr: float, momentum: float, init_scale: float,
                growth_interval: int, group_ranks: list | None = None) -> dict:
    """This rank's shard of the parameters, under SGD and the learner's scaler: for each gradient of
    ``grads`` (already scaled), ``step``, passed the group of ``group_ranks`` (made by make_groups) if given.
    What step returned, the shard and the scale after each step."""
    p = nn.Parameter(shard.clone())
    optimizer = torch.optim.SGD([p], lr=lr, momentum=momentum)
    scaler = learner.LossScaler(init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for g in grads:
        p.grad = g.clone()
        if group_ranks is None:
            stepped = scaler.step(optimizer)
        else:
            stepped = scaler.step(optimizer, group=_GROUPS[tuple(group_ranks)])
        out.append({"stepped": stepped, "shard": p.detach().clone(), "scale": scaler.loss_scale})
    return {"steps": out}
