"""Tensor parallel equals one device: the sharded linears, f and g, whole runs, and the bytes they move.

Whole runs train 4 steps: the forward at the starting weights, then three AdamW updates from the state each layout
keeps (a later step runs the same code again). Rank functions live at the top of this module so that ``launch`` can
start them.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gpucourse
from gpucourse.parallel import check
from gpucourse import ConfigError, TrainConfig, data
from gpucourse.measure import Recorder
from gpucourse.modeled.memory import estimate
from gpucourse.model import build_model
from gpucourse.parallel import parallelize
from gpucourse.parallel.tensor_parallel import (ColumnParallelLinear, CopyToTensorParallel, ReduceFromTensorParallel,
                                                RowParallelLinear)
from gpucourse.train import build_mesh

from launches import train_launches

TP = 2
BASE = dict(model="tiny", steps=4, seq_len=32, batch_size=8, dropout=0.0, precision="fp32")
pytestmark = pytest.mark.timeout(600)


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def linear_worker() -> dict:
    """Column- and row-parallel shards of one nn.Linear, against the full layer."""
    rank, group = dist.get_rank(), dist.group.WORLD
    torch.manual_seed(0)
    full = nn.Linear(8, 6)
    x = torch.randn(3, 5, 8, requires_grad=True)
    dy = torch.randn(3, 5, 6)
    y = full(x)
    y.backward(dy)

    col = ColumnParallelLinear(full, group)
    xc = x.detach().clone().requires_grad_()
    yc = col(CopyToTensorParallel.apply(xc, group))  # f in front, as at a sub-layer's entrance
    yc.backward(dy.chunk(TP, -1)[rank])

    row = RowParallelLinear(full, group)
    xr = x.detach().chunk(TP, -1)[rank].clone().requires_grad_()
    yr = row(xr)
    yr.backward(dy)
    return {
        "column output": _max_diff(yc, y.chunk(TP, -1)[rank]),
        "column input grad": _max_diff(xc.grad, x.grad),
        "column weight grad": _max_diff(col.weight.grad, full.weight.grad.chunk(TP, 0)[rank]),
        "column bias grad": _max_diff(col.bias.grad, full.bias.grad.chunk(TP, 0)[rank]),
        "row output": _max_diff(yr, y),
        "row input grad": _max_diff(xr.grad, x.grad.chunk(TP, -1)[rank]),
        "row weight grad": _max_diff(row.weight.grad, full.weight.grad.chunk(TP, 1)[rank]),
        "row bias grad": _max_diff(row.bias.grad, full.bias.grad),
    }


def test_column_and_row_parallel_linear_equal_a_full_linear():
    for rank, diffs in enumerate(gpucourse.launch(linear_worker, world_size=TP, timeout=60, device="cpu",
                                                  quiet=True)):
        for what, diff in diffs.items():
            assert diff < 1e-6, f"rank {rank}: {what} differs by {diff}"


def operators_worker() -> dict:
    """f and g on rank-dependent values: rank r holds r + 1, and sends gradient 10·(r + 1)."""
    rank, group = dist.get_rank(), dist.group.WORLD
    x = torch.full((4,), rank + 1.0, requires_grad=True)
    fx = CopyToTensorParallel.apply(x, group)
    fx.backward(torch.full((4,), 10.0 * (rank + 1)))
    z = torch.full((4,), rank + 1.0, requires_grad=True)
    gz = ReduceFromTensorParallel.apply(z, group)
    gz.backward(torch.full((4,), 10.0 * (rank + 1)))
    return {"f forward": fx.tolist(), "f backward": x.grad.tolist(),
            "g forward": gz.tolist(), "g backward": z.grad.tolist()}


def test_f_and_g_are_conjugate():
    for rank, out in enumerate(gpucourse.launch(operators_worker, world_size=TP, timeout=60, device="cpu",
                                                quiet=True)):
        assert out["f forward"] == [rank + 1.0] * 4        # identity
        assert out["f backward"] == [10.0 + 20.0] * 4      # all-reduced
        assert out["g forward"] == [1.0 + 2.0] * 4         # all-reduced
        assert out["g backward"] == [10.0 * (rank + 1)] * 4  # identity


def replicated_worker(cfg_dict: dict) -> float:
    """Train a few steps under scratch TP; the largest difference of a replicated parameter between tp ranks."""
    cfg = TrainConfig.from_dict(cfg_dict)
    ctx = gpucourse.current()
    mesh = build_mesh(cfg, ctx.device)
    model = build_model(cfg.model_config(), cfg.seed)
    trainer = parallelize(model, mesh, cfg, Recorder(ctx.rank, ctx.device), ctx.device)
    for step in range(cfg.steps):
        trainer.step(*data.rank_batch(step, cfg.batch_size, cfg.seq_len, cfg.seed, 0, 1))
    sharded = [p for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               for name, p in m.named_parameters() if name in m.shard_dims]
    worst = 0.0
    for p in model.parameters():
        if any(p is s for s in sharded):
            continue
        copies = [torch.empty_like(p) for _ in range(cfg.tp)]
        dist.all_gather(copies, p.detach(), group=mesh["tp"].get_group())
        worst = max(worst, max(_max_diff(c, copies[0]) for c in copies))
    return worst


def test_replicated_parameters_stay_identical_across_tp_ranks():
    cfg = check(TrainConfig(**{**BASE, "steps": 3}, tp=TP))
    worst = gpucourse.launch(replicated_worker, cfg.to_dict(), world_size=TP, timeout=60, device="cpu", quiet=True)
    # f gives LayerNorms the same whole gradient on each rank, g the same activations: no drift at all.
    assert worst == [0.0] * TP


_RUNS: dict = {}


def train(tmp_path_factory, **layout):
    """BASE with ``layout`` (the single device or one of LAYOUTS): its RunResult and exported weights. The first
    call trains every one of them of the same world size, in one launch (tests/launches.py)."""
    key = tuple(sorted(layout.items()))
    if key not in _RUNS:
        world = TrainConfig(**BASE, **layout).world_size
        same = {name: kw for name, kw in {"single": {}, **LAYOUTS}.items()
                if TrainConfig(**BASE, **kw).world_size == world}
        runs = train_launches(tmp_path_factory.mktemp("tp"), BASE, {world: same})
        _RUNS.update({tuple(sorted(kw.items())): runs[name][1:] for name, kw in same.items()})
    return _RUNS[key]


LAYOUTS = {"tp2-scratch": dict(tp=2), "tp2-torch": dict(tp=2, impl="torch"), "tp4-scratch": dict(tp=4),
           "dp2xtp2-scratch": dict(dp=2, tp=2), "dp2xtp2-zero1": dict(dp=2, tp=2, zero=1),
           "dp2xtp2-zero2": dict(dp=2, tp=2, zero=2), "dp2xtp2-buckets": dict(dp=2, tp=2, bucket_mb=0.02),
           "dp2xtp2-fsdp2-torch": dict(dp=2, tp=2, zero=2, impl="torch"),
           "dp2xtp2-fsdp3-torch": dict(dp=2, tp=2, zero=3, impl="torch"), "dp2xtp2-zero3": dict(dp=2, tp=2, zero=3),
           "dp2xtp2-replicate-torch": dict(dp=2, tp=2, impl="torch"),
           # Sequence parallelism: the activations between sub-layers cut along the sequence.
           "tp2-sp-scratch": dict(tp=2, sequence_parallel=True), "tp2-sp-torch": dict(tp=2, sequence_parallel=True,
                                                                                       impl="torch"),
           "dp2xtp2-sp-zero3": dict(dp=2, tp=2, zero=3, sequence_parallel=True),
           # Selective recomputation on DTensor shards: each rank recomputes its own heads' scores.
           "tp2-torch-selective": dict(tp=2, impl="torch", checkpoint_activations="selective", attention="math")}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
def test_tensor_parallel_equals_single_device(tmp_path_factory, layout):
    single, single_weights = train(tmp_path_factory)
    result, weights = train(tmp_path_factory, **layout)
    assert result.losses == pytest.approx(single.losses, rel=1e-5)
    assert weights.keys() == single_weights.keys()
    for name, w in single_weights.items():
        assert weights[name].shape == w.shape, name
        assert _max_diff(weights[name], w) < 1e-5, name


@pytest.mark.parametrize("layout", [
    # The DTensor plan issues the same 16 all-reduces a step (as _c10d_functional ops).
    dict(tp=2), dict(tp=4), dict(dp=2, tp=2), dict(tp=2, impl="torch"),
], ids=["tp2", "tp4", "dp2xtp2", "tp2-torch"])
def test_bytes_are_what_the_algorithm_moves(tmp_path_factory, layout):
    result, _ = train(tmp_path_factory, **layout)
    cfg = TrainConfig(**BASE, **layout)
    mc = cfg.model_config()
    # Per rank: 2 all-reduces forward + 2 backward per block, each (batch/dp)·T·C fp32; summed over dp·tp ranks.
    activations = 4 * mc.n_layer * (cfg.batch_size // cfg.dp) * cfg.seq_len * mc.n_embd * 4 * cfg.world_size
    # dp × tp: each rank also all-reduces the gradients it holds (its shards and the replicated rest) over dp.
    gradients = sum(m["weights"] for m in result.memory.values()) if cfg.dp > 1 else 0
    assert result.comm_bytes["per_step"] == [activations + gradients] * cfg.steps
    assert activations == 16 * mc.n_layer * cfg.batch_size * cfg.seq_len * mc.n_embd * cfg.tp


@pytest.mark.parametrize("impl", ["scratch", "torch"])
def test_sequence_parallelism_moves_what_tensor_parallelism_moves_and_keeps_1_over_tp_of_layernorm_inputs(
        tmp_path_factory, impl):
    tp_run, _ = train(tmp_path_factory, tp=2, **({"impl": "torch"} if impl == "torch" else {}))
    sp_run, _ = train(tmp_path_factory, tp=2, sequence_parallel=True, **({"impl": "torch"} if impl == "torch" else {}))
    cfg = TrainConfig(**BASE, tp=2, sequence_parallel=True)
    mc = cfg.model_config()
    whole = cfg.batch_size * cfg.seq_len * mc.n_embd * 4  # one (B, T, C) activation in fp32, bytes
    for rank in ("0", "1"):
        ops = {c["op"]: c for c in sp_run.comm if c["step"] == 1 and c["rank"] == int(rank)}
        [all_reduce] = [c for c in tp_run.comm if c["step"] == 1 and c["rank"] == int(rank)]
        # Per block 2 entries (all-gather) and 2 exits (reduce-scatter), forward and backward; plus the region's
        # two ends: all-gathered after the last block, and the gradient at its start all-gathered in backward.
        assert ops["all_gather"]["calls"] == 4 * mc.n_layer + 2 and ops["reduce_scatter"]["calls"] == 4 * mc.n_layer
        edges = 2 * whole * (TP - 1) / TP
        assert ops["all_gather"]["bus_bytes"] + ops["reduce_scatter"]["bus_bytes"] - edges == \
            all_reduce["bus_bytes"], "an all-reduce is a reduce-scatter and an all-gather: the same bytes"
        if impl == "scratch":  # LayerNorm weights and biases, row-layer biases: 6 vectors of C per block, summed
            assert (ops["all_reduce"]["bytes"], ops["all_reduce"]["calls"]) == (6 * mc.n_embd * 4 * mc.n_layer,
                                                                                 6 * mc.n_layer)
    ratio = sp_run.extras["activations_by_region"]["block layernorms"] / \
        tp_run.extras["activations_by_region"]["block layernorms"]
    assert ratio == 1 / TP, "what the blocks' LayerNorms save shrinks by tp exactly"
    assert sp_run.memory["0"]["activations"] == estimate(cfg)["per_rank"][0]["activations"]


def test_memory_counts_local_shards(tmp_path_factory):
    model = build_model(TrainConfig(**BASE).model_config(), seed=0)
    whole = sum(p.numel() * 4 for p in model.parameters())
    cut = sum(p.numel() * 4 for name, p in model.named_parameters()
              if re.search(r"attn\.(q|k|v)\.|mlp\.fc\.|proj\.weight", name))
    for layout in (dict(tp=2), dict(tp=2, impl="torch")):
        result, _ = train(tmp_path_factory, **layout)
        for rank, mem in result.memory.items():
            assert mem["weights"] == mem["gradients"] == whole - cut + cut // TP, (layout, rank)


def test_a_block_without_the_layers_tensor_parallelism_cuts_is_refused_in_one_sentence():
    from gpucourse.parallel.tensor_parallel import apply_tensor_parallel

    model = build_model(TrainConfig(**BASE).model_config(), seed=0)
    model.blocks[1].mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))  # an MLP of one's own, without fc and proj
    with pytest.raises(TypeError) as info:
        apply_tensor_parallel(model, None)
    assert str(info.value) == ("Block has no nn.Linear mlp.fc, mlp.proj, so tensor parallelism cannot shard it "
                               "(it cuts attn.q, attn.k, attn.v, attn.proj, mlp.fc, mlp.proj of every block).")
    assert isinstance(model.blocks[0].attn.q, torch.nn.Linear), "nothing was changed before the refusal"


def test_a_layout_that_splits_heads_is_refused():
    with pytest.raises(ConfigError, match=r"tp=3 must divide n_head=4"):
        check(TrainConfig(tp=3))
