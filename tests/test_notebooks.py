"""Every notebook runs top to bottom in a real kernel, and is committed clean.

The kernel is this test's own interpreter (the venv's), started from a
kernelspec written to a temporary folder (:func:`gpucourse.course.lab.execute`), so
the notebooks import the gpucourse being tested and not whatever another
Jupyter on the machine has. GPUCOURSE_SMOKE=1 asks each notebook for its short
version.
"""

import json
import re
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest

from gpucourse.course import lab

NOTEBOOKS = lab.course_notebooks()
CELL_TIMEOUT = 240  # seconds for one cell; a hung rank must fail the cell, not the suite

# A cell that calls launch(...) or run(...) directly (not obj.run(...)) starts ranks.
# JupyterLab wraps an output line wider than its output area, mid-number ("4.9⏎95"). Measured in Chromium at
# 1400 px with the file browser open at its default 250 px: 13 px DejaVu Sans Mono is 7.83 px a character and the
# output area 960 px, so 122 characters. Printed lines keep to 110, room for a wider file browser; a line of the
# package's own source, printed by inspect.getsource, keeps the code's 120. The package's own notes ("gpucourse: 2
# ranks on cpu (gloo): ...", and on stderr the command line's "gpucourse: error: ...") are exempt: each is one
# sentence on one line by design (tests/test_cli.py), so that a script or grep gets it whole, and the launcher's
# names the GPUs in full; wrapped at the edge, it reads as in a terminal.
OUTPUT_WIDTH = 110
SOURCE_WIDTH = 120
CLI_DIAGNOSTIC = "gpucourse: "
STARTS_RANKS = re.compile(r"(?<![\w.])(launch|run)\(")
# What starting ranks leaves in a cell's output: the launcher's device line, or a rank's own print.
RANKS_STARTED = re.compile(r"gpucourse: \d+ ranks? on (cpu|cuda) \((gloo|nccl)\)|\[rank \d+\]")


# Some notebooks run on a machine described by GPUCOURSE_FAKE_GPUS (gpucourse.runtime.devices): Colab's one T4,
# Kaggle's two, a MIG seat. Every decision is then that machine's (which runs fall back to CPU processes, and the
# line that says so; which run on its GPUs, CPU processes standing in for them); each notebook still runs once.
FAKED = {"01_collectives": "colab-t4", "04b_pipeline_schedules": "kaggle-2xt4", "09_troubleshooting": "colab-t4",
         "10_accelerate_scaling": "kaggle-2xt4", "12_sequence_context_parallel": "mig-a100-1g.10gb"}
# What a launcher's line may give as the reason for CPU ranks on a described machine: the notebook asked for CPU
# ranks (notebook_device said why), described GPUs stood in for, or too few described GPUs for the ranks.
FAKED_REASONS = re.compile(r"device='cpu' asked for: "
                           r"|.*, as GPUCOURSE_FAKE_GPUS=[\w.-]+ describes; CPU processes stand in for (it|them)$"
                           r"|only \d GPUs? (is|are) visible, .*Tesla T4"
                           r"|.*MIG gives one CUDA rank")
LAUNCH_LINE = re.compile(r"gpucourse: \d+ ranks? on cpu \(gloo\): (.*)\.$", re.M)


@pytest.fixture
def kernel(tmp_path):
    """Runs a notebook in a fresh kernel of this interpreter, in smoke mode, in the notebook's folder.

    Grades and quiz scores go to a progress file of the test's own, not the learner's. ``platform`` names a machine
    of gpucourse.runtime.devices.PLATFORMS for the kernel to describe its GPUs as.
    """
    kernels = lab.kernelspec_dir(tmp_path)
    env = {"GPUCOURSE_PROGRESS": str(tmp_path / "progress.json")}

    def execute(nb, path: Path, platform: str | None = None) -> None:
        lab.execute(nb, path, kernels, cell_timeout=CELL_TIMEOUT,
                    env={**env, "GPUCOURSE_FAKE_GPUS": platform} if platform else env)

    return execute


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "")
    return ""


def _shown_text(output) -> str:
    """What JupyterLab draws as text: a stream, or text/plain when the output has nothing richer to draw."""
    if output.output_type == "stream":
        return output.text
    data = output.get("data", {}) if output.output_type in ("execute_result", "display_data") else {}
    return data.get("text/plain", "") if set(data) <= {"text/plain"} else ""


@lru_cache(maxsize=1)
def _source_lines() -> frozenset:
    package = Path(lab.__file__).parents[1]  # the whole package: gpucourse/course/lab.py
    return frozenset(line for f in package.rglob("*.py") for line in f.read_text(encoding="utf-8").splitlines())


def too_wide(nb) -> list[str]:
    """The printed lines of an executed notebook that JupyterLab would wrap (see OUTPUT_WIDTH)."""
    wide = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        for line in (line for o in cell.outputs for line in _shown_text(o).splitlines()
                     if not line.startswith(CLI_DIAGNOSTIC)):
            limit = SOURCE_WIDTH if line in _source_lines() else OUTPUT_WIDTH
            if len(line) > limit:
                wide.append(f"code cell {i}: {len(line)} > {limit} characters: {line}")
    return wide


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, kernel):
    nb = nbformat.read(path, as_version=4)
    platform = FAKED.get(path.stem)
    kernel(nb, path, platform)

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
    wide = too_wide(nb)
    assert not wide, f"{path.name}: printed lines JupyterLab would wrap:\n" + "\n".join(wide)
    if platform:
        assert_fallbacks(path, platform, "".join(_text(o) for c in code for o in c.outputs))


def assert_fallbacks(path: Path, platform: str, out: str) -> None:
    """A notebook run on a described machine took that machine's decisions, and said so."""
    from gpucourse.runtime.devices import PLATFORMS

    found, name = PLATFORMS[platform].devices, path.name
    largest = int(re.search(r"notebook_device\(largest=(\d)\)", path.read_text())[1])
    said = f"gpucourse: {'one MIG slice' if found.mig else f'{len(found.gpus)} GPU'}"
    if found.cuda_ranks < largest:  # too few GPUs for its largest run: every run on CPU ranks, said once
        line = rf"^{said}s? for runs of up to {largest} ranks: all run on CPU processes"
        assert re.search(line, out, re.M), f"{name} on {platform}: no line saying so\n{out[:3000]}"
    else:
        assert "CPU processes stand in" in out, f"{name} on {platform}: no run used the described GPUs"
    reasons = LAUNCH_LINE.findall(out)
    assert reasons, f"{name} on {platform}: no launcher line"
    wrong = [r for r in reasons if not FAKED_REASONS.match(r)]
    assert not wrong, f"{name} on {platform}: CPU ranks for a reason that is not the described machine's: {wrong}"


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
    """No outputs or execution counts in git, every cell with its own id (nbformat 4.5; a missing one will be an
    error in later nbformat), and a kernelspec so JupyterLab opens without asking."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # Read as committed: nbformat.read makes up the missing ids.
    ids = [cell.get("id") for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: cells without an id, or ids used twice"
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


def test_a_crashed_ranks_last_words_come_before_the_cells_next_line(kernel, tmp_path):
    """A rank that writes to stderr and then dies: its line is in the cell before what the cell prints next. Notebook
    10 showed "[rank 1] ... ends its process at step 5" under the restart's launch line (stderr and stdout are
    flushed apart in a kernel)."""
    source = ("import os, sys\nfrom gpucourse import WorkerError, current, launch\n\n"
              "def crash():\n    if current().rank == 1:\n"
              "        print('rank 1 says goodbye', file=sys.stderr, flush=True)\n        os._exit(1)\n\n"
              "try:\n    launch(crash, world_size=2, timeout=60, device='cpu')\nexcept WorkerError as e:\n"
              "    print(f'attempt 1 failed: rank {e.rank}')\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    kernel(nb, tmp_path / "crash.ipynb")
    shown = "".join(_text(o) for o in nb.cells[0].outputs)
    assert shown.index("[rank 1] rank 1 says goodbye") < shown.index("attempt 1 failed: rank 1"), shown


def test_a_wide_printed_line_is_found_but_printed_source_and_cli_diagnostics_keep_their_width():
    line = "x" * (OUTPUT_WIDTH + 1)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(...)")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"short\n{line}\n"),
                           nbformat.v4.new_output("display_data", data={"text/plain": line, "text/html": "<b>x</b>"})]
    assert too_wide(nb) == [f"code cell 0: {OUTPUT_WIDTH + 1} > {OUTPUT_WIDTH} characters: {line}"]
    source = next(s for s in _source_lines() if OUTPUT_WIDTH < len(s) <= SOURCE_WIDTH)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=source)]
    assert too_wide(nb) == []
    error = f"{CLI_DIAGNOSTIC}error: {line}"
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text=f"{error}\n{line}\n")]
    assert too_wide(nb) == [f"code cell 0: {OUTPUT_WIDTH + 1} > {OUTPUT_WIDTH} characters: {line}"]


# --- predict, then run: the Change cells' check and the numbers their text gives ----------------------------

def test_a_prediction_can_have_its_own_tolerance_and_a_percent_sign(capsys):
    from gpucourse.course.predict import WIDTH, check_prediction, parse

    assert parse(" 33.3 % ") == 33.3 and parse("1,024") == 1024 and parse("") is None
    assert check_prediction("bubble", "33%", 33.3, 36.0, "%", tolerance=5, against="simulated") is True
    assert check_prediction("bubble", "30", 33.3, 36.0, "%", tolerance=5, against="simulated") is False
    out = capsys.readouterr().out
    assert "bubble: your prediction 33 % | the formula 33.3 % | simulated 36 %" in out
    assert "is within ±5 percentage points of the value simulated." in out
    assert "is NOT within ±5 percentage points" in out
    check_prediction("a long name for what was predicted, long enough to need a line of its own", "1", 1, 1, "MiB")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(":") and lines[1].startswith("  your prediction") and max(map(len, lines)) <= WIDTH


def _prose(name: str) -> str:
    nb = nbformat.read(lab.NOTEBOOKS / f"{name}.ipynb", as_version=4)
    return " ".join(" ".join(c.source for c in nb.cells if c.cell_type == "markdown").split())


def test_what_to_predict_a_pipeline_bubble_from():
    from gpucourse.parallel import schedules

    text = _prose("04_pipeline_parallelism")
    assert "(p − 1)/(m + p − 1) of the total time for GPipe and 1F1B, (p − 1)/p for the naive schedule" in text
    assert "within ±5 percentage points of the simulated one" in text
    for name in ("gpipe", "1f1b"):
        assert schedules.formula_bubble(name, 2, 2) == 1 / 3
    assert schedules.formula_bubble("naive", 4, 8) == 3 / 4


def test_what_to_predict_context_parallel_traffic_from():
    from gpucourse import TrainConfig

    cfg = TrainConfig(cp=2, seq_len=64)
    mc = cfg.model_config()
    assert (cfg.batch_size, mc.n_embd, mc.n_layer) == (8, 64, 4)
    block = cfg.batch_size * (cfg.seq_len // cfg.cp) * mc.n_embd * 4
    assert block == 8 * 32 * 64 * 4 == 64 * 2**10
    # Per layer, in blocks (tests/test_context_parallel.py holds the runs to the same counts).
    per_layer = {"allgather": 4 * 2, "ring": 6 * 2 - 4, "ulysses": 8}
    assert set(per_layer.values()) == {8} and 8 * block * mc.n_layer == 2048 * 2**10
    text = _prose("12_sequence_context_parallel")
    assert "B · (T/cp) · C fp32 numbers, B = 8 sequences, C = 64 channels" in text
    assert "*payload* of the **all-gather** is 4·cp blocks" in text and "of the **ring** 6·cp − 4" in text
    assert "of **Ulysses** 8" in text and "how many KiB rank 0 *sends* for attention" in text
    assert "2,048 KiB" not in text and "1,024 KiB" not in text  # no default's answer in the prompt
    code = "\n".join(c.source for c in nbformat.read(lab.NOTEBOOKS / "12_sequence_context_parallel.ipynb",
                                                       as_version=4).cells if c.cell_type == "code")
    assert '"allgather": lambda cp: 4 * cp, "ring": lambda cp: 6 * cp - 4, "ulysses": lambda cp: 8' in code


def test_what_to_predict_the_all_to_all_from():
    """13 asks for what the all-to-alls send (the payload less what each rank keeps, (ep - 1)/ep of it), which moves
    with ep, and does not give the default's answer."""
    from gpucourse import TrainConfig
    from gpucourse.comm import RING_FACTOR
    from gpucourse.modeled.memory import all_to_all_bytes

    cfg = TrainConfig(dp=4, ep=2, moe_experts=4, seq_len=64)
    mc = cfg.model_config()
    assert (cfg.batch_size, mc.n_embd, mc.n_layer, mc.moe_top_k) == (8, 64, 4, 2)
    sent = {ep: all_to_all_bytes(TrainConfig(dp=4, ep=ep, moe_experts=4, seq_len=64)) * RING_FACTOR["all_to_all"](ep)
            for ep in (1, 2, 4)}
    assert sent[1] == 0 and sent[2] < sent[4] and sent[4] == 1.5 * sent[2]  # 1/2 against 3/4 of the same payload
    text = _prose("13_mixture_of_experts")
    assert "what goes on the wire, not the rows a rank keeps for its own experts" in text
    assert "a rank keeps the 1/ep share its own experts take and sends the rest" in text
    assert f"{sent[2] / 2**10:,.1f}" not in text and f"{sent[2] / 2**10:,.0f}" not in text  # no default's answer