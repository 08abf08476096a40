"""The GPUs this process can see, described without starting CUDA, and what a run does with them.

A :class:`DeviceSet` holds what a launch needs to know: for each visible GPU (a :class:`GPU`) its name, compute
capability, memory, whether it computes bf16 natively (compute capability 8.0 and up: Ampere, Ada, Hopper) and fp8
(8.9 and up: Ada, Hopper), and whether it is a MIG slice of a bigger GPU; for the set, how its GPUs are linked
(NVLink or PCIe) and whether they can reach each other's memory directly (P2P).

:func:`visible` builds it without creating a CUDA context in this process, since a notebook kernel that did could
no longer fork ranks that use the GPU. It asks, in turn:

1. NVML, the driver's management library, through ``pynvml`` (package nvidia-ml-py) when it is installed;
2. ``nvidia-smi`` (a separate process): ``--query-gpu`` for the GPUs, ``-L`` for MIG slices, ``topo -p2p r`` and
   ``topo -p2p n`` for P2P and NVLink between every pair;
3. torch in a child process (``torch.cuda.get_device_properties``, and
   ``torch.cuda.is_bf16_supported(including_emulation=False)`` for native bf16), which initialises CUDA there, not
   here.

The decisions are plain functions of a description — :meth:`DeviceSet.shortfall` (why some ranks cannot each have a
GPU), :func:`mixed_precision`, :func:`nccl_settings` — so each platform's behaviour is tested from its description
alone. :data:`PLATFORMS` describes the machines learners have (Colab's T4, Kaggle's two, a desktop RTX card, a MIG
seat, cloud L4, A10, A100 and H100 servers). Setting ``GPUCOURSE_FAKE_GPUS`` to one of their names, or to a JSON file
holding a description (the form of :meth:`DeviceSet.to_dict`), makes :func:`visible` return that instead of what
the machine has: the launcher, ``gpucourse doctor`` and the tests then behave as on that machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from itertools import groupby

import torch

from ..readable import ConfigError

FAKE_ENV = "GPUCOURSE_FAKE_GPUS"
BF16_CC = (8, 0)  # bf16 tensor cores: Ampere and later
FP8_CC = (8, 9)   # fp8 tensor cores: Ada and Hopper
MiB, GiB = 2**20, 2**30


class DescriptionError(ConfigError):
    """A GPU description that cannot be read; the message is one sentence saying why."""


@dataclass(frozen=True)
class GPU:
    """One visible GPU, or one MIG slice of a GPU (``mig`` is then its profile, e.g. ``"1g.10gb"``).

    ``bf16`` and ``fp8`` say whether its tensor cores compute those formats natively; left out, they follow from the
    compute capability (bf16 from 8.0, fp8 from 8.9). Unknown facts are None.
    """

    name: str
    capability: tuple[int, int] | None
    memory_bytes: int | None
    mig: str | None = None
    bf16: bool | None = None
    fp8: bool | None = None

    def __post_init__(self):
        cc = self.capability
        if self.bf16 is None:
            object.__setattr__(self, "bf16", cc is not None and cc >= BF16_CC)
        if self.fp8 is None:
            object.__setattr__(self, "fp8", cc is not None and cc >= FP8_CC)

    @property
    def label(self) -> str:
        """``Tesla T4``, or ``MIG 1g.10gb slice of NVIDIA A100-SXM4-80GB``: what it is, in a few words."""
        return f"MIG {self.mig} slice of {self.name}" if self.mig else self.name

    def describe(self) -> str:
        """``Tesla T4 (cc 7.5, 15.0 GiB, no native bf16 or fp8)``: what it is and what it computes natively."""
        what = self.label
        cc = f"cc {self.capability[0]}.{self.capability[1]}" if self.capability else "cc unknown"
        memory = f"{self.memory_bytes / GiB:.1f} GiB" if self.memory_bytes else "memory unknown"
        native = ("native bf16 and fp8" if self.fp8 else "native bf16, no fp8" if self.bf16
                  else "no native bf16 or fp8" if self.capability else "bf16 and fp8 unknown")
        return f"{what} ({cc}, {memory}, {native})"


@dataclass(frozen=True)
class DeviceSet:
    """The GPUs one process can use, and how they reach each other.

    ``link``: the slowest path between any two of them, ``"nvlink"`` or ``"pcie"``; ``p2p``: whether every pair can
    read each other's memory directly. Both None with fewer than two GPUs, or when unknown. ``source`` says where the
    description came from.
    """

    gpus: tuple[GPU, ...] = ()
    link: str | None = None
    p2p: bool | None = None
    source: str = "description"

    @property
    def described(self) -> bool:
        """Whether these GPUs are only described, by ``$GPUCOURSE_FAKE_GPUS``, not found on this machine."""
        return self.source.startswith(FAKE_ENV)

    @property
    def mig(self) -> bool:
        """Whether these are MIG slices (MIG mode is on)."""
        return any(g.mig for g in self.gpus)

    @property
    def cuda_ranks(self) -> int:
        """How many ranks can run on CUDA, one per GPU. One on MIG: a process sees only one MIG slice, NCCL refuses
        two ranks on one GPU ("Duplicate GPU detected") and MIG slices have no P2P between them."""
        return min(len(self.gpus), 1) if self.mig else len(self.gpus)

    @property
    def bf16(self) -> bool:
        """Whether every GPU computes bf16 natively (False without a GPU)."""
        return bool(self.gpus) and all(g.bf16 for g in self.gpus)

    @property
    def smallest(self) -> GPU | None:
        """The GPU with the least memory (None without a GPU, or when no memory is known)."""
        known = [g for g in self.gpus if g.memory_bytes]
        return min(known, key=lambda g: g.memory_bytes) if known else None

    def describe(self) -> str:
        """The GPUs in a few words: ``2 × Tesla T4 (cc 7.5, 15.0 GiB, no native bf16 or fp8) over PCIe, P2P off``."""
        if not self.gpus:
            return "no GPU"
        text = " + ".join(f"{n} × {gpu.describe()}" if n > 1 else gpu.describe()
                          for gpu, n in ((gpu, len(list(same))) for gpu, same in groupby(self.gpus)))
        return f"{text} {self.links()}" if self.links() else text

    def links(self) -> str:
        """``over PCIe, P2P off``: how the GPUs reach each other ("" for fewer than two, or for MIG slices)."""
        if len(self.gpus) < 2 or self.mig:
            return ""
        link = {"nvlink": "over NVLink", "pcie": "over PCIe"}.get(self.link, "links unknown")
        return f"{link}, P2P {({True: 'on', False: 'off'}).get(self.p2p, 'unknown')}"

    def shortfall(self, world_size: int) -> str | None:
        """Why ``world_size`` ranks cannot each have a CUDA device here, as a phrase; None when they can."""
        if self.cuda_ranks >= world_size:
            return None
        if not self.gpus:
            return "no GPU is visible"
        if self.mig:
            return (f"{self.describe()} {'is' if len(self.gpus) == 1 else 'are'} visible, and MIG gives one CUDA "
                    f"rank (NCCL refuses two ranks on one GPU, 'Duplicate GPU detected', and MIG slices have no P2P)")
        n = len(self.gpus)
        return f"only {n} GPU{'s are' if n > 1 else ' is'} visible, {self.describe()}"

    def to_dict(self) -> dict:
        """Plain JSON-ready data; :func:`from_dict` reads it back (``mig`` and ``cuda_ranks`` are derived)."""
        return {"gpus": [{"name": g.name, "capability": f"{g.capability[0]}.{g.capability[1]}" if g.capability
                          else None, "memory_bytes": g.memory_bytes, "mig": g.mig, "bf16": g.bf16, "fp8": g.fp8}
                         for g in self.gpus],
                "link": self.link, "p2p": self.p2p, "mig": self.mig, "cuda_ranks": self.cuda_ranks,
                "source": self.source}


# --- decisions ---------------------------------------------------------------------------------------------------

def _without_bf16(found: DeviceSet) -> str:
    """``Tesla T4 (cc 7.5)``: the first GPU that lacks native bf16, for the sentences that say so."""
    gpu = next(g for g in found.gpus if not g.bf16)
    return f"{gpu.name} ({f'cc {gpu.capability[0]}.{gpu.capability[1]}' if gpu.capability else 'cc unknown'})"


def mixed_precision(found: DeviceSet) -> tuple[str, str]:
    """The half precision for runs on the GPUs ``found``, and why in a few words.

    bf16 where every GPU computes it natively: fp32's range, so no loss scaling. Otherwise fp16, whose tensor cores
    every CUDA GPU of the course has, with the dynamic loss scaler (``parallel/precision.py``) that keeps small
    gradients from underflowing; bf16 there would be emulated, and slower. CPU ranks: bf16, what CPU autocast supports.
    """
    if not found.gpus:
        return "bf16", "CPU ranks: bf16 autocast, no loss scaler needed"
    if found.bf16:
        return "bf16", f"native from cc {BF16_CC[0]}.{BF16_CC[1]}, fp32's range, no loss scaler needed"
    return "fp16", (f"with the dynamic loss scaler: {_without_bf16(found)} has no native bf16 (it needs cc "
                    f"{BF16_CC[0]}.{BF16_CC[1]}), so bf16 would run emulated, slower")


def precision_note(found: DeviceSet, precision: str) -> str | None:
    """A sentence when ``precision`` is not what these GPUs compute natively (bf16 below cc 8.0); else None."""
    if precision != "bf16" or not found.gpus or found.bf16:
        return None
    return (f"precision='bf16' runs emulated, slower, on {_without_bf16(found)}, which has no native bf16 (it "
            f"needs cc {BF16_CC[0]}.{BF16_CC[1]}); precision='fp16' uses its tensor cores, with the dynamic loss "
            f"scaler.")


def nccl_settings(found: DeviceSet) -> tuple[tuple[str, str, str], ...]:
    """Known-good NCCL environment variables for the GPUs ``found``: ``(name, value, why)`` each.

    ``NCCL_P2P_DISABLE=1`` where GPUs cannot reach each other directly: the driver says so, or, when it was not
    asked, they are GeForce cards, on which the driver mostly leaves P2P off. NCCL then moves data through host memory instead of
    trying a P2P path that hangs or fails.
    """
    if len(found.gpus) < 2 or found.mig:
        return ()
    no_p2p = found.p2p is False or (found.p2p is None and any("GeForce" in g.name for g in found.gpus))
    if no_p2p:
        return (("NCCL_P2P_DISABLE", "1", "these GPUs cannot reach each other's memory directly (no P2P), so NCCL "
                                          "copies through host memory"),)
    return ()


# --- descriptions from data ---------------------------------------------------------------------------------------

_GPU_KEYS = {"name", "capability", "memory_bytes", "memory_gib", "mig", "bf16", "fp8"}
_SET_KEYS = {"gpus", "link", "p2p", "mig", "cuda_ranks", "source"}


def _capability(value, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    text = ".".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if not match:
        raise DescriptionError(f"{where}.capability={value!r} must look like \"8.0\" (major.minor).")
    return int(match[1]), int(match[2])


def _gpu_from_dict(entry, where: str) -> GPU:
    if not isinstance(entry, dict):
        raise DescriptionError(f"{where} must be an object with name, capability and memory_bytes.")
    unknown = sorted(set(entry) - _GPU_KEYS)
    if unknown:
        raise DescriptionError(f"{where} has unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                               f"the keys are {', '.join(sorted(_GPU_KEYS))}.")
    if not isinstance(entry.get("name"), str) or not entry["name"]:
        raise DescriptionError(f"{where} needs a name, such as \"Tesla T4\".")
    memory = entry.get("memory_bytes")
    if memory is None and entry.get("memory_gib") is not None:
        memory = entry["memory_gib"] * GiB
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0):
        raise DescriptionError(f"{where}: the memory must be a positive number of bytes (memory_bytes) or GiB "
                               f"(memory_gib), not {memory!r}.")
    for flag in ("bf16", "fp8"):
        if entry.get(flag) is not None and not isinstance(entry[flag], bool):
            raise DescriptionError(f"{where}.{flag}={entry[flag]!r} must be true, false or left out.")
    mig = entry.get("mig")
    if mig is not None and not (isinstance(mig, str) and mig):
        raise DescriptionError(f"{where}.mig={mig!r} must be a MIG profile such as \"1g.10gb\", or left out.")
    return GPU(entry["name"], _capability(entry.get("capability"), where),
               None if memory is None else int(memory), mig, entry.get("bf16"), entry.get("fp8"))


def from_dict(data, source: str = "description") -> DeviceSet:
    """A :class:`DeviceSet` from plain data: ``{"gpus": [{"name", "capability": "7.5", "memory_bytes" (or
    "memory_gib"), "mig"}, ...], "link": "nvlink" | "pcie" | null, "p2p": true | false | null}``."""
    if not isinstance(data, dict):
        raise DescriptionError(f"{source}: a GPU description is an object with a list of gpus, not "
                               f"{type(data).__name__}.")
    unknown = sorted(set(data) - _SET_KEYS)
    if unknown:
        raise DescriptionError(f"{source} has unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                               f"the keys are gpus, link and p2p.")
    gpus = data.get("gpus", [])
    if not isinstance(gpus, list):
        raise DescriptionError(f"{source}: gpus must be a list of GPUs.")
    if data.get("link") not in (None, "nvlink", "pcie"):
        raise DescriptionError(f"{source}: link={data['link']!r} must be \"nvlink\", \"pcie\" or null.")
    if data.get("p2p") not in (None, True, False):
        raise DescriptionError(f"{source}: p2p={data['p2p']!r} must be true, false or null.")
    return DeviceSet(tuple(_gpu_from_dict(g, f"{source}: gpus[{i}]") for i, g in enumerate(gpus)),
                     data.get("link"), data.get("p2p"), data.get("source") or source)


def load(value: str) -> DeviceSet:
    """The description ``value`` names: one of :data:`PLATFORMS`, or a JSON file in :func:`from_dict`'s form."""
    if value in PLATFORMS:
        return replace(PLATFORMS[value].devices, source=f"{FAKE_ENV}={value}")
    try:
        with open(value) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DescriptionError(f"{FAKE_ENV}={value!r} is neither a JSON file nor a platform "
                               f"({', '.join(PLATFORMS)}).") from None
    except OSError as e:
        raise DescriptionError(f"{FAKE_ENV}={value!r} cannot be read: {e.strerror}.") from None
    except ValueError as e:
        raise DescriptionError(f"{FAKE_ENV}={value!r} is not valid JSON: {e}.") from None
    return replace(from_dict(data, f"{FAKE_ENV}={value}"), source=f"{FAKE_ENV}={value}")


# --- descriptions of this machine --------------------------------------------------------------------------------

_cache: dict = {}


def visible(refresh: bool = False) -> DeviceSet:
    """The GPUs this process can use, described without initialising CUDA here (see the module's docstring).

    ``$GPUCOURSE_FAKE_GPUS`` replaces them with a description. A description of the real GPUs is kept for the
    process, per value of CUDA_VISIBLE_DEVICES; ``refresh=True`` asks again.
    """
    fake = os.environ.get(FAKE_ENV)
    if fake:
        return load(fake)
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is not None and chosen.strip().startswith("MIG-"):
        # torch counts MIG slices by starting the CUDA driver, which would poison fork: describe them without it.
        count = None if torch.version.cuda else 0
    else:
        count = torch.cuda.device_count()  # NVML underneath: leaves CUDA alone
    if count == 0:
        return DeviceSet(source="torch.cuda.device_count() = 0")
    key = (chosen, count)
    if refresh or key not in _cache:
        _cache[key] = _describe(chosen, count)
    return _cache[key]


def _describe(chosen: str | None, count: int | None) -> DeviceSet:
    for build in (_from_nvml, _from_nvidia_smi, _from_torch_child):
        found = build(chosen)
        # Outside MIG, a source that finds another number of GPUs than torch counted is not trusted. (On MIG torch
        # counts whole GPUs through NVML, where CUDA sees one slice.)
        if found is not None and found.gpus and (found.mig or count is None or found.cuda_ranks == count):
            return found
    return DeviceSet(tuple(GPU("unknown GPU", None, None) for _ in range(count or 1)),
                     source="no description: NVML, nvidia-smi and a torch child process all failed")


def visible_rows(rows: list[dict], chosen: str | None) -> list[dict]:
    """The rows (dicts with "index" and "uuid") of the GPUs CUDA_VISIBLE_DEVICES=``chosen`` lets CUDA use, in
    CUDA's order. Entries are indices or UUIDs (or their prefixes); like CUDA, stop at the first that names none.
    An index names every MIG slice of that GPU."""
    if chosen is None:
        return rows
    picked = []
    for entry in (e.strip() for e in chosen.split(",")):
        match = [row for row in rows if row["index"] == entry] or \
                [row for row in rows if entry and row["uuid"].startswith(entry)][:1]
        if not entry or not match:
            break
        picked += match
    return picked


def _from_rows(rows: list[dict], link: str | None, p2p: bool | None, source: str) -> DeviceSet:
    gpus = tuple(GPU(r["name"], r["capability"], r["memory_bytes"], r.get("mig"), r.get("bf16")) for r in rows)
    if len(gpus) < 2 or any(g.mig for g in gpus):
        link = p2p = None
    return DeviceSet(gpus, link, p2p, source)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mig_profile(name: str) -> str | None:
    """``"NVIDIA A100-SXM4-80GB MIG 1g.10gb"`` -> ``"1g.10gb"``."""
    match = re.search(r"MIG (\S+)", name)
    return match[1] if match else None


def _from_nvml(chosen: str | None) -> DeviceSet | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no library: NVML's own error classes, or OSError
        return None
    try:
        rows = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            row = {"index": str(i), "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                   "name": _text(pynvml.nvmlDeviceGetName(handle)),
                   "capability": tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                   "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), "handle": handle}
            try:
                mig_on = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:  # not supported before Ampere
                mig_on = False
            if not mig_on:
                rows.append(row)
                continue
            for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
                except pynvml.NVMLError:  # no slice at this index
                    continue
                rows.append({**row, "uuid": _text(pynvml.nvmlDeviceGetUUID(mig)),
                             "mig": _mig_profile(_text(pynvml.nvmlDeviceGetName(mig))),
                             "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(mig).total), "handle": None})
        rows = visible_rows(rows, chosen)
        handles = [r["handle"] for r in rows if r["handle"] is not None]
        pairs = [(a, b) for n, a in enumerate(handles) for b in handles[n + 1:]]

        def every_pair(capability: int) -> bool:
            return all(pynvml.nvmlDeviceGetP2PStatus(a, b, capability) == pynvml.NVML_P2P_STATUS_OK for a, b in pairs)

        # nvmlDeviceGetP2PStatus's capability indices: 0 reads, 2 NVLink (pynvml spells the first as a tuple).
        link = ("nvlink" if every_pair(2) else "pcie") if pairs else None
        p2p = every_pair(0) if pairs else None
        return _from_rows(rows, link, p2p, "NVML")
    except Exception:  # an NVML call this driver lacks: let nvidia-smi answer
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


_SMI_FIELDS = "index,uuid,name,memory.total,driver_version,compute_cap,mig.mode.current"


def nvidia_smi_rows() -> list[dict]:
    """Every GPU ``nvidia-smi`` lists on this machine, in its own order, as dicts: index, uuid, name, memory_bytes,
    driver_version, capability (None when this driver cannot say) and mig_mode (True, False or None).

    Empty when nvidia-smi is missing or fails. A separate process, so asking leaves CUDA in this one untouched.
    """
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return []
    for fields in (_SMI_FIELDS, _SMI_FIELDS.rsplit(",", 2)[0]):  # drivers before compute_cap know the first five
        try:
            result = subprocess.run([executable, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                    capture_output=True, text=True, timeout=20, check=True)
            break
        except (OSError, subprocess.SubprocessError):
            continue
    else:
        return []
    rows = []
    for line in result.stdout.splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != fields.count(",") + 1:
            continue
        index, uuid, name, memory_mib, driver, *rest = values
        cc, mig = (rest + [None, None])[:2]
        rows.append({"index": index, "uuid": uuid, "name": name,
                     "memory_bytes": int(memory_mib) * MiB if memory_mib.isdigit() else None,  # "[N/A]" at times
                     "driver_version": driver,
                     "capability": _capability(cc, "nvidia-smi") if cc and re.fullmatch(r"\d+\.\d+", cc) else None,
                     "mig_mode": {"Enabled": True, "Disabled": False}.get(mig)})
    return rows


def _smi(*args: str) -> str | None:
    try:
        return subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi", *args], capture_output=True, text=True,
                              timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _mig_slices(listing: str) -> dict[str, list[dict]]:
    """``nvidia-smi -L``'s MIG slices under each GPU index: ``{"0": [{"uuid", "mig", "memory_bytes"}]}``.

    Their memory is read from the profile's name (``1g.10gb``: 10 GiB), a little above what CUDA gets of it."""
    slices, gpu = {}, None
    for line in listing.splitlines():
        if match := re.match(r"GPU (\d+):", line):
            gpu = match[1]
        elif (match := re.match(r"\s+MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)]+)\)", line)) and gpu is not None:
            size = re.search(r"(\d+)gb$", match[1])
            slices.setdefault(gpu, []).append({"uuid": match[2], "mig": match[1],
                                               "memory_bytes": int(size[1]) * GiB if size else None})
    return slices


def _pair_matrix(text: str | None) -> dict[tuple[str, str], str]:
    """The cells of an ``nvidia-smi topo -p2p`` matrix: ``{("GPU0", "GPU1"): "OK", ...}`` (empty if unreadable)."""
    if not text:
        return {}
    lines = [line.split() for line in text.splitlines() if line.strip()]
    header = next((fields for fields in lines if fields and all(re.fullmatch(r"GPU\d+", f) for f in fields)), None)
    if header is None:
        return {}
    return {(fields[0], other): cell for fields in lines if fields and fields[0] in header and fields != header
            for other, cell in zip(header, fields[1:])}


def _from_nvidia_smi(chosen: str | None) -> DeviceSet | None:
    rows = nvidia_smi_rows()
    if not rows:
        return None
    if any(r["mig_mode"] for r in rows):
        slices = _mig_slices(_smi("-L") or "")
        rows = [s for r in rows for s in ([{**r, **m} for m in slices.get(r["index"], [])] if r["mig_mode"] else [r])]
    rows = visible_rows(rows, chosen)
    whole = [f"GPU{r['index']}" for r in rows if not r.get("mig")]
    pairs = [(a, b) for n, a in enumerate(whole) for b in whole[n + 1:]]
    link = p2p = None
    if pairs:
        reads, nvlinks = _pair_matrix(_smi("topo", "-p2p", "r")), _pair_matrix(_smi("topo", "-p2p", "n"))
        if all(pair in reads for pair in pairs):
            p2p = all(reads[pair] == "OK" for pair in pairs)
        if all(pair in nvlinks for pair in pairs):
            link = "nvlink" if all(nvlinks[pair] == "OK" for pair in pairs) else "pcie"
    return _from_rows(rows, link, p2p, "nvidia-smi")


# Run in a child process: it initialises CUDA there, which this process must not.
_TORCH_PROBE = """
import json, torch
gpus = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    torch.cuda.set_device(i)
    gpus.append({"name": p.name, "capability": [p.major, p.minor], "memory_bytes": p.total_memory,
                 "bf16": torch.cuda.is_bf16_supported(including_emulation=False)})
n = len(gpus)
pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
print(json.dumps({"gpus": gpus, "p2p": all(torch.cuda.can_device_access_peer(a, b) for a, b in pairs) if pairs
                  else None}))
"""


def _from_torch_child(chosen: str | None) -> DeviceSet | None:
    try:
        result = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=120,
                                check=True)
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    rows = [{"name": g["name"], "capability": tuple(g["capability"]), "memory_bytes": g["memory_bytes"],
             "mig": _mig_profile(g["name"]), "bf16": g["bf16"]} for g in data["gpus"]]
    return _from_rows(rows, None, data["p2p"], "torch (child process)")


# --- the machines learners have -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Platform:
    """A machine learners have, described as :func:`visible` finds it there. ``datasheet_gb``: each GPU's memory on
    NVIDIA's datasheet (a MIG slice: its profile's); CUDA sees a little less (ECC, the driver's share)."""

    title: str
    devices: DeviceSet
    datasheet_gb: int


# As nvidia-smi names them and counts their memory (MiB): a T4's 16 GB with ECC on shows 15360 MiB, an L4's and an
# A10's 24 GB about 23030; MIG slices about 95 % of their profile's size.
_T4 = GPU("Tesla T4", (7, 5), 15360 * MiB)
_L4 = GPU("NVIDIA L4", (8, 9), 23034 * MiB)
_A10 = GPU("NVIDIA A10", (8, 6), 23028 * MiB)
_RTX3090 = GPU("NVIDIA GeForce RTX 3090", (8, 6), 24576 * MiB)
_RTX4090 = GPU("NVIDIA GeForce RTX 4090", (8, 9), 24564 * MiB)
_A100 = GPU("NVIDIA A100-SXM4-80GB", (8, 0), 81920 * MiB)
_H100 = GPU("NVIDIA H100 80GB HBM3", (9, 0), 81559 * MiB)

PLATFORMS: dict[str, Platform] = {
    "colab-t4": Platform("Colab (free)", DeviceSet((_T4,)), 16),
    "kaggle-2xt4": Platform("Kaggle, 2 × T4", DeviceSet((_T4, _T4), "pcie", False), 16),
    "desktop-rtx3090": Platform("desktop RTX card", DeviceSet((_RTX3090,)), 24),
    "desktop-2xrtx4090": Platform("desktop, 2 RTX cards", DeviceSet((_RTX4090, _RTX4090), "pcie", False), 24),
    "mig-a100-1g.10gb": Platform("MIG seat (A100)", DeviceSet((replace(_A100, memory_bytes=9728 * MiB,
                                                                       mig="1g.10gb"),)), 10),
    "mig-h100-1g.10gb": Platform("MIG seat (H100)", DeviceSet((replace(_H100, memory_bytes=9728 * MiB,
                                                                       mig="1g.10gb"),)), 10),
    "cloud-l4": Platform("cloud L4", DeviceSet((_L4,)), 24),
    "cloud-a10": Platform("cloud A10", DeviceSet((_A10,)), 24),
    "cloud-8xa100": Platform("cloud 8 × A100 SXM", DeviceSet((_A100,) * 8, "nvlink", True), 80),
    "cloud-8xh100": Platform("cloud 8 × H100 SXM", DeviceSet((_H100,) * 8, "nvlink", True), 80),
}
