"""The course in a real browser: the JupyterLab that ``make lab`` serves (token on), headless Chromium driven
by Playwright, notebooks 00 and 04 run from the Run menu, their plotly figures and ipywidgets drawn, no
error output; and ``check("ex01")`` answering in notebook 01.

The server serves a copy of notebooks/ (JupyterLab saves what it runs) with a progress file of the test's
own, in smoke mode. Chromium comes from Debian's packages (scripts/install-chromium, which .ci/run calls);
in CI (CI=true) a missing browser fails the test, elsewhere it is skipped with the way to install one.
"""

from __future__ import annotations

import re

import pytest

import browsers
from gpucourse.course import lab

pytestmark = pytest.mark.timeout(1500)

RANKS_STARTED = re.compile(r"gpucourse: \d+ ranks? on (cpu|cuda) \((gloo|nccl)\)")


@pytest.fixture(scope="module")
def chromium():
    return browsers.chromium()


@pytest.fixture(scope="module")
def course(tmp_path_factory, chromium):
    """The course served as make lab serves it, and a browser: (server, browser)."""
    tmp = tmp_path_factory.mktemp("lab")
    root = lab.course_copy(tmp)
    env = {"GPUCOURSE_SMOKE": "1", "GPUCOURSE_PROGRESS": str(tmp / "progress.json")}
    with lab.LabServer(root, env=env) as server, lab.Browser(chromium) as browser:
        yield server, browser


def test_the_server_asks_for_its_token(course):
    """Token on: the same page without the token is sent to the login form, not to the notebook."""
    server, browser = course
    page = browser.new_page()
    try:
        page.goto(server.url("00_setup.ipynb").split("&token=")[0])
        page.wait_for_selector("input[type=password], input[name=password]", timeout=60_000)
        assert "/login" in page.url
    finally:
        page.close()


def test_first_check_answers_in_notebook_01(course):
    """The first thing a learner is graded on: check("ex01") on the untouched stub shows 0/10 and the hint ladder's
    first rung: the idea the exercise tests, and when the fixes show."""
    server, browser = course
    found = lab.first_check(server, browser)
    text = found["text"]
    assert "ex01_ring_allreduce" in text and "0 / 10" in text, text[:2000]
    assert "the idea:" in text and "each check's fix from try 4" in text, text[:2000]
    print(f"first_check_s {found['seconds']:.1f} (the cell itself {found['cell_s']:.1f} s)")


# Notebook 04 has all a page must draw: plotly figures (the measured and the modeled timelines), widgets, ranks'
# output. (00 ran here too; test_notebooks runs it top to bottom, and its browser run added only 20 s.) Notebook 15,
# the newest, draws figures and widgets and starts no rank: it serves on one process.
@pytest.mark.parametrize("notebook, ranks", [("04_pipeline_parallelism.ipynb", True),
                                             ("15_inference_optimization.ipynb", False)])
def test_notebook_runs_in_the_browser(course, notebook, ranks):
    server, browser = course
    page = browser.open(server, notebook)
    try:
        got = page.run_all(timeout=900)
    finally:
        page.page.close()
    assert got["errors"] == [], got["errors"]
    assert got["executed"] == got["code_cells"] > 0, got
    assert bool(RANKS_STARTED.search(got["text"])) == ranks, got["text"][-2000:]
    # Every figure and widget the kernel sent is drawn: plotly's SVG, the widget's own view.
    assert got["plotly_outputs"] >= 1, got
    assert got["plotly_drawn"] == got["plotly_outputs"], got
    assert got["widget_outputs"] >= 1, got
    assert got["widgets_drawn"] == got["widget_outputs"], got
    assert got["widget_trouble"] == [], got


def test_the_page_report_sees_errors_and_undrawn_output(course):
    """The report can fail: an error is named, and a widget whose front end never arrives is not counted as drawn."""
    import nbformat

    server, browser = course
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [
        nbformat.v4.new_code_cell("import plotly.graph_objects as go\ngo.Figure(go.Scatter(y=[1, 3, 2])).show()"),
        nbformat.v4.new_code_cell("from IPython.display import display\n"
                                  "display({'application/vnd.jupyter.widget-view+json': "
                                  "{'model_id': 'no-such-model', 'version_major': 2, 'version_minor': 0}}, raw=True)"),
        nbformat.v4.new_code_cell("1 / 0"),
    ]
    nbformat.write(nb, server.root / "zz_faulty.ipynb")
    page = browser.open(server, "zz_faulty.ipynb")
    try:
        got = page.run_all(timeout=120, draw_timeout=5)  # the widget is never drawn: do not wait long for it
    finally:
        page.page.close()
    assert got["errors"] == ["code cell 2: ZeroDivisionError: division by zero"], got
    assert got["plotly_outputs"] == got["plotly_drawn"] == 1, got
    assert got["widget_outputs"] == 1 and got["widgets_drawn"] == 0, got
