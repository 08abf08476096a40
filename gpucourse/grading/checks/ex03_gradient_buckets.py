"""Checks of exercise 3: gradient buckets in gradient-ready order, one async all-reduce each, during backward.

The model is described here (widths, weights, which parameter is frozen) and
built on each rank by the probes (``gpucourse/grading/probes/ex03_gradient_buckets.py``),
which run the learner's bucketing and sync and report what they saw: the
buckets, the gradients after each ``finish()``, and when each gradient was
computed. The expected buckets and gradients are computed here; whether the
communication overlapped backward is judged from the times of the collectives
the sandbox recorded against the times the gradients appeared.
"""

from __future__ import annotations

import torch

from ...parallel.data_parallel_buckets import assign_buckets as reference_buckets
from .. import contracts, generated, traffic
from ..core import Exercise, Fail, describe_mismatch
from ..generated import DTYPES, Many, One, Shape, Space
from ..probes.ex03_gradient_buckets import Drawn, build_model, drawn_loss, loss_of

EXERCISE = Exercise("ex03_gradient_buckets", "Gradient buckets overlapped with backward",
                    "notebooks/02_data_parallelism.ipynb",
                    forbidden_names=("torch.nn.parallel.DistributedDataParallel",
                                     "torch.nn.parallel.distributed.DistributedDataParallel"),
                    refusal=("this exercise switches off {op}: bucket the gradients and launch their "
                             "all-reduces yourself"),
                    concept=("gradients become ready during backward, last layers first; buckets group them so that "
                             "their communication starts while backward runs, and every gradient is reduced exactly "
                             "once a step"),
                    section="§4 (where the time goes, and buckets that overlap it)")

FROZEN = ("2.weight",)  # the middle layer's weight
HOLD_S = 0.5            # how late the last rank comes to its first all-reduce, in the overlap check

# What every caller relies on besides the averages (gpucourse.grading.contracts): a float64 model's gradients are
# averaged in float64. The sync takes a model, not tensors: its only other promises are the values themselves.
SYNC = contracts.Contract("BucketedGradientSync", ("model", "cap_bytes"))


def _spec(ctx, dtype=torch.float32) -> dict:
    """Three linear layers of random widths (tanh between them), in ``dtype``; the middle one's weight is frozen."""
    g = ctx.generator("model")
    widths = torch.randint(3, 10, (4,), generator=g).tolist()
    shapes = {}
    for i in range(3):
        shapes[f"{2 * i}.weight"] = (widths[i + 1], widths[i])
        shapes[f"{2 * i}.bias"] = (widths[i + 1],)
    weights = {n: (torch.randn(s, generator=g) * 0.5).to(dtype) for n, s in shapes.items()}
    return {"widths": widths, "weights": weights, "frozen": list(FROZEN)}


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _trainable(spec) -> dict:
    """Name -> parameter of the trainable parameters, in named_parameters() order."""
    return {n: p for n, p in build_model(spec).named_parameters() if p.requires_grad}


def _caps(spec) -> list[int]:
    sizes = [_nbytes(p) for p in _trainable(spec).values()]
    ready = sizes[::-1]
    # Smaller than any parameter, exactly two neighbours' worth (a bucket that fills the cap exactly),
    # a middling one, and one that holds everything.
    return [min(sizes) - 1, ready[0] + ready[1], sum(sizes) // 2, sum(sizes) * 2]


def _as_names(buckets, what: str) -> list[list[str]]:
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in buckets):
        raise Fail(f"{what} is a {type(buckets).__name__}, not a list of lists of parameter names")
    if not all(isinstance(n, str) for b in buckets for n in b):
        raise Fail(f"{what} holds something other than parameter names (strings, as in model.named_parameters())")
    return [list(b) for b in buckets]


def _learner_buckets(ctx, spec: dict, caps: list[int]) -> list[list[list[str]]]:
    got = ctx.probe("buckets", spec, caps).value
    return [_as_names(b, f"assign_buckets(model, {cap})") for b, cap in zip(got, caps)]


@EXERCISE.check("buckets follow gradient-ready order", points=2, hint=(
    "Backward computes gradients from the loss backwards: the last layer's parameters are ready first, the "
    "first layer's last. A bucket can only be sent once all of its gradients exist, so fill buckets in that "
    "order — the reverse of model.named_parameters() — and leave out parameters that get no gradient."))
def ready_order(ctx):
    spec = _spec(ctx)
    names = list(_trainable(spec))
    caps = _caps(spec)
    for cap, got in zip(caps, _learner_buckets(ctx, spec, caps)):
        flat = [n for b in got for n in b]
        if flat == names[::-1]:
            continue
        if flat == names:
            raise Fail(f"with a cap of {cap} bytes the buckets list the parameters in forward order, "
                       f"{names[0]} first; backward makes {names[-1]}'s gradient first")
        frozen = [n for n in flat if n in FROZEN]
        if frozen:
            raise Fail(f"the buckets include the frozen parameter {frozen[0]} (requires_grad is False)")
        missing = [n for n in names if n not in flat]
        if missing:
            raise Fail(f"with a cap of {cap} bytes the buckets leave out {', '.join(missing)}, which "
                       f"get{'s' * (len(missing) == 1)} a gradient")
        raise Fail(f"with a cap of {cap} bytes the parameters come in the order {flat}; gradient-ready "
                   f"order is {names[::-1]}")


@EXERCISE.check("buckets respect the size cap", points=2, hint=(
    "Walk the parameters once, keeping the current bucket's size in bytes (numel * element_size). A "
    "parameter joins the current bucket if the bucket stays at or under the cap with it; otherwise it starts "
    "a new one. A parameter larger than the cap still needs a bucket: its own. A bucket may be exactly full. A "
    "parameter's bytes are numel() * element_size(), whatever its dtype: 2 for bf16, 8 for float64."))
def size_cap(ctx):
    spec = _spec(ctx)
    params = dict(build_model(spec).named_parameters())
    caps = _caps(spec)
    for cap, got in zip(caps, _learner_buckets(ctx, spec, caps)):
        unknown = [n for b in got for n in b if n not in params]
        if unknown:
            raise Fail(f"the buckets name {unknown[0]!r}, which is not a parameter of the model")
        if any(not b for b in got):
            raise Fail(f"with a cap of {cap} bytes one of the buckets is empty")
        # Judged in the learner's own order, so that a wrong order costs only the check above.
        want = _name_buckets(params, [n for b in got for n in b], cap)
        if got != want:
            sizes = [sum(_nbytes(params[n]) for n in b) for b in got]
            over = [i for i, (b, s) in enumerate(zip(got, sizes)) if s > cap and len(b) > 1]
            if over:
                raise Fail(f"with a cap of {cap} bytes bucket {over[0]} holds {sizes[over[0]]} bytes "
                           f"({', '.join(got[over[0]])})")
            raise Fail(f"with a cap of {cap} bytes the buckets are {got} (sizes {sizes} bytes); "
                       f"filling each as far as the cap allows gives {want}")
    generated.for_all(ctx, BUCKETS, lambda case: _buckets_drawn(ctx, case), count=4, describe=_bucket_words)


def _name_buckets(params: dict, order: list[str], cap: int) -> list[list[str]]:
    name_of = {id(params[n]): n for n in order}
    return [[name_of[id(p)] for p in b] for b in reference_buckets([params[n] for n in order], cap)]


# Models a training loop hands the sync: 2 to 4 parameters (0-d, one element, odd, matrices) in fp32, fp64, fp16 or
# bf16, every other one in fp32 or not (a bf16 model keeps its norms in fp32), an empty parameter or not, a frozen one
# or not; caps smaller than any trainable parameter, of half of them and of all of them.
BUCKETS = Space(dtype=One(DTYPES), shapes=Many(Shape(("one", "odd", "matrix", "0-d")), 2, 4),
                fp32_norms=One((False, True)), empty=One((False, True)), frozen=One((False, True)))


def _bucket_params(case: dict) -> tuple[list, list]:
    """The weights of a drawn model (named p0, p1, ... in this order) and which of them are frozen."""
    shapes = list(case["shapes"]) + [(0,)] * case["empty"] + [(3,)] * case["frozen"]
    dtypes = [torch.float32 if case["fp32_norms"] and i % 2 else case["dtype"] for i in range(len(shapes))]
    weights = [generated.tensor(case, s, d, i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    return weights, [len(shapes) - 1] if case["frozen"] else []


def _param_words(shape: tuple, dtype: torch.dtype, transposed: bool = False) -> str:
    """A parameter in words: "float16, 1 element", "float64, 3×5 stored transposed", "float32, 0-d"."""
    size = (f"{shape[0]} element{'s' * (shape[0] > 1)}" if len(shape) == 1 and shape[0] else
            generated.shape_words(shape))
    return f"{generated.name(dtype)}, {size}" + (" stored transposed" if transposed and len(shape) == 2 and
                                                 min(shape) > 1 else "")


def _bucket_words(case: dict) -> str:
    weights, frozen = _bucket_params(case)
    params = [_param_words(tuple(w.shape), w.dtype) + (" frozen" if i in frozen else "") for i, w in enumerate(weights)]
    return f"a model with parameters [{'; '.join(params)}]"


def _buckets_drawn(ctx, case: dict) -> str | None:
    weights, frozen = _bucket_params(case)
    params = dict(Drawn(weights, frozen).named_parameters())
    sizes = [_nbytes(p) for p in params.values() if p.requires_grad and p.numel()]
    caps = sorted({min(sizes) - 1, sum(sizes) // 2, sum(sizes)})
    for cap, got in zip(caps, ctx.probe("buckets_drawn", weights, frozen, caps).value):
        got = _as_names(got, f"assign_buckets(model, {cap})")
        flat = [n for b in got for n in b]
        trainable = [n for n, p in params.items() if p.requires_grad]
        if sorted(flat) != sorted(trainable):
            return (f"with a cap of {cap} bytes the buckets hold {sorted(flat)}; the trainable parameters are "
                    f"{trainable}, each once")
        want = _name_buckets(params, flat, cap)  # in the learner's own order: a wrong order costs the order check
        if got != want:
            bytes_of = [[_nbytes(params[n]) for n in b] for b in got]
            return (f"with a cap of {cap} bytes the buckets are {got}, of {bytes_of} bytes; filling each as far as "
                    f"the cap allows, at numel() * element_size() bytes a parameter, gives {want}")
    return None


# --- the sync, during training ----------------------------------------------------------------------------


def _inputs(ctx, spec: dict, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(4, spec["widths"][0], generator=ctx.generator("x", rank, step))
    return x.to(spec["weights"]["0.weight"].dtype)


def _gradients(ctx, spec: dict, step: int) -> tuple[dict, list[dict]]:
    """The average over ranks of each rank's gradient in ``step``, and each rank's own."""
    own = []
    for r in range(ctx.world_size):
        model = build_model(spec)
        loss_of(model, _inputs(ctx, spec, r, step)).backward()
        own.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    mean = {n: sum(g[n] for g in own) / ctx.world_size for n in own[0]}
    return mean, own


def _close(got, want) -> bool:
    return torch.is_tensor(got) and got.shape == want.shape and bool(torch.allclose(got, want, atol=1e-6))


def _train(ctx, steps: int, hold_s: float = 0.0, dtype=torch.float32) -> tuple[list, dict, int]:
    """``steps`` steps through the learner's sync on every rank (the last rank pausing ``hold_s`` at its first
    gradient), the model in ``dtype``; fails unless the gradients after each finish() are the averages. Returns
    the Outcomes, the model's spec and the cap."""
    spec = _spec(ctx, dtype)
    cap = _caps(spec)[2]  # at least two buckets
    n = ctx.world_size
    expected = [_gradients(ctx, spec, s) for s in range(steps)]
    outs = ctx.probe_all("train", [(spec, cap, [_inputs(ctx, spec, r, s) for s in range(steps)],
                                    hold_s if r == n - 1 else 0.0) for r in range(n)])
    for out in outs:
        r = out.rank
        for s, ((want, own), got) in enumerate(zip(expected, out.value["steps"])):
            launched = [c for c in _step_comm(out, s) if c["op"] == "all_reduce"]
            for name, g in got["grads"].items():
                if name not in want:
                    if g is not None:
                        raise Fail(f"rank {r}: the frozen parameter {name} has a gradient after finish()")
                    continue
                problem = describe_mismatch(f"rank {r}, step {s + 1}: {name}.grad after finish()", g, want[name])
                if problem is None:
                    continue
                if s > 0 and _close(g, expected[0][0][name]):
                    problem += "; it is the first step's average, left in place"
                elif n > 1 and _close(g, own[r][name] / n):
                    problem += (f"; it is this rank's own gradient divided by the world size: no all-reduce of it "
                                f"ran in this step (this step started {len(launched)} all-reduce"
                                f"{'s' * (len(launched) != 1)})")
                elif n > 1 and _close(g, own[r][name]):
                    problem += "; it is this rank's own gradient, not averaged"
                elif n > 1 and _close(g, want[name] * n):
                    problem += f"; it is {n} times the average: the sum, not divided by the world size"
                raise Fail(problem)
    return outs, spec, cap


def _step_comm(out, step: int) -> list[dict]:
    """The collectives ``out``'s rank issued during step ``step`` (from its start to the end of its finish())."""
    info = out.value["steps"]
    start = info[step]["start"]
    end = info[step + 1]["start"] if step + 1 < len(info) else float("inf")
    return [c for c in out.comm if start <= c["t"] < end]


@EXERCISE.check("finish() leaves the averaged gradients", points=1, world_size=2, hint=(
    "Each hook copies p.grad into its place in the bucket's flat buffer; the all-reduce sums the buffers of "
    "all ranks in place. After waiting for it, divide by the world size and copy each parameter's slice back "
    "into p.grad, shaped like the parameter. A gradient may be strided (a parameter stored transposed), where "
    "p.grad.view(-1) raises: flatten with .reshape(-1), and copy back with p.grad.copy_(piece.view_as(p))."))
def averages(ctx):
    _train(ctx, 1)
    generated.for_all(ctx, SYNCS, lambda case: _syncs_drawn(ctx, case), count=4, describe=_sync_words)


# Models trained through the sync: a matrix and 0 to 3 other parameters (0-d, one element, odd, matrices, empty), in
# one of fp32, fp64, fp16 and bf16; matrices stored transposed or not (their gradients strided alike, as autograd makes
# them); a cap smaller than any parameter or of half the model. One step: a second is its own check.
SYNCS = Space(pairs=("layout", "cap"), matrix=Shape(("matrix",)), others=Many(Shape(), 0, 3), dtype=One(DTYPES),
              layout=One(("contiguous", "transposed")), cap=One(("half the model", "below every parameter")))


def _sync_words(case: dict) -> str:
    transposed = case["layout"] == "transposed"
    params = "; ".join(_param_words(s, case["dtype"], transposed) for s in (case["matrix"], *case["others"]))
    return f"{case['cap']} as the cap, a model with parameters [{params}]"


def _syncs_drawn(ctx, case: dict) -> str | None:
    n, dtype = ctx.world_size, case["dtype"]
    shapes = (case["matrix"], *case["others"])
    weights = [generated.tensor(case, s, dtype, "weight", i) for i, s in enumerate(shapes)]
    steps = [[[generated.tensor(case, s, dtype, "x", r, i) for i, s in enumerate(shapes)]] for r in range(n)]
    sizes = [w.numel() * w.element_size() for w in weights]
    cap = sum(sizes) // 2 if case["cap"] == "half the model" else max(min(sizes) - 1, 0)
    outs = ctx.probe_all("train_drawn", [(weights, case["layout"] == "transposed", cap, steps[r]) for r in range(n)])
    own = []  # each rank's gradients, as its autograd makes them
    for r in range(n):
        model = Drawn(weights)
        drawn_loss(model, steps[r][0]).backward()
        own.append([p.grad for p in model.parameters()])
    for out in outs:
        for i in range(len(shapes)):
            got = out.value[0].get(f"p{i}")
            want = (sum(g[i].double() for g in own) / n).to(dtype)
            problem = generated.mismatch(f"rank {out.rank}: p{i}.grad after finish()", got, want)
            if problem and torch.is_tensor(got) and contracts.same_bits(got, own[out.rank][i]):
                return f"{problem}; it is still this rank's own gradient, not averaged"
            if problem:
                return problem
    return None


@EXERCISE.check("one async all-reduce per bucket, during backward", points=2, world_size=2, hint=(
    "The point of buckets is overlap: a bucket's all-reduce should start inside backward, from the hook "
    "that brings its last gradient, with async_op=True, so that it travels while autograd goes on computing "
    "the earlier layers' gradients. Launching every bucket at the end — in finish(), or once the last "
    "gradient has arrived — sends the same bytes but overlaps nothing. finish() only waits for the handles. "
    "One message per bucket, not per parameter."))
def async_during_backward(ctx):
    outs, spec, cap = _train(ctx, 1, hold_s=HOLD_S)
    params = dict(build_model(spec).named_parameters())
    for out in outs:
        r = out.rank
        # One per bucket of the learner's own buckets: a wrong order costs only the order check.
        buckets = _as_names(out.value["buckets"], "BucketedGradientSync.buckets")
        if any(n not in params for b in buckets for n in b):
            raise Fail("BucketedGradientSync.buckets names something that is not a parameter of the model")
        step = out.value["steps"][0]
        calls = [c for c in _step_comm(out, 0) if c["op"] == "all_reduce"]
        if not calls:
            raise Fail(f"rank {r} started no all-reduce")
        want = sorted(sum(_nbytes(params[n]) for n in b) for b in buckets)
        got = sorted(c["bytes"] for c in calls)
        if got != want:
            raise Fail(f"rank {r} started {len(calls)} all-reduces of {got} bytes; its {len(buckets)} buckets "
                       f"hold {want} bytes: one all-reduce per bucket, of the bucket's whole buffer")
        # The records agree; so must the wire: what reached the other rank, by the kernel's count, is those
        # all-reduces' and nothing else's (the probe itself sends nothing).
        counted, _ = ctx.wire(outs)
        if counted is not None and ctx.world_size == 2:
            wire = sum(traffic.all_reduce_of_two(sum(params[n].numel() for n in b), params[b[0]].element_size())
                       for b in buckets if b)
            if counted.sent(r, 1 - r) != wire:
                raise Fail(f"rank {r} sent rank {1 - r} {counted.sent(r, 1 - r)} bytes by the kernel's count; one "
                           f"all-reduce of each of its {len(buckets)} buckets ({sum(want)} bytes of gradients) puts "
                           f"{wire} on the wire, gloo's framing included: something else went between the ranks, "
                           f"whether torch.distributed saw it or not")
        first = min(c["t"] for c in calls)
        if not step["computed"]:
            raise Fail(f"rank {r}: no gradient of the model was computed in backward")
        last_grad = max(step["computed"].values())
        last_name = max(step["computed"], key=step["computed"].get)
        if first >= step["backward_end"]:
            raise Fail(f"rank {r} started all {len(calls)} all-reduces after backward had returned (in finish()?), "
                       f"so none of the communication overlaps backward")
        if first >= last_grad:
            raise Fail(f"rank {r} started its first all-reduce {1e3 * (first - step['start']):.1f} ms into the "
                       f"step, after the last gradient ({last_name}, at {1e3 * (last_grad - step['start']):.1f} "
                       f"ms) had been computed: every bucket was sent once backward had made all the gradients, "
                       f"so no communication overlaps the computation of gradients")
        if r == 0:
            # The last rank paused HOLD_S at its first gradient, before it could launch anything. An
            # all-reduce that rank 0 waits for in backward holds rank 0's backward up as long; one left to
            # travel lets rank 0 go on computing its next gradient at once.
            after = [t for t in step["computed"].values() if t > first]
            gap = min(after) - first
            if gap > HOLD_S / 2:
                raise Fail(f"rank 0's backward stood still for {1e3 * gap:.0f} ms after it started its first "
                           f"all-reduce, while rank {ctx.world_size - 1} was {1e3 * HOLD_S:.0f} ms late: it "
                           f"waited for the all-reduce inside backward (a blocking call, or .wait() in the hook) "
                           f"instead of letting it travel while backward goes on")


@EXERCISE.check("a second step works too", points=1, world_size=2, hint=(
    "After finish() the sync must be ready for the next backward: reset whatever counts the gradients that "
    "have arrived, and forget the finished handles. Training calls backward and finish() once per step."))
def second_step(ctx):
    _train(ctx, 2)


@EXERCISE.check("the contract: a float64 model's gradients averaged in float64 (2 ranks)", points=1, world_size=2,
                hint=(
    "Make each bucket's buffer in its gradients' dtype, torch.zeros(n, dtype=p.dtype): one made without dtype= is "
    "float32, so a float64 model's gradients come back rounded to float32 (and a bf16 model's all-reduce moves "
    "twice the bytes it should)."))
def contract(ctx):
    outs, spec, _ = _train(ctx, 1, dtype=torch.float64)
    want, _ = _gradients(ctx, spec, 0)
    for out in outs:
        for name, g in out.value["steps"][0]["grads"].items():
            if name in want:
                contracts.expect_precision(SYNC, f"rank {out.rank}'s {name}.grad after finish()", g, want[name],
                                           f"{ctx.world_size} ranks, a float64 model")


@EXERCISE.check("3 ranks", points=1, world_size=3, hint=(
    "Divide by dist.get_world_size(), whatever it is; nothing in the buckets depends on the number of ranks."))
def three_ranks(ctx):
    _train(ctx, 1)
