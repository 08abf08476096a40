"""Benchmarks: gpucourse's runtime and strategies against their PyTorch and Accelerate counterparts.

``gpucourse bench`` measures a list of *figures* (see :mod:`gpucourse.readings`
for what a figure is and how two sides are timed in turns). Adding a figure is
one function::

    @figure("my_ratio", target="<= 1.05", quick=dict(reps=3), full=dict(reps=9))
    def my_ratio(reps: int) -> Reading:
        # seconds of ours over seconds of theirs, each side's median
        times = interleave({"ours": time_ours, "theirs": time_theirs}, reps)
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
        return Reading(ratio(ours, theirs), {"ours_s": times["ours"], "theirs_s": times["theirs"]})

``quick`` and ``full`` are the keyword arguments the function gets under
``gpucourse bench --quick`` and ``gpucourse bench``; :func:`compare_runs` does
the interleaving for two or more training configs. :func:`main` runs every
registered figure (or only those named), prints a table and can write them as
one JSON object.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..files import write_atomic
from ..readable import human_bytes
from ..runtime import launch
from ..runtime.launcher import plan_device, preimport, visible_gpus
from ..train import run
from ..readings import FIGURES, WARMUP_STEPS, Figure, Reading, figure, interleave, parse_target, passed, ratio

# Ranks of every figure: the smallest group that communicates.
RANKS = 2
RUN_TIMEOUT_S = 600
# What launch_vs_notebook_launcher times, from the call: until the slowest rank
# entered the function, until it ended its first step, until the call returned.
LAUNCH_TIMES = ("entered_s", "first_step_s", "returned_s")


# --- step times of whole training runs -------------------------------------------------


def _steady_step_times(config: TrainConfig) -> list[float]:
    """Train ``config`` once; return its step times without the warm-up steps."""
    result = run(config, timeout=RUN_TIMEOUT_S, quiet=True)
    return result.step_times_s[WARMUP_STEPS:]


def compare_runs(configs: dict[str, TrainConfig], reps: int) -> tuple[dict, dict[str, float]]:
    """Train each config ``reps`` times, interleaved; return the raw step times and each one's median.

    The median is over every steady step of every repetition of that config.
    """
    runs = interleave({name: (lambda c=c: _steady_step_times(c)) for name, c in configs.items()}, reps)
    medians = {name: statistics.median(t for r in rs for t in r) for name, rs in runs.items()}
    detail = {name: {"config": configs[name].to_dict(), "median_step_s": medians[name],
                     "run_medians_s": [statistics.median(r) for r in rs], "step_times_s": rs}
              for name, rs in runs.items()}
    return detail, medians


def _bench_config(**changes) -> TrainConfig:
    """The layout the step-time figures train: tiny GPT, 2 data-parallel ranks, 16 sequences a step."""
    return TrainConfig(**{"model": "tiny", "dp": RANKS, "batch_size": 16, "impl": "torch", **changes})


@figure("dp_scratch_vs_ddp", quick=dict(reps=2, steps=15), full=dict(reps=4, steps=40))
def dp_scratch_vs_ddp(reps: int, steps: int) -> Reading:
    """Step time of our data parallel (one all-reduce per gradient) over PyTorch's DDP."""
    detail, med = compare_runs({"scratch": _bench_config(impl="scratch", steps=steps),
                                "torch": _bench_config(impl="torch", steps=steps)}, reps)
    detail.update(reps=reps, warmup_steps=WARMUP_STEPS)
    return Reading(ratio(med["scratch"], med["torch"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, DDP {med['torch'] * 1e3:.1f} ms per step")


@figure("recording_overhead", target="<= 1.03", quick=dict(reps=3, steps=20), full=dict(reps=8, steps=60))
def recording_overhead(reps: int, steps: int) -> Reading:
    """Step time with the timeline recorded over the same run without it."""
    detail, med = compare_runs({"record": _bench_config(record=True, steps=steps),
                                "no_record": _bench_config(record=False, steps=steps)}, reps)
    detail.update(reps=reps, warmup_steps=WARMUP_STEPS)
    return Reading(ratio(med["record"], med["no_record"]), detail,
                   f"on {med['record'] * 1e3:.2f} ms, off {med['no_record'] * 1e3:.2f} ms per step")


@figure("dp_bucketed_vs_ddp", target="<= 1.10", quick=dict(reps=2, steps=15), full=dict(reps=4, steps=40))
def dp_bucketed_vs_ddp(reps: int, steps: int) -> Reading:
    """Step time of bucketed, overlapped data parallel from scratch over DDP, the same bucket size."""
    detail, med = compare_runs({"bucketed": _bench_config(impl="scratch", bucket_mb=0.25, steps=steps),
                                "ddp": _bench_config(bucket_mb=0.25, steps=steps)}, reps)
    return Reading(ratio(med["bucketed"], med["ddp"]), detail,
                   f"bucketed {med['bucketed'] * 1e3:.1f} ms, DDP {med['ddp'] * 1e3:.1f} ms per step")


def _model_parallel_ratio(changes: dict, reps: int, steps: int, what: str) -> Reading:
    base = dict(dp=1, batch_size=16, steps=steps, **changes)
    detail, med = compare_runs({"scratch": _bench_config(impl="scratch", **base),
                                "torch": _bench_config(impl="torch", **base)}, reps)
    return Reading(ratio(med["scratch"], med["torch"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, {what} {med['torch'] * 1e3:.1f} ms per step")


@figure("pp_1f1b_scratch_vs_torch", target="<= 1.20", quick=dict(reps=2, steps=12), full=dict(reps=4, steps=30))
def pp_1f1b_scratch_vs_torch(reps: int, steps: int) -> Reading:
    """Step time of the 2-stage 1F1B pipeline from scratch over torch.distributed.pipelining's."""
    return _model_parallel_ratio(dict(pp=2, schedule="1f1b", microbatches=4), reps, steps, "Schedule1F1B")


@figure("tp_scratch_vs_torch", target="<= 1.20", quick=dict(reps=2, steps=12), full=dict(reps=4, steps=30))
def tp_scratch_vs_torch(reps: int, steps: int) -> Reading:
    """Step time of 2-way Megatron-style tensor parallel from scratch over DTensor's."""
    return _model_parallel_ratio(dict(tp=2), reps, steps, "DTensor")


def _blocking(span: dict) -> tuple[float, float]:
    """When a communication span kept its rank from computing: a blocking call all along, an asynchronous one
    from the moment the rank asked for its result (``waited_s``) until it had it."""
    return span.get("waited_s", span["start_s"]), span["end_s"]


def _in_flight(span: dict) -> float | None:
    """A message's time on its way, read at its receive: from the later of the send's start and the moment the
    receiver needed it, to the receive's end. None where a run cannot show it: an asynchronous receive whose
    data were sent before the rank asked for them (they may have come long before)."""
    needed = span.get("waited_s", span["start_s"])
    if span.get("op") != "recv" or "sent_s" not in span or ("waited_s" in span and needed > span["sent_s"]):
        return None
    return max(0.0, span["end_s"] - max(span["sent_s"], needed))


def measured_bubble(result) -> tuple[float, dict]:
    """Share of a pipeline run's stage-time not spent computing, and the op costs measured in it.

    What the simulator's bubble fraction counts: all but F, B and W. So a stage's
    time inside a send or a receive counts (an asynchronous one from when the rank
    waits for it), waiting and transferring alike, and so does its time before its
    first op and after its last — from the step's first forward on any stage (a
    stage already waiting for the next step's data is not in this step's bubble) to
    its last op. The Python between ops is work: each compute op costs its span
    plus what its stage did after it, outside communication, until its next one.
    The fraction is the median over the steps after the warm-up (runs without
    gradient accumulation; one pipeline's ranks).

    Costs: ``ops``, each steady step's compute-op costs, per stage in its order
    (what :func:`simulated_bubble` feeds the simulator); ``comm``, the mean time a
    message was on its way (:func:`_in_flight`; on CPU ranks mostly waking the other
    side, with a long tail).
    """
    stage_of = {int(r): s for r, s in result.extras["stage_of_rank"].items()}
    pp = result.config["pp"]
    ranks = [min(r for r, s in stage_of.items() if s == stage) for stage in range(pp)]
    fractions, ops, flights = [], [], []
    for step in range(WARMUP_STEPS, len(result.losses)):
        spans = [s for s in result.timeline if s["step"] == step and s["rank"] in ranks
                 and s["kind"] in ("forward", "backward", "comm")]
        first = min(s["start_s"] for s in spans if s["kind"] != "comm")
        last = max(s["end_s"] for s in spans)
        step_ops = []
        for rank in ranks:
            mine = [s for s in spans if s["rank"] == rank]
            compute = sorted((s for s in mine if s["kind"] != "comm"), key=lambda s: s["start_s"])
            blocked = [_blocking(s) for s in mine if s["kind"] == "comm"]
            # Each compute op's share of the stage's time: from its start (the first: the stage's) to the next one's.
            edges = [max(first, min(s["start_s"] for s in mine))] + [s["start_s"] for s in compute[1:]] \
                + [max(s["end_s"] for s in mine)]
            costs = [(b - a) - sum(max(0.0, min(b, y) - max(a, x)) for x, y in blocked)
                     for a, b in zip(edges, edges[1:])]
            step_ops.append(costs)
        ops.append(step_ops)
        fractions.append(1 - sum(map(sum, step_ops)) / (pp * (last - first)))
        flights += [t for s in spans if (t := _in_flight(s)) is not None]
    return statistics.median(fractions), {"comm": statistics.mean(flights) if flights else 0.0, "ops": ops}


def simulated_bubble(config: dict, cost: dict) -> float:
    """The simulator's bubble fraction for ``config``'s schedule fed a run's measured costs (see measured_bubble):
    each steady step laid out with its own ops' times and the mean message time; the median over the steps."""
    from ..parallel import schedules, schedules_virtual

    name, pp, m = config["schedule"], config["pp"], config["microbatches"]
    if name in schedules.SCHEDULES:
        ops = schedules.SCHEDULES[name](pp, m)
        sims = [schedules.simulate(ops, pp, m, cost_comm=cost["comm"], op_costs=step) for step in cost["ops"]]
    else:
        ops, layout = schedules_virtual.build(name, pp, m, config["virtual_stages"])
        sims = [schedules_virtual.simulate(ops, layout, m, cost_comm=cost["comm"], op_costs=step)
                for step in cost["ops"]]
    return statistics.median(sim.bubble_fraction for sim in sims)


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")


@figure("pp_bubble_measured_vs_simulated", target="0.8..1.25", quick=dict(reps=3, steps=8, microbatches=4),
        full=dict(reps=3, steps=20, microbatches=4))
def pp_bubble_measured_vs_simulated(reps: int, steps: int, microbatches: int) -> Reading:
    """Measured bubble (stage-time not computing) of 2-stage pipelines over the simulator's, fed the same runs'
    op costs (each step with its own ops' times: see measured_bubble), for every schedule; the value is the one
    furthest from 1. Each schedule runs ``reps`` times, interleaved with the others, and each side is the median
    over its runs: a moment of load on the machine moves one run, not the figure."""
    configs = {name: _bench_config(impl="scratch", dp=1, pp=RANKS, schedule=name, microbatches=microbatches,
                                   batch_size=16, steps=steps) for name in PIPELINE_SCHEDULES}
    pairs = interleave({name: (lambda c=c: _bubble_pair(c)) for name, c in configs.items()}, reps)
    ratios, detail = {}, {}
    for name, got in pairs.items():
        measured = statistics.median(g[0] for g in got)
        simulated = statistics.median(g[1] for g in got)
        ratios[name] = ratio(measured, simulated)
        detail[name] = {"measured": measured, "simulated": simulated, "runs": got}
    worst = max(ratios, key=lambda k: abs(ratios[k] - 1.0))
    return Reading(ratios[worst], {"ratios": ratios, **detail},
                   "; ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + f" (furthest from 1: {worst})")


def _bubble_pair(config: TrainConfig) -> tuple[float, float]:
    result = run(config, timeout=RUN_TIMEOUT_S, quiet=True)
    measured, cost = measured_bubble(result)
    return measured, simulated_bubble(result.config, cost)


@figure("pp_interleaved_bubble_vs_formula", target="== 1.0", quick=dict(), full=dict())
def pp_interleaved_bubble_vs_formula() -> Reading:
    """Interleaved 1F1B simulated with equal costs: idle over compute time against (p−1)/(v·m), p 4, m 8, v 2."""
    from ..parallel import schedules_virtual

    pp, m, v = 4, 8, 2
    ops, layout = schedules_virtual.build("interleaved-1f1b", pp, m, v)
    sim = schedules_virtual.simulate(ops, layout, m)
    formula = schedules_virtual.formula_bubble_ratio("interleaved-1f1b", pp, m, v)
    return Reading(round(sim.bubble_ratio / formula, 12), {"simulated": sim.bubble_ratio, "formula": formula},
                   f"simulated {sim.bubble_ratio:.4f}, (p-1)/(v·m) = {formula:.4f}")


@figure("pp_zb_vs_1f1b_idle", quick=dict(reps=2, steps=8), full=dict(reps=3, steps=20))
def pp_zb_vs_1f1b_idle(reps: int, steps: int) -> Reading:
    """Measured idle share of zero bubble (ZB-H1) over 1F1B's, 2 stages, 4 microbatches (expect below 1)."""
    configs = {name: _bench_config(impl="scratch", dp=1, pp=RANKS, schedule=name, microbatches=4, batch_size=16,
                                   steps=steps) for name in ("zb-h1", "1f1b")}
    idle = interleave({name: (lambda c=c: measured_bubble(run(c, timeout=RUN_TIMEOUT_S, quiet=True))[0])
                       for name, c in configs.items()}, reps)
    zb, one = statistics.median(idle["zb-h1"]), statistics.median(idle["1f1b"])
    return Reading(ratio(zb, one), {"zb-h1": idle["zb-h1"], "1f1b": idle["1f1b"]},
                   f"idle zb-h1 {zb:.3f}, 1f1b {one:.3f}")


@figure("pp_interleaved_scratch_vs_torch", target="<= 1.20", quick=dict(reps=2, steps=12), full=dict(reps=4, steps=30))
def pp_interleaved_scratch_vs_torch(reps: int, steps: int) -> Reading:
    """Step time of interleaved 1F1B (2 ranks, 2 chunks each) from scratch over ScheduleInterleaved1F1B's."""
    return _model_parallel_ratio(dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4), reps,
                                 steps, "ScheduleInterleaved1F1B")


def _memory_ratios(configs: list[TrainConfig], expected) -> dict:
    ratios = {}
    for cfg in configs:
        measured = run(cfg, timeout=RUN_TIMEOUT_S, quiet=True).memory
        for rank, mem in measured.items():
            want = expected(cfg, int(rank))
            for k in ("weights", "gradients", "optimizer"):
                ratios[f"{cfg.layout()} zero{cfg.zero} rank{rank} {k}"] = mem[k] / want[k]
    return ratios


def _worst(ratios: dict) -> float:
    return max(ratios.values(), key=lambda r: abs(r - 1.0))


@figure("zero_memory_vs_formula", target="== 1.0", quick=dict(), full=dict())
def zero_memory_vs_formula() -> Reading:
    """Measured weights, gradients and optimizer bytes per rank of scratch ZeRO-1/2 over the ZeRO formula."""
    from ..memory import num_params
    from ..parallel.zero import memory_formula

    n = num_params(_bench_config().model_config())
    configs = [_bench_config(impl="scratch", dp=d, zero=z, batch_size=12, steps=1) for d in (2, 3) for z in (1, 2)]
    ratios = _memory_ratios(configs, lambda cfg, rank: memory_formula(n, cfg.dp, cfg.zero))
    worst = _worst(ratios)
    return Reading(worst, {"ratios": ratios}, f"worst measured/formula ratio {worst:.6f} over {len(ratios)}")


@figure("zero3_memory_vs_formula", target="== 1.0", quick=dict(), full=dict())
def zero3_memory_vs_formula() -> Reading:
    """Measured weights, gradients, optimizer state and peak gathered bytes of scratch ZeRO-3 over its formula."""
    from ..memory import stage_units
    from ..parallel.zero3 import memory_formula

    configs = [_bench_config(impl="scratch", dp=d, zero=3, batch_size=12, steps=1, **kw)
               for d, kw in ((2, {}), (3, {}), (2, dict(tp=2)))]
    ratios = {}
    for cfg in configs:
        result = run(cfg, timeout=RUN_TIMEOUT_S, quiet=True)
        want = memory_formula(stage_units(cfg.model_config(), 1, 0, cfg.tp), cfg.dp)
        for rank, mem in result.memory.items():
            for k in ("weights", "gradients", "optimizer"):
                ratios[f"{cfg.layout()} rank{rank} {k}"] = mem[k] / want[k]
        ratios[f"{cfg.layout()} gathered"] = result.extras["zero"]["gathered_peak_bytes"] / want["gathered"]
    worst = _worst(ratios)
    return Reading(worst, {"ratios": ratios}, f"worst measured/formula ratio {worst:.6f} over {len(ratios)}")


@figure("zero3_scratch_vs_fsdp2", target="<= 1.3", quick=dict(reps=2, steps=12), full=dict(reps=4, steps=30))
def zero3_scratch_vs_fsdp2(reps: int, steps: int) -> Reading:
    """Step time of ZeRO-3 from scratch (flat shards per block) over FSDP2's fully_shard, 2 data-parallel ranks."""
    detail, med = compare_runs({"scratch": _bench_config(impl="scratch", zero=3, steps=steps),
                                "fsdp2": _bench_config(impl="torch", zero=3, steps=steps)}, reps)
    return Reading(ratio(med["scratch"], med["fsdp2"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, FSDP2 {med['fsdp2'] * 1e3:.1f} ms per step")


@figure("fsdp_tp_vs_scratch_dp_tp", quick=dict(reps=2, steps=10), full=dict(reps=3, steps=20))
def fsdp_tp_vs_scratch_dp_tp(reps: int, steps: int) -> Reading:
    """Step time of FSDP2 × DTensor TP (torchtitan's 2-D recipe) over scratch ZeRO-3 × tensor parallel, dp2 × tp2."""
    base = dict(dp=2, tp=2, zero=3, steps=steps)
    detail, med = compare_runs({"torch": _bench_config(impl="torch", **base),
                                "scratch": _bench_config(impl="scratch", **base)}, reps)
    return Reading(ratio(med["torch"], med["scratch"]), detail,
                   f"FSDP2×DTensor {med['torch'] * 1e3:.1f} ms, scratch ZeRO-3×TP {med['scratch'] * 1e3:.1f} ms "
                   f"per step (4 ranks)")


@figure("sp_activation_ratio", target="== 0.5", quick=dict(), full=dict())
def sp_activation_ratio() -> Reading:
    """What the blocks' LayerNorms save per rank with sequence parallelism over without, tp = 2 (1/tp exactly)."""
    saved = {}
    for sp in (False, True):
        result = run(_bench_config(impl="scratch", dp=1, tp=RANKS, steps=1, sequence_parallel=sp),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        saved[sp] = result.extras["activations_by_region"]["block layernorms"]
    return Reading(ratio(saved[True], saved[False]), {"tp_bytes": saved[False], "sp_bytes": saved[True]},
                   f"{human_bytes(saved[True])} with sequence parallelism, {human_bytes(saved[False])} without")


def ring_work_times(seq_len: int, cp: int, zigzag: bool, reps: int, heads: int = 4, head_dim: int = 64) -> list:
    """Seconds each of ``cp`` ring-attention ranks computes per layer (forward and backward of its blocks).

    Each rank's own queries against every block of keys its mask lets it see, with the
    ring's block function — the compute of ``RingAttention`` without its transfers (a
    rank that finishes early waits in the ring, so wall time alone would hide the
    imbalance). Ranks are timed in turn in this process, each on one thread; the least disturbed
    of its runs counts.
    """
    from ..data import context_positions
    from ..parallel.context_parallel import block_attention, block_attention_backward, visible_part

    every = [context_positions(seq_len, r, cp, zigzag) for r in range(cp)]
    gen = torch.Generator().manual_seed(0)
    t = seq_len // cp
    qkv = [[torch.randn(1, heads, t, head_dim, generator=gen) for _ in range(3)]
           for _ in range(cp)]

    def work(rank: int) -> float:
        q, k, v = qkv[rank]
        start = time.perf_counter()
        for owner in range(cp):
            part = visible_part(every[rank], every[owner])
            if part is not None:
                rows, cols, bias, causal = part
                q_j, k_j, v_j = q.index_select(-2, rows), k.index_select(-2, cols), v.index_select(-2, cols)
                o, lse = block_attention(q_j, k_j, v_j, bias, causal, head_dim ** -0.5)
                block_attention_backward(torch.ones_like(o), q_j, k_j, v_j, o, lse, bias, causal, head_dim ** -0.5)
        return time.perf_counter() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as each rank of a launch has
    try:
        for rank in range(cp):
            work(rank)  # warm-up
        runs = [[work(rank) for rank in range(cp)] for _ in range(reps)]  # ranks interleaved: load hits all alike
    finally:
        torch.set_num_threads(threads)
    return [min(r[rank] for r in runs) for rank in range(cp)]  # the least disturbed of each rank's runs


@figure("cp_zigzag_imbalance", target="<= 1.15", quick=dict(reps=5), full=dict(reps=9))
def cp_zigzag_imbalance(reps: int) -> Reading:
    """Ring attention's busiest over least busy rank, causal, 4 ranks of a 4096-token sequence, zig-zag split."""
    plain = ring_work_times(4096, 4, zigzag=False, reps=reps)
    zigzag = ring_work_times(4096, 4, zigzag=True, reps=reps)
    return Reading(ratio(max(zigzag), min(zigzag)),
                   {"plain_s": plain, "zigzag_s": zigzag, "plain_ratio": max(plain) / min(plain)},
                   f"zig-zag {max(zigzag) / min(zigzag):.2f}, plain chunks {max(plain) / min(plain):.2f} "
                   f"(busiest over least busy rank)")


@figure("cp_ring_vs_allgather", quick=dict(reps=2, steps=10), full=dict(reps=3, steps=20))
def cp_ring_vs_allgather(reps: int, steps: int) -> Reading:
    """Step time of context parallelism with ring attention over all-gather attention, cp = 2, 1024 tokens."""
    base = dict(model="tiny-long", dp=1, cp=RANKS, seq_len=1024, batch_size=2, steps=steps)
    detail, med = compare_runs({"ring": _bench_config(impl="scratch", cp_algo="ring", **base),
                                "allgather": _bench_config(impl="scratch", cp_algo="allgather", **base)}, reps)
    return Reading(ratio(med["ring"], med["allgather"]), detail,
                   f"ring {med['ring'] * 1e3:.1f} ms, all-gather {med['allgather'] * 1e3:.1f} ms per step")


@figure("cp_scratch_vs_torch", target="<= 1.20", quick=dict(reps=2, steps=10), full=dict(reps=3, steps=20))
def cp_scratch_vs_torch(reps: int, steps: int) -> Reading:
    """Step time of our ring attention over PyTorch's (K/V by all-to-all), cp = 2, zig-zag, 1024 tokens.

    The gradients are averaged in 0.25 MB buckets in both (ours overlapped, DDP's): the ring is what differs.
    """
    base = dict(model="tiny-long", dp=1, cp=RANKS, seq_len=1024, batch_size=2, cp_algo="ring", zigzag=True,
                bucket_mb=0.25, steps=steps)
    detail, med = compare_runs({"scratch": _bench_config(impl="scratch", **base),
                                "torch": _bench_config(impl="torch", **base)}, reps)
    return Reading(ratio(med["scratch"], med["torch"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, PyTorch's ring {med['torch'] * 1e3:.1f} ms per step")


@figure("moe_a2a_bytes_vs_formula", target="== 1.0", quick=dict(), full=dict())
def moe_a2a_bytes_vs_formula() -> Reading:
    """Expert parallelism's all-to-all bytes per step, measured over ``memory.all_to_all_bytes``, ep = 2."""
    from ..memory import all_to_all_bytes

    cfg = _bench_config(impl="scratch", moe_experts=4, ep=RANKS, steps=3)
    result = run(cfg, timeout=RUN_TIMEOUT_S, quiet=True)
    sent = [sum(c["bytes"] for c in result.comm if c["op"] == "all_to_all" and c["step"] == s)
            for s in range(cfg.steps)]
    want = all_to_all_bytes(cfg)
    worst = max(sent, key=lambda b: abs(b - want))  # the step furthest from the formula
    return Reading(ratio(worst, want),
                   {"per_step": sent, "formula": want},
                   f"{human_bytes(sent[0])} per step measured, {human_bytes(want)} by the formula")


@figure("ep_vs_replicated_moe", quick=dict(reps=2, steps=10), full=dict(reps=3, steps=30))
def ep_vs_replicated_moe(reps: int, steps: int) -> Reading:
    """Step time of expert parallelism (ep = 2, 8 experts) over the same mixture replicated on both ranks."""
    base = dict(impl="scratch", moe_experts=8, steps=steps)
    detail, med = compare_runs({"ep": _bench_config(ep=RANKS, **base), "replicated": _bench_config(**base)}, reps)
    return Reading(ratio(med["ep"], med["replicated"]), detail,
                   f"ep {med['ep'] * 1e3:.1f} ms, replicated {med['replicated'] * 1e3:.1f} ms per step")


@figure("moe_imbalance_aux_vs_none", quick=dict(steps=100), full=dict(steps=200))
def moe_imbalance_aux_vs_none(steps: int) -> Reading:
    """Most over mean tokens per expert over the last 20 steps, with the balance loss (0.1) over without."""
    loads = {}
    for name, aux in (("aux", 0.1), ("none", 0.0)):
        result = run(_bench_config(impl="scratch", dp=1, moe_experts=4, moe_aux=aux, steps=steps),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        last = result.extras["moe"]["tokens_per_expert"][-20:]
        loads[name] = statistics.mean(max(layer) / statistics.mean(layer) for step in last for layer in step)
    return Reading(ratio(loads["aux"], loads["none"]), loads,
                   f"max/mean tokens per expert {loads['aux']:.2f} with the balance loss, {loads['none']:.2f} "
                   f"without")


@figure("memory_estimate_vs_measured", target="== 1.0", quick=dict(), full=dict())
def memory_estimate_vs_measured() -> Reading:
    """Measured weights, gradients and optimizer bytes over ``gpucourse memory``'s estimate, several layouts."""
    from ..memory import estimate

    configs = [_bench_config(impl="scratch", steps=1, **kw) for kw in
               (dict(dp=1), dict(dp=2), dict(dp=2, zero=2), dict(dp=1, tp=2), dict(dp=1, pp=2, microbatches=2))]
    ratios = _memory_ratios(configs, lambda cfg, rank: estimate(cfg)["per_rank"][rank])
    worst = _worst(ratios)
    return Reading(worst, {"ratios": ratios}, f"worst measured/estimated ratio {worst:.6f} over {len(ratios)}")


@figure("checkpointing_activation_ratio", quick=dict(), full=dict())
def checkpointing_activation_ratio() -> Reading:
    """Saved activation bytes with activation checkpointing over without (tiny model)."""
    sizes = {}
    for ckpt in (False, True):
        result = run(_bench_config(impl="scratch", dp=1, steps=1, checkpoint_activations=ckpt),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        sizes[ckpt] = result.memory["0"]["activations"]
    value = ratio(sizes[True], sizes[False])
    return Reading(value, {"plain_bytes": sizes[False], "checkpointed_bytes": sizes[True]},
                   f"{human_bytes(sizes[True])} with checkpointing, {human_bytes(sizes[False])} without")


@figure("selective_activation_ratio", quick=dict(), full=dict())
def selective_activation_ratio() -> Reading:
    """Saved activation bytes with selective recomputation over none, attention written out (tiny model, bf16
    weights, as Korthikanti et al. count), beside their formula's ratio for one layer at this shape (with dropout,
    which the run has not: its scores are 2 of the formula's 5 bytes)."""
    from ..memory import korthikanti_layer_bytes

    sizes = {}
    for recompute in ("none", "selective"):
        result = run(_bench_config(impl="scratch", dp=1, steps=1, precision="bf16", master_weights=True,
                                   attention="math", checkpoint_activations=recompute),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        sizes[recompute] = result.memory["0"]["activations"]
    cfg = _bench_config(dp=1)
    mc = cfg.model_config()
    paper = [korthikanti_layer_bytes(cfg.seq_len, cfg.batch_size, mc.n_embd, mc.n_head, recompute=r)
             for r in ("selective", "none")]
    value = ratio(sizes["selective"], sizes["none"])
    return Reading(value, {"none_bytes": sizes["none"], "selective_bytes": sizes["selective"],
                           "korthikanti_ratio": paper[0] / paper[1]},
                   f"{human_bytes(sizes['selective'])} selective, {human_bytes(sizes['none'])} none "
                   f"({value:.3f}; Korthikanti et al.'s layer: {paper[0] / paper[1]:.3f})")


@figure("allreduce_busbw_vs_copy", quick=dict(reps=2), full=dict(reps=5))
def allreduce_busbw_vs_copy(reps: int) -> Reading:
    """All-reduce bus bandwidth at 64 MB on 2 ranks over a same-size memory copy: the ceiling on one host."""
    from ..bandwidth import allreduce_busbw_vs_copy as measure_busbw

    return measure_busbw(reps=reps)


@figure("grade_one_exercise_s", target="< 10", quick=dict(), full=dict())
def grade_one_exercise_s() -> Reading:
    """Wall time to grade one distributed exercise (ex01, ring all-reduce, 1–3 CPU ranks)."""
    from ..grading import time_grade_one_exercise

    wall = time_grade_one_exercise(exercise="ex01")
    return Reading(wall, {"exercise": "ex01"}, f"{wall:.1f} s for ex01")


@figure("grade_class_20_s", quick=dict(learners=4), full=dict(learners=20))
def grade_class_20_s(learners: int) -> Reading:
    """Wall time to grade a class of 20 copies of solutions/ with --jobs 2 (quick: 4 learners, scaled to 20)."""
    from ..grading import time_grade_class

    wall = time_grade_class(learners=learners, jobs=2)
    value = wall * 20 / learners
    return Reading(value, {"learners_graded": learners, "wall_s": wall},
                   f"{value:.0f} s for 20" + (f" (scaled from {learners} in {wall:.0f} s)" if learners != 20 else ""))


@figure("live_view_overhead", target="<= 1.03", quick=dict(reps=3, steps=20), full=dict(reps=8, steps=60))
def live_view_overhead(reps: int, steps: int, interval_s: float = 0.75) -> Reading:
    """Step time with the notebook's live view on over off.

    Both sides train the bench's layout (tiny GPT, 2 data-parallel ranks, 16
    sequences a step), taking turns. The live side draws into a sink that
    serialises every bundle to JSON, as the kernel would before sending it,
    so the cost is measured in plain python too.
    """
    from ..viz.live import LiveView

    config = TrainConfig(model="tiny", dp=RANKS, batch_size=16, steps=steps)
    sent = []

    def side(live: bool) -> list[float]:
        view = LiveView(config, interval_s=interval_s, sink=lambda b: sent.append(len(json.dumps(b)))) if live else None
        result = run(config, timeout=RUN_TIMEOUT_S, quiet=True, on_step=view.on_step if view else None,
                     on_message=view.on_message if view else None)
        if view:
            view.finish(result)
        return result.step_times_s[WARMUP_STEPS:]

    times = interleave({"live": lambda: side(True), "off": lambda: side(False)}, reps)
    med = {k: statistics.median(t for run_times in v for t in run_times) for k, v in times.items()}
    detail = {"reps": reps, "steps": steps, "interval_s": interval_s, "warmup_steps": WARMUP_STEPS,
              "median_step_s": med, "step_times_s": times, "bundles_sent": len(sent)}
    return Reading(ratio(med["live"], med["off"]), detail,
                   f"live {med['live'] * 1e3:.2f} ms, off {med['off'] * 1e3:.2f} ms per step, "
                   f"{len(sent)} redraws")


@figure("tour_quick_s", quick=dict(), full=dict())
def tour_quick_s() -> Reading:
    """Wall time of ``gpucourse tour --quick`` (every layout, checked against one device) on this machine."""
    from .. import tour

    out = tempfile.mkdtemp(prefix="gpucourse-tour-")
    try:
        start = time.perf_counter()
        code = tour.main(quick=True, out=os.path.join(out, "report.html"))
        wall = time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return Reading(wall, {"exit_code": code}, f"{wall:.1f} s, exit code {code}")


@figure("course_smoke_s", target="< 600", quick=dict(), full=dict())
def course_smoke_s() -> Reading:
    """Wall time to execute every notebook in smoke mode (GPUCOURSE_SMOKE=1), one fresh kernel each."""
    from .. import lab

    start = time.perf_counter()
    seconds = lab.run_course(smoke=True, stream=sys.stdout)
    wall = time.perf_counter() - start
    slowest = max(seconds, key=seconds.get)
    return Reading(wall, {"notebooks_s": seconds},
                   f"{wall:.0f} s for {len(seconds)} notebooks; slowest {slowest} {seconds[slowest]:.0f} s")


@figure("first_check_s", quick=dict(), full=dict())
def first_check_s() -> Reading:
    """From the course's JupyterLab being up to ``check("ex01")`` answering in notebook 01, in headless Chromium."""
    from .. import lab

    with tempfile.TemporaryDirectory(prefix="gpucourse-lab-") as tmp:
        root = lab.course_copy(tmp)
        env = {"GPUCOURSE_SMOKE": "1", "GPUCOURSE_PROGRESS": os.path.join(tmp, "progress.json")}
        with lab.LabServer(root, env=env) as server, lab.Browser() as browser:
            found = lab.first_check(server, browser)
    if "/ 10" not in found["text"]:
        raise RuntimeError(f"check('ex01') showed no score: {found['text'][:300]!r}")
    return Reading(found["seconds"], {"cell_s": found["cell_s"]},
                   f"{found['seconds']:.1f} s, of which the check cell {found['cell_s']:.1f} s")


# --- launching ranks -------------------------------------------------------------------


def first_step(out_dir: str, device_type: str) -> None:
    """One data-parallel training step of the tiny GPT; write when it began and ended to ``out_dir``.

    Both launchers start this same function. It does what a learner's first
    cell does: build the model and AdamW, run forward and backward on this
    rank's shard of the batch, average the gradients with all-reduce, step.
    Under ``gpucourse.launch`` the process group is already up; under
    ``accelerate.notebook_launcher`` only the environment is (MASTER_ADDR,
    RANK, WORLD_SIZE …), so the function joins the group itself, and leaves it.
    """
    entered = time.time()  # wall clock: comparable across processes
    from .. import data
    from ..model import MODELS, build_model, loss_fn
    from ..optim import make_optimizer

    torch.set_num_threads(1)  # what gpucourse's launcher does in each forked rank
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
        model = build_model(MODELS["tiny"], seed=0).to(device)
        optimizer = make_optimizer(model.parameters(), lr=3e-3)
        x, y = data.rank_batch(0, 8, 64, 0, rank, world)
        loss_fn(model(x.to(device)), y.to(device)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        with open(os.path.join(out_dir, f"step-{rank}.json"), "w") as f:
            json.dump({"entered": entered, "ended": time.time()}, f)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_launch(start: Callable[[str], None]) -> dict:
    """Seconds from calling ``start(out_dir)`` until the slowest rank entered the function,
    until it ended its first step, and until ``start`` returned."""
    out_dir = tempfile.mkdtemp(prefix="gpucourse-bench-")
    try:
        t0 = time.time()
        start(out_dir)
        returned = time.time() - t0
        ranks = []
        for path in glob.glob(os.path.join(out_dir, "step-*.json")):
            with open(path) as f:
                ranks.append(json.load(f))
        if len(ranks) != RANKS:
            raise RuntimeError(f"{len(ranks)} of {RANKS} ranks finished their first step.")
        return {"entered_s": max(r["entered"] for r in ranks) - t0,
                "first_step_s": max(r["ended"] for r in ranks) - t0, "returned_s": returned}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


@figure("launch_vs_notebook_launcher", target="<= 1.0", quick=dict(reps=5), full=dict(reps=15))
def launch_vs_notebook_launcher(reps: int) -> Reading:
    """Call-to-first-step time of ``gpucourse.launch`` over ``accelerate.notebook_launcher``, 2 ranks."""
    from accelerate import notebook_launcher

    preimport()
    device_type = plan_device("auto", RANKS).device

    def ours(out_dir):
        launch(first_step, out_dir, device_type, world_size=RANKS, device=device_type, timeout=RUN_TIMEOUT_S,
               quiet=True)

    def accelerate(out_dir):
        # Its default port 29500 would collide with any other run; it also prints a banner.
        with contextlib.redirect_stdout(io.StringIO()):
            notebook_launcher(first_step, args=(out_dir, device_type), num_processes=RANKS,
                              use_port=str(_free_port()))

    sides = {"ours": lambda: _time_launch(ours), "accelerate": lambda: _time_launch(accelerate)}
    interleave(sides, 1)  # untimed: the first launch in a process imports the elastic agent
    times = interleave(sides, reps)
    med = {side: {k: statistics.median(t[k] for t in ts) for k in LAUNCH_TIMES} for side, ts in times.items()}
    detail = {side: {**{f"median_{k}": med[side][k] for k in LAUNCH_TIMES},
                     **{k: [t[k] for t in ts] for k in LAUNCH_TIMES}}
              for side, ts in times.items()}
    detail.update(reps=reps, device=device_type, ranks=RANKS)
    return Reading(ratio(med["ours"]["first_step_s"], med["accelerate"]["first_step_s"]), detail,
                   f"ours {med['ours']['first_step_s']:.3f} s, accelerate {med['accelerate']['first_step_s']:.3f} s "
                   f"to the first step (of which to enter the function: {med['ours']['entered_s']:.3f} s, "
                   f"{med['accelerate']['entered_s']:.3f} s)")


# --- the suite -------------------------------------------------------------------------


def machine() -> dict:
    """Where the figures were measured (found without initialising CUDA)."""
    plan = plan_device("auto", RANKS)
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "device": plan.device, "backend": plan.backend, "gpus": visible_gpus(), "cpu_count": os.cpu_count()}


def measure(fig: Figure, quick: bool) -> dict:
    """Run one figure; its JSON entry. A figure that raises is recorded as failed, with the error."""
    try:
        reading = fig.measure(**(fig.quick if quick else fig.full))
        value = float(reading.value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"figure {fig.key} measured {value!r}, not a positive finite number.")
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return {"value": None, "target": fig.target, "passed": False,
                "detail": {"error": f"{type(e).__name__}: {e}"}}
    detail = {**reading.detail, "summary": reading.summary}
    return {"value": value, "target": fig.target, "passed": passed(value, fig.target), "detail": detail}


def format_table(results: dict) -> str:
    """The table ``gpucourse bench`` prints: figure, value, target, result, and what was measured."""
    rows = [("figure", "value", "target", "result", "measured")]
    for key, entry in results.items():
        if key == "machine":
            continue
        if entry["value"] is None:
            value, result = "-", "error"
        else:
            value, result = f"{entry['value']:.3f}", {True: "pass", False: "FAIL", None: "report"}[entry["passed"]]
        note = entry["detail"].get("error") or entry["detail"].get("summary", "")
        rows.append((key, value, entry["target"], result, note))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    m = results.get("machine", {})
    if m:
        lines.append(f"(torch {m['torch']}, {RANKS} ranks on {m['device']} ({m['backend']}), {m['cpu_count']} CPUs, "
                     f"{m['gpus']} GPUs)")
    return "\n".join(line.rstrip() for line in lines)


def select(only=None) -> list[Figure]:
    """The figures named in ``only`` (keys, in the registry's order), or all of them; an unknown key is refused."""
    if only is None:
        return list(FIGURES)
    known = [f.key for f in FIGURES]
    unknown = [k for k in only if k not in known]
    if unknown or not only:
        raise ValueError(f"no figure called {', '.join(unknown) or 'nothing'}; the figures are: {', '.join(known)}.")
    return [f for f in FIGURES if f.key in only]


def main(quick: bool = False, json_path: str | None = None, only=None) -> dict:
    """Measure every registered figure (or those keyed in ``only``), print the table, optionally write the JSON.

    The JSON object has one entry per figure key, ``{"value", "target",
    "passed", "detail"}``, and ``"machine"``. It is written once, at the end,
    atomically: an interrupted bench leaves the previous file as it was.
    Returns the results.
    """
    figures = select(only)
    results: dict = {}
    preimport()
    for fig in figures:
        print(f"gpucourse bench: measuring {fig.key} ({'quick' if quick else 'full'}) …", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results[fig.key] = measure(fig, quick)
        results[fig.key]["detail"]["wall_s"] = time.perf_counter() - start
    results["machine"] = {**machine(), "suite": "quick" if quick else "full"}
    print(format_table(results), flush=True)
    if json_path:
        write_atomic(json_path, json.dumps(results, indent=1))
        print(f"figures written to {json_path}", flush=True)
    return results


from . import quiz_figures  # noqa: E402,F401 (registers the question bank's figures)
from . import workshop_figures  # noqa: E402,F401 (registers the workshop's figures)
from . import replay_figures  # noqa: E402,F401 (registers the modeled clock's figures)
