"""Under torchrun the same code runs in place: one node, two nodes on loopback,
and ``launch`` itself, all giving what ``gpucourse.run`` gives on its own."""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from gpucourse import TrainConfig, run
from procs import BIN, clean_env, free_port, identity

pytestmark = pytest.mark.timeout(180)

TRAIN = ["-m", "gpucourse", "train", "--dp", "2", "--steps", "10", "--quiet"]


@functools.cache
def launched_losses() -> list[float]:
    """The oracle: the same run started by ``launch`` from this process."""
    return run(TrainConfig(dp=2, steps=10), timeout=120, quiet=True).losses


def torchrun(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "torchrun"), *args], cwd=cwd, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], within: float = 120) -> list[tuple[str, str]]:
    """Wait for every process; stop them all (torchrun passes SIGTERM on to its ranks) on a timeout or failure."""
    deadline = time.monotonic() + within
    try:
        return [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def test_torchrun_one_node_matches_launch(tmp_path):
    out = tmp_path / "out.json"
    proc = torchrun("--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                    *TRAIN, "--json", str(out), cwd=tmp_path)
    expected = launched_losses()  # while torchrun starts
    [(stdout, stderr)] = finish([proc])
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("result written to") == 1, "only rank 0 writes and reports the result"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"], "a temporary file was left behind"
    result = json.loads(out.read_text())
    assert (result["world_size"], result["backend"]) == (2, "gloo")
    assert result["losses"] == pytest.approx(expected, rel=1e-5)


def test_two_nodes_on_loopback_match_launch(tmp_path):
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    outs = [tmp_path / f"node{node}.json" for node in (0, 1)]
    procs = [torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *TRAIN, "--json", str(outs[node]),
                      cwd=tmp_path) for node in (0, 1)]
    expected = launched_losses()
    results = finish(procs)
    for node, (p, (_, stderr)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"node {node}: {stderr[-3000:]}"
    # Whichever node holds global rank 0 writes its file; the other writes nothing.
    written = [o for o in outs if o.exists()]
    assert len(written) == 1
    result = json.loads(written[0].read_text())
    assert result["world_size"] == 2
    assert result["losses"] == pytest.approx(expected, rel=1e-5)


def test_torchrun_with_the_wrong_world_size_is_refused(tmp_path):
    proc = torchrun("--nproc-per-node", "2", "--standalone", "-m", "gpucourse", "train", "--dp", "4",
                    "--json", "out.json", cwd=tmp_path)
    [(stdout, stderr)] = finish([proc])
    # Each rank refuses with the same sentence and exit status 2; torchrun itself exits 1.
    errors = {line for line in stderr.splitlines() if line.startswith("gpucourse: error:")}
    assert len(errors) == 1, stderr[-3000:]
    assert "torchrun started 2 ranks" in errors.pop()
    assert re.search(r"exitcode\s*:\s*2\b", stderr), stderr[-3000:]
    assert proc.returncode != 0
    assert "[rank" not in stdout and not (tmp_path / "out.json").exists()


def test_a_world_size_mismatch_in_place_exits_2_with_one_line(tmp_path):
    # What each rank above does, without torchrun: exactly one line, status 2.
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-m", "gpucourse", "train", "--dp", "4"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith("gpucourse: error: torchrun started 2 ranks") and "4" in line


def test_launch_runs_in_place_under_torchrun(tmp_path):
    proc = torchrun("--nproc-per-node", "2", "--standalone", "-m", "rankfns", "in-place", str(tmp_path), cwd=tmp_path)
    [(_, stderr)] = finish([proc])
    assert proc.returncode == 0, stderr[-3000:]
    reports = [json.loads((tmp_path / f"in-place-{rank}.json").read_text()) for rank in (0, 1)]
    # Every rank got every rank's value, and each value came from the torchrun rank itself: no second launch.
    own = [r["identity"] for r in reports]
    for r in reports:
        assert r["values"] == [[0, 2, own[0]], [1, 2, own[1]]]
        assert r["children"] == 0
    assert own[0] != own[1] and identity() not in own
