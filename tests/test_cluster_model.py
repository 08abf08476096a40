"""The modeled cluster's parts: practitioners' shapes, kernels timed by their own shapes, and overlap as a setting.

Pure arithmetic (no launches): each test is the behaviour one of the cost model's old faults got wrong.
"""

from __future__ import annotations

import pytest

from gpucourse import ConfigError, TrainConfig
from gpucourse.cli import main
from gpucourse.modeled.cluster import Cluster
from gpucourse.modeled.gpus import get_gpu
from gpucourse.modeled.plan import FRAMEWORKS, explain, format_plan, get_framework, plan, step_time
from gpucourse.modeled.shapes import SHAPES, Shape, ShapeError, get_shape

H100 = Cluster(get_gpu("h100"))


# --- shapes ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, total, active", [
    ("gpt3-175b", 174.6e9, None), ("megatron-1t", 1008e9, None), ("llama2-70b", 69e9, None),
    ("llama3-8b", 8.03e9, None), ("llama3-70b", 70.6e9, None), ("llama3-405b", 405e9, None),
    ("mixtral-8x7b", 46.7e9, 12.9e9), ("deepseek-v3-like", 671e9, 37e9)])
def test_each_named_shape_has_the_parameters_its_source_says(name, total, active):
    shape = SHAPES[name]
    assert shape.params() == pytest.approx(total, rel=0.01 if active is None else 0.05), shape.describe()
    if active:
        assert shape.active_params() == pytest.approx(active, rel=0.05)
    assert len(shape.source) > 40


def test_gqa_and_swiglu_change_what_a_block_holds_and_multiplies():
    mha = Shape(32, 4096, 32, ffn=14336, mlp="swiglu")
    gqa = Shape(32, 4096, 32, kv_heads=8, ffn=14336, mlp="swiglu")
    C, d = 4096, 128
    assert mha.attention_params() - gqa.attention_params() == 2 * C * d * (32 - 8)
    assert gqa._mlp_params(14336) == 3 * C * 14336 and Shape(2, 64, 4)._mlp_params(256) == 2 * 64 * 256
    qkv = gqa.kernels(8192, 8192, tp=8)[0]
    assert (qkv["m"], qkv["n"], qkv["k"]) == (8192, (4 + 2 * 1) * d, C)  # 32/8 query heads, 8/8 K/V heads a rank
    # tp 16 over 8 K/V heads: each rank still computes a whole K/V head (two ranks hold a copy of each).
    assert gqa.kv_heads_per_rank(16) == 1 and gqa.kv_replication(16) == 2


def test_flops_count_attention_and_say_whether_the_mask_halves_it():
    shape = SHAPES["llama3-8b"]
    T = 8192
    causal, whole = shape.flops_per_token(T, causal=True), shape.flops_per_token(T, causal=False)
    attention = 3 * 4 * shape.layers * shape.hidden * T  # 12·L·C·T: PaLM's count, the whole square
    assert whole - causal == pytest.approx(attention / 2)
    assert whole == pytest.approx(6 * shape.matmul_params() + attention)


@pytest.mark.parametrize("bad, says", [
    ({"layers": 4, "hidden": 1000, "heads": 64}, "divisible by heads"),
    ({"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 3}, "must divide heads"),
    ({"layers": 4, "hidden": 512, "heads": 8, "mlp": "relu"}, "gelu, swiglu"),
    ({"layers": 4, "hidden": 512}, "heads missing"),
    ({"layers": 4, "hidden": 512, "heads": 8, "vocabulary": 5}, "unknown shape part vocabulary"),
    ("llama4", "known: gpt3-175b"),
])
def test_a_bad_shape_gets_one_sentence(bad, says):
    with pytest.raises(ShapeError, match=says):
        get_shape(bad)


def test_tensor_parallelism_must_split_the_heads_or_replicate_whole_kv_heads():
    gqa = Shape(8, 1536, 12, kv_heads=4)
    gqa.check_tp(4)
    gqa.check_tp(12)  # 3 copies of each K/V head
    with pytest.raises(ShapeError, match="does not divide the 12 attention heads"):
        gqa.check_tp(8)
    with pytest.raises(ShapeError, match="neither divides the other"):
        Shape(8, 1536, 12, kv_heads=6).check_tp(4)
    # The planner never offers such a tp.
    assert {r["tp"] for r in plan(None, 16, shape={"layers": 8, "hidden": 1536, "heads": 12, "kv_heads": 4},
                                   gpus_per_node=16)["layouts"]} <= {1, 2, 4}


def test_plan_from_the_command_line_with_a_shapes_parts(capsys):
    assert main(["plan", "--shape", "llama3-8b", "--gpus", "8", "--top", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b: 32 blocks of 4096, 32 heads, 8 K/V heads, swiglu MLP 14336, vocabulary 128256" in out
    assert "step" in out and "per GPU" in out
    assert main(["plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--kv-heads", "4", "--ffn",
                 "5632", "--mlp", "swiglu", "--vocab", "50000", "--gpus", "8", "--top", "1"]) == 0
    assert "24 blocks of 2048, 16 heads, 4 K/V heads, swiglu MLP 5632, vocabulary 50000" in capsys.readouterr().out
    assert main(["plan", "--shape", "llama3-8b", "--kv-heads", "5", "--gpus", "8"]) == 2
    assert "kv_heads=5 must divide heads=32" in capsys.readouterr().err
    assert main(["plan", "--shape", "gpt5", "--gpus", "8"]) == 2
    assert "known: gpt3-175b" in capsys.readouterr().err
    assert main(["plan", "--shape", "llama3-405b", "--gpus", "8"]) == 0
    assert "none fits: the smallest needs" in capsys.readouterr().out
    assert main(["plan", "--shape", "llama3-8b", "--gpus", "8", "--framework", "jax"]) == 2
    assert "framework 'jax' is not one of" in capsys.readouterr().err


# --- compute by shape --------------------------------------------------------------------------------------------------

def _tflops(m, n, k, cluster=H100, precision="bf16"):
    return 2 * m * n * k / cluster.gemm_s(m, n, k, precision) / 1e12


def test_small_matmuls_run_further_from_the_peak_than_large_ones():
    """A transformer's GEMMs (tokens × width × 4·width): the per-FLOP speed rises with the width, towards the
    large-GEMM share of the peak (cited in gpus.py), as measured GEMM tables show."""
    speeds = [_tflops(8192, 4 * C, C) for C in (1024, 2048, 4096, 8192, 16384)]
    assert speeds == sorted(speeds) and speeds[0] < 0.6 * speeds[-1]
    g = H100.gpu
    assert speeds[-1] <= g.peak_bf16_flops * g.gemm_efficiency * g.sustained / 1e12 + 1e-6


def test_a_wave_that_spills_over_the_sms_costs_more_than_its_work():
    """12 × 11 = 132 tiles of 256 × 128 fill an H100's 132 SMs once; a 13th row of tiles (143) means a second
    wave, or smaller tiles in more waves (the kernel picks the cheaper): 8 % more work takes 24 % more time."""
    full = H100.gemm_s(12 * 256, 11 * 128, 8192)
    spill = H100.gemm_s(13 * 256, 11 * 128, 8192)
    assert spill / full == pytest.approx(1.24, abs=0.01)


def test_a_skinny_matmul_is_memory_bound_and_fp8_halves_a_large_one():
    m, n, k = 16, 16384, 16384  # a decode step's GEMV-like shape: reading the weights dominates
    bytes_s = (m * k + k * n + m * n) * 2 / H100.hbm_Bps
    assert H100.gemm_s(m, n, k) == pytest.approx(bytes_s + 4e-6)
    big = (16384, 16384, 16384)
    assert H100.gemm_s(*big, precision="fp8") < 0.6 * H100.gemm_s(*big)


def test_attention_is_its_own_kernel_slower_at_short_sequences_and_backward_costs_more():
    def speed(T):
        seconds = H100.attention_s(sequences=8, heads=32, q=T, kv=T, head_dim=128)
        return 4 * 8 * 32 * T * T / 2 * 128 / seconds  # causal FLOPs per second
    assert speed(512) < 0.8 * speed(16384)
    fwd = H100.attention_s(1, 32, 8192, 8192, 128)
    assert H100.attention_s(1, 32, 8192, 8192, 128, backward=True) > 2.5 * fwd
    assert H100.attention_s(1, 32, 8192, 8192, 128, kernel="flash2") > 1.5 * fwd  # FlashAttention-2 on Hopper
    assert H100.attention_s(1, 32, 8192, 8192, 128, kernel="unfused") > fwd


def _cfg(**kw):
    base = dict(model="gpt2-small", overrides={"n_layer": 24, "n_embd": 4096, "n_head": 32, "vocab_size": 32000,
                                               "block_size": 4096}, seq_len=4096, precision="bf16")
    return TrainConfig(**{**base, **kw})


def test_full_recomputation_costs_one_more_forward_of_the_blocks():
    plain = step_time(_cfg(dp=8, batch_size=64, grad_accum=8), int(5e9), get_gpu("h100"), 8)
    redo = step_time(_cfg(dp=8, batch_size=64, grad_accum=8, checkpoint_activations=True), int(5e9),
                     get_gpu("h100"), 8)
    forward_share = redo.recompute_s / plain.compute_s
    assert 0.25 < forward_share < 1 / 3 + 1e-9  # a forward is a third of forward + backward, less the head's
    assert redo.compute_s == pytest.approx(plain.compute_s + redo.recompute_s)


def test_selective_recomputation_costs_attentions_forward_and_frees_the_scores_of_unfused_attention():
    """Unfused attention (Megatron-LM 2021) keeps a·s/h more per token than a fused kernel: selective recomputation
    frees it for one more forward of attention alone; full recomputation costs the whole forward."""
    from gpucourse.modeled.plan import activation_bytes, candidates

    kw = dict(dp=8, batch_size=64, grad_accum=8, precision="bf16", master_weights=True, attention="math")
    times = {rc: step_time(_cfg(**kw, checkpoint_activations=rc), int(5e9), get_gpu("a100"), 8,
                           framework="megatron-2021") for rc in (False, "selective", True)}
    assert times[False].recompute_s == 0 < times["selective"].recompute_s < 0.3 * times[True].recompute_s
    assert times["selective"].costs["tensor"].comm_s == times[False].costs["tensor"].comm_s
    shape = get_shape("gpt3-175b")
    held = {rc: activation_bytes(_cfg(**kw, checkpoint_activations=rc), shape, 0) for rc in (False, "selective")}
    tokens = 64 / 8 / 8 * 4096  # one microbatch's tokens
    assert held[False] - held["selective"] == pytest.approx(2 * shape.heads * 4096 * tokens * shape.layers)
    fused = list(candidates(shape, 64, 8, 64, 2048, "bf16"))
    unfused = list(candidates(shape, 64, 8, 64, 2048, "bf16", attention="math"))
    assert {c.recompute for c in fused} == {"none", "full"} and {c.attention for c in fused} == {"flash"}
    assert {c.recompute for c in unfused} == {"none", "selective", "full"}
    rows = plan(None, 64, "a100", shape="gpt3-175b", framework="megatron-2021", batch_size=64, seq_len=2048)
    sel = next(r for r in rows["layouts"] if r["checkpoint_activations"] == "selective")
    assert "selective recomputation" in explain(sel) and sel["recompute_s"] > 0
    only = {**rows, "layouts": [{**sel, "fits": True}]}
    assert f" {'sel':>4} " in format_plan(only).splitlines()[-1]


# --- overlap as a setting ----------------------------------------------------------------------------------------------

def test_whether_the_gradients_all_reduce_hides_depends_on_the_framework():
    """Megatron-LM 2021 all-reduced after the pipeline flush; Megatron-Core overlaps it with backward."""
    cfg = _cfg(dp=64, batch_size=64, grad_accum=1)
    after = step_time(cfg, int(5e9), get_gpu("a100"), 8, framework="megatron-2021")
    beside = step_time(cfg, int(5e9), get_gpu("a100"), 8, framework="megatron-core")
    assert after.costs["data"].comm_s == pytest.approx(beside.costs["data"].comm_s) and after.costs["data"].comm_s > 0
    assert after.costs["data"].exposed_s == pytest.approx(after.costs["data"].comm_s)
    assert beside.costs["data"].exposed_s < 0.5 * after.costs["data"].exposed_s
    for name, o in FRAMEWORKS.items():
        assert o.name == name and len(o.source) > 40
    with pytest.raises(ConfigError, match="framework='x' is not one of"):
        get_framework("x")


def test_zero3_gathers_the_weights_every_microbatch_and_deepspeed_2021_reached_one_card_a_gpu():
    one, four = (step_time(_cfg(dp=64, zero=3, batch_size=64 * m, grad_accum=m), int(5e9), get_gpu("a100"), 8)
                 for m in (1, 4))
    assert four.costs["data"].comm_s == pytest.approx(4 * one.costs["data"].comm_s)
    ds = step_time(_cfg(dp=64, zero=3, batch_size=64, grad_accum=1), int(5e9), get_gpu("a100"), 8,
                   framework="deepspeed-zero3")
    assert ds.costs["data"].comm_s > 5 * one.costs["data"].comm_s  # one 25 GB/s card, not the server's eight


def test_tensor_and_context_parallel_overlap_hide_what_they_say():
    cfg = _cfg(tp=8, dp=1, batch_size=8, grad_accum=8, sequence_parallel=True)
    plain = step_time(cfg, int(5e9), get_gpu("h100"), 8, framework="megatron-core")
    hidden = step_time(cfg, int(5e9), get_gpu("h100"), 8, framework="megatron-core-tp-overlap")
    assert plain.costs["tensor"].exposed_s == pytest.approx(plain.costs["tensor"].comm_s) and plain.costs["tensor"].comm_s > 0
    assert hidden.costs["tensor"].exposed_s < plain.costs["tensor"].exposed_s and hidden.costs["tensor"].comm_s == plain.costs["tensor"].comm_s
    long = _cfg(cp=8, zigzag=True, batch_size=1, grad_accum=1, seq_len=65536,
                overrides={"n_layer": 24, "n_embd": 4096, "n_head": 32, "vocab_size": 32000, "block_size": 65536})
    ring = step_time(long, int(5e9), get_gpu("h100"), 8, framework="megatron-core")
    exposed = step_time(long, int(5e9), get_gpu("h100"), 8, framework="megatron-2021")
    assert ring.costs["context"].comm_s == exposed.costs["context"].comm_s > 0
    assert ring.costs["context"].exposed_s < exposed.costs["context"].exposed_s == exposed.costs["context"].comm_s


# --- where a layout runs: pipelines, rings, servers, memory ---------------------------------------------------------

def test_an_interleaved_pipeline_sends_once_per_chunk_a_rank_holds():
    """SC21 (section 2.2.2): v chunks a rank cut the bubble by v and multiply the stage-to-stage traffic by v; the
    work a rank does is the same."""
    base = dict(pp=4, dp=1, microbatches=8, batch_size=8)
    one = step_time(_cfg(**base, schedule="1f1b"), int(5e9), get_gpu("h100"), 8, framework="megatron-2021")
    two, four = (step_time(_cfg(**base, schedule="interleaved-1f1b", virtual_stages=v), int(5e9), get_gpu("h100"),
                           8, framework="megatron-2021") for v in (2, 4))
    assert one.costs["pipeline"].comm_s > 0 and two.costs["pipeline"].comm_s == pytest.approx(2 * one.costs["pipeline"].comm_s)
    assert four.costs["pipeline"].comm_s == pytest.approx(4 * one.costs["pipeline"].comm_s)
    assert two.compute_s == pytest.approx(one.compute_s) and four.bubble_s < two.bubble_s < one.bubble_s


def test_megatron_2021_pipelines_split_the_blocks_evenly_and_tensor_parallelism_stays_in_a_server():
    """Megatron-LM's argument checks (2021): pp divides the layers, pp·v too when interleaved, which needs more than
    two stages. Any framework: a tp group that straddled two servers would all-reduce every block over the network."""
    from gpucourse.modeled.plan import candidates

    shape = get_shape({"layers": 60, "hidden": 9216, "heads": 96, "vocab": 51200})
    even = list(candidates(shape, 1536, 8, 1536, 2048, "bf16", even_split=True))
    free = list(candidates(shape, 1536, 8, 1536, 2048, "bf16"))
    assert even and all(60 % c.pp == 0 for c in even) and any(60 % c.pp for c in free)
    chunked = [c for c in even if c.schedule == "interleaved-1f1b"]
    assert chunked and all(60 % (c.pp * c.virtual_stages) == 0 and c.pp > 2 for c in chunked)
    assert {c.tp for c in free} == {1, 2, 4, 8}  # 96 heads would take 6, 12, ...: none divides a server of 8
    assert 6 in {c.tp for c in candidates(shape, 1536, 6, 1536, 2048, "bf16")}
    assert FRAMEWORKS["megatron-2021"].even_split and not FRAMEWORKS["megatron-core"].even_split


def test_a_context_parallel_ring_that_spans_servers_goes_at_its_network_hop():
    long = _cfg(cp=8, zigzag=True, batch_size=1, grad_accum=1, seq_len=65536,
                overrides={"n_layer": 24, "n_embd": 4096, "n_head": 32, "vocab_size": 32000, "block_size": 65536})
    inside = step_time(long, int(5e9), get_gpu("h100"), 8)
    across = step_time(long, int(5e9), get_gpu("h100"), 4)  # the same ring over two servers of 4
    h100 = get_gpu("h100")
    assert across.costs["context"].comm_s > 0.8 * inside.costs["context"].comm_s * h100.intra_node_GBps / h100.inter_node_GBps


def test_a_layout_fits_the_memory_nvidia_smi_shows_less_a_reserve():
    """An "80 GB" card holds 80 GiB (nvidia-smi: 81559 MiB on an H100): 85.9e9 bytes, not 80e9."""
    from gpucourse.modeled.gpus import RESERVED_BYTES

    h100 = get_gpu("h100")
    assert h100.usable_bytes() == 80 * 2**30 - RESERVED_BYTES > 83e9
    result = plan(None, 64, shape="llama3-70b")
    assert all(r["fits"] == (r["memory_total"] <= h100.usable_bytes()) for r in result["layouts"])
    assert any(80e9 < r["memory_total"] <= h100.usable_bytes() and r["fits"] for r in result["layouts"])


def test_explain_names_every_part_and_the_framework():
    result = plan(None, 64, shape="llama3-70b", framework="fsdp")
    row = next(r for r in result["layouts"] if r["fits"])
    text = explain(row)
    assert result["framework"] == "fsdp" and "per GPU" in text
    assert sum(row["parts"].values()) == pytest.approx(row["step_s"])
    assert row["communication_s"] == pytest.approx(sum(row["parts"][k] for k in ("tp", "cp", "ep", "pp", "dp")))


def test_three_pp_microbatches_reach_an_interleaved_pipelines_peak_in_flight():
    """The planner lays an interleaved schedule out with at most 3·pp microbatches to find its peak activations:
    more never change it."""
    from gpucourse.modeled.memory import in_flight

    for pp in (2, 4, 8):
        for v in (2, 4):
            peak = in_flight("interleaved-1f1b", pp, 3 * pp, v)
            for m in (4 * pp, 6 * pp):
                assert in_flight("interleaved-1f1b", pp, m, v) == peak


def test_fp8_plans_time_the_matmuls_at_the_fp8_peak_and_need_a_gpu_that_has_it():
    bf16 = plan(None, 64, "h100", shape="llama3-70b")["layouts"][0]
    fp8 = plan(None, 64, "h100", shape="llama3-70b", precision="fp8")
    assert 1.2 < bf16["step_s"] / fp8["layouts"][0]["step_s"] < 1.8  # matmuls faster; attention and the rest not
    assert fp8["precision"] == "fp8" and fp8["layouts"][0]["config"]["precision"] == "bf16"  # memory as bf16
    assert H100.gpu.gemm_fp8_efficiency == 0.71
    with pytest.raises(ConfigError, match="a100 has none"):
        plan(None, 64, "a100", shape="llama3-70b", precision="fp8")
    assert plan(None, 8, "l4", shape="llama3-8b", precision="fp8")["precision"] == "fp8"  # Ada has fp8


def test_a_plan_says_when_tensor_parallelism_replicates_kv_heads():
    result = plan(None, 8, shape={"layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 2, "mlp": "swiglu",
                                  "ffn": 5632})
    row = next(r for r in result["layouts"] if r["tp"] == 8)
    assert row["kv_replication"] == 4 and "each K/V head held by 4 of the tp ranks" in explain(row)
    assert all(r["kv_replication"] == 1 for r in result["layouts"] if r["tp"] <= 2)


def test_step_time_refuses_a_tp_the_heads_cannot_take_in_one_sentence():
    cfg = _cfg(tp=8, dp=1, batch_size=8, grad_accum=8)
    with pytest.raises(ConfigError, match="tp=8 and the 12 K/V heads: neither divides the other"):
        step_time(cfg, int(5e9), get_gpu("h100"), 8, shape={"layers": 24, "hidden": 4608, "heads": 48,
                                                              "kv_heads": 12})


def test_calibrate_times_a_blocks_kernels_here_beside_the_model():
    """What scripts/gpu-check prints on a GPU box, run here on the CPU against the 'cpu' entry."""
    from gpucourse.modeled.calibrate import format_ratios, gpu_entry, kernel_ratios

    rows = kernel_ratios("cpu", "cpu", model="tiny", tokens=64, seq_len=32, precision="fp32", repeats=2)
    assert [r["kernel"] for r in rows] == ["qkv", "out", "attention", "mlp_up", "mlp_down"]
    assert all(r["measured_s"] > 0 and r["ratio"] == r["modeled_s"] / r["measured_s"] for r in rows)
    assert "modeled/measured" in format_ratios(rows, "cpu")
    assert (gpu_entry("NVIDIA H100 80GB HBM3"), gpu_entry("NVIDIA H200"), gpu_entry("Tesla T4")) == \
        ("h100", "h200", None)


def test_calibrate_times_prefill_and_cached_decode_here_beside_the_serving_model():
    """gpu-check's serving lines (prefill, then decode steps through the KV cache at two batches), run here."""
    from gpucourse.modeled.calibrate import serving_ratios
    from gpucourse.model import MODELS
    from gpucourse.modeled.serve_plan import decode_step, prefill
    from gpucourse.modeled.shapes import Shape

    rows = serving_ratios("cpu", "cpu", model="tiny", prompt_len=16, prompts=2, batches=(1, 4), new_tokens=3,
                          precision="fp32", repeats=1)
    assert [(r["kernel"], r["shape"]) for r in rows] == [("prefill", "2 prompts × 16 tokens"),
                                                         ("decode", "batch 1, 16+3 tokens"),
                                                         ("decode", "batch 4, 16+3 tokens")]
    shape = Shape.of_model(MODELS["tiny"])
    assert rows[0]["modeled_s"] == prefill(shape, "cpu", 2, 16, weights="fp32")["first_token_s"]
    assert rows[2]["modeled_s"] == decode_step(shape, "cpu", 4, 17, weights="fp32", kv="fp32")["token_s"]
    assert all(r["measured_s"] > 0 and r["ratio"] == r["modeled_s"] / r["measured_s"] for r in rows)


# --- CPU offload of the optimizer ----------------------------------------------------------------------------------------

def test_offload_times_pcie_both_ways_and_a_cpu_adam_step_by_their_formulas():
    from gpucourse.modeled.offload import HOST_EFFICIENCY, PCIE_EFFICIENCY, offload_time

    h100 = get_gpu("h100")
    assert (h100.pcie_GBps, h100.host_GBps) == (64, 2 * 307.2 / 8)  # Gen5 x16; 2 sockets × 8 channels DDR5-4800
    t = offload_time(1e9, h100, "bf16", window_s=0.01)
    pcie = 64e9 * PCIE_EFFICIENCY
    assert t["to_host_s"] == pytest.approx(2e9 / pcie) == t["to_gpu_s"]
    assert t["cpu_adam_s"] == pytest.approx(28e9 / (76.8e9 * HOST_EFFICIENCY))  # 2 + 24 + 2 bytes a parameter
    assert t["exposed_s"] == pytest.approx(t["to_host_s"] - 0.01 + t["cpu_adam_s"] + t["to_gpu_s"])
    hidden = offload_time(1e9, h100, "bf16", window_s=1.0)  # the copy to the host hides behind a long backward
    assert hidden["exposed_s"] == pytest.approx(hidden["cpu_adam_s"] + hidden["to_gpu_s"])
    assert offload_time(1e9, h100, "fp32")["cpu_adam_s"] == pytest.approx(28e9 / (76.8e9 * HOST_EFFICIENCY))
    with pytest.raises(ValueError, match="cpu has no host link"):
        offload_time(1e9, get_gpu("cpu"), "bf16")


def test_offload_moves_the_optimizer_to_the_host_and_shrinks_with_zero_over_dp():
    """Llama 3 8B on one A100 does not fit (its 12 bytes of Adam state a parameter alone are 96 GB); with the
    optimizer on the CPU it does, at the price of a CPU step. With ZeRO-2 over 8 GPUs each offloads an eighth."""
    from gpucourse.modeled.plan import memory_of

    shape = get_shape("llama3-8b")
    result = plan(None, 1, "a100", shape="llama3-8b", batch_size=16, offload=True)
    rows = result["layouts"]
    assert not any(r["fits"] for r in rows if not r["offload"]) and rows[0]["fits"] and rows[0]["offload"]
    kept = next(r for r in rows if not r["offload"] and r["config"] == rows[0]["config"])
    assert rows[0]["memory"]["optimizer"] == 0 and kept["memory"]["optimizer"] == 12 * shape.params()
    assert rows[0]["host_bytes"] == pytest.approx(16 * shape.params())  # the state and an fp32 gradient
    assert rows[0]["memory_total"] == pytest.approx(kept["memory_total"] - 12 * shape.params())
    assert rows[0]["parts"]["optimizer"] == pytest.approx(rows[0]["offload"]["exposed_s"])
    assert "optimizer on the CPU" in explain(rows[0]) and " offl " in format_plan(result)
    cfg = TrainConfig(model="gpt2-small", overrides={**shape.overrides(), "block_size": 4096}, dp=8, zero=2,
                      batch_size=8, seq_len=4096, precision="bf16", master_weights=True)
    eight = step_time(cfg, int(shape.params()), get_gpu("a100"), 8, shape=shape, offload=True).offload
    one = rows[0]["offload"]
    assert eight["cpu_adam_s"] == pytest.approx(one["cpu_adam_s"] / 8)
    assert memory_of(cfg, shape, offload=True)["host_bytes"] == pytest.approx(16 * shape.params() / 8)
    with pytest.raises(ConfigError, match="offload needs the GPU's host link"):
        plan(None, 1, "cpu", shape="llama3-8b", offload=True)


def test_plan_offload_from_the_command_line(capsys):
    assert main(["plan", "--shape", "llama3-8b", "--gpus", "1", "--gpu", "a100", "--batch-size", "16",
                 "--offload", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert " offl " in out and out.splitlines()[3].split()[4] == "yes"


def test_explain_states_the_search_space_the_ranking_came_from(capsys):
    """plan --explain says what a layout could have been: each degree, ZeRO stage, schedule and recomputation the
    sized layouts took, and where context parallelism starts; a mixture of experts adds ep, a long sequence cp."""
    from gpucourse import cli
    from gpucourse.modeled import plan

    result = plan.plan(None, shape="llama3-70b", gpus=64, gpu="h100", batch_size=1024, seq_len=4096)
    searched = result["searched"]
    rows = result["layouts"]
    assert searched["layouts"] == len(rows)
    for key in ("tp", "pp", "dp", "cp", "zero"):
        assert searched[key] == sorted({r[key] for r in rows}), key
    assert searched["tp"] == [1, 2, 4, 8] and searched["cp"] == [1] and searched["zero"] == [0, 1, 2, 3]
    assert searched["recompute"] == [False, True] and "i8" in searched["schedules"]
    text = plan.format_searched(searched)
    assert "tp 1, 2, 4 and 8" in text and "; ep" not in text and "not tried at 4096" in text
    long = plan.plan(None, shape="mixtral-8x7b", gpus=16, gpu="h100", batch_size=64, seq_len=16384)["searched"]
    assert long["cp"][-1] > 1 and long["ep"][-1] > 1 and "16384 tokens on" in long["cp_rule"]
    assert "; ep 1, 2" in plan.format_searched(long) and "not tried" not in long["cp_rule"]
    assert cli.main(["plan", "--shape", "llama3-8b", "--gpus", "8", "--top", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "searched " in out and "A tensor-parallel group stays inside a server." in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()[2:]) <= 110
