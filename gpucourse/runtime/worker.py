"""What runs first inside every rank.

:func:`rank_main` is the entry point the launcher hands to torch's elastic agent.
It makes the process safe to use (one torch thread after a fork, default
signal handling, death with its parent), joins the process group, runs
the user's function, and leaves a note in the run folder: its pid when it starts,
its error (type, message, traceback, time) if it raises, a mark when it
finishes, and, while it runs, the collective it is in (see ``collective_status``).
The launcher reads those notes to say which rank failed or hung, and where.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import json
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import collective_status


@dataclass
class RankContext:
    """Who this process is in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    channel: Any = None
    notes: str | None = None  # the launcher's folder, where this rank says it is ready, done or failed
    # Asked to run in namespaces of its own (launch(isolate=True)) but could not: why ("" when it does, or was
    # not asked).
    unisolated: str = ""


_CONTEXT: RankContext | None = None


def in_rank() -> bool:
    """True inside a function started by ``launch`` (or run in place by it)."""
    return _CONTEXT is not None


def current() -> RankContext:
    """The running rank's context (inside a function started by ``launch``)."""
    if _CONTEXT is None:
        raise RuntimeError("gpucourse.runtime.current() is only available inside a rank started by launch().")
    return _CONTEXT


def report(message: dict) -> None:
    """Send a small picklable dict to the launching process (progress, live metrics).

    Without a launcher listening (under ``torchrun``) rank 0 prints it instead.
    """
    ctx = current()
    message = {"rank": ctx.rank, **message}
    if ctx.channel is not None:
        ctx.channel.put(message)
    elif ctx.rank == 0 and message.get("print"):
        print(message["print"], flush=True)


def _die_with_parent() -> None:
    # Linux only: if the launcher is killed outright, its ranks must not linger.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _note(run_dir: str, name: str, payload: dict) -> None:
    if _OUTSIDE is not None:  # an isolated rank: the process outside writes its notes (see _stand_in)
        _tell_outside({"note": name, "payload": payload})
        return
    path = os.path.join(run_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def plain_std_streams() -> None:
    """Point sys.stdout and sys.stderr at file descriptors 1 and 2, line-buffered.

    A child forked from a notebook kernel (or from pytest) still holds its
    parent's stream objects, which do not write to fd 1 and 2; the launcher calls
    this right after forking a rank (see ``launcher._after_fork_in_child``).
    """
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), line_buffering=True)


def pick_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def rank_main(fn, args: tuple, kwargs: dict, spec: dict):
    """Run ``fn(*args, **kwargs)`` as one rank of a launched group and return its value.

    With ``spec["isolate"]`` the rank runs in a child in namespaces of its own (:func:`_enter_namespaces`) and
    this process stands in for it, outside: it writes the child's notes and returns its value (sent as JSON).
    """
    try:
        value = _rank_main(fn, args, kwargs, spec)
    except SystemExit as e:
        if _OUTSIDE is None:
            raise
        os._exit(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    except BaseException:
        if _OUTSIDE is None:
            raise
        os._exit(1)  # the error note has gone outside
    if _OUTSIDE is not None:  # the isolated rank never returns into the launcher's code: that is the outside's
        _tell_outside({"value": value})
        os._exit(0)
    return value


def _rank_main(fn, args: tuple, kwargs: dict, spec: dict):
    global _CONTEXT
    # A forked child inherits the launcher's signal handlers, which only run
    # between Python bytecodes: a rank blocked inside a collective would ignore
    # the agent's SIGTERM. Default handling lets it stop at once.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    _die_with_parent()
    # After a fork, OpenMP's thread pool is unusable and large collectives can
    # hang; one thread per rank avoids that (and ranks share the cores anyway).
    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))  # libraries that read it (Accelerate) agree

    rank = int(os.environ["RANK"])
    run_dir = spec["run_dir"]
    _note(run_dir, f"pid-{rank}.json", {"pid": os.getpid()})
    unisolated = ""
    try:
        device = pick_device(spec["device_type"], int(os.environ["LOCAL_RANK"]))
        # No rank connects to the store until every rank exists: a rank forked while the launching
        # process (the store's server thread) held a lock, the resolver's in getnameinfo, would wait
        # on that lock forever.
        spec["all_started"].wait(spec["startup_s"])
        if spec.get("isolate"):
            child = _enter_namespaces(os.path.join(run_dir, f"ended-{rank}.json"))
            if isinstance(child, str):
                unisolated = child
            elif child is not None:  # this process, outside: the rank is the child
                return _stand_in(*child, run_dir, rank)
        dist.init_process_group(spec["backend"], timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
        _note(run_dir, f"ready-{rank}.json", {"time": time.time()})
        _CONTEXT = RankContext(rank, dist.get_world_size(), int(os.environ["LOCAL_RANK"]), device,
                               spec["backend"], None if _OUTSIDE is not None else spec.get("channel"), run_dir,
                               unisolated)
        # Each collective writes what it is into status-{rank}.json (a memory map,
        # no system call per call), so a hang can be reported as "waiting in #3 barrier()".
        collective_status.install(collective_status.status_path(run_dir, rank))
        value = fn(*args, **kwargs)
        _note(run_dir, f"done-{rank}.json", {"time": time.time()})
        _wait_for_all_ranks()
    except BaseException as e:  # SystemExit and KeyboardInterrupt are failures of the rank too
        # Looked at before the time is taken: every rank listed was gone before this note's time (which the
        # launcher's choice of culprit relies on). An isolated rank sees no other process: the process outside
        # looks for it.
        gone = silent_exits(run_dir) if _OUTSIDE is None else None
        _note(run_dir, f"error-{rank}.json", {
            "rank": rank, "type": type(e).__name__, "message": str(e),
            "traceback": traceback.format_exc(), "time": time.time(), "silent_exits": gone})
        raise
    finally:
        collective_status.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    return value


# --- a rank in namespaces of its own ---------------------------------------------------------------------

CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x08000000, 0x10000000, 0x20000000
_OUTSIDE: socket.socket | None = None  # in an isolated rank: its end of the channel to the process outside
_OUTSIDE_LINE_BYTES = 1 << 20  # longest message the process outside reads (a note with a traceback fits)


def _enter_namespaces(ended_path: str):
    """Fork this rank into new PID and IPC namespaces (and a user namespace, unless this process is root).

    In the parent: the child's pid and this end of their channel. The child is the first process of the new PID
    namespace, its init: it forks the rank, reaps what ends there, and when the rank has ended writes its wait
    status to ``ended_path`` (opened here, outside, and closed in the rank), says it on the channel, and ends too
    (the namespace with it). The file is written before the init ends, so a peer that finds this rank gone and
    blames it finds how it ended there too, whichever process the launcher's agent saw exit first. In the rank, with every descriptor closed but its output and that
    channel: None. The rank is not the init itself because a namespace's init takes no signal it has no handler
    for, even from itself: an abort() there would end as a SIGSEGV, a kill of itself not at all. Where
    the machine allows no such namespaces: why not, and nothing changed. The child's mount namespace is its
    caller's business (the grader's walls: :func:`gpucourse.grading.wall.rank_walls`).
    """
    global _OUTSIDE
    if not sys.platform.startswith("linux"):
        return "namespaces are Linux's"
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWUSER if uid else 0)) != 0:
        return f"this machine allows no new user, PID and IPC namespaces ({os.strerror(ctypes.get_errno())})"
    if uid:
        try:  # the same user and group inside as outside, no other
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as e:
            return f"the user namespace could not map this user ({e})"
    ours, theirs = socket.socketpair()
    ended = os.open(ended_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid:
        theirs.close()
        os.close(ended)
        return pid, ours
    # The child: it dies with the process outside, which it checks is still there after asking for that.
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    ours.close()
    theirs.setblocking(False)
    try:
        if theirs.recv(1, socket.MSG_PEEK) == b"":
            os._exit(1)
    except BlockingIOError:
        pass
    theirs.setblocking(True)
    # Nothing of the launcher's is the rank's to use: of its descriptors only its output stays, and none of the
    # memory every rank shares with the launcher (its queues' locks, the barrier's counters), which would carry data
    # from rank to rank through /proc/self/mem.
    keep = sorted({0, 1, 2, theirs.fileno(), ended})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    with open("/proc/self/maps") as f:
        shared = [line.split()[0].split("-") for line in f if line.split()[1][3] == "s"]
    for start, end in shared:
        libc.munmap(ctypes.c_void_p(int(start, 16)), ctypes.c_size_t(int(end, 16) - int(start, 16)))
    rank = os.fork()
    if rank:  # the namespace's init: reap, and end once the rank has, saying how (its wait status)
        theirs.sendall(b'{"forked": true}\n')  # the process outside looks its pid up (see _stand_in)
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(1)
            if pid == rank:
                try:
                    os.write(ended, json.dumps({"status": status}).encode())
                    theirs.sendall(json.dumps({"ended": status}).encode() + b"\n")
                finally:
                    os._exit(0)
    os.close(ended)  # the rank's own code must not write how it ended
    _OUTSIDE = theirs
    return None


def _tell_outside(message: dict) -> None:
    _OUTSIDE.sendall(json.dumps(message).encode() + b"\n")


def _stand_in(child: int, channel: socket.socket, run_dir: str, rank: int):
    """Outside an isolated rank: write the notes it sends, then end as it ended (its value, or its exit, as the
    namespace's init saw it)."""
    # For silent_exits, the process that runs the rank: the init until it says it has forked the rank, then the rank
    # itself (as pid here), which a peer failing on its closed connections finds gone as soon as its exit begins.
    _note(run_dir, f"pid-{rank}.json", {"pid": child})
    ended = None
    with channel, channel.makefile("rb") as lines:
        for line in iter(lambda: lines.readline(_OUTSIDE_LINE_BYTES), b""):
            try:
                message = json.loads(line)
                name, payload = message.get("note"), message.get("payload")
            except (ValueError, AttributeError):
                continue  # a line cut at the limit, or not ours: the rank's own code can write here too
            if message.get("forked"):
                _note(run_dir, f"pid-{rank}.json", {"pid": _only_child(child) or child})
                continue
            if "ended" in message and isinstance(message["ended"], int):
                ended = message["ended"]  # the init's word, its last: how the rank ended
                continue
            if "value" in message:
                # The rank's last word (it only ends its process after it): returned without waiting for its
                # memory to be torn down, which would delay every launch. It dies with this process if it lingers.
                os.waitpid(child, os.WNOHANG)
                return message["value"]
            if name in {f"{kind}-{rank}.json" for kind in ("ready", "done", "error")} and isinstance(payload, dict):
                if name.startswith("error-"):  # the rank itself may be gone by now, having said this
                    payload.update(silent_exits=[r for r in silent_exits(run_dir) if r != rank], time=time.time())
                _note(run_dir, name, payload)
    _, status = os.waitpid(child, 0)
    status = status if ended is None else ended
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.stdout.flush()
    os._exit(os.waitstatus_to_exitcode(status))  # ended without its value: as it ended (os._exit(0) too)


def _only_child(pid: int) -> int | None:
    """The one child of process ``pid``, by its pid here (an isolated rank's, seen from outside its namespace)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:  # a kernel without the children file
        return None
    return int(children[0]) if len(children) == 1 else None


_PF_EXITING = 0x4  # in the flags of /proc/<pid>/stat: the process has begun to exit


def silent_exits(run_dir: str) -> list[int]:
    """Ranks whose process has already ended without leaving an error or a done note.

    A rank that dies silently (os._exit, a crash) makes its peers fail in their
    next collective; a peer that sees it gone records so, and the launcher then
    blames the silent rank instead of the peer's "connection closed". The
    launcher's watchdog asks too: a rank that ended with status 0 and no result
    would otherwise keep the launch waiting for it for ever.
    """
    if not sys.platform.startswith("linux"):
        return []
    gone = []
    for name in os.listdir(run_dir):
        if not (name.startswith("pid-") and name.endswith(".json")):
            continue
        rank = name[len("pid-"):-len(".json")]
        if any(os.path.exists(os.path.join(run_dir, f"{kind}-{rank}.json")) for kind in ("error", "done")):
            continue
        with open(os.path.join(run_dir, name)) as f:
            pid = json.load(f)["pid"]
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # A zombie has ended already; only the agent has not reaped it yet. A rank whose exit has begun
            # counts as ended too: the kernel closes its connections (which this rank may be failing on) after
            # it sets PF_EXITING and before the rank is a zombie.
            running = fields[0] != "Z" and not int(fields[6]) & _PF_EXITING
        except OSError:
            running = False
        if not running:
            gone.append(int(rank))
    return sorted(gone)


def _wait_for_all_ranks() -> None:
    # A rank that finishes early must not exit: its closed connections would turn
    # a peer's pending collective into a confusing "connection reset" instead of
    # the hang it really is. Wait on the rendezvous store, not on the process
    # group, so a collective the peer is still missing cannot be matched by this.
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if store.add("gpucourse/finished", 1) == dist.get_world_size():
        store.set("gpucourse/all-finished", "1")
    store.wait(["gpucourse/all-finished"])


def run_in_place(fn, args: tuple, kwargs: dict, device_type: str, backend: str, pg_timeout: float) -> list:
    """Run as one rank of a group someone else started (``torchrun``, ``accelerate launch``).

    Every rank gets the values of all ranks, in rank order, like ``launch``.
    """
    global _CONTEXT
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_type, local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=pg_timeout))
    _CONTEXT = RankContext(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)
    try:
        value = fn(*args, **kwargs)
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values
    finally:
        _CONTEXT = None
        if owns_group:
            dist.destroy_process_group()
