"""Mutant of ex13_interleaved_schedule: warms up with 2(pp − s − 1) forwards, without the (v − 1)·pp:
its first backward comes before its own forward of that chunk."""

from gpucourse.parallel.schedules import B, F, Op


def _nth(k: int, pp: int, v: int, backward: bool) -> Op:
    """A rank's k-th forward (or backward): groups of pp microbatches, each group through every chunk in turn."""
    group, within = divmod(k, pp * v)
    chunk = within // pp                 # pp microbatches through one chunk, then the next chunk
    microbatch = group * pp + within % pp
    if backward:
        return Op(B, microbatch, v - 1 - chunk)  # the gradient comes back through the chunks in reverse
    return Op(F, microbatch, chunk)


def interleaved_1f1b(pp: int, m: int, v: int) -> list[list[Op]]:
    """Interleaved 1F1B of ``pp`` ranks, ``m`` microbatches (a multiple of pp), ``v`` chunks per rank:
    each rank's forwards and backwards, in order."""
    total = m * v  # each rank runs one forward and one backward per (microbatch, chunk)
    orders = []
    for s in range(pp):
        # Enough forwards to keep every later rank busy until the first gradient returns: the first
        # microbatch crosses v·pp virtual stages on its way down, and each rank's ops are 1/v as long.
        warmup = min(2 * (pp - s - 1), total)
        ops = [_nth(k, pp, v, False) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [_nth(warmup + k, pp, v, False), _nth(k, pp, v, True)]
        ops += [_nth(k, pp, v, True) for k in range(total - warmup, total)]
        orders.append(ops)
    return orders
