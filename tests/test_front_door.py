"""The course opened outside its repository: the wheel carries the notebooks and exercises (no solutions, no tests),
``gpucourse fetch-course DIR`` copies them out of an installed wheel, and each notebook's first cell installs the
course where it is missing and says so in one line. (``scripts/wheel-check`` does it all in a fresh virtual
environment: notebook 00 top to bottom and a grade.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpucourse.course import material

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "build-wheel"), str(dist)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip())


def _tracked(part: str, pattern: str) -> list[str]:
    names = subprocess.run(["git", "ls-files", part], cwd=REPO, capture_output=True, text=True).stdout.split()
    return sorted(Path(n).name for n in names if Path(n).match(pattern))


def test_the_wheel_carries_the_notebooks_and_exercises_and_no_solutions(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for part, pattern in material.PARTS.items():
        inside = sorted(Path(n).name for n in names if n.startswith(f"gpucourse/course/packaged/{part}/"))
        assert inside == _tracked(part, pattern) and inside, part
    assert not [n for n in names if n.startswith(("solutions/", "tests/")) or "/solutions/" in n]
    assert "gpucourse/quiz/bank.json" in names and "gpucourse/course/material.py" in names


def test_fetch_course_copies_the_course_out_of_an_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    work = tmp_path / "course"
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import sys, gpucourse; from gpucourse.cli import main; print(gpucourse.__file__, file=sys.stderr); "
            f"sys.exit(main(['fetch-course', {str(work)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.startswith(str(target)), "the wheel's package ran, not the checkout's"
    assert out.stdout.startswith("gpucourse: 17 notebooks and ") and out.stdout.count("\n") == 1
    assert sorted(p.name for p in (work / "exercises").iterdir()) == _tracked("exercises", "ex[0-9][0-9]_*.py")
    assert (work / "notebooks" / "00_setup.ipynb").read_bytes() == (REPO / "notebooks" / "00_setup.ipynb").read_bytes()
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env=env)
    assert again.returncode == 2 and "nothing was copied" in again.stderr
    assert again.stderr.count("\n") == 2  # the package's path, then one sentence


def test_fetch_course_refuses_a_file_and_keeps_a_learners_work(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(material.FetchError, match="is a file, not a folder"):
        material.fetch(tmp_path / "f")
    mine = tmp_path / "w" / "exercises" / "ex03_gradient_buckets.py"
    mine.parent.mkdir(parents=True)
    mine.write_text("# my work\n")
    with pytest.raises(material.FetchError, match="already holds exercises/ex03_gradient_buckets.py"):
        material.fetch(tmp_path / "w")
    assert mine.read_text() == "# my work\n" and sorted(os.listdir(tmp_path / "w")) == ["exercises"]


def _stanza() -> str:
    """The first cell's lines up to its one line of output, from notebook 00."""
    first = next(c for c in json.loads(NOTEBOOKS[0].read_text())["cells"] if c["cell_type"] == "code")
    text = "".join(first["source"])
    return text[:text.index("\n", text.index('print(f"gpucourse: installed from')) + 1]


def test_every_notebook_starts_by_installing_the_course_where_it_is_missing():
    stanza = _stanza()
    assert stanza.startswith("import importlib.util\nimport os\n") and 'find_spec("gpucourse") is None' in stanza
    for path in NOTEBOOKS:
        first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert "".join(first["source"]).startswith(stanza), f"{path.name}'s first cell does not install the course"


@pytest.mark.parametrize("beside, given, expected", [
    (["gpucourse-0.1.0-py3-none-any.whl"], None, "gpucourse-0.1.0-py3-none-any.whl"),
    (["gpucourse-0.1.0-py3-none-any.whl"], "https://example.org/gpucourse.whl", "https://example.org/gpucourse.whl"),
    ([], None, None),
])
def test_the_first_cell_installs_from_the_wheel_beside_it_or_what_the_learner_gives(tmp_path, monkeypatch, capsys,
                                                                                     beside, given, expected):
    import importlib.util

    for name in beside:
        (tmp_path / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as where gpucourse is not installed
    if given:
        monkeypatch.setenv("GPUCOURSE_SOURCE", given)
    else:
        monkeypatch.delenv("GPUCOURSE_SOURCE", raising=False)
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append(argv))
    if expected is None:
        with pytest.raises(ImportError, match="put its wheel .make dist. beside this notebook") as e:
            exec(_stanza(), {})
        assert "\n" not in str(e.value)
        return
    exec(_stanza(), {})
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", expected]]
    assert capsys.readouterr().out == f"gpucourse: installed from {expected} (gpucourse fetch-course DIR copies out " \
                                      f"the exercises)\n"
