"""gpucourse's GPT, the whole model in one file.

Token and position embeddings, a stack of pre-norm blocks (causal self-attention,
then an MLP), a final LayerNorm and an output head. The model knows nothing about
parallelism: strategies in ``gpucourse.parallel`` take this plain module and wrap
it, split it into stages, or swap its Linear layers for sharded ones. That is why
attention reads the number of heads from the width of its projections rather than
from the config: after tensor parallelism a rank holds only its share of heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of one GPT. ``n_embd`` must divide by ``n_head``."""

    vocab_size: int = 64
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    # How attention computes: "flash", PyTorch's fused scaled_dot_product_attention (it keeps no T × T scores and
    # recomputes them in backward); "math", the scores written out and kept for backward, as Megatron-LM ran
    # attention before FlashAttention (what selective recomputation was made for).
    attention: str = "flash"
    # Mixture of experts (0: a dense MLP in every block). See :class:`MoE`.
    moe_experts: int = 0       # E expert MLPs in each MoE block
    moe_top_k: int = 2         # experts each token goes to
    moe_every: int = 1         # an MoE in every block (1), every other block (2), ...
    moe_capacity: float = 0.0  # capacity factor; 0: no token is ever dropped
    moe_aux: float = 0.01      # weight of the load-balancing loss

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (counted from 0) has a mixture of experts in place of its MLP."""
        return self.moe_experts > 0 and (block + 1) % self.moe_every == 0


# Named sizes. ``tiny`` takes a CPU step in a few milliseconds; ``gpt2-small`` is
# GPT-2 small's shape for real GPUs — 12 blocks of 768, GPT-2's vocabulary and
# 1024 positions — with 163.0 M parameters here, not GPT-2's 124 M: the output
# head is not tied to the token embedding (and attention has no key bias).
MODELS = {
    "tiny": GPTConfig(vocab_size=64, block_size=128, n_layer=4, n_head=4, n_embd=64),
    # tiny's width with room for 4 k tokens: long-context runs (context parallelism) on a laptop.
    "tiny-long": GPTConfig(vocab_size=64, block_size=4096, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=64, block_size=256, n_layer=6, n_head=6, n_embd=192),
    "medium": GPTConfig(vocab_size=64, block_size=512, n_layer=8, n_head=8, n_embd=512),
    "gpt2-small": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
}


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees only itself and the past."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        # No key bias: it adds the same amount to every score of a query, which the
        # softmax ignores, so its true gradient is zero and Adam would only amplify
        # rounding noise into it (and make equal runs differ).
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.kernel = cfg.attention

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads·head_dim) -> (B, heads, T, head_dim); heads = whatever this rank holds.
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        # With a cache (generation), x holds only the new tokens: the cache keeps their keys and values and
        # attends the queries over every key it holds for the sequence.
        y = self.attend(q, k, v) if cache is None else cache.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, heads, T, head_dim) queries over keys and values of the same shape.

        A method of its own so that a strategy can replace it for one layer
        (context parallelism attends over keys other ranks hold).
        """
        if self.kernel == "math":
            # The T × T scores written out: softmax keeps its output for backward, dropout its mask, and the
            # weighted sum its (dropped-out) weights — per head, per sequence, T² numbers each.
            T = q.size(-2)
            future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
            scores = (q @ k.transpose(-2, -1) * self.head_dim ** -0.5).masked_fill(future, float("-inf"))
            weights = F.softmax(scores, dim=-1)
            if self.training and self.dropout:
                weights = F.dropout(weights, self.dropout)
            return weights @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class MLP(nn.Module):
    """Two Linear layers with a GELU between, four times wider inside."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class AttachAuxLoss(torch.autograd.Function):
    """Returns ``y`` unchanged; backward also sends ``weight`` as the gradient of ``aux``.

    That adds ``weight · aux`` to whatever loss ``y`` flows into, without the loss
    having to know the term exists: a pipeline stage's router gets its share of
    the load-balancing gradient though the loss is computed on the last stage.
    """

    @staticmethod
    def forward(ctx, y, aux, weight: float):
        ctx.weight = weight
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a router sends each token to ``top_k`` of E expert MLPs.

    The router is one Linear layer to E scores; a softmax makes them probabilities
    p, each token goes to its top_k experts, and its output is their outputs
    weighted by their p renormalised to sum to 1 (Mixtral's routing). Total
    parameters grow with E; the compute per token grows only with top_k.

    **Load balance.** Left alone, a router sends most tokens to a few experts.
    The Switch Transformer's auxiliary loss E · Σᵢ fᵢ · Pᵢ — fᵢ the fraction of
    token choices that went to expert i, Pᵢ the mean probability the router gave
    it — is smallest when both are uniform (value 1 then). It is computed over
    each sequence's tokens and averaged over the sequences (as DeepSeek-V3's
    sequence-wise balance loss), so its value does not depend on how a batch is
    cut into ranks and microbatches: every layout can equal one device. Its
    gradient is added with weight ``aux_coef × aux_weight`` (``aux_weight`` is
    1 / microbatches per step, set by the trainer, as a loss is divided).

    **Capacity.** With ``capacity`` c > 0 an expert takes at most
    ceil(c · tokens · top_k / E) token choices of each forward (first come, first
    served); the others are dropped — that choice adds nothing, the residual
    carries the token on. 0: nothing is dropped.

    :meth:`dispatch` computes the experts' part: here every expert on this
    device, one after the other. Expert parallelism replaces it with an
    all-to-all to the ranks that hold the experts (``parallel/expert_parallel.py``).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.router = nn.Linear(cfg.n_embd, cfg.moe_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.moe_experts))
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity, self.aux_coef, self.aux_weight = cfg.moe_capacity, cfg.moe_aux, 1.0
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start counting afresh: token choices per expert, dropped choices, the aux loss of each forward."""
        self.tokens = torch.zeros(self.num_experts, dtype=torch.long)
        self.dropped, self.aux_values = 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        probs = torch.softmax(self.router(flat).float(), dim=-1)       # (tokens, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)                # (tokens, top_k) each
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        keep = self.within_capacity(chosen)
        aux = balance_loss(probs.view(B, T, -1), chosen.view(B, T, -1))
        with torch.no_grad():
            self.tokens += torch.bincount(chosen.flatten(), minlength=self.num_experts).cpu()
            self.dropped += int((~keep).sum())
            self.aux_values.append(float(aux))
        y = self.dispatch(flat, chosen, weights, keep)
        return AttachAuxLoss.apply(y, aux, self.aux_coef * self.aux_weight).view(B, T, C)

    def within_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        """(tokens, top_k) booleans: the choices each expert takes, in token order, up to its capacity."""
        if not self.capacity:
            return torch.ones_like(chosen, dtype=torch.bool)
        limit = math.ceil(self.capacity * chosen.numel() / self.num_experts)
        onehot = F.one_hot(chosen.flatten(), self.num_experts)
        place = (onehot.cumsum(0) * onehot).sum(-1) - 1               # each choice's place in its expert's queue
        return (place < limit).view_as(chosen)

    def dispatch(self, x, chosen, weights, keep) -> torch.Tensor:
        """Σ over each token's kept choices of weight × expert(token): every expert here, in turn."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = ((chosen == e) & keep).nonzero(as_tuple=True)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch's E · Σᵢ fᵢ · Pᵢ per sequence, averaged over sequences: probs (B, T, E), chosen (B, T, top_k)."""
    E = probs.shape[-1]
    f = F.one_hot(chosen, E).sum(2).float().mean(1) / chosen.shape[-1]  # (B, E): share of the choices
    P = probs.mean(1)                                                  # (B, E): mean probability
    return E * (f * P).sum(-1).mean()


class Block(nn.Module):
    """One transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (a mixture of experts in MoE blocks)."""

    def __init__(self, cfg: GPTConfig, index: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg) if cfg.is_moe(index) else MLP(cfg)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache=cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model.

    ``forward(idx)`` returns logits of shape (batch, time, vocab). Pass ``targets``
    to get the mean cross-entropy loss instead. Pass a ``cache`` (a KV cache of
    :mod:`gpucourse.serving`) to run only new tokens: it gives their ``positions``
    (batch, time), and block i's attention calls ``cache.layer(i).attend(q, k, v)``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2's trick: scale the residual projections so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embedding: (B, T) ids -> (B, T, n_embd); positions 0..T-1 unless given (B, T)."""
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        return self.drop(self.wte(idx) + self.wpe(pos))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (B, T, n_embd) -> (B, T, vocab)."""
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        x = self.embed(idx, None if cache is None else cache.positions)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache=cache.layer(i))
        logits = self.logits(x)
        if targets is None:
            return logits
        return loss_fn(logits, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_params(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to."""
        unused = sum(sum(p.numel() for p in next(m.experts.children()).parameters()) * (m.num_experts - m.top_k)
                     for m in self.modules() if isinstance(m, MoE))
        return self.num_params() - unused


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT, or of one pipeline stage of it, in order.

    Strategies that work block by block (tensor parallel, activation
    checkpointing, FSDP's units, the pipeline split) find them here: a
    ``blocks`` attribute that is an ``nn.ModuleList`` (or, in a stage, an
    ``nn.ModuleDict`` keyed by the block's index in the whole model).
    """
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    raise TypeError(f"{type(module).__name__} has no `blocks` (an nn.ModuleList of transformer blocks), "
                    f"so it cannot be worked on block by block.")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position in the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The same initial weights for a given seed, on every rank and every layout."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
