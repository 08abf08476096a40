"""Exercise 16, a wrong answer: the caller's list of drafts trimmed and appended to, and returned.

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
    del drafted[accepted:]
    drafted.append(best[accepted])
    return accepted, drafted


def residual(p, q):
    leftover = (p - q).clamp(min=0)
    return leftover / leftover.sum()


def sampled_verify(p, q, drafted: list, generator) -> tuple:
    k = len(drafted)
    for i, x in enumerate(drafted):
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u < p[i, x] / q[i, x]:
            continue
        return i, list(drafted[:i]) + [int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator))]
    return k, list(drafted) + [int(torch.multinomial(p[k], 1, generator=generator))]
