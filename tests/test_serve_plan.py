"""Serving on modeled GPUs: prefill compute-bound, decode memory-bound, the KV cache's bytes, and layouts ranked.

Pure arithmetic on the cluster model (no launches)."""

from __future__ import annotations

import pytest

from gpucourse import ConfigError
from gpucourse.cli import main
from gpucourse.modeled.cluster import Cluster
from gpucourse.modeled.gpus import get_gpu
from gpucourse.modeled.serve_plan import (STEP_OVERHEAD_S, decode_step, held, kv_bytes_per_token, largest_batch, plan,
                                          prefill, ridge_point, serve, weight_bytes)
from gpucourse.modeled.shapes import get_shape

pytestmark = pytest.mark.timeout(120)
LLAMA70 = get_shape("llama3-70b")
H100 = get_gpu("h100")


def test_the_kv_cache_holds_keys_and_values_of_each_kv_head_in_every_layer():
    assert kv_bytes_per_token(LLAMA70) == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB a token in bf16
    assert kv_bytes_per_token(LLAMA70, tp=8) == 327_680 / 8
    assert kv_bytes_per_token(LLAMA70, tp=8, kv="fp8") == 327_680 / 16
    # 16 tp ranks and 8 K/V heads: each head is held by two ranks, so a rank's share stops shrinking.
    assert LLAMA70.kv_replication(16) == 2 and kv_bytes_per_token(LLAMA70, tp=16) == kv_bytes_per_token(LLAMA70, 8)
    assert weight_bytes(LLAMA70, tp=8) == pytest.approx(2 * LLAMA70.stage_params(1, 0, 8)[0])


def test_decode_is_memory_bound_so_a_bigger_batch_costs_little_and_prefill_is_compute_bound():
    ridge = ridge_point(H100)
    assert ridge == pytest.approx(989e12 / 3350e9)
    one, eight = (decode_step(LLAMA70, H100, b, 4096, tp=8) for b in (1, 8))
    assert one["intensity"] < 2 < ridge and eight["intensity"] < ridge
    floor = weight_bytes(LLAMA70, tp=8) / Cluster.of(H100).hbm_Bps  # every weight read once a step
    assert floor < one["matmul_s"] < 2 * floor
    assert eight["token_s"] < 1.2 * one["token_s"] and eight["tokens_per_s"] > 6 * one["tokens_per_s"]
    first = prefill(LLAMA70, H100, 1, 2048, tp=8)
    assert first["intensity"] > ridge and first["first_token_s"] > first["flops"] / 8 / H100.peak_flops("bf16")


def test_a_pipeline_sums_its_stages_and_tensor_parallelism_adds_all_reduces():
    from gpucourse.modeled.serve_plan import STEP_OVERHEAD_S

    piped = decode_step(LLAMA70, H100, 4, 4096, tp=2, pp=4)
    assert piped["token_s"] == pytest.approx(4 * piped["stage_s"] + piped["pp_send_s"] + STEP_OVERHEAD_S)
    assert piped["pp_send_s"] > 0
    alone = decode_step(LLAMA70, H100, 4, 4096, tp=1, pp=8)
    assert alone["tp_comm_s"] == 0 < piped["tp_comm_s"]
    assert piped["tokens_per_s"] == pytest.approx(4 / (piped["stage_s"] + piped["pp_send_s"] / 3 + STEP_OVERHEAD_S / 4))


def test_the_largest_batch_is_what_the_kv_cache_leaves_room_for():
    for tp, pp in ((8, 1), (4, 2)):
        b = largest_batch(LLAMA70, H100, 4096, tp, pp)
        cache = 4096 * kv_bytes_per_token(LLAMA70, tp)  # each GPU: its layers' cache of pp × b sequences
        assert weight_bytes(LLAMA70, tp, pp) + b * cache <= H100.usable_bytes() < \
            weight_bytes(LLAMA70, tp, pp) + (b + 1) * cache
    assert largest_batch(LLAMA70, H100, 4096, 1, 1) == 0  # 141 GB of weights: no room at all


def test_the_serving_plan_ranks_layouts_by_throughput_under_the_latency_target():
    result = plan("llama3-70b", 8, "h100", context=4096, tpot_s=0.05)
    rows = result["layouts"]
    assert {(r["tp"], r["pp"], r["replicas"]) for r in rows} >= {(8, 1, 1), (4, 2, 1), (1, 1, 8)}
    served = [r for r in rows if r["batch"]]
    assert served and all(r["token_s"] <= 0.05 and r["batch"] <= r["max_batch"] for r in served)
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows), reverse=True)
    whole = next(r for r in rows if r["tp"] == 1 and r["pp"] == 1)
    assert whole["max_batch"] == 0 and whole["tokens_per_s"] == 0  # one GPU cannot hold the weights
    best = served[0]
    assert best["tokens_per_s"] == pytest.approx(best["replicas"] * best["served"]["tokens_per_s"])
    # 262 sequences fit, and meet 100 ms a token, but 6 rows past 256 need one more row of 64-row matmul tiles:
    # 256 makes more tokens a second.
    tp4pp2 = next(r for r in plan("llama3-70b", 8, "h100", context=4096, tpot_s=0.1)["layouts"]
                  if (r["tp"], r["pp"]) == (4, 2))
    assert (tp4pp2["max_batch"], tp4pp2["batch"]) == (262, 256)
    assert serve(LLAMA70, H100, 262, 2048, 2048, tp=4, pp=2)["tokens_per_s"] < tp4pp2["served"]["tokens_per_s"]
    looser = plan("llama3-70b", 8, "h100", context=4096, tpot_s=0.1)["layouts"][0]
    assert looser["tokens_per_s"] >= best["tokens_per_s"]  # a looser target admits bigger batches
    with pytest.raises(ConfigError, match="kv='int3' is not one of"):
        plan("llama3-70b", 8, kv="int3")


def test_a_sequence_is_counted_at_what_it_holds_in_a_paged_cache():
    """2048 tokens in, 2048 out, blocks of 16: a decode step reads 3,072 tokens a sequence on average. Under
    continuous batching a sequence holds on average its mean rounded up to its last block, 3,080 slots (prompt +
    output / 2 + block / 2, where the block divides both), so the plan fits a third more sequences than a
    reservation of the 4,096-token window; a static batch's members all reach 4,096 at its last step."""
    h = held(2048, 2048)
    assert (h["read"], h["slots"], h["window"]) == (3072, 2048 + 1024 + 8, 4096)
    assert held(2048, 2048, "static")["slots"] == 4096 and held(2047, 2048, "static")["slots"] == 4096
    assert held(2000, 7, "continuous", 16)["slots"] == pytest.approx(sum(-(-(2000 + j) // 16) * 16
                                                                         for j in range(1, 8)) / 7)
    rows = {b: {(r["tp"], r["pp"]): r for r in plan("llama3-70b", 8, "h100", 4096, tpot_s=0.1,
                                                    batching=b)["layouts"]} for b in ("continuous", "static")}
    for tp, pp in ((8, 1), (4, 2)):
        assert rows["static"][tp, pp]["max_batch"] == largest_batch(LLAMA70, H100, 4096, tp, pp)
        assert rows["continuous"][tp, pp]["max_batch"] == largest_batch(LLAMA70, H100, 3080, tp, pp) \
            > 1.3 * largest_batch(LLAMA70, H100, 4096, tp, pp)
    with pytest.raises(ConfigError, match="prompt=5000 leaves no room for an answer in the context=4096"):
        plan("llama3-70b", 8, prompt=5000)
    with pytest.raises(ConfigError, match="batching='dynamic' is not one of continuous, static"):
        plan("llama3-70b", 8, batching="dynamic")


def test_a_static_batch_is_timed_at_its_mean_context_with_the_planners_function():
    """TensorRT-LLM's Llama 2 7B on one H100 in FP8, a static batch of 56, 2048 in / 2048 out: 2,826 output tokens/s
    published. serve() — what plan() sizes and times with — gives it within 7 % with every step at the context the
    sequences hold then (its mean, 3,072); timing every step at the whole window of 4,096, as the planner did, was
    25 % off. The published row's modeled value is the same function's."""
    from gpucourse.modeled import serve_published as sp
    from gpucourse.modeled.serve_published import LLAMA2_7B

    run = next(r for r in sp.RUNS if r.name == "Llama 2 7B, H100 fp8, batch 56, 2048/2048")
    served = serve(LLAMA2_7B, H100, 56, 2048, 2048, "static", weights="fp8", kv="fp8")
    assert abs(served["tokens_per_s"] / run.reported - 1) < 0.07 and served["tokens_per_s"] == sp.modeled(run)
    first = prefill(LLAMA2_7B, H100, 56, 2048, weights="fp8")["first_token_s"]
    window = decode_step(LLAMA2_7B, H100, 56, 4096, weights="fp8", kv="fp8")["token_s"]
    assert 56 * 2048 / (first + 2047 * window) / run.reported - 1 < -0.25
    row = plan(LLAMA2_7B, 1, "h100", 4096, tpot_s=1.0, weights="fp8", kv="fp8", batching="static")["layouts"][0]
    assert row["served"] == serve(LLAMA2_7B, H100, row["batch"], 2048, 2048, "static", weights="fp8", kv="fp8")
    assert row["max_batch"] == largest_batch(LLAMA2_7B, H100, 4096, weights="fp8", kv="fp8") >= 56


def test_continuous_batching_feeds_the_arriving_prompts_beside_the_decodes():
    """In the steady state a sequence in ``output`` finishes each step and a new one takes its seat: the step feeds
    batch / output whole prompts beside the other decodes, in one forward, and makes a token a sequence."""
    s = serve(LLAMA70, H100, 64, 1024, 256, tp=8)
    assert s["step"]["tokens_fed"] == pytest.approx(64 - 64 / 256 + 64 / 256 * 1024)
    assert s["step"]["tokens_made"] == pytest.approx(64) and s["prefill_tokens"] == 256
    alone = decode_step(LLAMA70, H100, 64, 1024 + 128, tp=8)["token_s"]
    assert alone < s["token_s"] < alone + prefill(LLAMA70, H100, 1, 1024, tp=8)["first_token_s"] / 4
    assert s["tokens_per_s"] == pytest.approx(64 / s["token_s"])


def test_plan_serve_from_the_command_line(capsys):
    assert main(["plan", "--serve", "--shape", "llama3-8b", "--gpus", "8", "--context", "2048", "--tpot-ms", "30",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "time per output token ≤ 30 ms (modeled" in out and len(out.strip().splitlines()) == 5
    assert "1024 tokens in / 1024 out (2048-token window), continuous batching" in out
    assert "a sequence holds 1,536 tokens on average, 1,544 KV slots paged in blocks of 16" in out
    assert main(["plan", "--serve", "--params", "7e9", "--gpus", "8"]) == 2
    assert "needs --shape" in capsys.readouterr().err
    assert main(["plan", "--serve", "--shape", "llama3-8b", "--gpus", "8", "--prompt", "3000", "--output", "2000"]) == 2
    assert "prompt=3000 and output=2000 leave no room for both in the context=4096" in capsys.readouterr().err
    assert main(["plan", "--serve", "--shape", "llama3-8b", "--gpus", "8", "--prompt", "3000", "--batching", "static",
                 "--top", "1"]) == 0
    assert "3000 tokens in / 1096 out (4096-token window), static batching" in capsys.readouterr().out
    assert main(["plan", "--serve", "--params", "7e9", "--gpus", "8"]) == 2
    assert "needs --shape" in capsys.readouterr().err


def test_memory_serve_from_the_command_line(capsys):
    """gpt2-small's shape at tp 2 in bf16: 2 × 12 layers × 6 heads a rank × 64 × 2 bytes = 18,432 bytes a token."""
    assert main(["memory", "--serve", "--model", "gpt2-small", "--tp", "2", "--seq-len", "1024", "--precision", "bf16",
                 "--budget-gb", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("serving gpt2-small with tp=2") and "(2 × 12 layers × 6 K/V heads × 64 × 2 bytes)" in out
    from gpucourse.modeled.serve_plan import memory
    from gpucourse.modeled.shapes import Shape
    from gpucourse import TrainConfig

    shape = Shape.of_model(TrainConfig(model="gpt2-small").model_config())
    m = memory(shape, 1024, tp=2, budget=16 * 2**30)
    assert m["kv_per_token"] == 18_432 and f"at most {m['largest_batch']} sequences of 1024 tokens" in out
    assert m["weights_per_gpu"] + m["largest_batch"] * 1024 * 18_432 <= 16 * 2**30
    assert main(["memory", "--serve", "--shape", "llama3-70b", "--tp", "3"]) == 2
    assert "tp=3 does not divide the 64 attention heads" in capsys.readouterr().err


def test_plan_serve_prints_the_fastest_layout_as_a_servers_config(capsys):
    best = plan("llama3-70b", 8, "h100", context=4096, tpot_s=0.05)["layouts"][0]
    assert main(["plan", "--serve", "--shape", "llama3-70b", "--gpus", "8", "--print-config", "vllm",
                 "--model-path", "org/m"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve org/m" in out and f"--tensor-parallel-size {best['tp']}" in out
    assert f"--max-num-seqs {best['pp'] * best['batch']}" in out  # pp microbatches in flight
    assert main(["plan", "--serve", "--shape", "llama3-70b", "--gpus", "8", "--print-config", "trtllm"]) == 0
    printed = capsys.readouterr()
    assert "tensor_parallel_size=" in printed.out and "note:" in printed.err
    assert main(["plan", "--serve", "--shape", "llama3-70b", "--gpus", "8", "--print-config", "sglang"]) == 2
    assert "is not one of vllm, trtllm" in capsys.readouterr().err
    assert main(["plan", "--serve", "--shape", "llama3-70b", "--gpus", "1", "--print-config", "vllm"]) == 2
    assert "nothing to print" in capsys.readouterr().err  # 141 GB of weights fit no single H100


MIXTRAL = get_shape("mixtral-8x7b")
A100 = get_gpu("a100")


def test_a_mixture_of_experts_reads_only_the_experts_its_batch_routes_to():
    """Uniform routing: a step of b tokens touches E·(1 − (1 − k/E)^b) of a block's experts — Mixtral's 2 of 8 at
    batch 1, so about its 12.9 B active parameters are read (12.9 GB a GPU in bf16 at tp 2), not all 46.7 B; the
    bytes grow toward every expert as the batch grows."""
    from gpucourse.modeled.serve_plan import experts_touched

    assert experts_touched(MIXTRAL, 1) == pytest.approx(2)
    assert experts_touched(MIXTRAL, 8) == pytest.approx(8 * (1 - 0.75 ** 8))
    assert experts_touched(MIXTRAL, 4, skew=1.0) < experts_touched(MIXTRAL, 4)  # popular experts are shared
    assert experts_touched(LLAMA70, 4) == 0
    one = decode_step(MIXTRAL, A100, 1, 105, tp=2)
    assert one["experts_read"] == pytest.approx(2)
    assert one["bytes_read"] == pytest.approx(MIXTRAL.active_params() * 2 / 2, rel=0.02)
    assert 12.5e9 < one["bytes_read"] < 13.5e9 < weight_bytes(MIXTRAL, 2) / 3
    read = [decode_step(MIXTRAL, A100, b, 105, tp=2)["bytes_read"] for b in (1, 2, 4, 8, 16, 64)]
    assert read == sorted(read)
    assert read[-1] == pytest.approx(weight_bytes(MIXTRAL, 2), rel=0.01)  # 64 tokens reach every expert
    assert decode_step(MIXTRAL, A100, 1, 105, tp=2)["token_s"] < 0.4 * decode_step(MIXTRAL, A100, 64, 105,
                                                                                    tp=2)["token_s"]


def test_expert_parallelism_pays_three_all_to_alls_a_block_at_decode_sizes():
    """ep groups each serve their own sequences; a MoE block all-to-alls the E counts, then every token choice's
    hidden vector there and back: a few kB, so each costs its ep − 1 latencies."""
    cluster = Cluster.of(H100)
    step = decode_step(MIXTRAL, H100, 4, 1024, ep=8)
    counts = cluster.collective_s("all_to_all", 8 * 8, range(8))[0]
    choices = cluster.collective_s("all_to_all", 4 * 2 * 4096 * 2, range(8))[0]
    assert step["ep_comm_s"] == pytest.approx(32 * (counts + 2 * choices))
    assert choices < 1.1 * 7 * H100.intra_node_latency_us * 1e-6
    assert step["experts_read"] == pytest.approx(1 - 0.75 ** 32)  # one expert a GPU, touched by all 32 tokens
    assert step["tokens_per_s"] == pytest.approx(8 * 4 / step["token_s"])
    with pytest.raises(ConfigError, match="ep=3 must divide the model's 8 experts"):
        decode_step(MIXTRAL, H100, 1, 1024, ep=3)
    with pytest.raises(ConfigError, match="this model has none"):
        decode_step(LLAMA70, H100, 1, 1024, tp=8, ep=2)


def test_a_batch_one_gemv_is_memory_bound():
    """A 1-row matmul reads its weights once over the bandwidth a streaming kernel reaches: Llama 2 7B's qkv on an
    A100 at tp 1 and 8 within 10 % of its bytes over that bandwidth (the tile model charged a 64-row tile on each SM:
    34 µs at tp 8 against 7 µs of bytes)."""
    from gpucourse.modeled.cluster import LAUNCH_S
    from gpucourse.modeled.serve_published import LLAMA2_7B

    cluster = Cluster.of(A100)
    for tp in (1, 8):
        qkv = next(k for k in LLAMA2_7B.kernels(1, 1, tp) if k.get("name") == "qkv")
        bytes_s = (qkv["m"] * qkv["k"] + qkv["k"] * qkv["n"] + qkv["m"] * qkv["n"]) * 2 / cluster.hbm_Bps
        assert cluster.skinny_gemm_s(qkv["m"], qkv["n"], qkv["k"]) - LAUNCH_S == pytest.approx(bytes_s, rel=0.10)
    assert cluster.gemm_s(qkv["m"], qkv["n"], qkv["k"]) > 3 * bytes_s
    step = decode_step(LLAMA2_7B, A100, 1, 105)
    kernels = 32 * 5 + 1  # a block's qkv, out, up, down and element-wise work; the head
    floor = (weight_bytes(LLAMA2_7B) - LLAMA2_7B.vocab * LLAMA2_7B.hidden * 2) / cluster.hbm_Bps  # the embedding's
    assert floor < step["matmul_s"] - kernels * LAUNCH_S < 1.02 * floor                       # one row is not read


def test_batch_one_decode_scales_with_tp_and_with_the_memory_bandwidth():
    """gpt-fast's Llama 2 70B on A100s at batch 1 is 2.93× faster at tp 8 than at tp 2 (the tile model gave 2.22×);
    an H200 reads 1.43× faster than an H100 (the tile model gave Llama 2 70B at tp 8 1.12×)."""
    tp = {n: decode_step("llama2-70b", A100, 1, 105, tp=n)["token_s"] for n in (2, 8)}
    assert 2.6 < tp[2] / tp[8] < 2.93
    h200 = get_gpu("h200")
    assert h200.hbm_GBps / H100.hbm_GBps == pytest.approx(1.43, abs=0.01)
    big = decode_step("llama2-70b", H100, 1, 2048, tp=8)["token_s"] / decode_step("llama2-70b", h200, 1, 2048,
                                                                                   tp=8)["token_s"]
    small = decode_step("llama3-8b", H100, 1, 2048)["token_s"] / decode_step("llama3-8b", h200, 1, 2048)["token_s"]
    assert 1.15 < big < small < 1.43


def test_weight_only_int4_speeds_decode_and_not_prefill():
    """W4A16, as vLLM's Marlin and AWQ kernels run it: the weights are read at half a byte and their fp16 scales (one
    a group of 128), widened to bf16 in the kernel and multiplied in bf16. Llama 3 8B on an H100: a batch-1 step
    reads 5.7 GB instead of 16.1 and takes about half as long (what the engine spends besides its kernels and the
    KV reads do not shrink); a prefill of 2048 tokens is bf16's arithmetic either way, no faster."""
    from gpucourse.modeled.cluster import LAUNCH_S
    from gpucourse.modeled.serve_plan import WEIGHTS, _other_params

    s = get_shape("llama3-8b")
    step = {w: decode_step(s, H100, 1, 4096, weights=w)["token_s"] for w in ("bf16", "int8", "int4")}
    assert step["int4"] < step["int8"] < step["bf16"] and step["int4"] < 0.55 * step["bf16"]
    first = {w: prefill(s, H100, 1, 2048, weights=w)["first_token_s"] for w in ("bf16", "int8", "int4")}
    assert first["int4"] >= 0.999 * first["bf16"] and first["int8"] >= 0.999 * first["bf16"]
    assert WEIGHTS["int4"].bytes(4096) == 0.5 + 2 / 128 and WEIGHTS["int8"].bytes(4096) == 1 + 2 / 4096
    rest = _other_params(s, 1, 0, 1)  # embedding, head and norms: kept in bf16, as AWQ's and GPTQ's checkpoints are
    assert rest == 2 * s.vocab * s.hidden + (2 * s.layers + 1) * s.hidden
    assert weight_bytes(s, weights="int4") == pytest.approx((s.params() - rest) * (0.5 + 2 / 128) + 2 * rest)
    assert 5.6e9 < weight_bytes(s, weights="int4") < 5.8e9
    # A GEMV of INT4 weights costs their bytes and their scales' over the bandwidth, its activations in bf16.
    cluster = Cluster.of(H100)
    gemv = cluster.skinny_gemm_s(1, 4096, 4096, "bf16", weight_elem=0.5 + 2 / 128, activation_elem=2)
    assert gemv == pytest.approx((4096 * 4096 * (0.5 + 2 / 128) + 2 * 4096 * 2) / cluster.hbm_Bps + LAUNCH_S)
    # At 64 sequences an A100 reaches bf16's arithmetic before INT4's bytes: no gain left over INT8.
    a100 = {w: decode_step(s, A100, 64, 4096, weights=w)["matmul_s"] for w in ("int8", "int4")}
    assert a100["int4"] == pytest.approx(a100["int8"], rel=0.01)


def test_fp8_weights_multiply_in_fp8_only_where_the_gpu_does_and_the_plan_says_so(capsys):
    """Compute capability 8.9 on (L4, H100, H200, B200) multiplies FP8: W8A8. An A100 (8.0) runs FP8 weights
    weight-only, W8A16: half bf16's bytes, bf16's arithmetic, and its prefill is no faster; one sentence says so."""
    from gpucourse.modeled.serve_plan import weight_format, weights_note

    assert {g: get_gpu(g).compute_capability for g in ("a100", "l4", "h100", "h200", "b200")} == \
        {"a100": 8.0, "l4": 8.9, "h100": 9.0, "h200": 9.0, "b200": 10.0}
    assert [weight_format("fp8", g).scheme for g in ("l4", "h100", "b200", "a100")] == ["W8A8"] * 3 + ["W8A16"]
    assert weight_format("fp8", "a100").multiply == "bf16" and weights_note("fp8", "h100") is None
    said = ("fp8 weights on the a100 (compute capability 8.0) run weight-only, W8A16: its tensor cores do not "
            "multiply FP8, so each matmul widens the weights to bf16 — half bf16's bytes read, bf16's arithmetic.")
    assert weights_note("fp8", "a100") == said and plan("llama3-8b", 2, "a100", weights="fp8")["notes"] == [said]
    s = get_shape("llama3-8b")
    first = {w: prefill(s, A100, 1, 2048, weights=w)["first_token_s"] for w in ("bf16", "fp8")}
    assert abs(first["fp8"] / first["bf16"] - 1) < 0.01
    assert decode_step(s, A100, 1, 4096, weights="fp8")["token_s"] < 0.7 * decode_step(s, A100, 1, 4096)["token_s"]
    assert main(["plan", "--serve", "--shape", "llama3-8b", "--gpus", "2", "--gpu", "a100", "--precision", "fp8",
                 "--top", "1"]) == 0
    assert "note: fp8 weights on the a100 (compute capability 8.0) run weight-only, W8A16" in capsys.readouterr().out


def test_an_unknown_weight_format_is_said_in_one_sentence(capsys):
    with pytest.raises(ConfigError) as e:
        plan("llama3-8b", 8, weights="int3")
    assert str(e.value) == "weights='int3' is not one of fp32, bf16, fp8, int8, int4 (did you mean int8 or int4?)."
    assert main(["plan", "--serve", "--shape", "llama3-8b", "--gpus", "8", "--precision", "nf4"]) == 2
    err = capsys.readouterr().err
    assert "--precision 'nf4' is not one of bf16, fp8, fp32, int8, int4" in err and err.count("\n") == 1
    assert main(["plan", "--params", "7e9", "--gpus", "8", "--precision", "int4"]) == 2
    assert "--precision int4 stores a served model's weights (plan --serve)" in capsys.readouterr().err
    assert main(["memory", "--serve", "--shape", "llama3-8b", "--precision", "int4"]) == 0
    assert "weights int4" in capsys.readouterr().out


def test_serve_benchs_clock_and_the_serving_model_are_one_step_function():
    """serve-bench's modeled clock times an iteration with serve_plan.step on the iteration's own sequences: the
    decodes (each reading what it has cached and its new token) and the prompt chunks in one forward. Thirty-two
    decodes of Llama 2 7B on an H100 cost what decode_step says (the clock of before charged 4.0 ms where the model
    said 7.25); a prompt chunk with decodes riding along costs less than the two steps apart."""
    from gpucourse.modeled.serve_plan import Chunk, step
    from gpucourse.modeled.serve_published import LLAMA2_7B
    from gpucourse.modeled.serve_clock import ModeledClock
    from gpucourse.serving import BlockAllocator, Request, Scheduler

    clock, sched = ModeledClock(), Scheduler(BlockAllocator(4096, 16), token_budget=512)
    for i in range(32):
        sched.add(Request(i, 0.0, tuple(range(100 + i)), max_new_tokens=50))
    for _ in range(8):  # the prompts in chunks of the budget, then decodes
        for seq, n in sched.schedule():
            sched.advance(seq, n, 7 if seq.cached + n == len(seq.tokens) else None, 0.0)
    decodes = sched.schedule()
    assert all(n == 1 for _, n in decodes) and len(decodes) == 32
    context = sum(seq.cached + 1 for seq, _ in decodes) / 32
    assert clock.seconds(decodes) == decode_step(LLAMA2_7B, H100, 32, context)["token_s"]
    for seq, n in decodes:
        sched.advance(seq, n, 7, 0.0)
    sched.add(Request(99, 0.0, tuple(range(2000)), max_new_tokens=4))
    mixed = sched.schedule()
    chunk = [(seq, n) for seq, n in mixed if seq.request.id == 99]
    assert len(mixed) == 33 and chunk[0][1] == 512 - 32
    want = step(LLAMA2_7B, H100, 32, sum(seq.cached + 1 for seq, n in mixed if n == 1) / 32,
                [Chunk(480, 0, 1, False)])
    assert clock.step(mixed) == want and clock.seconds(mixed) == want["seconds"]
    apart = clock.seconds([m for m in mixed if m not in chunk]) + clock.seconds(chunk)
    assert clock.seconds(mixed) < apart - 0.8 * STEP_OVERHEAD_S


def test_eight_chunks_cost_one_prefill_and_what_chunking_adds():
    """A 2048-token prompt alone under a budget of 256 tokens: 8 iterations on the modeled clock. They cost one
    prefill of 2048 (58.9 ms for Llama 2 7B on an H100), the engine's overhead of 7 more steps, and what the model's
    kernels charge a chunk of 256: matmuls of 256 rows and a chunk's attention fill fewer of the SMs, and each chunk
    reads the chunks before it — together under a quarter of the prefill. The clock of before charged 1.64 times."""
    from gpucourse.modeled.serve_plan import Chunk, step
    from gpucourse.modeled.serve_published import LLAMA2_7B
    from gpucourse.modeled.serve_clock import ModeledClock, simulate
    from gpucourse.serving import Request

    report = simulate([Request(0, 0.0, tuple(range(2048)), max_new_tokens=1)], 256, 16, token_budget=256)
    chunks = [it.seconds for it in report.iterations]
    assert len(chunks) == 8 and ModeledClock().shape is None
    assert chunks == [step(LLAMA2_7B, H100, chunks=[Chunk(256, 256 * i, 1, i == 7)])["seconds"] for i in range(8)]
    whole = prefill(LLAMA2_7B, H100, 1, 2048)["first_token_s"]
    added = sum(chunks) - 7 * STEP_OVERHEAD_S - whole
    assert round(whole * 1e3, 1) == 58.9 and 0 < added < 0.25 * whole and sum(chunks) / whole < 1.4


def test_continuous_batching_under_a_token_budget(capsys):
    """A step feeds at most the budget, the decodes first: a prompt is fed in chunks of what they leave, and a batch
    whose decodes and prompts need more than the budget a step is refused, saying how many keep up; the plan holds
    no more, and prints the budget as vLLM's max_num_batched_tokens."""
    from gpucourse.modeled.serve_plan import budget_batch

    free = serve(LLAMA70, H100, 64, 2048, 512, tp=8)
    chunked = serve(LLAMA70, H100, 64, 2048, 512, tp=8, token_budget=512)
    assert chunked["chunk"] == pytest.approx(512 - 64 * (1 - 1 / 512)) and free["chunk"] == 2048
    assert chunked["step"]["tokens_fed"] == pytest.approx(free["step"]["tokens_fed"])
    assert free["step"]["tokens_fed"] <= 512
    assert free["token_s"] < chunked["token_s"] < 1.05 * free["token_s"]
    assert budget_batch(2048, 512, 512) == int(512 / (1 - 1 / 512 + 4)) == 102
    with pytest.raises(ConfigError, match="more than the token budget of 512; at most 102 sequences keep up"):
        serve(LLAMA70, H100, 103, 2048, 512, tp=8, token_budget=512)
    with pytest.raises(ConfigError, match="static batching feeds whole prompts"):
        plan("llama3-70b", 8, batching="static", token_budget=512)
    rows = plan("llama3-70b", 8, prompt=2048, output=512, tpot_s=0.2, token_budget=512)["layouts"]
    assert max(r["max_batch"] for r in rows) == 102
    assert main(["plan", "--serve", "--shape", "llama3-70b", "--gpus", "8", "--token-budget", "2048",
                 "--print-config", "vllm"]) == 0
    assert "--max-num-batched-tokens 2048" in capsys.readouterr().out
