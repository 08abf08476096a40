"""Troubleshooting: a hang names each rank's pending collective; every planted fault prints its
symptom, diagnosis and fix, ends quickly and leaves no process behind; the checks name step and rank."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

from gpucourse import cli
from gpucourse.course import troubleshoot
from gpucourse.runtime import collective_status
from gpucourse.runtime.collective_status import diagnose_hang

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_children")]

_RESULTS: dict = {}


def scenario(name: str) -> tuple[dict, str]:
    """Run a scenario once per test session: (its result, what it printed)."""
    if name not in _RESULTS:
        out = io.StringIO()
        _RESULTS[name] = (troubleshoot.run(name, stream=out), out.getvalue())
    return _RESULTS[name]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_desync_times_out_naming_each_ranks_pending_collective():
    found, printed = scenario("desync")
    assert found["error"] == "LaunchTimeout"
    assert found["elapsed_s"] < troubleshoot.HANG_TIMEOUT_S + 10
    symptom = found["symptom"]
    assert f"did not finish within {troubleshoot.HANG_TIMEOUT_S} s" in symptom
    lines = {r: next(line for line in symptom.splitlines() if line.strip().startswith(f"rank {r}:")) for r in (0, 1)}
    assert "waiting in #" in lines[0] and "barrier()" in lines[0]
    assert "waiting in #" in lines[1] and "all_reduce(float32[" in lines[1]
    assert "last finished #" in lines[0] and "last finished #" in lines[1]
    assert "disagree about collective #" in printed


@pytest.mark.parametrize("name", list(troubleshoot.SCENARIOS))
def test_every_scenario_prints_symptom_diagnosis_and_fix_and_leaves_no_process(name):
    found, printed = scenario(name)
    for section in ("symptom (what you see):", "diagnosis:", "fix:"):
        assert section in printed
    assert found["error"] is not None, "the planted fault must show"
    assert found["pids"], "the ranks reported their pids"
    assert found["left_behind"] == []
    assert all(gone(pid) for pid in found["pids"])


def test_nan_is_caught_at_its_step_on_its_rank():
    found, _ = scenario("nan")
    assert found["error"] == "NonFiniteLoss"
    assert f"at step {troubleshoot.FAULT_STEP} on rank 1" in found["symptom"]


def test_crash_names_the_rank_and_its_error():
    found, _ = scenario("crash")
    assert "rank 1 failed: IndexError" in found["symptom"]


def test_oom_fails_then_the_fix_fits():
    found, printed = scenario("oom")
    assert found["error"] in ("OutOfMemoryBudget", "OutOfMemoryError"), found["symptom"]
    assert "within the" in printed and "budget" in printed


def test_shape_mismatch_is_named_by_torch_distributed_debug():
    _, printed = scenario("shape-mismatch")
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in printed
    assert "shape [4]" in printed and "shape [3]" in printed


def test_check_finite_names_step_rank_and_parameters():
    troubleshoot.check_finite(1.5, 3, 0)
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[0] = math.nan
    with pytest.raises(troubleshoot.NonFiniteLoss, match="loss is nan at step 7 on rank 1; non-finite parameters: bias"):
        troubleshoot.check_finite(math.nan, 7, 1, model)


def test_check_budget():
    troubleshoot.check_budget({"weights": 10, "activations": 10}, 20, 0, 0)
    with pytest.raises(troubleshoot.OutOfMemoryBudget, match="rank 1 needs .* at step 0"):
        troubleshoot.check_budget({"weights": 10 << 20, "activations": 10 << 20}, 16 << 20, 0, 1)


class _Work(dist.Work):
    def __init__(self):
        super().__init__()
        self.waited = False

    def wait(self, timeout=None):
        self.waited = True
        return True


def test_status_file_records_each_call_and_async_waits(tmp_path):
    path = str(tmp_path / "status-0.json")
    original = dist.all_reduce
    collective_status.install(path)
    assert dist.all_reduce is not original
    try:
        seen_inside = {}

        def blocking(*args, **kwargs):
            seen_inside.update(collective_status.read(path))

        collective_status.tracked("all_reduce", blocking)(torch.ones(4, 2))
        assert seen_inside["waiting"] == "#1 all_reduce(float32[4,2])"
        note = collective_status.read(path)
        assert note == {"waiting": "", "finished": "#1 all_reduce(float32[4,2])", "launched": ""}
        assert collective_status.explain(note) == "not in a collective — last finished #1 all_reduce(float32[4,2])"

        work = collective_status.tracked("send", lambda *a, **k: _Work())(torch.ones(3, dtype=torch.bfloat16), 1)
        assert isinstance(work, dist.Work)
        note = collective_status.read(path)
        assert note["launched"] == "#2 send(bfloat16[3]) to rank 1" and note["waiting"] == ""
        assert "not yet waited for" in collective_status.explain(note)
        assert work.wait() is True and work._work.waited
        assert collective_status.read(path)["finished"] == "#2 send(bfloat16[3]) to rank 1"
        assert collective_status.calls() == 2
    finally:
        collective_status.uninstall()
    assert dist.all_reduce is original


def test_explain_and_waiting_in_read_each_other():
    line = collective_status.explain({"waiting": "#3 barrier()", "finished": "#2 all_reduce(float32[1024])",
                                      "launched": ""})
    assert line == "waiting in #3 barrier() — last finished #2 all_reduce(float32[1024])"
    assert collective_status.waiting_in(line) == (3, "barrier()")
    assert collective_status.waiting_in("not in a collective — last finished #2 x()") is None
    text = diagnose_hang({0: line, 1: "waiting in #3 all_reduce(float32[4]) — last finished #2 x()"})
    assert "disagree about collective #3" in text


def test_diagnose_hang_names_the_ranks_that_left():
    """One rank left the loop early (a break on its own data); the others wait in the next step's all-reduce."""
    waiting = {0: "not in a collective — last finished #12 all_reduce(float32[1])",
               1: "waiting in #13 all_reduce(float32[1,3]) — last finished #12 all_reduce(float32[1])",
               2: "waiting in #13 all_reduce(float32[1,3]) — last finished #12 all_reduce(float32[1])"}
    text = diagnose_hang(waiting)
    assert text.startswith("Ranks 1, 2 wait in collective #13 (all_reduce(float32[1,3])) for rank 0, which never")
    assert "suspect the network" not in text
    alone = diagnose_hang({0: waiting[1], 1: waiting[2]})
    assert "Every rank waits in the same collective #13" in alone
    assert alone.index("different shapes") < alone.index("suspect the network")  # the common cause first


def test_tracking_costs_a_few_microseconds_per_call():
    # 65 all-reduces per step of dp=2 tiny scratch training; a step takes tens of ms, so
    # anything under 10 us a call keeps the tracking well under 1 % of it.
    assert troubleshoot._per_call_cost(5000) < 10e-6


def test_troubleshoot_command(capsys):
    assert cli.main(["troubleshoot", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in troubleshoot.SCENARIOS)
    assert cli.main(["troubleshoot", "gremlins"]) == 2
    assert "no scenario 'gremlins'" in capsys.readouterr().err
