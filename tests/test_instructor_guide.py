"""docs/instructor.md against the code: each number the guide states about the course, the grader or the workshop
(counts, totals, defaults, timeouts, how the GPUs are shared) is read from the guide and compared with the constant
or the function it describes; and its commands work as typed in a new shell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpucourse import grading
from gpucourse.workshop import accounts, collect, dashboard, hub, plan
from gpucourse.workshop.errors import WorkshopError

REPO = Path(__file__).resolve().parents[1]
GUIDE = (REPO / "docs" / "instructor.md").read_text(encoding="utf-8")
PROSE = " ".join(GUIDE.split())  # sentences whole, across the file's line breaks
BASH = re.findall(r"^```bash\n(.*?)^```", GUIDE, re.S | re.M)
WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "ten": 10, "fourteen": 14, "fifteen": 15,
         "sixteen": 16, "seventeen": 17}


def said(pattern: str) -> list[str]:
    """Every match of ``pattern``'s first group in the guide's prose; at least one."""
    found = re.findall(pattern, PROSE)
    assert found, f"the guide no longer says {pattern!r}"
    return found


def number(text: str) -> int:
    return WORDS[text] if text in WORDS else int(text)


def test_the_guide_counts_the_notebooks_and_exercises_there_are():
    notebooks = sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb"))
    exercises = grading.exercises()
    assert {number(n) for n in said(r"(\w+) notebooks in `notebooks/`")} == {len(notebooks)}
    assert {number(n) for n in said(r"for all (\w+)\)")} == {len(notebooks)}
    assert {number(n) for n in said(r"and (\w+) exercises in `exercises/`")} == {len(exercises)}
    # The table of notebooks: one row per notebook, and each exercise named once.
    rows = re.findall(r"^\| `(\w+)` \|.*\| (.+) \|$", GUIDE, re.M)
    assert [name for name, _ in rows] == notebooks
    named = re.findall(r"`(ex\d\d)`", " ".join(cell for _, cell in rows))
    assert sorted(named) == sorted(exercises)
    modules = sorted(ex.module for ex in exercises.values())
    assert f"`{modules[0]}.py` … `{modules[-1]}.py`" in PROSE


def test_the_grader_totals_and_timeout_the_guide_states():
    exercises = grading.exercises().values()
    total = sum(ex.max_score for ex in exercises)
    [command] = [line for block in BASH for line in block.splitlines() if "grade --path solutions" in line]
    assert command.endswith(f": {total}/{total}"), command
    assert {ex.max_score for ex in exercises} == {number(n) for n in said(r"\(points out of (\d+)\)")}
    assert said(r"\(`--timeout`, (\d+) s on a quiet machine\)") == [f"{grading.DEFAULT_TIMEOUT_S:g}"]
    most_ranks = max(check.world_size or 1 for ex in exercises for check in ex.checks)
    assert said(r"a distributed check runs up to (\d+) ranks") == [str(most_ranks)]


def test_the_exercises_said_to_check_their_contracts_are_those_that_do():
    """'Exercises 1–4, 6, 8, 11, 12 and 14–16 use it (5, 7, 9 and 13 take no tensors; 10 returns floats)': each
    exercise is named once, and those said to use it are those whose checks import the contracts."""
    def numbers(text: str) -> set[int]:
        found = set()
        for a, b in re.findall(r"(\d+)(?:–(\d+))?", text):
            found |= set(range(int(a), int(b or a) + 1))
        return found

    use, rest = re.search(r"Exercises ([\d–, and]+) use it \(([^)]*)\)", PROSE).groups()
    checks = REPO / "gpucourse" / "grading" / "checks"
    with_contracts = {int(p.name[2:4]) for p in checks.glob("ex*.py") if "contracts" in p.read_text()}
    assert numbers(use) == with_contracts
    assert sorted([*numbers(use), *numbers(rest)]) == sorted(int(ex[2:]) for ex in grading.exercises())


def test_the_workshop_defaults_the_guide_states(monkeypatch):
    from jupyter_client.restarter import KernelRestarter
    from jupyterhub.spawner import Spawner

    assert said(r"\(default (\d+)\) behind its proxy") == [str(hub.DEFAULT_PORT)]
    assert said(r"answers through the proxy \(up to (\d+) minutes\)") == [f"{hub.START_TIMEOUT_S / 60:g}"]
    assert said(r"It redraws itself every (\d+) seconds") == [str(dashboard.REFRESH_S)]
    assert {number(n) for n in said(r"gave up on after (\w+) restarts")} == {KernelRestarter.restart_limit.default_value}
    # The hub asks SLURM at JupyterHub's own interval: the workshop does not set another.
    assert said(r"every (\d+) seconds \(JupyterHub's `Spawner.poll_interval`\)") == \
        [str(Spawner.poll_interval.default_value)]
    assert "poll_interval" not in (REPO / "gpucourse" / "workshop" / "hub.py").read_text()
    monkeypatch.setattr(collect.os, "cpu_count", lambda: 16)
    assert said(r"\(default cores ÷ (\d+)\)") == [str(16 // collect.default_jobs())]
    seeds = re.search(r'"--seeds", type=int, default=(\d+)', (REPO / "scripts" / "mutant-stability").read_text())
    assert said(r"grades each of them under (\d+) seeds") == [seeds.group(1)]


def test_what_start_prints_in_the_guide_is_what_it_prints():
    """The guide's example output: 3 seats on 8 GPUs and 24 cores, on the default port."""
    shown = re.search(r"^```\n(workshop started in .*?)^```", GUIDE, re.S | re.M).group(1)
    example = plan.make_plan({name: Path("/x") / name for name in plan.seat_names(3)}, [str(i) for i in range(8)],
                             cores=24)
    url = hub.address(hub.DEFAULT_PORT, False)
    assert shown.splitlines()[0].endswith(f": {url}")
    for note in example.notes:
        assert f"\n  {note}\n" in shown
    assert f"ssh -L {hub.DEFAULT_PORT}:127.0.0.1:{hub.DEFAULT_PORT} <this server>, then open {url}" in shown


@pytest.mark.parametrize("gpus, seats", [(8, 4), (8, 3), (8, 2), (2, 4)])
def test_the_guides_table_of_shared_gpus(gpus, seats):
    row = re.search(rf"^\| {gpus} \| {seats} \| (.+) \|$", GUIDE, re.M).group(1)
    try:
        shared = plan.partition([str(i) for i in range(gpus)], seats)
    except WorkshopError as e:
        assert row.startswith("refused: ") and row[len("refused: "):].replace("`", "") in str(e), (row, str(e))
        return
    per_seat = {len(s) for s in shared.per_seat}
    assert row.startswith(f"{per_seat.pop()}") and not per_seat
    if "each" not in row:
        assert re.findall(r"`([\d,]+)`", row) == [",".join(s) for s in shared.per_seat]
    assert ("left idle" in row) == bool(shared.idle)
    if shared.idle:
        assert f"GPUs {' and '.join(shared.idle)} are left idle" in row


def test_the_test_run_the_guide_describes_is_the_suites():
    source = (REPO / "tests" / "test_workshop.py").read_text()
    seats, rounds = re.search(r"^STRESS_SEATS, STRESS_ROUNDS = (\d+), (\d+)$", source, re.M).groups()
    real_test = source.split("def test_a_real_workshop")[1].split("\ndef ")[0]
    [real] = re.findall(r'"workshop", "start", "--seats", "(\d+)"', real_test)
    said_real, said_seats, said_rounds = re.search(
        r"a real (\d+)-seat workshop, and (\d+) seats\s+# opening a notebook in the same second (\d+) times",
        " ".join(BASH[0].split())).groups()
    assert (said_real, said_seats, said_rounds) == (real, seats, rounds)
    [block] = [b for b in BASH if "workshop start --seats" in b and "workshop stop" in b]
    assert len(block.strip().splitlines()) == 5 and "## A workshop in five commands" in GUIDE


def test_the_guides_commands_work_as_typed_in_a_new_shell():
    """make puts gpucourse in .venv/bin, which no new shell has on its PATH (the README says so too): the guide
    activates the environment before its first bare 'gpucourse', says to do so in each new shell, and never runs
    'sudo gpucourse', which sudo's own PATH does not find."""
    lines = [line.split("#")[0].strip() for block in BASH for line in block.splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("gpucourse "))
    assert "source .venv/bin/activate" in lines[:first]
    assert "`source .venv/bin/activate`" in said(r"in a shell where (`[^`]+`) has run")
    assert "source .venv/bin/activate" in (REPO / "README.md").read_text()
    typed = lines + re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", GUIDE, flags=re.S | re.M))
    assert not [t for t in typed if t.startswith("sudo gpucourse")]


def test_the_seat_users_the_guide_names_are_the_ones_made():
    """The guide's `gc<id>-seat01`, "<id>: the first six characters of the workshop's id"."""
    guide = " ".join(GUIDE.split())
    assert "`gc<id>-seat01` (`<id>`: the first six characters of the workshop's id)" in guide
    assert accounts.account_name("1a2b3c4d5e6f7a8b", "seat01") == "gc1a2b3c-seat01"
