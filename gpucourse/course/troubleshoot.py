"""Planted faults: break a real training run on purpose, see what you would see, then why and the fix.

``gpucourse troubleshoot --list`` names the scenarios; ``gpucourse troubleshoot
NAME`` runs one. Each trains gpucourse's tiny GPT with data parallelism on two
ranks and plants one classic fault in it:

- ``desync``: ranks call collectives in different orders, and hang;
- ``shape-mismatch``: ranks all-reduce tensors of different shapes;
- ``crash``: one rank raises in the middle of training;
- ``nan``: a loss becomes NaN;
- ``oom``: a rank needs more memory than it has.

Each prints the **symptom** (the error exactly as ``gpucourse train`` would
report it), the **diagnosis** (what the error says, read the way an
experienced engineer reads it), the **fix**, and which debugging switches
(see ``gpucourse doctor``) would have helped. Every scenario ends within a few
seconds and checks that no rank process is left behind.

Two checks here are also useful in your own loops: :func:`check_finite` stops a
run at the first non-finite loss, naming the step, the rank and the first
broken parameter; :func:`check_budget` stops a rank whose measured memory
passes a budget (how CPU ranks imitate a GPU running out of memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..readable import human_bytes
from ..runtime import LaunchTimeout, WorkerError, current, launch, report
from ..runtime.collective_status import diagnose_hang
from ..runtime.launcher import plan_device, visible_gpus
from ..train import NonFiniteLoss, check_finite  # noqa: F401 (the loop's own check; the scenarios use it too)

WORLD = 2
HANG_TIMEOUT_S = 6      # the desync scenario's launch timeout: short, so the hang is over quickly
RUN_TIMEOUT_S = 60      # any other scenario (they end by themselves in seconds)
FAULT_STEP = 2          # the step at which a fault is planted
CPU_BUDGET_MB = 16      # the oom scenario's memory per rank, on CPU ranks
CUDA_BUDGET_MB = 256    # on a GPU (the CUDA context and cuBLAS workspace need their share)


class OutOfMemoryBudget(MemoryError):
    """A rank's measured memory passed its budget (CPU ranks' stand-in for a CUDA out-of-memory error)."""


def check_budget(memory: dict, budget_bytes: int, step: int, rank: int) -> None:
    """Raise :class:`OutOfMemoryBudget` if the categories of ``memory`` (bytes) add up to more than the budget."""
    parts = {k: v for k, v in memory.items() if k != "device_peak"}
    need = sum(parts.values())
    if need > budget_bytes:
        size = functools.partial(human_bytes, binary=True)
        raise OutOfMemoryBudget(
            f"rank {rank} needs {size(need)} at step {step} but its budget is {size(budget_bytes)} ("
            + ", ".join(f"{k} {size(v)}" for k, v in parts.items()) + ")")


# --- what the ranks run ---------------------------------------------------------------


def _load_extra_sample(rank: int, index: int) -> None:
    """The crash scenario's bug: rank 1 reads past the end of its data shard."""
    shard = 4096
    if index >= shard:
        raise IndexError(f"sample {index} is past the end of shard {rank} ({shard} samples)")


def _plant(fault: str, step: int, rank: int, model: torch.nn.Module, local_batch: int) -> None:
    """The one line of each scenario that is wrong (each reads like code found in real training loops)."""
    if step != FAULT_STEP:
        return
    if fault == "desync" and rank == 0:
        # "Rank 0 saves a checkpoint, then everyone waits for it" — with the
        # barrier indented one level too deep, only rank 0 waits.
        dist.barrier()
    elif fault == "shape-mismatch":
        # Per-sequence losses gathered for logging; the last batch of the epoch
        # was split unevenly, so rank 1 holds one sequence fewer.
        per_sequence = torch.ones(local_batch - rank)
        dist.all_reduce(per_sequence)
    elif fault == "crash" and rank == 1:
        _load_extra_sample(rank, 4096 + step)
    elif fault == "nan" and rank == 1:
        # What an fp16 overflow does: one weight becomes infinite.
        with torch.no_grad():
            dict(model.named_parameters())["ln_f.weight"][0] = float("inf")


def _trainer(cfg: TrainConfig, budget_bytes: int | None = None):
    """This rank's model and trainer for ``cfg``, as ``train`` builds them; and a batch function."""
    from .. import data
    from ..measure import Recorder
    from ..model import build_model
    from ..parallel import parallelize
    from ..train import build_mesh

    ctx = current()
    if budget_bytes and ctx.device.type == "cuda":
        # A real limit: the caching allocator refuses to go past this share of the GPU.
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, ctx.device)
    rec = Recorder(ctx.rank, ctx.device, enabled=cfg.record)
    mesh = build_mesh(cfg, ctx.device)
    dp_rank = mesh["dp"].get_local_rank()
    model = build_model(cfg.model_config(), cfg.seed).to(ctx.device)
    trainer = parallelize(model, mesh, cfg, rec, ctx.device)
    rec.activations.exclude(trainer.model.parameters())

    def batch(step):
        x, y = data.rank_batch(step, cfg.batch_size, cfg.seq_len, cfg.seed, dp_rank, cfg.dp)
        return x.to(ctx.device), y.to(ctx.device)
    return model, trainer, batch


def scenario_rank(fault: str, cfg_dict: dict, budget_bytes: int | None = None) -> dict:
    """Train ``cfg_dict`` on this rank with ``fault`` planted; return the final loss and memory."""
    ctx = current()
    report({"kind": "pid", "pid": os.getpid()})
    cfg = TrainConfig.from_dict(cfg_dict)
    model, trainer, batch = _trainer(cfg, budget_bytes)
    loss = None
    for step in range(cfg.steps):
        x, y = batch(step)
        _plant(fault, step, ctx.rank, model, x.shape[0])
        loss = trainer.step(x, y).item()
        check_finite(loss, step, ctx.rank, model)
        if budget_bytes and ctx.device.type == "cpu":
            check_budget(trainer.memory, budget_bytes, step, ctx.rank)
    return {"loss": loss, "memory": trainer.memory}


# --- the scenarios, as the user lives them ----------------------------------------------


def _doctor_hint(variable: str) -> str:
    from .doctor import TROUBLESHOOTING

    return next(s for s in TROUBLESHOOTING if s.startswith(variable))


@contextlib.contextmanager
def _environment(**values: str):
    """Set environment variables for the ranks about to be started (and torch.distributed's debug level)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    dist.set_debug_level_from_env()  # read once at import; forked ranks inherit this process's level
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        dist.set_debug_level_from_env()


def _config(**changes) -> dict:
    base = TrainConfig(dp=WORLD, steps=FAULT_STEP + 3, batch_size=8, seq_len=32, record=False)
    return dataclasses.replace(base, **changes).to_dict()


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _launch(fault: str, cfg: dict, world: int = WORLD, timeout: float = RUN_TIMEOUT_S, budget: int | None = None,
            device: str = "auto") -> tuple[list | None, BaseException | None, list[int]]:
    """Run the scenario's ranks; return (values, the error, their pids)."""
    pids: list[int] = []

    def on_message(msg):
        if msg.get("kind") == "pid":
            pids.append(msg["pid"])

    try:
        values = launch(scenario_rank, fault, cfg, budget, world_size=world, timeout=timeout, device=device,
                        on_message=on_message, quiet=True)
        return values, None, pids
    except (WorkerError, LaunchTimeout) as e:
        return None, e, pids


def _symptom(error: BaseException | None) -> str:
    """The error as ``gpucourse train`` prints it (a traceback cut to its last lines)."""
    if error is None:
        return "the run finished without an error"
    if isinstance(error, LaunchTimeout):
        return f"gpucourse: timeout: {error}"
    text = f"gpucourse: rank {error.rank} failed: {error.exc_type}: {error.message}"
    if error.remote_traceback:
        tail = error.remote_traceback.rstrip().splitlines()[-5:]
        text += f"\n--- traceback of rank {error.rank} (last lines) ---\n" + "\n".join(tail)
    return text


def _without_a_timeout() -> str:
    from .doctor import default_timeout_minutes

    minutes = default_timeout_minutes()
    return ("The launcher killed both ranks when its timeout passed; without one they would wait for the process "
            f"group's timeout ({minutes['gloo']} minutes by default on gloo, as here; {minutes['nccl']} on NCCL) and "
            "then fail with an unhelpful 'timed out' from gloo or NCCL.")


WITHOUT_A_TIMEOUT = _without_a_timeout()


def _desync() -> dict:
    _, error, pids = _launch("desync", _config(), timeout=HANG_TIMEOUT_S, device="cpu")
    lines = []
    if isinstance(error, LaunchTimeout):
        lines.append(diagnose_hang(error.waiting))
    return {"error": error, "pids": pids, "diagnosis": lines + [
        WITHOUT_A_TIMEOUT,
        f"Here rank 0 entered a barrier at step {FAULT_STEP} that rank 1 never calls: rank 1 went on to the "
        "next step's gradient all-reduce. Every rank must make the same collectives, in the same order.",
        "(This scenario runs on gloo CPU ranks everywhere, where it always hangs. On NCCL a barrier is itself an "
        "all-reduce of one value, so the same bug can also pair the wrong calls and corrupt data silently.)"],
        "fix": [
            "Make the collective unconditional: every rank calls it, whatever its rank or data. Here the barrier "
            "belongs outside `if rank == 0:` (rank 0 saves, then all ranks wait).",
            "Look for collectives inside `if rank == ...`, inside loops whose length differs between ranks "
            "(uneven data), and after an early `return` or `continue` on some ranks."],
        "see_also": [_doctor_hint("TORCH_DISTRIBUTED_DEBUG"), _doctor_hint("The timeout="),
                     _doctor_hint("NCCL_DEBUG"),
                     "On NCCL, TORCH_NCCL_DESYNC_DEBUG=1 makes the watchdog say, when a collective times out, "
                     "which rank never joined it (and TORCH_NCCL_TRACE_BUFFER_SIZE=2000 keeps a record of each "
                     "rank's last collectives, the 'flight recorder')."]}


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(.*?OpType=(\w+), "
                          r"TensorShape=\[([^\]]*)\]")


def _shape_mismatch() -> dict:
    # gloo may abort or hang on this bug: the short timeout bounds the hang.
    _, error, pids = _launch("shape-mismatch", _config(), timeout=HANG_TIMEOUT_S, device="cpu")
    with _environment(TORCH_DISTRIBUTED_DEBUG="DETAIL"):
        _, checked, more = _launch("shape-mismatch", _config(), timeout=RUN_TIMEOUT_S, device="cpu")
    pids += more
    diagnosis = []
    if isinstance(error, LaunchTimeout):
        diagnosis.append("A hang: gloo let the rank with the smaller tensor finish its all-reduce (it received "
                         "the bytes it expected) and go on, while the other still waits for the rest of its "
                         "bytes.")
        diagnosis.append("Compare the ranks' lines above: one collective number appears with a different shape "
                         "on each rank (one rank still waits in it, the other finished it). NCCL does not check "
                         "sizes either: there the same bug hangs, or silently reduces the wrong bytes.")
    elif isinstance(error, WorkerError) and error.exc_type == "ProcessExit":
        diagnosis.append(f"gloo noticed the sizes differ and aborted the process of rank {error.rank} "
                         "(\"Received data size doesn't match expected size\" in the rank's output above); the "
                         "launcher names the collective it was in. NCCL does not check sizes at all: there the "
                         "same bug hangs, or silently reduces the wrong bytes.")
    elif isinstance(error, WorkerError):
        diagnosis.append(f"The collective failed on rank {error.rank}: {error.exc_type}.")
    else:
        diagnosis.append("This time gloo did not notice: the ranks reduced buffers of different sizes.")
    symptom2 = _symptom(checked)
    seen = {int(r): (op, shape) for r, op, shape in _FINGERPRINT.findall(symptom2)}
    diagnosis.append("Run again with TORCH_DISTRIBUTED_DEBUG=DETAIL: torch checks every collective's "
                     "operation, shapes and dtypes across ranks before running it, and says what differs:")
    diagnosis.append("  " + symptom2.splitlines()[0][:300] + ("..." if len(symptom2.splitlines()[0]) > 300 else ""))
    if seen:
        diagnosis.append("  i.e. " + "; ".join(f"rank {r} {op.lower()} of shape [{shape}]"
                                               for r, (op, shape) in sorted(seen.items())) + ".")
    return {"error": error, "pids": pids, "diagnosis": diagnosis, "fix": [
        "Give every rank tensors of the same shape: pad the uneven last batch (or drop it: "
        "DistributedSampler(drop_last=True)), or gather sizes first and use all_gather with padding.",
        "Keep TORCH_DISTRIBUTED_DEBUG=DETAIL for debugging only: the checks cost an extra collective per call."],
        "see_also": [_doctor_hint("TORCH_DISTRIBUTED_DEBUG")]}


def _crash() -> dict:
    _, error, pids = _launch("crash", _config())
    diagnosis = []
    if isinstance(error, WorkerError):
        diagnosis.append(f"Read the rank named first: rank {error.rank} raised {error.exc_type} "
                         f"(\"{error.message}\"), and its traceback says where. The other rank did not fail by "
                         "itself: it was waiting in its next collective for the rank that died, and the launcher "
                         "stopped it at once.")
    return {"error": error, "pids": pids, "diagnosis": diagnosis + [
        "Errors printed by the other ranks after that (\"connection closed by peer\", NCCL watchdog "
        "timeouts) are consequences, not causes."],
        "fix": ["Fix the failing rank's bug (here: an index past the end of its data shard); reproduce it on one "
                "rank with the same data shard if you can."],
        "see_also": [_doctor_hint("TORCH_NCCL_ASYNC_ERROR_HANDLING")]}


def _nan() -> dict:
    _, error, pids = _launch("nan", _config())
    diagnosis = []
    if isinstance(error, WorkerError):
        diagnosis.append(f"check_finite stopped the run at the first non-finite loss, on rank {error.rank}; the "
                         f"other rank's loss of that step was still finite, so the NaN began in rank "
                         f"{error.rank}'s forward pass.")
    diagnosis.append("Within that same step the gradient all-reduce spread the NaN gradients to every replica and "
                     "the optimizer wrote them into the weights: from the next step on every rank reports NaN and "
                     "nothing shows where it began. Check the loss every step, on every rank.")
    return {"error": error, "pids": pids, "diagnosis": diagnosis, "fix": [
        "Find the first bad tensor: check parameters and activations before the step on that rank, or run "
        "the step under torch.autograd.detect_anomaly() to name the operation that produced the NaN (here: a "
        "weight of ln_f made infinite, as an fp16 overflow would).",
        "Usual causes: a learning rate too high (lower it, add warm-up, clip gradients with "
        "torch.nn.utils.clip_grad_norm_), fp16 overflow (use bf16, or a GradScaler with fp16), log or division "
        "of zero, a corrupt batch."], "see_also": []}


def _oom() -> dict:
    world = 1 if visible_gpus() == 1 else WORLD  # one GPU: one rank that really runs out
    device = plan_device("auto", world).device
    budget_mb = CUDA_BUDGET_MB if device == "cuda" else CPU_BUDGET_MB
    batch = (1024 if device == "cuda" else 32) * world
    broken = _config(dp=world, batch_size=batch, seq_len=64, steps=1)
    grad_accum = 64 if device == "cuda" else 8
    fixed = dict(broken, grad_accum=grad_accum)
    _, error, pids = _launch("oom", broken, world=world, budget=budget_mb << 20)
    values, still, more = _launch("oom", fixed, world=world, budget=budget_mb << 20)
    pids += more
    micro = batch // world
    diagnosis = []
    if device == "cpu":
        diagnosis.append("CPU ranks do not run out of memory that early, so each rank counts what it holds after "
                         f"its first step (weights, gradients, Adam state, saved activations) against a "
                         f"{budget_mb} MiB budget, as a GPU's allocator would.")
    else:
        diagnosis.append(f"The GPU allocator was limited to {budget_mb} MiB per rank "
                         "(torch.cuda.set_per_process_memory_fraction), and the step asked for more: a real "
                         "torch.cuda.OutOfMemoryError. 'Tried to allocate' is the one allocation that failed, "
                         "not the total.")
    diagnosis.append(f"Saved activations dominate: they grow with the microbatch ({micro} sequences of 64 tokens "
                     f"per rank), while weights, gradients and optimizer state do not.")
    if still is None and values:
        mem = values[0]["memory"]
        used = mem.get("device_peak") or sum(v for k, v in mem.items() if k != "device_peak")
        diagnosis.append(f"Fixed run, grad_accum={grad_accum} (microbatch {micro // grad_accum}, same global batch "
                         f"{batch}): {human_bytes(used, binary=True)} per rank, within the {budget_mb} MiB budget, "
                         f"and the same training.")
    else:
        diagnosis.append(f"The fixed run with grad_accum={grad_accum} failed too: {_symptom(still).splitlines()[0]}")
    return {"error": error, "pids": pids, "diagnosis": diagnosis, "fix": [
        f"Split the batch into microbatches (grad_accum={grad_accum}: activations shrink {grad_accum}x, the "
        "optimizer step is unchanged), and/or recompute activations in backward (--checkpoint-activations), "
        "train in bf16, or shard weights, gradients and optimizer state across data-parallel ranks "
        "(ZeRO / FSDP: --zero 1, 2, 3).",
        "Size a layout before running it: gpucourse memory (the same flags as train) and "
        "gpucourse batch-size --budget-gb."], "see_also": []}


@dataclass(frozen=True)
class Scenario:
    """One planted fault: its name, a line about it, and the function that runs it."""

    name: str
    title: str
    run: Callable[[], dict]


SCENARIOS = {s.name: s for s in (
    Scenario("desync", "ranks call collectives in a different order: a hang", _desync),
    Scenario("shape-mismatch", "ranks all-reduce tensors of different shapes", _shape_mismatch),
    Scenario("crash", "one rank raises in the middle of training", _crash),
    Scenario("nan", "a loss becomes NaN", _nan),
    Scenario("oom", "a rank needs more memory than it has", _oom),
)}


def _wait_gone(pids: list[int], within: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        left = [p for p in pids if not _pid_gone(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def run(name: str, stream=None) -> dict:
    """Run the scenario ``name`` and print its symptom, diagnosis and fix to ``stream`` (stdout by default).

    Returns ``{"name", "title", "symptom", "diagnosis", "fix", "see_also", "error"
    (the exception's type name or None), "elapsed_s", "pids", "left_behind"}``.
    """
    if name not in SCENARIOS:
        raise KeyError(f"no scenario {name!r}; the scenarios are {', '.join(SCENARIOS)}.")
    stream = stream or sys.stdout
    scenario = SCENARIOS[name]
    print(f"== {name}: {scenario.title}", file=stream, flush=True)
    start = time.monotonic()
    found = scenario.run()
    elapsed = time.monotonic() - start
    left = _wait_gone(found["pids"])
    error = found["error"]
    out = {"name": name, "title": scenario.title, "symptom": _symptom(error), "diagnosis": found["diagnosis"],
           "fix": found["fix"], "see_also": found["see_also"],
           "error": None if error is None else getattr(error, "exc_type", type(error).__name__),
           "elapsed_s": elapsed, "pids": found["pids"], "left_behind": left}
    print(format_report(out), file=stream, flush=True)
    return out


def format_report(found: dict) -> str:
    """A scenario's result as the plain text ``gpucourse troubleshoot NAME`` prints."""
    def block(title, lines):
        return [title] + [f"  {line}" for text in lines for line in text.splitlines()]

    lines = block("symptom (what you see):", [found["symptom"]])
    lines += block("diagnosis:", found["diagnosis"]) + block("fix:", found["fix"])
    if found["see_also"]:
        lines += block("debugging switches that help here (see also gpucourse doctor):", found["see_also"])
    gone = len(found["pids"]) - len(found["left_behind"])
    lines.append(f"(finished in {found['elapsed_s']:.1f} s; {gone} of {len(found['pids'])} rank processes gone"
                 + (f"; STILL RUNNING: {found['left_behind']}" if found["left_behind"] else "") + ")")
    return "\n".join(lines)


# --- what the collective status tracking costs -----------------------------------------


def _overhead_rank(cfg_dict: dict, rounds: int, block: int) -> dict:
    """Step times of one training, switching tracking off and on every ``block`` steps."""
    from ..runtime import collective_status

    cfg = TrainConfig.from_dict(cfg_dict)
    _, trainer, batch = _trainer(cfg)
    times = {"tracked": [], "untracked": []}
    step = 0
    for _ in range(3):  # warm-up steps, in neither list
        trainer.step(*batch(step)).item()
        step += 1
    for r in range(rounds):
        for mode in (("tracked", "untracked") if r % 2 == 0 else ("untracked", "tracked")):
            before = collective_status.calls()
            with collective_status.paused() if mode == "untracked" else contextlib.nullcontext():
                for _ in range(block):
                    x, y = batch(step)
                    start = time.perf_counter()
                    trainer.step(x, y).item()
                    times[mode].append(time.perf_counter() - start)
                    step += 1
            if mode == "tracked":
                calls = (collective_status.calls() - before) / block
    return {"times": times, "calls_per_step": calls, "per_call_s": _per_call_cost()}


def _per_call_cost(calls: int = 20000) -> float:
    """Seconds the tracking adds to one collective call (a wrapped no-op against a bare one)."""
    from ..runtime import collective_status

    def bare(*args, **kwargs):
        return None

    tensor = torch.ones(64, 64)
    wrapped = collective_status.tracked("all_reduce", bare)
    best = []
    for fn in (wrapped, bare):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn(tensor)
            runs.append((time.perf_counter() - start) / calls)
        best.append(min(runs))
    return best[0] - best[1]


def tracking_overhead(rounds: int = 10, block: int = 5):
    """Benchmark figure: step time of dp=2 from-scratch training with collective status tracking over without.

    The scratch strategy makes one all-reduce per parameter tensor (65 small
    ones per step for the tiny model), the worst case for a per-call cost. One
    run switches the tracking off and on every ``block`` steps (on, off, off,
    on...), so a machine that gets busier slows both sides alike; each side's
    median step time is used. Returns a :class:`gpucourse.bench.Reading` whose
    detail also has the per-call cost and the estimate cost x calls / step time.
    """
    from .readings import Reading

    cfg = TrainConfig(dp=2, record=False)
    outputs = launch(_overhead_rank, cfg.to_dict(), rounds, block, world_size=2, timeout=600, quiet=True)
    # A step ends when the slower rank's does: compare the slower rank's times.
    med = {mode: statistics.median(max(o["times"][mode][i] for o in outputs)
                                   for i in range(len(outputs[0]["times"][mode])))
           for mode in ("tracked", "untracked")}
    calls = outputs[0]["calls_per_step"]
    per_call = max(o["per_call_s"] for o in outputs)
    estimate = per_call * calls / med["untracked"]
    value = med["tracked"] / med["untracked"]
    return Reading(value, {"step_s": med, "calls_per_step": calls, "per_call_s": per_call,
                           "estimated_overhead": estimate},
                   f"{calls:.0f} collectives per step x {per_call * 1e6:.2f} us = {estimate:.2%} of a "
                   f"{med['untracked'] * 1e3:.1f} ms step (measured ratio {value:.3f})")
