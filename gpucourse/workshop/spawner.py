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

from .folder import Workshop, seat_from
from .plan import Seat, kernel_folder, seat_environment
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
        folder = str(self.seat()[0].folder)

        def enter_seat():  # runs in the child, before exec: no setuid, the seat's folder as working directory
            os.chdir(folder)
        return enter_seat

    def get_env(self):
        env = super().get_env()
        seat, marker = self.seat()
        env.update(seat_environment(seat, marker))
        env["JUPYTER_RUNTIME_DIR"] = str(kernel_folder(marker[MARKER], seat.name, self.system_users))
        env["PATH"] = course_path(env)
        return env

    async def start(self):
        seat, marker = self.seat()
        self.notebook_dir = str(seat.folder)
        kernel_folder(marker[MARKER], seat.name, self.system_users, make=True)
        log = Workshop(Path(self.plan_file).parents[1]).seat_log(seat.name)
        log.parent.mkdir(exist_ok=True)
        with open(log, "ab") as out:  # the server keeps its own copy of the descriptor
            self.popen_kwargs = {**self.popen_kwargs, "stdout": out, "stderr": subprocess.STDOUT}
            return await super().start()


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
