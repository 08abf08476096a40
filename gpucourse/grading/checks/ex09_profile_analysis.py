"""Checks of exercise 9: time shares of a timeline, MFU and scaling efficiency, against gpucourse.profiling."""

from __future__ import annotations

import math

import torch

from ... import profiling
from ..core import Exercise, Fail

EXERCISE = Exercise("ex09_profile_analysis", "Reading a profile", "notebooks/08_profiling.ipynb")

KINDS = ("compute", "comm", "idle")
TOL = 1e-9


def _span(kind: str, start: float, end: float, step: int = 1, rank: int = 0, **extra) -> dict:
    return {"rank": rank, "step": step, "kind": kind, "name": kind, "microbatch": None,
            "start_s": float(start), "end_s": float(end), **extra}


def _expected(spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    return {rank: {k: t[k] for k in KINDS} for rank, t in profiling.time_shares(spans, [step]).items()}


def _shares(ctx, spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    """The learner's answer, checked for shape (a dict of ranks, each with three numbers)."""
    copy = [dict(s) for s in spans]
    got = ctx.load().time_shares(copy, step)
    if not isinstance(got, dict):
        raise Fail(f"time_shares returned a {type(got).__name__}, not a dict {{rank: shares}}")
    for rank, shares in got.items():
        if not isinstance(shares, dict) or not all(isinstance(shares.get(k), (int, float)) for k in KINDS):
            raise Fail(f"time_shares gave rank {rank!r} {shares!r}; expected a dict with the numbers "
                       f"'compute', 'comm' and 'idle'")
    return got


def _text(shares: dict) -> str:
    return ", ".join(f"{k} {shares[k]:.4g}" for k in KINDS)


def _compare(ctx, what: str, spans: list[dict], step: int, explain=None) -> None:
    """Fail unless the learner's shares of ``step`` equal gpucourse.profiling's.

    ``explain(rank, got)`` may return a sentence about a known way to get them wrong.
    """
    got, want = _shares(ctx, spans, step), _expected(spans, step)
    if sorted(got, key=str) != sorted(want):
        raise Fail(f"{what}: time_shares gave ranks {sorted(got, key=str)}, expected {sorted(want)} (every rank with a "
                   f"'step' span of step {step}, and only those)")
    for rank in sorted(want):
        g, w = got[rank], want[rank]
        if all(abs(g[k] - w[k]) <= TOL for k in KINDS):
            continue
        extra = explain(rank, g) if explain else None
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
    and collectives: after the backward, or (``overlap``) in the background and blocking inside compute."""
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
            t = opt[1] + u(0, .3)
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


def _explain_overlap(spans: list[dict], step: int):
    def explain(rank, got):
        unblocked = [{k: v for k, v in s.items() if k != "blocking"} for s in spans]
        if _matches(got, unblocked, step, rank):
            return ("; that counts the blocking all-reduce inside the forward as compute, but the rank was "
                    "waiting in it, not computing")
        comm_first = [dict(s, blocking=True) if s["kind"] == "comm" else s for s in spans]
        if _matches(got, comm_first, step, rank):
            return ("; that counts the background all-reduce during the backward as communication, but the "
                    "backward was computing all along: that time is hidden")
        return None
    return explain


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
    _compare(ctx, "a step whose collectives overlap compute and each other", timeline, 1,
             _explain_overlap(timeline, 1))
    g = ctx.generator()
    for k in range(5):
        spans = _random_timeline(g, 1, 2, True)
        _compare(ctx, f"a random timeline with overlaps ({k + 1} of 5)", spans, 1, _explain_overlap(spans, 1))


@EXERCISE.check("every rank in its own window, spans cut to it", points=2, hint=(
    "Each rank has its own 'step' span, with its own start and end: a straggler's is longer, and a rank "
    "that waits for it idles or sits in a blocking collective. Use the rank's own window and only its own "
    "spans of that step, and cut a span that starts before the window or ends after it (an all-reduce "
    "still running when the step ends) to the part inside."))
def ranks_and_windows(ctx):
    # Step 1 on three ranks. Rank 2 is a straggler (a 6 s forward); ranks 0 and 1 wait for it in the
    # gradient all-reduce. Rank 0's last bucket runs past its step's end; rank 1's step starts late.
    timeline = [
        _span("step", 0, 10, 1, 0), _span("forward", 0, 2, 1, 0), _span("backward", 2, 4, 1, 0),
        _span("comm", 4, 9, 1, 0, blocking=True), _span("optimizer", 9, 9.5, 1, 0), _span("comm", 9.5, 12, 1, 0),
        _span("step", 1, 10, 1, 1), _span("forward", 1, 3, 1, 1), _span("idle", 3, 3.5, 1, 1),
        _span("backward", 3.5, 5, 1, 1), _span("comm", 5, 9, 1, 1, blocking=True),
        _span("optimizer", 9, 9.5, 1, 1),
        _span("step", 0, 10, 1, 2), _span("forward", 0, 6, 1, 2), _span("backward", 6, 8.5, 1, 2),
        _span("comm", 8.5, 9, 1, 2, blocking=True), _span("optimizer", 9, 9.5, 1, 2),
        _span("step", 10, 19, 2, 0), _span("forward", 10, 12, 2, 0), _span("step", 10, 20, 2, 1),
        _span("comm", -1, 0, 0, 0, blocking=True), _span("comm", 0.5, 1, 0, 1, blocking=True),
        _span("step", 12, 20, 2, 3), _span("forward", 12, 20, 2, 3),  # no step-1 window: no shares
    ]

    def explain(rank, got):
        if rank == 0 and got["comm"] > 0.55 + 1e-6:
            return "; rank 0's all-reduce from 9.5 s to 12 s counts only up to its step's end at 10 s"
        early = [dict(s, start_s=0.0) if s["kind"] == "step" and s["rank"] == 1 and s["step"] == 1 else s
                 for s in timeline]
        if rank == 1 and _matches(got, early, 1, 1):
            return "; rank 1's step runs from 1 s to 10 s, its own window, not from the first rank's start"
        return None

    _compare(ctx, "three ranks, one of them a straggler", timeline, 1, explain)
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
    for step in (1, 2):
        _compare(ctx, "a dp=2 run of gpucourse's tiny model with gradient buckets", result.timeline, step)


def _close(got, want) -> bool:
    return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9)


@EXERCISE.check("mfu", points=2, hint=(
    "Achieved FLOP/s = 6 x N x tokens/s: 2·N per token forward, 4·N backward. The peak to compare it with "
    "is that of every device the run used, world_size x peak_flops. MFU is a fraction (0.4 is 40%)."))
def mfu(ctx):
    fn = ctx.load().mfu
    g = ctx.generator()
    cases = [(10_000.0, 1_000_000, 1e12, 1), (3_000.0, 124_000_000, 312e12, 8), (120_000.0, 6_700_000_000, 989e12, 64)]
    for _ in range(6):
        r = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        cases.append((1e3 + 1e5 * r[0], int(1e6 + 1e9 * r[1]), 1e12 + 1e15 * r[2], 1 + int(16 * r[3])))
    for tokens, n, peak, world in cases:
        got = fn(tokens, n, peak, world)
        want = 6 * n * tokens / (world * peak)
        if not _close(got, want):
            extra = ""
            if _close(got, want / 3):
                extra = " — that counts 2·N FLOPs per token, the forward pass alone"
            elif world > 1 and _close(got, want * world):
                extra = f" — that compares with one device's peak, but the run used {world}"
            elif _close(got, 100 * want):
                extra = " — that is a percentage; return the fraction"
            raise Fail(f"mfu(tokens_per_s={tokens:g}, n_params={n}, peak_flops={peak:g}, world_size={world}) = "
                       f"{got!r}; expected 6·N·tokens/s / (world_size·peak) = {want:.6g}{extra}")


@EXERCISE.check("scaling_efficiency", points=1, hint=(
    "With n ranks, perfect scaling is n times the one-rank throughput. Efficiency is the throughput you got "
    "over that: (tokens/s on n ranks / n) / (tokens/s on one rank). It is at most about 1, and it falls as "
    "communication and waiting grow."))
def efficiency(ctx):
    fn = ctx.load().scaling_efficiency
    g = ctx.generator()
    cases = [(1000.0, 1500.0, 2), (1000.0, 4000.0, 4), (800.0, 5000.0, 8)]
    for _ in range(5):
        r = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        n = 2 + int(14 * r[2])
        one = 100 + 1e4 * r[0]
        cases.append((one, one * n * (0.2 + 0.8 * r[1]), n))
    for one, many, n in cases:
        got = fn(one, many, n)
        want = many / n / one
        if not _close(got, want):
            extra = ""
            if _close(got, many / one):
                extra = f" — that is the speed-up; efficiency divides it by n = {n}"
            elif _close(got, 1 / want):
                extra = " — that is the inverse"
            raise Fail(f"scaling_efficiency(tokens_per_s_1={one:g}, tokens_per_s_n={many:g}, n={n}) = {got!r}; "
                       f"expected {want:.6g}{extra}")
