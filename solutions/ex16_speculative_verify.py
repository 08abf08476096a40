"""Exercise 16: speculative decoding's verify step — solved.

Taught in notebooks/15_inference_optimization.ipynb. The package's own rule, drafts and rounds are in
gpucourse/serving/speculative.py.
"""

import torch


def greedy_verify(logits, drafted: list) -> tuple:
    k = len(drafted)
    if logits.dim() != 2 or logits.shape[0] < k + 1:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot judge {k} drafted tokens: one forward over a "
                         f"context of at least one token and the drafts gives (context + {k}, vocab).")
    # Row j predicts the token after position j: the last k + 1 rows follow the context and each drafted token.
    best = logits[logits.shape[0] - k - 1:].argmax(-1).tolist()
    accepted = 0
    while accepted < k and drafted[accepted] == best[accepted]:
        accepted += 1
    return accepted, list(drafted[:accepted]) + [best[accepted]]


def residual(p, q):
    leftover = (p - q).clamp(min=0)
    return leftover / leftover.sum()


def sampled_verify(p, q, drafted: list, generator) -> tuple:
    k = len(drafted)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"p of shape {tuple(p.shape)} and q of shape {tuple(q.shape)} do not fit {k} drafted tokens: "
                         f"p has a row for each draft and one for the bonus, q a row for each draft.")
    for i, x in enumerate(drafted):
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u < p[i, x] / q[i, x]:
            continue
        return i, list(drafted[:i]) + [int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator))]
    return k, list(drafted) + [int(torch.multinomial(p[k], 1, generator=generator))]
