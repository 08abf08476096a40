"""Start ranks: one function for notebook cells, the CLI and the grader.

``launch(fn, *args, world_size=4)`` stands on ``torch.distributed.elastic``, the
engine under ``torchrun``: its agent starts the processes, runs a c10d
rendezvous on a free port, tees each rank's output to ours with a ``[rank N]``
prefix, and stops every rank as soon as one fails. Around it this module adds
what a teaching runtime needs:

- a device decision made without initialising CUDA in the caller;
- one clear error: :class:`WorkerError` names the failing rank and carries its
  traceback; :class:`LaunchTimeout` names the ranks that did not finish and the
  collective each rank was in;
- a wall-clock timeout, and a Ctrl-C (or kernel interrupt) that stops the group;
- a channel for ranks to send small messages back (progress, live metrics);
- in place under ``torchrun`` / ``accelerate launch``: no second launch.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib
import json
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..readable import Readable
from . import collective_status, devices, worker


class LaunchError(Readable, RuntimeError):
    """The group could not be started as asked (one sentence says why)."""


class WorkerError(Readable, RuntimeError):
    """A rank raised. ``rank``, ``exc_type``, ``message`` and ``remote_traceback`` say what."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str = ""):
        self.rank, self.exc_type, self.message, self.remote_traceback = rank, exc_type, message, remote_traceback
        text = f"rank {rank} failed: {exc_type}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class LaunchTimeout(Readable, TimeoutError):
    """Some ranks had not finished after ``timeout`` seconds; ``pending`` lists them.

    ``waiting`` says per rank which collective it was in and which it finished last.
    """

    def __init__(self, timeout: float, pending: list[int], finished: list[int], waiting: dict | None = None):
        self.timeout, self.pending, self.finished, self.waiting = timeout, pending, finished, waiting or {}
        text = (f"rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))} did not finish "
                f"within {timeout:g} s")
        text += f" (finished: {', '.join(map(str, finished))})" if finished else " (none finished)"
        for rank, what in sorted(self.waiting.items()):
            text += f"\n  rank {rank}: {what}"
        super().__init__(text)


@dataclass(frozen=True)
class DevicePlan:
    """Where ranks run and over which backend, and why; ``nccl_env`` holds the NCCL settings these GPUs need, as
    ``(name, value, why)`` (see :func:`gpucourse.runtime.devices.nccl_settings`). ``stand_in``: the ranks would
    use GPUs that are only described (``GPUCOURSE_FAKE_GPUS``), so CPU processes run in their place. ``gpus``: the
    GPUs it was planned on, so that what else depends on them (precision "auto", the notes) asks no second time."""

    device: str   # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    reason: str
    nccl_env: tuple = ()
    stand_in: bool = False
    gpus: object = field(default=None, compare=False, repr=False)


def visible_gpus() -> int:
    """How many ranks can run on GPUs here, one each, counted without initialising CUDA.

    The visible GPUs (:func:`gpucourse.runtime.devices.visible`), or 1 on MIG slices, of which a process sees one.
    """
    return devices.visible().cuda_ranks


def notebook_device(largest: int) -> str:
    """The ``device`` every run of a notebook uses, so that its runs compare like with like; said when it falls back.

    ``"auto"`` where each rank of the notebook's largest run (``largest`` ranks) can have a GPU, and where there is
    no GPU at all (every run on CPU processes); ``"cpu"`` on a machine with fewer GPUs than that (Colab's one T4, a
    MIG seat), with one line saying so, instead of some runs on the GPU and the others on CPU processes.
    """
    found = devices.visible()
    if not found.cuda_ranks or found.shortfall(largest) is None:
        return "auto"
    n = len(found.gpus)
    have = "one MIG slice" if found.mig else f"{n} GPU{'s' * (n > 1)}"
    print(f"gpucourse: {have} for runs of up to {largest} ranks: all run on CPU processes, to compare like with like.",
          flush=True)
    return "cpu"


def cpu_rank_limit() -> int:
    """Most CPU processes ('virtual GPUs') one launch may start on this machine."""
    return max(8, 4 * (os.cpu_count() or 1))


def plan_device(device: str, world_size: int, gpus: devices.DeviceSet | None = None) -> DevicePlan:
    """Decide CUDA/NCCL or CPU/gloo for ``world_size`` ranks on ``gpus`` (the visible GPUs unless given), or raise
    LaunchError."""
    if device not in ("auto", "cpu", "cuda"):
        raise LaunchError(f"device={device!r} must be 'auto', 'cpu' or 'cuda'.")
    found = devices.visible() if gpus is None else gpus
    short = found.shortfall(world_size)
    if device == "cuda" and short:
        raise LaunchError(f"device='cuda' needs {world_size} GPU{'s' * (world_size > 1)} for {world_size} "
                          f"rank{'s' * (world_size > 1)} but {short}; use device='auto' to fall back to gloo on "
                          f"CPU processes.")
    if device == "cuda" or (device == "auto" and not short):
        reason = f"{found.describe()}, {'one rank' if found.mig else 'one per rank'}"
        if found.described:
            # Every decision is the described machine's (this line, the NCCL settings, the precision); the ranks
            # are this machine's: so a notebook runs top to bottom as it would there, with CPU processes.
            them = "it" if world_size == 1 else "them"
            return DevicePlan("cpu", "gloo", f"{reason}, as {found.source} describes; CPU processes stand in for "
                              f"{them}", devices.nccl_settings(found), stand_in=True, gpus=found)
        return DevicePlan("cuda", "nccl", reason, devices.nccl_settings(found), gpus=found)
    limit = cpu_rank_limit()
    if world_size > limit:
        fallback = f" ({short}, so the run would fall back to CPU processes)" if device == "auto" else ""
        raise LaunchError(f"{world_size} ranks are more than this machine can run as CPU processes "
                          f"(at most {limit}){fallback}; use fewer ranks.")
    why = "device='cpu' asked for" if device == "cpu" else short
    return DevicePlan("cpu", "gloo", f"{why}: ranks are CPU processes ('virtual GPUs')", gpus=found)


_told: set = set()  # the NCCL settings this process has printed


@contextlib.contextmanager
def _nccl_environment(plan: DevicePlan, quiet: bool):
    # The ranks inherit this process's environment: set the plan's NCCL settings for the launch, each printed once
    # per process, and never over a value the user set.
    added = {name: value for name, value, _ in plan.nccl_env if name not in os.environ}
    for name, value, why in plan.nccl_env:
        if name in added and not quiet and (name, value) not in _told:
            _told.add((name, value))
            print(f"gpucourse: {name}={value} for these ranks: {why} (set {name} yourself to choose otherwise).",
                  flush=True)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


_RDZV_BACKEND = "gpucourse-local"


def _register_local_rendezvous() -> None:
    """A one-node rendezvous whose store binds a free port (port 0) and says which it got.

    torch's c10d rendezvous also accepts port 0 but waits a random fraction of a
    second on its first round (it is built for many nodes joining); the static one
    is instant but needs a port chosen in advance, which two launches can race for.
    """
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo, registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LocalRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return _RDZV_BACKEND

        def next_rendezvous(self) -> RendezvousInfo:
            if not self._store:
                # As torch's own c10d rendezvous makes its store: no fixed number of clients.
                self._store = TCPStore(self.master_addr, 0, is_master=True, timeout=self.timeout, multi_tenant=True)
            return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1,
                                  RendezvousStoreInfo(self.master_addr, self._store.port))

    def create(params):
        return LocalRendezvous("127.0.0.1", 0, 0, 1, params.run_id, int(params.config.get("timeout", 120)))

    if _RDZV_BACKEND not in registry.handler_registry._registry:
        registry.handler_registry.register(_RDZV_BACKEND, create)


TAIL_INTERVAL_S = 0.02


def _prompt_tail_logs() -> None:
    """Copy the ranks' output to this process every 20 ms instead of torch's 100 ms.

    The agent tees each rank's output through threads (``TailLog``) that look for new lines every 0.1 s and notice
    that their rank has finished only on their next look: every launch returned about 80 ms after its ranks had,
    the grader's batches and a notebook's re-runs included. A look is one ``readline`` at the end of a file.
    """
    from torch.distributed.elastic.multiprocessing import api

    if getattr(api.TailLog, "interval_s", None) == TAIL_INTERVAL_S:
        return

    class PromptTailLog(api.TailLog):
        interval_s = TAIL_INTERVAL_S

        def __init__(self, *args, **kwargs):
            if len(args) < 5:  # (name, log_files, dst, log_line_prefixes, interval_sec, ...): not given
                kwargs.setdefault("interval_sec", TAIL_INTERVAL_S)
            super().__init__(*args, **kwargs)

    api.TailLog = PromptTailLog


def in_place() -> bool:
    """True when this process is already one rank of a group (torchrun, accelerate launch)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not worker.in_rank()


def check_in_place_world(world_size: int, asked: str = "world_size") -> None:
    """Under torchrun, refuse a world size other than the one it started, in one sentence naming both."""
    if not in_place():
        return
    started = int(os.environ["WORLD_SIZE"])
    if started != world_size:
        raise LaunchError(f"torchrun started {started} ranks but {asked} = {world_size}; make them equal.")


_forking_ranks = False  # True while launch() lets the agent fork ranks


def _after_fork_in_child() -> None:
    # The agent sends a forked rank's output to its log file (the one it tees back
    # to us with the [rank N] prefix) through sys.stdout.fileno(); a notebook
    # kernel's or pytest's sys.stdout is not fd 1, so the rank's prints bypassed
    # the log. Give the rank plain fd 1 and 2 streams before the agent looks.
    global _forking_ranks
    if _forking_ranks:
        _forking_ranks = False
        worker.plain_std_streams()
        # Garbage the parent had not collected yet (the store and agent of an
        # earlier launch, kept in a cycle by its exception) must not be collected
        # here: their C++ destructors join threads that do not exist in the child,
        # and the rank aborts ("std::system_error: Invalid argument"). Freezing keeps
        # the copies alive; they cost nothing, and the rank's own garbage is still collected.
        gc.freeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _nvml_cuda_check():
    # LaunchConfig's defaults ask torch.cuda.is_available(), which initialises the
    # CUDA driver in this process and so poisons fork: forked CUDA ranks then fail
    # with "Cannot re-initialize CUDA in forked subprocess". This variable makes
    # torch ask NVML instead, as torch.cuda.device_count() already does.
    old = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = old


def _start_method(fn, plan: DevicePlan, start_method: str | None) -> str:
    if start_method:
        return start_method
    # fork is fast (no re-import of torch) and runs functions defined in a notebook
    # cell; it is only unsafe once the parent has initialised CUDA, or off Linux.
    if sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _check_spawnable(fn, args, kwargs) -> None:
    main = sys.modules.get("__main__")
    defined_in_notebook = getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__")
    if defined_in_notebook or "<locals>" in getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "") == "<lambda>":
        raise LaunchError(f"{getattr(fn, '__qualname__', fn)!r} is defined in a notebook cell or inside another "
                          f"function, so new (spawned) processes cannot import it; put it at the top level of a "
                          f".py file next to the notebook and import it from there.")
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise LaunchError(f"the function or its arguments cannot be sent to spawned processes ({e}); "
                          f"pass plain data such as numbers, strings, lists, dicts or tensors.") from None


SILENT_EXIT_S = 1.0  # how long a rank's end may stay unexplained before it is taken for an exit with status 0


def _live(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (not ended, nor zombies waiting to be reaped)."""
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    alive.add(pid)
        except (OSError, IndexError):
            continue
    return alive


class _StartupStalled(Exception):
    """The ranks did not all join their process group in time."""


def _children() -> set[int]:
    """The pids of this process's children, found without waiting on any of them.

    ``multiprocessing.active_children()`` would reap the ones that ended: from the
    watchdog's thread that races the agent's own wait for its ranks, which then
    finds no exit code to read (torch's ``ProcessContext.join`` fails on None).
    """
    if not os.path.isdir("/proc"):  # no /proc (macOS): there ranks are spawned, and reaping is the only way
        return {p.pid for p in multiprocessing.active_children()}
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        found.add(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


class _Watchdog:
    """Kills the group's processes if the launch outlives its timeout, or its ranks never finish starting.

    Starting means joining the process group. A forked rank once stalled there
    for good, about once in 40 launches of four ranks: a rank forked while the
    agent's store, in another thread of this process, was naming an earlier rank's
    connection (``getnameinfo``) inherited glibc's resolver lock held, and waited
    on it forever in its own first connection. Ranks now wait for each other
    before they connect (``all_started`` in the worker), so nothing connects
    while ranks are forked; should a start still stall, it is started again.
    """

    def __init__(self, timeout: float | None, before: set, run_dir: str, world_size: int, startup_s: float):
        self.fired = self.stalled = False
        self.silent: int | None = None  # a rank that ended its process with status 0 and no result
        self._before, self._run_dir, self._world_size = before, run_dir, world_size
        self._done = threading.Event()
        self._lock = threading.Lock()
        # Only a launch in the main thread has the agent's SIGTERM handler to wake it with.
        self._main = threading.current_thread() is threading.main_thread()
        self._timers = [threading.Timer(startup_s, self._check_started)]
        if timeout:
            self._timers.append(threading.Timer(timeout, self._fire))
        self._timers.append(threading.Thread(target=self._watch_exits))
        for t in self._timers:
            t.daemon = True
            t.start()

    def _watch_exits(self) -> None:
        # A rank that ends its process with status 0 but no result (os._exit(0)) is, to the agent, neither finished
        # nor failed: it would wait for that result for ever, whatever the timeout. An exit with any other status
        # reaches the agent at once; one still unexplained after SILENT_EXIT_S is this one. The other ranks are
        # stopped (the agent then reports their ends), or, with none left, the agent is woken by the signal it
        # listens for.
        seen: dict[int, float] = {}
        while not self._done.wait(0.1):
            now = time.monotonic()
            for rank in worker.silent_exits(self._run_dir):
                seen.setdefault(rank, now)
            late = [r for r, t in seen.items() if now - t > SILENT_EXIT_S]
            if not late:
                continue
            self.silent = min(late, key=seen.get)
            with self._lock:
                if self._done.is_set():
                    return
                if not _live(_children() - self._before) and self._main:
                    os.kill(os.getpid(), signal.SIGTERM)
            self._keep_killing()
            return

    def _check_started(self) -> None:
        if not self._done.is_set() and len(_notes(self._run_dir, "ready")) < self._world_size:
            self.stalled = True
            self._keep_killing()

    def _fire(self) -> None:
        self.fired = True
        self._keep_killing()

    def _keep_killing(self) -> None:
        # The agent may still be starting ranks (in its rendezvous, or spawning):
        # keep killing the new ones until the launch has given up, or they would
        # run on after the timeout.
        while True:
            self.kill()
            if self._done.wait(0.05):
                return

    def kill(self) -> None:
        # Only our own children that started during this launch: never a stranger's pid.
        for pid in _children() - self._before:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def cancel(self) -> None:
        with self._lock:
            self._done.set()
        for t in self._timers:
            if isinstance(t, threading.Timer):
                t.cancel()


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _notes(run_dir: str, kind: str) -> dict[int, dict]:
    out = {}
    for path in glob.glob(os.path.join(run_dir, f"{kind}-*.json")):
        rank = int(os.path.basename(path)[len(kind) + 1:-5])
        out[rank] = _read_json(path)
    return out


def _worker_error(run_dir: str, failures: dict) -> WorkerError:
    # The agent reports one failure, the first exit it saw; only then does it stop the other ranks (SIGTERM).
    rank = agent_first = min(failures)
    errors = _notes(run_dir, "error")
    if errors:
        first = min(errors.values(), key=lambda e: e.get("time", 0))
        # A rank that ends without raising (os._exit, a crash, the OOM killer)
        # leaves no note, and makes its peers raise "connection closed" in their
        # next collective: the first of those names it, and it is the cause.
        gone = first.get("silent_exits")
        if not gone:
            return WorkerError(first["rank"], first["type"], first["message"], first["traceback"])
        # The ranks the agent stopped leave no note either, and a peer that raised late finds them gone too: the
        # exit the agent saw first came before those. When that rank is not listed, it ended after this note was
        # taken, so nothing had been stopped yet and every rank listed ended on its own.
        rank = agent_first if agent_first in gone else gone[0]
    # The agent's exit code is known for its first exit only, which may be a peer's; an isolated rank's wait status
    # is written by its namespace's init before that ends (worker._enter_namespaces).
    code = failures[rank].exitcode if rank in failures else _ended_code(run_dir, rank)
    if code is not None and code < 0:
        what = f"was killed by {signal.Signals(-code).name}"
    elif code is not None:
        what = f"exited with code {code} without raising an exception (os._exit, or a crash)"
    else:
        what = "ended without raising an exception (os._exit, or a crash)"
    # A rank killed inside a collective (gloo aborts on a size mismatch) was last seen there.
    where = collective_status.read(collective_status.status_path(run_dir, rank)).get("waiting")
    return WorkerError(rank, "ProcessExit", f"the process {what}" + (f" while in collective {where}" if where else ""))


def _ended_code(run_dir: str, rank: int) -> int | None:
    """How an isolated rank's process ended, as an exit code (minus the signal's number if a signal ended it), from
    the note its namespace's init wrote; None where there is none."""
    try:
        with open(os.path.join(run_dir, f"ended-{rank}.json")) as f:
            status = json.load(f)["status"]
        return os.waitstatus_to_exitcode(status)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _quiet_elastic():
    # The agent logs every failure as a table of its own; the caller gets one
    # WorkerError instead, so keep the agent's logger for real emergencies only.
    # (The agent's own module logger has a level of its own, so its parent's does not reach it.)
    logs = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api",
                                           "torch.multiprocessing", "torchelastic-events-null")]
    old = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, old):
            log.setLevel(level)


@contextlib.contextmanager
def _saved_signal_handlers():
    # The agent installs its own SIGINT/SIGTERM handlers in the main thread and
    # does not put the caller's back (a notebook kernel needs its own).
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [signal.SIGINT, signal.SIGTERM] + [getattr(signal, n) for n in ("SIGHUP", "SIGQUIT") if hasattr(signal, n)]
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, h in saved.items():
            if h is not None:
                signal.signal(s, h)


def _drain(channel, on_message, stop: threading.Event) -> None:
    # Wake fifty times a second (a blocked get costs no CPU; the wait only bounds
    # how long the launch takes to return once its ranks are done, as the
    # launcher joins this thread). Nothing is ever put into the channel from
    # this side: a queue this process wrote to would make the interpreter wait
    # for its feeder thread at exit, forever if a rank was killed half-way
    # through writing a message.
    while not stop.is_set():
        try:
            msg = channel.get(timeout=0.02)
        except queue.Empty:
            continue
        except (EOFError, OSError, ValueError):
            return
        if on_message is not None:
            on_message(msg)
    while True:  # what the ranks sent before they stopped
        try:
            msg = channel.get_nowait()
        except (queue.Empty, EOFError, OSError, ValueError):
            return
        if on_message is not None:
            on_message(msg)


# The modules preimport() imports (a process that knows its ranks' needs better, the grader's sandbox, sets its own).
PREIMPORTS = ("torch._dynamo",)


def preimport() -> None:
    """Import and build here, once, what every rank's first step would otherwise pay for, before ranks are forked.

    A forked rank inherits it all (copy-on-write), so a re-run in the same notebook starts with it:

    - ``torch._dynamo``, which AdamW's constructor imports: about a second of CPU on a small machine, paid by
      every rank that has not inherited it;
    - the course's corpus (``data.corpus()``, cached per process), which every rank that reads a batch builds
      first: tens of milliseconds a rank, every launch. Only where this process has imported the course's data
      module (a notebook or a command that trains has); the grader's sandbox cannot, and needs no corpus.

    A kernel that has built an optimizer or read a batch has them already; doing it here makes every launch
    start like that (the figures then measure launchers and training steps, and the suite runs faster).
    """
    for name in PREIMPORTS:
        importlib.import_module(name)

    data = sys.modules.get(__name__.split(".")[0] + ".data")
    if data is not None:
        data.corpus()


def launch(fn, *args, world_size: int, timeout: float | None = None, device: str = "auto",
           start_method: str | None = None, on_message=None, pg_timeout: float | None = None,
           quiet: bool = False, isolate: bool = False, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their values in rank order.

    Inside ``fn`` the default process group is ready (gloo on CPU, NCCL on CUDA)
    and :func:`gpucourse.runtime.current` says which rank this is.

    - ``timeout``: seconds for the whole group; past it every rank is killed and
      :class:`LaunchTimeout` names the ranks that had not finished.
    - ``device``: ``"auto"`` (NCCL when there is a GPU per rank, else gloo on CPU),
      ``"cpu"`` or ``"cuda"``; or a :class:`DevicePlan` the caller has made already.
    - ``on_message``: called in this process with each dict a rank passes to
      :func:`gpucourse.runtime.report`.
    - ``pg_timeout``: how long a collective may wait before the process group
      gives up (defaults to ``timeout`` + 30 s, or 300 s).
    - ``isolate``: each rank runs in PID and IPC namespaces of its own (and a user
      namespace unless this is root), with none of the launcher's descriptors, and
      returns JSON (the grader's ranks; see ``worker.rank_main``).

    Under ``torchrun`` (RANK and WORLD_SIZE already set) nothing is launched:
    ``fn`` runs here as this process's rank and every rank gets all values.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise LaunchError(f"world_size={world_size!r} must be a whole number of at least 1.")
    # The process group waits a little longer than the launch, so that a hang is
    # reported as the LaunchTimeout it is rather than as a collective's own error.
    pg_timeout = pg_timeout or (timeout + 30 if timeout else 300.0)
    if in_place():
        check_in_place_world(world_size)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        plan = device if isinstance(device, DevicePlan) else plan_device(device, local)
        with _nccl_environment(plan, quiet):
            return worker.run_in_place(fn, args, kwargs, plan.device, plan.backend, pg_timeout)

    plan = device if isinstance(device, DevicePlan) else plan_device(device, world_size)
    method = _start_method(fn, plan, start_method)
    if method != "fork":
        _check_spawnable(fn, args, kwargs)
    if not quiet:
        print(f"gpucourse: {world_size} rank{'s' * (world_size > 1)} on {plan.device} ({plan.backend}): "
              f"{plan.reason}.", flush=True)

    _register_local_rendezvous()
    _prompt_tail_logs()
    if method == "fork":
        preimport()  # forked ranks inherit it instead of each paying
    started = time.monotonic()
    with _nccl_environment(plan, quiet):
        for attempt in (1, 2):
            left = None if timeout is None else max(0.1, timeout - (time.monotonic() - started))
            try:
                return _launch_once(fn, args, kwargs, world_size, left, timeout, plan, method, pg_timeout,
                                    on_message, isolate)
            except _StartupStalled:
                if attempt == 2:
                    raise LaunchError(f"the {world_size} ranks did not finish joining their process group within "
                                      f"{_startup_s(method, world_size):g} s, twice; the machine may be "
                                      f"overloaded.") from None
                print(f"gpucourse: the ranks did not finish starting within {_startup_s(method, world_size):g} s; "
                      f"starting them again.", flush=True)


def _startup_s(method: str, world_size: int) -> float:
    # Joining the group takes well under a second after a fork (15 s is that many times over, and what a stalled
    # start costs before it is started again); a spawned rank first imports torch.
    return 15.0 if method == "fork" else 30.0 + 5.0 * world_size


def _launch_once(fn, args, kwargs, world_size, left, timeout, plan, method, pg_timeout, on_message,
                 isolate=False) -> list:
    """One attempt: ``left`` seconds remain of the caller's ``timeout`` (which error messages quote)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = tempfile.mkdtemp(prefix="gpucourse-run-")
    ctx = multiprocessing.get_context(method)
    channel = ctx.Queue()
    spec = {"run_dir": run_dir, "device_type": plan.device, "backend": plan.backend, "pg_timeout": pg_timeout,
            "channel": channel, "all_started": ctx.Barrier(world_size), "startup_s": _startup_s(method, world_size),
            "threads": 1 if method == "fork" else max(1, (os.cpu_count() or 1) // world_size), "isolate": isolate}
    with _nvml_cuda_check():
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=uuid.uuid4().hex,
            # The agent's store binds a free port, so launches never collide.
            rdzv_backend=_RDZV_BACKEND, rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": 120},
            max_restarts=0, monitor_interval=0.02, start_method=method,
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.ALL, tee=Std.ALL),
            log_line_prefix_template="[rank ${rank}] ", shutdown_timeout=5,
        )
    stop = threading.Event()
    drainer = threading.Thread(target=_drain, args=(channel, on_message, stop), daemon=True)
    drainer.start()
    watchdog = _Watchdog(left, _children(), run_dir, world_size,
                         _startup_s(method, world_size))
    global _forking_ranks
    _forking_ranks = method == "fork"
    try:
        with _quiet_elastic(), _saved_signal_handlers():
            try:
                values = elastic_launch(config, worker.rank_main)(fn, args, kwargs, spec)
            except ChildFailedError as e:
                watchdog.cancel()  # no signal from it once the agent has given up
                if watchdog.silent is not None:
                    raise _silent_error(run_dir, watchdog.silent) from None
                if watchdog.stalled:
                    raise _StartupStalled() from None
                if watchdog.fired:
                    raise _timeout_error(timeout, run_dir, world_size) from None
                raise _worker_error(run_dir, e.failures) from None
            except SignalException as e:
                watchdog.cancel()
                if watchdog.silent is not None and e.sigval == signal.SIGTERM:
                    raise _silent_error(run_dir, watchdog.silent) from None
                if e.sigval == signal.SIGINT:
                    raise KeyboardInterrupt("launch interrupted; every rank was stopped") from None
                raise
            except KeyboardInterrupt:
                watchdog.kill()
                raise
            finally:
                watchdog.cancel()  # before the caller's signal handlers come back
        # Every rank returned (even if the watchdog fired as they did): that is a result.
        return [values[r] for r in range(world_size)]
    finally:
        _forking_ranks = False
        watchdog.cancel()
        watchdog.kill()
        stop.set()
        drainer.join(timeout=5)
        channel.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        # What the ranks wrote reaches the cell before the caller's next line: in a notebook stderr (a rank's
        # last words before a crash) and stdout are flushed apart, and unflushed, it came under the next launch.
        for stream in (sys.stderr, sys.stdout):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # none, closed, or a reader gone
                stream.flush()


def _silent_error(run_dir: str, rank: int) -> WorkerError:
    where = collective_status.read(collective_status.status_path(run_dir, rank)).get("waiting")
    return WorkerError(rank, "ProcessExit", "the process ended without returning and without an error (os._exit(0)?)"
                       + (f" while in collective {where}" if where else ""))


def _timeout_error(timeout, run_dir: str, world_size: int) -> LaunchTimeout:
    done = sorted(_notes(run_dir, "done"))
    pending = [r for r in range(world_size) if r not in done]
    # Every rank's collective status: a hang is two ranks disagreeing on the next call.
    waiting = {r: ("finished; " if r in done else "") + collective_status.explain(collective_status.read(
               collective_status.status_path(run_dir, r))) for r in range(world_size)}
    return LaunchTimeout(timeout, pending, done, waiting)
