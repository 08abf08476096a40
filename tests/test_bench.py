"""The bench's machinery: targets, turn-taking, the JSON it writes (atomically),
and each real figure run at the smallest size, checked for a positive finite
value. Timings themselves are not asserted: this box is too noisy for that."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpucourse import bench, cli

pytestmark = pytest.mark.usefixtures("no_leftover_children")

ENTRY_KEYS = {"value", "target", "passed", "detail"}


def fake(key, value, target="report"):
    return bench.Figure(key, target, lambda n: bench.Reading(value * n, {"n": n, "times_s": [0.1, 0.2]}, "fake"),
                        quick={"n": 1}, full={"n": 2})


def broken(n):
    raise RuntimeError("rank 1 failed: boom")


def interrupted(n):
    raise KeyboardInterrupt


# --- targets and turn-taking --------------------------------------------------------------------------------

@pytest.mark.parametrize("value, target, expected", [
    (1.0, "<= 1.0", True), (1.0999, "<= 1.10", True), (1.2, "<= 1.10", False), (0.5, ">= 1", False),
    (2.0, "report", None), (None, "<= 1.0", False), (math.nan, "<= 1.0", False), (math.inf, "<= 1.0", False),
])
def test_passed_compares_with_the_target(value, target, expected):
    assert bench.passed(value, target) is expected


@pytest.mark.parametrize("target", ["1.10", "=< 1.1", "<= many", "fast"])
def test_a_malformed_target_is_refused_at_registration(target):
    with pytest.raises(ValueError):
        bench.figure("x", target, quick={}, full={})


def test_interleave_takes_turns_abba():
    calls = []
    out = bench.interleave({"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or len(calls)},
                           reps=4)
    assert calls == list("abbaabba")
    assert out == {"a": [1, 4, 5, 8], "b": [2, 3, 6, 7]}


@pytest.mark.parametrize("a, b", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, math.inf)])
def test_ratio_refuses_what_is_not_a_positive_finite_ratio(a, b):
    with pytest.raises(ValueError):
        bench.ratio(a, b)


def test_the_figures_are_registered_with_their_targets():
    targets = {f.key: f.target for f in bench.FIGURES}
    assert targets["dp_scratch_vs_ddp"] == "report"
    assert targets["launch_vs_notebook_launcher"] == "<= 0.8"
    assert targets["recording_overhead"] == "<= 1.03"
    issue_targets = {"dp_bucketed_vs_ddp": "<= 1.10", "pp_1f1b_scratch_vs_torch": "<= 1.20",
                     "tp_scratch_vs_torch": "<= 1.20", "pp_bubble_measured_vs_simulated": "0.8..1.25",
                     "zero_memory_vs_formula": "== 1.0", "memory_estimate_vs_measured": "== 1.0",
                     "live_view_overhead": "<= 1.03", "checkpointing_activation_ratio": "report",
                     "selective_activation_ratio": "report",
                     "allreduce_busbw_vs_copy": "report", "tour_quick_s": "report",
                     "course_smoke_s": "< 600", "first_check_s": "<= 8", "grade_one_exercise_s": "<= 5",
                     "zero3_memory_vs_formula": "== 1.0", "zero3_scratch_vs_fsdp2": "<= 1.3",
                     "fsdp_tp_vs_scratch_dp_tp": "report", "fsdp_module_vs_torch_fsdp2": "report",
                     "fsdp_peak_memory_vs_estimate": "<= 1.1",
                     "published_layouts_fit": "== 1.0",
                     "sp_activation_ratio": "== 0.5",
                     "cp_zigzag_imbalance": "<= 1.15", "cp_ring_vs_allgather": "report",
                     "cp_scratch_vs_torch": "<= 1.20",
                     "model_vs_published_max_error": "<= 0.30", "naive_idle_measured_vs_formula": "0.8..1.1",
                     "replay_s_per_1k_ops": "report", "pp_interleaved_bubble_vs_formula": "== 1.0",
                     "pp_zb_vs_1f1b_idle": "report", "pp_interleaved_scratch_vs_torch": "<= 1.20",
                     "quiz_best_heuristic_accuracy": "<= 0.35", "kv_cache_decode_speedup": "report",
                     "continuous_vs_static_throughput": ">= 1.5", "paged_kv_waste": "report",
                     "serve_model_vs_published_max_error": "<= 0.30", "grader_mutation_score": ">= 0.95",
                     "model_heldout_max_error": "<= 0.20", "model_heldout_median_error": "<= 0.08",
                     "model_heldout_max_error_b200_fp8": "<= 0.20", "serve_model_heldout_median_error": "<= 0.10",
                     "serve_model_heldout_max_error": "<= 0.30", "serve_model_fit_max_error": "report"}
    assert {k: targets[k] for k in issue_targets} == issue_targets
    for f in bench.FIGURES:
        bench.parse_target(f.target)  # every target parses


def test_range_and_equality_targets():
    assert bench.passed(0.9, "0.8..1.25") and not bench.passed(1.3, "0.8..1.25") and not bench.passed(0.7, "0.8..1.25")
    assert bench.passed(1.0, "== 1.0") and not bench.passed(1.0000001, "== 1.0")


# --- the suite and its JSON --------------------------------------------------------------------------------

def test_main_writes_one_entry_per_figure_and_the_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "FIGURES", [fake("ok_ratio", 0.9, "<= 1.0"), fake("too_slow", 1.5, "<= 1.10"),
                                           fake("shown", 2.0), bench.Figure("broken", "<= 1.0", broken, {"n": 1},
                                                                            {"n": 1})])
    written = []
    real_write = bench.write_atomic
    monkeypatch.setattr(bench, "write_atomic", lambda path, data: (written.append(path), real_write(path, data)))
    path = tmp_path / "bench.json"

    results = bench.main(quick=True, json_path=str(path))

    assert written == [str(path)], "the JSON must go through measure.write_atomic"
    assert os.listdir(tmp_path) == ["bench.json"], "no temporary file may be left behind"
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert set(results) == {"ok_ratio", "too_slow", "shown", "broken", "machine"}
    for key in ("ok_ratio", "too_slow", "shown", "broken"):
        assert set(results[key]) == ENTRY_KEYS
    assert results["ok_ratio"]["value"] == 0.9 and results["ok_ratio"]["passed"] is True
    assert results["too_slow"]["passed"] is False
    assert results["shown"]["passed"] is None and results["shown"]["target"] == "report"
    assert results["shown"]["detail"]["times_s"] == [0.1, 0.2]
    assert results["broken"]["value"] is None and results["broken"]["passed"] is False
    assert "boom" in results["broken"]["detail"]["error"]
    machine = results["machine"]
    assert machine["torch"] == torch.__version__ and machine["device"] in ("cpu", "cuda")
    assert machine["cpu_count"] == os.cpu_count() and machine["suite"] == "quick"

    table = capsys.readouterr().out
    for key, result in (("ok_ratio", "pass"), ("too_slow", "FAIL"), ("shown", "report"), ("broken", "error")):
        line = next(line for line in table.splitlines() if line.startswith(key))
        assert result in line.split()


def test_quick_and_full_pass_their_own_sizes(monkeypatch):
    monkeypatch.setattr(bench, "FIGURES", [fake("f", 1.0)])
    assert bench.main(quick=True)["f"]["detail"]["n"] == 1
    assert bench.main(quick=False)["f"]["detail"]["n"] == 2


def test_an_interrupted_bench_leaves_the_previous_file_alone(tmp_path, monkeypatch):
    path = tmp_path / "bench.json"
    path.write_text('{"previous": true}')
    monkeypatch.setattr(bench, "FIGURES", [fake("first", 1.0), bench.Figure("stop", "report", interrupted,
                                                                            {"n": 1}, {"n": 1})])
    with pytest.raises(KeyboardInterrupt):
        bench.main(quick=True, json_path=str(path))
    assert path.read_text() == '{"previous": true}'
    assert os.listdir(tmp_path) == ["bench.json"]


def test_the_cli_runs_the_suite_and_writes_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "FIGURES", [fake("f", 1.25)])
    path = tmp_path / "out.json"
    assert cli.main(["bench", "--quick", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["f"]["value"] == 1.25
    assert "f" in capsys.readouterr().out


def test_only_measures_the_figures_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "FIGURES", [fake("a", 1.0), fake("b", 2.0), fake("c", 3.0)])
    path = tmp_path / "out.json"
    assert cli.main(["bench", "--quick", "--only", "c,a", "--json", str(path)]) == 0
    assert set(json.loads(path.read_text())) == {"a", "c", "machine"}
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:3]] == ["a", "c"]


def test_only_refuses_an_unknown_figure_before_measuring_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "FIGURES", [fake("a", 1.0), bench.Figure("stop", "report", interrupted, {"n": 1}, {"n": 1})])
    path = tmp_path / "out.json"
    assert cli.main(["bench", "--only", "a,nope", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no figure called nope; the figures are: a, stop." in err and len(err.strip().splitlines()) == 1
    assert not path.exists()


# --- the real figures, at their smallest ---------------------------------------------------------------------

SMALLEST = {
    "dp_scratch_vs_ddp": {"reps": 1, "steps": bench.WARMUP_STEPS + 2},
    "recording_overhead": {"reps": 1, "steps": bench.WARMUP_STEPS + 2},
    "launch_vs_notebook_launcher": {"reps": 1},
    "kv_cache_decode_speedup": {"reps": 1, "new_tokens": 8},
    "continuous_vs_static_throughput": {"requests": 48},
    "paged_kv_waste": {"requests": 48},
    "serve_model_vs_published_max_error": {},
    "serve_model_heldout_median_error": {},
    "serve_model_heldout_max_error": {},
    "serve_model_fit_max_error": {},
    "model_heldout_max_error_b200_fp8": {},
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", sorted(SMALLEST))
def test_each_real_figure_measures_a_positive_finite_ratio(key):
    fig = next(f for f in bench.FIGURES if f.key == key)
    bench.preimport()
    entry = bench.measure(dataclasses.replace(fig, quick=SMALLEST[key]), quick=True)
    assert set(entry) == ENTRY_KEYS
    assert "error" not in entry["detail"], entry["detail"].get("error")
    assert isinstance(entry["value"], float) and math.isfinite(entry["value"]) and entry["value"] > 0
    assert entry["passed"] is bench.passed(entry["value"], fig.target)
    json.dumps(entry, allow_nan=False)  # plain, finite data all the way down
    assert not torch.cuda.is_initialized(), "the bench initialised CUDA in the launching process"


@pytest.mark.timeout(120)
def test_a_fully_sharded_step_holds_what_the_estimate_says():
    """At a short batch the weights, gradients and Adam's moments weigh most: FullyShardedDataParallel keeping every
    whole gradient until the end of backward (each waiting on its reduce-scatter) measured 1.72 times the estimate
    here. The reading is each rank's measured peak over its estimate."""
    from gpucourse.bench import memory_figures
    from gpucourse.modeled.memory import estimate

    reading = memory_figures.fsdp_peak_memory_vs_estimate(shapes=((1, 16),), steps=2)
    want = sum(estimate(memory_figures.fsdp_estimate_config(1, 16))["per_rank"][0].values())
    for key, peak in reading.detail["peaks"].items():
        assert peak["measured"]["total"] / want == reading.detail["ratios"][key] <= reading.value <= 1.1
        assert peak["measured"]["optimizer"] > 0, "Adam's moments, made by the first step, are counted"


def test_the_figures_sides_are_the_same_work():
    # The two sides of a ratio differ in exactly the thing measured.
    configs = {"dp_scratch_vs_ddp": ("impl", "scratch", "torch"), "recording_overhead": ("record", True, False)}
    for key, (name, a, b) in configs.items():
        ca, cb = (bench.harness.bench_config(**{name: value}).to_dict() for value in (a, b))
        assert {k for k in ca if ca[k] != cb[k]} == {name}, key


def test_importing_the_bench_needs_torch_alone():
    # A bare GPU node or a cluster job runs the bench: accelerate is imported by its figure, when it runs.
    code = ("import sys, gpucourse.bench; "
            "print(sorted(m for m in ('accelerate', 'plotly', 'ipywidgets', 'jupyterlab') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"


# --- the pipeline bubble: what a run's timeline is read as -----------------------------------------------------

def _timeline_of(sim, async_sends: bool, step: int) -> list[dict]:
    """The spans a run would record had it gone exactly as ``sim`` laid it out, one step: compute ops as forward and
    backward spans, each transfer as a comm span from the moment its rank reached it (asynchronous: a send posted
    and waited for at once, a receive posted and waited for when reached)."""
    from gpucourse.parallel.schedules import COMPUTE, F, PEER, SEND_B, SEND_F, W

    spans = []
    for stage, row in enumerate(sim.timeline):
        reached = 0.0
        for op, start, end in row:
            base = {"rank": stage, "step": step, "microbatch": op.microbatch, "start_s": reached, "end_s": end}
            if op.kind in COMPUTE:
                base["start_s"] = start
                kind = "forward" if op.kind == F else "backward"
                spans.append({**base, "kind": kind, "name": f"weights {op}" if op.kind == W else kind})
            else:
                sends = op.kind in (SEND_F, SEND_B)
                peer = stage + PEER[op.kind]
                spans.append({**base, "kind": "comm", "name": f"{'send' if sends else 'recv'} {op}",
                              "op": "send" if sends else "recv", "peer": peer, "group": [0, 1], "bytes": 4,
                              **({"waited_s": reached} if async_sends else {})})
            reached = end
    return spans


@pytest.mark.parametrize("name", ["gpipe", "zb-h1"])
def test_a_run_that_went_as_simulated_measures_the_simulators_bubble_and_costs(name):
    from types import SimpleNamespace

    from gpucourse.measure import note_waits
    from gpucourse.parallel import schedules, schedules_virtual

    pp, m, comm = 2, 4, 0.25
    config = {"schedule": name, "pp": pp, "microbatches": m, "virtual_stages": 1}
    if name in schedules.SCHEDULES:
        sim = schedules.simulate(schedules.build(name, pp, m), pp, m, cost_f=[1, 1.5], cost_b=[2, 3], cost_comm=comm)
    else:
        ops, layout = schedules_virtual.build(name, pp, m, 1)
        sim = schedules_virtual.simulate(ops, layout, m, cost_f=[1, 1.5], cost_b=[1, 2], cost_w=[1, 1],
                                         cost_comm=comm)
    timeline = _timeline_of(sim, async_sends=name not in schedules.SCHEDULES, step=bench.WARMUP_STEPS)
    note_waits(timeline)
    result = SimpleNamespace(config=config, extras={"stage_of_rank": {"0": 0, "1": 1}}, timeline=timeline,
                             losses=[0.0] * (bench.WARMUP_STEPS + 1))
    measured, cost = bench.parallel_figures.measured_bubble(result)
    assert measured == pytest.approx(sim.bubble_fraction)
    assert cost["comm"] == pytest.approx(comm)  # each message's time from when both sides were there
    assert cost["ops"] == [[[pytest.approx(b - a) for op, a, b in row if op.kind in ("F", "B", "W")]
                            for row in sim.timeline]]  # one steady step
    assert bench.parallel_figures.simulated_bubble(config, cost) == pytest.approx(sim.bubble_fraction)


def test_the_model_figures_are_the_published_tables_own():
    """Each model figure the bench reports is recomputed here from gpucourse.modeled.published's table."""
    from gpucourse.modeled import published

    rows = published.compare()
    held = sorted(abs(r["error"]) for r in rows if r["split"] == "heldout")
    want = {"model_fit_max_error": max(abs(r["error"]) for r in rows if r["split"] == "fit"),
            "model_heldout_max_error": held[-1], "model_heldout_median_error": published.statistics.median(held),
            "model_heldout_max_error_b200_fp8": max(abs(r["error"]) for r in rows if r["split"] == "heldout"
                                                    and r["gpu"] == "b200" and r["fp8"])}
    for key, value in want.items():
        reading = next(f for f in bench.FIGURES if f.key == key).measure()
        assert reading.value == value, key


def test_the_serve_model_figures_are_the_published_serving_tables_own():
    """Each serving-model figure the bench reports is recomputed here from gpucourse.modeled.serve_published's table:
    the held-out median and largest error over the held-out rows only, the largest fitting error beside them."""
    from gpucourse.modeled import serve_published

    rows = serve_published.compare()
    held = sorted(abs(r["error"]) for r in rows if r["split"] == "heldout")
    want = {"serve_model_heldout_median_error": serve_published.statistics.median(held),
            "serve_model_heldout_max_error": held[-1],
            "serve_model_fit_max_error": max(abs(r["error"]) for r in rows if r["split"] == "fit"),
            "serve_model_vs_published_max_error": max(abs(r["error"]) for r in rows)}
    for key, value in want.items():
        fig = next(f for f in bench.FIGURES if f.key == key)
        reading = fig.measure()
        assert reading.value == value, key
        assert reading.summary.startswith("modeled")
        if key != "serve_model_vs_published_max_error":
            split = "fit" if key == "serve_model_fit_max_error" else "heldout"
            assert set(reading.detail) == {r["name"] for r in rows if r["split"] == split}
