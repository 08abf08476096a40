"""Tensor parallelism (Megatron-LM style): every rank holds a slice of each weight matrix.

Data parallelism copies the whole model; tensor parallelism cuts each block's
big matrices between the ``tp`` ranks of a group, so a model too big for one
device fits on several. All ``tp`` ranks see the *same* batch and together
compute what one device would. A linear layer ``Y = X Wᵀ + b`` (W: out × in)
can be cut two ways:

- **column-parallel**: cut W by *output* features. Rank r computes
  ``Y_r = X W_rᵀ + b_r``, its slice of Y's last dimension. The input X must be
  whole on every rank; in backward each rank's ``dX`` is only its slice's
  contribution, so the full ``dX`` is their sum.
- **row-parallel**: cut W by *input* features. Rank r takes its slice ``X_r`` of
  the input and computes a partial ``X_r W_rᵀ``; the output is the sum over ranks,
  plus the bias, added once after that sum.

Put a column-parallel layer before a row-parallel one and the sliced activation
between them never has to be gathered. Two conjugate operators mark the region:

    f: forward identity,   backward all-reduce    (entry: X is whole, dX is summed)
    g: forward all-reduce, backward identity      (exit: partial outputs are summed)

In a GPT block each sub-layer is one such region:

- attention: ``q``, ``k``, ``v`` column-parallel — contiguous output features are
  whole heads, so each rank holds ``n_head / tp`` heads and attends with them
  alone — then ``proj`` row-parallel;
- MLP: ``fc`` column-parallel, GELU on the local slice (it is element-wise),
  ``proj`` row-parallel.

That is one all-reduce forward (g) and one backward (f) per sub-layer. f sits
once at the sub-layer's entrance, not in each of q, k, v, because they share one
input: one all-reduce of its summed gradient does (Megatron fuses q, k, v into
one matrix for the same reason). Everything else — embeddings, LayerNorms, the
head, the biases of row-parallel layers — is replicated, and stays identical on
every tp rank without any gradient sync: f hands each LayerNorm the same, whole
gradient, and after g every rank holds the same activation and gradient.

Communication per optimizer step, each tp rank (fp32, 4 bytes a number):

    forward 2 + backward 2 all-reduces per block, each B × T × n_embd × 4 bytes
    = 4 · n_layer · (batch_size / dp) · seq_len · n_embd · 4 bytes

(``grad_accum`` only splits B between microbatches), so summed over all
``dp · tp`` ranks ``16 · n_layer · batch_size · seq_len · n_embd · tp`` bytes.
With dp × tp each rank also averages its (local) gradients over its dp group.

Shards are cut from the model's full initialisation, so the run equals the
single-device run. ``impl="torch"`` does the same with DTensor's
``ColwiseParallel`` / ``RowwiseParallel``, which put f and g in for you
(``tensor_parallel_torch.py``).

Sequence parallelism (``sequence_parallel.py``) changes f and g into an
all-gather and a reduce-scatter along the sequence, so that the activations
between sub-layers, replicated here, hold T/tp tokens a rank.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..model import blocks_of
from ..readable import ConfigError
from .sequence_parallel import ReduceScatterSequence, enter_sequence_region, mark_sequence_region


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # autograd may share the incoming buffer
        comm.all_reduce(grad, group=ctx.group, name="tp all_reduce backward (f)")
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group, name="tp all_reduce forward (g)")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard(t: torch.Tensor, dim: int, group) -> nn.Parameter:
    """This rank's contiguous slice of ``t`` along ``dim``, as a new Parameter."""
    piece = t.detach().chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]
    return nn.Parameter(piece.clone(), requires_grad=t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """This rank's slice of a Linear's output features (weight and bias rows).

    Input: the whole X, which must have passed f (the gradient sum) before.
    Output: this rank's slice of the last dimension.
    """

    shard_dims = {"weight": 0, "bias": 0}  # the dimension each parameter is cut along

    def __init__(self, full: nn.Linear, group):
        super().__init__()
        self.weight = _shard(full.weight, 0, group)
        self.bias = None if full.bias is None else _shard(full.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of a Linear's input features; the partial outputs are summed by g.

    Input: this rank's slice of the last dimension. Output: the whole Y, equal on every rank.
    """

    shard_dims = {"weight": 1}  # the bias is whole on every rank

    def __init__(self, full: nn.Linear, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(full.weight, 1, group)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone(),
                                                                requires_grad=full.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exit_region = ReduceScatterSequence if self.sequence_parallel else ReduceFromTensorParallel
        y = exit_region.apply(F.linear(x, self.weight), self.group)
        # Added once, after the sum: added before it, it would count tp times.
        return y if self.bias is None else y + self.bias


def _enter_region(group, module, args):
    """Forward pre-hook of a sub-layer: its input passes f once, whoever reads it."""
    return (CopyToTensorParallel.apply(args[0], group), *args[1:])


SHARDED = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")  # the layers tensor parallelism cuts


def _sharded_paths(block: nn.Module) -> list[str]:
    """SHARDED, with a mixture of experts' every expert in place of ``mlp`` (each expert cut as the MLP is)."""
    experts = getattr(block.get_submodule("mlp"), "experts", None) if hasattr(block, "mlp") else None
    if experts is None:
        return list(SHARDED)
    return [*SHARDED[:4], *(f"mlp.experts.{name}.{layer}" for name, _ in experts.named_children()
                            for layer in ("fc", "proj"))]


def _mlps(block: nn.Module) -> list[nn.Module]:
    """The MLPs of a block tensor parallelism cuts: its own, or each of its experts."""
    experts = getattr(block.mlp, "experts", None)
    return list(experts.children()) if experts is not None else [block.mlp]


def check_shardable(module: nn.Module) -> list[nn.Module]:
    """``module``'s blocks, if each has the Linear layers tensor parallelism cuts; else one sentence naming it."""
    blocks = blocks_of(module)
    for block in blocks:
        missing = [path for path in _sharded_paths(block) if not _is_linear(block, path)]
        if missing:
            raise TypeError(f"{type(block).__name__} has no nn.Linear {', '.join(missing)}, so tensor parallelism "
                            f"cannot shard it (it cuts {', '.join(SHARDED)} of every block).")
    return blocks


def _is_linear(module: nn.Module, path: str) -> bool:
    try:
        return isinstance(module.get_submodule(path), nn.Linear)
    except AttributeError:
        return False


def apply_tensor_parallel(module: nn.Module, tp_group, sequence_parallel: bool = False) -> nn.Module:
    """Swap each block's Linear layers for this rank's shards, in place; return ``module``.

    attn.q, attn.k, attn.v and mlp.fc become column-parallel, attn.proj and
    mlp.proj row-parallel, and each attention and MLP sub-layer gets f at its
    entrance. Embeddings, LayerNorms and the head are left whole (replicated).
    With ``sequence_parallel`` the blocks' activations between sub-layers hold
    this rank's T/tp tokens: entries all-gather, row layers reduce-scatter, the
    first block takes this rank's tokens and the last gathers them again.
    """
    blocks = check_shardable(module)  # every block checked before any is changed
    enter = enter_sequence_region if sequence_parallel else _enter_region
    for block in blocks:
        attn = block.attn
        for name in ("q", "k", "v"):
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), tp_group))
        attn.proj = RowParallelLinear(attn.proj, tp_group, sequence_parallel)
        # A mixture of experts: each expert is cut as the MLP is, with f at its own entrance (not the block's:
        # the router, replicated, already gets its whole input gradient on every rank).
        for mlp in _mlps(block):
            mlp.fc = ColumnParallelLinear(mlp.fc, tp_group)
            mlp.proj = RowParallelLinear(mlp.proj, tp_group, sequence_parallel)
        for sub in (attn, *_mlps(block)):
            sub.register_forward_pre_hook(functools.partial(enter, tp_group))
    if sequence_parallel:
        mark_sequence_region(blocks, tp_group)
    return module


def shard_dims(module: nn.Module) -> dict[str, int]:
    """``{state_dict name: dimension it is cut along}`` of every tensor-parallel shard in ``module``."""
    return {f"{prefix}.{name}" if prefix else name: dim
            for prefix, m in module.named_modules() for name, dim in getattr(m, "shard_dims", {}).items()
            if getattr(m, name) is not None}  # a layer without bias has no bias shard


def gather_shards(module: nn.Module, tp_group, state: dict) -> dict:
    """``state`` (``module``'s state_dict) with every shard all-gathered whole, on every rank of ``tp_group``.

    Sharded parameters are concatenated along the dimension they were cut;
    replicated ones are the same on every rank and stay as they are. This uses
    ``torch.distributed`` directly: exporting is not training traffic.
    """
    cut = shard_dims(module)
    n = dist.get_world_size(tp_group)
    whole = {}
    for name, t in state.items():
        if name in cut:
            pieces = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(pieces, t.contiguous(), group=tp_group)
            t = torch.cat(pieces, dim=cut[name])
        whole[name] = t
    return whole


class ShardPlacement:
    """Tensor parallel's part of a checkpoint: each slice a rank holds is a piece of a whole tensor.

    ``place`` makes each slice (a weight, and the optimizer state shaped like it)
    a DTensor over the tp mesh, cut along the dimension it was cut: the
    checkpoint then stores the whole tensor under its single-device name, each
    rank writing its piece, and any layout can load it. ``local`` undoes it.
    """

    def __init__(self, module: nn.Module, tp_mesh):
        self.cuts, self.mesh = shard_dims(module), tp_mesh

    def _dim(self, section: str, key: str, value) -> int | None:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None  # Adam's step count is not cut
        return self.cuts.get(key if section == "model" else key.rpartition(".")[0])  # "name.exp_avg" → name

    def place(self, state: dict) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        def piece(section, key, value):
            dim = self._dim(section, key, value)
            return value if dim is None else DTensor.from_local(value, self.mesh, [Shard(dim)], run_check=False)
        return {**state, **{section: {k: piece(section, k, v) for k, v in state[section].items()}
                            for section in ("model", "optim")}}

    def local(self, state: dict) -> dict:
        def mine(section, key, value):
            return value.to_local() if self._dim(section, key, value) is not None else value
        return {**state, **{section: {k: mine(section, k, v) for k, v in state[section].items()}
                            for section in ("model", "optim") if section in state}}


# --- how the engine applies it ---------------------------------------------------------------------------------------

def apply(model, mesh, cfg, built):
    """The blocks' linear layers split over the tp ranks, on the tp slice of ``mesh``.

    What the engine needs later goes into ``built`` (``parallel.Built``). Scratch layers gather their shards for a whole-model state dict (first of the gathers: shards are made whole
    before pipeline stages are merged) and say where each shard sits for a checkpoint; DTensors do both themselves.
    """
    if cfg.tp == 1 or cfg.impl == "torch":  # impl "torch": tensor_parallel_torch.apply
        return model
    apply_tensor_parallel(model, mesh["tp"].get_group(), cfg.sequence_parallel)
    built.gathers.insert(0, functools.partial(gather_shards, model, mesh["tp"].get_group()))
    built.placements.append(ShardPlacement(model, mesh["tp"]))
    return model


# --- its rules -----------------------------------------------------------------------------------------------------

def check(cfg, mc, runnable: bool = True) -> None:
    """What tensor and sequence parallelism refuse, one sentence each."""
    if cfg.tp > 1:
        if mc.n_head % cfg.tp:
            raise ConfigError(f"tp={cfg.tp} must divide n_head={mc.n_head} of model {cfg.model!r}: "
                              f"each rank holds whole attention heads.")
        if (4 * mc.n_embd) % cfg.tp:
            raise ConfigError(f"tp={cfg.tp} must divide the MLP width 4 × n_embd = {4 * mc.n_embd}.")
    if cfg.sequence_parallel:
        if cfg.tp == 1:
            raise ConfigError("sequence_parallel cuts tensor parallelism's replicated activations along the "
                              "sequence; it needs tp > 1.")
        local = cfg.seq_len // cfg.cp  # the tokens a context-parallel rank holds
        if local % cfg.tp:
            held = f"seq_len={cfg.seq_len}" if cfg.cp == 1 else f"seq_len / cp = {local}"
            raise ConfigError(f"{held} must divide by tp={cfg.tp} under sequence parallelism: each rank "
                              f"keeps 1/tp of its tokens between sub-layers.")
