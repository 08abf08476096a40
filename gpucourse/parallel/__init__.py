"""Parallel strategies, one file per technique, each a lesson to read top to bottom.

:func:`parallelize` is the one place that reads the config. It applies the
strategies to the plain model in one fixed order, as torchtitan's
``parallelize_llama`` does, each given only its own slice of the device mesh:

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
around any optimizer class. The course's data-parallel trainers use the same modules
(its ZeRO keeps one flat buffer, sharded evenly: `ZeroScratch`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from ..measure import Recorder
from ..model import MoE
from . import (activation_checkpointing, context_parallel, context_parallel_torch, data_parallel, expert_parallel,
               pipeline, schedule_table, tensor_parallel)
from .activation_checkpointing import recompute
from .precision import Precision
from .single import Trainer

# A config (gpucourse.TrainConfig) is only read here, never built or imported: config.py asks these strategies
# to check it, so importing it back would make a loop.


@dataclass(frozen=True)
class Strategy:
    """One technique, as the engine knows it: its name, the config fields it owns, and its rules — each a
    ``check(cfg, model_config, runnable)`` raising one sentence, kept in the technique's own files."""

    name: str
    fields: tuple
    checks: tuple[Callable, ...]


# In the order parallelize applies them, and the order their rules are checked in.
STRATEGIES = (
    Strategy("pipeline", ("pp", "schedule", "virtual_stages", "microbatches"), (pipeline.check,)),
    Strategy("tensor", ("tp", "sequence_parallel"), (tensor_parallel.check,)),
    Strategy("context", ("cp", "cp_algo", "zigzag"), (context_parallel.check, context_parallel_torch.check)),
    Strategy("experts", ("ep", "moe_experts", "moe_top_k", "moe_every", "moe_capacity", "moe_aux"),
             (expert_parallel.check,)),
    Strategy("recomputation", ("checkpoint_activations", "attention"), (activation_checkpointing.check,)),
    Strategy("data", ("dp", "zero", "impl", "bucket_mb", "grad_accum", "precision", "master_weights"),
             (data_parallel.check,)),
)


def check_strategies(cfg, mc, runnable: bool = True) -> None:
    """Every strategy's rules for ``cfg`` (``mc``: its model's config), in order; the first broken one raises
    :class:`~gpucourse.readable.ConfigError` (what :meth:`gpucourse.TrainConfig.validate` calls)."""
    for strategy in STRATEGIES:
        for check in strategy.checks:
            check(cfg, mc, runnable)


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

    # How this rank's weights become the whole model's: undone in reverse order
    # (tensor-parallel shards made whole first, then the pipeline's stages merged).
    gathers, placements, loop, extras = [], [], None, {}
    virtual = cfg.pp > 1 and schedule_table.get(cfg.schedule).virtual  # several chunks a rank, or W split
    if cfg.pp > 1:
        from .pipeline import GPTStage, merge_stages, pipeline_extras
        if virtual:
            from .pipeline_virtual import GPTChunks
            from .schedules_virtual import build as build_virtual
            layout = build_virtual(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)[1]
            model = GPTChunks(model, mesh["pp"].get_local_rank(), layout)
        else:
            model = GPTStage(model, mesh["pp"].get_local_rank(), cfg.pp)
        gathers.append(functools.partial(merge_stages, mesh["pp"].get_group()))
        extras = pipeline_extras(mesh, cfg.schedule, cfg.microbatches, cfg.virtual_stages)
    if cfg.tp > 1:
        from . import tensor_parallel
        if cfg.impl == "torch":
            # DTensors gather themselves
            tensor_parallel.apply_dtensor_parallel(model, mesh["tp"], cfg.sequence_parallel)
        else:
            tensor_parallel.apply_tensor_parallel(model, mesh["tp"].get_group(), cfg.sequence_parallel)
            gathers.insert(0, functools.partial(tensor_parallel.gather_shards, model, mesh["tp"].get_group()))
            placements.append(tensor_parallel.ShardPlacement(model, mesh["tp"]))
    if cfg.cp > 1:  # each rank attends over the other cp ranks' keys
        from . import context_parallel
        if cfg.impl == "torch":
            from .context_parallel_torch import apply_torch_context_parallel
            apply_torch_context_parallel(model, mesh["cp"], cfg.seq_len, cfg.cp_algo, cfg.zigzag)
        else:
            context_parallel.apply_context_parallel(model, mesh["cp"].get_group(), cfg.seq_len, cfg.cp_algo,
                                                    cfg.zigzag)
    if cfg.ep > 1:  # each rank keeps E/ep experts of every MoE block; tokens travel to the others by all-to-all
        from . import expert_parallel
        ep_group, edp_group = expert_parallel.expert_groups(mesh, cfg.ep)
        expert_parallel.apply_expert_parallel(model, ep_group, edp_group)
        gathers.insert(len(gathers) - (cfg.pp > 1), functools.partial(expert_parallel.gather_experts, model,
                                                                       ep_group))
    set_aux_weight(model, 1 / (cfg.grad_accum * (cfg.microbatches if cfg.pp > 1 else 1)))
    recompute(model, cfg.recompute)
    if cfg.pp > 1:
        from .pipeline import PipelineSchedule, TorchPipelineSchedule
        if cfg.impl == "torch" and virtual:
            from .pipeline_virtual import TorchVirtualPipeline
            loop = TorchVirtualPipeline(mesh["pp"].get_group(), cfg.schedule, cfg.microbatches, device)
        elif cfg.impl == "torch":
            loop = TorchPipelineSchedule(mesh["pp"].get_group(), cfg.schedule, cfg.microbatches, device)
        elif virtual:
            from .pipeline_virtual import VirtualPipelineSchedule
            loop = VirtualPipelineSchedule(mesh["pp"].get_group(), cfg.schedule, cfg.microbatches,
                                           cfg.virtual_stages, cfg.model_config().n_embd)
        else:
            loop = PipelineSchedule(mesh["pp"].get_group(), cfg.schedule, cfg.microbatches,
                                    cfg.model_config().n_embd)
    trainer = _data_parallel(model, mesh, cfg, lr=cfg.lr, grad_accum=cfg.grad_accum, rec=rec, precision=precision,
                             loop=loop, gathers=gathers, placements=placements)
    trainer.extras.update(extras)
    return trainer


def set_aux_weight(model, weight: float) -> None:
    """Give each mixture of experts' balance loss the weight its microbatch's loss gets (1 / microbatches)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_weight = weight


# Which trainer synchronises the gradients, and what ``gpucourse train --list`` calls it: one choice, read by
# _data_parallel (to build it) and TrainConfig.describe (to name it).
DATA_PARALLEL = {
    "zero3": "ZeRO-3 (flat shards per block, each gathered just in time)",
    "zero": "ZeRO-{zero} (flat shards)",
    "torch-zero1": "ZeroRedundancyOptimizer",
    "fsdp2-kept": "FSDP2, parameters kept between forward and backward",
    "fsdp2": "FSDP2 fully_shard",
    "accelerate-fsdp": "accelerate.Accelerator (FSDP; CUDA only)",
    "buckets": "bucketed all-reduce overlapped with backward",
    "per-gradient": "one all-reduce per gradient after backward",
    "replicate": "replicate (DDP on FSDP2's machinery, for DTensor parameters)",
    "ddp": "DistributedDataParallel",
    "accelerate-ddp": "accelerate.Accelerator (DDP)",
}


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
    dp_mesh = mesh["dp", "cp"]._flatten() if cfg.cp > 1 else mesh["dp"]
    group = dp_mesh.get_group()
    kind = data_parallel_kind(cfg)
    if kind in ("torch-zero1", "fsdp2-kept", "fsdp2"):
        options.pop("precision")  # fp32 only (the config says so)
    if kind == "zero3":
        from .zero3 import Zero3Scratch
        return Zero3Scratch(model, group, **options)
    if kind == "zero":
        from .zero import ZeroScratch
        return ZeroScratch(model, group, cfg.zero, **options)
    if kind == "torch-zero1":
        from .zero import TorchZero1
        return TorchZero1(model, group, **options)
    if kind in ("fsdp2-kept", "fsdp2"):
        from .zero import TorchFSDP
        return TorchFSDP(model, dp_mesh, cfg.zero, **options)
    if kind == "replicate":
        from .data_parallel import TorchReplicate
        return TorchReplicate(model, dp_mesh, **options)
    if kind == "ddp":
        from .data_parallel import TorchDDP
        return TorchDDP(model, group, cfg.bucket_mb, **options)
    if kind == "buckets":
        from .data_parallel_buckets import BucketedDataParallel
        return BucketedDataParallel(model, group, cfg.bucket_mb, **options)
    if kind == "per-gradient":
        from .data_parallel import DataParallelScratch
        return DataParallelScratch(model, group, **options)
    return Trainer(model, **options)
