"""Fixtures shared by the tests that start ranks."""

import multiprocessing
import os
import pwd
import re
import subprocess
import uuid

import pytest

from procs import processes_with, wait_for


@pytest.fixture(autouse=True)
def real_gpus_only(monkeypatch):
    """A GPU description faked in the shell that runs the tests (GPUCOURSE_FAKE_GPUS) must not change them."""
    monkeypatch.delenv("GPUCOURSE_FAKE_GPUS", raising=False)


@pytest.fixture(autouse=True)
def own_progress_file(tmp_path, monkeypatch):
    """Grades and quiz scores of a test go to a file of its own, never to the learner's ~/.gpucourse."""
    path = tmp_path / "progress.json"
    monkeypatch.setenv("GPUCOURSE_PROGRESS", str(path))
    return path


@pytest.fixture(autouse=True)
def no_seat_users_left(tmp_path_factory):
    """As root, a workshop's prepare() makes a Unix user per seat (gpucourse.workshop.accounts): those a test made
    are removed after it, whether it ended well or not, so that none is left on the machine. Only those whose home
    (the seat's folder) lies in this run's own temporary folders: another run of the suite on the machine at the
    same time keeps its own."""
    if os.geteuid() != 0:
        yield
        return
    before = {entry.pw_name for entry in pwd.getpwall()}
    yield
    ours = str(tmp_path_factory.getbasetemp()) + os.sep
    for entry in pwd.getpwall():
        if entry.pw_name not in before and re.fullmatch(r"gc[0-9a-f]{6}-seat\d+", entry.pw_name) \
                and entry.pw_dir.startswith(ours):
            subprocess.run(["userdel", entry.pw_name], check=True, capture_output=True)


@pytest.fixture
def no_leftover_children():
    """Fail the test if a process it started is still a child of this one afterwards."""
    yield
    # active_children() also reaps the children that have exited.
    wait_for(lambda: not multiprocessing.active_children(), 5, "the test's child processes to end")


@pytest.fixture
def marked(monkeypatch):
    """Tag every process the test starts (through its environment); after it, none may still run."""
    marker = f"GPUCOURSE_GRADING_TEST={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    yield marker
    wait_for(lambda: not processes_with(marker), 10, "the grader's processes to end")


@pytest.fixture
def short_tmp(monkeypatch):
    """A short folder under /tmp for kernels' private socket folders (gpucourse.course.kernel_sockets puts them in
    ``<it>/gpucourse-<uid>/``): pytest's own folders are too deep for a Unix socket's path."""
    import shutil
    import tempfile
    from pathlib import Path

    from gpucourse.course import kernel_sockets

    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="g"))  # short: an ordinary user's uid has more digits than 0
    monkeypatch.setattr(kernel_sockets, "_base", lambda: base)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    """A SLURM cluster on this machine (tests/slurm_cluster.py), started once for every test that needs one."""
    import slurm_cluster
    from browsers import needed

    needed(True if slurm_cluster.installed() else None,
           "no SLURM for the SLURM tests: run scripts/install-slurm (Debian: apt-get install slurm-wlm munge)")
    started = slurm_cluster.start()
    yield started
    started.stop()  # fails if any process of the cluster or its jobs is left


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Torch on one thread in the test process, as in every rank it forks: the tests' models are tiny, their
    matmuls a few rows, and on a busy machine two threads waiting on each other made a tiny model's decode steps
    twenty times slower than one, and 40 training steps of it burn ten times the CPU. (The launcher's test of the
    fork-after-threads trap sets two threads itself.)"""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
