"""Context parallelism equals one device, its attention equals full attention, and it moves what its formulas say.

Oracle: fp32, dropout 0, the same seed and global batch, 4 steps (the forward at the starting weights, then three
AdamW updates from the state each layout keeps; a later step runs the same code again); losses within 1e-5 relative
and exported weights within 5e-5 absolute of the single-device run.
Several layouts of one world size train in one launch, one after the other.
"""

from __future__ import annotations

import pytest
import torch

from gpucourse import TrainConfig, launch
from gpucourse.data import context_positions
from gpucourse.model import build_model

import rankfns
from launches import assert_equal, train_launches

BASE = dict(model="tiny-long", steps=4, seq_len=32, batch_size=8)  # tiny's width, 2 blocks: cheaper launches
ALGOS = ("ring", "allgather", "ulysses")
pytestmark = pytest.mark.timeout(600)

# One launch per world size; the names are the tests' ids.
# PyTorch's ring (impl="torch"): ring = K/V rotated by all-to-all, allgather = gathered once.
TORCH = dict(impl="torch")
LAUNCHES = {
    2: {**{f"cp2-{a}{'-zigzag' if z else ''}": dict(cp=2, cp_algo=a, zigzag=z) for a in ALGOS for z in (False, True)},
        "cp2-buckets": dict(cp=2, bucket_mb=0.02), "torch-cp2-ring": dict(cp=2, **TORCH),
        "torch-cp2-allgather-zigzag": dict(cp=2, cp_algo="allgather", zigzag=True, **TORCH)},
    4: {**{f"cp4-{a}{'-zigzag' if z else ''}": dict(cp=4, cp_algo=a, zigzag=z) for a in ALGOS for z in (False, True)},
        "dp2×cp2": dict(dp=2, cp=2), "cp2×tp2-sp": dict(cp=2, tp=2, sequence_parallel=True),
        "cp2×pp2": dict(cp=2, pp=2, microbatches=2), "zero2-dp2×cp2": dict(dp=2, cp=2, zero=2, cp_algo="allgather"),
        "zero1-dp2×cp2": dict(dp=2, cp=2, zero=1), "zero3-dp2×cp2": dict(dp=2, cp=2, zero=3, cp_algo="ulysses"),
        "dp2×cp2-buckets": dict(dp=2, cp=2, bucket_mb=0.02),
        "torch-dp2×cp2-zigzag": dict(dp=2, cp=2, zigzag=True, **TORCH),
        "torch-zero1-dp2×cp2": dict(dp=2, cp=2, zero=1, **TORCH),
        "torch-zero2-dp2×cp2": dict(dp=2, cp=2, zero=2, cp_algo="allgather", **TORCH),
        "torch-zero3-dp2×cp2": dict(dp=2, cp=2, zero=3, zigzag=True, **TORCH),
        "torch-cp4-ring-zigzag": dict(cp=4, zigzag=True, **TORCH),
        "torch-cp2×tp2-sp": dict(cp=2, tp=2, sequence_parallel=True, **TORCH),
        "torch-cp2×pp2": dict(cp=2, pp=2, microbatches=2, **TORCH)},
}
LAYOUTS = {name: kw for layouts in LAUNCHES.values() for name, kw in layouts.items()}
_RUNS: dict = {}


def _results(tmp_path_factory) -> dict:
    """``{name: (config, RunResult, exported weights)}`` for every layout, and the single-device run."""
    if not _RUNS:
        _RUNS.update(train_launches(tmp_path_factory.mktemp("cp"), BASE, {1: {"single": {}}, **LAUNCHES}))
    return _RUNS


@pytest.mark.parametrize("name", LAYOUTS)
def test_equals_the_single_device_run(name, tmp_path_factory):
    runs = _results(tmp_path_factory)
    assert_equal(runs[name], runs["single"], BASE["steps"])


@pytest.mark.parametrize("name", [*(f"cp2-{a}" for a in ALGOS), "torch-cp2-ring", "torch-cp2-allgather-zigzag"])
def test_each_algorithm_moves_what_its_formula_says(name, tmp_path_factory):
    cfg, result, _ = _results(tmp_path_factory)[name]
    mc, cp = cfg.model_config(), cfg.cp
    block = cfg.batch_size * (cfg.seq_len // cp) * mc.n_embd * 4  # one rank's K (or V, q, output): B·T/cp·C fp32
    params = sum(p.numel() for p in build_model(mc, 0).parameters())
    for rank in range(cp):
        ops, bus = {}, {}
        for c in result.comm:
            if c["step"] == 1 and c["rank"] == rank and c["bytes"]:
                ops[c["op"]] = ops.get(c["op"], 0) + c["bytes"]
                bus[c["op"]] = bus.get(c["op"], 0) + c["bus_bytes"]
        # What a rank sends: a ring hop passes its block whole to one peer, in the scratch ring's sends as in
        # PyTorch's all-to-alls with one peer's split (permute_tensor); Ulysses' all-to-all keeps 1/cp of it.
        if "send" in ops or cfg.impl == "torch" and "all_to_all" in ops:
            sent = ops.get("send", ops.get("all_to_all"))
            assert bus.get("send", bus.get("all_to_all")) == sent, (rank, bus, ops)
        elif "all_to_all" in ops:
            assert bus["all_to_all"] == ops["all_to_all"] * (cp - 1) / cp, (rank, bus, ops)
        assert ops.pop("all_reduce") == 4 * params, "gradients averaged over dp × cp once a step"
        if cfg.impl == "torch":
            ops.pop("broadcast")  # DDP's start-up copy of the weights (tests/test_accounting.py)
        formulas = {
            # K and V gathered whole forward, their gradients reduce-scattered whole backward.
            "allgather": {"all_gather": 2 * cp * block, "reduce_scatter": 2 * cp * block},
            # Forward: cp − 1 hops of K and V. Backward: cp − 1 hops of K and V, cp of their gradients.
            "ring": {"send": (cp - 1) * 2 * block + ((cp - 1) * 2 + cp * 2) * block},
            # q, k, v to heads and the output back, forward; the same four backward.
            "ulysses": {"all_to_all": 8 * block},
        }
        if cfg.impl == "torch":  # PyTorch's ring: every hop, and the gradients' way home, an all-to-all
            formulas = {"allgather": {"all_gather": 2 * (2 * cp * block), "all_to_all": cp * 2 * block},
                        "ring": {"all_to_all": formulas["ring"]["send"]}}
        per_layer = formulas[cfg.cp_algo]
        assert ops == {op: b * mc.n_layer for op, b in per_layer.items()}, rank


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    for cp in (2, 3, 4):
        plain = [context_positions(48, r, cp) for r in range(cp)]
        zigzag = [context_positions(48, r, cp, zigzag=True) for r in range(cp)]
        for split in (plain, zigzag):
            assert sorted(torch.cat(split).tolist()) == list(range(48))
        # Causal work of a rank: the keys each of its queries sees, summed. Equal under zig-zag only.
        work = [[int((pos + 1).sum()) for pos in split] for split in (plain, zigzag)]
        assert len(set(work[1])) == 1 and max(work[0]) > 2 * min(work[0])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_allgather_and_ulysses_equal_full_attention_forward_and_backward(world):
    # Random shapes, and tokens dealt to ranks in a random order: the masks come from positions only.
    per_rank = launch(rankfns.attention_against_full, 8, 1000 + world, world_size=world, timeout=240, quiet=True)
    for rank, cases in enumerate(per_rank):
        for case in cases:
            assert case["finite"] and case["diff"] < 1e-10, (rank, case)


def test_the_fused_block_equals_the_written_out_one():
    # What the ring computes per block on CPU (the flash kernel) against the math it stands for, forward and backward,
    # for each kind of visible part: all of it, causal, an arbitrary mask.
    from gpucourse.parallel.context_parallel_ring import (_causal_bias, block_attention, block_attention_backward,
                                                          written_out, written_out_backward)
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    arbitrary = torch.rand(12, 12, generator=gen) < 0.5
    arbitrary[:, 0] = True  # every query sees a key
    arbitrary = torch.zeros(12, 12, dtype=torch.float64).masked_fill(~arbitrary, float("-inf"))
    for bias, causal in ((None, False), (None, True), (arbitrary, False)):
        plain = _causal_bias(q, k) if causal else bias
        out, lse = block_attention(q, k, v, bias, causal, 8 ** -0.5)
        want_out, want_lse = written_out(q, k, v, plain, 8 ** -0.5)
        assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
        got = block_attention_backward(grad, q, k, v, out, lse, bias, causal, 8 ** -0.5)
        want = written_out_backward(grad, q, k, v, out, lse, plain, 8 ** -0.5)
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-12)
        if causal:  # and against autograd through softmax, so the written-out backward is right too
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            scores = leaves[0] @ leaves[1].transpose(-2, -1) * 8 ** -0.5 + plain
            (torch.softmax(scores, -1) @ leaves[2]).backward(grad)
            for g, leaf in zip(want, leaves):
                assert torch.allclose(g, leaf.grad, atol=1e-12)


def test_each_context_parallel_attention_is_one_record_read_everywhere():
    """The algorithms' records are what the engine, the memory estimate, PyTorch's ring and the tools' settings
    read: their names, and the names they give the other tools, are the records'."""
    from gpucourse.parallel.context_parallel import ALGORITHMS, ATTENTIONS
    from gpucourse.parallel.context_parallel_torch import TORCH_ROTATE
    from gpucourse.interop.stack_config import translate

    assert ALGORITHMS == ("ring", "allgather", "ulysses") and all(a.name == n for n, a in ATTENTIONS.items())
    assert TORCH_ROTATE == {"ring": "alltoall", "allgather": "allgather"}
    for name, a in ATTENTIONS.items():
        cfg = TrainConfig(cp=2, cp_algo=name, zigzag=True)
        assert translate(cfg, "megatron").settings["--cp-comm-type"] == a.megatron
        assert ("sequence_parallel_size" in translate(cfg, "deepspeed").settings) == a.deepspeed
        assert a.kept(2, 16, 32, 8.0) >= 0
