"""A modeled GPU cluster: how long a piece of work would take on real hardware.

A :class:`Cluster` is a GPU kind from :mod:`gpucourse.modeled.gpus` (its peak FLOP/s, memory
bandwidth, NVLink and network bandwidths and latencies), ``gpus_per_node`` GPUs in
each server and ``nodes`` servers. Rank r sits on node ``r // gpus_per_node``: the
layouts put tensor-parallel ranks next to each other, so tensor parallelism stays
inside a server first, as :mod:`gpucourse.modeled.plan` assumes.

**Compute** of a recorded span (:meth:`Cluster.compute_s`, what a replay uses) is a roofline plus launches: the
slower of ``flops ÷ (peak × achievable)`` and ``bytes ÷ memory bandwidth``, plus ``kernels × LAUNCH_S`` (a GPU
kernel costs a few microseconds however small it is: tiny models are launch-bound, which is why a toy run scales
worse on GPUs than a big one).

**Kernels by shape** (:meth:`Cluster.kernel_s`, what the planner uses, one kernel of
:meth:`gpucourse.modeled.shapes.Shape.kernels` at a time):

- a **matmul** of m×k by k×n is cut into output tiles (256×128, 128×256, 128×128 or 64×128: the kernel takes
  whichever finishes first) that the GPU's ``sm_count`` SMs work through in *waves*: ⌈tiles ÷ SMs⌉ waves, each
  as long as one tile's 2·a·b·(k + ``gemm_overhead_k``) FLOPs at the SM's share of ``peak × gemm_efficiency ×
  sustained`` (NVIDIA's Matrix Multiplication Background guide: tile and wave quantization). A tile's prologue
  and epilogue cost as much as ``gemm_overhead_k`` more of k (``gemm_fp8_overhead`` times that in fp8), so small
  matmuls run further from the peak than large ones, and gain less from fp8; a skinny one is bound by the bytes it reads (its inputs and output over ``hbm_efficiency`` of the
  memory bandwidth). One of fewer rows than the smallest tile (a decode step's, timed by serving's model) runs as a
  GEMV or split-K kernel instead (:meth:`Cluster.skinny_gemm_s`): every SM streams its share of the weights, so a
  1-row product costs its bytes over that bandwidth;
- **attention** is one fused kernel (FlashAttention): blocks of 128 queries, each going through its (causal: on
  average half the) keys, at ``attention_efficiency`` of the peak forward and ``attention_bwd_efficiency``
  backward (2.5× the forward's FLOPs); ``flash2_share`` of that for FlashAttention-2 on a GPU whose best kernel is
  newer; or, unfused, two batched matmuls and a softmax that writes the T×T scores;
- **element-wise** work (norms, activations, residual adds) moves its bytes at the memory bandwidth.

``gemm_efficiency``, ``attention_*`` and ``hbm_efficiency`` are public measurements (cited in
:mod:`gpucourse.modeled.gpus`); ``sustained`` (the clock a GPU holds through a training step) and ``gemm_overhead_k`` are
fitted on the fitting set of :mod:`gpucourse.modeled.published` only.

**Collectives** follow the α–β model: each algorithm takes some steps of latency
α and moves some bytes at bandwidth β, the *slowest link* the group crosses —
NVLink when every member is in one server, the network cards when not: one per
GPU, as DGX-class servers have them, so a group with k members in each server
crosses over k cards at once (NCCL gives each card a channel of its own). For n
ranks and a payload of S bytes (the tensor of an all-reduce; the whole gathered
tensor of an all-gather or reduce-scatter):

    ring all-reduce      2(n−N)·α_NVLink + 2(N−1)·α_network + 2(n−1)/n · S/β
    tree all-reduce      2·((k−1)·α_NVLink + ⌈log2 N⌉·α_network) + 2 · S/β
    all-gather, reduce-scatter   (n−N)·α_NVLink + (N−1)·α_network + (n−1)/n · S/β
    all-to-all           (n−1)·α + (n−1)/n · S/β
    broadcast            ⌈log2 n⌉·α + S/β
    send / receive       α + S/β

for a group of n ranks over N servers, k of them in each (one server: N = 1, and
α is the link's own). A ring's steps that stay inside a server pay NVLink's
latency and only those that cross pay the network's, as NCCL's tuning model
counts them (NVIDIA/nccl, src/graph/tuning.cc). NCCL's tree is a chain through
the k members in each server and a double binary tree of the N servers
(src/graph/connect.cc; its latency is tuning.cc's formula): inside one server it
has the ring's n − 1 steps and more bytes, so there the ring always wins; across
many servers its few network hops win small and medium messages; NCCL gives a
tree 0.92 of a ring's bandwidth (``TREE_BANDWIDTH``). Each runs in one of
NCCL's protocols (:data:`PROTOCOLS`): Simple, as written above; LL, whose steps
cost a fraction of Simple's latency at a quarter of the bandwidth (NCCL's
tuning figure for a ring's LL up to 2.20; from 2.21 NCCL gives it half);
LL128, in between (about half Simple's latency at 0.92 of its bandwidth). On a
server of GPUs with NVLink SHARP (H100 and later), an all-reduce may also run
as **NVLS**: the switches reduce the data in flight, so each GPU sends its
buffer once and receives the sum once, S ÷ (link × ``nvls_efficiency``) after
NCCL's 25 µs (:meth:`Cluster.nvls_s`). An all-reduce takes whichever algorithm
and protocol is fastest, as NCCL's tuner does (:meth:`Cluster.choice` names
them). β is the link's bandwidth × ``bus_efficiency`` (the share of it
nccl-tests' bus bandwidth reaches). NVLS across servers (NVLS-tree) and
InfiniBand SHARP are not modeled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .gpus import GPUSpec, get_gpu

LAUNCH_S = 4e-6   # one kernel launch and its tail: a few µs on every recent GPU
ADAM_BYTES_PER_PARAM = 28     # read weight, gradient and two moments (fp32), write weight and moments
# NCCL's protocols, as its tuning model prices them (NVIDIA/nccl, src/graph/tuning.cc: hwLat and the bandwidth
# refinements). Simple moves data at the link's whole bandwidth and pays the link's latency at every step. LL
# ("low latency") sends a flag with every 8 bytes, so the receiver needs no separate signal: a step costs a fraction
# of Simple's latency (the ring's table up to NCCL 2.17: 0.47 against 3.4 µs over NVLink, 1.0 against 5.7 over PCIe,
# 2.7 against 9.6 over the network; 2.18 made them 0.6 of 3.4 and 2.7 of 14) at a quarter of the bandwidth: tuning.cc's factor for a ring all-reduce's LL up to NCCL 2.20.
# From 2.21 NCCL gives it half (busBw × 0.5); the model keeps the quarter, which its figures were made with.
PROTOCOLS = ("Simple", "LL", "LL128")
LL_LATENCY = {"NVLink": 0.47 / 3.4, "PCIe": 1.0 / 5.7, "network": 2.7 / 9.6}
LL_BANDWIDTH = 1 / 4
# LL128: a flag in every 128-byte line, so 120 of 128 bytes carry data (tuning.cc: busBw × 0.92 for a ring), at a
# per-step latency between LL's and Simple's (the ring's hardware latencies: 1.9 of Simple's 3.4 µs over NVLink,
# 2.5 of 5.7 over PCIe, 4.0 of 14 over the network).
LL128_LATENCY = {"NVLink": 1.9 / 3.4, "PCIe": 2.5 / 5.7, "network": 4.0 / 14.0}
LL128_BANDWIDTH = 0.92
TREE_BANDWIDTH = 0.92   # tuning.cc gives a tree all-reduce 0.92 of the ring's bus bandwidth
NVLS_LATENCY_S = 25e-6  # tuning.cc: NVLS's hardware latency inside a server, Simple protocol
# tuning.cc's base latency of one collective by protocol (a ring's; a tree's differs by 0.2 µs for LL), paid once
# before the per-step latencies: what makes LL128 lose to LL on small messages.
BASE_LATENCY = {"LL": 6.6e-6, "LL128": 14e-6, "Simple": 8.4e-6}
ALGORITHMS = ("ring", "tree", "nvls")
SHARE = {"Simple": 1.0, "LL": LL_BANDWIDTH, "LL128": LL128_BANDWIDTH}
# Kernels by shape (Cluster.gemm_s, attention_s): the output tiles a GEMM kernel may use (cuBLAS picks per shape;
# NVIDIA's Matrix Multiplication Background guide: tile and wave quantization) and FlashAttention's block of
# queries. What a tile's prologue and epilogue cost is the GPU's ``gemm_overhead_k`` (gpucourse.modeled.gpus).
TILES = ((256, 128), (128, 256), (128, 128), (64, 128))
# A matmul of fewer rows than the smallest tile is high (a decode step's, one row a sequence) runs as a GEMV or a
# split-K GEMM instead (Cluster.skinny_gemm_s), its rows padded to the tensor cores' smallest tile, 16 (PTX ISA:
# mma.sync.m16n8k16); cuBLAS and TensorRT-LLM pick such kernels for small m (TensorRT-LLM's weight-only GEMV, CUTLASS's
# split-K and swap-AB), which read each weight once with every SM busy.
SKINNY_ROWS = 64
SKINNY_PAD = 16
ATTENTION_BLOCK = 128
RING_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # n − 1 steps, (n−1)/n of the payload each rank


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    gpus_per_node: int = 8
    nodes: int = 1

    @classmethod
    def of(cls, gpu: str | GPUSpec, gpus_per_node: int = 8, nodes: int = 1) -> "Cluster":
        """A cluster of ``gpu`` (a name from :mod:`gpucourse.modeled.gpus`, any case, or a GPUSpec)."""
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
        per_node = self._per_node(ranks)
        intra = g.intra_node_GBps * 1e9 * g.bus_efficiency
        if len(per_node) <= 1:
            return self._intra_link, intra, g.intra_node_latency_us * 1e-6
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

    # --- kernels by shape ---------------------------------------------------------------------------------------------
    def gemm_s(self, m: float, n: float, k: float, precision: str = "bf16", count: float = 1,
               weight_elem: float | None = None, activation_elem: float | None = None) -> float:
        """Seconds of ``count`` matmuls of an m×k by a k×n matrix (a grouped GEMM when ``count`` > 1): a roofline
        on the matmul's own shape (see "Kernels by shape" in the module docstring). ``precision`` is what the
        tensor cores multiply in; the k×n weights and the m×k and m×n activations are read and written in its
        bytes unless ``weight_elem`` or ``activation_elem`` say otherwise (a weight-only quantized matmul reads
        INT4 weights and bf16 activations and multiplies in bf16)."""
        g = self.gpu
        share = g.gemm_fp8_efficiency if precision == "fp8" and g.gemm_fp8_efficiency else g.gemm_efficiency
        per_sm = g.peak_flops(precision) * share * g.sustained / g.sm_count
        overhead = g.gemm_overhead_k * (g.gemm_fp8_overhead if precision == "fp8" else 1.0)
        math_s = min(math.ceil(count * math.ceil(m / a) * math.ceil(n / b) / g.sm_count) * 2 * a * b * (k + overhead)
                     for a, b in TILES) / per_sm
        return max(math_s, self._matmul_bytes_s(m, n, k, precision, count, weight_elem, activation_elem)) + LAUNCH_S

    def _matmul_bytes_s(self, m, n, k, precision, count, weight_elem, activation_elem) -> float:
        elem = 1 if precision == "fp8" else 4 if precision == "fp32" else 2
        weight = elem if weight_elem is None else weight_elem
        activation = elem if activation_elem is None else activation_elem
        return count * ((m * k + m * n) * activation + k * n * weight) / self.hbm_Bps

    def skinny_gemm_s(self, m: float, n: float, k: float, precision: str = "bf16", count: float = 1,
                      weight_elem: float | None = None, activation_elem: float | None = None) -> float:
        """Seconds of ``count`` matmuls of only ``m`` ≤ :data:`SKINNY_ROWS` rows (a decode step's: one row a sequence),
        as serving engines run them: a GEMV, or a GEMM with the weights' n in the tile's long side and k split over
        the SMs (split-K), so every SM streams its share of the weights instead of one 64-row tile a weight column.
        Compute pads the rows to the tensor cores' smallest tile height (:data:`SKINNY_PAD`: mma.sync m16n8k16) at
        the same ``gemm_efficiency × sustained`` as :meth:`gemm_s`; bytes are the weights and activations at the
        bandwidth a streaming kernel reaches (:attr:`hbm_Bps`). A 1-row product is memory-bound on every GPU here.
        Serving's model uses it (``serve_plan``); training's matmuls never have so few rows. ``weight_elem`` and
        ``activation_elem``: as :meth:`gemm_s`."""
        g = self.gpu
        share = g.gemm_fp8_efficiency if precision == "fp8" and g.gemm_fp8_efficiency else g.gemm_efficiency
        math_s = count * 2 * math.ceil(m / SKINNY_PAD) * SKINNY_PAD * n * k / (g.peak_flops(precision) * share
                                                                             * g.sustained)
        return max(math_s, self._matmul_bytes_s(m, n, k, precision, count, weight_elem, activation_elem)) + LAUNCH_S

    @property
    def hbm_Bps(self) -> float:
        """Memory bandwidth an element-wise kernel reaches (the datasheet's × ``hbm_efficiency``)."""
        return self.gpu.hbm_GBps * 1e9 * self.gpu.hbm_efficiency

    def memory_kernel_s(self, elements: float, elem: int = 2) -> float:
        """Seconds of element-wise work that reads and writes ``elements`` values of ``elem`` bytes."""
        return elements * elem / self.hbm_Bps + LAUNCH_S

    def attention_s(self, sequences: float, heads: float, q: float, kv: float, head_dim: int,
                    backward: bool = False, kernel: str = "flash") -> float:
        """Seconds of causal attention (scores, softmax, weighted sum) for ``sequences`` × ``heads`` of ``q`` queries
        against ``kv`` keys (a context-parallel rank's T/cp queries against all T: the zig-zag split gives each
        rank half the keys on average, as one device's causal mask does).

        ``kernel="flash"``: one fused kernel (the GPU's best: FlashAttention-3 on Hopper), blocks of 128 queries spread over the SMs, each
        block going through its (causal: half) of the keys at ``attention_efficiency`` of the peak (backward:
        2.5× the forward's FLOPs, at ``attention_bwd_efficiency``); ``"flash2"``: FlashAttention-2, at
        ``flash2_share`` of those. ``"unfused"``: two batched matmuls and a
        softmax that writes the T×T scores to memory, as Megatron-LM did before fused attention kernels."""
        g = self.gpu
        keys = kv / 2
        if kernel == "unfused":
            scores = dict(count=sequences * heads, precision="bf16")
            passes = 2 if backward else 1  # backward: each matmul's two gradients
            s = passes * (self.gemm_s(q, kv, head_dim, **scores) + self.gemm_s(q, head_dim, kv, **scores))
            return s + self.memory_kernel_s((3 if backward else 2) * sequences * heads * q * kv)
        if kernel not in ("flash", "flash2"):
            raise ValueError(f"no attention kernel {kernel!r} in the model: flash, flash2 or unfused.")
        share = (g.attention_bwd_efficiency if backward else g.attention_efficiency) \
            * (g.flash2_share if kernel == "flash2" else 1.0)
        blocks = sequences * heads * math.ceil(q / ATTENTION_BLOCK)
        per_block = 4 * ATTENTION_BLOCK * (keys + g.gemm_overhead_k) * head_dim * (2.5 if backward else 1)
        return math.ceil(blocks / g.sm_count) * per_block / (g.peak_bf16_flops * share * g.sustained / g.sm_count) + LAUNCH_S

    def kernel_s(self, kernel: dict, precision: str = "bf16", backward: bool = False, attention: str = "flash") -> float:
        """Seconds of one kernel of :meth:`gpucourse.modeled.shapes.Shape.kernels` (its forward, or ``backward``: a
        matmul's input and weight gradients, attention's backward, element-wise work twice)."""
        kind = kernel["kind"]
        if kind == "gemm":
            m, n, k, c = kernel["m"], kernel["n"], kernel["k"], kernel["count"]
            if not backward:
                return self.gemm_s(m, n, k, precision, c)
            return self.gemm_s(m, k, n, precision, c) + self.gemm_s(k, n, m, precision, c)
        if kind == "attention":
            return self.attention_s(kernel["sequences"], kernel["heads"], kernel["q"], kernel["kv"],
                                    kernel["head_dim"], backward, attention)
        if kind == "memory":
            return self.memory_kernel_s(kernel["elements"] * (2 if backward else 1))
        raise ValueError(f"no kind of kernel {kind!r}: gemm, attention or memory.")

    def optimizer_s(self, params: float) -> float:
        """Seconds of one Adam step over ``params`` parameters: memory-bound, it reads and writes
        :data:`ADAM_BYTES_PER_PARAM` bytes for each (and launches about ten kernels)."""
        return self.compute_s(0.0, params * ADAM_BYTES_PER_PARAM, kernels=10)

    def collective_s(self, op: str, nbytes: float, ranks, algo: str | None = None,
                     protocol: str | None = None) -> tuple[float, str]:
        """Seconds of one collective of ``op`` with payload ``nbytes`` among global ``ranks``; and its algorithm.

        ``algo``: ``"ring"`` or ``"tree"`` forces an all-reduce's algorithm (as ``NCCL_ALGO`` does), ``protocol``
        ``"Simple"`` or ``"LL"`` the protocol of a ring or tree (as ``NCCL_PROTO`` does); by default the fastest
        (:meth:`choice` names the protocol too)."""
        seconds, chosen, _ = self.choice(op, nbytes, ranks, algo, protocol)
        return seconds, chosen

    def choice(self, op: str, nbytes: float, ranks, algo: str | None = None,
               protocol: str | None = None) -> tuple[float, str, str]:
        """:meth:`collective_s` with the protocol: ``(seconds, algorithm, protocol)``, the fastest allowed."""
        ranks = ranks if isinstance(ranks, range) else list(ranks)
        n = len(ranks)
        if algo is not None and algo not in ALGORITHMS:
            raise ValueError(f"no all-reduce algorithm {algo!r} in the model: ring, tree or nvls.")
        if protocol is not None and protocol not in PROTOCOLS:
            raise ValueError(f"no protocol {protocol!r} in the model: {' or '.join(PROTOCOLS)}.")
        if op in ("send", "recv"):
            _, beta, alpha = self.link(ranks)
            return alpha + nbytes / beta, "p2p", "Simple"
        if n <= 1:
            return 0.0, "none", "none"
        _, beta, alpha = self.link(ranks)
        if op in ("all_reduce", "all_gather", "reduce_scatter"):
            options = []
            if op == "all_reduce" and algo in (None, "nvls") and protocol in (None, "Simple"):
                nvls = self.nvls_s(nbytes, ranks)
                if nvls is not None:
                    options.append((nvls, "nvls", "Simple"))
                elif algo == "nvls":
                    raise ValueError(f"NVLS needs the group inside one server of GPUs with NVLink SHARP (H100 and "
                                     f"later); {self.gpu.name} × {n} here has none.")
            for proto in [protocol] if protocol else PROTOCOLS:
                share = SHARE[proto]
                if algo == "nvls":
                    break
                base = BASE_LATENCY[proto]
                if op != "all_reduce":
                    options.append((base + self.ring_latency_s(ranks, 1, proto)
                                    + (n - 1) / n * nbytes / (beta * share), "ring", proto))
                    continue
                if algo in (None, "ring"):
                    options.append((base + self.ring_latency_s(ranks, 2, proto)
                                    + 2 * (n - 1) / n * nbytes / (beta * share), "ring", proto))
                if algo in (None, "tree"):
                    options.append((base + 2 * self.tree_latency_s(ranks, proto)
                                    + 2 * nbytes / (beta * share * TREE_BANDWIDTH), "tree", proto))
            return min(options, key=lambda o: o[0])
        if op == "all_to_all":  # n − 1 exchanges, each as slow as the slowest link
            return (n - 1) * alpha + (n - 1) / n * nbytes / beta, "ring", "Simple"
        if op in ("broadcast", "reduce"):  # one root: each byte crosses each link once, as NCCL pipelines it
            return math.ceil(math.log2(n)) * alpha + nbytes / beta, "tree", "Simple"
        raise ValueError(f"no cost model for the collective {op!r}; known: all_reduce, broadcast, reduce, send, recv, "
                         f"{', '.join(RING_OPS)}.")

    def nvls_s(self, nbytes: float, ranks) -> float | None:
        """An all-reduce by NVLS (NVLink SHARP: the NVSwitches add the numbers up as they pass): each GPU sends its
        data into the switch once and takes the sum out once, so its algorithm bandwidth is a share of one link
        (``nvls_efficiency``) whatever the group's size — NCCL's latency for it is 25 µs. None where there is no
        NVLS: a GPU without it, a group across servers (NCCL's NVLS-tree, not modeled), fewer than 3 GPUs."""
        g = self.gpu
        if not g.nvls_efficiency or len(ranks) < 3 or self.servers(ranks) > 1:
            return None
        return NVLS_LATENCY_S + nbytes / (g.intra_node_GBps * 1e9 * g.nvls_efficiency)

    @property
    def _intra_link(self) -> str:
        """What joins the GPUs of one server: NVLink, or PCIe where the GPU has none."""
        return "NVLink" if self.gpu.intra_node_GBps >= 100 else "PCIe"

    def servers(self, ranks) -> int:
        """How many servers ``ranks`` span."""
        return len(self._per_node(ranks))

    def _per_node(self, ranks) -> dict[int, int]:
        """How many of ``ranks`` each server holds."""
        if isinstance(ranks, range) and len(ranks) > 64:  # a strided group (the planner's): count it, don't walk it
            return self._per_node_range(ranks.start, ranks.stop, ranks.step)
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node(r)] = per_node.get(self.node(r), 0) + 1
        return per_node

    @functools.lru_cache(maxsize=4096)
    def _per_node_range(self, start: int, stop: int, step: int) -> dict[int, int]:
        per_node: dict[int, int] = {}
        for r in range(start, stop, step):
            per_node[r // self.gpus_per_node] = per_node.get(r // self.gpus_per_node, 0) + 1
        return per_node

    def _latencies(self, ranks, protocol: str = "Simple") -> tuple[int, int, float, float]:
        """(servers the group spans, most members in one, a step's latency inside a server, across servers)."""
        per_node = self._per_node(ranks)
        g = self.gpu
        inside, network = g.intra_node_latency_us * 1e-6, g.inter_node_latency_us * 1e-6
        if protocol in ("LL", "LL128"):
            factor = LL_LATENCY if protocol == "LL" else LL128_LATENCY
            inside *= factor[self._intra_link]
            network *= factor["network"]
        return len(per_node), max(per_node.values()), inside, network

    def ring_latency_s(self, ranks, passes: int = 1, protocol: str = "Simple") -> float:
        """The latency of ``passes`` trips round a ring of ``ranks`` (2 for an all-reduce): n − 1 steps a pass, of
        which only the N − 1 that cross between N servers pay the network's latency, as NCCL's own tuning model
        counts them (src/graph/tuning.cc); the others pay NVLink's."""
        servers, _, inside, network = self._latencies(ranks, protocol)
        steps, crossing = passes * (len(ranks) - 1), passes * (servers - 1)
        return (steps - crossing) * inside + crossing * network

    def tree_latency_s(self, ranks, protocol: str = "Simple") -> float:
        """One way through NCCL's tree for ``ranks``: a chain through the members in each server (NVLink hops),
        then a double binary tree of the servers (⌈log2 servers⌉ network hops). Inside one server the tree is
        only the chain: as many steps as the ring, so it never wins there."""
        servers, most, inside, network = self._latencies(ranks, protocol)
        return (most - 1) * inside + math.ceil(math.log2(servers)) * network

    def bus_bandwidth(self, op: str, nbytes: float, n: int) -> float:
        """What nccl-tests would print as bus bandwidth (bytes/s) for ``op`` of ``nbytes`` on the first n GPUs."""
        seconds, _ = self.collective_s(op, nbytes, range(n))
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n if op in RING_OPS else 1.0
        return nbytes / seconds * factor

    def describe(self) -> str:
        return (f"{self.nodes} × {self.gpus_per_node} {self.gpu.name.upper()} "
                f"({self.gpus} GPU{'s' * (self.gpus > 1)})")
