"""Training on a SLURM cluster: the batch script that runs ``gpucourse train`` over several nodes, checked against
the cluster before it is submitted, and what became of the job.

``gpucourse submit --nodes 2 --gpus-per-node 8 --dp 16`` writes the script (:func:`batch_script`) and hands it to
``sbatch``. In it:

- ``srun`` starts one task on each node, and each task is one ``torchrun``, which starts that node's ranks: one per
  GPU, or CPU processes talking over gloo where the nodes have no GPU (``--gpus-per-node 0``);
- the torchruns meet in a c10d rendezvous on the first node (where the batch script itself runs), at a port found
  free there, under the job's id as rendezvous id: no port is fixed, and two jobs never share a rendezvous;
- under torchrun, ``gpucourse train`` runs in place (RANK and WORLD_SIZE are set): the entry point and the run
  are those of ``torchrun ... -m gpucourse train`` typed by hand, so a dp2 job over two nodes equals one device.
  Rank 0 writes ``--json``, ``--export-weights`` and the checkpoints in the folder the job was submitted from,
  which every node must see (a shared file system, as on any cluster);
- ``srun --kill-on-bad-exit`` ends every node's task as soon as one fails: a lost node ends the job at once instead
  of leaving the other ranks waiting in their next collective;
- with ``--save DIR`` the run also resumes from DIR: the first job starts at step 0, and the same command submitted
  again after a failure goes on from the last complete checkpoint (``gpucourse/checkpoint.py``).

Before anything is submitted, :func:`check` asks the cluster (``scontrol``) whether the job can run there — SLURM
answers, the partition exists and has the nodes, its nodes offer the GPUs (gres), the time limit is within the
partition's and covers the run by :func:`time_needed_s`'s rule — and refuses it in one sentence otherwise
(:class:`SlurmError`). After a job ends, :func:`diagnosis` says in one sentence why it failed.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a run is described: a workshop's hub asks SLURM without it
    from ..config import TrainConfig

QUERY_S = 30      # how long one of SLURM's commands may take to answer
POLL_S = 0.5      # how often a waiting `gpucourse submit --wait` asks for the job's state
LOG = "gpucourse-%j.out"  # each job's output, in the folder it was submitted from (%j: the job id)
# States a job never leaves (squeue's long names).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")

# The time a run needs, generously (time_needed_s): slower than this course's runs go on a laptop's cores or on any
# data-centre GPU, so a time limit under it is too short. (`tiny` dp2 on two CPU cores: 0.2-0.4 s a step, 1.3 s by
# this rule.)
START_S = 120.0   # every node imports torch, and the ranks meet
STEP_S = 1.0      # each step's fixed cost: Python, kernel launches, collectives
CPU_FLOPS = 1e9   # per CPU rank
GPU_FLOPS = 1e12  # per GPU: a thousandth of an H100's bf16 peak
TIME_RULE = ("2 minutes to start, then per step 1 s plus 6 × parameters × tokens FLOPs at 1 GFLOP/s per CPU rank "
             "or 1 TFLOP/s per GPU")


NOT_HERE = ("no SLURM reachable: {} is not on PATH (run this on the cluster's login node, where SLURM's commands "
            "are).")


class SlurmError(Exception):
    """What the cluster cannot do, or SLURM did not answer; the message is one sentence."""


@dataclass
class Request:
    """One training job: the ``gpucourse train`` flags and what the job asks SLURM for."""

    train: list[str]
    nodes: int
    procs_per_node: int
    gpus_per_node: int
    time_s: int
    partition: str | None = None
    name: str = "gpucourse"


# -- the batch script -----------------------------------------------------------------------------------------------

def format_time(seconds: float) -> str:
    """A time limit as SLURM writes it: ``HH:MM:SS``, or ``D-HH:MM:SS`` from a day on."""
    seconds = int(math.ceil(seconds))
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def parse_time(text: str) -> int | None:
    """Seconds in a SLURM time limit ("30" minutes, "MM:SS", "HH:MM:SS", "D-HH[:MM[:SS]]"); None for UNLIMITED."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise SlurmError(f"--time {text!r} is not a time limit: give minutes (30), HH:MM:SS or D-HH:MM:SS.")
    days, *parts = match.groups()
    numbers = [int(p) for p in parts if p is not None]
    if days is not None:  # days-hours[:minutes[:seconds]]
        h, m, s = (numbers + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    h, m, s = {1: [0, numbers[0], 0], 2: [0, *numbers], 3: numbers}[len(numbers)]  # minutes[:seconds], or H:M:S
    return (h * 60 + m) * 60 + s


def time_needed_s(cfg: TrainConfig, gpus_per_node: int) -> float:
    """How long ``cfg`` needs by :data:`TIME_RULE`: generous, so a time limit below it is too short."""
    from ..modeled.memory import active_params

    flops = 6 * active_params(cfg.model_config()) * cfg.batch_size * cfg.seq_len  # forward and backward, per step
    rate = cfg.world_size * (GPU_FLOPS if gpus_per_node else CPU_FLOPS)
    return START_S + cfg.steps * (STEP_S + flops / rate)


def interpreter_folder() -> str:
    """Where this Python and its ``torchrun`` are: relative to the current folder when inside it (``.venv/bin``),
    as every node runs the job from there."""
    folder = os.path.dirname(sys.executable)
    relative = os.path.relpath(folder)
    return folder if relative.startswith("..") else relative


# Run on the first node with bash's $head and $port: the rendezvous store, until the script kills it.
_STORE = ("import signal, torch.distributed as dist\n"
          "s = dist.TCPStore('$head', $port, is_master=True, wait_for_workers=False)\n"
          "signal.pause()")
_FREE_PORT = "import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])"


def batch_script(req: Request, bin_folder: str | None = None) -> str:
    """The sbatch script of ``req``: one torchrun per node, meeting on the first.

    The rendezvous store is served by a process of its own on the first node, not by that node's torchrun (each
    torchrun is told ``is_host=0``): torchrun's own store would close as soon as the first node's torchrun is done,
    while the other nodes' torchruns still use it to leave, and they would fill the log with connection errors.
    """
    bin_folder = bin_folder or interpreter_folder()
    python = shlex.quote(os.path.join(bin_folder, "python"))
    options = [f"--job-name={req.name}", f"--nodes={req.nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={req.procs_per_node}"]  # a CPU for each rank at least
    if req.gpus_per_node:
        options.append(f"--gpus-per-node={req.gpus_per_node}")
    if req.partition:
        options.append(f"--partition={req.partition}")
    options += [f"--time={format_time(req.time_s)}", f"--output={LOG}"]

    def words(*ws: str) -> list[str]:
        return [f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in ws]

    srun = [  # each part starts a line
        words("srun", "--kill-on-bad-exit=1", f"--cpus-per-task={req.procs_per_node}",
              os.path.join(bin_folder, "torchrun")),
        _flag_pairs(words("--nnodes", "$SLURM_NNODES", "--nproc-per-node", str(req.procs_per_node),
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", "$head:$port", "--rdzv-conf", "is_host=0",
                          "--rdzv-id", "$SLURM_JOB_ID")),
        ["-m gpucourse train", *_flag_pairs(words(*req.train))],
    ]
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {o}" for o in options),
        "",
        "# The nodes meet on this one, the first, at a port free here: the rendezvous store runs until every node's",
        "# torchrun has left. srun starts one torchrun per node, under the job's id; a node that fails ends them all.",
        "head=$(hostname)",
        f"port=$({python} -c {shlex.quote(_FREE_PORT)})",
        f'{python} -c "{_STORE}" &',
        "store=$!",
        " \\\n    ".join(_wrapped(part) for part in srun),
        "status=$?",
        "kill $store",
        "exit $status",
        "",
    ])


def _flag_pairs(words: list[str]) -> list[str]:
    """``--flag value`` as one word, so that a line is never broken between them."""
    pairs = []
    for word in words:
        if pairs and pairs[-1].startswith("--") and " " not in pairs[-1] and not word.startswith("--"):
            pairs[-1] += " " + word
        else:
            pairs.append(word)
    return pairs


def _wrapped(words: list[str], width: int = 100) -> str:
    """Shell words on lines of about ``width`` characters at most, continued with backslashes."""
    lines = [words[0]]
    for word in words[1:]:
        if len(lines[-1]) + len(word) + 1 > width:
            lines.append(word)
        else:
            lines[-1] += " " + word
    return " \\\n    ".join(lines)


# -- asking the cluster ---------------------------------------------------------------------------------------------

def _slurm(*argv: str) -> str:
    """The output of one of SLURM's commands; SlurmError when SLURM is not there or does not answer."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        raise SlurmError(f"no SLURM reachable: SLURM_CONF={conf} names no file.")
    if shutil.which(argv[0]) is None:
        raise SlurmError(NOT_HERE.format(argv[0]))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"no SLURM reachable: `{' '.join(argv)}` had no answer after {QUERY_S} s.") from None
    if done.returncode:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SlurmError(f"`{' '.join(argv)}` failed: {said[-1] if said else f'exit status {done.returncode}'}.")
    return done.stdout


def _records(text: str) -> list[dict[str, str]]:
    """``scontrol show ... -o`` output: one record a line, ``Key=Value`` pairs (a value may hold spaces)."""
    return [dict(re.findall(r"(\S+?)=(.*?)(?=\s+[^\s=]+=|\s*$)", line)) for line in text.splitlines() if line.strip()]


def reachable() -> None:
    """Raise SlurmError unless sbatch is here and the controller answers (``sinfo``)."""
    if shutil.which("sbatch") is None:
        raise SlurmError(NOT_HERE.format("sbatch"))
    try:
        _slurm("sinfo", "-h", "-o", "%P")
    except SlurmError as e:
        if str(e).startswith("no SLURM reachable"):
            raise
        raise SlurmError(f"no SLURM reachable: {e}") from None


def _gres(text: str) -> list[tuple[str, str | None, int]]:
    """``(name, type or None, count)`` of each resource in a ``Gres=`` list ("gpu:a100:4(S:0-1),nic:1"; "(null)":
    none)."""
    found = []
    for part in re.findall(r"(?:^|,)([^,(]+)(?:\([^)]*\))?", text.strip()):
        words = part.split(":")
        if words[0] in ("", "(null)"):
            continue
        count = int(words.pop()) if len(words) > 1 and words[-1].isdigit() else 1
        found.append((words[0], words[1] if len(words) > 1 else None, count))
    return found


def _gpus(gres: str) -> int:
    """GPUs in a node's ``Gres=`` ("gpu:8", "gpu:a100:4(S:0-1),nic:1"; "(null)": none)."""
    return sum(count for name, _, count in _gres(gres) if name == "gpu")


def _offers(node_gres: str, wanted: tuple[str, str | None, int]) -> int:
    """How many of ``wanted``'s kind (its name, and its type when it names one) a node's ``Gres=`` offers."""
    name, kind, _ = wanted
    return sum(count for n, k, count in _gres(node_gres) if n == name and (kind is None or k == kind))


def partition(name: str | None) -> tuple[str, dict[str, str]]:
    """The partition ``name`` (None: the cluster's default) and its ``scontrol`` record; SlurmError in one sentence
    when SLURM does not answer or has no such partition."""
    reachable()
    partitions = {p["PartitionName"]: p for p in _records(_slurm("scontrol", "show", "partition", "-o"))}
    chosen = name or next((n for n, p in partitions.items() if p.get("Default") == "YES"), None)
    if chosen is None:
        raise SlurmError(f"this cluster has no default partition: give --partition ({', '.join(partitions)}).")
    if chosen not in partitions:
        raise SlurmError(f"partition {chosen!r} does not exist on this cluster; it has {', '.join(partitions)}.")
    return chosen, partitions[chosen]


def _nodes(name: str) -> list[dict[str, str]]:
    """The ``scontrol`` records of partition ``name``'s nodes."""
    return [n for n in _records(_slurm("scontrol", "show", "node", "-o")) if name in n.get("Partitions", "").split(",")]


def node_addresses(name: str) -> dict[str, str]:
    """Where each node of partition ``name`` is reached (``NodeName`` -> ``NodeAddr``): a node's name need not be a
    host name (several slurmd on one host, ``slurmd -N``)."""
    return {n["NodeName"]: n.get("NodeAddr") or n["NodeName"] for n in _nodes(name)}


def check_gres(gres: str, name: str) -> None:
    """Refuse ``--gres`` (``gpu:1``, ``gpu:a100:2``, a MIG profile ``gpu:1g.10gb:1``; several joined by commas) in one
    sentence when it is malformed or no node of partition ``name`` offers all of it."""
    wanted = []
    for part in gres.split(","):
        if not re.fullmatch(r"[A-Za-z][\w.-]*(:[\w.-]+)?(:\d+)?", part) or part.endswith(":0"):
            raise SlurmError(f"--gres {gres!r} is not a generic resource: give name[:type]:count, such as gpu:1, "
                             f"gpu:a100:2 or gpu:1g.10gb:1.")
        wanted += _gres(part)
    nodes = _nodes(name)
    if not any(all(_offers(n.get("Gres", ""), w) >= w[2] for w in wanted) for n in nodes):
        offered = sorted({":".join(str(x) for x in g if x is not None)
                          for n in nodes for g in _gres(n.get("Gres", ""))})
        raise SlurmError(f"--gres {gres}: no node of partition {name} offers that"
                         + (f" (they offer {', '.join(offered)})." if offered else " (its nodes offer no gres)."))


def check_time(time_s: int | None, name: str, part: dict[str, str]) -> None:
    """Refuse a time limit longer than partition ``name`` (record ``part``) allows, in one sentence."""
    limit = parse_time(part.get("MaxTime", "UNLIMITED"))
    if limit is not None and (time_s is None or time_s > limit):
        asked = "UNLIMITED" if time_s is None else format_time(time_s)
        raise SlurmError(f"--time {asked} is longer than partition {name} allows ({format_time(limit)}).")


def check(req: Request, cfg: TrainConfig) -> None:
    """Refuse, in one sentence, a job this cluster cannot run: asked before anything is submitted."""
    name, part = partition(req.partition)
    total = int(part.get("TotalNodes", 0))
    if req.nodes > total:
        raise SlurmError(f"--nodes {req.nodes} is more than partition {name} has ({total} nodes).")
    if req.gpus_per_node:
        nodes = _nodes(name)
        enough = sum(_gpus(n.get("Gres", "")) >= req.gpus_per_node for n in nodes)
        if enough < req.nodes:
            most = max((_gpus(n.get("Gres", "")) for n in nodes), default=0)
            if not most:
                raise SlurmError(f"--gpus-per-node {req.gpus_per_node}: partition {name}'s nodes offer no GPUs (no "
                                 f"gres gpu); on CPU nodes leave it out, for CPU ranks over gloo.")
            raise SlurmError(f"--gpus-per-node {req.gpus_per_node} on {req.nodes} nodes: {enough} of partition "
                             f"{name}'s nodes offer that many GPUs (gres gpu, at most {most} a node).")
    check_time(req.time_s, name, part)
    needed = time_needed_s(cfg, req.gpus_per_node)
    if req.time_s < needed:
        raise SlurmError(f"--time {format_time(req.time_s)} is shorter than this run of {cfg.steps} steps needs: "
                         f"{format_time(needed)} by the rule {TIME_RULE}.")


def submit(script: str) -> str:
    """Hand ``script`` to sbatch (from the current folder, where the job will run); its job id."""
    reachable()
    try:
        done = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True,
                              timeout=QUERY_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"sbatch had no answer after {QUERY_S} s.") from None
    if done.returncode:
        said = done.stderr.strip().splitlines()
        raise SlurmError(f"sbatch refused the job: {said[-1] if said else f'exit status {done.returncode}'}.")
    return done.stdout.strip().split(";")[0]  # "id" or "id;cluster"


def queued(names: list[str]) -> list[dict[str, str]]:
    """The jobs in the queue (``squeue``) named one of ``names``: JobId, JobName, State, NodeList, Reason each."""
    if not names:
        return []
    out = _slurm("squeue", "-h", "--name", ",".join(names), "-o", "%i|%j|%T|%N|%r")
    keys = ("JobId", "JobName", "State", "NodeList", "Reason")
    return [dict(zip(keys, line.split("|", 4))) for line in out.splitlines() if line.strip()]


def cancel_all(job_ids: list[str]) -> None:
    """Ask SLURM to end these jobs (``scancel``); ones already gone are no error."""
    if job_ids:
        _slurm("scancel", *job_ids)


# -- a job ----------------------------------------------------------------------------------------------------------

def job(job_id: str) -> dict[str, str]:
    """What ``scontrol show job`` says of ``job_id`` (JobState, ExitCode, NodeList, StdOut ...)."""
    try:
        records = _records(_slurm("scontrol", "show", "job", "-o", job_id))
    except SlurmError as e:
        if "Invalid job id" in str(e):
            raise SlurmError(f"job {job_id} is not known to SLURM (a job is forgotten a while after it ends; "
                             f"its log stays in {log_path(job_id)}).") from None
        raise
    return records[0]


def state(info: dict[str, str]) -> str:
    """The job's state in a :func:`job` record: PENDING, RUNNING, COMPLETED, FAILED ..."""
    return info.get("JobState", "UNKNOWN")


def exit_status(info: dict[str, str]) -> int:
    """The job's exit status as a shell gives it: 0 when it completed, 128 + N when signal N ended it."""
    if state(info) == "COMPLETED":
        return 0
    code, signal = (int(n) for n in info.get("ExitCode", "0:0").split(":"))
    if code:
        return code
    return 128 + signal if signal else 1


def wait(job_id: str, on_change=None) -> dict[str, str]:
    """Poll until ``job_id`` has ended; ``on_change(info)`` hears each new state. The last record."""
    seen = None
    while True:
        info = job(job_id)
        if state(info) != seen:
            seen = state(info)
            if on_change is not None:
                on_change(info)
        if seen in ENDED:
            return info
        time.sleep(POLL_S)


def log_path(job_id: str, info: dict[str, str] | None = None) -> str:
    """Where the job's output is: what SLURM says, or gpucourse-ID.out here once SLURM has forgotten the job."""
    return (info or {}).get("StdOut") or LOG.replace("%j", job_id)


def cancel(job_id: str) -> None:
    job(job_id)  # an unknown job is refused in one sentence (scancel itself says nothing)
    _slurm("scancel", job_id)


def train_flags(job_id: str) -> list[str]:
    """The ``gpucourse train`` flags of the job's script (``scontrol write batch_script``), or [] if unreadable."""
    try:
        script = _slurm("scontrol", "write", "batch_script", job_id, "-")
    except SlurmError:
        return []
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    for i in range(len(words) - 2):
        if words[i:i + 3] == ["-m", "gpucourse", "train"]:
            return words[i + 3:]
    return []


def _cause(job_id: str, info: dict[str, str], log: str) -> str:
    """What ended the job, read from its state and from what srun and the ranks wrote in its log."""
    what = state(info)
    lost = re.search(r"srun: error: (\S+): tasks? [\d,-]+: (Killed|Terminated|Aborted|Segmentation fault)", log)
    exited = re.search(r"srun: error: (\S+): tasks? [\d,-]+: Exited with exit code (\d+)", log)
    refused = re.search(r"gpucourse: error: (.+)$", log, re.M)
    if what == "CANCELLED":
        return "was cancelled (scancel, or gpucourse submit --cancel)"
    if what == "TIMEOUT":
        return f"ran out of time: it reached its limit of {info.get('TimeLimit')}; give it a longer --time"
    if lost:
        return (f"failed: node {lost.group(1)} was lost mid-run (its ranks were {lost.group(2).lower()}, as when a "
                f"machine fails), and srun stopped the other nodes' ranks with it")
    if what == "NODE_FAIL":
        return f"failed: node(s) of {info.get('NodeList')} stopped answering SLURM's controller"
    if refused:
        return f"failed: {refused.group(1).rstrip('.')}"
    if exited:
        return (f"failed: a rank on node {exited.group(1)} exited with code {exited.group(2)}; its error is in "
                f"{log_path(job_id, info)}")
    return f"ended {what} with exit code {info.get('ExitCode')}; see {log_path(job_id, info)}"


def diagnosis(job_id: str, info: dict[str, str], log: str, flags: list[str]) -> str:
    """Why the job ended without completing, and what to do, in one sentence (``log``: its output; ``flags``: its
    ``gpucourse train`` flags, whose ``--save`` says where its checkpoints are)."""
    from ..checkpoint import complete_checkpoints

    sentence = f"job {job_id} {_cause(job_id, info, log)}"
    save = next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--save"), None)
    if state(info) == "CANCELLED":
        return sentence + "."
    if not save:
        return sentence + "; with --save DIR --save-every N, the same command submitted again goes on from the last " \
                          "checkpoint."
    done = complete_checkpoints(os.path.join(info.get("WorkDir", ""), save))
    if not done:
        return sentence + "; no checkpoint was complete yet, so the same command starts again from step 0."
    return sentence + f"; submit the same command again to go on from {save}/{os.path.basename(done[-1][1])}."
