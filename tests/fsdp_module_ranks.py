"""A small language model of its own classes, and the rank function that trains it through
:class:`~gpucourse.parallel.FullyShardedDataParallel` beside one device (``test_fsdp_module.py``).

The model is awkward on purpose: Linear and Embedding classes that are not torch's, sizes no rank count divides
(13, 10, 7, 4), a matrix held by the model itself (positions), the output head tied to the embedding (one
parameter held by two submodules), and a layer never called (no gradient).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, WIDTH, HIDDEN, T, BATCH, STEPS, LR = 13, 10, 7, 4, 6, 3, 0.5


class Linear(torch.nn.Module):
    """x @ weightᵀ + bias, the input cast to the weight's dtype (a bf16 product plus an fp32 bias is fp32)."""

    def __init__(self, n_in: int, n_out: int, bias: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) * n_in ** -0.5)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1) if bias else None

    def forward(self, x):
        y = x.to(self.weight.dtype) @ self.weight.t()
        return y if self.bias is None else y + self.bias


class Embedding(torch.nn.Module):
    def __init__(self, n: int, width: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(n, width) * 0.5)

    def forward(self, idx):
        return self.table[idx]


class Norm(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.gain


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc, self.proj = Norm(WIDTH), Linear(WIDTH, HIDDEN), Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(T, WIDTH) * 0.1)  # read in the model's own forward
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.norm = Norm(WIDTH)
        self.unused = Linear(3, 5)
        self.head = Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.table  # tied

    def forward(self, idx):
        x = self.embed(idx) + self.pos
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


def make_model(rank: int = 0, checkpointed: bool = False, frozen: bool = False) -> TinyLM:
    """``frozen``: the first block's first matrix is not trained (its unit still gathers it for both passes)."""
    torch.manual_seed(0)
    model = TinyLM(checkpointed)
    model.blocks[0].fc.weight.requires_grad_(not frozen)
    if rank:  # the others start elsewhere: the wrapper must copy rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def batches():
    data = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, T), generator=data), torch.randint(0, VOCAB, (BATCH, T), generator=data))
            for _ in range(STEPS)]


def loss_of(logits, y):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def one_device(dtype=None, parts: int = 1, tied_once: bool = False, frozen: bool = False) -> list[dict]:
    """The whole batch on one device, plain SGD: the weights after each step. With ``dtype`` each submodule casts
    its matrices to it for its forward (a tied one at each use, as the wrapper gathers it); the masters and their
    gradients stay fp32. With ``parts`` the batch goes through in that many parts, their gradients added in fp32
    and divided by ``parts``: a bf16 gradient of the whole batch, rounded once, differs from the parts' gradients,
    each rounded, by about 2⁻⁸ of itself, far more than the wrapper's own error. ``tied_once``: the tied table is
    cast once for both its uses, as a unit holding it gathers it once, so its two gradients add in ``dtype``."""
    model = make_model(frozen=frozen)
    if dtype is not None:
        def cast(m, args):
            m.__dict__.update({n: p.to(dtype) for n, p in m._parameters.items()
                               if p is not None and p.dim() >= 2 and n not in m.__dict__})
            if tied_once and m is model:
                model.embed.__dict__["table"] = model.head.__dict__["weight"] = model.embed.table.to(dtype)

        def uncast(m, args, out):
            for n, p in m._parameters.items():
                if p is not None and p.dim() >= 2:
                    m.__dict__.pop(n, None)

        for m in model.modules():
            m.register_forward_pre_hook(cast)
            m.register_forward_hook(uncast)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for x, y in batches():
        for x_part, y_part in zip(x.chunk(parts), y.chunk(parts)):
            loss_of(model(x_part), y_part).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= parts
        opt.step()
        opt.zero_grad()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


def blocks(name: str, m: torch.nn.Module) -> bool:
    """Units as FSDP2 users wrap them: each block gathers its matrices in one message (the model keeps the rest)."""
    return isinstance(m, Block)


def sharded_run(dtype=None, shard=None, record=None, checkpointed: bool = False, unit=None,
                frozen: bool = False) -> dict:
    """The same steps through FullyShardedDataParallel, each rank on its share of every batch (after a forward
    without gradients, which must change nothing)."""
    from gpucourse import comm
    from gpucourse.parallel import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(rank, checkpointed, frozen)
    fsdp = FullyShardedDataParallel(model, compute_dtype=dtype, unit=unit, **({"shard": shard} if shard else {}))
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR)
    out = {"after": [], "shards": {n: (tuple(p.shape), p.dtype) for n, p in fsdp.module.named_parameters()},
           "replicated": len(fsdp.replicated), "units": sorted(sorted(s.name for s in u.params) for u in fsdp.units)}
    with torch.no_grad():
        fsdp(batches()[0][0])
    if record is not None:
        comm.set_recorder(record)
    for step, (x, y) in enumerate(batches()):
        if record is not None:
            record.step = step
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            logits = fsdp(x)
        if step == 0:
            # What autograd keeps for backward: the whole matrices (their shapes or transposes) hold no memory.
            shapes = {s for p in (model.embed.table, model.pos, model.blocks[0].fc.weight, model.blocks[0].proj.weight)
                      for s in (tuple(fsdp.sharded[id(p)].shape), tuple(fsdp.sharded[id(p)].shape)[::-1])}
            weights = [t for t in saved if tuple(t.shape) in shapes]
            out["saved_weights"] = len(weights)
            out["saved_weight_bytes"] = sum(t.untyped_storage().nbytes() for t in weights)
            out["attribute_is_shard"] = model.blocks[0].fc.weight is dict(model.named_parameters())["blocks.0.fc.weight"]
        loss_of(logits, y).backward()
        fsdp.finish_gradient_synchronization()
        if step == 0:
            out["grads"] = {n: None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype)
                            for n, p in fsdp.module.named_parameters()}
        opt.step()
        opt.zero_grad()
        if record is not None:
            comm.set_recorder(None)  # gathering the weights to compare is not the step's traffic
        out["after"].append(fsdp.gather_full_params())
        if record is not None:
            comm.set_recorder(record)
    comm.set_recorder(None)
    return out


def fsdp_cases() -> dict:
    """Every case on this launch's ranks, with warnings as errors: the weights after each step against one device
    (fp32, fp32 again, everything sharded, bf16 and fp16 compute), what each rank holds, and the bytes of a step."""
    from gpucourse.measure import Recorder

    warnings.simplefilter("error")
    recs = {case: Recorder(dist.get_rank(), torch.device("cpu"), enabled=False)
            for case in ("fp32", "bf16", "blocks", "whole")}
    runs = {"fp32": sharded_run(record=recs["fp32"]), "again": sharded_run(),
            "all": sharded_run(shard=lambda n, p: True), "checkpointed": sharded_run(checkpointed=True),
            "bf16": sharded_run(torch.bfloat16, record=recs["bf16"]), "fp16": sharded_run(torch.float16),
            "blocks": sharded_run(unit=blocks, record=recs["blocks"]),
            "blocks_checkpointed": sharded_run(unit=blocks, checkpointed=True),
            "blocks_bf16": sharded_run(torch.bfloat16, unit=blocks),
            "blocks_frozen": sharded_run(unit=blocks, frozen=True),
            "whole": sharded_run(unit=lambda name, m: False, shard=lambda n, p: True, record=recs["whole"])}
    world = dist.get_world_size()
    refs = {None: one_device(), torch.bfloat16: one_device(torch.bfloat16, world),
            torch.float16: one_device(torch.float16, world), "tied once": one_device(torch.bfloat16, world, True),
            "frozen": one_device(frozen=True)}
    dtypes = {"fp32": None, "again": None, "all": None, "checkpointed": None, "bf16": torch.bfloat16,
              "fp16": torch.float16, "blocks": None, "blocks_checkpointed": None, "blocks_bf16": "tied once", "blocks_frozen": "frozen",
              "whole": None}
    result = {}
    for case, run in runs.items():
        ref = refs[dtypes[case]]
        result[case] = {
            "names": [sorted(step) for step in run["after"]] == [sorted(step) for step in ref],
            "diff": max((run["after"][i][n] - want).abs().max().item() for i, step in enumerate(ref)
                        for n, want in step.items()),
            "equal": all(torch.equal(run["after"][i][n], want) for i, step in enumerate(ref) for n, want in step.items()),
            **{k: v for k, v in run.items() if k != "after"}}
    result["again"]["same_bits"] = all(torch.equal(runs["again"]["after"][-1][n], v)
                                       for n, v in runs["fp32"]["after"][-1].items())
    for case, rec in recs.items():
        result[case]["comm"] = {op: totals for (step, op), totals in rec.comm.items() if step == 1}
    return result
