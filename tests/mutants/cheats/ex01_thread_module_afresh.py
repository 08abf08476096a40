"""Cheat ex01: takes the thread module out of sys.modules and imports it afresh, for a start_new_thread the
grader has not replaced, then sums with dist.all_reduce on that thread."""

import sys
import time

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out, done = tensor.clone(), []
    sys.modules.pop("_thread", None)
    import _thread

    _thread.start_new_thread(lambda: (dist.all_reduce(out), done.append(1)), ())
    while not done:
        time.sleep(0.001)
    return out
