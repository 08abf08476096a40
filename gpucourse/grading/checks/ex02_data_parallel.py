"""Checks of exercise 2: data-parallel gradient averaging, against one device taking the same step.

Every input is made here and each rank is sent its own: the weights (the same
on every rank), the gradients each rank holds, the global batch. The probes
(``gpucourse/grading/probes/ex02_data_parallel.py``) build the awkward model
there, run the learner's function on it and report what they saw; the expected
gradients and weights are computed here, on a model of our own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import contracts, generated
from ..core import Exercise, Fail, describe_mismatch
from ..generated import DTYPES, Int, Many, One, Shape, Space
from ..probes.ex02_data_parallel import Net, build_net, make_optimizer

EXERCISE = Exercise("ex02_data_parallel", "Data-parallel gradient averaging", "notebooks/02_data_parallelism.ipynb",
                    forbidden_names=("torch.nn.parallel.DistributedDataParallel",
                                     "torch.nn.parallel.distributed.DistributedDataParallel"),
                    refusal=("this exercise switches off {op}: average the gradients yourself, with "
                             "torch.distributed's collectives"),
                    rank_imports=("torch._dynamo",),  # the checks' SGD steps import it
                    concept=("after the exchange every rank must hold the same gradients, those of one device on the "
                             "whole global batch, whatever the world size"),
                    section="§2 (data parallelism from scratch) and §3 (the equality proof)")

BATCH, LR = 6, 0.5  # 6 rows: 2 and 3 ranks both divide it
TRAINABLE = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")  # the parameters a forward gives a gradient
NO_GRAD = ("scale", "unused")                                       # frozen, and never used

# What every caller of the step relies on besides the weights (gpucourse.grading.contracts): the batch it is handed
# comes back bit for bit, and may be a view with any strides (the probe "step" hands the learner its first two
# arguments as they came, and reports them after the call).
STEP = contracts.Contract("data_parallel_step", ("inputs", "targets"), unchanged=("inputs", "targets"),
                          strided=("inputs", "targets"))


def _weights(ctx) -> dict:
    """The model's weights (the same on every rank); the frozen scale is near 1."""
    g = ctx.generator("weights")
    return {n: torch.randn(p.shape, generator=g) * 0.5 + (1.0 if n == "scale" else 0.0)
            for n, p in Net().named_parameters()}


def _batch(ctx):
    g = ctx.generator("batch")
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def _rank_gradients(ctx, weights: dict, key: str) -> list[dict]:
    """Each rank's gradients of the trainable parameters.

    ``"fixed"``: rank r's are 2**r times a ramp from 1 to 2, so their mean is never any rank's own and
    never 0 — the sum, the mean, the mean divided again and a rank's own gradient all differ, on every
    seed. ``"random"``: normal, from the run's seed.
    """
    out = []
    for r in range(ctx.world_size):
        g = ctx.generator("grads", key, r)
        grads = {}
        for n in TRAINABLE:
            shape = weights[n].shape
            if key == "fixed":
                grads[n] = (2.0 ** r) * torch.linspace(1.0, 2.0, weights[n].numel()).reshape(shape)
            else:
                grads[n] = torch.randn(shape, generator=g)
        out.append(grads)
    return out


def _scale_sentence(what: str, got: torch.Tensor, want: torch.Tensor, n: int) -> str | None:
    """A sentence if ``got`` is a constant multiple c of ``want`` that says what c means, else None."""
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    if not bool((w.abs() > 1e-6).any()):
        return None
    c = float((g @ w) / (w @ w))
    if not torch.allclose(g, c * w, atol=1e-5, rtol=1e-4):
        return None
    if abs(c - n) < 1e-3 * n:
        return f"{what} is {n} times what it should be: summed over the ranks, but not divided by their number"
    if abs(c - 1 / n) < 1e-3 / n:
        return f"{what} is 1/{n} of what it should be: divided by the number of ranks twice"
    if abs(c) < 1e-6:
        return f"{what} is zero"
    k = n / c
    if abs(k - round(k)) < 1e-3 and 1 <= round(k) <= 4 * n and round(k) != n:
        return (f"{what} is {n}/{round(k)} of what it should be: the sum over {n} ranks divided by {round(k)}, "
                f"not by the world size")
    return f"{what} is {c:.4g} times what it should be"


# --- average_gradients ---------------------------------------------------------------------------------------


def _average(ctx, key: str) -> tuple[list, list, dict]:
    """``average_gradients`` on every rank, each holding its own gradients: the Outcomes, the gradients, the weights."""
    weights = _weights(ctx)
    grads = _rank_gradients(ctx, weights, key)
    return ctx.probe_all("average", [(weights, grads[r]) for r in range(ctx.world_size)]), grads, weights


def _judge_average(ctx, outs: list, grads: list, weights: dict) -> None:
    n = ctx.world_size
    for out in outs:
        r = out.rank
        for name in TRAINABLE:
            got = out.value["grads"].get(name)
            want = sum(g[name] for g in grads) / n
            if got is None:
                raise Fail(f"rank {r}: {name}.grad is None after average_gradients; it held a gradient before")
            problem = describe_mismatch(f"rank {r}: {name}.grad", got, want)
            if problem is None:
                continue
            if torch.is_tensor(got) and got.shape == want.shape:
                if torch.equal(got, grads[r][name]):
                    raise Fail(f"{problem}; it is still this rank's own gradient, not averaged with the others'")
                if torch.allclose(got.double(), grads[r][name].double() / n, atol=1e-6, rtol=1e-5):
                    raise Fail(f"{problem}; it is this rank's own gradient divided by {n}: divided, but no sum "
                               f"over the ranks reached it")
                scale = _scale_sentence(f"rank {r}: {name}.grad", got, want, n)
                if scale:
                    raise Fail(f"{problem}; {scale}")
            raise Fail(problem)
        for name, before in weights.items():
            after = out.value["weights"].get(name)
            if not (torch.is_tensor(after) and after.shape == before.shape and torch.equal(after, before)):
                raise Fail(f"rank {r}: average_gradients changed the weights of {name}; only .grad may change")


@EXERCISE.check("average_gradients averages over 2 ranks", points=2, world_size=2, hint=(
    "dist.all_reduce sums a tensor over the ranks, in place. The average is that sum divided by the world "
    "size, once. Each rank must end with the same gradients, and only .grad may change. All-reduce p.grad "
    "itself: for a parameter stored transposed .reshape(-1) and .flatten() hand you a copy, whose average never "
    "reaches p.grad, and a model with no gradient at all makes torch.cat([]) raise."))
def averages(ctx):
    for key in ("fixed", "random"):
        _judge_average(ctx, *_average(ctx, key))
    generated.for_all(ctx, MODELS, lambda case: _averages_drawn(ctx, case), count=6, describe=_model_words)


# Models a training loop hands average_gradients: a matrix and 0 to 3 other parameters (0-d, one element, odd,
# empty), in one of fp32, fp64, fp16 and bf16; matrices stored transposed or not, their gradients strided alike, as
# autograd makes them; a gradient on every parameter, on every other one, or on none; rank 0's all exactly zero.
MODELS = Space(pairs=("layout", "grads"), matrix=Shape(("matrix",)), others=Many(Shape(), 0, 3), dtype=One(DTYPES),
               layout=One(("contiguous", "transposed")), grads=One(("every", "every other", "no")),
               zero=One((False, True)))


def _model_words(case: dict) -> str:
    transposed = case["layout"] == "transposed"
    shapes = [generated.shape_words(s) + (" stored transposed" if transposed and len(s) == 2 and min(s) > 1 else "")
              for s in (case["matrix"], *case["others"])]
    return (f"a {generated.name(case['dtype'])} model with parameters [{', '.join(shapes)}], a gradient on "
            f"{case['grads']} parameter{'s' * (case['grads'] == 'no')}"
            + (", rank 0's gradients all exactly zero" if case["zero"] else ""))


def _averages_drawn(ctx, case: dict) -> str | None:
    shapes, dtype, n = (case["matrix"], *case["others"]), case["dtype"], ctx.world_size
    weights = [generated.tensor(case, s, dtype, "weight", i) for i, s in enumerate(shapes)]
    has = [case["grads"] == "every" or (case["grads"] == "every other" and i % 2 == 0) for i in range(len(shapes))]
    grads = [[generated.tensor(case, s, dtype, "grad", r, i) * (0 if r == 0 and case["zero"] else 1) if h else None
              for i, (s, h) in enumerate(zip(shapes, has))] for r in range(n)]
    outs = ctx.probe_all("average_drawn", [(weights, grads[r], case["layout"] == "transposed") for r in range(n)])
    for out in outs:
        for i, (w, h) in enumerate(zip(weights, has)):
            got = out.value["grads"].get(f"p{i}")
            what = f"rank {out.rank}: p{i}.grad"
            if not h:
                if got is not None:
                    return f"{what} is {generated.kind(got)} after average_gradients; it was None, and must stay so"
                continue
            want = (sum(g[i].double() for g in grads) / n).to(dtype)
            problem = generated.mismatch(what, got, want)
            if problem and torch.is_tensor(got) and contracts.same_bits(got, grads[out.rank][i]):
                return f"{problem}; it is still this rank's own gradient, not averaged with the others'"
            if problem:
                return problem
            if not contracts.same_bits(out.value["weights"].get(f"p{i}"), w):
                return f"rank {out.rank}: average_gradients changed the weight p{i}; only .grad may change"
    return None


# --- data_parallel_step --------------------------------------------------------------------------------------


def _step_alone(weights: dict, x: torch.Tensor, y: torch.Tensor, optimizer: dict | None = None):
    """The step one device takes on rows ``x`` (plain SGD, or the optimizer ``optimizer`` describes): the model after
    it (its .grad the gradient of the mean loss), in the weights' dtype."""
    model = build_net(weights)
    opt = make_optimizer(model, LR, optimizer)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    return model


def _stale(ctx, weights: dict) -> dict:
    """Gradients left over from "an earlier step" (the same on every rank, as averaged ones would be), on
    every parameter that can hold one: the trainable ones and the unused one."""
    g = ctx.generator("stale")
    return {n: torch.rand(weights[n].shape, generator=g) + 1.0 for n in (*TRAINABLE, "unused")}


def _run_step(ctx, held: bool = False, strided: bool = False, dtype=torch.float32):
    """Every rank's data_parallel_step on the same global batch (``held``: held to its contract too, with a
    ``strided`` batch), in ``dtype``. The Outcomes, the weights, the gradients left over, the batch."""
    x, y = (t.to(dtype) for t in _batch(ctx))
    weights = {k: w.to(dtype) for k, w in _weights(ctx).items()}
    stale = {k: g.to(dtype) for k, g in _stale(ctx, weights).items()}
    args = [(x, y, weights, stale, LR)] * ctx.world_size
    outs = contracts.probe_all(ctx, STEP, "step", args, strided) if held else ctx.probe_all("step", args)
    return outs, weights, stale, x, y


@EXERCISE.check("each rank trains on its own share of the batch", points=2, world_size=2, hint=(
    "Data parallelism splits the global batch: with n ranks, rank r takes rows r*B/n to (r+1)*B/n and runs "
    "the model on those only. Running every rank on the whole batch gives the right weights at n times "
    "the cost, which is exactly what data parallelism is there to avoid."))
def own_share(ctx):
    outs, _, _, x, _ = _run_step(ctx)
    n = ctx.world_size
    share = BATCH // n
    for out in outs:
        r = out.rank
        mine = list(range(r * share, (r + 1) * share))
        seen = [s.reshape(-1, x.shape[1]) for s in out.value["seen"]
                if torch.is_tensor(s) and s.numel() and s.numel() % x.shape[1] == 0]
        if not seen:
            raise Fail(f"rank {r} never ran the model's forward on rows of the batch")
        rows = torch.cat(seen)
        if len(seen) == 1 and torch.equal(rows, x):
            raise Fail(f"rank {r} ran forward on all {BATCH} rows, the whole global batch, not its {share}")
        found = [next((i for i in range(BATCH) if torch.equal(row, x[i])), None) for row in rows]
        if sorted(i for i in found if i is not None) == mine and None not in found:
            continue
        where = ", ".join("?" if i is None else str(i) for i in found)
        times = f" {len(seen)} times" if len(seen) > 1 else ""
        raise Fail(f"rank {r} ran forward{times} on rows [{where}] of the batch; its share is rows {mine}, "
                   f"each once")


def _own_gradients(weights: dict, x: torch.Tensor, y: torch.Tensor, n: int) -> list[dict]:
    """Each rank's gradient from its own rows alone (what it holds before any averaging)."""
    share = BATCH // n
    out = []
    for r in range(n):
        m = build_net(weights)
        F.mse_loss(m(x[r * share:(r + 1) * share]), y[r * share:(r + 1) * share]).backward()
        out.append({k: p.grad.detach().clone() for k, p in m.named_parameters() if p.grad is not None})
    return out


def _flat(d: dict, like: dict) -> torch.Tensor:
    """The tensors of ``d``, in the order and shapes of ``like``, one after another (zeros where ``d`` has none)."""
    return torch.cat([(d[k] if d.get(k) is not None else torch.zeros_like(v)).reshape(-1).double()
                      for k, v in like.items()])


def _equals_single_device(ctx):
    outs, weights, stale, x, y = _run_step(ctx)
    n = ctx.world_size
    alone = _step_alone(weights, x, y)
    params = dict(alone.named_parameters())
    after = {k: params[k].detach() for k in (*TRAINABLE, *NO_GRAD)}
    grads = {k: params[k].grad.detach() for k in TRAINABLE}
    own = _own_gradients(weights, x, y, n)
    names = list(after)
    for out in outs:
        r = out.rank
        got = out.value["weights"]
        for k in names:
            problem = describe_mismatch(f"rank {r}: {k} after the step", got.get(k), after[k])
            if problem is None:
                continue
            if any(not torch.is_tensor(got.get(m)) or got[m].shape != after[m].shape for m in names):
                raise Fail(problem)
            change, want = _flat(got, after) - _flat(weights, after), _flat(after, after) - _flat(weights, after)
            if torch.allclose(change, want - LR * _flat(stale, after), atol=1e-5, rtol=1e-4):
                raise Fail(f"{problem}; rank {r}'s weights moved as if the gradients left over from an earlier "
                           f"step had been added to this step's")
            if n > 1 and torch.allclose(change, -LR * _flat(own[r], after), atol=1e-5, rtol=1e-4):
                raise Fail(f"{problem}; rank {r}'s weights moved by the gradient of its own rows alone, as if "
                           f"the gradients had not been averaged over the ranks")
            if n > 1 and torch.allclose(change, -LR / n * _flat(own[r], after), atol=1e-5, rtol=1e-4):
                raise Fail(f"{problem}; rank {r}'s weights moved by the gradient of its own rows divided by {n}: "
                           f"divided by the world size, but no sum over the ranks reached it")
            scale = _scale_sentence(f"the change of rank {r}'s weights", change, want, n)
            raise Fail(f"{problem}; {scale}" if scale else
                       f"{problem} (compared with one device taking the step on the whole batch)")
        # The weights are right; the gradients they were stepped with must be the averaged ones too.
        for k, want in grads.items():
            g = out.value["grads"].get(k)
            if g is None:
                continue  # cleared after the step: allowed
            problem = describe_mismatch(f"rank {r}: {k}.grad after the step", g, want)
            if problem is None:
                continue
            if n > 1 and torch.is_tensor(g) and g.shape == want.shape and \
                    torch.allclose(g, own[r][k], atol=1e-5, rtol=1e-4):
                raise Fail(f"{problem}; it is the gradient of rank {r}'s own rows alone: the gradients were not "
                           f"averaged before the step (the weights agree, so they were made equal some other "
                           f"way, such as averaging the weights after the step, which matches only for plain SGD)")
            raise Fail(f"{problem} (one device's step leaves the gradient of the mean loss over the whole batch)")
        steps = out.value["steps"]
        reduced = [c for c in out.comm if c["op"] in ("all_reduce", "reduce", "all_gather", "reduce_scatter")]
        if n > 1 and steps and reduced and all(c["t"] > steps[0] for c in reduced):
            raise Fail(f"rank {r} communicated only after the optimizer step: its weights were averaged, not its "
                       f"gradients, which matches the single device only for plain SGD")


@EXERCISE.check("one step on 2 ranks equals the single-device step", points=2, world_size=2, hint=(
    "Every rank's loss is a mean over its share, so averaging the ranks' gradients (dividing the sum by n "
    "once) gives the gradient of the mean over the whole batch. Clear the gradients left from an earlier "
    "step before backward (optimizer.zero_grad()), or they are added in. Average the gradients, not the "
    "weights, before optimizer.step(): with momentum or Adam only that is the single device's step, and "
    "optimizer.step() itself takes it, whatever the optimizer and its parameter groups."))
def equals_single_2(ctx):
    _equals_single_device(ctx)
    generated.for_all(ctx, STEPS, lambda case: _steps_drawn(ctx, case), count=6, describe=_step_words)


# Steps a training loop takes: 1 to 3 rows a rank, plain SGD, SGD with Nesterov momentum or Adam, each with a float32
# and a float64 model (Adam's first step hardly depends on the gradients' rounding: plain SGD's shows it), over one
# parameter group or two with their own learning rates.
STEPS = Space(pairs=("optimizer", "dtype"), optimizer=One(("SGD", "SGD with Nesterov momentum", "Adam")),
              dtype=One((torch.float32, torch.float64)), groups=Int(1, 2), rows=Int(1, 3))


def _step_words(case: dict) -> str:
    groups = "one parameter group" if case["groups"] == 1 else f"2 parameter groups (lr {LR:g} and {LR / 5:g})"
    return (f"{case['rows']} row{'s' * (case['rows'] > 1)} a rank, a {generated.name(case['dtype'])} model, "
            f"{case['optimizer']} over {groups}")


def _steps_drawn(ctx, case: dict) -> str | None:
    n, dtype = ctx.world_size, case["dtype"]
    rows = n * case["rows"]
    x, y = generated.tensor(case, (rows, 5), dtype, "x"), generated.tensor(case, (rows, 3), dtype, "y")
    weights = {k: w.to(dtype) for k, w in _weights(ctx).items()}
    spec = {"kind": case["optimizer"], "groups": case["groups"]}
    outs = ctx.probe_all("step", [(x, y, weights, {}, LR, spec)] * n)
    alone = dict(_step_alone(weights, x, y, spec).named_parameters())
    for out in outs:
        for k in (*TRAINABLE, *NO_GRAD):
            problem = generated.mismatch(f"rank {out.rank}: {k} after the step", out.value["weights"].get(k),
                                         alone[k].detach())
            if problem:
                return f"{problem} (compared with one device taking the step on the whole batch)"
    return None


@EXERCISE.check("the contract: the batch left as it was, views accepted, float64 kept (2 ranks)", points=1,
                world_size=2, hint=(
    "The caller keeps using the batch it handed you: take this rank's rows by slicing, inputs[lo:hi], which works "
    "on a view with any strides (a transposed matrix) where .view(...) refuses, and never write into inputs or "
    "targets. A float64 model must be averaged in float64: a buffer made with torch.zeros(n), without dtype=, is "
    "float32 and rounds every gradient that passes through it."))
def contract(ctx):
    for strided in (False, True):  # contiguous first, so that an error there is not blamed on the views
        outs, weights, _, x, y = _run_step(ctx, held=True, strided=strided, dtype=torch.float64)
        alone = dict(_step_alone(weights, x, y).named_parameters())
        sent = tuple(map(contracts.as_strided_view, (x, y))) if strided else (x, y)
        case = contracts.describe_case(STEP, sent, ctx.world_size)
        for out in outs:
            for k in TRAINABLE:
                contracts.expect_precision(STEP, f"rank {out.rank}'s {k} after the step", out.value["weights"].get(k),
                                           alone[k].detach(), case)


@EXERCISE.check("average_gradients skips parameters without a gradient", points=1, world_size=3, hint=(
    "A frozen parameter (requires_grad=False), or one the forward did not use, has .grad None on every "
    "rank: there is nothing to average, so leave it None rather than giving it a gradient."))
def skips_none(ctx):
    outs, grads, weights = _average(ctx, "random")
    for out in outs:
        for name in NO_GRAD:
            if out.value["grads"].get(name) is not None:
                why = "frozen (requires_grad False)" if name == "scale" else "not used by the forward"
                raise Fail(f"rank {out.rank}: {name} ({why}) had no gradient, but has one after average_gradients")
    _judge_average(ctx, outs, grads, weights)


@EXERCISE.check("one step on 3 ranks equals the single-device step", points=2, world_size=3, hint=(
    "The same step on 3 ranks: each takes 2 of the 6 rows. Divide by the world size you are running on "
    "(dist.get_world_size()), not by a number written into the code."))
def equals_single_3(ctx):
    _equals_single_device(ctx)
