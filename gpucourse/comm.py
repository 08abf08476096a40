"""Collectives that count what they move.

Strategy files call these instead of ``torch.distributed`` directly; each has the
same arguments as its ``torch.distributed`` namesake and also tells the run's
:class:`~gpucourse.measure.Recorder` two numbers:

- ``bytes``: the payload, the size of the buffer the operation is about — the
  tensor of an all-reduce or broadcast, the *full* (gathered) tensor of an
  all-gather, the *full* input of a reduce-scatter, the tensor of a send.
- ``bus_bytes``: what each rank must send for that payload with the ring
  algorithm: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n,
  broadcast and send 1 times the payload (a receive counts 0: each
  point-to-point transfer is counted once, by its sender). By this count ZeRO-2's
  reduce-scatter plus all-gather moves exactly what data parallel's all-reduce
  does.

An asynchronous call returns a handle whose ``wait()`` records a ``comm`` span
from the launch to the end of the wait.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .measure import Recorder

_RECORDER: Recorder | None = None

# Per-rank bytes sent by the ring algorithm, as a multiple of the payload.
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "reduce": lambda n: 1.0 if n > 1 else 0.0,  # to one rank: every byte crosses each link once (nccl-tests: ×1)
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "all_to_all": lambda n: (n - 1) / n,  # each rank keeps 1/n of what it holds and sends the rest
}


def set_recorder(rec: Recorder | None) -> None:
    """Route counts from this process's collectives to ``rec``."""
    global _RECORDER
    _RECORDER = rec


def _count(op: str, payload: int, n: int) -> None:
    if op == "recv":
        payload = 0  # a transfer is counted once, by its sender
    if _RECORDER is not None:
        _RECORDER.count_comm(op, payload, payload * RING_FACTOR[op](n))


def count(op: str, tensor: torch.Tensor, group=None) -> None:
    """Count one collective of ``op`` on ``tensor``."""
    _count(op, tensor.numel() * tensor.element_size(), dist.get_world_size(group))


def _nbytes(tensors) -> int:
    if torch.is_tensor(tensors):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


# c10d operator -> (our name, which argument holds the payload). Every
# torch.distributed call, also those PyTorch's own FSDP, ZeroRedundancyOptimizer,
# pipelining and DTensor make, passes through one of these dispatcher operators.
_C10D_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0), "send": ("send", 0), "recv_": ("recv", 0),
    "alltoall_base_": ("all_to_all", 1),
}


# DTensor and compiled code use the functional collectives instead:
# name -> (our name, payload as a multiple of the input's size).
_FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", False), "all_reduce_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True), "reduce_scatter_tensor": ("reduce_scatter", False),
    "broadcast": ("broadcast", False), "broadcast_": ("broadcast", False),
    "all_to_all_single": ("all_to_all", False),
}


# The all-to-all operators, counted by their split sizes (which argument holds the input).
_ALL_TO_ALL = {("c10d", "alltoall_base_"): 1, ("_c10d_functional", "all_to_all_single"): 0}


def _arguments(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return dict(zip(names, args), **(kwargs or {}))


def _group(values: dict):
    if "process_group" in values:
        return dist.ProcessGroup.unbox(values["process_group"])
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(values["group_name"])


def _group_size(func, args, kwargs) -> int:
    return _group(_arguments(func, args, kwargs)).size()


def _count_all_to_all(func, args, kwargs, tensor: torch.Tensor) -> None:
    """An all-to-all sends what its input splits give the other ranks: the uniform (n−1)/n of the input when it
    has no splits, else the rows of every other rank's split. PyTorch's ring attention passes each block whole to
    one peer this way (``permute_tensor``): all of it is sent, not (n−1)/n."""
    values = _arguments(func, args, kwargs)
    group = _group(values)
    splits = list(values.get("input_split_sizes") or [])
    payload = _nbytes(tensor)
    if not splits or tensor.dim() == 0 or tensor.shape[0] == 0:
        _count("all_to_all", payload, group.size())
    elif _RECORDER is not None:
        row = payload // tensor.shape[0]
        _RECORDER.count_comm("all_to_all", payload, row * (sum(splits) - splits[group.rank()]))


def _dtensor_handler(func, args):
    """The handler PyTorch's context parallelism gives DTensor for this attention kernel on these args, or None."""
    if not func._schema.name.startswith("aten::_scaled_dot_product"):
        return None
    from torch.distributed.tensor import DTensor

    if any(isinstance(a, DTensor) for a in args):
        return DTensor._op_dispatcher._custom_op_handlers.get(func)
    return None


class counting:
    """Count the bytes of every collective issued inside this ``with`` block.

    Used around PyTorch's own strategies, whose collectives we do not call
    ourselves: a dispatch mode sees each c10d operator with its tensors and
    process group, on whatever thread autograd runs it. PyTorch's context
    parallelism talks inside DTensor's dispatch of the attention kernel, where a
    mode is off: the mode runs that handler itself, on again.
    """

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                namespace, _, name = func._schema.name.partition("::")
                if (namespace, name) in _ALL_TO_ALL:
                    _count_all_to_all(func, args, kwargs, args[_ALL_TO_ALL[namespace, name]])
                elif namespace == "c10d" and name in _C10D_OPS:
                    op, arg = _C10D_OPS[name]
                    _count(op, _nbytes(args[arg]), _group_size(func, args, kwargs))
                elif namespace == "_c10d_functional" and name in _FUNCTIONAL_OPS:
                    op, gathered = _FUNCTIONAL_OPS[name]
                    n = _group_size(func, args, kwargs)
                    _count(op, _nbytes(args[0]) * (n if gathered else 1), n)
                handler = _dtensor_handler(func, args)
                if handler is not None:  # its collectives would run inside DTensor's dispatch, unseen
                    with self:
                        return handler(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class Pending:
    """An in-flight collective; ``wait()`` blocks until it is done.

    Its ``comm`` span runs from the launch to the moment the collective
    completed (on CPU the work's future says when; on CUDA, the point where the
    compute stream has waited for it).
    """

    def __init__(self, work, name: str, meta: dict | None = None, start=None):
        self._work, self._name, self._rec, self._meta = work, name, _RECORDER, meta or {}
        self._start = start if start is not None else self._rec.mark() if self._rec else None
        self._nvtx = self._rec.open_range("comm", name) if self._rec else None  # on CUDA: launch to completion
        self._done = None
        if self._rec is not None and not self._rec._cuda:
            try:
                work.get_future().then(self._completed)
            except RuntimeError:  # gloo's point-to-point work has no future: the wait is the end
                pass

    def _completed(self, fut):
        self._done = self._rec.now()

    def wait(self) -> None:
        waited = self._rec.mark() if self._rec is not None else None  # where this rank starts to need the result
        self._work.wait()
        if self._rec is not None:
            end = self._rec.mark()
            if self._done is not None:
                end = min(end, self._done)
            self._rec.add_span("comm", self._name, self._start, end, waited=waited, nvtx=self._nvtx, **self._meta)


def _group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: every rank)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _meta(op: str, tensor: torch.Tensor, group, peer: int | None = None) -> dict:
    """What a replay needs of one call: which collective, its payload in bytes, the ranks that take part
    (and, for a send or receive, the other side's global rank). Nothing when nothing is recorded."""
    if _RECORDER is None or not _RECORDER.enabled:
        return {}
    meta = {"op": op, "bytes": tensor.numel() * tensor.element_size(), "group": _group_ranks(group)}
    if peer is not None:
        meta["peer"] = peer
    return meta


def _run(op: str, name: str, fn, tensor: torch.Tensor, group, async_op: bool, peer: int | None = None):
    count(op, tensor, group)
    return _call(name, fn, async_op, _meta(op, tensor, group, peer))


def _call(name: str, fn, async_op: bool, meta: dict | None = None):
    if async_op:
        # Marked before the launch: gloo may already move the data inside an isend call.
        start = _RECORDER.mark() if _RECORDER is not None else None
        return Pending(fn(async_op=True), name, meta, start)
    if _RECORDER is None:
        fn(async_op=False)
        return None
    with _RECORDER.span("comm", name, **(meta or {})):
        fn(async_op=False)
    spans = _RECORDER.spans
    if spans and spans[-1]["name"] == name:
        # The caller waited in this call, so profiling counts its time as
        # communication even inside a forward span (tensor parallel's all-reduces).
        spans[-1]["blocking"] = True
    return None


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, name="all_reduce"):
    """Every rank ends with the reduction (sum by default) of everyone's ``tensor``, in place."""
    return _run("all_reduce", name, lambda async_op: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                tensor, group, async_op)


# Newer PyTorch renamed the flat-tensor collectives; accept both spellings. Looked
# up at each call, not once at import, so a rank's collective status tracking
# (runtime.collective_status wraps torch.distributed's functions) sees them.
def all_gather_flat(*args, **kwargs):
    """torch's flat all-gather (``all_gather_into_tensor``, or its newer name), called directly: nothing recorded."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args, **kwargs):
    """torch's flat reduce-scatter (``reduce_scatter_tensor``, or its newer name), called directly: nothing recorded."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def all_gather_into_tensor(output, input, group=None, async_op=False, name="all_gather"):
    """``output`` (n × the size of ``input``) receives every rank's ``input``, in rank order."""
    return _run("all_gather", name,
                lambda async_op: all_gather_flat(output, input, group=group, async_op=async_op),
                output, group, async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, name="reduce_scatter"):
    """Reduce ``input`` over ranks; rank i keeps the i-th of n equal chunks in ``output``."""
    return _run("reduce_scatter", name,
                lambda async_op: reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op),
                input, group, async_op)


def broadcast(tensor, src, group=None, async_op=False, name="broadcast"):
    """Every rank's ``tensor`` becomes a copy of rank ``src``'s (``src`` is a global rank)."""
    return _run("broadcast", name,
                lambda async_op: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
                tensor, group, async_op)


def reduce(tensor, dst, op=dist.ReduceOp.SUM, group=None, async_op=False, name="reduce"):
    """Rank ``dst`` (a global rank) ends with the reduction of everyone's ``tensor``; the others' are left as
    they were or used as scratch."""
    return _run("reduce", name, lambda async_op: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op),
                tensor, group, async_op)


def send(tensor, dst, group=None, name="send"):
    """Send ``tensor`` to global rank ``dst`` (returns when the send can be reused)."""
    return _run("send", name, lambda async_op: dist.send(tensor, dst=dst, group=group), tensor, group, False, dst)


def recv(tensor, src, group=None, name="recv"):
    """Receive into ``tensor`` from global rank ``src``."""
    return _run("recv", name, lambda async_op: dist.recv(tensor, src=src, group=group), tensor, group, False, src)


def isend(tensor, dst, group=None, name="send"):
    """Start sending ``tensor`` to global rank ``dst``; ``wait()`` on the handle before reusing it."""
    return _run("send", name, lambda async_op: dist.isend(tensor, dst=dst, group=group), tensor, group, True, dst)


def irecv(tensor, src, group=None, name="recv"):
    """Start receiving into ``tensor`` from global rank ``src``; ``wait()`` on the handle before reading it."""
    return _run("recv", name, lambda async_op: dist.irecv(tensor, src=src, group=group), tensor, group, True, src)


def all_to_all_single(output, input, group=None, name="all_to_all"):
    """Rank i's chunk j of ``input`` (cut into n equal chunks along dim 0) becomes chunk i of rank j's ``output``."""
    return _run("all_to_all", name,
                lambda async_op: dist.all_to_all_single(output, input, group=group, async_op=async_op),
                input, group, False)


def all_to_all_uneven(output, input, output_splits: list[int], input_splits: list[int], group=None,
                      name="all_to_all"):
    """As :func:`all_to_all_single`, the chunks cut by size: ``input_splits[j]`` rows of ``input`` go to rank j,
    ``output_splits[i]`` rows of ``output`` come from rank i (each rank learns its ``output_splits`` first).

    Counted exactly, not by the ring factor: the payload is ``input``, and what this rank sends is every row
    of it but those it keeps for itself.
    """
    me = dist.get_rank(group)
    row = input[0].numel() * input.element_size() if input.shape[0] else 0
    if _RECORDER is not None:
        _RECORDER.count_comm("all_to_all", input.numel() * input.element_size(),
                             row * (sum(input_splits) - input_splits[me]))
    return _call(name, lambda async_op: dist.all_to_all_single(
        output, input, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group,
        async_op=async_op), False, _meta("all_to_all", input, group))
