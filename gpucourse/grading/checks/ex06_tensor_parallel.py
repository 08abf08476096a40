"""Checks of exercise 6: column- and row-parallel linear layers against the whole layer, forward and backward."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core import Exercise, Fail, describe_mismatch

EXERCISE = Exercise("ex06_tensor_parallel", "Tensor-parallel linear layers", "notebooks/05_tensor_parallelism.ipynb")

BATCH = 3


def _linear(ctx, fan_in: int, fan_out: int, key: str) -> nn.Linear:
    g = ctx.generator(key)  # the same layer on every rank
    layer = nn.Linear(fan_in, fan_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    return layer


def _data(ctx, *shape, key: str) -> torch.Tensor:
    return torch.randn(*shape, generator=ctx.generator(key))


def _reference(full: nn.Linear, x: torch.Tensor, probe: torch.Tensor) -> dict:
    w = full.weight.detach().clone().requires_grad_(True)
    b = full.bias.detach().clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    y = F.linear(x, w, b)
    (y * probe).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad}


def _expect(what: str, got, want, known_wrong=()) -> None:
    """Fail unless got == want; ``known_wrong`` lists (plausible wrong value, the sentence that explains it)."""
    problem = describe_mismatch(what, got, want, 1e-5, 1e-4)
    if problem:
        for value, sentence in known_wrong:
            if torch.is_tensor(got) and got.shape == value.shape and torch.allclose(got, value, atol=1e-5,
                                                                                    rtol=1e-4):
                problem += f"; {sentence}"
                break
        raise Fail(problem)


def _column(ctx, fan_in=4, fan_out=6):
    full = _linear(ctx, fan_in, fan_out, "column")
    x, probe = _data(ctx, BATCH, fan_in, key="x"), _data(ctx, BATCH, fan_out, key="probe")
    ref = _reference(full, x, probe)
    layer = ctx.load().ColumnParallelLinear(full)
    mine = x.clone().requires_grad_(True)
    y = layer(mine)
    if not torch.equal(mine.detach(), x):
        raise Fail(f"rank {ctx.rank}: the layer's forward changed its input")
    n, r = ctx.world_size, ctx.rank
    return full, x, probe, ref, layer, mine, y, n, r


@EXERCISE.check("column-parallel forward", points=2, world_size=2, hint=(
    "Rank r keeps rows r*out/n to (r+1)*out/n of the weight and of the bias (weight.chunk(n, dim=0)[r]) as "
    "new Parameters. Its forward is an ordinary linear layer on that slice: the whole input in, this rank's "
    "slice of the output features out, no communication needed."))
def column_forward(ctx):
    full, x, probe, ref, layer, mine, y, n, r = _column(ctx)
    _expect(f"rank {r}: the output", y, ref["y"].chunk(n, dim=-1)[r])


@EXERCISE.check("column-parallel backward", points=2, world_size=2, hint=(
    "Every rank's slice of the output depends on the whole input, so each rank's backward gives only its "
    "part of dL/dx; the whole gradient is their sum. Put an autograd Function in front of the layer that "
    "is the identity forward and all-reduces the gradient backward (Megatron's f). The weight and bias "
    "gradients need no communication: they are already this rank's slice."))
def column_backward(ctx):
    full, x, probe, ref, layer, mine, y, n, r = _column(ctx)
    (y * probe.chunk(n, dim=-1)[r]).sum().backward()
    _expect(f"rank {r}: the weight's gradient", layer.weight.grad, ref["dw"].chunk(n, dim=0)[r])
    _expect(f"rank {r}: the bias's gradient", layer.bias.grad, ref["db"].chunk(n, dim=0)[r])
    partial = probe.chunk(n, dim=-1)[r] @ full.weight.detach().chunk(n, dim=0)[r]
    _expect(f"rank {r}: the input's gradient", mine.grad, ref["dx"],
            [(partial, "it is this rank's own part of the gradient, not the sum over ranks")])


def _row(ctx, fan_in=6, fan_out=4):
    full = _linear(ctx, fan_in, fan_out, "row")
    x, probe = _data(ctx, BATCH, fan_in, key="x"), _data(ctx, BATCH, fan_out, key="probe")
    ref = _reference(full, x, probe)
    n, r = ctx.world_size, ctx.rank
    layer = ctx.load().RowParallelLinear(full)
    piece = x.chunk(n, dim=-1)[r].clone()
    mine = piece.clone().requires_grad_(True)
    y = layer(mine)
    if not torch.equal(mine.detach(), piece):
        raise Fail(f"rank {r}: the layer's forward changed its input")
    return full, x, probe, ref, layer, mine, y, n, r


@EXERCISE.check("row-parallel forward", points=2, world_size=2, hint=(
    "Rank r multiplies its slice of the input by its columns of the weight: that is one part of a sum, and "
    "the output is the sum of all ranks' parts. Add them with an all-reduce in the forward (Megatron's g), "
    "then add the bias — once, after the sum, or it is counted n times."))
def row_forward(ctx):
    full, x, probe, ref, layer, mine, y, n, r = _row(ctx)
    w = full.weight.detach().chunk(n, dim=1)[r]
    b = full.bias.detach()
    partial = x.chunk(n, dim=-1)[r] @ w.T
    _expect(f"rank {r}: the output", y, ref["y"], [
        (partial + b, "it is only this rank's partial product: the ranks' parts were never summed"),
        (ref["y"] + (n - 1) * b, f"the bias is in it {n} times: it was added before the sum")])


@EXERCISE.check("row-parallel backward", points=1, world_size=2, hint=(
    "The forward's all-reduce hands every rank the same output, so its backward hands every rank the same "
    "gradient unchanged: the identity. Summing it again over ranks multiplies the gradients by n."))
def row_backward(ctx):
    full, x, probe, ref, layer, mine, y, n, r = _row(ctx)
    (y * probe).sum().backward()
    twice = f"it is {n} times too large: the gradient was summed over ranks in backward"
    _expect(f"rank {r}: the weight's gradient", layer.weight.grad, ref["dw"].chunk(n, dim=1)[r],
            [(n * ref["dw"].chunk(n, dim=1)[r], twice)])
    _expect(f"rank {r}: the bias's gradient", layer.bias.grad, ref["db"])
    _expect(f"rank {r}: the input's gradient", mine.grad, ref["dx"].chunk(n, dim=-1)[r],
            [(n * ref["dx"].chunk(n, dim=-1)[r], twice)])


def _mlp(ctx):
    """Column-parallel fc, GELU on the local slice, row-parallel proj: the same as the whole MLP."""
    fc, proj = _linear(ctx, 4, 6, "fc"), _linear(ctx, 6, 4, "proj")
    x, probe = _data(ctx, BATCH, 4, key="x"), _data(ctx, BATCH, 4, key="probe")
    xf = x.clone().requires_grad_(True)
    wf = [t.detach().clone().requires_grad_(True) for t in (fc.weight, fc.bias, proj.weight, proj.bias)]
    yf = F.linear(F.gelu(F.linear(xf, wf[0], wf[1])), wf[2], wf[3])
    (yf * probe).sum().backward()
    module = ctx.load()
    col, row = module.ColumnParallelLinear(fc), module.RowParallelLinear(proj)
    xm = x.clone().requires_grad_(True)
    y = row(F.gelu(col(xm)))
    n, r = ctx.world_size, ctx.rank
    _expect(f"rank {r}: the MLP's output", y, yf.detach())
    (y * probe).sum().backward()
    _expect(f"rank {r}: the MLP's input gradient", xm.grad, xf.grad)
    _expect(f"rank {r}: fc's weight gradient", col.weight.grad, wf[0].grad.chunk(n, dim=0)[r])
    _expect(f"rank {r}: proj's weight gradient", row.weight.grad, wf[2].grad.chunk(n, dim=1)[r])
    _expect(f"rank {r}: proj's bias gradient", row.bias.grad, wf[3].grad)


@EXERCISE.check("column then row is the whole MLP (3 ranks)", points=2, world_size=3, hint=(
    "A column-parallel layer's sliced output is exactly the sliced input a row-parallel layer wants, and "
    "an element-wise GELU in between works on the slice: one all-reduce forward, one backward, for the "
    "whole MLP. Slice with chunk(n) along the right dimension for n = 3 too."))
def mlp_three(ctx):
    _mlp(ctx)


@EXERCISE.check("one rank", points=1, world_size=1, hint=(
    "With one rank each slice is the whole weight and every all-reduce leaves its tensor as it is: the "
    "layers must then behave exactly like nn.Linear."))
def one_rank(ctx):
    _mlp(ctx)
