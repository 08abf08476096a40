"""Checks of exercise 15: fully sharded data parallel with a compute dtype, against one device.

The model (widths and weights) is drawn here and built on each rank by the probe
(``gpucourse/grading/probes/ex15_fsdp.py``), which wraps it in the learner's ``FSDP``, trains it with
``torch.optim.SGD`` and reports every rank's shards and gradients, and the whole weights it found still holding
memory between forward and backward. The checks put the ranks' shards back together and compare them with one
device that takes the same batch in the same per-rank parts (casting each matrix at each use, with a compute
dtype); what went between the ranks is counted by the kernel and compared with the formula.
"""

from __future__ import annotations

import math

import torch

from .. import contracts, traffic
from ..core import Exercise, Fail, describe_mismatch
from ..probes.ex15_fsdp import build_model, loss_of

EXERCISE = Exercise(
    "ex15_fsdp", "FSDP with a compute dtype", "notebooks/03_zero_fsdp.ipynb",
    forbidden_names=("torch.distributed.fsdp.FullyShardedDataParallel",
                     "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
                     "torch.distributed.fsdp.fully_shard", "torch.distributed._composable.fsdp.fully_shard",
                     "torch.nn.parallel.DistributedDataParallel"),
    refusal=("{op} is switched off in this exercise: shard, gather and reduce-scatter yourself, with "
             "dist.all_gather_single and dist.reduce_scatter_single"),
    rank_imports=("torch._dynamo",),  # every SGD step imports it
    concept=("each rank keeps 1/n of every matrix; a matrix is whole only while the submodule that holds it "
             "computes, and its gradient is summed so that each rank receives only its own piece, yet every step "
             "equals one device's"),
    section="§7 (FSDP as a module any training loop can use, with a compute dtype) and §8 (the exercise)")

LR, STEPS, ROWS = 0.1, 2, 2  # ROWS: each rank's part of a step's batch
# One rank is held bit for bit: the same operations as the module's own. On 2 and 3 ranks each part's gradient is
# what one device computes for that part, but the ranks add a matrix's gradients call by call ((a1 + b1) + (a2 + b2)
# for the matrix called twice) where one device adds them part by part ((a1 + a2) + (b1 + b2)), and three ranks' sum
# runs in gloo's order: the same numbers added in another order, a few float32 ulps apart where they differ.
FP32_TOL = dict(atol=1e-6, rtol=1e-5)
# With a compute dtype the weights are held within 1e-4, as the issue asks; the gradients more tightly: each rank's
# fp16 gradient of its part is what one device computes for that part, and they differ from one device's only in
# the order of the fp32 sum, while a sum taken in fp16 rounds each element by up to 2^-11 of it.
HALF_TOL = dict(atol=1e-4, rtol=1e-4)
HALF_GRAD_TOL = dict(atol=1e-7, rtol=1e-5)

# The batches the probe hands the learner's forward come back as they were (after forward, after backward).
TRAIN = contracts.Contract("FSDP", ("xs",), unchanged=("xs",))
SHARDED = ("inp.weight", "mid.weight", "head.weight")
USES = {"inp.weight": 1, "mid.weight": 2, "head.weight": 1}  # forward calls of the submodule holding each


def _spec(ctx, key="") -> dict:
    """Widths of 3 to 8, the hidden one 5 or 7: its square matrix's numel divides by neither 2 nor 3."""
    g = ctx.generator("model", key)
    d_in, d_out = (int(v) for v in torch.randint(3, 9, (2,), generator=g))
    hidden = (5, 7)[int(torch.randint(0, 2, (1,), generator=g))]
    shapes = {"inp.weight": (hidden, d_in), "inp.bias": (hidden,), "norm.gain": (hidden,),
              "mid.weight": (hidden, hidden), "head.weight": (d_out, hidden)}
    weights = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g)
        weights[name] = w * shape[1] ** -0.5 if len(shape) == 2 else (1 + 0.1 * w if "gain" in name else 0.1 * w)
    return {"widths": [d_in, hidden, d_out], "weights": weights}


def _batches(ctx, spec, n: int, key="") -> list[torch.Tensor]:
    g = ctx.generator("x", key, n)
    return [torch.randn(n * ROWS, spec["widths"][0], generator=g) for _ in range(STEPS)]


def _one_device(spec, batches, n: int, cast=None, accumulate: int = 1) -> list[dict]:
    """The whole parameters and the averaged gradients after each SGD step on one device: the step's batch in the
    n parts the ranks get, each part's gradient (of the fp32 weights, each cast to ``cast`` at each use; with
    ``accumulate``, the sum of its microbatches' gradients, each loss divided by their number), their sum over the
    parts divided by n."""
    model = build_model(spec, cast)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for x in batches:
        total = {k: torch.zeros_like(p) for k, p in params.items()}
        for r in range(n):
            model.zero_grad(set_to_none=True)
            for part in x[r * ROWS:(r + 1) * ROWS].tensor_split(accumulate):
                loss = loss_of(model(part))
                (loss / accumulate if accumulate > 1 else loss).backward()
            for k, p in params.items():
                total[k] += p.grad
        for k, p in params.items():
            p.grad = total[k] / n
        opt.step()
        out.append({"grads": {k: p.grad.clone() for k, p in params.items()},
                    "params": {k: p.detach().clone() for k, p in params.items()}})
    return out


def _run(ctx, spec, batches, cast=None, steps=STEPS, accumulate: int = 1) -> list:
    n = ctx.world_size
    args = [([x[r * ROWS:(r + 1) * ROWS] for x in batches[:steps]], spec, LR, cast, accumulate) for r in range(n)]
    return contracts.probe_all(ctx, TRAIN, "train", args)


def _whole(outs, step: int, what: str, name: str, shape) -> torch.Tensor | str:
    """Rank r's pieces of ``name`` put back together (cut to the weight's size, shaped like it), or a sentence
    saying why they cannot be."""
    pieces = [o.value["steps"][step][what][name] for o in outs]
    for o, p in zip(outs, pieces):
        if not torch.is_tensor(p):
            return f"rank {o.rank}'s {name}{'.grad' if what == 'grads' else ''} is {type(p).__name__}, not a tensor"
    size = math.ceil(math.prod(shape) / len(outs))
    for o, p in zip(outs, pieces):
        if p.dim() != 1 or p.numel() != size:
            return (f"rank {o.rank}'s {name}{'.grad' if what == 'grads' else ''} has shape {tuple(p.shape)}; "
                    f"each rank's shard of a {'×'.join(map(str, shape))} weight on {len(outs)} ranks is flat, of "
                    f"ceil({math.prod(shape)} / {len(outs)}) = {size} elements")
    if len({p.dtype for p in pieces}) > 1:
        return f"the ranks' pieces of {name} differ in dtype: {[str(p.dtype) for p in pieces]}"
    return torch.cat(pieces)[:math.prod(shape)].view(shape)


def _compare(ctx, spec, batches, cast=None, tol=None, grad_tol=None, accumulate: int = 1) -> list:
    """Fails unless, after each step, every rank's shards and gradients put together are one device's (with
    ``accumulate``, gradients accumulated over that many backwards a step)."""
    n = ctx.world_size
    outs = _run(ctx, spec, batches, cast, accumulate=accumulate)
    want = _one_device(spec, batches, n, cast, accumulate)
    for step, expected in enumerate(want):
        for what in ("grads", "params"):
            for name, w in expected[what].items():
                label = f"{name}{'.grad after finish_gradient_synchronization()' if what == 'grads' else ''}"
                where = (f"step {step + 1} of {len(want)}, {n} rank{'s' * (n > 1)}"
                         + (f", {accumulate} backwards a step (gradient accumulation)" if accumulate > 1 else ""))
                if name in SHARDED:
                    got = _whole(outs, step, what, name, w.shape)
                    if isinstance(got, str):
                        raise Fail(f"{where}: {got}")
                    problem = _mismatch(f"{where}: {label}, the ranks' pieces put together", got, w,
                                        grad_tol if what == "grads" and grad_tol else tol)
                else:
                    problem = next(filter(None, (_mismatch(f"{where}: rank {o.rank}'s {label}",
                                                           o.value["steps"][step][what][name], w,
                                                           grad_tol if what == "grads" and grad_tol else tol)
                                                 for o in outs)), None)
                if problem:
                    seen = got if name in SHARDED else outs[0].value["steps"][step][what][name]
                    raise Fail(problem + _why(what, name, seen, w, n, cast))
    return outs


def _mismatch(what, got, want, tol) -> str | None:
    if tol is None:  # one rank: the same operations as the module's own, bit for bit
        if torch.is_tensor(got) and got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want):
            return None
        return describe_mismatch(what, got, want, 0.0, 0.0) or f"{what} differs from one device's"
    return describe_mismatch(what, got, want, **tol)


def _why(what: str, name: str, got, want: torch.Tensor, n: int, cast) -> str:
    """What a wrong gradient looks like, when the checks can tell; else ""."""
    if what != "grads" or n == 1 or not torch.is_tensor(got) or got.shape != want.shape or got.dtype != want.dtype:
        return ""
    if torch.allclose(got.double(), (want * n).double(), atol=1e-5, rtol=1e-3):
        return f"; it is {n} times the average: the sum over the ranks, not divided by the world size"
    if name not in SHARDED:
        return "; a vector (replicated on every rank) needs its gradient all-reduced and averaged too"
    if cast is not None and torch.allclose(got, want, atol=1e-5, rtol=2e-3):
        return (f"; it is within {str(cast).removeprefix('torch.')}'s rounding of it, not fp32's: the sum over the "
                f"ranks was taken in the compute dtype")
    return ""


@EXERCISE.check("one rank: every step equals the module's own, bit for bit", points=1, world_size=1, hint=(
    "On one rank each shard is the whole flattened weight, the all-gather hands it back and the reduce-scatter "
    "keeps the whole gradient: the steps are the module's own. Shard every parameter with two or more "
    "dimensions, use the gathered weight as the module's attribute during its forward, and put the gradient "
    "piece in p.grad in finish_gradient_synchronization()."))
def one_rank(ctx):
    spec = _spec(ctx)
    _compare(ctx, spec, _batches(ctx, spec, 1))


@EXERCISE.check("2 ranks, fp32: every step equals one device's", points=2, world_size=2, hint=(
    "Shard the flattened weight padded to a multiple of the world size, piece r on rank r; gather it whole "
    "before each call of the submodule that holds it, and in that call's backward reduce-scatter its gradient "
    "(padded the same way) so that rank r receives the sum of piece r; divide by the world size. Vectors stay "
    "whole on every rank: all-reduce their gradients and divide them too. Under gradient accumulation (several "
    "backwards, each followed by finish_gradient_synchronization(), before one step) add each piece to the .grad "
    "an earlier backward left, as autograd does."))
def two_ranks(ctx):
    spec = _spec(ctx)
    _compare(ctx, spec, _batches(ctx, spec, 2), tol=FP32_TOL)
    _compare(ctx, spec, _batches(ctx, spec, 2, "accumulate")[:1], tol=FP32_TOL, accumulate=2)  # one step of two


@EXERCISE.check("3 ranks: sizes no rank count divides, padding on the last rank", points=2, world_size=3, hint=(
    "ceil(numel / 3) elements per rank: the last rank's piece ends in zeros (padding), so that every rank "
    "gathers and reduce-scatters pieces of one size. Cut the padding off after the gather (full[:numel]) and "
    "keep it in the shard: its gradient is zero, so it stays zero."))
def three_ranks(ctx):
    spec = _spec(ctx, "3")
    _compare(ctx, spec, _batches(ctx, spec, 3, "3"), tol=FP32_TOL)


@EXERCISE.check("fp16 compute: fp32 master weights and gradients, within 1e-4 of one device (2 ranks)", points=2,
                world_size=2, hint=(
    "Cast the shard to the compute dtype before the all-gather (the gather then moves half the bytes), and "
    "compute forward and backward with the fp16 weight. The shard itself, the master weight the optimizer "
    "steps, stays fp32; cast each fp16 gradient to fp32 before the reduce-scatter, so that the sum over the "
    "ranks and p.grad are fp32. Leave the vectors in their own dtype."))
def half(ctx):
    spec = _spec(ctx, "fp16")
    _compare(ctx, spec, _batches(ctx, spec, 2, "fp16"), cast=torch.float16, tol=HALF_TOL,
             grad_tol=HALF_GRAD_TOL)


@EXERCISE.check("no whole weight kept between forward and backward (2 ranks)", points=1, world_size=2, hint=(
    "A whole weight is what FSDP saves memory on: free it as soon as its submodule's forward is done, "
    "including what autograd saved of it (buffer.untyped_storage().resize_(0) frees the memory under every "
    "view), and gather it again, into the same memory, when the gradient of the submodule's output arrives "
    "(a hook on the output). Gathering everything once a step and keeping it is data parallelism's memory."))
def freed(ctx):
    spec = _spec(ctx, "held")
    outs = _run(ctx, spec, _batches(ctx, spec, 2, "held"), torch.float16, steps=1)
    for o in outs:
        held = o.value["steps"][0]["held"]
        if held:
            names = sorted({name for name, _ in held})
            raise Fail(f"rank {o.rank} still held {len(held)} whole weight{'s' * (len(held) > 1)} "
                       f"({sum(b for _, b in held)} bytes, as large as {', '.join(names)}) after forward, before "
                       f"backward: each should have been freed when its submodule's forward returned")


@EXERCISE.check("the contract: flat fp32 shards of ceil(numel / n), gradients alike, the batch left as it was "
                "(2 ranks)", points=1, world_size=2, hint=(
    "After construction each matrix's p.data is this rank's piece of the flattened weight zero-padded to a "
    "multiple of the world size (ceil(numel / n) elements, the parameter's dtype), so that fsdp.parameters() "
    "hands the optimizer the shards; vectors are left as they were. After finish_gradient_synchronization() "
    "p.grad has the shard's shape and dtype, and zeros where the shard is padding (pad the gradient with zeros "
    "before the reduce-scatter), so the padding stays zero. Never write into the module's input."))
def contract(ctx):
    spec = _spec(ctx, "contract")
    n = ctx.world_size
    outs = _run(ctx, spec, _batches(ctx, spec, n, "contract"), steps=1)
    for o in outs:
        if not o.value["same_parameters"]:
            raise Fail(f"rank {o.rank}: fsdp.parameters() are not the wrapped module's own parameters (the shards)")
        for name, w in spec["weights"].items():
            got = o.value["shards"][name]
            if name in SHARDED:
                size = math.ceil(w.numel() / n)
                flat = torch.zeros(size * n)
                flat[:w.numel()] = w.reshape(-1)
                want = flat[o.rank * size:(o.rank + 1) * size]
                what = f"rank {o.rank}'s {name} after construction (its shard)"
            else:
                want, what = w, f"rank {o.rank}'s {name} after construction (a vector: left whole)"
            problem = describe_mismatch(what, got, want, 0.0, 0.0)
            if problem:
                raise Fail(problem)
            grad = o.value["steps"][0]["grads"][name]
            if not torch.is_tensor(grad) or grad.shape != want.shape or grad.dtype != want.dtype:
                seen = f"{tuple(grad.shape)} {grad.dtype}" if torch.is_tensor(grad) else type(grad).__name__
                raise Fail(f"rank {o.rank}'s {name}.grad after finish_gradient_synchronization() is {seen}; its "
                           f"shard is {tuple(want.shape)} {want.dtype}")
            if name in SHARDED:
                # The padding is no weight: its gradient is zero, so an optimizer's step leaves it zero.
                real = max(0, w.numel() - o.rank * want.numel())
                for what, t in (("gradient", grad), ("value after the step", o.value["steps"][0]["params"][name])):
                    if real < t.numel() and bool(t[real:].any()):
                        raise Fail(f"rank {o.rank}'s {name}: the {what} of its padding (elements {real} to "
                                   f"{want.numel() - 1} of its shard) is {t[real:].tolist()}, not zeros")


def _wire(spec, itemsize: int) -> tuple[int, dict]:
    """The bytes one rank of two sends the other in one step, by gloo's framing, and the collectives' payloads
    the ranks should record: per call of a submodule, an all-gather of each of its matrices in forward and
    another before its backward (pieces in the compute dtype) and a reduce-scatter of the padded fp32 gradient
    (on gloo as many bytes as an all-reduce of it: the wire cannot tell them apart, the records can); per vector,
    an all-reduce of its fp32 gradient."""
    total, ops = 0, {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    for name, w in spec["weights"].items():
        if name in SHARDED:
            size = math.ceil(w.numel() / 2)
            for _ in range(USES[name]):
                total += 2 * traffic.all_gather_of_two(size, itemsize) + traffic.reduce_scatter_of_two(2 * size, 4)
                ops["all_gather"] += [size * itemsize] * 2
                ops["reduce_scatter"].append(2 * size * 4)
        else:
            total += traffic.all_reduce_of_two(w.numel(), 4)
            ops["all_reduce"].append(w.numel() * 4)
    return total, {k: sorted(v) for k, v in ops.items()}


@EXERCISE.check("bytes per step: gathers in forward and backward, reduce-scatters of gradients (2 ranks)", points=1,
                world_size=2, hint=(
    "Per call of a submodule, each of its matrices is all-gathered twice (before forward, and again before "
    "that call's backward, since forward freed it) in the compute dtype, and its padded fp32 gradient is "
    "reduce-scattered once (dist.reduce_scatter_single, not an all-reduce: each rank needs only its piece); each "
    "vector's gradient is all-reduced once. Cast before the gather, not after: an fp32 gather moves twice the "
    "bytes."))
def bytes_per_step(ctx):
    spec = _spec(ctx, "bytes")
    batches = _batches(ctx, spec, 2, "bytes")
    for cast in (None, torch.float16):
        itemsize = 2 if cast is not None else 4
        outs = _run(ctx, spec, batches, cast, steps=1)
        wire, ops = _wire(spec, itemsize)
        mode = "fp16 compute" if cast is not None else "fp32"
        for o in outs:
            got = {k: sorted(c["bytes"] for c in o.comm if c["op"] == k) for k in ops}
            other = sorted({c["op"] for c in o.comm} - set(ops))
            if got != ops or other:
                said = "; ".join(f"{len(v)} {k}s of {v} bytes" for k, v in got.items() if v)
                raise Fail(f"{mode}: rank {o.rank}'s step called {said or 'no collective'}"
                           f"{' and ' + ', '.join(other) if other else ''}; one step of this model is "
                           + "; ".join(f"{len(v)} {k}s of {v} bytes" for k, v in ops.items()))
        counted, _ = ctx.wire(outs)
        if counted is not None:
            for r in (0, 1):
                if counted.sent(r, 1 - r) != wire:
                    raise Fail(f"{mode}: rank {r} sent rank {1 - r} {counted.sent(r, 1 - r)} bytes in one step by "
                               f"the kernel's count; the gathers, reduce-scatters and all-reduces of one step put "
                               f"{wire} on the wire, gloo's framing included: something else went between the "
                               f"ranks, whether torch.distributed saw it or not")
