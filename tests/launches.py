"""Several layouts of one world size trained in one launch, one after the other, and compared with one device.

Starting ranks is most of what a short run costs on CPU: a launch per world size, each rank training every
config in turn (``rankfns.train_several``), keeps equality tests cheap; a torch-impl rank also pays DTensor's and
pipelining's first-use set-up once, not once a layout. Used by the tests of pipelines (both kinds of schedule),
context parallelism and experts.
"""

from __future__ import annotations

import torch

from gpucourse import TrainConfig, launch
from gpucourse.measure import merge

import rankfns


def train_launches(tmp, base: dict, launches: dict[int, dict[str, dict]]) -> dict:
    """``{name: (config, RunResult, exported weights)}`` for ``{world size: {name: changes from base}}``."""
    runs = {}
    for world, layouts in launches.items():
        cfgs = [TrainConfig(**base, **kw) for kw in layouts.values()]
        paths = [str(tmp / f"{name}.pt") for name in layouts]
        per_rank = launch(rankfns.train_several, [c.to_dict() for c in cfgs], paths, world_size=world,
                          timeout=540, quiet=True)
        for i, (name, cfg) in enumerate(zip(layouts, cfgs)):
            result = merge(cfg.to_dict(), [outputs[i] for outputs in per_rank], device="cpu", backend="gloo")
            runs[name] = (cfg, result, torch.load(paths[i]))
    return runs


def assert_equal(run, reference, steps: int, weight_tolerance: float = 5e-5) -> None:
    """Losses within 1e-5 relative and every exported weight within ``weight_tolerance`` of ``reference``."""
    _, result, weights = run
    _, ref, ref_weights = reference
    assert len(result.losses) == steps
    for got, want in zip(result.losses, ref.losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert sorted(weights) == sorted(ref_weights)
    for key, want in ref_weights.items():
        assert (weights[key] - want).abs().max().item() <= weight_tolerance, key
