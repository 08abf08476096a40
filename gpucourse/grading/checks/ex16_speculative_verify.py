"""Checks of exercise 16: speculative decoding's verify step, greedy and by rejection sampling.

The learner's functions run in the sandbox (where ``gpucourse.serving`` cannot be imported). Their answers are
compared here with the rule written out plainly, on cases drawn as a server meets them: the target's logits over a
context and k drafted tokens, drafts that agree with it for a while and then do not; greedy rounds chained into a
whole decode, which must be the target's own; and for sampling a generator sent along and replayed here, so that
the same draws must make the same tokens. The values' checks read a 0-d tensor as the int it holds; the types are
the contract's check. Greedy rounds and the residual are also drawn with ``generated.Space`` (dtypes, sizes, where
the first rejection falls, transposed logits, zeros in p or q), their types and inputs held exactly there too.
"""

from __future__ import annotations

import torch

from .. import contracts, generated
from ..core import Exercise, Fail, expect_close
from ..generated import DTYPES, Int, One, Space

EXERCISE = Exercise("ex16_speculative_verify", "Speculative decoding: verify k drafted tokens in one forward",
                    "notebooks/15_inference_optimization.ipynb",
                    concept=("the target's one forward over the context and the k drafted tokens judges each draft at "
                             "its own position; a round keeps the drafts up to the first one the target rejects, "
                             "adds one token of the target's own, and a rejected draft is replaced from what the "
                             "target wants more than the draft did"),
                    section="§1 and §2 (speculative decoding; the rejection rule)")

GREEDY = contracts.Contract("greedy_verify", ("logits", "drafted"), unchanged=("logits",), strided=("logits",))
RESIDUAL = contracts.Contract("residual", ("p", "q"), unchanged=("p", "q"), dtype_of="p", strided=("p", "q"),
                              fresh=True)
SAMPLED = contracts.Contract("sampled_verify", ("p", "q", "drafted", "generator"), unchanged=("p", "q"),
                             strided=("p", "q"))


def _int(x):
    """An integer however it came back (an int, or a one-element integer tensor); anything else as it is."""
    if torch.is_tensor(x) and x.numel() == 1 and not x.is_floating_point() and x.dtype != torch.bool:
        return int(x.item())
    return x


def _answer(value):
    """``(accepted, tokens)`` with ints for 0-d tensors and a list for any sequence of tokens; else as it is."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return value
    accepted, tokens = value
    if torch.is_tensor(tokens) and tokens.dim() == 1:
        tokens = list(tokens)
    if isinstance(tokens, (tuple, list)):
        tokens = [_int(t) for t in tokens]
    return _int(accepted), tokens


# --- greedy ------------------------------------------------------------------------------------------------------

def greedy_reference(logits: torch.Tensor, drafted: list[int]) -> tuple[int, list[int]]:
    """The rule: row n − k − 1 + i judges drafted[i]; keep drafts while each is the argmax, then the target's."""
    k = len(drafted)
    best = [int(row.double().argmax()) for row in logits[len(logits) - k - 1:]]
    accepted = 0
    while accepted < k and drafted[accepted] == best[accepted]:
        accepted += 1
    return accepted, drafted[:accepted] + [best[accepted]]


def _logits_with(g, best: list[int], vocab: int, dtype=torch.float32) -> torch.Tensor:
    """Random logits whose row j has its maximum, by a clear margin, at ``best[j]``."""
    logits = torch.randn(len(best), vocab, generator=g, dtype=torch.float64)
    rows = torch.arange(len(best))
    logits[rows, torch.tensor(best)] = logits.max(-1).values + 1.0 + torch.rand(len(best), generator=g,
                                                                                   dtype=torch.float64)
    return logits.to(dtype)


def greedy_case(g, context: int, k: int, agree: int, vocab: int = 64, dtype=torch.float32):
    """The target's logits over ``context`` tokens and k drafts, and drafts of which the first ``agree`` are its
    argmax; the next is not (nor the argmax one position on, where an answer shifted by a row would look); those
    after it are the target's argmax again, where an answer that goes on past a rejection would accept them."""
    best = torch.randperm(vocab, generator=g)[:context + k].tolist()  # each row's argmax, all different
    judged = best[context - 1:]                                          # the k + 1 rows that judge
    drafted = []
    for i in range(k):
        if i == agree:
            wrong = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in judged[i:i + 2]]
            drafted.append(wrong[0])
        else:
            drafted.append(judged[i])
    return _logits_with(g, best, vocab, dtype), drafted


def _call_greedy(logits: torch.Tensor, drafted: list[int]) -> str:
    return (f"greedy_verify(logits of a {len(logits) - len(drafted)}-token context and {len(drafted)} drafts, "
            f"drafted={drafted})")


def _verify_greedy(ctx, logits: torch.Tensor, drafted: list[int]) -> tuple[int, list[int]]:
    got = _answer(ctx.call("greedy_verify", logits, list(drafted)).value)
    want = greedy_reference(logits, drafted)
    if got != want:
        argmax = [int(row.argmax()) for row in logits[len(logits) - len(drafted) - 1:]]
        raise Fail(f"{_call_greedy(logits, drafted)} returned {got!r}; expected {want} (the target's argmax at the "
                   f"last {len(drafted) + 1} positions: {argmax})")
    return want


@EXERCISE.check("greedy: the drafts up to the first one the target rejects, then the target's token", points=2,
                hint=("Take the last k + 1 rows of the logits (row j predicts the token after position j, so row "
                      "n − k − 1 judges drafted[0] and row n − 1 is the bonus), their argmax, and walk the drafts "
                      "in order: accept while drafted[i] equals argmax i, stop at the first that does not — what "
                      "follows a rejected token was drafted after a token the target never made. The round's tokens "
                      "are the accepted drafts, then argmax[accepted]. Take the argmax of the logits as they come, "
                      "in their own dtype: cast to a narrower one, two logits it cannot tell apart tie, and a tie "
                      "goes to the lower token."))
def greedy_rejects(ctx):
    g = ctx.generator()
    cases = [(5, 4, 2), (3, 4, 0), (2, 6, 3), (6, 1, 0), (9, 5, 4), (4, 3, 1)]
    for _ in range(4):
        k = int(torch.randint(2, 7, (1,), generator=g))
        cases.append((int(torch.randint(1, 12, (1,), generator=g)), k, int(torch.randint(0, k, (1,), generator=g))))
    for context, k, agree in cases:
        _verify_greedy(ctx, *greedy_case(g, context, k, agree))
    generated.for_all(ctx, ROUNDS, lambda case: _greedy_holds(ctx, case), count=8, describe=_round_words)


# Drawn rounds: each row's largest logit a few units in the last place of the logits' dtype above the next one,
# which sits at a lower token (an argmax taken in a narrower dtype sees a tie and picks that lower token).
ROUNDS = Space(dtype=One(DTYPES), context=Int(1, 12), k=Int(0, 6), vocab=One((8, 2, 64, 1000)),
               rejected=One(("none", "first", "middle", "last")), layout=One(("contiguous", "transposed")))
NEAR = 8  # the largest logit is (1 + NEAR·eps) times the next: distinct in the dtype, equal in a much narrower one


def _drawn_round(case: dict) -> tuple[torch.Tensor, list[int]]:
    """The logits and drafts of a drawn round (:data:`ROUNDS`)."""
    g = generated.generator(case, "round")
    context, k, vocab, dtype = case["context"], case["k"], case["vocab"], case["dtype"]
    best = torch.randint(1, vocab, (context + k,), generator=g)  # each row's argmax, above token 0
    logits = torch.randn(context + k, vocab, generator=g, dtype=torch.float64)
    rows = torch.arange(context + k)
    top = logits.max(-1).values.clamp(min=0) + 1
    second = (torch.rand(context + k, generator=g, dtype=torch.float64) * best).long()  # a token below the argmax
    logits[rows, second] = top
    logits[rows, best] = top * (1 + NEAR * torch.finfo(dtype).eps)
    logits = logits.to(dtype)
    if case["layout"] == "transposed":
        logits = logits.t().contiguous().t()
    agree = {"none": k, "first": 0, "middle": k // 2, "last": k - 1}[case["rejected"]] if k else 0
    judged = best[context - 1:].tolist()
    drafted = []
    for i in range(k):
        if i != agree:
            drafted.append(judged[i])
        else:  # the target's runner-up, as a draft model's choice often is, unless it is the next row's argmax
            near = int(second[context - 1 + i])
            drafted.append(near if near not in judged[i + 1:i + 2] else
                           next(t for t in range(vocab) if t not in judged[i:i + 2]))
    return logits, drafted


def _round_words(case: dict) -> str:
    view = " (a transposed view)" if case["layout"] == "transposed" else ""
    where = {"none": "every draft accepted", "first": "the first draft rejected", "middle": "a middle draft rejected",
             "last": "the last draft rejected"}[case["rejected"]] if case["k"] else "no drafts"
    return (f"greedy_verify on {generated.name(case['dtype'])} logits{view} of a {case['context']}-token context and "
            f"{case['k']} drafts over {case['vocab']} tokens, {where}")


def _greedy_holds(ctx, case: dict) -> str | None:
    logits, drafted = _drawn_round(case)
    words = _round_words(case)
    out = contracts.call(ctx, GREEDY, logits, list(drafted))
    _expect_kept("greedy_verify", out, 1, drafted, words)
    _expect_types("greedy_verify", out.value, words)
    want = greedy_reference(logits, drafted)
    if out.value != want:
        argmax = [int(row.double().argmax()) for row in logits[len(logits) - len(drafted) - 1:]]
        return (f"{_call_greedy(logits, drafted)} returned {out.value!r}; expected {want} (the target's argmax at the "
                f"last {len(drafted) + 1} positions: {argmax}, each a few units in the last place of "
                f"{generated.name(logits.dtype)} above the next logit, at a lower token)")
    return None


@EXERCISE.check("greedy: every draft accepted earns a bonus token; no drafts, or a one-token context", points=1,
                hint=("When all k drafts are accepted the round still ends with one token of the target's own, from "
                      "the last row (the bonus): k + 1 tokens for one forward. With k = 0 the round is a plain "
                      "decode step, (0, [argmax of the last row]); with a one-token context the logits have exactly "
                      "k + 1 rows. Count the accepted drafts as you go rather than from a loop variable, which is "
                      "one short when the loop runs to the end."))
def greedy_edges(ctx):
    g = ctx.generator()
    for context, k, agree in ((4, 3, 3), (7, 1, 1), (1, 5, 5), (1, 2, 0), (6, 0, 0), (1, 0, 0), (3, 6, 6)):
        _verify_greedy(ctx, *greedy_case(g, context, k, agree))


# The decode chained from greedy rounds: where the draft's argmax departs from the target's, along the path the
# target's greedy decode takes (index i: the draft proposes wrongly after the path's token i). With k = 3: rounds
# that accept nothing, all three (and earn the bonus) and two of three.
K_CHAIN, WRONG_AT, CHAIN_TOKENS = 3, (0, 1, 10, 11, 14, 19), 24


@EXERCISE.check("greedy rounds make the target's own greedy decode", points=1, hint=(
    "Speculation changes how many forwards a decode takes, never its tokens: the rounds' tokens, appended one round "
    "after another, must be what decoding one token at a time with the target makes. If yours differ, print one "
    "round's drafts beside the argmax of each of the last k + 1 rows."))
def greedy_chain(ctx):
    g = ctx.generator()
    vocab = 48
    order = torch.randperm(vocab, generator=g).tolist()  # the target's greedy path: one cycle through the vocabulary
    following = {order[i]: order[(i + 1) % vocab] for i in range(vocab)}
    target = _logits_with(g, [following[t] for t in range(vocab)], vocab, torch.float64)  # row t: after token t
    drafts = [following[t] for t in range(vocab)]
    prompt = torch.randint(0, vocab, (4,), generator=g).tolist() + [order[0]]
    for i in WRONG_AT:
        drafts[order[i]] = next(t for t in torch.randperm(vocab, generator=g).tolist()
                                if t not in (order[i + 1], order[i + 2]))
    want = [order[i] for i in range(1, CHAIN_TOKENS + 1)]
    tokens = list(prompt)
    while len(tokens) - len(prompt) < CHAIN_TOKENS:
        before = len(tokens) - len(prompt)
        drafted = []
        for _ in range(K_CHAIN):
            drafted.append(drafts[(tokens + drafted)[-1]])
        logits = target[tokens + drafted].to(torch.float32)  # one forward over the context and the drafts
        answer = _answer(ctx.call("greedy_verify", logits, list(drafted)).value)
        made = answer[1] if isinstance(answer, tuple) else None
        if not isinstance(made, list) or not made or any(type(t) is not int for t in made):
            raise Fail(f"a round after {before} tokens made {made!r}; expected a list of at least one token, each "
                       f"an int")
        tokens += made
        got = tokens[len(prompt):len(prompt) + CHAIN_TOKENS]
        if got != want[:len(got)]:
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise Fail(f"rounds of greedy_verify (k = {K_CHAIN}) decoded {got}; the target's own greedy decode "
                       f"begins {want[:len(got)]}: they part at token {at}, in the round that drafted {drafted} "
                       f"after {before} tokens and made {made}")


# --- sampling ----------------------------------------------------------------------------------------------------

def residual_reference(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p − q), normalised, in float64."""
    leftover = torch.clamp(p.double() - q.double(), min=0)
    return leftover / leftover.sum()


def sampled_reference(p: torch.Tensor, q: torch.Tensor, drafted: list[int], seed: int) -> tuple[int, list[int]]:
    """The rule, drawing as the exercise says from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    for i, x in enumerate(drafted):
        u = torch.rand((), generator=g, dtype=torch.float64)
        if not u < p[i, x] / q[i, x]:
            return i, drafted[:i] + [int(torch.multinomial(residual_reference(p[i], q[i]), 1, generator=g))]
    return len(drafted), drafted + [int(torch.multinomial(p[len(drafted)], 1, generator=g))]


def _distribution(g, vocab: int, zeros: int = 0) -> torch.Tensor:
    """A random next-token distribution (float64), ``zeros`` tokens of it impossible."""
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    logits[torch.randperm(vocab, generator=g)[:zeros]] = -float("inf")
    return logits.softmax(-1)


def sampled_case(g, k: int, vocab: int):
    """p (k + 1, vocab) of a target and q (k, vocab) of a draft that is close to it or not, some tokens impossible
    under each, and k tokens drawn from q as a draft draws them."""
    p = torch.stack([_distribution(g, vocab, zeros=int(torch.randint(0, 3, (1,), generator=g)))
                     for _ in range(k + 1)])
    q = []
    for i in range(k):
        close = float(torch.rand((), generator=g, dtype=torch.float64))
        q.append(close * p[i] + (1 - close) * _distribution(g, vocab, zeros=1))
    q = torch.stack(q) if q else torch.zeros(0, vocab, dtype=torch.float64)
    drafted = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
    return p, q, drafted


def _call_sampled(p, q, drafted, seed) -> str:
    return (f"sampled_verify(p {tuple(p.shape)}, q {tuple(q.shape)}, drafted={drafted}, "
            f"generator=torch.Generator().manual_seed({seed}))")


def _verify_sampled(ctx, g, p, q, drafted, why: str = "") -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    generator = torch.Generator().manual_seed(seed)
    got = _answer(ctx.call("sampled_verify", p, q, list(drafted), generator).value)
    want = sampled_reference(p, q, drafted, seed)
    if got != want:
        ratios = [round(float(p[i, x] / q[i, x]), 3) for i, x in enumerate(drafted)]
        raise Fail(f"{_call_sampled(p, q, drafted, seed)} returned {got!r}; expected {want}{why} (p/q of the "
                   f"drafts: {ratios})")


@EXERCISE.check("sampled: a uniform draw per draft, accepted when u < p/q, in the generator's order", points=2,
                hint=("For each draft x at row i, in order: u = torch.rand((), generator=generator, "
                      "dtype=torch.float64), drawn even when p ≥ q; accept when u < p[i, x] / q[i, x] — the "
                      "target's probability over the draft's, never the other way round. At the first rejection "
                      "draw the replacement with torch.multinomial(residual(p[i], q[i]), 1, generator=generator) "
                      "and stop; after k acceptances draw the bonus from p[k]. Any other draw from the generator, "
                      "or one from the global generator, shifts every draw after it."))
def sampled_rule(ctx):
    g = ctx.generator()
    for k in [0] + torch.randint(1, 6, (24,), generator=g).tolist():  # k = 0: nothing drafted, a plain decode step
        _verify_sampled(ctx, g, *sampled_case(g, k, int(torch.randint(6, 20, (1,), generator=g))))


def _row(*mass: tuple[int, float], vocab: int = 8) -> torch.Tensor:
    p = torch.zeros(vocab, dtype=torch.float64)
    for token, m in mass:
        p[token] = m
    return p


# Rows whose outcome no draw changes: A, B and C share no token, so a bonus from the wrong row is another token
# (C holds one token: the bonus after every draft accepted is 5, however many draws came before it);
# a draft of token 0 under (NEVER_P, NEVER_Q) is always rejected, and replaced by token 2, the one token where
# p > q (where q > p are tokens 0 and 4, and p alone would give 1 or 2).
A, B, C = _row((0, 0.5), (1, 0.5)), _row((2, 0.3), (3, 0.7)), _row((5, 1.0))
NEVER_P, NEVER_Q = _row((1, 0.4), (2, 0.6)), _row((0, 0.5), (1, 0.4), (4, 0.1))
REJECTED = (torch.stack([NEVER_P, A, B]), torch.stack([NEVER_Q, A]), [0, 1],
            " (p of the first draft is 0: rejected whatever u)")
ACCEPTED = (torch.stack([A, B, C]), torch.stack([A, B]), [1, 3],
            " (q = p: both accepted whatever u; then the bonus from p[2])")
THEN_REJECTED = (torch.stack([A, NEVER_P, B, B]), torch.stack([A, NEVER_Q, B]), [0, 0, 3],
                 " (q = p for the first draft; p of the second is 0)")


@EXERCISE.check("sampled: a rejection is replaced from max(0, p − q); all accepted draws the bonus from p[k]",
                points=1, hint=(
                    "A draft the target gives probability 0 is always rejected; the round then ends with a token "
                    "drawn from residual(p[i], q[i]) — where the target wants more than the draft did, not from p "
                    "nor from q − p — and nothing after it. Where q = p every draft is accepted (u < 1 always), and "
                    "the round ends with the bonus drawn from p[k], the row after the last draft."))
def sampled_edges(ctx):
    g = ctx.generator()
    for _ in range(2):
        for p, q, drafted, why in (REJECTED, ACCEPTED, THEN_REJECTED):
            _verify_sampled(ctx, g, p, q, drafted, why)


@EXERCISE.check("residual: max(0, p − q), divided by its sum", points=1, hint=(
    "Subtract, clamp below at 0 (tokens the draft over-proposed get nothing; the negative parts would make it no "
    "distribution at all), then divide by the sum of what is left, so that it sums to 1: "
    "leftover = (p - q).clamp(min=0); leftover / leftover.sum()."))
def residual_values(ctx):
    g = ctx.generator()
    for vocab in (5, 12, 33, 64):
        p, q = _distribution(g, vocab, zeros=vocab // 5), _distribution(g, vocab, zeros=1)
        got = ctx.call("residual", p, q).value
        if torch.is_tensor(got) and got.is_floating_point():  # the values here; the dtype is the contract's check
            got = got.double()
        expect_close(f"residual(p, q) over {vocab} tokens", got, residual_reference(p, q), atol=1e-12, rtol=1e-9)
    generated.for_all(ctx, RESIDUALS, lambda case: _residual_holds(ctx, case), count=4, describe=_residual_words)


# Drawn residuals: p and q in one dtype, tokens impossible under p, under q, under both or neither.
RESIDUALS = Space(dtype=One((torch.float32, torch.float64)), vocab=One((8, 2, 33, 1000)),
                  zeros=One(("none", "in p", "in q", "in both")))


def _drawn_residual(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q of a drawn residual (:data:`RESIDUALS`); q's zeros fall on p's likeliest tokens, so that something
    is left over however few tokens there are."""
    g = generated.generator(case, "residual")
    vocab, zeros = case["vocab"], case["zeros"]
    p = _distribution(g, vocab, zeros=(vocab // 4 or 1) if zeros in ("in p", "in both") else 0)
    q = _distribution(g, vocab)
    if zeros in ("in q", "in both"):
        q[p.topk(vocab // 3 or 1).indices] = 0
        q = q / q.sum()
    return p.to(case["dtype"]), q.to(case["dtype"])


def _residual_words(case: dict) -> str:
    zeros = "" if case["zeros"] == "none" else f", zeros {case['zeros']}"
    return f"residual(p, q) in {generated.name(case['dtype'])} over {case['vocab']} tokens{zeros}"


def _residual_holds(ctx, case: dict) -> str | None:
    p, q = _drawn_residual(case)
    got = contracts.call(ctx, RESIDUAL, p, q).value
    return generated.mismatch(f"residual(p, q) in {generated.name(p.dtype)}", got,
                              residual_reference(p, q).to(p.dtype))


# --- the contract ------------------------------------------------------------------------------------------------

def _kind(value) -> str:
    """What a value is, for a sentence: "a 0-d tensor", "a list", "an int"."""
    name = f"{value.dim()}-d tensor" if torch.is_tensor(value) else type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


TYPES = "an int and a list of ints"


def _expect_types(function: str, value, case: str) -> None:
    """``(accepted, tokens)`` as specified: a tuple of an int and a list of ints (a bool is no count)."""
    if type(value) is not tuple or len(value) != 2:
        raise Fail(f"contract '{TYPES}': {function} returned {_kind(value)}, not a tuple (accepted, tokens) ({case})")
    accepted, tokens = value
    if type(accepted) is not int:
        raise Fail(f"contract '{TYPES}': {function}'s accepted count is {_kind(accepted)}, not an int ({case})")
    if type(tokens) is not list:
        raise Fail(f"contract '{TYPES}': {function}'s tokens are {_kind(tokens)}, not a list ({case})")
    odd = next((t for t in tokens if type(t) is not int), None)
    if odd is not None:
        raise Fail(f"contract '{TYPES}': {function}'s tokens hold {_kind(odd)}, not only ints ({case})")


def _expect_kept(function: str, out, at: int, drafted: list[int], case: str) -> None:
    """The list of drafts (argument ``at``) as the call left it is the caller's list as it was."""
    after = out.args[at] if len(out.args) > at else drafted
    if not isinstance(after, (list, tuple)) or list(after) != drafted:
        raise Fail(f"contract '{contracts.UNCHANGED}': {function} changed its input drafted from {drafted} to "
                   f"{after!r} ({case})")


@EXERCISE.check("the contract: inputs left as they were, Python ints and lists, p's dtype kept", points=2, hint=(
    "The caller goes on using its logits, probabilities and drafts: slice and copy, never trim drafted, append to it "
    "or subtract into p in place (p.sub_ changes the caller's row). Return exactly a tuple (int, list of ints): "
    "int(...) or .item() on every count and token a tensor operation gives, since tensor(2) == 2 is true and "
    "hides it. residual returns a new tensor of p's dtype."))
def contract(ctx):
    g = ctx.generator()
    for dtype in (torch.float32, torch.bfloat16):
        logits, drafted = greedy_case(g, 4, 3, 1, dtype=dtype)
        out = contracts.call(ctx, GREEDY, logits, list(drafted), strided=True)
        case = contracts.describe_case(GREEDY, (logits, drafted), 1)
        _expect_kept("greedy_verify", out, 1, drafted, case)
        _expect_types("greedy_verify", out.value, case)
        if _answer(out.value) != greedy_reference(logits, drafted):
            raise Fail(f"{_call_greedy(logits, drafted)} in {dtype} with the logits as a view returned "
                       f"{out.value!r}; expected {greedy_reference(logits, drafted)}")
    for dtype in (torch.float64, torch.float32):
        p, q = _distribution(g, 10, zeros=2).to(dtype), _distribution(g, 10, zeros=1).to(dtype)
        got = contracts.call(ctx, RESIDUAL, p, q, strided=True).value
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        expect_close(f"residual(p, q) in {str(dtype).removeprefix('torch.')} with p and q as views", got,
                     residual_reference(p, q).to(dtype), atol=tol, rtol=tol)
    for p, q, drafted, why in (REJECTED, ACCEPTED):  # a token from the residual, and the bonus
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
        out = contracts.call(ctx, SAMPLED, p, q, list(drafted), torch.Generator().manual_seed(seed), strided=True)
        case = contracts.describe_case(SAMPLED, (p, q, drafted), 1)
        _expect_kept("sampled_verify", out, 2, drafted, case)
        _expect_types("sampled_verify", out.value, case)
        if _answer(out.value) != sampled_reference(p, q, drafted, seed):
            raise Fail(f"{_call_sampled(p, q, drafted, seed)} with p and q as views returned {out.value!r}; "
                       f"expected {sampled_reference(p, q, drafted, seed)}{why}")
