"""Parallel strategies, one file per technique, each a lesson to read top to bottom.

:func:`parallelize` is the one place that maps a config to a trainer: it takes
the plain model and the device mesh and returns the trainer for that layout, in
torchtitan's order — tensor parallel inside each stage, the pipeline split
across stages, data parallelism (or ZeRO) across replicas.
"""

from __future__ import annotations

from ..config import TrainConfig
from ..measure import Recorder
from .activation_checkpointing import checkpoint_blocks
from .precision import Precision
from .single import Trainer


def parallelize(model, mesh, cfg: TrainConfig, rec: Recorder, device) -> Trainer:
    """The trainer for ``cfg``'s layout, wrapping ``model`` on ``mesh`` (dims pp, dp, tp)."""
    dp_group = mesh["dp"].get_group()
    precision = Precision(cfg.precision, cfg.master_weights, device.type)
    if precision.master_weights:
        model.to(precision.dtype)  # the model itself in half precision; the optimizer keeps fp32 masters
    if cfg.checkpoint_activations:
        checkpoint_blocks(model)
    if cfg.pp > 1:
        from .pipeline import make_pipeline_trainer
        return make_pipeline_trainer(model, mesh, cfg, rec, device)
    if cfg.tp > 1:
        from .tensor_parallel import make_tensor_parallel_trainer
        return make_tensor_parallel_trainer(model, mesh, cfg, rec, device)
    if cfg.impl == "accelerate":
        from .accelerate_dp import AccelerateTrainer
        return AccelerateTrainer(model, cfg, rec)
    if cfg.zero:
        from .zero import make_zero_trainer
        return make_zero_trainer(model, mesh, cfg, rec, device, precision)
    if cfg.dp > 1:
        from .data_parallel import DataParallelScratch, TorchDDP
        if cfg.impl == "torch":
            return TorchDDP(model, cfg.lr, cfg.grad_accum, rec, dp_group, device, bucket_mb=cfg.bucket_mb,
                            precision=precision)
        if cfg.bucket_mb is not None:
            from .data_parallel_buckets import BucketedDataParallel
            return BucketedDataParallel(model, cfg.lr, cfg.grad_accum, rec, dp_group, cfg.bucket_mb, precision)
        return DataParallelScratch(model, cfg.lr, cfg.grad_accum, rec, dp_group, precision)
    return Trainer(model, cfg.lr, cfg.grad_accum, rec, precision=precision)
