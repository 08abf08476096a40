"""Grade a folder of exercises, or a whole class of them; this is what the CLI and ``check`` call.

Nothing here runs learner code: :func:`grade` starts the grading process
(``gpucourse.grading.start``, then ``host``, which holds the checks and starts the sandbox
that runs learner code) in a new session, with a clean environment (no
torchrun variables, no GPU: checks run on gloo CPU ranks), a private temporary
folder, and a deadline of its own on top of the per-check ones. However it
ends, every process it started is killed and the temporary folder removed.

Where the grader itself cannot run (its folder cannot be made, its process does
not start or dies before it has graded an exercise), the exercise gets no
grade but a result saying so (:func:`grader_failed`): that is the grader's
failure, never the learner's.
"""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..files import write_atomic
from . import catalog, remote
from .report import grader_failures, gradescope
from .results import grader_failed, untouched

DEFAULT_TIMEOUT_S = 20.0    # per check, for the learner's code on a quiet machine (scaled by the load)
DEFAULT_MEMORY_GB = 4.0     # address space of an exercise process (torch alone maps about 1.5 GB)
OUTPUT_LIMIT_BYTES = 32 << 20  # largest file an exercise process may write, its printed output included
STARTUP_S = 180.0           # for the grading process to import torch, on a busy machine
REPO = Path(__file__).resolve().parents[2]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")

_live: set[subprocess.Popen] = set()  # grading processes running now (for an interrupt to stop)
_live_lock = threading.Lock()


def find_folder(path: str | os.PathLike | None = None, name: str = "exercises") -> Path:
    """The folder to grade: ``path`` if given; else ``exercises/`` in or above the current folder
    (a notebook runs in ``notebooks/``, beside it), else the one in the repository."""
    if path is not None:
        return Path(path).resolve()
    here = Path.cwd().resolve()
    for folder in [here, *here.parents][:4]:
        if folder.name == name and any(folder.glob("ex[0-9][0-9]_*.py")):
            return folder
        if (folder / name).is_dir():
            return folder / name
    return REPO / name


def _environment(work: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    tmp = os.path.join(work, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env.update(TMPDIR=tmp, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p))
    return env


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, work: str, clean_exit: bool) -> None:
    _kill_group(proc.pid)
    proc.wait()
    if not clean_exit:
        # The grading process was killed: the exercise processes die with it (PDEATHSIG), but make sure.
        try:
            with open(os.path.join(work, "pgids")) as f:
                for line in f:
                    _kill_group(int(line))
        except (OSError, ValueError):
            pass


def grade(folder: str | os.PathLike | None = None, exercises: list[str] | None = None, *,
          timeout: float = DEFAULT_TIMEOUT_S, seed: int | None = None, memory_gb: float = DEFAULT_MEMORY_GB,
          files: dict[str, str] | None = None, hidden_paths: tuple[str, ...] = ()) -> dict:
    """Grade ``exercises`` (ids like "ex03"; default all) in ``folder``; the folder's result as a dict.

    ``files`` maps an exercise id to a file to grade instead of ``folder/<module>.py``;
    ``timeout`` is each check's budget in seconds on a quiet machine (scaled up
    when the machine is loaded); ``hidden_paths`` are more folders the learner's
    code may not read (a class's other submissions).
    The result holds ``folder``, ``seed``, ``score``, ``max_score``, ``time_s`` and
    ``exercises``: one result per exercise (see :mod:`gpucourse.grading.results`).
    An exercise the grader could not run (its result holds ``grader_error``, see
    :func:`grader_failed`) counts in neither ``score`` nor ``max_score``; this
    never raises for a grader that cannot run.
    """
    start = time.monotonic()
    if remote.service() is not None:  # a workshop seat of its own: the checks are on the instructor's side
        return _grade_by_service(folder, exercises, timeout, seed, files or hidden_paths)
    folder = find_folder(folder)
    # Resolved by name only: a notebook's kernel asking for a grade does not import the checks (or torch).
    chosen = [catalog.resolve(e) for e in exercises] if exercises else list(catalog.modules().items())
    paths = [(ex_id, os.path.abspath((files or {}).get(ex_id) or folder / f"{module}.py")) for ex_id, module in chosen]
    seed = secrets.randbelow(2**31) if seed is None else int(seed)
    results = _grade_in_host([(ex_id, path, seed) for ex_id, path in paths], [str(folder)], timeout, memory_gb,
                             hidden_paths)
    graded = [r for r in results if not r.get("grader_error")]
    return {"folder": str(folder), "seed": seed, "score": sum(r["score"] for r in graded),
            "max_score": sum(r["max_score"] for r in graded), "time_s": round(time.monotonic() - start, 3),
            "exercises": results}


def _grade_by_service(folder, exercises, timeout: float, seed, unsupported) -> dict:
    """:func:`grade` asked of the workshop's grading service (:mod:`.remote`): the same result."""
    if unsupported:
        raise ValueError("in a workshop seat the grader grades whole folders only: no files or hidden paths")
    ids = [catalog.resolve(e)[0] for e in exercises] if exercises else list(catalog.modules())
    which = remote.folder_name(folder, REPO, find_folder(None))
    request = {"exercises": ids, "folder": which, "seed": None if seed is None else int(seed),
               "timeout": float(timeout)}
    try:
        return remote.ask(remote.service(), request, STARTUP_S + len(ids) * catalog.MAX_CHECKS * (timeout * 4 + 30))
    except remote.ServiceError as e:  # the service's trouble, never the learner's
        return {"folder": str(find_folder(None if which == "exercises" else REPO / which)), "seed": seed or 0,
                "score": 0, "max_score": 0, "time_s": 0.0,
                "exercises": grader_failed(ids, str(e), seed or 0)}


def grade_runs(runs: list[tuple[str, str, int]], *, timeout: float = DEFAULT_TIMEOUT_S,
               memory_gb: float = DEFAULT_MEMORY_GB) -> list[dict]:
    """Grade each ``(exercise id, file, seed)`` of ``runs`` in one grading process, in order; one result each.

    The same walls as :func:`grade` (the same sandbox, started once): what it saves is the start of the grader and
    its sandbox for every run, so that one file under twenty seeds, or every wrong answer of the course, costs
    about what the checks themselves take."""
    runs = [(catalog.resolve(ex_id)[0], os.path.abspath(path), int(seed)) for ex_id, path, seed in runs]
    return _grade_in_host(runs, [], timeout, memory_gb, ())


def compare_runs(runs: list[tuple[str, str, int]], *, timeout: float = DEFAULT_TIMEOUT_S,
                 memory_gb: float = DEFAULT_MEMORY_GB) -> list[dict]:
    """Compare each ``(exercise id, mutant file, seed)`` of ``runs`` with the exercise's solution, call for call,
    in one process that stands where the grading process stands (:mod:`gpucourse.grading.equivalence`): one
    verdict each, with ``equivalent`` and ``difference``; a run it did not reach gets :func:`grader_failed`'s result."""
    runs = [(catalog.resolve(ex_id)[0], os.path.abspath(path), int(seed)) for ex_id, path, seed in runs]
    return _grade_in_host(runs, [], timeout, memory_gb, (), host="equivalence")


def _grade_in_host(runs: list[tuple[str, str, int]], folders: list[str], timeout: float, memory_gb: float,
                   hidden_paths, host: str = "host") -> list[dict]:
    """The grading process (``gpucourse.grading.host``, or ``equivalence``) over ``runs``; its results, one per run
    (a run it did not reach gets a result saying why: :func:`grader_failed`)."""
    try:
        work = tempfile.mkdtemp(prefix="gpucourse-grade-")
    except OSError as e:
        return _not_reached(runs, f"the grader could not make its working folder ({type(e).__name__}: {e})")
    try:
        # Learner code may read none of these: the repository (solutions/, the checks, the reference
        # strategies), the grader's folder, and the folders being graded (the sandbox has its own copy).
        hidden = [str(REPO), work, *folders] + sorted({os.path.dirname(p) for _, p, _ in runs})
        spec = {"files": [list(run) for run in runs], "seed": runs[0][2] if runs else 0,
                "timeout_scale": float(timeout) / DEFAULT_TIMEOUT_S, "work": work,
                "memory_bytes": int(memory_gb * 2**30), "output_bytes": OUTPUT_LIMIT_BYTES,
                "result": os.path.join(work, "result.json"), "hidden_paths": hidden + list(hidden_paths),
                "host": host}
        try:
            with open(os.open(os.path.join(work, "spec.json"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                json.dump(spec, f)
            os.makedirs(os.path.join(work, "cwd"))
            with open(os.open(os.path.join(work, "host.log"), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as log:
                proc = subprocess.Popen([sys.executable, "-m", "gpucourse.grading.start",
                                         os.path.join(work, "spec.json")],
                                        cwd=os.path.join(work, "cwd"), env=_environment(work),
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        except (OSError, subprocess.SubprocessError) as e:
            return _not_reached(runs, f"the grader could not start its process ({type(e).__name__}: {e})")
        with _live_lock:
            _live.add(proc)
        clean = timed_out = False
        # A net under the per-check budgets the grading process keeps: every check of every run at its longest.
        deadline = STARTUP_S + len(runs) * catalog.MAX_CHECKS * (timeout * 4 + 30)
        try:
            proc.wait(timeout=deadline)
            clean = proc.returncode == 0
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _stop(proc, work, clean)
            with _live_lock:
                _live.discard(proc)
        try:
            with open(spec["result"]) as f:
                results = json.load(f)
        except (OSError, ValueError):
            results = []
        if len(results) < len(runs):
            results += _not_reached(runs[len(results):], _host_failure(work, proc.returncode,
                                                                       deadline if timed_out else None))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _not_reached(runs: list[tuple[str, str, int]], why: str) -> list[dict]:
    return [grader_failed([ex_id], why, seed)[0] for ex_id, _, seed in runs]


def _host_failure(work: str, returncode: int | None, deadline: float | None) -> str:
    """Why the grading process left exercises ungraded: one sentence, then the end of its log."""
    try:
        with open(os.path.join(work, "host.log"), errors="replace") as f:
            tail = f.read()[-2000:].strip()
    except OSError:
        tail = ""
    if deadline is not None:
        how = f"was stopped after its deadline of {deadline:.0f} s"
    elif returncode is not None and returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"ended with status {returncode}"
    return f"the grader's own process {how} before it graded this exercise" + \
        (f"\nits log ends with:\n{tail}" if tail else " (its log is empty)")


def tries(result: dict) -> dict | None:
    """Which try at each exercise of ``result`` this grading is, from the learner's progress file before it is
    recorded (module -> 1 for the first): the hint ladder's rungs follow it (:data:`.report.LADDER`). None when
    the file cannot be read: every rung shows."""
    from ..course import progress

    try:
        done = progress.load().get("exercises", {})
    except (OSError, ValueError, progress.ProgressError):
        return None
    return {e["module"]: done.get(e["module"], {}).get("attempts", 0) + 1 for e in result["exercises"]}


def record_progress(result: dict) -> str:
    """Record each graded exercise's score in the learner's progress file; a note if that failed, else ``""``.

    An untouched stub (every check "not written yet", as a notebook's Run All
    grades it) is not an attempt and is not recorded. Nor is an exercise the
    grader could not run (:func:`grader_failed`): that is recorded apart, as
    the grader's failure (:func:`gpucourse.course.progress.record_grader_failure`), for
    the workshop's dashboard to show, until a grading that runs clears it. A
    grade is never lost to the progress file: a file that cannot be written (or
    a broken one) is reported in one sentence and the grade stands.
    """
    from ..course import progress

    try:
        for e in result["exercises"]:
            if e.get("grader_error"):
                progress.record_grader_failure(e["module"], e["grader_error"])
            elif untouched(e):
                progress.clear_grader_failure(e["module"])
            else:
                failed = [{"check": c["name"], "message": c["message"], "hint": c["hint"]}
                          for c in e["checks"] if c["status"] != "passed"]
                progress.record_exercise(e["module"], e["score"], e["max_score"], failed)
    except (OSError, ValueError) as err:
        return f"(progress not recorded: {err})"
    return ""




def stop_all() -> None:
    """Kill every grading process running now (a kernel interrupt, a Ctrl-C of a class run)."""
    with _live_lock:
        for proc in list(_live):
            _kill_group(proc.pid)


def learners(root: str | os.PathLike) -> list[str]:
    """The learner folders of a class: the sub-folders of ``root``, sorted (hidden ones left out)."""
    return sorted(d.name for d in Path(root).iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def class_csv(results: dict[str, dict], exercise_ids: list[str]) -> str:
    """One row per learner: their score in each exercise, then the total.

    An exercise the grader could not run (:func:`grader_failed`) has no grade: its cell is empty, and so is that
    learner's total (a sum of the rest would read as a grade)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["learner", *exercise_ids, "total"])
    for name in sorted(results):
        scores = {e["exercise"]: "" if e.get("grader_error") else e["score"] for e in results[name]["exercises"]}
        total = "" if "" in scores.values() else results[name]["score"]
        writer.writerow([name, *(scores.get(i, 0) for i in exercise_ids), total])
    return out.getvalue()


def results_folder(out_csv: str | os.PathLike) -> Path:
    """Where class grading puts each learner's results JSON: ``grades.csv`` -> ``grades-results/``."""
    out = Path(out_csv)
    return out.with_name(out.stem + "-results")


def grade_class(root: str | os.PathLike, out_csv: str | os.PathLike, *, jobs: int = 1,
                timeout: float = DEFAULT_TIMEOUT_S, seed: int | None = None, memory_gb: float = DEFAULT_MEMORY_GB,
                exercises: list[str] | None = None, on_learner=None, hidden_paths: tuple[str, ...] = ()) -> dict:
    """Grade every learner folder in ``root``, ``jobs`` at a time; write the CSV and one JSON per learner.

    The same ``seed`` (the same inputs) for everyone. Each learner's files are
    copied before any learner code runs, and every learner is graded from the
    copy, with the class folder and the other copies hidden from their code; the
    results are written once everyone is graded, so nothing a learner's code
    does can touch another learner's files or grade. ``on_learner(name,
    result)`` is called as each learner is done; ``hidden_paths`` are more
    folders no learner's code may read (where the class's work lives). A learner with an exercise the grader
    could not run gets no results JSON (one left by an earlier run is removed) and empty cells in the CSV.
    Returns ``{"learners": {name: result}, "csv", "results_dir", "seed", "time_s", "not_graded": {name:
    [(module, why), ...]}}``, the last for the learners with such exercises only.
    """
    start = time.monotonic()
    names = learners(root)
    seed = secrets.randbelow(2**31) if seed is None else int(seed)
    ids = [catalog.resolve(e)[0] for e in exercises] if exercises else list(catalog.modules())
    out_dir = results_folder(out_csv)
    results: dict[str, dict] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    futures: dict = {}
    copies = Path(tempfile.mkdtemp(prefix="gpucourse-class-"))
    try:
        for n in names:
            (copies / n).mkdir()
            for f in (Path(root) / n).glob("*.py"):
                if f.is_file() and not f.is_symlink():  # a link could name a file only the grader may read
                    shutil.copyfile(f, copies / n / f.name)
        hidden = (str(Path(root).resolve()), str(copies), str(out_dir.resolve()), str(Path(out_csv).resolve()),
                  *map(str, hidden_paths))
        futures = {pool.submit(grade, copies / n, ids, timeout=timeout, seed=seed, memory_gb=memory_gb,
                               hidden_paths=hidden): n for n in names}
        for future in as_completed(futures):
            name = futures[future]
            # Messages name the learner's own folder, not the copy graded.
            text = json.dumps(future.result()).replace(json.dumps(str(copies))[1:-1], json.dumps(str(root))[1:-1])
            results[name] = json.loads(text)
            if on_learner:
                on_learner(name, results[name])
    except BaseException:
        for f in futures:
            f.cancel()
        stop_all()
        raise
    finally:
        pool.shutdown(wait=True)
        shutil.rmtree(copies, ignore_errors=True)
    out_dir.mkdir(exist_ok=True)
    not_graded = {name: grader_failures(result) for name, result in results.items() if grader_failures(result)}
    for name, result in results.items():
        if name in not_graded:
            (out_dir / f"{name}.json").unlink(missing_ok=True)
        else:
            write_atomic(out_dir / f"{name}.json", json.dumps(gradescope(result), indent=1))
    write_atomic(out_csv, class_csv(results, ids))
    return {"learners": results, "csv": str(out_csv), "results_dir": str(out_dir), "seed": seed,
            "time_s": round(time.monotonic() - start, 3), "not_graded": not_graded}
