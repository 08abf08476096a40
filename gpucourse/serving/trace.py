"""A synthetic request trace: who asks what, and when — the workload a serving scheduler is judged on.

Requests arrive as a Poisson process (independent arrivals, ``rate`` a second on average; exponential gaps
between them), optionally in bursts of ``burst`` requests at once, as traffic behind a retrying client or a
batch job looks. Prompt lengths and answer lengths are drawn uniformly from the ranges given. Each request
carries ``max_new_tokens``, the most the client allows, and ``output_len``, where a model would stop on its
own (an end token): a server learns it only when it gets there, and ``max_new_tokens`` is all it may plan
with. A seed makes the same trace every time; a trace saves to and loads from JSON.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from ..files import write_atomic


@dataclass(frozen=True)
class Request:
    """One request: its id, arrival time (s), prompt tokens, token limit, and where it would stop on its own."""

    id: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    output_len: int | None = None  # None: it runs to max_new_tokens unless a real model emits the end token


def poisson_trace(n: int, rate: float, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  max_new_tokens: int | None = None, vocab_size: int = 64, burst: int = 1,
                  seed: int = 0) -> list[Request]:
    """``n`` requests arriving ``rate`` times a second (bursts of ``burst`` at once), prompt and output lengths
    uniform in the closed ranges given, ``max_new_tokens`` the top of ``output_lens`` unless given."""
    rng = random.Random(seed)
    limit = max_new_tokens or output_lens[1]
    now, out = 0.0, []
    for i in range(n):
        if i % burst == 0:
            now += rng.expovariate(rate)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens)))
        out.append(Request(i, now, prompt, limit, min(limit, rng.randint(*output_lens))))
    return out


def save_trace(path, requests: list[Request]) -> None:
    """Write the trace as a JSON list of requests, whole or not at all."""
    write_atomic(path, json.dumps([asdict(r) for r in requests]))


def load_trace(path) -> list[Request]:
    """Read a trace written by :func:`save_trace`; a file that is not one is refused in one sentence."""
    with open(path) as f:
        text = f.read()
    try:
        rows = json.loads(text)
        return [Request(int(r["id"]), float(r["arrival_s"]), tuple(int(t) for t in r["prompt"]),
                        int(r["max_new_tokens"]), None if r.get("output_len") is None else int(r["output_len"]))
                for r in rows]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a request trace: {e.msg} at line {e.lineno}.") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a request trace: each request needs id, arrival_s, prompt and "
                         f"max_new_tokens ({type(e).__name__}: {e}).") from None
