"""Exercise 13: interleaved 1F1B (virtual pipeline stages), as data.

Taught in notebooks/04b_pipeline_schedules.ipynb; check your work with
``from gpucourse import check; check("ex13")`` or ``gpucourse grade ex13``. Once it
passes, compare with gpucourse/parallel/schedules_virtual.py.

The model is cut into ``pp·v`` chunks (virtual stages) and each of the ``pp``
ranks holds ``v`` of them, interleaved: rank s holds virtual stages s, pp + s,
2·pp + s, …, its chunk c being virtual stage c·pp + s. A microbatch goes down
the ranks v times, once per chunk, so every op is 1/v of a stage's work and the
pipeline fills and drains v times faster.

An op is ``Op(kind, microbatch, chunk)`` with kind ``F`` (forward) or ``B``
(backward) of that microbatch on this rank's chunk ``chunk``. You return only
the compute ops; ``with_transfers(orders, Layout(pp, v, "loop"))`` puts the
sends and receives around them (asynchronous sends: a send never waits, a
receive waits for its data). Try yours with ``validate``, ``check`` and
``simulate`` (imported below): they say where a schedule breaks or deadlocks,
and what it costs.

``interleaved_1f1b(pp, m, v)``
    Megatron-LM's interleaved 1F1B, as one list of compute ops per rank, for
    ``pp`` ranks, ``m`` microbatches (always a multiple of pp) and ``v`` chunks
    per rank (pp, m, v >= 1). Every rank runs m·v forwards and m·v backwards:

    - its forwards take the microbatches pp at a time: microbatches 0 … pp−1
      through chunk 0, the same pp through chunk 1, …, through chunk v−1, then
      microbatches pp … 2·pp−1 through chunk 0, and so on;
    - its backwards take them in the same order, the chunks reversed (chunk
      v−1 first: the gradient comes back from the loss);
    - rank s starts with a warm-up of 2(pp − s − 1) + (v − 1)·pp forwards
      (at most m·v), then alternates one forward (the next one) and one
      backward (the next one), and ends with the backwards still owed.

    For pp = 2, m = 4, v = 2 the forwards of every rank are
    F0 F1 F0.1 F1.1 F2 F3 F2.1 F3.1 (``Op.__str__`` writes F2.1 for microbatch
    2, chunk 1), its backwards B0.1 B1.1 B0 B1 B2.1 B3.1 B2 B3, and rank 0
    warms up with 4 forwards, rank 1 with 2. It must be quick for 64 ranks too.
"""

from gpucourse.parallel.schedules import B, F, Op  # noqa: F401
from gpucourse.parallel.schedules_virtual import Layout, check, simulate, validate, with_transfers  # noqa: F401


def interleaved_1f1b(pp: int, m: int, v: int) -> list[list[Op]]:
    """Interleaved 1F1B of ``pp`` ranks, ``m`` microbatches (a multiple of pp), ``v`` chunks per rank:
    each rank's forwards and backwards, in order."""
    raise NotImplementedError("interleaved_1f1b")
