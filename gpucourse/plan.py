"""Plan a layout on paper: which dp × tp × pp (and ZeRO stage) fits, and how fast it would be.

For a model of N parameters on G GPUs of a stated kind, every layout with
dp·tp·pp = G (tp within one server, pp no more than the blocks) and every ZeRO
stage, with and without activation checkpointing, is sized with
:func:`gpucourse.memory.estimate` — the same formulas the tests check against
real runs here — and timed with a simple model:

- **compute**: 6·N FLOPs per token for the weights' matmuls, plus 12·L·C·T for attention's
  scores and weighted sum (PaLM's count, Chowdhery et al. 2022, appendix B: L blocks of
  width C, T tokens per sequence; it grows with T and rules long sequences); with
  checkpointing one more forward, 8·N + 16·L·C·T; spread over the G GPUs at
  ``efficiency`` × the GPU's peak (default: its ``achievable`` share, see :mod:`gpucourse.gpus`; a
  mixture of experts: N its active parameters);
- **bubble**: a pipeline of p stages and m microbatches idles the share of its
  compute time that its schedule leaves idle, as ``gpucourse schedule`` lays it
  out (:func:`bubble_ratio`): (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) for
  interleaved 1F1B with v chunks per rank, less for the zero-bubble schedules;
- **tensor-parallel communication**: per block and microbatch, two all-reduces
  forward and two backward of the activations a rank holds (b·T/cp·C values:
  with context parallelism each rank has only its T/cp tokens), ring cost
  2(tp−1)/tp of the payload, at the intra-node bandwidth;
- **pipeline communication**: each microbatch's activation (again T/cp tokens a
  rank) crosses each stage boundary forward and its gradient backward;
- **data-parallel communication**: one all-reduce of the gradients per step
  (ZeRO-1/2: reduce-scatter plus all-gather, the same volume; ZeRO-3 gathers
  the weights once more for backward: 1.5×), at the intra-node bandwidth when
  a data-parallel group fits in one server, else at the network's.

From ``LONG_SEQUENCE`` tokens on, layouts also use **sequence parallelism**
(with tp > 1) and **context parallelism** (cp ranks each holding T/cp tokens,
ring attention with the zig-zag split); cp·dp·tp·pp = G, tp·cp within a server
where they fit. Their communication:

- **context-parallel ring**: per block and microbatch, cp − 1 hops of a rank's
  K and V forward, cp − 1 again and cp hops of their gradients backward, at
  the intra-node bandwidth when tp·cp GPUs fit in one server, else the network's;
- sequence parallelism moves what tensor parallelism moves (an all-gather and
  a reduce-scatter are one all-reduce); it only shrinks activations.

Each transfer is timed by :class:`gpucourse.cluster.Cluster`'s α–β model (latency per step plus bytes
over bandwidth, ring or tree) over the slowest link its group crosses — NVLink inside a server, the
network card across servers — the same model that replays recorded runs (:mod:`gpucourse.replay`).
Tensor-, pipeline-, context- and expert-parallel transfers sit on the critical path (assumed not to
overlap compute); data-parallel traffic overlaps it, as it does in DDP and FSDP: the gradient all-reduce
hides behind backward (2/3 of the compute, 3/4 recomputing), ZeRO-3's gathers behind the whole step, and
only what is left over counts (``dp_exposed_s``; ``dp_comm_s`` is the whole). The ranking is what matters. A layout that does not fit in the GPU's
memory is never ranked as fitting.

With only a parameter count, the model's shape is taken from the common
aspect ratio of large GPTs: width ≈ 100 × depth (Llama-2 70B has 80 blocks of
8192), heads of 128, a 32000-token vocabulary; from 1024 on, the width is a
multiple of 8 heads, so that tensor parallelism of 2, 4 or 8 divides the heads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap

from .cluster import Cluster
from .config import ConfigError, TrainConfig
from .gpus import get_gpu
from .memory import active_params, estimate, expert_params
from .memory import num_params as num_params_of
from .readable import human_bytes


def shape_for_params(num_params: float) -> dict:
    """A plausible GPT shape (n_layer, n_embd, n_head) with about ``num_params`` parameters."""
    n_layer = max(2, round((num_params / (12 * 100**2)) ** (1 / 3)))
    width = math.sqrt(num_params / (12 * n_layer))
    step = 1024 if width >= 1024 else 128  # 8 heads of 128 at a time: tp = 2, 4, 8 can split the heads
    n_embd = max(128, round(width / step) * step)
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_embd // 128, "vocab_size": 32000}


LONG_SEQUENCE = 16384  # from here on the planner also tries sequence and context parallelism

# Named shapes to plan (``gpucourse plan --shape NAME``). Each is the real model's depth, width, heads and
# vocabulary with this course's block (a 4×-wide GELU MLP, or E of them with a router), so its counts are
# near, not equal to, the original's.
SHAPES = {
    "llama2-70b": {"n_layer": 80, "n_embd": 8192, "n_head": 64, "vocab_size": 32000},
    # Mixtral 8x7B (Jiang et al., 2024): 32 blocks of 4096, 32 heads, 8 experts, top-2. Its experts are
    # SwiGLU MLPs of width 14336 (47 B parameters, 13 B active); this course's 4×-wide GELU experts make it
    # 36.8 B and 11.0 B.
    "mixtral-8x7b": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "vocab_size": 32000, "moe_experts": 8,
                     "moe_top_k": 2},
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: dict, gpus: int, gpus_per_node: int, batch_size: int, seq_len: int, precision: str):
    """Every layout worth sizing, as TrainConfigs (not necessarily runnable in this build)."""
    long = seq_len >= LONG_SEQUENCE
    experts = shape.get("moe_experts", 0)
    for tp in _divisors(gpus):
        if tp > gpus_per_node or shape["n_head"] % tp:
            continue
        for cp in _divisors(gpus // tp) if long else [1]:
            if seq_len % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if pp > shape["n_layer"] or batch_size % dp:
                    continue
                # One sequence per microbatch on a pipeline keeps its bubble small.
                micro = batch_size // dp if pp > 1 else 1
                grad_accum = 1 if pp > 1 else batch_size // dp
                # A mixture of experts: expert parallelism over ep of the dp ranks (ep divides the experts).
                eps = [ep for ep in _divisors(dp) if experts % ep == 0] if experts else [1]
                for ep, zero in ((ep, zero) for ep in eps for zero in (0, 1, 2, 3)):
                    if zero and dp * cp == 1 or zero == 3 and ep > 1:
                        continue
                    for ckpt in (False, True):
                        yield TrainConfig(model="gpt2-small", overrides={**shape, "block_size": seq_len}, dp=dp,
                                          tp=tp, pp=pp, cp=cp, ep=ep, zigzag=cp > 1,
                                          sequence_parallel=long and tp > 1, zero=zero, microbatches=micro,
                                          grad_accum=grad_accum, schedule="1f1b", batch_size=batch_size,
                                          seq_len=seq_len, precision=precision, master_weights=precision != "fp32",
                                          checkpoint_activations=ckpt)


def attention_flops(n_layer: int, n_embd: int, seq_len: int, recompute: bool = False) -> float:
    """Attention's own FLOPs per token, forward and backward: 12·L·C·T (16·L·C·T recomputing the forward).

    Per block and token, forward: q·kᵀ against T keys and the weighted sum of T values, 2 · 2·C·T; backward
    twice that. Counted without the causal mask's saving, as PaLM's MFU formula does.
    """
    return (16 if recompute else 12) * n_layer * n_embd * seq_len


def lay_out_schedule(schedule: str, pp: int, m: int, v: int = 2, cost_f: float = 1.0, cost_b: float = 2.0,
                     cost_comm: float = 0.0):
    """Any pipeline schedule of the course, by name, built, checked and laid out on the clock: ``(ops, layout,
    simulation, costs)``. ``layout`` is None for the one-chunk schedules of :mod:`.parallel.schedules`; ``costs``
    are the op costs used: the zero-bubble schedules split a backward into B and W of ``cost_b / 2`` each, the
    others' B is the whole backward. What ``gpucourse schedule`` prints and the planner's bubble both come from here.
    """
    from .parallel import schedules, schedules_virtual

    if schedule in schedules.SCHEDULES:
        ops = schedules.build(schedule, pp, m)
        schedules.validate(ops, pp, m)
        return ops, None, schedules.simulate(ops, pp, m, cost_f, cost_b, cost_comm), {"f": cost_f, "b": cost_b}
    split = schedule != "interleaved-1f1b"
    costs = {"f": cost_f, "b": cost_b / 2, "w": cost_b / 2} if split else {"f": cost_f, "b": cost_b}
    ops, layout = schedules_virtual.build(schedule, pp, m, v)
    schedules_virtual.validate(ops, layout, m)
    sim = schedules_virtual.simulate(ops, layout, m, cost_f, costs["b"], costs.get("w", 0.0), cost_comm)
    return ops, layout, sim, costs


@functools.lru_cache(maxsize=512)
def bubble_ratio(schedule: str, pp: int, m: int, v: int = 2) -> float:
    """Idle over compute time of a pipeline ``schedule`` of ``pp`` stages and ``m`` microbatches: what
    ``gpucourse schedule`` prints as Megatron-LM's bubble (:func:`lay_out_schedule` with a backward twice a
    forward, transfers free). ``v``: chunks per rank of interleaved-1f1b.

    For gpipe, 1f1b and interleaved-1f1b the clock gives exactly the papers' formulas, (p−1)/m and
    (p−1)/(v·m) (tests/test_schedules.py lays them out on many shapes), so those are used as they are: a
    planner sizes hundreds of layouts. The others are laid out on the clock, once per shape.
    """
    from .parallel import schedules, schedules_virtual

    if pp == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return schedules.formula_bubble_ratio(schedule, pp, m)
    if schedule == "interleaved-1f1b":
        return schedules_virtual.formula_bubble_ratio(schedule, pp, m, v)
    return lay_out_schedule(schedule, pp, m, v)[2].bubble_ratio


def step_time(cfg: TrainConfig, num_params: int, gpu, gpus_per_node: int, efficiency: float | None = None) -> dict:
    """The timing model above for one layout: seconds per step, by part.

    Every transfer is timed by :class:`gpucourse.cluster.Cluster`'s α–β model over the link its group
    crosses — the same model that replays a recorded run (:mod:`gpucourse.replay`). Ranks are placed as the
    runtime places them (pp, dp, cp, tp, tensor-parallel ranks adjacent), ``gpus_per_node`` to a server.
    ``efficiency``: the share of the peak compute reaches (default: the GPU's ``achievable``).
    """
    mc = cfg.model_config()
    cluster = Cluster(gpu, gpus_per_node, max(1, -(-cfg.world_size // gpus_per_node)))
    tokens = cfg.batch_size * cfg.seq_len
    elem = 2 if cfg.precision != "fp32" else 4
    # A mixture of experts computes with the parameters a token uses (active), not all of them.
    weights = active_params(mc) if mc.moe_experts else num_params
    flops = (8 if cfg.checkpoint_activations else 6) * weights * tokens
    flops += attention_flops(mc.n_layer, mc.n_embd, cfg.seq_len, cfg.checkpoint_activations) * tokens
    compute = cluster.compute_s(flops / cfg.world_size, precision=cfg.precision, efficiency=efficiency)
    # What checkpointing recomputes: one more forward, 2·N + 4·L·C·T FLOPs a token, a share of the compute above.
    redo = (2 * weights + 4 * mc.n_layer * mc.n_embd * cfg.seq_len) * tokens if cfg.checkpoint_activations else 0
    recompute = compute * redo / flops
    m = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    bubble = compute * bubble_ratio(cfg.schedule, cfg.pp, m, cfg.virtual_stages) if cfg.pp > 1 else 0.0
    micro_tokens = tokens // (cfg.dp * m)
    local_tokens = micro_tokens / cfg.cp  # what one rank of a context-parallel group holds and sends
    # One group of each kind, as the runtime numbers ranks: rank = ((stage·dp + d)·cp + c)·tp + t.
    tp_group = range(cfg.tp)
    cp_neighbours = (0, cfg.tp)
    stage_neighbours = (0, cfg.tp * cfg.cp * cfg.dp)
    replicas = [i * cfg.tp for i in range(cfg.dp * cfg.cp)]     # the ranks that average the gradients
    ep_group = [d * cfg.cp * cfg.tp for d in range(cfg.ep)]

    def cost(op, nbytes, ranks):
        return cluster.collective_s(op, nbytes, ranks)[0]

    tp_comm = pp_comm = cp_comm = ep_comm = dp_comm = 0.0
    if cfg.tp > 1:  # per block and microbatch: two all-reduces forward, two backward
        tp_comm = 4 * (mc.n_layer / cfg.pp) * m * cost("all_reduce", local_tokens * mc.n_embd * elem, tp_group)
    if cfg.pp > 1:  # each microbatch's activation forward and its gradient back
        pp_comm = 2 * m * cost("send", local_tokens * mc.n_embd * elem, stage_neighbours)
    if cfg.cp > 1:
        block = 2 * local_tokens * mc.n_embd / cfg.tp * elem  # a rank's K and V of one microbatch
        cp_comm = (mc.n_layer / cfg.pp) * m * (3 * (cfg.cp - 1) + cfg.cp) * cost("send", block, cp_neighbours)
    if cfg.ep > 1:  # per MoE block and microbatch: dispatch and combine forward, both again backward
        blocks = sum(mc.is_moe(i) for i in range(mc.n_layer)) / cfg.pp
        rows = local_tokens * mc.moe_top_k * mc.n_embd * elem
        ep_comm = blocks * m * 4 * cost("all_to_all", rows, ep_group)
    experts = _expert_params(mc) if cfg.ep > 1 else 0  # averaged over their dp/ep replicas instead
    if len(replicas) > 1:
        grads = (num_params - experts) / (cfg.tp * cfg.pp) * elem
        dp_comm = (1.5 if cfg.zero == 3 else 1.0) * cost("all_reduce", grads, replicas)
    if experts and cfg.dp > cfg.ep:
        expert_replicas = [d * cfg.cp * cfg.tp for d in range(0, cfg.dp, cfg.ep)]
        dp_comm += cost("all_reduce", experts / (cfg.tp * cfg.pp * cfg.ep) * elem, expert_replicas)
    # Data-parallel traffic runs beside compute: the gradients' all-reduce behind backward (bucketed, as
    # DDP does), ZeRO-3's gathers behind the whole step (prefetched, as FSDP does). Only the rest is exposed.
    hidden = compute if cfg.zero == 3 else compute * (2 / 3 if not cfg.checkpoint_activations else 3 / 4)
    exposed_dp = max(0.0, dp_comm - hidden)
    # Adam updates what the rank holds: its 1/(tp·pp) of the weights (experts also 1/ep), 1/(dp·cp) of that with ZeRO.
    held = (num_params - _expert_params(mc)) / (cfg.tp * cfg.pp) + _expert_params(mc) / (cfg.tp * cfg.pp * cfg.ep)
    optimizer = cluster.optimizer_s(held / (cfg.dp * cfg.cp) if cfg.zero else held)
    parts = {"compute": compute - recompute, "recompute": recompute, "bubble": bubble, "tp": tp_comm, "cp": cp_comm,
             "ep": ep_comm, "pp": pp_comm, "dp": exposed_dp, "optimizer": optimizer}
    total = sum(parts.values())
    return {"step_s": total, "compute_s": compute, "recompute_s": recompute, "bubble_s": bubble,
            "communication_s": tp_comm + pp_comm + cp_comm + ep_comm + exposed_dp, "dp_exposed_s": exposed_dp,
            "tp_comm_s": tp_comm, "pp_comm_s": pp_comm, "cp_comm_s": cp_comm, "ep_comm_s": ep_comm,
            "dp_comm_s": dp_comm, "optimizer_s": optimizer, "parts": parts, "tokens_per_s": tokens / total}


def _expert_params(mc) -> int:
    """Every expert's parameters, over all MoE blocks."""
    return sum(mc.is_moe(i) for i in range(mc.n_layer)) * mc.moe_experts * expert_params(mc)


def plan(num_params: float | None, gpus: int, gpu: str = "h100", gpus_per_node: int = 8, batch_size: int = 1024,
         seq_len: int = 4096, precision: str = "bf16", efficiency: float | None = None,
         shape: dict | None = None) -> dict:
    """Size and time every layout; return them ranked (fitting ones first, fastest first).

    ``shape`` (``{"n_layer", "n_embd", "n_head", "vocab_size"}``) plans a real
    model's shape instead of the one :func:`shape_for_params` picks for ``num_params``.
    """
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError(f"gpus={gpus} and gpus_per_node={gpus_per_node} must be at least 1.")
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ConfigError(f"shape {shape!r} is not one of {', '.join(SHAPES)}.")
        shape = SHAPES[shape]
    if shape is None:
        if num_params is None or num_params < 1e5:
            raise ConfigError(f"params={num_params} is too small to plan; give at least 1e5 (or a shape).")
        shape = shape_for_params(num_params)
    else:
        missing = {"n_layer", "n_embd", "n_head"} - set(shape)
        if missing:
            raise ConfigError(f"shape needs n_layer, n_embd and n_head; {', '.join(sorted(missing))} missing.")
        if shape["n_embd"] % shape["n_head"]:
            raise ConfigError(f"n_embd={shape['n_embd']} must be divisible by n_head={shape['n_head']}.")
        shape = {"vocab_size": 32000, **shape}
    spec = get_gpu(gpu)
    rows = []
    for cfg in candidates(shape, gpus, gpus_per_node, batch_size, seq_len, precision):
        try:
            mem = estimate(cfg)
        except ConfigError:
            continue
        n = mem["num_params"]
        row = {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep, "sp": cfg.sequence_parallel,
               "zero": cfg.zero,
               "microbatches": cfg.microbatches,
               "grad_accum": cfg.grad_accum, "checkpoint_activations": cfg.checkpoint_activations,
               "memory": mem["max"], "memory_total": mem["max_total"],
               "fits": mem["max_total"] <= spec.memory_gb * 1e9, "config": cfg.to_dict(),
               **step_time(cfg, n, spec, gpus_per_node, efficiency)}
        rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], r["step_s"]))
    model = TrainConfig(model="gpt2-small", overrides={**shape, "block_size": seq_len}).model_config()
    if num_params is None:
        num_params = num_params_of(model)
    moe = {"active_params": active_params(model)} if model.moe_experts else {}
    return {"params": num_params, "model_params": num_params_of(model), **moe, "shape": shape, "gpus": gpus,
            "gpu": dataclasses.asdict(spec), "gpus_per_node": gpus_per_node,
            "batch_size": batch_size, "seq_len": seq_len, "precision": precision,
            "efficiency": efficiency or spec.achievable,
            "layouts": rows}


PARTS = {"compute": "compute", "recompute": "recompute", "bubble": "bubble", "tp": "tp comm", "cp": "cp comm",
         "ep": "ep comm", "pp": "pp comm", "dp": "dp comm exposed", "optimizer": "optimizer"}


def explain(row: dict) -> str:
    """One layout's step as its parts, each with its share, and the memory it needs per GPU: what makes it fast or
    slow (``gpucourse plan --explain``)."""
    layout = " ".join(f"{k} {row[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if row.get(k, 1) > 1) or "one GPU"
    layout += f", ZeRO-{row['zero']}" * bool(row["zero"]) + ", checkpointing" * row["checkpoint_activations"]
    parts = ", ".join(f"{PARTS[k]} {v:.2f} s ({v / row['step_s']:.0%})" for k, v in row["parts"].items() if v > 0)
    return (f"{layout}: step {row['step_s']:.2f} s = {parts}; {human_bytes(row['memory_total'])} per GPU "
            f"(gpucourse memory's estimate)")


def format_plan(result: dict, top: int = 10, explained: bool = False) -> str:
    """The ranked table ``gpucourse plan`` prints; ``explained``: each row's step as parts below it."""
    fitting = [r for r in result["layouts"] if r["fits"]]
    gpu = result["gpu"]
    cp_head = f" {'cp':>3} {'sp':>3}" if result["seq_len"] >= LONG_SEQUENCE else ""  # long sequences: cp and sp too
    ep_head = f" {'ep':>3}" if "active_params" in result else ""  # a mixture of experts: expert parallelism too
    shape = result["shape"]
    experts = (f", {shape['moe_experts']} experts top-{shape.get('moe_top_k', 2)}: "
               f"{result['active_params'] / 1e9:.1f} B active per token" if ep_head else "")
    lines = [f"{result['params'] / 1e9:.1f} B parameters (as {shape['n_layer']} blocks of width "
             f"{shape['n_embd']}{experts}) on {result['gpus']} × {gpu['name']} ({gpu['memory_gb']:g} GB, "
             f"{result['gpus_per_node']} per node), batch {result['batch_size']} × {result['seq_len']} tokens, "
             f"{result['precision']} with fp32 master weights",
             f"{len(fitting)} of {len(result['layouts'])} layouts fit; the fastest, by the timing model:",
             f"  {'dp':>4}{ep_head} {'tp':>3} {'pp':>3}{cp_head} {'zero':>4} {'ckpt':>4} {'memory/GPU':>11} {'step':>8} "
             f"{'compute':>8} {'comm':>8} {'bubble':>8} {'tokens/s':>10}"]
    for r in fitting[:top]:
        cp = f" {r.get('cp', 1):>3} {'yes' if r.get('sp') else 'no':>3}" if cp_head else ""
        ep = f" {r.get('ep', 1):>3}" if ep_head else ""
        lines.append(f"  {r['dp']:>4}{ep} {r['tp']:>3} {r['pp']:>3}{cp} {r['zero']:>4} "
                     f"{'yes' if r['checkpoint_activations'] else 'no':>4} {human_bytes(r['memory_total']):>11} "
                     f"{r['step_s']:>7.2f}s {r['compute_s']:>7.2f}s {r['communication_s']:>7.2f}s "
                     f"{r['bubble_s']:>7.2f}s {r['tokens_per_s']:>10,.0f}")
        if explained:
            lines.append(textwrap.fill(explain(r), 110, initial_indent="      ", subsequent_indent="        "))
    if not fitting:
        best = min(result["layouts"], key=lambda r: r["memory_total"]) if result["layouts"] else None
        lines.append("  none fits" + (f": the smallest needs {human_bytes(best['memory_total'])} per GPU"
                                      if best else ""))
    return "\n".join(lines)
