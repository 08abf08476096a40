"""Who sits where: the seats of a workshop, the GPUs each one gets, and the environment its server runs in.

A seat is one learner's place: a name (``seat01``), a folder with its own copy
of the course, its own progress file, and its own GPUs. GPUs are shared out
through ``CUDA_VISIBLE_DEVICES``: a process sees only the GPUs listed there,
renumbered from 0, so partitioning a server is one environment variable per
seat. The lists never overlap; GPUs that do not divide evenly are left idle,
and the plan says so. A seat with no GPU is a CPU seat: its ranks are CPU
processes, and it gets a share of the cores (``OMP_NUM_THREADS``) so that one
seat's run does not starve the others.

Everything here is plain data and arithmetic, so the plan can be checked
before anything starts, and unit-tested for a machine we do not have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..course.kernel_sockets import private_folder, private_folder_path
from .errors import WorkshopError

INSTRUCTOR = "instructor"  # the hub's admin user when seats are generated


@dataclass(frozen=True)
class Seat:
    """One learner's place: hub user ``name``, course copy in ``folder``, ``gpus`` (empty: a CPU seat).

    A seat on a SLURM cluster has a ``job`` name: its server is that batch job, whose GPUs (``gres``, empty for
    none) and threads SLURM gives it, on whichever node it runs.
    """

    name: str
    folder: Path
    gpus: tuple[str, ...] = ()
    threads: int = 1
    job: str = ""
    gres: str = ""
    account: str = ""  # the Unix account its server runs as when it has one of its own (:mod:`.accounts`)

    @property
    def progress_file(self) -> Path:
        """Where this seat's grades and quiz scores are kept (``GPUCOURSE_PROGRESS``)."""
        return self.folder / ".gpucourse" / "progress.json"

    def describe(self) -> str:
        """``GPUs 0,1``, ``CPU, 2 threads``, or ``SLURM job, gres gpu:1``."""
        if self.job:
            return f"SLURM job, {f'gres {self.gres}' if self.gres else 'CPU'}"
        if self.gpus:
            return f"GPU{'s' * (len(self.gpus) > 1)} {','.join(self.gpus)}"
        return f"CPU, {self.threads} thread{'s' * (self.threads > 1)}"


@dataclass(frozen=True)
class Partition:
    """How the visible GPUs are shared: one tuple per seat, the ones left idle, and a sentence saying so."""

    per_seat: list[tuple[str, ...]]
    idle: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """Every seat of a workshop, and what the instructor should be told about how the machine was shared."""

    seats: list[Seat]
    notes: list[str] = field(default_factory=list)


def seat_names(count: int) -> list[str]:
    """``seat01``, ``seat02``, … (three digits from 100 seats on, so names sort as numbers do)."""
    width = max(2, len(str(count)))
    return [f"seat{i:0{width}d}" for i in range(1, count + 1)]


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may hand out: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set,
    else ``0 … n-1``, counted without initialising CUDA."""
    from ..runtime.launcher import visible_gpus

    count = visible_gpus()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [g.strip() for g in listed.split(",") if g.strip()][:count]


def partition(gpus: list[str], seats: int, gpus_per_seat: int | None = None) -> Partition:
    """Share ``gpus`` among ``seats``: ``gpus_per_seat`` each (default: as many as divide evenly).

    With no GPUs every seat is a CPU seat. ``gpus_per_seat=0`` asks for CPU
    seats on a GPU machine. Asking for more GPUs than there are is refused
    with a sentence; GPUs left over are named in the note.
    """
    if seats < 1:
        raise WorkshopError(f"--seats {seats} must be at least 1.")
    if gpus_per_seat is not None and gpus_per_seat < 0:
        raise WorkshopError(f"--gpus-per-seat {gpus_per_seat} must be 0 (CPU seats) or more.")
    n = len(gpus)
    if gpus_per_seat is None:
        if n == 0:
            return Partition([()] * seats, (), "no GPU is visible: every seat is a CPU seat")
        gpus_per_seat = n // seats
        if gpus_per_seat == 0:
            raise WorkshopError(f"{seats} seats need at least {seats} GPUs for one each, but {n} "
                                f"{'is' if n == 1 else 'are'} visible; use at most {n} seats, or "
                                f"--gpus-per-seat 0 for CPU seats.")
    if gpus_per_seat == 0:
        note = "CPU seats (--gpus-per-seat 0)" + (f"; GPUs {','.join(gpus)} left idle" if gpus else "")
        return Partition([()] * seats, tuple(gpus), note)
    need = seats * gpus_per_seat
    if need > n:
        raise WorkshopError(f"{seats} seats × {gpus_per_seat} GPUs need {need} GPUs, but {n} "
                            f"{'is' if n == 1 else 'are'} visible; use fewer seats or fewer GPUs per seat.")
    per_seat = [tuple(gpus[i * gpus_per_seat:(i + 1) * gpus_per_seat]) for i in range(seats)]
    idle = tuple(gpus[need:])
    note = f"{n} GPUs, {seats} seat{'s' * (seats > 1)} of {gpus_per_seat}"
    if idle:
        note += f": GPU{'s' * (len(idle) > 1)} {','.join(idle)} left idle ({n} GPUs do not divide into " \
                f"{seats} × {gpus_per_seat})"
    return Partition(per_seat, idle, note)


def thread_budget(seats: int, cores: int | None = None) -> int:
    """CPU threads per seat: the cores shared evenly, at least one."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, seats))


def make_plan(folders: dict[str, Path], gpus: list[str], gpus_per_seat: int | None = None,
              cores: int | None = None) -> Plan:
    """The seats named in ``folders`` (name -> course folder, in seat order) with their GPUs and threads."""
    shared = partition(gpus, len(folders), gpus_per_seat)
    threads = thread_budget(len(folders), cores)
    seats = [Seat(name, Path(folder), g, threads) for (name, folder), g in zip(folders.items(), shared.per_seat)]
    cores_text = f"{cores or os.cpu_count() or 1} cores"
    notes = [shared.note, f"{threads} CPU thread{'s' * (threads > 1)} per seat (OMP_NUM_THREADS; {cores_text} "
                          f"shared by {len(seats)} seat{'s' * (len(seats) > 1)})"]
    return Plan(seats, notes)


def seat_environment(seat: Seat, marker: dict[str, str] | None = None) -> dict[str, str]:
    """What a seat's JupyterLab (and so its kernels and ranks) runs with, on top of the hub's own.

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes the numbers in ``CUDA_VISIBLE_DEVICES``
    the ones ``nvidia-smi`` and the dashboard show. ``marker`` tags every
    process of the workshop so that stopping it can find them all. A SLURM
    seat's GPUs and threads are its job's: SLURM sets ``CUDA_VISIBLE_DEVICES``
    for the gres it allocated, and the job's script the threads.
    """
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "GPUCOURSE_PROGRESS": str(seat.progress_file),
           "GPUCOURSE_SEAT": seat.name}
    if not seat.job:
        threads = str(seat.threads)
        env.update(CUDA_VISIBLE_DEVICES=",".join(seat.gpus), OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    env.update(marker or {})
    return env


def seat_account(seat: str, system: bool, account: str = "") -> tuple[int, int] | None:
    """(uid, gid) of the account a seat's server runs as: the learner's with real accounts (``--users``), the
    seat's own ``account`` when it has one (:mod:`.accounts`; None while it is not made yet), else None: the
    seat runs as the hub's own account."""
    import pwd

    if system:
        entry = pwd.getpwnam(seat)
    elif account:
        try:
            entry = pwd.getpwnam(account)
        except KeyError:
            return None
    else:
        return None
    return entry.pw_uid, entry.pw_gid


def kernel_folder(workshop_id: str, seat: str, system: bool = False, make: bool = False,
                  account: str = "") -> Path:
    """Where a seat's server keeps its kernels' connection files and sockets (its ``JUPYTER_RUNTIME_DIR``).

    Kernels talk to their server over Unix sockets, so that no two seats can
    race for a TCP port (:mod:`gpucourse.course.kernel_sockets`); a socket's path must
    be short, so the folder is under /tmp, private to the account the server
    runs as: with real accounts (``system``) the learner's own, and with a seat
    ``account`` the seat's, whose folder is its alone; else the hub's account,
    one folder per seat. ``make``: create it, owned by that account.
    """
    owner = seat_account(seat, system, account)
    name = f"workshop-{workshop_id[:8]}" if owner else f"workshop-{workshop_id[:8]}-{seat}"
    uid, gid = owner if owner else (None, None)
    return private_folder(name, uid, gid) if make else private_folder_path(name, uid)
