"""Continuous batching: choose, at every iteration, which sequences run — not once per batch.

**Static batching** admits a batch of requests together and runs it until its longest member has finished;
requests that arrive meanwhile wait, and a member that finished early leaves its seat empty. It must also
reserve every member's longest possible length (prompt + ``max_new_tokens``) in KV memory up front, since
nothing is re-planned until the batch ends.

**Continuous batching** (Orca, Yu et al. 2022; vLLM) schedules per iteration, one forward of the model:

- every running sequence feeds its next tokens: the rest of its prompt (prefill) or the token it has just
  generated (decode). Prefill and decode are one thing here — feed the tokens not yet cached; when a
  sequence's tokens are all cached, the logits of its last one give its next token;
- a sequence finishes at its end token or at ``max_new_tokens``, and its KV blocks go back at once;
- waiting requests are admitted, first come first served, when the free KV blocks hold their prompt — less the
  blocks of it a prefix cache holds already (``prefix_cache``), whose tokens it then need not feed;
- KV blocks are taken as sequences grow (``paged``). When a running sequence needs a block and none is
  free, the youngest running sequence is **preempted by recompute**: its blocks are freed and it goes back
  to the front of the queue, keeping the tokens it has generated; readmitted, it prefills them all again;
- **chunked prefill** (``token_budget``): an iteration feeds at most that many tokens, the running sequences'
  first, so a long new prompt is cut into chunks and never holds up the next tokens of those already running.

:func:`serve` drives a trace through a scheduler with a *runner* — :class:`ModelRunner` decodes with the
model through a paged cache (its tokens equal plain generation for every request); :class:`Simulated` only
counts tokens — and a *clock*: :func:`wall_clock` measures this machine, :class:`gpucourse.modeled.serve_clock.ModeledClock`
models one iteration's seconds with the serving planner's own step function (``gpucourse.modeled.serve_plan.step``). The
result is a :class:`~gpucourse.serving.metrics.Report`: time to first token, time per output token, throughput,
goodput.
On the bench's bursty trace (``gpucourse bench --only continuous_vs_static_throughput``, modeled clock) continuous
batching makes 2.5 to 2.6 times static batching's tokens per second in the same KV memory.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .kv_cache import check_fits, inference, next_token
from .metrics import Iteration, Report
from .paged import BlockAllocator, PagedKVCache
from .trace import Request


@dataclass(eq=False)
class Sequence:
    """A request being served: its tokens so far (prompt, then generated) and how many are in the cache."""

    request: Request
    tokens: list[int]
    cached: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def longest(self) -> int:
        """Tokens it may come to hold: what static batching reserves."""
        return len(self.request.prompt) + self.request.max_new_tokens


class Scheduled(NamedTuple):
    """One sequence's part of an iteration: the sequence, and how many of its tokens not yet cached it feeds."""

    seq: Sequence
    tokens: int


class SchedulerOutput(list):
    """What the scheduler hands the model runner each iteration, as vLLM's engine does: the sequences that run, in
    order, each a :class:`Scheduled` (the list itself), and the requests admitted and preempted to get there. The
    runner reads the sequences; the block pool and the sequences' block tables stay the scheduler's."""

    def __init__(self, scheduled=(), admitted=(), preempted=()):
        super().__init__(scheduled)
        self.admitted, self.preempted = list(admitted), list(preempted)

    @property
    def tokens(self) -> int:
        """Tokens fed this iteration, every sequence's."""
        return sum(part.tokens for part in self)


class Scheduler:
    """Which sequences feed how many tokens, each iteration, within ``blocks``' KV memory."""

    def __init__(self, blocks: BlockAllocator, static: bool = False, token_budget: int | None = None,
                 eos: int | None = None):
        if static and token_budget is not None:
            raise ValueError("static batching feeds whole prompts; a token budget (chunked prefill) is for "
                             "continuous batching.")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"a token budget of {token_budget} would never feed a token; it must be at least 1.")
        self.blocks, self.static, self.token_budget, self.eos = blocks, static, token_budget, eos
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the order they were admitted: the youngest last
        self.finished: list[Sequence] = []

    def check(self, request: Request) -> None:
        """Refuse a request that could not fit even if it had the whole KV memory to itself."""
        need = self.blocks.blocks_for(len(request.prompt) + request.max_new_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {request.id} ({len(request.prompt)} prompt tokens + {request.max_new_tokens} "
                             f"new) needs {need} KV blocks of {self.blocks.block_size} tokens, more than the whole "
                             f"budget of {self.blocks.num_blocks}.")

    def add(self, request: Request) -> None:
        """Queue an arrived request."""
        self.waiting.append(Sequence(request, list(request.prompt)))

    def schedule(self) -> SchedulerOutput:
        """This iteration's work: each sequence that runs with the tokens it feeds, and who was admitted and
        preempted."""
        return self._static() if self.static else self._continuous()

    def _static(self):
        out = SchedulerOutput()
        if not self.running:  # a new batch only when the last one has wholly finished
            while self.waiting and self.blocks.can_grow(self.waiting[0].request.id, self.waiting[0].longest):
                self.running.append(self.waiting.popleft())
                self.blocks.grow(self.running[-1].request.id, self.running[-1].longest)
                out.admitted.append(self.running[-1].request.id)
        out.extend(Scheduled(seq, len(seq.tokens) - seq.cached) for seq in self.running)
        return out

    def _continuous(self):
        budget, out = self.token_budget or math.inf, SchedulerOutput()
        # Oldest first: a sequence short of memory preempts the youngest, itself last, never one already planned.
        for seq in list(self.running):
            n = min(len(seq.tokens) - seq.cached, budget)
            if seq not in self.running or n == 0:
                break
            while seq in self.running and not self.blocks.can_grow(seq.request.id, seq.cached + n):
                out.preempted.append(self.running[-1].request.id)
                self._preempt(self.running[-1])
            if seq in self.running:
                self.blocks.grow(seq.request.id, seq.cached + n)
                out.append(Scheduled(seq, n))
                budget -= n
        # Admit only in an iteration that preempted nobody: what was just freed is what the running need.
        while not out.preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            cached = self.blocks.admit(seq.request.id, seq.tokens)  # tokens a prefix cache holds already, if any
            if cached is None:
                break  # first come, first served: nobody overtakes the request at the front
            self.running.append(self.waiting.popleft())
            out.admitted.append(seq.request.id)
            seq.cached = cached
            n = min(len(seq.tokens) - seq.cached, budget)
            self.blocks.grow(seq.request.id, seq.cached + n)
            out.append(Scheduled(seq, n))
            budget -= n
        return out

    def _preempt(self, seq):
        """Recompute: free its blocks and forget its cache; it waits first in line, keeping its tokens."""
        self.blocks.release(seq.request.id)
        seq.cached, seq.preemptions = 0, seq.preemptions + 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def advance(self, seq: Sequence, fed: int, token: int | None, now: float) -> None:
        """After an iteration: ``fed`` tokens of ``seq`` are cached, and ``token`` is its next, if it made one."""
        seq.cached += fed
        self.blocks.commit(seq.request.id, seq.tokens[:seq.cached])
        if token is None:
            return
        seq.tokens.append(token)
        if seq.first_token_s is None:
            seq.first_token_s = now
        if token == self.eos or seq.generated == seq.request.max_new_tokens:
            seq.finish_s = now
            self.blocks.release(seq.request.id)
            self.running.remove(seq)
            self.finished.append(seq)


class ModelRunner:
    """Runs an iteration's work through the model and a paged cache on the scheduler's blocks; greedy tokens."""

    def __init__(self, model, blocks: BlockAllocator):
        weight = next(model.parameters())
        self.model, self.cache = model, PagedKVCache(model.cfg, blocks, dtype=weight.dtype, device=weight.device)

    def check(self, request: Request) -> None:
        """Refuse a request the model's context or vocabulary cannot hold."""
        cfg = self.model.cfg
        check_fits(cfg, len(request.prompt), request.max_new_tokens, f"request {request.id}")
        if max(request.prompt) >= cfg.vocab_size:
            raise ValueError(f"request {request.id}'s prompt holds token {max(request.prompt)}, outside the model's "
                             f"vocabulary of {cfg.vocab_size} (token ids 0 to {cfg.vocab_size - 1}).")

    def __call__(self, work):
        chunks = [(seq.request.id, seq.cached, seq.tokens[seq.cached:seq.cached + n]) for seq, n in work]
        with inference(self.model):
            tokens = next_token(self.cache.feed_chunks(self.model, chunks)).tolist()
        return [t if seq.cached + n == len(seq.tokens) else None for (seq, n), t in zip(work, tokens)]


class Simulated:
    """No model: a sequence whose tokens are all fed makes token ``eos + 1``, or ``eos`` at its ``output_len``.
    ``cfg``: the model whose context a request must fit, as :class:`ModelRunner` would refuse it (None: any
    length)."""

    def __init__(self, eos: int, cfg=None):
        self.eos, self.cfg = eos, cfg

    def check(self, request: Request) -> None:
        """Refuse a request longer than ``cfg``'s context; without ``cfg`` any request fits."""
        if self.cfg is not None:
            check_fits(self.cfg, len(request.prompt), request.max_new_tokens, f"request {request.id}")

    def __call__(self, work):
        return [None if seq.cached + n < len(seq.tokens)
                else self.eos if seq.generated + 1 == seq.request.output_len else self.eos + 1 for seq, n in work]


def wall_clock(work, run):
    """Seconds this machine took to run the iteration, and its tokens."""
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def serve(trace: list[Request], scheduler: Scheduler, runner, clock=wall_clock, on_iteration=None) -> Report:
    """Serve every request of ``trace``: arrivals join the queue on the clock, the scheduler plans each iteration,
    the runner makes its tokens and the clock says how long it took (``clock(work, run)`` calls ``run()`` and
    returns its seconds and tokens). Bad requests are refused before anything runs. ``on_iteration(finished,
    requests, now_s)``, if given, hears after every iteration how many requests have finished."""
    if not trace:
        raise ValueError("the trace holds no requests: there is nothing to serve.")
    if len({r.id for r in trace}) < len(trace):
        raise ValueError("every request of a trace needs an id of its own; some ids repeat.")
    for request in trace:
        scheduler.check(request)
        runner.check(request)
    arrivals, now, log = deque(sorted(trace, key=lambda r: r.arrival_s)), 0.0, []
    while arrivals or scheduler.waiting or scheduler.running:
        while arrivals and arrivals[0].arrival_s <= now:
            scheduler.add(arrivals.popleft())
        work = scheduler.schedule()
        if not work:
            if not arrivals:
                raise RuntimeError(f"the scheduler planned nothing with {len(scheduler.waiting)} requests waiting "
                                   f"and {len(scheduler.running)} running.")
            now = arrivals[0].arrival_s  # idle until the next request arrives
            continue
        seconds, tokens = clock(work, lambda: runner(work))
        now += seconds
        for (seq, n), token in zip(work, tokens):
            scheduler.advance(seq, n, token, now)
        log.append(Iteration(now, seconds, sum(n for _, n in work), len(work), scheduler.blocks.used(),
                             [seq.cached for seq in scheduler.running], [seq.longest for seq in scheduler.running]))
        if on_iteration is not None:
            on_iteration(len(scheduler.finished), len(trace), now)
    return Report(sorted(scheduler.finished, key=lambda s: s.request.id), log, scheduler.blocks.block_size)
