"""Facts the notebooks state in prose, recomputed: the two definitions of the pipeline bubble, 1F1B's warm-up and
peak in flight, interleaving's rule for m, what ZB-H1 holds until its W, the bytes per parameter of the ZeRO paper
and of Megatron-Core, ZeRO's traffic, the range of a good MFU, which GPUs have FP8, gpt2-small's parameters,
Korthikanti et al.'s activation counts, what context-parallel attention puts on the wire, what a distributed
checkpoint writes, and what torchrun sets for NCCL's error handling. Where a notebook prints or writes a number,
the test reads it there and compares."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from gpucourse.parallel import check
from gpucourse import ConfigError, TrainConfig, quiz, run
from gpucourse.modeled import memory
from gpucourse.comm import RING_FACTOR
from gpucourse.modeled.gpus import get_gpu
from gpucourse.parallel import schedules, schedules_virtual
from procs import BIN, REPO, clean_env, free_port
from schedule_peaks import awaiting_b

BY_ID = {q["id"]: q for q in quiz.load_bank()}
MiB = 2**20


def markdown(name: str, kind: str = "markdown") -> str:
    """All markdown (or code) of one notebook, as one string."""
    nb = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind)


# --- the pipeline bubble: one idle time, two denominators ----------------------------------------------------

def idle_and_busy(schedule: str, p: int, m: int) -> tuple[float, float, float]:
    """Idle time, busy time and total stage-time of a simulated pipeline, forward and backward costing 1 each."""
    sim = schedules.simulate(schedules.build(schedule, p, m), p, m, cost_f=1, cost_b=1)
    return sum(sim.idle), sum(sim.busy), p * sim.makespan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 12), (8, 8), (8, 32)])
def test_bubble_is_one_idle_time_over_two_denominators(schedule, p, m):
    idle, busy, total = idle_and_busy(schedule, p, m)
    assert idle == pytest.approx(p * (p - 1) * 2), "each stage idles (p-1)(F+B)"
    # This course's bubble: idle over the total time.
    assert idle / total == pytest.approx((p - 1) / (m + p - 1)) == schedules.formula_bubble(schedule, p, m)
    # Megatron-LM's: the same idle time over the ideal compute time m(F+B).
    assert idle / busy == pytest.approx((p - 1) / m)


def test_the_bubble_numbers_the_course_states():
    idle, busy, total = idle_and_busy("1f1b", 4, 8)
    share_of_total, over_compute = idle / total, idle / busy
    assert share_of_total == pytest.approx(3 / 11) and over_compute == pytest.approx(3 / 8)
    side_by_side = (f"3/11 ≈ {share_of_total:.0%}", f"3/8 = {over_compute:.1%}")
    assert side_by_side == ("3/11 ≈ 27%", "3/8 = 37.5%")
    for notebook in ("04_pipeline_parallelism", "11_certification_review"):
        text = markdown(notebook)
        assert all(s in text for s in side_by_side), notebook
        assert "(p − 1)/(v·m)" in text or "(p−1)/(v·m)" in text, notebook
    # The questions' numbers in both definitions: GPipe p=4, m=12 and 1F1B p=8, m=8.
    gpipe = idle_and_busy("gpipe", 4, 12)
    assert gpipe[0] / gpipe[2] == pytest.approx(BY_ID["par-bubble-gpipe"]["answer"]) == pytest.approx(3 / 15)
    assert gpipe[0] / gpipe[1] == pytest.approx(3 / 12) and "3/12 = 0.25" in BY_ID["par-bubble-gpipe"]["explanation"]
    one_f = idle_and_busy("1f1b", 8, 8)
    assert one_f[0] / one_f[2] == pytest.approx(BY_ID["par-bubble-1f1b"]["answer"], abs=1e-4)
    assert one_f[0] / one_f[1] == pytest.approx(7 / 8) and "7/8 = 0.875" in BY_ID["par-bubble-1f1b"]["explanation"]
    # m >= 4p keeps the bubble under 20% of the total time and under 25% of the compute time.
    for p in (2, 4, 8, 16, 64):
        assert (p - 1) / (4 * p + p - 1) < 0.20 and (p - 1) / (4 * p) < 0.25
    # Interleaved 1F1B with v model chunks per GPU (par-shrink-bubble): Megatron's (p-1)/m divided by v.
    for p, m, v in ((4, 8, 2), (4, 8, 4), (8, 16, 2)):
        ops, layout = schedules_virtual.build("interleaved-1f1b", p, m, v)
        sim = schedules_virtual.simulate(ops, layout, m, cost_f=1, cost_b=1, cost_w=0)
        idle, busy, _ = idle_and_busy("1f1b", p, m)
        assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m)) == pytest.approx(idle / busy / v)
    assert "(p−1)/(v·m)" in BY_ID["par-shrink-bubble"]["explanation"]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 20)])
def test_1f1b_warm_up_is_p_minus_s_minus_1_and_the_peak_p_minus_s(p, m):
    schedule = schedules.one_f_one_b(p, m)
    sim = schedules.simulate(schedule, p, m)
    for s, ops in enumerate(schedule):
        kinds = [op.kind for op in ops]
        first_backward = kinds.index(schedules.B)
        assert kinds[:first_backward].count(schedules.F) == p - s, "warm-up forwards, then one more"
        if s < p - 1:  # warm-up forwards are the ones handed on before the first gradient comes back
            assert kinds[:kinds.index(schedules.RECV_B)].count(schedules.SEND_F) == p - s - 1
        assert sim.peak_in_flight[s] == p - s
    assert "p − s − 1 warm-up forwards" in markdown("04_pipeline_parallelism")
    explanation = BY_ID["par-1f1b-inflight"]["explanation"]
    assert "p−s−1 warm-up forwards" in explanation and "never holds more than p−s" in explanation


def megatron_core_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron-Core's order of a rank's forwards as (microbatch, chunk) (``get_schedule_table`` in
    megatron/core/pipeline_parallel/schedules.py): ``group`` microbatches through chunk 0, the same through chunk 1,
    and so on, then the next group; the last group is whatever is left."""
    order = []
    for start in range(0, m, group):
        members = range(start, m) if start + group >= m else range(start, start + group)
        order += [(mb, chunk) for chunk in range(v) for mb in members]
    return order


def megatron_core_takes(p: int, m: int, group: int) -> bool:
    """What Megatron-Core's interleaved schedule accepts before it runs: p ≤ group ≤ m, and a last group that is
    either whole or holds at least p microbatches."""
    return p <= group <= m and not 0 < m % group < p


def test_interleaved_m_rule_of_megatron_lm_megatron_core_and_this_runtime():
    # Megatron-Core's own example (PP 2, groups of 3, 5 microbatches, VP 2): a shorter last group, m no multiple of p.
    table = megatron_core_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert megatron_core_takes(2, 5, 3) and 5 % 2
    assert megatron_core_takes(4, 10, 6) and not megatron_core_takes(4, 9, 6), "a last group of 4 runs, of 3 not"
    # With its default group, p, it keeps Megatron-LM's original rule: m a multiple of p.
    for p in (2, 4, 8):
        assert [m for m in range(p, 5 * p) if megatron_core_takes(p, m, p)] == list(range(p, 5 * p, p))
    # This course's runtime lays out Megatron-LM's original order (Megatron-Core's table with groups of p) on every
    # rank, and refuses an m that is not a multiple of p.
    for p, m, v in ((2, 4, 3), (4, 8, 2), (4, 12, 2), (8, 16, 2)):
        ops, _ = schedules_virtual.build("interleaved-1f1b", p, m, v)
        for row in ops:
            assert [(op.microbatch, op.chunk) for op in row if op.kind == schedules.F] == megatron_core_table(m, v, p)
    cfg = TrainConfig(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=6, batch_size=24)
    with pytest.raises(ConfigError, match="must be a multiple of pp=4"):
        check(cfg, runnable=False)
    text = prose("04b_pipeline_schedules")
    assert ("Megatron-LM's original order sends microbatches through a chunk p at a time, so m must be a multiple of "
            "p; this course's runtime keeps that rule.") in text
    assert ("Megatron-Core makes the group a setting (`microbatch_group_size_per_vp_stage`, p by default and never "
            "fewer) and also takes a shorter last group, as long as it holds at least p microbatches: its own example "
            "runs p = 2 with groups of 3 and m = 5.") in text
    q = BY_ID["pipe-interleave-costs"]
    right = [q["choices"][i] for i in q["answer"]]
    assert "m a multiple of p = 4, in Megatron-LM's original interleaved order" in right
    assert "which this course's runtime follows" in q["explanation"] and 8 % 4 == 0
    assert ("takes a shorter last group as long as it holds at least p microbatches (its own example: p = 2, groups "
            "of 3, m = 5)") in q["explanation"]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16), (8, 32), (16, 64)])
def test_zb_h1_keeps_each_microbatch_until_its_w(p, m):
    """ZB-H1 lets no more microbatches await their B than 1F1B, but each keeps its activations until its W runs:
    rank s holds up to 2p − 1 − s of them (at most m), against 1F1B's p − s — what the simulator and the memory
    estimate both count."""
    ops, layout = schedules_virtual.build("zb-h1", p, m)
    zb = schedules_virtual.simulate(ops, layout, m)
    one = schedules.simulate(schedules.one_f_one_b(p, m), p, m)
    assert one.peak_in_flight == [min(p - s, m) for s in range(p)] == memory.in_flight("1f1b", p, m)
    assert awaiting_b(zb) == one.peak_in_flight, "B waits no longer than under 1F1B"
    held = [min(2 * p - 1 - s, m) for s in range(p)]
    assert zb.peak_in_flight == held == memory.in_flight("zb-h1", p, m)
    assert memory._weighted_peaks(ops, [[1.0]] * p) == held, "each chunk's activations freed by its W"
    if m >= 3 * p:  # the V shape: 4p − 1 half-stage chunks on every rank
        assert [2 * x for x in memory.in_flight("zbv", p, m)] == [4 * p - 1] * p


def test_what_zb_h1_holds_is_said_the_same_way_everywhere():
    def peaks(p, m):
        ops, layout = schedules_virtual.build("zb-h1", p, m)
        return schedules_virtual.simulate(ops, layout, m).peak_in_flight[0], min(p, m)

    assert peaks(4, 8) == (7, 4)  # the notebook's figure
    text = prose("04b_pipeline_schedules")
    assert ("The ZB-H1 laid out here holds up to 2p − 1 − s microbatches on rank s (never more than m) against 1F1B's "
            "p − s: rank 0 nearly twice as many, 7 against 4 in the figure below (p = 4, m = 8).") in text
    assert "| as 1F1B | 2p − 1 microbatches: as 1F1B awaiting B, each kept until its W |" in text
    assert "| 4p − 1 chunks on every rank, each kept until its W |" in text
    assert "at its memory" not in text and "when memory is tight" not in text
    assert "holds up to 2p − 1 − s of them, not 1F1B's p − s" in " ".join(schedules_virtual.__doc__.split())
    # pipe-choose-slow-link: p=8, m=16, room for twice 1F1B's activations; pipe-choose-headroom: p=4, m=8, 25%.
    for qid, (p, m), right in (("pipe-choose-slow-link", (8, 16), True), ("pipe-choose-headroom", (4, 8), False)):
        zb, one = peaks(p, m)
        ratio = f"{zb / one:g}×"
        assert (zb, ratio) == ((15, "1.875×") if p == 8 else (7, "1.75×"))
        q = BY_ID[qid]
        zb_choice = next(i for i, c in enumerate(q["choices"]) if c.startswith("ZB-H1"))
        assert f"{ratio} rank 0's activations" in q["choices"][zb_choice] and (q["answer"] == zb_choice) == right
        assert f"rank 0 holds up to 2p−1 = {zb} microbatches, {ratio} 1F1B's {one}" in q["explanation"]
        assert "1F1B's memory" not in q["explanation"] and "1F1B's activation memory" not in q["explanation"]
    assert "room for twice its 1F1B activations" in BY_ID["pipe-choose-slow-link"]["question"] and 15 / 8 <= 2
    assert "25% memory headroom" in BY_ID["pipe-choose-headroom"]["question"] and 7 / 4 > 1.25
    assert "activation memory" not in BY_ID["pipe-zbh1-bubble"]["question"]


# --- memory and traffic ----------------------------------------------------------------------------------------

def test_bytes_per_parameter_zero_paper_and_megatron_core():
    # The ZeRO paper (mixed-precision Adam): 2 (16-bit weights) + 2 (16-bit gradients) + K = 12 (fp32 master, two
    # moments) — what the course's master-weights estimate counts.
    assert 2 + 2 + 12 == 16 == sum(memory.estimate_params(1, 1, 0, "bf16", True, scratch_padding=False).values())
    # Megatron-Core's table (bytes per parameter, without / with the distributed optimizer over d ranks).
    weights, master, adam = {"fp16": 2, "bf16": 2, "fp32": 4}, 4, 8
    table = {("fp16", "fp16"): (20, (4, 16)), ("bf16", "fp32"): (18, (6, 12)), ("fp32", "fp32"): (16, (8, 8))}
    for (param, grad), (plain, (kept, sharded)) in table.items():
        main_grad = 4  # gradients accumulated across data-parallel ranks are fp32 main gradients
        fp16_grad = 2 if grad == "fp16" else 0  # fp16 model gradients are kept beside them
        own_master = 0 if param == "fp32" else master  # fp32 weights are their own master copy
        assert weights[param] + fp16_grad + main_grad + own_master + adam == plain
        assert kept + sharded == plain, "with d = 1 the distributed optimizer keeps what the plain one does"
        assert kept == weights[param] + fp16_grad + (main_grad if grad == "fp32" else 0)
    text = markdown("07_memory_batch")
    assert "2 + 2 + 12 = 16" in text and "18" in text and "2 + 4 + 4 + 8" in text and "6 + 12/d" in text
    assert 2 + 4 + 4 + 8 == 18


def test_gpt2_small_here_is_gpt2s_shape_with_163_m_parameters():
    import inspect

    import torch

    from gpucourse import model
    from gpucourse.model import GPT, MODELS

    mc = MODELS["gpt2-small"]
    assert (mc.n_layer, mc.n_embd, mc.vocab_size, mc.block_size) == (12, 768, 50257, 1024)
    n = memory.num_params(mc)
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT(mc).parameters()) == n
    gpt2 = 124_439_808  # OpenAI's GPT-2 small: the head tied to the token embedding, a bias on every key
    assert n == gpt2 + mc.vocab_size * mc.n_embd - mc.n_layer * mc.n_embd == 163_027_968
    assert (f"{n / 1e6:.1f} M", f"{gpt2 / 1e6:.0f} M") == ("163.0 M", "124 M")
    comment = " ".join(w for w in inspect.getsource(model).split() if w != "#")
    assert ("``gpt2-small`` is GPT-2 small's shape for real GPUs — 12 blocks of 768, GPT-2's vocabulary and 1024 "
            "positions — with 163.0 M parameters here, not GPT-2's 124 M: the output head is not tied to the token "
            "embedding (and attention has no key bias).") in comment
    assert "163 M parameters here, as its head is not tied to the embedding" in prose("07_memory_batch")
    # Nowhere is it called a 124 M model: every 124 M is GPT-2's.
    files = [*(REPO / "gpucourse").rglob("*.py"), REPO / "gpucourse" / "quiz" / "bank.json", REPO / "README.md",
             *(REPO / "notebooks").glob("*.ipynb"), *(REPO / "docs").glob("*.md")]
    for path in files:
        text = path.read_text(encoding="utf-8")
        for hit in re.finditer(r"124\s?M\b|124-million", text):
            before = text[max(0, hit.start() - 10):hit.start()]
            assert "GPT-2's" in before, f"{path}: {text[hit.start() - 60:hit.end()]}"


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_zero_traffic_against_data_parallel(n):
    rs, ag, ar = (RING_FACTOR[op](n) for op in ("reduce_scatter", "all_gather", "all_reduce"))
    assert rs + ag == pytest.approx(ar), "ZeRO-2: a reduce-scatter and one all-gather are one all-reduce"
    assert rs + 2 * ag == pytest.approx(1.5 * ar), "ZeRO-3 / FSDP: weights gathered in forward and in backward"
    assert "1.5×" in markdown("01_collectives")


def test_what_each_zero_1_and_2_sends_against_data_parallel():
    """03 §5: the ZeRO paper's "no more traffic than DP" holds for a reduce-scatter plus an all-gather, the scratch
    ZeRO-2. The scratch ZeRO-1 all-reduces and then all-gathers (1.5×); ZeroRedundancyOptimizer keeps DDP's
    all-reduce and broadcasts each parameter from its owner (2× on 2 ranks). The bytes the notebook's runs send a
    step, both ranks together, counted the ring way (comm.RING_FACTOR) on its model's fp32 gradients."""
    import inspect
    import warnings

    with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers: a deprecated API
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    from gpucourse.parallel import zero

    reduce = inspect.getsource(zero.FlatShardedOptimizer.reduce_gradients)
    assert "comm.all_reduce(flat_grad" in reduce and "comm.reduce_scatter_tensor(" in reduce
    assert "comm.all_gather_into_tensor(" in inspect.getsource(zero.FlatShardedOptimizer.gather_weights)
    assert "_broadcast_params_from_rank" in inspect.getsource(ZeroRedundancyOptimizer._sync_params)
    n, params = 2, memory.num_params(TrainConfig().model_config())
    grads = 4 * params
    assert zero.memory_formula(params, n, 1)["weights"] == grads, "no padding at dp = 2"
    sent = {"DP": n * grads * RING_FACTOR["all_reduce"](n)}
    sent["ZeRO-2"] = n * grads * (RING_FACTOR["reduce_scatter"](n) + RING_FACTOR["all_gather"](n))
    sent["ZeRO-1"] = sent["DP"] + n * grads * RING_FACTOR["all_gather"](n)
    sent["ZeroRedundancyOptimizer"] = sent["DP"] + n * grads * RING_FACTOR["broadcast"](n)
    shown = {k: f"{v / MiB:.2f} MiB" for k, v in sent.items()}
    assert shown == {"DP": "1.65 MiB", "ZeRO-2": "1.65 MiB", "ZeRO-1": "2.47 MiB",
                     "ZeroRedundancyOptimizer": "3.30 MiB"}
    assert (sent["ZeRO-1"] / sent["DP"], sent["ZeroRedundancyOptimizer"] / sent["DP"]) == (1.5, 2.0)
    text = prose("03_zero_fsdp")
    assert "no extra traffic over DP" not in text
    for said in ("ZeRO-1/2 add no traffic over DP only when written as the ZeRO paper writes them: a reduce-scatter "
                 "of the gradients, then an all-gather of the updated weights, together one all-reduce's bytes — the "
                 f"scratch ZeRO-2 here, whose ring sends DP's {shown['DP']} a step on 2 ranks",
                 "The scratch ZeRO-1 all-reduces the whole gradient and then all-gathers the weights: "
                 f"1.5× ({shown['ZeRO-1']})",
                 "`ZeroRedundancyOptimizer` (stage 1, `impl=\"torch\"`, the default of the cell above) keeps DDP's "
                 "all-reduce, then broadcasts each updated parameter from the rank that owns it",
                 f"(n − 1)/n of it: 2× on 2 ranks ({shown['ZeroRedundancyOptimizer']})"):
        assert said in text, said


def test_korthikanti_numbers_printed_in_the_review():
    layer = memory.korthikanti_layer_bytes
    b, s, h, a, tp = 1, 4096, 4096, 32, 8
    sbh = s * b * h
    general = {"tp=1": sbh * (34 + 5 * a * s / h), "tp=8": sbh * (10 + 24 / tp + 5 * a * s / (h * tp)),
               "tp=8 + SP": sbh * (34 / tp + 5 * a * s / (h * tp)), "full recompute": 2 * sbh}
    ours = {"tp=1": layer(s, b, h, a), "tp=8": layer(s, b, h, a, tp=tp), "tp=8 + SP": layer(s, b, h, a, tp=tp, sp=True),
            "full recompute": layer(s, b, h, a, recompute="full")}
    assert ours == pytest.approx(general)
    assert {k: round(v / MiB) for k, v in ours.items()} == {"tp=1": 3104, "tp=8": 528, "tp=8 + SP": 388,
                                                             "full recompute": 32}
    code = markdown("11_certification_review", "code")  # the review prints them for this shape
    assert "b, T, C = 1, 4096, 4096" in code and "heads = 32" in code
    assert "korthikanti_layer_bytes(T, b, C, heads, tp=8, sp=True)" in code


def test_mfu_range_is_what_published_h100_runs_report():
    """Notebook 08 and prof-mfu quote the MFU of the largest published H100 runs the course holds its model to
    (gpucourse.modeled.published): Llama 3 405B's and Megatron-LM's weak-scaling table's, model FLOP/s over the bf16 peak."""
    from gpucourse.modeled import published

    peak = get_gpu("h100").peak_flops("bf16")
    llama = [r for r in published.RUNS if r.name.startswith("Llama 3 405B")]
    table = [r for r in published.RUNS if r.source.startswith(published.MCORE_H100)]
    assert len(llama) == 3 and len(table) == 9 and all(r.gpu == "h100" for r in llama + table)

    def percent(runs):
        mfu = [r.reported / peak for r in runs]
        return round(100 * min(mfu)), round(100 * max(mfu))

    assert (percent(llama), percent(table)) == ((38, 43), (41, 49))
    assert 35 <= min(percent(llama + table)) and max(percent(llama + table)) <= 50
    gpus = sorted({r.layout["dp"] * r.layout["tp"] * r.layout["pp"] * r.layout.get("cp", 1) for r in llama})
    assert gpus == [8192, 16384]
    # Megatron-LM's README says of its own table: 41 % for the smallest model, rising to 47-48 % for the largest;
    # its TFLOP/s column over the bf16 peak gives the same ends (a middle row, 16B, reaches 49 %).
    by_size = sorted(table, key=lambda r: r.layout["tp"] * r.layout["pp"] * r.layout["dp"])
    assert round(100 * by_size[0].reported / peak) == 41
    assert sorted(round(100 * r.reported / peak) for r in by_size[-2:]) == [47, 48]
    text = prose("08_profiling")
    assert ("Well-tuned large runs on H100 report roughly 35–50% MFU (Llama 3 405B: 38–43% on 8,192 and 16,384 GPUs; "
            "Megatron-LM's weak-scaling table of GPT models: 41% for the smallest model, rising to 47–48% for the "
            "largest); 30% is common on smaller or communication-bound runs.") in text
    assert "40–60%" not in text and "41–49%" not in text
    q = BY_ID["prof-mfu"]
    assert ("Well-tuned large runs on H100 report roughly 0.35–0.5 (Llama 3 405B: 0.38–0.43); 0.3 is common on smaller "
            "or communication-bound runs.") in q["explanation"]
    torchtitan = next(r for r in published.RUNS if r.name == "Llama 3 8B, 64 A100 (FSDP)")
    assert "(MFU 58.2 %)" in torchtitan.source and "torchtitan's Llama 3 8B on 64 A100s: 0.58" in q["explanation"]
    mfu = 6 * 7e9 * 1e5 / (8 * peak)
    assert 0.5 < mfu < 0.582 and mfu == pytest.approx(q["answer"], abs=q["tolerance"])
    assert f"{mfu:.2f} is above what the largest runs report" in q["explanation"]


def test_fp8_tensor_cores_from_ada_on():
    """FP8 tensor cores came with Ada (the L4, in the course's GPU table) and Hopper (the H100), not the H100 alone."""
    from gpucourse.modeled import tensor_cores

    for gpu in (get_gpu("l4"), get_gpu("h100")):  # the datasheets: FP8 twice BF16, dense
        assert gpu.peak_flops("fp8") == pytest.approx(2 * gpu.peak_flops("bf16"), rel=0.01)
    said = "**FP8** (Ada and Hopper GPUs and later: the L4, the H100"
    assert f"- {said} and their successors): two 8-bit formats, next cell." in prose("07_memory_batch")
    assert said in " ".join(tensor_cores.__doc__.split())
    assert "FP8** (H100 and later)" not in prose("07_memory_batch") + tensor_cores.__doc__


# --- tools: a distributed checkpoint's files, torchrun's environment ------------------------------------------

def test_a_distributed_checkpoint_is_per_rank_shards_plus_one_metadata_file(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run(TrainConfig(batch_size=8, seq_len=32, steps=1, tp=2, save=str(tmp_path)), timeout=120, quiet=True)
    path = tmp_path / "step-000001"
    files = sorted(p.name for p in path.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    md = FileSystemReader(str(path)).read_metadata()
    name = "model.blocks.0.attn.q.weight"
    whole = md.state_dict_metadata[name]
    assert tuple(whole.size) == (64, 64), "the metadata knows the whole tensor"
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in whole.chunks) == [((0, 0), (32, 64)), ((32, 0), (32, 64))]
    stored_in = {info.relative_path for index, info in md.storage_data.items() if index.fqn == name}
    assert stored_in == {"__0_0.distcp", "__1_0.distcp"}, "each half is in its own rank's file"


def test_torchrun_sets_nccl_async_error_handling_unless_already_set(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('value:', os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING'))\n")

    def under_torchrun(value: str | None) -> str:
        env = clean_env()
        env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        if value is not None:
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = value
        out = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("value:")[1].strip()

    assert under_torchrun(None) == "1", "torchrun turns on abort-and-tear-down when the variable is unset"
    assert under_torchrun("3") == "3", "and leaves a value you set alone"
    text = markdown("09_troubleshooting")
    assert "defaults to 3" in text and "torchrun sets it to 1" in text


def test_the_default_timeout_of_a_process_group_by_backend():
    """Without timeout=, init_process_group waits 10 minutes on NCCL (default_pg_nccl_timeout) and 30 on gloo and
    the other backends (default_pg_timeout): the doctor, the desync scenario and notebook 09, which run on gloo,
    say both. A torch built without NCCL has no NCCL constant: the value then comes from its C++ header."""
    import math
    import pathlib

    import torch
    from torch.distributed import constants

    from gpucourse.course import doctor, troubleshoot

    gloo = constants.default_pg_timeout.total_seconds() / 60
    if constants.default_pg_nccl_timeout is not None:
        nccl = constants.default_pg_nccl_timeout.total_seconds() / 60
    else:
        header = pathlib.Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
        ms = re.search(r"kProcessGroupNCCLDefaultTimeout =\s*std::chrono::milliseconds\(([\d *]+)\)",
                       header.read_text())
        nccl = math.prod(int(f) for f in ms.group(1).split("*")) / 60_000  # "10 * 60 * 1000" ms
    assert (nccl, gloo) == (10, 30) and doctor.default_timeout_minutes() == {"nccl": nccl, "gloo": gloo}
    sentence = next(s for s in doctor.TROUBLESHOOTING if s.startswith("The timeout="))
    assert f"(unless set, {nccl:g} minutes on NCCL and {gloo:g} on gloo)" in sentence
    assert f"({gloo:g} minutes by default on gloo, as here; {nccl:g} on NCCL)" in troubleshoot.WITHOUT_A_TIMEOUT
    assert f"{nccl:g} minutes by default for NCCL, {gloo:g} for gloo as here" in prose("09_troubleshooting")
    assert "10 minutes unless set" not in " ".join(doctor.TROUBLESHOOTING)


def test_info_is_enough_for_ddp_to_name_the_parameters_without_a_gradient(tmp_path):
    """09 §3: DDP's error for a parameter that got no gradient asks for TORCH_DISTRIBUTED_DEBUG "to either INFO or
    DETAIL", and at INFO it names the parameter; DETAIL is not needed for that."""
    script = tmp_path / "unused.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:' + sys.argv[1])\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.used(x)\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(M())\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        ddp(torch.randn(2, 4)).sum().backward()\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n"
        "dist.destroy_process_group()\n")

    def error_at(level: str) -> str:
        out = subprocess.run([str(BIN / "python"), str(script), str(free_port())], capture_output=True, text=True,
                             env=clean_env(TORCH_DISTRIBUTED_DEBUG=level), cwd=tmp_path, timeout=120)
        assert out.returncode == 0, out.stderr
        return " ".join(out.stdout.split())

    off, info = error_at("OFF"), error_at("INFO")
    assert "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL" in off
    assert "did not receive grad for rank 0: unused.bias, unused.weight" in info
    text = prose("09_troubleshooting")
    assert "DETAIL also makes DDP name the parameters" not in text
    assert ("DDP's complaint about unused parameters needs no DETAIL: its own message asks for "
            "`TORCH_DISTRIBUTED_DEBUG` set \"to either INFO or DETAIL\", and at either level it names the parameters "
            "that received no gradient.") in text


# --- the numbers the Change cells give a learner to predict from ---------------------------------------------

def prose(name: str) -> str:
    """One notebook's markdown with every run of whitespace made one space (sentences wrap across lines)."""
    return " ".join(markdown(name).split())


def test_what_to_predict_a_collective_from():
    text = prose("01_collectives")
    assert "S = 4n bytes" in text and "2 · 3/4 · 16 = 24 bytes" in text
    assert RING_FACTOR["all_reduce"](4) * 4 * 4 == 24
    assert RING_FACTOR["broadcast"](4) == 1 and RING_FACTOR["reduce_scatter"](4) == RING_FACTOR["all_gather"](4) == 3 / 4


def test_a_broadcast_chains_last_rank_sends_nothing():
    """01's table: a broadcast's ranks each send S down the chain but the last, which only receives; the counter
    still counts S on every rank, nccl-tests' bus-bandwidth factor."""
    from gpucourse.viz.collectives import simulate_collective

    for n in (2, 4, 8):
        sim = simulate_collective("broadcast", n)
        chunks = [sum(src == r for step in sim.transfers for src, *_ in step) for r in range(n)]
        assert chunks == [n] * (n - 1) + [0]  # n chunks of S/n: S, and nothing from the last rank
    text = prose("01_collectives")
    assert "| S (the chain's last rank: 0) |" in text and "but the last, which only receives" in text
    assert RING_FACTOR["broadcast"](4) == 1 and "`gpucourse.comm` counts S on every rank" in text


def test_what_to_predict_data_parallel_traffic_and_model_states_from():
    from gpucourse.model import GPT

    mc = TrainConfig().model_config()
    params = memory.num_params(mc)
    assert params == 216_192 and len(list(GPT(mc).parameters())) == 65
    assert f"{4 * params / MiB:.2f}" == "0.82" and f"{16 * params / MiB:.2f}" == "3.30"
    assert "65 of them, carrying 0.82 MiB" in prose("02_data_parallelism")
    for dp in (2, 4):  # the all-reduce payload is every fp32 gradient, whatever dp is
        assert memory.estimate(TrainConfig(dp=dp))["per_rank"][0]["gradients"] == 4 * params
    assert "216,192 parameters" in prose("03_zero_fsdp") and "16 in all — 3.30 MiB" in prose("03_zero_fsdp")
    assert sum(memory.estimate_params(params).values()) == 16 * params == (4 + 4 + 8) * params
    text = prose("07_memory_batch")
    assert "16 bytes per parameter in every regime here — 3.30 MiB for the model's 216,192 parameters" in text
    states = ("weights", "gradients", "optimizer")
    for precision, master in (("fp32", False), ("bf16", False), ("bf16", True), ("fp16", True)):
        for dp in (1, 2, 4):
            est = memory.estimate(TrainConfig(dp=dp, precision=precision, master_weights=master))["per_rank"][0]
            assert sum(est[c] for c in states) == 16 * params, (precision, master, dp)


def test_what_to_predict_tensor_parallel_traffic_from():
    cfg = TrainConfig()
    mc = cfg.model_config()
    assert (cfg.batch_size, mc.n_embd, mc.n_layer) == (8, 64, 4)
    text = prose("05_tensor_parallelism")
    assert "B = 8 sequences, C = 64 channels" in text and "n_layer = 4 blocks makes 4 of them" in text
    assert "4 · 4 · 8 · 32 · 64 · 4 bytes = 1 MiB" in text and 4 * 4 * 8 * 32 * 64 * 4 == MiB
    # The Change cell divides the notebook's sum over ranks, 16 · n_layer · B · T · C · tp, by tp.
    assert "16 * mc.n_layer * cfg.batch_size * cfg.seq_len * mc.n_embd * cfg.tp" in markdown("05_tensor_parallelism",
                                                                                             "code")
    assert "tp_bytes_formula(cfg) / degree" in markdown("05_tensor_parallelism", "code")


def test_what_context_parallel_attention_puts_on_the_wire():
    """Notebook 12's Change cell: the payload rank 0 counts per layer (its own formula, in blocks of B · (T/cp) · C),
    and what leaves the rank — a collective keeps the rank's own share (comm.RING_FACTOR), a ring hop leaves whole.
    At cp = 2 the payloads are equal and the wire is not; a run counts both."""
    code = markdown("12_sequence_context_parallel", "code")
    line = next(line for line in code.splitlines() if line.startswith("BLOCKS_PER_LAYER = "))
    namespace: dict = {}
    exec(line, namespace)
    payload = namespace["BLOCKS_PER_LAYER"]
    by_op = {"allgather": {"all_gather": lambda cp: 2 * cp, "reduce_scatter": lambda cp: 2 * cp},
             "ring": {"send": lambda cp: 6 * cp - 4}, "ulysses": {"all_to_all": lambda cp: 8}}
    wire = {algo: (lambda cp, ops=ops: sum(n(cp) * RING_FACTOR[op](cp) for op, n in ops.items()))
            for algo, ops in by_op.items()}
    for cp in (2, 3, 4, 8):
        for algo, ops in by_op.items():
            assert sum(n(cp) for n in ops.values()) == payload[algo](cp)
        assert wire["allgather"](cp) == pytest.approx(4 * (cp - 1))
        assert wire["ulysses"](cp) == pytest.approx(8 * (cp - 1) / cp)
        assert wire["ring"](cp) == payload["ring"](cp) == 6 * cp - 4
    assert {algo: f(2) for algo, f in payload.items()} == {"allgather": 8, "ring": 8, "ulysses": 8}
    assert {algo: f(2) for algo, f in wire.items()} == {"allgather": 4, "ring": 8, "ulysses": 4}
    # A step of the notebook's runs (T = 64, cp = 2, 4 layers): rank 0's payload and what it sent, in KiB.
    KiB = 2**10
    for algo in ("allgather", "ring", "ulysses"):
        cfg = TrainConfig(cp=2, cp_algo=algo, seq_len=64, steps=1)
        mc = cfg.model_config()
        block = cfg.batch_size * (cfg.seq_len // cfg.cp) * mc.n_embd * 4
        assert block == 64 * KiB and mc.n_layer == 4
        result = run(cfg, timeout=120, quiet=True)
        counted = [(c["bytes"], c["bus_bytes"]) for c in result.comm
                   if c["rank"] == 0 and c["step"] == 0 and c["bytes"] and c["op"] != "all_reduce"]
        assert sum(b for b, _ in counted) == payload[algo](2) * block * mc.n_layer == 2048 * KiB, algo
        assert sum(s for _, s in counted) == wire[algo](2) * block * mc.n_layer, algo
        assert sum(s for _, s in counted) == {"allgather": 1024, "ring": 2048, "ulysses": 1024}[algo] * KiB
    start = code.index("SENT_PER_LAYER = ")
    exec(code[start:code.index("}\n", start) + 1], namespace)  # the dict, over its two lines
    for cp in (2, 3, 4, 8):
        for algo in wire:
            assert namespace["SENT_PER_LAYER"][algo](cp) == pytest.approx(wire[algo](cp)), (algo, cp)
    text = prose("12_sequence_context_parallel")
    assert "each algorithm moves 8 blocks" not in text and "2,048 KiB" not in text
    assert ("What goes on the wire is less where a collective's payload includes the rank's own share, which stays "
            "put") in text and "while every ring hop leaves whole" in text


def test_how_many_kv_blocks_the_ring_holds_at_once():
    """12 §7: RingAttention.forward, printed in the notebook, receives the next K/V block while it attends to the
    current one and drops the current one only after: two blocks at once besides its own (kept for backward)."""
    import inspect

    from gpucourse.parallel.context_parallel_ring import RingAttention

    src = inspect.getsource(RingAttention.forward)
    receive = src.index("(k_next, v_next), handles = _pass([k_cur, v_cur]")
    attend = src.index("block_attention(")
    swap = src.index("k_cur, v_cur = k_next, v_next")
    assert receive < attend < swap, "the next block arrives while the current one is attended to"
    assert "ctx.save_for_backward(q, k, v," in src, "its own block stays too"
    assert "print(inspect.getsource(context_parallel_ring.RingAttention.forward))" in markdown(
        "12_sequence_context_parallel", "code")
    text = prose("12_sequence_context_parallel")
    assert "keeps only one extra block" not in text
    assert ("the ring overlaps its transfers with compute and, besides its own K/V, holds only two blocks at a time "
            "— the one it attends to and the next, on its way") in text


def test_a_prediction_is_printed_beside_the_formula_and_the_run(capsys):
    """The Change cells' check: within 5 % of the measured value or not; empty or not a number, no verdict."""
    from gpucourse.course.predict import check_prediction

    assert check_prediction("bytes", "1,040", 1000.0, 1000.0, "B") is True
    assert check_prediction("bytes", "1100", 1000.0, 1000.0, "B") is False
    assert check_prediction("bytes", "", 1000.0, 1000.0, "B") is None
    assert check_prediction("bytes", "lots", 1000.0, 1000.0, "B") is None
    out = capsys.readouterr().out
    assert "your prediction 1,040 B | the formula 1,000 B | measured in the run 1,000 B" in out
    assert "'lots' is not a number" in out and out.count("NOT within 5 %") == 1


def test_notebook_06_says_how_the_planner_times_compute():
    """06: the H100's 132 SMs, its large GEMMs at 0.80 of the peak times 0.85 sustained, 4.2 million tokens a
    step; the held-out check and the planner's agreement with the sources, the 39 B disagreement's figures, and
    the memory in GiB that lets Llama 3 405B's layout fit."""
    from gpucourse.modeled import plan, published
    from gpucourse.modeled.gpus import get_gpu

    text = " ".join(prose("06_hybrid_planning").split())
    h100 = get_gpu("h100")
    assert (h100.sm_count, h100.gemm_efficiency, h100.sustained) == (132, 0.80, 0.85)
    assert "H100's 132 SMs (a large one at 0.80 of the bf16 peak" in text and "times 0.85, `sustained`" in text
    assert round(1024 * 4096 / 1e6, 1) == 4.2 and "4.2 million tokens per step" in text
    assert f"{len(published.RUNS)} of them" in text
    e = published.errors()
    assert e["heldout_max"] <= 0.25 and "within a quarter of published runs it was never fitted to" in text
    rows = published.agreement()
    assert (sum(r["agrees"] for r in rows), len(rows)) == (15, 20) and "for 15 of 20 runs" in text
    verdict = next(r for r in rows if r["name"].startswith("GPT 48×8192"))
    mine, first = verdict["chosen_row"], verdict["first_row"]
    share = lambda row, k: round(100 * row["parts"][k] / row["step_s"])  # noqa: E731
    assert (mine["tp"], mine["pp"], first["tp"], first["pp"], first["microbatches"]) == (8, 2, 2, 8, 48)
    assert (share(mine, "tp"), share(first, "tp"), share(first, "bubble")) == (15, 2, 6)
    assert "tp 8's take 15 % of the step; at tp 2 they take 2 %" in text and "bubble to 6 %" in text
    assert round(verdict["ratio"], 1) == 1.2 and "costs a narrower model about a fifth" in text
    result = plan.plan(None, 8192, "h100", 8, 2048, 8192, shape="llama3-405b")
    zero2 = next(r for r in result["layouts"] if (r["tp"], r["pp"], r["zero"], r["schedule"]) == (8, 16, 2, "1f1b")
                 and not r["checkpoint_activations"])
    gb = {k: round(v / 1e9, 1) for k, v in zero2["memory"].items()}
    assert (gb["activations"], gb["weights"], round(zero2["memory_total"] / 1e9, 1)) == (68.2, 6.9, 76.3)
    assert "68.2 GB of activations" in text and "6.9 GB of bf16 weights" in text and "needs 76.3 GB" in text
    assert (round(80 * 2**30 / 1e9, 1), round(h100.usable_bytes() / 1e9, 1)) == (85.9, 83.8)
    assert "holds 80 GiB, 85.9 GB" in text and "a run has 83.8 GB" in text and zero2["fits"]
    as_decimal = 80e9 - (80 * 2**30 - h100.usable_bytes())  # the same reserve out of 80·10⁹ bytes
    assert round(as_decimal / 1e9, 1) == 77.9 and "a run would have 77.9 GB: 5.9 GB less" in text
    assert round((h100.usable_bytes() - as_decimal) / 1e9, 1) == 5.9 and round(gb["weights"]) == 7


def test_notebook_13_quotes_mixtrals_own_counts():
    from gpucourse.modeled.shapes import SHAPES

    shape = SHAPES["mixtral-8x7b"]
    assert (round(shape.params() / 1e9, 1), round(shape.active_params() / 1e9, 1)) == (46.7, 12.9)
    assert "46.7 B parameters, 12.9 B of them active" in prose("13_mixture_of_experts")

def test_where_fp16_overflows_and_where_it_rounds_to_zero():
    """07 §2: fp16's smallest positive value is the subnormal 2⁻²⁴ ≈ 5.96e-8; a value rounds to 0 only below half of
    it, 2⁻²⁵ ≈ 2.98e-8 (round to nearest): 3.1e-8 is kept as 2⁻²⁴, 2.9e-8 is 0."""
    import torch

    half = torch.float16
    assert torch.finfo(half).max == 65504 and torch.tensor(65504.0, dtype=half).isfinite()
    smallest = torch.nextafter(torch.zeros((), dtype=half), torch.ones((), dtype=half)).item()
    assert smallest == 2**-24 and f"{smallest:.0e}" == "6e-08"
    assert torch.tensor(3.1e-8, dtype=half).item() == smallest and torch.tensor(2.9e-8, dtype=half).item() == 0
    assert torch.tensor(smallest / 2 * 1.001, dtype=half) != 0 and torch.tensor(smallest / 2 * 0.999, dtype=half) == 0
    assert torch.tensor(5e-8, dtype=half) != 0, "between the two, not 0"
    text = prose("07_memory_batch")
    assert "below about 6 × 10⁻⁸ it is 0" not in text

    def sci(x: float) -> str:  # 6e-08 -> 6 × 10⁻⁸
        mantissa, exponent = f"{x:.0e}".split("e")
        return f"{mantissa} × 10" + str(int(exponent)).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))

    assert (sci(smallest), sci(smallest / 2)) == ("6 × 10⁻⁸", "3 × 10⁻⁸")
    assert (f"its smallest positive value is 2⁻²⁴ ≈ {sci(smallest)} (a subnormal), and a value below half of that, "
            f"about {sci(smallest / 2)}, rounds to 0") in text


def test_notebook_07_compares_none_selective_and_full_recomputation_on_gpt3():
    """07: the scores keep 2 of Korthikanti et al.'s 5 bytes without dropout; on GPT-3 175B (tp 8 with SP, pp 8,
    unfused attention, A100) selective recomputation frees about a third of the activations for under a tenth of
    full recomputation's time, and full recomputation makes the step about a third longer."""
    from gpucourse.modeled import plan
    from gpucourse.modeled.gpus import get_gpu
    from gpucourse.modeled.memory import korthikanti_layer_bytes
    from gpucourse.modeled.shapes import get_shape

    text = " ".join(prose("07_memory_batch").split())
    s, b, h, a = 2048, 1, 12288, 96
    assert korthikanti_layer_bytes(s, b, h, a) - korthikanti_layer_bytes(s, b, h, a, recompute="selective") == \
        5 * a * s * s * b and "their 5·a·s/h bytes per token and channel" in text
    gpt3 = get_shape("gpt3-175b")
    rows = {}
    for rc in ("none", "selective", "full"):
        cfg = TrainConfig(model="gpt2-small", overrides={**gpt3.overrides(), "block_size": 2048}, tp=8, pp=8, dp=8,
                          microbatches=64, batch_size=512, seq_len=2048, precision="bf16", master_weights=True,
                          sequence_parallel=True, attention="math", checkpoint_activations=rc)
        rows[rc] = (plan.memory_of(cfg, gpt3)["max"]["activations"],
                    plan.step_time(cfg, int(gpt3.params()), get_gpu("a100"), 8, shape=gpt3,
                                   framework="megatron-2021"))
    freed = 1 - rows["selective"][0] / rows["none"][0]
    assert 0.3 <= freed <= 0.4 and "frees about a third of the activations here" in text
    assert rows["selective"][1].recompute_s < 0.1 * rows["full"][1].recompute_s
    assert "for under a tenth of full recomputation's time" in text
    assert rows["full"][0] < 0.05 * rows["none"][0] and "frees nearly all of them" in text
    assert round(3 * (rows["full"][1].step_s / rows["none"][1].step_s - 1)) == 1
    assert "for a step a third longer" in text


def test_notebook_07_says_whether_each_gpt3_row_fits_an_a100(capsys):
    """07 §3: the table's memory/GPU is in GB of 10⁹ bytes; even the no-recomputation row's 82.0 GB fits the 80 GiB
    of an "80 GB" A100, 83.8 GB of it a run's (usable_bytes), with 1.8 GB to spare. The rows are the table's own,
    from the notebook's cell run here."""
    a100 = get_gpu("a100")
    cell = next(c for c in json.loads((REPO / "notebooks" / "07_memory_batch.ipynb").read_text(encoding="utf-8"))
                ["cells"] if c.get("id") == "0a793d09")
    exec("".join(cell["source"]), {"TrainConfig": TrainConfig, "get_gpu": get_gpu})
    rows = {line.split()[0]: float(line.split()[3]) for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"none", "selective", "full"}
    usable, room = a100.usable_bytes() / 1e9, 80 * 2**30 / 1e9
    assert max(rows.values()) == rows["none"] > 80 and rows["none"] < usable, "the none row fits, barely"
    text = prose("07_memory_batch")
    assert (f"All three fit an A100, the none row barely: the memory/GPU column counts GB of 10⁹ bytes, and an "
            f"\"80 GB\" A100 holds 80 GiB, {room:.1f} GB, of which a run has {usable:.1f} GB (`usable_bytes()`, as in "
            f"the offload table below), {usable - rows['none']:.1f} GB more than the none row's "
            f"{rows['none']:.1f} GB.") in text
    assert "held['max_total'] <= a100.usable_bytes()" in markdown("07_memory_batch", "code")


def test_notebook_07_says_selective_recomputation_now_chooses_modules():
    """Recipes do not choose between none and full: Megatron-Core's selective granularity recomputes the modules
    ``--recompute-modules`` names (TransformerConfig.recompute_modules: core_attn by default; moe_act, layernorm,
    mla_up_proj, mlp, moe, shared_experts), and NeMo's guidance (Megatron Bridge, "Activation Recomputation")
    starts with selective, comparing core_attn against no module under fused attention, and turns to full only when
    that does not fit. The course's own selective recomputation is Megatron's default, attention's core."""
    import inspect

    from gpucourse.parallel import activation_checkpointing

    assert "attention core" in " ".join(activation_checkpointing.checkpoint_attention.__doc__.split())
    assert "return checkpoint_attention(model)" in inspect.getsource(activation_checkpointing.recompute)
    text = prose("07_memory_batch")
    assert "choose between no recomputation and full recomputation" not in text
    for said in ("so selective recomputation today chooses which modules of every block to recompute: "
                 "Megatron-Core's `--recompute-granularity selective` takes them from `--recompute-modules` — "
                 "`core_attn` by default, and also `mlp`, `layernorm`, `moe_act`, `mla_up_proj` and others",
                 "with `--recompute-method block` the first `--recompute-num-layers` of each pipeline stage",
                 "NVIDIA's NeMo guidance starts with selective recomputation (with a fused attention, comparing "
                 "`core_attn` against no module at all), turns to full only when that does not fit"):
        assert said in text, said


def test_notebook_10_chooses_a_save_interval_from_a_failure_rate_and_reads_a_hang():
    """10: Young's interval at Llama 3 405B's published failure rate (419 unexpected interruptions in 54 days),
    the NCCL watchdog's message and settings named as PyTorch's docs name them."""
    import math

    import torch.distributed.checkpoint as dcp

    text = " ".join(prose("10_accelerate_scaling").split())
    mtbf_h = 54 * 24 / 419
    assert round(mtbf_h, 1) == 3.1 and "419 unexpected interruptions in 54 days on 16,384 H100s" in text
    assert "one every 3.1 hours" in text
    assert round(math.sqrt(2 * 60 * mtbf_h * 3600) / 60) == 19 and "one about every 19 minutes" in text
    assert round(math.sqrt(2 * 600 * mtbf_h * 3600) / 60 / 60) == 1 and "a ten-minute save for one an hour" in text
    assert hasattr(dcp, "async_save") and "torch.distributed.checkpoint.async_save" in text
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        assert name in text
    assert "Watchdog caught collective operation timeout" in text and "10 minutes by default for NCCL" in text


def test_notebook_10_says_the_flight_recorder_and_the_heartbeat_monitor_are_on_by_default():
    """PyTorch 2.13 records each rank's last 2000 collectives unless told otherwise (FlightRecorder.hpp, installed
    with torch) and dumps them at a timeout, to $HOME/.cache/torch/comm_lib_trace_rank_<rank> (FlightRecorder.cpp);
    ProcessGroupNCCL's heartbeat monitor then ends the process 480 s later even with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (ProcessGroupNCCL.cpp, HeartbeatMonitor::runLoop; pytorch/pytorch#133237,
    #143446). Nothing needs turning on."""
    import pathlib

    import torch

    header = pathlib.Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp"
    assert re.search(r'\{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"\},\s*2000\)', header.read_text())
    text = prose("10_accelerate_scaling")
    for said in ("read the **flight recorder**, on by default in PyTorch 2.13: each rank keeps its last 2,000 "
                 "collectives in a ring buffer (`TORCH_FR_BUFFER_SIZE`, formerly `TORCH_NCCL_TRACE_BUFFER_SIZE`; 0 "
                 "turns it off)", "(`TORCH_NCCL_DUMP_ON_TIMEOUT`, also on by default), writes it to "
                 "`~/.cache/torch/comm_lib_trace_rank_<rank>` (`TORCH_FR_DUMP_TEMP_FILE`, formerly "
                 "`TORCH_NCCL_DEBUG_INFO_TEMP_FILE`, sets another prefix", "`torchfrtrace`",
                 "Even at 0, which tears nothing down, the rank does not wait for ever: a heartbeat monitor thread "
                 "(`TORCH_NCCL_ENABLE_MONITORING`, on by default) writes the flight recorder's dump, waits "
                 "`TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC` (480 s) and ends the process"):
        assert said in text, said
    assert "turn on the **flight recorder**" not in text and "(N > 0)" not in text


def test_notebook_08_times_each_overlap_knob_on_the_cluster_model():
    """08: on Llama 3 70B over 64 H100s, --tp-comm-overlap hides 11 s of tp all-reduces, a sixth of a tp 8 × pp 2
    step; --overlap-grad-reduce hides all of a tp 2 × dp 32 step's gradient reduction."""
    import dataclasses

    from gpucourse.modeled import plan
    from gpucourse.modeled.shapes import get_shape

    text = " ".join(prose("08_profiling").split())
    llama = get_shape("llama3-70b")
    core = plan.FRAMEWORKS["megatron-core"]

    def timed(framework, **kw):
        cfg = TrainConfig(model="gpt2-small", overrides={**llama.overrides(), "block_size": 4096}, batch_size=1024,
                          seq_len=4096, precision="bf16", master_weights=True, sequence_parallel=True, zero=1, **kw)
        return plan.step_time(cfg, int(llama.params()), get_gpu("h100"), 8, shape=llama, framework=framework)

    deep = dict(dp=4, tp=8, pp=2, microbatches=256, schedule="interleaved-1f1b")
    plain, hidden = timed(core, **deep), timed(plan.FRAMEWORKS["megatron-core-tp-overlap"], **deep)
    assert round(plain.costs["tensor"].exposed_s) == 11 and hidden.costs["tensor"].exposed_s == 0
    assert round(plain.step_s / (plain.step_s - hidden.step_s)) == 6
    assert "`--tp-comm-overlap` hides 11 s of them, a sixth of the step" in text
    wide = dict(dp=32, tp=2, grad_accum=32)
    after, overlapped = timed(dataclasses.replace(core, name="no overlap", dp="after"), **wide), timed(core, **wide)
    after, overlapped = after.costs["data"], overlapped.costs["data"]
    assert after.exposed_s == after.comm_s > 0 == overlapped.exposed_s
    assert "`--overlap-grad-reduce` hides all of it" in text and "CUDA_DEVICE_MAX_CONNECTIONS=1" in text


def test_notebook_06_compares_hsdp_with_full_sharding_and_names_mig_and_mps():
    """06: a 13 B model on 8 × 8 H100s: HSDP's network carries 0.14 s a step instead of FSDP's 0.24 s, for 26 GB
    of model states a GPU instead of 3.25; MIG's up to 7 instances and its A100 profiles."""
    from gpucourse.modeled.cluster import Cluster
    from gpucourse.modeled.memory import estimate_params

    text = " ".join(prose("06_hybrid_planning").split())
    cluster, payload, every = Cluster(get_gpu("h100"), 8, 8), 2 * 13e9, range(64)
    states = {n: sum(estimate_params(int(13e9), n, 3, "bf16", True, scratch_padding=False).values()) for n in (64, 8)}
    full = 2 * cluster.collective_s("all_gather", payload, every)[0] + cluster.collective_s("reduce_scatter",
                                                                                            payload, every)[0]
    across = cluster.collective_s("all_reduce", payload / 8, range(0, 64, 8))[0]
    assert (round(across, 2), round(full, 2)) == (0.14, 0.24)
    assert (round(states[8] / 1e9), round(states[64] / 1e9, 2)) == (26, 3.25)
    assert "The network carries 0.14 s a step instead of 0.24 s" in text and "(26 GB a GPU instead of 3.25)" in text
    assert "up to 7 isolated instances" in text and "`1g.10gb`, `3g.40gb` and `7g.80gb` on an 80 GB A100" in text


def test_notebook_06_says_what_mps_isolates_and_what_it_does_not():
    """NVIDIA's MPS documentation: since Volta each client has its own GPU address space, and a client's memory
    (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) and share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) can be capped; the
    clients still share the memory bandwidth and the L2 cache, and a fatal fault in one reaches every client on
    that GPU (error containment). Notebook 06 and the tenant question say so."""
    text = prose("06_hybrid_planning")
    assert "but no memory or fault isolation" not in text
    for said in ("Since Volta each client has its own GPU address space, and its memory and its share of the SMs "
                 "can be capped (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`)",
                 "what MPS does not partition is the memory bandwidth and the L2 cache, and it does not contain "
                 "faults: a fatal GPU fault in one client can take down every client on that GPU"):
        assert said in text, said
    explanation = BY_ID["mig-tenant-isolation"]["explanation"]
    assert "the clients share the GPU's memory" not in explanation
    assert "each in its own address space" in explanation and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in explanation
    assert "partitions neither the memory bandwidth nor the L2 cache" in explanation


def test_notebook_06_says_which_gpus_have_mig_and_what_must_be_idle_to_change_it():
    """MIG is on data-center GPUs (A100, A30, H100, H200, B200), not on the Ada L4 or L40S, whatever their compute
    capability; changing a profile needs only the instances it replaces idle (the others keep running), turning
    MIG mode on or off the whole GPU (NVIDIA's MIG user guide)."""
    from gpucourse.runtime.devices import PLATFORMS

    l4 = PLATFORMS["cloud-l4"].devices.gpus[0]
    assert l4.capability > PLATFORMS["cloud-8xa100"].devices.gpus[0].capability and l4.mig is None
    text = prose("06_hybrid_planning")
    assert "MIG** (Multi-Instance GPU, A100 and later)" not in text
    assert ("**MIG** (Multi-Instance GPU: data-center GPUs from the A100 and A30 on, the H100, H200 and B200 too, but "
            "not the L4 or L40S)") in text
    explanation = BY_ID["mig-profile-size"]["explanation"]
    assert "while the GPU is idle" not in explanation
    assert ("only the instances being changed must be idle, the GPU's other instances keep running (turning MIG "
            "mode itself on or off is what needs the whole GPU idle)") in explanation


def test_what_notebook_07_says_offload_moves_and_costs():
    """Llama 3 8B's Adam state (fp32 masters and two moments) is 96 GB; the CPU step moves 28 bytes a parameter;
    ZeRO-2 over eight GPUs gives each an eighth of the CPU's work."""
    from gpucourse.modeled import offload, plan
    from gpucourse.modeled.shapes import get_shape

    text = prose("07_memory_batch")
    llama8 = get_shape("llama3-8b")
    assert f"For Llama 3 8B that is {12 * llama8.params() / 1e9:.0f} GB before a single activation" in text
    assert f"memory-bound, {offload.host_adam_bytes(2, True)} bytes of traffic a parameter" in text
    a100 = get_gpu("a100")
    steps = {}
    for gpus, zero in ((1, 0), (8, 2)):
        cfg = TrainConfig(model="gpt2-small", overrides={**llama8.overrides(), "block_size": 4096}, dp=gpus, zero=zero,
                          batch_size=16 * gpus, grad_accum=16, seq_len=4096, precision="bf16", master_weights=True)
        steps[gpus] = plan.step_time(cfg, int(llama8.params()), a100, 8, shape=llama8, offload=True).offload
        fits = {on: plan.memory_of(cfg, llama8, on)["max_total"] <= a100.usable_bytes() for on in (False, True)}
        assert fits == ({False: False, True: True} if gpus == 1 else {False: True, True: True})
    assert "shrink eightfold" in text and steps[8]["cpu_adam_s"] == pytest.approx(steps[1]["cpu_adam_s"] / 8)
    assert steps[1]["to_host_s"] > 0 and steps[1]["exposed_s"] == pytest.approx(steps[1]["cpu_adam_s"] +
                                                                                   steps[1]["to_gpu_s"])


def test_what_notebook_08_counts_for_a_fused_chain():
    """Eager, `r + relu(x + b) * 0.5` runs four kernels that read or write 9 full-size tensors (counted here from
    the operations PyTorch dispatches); fused, it reads x and r and writes the result: 3."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    x, r, b = torch.randn(64, 32), torch.randn(64, 32), torch.randn(32)
    moved = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            full = [a for a in (*args, out) if isinstance(a, torch.Tensor) and a.numel() == x.numel()]
            moved.append(len(full))
            return out

    with Count():
        r + F.relu(x + b) * 0.5
    assert len(moved) == 4 and sum(moved) == 9
    text = prose("08_profiling")
    assert "9 full-size reads and writes against the fused kernel's 3: a third of the traffic" in text
    assert "eager PyTorch runs it as four kernels" in text


def test_what_notebook_07_says_the_loss_scaler_did_at_the_fp16_spike():
    """07 §2, the notebook's full fp16 run on CPU ranks read row by row, as its prose reads it: the record gives the
    scale of every step, halved after each skip and never grown in 20 steps; the first step is skipped (the flat
    start); the spike's first high loss follows a step that was taken; the steps after it are skipped until the
    scale fits; the largest distance from fp32 is the first step taken again, and the next loss falls more than half
    the way back."""
    base = dict(steps=20, seq_len=64, device="cpu")  # the notebook's BASE outside smoke mode
    fp32 = run(TrainConfig(dp=2, **base))
    fp16 = run(TrainConfig(dp=2, precision="fp16", master_weights=True, **base))
    p = fp16.extras["precision"]
    scales, skipped = p["step_scales"], p["skipped_at"]
    assert len(scales) == len(fp16.losses) and p["skipped_steps"] == len(skipped)
    assert scales[0] == 2**16
    for i, scale in enumerate(scales):
        after = scale / 2 if i in skipped else scale
        assert (scales[i + 1] if i + 1 < len(scales) else p["loss_scale"]) == after, f"step {i}"
    assert 0 in skipped, "the flat start"

    gaps = [a - b for a, b in zip(fp16.losses, fp32.losses)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    first = worst
    while first - 1 in skipped:
        first -= 1
    assert worst not in skipped and first < worst, "the largest distance is the first step taken after skips"
    assert first - 1 not in skipped, "the spike's first high loss follows a step the scaler let through"
    assert gaps[first] > 0.5 * gaps[worst] and gaps[first] > 2 * max(gaps[1:first - 1]), "the spike comes first"
    assert gaps[worst + 1] < gaps[worst] / 2, "the next loss falls most of the way back"
    from gpucourse.parallel.precision import DynamicLossScaler

    assert DynamicLossScaler().growth_interval == 200 > len(fp16.losses), "the scale never grows back"

    text = prose("07_memory_batch")
    for said in ("The first high loss follows a step the scaler let through (no `*`)",
                 "the largest distance from fp32 is the first step taken again",
                 "the next loss falls most of the way back towards fp32's",
                 "doubling needs 200 good steps in a row"):
        assert said in text, said


# --- the notebook sweep (issue 54): statements a reader checked against the cells and the sources ---------------

def test_notebook_02_counts_buckets_in_mib_as_ddp_does():
    """DDP's ``bucket_cap_mb`` is MiB (its docstring), 25 of them by default, with a first bucket of 1 MiB; the
    course's ``bucket_mb`` is MiB too (``assign_buckets`` gets bucket_mb × 2²⁰ bytes)."""
    import inspect

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    doc = " ".join(inspect.getdoc(DistributedDataParallel).split())
    assert "bucket size in MebiBytes (MiB). If ``None``, a default size of 25 MiB" in doc
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    text = prose("02_data_parallelism")
    assert "buckets of at most `bucket_mb` MiB" in text and "megabytes" not in text
    assert "25 MiB by default, `bucket_cap_mb`, in MiB as here; the first bucket is 1 MiB" in text
    assert "int(cfg.bucket_mb * 2**20)" in markdown("02_data_parallelism", "code")


def test_notebook_03_says_why_fsdp2_gathers_more_than_the_scratch_zero3():
    """The scratch ZeRO-3 gathers its root once a step; FSDP2 as TorchFSDP calls it (reshard_after_forward=True on
    every unit) gathers the root again for backward, which torch's default (None) would not: the difference between
    the two runs' all-gathers is the root's weights, on both ranks."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    from gpucourse.parallel import zero_torch

    doc = " ".join(inspect.getdoc(fully_shard).split())
    assert "If ``None``, it is set to ``True`` for non-root modules and ``False`` for root modules." in doc
    assert "fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)" in inspect.getsource(zero_torch)
    gathered = {}
    for impl in ("scratch", "torch"):
        r = run(TrainConfig(dp=2, zero=3, impl=impl, steps=2, seq_len=32, device="cpu"))
        gathered[impl] = {op: sum(c["bytes"] for c in r.comm if c["step"] == 1 and c["op"] == op)
                          for op in ("all_gather", "reduce_scatter")}
    mc = TrainConfig().model_config()
    root = mc.vocab_size * mc.n_embd + mc.block_size * mc.n_embd + 2 * mc.n_embd + mc.n_embd * mc.vocab_size
    assert gathered["torch"]["all_gather"] - gathered["scratch"]["all_gather"] == root * 4 * 2
    assert gathered["torch"]["all_gather"] == 2 * gathered["torch"]["reduce_scatter"]
    assert [round(gathered[i]["all_gather"] / MiB, 2) for i in ("scratch", "torch")] == [3.17, 3.30]
    text = prose("03_zero_fsdp")
    assert "as FSDP2 keeps its root by default" in text
    assert "Its all-gathers carry 3.17 MiB a step where FSDP2's above carried 3.30: here the root is gathered once" in text


def test_notebook_03_fsdp_peak_memory_beside_the_estimate():
    """03 runs FullyShardedDataParallel with Adam at 4 sequences of 64 tokens a rank, and says what each rank's
    peak is made of against the ZeRO-3 estimate; then at 1 sequence of 16 tokens."""
    from gpucourse import launch
    from gpucourse.bench.memory_figures import fsdp_estimate_config, fsdp_module_peaks
    from gpucourse.model import GPT

    assert "SHAPE = (4, 64)" in markdown("03_zero_fsdp", "code")
    per_rank = launch(fsdp_module_peaks, [(4, 64), (1, 16)], 2, world_size=2, timeout=120, device="cpu", quiet=True)
    (long, short), (long1, short1) = per_rank
    assert long == long1 and short == short1, "the ranks hold the same"
    want = memory.estimate(fsdp_estimate_config(4, 64))["per_rank"][0]
    total = sum(want.values())
    said = (f"{long['total'] / MiB:.2f} MiB", f"{total / MiB:.2f} MiB", f"{long['total'] / total:.3f}",
            f"{long['activations'] / MiB:.2f} MiB", f"{want['activations'] / MiB:.2f} MiB")
    assert said == ("5.75 MiB", "5.87 MiB", "0.979", "4.09 MiB", "4.23 MiB")
    assert long["activations"] > 0.95 * want["activations"], "nearly all still saved"
    assert long["gradients"] < 0.01 * want["gradients"], "hardly any gradient yet"
    vectors = sum(p.numel() for p in GPT(TrainConfig().model_config()).parameters() if p.dim() < 2)
    assert vectors == 3_200 and long["weights"] - want["weights"] == 6_400 == vectors // 2 * 4
    short_want = memory.estimate(fsdp_estimate_config(1, 16))["per_rank"][0]
    assert 100 * 2**10 < short_want["activations"] < 1000 * 2**10, "a few hundred KiB"
    assert short_want["activations"] < 0.5 * sum(short_want.values()), "model states make most of it"
    shard_gradients = want["gradients"] - vectors // 2 * 4  # the matrices' shards, fp32
    assert short["temporaries"] > 0.5 * shard_gradients and short["activations"] < 0.5 * short_want["activations"]
    assert short["total"] < sum(short_want.values()), "under the estimate"
    text = prose("03_zero_fsdp")
    for sentence in (f"Each rank peaks at {said[0]} where the estimate says {said[1]} ({said[2]} of it)",
                     f"the activations are nearly all still saved ({said[3]} of the {said[4]} the estimate counts), "
                     "hardly any gradient exists yet",
                     "The weights are 6,400 bytes above the estimate: the module keeps the 3,200 values of the biases "
                     "and norm gains whole on each rank",
                     "`SHAPE = (1, 16)`: the activations shrink to a few hundred KiB",
                     "most activations are freed; it stays under the estimate"):
        assert sentence in text, sentence


def test_notebook_04_modeled_pipelines_idle_a_little_under_the_formula():
    """04's table of idle shares (pp=4, m=8, the learner's size): on modeled H100s each schedule idles a point or two
    under its formula, not over it."""
    from gpucourse import profiling
    from gpucourse.modeled.replay import replay

    for name in ("naive", "gpipe", "1f1b"):
        r = run(TrainConfig(pp=4, microbatches=8, batch_size=16, schedule=name, steps=2, seq_len=64, device="cpu"))
        shares = profiling.time_shares(replay(r, on="h100").timeline, [1])
        idle = sum(s["idle"] for s in shares.values()) / len(shares)
        formula = 3 / 4 if name == "naive" else schedules.formula_bubble(name, 4, 8)
        assert 0 < formula - idle < 0.02, (name, idle, formula)
    assert "GPipe and 1F1B about the bubble (p − 1)/(m + p − 1), each a point or two under the formula" in prose(
        "04_pipeline_parallelism")


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_notebook_04b_counts_each_schedules_transfers(p, m):
    """04b's table: 2·m·(p−1) transfers a step for 1F1B and ZB-H1, 2·m·(p·v−1) interleaved (more than v times
    1F1B's), 2·m·(2p−2) on the V (ZBV and DualPipeV: the turn at the last rank stays on it)."""
    def sends(ops):
        return sum(op.kind in (schedules.SEND_F, schedules.SEND_B) for row in ops for op in row)

    assert sends(schedules.build("1f1b", p, m)) == sends(schedules_virtual.build("zb-h1", p, m)[0]) == 2 * m * (p - 1)
    for v in (2, 4):
        interleaved = sends(schedules_virtual.build("interleaved-1f1b", p, m, v)[0])
        assert interleaved == 2 * m * (p * v - 1) > v * 2 * m * (p - 1)
    for name in ("zbv", "dualpipev"):
        assert sends(schedules_virtual.build(name, p, m)[0]) == 2 * m * (2 * p - 2)
    text = prose("04b_pipeline_schedules")
    assert "p·v − 1 of them against 1F1B's p − 1 (more than v times as many: 112 against 48 at p = 4, v = 2)" in text
    assert "sends more than v times as many messages" in text and "v times 1F1B's" not in text
    assert "| 2·m·(p−1) |" in text and "| 2·m·(p·v−1) |" in text and text.count("| 2·m·(2p−2) |") == 2


def test_notebooks_import_the_moved_modules_by_their_new_names():
    """A module that moved into modeled/, interop/ or course/ still imports by its old name, with a
    DeprecationWarning a learner would see under the cell: no notebook uses an old name."""
    import gpucourse

    old = sorted(name for name in gpucourse._MOVED if name != "progress")
    names = "|".join(old)
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        code = markdown(path.stem, "code")
        imported = [m for block in re.findall(r"from gpucourse import (\([^)]*\)|[^\n]*)", code)
                    for m in re.findall(r"\w+", block) if m in old]
        used = re.findall(rf"(?:import|from) gpucourse\.({names})\b", code)
        assert not imported and not used, (path.name, imported, used)


def test_notebook_08_says_what_each_layout_overlaps():
    """08: at tp 2 × dp 32 the gradient reduction weighs more than at tp 8 × dp 4, and tensor parallelism's still
    more; communication is about two fifths of a modeled step on two ranks and nearly half on four."""
    from gpucourse import profiling
    from gpucourse.modeled import plan
    from gpucourse.modeled.replay import replay
    from gpucourse.modeled.shapes import get_shape

    llama = get_shape("llama3-70b")

    def timed(**kw):
        cfg = TrainConfig(model="gpt2-small", overrides={**llama.overrides(), "block_size": 4096}, batch_size=1024,
                          seq_len=4096, precision="bf16", master_weights=True, sequence_parallel=True, zero=1, **kw)
        return plan.step_time(cfg, int(llama.params()), get_gpu("h100"), 8, shape=llama,
                              framework=plan.FRAMEWORKS["megatron-core"])

    deep = timed(dp=4, tp=8, pp=2, microbatches=256, schedule="interleaved-1f1b")
    wide = timed(dp=32, tp=2, grad_accum=32)
    assert (round(wide.costs["data"].comm_s, 2), round(deep.costs["data"].comm_s, 2),
            round(wide.costs["tensor"].comm_s, 2)) == (0.85, 0.33, 2.10)
    text = prose("08_profiling")
    assert "the gradient reduction weighs more (0.85 s against 0.33 s at dp 4; tensor parallelism's 2.10 s" in text
    assert "what moves most" not in text
    comm = {}
    for n in (2, 4):
        r = run(TrainConfig(dp=n, batch_size=4 * n, steps=2, seq_len=32, device="cpu"))
        comm[n] = profiling.summarize(replay(r, on="h100"))["ranks"][0]["comm"]
    assert round(comm[2], 1) == 0.4 and 0.45 < comm[4] < 0.5
    assert "about two fifths of every step on two ranks, and nearly half on four" in text


def test_notebook_08_counts_what_eager_writes_for_the_chain():
    """08's chain r + relu(x + b) * 0.5: eager makes four full-size tensors (three temporaries and the result) and
    reads or writes 9 full-size tensors; fused it reads x and r and writes one."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    x, r, b = torch.randn(64, 16), torch.randn(64, 16), torch.randn(16)
    full = x.numel()

    class Count(TorchDispatchMode):
        made = reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.reads += sum(isinstance(a, torch.Tensor) and a.numel() == full for a in args)
            Count.made += out.numel() == full
            return out

    with Count():
        r + F.relu(x + b) * 0.5
    assert (Count.made, Count.reads + Count.made) == (4, 9)
    text = prose("08_profiling")
    assert "9 full-size reads and writes against the fused kernel's 3: a third of the traffic" in text
    assert "its four new 16 MiB tensors (the fused kernel makes one, its result)" in text
    assert 4096 * 1024 * 4 == 16 * MiB and "at most 3× faster" not in text


def test_notebook_08_does_not_call_a_compiled_steps_gain_little():
    """08 printed a compiled step 1.9 to 2.3 times faster than eager on this machine beside "gains little"; it says
    what the step gains against the chain instead."""
    text = prose("08_profiling")
    assert "gains little" not in text
    assert "A whole step gains less than the chain did: much of its time is in the matmuls" in text


def test_notebook_08_gives_bucket_and_message_sizes_in_the_units_it_computes():
    """bucket_mb is MiB and bandwidth.KB is 1024 bytes: 08 labels them MiB and KiB."""
    from gpucourse.course import bandwidth

    assert (bandwidth.KB, bandwidth.MB) == (2**10, 2**20)
    code, text = markdown("08_profiling", "code"), prose("08_profiling")
    assert '"buckets of 0.25 MiB"' in code and "{sent / calls / KB:.1f} KiB on average" in code
    assert 'description="bucket MiB"' in code and "no buckets against 0.25 MiB on 4 ranks" in text


def test_notebook_11_recap_says_which_zero_1_sends_what():
    """11's one-page recap: ZeRO-1/2 cost DP's bytes only as the paper writes them; notebook 03's scratch ZeRO-1
    (all-reduce, then all-gather) sends 1.5× and ZeroRedundancyOptimizer (all-reduce, then broadcasts) 2× on 2 ranks,
    the ratios of the ring factors."""
    n = 2
    dp = RING_FACTOR["all_reduce"](n)
    assert RING_FACTOR["reduce_scatter"](n) + RING_FACTOR["all_gather"](n) == dp
    assert (dp + RING_FACTOR["all_gather"](n)) / dp == 1.5 and (dp + RING_FACTOR["broadcast"](n)) / dp == 2
    text = prose("11_certification_review")
    assert ("ZeRO-1/2 as the ZeRO paper writes them: reduce-scatter + all-gather = one all-reduce (DP's); an all-reduce "
            "then an all-gather (this course's ZeRO-1) 1.5×, `ZeroRedundancyOptimizer`'s all-reduce then broadcasts 2× "
            "on 2 ranks") in text


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_notebook_11_recap_gives_a_blocks_activations(tp):
    """11's recap: one block of this course's model keeps about b·T·C·(16 + 48/tp) bytes in fp32 (within 2 %: the
    LayerNorms' statistics and attention's core add a little), 4·b·T·C checkpointed; from memory.estimate."""
    def per_block(**kw):
        est = {n: memory.estimate(TrainConfig(seq_len=64, overrides={"n_layer": n}, **kw))["per_rank"][0]["activations"]
               for n in (4, 8)}
        return (est[8] - est[4]) / 4

    cfg = TrainConfig(tp=tp, seq_len=64)
    btc = cfg.batch_size * cfg.seq_len * cfg.model_config().n_embd
    assert per_block(tp=tp) / btc == pytest.approx(16 + 48 / tp, rel=0.02)
    assert per_block(checkpoint_activations=True) == 4 * btc
    text = prose("11_certification_review")
    assert "this course's model, fp32: ≈ b·T·C·(16 + 48/tp) bytes; checkpointed: the block's input, 4·b·T·C" in text


def test_notebook_13_says_why_a_plan_row_above_80_gb_fits_an_h100():
    """13's Mixtral plan ranks first a layout of 83.34 GB a GPU on "80 GB" H100s: the column is 10⁹ bytes and a run
    has 80 GiB less 2 GiB, 83.8 GB."""
    from gpucourse.modeled import plan

    usable = get_gpu("h100").usable_bytes()
    assert round(usable / 1e9, 1) == 83.8 and usable == 78 * 2**30
    best = next(r for r in plan.plan(None, gpus=64, shape="mixtral-8x7b")["layouts"] if r["fits"])
    assert 80e9 < best["memory_total"] <= usable
    assert ("`memory/GPU` is in GB of 10⁹ bytes, against the 83.8 GB a run has of an \"80 GB\" H100 (80 GiB less "
            "2 GiB, notebook 06): a row above 80 GB still fits") in prose("13_mixture_of_experts")


def test_notebook_13_compares_expert_parallelism_up_to_the_first_different_choice():
    """Top-k routing is discontinuous: over 12 steps of 64 tokens, dp = 2 × ep = 2 may route one token otherwise than
    one device (a near tie, added in another order); the losses agree to 1e-5 up to the first step whose choices
    differ, as 13's cell checks, and by more than rounding from there only."""
    moe = dict(steps=12, seq_len=64, device="cpu", moe_experts=4)
    one, ep = run(TrainConfig(**moe)), run(TrainConfig(dp=2, ep=2, **moe))
    agree = [a == b for a, b in zip(ep.extras["moe"]["tokens_per_expert"], one.extras["moe"]["tokens_per_expert"])]
    upto = agree.index(False) if False in agree else len(agree)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ep.losses[:upto], one.losses[:upto]))
    if upto < len(agree):  # a choice that differs moves one token's row between two experts
        moved = sum(abs(x - y) for a, b in zip(ep.extras["moe"]["tokens_per_expert"][upto],
                                               one.extras["moe"]["tokens_per_expert"][upto]) for x, y in zip(a, b))
        assert moved <= 4
    text = prose("13_mixture_of_experts")
    assert "Top-k routing is where \"equal to float rounding\" ends" in text
    assert "the cell compares the losses up to the first step whose expert choices differ" in text
    assert "upto = agree.index(False) if False in agree else STEPS" in markdown("13_mixture_of_experts", "code")


def test_notebook_15_says_which_bandwidth_its_weight_reads_use():
    """15 times Llama 3 8B's weights at the bandwidth a streaming kernel reaches (0.85 of 3.35 TB/s): 5.6 ms in bf16,
    where 14's floor at the datasheet's 3.35 TB/s is 4.8 ms."""
    from gpucourse.modeled import serve_plan
    from gpucourse.modeled.cluster import Cluster
    from gpucourse.modeled.shapes import get_shape

    h100, weights = get_gpu("h100"), serve_plan.weight_bytes(get_shape("llama3-8b"))
    assert (h100.hbm_GBps, h100.hbm_efficiency) == (3350, 0.85)
    assert Cluster.of(h100).hbm_Bps == 3350e9 * 0.85
    assert round(weights / Cluster.of(h100).hbm_Bps * 1e3, 1) == 5.6 and round(weights / 3350e9 * 1e3, 1) == 4.8
    assert ("at the 85 % of the datasheet's 3.35 TB/s a streaming kernel reaches: so bf16 reads in 5.6 ms here, where "
            "notebook 14's floor at the full 3.35 TB/s is 4.8 ms") in prose("15_inference_optimization")


def test_notebook_09_says_the_flight_recorder_is_on_by_default_as_10_does():
    """09 named TORCH_NCCL_TRACE_BUFFER_SIZE=2000 as what keeps the flight recorder's record; in PyTorch 2.13 it is
    on by default with 2,000 entries, under the name TORCH_FR_BUFFER_SIZE (the old one still read)."""
    import pathlib

    import torch

    header = pathlib.Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp"
    assert re.search(r'\{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"\},\s*2000\)', header.read_text())
    text = prose("09_troubleshooting")
    assert "`TORCH_NCCL_TRACE_BUFFER_SIZE=2000` keeps" not in text
    assert ("the \"flight recorder\", on by default in PyTorch 2.13, keeps each rank's last 2,000 collectives and "
            "dumps them at a timeout (`TORCH_FR_BUFFER_SIZE`, formerly `TORCH_NCCL_TRACE_BUFFER_SIZE`; 0 turns it "
            "off; notebook 10)") in text


def test_notebook_12_zigzag_gives_every_rank_the_same_causal_work():
    """12: with a causal mask plain chunks give the last of cp = 4 ranks 7 times rank 0's query-key pairs, and the
    zig-zag split gives every rank the same; the notebook times the least disturbed of 5 runs a rank, where one run
    on a busy machine once printed zig-zag 4.69 against plain 3.75."""
    import torch

    from gpucourse.data import context_positions

    T, cp = 512, 4
    everything = torch.arange(T)
    for zigzag, spread in ((False, 7.0), (True, 1.0)):
        pairs = [int((context_positions(T, r, cp, zigzag)[:, None] >= everything[None, :]).sum()) for r in range(cp)]
        assert max(pairs) / min(pairs) == pytest.approx(spread, rel=0.02), (zigzag, pairs)
    code = markdown("12_sequence_context_parallel", "code")
    assert "ring_work_times(LONG, 4, zigzag, reps=5)" in code and "reps=1" not in code
    assert "zig-zag gives every rank the same" in prose("12_sequence_context_parallel")


# --- notebooks 06 and 00, read against their runs and the sources (issue 54's sweep) --------------------------

def _plans_06() -> tuple[dict, dict]:
    """Notebook 06's two plans: a 70 B parameter count and Llama 3 70B's shape, on 8 servers of 8 H100s."""
    from gpucourse.modeled import plan

    case = dict(gpus=64, gpu="h100", gpus_per_node=8, batch_size=1024, seq_len=4096)
    return plan.plan(70e9, **case), plan.plan(None, shape="llama3-70b", **case)


def test_notebook_06_says_what_the_dp_group_carries_beside_half_the_model():
    """06 §3: the dp group all-reduces the gradients of what rank 0 holds, a little more than parameters / (tp · pp):
    0.447 MiB at dp 2 × tp 2 and 0.428 at dp 2 × pp 2, against 0.412 for half of the 0.825 MiB model (tensor
    parallelism leaves the embeddings, norms and head whole; the first stage holds the embeddings)."""
    from gpucourse.model import GPT

    mib = 2**20
    whole = sum(p.numel() for p in GPT(TrainConfig().model_config()).parameters()) * 4 / mib
    held = {k: run(TrainConfig(dp=2, steps=1, seq_len=32, **kw)).memory["0"]["gradients"] / mib
            for k, kw in (("tp", {"tp": 2}), ("pp", {"pp": 2, "microbatches": 2}))}
    assert [f"{v:.3f}" for v in (held["tp"], held["pp"], whole / 2, whole)] == ["0.447", "0.428", "0.412", "0.825"]
    text = prose("06_hybrid_planning")
    assert "the gradients of what the rank holds, parameters / (tp · pp), once per step" not in text
    assert "0.447 and 0.428 MiB on rank 0 above, against 0.412 for half of the 0.825 MiB model" in text
    assert "twice the sequence doubles the tp group's bytes above, not the dp group's" in text


def test_notebook_06_says_why_the_fastest_70b_layouts_do_not_fit():
    """06 §5: the eight fastest 70 B layouts, all tp 1 without checkpointing, do not fit: without ZeRO-3 a GPU keeps
    its whole stage's bf16 weights (136.4 GB on one stage), without ZeRO 16 bytes a parameter of model state, and
    with ZeRO-3 the activations alone (90.7 GB) are more than the 83.8 GB a GPU has — not "mostly activations"."""
    seventy, _ = _plans_06()
    usable = get_gpu("h100").usable_bytes()
    fastest = sorted(seventy["layouts"], key=lambda r: r["step_s"])[:8]
    assert all(r["tp"] == 1 and not r["checkpoint_activations"] and not r["fits"] for r in fastest)
    gb = lambda r, k: round(r["memory"][k] / 1e9, 1)  # noqa: E731
    one_stage = [r for r in fastest if r["pp"] == 1]
    assert {gb(r, "weights") for r in one_stage if r["zero"] < 3} == {136.4}
    assert {gb(r, "activations") for r in one_stage} == {90.7} and round(usable / 1e9, 1) == 83.8
    assert all(r["memory"]["activations"] > usable for r in fastest if r["zero"] == 3)
    zero0 = next(r for r in fastest if r["zero"] == 0)
    states = sum(zero0["memory"][k] for k in ("weights", "gradients", "optimizer"))
    assert states / seventy["model_params"] == pytest.approx(16, rel=1e-3)
    assert any(r["memory"]["weights"] > r["memory"]["activations"] for r in fastest)  # not mostly activations
    text = prose("06_hybrid_planning")
    assert "mostly in activations" not in text
    assert ("(136.4 GB with one stage; without ZeRO, 16 bytes per parameter of model state on every replica), and "
            "even with ZeRO-3 the activations alone, 90.7 GB, are more than the 83.8 GB a GPU has") in text


def test_notebook_06_places_the_best_llama_layout_and_times_it_on_a100s():
    """06 §5: Llama 3 70B's best layout has no pipeline, and its dp group (ranks tp apart) spans all 8 servers;
    §6: on A100s the same layouts come first, about two and a half times slower (the peak ratio is 3.2)."""
    from gpucourse.modeled import plan

    seventy, llama = _plans_06()
    best = next(r for r in llama["layouts"] if r["fits"])
    assert (best["dp"], best["tp"], best["pp"]) == (32, 2, 1)
    assert {rank // 8 for rank in range(0, 64, best["tp"])} == set(range(8))  # rank 0's dp group
    a100 = plan.plan(70e9, gpus=64, gpu="a100", gpus_per_node=8, batch_size=1024, seq_len=4096)
    layout = lambda r: (r["dp"], r["tp"], r["pp"], r["zero"], r["schedule"], r["checkpoint_activations"])  # noqa
    fits = {n: [r for r in p["layouts"] if r["fits"]] for n, p in (("h100", seventy), ("a100", a100))}
    assert [layout(r) for r in fits["a100"][:5]] == [layout(r) for r in fits["h100"][:5]]
    assert round(fits["a100"][0]["step_s"] / fits["h100"][0]["step_s"], 1) == 2.6
    text = prose("06_hybrid_planning")
    assert "pipeline stages spread over servers. Where the best layout's groups sit" not in text
    assert "the best layout here has no pipeline, and its data-parallel group spans all 8 servers" in text
    assert "about two and a half times slower" in text and "about three times slower" not in text


def test_notebook_06_says_which_field_counts_the_gpus_of_a_server_in_each_tool():
    """06 §5: torchrun's --nproc-per-node, NeMo's devices and DeepSpeed's --num_gpus count one server's GPUs beside a
    count of servers; Accelerate's num_processes counts every GPU of the job (`accelerate launch --help`)."""
    from gpucourse.interop import stack_config

    _, llama = _plans_06()
    cfg = TrainConfig.from_dict(next(r for r in llama["layouts"] if r["fits"])["config"])
    out = {t: stack_config.translate(cfg, t, gpus_per_node=8) for t in ("megatron", "nemo", "deepspeed", "accelerate")}
    assert "torchrun --nnodes 8 --nproc-per-node 8" in out["megatron"].text
    assert "devices: 8" in out["nemo"].text and "num_nodes: 8" in out["nemo"].text
    assert any("--num_nodes 8 --num_gpus 8" in note for note in out["deepspeed"].notes)
    assert "num_processes: 64" in out["accelerate"].text and "num_machines: 8" in out["accelerate"].text
    text = prose("06_hybrid_planning")
    assert "every tool counts GPUs per server in one field" not in text
    assert ("torchrun's `--nproc-per-node`, NeMo's `devices` and DeepSpeed's `--num_gpus` count the GPUs of one "
            "server, beside a count of servers; Accelerate's `num_processes` alone counts every GPU of the job") in text


def test_notebook_00_says_how_the_hint_ladder_climbs_and_what_is_a_try(tmp_path, monkeypatch):
    """00 §6: the hints show the idea first, where it is taught from the second try, the fix from the fourth; a
    score is out of 10; a stub whose every check says "not written yet" is no try and is not recorded."""
    from gpucourse.course import progress
    from gpucourse.grading import catalog
    from gpucourse.grading.report import LADDER
    from gpucourse.grading.runner import record_progress

    assert LADDER == {"section": 2, "fix": 4} and catalog.POINTS == 10
    monkeypatch.setenv(progress.ENV_VAR, str(tmp_path / "progress.json"))
    stub = {"module": "ex01_ring_allreduce", "score": 0, "max_score": 10,
            "checks": [{"name": "sums", "status": "failed", "hint": "",
                        "message": "not written yet: ring_allreduce raises NotImplementedError"}]}
    assert record_progress({"exercises": [stub]}) == ""
    assert "ex01_ring_allreduce" not in progress.load().get("exercises", {})
    text = prose("00_setup")
    assert ("the first time, the idea the exercise tests; from the second try, where its notebook teaches it; from "
            "the fourth, each failing check's fix") in text and "the score out of 10" in text
    assert 'not a stub whose every check still says "not written yet": that is no try' in text


def test_notebook_06_plans_the_same_model_on_blackwell_and_hopper():
    """06: a B200 multiplies about 2.3 times as fast as an H100 in bf16 with 180 GB instead of 80; its first fitting
    layout for Llama 3 70B on 64 GPUs splits the model over fewer ranks and steps faster, in bf16 and fp8; fp8
    speeds each up by less than the peaks' ratio."""
    from gpucourse.modeled import plan
    from gpucourse.modeled.gpus import get_gpu

    text = prose("06_hybrid_planning")
    h100, b200 = get_gpu("h100"), get_gpu("b200")
    assert round(b200.peak_flops("bf16") / h100.peak_flops("bf16"), 1) == 2.3
    assert (b200.memory_gb, h100.memory_gb) == (180, 80)
    assert "about 2.3 times as fast as an H100 in bf16 and has 180 GB instead of 80" in text
    best = {}
    for gpu in ("h100", "b200"):
        for precision in ("bf16", "fp8"):
            result = plan.plan(None, shape="llama3-70b", gpus=64, gpu=gpu, gpus_per_node=8, batch_size=1024,
                               seq_len=4096, precision=precision)
            best[gpu, precision] = next(r for r in result["layouts"] if r["fits"])
    for precision in ("bf16", "fp8"):
        hopper, blackwell = best["h100", precision], best["b200", precision]
        assert blackwell["tp"] * blackwell["pp"] < hopper["tp"] * hopper["pp"], precision
        assert blackwell["step_s"] < hopper["step_s"], precision
    for gpu in ("h100", "b200"):
        speedup = best[gpu, "bf16"]["step_s"] / best[gpu, "fp8"]["step_s"]
        assert 1 < speedup < get_gpu(gpu).peak_flops("fp8") / get_gpu(gpu).peak_flops("bf16"), (gpu, speedup)
    assert "the B200's layout splits the model over fewer ranks (tp · pp) than the H100's; its step is shorter" in text
    assert "fp8 speeds each up by less than the twice that the peaks promise" in text
    assert all(round(get_gpu(g).peak_flops("fp8") / get_gpu(g).peak_flops("bf16")) == 2 for g in ("h100", "b200"))
