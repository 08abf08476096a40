"""Rank functions the launcher tests start, importable so that spawn can start them too.

Run as a script (``python -m rankfns MODE ...``, tests/ on PYTHONPATH) it is the
launching process of the tests that need one of their own: two launchers at
once, a Ctrl-C, and ``launch`` in place under torchrun.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpucourse import current, launch, report
from procs import alive, identity, read_identities, wait_for


def note_identity(folder) -> None:
    """Leave this rank's process identity in ``folder`` for the test to check later."""
    path = Path(folder) / f"rank-{current().rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(identity()))
    path.with_suffix(".tmp").rename(path)


def whoami():
    ctx = current()
    return ctx.rank, ctx.world_size, identity()


def all_reduce_ones(n: int):
    """Sum a tensor of ``n`` values rank+1 over the group; every value must be the same sum."""
    t = torch.full((n,), float(current().rank + 1))
    dist.all_reduce(t)
    return float(t.min()), float(t.max())


def fail_on(bad: int, folder):
    note_identity(folder)
    dist.barrier()  # every rank has left its identity before one fails
    if current().rank == bad:
        raise ValueError(f"rank {bad} was told to fail")
    dist.barrier()  # the others wait here for a rank that never comes


def exit_on(bad: int, code: int, folder):
    note_identity(folder)
    dist.barrier()
    if current().rank == bad:
        sys.exit(code)
    dist.barrier()


def os_exit_on(bad: int, code: int, folder):
    note_identity(folder)
    dist.barrier()
    if current().rank == bad:
        os._exit(code)
    dist.barrier()


def os_exit_then_late_error(folder):
    """Rank 2 ends with ``os._exit``; rank 1 raises only after the agent, having seen rank 2 go, has stopped rank 0.

    What a peer busy in C++ when the agent's SIGTERM comes can do (about once in 300 launches of
    ``os_exit_on``): its error then finds ranks 0 and 2 both gone without a note, though only rank 2 died first.
    """
    rank = current().rank
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlives the agent's teardown
    note_identity(folder)
    dist.barrier()
    if rank == 2:
        os._exit(7)
    if rank == 1:
        wait_for(lambda: not alive(read_identities(Path(folder))[0]), 30, "the agent to stop rank 0")
        raise RuntimeError("Connection closed by peer")
    time.sleep(120)  # rank 0: until the agent stops it


def skip_barrier(skipper: int, folder):
    """Every rank but ``skipper`` enters a barrier: the classic hang."""
    note_identity(folder)
    if current().rank != skipper:
        dist.barrier()
    return current().rank


def chatter():
    rank = current().rank
    print(f"out line of rank {rank}")
    print(f"err line of rank {rank}", file=sys.stderr)
    report({"hello": rank, "payload": [rank] * 3})
    return rank


def block(folder):
    """Rank 1 spins in Python, rank 0 waits in a barrier for it: only a signal ends this."""
    note_identity(folder)
    if current().rank == 1:
        while True:
            time.sleep(0.01)
    dist.barrier()


def _repeat(folder: str, times: int = 3) -> None:
    """Launch ``times`` times in a row, starting together with the other launcher in ``folder``."""
    Path(folder, f"ready-{os.getpid()}").touch()
    wait_for(lambda: len(list(Path(folder).glob("ready-*"))) == 2, 60, "the other launcher")
    for _ in range(times):
        values = launch(whoami, world_size=2, timeout=60, quiet=True)
        assert [v[:2] for v in values] == [(0, 2), (1, 2)], values
    print("launches ok")


def _block(folder: str) -> None:
    try:
        launch(block, folder, world_size=2, timeout=120, quiet=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt reached the caller", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit("the blocked launch returned")


def _in_place(folder: str) -> None:
    """Under torchrun: ``launch`` runs here as this rank and returns every rank's value."""
    values = launch(whoami, world_size=int(os.environ["WORLD_SIZE"]), timeout=60)
    out = {"rank": int(os.environ["RANK"]), "identity": identity(), "values": values,
           "children": len(multiprocessing.active_children())}
    Path(folder, f"in-place-{os.environ['RANK']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    import rankfns  # the functions must come from the module `rankfns`, not from `__main__`

    mode, arg = sys.argv[1], sys.argv[2]
    {"repeat": rankfns._repeat, "block": rankfns._block, "in-place": rankfns._in_place}[mode](arg)


def train_several(cfg_dicts: list[dict], export_paths: list[str]) -> list[dict]:
    """Train each config in turn in this one launch (every one of the same world size): one output per config."""
    from gpucourse.train import train_worker

    return [train_worker(cfg, path) for cfg, path in zip(cfg_dicts, export_paths)]


def attention_against_full(cases: int, seed: int) -> list[dict]:
    """Ring, all-gather and Ulysses attention against full causal attention, on random shapes and token orders.

    Every rank draws the same whole q, k, v and the same random assignment of positions to ranks, runs each
    context-parallel algorithm on its own tokens, and compares its output and the gradients of its q, k, v
    with those of full attention (autograd on the whole tensors), restricted to its tokens.
    """
    import math

    import torch.nn.functional as F

    from gpucourse.parallel.context_parallel import RingAttention, allgather_attention, ulysses_attention

    group, n, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    worst = []
    for _ in range(cases):
        B, H, d = (int(torch.randint(1, 4, (), generator=gen)), n * int(torch.randint(1, 3, (), generator=gen)),
                   int(torch.randint(2, 9, (), generator=gen)))
        T = n * int(torch.randint(1, 6, (), generator=gen))
        q, k, v = (torch.randn(B, H, T, d, generator=gen, dtype=torch.float64) for _ in range(3))
        grad = torch.randn(B, H, T, d, generator=gen, dtype=torch.float64)
        every = list(torch.randperm(T, generator=gen).chunk(n))  # any tokens on any rank, in any order
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
        full = F.scaled_dot_product_attention(*whole, attn_mask=mask)
        full.backward(grad)
        mine = every[rank]
        for name, attend in (("ring", RingAttention.apply), ("allgather", allgather_attention),
                             ("ulysses", ulysses_attention)):
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            out = attend(*local, group, every)
            out.backward(grad[:, :, mine])
            diffs = [(out - full[:, :, mine]).abs().max().item()]
            diffs += [(t.grad - w.grad[:, :, mine]).abs().max().item() for t, w in zip(local, whole)]
            worst.append({"algo": name, "shape": [B, H, T, d], "diff": max(diffs),
                          "finite": all(math.isfinite(x) for x in diffs)})
    return worst


def dispatch_against_local(cases: int, seed: int) -> list[dict]:
    """Expert-parallel dispatch against every expert on one device, on random and on lopsided routing.

    Every rank builds the same MoE layer and draws the same random inputs; each
    case fixes the router's scores (random; every token to expert 0, so the other
    ranks' experts get nothing; every token to the last rank's experts; skewed), and
    each rank runs its own tokens through the expert-parallel layer (ep = every
    rank) and through the whole layer, forward and backward, comparing the output,
    the input's gradient and the gradients of the experts it holds.
    """
    import copy

    from gpucourse.model import GPTConfig, MoE
    from gpucourse.parallel.expert_parallel import apply_expert_parallel

    class Fixed(torch.nn.Module):
        """A router whose scores are given: (tokens, E)."""

        def __init__(self, scores):
            super().__init__()
            self.scores = scores

        def forward(self, x):
            return self.scores + 0 * x.sum()

    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    worst = []
    for case in range(cases):
        E = n * int(torch.randint(1, 3, (), generator=gen))
        k = int(torch.randint(1, min(E, 3) + 1, (), generator=gen))
        tokens = int(torch.randint(1, 7, (), generator=gen))  # per rank
        cfg = GPTConfig(n_embd=8, moe_experts=E, moe_top_k=k)
        torch.manual_seed(seed + case)
        whole = MoE(cfg).double()
        x = torch.randn(n, 1, tokens, 8, generator=gen, dtype=torch.float64)
        kind = ["random", "all to expert 0", "all to the last rank", "skewed"][case % 4]
        scores = torch.randn(n, tokens, E, generator=gen, dtype=torch.float64)
        if kind == "all to expert 0":
            scores[..., 0] += 100
        elif kind == "all to the last rank":
            scores[..., E - E // n:] += 100
        elif kind == "skewed":
            scores[..., 1 % E] += 3
        ep = copy.deepcopy(whole)
        holder = torch.nn.Module()  # apply_expert_parallel works on a model's blocks: a one-block model
        holder.blocks = torch.nn.ModuleList([torch.nn.Module()])
        holder.blocks[0].mlp = ep
        apply_expert_parallel(holder, dist.group.WORLD, None)
        whole.router, ep.router = Fixed(scores[rank]), Fixed(scores[rank])
        mine = x[rank].clone().requires_grad_()
        theirs = x[rank].clone().requires_grad_()
        probe = torch.randn(x[rank].shape, generator=gen, dtype=torch.float64)
        (whole(mine) * probe).sum().backward()
        (ep(theirs) * probe).sum().backward()
        diffs = [(ep(theirs.detach()) - whole(mine.detach())).abs().max().item(),
                 (theirs.grad - mine.grad).abs().max().item()]
        # Each expert's gradient, summed over ranks on one device, against the holder's (summed by the ep group).
        for name, p in whole.experts.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            held = dict(ep.experts.named_parameters()).get(name)
            if held is not None:
                diffs.append((held.grad - g).abs().max().item())
        worst.append({"kind": kind, "E": E, "k": k, "tokens": tokens, "diff": max(diffs),
                      "held": sorted(ep.experts.keys())})
    return worst


def third_party_loop(kind: str, steps: int = 6) -> dict:
    """A training loop that is not the course's — its own model and loss, SGD with momentum, a second parameter
    group without weight decay, a learning-rate scheduler, gradient clipping — through one data-parallel component
    (``kind``), each rank on its share of every batch. ``"single"``: the same loop on one device, no process group.
    Returns the mean loss of each step over the whole batch, the final weights and (sharded) the state each rank
    holds."""
    import torch.nn.functional as F

    from gpucourse.parallel.data_parallel import DataParallel
    from gpucourse.parallel.data_parallel_buckets import DataParallelBuckets
    from gpucourse.parallel.sharded_optimizer import ShardedGradientsOptimizer, ShardedOptimizer
    from gpucourse.parallel.zero import FlatShardedOptimizer

    rank, world = (0, 1) if kind == "single" else (dist.get_rank(), dist.get_world_size())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if rank:  # every rank but 0 starts elsewhere: the component must copy rank 0's weights
        torch.nn.init.normal_(model[0].weight)
    wrap = {"single": lambda m: m, "dp": DataParallel, "sharded": DataParallel, "accumulated": DataParallelBuckets,
            "buckets": lambda m: DataParallelBuckets(m, bucket_mb=0.0005),
            "one-bucket": DataParallelBuckets, "sharded-gradients": lambda m: m, "flat-1": lambda m: m,
            "flat-2": lambda m: m}[kind]
    net = wrap(model)
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.05},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    sharded = {"sharded": ShardedOptimizer, "sharded-gradients": ShardedGradientsOptimizer,
               "flat-1": functools.partial(FlatShardedOptimizer, stage=1),
               "flat-2": functools.partial(FlatShardedOptimizer, stage=2)}.get(kind)
    opt = (sharded(groups, torch.optim.SGD, lr=0.2, momentum=0.9) if sharded
           else torch.optim.SGD(groups, lr=0.2, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        if kind == "accumulated":  # two microbatches, the first backward only accumulating
            with net.no_sync():
                first = F.smooth_l1_loss(net(x[:4]), y[:4]) / 2
                first.backward()
            second = F.smooth_l1_loss(net(x[4:]), y[4:]) / 2
            second.backward()
            loss = first.detach() + second.detach()
        elif kind == "sharded-gradients":  # two microbatches too: each backward reduces, the owner accumulates
            losses_ = [F.smooth_l1_loss(net(x[i:i + 4]), y[i:i + 4]) / 2 for i in (0, 4)]
            for part in losses_:
                part.backward()
            loss = sum(part.detach() for part in losses_)
            out_grads = [p.grad is None for p in model.parameters()]
            held = opt.gradient_bytes()
        else:
            loss = F.smooth_l1_loss(net(x), y)
            loss.backward()
        if kind in ("flat-1", "flat-2"):
            opt.reduce_gradients()  # averaged into each rank's shard of the flat buffers
        elif kind not in ("single", "sharded-gradients"):
            net.finish_gradient_synchronization()
        if kind != "single":
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        if kind in ("sharded-gradients", "flat-1", "flat-2"):
            opt.clip_grad_norm_(0.25)  # the norm is every rank's shares together
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)  # below every step's norm: it clips
        opt.step()
        sched.step()
        losses.append(loss.item() / world)
    out = {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "lr": sched.get_last_lr()}
    if kind == "sharded-gradients":
        out["freed"], out["gradient_bytes"] = out_grads, held
    if sharded:
        out["held"] = sorted(len(g["params"]) for g in opt.inner.param_groups)
        out["shard_sizes"] = [sum(p.numel() for p in g["params"]) for g in opt.inner.param_groups]
        saved = list(opt.inner.state.values())
        fresh = sharded(groups, torch.optim.SGD, lr=0.2, momentum=0.9)  # (a flat one takes the parameters over)
        fresh.load_state_dict(opt.state_dict())
        out["reloaded"] = len(saved) > 0 and all(
            torch.equal(new["momentum_buffer"], old["momentum_buffer"])
            for new, old in zip(fresh.inner.state.values(), saved))
        out["lr_reloaded"] = [g["lr"] for g in fresh.param_groups]
    return out


def third_party_loops(kinds: list[str], steps: int = 6) -> dict:
    """:func:`third_party_loop` for each kind in turn, in one launch."""
    return {kind: third_party_loop(kind, steps) for kind in kinds}


def exit_zero_on(bad: int, folder):
    """Rank ``bad`` ends its process with status 0 and no result; the others return."""
    note_identity(folder)
    if current().rank == bad:
        os._exit(0)
    return current().rank


def ends_by_signal(how: str) -> None:
    """Rank 0 ends its own process: ``abort`` (what a C++ library does on a fatal error) or ``term`` (a kill of
    itself); the others wait in a barrier."""
    if current().rank == 0:
        os.abort() if how == "abort" else os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # not reached where the signal ends the process, as it must
    dist.barrier()
