"""Where the learner's code runs (started as ``python -m gpucourse.grading.wall CONTROL_FD SPEC``).

The grading host (trusted) starts this process with a clean interpreter, as an
unprivileged user when the host is root (a copy of the interpreter where the
only one lives in root's private home: see :mod:`gpucourse.grading.spawn`),
behind the walls of :mod:`gpucourse.grading.wall`. It imports torch and the probes —
never the checks, the grader, the reference strategies or ``solutions/`` — and
then, for each batch of checks the host asks for, starts ``world_size`` ranks
with :func:`gpucourse.launch`, each isolated by the operating system
(``isolate=True``: PID and IPC namespaces of its own, and a user namespace
where this process is not root). Each rank:

1. connects to the host's socket for that batch, raises its own walls
   (:func:`gpucourse.grading.wall.rank_walls`: a mount namespace with a fresh
   /proc, an empty /tmp and /dev/shm of its own, nothing of the sandbox's folder
   but its own folder and the learner's file, no capability left), says who it
   is (with the batch's token, and why it could not raise those walls, if it
   could not: the grade then says so in its first line), and waits at a barrier
   until every rank has, so that no learner code runs before every channel is up;
2. sets its limits (address space, file size, no core dumps) and its guard, a
   second wall inside the first: an audit hook (``sys.addaudithook``, which cannot be removed) that refuses
   to read the repository, the grader's files or other processes, to write
   outside the sandbox, to start processes, open sockets, load C libraries or
   import the reference; a dispatch mode that sees every collective however it
   is issued (``dist`` functions, process-group methods, ``torch.ops``,
   functional collectives), refuses the ones the exercise forbids and records
   the rest (operation, bytes, group, peer, time); and the exercise's
   forbidden names (``DistributedDataParallel``, ``GradScaler``...) replaced
   by refusals;
3. answers the host's requests — load the learner's file afresh, call one of
   its functions, or run a probe that drives it (refused once the learner's code
   has replaced any part of the probe) — with replies of tensors and plain data
   (:mod:`gpucourse.grading.wire`), until the host closes the channel.

Nothing here decides a verdict: a rank only reports what the learner's code did.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import socket
import sys
import time
import traceback
import types

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from . import wire

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPOSITORY = os.path.dirname(PACKAGE)

# The collectives as the dispatcher names them (c10d's in-place ops and the
# functional ones), by the name torch.distributed gives them.
COLLECTIVES = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "barrier": "barrier", "monitored_barrier_": "barrier",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    # functional collectives (DTensor, torch.distributed._functional_collectives)
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")

# Audit events that start processes, talk to the network, load C code or
# change files: none of them is needed to answer an exercise.
_REFUSED_EVENTS = {
    "os.fork": "start a process", "os.forkpty": "start a process", "os.system": "run a command",
    "os.exec": "run a program", "os.posix_spawn": "start a process", "os.spawn": "start a process",
    "subprocess.Popen": "start a process", "pty.spawn": "start a process", "os.startfile": "run a program",
    "socket.__new__": "open a socket", "socket.connect": "open a socket", "socket.bind": "open a socket",
    "ctypes.dlopen": "load a C library", "ctypes.dlsym": "load a C library",
    "os.remove": "delete a file", "os.rmdir": "delete a folder", "shutil.rmtree": "delete a folder",
    "os.rename": "rename a file", "os.link": "link a file", "os.symlink": "link a file",
    "os.truncate": "truncate a file", "os.chmod": "change a file's mode", "os.chown": "change a file's owner",
    "os.killpg": "signal other processes", "signal.pthread_kill": "signal other processes",
    "resource.setrlimit": "change its limits", "resource.prlimit": "change its limits",
}


class ForbiddenCall(BaseException):
    """The learner's code did something the exercise forbids.

    A BaseException, so that ``except Exception`` in learner code does not hide it.
    """


_CALL_START = [time.perf_counter()]


def elapsed() -> float:
    """Seconds since the current request began (the clock of every time a reply carries)."""
    return time.perf_counter() - _CALL_START[0]


# --- the guard ----------------------------------------------------------------------------------------------


class Recorder(TorchDispatchMode):
    """Sees every collective this rank issues; refuses the forbidden ones and records the others."""

    def __init__(self, forbidden: set[str], refusal: str):
        super().__init__()
        self.forbidden, self.refusal, self.records = forbidden, refusal, []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch's hook: True (its default) wraps __torch_dispatch__ to keep torch.compile out of it, which imports
        # torch._dynamo on the first collective, over a second of a rank's CPU. No exercise compiles.
        return False

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        if namespace in _NAMESPACES and name in COLLECTIVES:
            op = COLLECTIVES[name]
            if op in self.forbidden:
                raise ForbiddenCall(self.refusal.format(op=op))
            self.records.append(self._describe(func, op, args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _describe(func, op: str, args, kwargs) -> dict:
        # Arguments equal to their default are left out of the call: start from the schema's defaults.
        values = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
        values.update(zip([a.name for a in func._schema.arguments], args), **kwargs)
        group = None
        if "process_group" in values:
            group = dist.ProcessGroup.unbox(values["process_group"])
        elif "group_name" in values:
            from torch.distributed.distributed_c10d import _resolve_process_group
            group = _resolve_process_group(values["group_name"])
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        tensors = values.get("tensors", values.get("input_tensors", values.get("input_tensor",
                                                                              values.get("input"))))
        record = {"op": op, "bytes": _nbytes(tensors), "group": ranks, "async": bool(values.get("async_op", False)),
                  "t": elapsed()}
        if ranks is not None and op in ("all_to_all", "barrier"):
            record["to"] = _bytes_to(op, values, ranks)
        for key in ("dst", "src", "root_rank"):
            if key in values and ranks is not None and isinstance(values[key], int) and values[key] >= 0:
                record["peer"] = ranks[values[key]] if values[key] < len(ranks) else values[key]
        return record


def _bytes_to(op: str, values: dict, ranks: list[int]) -> dict[int, int]:
    """The bytes an all-to-all or a barrier sends to each rank of its group (by global rank)."""
    if op == "barrier":
        return dict.fromkeys(ranks, 0)
    if "input_tensors" in values:
        return {r: _nbytes(t) for r, t in zip(ranks, values["input_tensors"])}
    tensor, splits = values["input"], list(values.get("input_split_sizes") or ())
    rows = tensor.shape[0] if tensor.dim() else 1
    row = _nbytes(tensor) // rows if rows else 0
    splits = splits or [rows // len(ranks)] * len(ranks)
    return {r: n * row for r, n in zip(ranks, splits)}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _refuse_name(module: str, name: str, why: str):
    def refused(*args, **kwargs):
        raise ForbiddenCall(why.format(name=f"{module}.{name}"))
    return refused


def replace_names(names: list[str], why: str) -> None:
    """Make each dotted name (``torch.nn.parallel.DistributedDataParallel``) raise ForbiddenCall when used."""
    import importlib

    for dotted in names:
        module_name, _, attr = dotted.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            setattr(module, attr, _refuse_name(module_name, attr, why))


def refuse_threads(why: str) -> None:
    """Make starting a Python thread raise ForbiddenCall (``why`` names it with ``{name}``).

    The recorder is a dispatch mode, and a dispatch mode is thread-local: a collective issued from another thread
    would be neither refused nor recorded. No exercise needs a thread, so none may start; every way Python starts
    one goes through these functions (``threading.Thread.start`` calls the module's own reference)."""
    import _thread
    import threading

    for module, name in ((_thread, "start_new_thread"), (_thread, "start_new"), (_thread, "start_joinable_thread"),
                         (threading, "_start_new_thread"), (threading, "_start_joinable_thread")):
        if hasattr(module, name):
            setattr(module, name, _refuse_name(module.__name__, name, why))


def refuse_programs(why: str) -> None:
    """Make ``_posixsubprocess.fork_exec`` raise ForbiddenCall: ``subprocess`` calls it after the audit event the
    hook refuses, and learner code could call it directly, with no event at all."""
    import _posixsubprocess

    _posixsubprocess.fork_exec = _refuse_name("_posixsubprocess", "fork_exec", why)


# What a store (``torch.distributed.Store``) offers: a key-value service every rank reaches.
STORE_METHODS = ("add", "append", "barrier", "check", "clone", "compare_set", "delete_key", "get", "list_keys",
                 "multi_get", "multi_set", "num_keys", "queue_len", "queue_pop", "queue_push", "set", "wait")


def _code_objects(modules) -> set:
    """Every code object of the functions the modules define themselves (their classes' methods, and the functions
    nested in either, included; what they import from elsewhere left out)."""
    found, stack = set(), []
    for module in modules:
        for value in vars(module).values():
            # type(), not isinstance(): asking a deprecated module attribute (torch's reduce_op) for its class warns
            for member in (vars(value).values() if issubclass(type(value), type) else (value,)):
                if type(member) in (staticmethod, classmethod):
                    member = member.__func__
                if type(member) is types.FunctionType and member.__module__ == module.__name__:
                    stack.append(member.__code__)
    while stack:
        code = stack.pop()
        if code not in found:
            found.add(code)
            stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return found


def guard_store(why: str) -> None:
    """Make the rendezvous store answer only torch's own group creation and the launcher.

    The store that brought the ranks together is a key-value service every rank reaches: data set by one rank
    and read by another would pass between them with no collective the checks see. Its methods now refuse unless
    called straight from ``torch.distributed.distributed_c10d`` or ``device_mesh`` (creating a group counts its
    members there: counters, never a caller's data) or from the launcher's own wait at the end of the call."""
    from torch.distributed import device_mesh, distributed_c10d

    from ..runtime import worker

    allowed = _code_objects((distributed_c10d, device_mesh, worker))
    for name in STORE_METHODS:
        original = getattr(dist.Store, name, None)
        if original is None:
            continue

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            if sys._getframe(1).f_code not in allowed:
                raise ForbiddenCall(why.format(name=f"Store.{_name}"))
            return _original(self, *args, **kwargs)

        setattr(dist.Store, name, guarded)


# The modules whose functions the walls replace: loading one afresh (after taking it out of sys.modules) would
# bring the originals back, so the audit hook refuses to.
REPLACED_MODULES = ("_thread", "_posixsubprocess")


def own_folder(batch: dict, rank: int) -> str:
    """This rank's own writable folder, its TMPDIR, HOME and working directory: no other rank may read it, so no
    file carries data between ranks (everything they exchange goes through collectives, which are recorded)."""
    import tempfile

    folder = os.path.join(batch["private"], "ranks", f"b{batch['batch']}-r{rank}")
    os.makedirs(folder, exist_ok=True)
    os.environ.update(TMPDIR=folder, HOME=folder, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "torchinductor"))
    tempfile.tempdir = folder
    os.chdir(folder)
    return folder


class FileRules:
    """Which paths learner code may read and write (the policy of the audit hook).

    It writes only in ``private`` (its rank's own folder); inside ``shared`` (the sandbox's folder, which holds
    every rank's) it reads only its own folder and ``readable`` (the learner's file)."""

    def __init__(self, private: str, hidden: list[str], shared: str | None = None, readable: tuple = (),
                 library: tuple = (), notes: tuple = ()):
        import sysconfig

        self.private = os.path.realpath(private)
        self.shared = os.path.realpath(shared) if shared else None
        self.readable = {os.path.realpath(p) for p in readable}
        self.hidden = [os.path.realpath(p) for p in hidden]
        # Python and its packages stay readable even when a virtual environment lives in the repository.
        self.library = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                               *sysconfig.get_paths().values(), *library)})
        self.pid = str(os.getpid())
        # The launcher's own notes of this rank (done, or the error it ended with): written and renamed into place
        # after the learner's code returns, and read by the launcher only.
        self.notes = {os.path.realpath(p) for p in notes}

    @staticmethod
    def _under(path: str, root: str) -> bool:
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

    def refusal(self, path, writing: bool) -> str | None:
        if isinstance(path, int):
            return None
        real = os.path.realpath(os.fsdecode(path))
        if real in self.notes:
            return None
        if writing and not (self._under(real, self.private) or real == os.devnull):
            return f"write {real}: learner code may write only in its own temporary folder"
        if self._under(real, self.private) or real in self.readable:
            return None
        if self.shared and self._under(real, self.shared):
            return f"read {real}: each rank reads only its own folder (ranks exchange data by collectives alone)"
        parts = real.split(os.sep)
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != self.pid:
            return f"read {real}: another process's files"
        if any(self._under(real, root) for root in self.hidden) and \
                not any(self._under(real, root) for root in self.library):
            return f"read {real}: the course's own code, the grader's files and other submissions are hidden"
        return None


def install_audit_hook(rules: FileRules, hidden_modules: tuple[str, ...]) -> None:
    """Refuse what learner code must not do, for the rest of this process's life (audit hooks cannot be removed)."""
    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (args + (None, None))[:3]
            writing = bool(flags and flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC)) or \
                bool(isinstance(mode, str) and any(c in mode for c in "wax+"))
            why = rules.refusal(path, writing)
            if why:
                raise PermissionError(f"the grader's sandbox refuses to {why}")
        elif event in ("os.listdir", "os.scandir") and args and args[0] is not None:
            why = rules.refusal(args[0], False)
            if why:
                raise PermissionError(f"the grader's sandbox refuses to {why.replace('read', 'list', 1)}")
        elif event == "import" and args and isinstance(args[0], str):
            name = args[0]
            if name in REPLACED_MODULES:
                raise ForbiddenCall(f"import {name} afresh: the grader's sandbox keeps the one it has (it refuses "
                                    f"to start threads and programs)")
            if name not in CENSORED_ON_IMPORT and \
                    any(name == m or name.startswith(m + ".") for m in hidden_modules):
                raise ForbiddenCall(f"import {name}: the course's own answers are not available to an exercise; "
                                    f"write it yourself")
        elif event == "os.rename" and len(args) >= 2 and all(
                isinstance(p, (str, bytes)) and os.path.realpath(os.fsdecode(p)) in rules.notes for p in args[:2]):
            return  # the launcher's note of this rank, renamed into place
        elif event == "os.kill" and args and args[0] not in (0, os.getpid()):
            raise PermissionError("the grader's sandbox refuses to signal other processes")
        elif event in _REFUSED_EVENTS:
            raise PermissionError(f"the grader's sandbox refuses to {_REFUSED_EVENTS[event]} ({event})")

    sys.addaudithook(hook)


# --- serving the host -----------------------------------------------------------------------------------


class Server:
    """One rank's side of the channel: loads the learner's file, calls into it, reports what happened."""

    def __init__(self, batch: dict, sock: socket.socket, recorder: Recorder):
        self.batch, self.sock, self.recorder = batch, sock, recorder
        self.module: types.ModuleType | None = None
        self.probes = __import__(batch["probes"], fromlist=["*"]) if batch.get("probes") else None
        self.probe_parts = probe_parts(self.probes) if self.probes else {}  # taken before any learner code runs

    def load(self) -> types.ModuleType:
        """The learner's file, executed afresh as module ``batch["module"]``."""
        path = self.batch["file"]
        with open(path, encoding="utf-8") as f:
            source = f.read()
        module = types.ModuleType(self.batch["module"])
        module.__file__ = path
        sys.modules[module.__name__] = module  # dataclasses and pickling look modules up here
        exec(compile(source, path, "exec"), module.__dict__)
        return module

    def handle(self, request: dict) -> dict:
        _CALL_START[0] = time.perf_counter()
        self.recorder.records = []
        try:
            if request["op"] == "load":
                self.module = None
                self.module = self.load()
                return {"ok": True}
            if self.module is None:
                raise RuntimeError("the learner's file is not loaded")
            args, kwargs = request.get("args", ()), request.get("kwargs", {})
            if request["op"] == "probe":
                fn = getattr(self.probes, request["name"])
                args = (self.module, *args)
            else:
                fn = getattr(self.module, request["name"], None)
                if fn is None:
                    raise AttributeError(f"the file defines no {request['name']}")
            if request["op"] == "probe":
                self.hold_probe()
            with self.recorder:
                value = fn(*args, **kwargs)
                if self.recorder not in _get_current_dispatch_mode_stack():
                    raise ForbiddenCall("the code took the grader's dispatch mode off the stack; the checks need "
                                        "to see every collective, so this call is not graded")
            if request["op"] == "probe":
                self.hold_probe()
            return {"ok": True, "value": value, "args": args if request["op"] == "call" else (),
                    "aliases": _aliases(value, args), "comm": list(self.recorder.records),
                    "time_s": elapsed()}
        except BaseException as e:  # noqa: BLE001 -- SystemExit, ForbiddenCall... from learner code too
            return {"ok": False, "type": type(e).__name__, "message": _message(e),
                    "traceback": traceback.format_exc()[-8000:], "comm": list(self.recorder.records)}

    def hold_probe(self) -> None:
        """Refuse the call if the learner's code replaced any part of the probe (its functions, their code, its
        classes' methods): what the probe reports is what the checks judge."""
        now, was = probe_parts(self.probes), self.probe_parts
        changed = sorted(k for k in now.keys() | was.keys() if now.get(k, now) is not was.get(k, now))
        if changed:
            names = list(dict.fromkeys(k.split(".__")[0] for k in changed))  # step, not also step.__code__
            raise ForbiddenCall(f"the code replaced the grader's probe ({', '.join(names[:4])} of "
                                f"{self.probes.__name__}); the checks judge what the probe observes, so this call "
                                f"is not graded")

    def serve(self) -> None:
        handle = self.handle  # bound before any learner code runs: a replaced Server.handle is never called
        while True:
            try:
                data = wire.recv_bytes(self.sock)
            except (wire.ChannelClosed, OSError):
                return
            reply = handle(wire.decode_request(data))
            try:
                encoded = wire.encode_reply(reply)
            except BaseException as e:  # noqa: BLE001 -- a value torch.save cannot write
                encoded = wire.encode_reply({"ok": False, "type": type(e).__name__, "message": _message(e),
                                             "traceback": ""})
            wire.send_bytes(self.sock, encoded)


def probe_parts(module: types.ModuleType) -> dict[str, object]:
    """Every part of a probe module a learner could replace to change what it reports: each name it holds, each
    function's code and defaults, each of its own classes' attributes and their functions' code."""
    parts: dict[str, object] = {}

    def add(name: str, value) -> None:
        parts[name] = value
        if isinstance(value, types.FunctionType):
            parts[f"{name}.__code__"] = value.__code__
            parts[f"{name}.__defaults__"] = value.__defaults__
            parts[f"{name}.__kwdefaults__"] = value.__kwdefaults__

    for name, value in list(vars(module).items()):
        add(name, value)
        if isinstance(value, type) and value.__module__ == module.__name__:
            for attr, member in list(vars(value).items()):
                add(f"{name}.{attr}", member)
    return parts


def _message(e: BaseException) -> str:
    try:
        return str(e)[:2000]
    except BaseException:  # noqa: BLE001 -- a learner's exception whose __str__ raises
        return type(e).__name__


def _aliases(value, args) -> int | None:
    """The index of the argument whose memory ``value`` shares (an in-place answer), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel() and value.numel() and \
                a.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
            return i
    return None


def serve_rank(batch: dict) -> list[str]:
    """One rank of a batch (started by :func:`gpucourse.launch` in the sandbox process); returns which of
    ``wire.SLOW_IMPORTS`` this process holds when the host is done with it."""
    from ..runtime import collective_status, current

    try:
        os.close(batch["control_fd"])  # the sandbox's own channel to the host is not the learner's
    except OSError:
        pass  # an isolated rank has none of the sandbox's descriptors already
    rank = dist.get_rank()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(batch["address"])
    status = os.path.join(batch["private"], f"status-{batch['batch']}-{rank}.json")
    collective_status.install(status)
    own = own_folder(batch, rank)
    # Its own mount namespace, in the PID and IPC namespaces the launcher gave it: the walls that the audit hook
    # below only doubles. Where they cannot be raised, the host says so in the grade's first line.
    unisolated = current().unisolated or batch["rank_walls"](own, [batch["file"]], batch["private"],
                                                             batch["output_bytes"], batch["library"])
    wire.send_bytes(sock, json.dumps({"rank": rank, "pid": os.getpid(), "token": batch["token"],
                                      "status": status, "unisolated": unisolated}).encode())
    dist.barrier()  # every rank's channel is up before any learner code runs

    for limit, value in ((resource.RLIMIT_AS, batch["memory_bytes"]), (resource.RLIMIT_FSIZE, batch["output_bytes"]),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the file-size limit a write fails instead of killing
    refusal = batch["refusal"]
    recorder = Recorder(set(batch["forbidden_collectives"]), refusal)
    replace_names(batch["forbidden_names"], refusal.replace("{op}", "{name}"))
    refuse_threads("the grader's sandbox refuses to start a thread ({name}): a collective issued from another "
                   "thread would go unseen by the checks, and no exercise needs one")
    refuse_programs("the grader's sandbox refuses to start a process ({name})")
    guard_store("the grader's sandbox refuses to use the rendezvous store ({name}): ranks exchange data by "
                "collectives alone, which the checks see")
    context = current()
    if context.channel is not None:  # the launcher's queue: every rank holds its ends, so it could carry data
        context.channel.close()
        context.channel = None
    server = Server(batch, sock, recorder)
    notes = [os.path.join(context.notes, f"{kind}-{rank}.json{tmp}") for kind in ("done", "error")
             for tmp in ("", ".tmp")] if context.notes else []
    rules = FileRules(own, batch["hidden_paths"], batch["private"], (batch["file"],), batch["library"], tuple(notes))
    install_audit_hook(rules, tuple(batch["hidden_modules"]))
    server.serve()
    return [name for name in wire.SLOW_IMPORTS if name in sys.modules]


# --- the sandbox process ----------------------------------------------------------------------------------


def censored_schedules(source: str) -> None:
    """Put a ``gpucourse.parallel.schedules`` in ``sys.modules`` that has the op format and the checker, but
    none of the reference schedules, and a ``gpucourse.parallel`` that holds nothing else.

    Exercise 5 may use ``Op``, the op kinds, ``validate`` and ``simulate``; the
    functions it may use must not carry the answer in their globals.
    """
    parallel = types.ModuleType("gpucourse.parallel")
    parallel.__path__ = []
    parallel.__package__ = "gpucourse.parallel"
    module = types.ModuleType("gpucourse.parallel.schedules")
    module.__file__ = "<the op format and checker of gpucourse.parallel.schedules>"
    module.__package__ = "gpucourse.parallel"
    sys.modules["gpucourse.parallel"] = parallel
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    for name in REFERENCE_SCHEDULE_NAMES:
        module.__dict__.pop(name, None)
    parallel.schedules = module


# The reference schedules and what builds them: removed from the censored module.
REFERENCE_SCHEDULE_NAMES = ("naive", "gpipe", "one_f_one_b", "_forward", "_backward", "SCHEDULES", "build",
                            "formula_bubble", "formula_bubble_ratio")
# The same for gpucourse.parallel.schedules_virtual: exercise 13 writes interleaved 1F1B, and may use the
# layout, the transfers, the checker and the simulator (Layout, with_transfers, check, validate, simulate).
REFERENCE_VIRTUAL_NAMES = ("interleaved_1f1b", "greedy", "SCHEDULES", "build", "formula_bubble_ratio")


class CensoredOnImport:
    """Serves censored modules of ``gpucourse.parallel`` when learner code imports them (and only then, so that
    an exercise that does not import one never has it in ``sys.modules``): a finder at the head of
    ``sys.meta_path`` that hands out a module built, and censored, before any learner code ran."""

    def __init__(self, modules: dict[str, types.ModuleType]):
        self._modules = modules

    def find_spec(self, name, path=None, target=None):
        if name not in self._modules:
            return None
        return importlib.util.spec_from_loader(name, self, origin=self._modules[name].__file__)

    def create_module(self, spec):
        return self._modules[spec.name]

    def exec_module(self, module) -> None:
        pass  # built and censored already


def censored_virtual_schedules(source: str) -> types.ModuleType:
    """A ``gpucourse.parallel.schedules_virtual`` without the reference schedules (the censored
    ``gpucourse.parallel.schedules`` must be in place: it imports the op format from there)."""
    name = "gpucourse.parallel.schedules_virtual"
    module = types.ModuleType(name)
    module.__file__ = "<the layout, transfers and checker of gpucourse.parallel.schedules_virtual>"
    module.__package__ = "gpucourse.parallel"
    sys.modules[name] = module  # dataclasses look the module up while the class is made
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    for reference in REFERENCE_VIRTUAL_NAMES:
        module.__dict__.pop(reference, None)
    return module


# Modules of the hidden ``gpucourse.parallel`` that learner code may import, censored (see CensoredOnImport).
CENSORED_ON_IMPORT = ("gpucourse.parallel.schedules_virtual",)


def main(control_fd: int, sources: dict[str, str], library: tuple = (), as_root: str = "", rank_walls=None) -> int:
    """Serve the host's batches (started by :mod:`gpucourse.grading.wall`, which raised the walls first).

    ``sources``: the text of ``gpucourse/parallel/schedules.py`` and ``schedules_virtual.py`` by module name,
    read before the walls went up; emptied here, so that only the censored modules outlive this call. ``library``:
    where the grader's packages live (readable by learner code even inside a hidden folder). ``as_root``: why
    this process is still root where it was to run as an unprivileged user ("" where it is not), told to the host
    with every batch. ``rank_walls``: what each rank raises its own walls with (:func:`.wall.rank_walls`, handed
    down by the module that raised this process's)."""
    from ..runtime import LaunchError, LaunchTimeout, WorkerError, launch
    from ..runtime import launcher

    # The launcher would import torch._dynamo before every fork (optimizers need it): most exercises do not, and it
    # is half of this process's start. Each batch names what its ranks need (Exercise.rank_imports); see below.
    launcher.PREIMPORTS = ()
    from . import probes  # noqa: F401

    censored_schedules(sources.pop("schedules"))
    virtual = censored_virtual_schedules(sources.pop("schedules_virtual"))
    sources.clear()
    sys.meta_path.insert(0, CensoredOnImport({virtual.__name__: virtual}))
    for name in probes.NAMES:
        __import__(f"{probes.__name__}.{name}")
    torch.set_num_threads(1)
    control = socket.socket(fileno=control_fd)
    reader = control.makefile("r", encoding="utf-8")
    for line in reader:
        batch = json.loads(line)
        batch["control_fd"] = control_fd
        batch["library"] = library
        batch["rank_walls"] = rank_walls
        late = []
        try:
            for name in batch["imports"]:  # before forking: the ranks inherit them (a rank's walls are up already)
                importlib.import_module(name)
            before = set(sys.modules)
            imported = launch(serve_rank, batch, world_size=batch["world_size"], device="cpu", quiet=True,
                              timeout=batch["limit_s"], pg_timeout=batch["limit_s"] + 30, isolate=True)
            # A slow module a rank had to import itself, that its exercise did not name: imported here for the
            # next batches, and told to the host (the suite holds every exercise's rank_imports to it).
            late = sorted({name for names in imported for name in names or ()} & set(wire.SLOW_IMPORTS) - before)
            for name in late:
                importlib.import_module(name)
            outcome = ""
        except WorkerError as e:
            outcome = json.dumps({"rank": e.rank, "type": e.exc_type, "message": e.message,
                                  "traceback": e.remote_traceback[-4000:]})
        except (LaunchTimeout, LaunchError) as e:
            outcome = json.dumps({"rank": None, "type": type(e).__name__, "message": str(e)[:2000], "traceback": ""})
        except Exception as e:  # noqa: BLE001 -- a rank that ended in a way the launcher has no word for
            outcome = json.dumps({"rank": None, "type": type(e).__name__, "message": str(e)[:2000], "traceback": ""})
        control.sendall((json.dumps({"batch": batch["batch"], "outcome": outcome, "late_imports": late,
                                  "as_root": as_root})
                         + "\n").encode())
    return 0

