"""The cost model against published runs (gpucourse.published): each within its tolerance, and the docs' table
is the one the model prints today."""

from __future__ import annotations

import pathlib

import pytest

from gpucourse import published

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "modeled-timing.md"


@pytest.mark.parametrize("run", published.RUNS, ids=lambda r: r.name)
def test_the_model_predicts_each_published_run_within_its_tolerance(run):
    got = published.predict(run)
    assert abs(got - run.reported) / run.reported <= run.tolerance, (run.name, got, run.reported)


def test_the_worst_prediction_is_within_thirty_per_cent_and_every_source_is_cited():
    rows = published.compare()
    assert max(abs(r["error"]) for r in rows) <= 0.30
    assert {r["bound"] for r in rows} == {"compute", "communication"}
    assert {r["gpu"] for r in rows} >= {"a100", "h100"}
    for run in published.RUNS:
        assert len(run.source) > 60 and run.tolerance in (0.20, 0.30)


def test_megatrons_flop_count_gives_its_own_figure_for_gpt3():
    # The README's 175B run: 138 TFLOP/s per GPU at about 32 s per iteration on 1024 GPUs.
    flops = published._megatron_flops(1536, 2048, 96, 12288, 51200)
    assert flops / (32 * 1024) / 1e12 == pytest.approx(138, rel=0.03)


def test_the_docs_table_is_the_models():
    assert published.markdown_table() in DOC.read_text()


def test_the_readme_states_the_range_of_errors_the_model_has():
    errors = [r["error"] for r in published.compare()]
    readme = (DOC.parent.parent / "README.md").read_text()
    assert f"within −{abs(round(100 * min(errors)))} % to +{round(100 * max(errors))} %" in readme
