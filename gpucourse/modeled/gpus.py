"""A small table of accelerators: how fast they compute, how much they hold, how fast they talk.

Profiling (MFU: model FLOP/s over the peak) and planning (does a layout fit,
how long does its communication take) need the same few numbers per GPU::

    from gpucourse.modeled.gpus import get_gpu
    h100 = get_gpu("h100")
    h100.peak_flops("bf16")      # 9.89e14 FLOP/s, dense (no 2:4 sparsity)
    h100.memory_gb               # 80
    h100.intra_node_GBps         # 450: NVLink, per direction, per GPU

The figures are the vendors' datasheet numbers for the SXM parts (dense tensor
cores for bf16, plain CUDA cores for fp32), rounded; real runs reach a fraction
of them, which is exactly what MFU measures. Bandwidths are one direction per
GPU, in GB/s (10^9 bytes), the figure nccl-tests' bus bandwidth approaches:
``intra_node_GBps`` between GPUs of one server (NVLink; PCIe for the L4),
``inter_node_GBps`` the network card each GPU has to other servers.

``cpu`` is one CPU process of this course (a "virtual GPU"): one core with AVX2,
shared memory between processes, 10 Gb Ethernet between machines. Its numbers
are rough orders of magnitude, not a measurement of this machine.

Your own GPUs: a JSON file ``{"name": {field: value, ...}, ...}`` with the
fields of :class:`GPUSpec` (FLOP/s and GB/s as plain numbers). Name it in the
environment variable ``GPUCOURSE_GPUS`` or pass its path as ``path=``. An entry
whose name is already in the table only needs the fields it changes
(``{"h100": {"memory_gb": 94}}`` for the H100 NVL).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from ..readable import ConfigError
from ..values import Name

ENV_VAR = "GPUCOURSE_GPUS"


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peak compute (FLOP/s), memory (GB and GB/s) and links (GB/s one direction, latency µs).

    ``achievable`` is the share of the peak that a transformer's training step reaches on large
    matrices (what :mod:`gpucourse.modeled.cluster` times a replayed span with); ``bus_efficiency`` the share of a
    link's bandwidth that NCCL's ring reaches (nccl-tests' bus bandwidth over the link's).

    The planner times kernels by their shape (:meth:`gpucourse.modeled.cluster.Cluster.kernel_s`) with: ``sm_count``
    (streaming multiprocessors), ``gemm_efficiency`` (the share of the peak the best large bf16 GEMM reaches),
    ``attention_efficiency`` and ``attention_bwd_efficiency`` (FlashAttention's forward and backward, long
    sequences), ``flash2_share`` (FlashAttention-2 against that kernel), ``hbm_efficiency`` (the share of the memory
    bandwidth a streaming kernel reaches) — measurements, cited in the table below — and two numbers fitted on the
    fitting set of :mod:`gpucourse.modeled.published` and nothing else: ``sustained`` (the clock a GPU holds through a
    whole training step, against the benchmarks' short bursts) and ``gemm_overhead_k`` (a GEMM tile's fixed cost,
    as that much more of its K).
    """

    name: str
    peak_bf16_flops: float
    peak_fp32_flops: float
    memory_gb: float
    intra_node_GBps: float
    inter_node_GBps: float
    note: str = ""
    peak_fp8_flops: float = 0.0
    hbm_GBps: float = 0.0
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    achievable: float = 0.5
    bus_efficiency: float = 0.8
    sm_count: int = 100
    gemm_efficiency: float = 0.8
    attention_efficiency: float = 0.6
    attention_bwd_efficiency: float = 0.45
    hbm_efficiency: float = 0.85
    gemm_overhead_k: float = 256
    sustained: float = 1.0
    flash2_share: float = 1.0
    nvls_efficiency: float = 0.0
    gemm_fp8_efficiency: float = 0.0  # the best large fp8 GEMM over the fp8 peak (0: as gemm_efficiency)
    gemm_fp8_overhead: float = 1.0  # an fp8 tile's fixed cost over a bf16 tile's, both as more K (1: the same)
    pcie_GBps: float = 32.0  # the GPU's PCIe link to the host, one direction (Gen4 x16; Gen5 x16 64)
    host_GBps: float = 50.0  # the server's CPU memory bandwidth over its GPUs (what CPU offload works with)
    compute_capability: float = 0.0  # CUDA's compute capability as a number, 8.9 for sm_89 (0: not known)

    def usable_bytes(self) -> float:
        """The memory a training run may fill: the card's ``memory_gb`` counted as GiB, as its HBM stacks are and
        nvidia-smi shows them (an "80 GB" H100 reports 81559 MiB, 79.6 GiB), less ``RESERVED_BYTES`` for what is
        not the run's tensors."""
        return self.memory_gb * 2**30 - RESERVED_BYTES

    def multiplies_fp8(self) -> bool:
        """Whether the tensor cores multiply FP8: from compute capability 8.9 (Ada; then Hopper's 9.0, Blackwell's
        10.0), not on Ampere's 8.0. A GPU whose capability is not known: whether it has an fp8 peak."""
        if self.compute_capability:
            return self.compute_capability >= 8.9
        return bool(self.peak_fp8_flops)

    def fp8_any_layout(self) -> bool:
        """Whether the fp8 GEMMs read a matrix in either layout, so that Transformer Engine keeps no transposed fp8
        copy of a weight for backward: compute capability 10.x and from 13 on (TransformerEngine v2.3 to v2.9,
        transformer_engine/pytorch/utils.py, is_non_tn_fp8_gemm_supported; v2.0 to v2.2 from 10 on, named
        non_tn_fp8_gemm_supported). Hopper and Ada (9.0, 8.9) take only the "TN" layout: a weight's fp8 copy is
        kept with its transpose. A GPU whose capability is not known: TN only."""
        cc = self.compute_capability
        return 10 <= cc < 12 or cc >= 13

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak FLOP/s for a run in ``precision``: fp32 uses the fp32 figure, fp8 the fp8 one, else bf16's."""
        if precision in ("fp32", "float32"):
            return self.peak_fp32_flops
        if precision == "fp8" and self.peak_fp8_flops:
            return self.peak_fp8_flops
        return self.peak_bf16_flops


T = 1e12
# What a run cannot have of its GPU's memory, an allowance rather than a measurement: what the driver keeps (an
# "80 GB" H100 shows 79.6 of its 80 GiB), the CUDA context (several hundred MiB), cuBLAS's workspaces, NCCL's
# buffers for each communicator and the caching allocator's fragmentation.
RESERVED_BYTES = 2 * 2**30

# The built-in table; :func:`gpus` adds the user's file on top. Sources, dense figures (the datasheets print
# tensor-core FLOP/s "with sparsity", twice the dense ones):
# - A100 SXM 80 GB: NVIDIA A100 datasheet: BF16 312 T, FP32 19.5 T, HBM2e 2,039 GB/s, NVLink 3 600 GB/s
#   (both directions); DGX A100: one 200 Gb/s HDR InfiniBand port per GPU.
# - H100 SXM: NVIDIA H100 datasheet: BF16 1,979 T and FP8 3,958 T with sparsity, FP32 67 T, HBM3 3.35 TB/s,
#   NVLink 4 900 GB/s; DGX H100: one 400 Gb/s NDR port per GPU.
# - H200 SXM: NVIDIA H200 datasheet: H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
# - B200 (HGX B200): NVIDIA HGX platform specifications: per GPU BF16 4.5 P and FP8 9 P with sparsity,
#   FP32 75 T, 180 GB HBM3e at 7.7 TB/s, NVLink 5 1.8 TB/s; DGX B200: 400 Gb/s per GPU.
# - L4: NVIDIA L4 datasheet: BF16 242 T and FP8 485 T with sparsity (Ada's fourth-generation tensor cores have
#   FP8), 24 GB GDDR6 300 GB/s, PCIe Gen4 x16 (32 GB/s).
# - compute_capability: NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus): A100 8.0, L4 8.9, H100 and H200
#   9.0, B200 10.0. FP8 tensor cores come with 8.9 (the CUDA programming guide's FP8 MMA, sm_89 and later): the
#   A100 has none, so its table gives no fp8 peak.
# Latencies are orders of magnitude for one NCCL step: a few µs over NVLink, about 10 µs across
# InfiniBand. ``achievable`` and ``bus_efficiency``: see docs/modeled-timing.md for what they were
# fitted on and how the model compares with published runs.
# Kernels (measurements):
# - SMs: A100 108, H100 and H200 132, B200 148, L4 58 (the datasheets / CUDA programming guide).
# - gemm_efficiency, the best large bf16 GEMM over the dense peak ("maximum achievable matmul FLOPS", Bekman,
#   ml-engineering, compute/accelerator/README.md): A100 SXM 271.2 of 312 (0.87), H100 SXM 794.5 of 989 (0.80,
#   "H200 is the same"), B200 1745 of 2250 (0.78); gemm_fp8_efficiency, the same for e4m3 over the fp8 peak: H100
#   1402.6 of 1979 (0.71), H200 1453.4 (0.73), B200 3432.5 of 4500 (0.76).
# - attention: FlashAttention-2 on A100, forward and backward, causal, long sequences: 0.55-0.61 of the peak
#   (Dao 2023, its repository's benchmark figures); FlashAttention-3 on H100, forward 616-648 TFLOP/s (0.62-0.66),
#   backward 1.5-1.75× FlashAttention-2's (about 0.5) (Shah et al. 2024); FlashAttention-2 on H100: 328-338
#   TFLOP/s (0.34 of the peak, 0.55 of FlashAttention-3's forward): flash2_share.
# - GEMMs by size on B200, bf16 and fp8: XLA's default matmul performance table for sm_100
#   (xla/backends/gpu/cost_model/matmul_interpolator_data.h, OpenXLA 2025; b = 1, m = n = 4096), TFLOP/s at k = 512,
#   1024, 2048, 4096: bf16 805, 1076, 1278, 1417; e4m3 1172, 1895, 2485, 2765. bf16 falls from k = 4096 as a tile
#   costing k + 494 (484-500 from each k) would: gemm_overhead_k 500, measured, not fitted. e4m3's fall is steeper,
#   520-987 (mean 749): gemm_fp8_overhead 1.5. With sustained 1 (a benchmark's burst) the model gives the table's
#   eleven shapes with k, n of 512 to 4096 within 9 % in bf16 (median +0.6 %) and 16 % in fp8 (median -1.4 %).
#   FP8's speed-up over bf16 thus grows with the GEMM: 1.46 at k = 512, 1.76 at 1024, 1.95 at 4096 (the table).
#   The H100 and H200 keep gemm_fp8_overhead 1: XLA's sm_90 table has no fp8 entries.
# - attention on B200 (cuDNN's fused attention through Transformer Engine, what NeMo runs): FlashAttention-4 reaches
#   1605 TFLOP/s forward in BF16 (0.71 of 2250), "up to 1.3× faster than cuDNN version 9.13" (Zadouri, Shah, Dao et
#   al., FlashAttention-4, together.ai/blog/flashattention-4 and arXiv:2603.05451, 2026): cuDNN's forward 1235
#   (0.55). No backward figure is printed; B200 takes the H100's backward over forward (0.5 / 0.62): 0.44. Its
#   tensor cores doubled from Hopper while the exponential units and shared memory did not (the same post), so
#   attention reaches less of the peak than the H100's FlashAttention-3.
# - H200: the H100's compute die (its datasheet), so its GEMM and attention shares are the H100's, with its own
#   memory (141 GB at 4.8 TB/s) and its own e4m3 GEMM figure (Bekman, above); no published training run on H200 is
#   in the table, so its fitted constants are the H100's.
# - hbm_efficiency: A100 1.80 of 2.04 TB/s in a streaming copy (0.88, NVIDIA developer forum); H100 about 0.85.
# - nvls_efficiency, NVLS all-reduce's algorithm bandwidth over one GPU's NVLink (Bekman, ml-engineering,
#   network/README.md, nccl-tests on 8 × H200, 16 GiB: NVLS 480 GB/s bus bandwidth, 274 GB/s algorithm bandwidth,
#   0.61 of 450; on 8 × B200 838 GB/s, 479 of 900, 0.53). The H200's NVLink and NVSwitch are the H100's, so the
#   H100 takes its figure; A100 has no NVLS (NCCL's nvlsEfficiency is 0 for Ampere).
# Host links (CPU offload, gpucourse.modeled.offload): pcie_GBps, one direction of the datasheets' PCIe figure (H100, H200
# and HGX B200 SXM "PCIe Gen5: 128 GB/s", A100 SXM "PCIe Gen4: 64 GB/s", L4 "PCIe Gen4 x16 64 GB/s"); host_GBps, the
# DGX server's CPU memory bandwidth shared by its 8 GPUs: DGX A100, 2 × AMD EPYC 7742 with 8 channels of DDR4-3200
# (2 × 204.8 GB/s); DGX H100 and H200, 2 × Xeon Platinum 8480C with 8 channels of DDR5-4800 (2 × 307.2 GB/s); DGX
# B200, 2 × Xeon Platinum 8570 with 8 channels of DDR5-5600 (2 × 358.4 GB/s). The L4 keeps the defaults.
# Fitted on the fitting set of gpucourse.modeled.published (published.fit, tests/test_published.py): sustained and
# gemm_overhead_k, A100 0.80 and 128, H100 0.85 and 1024; B200's sustained alone, 0.6, on its five fitting rows of
# NVIDIA's FP8 tables (its gemm_overhead_k is measured, above); the H200, with none, takes the H100's. B200's low
# sustained share also holds what the model leaves out of an FP8 step (the casts to fp8 before each matmul, the
# first and last layers in BF16); no B200 BF16 run checks it. The
# H100's 1024 agrees with measured GEMM tables: a 2048³ GEMM at 0.82 of a 4096³ one (XLA's
# default_matmul_perf_table for sm_90: 641 against 780 TFLOP/s), k/(k + 1024) giving 0.83.
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("h100", 989 * T, 67 * T, 80, 450, 50, "H100 SXM: NVLink 4 (900 GB/s both ways), 400 Gb/s NIC per GPU",
            peak_fp8_flops=1979 * T, hbm_GBps=3350, achievable=0.4, bus_efficiency=0.8, sm_count=132,
            gemm_efficiency=0.8, attention_efficiency=0.62, attention_bwd_efficiency=0.5, flash2_share=0.55,
            sustained=0.85, gemm_overhead_k=1024, nvls_efficiency=0.61, gemm_fp8_efficiency=0.71,
            pcie_GBps=64, host_GBps=76.8, compute_capability=9.0),
    GPUSpec("h200", 989 * T, 67 * T, 141, 450, 50, "H200 SXM: H100's compute with more, faster memory",
            peak_fp8_flops=1979 * T, hbm_GBps=4800, achievable=0.4, bus_efficiency=0.8, sm_count=132,
            gemm_efficiency=0.8, attention_efficiency=0.62, attention_bwd_efficiency=0.5, flash2_share=0.55,
            sustained=0.85, gemm_overhead_k=1024, nvls_efficiency=0.61, gemm_fp8_efficiency=0.73,
            pcie_GBps=64, host_GBps=76.8, compute_capability=9.0),
    GPUSpec("b200", 2250 * T, 75 * T, 180, 900, 50, "B200 (HGX): NVLink 5 (1.8 TB/s both ways), 400 Gb/s NIC per GPU",
            peak_fp8_flops=4500 * T, hbm_GBps=7700, achievable=0.4, bus_efficiency=0.8, sm_count=148,
            gemm_efficiency=0.78, attention_efficiency=0.55, attention_bwd_efficiency=0.44, flash2_share=0.55,
            sustained=0.6, gemm_overhead_k=500, gemm_fp8_overhead=1.5, nvls_efficiency=0.53, gemm_fp8_efficiency=0.76,
            pcie_GBps=64, host_GBps=89.6, compute_capability=10.0),
    GPUSpec("a100", 312 * T, 19.5 * T, 80, 300, 25, "A100 SXM 80 GB: NVLink 3 (600 GB/s both ways), 200 Gb/s NIC",
            hbm_GBps=2039, achievable=0.55, bus_efficiency=0.8, sm_count=108, gemm_efficiency=0.87,
            attention_efficiency=0.62, attention_bwd_efficiency=0.55, hbm_efficiency=0.88, sustained=0.8,
            gemm_overhead_k=128, pcie_GBps=32, host_GBps=51.2, compute_capability=8.0),
    GPUSpec("l4", 121 * T, 30.3 * T, 24, 32, 12.5, "L4: no NVLink, PCIe 4.0 x16; 100 Gb/s Ethernet",
            peak_fp8_flops=242.5 * T,
            hbm_GBps=300, intra_node_latency_us=10, inter_node_latency_us=20, achievable=0.5, bus_efficiency=0.8,
            sm_count=58, compute_capability=8.9),
    GPUSpec("cpu", 0.1 * T, 0.1 * T, 16, 10, 1.25, "one CPU core as a 'virtual GPU': rough orders of magnitude",
            hbm_GBps=20, intra_node_latency_us=20, inter_node_latency_us=50, achievable=0.3, bus_efficiency=0.5,
            sm_count=1, gemm_efficiency=0.3, attention_efficiency=0.2, attention_bwd_efficiency=0.2,
            pcie_GBps=0, host_GBps=0),
)}

_FIELDS = {f.name: f for f in dataclasses.fields(GPUSpec)}


def _from_json(name: str, entry, base: GPUSpec | None, source: str) -> GPUSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{source}: the entry {name!r} must be an object of fields, not {type(entry).__name__}.")
    unknown = sorted(set(entry) - set(_FIELDS) - {"name"})
    if unknown:
        raise ValueError(f"{source}: {name!r} has unknown field{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                         f"the fields are {', '.join(f for f in _FIELDS if f != 'name')}.")
    values = dataclasses.asdict(base) if base else {}
    values.update(entry, name=name)
    missing = [f for f, spec in _FIELDS.items()
               if f not in values and spec.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{source}: the new GPU {name!r} needs {', '.join(missing)}.")
    for field_name, value in values.items():
        if field_name not in ("name", "note") and not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"{source}: {name}.{field_name}={value!r} must be a number of at least 0.")
    return GPUSpec(**values)


def gpus(path: str | os.PathLike | None = None) -> dict[str, GPUSpec]:
    """The table: built-in GPUs, then those of ``$GPUCOURSE_GPUS``, then those of ``path`` (later ones win)."""
    table = dict(GPUS)
    for source in (os.environ.get(ENV_VAR), path):
        if not source:
            continue
        source = os.fspath(source)
        try:
            with open(source) as f:
                entries = json.load(f)
        except OSError as e:
            raise ValueError(f"cannot read the GPU table {source}: {e.strerror}.") from None
        except ValueError as e:
            raise ValueError(f"the GPU table {source} is not valid JSON: {e}.") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{source} must hold one JSON object mapping GPU names to their fields.")
        for name, entry in entries.items():
            key = name.lower()
            table[key] = _from_json(key, entry, table.get(key), source)
    return table


class UnknownGPU(ConfigError, KeyError):
    """A GPU name the table does not hold (a KeyError too, for callers that look it up as in a dict)."""

    __str__ = BaseException.__str__  # the sentence, not KeyError's quoted repr of it


def gpu_names(path: str | os.PathLike | None = None) -> Name:
    """The kind of value a GPU name is (:mod:`gpucourse.values`): one of the table's, in any case."""
    return Name(lambda: gpus(path), fold=str.lower,
                unknown=f"is not in the GPU table; known: {{names}}{{near}}; add your own in a JSON file named by "
                        f"${ENV_VAR}")


GPU = gpu_names()


def get_gpu(name: str, path: str | os.PathLike | None = None, flag: str = "gpu") -> GPUSpec:
    """The GPU called ``name`` (any case), from :func:`gpus`; :class:`UnknownGPU` in one sentence lists the names
    known (``flag``: how the refusal names what was given)."""
    try:
        gpu_names(path).check(name, flag)
    except ConfigError as e:
        raise UnknownGPU(str(e)) from None
    return gpus(path)[name.lower()]
