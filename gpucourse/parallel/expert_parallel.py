"""Expert parallelism: a mixture of experts' experts spread over ranks, the tokens sent to them by all-to-all.

A mixture-of-experts block (``model.MoE``) holds E expert MLPs; each token uses
only top_k of them. Replicated on every data-parallel rank, the experts cost E
times a dense MLP's memory for top_k times its compute. Expert parallelism
(GShard, Switch, DeepSpeed-MoE, Megatron-Core) carves ``ep`` out of the ``dp``
ranks: each group of ep adjacent data-parallel ranks shares one copy of the
experts, E/ep on each rank, and the tokens travel to their experts instead:

1. **route** — every rank runs the (replicated) router on its own tokens and
   sorts its token choices by expert;
2. **counts** — an all-to-all of E integers: rank j learns how many rows each
   rank will send to each of its experts (it must size its receive buffer, and
   the split sizes of step 3 must agree on both sides);
3. **dispatch** — an all-to-all with uneven splits sends each row to the rank
   holding its expert (rows in expert order, so each destination's rows are one
   contiguous piece);
4. **compute** — each rank runs its E/ep experts on the rows it received (from
   every rank of its group);
5. **combine** — the reverse all-to-all brings every row's output home, where it
   is weighted by the router and summed into its token.

Backward runs the same in reverse: each all-to-all's backward is the all-to-all
with the splits swapped (:class:`AllToAll`).

**Gradients.** The non-expert weights (attention, norms, router) are replicated
over all dp ranks and averaged over dp as usual. An expert's weights live on one
rank of each ep group; its gradient there already sums the contributions of the
whole group's tokens, so its replicas — the same expert on the other dp/ep
groups, the *expert-data-parallel* group — sum their gradients and divide by dp
(not dp/ep): the mean over every dp rank's tokens, as on one device. Each expert
parameter carries that group as ``expert_group``, which the data-parallel
strategies read.

**Communication per MoE block, per microbatch, per rank** (bytes as counted in
``gpucourse.comm``, exactly, for uneven splits): counts: E · 8 bytes payload;
dispatch and combine: payload r · C · 4 bytes each, of which the rows for other
ranks' experts are sent — r the token choices this rank kept, C the width,
fp32. Backward moves the same rows again (not the counts). So a step sends
4 · C · 4 · (rows this rank's tokens send to other ranks' experts) bytes per
MoE block, plus the counts' (ep − 1)/ep · E · 8 per forward.

PyTorch core has no mixture-of-experts layer and no expert-parallel dispatch:
torchtitan and Megatron-Core each write their own, as this file does. Both
organise it the same way — a router, a "token dispatcher" object doing the
permutation and the all-to-alls (Megatron-Core's ``MoEAlltoAllTokenDispatcher``;
torchtitan's expert-parallel wrapper around its grouped experts), and grouped
GEMMs running all of a rank's experts in one kernel where this file loops over
them one by one.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..model import MoE, blocks_of
from ..readable import ConfigError


def expert_groups(mesh, ep: int) -> tuple:
    """This rank's (ep group, expert-data-parallel group): each dp group cut into dp/ep runs of ep adjacent ranks.

    Every rank creates every group, in the same order (``dist.new_group`` requires it) and keeps its own.
    """
    ranks = mesh.mesh  # the global rank at each (pp, dp, cp, tp) coordinate
    lines = ranks.movedim(1, -1).reshape(-1, ranks.shape[1]).tolist()  # every dp group's ranks
    me, mine = dist.get_rank(), {}
    for line in lines:
        for kind, groups in (("ep", [line[i:i + ep] for i in range(0, len(line), ep)]),
                             ("edp", [line[j::ep] for j in range(ep)])):
            for members in groups:
                group = dist.new_group(members)
                if me in members:
                    mine[kind] = group
    return mine["ep"], mine["edp"]


def apply_expert_parallel(module: nn.Module, ep_group, edp_group) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE block and send tokens to the others'; return ``module``.

    The experts kept keep their names (``experts.5`` stays ``experts.5``), so a
    state dict reads as the single-device model's, with the other ranks' experts missing.
    """
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for block in blocks_of(module):
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        per = moe.num_experts // ep
        mine = range(rank * per, (rank + 1) * per)
        moe.experts = nn.ModuleDict({str(e): moe.experts[e] for e in mine})
        for p in moe.experts.parameters():
            p.expert_group = edp_group  # averaged over these ranks (and divided by dp) by data parallelism
        moe.dispatch = functools.partial(dispatch, moe, ep_group)
    return module


class AllToAll(torch.autograd.Function):
    """Rows to ranks by uneven all-to-all; backward sends the gradients back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, name: str):
        ctx.splits, ctx.group, ctx.name = (out_splits, in_splits), group, name
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_uneven(out, x.contiguous(), out_splits, in_splits, group=group, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_uneven(back, grad.contiguous(), in_splits, out_splits, group=ctx.group,
                               name=f"{ctx.name} (backward)")
        return back, None, None, None, None


def dispatch(moe: MoE, group, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
             keep: torch.Tensor) -> torch.Tensor:
    """``MoE.dispatch`` across the ep group: the experts' weighted outputs for this rank's tokens ``x``."""
    ep = dist.get_world_size(group)
    E, k = moe.num_experts, chosen.shape[1]
    per = E // ep
    # 1. route: this rank's kept token choices, sorted by expert (stable: token order within an expert)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[keep.flatten()]
    expert, weight = chosen.flatten()[keep.flatten()], weights.flatten()[keep.flatten()]
    order = torch.argsort(expert, stable=True)
    token, expert, weight = token[order], expert[order], weight[order]
    # 2. counts: rows for each expert from here; afterwards recv_counts[i·per + e] = rows rank i sends my expert e
    send_counts = torch.bincount(expert, minlength=E)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts, group=group, name="moe counts")
    send_splits = send_counts.view(ep, per).sum(1).tolist()  # rows to each rank (.tolist() waits for them)
    recv_splits = recv_counts.view(ep, per).sum(1).tolist()
    # 3. dispatch: each row to the rank that holds its expert
    received = AllToAll.apply(x[token], recv_splits, send_splits, group, "moe dispatch")
    # 4. compute: received rows come by source rank, and by expert within each source
    which = torch.arange(per, device=x.device).repeat(ep).repeat_interleave(recv_counts)
    out = torch.zeros_like(received)
    for i, exp in enumerate(moe.experts.values()):  # an expert with no row still runs (on none): a zero gradient
        rows = (which == i).nonzero()[:, 0]
        out = out.index_add(0, rows, exp(received[rows]))
    # 5. combine: outputs home, weighted by the router, summed into their tokens
    back = AllToAll.apply(out, send_splits, recv_splits, group, "moe combine")
    return torch.zeros_like(x).index_add(0, token, back * weight[:, None])


def gather_experts(module: nn.Module, ep_group, state: dict) -> dict:
    """``state`` with every rank's experts in it, on every rank of ``ep_group`` (exporting: not training traffic)."""
    theirs = [None] * dist.get_world_size(ep_group)
    mine = {name: t.detach().cpu() for name, t in state.items() if ".experts." in name}
    dist.all_gather_object(theirs, mine, group=ep_group)
    device = next(iter(state.values())).device
    whole = dict(state)
    for part in theirs:
        whole.update({name: t.to(device) for name, t in part.items()})
    return whole


# --- how the engine applies it ---------------------------------------------------------------------------------------

def apply(model, mesh, cfg, built):
    """Each MoE block's balance loss weighted as its microbatch's loss (1 / microbatches); with ep > 1 each rank
    keeps E/ep experts of every MoE block and tokens travel to the others by all-to-all.
    What the engine needs later goes into ``built`` (``parallel.Built``). The experts are gathered after tensor-parallel shards are made whole, before
    pipeline stages are merged."""
    weight = 1 / (cfg.grad_accum * (cfg.microbatches if cfg.pp > 1 else 1))
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_weight = weight
    if cfg.ep == 1:
        return model
    ep_group, edp_group = expert_groups(mesh, cfg.ep)
    apply_expert_parallel(model, ep_group, edp_group)
    built.gathers.insert(len(built.gathers) - (cfg.pp > 1), functools.partial(gather_experts, model, ep_group))
    return model


# --- its rules -----------------------------------------------------------------------------------------------------

def check(cfg, mc, runnable: bool = True) -> None:
    """What a mixture of experts and expert parallelism refuse, one sentence each."""
    given = [f"moe_{n}" for n in ("top_k", "every", "capacity", "aux") if getattr(cfg, f"moe_{n}") is not None]
    if not isinstance(cfg.moe_experts, int) or isinstance(cfg.moe_experts, bool) or cfg.moe_experts < 0:
        raise ConfigError(f"moe_experts={cfg.moe_experts!r} must be a whole number of experts (0: none).")
    if not mc.moe_experts:
        if given:
            raise ConfigError(f"{given[0]} sets up a mixture of experts; give moe_experts (how many) with it.")
        if cfg.ep > 1:
            raise ConfigError(f"ep={cfg.ep} spreads the experts of a mixture of experts; give moe_experts "
                              f"with it.")
        return
    E, k = mc.moe_experts, mc.moe_top_k
    if E < 2:
        raise ConfigError(f"moe_experts={E}: a mixture needs at least 2 experts.")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E:
        raise ConfigError(f"moe_top_k={k!r} must be between 1 and the {E} experts.")
    if not isinstance(mc.moe_every, int) or not 1 <= mc.moe_every <= mc.n_layer:
        raise ConfigError(f"moe_every={mc.moe_every!r} must be between 1 (every block) and the "
                          f"{mc.n_layer} blocks.")
    if cfg.moe_capacity is not None and not cfg.moe_capacity > 0:
        raise ConfigError(f"moe_capacity={cfg.moe_capacity} must be a positive capacity factor "
                          f"(leave it out to drop no token).")
    if cfg.moe_aux is not None and cfg.moe_aux < 0:
        raise ConfigError(f"moe_aux={cfg.moe_aux} must be at least 0.")
    if cfg.ep > 1:
        if cfg.dp % cfg.ep:
            raise ConfigError(f"ep={cfg.ep} must divide dp={cfg.dp}: expert parallelism is carved out of "
                              f"the data-parallel ranks.")
        if E % cfg.ep:
            raise ConfigError(f"ep={cfg.ep} must divide moe_experts={E}: each rank holds E/ep experts.")
    if not runnable:
        return
    if cfg.cp > 1:
        raise ConfigError("a mixture of experts with cp > 1 is not written: its balance loss is computed over "
                          "whole sequences, which context parallelism cuts.")
    if cfg.sequence_parallel:
        raise ConfigError("a mixture of experts with sequence_parallel is not written: route whole sequences "
                          "(leave sequence_parallel off).")
    if cfg.recompute == "full":
        raise ConfigError("checkpoint_activations with a mixture of experts is not written: recomputing a "
                          "block would route its tokens, and count them, twice.")
    if cfg.precision == "fp16":
        raise ConfigError("fp16's loss scaling does not scale the experts' balance loss here; use bf16 or "
                          "fp32 with a mixture of experts.")
    if cfg.impl != "scratch":
        raise ConfigError(f"a mixture of experts runs from scratch in this build (impl='scratch'), not "
                          f"impl={cfg.impl!r}: PyTorch has no mixture-of-experts layer of its own.")
    if cfg.ep > 1 and cfg.zero == 3:
        raise ConfigError("ep > 1 with zero=3 is not written: use zero 1 or 2 (experts get shards of their "
                          "own), or ep=1.")
    if cfg.ep > 1 and cfg.bucket_mb is not None:
        raise ConfigError("bucket_mb with ep > 1 is not written: experts' gradients are averaged over a "
                          "group of their own.")
    if cfg.ep > 1 and (cfg.save or cfg.resume):
        raise ConfigError("checkpoints of expert-parallel runs are not written yet; save with ep=1.")
