"""A small table of accelerators: how fast they compute, how much they hold, how fast they talk.

Profiling (MFU: model FLOP/s over the peak) and planning (does a layout fit,
how long does its communication take) need the same few numbers per GPU::

    from gpucourse.gpus import get_gpu
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

ENV_VAR = "GPUCOURSE_GPUS"


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator's peak compute (FLOP/s), memory (GB) and link bandwidths (GB/s, one direction)."""

    name: str
    peak_bf16_flops: float
    peak_fp32_flops: float
    memory_gb: float
    intra_node_GBps: float
    inter_node_GBps: float
    note: str = ""

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak FLOP/s for a run in ``precision``: fp32 uses the fp32 figure, anything lower the bf16 one."""
        return self.peak_fp32_flops if precision in ("fp32", "float32") else self.peak_bf16_flops


T = 1e12

# The built-in table; :func:`gpus` adds the user's file on top.
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("h100", 989 * T, 67 * T, 80, 450, 50, "H100 SXM: NVLink 4 (900 GB/s both ways), 400 Gb/s NIC per GPU"),
    GPUSpec("h200", 989 * T, 67 * T, 141, 450, 50, "H200 SXM: H100's compute with more, faster memory"),
    GPUSpec("a100", 312 * T, 19.5 * T, 80, 300, 25, "A100 SXM 80 GB: NVLink 3 (600 GB/s both ways), 200 Gb/s NIC"),
    GPUSpec("l4", 121 * T, 30.3 * T, 24, 32, 12.5, "L4: no NVLink, PCIe 4.0 x16; 100 Gb/s Ethernet"),
    GPUSpec("cpu", 0.1 * T, 0.1 * T, 16, 10, 1.25, "one CPU core as a 'virtual GPU': rough orders of magnitude"),
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


def get_gpu(name: str, path: str | os.PathLike | None = None) -> GPUSpec:
    """The GPU called ``name`` (any case), from :func:`gpus`; a KeyError lists the names known."""
    table = gpus(path)
    try:
        return table[name.lower()]
    except KeyError:
        raise KeyError(f"no GPU called {name!r}; known: {', '.join(table)} "
                       f"(add your own in a JSON file named by ${ENV_VAR}).") from None
