"""What the course does on the GPUs you have: how many ranks, which precision, which NCCL settings, which models fit.

Everything here is a function of a :class:`~gpucourse.runtime.devices.DeviceSet`, the description of a machine's GPUs
(:func:`gpucourse.runtime.devices.visible` for this one, :data:`~gpucourse.runtime.devices.PLATFORMS` for the ones
learners have). :func:`course_advice` says it in the plain sentences ``gpucourse doctor`` prints; :func:`model_fit`
sizes every course model for the smallest GPU with the batch-size search of :mod:`gpucourse.modeled.memory` (what
``gpucourse batch-size`` runs), on the memory estimate; :func:`readme_table` is the table of README's "Which GPU you
have", and a test holds the README to it.
"""

from __future__ import annotations

import dataclasses

from .config import AUTO_PRECISION, TrainConfig
from .modeled.gpus import RESERVED_BYTES
from .modeled.memory import estimate, largest_microbatch, num_params, with_microbatch
from .model import MODELS
from .readable import human_bytes
from .runtime import devices

SEQ_LEN = 1024  # tokens per sequence a model is sized at (its block_size when shorter)
BATCH = TrainConfig.batch_size  # the course's default global batch


def resolve(cfg: TrainConfig, found: devices.DeviceSet | None = None, on_gpus: bool | None = None) -> TrainConfig:
    """``cfg`` with precision "auto" made the half precision its ranks compute natively: bf16 on GPUs from compute
    capability 8.0 and on CPU ranks, fp16 (with the dynamic loss scaler) on older GPUs, where bf16 would be
    emulated. Any other precision is kept. Called where the device is planned, once: ``found`` the visible GPUs and
    ``on_gpus`` whether the ranks run on them (the device plan's answer; else read from ``cfg.device`` and
    ``found``)."""
    if cfg.precision != AUTO_PRECISION:
        return cfg
    found = devices.visible() if found is None else found
    if on_gpus is None:
        on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and found.shortfall(cfg.world_size) is None)
    return dataclasses.replace(cfg, precision=devices.mixed_precision(found if on_gpus else devices.DeviceSet())[0])


def run_budget(found: devices.DeviceSet) -> tuple[float, str] | None:
    """The bytes a run may use on each of ``found``'s GPUs (the smallest's memory less ``RESERVED_BYTES``) and which
    GPU that is, in words; None without a GPU whose memory is known."""
    gpu = found.smallest
    if gpu is None:
        return None
    return gpu.memory_bytes - RESERVED_BYTES, gpu.label


def model_fit(found: devices.DeviceSet, precision: str | None = None) -> list[dict]:
    """Each course model, smallest first, with the most sequences a microbatch that fit the smallest GPU.

    ``{"model", "seq_len", "microbatch"}`` (0: not even one), in ``precision`` (the GPUs' mixed precision unless
    given), within the GPU's memory less what is not the run's (CUDA context, NCCL, the allocator). Empty without a
    GPU whose memory is known.
    """
    known = run_budget(found)
    if known is None:
        return []
    precision = precision or devices.mixed_precision(found)[0]
    budget = known[0]
    rows = []
    for name, mc in sorted(MODELS.items(), key=lambda item: num_params(item[1])):
        seq_len = min(mc.block_size, SEQ_LEN)
        cfg = TrainConfig(model=name, seq_len=seq_len, batch_size=1, precision=precision)
        rows.append({"model": name, "seq_len": seq_len,
                     "microbatch": largest_microbatch(cfg, budget, limit=1024)["microbatch"]})
    return rows


def memory_note(cfg: TrainConfig, found: devices.DeviceSet) -> str | None:
    """One sentence when, by the memory estimate, ``cfg``'s busiest rank outgrows the smallest of ``found``'s GPUs,
    with the microbatch that fits (the batch-size search); None when it fits, or no GPU memory is known.

    Said before a run on GPUs starts; the run still starts (the estimate is an estimate; CUDA then has the last
    word), so that a learner who runs out of memory already holds the number that fits.
    """
    known = run_budget(found)
    if known is None:
        return None
    budget, gpu = known
    need = estimate(cfg, every_rank=False)["max_total"]
    if need <= budget:
        return None
    fit = largest_microbatch(cfg, budget)["microbatch"]
    if fit:
        advice = f"{_plural(fit, 'sequence')} a microbatch fit: batch_size={with_microbatch(cfg, fit).batch_size}"
        name, parts = ("microbatches", cfg.microbatches) if cfg.pp > 1 else ("grad_accum", cfg.grad_accum)
        per_rank = cfg.batch_size // cfg.dp
        more = next((k for k in range(parts + 1, per_rank + 1) if per_rank % k == 0 and per_rank // k <= fit), None)
        if more:
            advice += f", or {name}={more} to keep the batch of {cfg.batch_size}"
    else:
        advice = "not even one sequence a microbatch fits: a smaller model or seq_len, or more ranks (zero, tp, pp)"
    return (f"by the memory estimate this run's busiest rank needs {human_bytes(need, binary=True)}, more than the "
            f"{human_bytes(budget, binary=True)} a run can use on each {gpu}; {advice}.")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _fit_sentence(found: devices.DeviceSet) -> str | None:
    fit = model_fit(found)
    if not fit:
        return None
    precision = devices.mixed_precision(found)[0]
    whole = [r["model"] for r in fit if r["microbatch"] >= BATCH]
    parts = [r for r in fit if 0 < r["microbatch"] < BATCH]
    none = [r["model"] for r in fit if not r["microbatch"]]
    said = []
    if whole:
        said.append(f"{', '.join(whole)} fit the default batch of {BATCH} sequences (of up to {SEQ_LEN} tokens)")
    said += [f"{r['model']} fits {_plural(r['microbatch'], 'sequence')} of {r['seq_len']} tokens a microbatch "
             f"(raise grad_accum for a larger batch)" for r in parts]
    if none:
        said.append(f"{', '.join(none)} {'does' if len(none) == 1 else 'do'} not fit one sequence")
    largest = [r for r in fit if r["microbatch"]]
    budget = run_budget(found)[0] / devices.GiB
    text = (f"Memory: the smallest GPU leaves about {budget:.1f} GiB for a run; in {precision}, by the estimate's "
            f"batch-size search: {'; '.join(said)}")
    if largest:
        text += f"; the largest course model that fits is {largest[-1]['model']}"
    return text + f" (gpucourse batch-size --model M --budget-gb {budget:.1f} searches any layout)."


def course_advice(found: devices.DeviceSet, nccl: bool = True) -> list[str]:
    """Plain sentences on what these GPUs mean for the course: ranks, NCCL settings, precision, memory.

    ``nccl``: whether this torch has NCCL. Empty without a GPU (the CPU ranks need no advice on GPUs).
    """
    n = len(found.gpus)
    if not n:
        return []
    if found.mig:
        ranks = (f"{found.describe()}: a MIG slice holds one CUDA rank, so 1-rank runs use it and layouts of 2 or "
                 f"more ranks run on gloo CPU processes (NCCL refuses two ranks on one GPU, 'Duplicate GPU detected', "
                 f"and MIG slices have no P2P).")
    elif nccl:
        ranks = (f"{_plural(n, 'GPU')} visible, {found.describe()}: layouts with dp×tp×pp up to {_plural(n, 'rank')} "
                 f"run on NCCL, one rank per GPU; larger ones run on gloo CPU processes.")
    else:
        ranks = (f"{_plural(n, 'GPU')} visible but this torch has no NCCL: runs use gloo, which works but is far "
                 f"slower between GPUs.")
    advice = [ranks]
    advice += [f"{name}={value} is set for ranks on these GPUs unless you set {name} yourself: {why}."
               for name, value, why in devices.nccl_settings(found)]
    precision, why = devices.mixed_precision(found)
    fp8 = " fp8 is native too (cc 8.9 and up)." if all(g.fp8 for g in found.gpus) else ""
    advice.append(f"Mixed precision here: {precision}, {why}.{fp8}")
    fit = _fit_sentence(found)
    if fit:
        advice.append(fit)
    return advice


def _short(name: str) -> str:
    for prefix in ("NVIDIA ", "Tesla ", "GeForce "):
        name = name.removeprefix(prefix)
    return name


def readme_table() -> str:
    """README's table of :data:`~gpucourse.runtime.devices.PLATFORMS`, every cell computed from their descriptions."""
    lines = ["| where | GPUs | cc | native bf16 / fp8 | CUDA ranks (more: CPU ranks) | mixed precision | "
             "NCCL setting | largest course model that fits |",
             "|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for key, platform in devices.PLATFORMS.items():
        found = platform.devices
        gpu = found.gpus[0]
        what = f"MIG {gpu.mig} of {_short(gpu.name)}" if gpu.mig else _short(gpu.name)
        largest = [r for r in model_fit(found) if r["microbatch"]][-1]
        precision = devices.mixed_precision(found)[0]
        link = "" if len(found.gpus) < 2 else {"nvlink": ", NVLink", "pcie": ", PCIe"}[found.link] + \
            f", P2P {'on' if found.p2p else 'off'}"
        lines.append(" | ".join([
            f"| {platform.title} (`{key}`)", f"{len(found.gpus)} × {what}, {platform.datasheet_gb} GB{link}",
            f"{gpu.capability[0]}.{gpu.capability[1]}", f"{yes[gpu.bf16]} / {yes[gpu.fp8]}",
            f"{found.cuda_ranks}{' (MIG)' if found.mig else ''}",
            "bf16" if precision == "bf16" else "fp16 + loss scaler",
            ", ".join(f"`{name}={value}`" for name, value, _ in devices.nccl_settings(found)) or "—",
            f"{largest['model']} ({largest['microbatch']} × {largest['seq_len']} tokens) |"]))
    return "\n".join(lines)
