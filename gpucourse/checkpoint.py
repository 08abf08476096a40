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
  where the shard sits in the whole): no rank gathers it; each rank writes its
  own piece into its own file (``__r_0.distcp``), and one metadata file
  (``.metadata``) records the tensor under its single-device name and shape and
  where each piece lies — so a load at any layout reshards it.

What a rank holds, the trainer says itself: ``trainer.state_dict()`` is DCP's
Stateful protocol, filled in by each strategy (``parallel/single.py``): weights
under single-device names, optimizer state per parameter ("blocks.0.ln1.weight.exp_avg"),
tensor parallel's slices as DTensors, ZeRO's flat shards cut back into
parameters. Nothing in it depends on the layout, so **a checkpoint saved at one
layout resumes at another** (dp2 ZeRO-2 → tp2 × pp2, dp4 → dp2): loading is the
mirror image, each rank builds the same dictionary from its freshly built
trainer and DCP fills it in place, reading from whichever files hold the pieces
that rank needs now. This file keeps only folders, the random state and DCP's
save and load.

A crash in the middle of a save must never leave something that looks like a
checkpoint. Every rank writes into ``DIR/step-000010.tmp``; after a barrier
(everyone has written) rank 0 adds ``meta.json`` (the step and the config) and
renames the folder to ``DIR/step-000010`` — a rename is atomic — then rewrites
the ``DIR/latest`` pointer (one line, the newest checkpoint's name, for people
and scripts). Resuming takes the newest *complete* folder: named
``step-NNNNNN``, with DCP's ``.metadata`` and our ``meta.json`` inside;
``*.tmp`` folders are ignored.

Rules for ``resume=DIR`` (checked before any rank starts):

- the checkpoint must come from the same model and training settings; the
  layout (dp, tp, pp, zero, impl, schedule, microbatches, grad_accum, ...) and
  ``steps`` (and where the run saves, records and runs) may change. Each rank's
  random state is restored when as many ranks resume as saved;
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
from .config import ConfigError, TrainConfig, fields_of
from .files import write_atomic

FAULT_ENV = "GPUCOURSE_FAULT"
META = "meta.json"
LATEST = "latest"
# Config fields a resumed run may change, as the config tags them: how long and where it runs, not what it
# computes (run options) and how the same computation is laid out on ranks (every layout equals one device).
RUN_OPTIONS = fields_of("run")
LAYOUT_OPTIONS = fields_of("layout")
FORMAT = 2  # 2: state under single-device names, whatever the layout (1: each layout its own)
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
    return [k for k in now if k not in RUN_OPTIONS + LAYOUT_OPTIONS and saved.get(k, default[k]) != now[k]]


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
    if meta.get("format", 1) != FORMAT:
        raise ConfigError(f"{path} was saved by an earlier gpucourse, whose checkpoints depend on their layout; "
                          f"this one reads format {FORMAT}: train again from step 0 (or resume with that version).")
    diff = _differences(meta["config"], cfg)
    if diff:
        was = ", ".join(f"{k}={meta['config'].get(k)!r}" for k in diff)
        now = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in diff)
        raise ConfigError(f"{path} was saved by a run with {was} but this run has {now}; a run resumes the model "
                          f"and training settings it saved (the layout and the number of steps may change).")
    if step >= cfg.steps:
        raise ConfigError(f"{path} is already at step {step}, so steps={cfg.steps} leaves nothing to train; "
                          f"ask for more steps.")
    return path


# --- What each rank holds ------------------------------------------------------------------------
#
# The trainer says it itself: ``trainer.state_dict()`` / ``load_state_dict()`` (each strategy fills in
# its part, see ``parallel/single.py``). Here only the random-number state is added, and at load the
# keys the checkpoint lacks are left out (a parameter that never got a gradient has no optimizer state).

def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _saved(tree: dict, keys: set, prefix: str = "") -> dict:
    """``tree`` without the leaves the checkpoint lacks (DCP names a leaf by its keys joined with dots)."""
    kept = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            inner = _saved(v, keys, f"{prefix}{k}.")
            if inner:
                kept[k] = inner
        elif f"{prefix}{k}" in keys:
            kept[k] = v
    return kept


# --- Saving and resuming, called by train._train on every rank ------------------------------------

@contextlib.contextmanager
def _uncounted(rec):
    """Checkpoint traffic is not training traffic: the recorder counts none of it."""
    comm.set_recorder(None)
    try:
        yield
    finally:
        comm.set_recorder(rec)


def save(trainer, cfg: TrainConfig, step: int, rec=None) -> str:
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
        dcp.save({**trainer.state_dict(), "rng": {f"rank{dist.get_rank()}": _rng_state()}}, checkpoint_id=tmp)
        dist.barrier()  # every rank has written its part
        if dist.get_rank() == 0:
            write_atomic(os.path.join(tmp, META), json.dumps({
                "format": FORMAT, "step": step, "config": cfg.to_dict(), "layout": cfg.layout(), "kind": cfg.kind(),
                "world_size": dist.get_world_size(), "torch": torch.__version__, "time": time.time()}, indent=1))
            if os.path.isdir(final):  # the same step saved before, by an attempt that later failed
                shutil.rmtree(final)
            os.rename(tmp, final)
            write_atomic(os.path.join(cfg.save, LATEST), checkpoint_name(step) + "\n")
            print(f"gpucourse: saved {final} ({time.perf_counter() - start:.2f} s)", flush=True)
        dist.barrier()
    return final


def resume(trainer, cfg: TrainConfig, rec=None) -> int:
    """Load the newest complete checkpoint of ``cfg.resume`` into ``trainer``; return the step to start from.

    Rank 0 chooses the checkpoint and tells the others, so that every rank loads the same one.
    The layout may differ from the one that saved: DCP reads each rank's pieces from whichever
    files hold them. Each rank's random state comes back only on as many ranks as saved it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    with _uncounted(rec):
        chosen = [find_resume(cfg) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
        if path is None:
            return 0
        start = time.perf_counter()
        meta = read_meta(path)
        state = trainer.state_dict()
        if meta["world_size"] == dist.get_world_size():
            state["rng"] = {f"rank{dist.get_rank()}": _rng_state()}
        state = _saved(state, set(FileSystemReader(path).read_metadata().state_dict_metadata))
        dcp.load(state, checkpoint_id=path)
        trainer.load_state_dict(state)
        if "rng" in state:
            _set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
        if dist.get_rank() == 0:
            moved = "" if meta["layout"] == cfg.layout() else f", saved at layout {meta['layout']}"
            print(f"gpucourse: resumed from {path} at step {meta['step']}{moved} "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)
    return meta["step"]


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
