"""Exercise 12, a wrong answer: exchange_counts receives into the counts it was given and returns them.

Contracts on some arguments only: the checks held permute, dispatch and combine to 'inputs unchanged', not
exchange_counts, and its answer is right (its dispatch takes its send splits before the exchange). But the
caller's counts are now the other ranks': a dispatch that reads them after the exchange sends the wrong rows. It
scored 10/10 under the checks before exchange_counts was held to the contract (seeds 1 to 5), and fails the
contract check now.
"""

import torch
import torch.distributed as dist


def permute(chosen, num_experts):
    """The choice numbers sorted by expert, stably, and the number of choices of each expert: (order, counts)."""
    flat = chosen.flatten()                       # choice t·k + j is token t's j-th expert
    order = torch.argsort(flat, stable=True)      # ties (the same expert) keep choice order: token order
    counts = torch.bincount(flat, minlength=num_experts)  # minlength: an expert nobody chose still counts 0
    return order, counts


def exchange_counts(counts):
    """recv_counts[i·E/n + e]: the rows rank i will send to this rank's local expert e."""
    # Equal splits of E/n: counts[j·E/n : (j+1)·E/n], what this rank sends rank j's experts, goes to rank j.
    dist.all_to_all_single(counts, counts.clone())  # received in place: no second buffer
    return counts


class AllToAll(torch.autograd.Function):
    """Rows to ranks by one uneven all-to-all; backward sends their gradients back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        received = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), out_splits, in_splits)
        return received

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        # A received row's gradient goes home to the rank that sent the row: what came in goes out.
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


def dispatch(x, chosen, num_experts):
    """Each choice's row to the rank holding its expert: (received, state)."""
    n = dist.get_world_size()
    per, k = num_experts // n, chosen.shape[1]
    order, counts = permute(chosen, num_experts)
    # Experts r·per … (r+1)·per − 1 live on rank r: in expert order, each rank's rows are one piece.
    send_splits = counts.view(n, per).sum(1).tolist()
    recv_counts = exchange_counts(counts)
    recv_splits = recv_counts.view(n, per).sum(1).tolist()  # both sides agree: from the exchanged counts
    received = AllToAll.apply(x[order // k], recv_splits, send_splits)
    state = {"order": order, "recv_counts": recv_counts, "send_splits": send_splits, "recv_splits": recv_splits}
    return received, state


def combine(expert_out, weights, state, num_tokens):
    """The outputs home by the reverse all-to-all, each weighted by its choice's weight and summed into its token."""
    order, k = state["order"], weights.shape[1]
    back = AllToAll.apply(expert_out, state["send_splits"], state["recv_splits"])  # in `order`, as they left
    weight = weights.flatten()[order].to(back.dtype)  # float32 router weights on bf16 outputs: the outputs' dtype
    out = expert_out.new_zeros((num_tokens, expert_out.shape[1]))
    return out.index_add(0, order // k, back * weight[:, None])


def moe_forward(x, chosen, weights, experts):
    """Dispatch, this rank's experts on their rows, combine: each token's weighted sum of its experts' outputs."""
    n, per = dist.get_world_size(), len(experts)
    received, state = dispatch(x, chosen, n * per)
    # Received rows come by source rank, and by local expert within each source: the local expert of each row.
    which = torch.arange(per).repeat(n).repeat_interleave(state["recv_counts"])
    out = torch.zeros_like(received)
    for e, expert in enumerate(experts):  # an expert with no row runs on none: its gradient is zero
        rows = (which == e).nonzero()[:, 0]
        out = out.index_add(0, rows, expert(received[rows]))
    return combine(out, weights, state, x.shape[0])


# --- given in the exercise, unchanged here ---------------------------------------------------------------


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
