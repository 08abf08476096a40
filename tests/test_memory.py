"""Memory and batch: estimates equal measurements, precision tracks fp32, checkpointing saves memory."""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch

from gpucourse import TrainConfig, run
from gpucourse.measure import Recorder
from gpucourse.modeled.memory import estimate, in_flight, largest_microbatch, num_params
from gpucourse.model import MODELS, build_model
from gpucourse.parallel.precision import DynamicLossScaler, Precision
from gpucourse.parallel.schedules import SCHEDULES, simulate
from gpucourse.parallel.single import Trainer
from gpucourse.modeled.plan import plan

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_count_formula_matches_the_model(name):
    model = build_model(MODELS[name], 0) if name in ("tiny", "small") else None
    if model is not None:
        assert num_params(MODELS[name]) == sum(p.numel() for p in model.parameters())
    assert num_params(MODELS[name]) > 0


@pytest.mark.parametrize("kw", [dict(), dict(dp=2), dict(dp=2, zero=1), dict(dp=3, zero=2, batch_size=12),
                                dict(tp=2), dict(pp=2, microbatches=4), dict(pp=4, microbatches=8, schedule="gpipe"),
                                dict(dp=2, tp=2), dict(checkpoint_activations=True), dict(dp=2, grad_accum=2),
                                dict(dp=2, tp=2, zero=3), dict(dp=2, pp=2, zero=3, microbatches=2),
                                dict(tp=2, sequence_parallel=True, checkpoint_activations=True),  # (plain SP: test_tp)
                                dict(cp=2), dict(cp=2, cp_algo="allgather", zigzag=True), dict(cp=2, cp_algo="ulysses"),
                                dict(dp=2, cp=2, zero=2), dict(cp=2, zero=3, batch_size=8),
                                dict(checkpoint_activations="selective"), dict(attention="math"),
                                dict(attention="math", tp=2, checkpoint_activations="selective"),
                                dict(attention="math", pp=2, microbatches=4)],
                         ids=str)
def test_estimate_equals_measurement(kw):
    cfg = TrainConfig(steps=1, seq_len=32, **kw)
    result = run(cfg, timeout=120, quiet=True)
    measured, full = result.memory, estimate(cfg)
    est = full["per_rank"]
    if cfg.zero == 3 and cfg.pp == 1:  # the weights whole at once while computing, too
        assert result.extras["zero"]["gathered_peak_bytes"] == full["gathered"][0]
    assert len(measured) == cfg.world_size
    for rank, m in measured.items():
        e = est[int(rank)]
        for k in ("weights", "gradients", "optimizer"):
            assert m[k] == e[k], f"rank {rank} {k}: measured {m[k]}, estimated {e[k]}"
        assert abs(m["activations"] - e["activations"]) <= 0.10 * m["activations"], f"rank {rank} activations"


def test_checkpointing_saves_activation_memory_and_changes_nothing_else():
    plain = run(TrainConfig(steps=5, seq_len=32), timeout=120, quiet=True)
    ckpt = run(TrainConfig(steps=5, seq_len=32, checkpoint_activations=True), timeout=120, quiet=True)
    ratio = ckpt.memory["0"]["activations"] / plain.memory["0"]["activations"]
    assert ratio < 0.5
    assert ckpt.losses == pytest.approx(plain.losses, rel=1e-6)


def test_selective_recomputation_frees_the_scores_korthikanti_counts_and_changes_nothing_else():
    """Attention written out keeps the softmax's output (Korthikanti et al.'s 5·a·s/h term is softmax 2, dropout
    mask 1 and dropout output 2 bytes a score; without dropout, its 2 of 5) and the causal mask; selective
    recomputation keeps neither, and the losses stay bit for bit. In bf16 weights, as their count assumes."""
    from gpucourse.modeled.memory import korthikanti_layer_bytes

    base = dict(steps=2, seq_len=32, precision="bf16", master_weights=True, attention="math")
    none, selective, flash = (run(TrainConfig(**{**base, **kw}), timeout=120, quiet=True)
                              for kw in (dict(), dict(checkpoint_activations="selective"), dict(attention="flash")))
    assert selective.losses == none.losses
    mc, cfg = TrainConfig(**base).model_config(), TrainConfig(**base)
    s, b, h, a = cfg.seq_len, cfg.batch_size, mc.n_embd, mc.n_head
    paper = korthikanti_layer_bytes(s, b, h, a) - korthikanti_layer_bytes(s, b, h, a, recompute="selective")
    assert paper == 5 * a * s * s * b
    freed = (none.memory["0"]["activations"] - selective.memory["0"]["activations"]) / mc.n_layer
    assert freed == 2 / 5 * paper + s * s  # the softmax's output, and the causal mask
    # A fused kernel keeps no scores: selective recomputation is already inside it.
    assert flash.memory["0"]["activations"] < none.memory["0"]["activations"] - mc.n_layer * 2 / 5 * paper * 0.9


@pytest.mark.parametrize("kw", [dict(precision="bf16"), dict(precision="fp16"),
                                dict(precision="bf16", master_weights=True), dict(precision="fp16", master_weights=True),
                                dict(dp=2, precision="bf16"), dict(dp=2, zero=2, precision="bf16", master_weights=True),
                                dict(dp=2, zero=1, precision="fp16")], ids=str)
def test_half_precision_tracks_fp32(kw):
    # seq_len 64: at 32 the fp32 run itself spikes at step 6, and fp16 rightly skips overflowing steps there.
    ref = run(TrainConfig(steps=20), timeout=120, quiet=True)
    half = run(TrainConfig(steps=20, **kw), timeout=120, quiet=True)
    for a, b in zip(half.losses, ref.losses):
        assert abs(a - b) <= 0.02 * abs(b)
    assert half.extras["precision"]["precision"] == kw["precision"]
    if kw.get("master_weights"):
        m, n = half.memory["0"], num_params(MODELS["tiny"])
        dp = kw.get("dp", 1)
        assert m["weights"] == 2 * n and m["optimizer"] == 12 * (n // dp), "2 + 2 + 12 bytes per parameter"


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(init_scale=1024, growth_interval=2)
    s.update(found_inf=True)
    assert (s.scale, s.skipped) == (512, 1)
    s.update(False)
    s.update(False)
    assert s.scale == 1024


def test_fp16_step_with_an_injected_inf_is_skipped():
    torch.manual_seed(0)
    model = build_model(MODELS["tiny"], 0)
    trainer = Trainer(model, lr=1e-3, rec=Recorder(0, torch.device("cpu")), precision=Precision("fp16"))
    x = torch.randint(0, 40, (2, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = model.head.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    trainer.step(x, x)
    handle.remove()
    assert trainer.precision.scaler.skipped == 1 and trainer.precision.scaler.scale == 2.0**15
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a skipped step changed weights"
    trainer.step(x, x)
    assert trainer.precision.scaler.skipped == 1
    assert not torch.equal(before["head.weight"], model.head.weight)


def test_in_flight_formula_matches_the_simulator():
    for name, schedule in SCHEDULES.items():
        for pp in range(2, 7):
            for m in range(1, 12):
                assert in_flight(name, pp, m) == simulate(schedule(pp, m), pp, m).peak_in_flight, (name, pp, m)


def test_largest_microbatch_bisects_to_the_edge():
    cfg = TrainConfig(dp=2, grad_accum=2)
    found = largest_microbatch(cfg, 0, fits=lambda c: c.microbatch_size <= 37)
    assert found["microbatch"] == 37 and found["batch_size"] == 37 * 4
    budget = estimate(dataclasses.replace(cfg, batch_size=37 * 4))["max_total"]
    assert largest_microbatch(cfg, budget)["microbatch"] == 37


def test_plan_agrees_with_memory_and_never_ranks_a_misfit_as_fitting():
    result = plan(70e9, 64, "h100", gpus_per_node=8)
    rows = result["layouts"]
    assert rows and any(r["fits"] for r in rows) and not all(r["fits"] for r in rows)
    from gpucourse.modeled.gpus import get_gpu

    limit = get_gpu("h100").usable_bytes()
    seen_misfit = False
    for r in rows:
        assert r["fits"] == (r["memory_total"] <= limit)
        seen_misfit |= not r["fits"]
        assert not (seen_misfit and r["fits"]), "a fitting layout ranked after one that does not fit"
        assert r["tp"] <= 8 and r["dp"] * r["tp"] * r["pp"] == 64
    for r in rows[:5]:
        assert estimate(TrainConfig.from_dict(r["config"]))["max"] == r["memory"]
    fitting = [r for r in rows if r["fits"]]
    assert fitting == sorted(fitting, key=lambda r: r["step_s"])


def test_for_long_sequences_the_planner_also_tries_context_and_sequence_parallelism():
    rows = plan(70e9, 64, "h100", gpus_per_node=8, batch_size=64, seq_len=131072)["layouts"]
    assert {r["cp"] for r in rows} >= {1, 2, 4, 8} and all(r["sp"] == (r["tp"] > 1) for r in rows)
    for r in rows:
        assert r["dp"] * r["cp"] * r["tp"] * r["pp"] == 64
        assert (r["cp_comm_s"] > 0) == (r["cp"] > 1)
    by_cp = {cp: min(r["memory_total"] for r in rows if r["cp"] == cp and r["tp"] == 8 and r["pp"] == 1)
             for cp in (1, 2, 4, 8)}
    assert by_cp[8] < by_cp[4] < by_cp[2] < by_cp[1], "each rank's activations fall with cp"
    for r in [r for r in rows if r["cp"] > 1][:3]:
        assert estimate(TrainConfig.from_dict(r["config"]))["max"] == r["memory"]
    assert {r["cp"] for r in plan(70e9, 64, "h100", batch_size=64, seq_len=4096)["layouts"]} == {1}


@pytest.mark.parametrize("params", [1.3e9, 7e9, 13e9, 70e9, 175e9, 405e9])
def test_the_planners_shapes_let_tensor_parallelism_split_the_heads(params):
    """From 1 B on, the assumed width is a whole number of 8 heads, so tp = 2, 4 and 8 are all tried."""
    from gpucourse.modeled.plan import shape_for_params

    shape = shape_for_params(params)
    assert shape["n_head"] % 8 == 0 and shape["n_embd"] == 128 * shape["n_head"], shape
    if params == 70e9:
        assert {r["tp"] for r in plan(params, gpus=64)["layouts"]} == {1, 2, 4, 8}


def test_plan_takes_a_real_models_shape():
    """The course's own block as a dict of its sizes: sized by gpucourse memory's estimate, counted as the course's
    GPT counts it."""
    llama = {"n_layer": 80, "n_embd": 8192, "n_head": 64}
    result = plan(None, gpus=64, shape=llama)
    assert (result["shape"]["layers"], result["shape"]["hidden"], result["shape"]["heads"],
            result["shape"]["vocab"]) == (80, 8192, 64, 32000)
    model = TrainConfig(model="gpt2-small", overrides={**llama, "vocab_size": 32000, "block_size": 4096})
    fitting = [r for r in result["layouts"] if r["fits"]]
    assert any(r["tp"] > 1 for r in fitting)
    assert estimate(TrainConfig.from_dict(fitting[0]["config"]))["max"] == fitting[0]["memory"]
    assert model.model_config().n_layer == 80
    with pytest.raises(ValueError, match="divisible by heads"):
        plan(None, gpus=8, shape={"n_layer": 4, "n_embd": 1000, "n_head": 64})


def test_korthikanti_per_layer_formulas():
    from gpucourse.modeled.memory import korthikanti_layer_bytes as layer

    s, b, h, a, t = 2048, 1, 12288, 96, 8          # a GPT-3 175B layer on tp = 8
    sbh = s * b * h
    assert layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert layer(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer(s, b, h, a, t, sp=True) == pytest.approx(layer(s, b, h, a) / t), "SP: everything divided by tp"
    assert layer(s, b, h, a, t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert layer(s, b, h, a, t, recompute="full") == 2 * sbh and layer(s, b, h, a, t, True, "full") == 2 * sbh / t


def test_plan_a_mixtral_like_mixture_of_experts_on_64_gpus():
    """Mixtral 8x7B by its own shape (SwiGLU experts of 14336, 8 K/V heads): 46.7 B parameters, 12.9 B active per
    token, as its paper says."""
    from gpucourse.modeled.plan import SHAPES

    result = plan(None, gpus=64, shape="mixtral-8x7b")
    assert round(result["model_params"] / 1e9, 1) == 46.7 and round(result["active_params"] / 1e9, 1) == 12.9
    assert result["active_params"] == SHAPES["mixtral-8x7b"].active_params()
    rows = result["layouts"]
    assert {r["ep"] for r in rows} == {1, 2, 4, 8}
    for r in rows:
        assert r["dp"] * r["tp"] * r["pp"] == 64 and r["dp"] % r["ep"] == 0
        assert (r["ep_comm_s"] > 0) == (r["ep"] > 1)
    # Expert parallelism shrinks the experts' weights per rank: the same layout, ep 1 against 8.
    same = {r["ep"]: r for r in rows if (r["dp"], r["tp"], r["pp"], r["zero"], r["checkpoint_activations"])
            == (64, 1, 1, 0, False)}
    assert same[8]["memory"]["weights"] < same[1]["memory"]["weights"] / 3
    # Compute follows the active parameters, not all of them: under a third of what all 46.7 B would take.
    dense_flops = 6 * result["model_params"] * 1024 * 4096
    assert same[1]["compute_s"] < dense_flops / (64 * 989e12) / 3 * 2
    with pytest.raises(ValueError, match="mixtral-8x7b"):
        plan(None, gpus=64, shape="mixtral")


def test_the_planner_counts_attentions_flops_which_rule_long_sequences():
    from gpucourse.modeled.plan import attention_flops, step_time
    from gpucourse.modeled.gpus import get_gpu

    # PaLM's count: 6·N + 12·L·C·T per token. At 4 k tokens a 70 B model's attention adds a few per cent; at
    # 128 k it is several times the weights' FLOPs.
    n, L, C = 70e9, 80, 8192
    assert attention_flops(L, C, 4096) / (6 * n) == pytest.approx(12 * 80 * 8192 * 4096 / 420e9)
    assert attention_flops(L, C, 4096) < 0.1 * 6 * n < attention_flops(L, C, 131072) / 5
    assert attention_flops(L, C, 4096, recompute=True) == 16 * L * C * 4096
    cfg = TrainConfig(model="gpt2-small", overrides={"n_layer": L, "n_embd": C, "n_head": 64, "vocab_size": 32000,
                                                     "block_size": 8192}, dp=64, seq_len=8192, batch_size=64,
                      precision="bf16", master_weights=True)
    gpu = get_gpu("h100")
    t = step_time(cfg, int(n), gpu, 8, 0.5)
    want = (6 * n + 12 * L * C * 8192) * 64 * 8192 / (64 * gpu.peak_flops("bf16") * 0.5)
    assert t.compute_s == pytest.approx(want)
    # Notebook 06: "at 4096 tokens attention adds about 8 % for this 70 B shape" (the planner's shape for 70e9).
    from gpucourse.modeled.plan import shape_for_params
    shape = shape_for_params(70e9)
    assert round(100 * attention_flops(shape["n_layer"], shape["n_embd"], 4096) / (6 * 70e9)) == 8


def _layout(**layout):
    """A 70 B-like shape at 32 k tokens, with ``layout`` (dp, tp, pp, cp, schedule, ...)."""
    return TrainConfig(model="gpt2-small", overrides={"n_layer": 80, "n_embd": 8192, "n_head": 64,
                                                      "vocab_size": 32000, "block_size": 32768},
                       seq_len=32768, precision="bf16", master_weights=True, **layout)


def test_context_parallelism_divides_what_tensor_and_pipeline_parallelism_move_by_cp():
    """Each context-parallel rank holds T/cp tokens: its tp all-reduces and pp sends carry T/cp, not T."""
    from gpucourse.modeled.cluster import Cluster
    from gpucourse.modeled.gpus import get_gpu
    from gpucourse.modeled.plan import step_time

    gpu, n = get_gpu("h100"), int(70e9)
    one = step_time(_layout(tp=8, pp=2, microbatches=4, batch_size=4, sequence_parallel=True), n, gpu, 8)
    four = step_time(_layout(tp=2, cp=4, pp=2, microbatches=4, batch_size=4, sequence_parallel=True, zigzag=True),
                     n, gpu, 8)
    cluster = Cluster(gpu, 8, 2)
    # Per block and microbatch: four all-reduces of a rank's activations (tokens × width × 2 bytes); a pipeline
    # send carries 1/tp of them (sequence parallelism), all-gathered on arrival.
    for got, tp, cp in ((one, 8, 1), (four, 2, 4)):
        activations = 32768 / cp * 8192 * 2
        assert got.costs["tensor"].comm_s == pytest.approx(4 * 40 * 4 * cluster.collective_s("all_reduce", activations,
                                                                                   range(tp))[0])
        assert got.costs["pipeline"].comm_s == pytest.approx(2 * 4 * (
            cluster.collective_s("send", activations / tp, (0, tp * cp))[0]
            + cluster.collective_s("all_gather", activations, range(tp))[0]))


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                         ("interleaved-1f1b", 4), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
def test_the_planners_bubble_is_the_schedule_commands(schedule, v, tmp_path, capsys):
    """plan.step_time charges the bubble `gpucourse schedule` lays out for the same schedule, pp and m."""
    from gpucourse import cli
    from gpucourse.modeled.gpus import get_gpu
    from gpucourse.modeled.plan import step_time

    pp, m = 4, 8
    cfg = _layout(tp=8, pp=pp, microbatches=m, batch_size=m, schedule=schedule, virtual_stages=max(v, 2))
    got = step_time(cfg, int(70e9), get_gpu("h100"), 8)
    out = tmp_path / "schedule.json"
    argv = ["schedule", "--schedule", schedule, "--pp", str(pp), "--microbatches", str(m), "--json", str(out)]
    assert cli.main(argv + (["--virtual-stages", str(v)] if schedule == "interleaved-1f1b" else [])) == 0
    capsys.readouterr()
    laid_out = json.loads(out.read_text())["bubble_ratio"]
    assert got.bubble_s / got.compute_s == pytest.approx(laid_out)
    if schedule == "interleaved-1f1b":
        assert laid_out == pytest.approx((pp - 1) / (v * m))


def test_a_plans_step_is_the_sum_of_its_parts_and_explain_prints_them(capsys):
    """Compute, recompute, bubble, each kind of communication and the optimizer add up to the step; recomputation
    is one more forward (2·N + 4·L·C·T of the 8·N + 16·L·C·T a token); Adam moves 28 bytes a parameter it updates."""
    from gpucourse import cli
    from gpucourse.modeled.cluster import ADAM_BYTES_PER_PARAM, Cluster
    from gpucourse.modeled.gpus import get_gpu
    from gpucourse.modeled.plan import step_time

    gpu, n = get_gpu("h100"), int(70e9)
    for ckpt, zero in ((False, 0), (True, 1)):
        cfg = _layout(dp=4, tp=8, pp=2, microbatches=8, batch_size=32, zero=zero, checkpoint_activations=ckpt)
        got = step_time(cfg, n, gpu, 8)
        assert sum(got.parts.values()) == pytest.approx(got.step_s)
        assert got.parts["compute"] + got.parts["recompute"] == pytest.approx(got.compute_s)
        # Recomputation is one more forward of the blocks (not of the head): a bit under a third of the rest.
        share = got.recompute_s / (got.compute_s - got.recompute_s)
        assert (0.25 < share < 1 / 3) if ckpt else share == 0
        held = n / (8 * 2) / (4 if zero else 1)
        assert got.optimizer_s == pytest.approx(Cluster(gpu, 8, 8).optimizer_s(held))
        assert got.optimizer_s == pytest.approx(held * ADAM_BYTES_PER_PARAM / (gpu.hbm_GBps * 1e9) + 10 * 4e-6)
    assert cli.main(["plan", "--params", "7e9", "--gpus", "8", "--gpu", "a100", "--top", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert out.count("(gpucourse memory's estimate)") == 2 and "step " in out and "optimizer " in out
    assert max(len(line) for line in out.splitlines()[2:]) <= 110
