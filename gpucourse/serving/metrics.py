"""What a serving engineer reads off a run: the latency each request saw and the throughput of the whole.

- **Time to first token (TTFT)**: from a request's arrival to its first token — time in the queue, then its
  prefill. What a chat user feels as "it started answering".
- **Time per output token (TPOT)**: from the first token to the last, divided by the tokens after the first —
  the pace of the stream: decode steps, slowed when prefills or recomputation share the iteration.
- **Throughput**: output tokens per second, from the first arrival to the last finish.
- **Goodput**: requests per second that met both latency targets (TTFT and TPOT at most their targets):
  throughput that counts only the users served well (DistServe, Zhong et al. 2024).
- **KV waste**: the share of allocated KV slots that hold no token, over all iterations — allocated by paging
  (only each sequence's last block is part empty), and had each running sequence reserved its maximum length.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Iteration:
    """One forward of the model in a served trace, and the KV memory after it."""

    end_s: float
    seconds: float
    tokens: int          # tokens fed (prefill and decode)
    sequences: int       # sequences that ran
    blocks_used: int     # KV blocks held after it
    held: list[int]      # tokens cached by each running sequence
    longest: list[int]   # each running sequence's maximum length (prompt + max_new_tokens)


@dataclass
class Report:
    """A served trace: its finished sequences (by request id) and its iterations."""

    sequences: list
    iterations: list[Iteration]
    block_size: int

    def ttft_s(self) -> list[float]:
        """Per request: arrival to first token."""
        return [s.first_token_s - s.request.arrival_s for s in self.sequences]

    def tpot_s(self) -> list[float]:
        """Per request: first token to last, over the tokens after the first (0 for a one-token answer)."""
        return [(s.finish_s - s.first_token_s) / (s.generated - 1) if s.generated > 1 else 0.0
                for s in self.sequences]

    def span_s(self) -> float:
        """First arrival to last finish."""
        return max(s.finish_s for s in self.sequences) - min(s.request.arrival_s for s in self.sequences)

    def throughput(self) -> float:
        """Output tokens per second."""
        return sum(s.generated for s in self.sequences) / self.span_s()

    def goodput(self, ttft_s: float, tpot_s: float) -> float:
        """Requests per second whose TTFT and TPOT both met their targets."""
        good = sum(a <= ttft_s and b <= tpot_s for a, b in zip(self.ttft_s(), self.tpot_s()))
        return good / self.span_s()

    def kv_waste(self) -> dict:
        """Slots holding a token, slots allocated by paging and by maximum-length reservation, over every
        iteration, and the share of each allocation left empty."""
        used = sum(sum(it.held) for it in self.iterations)
        paged = sum(-(-h // self.block_size) * self.block_size for it in self.iterations for h in it.held)
        reserved = sum(sum(it.longest) for it in self.iterations)
        return {"used_slots": used, "paged_slots": paged, "max_length_slots": reserved,  # none held: none wasted
                "paged_waste": 1 - used / paged if paged else 0.0,
                "max_length_waste": 1 - used / reserved if reserved else 0.0}

    def summary(self, ttft_s: float, tpot_s: float) -> dict:
        """The numbers of a run, with goodput under the targets given."""
        ttft, tpot = self.ttft_s(), self.tpot_s()
        return {"requests": len(self.sequences), "iterations": len(self.iterations),
                "output_tokens": sum(s.generated for s in self.sequences), "span_s": self.span_s(),
                "throughput_tok_s": self.throughput(), "goodput_req_s": self.goodput(ttft_s, tpot_s),
                "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
                "tpot_median_s": statistics.median(tpot), "tpot_max_s": max(tpot),
                "preemptions": sum(s.preemptions for s in self.sequences),
                "peak_blocks": max(it.blocks_used for it in self.iterations)}
