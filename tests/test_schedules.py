"""Pipeline schedules are data: every one validates, and the simulator reproduces the textbook numbers.

Cost model of the formulas: every stage takes the same time for a forward (F)
and the same for a backward (B), transfers are free, and a send waits for its
receive (a rendezvous). Then naive idles (p-1)/p of stage-time, and GPipe and
1F1B idle (p-1)/(m+p-1), for F = B and for any other F, B as well.
"""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucourse import cli
from gpucourse.parallel.schedules import (B, F, RECV_F, SCHEDULES, SEND_F, Op, ScheduleError, build,
                                          formula_bubble, simulate, validate)

pp_s = st.integers(1, 8)
m_s = st.integers(1, 32)
name_s = st.sampled_from(sorted(SCHEDULES))


@settings(max_examples=150, deadline=None)
@given(name=name_s, pp=pp_s, m=m_s)
def test_every_schedule_validates_and_runs_each_microbatch_once(name, pp, m):
    schedule = build(name, pp, m)
    validate(schedule, pp, m)
    for s, ops in enumerate(schedule):
        assert sorted(op.microbatch for op in ops if op.kind == F) == list(range(m))
        assert sorted(op.microbatch for op in ops if op.kind == B) == list(range(m))
        kinds = {op.kind for op in ops}
        assert (RECV_F in kinds) == (s > 0) and (SEND_F in kinds) == (s < pp - 1)


@settings(max_examples=150, deadline=None)
@given(name=name_s, pp=pp_s, m=m_s, cost=st.sampled_from([(1, 1), (1, 2), (2, 3)]))
def test_bubble_fraction_matches_the_formula(name, pp, m, cost):
    sim = simulate(build(name, pp, m), pp, m, cost_f=cost[0], cost_b=cost[1])
    assert sim.bubble_fraction == pytest.approx(formula_bubble(name, pp, m), abs=1e-12)
    expected = (pp - 1) / pp if name == "naive" else (pp - 1) / (m + pp - 1)
    assert sim.bubble_fraction == pytest.approx(expected, abs=1e-12)
    per_pass = cost[0] + cost[1]
    assert sim.makespan == pytest.approx(m * pp * per_pass if name == "naive" else (m + pp - 1) * per_pass)
    for s in range(pp):
        assert sim.busy[s] + sim.comm[s] + sim.idle[s] == pytest.approx(sim.makespan)


@settings(max_examples=150, deadline=None)
@given(pp=pp_s, m=m_s)
def test_activations_held(pp, m):
    assert simulate(build("gpipe", pp, m), pp, m).peak_in_flight == [m] * pp
    assert simulate(build("naive", pp, m), pp, m).peak_in_flight == [1] * pp
    peak = simulate(build("1f1b", pp, m), pp, m).peak_in_flight
    assert peak[0] == min(pp, m)
    assert peak == [min(pp - s, m) for s in range(pp)]
    assert max(peak) <= pp


@settings(max_examples=50, deadline=None)
@given(name=name_s, pp=st.integers(2, 6), m=st.integers(1, 12), comm=st.sampled_from([0.5, 1, 3]))
def test_transfers_that_cost_time_never_shorten_a_step(name, pp, m, comm):
    schedule = build(name, pp, m)
    free, paid = simulate(schedule, pp, m), simulate(schedule, pp, m, cost_comm=comm)
    assert paid.makespan >= free.makespan
    assert paid.bubble_fraction >= free.bubble_fraction
    assert paid.comm[0] == pytest.approx(comm * sum(op.kind not in (F, B) for op in schedule[0]))


def test_per_stage_costs_move_the_bubble_to_the_fast_stages():
    sim = simulate(build("1f1b", 3, 6), 3, 6, cost_f=[1, 1, 2], cost_b=[2, 2, 4])
    assert sim.busy == [18, 18, 36]
    assert sim.idle[0] > sim.idle[2]


def _receives_swapped(pp=3, m=4):
    """Stage 1 receives microbatch 1's activation before 0's, whole forwards swapped so each stage alone is fine."""
    schedule = build("gpipe", pp, m)
    ops = schedule[1]
    first, second = ops[0:3], ops[3:6]  # RECV_F0 F0 SEND_F0, RECV_F1 F1 SEND_F1
    ops[0:6] = second + first
    return schedule


def test_receives_out_of_order_are_rejected():
    with pytest.raises(ScheduleError, match="transfer 0 from stage 0 to stage 1 does not match"):
        validate(_receives_swapped(), 3, 4)


def test_backward_before_forward_is_rejected():
    schedule = build("gpipe", 2, 2)
    schedule[0].remove(Op(B, 1))
    schedule[0].insert(0, Op(B, 1))
    with pytest.raises(ScheduleError, match=r"stage 0, op 0 \(B1\): comes before F1"):
        validate(schedule, 2, 2)


def test_a_forward_before_its_activation_arrived_is_rejected():
    schedule = build("1f1b", 2, 2)
    schedule[1][0], schedule[1][1] = schedule[1][1], schedule[1][0]  # F0 before RECV_F0
    with pytest.raises(ScheduleError, match="comes before RECV_F0"):
        validate(schedule, 2, 2)


def test_sending_before_receiving_deadlocks_1f1b_and_the_error_says_where():
    """The 1F1B order with SEND_F before RECV_B: stage s waits to send to s+1, which waits to send back."""
    schedule = build("1f1b", 4, 8)
    for ops in schedule[:-1]:
        for n in range(len(ops) - 1):
            if ops[n].kind == "RECV_B" and ops[n + 1].kind == "SEND_F":
                ops[n], ops[n + 1] = ops[n + 1], ops[n]
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits in op 7 \(SEND_F3\);.*"
                                            r"stage 3 waits in op 3 \(SEND_B0\)"):
        validate(schedule, 4, 8)


def test_missing_and_duplicated_ops_are_rejected():
    schedule = build("naive", 2, 3)
    schedule[1] = [op for op in schedule[1] if op != Op(B, 2)]
    with pytest.raises(ScheduleError):
        validate(schedule, 2, 3)
    schedule = build("naive", 1, 2)
    schedule[0].append(Op(F, 0))
    with pytest.raises(ScheduleError, match="done twice"):
        validate(schedule, 1, 2)
    with pytest.raises(ScheduleError, match="no neighbour"):
        validate([[Op(RECV_F, 0), Op(F, 0), Op(B, 0)]], 1, 1)


def test_far_past_one_machine_is_fast():
    start = time.process_time()  # CPU time: others' load on the machine does not count
    schedule = build("1f1b", 64, 1024)
    validate(schedule, 64, 1024)
    sim = simulate(schedule, 64, 1024)
    assert sim.bubble_fraction == pytest.approx(63 / (1024 + 63))
    assert sim.peak_in_flight[0] == 64
    assert time.process_time() - start < 15  # about 3 s here


def test_cli_prints_the_gantt_and_the_numbers(capsys, tmp_path):
    out_json = tmp_path / "s.json"
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b",
                     "--cost-b", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "stage 3 | .. .. .. F0 B0 F1 B1" in out
    assert "bubble          27.3%" in out
    assert "peak in flight  4 3 2 1" in out
    data = json.loads(out_json.read_text())
    assert data["bubble_fraction"] == pytest.approx(3 / 11)
    assert data["ops"][3][:3] == ["RECV_F0", "F0", "B0"]


@pytest.mark.parametrize("argv, message", [
    (["--pp", "0"], "--pp 0 must be at least 1."),
    (["--schedule", "zero-bubble"],
     "--schedule 'zero-bubble' is not one of naive, gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zbv, dualpipev."),
    (["--microbatches", "-3"], "--microbatches -3 must be at least 1."),
    (["--schedule", "interleaved-1f1b", "--microbatches", "6"],
     "interleaved-1f1b sends microbatches through a chunk pp at a time: microbatches=6 must be a multiple of pp=4."),
    (["--schedule", "zb-h1", "--virtual-stages", "3"],
     "--virtual-stages sets the chunks per rank of interleaved-1f1b and looped-bfs (zbv and dualpipev have 2, the "
     "others 1)."),
    (["--schedule", "dualpipev", "--microbatches", "6"],
     "dualpipev fills all 2 chunks of every rank: microbatches=6 must be at least 2 × pp = 8."),
])
def test_cli_bad_input_is_one_sentence_and_exit_2(argv, message, capsys):
    assert cli.main(["schedule", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"gpucourse: error: {message}"
    assert out == ""


# --- virtual stages and the split backward (schedules_virtual.py): simulated, no ranks -------------------------

from gpucourse.parallel import schedules  # noqa: E402
from gpucourse.parallel import schedules_virtual as virtual  # noqa: E402


def _awaiting_b_peak(sim, layout, rank: int) -> int:
    """Most (microbatch, chunk)s forwarded but not yet B'd on ``rank`` at once."""
    held = peak = 0
    for op, _, _ in sim.timeline[rank]:
        held += 1 if op.kind == schedules.F else -1 if op.kind == schedules.B else 0
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 6), (3, 6), (4, 4), (4, 8), (4, 12), (6, 12), (8, 16)])
def test_interleaving_divides_the_bubble_by_v(pp, m):
    one = schedules.simulate(schedules.one_f_one_b(pp, m), pp, m, 1.0, 2.0, 0.0)
    # The two definitions, side by side: idle over total time, and the same idle over compute time.
    assert one.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert one.bubble_ratio == pytest.approx((pp - 1) / m) == pytest.approx(schedules.formula_bubble_ratio("1f1b", pp, m))
    assert one.bubble_ratio == pytest.approx(one.bubble_fraction / (1 - one.bubble_fraction))
    for v in (2, 3):
        ops, layout = virtual.build("interleaved-1f1b", pp, m, v)
        virtual.validate(ops, layout, m)
        sim = virtual.simulate(ops, layout, m, cost_f=1.0, cost_b=2.0, cost_w=0.0)
        assert sim.bubble_ratio == pytest.approx((pp - 1) / (v * m))
        assert sim.bubble_ratio == pytest.approx(virtual.formula_bubble_ratio("interleaved-1f1b", pp, m, v))
        # v times the transfers: every chunk boundary but the model's two ends crosses ranks.
        sends = sum(op.kind in (schedules.SEND_F, schedules.SEND_B) for row in ops for op in row)
        assert sends == 2 * m * (pp * v - 1)


@pytest.mark.parametrize("pp, m", [(2, 2), (3, 6), (4, 8), (4, 5), (8, 16), (5, 20)])
def test_zero_bubble_h1_cuts_1f1bs_bubble_to_a_third_at_its_memory(pp, m):
    ops, layout = virtual.build("zb-h1", pp, m)
    virtual.validate(ops, layout, m)
    sim = virtual.simulate(ops, layout, m, cost_f=1.0, cost_b=1.0, cost_w=1.0)
    one = schedules.simulate(schedules.one_f_one_b(pp, m), pp, m, 1.0, 2.0, 0.0)  # B + W in one backward
    # Zero Bubble's (p−1)(F + B − W) against 1F1B's (p−1)(F + B + W), over the compute 3m.
    assert sim.bubble_ratio == pytest.approx((pp - 1) / (3 * m)) == pytest.approx(one.bubble_ratio / 3)
    for rank in range(pp):
        assert _awaiting_b_peak(sim, layout, rank) <= one.peak_in_flight[rank]  # 1F1B's p − s
        assert sum(op.kind == schedules.W for op in ops[rank]) == m


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (8, 16)])
def test_the_v_schedule_turns_at_the_last_rank_without_a_transfer(pp, m):
    ops, layout = virtual.build("zbv", pp, m)
    assert [(layout.virtual(s, 0), layout.virtual(s, 1)) for s in range(pp)] == [(s, 2 * pp - 1 - s) for s in range(pp)]
    virtual.validate(ops, layout, m)
    sim = virtual.simulate(ops, layout, m, 1.0, 1.0, 1.0)
    h1 = virtual.simulate(*virtual.build("zb-h1", pp, m), m, 1.0, 1.0, 1.0)
    assert sim.bubble_ratio <= h1.bubble_ratio
    last = ops[pp - 1]  # chunk 0 ends and chunk 1 starts on the last rank: no send, no receive between them
    assert not [op for op in last if op.kind == schedules.SEND_F and op.chunk == 0]
    assert not [op for op in last if op.kind == schedules.RECV_F and op.chunk == 1]


@pytest.mark.parametrize("pp", range(1, 9))
def test_dualpipev_runs_for_any_ranks_and_microbatches_with_zero_bubbles_idle(pp):
    """DualPipeV (the V placement, DeepSeek's eight phases): valid and deadlock-free from m = 2p up; with equal
    costs its bubble is no more than ZB-H1's or ZBV's, every (microbatch, chunk) has its W, and a rank holds 2p + 1."""
    for m in sorted({2 * pp, 2 * pp + 3, 32}):
        ops, layout = virtual.build("dualpipev", pp, m)
        assert layout.shape == "v" and layout.v == 2
        virtual.validate(ops, layout, m)
        sim = virtual.simulate(ops, layout, m, 1.0, 1.0, 1.0)
        h1 = virtual.simulate(*virtual.build("zb-h1", pp, m), m, 1.0, 1.0, 1.0)
        zbv = virtual.simulate(*virtual.build("zbv", pp, m), m, 1.0, 1.0, 1.0)
        assert sim.bubble_ratio <= min(h1.bubble_ratio, zbv.bubble_ratio) + 1e-12  # notebook 04b: at most ZBV's
        assert all(sum(op.kind == schedules.W for op in row) == 2 * m for row in ops)
        assert sim.peak_in_flight == [2 * pp + 1] * pp  # notebook 04b: 2p + 1 microbatch-chunks on every rank
    with pytest.raises(schedules.ScheduleError, match="at least 2·pp"):
        virtual.build("dualpipev", pp, 2 * pp - 1)


def test_virtual_schedules_that_cannot_run_say_where():
    ops, layout = virtual.build("interleaved-1f1b", 2, 4, 2)
    swapped = [list(row) for row in ops]
    first_b = next(n for n, op in enumerate(swapped[0]) if op.kind == schedules.B)
    del swapped[0][first_b]
    with pytest.raises(schedules.ScheduleError, match=r"rank 0, op \d+ \(SEND_B0\.1\): comes before B0\.1"):
        virtual.validate(swapped, layout, 4)  # the gradient it would send was never computed
    # Receive a gradient before the forward it belongs to has run anywhere: the receive waits forever.
    stuck = [list(row) for row in ops]
    recv = next(op for op in stuck[0] if op.kind == schedules.RECV_B)
    stuck[0].remove(recv)
    stuck[0].insert(0, recv)
    with pytest.raises(schedules.ScheduleError, match="comes before|deadlock"):
        virtual.validate(stuck, layout, 4)
    with pytest.raises(schedules.ScheduleError, match="multiple of pp=4"):
        virtual.build("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(schedules.ScheduleError, match="is not one of"):
        virtual.build("dualpipe", 4, 8)


def test_virtual_schedules_far_past_one_machine_are_quick():
    start = time.perf_counter()
    ops, layout = virtual.build("interleaved-1f1b", 32, 128, 4)
    sim = virtual.simulate(ops, layout, 128, 1.0, 2.0, 0.0)
    assert sim.bubble_ratio == pytest.approx(31 / (4 * 128))
    assert time.perf_counter() - start < 20


def test_cli_lays_out_the_new_schedules_with_both_bubble_definitions(capsys):
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--cost-b", "1"]) == 0
    out = capsys.readouterr().out
    assert "27.3% of stage-time not computing" in out and "37.5% of the compute time" in out  # 3/11 and 3/8
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved-1f1b",
                     "--virtual-stages", "2", "--cost-b", "1"]) == 0
    out = capsys.readouterr().out
    assert "18.8% of the compute time (Megatron-LM's definition; (p-1)/(v·m) = 18.8%)" in out  # 3/16
    assert cli.main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "B 1, W 1" in out and "12.5% of the compute time" in out  # (p-1)/(3m) = 3/24, a third of 1F1B's
    assert "stage 3 | .. .. .. F0 B0 F1 B1" in out


def test_every_schedule_has_one_record_and_what_it_names_exists():
    """The records cover exactly the builders; the PyTorch classes and torchtitan names they give are real."""
    import torch.distributed.pipelining as pipelining

    from gpucourse.parallel import schedules_virtual
    from gpucourse.parallel.schedule_table import SCHEDULES, get

    assert set(SCHEDULES) == set(schedules.SCHEDULES) | set(schedules_virtual.SCHEDULES)
    for name, record in SCHEDULES.items():
        assert record.name == name and record.virtual == (name in schedules_virtual.SCHEDULES)
        assert record.torch_class is None or hasattr(pipelining, record.torch_class), name
        assert (record.in_flight is None) == record.virtual  # one-chunk: a closed form; else the simulator
    for name in schedules.SCHEDULES:  # the closed forms are what the clock finds
        for pp, m in ((2, 1), (4, 8), (3, 5)):
            sim = schedules.simulate(schedules.build(name, pp, m), pp, m)
            assert get(name).in_flight(pp, m) == sim.peak_in_flight, (name, pp, m)
    with pytest.raises(schedules.ScheduleError, match="is not one of naive"):
        get("zero-bubble")


def test_looped_bfs_has_interleavings_bubble_at_gpipes_memory():
    """Added as a builder and one record: every microbatch through chunk 0, then chunk 1 — the bubble of interleaved
    1F1B once m ≥ p, with all m·v microbatch-chunks held at the peak (interleaved 1F1B holds far fewer)."""
    from gpucourse.modeled.memory import in_flight
    from gpucourse.parallel import schedules_virtual

    for pp, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 3)):
        ops, layout = schedules_virtual.build("looped-bfs", pp, m, v)
        schedules_virtual.validate(ops, layout, m)
        sim = schedules_virtual.simulate(ops, layout, m, 1.0, 2.0, 0.0)
        assert sim.bubble_ratio == pytest.approx((pp - 1) / (v * m))
        assert sim.peak_in_flight == [m * v] * pp and in_flight("looped-bfs", pp, m, v) == [m] * pp
        assert max(in_flight("interleaved-1f1b", pp, m, v)) < m
