"""Checkpoints: stop a run, resume it later, and get exactly the run that never stopped.

What a checkpoint must hold so that resuming changes nothing:

- the **weights** and the **optimizer state** (AdamW's two moments and its step
  counter: without them the first steps after a resume would be different steps);
- the **step** to go on from;
- each rank's **random-number state** (dropout draws from it);
- the **position in the data**. Here that is the step itself: ``data.global_batch``
  depends only on ``(seed, step)``, so there is no data loader state to save.

Every rank holds a different part of that state — a ZeRO shard of the optimizer,
a pipeline stage, a tensor-parallel slice — and gathering it all on one rank
would need that rank to fit the whole model. ``torch.distributed.checkpoint``
(DCP) instead lets *each rank write what it holds*, in parallel:

- a tensor that every rank holds the same (a data-parallel replica's weights)
  is written once;
- a tensor cut between ranks is handed to DCP as a ``DTensor`` (its shard, plus
  where the shard sits in the whole), so the checkpoint stores the *whole*
  tensor under its single-device name and each rank writes its own piece;
- ``torch.distributed.checkpoint.state_dict``'s ``get_model_state_dict`` and
  ``get_optimizer_state_dict`` (and their ``set_`` twins) name what a module and
  its optimizer hold, plain or wrapped: DDP's replica, FSDP2's and DTensor tensor
  parallel's shards. The from-scratch shards are made DTensors here, a few lines
  each (:func:`trainer_state`): tensor-parallel slices of weights and moments, and
  ZeRO's shard of Adam's moments in its flat buffer (:func:`_zero_shard`).

Loading is the mirror image: each rank builds the same dictionary from its
freshly built trainer and DCP fills it in place, reading only the pieces that
rank needs.

A crash in the middle of a save must never leave something that looks like a
checkpoint. Every rank writes into ``DIR/step-000010.tmp``; after a barrier
(everyone has written) rank 0 adds ``meta.json`` (the step and the config) and
renames the folder to ``DIR/step-000010`` — a rename is atomic — then rewrites
the ``DIR/latest`` pointer (one line, the newest checkpoint's name, for people
and scripts). Resuming takes the newest *complete* folder: named
``step-NNNNNN``, with DCP's ``.metadata`` and our ``meta.json`` inside;
``*.tmp`` folders are ignored.

Rules for ``resume=DIR`` (checked before any rank starts):

- the checkpoint must come from the same layout and training settings; only
  ``steps`` (and where the run saves, records and runs) may change;
- a folder with no complete checkpoint is refused — unless it is also the
  ``save`` folder: then the run starts from step 0. That is what a job that is
  restarted after a failure needs (``torchrun --max-restarts``): the same command
  line starts fresh the first time and resumes every time after. (Give torchrun
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store it shares by default, a
  restarted attempt can read the addresses the failed one left there and fail to
  connect, pytorch/pytorch#135712.)

Fault injection, a teaching and test hook: with ``GPUCOURSE_FAULT="rank=1,step=6"``
in the environment, rank 1 ends its process (``os._exit(1)``, no exception, as a
crash or a lost machine would) when it reaches step 6 — on the first attempt
only, so a job restarted by ``torchrun --max-restarts`` (which sets
``TORCHELASTIC_RESTART_COUNT``) runs through.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time

import torch
import torch.distributed as dist

from . import comm
from .config import ConfigError, TrainConfig
from .measure import write_atomic
from .parallel.tensor_parallel import shard_dims
from .parallel.zero import ZeroScratch

FAULT_ENV = "GPUCOURSE_FAULT"
META = "meta.json"
LATEST = "latest"
# Config fields a resumed run may change: they say how long and where it runs, not what it computes.
RUN_OPTIONS = ("steps", "device", "record", "profile", "save", "save_every", "resume")
_NAME = re.compile(r"step-(\d{6,})")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint taken after ``step`` steps: ``step-000010``."""
    return f"step-{step:06d}"


def complete_checkpoints(folder: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``folder``, oldest first.

    Complete: renamed from ``.tmp`` (so every rank finished writing) and holding
    both DCP's ``.metadata`` and ``meta.json``.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        match = _NAME.fullmatch(name)
        if match and all(os.path.isfile(os.path.join(path, f)) for f in (".metadata", META)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_meta(path: str | os.PathLike) -> dict:
    """The ``meta.json`` of one checkpoint: ``step``, ``config``, ``layout``, ``world_size``, ``torch``."""
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def _differences(saved: dict, cfg: TrainConfig) -> list[str]:
    now = cfg.to_dict()
    default = TrainConfig().to_dict()  # a field newer than the checkpoint had its default then
    return [k for k in now if k not in RUN_OPTIONS and saved.get(k, default[k]) != now[k]]


def find_resume(cfg: TrainConfig) -> str | None:
    """Check ``cfg``'s save and resume options; return the checkpoint it resumes from (None: step 0).

    Raises :class:`ConfigError` with one sentence. :func:`gpucourse.train.run`
    calls it before any rank starts, so a resume that cannot work never starts one.
    """
    for name in ("save", "resume"):
        path = getattr(cfg, name)
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{name}={path!r} is a file; checkpoints go in a folder.")
    if not isinstance(cfg.save_every, int) or cfg.save_every < 0:
        raise ConfigError(f"save_every={cfg.save_every!r} must be 0 (save only at the end) or a positive "
                          f"number of steps.")
    if cfg.save_every and not cfg.save:
        raise ConfigError(f"save_every={cfg.save_every} says how often to save, but no save folder is set.")
    if cfg.resume is None:
        return None
    found = complete_checkpoints(cfg.resume)
    if not found:
        if cfg.save and os.path.abspath(cfg.save) == os.path.abspath(cfg.resume):
            return None  # a job's first attempt: nothing saved yet, start from step 0
        raise ConfigError(f"resume={cfg.resume!r} holds no complete checkpoint (a step-NNNNNN folder; "
                          f"*.tmp ones are unfinished saves); to start from step 0 when there is none, save to "
                          f"the same folder.")
    step, path = found[-1]
    meta = read_meta(path)
    diff = _differences(meta["config"], cfg)
    if diff:
        was = ", ".join(f"{k}={meta['config'].get(k)!r}" for k in diff)
        now = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in diff)
        raise ConfigError(f"{path} was saved by a run with {was} but this run has {now}; a run resumes only "
                          f"the layout and settings it saved (only steps may change).")
    if step >= cfg.steps:
        raise ConfigError(f"{path} is already at step {step}, so steps={cfg.steps} leaves nothing to train; "
                          f"ask for more steps.")
    return path


# --- What each rank holds -----------------------------------------------------------------------

def _options():
    """Optimizer state under parameter names, one key per parameter ("state.blocks.0.ln1.weight.exp_avg").

    Rather than torch's list of parameter groups: a pipeline stage or a ZeRO-1
    rank then saves just the entries of its own parameters.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _torch_optimizer(trainer, cfg: TrainConfig):
    """The torch optimizer whose state this rank holds."""
    if cfg.impl == "torch" and cfg.zero == 1:
        return trainer.optimizer.optim  # ZeroRedundancyOptimizer: the AdamW over this rank's own parameters
    if cfg.impl == "accelerate":
        return trainer.optimizer.optimizer  # Accelerate's wrapper around ours
    return trainer.optimizer


def _sharded(t: torch.Tensor, mesh, dim: int):
    """This rank's piece ``t`` as a DTensor: DCP then stores the whole tensor, each rank writing its piece."""
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)


def _local(tree):
    """``tree`` with every DTensor in it turned back into this rank's piece (for those made by :func:`_sharded`)."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    return tree.to_local() if isinstance(tree, DTensor) else tree


def _adam_state(adamw: torch.optim.Optimizer, tensors: list) -> list[dict]:
    """AdamW's state of each of ``tensors``; zeros of the right shape for a fresh optimizer, for DCP to fill."""
    return [adamw.state.get(t) or {"step": torch.zeros(()), "exp_avg": torch.zeros_like(t),
                                   "exp_avg_sq": torch.zeros_like(t)} for t in tensors]


def _give_adam_state(adamw: torch.optim.Optimizer, states: list[dict]) -> None:
    """Hand AdamW the (loaded) state of its parameters, in their order."""
    groups = adamw.state_dict()["param_groups"]
    adamw.load_state_dict({"state": dict(enumerate(states)), "param_groups": groups})


def _zero_shard(trainer: ZeroScratch, mesh) -> dict:
    # Weights: every rank holds them all (stages 1 and 2), each parameter a view into the flat
    # buffer, so they are in "model". Here: this rank's shard of Adam's moments (and of the fp32
    # master weights, with master_weights) — a DTensor over dp, so the checkpoint holds the whole flat.
    masters = trainer.precision.master_weights
    adamw = trainer.optimizer.inner if masters else trainer.optimizer
    tensor = trainer.optimizer.masters[0] if masters else trainer.local
    [adam] = _adam_state(adamw, [tensor])
    shard = {"step": adam["step"], "exp_avg": _sharded(adam["exp_avg"], mesh["dp"], 0),
             "exp_avg_sq": _sharded(adam["exp_avg_sq"], mesh["dp"], 0)}
    if masters:
        shard["master"] = _sharded(tensor, mesh["dp"], 0)
    return shard


def _master_names(trainer) -> list[str]:
    name_of = {p: n.removeprefix("module.") for n, p in trainer.model.named_parameters()}
    return [name_of[p] for p in trainer.optimizer.params]


def trainer_state(trainer, mesh, cfg: TrainConfig) -> dict:
    """This rank's part of the checkpoint, as DCP takes it: ``{"model", "optim", "rng"}`` (+ ``"loss_scale"``).

    The tensors are the trainer's own (or views of them), so ``dcp.load`` into
    this dictionary writes straight into the trainer; :func:`load_trainer_state`
    then hands the optimizer its state.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # DDP, FSDP2 and DTensor say what they hold; under the single-device names, DDP's "module." removed.
    model = get_model_state_dict(trainer.model)
    cuts = shard_dims(trainer.model)
    for name, dim in cuts.items():  # scratch tensor parallel: each tp rank holds a slice of these
        model[name] = _sharded(model[name], mesh["tp"], dim)
    if isinstance(trainer, ZeroScratch):
        optim = {"flat_shard": _zero_shard(trainer, mesh)}
    elif trainer.precision.master_weights:  # AdamW on fp32 copies of the (half-precision) weights
        names, opt = _master_names(trainer), trainer.optimizer
        optim = {"master": dict(zip(names, opt.masters)),
                 "state": dict(zip(names, _adam_state(opt.inner, opt.masters)))}
    else:
        # A fresh optimizer has no state yet; this creates it (a step with lr 0) so DCP has tensors to fill.
        optim = get_optimizer_state_dict(trainer.model, _torch_optimizer(trainer, cfg), options=_options())
        for key, value in optim.items():  # "state.<name>.exp_avg": the moments are sliced like their weight
            prefix, _, field = key.rpartition(".")
            name = prefix.removeprefix("state.")
            if key.startswith("state.") and name in cuts and field != "step":
                optim[key] = _sharded(value, mesh["tp"], cuts[name])
    state = {"model": model, "optim": optim, "rng": {f"rank{dist.get_rank()}": _rng_state()}}
    scaler = trainer.precision.scaler
    if scaler is not None:  # fp16: the loss scale and its count of good steps are state too
        state["loss_scale"] = {"scale": scaler.scale, "good_steps": scaler.good_steps, "skipped": scaler.skipped}
    return state


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_trainer_state(trainer, cfg: TrainConfig, state: dict) -> None:
    """Give the trainer what ``dcp.load`` read into ``state`` (built by :func:`trainer_state`)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rng = state["rng"][f"rank{dist.get_rank()}"]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    if "loss_scale" in state:
        vars(trainer.precision.scaler).update(state["loss_scale"])
    model, optim = state["model"], state["optim"]
    if shard_dims(trainer.model):  # our tensor-parallel DTensors back to this rank's slices
        model, optim = _local(model), _local(optim)
    set_model_state_dict(trainer.model, model)
    if isinstance(trainer, ZeroScratch):  # the master shard, if any, was loaded in place
        shard, opt = _local(optim["flat_shard"]), trainer.optimizer
        _give_adam_state(opt.inner if trainer.precision.master_weights else opt,
                         [{k: shard[k] for k in ("step", "exp_avg", "exp_avg_sq")}])
    elif trainer.precision.master_weights:  # the masters were loaded in place
        _give_adam_state(trainer.optimizer.inner, [optim["state"][n] for n in _master_names(trainer)])
    else:
        set_optimizer_state_dict(trainer.model, _torch_optimizer(trainer, cfg), optim, options=_options())


# --- Saving and resuming, called by train._train on every rank ------------------------------------

@contextlib.contextmanager
def _uncounted(rec):
    """Checkpoint traffic is not training traffic: the recorder counts none of it."""
    comm.set_recorder(None)
    try:
        yield
    finally:
        comm.set_recorder(rec)


def save(trainer, mesh, cfg: TrainConfig, step: int, rec=None) -> str:
    """Write the checkpoint after ``step`` steps into ``cfg.save`` (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(cfg.save, checkpoint_name(step))
    tmp = final + ".tmp"
    start = time.perf_counter()
    with _uncounted(rec):
        if dist.get_rank() == 0:
            os.makedirs(cfg.save, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        dist.barrier()
        dcp.save(trainer_state(trainer, mesh, cfg), checkpoint_id=tmp)
        dist.barrier()  # every rank has written its part
        if dist.get_rank() == 0:
            write_atomic(os.path.join(tmp, META), json.dumps({
                "step": step, "config": cfg.to_dict(), "layout": cfg.layout(), "kind": cfg.kind(),
                "world_size": dist.get_world_size(), "torch": torch.__version__, "time": time.time()}, indent=1))
            if os.path.isdir(final):  # the same step saved before, by an attempt that later failed
                shutil.rmtree(final)
            os.rename(tmp, final)
            write_atomic(os.path.join(cfg.save, LATEST), checkpoint_name(step) + "\n")
            print(f"gpucourse: saved {final} ({time.perf_counter() - start:.2f} s)", flush=True)
        dist.barrier()
    return final


def resume(trainer, mesh, cfg: TrainConfig, rec=None) -> int:
    """Load the newest complete checkpoint of ``cfg.resume`` into ``trainer``; return the step to start from.

    Rank 0 chooses the checkpoint and tells the others, so that every rank loads the same one.
    """
    import torch.distributed.checkpoint as dcp

    with _uncounted(rec):
        chosen = [find_resume(cfg) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
        if path is None:
            return 0
        start = time.perf_counter()
        state = trainer_state(trainer, mesh, cfg)
        dcp.load(state, checkpoint_id=path)
        load_trainer_state(trainer, cfg, state)
        step = read_meta(path)["step"]
        if dist.get_rank() == 0:
            print(f"gpucourse: resumed from {path} at step {step} ({time.perf_counter() - start:.2f} s)",
                  flush=True)
    return step


def inject_fault(rank: int, step: int) -> None:
    """End this process at ``step`` if ``GPUCOURSE_FAULT`` says so (first attempt only; see the module doc)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        return
    try:
        fault = {k.strip(): int(v) for k, v in (part.split("=") for part in spec.split(","))}
        target = (fault["rank"], fault["step"])
    except (ValueError, KeyError):
        raise ConfigError(f"{FAULT_ENV}={spec!r} must look like 'rank=1,step=6'.") from None
    if (rank, step) == target:
        print(f"gpucourse: {FAULT_ENV}: rank {rank} ends its process at step {step} (a simulated crash)",
              file=sys.stderr, flush=True)
        os._exit(1)
