"""Probes of exercise 6: build the learner's tensor-parallel layers from whole layers, run forward and backward.

Each function builds the whole ``nn.Linear`` layers from the tensors a check
sent (a bias of None makes a layer with ``bias=False``), cuts them with the
learner's ``ColumnParallelLinear`` / ``RowParallelLinear``, runs forward and
backward on the input it was sent and reports what it saw: the outputs, the
gradients, the layers' parameters (and how much storage each holds), the input
(under ``"contract"``) and the whole layers as they were afterwards, and when
forward and backward began and ended (to place the collectives the rank issued).
The verdicts are made by the checks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..sandbox import elapsed


def _whole(weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool = False) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` and ``bias``; with ``transposed``, its weight stored transposed
    (column-major, as a GPT-2 Conv1D weight converted with ``.t()`` is)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    if transposed:
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())
    return layer


def _describe(layer: nn.Module) -> dict:
    """The layer's parameters by name: its value, its gradient, and the bytes of the storage it lives in."""
    out = {}
    for name, p in layer.named_parameters():
        out[name] = {"value": p.detach().clone(), "grad": None if p.grad is None else p.grad.detach().clone(),
                     "storage_bytes": p.untyped_storage().nbytes(), "bytes": p.numel() * p.element_size()}
    return out


def _whole_after(full: nn.Linear) -> dict:
    return {"weight": full.weight.detach().clone(), "bias": None if full.bias is None else full.bias.detach().clone(),
            "weight_grad": full.weight.grad is not None}


def layers(learner, x: torch.Tensor, kind: str, whole: list, grads_out: list, x_requires_grad: bool = True,
           backward: bool = True, transposed: list | None = None, empty: bool = False) -> dict:
    """``learner.<kind>`` (``"ColumnParallelLinear"`` or ``"RowParallelLinear"``) made from each whole layer
    ``(weight, bias)`` of ``whole``, all applied to one input ``x`` (as it came: a view stays a view); then (with
    ``backward``) backward of ``sum_i (y_i * grads_out[i])``.

    Reports ``ys`` (each layer's output), ``dx`` (the input's gradient), ``layers`` (each layer's parameters, see
    :func:`_describe`, after backward), ``whole_after`` (each whole layer after backward), ``marks``: the times
    the forward and the backward began and ended (``{"forward": [t0, t1], "backward": [t2, t3]}``), and under
    ``"contract"`` the outputs and the input as it was after forward and after backward. ``transposed`` says, for each
    whole layer, whether its weight is stored transposed. With ``empty``, ``ys_empty`` holds each layer's output for
    no rows of ``x`` (its first dimension cut to 0), run before the forward on ``x``.
    """
    fulls = [_whole(w, b, t) for (w, b), t in zip(whole, transposed or [False] * len(whole))]
    built = [getattr(learner, kind)(full) for full in fulls]
    ys_empty = ([layer(x.detach()[:0].clone().requires_grad_(x_requires_grad)).detach().clone() for layer in built]
                if empty else None)
    mine = x.detach().requires_grad_(x_requires_grad)
    t0 = elapsed()
    ys = [layer(mine) for layer in built]
    t1 = elapsed()
    after = {"forward": (mine.detach().clone(),)}
    t2 = t3 = elapsed()
    if backward:
        loss = sum((y * g).sum() for y, g in zip(ys, grads_out))
        t2 = elapsed()
        loss.backward()
        t3 = elapsed()
        after["backward"] = (mine.detach().clone(),)
    ys = [y.detach().clone() for y in ys]
    return {"ys": ys, "ys_empty": ys_empty, "dx": None if mine.grad is None else mine.grad.clone(),
            "layers": [_describe(layer) for layer in built], "whole_after": [_whole_after(f) for f in fulls],
            "marks": {"forward": [t0, t1], "backward": [t2, t3]}, "contract": {"value": ys, "after": after}}


def _laid_out(grad: torch.Tensor, run: str) -> torch.Tensor:
    """``grad`` with the strides autograd hands an output's gradient with: as it is ("contiguous", "empty"), stored
    with its dimensions reversed ("transposed": a later op used the output transposed), or its first row broadcast
    over the leading dimensions, with stride 0 there ("expanded": a sum over the batch came after; the check sends
    a gradient whose rows are all that row)."""
    if run == "transposed":
        order = list(reversed(range(grad.dim())))
        return grad.permute(order).contiguous().permute(order)
    if run == "expanded":
        return grad[(slice(0, 1),) * max(grad.dim() - 1, 1)].expand(grad.shape)
    return grad


def gradients(learner, kind: str, whole: list, transposed: list, runs: dict) -> dict:
    """Each whole layer ``(weight, bias)`` of ``whole`` (its weight stored transposed where ``transposed`` says so)
    cut with ``learner.<kind>``; then for each run ``name: (x, grad_out)`` of ``runs``, each layer applied to an
    input of its own equal to ``x`` and backward from its output with ``grad_out`` as the output's gradient, laid
    out as the run's name says (:func:`_laid_out`), the layers' gradients cleared before each run.

    Reports ``{name: [{"dx": ..., "weight": ..., "bias": ...}, ...]}``: the input's gradient and the layer's
    parameters' gradients, one dict per whole layer (``"bias"`` None where the layer has no bias)."""
    built = [getattr(learner, kind)(_whole(w, b, t)) for (w, b), t in zip(whole, transposed)]
    report = {}
    for name, (x, grad) in runs.items():
        report[name] = []
        for layer in built:
            params = dict(layer.named_parameters())
            for p in params.values():
                p.grad = None
            mine = x.detach().clone().requires_grad_(True)
            torch.autograd.backward(layer(mine), _laid_out(grad, name))
            report[name].append({key: None if p is None or p.grad is None else p.grad.clone()
                                 for key, p in (("dx", mine), ("weight", params.get("weight")),
                                                ("bias", params.get("bias")))})
    return report


def mlp(learner, fc: tuple, proj: tuple, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """``RowParallelLinear(proj)(gelu(ColumnParallelLinear(fc)(x)))``, then backward of ``sum(y * grad_out)``.

    ``fc`` and ``proj`` are ``(weight, bias)`` of the whole layers. Reports ``y``, ``dx`` and ``fc`` / ``proj``,
    each layer's parameters after backward (see :func:`_describe`)."""
    col = learner.ColumnParallelLinear(_whole(*fc))
    row = learner.RowParallelLinear(_whole(*proj))
    mine = x.clone().requires_grad_(True)
    y = row(F.gelu(col(mine)))
    (y * grad_out).sum().backward()
    return {"y": y.detach().clone(), "dx": None if mine.grad is None else mine.grad.clone(),
            "fc": _describe(col), "proj": _describe(row)}
