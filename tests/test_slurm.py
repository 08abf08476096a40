"""``gpucourse submit`` on a real SLURM: a small cluster on this machine (tests/slurm_cluster.py), started once.

A dp2 job over two nodes, one rank each, equals one device; a node lost mid-run ends the job with one sentence, and
the same command submitted again goes on from the last checkpoint and equals the run that never stopped; what the
cluster cannot run is refused in one sentence, exit status 2, with nothing submitted. The README's sbatch script is
the generated one.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from gpucourse import TrainConfig, run
from gpucourse.course import slurm
from gpucourse.cli import build_parser, config_from, main
from gpucourse.cli.common import layout_flags
from gpucourse.measure import RunResult
from procs import BIN, REPO, free_port, wait_for
from test_checkpoint import assert_continues

pytestmark = pytest.mark.timeout(120)

STEPS = 12
# Tiny runs: the model `tiny` on sequences of 32 tokens.
JOB = ["submit", "--nodes", "2", "--dp", "2", "--steps", str(STEPS), "--seq-len", "32", "--quiet"]


@pytest.fixture
def on_cluster(cluster, monkeypatch, tmp_path):
    """SLURM's commands pointed at the test cluster; jobs submitted from (and writing into) tmp_path."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.chdir(tmp_path)
    return cluster


_ONE_DEVICE: dict = {}


def one_device(tmp_path_factory):
    """The single-device run of the jobs' settings: (RunResult, final weights), trained once per session."""
    if not _ONE_DEVICE:
        path = tmp_path_factory.mktemp("one-device") / "weights.pt"
        result = run(TrainConfig(steps=STEPS, seq_len=32), timeout=120, export_weights=str(path), quiet=True)
        _ONE_DEVICE["run"] = result, torch.load(path)
    return _ONE_DEVICE["run"]


def submitted(capsys, argv: list[str]) -> str:
    """Submit without waiting; the job id (the one line on stdout)."""
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out.strip()


def test_dp2_over_two_nodes_equals_one_device(on_cluster, capsys, tmp_path, tmp_path_factory):
    job = submitted(capsys, [*JOB, "--json", "out.json"])
    full, _ = one_device(tmp_path_factory)  # while the job runs
    assert main(["submit", "--status", job, "--wait"]) == 0
    out, err = capsys.readouterr()
    assert f"job {job}: COMPLETED" in err
    assert out.count("result written to out.json") == 1, "the job's log, with rank 0's summary alone"
    result = json.loads((tmp_path / "out.json").read_text())
    assert (result["world_size"], result["backend"]) == (2, "gloo")
    assert result["losses"] == pytest.approx(full.losses, rel=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"gpucourse-{job}.out", "out.json"]
    assert "Traceback" not in (tmp_path / f"gpucourse-{job}.out").read_text(), "a clean run leaves a clean log"
    assert main(["submit", "--logs", job]) == 0
    assert "result written to out.json" in capsys.readouterr().out


def test_a_lost_node_ends_the_job_and_the_same_command_resumes(on_cluster, capsys, tmp_path, tmp_path_factory):
    command = [*JOB, "--save", "ckpt", "--save-every", "4", "--json", "out.json", "--export-weights", "w.pt"]
    job = submitted(capsys, command)
    wait_for((tmp_path / "ckpt" / "step-000004").is_dir, 90, "the job's first checkpoint")
    # What a machine's failure does to the job: everything it runs on node n2 ends at once.
    victims = on_cluster.job_processes(job, "n2")
    assert victims, "the job runs nothing on n2"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert main(["submit", "--status", job, "--wait"]) != 0
    said = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(rf"gpucourse: job {job} failed: node n2 was lost mid-run .*; submit the same command again "
                        rf"to go on from ckpt/step-0000(04|08)\.", said), said
    full, full_weights = one_device(tmp_path_factory)
    assert main([*command, "--wait"]) == 0, capsys.readouterr().err
    resumed = RunResult.load(str(tmp_path / "out.json"))
    assert resumed.start_step in (4, 8)
    # Two ranks against one device: the equality tests' tolerance (their gradient sums add in another order).
    assert_continues(resumed, torch.load(tmp_path / "w.pt"), full, full_weights, start=resumed.start_step, tol=1e-5)


def test_a_cancelled_job_says_so(on_cluster, capsys):
    job = submitted(capsys, JOB)
    assert main(["submit", "--cancel", job, "--wait"]) != 0
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"gpucourse: job {job} was cancelled (scancel, or gpucourse submit --cancel)."


@pytest.mark.parametrize("flags, sentence", [
    (["--partition", "gpu"], "partition 'gpu' does not exist on this cluster; it has debug."),
    (["--nodes", "3", "--dp", "3", "--batch-size", "6"], "--nodes 3 is more than partition debug has (2 nodes)."),
    (["--gpus-per-node", "1"], "--gpus-per-node 1: partition debug's nodes offer no GPUs"),
    (["--time", "1"], f"--time 00:01:00 is shorter than this run of {STEPS} steps needs: 00:02:"),
    (["--time", "2:00:00"], "--time 02:00:00 is longer than partition debug allows (01:00:00)."),
])
def test_what_the_cluster_cannot_run_is_refused_before_submitting(on_cluster, capsys, flags, sentence):
    name = f"refused-{free_port()}"
    assert main([*JOB, *flags, "--job-name", name]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gpucourse: error: {sentence}"), line
    assert f"JobName={name} " not in on_cluster.run("scontrol", "show", "job", "-o").stdout


def test_without_sbatch_nothing_is_submitted(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(BIN))  # this environment's commands, none of SLURM's
    assert main(JOB) == 2
    assert capsys.readouterr().err == ("gpucourse: error: no SLURM reachable: sbatch is not on PATH (run this on the "
                                       "cluster's login node, where SLURM's commands are).\n")


def test_without_an_answering_controller_nothing_is_submitted(cluster, capsys, monkeypatch, tmp_path):
    # The test cluster's configuration, with its controller at a port nobody listens on.
    conf = re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port()}", cluster.conf.read_text())
    (tmp_path / "slurm.conf").write_text(conf + "MessageTimeout=1\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    monkeypatch.chdir(tmp_path)
    assert main(JOB) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("gpucourse: error: no SLURM reachable: `sinfo -h -o %P` failed:"), line


def test_the_readme_script_is_the_generated_one(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    readme = (REPO / "README.md").read_text()
    flags = "--nodes 2 --gpus-per-node 8 --time 30 --dp 16 --batch-size 64 --json run.json"
    assert f"gpucourse submit {flags}" in readme
    assert main(["submit", *flags.split(), "--dry-run"]) == 0
    script = capsys.readouterr().out.replace(slurm.interpreter_folder(), ".venv/bin")
    blocks = re.findall(r"```bash\n(#!/bin/bash\n.*?)```", readme, re.S)
    assert blocks == [script]


@pytest.mark.parametrize("changes", [
    dict(dp=2, zero=2, steps=5, lr=1e-3),
    dict(tp=2, sequence_parallel=True, record=False, device="cpu"),
    dict(pp=2, schedule="gpipe", microbatches=2, checkpoint_activations="selective"),
    dict(checkpoint_activations=True, save="ckpt", save_every=2, resume="ckpt"),
])
def test_the_scripts_train_flags_describe_the_same_run(changes):
    cfg = TrainConfig(**changes)
    assert config_from(build_parser().parse_args(["train", *layout_flags(cfg, train=True)])) == cfg


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("1:30", 90), ("2:00:00", 7200), ("1-2", 93600),
                                           ("1-2:03:04", 93784), ("UNLIMITED", None)])
def test_time_limits_read_as_slurm_reads_them(text, seconds):
    assert slurm.parse_time(text) == seconds
    if seconds:
        assert slurm.parse_time(slurm.format_time(seconds)) == seconds


def test_slurm_down_from_a_shell_that_exported_slurm_conf_stops_the_cluster_alone(tmp_path):
    """`make slurm-down` from the shell that ran the `export SLURM_CONF=...` slurm-up printed ended every process
    whose environment held it, make and that shell included, and left .slurm-cluster behind."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import slurm_cluster
    from browsers import needed
    from procs import clean_env

    needed(True if slurm_cluster.installed() and shutil.which("make") else None,
           "no SLURM (or make) for the SLURM tests: run scripts/install-slurm")
    pointer = tmp_path / "slurm-cluster"
    env = clean_env(GPUCOURSE_SLURM_POINTER=str(pointer))
    up = subprocess.run([sys.executable, "tests/slurm_cluster.py", "up"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=90)
    assert up.returncode == 0, up.stderr
    conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)
    try:
        shell = subprocess.run(["bash", "-c", f"export SLURM_CONF={conf}; sleep 300 & "
                                              f"make -s slurm-down PY={sys.executable}; echo shell lives: $?; "
                                              f"kill %1 && echo its other job lives too"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
        assert "shell lives: 0" in shell.stdout and "its other job lives too" in shell.stdout, (shell.stdout,
                                                                                                 shell.stderr)
        assert "stopped; no process of it is left" in shell.stdout and not pointer.exists()
    finally:
        if pointer.exists():
            slurm_cluster.Cluster(Path(pointer.read_text().strip()), []).stop()
