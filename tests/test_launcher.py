"""launch(): values in rank order, one clear error per failure, a bounded hang,
no process left behind, and the ranks' output and messages reaching the caller
(a test process, a second launcher at the same time, a notebook kernel)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import nbformat
import pytest
import torch

import rankfns
from gpucourse import LaunchError, LaunchTimeout, WorkerError, launch
from gpucourse.runtime import launcher
from gpucourse.runtime.launcher import cpu_rank_limit
from procs import clean_env, read_identities, wait_for, wait_gone

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_children")]


# --- values and collectives -------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_values_come_back_in_rank_order(world_size):
    values = launch(rankfns.whoami, world_size=world_size, timeout=60, quiet=True)
    assert [v[:2] for v in values] == [(rank, world_size) for rank in range(world_size)]
    pids = {v[2][0] for v in values}
    assert len(pids) == world_size and os.getpid() not in pids
    assert wait_gone([v[2] for v in values]) == [], "ranks still run after a successful launch"
    assert not torch.cuda.is_initialized(), "the launching process initialised CUDA"


def test_large_all_reduce_after_threaded_torch_work_in_the_parent():
    # The fork-after-threads trap: a parent that already ran multi-threaded torch
    # work used to leave forked ranks hanging in their first large collective.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        a = torch.randn(512, 512, requires_grad=True)
        (a @ a).tanh().sum().backward()
        assert a.grad is not None
        values = launch(rankfns.all_reduce_ones, 4_000_000, world_size=2, timeout=60, quiet=True)
    finally:
        torch.set_num_threads(threads)
    assert values == [(3.0, 3.0), (3.0, 3.0)]


def test_back_to_back_launches():
    for _ in range(4):
        values = launch(rankfns.whoami, world_size=2, timeout=60, quiet=True)
        assert [v[:2] for v in values] == [(0, 2), (1, 2)]


def _corpus_built_before_entry() -> int:
    from gpucourse import data

    return data.corpus.cache_info().currsize


def test_forked_ranks_inherit_what_the_launching_process_built():
    """A re-run's ranks start with the course's corpus already built (the launcher builds it once, before forking,
    where the launching process uses the course's data), instead of each rank building it every launch."""
    from gpucourse import data

    data.corpus.cache_clear()
    assert launch(_corpus_built_before_entry, world_size=2, timeout=60, quiet=True) == [1, 1]


def test_spawn_starts_an_importable_function():
    values = launch(rankfns.whoami, world_size=2, timeout=90, start_method="spawn", quiet=True)
    assert [v[:2] for v in values] == [(0, 2), (1, 2)]


@pytest.mark.timeout(180)
def test_two_launchers_at_once_do_not_collide(tmp_path):
    # Two pytest-like processes, each launching 2 ranks several times, started together.
    procs = [subprocess.Popen([sys.executable, "-m", "rankfns", "repeat", str(tmp_path)], env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
        assert "launches ok" in out


# --- failures -----------------------------------------------------------------------------------------------------

def test_a_rank_that_raises_fails_the_launch_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        # The others wait in a barrier; a 10-minute process-group timeout must not matter.
        launch(rankfns.fail_on, 1, str(tmp_path), world_size=3, timeout=60, pg_timeout=600, quiet=True)
    elapsed = time.monotonic() - start
    error = info.value
    assert (error.rank, error.exc_type, error.message) == (1, "ValueError", "rank 1 was told to fail")
    assert 'raise ValueError(f"rank {bad} was told to fail")' in error.remote_traceback
    assert "rankfns.py" in error.remote_traceback
    assert str(error).startswith("rank 1 failed: ValueError: rank 1 was told to fail")
    # Far below the 60 s timeout and the 600 s group timeout; a start that stalls is started again once
    # (launcher._startup_s), which the bound allows.
    bound = 15 + launcher._startup_s("fork", 3)
    assert elapsed < bound, f"the failure took {elapsed:.1f} s to reach the caller"
    identities = read_identities(tmp_path)
    assert sorted(identities) == [0, 1, 2]
    assert wait_gone(identities.values()) == [], "ranks still run after a failed launch"


@pytest.mark.parametrize("fn, bad, code, exc_type, message", [
    (rankfns.exit_on, 1, 3, "SystemExit", "3"),
    # No exception at all, and the other ranks then fail in their barrier with
    # "connection closed" errors of their own: rank 2 must still be the one named.
    (rankfns.os_exit_on, 2, 7, "ProcessExit", "without raising an exception"),
])
def test_a_rank_that_exits_fails_the_launch(tmp_path, fn, bad, code, exc_type, message):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(fn, bad, code, str(tmp_path), world_size=3, timeout=60, pg_timeout=600, quiet=True)
    elapsed = time.monotonic() - start
    error = info.value
    assert (error.rank, error.exc_type) == (bad, exc_type), str(error)
    assert message in error.message
    assert str(error).startswith(f"rank {bad} failed")
    assert elapsed < 15
    identities = read_identities(tmp_path)
    assert sorted(identities) == [0, 1, 2]
    assert wait_gone(identities.values()) == []


@pytest.mark.timeout(240)
def test_the_rank_that_died_first_is_named_on_every_run(tmp_path):
    # Rank 2's os._exit leaves no note, and ranks 0 and 1 then end too (their collective fails, or the agent stops
    # them), in whatever order the agent happens to see: rank 2 must be the one named, on every run.
    for run in range(20):
        folder = tmp_path / str(run)
        folder.mkdir()
        with pytest.raises(WorkerError) as info:
            launch(rankfns.os_exit_on, 2, 7, str(folder), world_size=3, timeout=60, pg_timeout=600, quiet=True)
        assert (info.value.rank, info.value.exc_type) == (2, "ProcessExit"), f"run {run}: {info.value}"


def test_a_rank_stopped_by_the_agent_is_not_named(tmp_path):
    # The rare order of the test above, every time: rank 1's error finds rank 0, stopped by the agent once it saw
    # rank 2 end, gone without a note as well as rank 2.
    with pytest.raises(WorkerError) as info:
        launch(rankfns.os_exit_then_late_error, str(tmp_path), world_size=3, timeout=60, pg_timeout=600, quiet=True)
    assert (info.value.rank, info.value.exc_type) == (2, "ProcessExit"), str(info.value)
    assert wait_gone(read_identities(tmp_path).values()) == []


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_rank_that_exits_with_status_0_and_no_result_is_named_long_before_the_timeout(tmp_path, world_size):
    # To torch's agent such a rank is neither finished nor failed: it waited for its result for ever, past any
    # timeout (the other rank, done, waits for it at the end of the call).
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(rankfns.exit_zero_on, world_size - 1, str(tmp_path), world_size=world_size, timeout=60, quiet=True)
    assert time.monotonic() - start < 15
    assert (info.value.rank, info.value.exc_type) == (world_size - 1, "ProcessExit"), str(info.value)
    assert "without returning and without an error (os._exit(0)?)" in str(info.value)
    assert wait_gone(read_identities(tmp_path).values()) == [], "a rank outlived the launch"


def test_a_hang_ends_in_launch_timeout_naming_the_pending_ranks(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(rankfns.skip_barrier, 1, str(tmp_path), world_size=3, timeout=4, quiet=True)
    elapsed = time.monotonic() - start
    error = info.value
    assert 4 <= elapsed < 20
    assert (error.pending, error.finished) == ([0, 2], [1])
    assert "ranks 0, 2 did not finish within 4 s" in str(error)
    identities = read_identities(tmp_path)
    assert sorted(identities) == [0, 1, 2]
    assert wait_gone(identities.values()) == [], "ranks still run after a timeout"


def test_a_timeout_that_passes_while_ranks_start_still_stops_them(tmp_path):
    # 0.05 s is over before the agent has started the ranks; they must not run on.
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(rankfns.block, str(tmp_path), world_size=2, timeout=0.05, quiet=True)
    assert time.monotonic() - start < 10
    assert (info.value.pending, info.value.finished) == ([0, 1], [])
    assert wait_gone(read_identities(tmp_path).values()) == []


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_rank(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rankfns", "block", str(tmp_path)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(read_identities(tmp_path)) == 2 or proc.poll() is not None, 60, "both ranks to start")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        identities = read_identities(tmp_path)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt reached the caller" in err, err[-3000:]
    assert proc.returncode == 130
    assert elapsed < 15
    assert wait_gone(identities.values()) == [], "ranks outlived a Ctrl-C"


# --- what reaches the caller --------------------------------------------------------------------------------------

def test_rank_output_reaches_the_caller_prefixed(capfd):
    assert launch(rankfns.chatter, world_size=2, timeout=60, quiet=True) == [0, 1]
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] out line of rank {rank}\n" in out
        assert f"[rank {rank}] err line of rank {rank}\n" in err
    assert "err line" not in out and "out line" not in err
    # The agent's tee, as it builds it, looks for the ranks' new lines (and their end) every 20 ms, not torch's
    # 100 ms, which every launch used to wait out before returning.
    from torch.distributed.elastic.multiprocessing import api

    tail = api.TailLog("trainer", {0: os.devnull}, sys.stdout, {0: "[rank 0] "})
    assert tail._interval_sec == launcher.TAIL_INTERVAL_S == 0.02


def test_report_reaches_on_message():
    got = []
    launch(rankfns.chatter, world_size=2, timeout=60, on_message=got.append, quiet=True)
    assert sorted(got, key=lambda m: m["rank"]) == [{"rank": 0, "hello": 0, "payload": [0, 0, 0]},
                                                     {"rank": 1, "hello": 1, "payload": [1, 1, 1]}]


def test_device_line_says_where_ranks_run(capfd, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    launch(rankfns.whoami, world_size=2, timeout=60)
    out = capfd.readouterr().out
    assert "gpucourse: 2 ranks on cpu (gloo): no GPU is visible" in out


# --- refused before any process starts ----------------------------------------------------------------------------

def refused(capsys, **kwargs) -> str:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(rankfns.whoami, timeout=60, **kwargs)
    assert time.monotonic() - start < 2
    assert "ranks on" not in capsys.readouterr().out, "the launch went as far as announcing its ranks"
    return str(info.value)


def test_cuda_without_gpus_is_refused_with_the_auto_fallback(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    message = refused(capsys, world_size=2, device="cuda")
    assert "device='cuda' needs 2 GPUs" in message
    assert "device='auto'" in message and "fall back" in message


def test_cuda_with_more_ranks_than_gpus_is_refused_in_one_sentence(capsys, monkeypatch):
    monkeypatch.setenv("GPUCOURSE_FAKE_GPUS", "colab-t4")  # one T4, described (gpucourse.runtime.devices)
    assert refused(capsys, world_size=2, device="cuda") == (
        "device='cuda' needs 2 GPUs for 2 ranks but only 1 GPU is visible, Tesla T4 (cc 7.5, 15.0 GiB, no native "
        "bf16 or fp8); use device='auto' to fall back to gloo on CPU processes.")


def test_unknown_device_is_refused(capsys):
    assert "'bogus'" in refused(capsys, world_size=2, device="bogus")


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, "2"])
def test_bad_world_size_is_refused(capsys, world_size):
    assert "world_size" in refused(capsys, world_size=world_size)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_more_cpu_ranks_than_the_machine_holds_are_refused(capsys, monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    too_many = cpu_rank_limit() + 1
    message = refused(capsys, world_size=too_many, device=device)
    assert f"{too_many} ranks are more than this machine can run as CPU processes" in message
    assert f"at most {cpu_rank_limit()}" in message


def test_launching_never_initialises_cuda(monkeypatch):
    # This CPU build never reaches the CUDA driver, so pretend to be a CUDA build on
    # a box without GPUs, and forbid (in this process only: ranks are forked with
    # these patches) every call that starts CUDA or its driver and so poisons fork.
    parent = os.getpid()

    def forbidden(name, real=None):
        def call(*args, **kwargs):
            if os.getpid() == parent:
                raise AssertionError(f"the launching process called {name}, which starts CUDA")
            return real(*args, **kwargs) if real else 0
        return call

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: os.getpid() == parent)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # what NVML answers there
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", forbidden("torch._C._cuda_getDeviceCount"), raising=False)
    for name in ("init", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, forbidden(f"torch.cuda.{name}", getattr(torch.cuda, name)))
    assert len(launch(rankfns.whoami, world_size=2, timeout=60, quiet=True)) == 2
    assert not torch.cuda.is_initialized()


# --- a notebook kernel --------------------------------------------------------------------------------------------

NOTEBOOK_CELLS = [
    """\
import json, sys, time
import torch
a = torch.randn(256, 256, requires_grad=True)
(a @ a).sum().backward()
print("EXE", sys.executable)""",
    """\
import torch.distributed as dist

def in_a_cell(n):
    t = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    print(f"hello from rank {dist.get_rank()}")
    return dist.get_rank(), float(t.max())""",
    """\
from gpucourse import launch
values = launch(in_a_cell, 1_000_000, world_size=2, timeout=60)
assert values == [(0, 3.0), (1, 3.0)], values""",
    """\
import gpucourse
from gpucourse import TrainConfig
result = gpucourse.run(TrainConfig(dp=2, steps=5), timeout=120)
assert type(result).__name__ == "RunResult" and len(result.losses) == 5, result
print("LOSSES", json.dumps(result.losses))""",
    """\
from gpucourse import LaunchError
start = time.monotonic()
try:
    launch(in_a_cell, 10, world_size=2, timeout=60, start_method="spawn")
except LaunchError as e:
    refusal = str(e)
else:
    raise AssertionError("spawn started a function defined in a cell")
assert time.monotonic() - start < 2
print("REFUSAL", refusal)""",
]


def cell_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.timeout(240)
def test_launch_from_a_notebook_cell(tmp_path):
    from gpucourse.course import lab

    # A kernel spec of our own makes the kernel this venv's python, whatever python3 means elsewhere.
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (gpucourse venv)", "language": "python"}))
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_CELLS]
    lab.execute(nb, tmp_path / "cells.ipynb", spec.parent, name="python3", cell_timeout=180, smoke=False)

    setup, _, launched, trained, spawn = nb.cells
    assert f"EXE {sys.executable}" in cell_text(setup)
    assert "[rank 0] hello from rank 0" in cell_text(launched)
    assert "[rank 1] hello from rank 1" in cell_text(launched)
    losses = json.loads(cell_text(trained).split("LOSSES ", 1)[1].splitlines()[0])
    assert len(losses) == 5 and all(isinstance(x, float) for x in losses)
    text = cell_text(spawn)
    refusal = text.split("REFUSAL ", 1)[1]
    assert "in_a_cell" in refusal and "import it" in refusal and ".py file" in refusal
    assert "[rank" not in text and "Traceback" not in text, "the refusal started ranks"


def test_no_rank_joins_its_group_before_every_rank_is_forked(tmp_path, monkeypatch):
    # A rank forked while another thread of the launching process held a lock waits on it
    # forever: the agent's store naming an earlier rank's connection (getnameinfo) held
    # glibc's resolver lock, about once in 40 launches of four ranks. So nothing may connect
    # while ranks are forked. Forks are slowed down here; every join must come after the last.
    import multiprocessing.popen_fork as popen_fork

    forks, joins = tmp_path / "forks", tmp_path / "joins"
    real_launch, real_init = popen_fork.Popen._launch, torch.distributed.init_process_group

    def slow_fork(self, process_obj):
        real_launch(self, process_obj)  # a forked child never returns from it
        with open(forks, "a") as f:
            f.write(f"{time.time()}\n")
        time.sleep(0.3)

    def init(*args, **kwargs):  # the forked ranks inherit this
        with open(joins, "a") as f:
            f.write(f"{time.time()}\n")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(popen_fork.Popen, "_launch", slow_fork)
    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    assert [v[:2] for v in launch(rankfns.whoami, world_size=3, timeout=60, quiet=True)] == [(0, 3), (1, 3), (2, 3)]
    fork_times = [float(t) for t in forks.read_text().split()]
    join_times = [float(t) for t in joins.read_text().split()]
    assert len(fork_times) == len(join_times) == 3
    assert min(join_times) > max(fork_times), "a rank joined its group while others were still being forked"


def test_ranks_that_never_finish_starting_are_started_again(tmp_path, monkeypatch, capsys):
    # Simulate the rare stall of a rank in its first connection: on the first
    # attempt rank 1 never reports that it joined its group.
    from gpucourse.runtime import launcher as launcher_module
    from gpucourse.runtime import worker as worker_module

    marker = tmp_path / "stalled-once"
    real_note = worker_module._note

    def note(run_dir, name, payload):
        if name == "ready-1.json" and not marker.exists():
            marker.write_text("x")
            time.sleep(600)  # stuck, as a stalled rank is; the launcher kills it
        real_note(run_dir, name, payload)

    monkeypatch.setattr(worker_module, "_note", note)
    monkeypatch.setattr(launcher_module, "_startup_s", lambda method, world_size: 3.0)
    start = time.monotonic()
    assert [r[0] for r in launch(rankfns.whoami, world_size=2, timeout=60, quiet=True)] == [0, 1]
    assert time.monotonic() - start < 30
    assert "starting them again" in capsys.readouterr().out
