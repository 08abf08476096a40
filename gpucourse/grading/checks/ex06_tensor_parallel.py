"""Checks of exercise 6: column- and row-parallel linear layers against the whole layer, forward and backward.

The learner's layers run in the sandbox under the probes of
``probes/ex06_tensor_parallel.py``, which build them from whole ``nn.Linear``
layers (with and without a bias) and report outputs, gradients and parameters;
the expected values (the whole layer, or the whole MLP, on one device) are
computed here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import contracts, generated
from ..core import Exercise, Fail, describe_mismatch, expect_close
from ..generated import DTYPES, Int, One, Space

EXERCISE = Exercise(
    "ex06_tensor_parallel", "Tensor-parallel linear layers", "notebooks/05_tensor_parallelism.ipynb",
    forbidden_names=("torch.distributed.tensor.parallel.parallelize_module",
                     "torch.distributed.tensor.parallel.ColwiseParallel",
                     "torch.distributed.tensor.parallel.RowwiseParallel",
                     "torch.distributed.tensor.parallel.api.parallelize_module",
                     "torch.distributed.tensor.parallel.style.ColwiseParallel",
                     "torch.distributed.tensor.parallel.style.RowwiseParallel"),
    refusal=("{op} is switched off in this exercise: cut the weights yourself and carry the communication in "
             "two torch.autograd.Functions"),
    concept=("a column-parallel layer splits a weight's output features, a row-parallel one its input features; the "
             "pair is equal to the whole layer with one all-reduce forward and one backward (f and g)"),
    section="§1 (one linear layer, split two ways) and §2 (f and g)")

BATCH = 3
COLUMN, ROW = "ColumnParallelLinear", "RowParallelLinear"
BY_HAND = (" A linear layer's backward written by hand must take what autograd hands it: an input of 1 to 4 "
           "dimensions (the bias's gradient sums the output gradient over all but the last; flatten with .reshape), "
           "an output gradient with any strides (stored transposed, or expanded with stride 0, where .view refuses), "
           "any dtype (compute in it: float64 in float64). F.linear on the slices gets all of it right.")

# What every caller of a layer relies on besides its values (gpucourse.grading.contracts): the input comes back bit
# for bit after forward and after backward, the output has the input's dtype, and the input may be a view with any
# strides (the probe "layers" hands the layer its first argument as it came).
FORWARD = {kind: contracts.Contract(f"{kind}.forward", ("x",), unchanged=("x",), dtype_of="x", strided=("x",))
           for kind in (COLUMN, ROW)}


def _whole(ctx, fan_in: int, fan_out: int, key, bias: bool = True) -> tuple:
    """A whole layer's (weight, bias), the same on every rank. The bias is far from zero (about 3), so that a
    bias counted n times, or not at all, shows on every element."""
    g = ctx.generator("layer", key)
    weight = torch.randn(fan_out, fan_in, generator=g)
    b = torch.randn(fan_out, generator=g) + 3.0 if bias else None
    return weight, b


def _data(ctx, *shape, key) -> torch.Tensor:
    return torch.randn(*shape, generator=ctx.generator("data", key))


def _reference(layers: list, x: torch.Tensor, grads_out: list) -> dict:
    """Whole layers ``(weight, bias)`` all applied to ``x``; backward of ``sum_i (y_i * grads_out[i])``."""
    x = x.clone().requires_grad_(True)
    params = [(w.clone().requires_grad_(True), None if b is None else b.clone().requires_grad_(True))
              for w, b in layers]
    ys = [F.linear(x, w, b) for w, b in params]
    sum((y * g).sum() for y, g in zip(ys, grads_out)).backward()
    return {"ys": [y.detach() for y in ys], "dx": x.grad,
            "dw": [w.grad for w, _ in params], "db": [None if b is None else b.grad for _, b in params]}


def _expect(what: str, got, want, known_wrong=()) -> None:
    """Fail unless got == want; ``known_wrong`` lists (plausible wrong value, the sentence that explains it)."""
    if want is None:
        if got is not None:
            raise Fail(f"{what} is a {type(got).__name__}, expected none")
        return
    problem = describe_mismatch(what, got, want, 1e-5, 1e-4)
    if problem:
        for value, sentence in known_wrong:
            if torch.is_tensor(got) and got.shape == value.shape and torch.allclose(got, value, atol=1e-5,
                                                                                    rtol=1e-4):
                problem += f"; {sentence}"
                break
        raise Fail(problem)


def _check_parameters(rank: int, n: int, kind: str, params: dict, weight: torch.Tensor, bias) -> None:
    """The layer holds exactly its slice of the weight (and of the bias, or the whole bias for a row layer), as
    parameters ``weight`` and ``bias`` of their own; none called bias when the whole layer has none."""
    what = f"rank {rank}'s {kind}"
    want = {"weight": weight}
    if bias is not None:
        want["bias"] = bias
    extra = sorted(set(params) - set(want))
    if "bias" in extra and bias is None:
        raise Fail(f"{what} has a parameter 'bias' of shape {tuple(params['bias']['value'].shape)}, made from a "
                   f"layer with no bias (nn.Linear(..., bias=False)): it must have none (self.bias = None)")
    if extra:
        shapes = ", ".join(f"'{k}' {tuple(params[k]['value'].shape)}" for k in extra)
        raise Fail(f"{what} has parameters besides its slice of the layer: {shapes}; it must keep only this "
                   f"rank's slice (a whole layer kept as a submodule keeps its whole weight on every rank)")
    for name, value in want.items():
        if name not in params:
            raise Fail(f"{what} has no parameter '{name}' (it keeps its slice as nn.Parameters self.weight"
                       f"{' and self.bias' if bias is not None else ''})")
        _expect(f"{what}'s {name}", params[name]["value"], value)
        if n > 1 and params[name]["storage_bytes"] > params[name]["bytes"]:
            raise Fail(f"{what}'s {name} is a view into a storage of {params[name]['storage_bytes']} bytes, for "
                       f"{params[name]['bytes']} bytes of its own: it keeps the whole layer's {name} alive on "
                       f"every rank; .clone() the slice")


def _check_untouched(rank: int, report: dict, whole: list) -> None:
    """The whole layers the layer was made from are as they were, and got no gradient."""
    for (w, b), after in zip(whole, report["whole_after"]):
        if not torch.equal(after["weight"], w) or (b is not None and not torch.equal(after["bias"], b)):
            raise Fail(f"rank {rank}: making or running the layer changed the whole layer it was made from; "
                       f"copy its slice, and leave the nn.Linear passed in as it was")
        if after["weight_grad"]:
            raise Fail(f"rank {rank}: the whole layer's weight got a gradient: the layer computed with the whole "
                       f"weight, not with a slice of its own")


def _comm_during(outcome, span) -> list:
    t0, t1 = span
    return [c for c in outcome.comm if t0 <= c["t"] <= t1]


def _run_column(ctx, cases: list, key, x_requires_grad: bool = True, backward: bool = True) -> tuple:
    """Every rank's column layers, one per whole layer of ``cases``, all on the same input; backward of
    each rank's slice of the output gradients. Their Outcomes, the input, the rank's gradients, the reference."""
    n = ctx.world_size
    x = _data(ctx, BATCH, cases[0][0].shape[1], key=(key, "x"))
    probes = [_data(ctx, BATCH, w.shape[0], key=(key, "probe", i)) for i, (w, _) in enumerate(cases)]
    ref = _reference(cases, x, probes)
    args = [(x, COLUMN, cases, [p.chunk(n, dim=-1)[r] for p in probes], x_requires_grad, backward)
            for r in range(n)]
    return ctx.probe_all("layers", args), x, probes, ref


@EXERCISE.check("column-parallel forward", points=2, world_size=2, hint=(
    "Rank r keeps rows r*out/n to (r+1)*out/n of the weight and of the bias (weight.chunk(n, dim=0)[r], "
    ".clone()d, so the whole weight can be freed) as new Parameters, or no bias at all when the layer has "
    "none (nn.Linear(..., bias=False)). Its forward is an ordinary linear layer on that slice: the whole input "
    "in, this rank's slice of the output features out, no communication needed, the input left as it was. The "
    "whole weight may be stored transposed, where .view of it refuses: cut it with chunk or narrow."))
def column_forward(ctx):
    n = ctx.world_size
    for bias in (True, False):
        cases = [_whole(ctx, 4, 6, ("column", bias), bias=bias)]
        outs, x, probes, ref = _run_column(ctx, cases, ("column", bias), backward=False)
        (w, b), = cases
        for out in outs:
            r, report = out.rank, out.value
            _check_untouched(r, report, cases)
            _check_parameters(r, n, "column-parallel layer", report["layers"][0], w.chunk(n, dim=0)[r],
                              None if b is None else b.chunk(n, dim=0)[r])
            _expect(f"rank {r}: the output{'' if bias else ' (no bias)'}", report["ys"][0],
                    ref["ys"][0].chunk(n, dim=-1)[r])
    generated.for_all(ctx, LAYERS, lambda case: _forward_drawn(ctx, COLUMN, case), count=4, describe=_layer_words)


# Layers a model hands the constructors, and inputs a caller hands their forward: 1 to 3 features a rank on the side
# that is cut, 3 to 7 on the other; in fp32, fp64, fp16 or bf16 (half precision as small whole numbers, exact in any
# order of the sums); inputs of 1 to 4 dimensions (one token's features, a batch, a batch of sequences, ...), the first
# of 1 to 3 rows. Each case runs four layers on its input, with a bias and without, each with its whole weight stored
# as usual and transposed (as a GPT-2 Conv1D weight converted with .t() is), and an input of more than one dimension
# cut to no rows too (an empty batch).
LAYERS = Space(dims=One((2, 1, 3, 4)), dtype=One(DTYPES), each=Int(1, 3), other=Int(3, 7), rows=Int(1, 3))
FOUR = ((True, False), (False, False), (True, True), (False, True))  # (a bias, the weight stored transposed)


def _layer_words(case: dict, empty: bool = True) -> str:
    shape = "×".join(map(str, _x_shape(case, case["other"])))
    return (f"whole {generated.name(case['dtype'])} layers with {case['each']} feature{'s' * (case['each'] > 1)} a "
            f"rank on the cut side, {case['other']} on the other, with a bias and without, each with its weight "
            f"stored as usual and transposed; an input of {case['dims']} dimension{'s' * (case['dims'] > 1)}, "
            f"{shape} whole{', and its first cut to 0 rows' if empty and case['dims'] > 1 else ''}")


def _x_shape(case: dict, features: int) -> tuple:
    return ((case["rows"], 2, 1)[:case["dims"] - 1]) + (features,)


def _numbers(case: dict, shape: tuple, dtype, *key) -> torch.Tensor:
    """Normal numbers; in half precision small whole numbers, whose products and sums are exact in any order."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.randint(-3, 4, shape, generator=generated.generator(case, *key)).to(dtype)
    return generated.tensor(case, shape, dtype, *key)


def _drawn_layer(kind: str, case: dict, n: int) -> tuple:
    """A drawn case's whole layer on ``n`` ranks: (fan_in, fan_out, weight, bias, input), the cut dimension ``n``
    times the case's share a rank."""
    cut = n * case["each"]
    fan_in, fan_out = (case["other"], cut) if kind == COLUMN else (cut, case["other"])
    w = _numbers(case, (fan_out, fan_in), case["dtype"], "weight")
    b = _numbers(case, (fan_out,), case["dtype"], "bias")
    return fan_in, fan_out, w, b, _numbers(case, _x_shape(case, fan_in), case["dtype"], "x")


def _forward_drawn(ctx, kind: str, case: dict) -> str | None:
    n, dtype = ctx.world_size, case["dtype"]
    _, _, w, b, x = _drawn_layer(kind, case, n)
    wholes = [(w, b if bias else None) for bias, _ in FOUR]
    ys = [F.linear(x.double(), w.double(), None if c is None else c.double()).to(dtype) for _, c in wholes]
    mine = ([(x, [y.chunk(n, dim=-1)[r] for y in ys]) for r in range(n)] if kind == COLUMN else
            [(x.chunk(n, dim=-1)[r].contiguous(), ys) for r in range(n)])
    empty = x.dim() > 1
    outs = ctx.probe_all("layers", [(xr, kind, wholes, [], True, False, [t for _, t in FOUR], empty)
                                    for xr, _ in mine])
    for out, (_, wants) in zip(outs, mine):
        for (bias, transposed), got, want, got_empty in zip(FOUR, out.value["ys"], wants,
                                                            out.value["ys_empty"] or [None] * len(FOUR)):
            layer = f"the layer {'with a bias' if bias else 'without a bias'}, its weight stored " + \
                    ("transposed" if transposed else "as usual")
            problem = generated.mismatch(f"rank {out.rank}'s output of {layer}", got, want)
            if problem is None and empty:
                problem = generated.mismatch(f"rank {out.rank}'s output of {layer} for an empty batch", got_empty,
                                             want[:0])
            if problem:
                return problem
    return None


# The cases of the backward checks: LAYERS's, with a first dimension of 2 or 3, so that an input of 3 or 4 dimensions
# has two leading dimensions of more than one (only then can .view not flatten a gradient's leading dimensions).
GRADS = Space(**{**LAYERS.knobs, "rows": Int(2, 3)})

# How a layer's output gradient reaches its backward (gpucourse.grading.probes.ex06_tensor_parallel._laid_out): as
# it is, stored transposed (a later op used the output transposed), broadcast with stride 0 over the batch (a sum
# over the batch came after); and for an input of more than one dimension, an empty batch.
RUNS = {"contiguous": "an output gradient handed contiguous",
        "transposed": "an output gradient handed stored transposed (as autograd hands it when a later op used the "
                      "output transposed)",
        "expanded": "an output gradient handed expanded, one row broadcast over the batch with stride 0 (as "
                    "autograd hands it when a sum over the batch came after)",
        "empty": "an empty batch (the input's first dimension cut to 0 rows)"}


def _grads_words(case: dict) -> str:
    return (_layer_words(case, empty=False) + "; backward from output gradients handed contiguous, transposed and "
            "expanded" + (", and from an empty batch" if case["dims"] > 1 else ""))


def _backward_drawn(ctx, kind: str, case: dict) -> str | None:
    """The four layers of a drawn case (as :func:`_forward_drawn`'s), each backward from its output under each run of
    :data:`RUNS`: the input's, the weight's and the bias's gradients against the whole layer's, at the dtype's
    tolerance. In half precision the numbers are small whole numbers, so the sums are exact in any order."""
    n, dtype = ctx.world_size, case["dtype"]
    fan_in, fan_out, w, b, x = _drawn_layer(kind, case, n)
    grad = _numbers(case, x.shape[:-1] + (fan_out,), dtype, "grad")
    runs = {"contiguous": (x, grad), "transposed": (x, grad),
            "expanded": (x, grad[(slice(0, 1),) * max(grad.dim() - 1, 1)].expand(grad.shape).contiguous())}
    if x.dim() > 1:
        runs["empty"] = (x[:0], grad[:0])
    wants = {}
    for name, (xr, g) in runs.items():
        g64, x64 = g.double(), xr.double()
        rows = g64.reshape(-1, fan_out)
        dx, dw, db = g64 @ w.double(), rows.T @ x64.reshape(-1, fan_in), rows.sum(0)
        # A column layer's rank: the whole input's gradient (summed over ranks), its rows of the weight and bias; a
        # row layer's: its slice of the input's gradient, its columns of the weight, the whole bias.
        wants[name] = [tuple(t.to(dtype) for t in (
            (dx, dw.chunk(n, dim=0)[r], db.chunk(n, dim=0)[r]) if kind == COLUMN else
            (dx.chunk(n, dim=-1)[r], dw.chunk(n, dim=1)[r], db))) for r in range(n)]
    mine = [{name: (xr, g.chunk(n, dim=-1)[r].contiguous()) if kind == COLUMN else
             (xr.chunk(n, dim=-1)[r].contiguous(), g) for name, (xr, g) in runs.items()} for r in range(n)]
    wholes, flipped = [(w, b if bias else None) for bias, _ in FOUR], [t for _, t in FOUR]
    try:
        outs = ctx.probe_all("gradients", [(kind, wholes, flipped, m) for m in mine])
    except Exception as e:
        if getattr(e, "sentence", None) is None:
            raise
        for name in runs:  # which run raised: each alone
            try:
                ctx.probe_all("gradients", [(kind, wholes, flipped, {name: m[name]}) for m in mine])
            except Exception as alone:
                if getattr(alone, "sentence", None) is None:
                    raise
                return f"for {RUNS[name]}: {alone.sentence}"
        raise
    for out in outs:
        for name in runs:
            dx, dw, db = wants[name][out.rank]
            for (bias, transposed), layer in zip(FOUR, out.value[name]):
                which = (f"the layer {'with a bias' if bias else 'without a bias'}, its weight stored "
                         f"{'transposed' if transposed else 'as usual'}, for {RUNS[name]}")
                for what, value, want in (("input's", layer["dx"], dx), ("weight's", layer["weight"], dw),
                                          ("bias's", layer["bias"], db if bias else None)):
                    problem = want is not None and generated.mismatch(f"rank {out.rank}: the {what} gradient of "
                                                                      f"{which}", value, want)
                    if problem:
                        return problem
    return None


def _column_grads(r: int, n: int, report: dict, cases: list, ref: dict, probes: list, x_requires_grad: bool,
                  outcome, shared: bool) -> None:
    for i, ((w, b), params) in enumerate(zip(cases, report["layers"])):
        which = f"layer {i + 1}'s" if len(cases) > 1 else "the"
        if "weight" not in params:
            raise Fail(f"rank {r}'s column-parallel layer has no parameter 'weight'")
        _expect(f"rank {r}: {which} weight's gradient", params["weight"]["grad"], ref["dw"][i].chunk(n, dim=0)[r])
        if b is not None:
            if "bias" not in params:
                raise Fail(f"rank {r}'s column-parallel layer has no parameter 'bias'")
            _expect(f"rank {r}: {which} bias's gradient", params["bias"]["grad"], ref["db"][i].chunk(n, dim=0)[r])
    if not x_requires_grad:
        if report["dx"] is not None:
            raise Fail(f"rank {r}: an input that does not require a gradient got one")
        return
    partial = sum(p.chunk(n, dim=-1)[r] @ w.chunk(n, dim=0)[r] for p, (w, _) in zip(probes, cases))
    in_backward = _comm_during(outcome, report["marks"]["backward"])
    none_seen = "" if in_backward else " (no collective ran during backward)"
    known = [(partial, f"it is this rank's own part of the gradient, not the sum over ranks{none_seen}")]
    if shared:
        known.append((n * ref["dx"], f"it is {n} times the sum: with one layer on this input it was right, with "
                                     f"two layers on the same input the whole gradient of the input was summed "
                                     f"over ranks once per layer — as a hook on the input tensor does, since it "
                                     f"sees the gradient of every use of the input — instead of each layer's own "
                                     f"part being summed once"))
    else:
        known.append((n * ref["dx"], f"it is {n} times the sum: the gradient was summed over ranks twice"))
    _expect(f"rank {r}: the input's gradient" + (" (one input, two column-parallel layers)" if shared else ""),
            report["dx"], ref["dx"], known)


@EXERCISE.check("column-parallel backward", points=2, world_size=2, hint=(
    "Every rank's slice of the output depends on the whole input, so each rank's backward gives only its "
    "part of dL/dx; the whole gradient is their sum. Put an autograd Function in front of the layer that "
    "is the identity forward and all-reduces the gradient backward (Megatron's f): it sums this layer's part "
    "exactly once, also when the same input feeds several layers (the queries, keys and values of attention) "
    "or does not need a gradient at all, where a hook on the input tensor goes wrong. The weight and bias "
    "gradients need no communication: they are already this rank's slice." + BY_HAND))
def column_backward(ctx):
    n = ctx.world_size
    scenarios = [("one", [_whole(ctx, 4, 6, "one")], True),
                 ("shared", [_whole(ctx, 4, 6, "q"), _whole(ctx, 4, 4, "k", bias=False)], True),
                 ("no grad", [_whole(ctx, 4, 6, "data in")], False)]
    for key, cases, needs_grad in scenarios:
        outs, x, probes, ref = _run_column(ctx, cases, key, x_requires_grad=needs_grad)
        for out in outs:
            _check_untouched(out.rank, out.value, cases)
            _column_grads(out.rank, n, out.value, cases, ref, probes, needs_grad, out, shared=len(cases) > 1)
    generated.for_all(ctx, GRADS, lambda case: _backward_drawn(ctx, COLUMN, case), count=4, describe=_grads_words)


def _run_row(ctx, bias: bool, key, backward: bool = True, fan_in: int = 6, fan_out: int = 4) -> tuple:
    """Every rank's row layer on its own slice of the input; backward of the whole output gradient."""
    n = ctx.world_size
    cases = [_whole(ctx, fan_in, fan_out, (key, bias), bias=bias)]
    x = _data(ctx, BATCH, fan_in, key=(key, bias, "x"))
    probe = _data(ctx, BATCH, fan_out, key=(key, bias, "probe"))
    ref = _reference(cases, x, [probe])
    pieces = x.chunk(n, dim=-1)
    outs = ctx.probe_all("layers", [(pieces[r].contiguous(), ROW, cases, [probe], True, backward)
                                    for r in range(n)])
    return outs, cases, pieces, probe, ref


@EXERCISE.check("row-parallel forward", points=2, world_size=2, hint=(
    "Rank r keeps columns r*in/n to (r+1)*in/n of the weight (.clone()d) and the whole bias, or none when the "
    "layer has none. It multiplies its slice of the input by its columns of the weight: that is one part of a "
    "sum, and the output is the sum of all ranks' parts. Add them with an all-reduce in the forward "
    "(Megatron's g), then add the bias — once, after the sum, or it is counted n times — as the vector it is: an "
    "input of one dimension (one token's features) gives an output of one dimension."))
def row_forward(ctx):
    n = ctx.world_size
    for bias in (True, False):
        outs, cases, pieces, probe, ref = _run_row(ctx, bias, "row", backward=False)
        (w, b), = cases
        for out in outs:
            r, report = out.rank, out.value
            _check_untouched(r, report, cases)
            _check_parameters(r, n, "row-parallel layer", report["layers"][0], w.chunk(n, dim=1)[r], b)
            partial = pieces[r] @ w.chunk(n, dim=1)[r].T
            known = [(partial if b is None else partial + b,
                      "it is only this rank's partial product: the ranks' parts were never summed")]
            if b is not None:
                known.append((ref["ys"][0] + (n - 1) * b, f"the bias is in it {n} times: it was added before the sum"))
                known.append((ref["ys"][0] - b, "the bias is missing from it"))
            _expect(f"rank {r}: the output{'' if bias else ' (no bias)'}", report["ys"][0], ref["ys"][0], known)
    generated.for_all(ctx, LAYERS, lambda case: _forward_drawn(ctx, ROW, case), count=4, describe=_layer_words)


@EXERCISE.check("row-parallel backward", points=1, world_size=2, hint=(
    "The forward's all-reduce hands every rank the same output, so its backward hands every rank the same "
    "gradient unchanged: the identity. Summing it again over ranks multiplies the gradients by n. The bias "
    "is added once, after the sum, on every rank: each rank's bias gets the whole bias gradient." + BY_HAND))
def row_backward(ctx):
    n = ctx.world_size
    outs, cases, pieces, probe, ref = _run_row(ctx, True, "row back")
    for out in outs:
        r, report = out.rank, out.value
        _check_untouched(r, report, cases)
        params = report["layers"][0]
        for name in ("weight", "bias"):
            if name not in params:
                raise Fail(f"rank {r}'s row-parallel layer has no parameter '{name}'")
        in_backward = _comm_during(out, report["marks"]["backward"])
        twice = (f"it is {n} times too large: the gradient was summed over ranks in backward"
                 + (f" ({len(in_backward)} collective{'s' * (len(in_backward) > 1)} ran during backward)"
                    if in_backward else ""))
        _expect(f"rank {r}: the weight's gradient", params["weight"]["grad"], ref["dw"][0].chunk(n, dim=1)[r],
                [(n * ref["dw"][0].chunk(n, dim=1)[r], twice)])
        db = ref["db"][0]
        if params["bias"]["grad"] is None:
            raise Fail(f"rank {r}: the bias got no gradient: the bias took no part in this rank's output "
                       f"(add it on every rank, after the sum)")
        _expect(f"rank {r}: the bias's gradient", params["bias"]["grad"], db,
                [(n * db, twice), (db / n, f"it is 1/{n} of the bias's gradient: each rank added 1/{n} of the "
                                           f"bias before the sum; add the whole bias once, after it"),
                 (torch.zeros_like(db), "it is zero: the bias took no part in this rank's output")])
        _expect(f"rank {r}: the input's gradient", report["dx"], ref["dx"].chunk(n, dim=-1)[r],
                [(n * ref["dx"].chunk(n, dim=-1)[r], twice)])
    generated.for_all(ctx, GRADS, lambda case: _backward_drawn(ctx, ROW, case), count=4, describe=_grads_words)


def _held(ctx, kind: str, dtype, strided: bool = False) -> None:
    """One layer of ``kind`` (with a bias) in ``dtype`` on an input of three dimensions, forward and backward on
    every rank, held to its contract (with a ``strided`` input); its output and its input's gradient against the
    whole layer's, in float64."""
    n = ctx.world_size
    fan_in, fan_out = (4, 6) if kind == COLUMN else (6, 4)
    w, b = _whole(ctx, fan_in, fan_out, ("contract", kind))
    x, probe = _data(ctx, 2, BATCH, fan_in, key=("contract", kind)), _data(ctx, 2, BATCH, fan_out, key=kind)
    ref = _reference([(w.double(), b.double())], x.double(), [probe.double()])
    mine = [(x, probe.chunk(n, dim=-1)[r], ref["ys"][0].chunk(n, dim=-1)[r], ref["dx"]) if kind == COLUMN else
            (x.chunk(n, dim=-1)[r], probe, ref["ys"][0], ref["dx"].chunk(n, dim=-1)[r]) for r in range(n)]
    cases = [(w.to(dtype), b.to(dtype))]
    args = [(xr.to(dtype).contiguous(), kind, cases, [g.to(dtype)]) for xr, g, _, _ in mine]
    outs = contracts.probe_all(ctx, FORWARD[kind], "layers", args, strided)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    case = contracts.describe_case(FORWARD[kind], (contracts.as_strided_view(x) if strided else x,), n)
    for out, (_, _, y, dx) in zip(outs, mine):
        for what, got, want in (("output", out.value["ys"][0], y), ("input's gradient", out.value["dx"], dx)):
            what = f"rank {out.rank}'s {what}"
            if dtype == torch.float64:
                contracts.expect_precision(FORWARD[kind], what, got, want, case)
            else:
                expect_close(f"{what} ({case})", got.double() if torch.is_tensor(got) else got, want, tol, tol)


@EXERCISE.check("the contract: the input left as it was after forward and backward, its dtype kept, views (2 ranks)",
                points=1, world_size=2, hint=(
    "A caller keeps using the input it passed in: never write into x, in forward or in backward (not even through a "
    "tensor an autograd Function saved); compute new tensors. Return x's dtype: bf16 in, bf16 out — a sum done in "
    "float32 must be brought back to x's dtype. And x may be a view with any strides (a transposed batch, a slice "
    "of the features): flatten with .reshape, which copies when it must, not .view, and all-reduce a contiguous "
    "tensor of your own."))
def contract(ctx):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for kind in (COLUMN, ROW):
            _held(ctx, kind, dtype)
    for kind in (COLUMN, ROW):  # after the contiguous inputs, so that an error there is not blamed on the views
        _held(ctx, kind, torch.float32, strided=True)


def _mlp(ctx, bias: bool):
    """Column-parallel fc, GELU on the local slice, row-parallel proj: the same as the whole MLP."""
    n = ctx.world_size
    fc, proj = _whole(ctx, 4, 6, ("fc", bias), bias=bias), _whole(ctx, 6, 4, ("proj", bias), bias=bias)
    x, probe = _data(ctx, BATCH, 4, key=("x", bias)), _data(ctx, BATCH, 4, key=("probe", bias))
    xf = x.clone().requires_grad_(True)
    wf = [None if t is None else t.clone().requires_grad_(True) for t in (*fc, *proj)]
    yf = F.linear(F.gelu(F.linear(xf, wf[0], wf[1])), wf[2], wf[3])
    (yf * probe).sum().backward()
    label = "" if bias else " (no biases)"
    for out in ctx.probe_all("mlp", [(fc, proj, x, probe)] * n):
        r, report = out.rank, out.value
        _expect(f"rank {r}: the MLP's output{label}", report["y"], yf.detach())
        _expect(f"rank {r}: the MLP's input gradient{label}", report["dx"], xf.grad,
                [(n * xf.grad, f"it is {n} times too large: summed over ranks twice")])
        for layer, name, want in (("fc", "weight", wf[0].grad.chunk(n, dim=0)[r]),
                                  ("fc", "bias", None if wf[1] is None else wf[1].grad.chunk(n, dim=0)[r]),
                                  ("proj", "weight", wf[2].grad.chunk(n, dim=1)[r]),
                                  ("proj", "bias", None if wf[3] is None else wf[3].grad)):
            params = report[layer]
            if want is None:
                if name in params:
                    raise Fail(f"rank {r}: {layer} has a parameter '{name}' though its whole layer has none "
                               f"(nn.Linear(..., bias=False))")
                continue
            if name not in params:
                raise Fail(f"rank {r}: {layer} has no parameter '{name}'")
            _expect(f"rank {r}: {layer}'s {name} gradient{label}", params[name]["grad"], want)


@EXERCISE.check("column then row is the whole MLP (3 ranks)", points=1, world_size=3, hint=(
    "A column-parallel layer's sliced output is exactly the sliced input a row-parallel layer wants, and "
    "an element-wise GELU in between works on the slice: one all-reduce forward, one backward, for the "
    "whole MLP. Slice with chunk(n) along the right dimension for n = 3 too, and handle layers with and "
    "without a bias."))
def mlp_three(ctx):
    _mlp(ctx, bias=True)
    _mlp(ctx, bias=False)


@EXERCISE.check("one rank", points=1, world_size=1, hint=(
    "With one rank each slice is the whole weight and every all-reduce leaves its tensor as it is: the "
    "layers must then behave exactly like nn.Linear, with a bias or without."))
def one_rank(ctx):
    _mlp(ctx, bias=True)
    _mlp(ctx, bias=False)
