"""Prefix caching: full blocks named by their tokens and everything before them, shared with reference counts,
kept after their request and evicted least recently used first; serving with it makes the tokens serving without it
makes, and on a trace with a shared system prompt it saves prefill (time to first token) and KV memory."""

from __future__ import annotations

import random
import statistics

import pytest

from gpucourse.model import MODELS, build_model
from gpucourse.modeled.serve_clock import ModeledClock
from gpucourse.serving import BlockAllocator, ModelRunner, Scheduler, Simulated, generate, poisson_trace, serve
from gpucourse.serving.prefix_cache import PrefixCachingAllocator, block_hash, with_prefix

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


def test_a_block_is_named_by_its_tokens_and_all_before_them():
    first = block_hash(b"", [1, 2, 3, 4])
    assert block_hash(b"", [1, 2, 3, 4]) == first and block_hash(b"", [1, 2, 3, 5]) != first
    # The same four tokens after two different first blocks: two different blocks of keys and values.
    assert block_hash(first, [7, 7, 7, 7]) != block_hash(block_hash(b"", [9, 2, 3, 4]), [7, 7, 7, 7])


def test_blocks_are_shared_counted_kept_and_evicted_least_recently_used_first():
    pool = PrefixCachingAllocator(num_blocks=8, block_size=4)
    a = list(range(10))                  # 2 full blocks and 2 tokens
    assert pool.admit("a", a) == 0
    pool.grow("a", 10)
    pool.commit("a", a)                  # its tokens are all cached now: the 2 full blocks get names
    assert len(pool.block_of) == 2 and pool.used() == 3
    b = a[:8] + [50, 51, 52]             # the same 8 first tokens
    assert pool.admit("b", b) == 8 and pool.tables["b"] == pool.tables["a"][:2]
    pool.grow("b", 11)
    assert pool.refs[pool.tables["a"][0]] == 2 and pool.used() == 4 and pool.shared() == 2
    pool.release("a")                    # b still holds the shared blocks; a's last block is free again
    assert pool.used() == 3 and not pool.evictable and len(pool.free) == 5
    pool.release("b")                    # nobody holds them now, but they stay cached
    first, second = pool.block_of.values()  # named in order: the prompt's first block, then its second
    assert pool.used() == 0 and list(pool.evictable) == [second, first] and len(pool.free) == 6
    # A prompt found whole still feeds its last token: 8 tokens, two full blocks, only the first is reused.
    assert pool.admit("c", a[:8]) == 4
    pool.release("c")                    # the first block is now the more recently used
    # Memory runs short: never-used blocks go first, then the least recently used cached one, its name forgotten.
    pool.grow("d", 4 * 7)
    assert list(pool.block_of.values()) == [first] and pool.cached_prefix(a) == [(block_hash(b"", a[:4]), first)]
    # Admitted only if what it does not find fits: 3 blocks for 10 tokens, 1 found, 1 left, and that one is it.
    assert pool.admit("e", a) is None and "e" not in pool.tables


def test_a_prompt_that_fits_only_because_it_shares_is_admitted():
    pool = PrefixCachingAllocator(num_blocks=5, block_size=4)
    a = list(range(13))                  # 4 blocks: 3 full, named once computed
    pool.admit("a", a)
    pool.grow("a", 13)
    pool.commit("a", a)
    b = a[:12] + [99, 98]                # 4 blocks too, 3 of them a's: 1 free block is enough
    assert pool.admit("b", b) == 12 and pool.tables["b"] == pool.tables["a"][:3]
    pool.grow("b", 14)
    assert pool.used() == 5 and pool.shared() == 3 and pool.hit_rate() == 12 / 27


def test_a_chain_is_evicted_from_its_tail():
    pool = PrefixCachingAllocator(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    pool.grow("a", 7)
    pool.commit("a", tokens)
    head, middle, tail = pool.tables["a"][:3]
    pool.release("a")
    assert list(pool.evictable) == [tail, middle, head]  # first to go: the block that needs the most before it
    pool.grow("b", 2 * 2)  # the one never-used block, then the tail
    assert pool.tables["b"] == [pool.tables["b"][0], tail]
    assert [block for _, block in pool.cached_prefix(tokens)] == [head, middle]


def served(trace, blocks, runner):
    """The trace served on the modeled clock: the same schedule on every machine."""
    return serve(trace, Scheduler(blocks), runner, ModeledClock())


def test_serving_with_the_prefix_cache_makes_the_same_tokens():
    """A shared system prompt, a KV budget small enough to preempt and to evict, and the tiny model: every
    request's tokens are what generating it alone makes, and some prompts were found in the cache."""
    model = build_model(MODELS["tiny"], 0)
    rng = random.Random(2)
    system = [rng.randrange(64) for _ in range(20)]
    trace = with_prefix(poisson_trace(8, rate=400.0, prompt_lens=(3, 12), output_lens=(4, 10), burst=2, seed=5),
                        system)
    pool = PrefixCachingAllocator(num_blocks=14, block_size=4)
    report = served(trace, pool, ModelRunner(model, pool))
    for seq in report.sequences:
        alone = generate(model, [list(seq.request.prompt)], seq.request.max_new_tokens)[0].tolist()
        assert seq.tokens[len(seq.request.prompt):] == alone, seq.request.id
    assert pool.hit_rate() > 0.3 and pool.evicted > 0 and sum(s.preemptions for s in report.sequences) > 0
    assert pool.used() == 0 and sorted(pool.free + list(pool.evictable)) == list(range(14))


def test_a_shared_system_prompt_saves_prefill_and_memory_on_the_modeled_clock():
    """The bench's bursty trace, every prompt after one 512-token system prompt, on the modeled clock with KV memory
    to spare: the first burst of 16 arrives together and computes the system prompt 16 times (none is cached yet);
    every later request finds all 32 of its blocks."""
    from gpucourse.bench.serving_figures import TRACE

    trace = with_prefix(poisson_trace(64, **{**TRACE, "rate": 1.0}), list(range(512)))
    runs = {}
    for name, pool in (("plain", BlockAllocator(2048, 16)), ("prefix cache", PrefixCachingAllocator(2048, 16))):
        report = served(trace, pool, Simulated(eos=-1))
        held = statistics.mean(it.blocks_used for it in report.iterations)
        runs[name] = report.summary(ttft_s=2.0, tpot_s=0.05), held
    (plain, plain_blocks), (cached, cached_blocks) = runs["plain"], runs["prefix cache"]
    assert pool.hit_tokens == 48 * 512 and pool.evicted == 0
    assert cached["ttft_median_s"] < 0.35 * plain["ttft_median_s"]
    assert cached["peak_blocks"] < 0.75 * plain["peak_blocks"] and cached_blocks < 0.65 * plain_blocks
    assert cached["preemptions"] == 0 < plain["preemptions"]
    assert cached["output_tokens"] == plain["output_tokens"]
