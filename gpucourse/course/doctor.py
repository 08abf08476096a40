"""What this machine offers for distributed training, and what that means.

`collect()` gathers the facts a run depends on: Python and torch versions,
which GPUs this process can see, which torch.distributed backends are built
in (NCCL for GPUs, gloo for CPUs), the course's other packages, and the
environment variables that change how collectives report trouble.
`format_text()` turns those facts into a short report with advice.

Looking must not change what it looks at. A notebook kernel that initialised
CUDA can no longer fork ranks that use the GPU, so this module never creates
a CUDA context:

* the GPUs are described by `gpucourse.runtime.devices.visible()`: NVML (the
  driver's management library) or `nvidia-smi`, which honour
  CUDA_VISIBLE_DEVICES, and torch only in a child process;
  `torch.cuda.is_available()` is avoided because it initialises the CUDA driver.
  Each GPU's name, compute capability, memory, native bf16 and fp8, MIG slice,
  and the links and P2P between them are reported, with what follows for the
  course (`gpucourse.platforms`): ranks, precision, NCCL settings, models that fit.

Only torch is imported; the other packages are looked up by their installed
version, so the doctor also works on a bare GPU node.
"""

import multiprocessing
import os
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

from .. import platforms
from ..runtime import devices

PACKAGES = ("jupyterlab", "ipywidgets", "plotly", "accelerate", "nbclient")
ENV_VARS = (
    "NCCL_DEBUG",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_VISIBLE_DEVICES",
)
# Shown only when set: each changes how NCCL or CUDA behaves, and a forgotten one explains a slow or odd run.
ENV_VARS_WHEN_SET = (
    "NCCL_DEBUG_SUBSYS",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_P2P_DISABLE",
    "NCCL_IB_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "CUDA_LAUNCH_BLOCKING",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)

# NCCL's default timeout, kProcessGroupNCCLDefaultTimeout in c10d's ProcessGroupNCCL.hpp: what a torch built
# without NCCL (a CPU build, constants.default_pg_nccl_timeout None) cannot report itself.
NCCL_DEFAULT_TIMEOUT_MIN = 10


def default_timeout_minutes() -> dict[str, int]:
    """init_process_group's timeout when none is given, in minutes, by backend: NCCL's
    (``torch.distributed.constants.default_pg_nccl_timeout``) and gloo's, every other backend's too
    (``default_pg_timeout``)."""
    from torch.distributed import constants

    nccl = constants.default_pg_nccl_timeout
    return {"nccl": round(nccl.total_seconds() / 60) if nccl is not None else NCCL_DEFAULT_TIMEOUT_MIN,
            "gloo": round(constants.default_pg_timeout.total_seconds() / 60)}


_TIMEOUT_MIN = default_timeout_minutes()

# Always worth knowing when a run hangs or fails; one sentence each.
TROUBLESHOOTING = (
    "NCCL_DEBUG=INFO makes NCCL print its version, the transport it picked "
    "(NVLink, PCIe, InfiniBand, sockets) and its rings at start-up, which shows "
    "why ranks hang at their first collective or move data slower than expected.",
    "TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch.distributed check that every "
    "rank calls the same collective with the same shapes, so a mismatch fails "
    "with a message naming it instead of hanging.",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING (3 by default in PyTorch 2.x; torchrun sets 1 "
    "when it is unset) makes a rank whose NCCL collective fails or times out tear "
    "its process down (1 also aborts the communicator first), so the launcher sees "
    "the failure and stops the whole group instead of leaving it stuck; 0 turns it off.",
    f"The timeout= of init_process_group (unless set, {_TIMEOUT_MIN['nccl']} minutes on NCCL and "
    f"{_TIMEOUT_MIN['gloo']} on gloo) bounds how long "
    "a collective waits for the other ranks, turning a dead or diverging rank "
    "into an error instead of a silent hang.",
)


def collect() -> dict:
    """Gather the facts about this machine as a plain, JSON-ready dict.

    Keys: python, platform, torch_version, cuda_available, cuda_version
    (the CUDA torch was built for, None on a CPU build), gpu_count, gpus
    (one {index, name, memory_gb, capability, bf16, fp8, mig} per GPU this
    process can use; index is the `cuda:N` number), devices (the whole
    description: links, P2P, MIG, where it came from), driver_version,
    nccl_available, gloo_available, mpi_available, default_device, cpu_count,
    start_method, versions (of the course's packages, None when missing), env
    (the debug variables, None when unset) and advice (plain sentences).
    """
    found = devices.visible(refresh=True)
    smi_rows = devices.nvidia_smi_rows()
    gpus = [
        {
            "index": index,
            "name": gpu.name,
            "memory_gb": round(gpu.memory_bytes / 2**30, 1) if gpu.memory_bytes else None,
            "capability": f"{gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else None,
            "bf16": gpu.bf16,
            "fp8": gpu.fp8,
            "mig": gpu.mig,
        }
        for index, gpu in enumerate(found.gpus)
    ]
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "cuda_available": bool(gpus),
        "cuda_version": torch.version.cuda,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "devices": found.to_dict(),
        "driver_version": smi_rows[0]["driver_version"] if smi_rows else None,
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "mpi_available": dist.is_available() and dist.is_mpi_available(),
        "default_device": "cuda" if gpus else "cpu",
        "cpu_count": _cpu_count(),
        # The first listed method is the default; asking get_start_method()
        # without allow_none would fix it for the whole process.
        "start_method": multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0],
        "versions": {name: _version(name) for name in PACKAGES},
        "env": {**{name: os.environ.get(name) for name in ENV_VARS},
                **{name: os.environ[name] for name in ENV_VARS_WHEN_SET if name in os.environ}},
    }
    info["advice"] = _advice(info, found, machine_gpus=len(smi_rows))
    return info


def format_text(info: dict) -> str:
    """Render `collect()`'s dict as an aligned report followed by the advice."""
    backends = ", ".join(
        f"{name} {'yes' if info[f'{name}_available'] else 'no'}"
        for name in ("nccl", "gloo", "mpi")
    )
    build = f"built for CUDA {info['cuda_version']}" if info["cuda_version"] else "CPU-only build"
    backend = "nccl" if info["default_device"] == "cuda" and info["nccl_available"] else "gloo"
    rows = [
        ("python", f"{info['python']} ({sys.executable})"),
        ("platform", info["platform"]),
        ("torch", f"{info['torch_version']} ({build})"),
        ("default device", f"{info['default_device']} ({backend})"),
        ("GPUs", str(info["gpu_count"])),
    ]
    found = devices.from_dict(info["devices"])
    rows += [(f"  cuda:{index}", gpu.describe()) for index, gpu in enumerate(found.gpus)]
    if found.links():
        rows.append(("links", found.links()))
    if found.mig:
        rows.append(("MIG", "on: a process sees one slice, so one CUDA rank"))
    if found.gpus:
        rows.append(("described by", found.source))
    if info["driver_version"]:
        rows.append(("NVIDIA driver", info["driver_version"]))
    rows += [
        ("backends", backends),
        ("CPU cores", str(info["cpu_count"])),
        ("start method", info["start_method"]),
    ]
    rows += [(name, version or "not installed") for name, version in info["versions"].items()]
    rows += [(name, value if value is not None else "(unset)") for name, value in info["env"].items()]

    width = max(len(label) for label, _ in rows)
    lines = ["gpucourse doctor", ""]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    lines += ["", "Advice"]
    lines += [f"  - {sentence}" for sentence in info["advice"]]
    return "\n".join(lines)


def _advice(info: dict, found: devices.DeviceSet, machine_gpus: int) -> list[str]:
    """Plain sentences on what the facts mean for a run."""
    advice = []
    cores = info["cpu_count"]
    if not found.gpus:
        advice.append(
            "No GPU is visible: runs use gloo on CPU processes ('virtual GPUs'); "
            f"4 ranks on {cores} core{'s' if cores != 1 else ''} work, only slower."
        )
        if machine_gpus and info["cuda_version"] is None:
            advice.append(
                f"nvidia-smi lists {machine_gpus} GPU(s) but this torch "
                f"({info['torch_version']}) is a CPU-only build: install a CUDA "
                "build of torch to use them."
            )
    advice += platforms.course_advice(found, nccl=info["nccl_available"])
    visible_devices = info["env"]["CUDA_VISIBLE_DEVICES"]
    if visible_devices is not None:
        advice.append(
            f"CUDA_VISIBLE_DEVICES={visible_devices!r} limits this process and its "
            "ranks to those GPUs; unset it to use them all."
        )
    advice.extend(TROUBLESHOOTING)
    return advice


def _cpu_count() -> int:
    """Cores this process may run on (a container or SLURM job may get fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _version(package: str) -> str | None:
    """Installed version of `package`, without importing it; None when missing."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
