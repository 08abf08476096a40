"""Checks of exercise 9: time shares of a timeline, MFU and scaling efficiency, against gpucourse.profiling.

Timelines are plain data (lists of span dicts) built here, or recorded here from a real run, and sent to the
learner's functions in the sandbox; the expected shares come from gpucourse.profiling, here.
"""

from __future__ import annotations

import math

import torch

from ... import profiling
from ..core import Exercise, Fail

EXERCISE = Exercise("ex09_profile_analysis", "Reading a profile", "notebooks/08_profiling.ipynb",
                    concept=("a profile's time splits, per rank, into compute, communication and idle; communication "
                             "is exposed where no compute hides it"),
                    section="§3 (compute, communication, idle, and MFU)")

KINDS = ("compute", "comm", "idle")
TOL = 1e-9


def _span(kind: str, start: float, end: float, step: int = 1, rank: int = 0, **extra) -> dict:
    return {"rank": rank, "step": step, "kind": kind, "name": kind, "microbatch": None,
            "start_s": float(start), "end_s": float(end), **extra}


def _expected(spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    return {rank: {k: t[k] for k in KINDS} for rank, t in profiling.time_shares(spans, [step]).items()}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _shares(ctx, spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    """The learner's answer, checked for shape (a dict of ranks, each with three numbers)."""
    got = ctx.call("time_shares", spans, step).value
    if not isinstance(got, dict):
        raise Fail(f"time_shares returned a {type(got).__name__}, not a dict {{rank: shares}}")
    for rank, shares in got.items():
        if not isinstance(shares, dict) or not all(_number(shares.get(k)) for k in KINDS):
            raise Fail(f"time_shares gave rank {rank!r} {repr(shares)[:200]}; expected a dict with the numbers "
                       f"'compute', 'comm' and 'idle'")
    return got


def _text(shares: dict) -> str:
    return ", ".join(f"{k} {shares[k]:.4g}" for k in KINDS)


# Known wrong readings of a timeline, each as the timeline that the right reading would turn into that answer:
# a learner's shares that equal the right shares of the changed timeline (and not of the real one) are named.
VARIANTS = (
    ("; that counts the blocking all-reduce inside the forward as compute, but the rank was waiting in it, "
     "not computing", lambda s: {k: v for k, v in s.items() if k != "blocking"}),
    ("; that counts the background all-reduce during the backward as communication, but the backward was "
     "computing all along: that time is hidden", lambda s: dict(s, blocking=True) if s["kind"] == "comm" else s),
    ("; that counts spans of other steps that reach into this step's window (a collective still running "
     "when the previous step ended); use only the rank's spans of this step",
     lambda s: s if s["kind"] == "step" else dict(s, step="any")),
    ("; that counts the 'idle' span as compute: in an 'idle' span the rank computes nothing",
     lambda s: dict(s, kind="forward") if s["kind"] == "idle" else s),
)


def _variant(spans: list[dict], change, step: int) -> list[dict]:
    changed = [change(s) for s in spans]
    # "any" step: the span counts in every window of its rank (the answer of a time_shares that ignores 'step').
    return [dict(s, step=step) if s["step"] == "any" else s for s in changed]


def _known_mistake(spans: list[dict], step: int, rank: int, got: dict) -> str | None:
    named = [text for text, change in VARIANTS if _matches(got, _variant(spans, change, step), step, rank)]
    return named[0] if len(named) == 1 else None


def _compare(ctx, what: str, spans: list[dict], step: int, explain=None) -> None:
    """Fail unless the learner's shares of ``step`` equal gpucourse.profiling's.

    ``explain(rank, got)`` may return a sentence about a way to get them wrong that only this timeline shows;
    the known wrong readings (VARIANTS) are tried on every timeline.
    """
    got, want = _shares(ctx, spans, step), _expected(spans, step)
    if set(got) != set(want):
        raise Fail(f"{what}: time_shares gave ranks {sorted(got, key=str)}, expected {sorted(want)} (every rank "
                   f"with a 'step' span of step {step}, and only those)")
    for rank in sorted(want):
        g, w = got[rank], want[rank]
        if all(abs(g[k] - w[k]) <= TOL for k in KINDS):
            continue
        extra = (explain(rank, g) if explain else None) or _known_mistake(spans, step, rank, g)
        if not extra:
            total = sum(g[k] for k in KINDS)
            busy = g["compute"] + g["comm"]
            if busy > 1 - w["idle"] + 1e-6:
                extra = (f"; compute and communication add up to {busy:.4g} of the window, but spans cover only "
                         f"{1 - w['idle']:.4g} of it: time covered by two spans at once was counted twice")
            elif abs(total - 1) > 1e-6:
                extra = f"; they add up to {total:.4g}, not 1"
        raise Fail(f"{what}, step {step}, rank {rank}: got {_text(g)}; expected {_text(w)}{extra or ''}")


def _matches(got: dict, spans: list[dict], step: int, rank: int) -> bool:
    want = _expected(spans, step).get(rank)
    return want is not None and all(abs(got[k] - want[k]) <= TOL for k in KINDS)


def _random_timeline(g: torch.Generator, ranks: int, steps: int, overlap: bool) -> list[dict]:
    """Consecutive steps per rank, each a forward, a backward and an optimizer step with gaps between,
    and collectives: after the backward, or (``overlap``) in the background and blocking inside compute.
    Every span lies inside its own step's window, so only the fixed timelines, which are built for it, tell
    a reading that ignores 'step' from the right one (on every seed alike)."""
    def u(lo, hi):
        return lo + (hi - lo) * float(torch.rand((), generator=g, dtype=torch.float64))

    spans = []
    for rank in range(ranks):
        t = u(0, 1)
        for step in range(steps):
            begin = t
            fwd = (t + u(0, .1), t + u(.2, 1))
            bwd = (fwd[1] + u(0, .1), fwd[1] + u(.5, 2))
            comms = []
            if overlap:
                for _ in range(3):
                    a = u(fwd[0], bwd[1])
                    comms.append(_span("comm", a, a + u(.05, .8), step, rank))
                a = u(*fwd)
                comms.append(_span("comm", a, min(a + u(.01, .2), fwd[1]), step, rank, blocking=True))
                after = bwd[1]
            else:
                comms.append(_span("comm", bwd[1] + u(0, .1), bwd[1] + u(.2, .6), step, rank,
                                   **({"blocking": True} if u(0, 1) < .5 else {})))
                after = comms[-1]["end_s"]
            opt = (after + u(0, .1), after + u(.2, .4))
            t = max([opt[1]] + [c["end_s"] for c in comms]) + u(0, .3)
            spans += [_span("step", begin, t, step, rank), _span("forward", *fwd, step, rank),
                      _span("backward", *bwd, step, rank), _span("optimizer", *opt, step, rank), *comms]
    return spans


@EXERCISE.check("time_shares of one rank's step", points=2, hint=(
    "The window is the rank's 'step' span of that step; its length is the step's wall time. Add up the time "
    "inside it that forward, backward and optimizer spans cover (compute) and that comm spans cover "
    "(communication); what is covered by neither is idle. Leave out the spans of other steps, and divide "
    "by the window's length so the three shares add up to 1."))
def one_rank(ctx):
    # Step 1, 10 s: forward 3, backward 4, all-reduce 1 (blocking), optimizer 1; idle 0.5 + 0.5.
    timeline = [_span("step", 0, 9.5, step=0), _span("forward", 0, 9, step=0),
                _span("step", 10, 20), _span("forward", 10, 13), _span("backward", 13, 17),
                _span("comm", 17, 18, blocking=True), _span("optimizer", 18.5, 19.5),
                _span("step", 20, 25, step=2), _span("comm", 20, 24, step=2)]
    _compare(ctx, "a step of forward 3 s, backward 4 s, all-reduce 1 s, optimizer 1 s", timeline, 1)
    g = ctx.generator()
    for k in range(5):
        _compare(ctx, f"a random timeline without overlaps ({k + 1} of 5)", _random_timeline(g, 1, 3, False), 1)


@EXERCISE.check("overlapping spans count once, blocking ones as communication", points=2, hint=(
    "Cut the window at every span's start and end: between two cuts the same spans are open throughout. "
    "Each piece is communication if a blocking comm span covers it, else compute if a forward, backward or "
    "optimizer span covers it, else communication if any comm span does, else idle. Summing each kind's "
    "span durations counts overlapping time twice."))
def overlaps(ctx):
    # 10 s: forward 0-3 with a blocking all-reduce 1-2 in it; backward 3-6 with a bucket all-reduce 4-7
    # behind it; two buckets in flight at once, 7.5-9 and 8-9.5; optimizer 9.5-10.
    timeline = [_span("step", 0, 10), _span("forward", 0, 3), _span("comm", 1, 2, blocking=True),
                _span("backward", 3, 6), _span("comm", 4, 7), _span("comm", 7.5, 9), _span("comm", 8, 9.5),
                _span("optimizer", 9.5, 10)]
    _compare(ctx, "a step whose collectives overlap compute and each other", timeline, 1)
    g = ctx.generator()
    for k in range(5):
        spans = _random_timeline(g, 1, 2, True)
        _compare(ctx, f"a random timeline with overlaps ({k + 1} of 5)", spans, 1)


@EXERCISE.check("every rank in its own window, spans cut to it", points=2, hint=(
    "Each rank has its own 'step' span, with its own start and end: a straggler's is longer, and a rank "
    "that waits for it idles or sits in a blocking collective. Use the rank's own window and only its own "
    "spans of that step, and cut a span that starts before the window or ends after it (an all-reduce "
    "still running when the step ends) to the part inside."))
def ranks_and_windows(ctx):
    # Step 1 on three ranks. Rank 2 is a straggler (a 6 s forward); ranks 0 and 1 wait for it in the
    # gradient all-reduce. Rank 0's last bucket runs past its step's end, into step 2's window, where
    # rank 0 idles until its forward at 11 s; rank 1's step starts late, after a collective it launched
    # (which counts only from 1 s, and alone, till its forward at 1.5 s). Spans of steps 0 and 2 sit just
    # outside step 1's windows, rank 3 has no step-1 window.
    timeline = [
        _span("step", 0, 10, 1, 0), _span("forward", 0, 2, 1, 0), _span("backward", 2, 4, 1, 0),
        _span("comm", 4, 9, 1, 0, blocking=True), _span("optimizer", 9, 9.5, 1, 0), _span("comm", 9.5, 12, 1, 0),
        _span("step", 1, 10, 1, 1), _span("comm", 0.5, 1.5, 1, 1), _span("forward", 1.5, 3, 1, 1),
        _span("idle", 3, 3.5, 1, 1), _span("backward", 3.5, 5, 1, 1), _span("comm", 5, 9, 1, 1, blocking=True),
        _span("optimizer", 9, 9.5, 1, 1),
        _span("step", 0, 10, 1, 2), _span("forward", 0, 6, 1, 2), _span("backward", 6, 8.5, 1, 2),
        _span("comm", 8.5, 9, 1, 2, blocking=True), _span("optimizer", 9, 9.5, 1, 2),
        _span("step", 10, 19, 2, 0), _span("forward", 11, 12, 2, 0), _span("step", 10, 20, 2, 1),
        _span("comm", -1, 0, 0, 0, blocking=True), _span("comm", 0.5, 1, 0, 1, blocking=True),
        _span("step", 12, 20, 2, 3), _span("forward", 12, 20, 2, 3),  # no step-1 window: no shares
    ]

    def explain(rank, got):
        if rank == 0 and abs(got["comm"] - 0.75) <= TOL:
            return "; rank 0's all-reduce from 9.5 s to 12 s counts only up to its step's end at 10 s"
        if rank == 1 and abs(got["comm"] - 5 / 9) <= TOL:
            return "; rank 1's collective from 0.5 s to 1.5 s counts only from its step's start at 1 s"
        early = [dict(s, start_s=0.0) if s["kind"] == "step" and s["rank"] == 1 and s["step"] == 1 else s
                 for s in timeline]
        if rank == 1 and _matches(got, early, 1, 1):
            return "; rank 1's step runs from 1 s to 10 s, its own window, not from the first rank's start"
        return None

    _compare(ctx, "three ranks, one of them a straggler", timeline, 1, explain)
    _compare(ctx, "three ranks, the next step: rank 0 idles 10-11 s while step 1's last all-reduce still runs",
             timeline, 2)
    g = ctx.generator()
    for k in range(3):
        spans = _random_timeline(g, 3, 3, False)
        _compare(ctx, f"a random timeline of three ranks ({k + 1} of 3)", spans, 1)
        _compare(ctx, f"a random timeline of three ranks ({k + 1} of 3)", spans, 2)


def _recorded_run():
    from ...config import TrainConfig
    from ...train import run

    # Buckets all-reduced during backward: collectives overlap compute, as they do in real training.
    cfg = TrainConfig(dp=2, steps=3, batch_size=4, seq_len=16, bucket_mb=0.05, device="cpu")
    return run(cfg, quiet=True, timeout=120)


@EXERCISE.check("the shares of a recorded run", points=1, hint=(
    "A run's timeline is the same kind of list: one 'step' span per rank and step, and forward, backward, "
    "optimizer and comm spans inside it, where data parallel's bucket all-reduces overlap the backward. "
    "If the made-up timelines pass, check that you read 'start_s' and 'end_s' and group by 'rank' and "
    "'step'."))
def recorded(ctx):
    _shares(ctx, [], 1)  # an unwritten time_shares fails here, before a run is started for it
    result = _recorded_run()
    # The exercise reads a timeline as it teaches it: what is covered by compute, by communication, or by
    # nothing. A run also marks how long each collective only waited for the other rank (``wait_s``, which
    # gpucourse.profiling counts as idle); the exercise leaves that out, so the recorded spans go without it.
    spans = [{k: v for k, v in s.items() if k != "wait_s"} for s in result.timeline]
    for step in (1, 2):
        _compare(ctx, "a dp=2 run of gpucourse's tiny model with gradient buckets", spans, step)


def _close(got, want) -> bool:
    return _number(got) and math.isclose(got, want, rel_tol=1e-9)


def _named(answers: list[tuple], known: dict) -> str:
    """The known wrong formula that gives every answer (right and wrong alike), if exactly one does."""
    found = [text for text, formula in known.items()
             if all(_close(got, formula(*args)) for args, got, _ in answers)]
    return found[0] if len(found) == 1 else ""


@EXERCISE.check("mfu", points=2, hint=(
    "Achieved FLOP/s = 6 x N x tokens/s: 2·N per token forward, 4·N backward. The peak to compare it with "
    "is that of every device the run used, world_size x peak_flops. MFU is a fraction (0.4 is 40%)."))
def mfu(ctx):
    g = ctx.generator()
    cases = [(10_000.0, 1_000_000, 1e12, 1), (3_000.0, 124_000_000, 312e12, 8),
             (120_000.0, 6_700_000_000, 989e12, 64)]
    for _ in range(6):
        r = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        cases.append((1e3 + 1e5 * r[0], int(1e6 + 1e9 * r[1]), 1e12 + 1e15 * r[2], 1 + int(16 * r[3])))
    answers = [(case, ctx.call("mfu", *case).value, 6 * case[1] * case[0] / (case[3] * case[2])) for case in cases]
    wrong = [a for a in answers if not _close(a[1], a[2])]
    if not wrong:
        return
    known = {
        " — that counts 2·N FLOPs per token, the forward pass alone": lambda t, n, p, w: 2 * n * t / (w * p),
        " — that counts 4·N FLOPs per token: the backward costs twice the forward, 6·N in all":
            lambda t, n, p, w: 4 * n * t / (w * p),
        " — world_size times too large: that compares with one device's peak (the run used world_size of "
        "them), or takes tokens_per_s for one rank's (it is all ranks together)": lambda t, n, p, w: 6 * n * t / p,
        " — world_size times too small: tokens_per_s is already the whole run's, all ranks together":
            lambda t, n, p, w: 6 * n * t / (w * w * p),
        " — that is a percentage; return the fraction": lambda t, n, p, w: 600 * n * t / (w * p),
    }
    (tokens, n, peak, world), got, want = wrong[0]
    raise Fail(f"mfu(tokens_per_s={tokens:g}, n_params={n}, peak_flops={peak:g}, world_size={world}) = "
               f"{got!r}; expected 6·N·tokens/s / (world_size·peak) = {want:.6g}{_named(answers, known)}")


@EXERCISE.check("scaling_efficiency", points=1, hint=(
    "With n ranks, perfect scaling is n times the one-rank throughput. Efficiency is the throughput you got "
    "over that: (tokens/s on n ranks / n) / (tokens/s on one rank). It is at most about 1, and it falls as "
    "communication and waiting grow."))
def efficiency(ctx):
    g = ctx.generator()
    cases = [(1000.0, 1500.0, 2), (1000.0, 4000.0, 4), (800.0, 5000.0, 8)]
    for _ in range(5):
        r = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        n = 2 + int(14 * r[2])
        one = 100 + 1e4 * r[0]
        cases.append((one, one * n * (0.2 + 0.8 * r[1]), n))
    answers = [(case, ctx.call("scaling_efficiency", *case).value, case[1] / case[2] / case[0]) for case in cases]
    wrong = [a for a in answers if not _close(a[1], a[2])]
    if not wrong:
        return
    known = {
        " — that is the speed-up, tokens_per_s_n / tokens_per_s_1; efficiency divides it by n":
            lambda one, many, n: many / one,
        " — that is the inverse": lambda one, many, n: n * one / many,
        " — that is a percentage; return the fraction": lambda one, many, n: 100 * many / n / one,
        " — that divides by n twice: tokens_per_s_n is the whole run's throughput, all n ranks together":
            lambda one, many, n: many / n / n / one,
    }
    (one, many, n), got, want = wrong[0]
    raise Fail(f"scaling_efficiency(tokens_per_s_1={one:g}, tokens_per_s_n={many:g}, n={n}) = {got!r}; "
               f"expected {want:.6g}{_named(answers, known)}")
