"""The figures notebook 15 (inference optimisations) states in its prose, recomputed with the course's functions:
the modeled speed-ups of speculative decoding, what prefix caching saves on the bench's trace, the SMs split-KV keeps
busy, the cost of a prefill beside decoding and of moving its KV cache, and the bits a weight of each format."""

from __future__ import annotations

import json

import pytest

from gpucourse.modeled import serve_plan
from gpucourse.modeled.cluster import Cluster
from gpucourse.modeled.gpus import get_gpu
from gpucourse.modeled.serve_clock import ModeledClock
from gpucourse.serving import BlockAllocator, Scheduler, Simulated, poisson_trace, serve
from gpucourse.serving.prefix_cache import PrefixCachingAllocator, with_prefix
from gpucourse.modeled.shapes import get_shape
from procs import REPO

H100 = get_gpu("h100")


def prose() -> str:
    nb = json.loads((REPO / "notebooks" / "15_inference_optimization.ipynb").read_text(encoding="utf-8"))
    return " ".join(" ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown").split())


def test_the_speculative_speedups_the_notebook_states():
    draft = serve_plan.speculative_speedup("llama3-8b", H100, 1, 1024, 4, 0.7, serve_plan.LLAMA3_DRAFT)
    free = serve_plan.speculative_speedup("llama3-8b", H100, 1, 1024, 4, 0.7)
    assert (round(draft["speedup"], 1), round(free["speedup"], 1)) == (1.7, 2.8)
    assert "about 1.7 times with the 1B draft, 2.8 with a free draft" in prose()
    assert serve_plan.speculative_speedup("llama3-8b", H100, 256, 1024, 4, 0.7, serve_plan.LLAMA3_DRAFT)["speedup"] < 1
    assert serve_plan.speculative_speedup("llama3-8b", H100, 256, 4096, 4, 0.7, serve_plan.LLAMA3_DRAFT)["speedup"] > 1
    assert "at 256 sequences of 1024 tokens speculation is slower than plain decoding" in prose()
    assert "At a context of 4096 the cache reads keep even a large batch memory-bound" in prose()
    assert round(serve_plan.ridge_point(H100)) == 295 and "about 295 FLOPs a byte on an H100" in prose()


def test_what_prefix_caching_saves_on_the_bench_trace():
    from gpucourse.bench.serving_figures import TRACE

    trace = with_prefix(poisson_trace(64, **{**TRACE, "rate": 1.0}), list(range(512)))
    ttft = {}
    for name, pool in (("plain", BlockAllocator(2048, 16)), ("cached", PrefixCachingAllocator(2048, 16))):
        report = serve(trace, Scheduler(pool), Simulated(eos=-1), ModeledClock())
        ttft[name] = report.summary(2.0, 0.05)["ttft_median_s"]
    assert 0.65 < 1 - ttft["cached"] / ttft["plain"] < 0.75
    assert pool.hit_tokens == 48 * 32 * 16
    text = prose()
    assert "its 16 requests compute it 16 times" in text and "Every later request finds all 32 of its blocks" in text
    assert "the median time to first token falls by about 70 %" in text


def test_the_sms_split_kv_keeps_busy():
    one = serve_plan.split_kv_decode("llama3-8b", H100, 1, 32768)
    step = serve_plan.decode_step("llama3-8b", H100, 1, 32768)
    assert (one["busy_sms_without"], one["bytes_per_sm_without"]) == (8, 16 * 2**20)
    assert round(one["without_s"] / one["full_bandwidth_s"], 1) == 16.5 and one["bytes_per_sm_with"] < 2**20
    assert (step["token_s"] - step["attention_s"] + one["without_s"]) / step["token_s"] > 3
    text = prose()
    assert "8 SMs each read 16 MiB of a layer's cache while 124 wait" in text
    assert "16.5 times as long as the cache read at full bandwidth, and the whole step more than three times" in text
    assert "every SM reads under 1 MiB" in text
    assert serve_plan.split_kv_decode("llama3-8b", H100, 32, 32768)["thread_blocks"] == 256
    assert "From batch 32 on (256 thread blocks) there is nothing to gain" in text


def test_a_prefill_beside_decoding_and_moving_its_cache():
    stall = serve_plan.prefill("llama3-8b", H100, 1, 4096)["first_token_s"]
    step = serve_plan.decode_step("llama3-8b", H100, 32, 4096)["token_s"]
    assert round(stall * 1e3, -1) == 130 and round(stall / step) == 9
    kv = 4096 * serve_plan.kv_bytes_per_token(get_shape("llama3-8b"))
    cluster = Cluster.of(H100, gpus_per_node=8, nodes=2)
    nvlink, network = (cluster.collective_s("send", kv, ranks)[0] for ranks in ((0, 1), (0, 8)))
    assert kv == 512 * 2**20 and round(nvlink * 1e3, 1) == 1.5 and round(network * 1e3) == 13
    text = prose()
    assert "adds about 130 ms — nine decode steps — to one step of every stream" in text
    assert "sending its 512 MiB of cache takes about 1.5 ms over NVLink and 13 ms across servers" in text


@pytest.mark.parametrize("name, bits, said", [("NVFP4", 4 + 8 / 16, "4 bits + 8/16 = 4.5 bits a number"),
                                              ("MXFP8", 8 + 8 / 32, "8 + 8/32 = 8.25 bits a number")])
def test_the_bits_a_number_of_each_block_format(name, bits, said):
    assert said in prose() and f"{bits:g}" in said
