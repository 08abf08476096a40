"""Parallel decode: tp2 and tp4 (scratch and DTensor), pp2 and pp4, dp2, ep2 and ep4 make exactly the single-device
tokens, each sends per decode step the bytes its formula says, and a layout that cannot run is refused in one
sentence before any rank starts."""

from __future__ import annotations

import random

import pytest

from gpucourse.model import MODELS, GPTConfig, build_model
from gpucourse.readable import ConfigError
from gpucourse.serving import generate, parallel_decode
from gpucourse.serving.parallel_decode import Layout, kv_heads_per_rank, run, step_bytes

pytestmark = pytest.mark.timeout(240)

TINY = MODELS["tiny"]
MOE = GPTConfig(n_layer=2, moe_experts=4, moe_top_k=2)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(64) for _ in range(n)] for n in (5, 17, 1, 30, 9)]  # uneven: shares and microbatches too
NEW = 8
ELEM = 8  # float64: greedy tokens cannot flip by a rounding difference

# One launch per world size, every layout of that size in it, in turn.
CASES = {
    2: [(TINY, Layout("tp", 2)), (TINY, Layout("tp", 2, "torch")), (TINY, Layout("pp", 2)), (TINY, Layout("dp", 2)),
        (MOE, Layout("ep", 2))],
    4: [(TINY, Layout("tp", 4)), (TINY, Layout("tp", 4, "torch")), (TINY, Layout("pp", 4, microbatches=3)),
        (MOE, Layout("ep", 4))],
}
LAYOUTS = [(world, str(layout)) for world, cases in CASES.items() for _, layout in cases]


@pytest.fixture(scope="module")
def decoded() -> dict:
    """``{layout name: (model config, layout, what run returned)}`` for every layout of CASES."""
    out = {}
    for cases in CASES.values():
        results = run(cases, PROMPTS, NEW, dtype="float64", timeout=180, quiet=True)
        out.update({str(layout): (cfg, layout, r) for (cfg, layout), r in zip(cases, results)})
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    """The single-device greedy tokens of each model."""
    return {cfg: generate(build_model(cfg, 0).double(), PROMPTS, NEW).tolist() for cfg in (TINY, MOE)}


@pytest.mark.parametrize("world, name", LAYOUTS)
def test_every_layout_makes_the_single_device_tokens(decoded, single, world, name):
    cfg, _, out = decoded[name]
    assert out["tokens"] == single[cfg]
    assert len({t for row in single[cfg] for t in row}) > 1, "a test that sees one token cannot tell rows apart"


@pytest.mark.parametrize("world, name", LAYOUTS)
def test_bytes_per_decode_step_equal_the_formula(decoded, world, name):
    cfg, layout, out = decoded[name]
    B = len(PROMPTS)
    for k in range(1, NEW):  # each decode step: one token for each of the B sequences
        assert out["sent"][k] == step_bytes(layout, cfg, B, ELEM, out["away"][k]), f"step {k}"
    if layout.kind == "tp":  # the prefill feeds every prompt padded to the longest: B × 30 token rows
        assert out["sent"][0] == step_bytes(layout, cfg, B * max(map(len, PROMPTS)), ELEM)
    if layout.kind == "ep":  # tokens did travel to the other ranks' experts, so both terms were counted
        assert all(out["away"]) and out["sent"][1] > step_bytes(layout, cfg, B, ELEM)
    else:  # the per-token formulas of the lesson's docstring
        assert step_bytes(layout, cfg, B, ELEM) / B == {"tp": 4 * (layout.n - 1) * cfg.n_layer * cfg.n_embd * ELEM,
                                                        "pp": (layout.n - 1) * cfg.n_embd * ELEM + 8,
                                                        "dp": 0}[layout.kind]


@pytest.mark.parametrize("cases, message", [
    ([(TINY, Layout("tp", 3))],
     "tp=3 must divide n_head=4: each rank holds whole attention heads and their share of the KV cache."),
    ([(TINY, Layout("pp", 5))], "pp=5 needs a block for every stage; the model has n_layer=4."),
    ([(TINY, Layout("pp", 2, microbatches=6))], "microbatches=6 must be between 1 and the 5 requests."),
    ([(TINY, Layout("ep", 2))], "ep=2 spreads the experts of a mixture of experts; this model has none "
                                "(moe_experts=0)."),
    ([(MOE, Layout("ep", 3))], "ep=3 must divide moe_experts=4: each rank holds E/ep experts of every "
                               "mixture-of-experts block."),
    ([(TINY, Layout("dp", 8))], "dp=8 gives each replica its own requests; there are only 5."),
    ([(TINY, Layout("dp", 2, "torch"))], "impl='torch' with dp: 'torch' (DTensor) is for tp; every layout runs "
                                         "impl='scratch'."),
    ([(TINY, Layout("tp", 2)), (TINY, Layout("tp", 4))],
     "the layouts of one run share its ranks, so they need one size; got [2, 4]."),
])
def test_a_layout_that_cannot_run_is_refused_before_any_rank_starts(monkeypatch, cases, message):
    monkeypatch.setattr(parallel_decode, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(ConfigError) as e:
        run(cases, PROMPTS, NEW)
    assert str(e.value) == message


def test_grouped_kv_heads_are_cut_by_tp_then_replicated():
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ConfigError, match="must divide one another"):
        kv_heads_per_rank(6, 4)
