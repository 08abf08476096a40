"""config → mesh → parallelize(model) → one training loop.

:func:`run` validates a :class:`~gpucourse.config.TrainConfig`, starts its ranks
through :func:`gpucourse.runtime.launch`, and merges what they measured into one
:class:`~gpucourse.measure.RunResult`. :func:`train_worker` is what each rank
runs; under ``torchrun`` it runs in place, in every process.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time

import torch

from . import checkpoint, comm, data, platforms, profiling
from .config import TrainConfig
from .files import write_atomic
from .measure import Recorder, RunResult, merge
from .model import MoE, blocks_of, build_model
from .parallel import check, parallelize
from .runtime import current, devices, launch, report
from .runtime.launcher import DevicePlan, in_place, plan_device


class NonFiniteLoss(FloatingPointError):
    """A loss became NaN or infinite; the message names the step, the rank and the first bad parameter."""


def check_finite(loss: float, step: int, rank: int, model: torch.nn.Module | None = None) -> None:
    """Raise :class:`NonFiniteLoss` if ``loss`` is NaN or infinite.

    Checking every step costs nothing extra when the loss is read anyway (its
    ``.item()``). Stopping at the *first* bad step matters: one step later, data
    parallelism's all-reduce has spread the NaN gradients to every replica and
    the rank where it started can no longer be told apart.
    """
    if math.isfinite(loss):
        return
    where = ""
    if model is not None:
        params = list(model.named_parameters())
        bad = [n for n, p in params if not torch.isfinite(p).all()]
        if len(bad) == len(params):
            where = (f"; all {len(bad)} parameter tensors are non-finite now (this step's update already "
                     f"applied the bad gradients)")
        elif bad:
            where = f"; non-finite parameters: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
        else:
            where = "; every parameter is still finite (look at this step's batch)"
    raise NonFiniteLoss(f"loss is {loss} at step {step} on rank {rank}{where}")


MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost


def build_mesh(cfg: TrainConfig, device: torch.device):
    """One DeviceMesh for the layout: dims (pp, dp, cp, tp), tensor-parallel ranks adjacent.

    Every strategy gets its 1-D slice of it (``mesh["dp"]``); a dimension of size 1 is a
    group of one rank, so every layout has every dimension.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, tuple(getattr(cfg, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def train_worker(cfg_dict: dict, export_path: str | None = None) -> dict:
    """Train on this rank; return its measurements as plain data."""
    cfg = TrainConfig.from_dict(cfg_dict)
    ctx = current()
    rec = Recorder(ctx.rank, ctx.device, enabled=cfg.record)
    comm.set_recorder(rec)
    # Our own strategies count their bytes as they call gpucourse.comm; PyTorch's
    # make their collectives inside torch, so there we count at the dispatcher.
    counting = comm.counting() if cfg.impl != "scratch" else contextlib.nullcontext()
    try:
        # --profile DIR: a torch.profiler trace of a few steps per rank (a no-op otherwise).
        # --memory-snapshot DIR: every CUDA allocation of this rank, written when the run ends (or fails).
        with counting, profiling.trace(cfg.profile, ctx.rank, cfg.steps), \
                profiling.memory_snapshot(cfg.memory_snapshot, ctx.rank):
            return _train(cfg, ctx, rec, export_path)
    finally:
        comm.set_recorder(None)


def _train(cfg: TrainConfig, ctx, rec: Recorder, export_path: str | None) -> dict:
    mesh = build_mesh(cfg, ctx.device)
    dp_rank = mesh["dp"].get_local_rank()
    # Context parallelism: this rank's tokens of every sequence (None: all of them).
    positions = data.context_positions(cfg.seq_len, mesh["cp"].get_local_rank(), cfg.cp, cfg.zigzag) \
        if cfg.cp > 1 else None
    model = build_model(cfg.model_config(), cfg.seed).to(ctx.device)
    trainer = parallelize(model, mesh, cfg, rec, ctx.device)
    rec.activations.exclude(trainer.model.parameters())
    # What the blocks' LayerNorms save: the region sequence parallelism cuts.
    rec.activations.watch([m for block in blocks_of(trainer.module) for m in block.modules()
                           if isinstance(m, torch.nn.LayerNorm)], "block layernorms")
    start_step = checkpoint.resume(trainer, cfg, rec) if cfg.resume else 0
    # Mixture of experts: what each router did, step by step (summed over the ranks by merge()).
    experts = [(name, m) for name, m in trainer.module.named_modules() if isinstance(m, MoE)]
    moe_steps = []
    losses, step_times, save_times = [], [], []
    slow = cfg.straggler_delay()
    for step in range(start_step, cfg.steps):
        checkpoint.inject_fault(ctx.rank, step)
        rec.step = step - start_step  # what a RunResult counts from: its losses[0] is step start_step
        x, y = data.rank_batch(step, cfg.batch_size, cfg.seq_len, cfg.seed, dp_rank, cfg.dp, positions)
        first_span = len(rec.spans)
        start = time.perf_counter()
        with rec.span("step"):
            if slow is not None and slow[0] == ctx.rank:  # a planted straggler: a device slower than its peers
                with rec.span("forward", "slow device (planted straggler)", delay_s=slow[1]):
                    time.sleep(slow[1])
            loss = trainer.step(x.to(ctx.device), y.to(ctx.device))
        value = None if loss is None else loss.item()  # .item() waits for the step on CUDA
        if value is not None:
            check_finite(value, step, ctx.rank)  # stop at the first NaN, where it started
        step_times.append(time.perf_counter() - start)
        if experts:
            moe_steps.append(_router_counts(experts))
        rec.flush()
        profiling.step()
        losses.append(value)
        if value is not None:
            report({"kind": "step", "step": step, "steps": cfg.steps, "loss": value, "time_s": step_times[-1]})
        if cfg.record:  # what this rank did during the step, for a live view
            report({"kind": "activity", "step": step, "time_s": step_times[-1], "busy_s": rec.totals(first_span)})
        if cfg.save and (step + 1 == cfg.steps or cfg.save_every and (step + 1) % cfg.save_every == 0):
            saving = time.perf_counter()
            checkpoint.save(trainer, cfg, step + 1, rec)
            save_times.append(time.perf_counter() - saving)  # what a save costs: the interval's price
    comm.set_recorder(None)  # gathering the weights for export is not training traffic
    state = trainer.full_state_dict()
    if export_path and ctx.rank == 0:
        buf = io.BytesIO()
        torch.save(state, buf)
        write_atomic(export_path, buf.getvalue())
    return {"rank": ctx.rank, "start_step": start_step, "losses": None if losses[0] is None else losses,
            "step_times_s": step_times,
            "memory": trainer.memory,
            "extras": {**_extras(trainer), **({"moe": {"layers": [n for n, _ in experts], "steps": moe_steps}}
                                              if experts else {}),
                       **({"checkpoint_save_s": save_times} if save_times else {})},
            **rec.export()}


def _router_counts(experts: list) -> dict:
    """This step's token choices per expert, dropped choices and mean balance loss of each MoE block; reset."""
    out = {"tokens": [m.tokens.tolist() for _, m in experts], "dropped": [m.dropped for _, m in experts],
           "aux": [sum(m.aux_values) / max(len(m.aux_values), 1) for _, m in experts]}
    for _, m in experts:
        m.reset_stats()
    return out


def _extras(trainer) -> dict:
    extras = dict(getattr(trainer, "extras", {}))
    extras["activations_by_region"] = dict(trainer.rec.activations.regions)
    if getattr(trainer, "precision", None) is not None:
        extras["precision"] = trainer.precision.extras()
    return extras


class _Progress:
    """Turns per-rank step reports into one global-loss callback per step."""

    def __init__(self, holders: int, callback):
        self.holders, self.callback = holders, callback
        self._seen: dict[int, list] = {}

    def __call__(self, msg: dict) -> None:
        if msg.get("kind") != "step":
            return
        got = self._seen.setdefault(msg["step"], [])
        got.append(msg)
        if len(got) == self.holders:
            del self._seen[msg["step"]]
            loss = sum(m["loss"] for m in got) / len(got)
            self.callback({"step": msg["step"], "steps": msg["steps"], "loss": loss,
                           "time_s": max(m["time_s"] for m in got)})


_said: set = set()  # the notes on precision and memory this process has printed


def run(config: TrainConfig, *, timeout: float | None = None, export_weights: str | os.PathLike | None = None,
        on_step=None, on_message=None, quiet: bool = False, device_plan: DevicePlan | None = None) -> RunResult:
    """Train ``config`` on its ranks and return the merged :class:`RunResult`.

    ``on_step`` is called in this process with ``{step, steps, loss, time_s}``
    after each step (the global mean loss). ``on_message`` is given every report
    the ranks send, as it arrives (each rank's own ``step`` and, when recording,
    ``activity``); :func:`gpucourse.viz.watch` draws from both while the run
    trains. ``export_weights`` saves the trained model as one single-device
    ``state_dict`` file, whatever the layout. ``device_plan``: where the ranks run, when the caller has planned
    it already (the command line does, to refuse before anything else); else it is planned here, once.
    """
    config.validate()  # its values, before the machine is asked anything
    # The device, planned once: where the ranks run decides what precision "auto" means, then every rule is checked.
    plan = device_plan or plan_device(config.device, int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
                                      if in_place() else config.world_size)
    found = plan.gpus
    config = check(platforms.resolve(config, found, on_gpus=plan.device == "cuda" or plan.stand_in))
    config.validate_on(plan.device)
    if (plan.device == "cuda" or plan.stand_in) and not quiet:  # described GPUs get their notes too
        for note in (devices.precision_note(found, config.precision), platforms.memory_note(config, found)):
            if note and note not in _said:  # once a process: a notebook re-runs its cells
                _said.add(note)
                print(f"gpucourse: {note}", flush=True)
    checkpoint.find_resume(config)  # a resume that cannot work is refused before any rank starts
    holders = config.world_size // config.pp  # ranks that see a loss: those of the last pipeline stage
    progress = _Progress(holders, on_step) if on_step else None

    def handle(msg: dict) -> None:
        if progress is not None:
            progress(msg)
        if on_message is not None:
            on_message(msg)

    export = os.fspath(export_weights) if export_weights else None
    outputs = launch(train_worker, config.to_dict(), export, world_size=config.world_size, timeout=timeout,
                     device=plan, on_message=handle if on_step or on_message else None, quiet=quiet)
    return merge(config.to_dict(), outputs, device=plan.device, backend=plan.backend)
