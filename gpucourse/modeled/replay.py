"""Replay a recorded run on a modeled GPU cluster: what the same work would take on real hardware.

A run on a laptop is right (every layout equals one device) but its clock is the
laptop's: four CPU processes on two cores cannot show data or pipeline
parallelism paying off. Every run records what each rank did, op by op —
forward and backward of each microbatch, each collective with its bytes and its
group, each send and receive with its peer (:mod:`gpucourse.measure`). This module
keeps that *record* and throws away its *clock*:

1. **Work.** Each forward, backward and optimizer span gets its FLOPs and bytes,
   counted from the model's shapes and the rank's place in the layout (its
   stage, its 1/tp of the weights, its tokens); each collective keeps its
   payload and group. :class:`~gpucourse.modeled.cluster.Cluster` turns them into
   seconds on the chosen GPUs (a roofline for compute, α–β for collectives).
2. **Order.** What each rank did, in the order it did it, with what it waited
   for: a collective needs the computation before it (its data) and holds up
   the computation after the ``wait()`` that needed it; a blocking call holds
   up everything after it; collectives of one rank run one after another, on
   their own stream, beside compute — so data parallelism's bucketed
   all-reduces overlap backward here as they do on a GPU.
3. **Clock.** :mod:`gpucourse.clock` lays the tasks out: a collective starts
   when its last member arrives, a send meets its receive. Whoever arrived
   first waited — idle time, as in the measured timeline.

The result is a :class:`~gpucourse.measure.RunResult` whose device says
"modeled", so everything that reads runs — :func:`gpucourse.viz.timeline`,
:func:`gpucourse.profiling.summarize` (shares, MFU, scaling efficiency) — reads
the modeled one too::

    from gpucourse.modeled.replay import replay
    modeled = replay(result, on="h100", gpus_per_node=8)
    modeled.step_times_s, modeled.tokens_per_s

Spans inside the first step are replayed like the others: warm-up is the
laptop's, not the work's. Only runs of the scratch strategies can be replayed
(PyTorch's own record no group for their collectives), and only runs that
recorded spans (``record=True``).
"""

from __future__ import annotations

import warnings

from ..clock import Task
from ..clock import run as run_clock
from ..config import ConfigError, TrainConfig
from ..measure import SPAN_KINDS, RunResult
from ..parallel import check
from ..parallel.schedule_table import get as get_schedule
from ..values import NON_NEGATIVE, NON_NEGATIVE_NUMBER, RANKS, Name, number, whole
from .cluster import Cluster
from .memory import active_params, num_params, stage_params

COMPUTE = ("forward", "backward", "optimizer")
KERNELS_PER_BLOCK = 14        # one block's forward: 2 LayerNorms, 4 matmuls, attention's few, GELU, 2 adds


# The collectives gpucourse.comm records, by the names a span's op holds.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv")


class ReplayError(ValueError):
    """This run cannot be replayed (no spans, PyTorch's own collectives, an unknown GPU)."""


def coordinates(cfg: TrainConfig, rank: int) -> dict[str, int]:
    """Rank ``rank``'s place in the mesh (pp, dp, cp, tp; tensor-parallel ranks adjacent)."""
    tp_rank = rank % cfg.tp
    cp_rank = rank // cfg.tp % cfg.cp
    dp_rank = rank // (cfg.tp * cfg.cp) % cfg.dp
    return {"stage": rank // (cfg.tp * cfg.cp * cfg.dp), "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}


def forward_work(cfg: TrainConfig, rank: int) -> dict[str, float]:
    """One microbatch's forward on ``rank`` (all its model chunks): FLOPs, bytes read, kernels.

    FLOPs: 2 per matmul weight per token (the embeddings are look-ups, not matmuls; a
    mixture of experts counts the experts a token uses), plus attention's 4·C·T per
    token and block (q·kᵀ and the weighted sum against T keys), over this rank's share
    of the heads (1/tp) and of the tokens (1/dp of the batch, 1/microbatches, 1/cp).
    """
    mc = cfg.model_config()
    stage = coordinates(cfg, rank)["stage"]
    params = stage_params(mc, cfg.pp, stage, cfg.tp, cfg.ep)
    if stage == 0:
        params -= (mc.vocab_size + mc.block_size) * mc.n_embd  # embeddings: look-ups
    if mc.moe_experts:
        params *= active_params(mc) / num_params(mc)
    m = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    tokens = cfg.batch_size / (cfg.dp * m) * cfg.seq_len / cfg.cp
    blocks = mc.n_layer / cfg.pp
    flops = 2 * params * tokens + blocks * 4 * mc.n_embd / cfg.tp * cfg.seq_len * tokens
    elem = 4 if cfg.precision == "fp32" else 2
    return {"flops": flops, "bytes": params * elem, "kernels": KERNELS_PER_BLOCK * blocks + 4}


def span_seconds(cluster: Cluster, cfg: TrainConfig, span: dict, split_backward: bool) -> float:
    """Modeled seconds of one recorded compute span (a forward, a backward or its weight part, an optimizer step)."""
    if "delay_s" in span:
        return span["delay_s"]  # a planted straggler loses the same time on any hardware
    fwd = forward_work(cfg, span["rank"])
    chunks = get_schedule(cfg.schedule).chunks_per_rank(cfg.virtual_stages) if cfg.pp > 1 else 1
    flops, nbytes, kernels = fwd["flops"] / chunks, fwd["bytes"] / chunks, fwd["kernels"] / chunks
    if span["kind"] == "forward":
        return cluster.compute_s(flops, nbytes, round(kernels), cfg.precision)
    if span["kind"] == "backward":
        # Backward: the input gradients (one forward's FLOPs) and the weight gradients (another); a
        # split backward (zero bubble) does them in two spans. Recomputing the forward adds one more.
        share = 1 if split_backward else 2
        # (Selective recomputation redoes attention's core, which the forward's FLOPs here do not separate out.)
        redo = 1 if cfg.recompute == "full" and not span["name"].startswith("weights") else 0
        return cluster.compute_s((share + redo) * flops, (share + redo) * nbytes, round((share + redo) * kernels),
                                 cfg.precision)
    if span["kind"] == "optimizer":
        mc = cfg.model_config()
        params = stage_params(mc, cfg.pp, coordinates(cfg, span["rank"])["stage"], cfg.tp, cfg.ep)
        if cfg.zero:
            params /= cfg.dp
        return cluster.optimizer_s(params)
    return 0.0


def _rank_tasks(spans: list[dict], tasks: list[Task], seconds, counters: dict) -> None:
    """Append one rank's tasks, in issue order, with what each waits for (see the module docstring)."""
    spans = sorted(spans, key=lambda s: (s["start_s"], s["kind"] != "step"))
    computes = [s for s in spans if s["kind"] in COMPUTE]
    comms = [s for s in spans if s["kind"] == "comm"]
    nested = {id(c): [] for c in computes}
    alone = []
    for c in comms:
        home = next((x for x in computes if x["start_s"] <= c["start_s"] < x["end_s"]), None)
        (nested[id(home)] if home else alone).append(c)
    # Each compute span, cut where a collective inside it was called: (start, kind, payload).
    issue = []
    for x in computes:
        parts, cursor = [], x["start_s"]
        for c in sorted(nested[id(x)], key=lambda c: c["start_s"]):
            parts.append((cursor, c["start_s"]))
            issue.append((c["start_s"], 1, c))
            cursor = c["start_s"] if "waited_s" in c else max(cursor, c["end_s"])
        parts.append((cursor, x["end_s"]))
        measured = sum(b - a for a, b in parts)
        total = seconds(x)
        for a, b in parts:
            share = (b - a) / measured if measured > 0 else 1 / len(parts)
            issue.append((a, 0, {**x, "start_s": a, "end_s": b, "_seconds": total * share}))
    issue += [(c["start_s"], 1, c) for c in alone]
    issue.sort(key=lambda e: (e[0], e[1]))

    last_compute = last_collective = barrier = None
    pending: list[tuple[float, int]] = []   # async collectives not yet waited for: (waited_s, task)
    for at, _, s in issue:
        deps = [d for d in (last_compute, barrier) if d is not None]
        if s["kind"] != "comm":
            deps += [t for w, t in pending if w <= at]
            pending = [(w, t) for w, t in pending if w > at]
            tasks.append(Task(s["rank"], s["_seconds"], tuple(deps), kind=s["kind"], name=s["name"], data=s))
            last_compute = len(tasks) - 1
            continue
        if s["op"] in ("send", "recv"):
            pair = (s["rank"], s["peer"]) if s["op"] == "send" else (s["peer"], s["rank"])
            match, members = ("p2p", *pair), 2
        else:
            match, members = ("coll", tuple(s["group"])), len(s["group"])
            if last_collective is not None:
                deps.append(last_collective)   # one rank's collectives run in order, on their stream
        k = counters.get((match, s["rank"]), 0)
        counters[(match, s["rank"])] = k + 1
        tasks.append(Task(s["rank"], seconds(s), tuple(sorted(set(deps))), match=(*match, k), members=members,
                          kind="comm", name=s["name"], data=s))
        i = len(tasks) - 1
        if s["op"] not in ("send", "recv"):
            last_collective = i
        if "waited_s" in s:
            pending.append((s["waited_s"], i))
        else:
            barrier = i   # the rank waited in this call: nothing after it could start before it ended


def check_run(run: RunResult) -> RunResult:
    """``run``, if it holds what a saved run holds, else :class:`ConfigError` in one sentence saying what it
    lacks: a config that validates, its world of ranks, a finite loss and a step time for each step, and spans of
    known kinds on its ranks with finite times (a collective with its op, bytes and group). A file cut short or
    edited by hand is refused here, before a replay or a comparison reads it."""
    for name, kind in (("config", dict), ("device", str), ("backend", str), ("losses", list),
                       ("step_times_s", list), ("timeline", list), ("comm_bytes", dict), ("comm", list),
                       ("memory", dict), ("extras", dict)):
        if not isinstance(getattr(run, name), kind):
            raise ConfigError(f"a saved run's {name} is a {'JSON object' if kind is dict else kind.__name__}, "
                              f"not {type(getattr(run, name)).__name__}.")
    try:
        cfg = check(TrainConfig.from_dict(run.config), runnable=False)
    except (TypeError, KeyError, AttributeError) as e:  # a field of the wrong type, which validate cannot name
        raise ConfigError(f"a saved run's config does not describe a run ({type(e).__name__}: {e}).") from None
    if RANKS.check(run.world_size, "world_size") != cfg.world_size:
        raise ConfigError(f"a saved run's world_size={run.world_size} is not its layout's {cfg.world_size} ranks.")
    NON_NEGATIVE.check(run.start_step, "start_step")
    NON_NEGATIVE_NUMBER.check(run.tokens_per_s, "tokens_per_s")
    if not run.losses or len(run.step_times_s) != len(run.losses):
        raise ConfigError(f"a saved run has a loss and a step time for each step; this one has "
                          f"{len(run.losses)} losses and {len(run.step_times_s)} step times.")
    for i, (loss, seconds) in enumerate(zip(run.losses, run.step_times_s)):
        number().check(loss, f"losses[{i}]")
        NON_NEGATIVE_NUMBER.check(seconds, f"step_times_s[{i}]")
    rank = whole(0, run.world_size - 1, why=f"the run has {run.world_size} rank{'s' * (run.world_size > 1)}")
    kinds, ops = Name(SPAN_KINDS), Name(COLLECTIVES)
    for i, span in enumerate(run.timeline):
        where = f"timeline[{i}]"
        missing = [k for k in ("rank", "step", "kind", "name", "start_s", "end_s") if not isinstance(span, dict)
                   or k not in span] + (["op", "bytes"] if isinstance(span, dict) and span.get("kind") == "comm"
                                        and not {"op", "bytes"} <= set(span) else [])
        if missing:
            raise ConfigError(f"{where}, a span, lacks {', '.join(missing)}.")
        rank.check(span["rank"], f"{where}.rank")
        whole(least=-1).check(span["step"], f"{where}.step")  # -1: before the first step (set-up)
        kinds.check(span["kind"], f"{where}.kind")
        if not isinstance(span["name"], str):
            raise ConfigError(f"{where}.name={span['name']!r} must be text.")
        if span.get("microbatch") is not None:
            NON_NEGATIVE.check(span["microbatch"], f"{where}.microbatch")
        for key in ("start_s", "end_s", "waited_s", "wait_s", "delay_s"):
            if key in span:
                number().check(span[key], f"{where}.{key}")
        if span["end_s"] < span["start_s"]:
            raise ConfigError(f"{where} ends at {span['end_s']} s, before it starts at {span['start_s']} s.")
        if span["kind"] == "comm":
            ops.check(span["op"], f"{where}.op")
            NON_NEGATIVE_NUMBER.check(span["bytes"], f"{where}.bytes")
            group = span.get("group", [])
            if not isinstance(group, list):
                raise ConfigError(f"{where}.group={group!r} must be a list of ranks.")
            for peer in group + ([span["peer"]] if "peer" in span else []):
                rank.check(peer, f"{where}'s group or peer")
    return run


def replay(result, on: str = "h100", gpus_per_node: int = 8, nodes: int | None = None, cost=None) -> RunResult:
    """``result`` (a RunResult or its JSON path) replayed on a modeled cluster of ``on`` GPUs.

    ``nodes`` defaults to as many servers as the run's ranks need. ``cost(span, seconds)``,
    if given, returns the seconds to use instead of the model's for a span (a test can
    give every forward 1 and every backward 2 to compare with the schedule simulator).
    """
    try:
        r = check_run(RunResult.load(result))
    except ConfigError as e:
        raise ReplayError(str(e)) from None
    cfg = TrainConfig.from_dict(r.config)
    spans = [s for s in r.timeline if 0 <= s["step"] < len(r.losses)]
    if not spans:
        raise ReplayError("this run recorded no spans (record=False): run it again with record=True to replay it.")
    if any(s["kind"] == "comm" and "group" not in s for s in spans):
        raise ReplayError(f"this run's collectives ran inside PyTorch (impl={cfg.impl!r}), which records no group for "
                          f"them; replay a run of the scratch strategies (impl='scratch').")
    try:
        cluster = Cluster.of(on, gpus_per_node, nodes or -(-r.world_size // gpus_per_node))
    except KeyError as e:
        raise ReplayError(e.args[0]) from None
    except ValueError as e:
        raise ReplayError(str(e)) from None
    if cluster.gpus < r.world_size:
        raise ReplayError(f"the run has {r.world_size} ranks; {cluster.describe()} hold only {cluster.gpus}.")
    notes = []
    if cfg.tp > cluster.gpus_per_node:
        notes.append(f"tp={cfg.tp} is more than the {cluster.gpus_per_node} GPUs of a server: tensor parallelism "
                     f"crosses servers here, over the network, which real jobs avoid.")
        warnings.warn(notes[-1], stacklevel=2)
    split = any(s["kind"] == "backward" and s["name"].startswith("weights") for s in spans)

    def seconds(span: dict) -> float:
        if span["kind"] == "comm":
            model = cluster.collective_s(span["op"], span["bytes"], span["group"] if span["op"] not in
                                         ("send", "recv") else (span["rank"], span["peer"]))[0]
        else:
            model = span_seconds(cluster, cfg, span, split)
        return model if cost is None else cost(span, model)

    tasks: list[Task] = []
    counters: dict = {}
    for rank in sorted({s["rank"] for s in spans}):
        _rank_tasks([s for s in spans if s["rank"] == rank and s["kind"] != "step"], tasks, seconds, counters)
    layout = run_clock(tasks)
    result = _as_result(r, cfg, cluster, tasks, layout)
    result.extras["modeled"]["notes"] = notes
    return result


def _as_result(r: RunResult, cfg: TrainConfig, cluster: Cluster, tasks: list[Task], layout) -> RunResult:
    timeline, windows = [], {}
    for i, t in enumerate(tasks):
        s = t.data
        span = {"rank": t.rank, "step": s["step"], "kind": t.kind, "name": t.name, "microbatch": s["microbatch"],
                "start_s": layout.ready[i] if t.match else layout.start[i], "end_s": layout.end[i]}
        if t.match:
            span.update({k: s[k] for k in ("op", "bytes", "group", "peer") if k in s},
                        wait_s=layout.start[i] - layout.ready[i])
            if s.get("blocking"):
                span["blocking"] = True
        timeline.append(span)
        w = windows.setdefault((t.rank, s["step"]), [span["start_s"], span["end_s"]])
        w[0], w[1] = min(w[0], span["start_s"]), max(w[1], span["end_s"])
    # Each rank's step runs from where its previous step ended (or 0) to its last task's end.
    ends: dict[int, float] = {}
    for (rank, step), (a, b) in sorted(windows.items(), key=lambda kv: kv[0][1]):
        timeline.append({"rank": rank, "step": step, "kind": "step", "name": "step", "microbatch": None,
                         "start_s": ends.get(rank, 0.0), "end_s": b})
        ends[rank] = b
    steps = len(r.losses)
    step_end = [max((b for (_, st), (_, b) in windows.items() if st == k), default=0.0) for k in range(steps)]
    step_times = [step_end[k] - (step_end[k - 1] if k else 0.0) for k in range(steps)]
    timed = step_times[1:] if steps > 1 else step_times
    tokens = cfg.batch_size * cfg.seq_len * len(timed)
    timeline.sort(key=lambda s: (s["rank"], s["start_s"]))
    algorithms = {}
    for t in tasks:
        if t.match and t.data.get("op") not in ("send", "recv"):
            algo = cluster.collective_s(t.data["op"], t.data["bytes"], t.data["group"])[1]
            algorithms[algo] = algorithms.get(algo, 0) + 1
    modeled = {"gpu": cluster.gpu.name, "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes,
               "cluster": cluster.describe(), "measured_on": r.device, "measured_step_times_s": r.step_times_s,
               "tasks": len(tasks), "algorithms": algorithms}
    return RunResult(config=r.config, world_size=r.world_size, device=f"modeled {cluster.gpu.name}",
                     backend="modeled", losses=r.losses, step_times_s=step_times,
                     tokens_per_s=tokens / sum(timed) if sum(timed) > 0 else 0.0, timeline=timeline,
                     comm_bytes=r.comm_bytes, comm=r.comm, memory=r.memory,
                     extras={**r.extras, "modeled": modeled}, start_step=r.start_step)
