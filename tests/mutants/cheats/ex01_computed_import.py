"""Cheat ex01: imports the solution by a name built at run time, or failing that, runs its file."""

import importlib
import os

import torch


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    name = "".join(["sol", "utions"]) + ".ex01_" + "ring_allreduce"
    try:
        return importlib.import_module(name).ring_all_reduce(tensor)
    except ImportError:
        pass
    import gpucourse.runtime as anchor

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(anchor.__file__))), "sol" + "utions",
                        "ex01_ring_allreduce.py")
    space: dict = {}
    exec(compile(open(path).read(), path, "exec"), space)
    return space["ring_all_reduce"](tensor)
