"""What each strategy adds to a step's time, one function a strategy, under the names of ``parallel.STRATEGIES``.

:func:`gpucourse.modeled.plan.step_time` times the compute of the stage that sets the pace, then asks each strategy
here for its part: the transfers it makes in a step (``comm_s``), what of them holds compute up (``exposed_s``: the
rest hides behind matmuls, attention, backward or the next microbatch, as the framework overlaps them), and compute
it adds by itself (``extra_s``: the pipeline's bubble, recomputation's second forward). Every transfer is timed by
:class:`~gpucourse.modeled.cluster.Cluster`'s α–β model over the link its group crosses, with ranks placed as the
runtime places them (rank = ((stage·dp + d)·cp + c)·tp + t, ``gpus_per_node`` to a server).

A new strategy's author adds its function to :data:`COSTS` (a test walks ``STRATEGIES`` and fails without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import TrainConfig
from ..parallel.schedule_table import get as get_schedule
from .cluster import Cluster
from .shapes import Shape


@dataclass(frozen=True)
class Cost:
    """One strategy's share of a step, in seconds."""

    comm_s: float = 0.0     # everything it sends in a step
    exposed_s: float = 0.0  # what of that the step waits for
    extra_s: float = 0.0    # compute it adds (a bubble, a recomputed forward)


@dataclass(frozen=True)
class Step:
    """What the strategies' costs are computed from: the layout, the model's shape, the cluster and the framework's
    overlap, and the compute already timed (``pace``: one microbatch on the slowest stage, by part)."""

    cfg: TrainConfig
    shape: Shape
    cluster: Cluster
    overlap: object          # plan.Overlap: what the framework hides behind what
    gpus_per_node: int
    num_params: int
    m: int                   # microbatches a step (pipeline microbatches, or accumulated parts)
    pace: dict               # seconds of one microbatch: forward, backward, recompute, attention, gemm; blocks
    compute_s: float         # forward and backward of the whole step, recomputation included
    recompute_s: float
    bubble_ratio: float      # idle over compute of the pipeline's schedule
    elem: int = field(init=False)  # bytes of an activation value

    def __post_init__(self):
        object.__setattr__(self, "elem", 2 if self.cfg.precision != "fp32" else 4)

    @property
    def local_tokens(self) -> float:
        """The tokens one rank of a context-parallel group holds and sends, a microbatch."""
        cfg = self.cfg
        return cfg.batch_size * cfg.seq_len // (cfg.dp * self.m) / cfg.cp

    @property
    def window_s(self) -> float:
        """The backward (with its recomputation) that gradient reductions may hide behind, where the framework
        reduces during backward."""
        return self.pace["backward"] + self.pace["recompute"] if self.overlap.dp == "backward" else 0.0

    def cost(self, op: str, nbytes: float, ranks) -> float:
        return self.cluster.collective_s(op, nbytes, ranks)[0]


def tensor_cost(s: Step) -> Cost:
    """Per block and microbatch: two all-reduces forward, two backward (three with full recomputation), hidden
    beside the matmuls where the framework splits them so."""
    cfg = s.cfg
    if cfg.tp == 1:
        return Cost()
    passes = 6 if cfg.recompute == "full" else 4
    comm = passes * s.pace["blocks"] * s.m * s.cost("all_reduce", s.local_tokens * s.shape.hidden * s.elem,
                                                      range(cfg.tp))
    return Cost(comm, max(0.0, comm - s.m * s.pace["gemm"]) if s.overlap.tp else comm)


def pipeline_cost(s: Step) -> Cost:
    """Each microbatch's activation forward and its gradient back, once per chunk a rank holds; only the first each
    way waits where the framework sends beside the next microbatch. The bubble is the schedule's idle time."""
    cfg = s.cfg
    if cfg.pp == 1:
        return Cost()
    C = s.shape.hidden
    hops = 2 * s.m * (cfg.virtual_stages if get_schedule(cfg.schedule).interleaved else 1)
    split = cfg.tp if (s.overlap.pp_scatter or cfg.sequence_parallel) else 1
    stage_neighbours = (0, cfg.tp * cfg.cp * cfg.dp)
    comm = hops * s.cost("send", s.local_tokens * C * s.elem / split, stage_neighbours)
    if split > 1:  # the receiving stage all-gathers the pieces over NVLink
        comm += hops * s.cost("all_gather", s.local_tokens * C * s.elem, range(cfg.tp))
    return Cost(comm, comm / s.m if s.overlap.pp else comm, s.compute_s * s.bubble_ratio)


def context_cost(s: Step) -> Cost:
    """The ring's K/V blocks, forward and backward, per block and microbatch; hidden behind attention on this
    block where the framework overlaps them. A ring goes at its slowest hop: one that leaves the server where the
    group spans servers."""
    cfg = s.cfg
    if cfg.cp == 1:
        return Cost()
    neighbours = (0, cfg.tp) if cfg.cp * cfg.tp <= s.gpus_per_node else (0, s.gpus_per_node)
    kv_width = 2 * s.shape.head_dim * s.shape.kv_heads_per_rank(cfg.tp)  # a rank's K and V per token
    chunk = s.local_tokens * kv_width * s.elem
    comm = s.pace["blocks"] * s.m * (3 * (cfg.cp - 1) + cfg.cp) * s.cost("send", chunk, neighbours)
    return Cost(comm, max(0.0, comm - s.m * s.pace["attention"]) if s.overlap.cp else comm)


def experts_cost(s: Step) -> Cost:
    """Per MoE block and microbatch: dispatch and combine forward, both again backward; none of it hidden."""
    cfg = s.cfg
    if cfg.ep == 1:
        return Cost()
    moe_blocks = s.shape.moe_layers / cfg.pp
    rows = s.local_tokens * s.shape.top_k * s.shape.hidden * s.elem
    comm = moe_blocks * s.m * 4 * s.cost("all_to_all", rows, range(0, cfg.ep * cfg.cp * cfg.tp, cfg.cp * cfg.tp))
    return Cost(comm, comm)


def recomputation_cost(s: Step) -> Cost:
    """The forward computed again in backward: full (every block's) or selective (attention's core), timed with the
    rest of the compute (:func:`gpucourse.modeled.plan.step_time`)."""
    return Cost(extra_s=s.recompute_s)


def data_cost(s: Step) -> Cost:
    """The gradients averaged over the replicas (dp × cp ranks of the same weights): one all-reduce after or during
    backward, or, under ZeRO-3, the weights gathered for each use and the gradients reduce-scattered, block by block;
    the experts' own gradients over their dp/ep replicas."""
    cfg, cluster = s.cfg, s.cluster
    replicas = range(0, cfg.dp * cfg.cp * cfg.tp, cfg.tp)
    experts = s.shape.expert_params() if cfg.ep > 1 else 0  # averaged over their dp/ep replicas instead
    comm = exposed = 0.0
    if len(replicas) > 1:
        shard = (s.num_params - experts) / (cfg.tp * cfg.pp) * s.elem
        if cfg.zero == 3:
            # Every microbatch gathers the weights for forward, again for backward (and for the recomputed
            # forward), and reduce-scatters the gradients: each half an all-reduce's worth. Prefetched, each
            # hides behind the compute it feeds but the first layer's.
            # They go block by block (FSDP's units), so each pays a ring's latency: at thousands of ranks that adds up.
            blocks = s.pace["blocks"]
            collectives = (4 if cfg.recompute == "full" else 3) * blocks
            per_micro = collectives * s.cost("all_gather", shard / blocks, replicas)
            if s.overlap.one_card and cluster.servers(replicas) > 1:
                card = cluster.gpu.inter_node_GBps * 1e9 * cluster.gpu.bus_efficiency
                n = len(replicas)
                per_micro = collectives * ((n - 1) / n * shard / blocks / card + cluster.ring_latency_s(replicas))
            comm = s.m * per_micro
            if s.overlap.prefetch:
                busy = s.pace["forward"] + s.pace["backward"] + s.pace["recompute"]
                exposed = s.m * (max(0.0, per_micro - busy) + per_micro / collectives)
            else:
                exposed = comm
        else:
            comm = s.cost("all_reduce", shard, replicas)
            exposed = max(0.0, comm - s.window_s)
    if experts and cfg.dp > cfg.ep:
        expert_replicas = range(0, cfg.dp * cfg.cp * cfg.tp, cfg.ep * cfg.cp * cfg.tp)
        extra = s.cost("all_reduce", experts / (cfg.tp * cfg.pp * cfg.ep) * s.elem, expert_replicas)
        left = max(0.0, s.window_s - comm)  # backward still running once the other gradients are reduced
        comm += extra
        exposed += max(0.0, extra - left)
    return Cost(comm, min(exposed, comm))


# Under the names of parallel.STRATEGIES, in the order the parts of a step are summed.
COSTS = {"recomputation": recomputation_cost, "pipeline": pipeline_cost, "tensor": tensor_cost,
         "context": context_cost, "experts": experts_cost, "data": data_cost}
# The short names a step's parts and a plan's columns use.
SHORT = {"tensor": "tp", "context": "cp", "pipeline": "pp", "experts": "ep", "data": "dp"}


@dataclass(frozen=True)
class StepTime:
    """One layout's modeled step, by named part: the compute of the stage that sets the pace, each strategy's
    :class:`Cost`, and the optimizer's step; ``step_s`` is their sum."""

    compute_s: float           # forward and backward of the step, recomputation included
    costs: dict                # strategy name -> Cost
    optimizer_s: float
    tokens: int                # a step's tokens
    model_flops: float         # the model's FLOPs of a step (PaLM's count, no recomputation)
    peak_flops: float          # the GPUs' peak, all of them
    framework: str
    offload: dict | None = None  # the optimizer on the CPU (gpucourse.modeled.offload.offload_time)

    @property
    def recompute_s(self) -> float:
        return self.costs["recomputation"].extra_s

    @property
    def bubble_s(self) -> float:
        return self.costs["pipeline"].extra_s

    @property
    def parts(self) -> dict:
        """Seconds of the step by part: compute, recompute, bubble, each strategy's exposed communication (tp, cp,
        pp, ep, dp), optimizer — what :func:`gpucourse.modeled.plan.explain` prints."""
        exposed = {SHORT[name]: self.costs[name].exposed_s for name in ("tensor", "context", "pipeline", "experts",
                                                                         "data")}
        return {"compute": self.compute_s - self.recompute_s, "recompute": self.recompute_s,
                "bubble": self.bubble_s, **exposed, "optimizer": self.optimizer_s}

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    @property
    def communication_s(self) -> float:
        """The communication the step waits for, every strategy's."""
        return sum(self.costs[name].exposed_s for name in ("tensor", "context", "pipeline", "experts", "data"))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_flops)

    def as_dict(self) -> dict:
        """The step as plain data, for a plan's rows and its JSON: ``step_s``, ``compute_s``, each strategy's
        ``<short>_comm_s`` and ``<short>_exposed_s``, ``parts``, ``mfu``..."""
        return {"step_s": self.step_s, "compute_s": self.compute_s, "recompute_s": self.recompute_s,
                "bubble_s": self.bubble_s, "communication_s": self.communication_s,
                **{f"{SHORT[n]}_exposed_s": self.costs[n].exposed_s for n in ("data", "tensor", "context",
                                                                               "pipeline", "experts")},
                **{f"{SHORT[n]}_comm_s": self.costs[n].comm_s for n in ("tensor", "pipeline", "context", "experts",
                                                                         "data")},
                "optimizer_s": self.optimizer_s, "offload": self.offload, "parts": self.parts,
                "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops, "mfu": self.mfu,
                "framework": self.framework}
