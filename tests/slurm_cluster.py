"""A SLURM cluster on this machine, for the tests of ``gpucourse submit`` and for a person to try it on.

One controller (slurmctld) and one slurmd per node name (n1, n2, ...), every node this host, with munge for their
authentication: Debian's ``slurm-wlm`` and ``munge`` (scripts/install-slurm). Everything lives in one temporary
folder — the configuration, munge's key and socket, the state, spool, log and pid files — and every port is one
the system found free, so two clusters (two test runs) on one machine do not meet. No cgroups and no systemd:
processes are tracked through their parents (proctrack/linuxproc) and tasks are not bound to CPUs (task/none).

SLURM's commands find this cluster through ``SLURM_CONF`` (:attr:`Cluster.env`). Every daemon, and so every job
step and task they start, carries that variable, which is how :meth:`Cluster.stop` checks that nothing is left —
but so does the shell a person exported it in, and whatever that shell runs (``make slurm-down`` itself): a
process is the cluster's only if it also descends from a daemon or a job step, or runs a job's task.

    python tests/slurm_cluster.py up      # prints the export line for SLURM_CONF (make slurm-up)
    python tests/slurm_cluster.py down    # stops it and checks that no process is left (make slurm-down)
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpucourse.workshop.processes import end, identity, wait_until
from procs import REPO, environment, free_port, processes_with

DAEMONS = ("munged", "slurmctld", "slurmd")
# Where `up` notes the cluster's folder for `down` ($GPUCOURSE_SLURM_POINTER moves it, for a test of its own).
POINTER = Path(os.environ.get("GPUCOURSE_SLURM_POINTER", REPO / ".slurm-cluster"))
START_S = 30  # how long the daemons may take until every node is idle
STOP_S = 15   # how long jobs and daemons may take to end


def installed() -> bool:
    """Whether this machine has SLURM's daemons and munge (scripts/install-slurm installs them)."""
    return all(shutil.which(d) for d in DAEMONS)


def _config(folder: Path, nodes: list[str]) -> str:
    host, cpus, user = socket.gethostname(), os.cpu_count() or 1, getpass.getuser()
    node_lines = [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} State=UNKNOWN"
                  for n in nodes]
    return "\n".join([
        "ClusterName=gpucourse",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge/socket",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/run/slurmctld.pid",
        f"SlurmdPidFile={folder}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log",
        f"SlurmdLogFile={folder}/log/slurmd-%n.log",
        f"PlugStackConfig={folder}/plugstack.conf",  # none: not the system's /etc/slurm/plugstack.conf
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "KillWait=5",
        "MinJobAge=3600",  # a finished job stays in `scontrol show job` for the whole test session
        *node_lines,
        f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=60 State=UP",
        "",
    ])


@dataclass
class Cluster:
    """A running test cluster: its folder, its configuration file and its node names."""

    folder: Path
    nodes: list[str]

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What points SLURM's commands at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """One of SLURM's commands (sinfo, squeue, scancel ...) on this cluster."""
        return subprocess.run(command, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30,
                              check=check)

    def idle_nodes(self) -> set[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return {name for name, state in (line.split() for line in out.splitlines()) if state == "idle"}

    def processes(self) -> list[int]:
        """Every process of this cluster: its daemons and what they started, the job steps (slurmstepd leaves the
        daemons' tree: its parent is init) and the jobs' tasks. Never this process or one it runs under."""
        daemons = self.folder / "daemons.json"
        roots = {pid for pid, _ in json.loads(daemons.read_text()).values()} if daemons.exists() else set()
        callers = _ancestors(os.getpid())

        def ours(pid: int) -> bool:
            if any(e.startswith(b"SLURM_JOB_ID=") for e in environment(pid)) or _session(pid) in roots:
                return True  # a job's task, or in a daemon's session (each daemon starts one of its own)
            return any(p in roots or _command(p).startswith("slurmstepd") for p in _ancestors(pid))

        return [pid for pid in processes_with(f"SLURM_CONF={self.conf}") if pid not in callers and ours(pid)]

    def job_processes(self, job_id: str, node: str) -> list[int]:
        """The processes job ``job_id`` runs on ``node`` (its torchrun and ranks there)."""
        on_node = f"SLURMD_NODENAME={node}".encode()
        return [pid for pid in processes_with(f"SLURM_JOB_ID={job_id}") if on_node in environment(pid)]

    def stop(self) -> None:
        """Cancel every job, stop every daemon, and fail if any process of the cluster is left."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
            wait_until(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).stdout.split(), STOP_S)
        daemons = json.loads((self.folder / "daemons.json").read_text())
        # The slurmds and the controller before munge, which they need to the end.
        for names in (("slurmd", "slurmctld"), ("munged",)):
            end([pid for name, (pid, start) in daemons.items() if name.split("-")[0] in names
                 and identity(pid) == [pid, start]], grace=STOP_S)
        left = end(self.processes(), grace=STOP_S)
        if left:
            raise RuntimeError(f"the test cluster in {self.folder} left processes running: {left}")
        shutil.rmtree(self.folder, ignore_errors=True)


def _stat(pid: int, field: int) -> int:
    """A number of /proc/PID/stat, counted from the state after the command's name (0: ppid, 2: session)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[field + 1])
    except (OSError, IndexError, ValueError):
        return 0


def _parent(pid: int) -> int:
    return _stat(pid, 0)


def _session(pid: int) -> int:
    return _stat(pid, 2)


def _ancestors(pid: int) -> set[int]:
    """``pid`` and every process it runs under, up to init."""
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        pid = _parent(pid)
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _daemon(cluster: Cluster, name: str, *argv: str) -> list:
    log = open(cluster.folder / "log" / f"{name}.out", "wb")
    proc = subprocess.Popen(argv, env={**os.environ, **cluster.env}, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # outlives `up` for make slurm-up
    log.close()
    return identity(proc.pid)


def start(nodes: int = 2) -> Cluster:
    """Start munged, slurmctld and a slurmd per node; return once ``sinfo`` shows every node idle."""
    for daemon in DAEMONS:
        if not shutil.which(daemon):
            raise RuntimeError(f"{daemon} is not installed: run scripts/install-slurm.")
    folder = Path(tempfile.mkdtemp(prefix="gpucourse-slurm-"))
    cluster = Cluster(folder, [f"n{i + 1}" for i in range(nodes)])
    for sub in ("state", "run", "log", "munge", *(f"spool/{n}" for n in cluster.nodes)):
        (folder / sub).mkdir(parents=True)
    # munged checks its files' modes: a private key, a socket folder everyone may enter.
    folder.chmod(0o755)
    (folder / "munge").chmod(0o755)
    key = folder / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    (folder / "plugstack.conf").write_text("")
    cluster.conf.write_text(_config(folder, cluster.nodes))
    daemons = {}
    try:
        munge = folder / "munge"
        daemons["munged"] = _daemon(cluster, "munged", "munged", "--foreground", f"--key-file={key}",
                                    f"--socket={munge}/socket", f"--pid-file={munge}/munged.pid",
                                    f"--seed-file={munge}/munged.seed", f"--log-file={folder}/log/munged.log")
        if not wait_until((munge / "socket").exists, START_S):
            raise RuntimeError(f"munged did not start: see {folder}/log/munged.out")
        daemons["slurmctld"] = _daemon(cluster, "slurmctld", "slurmctld", "-D")
        for node in cluster.nodes:
            daemons[f"slurmd-{node}"] = _daemon(cluster, f"slurmd-{node}", "slurmd", "-D", "-N", node)
        (folder / "daemons.json").write_text(json.dumps(daemons))
        if not wait_until(lambda: cluster.idle_nodes() == set(cluster.nodes), START_S, step=0.2):
            raise RuntimeError(f"the test cluster's nodes were not idle after {START_S} s: see {folder}/log")
    except BaseException:
        (folder / "daemons.json").write_text(json.dumps(daemons))
        cluster.stop()
        raise
    return cluster


def main(argv: list[str]) -> int:
    if argv == ["up"]:
        if POINTER.exists():
            print(f"a test cluster is already up ({POINTER.read_text().strip()}); `make slurm-down` stops it.",
                  file=sys.stderr)
            return 1
        try:
            cluster = start()
        except RuntimeError as e:
            print(f"slurm-up: {e}", file=sys.stderr)
            return 1
        POINTER.write_text(f"{cluster.folder}\n")
        print(f"SLURM test cluster up: nodes {', '.join(cluster.nodes)}, partition debug. In your shell:\n"
              f"export SLURM_CONF={cluster.conf}")
        return 0
    if argv == ["down"]:
        if not POINTER.exists():
            print("no test cluster is up.", file=sys.stderr)
            return 0
        folder = Path(POINTER.read_text().strip())
        if not (folder / "daemons.json").exists():  # its folder is gone (a reboot cleans /tmp): nothing to stop
            POINTER.unlink()
            print(f"the test cluster in {folder} is gone already; forgot it.", file=sys.stderr)
            return 0
        try:
            Cluster(folder, []).stop()
        except RuntimeError as e:
            print(f"slurm-down: {e}; run `make slurm-down` again to retry.", file=sys.stderr)
            return 1
        POINTER.unlink()
        print(f"SLURM test cluster in {folder} stopped; no process of it is left.")
        return 0
    print("usage: python tests/slurm_cluster.py up|down", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
