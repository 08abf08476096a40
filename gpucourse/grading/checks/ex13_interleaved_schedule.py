"""Checks of exercise 13: interleaved 1F1B (virtual pipeline stages) as each rank's compute order.

The learner's function runs in the sandbox (where ``gpucourse.parallel.schedules_virtual`` is a copy without the
reference schedules); its answer comes back as plain data, lists of (kind, microbatch, chunk) tuples, and here
the real module puts the transfers around it (``with_transfers``), validates it, simulates it and compares it
with the reference order.
"""

from __future__ import annotations

import torch

from ...parallel import schedules_virtual as virtual
from ...parallel.schedules import B, F, Op, ScheduleError
from ..core import Exercise, Fail

EXERCISE = Exercise("ex13_interleaved_schedule", "Interleaved 1F1B: virtual pipeline stages",
                    "notebooks/04b_pipeline_schedules.ipynb",
                    concept=("with v chunks per rank a microbatch passes through every chunk in turn; the schedule "
                             "keeps every data dependency and interleaved 1F1B's warm-up depth"),
                    section="§2 (interleaving: v chunks per rank)")

# (pp, m, v), m a multiple of pp, with pp >= 2 and v >= 2 (one rank or one chunk is the edge check's): m = pp,
# where rank 0's warm-up 2(pp − 1) + (v − 1)·pp is more than the m·v forwards there are once pp >= 3 (the cap);
# m = 2·pp and 3·pp (a steady state on every rank); up to 8 ranks and 4 chunks.
FIXED = [(2, 2, 2), (2, 4, 3), (3, 3, 2), (3, 6, 4), (4, 4, 2), (4, 8, 3), (5, 5, 2), (8, 8, 2), (8, 16, 3)]
# One rank (every chunk on it: no transfers at all) and one chunk per rank.
EDGES = [(1, 1, 1), (1, 1, 3), (1, 4, 2), (1, 3, 4), (2, 2, 1), (3, 3, 1), (4, 8, 1), (5, 5, 1)]
# Large: the answer must come back quickly (and be right there too).
LARGE = [(16, 64, 4), (64, 64, 2)]


def _cases(ctx) -> list[tuple[int, int, int]]:
    g = ctx.generator()
    out = []
    for _ in range(3):
        pp, k, v = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 9), (1, 4), (2, 5)))
        out.append((pp, k * pp, v))
    return FIXED + out


def _warmup(pp: int, m: int, v: int, s: int) -> int:
    return min(2 * (pp - s - 1) + (v - 1) * pp, m * v)


def _where(pp: int, m: int, v: int) -> str:
    return f"pp={pp}, m={m}, v={v}"


def _op(op) -> Op:
    """One op as the sandbox sent it back: an Op comes as a (kind, microbatch, chunk) tuple; (kind, microbatch)
    is chunk 0, and an object with those attributes comes as a dict."""
    if isinstance(op, dict) and "kind" in op and "microbatch" in op:
        op = (op["kind"], op["microbatch"], op.get("chunk", 0))
    if not isinstance(op, (tuple, list)) or len(op) not in (2, 3) or not isinstance(op[0], str) \
            or any(not isinstance(x, int) or isinstance(x, bool) for x in op[1:]):
        raise TypeError
    return Op(*op)


def _orders(ctx, pp: int, m: int, v: int) -> list[list[Op]]:
    """The learner's compute order for (pp, m, v): one list of Ops per rank, F and B only."""
    out = ctx.call("interleaved_1f1b", pp, m, v).value
    if not isinstance(out, (list, tuple)) or len(out) != pp:
        raise Fail(f"interleaved_1f1b({pp}, {m}, {v}) returned {type(out).__name__}"
                   f"{f' of length {len(out)}' if isinstance(out, (list, tuple, dict, str)) else ''}, "
                   f"not a list of {pp} ranks")
    try:
        orders = [[_op(op) for op in rank] for rank in out]
    except TypeError:
        raise Fail(f"interleaved_1f1b({pp}, {m}, {v}): every rank must be a list, and every op an "
                   f"Op(kind, microbatch, chunk) of a kind (a str) and two ints") from None
    for s, ops in enumerate(orders):
        other = next((op for op in ops if op.kind not in (F, B)), None)
        if other is not None:
            raise Fail(f"{_where(pp, m, v)}: rank {s} runs {other}: return the compute ops only, F and B "
                       f"(with_transfers puts the sends and receives around them)")
    return orders


def _order(ops: list[Op], limit: int = 12) -> str:
    return " ".join(map(str, ops[:limit])) + (" …" if len(ops) > limit else "")


def _reference(pp: int, m: int, v: int) -> list[list[Op]]:
    return virtual.interleaved_1f1b(pp, m, v)


def _why_invalid(message: str, pp: int, m: int, v: int) -> str:
    """What a ScheduleError of the checker or the clock says about the compute order behind it."""
    if "done twice" in message:
        return (" — two of the rank's k give the same (microbatch, chunk): forward k is microbatch "
                "(k // (pp·v))·pp + k mod pp on chunk (k // pp) mod v, which covers each pair once")
    if "out of range" in message:
        return (f" — an op past the end: a rank has m·v = {m * v} forwards and as many backwards, so the "
                f"warm-up is at most m·v")
    if "deadlock" in message:
        stuck = message.split("deadlock: ", 1)[-1]
        if "RECV_B" in stuck and "RECV_F" not in stuck:
            return (" — every stuck rank waits for a gradient that its neighbour would send only after a "
                    "backward it cannot start: a microbatch's gradient comes back from the loss, through its "
                    "last chunk first (chunk v − 1, then v − 2, …)")
        return (" — the ranks wait for each other: a rank's forward of chunk c needs the previous virtual "
                "stage's forward of the same microbatch first")
    if "comes before F" in message and message.split("(", 1)[-1].startswith(("B", "RECV_B")):
        return (" — the rank's first backwards come before its own forwards of the same microbatch and "
                "chunk: a warm-up long enough runs them first (the first backward is microbatch 0 on the "
                "rank's last chunk, forward number (v − 1)·pp)")
    return ""


def _valid(orders: list[list[Op]], pp: int, m: int, v: int) -> None:
    layout = virtual.Layout(pp, v, "loop")
    try:
        virtual.validate(virtual.with_transfers(orders, layout), layout, m)
    except ScheduleError as e:
        why = _why_invalid(str(e), pp, m, v)
        raise Fail(f"{_where(pp, m, v)}: with its transfers, {str(e).rstrip('.') if why else e}{why}") from None


@EXERCISE.check("every (microbatch, chunk) forwarded and backwarded once, each after what it needs", points=2,
                hint=(
    "With its transfers (with_transfers(orders, Layout(pp, v, 'loop'))) a rank must forward and backward each "
    "(microbatch, chunk) once: a forward after the previous virtual stage's forward of that microbatch, a "
    "backward after its own forward and after the next virtual stage's backward. validate says where it "
    "breaks. Forward k is microbatch (k // (pp·v))·pp + k mod pp on chunk (k // pp) mod v; backward k the "
    "same on chunk v − 1 − (k // pp) mod v; and the warm-up must reach the rank's last chunk of microbatch 0 "
    "before its first backward."))
def valid(ctx):
    for pp, m, v in _cases(ctx):
        _valid(_orders(ctx, pp, m, v), pp, m, v)


def _first_backward(ops: list[Op]) -> int:
    kinds = [op.kind for op in ops]
    return kinds.index(B) if B in kinds else len(kinds)


def _warmup_signature(pp: int, m: int, v: int, counts: list[int]) -> str:
    """What the forwards each rank runs before its first backward say about the learner's warm-up."""
    total = m * v

    def runs(warm) -> list[int]:  # forwards before the first backward, with a warm-up of warm(s)
        return [min(warm(s), total) + (warm(s) < total) for s in range(pp)]

    if all(c == total for c in counts):
        return (" — every rank runs all m·v forwards before any backward: that is GPipe's order, and it holds "
                "every microbatch's activations")
    if any(c > total for c in counts):
        return f" — more forwards than the m·v = {total} there are: the warm-up is capped at m·v"
    if counts == runs(lambda s: (pp - s - 1) + (v - 1) * pp):
        return (" — a warm-up of (pp − s − 1) + (v − 1)·pp: plain 1F1B's pp − s − 1 where interleaved 1F1B "
                "takes 2(pp − s − 1)")
    if counts == runs(lambda s: 2 * (pp - s - 1)):
        return (" — a warm-up of 2(pp − s − 1), without the (v − 1)·pp: a rank's first backward is microbatch 0 "
                "on its last chunk, whose forward is its forward number (v − 1)·pp")
    if counts == runs(lambda s: pp - s - 1):
        return (" — plain 1F1B's warm-up, pp − s − 1: interleaved 1F1B adds (v − 1)·pp forwards, and takes "
                "2(pp − s − 1)")
    return ""


@EXERCISE.check("a warm-up of 2(p − s − 1) + (v − 1)·p forwards, at most m·v, then one forward, one backward",
                points=2, hint=(
    "Rank s warms up with 2(pp − s − 1) + (v − 1)·pp forwards: (v − 1)·pp take the first pp microbatches "
    "through every chunk but the last (the rank's first backward is microbatch 0 on its last chunk, v − 1), and "
    "2(pp − s − 1) keep the ranks after it busy while the first gradient comes back. There are only m·v "
    "forwards: cap the warm-up there. Then one forward, one backward, in turn, and the backwards still owed."))
def warmup(ctx):
    for pp, m, v in _cases(ctx):
        orders = _orders(ctx, pp, m, v)
        total = m * v
        counts = [_first_backward(ops) for ops in orders]
        for s, ops in enumerate(orders):
            warm = _warmup(pp, m, v, s)
            want = warm + (warm < total)  # the warm-up, then the steady state's first forward
            if counts[s] != want:
                raise Fail(f"{_where(pp, m, v)}: rank {s} runs {counts[s]} forward{'s' * (counts[s] != 1)} "
                           f"before its first backward; interleaved 1F1B runs {want} there: a warm-up of "
                           f"{warm}{f' (m·v = {total})' if warm == total else ''}"
                           f"{', then the first forward of the steady state' if warm < total else ''}"
                           f"{_warmup_signature(pp, m, v, counts)}")
            kinds = [op.kind for op in ops]
            expected = [F] * warm + [F, B] * (total - warm) + [B] * warm
            if kinds != expected:
                n = next((n for n, (a, b) in enumerate(zip(kinds, expected)) if a != b),
                         min(len(kinds), len(expected)))
                says = kinds[n] if n < len(kinds) else "nothing"
                raise Fail(f"{_where(pp, m, v)}: rank {s}'s compute op {n} is {says}; interleaved 1F1B runs "
                           f"{expected[n] if n < len(expected) else 'nothing'} there (rank {s}'s F/B order: "
                           f"{_order(ops, 20)}): after {warm} warm-up forwards, one forward and one backward in "
                           f"turn, {total} of each in all")


def _pattern_signature(pp: int, v: int, got: list[Op], want: list[Op]) -> str:
    """What a sequence of forwards (or backwards) that is not interleaved 1F1B's looks like."""
    n = len(want)
    if len(got) > n:
        return f" — {len(got)} of them: a rank has m·v = {n}"
    chunks, microbatches = [op.chunk for op in got], [op.microbatch for op in got]
    backward = bool(want) and want[0].kind == B

    def chunk(c: int) -> int:  # a backward's chunk counts down from v − 1
        return v - 1 - c if backward else c

    if len(got) == n and v > 1:
        if chunks == [chunk(k % v) for k in range(n)]:
            if microbatches == [k // v for k in range(n)]:
                return (" — each microbatch through all its chunks before the next one (depth first): "
                        "interleaved 1F1B takes pp microbatches through a chunk, then the same pp through the "
                        "next chunk")
            return (" — the chunk changes with every op, k mod v: interleaved 1F1B keeps a chunk for pp ops "
                    "in a row, (k // pp) mod v")
        if microbatches == [k // v for k in range(n)]:
            return (" — microbatch k // v: op k is microbatch (k // (pp·v))·pp + k mod pp, the pp microbatches "
                    "of a group going through each chunk in turn")
        if backward and chunks == [(k // pp) % v for k in range(n)]:
            return (" — the chunks in the order of the forwards: a gradient starts at the loss, after the last "
                    "chunk, so the backwards take chunk v − 1 first")
    return ""


def _compare(ctx, kind: str, what: str) -> None:
    for pp, m, v in _cases(ctx):
        orders, reference = _orders(ctx, pp, m, v), _reference(pp, m, v)
        for s in range(pp):
            got = [op for op in orders[s] if op.kind == kind]
            want = [op for op in reference[s] if op.kind == kind]
            if got != want:
                k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                raise Fail(f"{_where(pp, m, v)}: rank {s}'s {what} {k} is "
                           f"{got[k] if k < len(got) else 'missing'}; interleaved 1F1B's is "
                           f"{want[k] if k < len(want) else 'nothing'} (rank {s}'s {what}s: {_order(got)}; "
                           f"interleaved 1F1B's: {_order(want)}){_pattern_signature(pp, v, got, want)}")


@EXERCISE.check("forwards go p microbatches through a chunk, then the next chunk", points=1, hint=(
    "A rank's forward k is microbatch (k // (pp·v))·pp + k mod pp on chunk (k // pp) mod v: microbatches 0 … "
    "pp − 1 through chunk 0, the same pp through chunk 1, … through chunk v − 1, then the next pp microbatches. "
    "pp at a time is what keeps every rank busy: by the time microbatch 0 comes back to rank 0 for chunk 1, "
    "rank 0 has had pp forwards of chunk 0 to run."))
def forwards(ctx):
    _compare(ctx, F, "forward")


@EXERCISE.check("backwards take the chunks in reverse", points=1, hint=(
    "Backwards follow the forwards' order of microbatches, pp at a time, with the chunks reversed: backward k is "
    "microbatch (k // (pp·v))·pp + k mod pp on chunk v − 1 − (k // pp) mod v. The gradient starts at the loss, "
    "after the model's last chunk, and goes back through the virtual stages in reverse: chunk v − 1 first."))
def backwards(ctx):
    _compare(ctx, B, "backward")


def _simulate(orders: list[list[Op]], pp: int, m: int, v: int):
    layout = virtual.Layout(pp, v, "loop")
    try:
        return virtual.simulate(virtual.with_transfers(orders, layout), layout, m, 1.0, 2.0, 0.0)
    except ScheduleError as e:
        raise Fail(f"{_where(pp, m, v)}: the schedule cannot run ({str(e).rstrip('.')})") from None


@EXERCISE.check("the bubble is (p − 1)/(v·m) of the compute time", points=1, hint=(
    "With F = 1, B = 2 and free transfers, interleaved 1F1B idles (pp − 1)/(v·m) of its compute time: the "
    "pipeline fills and drains in ops 1/v as long as plain 1F1B's, whose (pp − 1)/m it is at v = 1. "
    "simulate(with_transfers(orders, layout), layout, m, 1, 2, 0).bubble_ratio measures yours; ranks that wait "
    "for a forward or a gradient they could have had make it larger."))
def bubble(ctx):
    for pp, m, v in _cases(ctx):
        ratio = _simulate(_orders(ctx, pp, m, v), pp, m, v).bubble_ratio
        want = (pp - 1) / (v * m)
        if abs(ratio - want) > 1e-9:
            plain = " — that of plain 1F1B, (pp − 1)/m: the chunks do not shorten the fill" \
                if abs(ratio - (pp - 1) / m) <= 1e-9 else ""
            raise Fail(f"{_where(pp, m, v)}: the ranks idle {ratio:.6g} of the compute time (F = 1, B = 2); "
                       f"interleaved 1F1B idles (pp − 1)/(v·m) = {want:.6g}{plain}")


@EXERCISE.check("no rank holds more activations than interleaved 1F1B", points=1, hint=(
    "A rank keeps each (microbatch, chunk)'s activations from its forward to its backward. Interleaved 1F1B's "
    "rank s holds at most its warm-up and one more, 2(pp − s − 1) + (v − 1)·pp + 1 (at most m·v), however large "
    "m is; running all forwards first (GPipe's order) holds all m·v."))
def memory(ctx):
    for pp, m, v in _cases(ctx):
        peak = _simulate(_orders(ctx, pp, m, v), pp, m, v).peak_in_flight
        limits = [min(_warmup(pp, m, v, s) + 1, m * v) for s in range(pp)]
        for s, held in enumerate(peak):
            if held > limits[s]:
                why = " — every rank holds all m·v, as GPipe does: its backwards wait for all its forwards" \
                    if all(p == m * v for p in peak) else ""
                raise Fail(f"{_where(pp, m, v)}: rank {s} holds the activations of {held} (microbatch, chunk) "
                           f"pairs at once; interleaved 1F1B at most {limits[s]}{why}")


@EXERCISE.check("p = 1 and v = 1 edge cases", points=1, hint=(
    "The same rules hold at the edges. One rank (pp = 1) holds every chunk, so nothing is sent at all: its "
    "warm-up is (v − 1)·1 forwards, and forward k is microbatch k // v on chunk k mod v. One chunk per rank "
    "(v = 1) is 1F1B with a warm-up of 2(pp − s − 1), Megatron-LM's interleaved order with a single chunk."))
def edges(ctx):
    for pp, m, v in EDGES:
        orders = _orders(ctx, pp, m, v)
        _valid(orders, pp, m, v)
        reference = _reference(pp, m, v)
        for s in range(pp):
            if orders[s] != reference[s]:
                got, want = orders[s], reference[s]
                n = next((n for n, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                warm = _warmup(pp, m, v, s)
                case = (f"one rank holds all {v} chunks: a warm-up of v − 1 = {warm}" if pp == 1 else
                        f"one chunk per rank: a warm-up of 2(pp − s − 1) = {warm} on rank {s}" if warm < m else
                        f"one chunk per rank: a warm-up of 2(pp − s − 1), capped at m = {m}, on rank {s}")
                raise Fail(f"{_where(pp, m, v)}: rank {s}'s compute op {n} is "
                           f"{got[n] if n < len(got) else 'missing'}; interleaved 1F1B runs "
                           f"{want[n] if n < len(want) else 'nothing'} there ({case}; rank {s}'s order: "
                           f"{_order(got, 16)}; interleaved 1F1B's: {_order(want, 16)})")


@EXERCISE.check("16 ranks, 64 microbatches, 4 chunks: valid, and quick", points=1, budget_s=10.0, hint=(
    "A real job has tens of ranks and hundreds of microbatches: the order is a formula of k, pp and v, one pass "
    "over each rank's 2·m·v ops. Searching, sorting or simulating to build it is too slow."))
def large(ctx):
    for pp, m, v in LARGE:
        _valid(_orders(ctx, pp, m, v), pp, m, v)
