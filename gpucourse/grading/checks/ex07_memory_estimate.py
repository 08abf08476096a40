"""Checks of exercise 7: bytes of model state per rank, and the largest microbatch, against gpucourse.modeled.memory.

The learner's functions run in the sandbox, where gpucourse.modeled.memory cannot be imported (the host's
HIDDEN_MODULES); the expected values are computed here, with gpucourse.modeled.memory and a real AdamW step.
"""

from __future__ import annotations

import math

import torch

from ...config import TrainConfig
from ...measure import optimizer_state_bytes, tensor_bytes
from ...modeled.memory import estimate, estimate_params, largest_microbatch, with_microbatch
from ...model import MODELS, build_model
from ...optim import MasterWeightsAdamW, make_optimizer
from .. import generated
from ..core import Exercise, Fail
from ..generated import Int, One, Space

EXERCISE = Exercise("ex07_memory_estimate", "Memory estimate", "notebooks/07_memory_batch.ipynb",
                    concept=("training memory is the model states, bytes per parameter by precision and by what ZeRO "
                             "shards, plus the activations each layer keeps for backward"),
                    section="§1 to §4, with notebook 03's §1 (sixteen bytes per parameter)")

KEYS = ("weights", "gradients", "optimizer")


def _describe(num: int, precision: str = "fp32", master_weights: bool = False, dp: int = 1, zero: int = 0) -> str:
    return f"model_state_bytes({num:,}, {precision!r}, master_weights={master_weights}, dp={dp}, zero={zero})"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _call(ctx, num: int, precision: str = "fp32", master_weights: bool = False, dp: int = 1,
          zero: int = 0) -> tuple[str, dict]:
    call = _describe(num, precision, master_weights, dp, zero)
    got = ctx.call("model_state_bytes", num, precision, master_weights, dp, zero).value
    if not isinstance(got, dict) or sorted(got, key=str) != sorted(KEYS):
        keys = sorted(got, key=str) if isinstance(got, dict) else type(got).__name__
        raise Fail(f"{call} returned {keys}, not a dict with the keys {', '.join(KEYS)}")
    bad = [k for k in KEYS if not _number(got[k])]
    if bad:
        raise Fail(f"{call} gave {bad[0]} = {got[bad[0]]!r}; expected a number of bytes")
    return call, got


def _per_param(mem: dict, num: int) -> str:
    return ", ".join(f"{mem[k] / num:g}" for k in KEYS)


def _formula(num: int, precision: str, master: bool, *, half_if=None, weight: int | None = None,
             moments: int = 8, master_copy: bool = True, scale: int = 1) -> dict:
    """Unsharded bytes by a formula with one piece changed (the known wrong answers below)."""
    half = (half_if or (lambda p, m: p != "fp32" and m))(precision, master)
    w = weight if weight is not None else (2 if half else 4)
    opt = moments + (4 if half and master_copy else 0)
    return {"weights": scale * w * num, "gradients": scale * w * num, "optimizer": scale * opt * num}


# A wrong answer is named when its formula gives every answer of the check, right and wrong alike.
UNSHARDED_MISTAKES = {
    "Adam's state counted as one moment (4 bytes); Adam keeps two, exp_avg and exp_avg_sq, 4 bytes each":
        dict(moments=4),
    "no fp32 master copy: with half-precision weights the optimizer keeps one (4 bytes) beside the two moments":
        dict(master_copy=False),
    "autocast counted as half-precision weights: autocast (master_weights=False) keeps the parameters, their "
    "gradients and the moments in fp32":
        dict(half_if=lambda p, m: p != "fp32"),
    "an fp32 model given half-precision weights and a master copy: master weights mean nothing in fp32":
        dict(half_if=lambda p, m: m),
    "the weights and gradients kept in fp32 beside the master copy: with master weights they are half "
    "precision, 2 bytes":
        dict(weight=4),
    "bits, not bytes": dict(scale=8),
}


def _unsharded(ctx, cases) -> None:
    """dp=1: compare, and say it per parameter, where the 16 bytes are easiest to see."""
    answers = []
    for num, precision, master in cases:
        call, got = _call(ctx, num, precision, master)
        answers.append((num, precision, master, call, got, estimate_params(num, 1, 0, precision, master)))
    wrong = [a for a in answers if a[4] != a[5]]
    if not wrong:
        return
    named = [name for name, change in UNSHARDED_MISTAKES.items()
             if all(got == _formula(num, p, m, **change) for num, p, m, _, got, _ in answers)]
    num, _, _, call, got, want = wrong[0]
    raise Fail(f"{call} = {got}; expected {want} (per parameter: weights, gradients, optimizer "
               f"{_per_param(got, num)} bytes; expected {_per_param(want, num)})"
               f"{f' — {named[0]}' if len(named) == 1 else ''}")


def _sizes(ctx, low: int, high: int, count: int) -> list[int]:
    g = ctx.generator("sizes", low, high)
    return [int(torch.randint(low, high, (1,), generator=g)) for _ in range(count)]


@EXERCISE.check("fp32 with Adam: 16 bytes per parameter", points=2, hint=(
    "Per parameter, fp32 training keeps the weight (4 bytes), its gradient (4) and Adam's two moments, "
    "exp_avg and exp_avg_sq (4 + 4 = 8): 16 bytes, before a single activation. A 7B model needs 112 GB for "
    "that alone, more than one 80 GB GPU."))
def fp32(ctx):
    _unsharded(ctx, [(n, "fp32", False) for n in [1, 7, 1000, 124_439_808, 7_000_000_000]
                     + _sizes(ctx, 1, 10**9, 5)])


@EXERCISE.check("half precision: master weights, or autocast", points=2, hint=(
    "Autocast (master_weights=False) keeps fp32 parameters, gradients and moments and only casts each "
    "matmul's inputs: the state is fp32's 4 + 4 + 8 bytes. Half-precision weights (master_weights=True) "
    "take 2 bytes, their gradients 2, and the optimizer needs an fp32 master copy (4) to add tiny updates to "
    "without rounding them away, beside the two fp32 moments (8): 2 + 2 + 12, still 16. Master weights mean "
    "nothing for an fp32 model."))
def half(ctx):
    cases = [(n, p, m) for n in [1, 3, 1_558_000_000] + _sizes(ctx, 1, 10**9, 3)
             for p in ("bf16", "fp16") for m in (False, True)]
    _unsharded(ctx, cases + [(1000, "fp32", True)])


def _elements(num: int, dp: int, zero: int, shard: int | None = None, padded_stages=(1, 2)) -> dict:
    """Elements of each category one rank holds (what ``estimate_params`` multiplies by bytes per element);
    ``shard`` and ``padded_stages`` changed give the known wrong answers."""
    shard = math.ceil(num / dp) if shard is None else shard
    flat = shard * dp if zero in padded_stages else num
    return {"weights": shard if zero == 3 else flat, "gradients": shard if zero >= 2 else flat,
            "optimizer": shard if zero >= 1 else num}


def _rounding_mistake(num: int, dp: int, zero: int, got: dict, want: dict) -> str:
    """A sentence naming how the whole answer went wrong when dp does not divide num, if a known way explains
    all three numbers (bytes per element as expected, element counts by a wrong rule)."""
    if num % dp == 0:
        return ""
    elements, shard = _elements(num, dp, zero), math.ceil(num / dp)
    per = {k: want[k] // elements[k] for k in KEYS}

    def by(rule: dict) -> bool:
        return got == {k: per[k] * rule[k] for k in KEYS}

    if by(_elements(num, dp, zero, shard=num // dp)):
        return (f" — the shard rounded down: floor({num:,} / {dp}) = {num // dp:,} leaves the last "
                f"{num - dp * (num // dp)} parameters to no rank; S = ceil({num:,} / {dp}) = {shard:,} per shard")
    if by(_elements(num, dp, zero, padded_stages=(0, 1, 2))):
        return (f" — {shard * dp:,} weights, a flat buffer padded to S·dp (S = ceil({num:,} / {dp}) = {shard:,}); "
                f"only stages 1 and 2 keep that buffer: stage 0 shards nothing and holds the {num:,} parameters")
    if by(_elements(num, dp, zero, padded_stages=())):
        return (f" — {num:,} unsharded elements, num_params; stages 1 and 2 keep every weight in one flat buffer "
                f"padded to S·dp = {shard * dp:,} elements (S = ceil({num:,} / {dp}))")
    return ""


def _sharded(ctx, cases) -> None:
    for num, dp, zero, precision, master in cases:
        call, got = _call(ctx, num, precision, master, dp, zero)
        want = estimate_params(num, dp, zero, precision, master)
        if got == want:
            continue
        elements = _elements(num, dp, zero)
        key = next(k for k in KEYS if got[k] != want[k])
        n, per = elements[key], want[key] // elements[key]
        why = _rounding_mistake(num, dp, zero, got, want)
        if why:
            pass
        elif dp > 1 and got[key] * dp == want[key]:
            why = f" — a 1/{dp} shard, but stage {zero} does not shard the {key}"
        elif dp > 1 and got[key] == want[key] * dp:
            why = f" — all of them, but stage {zero} shards the {key} over the {dp} ranks"
        elif got[key] % n == 0:
            why = f" — {got[key] // n} bytes for each of its {n:,} elements, expected {per}"
        else:
            why = (f" — {got[key] / per:,g} elements of {per} bytes, expected {n:,}" +
                   (f" (ceil({num:,} / {dp}) = {math.ceil(num / dp):,} per shard)" if num % dp else ""))
        raise Fail(f"{call}: {key} {got[key]:,} bytes, expected {want[key]:,}{why}")


@EXERCISE.check("ZeRO stages 1 to 3 shard over dp", points=2, hint=(
    "Each ZeRO stage shards one more category over the dp ranks: stage 1 the optimizer state (the largest: "
    "8 or 12 bytes per parameter), stage 2 the gradients too, stage 3 the weights too. Whatever a stage "
    "does not shard, every rank holds in full. 16 bytes per parameter under ZeRO-3 on 64 GPUs is 0.25."))
def zero_stages(ctx):
    g = ctx.generator()
    cases = [(8000, 8), (7_000_000_000, 64), (1200, 3), (6, 2)]
    for _ in range(4):
        dp = int(torch.randint(2, 65, (1,), generator=g))
        cases.append((dp * int(torch.randint(1, 10**7, (1,), generator=g)), dp))
    _sharded(ctx, [(n, dp, z, p, m) for n, dp in cases for z in range(4)
                   for p, m in (("fp32", False), ("bf16", True), ("fp16", False))])


@EXERCISE.check("shards round up, and stages 1 and 2 pad the buffer", points=1, hint=(
    "When dp does not divide the parameter count, every rank still holds a shard of the same size, "
    "S = ceil(num_params / dp), the last one padded (rounding down would leave the last parameters to no "
    "rank). Stages 1 and 2 keep all weights in one flat buffer of S·dp elements, so what they do not shard "
    "is S·dp elements, a little more than num_params; stage 3 holds S of everything, and stage 0, which "
    "shards nothing, keeps num_params of everything, unpadded. Every count is whole: an int of bytes."))
def rounding(ctx):
    cases = [(10, 4), (7, 8), (1_000_001, 8), (5, 3), (1, 2)]
    g = ctx.generator()
    while len(cases) < 9:
        num, dp = int(torch.randint(1, 10**6, (1,), generator=g)), int(torch.randint(2, 33, (1,), generator=g))
        if num % dp:
            cases.append((num, dp))
    _sharded(ctx, [(n, dp, z, p, m) for n, dp in cases for z in (1, 2, 3, 0)
                   for p, m in (("fp32", False), ("bf16", True))])
    generated.for_all(ctx, STATE_CASES, lambda case: _state_matches(ctx, case), count=6, describe=_state_case)


# Drawn cases of model_state_bytes: every stage of each, over parameter counts from none to a trillion, dp from 1 to
# 1024, every precision with and without master weights.
STATE_CASES = Space(num=One(("none", "one", "odd", "a multiple of dp", "hundreds of billions")), dp=Int(1, 1024),
                    precision=One(("fp32", "bf16", "fp16")), master=One((False, True)))


def _state_num(case: dict) -> int:
    g = generated.generator(case, "num")
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    return {"none": 0, "one": 1, "odd": 2 * draw(1, 500_000) + 1, "a multiple of dp": case["dp"] * draw(1, 10**6),
            "hundreds of billions": draw(10**11, 10**12)}[case["num"]]


def _state_case(case: dict) -> str:
    return (f"{_state_num(case):,} parameters ({case['num']}), dp={case['dp']}, {case['precision']}, "
            f"master_weights={case['master']}")


def _state_matches(ctx, case: dict) -> str | None:
    num, dp = _state_num(case), case["dp"]
    for zero in range(4):
        call, got = _call(ctx, num, case["precision"], case["master"], dp, zero)
        want = estimate_params(num, dp, zero, case["precision"], case["master"])
        key = next((k for k in KEYS if got[k] != want[k]), None)
        if key:
            return (f"{call}: {key} {got[key]:,} bytes, expected {want[key]:,} (S = ceil({num:,} / {dp}) = "
                    f"{-(-num // dp):,} elements per shard)")
        key = next((k for k in KEYS if type(got[k]) is not int), None)
        if key:
            return (f"{call} gave {key} = {got[key]!r}, a {type(got[key]).__name__}: bytes are counted whole, an int "
                    f"({want[key]:,}); a / on the way makes a float")
    return None


def _measured(ctx, master: bool) -> tuple[int, dict]:
    """Bytes a tiny GPT really holds after one AdamW step (fp32, or bf16 with fp32 master weights)."""
    model = build_model(MODELS["tiny"], seed=ctx.seed % 1000)
    if master:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = MasterWeightsAdamW(params, lr=1e-3) if master else make_optimizer(params, 1e-3)
    idx = torch.randint(0, MODELS["tiny"].vocab_size, (2, 16), generator=ctx.generator("tokens"))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    held = {"weights": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params),
            "optimizer": opt.state_bytes() if master else optimizer_state_bytes(opt)}
    return sum(p.numel() for p in params), held


@EXERCISE.check("matches the bytes of a real Adam step", points=1, hint=(
    "The formula counts what the tensors hold: after one AdamW step, a model's parameters, their .grad "
    "tensors and the optimizer's state (exp_avg and exp_avg_sq, plus the fp32 masters when the model is "
    "bf16). Count the elements of each and multiply by their element size."))
def measured(ctx):
    for master in (False, True):
        num, held = _measured(ctx, master)
        calls = [(num, "bf16", True)] if master else [(num, "fp32", False), (num, "bf16", False)]
        for args in calls:
            call, got = _call(ctx, *args)
            if got != held:
                what = "bf16 with fp32 master weights" if master else "fp32 (autocast does not change it)"
                raise Fail(f"a tiny GPT of {num:,} parameters, {what}, holds {held} after one AdamW step; "
                           f"{call} = {got}")


def _linear(cfg: TrainConfig) -> tuple[int, int]:
    """(fixed bytes, bytes per sequence) of ``cfg``'s busiest rank: its estimate is fixed + b · per."""
    one, two = (estimate(with_microbatch(cfg, b))["max_total"] for b in (1, 2))
    return one - (two - one), two - one


@EXERCISE.check("largest_microbatch fits the budget", points=2, hint=(
    "Whatever is left of the budget after the fixed bytes goes to activations, which grow by "
    "bytes_per_sequence with every sequence: b = floor((budget - fixed) / per_sequence), an int. A budget met "
    "exactly still fits. When the fixed bytes alone exceed the budget nothing fits: 0, never a negative "
    "count. Halving the microbatch and doubling grad_accum keeps the global batch."))
def microbatch(ctx):
    cases = [(1500, 1000, 100, 5, "1,000 + 5 × 100 = 1,500 fits exactly"), (1499, 1000, 100, 4, ""),
             (1099, 1000, 100, 0, ""), (1000, 1000, 100, 0, ""),
             (999, 1000, 100, 0, "the fixed bytes alone are over the budget"),
             (10, 10**6, 7, 0, "the fixed bytes alone are over the budget"),
             (2.5e9, 1e9, 3e8, 5, "budgets in bytes may come as floats; the count is an int all the same"),
             (2.4e9, 1e9, 2e8, 7, "1e9 + 7 × 2e8 = 2.4e9 fits exactly")]
    g = ctx.generator()
    for cfg in (TrainConfig(), TrainConfig(model="small", dp=2, zero=2), TrainConfig(tp=2),
                TrainConfig(precision="bf16", master_weights=True, dp=4, zero=1, batch_size=16)):
        fixed, per = _linear(cfg)
        for k in (0, 1, int(torch.randint(2, 200, (1,), generator=g))):
            for budget in (fixed + k * per, fixed + k * per + int(torch.randint(1, per, (1,), generator=g))):
                want = largest_microbatch(cfg, budget)["microbatch"]
                why = f"gpucourse.modeled.memory finds {want} for {cfg.model} {cfg.layout()}, zero {cfg.zero}"
                cases.append((budget, fixed, per, want, why))
        budget = 0.5 * 2**30
        want = largest_microbatch(cfg, budget)["microbatch"]
        cases.append((budget, fixed, per, want, f"gpucourse.modeled.memory finds {want} in 0.5 GiB"))
    for budget, fixed, per, want, why in cases:
        got = ctx.call("largest_microbatch", budget, fixed, per).value
        if isinstance(got, int) and not isinstance(got, bool) and got == want:
            continue
        extra = ""
        if _number(got) and got < 0:
            extra = " — a negative count of sequences"
        elif isinstance(got, float) and got == want:
            extra = " — a float: a number of sequences is an int (int(...), or // on ints)"
        elif _number(got) and got == want - 1 and fixed + want * per == budget:
            extra = " — one fewer: a budget met exactly still fits (<=, not <)"
        elif _number(got) and got == want + 1 and fixed + got * per > budget:
            extra = f" — {got} sequences need {fixed + got * per:,} bytes, over the budget: round down"
        raise Fail(f"largest_microbatch({budget:,}, {fixed:,}, {per:,}) = {got!r}; expected {want}{extra}"
                   f"{f' ({why})' if why else ''}")
