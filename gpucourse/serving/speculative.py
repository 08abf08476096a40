"""Speculative decoding: something cheap proposes k tokens, the model checks them all in one forward.

Decode is memory-bound (``serve_plan``): at batch 1 a step reads every weight to make one token while the GPU's
arithmetic idles, and a forward over k + 1 tokens of the same sequence reads the same weights for about the same
time. So let a cheap *draft* propose k tokens, run the model — the *target* — once over all of them, and keep the
proposals the target agrees with, plus one token of the target's own: a round never makes fewer tokens than a
plain decode step, and makes up to k + 1.

**Greedy** (temperature 0). At each position of the verifying forward the target's most likely token is what plain
decoding would make there, given the same prefix. Keep proposals while they equal it; at the first that does not,
take the target's token instead and end the round. The output is the target's own greedy decode, token for token.

**Sampling** (Leviathan et al. 2023; Chen et al. 2023). The draft proposed x with probability q(x); the target,
given the same prefix, gives p(x). Accept x with probability min(1, p(x)/q(x)). At the first rejection draw the
token from the leftover max(0, p − q), normalised, and end the round; when all k are accepted, draw one more from
the target's next distribution. Each token is then distributed exactly as p:

    P(x) = q(x)·min(1, p(x)/q(x)) + P(reject)·max(0, p(x) − q(x)) / Σ max(0, p − q)
         = min(p, q)(x) + max(0, p − q)(x) = p(x),   since P(reject) = 1 − Σ min(p, q) = Σ max(0, p − q).

The draft changes how fast tokens come, never which: a bad draft only gets rejected more. Greedy is the same rule
with p and q one-hot (a point mass on the most likely token), so one function does both (:func:`verify`).

**Drafts.** Anything that proposes tokens with the probabilities it drew them from:

- :class:`ModelDraft`: a smaller GPT over the same vocabulary, decoding k tokens with its own cache (Leviathan's
  "approximation model", vLLM's draft model). :func:`truncated` makes one from the target's own first blocks,
  final norm and head (self-speculative decoding, as LayerSkip and Draft & Verify do): no second model to train;
- :class:`PromptLookupDraft`: no model at all. Find the context's last n tokens earlier in the context and propose
  what followed them there (prompt lookup, vLLM's "ngram" method). Free, and right whenever the answer copies its
  prompt: code edits, summaries quoting their source, answers from retrieved passages. Its q is a point mass.

**Rolling back.** Target and draft each keep a KV cache for the tokens they have seen (:class:`CachedModel`).
Rejected proposals leave their keys and values behind; forgetting them is only setting the cache's length back to
the longest prefix still true: the next tokens overwrite those slots, and no query attends past its own position.

:func:`speculative_generate` returns the tokens and a :class:`Stats`: the acceptance rate (accepted ÷ proposed)
and the tokens made per target forward, the most speculation can speed a memory-bound decode up. What that is
worth on a GPU — where a draft model is not free, and a large batch is no longer memory-bound — is
``serve_plan.speculative_speedup``, on the serving cost model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..model import build_model
from .kv_cache import KVCache, check_fits, check_prompts, inference


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next-token probabilities (float64) from ``logits`` (..., vocab): softmax(logits / temperature), or at
    temperature 0 a point mass on the most likely token (greedy as the limit of sampling)."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return F.softmax(logits.double() / temperature, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """A token drawn from the distribution ``p`` (vocab,); a point mass needs no draw."""
    if p.max() == 1:
        return int(p.argmax())
    return int(torch.multinomial(p, 1, generator=generator))


def verify(p: torch.Tensor, q: torch.Tensor | None, drafted: list[int],
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens one round makes: the drafted tokens the rejection rule accepts, then one more.

    ``p`` (len(drafted) + 1, vocab): the target's distribution after the context and after each drafted token;
    ``q`` (len(drafted), vocab): the draft's distribution each token was drawn from, or None for a draft that
    proposes without one (a point mass on the token it proposed)."""
    if q is None:
        q = F.one_hot(torch.tensor(drafted, dtype=torch.long), p.shape[-1]).to(p) if drafted else p[:0]
    made = []
    for i, x in enumerate(drafted):
        ratio = float(p[i, x] / q[i, x])  # q[i, x] > 0: the draft drew x from q
        if ratio >= 1 or ratio > float(torch.rand((), dtype=torch.float64, generator=generator)):
            made.append(x)
            continue
        leftover = (p[i] - q[i]).clamp(min=0)  # not all zero: a rejection means p(x) < q(x)
        made.append(sample(leftover / leftover.sum(), generator))
        return made
    made.append(sample(p[len(drafted)], generator))
    return made


class CachedModel:
    """A GPT with a KV cache for one sequence: each call feeds only the tokens the cache does not hold."""

    def __init__(self, model):
        weight = next(model.parameters())
        self.model, self.cfg = model, model.cfg
        self.cache = KVCache(model.cfg, 1, model.cfg.block_size, dtype=weight.dtype, device=weight.device)
        self.seen: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.forwards = 0

    def logits(self, tokens: list[int], last: int = 1) -> torch.Tensor:
        """Logits (last, vocab) after each of the ``last`` final tokens of ``tokens``, in one forward."""
        check_fits(self.cfg, len(tokens), 1, "the context")
        keep = 0  # the longest prefix the cache holds and need not feed again
        for held, token in zip(self.seen, tokens[:len(tokens) - last]):
            if held != token:
                break
            keep += 1
        self.cache.lengths[0] = keep  # roll back: what lay beyond is overwritten, never read
        new = torch.tensor([tokens[keep:]], device=self.cache.k.device)
        with inference(self.model):
            out = self.cache.feed_rows(self.model, new, torch.tensor([new.shape[1]], device=new.device), every=True)
        self.seen = list(tokens)
        self.forwards += 1
        return out[0, -last:]


class ModelDraft:
    """A smaller GPT of the same vocabulary that proposes k tokens, one decode step each, with its own cache."""

    def __init__(self, model):
        self.runner = CachedModel(model)

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def propose(self, tokens: list[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``k`` tokens after ``tokens``, and the distributions (k, vocab) they were drawn from."""
        drafted, qs = [], []
        for _ in range(k):
            q = distribution(self.runner.logits(tokens + drafted)[-1], temperature)
            drafted.append(sample(q, generator))
            qs.append(q)
        return drafted, torch.stack(qs) if qs else None


class PromptLookupDraft:
    """Proposes what followed the last occurrence of the context's final n tokens (n from ``max_ngram`` down to
    ``min_ngram``) earlier in the context; nothing when they occur nowhere before."""

    forwards = 0  # no model: drafting costs no forward

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"the n-grams to look up need 1 <= min_ngram <= max_ngram; got {min_ngram} and "
                             f"{max_ngram}.")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], None]:
        """Up to ``k`` tokens copied from the context; None: each is proposed with certainty (a point mass)."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # the latest earlier occurrence first
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k], None
        return [], None


@dataclasses.dataclass
class Stats:
    """What a speculative generation did: target forwards (rounds), tokens proposed, accepted and made."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    made: int = 0
    draft_forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ proposed proposals (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens made per forward of the target: 1 for plain decoding, up to k + 1 here."""
        return self.made / self.rounds


def speculative_generate(target, draft, prompt: list[int], max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, generator: torch.Generator | None = None):
    """Continue ``prompt`` by ``max_new_tokens`` tokens of ``target`` (a GPT), ``draft`` proposing up to ``k`` a
    round (a :class:`ModelDraft` or :class:`PromptLookupDraft`); return the tokens and the :class:`Stats`.

    Greedy at temperature 0: the tokens of ``generate(target, [prompt], max_new_tokens)``. Otherwise each token is
    distributed as the target's softmax(logits / temperature), whatever the draft."""
    check_prompts(target.cfg, [prompt], max_new_tokens)
    return decode_rounds(CachedModel(target), draft, prompt, max_new_tokens, k, temperature, generator)


def decode_rounds(verifier, draft, prompt: list[int], max_new_tokens: int, k: int = 4, temperature: float = 0.0,
                  generator: torch.Generator | None = None):
    """The rounds of :func:`speculative_generate`: propose, verify in one forward, keep what the rule accepts.
    ``verifier``: anything with ``logits(tokens, last)`` as :class:`CachedModel` has (a model, or a distribution
    known exactly, as the tests use)."""
    if k < 1:
        raise ValueError(f"k={k}: a round needs at least one proposed token to verify.")
    tokens, stats, drafted_before = list(prompt), Stats(), draft.forwards
    while len(tokens) - len(prompt) < max_new_tokens:
        left = max_new_tokens - (len(tokens) - len(prompt))
        # A round makes up to len(drafted) + 1 tokens: propose no more than the answer still needs.
        drafted, q = draft.propose(tokens, min(k, left - 1), temperature, generator)
        p = distribution(verifier.logits(tokens + drafted, len(drafted) + 1), temperature)
        made = verify(p, q, drafted, generator)
        stats.rounds += 1
        stats.proposed, stats.accepted, stats.made = (stats.proposed + len(drafted),
                                                      stats.accepted + len(made) - 1, stats.made + len(made))
        tokens += made
    stats.draft_forwards = draft.forwards - drafted_before
    return tokens[len(prompt):], stats


def truncated(model, n_layer: int):
    """A draft made of ``model``'s embeddings, its first ``n_layer`` blocks, its final norm and its head (a copy):
    the same vocabulary, and predictions close to the whole model's when the later blocks change little."""
    if not 1 <= n_layer < model.cfg.n_layer:
        raise ValueError(f"a truncated draft keeps between 1 and {model.cfg.n_layer - 1} of the model's "
                         f"{model.cfg.n_layer} blocks, not {n_layer}.")
    weight = next(model.parameters())
    draft = build_model(dataclasses.replace(model.cfg, n_layer=n_layer), 0).to(weight.dtype).to(weight.device)
    kept = {name: value for name, value in model.state_dict().items()
            if not name.startswith("blocks.") or int(name.split(".")[1]) < n_layer}
    draft.load_state_dict(kept)
    return draft


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round makes on average when each proposal is accepted with probability ``acceptance``,
    independently (Leviathan et al.'s α): 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"an acceptance rate is a probability, not {acceptance}.")
    return float(k + 1) if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
