"""A built-in, generated corpus and a deterministic batch order.

Nothing is downloaded. The corpus is English-like text written by a small
grammar (simple sentences and sums such as ``7 plus 5 is 12.``) with a fixed
random seed, encoded one character per token. It has enough structure that a
tiny GPT's loss falls clearly within a hundred CPU steps (words, spelling, and
arithmetic that needs attention to earlier tokens), yet is cheap to generate.

Batches depend only on ``(seed, step)``: the global batch of a step is the same
whatever the layout, and data-parallel rank ``r`` of ``dp`` takes rows
``r·B/dp … (r+1)·B/dp`` of it. That is what makes every layout comparable with
the single-device run.
"""

from __future__ import annotations

import functools
import random

import torch

VOCAB = "\n !',.:?abcdefghijklmnopqrstuvwxyz0123456789"
_STOI = {c: i for i, c in enumerate(VOCAB)}
_IDS = bytes.maketrans(VOCAB.encode(), bytes(range(len(VOCAB))))  # character byte -> token id, in one C call

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher",
             "our robot", "the gpu", "every rank", "the model"]
_VERBS = ["sees", "likes", "follows", "builds", "finds", "trains", "sends", "reads"]
_OBJECTS = ["the ball", "a red box", "the river", "a long road", "the gradient", "a tensor",
            "the loss", "a big tree", "the message", "some bread"]
_PLACES = ["at home", "in the park", "on the ring", "near the sea", "after lunch", "every day"]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return f"{a} plus {b} is {a + b}."
    if kind < 0.45:
        word = rng.choice(_OBJECTS).split()[-1]
        return f"spell {word}: {' '.join(word)}."
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(_PLACES)}"
    return s + rng.choice([".", ".", "!", "?"])


@functools.lru_cache(maxsize=4)
def corpus(n_chars: int = 400_000, seed: int = 1234) -> torch.Tensor:
    """The whole corpus as a 1-D tensor of token ids (cached per process)."""
    rng = random.Random(seed)
    parts, total = [], 0
    while total < n_chars:
        s = _sentence(rng) + ("\n" if rng.random() < 0.2 else " ")
        parts.append(s)
        total += len(s)
    text = "".join(parts)[:n_chars]  # the grammar writes only characters of VOCAB
    return torch.frombuffer(bytearray(text.encode().translate(_IDS)), dtype=torch.uint8).long()


def encode(text: str) -> torch.Tensor:
    """Characters -> token ids (characters outside the vocabulary are refused)."""
    return torch.tensor([_STOI[c] for c in text], dtype=torch.long)


def decode(ids) -> str:
    """Token ids -> text."""
    return "".join(VOCAB[int(i)] for i in ids)


def global_batch(step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of one optimizer step: two (batch_size, seq_len) tensors."""
    data = corpus()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    offsets = torch.arange(seq_len)
    x = data[starts[:, None] + offsets]
    y = data[starts[:, None] + offsets + 1]
    return x, y


def shard(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Row block ``index`` of ``count`` equal blocks (the batch must divide evenly)."""
    rows = t.shape[0] // count
    return t[index * rows:(index + 1) * rows]


def rank_batch(step: int, batch_size: int, seq_len: int, seed: int, dp_rank: int, dp: int,
               positions: torch.Tensor | None = None):
    """This data-parallel rank's share of the global batch of ``step`` (only ``positions`` of each sequence, if given)."""
    x, y = global_batch(step, batch_size, seq_len, seed)
    x, y = shard(x, dp_rank, dp), shard(y, dp_rank, dp)
    if positions is not None:  # context parallelism: this rank's tokens of every sequence, targets alike
        x, y = x[:, positions], y[:, positions]
    return x, y


def context_positions(seq_len: int, cp_rank: int, cp: int, zigzag: bool = False) -> torch.Tensor:
    """The token positions context-parallel rank ``cp_rank`` of ``cp`` holds, in order.

    Plain: chunk ``cp_rank`` of ``cp`` equal chunks. Zig-zag (causal load balance):
    the sequence cut into 2·cp chunks, rank i holding chunks i and 2·cp − 1 − i —
    an early chunk (few keys to attend to) with a late one (many), so every rank
    does the same attention work under a causal mask.
    """
    if not zigzag:
        return torch.arange(seq_len).chunk(cp)[cp_rank]
    chunks = torch.arange(seq_len).chunk(2 * cp)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]])
