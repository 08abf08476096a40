"""Whether a mutant the checks did not catch is the solution in another spelling: a differential test.

A mutant (:mod:`gpucourse.grading.mutation`) that scores full marks is either a gap in the checks or a change that
makes no difference (``x * 2`` for ``x + x``). Which one is decided here by running it, never by reading it: the
solution and the mutant are called on the same inputs and everything that comes back is compared.

The inputs are the checks' own. Each check of the exercise runs once against the solution, under the seed of the
run (its generators draw the shapes, dtypes, values and hyper-parameters from it; the check names its world
size), and every request it makes of the ranks (load the file, call a function, run a probe) is recorded with
what came back. The mutant then gets the same requests, in the same order, on ranks of its own in the same
sandbox, and each reply is compared with the solution's: the value returned, the arguments as they were after the
call (an input changed in place), which argument the value shares memory with, each collective's operation,
bytes, group, peer and whether it was asynchronous, the exception raised if one was; a hang or a dead rank is a
difference. Tensors must be equal bit for bit (same dtype, shape and ``requires_grad``), numbers exactly equal,
containers equal item by item. Times are not compared; nor is anything that differs between two runs of the
solution itself, which is replayed once against its own recording to find it. The mutant is *equivalent* under a
seed when no reply differs; the first difference is reported.

It runs in the grading process's place (``python -m gpucourse.grading.start`` with ``"host":
"equivalence"``, started by :func:`gpucourse.grading.runner.compare_runs`), with the same sandbox and walls:
neither the solution nor the mutant runs in this process.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import time
from dataclasses import dataclass, field

from ..files import write_atomic
from . import core, host

SOLUTIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "solutions")
_IGNORED_REPLY_KEYS = ("time_s", "ok")
_IGNORED_COMM_KEYS = ("t",)


class Differs(Exception):
    """A reply of the mutant that is not the solution's; the message says where and how."""


@dataclass
class _Step:
    requests: bytes          # the pickled requests, one per rank
    budget: float
    replies: bytes           # the solution's replies, pickled; or the exception it raised (LearnerError only)


@dataclass
class _Recording:
    """What the checks asked of the solution under one seed, check by check, and how it answered."""

    checks: list = field(default_factory=list)   # (check name, world size, [steps])
    noise: set = field(default_factory=set)      # paths whose value differs between two runs of the solution
    trouble: list = field(default_factory=list)  # checks the solution itself did not pass under this seed


class _RecordingBatch:
    """A batch of ranks that keeps every request and its replies (what :class:`core.CheckContext` calls); the
    batch's other attributes are the batch's own."""

    def __init__(self, batch: host.Batch, steps: list):
        self.batch, self.steps = batch, steps

    def __getattr__(self, name: str):
        return getattr(self.batch, name)

    def request(self, requests: list[dict], budget: float, path: str, **options) -> list[dict]:
        sent = pickle.dumps(requests)
        try:
            replies = self.batch.request(requests, budget, path, **options)
        except host.LearnerError as e:
            self.steps.append(_Step(sent, budget, pickle.dumps(_raised(e))))
            raise
        self.steps.append(_Step(sent, budget, pickle.dumps(replies)))
        return replies


def _raised(e: host.LearnerError) -> tuple:
    """What a raised exception is compared by: its type and rank (its sentence names the file, which differs)."""
    return ("raised", e.exc_type, e.rank)


class Tester:
    """Records the solution once per exercise and seed, then compares mutants with it."""

    def __init__(self, spec: dict, sandbox: host.Sandbox, known: dict[str, core.Exercise]):
        self.spec, self.sandbox, self.known = spec, sandbox, known
        self.recordings: dict[tuple[str, int], _Recording] = {}
        self.different: dict[str, dict] = {}  # a file already found different, under an earlier seed
        self.placed = 0

    def compare(self, ex_id: str, path: str, seed: int) -> dict:
        """The verdict on the mutant ``path`` of exercise ``ex_id`` under ``seed``: a dict with ``equivalent``,
        ``difference`` (None or one sentence), ``compared`` (how many requests were) and ``trouble``."""
        start = time.monotonic()
        ex = self.known[ex_id]
        result = {"exercise": ex_id, "file": path, "seed": seed, "equivalent": False, "difference": None,
                  "compared": 0, "trouble": [], "time_s": 0.0}
        if path in self.different:
            earlier = self.different[path]
            result["difference"] = f"(under seed {earlier['seed']}) {earlier['difference']}"
        else:
            recording = self._recording(ex, seed)
            result["trouble"] = recording.trouble
            try:
                result["compared"] = self._replay(ex, recording, self._place(ex, path), seed)
                result["equivalent"] = True
            except Differs as e:
                result["difference"] = str(e)
                self.different[path] = result
        result["time_s"] = round(time.monotonic() - start, 3)
        return result

    def _place(self, ex: core.Exercise, path: str) -> str:
        """A copy of ``path`` in a folder of its own in the sandbox, readable by the sandbox's user."""
        self.placed += 1
        folder = os.path.join(self.sandbox.private, f"{ex.id}-{self.placed}")
        os.makedirs(folder)
        copy = os.path.join(folder, f"{ex.module}.py")
        shutil.copyfile(path, copy)
        if self.sandbox.user is not None:
            os.chown(folder, 0, self.sandbox.user)
            os.chmod(folder, 0o750)
            os.chown(copy, 0, self.sandbox.user)
            os.chmod(copy, 0o640)
        return copy

    def _recording(self, ex: core.Exercise, seed: int) -> _Recording:
        key = (ex.id, seed)
        if key not in self.recordings:
            solution = os.path.join(SOLUTIONS, f"{ex.module}.py")
            recording = self._record(ex, self._place(ex, solution), seed)
            noise: set = set()
            try:
                self._replay(ex, recording, self._place(ex, solution), seed, noise)
            except Differs as e:  # the solution's own second run hung or died: leave that step out
                recording.trouble.append(f"the solution's second run: {e}")
            recording.noise = noise
            self.recordings[key] = recording
        return self.recordings[key]

    def _budget_factor(self) -> float:
        return host.load_factor() * self.spec["timeout_scale"]

    def _record(self, ex: core.Exercise, file: str, seed: int) -> _Recording:
        recording = _Recording()
        factor = self._budget_factor()
        for world_size, checks in _groups(ex.checks):
            batch = None
            for check in checks:
                budget = check.budget_s * factor
                steps: list[_Step] = []
                recording.checks.append((check.name, world_size, steps))
                try:
                    batch = batch or _start(self.sandbox, ex, world_size, file, budget)
                    ctx = core.CheckContext(ex, check, file, seed, world_size=world_size,
                                            batch=_RecordingBatch(batch, steps), budget_s=budget)
                    ctx.load()
                    check.fn(ctx)
                except Exception as e:  # noqa: BLE001 -- whatever stopped the solution: said, and its steps kept
                    recording.trouble.append(f"{check.name}: {type(e).__name__}: {e}"[:300])
                batch = _end_if_dead(self.sandbox, batch)
            if batch is not None:
                self.sandbox.finish_batch(batch)
        return recording

    def _replay(self, ex: core.Exercise, recording: _Recording, file: str, seed: int, noise: set | None = None) -> int:
        """Send ``file``'s ranks every recorded request; Differs at the first reply that is not the solution's
        (with ``noise`` given: collect where replies differ instead, and go on). How many requests were compared."""
        compared = 0
        batch, batch_size = None, None
        try:
            for c, (name, world_size, steps) in enumerate(recording.checks):
                if batch is not None and batch_size != world_size:
                    self.sandbox.finish_batch(batch)
                    batch = None
                for s, step in enumerate(steps):
                    where = (c, s)
                    if noise is None and where in recording.noise:
                        continue
                    try:
                        if batch is None:
                            batch, batch_size = _start(self.sandbox, ex, world_size, file, step.budget), world_size
                        got = batch.request(pickle.loads(step.requests), step.budget, file)
                        said = ""
                    except (host.LearnerError, host.Stuck, host.RankDied) as e:
                        got = _raised(e) if isinstance(e, host.LearnerError) else ("stopped", type(e).__name__, str(e))
                        said = e.sentence if isinstance(e, host.LearnerError) else str(e)
                        batch = _end_if_dead(self.sandbox, batch)
                    compared += 1
                    want = pickle.loads(step.replies)
                    paths: list = []
                    _diff(want, got, where, recording.noise if noise is None else set(), paths)
                    if paths and noise is not None:
                        if isinstance(got, tuple) and got[0] == "stopped":
                            raise Differs(f"in {name!r}, seed {seed}: {got[2]}")
                        noise.update(p for p, _ in paths)
                    elif paths:
                        raise Differs(f"{_request_words(step, name, world_size, seed)}: {paths[0][1]}"
                                      + (f" ({said[:300]})" if said else ""))
        finally:
            if _end_if_dead(self.sandbox, batch) is not None:
                self.sandbox.finish_batch(batch)
        return compared


def _groups(checks: list[core.Check]) -> list[tuple[int, list[core.Check]]]:
    """Consecutive checks with the same number of ranks, as the grader batches them."""
    out: list = []
    for c in checks:
        n = c.world_size or 1
        if out and out[-1][0] == n:
            out[-1][1].append(c)
        else:
            out.append((n, [c]))
    return out


def _start(sandbox: host.Sandbox, ex: core.Exercise, world_size: int, file: str, budget: float) -> host.Batch:
    limit = budget * host.MAX_EXTENSION * 20
    try:
        return sandbox.start_batch(ex, world_size, file, limit_s=limit)
    except host.RankDied:
        return sandbox.start_batch(ex, world_size, file, limit_s=limit)  # a busy machine: once more


def _end_if_dead(sandbox: host.Sandbox, batch: host.Batch | None) -> host.Batch | None:
    if batch is not None and not batch.alive:
        batch.close()
        sandbox.kill_ranks(batch)
        return None
    return batch


def _request_words(step: _Step, check: str, world_size: int, seed: int) -> str:
    first = pickle.loads(step.requests)[0]
    what = "loading the file" if first.get("op") == "load" else \
        f"{'probe ' if first.get('op') == 'probe' else ''}{first.get('name')}(...)"
    ranks = f" on {world_size} ranks" if world_size > 1 else ""
    return f"check {check!r}, seed {seed}, {what}{ranks}"


# --- comparing replies -------------------------------------------------------------------------------------------


def _diff(want, got, path: tuple, noise: set, found: list) -> None:
    """Append (path, sentence) to ``found`` for each place where ``got`` is not ``want`` (skipping ``noise``)."""
    if path in noise:
        return
    import torch

    where = _where(path)
    if type(want) is not type(got):
        found.append((path, f"{where}{_kind(got)} instead of {_kind(want)}"))
    elif isinstance(want, torch.Tensor):
        problem = _tensor_difference(want, got)
        if problem:
            found.append((path, f"{where}{problem}"))
    elif isinstance(want, dict):
        if sorted(map(str, want)) != sorted(map(str, got)):
            found.append((path, f"{where}keys {sorted(map(str, got))} instead of {sorted(map(str, want))}"))
            return
        for k in want:
            if (len(path) == 3 and k in _IGNORED_REPLY_KEYS) or (_in_comm(path) and k in _IGNORED_COMM_KEYS):
                continue
            _diff(want[k], got[k], path + (k,), noise, found)
    elif isinstance(want, (list, tuple)):
        if len(want) != len(got):
            found.append((path, f"{where}{len(got)} items instead of {len(want)}"))
            return
        for i, (w, g) in enumerate(zip(want, got)):
            _diff(w, g, path + (i,), noise, found)
    elif isinstance(want, float):
        if not (want == got or (math.isnan(want) and math.isnan(got))):
            found.append((path, f"{where}{got!r} instead of {want!r}"))
    elif want != got:
        found.append((path, f"{where}{repr(got)[:150]} instead of {repr(want)[:150]}"))


def _in_comm(path: tuple) -> bool:
    return len(path) == 5 and path[3] == "comm"


def _where(path: tuple) -> str:
    """Words for a path (check, step, rank, key...) into the replies: "rank 1's value[0]['dx']: "."""
    if len(path) < 3:
        return ""
    rest = path[3:]
    return f"rank {path[2]}" + (f"'s {rest[0]}" + "".join(f"[{k!r}]" for k in rest[1:]) if rest else "") + ": "


def _kind(value) -> str:
    if isinstance(value, tuple) and value and value[0] == "raised":
        return f"raised {value[1]}" + (f" on rank {value[2]}" if value[2] is not None else "")
    if isinstance(value, tuple) and value and value[0] == "stopped":
        return f"{value[2][:200]}"
    return f"a {type(value).__name__}"


def _tensor_difference(want, got) -> str | None:
    import torch

    if want.dtype != got.dtype:
        return f"dtype {got.dtype} instead of {want.dtype}"
    if want.shape != got.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    if want.requires_grad != got.requires_grad:
        return f"requires_grad {got.requires_grad} instead of {want.requires_grad}"
    w, g = want.detach(), got.detach()
    if w.is_floating_point() or w.is_complex():
        same = (w == g) | (torch.isnan(w) & torch.isnan(g))
    else:
        same = w == g
    if bool(same.all()):
        return None
    bad = int((~same).sum())
    if w.is_floating_point():
        gap = (w.double() - g.double()).abs()
        largest = float(gap[~same].nan_to_num(nan=math.inf).max())
        scale = float(w.double().abs()[~same].max()) or 1.0
        return (f"{bad} of {w.numel()} elements differ (largest difference {largest:.3g}, "
                f"relative {largest / scale:.3g})")
    return f"{bad} of {w.numel()} elements differ"


# --- the process -------------------------------------------------------------------------------------------------


def run(spec: dict, private: str, user: int | None, started) -> int:
    """Compare each ``(exercise id, mutant file, seed)`` of ``spec["files"]`` with the solution; write the verdicts
    (one dict each, see :meth:`Tester.compare`) to ``spec["result"]``."""
    import torch

    sandbox = host.Sandbox(spec, private, os.path.join(spec["work"], "output.txt"), user)
    sandbox.start(started)
    torch.set_num_threads(1)
    spec["load"] = host.load_factor()
    tester = Tester(spec, sandbox, core.exercises())
    results = []
    try:
        for ex_id, path, seed in spec["files"]:
            results.append(tester.compare(ex_id, path, seed))
    finally:
        host.kill_descendants()
    write_atomic(spec["result"], json.dumps(results))
    return 0
