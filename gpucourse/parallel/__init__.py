"""Parallel strategies, one file per technique, each a lesson to read top to bottom.

:func:`parallelize` applies the strategies to the plain model in one fixed order,
as torchtitan's ``parallelize_llama`` does: :data:`STRATEGIES`, the same tuple
whose rules :func:`check` checks before anything runs or is planned. Each strategy's
``apply`` lives in its technique's file and takes only its own slice of the
device mesh:

    pipeline split (pp)  →  tensor parallel (tp)  →  context parallel (cp)  →  experts (ep)
      →  activation checkpointing  →  data parallel / ZeRO / FSDP (dp)  →  precision  →  optimizer

A pipeline split replaces the model by this rank's stage and the trainer's
loop by the stage's schedule; tensor parallelism swaps layers inside the
blocks; data parallelism decides how gradients are synchronised and what the
optimizer step holds. So any data-parallel kind runs on a stage or on a
tensor-parallel slice, without a class written for the combination.

The data-parallel pieces are also components for a loop that is not the
course's: :class:`~.data_parallel.DataParallel` and
:class:`~.data_parallel_buckets.DataParallelBuckets` wrap a module (call
``finish_gradient_synchronization()`` after backward), and
:class:`~.sharded_optimizer.ShardedOptimizer` is ZeRO-1 as a ``torch.optim.Optimizer``
around any optimizer class, :class:`~.sharded_optimizer.ShardedGradientsOptimizer` ZeRO-2
(the gradients reduced to their owner during backward, and clipped by it), and
:class:`~.zero.FlatShardedOptimizer` ZeRO-1 or 2 on flat buffers cut into equal shards. The
course's data-parallel trainers use the same modules, and its ZeRO trainer the flat one.
:class:`~.fsdp_module.FullyShardedDataParallel` is ZeRO-3 as a module: each rank keeps a shard of every matrix,
gathered whole only while the submodule holding it computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..measure import Recorder
from ..values import Name
from . import (activation_checkpointing, context_parallel, context_parallel_torch, data_parallel, expert_parallel,
               pipeline, pipeline_virtual, tensor_parallel, tensor_parallel_torch)
from .activation_checkpointing import recompute
from .data_parallel import DataParallel
from .data_parallel_buckets import DataParallelBuckets
from .fsdp_module import FullyShardedDataParallel
from .precision import Precision
from .schedule_table import SCHEDULES
from .sharded_optimizer import ShardedGradientsOptimizer, ShardedOptimizer
from .single import Trainer

# The components another training loop uses, as ``from gpucourse.parallel import DataParallel``.
COMPONENTS = ("DataParallel", "DataParallelBuckets", "ShardedOptimizer", "ShardedGradientsOptimizer",
              "FullyShardedDataParallel")

# A config (gpucourse.TrainConfig) is only read here, never built or imported: it is data, and these strategies
# check it (check, below) wherever a layout is run or planned.


@dataclass(frozen=True)
class Strategy:
    """One technique, as the engine knows it: its name, the config fields it owns, its rules — each a
    ``check(cfg, model_config, runnable)`` raising one sentence — and how it applies — each an
    ``apply(model, mesh, cfg, built)`` returning the model transformed (or as it was, where the run does not use
    it). Both kept in the technique's own files, one per implementation where they differ."""

    name: str
    fields: tuple
    checks: tuple[Callable, ...]
    applies: tuple[Callable, ...]


@dataclass
class Built:
    """What the strategies build besides the model, for the trainer and the checkpoints."""

    device: torch.device
    rec: Recorder
    precision: Precision
    # How this rank's weights become the whole model's: undone in reverse order (tensor-parallel shards made whole
    # first, then experts gathered, then the pipeline's stages merged).
    gathers: list = field(default_factory=list)
    placements: list = field(default_factory=list)  # where each tensor-parallel shard sits, for checkpoints
    loop: object = None   # a pipeline schedule's step, in place of the trainer's microbatch loop
    extras: dict = field(default_factory=dict)  # what every rank can say about the run (the schedule's ops)
    trainer: Trainer | None = None  # the last strategy's: it synchronises gradients and steps the optimizer


def apply_data_parallel(model, mesh, cfg, built: Built):
    """The trainer that synchronises ``model``'s gradients over the dp slice of the mesh and steps the optimizer,
    chosen by :func:`data_parallel_kind`, into ``built.trainer``."""
    built.trainer = _data_parallel(model, mesh, cfg, lr=cfg.lr, grad_accum=cfg.grad_accum, rec=built.rec,
                                   precision=built.precision, loop=built.loop, gathers=built.gathers,
                                   placements=built.placements)
    built.trainer.extras.update(built.extras)
    return model


# In the order parallelize applies them (torchtitan's), and the order their rules are checked in.
STRATEGIES = (
    Strategy("pipeline", ("pp", "schedule", "virtual_stages", "microbatches"), (pipeline.check,),
             (pipeline.apply, pipeline_virtual.apply)),
    Strategy("tensor", ("tp", "sequence_parallel"), (tensor_parallel.check,),
             (tensor_parallel.apply, tensor_parallel_torch.apply)),
    Strategy("context", ("cp", "cp_algo", "zigzag"), (context_parallel.check, context_parallel_torch.check),
             (context_parallel.apply, context_parallel_torch.apply)),
    Strategy("experts", ("ep", "moe_experts", "moe_top_k", "moe_every", "moe_capacity", "moe_aux"),
             (expert_parallel.check,), (expert_parallel.apply,)),
    Strategy("recomputation", ("checkpoint_activations", "attention"), (activation_checkpointing.check,),
             (activation_checkpointing.apply,)),
    Strategy("data", ("dp", "zero", "impl", "bucket_mb", "grad_accum", "precision", "master_weights"),
             (data_parallel.check,), (apply_data_parallel,)),
)


# The config fields whose values are the strategies' own records: a schedule's name, an attention's. The command
# line's flags take their kind from here, and check refuses an unknown one naming those known.
KINDS = {"schedule": Name(SCHEDULES), "cp_algo": Name(context_parallel.ATTENTIONS)}


def check(cfg, runnable: bool = True):
    """``cfg`` if it can run, else :class:`~gpucourse.readable.ConfigError` naming the first constraint it breaks:
    its values (:meth:`~gpucourse.TrainConfig.validate`), then every strategy's own rules in the order they apply.

    ``runnable=False`` checks only that the layout makes sense (for estimates on paper), not that this build can
    train it."""
    cfg.validate()
    for name, kind in KINDS.items():
        kind.check(getattr(cfg, name), name)
    check_strategies(cfg, cfg.model_config(), runnable)
    return cfg


def check_strategies(cfg, mc, runnable: bool = True) -> None:
    """Every strategy's rules for ``cfg`` (``mc``: its model's config), in order; the first broken one raises
    :class:`~gpucourse.readable.ConfigError`."""
    for strategy in STRATEGIES:
        for rule in strategy.checks:
            rule(cfg, mc, runnable)


def parallelize(model, mesh, cfg, rec: Recorder | None = None, device=None) -> Trainer:
    """The trainer for ``cfg``'s layout: ``model`` transformed by each strategy in turn, on ``mesh`` (pp dp cp tp)."""
    device = device or next(model.parameters()).device
    rec = rec if rec is not None else Recorder(0, device, enabled=False)
    precision = Precision(cfg.precision, cfg.master_weights, device.type)
    if precision.master_weights:
        model.to(precision.dtype)  # the model itself in half precision; the optimizer keeps fp32 masters
    if cfg.impl == "accelerate":  # Accelerate prepares the whole model itself (data parallel only)
        from .accelerate_dp import AccelerateTrainer
        recompute(model, cfg.recompute)
        return AccelerateTrainer(model, zero=cfg.zero, lr=cfg.lr, grad_accum=cfg.grad_accum, rec=rec)
    built = Built(device, rec, precision)
    for strategy in STRATEGIES:
        for apply in strategy.applies:
            model = apply(model, mesh, cfg, built)
    return built.trainer


@dataclass(frozen=True)
class DataParallelKind:
    """One way of synchronising gradients over the dp slice: its name, what ``gpucourse train --list`` calls it,
    and how it builds its trainer — ``build(model, mesh, cfg, options)``, where ``mesh`` is the dp slice (dp × cp
    flattened with context parallelism) and ``options`` the trainer's keyword arguments."""

    name: str
    summary: str
    build: Callable
    fp32_only: bool = False  # PyTorch's sharded kinds take no precision of the course's (the config says so)


def _zero3(model, mesh, cfg, options):
    from .zero3 import Zero3Scratch
    return Zero3Scratch(model, mesh.get_group(), **options)


def _zero(model, mesh, cfg, options):
    from .zero import ZeroScratch
    return ZeroScratch(model, mesh.get_group(), cfg.zero, **options)


def _torch_zero1(model, mesh, cfg, options):
    from .zero_torch import TorchZero1
    return TorchZero1(model, mesh.get_group(), **options)


def _fsdp2(model, mesh, cfg, options):
    from .zero_torch import TorchFSDP
    return TorchFSDP(model, mesh, cfg.zero, **options)


def _replicate(model, mesh, cfg, options):
    from .data_parallel import TorchReplicate
    return TorchReplicate(model, mesh, **options)


def _ddp(model, mesh, cfg, options):
    from .data_parallel import TorchDDP
    return TorchDDP(model, mesh.get_group(), cfg.bucket_mb, **options)


def _buckets(model, mesh, cfg, options):
    from .data_parallel_buckets import BucketedDataParallel
    return BucketedDataParallel(model, mesh.get_group(), cfg.bucket_mb, **options)


def _per_gradient(model, mesh, cfg, options):
    from .data_parallel import DataParallelScratch
    return DataParallelScratch(model, mesh.get_group(), **options)


def _accelerate(model, mesh, cfg, options):
    raise AssertionError("Accelerate prepares the whole model itself: parallelize builds it before the strategies")


# Which trainer synchronises the gradients, and what ``gpucourse train --list`` calls it: one record each, read by
# _data_parallel (to build it) and the catalogue (to name it).
DATA_PARALLEL = {kind.name: kind for kind in (
    DataParallelKind("zero3", "ZeRO-3 (flat shards per block, each gathered just in time)", _zero3),
    DataParallelKind("zero", "ZeRO-{zero} (flat shards)", _zero),
    DataParallelKind("torch-zero1", "ZeroRedundancyOptimizer", _torch_zero1, fp32_only=True),
    DataParallelKind("fsdp2-kept", "FSDP2, parameters kept between forward and backward", _fsdp2, fp32_only=True),
    DataParallelKind("fsdp2", "FSDP2 fully_shard", _fsdp2, fp32_only=True),
    DataParallelKind("accelerate-fsdp", "accelerate.Accelerator (FSDP; CUDA only)", _accelerate),
    DataParallelKind("buckets", "bucketed all-reduce overlapped with backward", _buckets),
    DataParallelKind("per-gradient", "one all-reduce per gradient after backward", _per_gradient),
    DataParallelKind("replicate", "replicate (DDP on FSDP2's machinery, for DTensor parameters)", _replicate),
    DataParallelKind("ddp", "DistributedDataParallel", _ddp),
    DataParallelKind("accelerate-ddp", "accelerate.Accelerator (DDP)", _accelerate),
)}


def data_parallel_kind(cfg) -> str | None:
    """The :data:`DATA_PARALLEL` entry that runs ``cfg``'s data parallelism (dp × cp ranks of the same weights),
    None where there is none."""
    if cfg.zero:
        if cfg.impl == "scratch":
            return "zero3" if cfg.zero == 3 else "zero"
        return {1: "torch-zero1", 2: "fsdp2-kept", 3: "fsdp2"}[cfg.zero] if cfg.impl == "torch" else "accelerate-fsdp"
    if cfg.dp * cfg.cp == 1:
        return None
    if cfg.impl == "scratch":
        return "per-gradient" if cfg.bucket_mb is None else "buckets"
    if cfg.impl == "torch":
        return "replicate" if cfg.tp > 1 else "ddp"  # DDP takes no DTensor parameters; replicate does
    return "accelerate-ddp"


def _data_parallel(model, mesh, cfg, **options) -> Trainer:
    """The trainer that synchronises ``model``'s gradients over the dp slice of the mesh (and steps the optimizer).

    With context parallelism the dp and cp ranks hold the same weights and average their gradients together:
    the slice is the flattened dp × cp mesh.
    """
    name = data_parallel_kind(cfg)
    if name is None:
        return Trainer(model, **options)
    kind = DATA_PARALLEL[name]
    if kind.fp32_only:
        options.pop("precision")
    dp_mesh = mesh["dp", "cp"]._flatten() if cfg.cp > 1 else mesh["dp"]
    return kind.build(model, dp_mesh, cfg, options)
