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
FITTED_SOURCES = (sp.TRTLLM_URL, sp.NIM_URL)  # the tables serve_plan's constant was fitted on (alternate rows)
GPT_FAST_URLS = (sp.GPT_FAST_URL, sp.GPT_FAST_MOE_URL)
# The 24 rows the table held before LMDeploy's, the H200 blogs' and gpt-fast's quantized rows were added.
FIRST = [r for r in ROWS
         if r["url"] in FITTED_SOURCES or (r["url"] in GPT_FAST_URLS and "bf16 weights" in r["setting"])]
FIT = ("Llama 2 70B, H100 fp8, batch 1024, 128/128", "Llama 2 70B, H100 fp8, batch 96, 2048/128",
       "Llama 2 7B, H100 fp8, batch 896, 128/128", "Llama 2 7B, H100 fp8, batch 84, 2048/128",
       "Llama 2 7B, H100 fp8, first token of 128", "Llama 2 70B, H100 fp8, first token of 128",
       "Llama 3.3 70B, 2 H100 fp8, concurrency 1, 5000/500")
# The TensorRT-LLM and NIM rows' errors with every expert read and batch-1 matmuls timed as tiles (before the GEMV and
# routed-experts model), in RUNS' order.
BEFORE = (-0.0991, 0.0787, -0.0988, 0.0569, -0.0305, -0.0273, -0.1125, -0.0809, -0.1037, 0.2177, -0.0976, -0.0787,
          -0.0860, -0.1134)


@pytest.mark.parametrize("run", sp.RUNS, ids=lambda r: r.name)
def test_each_row_has_its_source_and_its_whole_setting(run):
    assert run.url.startswith("https://") and run.url in sp.SOURCES
    assert len(run.source) > 100 and any(mark in run.source for mark in ("v0.9.0", "version 1.8.0", "at commit"))
    assert run.metric in sp.METRICS and run.split in ("fit", "heldout") and run.reported > 0
    assert run.gpu in ("h100", "h200", "a100") and run.batch >= 1 and run.prompt >= 1 and run.output >= 1
    assert run.tp in (1, 2, 4, 8)
    assert get_shape(run.shape).name in ("llama2-7b", "llama2-70b", "llama3-70b", "mixtral-8x7b", "gpt-j-6b")
    setting = run.setting
    for part in (f"tp {run.tp}", f"batch {run.batch}", f"{run.prompt} in", f"{run.weights} weights"):
        assert part in setting, (part, setting)
    if run.metric != "first_token_s":
        assert f"{run.output} out" in setting


def test_the_table_is_split_by_a_rule_that_ignores_the_errors():
    """Within each source table the constant was fitted on, in the source's order, rows alternate fit, held-out,
    fit, …; every row of a source added after the fit (gpt-fast, LMDeploy, the H200 blogs) is held out."""
    tables = {}
    for run in sp.RUNS:
        tables.setdefault((run.url, run.metric, get_shape(run.shape).name if run.metric == "tpot_s" else ""),
                          []).append(run.split)
    for (url, *_), splits in tables.items():
        if url in FITTED_SOURCES:
            assert splits == ["fit", "heldout"] * (len(splits) // 2)
        else:
            assert set(splits) == {"heldout"}
    e = sp.errors(ROWS)
    assert e["fit_runs"] + e["heldout_runs"] == len(sp.RUNS) and e["fit_runs"] == 7


def test_the_table_has_thirty_rows_from_five_sources_across_gpus_models_formats_and_metrics():
    """At least 30 rows from at least 5 sources: A100, H100 and H200; dense models and a mixture of experts; FP8
    and INT4 (and INT8) weights; a static batch's throughput, one request's tokens, a time per output token and a
    first token. The fitting rows are the 7 they were when the constant was fitted: nothing added moved the split."""
    assert len(sp.RUNS) >= 30 and len({r.name for r in sp.RUNS}) == len(sp.RUNS)
    assert len({sp.SOURCES[r.url] for r in sp.RUNS}) >= 5
    assert {"a100", "h100", "h200"} <= {r.gpu for r in sp.RUNS}
    assert any(get_shape(r.shape).experts for r in sp.RUNS) and any(not get_shape(r.shape).experts for r in sp.RUNS)
    assert {"fp8", "bf16", *sp.GPT_FAST_FORMATS.values()} <= {r.weights for r in sp.RUNS}
    assert {r.metric for r in sp.RUNS} == set(sp.METRICS)
    assert tuple(r.name for r in sp.RUNS if r.split == "fit") == FIT
    assert all(r.url in FITTED_SOURCES for r in sp.RUNS if r.split == "fit")
    assert len(FIRST) == 24 and sum(r["split"] == "heldout" for r in FIRST) == 17


def test_the_blog_rows_are_kept_by_what_an_unstated_kv_cache_moves_not_by_their_error():
    """No TensorRT-LLM blog says whether its KV cache was FP8: a row is kept where a bf16 cache moves its modeled
    figure by at most 5 %, left out (EXCLUDED) where it moves it more; every blog row of RUNS either passes or does
    not read a cache (a first token)."""
    moves = {r.name: sp.kv_moves(r) for r in sp.KV_UNSTATED}
    kept = {name for name, m in moves.items() if m <= sp.KV_UNSTATED_MOVES}
    blogs = {sp.H200_LAUNCH_URL, sp.H200_FALCON_URL, sp.H100_A100_URL}
    fp8_blog_rows = [r for r in sp.RUNS if r.url in blogs and r.weights == "fp8"]
    assert kept == set(sp.KV_KEPT) == {r.name for r in fp8_blog_rows if r.metric != "first_token_s"}
    assert all(sp.kv_moves(r) == 0 for r in fp8_blog_rows if r.metric == "first_token_s")
    left = sorted(m for name, m in moves.items() if name not in kept)
    assert len(left) == 7 and (round(left[0] * 100), round(left[-1] * 100)) == (14, 41)
    assert "14 to 41 %" in " ".join(why for _, why in sp.EXCLUDED)
    assert "moves their modeled figure by 14 to 41 %" in " ".join(DOC.read_text().split())
    assert max(moves[name] for name in kept) < 0.032


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
        elif metric == "tokens_per_s":  # a static batch: its prefill, then output − 1 steps, as gpt-fast times it
            first = prefill(run.shape, run.gpu, run.batch, run.prompt, run.tp, weights=run.weights)["first_token_s"]
            step = decode_step(run.shape, run.gpu, run.batch, run.prompt + run.output / 2, run.tp,
                               weights=run.weights, kv=run.kv)["token_s"]
            want = run.batch * run.output / (first + (run.output - 1) * step)
            assert sp.modeled(run) == pytest.approx(want, rel=1e-9)
            continue
        else:
            want = prefill(run.shape, run.gpu, run.batch, run.prompt, run.tp, weights=run.weights)["first_token_s"]
        assert sp.modeled(run) == want


def test_the_errors_are_the_rows_own():
    for row, run in zip(ROWS, sp.RUNS):
        assert row["error"] == (sp.modeled(run) - run.reported) / run.reported
    e = sp.errors(ROWS)
    assert e["max"] == max(abs(r["error"]) for r in ROWS)


def test_large_batches_are_close_and_a_cost_of_each_step_fitted_on_the_fitting_rows_brings_the_rest_in():
    """TensorRT-LLM v0.9.0's static batches within 12 %; serve_plan's one serving constant (1.4 ms an iteration) is
    the value on a 0.1 ms grid that makes the largest fitting error smallest; without it every latency-bound row of
    TensorRT-LLM and NIM (one request's tokens, a 128-token prompt) came out 16-33 % too fast. The worst of the first
    24 rows is gpt-fast's Llama 2 7B on 8 A100s, 3 ms a token, of which the model's 1.4 ms an iteration is a large
    part."""
    from gpucourse.modeled import serve_plan

    assert all(abs(r["error"]) <= 0.12 for r in ROWS if r["metric"] == "output_tokens_per_s_per_gpu"
               and r["url"] == sp.TRTLLM_URL)
    e = sp.errors(FIRST)
    assert e["max"] <= 0.25 and e["worst"] == "Llama 2 7B, 8 A100 bf16, batch 1, gpt-fast"
    assert e["heldout_median"] <= 0.10 and serve_plan.STEP_OVERHEAD_S == 1.4e-3
    fitted = {}
    try:
        for tenths in range(31):
            serve_plan.STEP_OVERHEAD_S = tenths * 1e-4
            fitted[tenths] = sp.errors(sp.compare([r for r in sp.RUNS if r.url in FITTED_SOURCES]))["fit_max"]
    finally:
        serve_plan.STEP_OVERHEAD_S = 1.4e-3
    assert min(fitted, key=fitted.get) == 14
    bound = [r["name"] for r in FIRST if r["metric"] == "tpot_s" or (r["metric"] == "first_token_s"
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
    assert ("`serve_model_heldout_max_error` (target 30 %) and `serve_model_heldout_median_error` (target 10 %), and "
            "the fitting one as `serve_model_fit_max_error`: neither held-out figure meets its target") in flat
    assert e["heldout_max"] > 0.30 and e["heldout_median"] > 0.10
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
    gpt_fast = [r for r in FIRST if r["metric"] == "tokens_per_s"]
    assert len(gpt_fast) == 10 and all(abs(r["error"]) <= 0.25 and r["split"] == "heldout" for r in gpt_fast)


def test_the_added_rows_far_off_are_explained_by_their_setting():
    """Five added rows are off by more than 30 %: gpt-fast's INT4 on Llama 2 70B on one A100 (its kernels stream slower
    than bf16's, which the model does not charge; read as the model's own INT4 instead of gpt-fast's it was worse),
    LMDeploy's Llama 2 70B on 4 A100s (5 ms a step more than the model's and gpt-fast's), and LMDeploy's first tokens
    of 128-token prompts (about one decode step after the model's prefill). No constant was changed for them."""
    from gpucourse.modeled import serve_plan

    far = sorted(r["name"] for r in ROWS if abs(r["error"]) > 0.30)
    assert far == sorted(["Llama 2 70B, 1 A100 int4, batch 1, gpt-fast",
                          "Llama 2 70B, 4 A100 fp16, batch 32, 128/128, LMDeploy",
                          "Llama 2 70B, 4 A100 fp16, batch 64, 128/128, LMDeploy",
                          "Llama 2 7B, 1 A100 fp16, first token of 128, LMDeploy",
                          "Llama 2 70B, 4 A100 fp16, first token of 128, LMDeploy"])
    assert all(r["split"] == "heldout" and r["url"] not in FITTED_SOURCES for r in ROWS if r["name"] in far)
    flat = " ".join(DOC.read_text().split())
    by_name = {r["name"]: r for r in ROWS}
    for name, said in (("Llama 2 70B, 1 A100 int4, batch 1, gpt-fast", "INT4 +46.7 %"),
                       ("Llama 2 70B, 1 A100 int8, batch 1, gpt-fast", "INT8 +26.4 %"),
                       ("Llama 2 70B, 8 A100 int4, batch 1, gpt-fast", "INT4 +26.7 %"),
                       ("Llama 2 7B, 1 A100 int4, batch 1, gpt-fast", "INT4 +15.9 %"),
                       ("Llama 2 70B, 4 A100 fp16, batch 1, 128/128, LMDeploy", "+23.2 % at batch 1"),
                       ("Llama 2 70B, 4 A100 fp16, batch 64, 128/128, LMDeploy", "+33.3 % at batch 64"),
                       ("Llama 2 70B, 4 A100 fp16, batch 1, 2048/2048, LMDeploy", "+29.1 % for one request"),
                       ("Llama 2 7B, 1 A100 fp16, batch 1, 128/128, LMDeploy", "from +3.0 % at batch 1"),
                       ("Llama 2 7B, 1 A100 fp16, batch 64, 128/128, LMDeploy", "to +21.8 % at batch 64"),
                       ("Llama 2 7B, 1 A100 fp16, first token of 128, LMDeploy", "−38.4 % for Llama 2 7B"),
                       ("Llama 2 70B, 4 A100 fp16, first token of 128, LMDeploy", "−37.1 % for 70B")):
        number = said.split("%")[0].split()[-1]
        assert f"{by_name[name]['error'] * 100:+.1f}".replace("-", "−") == number and said in flat, (name, said)
    # The same rows read in the model's own INT4 (0.516 bytes a weight, the head in bf16) instead of gpt-fast's.
    own = {r.name: sp.modeled(dataclasses.replace(r, weights="int4")) / r.reported - 1
           for r in sp.RUNS if r.weights == sp.GPT_FAST_FORMATS["int4"]}
    assert (f"the 70B row on one A100 was {own['Llama 2 70B, 1 A100 int4, batch 1, gpt-fast'] * 100:+.1f} % and the "
            f"7B row {own['Llama 2 7B, 1 A100 int4, batch 1, gpt-fast'] * 100:+.1f} %") in flat
    # LMDeploy's Llama 2 70B at tp 4: the model's step and its all-reduces; LMDeploy's first tokens.
    step = decode_step("llama2-70b", "a100", 1, 128 + 64, 4)
    assert (f"the model's {step['token_s'] * 1e3:.1f} ms, {step['tp_comm_s'] * 1e3:.1f} ms of it for the step's 160 "
            f"all-reduces ({step['tp_comm_s'] / 160 * 1e6:.0f} µs each)") in flat
    first = [by_name[f"Llama 2 {m}, first token of 128, LMDeploy"]["modeled"] * 1e3
             for m in ("7B, 1 A100 fp16", "70B, 4 A100 fp16")]
    assert f"against the model's prefill, {first[0]:.1f} and {first[1]:.1f} ms" in flat


def test_a_row_is_read_in_the_weight_format_its_source_ran():
    """gpt-fast's quantize.py: INT4 with a bf16 scale and a bf16 zero point every 32 weights along k (0.625 bytes a
    weight), INT8 with one bf16 scale an output channel, every nn.Linear quantized, the output head included. Its rows
    carry those formats; the model's own int8 and int4 (the CLI's names) are unchanged."""
    from gpucourse.modeled import serve_plan

    int8, int4 = sp.GPT_FAST_FORMATS["int8"], sp.GPT_FAST_FORMATS["int4"]
    assert (int4.group, int4.scale, int4.zero, int4.head) == (32, "bf16", True, True) and int4.bytes(4096) == 0.625
    assert (int8.group, int8.scale, int8.zero, int8.head) == (0, "bf16", False, True)
    assert int8.bytes(4096) == 1 + 2 / 4096 == serve_plan.WEIGHTS["int8"].bytes(4096)
    assert serve_plan.WEIGHTS["int4"].bytes(4096) == 0.5 + 2 / 128 and not serve_plan.WEIGHTS["int4"].head
    quantized = [r for r in sp.RUNS if r.url in GPT_FAST_URLS and r.weights != "bf16"]
    assert len(quantized) == 10 and {r.weights for r in quantized} == {int8, int4}
    for run in quantized:
        bits = "int4" if run.weights is int4 else "int8"
        assert f" {bits}, " in run.name and f"{run.weights} weights ({run.weights.described})" in run.setting
    assert "one bf16 scale and zero point every 32 weights along k" in int4.described
    # The head is read in the format: the 7B's head (32000 × 4096) at 0.625 bytes, not 2, on top of the blocks.
    s = sp.LLAMA2_7B
    bf16_head = dataclasses.replace(int4, head=False)
    saved = s.vocab * s.hidden * (2 - 0.625)
    assert serve_plan.weight_bytes(s, weights=bf16_head) - serve_plan.weight_bytes(s, weights=int4) == \
        pytest.approx(saved)
    step = decode_step(s, "a100", 1, 105, weights=int4)["matmul_s"]
    assert step < decode_step(s, "a100", 1, 105, weights=bf16_head)["matmul_s"]


def _with_a_cost_a_sequence(monkeypatch, seconds):
    """serve_plan's step with ``seconds`` more for each decoding sequence (sampling, scheduling, per-sequence work)."""
    from gpucourse.modeled import serve_plan

    plain = serve_plan.step

    def step(*args, **kwargs):
        s = dict(plain(*args, **kwargs))
        extra = seconds * (args[2] if len(args) > 2 else kwargs.get("decodes", 0))
        s["seconds"] += extra
        s["stage_s"] += extra
        return s
    monkeypatch.setattr(serve_plan, "step", step)


def test_a_step_grows_with_its_batch_as_the_engines_does_and_the_fitting_rows_refuse_a_cost_a_sequence(monkeypatch):
    """From batch 1 to 64 (128 in / 128 out, on A100s) LMDeploy's median per-token latency grows 4 ms for Llama 2 7B
    on one GPU and 8 ms for 70B on four; the model's step, at the mean context, 3.9 and 5.6 ms. The 7B's static rows
    drift from +3.0 % to +21.8 % all the same: its requests reach their first tokens in turns (FTL(max) 1.06 s at batch
    64) where the model prefills the batch in one step. A cost a sequence a step, fitted on the fitting rows together
    with the step's own overhead, comes out nothing: TensorRT-LLM's batches of 896 and 1024 are already slow in the
    model."""
    growth = {}
    for (name, tp), published in sp.LMDEPLOY_STEP_S.items():
        shape = sp.LLAMA2_7B if name == "llama2-7b" else name
        modeled = [decode_step(shape, "a100", b, 128 + 128 / 2, tp)["token_s"] for b in sp.LMDEPLOY_BATCHES]
        growth[name] = (published[-1] - published[0], modeled[-1] - modeled[0])
        assert all(a < b for a, b in zip(modeled, modeled[1:]))
    (seven, seven_model), (seventy, seventy_model) = growth["llama2-7b"], growth["llama2-70b"]
    assert round(seven * 1e3) == 4 and abs(seven_model - seven) <= 0.5e-3 + 0.5e-3  # the table prints whole ms
    assert round(seventy * 1e3) == 8 and round(seventy_model * 1e3, 1) == 5.6  # 2.4 ms short at tp 4
    flat = " ".join(DOC.read_text().split())
    by_name = {r["name"]: r for r in ROWS}
    assert f"grows {seven_model * 1e3:.1f} ms" in flat and f"and {seventy_model * 1e3:.1f} ms" in flat
    ends = {name: [decode_step(sp.LLAMA2_7B if name == "llama2-7b" else name, "a100", b, 192, tp) for b in (1, 64)]
            for name, tp in sp.LMDEPLOY_STEP_S}
    for name in ends:
        assert f"({ends[name][0]['token_s'] * 1e3:.1f} to {ends[name][1]['token_s'] * 1e3:.1f} ms" in flat
    tp_growth = ends["llama2-70b"][1]["tp_comm_s"] - ends["llama2-70b"][0]["tp_comm_s"]
    assert f"{tp_growth * 1e3:.1f} ms of it the all-reduces of 64 rows" in flat
    assert f"in one step of {prefill(sp.LLAMA2_7B, 'a100', 64, 128)['first_token_s']:.2f} s" in flat
    large = [round(-by_name[f"Llama 2 {m}, H100 fp8, batch {b}, 128/128"]["error"] * 100) for m, b in (("7B", 896),
                                                                                                      ("70B", 1024))]
    assert large == [3, 10] and "already run 3 to 10 % slower in the model" in flat
    assert [round(by_name[f"Llama 2 7B, 1 A100 fp16, batch {b}, 128/128, LMDeploy"]["error"], 3) for b in (1, 64)] == \
        [0.030, 0.218]
    from gpucourse.modeled import serve_plan

    fit = [r for r in sp.RUNS if r.split == "fit"]
    joint = {}
    for tenths in (12, 13, 14, 15, 16):
        for us in (0, 1, 2, 5):
            monkeypatch.setattr(serve_plan, "STEP_OVERHEAD_S", tenths * 1e-4)
            _with_a_cost_a_sequence(monkeypatch, us * 1e-6)
            joint[tenths, us] = max(abs(r["error"]) for r in sp.compare(fit))
            monkeypatch.undo()
    assert min(joint, key=joint.get) == (14, 0)
    fit_max = {}
    for us in (0, 1, 10, 37.5):
        _with_a_cost_a_sequence(monkeypatch, us * 1e-6)
        fit_max[us] = max(abs(r["error"]) for r in sp.compare(fit))
        monkeypatch.undo()
    assert list(fit_max.values()) == sorted(fit_max.values()) and fit_max[0] == sp.errors(ROWS)["fit_max"]
    said = (f"lifts the largest fitting error from {fit_max[0]:.1%} to {fit_max[10]:.1%}; the 37.5 µs that would "
            f"close the 70B's growth, to {fit_max[37.5]:.1%}").replace("%", " %")
    assert said in flat, said
