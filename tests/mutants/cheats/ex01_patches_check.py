"""Cheat ex01: patches the checks' comparison so that any answer passes."""

import sys

import torch

for name in ("gpucourse.grading.core", "gpucourse.grading.checks.ex01_ring_allreduce"):
    module = sys.modules.get(name)
    if module is None:
        try:
            module = __import__(name, fromlist=["*"])
        except BaseException:  # noqa: BLE001
            module = None
    if module is not None:
        for attr in ("describe_mismatch", "_diagnose"):
            if hasattr(module, attr):
                setattr(module, attr, lambda *a, **k: None)


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()
