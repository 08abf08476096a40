"""Figures of the course around the strategies: bandwidth on this host, grading, the live view, the tour and the
notebooks' smoke run, and how fast ranks start."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..runtime import launch
from ..runtime.launcher import plan_device
from ..train import run
from ..course.readings import WARMUP_STEPS, Reading, figure, interleave, ratio
from .harness import RANKS, RUN_TIMEOUT_S


@figure("allreduce_busbw_vs_copy", quick=dict(reps=2), full=dict(reps=5))
def allreduce_busbw_vs_copy(reps: int) -> Reading:
    """All-reduce bus bandwidth at 64 MB on 2 ranks over a same-size memory copy: the ceiling on one host."""
    from ..course.bandwidth import allreduce_busbw_vs_copy as measure_busbw

    return measure_busbw(reps=reps)


@figure("grade_one_exercise_s", target="<= 5", quick=dict(), full=dict())
def grade_one_exercise_s() -> Reading:
    """Wall time to grade one distributed exercise (ex01, ring all-reduce, 1–3 CPU ranks)."""
    from ..grading import time_grade_one_exercise

    wall = time_grade_one_exercise(exercise="ex01")
    return Reading(wall, {"exercise": "ex01"}, f"{wall:.1f} s for ex01")


@figure("grade_class_20_s", quick=dict(learners=4), full=dict(learners=20))
def grade_class_20_s(learners: int) -> Reading:
    """Wall time to grade a class of 20 copies of solutions/ with --jobs 2 (quick: 4 learners, scaled to 20)."""
    from ..grading import time_grade_class

    wall = time_grade_class(learners=learners, jobs=2)
    value = wall * 20 / learners
    return Reading(value, {"learners_graded": learners, "wall_s": wall},
                   f"{value:.0f} s for 20" + (f" (scaled from {learners} in {wall:.0f} s)" if learners != 20 else ""))


@figure("grader_mutation_score", target=">= 0.95", quick=dict(exercises=("ex14", "ex07")), full=dict(exercises=()))
def grader_mutation_score(exercises: tuple[str, ...]) -> Reading:
    """Of every single-point mutant of the solutions, the share the checks catch, equivalent ones left out
    (gpucourse.grading.mutation; scripts/mutation-score says which survive). Quick: two exercises; full: all."""
    from ..grading.mutation import score

    results = score(list(exercises) or None)
    caught = sum(r["caught"] for r in results.values())
    judged = sum(r["total"] - r["equivalent"] - r["not_graded"] for r in results.values())
    detail = {ex: {**{k: r[k] for k in ("total", "caught", "equivalent", "surviving", "not_graded", "score",
                                        "time_s")},
                   "survivors": [f"{s['id']} {s['description']}" for s in r["survivors"]]}
              for ex, r in results.items()}
    return Reading(caught / judged, detail, f"{caught} of {judged} mutants caught in {', '.join(results)} "
                                            f"({sum(r['equivalent'] for r in results.values())} equivalent left out)")


@figure("live_view_overhead", target="<= 1.03", quick=dict(reps=3, steps=20), full=dict(reps=8, steps=60))
def live_view_overhead(reps: int, steps: int, interval_s: float = 0.75) -> Reading:
    """Step time with the notebook's live view on over off.

    Both sides train the bench's layout (tiny GPT, 2 data-parallel ranks, 16
    sequences a step), taking turns. The live side draws into a sink that
    serialises every bundle to JSON, as the kernel would before sending it,
    so the cost is measured in plain python too.
    """
    from ..viz.live import LiveView

    config = TrainConfig(model="tiny", dp=RANKS, batch_size=16, steps=steps)
    sent = []

    def side(live: bool) -> list[float]:
        view = LiveView(config, interval_s=interval_s, sink=lambda b: sent.append(len(json.dumps(b)))) if live else None
        result = run(config, timeout=RUN_TIMEOUT_S, quiet=True, on_step=view.on_step if view else None,
                     on_message=view.on_message if view else None)
        if view:
            view.finish(result)
        return result.step_times_s[WARMUP_STEPS:]

    times = interleave({"live": lambda: side(True), "off": lambda: side(False)}, reps)
    med = {k: statistics.median(t for run_times in v for t in run_times) for k, v in times.items()}
    detail = {"reps": reps, "steps": steps, "interval_s": interval_s, "warmup_steps": WARMUP_STEPS,
              "median_step_s": med, "step_times_s": times, "bundles_sent": len(sent)}
    return Reading(ratio(med["live"], med["off"]), detail,
                   f"live {med['live'] * 1e3:.2f} ms, off {med['off'] * 1e3:.2f} ms per step, "
                   f"{len(sent)} redraws")


@figure("tour_quick_s", quick=dict(), full=dict())
def tour_quick_s() -> Reading:
    """Wall time of ``gpucourse tour --quick`` (every layout, checked against one device) on this machine."""
    from ..course import tour

    out = tempfile.mkdtemp(prefix="gpucourse-tour-")
    try:
        start = time.perf_counter()
        code = tour.main(quick=True, out=os.path.join(out, "report.html"))
        wall = time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return Reading(wall, {"exit_code": code}, f"{wall:.1f} s, exit code {code}")


@figure("course_smoke_s", target="< 600", quick=dict(), full=dict())
def course_smoke_s() -> Reading:
    """Wall time to execute every notebook in smoke mode (GPUCOURSE_SMOKE=1), one fresh kernel each."""
    from ..course import lab

    start = time.perf_counter()
    seconds = lab.run_course(smoke=True, stream=sys.stdout)
    wall = time.perf_counter() - start
    slowest = max(seconds, key=seconds.get)
    return Reading(wall, {"notebooks_s": seconds},
                   f"{wall:.0f} s for {len(seconds)} notebooks; slowest {slowest} {seconds[slowest]:.0f} s")


@figure("first_check_s", target="<= 8", quick=dict(), full=dict())
def first_check_s() -> Reading:
    """From the course's JupyterLab being up to ``check("ex01")`` answering in notebook 01, in headless Chromium
    (started first: a learner's browser is open before the lab is)."""
    from ..course import lab

    with tempfile.TemporaryDirectory(prefix="gpucourse-lab-") as tmp:
        root = lab.course_copy(tmp)
        env = {"GPUCOURSE_SMOKE": "1", "GPUCOURSE_PROGRESS": os.path.join(tmp, "progress.json")}
        with lab.Browser() as browser, lab.LabServer(root, env=env) as server:
            found = lab.first_check(server, browser)
    if "/ 10" not in found["text"]:
        raise RuntimeError(f"check('ex01') showed no score: {found['text'][:300]!r}")
    return Reading(found["seconds"], {"cell_s": found["cell_s"]},
                   f"{found['seconds']:.1f} s, of which the check cell {found['cell_s']:.1f} s")


# What launch_vs_notebook_launcher times, from the call: until the slowest rank
# entered the function, until it ended its first step, until the call returned.
LAUNCH_TIMES = ("entered_s", "first_step_s", "returned_s")


# --- launching ranks -------------------------------------------------------------------


def first_step(out_dir: str, device_type: str) -> None:
    """One data-parallel training step of the tiny GPT; write when it began and ended to ``out_dir``.

    Both launchers start this same function. It does what a learner's first
    cell does: build the model and AdamW, run forward and backward on this
    rank's shard of the batch, average the gradients with all-reduce, step.
    Under ``gpucourse.launch`` the process group is already up; under
    ``accelerate.notebook_launcher`` only the environment is (MASTER_ADDR,
    RANK, WORLD_SIZE …), so the function joins the group itself, and leaves it.
    """
    entered = time.time()  # wall clock: comparable across processes
    from .. import data
    from ..model import MODELS, build_model, loss_fn
    from ..optim import make_optimizer

    torch.set_num_threads(1)  # what gpucourse's launcher does in each forked rank
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
        model = build_model(MODELS["tiny"], seed=0).to(device)
        optimizer = make_optimizer(model.parameters(), lr=3e-3)
        x, y = data.rank_batch(0, 8, 64, 0, rank, world)
        loss_fn(model(x.to(device)), y.to(device)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        with open(os.path.join(out_dir, f"step-{rank}.json"), "w") as f:
            json.dump({"entered": entered, "ended": time.time()}, f)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_launch(start: Callable[[str], None]) -> dict:
    """Seconds from calling ``start(out_dir)`` until the slowest rank entered the function,
    until it ended its first step, and until ``start`` returned."""
    out_dir = tempfile.mkdtemp(prefix="gpucourse-bench-")
    try:
        t0 = time.time()
        start(out_dir)
        returned = time.time() - t0
        ranks = []
        for path in glob.glob(os.path.join(out_dir, "step-*.json")):
            with open(path) as f:
                ranks.append(json.load(f))
        if len(ranks) != RANKS:
            raise RuntimeError(f"{len(ranks)} of {RANKS} ranks finished their first step.")
        return {"entered_s": max(r["entered"] for r in ranks) - t0,
                "first_step_s": max(r["ended"] for r in ranks) - t0, "returned_s": returned}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def launcher_kernel(side: str, device_type: str) -> None:
    """A notebook kernel that starts ranks with one launcher only (``side``: "ours" or "accelerate"), as a learner's
    would: for each line on stdin, one launch of :func:`first_step` and a line ``times {...}`` on stdout.

    Each launcher gets a kernel of its own, so neither inherits what the other's launches left in the kernel.
    Both kernels have imported ``torch._dynamo`` as one that has built an optimizer has; ours also builds what
    its launcher builds before forking (``preimport``), accelerate's what ``notebook_launcher`` does.
    """
    import torch._dynamo  # noqa: F401

    if side == "ours":
        def start(out_dir):
            launch(first_step, out_dir, device_type, world_size=RANKS, device=device_type, timeout=RUN_TIMEOUT_S,
                   quiet=True)
    else:
        from accelerate import notebook_launcher

        def start(out_dir):
            # Its default port 29500 would collide with any other run; it also prints a banner.
            with contextlib.redirect_stdout(io.StringIO()):
                notebook_launcher(first_step, args=(out_dir, device_type), num_processes=RANKS,
                                  use_port=str(_free_port()))
    for _ in sys.stdin:
        # The ranks write to this process's stdout too (their output, teed): the answer is the line marked so.
        print("times " + json.dumps(_time_launch(start)), flush=True)


class _Kernel:
    """A :func:`launcher_kernel` in its own process; ``launch()`` asks it for one launch and returns its times."""

    def __init__(self, side: str, device_type: str):
        code = "import sys; from gpucourse.bench.course_figures import launcher_kernel; launcher_kernel(*sys.argv[1:])"
        self.process = subprocess.Popen([sys.executable, "-c", code, side, device_type], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def launch(self) -> dict:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("times "):
                return json.loads(line[len("times "):])
        raise RuntimeError(f"the launcher's kernel ended (exit code {self.process.wait()}) without an answer.")

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@figure("launch_vs_notebook_launcher", target="<= 0.8", quick=dict(reps=5), full=dict(reps=15))
def launch_vs_notebook_launcher(reps: int) -> Reading:
    """Call-to-first-step time of a re-run with ``gpucourse.launch`` over ``accelerate.notebook_launcher``, 2 ranks,
    each launcher in a kernel of its own."""
    device_type = plan_device("auto", RANKS).device
    kernels = {side: _Kernel(side, device_type) for side in ("ours", "accelerate")}
    try:
        sides = {side: kernel.launch for side, kernel in kernels.items()}
        interleave(sides, 1)  # untimed: the first launch in a kernel imports the elastic agent; the rest are re-runs
        times = interleave(sides, reps)
    finally:
        for kernel in kernels.values():
            kernel.close()
    med = {side: {k: statistics.median(t[k] for t in ts) for k in LAUNCH_TIMES} for side, ts in times.items()}
    detail = {side: {**{f"median_{k}": med[side][k] for k in LAUNCH_TIMES},
                     **{k: [t[k] for t in ts] for k in LAUNCH_TIMES}}
              for side, ts in times.items()}
    detail.update(reps=reps, device=device_type, ranks=RANKS)
    return Reading(ratio(med["ours"]["first_step_s"], med["accelerate"]["first_step_s"]), detail,
                   f"ours {med['ours']['first_step_s']:.3f} s, accelerate {med['accelerate']['first_step_s']:.3f} s "
                   f"to the first step (of which to enter the function: {med['ours']['entered_s']:.3f} s, "
                   f"{med['accelerate']['entered_s']:.3f} s)")
