"""Tensor parallelism the PyTorch way (``impl="torch"``), beside ``tensor_parallel.py``'s from-scratch layers.

DTensor's ``parallelize_module`` takes a plan — for each sub-module path, how to cut it — and swaps each Linear's
weight for a DTensor sharded over the tp mesh: ``ColwiseParallel`` by output features, ``RowwiseParallel`` by input
features, with the collectives f and g of the scratch version put in by the layouts DTensor knows its tensors have.
The plan below is the scratch layout written for DTensor, block by block, so both equal the single-device run.
"""

from __future__ import annotations

import torch.nn as nn

from .tensor_parallel import check_shardable


def torch_block_plan(sequence_parallel: bool = False) -> dict:
    """The same layout for DTensor's ``parallelize_module``, one block at a time.

    Colwise layers take a Replicate input and Rowwise layers sum their partial
    outputs: g, written for you. Each sub-layer's input is first made one
    Replicate DTensor (``PrepareModuleInput``) shared by q, k and v, so that their
    three partial input gradients add up locally and are all-reduced once, at
    that boundary: f, once per sub-layer, as in scratch.

    With ``sequence_parallel`` the activations between sub-layers are
    ``Shard(1)`` (cut along the sequence): ``SequenceParallel`` runs each
    LayerNorm on its tokens (its weights' gradients are summed over tp by
    DTensor), the sub-layer entry turns Shard(1) into Replicate (an all-gather;
    backward a reduce-scatter) and the Rowwise layers hand back Shard(1) (a
    reduce-scatter; backward an all-gather).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    between = Shard(1) if sequence_parallel else Replicate()

    def enter():
        return PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))

    plan = {"attn": enter(), "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=between),
            "mlp": enter(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=between)}
    if sequence_parallel:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    return plan


def apply_dtensor_parallel(module: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """DTensor tensor parallel: ``parallelize_module`` with Colwise/RowwiseParallel on each block; returns ``module``.

    Colwise layers hand back plain local tensors (``use_local_output=True``), so
    attention's ``view(B, T, -1, head_dim)`` finds this rank's heads, as in scratch.
    Parameters become DTensors and AdamW updates them shard by shard; memory is
    counted from their local shards.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    blocks = check_shardable(module)
    for block in blocks:
        parallelize_module(block, tp_mesh, torch_block_plan(sequence_parallel))
    if sequence_parallel and blocks:  # into the region: this rank's tokens; out of it: all of them again
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
    return module


def apply(model, mesh, cfg, built):
    """impl "torch": DTensor's tensor (and sequence) parallelism on the tp slice of ``mesh``."""
    if cfg.tp == 1 or cfg.impl != "torch":
        return model
    return apply_dtensor_parallel(model, mesh["tp"], cfg.sequence_parallel)
