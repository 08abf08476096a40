"""Collectives that count what they move.

Strategy files call these instead of ``torch.distributed`` directly; each has the
same arguments as its ``torch.distributed`` namesake and also tells the run's
:class:`~gpucourse.measure.Recorder` two numbers:

- ``bytes``: the payload, the size of the buffer the operation is about — the
  tensor of an all-reduce or broadcast, the *full* (gathered) tensor of an
  all-gather, the *full* input of a reduce-scatter, the tensor of a send.
- ``bus_bytes``: what each rank must send for that payload with the ring
  algorithm: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n,
  broadcast and send 1 times the payload. By this count ZeRO-2's
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
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


def set_recorder(rec: Recorder | None) -> None:
    """Route counts from this process's collectives to ``rec``."""
    global _RECORDER
    _RECORDER = rec


def count(op: str, tensor: torch.Tensor, group=None) -> None:
    """Count one collective of ``op`` on ``tensor`` (also used by comm hooks)."""
    if _RECORDER is not None:
        n = dist.get_world_size(group)
        payload = tensor.numel() * tensor.element_size()
        _RECORDER.count_comm(op, payload, int(round(payload * RING_FACTOR[op](n))))


class Pending:
    """An in-flight collective; ``wait()`` blocks until it is done."""

    def __init__(self, work, name: str):
        self._work, self._name = work, name
        self._start = _RECORDER.now() if _RECORDER else 0.0

    def wait(self) -> None:
        self._work.wait()
        if _RECORDER is not None:
            _RECORDER.add_span("comm", self._name, self._start, _RECORDER.now())


def _run(op: str, name: str, fn, tensor: torch.Tensor, group, async_op: bool):
    count(op, tensor, group)
    if async_op:
        return Pending(fn(async_op=True), name)
    if _RECORDER is None:
        fn(async_op=False)
        return None
    with _RECORDER.span("comm", name):
        fn(async_op=False)
    return None


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, name="all_reduce"):
    """Every rank ends with the reduction (sum by default) of everyone's ``tensor``, in place."""
    return _run("all_reduce", name, lambda async_op: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                tensor, group, async_op)


def all_gather_into_tensor(output, input, group=None, async_op=False, name="all_gather"):
    """``output`` (n × the size of ``input``) receives every rank's ``input``, in rank order."""
    return _run("all_gather", name,
                lambda async_op: dist.all_gather_into_tensor(output, input, group=group, async_op=async_op),
                output, group, async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, name="reduce_scatter"):
    """Reduce ``input`` over ranks; rank i keeps the i-th of n equal chunks in ``output``."""
    return _run("reduce_scatter", name,
                lambda async_op: dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op),
                input, group, async_op)


def broadcast(tensor, src, group=None, async_op=False, name="broadcast"):
    """Every rank's ``tensor`` becomes a copy of rank ``src``'s (``src`` is a global rank)."""
    return _run("broadcast", name,
                lambda async_op: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
                tensor, group, async_op)


def send(tensor, dst, group=None, name="send"):
    """Send ``tensor`` to global rank ``dst`` (returns when the send can be reused)."""
    return _run("send", name, lambda async_op: dist.send(tensor, dst=dst, group=group), tensor, group, False)


def recv(tensor, src, group=None, name="recv"):
    """Receive into ``tensor`` from global rank ``src``."""
    return _run("recv", name, lambda async_op: dist.recv(tensor, src=src, group=group), tensor, group, False)
