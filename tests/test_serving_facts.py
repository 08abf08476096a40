"""Every figure notebook 14 (serving) and its questions state, recomputed with the course's own functions: the KV
cache's bytes, the roofline's ridge and intensities, the modeled decode and prefill times, the schedulers on the
bench's trace, paged slots, chunked prefill's chunks, parallel decode's all-reduces and GQA's replicated heads,
quantized bytes, and the sizing of a deployment; and those of notebook 15's questions (inference optimisations):
speculative decoding's tokens per pass, prefix caching's block keys and eviction order, split-KV attention's thread
blocks, the KV transfer of disaggregated serving, SmoothQuant's scales and block-scaled formats' bytes. The questions
are also held to the bank's rules against guessing."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch

from gpucourse import quiz
from gpucourse.modeled import serve_plan
from gpucourse.comm import RING_FACTOR
from gpucourse.modeled.gpus import RESERVED_BYTES, get_gpu
from gpucourse.model import MODELS, build_model
from gpucourse.modeled.serve_clock import ModeledClock, simulate
from gpucourse.serving import BlockAllocator, Request, Scheduler, Sequence, generate, poisson_trace
from gpucourse.serving.metrics import Report
from gpucourse.serving.parallel_decode import Layout, kv_heads_per_rank, step_bytes
from gpucourse.serving.quantize import stored_bytes
from gpucourse.modeled.shapes import get_shape
from procs import REPO

NOTEBOOK = "14_serving"
QS = quiz.load_bank(notebook=NOTEBOOK)
INFERENCE = quiz.load_bank(notebook="15_inference_optimization")
BY_ID = {q["id"]: q for q in QS + INFERENCE}
KiB, MiB, GiB = 2**10, 2**20, 2**30
H100 = get_gpu("h100")


def right(qid: str) -> str:
    q = BY_ID[qid]
    return q["choices"][q["answer"]]


def choices(qid: str) -> list[str]:
    return BY_ID[qid]["choices"]


def notebook(kind: str = "markdown") -> str:
    nb = json.loads((REPO / "notebooks" / f"{NOTEBOOK}.ipynb").read_text(encoding="utf-8"))
    return " ".join(" ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind).split())


def bench_trace(requests: int = 160):
    from gpucourse.bench.serving_figures import BLOCK_SIZE, NUM_BLOCKS, TRACE

    trace = poisson_trace(requests, **TRACE)
    return {name: simulate(trace, NUM_BLOCKS, BLOCK_SIZE, static=name == "static") for name in ("continuous", "static")}


# --- the KV cache --------------------------------------------------------------------------------------------------

def test_kv_cache_bytes_per_token_and_sequence():
    s = get_shape("llama3-70b")
    assert (s.layers, s.heads, s.kv, s.head_dim) == (80, 64, 8, 128)
    per_token = serve_plan.kv_bytes_per_token(s)
    assert per_token == 2 * 80 * 8 * 128 * 2 == 327_680 == 320 * KiB
    assert 4096 * per_token == 1.25 * GiB
    # The distractors: keys only, all 64 heads, fp32.
    assert (per_token / 2, 4096 * per_token / 2) == (160 * KiB, 0.625 * GiB)
    assert (per_token * 8, 4096 * per_token * 8) == (2.5 * MiB, 10 * GiB)
    assert (per_token * 2, 4096 * per_token * 2) == (640 * KiB, 2.5 * GiB)
    assert right("srv-kv-bytes-70b") == "320 KiB a token, 1.25 GiB a sequence"
    # "About a hundred such sequences hold as much as the weights" (140 GB; 138 GB for Llama 2 70B, the notebook's).
    for name in ("llama3-70b", "llama2-70b"):
        assert 95 <= serve_plan.weight_bytes(get_shape(name)) / (4096 * per_token) <= 110
    assert round(serve_plan.weight_bytes(s) / 1e9) == 141
    # The notebook's table: Llama 3 8B 128 KiB a token, 0.5 GiB a 4096-token sequence; 405B 504 KiB.
    assert serve_plan.kv_bytes_per_token(get_shape("llama3-8b")) == 128 * KiB
    assert serve_plan.kv_bytes_per_token(get_shape("llama3-405b")) == 504 * KiB
    assert "about a hundred of them hold as much as the weights" in notebook()


def test_the_largest_batch_of_llama3_8b_on_one_h100():
    s = get_shape("llama3-8b")
    usable = 80 * GiB - 2 * GiB
    assert RESERVED_BYTES == 2 * GiB and H100.usable_bytes() == usable
    weights = serve_plan.weight_bytes(s)
    assert round(weights / 1e9, 1) == 16.1 and round(usable / 1e9, 2) == 83.75
    seq = 4096 * 2 * 32 * 8 * 128 * 2
    assert seq == 512 * MiB and round((usable - weights) / 1e9, 1) == 67.7
    assert serve_plan.largest_batch(s, H100, 4096) == (usable - weights) // seq == 126
    assert usable // seq == 156 and (usable - weights) // (2 * seq) == 63 and (usable - weights) // (4 * seq) == 31
    assert right("srv-max-batch-8b") == "126 sequences"
    assert set(choices("srv-max-batch-8b")) == {f"{n} sequences" for n in (126, 156, 63, 31)}


def count_positions(model, prompt_len: int, new: int, use_cache: bool) -> int:
    """Token positions the model is run on to generate ``new`` tokens after a prompt, counted by a forward hook."""
    fed = []
    hook = model.register_forward_pre_hook(lambda m, args: fed.append(args[0].numel()))
    try:
        generate(model, [list(range(prompt_len))], new, use_cache=use_cache)
    finally:
        hook.remove()
    return sum(fed)


def test_what_the_cache_saves_in_positions_fed():
    model = build_model(MODELS["tiny"], 0)
    for p, n in ((16, 8), (32, 20)):
        assert count_positions(model, p, n, True) == p + n - 1
        assert count_positions(model, p, n, False) == sum(p + k for k in range(n))
    # srv-kv-cache-cost: 1,024 + 255 against 256 × 1,024 + 255 × 256 / 2.
    assert 1024 + 256 - 1 == 1279 and sum(1024 + k for k in range(256)) == 294_784
    assert 256 * 1280 == 327_680 and 256 * 1024 == 262_144
    assert right("srv-kv-cache-cost") == "1,279 against 294,784"
    # The notebook: P + N − 1 against about N·(P + N/2).
    text = notebook()
    assert "P + N − 1 token-forwards with the cache against about N·(P + N/2)" in text


# --- the roofline and the batch ------------------------------------------------------------------------------------

def test_decode_is_memory_bound_and_prefill_compute_bound():
    s = get_shape("llama3-8b")
    ridge = serve_plan.ridge_point(H100)
    assert round(ridge) == 295 and H100.peak_flops("bf16") == 989e12 and H100.hbm_GBps == 3350
    one = serve_plan.decode_step(s, H100, 1, 4096)
    assert 0.9 < one["intensity"] < 1.2
    # A GPU with twice the FLOP/s and the same bandwidth: the step hardly moves.
    faster = dataclasses.replace(H100, peak_bf16_flops=2 * H100.peak_bf16_flops)
    assert serve_plan.decode_step(s, faster, 1, 4096)["token_s"] > 0.9 * one["token_s"]
    floor = serve_plan.weight_bytes(s) / (H100.hbm_GBps * 1e9)
    assert round(floor * 1e3, 1) == 4.8
    assert "barely change" in right("srv-decode-memory-bound") and "16 GB" in right("srv-decode-memory-bound")
    # The notebook's points: decode under the ridge up to batch 256, prefill above it from 512 tokens.
    assert all(serve_plan.decode_step(s, H100, b, 4096)["intensity"] < 35 for b in (1, 8, 64, 256))
    assert serve_plan.prefill(s, H100, 1, 512)["intensity"] > ridge
    two_k = serve_plan.prefill(s, H100, 1, 2048)
    assert 1800 < two_k["intensity"] < 2100
    # Each sequence at 4096 tokens reads 512 MiB of keys and values a step.
    assert 4096 * serve_plan.kv_bytes_per_token(s) == 512 * MiB
    assert "about 295 FLOPs a byte" in notebook() and "989 TFLOP/s of bf16 over 3.35 TB/s" in notebook()


def test_doubling_prefill_and_decode():
    s = get_shape("llama3-8b")
    p2, p4 = (serve_plan.prefill(s, H100, 1, n)["first_token_s"] for n in (2048, 4096))
    d8, d16 = (serve_plan.decode_step(s, H100, b, 4096)["token_s"] for b in (8, 16))
    assert 1.9 < p4 / p2 < 2.1
    assert 1.1 < d16 / d8 < 1.2  # "under a fifth"; the choice says "well under a third"
    assert right("srv-prefill-vs-decode-batch").startswith("prefill roughly doubles")


def test_what_a_batch_of_64_does():
    s = get_shape("llama3-8b")
    one, many = (serve_plan.decode_step(s, H100, b, 4096) for b in (1, 64))
    assert many["tokens_per_s"] / one["tokens_per_s"] > 20 and many["token_s"] / one["token_s"] < 3
    assert 0.55 < many["attention_s"] / many["token_s"] < 0.68 and 20 < many["intensity"] < 26  # about 60 %
    assert many["intensity"] < serve_plan.ridge_point(H100)
    q = BY_ID["srv-batch-effects"]
    picked = {q["choices"][i] for i in q["answer"]}
    assert any("over 20 times" in c and "under 3 times" in c for c in picked)
    assert not any("crosses the ridge" in c or "falls" in c for c in picked)


def test_the_single_stream_ceiling():
    s = get_shape("llama3-8b")
    floor = serve_plan.weight_bytes(s) / (H100.hbm_GBps * 1e9)
    assert round(1 / floor) == 209  # "about 210 tokens/s"
    assert 1 / (floor / 2) > 400    # FP8 weights: about 2.4 ms, over 400 tokens/s
    assert round(floor / 2 * 1e3, 1) == 2.4
    assert right("srv-tpot-floor").startswith("about 210 tokens/s; FP8 or INT4")
    # FP8 halves the read, but the modeled step (its kernels and what the engine spends besides them) falls by
    # about a third, to about 205 tokens/s: what notebook 14 prints, and short of the 300 the question asks for.
    step = {w: serve_plan.decode_step(s, H100, 1, 4096, weights=w) for w in ("bf16", "fp8")}
    assert step["fp8"]["bytes_read"] < 0.52 * step["bf16"]["bytes_read"]
    assert 0.28 < 1 - step["fp8"]["token_s"] / step["bf16"]["token_s"] < 0.42
    assert round(step["fp8"]["tokens_per_s"]) == 205 < 300
    q = BY_ID["srv-tpot-floor"]
    assert "what raises that ceiling?" in q["question"] and "what could reach the target" not in q["question"]
    assert "FP8 weights halve the read (about 2.4 ms, a ceiling over 400 tokens/s)" in q["explanation"]
    assert "FP8 weights cut the batch-1 step by about a third, to about 205 tokens/s" in q["explanation"]


# --- continuous batching, its metrics, paging, preemption, chunked prefill -----------------------------------------

def test_continuous_against_static_on_the_bench_trace():
    runs = bench_trace()
    cont, stat = runs["continuous"].throughput(), runs["static"].throughput()
    assert round(stat, -1) == 760 and round(cont, -2) == 1900 and round(cont / stat, 1) == 2.5
    assert "2.5 times" in BY_ID["srv-continuous-static"]["explanation"]
    assert "about 760 tokens/s; continuous batching about 1,900" in BY_ID["srv-continuous-static"]["question"]
    assert "refills a finished sequence's seat" in right("srv-continuous-static")
    assert runs["static"].summary(2.0, 0.05)["preemptions"] == 0  # static reserves the maximum: never preempts


@pytest.mark.parametrize("requests", [60, 160])  # the notebook's short and full runs
def test_what_the_notebook_says_of_the_trace(requests):
    from gpucourse.bench.serving_figures import BLOCK_SIZE, NUM_BLOCKS, TARGETS, TRACE

    runs = bench_trace(requests)
    c, s = (runs[k].summary(**TARGETS) for k in ("continuous", "static"))
    assert s["tpot_median_s"] < c["tpot_median_s"]                      # static's streams are smoothest
    assert s["ttft_median_s"] > 2 and s["goodput_req_s"] < c["goodput_req_s"] / 3
    assert 0.35 < s["throughput_tok_s"] / c["throughput_tok_s"] < 0.5    # "falls by more than half"
    reserved = max(sum(it.longest) for it in runs["continuous"].iterations)
    assert reserved > 2 * NUM_BLOCKS * BLOCK_SIZE                        # fewer than half would have fit
    waste = runs["continuous"].kv_waste()
    assert waste["paged_waste"] < 0.04 and 0.4 < waste["max_length_waste"] < 0.45
    chunked = simulate(poisson_trace(requests, **TRACE), NUM_BLOCKS, BLOCK_SIZE, token_budget=256)
    whole = runs["continuous"]
    assert max(it.seconds for it in chunked.iterations) < max(it.seconds for it in whole.iterations) / 3
    assert abs(chunked.summary(**TARGETS)["ttft_median_s"] / c["ttft_median_s"] - 1) < 0.05  # hardly moves
    text = notebook()
    assert "goodput collapses and throughput falls by more than half" in text
    assert "the median time to first token hardly moves" in text


def test_the_modeled_clock_is_the_serving_models_step():
    """Notebook 14's modeled clock is serve_plan.step for Llama 2 7B in bf16 on one H100: a step of one decode 6.7 ms,
    most of it the 13.5 GB of weights read; fifty decodes at 200 cached tokens 8.7 ms, each cached token 512 KiB of
    keys and values; a 256-token prompt 9.8 ms."""
    from gpucourse.modeled.serve_published import LLAMA2_7B

    assert ModeledClock().shape is None and ModeledClock()._shape() == LLAMA2_7B
    one, fifty = (serve_plan.decode_step(LLAMA2_7B, H100, b, 200)["token_s"] for b in (1, 50))
    prompt = serve_plan.prefill(LLAMA2_7B, H100, 1, 256)["first_token_s"]
    assert (round(one * 1e3, 1), round(fifty * 1e3, 1), round(prompt * 1e3, 1)) == (6.7, 8.7, 9.8)
    assert round(serve_plan.weight_bytes(LLAMA2_7B) / 1e9, 1) == 13.5 and serve_plan.kv_bytes_per_token(LLAMA2_7B) \
        == 512 * KiB
    floor = serve_plan.weight_bytes(LLAMA2_7B) / (H100.hbm_GBps * 1e9 * H100.hbm_efficiency)
    assert 0.6 < floor / one < 0.75  # most of the step: the weights' read
    text = notebook()
    assert ("A step of one decode takes 6.7 ms, most of it reading the 13.5 GB of weights; fifty decodes at 200 "
            "cached tokens each take 8.7 ms, each cached token's 512 KiB of keys and values read too; a 256-token "
            "prompt, 9.8 ms") in text
    assert "The clock is `ModeledClock`: each iteration timed by the serving model's own step function" in text


def report_of(times: list[tuple[float, float, float, int]]) -> Report:
    """A report of finished requests, each (arrival, first token, last token, tokens generated)."""
    seqs = []
    for i, (arrival, first, last, n) in enumerate(times):
        seq = Sequence(Request(i, arrival, (1,), n), [1] + [2] * n, first_token_s=first, finish_s=last)
        seqs.append(seq)
    return Report(seqs, [], 16)


def test_ttft_and_tpot_of_one_request():
    r = report_of([(0.0, 0.5, 2.5, 101)])
    assert r.ttft_s() == [0.5] and r.tpot_s()[0] == pytest.approx(0.020)
    assert 2.5 / 100 == 0.025 and (2.5 - 0.3) / 100 == pytest.approx(0.022) and 0.5 - 0.3 == pytest.approx(0.2)
    assert right("srv-ttft-tpot") == "TTFT 0.5 s, TPOT 20 ms"


def test_goodput_counts_requests_that_met_both_targets():
    def config(good: int) -> Report:
        # 200 requests over 10 s; ``good`` meet both targets, the rest miss TTFT.
        return report_of([(0.0, 1.0 if i < good else 3.0, 10.0, 301) for i in range(200)])

    a, b = config(170), config(120)
    assert a.span_s() == b.span_s() == 10
    assert a.goodput(2.0, 0.05) == 17 and b.goodput(2.0, 0.05) == 12
    assert round(3400 / 3000 - 1, 2) == 0.13
    assert right("srv-goodput").startswith("A, by goodput: 17 requests/s")


def test_paged_slots_against_reservation():
    blocks = BlockAllocator(num_blocks=200, block_size=16)
    blocks.grow("seq", 1000)
    assert blocks.used() == 63 and blocks.used() * 16 == 1008 and 1008 - 1000 == 8
    assert 200 + 2048 == 2248 and 2248 - 1000 == 1248
    assert right("srv-paged-slots") == "1,008 slots against 2,248"


def test_preemption_frees_blocks_and_keeps_the_generated_tokens():
    blocks = BlockAllocator(num_blocks=4, block_size=4)
    sched = Scheduler(blocks)
    for i in range(2):
        sched.add(Request(i, 0.0, (1, 2, 3), max_new_tokens=8))
    work = sched.schedule()
    assert [n for _, n in work] == [3, 3]
    for seq, n in work:
        sched.advance(seq, n, 9, 0.1)                       # each made its first token
    for _ in range(10):                                     # decode until the 4 blocks run out
        if sched.waiting:
            break
        for seq, n in sched.schedule():
            sched.advance(seq, n, 9, 0.2)
    young = sched.waiting[0] if sched.waiting else None
    assert young is not None and young.preemptions == 1 and young.cached == 0
    assert young.generated >= 1 and young.tokens[:3] == [1, 2, 3]  # its generated tokens are kept
    assert young.request.id not in blocks.tables                   # its blocks were freed
    # Readmitted, it prefills its prompt and what it had generated, all at once.
    while sched.running:
        for seq, n in sched.schedule():
            if seq is young:
                assert n == len(young.tokens)
            sched.advance(seq, n, 9 if seq.cached + n == len(seq.tokens) else None, 0.3)
    q = BY_ID["srv-preemption"]
    picked = {q["choices"][i] for i in q["answer"]}
    assert any("freed" in c for c in picked) and any("prefills its prompt and the tokens" in c for c in picked)
    assert not any("lost" in c or "CPU" in c for c in picked)


def test_chunked_prefill_chunks():
    sched = Scheduler(BlockAllocator(num_blocks=2000, block_size=16), token_budget=512)
    for i in range(50):
        sched.add(Request(i, 0.0, (1,), max_new_tokens=100))
    for seq, n in sched.schedule():
        sched.advance(seq, n, 2, 0.0)                       # 50 sequences now decode one token a step
    sched.add(Request(50, 0.0, tuple([1] * 8000), max_new_tokens=1))
    chunks = []
    while not any(seq.request.id == 50 and seq.first_token_s is not None for seq in sched.finished + sched.running):
        work = sched.schedule()
        assert sum(n for _, n in work) <= 512
        for seq, n in work:
            if seq.request.id == 50:
                chunks.append(n)
            sched.advance(seq, n, 2 if seq.cached + n == len(seq.tokens) else None, 0.0)
    assert chunks[:-1] == [462] * 17 and chunks[-1] == 146 and len(chunks) == math.ceil(8000 / 462) == 18
    assert sum(chunks) == 8000 and 17 * 462 == 7854
    assert right("srv-chunked-prefill") == "462 tokens an iteration, 18 iterations"


# --- parallel serving -----------------------------------------------------------------------------------------------

def test_tensor_parallel_all_reduces_per_token():
    cfg = MODELS["tiny"]
    for n in (2, 4):
        per_reduce = RING_FACTOR["all_reduce"](n) * n * 16 * cfg.n_embd * 2  # what all ranks send, batch 16, bf16
        assert step_bytes(Layout("tp", n), cfg, 16, elem=2) == 2 * cfg.n_layer * per_reduce  # 2 a block
    assert 2 * 80 == 160 and 16 * 8192 * 2 == 256 * KiB and 80 * 256 * KiB == 20 * MiB and 256 // 8 == 32
    assert right("srv-tp-allreduce") == "160 all-reduces of 256 KiB: after attention and its MLP"


def test_tp_against_pp_latency_for_one_stream():
    s = get_shape("llama2-70b")
    tp8 = serve_plan.decode_step(s, H100, 1, 4096, tp=8)
    pp8 = serve_plan.decode_step(s, H100, 1, 4096, pp=8)
    one = serve_plan.decode_step(s, H100, 1, 4096)
    assert 3.3 < pp8["token_s"] / tp8["token_s"] < 4.5  # "about 4 times A's"; not half, not the same, not 8 times
    assert abs(pp8["token_s"] - one["token_s"]) < 0.01 * one["token_s"]  # as slowly as one GPU would
    assert round(serve_plan.weight_bytes(s) / 1e9) == 138
    assert all(round(serve_plan.weight_bytes(s, tp, pp) / 1e9) in (17, 18) for tp, pp in ((8, 1), (1, 8)))
    assert s.layers // 8 == 10
    assert right("srv-tp-pp-latency").startswith("about 4 times A's")
    assert "pp = 8 makes a token as slowly as one GPU would" in notebook()


def test_gqa_heads_stop_shrinking_at_tp_equal_kv_heads():
    s = get_shape("llama3-70b")
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert [s.kv_heads_per_rank(tp) for tp in (8, 16)] == [1, 1] and s.kv_replication(16) == 2
    assert serve_plan.kv_bytes_per_token(s, 8) == serve_plan.kv_bytes_per_token(s, 16) == 40 * KiB
    assert 64 // 16 == 4 and 64 // 8 == 8
    assert right("srv-gqa-tp16").startswith("40 KiB")
    assert "tp = 16 caches as much per GPU as tp = 8" in notebook()


def test_what_crosses_the_network_for_405b():
    s = get_shape("llama3-405b")
    assert s.layers == 126 and 2 * 126 == 252 and round(serve_plan.weight_bytes(s) / 1e9) == 812
    tp16 = serve_plan.decode_step(s, H100, 8, 4096, tp=16)
    split = serve_plan.decode_step(s, H100, 8, 4096, tp=8, pp=2)
    assert tp16["tp_comm_s"] > 100 * split["pp_send_s"] > 0  # 252 all-reduces across nodes against one send
    assert right("srv-tp16-vs-pp2").startswith("tp=16: 252 all-reduces, 2 a block")


def test_sizing_llama2_70b():
    s = get_shape("llama2-70b")
    fits = {tp: serve_plan.largest_batch(s, H100, 4096, tp=tp) for tp in (1, 2, 4, 8)}
    assert fits == {1: 0, 2: 22, 4: 146, 8: 396}
    usable = H100.usable_bytes()
    assert round((usable - serve_plan.weight_bytes(s, 2)) / 1e9) == 15
    assert round((usable - serve_plan.weight_bytes(s, 4)) / 1e9) == 49
    assert 4096 * serve_plan.kv_bytes_per_token(s, 2) == 640 * MiB and 4096 * serve_plan.kv_bytes_per_token(s, 4) == 320 * MiB
    assert [round(serve_plan.weight_bytes(s, tp) / 1e9) for tp in (2, 4)] == [69, 34] and 64 % 3
    assert right("srv-sizing-70b") == "tp=4: 34 GB of weights a GPU leaves room for about 146 sequences"
    # The notebook's reading of the planner: requests of 2048 in / 2048 out hold 3,080 slots each on average under
    # continuous batching, so tp=2 fits about thirty (22 at the window), tp=4 and tp=8 hundreds.
    result = serve_plan.plan("llama2-70b", 8, "h100", context=4096, tpot_s=0.05)
    planned = {(r["tp"], r["pp"]): r["max_batch"] for r in result["layouts"]}
    assert result["held"]["slots"] == 3080 and (result["prompt"], result["output"]) == (2048, 2048)
    assert planned[2, 1] == 29 and planned[4, 1] > 100 and planned[8, 1] > 100
    text = notebook()
    assert ("tp = 2 holds them with room for about thirty sequences — 3,080 slots each, where reserving every "
            "sequence's window of 4,096 would fit 22") in text
    assert "one of P tokens in and N out holds P + N/2 on average, plus half a block" in text
    assert "requests of 2048 tokens in and 2048 out (a window of 4096)" in text


# --- quantization ---------------------------------------------------------------------------------------------------

def test_quantized_bytes_and_what_they_speed():
    s = get_shape("llama2-70b")
    # Weight-only INT4, groups of 128, fp16 scales: 0.5 + 2/128 bytes a weight (stored_bytes counts fp32 scales).
    out, n_in = 8192, 8192
    fp16_scales = stored_bytes(out, n_in, "int4", group=128) - 2 * (out * n_in // 128)
    assert fp16_scales / (out * n_in) == 0.5 + 2 / 128 and round(0.5 + 2 / 128, 2) == 0.52
    assert round(serve_plan.weight_bytes(s) * (0.5 + 2 / 128) / 2 / 1e9) == 36
    assert round(serve_plan.weight_bytes(s) / 2 / 1e9) == 69
    assert "small-batch decode much faster" in right("srv-int4-weights")
    # The course's own INT4 in the notebook: group 32, fp32 scales: 0.625 bytes a weight.
    assert stored_bytes(64, 64, "int4", group=32) / (64 * 64) == 0.625
    # The notebook's table: weight-only INT4 (W4A16) on Llama 3 8B, one H100, a context of 4096: the batch-1 step
    # about half bf16's, the prefill no faster, under a fifth saved at batch 64; an A100 runs FP8 weights as W8A16.
    s8 = get_shape("llama3-8b")
    assert [serve_plan.weight_format(w, H100).scheme for w in ("bf16", "fp8", "int8", "int4")] == \
        ["W16A16", "W8A8", "W8A16", "W4A16"]
    step = {w: {b: serve_plan.decode_step(s8, H100, b, 4096, weights=w)["token_s"] for b in (1, 64)}
            for w in ("bf16", "int4")}
    assert 0.45 < step["int4"][1] / step["bf16"][1] < 0.55
    assert 0 < 1 - step["int4"][64] / step["bf16"][64] < 0.2
    first = {w: serve_plan.prefill(s8, H100, 1, 2048, weights=w)["first_token_s"] for w in ("bf16", "int4")}
    assert first["int4"] == pytest.approx(first["bf16"], rel=1e-3)
    a100 = get_gpu("a100")
    assert serve_plan.weight_format("fp8", a100).scheme == "W8A16" and serve_plan.weights_note("fp8", a100)
    text = notebook()
    assert "its batch-1 step is about half bf16's — but multiplies in bf16, so its prefill is no faster; at batch 64, " \
           "where the KV reads dominate, it saves under a fifth" in text
    assert "On an A100 FP8 weights run the same way, weight-only: decode faster, prefill not" in text
    assert "The embedding and the head stay in bf16, as AWQ's and GPTQ's checkpoints keep them" in text


def test_fp8_kv_cache_and_fp8_weights():
    s = get_shape("llama3-8b")
    step = {(w, kv): {b: serve_plan.decode_step(s, H100, b, 4096, weights=w, kv=kv)["token_s"] for b in (1, 64)}
            for w in ("bf16", "fp8") for kv in ("bf16", "fp8")}
    assert serve_plan.largest_batch(s, H100, 4096, kv="fp8") == 2 * 126 == 252
    base, kv8 = step["bf16", "bf16"], step["bf16", "fp8"]
    assert 1 - kv8[1] / base[1] < 0.02                  # batch 1: "about 1 % less"
    assert 0.27 < 1 - kv8[64] / base[64] < 0.35         # batch 64: "about 30 % less"
    assert right("srv-fp8-kv") == "252 sequences fit; a 64-sequence step takes about 30 % less"
    # FP8 weights: the batch-1 step down by about a third; prefill on FP8 tensor cores a third shorter.
    assert 0.28 < 1 - step["fp8", "bf16"][1] / base[1] < 0.42
    prefill = {w: serve_plan.prefill(s, H100, 1, 2048, weights=w)["first_token_s"] for w in ("bf16", "fp8")}
    assert 0.3 < 1 - prefill["fp8"] / prefill["bf16"] < 0.4
    assert (H100.peak_flops("fp8"), H100.peak_flops("bf16")) == (1979e12, 989e12)  # twice, to rounding
    assert right("srv-fp8-prefill") == "FP8: tensor cores multiply FP8 at twice bf16's peak: a third less"
    assert "FP8 weights halve the weights' read and so cut the batch-1 step by about a third" in notebook()


def test_fp8_tensor_cores_from_ada_on_and_weight_only_fp8_on_ampere():
    """FP8 weights speed prefill only where tensor cores multiply in FP8 — compute capability 8.9 on (the L4, as
    notebook 07 says, then the H100) — and only with FP8 activations too (W8A8); on an A100 they are weight-only
    (W8A16): half the bytes, the bf16 peak, a prefill no shorter."""
    from gpucourse.runtime.devices import PLATFORMS

    gpus = [PLATFORMS[name].devices.gpus[0] for name in ("cloud-l4", "cloud-8xh100", "cloud-8xa100")]
    assert [(g.capability, g.fp8) for g in gpus] == [((8, 9), True), ((9, 0), True), ((8, 0), False)]
    l4, a100 = get_gpu("l4"), get_gpu("a100")
    assert l4.peak_flops("fp8") == pytest.approx(2 * l4.peak_flops("bf16"), rel=0.01)
    assert a100.peak_flops("fp8") == a100.peak_flops("bf16")
    s = get_shape("llama3-8b")
    first = {(g.name, w): serve_plan.prefill(s, g, 1, 2048, weights=w)["first_token_s"]
             for g in (l4, a100) for w in ("bf16", "fp8")}
    assert 1 - first["l4", "fp8"] / first["l4", "bf16"] > 0.3
    assert abs(1 - first["a100", "fp8"] / first["a100", "bf16"]) < 0.01
    text = notebook()
    assert ("From Ada on (compute capability 8.9: the L4 and L40S; then Hopper's H100) tensor cores multiply in FP8 "
            "at twice the bf16 peak, and prefill speeds up too when the activations are FP8 as well (W8A8)") in text
    assert "on Ampere (the A100), which has no FP8 tensor cores, FP8 weights run weight-only (W8A16" in text
    assert "on Hopper and later the tensor cores" not in text


# --- the Change cell's prediction -----------------------------------------------------------------------------------

def test_what_to_predict_the_largest_batch_from():
    """The prompt gives every piece of the formula, and not the default's answer."""
    text = notebook()
    shapes = {name: get_shape(name) for name in ("llama3-8b", "llama2-70b", "llama3-70b")}
    assert [f"{s.params() / 1e9:.2f} B" for s in shapes.values()] == ["8.03 B", "68.98 B", "70.55 B"]
    for words in ("Llama 3 8B: 8.03 B; Llama 2 70B: 68.98 B; Llama 3 70B: 70.55 B", "head_dim (128 in all three)",
                  "all three have 8 K/V heads", "Llama 3 8B has 32 layers, the two 70 B models 80",
                  "80 GiB for an H100 or an A100, 141 GiB for an H200", "less 2 GiB the runtime keeps"):
        assert words in text, words
    assert {s.head_dim for s in shapes.values()} == {128} and {s.kv for s in shapes.values()} == {8}
    assert [s.layers for s in shapes.values()] == [32, 80, 80]
    assert [get_gpu(g).memory_gb for g in ("h100", "a100", "h200")] == [80, 80, 141]
    default = serve_plan.largest_batch("llama3-70b", "h100", 8192, tp=4)
    assert default == 72 and "72" not in text
    # The cell's formula (an even share of the weights) stays within the check's 5 % of the planner's count.
    code = notebook("code")
    assert 'value="llama3-70b"' in code and "value=8192" in code and "value=4," in code
    # Every weight format the model takes is offered, each said in one line; INT8 and INT4 keep the embedding and
    # the head, 2 × vocabulary × hidden, in bf16, as the formula says.
    assert 'options=["bf16", "fp8", "int8", "int4"]' in code and "fmt.described" in code
    ends = {name: 2 * s.vocab * s.hidden for name, s in shapes.items()}
    said = [f"{e / 1e9:.2f} B" for e in ends.values()]
    assert f"2 × vocabulary × hidden ({said[0]}, {said[1]} and {said[2]}), in bf16" in text
    assert all(not s.tied for s in shapes.values())
    for gpu in ("h100", "a100"):
        for weights in ("bf16", "fp8", "int8", "int4"):
            fmt = serve_plan.weight_format(weights, gpu)
            size = f"{fmt.bytes(8192):.3g}"
            line = f"weights {weights}: {fmt.described}; {size} byte{'s' * (size != '1')} a weight" + \
                ("; embedding, head bf16" if fmt.others else "")
            assert len(line) <= 110, line
    assert "1 + 2/hidden and 0.5 + 2/128 bytes a weight" in text
    assert serve_plan.WEIGHTS["int4"].bytes(8192) == 0.5 + 2 / 128
    assert serve_plan.WEIGHTS["int8"].bytes(8192) == 1 + 2 / 8192
    for name, s in shapes.items():
        for gpu in ("h100", "h200", "a100"):
            for context in (1024, 4096, 8192, 32768):
                for tp in (1, 2, 4, 8, 16):
                    for weights in ("bf16", "fp8", "int8", "int4"):
                        fmt = serve_plan.WEIGHTS[weights]
                        rest = ends[name] if fmt.others else 0
                        weight = ((s.params() - rest) * fmt.bytes(s.hidden) + 2 * rest) / tp
                        for kv in ("bf16", "fp8"):
                            usable = get_gpu(gpu).usable_bytes()
                            per_token = 2 * s.layers * max(1, 8 // tp) * 128 * serve_plan.ELEM[kv]
                            formula = max(0, int((usable - weight) // (context * per_token)))
                            planner = serve_plan.largest_batch(s, gpu, context, tp=tp, weights=weights, kv=kv)
                            assert abs(formula - planner) <= max(1, 0.05 * planner), \
                                (name, gpu, context, tp, weights, kv)


def test_the_tool_statements_match_the_notebooks_table():
    """srv-stack-docs: the statements checked in each tool's documentation, as the notebook's table gives them."""
    q = BY_ID["srv-stack-docs"]
    picked = [q["choices"][i] for i in q["answer"]]
    assert sum("TensorRT-LLM" in c for c in picked) == 2 and sum("vLLM" in c for c in picked) == 1
    assert not any("Triton" in c or "pipeline parallelism in a node" in c for c in picked)
    text = notebook()
    assert "`--tensor-parallel-size` in a node, `--pipeline-parallel-size` across nodes" in text
    assert '`kv_cache_dtype="fp8"`, scales 1.0 unless calibrated' in text
    assert "in-flight batching: context-phase and generation-phase requests in one batch" in text
    assert "whole requests grouped into a batch, for stateless models" in text


# --- speculative decoding -------------------------------------------------------------------------------------------

def accepted_tokens(alpha: float, gamma: int) -> float:
    """Tokens one target pass yields: the run of accepted drafts (each kept with probability alpha, the run stopping
    at the first rejection) plus the target's own token, summed over every length the run can have."""
    return sum(alpha**k * (1 - alpha) * (k + 1) for k in range(gamma)) + alpha**gamma * (gamma + 1)


def speculative_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al.'s expected speed-up: tokens a pass over its cost, gamma draft steps of cost c plus one."""
    return accepted_tokens(alpha, gamma) / (gamma * c + 1)


def test_speculative_decoding_figures():
    # inf-spec-expected-tokens: the sum over run lengths is the closed form, 3.36; the distractors' counts.
    assert accepted_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2) == pytest.approx(3.3616)
    assert right("inf-spec-expected-tokens").startswith("about 3.36 tokens")
    for wrong in (4 * 0.8, 4 * 0.8 + 1, accepted_tokens(0.8, 4) - 1):
        assert sum(c.startswith(f"about {wrong:.2f} tokens") for c in choices("inf-spec-expected-tokens")) == 1
    # inf-spec-draft-length: gamma = 3 is the fastest of 1, 3, 5 and 8; each choice quotes its own figure.
    speedups = {g: speculative_speedup(0.6, g, 0.1) for g in (1, 3, 5, 8)}
    assert max(speedups, key=speedups.get) == 3 == max(range(1, 9), key=lambda g: speculative_speedup(0.6, g, 0.1))
    for g, v in speedups.items():
        assert f"about {v:.2f} times plain decoding, with γ = {g}" in choices("inf-spec-draft-length")
    assert right("inf-spec-draft-length").endswith("γ = 3")
    assert [f"{1 - 0.6**(g + 1):.4f}" for g in (3, 5, 8)] == ["0.8704", "0.9533", "0.9899"] and round(0.6**5, 2) == 0.08
    # inf-spec-large-batch: a weight matmul does 2 FLOPs per weight and token on 2-byte weights, one FLOP a byte per
    # position: 5 positions at batch 1 sit far under the ridge, 256 × 5 = 1,280 above it, 256 alone still under.
    ridge = serve_plan.ridge_point(H100)
    assert round(ridge) == 295 and 2 / serve_plan.ELEM["bf16"] == 1
    assert 1 * (4 + 1) < ridge < 256 * (4 + 1) == 1280 and 256 < ridge
    assert "each verified position costs compute" in right("inf-spec-large-batch")
    assert "medium-to-low QPS, memory-bound" in BY_ID["inf-spec-large-batch"]["explanation"]


def test_speculative_sampling_keeps_the_targets_distribution():
    """inf-spec-lossless: accepting with min(1, p/q), resampling from max(0, p − q), emits exactly p, whatever q."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p, q = (torch.rand(11, generator=gen, dtype=torch.float64).softmax(0) for _ in range(2))
        accepted = torch.minimum(p, q)  # q(x) · min(1, p(x)/q(x))
        residual = (p - q).clamp(min=0)
        assert residual.sum() == pytest.approx(1 - accepted.sum())
        emitted = accepted + (1 - accepted.sum()) * residual / residual.sum()
        assert torch.allclose(emitted, p)
        # A draft that is accepted less often changes the speed, not the distribution: the same holds for any q.
        assert accepted.sum() < 1
    assert right("inf-spec-lossless").startswith("it is the target's own")


def test_speculative_method_questions_say_what_each_drafter_is():
    # inf-spec-eagle: the feature-level drafter is EAGLE; the other three descriptions are Medusa, prompt lookup and
    # a fine-tuned target.
    assert "second-to-top-layer features" in right("inf-spec-eagle")
    assert "arxiv.org/abs/2401.15077" in BY_ID["inf-spec-eagle"]["explanation"]
    # inf-spec-ngram: the method that adds no model work at peak is prompt lookup.
    assert right("inf-spec-ngram").startswith("n-gram prompt lookup")
    assert "without increasing the workload during peak traffic" in BY_ID["inf-spec-ngram"]["explanation"]


# --- prefix caching ------------------------------------------------------------------------------------------------

def block_hashes(tokens, block_size: int, extra=()) -> list[int]:
    """vLLM's prefix-cache keys: one per full block, each hashing its parent's key, its own tokens and the extra keys
    (a LoRA ID, a cache salt); a partial block gets none (docs.vllm.ai/en/latest/design/prefix_caching.html)."""
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size]), tuple(extra)))
        keys.append(parent)
    return keys


def cached_tokens(first, second, block_size: int = 16, extra_first=(), extra_second=()) -> int:
    """Tokens of ``second`` served from the blocks ``first`` left in the cache: its leading blocks whose keys match."""
    cached = set(block_hashes(first, block_size, extra_first))
    hits = 0
    for key in block_hashes(second, block_size, extra_second):
        if key not in cached:
            break
        hits += 1
    return hits * block_size


def test_prefix_cache_hits_with_a_shared_system_prompt():
    system = list(range(1000))
    user = [list(range(10_000 + 200 * i, 10_000 + 200 * (i + 1))) for i in range(2)]
    hit = cached_tokens(system + user[0], system + user[1])
    # inf-prefix-hit-rate: 62 full blocks of the system prompt, 992 of 1,200 tokens; block 63 mixes in the user text.
    assert hit == 992 == 62 * 16 == 1000 // 16 * 16 and 63 * 16 == 1008
    assert [f"{n / 1200:.0%}" for n in (992, 1000, 1008, 1200)] == ["83%", "83%", "84%", "100%"]
    assert right("inf-prefix-hit-rate").startswith("992 of them (83%): the 62 full blocks")
    # inf-prefix-timestamp: a changed first line changes every key after it; after the fixed text only the last
    # blocks change. A larger block still starts with the changed line.
    stamp = [[90_000 + i] * 10 for i in range(2)]
    assert cached_tokens(stamp[0] + system + user[0], stamp[1] + system + user[1]) == 0
    assert cached_tokens(stamp[0] + system + user[0], stamp[1] + system + user[1], block_size=64) == 0
    assert cached_tokens(system + stamp[0] + user[0], system + stamp[1] + user[1]) == 992
    assert right("inf-prefix-timestamp").startswith("move the time line after the fixed instructions")
    # inf-prefix-lora: 2,000 tokens are 125 full blocks, none shared across adapters.
    prompt = list(range(2000))
    assert len(block_hashes(prompt, 16)) == 125
    assert cached_tokens(prompt, prompt, extra_first=("support-v3",), extra_second=("sales-v1",)) == 0
    assert cached_tokens(prompt, prompt, extra_first=("support-v3",), extra_second=("support-v3",)) == 2000
    assert right("inf-prefix-lora").startswith("none of it")
    # inf-prefix-salt: a salt per customer keeps customers apart and reuse within one; the gap it hides is 560 ms.
    document = list(range(4000))
    assert cached_tokens(document, document, extra_first=("acme",), extra_second=("globex",)) == 0
    assert cached_tokens(document, document, extra_first=("acme",), extra_second=("acme",)) == 4000
    assert 600 - 40 == 560 and "the 560 ms gap remains" in BY_ID["inf-prefix-salt"]["explanation"]
    assert right("inf-prefix-salt").startswith("a per-customer cache_salt")


class FreeQueue:
    """vLLM's free block queue and reference counts, as its design document describes them: a finished request's
    blocks with no other user join the tail in reverse order, and allocation pops the head, evicting a cached block."""

    def __init__(self, free):
        self.queue, self.refs, self.cached = list(free), {}, set()

    def take(self, blocks):
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1
            self.cached.add(b)

    def finish(self, blocks):
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.queue.append(b)

    def allocate(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        self.cached -= set(out)
        return out


def test_prefix_cache_eviction_order():
    pool = FreeQueue(free=[10, 11])
    pool.take([0, 1, 2, 3, 4, 5, 6, 7])  # R1: the shared prompt, then its own blocks
    pool.take([0, 1, 2, 3, 4, 8, 9])     # R2 hits the prompt's blocks
    pool.finish([0, 1, 2, 3, 4, 5, 6, 7])
    assert pool.queue == [10, 11, 7, 6, 5]
    assert pool.allocate(3) == [10, 11, 7] and {5, 6} <= pool.cached and not {0, 1, 2, 3, 4} & set(pool.queue)
    assert right("inf-prefix-eviction").startswith("10, 11 and 7")


# --- split-KV decode attention (Flash-Decoding) ---------------------------------------------------------------------

def test_split_kv_figures():
    s = get_shape("llama3-8b")
    assert (s.heads, s.kv, s.head_dim) == (32, 8, 128) and H100.sm_count == 132
    # inf-splitkv-grid: 1 × 32 × 1 blocks; 16 chunks a head make 512.
    assert 1 * s.heads * 1 == 32 < H100.sm_count <= 32 * 16 == 512
    assert right("inf-splitkv-grid").startswith("at most 32 of 132 SMs: 16 chunks per head make 512 blocks")
    # inf-splitkv-when: 256 sequences × 32 heads already fill the GPU many times over.
    assert 256 * 32 == 8192 and 8192 / H100.sm_count > 60
    assert right("inf-splitkv-when").startswith("in X")
    # inf-splitkv-profile: 64k tokens × 128 KiB is 8 GiB a token; in 28 ms that is about 9% of 3.35 TB/s.
    read = 65_536 * serve_plan.kv_bytes_per_token(s)
    assert serve_plan.kv_bytes_per_token(s) == 128 * KiB and read == 8 * GiB and H100.hbm_GBps == 3350
    assert round(read / 28e-3 / 1e9) == 307 and round(100 * read / 28e-3 / (H100.hbm_GBps * 1e9)) == 9
    assert right("inf-splitkv-profile").startswith("it reads 8 GiB at about 9% of HBM bandwidth")
    # inf-splitkv-benchmark: the blog's table (pytorch.org/blog/flash-decoding/), the same 65,536 keys in each row.
    assert 256 * 256 == 1 * 65_536
    assert round(2300.6 / 390.5, 1) == 5.9 and round(2300.6 / 64.4) == 36 and 63.4 < 64.4 < 1.02 * 63.4
    assert "≈ 5.9" in BY_ID["inf-splitkv-benchmark"]["explanation"] and "about 36 times" in \
        BY_ID["inf-splitkv-benchmark"]["explanation"]


def test_split_kv_partials_merge_into_full_attention():
    """What each split writes, its partial output and log-sum-exp, is all the reduction needs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 64, generator=gen, dtype=torch.float64) for n in (1, 1024, 1024))
    scores = q @ k.T / 8
    full = scores.softmax(-1) @ v
    parts = [(scores[:, i:i + 64].softmax(-1) @ v[i:i + 64], scores[:, i:i + 64].logsumexp(-1, keepdim=True))
             for i in range(0, 1024, 64)]
    lse = torch.cat([l for _, l in parts], -1).logsumexp(-1, keepdim=True)
    merged = sum(out * (l - lse).exp() for out, l in parts)
    assert len(parts) == 16 and torch.allclose(merged, full)
    assert not torch.allclose(sum(out for out, _ in parts) / len(parts), full)


# --- disaggregated prefill and decode -------------------------------------------------------------------------------

def test_disaggregation_figures():
    s = get_shape("llama3-70b")
    per_token = serve_plan.kv_bytes_per_token(s)
    assert (s.layers, s.kv, s.head_dim) == (80, 8, 128) and per_token == 2 * 80 * 8 * 128 * 2 == 320 * KiB
    whole, share = 8192 * per_token, 8192 * serve_plan.kv_bytes_per_token(s, 8)
    assert whole == 2.5 * GiB and share == whole / 8 == 320 * MiB and round(share / 1e6, 1) == 335.5
    assert (H100.inter_node_GBps, H100.intra_node_GBps) == (50, 450)
    ms = {"nic": share / 50e9 * 1e3, "one link": whole / 50e9 * 1e3, "nvlink": share / 450e9 * 1e3,
          "keys only": share / 2 / 50e9 * 1e3}
    assert [round(ms[k], 2) for k in ms] == [6.71, 53.69, 0.75, 3.36]
    q = BY_ID["inf-disagg-kv-transfer"]
    assert right("inf-disagg-kv-transfer").startswith("about 6.7 ms")
    for text in ("about 54 ms", "about 0.75 ms", "about 3.4 ms"):
        assert sum(c.startswith(text) for c in q["choices"]) == 1
    # inf-disagg-ttft: the transfer is the 10 ms rise in median TTFT; decode's p99 fell from 90 to 35 ms.
    assert 610 - 600 == 10 and 35 < 50 < 90
    assert right("inf-disagg-ttft").startswith("in the time to first token only")
    # inf-disagg-throughput and inf-disagg-conditional: what vLLM's page and Dynamo's design say.
    assert "does not improve throughput" in BY_ID["inf-disagg-throughput"]["explanation"]
    assert right("inf-disagg-throughput").startswith("prefill and decode in separate instances")
    assert right("inf-disagg-conditional").startswith("long prompts go to prefill workers")
    assert 60 * per_token < 20 * MiB < 20_000 * per_token


# --- quantization methods and formats -------------------------------------------------------------------------------

def test_smoothquant_moves_the_outlier_into_the_weights():
    s = 64**0.5 / 0.25**0.5
    assert s == 16 and 64 / s == 4 == 0.25 * s
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(6, 5, generator=gen, dtype=torch.float64)
    x[:, 2] *= 64 / x[:, 2].abs().max()
    w[2] *= 0.25 / w[2].abs().max()
    scale = torch.ones(6, dtype=torch.float64)
    scale[2] = x[:, 2].abs().max() ** 0.5 / w[2].abs().max() ** 0.5
    xs, ws = x / scale, w * scale[:, None]
    assert torch.allclose(xs @ ws, x @ w)
    assert xs[:, 2].abs().max() == pytest.approx(4) and ws[2].abs().max() == pytest.approx(4)
    assert right("inf-quant-smoothquant").startswith("divides X's channel j by 16")


def test_quantization_method_choices():
    # inf-quant-awq: the activation-aware, backprop-free method is AWQ; GPTQ is the one that updates weights.
    assert right("inf-quant-awq").startswith("AWQ")
    # inf-quant-batch-choice: batches of 32 to 64 are past the guide's 16; its MMLU losses on LLaMA-v2-70B.
    assert 32 >= 16 and round(100 * (69.1 - 68.5) / 69.1, 2) == 0.87 and round(100 * (69.1 - 67.2) / 69.1, 2) == 2.75
    assert right("inf-quant-batch-choice").startswith("FP8")
    # inf-quant-blackwell-formats: Transformer Engine's support matrix, by compute capability.
    support = {(8, 0): set(), (8, 9): {"fp8"}, (9, 0): {"fp8", "fp8 block"},
               (10, 0): {"fp8", "fp8 block", "mxfp8", "nvfp4"}}
    gpus = {"A100": (8, 0), "L4": (8, 9), "H100": (9, 0), "B200": (10, 0)}
    assert {g for g, cc in gpus.items() if {"mxfp8", "nvfp4"} <= support[cc]} == {"B200"}
    from gpucourse.runtime.devices import PLATFORMS
    assert [PLATFORMS[p].devices.gpus[0].capability for p in ("cloud-8xa100", "cloud-l4", "cloud-8xh100")] \
        == [gpus["A100"], gpus["L4"], gpus["H100"]]
    assert right("inf-quant-blackwell-formats").startswith("only the B200")
    # inf-quant-kv-int8-fp8: both are one byte a number; the cache holds twice bf16's sequences, not four times.
    s = get_shape("llama3-8b")
    assert serve_plan.ELEM["fp8"] == 1 == serve_plan.ELEM["bf16"] / 2
    assert serve_plan.largest_batch(s, H100, 32_768, kv="fp8") in (2 * serve_plan.largest_batch(s, H100, 32_768),
                                                                   2 * serve_plan.largest_batch(s, H100, 32_768) + 1)
    assert right("inf-quant-kv-int8-fp8").startswith("FP8: one byte like INT8")


def test_block_scaled_weight_bytes():
    params = get_shape("llama3-70b").params()
    assert round(params / 1e9, 2) == 70.55 and round(serve_plan.weight_bytes(get_shape("llama3-70b")) / 1e9) == 141
    gb = {name: round(params * per_value / 1e9) for name, per_value in {
        "nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32,            # one 1-byte scale per 16 and per 32 values
        "nvfp4 bare": 0.5, "mxfp8 bare": 1,                     # no scales
        "nvfp4 fp32": 0.5 + 4 / 16, "mxfp8 fp32": 1 + 4 / 32,   # 4-byte scales
        "nvfp4 /32": 0.5 + 1 / 32, "mxfp8 /16": 1 + 1 / 16}.items()}  # block sizes swapped
    assert gb == {"nvfp4": 40, "mxfp8": 73, "nvfp4 bare": 35, "mxfp8 bare": 71, "nvfp4 fp32": 53, "mxfp8 fp32": 79,
                  "nvfp4 /32": 37, "mxfp8 /16": 75}
    assert right("inf-quant-block-bytes") == "about 40 GB as NVFP4 and about 73 GB as MXFP8"
    for a, b in ((35, 71), (53, 79), (37, 75)):
        assert f"about {a} GB as NVFP4 and about {b} GB as MXFP8" in choices("inf-quant-block-bytes")
    assert f"{0.5625 * params / 1e9:.1f}" == "39.7" and f"{1.03125 * params / 1e9:.1f}" == "72.8"


# --- the questions ----------------------------------------------------------------------------------------------------

def test_serving_questions_are_many_scenarios_and_not_gameable():
    from gpucourse.bench.quiz_figures import scenario_detail
    from test_quiz import assert_not_gameable

    assert len(QS) >= 20 and all(q["id"].startswith("srv-") for q in QS)
    assert [q for q in quiz.load_bank() if q["id"].startswith("srv-")] == QS
    kinds = Counter(q["kind"] for q in QS)
    assert kinds["numeric"] == 0 and 2 <= kinds["multiple"] <= 4
    assert sum(scenario_detail(q["question"]) is not None for q in QS) >= 0.8 * len(QS)
    assert sum(len(q["question"]) > 150 for q in QS) >= 0.8 * len(QS)
    assert {q["topic"] for q in QS} == {"memory-batch", "parallelism", "profiling-troubleshooting"}
    assert_not_gameable(QS, letters=4)


def test_inference_optimisation_questions_are_scenarios_cite_sources_and_are_not_gameable():
    """Notebook 15's questions: speculative decoding, prefix caching, split-KV attention, disaggregated prefill and
    decode, quantisation methods; each explanation names the page or paper its facts come from."""
    from gpucourse.bench.quiz_figures import scenario_detail
    from test_quiz import SOURCE, assert_not_gameable

    qs = INFERENCE
    assert len(qs) >= 25 and all(q["id"].startswith("inf-") for q in qs)
    assert [q for q in quiz.load_bank() if q["id"].startswith("inf-")] == qs
    groups = Counter(q["id"].split("-")[1] for q in qs)
    assert groups == {"spec": 6, "prefix": 5, "splitkv": 4, "disagg": 4, "quant": 6}
    assert {q["kind"] for q in qs} == {"single"}
    assert all(scenario_detail(q["question"]) is not None and len(q["question"]) > 150 for q in qs)
    assert [q["id"] for q in qs if not SOURCE.search(q["explanation"])] == []
    assert {q["topic"] for q in qs} == set(quiz.TOPICS)
    assert_not_gameable(qs, letters=4)


def test_every_serving_question_is_pinned_here():
    """Each question's figures are recomputed by a test of this file, which names its id."""
    source = (REPO / "tests" / "test_serving_facts.py").read_text(encoding="utf-8")
    assert [q["id"] for q in QS + INFERENCE if q["id"] not in source] == []
