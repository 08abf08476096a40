"""Serving: cached generation equals recomputing the prefix, paged attention equals contiguous, and the
continuous-batching scheduler serves every request within its KV budget with the tokens plain generation makes."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucourse.model import MODELS, GPTConfig, build_model
from gpucourse.modeled.serve_clock import ModeledClock, simulate
from gpucourse.serving import (BlockAllocator, KVCache, ModelRunner, OutOfBlocks, PagedKVCache, Request, Scheduler,
                               generate, load_trace, poisson_trace, save_trace, serve, wall_clock)
from gpucourse.serving.kv_cache import inference

MOE = GPTConfig(n_layer=2, moe_experts=4, moe_top_k=2)


def prompts_of(lengths, vocab=64, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


# --- the KV cache ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [MODELS["tiny"], MODELS["small"], MOE], ids=["tiny", "small", "moe"])
def test_cached_generation_equals_recomputing_the_prefix(cfg):
    model = build_model(cfg, 0)
    prompts = prompts_of([5, 17, 1, 30])
    cached, cached_logits = generate(model, prompts, 16, return_logits=True)
    plain, plain_logits = generate(model, prompts, 16, use_cache=False, return_logits=True)
    assert torch.equal(cached, plain)
    torch.testing.assert_close(cached_logits, plain_logits, rtol=1e-4, atol=1e-5)
    assert len(set(cached.flatten().tolist())) > 1, "a test that sees one token cannot tell positions apart"


def test_a_batch_generates_what_each_prompt_generates_alone():
    # Right padding: a short prompt beside a long one gets the same tokens as on its own.
    model = build_model(MODELS["tiny"], 1)
    prompts = prompts_of([3, 25, 9], seed=1)
    together = generate(model, prompts, 10)
    for row, prompt in enumerate(prompts):
        assert torch.equal(together[row], generate(model, [prompt], 10)[0])


def test_sampling_is_seeded_and_keeps_to_the_top_k():
    model = build_model(MODELS["tiny"], 0)
    prompts = prompts_of([4, 11], seed=2)

    def sample(use_cache=True, **kw):
        return generate(model, prompts, 24, temperature=1.5, generator=torch.Generator().manual_seed(7),
                        use_cache=use_cache, return_logits=True, **kw)

    tokens, logits = sample(top_k=3)
    assert torch.equal(tokens, sample(top_k=3)[0])
    assert torch.equal(tokens, sample(use_cache=False, top_k=3)[0])
    third = logits.topk(3, dim=-1).values[..., -1]
    assert (logits.gather(-1, tokens[..., None])[..., 0] >= third).all()
    free = sample()[0]
    assert not torch.equal(free, generate(model, prompts, 24)), "temperature 1.5 drew only greedy tokens"
    assert torch.equal(sample(top_k=1)[0], generate(model, prompts, 24))


@pytest.mark.parametrize("lengths, new, message", [
    ([4, 129], 1, "prompt 1 of 129 tokens is longer than the model's context of 128 tokens (block_size)."),
    ([100], 30, "prompt 0 of 100 tokens and 30 new tokens need 129 positions; the model has 128 (block_size)."),
    ([3, 0], 2, "prompt 1 is empty: generation needs at least one token to continue."),
])
def test_what_the_context_cannot_hold_is_refused_before_anything_runs(lengths, new, message):
    model = build_model(MODELS["tiny"], 0)
    model.wte.register_forward_pre_hook(lambda *a: pytest.fail("the model ran"))
    with pytest.raises(ValueError) as e:
        generate(model, prompts_of(lengths), new)
    assert str(e.value) == message
    assert generate(build_model(MODELS["tiny"], 0), [[1] * 128], 1).shape == (1, 1)  # the whole context is fine


def test_a_cache_holds_two_numbers_per_layer_and_channel_for_each_token():
    cfg = MODELS["tiny"]
    assert KVCache(cfg, batch=3, max_len=10).bytes() == 2 * cfg.n_layer * cfg.n_embd * 4 * 3 * 10
    assert KVCache(cfg, batch=1, max_len=1, dtype=torch.bfloat16).bytes() == 2 * cfg.n_layer * cfg.n_embd * 2


def test_generation_leaves_the_training_model_as_it_was():
    model = build_model(MODELS["tiny"], 0)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, prompts_of([6]), 4)
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- paged KV memory -------------------------------------------------------------------------------------------

def test_the_allocator_hands_out_frees_and_says_when_it_is_out():
    blocks = BlockAllocator(num_blocks=4, block_size=8)
    blocks.grow("a", 9)                      # two blocks, the second holding one token
    blocks.grow("a", 16)                     # still two
    assert len(blocks.tables["a"]) == 2 and blocks.used() == 2
    assert blocks.can_grow("b", 16) and not blocks.can_grow("b", 17)
    with pytest.raises(OutOfBlocks, match="sequence 'b' needs 3 more KV blocks to hold 17 tokens; 2 of 4 are free"):
        blocks.grow("b", 17)
    assert blocks.used() == 2, "a refused request took blocks"
    blocks.release("a")
    blocks.grow("b", 32)
    assert sorted(blocks.tables["b"]) == [0, 1, 2, 3] and not blocks.free


def test_release_gives_the_blocks_back_in_table_order_as_exercise_14_asks():
    """The package's allocator is exercise 14's reference (notebook 14 says so): its release appends a sequence's
    blocks to the free list in table order, as the exercise's check and its solution do — reversed is the wrong
    answer tests/mutants/ex14_paged_attention/release_reversed.py loses points for."""
    import inspect
    import runpy

    from gpucourse.grading.checks import ex14_paged_attention as check
    from procs import REPO

    solution = runpy.run_path(str(REPO / "solutions" / "ex14_paged_attention.py"))["release"]
    assert "after_free != free + table" in inspect.getsource(check.releases)
    for table, free in (([4, 2, 9], [1]), ([0], []), ([], [5, 6]), ([8, 3, 1, 7, 6], [2, 0])):
        blocks = BlockAllocator(num_blocks=10, block_size=4)
        blocks.free, blocks.tables["s"] = list(free), list(table)
        blocks.release("s")
        theirs_table, theirs_free = list(table), list(free)
        solution(theirs_table, theirs_free)
        assert blocks.free == free + table == theirs_free and "s" not in blocks.tables and theirs_table == []
    # So the next sequence takes the released table's last block first, as the exercise's grow would.
    blocks = BlockAllocator(num_blocks=4, block_size=8)
    blocks.grow("a", 24)
    assert blocks.tables["a"] == [0, 1, 2] and blocks.free == [3]
    blocks.release("a")
    blocks.grow("b", 8)
    assert blocks.tables["b"] == [2] and blocks.free == [3, 0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_attention_equals_contiguous_attention(seed):
    """Sequences of random lengths fed in random chunks, in random order, through blocks of a shuffled free
    list: each chunk's logits equal the plain forward's at the same position."""
    rng = random.Random(seed)
    model = build_model(MODELS["tiny"], seed)
    sequences = prompts_of([rng.randint(1, 40) for _ in range(5)], seed=seed)
    blocks = BlockAllocator(num_blocks=40, block_size=4)
    rng.shuffle(blocks.free)
    cache = PagedKVCache(model.cfg, blocks)
    fed = [0] * len(sequences)
    with inference(model):
        plain = [model(torch.tensor([s]))[0] for s in sequences]
        while any(f < len(s) for f, s in zip(fed, sequences)):
            left = [i for i, s in enumerate(sequences) if fed[i] < len(s)]
            rows = rng.sample(left, k=rng.randint(1, len(left)))
            chunks = [(i, fed[i], sequences[i][fed[i]:fed[i] + rng.randint(1, 9)]) for i in rows]
            logits = cache.feed_chunks(model, chunks)
            for (i, start, new), got in zip(chunks, logits):
                torch.testing.assert_close(got, plain[i][start + len(new) - 1], rtol=1e-4, atol=1e-5)
                fed[i] += len(new)
    tables = list(blocks.tables.values())
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "every table was contiguous"
    assert any(len(s) % 4 for s in sequences), "no sequence had a part-filled last block"


def test_a_paged_cache_and_a_contiguous_one_hold_the_same_keys():
    model = build_model(MODELS["tiny"], 0)
    prompts = prompts_of([7, 2])
    contiguous = KVCache(model.cfg, batch=2, max_len=8)
    blocks = BlockAllocator(num_blocks=6, block_size=3)
    blocks.free.reverse()
    paged = PagedKVCache(model.cfg, blocks)
    with inference(model):
        contiguous.feed_rows(model, torch.tensor([prompts[0], prompts[1] + [0] * 5]), torch.tensor([7, 2]))
        paged.feed_chunks(model, [(0, 0, prompts[0]), (1, 0, prompts[1])])
    keys = paged.read(layer=2)[0]
    torch.testing.assert_close(keys[0, :, :7], contiguous.k[2][0, :, :7])
    torch.testing.assert_close(keys[1, :, :2], contiguous.k[2][1, :, :2])
    assert blocks.tables == {0: [5, 4, 3], 1: [2]}


# --- the scheduler ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("static, token_budget, num_blocks", [(False, None, 12), (False, 7, 12), (True, None, 24)],
                         ids=["continuous", "chunked-prefill", "static"])
def test_served_tokens_equal_plain_generation(static, token_budget, num_blocks):
    model = build_model(MODELS["tiny"], 3).double()  # float64: batching changes no greedy choice by rounding
    trace = poisson_trace(8, rate=200.0, prompt_lens=(1, 20), output_lens=(1, 14), seed=4)
    alone = {r.id: generate(model, [list(r.prompt)], r.max_new_tokens)[0].tolist() for r in trace}
    eos = alone[0][len(alone[0]) // 2]  # a token the model does make, so some requests end on it
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size=4), static, token_budget, eos=eos)
    report = serve(trace, scheduler, ModelRunner(model, scheduler.blocks), ModeledClock())
    for seq in report.sequences:
        want = alone[seq.request.id]
        want = want[:want.index(eos) + 1] if eos in want else want
        assert seq.tokens[len(seq.request.prompt):] == want, seq.request.id
    assert any(s.generated < s.request.max_new_tokens for s in report.sequences), "no request ended on its end token"
    if not static:
        assert sum(s.preemptions for s in report.sequences) > 0, "the budget was meant to force preemptions"
    if token_budget:
        assert max(it.tokens for it in report.iterations) <= token_budget


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 3, 16]), spare=st.integers(0, 40),
       token_budget=st.sampled_from([None, 1, 5, 64]), static=st.booleans())
def test_the_scheduler_keeps_to_its_budget_and_finishes_every_request(seed, block_size, spare, token_budget, static):
    trace = poisson_trace(30, rate=100.0, prompt_lens=(1, 40), output_lens=(1, 30), burst=3, seed=seed)
    longest = max(-(-(len(r.prompt) + r.max_new_tokens) // block_size) for r in trace)
    num_blocks = longest + spare
    report = simulate(trace, num_blocks, block_size, static, None if static else token_budget)
    assert [s.request.id for s in report.sequences] == [r.id for r in trace]
    for seq in report.sequences:
        assert seq.generated == seq.request.output_len and seq.finish_s >= seq.first_token_s > seq.request.arrival_s
    for it in report.iterations:
        held = sum(-(-h // block_size) for h in it.held)
        assert held <= it.blocks_used <= num_blocks  # within budget, and no block kept by nobody
        assert static or held == it.blocks_used
        assert static or token_budget is None or it.tokens <= token_budget


def test_continuous_batching_beats_static_at_equal_memory():
    trace = poisson_trace(60, rate=20.0, prompt_lens=(16, 128), output_lens=(8, 256), burst=10, seed=0)
    continuous, static = (simulate(trace, 200, 16, static=s) for s in (False, True))
    assert continuous.throughput() > 1.5 * static.throughput()
    assert continuous.kv_waste()["paged_waste"] < 0.1 < continuous.kv_waste()["max_length_waste"]
    assert simulate(trace, 200, 16).summary(1, 1) == continuous.summary(1, 1)  # the modeled clock repeats


def test_the_metrics_of_one_request_on_a_unit_clock():
    # One request, 3 prompt tokens, 4 new, each iteration 1 s: first token after the prefill at t = 1,
    # the other three one a second, the last at t = 4.
    trace = [Request(0, 0.0, (1, 2, 3), max_new_tokens=4)]
    report = simulate(trace, num_blocks=2, block_size=4, cost=lambda work, run: (1.0, run()))
    assert (report.ttft_s(), report.tpot_s(), report.span_s(), report.throughput()) == ([1.0], [1.0], 4.0, 1.0)
    assert report.goodput(ttft_s=1.0, tpot_s=1.0) == 0.25 and report.goodput(ttft_s=0.5, tpot_s=1.0) == 0.0
    assert [it.held for it in report.iterations] == [[3], [4], [5], []]
    assert report.kv_waste() == {"used_slots": 12, "paged_slots": 16, "max_length_slots": 21,
                                 "paged_waste": 0.25, "max_length_waste": 1 - 12 / 21}


def test_the_wall_clock_times_real_decoding():
    model = build_model(MODELS["tiny"], 0)
    trace = poisson_trace(3, rate=1000.0, prompt_lens=(2, 6), output_lens=(2, 4), seed=1)
    scheduler = Scheduler(BlockAllocator(8, 4))
    report = serve(trace, scheduler, ModelRunner(model, scheduler.blocks), wall_clock)
    assert all(it.seconds > 0 for it in report.iterations) and report.throughput() > 0


class NeverRuns:
    """A runner that accepts every request and fails the test if it is asked to run one."""

    def check(self, request):
        pass

    def __call__(self, work):
        pytest.fail("the trace ran")


def test_a_request_that_can_never_fit_is_refused_before_anything_runs():
    trace = [Request(0, 0.0, (1,) * 10, 5), Request(1, 0.5, (1,) * 30, 20)]
    scheduler = Scheduler(BlockAllocator(num_blocks=6, block_size=8))
    with pytest.raises(ValueError) as e:
        serve(trace, scheduler, NeverRuns())
    assert str(e.value) == ("request 1 (30 prompt tokens + 20 new) needs 7 KV blocks of 8 tokens, more than the "
                            "whole budget of 6.")
    with pytest.raises(ValueError, match="request 0 of 100 tokens and 32 new tokens need 131 positions; the model"):
        ModelRunner(build_model(MODELS["tiny"], 0), scheduler.blocks).check(Request(0, 0.0, (1,) * 100, 32))
    with pytest.raises(ValueError, match="some ids repeat"):
        serve([trace[0], dataclasses.replace(trace[0], arrival_s=1.0)], scheduler, NeverRuns())


def test_a_trace_saves_loads_and_refuses_what_is_not_one(tmp_path):
    trace = poisson_trace(5, rate=3.0, prompt_lens=(1, 4), output_lens=(1, 9), burst=2, seed=9)
    assert trace[0].arrival_s == trace[1].arrival_s < trace[2].arrival_s  # bursts of two
    path = tmp_path / "trace.json"
    save_trace(path, trace)
    assert load_trace(path) == trace and os.listdir(tmp_path) == ["trace.json"]
    path.write_text('[{"id": 0, "arrival_s": 0.0,')
    with pytest.raises(ValueError, match=r"trace.json is not a request trace: it is not JSON \(Expecting .* at line 1\)\.$"):
        load_trace(path)
    path.write_text(json.dumps([{**dataclasses.asdict(trace[0]), "prompt": None}]))
    with pytest.raises(ValueError, match="is not a request trace: request 0's prompt must be a list of token ids"):
        load_trace(path)


def test_what_the_serving_lessons_say_of_the_bench_trace():
    """paged.py: 3 % of the slots paging allocates stay empty on the bench's trace, 43 % had each sequence reserved
    its maximum; scheduler.py: continuous batching makes 2.5 to 2.6 times static batching's tokens per second
    (the quick and the full trace)."""
    from gpucourse.bench import serving_figures
    from gpucourse.serving import paged, scheduler

    full = serving_figures.paged_kv_waste(requests=320).detail
    assert f"{full['paged_waste']:.0%}" == "3%" and f"{full['max_length_waste']:.0%}" == "43%"
    assert "3 % of the slots paging allocates stay empty, against 43 %" in " ".join(paged.__doc__.split())
    gains = [serving_figures.continuous_vs_static_throughput(requests=n).value for n in (160, 320)]
    assert [round(g, 1) for g in gains] == [2.5, 2.6], gains
    assert "2.5 to 2.6 times static batching's tokens per second" in " ".join(scheduler.__doc__.split())


def test_serve_bench_from_the_command_line(tmp_path, capsys):
    """The modeled run prints what simulate() finds for the same trace; the wall clock decodes with the model; bad
    input gets one sentence."""
    import json

    from gpucourse.cli import main
    from gpucourse.modeled.serve_clock import simulate
    from gpucourse.serving import poisson_trace, save_trace

    out = tmp_path / "s.json"
    assert main(["serve-bench", "--requests", "40", "--burst", "8", "--blocks", "48", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    want = simulate(poisson_trace(40, 4.0, (16, 64), (8, 48), burst=8, seed=0), 48, 16).summary(2.0, 0.05)
    got = json.loads(out.read_text())["summary"]
    assert got == pytest.approx(want) and f"throughput        {want['throughput_tok_s']:,.0f}" in printed.out
    assert "request 40/40" in printed.err  # the progress bar reached the end
    trace = tmp_path / "t.json"
    save_trace(trace, poisson_trace(3, 50.0, (4, 8), (2, 4), seed=1))
    assert main(["serve-bench", "--trace", str(trace), "--clock", "wall", "--quiet"]) == 0
    assert "3 requests, continuous batching" in capsys.readouterr().out
    for argv, says in ((["--static", "--token-budget", "8"], "static batching feeds whole prompts"),
                       (["--blocks", "2"], "more than the whole budget of 2"),
                       (["--trace", str(tmp_path / "none.json")], "none.json does not exist; give a request trace"),
                       (["--model", "huge"], "--model 'huge' is not one of")):
        assert main(["serve-bench", *argv]) == 2
        assert says in capsys.readouterr().err


def test_what_the_scheduler_hands_the_runner_says_who_was_admitted_and_who_preempted():
    """The boundary between scheduler and model runner is one record a step: the sequences that run with the tokens
    each feeds (a list of Scheduled, which the runner reads), and the requests admitted and preempted for it."""
    from gpucourse.serving.scheduler import Scheduled, SchedulerOutput

    sched = Scheduler(BlockAllocator(num_blocks=4, block_size=4))
    for i in range(2):
        sched.add(Request(i, 0.0, (1, 2, 3), max_new_tokens=8))
    first = sched.schedule()
    assert isinstance(first, SchedulerOutput) and all(isinstance(part, Scheduled) for part in first)
    assert (first.admitted, first.preempted, first.tokens) == ([0, 1], [], 6)
    assert [(part.seq.request.id, part.tokens) for part in first] == [(0, 3), (1, 3)]
    seen = []
    for step in range(12):
        out = sched.schedule()
        seen.append((out.admitted, out.preempted))
        for seq, n in out:
            sched.advance(seq, n, 9 if seq.cached + n == len(seq.tokens) else None, 0.1 * step)
        if out.preempted:
            assert out.preempted == [1] and not out.admitted  # the youngest goes; nobody is admitted that step
            assert [part.seq.request.id for part in out] == [0]
            break
    else:
        pytest.fail(f"4 blocks of 4 tokens were meant to run out: {seen}")
