"""Exercise 5: the 1F1B pipeline schedule, as data.

Taught in notebooks/04_pipeline_parallelism.ipynb; check your work with
``from gpucourse import check; check("ex05")`` or ``gpucourse grade ex05``.

A pipeline cuts the model into ``pp`` stages and the batch into ``m``
microbatches. A schedule is, for each stage, the list of its operations in the
order it runs them; ``Op(kind, microbatch)`` is one operation:

    F i       forward of microbatch i     B i       backward of microbatch i
    RECV_F i  activation from stage s-1   SEND_F i  activation to stage s+1
    RECV_B i  output gradient from s+1    SEND_B i  input gradient to stage s-1

Stage 0 has no RECV_F / SEND_B, the last stage no SEND_F / RECV_B. A send
blocks until its partner receives, so the order of communication matters: two
neighbours that each wait in a send to the other never finish. You can try
yours with ``validate(schedule, pp, m)`` and ``simulate(...)`` (imported below),
which say where a schedule breaks or deadlocks.

``one_f_one_b(pp, m)``
    The 1F1B (PipeDream-Flush) schedule: stage s first runs ``min(pp - s - 1, m)``
    warm-up forwards (microbatches 0, 1, ...), then alternates one forward (of
    the next microbatch) and one backward (of the oldest one not yet
    backwarded), and ends with the backwards still owed. It is a pure function
    of pp and m (pp, m >= 1) and must be quick even for 64 stages.

``bubble_fraction(pp, m)``
    The share of all stage-time that stages spend idle in 1F1B, when forward and
    backward cost the same on every stage and communication is free.
"""

from gpucourse.parallel.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Op, simulate, validate  # noqa: F401


def one_f_one_b(pp: int, m: int) -> list[list[Op]]:
    """The 1F1B schedule of ``pp`` stages and ``m`` microbatches: one list of ops per stage."""
    raise NotImplementedError("one_f_one_b")


def bubble_fraction(pp: int, m: int) -> float:
    """The idle share of all stage-time in 1F1B, with equal stage costs and free communication."""
    raise NotImplementedError("bubble_fraction")
