"""Figures of the strategies: each one's step time beside PyTorch's, a pipeline's bubble measured against the
simulator, context parallelism's balance and the experts' traffic."""

from __future__ import annotations

import functools
import statistics
import time

import torch

from ..config import TrainConfig
from ..readable import human_bytes
from ..train import run
from ..course.readings import WARMUP_STEPS, Reading, figure, interleave, ratio
from .harness import RANKS, RUN_TIMEOUT_S, bench_config, compare_runs


@figure("dp_scratch_vs_ddp", quick=dict(reps=2, steps=15), full=dict(reps=4, steps=40))
def dp_scratch_vs_ddp(reps: int, steps: int) -> Reading:
    """Step time of our data parallel (one all-reduce per gradient) over PyTorch's DDP."""
    detail, med = compare_runs({"scratch": bench_config(impl="scratch", steps=steps),
                                "torch": bench_config(impl="torch", steps=steps)}, reps)
    detail.update(reps=reps, warmup_steps=WARMUP_STEPS)
    return Reading(ratio(med["scratch"], med["torch"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, DDP {med['torch'] * 1e3:.1f} ms per step")


@figure("recording_overhead", target="<= 1.03", quick=dict(reps=3, steps=20), full=dict(reps=8, steps=60))
def recording_overhead(reps: int, steps: int) -> Reading:
    """Step time with the timeline recorded over the same run without it."""
    detail, med = compare_runs({"record": bench_config(record=True, steps=steps),
                                "no_record": bench_config(record=False, steps=steps)}, reps)
    detail.update(reps=reps, warmup_steps=WARMUP_STEPS)
    return Reading(ratio(med["record"], med["no_record"]), detail,
                   f"on {med['record'] * 1e3:.2f} ms, off {med['no_record'] * 1e3:.2f} ms per step")


@figure("dp_bucketed_vs_ddp", target="<= 1.10", quick=dict(reps=2, steps=15), full=dict(reps=4, steps=40))
def dp_bucketed_vs_ddp(reps: int, steps: int) -> Reading:
    """Step time of bucketed, overlapped data parallel from scratch over DDP, the same bucket size."""
    detail, med = compare_runs({"bucketed": bench_config(impl="scratch", bucket_mb=0.25, steps=steps),
                                "ddp": bench_config(bucket_mb=0.25, steps=steps)}, reps)
    return Reading(ratio(med["bucketed"], med["ddp"]), detail,
                   f"bucketed {med['bucketed'] * 1e3:.1f} ms, DDP {med['ddp'] * 1e3:.1f} ms per step")


def _model_parallel_ratio(changes: dict, reps: int, steps: int, what: str) -> Reading:
    base = dict(dp=1, batch_size=16, steps=steps, **changes)
    detail, med = compare_runs({"scratch": bench_config(impl="scratch", **base),
                                "torch": bench_config(impl="torch", **base)}, reps)
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
    configs = {name: bench_config(impl="scratch", dp=1, pp=RANKS, schedule=name, microbatches=microbatches,
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
    configs = {name: bench_config(impl="scratch", dp=1, pp=RANKS, schedule=name, microbatches=4, batch_size=16,
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


@figure("zero3_scratch_vs_fsdp2", target="<= 1.3", quick=dict(reps=2, steps=12), full=dict(reps=4, steps=30))
def zero3_scratch_vs_fsdp2(reps: int, steps: int) -> Reading:
    """Step time of ZeRO-3 from scratch (flat shards per block) over FSDP2's fully_shard, 2 data-parallel ranks."""
    detail, med = compare_runs({"scratch": bench_config(impl="scratch", zero=3, steps=steps),
                                "fsdp2": bench_config(impl="torch", zero=3, steps=steps)}, reps)
    return Reading(ratio(med["scratch"], med["fsdp2"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, FSDP2 {med['fsdp2'] * 1e3:.1f} ms per step")


def fsdp_module_step_times(reps: int, steps: int) -> dict[str, list[list[float]]]:
    """On this rank: the tiny GPT trained ``steps`` steps through :class:`~gpucourse.parallel.FullyShardedDataParallel`
    in a plain loop, each block a unit ("blocks") and each submodule holding a matrix its own ("submodules"), and the
    same through FSDP2 (``fully_shard`` on each block, then on the model), the three taking turns ``reps`` times;
    each run's step times after the warm-up (forward, backward, synchronisation, SGD step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..model import GPT, MODELS, Block, loss_fn
    from ..parallel import FullyShardedDataParallel
    from ..runtime import current

    device, world = current().device, dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    cfg = MODELS["tiny"]
    data = torch.Generator().manual_seed(dist.get_rank())
    x, y = (torch.randint(0, cfg.vocab_size, (16 // world, 64), generator=data).to(device) for _ in range(2))

    def ours(unit=None):
        torch.manual_seed(0)
        fsdp = FullyShardedDataParallel(GPT(cfg).to(device), unit=unit)
        return fsdp, fsdp.finish_gradient_synchronization

    def fsdp2():
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh), lambda: None

    def times(build) -> list[float]:
        net, finish = build()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        out = []
        for _ in range(steps):
            start = time.perf_counter()
            loss_fn(net(x), y).backward()
            finish()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
        return out[WARMUP_STEPS:]

    def blocks(name, m):
        return isinstance(m, Block)

    return interleave({"blocks": lambda: times(functools.partial(ours, blocks)), "submodules": lambda: times(ours),
                       "fsdp2": lambda: times(fsdp2)}, reps)


@figure("fsdp_module_vs_torch_fsdp2", quick=dict(reps=2, steps=12), full=dict(reps=4, steps=30))
def fsdp_module_vs_torch_fsdp2(reps: int, steps: int) -> Reading:
    """Step time of FullyShardedDataParallel (each block a unit: one gather of its matrices, vectors replicated) in a
    plain loop over FSDP2's fully_shard on each block, the tiny GPT on 2 ranks; a step lasts as long as its slowest
    rank. The detail also times each submodule a unit (a gather per matrix)."""
    from ..runtime import launch

    per_rank = launch(fsdp_module_step_times, reps, steps, world_size=RANKS, timeout=RUN_TIMEOUT_S, quiet=True)
    steps_s = {side: [[max(ts) for ts in zip(*(r[side][rep] for r in per_rank))] for rep in range(reps)]
               for side in ("blocks", "submodules", "fsdp2")}
    med = {side: statistics.median(t for rep_times in runs for t in rep_times) for side, runs in steps_s.items()}
    detail = {side: {"median_step_s": med[side], "step_times_s": runs} for side, runs in steps_s.items()}
    detail.update(reps=reps, warmup_steps=WARMUP_STEPS, submodules_ratio=ratio(med["submodules"], med["fsdp2"]))
    return Reading(ratio(med["blocks"], med["fsdp2"]), detail,
                   f"ours {med['blocks'] * 1e3:.1f} ms (a gather per matrix: {med['submodules'] * 1e3:.1f} ms), "
                   f"FSDP2 {med['fsdp2'] * 1e3:.1f} ms per step")


@figure("fsdp_tp_vs_scratch_dp_tp", quick=dict(reps=2, steps=10), full=dict(reps=3, steps=20))
def fsdp_tp_vs_scratch_dp_tp(reps: int, steps: int) -> Reading:
    """Step time of FSDP2 × DTensor TP (torchtitan's 2-D recipe) over scratch ZeRO-3 × tensor parallel, dp2 × tp2."""
    base = dict(dp=2, tp=2, zero=3, steps=steps)
    detail, med = compare_runs({"torch": bench_config(impl="torch", **base),
                                "scratch": bench_config(impl="scratch", **base)}, reps)
    return Reading(ratio(med["torch"], med["scratch"]), detail,
                   f"FSDP2×DTensor {med['torch'] * 1e3:.1f} ms, scratch ZeRO-3×TP {med['scratch'] * 1e3:.1f} ms "
                   f"per step (4 ranks)")


def ring_work_times(seq_len: int, cp: int, zigzag: bool, reps: int, heads: int = 4, head_dim: int = 64) -> list:
    """Seconds each of ``cp`` ring-attention ranks computes per layer (forward and backward of its blocks).

    Each rank's own queries against every block of keys its mask lets it see, with the
    ring's block function — the compute of ``RingAttention`` without its transfers (a
    rank that finishes early waits in the ring, so wall time alone would hide the
    imbalance). Ranks are timed in turn in this process, each on one thread; the least disturbed
    of its runs counts.
    """
    from ..data import context_positions
    from ..parallel.context_parallel_ring import block_attention, block_attention_backward, visible_part

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
    detail, med = compare_runs({"ring": bench_config(impl="scratch", cp_algo="ring", **base),
                                "allgather": bench_config(impl="scratch", cp_algo="allgather", **base)}, reps)
    return Reading(ratio(med["ring"], med["allgather"]), detail,
                   f"ring {med['ring'] * 1e3:.1f} ms, all-gather {med['allgather'] * 1e3:.1f} ms per step")


@figure("cp_scratch_vs_torch", target="<= 1.20", quick=dict(reps=2, steps=10), full=dict(reps=3, steps=20))
def cp_scratch_vs_torch(reps: int, steps: int) -> Reading:
    """Step time of our ring attention over PyTorch's (K/V by all-to-all), cp = 2, zig-zag, 1024 tokens.

    The gradients are averaged in 0.25 MB buckets in both (ours overlapped, DDP's): the ring is what differs.
    """
    base = dict(model="tiny-long", dp=1, cp=RANKS, seq_len=1024, batch_size=2, cp_algo="ring", zigzag=True,
                bucket_mb=0.25, steps=steps)
    detail, med = compare_runs({"scratch": bench_config(impl="scratch", **base),
                                "torch": bench_config(impl="torch", **base)}, reps)
    return Reading(ratio(med["scratch"], med["torch"]), detail,
                   f"scratch {med['scratch'] * 1e3:.1f} ms, PyTorch's ring {med['torch'] * 1e3:.1f} ms per step")


@figure("moe_a2a_bytes_vs_formula", target="== 1.0", quick=dict(), full=dict())
def moe_a2a_bytes_vs_formula() -> Reading:
    """Expert parallelism's all-to-all bytes per step, measured over ``memory.all_to_all_bytes``, ep = 2."""
    from ..modeled.memory import all_to_all_bytes

    cfg = bench_config(impl="scratch", moe_experts=4, ep=RANKS, steps=3)
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
    detail, med = compare_runs({"ep": bench_config(ep=RANKS, **base), "replicated": bench_config(**base)}, reps)
    return Reading(ratio(med["ep"], med["replicated"]), detail,
                   f"ep {med['ep'] * 1e3:.1f} ms, replicated {med['replicated'] * 1e3:.1f} ms per step")


@figure("moe_imbalance_aux_vs_none", quick=dict(steps=100), full=dict(steps=200))
def moe_imbalance_aux_vs_none(steps: int) -> Reading:
    """Most over mean tokens per expert over the last 20 steps, with the balance loss (0.1) over without."""
    loads = {}
    for name, aux in (("aux", 0.1), ("none", 0.0)):
        result = run(bench_config(impl="scratch", dp=1, moe_experts=4, moe_aux=aux, steps=steps),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        last = result.extras["moe"]["tokens_per_expert"][-20:]
        loads[name] = statistics.mean(max(layer) / statistics.mean(layer) for step in last for layer in step)
    return Reading(ratio(loads["aux"], loads["none"]), loads,
                   f"max/mean tokens per expert {loads['aux']:.2f} with the balance loss, {loads['none']:.2f} "
                   f"without")
