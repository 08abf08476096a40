"""Exercise 16, a wrong answer: a rejected draft replaced, and the drafts after it judged too.

Taught in notebooks/15_inference_optimization.ipynb. The package's own rule, drafts and rounds are in
gpucourse/serving/speculative.py.
"""

import torch


def greedy_verify(logits, drafted: list) -> tuple:
    k = len(drafted)
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
    tokens, accepted = [], 0
    for i, x in enumerate(drafted):
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u < p[i, x] / q[i, x]:
            tokens.append(x)
            accepted += 1
        else:
            tokens.append(int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator)))
    return accepted, tokens + [int(torch.multinomial(p[k], 1, generator=generator))]
