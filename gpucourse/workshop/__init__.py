"""Running the course for a class on one shared server (or a SLURM cluster): JupyterHub seats, GPUs per seat, a
live dashboard.

    gpucourse workshop start --seats 4 --gpus-per-seat 2   # a hub, 4 seats, their codes printed once
    gpucourse workshop start --seats 4 --spawner slurm --gres gpu:1    # or: each seat a SLURM job, 1 GPU
    gpucourse workshop status                              # who passed what, who is stuck where, GPU use
    gpucourse workshop collect --out grades.csv            # every seat graded into one CSV
    gpucourse workshop stop                                # everything stopped, every seat's work kept
    gpucourse workshop remove-users                        # as root: the seats' Unix users removed, files kept

The same from Python: :func:`.hub.start`, :func:`.report.status`, :func:`.collect.collect`, :func:`.hub.stop`.

How it fits together, one module each:

- :mod:`.plan` — the seats and how the GPUs are shared among them (``CUDA_VISIBLE_DEVICES``);
- :mod:`.folder` — the workshop folder: settings, secrets, and each seat's copy of the course;
- :mod:`.auth` — the seats' login codes, and the authenticator the hub uses to check them;
- :mod:`.accounts` — as root, a Unix user per seat, owning its folder, that its server runs as;
- :mod:`.spawner` — how the hub starts a seat's JupyterLab (a local process, no containers), as that user, with
  the course's solutions and checks out of its sight;
- :mod:`.grader` — the grading service a seat's ``check()`` asks when the checks are out of its sight;
- :mod:`.slurm_seats` and :mod:`.slurm_spawner` — or each seat's JupyterLab as a SLURM batch job (batchspawner):
  what the jobs ask for, checked first, and what the queue says of each seat;
- :mod:`.hub` — the generated JupyterHub config, and starting and stopping it all;
- :mod:`.processes` — finding every process a workshop started, so that stopping leaves none behind;
- :mod:`.report` and :mod:`.dashboard` — the class at a glance, in a terminal and as a hub service page;
- :mod:`.collect` — grading every seat with the course's grader.

Nothing here is imported by the training runtime; JupyterHub is needed only to start a workshop
(``make workshop-deps`` installs it and its proxy).
"""
