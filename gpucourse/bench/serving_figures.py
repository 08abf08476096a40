"""Figures of serving: what a KV cache saves in decoding, what continuous batching gains over static batching,
and what paged KV memory wastes against reserving each sequence's maximum length."""

from __future__ import annotations

import random
import statistics
import time

from ..model import MODELS, build_model
from ..course.readings import Reading, figure, interleave, ratio
from ..modeled.serve_clock import simulate
from ..serving import generate, poisson_trace

# A bursty trace: bursts of 16 requests, 4 bursts a second, more than the server keeps up with. The KV budget,
# 256 blocks of 16 tokens (4096 tokens), holds at most 10 sequences at their maximum length (prompt + 256, what
# static batching reserves) and about twice as many at the lengths they actually reach.
TRACE = dict(rate=4.0, prompt_lens=(32, 256), output_lens=(8, 256), burst=16, seed=0)
NUM_BLOCKS, BLOCK_SIZE = 256, 16
TARGETS = dict(ttft_s=2.0, tpot_s=0.05)  # the latency targets goodput is counted under


@figure("kv_cache_decode_speedup", quick=dict(reps=1, new_tokens=128), full=dict(reps=3, new_tokens=128))
def kv_cache_decode_speedup(reps: int, new_tokens: int) -> Reading:
    """Seconds to generate ``new_tokens`` greedy tokens after a 128-token prompt recomputing the whole prefix each
    step, over the same with the KV cache (the "small" model, one sequence, this machine's CPU)."""
    model = build_model(MODELS["small"], 0)
    prompt = [random.Random(0).randrange(model.cfg.vocab_size) for _ in range(128)]
    tokens = {}

    def timed(use_cache):
        start = time.perf_counter()
        tokens[use_cache] = generate(model, [prompt], new_tokens, use_cache=use_cache)
        return time.perf_counter() - start

    for use_cache in (True, False):  # the first forwards of a shape pay for the kernels' set-up: not timed
        generate(model, [prompt], 4, use_cache=use_cache)
    times = interleave({"cached": lambda: timed(True), "recompute": lambda: timed(False)}, reps)
    if not (tokens[True] == tokens[False]).all():
        raise AssertionError("cached generation made other tokens than recomputing the prefix")
    cached, recompute = statistics.median(times["cached"]), statistics.median(times["recompute"])
    return Reading(ratio(recompute, cached), {"cached_s": times["cached"], "recompute_s": times["recompute"]},
                   f"{new_tokens} tokens in {cached:.2f} s with the cache, {recompute:.2f} s recomputing")


def _served(requests: int, static: bool):
    return simulate(poisson_trace(requests, **TRACE), NUM_BLOCKS, BLOCK_SIZE, static=static)


@figure("continuous_vs_static_throughput", target=">= 1.5", quick=dict(requests=160), full=dict(requests=320))
def continuous_vs_static_throughput(requests: int) -> Reading:
    """Output tokens per second of continuous batching over static batching, the same bursty trace and the same
    KV memory (256 blocks of 16 tokens), on the modeled clock (modeled.serve_clock.ModeledClock: serve_plan's step function
    for Llama 2 7B in bf16 on one H100),
    not this machine's. The details hold each side's summary, goodput under TTFT <= 2 s and TPOT <= 50 ms."""
    continuous, static = _served(requests, False), _served(requests, True)
    sides = {"continuous": continuous.summary(**TARGETS), "static": static.summary(**TARGETS)}
    value = ratio(continuous.throughput(), static.throughput())
    return Reading(value, sides, f"modeled: {continuous.throughput():.0f} tokens/s continuous, "
                                 f"{static.throughput():.0f} static ({requests} requests)")


@figure("paged_kv_waste", quick=dict(requests=160), full=dict(requests=320))
def paged_kv_waste(requests: int) -> Reading:
    """Share of allocated KV slots left empty by paging (blocks of 16 tokens) while continuous batching serves the
    bursty trace, beside the share left empty had each running sequence reserved its maximum length."""
    waste = _served(requests, False).kv_waste()
    return Reading(waste["paged_waste"], waste, f"paged {waste['paged_waste']:.1%} empty, maximum-length "
                                                f"reservation {waste['max_length_waste']:.1%}")
