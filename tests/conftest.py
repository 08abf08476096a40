"""Fixtures shared by the tests that start ranks."""

import multiprocessing
import os
import uuid

import pytest

from procs import wait_for


@pytest.fixture(autouse=True)
def own_progress_file(tmp_path, monkeypatch):
    """Grades and quiz scores of a test go to a file of its own, never to the learner's ~/.gpucourse."""
    path = tmp_path / "progress.json"
    monkeypatch.setenv("GPUCOURSE_PROGRESS", str(path))
    return path


@pytest.fixture
def no_leftover_children():
    """Fail the test if a process it started is still a child of this one afterwards."""
    yield
    # active_children() also reaps the children that have exited.
    wait_for(lambda: not multiprocessing.active_children(), 5, "the test's child processes to end")


def _processes_with(marker: str) -> list[int]:
    """Pids of processes (other than this one) whose environment holds ``marker``."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture
def marked(monkeypatch):
    """Tag every process the test starts (through its environment); after it, none may still run."""
    marker = f"GPUCOURSE_GRADING_TEST={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    yield marker
    wait_for(lambda: not _processes_with(marker), 10, "the grader's processes to end")


@pytest.fixture
def short_tmp(monkeypatch):
    """A short folder under /tmp for kernels' private socket folders (gpucourse.kernel_sockets puts them in
    ``<it>/gpucourse-<uid>/``): pytest's own folders are too deep for a Unix socket's path."""
    import shutil
    import tempfile
    from pathlib import Path

    from gpucourse import kernel_sockets

    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="gc-"))
    monkeypatch.setattr(kernel_sockets, "_base", lambda: base)
    yield base
    shutil.rmtree(base, ignore_errors=True)
