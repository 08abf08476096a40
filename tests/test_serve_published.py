"""The serving model against published serving measurements (gpucourse.modeled.serve_published): every row cited and
set out in full, each modeled value recomputed from serve_plan, the table in docs/modeled-timing.md the function's
own, and where the model is off named."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from gpucourse.modeled import cluster, serve_published as sp
from gpucourse.modeled.serve_plan import decode_step, experts_touched, prefill
from gpucourse.modeled.shapes import get_shape

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "modeled-timing.md"
ROWS = sp.compare()
# The TensorRT-LLM and NIM rows' errors with every expert read and batch-1 matmuls timed as tiles (before the GEMV and
# routed-experts model), in RUNS' order.
BEFORE = (-0.0991, 0.0787, -0.0988, 0.0569, -0.0305, -0.0273, -0.1125, -0.0809, -0.1037, 0.2177, -0.0976, -0.0787,
          -0.0860, -0.1134)


@pytest.mark.parametrize("run", sp.RUNS, ids=lambda r: r.name)
def test_each_row_has_its_source_and_its_whole_setting(run):
    assert run.url.startswith("https://") and run.url in sp.SOURCES
    assert len(run.source) > 100 and any(mark in run.source for mark in ("v0.9.0", "version 1.8.0", "at commit"))
    assert run.metric in sp.METRICS and run.split in ("fit", "heldout") and run.reported > 0
    assert run.gpu in ("h100", "a100") and run.batch >= 1 and run.prompt >= 1 and run.output >= 1
    assert run.tp in (1, 2, 4, 8)
    assert get_shape(run.shape).name in ("llama2-7b", "llama2-70b", "llama3-70b", "mixtral-8x7b")
    setting = run.setting
    for part in (f"tp {run.tp}", f"batch {run.batch}", f"{run.prompt} in", f"{run.weights} weights"):
        assert part in setting, (part, setting)
    if run.metric != "first_token_s":
        assert f"{run.output} out" in setting


def test_the_table_is_split_by_a_rule_that_ignores_the_errors():
    """Within each source table the constant was fitted on, in the source's order, rows alternate fit, held-out,
    fit, …; gpt-fast's rows, added after the fit, are all held out."""
    tables = {}
    for run in sp.RUNS:
        tables.setdefault((run.url, run.metric, get_shape(run.shape).name if run.metric == "tpot_s" else ""),
                          []).append(run.split)
    for (url, *_), splits in tables.items():
        if url in (sp.GPT_FAST_URL, sp.GPT_FAST_MOE_URL):
            assert set(splits) == {"heldout"}
        else:
            assert splits == ["fit", "heldout"] * (len(splits) // 2)
    e = sp.errors(ROWS)
    assert e["fit_runs"] + e["heldout_runs"] == len(sp.RUNS) and 6 <= len(sp.RUNS) <= 30


def test_a_static_batch_is_its_prefill_and_every_decode_step_in_turn():
    """The mean context stands for the steps exactly: a step's cost is linear in its context."""
    run = next(r for r in sp.RUNS if r.metric == "output_tokens_per_s_per_gpu" and r.output == 128)
    first = prefill(run.shape, run.gpu, run.batch, run.prompt, run.tp, weights=run.weights)["first_token_s"]
    steps = sum(decode_step(run.shape, run.gpu, run.batch, run.prompt + j, run.tp, weights=run.weights,
                            kv=run.kv)["token_s"] for j in range(1, run.output))
    assert sp.modeled(run) == pytest.approx(run.batch * run.output / (first + steps) / run.tp, rel=1e-9)


@pytest.mark.parametrize("metric", ["tpot_s", "first_token_s", "tokens_per_s"])
def test_latency_rows_are_one_decode_step_or_one_prefill(metric):
    for run in (r for r in sp.RUNS if r.metric == metric):
        if metric == "tpot_s":
            want = decode_step(run.shape, run.gpu, run.batch, run.prompt + run.output / 2, run.tp,
                               weights=run.weights, kv=run.kv)["token_s"]
        elif metric == "tokens_per_s":  # one request: its prefill, then output − 1 steps, as gpt-fast times it
            first = prefill(run.shape, run.gpu, 1, run.prompt, run.tp, weights=run.weights)["first_token_s"]
            step = decode_step(run.shape, run.gpu, 1, run.prompt + run.output / 2, run.tp, weights=run.weights,
                               kv=run.kv)["token_s"]
            want = run.output / (first + (run.output - 1) * step)
        else:
            want = prefill(run.shape, run.gpu, run.batch, run.prompt, run.tp, weights=run.weights)["first_token_s"]
        assert sp.modeled(run) == want


def test_the_errors_are_the_rows_own():
    for row, run in zip(ROWS, sp.RUNS):
        assert row["error"] == (sp.modeled(run) - run.reported) / run.reported
    e = sp.errors(ROWS)
    assert e["max"] == max(abs(r["error"]) for r in ROWS)


def test_large_batches_are_close_and_a_cost_of_each_step_fitted_on_the_fitting_rows_brings_the_rest_in():
    """Throughput of static batches within 12 %; serve_plan's one serving constant (1.4 ms an iteration) is the value
    on a 0.1 ms grid that makes the largest fitting error smallest; without it every latency-bound row of
    TensorRT-LLM and NIM (one request's tokens, a 128-token prompt) came out 16-33 % too fast. The worst row is
    gpt-fast's Llama 2 7B on 8 A100s, 3 ms a token, of which the model's 1.4 ms an iteration is a large part."""
    from gpucourse.modeled import serve_plan

    assert all(abs(r["error"]) <= 0.12 for r in ROWS if r["metric"] == "output_tokens_per_s_per_gpu")
    e = sp.errors(ROWS)
    assert e["max"] <= 0.25 and e["worst"] == "Llama 2 7B, 8 A100 bf16, batch 1, gpt-fast"
    assert e["heldout_median"] <= 0.10 and serve_plan.STEP_OVERHEAD_S == 1.4e-3
    fitted = {}
    try:
        for tenths in range(31):
            serve_plan.STEP_OVERHEAD_S = tenths * 1e-4
            fitted[tenths] = sp.errors()["fit_max"]
    finally:
        serve_plan.STEP_OVERHEAD_S = 1.4e-3
    assert min(fitted, key=fitted.get) == 14
    bound = [r["name"] for r in ROWS if r["metric"] == "tpot_s" or (r["metric"] == "first_token_s"
                                                                     and "128 in" in r["setting"])]
    serve_plan.STEP_OVERHEAD_S = 0.0
    try:
        fitted_sources = [run for run in sp.RUNS if run.url in (sp.TRTLLM_URL, sp.NIM_URL)]
        without = {r["name"]: r for r in sp.compare(fitted_sources)}
        assert len(bound) == 4 and all(-0.33 <= without[n]["error"] <= -0.16 for n in bound)
        assert round(sp.errors(list(without.values()))["max"], 3) == 0.326
    finally:
        serve_plan.STEP_OVERHEAD_S = 1.4e-3


def test_the_docs_table_and_what_it_says_are_the_models():
    text = DOC.read_text()
    assert sp.markdown_table(ROWS) in text.split("## Serving")[1]
    flat = " ".join(text.split())
    e = sp.errors(ROWS)
    assert (f"The largest error is {e['max']:.1%} (`gpucourse bench`'s `serve_model_vs_published_max_error`, "
            f"target 30 %), the largest held-out error {e['heldout_max']:.1%} and the held-out median "
            f"{e['heldout_median']:.1%}; the largest fitting error is {e['fit_max']:.1%}") in flat
    assert "`serve_plan.STEP_OVERHEAD_S`, 1.4 ms an iteration" in flat
    mixtral = get_shape("mixtral-8x7b")
    touched = [round(experts_touched(mixtral, b), 1) for b in (1, 8, 32)]
    assert touched == [2.0, 7.2, 8.0] and "Mixtral's 2 of 8 at batch 1 (12.9 GB" in flat
    assert "7.2 at batch 8, all 8 by batch 32" in flat
    tp = decode_step("llama2-70b", "a100", 1, 105, 2)["token_s"] / decode_step("llama2-70b", "a100", 1, 105,
                                                                               8)["token_s"]
    h200 = decode_step("llama2-70b", "h100", 1, 2048, 8)["token_s"] / decode_step("llama2-70b", "h200", 1, 2048,
                                                                                 8)["token_s"]
    assert f"against gpt-fast's 2.93×; now {tp:.2f}×" in flat and f"now {h200:.2f}×, against 1.43×" in flat
    moved = [abs(r["error"] - e_old) for r, e_old in zip(ROWS, BEFORE)]
    assert round(max(moved) * 100, 1) == 1.2 and "moved by at most 1.2 points" in flat
    assert f"holds {len(sp.RUNS)} published serving measurements" in flat
    assert f"fitting set ({e['fit_runs']} rows) and the held-out set ({e['heldout_runs']})" in flat
    assert cluster.LAUNCH_S == 4e-6 and "The model also charges 4 µs for each of a block's 5 or 6 kernels" in flat
    shape = get_shape("llama2-70b")
    assert len([k for k in shape.kernels(1, 1, 2) if k["kind"] != "attention"]) == 5
    assert len(shape.kernels(128, 128, 1)) == 6


def test_the_docs_say_what_timing_every_step_at_the_window_did():
    from gpucourse.modeled.serve_plan import held

    run = next(r for r in sp.RUNS if r.name == "Llama 2 7B, H100 fp8, batch 56, 2048/2048")
    first = prefill(run.shape, "h100", 56, 2048, weights="fp8")["first_token_s"]
    window = decode_step(run.shape, "h100", 56, 4096, weights="fp8", kv="fp8")["token_s"]
    at_window = 56 * 2048 / (first + 2047 * window) / run.reported - 1
    row = next(r for r in ROWS if r["name"] == run.name)
    flat = " ".join(DOC.read_text().split())
    said = f"{at_window * 100:+.1f} % where the mean context gives {row['error'] * 100:+.1f} %".replace("-", "−")
    assert said == "−25.4 % where the mean context gives −6.9 %" and said in flat
    assert held(2048, 2048)["slots"] == 3080 and 1 - 3080 / 4096 == pytest.approx(0.248, abs=0.001)
    assert "a quarter fewer sequences than a paged cache holds (4,096 slots a request of 2048 / 2048 against 3,080)" \
        in flat


def test_the_docs_say_what_the_one_clock_changed():
    """The simulator's old clock, a line (4 ms an iteration, 20 µs a token fed, 0.16 µs a cached token read), against
    serve_plan.step, which serve-bench's modeled clock now is."""
    from gpucourse.modeled.serve_plan import Chunk, step

    def line(fed, read):
        return 4e-3 + 2e-5 * fed + 1.6e-7 * read

    one = decode_step(sp.LLAMA2_7B, "h100", 1, 200)["token_s"]
    old_chunks = sum(line(256, 256 * (i + 1)) for i in range(8)) / line(2048, 2048)
    whole = prefill(sp.LLAMA2_7B, "h100", 1, 2048)["first_token_s"]
    chunks = sum(step(sp.LLAMA2_7B, "h100", chunks=[Chunk(256, 256 * i, 1, i == 7)])["seconds"] for i in range(8))
    flat = " ".join(DOC.read_text().split())
    said = (f"it charged a step of one decode at 200 tokens {line(1, 201) * 1e3:.2f} ms where the model says "
            f"{one * 1e3:.2f}, and 8 chunks of 256 tokens {old_chunks:.2f} times one prefill of 2048")
    assert said == ("it charged a step of one decode at 200 tokens 4.05 ms where the model says 6.72, and 8 chunks of "
                    "256 tokens 1.64 times one prefill of 2048") and said in flat
    assert f"each chunk reads the chunks before it): {chunks / whole:.2f} times in all" in flat


def test_the_left_out_request_would_test_a_guess():
    """The 1.7 s batch-1 request (2048 in, 128 out) whose precision and layout its source does not state."""
    def request_s(weights):
        first = prefill("llama2-70b", "h100", 1, 2048, 8, weights=weights)["first_token_s"]
        return first + 127 * decode_step("llama2-70b", "h100", 1, 2048 + 64, 8, weights=weights, kv=weights)["token_s"]

    fp8, fp16 = request_s("fp8"), request_s("bf16")
    assert (round(fp8, 2), round(fp16, 2)) == (1.18, 1.60)
    assert round((fp8 - 1.7) / 1.7, 2) == -0.30 and round((fp16 - 1.7) / 1.7, 2) == -0.06
    flat = " ".join(DOC.read_text().split())
    assert "1.18 s (−30 %), with FP16 and tp 8 1.60 s (−6 %)" in flat
    assert "1.18 s" in sp.EXCLUDED[0][1] and "1.60 s" in sp.EXCLUDED[0][1]


def test_the_bench_figure_reports_the_largest_error_and_every_row():
    from gpucourse import bench

    fig = next(f for f in bench.FIGURES if f.key == "serve_model_vs_published_max_error")
    reading = fig.measure()
    assert fig.target == "<= 0.30" and reading.value == sp.errors(ROWS)["max"]
    assert set(reading.detail) == {r["name"] for r in ROWS}
    for r in ROWS:
        d = reading.detail[r["name"]]
        assert (d["published"], d["modeled"], d["setting"]) == (r["reported"], r["modeled"], r["setting"])
    assert reading.summary.startswith("modeled")


def test_a_row_on_another_gpu_is_timed_on_that_gpu():
    run = sp.RUNS[0]
    assert sp.modeled(dataclasses.replace(run, gpu="h200")) > sp.modeled(run)


def test_mixtral_at_batch_one_is_near_gpt_fasts_published_figure():
    """Mixtral 8x7B, 2 A100s, bf16, one request: 96.67 tokens/s published; reading every expert each step gave
    32.6 (−66 %), reading the two routed experts is within 25 %; every gpt-fast row within 25 %."""
    row = next(r for r in ROWS if r["name"] == "Mixtral 8x7B, 2 A100 bf16, batch 1, gpt-fast")
    assert row["reported"] == 96.67 and abs(row["error"]) <= 0.25
    gpt_fast = [r for r in ROWS if r["metric"] == "tokens_per_s"]
    assert len(gpt_fast) == 10 and all(abs(r["error"]) <= 0.25 and r["split"] == "heldout" for r in gpt_fast)
