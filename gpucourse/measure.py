"""What a run measures, as plain data.

Each rank owns one :class:`Recorder`. Strategies wrap their phases in
``rec.span("forward", microbatch=i)`` and route collectives through
:mod:`gpucourse.comm`, which tells the recorder how many bytes each one moved.
At the end every rank hands back a plain dict, and :func:`merge` turns those into
one :class:`RunResult` that serialises to JSON. Figures, the grader, benchmarks
and the CLI all read that object and nothing else.

Timing: on CPU a span is two ``time.perf_counter()`` readings. On CUDA work is
asynchronous, so a span records two CUDA events instead and they are turned into
seconds once per step (:meth:`Recorder.flush`), when the step has already waited
for its loss — no extra synchronisation inside the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .files import write_atomic

SPAN_KINDS = ("forward", "backward", "comm", "optimizer", "idle", "step")


class ActivationMeter:
    """Counts the bytes of the tensors autograd saves for backward (the "activations").

    Inside :meth:`forward`, a saved-tensor hook sees every tensor autograd keeps
    for backward; parameters (and views of them) are not activations and are
    left out. A microbatch's bytes stay counted until :meth:`release` (after its
    backward), so with several microbatches in flight — a pipeline — ``peak`` is
    what the schedule really holds at once. Works on any device: it counts
    tensors, not allocator statistics.
    """

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._by_microbatch: dict = {}
        self._excluded: set = set()
        self._active = None
        self._region = None
        self.regions: dict[str, int] = {}  # bytes saved inside each watched kind of module, per microbatch (most)
        self._region_bytes: dict = {}

    def exclude(self, params) -> None:
        """Do not count tensors sharing storage with ``params``."""
        for p in params:
            p = p.to_local() if hasattr(p, "to_local") else p
            self._excluded.add(p.untyped_storage().data_ptr())

    def forget(self, params) -> None:
        """Undo :meth:`exclude` for tensors whose storage is about to be freed (its address may be reused)."""
        for p in params:
            self._excluded.discard(p.untyped_storage().data_ptr())

    def add(self, t: torch.Tensor) -> None:
        """Count ``t`` as saved by the microbatch whose forward is running."""
        if self._active is None:
            return
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: count this rank's shard
        if t.untyped_storage().data_ptr() in self._excluded:
            return
        seen = self._by_microbatch.setdefault(self._active, {})
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen[key] = t.numel() * t.element_size()
            self.current += seen[key]
            self.peak = max(self.peak, self.current)
            if self._region is not None:
                mine = (self._active, self._region)
                self._region_bytes[mine] = self._region_bytes.get(mine, 0) + seen[key]
                self.regions[self._region] = max(self.regions.get(self._region, 0), self._region_bytes[mine])

    def watch(self, modules, name: str) -> None:
        """Also count, under ``regions[name]``, what ``modules`` save (e.g. the blocks' LayerNorms)."""
        def enter(module, args):
            self._region = name

        def leave(module, args, out):
            self._region = None

        for module in modules:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

    @contextlib.contextmanager
    def forward(self, microbatch):
        def pack(t):
            self.add(t)
            return t

        self._active = microbatch
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            self._active = None

    def release(self, microbatch) -> None:
        """Backward of ``microbatch`` is done: its saved tensors are gone."""
        self.current -= sum(self._by_microbatch.pop(microbatch, {}).values())
        for key in [k for k in self._region_bytes if k[0] == microbatch]:
            del self._region_bytes[key]


_METER: ActivationMeter | None = None


def note_saved_input(t: torch.Tensor) -> None:
    """An activation kept outside autograd's saved tensors (a checkpointed block's input)."""
    if _METER is not None:
        _METER.add(t)


def nvtx_label(span: dict) -> str:
    """The NVTX range name of a span: ``"forward mb2"``, ``"comm all_reduce 4.0 MB"`` (kind, name, microbatch)."""
    label = span["kind"] if span["name"] in ("", span["kind"]) else f"{span['kind']} {span['name']}"
    return label if span.get("microbatch") is None else f"{label} mb{span['microbatch']}"


class Recorder:
    """Per-rank log of spans and collective bytes.

    ``enabled=False`` turns span recording into a no-op (bytes are still
    counted: that is one addition per collective).
    """

    def __init__(self, rank: int, device: torch.device, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.step = -1  # set-up, before the first step
        self.spans: list[dict] = []
        self.comm: dict[tuple[int, str], list[int]] = {}
        self._cuda = self.on_cuda = device.type == "cuda"
        self._pending: list[tuple[dict, Any, Any, Any]] = []
        self.activations = ActivationMeter()
        global _METER
        _METER = self.activations
        self._t0 = time.perf_counter()
        if self._cuda:
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()

    def now(self) -> float:
        """Seconds since this recorder started (host clock)."""
        return time.perf_counter() - self._t0

    @contextlib.contextmanager
    def span(self, kind: str, name: str = "", microbatch: int | None = None, **meta):
        """Record the time the body takes as one span of ``kind``.

        ``meta`` goes into the span as it is: a collective's ``op``, ``bytes``, ``group``
        (its global ranks) and ``peer`` (see :mod:`gpucourse.comm`), which a replay reads.
        """
        if not self.enabled:
            yield
            return
        rec = {"rank": self.rank, "step": self.step, "kind": kind, "name": name or kind,
               "microbatch": microbatch, **meta}
        if self._cuda:
            # The same span as an NVTX range: Nsight Systems (`nsys profile -t cuda,nvtx`) draws it above the
            # kernels it launched, named as the run's own timeline names it.
            torch.cuda.nvtx.range_push(nvtx_label(rec))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                torch.cuda.nvtx.range_pop()
                self._pending.append((rec, start, end, None))
                self.spans.append(rec)
        else:
            rec["start_s"] = self.now()
            try:
                yield
            finally:
                rec["end_s"] = self.now()
                self.spans.append(rec)

    def mark(self):
        """A point in time to pass to :meth:`add_span` (a CUDA event on CUDA)."""
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def open_range(self, kind: str, name: str = "", microbatch: int | None = None):
        """On CUDA, start the NVTX range of a span that :meth:`add_span` will close — an asynchronous collective's,
        from its launch to its completion, possibly on another thread; elsewhere nothing (``None``)."""
        if not (self.enabled and self._cuda):
            return None
        return torch.cuda.nvtx.range_start(nvtx_label({"kind": kind, "name": name, "microbatch": microbatch}))

    def add_span(self, kind: str, name: str, start, end, microbatch: int | None = None, waited=None, nvtx=None,
                 **meta):
        """Add a span between two :meth:`mark` points (e.g. an async collective's launch and completion).

        ``waited``: a third mark, where the rank started to need the result (``wait()`` was called);
        recorded as ``waited_s``. ``nvtx``: the range :meth:`open_range` started for it, ended here.
        """
        if nvtx is not None:
            torch.cuda.nvtx.range_end(nvtx)
        if not self.enabled:
            return
        rec = {"rank": self.rank, "step": self.step, "kind": kind, "name": name, "microbatch": microbatch, **meta}
        if self._cuda:
            self._pending.append((rec, start, end, waited))
        else:
            rec["start_s"], rec["end_s"] = start, end
            if waited is not None:
                rec["waited_s"] = waited
        self.spans.append(rec)

    def totals(self, since: int = 0) -> dict[str, float]:
        """Seconds per span kind over the spans recorded since index ``since`` (whole steps left out)."""
        out: dict[str, float] = {}
        for s in self.spans[since:]:
            if s["kind"] != "step" and "end_s" in s:
                out[s["kind"]] = out.get(s["kind"], 0.0) + s["end_s"] - s["start_s"]
        return out

    def count_comm(self, op: str, nbytes: int, bus_bytes: int) -> None:
        """Count one collective call of ``op``: its payload and the bytes this rank sends for it."""
        totals = self.comm.setdefault((self.step, op), [0, 0, 0])
        totals[0] += int(nbytes)
        totals[1] += bus_bytes
        totals[2] += 1

    def flush(self) -> None:
        """Turn pending CUDA event pairs into seconds (call after the step has synchronised)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for rec, start, end, waited in self._pending:
            rec["start_s"] = self._ref.elapsed_time(start) / 1e3
            rec["end_s"] = self._ref.elapsed_time(end) / 1e3
            if waited is not None:
                rec["waited_s"] = self._ref.elapsed_time(waited) / 1e3
        self._pending.clear()

    def export(self) -> dict:
        """This rank's measurements as plain, picklable data."""
        self.flush()
        return {
            # One clock for all ranks of a machine: the monotonic clock's reading at this recorder's zero.
            "clock": {"host": socket.gethostname(), "origin_s": self._t0},
            "spans": self.spans,
            "comm": [{"rank": self.rank, "step": s, "op": op, "bytes": b, "bus_bytes": bb, "calls": c}
                     for (s, op), (b, bb, c) in sorted(self.comm.items())],
        }


@dataclass
class RunResult:
    """One run, merged over ranks. ``RunResult.load(path)`` reads a saved one.

    - ``losses``: global mean training loss of each optimizer step.
    - ``start_step``: the training step of ``losses[0]`` — 0, or the step a run
      resumed from a checkpoint at. Every per-step list here (and the ``step`` of
      spans and counts) is indexed from it: index ``i`` is step ``start_step + i``.
    - ``step_times_s``: wall time of each step (the slowest rank's).
    - ``tokens_per_s``: global tokens per second over the steps after the first
      (the first pays for warm-up and is left out).
    - ``timeline``: spans ``{rank, step, kind, name, microbatch, start_s, end_s}``.
    - ``comm_bytes``: payload bytes handed to collectives (see :mod:`gpucourse.comm`),
      ``total``, ``per_op``, ``per_rank`` and ``per_step`` (summed over ranks, steps
      from 0; set-up traffic such as the first broadcast counts as step -1 and only
      in ``total``), and ``bus_total``, the ring algorithm's bytes sent.
    - ``comm``: the same counts, one row per (rank, step, op).
    """

    config: dict
    world_size: int
    device: str
    backend: str
    losses: list[float]
    step_times_s: list[float]
    tokens_per_s: float
    timeline: list[dict] = field(default_factory=list)
    comm_bytes: dict = field(default_factory=dict)
    comm: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    start_step: int = 0

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def save(self, path: str | os.PathLike) -> None:
        """Write the result as JSON, atomically: a reader never sees half a file."""
        write_atomic(path, self.to_json(indent=1))

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, path_or_result) -> "RunResult":
        """A RunResult from itself, a dict, or a JSON file path."""
        if isinstance(path_or_result, RunResult):
            return path_or_result
        if isinstance(path_or_result, dict):
            return cls.from_dict(path_or_result)
        with open(path_or_result) as f:
            return cls.from_dict(json.load(f))


def tensor_bytes(tensors) -> int:
    """Bytes of the elements of ``tensors``, each tensor counted once.

    A sharded tensor (a DTensor) counts only this rank's local shard.
    """
    held, total = {}, 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in held:
            held[key] = t  # keep it alive so its address cannot be reused while we count
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of an optimizer's per-parameter state (Adam's two moments).

    Scalar entries such as Adam's step counter are left out: they are a few
    bytes per tensor and no memory formula counts them.
    """
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)


def merge(config: dict, rank_outputs: list[dict], device: str, backend: str) -> RunResult:
    """Combine each rank's output dict into one RunResult.

    A rank output holds ``losses`` (its local mean loss per step, or None where
    the rank does not see the loss, e.g. a pipeline stage before the last),
    ``step_times_s``, and the recorder's ``spans`` and ``comm``. Every rank that
    sees the loss holds an equal share of the global batch, so the global loss
    is the plain mean of theirs.
    """
    holders = [o for o in rank_outputs if o["losses"] is not None]
    steps = len(holders[0]["losses"])
    losses = [sum(o["losses"][s] for o in holders) / len(holders) for s in range(steps)]
    step_times = [max(o["step_times_s"][s] for o in rank_outputs) for s in range(steps)]
    tokens_per_step = config["batch_size"] * config["seq_len"]
    timed = step_times[1:] if steps > 1 else step_times
    tokens_per_s = tokens_per_step * len(timed) / sum(timed) if sum(timed) > 0 else 0.0

    comm = [c for o in rank_outputs for c in o["comm"]]
    per_op: dict[str, int] = {}
    per_rank = [0] * len(rank_outputs)
    per_step = [0] * steps
    for c in comm:
        per_op[c["op"]] = per_op.get(c["op"], 0) + c["bytes"]
        per_rank[c["rank"]] += c["bytes"]
        if 0 <= c["step"] < steps:
            per_step[c["step"]] += c["bytes"]
    _align_clocks(rank_outputs)
    timeline = sorted((s for o in rank_outputs for s in o["spans"]), key=lambda s: (s["rank"], s["start_s"]))
    note_waits(timeline)
    memory = {str(o["rank"]): o["memory"] for o in rank_outputs if o.get("memory")}
    return RunResult(
        config=config, world_size=len(rank_outputs), device=device, backend=backend,
        losses=losses, step_times_s=step_times, tokens_per_s=tokens_per_s, timeline=timeline,
        comm_bytes={"total": sum(per_op.values()), "per_op": per_op, "per_rank": per_rank, "per_step": per_step,
                    "bus_total": sum(c["bus_bytes"] for c in comm)},
        comm=comm, memory=memory,
        extras={**{k: v for o in rank_outputs for k, v in o.get("extras", {}).items()},
                **_merge_moe(config, rank_outputs)},
        start_step=rank_outputs[0].get("start_step", 0),
    )


def _align_clocks(rank_outputs: list[dict]) -> None:
    """Put every rank's spans on one clock: the earliest rank's zero (ranks of one machine share a clock).

    Each rank counts from its own start; ranks start a little apart, so without this a
    span on one rank could not be compared with one on another.
    """
    clocks = [o.get("clock") for o in rank_outputs]
    if not all(clocks) or len({c["host"] for c in clocks}) != 1:
        return  # several machines: their clocks are not one; leave each rank on its own
    zero = min(c["origin_s"] for c in clocks)
    for o in rank_outputs:
        shift = o["clock"]["origin_s"] - zero
        o["clock"] = {**o["clock"], "origin_s": zero}
        for s in o["spans"]:
            for key in ("start_s", "end_s", "waited_s"):
                if key in s:
                    s[key] += shift


def note_waits(timeline: list[dict]) -> None:
    """Mark how much of each communication span was waiting for another rank: ``wait_s``.

    A collective cannot start before its last member arrives, and a send and its
    receive meet: until then a rank that got there first is *waiting* (idle), not
    transferring. Calls are matched across ranks the way they are matched when they
    run: the k-th collective on a group on every member, the k-th message from a to b.
    A receive also gets its send's start, ``sent_s``: the message is on its way from the
    later of that and the moment the receiver needs it until the receive ends.
    """
    calls: dict[tuple, list[dict]] = {}
    seen: dict[tuple, int] = {}
    for s in sorted((s for s in timeline if s["kind"] == "comm" and "group" in s), key=lambda s: s["start_s"]):
        if s["op"] in ("send", "recv"):
            pair = (s["rank"], s["peer"]) if s["op"] == "send" else (s["peer"], s["rank"])
            key = ("p2p", *pair, s["op"])
        else:
            key = ("coll", tuple(s["group"]), s["rank"])
        k = seen.get(key, 0)
        seen[key] = k + 1
        match = ("p2p", *pair) if s["op"] in ("send", "recv") else ("coll", tuple(s["group"]))
        calls.setdefault((*match, k), []).append(s)
    for (what, *_), spans in calls.items():
        if len(spans) != (2 if what == "p2p" else len(spans[0]["group"])):
            continue  # a member's call was not recorded (e.g. outside the recorded steps)
        last = max(s["start_s"] for s in spans)
        for s in spans:
            s["wait_s"] = min(max(0.0, last - s["start_s"]), s["end_s"] - s["start_s"])
        if what == "p2p":
            send, recv = sorted(spans, key=lambda s: s["op"] != "send")
            recv["sent_s"] = send["start_s"]


def waiting(span: dict) -> tuple[float, float] | None:
    """When a communication span kept its rank waiting for another rank, or None.

    A blocking call waits from its start for ``wait_s``; an asynchronous one (it has
    ``waited_s``) only keeps the rank waiting once the rank asks for the result.
    """
    if not span.get("wait_s"):
        return None
    start = max(span["start_s"], span.get("waited_s", span["start_s"]))
    end = span["start_s"] + span["wait_s"]
    return (start, end) if end > start else None


def _merge_moe(config: dict, rank_outputs: list[dict]) -> dict:
    """Each rank's router counts as the whole batch's: ``{"moe": {"layers", "tokens_per_expert", "dropped", "aux"}}``.

    Per MoE block (by name) and step: token choices per expert (also each rank's own,
    ``tokens_by_rank``) and dropped choices summed over the ranks that routed different tokens (tensor-parallel ranks route
    the same ones: one of them counts), the balance loss averaged over them.
    """
    tp = config.get("tp", 1)
    seen = {}  # layer name -> list of that layer's per-rank {"tokens", "dropped", "aux"} over steps
    for o in sorted(rank_outputs, key=lambda o: o["rank"]):
        m = o.get("extras", {}).get("moe")
        if not m or o["rank"] % tp:
            continue
        for i, name in enumerate(m["layers"]):
            seen.setdefault(name, []).append([(s["tokens"][i], s["dropped"][i], s["aux"][i]) for s in m["steps"]])
    if not seen:
        return {}
    names = sorted(seen, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
    steps = len(seen[names[0]][0])

    def total(name, s, j):
        return [sum(r[s][j][e] for r in seen[name]) for e in range(len(seen[name][0][s][j]))]
    return {"moe": {"layers": names,
                    "tokens_per_expert": [[total(n, s, 0) for n in names] for s in range(steps)],
                    # Each routing rank's own counts (in rank order): who sent how many rows to which expert.
                    "tokens_by_rank": [[[r[s][0] for r in seen[n]] for n in names] for s in range(steps)],
                    "dropped": [[sum(r[s][1] for r in seen[n]) for n in names] for s in range(steps)],
                    "aux": [[sum(r[s][2] for r in seen[n]) / len(seen[n]) for n in names] for s in range(steps)]}}
