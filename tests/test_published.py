"""The cost model against published runs (gpucourse.modeled.published): a table split into a fitting and a held-out set
before any constant was tuned, each run within its set's bound, the constants the fit's own best point, and the
planner's advice against the layouts the sources chose."""

from __future__ import annotations

import dataclasses
import pathlib
import statistics

import pytest

from gpucourse.modeled import gpus, published

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "modeled-timing.md"
ROWS = published.compare()


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["name"])
def test_each_published_run_is_within_its_sets_bound(row):
    """15 % on the fitting set, 25 % on the held-out set (the issue's figures)."""
    assert abs(row["error"]) <= row["tolerance"], (row["name"], row["predicted"], row["reported"])
    fit = 0.20 if row["gpu"] == "b200" else 0.15
    assert row["tolerance"] == (fit if row["split"] == "fit" else 0.25)


def test_the_held_out_median_and_the_figures_bench_reports():
    e = published.errors(ROWS)
    held = sorted(abs(r["error"]) for r in ROWS if r["split"] == "heldout")
    assert e["heldout_median"] == statistics.median(held) <= 0.10
    assert e["fit_max"] == max(abs(r["error"]) for r in ROWS if r["split"] == "fit") <= 0.20
    assert max(abs(r["error"]) for r in ROWS if r["split"] == "fit" and r["gpu"] != "b200") <= 0.15
    assert e["heldout_max"] == held[-1] <= 0.25
    assert e["fit_runs"] + e["heldout_runs"] == len(published.RUNS)


def test_the_b200_fp8_held_out_runs_are_within_20_percent():
    """NVIDIA's B200 FP8 tables held out: each run within 20 % (with H100's fitted constants and attention borrowed,
    the model ran them up to 28 % fast; their worst is the bench's model_heldout_max_error_b200_fp8)."""
    rows = [r for r in ROWS if r["gpu"] == "b200" and r["fp8"] and r["split"] == "heldout"]
    assert len(rows) == 5
    assert published.errors(ROWS)["heldout_max_b200_fp8"] == max(abs(r["error"]) for r in rows) <= 0.20


def test_the_new_rows_state_what_their_source_leaves_out_and_the_excluded_say_why():
    fp8 = [r for r in published.RUNS if r.matmuls == "fp8"]
    assert len(fp8) >= 15 and {r.gpu for r in fp8} == {"b200", "h100"}
    assert all(r.assumed and "GBS" in r.source and "tokens/s per GPU" in r.source for r in fp8)
    assert all(len(what) > 20 and len(why) > 40 for what, why in published.EXCLUDED)


def test_the_table_is_broad_enough_to_mean_something():
    """At least 20 training runs from at least 4 independent sources: A100 and H100, dense and MoE, tp × pp and
    ZeRO-3/FSDP, 4k-class and ≥ 64k tokens, plus nccl-tests bus bandwidths; both sets used for both GPUs."""
    runs = [r for r in published.RUNS if r.metric != "bus_bandwidth"]
    assert len(runs) >= 20
    sources = {key for key in ("Narayanan", "Megatron-LM README", "Llama 3 Herd", "llm-foundry", "MegaScale",
                               "torchtitan", "Nemotron", "moe/README")
               if any(key in r.source for r in runs)}
    assert len(sources) >= 4, sources
    assert {r.gpu for r in runs} >= {"a100", "h100"}
    assert {r.kind for r in published.RUNS} >= {"tp×pp", "zero3", "moe", "cp", "collective"}
    seqs = [published.TrainConfig(**r.layout).seq_len for r in runs]
    assert min(seqs) <= 4096 and sum(s >= 65536 for s in seqs) >= 2
    for gpu in ("a100", "h100"):
        assert {r.split for r in runs if r.gpu == gpu} == {"fit", "heldout"}
    for r in published.RUNS:
        assert len(r.source) > 60 and r.split in ("fit", "heldout")


@pytest.mark.parametrize("gpu", ["a100", "h100", "b200"])
def test_the_gpu_tables_constants_are_the_fits_best_point_on_the_fitting_set_only(gpu):
    """The table's fitted constants are exactly what `published.fit` finds; moving every held-out figure leaves
    the fit where it is (it never looks at them)."""
    found = published.fit(gpu)
    spec = gpus.get_gpu(gpu)
    assert {k: getattr(spec, k) for k in published.fitted(gpu)} == found["values"]
    assert found["max_error"] <= (0.20 if gpu == "b200" else 0.15)
    moved = [dataclasses.replace(r, reported=r.reported * 3) if r.split == "heldout" else r for r in published.RUNS]
    assert published.fit(gpu, moved)["values"] == found["values"]


def test_h200_takes_the_h100s_fit_for_want_of_runs_of_its_own():
    h100 = gpus.get_gpu("h100")
    for name in ("h200",):
        assert not [r for r in published.RUNS if r.gpu == name and r.split == "fit"]
        assert {k: getattr(gpus.get_gpu(name), k) for k in published.FITTED} == \
            {k: getattr(h100, k) for k in published.FITTED}


def test_megatrons_flop_count_gives_its_own_figure_for_gpt3():
    # The README's 175B run: 138 TFLOP/s per GPU at about 32 s per iteration on 1024 GPUs.
    flops = published._megatron_flops(1536, 2048, 96, 12288, 51200)
    assert flops / (32 * 1024) / 1e12 == pytest.approx(138, rel=0.03)


def test_the_throughput_trend_with_model_size_is_the_published_one():
    """SC21's weak scaling: published TFLOP/s per GPU rise from 1.7B to 1T (137 → 163); so must the model's (one
    constant share of the peak made them fall)."""
    sc21 = [r for r in published.RUNS if "Table 1:" in r.source and "against ZeRO-3" not in r.name]
    assert len(sc21) == 10
    got = [published.predict(r) for r in sc21]
    reported = [r.reported for r in sc21]
    assert statistics.mean(reported[:3]) < statistics.mean(reported[-3:])
    assert statistics.mean(got[:3]) < statistics.mean(got[-3:]) and got[0] < got[-1]


def test_the_docs_table_is_the_models():
    assert published.markdown_table() in DOC.read_text()


def test_the_readme_states_the_range_of_errors_the_model_has():
    errors = [r["error"] for r in ROWS]
    readme = (DOC.parent.parent / "README.md").read_text()
    assert f"within −{abs(round(100 * min(errors)))} % to +{round(100 * max(errors))} %" in readme


def test_the_docs_agreement_table_and_what_it_says_of_the_disagreements():
    """docs/modeled-timing.md prints the planner against the sources' choices; each figure its discussion quotes is
    recomputed here."""
    from gpucourse.modeled.cluster import Cluster

    rows = published.agreement()
    text = DOC.read_text()
    assert published.agreement_table(rows) in text
    text = " ".join(text.split())  # the discussion's phrases, whatever the line breaks
    share = sum(r["agrees"] for r in rows) / len(rows)
    assert len(rows) >= 20 and f"({share:.0%})" in text
    sc21 = [r for r in rows if not r["agrees"] and r["name"].startswith("GPT") and "A100" in r["name"]]
    assert [r["name"] for r in sc21] == ["GPT 48×8192, 512 A100 (tp 8, pp 2, dp 32)"]
    mine, theirs = sc21[0]["chosen_row"], sc21[0]["first_row"]
    assert (theirs["tp"], theirs["pp"], mine["tp"]) == (2, 8, 8) and theirs["microbatches"] == 48
    share = lambda row, k: round(100 * row["parts"][k] / row["step_s"])  # noqa: E731
    assert (share(mine, "tp"), share(theirs, "tp"), share(theirs, "bubble")) == (15, 2, 6)
    assert "spends 15 % of the step in all-reduces" in text and "tp 2 only 2 %" in text and "bubble to 6 %" in text
    assert 20480 / 8192 == 2.5 and "a 162 B model 2.5 times as wide" in text
    long = next(r for r in rows if "131072" in r["name"])
    assert not long["agrees"] and [long["first_row"][k] for k in ("tp", "cp", "pp")] == [4, 64, 8]
    assert share(long["chosen_row"], "bubble") == 18 and "leave 18 % of the step in the bubble" in text
    h100 = gpus.get_gpu("h100")
    assert round(h100.usable_bytes() / 2**30) == 78 and "a 2 GiB allowance" in text
    assert next(r for r in rows if r["name"].startswith("Llama 3 405B, 8192"))["agrees"]
    mcore = [r for r in rows if not r["agrees"] and "H100 (tp 8, pp" in r["name"] and "GPT" in r["name"]]
    assert len(mcore) == 2 and all((r["first_row"]["tp"], r["first_row"]["zero"]) == (2, 3) for r in mcore)
    assert all(r["chosen_row"]["tp_exposed_s"] == 0 for r in mcore)
    cluster = Cluster(h100)
    speed = lambda k: 2 * 4096 * 8192 * k / cluster.gemm_s(4096, 8192, k)  # noqa: E731
    assert round(speed(1024) / speed(4096), 1) == 0.6 and "about 0.6 of the speed" in text


def test_the_docs_quote_the_errors_and_the_table_size_the_model_has():
    e = published.errors(ROWS)
    text = " ".join(DOC.read_text().split())
    assert (f"the largest fitting error is {e['fit_max']:.1%}, the largest held-out error {e['heldout_max']:.1%} "
            f"and the held-out median {e['heldout_median']:.1%}") in text
    assert f"holds {len(published.RUNS)} published runs" in text
    assert f"fitting set ({e['fit_runs']} runs) and a held-out set ({e['heldout_runs']})" in text


def test_the_docs_say_the_nvls_figure_was_measured_on_h200_and_held_against_h100():
    """nvls_efficiency comes from nccl-tests on 8 × H200 (gpucourse/modeled/gpus.py); the H100, with the same NVLink and
    NVSwitch, takes it, and the docs' table holds it against the published 8 × H100 bus bandwidth."""
    h100, h200 = gpus.get_gpu("h100"), gpus.get_gpu("h200")
    assert h100.nvls_efficiency == h200.nvls_efficiency == 0.61 and h100.intra_node_GBps == h200.intra_node_GBps
    row = next(r for r in ROWS if r["name"] == "all-reduce bus bandwidth, 8 H100 (NVLink 4)")
    assert round(row["reported"] / 1e9) == 470 and round(row["predicted"] / 1e9) == 480
    text = " ".join(DOC.read_text().split())
    assert ("(`nvls_efficiency`, 0.61: nccl-tests' 480 GB/s bus bandwidth on 8 × H200, whose NVLink and NVSwitch are "
            "the H100's, so the H100 takes the same figure; the table below holds it against 8 × H100's published "
            "470 GB/s)") in text
