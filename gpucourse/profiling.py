"""Where a run's time goes: a torch.profiler trace per rank, and the few numbers that judge a run.

``gpucourse train --profile DIR`` does two things:

1. Each rank records a few steps with ``torch.profiler`` and writes
   ``DIR/rank{N}.trace.json``, a Chrome trace: open it in https://ui.perfetto.dev
   or chrome://tracing to see every operator (and, on CUDA, every kernel) on a
   clock. :func:`trace` is that recording; outside ``--profile`` it does nothing.
2. :func:`summarize` reads the finished :class:`~gpucourse.measure.RunResult`
   (a pure function: no rank needs to run) and says, per rank, what share of
   each step was computing, communicating or idle, plus throughput, MFU and
   scaling efficiency. :func:`format_summary` prints it.

The shares, per rank, within each step's wall time (the rank's ``step`` span),
summed over the steps after the first (the first pays for warm-up):

- **compute**: time covered by a forward, backward or optimizer span;
- **communication**: time covered by a comm span and by no compute span — a
  collective that runs *while* compute goes on (data parallel's buckets during
  backward) is hidden, which is the point of overlapping — plus the time of a
  collective the rank waited in, even inside a forward or backward (tensor
  parallel's all-reduces: the rank could not compute meanwhile);
- **idle**: the rest — Python between phases, waiting for a pipeline stage, a
  straggler — and the part of a communication span in which the rank only waited
  for another rank to arrive (``wait_s``, see :func:`gpucourse.measure.note_waits`):
  a blocking receive that waits is idle, not communication. The three add up to 1.

MFU (model FLOPs utilisation): training a model of N parameters costs about
6·N FLOPs per token (2·N forward, 4·N backward; attention's own score
arithmetic is left out, as in the usual formula), so

    MFU = 6 · N · tokens/s ÷ (ranks × peak FLOP/s of one device)

Scaling efficiency against a baseline run (usually dp=1 on one device):

    efficiency = (tokens/s ÷ ranks) ÷ (baseline tokens/s ÷ baseline ranks)

1.0 means every added rank added its full share of throughput.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap

import torch

from .measure import RunResult, waiting

COMPUTE_KINDS = ("forward", "backward", "optimizer")
NOTE_WIDTH = 110  # characters a line of format_summary's notes: a notebook's output area shows them whole
# Steps recorded by the profiler: skip one (set-up), warm one up, record up to three.
WAIT, WARMUP, ACTIVE = 1, 1, 3

_PROFILER = None  # the running torch.profiler.profile of this rank, while trace() is on


def trace_path(folder: str | os.PathLike, rank: int) -> str:
    """Where rank ``rank`` writes its Chrome trace: ``folder/rank{N}.trace.json``."""
    return os.path.join(os.fspath(folder), f"rank{rank}.trace.json")


def _schedule(steps: int | None) -> tuple[int, int, int]:
    """(wait, warmup, active) steps that fit in a run of ``steps``: a trace always comes out."""
    if steps is None or steps >= WAIT + WARMUP + ACTIVE:
        return WAIT, WARMUP, ACTIVE
    active = min(ACTIVE, steps)
    warmup = min(WARMUP, steps - active)
    return steps - active - warmup, warmup, active


@contextlib.contextmanager
def trace(folder: str | os.PathLike | None, rank: int, steps: int | None = None):
    """Record this rank's training steps with torch.profiler into ``folder/rank{N}.trace.json``.

    Call :func:`step` after each training step. The profiler skips the first
    step, warms up on the next and records up to three (fewer when the run is
    shorter), so a trace stays a few megabytes. CPU activity is always
    recorded, CUDA kernels too when this rank uses a GPU. With ``folder=None``
    nothing is recorded and :func:`step` costs nothing.
    """
    global _PROFILER
    if folder is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    os.makedirs(folder, exist_ok=True)
    path = trace_path(folder, rank)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_initialized():  # this rank runs on a GPU (never initialise CUDA just to ask)
        activities.append(ProfilerActivity.CUDA)
    wait, warmup, active = _schedule(steps)
    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(path))
    with _native_log_hidden():
        prof.start()
    _PROFILER = prof
    try:
        yield prof
    finally:
        _PROFILER = None
        with _native_log_hidden():
            prof.stop()


def snapshot_path(folder: str | os.PathLike, rank: int) -> str:
    """Where rank ``rank`` writes its CUDA memory snapshot: ``folder/rank{N}.memory.pickle``."""
    return os.path.join(os.fspath(folder), f"rank{rank}.memory.pickle")


@contextlib.contextmanager
def memory_snapshot(folder: str | os.PathLike | None, rank: int, max_entries: int = 100_000):
    """Record every CUDA allocation and free of this rank, each with the Python stack that made it, and write
    them to ``folder/rank{N}.memory.pickle`` when the body ends — also when it ends in an out-of-memory error,
    which is when a snapshot is most wanted. Drag the file onto https://pytorch.org/memory_viz: the active memory
    over time, one band per tensor; click a band for its stack.

    This is PyTorch's memory snapshot (``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``): the
    allocator's own record, so it answers *which* tensors made the peak, where ``max_memory_allocated`` gives only
    the number. ``max_entries`` keeps the last events only (each costs a few KB of host memory). CUDA only; with
    ``folder=None`` it does nothing.
    """
    if folder is None:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
    finally:
        path = snapshot_path(folder, rank)
        torch.cuda.memory._dump_snapshot(path + ".part")
        os.replace(path + ".part", path)  # a reader never sees half a file
        torch.cuda.memory._record_memory_history(enabled=None)


# PyTorch's memory tracker's kinds of tensor, in the names a run's memory uses.
PEAK_KINDS = {"Parameter": "weights", "Gradient": "gradients", "Optstate": "optimizer", "Activation": "activations",
              "Temp": "temporaries", "Buffer": "buffers", "Other": "inputs"}


def peak_memory(step, *held, device: torch.device | None = None) -> dict[str, int]:
    """The most bytes of tensors alive at once on this rank while ``step()`` runs: ``{"total": ..., kind: ...}``,
    what each kind held at that moment.

    Counted by PyTorch's own tracker (``torch.distributed._tools.mem_tracker.MemTracker``), on any device: a
    dispatch mode that sees each tensor an operator makes and follows its storage until it is freed (or resized
    to nothing, as FSDP frees a gathered weight). ``held``: the modules, optimizers and tensors made before the
    step (its parameters and gradients, the optimizer's state, the inputs), which count from the start. The kinds
    are the tracker's: weights, gradients, optimizer, activations (made in forward), temporaries (made in backward:
    the activations' gradients, and a gradient that autograd did not write into a ``.grad``), buffers, inputs.
    ``device``: whose memory (default: the device that held the most).
    """
    import warnings

    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with warnings.catch_warnings():
        # A parameter whose .grad autograd never writes (a sharded one: its gradient comes from a reduce-scatter)
        # makes the tracker's gradient hook see None, and warn; there is nothing to count there.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass of tensor")
        tracker.track_external(*held)
        with tracker:
            step()
    peaks = tracker.get_tracker_snapshot("peak")
    if not peaks:
        return {"total": 0}
    snap = peaks[torch.device(device)] if device is not None else max(peaks.values(), key=lambda s: s["Total"])
    kinds = {PEAK_KINDS[kind.value]: n for kind, n in snap.items() if kind != "Total" and n}
    return {"total": snap["Total"], **kinds}


def step() -> None:
    """Tell this rank's profiler (if :func:`trace` is on) that a training step ended."""
    if _PROFILER is not None:
        with _native_log_hidden():
            _PROFILER.step()


@contextlib.contextmanager
def _native_log_hidden():
    """Hide what the profiler's C++ side (Kineto) writes straight to the process's stderr as it starts and stops
    recording ("USDT: ... profiler_start", "STAGE: ... Completed Stage"): forwarded from a rank into a notebook
    it is a red block that reads like an error, and it is not one. Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# --- the analysis of a finished run ---------------------------------------------------


def count_params(config: dict) -> int:
    """Parameters N of the model a run's config trains (built on the meta device: no memory, no time)."""
    from .config import TrainConfig
    from .model import GPT

    with torch.device("meta"):
        return GPT(TrainConfig.from_dict(config).model_config()).num_params()


def _cover(intervals: list[tuple[float, float, str]], lo: float, hi: float) -> dict[str, float]:
    """Seconds of [lo, hi] that are communication, compute or idle (see the module docstring)."""
    events = []
    for start, end, what in intervals:
        start, end = max(start, lo), min(end, hi)
        if end > start:
            events += [(start, 1, what), (end, -1, what)]
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times close before opening
    depth = {"waiting": 0, "blocking": 0, "compute": 0, "comm": 0}
    out = {"compute": 0.0, "comm": 0.0, "idle": 0.0}
    at = lo
    for time, delta, what in events:
        if time > at:
            kind = ("idle" if depth["waiting"] else "comm" if depth["blocking"] else "compute" if depth["compute"]
                    else "comm" if depth["comm"] else "idle")
            out[kind] += time - at
            at = time
        depth[what] += delta
    out["idle"] += hi - at
    return out


def time_shares(timeline: list[dict], steps: list[int] | None = None) -> dict[int, dict]:
    """Per rank: seconds and shares of compute, communication and idle within ``steps``' wall time.

    ``timeline`` holds a RunResult's spans. Returns ``{rank: {"wall_s", "compute_s",
    "comm_s", "idle_s", "compute", "comm", "idle"}}``; ranks without ``step``
    spans (a run recorded with ``record=False``) are left out.
    """
    by_key: dict[tuple[int, int], list[dict]] = {}
    for span in timeline:
        by_key.setdefault((span["rank"], span["step"]), []).append(span)
    totals: dict[int, dict] = {}
    for (rank, step_no), spans in sorted(by_key.items()):
        if step_no < 0 or (steps is not None and step_no not in steps):
            continue
        windows = [s for s in spans if s["kind"] == "step"]
        if not windows:
            continue
        intervals = [(s["start_s"], s["end_s"], "compute") for s in spans if s["kind"] in COMPUTE_KINDS]
        intervals += [(s["start_s"] + s.get("wait_s", 0.0), s["end_s"], "blocking" if s.get("blocking") else "comm")
                      for s in spans if s["kind"] == "comm"]
        intervals += [(*w, "waiting") for w in map(waiting, spans) if w]
        for w in windows:
            part = _cover(intervals, w["start_s"], w["end_s"])
            t = totals.setdefault(rank, {"wall_s": 0.0, "compute_s": 0.0, "comm_s": 0.0, "idle_s": 0.0})
            t["wall_s"] += w["end_s"] - w["start_s"]
            for kind, seconds in part.items():
                t[f"{kind}_s"] += seconds
    for t in totals.values():
        wall = t["wall_s"]
        for kind in ("compute", "comm", "idle"):
            t[kind] = t[f"{kind}_s"] / wall if wall > 0 else 0.0
    return totals


def summarize(result, peak_flops: float | None = None, baseline=None, n_params: int | None = None) -> dict:
    """The numbers that judge a run, as a plain dict (JSON-ready).

    ``result`` and ``baseline`` are RunResults, their dicts or JSON file paths.
    ``peak_flops`` is one device's peak FLOP/s (e.g. ``get_gpu("h100").peak_flops("bf16")``);
    without it MFU is None. ``n_params`` defaults to the parameters of the run's model.

    Keys: ``ranks`` ({rank: seconds and shares, see :func:`time_shares`}),
    ``steps_analysed``, ``tokens_per_s``, ``tokens_per_s_per_rank``, ``n_params``,
    ``flops_per_token`` (6·N), ``achieved_flops`` (FLOP/s, all ranks), ``peak_flops``,
    ``mfu``, ``baseline_tokens_per_s_per_rank``, ``scaling_efficiency``, ``world_size``,
    ``device``, ``notes`` (sentences about what could not be computed).
    """
    result = RunResult.load(result)
    cfg = result.config
    steps = len(result.losses)
    analysed = list(range(1, steps)) if steps > 1 else [0]  # the first step pays for warm-up
    shares = time_shares(result.timeline, analysed)
    n = n_params if n_params is not None else count_params(cfg)
    world = result.world_size
    notes = []
    if not shares:
        notes.append("no timeline was recorded (record=False / --no-record), so no time shares.")
    if cfg.get("profile"):
        wait, warmup, active = _schedule(steps)
        notes.append(f"steps {wait}-{wait + warmup + active - 1} ran under torch.profiler, which slows them "
                     f"a little; compare throughput without --profile.")
    achieved = 6 * n * result.tokens_per_s
    mfu = None
    if peak_flops:
        mfu = achieved / (world * peak_flops)
    else:
        notes.append("MFU needs the peak FLOP/s of one device: pass --peak-tflops or --gpu NAME "
                     "(see gpucourse.modeled.gpus).")
    efficiency = base_per_rank = None
    if baseline is not None:
        base = RunResult.load(baseline)
        base_per_rank = base.tokens_per_s / base.world_size
        if base_per_rank > 0:
            efficiency = (result.tokens_per_s / world) / base_per_rank
        for key in ("model", "seq_len"):
            if base.config.get(key) != cfg.get(key):
                notes.append(f"the baseline trains {key}={base.config.get(key)!r}, this run {key}={cfg.get(key)!r}: "
                             f"tokens/s are not comparable.")
    return {
        "world_size": world, "device": result.device, "steps_analysed": analysed, "ranks": shares,
        "tokens_per_s": result.tokens_per_s, "tokens_per_s_per_rank": result.tokens_per_s / world,
        "n_params": n, "flops_per_token": 6 * n, "achieved_flops": achieved, "peak_flops": peak_flops,
        "mfu": mfu, "baseline_tokens_per_s_per_rank": base_per_rank, "scaling_efficiency": efficiency,
        "notes": notes,
    }


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_summary(summary: dict, peak_name: str | None = None) -> str:
    """The summary as the lines ``gpucourse train --profile`` prints.

    ``peak_name`` says where the peak came from (e.g. ``"h100 bf16"``).
    """
    lines = []
    if summary["ranks"]:
        head = f"time per step, steps {summary['steps_analysed'][0]}-{summary['steps_analysed'][-1]} ("
        lines += [f"{head}compute = forward+backward+optimizer;",
                  f"{' ' * len(head)}communication = collectives not hidden behind compute):"]
    for rank, s in sorted(summary["ranks"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"  rank {rank}: compute {s['compute']:6.1%}  communication {s['comm']:6.1%}  "
                     f"idle {s['idle']:6.1%}   of {1e3 * s['wall_s'] / len(summary['steps_analysed']):.1f} ms")
    lines.append(f"throughput      {summary['tokens_per_s']:,.0f} tokens/s "
                 f"({summary['tokens_per_s_per_rank']:,.0f} per rank)")
    lines.append(f"model FLOPs     6 x N x tokens, N = {summary['n_params']:,} parameters: "
                 f"{_si(summary['achieved_flops'], 'FLOP/s')} achieved")
    if summary["mfu"] is not None:
        source = f" ({peak_name})" if peak_name else ""
        lines.append(f"MFU             {100 * summary['mfu']:.3g}% of {summary['world_size']} x "
                     f"{_si(summary['peak_flops'], 'FLOP/s')}{source}")
    if summary["scaling_efficiency"] is not None:
        lines.append(f"scaling         {summary['scaling_efficiency']:.1%} efficiency: "
                     f"{summary['tokens_per_s_per_rank']:,.0f} tokens/s per rank vs "
                     f"{summary['baseline_tokens_per_s_per_rank']:,.0f} in the baseline")
    for note in summary["notes"]:  # folded at words, so that a notebook's output area need not break them
        lines += textwrap.wrap(f"note: {note}", width=NOTE_WIDTH, subsequent_indent="      ",
                               break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)
