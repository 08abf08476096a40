"""`gpucourse workshop start --spawner slurm`: every seat's JupyterLab a SLURM job, on the test cluster of
tests/slurm_cluster.py (nodes n1 and n2, this machine; its file system is the shared folder).

What the cluster cannot run is refused in one sentence before anything is written or submitted. Then one real
workshop: two seats' jobs run, two learners log in with headless Chromium and run a cell in their seat — inside
that seat's job, in the seat's folder, with the seat's progress file —, the instructor's dashboard and `status`
show each seat's job and node as `squeue` does, `collect` grades both seats, and `stop` leaves no job in the queue
and no process behind. A seat whose job is still queued when `start`'s deadline passes is named with its state,
and nothing of that workshop is left either.

Needs SLURM (scripts/install-slurm), Chromium (scripts/install-chromium) and the hub's proxy (scripts/install-proxy);
in CI (CI=true) a missing one fails the test, elsewhere it is skipped.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import time

import nbformat
import pytest

import browsers
from gpucourse import cli
from gpucourse.course import lab, slurm
from gpucourse.workshop import hub, processes
from gpucourse.workshop.errors import WorkshopError
from procs import BIN, free_port, processes_with, wait_for
from test_workshop import SCRATCH, SOLVED_EX01, _log_in, _scratch_notebook, _scratch_open

# Run in a seat's kernel: where it runs, as SLURM and the workshop set it.
WHERE_AM_I = ("import os\n"
              "print('seat', os.environ['GPUCOURSE_SEAT'], 'job', os.environ['SLURM_JOB_ID'], 'node',\n"
              "      os.environ['SLURMD_NODENAME'], 'gpus', repr(os.environ.get('CUDA_VISIBLE_DEVICES')),\n"
              "      'progress', os.environ['GPUCOURSE_PROGRESS'], 'cwd', os.getcwd())")


@pytest.fixture
def on_cluster(cluster, monkeypatch, tmp_path):
    """SLURM's commands (and so the hub's sbatch, squeue and scancel) pointed at the test cluster."""
    browsers.needed(hub.find_proxy(), "no configurable-http-proxy for the workshop test: run scripts/install-proxy "
                                      "(or make workshop-deps)")
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    return cluster


def _refused(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpucourse: error: ") and err.count("\n") == 0, err
    return err.removeprefix("gpucourse: error: ")


@pytest.mark.timeout(60)
def test_what_the_cluster_cannot_run_is_refused_before_anything_starts(on_cluster, tmp_path, capsys, monkeypatch):
    root = tmp_path / "ws"
    start = ["workshop", "start", "--seats", "2", "--port", str(free_port()), "--dir", str(root)]
    slurm_start = [*start, "--spawner", "slurm"]
    assert _refused(capsys, [*slurm_start, "--partition", "gpu"]) == \
        "partition 'gpu' does not exist on this cluster; it has debug."
    assert _refused(capsys, [*slurm_start, "--gres", "gpu:1"]) == \
        "--gres gpu:1: no node of partition debug offers that (its nodes offer no gres)."
    assert _refused(capsys, [*slurm_start, "--gres", "gpu:"]).startswith("--gres 'gpu:' is not a generic resource")
    assert _refused(capsys, [*slurm_start, "--time", "4h"]) == \
        "--time '4h' is not a time limit: give minutes (30), HH:MM:SS or D-HH:MM:SS."
    assert _refused(capsys, [*slurm_start, "--time", "2:00:00"]) == \
        "--time 02:00:00 is longer than partition debug allows (01:00:00)."
    assert _refused(capsys, [*slurm_start, "--gpus-per-seat", "1"]).startswith(
        "--gpus-per-seat shares this machine's GPUs; a seat that is a SLURM job asks for its own with --gres")
    assert _refused(capsys, [*start, "--partition", "debug"]) == \
        "--partition is for seats that are SLURM jobs; add --spawner slurm."
    with monkeypatch.context() as no_slurm:
        no_slurm.setenv("PATH", str(BIN))  # this environment's commands, none of SLURM's
        assert _refused(capsys, slurm_start) == ("no SLURM reachable: sbatch is not on PATH (run this on the "
                                                 "cluster's login node, where SLURM's commands are).")
    assert not root.exists()
    assert "gpucourse-" not in on_cluster.run("squeue", "-h", "-o", "%j").stdout


def test_gres_is_checked_against_what_the_nodes_offer(monkeypatch):
    """A partition of GPU nodes, as scontrol describes them: typed GPUs and MIG profiles, counted as SLURM does."""
    nodes = [{"NodeName": "g1", "Gres": "gpu:a100:4(S:0-1),gpu:1g.10gb:7"}, {"NodeName": "g2", "Gres": "gpu:h100:2"}]
    monkeypatch.setattr(slurm, "_nodes", lambda name: nodes)
    for fits in ("gpu", "gpu:1", "gpu:8", "gpu:a100:4", "gpu:1g.10gb:7", "gpu:h100:2", "gpu:a100:1,gpu:1g.10gb:1"):
        slurm.check_gres(fits, "gpus")
    for too_much in ("gpu:12", "gpu:a100:5", "gpu:h100:1,gpu:a100:1", "gpu:2g.20gb:1", "nic:1"):
        with pytest.raises(slurm.SlurmError, match=rf"^--gres {too_much}: no node of partition gpus offers that "
                                                   rf"\(they offer gpu:1g.10gb:7, gpu:a100:4, gpu:h100:2\)\.$"):
            slurm.check_gres(too_much, "gpus")
    for malformed in ("gpu:0", "gpu:a100:2:1", ":1", "gpu 1"):
        with pytest.raises(slurm.SlurmError, match="is not a generic resource"):
            slurm.check_gres(malformed, "gpus")


def test_real_accounts_submit_their_jobs_as_themselves(tmp_path):
    """With --users the jobs are submitted through batchspawner's default `sudo -E -u <learner>`; generated seats'
    jobs are the hub account's own."""
    from gpucourse.workshop.folder import Workshop

    request = {"partition": "debug", "gres": "gpu:1", "time": "04:00:00"}
    values = {}
    for login in ("codes", "system"):
        settings = {**Workshop.new_settings("id123", ["alice"], login, None, "teacher"), "slurm": request}
        values[login] = hub.config_values(Workshop(tmp_path), settings, port=1, public=False, proxy="chp", hub_port=2,
                                          proxy_api_port=3, dashboard_port=4, as_root=True, nodes={"n1": "10.0.0.1"})
    assert values["codes"]["SlurmSeatSpawner.exec_prefix"] == ""
    assert values["system"]["SlurmSeatSpawner.exec_prefix"] == "sudo -E -u {username}"
    assert values["system"]["SlurmSeatSpawner.system_users"] is True
    assert {k: values["system"][f"SlurmSeatSpawner.{k}"] for k in ("req_partition", "req_gres", "req_runtime")} == \
        {"req_partition": "debug", "req_gres": "gpu:1", "req_runtime": "04:00:00"}
    assert values["codes"]["JupyterHub.spawner_class"] == "gpucourse.workshop.slurm_spawner.SlurmSeatSpawner"
    assert not any(key.startswith("SeatSpawner.") for key in values["codes"])
    assert "import batchspawner" in hub.render_config(values["codes"], tmp_path / "token")


@pytest.mark.timeout(300)
def test_a_workshop_whose_seats_are_slurm_jobs(on_cluster, tmp_path, capsys):
    chromium = browsers.chromium()
    root, port = tmp_path / "workshop", free_port()
    t0 = time.monotonic()
    assert cli.main(["workshop", "start", "--spawner", "slurm", "--seats", "2", "--time", "30", "--port", str(port),
                     "--dir", str(root)]) == 0
    started_s = time.monotonic() - t0
    printed = capsys.readouterr().out
    assert "each seat is a SLURM job on partition debug: no GPU asked (CPU nodes), time limit 00:30:00" in printed
    codes = dict(re.findall(r"^  (seat0\d)\s+([a-z2-9-]{14})\s+SLURM job, CPU\s", printed, re.M))
    codes["instructor"] = re.search(r"^instructor \(instructor\): (\S+)$", printed, re.M).group(1)
    assert sorted(codes) == ["instructor", "seat01", "seat02"], printed
    workshop_id = json.loads((root / "workshop.json").read_text())["id"]
    names = {f"gpucourse-{workshop_id[:8]}-{seat}": seat for seat in ("seat01", "seat02")}
    # Each seat's server is a job of its own, running, as squeue says.
    queue = on_cluster.run("squeue", "-h", "-o", "%j %i %T %N").stdout.split("\n")
    jobs = {names[name]: (job, node) for name, job, state, node in (line.split() for line in queue if line)
            if state == "RUNNING" and name in names}
    assert sorted(jobs) == ["seat01", "seat02"], queue
    base, seats = f"http://127.0.0.1:{port}", root / "seats"
    for seat in ("seat01", "seat02"):
        _scratch_notebook(seats / seat)
        notebook = seats / seat / "notebooks" / SCRATCH
        nb = nbformat.read(notebook, as_version=4)
        nb.cells = [nbformat.v4.new_code_cell(WHERE_AM_I)]
        nbformat.write(nb, notebook)
    shutil.copyfile(SOLVED_EX01, seats / "seat01" / "exercises" / SOLVED_EX01.name)  # seat01 solved ex01
    try:
        with lab.Browser(chromium) as browser:
            logged_in = {seat: _log_in(browser, base, seat, codes[seat], f"/user/{seat}/lab/tree/notebooks/{SCRATCH}")
                         for seat in ("seat01", "seat02")}
            for seat, page in logged_in.items():
                _, text = _scratch_open(page).run_cell("SLURM_JOB_ID", timeout=120)
                job, node = jobs[seat]
                folder = seats / seat
                assert f"seat {seat} job {job} node {node} gpus None" in text, text
                assert f"progress {folder}/.gpucourse/progress.json cwd {folder}/notebooks" in text, text
            # The instructor sees each seat's job where it runs, beside what the dashboard showed before.
            instructor = _log_in(browser, base, "instructor", codes["instructor"])
            instructor.wait_for_url("**/services/dashboard/**")
            for seat, (job, node) in jobs.items():
                row = instructor.locator(f"#seat-{seat}")
                assert row.locator("td.job").inner_text() == f"running on {node} (job {job})"
                assert "SLURM job, CPU" in row.inner_text() and "0/" in row.inner_text()
        assert cli.main(["workshop", "status", "--dir", str(root)]) == 0
        status = capsys.readouterr().out
        job, node = jobs["seat02"]
        assert re.search(rf"^seat02\s+SLURM job, CPU\s+running on {node} \(job {job}\)\s+running\s+ok\s", status,
                         re.M), status
        # Graded as on one server: the seats' folders are all the grader needs.
        grades = tmp_path / "grades.csv"
        assert cli.main(["workshop", "collect", "ex01", "--out", str(grades), "--jobs", "2", "--dir", str(root)]) == 0
        rows = list(csv.DictReader(grades.open()))
        assert [(r["learner"], r["ex01"]) for r in rows] == [("seat01", "10"), ("seat02", "0")], rows
        marked = processes.marked(workshop_id)
        assert len(marked) >= 7, marked  # hub, proxy, dashboard; each job's script and server, 2 kernels
    finally:
        assert cli.main(["workshop", "stop", "--dir", str(root)]) == 0
    assert not set(names) & set(on_cluster.run("squeue", "-h", "-o", "%j").stdout.split())
    assert processes.marked(workshop_id) == []
    assert not [pid for job, _ in jobs.values() for pid in processes_with(f"SLURM_JOB_ID={job}")]
    assert (seats / "seat01" / "exercises" / SOLVED_EX01.name).read_bytes() == SOLVED_EX01.read_bytes()
    assert os.path.getsize(root / "hub" / "logs" / "seat01.log")  # the job's own log, on the shared folder
    print(f"SLURM workshop: started in {started_s:.1f} s, whole test {time.monotonic() - t0:.1f} s")


@pytest.mark.timeout(120)
def test_a_seat_still_queued_at_the_deadline_is_named_and_nothing_is_left(on_cluster, tmp_path):
    """Every node busy with another job: the seat's job waits in the queue; `start` gives up at its deadline naming
    the job's state, and stops everything it started, the queued job included."""
    busy = on_cluster.run("sbatch", "--parsable", "--exclusive", "--nodes", "2", "--job-name", "busy",
                          "--output", "/dev/null", "--wrap", "sleep 300").stdout.strip()
    root = tmp_path / "ws"
    try:
        with pytest.raises(WorkshopError, match=r"^gave up waiting for seat01's server: the deadline passed \(its "
                                                r"SLURM job: pending(: \w+)? \(job \d+\)\); see "):
            hub.start(root, seats=1, spawner="slurm", port=free_port(), timeout=15)
        workshop_id = json.loads((root / "workshop.json").read_text())["id"]
        assert f"gpucourse-{workshop_id[:8]}" not in on_cluster.run("squeue", "-h", "-o", "%j").stdout
        assert processes.marked(workshop_id) == []
    finally:
        on_cluster.run("scancel", busy)
        wait_for(lambda: busy not in on_cluster.run("squeue", "-h", "-o", "%i").stdout.split(), 30,
                 "the busy job to leave the queue")
