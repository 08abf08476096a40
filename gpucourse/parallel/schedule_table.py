"""Every pipeline schedule of the course, one record each: what the rest of the package needs to know about it.

How a schedule orders its work is its builder — the one-chunk schedules in ``schedules.py``, those with several
chunks a rank or a split backward in ``schedules_virtual.py``. Everything else about it is here, read by the
engine (``parallel/__init__``, the PyTorch pipelines), the config's checks, the memory estimate, the plots, the
command line and the translations into other tools' settings:

- ``chunks``: model chunks a rank holds (0: as many as the run's ``virtual_stages``, at least 2);
- ``split_backward``: the backward split into B (input gradients, what the previous stage waits for) and W
  (weight gradients, run whenever a rank would otherwise idle) — the zero-bubble idea;
- ``least`` and ``multiple_of_pp``: the microbatches it needs, as a multiple of pp (DualPipeV fills both
  chunks of every rank: m ≥ 2·pp), and whether they must come pp at a time (interleaving);
- ``in_flight``: for the one-chunk schedules, the closed form of the microbatches each stage holds at its peak
  (the others are laid out on the simulator's clock);
- ``torch_class`` and ``titan``: ``torch.distributed.pipelining``'s class for it (None: PyTorch has none, so
  ``impl="torch"`` is refused) and torchtitan's ``pipeline_parallel_schedule`` name;
- ``placement``: where a rank's chunks sit, looping through the ranks or in a V (the loss back on rank 0);
- ``interleaved``: v chunks a rank, each microbatch through every chunk in turn, pp microbatches at a time
  (Megatron-LM's interleaving): the transfers once per chunk, the peak in flight reached within 3·pp microbatches;
- ``megatron``: Megatron-LM's own schedule for it ("" where Megatron-LM, and NeMo above it, have none);
- ``formula``: the closed form of its bubble, idle over compute, where it has one (the clock gives exactly it).

A new schedule is its builder and one record here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import schedules_virtual
from .schedules import ScheduleError


@dataclass(frozen=True)
class Schedule:
    name: str
    summary: str
    chunks: int = 1
    split_backward: bool = False
    least: int = 0                 # at least least × pp microbatches (0: one)
    multiple_of_pp: bool = False
    in_flight: Callable[[int, int], list] | None = None
    torch_class: str | None = None
    titan: str = ""
    placement: str = "loop"        # "v": two chunks a rank, the second coming back up (the loss on rank 0)
    interleaved: bool = False
    megatron: str = ""
    formula: str = ""

    @property
    def virtual(self) -> bool:
        """Built by ``schedules_virtual`` (chunks or a split backward) rather than ``schedules``."""
        return self.name in schedules_virtual.SCHEDULES

    def chunks_per_rank(self, virtual_stages: int = 2) -> int:
        return virtual_stages if self.chunks == 0 else self.chunks

    def least_microbatches(self, pp: int) -> int:
        return max(1, self.least * pp, pp if self.multiple_of_pp else 1)

    def problem(self, pp: int, m: int, virtual_stages: int = 2) -> str | None:
        """Why ``m`` microbatches on ``pp`` ranks (``virtual_stages`` chunks, where it asks for them) cannot run
        this schedule, in one sentence; None when they can."""
        if self.chunks == 0 and (not isinstance(virtual_stages, int) or virtual_stages < 2):
            return (f"virtual_stages={virtual_stages!r}: {self.name} needs at least 2 chunks per rank (1 is the "
                    f"one-chunk schedule).")
        if self.least and m < self.least * pp:
            return (f"{self.name} fills all {self.chunks_per_rank(virtual_stages)} chunks of every rank: "
                    f"microbatches={m} must be at least {self.least} × pp = {self.least * pp}.")
        if self.multiple_of_pp and m % pp:
            return (f"{self.name} sends microbatches through a chunk pp at a time: microbatches={m} must be a "
                    f"multiple of pp={pp}.")
        return None


SCHEDULES = {s.name: s for s in (
    Schedule("naive", "one microbatch through every stage at a time", in_flight=lambda pp, m: [1] * pp,
             titan="GPipe", formula="(p-1)/p"),
    Schedule("gpipe", "all forwards, then all backwards", in_flight=lambda pp, m: [m] * pp,
             torch_class="ScheduleGPipe", titan="GPipe", formula="(p-1)/(m+p-1)"),
    Schedule("1f1b", "one forward, one backward once the pipeline is full",
             in_flight=lambda pp, m: [min(pp - stage, m) for stage in range(pp)],  # each stage's warm-up depth
             torch_class="Schedule1F1B", titan="1F1B", megatron="1F1B", formula="(p-1)/(m+p-1)"),
    Schedule("interleaved-1f1b", "1F1B over v chunks a rank, looping through the ranks", chunks=0,
             multiple_of_pp=True, torch_class="ScheduleInterleaved1F1B", titan="Interleaved1F1B", interleaved=True,
             megatron="interleaved 1F1B", formula="(p-1)/(v·m)"),
    Schedule("looped-bfs", "every microbatch through chunk 0, then chunk 1, ...: interleaving at GPipe's memory",
             chunks=0, torch_class="ScheduleLoopedBFS", titan="LoopedBFS"),
    Schedule("zb-h1", "1F1B with B and W apart, W filling the idle slots", split_backward=True, titan="1F1B"),
    Schedule("zbv", "zero bubble on two chunks a rank placed in a V", chunks=2, split_backward=True,
             torch_class="ScheduleZBVZeroBubble", titan="ZBVZeroBubble", placement="v"),
    Schedule("dualpipev", "DeepSeek's DualPipe on the V placement", chunks=2, split_backward=True, least=2,
             torch_class="ScheduleDualPipeV", titan="DualPipeV", placement="v"),
)}


def get(name: str) -> Schedule:
    """The record of schedule ``name``; an unknown name is refused with the known ones."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}.")
    return SCHEDULES[name]

