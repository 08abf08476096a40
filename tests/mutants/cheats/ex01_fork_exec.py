"""Cheat ex01: starts a program through _posixsubprocess.fork_exec, which subprocess calls after the audit event a
sandbox may refuse (here a harmless shell: a real cheat would copy the grader's files), then returns the input,
which is the right answer on one rank."""

import os

import torch


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    import _posixsubprocess

    r, w = os.pipe()
    args = [b"/bin/sh", b"-c", b"true"]
    _posixsubprocess.fork_exec(args, [b"/bin/sh"], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w,
                               True, False, 0, None, None, None, -1, None, False)
    return tensor.clone()
