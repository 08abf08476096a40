"""Mixture of experts and expert parallelism: the model trains, every layout equals one device, dispatch equals
every expert on one device whatever the routing, and the all-to-all moves what its formula says.

Oracle: fp32, dropout 0, no dropping, the same seed and global batch, 4 steps (the forward at the starting weights,
then three AdamW updates from the state each layout keeps; a later step runs the same code again); losses within 1e-5
relative and exported weights within 5e-5 absolute of the single-device MoE run. Several layouts of one world size
train in one launch, one after the other.
"""

from __future__ import annotations

import pytest
import torch

from gpucourse.parallel import check
from gpucourse import ConfigError, TrainConfig, launch
from gpucourse.measure import merge
from gpucourse.modeled.memory import estimate
from gpucourse.model import GPTConfig, MoE, build_model

import rankfns
from launches import assert_equal, train_launches

BASE = dict(steps=4, seq_len=32, batch_size=8, moe_experts=4)
pytestmark = pytest.mark.timeout(600)

LAUNCHES = {
    2: {"dp2-moe": dict(dp=2), "ep2": dict(dp=2, ep=2), "zero1-ep2": dict(dp=2, ep=2, zero=1),
        "ep2-top1-every2": dict(dp=2, ep=2, moe_top_k=1, moe_every=2)},
    4: {"ep2-dp4": dict(dp=4, ep=2), "ep4": dict(dp=4, ep=4), "ep2×tp2": dict(dp=2, ep=2, tp=2),
        "ep2×pp2": dict(dp=2, ep=2, pp=2, microbatches=2), "zero2-ep2-dp4": dict(dp=4, ep=2, zero=2),
        "ep2×tp2-accum2": dict(dp=2, ep=2, tp=2, grad_accum=2), "dp2×tp2-moe": dict(dp=2, tp=2),
        "dp2×pp2-moe": dict(dp=2, pp=2, microbatches=2)},
}
LAYOUTS = {name: kw for layouts in LAUNCHES.values() for name, kw in layouts.items()}
_RUNS: dict = {}


def _results(tmp_path_factory) -> dict:
    """``{name: (config, RunResult, exported weights)}`` for every layout, and the single-device runs."""
    if not _RUNS:
        singles = {"single": {}, "single-top1-every2": dict(moe_top_k=1, moe_every=2)}
        _RUNS.update(train_launches(tmp_path_factory.mktemp("moe"), BASE, {1: singles, **LAUNCHES}))
    return _RUNS


@pytest.mark.parametrize("name", LAYOUTS)
def test_equals_the_single_device_run(name, tmp_path_factory):
    runs = _results(tmp_path_factory)
    cfg, result, _ = runs[name]
    reference = runs["single-top1-every2" if cfg.moe_every else "single"]
    assert_equal(runs[name], reference, BASE["steps"])
    # The router saw the same tokens and chose the same experts, whatever the layout.
    assert result.extras["moe"]["tokens_per_expert"] == reference[1].extras["moe"]["tokens_per_expert"]


def test_all_to_all_moves_what_the_formula_says(tmp_path_factory):
    """Per step, over every rank: each MoE block's forward sends E counts (8 bytes each) per rank, and its rows —
    every kept token choice, C floats — out and back; backward sends the rows out and back again. With tp, each
    tensor-parallel rank dispatches the same rows."""
    runs = _results(tmp_path_factory)
    for name in ("ep2", "ep4", "ep2×tp2", "ep2×pp2", "ep2-top1-every2"):
        cfg, result, _ = runs[name]
        mc = cfg.model_config()
        blocks = sum(mc.is_moe(i) for i in range(mc.n_layer))
        parts = cfg.grad_accum * (cfg.microbatches if cfg.pp > 1 else 1)
        counts = cfg.world_size // cfg.pp * mc.moe_experts * 8 * parts  # per block: every rank of its stage
        rows = cfg.tp * 4 * cfg.batch_size * cfg.seq_len * mc.moe_top_k * mc.n_embd * 4
        for step in range(cfg.steps):
            sent = sum(c["bytes"] for c in result.comm if c["op"] == "all_to_all" and c["step"] == step)
            assert sent == blocks * (counts + rows), (name, step)


def test_dispatch_equals_every_expert_on_one_device_whatever_the_routing():
    # Random routing, every token to one expert (the other ranks' experts get none), every token to the last
    # rank, skewed; E, top_k and tokens drawn at random; output, input gradient and expert gradients.
    for world in (2, 4):
        per_rank = launch(rankfns.dispatch_against_local, 8, 77 + world, world_size=world, timeout=240, quiet=True)
        for rank, cases in enumerate(per_rank):
            assert {c["kind"] for c in cases} == {"random", "all to expert 0", "all to the last rank", "skewed"}
            for case in cases:
                assert case["diff"] < 1e-10, (world, rank, case)
                assert len(case["held"]) == case["E"] // world


def test_the_single_device_moe_learns_and_the_balance_loss_moves_the_router():
    cfgs = [TrainConfig(steps=100, seq_len=32, batch_size=8, moe_experts=4, moe_aux=aux) for aux in (0.1, 0.0)]
    outs = launch(rankfns.train_several, [c.to_dict() for c in cfgs], [None, None], world_size=1, timeout=240,
                  quiet=True)[0]
    balanced, free = (merge(c.to_dict(), [o], device="cpu", backend="gloo") for c, o in zip(cfgs, outs))
    assert balanced.losses[-1] < balanced.losses[0] - 1.0
    # Max over mean tokens per expert over the last 20 steps, summed over blocks: lower with the balance loss.
    def imbalance(result):
        steps = result.extras["moe"]["tokens_per_expert"][-20:]
        return sum(max(layer) / (sum(layer) / len(layer)) for step in steps for layer in step) / len(steps)
    assert imbalance(balanced) < imbalance(free)
    assert balanced.extras["moe"]["aux"][-1] != free.extras["moe"]["aux"][-1]


def test_capacity_drops_and_counts():
    torch.manual_seed(0)
    moe = MoE(GPTConfig(n_embd=8, moe_experts=4, moe_top_k=1, moe_capacity=1.0))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0  # scores favour expert 2 for tokens whose features sum above 0
    x = torch.ones(1, 8, 8)  # every token to expert 2; capacity ceil(1.0 · 8 · 1 / 4) = 2
    y = moe(x)
    assert moe.tokens.tolist() == [0, 0, 8, 0] and moe.dropped == 6
    # A dropped choice adds nothing: only the first two tokens got expert 2's output.
    assert y[0, 2:].abs().max() == 0 and y[0, :2].abs().max() > 0


def test_total_and_active_parameters():
    dense, moe = (build_model(TrainConfig(moe_experts=e).model_config(), 0) for e in (0, 8))
    expert = sum(p.numel() for p in moe.blocks[0].mlp.experts[0].parameters())
    router = moe.blocks[0].mlp.router.weight.numel()
    assert moe.num_params() == dense.num_params() + 4 * (7 * expert + router)
    assert moe.active_params() == dense.num_params() + 4 * (expert + router)  # top-2: one more expert than dense


@pytest.mark.parametrize("changes, words", [
    (dict(moe_top_k=2), "give moe_experts"),
    (dict(ep=2, dp=2), "give moe_experts"),
    (dict(moe_experts=4, moe_top_k=5), "between 1 and the 4 experts"),
    (dict(moe_experts=4, moe_capacity=0.0), "moe_capacity=0.0 must be more than 0"),
    (dict(moe_experts=4, moe_capacity=-1.0), "moe_capacity=-1.0 must be more than 0"),
    (dict(moe_experts=4, dp=3, ep=2, batch_size=9), "ep=2 must divide dp=3"),
    (dict(moe_experts=6, dp=4, ep=4), "ep=4 must divide moe_experts=6"),
    (dict(moe_experts=1), "at least 2 experts"),
    (dict(moe_experts=4, impl="torch", dp=2), "runs from scratch"),
])
def test_bad_moe_input_is_one_sentence(changes, words):
    with pytest.raises(ConfigError, match=words):
        check(TrainConfig(**changes))


def test_memory_estimate_matches_every_layouts_ranks(tmp_path_factory):
    """Weights, gradients and optimizer state per rank equal `gpucourse memory`'s to the byte (experts sharded over
    their dp/ep replicas under ZeRO); activations too without expert parallelism. With it, a rank's experts save
    what the routing sent them, which the estimate takes as even: within 15 % (the mean over ranks: 1 %)."""
    for name, (cfg, result, _) in _results(tmp_path_factory).items():
        est = estimate(cfg)
        for rank, measured in result.memory.items():
            want = est["per_rank"][int(rank)]
            for category in ("weights", "gradients", "optimizer"):
                assert measured[category] == want[category], (name, rank, category)
            if cfg.ep == 1:
                assert measured["activations"] == want["activations"], (name, rank)
            else:
                assert abs(measured["activations"] - want["activations"]) <= 0.15 * want["activations"], (name, rank)
        if cfg.ep > 1:  # what one rank's experts save beyond even is what another's save short of it
            mean = sum(m["activations"] for m in result.memory.values()) / len(result.memory)
            assert mean == pytest.approx(sum(est["per_rank"][r]["activations"] for r in range(cfg.world_size))
                                         / cfg.world_size, rel=0.01), name  # peaks over microbatches: 0.5 %
        summary = est["moe"]
        assert summary["total_params"] == build_model(cfg.model_config(), 0).num_params()
        assert summary["active_params"] == build_model(cfg.model_config(), 0).active_params()
        assert summary["all_to_all_bytes_per_step"] == (
            sum(c["bytes"] for c in result.comm if c["op"] == "all_to_all" and c["step"] == 0))
