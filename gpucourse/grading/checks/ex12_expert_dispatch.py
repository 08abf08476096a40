"""Checks of exercise 12: expert-parallel dispatch — permute, the counts, the rows out and back, forward and backward.

The learner's functions are called on every rank with that rank's tokens, their
chosen experts and weights (``forward_backward``, given in the exercise, builds
the experts from the weights sent here and runs ``moe_forward`` forward and
backward). The expected values are worked out here: the rows each rank must
receive, in order, and every expert on one device in float64, as
``MoE.dispatch`` computes it, with its gradients by autograd.
"""

from __future__ import annotations

import torch

from .. import contracts, generated, host
from ..contracts import Contract
from ..core import Exercise, Fail, describe_mismatch
from ..generated import DTYPES, Int, One, Space

EXERCISE = Exercise("ex12_expert_dispatch", "Expert-parallel dispatch", "notebooks/13_mixture_of_experts.ipynb",
                    forbidden_collectives=("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                           "gather", "scatter", "send", "recv"),
                    refusal=("the expert dispatch called {op}, which this exercise switches off: rows travel by "
                             "all-to-all only, each to the rank that holds its expert"),
                    concept=("tokens travel to the rank that holds their expert and come back in their own order: the "
                             "counts first, then the tokens in one all-to-all, then the combine"),
                    section="§4 (expert parallelism) and §5 (one all-to-all)")

C, H = 6, 5          # a token's width; an expert's hidden width
ATOL, RTOL = 1e-5, 1e-4

# What every caller relies on besides the values (gpucourse.grading.contracts): the inputs come back bit for bit,
# the rows keep x's dtype, the combined output expert_out's (float32 router weights on bf16 outputs included).
# exchange_counts leaves the counts it was given (dispatch needs them for its own splits), and combine the state
# dispatch handed it (a recomputation, as activation checkpointing runs, combines twice from one state).
PERMUTE = Contract("permute", ("chosen", "num_experts"), unchanged=("chosen",))
EXCHANGE = Contract("exchange_counts", ("counts",), unchanged=("counts",))
DISPATCH = Contract("dispatch", ("x", "chosen", "num_experts"), unchanged=("x", "chosen"), dtype_of="x")
COMBINE = Contract("combine", ("expert_out", "weights", "state", "num_tokens"),
                   unchanged=("expert_out", "weights", "state"), dtype_of="expert_out")


# --- inputs ---------------------------------------------------------------------------------------------------


def _pairs(g, n_tokens: int, k: int, experts: list[int]) -> torch.Tensor:
    """(n_tokens, k) int64: each token's k different experts, drawn from ``experts`` uniformly."""
    pool = torch.tensor(experts)
    pick = torch.rand(n_tokens, len(experts), generator=g).argsort(1)[:, :k]
    return pool[pick]


def _shuffled(g, rows: list[list[int]]) -> torch.Tensor:
    """Each token's given experts, in a random order."""
    out = torch.tensor(rows)
    return out.gather(1, torch.rand(out.shape, generator=g).argsort(1))


def _tokens(ctx, chosens: list, key) -> tuple:
    """Every rank's x (float32) and weights (float32, each token's summing to 1), from the same generator."""
    g = ctx.generator("tokens", key)
    xs, ws = [], []
    for ch in chosens:
        xs.append(torch.randn(ch.shape[0], C, generator=g, dtype=torch.float64).float())
        w = torch.rand(ch.shape, generator=g, dtype=torch.float64) + 0.2
        ws.append((w / w.sum(1, keepdim=True)).float())
    return xs, ws


def _expert_params(ctx, E: int, key) -> list:
    """E experts' (w1, b1, w2, b2), float32: Linear(C, H) → tanh → Linear(H, C)."""
    g = ctx.generator("experts", key)
    return [tuple((torch.randn(*shape, generator=g, dtype=torch.float64) * s).float()
                  for shape, s in (((H, C), 0.6), ((H,), 0.3), ((C, H), 0.6), ((C,), 0.3))) for _ in range(E)]


# --- what each rank must receive --------------------------------------------------------------------------------


def _home(r: int, local: int, n: int, per: int) -> int:
    """The expert that is local expert ``local`` of rank r: experts r·per … (r+1)·per − 1 live on rank r."""
    return r * per + local


def _round_robin(r: int, local: int, n: int, per: int) -> int:
    """The wrong layout: expert e on rank e % n, as its local expert e // n."""
    return local * n + r


def _layout(chosens: list, E: int, expert_at=_home) -> list:
    """For each rank, the choices its received rows carry, in order: (source rank, choice number, expert) each."""
    n = len(chosens)
    per = E // n
    out = []
    for r in range(n):
        rows = []
        for i, ch in enumerate(chosens):
            flat = ch.flatten()
            for local in range(per):
                e = expert_at(r, local, n, per)
                rows += [(i, int(c), e) for c in (flat == e).nonzero()[:, 0]]
        out.append(rows)
    return out


def _received(layout: list, xs: list, k: int) -> list:
    """The rows each rank receives under ``layout``."""
    return [torch.stack([xs[i][c // k] for i, c, _ in rows]) if rows else torch.zeros(0, C) for rows in layout]


# --- judging -------------------------------------------------------------------------------------------------


def _expect(what: str, got, want: torch.Tensor, known_wrong=(), atol: float = ATOL, rtol: float = RTOL) -> None:
    """Fail unless got == want; ``known_wrong``: (plausible wrong value, the sentence that explains it)."""
    problem = describe_mismatch(what, got, want, atol, rtol)
    if problem is None:
        return
    if torch.is_tensor(got):
        for value, sentence in known_wrong:
            if value is not None and got.shape == value.shape and \
                    torch.allclose(got.double(), value.double(), atol=atol, rtol=rtol):
                problem += f"; {sentence}"
                break
    raise Fail(problem)


def _call_all(ctx, function, args: list, case: str = "", held: bool = False) -> list:
    """``ctx.call_all`` of ``function`` (a name or a Contract; ``held``: the outcomes held to that contract, as the
    contract check does); an error says in which ``case``, and gloo's abort on mismatched split sizes, why."""
    try:
        if held:
            return contracts.call_all(ctx, function, args)
        return ctx.call_all(function.function if isinstance(function, Contract) else function, args)
    except host.LearnerError as e:
        if not case or e.exc_type == "NotImplementedError":
            raise
        raise Fail(f"{e.sentence} — with {case}") from None
    except host.Stuck as e:
        raise Fail(f"{e}. Every rank must take part in every all-to-all, even with nothing to send or receive "
                   f"(splits of 0), and in backward too: autograd runs a rank's AllToAll backward only if that "
                   f"rank's output depends on the rows it received, so run each expert even on zero rows") from None
    except host.RankDied as e:
        if "SIGABRT" not in str(e):
            raise
        raise Fail(f"{str(e).split('; a function under test')[0]}: gloo ends a process that receives more from a "
                   f"rank than its split sizes say. Both sides of an all-to-all must agree — rank j's "
                   f"output_split_sizes[i] is rank i's input_split_sizes[j] — so the receive splits come from the "
                   f"exchanged counts (recv_counts), not from this rank's own, and every rank's counts have E "
                   f"entries") from None


def _pair(what: str, value) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise Fail(f"{what} returned {type(value).__name__} {str(value)[:60]}, not a pair")
    return tuple(value)


# --- one process: permute ---------------------------------------------------------------------------------------


@EXERCISE.check("permute sorts choices by expert, stably", points=1, hint=(
    "Flatten chosen (choice t·k + j is token t's j-th expert) and sort the choice numbers by expert with "
    "torch.argsort(flat, stable=True): a plain argsort is free to reorder the choices of one expert (torch's "
    "does, past 16 elements), and then the rows reach an expert out of token order. counts is "
    "torch.bincount(flat, minlength=num_experts): without minlength an expert after the last one chosen is "
    "missing, not 0."))
def permute(ctx):
    g = ctx.generator("permute")
    cases = [
        ("random routing, 8 experts, expert 7 never chosen", _pairs(g, 40, 2, list(range(7))), 8),
        ("every token on experts 1 and 2 (of 4)", _shuffled(g, [[1, 2]] * 36), 4),
        ("one choice per token, 3 experts", torch.randint(0, 3, (9, 1), generator=g), 3),
    ]
    for label, chosen, E in cases:
        flat = chosen.flatten()
        want_order = torch.argsort(flat, stable=True)
        want_counts = torch.bincount(flat, minlength=E)
        o = ctx.call(PERMUTE.function, chosen.clone(), E)
        order, counts = _pair("permute", o.value)
        problem = describe_mismatch(f"order ({label})", order, want_order, 0, 0)
        if problem and torch.is_tensor(order) and order.shape == want_order.shape and \
                torch.equal(order.sort().values, torch.arange(flat.numel())):
            if torch.equal(flat[order], flat[want_order]):
                problem += ("; it is sorted by expert, but the choices of one expert are not in choice order: "
                            "the sort is not stable")
            elif torch.equal(chosen.t().flatten()[order], flat[want_order]):
                problem += ("; it sorts chosen.t().flatten(): choice t·k + j is chosen[t, j], row by row "
                            "(chosen.flatten())")
        if problem:
            raise Fail(problem)
        shorter = torch.bincount(flat)
        _expect(f"counts ({label})", counts, want_counts,
                [] if shorter.shape == want_counts.shape else
                [(shorter, f"torch.bincount stops at the last expert chosen ({int(flat.max())}); "
                           f"minlength={E} counts every expert")], 0, 0)


# --- the counts -------------------------------------------------------------------------------------------------


@EXERCISE.check("counts: each rank learns what it will receive (2 ranks)", points=1, world_size=2, hint=(
    "dist.all_to_all_single(recv_counts, counts) with no split sizes cuts counts into n equal pieces of E/n: "
    "piece j, what this rank sends rank j's experts, goes to rank j, and the piece from rank i lands at "
    "recv_counts[i·E/n : (i+1)·E/n]. recv_counts is a new int64 tensor shaped like counts."))
def counts(ctx):
    n = ctx.world_size
    g = ctx.generator("counts")
    for E in (6, 2):
        per = E // n
        sent = [torch.randint(0, 6, (E,), generator=g) for _ in range(n)]
        sent[0][per - 1] = 0  # an expert that rank 0 sends nothing
        _exchanged(ctx, sent, "exchange_counts")
    generated.for_all(ctx, COUNTS,
                      lambda case: generated.failure(_exchanged, ctx, _drawn_counts(case, n), "exchange_counts"),
                      count=3, describe=lambda case: _counts_words(case, n))


# Counts drawn: 2 to 8 experts, up to 9 choices each, and none at all to one expert or to every one. For the
# contract, counts that the exchange changes on every draw (rank 0's for rank 1's first expert are not rank 1's for
# rank 0's), so that counts received in place are seen whatever the seed.
COUNTS = Space(experts_per_rank=One((1, 2, 4)), most=Int(0, 9), zeros=One(("none", "one", "all")))
CHANGED_COUNTS = Space(experts_per_rank=One((1, 2, 4)), most=Int(1, 9), zeros=One(("changed",)))


def _drawn_counts(case: dict, n: int) -> list:
    E = case["experts_per_rank"] * n
    sent = [torch.randint(0, case["most"] + 1, (E,), generator=generated.generator(case, r)) for r in range(n)]
    if case["zeros"] == "one":
        sent[case["seed"] % n][case["seed"] % E] = 0
    elif case["zeros"] == "all":
        sent[case["seed"] % n].zero_()
    elif case["zeros"] == "changed":
        per = case["experts_per_rank"]
        sent[0][per] = (sent[1][0] + 1) % (case["most"] + 1)
    return sent


def _counts_words(case: dict, n: int) -> str:
    return "exchange_counts of " + ", ".join(f"rank {r}'s {c.tolist()}" for r, c in enumerate(_drawn_counts(case, n)))



def _exchanged(ctx, sent: list, function) -> None:
    n = ctx.world_size
    per = len(sent[0]) // n
    outs = _call_all(ctx, function, [(c.clone(),) for c in sent])
    for o in outs:
        r = o.rank
        want = torch.cat([sent[i][r * per:(r + 1) * per] for i in range(n)])
        _expect(f"rank {r}'s recv_counts ({len(sent[0])} experts, {n} ranks)", o.value, want,
                [(sent[r], "it is this rank's own counts: the counts must travel, by one all-to-all")], 0, 0)


# --- the rows out ---------------------------------------------------------------------------------------------


def _dispatch_cases(ctx) -> list:
    """(label, E, every rank's chosen): uneven in both directions, two experts per token and one."""
    g = ctx.generator("routing")
    return [
        ("4 experts, 2 per token, skewed", 4,
         [_pairs(g, 40, 2, [0, 2, 3]), torch.cat([_pairs(g, 20, 2, [0, 1, 2]), _shuffled(g, [[1, 3]] * 4)])]),
        ("6 experts, 1 per token", 6, [_pairs(g, 6, 1, list(range(6))), _pairs(g, 11, 1, [0, 1, 2, 4])]),
    ]


@EXERCISE.check("dispatch sends each row to its expert's rank (2 ranks)", points=2, world_size=2, hint=(
    "Rank r holds experts r·E/n … (r+1)·E/n − 1, so expert e's rows go to rank e // (E/n). In expert order "
    "each rank's rows are one piece: input_split_sizes[j] = counts[j·E/n:(j+1)·E/n].sum(), and "
    "output_split_sizes[i] = recv_counts[i·E/n:(i+1)·E/n].sum() — from the exchanged counts, so both sides "
    "agree. Send x[order // k] (each choice's token row) through AllToAll.apply(rows, out_splits, in_splits)."))
def dispatch(ctx):
    n = ctx.world_size
    for label, E, chosens in _dispatch_cases(ctx):
        k = chosens[0].shape[1]
        xs, _ = _tokens(ctx, chosens, label)
        want = _received(_layout(chosens, E), xs, k)
        rr = _received(_layout(chosens, E, _round_robin), xs, k)
        outs = _call_all(ctx, DISPATCH, [(xs[r].clone(), chosens[r].clone(), E) for r in range(n)],
                         f"{label}, {n} ranks")
        for o in outs:
            r = o.rank
            received, state = _pair(f"rank {r}'s dispatch", o.value)
            if not isinstance(state, dict):
                raise Fail(f"rank {r}'s dispatch returned state as {type(state).__name__}, not a dict")
            what = f"rank {r}'s received rows ({label}, {n} ranks)"
            problem = describe_mismatch(what, received, want[r], ATOL, RTOL)
            if problem is None:
                continue
            if torch.is_tensor(received) and received.shape == rr[r].shape and \
                    torch.allclose(received.double(), rr[r].double(), atol=ATOL, rtol=RTOL):
                problem += (f"; they are the rows of experts {', '.join(map(str, range(r, E, n)))}: expert e "
                            f"lives on rank e // (E/n) (experts r·E/n … (r+1)·E/n − 1 on rank r), not on "
                            f"rank e % n")
            elif torch.is_tensor(received) and received.shape == want[r].shape and \
                    torch.allclose(received.double().sum(1).sort().values, want[r].double().sum(1).sort().values,
                                   atol=ATOL, rtol=RTOL):
                problem += ("; they are the right rows in another order: by source rank, then by local expert, "
                            "then in the source's choice order (a stable sort)")
            elif torch.is_tensor(received) and received.shape[0] != want[r].shape[0]:
                problem += (f"; rank {r} must receive {want[r].shape[0]} rows: every choice, from every rank, "
                            f"of its experts {r * (E // n)} … {(r + 1) * (E // n) - 1}")
            raise Fail(problem)


# --- the rows back --------------------------------------------------------------------------------------------


@EXERCISE.check("combine weights and sums into tokens (2 ranks)", points=1, world_size=2, hint=(
    "The reverse all-to-all is AllToAll.apply(expert_out, send_splits, recv_splits) — the splits swapped — "
    "and the rows come home in the order they left (order). Weight each by weights.flatten()[order], once, "
    "and index_add it into row order // k of a (num_tokens, C) zero tensor: a token's k outputs add up."))
def combine(ctx):
    n = ctx.world_size
    label, E, chosens = _dispatch_cases(ctx)[0]
    k = chosens[0].shape[1]
    xs, ws = _tokens(ctx, chosens, "combine")
    layout = _layout(chosens, E)
    want_received = _received(layout, xs, k)
    dispatched = _call_all(ctx, DISPATCH, [(xs[r].clone(), chosens[r].clone(), E) for r in range(n)],
                           f"{label}, {n} ranks")
    expert_outs, sources = [], []
    for o in dispatched:
        received, state = _pair(f"rank {o.rank}'s dispatch", o.value)
        if not torch.is_tensor(received):
            raise Fail(f"rank {o.rank}'s dispatch returned {type(received).__name__} as received, not a tensor")
        right = received.shape == want_received[o.rank].shape and \
            torch.allclose(received.double(), want_received[o.rank].double(), atol=ATOL, rtol=RTOL)
        if right:  # each expert its own output: out = row · (1 + e/2) + e/10
            e = torch.tensor([float(c[2]) for c in layout[o.rank]], dtype=torch.float64).view(-1, 1)
            expert_outs.append((received.double() * (1 + e / 2) + e / 10).float())
        else:      # their own order of rows: the same function of the row for every expert
            expert_outs.append((received.double() * 1.5 + 0.1).float())
        sources.append(right)
    outs = _call_all(ctx, COMBINE, [(expert_outs[r], ws[r].clone(), dispatched[r].value[1], xs[r].shape[0])
                                    for r in range(n)], f"{label}, {n} ranks")
    for o in outs:
        r = o.rank
        # Choice (t, j)'s output row: by its expert where the rows were the expected ones, else by the row alone.
        per_choice = torch.zeros(chosens[r].numel(), C, dtype=torch.float64)
        for i in range(n):
            for src, c, e in layout[i]:
                if src == r:
                    x = xs[r][c // k].double()
                    per_choice[c] = x * (1 + e / 2) + e / 10 if sources[i] else x * 1.5 + 0.1
        per_choice = per_choice.view(-1, k, C)
        w = ws[r].double()[..., None]
        want = (per_choice * w).sum(1)
        _expect(f"rank {r}'s combined output ({n} ranks)", o.value, want.float(),
                [(per_choice.sum(1), "it is the sum of the experts' outputs, unweighted: multiply each row by its "
                                     "choice's weight before summing"),
                 ((per_choice * w * w).sum(1), "each output is weighted twice: weight once, in combine")])


@EXERCISE.check("the contract: inputs left as they were, x's and expert_out's dtype kept (2 ranks)", points=1,
                world_size=2, hint=(
    "A caller keeps using what it passed in: never write into x, chosen or weights — not even through a view "
    "(chosen.view(-1) shares chosen's memory); compute new tensors. Make what you create in the dtype of what "
    "it holds: the rows sent in x's dtype, the combined output in expert_out's (expert_out.new_zeros), and bring "
    "float32 router weights to that dtype before multiplying: bf16 rows times float32 weights are float32."))
def contract(ctx):
    n = ctx.world_size
    label, E, chosens = _dispatch_cases(ctx)[0]
    _call_all(ctx, PERMUTE, [(chosens[r].clone(), E) for r in range(n)], f"{label}, {n} ranks", held=True)
    generated.for_all(ctx, CHANGED_COUNTS,
                      lambda case: generated.failure(_call_all, ctx, EXCHANGE, [(c,) for c in _drawn_counts(case, n)],
                                                     "", True),
                      count=2, describe=lambda case: _counts_words(case, n))
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        xs, ws = _tokens(ctx, chosens, ("contract", name))
        case = f"{label}, x in {name}, float32 weights, {n} ranks"
        dispatched = _call_all(ctx, DISPATCH, [(xs[r].to(dtype), chosens[r].clone(), E) for r in range(n)], case,
                               held=True)
        rows = [_pair(f"rank {o.rank}'s dispatch", o.value) for o in dispatched]
        if not all(torch.is_tensor(received) for received, _ in rows):
            raise Fail("dispatch returned its received rows as something other than a tensor")
        _call_all(ctx, COMBINE, [(received * 1.5, ws[r].clone(), state, xs[r].shape[0])
                                 for r, (received, state) in enumerate(rows)], case, held=True)


# --- forward and backward against one device ---------------------------------------------------------------


def _reference(xs, chosens, ws, params, grad_outs=None, serve=None) -> dict:
    """Every expert on one device, in float64, as MoE.dispatch computes it; with ``grad_outs``, the gradients.

    ``serve[e]``: whose parameters serve expert e's rows (a wrong layout); by default expert e's own.
    """
    E = len(params)
    serve = serve or list(range(E))
    leaves = [[p.double().requires_grad_(True) for p in ps] for ps in params]
    xs = [x.double().requires_grad_(True) for x in xs]
    ws = [w.double().requires_grad_(True) for w in ws]
    outs = []
    for x, ch, w in zip(xs, chosens, ws):
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = (ch == e).nonzero(as_tuple=True)
            w1, b1, w2, b2 = leaves[serve[e]]
            y = torch.tanh(x[token] @ w1.T + b1) @ w2.T + b2
            out = out.index_add(0, token, y * w[token, slot, None])
        outs.append(out)
    result = {"out": [o.detach() for o in outs]}
    if grad_outs is not None:
        sum((o * g.double()).sum() for o, g in zip(outs, grad_outs)).backward()
        result["dx"] = [x.grad for x in xs]
        result["dweights"] = [w.grad for w in ws]
        result["dexperts"] = [[torch.zeros_like(p) if p.grad is None else p.grad for p in ps] for ps in leaves]
    return result


PARAM_NAMES = ("its first Linear's weight", "its first Linear's bias", "its second Linear's weight",
               "its second Linear's bias")


def _forward_backward(ctx, label: str, chosens: list, E: int, judge: bool = True):
    """Every rank's forward_backward, checked against one device unless not ``judge``; the Outcomes."""
    n = ctx.world_size
    per = E // n
    xs, ws = _tokens(ctx, chosens, label)
    params = _expert_params(ctx, E, label)
    g = ctx.generator("grad", label)
    grad_outs = [torch.randn(x.shape, generator=g) for x in xs]
    want = _reference(xs, chosens, ws, params, grad_outs)
    unweighted = _reference(xs, chosens, [torch.ones_like(w) for w in ws], params)["out"]
    serve = [_home(e % n, e // n, n, per) for e in range(E)]  # expert e's rows on rank e % n, local e // n
    rr = _reference(xs, chosens, ws, params, serve=serve)["out"] if serve != list(range(E)) else None
    args = [(xs[r].clone(), chosens[r].clone(), ws[r].clone(), params[r * per:(r + 1) * per], grad_outs[r])
            for r in range(n)]
    outs = _call_all(ctx, "forward_backward", args, f"{label}, {n} ranks")
    if not judge:
        return outs
    where = f"({label}, {n} ranks)"
    for o in outs:
        r = o.rank
        got = o.value
        if not isinstance(got, dict) or not {"out", "dx", "dweights", "dexperts"} <= set(got):
            raise Fail(f"rank {r}'s forward_backward returned {type(got).__name__}, not the given dict: "
                       f"keep forward_backward as it was given")
        _expect(f"rank {r}'s output {where}", got["out"], want["out"][r].float(),
                [(unweighted[r], "it is the experts' outputs summed without the router's weights"),
                 (None if rr is None else rr[r], "each expert's rows were served by the expert of another: "
                  "expert e lives on rank e // (E/n), as its local expert e % (E/n), not on rank e % n")])
        if got["dx"] is None:
            raise Fail(f"rank {r}: no gradient reached x {where}: the rows must travel through AllToAll (an "
                       f"autograd Function), not a bare dist.all_to_all_single, which autograd cannot see")
        if got["dweights"] is None:
            raise Fail(f"rank {r}: no gradient reached weights {where}: combine must multiply the rows by the "
                       f"weights, inside the graph")
        swapped = ("; the forward is right, so the backward is not: each all-to-all's gradient must go back "
                   "the way its rows came, the same all-to-all with the split sizes swapped")
        problem = describe_mismatch(f"rank {r}'s dx {where}", got["dx"], want["dx"][r].float(), ATOL, RTOL)
        if problem:
            raise Fail(problem + swapped)
        _expect(f"rank {r}'s dweights {where}", got["dweights"], want["dweights"][r].float())
        mine = got["dexperts"]
        if not isinstance(mine, (list, tuple)) or len(mine) != per:
            raise Fail(f"rank {r}'s forward_backward returned {type(mine).__name__} as dexperts, not {per} "
                       f"experts' gradients: keep forward_backward as it was given")
        for local, grads in enumerate(mine):
            e = r * per + local
            for p, (name, grad) in enumerate(zip(PARAM_NAMES, grads)):
                expected = want["dexperts"][e][p].float()
                what = f"rank {r}'s expert {e}: the gradient of {name} {where}"
                if grad is None:
                    if expected.abs().max() > 0:
                        raise Fail(f"{what} is None, but expert {e} received rows: its output must reach the "
                                   f"combined output through autograd")
                    continue  # an expert that got no row and was skipped: right
                problem = describe_mismatch(what, grad, expected, ATOL, RTOL)
                if problem:
                    raise Fail(problem)
    return outs


def _ring(ctx, n: int, N: int) -> list:
    """Each rank's tokens: one expert of its own, one of the next rank's (E = 2n): as many rows in as out."""
    g = ctx.generator("ring")
    return [_shuffled(g, [[2 * r + int(a), 2 * ((r + 1) % n) + int(b)]
                          for a, b in torch.randint(0, 2, (N, 2), generator=g).tolist()]) for r in range(n)]


def _skewed(ctx, n: int) -> list:
    """Rank 0 keeps its tokens on its own experts (0 and 1); the others' all choose the hot expert 2, and as their
    second one rank 0's experts, but for rank 3's first five tokens: the experts 3 … 7, one row each (its last token
    adds a second to at most one of them), whatever the seed — a single row is a case of its own."""
    g = ctx.generator("skewed")
    sizes = [5, 7, 4, 6]
    chosens = [_shuffled(g, [[0, 1]] * sizes[0])]
    for r in range(1, n):
        rows = []
        for t in range(sizes[r]):
            pool = [0, 1, *range(3, 2 * n)] if r == n - 1 else [0, 1]
            other = 3 + t if r == n - 1 and t < 2 * n - 3 else int(_pairs(g, 1, 1, pool))
            rows.append([2, other])
        chosens.append(_shuffled(g, rows))
    return chosens


@EXERCISE.check("forward and backward equal every expert on one device (4 ranks, skewed routing)", points=2,
                world_size=4, hint=(
    "moe_forward: dispatch, then each local expert e on its received rows — recv_counts, read as "
    "(source rank, local expert), says which: torch.arange(E/n).repeat(n).repeat_interleave(recv_counts) is "
    "each row's local expert — then combine. Backward needs nothing more if both row all-to-alls go through "
    "AllToAll: its backward is dist.all_to_all_single(back, grad, in_splits, out_splits), the forward's "
    "splits swapped, since a row's gradient goes home to the rank that sent the row."))
def forward_backward(ctx):
    n = ctx.world_size
    _forward_backward(ctx, "ring routing: each rank's tokens to its own experts and the next rank's",
                      _ring(ctx, n, 6), 2 * n)
    _forward_backward(ctx, "skewed: rank 0 keeps all its tokens, expert 2 gets most of the others",
                      _skewed(ctx, n), 2 * n)


@EXERCISE.check("an expert that gets no token, or a single one (4 ranks)", points=1, world_size=4, hint=(
    "When every token chooses the experts of rank 0, the other ranks receive no row at all, and an expert "
    "anywhere may get none: its rows are an empty (0, C) tensor. Run it on them (a zero gradient) or skip it "
    "(no gradient) — but nothing that needs a row, such as .max(), [0] or torch.cat of an empty list. An "
    "all-to-all with splits of 0 works, and every rank must still call it, in backward too: if a rank skips "
    "all its experts, its output no longer depends on the rows it received, autograd never runs that rank's "
    "AllToAll backward, and the other ranks wait for it for ever. Running every expert, even on zero rows, "
    "keeps the graph whole. An expert with a single row gets a (1, C) tensor: keep it two-dimensional (no "
    "squeeze, no integer index)."))
def empty_expert(ctx):
    n = ctx.world_size
    g = ctx.generator("empty")
    sizes = [4, 3, 5, 2]
    _forward_backward(ctx, "every token on experts 0 and 1, both of rank 0",
                      [_shuffled(g, [[0, 1]] * s) for s in sizes], 2 * n)
    _forward_backward(ctx, "one expert per token, every token's expert 0",
                      [torch.zeros(s, 1, dtype=torch.long) for s in sizes], 2 * n)
    _forward_backward(ctx, "no token on experts 3 and 4",
                      [_pairs(g, s + 3, 2, [e for e in range(2 * n) if e not in (3, 4)]) for s in sizes], 2 * n)
    # Fixed, whatever the seed: experts 1 … 7 each get exactly one row, expert 0 all the others.
    singles = [[1, 0, 0, 0], [2, 3, 0], [4, 0, 5, 0, 0], [6, 7]]
    _forward_backward(ctx, "experts 1 to 7 one row each, expert 0 the rest",
                      [torch.tensor(experts).view(-1, 1) for experts in singles], 2 * n)


# --- the traffic ------------------------------------------------------------------------------------------------


@EXERCISE.check("bytes: each row crosses once each way (4 ranks)", points=1, world_size=4, hint=(
    "A forward and backward is five all-to-alls per rank: the E counts (int64, E·8 bytes), this rank's N·k "
    "rows out, the R rows its experts received back home, and in backward the same two again, swapped "
    "(fp32: rows·C·4 bytes each). The backward reuses the forward's splits: no new counts. Sending every "
    "token to every rank costs n times as much."))
def traffic(ctx):
    n = ctx.world_size
    E, k = 2 * n, 2
    # Token u of all 24 chooses experts u % 8 and (u + 3) % 8: 6 rows for each expert, 12 for each rank, which
    # sends 10, 14, 6 and 18.
    sizes, starts = [5, 7, 3, 9], [0, 5, 12, 15]
    g = ctx.generator("traffic")
    chosens = [_shuffled(g, [[u % E, (u + 3) % E] for u in range(a, a + s)]) for a, s in zip(starts, sizes)]
    layout = _layout(chosens, E)
    outs = _forward_backward(ctx, "6 rows for every expert", chosens, E, judge=False)
    for o in outs:
        r = o.rank
        sent, back = sizes[r] * k, len(layout[r])
        want = sorted([E * 8, sent * C * 4, back * C * 4, sent * C * 4, back * C * 4])
        got = sorted(c["bytes"] for c in o.comm if c["op"] == "all_to_all")
        if got == want:
            continue
        problem = (f"rank {r}'s all-to-alls carried {got} bytes; expected {want}: the counts ({E} × 8), its "
                   f"{sent} rows out and the {back} its experts received back ({C} floats of 4 bytes each), then "
                   f"the same two again in backward")
        if got.count(E * 8) > 1:
            problem += (f"; the counts were exchanged {got.count(E * 8)} times: once, in dispatch, is enough — keep "
                        f"recv_counts and the splits in state for moe_forward and combine (backward reuses them)")
        elif sum(got) > sum(want):
            problem += "; more bytes than the rows need: each row goes only to the rank that holds its expert"
        raise Fail(problem)
    # What each pair of ranks carried, by the kernel's count: rank r's counts for s's experts, the rows r sends s
    # out and gets back, and the rows s sends r out and gets back, each twice (forward, then their gradients).
    data, note = ctx.payloads(outs)
    for r in range(n):
        for s in range(n):
            rows = [sum(i == a for i, _, _ in layout[b]) for a, b in ((r, s), (s, r))]
            want = E // n * 8 + 2 * sum(rows) * C * 4
            if r != s and data.get((r, s), 0) != want:
                raise Fail(f"rank {r} sent rank {s} {data.get((r, s), 0)} bytes{note}; expected {want}: the counts "
                           f"of rank {s}'s {E // n} experts ({E // n} × 8), the {rows[0]} rows rank {r} sends rank "
                           f"{s} and the {rows[1]} it gets from rank {s} and sends back ({C} floats of 4 bytes "
                           f"each), each once forward and once backward")
