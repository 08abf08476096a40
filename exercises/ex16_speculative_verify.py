"""Exercise 16: speculative decoding's verify step — keep the drafted tokens the target agrees with, plus one.

Taught in notebooks/15_inference_optimization.ipynb; check your work with
``from gpucourse import check; check("ex16")`` or ``gpucourse grade ex16``.
Compare with the reference, gpucourse/serving/speculative.py, once yours passes.

A cheap draft has proposed k tokens after the context. The target runs ONE forward over the context followed by
those k tokens; its logits at the last k + 1 positions say what it would have made after the context and after
each drafted token. A round keeps the drafted tokens up to the first one the target rejects, then one token of the
target's own: the one that replaces the rejected draft, or, when all k are accepted, the "bonus" token after them.
So a round makes between 1 and k + 1 tokens for one forward of the target.

``greedy_verify(logits, drafted)``
    Greedy decoding (temperature 0). ``logits`` (n, vocab): the target's forward over the context then the
    ``drafted`` tokens (n = context length + k, the context at least one token); row j is the logits for the token
    AFTER position j, so row n − k − 1 judges ``drafted[0]`` and row n − 1 gives the bonus. ``drafted``: a list
    of k ints (k may be 0). A drafted token is accepted when it is the target's most likely token (argmax) at its
    position, and only while every token before it was accepted. Return ``(accepted, tokens)``: ``accepted`` an
    int, how many drafted tokens were accepted; ``tokens`` a list of accepted + 1 ints, the accepted drafts then
    the target's own most likely token at the next position. Repeated, rounds make exactly the target's own greedy
    decode.

``residual(p, q)``
    What to draw from after a rejection: max(0, p − q), divided by its sum. ``p``, ``q`` (vocab,): the target's
    and the draft's probabilities at one position, which differ. Return a new tensor of p's dtype.

``sampled_verify(p, q, drafted, generator)``
    Sampling (Leviathan et al. 2023). ``p`` (k + 1, vocab): the target's probabilities after the context and after
    each drafted token (row i judges ``drafted[i]``, row k gives the bonus); ``q`` (k, vocab): the draft's
    probabilities that ``drafted[i]`` was drawn from (float64, both). For each drafted token x, in order, draw
    ``u = torch.rand((), generator=generator, dtype=torch.float64)`` and accept x when u < p[i, x] / q[i, x],
    which happens with probability min(1, p/q). At the first rejection, draw the replacement with
    ``torch.multinomial(residual(p[i], q[i]), 1, generator=generator)`` and end the round; when all k are
    accepted, draw the bonus with ``torch.multinomial(p[k], 1, generator=generator)``. Use the generator for
    these draws and no others, in this order, so that the grader, holding the same generator, can repeat them
    (the package's ``verify`` skips u when p ≥ q: the same distribution, other draws). Return
    ``(accepted, tokens)`` as ``greedy_verify`` does. Every token made is then distributed exactly as the target's
    p, whatever the draft.

The contract every caller relies on: leave ``logits``, ``p``, ``q`` and ``drafted`` as they were (the caller keeps
using them), and return exactly the types above — Python ints, not 0-d tensors (``tensor(4) == 4`` is true,
``[tensor(4)]`` is not a list of tokens a tokenizer can read).
"""


def greedy_verify(logits, drafted: list) -> tuple:
    """(accepted, tokens): the drafts the target's argmax agrees with, in order, then the target's own token."""
    raise NotImplementedError("greedy_verify")


def residual(p, q):
    """max(0, p − q), normalised: the distribution a rejected draft is replaced from."""
    raise NotImplementedError("residual")


def sampled_verify(p, q, drafted: list, generator) -> tuple:
    """(accepted, tokens) by the rejection rule, drawing with ``generator`` exactly as the module says."""
    raise NotImplementedError("sampled_verify")
