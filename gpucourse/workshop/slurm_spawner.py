"""What JupyterHub loads to run each seat's JupyterLab as a SLURM batch job (``workshop start --spawner slurm``).

:class:`SlurmSeatSpawner` is batchspawner's ``MultiSlurmSpawner`` told about the seat. The hub submits the seat's
job with ``sbatch`` (:data:`.slurm_seats.BATCH_SCRIPT`), follows it with ``squeue`` (pending, running, on which
node) and ends it with ``scancel``. In the job, ``batchspawner-singleuser`` picks a free port on the node, tells it
to the hub (a POST to ``/hub/api/batchspawner``, which importing batchspawner adds to the hub) and starts the seat's
JupyterLab there; the hub's proxy then routes ``/user/<seat>/`` to that node and port. ``daemon_resolver`` maps
SLURM's node names to addresses the proxy can reach (they differ where one host runs several slurmd).

The job's environment is the seat's (:func:`.plan.seat_environment`: progress file, seat name, the workshop's
marker) with the course's Python first on ``PATH``; ``sbatch --export=ALL`` hands it to the job. Its GPUs are the
gres SLURM allocated it. Its kernels talk to it over Unix sockets in a private folder under the node's /tmp, which
the job makes first and removes when its server ends. What the server says goes to the seat's log on the shared
folder (``hub/logs/<seat>.log``), where the class report reads it.

Who submits: with generated seats every job is submitted by, and runs as, the account that runs the hub
(``exec_prefix`` empty), as generated seats' servers do on one machine; with real accounts (``--users``) batchspawner's
own default, ``sudo -E -u <learner>``, submits each job as its learner.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from batchspawner import MultiSlurmSpawner  # importing batchspawner adds /hub/api/batchspawner to the hub
from traitlets import Bool, Unicode, default

from .folder import Workshop
from .plan import kernel_folder, seat_environment
from .processes import MARKER
from .slurm_seats import BATCH_SCRIPT, slurm_environment
from .spawner import SeatOf, course_path


class SlurmSeatSpawner(SeatOf, MultiSlurmSpawner):
    """A seat's JupyterLab as a SLURM job: in the seat's folder, with its progress file, logging to its seat log."""

    plan_file = Unicode(help="the workshop's hub/seats.json").tag(config=True)
    system_users = Bool(False, help="seats are real accounts: submit each job as its user").tag(config=True)
    batch_script = Unicode(BATCH_SCRIPT).tag(config=True)
    # Template variables of the batch script, beside batchspawner's own req_* (partition, runtime, gres ...).
    req_job_name = Unicode(help="the seat's job's name in the queue")
    req_log = Unicode(help="where the seat's job writes (its seat log, on the shared folder)")

    def _kernels(self) -> Path:
        seat, marker = self.seat()
        return kernel_folder(marker[MARKER], seat.name, self.system_users)

    @default("req_homedir")
    def _seat_folder(self):
        return str(self.seat()[0].folder)

    @default("req_job_name")
    def _job_name(self):
        return self.seat()[0].job

    @default("req_log")
    def _log(self):
        return str(Workshop(Path(self.plan_file).parents[1]).seat_log(self.user.name))

    @default("req_prologue")
    def _make_kernel_folder(self):
        seat, marker = self.seat()
        make = (f"from gpucourse.workshop.plan import kernel_folder; "
                f"kernel_folder({marker[MARKER]!r}, {seat.name!r}, {self.system_users}, make=True)")
        return shlex.join([sys.executable, "-c", make])

    @default("req_epilogue")
    def _remove_kernel_folder(self):
        return shlex.join(["rm", "-rf", str(self._kernels())])

    def get_env(self):
        env = super().get_env()
        seat, marker = self.seat()
        env.update(seat_environment(seat, marker))
        env.update(slurm_environment())
        env["JUPYTER_RUNTIME_DIR"] = str(self._kernels())
        # The hub's PATH after the course's Python: sbatch is run with this environment, and the job inherits it.
        env["PATH"] = course_path({"PATH": os.environ.get("PATH", "")})
        return env

    def cmd_formatted_for_batch(self):
        return shlex.join([self.batchspawner_singleuser_cmd, *self.cmd, *self.get_args()])

    async def start(self):
        seat = self.seat()[0]
        self.notebook_dir = str(seat.folder)
        Path(self.req_log).parent.mkdir(exist_ok=True)
        return await super().start()
