"""Mutant of ex05_one_f_one_b: warms up with all m forwards on every stage: GPipe's order, which holds all m."""

from gpucourse.parallel.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Op


def _forward(s: int, pp: int, i: int) -> list[Op]:
    """Stage s's forward of microbatch i: receive the activation (unless first), compute, pass it on (unless last)."""
    return ([Op(RECV_F, i)] if s > 0 else []) + [Op(F, i)] + ([Op(SEND_F, i)] if s < pp - 1 else [])


def _backward(s: int, pp: int, i: int) -> list[Op]:
    """Stage s's backward of microbatch i: receive the gradient (unless last), compute, pass it back (unless first)."""
    return ([Op(RECV_B, i)] if s < pp - 1 else []) + [Op(B, i)] + ([Op(SEND_B, i)] if s > 0 else [])


def one_f_one_b(pp: int, m: int) -> list[list[Op]]:
    """The 1F1B schedule of ``pp`` stages and ``m`` microbatches: one list of ops per stage."""
    schedule = []
    for s in range(pp):
        warmup = m  # fill the pipeline
        ops = [op for i in range(warmup) for op in _forward(s, pp, i)]
        for k in range(m - warmup):
            fwd, bwd = _forward(s, pp, warmup + k), _backward(s, pp, k)
            if s < pp - 1:
                # The next stage sends gradient k before it asks for activation warmup + k: receive the
                # gradient before sending the activation, or both stages wait in a send to each other.
                fwd, bwd = fwd[:-1] + [bwd[0], fwd[-1]], bwd[1:]
            ops += fwd + bwd
        ops += [op for k in range(m - warmup, m) for op in _backward(s, pp, k)]
        schedule.append(ops)
    return schedule


def bubble_fraction(pp: int, m: int) -> float:
    """The idle share of all stage-time in 1F1B, with equal stage costs and free communication."""
    return (pp - 1) / (m + pp - 1)
