"""A run's record replayed on a modeled GPU cluster; waiting for a peer counted as idle; the cost model itself.

Four launches in all (4 ranks: three pipeline schedules; 8 and 2 ranks: data parallelism, plain and bucketed;
1 rank: the baselines); everything else is pure arithmetic on their records.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from gpucourse import ConfigError, TrainConfig, clock, profiling, viz
from gpucourse.modeled.cluster import BASE_LATENCY, LL_BANDWIDTH, LL_LATENCY, TREE_BANDWIDTH, Cluster
from gpucourse.modeled.gpus import get_gpu
from gpucourse.parallel import schedules
from gpucourse.modeled.replay import ReplayError, replay

from launches import train_launches

PP, M = 4, 4
MULTI_CHUNK = ("interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
BASE = dict(steps=3, seq_len=32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    return {name: result for name, (_, result, _) in train_launches(tmp, BASE, {
        4: {**{name: dict(pp=PP, microbatches=M, schedule=name, batch_size=8) for name in ("naive", "gpipe", "1f1b")},
            # The multi-chunk and zero-bubble schedules need two chunks a rank: eight blocks.
            **{name: dict(pp=PP, microbatches=2 * PP, schedule=name, virtual_stages=2, batch_size=16,
                          overrides={"n_layer": 8}) for name in MULTI_CHUNK}},
        8: {"dp8": dict(dp=8, batch_size=64, bucket_mb=0.25)},
        2: {"dp2": dict(dp=2, batch_size=8), "dp2_bucketed": dict(dp=2, batch_size=8, bucket_mb=0.25),
            "straggler": dict(dp=2, batch_size=8, straggler="1:40")},
        1: {"one": dict(batch_size=8), "one_micro4": dict(batch_size=4)},
    }).items()}


def _step_bubble(modeled, step: int) -> float:
    busy = sum(s["end_s"] - s["start_s"] for s in modeled.timeline
               if s["step"] == step and s["kind"] in ("forward", "backward"))
    return 1 - busy / (PP * modeled.step_times_s[step])


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_a_recorded_pipeline_replayed_with_equal_costs_is_the_simulators_schedule(runs, name):
    # Every forward 1, every backward 2, transfers and the optimizer free: the simulator's own assumptions.
    modeled = replay(runs[name], cost=lambda span, seconds: {"forward": 1.0, "backward": 2.0}.get(span["kind"], 0.0))
    sim = schedules.simulate(schedules.build(name, PP, M), PP, M, 1.0, 2.0, 0.0)
    for step in range(BASE["steps"]):
        assert modeled.step_times_s[step] == pytest.approx(sim.makespan, abs=1e-9)
        assert _step_bubble(modeled, step) == pytest.approx(sim.bubble_fraction, abs=1e-12)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", *MULTI_CHUNK])
def test_replay_schedule_and_planner_report_the_same_bubble(runs, name):
    """One schedule model: a recorded run replayed with a forward 1 and a backward 2 (a zero-bubble split: B 1 and
    W 1), transfers free, idles exactly as ``gpucourse schedule`` lays the schedule out, and ``plan.step_time``
    charges that bubble (idle over compute)."""
    from gpucourse.modeled.plan import bubble_ratio, lay_out_schedule

    cfg = runs[name].config
    m = cfg["microbatches"]

    def cost(span, seconds):
        if span["kind"] == "forward":
            return 1.0
        if span["kind"] == "backward":
            return 1.0 if split else 2.0
        return 0.0

    split = any(s["kind"] == "backward" and s["name"].startswith("weights") for s in runs[name].timeline)
    modeled = replay(runs[name], cost=cost)
    sim = lay_out_schedule(name, PP, m, cfg["virtual_stages"])[2]
    chunks = 1 if name in ("gpipe", "1f1b", "zb-h1") else 2  # the simulator prices a chunk's op 1/v of a stage's
    # The first step: later ones may overlap it (under zbv the first rank starts step 2 before the last ends step 1,
    # nothing between steps holding it back), which hides part of the bubble in a long run.
    idle = _step_bubble(modeled, 0)
    assert modeled.step_times_s[0] == pytest.approx(sim.makespan * chunks, abs=1e-9)
    assert idle / (1 - idle) == pytest.approx(bubble_ratio(name, PP, m, cfg["virtual_stages"]), abs=1e-9)
    assert all(t <= modeled.step_times_s[0] + 1e-9 for t in modeled.step_times_s)


def test_waiting_for_a_peer_is_idle_in_the_measured_timeline(runs):
    naive = profiling.time_shares(runs["naive"].timeline, [1, 2])
    # The naive pipeline keeps one stage of four busy: (p-1)/p = 75% idle, measured as waiting, not as transfer.
    # Quiet, each rank measures about 0.7 idle; with four ranks on two busy cores, a rank descheduled inside its
    # compute or a transfer stretches that span: the mean idle share fell to 0.48 at a load of 2, and at a load of 8
    # one rank's idle share (0.39) was below its transfer's (0.41). Over the ranks, idle still outweighs compute and
    # transfer each: a wait counted as transfer would make transfer the larger.
    mean = {kind: sum(s[kind] for s in naive.values()) / PP for kind in ("compute", "comm", "idle")}
    assert mean["idle"] > max(mean["compute"], mean["comm"]), (mean, naive)
    # That 1F1B idles less (0.41 against 0.70 quiet, 0.42 against 0.48 at a load of 2) is held on the modeled
    # clock below, where no other process shares the cores.
    waits = [s for s in runs["naive"].timeline if s["kind"] == "comm" and s.get("wait_s")]
    assert waits and all(0 <= s["wait_s"] <= s["end_s"] - s["start_s"] for s in waits)
    # A receive cannot end before its send started: the ranks' spans are on one clock.
    sends = {(s["rank"], s["peer"], " ".join(s["name"].split()[1:]), s["step"]): s
             for s in runs["naive"].timeline if s.get("op") == "send"}
    matched = 0
    for s in runs["naive"].timeline:
        send = sends.get((s["peer"], s["rank"], " ".join(s["name"].split()[1:]), s["step"])) if s.get("op") == "recv" else None
        if send is not None:
            assert s["end_s"] >= send["start_s"] - 1e-3
            matched += 1
    assert matched >= BASE["steps"] * M * 2 * (PP - 1)


def test_a_modeled_pipeline_keeps_its_bubble_and_1f1b_beats_naive(runs):
    idle = {}
    for name in ("naive", "1f1b"):
        modeled = replay(runs[name], on="h100")
        shares = profiling.time_shares(modeled.timeline, [1, 2])
        idle[name] = sum(s["idle"] for s in shares.values()) / PP
        assert modeled.device == "modeled h100" and modeled.losses == runs[name].losses
    assert idle["naive"] >= 0.6 and idle["1f1b"] < idle["naive"]


def test_modeled_data_parallel_overlaps_backward_and_scales_on_one_server(runs):
    dp8, one = replay(runs["dp8"], on="h100"), replay(runs["one"], on="h100")
    efficiency = profiling.summarize(dp8, baseline=one)["scaling_efficiency"]
    assert efficiency > 0.9  # measured on two shared cores it is a fraction of that
    overlapped = 0
    for rank in range(8):
        spans = [s for s in dp8.timeline if s["rank"] == rank and s["step"] == 1]
        backward = [s for s in spans if s["kind"] == "backward"]
        for c in (s for s in spans if s["kind"] == "comm"):
            overlapped += any(c["start_s"] < b["end_s"] and b["start_s"] < c["end_s"] for b in backward)
    assert overlapped > 0
    assert set(dp8.extras["modeled"]["algorithms"]) <= {"ring", "tree"}


def test_what_notebooks_02_and_08_say_of_the_modeled_runs(runs):
    one, one_micro4 = replay(runs["one"]), replay(runs["one_micro4"])
    # 02: strong scaling (global batch 8): the bucketed dp=2 run's modeled efficiency is higher than plain dp=2's.
    plain, bucketed = (replay(runs[k]).tokens_per_s / (2 * one.tokens_per_s) for k in ("dp2", "dp2_bucketed"))
    assert bucketed > plain
    # 08: weak scaling (4 sequences a rank): communication takes about two fifths of each step on two ranks (a small
    # all-reduce costs about 8 µs, NCCL's fixed cost in LL), and a model this small is launch-bound: its modeled MFU
    # on an H100 is under 1 %.
    summary = profiling.summarize(replay(runs["dp2"]), peak_flops=get_gpu("h100").peak_flops("fp32"),
                                  baseline=one_micro4)
    assert all(round(s["comm"], 1) == 0.4 for s in summary["ranks"].values()) and summary["scaling_efficiency"] < 1
    small = Cluster.of("h100").choice("all_reduce", 4096, range(2))
    assert small[2] == "LL" and round(small[0] * 1e6) == 8
    cells = json.loads((pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "08_profiling.ipynb")
                       .read_text())["cells"]
    text = " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())
    assert "about 8 µs for a small one" in text and "about two fifths of every step" in text
    assert profiling.summarize(one_micro4, peak_flops=get_gpu("h100").peak_flops("fp32"))["mfu"] < 0.01


def test_the_timeline_and_scaling_figures_draw_the_modeled_run_beside_the_measured_one(runs):
    fig = viz.timeline(runs["1f1b"], steps=1, on="h100")
    titles = [a.text for a in fig.layout.annotations]
    assert "cpu" in titles[0] and titles[1].startswith("MODELED") and "h100" in titles[1]
    assert "(µs)" in fig.layout.xaxis2.title.text
    fig = viz.scaling([runs["one"], runs["dp8"]], on="h100")
    assert any("modeled H100" in a.text for a in fig.layout.annotations)


def test_bad_input_gets_one_sentence(runs):
    with pytest.raises(ReplayError, match="known: .*h100"):
        replay(runs["one"], on="h1000")
    with pytest.raises(ReplayError, match="hold only 4"):
        replay(runs["dp8"], on="h100", gpus_per_node=4, nodes=1)
    with pytest.raises(ReplayError, match="record=True"):
        replay(runs["one"].to_dict() | {"timeline": []})
    torch_like = runs["dp8"].to_dict()
    torch_like["timeline"] = [{k: v for k, v in s.items() if k != "group"} for s in torch_like["timeline"]]
    with pytest.raises(ReplayError, match="scratch"):
        replay(torch_like)


# --- the clock and the cost model ---------------------------------------------------------------------------


def test_a_collective_starts_when_its_last_member_arrives_and_the_early_one_waits():
    tasks = [clock.Task(0, 1.0), clock.Task(0, 0.5, (0,), match=("ar",), members=2),
             clock.Task(1, 3.0), clock.Task(1, 0.5, (2,), match=("ar",), members=2)]
    layout = clock.run(tasks)
    assert (layout.ready[1], layout.start[1], layout.end[1]) == (1.0, 3.0, 3.5)
    assert (layout.ready[3], layout.start[3], layout.end[3]) == (3.0, 3.0, 3.5)


def test_an_eager_send_does_not_wait_and_a_blocking_pair_deadlocks_with_where():
    eager = [clock.Task(0, 2.0, match=("m",), members=2, eager=True), clock.Task(0, 1.0, (0,)),
             clock.Task(1, 5.0), clock.Task(1, 0.0, (2,), match=("m",), members=2)]
    layout = clock.run(eager)
    assert layout.end[0] == 0.0 and layout.end[1] == 1.0 and layout.end[3] == 5.0  # the data came at 2
    stuck = [clock.Task(0, 1.0, match=("a",), members=2), clock.Task(0, 1.0, (0,), match=("b",), members=2),
             clock.Task(1, 1.0, match=("b",), members=2), clock.Task(1, 1.0, (2,), match=("a",), members=2)]
    with pytest.raises(clock.ClockError, match="rank 0 waits") as e:
        clock.run(stuck)
    assert e.value.waiting == {0: 0, 1: 2}


def test_alpha_beta_costs_and_the_slowest_link():
    c = Cluster.of("a100", gpus_per_node=8, nodes=2)
    g = get_gpu("a100")
    nvlink, network = g.intra_node_GBps * 1e9 * g.bus_efficiency, g.inter_node_GBps * 1e9 * g.bus_efficiency
    alpha_in, alpha_out = g.intra_node_latency_us * 1e-6, g.inter_node_latency_us * 1e-6
    size = 1 << 30
    simple = BASE_LATENCY["Simple"]  # NCCL's fixed cost of a collective in the Simple protocol
    assert c.collective_s("all_reduce", size, range(8)) == (pytest.approx(simple + 14 * alpha_in
                                                                          + 1.75 * size / nvlink), "ring")
    # Across two servers, one network card per GPU: the 16 ranks' ring crosses over 8 cards at once (NCCL's
    # channels, one per card), never faster than NVLink; a group with one GPU in each server has one card.
    rails = min(nvlink, 8 * network)
    # Of the ring's 30 steps only the 2 that cross between the servers pay the network's latency (NCCL's count).
    assert c.collective_s("all_reduce", size, range(16))[0] == pytest.approx(simple + 28 * alpha_in + 2 * alpha_out
                                                                             + 30 / 16 * size / rails)
    one_card = 30 * alpha_out + 30 / 16 * size / network
    assert c.collective_s("all_reduce", size, range(16))[0] < one_card / 6
    assert c.collective_s("all_gather", size, [0, 8])[0] == pytest.approx(simple + alpha_out + size / 2 / network)
    assert c.link([0, 1, 8])[1] == pytest.approx(network)  # one member in the second server: one card
    assert c.collective_s("send", 1000, [3, 4]) == (pytest.approx(alpha_in + 1000 / nvlink), "p2p")
    # A small message across servers: the tree (a chain of 7 NVLink hops in each server, 1 network hop between
    # the two) beats the ring, both in NCCL's LL protocol: a fraction of each step's latency, a quarter of the bandwidth,
    # and NCCL gives a tree 0.92 of a ring's bandwidth.
    small = c.choice("all_reduce", 1024, range(16))
    ll_in, ll_out = alpha_in * LL_LATENCY["NVLink"], alpha_out * LL_LATENCY["network"]
    assert small == (pytest.approx(BASE_LATENCY["LL"] + 2 * (7 * ll_in + ll_out)
                                   + 2 * 1024 / (rails * LL_BANDWIDTH * TREE_BANDWIDTH)), "tree", "LL")
    assert c.collective_s("all_reduce", 1024, range(16), algo="tree", protocol="Simple")[0] == pytest.approx(
        simple + 2 * (7 * alpha_in + alpha_out) + 2 * 1024 / (rails * TREE_BANDWIDTH))
    # nccl-tests' bus bandwidth of a large ring all-reduce on one server: the link × bus_efficiency.
    assert c.bus_bandwidth("all_reduce", 8 << 30, 8) == pytest.approx(nvlink, rel=2e-3)
    with pytest.raises(ValueError, match="no cost model"):
        c.collective_s("scatter", 10, range(4))


def test_compute_is_a_roofline_plus_launches():
    c = Cluster.of("h100")
    g = c.gpu
    assert c.compute_s(1e15, 0, 0) == pytest.approx(1e15 / (g.peak_bf16_flops * g.achievable))
    assert c.compute_s(1e6, 1e9, 3) == pytest.approx(1e9 / (g.hbm_GBps * 1e9) + 3 * 4e-6)
    assert c.compute_s(1e12, 0, 0, precision="fp32") > c.compute_s(1e12, 0, 0, precision="bf16")


def test_the_replay_command_prints_the_modeled_step_and_refuses_bad_input_in_one_sentence(runs, tmp_path, capsys):
    from gpucourse import cli

    saved = tmp_path / "run.json"
    runs["1f1b"].save(saved)
    assert cli.main(["replay", str(saved), "--on", "a100", "--json", str(tmp_path / "modeled.json")]) == 0
    out = capsys.readouterr().out
    assert "replayed on 1 × 8 A100" in out and "modeled" in out and "MFU" in out
    assert json.loads((tmp_path / "modeled.json").read_text())["device"] == "modeled a100"
    for argv, words in ((["replay", str(tmp_path / "none.json")], "none.json does not exist"),
                        (["replay", str(saved), "--on", "v100"], "known: "),
                        (["replay", str(saved), "--gpus-per-node", "2", "--nodes", "1"], "hold only 2")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1


def test_tensor_parallelism_across_servers_is_replayed_but_warned(runs):
    d = runs["dp8"].to_dict()
    d["config"] = {**d["config"], "dp": 1, "tp": 8, "bucket_mb": None, "overrides": {"n_head": 8}}  # 8 heads to split
    with pytest.warns(UserWarning, match="crosses servers"):
        modeled = replay(d, gpus_per_node=4, nodes=2)
    assert modeled.extras["modeled"]["notes"]


def test_a_planted_straggler_shows_as_its_peers_waiting(runs):
    """Notebook 08's exercise: rank 1 loses 40 ms a step; rank 0 waits for it in the all-reduces, as idle."""
    r = runs["straggler"]
    shares = profiling.time_shares(r.timeline, [1, 2])
    assert shares[0]["idle"] > shares[1]["idle"] + 0.1
    waited = sum(s.get("wait_s", 0.0) for s in r.timeline if s["rank"] == 0 and s["step"] == 2 and s["kind"] == "comm")
    assert waited >= 0.03
    # On modeled GPUs the delay stays what it was, and the other rank's wait with it.
    modeled = profiling.time_shares(replay(r).timeline, [1, 2])
    assert modeled[0]["idle"] > 0.5 > modeled[1]["idle"]
    with pytest.raises(ConfigError, match="RANK:MS"):
        TrainConfig(dp=2, straggler="1-40").validate()
