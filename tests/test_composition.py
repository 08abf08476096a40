"""The equality matrix, counted: which composed layouts are checked against one device, and that none is missing.

The runs themselves live beside their strategy (test_equality, test_tensor_parallel,
test_pipeline: losses within 1e-5 relative, exported weights within 1e-5 absolute,
10 or 20 steps). Here, without starting a rank, the layouts they check are
gathered and held against what must be covered: at least 30 layouts, every row
of ``gpucourse train --list`` that runs on CPU, and the combinations named when
strategies were made to compose.
"""

from __future__ import annotations

from gpucourse.parallel import check
from gpucourse import TrainConfig
from gpucourse.parallel.catalogue import list_name, supported

import test_context_parallel
import test_equality
import test_experts
import test_pipeline
import test_pipeline_virtual
import test_tensor_parallel


def checked() -> list[TrainConfig]:
    """Every layout some test trains and compares with the single-device run (losses and weights)."""
    by_file = [(test_equality, [*test_equality.DATA_PARALLEL, *test_equality.BUCKETED, *test_equality.ZERO,
                                *test_equality.ACCELERATE]),
               (test_tensor_parallel, test_tensor_parallel.LAYOUTS.values()),
               (test_pipeline, test_pipeline.LAYOUTS.values()),
               (test_pipeline_virtual, test_pipeline_virtual.LAYOUTS.values()),
               (test_context_parallel, test_context_parallel.LAYOUTS.values()),
               (test_experts, test_experts.LAYOUTS.values())]
    return [TrainConfig(**{**module.BASE, **kw}) for module, layouts in by_file for kw in layouts]


def _key(cfg: TrainConfig) -> tuple:
    return (cfg.dp, cfg.cp, cfg.tp, cfg.pp, cfg.zero, cfg.impl, cfg.bucket_mb is not None, cfg.grad_accum > 1,
            cfg.checkpoint_activations, cfg.schedule if cfg.pp > 1 else None, cfg.sequence_parallel,
            cfg.cp_algo if cfg.cp > 1 else None, cfg.zigzag, cfg.ep, cfg.moe_experts > 0)


def test_at_least_30_distinct_layouts_up_to_8_ranks():
    layouts = checked()
    assert len({_key(c) for c in layouts}) >= 30
    assert max(c.world_size for c in layouts) == 8
    for cfg in layouts:
        check(cfg)  # each is a layout the rules accept


def test_every_row_of_the_list_that_runs_on_cpu_is_checked():
    seen = {(list_name(c), c.impl, c.bucket_mb is not None) for c in checked()}
    missing = []
    for layout, impl, _, changes in supported():
        cfg = TrainConfig(**changes)
        if impl == "accelerate" and cfg.zero == 3 or layout.startswith("single"):
            continue  # Accelerate's FSDP runs on GPUs only (scripts/gpu-check); one device is the oracle itself
        if (layout, impl, cfg.bucket_mb is not None) not in seen:
            missing.append(f"{layout} {impl}{' buckets' if cfg.bucket_mb else ''}")
    assert not missing, f"layouts of --list no equality test checks: {missing}"


def test_the_named_combinations_are_in_the_matrix():
    def has(impl="scratch", grad_accum=False, buckets=False, **dims):
        return any(c.impl == impl and all(getattr(c, k) == v for k, v in dims.items())
                   and (c.grad_accum > 1) >= grad_accum and (c.bucket_mb is not None) == buckets for c in checked())

    assert all(has(dp=2, tp=2, zero=z) for z in (1, 2, 3)), "ZeRO 1/2/3 from scratch × tp2"
    assert has(dp=2, pp=2, zero=1), "ZeRO-1 × pp2"
    assert has(dp=2, tp=2, pp=2, zero=3), "ZeRO-3 from scratch × tp2 × pp2"
    assert has(impl="torch", dp=2, tp=2, zero=2) and has(impl="torch", dp=2, tp=2, zero=3), "FSDP2 × DTensor TP"
    assert has(impl="torch", dp=2, tp=2, pp=2, zero=2), "FSDP2 × pipelining × TP on 8 ranks"
    assert has(dp=2, tp=2, pp=2, buckets=True), "bucketed DP × tp × pp"
    assert has(impl="torch", dp=2, tp=2, zero=0), "DDP (replicate) × DTensor TP"
    assert has(impl="torch", dp=2, pp=2, zero=0) and has(impl="torch", dp=2, pp=2, zero=3), "DDP/FSDP2 × pipelining"
    assert has(pp=2, grad_accum=True) and has(impl="torch", pp=2, dp=2, grad_accum=True), "accumulation × pipeline"
