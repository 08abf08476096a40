"""Exercise 12: expert parallelism — each token to its experts' rank by all-to-all, and back.

Taught in notebooks/13_mixture_of_experts.ipynb; check your work with
``from gpucourse import check; check("ex12")`` or ``gpucourse grade ex12``.
Compare with the reference, gpucourse/parallel/expert_parallel.py, once yours passes.

A mixture of experts has E expert MLPs; its router gives each token k of them
(all different) and a weight for each. On one device a token's output is

    out[t] = Σ_j weights[t, j] · expert_{chosen[t, j]}(x[t])      (j = 0 … k − 1)

which is what ``MoE.dispatch`` in gpucourse/model.py computes, every expert in
turn. Under expert parallelism the n ranks of the default process group share
the experts: rank r holds experts r·E/n … (r+1)·E/n − 1 (E/n of them, its
*local* experts 0 … E/n − 1; E is a multiple of n), and each rank has tokens of
its own: the rows of ``x`` (N, C), with ``chosen`` (N, k) int64, each token's
experts, and ``weights`` (N, k). The number of choices differs from rank to
rank and from expert to expert: any expert, or every expert of a rank, may get
none. Choice j of token t is choice number t·k + j of the N·k
(``chosen.flatten()``'s order). Each choice's row travels to the rank that
holds its expert, the experts run there, and the outputs travel back.

``permute(chosen, num_experts)`` → ``(order, counts)``
    One process, no communication. ``order``: int64 (N·k,), the choice numbers
    sorted by expert, stably — choices of the same expert stay in choice order
    (which is token order). ``counts``: int64 (num_experts,), how many choices
    each expert got, 0 for an expert nobody chose.

``exchange_counts(counts)`` → ``recv_counts``
    ``counts``: this rank's (E,) counts. One ``dist.all_to_all_single`` with
    equal splits (E/n numbers to each rank: the counts of its experts). Returns
    int64 (E,): ``recv_counts[i·E/n + e]`` is the number of rows rank i will
    send to this rank's local expert e. Every rank calls it.

``dispatch(x, chosen, num_experts)`` → ``(received, state)``
    ``permute``, ``exchange_counts``, then one all-to-all with uneven split
    sizes, through ``AllToAll`` (below) so that gradients can flow: the row
    ``x[t]`` of every choice, in ``order``, to the rank holding its expert —
    the rows for rank 0's experts first, then rank 1's, … ``received``
    (R, C): the rows this rank's experts must process, first those from rank
    0, then from rank 1, …; within one source rank local expert 0's rows, then
    local expert 1's, …; within one expert, in the source's choice order.
    ``state``: a dict of what ``combine`` needs, holding only tensors, ints and
    lists of ints (the grader hands it back to your ``combine`` as it came
    back). Both sides of an all-to-all must agree on its split sizes: what
    rank i sends rank j is what rank j expects from rank i.

``combine(expert_out, weights, state, num_tokens)`` → (num_tokens, C)
    ``expert_out`` (R, C): the experts' outputs for ``received``, row for row.
    Send them home by the reverse all-to-all (``AllToAll`` with the splits
    swapped); then out[t] = Σ_j weights[t, j] · (the output row of choice
    t·k + j), summed into its token with ``index_add``. Tensors of
    ``expert_out``'s dtype.

``moe_forward(x, chosen, weights, experts)`` → (N, C)
    ``experts``: this rank's local experts, E/n modules (callables: (rows, C)
    → (rows, C)); ``experts[e]`` is expert r·E/n + e, and E = n·len(experts).
    Dispatch, run each local expert on its received rows (``recv_counts``
    says which: from each source rank in turn, its counts for local expert 0,
    1, …), combine. It must be differentiable end to end: the gradients reach
    ``x``, ``weights`` and every expert's parameters. An expert that receives
    no row either runs on zero rows (its gradient is then 0) or is skipped
    (its gradient stays None): both are right. But every rank must take part
    in every all-to-all, backward's too, even a rank that received no row at
    all — and autograd runs a rank's ``AllToAll`` backward only if that
    rank's output depends on the rows it received. Running every expert,
    even on zero rows, keeps it so.

``AllToAll`` (fill it in)
    ``AllToAll.apply(rows, out_splits, in_splits)``: one
    ``dist.all_to_all_single`` sending ``in_splits[i]`` consecutive rows of
    ``rows`` to rank i and returning the ``sum(out_splits)`` rows received,
    ``out_splits[i]`` of them from rank i, in rank order (lists of ints, the
    argument order of ``dist.all_to_all_single(output, input,
    output_split_sizes, input_split_sizes)``). Its backward is the gradient
    of those received rows going home the way they came: the same all-to-all
    with the split sizes swapped.

All-to-all is the only collective: the others (all-gather, all-reduce,
broadcast, send/recv …) are switched off, so the rows travel only to the rank
that needs them. Each row crosses once each way: a forward and backward of
``moe_forward`` is five all-to-alls on each rank — the E counts, once (keep
what ``moe_forward`` and ``combine`` need in ``state``), the rows out, the
rows back, and in backward those two again.

The contract every function here keeps, checked on its own besides the values:

- the input tensors come back bit for bit (``chosen`` included: no in-place
  change, not even through a view; ``counts`` given to ``exchange_counts``
  too, and the ``state`` given to ``combine``);
- what ``dispatch`` sends keeps ``x``'s dtype, and what ``combine`` returns
  ``expert_out``'s — bf16 expert outputs with float32 router weights too;
- an expert may get no row, or a single one (a (1, C) tensor), whatever the
  seed.

``make_expert`` and ``forward_backward`` (below, given) are what the grader
calls to run ``moe_forward`` forward and backward with experts of its own.
"""

import torch
import torch.distributed as dist


def permute(chosen, num_experts):
    """The choice numbers sorted by expert, stably, and each expert's number of choices: (order, counts)."""
    raise NotImplementedError("permute")


def exchange_counts(counts):
    """recv_counts[i·E/n + e]: the rows rank i will send to this rank's local expert e (one all-to-all)."""
    raise NotImplementedError("exchange_counts")


class AllToAll(torch.autograd.Function):
    """Rows to ranks by one uneven all-to-all: ``AllToAll.apply(rows, out_splits, in_splits)``; differentiable."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        raise NotImplementedError("AllToAll.forward")

    @staticmethod
    def backward(ctx, grad):
        # Return the gradient of ``rows``, then None for each of the two split lists.
        raise NotImplementedError("AllToAll.backward")


def dispatch(x, chosen, num_experts):
    """Each choice's row to the rank holding its expert: (received, state)."""
    raise NotImplementedError("dispatch")


def combine(expert_out, weights, state, num_tokens):
    """The outputs home by the reverse all-to-all, each weighted by its choice's weight, summed into its token."""
    raise NotImplementedError("combine")


def moe_forward(x, chosen, weights, experts):
    """Dispatch, this rank's experts on their rows, combine: each token's weighted sum of its experts' outputs."""
    raise NotImplementedError("moe_forward")


# --- given: what the grader calls ------------------------------------------------------------------------


def make_expert(w1, b1, w2, b2):
    """An expert MLP, Linear(C, H) → tanh → Linear(H, C), holding copies of these weights as its parameters."""
    expert = torch.nn.Sequential(torch.nn.Linear(w1.shape[1], w1.shape[0]), torch.nn.Tanh(),
                                 torch.nn.Linear(w2.shape[1], w2.shape[0]))
    with torch.no_grad():
        for p, value in zip(expert.parameters(), (w1, b1, w2, b2)):
            p.copy_(value)
    return expert


def forward_backward(x, chosen, weights, expert_params, grad_out):
    """moe_forward on experts made from ``expert_params``, then backward from ``grad_out``: what the grader reads."""
    x = x.detach().clone().requires_grad_(True)
    weights = weights.detach().clone().requires_grad_(True)
    experts = [make_expert(*params) for params in expert_params]
    out = moe_forward(x, chosen, weights, experts)
    out.backward(grad_out)
    return {"out": out.detach(), "dx": x.grad, "dweights": weights.grad,
            "dexperts": [[p.grad for p in expert.parameters()] for expert in experts]}
