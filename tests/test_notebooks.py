"""Every notebook runs top to bottom in a real kernel, and is committed clean.

The kernel is this test's own interpreter (the venv's), started from a
kernelspec written to a temporary folder (:func:`gpucourse.lab.execute`), so
the notebooks import the gpucourse being tested and not whatever another
Jupyter on the machine has. GPUCOURSE_SMOKE=1 asks each notebook for its short
version.
"""

import re
from pathlib import Path

import nbformat
import pytest

from gpucourse import lab

NOTEBOOKS = lab.course_notebooks()
CELL_TIMEOUT = 240  # seconds for one cell; a hung rank must fail the cell, not the suite

# A cell that calls launch(...) or run(...) directly (not obj.run(...)) starts ranks.
STARTS_RANKS = re.compile(r"(?<![\w.])(launch|run)\(")
# What starting ranks leaves in a cell's output: the launcher's device line, or a rank's own print.
RANKS_STARTED = re.compile(r"gpucourse: \d+ ranks? on (cpu|cuda) \((gloo|nccl)\)|\[rank \d+\]")


@pytest.fixture
def kernel(tmp_path):
    """Runs a notebook in a fresh kernel of this interpreter, in smoke mode, in the notebook's folder.

    Grades and quiz scores go to a progress file of the test's own, not the learner's.
    """
    kernels = lab.kernelspec_dir(tmp_path)
    env = {"GPUCOURSE_PROGRESS": str(tmp_path / "progress.json")}

    def execute(nb, path: Path) -> None:
        lab.execute(nb, path, kernels, cell_timeout=CELL_TIMEOUT, env=env)

    return execute


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "")
    return ""


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, kernel):
    nb = nbformat.read(path, as_version=4)
    kernel(nb, path)

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(code) for o in c.outputs
              if o.output_type == "error"]
    assert not errors, f"{path.name}: cells raised {errors}"
    for i, cell in enumerate(code):
        if STARTS_RANKS.search(cell.source):
            out = "".join(_text(o) for o in cell.outputs)
            assert RANKS_STARTED.search(out), (
                f"{path.name}, code cell {i} calls launch/run but its output shows no ranks starting:\n"
                f"{cell.source}\n--- output ---\n{out[:2000]}")


def test_setup_notebook_really_runs_two_ranks(kernel):
    """00_setup's cell-defined function reaches both forked ranks, and both see the all_reduce sum."""
    path = next(p for p in NOTEBOOKS if p.name == "00_setup.ipynb")
    nb = nbformat.read(path, as_version=4)
    hello = next(c for c in nb.cells if c.cell_type == "code" and "def hello" in c.source)
    # Only the hello cell (and the imports it needs) runs: quick, and independent of the rest.
    nb.cells = [hello]
    kernel(nb, path)
    out = "".join(_text(o) for o in hello.outputs)
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\].*I am rank {rank} of 2 .*all_reduce gave 3\b", out), out
    assert "[3.0, 3.0]" in out, out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean(path):
    """No outputs or execution counts in git, and a kernelspec so JupyterLab opens without asking."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    spec = nb.metadata.get("kernelspec", {})
    assert spec.get("name") == "python3" and spec.get("language") == "python", spec
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {i} has outputs"
            assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count"


def test_there_are_notebooks():
    assert any(p.name == "00_setup.ipynb" for p in NOTEBOOKS)


def test_a_learners_mistake_reads_as_one_sentence(kernel, tmp_path):
    """A layout that cannot run, and a rank whose code raised, show their sentence, not a traceback wall."""
    from nbclient.exceptions import CellExecutionError

    cells = {
        "config": ("from gpucourse import TrainConfig, run\nrun(TrainConfig(dp=3, batch_size=8, steps=2))",
                   "ConfigError", "batch_size=8 must be divisible by grad_accum × dp"),
        "rank": ("from gpucourse import launch\n\ndef boom():\n    raise ValueError('my bug')\n\n"
                 "launch(boom, world_size=2, timeout=60)", "WorkerError", "failed: ValueError: my bug"),
    }
    for name, (source, ename, words) in cells.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
        with pytest.raises(CellExecutionError):
            kernel(nb, tmp_path / f"{name}.ipynb")
        [error] = [o for o in nb.cells[0].outputs if o.output_type == "error"]
        shown = "\n".join(error.traceback)
        assert error.ename == ename and words in shown, shown
        assert "site-packages" not in shown and "gpucourse/train.py" not in shown, shown
        assert len(error.traceback) <= 25, shown
