"""CPU offload of the optimizer (ZeRO-Offload): GPU memory given back, paid for in PCIe transfers and CPU time.

Adam's state is the largest thing a mixed-precision run keeps: fp32 master weights and two fp32 moments, 12 bytes
a parameter, against 2 for the bf16 weights and 2 for their gradients. ZeRO-Offload (Ren et al., 2021) keeps that
state in the server's CPU memory, which is ten to twenty times larger, and runs the optimizer step on the CPU:

1. backward streams each bucket of gradients to the host as it is ready (device → host over PCIe, beside the rest
   of backward: only what outlasts backward is exposed);
2. the CPU steps Adam on its share — memory-bound, it reads the gradient, reads and writes the fp32 weight and
   both moments, and writes a bf16 copy: ``24 + 2 + 2 = 28`` bytes a parameter through host memory;
3. the updated bf16 weights go back (host → device), and the next forward waits for them.

With ZeRO-2 each data-parallel rank offloads only its 1/dp share, so the transfers and the CPU's work shrink as
dp grows — which is why offload and sharding go together (DeepSpeed's ``offload_optimizer`` with stage 2 or 3;
Megatron-Core's ``--optimizer-cpu-offload`` with its distributed optimizer; FSDP2's ``CPUOffloadPolicy`` keeps the
parameters on the host too). ZeRO-Offload's "delayed parameter update" goes further: it overlaps steps 2–3 with
the next step's forward and backward, at the price of weights one step stale.

The model here times the three steps on a server's links: PCIe at ``PCIE_EFFICIENCY`` of the GPU's link
(``GPUSpec.pcie_GBps``, one direction) and the CPU at ``HOST_EFFICIENCY`` of the host memory bandwidth that falls
to each GPU (``GPUSpec.host_GBps``). Both efficiencies are assumptions, not fits: measure your own server's
(CUDA's bandwidthTest for PCIe; a CPU Adam step for the host, as notebook 07 does on this machine).
"""

from __future__ import annotations

PCIE_EFFICIENCY = 0.8   # assumed: pinned copies reach about 80 % of a PCIe link's nominal rate
HOST_EFFICIENCY = 0.5   # assumed: a CPU Adam step reaches about half of the sockets' peak memory bandwidth


def host_adam_bytes(grad_bytes: int, half_weights: bool) -> int:
    """Bytes of host memory traffic per parameter in one CPU Adam step: the gradient read, the fp32 weight and two
    moments read and written, and (mixed precision) the half-precision copy written for the GPU."""
    return grad_bytes + 2 * 3 * 4 + (2 if half_weights else 0)


def offload_memory(per_gpu: dict, master_weights: bool) -> tuple[dict, float]:
    """``(what stays on the GPU, bytes on the host)`` for a rank's ``{category: bytes}``: the optimizer's state
    (two fp32 moments, 8 bytes a parameter, and 4 more for fp32 master weights where there are some) moves to the
    host, beside an fp32 copy of the rank's share of the gradients that the CPU steps with (4 bytes a parameter)."""
    params = per_gpu["optimizer"] / (12 if master_weights else 8)
    return {**per_gpu, "optimizer": 0}, per_gpu["optimizer"] + 4 * params


def offload_time(params: float, gpu, precision: str, window_s: float = 0.0) -> dict:
    """Seconds one step spends offloading the optimizer of the ``params`` parameters a GPU steps (its share).

    ``window_s``: the backward time the gradients' copy to the host can hide behind. Returns each step's
    seconds and ``exposed_s``, what the step waits for (the copy's excess over the window, the CPU's step and the
    weights' way back)."""
    if not gpu.pcie_GBps or not gpu.host_GBps:
        raise ValueError(f"{gpu.name} has no host link in the table (pcie_GBps, host_GBps): nothing to offload to.")
    half = precision != "fp32"
    elem = 2 if half else 4
    copy = params * elem / (gpu.pcie_GBps * 1e9 * PCIE_EFFICIENCY)  # the gradients down, the weights up: as many bytes
    cpu = params * host_adam_bytes(elem, half) / (gpu.host_GBps * 1e9 * HOST_EFFICIENCY)
    return {"to_host_s": copy, "cpu_adam_s": cpu, "to_gpu_s": copy,
            "exposed_s": max(0.0, copy - window_s) + cpu + copy}
