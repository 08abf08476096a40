"""`gpucourse workshop`: seats and their GPUs planned on paper, the hub's config generated, bad input refused before
anything starts — and one real workshop: a JupyterHub with 3 CPU seats on this machine, its printed address leading
to the login page and a learner from there into notebook 00, two learners logged in with headless Chromium, each
running a cell in their own seat and unable to open the other's, the instructor's dashboard showing a check passed,
the class collected into a CSV, and nothing left running after `stop`.

The end-to-end test needs Chromium (scripts/install-chromium) and the hub's proxy (scripts/install-proxy, run by
`make test` and `make workshop-deps`); in CI (CI=true) a missing one fails the test, elsewhere it is skipped.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlencode, urlparse

import nbformat
import pytest

import browsers
from gpucourse import cli, grading
from gpucourse.course import lab, progress
from gpucourse.workshop import auth, dashboard, hub, kernels, plan, processes, report, spawner
from gpucourse.workshop.errors import WorkshopError
from gpucourse.workshop.folder import Workshop
from procs import KERNEL_TRANSPORT, free_port

REPO = Path(__file__).resolve().parents[1]
SOLVED_EX01 = next((REPO / "solutions").glob("ex01_*.py"))


# --- the GPU partition, on paper --------------------------------------------------------------------------------

def gpus(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def test_eight_gpus_four_seats_get_two_each():
    shared = plan.partition(gpus(8), 4)
    assert shared.per_seat == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert shared.idle == ()


def test_eight_gpus_three_seats_get_two_each_and_two_are_left_idle_and_said_so():
    shared = plan.partition(gpus(8), 3)
    assert shared.per_seat == [("0", "1"), ("2", "3"), ("4", "5")]
    assert shared.idle == ("6", "7")
    assert "GPUs 6,7 left idle" in shared.note


def test_two_gpus_four_seats_are_refused_with_a_way_out():
    with pytest.raises(WorkshopError, match=r"4 seats need at least 4 GPUs.*2 are visible.*--gpus-per-seat 0"):
        plan.partition(gpus(2), 4)
    with pytest.raises(WorkshopError, match="need 4 GPUs"):
        plan.partition(gpus(2), 4, gpus_per_seat=1)


def test_cpu_seats_without_gpus_or_when_asked():
    assert plan.partition([], 3).per_seat == [(), (), ()]
    shared = plan.partition(gpus(2), 3, gpus_per_seat=0)
    assert shared.per_seat == [(), (), ()] and shared.idle == ("0", "1")
    with pytest.raises(WorkshopError, match="--seats 0 must be at least 1"):
        plan.partition(gpus(8), 0)


def test_each_seat_runs_with_its_own_gpus_progress_file_and_threads(tmp_path):
    folders = {name: tmp_path / name for name in plan.seat_names(4)}
    seats = plan.make_plan(folders, gpus(8), cores=16)
    envs = [plan.seat_environment(s, processes.marker_env("abc")) for s in seats.seats]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3", "4,5", "6,7"]
    assert [e["GPUCOURSE_PROGRESS"] for e in envs] == [str(tmp_path / n / ".gpucourse" / "progress.json")
                                                       for n in folders]
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"4"} and "4 CPU threads per seat" in seats.notes[1]
    assert all(e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and e[processes.MARKER] == "abc" for e in envs)
    cpu = plan.make_plan({"seat01": tmp_path / "a", "seat02": tmp_path / "b"}, [], cores=2)
    assert [plan.seat_environment(s)["CUDA_VISIBLE_DEVICES"] for s in cpu.seats] == ["", ""]
    assert cpu.seats[0].describe() == "CPU, 1 thread"


# --- codes, config -------------------------------------------------------------------------------------------

def test_a_code_logs_in_to_its_own_seat_only(tmp_path):
    code = auth.new_code()
    assert re.fullmatch(r"[a-z2-9]{4}-[a-z2-9]{4}-[a-z2-9]{4}", code)
    stored = auth.hash_code(code)
    assert code not in stored and auth.code_matches(f"  {code.upper()} ", stored)
    assert not auth.code_matches(auth.new_code(), stored)
    codes = tmp_path / "codes.json"
    codes.write_text(json.dumps({"seat01": stored}))
    checker = auth.SeatAuthenticator(codes_file=str(codes))

    def ask(name, password):
        return asyncio.run(checker.authenticate(None, {"username": name, "password": password}))

    assert ask("seat01", code) == "seat01"
    assert ask("seat02", code) is None and ask("seat01", "nope") is None


def _settings(login: str, seats: list[str], admin: str) -> dict:
    return Workshop.new_settings("id123", seats, login, None, admin)


PORT = free_port()  # only written into the generated config: nothing listens on it


def _config(ws: Workshop, settings: dict, public: bool = False) -> dict:
    return hub.config_values(ws, settings, port=PORT, public=public, proxy="/x/configurable-http-proxy", hub_port=1,
                             proxy_api_port=2, dashboard_port=3, as_root=True)


def test_the_generated_config_for_generated_seats(tmp_path):
    ws = Workshop(tmp_path)
    values = _config(ws, _settings("codes", ["seat01", "seat02"], plan.INSTRUCTOR))
    assert values["JupyterHub.bind_url"] == f"http://127.0.0.1:{PORT}"
    assert values["JupyterHub.authenticator_class"] == "gpucourse.workshop.auth.SeatAuthenticator"
    assert values["Authenticator.allowed_users"] == {"seat01", "seat02"}
    assert values["Authenticator.admin_users"] == {"instructor"}
    assert values["JupyterHub.spawner_class"] == "gpucourse.workshop.spawner.SeatSpawner"
    assert values["SeatSpawner.system_users"] is False
    assert values["Spawner.args"] == ["--allow-root", "--KernelManager.transport=ipc"]
    dashboard_service = values["JupyterHub.services"][0]
    assert dashboard_service["name"] == "dashboard" and dashboard_service["environment"] == {processes.MARKER: "id123"}
    assert _config(ws, _settings("codes", ["seat01"], "instructor"), public=True)["JupyterHub.bind_url"] == \
        f"http://0.0.0.0:{PORT}"
    # The file JupyterHub reads is Python that sets exactly these values.
    token = tmp_path / "api_token"
    token.write_text("secret-token\n")
    config = _ConfigSpy()
    exec(hub.render_config(values, token), {"get_config": lambda: config})
    assert config.values["Authenticator.allowed_users"] == {"seat01", "seat02"}
    assert config.values["JupyterHub.services"][1] == {"name": "gpucourse", "api_token": "secret-token"}
    assert config.values["JupyterHub.default_url"].__name__ == "landing_page"


def test_the_generated_config_for_real_accounts_uses_pam(tmp_path, monkeypatch):
    ws = Workshop(tmp_path)
    values = _config(ws, _settings("system", ["alice", "bob"], "teacher"))
    assert values["JupyterHub.authenticator_class"] == "pam"
    assert values["SeatSpawner.system_users"] is True and values["Spawner.args"] == ["--KernelManager.transport=ipc"]
    assert values["Authenticator.allowed_users"] == {"alice", "bob"}
    assert values["Authenticator.admin_users"] == {"teacher"}
    assert "SeatAuthenticator.codes_file" not in values
    # Their course copies go to their homes; each account must exist, and only root may start servers as them.
    import pwd

    homes = {"alice": "/home/alice", "bob": "/home/bob", "teacher": "/home/teacher"}
    monkeypatch.setattr(pwd, "getpwnam", lambda name: type("Account", (), {"pw_dir": homes[name]}))
    settings = _settings("system", ["alice", "bob"], "teacher")
    assert ws.seat_folders(settings) == {"alice": Path("/home/alice/gpucourse-workshop"),
                                         "bob": Path("/home/bob/gpucourse-workshop")}
    monkeypatch.setattr(hub.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))  # checked first: the test needs none installed
    with pytest.raises(WorkshopError, match="needs root"):
        hub.start(tmp_path / "ws", users=["alice", "bob"], gpus=[], port=free_port())
    assert not (tmp_path / "ws").exists()


def test_starting_again_resumes_the_same_seats_work_and_codes(tmp_path, monkeypatch):
    """The folder half of start (hub.prepare), twice: nothing of a seat is lost, and the codes stay."""
    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))  # prepare only checks that the proxy is there
    root = tmp_path / "ws"
    port = free_port()
    first = hub.prepare(root, seats=2, gpus=[], port=port, public=True)
    assert sorted(first["codes"]) == ["instructor", "seat01", "seat02"] and not first["resumed"]
    assert first["before"] is None
    assert _started(first).startswith(f"workshop started in 9 s: {hub.address(port, True)}\n")
    codes_file = root / "secrets" / "codes.json"
    assert codes_file.stat().st_mode & 0o777 == 0o600 and codes_file.parent.stat().st_mode & 0o777 == 0o700
    hashes = codes_file.read_text()
    assert not any(code in hashes for code in first["codes"].values())
    work = root / "seats" / "seat01" / "exercises" / "ex01_ring_allreduce.py"
    work.write_text("# my ring\n")
    # Started again as 'start' with no --port or --public (the CLI's defaults): the same address, and it says so.
    asked = vars(cli.build_parser().parse_args(["workshop", "start"]))
    again = hub.prepare(root, gpus=[], port=asked["port"], public=asked["public"])
    assert again["resumed"] and again["codes"] == {} and codes_file.read_text() == hashes
    assert (again["port"], again["public"], again["before"]) == (port, True, (port, True))
    assert _started(again).startswith(f"workshop resumed in 9 s, on the same address as before: "
                                      f"{hub.address(port, True)}\n")
    assert work.read_text() == "# my ring\n"
    with pytest.raises(WorkshopError, match="has 2 seats; start it again with --seats 2"):
        hub.prepare(root, seats=3, gpus=[], port=free_port())
    with pytest.raises(WorkshopError, match="add --new-codes"):
        hub.prepare(root, password=True, gpus=[], port=free_port())
    shared = hub.prepare(root, password=True, new_codes=True, gpus=[], port=free_port(), public=False)
    assert _started(shared).startswith(f"workshop resumed in 9 s, on a new address (it was {hub.address(port, True)}): "
                                       f"http://127.0.0.1:{shared['port']}\n")
    assert hub.prepare(root, gpus=[])["port"] == shared["port"]
    assert f"'gpucourse workshop start --dir {root}' resumes the same seats" in hub.format_stopped(hub.stop(root), root)
    stored = json.loads(codes_file.read_text())
    assert sorted(shared["codes"]) == ["instructor", "password"]
    assert auth.code_matches(shared["codes"]["password"], stored["seat02"])
    assert not auth.code_matches(first["codes"]["seat02"], stored["seat02"])


def test_a_second_workshop_names_the_one_whose_seats_share_the_machine(tmp_path, monkeypatch):
    """A workshop started while another one's hub runs on this machine says, in one line, which one and what their
    seats share. The other hub is a process that /proc shows as start launches a hub: its command line, its marker."""
    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))
    first, second = tmp_path / "first", tmp_path / "second"
    marker = processes.marker_env(hub.prepare(first, seats=2, gpus=[], port=free_port())["settings"]["id"])
    alone = hub.prepare(second, seats=1, gpus=[], port=free_port())
    assert not any(str(first) in line for line in alone["shared"])  # others may run here
    hub_argv = ["-m", "jupyterhub", "-f", str(first / "hub" / "jupyterhub_config.py")]  # as hub._launch starts it
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *hub_argv],
                             env={**os.environ, **marker})
    try:
        processes.wait_until(lambda: str(first) in processes.hubs(), 10)
        both = hub.prepare(second, gpus=[])
    finally:
        other.kill()
        other.wait()
    line = f"the workshop in {first} runs on this machine too: its seats and these share its {os.cpu_count()} cores"
    assert line in both["shared"] and f"\n  {line}\n" in _started(both)


def _started(prepared: dict) -> str:
    """What 'start' would print for a workshop that :func:`hub.prepare` made ready, had it started in 9 s."""
    url = hub.address(prepared["port"], prepared["public"])
    return hub.format_started({**prepared, "url": url, "dashboard": f"{url}/services/dashboard/", "seconds": 9,
                               "admin": prepared["settings"]["admin"], "login": prepared["settings"]["login"]})


class _ConfigSpy:
    """What a config file sets: ``c.Class.trait = value`` recorded as ``{"Class.trait": value}``."""

    def __init__(self):
        self.values = {}

    def __getattr__(self, section):
        values = self.values

        class Section:
            def __setattr__(self, trait, value):
                values[f"{section}.{trait}"] = value
        return Section()


# --- bad input: one sentence each, nothing started, nothing written --------------------------------------------

def _refused(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpucourse: error: ") and err.count("\n") == 0, err
    return err


def test_bad_input_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    root = tmp_path / "ws"
    where = ["--dir", str(root)]
    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))  # a machine without the proxy refuses the same
    monkeypatch.setattr(hub, "visible_gpu_ids", lambda: ["0", "1"])
    assert "--seats 0 must be at least 1" in _refused(capsys, ["workshop", "start", "--seats", "0", *where])
    assert "--seats -1 must be at least 1" in _refused(capsys, ["workshop", "start", "--seats", "-1", *where])
    assert "4 seats need at least 4 GPUs" in _refused(capsys, ["workshop", "start", "--seats", "4", *where])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert f"port {port} is in use" in _refused(capsys, ["workshop", "start", "--seats", "2", "--port", str(port),
                                                             *where])
    monkeypatch.setenv("GPUCOURSE_PROXY", str(tmp_path / "no-such-proxy"))
    assert "configurable-http-proxy, was not found; 'make workshop-deps'" in \
        _refused(capsys, ["workshop", "start", "--seats", "2", *where])
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: None)
    assert "JupyterHub is not installed in this Python; 'make workshop-deps'" in \
        _refused(capsys, ["workshop", "start", "--seats", "2", *where])
    for action in (["collect", "--out", str(tmp_path / "g.csv")], ["status"], ["check"], ["stop"]):
        assert f"no workshop in {root}" in _refused(capsys, ["workshop", *action, *where])
    assert not root.exists() and not (tmp_path / "g.csv").exists()


def test_a_kernel_folder_too_deep_or_open_to_others_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch,
                                                                                       short_tmp):
    """Kernels' sockets go under /tmp/gpucourse-<uid>/: a base too deep for a socket's path, or a folder other
    accounts can open, is refused in one sentence and nothing starts."""
    from gpucourse.course import kernel_sockets

    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))
    root = tmp_path / "ws"
    start = ["workshop", "start", "--seats", "2", "--port", str(free_port()), "--dir", str(root)]
    with monkeypatch.context() as deep:
        deep.setattr(kernel_sockets, "_base", lambda: tmp_path / ("deep" * 10))
        said = _refused(capsys, start)
        assert "seat01: kernels' sockets in " in said and "too long for a Unix socket" in said
    shared = short_tmp / f"gpucourse-{os.getuid()}"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert f"seat01: {shared} is not a private folder of user {os.getuid()}" in _refused(capsys, start)
    assert not root.exists()


# --- progress, report, dashboard -------------------------------------------------------------------------------

def test_the_progress_file_keeps_the_failed_checks_and_reads_old_files(tmp_path, own_progress_file):
    failed = [{"check": "sums over 2 ranks", "message": "rank 1 got 3.0", "hint": "think of the ring"}]
    entry = progress.record_exercise("ex01_ring_allreduce", 4, 10, failed)
    assert entry["failed"] == failed and not entry["passed"]
    assert progress.record_exercise("ex01_ring_allreduce", 10, 10, [])["failed"] == []
    assert progress.record_exercise("ex02_data_parallel", 3, 10)  # an older caller: no failed checks given
    assert "failed" not in progress.load()["exercises"]["ex02_data_parallel"]
    # A file written before failed checks were recorded still reads, from its own path too.
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": 1, "quizzes": [], "exercises": {"ex03_gradient_buckets": {
        "attempts": 1, "best": 2, "first_passed": None, "score": 2, "max_score": 10, "last": "2026-01-01T10:00:00",
        "passed": False}}}))
    seat = report.seat_progress(old)
    assert seat["stuck"]["exercise"] == "ex03_gradient_buckets" and seat["stuck"]["check"] is None
    assert progress.summary(old)["file"] == str(old)


def _seat_file(folder: Path, exercises: dict, quizzes: list | None = None) -> None:
    path = folder / ".gpucourse" / "progress.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": 1, "exercises": exercises, "quizzes": quizzes or []}))


def test_the_class_report_names_who_is_stuck_and_what_to_explain_next(tmp_path):
    ws = Workshop(tmp_path)
    ws.hub_dir.mkdir()
    folders = {n: tmp_path / "seats" / n for n in plan.seat_names(3)}
    ws.save_plan(plan.make_plan(folders, [], cores=2), processes.marker_env("x"))
    ring = {"check": "sums over 2 ranks", "message": "wrong sum", "hint": "send to rank+1"}
    tried = lambda score, failed, last: {"attempts": 2, "best": score, "score": score, "max_score": 10,  # noqa: E731
                                         "passed": score == 10, "first_passed": None, "last": last, "failed": failed}
    _seat_file(folders["seat01"], {"ex01_ring_allreduce": tried(10, [], "2026-01-01T10:00:00+00:00")},
               [{"topic": "parallelism", "correct": 4, "total": 5, "time": "2026-01-01T10:05:00+00:00",
                 "by_topic": {"parallelism": [4, 5]}}])
    _seat_file(folders["seat02"], {"ex01_ring_allreduce": tried(4, [ring], "2026-01-01T10:00:00+00:00"),
                                   "ex02_data_parallel": tried(0, [{"check": "averages", "hint": "divide"}],
                                                               "2026-01-01T09:00:00+00:00")})
    _seat_file(folders["seat03"], {"ex01_ring_allreduce": tried(0, [ring], "2026-01-01T10:01:00+00:00")})
    found = report.class_report(ws)
    seats = {s["name"]: s for s in found["seats"]}
    assert seats["seat01"]["passed"] == 1 and seats["seat01"]["quiz"] == {"parallelism": [4, 5]}
    assert seats["seat01"]["last_activity"] == "2026-01-01T10:05:00+00:00" and seats["seat01"]["stuck"] is None
    assert seats["seat02"]["stuck"]["exercise"] == "ex01_ring_allreduce"  # the one graded last
    assert seats["seat02"]["stuck"]["check"] == "sums over 2 ranks"
    assert found["common_failures"][0] == {"exercise": "ex01_ring_allreduce", "check": "sums over 2 ranks",
                                           "seats": ["seat02", "seat03"], "count": 2, "hint": "send to rank+1"}
    assert found["gpu"]["available"] is False and found["gpu"]["note"].startswith("no GPU")
    text = report.format_report(found)
    assert "2× ex01_ring_allreduce: sums over 2 ranks" in text and "jupyterlab-nvdashboard" in text
    page = dashboard.render(found, report.course_exercises())
    assert 'id="seat-seat01"' in page and "ex01 ✔" in page and "send to rank+1" in page


def test_gpu_use_reads_each_seats_own_gpus_from_nvml(tmp_path, monkeypatch):
    """The dashboard's GPU table on a GPU server, with NVML's answers made up (this machine has no GPU)."""
    class Memory:
        used, total = 3 * 2**30, 80 * 2**30

    nvml = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}", nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100", nvmlDeviceGetMemoryInfo=lambda h: Memory,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu={"gpu2": 97}.get(h, 0)))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    seats = plan.make_plan({n: tmp_path / n for n in plan.seat_names(2)}, gpus(4), cores=8)
    use = report.gpu_use(seats)
    assert use["available"] and use["note"] == "4 GPUs on this machine"
    assert [(g["gpu"], g["utilization"]) for g in use["seats"]["seat02"]] == [("2", 97), ("3", 0)]
    assert use["seats"]["seat01"][0]["memory_total"] == 80 * 2**30


# What a seat's server writes about its kernels, in its own words (jupyter_server 2, jupyter_client 8).
KERNEL_LOG = """\
[I 2026-12-04 09:00:41.242 ServerApp] Kernel started: 9ec96b2f-2410-4151-b004-1ba9bee46011
[I 2026-12-04 09:00:41.244 ServerApp] 201 POST /user/seat03/api/sessions (seat03@127.0.0.1) 22.84ms
zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:40197')
[I 2026-12-04 09:00:44.234 ServerApp] AsyncIOLoopKernelRestarter: restarting kernel (1/5), new random ports
"""
KERNEL_GAVE_UP = """\
[W 2026-12-04 09:00:59.315 ServerApp] AsyncIOLoopKernelRestarter: restart failed
[W 2026-12-04 09:00:59.315 ServerApp] Kernel 9ec96b2f-2410-4151-b004-1ba9bee46011 died, removing from map.
"""
KERNEL_AGAIN = "[I 2026-12-04 09:03:10.001 ServerApp] Kernel started: 2898b6d8-065c-4a0b-8983-217893d1d3a6\n"


def test_the_report_names_a_seat_whose_kernel_died_until_one_starts_again(tmp_path):
    ws = Workshop(tmp_path)
    ws.hub_dir.mkdir()
    folders = {n: tmp_path / "seats" / n for n in plan.seat_names(2)}
    ws.save_plan(plan.make_plan(folders, [], cores=2), processes.marker_env("x"))
    log = ws.seat_log("seat02")
    log.parent.mkdir()
    seen = []
    for text in (KERNEL_LOG, KERNEL_GAVE_UP, KERNEL_AGAIN):
        with log.open("a") as f:
            f.write(text)
        seen.append({s["name"]: s["kernels"] for s in report.class_report(ws)["seats"]})
    restarting, died, again = (s["seat02"] for s in seen)
    assert all(s["seat01"] == {"state": "none", "died": 0, "restarts": 0, "problem": None, "log": None} for s in seen)
    assert restarting["state"] == "restarting" and "(1/5 tries)" in restarting["problem"]
    assert died["state"] == "died" and died["died"] == 1 and died["restarts"] == 1
    assert "died at 2026-12-04 09:00:59" in died["problem"] and "Address already in use" in died["log"]
    assert again["state"] == "ok, 1 died before" and again["problem"] is None and again["log"] is None
    # What the instructor reads: the terminal names the seat and shows its log; the dashboard marks it.
    found = report.class_report(ws)
    found["seats"][1]["kernels"] = died
    text = report.format_report(found)
    assert re.search(r"^seat02\s+CPU, 1 thread\s+stopped\s+died\s", text, re.M), text
    assert "kernels in trouble" in text and "seat02: a kernel died at 2026-12-04 09:00:59" in text
    assert "      [W 2026-12-04 09:00:59.315 ServerApp] Kernel 9ec96b2f" in text
    page = dashboard.render(found, report.course_exercises())
    row = page.split('id="seat-seat02"')[1].split("</tr>")[0]
    assert '<span class="trouble">died</span>' in row and "removing from map" in row
    assert "trouble" not in page.split('id="seat-seat01"')[1].split("</tr>")[0]


# --- one real workshop ----------------------------------------------------------------------------------------

SCRATCH = "scratch.ipynb"  # a notebook each learner makes in their seat
WHERE_AM_I = ("import os, shutil\n"
              "print('seat', os.environ['GPUCOURSE_SEAT'], 'gpus', repr(os.environ['CUDA_VISIBLE_DEVICES']),\n"
              "      'progress', os.environ['GPUCOURSE_PROGRESS'], 'cwd', os.getcwd(), 'cli', shutil.which('gpucourse'))")


# Run in a seat's kernel: what its user can reach of what is not its own (a file's bytes, or why not).
SEAT_PROBE = """
import json, os, urllib.request
def reach(path):
    try:
        if os.path.isdir(path):
            return "lists " + ",".join(sorted(os.listdir(path)))
        with open(path, "rb") as f:
            return f"reads {len(f.read())} bytes"
    except OSError as e:
        return type(e).__name__
def status(path):  # this seat's own token, as its server has it, at another address
    req = urllib.request.Request(BASE + path, headers={"Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"]})
    try:
        return urllib.request.urlopen(req).status
    except urllib.error.HTTPError as e:
        return e.code
print(json.dumps({"uid": os.getuid(), "paths": {p: reach(p) for p in PATHS},
                  "other server": status(OTHER), "own server": status(OWN)}))
"""


def _own_files(folder: Path) -> None:
    """What the test wrote into a seat's folder, handed to the seat's owner (its own Unix user, as root)."""
    owner = folder.stat()
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)


def _what_a_seat_reaches(base: str, root: Path, seat: str, other: str) -> dict:
    closed = [root / "seats" / other / "exercises", root / "secrets" / "api_token", root / "workshop.json",
              root / "hub" / "jupyterhub.sqlite", root / "hub" / "logs" / f"{other}.log",
              REPO / "solutions" / SOLVED_EX01.name, REPO / "solutions",
              REPO / "gpucourse" / "grading" / "checks" / SOLVED_EX01.name, REPO / "tests" / "mutants", REPO / ".git",
              Path("/etc/shadow")]
    code = (f"BASE = {base!r}; PATHS = {[str(p) for p in closed]!r}; OTHER = '/user/{other}/api/contents/exercises'; "
            f"OWN = '/user/{seat}/api/contents/exercises'\n" + SEAT_PROBE)
    workshop = Workshop(root)
    [found] = kernels.open_all_at_once({seat: f"{base}/user/{seat}/api"}, hub.api_token(workshop), code, None, 120)
    assert found["ok"], found
    return json.loads(found["output"].strip().splitlines()[-1])


def _scratch_notebook(folder: Path) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(WHERE_AM_I),
                nbformat.v4.new_code_cell('from gpucourse.grading import check\ncheck("ex01")'),
                nbformat.v4.new_code_cell('from gpucourse.grading import check\ncheck("ex02")')]
    nbformat.write(nb, folder / "notebooks" / SCRATCH)
    for name, values in lab.DRIVEN_SETTINGS.items():  # no news pop-up over the page
        path = folder / ".jupyter" / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _log_in(browser, base: str, name: str, code: str, then: str = ""):
    """A new browser page that logs in to the hub as ``name``; the hub then sends it to ``then`` (a path)."""
    page = browser.new_page()
    page.set_default_timeout(120_000)
    page.goto(f"{base}/hub/login" + (f"?next={quote(then)}" if then else ""))
    page.fill("#username_input", name)
    page.fill("#password_input", code)
    page.click("#login_submit")
    return page


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed as any HTTP client follows them, at most ``limit``, keeping the addresses passed."""

    def __init__(self, limit: int):
        self.max_redirections = limit
        self.passed = []

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.passed.append(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _follow(url: str, limit: int, *handlers, data: bytes | None = None) -> tuple[list[str], str, str]:
    """(addresses redirected to, the address that answered, its page) of a plain HTTP request to ``url``: no
    cookies unless ``handlers`` keep them."""
    redirects = _Redirects(limit)
    try:
        with urllib.request.build_opener(redirects, *handlers).open(url, data=data, timeout=60) as response:
            return redirects.passed, response.geturl(), response.read().decode()
    except urllib.error.HTTPError as e:
        pytest.fail(f"{url}: {e} after {redirects.passed}")


def _scratch_open(page, timeout: float = 120) -> lab.NotebookPage:
    """The scratch notebook, once the page shows it and its kernel is idle."""
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout * 1000)
    notebook = lab.NotebookPage(page, None, SCRATCH)
    notebook.wait_idle(timeout)
    return notebook


def _parent_and_session(pid: int) -> tuple[int, int]:
    """(parent pid, session id) of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[3])


@pytest.mark.timeout(600)
def test_a_real_workshop_from_start_to_stop(tmp_path, capsys):
    chromium = browsers.chromium()
    browsers.needed(hub.find_proxy(), "no configurable-http-proxy for the workshop test: run scripts/install-proxy "
                                      "(or make workshop-deps)")
    root, port = tmp_path / "workshop", free_port()
    t0 = time.monotonic()
    assert cli.main(["workshop", "start", "--seats", "3", "--port", str(port), "--dir", str(root)]) == 0
    started_s = time.monotonic() - t0
    printed = capsys.readouterr().out
    codes = dict(re.findall(r"^  (seat0\d)\s+([a-z2-9-]{14})\s", printed, re.M))
    codes["instructor"] = re.search(r"^instructor \(instructor\): (\S+)$", printed, re.M).group(1)
    assert sorted(codes) == ["instructor", "seat01", "seat02", "seat03"], printed
    base = f"http://127.0.0.1:{port}"
    seats = root / "seats"
    workshop_id = json.loads((root / "workshop.json").read_text())["id"]
    for seat in ("seat01", "seat02"):
        _scratch_notebook(seats / seat)
    shutil.copyfile(SOLVED_EX01, seats / "seat01" / "exercises" / SOLVED_EX01.name)  # seat A solved ex01
    for seat in ("seat01", "seat02"):
        _own_files(seats / seat)
    as_root = os.geteuid() == 0
    try:
        # As root, each seat is a Unix user of its own: its server, and so its kernels, run as that user, and what is
        # not the seat's own cannot be read from it (what its modes would allow is hidden by its mount namespace).
        # Not as root, the seats share this account, and start says so.
        if as_root:
            assert "each seat runs as a Unix user of its own" in printed, printed
            seen = {seat: _what_a_seat_reaches(base, root, seat, other)
                    for seat, other in (("seat01", "seat02"), ("seat02", "seat01"))}
            assert 0 not in (seen["seat01"]["uid"], seen["seat02"]["uid"]) and \
                seen["seat01"]["uid"] != seen["seat02"]["uid"], seen
            for seat, found in seen.items():
                unread = {p: r for p, r in found["paths"].items() if r not in (
                    "PermissionError", "FileNotFoundError", "reads 0 bytes", "lists ")}
                assert unread == {}, (seat, unread)
                assert (found["other server"], found["own server"]) == (403, 200), found
            assert (root / "seats" / "seat01").stat().st_mode & 0o777 == 0o700
        else:
            assert "seats share this account (the hub is not root)" in printed, printed
        assert f"already running at {base}; stop it first with 'gpucourse workshop stop --dir {root}'." in \
            _refused(capsys, ["workshop", "start", "--dir", str(root)])
        # The printed address, as a client with no cookies follows it, ends on the login page. A learner who logs in
        # there lands in notebook 00 of their seat, with no news prompt from JupyterLab.
        address = re.search(r"^workshop started in \d+ s: (\S+)$", printed, re.M).group(1)
        passed, login_page, _ = _follow(address, 3)
        assert urlparse(login_page).path == "/hub/login", passed
        cookies = urllib.request.HTTPCookieProcessor()  # the login form's _xsrf cookie, then the learner's session
        form = _follow(login_page, 0, cookies)[2]
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', form).group(1)
        login = urlencode({"username": "seat03", "password": codes["seat03"], "_xsrf": xsrf}).encode()
        passed, landed, _ = _follow(login_page, 10, cookies, data=login)
        assert urlparse(landed).path == f"/user/seat03/lab/tree/{spawner.FIRST_NOTEBOOK}", passed
        assert (seats / "seat03" / spawner.FIRST_NOTEBOOK).is_file()
        news = json.loads(_follow(f"{base}/user/seat03/lab/api/settings/@jupyterlab/apputils-extension:notification",
                                  0, cookies)[2])
        assert news["schema"]["properties"]["fetchNews"]["default"] == "false", news["schema"]["properties"]
        with lab.Browser(chromium) as browser:
            # Nothing is open without a login: no server, no file, no API, no dashboard.
            stranger = browser.new_page()
            for path in ("/user/seat01/api/contents/exercises", "/hub/api/users"):
                assert stranger.request.get(base + path, max_redirects=0).status == 403, path
            for path in ("/user/seat01/lab", "/user/seat01/files/exercises/" + SOLVED_EX01.name,
                         "/services/dashboard/"):
                response = stranger.request.get(base + path, max_redirects=0)
                assert response.status == 302, (path, response.status)
                assert re.search(r"/hub/login|/oauth2/authorize", response.headers["location"]), path
            wrong = _log_in(browser, base, "seat01", "aaaa-bbbb-cccc")
            wrong.wait_for_selector("text=Invalid username or password")
            # Two learners, each in their own seat, each running a cell there.
            logged_in = {seat: _log_in(browser, base, seat, codes[seat], f"/user/{seat}/lab/tree/notebooks/{SCRATCH}")
                         for seat in ("seat01", "seat02")}  # both pages load side by side
            pages = {}
            for seat, page in logged_in.items():
                pages[seat] = _scratch_open(page)
                _, text = pages[seat].run_cell("GPUCOURSE_SEAT", timeout=120)
                folder = seats / seat
                assert f"seat {seat} gpus ''" in text and f"progress {folder}/.gpucourse/progress.json" in text, text
                assert f"cwd {folder}/notebooks cli {Path(sys.executable).parent / 'gpucourse'}" in text, text
            # Seat A cannot reach seat B's server, its files, the hub's API or the dashboard.
            a = pages["seat01"].page
            for path in ("/user/seat02/lab", "/user/seat02/api/contents/exercises",
                         "/user/seat02/files/exercises/" + SOLVED_EX01.name, "/hub/api/users", "/services/dashboard/"):
                assert a.request.get(base + path).status == 403, path
            assert a.request.get(f"{base}/user/seat01/api/contents/../seat02/exercises").status == 404
            # Seat A checks its solved exercise; the instructor's dashboard shows it passed.
            _, text = pages["seat01"].run_cell('check("ex01")', timeout=300)
            assert "10 / 10" in text, text[:2000]
            if as_root:  # a grading service that cannot be reached is the instructor's trouble, not a try of seat B's
                service = root / "grader" / "socket"
                service.rename(service.with_name("away"))
                _, text = pages["seat02"].run_cell('check("ex02")', timeout=120)
                service.with_name("away").rename(service)
                assert "the grader could not run" in text and "cannot be reached" in text, text[:2000]
                assert "not your code" in text and "0 / 10" not in text, text[:2000]
                kept = json.loads((seats / "seat02" / ".gpucourse" / "progress.json").read_text())
                assert "ex02_data_parallel" not in kept.get("exercises", {}), kept
                assert "ex02_data_parallel" in kept["grader_failures"], kept
            instructor = _log_in(browser, base, "instructor", codes["instructor"])
            instructor.wait_for_url("**/services/dashboard/**")
            row = instructor.locator("#seat-seat01").inner_text()
            exercises = len(grading.exercises())  # every exercise the course has, one of them passed
            assert f"1/{exercises} passed" in row and "ex01 ✔" in row, row
            assert instructor.locator("#seat-seat01 td").nth(3).inner_text() == "ok"  # its kernel started, none died
            assert f"0/{exercises} passed" in instructor.locator("#seat-seat02").inner_text()
        assert cli.main(["workshop", "status", "--dir", str(root)]) == 0
        status = capsys.readouterr().out
        assert re.search(rf"^seat01\s+CPU, 1 thread\s+running\s.*\s1/{exercises}\s+10/{report.course_points()}\s",
                         status, re.M), status
        # The whole class, graded with the course's grader.
        grades, gradescope = tmp_path / "grades.csv", tmp_path / "gradescope"
        assert cli.main(["workshop", "collect", "ex01", "--out", str(grades), "--gradescope", str(gradescope),
                         "--jobs", "3", "--dir", str(root)]) == 0
        rows = list(csv.DictReader(grades.open()))
        assert [(r["learner"], r["ex01"], r["total"]) for r in rows] == \
            [("seat01", "10", "10"), ("seat02", "0", "0"), ("seat03", "0", "0")], rows
        assert json.loads((gradescope / "seat01" / "results.json").read_text())["score"] == 10
        assert sorted(p.name for p in gradescope.iterdir()) == ["seat01", "seat02", "seat03"]
        # Every process of the workshop carries its marker: hub, proxy, dashboard, 3 servers, 2 kernels at least;
        # the hub and each process it started run in a session of their own.
        marked = processes.marked(workshop_id)
        running = [processes.identity(pid) for pid in marked]
        assert len(running) >= 8, running
        hub_pid = json.loads((root / "hub" / "running.json").read_text())["pid"]
        started_by_hub = [pid for pid in marked if _parent_and_session(pid)[0] == hub_pid]
        # The proxy, the dashboard, 3 seat servers, and as root the grading service the seats ask.
        assert len(started_by_hub) == 5 + as_root, started_by_hub
        assert all(_parent_and_session(pid)[1] == pid for pid in [hub_pid, *started_by_hub])
    finally:
        assert cli.main(["workshop", "stop", "--dir", str(root)]) == 0
        if as_root:  # the seats' users stay across stop and start, until they are removed
            accounts = [plan.seat_account(s.name, False, s.account) for s in Workshop(root).saved_plan().seats]
            assert None not in accounts, accounts
            assert cli.main(["workshop", "remove-users", "--dir", str(root)]) == 0
            assert "removed 3 seat user(s)" in capsys.readouterr().out
            assert [plan.seat_account(s.name, False, s.account) for s in Workshop(root).saved_plan().seats] == \
                [None] * 3
            assert (seats / "seat01" / "exercises" / SOLVED_EX01.name).stat().st_uid == 0
    assert processes.marked(workshop_id) == []
    assert not any(processes.alive(i) for i in running if i)
    assert (seats / "seat01" / "exercises" / SOLVED_EX01.name).read_bytes() == SOLVED_EX01.read_bytes()
    assert json.loads((seats / "seat01" / ".gpucourse" / "progress.json").read_text())["exercises"]
    print(f"workshop: started in {started_s:.1f} s, whole test {time.monotonic() - t0:.1f} s")


# --- a class opening its first notebook in the same second -----------------------------------------------------

STRESS_SEATS, STRESS_ROUNDS = 6, 4
NO_KERNEL = "this seat's kernels exit as they start"


@pytest.mark.timeout(600)
def test_six_seats_open_a_notebook_in_the_same_second_four_times(tmp_path, capsys):
    """Kernels only, through the hub and the proxy as a browser goes: every seat's kernel starts, with no restart,
    and runs a cell, 4 rounds (a round takes about 2 s; `gpucourse workshop check --rounds N` tries more on a
    started workshop); then a seat whose kernel cannot start is named by `check` and by `status`."""
    browsers.needed(hub.find_proxy(), "no configurable-http-proxy for the workshop test: run scripts/install-proxy "
                                      "(or make workshop-deps)")
    root = tmp_path / "ws"
    hub.start(root, seats=STRESS_SEATS, gpus=[], port=free_port())
    try:
        found = kernels.check(root, rounds=STRESS_ROUNDS, code=KERNEL_TRANSPORT, expect="ipc tcp ports 0")
        assert found["failed"] == {}, kernels.format_check(found)
        assert [len(r) for r in found["rounds"]] == [STRESS_SEATS] * STRESS_ROUNDS
        ready = sorted(r["ready_s"] for results in found["rounds"] for r in results)
        print(f"{STRESS_SEATS} seats × {STRESS_ROUNDS} rounds: kernels answered in {ready[0]:.1f}–{ready[-1]:.1f} s")
        # A seat whose kernel cannot start: an IPython start-up file in the seat (its HOME) ends every kernel.
        last = plan.seat_names(STRESS_SEATS)[-1]
        startup = root / "seats" / last / ".ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True, exist_ok=True)  # the kernels so far made the profile
        (startup / "00-broken.py").write_text(f"import os\nos.write(2, b{NO_KERNEL + chr(10)!r})\nos._exit(3)\n")
        assert cli.main(["workshop", "check", "--dir", str(root)]) == 1
        printed = capsys.readouterr().out
        assert f"round 1: {STRESS_SEATS - 1}/{STRESS_SEATS} seats' kernels started" in printed, printed
        assert f"  {last}: connecting to the kernel: the kernel kept dying" in printed, printed
        # The log's end shows the server's five restarts and its giving up. (What the kernel itself wrote before it
        # died may be lost: ipykernel forwards its stderr from a thread that os._exit does not wait for.)
        log = printed.split(f"{last}'s server log ends with:")[1]
        assert "restarting kernel (5/5)" in log and "restart failed" in log and "died, removing from map" in log
        assert cli.main(["workshop", "status", "--dir", str(root)]) == 0
        status = capsys.readouterr().out
        assert re.search(rf"^{last}\s+CPU, 1 thread\s+running\s+died\s", status, re.M), status
        assert re.search(r"^seat01\s+CPU, 1 thread\s+running\s+ok\s", status, re.M), status
        trouble = status.split("kernels in trouble")[1]
        assert f"{last}: a kernel died at " in trouble and "died, removing from map" in trouble
    finally:
        hub.stop(root)
        if os.geteuid() == 0:
            hub.remove_users(root)


def test_check_refuses_bad_input_in_one_sentence(tmp_path, capsys, monkeypatch):
    """`workshop check` on a workshop that is not running, a seat it does not have, no rounds, no time."""
    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))
    root = tmp_path / "ws"
    hub.prepare(root, seats=2, gpus=[], port=free_port())
    where = ["--dir", str(root)]
    assert "--rounds 0 must be at least 1" in _refused(capsys, ["workshop", "check", "--rounds", "0", *where])
    assert "--timeout 0 must be more than 0" in _refused(capsys, ["workshop", "check", "--timeout", "0", *where])
    assert "no seat named seat09 in this workshop (it has seat01, seat02)" in \
        _refused(capsys, ["workshop", "check", "seat09", *where])
    assert f"the workshop in {root} is not running; start it with 'gpucourse workshop start --dir {root}'." in \
        _refused(capsys, ["workshop", "check", *where])
