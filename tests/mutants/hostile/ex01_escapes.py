"""Hostile ex01: each check meets a way out of the sandbox that must fail.

sums over 2 ranks: a fork bomb; bf16: opens a socket; input unchanged: deletes
the solution, its own file and the folder it was graded from, and renames what
it can; 3 ranks: sleeps forever; bytes sent (3 ranks): a segfault; one rank:
tries to leave a detached process behind through the fork primitive no audit
hook sees (refused too), then would answer right.
"""

import ctypes
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist

TARGETS = os.environ.get("GPUCOURSE_TEST_TARGETS", "").split(os.pathsep)


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size()
    if tensor.shape == (24,):
        while True:
            os.fork()
    if tensor.dtype == torch.bfloat16:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("127.0.0.1", 22))
    if tensor.shape == (12,):
        for path in TARGETS:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif path:
                os.remove(path)
    if world == 3 and tensor.numel() != 3000:
        time.sleep(10**6)
    if tensor.numel() == 3000:
        ctypes.string_at(0)
    if world == 1:
        import _posixsubprocess

        r, w = os.pipe()
        argv = [sys.executable.encode(), b"-c", b"import time; time.sleep(600)"]
        _posixsubprocess.fork_exec(argv, [argv[0]], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True,
                                   0, None, None, None, -1, None, True)
    return tensor.clone()
