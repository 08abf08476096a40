"""How fast the collectives are here: time, algorithm bandwidth and bus bandwidth per message size.

``gpucourse bandwidth --world-size 2`` starts ranks through
:func:`gpucourse.launch` and times each collective over a range of message
sizes, the way NVIDIA's nccl-tests do, so the numbers can be compared with
theirs and with a GPU's datasheet:

- **size** (``bytes``): the buffer the operation is about — the tensor of an
  all-reduce or broadcast, the gathered output of an all-gather, the full input
  of a reduce-scatter (the same convention as :mod:`gpucourse.comm`).
- **time** (``time_s``): seconds per call, after warm-up, averaged over the
  timed calls; the slowest rank's (a collective is done when the last rank is).
- **algorithm bandwidth** ``algbw = bytes / time``, in GB/s (10^9 bytes).
- **bus bandwidth** ``busbw = algbw × factor``, with nccl-tests' factor for n
  ranks: all-reduce 2(n−1)/n, all-gather and reduce-scatter (n−1)/n, broadcast
  1. The factor counts what each rank must really send with the ring
  algorithm, so busbw can be compared across operations and rank counts, and
  with the link's hardware bandwidth: a good all-reduce approaches the link.

Small messages are dominated by latency (time hardly grows with size), large
ones by bandwidth (time grows with size, busbw flattens at its ceiling).
:func:`memcpy_bandwidth` times a plain memory copy of the same size on one
rank: on CPU ranks ('virtual GPUs') every collective is memory copies between
processes, so that is the ceiling their bus bandwidth is measured against.
Sizes use binary units (1 KB = 1024 bytes), as nccl-tests' ``-b 1K -e 64M``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..comm import RING_FACTOR, all_gather_flat, reduce_scatter_flat
from ..readable import human_bytes
from ..runtime import current, launch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
KB, MB = 1 << 10, 1 << 20
SIZES = tuple(KB * 4 ** i for i in range(9))  # 1 KB, 4 KB, ... 64 MB
QUICK_SIZES = (KB, 64 * KB, 4 * MB, 64 * MB)
MOST_BYTES = 4 << 30  # the largest message timed
_UNITS = {"": 1, "B": 1, "K": KB, "KB": KB, "KIB": KB, "M": MB, "MB": MB, "MIB": MB, "G": 1 << 30, "GB": 1 << 30,
          "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"64MB"`` / ``"64M"`` / ``"1024"`` -> bytes (binary units: 1 KB = 1024 bytes)."""
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1
    if unit not in _UNITS or not value * _UNITS.get(unit, 1) >= 1:  # NaN is not: nor is under a byte
        raise ValueError(f"size {text!r} must be a positive number of bytes, optionally with K, KB, M, MB or G "
                         f"(1 KB = 1024 bytes).")
    if value * _UNITS[unit] > MOST_BYTES:  # infinity too: every size is allocated, on each rank
        raise ValueError(f"size {text!r} is more than {human_bytes(MOST_BYTES, binary=True)}, where every link's bus "
                         f"bandwidth has long levelled off; give a smaller one.")
    return int(value * _UNITS[unit])


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``n`` ranks (the ring algorithm's bytes sent per payload byte)."""
    return RING_FACTOR[op](n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(op: str, numel: int, n: int, device: torch.device):
    """A no-argument function running one ``op`` on float32 buffers of ``numel`` elements (the size)."""
    if op == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.ones(numel, device=device)
        return lambda: dist.broadcast(t, src=0)
    full, part = torch.ones(numel, device=device), torch.ones(numel // n, device=device)
    if op == "all_gather":
        return lambda: all_gather_flat(full, part)
    if op == "reduce_scatter":
        return lambda: reduce_scatter_flat(part, full)
    raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}.")


def _timed(fn, device: torch.device, warmup: int, budget_s: float, min_iters: int, max_iters: int) -> float:
    """Seconds per call of the collective ``fn``: warm-up, then as many calls as fit ``budget_s``.

    Every rank must make the same number of calls, so the count comes from the
    slowest rank's warm-up (one all-reduce, outside the timed region).
    """
    _sync(device)
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    _sync(device)
    per_call = torch.tensor([(time.perf_counter() - start) / max(warmup, 1)], device=device)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    iters = int(min(max_iters, max(min_iters, budget_s / max(per_call.item(), 1e-9))))
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)  # on CUDA the calls only queued work: wait for it, once, after the timed calls
    return (time.perf_counter() - start) / iters


def memcpy_bandwidth(nbytes: int, device: str | torch.device = "cpu", budget_s: float = 0.2,
                     min_iters: int = 3) -> dict:
    """Time copying ``nbytes`` from one buffer to another on ``device``.

    Returns ``{"bytes", "time_s", "GBps"}``: bytes copied per second (each byte
    read once and written once), in GB/s. On CPU it uses this process's torch
    threads. Call it inside a rank on CUDA, never in a notebook kernel that
    launches ranks (it would initialise CUDA there).
    """
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    _sync(device)
    start = time.perf_counter()
    copy()
    _sync(device)
    first = time.perf_counter() - start
    iters = max(min_iters, int(budget_s / max(first, 1e-9)))
    start = time.perf_counter()
    for _ in range(iters):
        copy()
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    return {"bytes": nbytes, "time_s": seconds, "GBps": nbytes / seconds / 1e9}


def _rank_measure(ops, sizes, warmup: int, budget_s: float, min_iters: int, max_iters: int,
                  copy_bytes: int | None) -> dict:
    """One rank's timings: ``{"times": [[op, bytes, seconds], ...], "copy": memcpy or None}``."""
    ctx = current()
    n, device = ctx.world_size, ctx.device
    times = []
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4 // n * n)  # float32, divisible into n equal shards
            fn = _call(op, numel, n, device)
            times.append([op, numel * 4, _timed(fn, device, warmup, budget_s, min_iters, max_iters)])
    copy = None
    if copy_bytes:
        dist.barrier()  # the other ranks wait, so the copy has the memory to itself
        if ctx.rank == 0:
            copy = memcpy_bandwidth(copy_bytes, device)
        dist.barrier()
    return {"times": times, "copy": copy}


def rows_from(rank_results: list[dict], world_size: int) -> list[dict]:
    """The table from each rank's timings: one ``{op, bytes, time_s, algbw_GBps, busbw_GBps}`` per (op, size)."""
    rows = []
    for i, (op, nbytes, _) in enumerate(rank_results[0]["times"]):
        seconds = max(r["times"][i][2] for r in rank_results)
        algbw = nbytes / seconds / 1e9
        rows.append({"op": op, "bytes": nbytes, "time_s": seconds, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * bus_factor(op, world_size)})
    return rows


def measure(world_size: int = 2, ops=OPS, sizes=None, *, quick: bool = False, device: str = "auto",
            copy_bytes: int | None = None, timeout: float | None = 600, quiet: bool = True) -> dict:
    """Time every op of ``ops`` at every size of ``sizes`` on ``world_size`` ranks.

    Returns ``{"world_size", "device", "rows": [{op, bytes, time_s, algbw_GBps,
    busbw_GBps}, ...], "memcpy": memcpy_bandwidth(copy_bytes) on rank 0 or None}``.
    ``sizes`` defaults to :data:`SIZES` (1 KB to 64 MB), or :data:`QUICK_SIZES`
    with ``quick``, which also warms up once and times about 0.05 s per point
    instead of 0.25 s.
    """
    from ..runtime.launcher import plan_device

    for op in ops:
        if op not in OPS:
            raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}.")
    if world_size < 2:
        raise ValueError(f"world_size={world_size} must be at least 2: a collective needs ranks to talk to.")
    plan = plan_device(device, world_size)
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    warmup, budget, min_iters = (1, 0.05, 2) if quick else (3, 0.25, 5)
    per_rank = launch(_rank_measure, list(ops), [int(s) for s in sizes], warmup, budget, min_iters, 1000,
                      copy_bytes, world_size=world_size, device=device, timeout=timeout, quiet=quiet)
    return {"world_size": world_size, "device": plan.device, "backend": plan.backend,
            "rows": rows_from(per_rank, world_size), "memcpy": per_rank[0]["copy"]}


def fit_alpha_beta(rows: list[dict], op: str, world_size: int) -> dict:
    """Fit the α–β model to measured ``rows`` of ``op``: time = steps·α + factor·bytes / busbw.

    A least-squares line through (bytes, time): its intercept is the latency of the ``steps`` the ring takes
    (2(n−1) for an all-reduce, n−1 for the others), its slope the bus bandwidth — the same two numbers
    :class:`gpucourse.modeled.cluster.Cluster` holds for real GPUs, so the fit can be set beside a modeled NVLink or
    InfiniBand. Returns ``{"alpha_s", "busbw_GBps", "steps"}``.
    """
    points = [(r["bytes"], r["time_s"]) for r in rows if r["op"] == op]
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise ValueError(f"fitting {op} needs times at two sizes at least; the rows hold {len(points)}.")
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points))
    if slope <= 0:
        raise ValueError(f"{op} times do not grow with the size (noise swamped them): measure again, "
                         f"or with larger sizes.")
    intercept = max(0.0, mean_t - slope * mean_b)
    steps = 2 * (world_size - 1) if op == "all_reduce" else world_size - 1
    return {"alpha_s": intercept / max(steps, 1), "busbw_GBps": bus_factor(op, world_size) / slope / 1e9,
            "steps": steps}


def format_table(measured: dict) -> str:
    """The rows as an aligned table, one block per op, then the copy bandwidth."""
    n = measured["world_size"]
    lines = [f"{n} ranks on {measured['device']} ({measured['backend']}); GB/s = 10^9 bytes per second; "
             f"busbw = algbw x nccl-tests factor"]
    lines.append(f"{'op':<15} {'size':>8} {'time':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}  factor")
    for row in measured["rows"]:
        lines.append(f"{row['op']:<15} {human_bytes(row['bytes'], binary=True):>8} {row['time_s'] * 1e6:>9.1f}us "
                     f"{row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f}  {bus_factor(row['op'], n):g}")
    copy = measured.get("memcpy")
    if copy:
        lines.append(f"memory copy of {human_bytes(copy['bytes'], binary=True)} on one rank: {copy['GBps']:.2f} GB/s "
                     f"({copy['time_s'] * 1e3:.2f} ms)")
        lines.append("  — the ceiling for CPU ranks, whose collectives are copies")
    return "\n".join(lines)


def _rank_busbw_vs_copy(nbytes: int, reps: int) -> dict:
    ctx = current()
    device = ctx.device
    fn = _call("all_reduce", nbytes // 4 // ctx.world_size * ctx.world_size, ctx.world_size, device)
    times, copies = [], []
    for _ in range(reps):
        times.append(_timed(fn, device, 1, 0.2, 3, 100))
        dist.barrier()
        if ctx.rank == 0:
            copies.append(memcpy_bandwidth(nbytes, device)["GBps"])
        dist.barrier()
    return {"times": times, "copies": copies}


def allreduce_busbw_vs_copy(reps: int = 3, nbytes: int = 64 * MB, world_size: int = 2):
    """Benchmark figure: all-reduce bus bandwidth at 64 MB on 2 ranks over one rank's memory-copy bandwidth.

    Returns a :class:`gpucourse.bench.Reading` (value = the ratio; medians over
    ``reps`` rounds in one launch, all-reduce and copy taking turns). Register
    it with ``bench.figure("allreduce_busbw_vs_copy", quick=dict(reps=2),
    full=dict(reps=5))``.
    """
    from .readings import Reading

    out = launch(_rank_busbw_vs_copy, nbytes, reps, world_size=world_size, timeout=600, quiet=True)
    times = [max(r["times"][i] for r in out) for i in range(reps)]
    busbw = [nbytes / t / 1e9 * bus_factor("all_reduce", world_size) for t in times]
    copy = out[0]["copies"]
    value = statistics.median(busbw) / statistics.median(copy)
    return Reading(value, {"busbw_GBps": busbw, "copy_GBps": copy, "bytes": nbytes, "world_size": world_size},
                   f"all_reduce busbw {statistics.median(busbw):.2f} GB/s vs copy {statistics.median(copy):.2f} GB/s "
                   f"({human_bytes(nbytes, binary=True)}, {world_size} ranks)")
