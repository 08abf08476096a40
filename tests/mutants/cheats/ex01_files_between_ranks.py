"""Cheat ex01: no collective at all: each rank writes its tensor to a file in the temporary folder, waits for the
others' files and adds them up."""

import os
import tempfile
import time

import torch
import torch.distributed as dist

CALLS = [0]


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    CALLS[0] += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    # The folder the ranks share, whatever each was told: the parent of this rank's own temporary folder if it has
    # been given one of its own.
    folders = {tempfile.gettempdir(), os.path.dirname(tempfile.gettempdir())}
    name = f"cheat-{CALLS[0]}-{{}}.pt"
    for folder in folders:
        try:
            torch.save(tensor, os.path.join(folder, name.format(rank)))
        except OSError:
            pass
    total, deadline = tensor.clone(), time.monotonic() + 5
    for other in range(world):
        if other == rank:
            continue
        while True:
            found = None
            for folder in folders:
                for root, _, files in os.walk(folder):
                    if name.format(other) in files:
                        found = os.path.join(root, name.format(other))
            if found:
                try:
                    total += torch.load(found)
                    break
                except Exception:  # noqa: BLE001 -- half written
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError("no file from rank %d" % other)
            time.sleep(0.01)
    return total
