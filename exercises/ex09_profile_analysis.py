"""Exercise 9: reading a profile.

Taught in notebooks/08_profiling.ipynb; check your work with
``from gpucourse import check; check("ex09")`` or ``gpucourse grade ex09``.
Compare with the reference, gpucourse/profiling.py (``time_shares`` and
``summarize``), once yours passes.

A run's ``RunResult.timeline`` is a list of spans, one dict per timed phase of
one rank, with times in seconds on that rank's clock::

    {"rank": 1, "step": 3, "kind": "backward", "name": "backward", "microbatch": None,
     "start_s": 1.204, "end_s": 1.262}

``kind`` is ``"step"`` (the whole training step on that rank: its wall time),
``"forward"``, ``"backward"`` or ``"optimizer"`` (compute), ``"comm"`` (a
collective; it has ``"blocking": True`` when the rank sat inside the call until
it finished), or ``"idle"``. Write three functions that turn such numbers into
the ones a profile is judged by:

``time_shares(spans, step)``
    For every rank that has a ``"step"`` span of step ``step``: which fraction
    of that span's window the rank spent computing, communicating and idle, as
    ``{rank: {"compute": c, "comm": m, "idle": i}}`` with c + m + i = 1. Use only
    that rank's spans of that step (``span["step"] == step``), each cut to the
    window. Spans overlap — a collective runs in the background while the
    backward goes on, a blocking all-reduce sits inside a forward — so count
    every instant of the window once, by what covers it:

    1. a blocking ``comm`` span: communication (the rank waited in the call, so
       it computed nothing meanwhile, even inside a forward);
    2. otherwise a compute span: compute (a collective running behind it is
       hidden, which is what overlapping communication with compute is for);
    3. otherwise a ``comm`` span that is not blocking: communication;
    4. covered by none of these (nothing at all, or only an ``"idle"`` span): idle.

``mfu(tokens_per_s, n_params, peak_flops, world_size)``
    Model FLOPs utilisation: the FLOP/s the training achieved over the peak FLOP/s
    of all ``world_size`` devices together. ``tokens_per_s`` is the whole run's
    throughput, all ranks together (``RunResult.tokens_per_s``); ``peak_flops``
    is one device's peak.
    Training a model of N parameters costs about 6·N FLOPs per token: 2·N for
    the forward pass (a multiply and an add per weight) and twice that for the
    backward (gradients of the activations and of the weights).

``scaling_efficiency(tokens_per_s_1, tokens_per_s_n, n)``
    How much of a perfect speed-up a run on ``n`` ranks gets, against the same
    training on one rank: its throughput per rank over the one-rank throughput
    (both arguments are whole runs' tokens per second).
    1.0 means every rank added its full share; 0.5 means half of each rank's
    time went to communication, idling or stragglers.
"""


def time_shares(spans: list[dict], step: int) -> dict[int, dict[str, float]]:
    """Per rank, the shares of step ``step``'s wall time spent computing, communicating and idle."""
    raise NotImplementedError("time_shares")


def mfu(tokens_per_s: float, n_params: int, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation: 6·N FLOPs per token, over the peak FLOP/s of all ranks."""
    raise NotImplementedError("mfu")


def scaling_efficiency(tokens_per_s_1: float, tokens_per_s_n: float, n: int) -> float:
    """Throughput per rank of an ``n``-rank run over that of the same training on one rank."""
    raise NotImplementedError("scaling_efficiency")
