"""The grader under attack: learner code cannot see the checks' inputs, patch the checks, forge verdicts, leave a
process behind, rewrite a result, import or borrow the reference, or call a forbidden collective by another door;
hostile code (a fork bomb, a socket, deleting files, sleeping forever, a segfault, a detached process) becomes a
failed check, and the checks' verdicts do not depend on the machine's load.

The cheats and hostile files are in tests/mutants/cheats and tests/mutants/hostile; the cheats are graded as one
class (two at a time), which is also the test that one learner's code cannot touch another's files or grade."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpucourse import grading
from gpucourse.grading import catalog, runner

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
CHEATS = REPO / "tests" / "mutants" / "cheats"
HOSTILE = REPO / "tests" / "mutants" / "hostile"
EX01 = [c.name for c in grading.find_exercise("ex01").checks]
MULTI_RANK = [c.name for c in grading.find_exercise("ex01").checks if (c.world_size or 1) > 1]
ALL = None  # every check of the exercise
SECRET = "tell-no-one-31337"

# cheat -> (exercise, the checks it must score 0 on, words every one of those messages holds or None)
ATTACKS = {
    "ex01_reads_check_inputs": ("ex01", MULTI_RANK, None),
    "ex01_patches_check": ("ex01", MULTI_RANK, None),
    "ex01_forges_events": ("ex01", EX01, "ended in the middle of this check"),
    "ex01_daemon_rewrites_results": ("ex01", MULTI_RANK, None),
    "ex01_computed_import": ("ex01", EX01, "refuses to read"),
    "ex01_process_group_method": ("ex01", EX01, "switches off"),
    # Below the dispatcher: the backend's all-reduce, unseen by the recorder (and then records forged to match a
    # ring's); the kernel's count of the bytes on the wire sees it all the same.
    "ex01_backend_allreduce": ("ex01", MULTI_RANK, "by the kernel's count"),
    "ex01_backend_forges_records": ("ex01", MULTI_RANK, "by the kernel's count"),
    "ex01_functional_collective": ("ex01", EX01, "switches off"),
    "ex01_pops_dispatch_mode": ("ex01", EX01, None),
    "ex05_borrows_through_object": ("ex05", ALL, "KeyError"),
    # Back channels: a collective from a thread the recorder does not watch, data passed as files.
    "ex01_thread_collective": ("ex01", EX01, "refuses to start a thread"),
    "ex01_files_between_ranks": ("ex01", MULTI_RANK, None),
    "ex01_thread_module_afresh": ("ex01", EX01, "afresh"),
    "ex01_fork_exec": ("ex01", EX01, "refuses to start a process"),
    "ex01_store_between_ranks": ("ex01", EX01, "refuses to use the rendezvous store"),
}


@pytest.fixture(scope="module")
def cheaters(tmp_path_factory):
    """Every cheat, each handed in by a learner of its own, graded as one class with --jobs 2."""
    root = tmp_path_factory.mktemp("cheaters")
    for name, (ex_id, _, _) in ATTACKS.items():
        folder = root / "class" / name
        folder.mkdir(parents=True)
        shutil.copy(CHEATS / f"{name}.py", folder / f"{grading.find_exercise(ex_id).module}.py")
    honest = root / "class" / "zz_honest"
    shutil.copytree(REPO / "solutions", honest)
    # A learner whose exercise is a link to a file only the grader may read: graded as missing, never read.
    (root / "secret.txt").write_text(f"{SECRET} is not Python\n")
    (root / "secret.txt").chmod(0o600)
    (root / "class" / "link_to_secret").mkdir()
    (root / "class" / "link_to_secret" / f"{grading.find_exercise('ex01').module}.py").symlink_to(root / "secret.txt")
    before = {p: p.read_bytes() for p in (root / "class").rglob("*.py")}
    out = root / "grades.csv"
    result = grading.grade_class(root / "class", out, jobs=2, exercises=["ex01", "ex05"], seed=11)
    time.sleep(3)  # a daemon that escaped would be rewriting results by now
    return result, out, before


def test_a_link_to_a_file_the_learner_may_not_read_is_not_graded(cheaters):
    result, _, _ = cheaters
    linked = result["learners"]["link_to_secret"]
    assert SECRET not in json.dumps(linked) and linked["score"] == 0
    assert "is missing" in linked["exercises"][0]["error"], linked["exercises"][0]["error"]


@pytest.mark.parametrize("cheat", sorted(ATTACKS))
def test_each_attack_scores_zero_on_the_attacked_checks(cheaters, cheat):
    result, _, _ = cheaters
    ex_id, attacked, words = ATTACKS[cheat]
    graded = {e["exercise"]: e for e in result["learners"][cheat]["exercises"]}[ex_id]
    checks = {c["name"]: c for c in graded["checks"]}
    for name in attacked or checks:
        assert checks[name]["points"] == 0, (name, checks[name]["message"])
        if words:
            assert words in checks[name]["message"], (name, checks[name]["message"])


def test_nothing_a_cheat_did_reached_another_learner_or_the_results(cheaters, marked):
    result, out, before = cheaters
    honest = result["learners"]["zz_honest"]
    assert honest["score"] == honest["max_score"] == 20
    for path, content in before.items():
        assert path.read_bytes() == content, f"{path} was changed"
    rows = out.read_text().splitlines()
    assert rows[0] == "learner,ex01,ex05,total" and rows[-1] == "zz_honest,10,10,20"
    for path in (out.parent / "grades-results").iterdir():
        data = json.loads(path.read_text())
        assert data["score"] == result["learners"][path.stem]["score"], path


def test_the_sandbox_holds_no_check_reference_or_solution(tmp_path, marked):
    """A learner file that reports what its interpreter holds: no checks, no reference strategies, no solutions,
    no schedule answers in the functions it may import."""
    (tmp_path / "ex05_one_f_one_b.py").write_text('''
import sys
from gpucourse.parallel.schedules import validate

def one_f_one_b(pp, m):
    secret = sorted(n for n in sys.modules if n.startswith(("solutions", "gpucourse.grading.checks",
                                                            "gpucourse.grading.host", "gpucourse.modeled.memory"))
                    or n.startswith("gpucourse.parallel.") and n != "gpucourse.parallel.schedules")
    names = sorted(k for k in validate.__globals__ if k in ("one_f_one_b", "gpipe", "naive", "formula_bubble"))
    import os
    seen = [p for p in (SOLUTION, CHECK) if os.path.exists(p)]
    raise ValueError(f"SEEN {secret} {names} {seen}")
'''.replace("SOLUTION", repr(str(REPO / "solutions" / "ex05_one_f_one_b.py")))
       .replace("CHECK", repr(str(REPO / "gpucourse" / "grading" / "checks" / "ex05_one_f_one_b.py"))))
    result = grading.grade(tmp_path, ["ex05"])
    message = result["exercises"][0]["checks"][0]["message"]
    # Where the machine allows mount namespaces (as here), the files are not even there.
    walls = subprocess.run(["unshare", "-m", "true"] if os.geteuid() == 0 else ["unshare", "-U", "-m", "true"],
                           capture_output=True).returncode == 0
    assert ("SEEN [] [] []" if walls else "SEEN [] []") in message, message


def test_hostile_code_is_contained(tmp_path, monkeypatch, marked):
    """A fork bomb, a socket, deleting files, sleeping forever, a segfault and a detached process started by the
    fork primitive itself: each a failed check with one sentence, the files it went for intact, nothing left
    running."""
    victim = tmp_path / "victim"
    shutil.copytree(REPO / "exercises", victim)
    targets = [REPO / "solutions" / "ex01_ring_allreduce.py", victim / "ex02_data_parallel.py", victim]
    monkeypatch.setenv("GPUCOURSE_TEST_TARGETS", os.pathsep.join(map(str, targets)))
    before = {p: p.read_bytes() for p in [targets[0], *victim.iterdir()]}
    start = time.monotonic()
    result = grading.grade(REPO / "solutions", ["ex01"], timeout=10,
                           files={"ex01": str(HOSTILE / "ex01_escapes.py")}, hidden_paths=(str(victim),))
    checks = {c["name"]: c for c in result["exercises"][0]["checks"]}
    assert "refuses to start a process" in checks["sums over 2 ranks"]["message"]
    assert "refuses to open a socket" in checks["the contract: bf16 stays bf16, float64 stays float64 (2 ranks)"][
        "message"]
    assert "refuses to" in checks["the contract: a new tensor, the input unchanged, a view accepted (2 ranks)"][
        "message"]
    assert "did not finish within" in checks["3 ranks, lengths not divisible by 3"]["message"]
    assert "ended in the middle of this check" in \
        checks["each rank sends 2(n-1)/n of the tensor, to rank+1 (3 ranks)"]["message"]
    assert "refuses to start a process (_posixsubprocess.fork_exec)" in checks["one rank"]["message"]
    assert all(p.read_bytes() == content for p, content in before.items())
    assert time.monotonic() - start < 200


def test_cli_results_survive_a_daemon(tmp_path, marked):
    """The CLI in a process of its own (its --json path is in its command line, where the daemon looks)."""
    out = tmp_path / "results.json"
    folder = tmp_path / "learner"
    folder.mkdir()
    shutil.copy(CHEATS / "ex01_daemon_rewrites_results.py", folder / "ex01_ring_allreduce.py")
    done = subprocess.run([sys.executable, "-m", "gpucourse.cli", "grade", "ex01", "--path", str(folder),
                           "--json", str(out), "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    time.sleep(3)
    data = json.loads(out.read_text())
    assert data["score"] < data["max_score"] == 10 and len(data["tests"]) == len(EX01)


def test_verdicts_do_not_depend_on_load(marked):
    """The solutions of the hang-prone exercises pass with both cores saturated by other work."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        result = grading.grade(REPO / "solutions", ["ex10", "ex01"])
    finally:
        for b in burners:
            b.kill()
            b.wait()
    for e in result["exercises"]:
        assert e["score"] == e["max_score"], [(c["name"], c["message"]) for c in e["checks"] if c["points"] == 0]


def test_an_untouched_stub_is_not_an_attempt(tmp_path, monkeypatch, marked):
    from gpucourse.course import progress

    folder = tmp_path / "exercises"
    shutil.copytree(REPO / "exercises", folder)
    monkeypatch.chdir(tmp_path)
    grading.check("ex05")
    assert "ex05_one_f_one_b" not in progress.load()["exercises"]
    assert runner.untouched(grading.grade(folder, ["ex05"])["exercises"][0])


# A learner's file that says who runs it, whether root's home is open, where Python and torch came from.
WHOAMI = (
    "import os, sys, torch\n"
    "def ring_all_reduce(tensor):\n"
    "    try:\n"
    "        open('/root/.profile').close(); home = 'read'\n"
    "    except OSError:\n"
    "        home = 'closed'\n"
    "    raise ValueError(f'UID {os.geteuid()} GID {os.getegid()} ROOT {home} PYTHON {sys.base_prefix} '\n"
    "                     f'TORCH {torch.__file__}')\n")


def test_learner_code_runs_as_nobody_even_where_python_lives_in_roots_home(tmp_path, marked):
    """As root, learner code runs as an unprivileged user, with the interpreter where it is installed, even when
    that is a folder only root may enter (here /root/.pyenv), and still cannot read what is root's."""
    from gpucourse.grading import spawn

    (tmp_path / "ex01_ring_allreduce.py").write_text(WHOAMI)
    result = grading.grade(tmp_path, ["ex01"], seed=1)
    message = result["exercises"][0]["checks"][0]["message"]
    if os.geteuid() != 0:
        assert f"UID {os.geteuid()}" in message, message
        return
    assert spawn.sandbox_user() == spawn.NOBODY
    assert "UID 65534 GID 65534" in message and "ROOT closed" in message, message
    assert f"PYTHON {sys.base_prefix} " in message, message
    assert "warning" not in result["exercises"][0]


@pytest.mark.parametrize("mode", [0o700, 0o755], ids=["closed", "open"])
def test_a_clone_in_a_folder_only_its_owner_may_enter_still_grades_as_nobody(tmp_path, marked, mode):
    """A clone in a 0700 folder (what ``mktemp -d`` makes, or root's home): ``nobody`` cannot pass the folder to
    reach the clone's torch, yet learner code runs as ``nobody`` with that torch, and the solution gets full marks.
    As root the checkout is bound into such a folder in a mount namespace of the test's own, its package first on
    the path, so that everything the sandbox runs lies behind the closed folder. A clone in a folder open to all
    (``/srv``), on a machine whose ``/var/cache`` is empty, as a fresh server's is: every solution, full marks,
    and no rank importing a slow module its exercise does not name (the suite's one grading of every solution)."""
    closed = tmp_path / "closed"
    clone = closed / "clone"
    clone.mkdir(parents=True)
    closed.chmod(mode)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "ex01_ring_allreduce.py").write_text(WHOAMI)
    solved = [("ex01", clone / "solutions" / "ex01_ring_allreduce.py")] if mode == 0o700 else \
        [(ex_id, clone / "solutions" / f"{module}.py") for ex_id, module in catalog.modules().items()]
    program = (
        "import json\n"
        "import gpucourse\n"
        "from gpucourse.grading import runner\n"
        f"result = runner.grade_runs([('ex01', {str(tmp_path / 'mine' / 'ex01_ring_allreduce.py')!r}, 1)] +\n"
        f"                           [(i, path, 1) for i, path in {[(i, str(p)) for i, p in solved]!r}])\n"
        "print(json.dumps({'package': gpucourse.__file__, 'result': result}))\n")
    if os.geteuid() == 0:
        script = (f"mount --make-rprivate / && mount --bind {REPO} {clone} && cd {clone} && "
                  + ("mount -t tmpfs tmpfs /var/cache && " if mode == 0o755 else "")
                  + f"exec {clone}/.venv/bin/python -c \"$0\"")
        command = ["unshare", "-m", "sh", "-c", script, program]
    else:  # an ordinary user's own 0700 folder is open to that user: a copy of the checkout runs there
        shutil.copytree(REPO, clone, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".venv", ".git"))
        command = [sys.executable, "-c", program]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(clone)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["package"].startswith(str(clone)), said["package"]
    whoami, *solutions = said["result"]
    message = whoami["checks"][0]["message"]
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    assert f"UID {uid} " in message and (os.geteuid() != 0 or f"TORCH {clone}" in message), message
    assert len(solutions) == len(solved)
    for solution in solutions:
        assert solution["score"] == solution["max_score"] == 10, \
            (solution["exercise"], [c["message"] for c in solution["checks"] if c["points"] == 0])
    assert not any(r.get("warning") for r in said["result"]), whoami.get("warning")
    # A rank that imports a slow module (torch._dynamo, for an optimizer) its exercise does not name in
    # rank_imports costs every grade a second or more; the sandbox imports the named ones once.
    assert [(r["exercise"], r["late_imports"]) for r in solutions if r.get("late_imports")] == []
    if mode == 0o755:  # every exercise's solution, in the catalogue's order: the course's own full marks
        assert [r["exercise"] for r in solutions] == list(catalog.modules())


def test_a_sandbox_that_cannot_become_nobody_says_why_and_the_grade_says_so_first(tmp_path):
    """Where the sandbox's user cannot reach what it runs (and no mount namespace opens a way), the sandbox stays
    root and says why; a grade that ran so says it in its first line."""
    from gpucourse.grading import report

    if os.geteuid() != 0:
        pytest.skip("only root changes user")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    # Without walls nobody reaches neither this interpreter (under /root here) nor a 0700 folder; with them, the
    # interpreter, and an open private folder: then it becomes nobody for good.
    program = ("import os, sys\nfrom gpucourse.grading import wall\n"
               "if sys.argv[2] == 'walls': assert wall.raise_walls([], sys.argv[1])\n"
               "print(repr(wall.drop_to(65534, sys.argv[1], sys.argv[2] == 'walls')), os.geteuid())\n")
    for folder, walls, said_uid in ((closed, "none", "0"), (closed, "walls", "0"), (tmp_path / "open", "walls", None)):
        said = subprocess.run([sys.executable, "-c", program, str(folder), walls], capture_output=True, text=True,
                              timeout=60)
        if said_uid == "0":
            assert "cannot reach" in said.stdout and said.stdout.split()[-1] == "0", said.stdout + said.stderr
        else:
            assert said.stdout.split() == ["''", "65534"], said.stdout + said.stderr
    ex = {"exercise": "ex01", "module": "ex01_ring_allreduce", "title": "t", "notebook": "01", "score": 10,
          "max_score": 10, "error": None, "checks": [], "seed": 1, "warning": "learner code ran as root, ...: why"}
    text = report.text_report({"folder": "f", "seed": 1, "score": 10, "max_score": 10, "exercises": [ex, ex]})
    assert text.splitlines()[0] == "warning: learner code ran as root, ...: why" and text.count("warning") == 1
