"""The grading process: ``python -m gpucourse.grading.host SPEC.json``.

:func:`gpucourse.grading.runner.grade` starts it in a new session. It imports
torch once, then grades each exercise in a process of its own, forked from
it (so no exercise pays for importing torch again, and none sees another's
state):

- the exercise process starts a new session (its process group is killed as a
  whole), dies with this one (PR_SET_PDEATHSIG), and runs under limits set
  with ``resource.setrlimit``: address space (``memory_bytes``), size of any
  file it writes (``output_bytes``, which caps what it and its ranks print),
  no core dumps. Its output goes to a file, of which we keep the head and tail;
- it runs the checks, local ones in itself and distributed ones on gloo ranks
  through ``gpucourse.launch``, and appends one JSON line per event (a check
  started, passed, failed, raised) to the exercise's event file; ranks append
  their own lines, which survive any way a process can end;
- this process watches the event file: an exercise process that makes no
  progress (no check starts or ends on any rank) for the check timeout, a
  third of the exercise's (at least 10 s), or that runs past the exercise's
  timeout, has its process group killed. If the exercise process ended early
  (a hang, os._exit, a crash, the memory limit), the check it was in fails
  with the reason and a fresh process grades the checks that are left, as long
  as time is left. Ranks that never got as far as the first check (not the
  learner's doing: a busy machine) are given one more try.

Results go to the spec's ``result`` file after every exercise (written atomically).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
import traceback

from ..measure import write_atomic
from . import core, source
from .results import (OUTPUT_KEEP_BYTES, compile_exercise, crash, describe_exception, describe_launch_error,
                      finalize, in_progress, read_events, static_result, who_finished)

GRACE_S = 5.0  # after a deadline, for the launch's own timeout to report first


def _log(events_path: str, **event) -> None:
    # One write() of one line to a file opened for appending: lines from several
    # processes never interleave, and a line written is kept however the writer ends.
    line = json.dumps({"t": time.time(), **event}) + "\n"
    fd = os.open(events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def rank_checks(module: str, names: list[str], path: str, seed: int, events: str) -> None:
    """Run the checks ``names`` of exercise ``module`` on this rank (started by ``launch``).

    A wrong answer (:class:`~gpucourse.grading.core.Fail`) is noted and the next
    check runs; any other exception leaves the rank, so that the launcher stops
    the group at once and names the rank that raised.
    """
    import torch.distributed as dist

    ex = core.exercises()[module[:4]]
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        _log(events, check=name, rank=rank, event="start")
        ctx = core.CheckContext(ex, ex.by_name(name), path, seed, rank, world)
        try:
            ex.by_name(name).fn(ctx)
        except core.Fail as e:
            _log(events, check=name, rank=rank, event="fail", message=str(e))
        else:
            _log(events, check=name, rank=rank, event="pass")


def _batches(checks: list[core.Check]) -> list[tuple[int | None, list[core.Check]]]:
    """Consecutive checks with the same world size share one launch."""
    out: list = []
    for c in checks:
        if out and out[-1][0] == c.world_size:
            out[-1][1].append(c)
        else:
            out.append((c.world_size, [c]))
    return out


def _run_exercise(ex: core.Exercise, path: str, todo: list[str], seed: int, events: str, deadline: float) -> None:
    """Inside the exercise process: run the checks ``todo``; return at the first one that raised."""
    from ..runtime.launcher import LaunchError, LaunchTimeout, WorkerError, launch

    for world_size, checks in _batches([c for c in ex.checks if c.name in todo]):
        if world_size is None:
            for c in checks:
                _log(events, check=c.name, rank=None, event="start")
                try:
                    c.fn(core.CheckContext(ex, c, path, seed))
                except core.Fail as e:
                    _log(events, check=c.name, rank=None, event="fail", message=str(e))
                except BaseException as e:  # SystemExit and KeyboardInterrupt from learner code are failures too
                    _log(events, check=c.name, rank=None, event="error",
                         message=describe_exception(type(e).__name__, str(e), traceback.format_exc(), path))
                    return
                else:
                    _log(events, check=c.name, rank=None, event="pass")
            continue
        names = [c.name for c in checks]
        try:
            launch(rank_checks, ex.module, names, path, seed, events, world_size=world_size, device="cpu",
                   timeout=max(1.0, deadline - time.time()), quiet=True)
        except (WorkerError, LaunchTimeout, LaunchError) as e:
            current = in_progress(ex, read_events(events), names)
            _log(events, check=current or names[0], rank=None, event="error",
                 message=describe_launch_error(e, path))
            return


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exercise_process(ex, path, todo, seed, events, out_path, deadline, spec) -> None:
    """The forked exercise process: limits, output, checks; it never returns."""
    code = 0
    try:
        os.setsid()
        _die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # Past the file-size limit a write fails (EFBIG) instead of killing the writer.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["output_bytes"], spec["output_bytes"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        _run_exercise(ex, path, todo, seed, events, deadline)
    except BaseException:
        code = 3
        try:
            _log(events, check=None, rank=None, event="crash", message=traceback.format_exc())
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"the exercise process was killed by {signal.Signals(sig).name}" + \
            (" (out of memory?)" if sig == signal.SIGKILL else "")
    return f"the exercise process exited with code {os.WEXITSTATUS(status)} (os._exit, or a crash)"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _watch(pid: int, ex, events: str, deadline: float, check_timeout: float, timeout: float) -> str | None:
    """Wait for the exercise process; kill its group at a deadline. None if it ended by itself, else why.

    Besides the exercise's own deadline, the process must make progress: a new
    event (a check started or finished on some rank) at least every ``check_timeout``.
    """
    seen, since = 0, time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # anything it left behind in its group
            return None if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else _describe_status(status)
        now, log = time.monotonic(), read_events(events)
        if len(log) != seen:
            seen, since = len(log), now
        why = None
        if time.time() > deadline + GRACE_S:
            why = f"the exercise ran past its {timeout:g} s"
        elif now - since > check_timeout + GRACE_S:
            why = f"this check did not finish within {check_timeout:g} s" if in_progress(ex, log) else STALLED
        if why:
            _kill_group(pid)
            os.waitpid(pid, 0)
            return why
        time.sleep(0.1)


STALLED = "the grader's ranks did not start"


def grade_exercise(ex: core.Exercise, path: str, spec: dict) -> dict:
    """Grade one exercise file in fresh exercise processes; its result as a dict."""
    start = time.monotonic()
    problem = source.inspect(path, ex.module)
    if problem:
        return static_result(ex, problem, spec["seed"], time.monotonic() - start)
    work, timeout = spec["work"], spec["timeout"]
    check_timeout = max(10.0, timeout / 3)
    out_path = os.path.join(work, f"{ex.id}-output.txt")
    deadline = time.time() + timeout
    attempts: list[str] = []    # one event file per exercise process
    reasons: dict[str, str] = {}  # check -> why the process ended while it ran
    stalled: set[str] = set()     # checks whose ranks once failed to start
    while True:
        before = compile_exercise(ex, [read_events(a) for a in attempts], reasons)
        todo = [c["name"] for c in before["checks"] if c["status"] == "not run"]
        if not todo or time.time() >= deadline:
            break
        events = os.path.join(work, f"{ex.id}-events-{len(attempts)}.jsonl")
        attempts.append(events)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _exercise_process(ex, path, todo, spec["seed"], events, out_path, deadline, spec)
        with open(os.path.join(work, "pgids"), "a") as f:
            f.write(f"{pid}\n")
        why = _watch(pid, ex, events, deadline, check_timeout, timeout)
        after = compile_exercise(ex, [read_events(a) for a in attempts], reasons)
        still = [c["name"] for c in after["checks"] if c["status"] == "not run"]
        if why == STALLED and still[0] not in stalled:
            stalled.add(still[0])  # not the learner's doing (a busy machine?): once more
            continue
        if why or len(still) == len(todo):
            # It ended inside a check, or before deciding any: that check fails with the reason.
            name = in_progress(ex, read_events(events), still) or still[0]
            broke = crash(read_events(events))
            if broke:
                why = f"the grader could not run this check ({broke}); is --memory-gb too small?"
            check = ex.by_name(name)
            reasons[name] = (why or "the exercise process ended in the middle of this check without an "
                                    "error (os._exit(0)?)") + who_finished(check, read_events(events))
            if why == STALLED:
                reasons[name] += f" within {check_timeout:g} s, twice (a busy machine? try a longer --timeout)"
            elif why and why.startswith("this check did not finish") and (check.world_size or 1) > 1:
                reasons[name] += (" — a hang: a blocking send or receive whose partner never comes, a collective "
                                  "that not every rank reached, or an endless loop")
    result = finalize(compile_exercise(ex, [read_events(a) for a in attempts], reasons,
                                       not_run=f"not run: the exercise had used up its {timeout:g} s"))
    result.update(seed=spec["seed"], time_s=round(time.monotonic() - start, 3), output=_head_and_tail(out_path))
    return result


def _head_and_tail(path: str) -> str:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size <= OUTPUT_KEEP_BYTES:
                return f.read().decode(errors="replace")
            head = f.read(OUTPUT_KEEP_BYTES // 4).decode(errors="replace")
            f.seek(size - 3 * OUTPUT_KEEP_BYTES // 4)
            tail = f.read().decode(errors="replace")
        return f"{head}\n… [{size - OUTPUT_KEEP_BYTES} bytes of output left out] …\n{tail}"
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    import torch
    import torch._dynamo  # noqa: F401  -- building an optimizer imports it: once here, not in every rank

    torch.set_num_threads(1)
    known = core.exercises()
    results = []
    for ex_id, path in spec["files"]:
        results.append(grade_exercise(known[ex_id], path, spec))
        write_atomic(spec["result"], json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
