"""DualPipeV: DeepSeek-V3's pipeline schedule on the V placement, as data.

DualPipe (DeepSeek-V3 technical report, 2024) runs two pipelines in opposite directions and overlaps one
microbatch's forward with another's backward; DualPipeV is it cut in half: each rank s holds chunk 0 (virtual
stage s, going down the ranks) and chunk 1 (virtual stage 2p − 1 − s, coming back up), the V placement of
:mod:`gpucourse.parallel.schedules_virtual` (``Layout(pp, 2, "v")``), which adds the transfers, checks the
orders and lays them out on the clock.
"""

from __future__ import annotations

from .schedules import B, F, W, Op, ScheduleError


def dualpipe_v(pp: int, m: int) -> list[list[Op]]:
    """DeepSeek-V3's DualPipeV (DualPipe cut in half: the V placement, chunk 0 going down the ranks and chunk 1
    coming back up), compute ops only. Rank s, in eight phases:

    1. 2(p − s − 1) forwards of chunk 0;            2. s + 1 pairs: forward chunk 0, forward chunk 1;
    3. p − s − 1 times: B of chunk 1, the oldest waiting W, forward chunk 1 (zero bubble's split);
    4. m − 2p + s + 1 times: forward chunk 0 with the whole backward of chunk 1, then forward chunk 1 with the
       whole backward of chunk 0 — the pairs DualPipe *overlaps* on a GPU (one's compute under the other's
       all-to-all), here run one after the other;
    5. p − s − 1 times: whole backward of chunk 1, then forward chunk 1 with the whole backward of chunk 0;
    6. s + 1 pairs of backwards, chunk 1 then chunk 0, split into B and a later W from halfway on;
    7. p − s − 1 times: the oldest waiting W, then a backward of chunk 0;   8. the W still waiting.

    A whole backward is a B followed at once by its W. Needs m ≥ 2p (every rank's two chunks full).
    """
    if m < 2 * pp:
        raise ScheduleError(f"DualPipeV fills both chunks of every rank: microbatches={m} must be at least "
                            f"2·pp = {2 * pp}.")
    orders = []
    for s in range(pp):
        ops: list[Op] = []
        nxt = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}
        waiting: list[Op] = []

        def forward(chunk):
            ops.append(Op(F, nxt[(F, chunk)], chunk))
            nxt[(F, chunk)] += 1

        def backward(chunk, whole=True):
            mb = nxt[(B, chunk)]
            nxt[(B, chunk)] += 1
            ops.append(Op(B, mb, chunk))
            if whole:
                ops.append(Op(W, mb, chunk))
            else:
                waiting.append(Op(W, mb, chunk))

        def oldest_w():
            if waiting:
                ops.append(waiting.pop(0))

        for _ in range(2 * (pp - s - 1)):
            forward(0)
        for _ in range(s + 1):
            forward(0)
            forward(1)
        for _ in range(pp - s - 1):
            backward(1, whole=False)
            oldest_w()
            forward(1)
        for _ in range(m - 2 * pp + s + 1):
            forward(0)
            backward(1)
            forward(1)
            backward(0)
        for _ in range(pp - s - 1):
            backward(1)
            forward(1)
            backward(0)
        split = False
        for i in range(s + 1):
            split = split or (i == (s + 1) // 2 and s % 2 == 1)
            backward(1, whole=not split)
            split = split or (i == (s + 1) // 2 and s % 2 == 0)
            backward(0, whole=not split)
        for _ in range(pp - s - 1):
            oldest_w()
            backward(0, whole=not split)
        while waiting:
            oldest_w()
        orders.append(ops)
    return orders
