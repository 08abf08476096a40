"""A modeled GPU cluster: how long a piece of work would take on real hardware.

A :class:`Cluster` is a GPU kind from :mod:`gpucourse.gpus` (its peak FLOP/s, memory
bandwidth, NVLink and network bandwidths and latencies), ``gpus_per_node`` GPUs in
each server and ``nodes`` servers. Rank r sits on node ``r // gpus_per_node``: the
layouts put tensor-parallel ranks next to each other, so tensor parallelism stays
inside a server first, as :mod:`gpucourse.plan` assumes.

**Compute** is a roofline plus launches: the slower of ``flops ÷ (peak ×
achievable)`` and ``bytes ÷ memory bandwidth``, plus ``kernels × LAUNCH_S``
(a GPU kernel costs a few microseconds however small it is: tiny models are
launch-bound, which is why a toy run scales worse on GPUs than a big one).

**Collectives** follow the α–β model: each algorithm takes some steps of latency
α and moves some bytes at bandwidth β, the *slowest link* the group crosses —
NVLink when every member is in one server, the network cards when not: one per
GPU, as DGX-class servers have them, so a group with k members in each server
crosses over k cards at once (NCCL gives each card a channel of its own). For n
ranks and a payload of S bytes (the tensor of an all-reduce; the whole gathered
tensor of an all-gather or reduce-scatter):

    ring all-reduce      2(n−1)·α + 2(n−1)/n · S/β
    tree all-reduce      2·⌈log2 n⌉·α + 2 · S/β      (NCCL's double binary tree)
    all-gather, reduce-scatter, all-to-all   (n−1)·α + (n−1)/n · S/β
    broadcast            ⌈log2 n⌉·α + S/β
    send / receive       α + S/β

The all-reduce takes whichever of ring and tree is faster, as NCCL's tuner does:
tree for small messages on many ranks, ring for large ones. β is the link's
bandwidth × ``bus_efficiency`` (the share of it nccl-tests' bus bandwidth
reaches). NVLink SHARP (NVLS, in-switch reduction on H100 and later) is not
modeled: on one NVSwitch server it makes large all-reduces faster than this model
says (docs/modeled-timing.md shows by how much against published figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .gpus import GPUSpec, get_gpu

LAUNCH_S = 4e-6   # one kernel launch and its tail: a few µs on every recent GPU
RING_OPS = ("all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    gpus_per_node: int = 8
    nodes: int = 1

    @classmethod
    def of(cls, gpu: str | GPUSpec, gpus_per_node: int = 8, nodes: int = 1) -> "Cluster":
        """A cluster of ``gpu`` (a name from :mod:`gpucourse.gpus`, any case, or a GPUSpec)."""
        if gpus_per_node < 1 or nodes < 1:
            raise ValueError(f"a cluster needs at least one GPU per node and one node, not "
                             f"{gpus_per_node} per node on {nodes}.")
        return cls(get_gpu(gpu) if isinstance(gpu, str) else gpu, gpus_per_node, nodes)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, ranks) -> tuple[str, float, float]:
        """The slowest link among ``ranks``: (name, bytes/s as NCCL reaches it, latency in s).

        Across servers each GPU has its own network card (DGX-class servers are "rail-optimised": one NIC per
        GPU), and NCCL spreads a collective over as many channels as there are cards: a group with k members in
        each server crosses between servers over k cards at once, k × one card's bandwidth, but never faster
        than the NVLink each member's traffic also takes inside its server.
        """
        g = self.gpu
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node(r)] = per_node.get(self.node(r), 0) + 1
        intra = g.intra_node_GBps * 1e9 * g.bus_efficiency
        if len(per_node) <= 1:
            return "NVLink" if g.intra_node_GBps >= 100 else "PCIe", intra, g.intra_node_latency_us * 1e-6
        cards = min(per_node.values())
        return ("network", min(intra, cards * g.inter_node_GBps * 1e9 * g.bus_efficiency),
                g.inter_node_latency_us * 1e-6)

    def compute_s(self, flops: float, nbytes: float = 0.0, kernels: int = 0, precision: str = "bf16",
                  efficiency: float | None = None) -> float:
        """Seconds of one piece of computation: the roofline (see the module docstring) plus its launches.

        ``efficiency``: the share of the peak reached, instead of the GPU's ``achievable``."""
        g = self.gpu
        math_s = flops / (g.peak_flops(precision) * (efficiency or g.achievable))
        memory_s = nbytes / (g.hbm_GBps * 1e9) if g.hbm_GBps else 0.0
        return max(math_s, memory_s) + kernels * LAUNCH_S

    def collective_s(self, op: str, nbytes: float, ranks, algo: str | None = None) -> tuple[float, str]:
        """Seconds of one collective of ``op`` with payload ``nbytes`` among global ``ranks``; and its algorithm.

        ``algo``: ``"ring"`` or ``"tree"`` forces an all-reduce's algorithm (as ``NCCL_ALGO`` does); by default
        the faster one."""
        ranks = list(ranks)
        n = len(ranks)
        if op in ("send", "recv"):
            _, beta, alpha = self.link(ranks)
            return alpha + nbytes / beta, "p2p"
        if n <= 1:
            return 0.0, "none"
        _, beta, alpha = self.link(ranks)
        steps = math.ceil(math.log2(n))
        if op == "all_reduce":
            ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
            tree = 2 * steps * alpha + 2 * nbytes / beta
            if algo is not None:
                if algo not in ("ring", "tree"):
                    raise ValueError(f"no all-reduce algorithm {algo!r} in the model: ring or tree.")
                return (ring, "ring") if algo == "ring" else (tree, "tree")
            return (ring, "ring") if ring <= tree else (tree, "tree")
        if op in RING_OPS:
            return (n - 1) * alpha + (n - 1) / n * nbytes / beta, "ring"
        if op == "broadcast":
            return steps * alpha + nbytes / beta, "tree"
        raise ValueError(f"no cost model for the collective {op!r}; known: all_reduce, broadcast, send, recv, "
                         f"{', '.join(RING_OPS)}.")

    def bus_bandwidth(self, op: str, nbytes: float, n: int) -> float:
        """What nccl-tests would print as bus bandwidth (bytes/s) for ``op`` of ``nbytes`` on the first n GPUs."""
        seconds, _ = self.collective_s(op, nbytes, range(n))
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n if op in RING_OPS else 1.0
        return nbytes / seconds * factor

    def describe(self) -> str:
        return (f"{self.nodes} × {self.gpus_per_node} {self.gpu.name.upper()} "
                f"({self.gpus} GPU{'s' * (self.gpus > 1)})")
