"""Interleaved 1F1B, ZB-H1 and the V schedule, executed by the engine on gloo ranks: equal to one device, with the
transfers their schedules say.

Oracle: fp32, dropout 0, the same seed and global batch, 4 steps (the forward at the starting weights, then three
AdamW updates from the state each layout keeps; a later step runs the same code again); losses within 1e-5 relative
and exported weights within 5e-5 absolute of the single-device run. Several layouts of one world size train in one
launch.
"""

from __future__ import annotations

import pytest

from gpucourse.parallel import check
from gpucourse import ConfigError, TrainConfig
from gpucourse.parallel.schedules_virtual import build

from launches import assert_equal, train_launches

BASE = dict(steps=4, seq_len=32, batch_size=8)
pytestmark = pytest.mark.timeout(600)

LAUNCHES = {
    2: {"pp2-interleaved-v2": dict(pp=2, schedule="interleaved-1f1b", microbatches=4),
        "pp2-interleaved-v2-accum2": dict(pp=2, schedule="interleaved-1f1b", microbatches=2, grad_accum=2),
        "pp2-zb-h1": dict(pp=2, schedule="zb-h1", microbatches=4),
        "pp2-zbv": dict(pp=2, schedule="zbv", microbatches=4),
        "pp2-dualpipev": dict(pp=2, schedule="dualpipev", microbatches=4),
        "pp2-looped-bfs": dict(pp=2, schedule="looped-bfs", microbatches=4),
        "pp2-looped-bfs-torch": dict(pp=2, schedule="looped-bfs", microbatches=4, impl="torch"),
        # PyTorch's own: ScheduleInterleaved1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV over the same chunks.
        "pp2-interleaved-torch": dict(pp=2, schedule="interleaved-1f1b", microbatches=4, impl="torch"),
        "pp2-zbv-torch": dict(pp=2, schedule="zbv", microbatches=4, impl="torch"),
        "pp2-dualpipev-torch": dict(pp=2, schedule="dualpipev", microbatches=4, impl="torch")},
    4: {"dp2×pp2-interleaved": dict(dp=2, pp=2, schedule="interleaved-1f1b", microbatches=2),
        "tp2×pp2-interleaved": dict(tp=2, pp=2, schedule="interleaved-1f1b", microbatches=2),
        "dp2×pp2-zb-h1-zero1": dict(dp=2, pp=2, schedule="zb-h1", microbatches=2, zero=1),
        "tp2×pp2-zb-h1": dict(tp=2, pp=2, schedule="zb-h1", microbatches=2),
        "pp4-zb-h1": dict(pp=4, schedule="zb-h1", microbatches=4)},
}
LAYOUTS = {name: kw for layouts in LAUNCHES.values() for name, kw in layouts.items()}
_RUNS: dict = {}


def _results(tmp_path_factory) -> dict:
    if not _RUNS:
        _RUNS.update(train_launches(tmp_path_factory.mktemp("virtual"), BASE, {1: {"single": {}}, **LAUNCHES}))
    return _RUNS


@pytest.mark.parametrize("name", LAYOUTS)
def test_equals_the_single_device_run(name, tmp_path_factory):
    runs = _results(tmp_path_factory)
    assert_equal(runs[name], runs["single"], BASE["steps"])


def test_each_rank_sends_what_its_schedule_says(tmp_path_factory):
    """Per step and pipeline: an activation and a gradient per microbatch across every chunk boundary between
    ranks — pp·v − 1 of them interleaved (more than v times 1F1B's pp − 1), 2·pp − 2 on the V (the turn stays on its rank)."""
    runs = _results(tmp_path_factory)
    for name in ("pp2-interleaved-v2", "pp2-zb-h1", "pp2-zbv", "pp2-dualpipev", "pp4-zb-h1"):
        cfg, result, _ = runs[name]
        ops, layout = build(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
        crossings = layout.stages - 1 - sum(layout.place(vs)[0] == layout.place(vs + 1)[0]
                                            for vs in range(layout.stages - 1))
        activation = cfg.batch_size // cfg.microbatches * cfg.seq_len * cfg.model_config().n_embd * 4
        for step in range(cfg.steps):
            sent = sum(c["bytes"] for c in result.comm if c["op"] == "send" and c["step"] == step)
            assert sent == 2 * cfg.microbatches * crossings * activation, (name, step)
        assert result.extras["schedule"] == [[str(op) for op in row] for row in ops]


def test_what_the_engine_does_not_run_is_refused_in_one_sentence():
    for changes, words in ((dict(pp=2, schedule="interleaved-1f1b", microbatches=3), "multiple of pp=2"),
                           (dict(pp=2, schedule="interleaved-1f1b", microbatches=2, virtual_stages=1), "at least 2"),
                           (dict(pp=4, schedule="interleaved-1f1b", microbatches=4), "more than the 4 blocks"),
                           (dict(schedule="zb-h1"), "needs pp > 1"),
                           (dict(pp=2, schedule="zb-h1", microbatches=2, impl="torch"), "has no zb-h1 schedule"),
                           (dict(dp=2, pp=2, schedule="zbv", microbatches=2, impl="torch"), "pipeline alone"),
                           (dict(dp=2, pp=2, schedule="zb-h1", microbatches=2, zero=3), "not with zero=3")):
        with pytest.raises(ConfigError, match=words):
            check(TrainConfig(**BASE, **changes))


def test_memory_estimate_follows_the_chunks_and_the_split_backward(tmp_path_factory):
    """Weights, gradients and optimizer state per rank equal `gpucourse memory`'s; activations (the simulator's
    peak of microbatch-chunks held, each 1/v of a stage's; a W keeps its chunk's until it runs) within 5 % of
    the scratch engine's."""
    from gpucourse.modeled.memory import estimate

    for name, (cfg, result, _) in _results(tmp_path_factory).items():
        est = estimate(cfg)
        for rank, measured in result.memory.items():
            want = est["per_rank"][int(rank)]
            for category in ("weights", "gradients", "optimizer"):
                assert measured[category] == want[category], (name, rank, category)
            if cfg.impl == "scratch":  # torch's stages run their forwards themselves, outside the meter
                assert abs(measured["activations"] - want["activations"]) <= 0.05 * want["activations"], (name, rank)
