"""Probes of exercise 15: build a small model of its own classes, wrap it in the learner's FSDP, and train it.

The model is not torch's: a ``Linear`` whose bias is a vector (replicated) and whose weight is a matrix (sharded),
an RMS norm's gain (replicated), a square matrix called twice in one forward (so gathered, and reduce-scattered,
once for each call), and a head without a bias. ``train`` reports the shards, the gradients after
``finish_gradient_synchronization()`` and the shards after each SGD step, and between the first forward and its
backward, every tensor it can find that is as large as a whole weight and still holds memory: those autograd saved
for backward, and those reachable from the learner's object. The verdicts are made by the checks.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

_MAX_OBJECTS = 20000  # how many objects the search for whole weights looks at before it stops
_MAX_DEPTH = 10


class Linear(nn.Module):
    """x @ weightᵀ (+ bias), the input cast to the weight's dtype; with ``cast``, the weight is cast to it at each
    use (how one device computes what FSDP with a compute dtype computes)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, cast: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        self.cast = cast

    def forward(self, x):
        w = self.weight if self.cast is None else self.weight.to(self.cast)
        y = x.to(w.dtype) @ w.t()
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.gain


class Net(nn.Module):
    def __init__(self, widths: list, cast: torch.dtype | None = None):
        super().__init__()
        d_in, hidden, d_out = widths
        self.inp = Linear(d_in, hidden, True, cast)
        self.norm = RMSNorm(hidden)
        self.mid = Linear(hidden, hidden, False, cast)
        self.head = Linear(hidden, d_out, False, cast)

    def forward(self, x):
        y = self.norm(torch.tanh(self.inp(x)))
        y = self.mid(torch.tanh(self.mid(y)))  # one weight, two calls
        return self.head(y)


def build_model(spec: dict, cast: torch.dtype | None = None) -> Net:
    """The model of ``spec`` (``widths``: input, hidden, output; ``weights``: name -> tensor)."""
    model = Net(spec["widths"], cast)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(spec["weights"][name])
    return model


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean()


def _children(obj) -> list:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, types.FunctionType):
        return [c.cell_contents for c in (obj.__closure__ or ()) if c.cell_contents is not None] \
            if all(_filled(c) for c in (obj.__closure__ or ())) else []
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if hasattr(obj, "func") and hasattr(obj, "args") and hasattr(obj, "keywords"):  # functools.partial
        return [obj.func, *obj.args, *(obj.keywords or {}).values()]
    try:
        return list(vars(obj).values())
    except TypeError:
        return [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _reachable_tensors(roots) -> list:
    found, seen = [], set()
    frontier = [(r, 0) for r in roots]
    while frontier and len(seen) < _MAX_OBJECTS:
        obj, depth = frontier.pop()
        if id(obj) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            found.append(obj)
            continue
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                           types.ModuleType, type, types.BuiltinFunctionType)):
            continue
        frontier.extend((c, depth + 1) for c in _children(obj))
    return found


def _whole_weights(tensors: list, sharded: dict, params: list) -> list:
    """``[name, bytes]`` for each storage that holds memory and a tensor shaped like a whole sharded weight (or a
    flat one at least as long), named after the weight it is as large as; the parameters (the shards) left out."""
    out, seen = [], {p.untyped_storage().data_ptr() for p in params}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        for name, shape in sharded.items():
            numel = torch.Size(shape).numel()
            if tuple(t.shape) == tuple(shape) or (t.dim() == 1 and t.numel() >= numel):
                seen.add(storage.data_ptr())
                out.append([name, storage.nbytes()])
                break
    return out


def train(learner, xs: list, spec: dict, lr: float, compute_dtype=None, accumulate: int = 1) -> dict:
    """Wrap the model of ``spec`` in ``learner.FSDP(model, compute_dtype=...)``; for each batch of ``xs`` (this
    rank's part of the step's batch): clear the gradients, forward, the loss, backward,
    ``finish_gradient_synchronization()``, one step of ``torch.optim.SGD(fsdp.parameters(), lr)``. With
    ``accumulate`` > 1, the batch is cut into that many microbatches, each forwarded and backwarded (its loss divided
    by their number) and followed by ``finish_gradient_synchronization()``, the gradients accumulating, before the step.

    Reports ``shards`` (each parameter of the model by name, after construction), ``same_parameters`` (whether
    ``fsdp.parameters()`` are the model's own parameters), and for each step ``grads`` and ``params`` (after the
    step), and ``held``: the whole weights found between forward and backward (see :func:`_whole_weights`). Under
    ``"contract"``, the batches as forward and backward left them."""
    model = build_model(spec)
    names = [n for n, _ in model.named_parameters()]
    sharded = {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() >= 2}
    fsdp = learner.FSDP(model, compute_dtype=compute_dtype)
    params = dict(model.named_parameters())
    shards = {n: params[n].detach().clone() for n in names}
    mine = list(fsdp.parameters())
    same = len(mine) == len(params) and all(any(p is q for q in params.values()) for p in mine)
    opt = torch.optim.SGD(mine, lr=lr)
    steps, after = [], {}
    for i, x in enumerate(xs):
        opt.zero_grad(set_to_none=True)
        for k, part in enumerate(x.tensor_split(accumulate)):
            saved: list = []

            def pack(t):
                saved.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_of(fsdp(part))
            if accumulate > 1:
                loss = loss / accumulate
            if k == 0:
                held = _whole_weights(saved + _reachable_tensors([fsdp]), sharded, list(params.values()))
            del saved
            if i == 0 and k == 0:
                after["forward"] = ([t.clone() for t in xs],)
            loss.backward()
            fsdp.finish_gradient_synchronization()
        grads = {n: None if params[n].grad is None else params[n].grad.detach().clone() for n in names}
        opt.step()
        steps.append({"held": held, "grads": grads, "params": {n: params[n].detach().clone() for n in names}})
    after["backward"] = ([t.clone() for t in xs],)
    return {"shards": shards, "same_parameters": same, "steps": steps, "contract": {"value": None, "after": after}}
