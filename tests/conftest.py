"""Fixtures shared by the tests that start ranks."""

import multiprocessing

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
