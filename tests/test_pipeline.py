"""Pipeline parallelism equals the single-device run, moves exactly its activations, and records its schedule.

Oracle: fp32, dropout 0, the same seed and global batch, 4 steps (the forward at the starting weights, then three
AdamW updates from the state each layout keeps; a later step runs the same code again); losses within 1e-5 relative
and the exported weights within 1e-5 absolute of ``TrainConfig()`` with the same batch.

Bytes: per optimizer step, each pipeline sends one activation forward and one
gradient backward per microbatch over each of its pp − 1 stage boundaries,

    2 × (pp − 1) × m × (batch_size / dp / m) × seq_len × n_embd × 4 bytes,

and there are dp × tp pipelines (a tp rank sends its own copy to the same tp
rank of the next stage). torch.distributed.pipelining adds a handshake of a few
hundred bytes on the first step only.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from gpucourse import TrainConfig
from gpucourse.model import MODELS, build_model
from gpucourse.parallel.pipeline import GPTStage, stage_blocks
from gpucourse.parallel.schedules import build

from launches import train_launches

BASE = dict(steps=4, seq_len=32, batch_size=8, model="tiny", seed=0, dropout=0.0)
pytestmark = pytest.mark.timeout(600)

LAYOUTS = {
    "pp2-naive": dict(pp=2, schedule="naive", microbatches=8),
    "pp2-gpipe": dict(pp=2, schedule="gpipe", microbatches=8),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", microbatches=8),
    "pp4-1f1b": dict(pp=4, schedule="1f1b", microbatches=8),
    "pp2-gpipe-torch": dict(pp=2, schedule="gpipe", microbatches=8, impl="torch"),
    "pp2-1f1b-torch": dict(pp=2, schedule="1f1b", microbatches=8, impl="torch"),
    "dp2×pp2-1f1b": dict(dp=2, pp=2, schedule="1f1b", microbatches=4),
    "tp2×pp2-1f1b": dict(tp=2, pp=2, schedule="1f1b", microbatches=4),
    "tp2×pp2-1f1b-selective": dict(tp=2, pp=2, schedule="1f1b", microbatches=4, checkpoint_activations="selective"),
    "tp2×pp2-1f1b-sp": dict(tp=2, pp=2, schedule="1f1b", microbatches=2, sequence_parallel=True),
    "dp2×tp2×pp2-1f1b": dict(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2),
    # Any data-parallel kind runs over a stage's replicas: the schedule is only the trainer's loop.
    "dp2×pp2-1f1b-zero1": dict(dp=2, pp=2, schedule="1f1b", microbatches=2, zero=1),
    "dp2×pp2-gpipe-zero2": dict(dp=2, pp=2, schedule="gpipe", microbatches=2, zero=2),
    "dp2×pp2-1f1b-buckets": dict(dp=2, pp=2, schedule="1f1b", microbatches=2, bucket_mb=0.02),
    "dp2×tp2×pp2-1f1b-zero1": dict(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2, zero=1),
    "dp2×pp2-1f1b-zero3": dict(dp=2, pp=2, schedule="1f1b", microbatches=2, zero=3),
    "dp2×tp2×pp2-gpipe-zero3": dict(dp=2, tp=2, pp=2, schedule="gpipe", microbatches=2, zero=3),
    # PyTorch's own: DDP or FSDP2 on each stage, DTensor TP inside it, torch.distributed.pipelining across.
    "dp2×pp2-1f1b-torch": dict(dp=2, pp=2, schedule="1f1b", microbatches=2, impl="torch"),
    "dp2×pp2-gpipe-zero3-torch": dict(dp=2, pp=2, schedule="gpipe", microbatches=2, zero=3, impl="torch"),
    "tp2×pp2-1f1b-torch": dict(tp=2, pp=2, schedule="1f1b", microbatches=2, impl="torch"),
    "dp2×tp2×pp2-1f1b-zero2-torch": dict(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2, zero=2, impl="torch"),
    "dp2×tp2×pp2-1f1b-torch": dict(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2, impl="torch"),  # replicate
    "dp2×pp2-1f1b-zero2-torch": dict(dp=2, pp=2, schedule="1f1b", microbatches=2, zero=2, impl="torch"),
    "dp2×tp2×pp2-gpipe-zero3-torch": dict(dp=2, tp=2, pp=2, schedule="gpipe", microbatches=2, zero=3, impl="torch"),
    "dp2×tp2×pp2-1f1b-zero2": dict(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2, zero=2),
    "dp2×tp2×pp2-1f1b-buckets": dict(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2, bucket_mb=0.02),
    # Gradient accumulation: the schedule runs grad_accum times a step, data parallelism syncs once.
    "pp2-1f1b-ga2": dict(pp=2, schedule="1f1b", microbatches=2, grad_accum=2),
    "dp2×pp2-gpipe-ga2-zero3": dict(dp=2, pp=2, schedule="gpipe", microbatches=2, grad_accum=2, zero=3),
    "dp2×pp2-gpipe-ga2-torch": dict(dp=2, pp=2, schedule="gpipe", microbatches=2, grad_accum=2, impl="torch"),
}


def _by_world_size(layouts: dict[str, dict]) -> dict[int, dict[str, dict]]:
    """``{world size: {name: layout}}``: what one launch trains (tests/launches.py)."""
    groups = defaultdict(dict)
    for name, kw in layouts.items():
        groups[TrainConfig(**BASE, **kw).world_size][name] = kw
    return dict(groups)


LAUNCHES = _by_world_size({"single": {}, **LAYOUTS})
_RUNS: dict = {}


def _run(name: str, tmp_path_factory):
    """The layouts of one world size train in one launch, once per test session (tests/launches.py); the tests
    share each result (or the launch's error) and the weights."""
    if name not in _RUNS:
        world, layouts = next((w, group) for w, group in LAUNCHES.items() if name in group)
        try:
            _RUNS.update(train_launches(tmp_path_factory.mktemp("weights"), BASE, {world: layouts}))
        except Exception as e:  # a failed launch fails each test of its layouts once, not after one launch each
            _RUNS.update(dict.fromkeys(layouts, e))
    if isinstance(_RUNS[name], Exception):
        raise _RUNS[name]
    return _RUNS[name]


ALL = list(LAYOUTS)


@pytest.mark.parametrize("name", ALL)
def test_equals_the_single_device_run(name, tmp_path_factory):
    _, ref, ref_weights = _run("single", tmp_path_factory)
    _, result, weights = _run(name, tmp_path_factory)
    assert len(result.losses) == BASE["steps"]
    for got, want in zip(result.losses, ref.losses):
        assert got == pytest.approx(want, rel=1e-5)
    assert list(weights) == list(ref_weights)  # the whole model, single-device names, in order
    for key, want in ref_weights.items():
        assert weights[key].shape == want.shape, key
        assert (weights[key] - want).abs().max().item() <= 1e-5, key


def _per_step(result, op: str) -> list[int]:
    totals = defaultdict(int)
    for row in result.comm:
        if row["op"] == op and 0 <= row["step"] < BASE["steps"]:
            totals[row["step"]] += row["bytes"]
    return [totals[s] for s in range(BASE["steps"])]


@pytest.mark.parametrize("name", ALL)
def test_moves_one_activation_and_one_gradient_per_microbatch_and_boundary(name, tmp_path_factory):
    cfg, result, _ = _run(name, tmp_path_factory)
    mc = cfg.model_config()
    count = cfg.microbatches * cfg.grad_accum  # the schedule runs once per accumulated part
    microbatch = cfg.batch_size // cfg.dp // count
    expected = 2 * (cfg.pp - 1) * count * microbatch * cfg.seq_len * mc.n_embd * 4 * cfg.dp * cfg.tp
    per_step = _per_step(result, "send")
    if cfg.impl == "torch":  # its first step also carries the neighbours' handshake
        assert expected <= per_step[0] <= expected + 4096
        per_step = per_step[1:]
    assert set(per_step) == {expected}
    assert set(_per_step(result, "recv")) <= {0}, "a transfer is counted once, by its sender"
    if cfg.dp > 1 and cfg.tp == 1 and not cfg.zero and cfg.impl == "scratch":  # averaged over dp, once per step
        n_params = build_model(mc, 0).num_params()
        assert set(_per_step(result, "all_reduce")) == {cfg.dp * n_params * 4}
    if cfg.zero in (1, 2) and cfg.tp == 1 and cfg.impl == "scratch":  # ZeRO per stage: its own flat buffer
        stage_params = [sum(p.numel() for p in GPTStage(build_model(mc, 0), s, cfg.pp).parameters())
                        for s in range(cfg.pp)]
        padded = sum(math.ceil(n / cfg.dp) * cfg.dp for n in stage_params)
        sync = "all_reduce" if cfg.zero == 1 else "reduce_scatter"
        assert set(_per_step(result, sync)) == {cfg.dp * padded * 4}
        assert set(_per_step(result, "all_gather")) == {cfg.dp * padded * 4}


@pytest.mark.parametrize("name", ALL)
def test_timeline_has_every_microbatch_forward_and_backward_on_every_rank(name, tmp_path_factory):
    cfg, result, _ = _run(name, tmp_path_factory)
    seen = defaultdict(list)
    for span in result.timeline:
        if span["kind"] in ("forward", "backward") and span["step"] >= 0:
            seen[span["rank"], span["step"], span["kind"]].append(span["microbatch"])
    for rank in range(cfg.world_size):
        for step in range(cfg.steps):
            for kind in ("forward", "backward"):
                assert sorted(seen[rank, step, kind]) == list(range(cfg.microbatches * cfg.grad_accum)), \
                    (rank, step, kind)
    if cfg.impl == "scratch":
        assert {s["rank"] for s in result.timeline if s["kind"] == "comm"} == set(range(cfg.world_size))
    stages = result.extras["stage_of_rank"]
    assert sorted(stages) == sorted(str(r) for r in range(cfg.world_size))
    assert sorted(set(stages.values())) == list(range(cfg.pp))
    assert result.extras["schedule"] == [[str(op) for op in ops]
                                         for ops in build(cfg.schedule, cfg.pp, cfg.microbatches)]


@pytest.mark.parametrize("name", ALL)
def test_each_rank_computes_in_its_schedules_order(name, tmp_path_factory):
    """The spans, in time order, are the stage's F and B ops from schedules.py (torch's own 1F1B included)."""
    cfg, result, _ = _run(name, tmp_path_factory)
    schedule = build(cfg.schedule, cfg.pp, cfg.microbatches)
    for rank, stage in result.extras["stage_of_rank"].items():
        want = [f"{op.kind}{op.microbatch + part * cfg.microbatches}"  # once per accumulated part
                for part in range(cfg.grad_accum) for op in schedule[stage] if op.kind in ("F", "B")]
        for step in (0, cfg.steps - 1):
            spans = sorted((s for s in result.timeline if s["rank"] == int(rank) and s["step"] == step
                            and s["kind"] in ("forward", "backward")), key=lambda s: s["start_s"])
            assert [f"{s['kind'][0].upper()}{s['microbatch']}" for s in spans] == want, (rank, step)


# Stages, without starting any rank.

@pytest.mark.parametrize("n_layer, pp", [(4, 2), (4, 4), (5, 2), (7, 3), (12, 5)])
def test_stages_are_balanced_contiguous_and_cover_every_block(n_layer, pp):
    ranges = [stage_blocks(n_layer, pp, s) for s in range(pp)]
    assert [i for r in ranges for i in r] == list(range(n_layer))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_stages_chained_are_the_model_with_its_names():
    cfg = MODELS["tiny"]
    whole = build_model(cfg, 3)
    names = list(whole.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        want = whole(idx)
    stages = [GPTStage(build_model(cfg, 3), s, 2) for s in range(2)]
    assert [k for st in stages for k in st.state_dict()] == names
    assert "blocks.2.ln1.weight" in stages[1].state_dict()
    with torch.no_grad():
        got = stages[1](stages[0](idx))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_module_without_blocks_is_refused_in_one_sentence_naming_it():
    from gpucourse.model import blocks_of
    from gpucourse.parallel.activation_checkpointing import checkpoint_blocks

    bigram = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    for strategy in (blocks_of, checkpoint_blocks, lambda m: GPTStage(m, 0, 2)):
        with pytest.raises(TypeError) as info:
            strategy(bigram)
        assert str(info.value) == ("Sequential has no `blocks` (an nn.ModuleList of transformer blocks), "
                                   "so it cannot be worked on block by block.")
