"""The serving runtime's scheduler on a modeled clock: each iteration it plans timed by the serving model.

:class:`ModeledClock` is a clock for :func:`gpucourse.serving.scheduler.serve`: the seconds of an iteration are
what :func:`gpucourse.modeled.serve_plan.step` says of its own work, the function ``gpucourse plan --serve`` and
the serving planner time their batches with, so the simulator and the planner keep one clock. :func:`simulate`
serves a trace with no model on that clock: what the schedule alone does, in a blink. (The scheduler is the
runtime's; the clock is a model's, so it lives here, on paper.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..serving.paged import BlockAllocator
from ..serving.scheduler import Report, Request, Scheduler, Simulated, serve
from .serve_plan import Chunk, step
from .serve_published import LLAMA2_7B


@dataclass(frozen=True)
class ModeledClock:
    """Modeled seconds of an iteration: :func:`gpucourse.modeled.serve_plan.step` on the iteration's own work, the
    step-time function the serving planner and ``gpucourse plan --serve`` use. The sequences that feed the one
    token they made last are decodes, each reading its cache (what it holds cached, and the new token); the others
    feed prompt chunks (a whole prompt, a token budget's piece of one, or a preempted sequence's recompute), each
    attending to what it has cached and to its own tokens — all in one forward, every matmul one row a token fed,
    as vLLM's scheduler batches prefill and decode. An iteration of one sequence or of fifty costs nearly the same,
    as decode does.

    ``shape`` (None: Llama 2 7B, the 7 B model with a 0.5 MB cache a token), ``gpu``, ``tp``, ``weights``, ``kv``:
    what is served, as :mod:`gpucourse.modeled.serve_plan` takes them; the default is Llama 2 7B in bf16 on one H100."""

    shape: object = None
    gpu: str = "h100"
    tp: int = 1
    weights: str = "bf16"
    kv: str = "bf16"

    def parts(self, work) -> tuple[int, float, list]:
        """The iteration as ``serve_plan.step`` takes it: (decodes, their mean context, prompt chunks)."""
        decodes, held, chunks = 0, 0, []
        for seq, n in work:
            if n == 1 and seq.generated > 0 and seq.cached == len(seq.tokens) - 1:  # the token it made last
                decodes, held = decodes + 1, held + seq.cached + 1
            else:
                chunks.append(Chunk(n, seq.cached, 1, seq.cached + n == len(seq.tokens)))
        return decodes, held / decodes if decodes else 0.0, chunks

    def step(self, work) -> dict:
        """``serve_plan.step``'s whole answer for the iteration: seconds, and what they are made of."""
        decodes, context, chunks = self.parts(work)
        return step(self._shape(), self.gpu, decodes, context, chunks, self.tp, weights=self.weights, kv=self.kv)

    def seconds(self, work) -> float:
        return self.step(work)["seconds"]

    def __call__(self, work, run):
        return self.seconds(work), run()

    def _shape(self):
        if self.shape is not None:
            return self.shape
        return LLAMA2_7B


def simulate(trace: list[Request], num_blocks: int, block_size: int, static: bool = False,
             token_budget: int | None = None, cost: ModeledClock = ModeledClock()) -> Report:
    """Serve ``trace`` with no model, on the modeled clock: what the schedule alone does, in a blink."""
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), static, token_budget, eos=-1)
    return serve(trace, scheduler, Simulated(eos=-1), cost)
