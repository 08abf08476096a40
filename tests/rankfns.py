"""Rank functions the launcher tests start, importable so that spawn can start them too.

Run as a script (``python -m rankfns MODE ...``, tests/ on PYTHONPATH) it is the
launching process of the tests that need one of their own: two launchers at
once, a Ctrl-C, and ``launch`` in place under torchrun.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpucourse import current, launch, report
from procs import identity, wait_for


def note_identity(folder) -> None:
    """Leave this rank's process identity in ``folder`` for the test to check later."""
    path = Path(folder) / f"rank-{current().rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(identity()))
    path.with_suffix(".tmp").rename(path)


def whoami():
    ctx = current()
    return ctx.rank, ctx.world_size, identity()


def all_reduce_ones(n: int):
    """Sum a tensor of ``n`` values rank+1 over the group; every value must be the same sum."""
    t = torch.full((n,), float(current().rank + 1))
    dist.all_reduce(t)
    return float(t.min()), float(t.max())


def fail_on(bad: int, folder):
    note_identity(folder)
    dist.barrier()  # every rank has left its identity before one fails
    if current().rank == bad:
        raise ValueError(f"rank {bad} was told to fail")
    dist.barrier()  # the others wait here for a rank that never comes


def exit_on(bad: int, code: int, folder):
    note_identity(folder)
    dist.barrier()
    if current().rank == bad:
        sys.exit(code)
    dist.barrier()


def os_exit_on(bad: int, code: int, folder):
    note_identity(folder)
    dist.barrier()
    if current().rank == bad:
        os._exit(code)
    dist.barrier()


def skip_barrier(skipper: int, folder):
    """Every rank but ``skipper`` enters a barrier: the classic hang."""
    note_identity(folder)
    if current().rank != skipper:
        dist.barrier()
    return current().rank


def chatter():
    rank = current().rank
    print(f"out line of rank {rank}")
    print(f"err line of rank {rank}", file=sys.stderr)
    report({"hello": rank, "payload": [rank] * 3})
    return rank


def block(folder):
    """Rank 1 spins in Python, rank 0 waits in a barrier for it: only a signal ends this."""
    note_identity(folder)
    if current().rank == 1:
        while True:
            time.sleep(0.01)
    dist.barrier()


def _repeat(folder: str, times: int = 3) -> None:
    """Launch ``times`` times in a row, starting together with the other launcher in ``folder``."""
    Path(folder, f"ready-{os.getpid()}").touch()
    wait_for(lambda: len(list(Path(folder).glob("ready-*"))) == 2, 60, "the other launcher")
    for _ in range(times):
        values = launch(whoami, world_size=2, timeout=60, quiet=True)
        assert [v[:2] for v in values] == [(0, 2), (1, 2)], values
    print("launches ok")


def _block(folder: str) -> None:
    try:
        launch(block, folder, world_size=2, timeout=120, quiet=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt reached the caller", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit("the blocked launch returned")


def _in_place(folder: str) -> None:
    """Under torchrun: ``launch`` runs here as this rank and returns every rank's value."""
    values = launch(whoami, world_size=int(os.environ["WORLD_SIZE"]), timeout=60)
    out = {"rank": int(os.environ["RANK"]), "identity": identity(), "values": values,
           "children": len(multiprocessing.active_children())}
    Path(folder, f"in-place-{os.environ['RANK']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    import rankfns  # the functions must come from the module `rankfns`, not from `__main__`

    mode, arg = sys.argv[1], sys.argv[2]
    {"repeat": rankfns._repeat, "block": rankfns._block, "in-place": rankfns._in_place}[mode](arg)
