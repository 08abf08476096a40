"""The grading process. It is trusted; learner code never runs in it.

:func:`gpucourse.grading.runner.grade` starts it in a new session
(``python -m gpucourse.grading.start SPEC.json``, which starts the sandbox
first, then runs :func:`run` here). It imports the checks and drives one
sandbox process (:mod:`gpucourse.grading.sandbox`), as an unprivileged user
when it is root (see :mod:`.spawn`), over a private folder that holds a
copy of each learner file and nothing else. For each exercise it runs the
checks here, one after another; a check sends inputs to the sandbox's ranks
and judges what comes back (see :class:`~gpucourse.grading.core.CheckContext`).
Consecutive checks with the same number of ranks share one batch of ranks;
after a hang or a crash the next check gets fresh ranks, so a hang in one
check leaves the others to run.

Time limits judge the learner's code, not the machine: starting ranks is not
counted; each check has a budget of its own, scaled by how loaded the machine
is right now (:func:`load_factor`), and a rank that is still moving from
collective to collective is given more time rather than called hung.

This process is a child subreaper: whatever the learner's code started, however
it detached, ends up its child and is killed before the result file is written.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid

from ..files import write_atomic
from ..runtime import collective_status
from . import core, source, traffic, wire
from .spawn import spawn_sandbox
from .results import describe_exception, grader_failed, static_result

STARTUP_S = 90.0         # for a batch's ranks to start and connect (not counted against any check)
PROGRESS_GRACE_S = 3.0   # after a check's budget, how long a rank may take to show it is still moving
DEADLOCK_S = 1.5         # how long ranks must sit still in a collective that a finished rank would have to join
MAX_EXTENSION = 4.0      # a progressing check gets at most this many budgets


class Stuck(Exception):
    """Some ranks did not answer within the check's budget and showed no progress."""

    def __init__(self, budget: float, done: list[int], pending: list[int], waiting: dict[int, str],
                 never: bool = False):
        self.budget, self.done, self.pending, self.waiting, self.never = budget, done, pending, waiting, never
        super().__init__(self.describe())

    def describe(self) -> str:
        n = len(self.done) + len(self.pending)
        if n == 1:
            return f"this check did not finish within {self.budget:.0f} s (an endless loop, or a wait for nothing)"
        who = (f"rank{'s' * (len(self.done) > 1)} {', '.join(map(str, self.done))} finished it, "
               f"rank{'s' * (len(self.pending) > 1)} {', '.join(map(str, self.pending))} did not"
               if self.done else f"none of the {n} ranks finished it")
        status = "; ".join(f"rank {r}: {self.waiting[r]}" for r in self.pending if self.waiting.get(r))
        within = f"within {self.budget:.0f} s" + (" and never would, waiting for a rank that had finished"
                                                   if self.never else "")
        return (f"this check did not finish {within} ({who}) — a hang: a blocking send or receive "
                f"whose partner never comes, a collective that not every rank reached, or an endless loop"
                + (f" [{status}]" if status else ""))


def _deadlocked(notes: dict[int, dict]) -> bool:
    """Whether ranks that are still working on a request, while others have answered it, can never finish: each
    waits in a collective, and either it is the only one left or every one of them waits in a collective of all
    the ranks (which the ranks that answered, waiting for the next request, will not join)."""
    waiting = [note.get("waiting", "") for note in notes.values()]
    return all(waiting) and (len(waiting) == 1 or not any(" on group " in w or " on a subgroup" in w
                                                          for w in waiting))


class RankDied(Exception):
    """A rank's process ended in the middle of a request."""


class LearnerError(Exception):
    """Learner code raised; ``describe`` is the one sentence a learner reads."""

    def __init__(self, rank: int | None, exc_type: str, message: str, traceback_text: str, path: str, private: str):
        self.rank, self.exc_type = rank, exc_type
        text = describe_exception(exc_type, message.replace(private, path), traceback_text.replace(private, path),
                                  path)
        self.sentence = text if rank is None or exc_type == "NotImplementedError" else f"rank {rank}: {text}"
        super().__init__(self.sentence)


def load_factor() -> float:
    """How much slower than a quiet core this machine runs torch right now (at least 1).

    40 matrix products of 256 x 256 take about 14 ms on one quiet core of the
    machines the course is tested on; the best of three tries, divided by that.
    """
    import torch

    a = torch.randn(256, 256)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(40):
            a @ a
        best = min(best, time.perf_counter() - start)
    return max(1.0, min(10.0, best / 0.014))


class Batch:
    """The ranks of one batch, each at the end of a socket.

    Where the kernel's counters can be read (:mod:`.traffic`; tried once, as the batch starts and before any
    learner code runs), ``meter`` reads them and each measured request leaves in ``traffic`` what went between the
    ranks while it ran; where they cannot, ``meter`` is None and ``unmeasured`` says why."""

    def __init__(self, sandbox: "Sandbox", number: int, world_size: int, socks: dict[int, socket.socket],
                 pids: dict[int, int], status: dict[int, str], unisolated: str = ""):
        self.sandbox, self.number, self.world_size = sandbox, number, world_size
        self.socks, self.pids, self.status = socks, pids, status
        self.unisolated = unisolated  # why the ranks run without namespaces of their own ("" where they do)
        self.alive = True
        self.meter: traffic.Meter | None = None
        self.unmeasured = ""
        self.traffic: traffic.Traffic | str | None = None  # the last measured request's, or why it could not be
        if world_size > 1:
            try:
                self.meter = traffic.Meter(pids)
                self.meter.read()
            except traffic.Unavailable as e:
                self.meter, self.unmeasured = None, str(e)

    def request(self, requests: list[dict], budget: float, path: str, measure: bool = False) -> list[dict]:
        """Send rank r ``requests[r]``; every rank's reply, or Stuck / RankDied / LearnerError. ``measure``: count
        what the ranks send each other meanwhile (into ``traffic``)."""
        self.traffic, before = None, None
        if measure and self.meter is not None:
            before = self._read(quiet=True)
        for rank, req in enumerate(requests):
            try:
                wire.send_bytes(self.socks[rank], wire.encode_request(req))
            except OSError:
                raise RankDied(f"rank {rank}'s process had already ended") from None
        replies: dict[int, dict] = {}
        start = time.monotonic()
        deadline, hard = start + budget, start + budget * MAX_EXTENSION
        seen = {r: self._progress(r) for r in range(self.world_size)}
        first_error = None
        still, still_since = None, start  # the pending ranks' progress, and since when it has not changed
        while len(replies) < self.world_size:
            pending = {self.socks[r].fileno(): r for r in range(self.world_size) if r not in replies}
            now = time.monotonic()
            if first_error is not None and now > first_error + 1.0:
                break  # a rank raised; the others are most likely waiting for it
            if replies:
                notes = {r: collective_status.read(self.status[r]) for r in pending.values()}
                if notes != still:
                    still, still_since = notes, now
                elif _deadlocked(notes) and now > still_since + DEADLOCK_S * self.sandbox.spec["load"]:
                    self.alive = False
                    raise Stuck(round(now - start), sorted(replies), sorted(pending.values()),
                                {r: collective_status.explain(notes[r]) for r in notes}, never=True)
            if now > deadline:
                moved = {r: self._progress(r) for r in pending.values()}
                if now < hard and any(moved[r] != seen[r] for r in moved):
                    seen.update(moved)  # still moving from collective to collective: slow, not hung
                    deadline = now + PROGRESS_GRACE_S
                else:
                    self.alive = False
                    raise Stuck(budget, sorted(replies), sorted(pending.values()),
                                {r: collective_status.explain(collective_status.read(self.status[r]))
                                 for r in pending.values()})
            ready, _, _ = select.select(list(pending), [], [], 0.2)
            for fd in ready:
                rank = pending[fd]
                try:
                    replies[rank] = wire.decode_reply(wire.recv_bytes(self.socks[rank], wire.MAX_REPLY_BYTES))
                except (wire.ChannelClosed, OSError, wire.BadReply) as e:
                    self.alive = False
                    raise RankDied(self.sandbox.why_rank_ended(self.number, rank, e)) from None
                if not replies[rank].get("ok") and first_error is None:
                    first_error = time.monotonic()
        errors = [r for r in sorted(replies) if not replies[r].get("ok")]
        if errors:
            if len(replies) < self.world_size:
                self.alive = False
            r = errors[0]
            e = replies[r]
            raise LearnerError(r if self.world_size > 1 else None, str(e.get("type")), str(e.get("message")),
                               str(e.get("traceback", "")), path, self.sandbox.private)
        if isinstance(before, traffic.Reading):
            after = self._read(quiet=True)
            self.traffic = traffic.Traffic(before, after) if isinstance(after, traffic.Reading) else after
        elif before is not None:
            self.traffic = before
        return [replies[r] for r in range(self.world_size)]

    def _read(self, quiet: bool) -> "traffic.Reading | str":
        """The counters now; or, where they could be read when the batch started and cannot now (learner code
        closed its descriptors to the grader?), why not."""
        try:
            return self.meter.read(quiet=quiet)
        except traffic.Unavailable as e:
            return str(e)

    def _progress(self, rank: int) -> str:
        note = collective_status.read(self.status[rank])
        return f"{note.get('waiting')}|{note.get('finished')}|{note.get('launched')}"

    def close(self) -> None:
        for s in self.socks.values():
            try:
                s.close()
            except OSError:
                pass


class Sandbox:
    """The sandbox process, seen from here: it starts batches of ranks on request."""

    def __init__(self, spec: dict, private: str, output: str, user: int | None):
        self.spec, self.private, self.output, self.user = spec, private, output, user
        self.batches = 0
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.outcomes: dict[int, str] = {}  # batch -> how it ended, as the sandbox said
        self.late_imports: set[str] = set()  # slow modules a rank imported that its exercise does not name
        self.as_root = ""  # why learner code ran as root where it was to run as ``user`` (the sandbox says)
        self._heard = b""
        self.gone = False  # the sandbox process has closed its end

    def start(self, started=None) -> None:
        """Start the sandbox process (or take ``started``, the one :mod:`.start` began: its process and channel)."""
        self.proc, self.control = started or spawn_sandbox(self.spec, self.private, self.output, self.user)
        self._heard, self.gone = b"", False

    def start_batch(self, ex: core.Exercise, world_size: int, file: str, limit_s: float) -> Batch:
        """Ranks for a batch of ``ex``'s checks, connected; RankDied if they could not start."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.batches += 1
        token = uuid.uuid4().hex
        address = os.path.join(self.private, f"b{self.batches}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        if self.user is not None:
            os.chown(address, self.user, self.user)
        listener.listen(world_size)
        request = {"batch": self.batches, "world_size": world_size, "module": ex.module, "file": file,
                   "probes": f"{__package__}.probes.{ex.module}" if ex.module in _probe_names() else None,
                   "address": address, "token": token, "private": self.private, "limit_s": limit_s,
                   "memory_bytes": self.spec["memory_bytes"], "output_bytes": self.spec["output_bytes"],
                   "forbidden_collectives": sorted(ex.forbidden_collectives), "forbidden_names": list(ex.forbidden_names),
                   "refusal": ex.refusal, "hidden_paths": self.spec["hidden_paths"],
                   "hidden_modules": list(HIDDEN_MODULES + ex.hidden_modules), "imports": list(ex.rank_imports)}
        self.control.sendall((json.dumps(request) + "\n").encode())
        socks, pids, status, unisolated = {}, {}, {}, ""
        deadline = time.monotonic() + STARTUP_S * self.spec["load"]
        try:
            while len(socks) < world_size:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([listener, self.control], [], [], max(0.0, min(left, 1.0)))
                if self.control in ready:
                    self._listen(0)
                if self.gone or self.batches in self.outcomes or left <= 0:
                    told = self._words(self.outcomes.get(self.batches))
                    raise RankDied("the grader's ranks did not start" + (f" within {STARTUP_S:.0f} s" if left <= 0
                                                                            else f": {told}" if told else ""))
                if listener in ready:
                    conn, _ = listener.accept()
                    conn.settimeout(10)
                    try:
                        hello = json.loads(wire.recv_bytes(conn, 4096))
                        rank = int(hello["rank"])
                        ok = hello.get("token") == token and 0 <= rank < world_size and rank not in socks
                    except (ValueError, KeyError, TypeError, OSError, wire.ChannelClosed):
                        ok = False
                    if not ok:
                        conn.close()
                        continue
                    conn.settimeout(None)
                    socks[rank], pids[rank], status[rank] = conn, _peer_pid(conn, int(hello["pid"])), \
                        str(hello["status"])
                    unisolated = unisolated or str(hello.get("unisolated") or "")[:500]
        except BaseException:
            for s in socks.values():
                s.close()
            self.restart()
            raise
        finally:
            listener.close()
            os.unlink(address)
        return Batch(self, self.batches, world_size, socks, pids, status, unisolated)

    def _listen(self, wait: float) -> None:
        """Take in what the sandbox has said within ``wait`` s: one line per finished batch."""
        ready, _, _ = select.select([self.control], [], [], wait)
        if not ready:
            return
        try:
            data = self.control.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.gone = True
            return
        self._heard += data
        while b"\n" in self._heard:
            line, self._heard = self._heard.split(b"\n", 1)
            try:
                said = json.loads(line)
                self.outcomes[int(said["batch"])] = str(said.get("outcome") or "")
                self.late_imports.update(n for n in said.get("late_imports") or () if n in wire.SLOW_IMPORTS)
                self.as_root = str(said.get("as_root") or "")[:500]
            except (ValueError, KeyError, TypeError):
                continue

    def outcome(self, batch: int, wait: float) -> str | None:
        """How batch ``batch`` ended, in the sandbox's words ("" if well), or None if it has not said in ``wait`` s."""
        deadline = time.monotonic() + wait
        while batch not in self.outcomes and not self.gone:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._listen(left)
        return self.outcomes.get(batch)

    @staticmethod
    def _words(outcome: str | None) -> str:
        try:
            e = json.loads(outcome or "")
            return f"{e.get('type')}: {e.get('message')}"
        except (ValueError, AttributeError):
            return ""

    def why_rank_ended(self, batch: int, rank: int, error: Exception) -> str:
        if isinstance(error, wire.BadReply):
            return f"rank {rank} sent the grader something that is not a reply ({error})"
        told = self._words(self.outcome(batch, 2.0))
        if "ProcessExit" in told or "exit" in told.lower() or "signal" in told.lower():
            return (f"rank {rank}'s process ended in the middle of this check ({told.split(': ', 1)[-1]}); "
                    f"a function under test must return, not end its process")
        if "memory" in told.lower():
            return f"rank {rank} ran out of memory under the grader's limit (gpucourse grade --memory-gb)"
        return (f"rank {rank}'s process ended in the middle of this check without an error (os._exit? a crash?)"
                + (f": {told}" if told else ""))

    def finish_batch(self, batch: Batch) -> None:
        """End a batch: close its channels (the ranks return); kill them if they do not."""
        batch.close()
        if batch.alive and self.outcome(batch.number, 10.0) is not None:
            return
        self.kill_ranks(batch)

    def kill_ranks(self, batch: Batch) -> None:
        for pid in batch.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.outcome(batch.number, 3.0) is None:
            self.restart()  # the launcher has no word for how they ended (os._exit(0)): start afresh

    def restart(self) -> None:
        """Kill the sandbox and everything under it; the next batch starts a fresh one."""
        if self.proc is not None:
            kill_descendants()
            self.proc = None
        if self.control is not None:
            self.control.close()
            self.control = None


# Never importable by learner code, whatever the exercise.
HIDDEN_MODULES = ("solutions", "tests", "gpucourse.grading.checks", "gpucourse.grading.host",
                  "gpucourse.grading.runner", "gpucourse.grading.core", "gpucourse.grading.results",
                  "gpucourse.grading.timing", "gpucourse.parallel", "gpucourse.train", "gpucourse.modeled.memory",
                  "gpucourse.modeled.plan", "gpucourse.profiling", "gpucourse.measure", "gpucourse.comm",
                  "gpucourse.course.troubleshoot", "gpucourse.bench", "gpucourse.course.tour", "gpucourse.serving")


def _peer_pid(conn: socket.socket, said: int) -> int:
    """The process at the other end of ``conn``, as the kernel knows it (what the rank ``said`` elsewhere)."""
    try:
        return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    except (AttributeError, OSError):
        return said


def _probe_names() -> set[str]:
    from . import probes
    return set(probes.NAMES)


def kill_descendants() -> None:
    """Kill every process below this one (a subreaper: detached ones are children too), until none is left."""
    me = os.getpid()
    for _ in range(200):
        children = _descendants(me)
        if not children:
            break
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        time.sleep(0.02)
    _reap()


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read().decode(errors="replace")
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _batches(checks: list[core.Check]) -> list[tuple[int, list[core.Check]]]:
    """Consecutive checks with the same number of ranks share one batch (a local check runs on one)."""
    out: list = []
    for c in checks:
        n = c.world_size or 1
        if out and out[-1][0] == n:
            out[-1][1].append(c)
        else:
            out.append((n, [c]))
    return out


def grade_exercise(ex: core.Exercise, path: str, spec: dict, sandbox: Sandbox) -> dict:
    """Grade one exercise file; its result as a dict (see :mod:`gpucourse.grading.results`)."""
    start = time.monotonic()
    problem = source.inspect(path, ex.module)
    if problem:
        return static_result(ex, problem, spec["seed"], time.monotonic() - start)
    folder = os.path.join(sandbox.private, ex.id)
    os.makedirs(folder, exist_ok=True)
    private_file = os.path.join(folder, f"{ex.module}.py")
    shutil.copyfile(path, private_file)
    if sandbox.user is not None:
        os.chown(folder, 0, sandbox.user)
        os.chmod(folder, 0o750)
        os.chmod(private_file, 0o640)
        os.chown(private_file, 0, sandbox.user)
    output_start = _size(sandbox.output)
    sandbox.late_imports.clear()
    factor = load_factor()
    verdicts: dict[str, tuple[str, str]] = {}
    spent: dict[str, float] = {}  # seconds each check took, starting its ranks included
    unmeasured: set[str] = set()  # why the kernel's counters could not be read, for a batch of several ranks
    unisolated: set[str] = set()  # why ranks ran without namespaces of their own
    for world_size, checks in _batches(ex.checks):
        batch = None
        for check in checks:
            budget = check.budget_s * factor * spec["timeout_scale"]
            began = time.monotonic()
            if batch is None:
                try:
                    batch = _start(sandbox, ex, world_size, private_file, budget)
                except RankDied as e:
                    # Twice, with a fresh sandbox, and before any learner code ran in them: the grader's own failure.
                    return grader_failed([ex.id], f"{e} (for the check {check.name!r}, tried twice)", spec["seed"])[0]
                if batch.unmeasured:
                    unmeasured.add(batch.unmeasured)
                if batch.unisolated:
                    unisolated.add(batch.unisolated)
            try:
                ctx = core.CheckContext(ex, check, path, spec["seed"], world_size=world_size, batch=batch,
                                        budget_s=budget)
                ctx.load()
                check.fn(ctx)
                verdicts[check.name] = ("passed", "")
            except core.Fail as e:
                verdicts[check.name] = ("failed", str(e))
            except LearnerError as e:
                verdicts[check.name] = ("failed", e.sentence)
            except (Stuck, RankDied) as e:
                verdicts[check.name] = ("failed", str(e))
            except Exception as e:  # noqa: BLE001 -- a reply shaped so that the check itself tripped on it
                verdicts[check.name] = ("failed", f"the check could not read what the code returned "
                                                  f"({type(e).__name__}: {e})")
            spent[check.name] = round(time.monotonic() - began, 3)
            if batch is not None and not batch.alive:
                batch.close()
                sandbox.kill_ranks(batch)
                batch = None
        if batch is not None:
            sandbox.finish_batch(batch)
    result = static_result(ex, "", spec["seed"], time.monotonic() - start)
    result["error"] = None
    for c in result["checks"]:
        status, message = verdicts.get(c["name"], ("failed", "not run"))
        c.update(status=status, message=message, points=c["max_points"] if status == "passed" else 0,
                 time_s=spent.get(c["name"], 0.0))
    result["score"] = sum(c["points"] for c in result["checks"])
    result["output"] = _output_since(sandbox.output, output_start)
    if sandbox.late_imports:
        result["late_imports"] = sorted(sandbox.late_imports)
        sandbox.late_imports.clear()
    warnings = [f"learner code ran as root, not as an unprivileged user: {sandbox.as_root}"] if sandbox.as_root else []
    warnings += [f"learner code ran without a mount, PID and IPC namespace of its own per rank, walled in by the "
                 f"grader's audit hook alone: {why}" for why in sorted(unisolated)]
    warnings += [f"the bytes the ranks sent each other were taken from the ranks' own records, which their code can "
                 f"write, not counted by the kernel: {why}" for why in sorted(unmeasured)]
    if warnings:
        result["warning"] = "\n".join(warnings)
    return result


def _start(sandbox: Sandbox, ex, world_size: int, file: str, budget: float) -> Batch:
    try:
        return sandbox.start_batch(ex, world_size, file, limit_s=budget * MAX_EXTENSION * 20)
    except RankDied:
        return sandbox.start_batch(ex, world_size, file, limit_s=budget * MAX_EXTENSION * 20)  # a busy machine: once more


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _output_since(path: str, offset: int) -> str:
    from .results import OUTPUT_KEEP_BYTES

    try:
        size = os.path.getsize(path) - offset
        with open(path, "rb") as f:
            f.seek(offset)
            if size <= OUTPUT_KEEP_BYTES:
                return f.read().decode(errors="replace")
            head = f.read(OUTPUT_KEEP_BYTES // 4).decode(errors="replace")
            f.seek(offset + size - 3 * OUTPUT_KEEP_BYTES // 4)
            tail = f.read(3 * OUTPUT_KEEP_BYTES // 4).decode(errors="replace")
        return f"{head}\n… [{size - OUTPUT_KEEP_BYTES} bytes of output left out] …\n{tail}"
    except OSError:
        return ""


def run(spec: dict, private: str, user: int | None, started) -> int:
    """Grade ``spec["files"]`` with the sandbox :mod:`.start` began (``started``) and write the results."""
    import torch

    sandbox = Sandbox(spec, private, os.path.join(spec["work"], "output.txt"), user)
    sandbox.start(started)
    torch.set_num_threads(1)
    known = core.exercises()
    spec["load"] = load_factor()
    results = []
    try:
        for ex_id, path, seed in spec["files"]:  # each file under its own seed (grade_runs: several of each)
            results.append(grade_exercise(known[ex_id], path, {**spec, "seed": seed}, sandbox))
    finally:
        # Nothing in the sandbox is worth a graceful end (each batch has ended): kill it and all below at once.
        kill_descendants()
    write_atomic(spec["result"], json.dumps(results))
    return 0
