"""What JupyterHub loads to give each seat its server: the seat spawner and where a user lands after login.

:class:`SeatSpawner` is JupyterHub's own ``LocalProcessSpawner`` (a local
process per user, no containers) that reads the workshop's plan
(``hub/seats.json``) and starts the seat's JupyterLab in the seat's folder,
with the seat's GPUs, progress file and thread budget in its environment. With
generated seats every server runs under the instructor's account, each in a
session of its own (so the hub can stop it, and everything it started, as one
group). With real accounts (``--users``) it switches to the learner's account
first, exactly as ``LocalProcessSpawner`` does.

Each server reaches its kernels over Unix sockets in a folder of its own
(:func:`.plan.kernel_folder`), never over TCP ports that another seat's server
could be handed at the same moment, and writes what it and its kernels say to
``hub/logs/<seat>.log``, which the class report reads for kernels that died.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from jupyterhub.utils import url_path_join
from traitlets import Bool, Unicode

from ..grading import remote
from ..grading.spawn import library_paths
from ..grading.wall import PACKAGE, seat_view
from .folder import REPO, Workshop, seat_from
from .grader import socket_path
from .plan import Seat, kernel_folder, seat_account, seat_environment
from .processes import MARKER


def seat_in_plan(plan_file: str, name: str) -> tuple[Seat, dict]:
    """The seat of hub user ``name`` in the workshop's plan, and the marker every workshop process carries."""
    with open(plan_file, encoding="utf-8") as f:
        plan = json.load(f)
    for s in plan["seats"]:
        if s["name"] == name:
            return seat_from(s), plan["marker"]
    raise RuntimeError(f"{name} has no seat in this workshop; the class dashboard is at /services/dashboard/")


def course_path(env: dict) -> str:
    """``PATH`` with the course's Python first, so that 'gpucourse' and 'python' in a seat's terminal are the hub's
    own."""
    return os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)


class SeatOf:
    """What every kind of seat spawner shares (it has ``plan_file`` and ``system_users`` traits): which seat a hub
    user has, and the environment a seat's server sees when seats are not real accounts."""

    def seat(self) -> tuple[Seat, dict]:
        """This user's seat in the plan, and the marker every workshop process carries."""
        return seat_in_plan(self.plan_file, self.user.name)

    def user_env(self, env):
        if self.system_users:
            return super().user_env(env)
        seat = self.seat()[0]
        env.update(USER=seat.name, HOME=str(seat.folder), SHELL="/bin/bash")
        return env


class SeatSpawner(SeatOf, LocalProcessSpawner):
    """A seat's JupyterLab: its folder, its GPUs (``CUDA_VISIBLE_DEVICES``), its progress file."""

    plan_file = Unicode(help="the workshop's hub/seats.json").tag(config=True)
    system_users = Bool(False, help="seats are real accounts: run each server as its user").tag(config=True)

    def make_preexec_fn(self, name):
        if self.system_users:
            return super().make_preexec_fn(name)
        seat, marker = self.seat()
        folder = str(seat.folder)
        owner = seat_account(seat.name, False, seat.account)
        if owner is None:
            def enter_seat():  # runs in the child, before exec: the seat's folder as working directory
                os.chdir(folder)
            return enter_seat
        uid, gid = owner
        needed, hidden = seat_walls(self.workshop(), seat, kernel_folder(marker[MARKER], seat.name, False,
                                                                       account=seat.account))

        def enter_own_seat():  # in the child, before exec: walls up, then the seat's user for good
            seat_view(needed, hidden)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.chdir(folder)
        return enter_own_seat

    def workshop(self) -> Workshop:
        return Workshop(Path(self.plan_file).parents[1])

    def get_env(self):
        env = super().get_env()
        seat, marker = self.seat()
        env.update(seat_environment(seat, marker))
        env["JUPYTER_RUNTIME_DIR"] = str(kernel_folder(marker[MARKER], seat.name, self.system_users,
                                                       account=seat.account))
        env["PATH"] = course_path(env)
        if seat.account:  # the checks are out of its reach: check() asks the workshop's grading service
            env[remote.ENV_VAR] = str(socket_path(self.workshop()))
        return env

    async def start(self):
        seat, marker = self.seat()
        self.notebook_dir = str(seat.folder)
        kernel_folder(marker[MARKER], seat.name, self.system_users, make=True, account=seat.account)
        log = self.workshop().seat_log(seat.name)
        log.parent.mkdir(exist_ok=True)
        with open(log, "ab") as out:  # the server keeps its own copy of the descriptor
            self.popen_kwargs = {**self.popen_kwargs, "stdout": out, "stderr": subprocess.STDOUT}
            return await super().start()


def seat_walls(ws: Workshop, seat: Seat, kernels: Path) -> tuple[list[str], list[str]]:
    """What a seat with an account of its own must reach (the interpreter and its packages, the course's
    package, its folder, its kernels' folder, the grading service) and what it must not read though its modes
    would let it: the rest of the course's repository (``solutions/``, the tests and their wrong answers, the
    history), the checks (each file reads as empty; their names stay, as ``check()`` lists them), and the
    workshop's own state."""
    package = os.path.realpath(PACKAGE)
    needed = sorted({os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix,
                                                   sys.base_exec_prefix, *library_paths(), package, seat.folder,
                                                   kernels, socket_path(ws).parent)})

    def inside(path: str) -> bool:
        return any(n == path or n.startswith(path + os.sep) for n in needed)

    repository = os.path.realpath(REPO)
    hidden = [os.path.join(repository, name) for name in sorted(os.listdir(repository))
              if not inside(os.path.join(repository, name))]
    checks = os.path.join(package, "grading", "checks")
    hidden += [os.path.join(checks, name) for name in sorted(os.listdir(checks))]
    root = os.path.realpath(ws.root)
    hidden += [os.path.join(root, name) for name in sorted(os.listdir(root))
               if not inside(os.path.join(root, name)) and name != "seats"]
    return needed, hidden


# Where a learner starts, in a seat's folder (folder.COURSE): notebook 00, not an empty launcher.
FIRST_NOTEBOOK = "notebooks/00_setup.ipynb"


def landing_page(handler) -> str:
    """After login: the instructor (an admin) to the class dashboard, a learner to the first notebook in their own
    JupyterLab. A visitor not logged in gets "": the hub then sends them to its login page (its own base URL
    would send them back here, for ever)."""
    user = handler.current_user
    if user is None:
        return ""
    if user.admin:
        return url_path_join(handler.base_url, "services/dashboard/")
    return url_path_join(user.url, "lab/tree", FIRST_NOTEBOOK)
