"""Speculative decoding: greedy output is the target's own, token for token, whatever the draft; sampled output is
distributed as the target's (a chi-square test on a Markov chain whose probabilities are known exactly); and the
modeled speed-up wins at batch 1 and loses at a large batch, on the serving cost model."""

from __future__ import annotations

import random

import pytest
import torch

from gpucourse.modeled import serve_plan
from gpucourse.model import MODELS, GPTConfig, build_model
from gpucourse.serving import generate
from gpucourse.serving.speculative import (ModelDraft, PromptLookupDraft, decode_rounds, expected_tokens,
                                           speculative_generate, truncated, verify)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


def prompts_of(lengths, vocab=64, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def target():
    # float64: verifying k + 1 tokens in one forward rounds differently from one at a time, and in float32 a
    # near-tie between two logits could flip a greedy token of a random model; in float64 none does.
    return build_model(MODELS["tiny"], 0).double()


@pytest.mark.parametrize("draft_of", ["truncated", "other model", "prompt lookup"])
def test_greedy_speculation_makes_the_targets_own_tokens(target, draft_of):
    for prompt, k in zip(prompts_of([1, 7, 19], seed=3), (1, 3, 5)):
        draft = {"truncated": lambda: ModelDraft(truncated(target, 1)),
                 "other model": lambda: ModelDraft(build_model(GPTConfig(n_layer=2), 5).double()),
                 "prompt lookup": lambda: PromptLookupDraft(max_ngram=2)}[draft_of]()
        tokens, stats = speculative_generate(target, draft, prompt, 12, k=k)
        assert tokens == generate(target, [prompt], 12)[0].tolist(), (draft_of, len(prompt), k)
        assert stats.made == 12 and stats.rounds == 12 - stats.accepted
        assert stats.tokens_per_forward == pytest.approx(12 / stats.rounds)
        assert stats.draft_forwards == (0 if draft_of == "prompt lookup" else stats.proposed)
        if draft_of == "truncated":  # the target's own first block agrees with it often: some rounds gain
            assert stats.accepted > 0 and stats.tokens_per_forward > 1


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    draft = PromptLookupDraft(max_ngram=3)
    assert draft.propose([5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3], 4) == ([7, 1, 2, 3], None)  # the 3-gram, latest
    assert draft.propose([4, 2, 6, 5, 2], 3) == ([6, 5, 2], None)  # no 3- or 2-gram earlier: the 1-gram
    assert draft.propose([1, 2, 3], 3) == ([], None)  # nothing earlier: no proposal, a plain decode step
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookupDraft(max_ngram=1, min_ngram=2)


class Chain:
    """A Markov chain over a few tokens: the next token's probabilities depend on the last token only, so every
    sequence's probability is known exactly. As a verifier: ``logits``; as a draft: ``propose``."""

    def __init__(self, probs: torch.Tensor):
        self.probs, self.forwards = probs.double(), 0

    def logits(self, tokens, last=1):
        return self.probs[tokens[-last:]].log()

    def propose(self, tokens, k, temperature, generator):
        drafted, qs = [], []
        for _ in range(k):
            q = self.probs[(tokens + drafted)[-1]]
            drafted.append(int(torch.multinomial(q, 1, generator=generator)))
            qs.append(q)
        self.forwards += k
        return drafted, torch.stack(qs) if qs else None


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chance that a sample from ``probs`` lies at least this far from them (Pearson's chi-square)."""
    expected = probs * counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_tokens_are_distributed_as_the_targets():
    # Three tokens after token 0, k = 2: rounds of two, one and no proposals, accepted and rejected, some
    # probabilities zero in the target (p − q then leaves some tokens out) and some in the draft.
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.0, 0.8], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.2, 0.6], [0.5, 0.5, 0.0], [0.7, 0.1, 0.2]], dtype=torch.float64)
    gen, counts, n = torch.Generator().manual_seed(0), torch.zeros(3, 3, 3, dtype=torch.float64), 2500
    draft = Chain(q)
    for _ in range(n):
        a, b, c = decode_rounds(Chain(p), draft, [0], 3, k=2, temperature=1.0, generator=gen)[0]
        counts[a, b, c] += 1
    exact = p[0][:, None, None] * p[:, :, None] * p[None, :, :]  # P(a | 0) · P(b | a) · P(c | b)
    seen = exact > 0
    assert counts[~seen].sum() == 0, "a sequence the target can never make was made"
    assert chi_square_p(counts[seen], exact[seen]) > 1e-3
    # The same test has the power to tell: the draft's own sequences are far from the target's.
    drafted = q[0][:, None, None] * q[:, :, None] * q[None, :, :]
    assert chi_square_p(drafted[seen] * n, exact[seen]) < 1e-9


def test_the_rejection_rule_on_one_token_leaves_the_targets_distribution():
    gen, n = torch.Generator().manual_seed(1), 6000
    p = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.6, 0.0, 0.1, 0.2]], dtype=torch.float64)
    counts = torch.zeros(5, dtype=torch.float64)
    for _ in range(n):
        counts[verify(p, q, [int(torch.multinomial(q[0], 1, generator=gen))], gen)[0]] += 1
    assert counts[p[0] == 0].sum() == 0
    assert chi_square_p(counts[p[0] > 0], p[0][p[0] > 0]) > 1e-3
    # A point mass (a lookup's proposal) is accepted with probability p(x), else p without x, renormalised.
    assert verify(torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), None, [1]) == [1, 0]
    assert verify(torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]), None, [1]) == [2]


def test_sampling_with_a_model_is_seeded_and_leaves_greedy():
    model = build_model(MODELS["tiny"], 0)
    prompt = prompts_of([6], seed=4)[0]

    def sample(seed):
        return speculative_generate(model, ModelDraft(truncated(model, 2)), prompt, 10, k=3, temperature=1.5,
                                    generator=torch.Generator().manual_seed(seed))

    (first, stats), (again, _) = sample(7), sample(7)
    # A random model's softmax at temperature 1.5 is nearly flat, the draft's too: nearly everything is accepted.
    assert first == again and stats.made == 10 and stats.accepted > 0
    assert first != generate(model, [prompt], 10)[0].tolist()


def test_what_cannot_be_drafted_is_refused():
    model = build_model(MODELS["tiny"], 0)
    with pytest.raises(ValueError, match="k=0"):
        speculative_generate(model, PromptLookupDraft(), [1, 2], 4, k=0)
    with pytest.raises(ValueError, match="between 1 and 3"):
        truncated(model, 4)
    with pytest.raises(ValueError, match="longer than the model's context"):
        speculative_generate(model, PromptLookupDraft(), [1] * 129, 4)


def test_expected_tokens_a_round():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(0.7, 4) == pytest.approx(sum(0.7 ** i for i in range(5)))


def test_the_modeled_speedup_wins_at_batch_one_and_loses_at_a_large_batch():
    one = serve_plan.speculative_speedup("llama3-8b", "h100", 1, 1024, k=4, acceptance=0.7,
                                         draft=serve_plan.LLAMA3_DRAFT)
    # Memory-bound: verifying 5 tokens costs what making 1 does, within 2 %.
    assert one["verify_s"] == pytest.approx(one["plain_s"], rel=0.02)
    assert 1.3 < one["speedup"] < one["tokens_per_round"]
    lookup = serve_plan.speculative_speedup("llama3-8b", "h100", 1, 1024, k=4, acceptance=0.7)
    assert lookup["draft_s"] == 0 and lookup["speedup"] == pytest.approx(lookup["tokens_per_round"], rel=0.02)
    many = serve_plan.speculative_speedup("llama3-8b", "h100", 256, 1024, k=4, acceptance=0.7,
                                          draft=serve_plan.LLAMA3_DRAFT)
    assert many["verify_s"] > 2 * many["plain_s"] and many["speedup"] < 1  # compute-bound: 1280 rows a matmul
    # A draft nobody agrees with only costs.
    assert serve_plan.speculative_speedup("llama3-8b", "h100", 1, 1024, k=4, acceptance=0.0)["speedup"] < 1
    plain = serve_plan.decode_step("llama3-8b", "h100", 8, 4096)
    assert serve_plan.decode_step("llama3-8b", "h100", 8, 4096, new_tokens=1) == plain
    five = serve_plan.decode_step("llama3-8b", "h100", 8, 4096, new_tokens=5)
    assert five["attention_s"] == plain["attention_s"] and five["flops"] == pytest.approx(5 * plain["flops"])
