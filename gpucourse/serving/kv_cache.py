"""Generation with a KV cache: run each prompt through the model once (prefill), then one token a step (decode).

A language model makes one token per forward. Without a cache, step n runs the whole prefix of n tokens
through every block again, although the keys and values of the first n - 1 tokens are exactly what the
previous step computed: generating N tokens after a prompt of P costs about N·(P + N/2) token-forwards.
With a cache each block's attention keeps the keys and values it has computed; a decode step runs only the
newest token through the model and attends its query over the cached keys: N token-forwards, plus reading
the cache, which grows with the sequence. The price is memory: 2 (K and V) × n_layer × n_embd numbers per
token — gpt2-small in fp32: 2 · 12 · 768 · 4 B = 72 KiB a token, 72 MiB for one sequence of 1024 tokens.
That memory, not compute, is what limits how many sequences a server decodes at once (see ``paged``).

**Padding.** Prompts of different lengths are fed as one batch padded on the right: token j of every
sequence sits at position j, so positions need no per-sequence offset, and a causal mask alone keeps every
real token from seeing the padding after it. Only real tokens are written to the cache, and a sequence's
next token goes at its own length, where its padding was. (Left padding, as Hugging Face generates, puts
every sequence's end in the last column but shifts each sequence's positions by its padding and has to mask
the padded keys in every later step.)

**The cache protocol.** ``GPT.forward(idx, cache=c)`` embeds ``idx`` at ``c.positions`` (B, T) and block i's
attention calls ``c.layer(i).attend(q, k, v)``, which stores the new keys and values and attends the new
queries over every key of the sequence up to each query's position. :class:`Cache` does that attend;
a subclass says where keys and values live: :class:`KVCache` here, one contiguous tensor per layer with a
row per sequence; :class:`~gpucourse.serving.paged.PagedKVCache`, blocks found through a block table.
Attention reads heads from the tensors, so a cache of a tensor-parallel rank holds only that rank's heads.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class Cache:
    """Keys and values of the tokens already seen; subclasses implement ``write`` and ``read``."""

    positions: torch.Tensor  # (B, T): where each token being fed sits in its sequence
    valid: torch.Tensor      # (B, T) bools: the real tokens (the rest pad a row to T)

    def layer(self, i: int) -> "LayerCache":
        """What block ``i``'s attention calls."""
        return LayerCache(self, i)

    def feed(self, model, idx: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
             every: bool = False) -> torch.Tensor:
        """Run ``counts[b]`` new tokens of row b (``idx`` (B, T), right-padded) after the ``starts[b]`` tokens
        already cached; return each row's logits (B, vocab) at its last new token, or at every new token
        (B, T, vocab) if ``every`` (what verifying several proposed tokens at once needs: ``speculative``)."""
        steps = torch.arange(idx.shape[1], device=idx.device)
        self.valid = steps[None, :] < counts[:, None]
        # A pad token sits at its row's last real position, so it never asks for a position past the context.
        self.positions = starts[:, None] + torch.minimum(steps[None, :], counts[:, None] - 1)
        logits = model(idx, cache=self)
        return logits if every else logits[torch.arange(len(counts)), counts - 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the real tokens' keys and values (B, heads, T, head_dim) at their positions."""
        raise NotImplementedError

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every row (B, heads, S, head_dim), the one at position j in column j."""
        raise NotImplementedError


class LayerCache:
    """One block's view of a :class:`Cache`: what its attention calls in place of ``attend``."""

    def __init__(self, cache: Cache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new keys and values, then attend the new queries over all the sequence's keys."""
        self.cache.write(self.index, k, v)
        keys, values = self.cache.read(self.index)
        return attend_positions(q, keys, values, self.cache.positions)


def attend_positions(q, keys, values, positions) -> torch.Tensor:
    """Queries (B, H, T, d) at ``positions`` (B, T) over keys and values (B, H, S, d) at positions 0..S-1:
    each query sees the keys at its own position and before (a causal mask made from positions)."""
    seen = torch.arange(keys.shape[-2], device=keys.device)[None, None, :] <= positions[:, :, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[:, None])


class KVCache(Cache):
    """A contiguous cache: for each layer a (batch, heads, max_len, head_dim) tensor of keys and one of values."""

    def __init__(self, cfg, batch: int, max_len: int, heads: int | None = None, dtype=torch.float32, device=None):
        shape = (cfg.n_layer, batch, heads or cfg.n_head, max_len, cfg.head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # tokens cached per row

    def bytes(self) -> int:
        """Memory the cache holds, filled or not."""
        return 2 * self.k.numel() * self.k.element_size()

    def feed_rows(self, model, idx: torch.Tensor, counts: torch.Tensor, every: bool = False) -> torch.Tensor:
        """Feed every row ``counts`` new tokens after those it holds; its logits at each row's last new token (at
        every new token if ``every``)."""
        logits = self.feed(model, idx, self.lengths, counts, every)
        self.lengths = self.lengths + counts
        return logits

    def write(self, layer, k, v):
        row, t = self.valid.nonzero(as_tuple=True)
        at = self.positions[row, t]
        self.k[layer][row, :, at] = k[row, :, t]
        self.v[layer][row, :, at] = v[row, :, t]

    def read(self, layer):
        end = int(self.positions.max()) + 1
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, vocab): the most likely (temperature 0, greedy), or drawn from the
    softmax of logits / temperature, among the ``top_k`` most likely only if given."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def check_fits(cfg, prompt_len: int, max_new_tokens: int, name: str = "a prompt") -> None:
    """Refuse, in one sentence, what the model's context (``block_size`` positions) cannot hold."""
    if prompt_len < 1:
        raise ValueError(f"{name} is empty: generation needs at least one token to continue.")
    if prompt_len > cfg.block_size:
        raise ValueError(f"{name} of {prompt_len} tokens is longer than the model's context of "
                         f"{cfg.block_size} tokens (block_size).")
    # The last new token is sampled, never fed back: it needs no position of its own.
    if prompt_len + max_new_tokens - 1 > cfg.block_size:
        raise ValueError(f"{name} of {prompt_len} tokens and {max_new_tokens} new tokens need "
                         f"{prompt_len + max_new_tokens - 1} positions; the model has {cfg.block_size} (block_size).")


def check_prompts(cfg, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Refuse, in one sentence, prompts the model cannot continue by ``max_new_tokens`` tokens."""
    if not prompts:
        raise ValueError("there are no prompts to continue.")
    for i, p in enumerate(prompts):
        check_fits(cfg, len(p), max_new_tokens, f"prompt {i}")
        if not all(0 <= t < cfg.vocab_size for t in p):
            raise ValueError(f"prompt {i} holds a token outside the model's vocabulary of {cfg.vocab_size}.")


@contextlib.contextmanager
def inference(model):
    """Evaluation mode (no dropout) and no autograd for the block, the model's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None, use_cache: bool = True,
             return_logits: bool = False, heads: int | None = None):
    """Continue each prompt (a list of token ids) by ``max_new_tokens`` tokens; return them (B, max_new_tokens).

    ``use_cache=False`` recomputes the whole prefix at every step with the plain forward, the reference the
    cache must equal. ``return_logits``: also return the logits each token was chosen from (B, new, vocab).
    ``heads``: the attention heads the cache keeps, those this rank's attention holds (tensor parallelism
    leaves n_head / tp a rank); all of them by default.
    """
    cfg = model.cfg
    check_prompts(cfg, prompts, max_new_tokens)
    weight = next(model.parameters())
    B, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(B, longest + max_new_tokens, dtype=torch.long, device=weight.device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts], device=weight.device)
    rows, chosen, seen = torch.arange(B, device=weight.device), [], []
    with inference(model):
        cache = KVCache(cfg, B, tokens.shape[1], heads, weight.dtype, weight.device) if use_cache else None
        idx, counts = tokens[:, :longest], lengths  # the first step feeds the prompts (prefill)
        for _ in range(max_new_tokens):
            if cache is None:
                logits = model(tokens[:, :int(lengths.max())])[rows, lengths - 1]
            else:
                logits = cache.feed_rows(model, idx, counts)
            new = next_token(logits, temperature, top_k, generator)
            tokens[rows, lengths] = new
            lengths = lengths + 1
            idx, counts = new[:, None], torch.ones_like(counts)  # then one token a step (decode)
            chosen.append(new)
            if return_logits:
                seen.append(logits)
    out = torch.stack(chosen, 1)
    return (out, torch.stack(seen, 1)) if return_logits else out
