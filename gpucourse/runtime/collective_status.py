"""Which collective each rank is in, kept where the launcher can read it after a hang.

A hang in distributed training is almost always two ranks disagreeing about
the next collective: one is in an all-reduce, the other in a barrier, or one
skipped a call the others made. To say so, every rank keeps a tiny status file
``status-{rank}.json`` in the run folder. :func:`install` wraps the collective
entry points of ``torch.distributed`` (``dist.all_reduce``, ``dist.barrier``,
``dist.send``...), so each call writes ``#seq op(shapes)`` into it: the number of
the call on this rank, the operation, and its tensors' dtypes and shapes.

The file is memory-mapped, so writing into it is copying a few bytes into
memory: no system call per collective, and what was written is still there
(in the page cache) when the rank is killed. It is laid out as fixed-width JSON,
three slots of ASCII text padded with spaces::

    {"waiting": "#3 barrier()", "finished": "#2 all_reduce(float32[1024])", "launched": ""}

- ``waiting``: the call this rank is in now (empty between calls);
- ``finished``: the last call that returned (for an asynchronous one: whose
  ``wait()`` returned);
- ``launched``: the last asynchronous call started (``async_op=True``).

Collectives PyTorch makes in C++ (DDP's gradient buckets, NCCL inside compiled
code) do not pass through these Python functions and are not seen; those made
through ``torch.distributed`` in Python (gpucourse's strategies, FSDP2,
ZeroRedundancyOptimizer, pipelining) are.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import re

import torch
import torch.distributed as dist

# The entry points wrapped, as named in torch.distributed. isend and irecv stay
# unwrapped: dist.P2POp checks that its op *is* torch's own isend or irecv. Object collectives
# (all_gather_object...) are one entry each: the calls they make inside
# distributed_c10d do not go through this namespace, so they are not counted twice.
OPS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
       "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce",
       "broadcast", "barrier", "monitored_barrier", "gather", "scatter", "all_to_all", "all_to_all_single",
       "send", "recv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
       "gather_object", "scatter_object_list", "send_object_list", "recv_object_list")
# The peer rank is their second argument: shown as "to rank 1" / "from rank 0".
_PEER = {"send": ("dst", "to"), "recv": ("src", "from"), "broadcast": ("src", "from")}

SLOT = 200  # bytes of text per slot; longer descriptions are cut
FIELDS = ("waiting", "finished", "launched")


def _layout() -> tuple[bytes, dict[str, int]]:
    text, offsets = "{", {}
    for i, name in enumerate(FIELDS):
        text += f'{", " if i else ""}"{name}": "'
        offsets[name] = len(text)
        text += " " * SLOT + '"'
    return (text + "}\n").encode(), offsets


_TEMPLATE, _OFFSET = _layout()
_W, _F, _L = (_OFFSET[n] for n in FIELDS)
_BLANK = b" " * SLOT

_SINK = bytearray(len(_TEMPLATE))  # where writes go while no status file is open: harmless
_mm = _SINK         # the mapped status file of this rank while installed
_seq = 0            # collectives this rank has called
_originals: dict = {}
_TENSOR_TEXT: dict = {}
_group_names: dict[int, str] = {}


def _slot(text: str) -> bytes:
    # Only ASCII without quotes or backslashes reaches here (names, digits,
    # brackets), so any mix of old and new bytes is still valid JSON.
    data = text.encode("ascii", "replace")
    return data[:SLOT - 3] + b"..." if len(data) > SLOT else data.ljust(SLOT)


def _tensor(t: torch.Tensor) -> str:
    # Training calls the same few shapes over and over: formatting one costs
    # more than the rest of the bookkeeping, so each is formatted once.
    key = (t.dtype, t.shape)
    text = _TENSOR_TEXT.get(key)
    if text is None:
        text = f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]"
        if len(_TENSOR_TEXT) < 4096:
            _TENSOR_TEXT[key] = text
    return text


def _group(group) -> str:
    key = id(group)
    if key not in _group_names:
        try:
            _group_names[key] = f"group {dist.get_process_group_ranks(group)}"
        except (ValueError, RuntimeError):  # a group this rank is not part of
            _group_names[key] = "a subgroup"
    return _group_names[key]


def describe(op: str, args: tuple, kwargs: dict) -> str:
    """``op(dtype[shape], ...)``: the tensors of one call, its peer and its process group."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(_tensor(a))
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            parts.append(f"{len(a)} x {_tensor(a[0])}")
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            parts.append(_tensor(a))
    text = f"{op}({', '.join(parts)})"
    if op in _PEER:
        name, word = _PEER[op]
        peer = args[1] if len(args) > 1 else kwargs.get(name)
        if isinstance(peer, int):
            text += f" {word} rank {peer}"
    group = kwargs.get("group")
    if group is not None and group is not dist.GroupMember.WORLD:
        text += f" on {_group(group)}"
    return text


class _TrackedWork(dist.Work):
    """An asynchronous collective's handle: the same, but its ``wait()`` is written down."""

    def __init__(self, work, text: str, done: bytes):
        super().__init__()
        self._work, self._text, self._done = work, text, done

    def wait(self, *args, **kwargs):
        _mm[_W:_W + SLOT] = _slot(f"{self._text} (async, in wait())")
        out = self._work.wait(*args, **kwargs)
        _mm[_F:_F + SLOT] = self._done
        _mm[_W:_W + SLOT] = _BLANK
        return out


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self._work, name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name in ("get_future", "is_completed", "is_success", "exception", "source_rank", "result", "synchronize",
              "block_current_stream", "get_future_result", "boxed", "_get_op_type", "_get_duration"):
    if hasattr(dist.Work, _name):
        setattr(_TrackedWork, _name, _delegate(_name))


def tracked(op: str, fn):
    """``fn`` (the collective ``op``), writing what it is into this rank's status slot while it runs."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        global _seq
        _seq += 1
        text = f"#{_seq} {describe(op, args, kwargs)}"
        slot = _slot(text)
        _mm[_W:_W + SLOT] = slot
        out = fn(*args, **kwargs)
        if out is None or not (isinstance(out, dist.Work) or isinstance(out, list) and out
                               and isinstance(out[0], dist.Work)):
            _mm[_F:_F + SLOT] = slot
            _mm[_W:_W + SLOT] = _BLANK
            return out
        _mm[_L:_L + SLOT] = slot
        _mm[_W:_W + SLOT] = _BLANK
        if isinstance(out, list):  # batch_isend_irecv: one handle per operation
            return [_TrackedWork(w, text, slot) for w in out]
        return _TrackedWork(out, text, slot)
    return call


def install(path: str) -> None:
    """Start writing this rank's collectives to ``path`` (wraps torch.distributed's functions)."""
    global _mm, _seq
    uninstall()
    with open(path, "w+b") as f:
        f.write(_TEMPLATE)
        f.flush()
        _mm = mmap.mmap(f.fileno(), len(_TEMPLATE))
    _seq = 0
    for op in OPS:
        fn = getattr(dist, op, None)
        if fn is not None:
            _originals[op] = fn
            setattr(dist, op, tracked(op, fn))


def uninstall() -> None:
    """Put torch.distributed's own functions back and close the status file."""
    global _mm
    for op, fn in _originals.items():
        setattr(dist, op, fn)
    _originals.clear()
    if _mm is not _SINK:
        mm, _mm = _mm, _SINK  # a handle still waited on later writes to the sink
        mm.close()


def calls() -> int:
    """Collectives this rank has called since :func:`install`."""
    return _seq


@contextlib.contextmanager
def paused():
    """Inside this block torch.distributed's own, unwrapped functions run (to measure what tracking costs)."""
    wrapped = {op: getattr(dist, op) for op in _originals}
    for op, fn in _originals.items():
        setattr(dist, op, fn)
    try:
        yield
    finally:
        for op, fn in wrapped.items():
            setattr(dist, op, fn)


def read(path: str) -> dict:
    """A status file as ``{"waiting": ..., "finished": ..., "launched": ...}`` (empty strings when unknown)."""
    try:
        with open(path) as f:
            note = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: str(note.get(k, "")).strip() for k in FIELDS}


def _seq_of(text: str) -> int:
    try:
        return int(text.split(" ", 1)[0].lstrip("#"))
    except ValueError:
        return 0


def explain(note: dict) -> str:
    """One line for a rank: ``waiting in #3 barrier() — last finished #2 all_reduce(float32[1024])``."""
    if not note:
        return "no collective recorded"
    waiting, finished, launched = (note.get(k, "") for k in FIELDS)
    where = f"waiting in {waiting}" if waiting else "not in a collective"
    text = f"{where} — last finished {finished or 'none'}"
    if launched and _seq_of(launched) > _seq_of(finished) and launched not in waiting:
        text += f"; async {launched} launched, not yet waited for"
    return text


_CALL = re.compile(r"#(\d+) (.*)")


def waiting_in(explained: str) -> tuple[int, str] | None:
    """From a line of :func:`explain`: ``(seq, "op(shapes)")`` of the call the rank waits in, or None."""
    head = explained.split(" — ", 1)[0]
    if "waiting in " not in head:
        return None
    match = _CALL.match(head.split("waiting in ", 1)[1])
    return (int(match.group(1)), match.group(2).removesuffix(" (async, in wait())")) if match else None


def status_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` keeps its status in a run folder."""
    return os.path.join(run_dir, f"status-{rank}.json")


def diagnose_hang(waiting: dict) -> str:
    """Read a :class:`~gpucourse.runtime.LaunchTimeout`'s per-rank lines (``waiting``: rank -> what its status
    file says): where the ranks disagree, in a few sentences — what the launcher, the grader and the fault
    scenarios print after a hang."""
    calls = {r: waiting_in(text) for r, text in waiting.items()}
    inside = {r: c for r, c in calls.items() if c}
    idle = sorted(r for r, c in calls.items() if not c)
    if not inside:
        return ("No rank is inside a collective: they are computing, or stuck outside torch.distributed "
                "(a deadlock in data loading, an endless loop).")
    parts = []
    by_seq: dict[int, list[int]] = {}
    for r, (seq, _) in inside.items():
        by_seq.setdefault(seq, []).append(r)
    if len(by_seq) == 1:
        seq = next(iter(by_seq))
        ops = {r: op for r, (_, op) in inside.items()}
        if len(set(ops.values())) > 1:
            parts.append(f"The ranks disagree about collective #{seq}: "
                         + "; ".join(f"rank {r} called {op}" for r, op in sorted(ops.items()))
                         + ". Each waits for partners that are in a different call, so none can finish.")
        elif idle:
            waiters = sorted(inside)
            return (f"Rank{'s' * (len(waiters) > 1)} {', '.join(map(str, waiters))} "
                    f"wait{'s' * (len(waiters) == 1)} in collective #{seq} ({next(iter(ops.values()))}) for "
                    f"rank{'s' * (len(idle) > 1)} {', '.join(map(str, idle))}, which never made that call: "
                    "they finished, returned or took another branch first. Look for a break, return or if "
                    "that came out differently on some ranks (a decision taken on a rank's own data).")
        else:
            parts.append(f"Every rank waits in the same collective #{seq} ({next(iter(ops.values()))}): "
                         "the partners it needs are all there. Rule out tensors of different shapes first "
                         "(TORCH_DISTRIBUTED_DEBUG=DETAIL names a mismatch), then suspect the network or a rank "
                         "outside this group (NCCL_DEBUG=INFO shows the transport).")
    else:
        order = sorted(inside.items(), key=lambda kv: kv[1][0])
        parts.append("The ranks are at different collectives: "
                     + "; ".join(f"rank {r} in #{seq} {op}" for r, (seq, op) in order)
                     + ". A rank that is behind made fewer calls before: one was skipped, or added, on some ranks.")
    if idle:
        parts.append(f"Rank{'s' * (len(idle) > 1)} {', '.join(map(str, idle))} "
                     f"{'are' if len(idle) > 1 else 'is'} not in any collective: computing, finished, or stuck "
                     "elsewhere, while the others wait for it.")
    return " ".join(parts)
