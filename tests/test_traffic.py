"""The kernel's count of what ranks send each other (gpucourse.grading.traffic): gloo's framing measured on real
gloo ranks against the wire model the checks use, a collective called through a process group's backend seen
though no recorder saw it, and a grader that cannot read the counters saying so and grading as before."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpucourse import grading
from gpucourse.grading import runner, traffic

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the counters are Linux's")]

REPO = Path(__file__).resolve().parents[1]
CHEATS = REPO / "tests" / "mutants" / "cheats"


def _rows(splits: list[int]) -> torch.Tensor:
    return torch.ones(sum(splits), 5)


def _rank(rank: int, world: int, port: int, conn) -> None:
    """A gloo rank that runs the operations the test names, one at a time, and says when each is done. The store
    is the test's (its server in the test process), as the launcher's is in the grader: never a rank's."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    pair = dist.new_group([0, 1])
    dist.barrier()
    conn.send(os.getpid())
    while (op := conn.recv()) is not None:
        name, arg = op
        if name == "send" and rank in (0, 1):
            x = torch.zeros(arg, dtype=torch.uint8)
            dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
        elif name == "irecv_first" and rank in (0, 1):
            x = torch.zeros(arg, dtype=torch.uint8)
            (dist.irecv(x, 0) if rank == 1 else dist.isend(x, 1)).wait()
        elif name == "all_to_all":
            ins, outs = [(rank + s) % 3 for s in range(world)], [(s + rank) % 3 for s in range(world)]
            dist.all_to_all_single(_rows(outs), _rows(ins), outs, ins)
        elif name == "all_reduce_of_two" and rank in (0, 1):
            dist.all_reduce(torch.ones(arg), group=pair)
        elif name == "all_gather_of_two" and rank in (0, 1):
            dist.all_gather_single(torch.empty(2 * arg), torch.ones(arg), group=pair)
        elif name == "reduce_scatter_of_two" and rank in (0, 1):
            dist.reduce_scatter_single(torch.empty(arg), torch.ones(2 * arg), group=pair)
        elif name == "barrier":
            dist.barrier()
        elif name == "backend_allreduce":
            dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).allreduce(
                [torch.ones(arg)]).wait()
        conn.send("done")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    """Three gloo ranks in processes of their own, and a way to run an operation on them and count its bytes."""
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)
    pipes, procs = [], []
    for rank in range(3):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(rank, 3, store.port, theirs), daemon=True)
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    meter = traffic.Meter({rank: pipe.recv() for rank, pipe in enumerate(pipes)})

    def run(name: str, arg: int = 0) -> traffic.Traffic:
        before = meter.read(quiet=True)
        for pipe in pipes:
            pipe.send((name, arg))
        for pipe in pipes:
            assert pipe.recv() == "done"
        return traffic.Traffic(before, meter.read(quiet=True))

    yield run
    for pipe in pipes:
        pipe.send(None)
    for proc in procs:
        proc.join(30)
    del store


def _records(name: str, arg: int) -> dict[int, list[dict]]:
    """What the grader's recorder writes down for the operation (its op names, global ranks)."""
    if name in ("send", "irecv_first"):
        return {0: [{"op": "send", "bytes": arg, "peer": 1}], 1: [{"op": "recv", "bytes": arg, "peer": 0}], 2: []}
    if name == "all_to_all":
        return {r: [{"op": "all_to_all", "to": {s: (r + s) % 3 * 20 for s in range(3)}}] for r in range(3)}
    return {r: [{"op": "barrier", "to": dict.fromkeys(range(3), 0)}] for r in range(3)}


@pytest.mark.parametrize("name, arg", [("send", 0), ("send", 1), ("send", 4000), ("send", 100_000),
                                       ("irecv_first", 333), ("all_to_all", 0), ("barrier", 0)])
def test_gloo_framing_is_what_the_wire_model_says(ranks, name, arg):
    """A message of k bytes is k + 96 bytes one way and 48 the other, whatever k is and whichever side starts
    first; an all-to-all is one message to every other rank (empty ones too), a barrier one empty message."""
    counted = ranks(name, arg)
    records = _records(name, arg)
    assert counted.pairs() == {pair: b for pair, b in traffic.expected(records)[0].items() if b}
    assert traffic.unexplained(counted, records) is None
    if name == "send":
        assert counted.pairs() == {(0, 1): arg + 2 * traffic.HEADER, (1, 0): traffic.HEADER}
        assert traffic.payloads(counted, records) == ({(0, 1): arg} if arg else {})


@pytest.mark.parametrize("numel", [1, 2, 3, 4, 5, 6, 7, 9, 10, 1000, 250_000])
def test_an_all_reduce_of_two_ranks_is_four_segments_each_way(ranks, numel):
    """Four segments of ceil(numel / 4) elements, the empty ones not sent: 5, 6 and 9 elements make 3."""
    assert ranks("all_reduce_of_two", numel).pairs() == dict.fromkeys([(0, 1), (1, 0)],
                                                                      traffic.all_reduce_of_two(numel, 4))


@pytest.mark.parametrize("numel", [1, 3, 7, 13, 100, 1000])
def test_an_all_gather_and_a_reduce_scatter_of_two_ranks(ranks, numel):
    """An all-gather sends a rank's piece and 288 bytes of framing each way; a reduce-scatter of 2·numel elements
    sends what an all-reduce of them sends (gloo reduces the whole buffer)."""
    pair = [(0, 1), (1, 0)]
    assert ranks("all_gather_of_two", numel).pairs() == dict.fromkeys(pair, traffic.all_gather_of_two(numel, 4))
    assert ranks("reduce_scatter_of_two", numel).pairs() == dict.fromkeys(pair,
                                                                          traffic.reduce_scatter_of_two(2 * numel, 4))


def test_a_backend_collective_no_recorder_saw_is_counted(ranks):
    counted = ranks("backend_allreduce", 3000)
    # A ring all-reduce on 3 ranks: each rank sends 2/3 of the 12000 bytes on, in segments, and its framing.
    assert all(sum(counted.sent_by(r).values()) > 2 * 12000 // 3 for r in range(3)), counted.pairs()
    problem = traffic.unexplained(counted, {r: [] for r in range(3)})
    assert problem and "by the kernel's count" in problem and "account for 0" in problem


def test_a_message_sent_and_not_received_is_told(ranks):
    records = _records("send", 10)
    records[1] = []  # rank 1's receive left out of its records
    counted = ranks("send", 10)
    assert "every message sent must be received" in traffic.unexplained(counted, records)


def test_a_meter_that_cannot_list_a_ranks_sockets_says_why():
    meter = traffic.Meter({0: os.getpid(), 1: 2**22 + 12345})  # no such process
    with pytest.raises(traffic.Unavailable, match="could not list rank 1's sockets"):
        meter.read()


def test_a_forbidden_collective_through_the_backend_fails_every_check_that_calls_it(tmp_path, marked):
    """Exercise 12 switches the all-gather off; its counts exchanged by the backend's all-gather (which scored 9 of
    10 when the checks trusted the recorder) fail every check on several ranks, by the kernel's count."""
    cheat = tmp_path / "ex12_expert_dispatch.py"
    shutil.copy(CHEATS / "ex12_backend_allgather.py", cheat)
    (result,) = runner.grade_runs([("ex12", str(cheat), 5)])
    for check in result["checks"]:
        if (check["world_size"] or 1) > 1:
            assert check["points"] == 0 and "by the kernel's count" in check["message"], check
    assert result["score"] == 1, result


def test_without_the_counters_the_grade_says_so_and_grades_by_the_records(tmp_path, monkeypatch, marked):
    """Where the kernel cannot be asked, the solution still gets full marks, a cheat the records cannot see
    scores as it did before the counters (the bytes check fails, by the records, and says so), and the grade's
    warning says why."""
    site = tmp_path / "site"
    site.mkdir()
    # Only the grading process (gpucourse.grading.start) loses the counters; the sandbox and its ranks are as ever.
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'gpucourse.grading.start' in sys.orig_argv:\n"
        "    from gpucourse.grading import traffic\n"
        "    def _read(self):\n"
        "        raise traffic.Unavailable('inet_diag is switched off on this test machine')\n"
        "    traffic.Meter._read = _read\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    cheat = tmp_path / "cheat" / "ex01_ring_allreduce.py"
    cheat.parent.mkdir()
    shutil.copy(CHEATS / "ex01_backend_allreduce.py", cheat)
    solved, cheated = runner.grade_runs([("ex01", str(REPO / "solutions" / "ex01_ring_allreduce.py"), 4),
                                         ("ex01", str(cheat), 4)])
    for result in (solved, cheated):
        assert "not counted by the kernel: inet_diag is switched off" in result["warning"], result.get("warning")
    assert solved["score"] == 10
    checks = {c["name"]: c for c in cheated["checks"]}
    bytes_check = grading.find_exercise("ex01").checks[4].name
    assert cheated["score"] == 9 and checks[bytes_check]["points"] == 0
    assert "by the ranks' own records" in checks[bytes_check]["message"], checks[bytes_check]["message"]
