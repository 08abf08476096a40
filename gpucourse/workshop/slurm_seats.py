"""Workshop seats as SLURM jobs: what each seat asks of the cluster, checked before anything starts, and what the
queue says of each seat while the workshop runs.

With ``gpucourse workshop start --spawner slurm`` the hub runs on this machine (a login or service node) and each
seat's JupyterLab is a batch job (:mod:`.slurm_spawner`, batchspawner's SlurmSpawner): one node, one task, the
partition, gres and time limit given here, the seat's folder as its working folder. Everything a seat keeps — its
copy of the course, its progress file, its server's log — is in the workshop's folder, which the compute nodes
must see at the same path (a shared file system), as they must see the course's Python environment.

Each seat's job is named ``gpucourse-<workshop id>-<seat>``: that name is how the dashboard finds the seat's job in
``squeue`` (pending, running, on which node) and how ``stop`` makes sure that no job of the workshop is left.
This module asks SLURM only through :mod:`gpucourse.course.slurm` and imports neither JupyterHub nor batchspawner, so the
class report can use it anywhere.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

from ..course import slurm
from .errors import WorkshopError
from .plan import Plan, make_plan
from .processes import wait_until

SPAWNER = "gpucourse.workshop.slurm_spawner.SlurmSeatSpawner"
CANCEL_S = 60.0  # for every seat's job to leave the queue once cancelled (SLURM's KillWait is 30 s by default)

# The seat's job. batchspawner fills it in (jinja2): each {{x}} is the spawner's req_x; {{cmd}} starts the server
# through batchspawner-singleuser, which tells the hub the port it picked on the node.
BATCH_SCRIPT = """#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --output={{log}}
#SBATCH --open-mode=append
#SBATCH --chdir={{homedir}}
#SBATCH --export=ALL
#SBATCH --nodes=1
#SBATCH --ntasks=1
{% if partition %}#SBATCH --partition={{partition}}
{% endif %}{% if runtime %}#SBATCH --time={{runtime}}
{% endif %}{% if gres %}#SBATCH --gres={{gres}}
{% endif %}{% if options %}#SBATCH {{options}}
{% endif %}
# A gpucourse workshop seat: its JupyterLab runs until the hub cancels this job or the time limit ends it.
# Its GPUs are those SLURM allocated (CUDA_VISIBLE_DEVICES); its threads, the CPUs SLURM gave the job.
export OMP_NUM_THREADS=${SLURM_CPUS_ON_NODE:-1} MKL_NUM_THREADS=${SLURM_CPUS_ON_NODE:-1}
trap 'echo "gpucourse: the job was asked to stop (scancel or its time limit)"' TERM
{{prologue}}
{{cmd}}
status=$?
{{epilogue}}
exit $status
"""


def job_name(workshop_id: str, seat: str) -> str:
    """The name of ``seat``'s job in SLURM's queue."""
    return f"gpucourse-{workshop_id[:8]}-{seat}"


def slurm_environment() -> dict[str, str]:
    """What points SLURM's commands at the cluster (``SLURM_CONF``, where set), for the hub's own children."""
    return {k: os.environ[k] for k in ("SLURM_CONF",) if k in os.environ}


def checked_request(partition: str | None, gres: str | None, time: str | None) -> dict:
    """What every seat's job asks for, checked against the cluster: ``{"partition", "gres", "time"}`` with the
    partition resolved (its default when none is named) and the time as SLURM writes it.

    Refused in one sentence (:class:`.WorkshopError`) before anything starts: batchspawner missing, a malformed
    time, no SLURM answering, a partition that does not exist, gres its nodes lack, a time over its limit.
    """
    if importlib.util.find_spec("batchspawner") is None:
        raise WorkshopError("batchspawner is not installed in this Python; 'make workshop-deps' installs it.")
    try:
        time_s = slurm.parse_time(time) if time else None
        name, record = slurm.partition(partition)
        if gres:
            slurm.check_gres(gres, name)
        if time:
            slurm.check_time(time_s, name, record)
    except slurm.SlurmError as e:
        raise WorkshopError(str(e)) from None
    return {"partition": name, "gres": gres or "",
            "time": slurm.format_time(time_s) if time_s is not None else (time or "").upper()}


def node_addresses(partition: str) -> dict[str, str]:
    """Where the hub's proxy reaches a server on each node of ``partition`` (node name -> address)."""
    try:
        return slurm.node_addresses(partition)
    except slurm.SlurmError as e:
        raise WorkshopError(str(e)) from None


def make_seats(folders: dict[str, Path], workshop_id: str, request: dict) -> Plan:
    """The seats of a SLURM workshop: each its folder and its job; GPUs and threads are the job's."""
    plan = make_plan(folders, [], 0)
    seats = [replace(s, job=job_name(workshop_id, s.name), gres=request["gres"]) for s in plan.seats]
    gpus = f"gres {request['gres']}" if request["gres"] else "no GPU asked (CPU nodes)"
    limit = f"time limit {request['time']}" if request["time"] else "the partition's default time limit"
    return Plan(seats, [f"each seat is a SLURM job on partition {request['partition']}: {gpus}, {limit}"])


def queued_jobs(plan: Plan) -> list[dict]:
    """Every job of the workshop's seats in the queue now (``squeue``: JobId, JobName, State, NodeList, Reason), oldest
    first. Raises :class:`.WorkshopError` when SLURM does not answer."""
    try:
        queued = slurm.queued(sorted(s.job for s in plan.seats if s.job))
    except slurm.SlurmError as e:
        raise WorkshopError(str(e)) from None
    return sorted(queued, key=lambda j: int(j["JobId"].split("_")[0]))


def seat_jobs(plan: Plan) -> dict[str, dict]:
    """Each SLURM seat's newest job in the queue, by seat; a seat with no job in the queue is left out."""
    seat = {s.job: s.name for s in plan.seats if s.job}
    return {seat[j["JobName"]]: j for j in queued_jobs(plan) if j["JobName"] in seat}


def describe_job(job: dict | None) -> str:
    """``running on n1 (job 12)``, ``pending: Resources (job 13)``, or ``no job`` for a seat with none queued."""
    if job is None:
        return "no job"
    state = job["State"].lower()
    if state == "running":
        return f"running on {job['NodeList']} (job {job['JobId']})"
    reason = job.get("Reason", "None")
    return f"{state}{f': {reason}' if reason not in ('None', '') else ''} (job {job['JobId']})"


def cancel_jobs(plan: Plan, within: float = CANCEL_S) -> list[str]:
    """Cancel every seat's job still in the queue and wait until none is; the ids of those still there after
    ``within`` seconds. Raises :class:`.WorkshopError` when SLURM does not answer."""
    try:
        slurm.cancel_all([j["JobId"] for j in queued_jobs(plan)])
    except slurm.SlurmError as e:
        raise WorkshopError(str(e)) from None
    wait_until(lambda: not queued_jobs(plan), within, step=0.5)
    return [j["JobId"] for j in queued_jobs(plan)]
