"""Facts the notebooks state in prose, recomputed: the two definitions of the pipeline bubble, 1F1B's warm-up and
peak in flight, the bytes per parameter of the ZeRO paper and of Megatron-Core, ZeRO's traffic, the range of a
good MFU, Korthikanti et al.'s activation counts, what a distributed checkpoint writes, and what torchrun sets for
NCCL's error handling. Where a notebook prints or writes a number, the test reads it there and compares."""

from __future__ import annotations

import json
import subprocess

import pytest

from gpucourse import TrainConfig, memory, quiz, run
from gpucourse.comm import RING_FACTOR
from gpucourse.gpus import get_gpu
from gpucourse.parallel import schedules, schedules_virtual
from procs import BIN, REPO, clean_env, free_port

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


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_zero_traffic_against_data_parallel(n):
    rs, ag, ar = (RING_FACTOR[op](n) for op in ("reduce_scatter", "all_gather", "all_reduce"))
    assert rs + ag == pytest.approx(ar), "ZeRO-2: a reduce-scatter and one all-gather are one all-reduce"
    assert rs + 2 * ag == pytest.approx(1.5 * ar), "ZeRO-3 / FSDP: weights gathered in forward and in backward"
    assert "1.5×" in markdown("01_collectives")


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


def test_mfu_range_is_the_same_in_the_notebook_and_the_bank():
    assert "about 40–60% MFU; 30% is common on smaller or communication-bound runs" in markdown("08_profiling")
    q = BY_ID["prof-mfu"]
    assert "about 0.4–0.6; 0.3 is common on smaller or communication-bound runs" in q["explanation"]
    mfu = 6 * 7e9 * 1e5 / (8 * get_gpu("h100").peak_flops("bf16"))
    assert 0.4 <= mfu <= 0.6 and mfu == pytest.approx(q["answer"], abs=q["tolerance"])


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


# --- the numbers the Change cells give a learner to predict from ---------------------------------------------

def prose(name: str) -> str:
    """One notebook's markdown with every run of whitespace made one space (sentences wrap across lines)."""
    return " ".join(markdown(name).split())


def test_what_to_predict_a_collective_from():
    text = prose("01_collectives")
    assert "S = 4n bytes" in text and "2 · 3/4 · 16 = 24 bytes" in text
    assert RING_FACTOR["all_reduce"](4) * 4 * 4 == 24
    assert RING_FACTOR["broadcast"](4) == 1 and RING_FACTOR["reduce_scatter"](4) == RING_FACTOR["all_gather"](4) == 3 / 4


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


def test_a_prediction_is_printed_beside_the_formula_and_the_run(capsys):
    """The Change cells' check: within 5 % of the measured value or not; empty or not a number, no verdict."""
    from gpucourse.predict import check_prediction

    assert check_prediction("bytes", "1,040", 1000.0, 1000.0, "B") is True
    assert check_prediction("bytes", "1100", 1000.0, 1000.0, "B") is False
    assert check_prediction("bytes", "", 1000.0, 1000.0, "B") is None
    assert check_prediction("bytes", "lots", 1000.0, 1000.0, "B") is None
    out = capsys.readouterr().out
    assert "your prediction 1,040 B | the formula 1,000 B | measured in the run 1,000 B" in out
    assert "'lots' is not a number" in out and out.count("NOT within 5 %") == 1


def test_notebook_06_says_how_the_planner_times_compute():
    """06: the H100's 132 SMs, its large GEMMs at 0.80 of the peak times 0.85 sustained, 4.2 million tokens a
    step; the held-out check and the planner's agreement with the sources, and the Llama 3 405B disagreement's
    figures."""
    from gpucourse import plan, published
    from gpucourse.gpus import get_gpu

    text = prose("06_hybrid_planning")
    h100 = get_gpu("h100")
    assert (h100.sm_count, h100.gemm_efficiency, h100.sustained) == (132, 0.80, 0.85)
    assert "H100's 132 SMs (a large one at 0.80 of the bf16 peak" in text and "times 0.85, `sustained`" in text
    assert round(1024 * 4096 / 1e6, 1) == 4.2 and "4.2 million tokens per step" in text
    assert len(published.RUNS) == 48 and "48 of them" in text
    e = published.errors()
    assert e["heldout_max"] <= 0.25 and "within a quarter of published runs it was never fitted to" in text
    rows = published.agreement()
    assert (sum(r["agrees"] for r in rows), len(rows)) == (13, 20) and "for 13 of 20 runs" in text
    verdict = next(r for r in rows if r["name"].startswith("Llama 3 405B, 8192"))
    assert (verdict["chosen_row"]["zero"], verdict["first_row"]["pp"]) == (3, 32) and "double the pipeline" in text
    result = plan.plan(None, 8192, "h100", 8, 2048, 8192, shape="llama3-405b")
    zero2 = next(r for r in result["layouts"] if (r["tp"], r["pp"], r["zero"], r["schedule"]) == (8, 16, 2, "1f1b")
                 and not r["checkpoint_activations"])
    gb = {k: round(v / 1e9, 1) for k, v in zero2["memory"].items()}
    assert (gb["activations"], gb["weights"], round(zero2["memory_total"] / 1e9, 1)) == (72.5, 6.9, 80.1)
    assert "hold 72.5 GB of activations" in text and "6.9 GB of bf16 weights" in text and "needs 80.1 GB" in text
    assert not zero2["fits"]


def test_notebook_13_quotes_mixtrals_own_counts():
    from gpucourse.shapes import SHAPES

    shape = SHAPES["mixtral-8x7b"]
    assert (round(shape.params() / 1e9, 1), round(shape.active_params() / 1e9, 1)) == (46.7, 12.9)
    assert "46.7 B parameters, 12.9 B of them active" in prose("13_mixture_of_experts")