"""Serving on modeled GPUs: prefill compute-bound, decode memory-bound, the KV cache's bytes, and layouts ranked.

Pure arithmetic on the cluster model (no launches)."""

from __future__ import annotations

import pytest

from gpucourse import ConfigError
from gpucourse.cli import main
from gpucourse.modeled.cluster import Cluster
from gpucourse.modeled.gpus import get_gpu
from gpucourse.modeled.serve_plan import (decode_step, kv_bytes_per_token, largest_batch, plan, prefill, ridge_point,
                                  weight_bytes)
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
    assert best["tokens_per_s"] == pytest.approx(best["replicas"] * best["step"]["tokens_per_s"])
    # 197 sequences fit, and meet 100 ms a token, but 5 rows past 192 need one more row of 64-row matmul tiles:
    # 192 makes more tokens a second.
    tp4pp2 = next(r for r in plan("llama3-70b", 8, "h100", context=4096, tpot_s=0.1)["layouts"]
                  if (r["tp"], r["pp"]) == (4, 2))
    assert (tp4pp2["max_batch"], tp4pp2["batch"]) == (197, 192)
    assert decode_step(LLAMA70, H100, 197, 4096, 4, 2)["tokens_per_s"] < tp4pp2["step"]["tokens_per_s"]
    looser = plan("llama3-70b", 8, "h100", context=4096, tpot_s=0.1)["layouts"][0]
    assert looser["tokens_per_s"] >= best["tokens_per_s"]  # a looser target admits bigger batches
    with pytest.raises(ConfigError, match="kv='int3' is not one of"):
        plan("llama3-70b", 8, kv="int3")


def test_plan_serve_from_the_command_line(capsys):
    assert main(["plan", "--serve", "--shape", "llama3-8b", "--gpus", "8", "--context", "2048", "--tpot-ms", "30",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "time per output token ≤ 30 ms (modeled" in out and len(out.strip().splitlines()) == 4
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
