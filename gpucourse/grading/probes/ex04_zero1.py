"""Probes of exercise 4: drive the learner's shard_bounds and ZeroOneAdam, and take a census of optimizer state.

``steps`` builds the parameters from the tensors a check sent, makes the
learner's ``ZeroOneAdam`` over them, hands it the gradients of each step and
reports, after construction and after every step, the weights and a census of
every ``torch.optim.Optimizer`` it can reach from the learner's object and the
learner's module (through attributes, lists, tuples and dicts): how many
elements of state each holds, and for each tensor it optimizes, which range of
the flattened parameters that tensor is (when it can tell: a parameter itself,
or a copy of part of them made when the optimizer was built). The verdicts are
made by the checks.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

_MAX_OBJECTS = 20000  # how many objects the census looks at before it stops
_MAX_DEPTH = 8


def bounds(learner, cases: list) -> list:
    """``[shard_bounds(numel, world, r) for r in range(world)]`` for each ``(numel, world)`` of ``cases``."""
    return [[learner.shard_bounds(numel, world, r) for r in range(world)] for numel, world in cases]


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


def _reachable_optimizers(roots) -> list:
    """Every torch.optim.Optimizer reachable from ``roots`` (not looking inside an optimizer)."""
    found, seen = [], set()
    frontier = [(r, 0) for r in roots]
    while frontier and len(seen) < _MAX_OBJECTS:
        obj, depth = frontier.pop()
        if id(obj) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
            continue
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
                                           torch.device, types.ModuleType, type, types.FunctionType,
                                           types.BuiltinFunctionType, types.MethodType)):
            continue
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        else:
            try:
                children = list(vars(obj).values())
            except TypeError:
                children = [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
        frontier.extend((c, depth + 1) for c in children)
    return found


def _where(t: torch.Tensor, params: list, start_flat: torch.Tensor | None) -> list | None:
    """``[start, end)`` of ``t`` in the flattened parameters: by identity with a parameter, else (``start_flat``
    given: while the optimizer is new) where its values, trailing zeros (padding) left out, lie in the
    flattened starting weights; None if it cannot tell."""
    offset = 0
    for p in params:
        if t is p:
            return [offset, offset + p.numel()]
        offset += p.numel()
    if start_flat is None:
        return None
    v = t.detach().reshape(-1)
    nonzero = v.nonzero().reshape(-1)
    if not len(nonzero):
        return None
    v = v[:int(nonzero[-1]) + 1]
    if v.numel() > start_flat.numel() or v.dtype != start_flat.dtype:
        return None
    for start in (start_flat == v[0]).nonzero().reshape(-1).tolist():
        if start + v.numel() <= start_flat.numel() and torch.equal(start_flat[start:start + v.numel()], v):
            return [start, start + v.numel()]
    return None


def _census(learner, opt, params: list, known: dict, start_flat: torch.Tensor | None) -> list:
    """For each optimizer reachable from ``opt`` and the learner's module: its class, the elements of state it
    holds (tensors of one dimension or more), and ``tensors``, one row for each tensor it has state for or
    optimizes: ``[its size, start, end, elements of state kept for it]``, where ``[start, end)`` is its range in
    the flattened parameters, or ``-1, -1`` if the probe cannot tell (an int64 tensor of shape (k, 4)).

    A tensor's range is found when it is first seen: by identity with a parameter, or by its values, which
    right after construction (``start_flat``, the starting weights) are those of the part it is a copy of.
    ``known`` remembers it (by the tensor itself) for the later censuses."""
    roots = [opt] + [v for k, v in vars(learner).items() if not k.startswith("__")]
    out = []
    for o in _reachable_optimizers(roots):
        tensors = {}
        for group in getattr(o, "param_groups", []):
            for p in group.get("params", []):
                tensors.setdefault(id(p), p)
        for p in getattr(o, "state", {}):
            if torch.is_tensor(p):
                tensors.setdefault(id(p), p)
        entries, total = [], 0
        for p in tensors.values():
            if not torch.is_tensor(p):
                continue
            state = getattr(o, "state", {}).get(p, {})
            held = sum(v.numel() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
            total += held
            if id(p) not in known or known[id(p)][0] is not p:
                known[id(p)] = (p, _where(p, params, start_flat))
            where = known[id(p)][1]
            entries.append([p.numel(), *(where or (-1, -1)), held])
        out.append({"type": type(o).__name__, "state_elements": total,
                    "tensors": torch.tensor(entries, dtype=torch.int64).reshape(-1, 4)})
    return out


def steps(learner, weights: list, grads: list, lr: float, container: str = "list") -> dict:
    """``ZeroOneAdam`` over parameters holding ``weights`` (as they came: a view stays a view), handed to it as a
    ``container`` ("list", "tuple", or "generator" as ``model.parameters()`` is); step ``i`` gets ``grads[i]`` (one
    per parameter).

    Reports ``weights``, the flattened parameters after each step, ``census``, the optimizer census after
    construction and after each step (see :func:`_census`), and under ``"contract"`` the gradients as each step left
    them.
    """
    params = [nn.Parameter(w.clone()) for w in weights]
    start_flat = _flat(params).clone()
    given = {"list": list, "tuple": tuple, "generator": lambda ps: (p for p in ps)}[container](params)
    opt = learner.ZeroOneAdam(given, lr=lr)
    known: dict = {}
    census = [_census(learner, opt, params, known, start_flat)]
    after, grads_after = [], []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        after.append(_flat(params).clone())
        grads_after.append([None if p.grad is None else p.grad.detach().clone() for p in params])
        census.append(_census(learner, opt, params, known, None))
    return {"weights": after, "census": census,
            "contract": {"value": None, "after": {"step": (None, grads_after)}}}
