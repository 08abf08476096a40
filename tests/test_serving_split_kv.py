"""Split-KV decode attention equals plain attention (float64, lengths and splits that do not divide each other),
generation through it equals generation through the plain cache, its split count is FlashAttention's, and on the
serving cost model it keeps every SM of an H100 busy at batch 1 where plain decode attention leaves most idle."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from gpucourse.modeled import serve_plan
from gpucourse.model import MODELS, build_model
from gpucourse.serving import KVCache
from gpucourse.serving.kv_cache import attend_positions, inference
from gpucourse.serving.split_kv import SplitKVCache, combine, num_splits, split_kv_attention

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]


def qkv(length, heads=3, d=16, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, 1, d, generator=gen, dtype=torch.float64) * spread
    k, v = (torch.randn(2, heads, length, d, generator=gen, dtype=torch.float64) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize("length", [1, 7, 64, 129, 1000])
def test_split_kv_attention_equals_plain_attention(length):
    q, k, v = qkv(length, seed=length)
    plain = F.scaled_dot_product_attention(q, k, v)  # one query at the end of its sequence: it sees every key
    at_end = attend_positions(q, k, v, torch.full((2, 1), length - 1))
    torch.testing.assert_close(at_end, plain, rtol=1e-12, atol=1e-12)
    for splits in (1, 2, 3, 7, 16, length, length + 5):
        torch.testing.assert_close(split_kv_attention(q, k, v, splits), plain, rtol=1e-12, atol=1e-12)


def test_the_combination_holds_for_scores_far_from_zero():
    # Scores in the hundreds: e^s overflows float64, e^(lse_c - lse) does not.
    q, k, v = qkv(300, spread=60.0, seed=3)
    torch.testing.assert_close(split_kv_attention(q, k, v, 9), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-10, atol=1e-10)
    # Two chunks that are the same keys give the same output, each with half the weight.
    out = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    lse = torch.full((1, 1, 1), 700.0, dtype=torch.float64)
    torch.testing.assert_close(combine([out, out], [lse, lse]), out)


def test_a_single_query_marked_causal_sees_only_the_first_key():
    """Why the reference above passes no causal flag: PyTorch aligns is_causal's mask to the top left, so one query
    "at position 0" sees key 0 alone, not the cache it is the end of."""
    q, k, v = qkv(10)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), v[:, :, :1])


def test_generation_through_split_kv_equals_the_plain_cache():
    model = build_model(MODELS["tiny"], 0).double()
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (3, 17, 9)]
    caches = {"plain": KVCache(model.cfg, 3, 40, dtype=torch.float64),
              "split": SplitKVCache(model.cfg, 3, 40, splits=3, dtype=torch.float64)}
    tokens, seen = {}, {}
    for name, cache in caches.items():
        idx = torch.zeros(3, 17, dtype=torch.long)
        for row, p in enumerate(prompts):
            idx[row, :len(p)] = torch.tensor(p)
        counts, made, logits_seen = torch.tensor([len(p) for p in prompts]), [], []
        with inference(model):
            for _ in range(8):
                logits = cache.feed_rows(model, idx, counts)
                idx, counts = logits.argmax(-1)[:, None], torch.ones(3, dtype=torch.long)
                made.append(idx[:, 0])
                logits_seen.append(logits)
        tokens[name], seen[name] = torch.stack(made, 1), torch.stack(logits_seen, 1)
    assert torch.equal(tokens["split"], tokens["plain"])
    torch.testing.assert_close(seen["split"], seen["plain"], rtol=1e-10, atol=1e-10)


def test_the_split_count_is_flash_attentions():
    # flash_api.cpp's own example: 48 thread blocks on 108 slots: 2 splits fill 89 %, better than 3 (67 %).
    assert num_splits(48, 108, key_blocks=1000) == 2
    assert num_splits(220, 264, key_blocks=1000) == 1  # 83 % of the slots already busy: no split
    assert num_splits(8, 264, key_blocks=32) == 32  # batch 1, 8 K/V heads, 4096 keys: as many as there are blocks
    # 64 blocks of keys in 11 chunks or in 12 are 6 a chunk either way: 12 is never a count of its own.
    assert all(num_splits(b, 264, key_blocks=64) != 12 for b in range(1, 212))
    with pytest.raises(ValueError, match="at least one chunk"):
        split_kv_attention(*qkv(4), 0)


def test_the_split_keeps_every_sm_busy_at_batch_one_and_changes_nothing_at_a_large_batch():
    one = serve_plan.split_kv_decode("llama3-8b", "h100", 1, 32768)
    assert (one["thread_blocks"], one["busy_sms_without"], one["busy_sms_with"]) == (8, 8, 132)
    assert one["bytes_per_sm_without"] == 16 * 2**20  # 32768 tokens × 2 × 128 × 2 bytes of one K/V head
    assert one["without_s"] == pytest.approx(132 / 8 * one["full_bandwidth_s"])
    assert one["with_s"] < 1.2 * one["full_bandwidth_s"]
    step = serve_plan.decode_step("llama3-8b", "h100", 1, 32768)
    assert one["full_bandwidth_s"] == pytest.approx(step["attention_s"])  # what decode_step assumes: the split
    # Without it, the step of 9 ms would take three times as long.
    assert (step["token_s"] - step["attention_s"] + one["without_s"]) / step["token_s"] > 3
    many = serve_plan.split_kv_decode("llama3-8b", "h100", 32, 4096)
    assert many["splits"] == 1 and many["with_s"] == many["without_s"]
    # Llama 3 70B at tp = 8: one K/V head a GPU, one thread block for a whole layer at batch 1.
    wide = serve_plan.split_kv_decode("llama3-70b", "h100", 1, 32768, tp=8)
    assert wide["thread_blocks"] == 1 and wide["splits"] == 128 and wide["without_s"] > 100 * wide["with_s"]
