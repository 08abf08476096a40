"""The tour runs every supported layout, checks each against the single-device run, and reports it offline."""

import html.parser
import re
import subprocess
import sys
import time

import pytest

from gpucourse.course import tour
from gpucourse.runtime import visible_gpus

from procs import REPO, clean_env

FIGURE_IDS = {"compare", "timeline", "schedule", "memory", "scaling", "bandwidth",
              "collective-all_reduce", "collective-reduce_scatter", "collective-all_gather", "collective-broadcast"}
SOME = ["dp scratch", "pp scratch", "zero2 scratch", "zero3 accelerate"]


class _Links(html.parser.HTMLParser):
    """Every src= and href= in a page, and the ids of its sections."""

    def __init__(self):
        super().__init__()
        self.links, self.sections, self.plots = [], set(), 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.links += [attrs[k] for k in ("src", "href") if attrs.get(k)]
        if tag == "section":
            self.sections.add(attrs.get("id"))
        if "plotly-graph-div" in (attrs.get("class") or ""):
            self.plots += 1


def _check_report(path) -> _Links:
    page = path.read_text()
    parsed = _Links()
    parsed.feed(page)
    assert FIGURE_IDS <= parsed.sections, FIGURE_IDS - parsed.sections
    assert parsed.plots == len(parsed.sections)
    assert not [u for u in parsed.links if re.match(r"(https?:)?//", u)], "the report must open offline"
    assert "Plotly.newPlot" in page and "window.Plotly" in page  # plotly.js is inside the file
    return parsed


@pytest.mark.timeout(240)
def test_quick_tour_of_some_layouts(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert tour.main(quick=True, out=str(out), only=SOME) == 0
    printed = capsys.readouterr().out
    for column in tour.TABLE_HEADER:
        assert column in printed
    assert re.search(r"dp2 buckets 1 MB\s+scratch\s+2 cpu\s+3\.\d+\s+\S+e-\d\d", printed)
    if visible_gpus() < 2:
        assert "skipped: zero3 accelerate: Accelerate offers FSDP only on GPUs" in printed
    _check_report(out)
    assert "schedule-measured" in _check_report(out).sections


@pytest.mark.timeout(240)
def test_a_layout_that_differs_fails_the_tour(tmp_path, monkeypatch, capsys):
    from gpucourse import train

    real = train.run

    def drifting(config, **kw):  # a "bug" in data parallelism: the loss drifts by 1e-4 relative
        result = real(config, **kw)
        if config.dp > 1:
            result.losses = [x * (1 + 1e-4) for x in result.losses]
        return result

    monkeypatch.setattr(train, "run", drifting)
    assert tour.main(quick=True, out=str(tmp_path / "r.html"), only=["dp scratch"]) == 1
    printed = capsys.readouterr().out
    assert "DIFFERS" in printed and "1.00e-04" in printed
    assert 'class="bad">DIFFERS' in (tmp_path / "r.html").read_text()


def test_every_supported_row_becomes_a_config():
    from gpucourse.parallel.catalogue import supported

    rows = tour.layouts(tour.QUICK)
    assert [(r.layout, r.impl) for r in rows] == [(layout, impl) for layout, impl, *_ in supported()]
    for r in rows:
        assert r.config.steps == tour.QUICK["steps"] and r.config.seq_len == tour.QUICK["seq_len"]
    assert next(r for r in rows if r.name == "dp×tp×pp scratch").config.world_size == 8


def test_an_unknown_layout_is_refused():
    from gpucourse.config import ConfigError

    with pytest.raises(ConfigError, match="gpucourse train --list"):
        tour.run_tour(only=["dp magic"])


# A few layouts the tour draws from (a pipeline, context parallelism, a mixture of experts and its own baseline):
# every layout of the list is trained and compared with one device by the equality tests already.
EACH_KIND = ["pp scratch", "cp scratch", "dp×ep scratch"]


@pytest.mark.timeout(600)
def test_tour_quick_command(tmp_path):
    """The real ``gpucourse tour --quick`` on some layouts of each kind, each against its own model's baseline."""
    out = tmp_path / "tour.html"
    start = time.perf_counter()
    only = [arg for name in EACH_KIND for arg in ("--only", name)]
    proc = subprocess.run([sys.executable, "-m", "gpucourse", "tour", "--quick", *only, "--out", str(out)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=580)
    took = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every layout that ran matches the single-device run" in proc.stdout
    # Each, and the two single-device runs they are compared with (dense, and the mixture of experts).
    progress = re.findall(r"^tour +\d+/\d+ +(\S+ \S+) +(\S+)", proc.stderr, re.M)
    assert {name for name, _ in progress} == {*EACH_KIND, "single scratch", "single+moe scratch"}
    assert all(status == "ok" for _, status in progress), progress
    assert re.search(r"^single MoE 4×top2 .* ok$", proc.stdout, re.M)
    _check_report(out)
    print(f"tour --quick took {took:.0f} s")


def test_tour_refuses_an_unwritable_report(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpucourse", "tour", "--quick", "--out", str(tmp_path / "no" / "r.html")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
