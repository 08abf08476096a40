"""Learner ranks walled in by the operating system, not by the audit hook alone: from inside a rank, a learner file
reports who it runs as and tries every channel to the other rank, the grader or the course that the audit hook is
known to miss (a file opened relative to a directory descriptor, an extended attribute, POSIX shared memory,
/dev/shm, another process's /proc, the solution by absolute path), each through a door the hook does not watch,
so that what stops it is the rank's own mount, PID and IPC namespace; and its backend's all-reduce with records
forged to match a ring is still caught by the kernel's count of the bytes. One grading run checks it all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpucourse import grading
from gpucourse.grading import spawn

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "ex01_ring_allreduce.py"
CHECKS = REPO / "gpucourse" / "grading" / "checks" / "ex01_ring_allreduce.py"

# Rank 0 writes into each channel, both ranks meet at a barrier, rank 1 looks for what rank 0 wrote. Every path
# is opened relative to a descriptor of "/" (the audit hook resolves such a path against the working folder, the
# rank's own, and lets it pass), and xattrs and shm_open raise no audit event at all.
PROBE = '''
import json, os
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

SOLUTION, CHECKS, GRADER_PID = {solution!r}, {checks!r}, {grader_pid!r}


def attempt(fn):
    try:
        return "ok " + repr(fn())[:120]
    except BaseException as e:  # ForbiddenCall is a BaseException
        return f"{{type(e).__name__}}: {{e}}"[:150]


def at(path, flags=os.O_RDONLY, data=None):
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(path.lstrip("/"), flags, 0o666, dir_fd=root)
    try:
        return os.write(fd, data) if data is not None else os.read(fd, 100)
    finally:
        os.close(fd)
        os.close(root)


def shm(name, data=None):
    import _posixshmem  # what multiprocessing.shared_memory opens its segments with

    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_RDWR if data else os.O_RDONLY, 0o666)
    try:
        return os.write(fd, data) if data else os.read(fd, 100)
    finally:
        os.close(fd)


def probe():
    rank, own = dist.get_rank(), os.getcwd()
    ranks, private = os.path.dirname(own), os.path.dirname(os.path.dirname(own))
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    said = {{"rank": rank, "uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid(),
            "caps": {{k: status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs")}},
            "proc": sorted(n for n in os.listdir("/proc") if n.isdigit()), "tmp": sorted(os.listdir("/tmp")),
            "shm": sorted(os.listdir("/dev/shm")), "private": private, "file": __file__,
            # memory this process shares with others: the launcher's, which every rank would share, is gone
            "shared": sorted({{line.split()[-1] for line in open("/proc/self/maps") if line.split()[1][3] == "s"}})}}
    places = {{"dir_fd in the ranks' folder": os.path.join(ranks, "drop"),
              "dir_fd in the sandbox's folder": os.path.join(private, "drop"),
              "dir_fd in /tmp": "/tmp/gpucourse-drop", "/dev/shm": "/dev/shm/gpucourse-drop"}}
    xattrs = {{"xattr on the learner's file": __file__, "xattr on the ranks' folder": ranks,
              "xattr on the sandbox's folder": private, "xattr on /tmp": "/tmp"}}
    if rank == 0:
        said["wrote"] = {{name: attempt(lambda p=p: at(p, os.O_CREAT | os.O_WRONLY, b"from rank 0"))
                         for name, p in places.items()}}
        said["wrote"].update({{name: attempt(lambda p=p: os.setxattr(p, "user.gpucourse", b"from rank 0"))
                              for name, p in xattrs.items()}})
        said["wrote"]["POSIX shared memory"] = attempt(lambda: shm("/gpucourse-drop", b"from rank 0"))
    dist.barrier()
    if rank == 1:
        said["read"] = {{name: attempt(lambda p=p: at(p)) for name, p in places.items()}}
        said["read"].update({{name: attempt(lambda p=p: os.getxattr(p, "user.gpucourse")) for name, p in xattrs.items()}})
        said["read"]["POSIX shared memory"] = attempt(lambda: shm("/gpucourse-drop"))
    said["outside"] = {{"the solution": attempt(lambda: at(SOLUTION)), "the checks": attempt(lambda: at(CHECKS)),
                       "the grader's /proc": attempt(lambda: at(f"/proc/{{GRADER_PID}}/cmdline")),
                       "the grader's root": attempt(lambda: at(f"/proc/{{GRADER_PID}}/root" + SOLUTION)),
                       "the solution, asked plainly": attempt(lambda: open(SOLUTION).read())}}
    for key, value in said.items():  # short lines: the ranks' output is read back a line at a time
        for name, one in (value.items() if isinstance(value, dict) else [("-", value)]):
            print(f"PROBE {{rank}} {{key}} {{name.replace(' ', '+')}} " + json.dumps(one), flush=True)


def ring_all_reduce(tensor):
    if "PROBED" not in os.environ and dist.get_world_size() == 2:  # once a process: each check loads the file afresh
        os.environ["PROBED"] = "1"
        probe()
    # The backend's all-reduce, below the dispatcher, with the records an honest ring would have left.
    out = tensor.detach().clone().contiguous()
    n, rank = dist.get_world_size(), dist.get_rank()
    if n > 1:
        _get_default_group()._get_backend(torch.device("cpu")).allreduce([out]).wait()
        chunks = out.reshape(-1).tensor_split(n)
        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "records"):
                for step in range(2 * (n - 1)):
                    sent, got = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
                    mode.records.append({{"op": "send", "bytes": sent.numel() * sent.element_size(),
                                         "group": list(range(n)), "async": True, "t": 0.0, "peer": (rank + 1) % n}})
                    mode.records.append({{"op": "recv", "bytes": got.numel() * got.element_size(),
                                         "group": list(range(n)), "async": False, "t": 0.0, "peer": (rank - 1) % n}})
    return out.view(tensor.shape)
'''


def _namespaces_allowed() -> bool:
    user = ["setpriv", "--reuid", str(spawn.NOBODY), "--regid", str(spawn.NOBODY), "--clear-groups"] \
        if os.geteuid() == 0 else []
    return subprocess.run([*user, "unshare", "-U", "-m", "-p", "-i", "-f", "true"], capture_output=True,
                          cwd="/").returncode == 0


def test_a_rank_sees_no_other_process_file_or_shared_memory_and_holds_no_capability(tmp_path, marked):
    if not _namespaces_allowed():
        pytest.skip("this machine allows no user namespaces to the sandbox's user")
    (tmp_path / "ex01_ring_allreduce.py").write_text(PROBE.format(solution=str(SOLUTION), checks=str(CHECKS),
                                                                  grader_pid=os.getpid()))
    result = grading.grade(tmp_path, ["ex01"], seed=5)
    graded = result["exercises"][0]
    assert not graded.get("warning"), graded["warning"]
    said: dict[int, dict] = {}
    for line in graded["output"].splitlines():
        if "PROBE " in line:
            rank, key, name, value = line.split("PROBE ", 1)[1].split(" ", 3)
            if name == "-":
                said.setdefault(int(rank), {}).setdefault(key, json.loads(value))  # the first check's
            else:
                said.setdefault(int(rank), {}).setdefault(key, {}).setdefault(name.replace("+", " "),
                                                                               json.loads(value))
    assert sorted(said) == [0, 1], graded["output"][-3000:]
    uid = spawn.NOBODY if os.geteuid() == 0 else os.geteuid()
    for rank, report in said.items():
        # An unprivileged user with no capability left, alone in its PID namespace, its /tmp and /dev/shm its own
        # (/tmp holds only the way down to its own folder where the sandbox's folder lies in /tmp).
        assert (report["uid"], report["gid"], report["pid"]) == (uid, uid if os.geteuid() == 0 else os.getegid(), 2)
        assert report["caps"] == {"CapEff": "0000000000000000", "CapPrm": "0000000000000000",
                                  "CapBnd": "0000000000000000", "NoNewPrivs": "1"}, report["caps"]
        assert report["proc"] == ["1", "2"], report["proc"]  # the namespace's init and the rank
        assert all(os.path.basename(path).startswith("status-") for path in report["shared"]), report["shared"]
        assert report["shm"] == [] and report["tmp"] in ([], [report["private"].split("/")[2]]), report
        # Neither the course nor the grader: not through the audit hook's blind spot, nor through it.
        for name, outcome in report["outside"].items():
            assert not outcome.startswith("ok"), (rank, name, outcome)
        assert "refuses to read" in report["outside"]["the solution, asked plainly"]
        assert "FileNotFoundError" in report["outside"]["the grader's /proc"], report["outside"]
    # What rank 0 could write at all went to places of its own: nothing it wrote reached rank 1.
    wrote, read = said[0]["wrote"], said[1]["read"]
    assert set(wrote) == set(read)
    for name, outcome in read.items():
        assert not outcome.startswith("ok"), (name, wrote[name], outcome)
    for name in ("dir_fd in the ranks' folder", "dir_fd in the sandbox's folder", "xattr on the learner's file",
                 "xattr on the ranks' folder", "xattr on the sandbox's folder"):
        assert "Read-only file system" in wrote[name], (name, wrote[name])
    # The backend's all-reduce and the forged records: the kernel counted the bytes all the same.
    checks = {c["name"]: c for c in graded["checks"]}
    traffic = checks["each rank sends 2(n-1)/n of the tensor, to rank+1 (3 ranks)"]
    assert traffic["points"] == 0 and "by the kernel's count" in traffic["message"], traffic["message"]


def test_the_walls_say_why_not_where_the_kernel_refuses_them():
    """A rank whose mount namespace the kernel refuses (an unprivileged process outside a user namespace of its
    own) gets a reason, not an exception."""
    program = ("import os\nfrom gpucourse.grading import wall\n"
               "if os.geteuid() == 0: os.setresuid(65534, 65534, 65534)\n"
               "print(wall.rank_walls('/', [], '/nonexistent', 1 << 20))\n")
    said = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith("this machine gave the rank no mount namespace"), said.stdout


def test_a_workshop_does_not_start_where_learner_ranks_cannot_be_walled_in(tmp_path, monkeypatch):
    """Seats' code is graded by this machine's grader: where it could not isolate ranks, the workshop refuses to
    start, in one sentence that says why, and writes nothing; where it can (as here), nothing is said."""
    import shutil

    from gpucourse.workshop import hub
    from gpucourse.workshop.errors import WorkshopError

    if _namespaces_allowed():
        assert spawn.isolation_problem() is None
    monkeypatch.setenv("GPUCOURSE_PROXY", shutil.which("true"))  # a machine without the proxy refuses the same
    monkeypatch.setattr(hub, "visible_gpu_ids", lambda: [])
    monkeypatch.setattr(hub, "isolation_problem", lambda: "the sandbox's user (uid 65534) may not make ... namespaces")
    with pytest.raises(WorkshopError, match=r"could not wall learner code in on this machine: the sandbox's user"):
        hub.prepare(tmp_path / "ws", seats=2, port=hub.free_port())
    assert not (tmp_path / "ws").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, signal_name", [("abort", "SIGABRT"), ("term", "SIGTERM")])
def test_an_isolated_rank_ends_by_its_own_signal_as_any_process_would(how, signal_name):
    """An isolated rank is not its PID namespace's init (which takes no signal it has no handler for, even from
    itself): an abort() ends it with SIGABRT, not a SIGSEGV, and a kill of itself ends it at all."""
    import rankfns
    from gpucourse import launch
    from gpucourse.runtime import WorkerError

    if not _namespaces_allowed():
        pytest.skip("this machine allows no new user, PID and IPC namespaces")
    with pytest.raises(WorkerError) as info:
        launch(rankfns.ends_by_signal, how, world_size=2, timeout=60, quiet=True, isolate=True)
    assert info.value.rank == 0 and signal_name in str(info.value), str(info.value)


def test_what_covers_a_hidden_file_reads_empty_even_where_dev_null_is_not_the_null_device(tmp_path, monkeypatch):
    """Hidden files (the checks in a seat, the repository in the sandbox) are covered by a bind of an empty file:
    /dev/null where it is the null device, else an empty read-only file of the grader's own — a /dev/null that a
    mistake made a file or a link would show its content in their place."""
    from gpucourse.grading import wall

    assert wall.empty_file() == os.devnull  # this machine's is the device
    for kind in ("file", "link"):
        fake = tmp_path / f"null-{kind}"
        if kind == "file":
            fake.write_text("secret checks\n")
        else:
            (tmp_path / "target").write_text("python3\n")
            fake.symlink_to(tmp_path / "target")
        monkeypatch.setattr(os, "devnull", str(fake))
        empty = wall.empty_file()
        assert empty != str(fake) and os.path.getsize(empty) == 0 and open(empty).read() == "", empty
        assert os.stat(empty).st_mode & 0o777 == 0o444, oct(os.stat(empty).st_mode)
        os.unlink(empty)
