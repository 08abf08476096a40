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
from ..readable import ConfigError
from ..values import NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE, POSITIVE_NUMBER, json_value, ordered, whole


@dataclass(frozen=True)
class Request:
    """One request: its id, arrival time (s), prompt tokens, token limit, and where it would stop on its own.
    A request that could never be served (no prompt, no token to make, an arrival that is not a time) is refused
    in one sentence as it is made."""

    id: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    output_len: int | None = None  # None: it runs to max_new_tokens unless a real model emits the end token

    def __post_init__(self):
        whole().check(self.id, "id")
        where = f"request {self.id}'s "
        NON_NEGATIVE_NUMBER.check(self.arrival_s, where + "arrival_s")
        if not isinstance(self.prompt, tuple) or not self.prompt:
            raise ConfigError(f"{where}prompt must be a list of at least one token id (a model continues a prompt).")
        for token in self.prompt:
            NON_NEGATIVE.check(token, where + "prompt token")
        POSITIVE.check(self.max_new_tokens, where + "max_new_tokens")
        if self.output_len is not None:
            POSITIVE.check(self.output_len, where + "output_len")


def poisson_trace(n: int, rate: float, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  max_new_tokens: int | None = None, vocab_size: int = 64, burst: int = 1,
                  seed: int = 0) -> list[Request]:
    """``n`` requests arriving ``rate`` times a second (bursts of ``burst`` at once), prompt and output lengths
    uniform in the closed ranges given, ``max_new_tokens`` the top of ``output_lens`` unless given."""
    for name, value in (("n", n), ("burst", burst), ("vocab_size", vocab_size), *(
            (f"{what}[{i}]", v) for what, pair in (("prompt_lens", prompt_lens), ("output_lens", output_lens))
            for i, v in enumerate(pair))):
        POSITIVE.check(value, name)
    POSITIVE_NUMBER.check(rate, "rate")
    ordered(prompt_lens, "prompt_lens")
    ordered(output_lens, "output_lens")
    if max_new_tokens is not None:
        POSITIVE.check(max_new_tokens, "max_new_tokens")
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


FIELDS = ("id", "arrival_s", "prompt", "max_new_tokens")  # what each request of a trace file holds (output_len too)


def parse_trace(text: str) -> list[Request]:
    """The requests of a trace's JSON text; ValueError says why text that is not one is not."""
    rows = json_value(text)
    if not isinstance(rows, list) or not rows:
        raise ValueError("a trace is a JSON list of one or more requests" + (
            "; this one is empty" if rows == [] else f", not {type(rows).__name__}"))
    requests = []
    for i, row in enumerate(rows):
        missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise ValueError(f"request {i} lacks {', '.join(missing)} (each request is an object of "
                             f"{', '.join(FIELDS)} and optionally output_len)")
        if not isinstance(row["prompt"], list):
            raise ValueError(f"request {i}'s prompt must be a list of token ids")
        requests.append(Request(row["id"], row["arrival_s"], tuple(row["prompt"]), row["max_new_tokens"],
                                row.get("output_len")))
    if len({r.id for r in requests}) < len(requests):
        raise ValueError("every request of a trace needs an id of its own; some ids repeat")
    return requests


def load_trace(path) -> list[Request]:
    """Read a trace written by :func:`save_trace`; a file that is not one is refused in one sentence."""
    with open(path) as f:
        text = f.read()
    try:
        return parse_trace(text)
    except ValueError as e:
        raise ValueError(f"{path} is not a request trace: {str(e).rstrip('.')}.") from None
