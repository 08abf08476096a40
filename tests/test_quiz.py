"""The question bank is well formed and right: every numeric answer is recomputed here, with the course's
own functions where it has them; grading, the mock exam's marking, the export and the terminal quiz work."""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from gpucourse.parallel import check
from gpucourse import ConfigError, cli, quiz
from gpucourse.course import progress
from gpucourse.course.bandwidth import bus_factor
from gpucourse.comm import RING_FACTOR
from gpucourse.config import TrainConfig
from gpucourse.data import context_positions
from gpucourse.modeled.gpus import get_gpu
from gpucourse.modeled.memory import estimate_params, korthikanti_layer_bytes, with_microbatch
from gpucourse.model import GPTConfig, MoE, balance_loss, build_model
from gpucourse.parallel import expert_parallel, schedules
from gpucourse.parallel.precision import DynamicLossScaler
from gpucourse.profiling import time_shares
from gpucourse.quiz import bank as bank_module
from procs import REPO, clean_env
from schedule_peaks import awaiting_b

BANK = quiz.load_bank()
BY_ID = {q["id"]: q for q in BANK}


@pytest.fixture(autouse=True)
def progress_file(tmp_path, monkeypatch):
    """Every test records into its own progress file, never the learner's."""
    path = tmp_path / "progress.json"
    monkeypatch.setenv(progress.ENV_VAR, str(path))
    return path


# --- the numeric answers, recomputed ------------------------------------------------------------------

def model_state_gb(n: float, dp: int = 1, zero: int = 0) -> float:
    """Weights + gradients + optimizer, mixed precision with fp32 master weights, in 10^9 bytes."""
    return sum(estimate_params(int(n), dp, zero, "bf16", True, scratch_padding=False).values()) / 1e9


def bubble(schedule: str, pp: int, m: int) -> float:
    """The simulated bubble (forward 1, backward 2), which must equal the textbook formula."""
    sim = schedules.simulate(schedules.build(schedule, pp, m), pp, m)
    assert sim.bubble_fraction == pytest.approx(schedules.formula_bubble(schedule, pp, m))
    return sim.bubble_fraction


def scale_after(scale: float, overflow: bool, steps: int = 1) -> float:
    scaler = DynamicLossScaler(init_scale=scale)
    for _ in range(steps):
        scaler.update(overflow)
    return scaler.scale


def exposed_comm_ms() -> float:
    """The profiling question's step laid out as spans: compute 0-150 ms, communication 90-170 ms."""
    spans = [{"rank": 0, "step": 0, "kind": "step", "start_s": 0.0, "end_s": 0.2},
             {"rank": 0, "step": 0, "kind": "forward", "start_s": 0.0, "end_s": 0.15},
             {"rank": 0, "step": 0, "kind": "comm", "start_s": 0.09, "end_s": 0.17}]
    return time_shares(spans)[0]["comm_s"] * 1e3


def accum_steps(global_batch: int, micro: int, dp: int) -> int:
    steps = global_batch // (micro * dp)
    assert with_microbatch(TrainConfig(dp=dp, grad_accum=steps), micro).batch_size == global_batch
    return steps


def dp_degree(gpus: int, tp: int, pp: int) -> int:
    dp = gpus // (tp * pp)
    assert TrainConfig(dp=dp, tp=tp, pp=pp).world_size == gpus
    return dp


MEGATRON_SUBLAYERS = 2            # attention and MLP, each one column → row region
ALLREDUCES_PER_REGION = 1 + 1     # g in forward, f in backward


def korthikanti_mib(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """One transformer layer's 16-bit activations (Korthikanti et al. 2022), in MiB per GPU.

    Replicated between sub-layers (LayerNorms, dropout, residual): 10·s·b·h bytes, divided by t only with sequence
    parallelism; the tensor-parallel part 24·s·b·h and attention's 5·a·s²·b bytes are divided by t either way.
    """
    per_token_hidden = (10 / t if sp else 10) + 24 / t + 5 * a * s / (h * t)
    return s * b * h * per_token_hidden / 2**20


def ulysses_forward_mib(seq_len: int, cp: int, hidden: int, layers: int = 1, micro: int = 1) -> float:
    """Bytes each rank sends in DeepSpeed-Ulysses' four all-to-alls (q, k, v, output) per layer, forward, bf16."""
    one = micro * (seq_len // cp) * hidden * torch.empty(0, dtype=torch.bfloat16).element_size()
    return layers * 4 * one * RING_FACTOR["all_to_all"](cp) / 2**20

BF16_BYTES = torch.empty(0, dtype=torch.bfloat16).element_size()


def young_interval(save: float, mtbf: float) -> float:
    """Young's first-order checkpoint interval, √(2 · save time · MTBF), in the units given."""
    return math.sqrt(2 * save * mtbf)


NUMERIC = {
    "setup-ring-allreduce-bytes": lambda: RING_FACTOR["all_reduce"](8) * 1.0,
    "setup-allgather-bytes": lambda: RING_FACTOR["all_gather"](4) * 400,
    "setup-busbw": lambda: 100 * bus_factor("all_reduce", 8),
    "setup-world-size": lambda: 4 * 8,
    "setup-global-rank": lambda: 2 * 8 + 3,
    "par-dp-comm-bytes": lambda: RING_FACTOR["all_reduce"](8) * 1e9 * 4 / 1e9,
    "par-zero-mem-1": lambda: model_state_gb(10e9, 32, 1),
    "par-zero-mem-2": lambda: model_state_gb(10e9, 32, 2),
    "par-zero-mem-3": lambda: model_state_gb(10e9, 32, 3),
    "par-bubble-gpipe": lambda: bubble("gpipe", 4, 12),
    "par-bubble-1f1b": lambda: bubble("1f1b", 8, 8),
    "par-bubble-naive": lambda: bubble("naive", 4, 1),
    "par-1f1b-inflight": lambda: schedules.simulate(schedules.build("1f1b", 4, 16), 4, 16).peak_in_flight[0],
    "par-tp-allreduces": lambda: MEGATRON_SUBLAYERS * ALLREDUCES_PER_REGION,
    "par-tp-payload": lambda: 8 * 2048 * 4096 * torch.empty(0, dtype=torch.bfloat16).element_size() / 2**20,
    "par-3d-dp": lambda: dp_degree(64, 8, 2),
    "mem-bytes-mixed": lambda: sum(estimate_params(1, 1, 0, "bf16", True).values()),
    "mem-bytes-fp32": lambda: sum(estimate_params(1).values()),
    "mem-model-states-7b": lambda: model_state_gb(7e9),
    "mem-adam-states": lambda: estimate_params(1)["optimizer"],
    "mem-scaler-backoff": lambda: scale_after(65536, overflow=True),
    "mem-scaler-growth": lambda: scale_after(32768, overflow=False, steps=200),
    "mem-ckpt-flops": lambda: (2 + 4 + 2) / (2 + 4),
    "mem-ckpt-input": lambda: 8 * 1024 * 4096 * torch.empty(0, dtype=torch.bfloat16).element_size() / 2**20,
    "mem-accum-steps": lambda: accum_steps(512, 4, 16),
    "mem-tokens-per-step": lambda: 2 * 16 * 32 * 4096,
    "prof-mfu": lambda: 6 * 7e9 * 1e5 / (8 * get_gpu("h100").peak_flops("bf16")),
    "prof-tflops-per-gpu": lambda: 6 * 13e9 * 2.5e5 / 64 / 1e12,
    "prof-scaling-efficiency": lambda: (68_000 / 8) / (10_000 / 1),
    "prof-profile-shares": exposed_comm_ms,
    "mem-sp-activation-per-layer": lambda: korthikanti_mib(2048, 1, 8192, 64, t=8, sp=True),
    "par-cp-ulysses-bytes": lambda: ulysses_forward_mib(131_072, 8, 4096),
    "mem-selective-sp-bytes": lambda: korthikanti_layer_bytes(2048, 2, 5120, 40, tp=4, sp=True,
                                                              recompute="selective") / 2**20,
    "ft-young-interval": lambda: young_interval(save=2, mtbf=512 / 128 * 60),
    "off-pcie-seconds": lambda: 2 * 13e9 * BF16_BYTES / 50e9,
    "hsdp-cross-node-bytes": lambda: RING_FACTOR["all_reduce"](4) * 13e9 * BF16_BYTES / 8 / 1e9,
    "pp-p2p-bytes": lambda: 16 * 2 * 4096 * 8192 * BF16_BYTES / 2**20,
    "dp-allreduce-time": lambda: 1.3e9 * 4 * RING_FACTOR["all_reduce"](8) / 200e9 * 1e3,
    "fsdp-step-bytes": lambda: 3 * RING_FACTOR["all_gather"](8) * 7e9 * BF16_BYTES / 1e9,
    "tp-forward-bytes": lambda: MEGATRON_SUBLAYERS * RING_FACTOR["all_reduce"](8) * 4096 * 8192 * BF16_BYTES / 2**20,
    "setup-busbw-from-time": lambda: 4e9 / 22_000e-6 * bus_factor("all_reduce", 16) / 1e9,
}


def test_every_numeric_question_has_a_recomputation():
    numeric = {q["id"] for q in BANK if q["kind"] == "numeric"}
    assert numeric == set(NUMERIC), "add a recomputation to NUMERIC for each numeric question (and only those)"


@pytest.mark.parametrize("qid", sorted(NUMERIC))
def test_numeric_answer_is_recomputed(qid):
    q = BY_ID[qid]
    value = NUMERIC[qid]()
    assert abs(value - q["answer"]) <= q["tolerance"] + 1e-9 * abs(value), (qid, value, q["answer"])
    assert quiz.grade(q, value)[0], "the exact value must be graded right"
    # The tolerance forgives rounding, not a different answer.
    assert q["tolerance"] <= 0.01 * abs(q["answer"])


def test_choice_facts_hold():
    fp16 = BY_ID["mem-fp16-overflow"]
    assert fp16["choices"][fp16["answer"]] == str(torch.tensor(70000.0).half().item())
    heads = BY_ID["par-tp-heads"]
    assert [c for c in heads["choices"] if 12 % int(c)] == [heads["choices"][heads["answer"]]]


# --- sequence and context parallelism: every figure the questions state ---------------------------------

SP_CP = "12_sequence_context_parallel"


def span(positions: torch.Tensor) -> str:
    """Positions as the questions write them: '512–1023 and 3072–3583' (contiguous runs joined by 'and')."""
    pos = positions.tolist()
    runs, start = [], pos[0]
    for prev, cur in zip(pos, pos[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}–{prev}")
            start = cur
    return " and ".join(runs)


def visible_key_chunks(seq_len: int, cp: int, rank: int) -> int:
    """How many of cp contiguous key chunks rank's queries see any key of, under a causal mask."""
    q = context_positions(seq_len, rank, cp)
    return sum(bool((context_positions(seq_len, r, cp)[None, :] <= q[:, None]).any()) for r in range(cp))


def causal_pairs(seq_len: int, cp: int, rank: int, zigzag: bool) -> int:
    """(query, key) pairs a rank computes under a causal mask: its attention work."""
    q = context_positions(seq_len, rank, cp, zigzag)
    return int((torch.arange(seq_len)[None, :] <= q[:, None]).sum())


def test_selective_recomputation_figures():
    """The mem-selective-* questions: what selective recomputation frees, what it costs, against full."""
    assert TrainConfig(checkpoint_activations="selective").recompute == "selective"
    assert TrainConfig(checkpoint_activations=True).recompute == TrainConfig(checkpoint_activations="full").recompute
    # mem-selective-sp-bytes: s·b·h = 20 MiB, 5·a·s/(h·t) = 20; 170 MiB kept against 570, full keeps 10.
    s, b, h, a, t = 2048, 2, 5120, 40, 4
    mib = {rc: korthikanti_layer_bytes(s, b, h, a, tp=t, sp=True, recompute=rc) / 2**20
           for rc in ("none", "selective", "full")}
    assert s * b * h == 20 * 2**20 and 5 * a * s / (h * t) == 20 and 34 / t == 8.5
    assert mib == {"none": 570, "selective": 170, "full": 10}
    assert (mib["none"], mib["selective"], mib["full"]) == (20 * (8.5 + 20), 20 * 8.5, 2 * 20 / t)
    # mem-selective-observed and mem-selective-what-reruns: selective drops exactly the 5·a·s/h term (s² scores per
    # head and sequence, 2 + 1 + 2 bytes each); full keeps each layer's input, 2·s·b·h.
    assert korthikanti_layer_bytes(s, b, h, a) - korthikanti_layer_bytes(s, b, h, a, recompute="selective") \
        == 5 * a * s * s * b == (2 + 1 + 2) * a * s * s * b
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * s * b * h
    # mem-selective-cost: at s = 4096, h = 5120 attention's core is s/(6h + s) ≈ 12 % of a layer's forward, about
    # 4 % of a step of three forwards; full recomputation adds a forward: 8N / 6N.
    s, h = 4096, 5120
    core, rest = 4 * s * s * h, 24 * s * h * h
    assert f"{core / (core + rest):.0%}" == "12%" and round(100 * core / (3 * (core + rest))) == 4
    assert core / (core + rest) == pytest.approx(s / (6 * h + s)) and (2 + 4 + 2) / (2 + 4) == pytest.approx(4 / 3)


def test_sequence_parallel_figures():
    # par-sp-what-it-cuts: 512 of 4096 tokens on each of 8 ranks; attention on 512 tokens would be 8× less.
    assert 4096 // 8 == 512 and 4096 / 512 == 8
    # par-sp-comm-bytes: an all-reduce is a reduce-scatter plus an all-gather, in bytes too.
    ar, ag, rs = (RING_FACTOR[op](8) for op in ("all_reduce", "all_gather", "reduce_scatter"))
    assert ar == 2 * 7 / 8 == 1.75 and ag == rs == 7 / 8 and ag + rs == ar and rs / ar == 0.5
    # mem-sp-activation-per-layer: s·b·h = 16 MiB, 5·a·s/h = 80, 14.25 / 23 / 114 times it.
    s, b, h, a, t = 2048, 1, 8192, 64, 8
    assert s * b * h == 16 * 2**20 and 5 * a * s / h == 80 and 34 / t + 80 / t == 14.25
    assert korthikanti_mib(s, b, h, a, t, sp=True) == 16 * 14.25 == 228
    assert korthikanti_mib(s, b, h, a, t) == 16 * (10 + 3 + 10) == 368
    assert korthikanti_mib(s, b, h, a) == korthikanti_mib(s, b, h, a, sp=True) == 16 * 114 == 1824
    # With SP everything is divided by t (Korthikanti's 34/t form).
    assert korthikanti_mib(s, b, h, a, t, sp=True) == pytest.approx(korthikanti_mib(s, b, h, a) / t)


def test_context_parallel_figures():
    # par-cp-positions: cp=4 of 4096 tokens, 1024 each; rank 2 holds 2048–3071.
    assert span(context_positions(4096, 2, 4)) == "2048–3071" and 4096 // 4 == 1024
    # par-cp-zigzag-fix: plain chunks, rank r sees r + 1 chunks (4 to 1 on cp=4; 8 to 1 on cp=8); zig-zag is even.
    assert [visible_key_chunks(4096, 4, r) for r in range(4)] == [1, 2, 3, 4]
    assert [visible_key_chunks(4096, 8, r) for r in (0, 7)] == [1, 8]
    plain = [causal_pairs(4096, 4, r, False) for r in range(4)]
    zigzag = [causal_pairs(4096, 4, r, True) for r in range(4)]
    assert plain == sorted(plain) and plain[0] < plain[-1] and len(set(zigzag)) == 1
    # par-cp-ring-backward-home: a K/V block visits every rank in cp − 1 hops; its gradient is home after cp.
    cp = 8
    for owner in range(cp):
        holders = [(owner + hop) % cp for hop in range(cp + 1)]
        assert set(holders[:cp]) == set(range(cp)) and len(set(holders[:cp])) == cp
        assert holders[cp] == owner and owner not in holders[1:cp]
    # par-cp-ring-overlap: from 8k to 128k tokens a block's compute grows 256×, its transfer 16×.
    assert (131_072 // 8) ** 2 / (8192 // 8) ** 2 == 256 and (131_072 // 8) / (8192 // 8) == 16
    # par-cp-ulysses-heads: 32 heads over tp=8 leave 4 per tp rank: cp=8 cannot share them, cp=4 can.
    assert 32 // 8 == 4 and (32 // 8) % 8 and (32 // 8) % 4 == 0
    # par-cp-ulysses-bytes: one rank's tensor is 128 MiB, 7/8 of it leaves, four times: 448 MiB.
    assert 131_072 // 8 == 16_384 and 1 * 16_384 * 4096 * 2 / 2**20 == 128
    assert RING_FACTOR["all_to_all"](8) * 128 == 112 and ulysses_forward_mib(131_072, 8, 4096) == 4 * 112 == 448
    # par-cp-grad-group: dp=4 × cp=2 is 8 ranks.
    assert TrainConfig(dp=4, cp=2).world_size == 4 * 2 == 8
    # par-cp-loss-tokens: 2048 tokens at 2.0 and 512 at 3.0: 2.2 over 2560 tokens; the mean of means is 2.5.
    counts, means = torch.tensor([2048.0, 512.0]), torch.tensor([2.0, 3.0])
    assert counts.sum() == 2560 and means.mean() == 2.5
    assert (counts * means).sum() / counts.sum() == pytest.approx(2.2)
    # par-cp-sp-layout: tp=8 × cp=4 leaves dp=2 on 64 GPUs; dp=8 would need 256.
    assert 64 // (8 * 4) == 2 and TrainConfig(dp=2, cp=4, tp=8).world_size == 64 and 8 * 4 * 8 == 256


def test_zigzag_positions_choices():
    q = BY_ID["par-cp-zigzag-positions"]
    rank1 = context_positions(4096, 1, 4, zigzag=True)
    assert q["choices"][q["answer"]] == span(rank1) == "512–1023 and 3072–3583"
    assert torch.equal(rank1, torch.cat([torch.arange(512, 1024), torch.arange(3072, 3584)]))
    chunks = torch.arange(4096).chunk(8)                 # 8 chunks of 512 tokens
    assert all(len(c) == 512 for c in chunks)
    others = {span(context_positions(4096, 1, 4)).replace("1024–2047", "1024–1535 and 1536–2047"),
              span(torch.cat([chunks[1], chunks[5]])),   # chunks i and i + cp: not zig-zag
              span(torch.cat([chunks[2], chunks[5]]))}   # chunks 2i and 2·cp − 1 − 2i: not zig-zag
    assert others == {c for i, c in enumerate(q["choices"]) if i != q["answer"]}
    assert span(context_positions(4096, 1, 4)) == "1024–2047"


def test_ring_merge_by_log_sum_exp_is_full_attention():
    """par-cp-ring-merge: lse = log(e^lse + e^lse_j), weights e^(lse_j − lse): full attention; averaging is not."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, n, 8, generator=gen, dtype=torch.float64) for n in (16, 32, 32))
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    full = torch.softmax(scores, -1) @ v
    parts = []
    for cols in torch.arange(32).chunk(4):              # four K/V blocks, as on cp=4 ranks
        s_j = scores[..., cols]
        parts.append((torch.softmax(s_j, -1) @ v[..., cols, :], torch.logsumexp(s_j, -1)))
    lse = torch.full(scores.shape[:-1], float("-inf"), dtype=torch.float64)
    out = torch.zeros_like(full)
    for o_j, lse_j in parts:                             # the running merge, block by block
        new = torch.log(torch.exp(lse) + torch.exp(lse_j))
        out = out * torch.exp(lse - new)[..., None] + o_j * torch.exp(lse_j - new)[..., None]
        lse = new
    assert torch.allclose(out, full) and torch.allclose(lse, torch.logsumexp(scores, -1))
    closed = sum(o_j * torch.exp(lse_j - lse)[..., None] for o_j, lse_j in parts)
    assert torch.allclose(closed, full)
    assert not torch.allclose(sum(o for o, _ in parts) / 4, full)
    assert not torch.allclose(sum(o for o, _ in parts), full)


def test_sequence_context_questions_are_not_gameable():
    """The SP/CP questions: mostly scenarios, the right choice never the longest, letters spread, few numerics."""
    qs = quiz.load_bank(notebook=SP_CP)
    assert len(qs) >= 16 and {q["topic"] for q in qs} <= {"parallelism", "memory-batch"}
    kinds = Counter(q["kind"] for q in qs)
    assert kinds["numeric"] <= 2 and 2 <= kinds["multiple"] <= 3 and kinds["single"] >= 12
    assert sum(len(q["question"]) > 150 for q in qs) >= 12
    singles = [q for q in qs if q["kind"] == "single"]
    for q in singles:
        lengths = [len(c) for c in q["choices"]]
        right = lengths[q["answer"]]
        assert right < max(lengths), f"{q['id']}: the right choice is the longest"
        assert min(lengths) >= 0.7 * max(lengths), f"{q['id']}: choices of very different lengths"
    shortest = sum(len(q["choices"][q["answer"]]) < min(len(c) for i, c in enumerate(q["choices"]) if i != q["answer"])
                   for q in singles)
    assert shortest <= len(singles) / 4, "the right choice must not be the shortest either"
    positions = Counter(q["answer"] for q in singles)
    assert set(positions) == {0, 1, 2, 3} and max(positions.values()) <= 0.4 * len(singles), positions
    for q in qs:
        if q["kind"] == "multiple":
            assert sorted(q["answer"]) != list(range(len(q["answer"]))), f"{q['id']}: the right ones lead"
            assert len(q["answer"]) < len(q["choices"])


# --- the bank is well formed --------------------------------------------------------------------------

def test_bank_size_and_topics():
    assert len(BANK) >= 80
    per_topic = Counter(q["topic"] for q in BANK)
    assert set(per_topic) == set(quiz.TOPICS)
    assert min(per_topic.values()) >= 15, per_topic
    assert set(Counter(q["kind"] for q in BANK)) == {"single", "multiple", "numeric"}


def test_ids_are_unique():
    ids = [q["id"] for q in BANK]
    assert len(ids) == len(set(ids))


def stem_and_answer(q: dict) -> list[str]:
    """A question's words followed by its right answer's: what two questions must not almost share."""
    right = [str(q["answer"])] if q["kind"] == "numeric" else [q["choices"][i] for i in right_indices(q)]
    return re.findall(r"\w+", " ".join([q["question"], *right]).lower())


def similarity(a: list[str], b: list[str], floor: float = 0.0) -> float:
    """difflib's ratio of two word lists (2 × matched words / all words), 0 when its quick bounds are below floor."""
    m = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return m.ratio() if m.real_quick_ratio() > floor and m.quick_ratio() > floor else 0.0


# Chosen from the bank as it stands: the most similar pairs are par-bubble-gpipe / par-bubble-1f1b (0.81) and
# par-zero-mem-2 / par-zero-mem-3 (0.72), then par-tp-payload / mem-ckpt-input (0.58), par-zero-mem-1 /
# par-zero-mem-2 (0.55), every other pair under 0.52; a copy with only its numbers changed scores above 0.9.
NEAR_DUPLICATE = 0.70
# Pairs above the line today, kept knowingly: one template asked twice. Rewrite one of a pair, then drop it here.
SIBLINGS = {("par-bubble-gpipe", "par-bubble-1f1b"): "GPipe and 1F1B with the same bubble formula and wording",
            ("par-zero-mem-2", "par-zero-mem-3"): "one model at ZeRO stage 2 and at stage 3, each stem whole"}


def test_no_two_questions_are_near_duplicates():
    """No two stems (with their right answers) are near copies: a mock exam would ask the same thing twice."""
    words = {q["id"]: stem_and_answer(q) for q in BANK}
    close = {(a, b): round(r, 2) for (a, wa), (b, wb) in itertools.combinations(words.items(), 2)
             for r in [similarity(wa, wb, NEAR_DUPLICATE)] if r > NEAR_DUPLICATE}
    assert set(close) - set(SIBLINGS) == set(), {k: v for k, v in close.items() if k not in SIBLINGS}
    assert set(SIBLINGS) <= set(close), f"no longer near duplicates, drop from SIBLINGS: {set(SIBLINGS) - set(close)}"


def test_the_near_duplicate_measure_catches_a_copy():
    q = BY_ID["par-bubble-naive"]
    copy = {**q, "question": q["question"].replace("p=4", "p=8"), "answer": 7 / 8}
    assert similarity(stem_and_answer(q), stem_and_answer(copy)) > NEAR_DUPLICATE
    assert similarity(stem_and_answer(q), stem_and_answer(BY_ID["setup-nvlink"])) < 0.3


@pytest.mark.parametrize("q", BANK, ids=lambda q: q["id"])
def test_question_is_well_formed(q):
    assert q["topic"] in quiz.TOPICS and q["notebook"] in quiz.NOTEBOOKS
    assert q["question"].strip() and len(q["explanation"]) >= 60 and "answer" in q
    if q["kind"] == "numeric":
        assert "choices" not in q and q["tolerance"] >= 0
        return
    n = len(q["choices"])
    assert n >= 2 and len(set(q["choices"])) == n
    right = [q["answer"]] if q["kind"] == "single" else q["answer"]
    assert right and all(isinstance(i, int) and 0 <= i < n for i in right)
    assert quiz.grade(q, q["answer"])[0]
    wrong = next(i for i in range(n) if i not in right)
    assert not quiz.grade(q, wrong if q["kind"] == "single" else [wrong])[0]


# A stem that leans on another question's: its opening points back ("In that overflow step", "Same model", "One of
# those all-reduces"), or it names another question. A quiz or a mock exam draws each question alone, in any order.
BACK_REFERENCE = re.compile(
    r"^(in|at|for|after|from|with|under|on) (that|those|this|these|the (same|previous|above|last)) "
    r"(step|run|model|layout|job|case|setup|cluster|question|example|scenario|situation|one|overflow|configuration)"
    r"|^(same|as above|as before|again|also|then|continuing|following|similarly|likewise)\b"
    r"|^(one|each|some|all|both|none|any|two) of (those|these|them|the above)\b"
    r"|\b(previous|last|above|preceding|earlier|first|other) question\b|\bquestion above\b|\bas (above|before)\b",
    re.IGNORECASE)


def test_back_references_are_caught():
    leaning = ["In that overflow step, what happens to the weights?", "Same model and layout, now ZeRO stage 2.",
               "Same again, with ZeRO stage 3.", "One of those tensor-parallel all-reduces carries",
               "In the previous question's run, what", "As above, but with dp=8.", "With the same model as before, ",
               "Continuing the example, how many", "Using the numbers of the previous question, what"]
    assert [s for s in leaning if not BACK_REFERENCE.search(s)] == []
    standing = ["In a 1F1B pipeline with p=4", "In which order do gradients become ready", "With ZeRO stage 2, which",
                "One of Megatron tensor parallelism's all-reduces", "With the same m, what", "On a node of 8 GPUs",
                "An fp16 run with a dynamic loss scaler finds inf values in one step's gradients"]
    assert [s for s in standing if BACK_REFERENCE.search(s)] == []


def test_no_stem_leans_on_another_question():
    """Every stem states its own situation: none opens by pointing back at another question's, or names one."""
    leaning = {q["id"]: q["question"][:70] for q in BANK if BACK_REFERENCE.search(q["question"])}
    assert not leaning, leaning


def test_right_answers_are_spread_over_positions():
    """A learner must not be able to score by always picking the same letter."""
    positions = Counter(q["answer"] for q in BANK if q["kind"] == "single")
    assert max(positions.values()) <= 0.4 * sum(positions.values()), positions


def right_indices(q: dict) -> list[int]:
    return [q["answer"]] if q["kind"] == "single" else list(q["answer"])


def test_the_longest_choice_is_not_a_tell():
    """Over the whole bank, picking the longest choice must not pass: the right choice is rarely the strictly longest,
    and right choices are about as long as wrong ones."""
    singles = [q for q in BANK if q["kind"] == "single"]
    longest = [q["id"] for q in singles
               if all(len(q["choices"][q["answer"]]) > len(c) for i, c in enumerate(q["choices"]) if i != q["answer"])]
    right, wrong = [], []
    for q in BANK:
        if q["kind"] != "numeric":
            for i, c in enumerate(q["choices"]):
                (right if i in right_indices(q) else wrong).append(len(c))
    ratio = (sum(right) / len(right)) / (sum(wrong) / len(wrong))
    measured = (f"right choice strictly longest in {len(longest)} of {len(singles)} single-choice questions "
                f"({len(longest) / len(singles):.0%}); mean right/wrong length {ratio:.2f}")
    assert len(longest) <= 0.30 * len(singles), measured + f": {', '.join(longest)}"
    assert ratio <= 1.25, measured


def test_select_all_answers_do_not_lead():
    """In select-all questions the right choices are not simply the first ones, and they sit at every position."""
    multiple = [q for q in BANK if q["kind"] == "multiple"]
    leading = [q["id"] for q in multiple if sorted(q["answer"]) == list(range(len(q["answer"])))]
    spread = Counter(i for q in multiple for i in q["answer"])
    measured = f"{len(leading)} of {len(multiple)} select-all questions have their right choices first; {spread}"
    assert len(leading) <= 0.25 * len(multiple), measured + f": {', '.join(leading)}"
    assert set(spread) == set(range(max(len(q["choices"]) for q in multiple))), measured
    assert all(len(q["answer"]) < len(q["choices"]) for q in multiple)


POSITION_WORDS = [r"(?<!, )\b[A-D]\)", r"\([a-dA-D]\)", r"\b(?i:option|choice)s? *[A-D1-4]\b", r"\b(?i:answer) [A-D]\b",
                  r"(?i)\b(first|second|third|fourth|last|other) (option|choice|answer)s?\b",
                  r"(?i)\b(all|none|both) of the (above|others|options|choices)\b", r"(?i)\bthe (above|previous) (option|choice)"]


def test_position_words_are_caught():
    examples = ["B) is wrong", "unlike (c)", "so option A", "choice 2 is", "answer D", "the first choice", "Option 3",
                "the last answer", "the other options", "all of the above", "none of the others", "the previous choice"]
    assert [e for e in examples if not any(re.search(p, e) for p in POSITION_WORDS)] == []
    assert not any(re.search(p, "a (b, T/cp, C) tensor; the answer is 2.2") for p in POSITION_WORDS)


@pytest.mark.parametrize("pattern", POSITION_WORDS)
def test_explanations_name_choices_by_content_not_position(pattern):
    """Choices are shuffled when shown, so neither an explanation nor a choice may point at a letter or a position."""
    found = {q["id"]: m.group(0) for q in BANK for text in [q["explanation"], *q.get("choices", [])]
             for m in [re.search(pattern, text)] if m}
    assert not found, found


CHOICE_QUESTIONS = [q for q in BANK if q["kind"] != "numeric"]


def test_shuffled_is_reproducible_and_keeps_the_answer():
    for q in CHOICE_QUESTIONS:
        for seed in (0, 1, 12345):
            s = bank_module.shuffled(q, seed)
            assert s == bank_module.shuffled(q, seed), q["id"]
            assert sorted(s["choices"]) == sorted(q["choices"])
            assert sorted(s["choices"][i] for i in right_indices(s)) == sorted(q["choices"][i] for i in right_indices(q))
            assert quiz.grade(s, s["answer"])[0]
            assert {**s, "choices": q["choices"], "answer": q["answer"]} == q  # nothing else changes
    assert quiz.load_bank() == BANK  # the bank itself is never reordered
    numeric = BY_ID["par-bubble-gpipe"]
    assert bank_module.shuffled(numeric, 3) == numeric


def test_shuffled_orders_differ_across_seeds():
    moved = sum(bank_module.shuffled(q, 1)["choices"] != bank_module.shuffled(q, 2)["choices"] for q in CHOICE_QUESTIONS)
    assert moved >= 0.8 * len(CHOICE_QUESTIONS), f"{moved} of {len(CHOICE_QUESTIONS)} orders differ between seeds"
    unseeded = sum(bank_module.shuffled(q, None)["choices"] != q["choices"] for q in CHOICE_QUESTIONS)
    assert unseeded >= 0.5 * len(CHOICE_QUESTIONS)
    q = BY_ID["setup-nvlink"]
    assert {bank_module.shuffled(q, seed)["answer"] for seed in range(100)} == {0, 1, 2, 3}


def test_quizzes_and_exams_show_the_seeds_choice_order():
    """ask and mock_exam shuffle through the same function: one seed, one order per question, wherever it is drawn."""
    drawn = quiz.ask(count=1000, seed=7)
    assert drawn == quiz.ask(count=1000, seed=7)
    assert all(q == bank_module.shuffled(BY_ID[q["id"]], 7) for q in drawn)
    assert sum(q["choices"] != BY_ID[q["id"]]["choices"] for q in drawn if "choices" in q) >= 0.8 * len(CHOICE_QUESTIONS)
    exam = quiz.mock_exam(40, seed=7)
    assert exam.questions == quiz.mock_exam(40, seed=7).questions
    assert all(q == bank_module.shuffled(BY_ID[q["id"]], 7) for q in exam)
    other = {q["id"]: q for q in quiz.mock_exam(40, seed=8)}
    both = [q for q in exam if q["id"] in other and "choices" in q]
    assert sum(q["choices"] != other[q["id"]]["choices"] for q in both) >= 0.6 * len(both)


def test_a_malformed_question_is_refused():
    good = dict(BY_ID["setup-nvlink"])
    for change, words in [({"answer": 9}, "does not index"), ({"notebook": "99_x"}, "notebook"),
                          ({"topic": "cooking"}, "topic"), ({"explanation": ""}, "explanation")]:
        with pytest.raises(quiz.BankError, match=words):
            bank_module._check({**good, **change})


# --- drawing and grading ------------------------------------------------------------------------------

def test_ask_is_reproducible_and_filters_by_topic():
    assert [q["id"] for q in quiz.ask(count=5, seed=3)] == [q["id"] for q in quiz.ask(count=5, seed=3)]
    qs = quiz.ask("memory-batch", count=1000, seed=0)
    assert len(qs) == sum(q["topic"] == "memory-batch" for q in BANK)
    assert {q["topic"] for q in qs} == {"memory-batch"}
    qs[0]["answer"] = "changed"
    assert all(q["answer"] != "changed" for q in quiz.load_bank())  # callers get copies
    with pytest.raises(ValueError, match="no topic"):
        quiz.ask("cooking")
    with pytest.raises(ValueError, match="at least 1"):
        quiz.ask(count=0)


def test_grade_reads_typed_answers():
    single, multiple, numeric = BY_ID["setup-nvlink"], BY_ID["par-fsdp-true"], BY_ID["par-bubble-gpipe"]
    assert quiz.grade(single, "abcd"[single["answer"]].upper())[0]
    assert multiple["answer"] == [1, 2, 3]
    assert quiz.grade(multiple, "b, c d")[0] and quiz.grade(multiple, "dcb")[0]
    assert not quiz.grade(multiple, "bc")[0]  # one right answer missing
    for text in ("0.2", "20%", "3/15", " 0.2 "):
        assert quiz.grade(numeric, text)[0], text
    ok, why = quiz.grade(numeric, 0.25)
    assert not ok and why.startswith("Not quite: the answer is 0.2") and "(p−1)/(m+p−1)" in why
    assert quiz.grade(numeric, None)[1].startswith("No answer")
    assert quiz.grade(single, "z")[1].startswith("Could not read")
    assert not quiz.grade(single, True)[0]  # a bool is not a choice index
    with pytest.raises(ValueError, match="single letter"):
        quiz.parse_response(single, "ab")


# --- the mock exam ------------------------------------------------------------------------------------

def test_mock_exam_draws_choice_questions_by_the_exams_topic_weights(capsys):
    from gpucourse.quiz.exam import quotas

    weights = quiz.EXAM_WEIGHTS
    assert set(weights) == set(quiz.TOPICS) and sum(weights.values()) == pytest.approx(1)
    # The exam weights its whole "GPU Acceleration and Optimization" topic (14%), not its four parts: a quarter each.
    assert set(weights.values()) == {0.25}
    exam = quiz.mock_exam(40, seed=5)
    assert len(exam) == 40 and len({q["id"] for q in exam}) == 40
    assert exam.time_limit_s == 40 * quiz.SECONDS_PER_QUESTION == 3600
    assert {q["kind"] for q in exam} <= {"single", "multiple"}  # typed numbers stay practice
    assert Counter(q["topic"] for q in exam) == quotas(40, weights) == {t: 10 for t in quiz.TOPICS}
    assert {q["topic"] for q in quiz.mock_exam(4, seed=0)} == set(quiz.TOPICS)
    assert [q["id"] for q in exam] == [q["id"] for q in quiz.mock_exam(40, seed=5)]
    # Every topic has choice questions enough for a 40-question exam, and some to spare for a second draw.
    choice = Counter(q["topic"] for q in BANK if q["kind"] != "numeric")
    assert all(choice[t] >= 2 * n for t, n in quotas(40, weights).items()), choice
    # The longest exam is the last count the bank can fill at those weights; one more is refused in one sentence.
    limit = quiz.most_questions()
    assert limit >= 40 and limit <= sum(choice.values())
    assert all(n <= choice[t] for count in range(1, limit + 1) for t, n in quotas(count, weights).items())
    assert any(n > choice[t] for t, n in quotas(limit + 1, weights).items())
    assert len(quiz.mock_exam(limit, seed=1)) == limit
    for count in (0, limit + 1, len(BANK) + 1):
        with pytest.raises(ValueError, match=f"from 1 to {limit} questions"):
            quiz.mock_exam(count)
    assert cli.main(["quiz", "--exam", "--count", str(limit + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"from 1 to {limit} questions" in err[0] and f"not {limit + 1}" in err[0]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "EXAM_WEIGHTS" in readme and "14%" in readme and "NVIDIA may change its weights" in readme


def test_score_exam_all_right():
    exam = quiz.mock_exam(40, seed=1)
    result = quiz.score_exam(exam, [q["answer"] for q in exam])
    assert (result["correct"], result["total"], result["percent"], result["wrong"]) == (40, 40, 100.0, [])
    assert all(t["score"] == 1 for t in result["by_topic"].values())
    assert result["timing"]["over_time"] is False and "under the 60 min limit" in result["timing"]["verdict"]


def test_score_exam_lists_the_wrong_ones():
    exam = quiz.mock_exam(40, seed=2)
    answers = [q["answer"] for q in exam]
    wrong_at = [0, 7, 19]
    for i in wrong_at:
        q = exam[i]
        answers[i] = None if q["kind"] == "numeric" else ([] if q["kind"] == "multiple" else
                                                          (q["answer"] + 1) % len(q["choices"]))
    result = quiz.score_exam(exam.questions, answers, started=1000.0, finished=1000.0 + 3700,
                             time_limit_s=3600)
    assert (result["correct"], result["score"], result["percent"]) == (37, 37 / 40, 92.5)
    assert [w["id"] for w in result["wrong"]] == [exam[i]["id"] for i in wrong_at]
    assert all(w["explanation"] == BY_ID[w["id"]]["explanation"] and w["notebook"] == BY_ID[w["id"]]["notebook"]
               for w in result["wrong"])
    assert result["revisit"] == sorted({exam[i]["notebook"] for i in wrong_at})
    missed = Counter(exam[i]["topic"] for i in wrong_at)
    for topic, t in result["by_topic"].items():
        assert t["total"] - t["correct"] == missed.get(topic, 0)
    assert result["timing"]["over_time"] is True
    assert result["timing"]["verdict"] == "took 61 min 40 s: over the 60 min limit by 1 min 40 s"
    by_id = quiz.score_exam(exam.questions, {q["id"]: a for q, a in zip(exam, answers)})
    assert by_id["correct"] == 37 and by_id["timing"] is None
    report = quiz.format_report(result)
    assert "score: 37/40 (92.5%)" in report and exam[7]["explanation"] in report


# --- export and the terminal ----------------------------------------------------------------------------

def test_export_writes_the_bank_atomically(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bank.json"
    assert cli.main(["quiz", "--export", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["questions"] == BANK
    assert all({"question", "answer", "explanation", "topic", "notebook"} <= set(q) for q in data["questions"])
    assert f"{len(BANK)} questions written" in capsys.readouterr().out

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        quiz.export_bank(out, "parallelism")
    assert json.loads(out.read_text()) == data  # the old file is whole
    assert os.listdir(tmp_path) == ["bank.json"]  # no temporary file left behind


def test_bad_topic_is_one_sentence_and_status_2(capsys):
    assert cli.main(["quiz", "--topic", "cooking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--topic 'cooking' is not one of" in err[0] and "parallelism" in err[0]
    assert cli.main(["quiz", "--count", "0"]) == 2


def typed_answer(q: dict) -> str:
    """What a learner who knows the answer types."""
    if q["kind"] == "numeric":
        return repr(q["answer"])
    right = [q["answer"]] if q["kind"] == "single" else q["answer"]
    return ",".join("abcdefgh"[i] for i in right)


def test_terminal_quiz_with_piped_answers(tmp_path, progress_file):
    qs = quiz.ask(count=2, seed=0)
    typed = ["zzz"] + [typed_answer(q) for q in qs]  # unreadable first: asked again
    run = subprocess.run([sys.executable, "-m", "gpucourse", "quiz", "--count", "2", "--seed", "0"],
                         check=False, input="\n".join(typed) + "\n", capture_output=True, text=True, timeout=60,
                         cwd=tmp_path,
                         env=clean_env(GPUCOURSE_PROGRESS=str(progress_file)))
    assert run.returncode == 0, run.stderr
    assert "score: 2/2 (100%)" in run.stdout and run.stdout.count("✓ Correct.") == 2
    assert "answer with" in run.stdout  # the unreadable answer was refused
    assert qs[0]["question"][:40] in run.stdout
    saved = progress.load()["quizzes"]
    assert [(e["topic"], e["correct"], e["total"]) for e in saved] == [("mixed", 2, 2)]


def test_terminal_exam_hands_in_early(monkeypatch, capsys, progress_file):
    answers = iter(["a"])

    def fake_input(prompt=""):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    assert cli.main(["quiz", "--exam", "--count", "4", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "handed in early" in out and "/4 (" in out and "time: took" in out
    entry = progress.load()["quizzes"][0]
    assert entry["topic"] == "mock-exam" and entry["total"] == 4 and set(entry["by_topic"]) == set(quiz.TOPICS)


# --- the notebook widgets -------------------------------------------------------------------------------

def _answer_widget(card):
    return card.children[1]


def test_quiz_widget_checks_and_records():
    pytest.importorskip("ipywidgets")
    box = quiz.quiz("parallelism", count=3, seed=4)
    cards, score = box.children[:-1], box.children[-1]
    qs = quiz.ask("parallelism", 3, 4)
    for i, (card, q) in enumerate(zip(cards, qs)):
        widget, button, feedback = card.children[1], card.children[2], card.children[3]
        button.click()
        assert "answer first" in feedback.value and not button.disabled
        right = i < 2  # the last one is answered wrongly
        if q["kind"] == "single":
            widget.value = q["answer"] if right else (q["answer"] + 1) % len(q["choices"])
        elif q["kind"] == "multiple":
            for j, b in enumerate(widget.children):
                b.value = (j in q["answer"]) == right
        else:
            widget.value = str(q["answer"] if right else q["answer"] * 2 + 1)
        button.click()
        assert button.disabled and ("✓" in feedback.value) == right
    assert "score: 2/3" in score.value
    [entry] = progress.load()["quizzes"]
    assert (entry["topic"], entry["correct"], entry["total"]) == ("parallelism", 2, 3)


def test_exam_widget_marks_on_hand_in():
    pytest.importorskip("ipywidgets")
    box = quiz.exam(count=4, seed=9)
    hand_in, report = box.children[-2], box.children[-1]
    sheet = quiz.mock_exam(4, seed=9)
    for card, q in zip(box.children[1:-2], sheet):
        widget = _answer_widget(card)
        if q["kind"] == "single":  # the choices in the sheet's shuffled order, lettered afresh
            assert [label for label, _ in widget.options] == [f"{'abcdefgh'[j]}) {c}" for j, c in enumerate(q["choices"])]
            widget.value = q["answer"]
        elif q["kind"] == "multiple":
            for j, b in enumerate(widget.children):
                b.value = j in q["answer"]
        else:
            widget.value = str(q["answer"])
    hand_in.click()
    assert "score: 4/4 (100%)" in report.value and hand_in.disabled
    assert progress.load()["quizzes"][0]["topic"] == "mock-exam"


# --- mixture of experts and expert parallelism: every figure the questions state ------------------------

MOE_NOTEBOOK = "13_mixture_of_experts"


def expert_numel(moe: MoE) -> int:
    """The parameters of one expert MLP of an MoE block."""
    return sum(p.numel() for p in moe.experts[0].parameters())


def moe_counts(**kw) -> tuple[int, int, int, int]:
    """(total, active, one expert MLP, one router) parameters of the course's GPT with a mixture of experts."""
    model = build_model(GPTConfig(**kw), 0)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    return model.num_params(), model.active_params(), expert_numel(moe), moe.router.weight.numel()


def ep_expert_grad(dp: int, ep: int, divide_by: int, tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(one GPU's gradient, expert parallelism's) of one expert every token is routed to, each rank's loss its mean.

    On each ep group the expert's one copy receives the tokens of the group's ep ranks, so its gradient is the sum
    of their per-rank mean losses' gradients; its dp/ep replicas (one per group) are summed, then divided.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(dp, tokens, 4, generator=gen, dtype=torch.float64)
    w0 = torch.randn(4, 4, generator=gen, dtype=torch.float64)

    def grad(loss_of):
        w = w0.clone().requires_grad_()
        loss_of(w).backward()
        return w.grad

    def rank_loss(w, r):
        return (x[r] @ w).square().mean()

    single = grad(lambda w: (x.reshape(-1, 4) @ w).square().mean())
    replicas = [grad(lambda w, g=g: sum(rank_loss(w, r) for r in range(g * ep, (g + 1) * ep)))
                for g in range(dp // ep)]
    return single, sum(replicas) / divide_by


def test_moe_figures():
    # moe-active-params: 8 × 7B and 2 × 7B are 56B and 14B; S + 8X = 47B, S + 2X = 13B give X ≈ 5.7B, S ≈ 1.7B.
    assert 8 * 7 == 56 and 2 * 7 == 14
    X = (47 - 13) / (8 - 2)
    S = 13 - 2 * X
    assert round(X, 1) == 5.7 and round(S, 1) == 1.7 and S + 8 * X == pytest.approx(47)
    #   and in the course's GPT: only the MLPs are per expert, so the total is far below 8 dense models and the
    #   active count is the dense model plus one more MLP and a router per block.
    dense = build_model(GPTConfig(), 0).num_params()
    total, active, mlp, router = moe_counts(moe_experts=8, moe_top_k=2)
    layers = GPTConfig().n_layer
    assert total == dense + layers * (7 * mlp + router) and active == dense + layers * (mlp + router)
    assert total - active == layers * (8 - 2) * mlp and total < 8 * dense and active < 2 * dense
    # moe-more-experts: 16 experts top-2 adds parameters (8 MLPs a block) and only the router's 8 outputs of
    # compute; top-4 adds 2 MLPs a block of compute and no parameter.
    total16, active16, _, router16 = moe_counts(moe_experts=16, moe_top_k=2)
    total_k4, active_k4, _, _ = moe_counts(moe_experts=8, moe_top_k=4)
    assert total16 - total == layers * (8 * mlp + router16 - router) and router16 - router == GPTConfig().n_embd * 8
    assert active16 - active == layers * (router16 - router)
    assert total_k4 == total and active_k4 - active == layers * 2 * mlp
    assert (16 - 2) * mlp == 2 * ((8 - 2) * mlp) + 2 * mlp  # 16 experts: the experts' parameters double
    # moe-balance-collapse: the default coefficient is 0.01; uniform routing reads E·E·(1/E)² = 1; every token to
    # expert 0 with mean probability 0.7 reads 4 × 1 × 0.7 = 2.8; with probability 1 it reads E = 4.
    assert GPTConfig().moe_aux == 0.01 and 4 * 4 * (1 / 4) ** 2 == 1
    uniform = balance_loss(torch.full((1, 4, 4), 0.25), torch.arange(4).view(1, 4, 1))
    collapsed = balance_loss(torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(1, 4, 4), torch.zeros(1, 4, 1, dtype=torch.long))
    onehot = balance_loss(torch.tensor([1.0, 0, 0, 0]).expand(1, 4, 4), torch.zeros(1, 4, 1, dtype=torch.long))
    assert float(uniform) == pytest.approx(1) and float(collapsed) == pytest.approx(4 * 1 * 0.7) == 2.8
    assert float(onehot) == pytest.approx(4)
    # moe-balance-per-sequence: 8 sequences, dp=4 ranks of 2; per sequence, any cut gives the one-GPU value; taken
    # over each rank's batch and averaged over ranks, it does not.
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, 16, 4, generator=gen) * 2, -1)
    chosen = probs.topk(2, dim=-1).indices
    assert 8 // 4 == 2
    per_rank = [balance_loss(p, c) for p, c in zip(probs.chunk(4), chosen.chunk(4))]
    assert float(balance_loss(probs, chosen)) == pytest.approx(float(sum(per_rank) / 4))

    def batch_level(p, c):  # fᵢ and Pᵢ over the whole batch: one long "sequence"
        return float(balance_loss(p.reshape(1, -1, 4), c.reshape(1, -1, 2)))

    ranks_mean = sum(batch_level(p, c) for p, c in zip(probs.chunk(4), chosen.chunk(4))) / 4
    assert abs(batch_level(probs, chosen) - ranks_mean) > 1e-3
    assert abs(batch_level(probs, chosen) - 4 * ranks_mean) > 1e-3
    assert abs(batch_level(probs, chosen) - batch_level(probs[:2], chosen[:2])) > 1e-3
    # moe-capacity-drop: 16 tokens, 7 to expert 0 and 3 to each other one; capacity ceil(1.0 × 16 × 1 / 4) = 4:
    # expert 0 keeps its first 4, drops its last 3, whose MoE output is zero (the residual carries them on).
    moe = MoE(GPTConfig(n_embd=8, moe_experts=4, moe_top_k=1, moe_capacity=1.0))
    chosen = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 0, 0]).view(16, 1)
    assert torch.bincount(chosen.flatten()).tolist() == [7, 3, 3, 3] and 7 + 3 * 3 == 16
    assert math.ceil(1.0 * 16 * 1 / 4) == 4
    keep = moe.within_capacity(chosen)
    assert (~keep).flatten().nonzero().flatten().tolist() == [13, 14, 15]  # the last 3 of expert 0's 7
    assert keep[chosen == 0].tolist() == [True] * 4 + [False] * 3 and keep[chosen != 0].all()
    with torch.no_grad():
        out = moe.dispatch(torch.randn(16, 8, generator=gen), chosen, torch.ones(16, 1), keep)
    assert (out[13:] == 0).all() and (out[:13].abs().sum(-1) > 0).all()
    # moe-capacity-size: 4 × 1024 = 4096 tokens, 8192 choices, 1024 each evenly; ceil(1.25 × 4096 × 2 / 8) = 1280;
    # without top_k 640 (512 without the factor too); 25% headroom.
    assert 4 * 1024 == 4096 and 4096 * 2 == 8192 and 8192 // 8 == 1024
    assert math.ceil(1.25 * 4096 * 2 / 8) == 1280 and 1.25 * 4096 / 8 == 640 and 4096 // 8 == 512
    assert 1280 / 1024 == 1.25
    moe = MoE(GPTConfig(n_embd=8, moe_experts=8, moe_top_k=2, moe_capacity=1.25))
    hot = torch.stack([torch.zeros(4096, dtype=torch.long), torch.ones(4096, dtype=torch.long)], 1)
    assert moe.within_capacity(hot).sum(0).tolist() == [1280, 1280]
    # moe-ep-what-each-holds: ep=8 of dp=8, E/ep = 1 whole expert per GPU.
    check(TrainConfig(dp=8, ep=8, moe_experts=8, batch_size=8))
    assert 8 // 8 == 1
    # moe-ep-degree: ep must divide dp=16 and E=12: 1, 2, 4; ep=4 gives 3 experts per GPU, each on 4 GPUs.
    accepted = []
    for ep in range(1, 17):
        try:
            check(TrainConfig(dp=16, ep=ep, moe_experts=12, batch_size=16))
            accepted.append(ep)
        except ConfigError:
            pass
    assert accepted == [1, 2, 4] and 12 // 4 == 3 and 16 // 4 == 4
    assert 16 % 12 and 12 % 8 and 16 - 12 == 4 and 16 // 8 == 2 and 12 / 16 == 3 / 4
    # moe-ep-grad-divide: dp=8, ep=4: 2 replicas; their sum divided by dp = 8 is the one-GPU gradient, by 2 it is
    # ep = 4 times too big.
    assert 8 // 4 == 2
    single, right = ep_expert_grad(8, 4, divide_by=8)
    _, wrong = ep_expert_grad(8, 4, divide_by=2)
    assert torch.allclose(right, single) and torch.allclose(wrong, 4 * single)
    # moe-ep-alltoall-bytes: 4 × 4096 × 2 = 32,768 rows × 4096 bf16 values = 256 MiB; 3/4 of it leaves: 192 MiB;
    # dispatch + combine 384 MiB; without the local quarter 512; with the backward 768.
    rows = 4 * 4096 * 2
    payload = rows * 4096 * torch.empty(0, dtype=torch.bfloat16).element_size() / 2**20
    sent = RING_FACTOR["all_to_all"](4) * payload
    assert rows == 32_768 and payload == 256 and sent == 192 and 2 * sent == 384
    assert 2 * payload == 512 and 2 * (2 * sent) == 768
    # moe-counts-first: 8 int64 counts = 64 bytes per rank, 48 of them leave on ep=4.
    counts = torch.bincount(torch.tensor([0, 5]), minlength=8)
    assert counts.numel() * counts.element_size() == 64 and RING_FACTOR["all_to_all"](4) * 64 == 48
    # moe-ep-step-comm: dp=8, ep=4: each expert on dp/ep = 2 ranks; the router over all 8.
    check(TrainConfig(dp=8, ep=4, moe_experts=8, batch_size=8))
    assert 8 // 4 == 2
    # moe-hot-expert-remedies: capacity 1.25 caps a hot expert at 1.25× the even share.
    moe = MoE(GPTConfig(n_embd=8, moe_experts=8, moe_top_k=1, moe_capacity=1.25))
    kept = int(moe.within_capacity(torch.zeros(64, 1, dtype=torch.long)).sum())
    assert kept == math.ceil(1.25 * 64 * 1 / 8) == 10 and kept / (64 // 8) == 1.25
    # moe-straggler: ep=8 with one expert per GPU; the other 7 ranks wait.  moe-pytorch-support: 64 experts over
    # 8-GPU nodes, 8 each; torch.nn has no mixture-of-experts layer.
    assert 64 // 8 == 8 and 8 - 1 == 7
    assert not any("expert" in name.lower() or name.lower() == "moe" for name in dir(torch.nn))


def test_moe_router_weights_are_renormalised():
    """moe-router-weights: probabilities 0.5, 0.3, 0.1, 0.1, top-2: the outputs weighted 0.625 and 0.375."""
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    moe = MoE(GPTConfig(n_embd=4, moe_experts=4, moe_top_k=2))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, 0] = p.log()  # the token e₀ gets the logits log p: its softmax is p
    seen = {}

    def capture(x, chosen, weights, keep):
        seen.update(chosen=chosen, weights=weights)
        return torch.zeros_like(x)

    moe.dispatch = capture
    moe(torch.eye(4)[0].view(1, 1, 4))
    assert seen["chosen"].tolist() == [[0, 1]]
    assert torch.allclose(seen["weights"], torch.tensor([[0.625, 0.375]]))
    assert 0.5 + 0.3 == pytest.approx(0.8) and 1 - 0.8 == pytest.approx(0.2)  # 0.2 went to experts that did not run
    assert 0.5 / 0.8 == pytest.approx(0.625) and 0.3 / 0.8 == pytest.approx(0.375)
    assert torch.allclose(torch.softmax(p.log()[:2], -1), torch.tensor([0.625, 0.375]))  # softmax over the chosen


def test_moe_ep_groups_stay_inside_a_node(monkeypatch):
    """moe-ep-placement: dp=64, ep=8 on 8-GPU nodes: each ep group is one node's 8 GPUs, each expert's 64/8 = 8
    replicas lie one per node (the course numbers ranks node by node and groups adjacent ones)."""
    mesh = SimpleNamespace(mesh=torch.arange(64).view(1, 64, 1, 1))
    monkeypatch.setattr(expert_parallel.dist, "new_group", lambda members: tuple(members))
    for rank in range(64):
        monkeypatch.setattr(expert_parallel.dist, "get_rank", lambda group=None, r=rank: r)
        ep_group, edp_group = expert_parallel.expert_groups(mesh, 8)
        assert rank in ep_group and rank in edp_group
        assert len(ep_group) == 8 and {r // 8 for r in ep_group} == {rank // 8}
        assert len(edp_group) == 64 // 8 == 8 and {r // 8 for r in edp_group} == set(range(8))


def assert_not_gameable(qs, letters: int = 3) -> None:
    """A group of questions: choices of like length, select-all answers not leading, the right single choice the
    strictly longest (or shortest) in at most a quarter, and its letter spread over at least ``letters`` of 4."""
    for q in qs:
        lengths = [len(c) for c in q["choices"]]
        assert min(lengths) >= 0.8 * max(lengths), f"{q['id']}: choices of very different lengths"
        if q["kind"] == "multiple":
            assert sorted(q["answer"]) != list(range(len(q["answer"]))), f"{q['id']}: the right ones lead"
            assert len(q["answer"]) < len(q["choices"])
    singles = [q for q in qs if q["kind"] == "single"]

    def strictly(q, pick) -> bool:
        lengths = [len(c) for c in q["choices"]]
        return all(pick(lengths[q["answer"]], n) for i, n in enumerate(lengths) if i != q["answer"])

    longest = sum(strictly(q, lambda right, other: right > other) for q in singles)
    shortest = sum(strictly(q, lambda right, other: right < other) for q in singles)
    assert longest <= 0.25 * len(singles), f"the right choice is the longest in {longest} of {len(singles)}"
    assert shortest <= 0.25 * len(singles), f"the right choice is the shortest in {shortest} of {len(singles)}"
    positions = Counter(q["answer"] for q in singles)
    assert len(positions) >= letters and max(positions.values()) <= 0.4 * len(singles), positions


def test_moe_questions_are_not_gameable():
    """The MoE questions: scenarios, choices of like length, the right one rarely the longest, letters spread."""
    qs = [q for q in BANK if q["id"].startswith("moe-")]
    assert len(qs) >= 14 and all(q["notebook"] == MOE_NOTEBOOK for q in qs)
    assert quiz.load_bank(notebook=MOE_NOTEBOOK) == qs
    kinds = Counter(q["kind"] for q in qs)
    assert kinds["numeric"] == 0 and kinds["multiple"] <= 2
    assert Counter(q["topic"] for q in qs).most_common(1)[0][0] == "parallelism"
    assert sum(len(q["question"]) > 150 for q in qs) >= 0.8 * len(qs)
    assert_not_gameable(qs)


# --- pipeline schedules: virtual stages, the split backward, the V placement ------------------------------

from gpucourse.parallel import schedules_virtual  # noqa: E402
from gpucourse.parallel.pipeline import stage_blocks  # noqa: E402
from gpucourse.parallel.pipeline_virtual import GPTChunks  # noqa: E402

PIPE_NOTEBOOK = "04b_pipeline_schedules"


def one_f_one_b(p: int, m: int, cost_f: float = 1.0, cost_b: float = 2.0) -> schedules.Simulation:
    """1F1B with free transfers; ``cost_b`` is the whole backward, B and W together."""
    return schedules.simulate(schedules.one_f_one_b(p, m), p, m, cost_f, cost_b, 0.0)


def interleaved(p: int, m: int, v: int, comm: float = 0.0) -> schedules.Simulation:
    """Megatron's interleaved 1F1B, a stage's forward 1 and its whole backward 2 (each chunk op 1/v of that)."""
    ops, layout = schedules_virtual.build("interleaved-1f1b", p, m, v)
    return schedules_virtual.simulate(ops, layout, m, 1.0, 2.0, 0.0, comm)


def zb_h1(p: int, m: int, cost: float = 1.0, comm: float = 0.0) -> schedules.Simulation:
    """ZB-H1 with F = B = W = ``cost``."""
    ops, layout = schedules_virtual.build("zb-h1", p, m)
    return schedules_virtual.simulate(ops, layout, m, cost, cost, cost, comm)


def sends_per_microbatch(ops, m: int, kind: str = schedules.SEND_F) -> float:
    """Transfers between ranks one microbatch makes in one direction: ``kind`` ops over all ranks, divided by m."""
    return sum(op.kind == kind for row in ops for op in row) / m


def test_pipeline_schedule_figures():
    # pipe-interleave-why: p=4, m=16: 1F1B 3/16 of compute; interleaved v=4 3/64 ≈ 4.7% (3/67 of the total time);
    # not (p−1)/(v²·m) = 3/256 ≈ 1.2% nor (v·p−1)/(v·m) = 15/64 ≈ 23%.
    assert one_f_one_b(4, 16).bubble_ratio == pytest.approx(3 / 16) and round(100 * 3 / 16, 1) == 18.8
    sim = interleaved(4, 16, 4)
    assert sim.bubble_ratio == pytest.approx(3 / 64) == schedules_virtual.formula_bubble_ratio("interleaved-1f1b",
                                                                                                 4, 16, 4)
    assert sim.bubble_fraction == pytest.approx(3 / 67) and round(100 * 3 / 64, 1) == 4.7 and round(100 * 3 / 67, 1) == 4.5
    assert (4 - 1) / (4**2 * 16) == 3 / 256 and round(100 * 3 / 256, 1) == 1.2
    assert (4 * 4 - 1) / (4 * 16) == 15 / 64 and round(100 * 15 / 64) == 23
    assert sim.bubble_ratio != pytest.approx(3 / 256) and sim.bubble_ratio != pytest.approx(15 / 64)

    # pipe-interleave-costs: p=4, m=8, v=2: 7 sends per microbatch each way instead of 3; m=8 is a multiple of p;
    # rank 0 peaks at 11 half-stage chunks (5.5 stages) against 1F1B's 4; each rank keeps L/p layers.
    ops, _ = schedules_virtual.build("interleaved-1f1b", 4, 8, 2)
    plain = schedules.one_f_one_b(4, 8)
    assert sends_per_microbatch(ops, 8) == sends_per_microbatch(ops, 8, schedules.SEND_B) == 2 * 4 - 1 == 7
    assert sends_per_microbatch(plain, 8) == sends_per_microbatch(plain, 8, schedules.SEND_B) == 4 - 1 == 3
    assert interleaved(4, 8, 2).bubble_ratio == pytest.approx(3 / (2 * 8)) and one_f_one_b(4, 8).bubble_ratio == 3 / 8
    assert interleaved(4, 8, 2).peak_in_flight[0] == 2 * (4 - 0 - 1) + (2 - 1) * 4 + 1 == 11 and 11 / 2 == 5.5
    assert one_f_one_b(4, 8).peak_in_flight[0] == 4
    for rank in range(4):
        chunks = GPTChunks(build_model(GPTConfig(n_layer=16), 0), rank, schedules_virtual.Layout(4, 2))
        assert sum(len(b) for b in chunks.chunk_blocks) == len(stage_blocks(16, 4, rank)) == 16 // 4

    # pipe-interleave-m: p=4, v=2: m=10 (and 6, even) refused; 12, 4 and 20 run; 12 is not a multiple of 8, and
    # neither 12 nor 20 is a power of two.
    for m in (10, 6):
        with pytest.raises(schedules.ScheduleError, match="multiple of pp=4"):
            schedules_virtual.build("interleaved-1f1b", 4, m, 2)
    for m in (12, 4, 20):
        ops, layout = schedules_virtual.build("interleaved-1f1b", 4, m, 2)
        schedules_virtual.validate(ops, layout, m)
    assert min(m for m in range(10, 100) if m % 4 == 0) == 12 and 10 % 2 == 0 and 12 % 8 and 16 % 8 == 0
    assert all(m & (m - 1) for m in (12, 20))

    # pipe-interleave-memory: p=4, m=16: 1F1B 4; v=2: 11 half chunks = 5.5 = 1.375×; v=4: 19 quarters = 4.75 = 1.19×;
    # only v=4 within 25%. Halving gives 2 and 1; whole-stage chunks 8 and 16.
    assert one_f_one_b(4, 16).peak_in_flight[0] == 4
    peak2, peak4 = interleaved(4, 16, 2).peak_in_flight[0], interleaved(4, 16, 4).peak_in_flight[0]
    assert peak2 == 6 + 4 + 1 == 11 and peak4 == 6 + 12 + 1 == 19
    assert peak2 / 2 == 5.5 and peak4 / 4 == 4.75
    assert 5.5 / 4 == 1.375 == 1 + 3 / (4 * 2) > 1.25 and 4.75 / 4 == 1.1875 == 1 + 3 / (4 * 4) <= 1.25
    assert round(1.1875, 2) == 1.19 and (4 / 2, 4 / 4, 4 * 2, 4 * 4) == (2, 1, 8, 16)

    # pipe-split-backward: W needs only its own B: with every W moved to the end of its rank, ZB-H1 still runs.
    ops, layout = schedules_virtual.build("zb-h1", 4, 8)
    late_w = [[op for op in row if op.kind != schedules.W] + [op for op in row if op.kind == schedules.W]
              for row in ops]
    schedules_virtual.validate(late_w, layout, 8)

    # pipe-zbh1-bubble: p=8, m=16, F = B = W = 1: compute 48; 1F1B idles 21 (7/16 ≈ 44%), ZB-H1 7 (7/48 ≈ 14.6% of
    # compute, 7/55 ≈ 12.7% of the total); a third less would be 14 (7/24 ≈ 29%); v=2 halves it to 7/32 ≈ 22%.
    one, zb = one_f_one_b(8, 16), zb_h1(8, 16)
    assert one.makespan - 16 * 3 == (8 - 1) * (1 + 1 + 1) == 21 and one.bubble_ratio == pytest.approx(7 / 16)
    assert zb.makespan - 16 * 3 == (8 - 1) * (1 + 1 - 1) == 7 and zb.bubble_ratio == pytest.approx(7 / 48)
    assert zb.bubble_fraction == pytest.approx(7 / 55) and round(100 * 7 / 55, 1) == 12.7
    assert round(100 * 7 / 16) == 44 and round(100 * 7 / 48, 1) == 14.6 and round(100 * 7 / 48) == 15
    assert 21 * 2 / 3 == 14 and 14 / 48 == 7 / 24 and round(100 * 7 / 24) == 29 and round(100 * 7 / 32) == 22
    assert awaiting_b(zb) == one.peak_in_flight == [8 - s for s in range(8)]  # 1F1B's p − s

    # pipe-zbh1-step-time: p=4, m=8, 10 ms each: 1F1B 330 ms, ZB-H1 270 ms; 240 no bubble, 300 a third less, 285 half.
    one, zb = one_f_one_b(4, 8, 10, 20), zb_h1(4, 8, 10)
    assert one.makespan == 330 == 8 * 30 + 3 * 30 and zb.makespan == 270 == 8 * 30 + 3 * 10
    assert 240 + 90 * 2 / 3 == 300 and 240 + 90 / 2 == 285
    q = BY_ID["pipe-zbh1-step-time"]
    assert q["choices"][q["answer"]] == f"{zb.makespan:.0f} ms" and "240 ms" in q["choices"]
    assert one.bubble_fraction == pytest.approx(90 / 330) and round(100 * 90 / 330) == 27
    assert one.bubble_ratio == pytest.approx(90 / 240) == 0.375
    assert zb.bubble_fraction == pytest.approx(30 / 270) and round(100 * 30 / 270) == 11
    assert zb.bubble_ratio == pytest.approx(30 / 240) == 0.125

    # pipe-bubble-convert: p=8, v=2, m=32: 7/64 ≈ 10.9% of compute is 7/71 ≈ 9.9% of the total.
    sim = interleaved(8, 32, 2)
    assert sim.bubble_ratio == pytest.approx(7 / 64) and sim.bubble_fraction == pytest.approx(7 / 71)
    assert round(100 * 7 / 64, 1) == 10.9 and round(100 * 7 / 71, 1) == 9.9 and round(100 * 7 / 71, 2) == 9.86
    assert sim.bubble_fraction == pytest.approx(sim.bubble_ratio / (1 + sim.bubble_ratio))
    assert sim.bubble_ratio == pytest.approx(sim.bubble_fraction / (1 - sim.bubble_fraction))
    assert round(0.0986 / 0.9014, 3) == 0.109 and round(1 - 7 / 71, 4) == 0.9014

    # pipe-v-placement: p=4, V: rank 3 holds 3 and 4 (loop: 3 and 7); 6 transfers per forward (loop 7, 1F1B 3);
    # chunk 7 on rank 0.
    v_shape, loop = schedules_virtual.Layout(4, 2, "v"), schedules_virtual.Layout(4, 2)
    assert [v_shape.virtual(3, c) for c in (0, 1)] == [3, 4] and [loop.virtual(3, c) for c in (0, 1)] == [3, 7]
    assert [v_shape.virtual(0, c) for c in (0, 1)] == [0, 7] and v_shape.place(7) == (0, 1)
    ops, _ = schedules_virtual.build("zbv", 4, 8)
    assert sends_per_microbatch(ops, 8) == sends_per_microbatch(ops, 8, schedules.SEND_B) == 6 == 2 * 4 - 2
    ops, _ = schedules_virtual.build("interleaved-1f1b", 4, 8, 2)
    assert sends_per_microbatch(ops, 8) == 2 * 4 - 1 == 7
    q = BY_ID["pipe-v-placement"]
    assert q["choices"][q["answer"]].startswith("chunks 3 and 4; 6 transfers")

    # pipe-v-rank0: p=8, V: rank 0 holds chunks 0 and 15, embeds and computes the loss; rank 7 holds 7 and 8; the
    # last chunk's input comes from rank 1.
    v_shape = schedules_virtual.Layout(8, 2, "v")
    assert [v_shape.virtual(0, c) for c in (0, 1)] == [0, 15] == [0, 2 * 8 - 1]
    assert [v_shape.virtual(7, c) for c in (0, 1)] == [7, 8] and v_shape.place(14) == (1, 1)
    for rank in range(8):
        chunks = GPTChunks(build_model(GPTConfig(n_layer=16), 0), rank, v_shape)
        assert chunks.first == chunks.last == (rank == 0)
        assert hasattr(chunks, "wte") == hasattr(chunks, "head") == (rank == 0)

    # pipe-recv-order: on p=4's V, rank 0 sends rank 1 both activations (chunk 0) and gradients (chunk 7).
    v_shape = schedules_virtual.Layout(4, 2, "v")
    assert v_shape.route(0, schedules.Op(schedules.SEND_F, 0, 0))[0] == 1
    assert v_shape.route(0, schedules.Op(schedules.SEND_B, 0, 1))[0] == 1

    # pipe-async-rules: with every send a rendezvous, the interleaved schedule deadlocks; posted asynchronously,
    # it runs.
    ops, layout = schedules_virtual.build("interleaved-1f1b", 4, 8, 2)
    with pytest.raises(schedules.ScheduleError, match="deadlock"):
        schedules.run_clock(ops, 4, [1.0] * 4, [2.0] * 4, 0.0, route=layout.route, share=0.5, async_sends=False)
    schedules_virtual.validate(ops, layout, 8)

    # pipe-choose-slow-link: p=8, m=16: 1F1B 7/16, v=2 7/32, v=4 7/64, ZB-H1 7/48 of compute; sends 7, 15, 31;
    # rank 0's activations 1.44× (v=2), 1.22× (v=4) and 1.875× (ZB-H1: 1F1B's p − s awaiting B, 2p − 1 = 15 until
    # their W), all within twice 1F1B's; with transfers half a stage's forward, v=4 is slower than 1F1B and ZB-H1 is
    # fastest.
    zb = zb_h1(8, 16)
    assert zb.bubble_ratio == pytest.approx(7 / 48) and one_f_one_b(8, 16).bubble_ratio == pytest.approx(7 / 16)
    assert interleaved(8, 16, 2).bubble_ratio == pytest.approx(7 / 32)
    assert interleaved(8, 16, 4).bubble_ratio == pytest.approx(7 / 64)
    zb_ops = schedules_virtual.build("zb-h1", 8, 16)[0]
    assert sends_per_microbatch(zb_ops, 16) == sends_per_microbatch(zb_ops, 16, schedules.SEND_B) == 8 - 1 == 7
    assert [sends_per_microbatch(schedules_virtual.build("interleaved-1f1b", 8, 16, v)[0], 16) for v in (2, 4)] == [15, 31]
    assert interleaved(8, 16, 2).peak_in_flight[0] / 2 / 8 == 1.4375 and round(1.4375, 2) == 1.44
    assert interleaved(8, 16, 4).peak_in_flight[0] / 4 / 8 == 1.21875 and round(1.21875, 2) == 1.22
    assert awaiting_b(zb) == one_f_one_b(8, 16).peak_in_flight
    assert zb.peak_in_flight[0] == 2 * 8 - 1 == 15 and 15 / one_f_one_b(8, 16).peak_in_flight[0] == 1.875 <= 2
    async_1f1b = schedules_virtual.simulate(schedules.one_f_one_b(8, 16), schedules_virtual.Layout(8), 16, 1.0, 2.0,
                                            0.0, 0.5)
    slow = {"1f1b": async_1f1b.makespan, "v=2": interleaved(8, 16, 2, 0.5).makespan,
            "v=4": interleaved(8, 16, 4, 0.5).makespan, "zb-h1": zb_h1(8, 16, comm=0.5).makespan}
    assert slow["v=4"] > slow["1f1b"] and min(slow, key=slow.get) == "zb-h1", slow

    # pipe-choose-headroom: p=4, m=8, 16 layers: v ≤ 4; v=2 3/16 at 1.375×, v=4 3/32 at 1.19×, ZB-H1 3/24 at 1.75×
    # (7 microbatches until their W against 1F1B's 4), 1F1B 3/8; 15 transfers instead of 3; with transfers at 1% of a
    # stage's forward v=4 still beats ZB-H1.
    assert 16 // (4 * 4) == 1 and 16 % (8 * 4)
    assert interleaved(4, 8, 2).bubble_ratio == pytest.approx(3 / 16)
    assert interleaved(4, 8, 4).bubble_ratio == pytest.approx(3 / 32)
    assert zb_h1(4, 8).bubble_ratio == pytest.approx(3 / 24) and one_f_one_b(4, 8).bubble_ratio == 3 / 8
    assert zb_h1(4, 8).peak_in_flight[0] / one_f_one_b(4, 8).peak_in_flight[0] == 7 / 4 == 1.75 > 1.25
    assert interleaved(4, 8, 2).peak_in_flight[0] / 2 / 4 == 1.375 > 1.25
    assert interleaved(4, 8, 4).peak_in_flight[0] / 4 / 4 == 1.1875 <= 1.25
    assert sends_per_microbatch(schedules_virtual.build("interleaved-1f1b", 4, 8, 4)[0], 8) == 15
    assert interleaved(4, 8, 4, 0.01).makespan < zb_h1(4, 8, comm=0.01).makespan


def test_split_backward_computes_b_without_w():
    """pipe-split-backward: B (autograd.grad for the input and the layer outputs) runs no weight gradient; W then
    gives each layer its weight gradient from the output gradient B left, the same as one whole backward."""
    gen = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)]
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    h = layers[0](x)
    out = layers[1](torch.tanh(h))
    grad_out = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    grad_x, grad_h, grad_out_again = torch.autograd.grad(out, [x, h, out], grad_outputs=grad_out, retain_graph=True)
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # B: no weight gradient yet
    torch.autograd.backward(h, grad_h, inputs=list(layers[0].parameters()))       # W, layer by layer
    torch.autograd.backward(out, grad_out_again, inputs=list(layers[1].parameters()))
    split = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x2 = x.detach().requires_grad_()
    torch.autograd.backward(layers[1](torch.tanh(layers[0](x2))), grad_out)
    assert all(torch.allclose(a, p.grad) for a, p in zip(split, [p for layer in layers for p in layer.parameters()]))
    assert torch.allclose(grad_x, x2.grad)


def test_pipeline_schedule_questions_are_not_gameable():
    """The pipeline-schedule questions: scenarios, choices of like length, the right one rarely the longest or the
    shortest, letters spread, every bubble figure with its definition."""
    qs = [q for q in BANK if q["id"].startswith("pipe-")]
    assert len(qs) >= 12 and all(q["notebook"] == PIPE_NOTEBOOK for q in qs)
    assert quiz.load_bank(notebook=PIPE_NOTEBOOK) == qs
    kinds = Counter(q["kind"] for q in qs)
    assert kinds["numeric"] == 0 and kinds["multiple"] <= 2
    topics = Counter(q["topic"] for q in qs)
    assert topics.most_common(1)[0][0] == "parallelism" and topics["parallelism"] > 0.4 * len(qs)
    assert sum(len(q["question"]) > 150 for q in qs) >= 0.8 * len(qs)
    for q in qs:
        if "bubble" in q["question"] and re.search(r"\d+/\d+|%", q["question"]):
            assert "idle over compute" in q["question"] or "idle time over compute" in q["question"], q["id"]
    assert_not_gameable(qs, letters=4)


# --- the bank's bench figures -------------------------------------------------------------------------------------

def test_the_banks_figures_are_registered_with_their_rule():
    from gpucourse import bench
    from gpucourse.bench.quiz_figures import scenario_detail

    figures = {f.key: f for f in bench.FIGURES}
    longest, scenario = figures["quiz_longest_choice_share"], figures["quiz_scenario_share"]
    assert (longest.target, scenario.target) == ("<= 0.30", ">= 0.60")
    reading = longest.measure(**longest.quick)
    assert reading.value == len(reading.detail["right_is_longest"]) / reading.detail["single_choice"] <= 0.30
    # A scenario states a situation with concrete material before it asks; a one-sentence question is recall.
    assert scenario_detail("A job runs on 4 servers with 8 GPUs each. What is WORLD_SIZE?") == "4"
    assert scenario_detail("A process starts with CUDA_VISIBLE_DEVICES=2,3. Which names does it use?") \
        == "CUDA_VISIBLE_DEVICES"
    assert scenario_detail("A run logs 'connection reset by peer' on rank 3. What failed first?") is not None
    assert scenario_detail("What does TORCH_NCCL_ASYNC_ERROR_HANDLING=1 do when a collective fails?") is None
    assert scenario_detail("A run uses fp16 on H100s. Why does its loss overflow?") is None  # digits inside words
    assert scenario_detail("A run fails with out of memory. What is the first thing to try?") is None
    reading = scenario.measure(**scenario.quick)
    recall = set(reading.detail["recall"])
    assert reading.value == 1 - len(recall) / len(BANK)
    assert "setup-world-size" not in recall and "par-zero1" in recall
    best = figures["quiz_best_heuristic_accuracy"]
    assert best.target == "<= 0.35"
    reading = best.measure(**best.quick)
    assert reading.value == max(heuristic_accuracies(BANK).values()) <= 0.35
    assert reading.detail["accuracies"][reading.detail["best"]] == round(reading.value, 3)
    assert reading.detail["best"] in HEURISTICS and reading.detail["single_choice"] == len(SINGLES)
    assert set(reading.detail["select_all"]) == set(SET_HEURISTICS)


# --- test-taking heuristics: guessing from the choices' shape, never their content, scores about chance ----------

from gpucourse.bench.quiz_figures import (FALLBACK, HEURISTICS, SET_HEURISTICS, guess,  # noqa: E402
                                          heuristic_accuracies, set_scores)

SINGLES = [q for q in BANK if q["kind"] == "single"]
SELECT_ALL = [q for q in BANK if q["kind"] == "multiple"]
# The most any heuristic may score on the single-choice questions, chance being 1/4 (every one has 4 choices): with
# 148 questions one heuristic's score at chance has a standard deviation of about 0.036, so 0.35 is a real tell, not
# the luckiest of two dozen guessers.
HEURISTIC_CEILING = 0.35
# How far a select-all heuristic may beat a random pick of as many choices, exactly or by Jaccard overlap: with 20
# questions a score's standard deviation is about 0.1.
SELECT_ALL_MARGIN = 0.15


def test_the_guessing_heuristics_are_many_and_never_see_the_answer():
    """A broad battery: lengths and their ranks, punctuation and clauses, numbers, hedges, overlap with the stem and
    with the other choices, fixed letters and combinations; each reads only the stem and the choices."""
    families = {"longest", "shortest", "second_longest", "closest_to_mean_length", "most_punctuation",
                "only_semicolon", "only_colon", "only_parenthesis", "only_because_which", "most_digits",
                "middle_number", "hedged", "most_stem_words", "centroid", "first", "second", "third", "last",
                "punctuation_then_second_longest"}
    assert len(HEURISTICS) >= 12 and families <= set(HEURISTICS)
    for q in SINGLES:
        blind = {k: v for k, v in q.items() if k not in ("answer", "explanation")}
        picks = {name: guess(name, blind) for name in HEURISTICS}  # no answer to read: a KeyError otherwise
        assert all(0 <= p < len(q["choices"]) for p in picks.values()), q["id"]
        moved = {**blind, "answer": (q["answer"] + 1) % 4}
        assert {name: guess(name, moved) for name in HEURISTICS} == picks
    for q in SELECT_ALL:
        picks = [SET_HEURISTICS[name](list(q["choices"]), q["question"]) for name in SET_HEURISTICS]
        assert all(p and p <= set(range(len(q["choices"]))) for p in picks), q["id"]


def test_each_heuristic_picks_the_tell_it_is_named_for():
    choices = ["all of it, always",
               "it can take about 40 GB: the usual case",
               "the network; because the link is slow, which hurts",
               "a much longer answer that names the gradients and the buckets (both of them) at length"]
    stem = "Why are the gradients put into buckets?"
    expected = {"longest": 3, "shortest": 0, "second_longest": 2, "second_shortest": 1, "most_punctuation": 2,
                "only_semicolon": 2, "only_colon": 1, "only_parenthesis": 3, "only_because_which": 2,
                "most_digits": 1, "hedged": 1, "not_absolute": 1, "most_stem_words": 3, "first": 0, "second": 1,
                "third": 2, "last": 3, "semicolon_else_second_longest": 2}
    assert {name: HEURISTICS[name](choices, stem) for name in expected} == expected
    overlap = ["ring all-reduce bandwidth", "ring all-reduce latency", "ring all-reduce bandwidth latency", "tree"]
    assert (HEURISTICS["centroid"](overlap, ""), HEURISTICS["odd_one_out"](overlap, "")) == (2, 3)
    assert HEURISTICS["middle_number"](["8 GB", "1 GB", "4 GB", "2 GB"], "") == 3  # 1, 2, 4, 8: the lower middle
    # With nothing to go on a heuristic abstains, and its guess is the fixed fallback, the first choice.
    tie = {"question": "?", "choices": ["a; b", "c; d", "e", "f"], "kind": "single"}
    assert HEURISTICS["only_semicolon"](tie["choices"], "?") is None and guess("only_semicolon", tie) == FALLBACK == 0
    assert HEURISTICS["middle_number"](["a", "b", "c", "d"], "") is None


def score_table(scores: dict[str, float]) -> str:
    return ", ".join(f"{name} {score:.3f}" for name, score in sorted(scores.items(), key=lambda kv: -kv[1]))


def test_no_guessing_heuristic_beats_chance_on_single_choice_questions():
    """Every heuristic, scored over all single-choice questions (an abstaining one falls back to the first choice),
    stays at most 0.35, chance being 0.25."""
    chance = sum(1 / len(q["choices"]) for q in SINGLES) / len(SINGLES)
    scores = heuristic_accuracies(BANK)
    print(f"chance {chance:.3f} over {len(SINGLES)} single-choice questions; {score_table(scores)}")
    assert chance == 0.25
    beaten = {name: round(score, 3) for name, score in scores.items() if score > HEURISTIC_CEILING}
    assert not beaten, f"heuristics above {HEURISTIC_CEILING} (chance {chance}): {beaten}; all: {score_table(scores)}"


def test_the_heuristics_catch_a_gamed_bank():
    """A bank whose right choice is always the only one with a semicolon, or always the first, fails the check."""
    def only_semicolon(q):
        choices = [c.replace(";", ",") for c in q["choices"]]
        choices[q["answer"]] += "; that is why"
        return {**q, "choices": choices}

    def right_first(q):
        rest = [c for i, c in enumerate(q["choices"]) if i != q["answer"]]
        return {**q, "choices": [q["choices"][q["answer"]], *rest], "answer": 0}

    assert heuristic_accuracies([only_semicolon(q) for q in SINGLES])["only_semicolon"] == 1.0
    assert heuristic_accuracies([right_first(q) for q in SINGLES])["first"] == 1.0 > HEURISTIC_CEILING


def test_random_pick_chance_is_exact():
    from gpucourse.bench.quiz_figures import random_pick_scores

    # 2 of 4 drawn, 2 right: the right pair 1 time in 6; one right 4 times in 6 (Jaccard 1/3); none once.
    assert random_pick_scores(4, 2, 2) == pytest.approx((1 / 6, 4 / 6 * 1 / 3 + 1 / 6))
    assert random_pick_scores(5, 3, 2) == pytest.approx((0.0, 3 / 10 * 2 / 3 + 6 / 10 * 1 / 4))
    assert random_pick_scores(4, 4, 3) == (0.0, 0.75)


def test_no_guessing_heuristic_beats_chance_on_select_all_questions():
    """Guessing a select-all answer by its shape (the two longest, the most punctuated half, all but the odd one out)
    does not beat a random pick of as many choices, by exact set or by Jaccard overlap, by more than 0.15."""
    scores = set_scores(BANK)
    table = "; ".join(f"{name}: exact {s['exact']:.3f} (chance {s['exact_chance']:.3f}), Jaccard {s['jaccard']:.3f} "
                      f"(chance {s['jaccard_chance']:.3f})" for name, s in scores.items())
    print(f"{len(SELECT_ALL)} select-all questions; {table}")
    assert len(SET_HEURISTICS) >= 8
    beaten = {name: s for name, s in scores.items()
              if s["exact"] > s["exact_chance"] + SELECT_ALL_MARGIN
              or s["jaccard"] > s["jaccard_chance"] + SELECT_ALL_MARGIN}
    assert not beaten, f"select-all heuristics more than {SELECT_ALL_MARGIN} above chance: {beaten}"


# --- tensor parallelism, hybrid layouts, data parallelism, ZeRO and pipelines: every figure the questions state ---

import inspect  # noqa: E402

from gpucourse.interop import stack_config  # noqa: E402
from gpucourse.modeled import plan  # noqa: E402
from gpucourse.modeled.cluster import Cluster  # noqa: E402
from gpucourse.modeled.memory import estimate  # noqa: E402
from gpucourse.parallel import tensor_parallel  # noqa: E402
from gpucourse.parallel import data_parallel_buckets  # noqa: E402
from gpucourse.parallel.data_parallel_buckets import assign_buckets  # noqa: E402
from gpucourse.modeled.published import RUNS  # noqa: E402
from gpucourse.train import MESH_DIMS  # noqa: E402

MiB = 2**20
BF16 = torch.empty(0, dtype=torch.bfloat16).element_size()


def right_choice(qid: str) -> str:
    q = BY_ID[qid]
    return q["choices"][q["answer"]]


def mesh_groups(pp: int, dp: int, tp: int, order: tuple[str, ...] = MESH_DIMS) -> dict[str, list[list[int]]]:
    """Each mesh dimension's groups of ranks, laid out as the runtime's DeviceMesh lays them (cp = 1)."""
    sizes = {"pp": pp, "dp": dp, "cp": 1, "tp": tp}
    grid = torch.arange(pp * dp * tp).reshape([sizes[d] for d in order])
    return {d: grid.movedim(order.index(d), -1).reshape(-1, sizes[d]).tolist() for d in order}


def group_of(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


def test_tensor_parallel_figures():
    # par-tp-shard-shapes: fc (16384, 4096) and proj (4096, 16384), each cut 4 ways along the dimension its
    # tensor-parallel layer names: both (4096, 4096); the reversed cuts give (16384, 1024) and (1024, 16384).
    fc, proj = torch.nn.Linear(4096, 16384, device="meta"), torch.nn.Linear(16384, 4096, device="meta")
    col = tuple(fc.weight.chunk(4, dim=tensor_parallel.ColumnParallelLinear.shard_dims["weight"])[0].shape)
    row = tuple(proj.weight.chunk(4, dim=tensor_parallel.RowParallelLinear.shard_dims["weight"])[0].shape)
    assert col == row == (4096, 4096) and right_choice("par-tp-shard-shapes") == f"fc {col} and proj {row}"
    assert tuple(fc.weight.chunk(4, dim=1)[0].shape) == (16384, 1024)
    assert tuple(proj.weight.chunk(4, dim=0)[0].shape) == (1024, 16384)
    # par-tp-f-backward: the course's f and g record under those names; 2 forward + 2 backward per block.
    source = inspect.getsource(tensor_parallel)
    assert "tp all_reduce forward (g)" in source and "tp all_reduce backward (f)" in source
    assert MEGATRON_SUBLAYERS * ALLREDUCES_PER_REGION == 2 + 2 == 4
    # setup-tp-ring-bytes: 4 × 4096 × 8192 bf16 = 256 MiB; the ring sends 448 MiB (chunks of 32), 1792 per block;
    # 896 forward only; 3584 (and 14336) if each GPU sent the whole tensor to the 7 others twice.
    payload = 4 * 4096 * 8192 * BF16 / MiB
    sent = RING_FACTOR["all_reduce"](8) * payload
    assert payload == 256 and sent == 448 and payload / 8 == 32 and 4 * sent == 1792 and 2 * sent == 896
    assert 2 * 7 * payload == 3584 and 4 * 3584 == 14336 and 4 * payload == 1024
    # par-tp-heads-per-rank: 32 heads of 128; rows r·512 to r·512+511 of q are heads 4r to 4r+3, whole.
    assert 4096 // 32 == 128 and 32 // 8 == 4 and 128 // 8 == 16
    for r, rows in enumerate(torch.arange(4096).chunk(8)):
        assert (rows[0], rows[-1]) == (r * 512, r * 512 + 511)
        assert (rows // 128).unique().tolist() == list(range(4 * r, 4 * r + 4))
    # prof-tp-across-nodes: 64 heads allow tp=16; NVLink 450 GB/s against the NIC's 50, 9×; the planner never puts
    # tensor parallelism across servers.
    h100 = get_gpu("h100")
    assert 64 % 16 == 0 and (h100.intra_node_GBps, h100.inter_node_GBps) == (450, 50) and 450 / 50 == 9
    shape = {"n_layer": 8, "n_embd": 8192, "n_head": 64, "vocab_size": 32000}
    assert max(cfg.tp for cfg in plan.candidates(shape, 16, 8, 16, 4096, "bf16")) == 8
    # mem-tp-replicated-activations: 3104 MiB at tp=1, 528 at tp=8, 388 = 3104/8 with sequence parallelism; the
    # replicated 10·s·b·h is 160 MiB, the rest 368; full recomputation keeps 32 MiB.
    s, b, h, a = 4096, 1, 4096, 32
    mib = {k: korthikanti_layer_bytes(s, b, h, a, **kw) / MiB for k, kw in {
        "tp1": {}, "tp8": {"tp": 8}, "sp": {"tp": 8, "sp": True}, "full": {"recompute": "full"}}.items()}
    assert mib == {"tp1": 3104, "tp8": 528, "sp": 388, "full": 32} and 3104 / 8 == 388
    assert s * b * h / MiB == 16 and 10 * s * b * h / MiB == 160 and 5 * a * s / h == 160
    assert 528 - 160 == 368 == 16 * (24 + 160) / 8
    # prof-tp-wider-comm-bound: 1.5× the payload per rank at tp=4, 1.75× at tp=8, 7/6; compute halves: 7/3 ≈ 2.33.
    assert (RING_FACTOR["all_reduce"](4), RING_FACTOR["all_reduce"](8)) == (1.5, 1.75)
    assert 1.75 / 1.5 == pytest.approx(7 / 6) and 2 * 7 / 6 == pytest.approx(7 / 3) and round(7 / 3, 2) == 2.33
    # mem-tp-model-states: 12.9B parameters; 1.92B per rank, not 1.62B; 0.35B replicated; 30.8 GB, not 25.9.
    cfg = TrainConfig(model="gpt2-small", overrides={"n_layer": 40, "n_embd": 5120, "n_head": 40, "vocab_size": 32000,
                                                     "block_size": 4096},
                      tp=8, precision="bf16", master_weights=True, seq_len=4096, batch_size=8)
    est = estimate(cfg)
    n, per_rank = est["num_params"], est["params_per_rank"][0]
    states = sum(est["per_rank"][0][k] for k in ("weights", "gradients", "optimizer"))
    replicated = (8 * per_rank - n) / 7  # per_rank = replicated + (n - replicated) / 8
    assert (f"{n / 1e9:.2f}", f"{per_rank / 1e9:.2f}", f"{n / 8e9:.2f}") == ("12.93", "1.92", "1.62")
    assert f"{replicated / 1e9:.2f}" == "0.35" and 32000 * 5120 * 2 > 0.9 * replicated
    assert f"{states / 1e9:.1f}" == "30.8" and states == 16 * per_rank and f"{16 * n / 8 / 1e9:.1f}" == "25.9"


def test_tensor_parallel_gradients_and_bias():
    """par-tp-no-grad-sync and prof-tp-bias-every-rank, on one process: the shards' gradients are already the whole
    gradients of their own weights; a bias added before the sum counts tp times."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen, dtype=torch.float64)
    whole = w.clone().requires_grad_()
    (x @ whole.T).square().sum().backward()
    shards = [piece.clone().requires_grad_() for piece in w.chunk(2, dim=0)]  # column-parallel, tp=2
    torch.cat([x @ s.T for s in shards], dim=-1).square().sum().backward()
    assert all(torch.allclose(s.grad, g) for s, g in zip(shards, whole.grad.chunk(2, dim=0)))
    summed = shards[0].grad + shards[1].grad
    assert not any(torch.allclose(summed, g) for g in whole.grad.chunk(2, dim=0))
    assert not any(torch.allclose(summed / 2, g) for g in whole.grad.chunk(2, dim=0))
    # A replicated parameter's gradient, already equal on both ranks, doubles when summed.
    norm_grad = torch.ones(4, dtype=torch.float64)
    assert torch.equal(norm_grad + norm_grad, 2 * norm_grad)
    # The bias: each of 4 ranks adds b before g, and the all-reduce sums it 4 times: off by 3b.
    x, w, b = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((5, 8), (3, 8), (3,)))
    parts = [xr @ wr.T for xr, wr in zip(x.chunk(4, dim=-1), w.chunk(4, dim=1))]
    full = x @ w.T + b
    assert torch.allclose(sum(p + b for p in parts), full + 3 * b) and torch.allclose(sum(parts) + b, full)
    assert not torch.allclose(sum(p + b for p in parts) / 4, full)


def test_dtensor_default_layouts():
    """par-tp-dtensor-layouts: ColwiseParallel takes Replicate and leaves Shard(-1); RowwiseParallel takes Shard(-1)
    and returns Replicate (its partial sums all-reduced)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    assert (col.input_layouts, col.output_layouts) == ((Replicate(),), (Shard(-1),))
    assert (row.input_layouts, row.output_layouts) == ((Shard(-1),), (Replicate(),))
    assert RowwiseParallel(output_layouts=Shard(1)).output_layouts == (Shard(1),)


def test_hybrid_planning_figures():
    # setup-mesh-dp-group: dp=4 × tp=8 × pp=2, rank 45 = (1·4 + 1)·8 + 5; its dp group 37, 45, 53, 61 on servers
    # 4 to 7; tp 40–47; pp 13 and 45; the eight ranks with slice 5 span all eight servers.
    g = mesh_groups(2, 4, 8)
    assert (1 * 4 + 1) * 8 + 5 == 45
    assert group_of(g["dp"], 45) == [37, 45, 53, 61] and {r // 8 for r in [37, 45, 53, 61]} == {4, 5, 6, 7}
    assert group_of(g["tp"], 45) == list(range(40, 48)) and group_of(g["pp"], 45) == [13, 45]
    slice5 = [r for r in range(64) if r % 8 == 5]
    assert slice5[0] == 5 and slice5[-1] == 61 and len(slice5) == 8 and len({r // 8 for r in slice5}) == 8
    # setup-which-group-crosses: dp=2 × tp=4 × pp=4 on 4 servers of 8: only the pipeline groups cross.
    g = mesh_groups(4, 2, 4)
    assert group_of(g["tp"], 0) == [0, 1, 2, 3] and group_of(g["dp"], 0) == [0, 4]
    assert group_of(g["pp"], 0) == [0, 8, 16, 24] and 2 * 4 == 8
    for dim, crosses in (("tp", False), ("dp", False), ("pp", True)):
        assert all((len({r // 8 for r in grp}) > 1) == crosses for grp in g[dim]), dim
    # setup-topo-tp-pairs: dp=2 × tp=2: tp pairs (0, 1) and (2, 3), dp pairs (0, 2) and (1, 3); dp innermost
    # would swap them.
    g = mesh_groups(1, 2, 2)
    assert (g["tp"], g["dp"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert mesh_groups(1, 2, 2, order=("pp", "tp", "cp", "dp"))["tp"] == [[0, 2], [1, 3]]
    # par-plan-fits-first: see test_the_plan_ranks_what_fits_first.
    # par-megatron-bubble-dp: 256 GPUs: dp 8, 16 microbatches of 4, bubble 3/16 of compute; 512 GPUs: dp 16, m = 8,
    # 3/8; --micro-batch-size 2 gives m = 16 again.
    shape = {"n_layer": 32, "n_embd": 1024, "n_head": 16}
    runs = {gpus: TrainConfig(model="gpt2-small", overrides=shape, dp=dp, tp=8, pp=4, microbatches=m, batch_size=512)
            for gpus, dp, m in ((256, 8, 16), (512, 16, 8))}
    for gpus, cfg in runs.items():
        args = stack_config.translate(cfg, "megatron").settings
        assert cfg.world_size == gpus and cfg.dp == gpus // (8 * 4)
        assert (args["--tensor-model-parallel-size"], args["--pipeline-model-parallel-size"]) == (8, 4)
        assert (args["--micro-batch-size"], args["--global-batch-size"]) == (4, 512)
        assert stack_config.batch(cfg) == (4, 512 // (4 * cfg.dp))
    assert [stack_config.batch(c)[1] for c in runs.values()] == [16, 8]
    ratio = {m: schedules.simulate(schedules.build("1f1b", 4, m), 4, m).bubble_ratio for m in (16, 8)}
    assert ratio == pytest.approx({16: 3 / 16, 8: 3 / 8})
    assert 512 // (2 * 16) == 16
    # par-nemo-to-gpucourse: 4 nodes × 8: dp = 32 / (4 × 2) = 4, 256 / (2 × 4) = 32 microbatches of 2.
    cfg = TrainConfig(model="gpt2-small", dp=4, tp=4, pp=2, microbatches=32, batch_size=256)
    nemo = stack_config.translate(cfg, "nemo").settings
    assert cfg.world_size == 4 * 8 and nemo["data"] == {"micro_batch_size": 2, "global_batch_size": 256,
                                                        "seq_length": cfg.seq_len}
    strategy = nemo["trainer"]["strategy"]
    assert (strategy["tensor_model_parallel_size"], strategy["pipeline_model_parallel_size"]) == (4, 2)
    assert right_choice("par-nemo-to-gpucourse") == "--dp 4 --tp 4 --pp 2 --microbatches 32 --batch-size 256"
    assert (TrainConfig(dp=32, tp=4, pp=2).world_size, TrainConfig(dp=8, tp=4, pp=2).world_size) == (256, 64)
    assert 256 // 2 == 128 and 32 // 4 == 8
    # par-virtual-pipeline-layers: 48 layers, p=4, v=3: 12 chunks of 4; rank 0 holds chunks 0, 4, 8 = layers 0–3,
    # 16–19, 32–35; Megatron's docstring example (16 layers, p=4, v=2): GPU 0 holds layers 1, 2, 9, 10 from 1.
    layout = schedules_virtual.Layout(4, 3)
    chunks = [layout.virtual(0, c) for c in range(3)]
    per_chunk = 48 // (4 * 3)
    assert chunks == [0, 4, 8] and per_chunk == 4
    assert [(c * per_chunk, c * per_chunk + per_chunk - 1) for c in chunks] == [(0, 3), (16, 19), (32, 35)]
    two = schedules_virtual.Layout(4, 2)
    assert [layer + 1 for c in (two.virtual(0, 0), two.virtual(0, 1)) for layer in (2 * c, 2 * c + 1)] == [1, 2, 9, 10]
    cfg = TrainConfig(model="gpt2-small", overrides={"n_layer": 48}, pp=4, schedule="interleaved-1f1b",
                      virtual_stages=3, microbatches=8, batch_size=8)
    assert stack_config.translate(cfg, "nemo").settings["trainer"]["strategy"][
        "virtual_pipeline_model_parallel_size"] == 3
    assert stack_config.translate(cfg, "megatron").settings["--num-virtual-stages-per-pipeline-rank"] == 3
    # prof-sp-needs-tp: the course refuses sequence parallelism without tensor parallelism, before anything starts.
    with pytest.raises(ConfigError, match="it needs tp > 1"):
        check(TrainConfig(sequence_parallel=True))
    # setup-nvlink-vs-nic-units: 900 GB/s both ways is 450 each; 400 Gb/s is 50 GB/s; 9×, not 2.25×, 18× or 1.1×.
    h100 = get_gpu("h100")
    assert (900 / 2, 400 / 8) == (h100.intra_node_GBps, h100.inter_node_GBps) == (450, 50) and 450 / 50 == 9
    assert 900 / 400 == 2.25 and 900 / 50 == 18 and round(450 / 400, 1) == 1.1
    # prof-nvls-busbw: nccl-tests' 470 GB/s on 8 H100s for 8 GiB; the model forced to a ring 359 GB/s, bounded by
    # 450 × 0.8 = 360; left to choose, NVLS and 480 GB/s, +2.1% as docs/modeled-timing.md shows; 14 latency steps.
    run = next(r for r in RUNS if r.gpu == "h100" and r.metric == "bus_bandwidth")
    op, nbytes, n = run.collective
    ring_s = Cluster(h100, 8).collective_s(op, nbytes, range(n), algo="ring")[0]
    ring = nbytes / ring_s * 2 * (n - 1) / n
    chosen = Cluster(h100, 8).bus_bandwidth(*run.collective)
    assert run.reported == 470e9 and run.collective == ("all_reduce", 8 << 30, 8) and round(ring / 1e9) == 359
    assert h100.intra_node_GBps * h100.bus_efficiency == 360 and ring < 360e9
    assert Cluster(h100, 8).collective_s(op, nbytes, range(n))[1] == "nvls" and round(chosen / 1e9) == 480
    assert f"{100 * (chosen - run.reported) / run.reported:+.1f}" == "+2.1" and 2 * (8 - 1) == 14
    assert "+2.1%" in (REPO / "docs" / "modeled-timing.md").read_text(encoding="utf-8")
    # mem-zero-in-hybrid: 70e9 / 32 = 2.19B per GPU: 35 GB plain, 21.9 with ZeRO-1 over dp=2, 17.5 with ZeRO-3,
    # 9.2 if the optimizer were split over all 64.
    per_gpu = int(70e9 / 32)
    gb = {(dp, zero): sum(estimate_params(per_gpu, dp, zero, "bf16", True, scratch_padding=False).values()) / 1e9
          for dp, zero in ((1, 0), (2, 1), (2, 3), (64, 1))}
    assert f"{per_gpu / 1e9:.2f}" == "2.19" and gb[1, 0] == pytest.approx(35)
    assert (f"{gb[2, 1]:.1f}", f"{gb[2, 3]:.1f}", f"{gb[64, 1]:.1f}") == ("21.9", "17.5", "9.2")


def test_the_plan_ranks_what_fits_first():
    """par-plan-fits-first: `gpucourse plan --params 70e9 --gpus 64 --gpu h100` (8 per server, 1024 × 4096)."""
    result = plan.plan(70e9, gpus=64, gpu="h100", gpus_per_node=8, batch_size=1024, seq_len=4096)
    assert {k: result["shape"][k] for k in ("layers", "hidden")} == {"layers": 84, "hidden": 8192}
    rows = result["layouts"]

    def row(dp, tp, pp, zero):
        return next(r for r in rows if (r["dp"], r["tp"], r["pp"], r["zero"]) == (dp, tp, pp, zero)
                    and not r["checkpoint_activations"] and r["schedule"] in ("", "1f1b"))

    fast, first = row(64, 1, 1, 3), rows[0]
    assert fast["step_s"] < 1.01 * min(r["step_s"] for r in rows) and not fast["fits"]
    assert (f"{fast['step_s']:.1f}", f"{fast['memory_total'] / 1e9:.1f}") == ("52.3", "110.5")
    assert (first["dp"], first["tp"], first["pp"], first["zero"]) == (32, 2, 1, 3)
    assert not first["checkpoint_activations"]
    assert (f"{first['memory_total'] / 1e9:.1f}", f"{first['step_s']:.1f}", f"{first['tp_comm_s']:.1f}") \
        == ("70.3", "55.4", "2.2")
    wide, deep = row(8, 8, 1, 3), row(1, 8, 8, 0)
    assert wide["fits"] and deep["fits"] and deep["bubble_s"] > 0
    assert (f"{wide['memory_total'] / 1e9:.1f}", f"{wide['step_s']:.1f}", f"{wide['tp_comm_s']:.1f}",
            f"{wide['parts']['dp']:.1f}", wide["grad_accum"]) == ("40.9", "158.0", "11.6", "88.8", 128)
    assert wide["step_s"] == max(r["step_s"] for r in (first, wide, deep))
    assert (f"{deep['memory_total'] / 1e9:.1f}", f"{deep['step_s']:.1f}", f"{deep['tp_comm_s']:.1f}") \
        == ("44.6", "72.6", "12.1")
    assert result["gpu"]["memory_gb"] == 80

def test_data_zero_pipeline_figures():
    # prof-dp-one-bucket: 250M fp32 parameters are 954 MiB: one bucket under a 1000 MiB cap, dozens under 25 MiB
    # (gpucourse's bucket_mb counts MiB).
    assert "bucket_mb * 2**20" in inspect.getsource(data_parallel_buckets)
    params = [torch.nn.Parameter(torch.empty(1_000_000, device="meta")) for _ in range(250)]
    assert round(sum(p.numel() * p.element_size() for p in params) / MiB) == 954
    assert len(assign_buckets(params, int(1000 * MiB))) == 1 and len(assign_buckets(params, int(25 * MiB))) >= 24
    # mem-accum-to-more-gpus: 8 × 4 × 8 = 256 = 8 × 1 × 32; grad_accum 4 on 32 GPUs would be 1024.
    assert with_microbatch(TrainConfig(dp=8, grad_accum=4), 8).batch_size == 256
    assert with_microbatch(TrainConfig(dp=32, grad_accum=1), 8).batch_size == 256
    assert with_microbatch(TrainConfig(dp=32, grad_accum=4), 8).batch_size == 1024
    # prof-strong-weak-scaling: 72,000 / 8 / 10,000 = 90%; 40,000 / 8 / 10,000 = 50%; 64 = 8 × 8.
    assert 72_000 / 8 / 10_000 == 0.9 and 40_000 / 8 / 10_000 == 0.5 and 72_000 / 8 == 9_000 and 40_000 / 8 == 5_000
    assert 8 * 8 == 64
    # mem-hybrid-shard: 16 × 13e9 / 8 = 26 GB against 16 × 13e9 / 32 = 6.5 GB; PyTorch names the strategy.
    from torch.distributed.fsdp import ShardingStrategy

    assert sum(estimate_params(13e9, 8, 3, "bf16", True, scratch_padding=False).values()) / 1e9 == 26
    assert sum(estimate_params(13e9, 32, 3, "bf16", True, scratch_padding=False).values()) / 1e9 == 6.5
    assert ShardingStrategy.HYBRID_SHARD.name == "HYBRID_SHARD"
    # par-pp-microbatch-size: p=8, 64 sequences per pipeline: 7/71, 7/39, 7/23, 7/15 of the total time; the largest
    # microbatch under 20% is 2 (m = 32 = 4p).
    assert 256 // 4 == 64
    bubbles = {micro: schedules.formula_bubble("1f1b", 8, 64 // micro) for micro in (1, 2, 4, 8)}
    assert bubbles == pytest.approx({1: 7 / 71, 2: 7 / 39, 4: 7 / 23, 8: 7 / 15})
    assert [f"{100 * v:.1f}" for v in bubbles.values()] == ["9.9", "17.9", "30.4", "46.7"]
    assert [round(100 * v) for v in bubbles.values()] == [10, 18, 30, 47]
    assert max(micro for micro, v in bubbles.items() if v < 0.2) == 2 and 64 // 2 == 32 == 4 * 8
    assert bubble("1f1b", 8, 32) == pytest.approx(7 / 39)
    # mem-1f1b-stage0: 1F1B holds p − s = 4, 3, 2, 1 whatever m; GPipe holds all 16 on every stage.
    for m in (8, 16, 32):
        assert schedules.simulate(schedules.build("1f1b", 4, m), 4, m).peak_in_flight == [4, 3, 2, 1]
    assert schedules.simulate(schedules.build("gpipe", 4, 16), 4, 16).peak_in_flight == [16] * 4 and 16 // 4 == 4
    # prof-pp-send-deadlock: sending microbatch 1's activation before receiving microbatch 0's gradient deadlocks
    # p=2, m=3; the course's 1F1B (with m = 3 < 2p) runs.
    ops = schedules.one_f_one_b(2, 3)
    schedules.validate(ops, 2, 3)
    Op = schedules.Op
    assert ops[0][:5] == [Op("F", 0), Op("SEND_F", 0), Op("F", 1), Op("RECV_B", 0), Op("SEND_F", 1)]
    bad = list(ops[0])
    bad[3], bad[4] = bad[4], bad[3]
    assert bad[:5] == [Op("F", 0), Op("SEND_F", 0), Op("F", 1), Op("SEND_F", 1), Op("RECV_B", 0)]
    assert ops[1][:5] == [Op("RECV_F", 0), Op("F", 0), Op("B", 0), Op("SEND_B", 0), Op("RECV_F", 1)]
    with pytest.raises(schedules.ScheduleError, match="deadlock"):
        schedules.validate([bad, ops[1]], 2, 3)


def test_gradient_accumulation_without_dividing():
    """mem-accum-loss-divide: 4 mean losses summed in .grad are 4× the batch's gradient (SGD steps 4× too far);
    Adam's update barely changes with the factor."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=gen, dtype=torch.float64), torch.randn(8, 1, generator=gen, dtype=torch.float64)
    w = torch.randn(1, 3, generator=gen, dtype=torch.float64)
    whole = w.clone().requires_grad_()
    torch.nn.functional.mse_loss(x @ whole.T, y).backward()
    accumulated = w.clone().requires_grad_()
    for xc, yc in zip(x.chunk(4), y.chunk(4)):
        torch.nn.functional.mse_loss(xc @ accumulated.T, yc).backward()
    assert torch.allclose(accumulated.grad, 4 * whole.grad)
    assert 0.1 * accumulated.grad == pytest.approx(0.4 * whole.grad)

    def adam_steps(grad: torch.Tensor, steps: int = 3, lr=0.1, betas=(0.9, 0.999), eps=1e-8) -> torch.Tensor:
        """Adam's update (Kingma and Ba), the rule torch.optim.Adam follows, summed over a few steps."""
        m = v = torch.zeros_like(grad)
        total = torch.zeros_like(grad)
        for t in range(1, steps + 1):
            m, v = betas[0] * m + (1 - betas[0]) * grad, betas[1] * v + (1 - betas[1]) * grad**2
            total += lr * (m / (1 - betas[0]**t)) / ((v / (1 - betas[1]**t)).sqrt() + eps)
        return total

    assert torch.allclose(adam_steps(whole.grad), adam_steps(4 * whole.grad), rtol=1e-6)


def test_every_notebook_has_questions_enough():
    """At least 10 questions for every notebook that has any, 15 for tensor parallelism and hybrid planning; their
    new questions are scenarios with choices of like length, the right one rarely the longest or the shortest."""
    from gpucourse.bench.quiz_figures import scenario_detail

    per_notebook = Counter(q["notebook"] for q in BANK)
    assert min(per_notebook.values()) >= 10, per_notebook
    assert per_notebook["05_tensor_parallelism"] >= 15 and per_notebook["06_hybrid_planning"] >= 15
    qs = [q for q in BANK if q["notebook"] in ("05_tensor_parallelism", "06_hybrid_planning")]
    assert sum(scenario_detail(q["question"]) is not None for q in qs) >= 0.75 * len(qs)
    choice = [q for q in qs if q["kind"] != "numeric"]
    assert all(min(map(len, q["choices"])) >= 0.7 * max(map(len, q["choices"])) for q in choice
               if len(q["question"]) > 150)
    singles = [q for q in choice if q["kind"] == "single"]

    def strictly(q, pick) -> bool:
        lengths = [len(c) for c in q["choices"]]
        return all(pick(lengths[q["answer"]], n) for i, n in enumerate(lengths) if i != q["answer"])

    assert sum(strictly(q, lambda right, other: right > other) for q in singles) <= 0.25 * len(singles)
    assert sum(strictly(q, lambda right, other: right < other) for q in singles) <= 0.25 * len(singles)
    positions = Counter(q["answer"] for q in singles)
    assert set(positions) == {0, 1, 2, 3} and max(positions.values()) <= 0.4 * len(singles), positions


# --- the NVIDIA stack: the wires under the collectives, what tensor cores compute with, the profiling tools ------

import dataclasses  # noqa: E402

from gpucourse.modeled import tensor_cores, topology  # noqa: E402
from gpucourse.bench.quiz_figures import scenario_detail  # noqa: E402
from gpucourse.measure import nvtx_label  # noqa: E402
from gpucourse.model import MODELS  # noqa: E402
from gpucourse.parallel import single  # noqa: E402

NVIDIA_STACK = {
    "01_collectives": ["setup-topo-nic-near", "setup-gdr-staged", "setup-roce-rdma", "setup-nccl-proto-latency",
                       "setup-nccl-algo-pinned"],
    "07_memory_batch": ["mem-tf32-enable", "mem-tf32-memory", "mem-vocab-padding", "mem-fp8-formats",
                        "mem-fp8-delayed-scaling"],
    "08_profiling": ["prof-nvtx-ranges", "prof-memory-snapshot", "prof-dcgm-fleet", "prof-tool-per-question"],
}
STACK_TOPIC = {"01_collectives": "distributed-setups", "07_memory_batch": "memory-batch",
               "08_profiling": "profiling-troubleshooting"}


def test_nvidia_stack_questions_are_scenarios_and_not_gameable():
    """Hardware and tools: situations to decide in (a topology, a log line, a setting, a profile), choices of like
    length, the right one rarely the longest or the shortest, letters spread."""
    qs = [BY_ID[qid] for ids in NVIDIA_STACK.values() for qid in ids]
    assert all(q["notebook"] == nb and q["topic"] == STACK_TOPIC[nb]
               for nb, ids in NVIDIA_STACK.items() for q in (BY_ID[i] for i in ids))
    assert sum(scenario_detail(q["question"]) is not None for q in qs) >= 10
    assert all(q["kind"] != "numeric" for q in qs) and sum(q["kind"] == "multiple" for q in qs) <= 3
    assert_not_gameable(qs, letters=4)


# setup-topo-nic-near's server, as nvidia-smi would print it: PCIe only, a NIC beside each pair of GPUs.
PCIE_SERVER = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tSYS\tSYS\tPIX\tSYS\t0-15\t0
GPU1\tPIX\t X \tSYS\tSYS\tPIX\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tPIX\tSYS\tPIX\t16-31\t1
GPU3\tSYS\tSYS\tPIX\t X \tSYS\tPIX\t16-31\t1
NIC0\tPIX\tPIX\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tSYS\tPIX\tPIX\tSYS\t X
"""


def test_interconnect_figures():
    # setup-topo-nic-near: GPU2 reaches NIC0 across sockets (SYS), NIC1 through one PCIe switch (PIX); the legend
    # the explanation quotes; tensor-parallel pairs 0–1 and 2–3.
    server = topology.parse(PCIE_SERVER)
    assert server.link("GPU2", "NIC0") == "SYS" and server.nearest("GPU2", server.nics) == ("NIC1", "PIX")
    assert server.nearest("GPU0", server.nics) == ("NIC0", "PIX")
    assert topology.placement(server, tp=2, dp=2)["tp"] == {(0, 1): "PIX", (2, 3): "PIX"}
    assert topology.LEGEND["PIX"] == "at most one PCIe bridge" and "host bridge" in topology.LEGEND["PHB"]
    assert "NUMA nodes" in topology.LEGEND["SYS"] and "not crossing the PCIe host bridge" in topology.LEGEND["PXB"]
    assert sorted(["SYS", "PIX", "PHB"], key=topology.speed_rank) == ["PIX", "PHB", "SYS"]
    # setup-gdr-staged: the two log lines follow NCCL's connection line; only node A's ends in /GDRDMA.
    line = re.compile(r"Channel \d\d/\d : \d+\[\d+\] -> \d+\[\d+\] \[send\] via NET/IB/\d+(/GDRDMA)?")
    logged = re.findall(r"`(Channel [^`]+)`", BY_ID["setup-gdr-staged"]["question"])
    assert [bool(line.fullmatch(s).group(1)) for s in logged] == [True, False]
    # setup-nccl-algo-pinned: 16 servers of 8 are 128 GPUs, a ring's 2(n−1) = 254 steps; the modeled cluster of
    # notebook 01 takes the tree for a 256 KiB all-reduce there, and a forced ring is slower.
    many = Cluster.of("h100", 8, 16)
    small = 256 * 2**10
    assert many.gpus == 16 * 8 == 128 and 2 * (128 - 1) == 254
    ring = many.collective_s("all_reduce", small, range(128), algo="ring")[0]
    tree = many.collective_s("all_reduce", small, range(128), algo="tree")[0]
    assert many.collective_s("all_reduce", small, range(128))[1] == "tree" and ring > tree


def test_tensor_core_figures():
    # mem-tf32-enable: this torch's defaults — fp32 matmuls in full fp32, cuDNN convolutions in TF32 — and the new
    # switch exists; TF32 keeps 10 mantissa bits (fp16's) and fp32's range.
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.fp32_precision in ("none", "ieee")
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert tensor_cores.MANTISSA_BITS["tf32"] == 10 == -math.log2(torch.finfo(torch.float16).eps)
    x = torch.tensor([1 + 2**-10, 1 + 2**-12, 3e38])
    assert tensor_cores.to_tf32(x)[:2].tolist() == [1 + 2**-10, 1.0] and torch.isfinite(tensor_cores.to_tf32(x)).all()
    # mem-tf32-memory: 1 + 8 + 10 = 19 bits inside the matmul; no TF32 dtype, results stay 4-byte fp32.
    assert 1 + 8 + 10 == 19 and tensor_cores.to_tf32(x).dtype == torch.float32 and torch.float32.itemsize == 4
    assert not [n for n in dir(torch) if "tf32" in n.lower() and isinstance(getattr(torch, n), torch.dtype)]
    # mem-vocab-padding: 50,257 → 51,200 = 50 × 1024 for 128 × tp=8 (943 dummy rows, 6,400 = 50 × 128 per shard);
    # 50,304 for 128 (and 64) alone; 50,264 for 8, which leaves 6,283 rows per shard.
    vocab = MODELS["gpt2-small"].vocab_size
    assert vocab == 50257 and tensor_cores.padded(vocab, 128 * 8) == 51200 == 50 * 1024 and 51200 - vocab == 943
    assert 51200 // 8 == 6400 == 50 * 128 and tensor_cores.padded(vocab, 128) == tensor_cores.padded(vocab, 64) == 50304
    assert tensor_cores.padded(vocab, 8) == 50264 and 50264 / 8 == 6283 and 6283 % 2 == 1 and vocab % 8
    assert "vocabulary" in tensor_cores.misaligned_dims(MODELS["gpt2-small"], tp=8)
    assert not tensor_cores.misaligned_dims(dataclasses.replace(MODELS["gpt2-small"], vocab_size=51200), tp=8)
    # mem-fp8-formats: E4M3 448 down to 2^-9, E5M2 57344 down to 2^-16; magnitudes 1e-4 to 1e2 scaled onto each
    # maximum: E4M3 rounds the smallest to 0, E5M2 keeps them.
    assert (tensor_cores.fp8_max("e4m3"), tensor_cores.fp8_max("e5m2")) == (448, 57344)
    assert (tensor_cores.fp8_smallest("e4m3"), tensor_cores.fp8_smallest("e5m2")) == (2**-9, 2**-16)
    assert (tensor_cores.MANTISSA_BITS["e4m3"], tensor_cores.MANTISSA_BITS["e5m2"]) == (3, 2)
    grad = torch.tensor([1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2])
    e4m3 = tensor_cores.quantize(grad, "e4m3", tensor_cores.amax_scale(1e2, "e4m3"))
    e5m2 = tensor_cores.quantize(grad, "e5m2", tensor_cores.amax_scale(1e2, "e5m2"))
    assert e4m3[0] == 0 and 1e-4 * 448 / 1e2 < 2**-9 / 2 and bool((e5m2 != 0).all())
    # mem-fp8-delayed-scaling: a 16-step history peaking at 28 gives scale 448/28 = 16; a step reaching 40 lands at
    # 640 > 448 and is clipped (to 448, 28 after unscaling); margin=1 gives 8, and 320 fits exactly.
    history = [20.0 + (i % 5) for i in range(15)] + [28.0]
    ds = tensor_cores.DelayedScaling("e4m3", history_len=16, algo="max", margin=0, history=list(history))
    jump = torch.tensor([40.0, -3.0, 1.5])
    assert ds.scale() == 448 / 28 == 16 and 40 * 16 == 640 > 448
    seen = ds(jump)
    assert seen["scale"] == 16 and seen["saturated"] > 0 and ds.history[-1] == 40 and len(ds.history) == 16
    assert tensor_cores.quantize(jump, "e4m3", 16)[0] * 16 == 448
    assert torch.tensor(640.0).to(torch.float8_e4m3fn).float() == 448  # torch's own cast clips too
    wide = tensor_cores.DelayedScaling("e4m3", history_len=16, algo="max", margin=1, history=list(history))
    assert wide.scale() == tensor_cores.amax_scale(28, "e4m3", 1) == 8 and 40 * 8 == 320 <= 448
    assert wide(jump)["saturated"] == 0 and tensor_cores.quantize(jump, "e4m3", 8)[0] == 40


def test_profiling_tool_figures():
    # prof-nvtx-ranges: the runtime's ranges are named as its timeline names the spans.
    assert nvtx_label({"kind": "backward", "name": "backward", "microbatch": 2}) == "backward mb2"
    assert nvtx_label({"kind": "optimizer", "name": "optimizer", "microbatch": None}) == "optimizer"
    source = inspect.getsource(single)
    assert 'rec.span("optimizer")' in source and 'rec.span("backward", microbatch=microbatch)' in source
    # prof-memory-snapshot: PyTorch's recorder takes max_entries, the course's snapshot keeps 100,000 events and
    # writes DIR/rankN.memory.pickle, and the dump names the viewer.
    from gpucourse import profiling

    assert "max_entries" in inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert inspect.signature(profiling.memory_snapshot).parameters["max_entries"].default == 100_000
    assert profiling.snapshot_path("DIR", 3) == os.path.join("DIR", "rank3.memory.pickle")
    assert "pytorch.org/memory_viz" in torch.cuda.memory._dump_snapshot.__doc__
    assert "--memory-snapshot DIR" in BY_ID["prof-memory-snapshot"]["explanation"]


# --- fault tolerance, offload, overlap, compile, MIG/MPS, HSDP: every figure the questions state ---------------

def choice_with(qid: str, text: str) -> int:
    """The index of question ``qid``'s one choice that contains ``text``."""
    hits = [i for i, c in enumerate(BY_ID[qid]["choices"]) if text in c]
    assert len(hits) == 1, (qid, text, hits)
    return hits[0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fault_tolerance_figures(tmp_path):
    import torch.distributed.checkpoint as dcp

    # ft-young-interval: 512 h / 128 nodes = 4 h = 240 min between failures; √(2 × 2 × 240) = √960 ≈ 31 minutes.
    assert 512 / 128 * 60 == 240 and young_interval(2, 240) == pytest.approx(math.sqrt(960)) and round(math.sqrt(960)) == 31
    # ft-async-interval: 120 s → 10 s blocked, MTBF 20 h: √4800 ≈ 69 min before, √400 = 20 after, √12 ≈ 3.5 times shorter;
    # 12 times shorter would be 5.77 min; √12 times longer would be 240 min = 4 h.
    before, after = young_interval(120 / 60, 20 * 60), young_interval(10 / 60, 20 * 60)
    assert round(before) == 69 and after == pytest.approx(20) and 120 / 10 == 12
    assert before / after == pytest.approx(math.sqrt(12)) and round(math.sqrt(12), 1) == 3.5
    assert f"{before / 12:.2f}" == "5.77" and before * math.sqrt(12) == pytest.approx(240) and 240 / 60 == 4
    q = BY_ID["ft-async-interval"]
    assert q["answer"] == choice_with("ft-async-interval", "3.5 times, to 20 minutes")
    # ft-elastic-node-loss: 8 nodes of 8 are 64 ranks; after one node is lost, 7 ≥ the minimum of 4 remain: 56.
    assert 8 * 8 == 64 and 7 * 8 == 56 and 7 >= 4
    # ft-barrier-timeout: NCCL's default process-group timeout is 10 minutes, shorter than the 14-minute write.
    assert "10 minutes for NCCL" in torch.distributed.init_process_group.__doc__ and 14 > 10
    # ft-dcp-reshard: dcp.save writes __<rank>_<n>.distcp files and one .metadata file, and loads in place.
    state = {"w": torch.arange(6.0)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata", "__0_0.distcp"]
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert torch.equal(loaded["w"], state["w"])
    # ft-flight-recorder: PyTorch ships the analyzer for the flight recorder's dumps.
    import importlib.util

    assert importlib.util.find_spec("torch.distributed.flight_recorder.fr_trace") is not None
    # ft-accelerate-resume: 3,000 batches to skip; Accelerate has the call, and save_state names what it saves.
    from accelerate import Accelerator

    assert "num_batches" in inspect.signature(Accelerator.skip_first_batches).parameters
    assert "RNG generators" in Accelerator.save_state.__doc__


def c10d_header(name: str) -> str:
    """One of the c10d headers the installed torch ships (torch/include/torch/csrc/distributed/c10d)."""
    folder = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "distributed", "c10d")
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return f.read()


def test_timeout_questions_say_what_pytorch_2_13_does():
    """ft-flight-recorder and ft-async-error-zero, against the installed torch: the flight recorder keeps 2000
    entries unless told otherwise (FlightRecorder.hpp), and ProcessGroupNCCL has a heartbeat monitor with the
    switches the questions name (ProcessGroupNCCL.hpp). What the monitor does is in ProcessGroupNCCL.cpp, not
    installed (HeartbeatMonitor::runLoop; pytorch/pytorch#133237 and #143446 made the dump the default): at a
    timeout it writes the dump, sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) and ends the process, whatever
    TORCH_NCCL_ASYNC_ERROR_HANDLING says; the dump goes to $HOME/.cache/torch/comm_lib_trace_rank_<rank>
    (FlightRecorder.cpp, DebugInfoWriter::getWriter)."""
    from importlib.metadata import entry_points

    recorder, pg = c10d_header("FlightRecorder.hpp"), c10d_header("ProcessGroupNCCL.hpp")
    assert re.search(r'getCvarInt\(\s*\{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"\},\s*2000\)', recorder)
    for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"):
        assert f'"{name}"' in pg, name
    assert all(word in pg for word in ("class HeartbeatMonitor", "dumpOnTimeoutOrEx_", "heartbeatTimeoutInSec_"))
    [script] = [e for e in entry_points(group="console_scripts") if e.name == "torchfrtrace"]
    assert script.value == "torch.distributed.flight_recorder.fr_trace:main"
    # ft-flight-recorder: nothing to set, the dumps are already there.
    q = BY_ID["ft-flight-recorder"]
    assert "PyTorch 2.13" in q["question"] and "No TORCH_ or NCCL_ variable is set" in q["question"]
    assert q["answer"] == choice_with("ft-flight-recorder", "flight-recorder dump in ~/.cache/torch")
    assert "torchfrtrace" in q["choices"][q["answer"]]
    assert choice_with("ft-flight-recorder", "nowhere yet") != q["answer"]
    for said in ("on by default", "its last 2000 collectives", "TORCH_FR_BUFFER_SIZE, formerly "
                 "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT also on by default",
                 "$HOME/.cache/torch/comm_lib_trace_rank_<rank>", "TORCH_FR_DUMP_TEMP_FILE, formerly "
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "torch.distributed.flight_recorder.fr_trace"):
        assert said in q["explanation"], said
    assert "0, the default" not in q["explanation"] and "/tmp" not in q["explanation"]
    # ft-async-error-zero: the timeout at 10 minutes, the monitor's 480 s after the dump: about 18 minutes.
    q = BY_ID["ft-async-error-zero"]
    assert 10 + 480 / 60 == 18 and "PyTorch 2.13" in q["question"]
    assert q["answer"] == choice_with("ft-async-error-zero", "about 18 minutes after the failure")
    assert choice_with("ft-async-error-zero", "stuck since the night") != q["answer"]
    for said in ("TORCH_NCCL_DUMP_ON_TIMEOUT, on by default", "TORCH_NCCL_ENABLE_MONITORING, on by default",
                 "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s", "whatever TORCH_NCCL_ASYNC_ERROR_HANDLING says",
                 "TORCH_NCCL_ENABLE_MONITORING=0 or TORCH_NCCL_DUMP_ON_TIMEOUT=0"):
        assert said in q["explanation"], said
    assert "so the ranks wait forever" not in q["explanation"]


def test_offload_figures():
    from torch.distributed.fsdp import CPUOffloadPolicy

    # off-zero-offload-split: 6B × 16 bytes = 96 GB; 2 bytes of 16-bit weights (12 GB) on the GPU, 12 bytes (72 GB)
    # of master weights and Adam's moments on the host.
    per_param = estimate_params(1, 1, 0, "bf16", True, scratch_padding=False)
    assert per_param == {"weights": 2, "gradients": 2, "optimizer": 12} and model_state_gb(6e9) == 96
    assert 6e9 * per_param["weights"] / 1e9 == 12 and 6e9 * per_param["optimizer"] / 1e9 == 72
    # off-pcie-seconds: 26 GB each way, 52 GB at 50 GB/s = 1.04 s; PCIe 5.0 x16 peaks at 32 GT/s × 16 lanes × 128/130.
    assert 13e9 * BF16_BYTES / 1e9 == 26 and NUMERIC["off-pcie-seconds"]() == pytest.approx(1.04)
    assert round(32e9 * 16 * 128 / 130 / 8 / 1e9) == 63 and 32e9 * 16 / 8 * 2 / 1e9 == 128
    # off-when-helps: 13B × 16 = 208 GB against 80, 26 GB of bf16 weights; 7B over 32 FSDP ranks is 3.5 GB each.
    assert model_state_gb(13e9) == 208 and 13e9 * BF16_BYTES / 1e9 == 26 and model_state_gb(7e9, 32, 3) == 3.5
    # off-infinity-nvme: 200B × 16 = 3.2 TB, beyond 8 × 80 GB and 2 TB of host memory; whole 16-bit weights are
    # 400 GB per GPU, five H100s' worth.
    assert model_state_gb(200e9) == 3200 and 8 * 80 == 640 and 200e9 * BF16_BYTES / 1e9 == 400 == 5 * 80
    # off-fsdp2-cpu-policy: pinned host memory by default; save_on_cpu offers the same for activations.
    assert CPUOffloadPolicy().pin_memory is True
    assert "pin_memory" in inspect.signature(torch.autograd.graph.save_on_cpu).parameters


def test_overlap_figures():
    from torch.distributed.fsdp import BackwardPrefetch, FSDPModule, FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    # dp-bucket-view and dp-bucket-cap-latency: DDP's defaults, 25 MiB buckets, copies unless told otherwise.
    ddp = inspect.signature(DistributedDataParallel.__init__).parameters
    assert ddp["gradient_as_bucket_view"].default is False and ddp["find_unused_parameters"].default is False
    assert "default size of 25 MiB" in " ".join(DistributedDataParallel.__doc__.split())
    assert 1.3e9 * 4 / 1e9 == pytest.approx(5.2) and 400 / 4 == 100
    # dp-bucket-cap-latency: buckets of 4 MiB (the run's own cap, below DDP's 25 MiB default, which is why they are
    # small enough for latency to rule); four times the cap is 16 MiB and about 100 buckets; 25 MiB about 64.
    q = BY_ID["dp-bucket-cap-latency"]
    assert "a few MB" not in q["question"] and "each about 4 MiB, as its bucket_cap_mb=4 makes them" in q["question"]
    assert 4 * 4 == 16 and 400 * 4 / 16 == 100 and 400 * 4 / 25 == 64
    assert ("bucket_cap_mb=16, four times the 4 MiB set here, turns about 400 buckets into about 100 (DDP's "
            "default, 25 MiB, would leave about 64)") in q["explanation"]
    # ovl-fsdp-prefetch: FSDP's default backward prefetch.
    assert inspect.signature(FullyShardedDataParallel.__init__).parameters["backward_prefetch"].default \
        == BackwardPrefetch.BACKWARD_PRE
    # hsdp-mesh-layout and hsdp-accumulate: a 2-D mesh is HSDP, and FSDP2 can skip the all-reduce alone.
    assert "(Replicate(), Shard(0))" in " ".join(fully_shard.__doc__.split())
    assert all(hasattr(FSDPModule, name) for name in ("set_requires_all_reduce", "set_requires_gradient_sync",
                                                       "set_reshard_after_backward"))


def test_compile_figures():
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    # tc-recompile: a second batch size recompiles once with the size dynamic; later sizes reuse the graphs.
    assert dynamo.config.automatic_dynamic_shapes and dynamo.config.recompile_limit == 8
    dynamo.reset()
    counters.clear()
    step = torch.compile(lambda x: (x * 2).sin() + 1, backend="eager")
    for batch in (32, 32, 20, 32, 20, 32, 20):
        step(torch.randn(batch, 8))
    assert counters["stats"]["unique_graphs"] == 2
    # tc-graph-break: a .item() inside the compiled code splits it in two graphs; fullgraph=True refuses instead.
    def forward(x):
        y = x.sin()
        print(y.sum().item(), end="")
        return y.cos()

    explained = dynamo.explain(forward)(torch.randn(3))
    assert (explained.graph_count, explained.graph_break_count) == (2, 1)
    with pytest.raises(Exception):
        torch.compile(forward, backend="eager", fullgraph=True)(torch.randn(3))
    dynamo.reset()
    # tc-reduce-overhead: the mode is CUDA graphs.
    assert "CUDA graphs" in torch.compile.__doc__ and "reduce-overhead" in torch.compile.__doc__
    # tc-first-step: (90 + 19 × 0.9) / 20 ≈ 5.4 s; 5.4 / 1.2 = 4.5; 0.9 s is 25% under 1.2 s; 90 s back in 300 steps.
    assert f"{(90 + 19 * 0.9) / 20:.1f}" == "5.4" and 5.4 / 1.2 == pytest.approx(4.5)
    assert 1 - 0.9 / 1.2 == pytest.approx(0.25) and 90 / (1.2 - 0.9) == pytest.approx(300)


def test_mig_and_hsdp_figures():
    # mig-ddp-start and mig-profile-size: 8 A100s × 7 instances = 56 ranks; a 1g.10gb has 10 GB, a 3g.40gb 40 GB.
    assert 8 * 7 == 56 and 10 < 30 <= 40
    # mig-ddp-start: the job does not start at all. NCCL knows a GPU by its PCI bus ID, which a GPU's MIG instances
    # share, and from 2.5 refuses two ranks on one (NVIDIA/nccl#418: "Duplicate GPU detected"), as the course's own
    # device check says; the stem names an NCCL of that range (the newest add experimental MIG support).
    from gpucourse.runtime.devices import PLATFORMS

    seat = PLATFORMS["mig-a100-1g.10gb"].devices
    assert seat.mig and seat.cuda_ranks == 1 and "Duplicate GPU detected" in seat.shortfall(2)
    q = BY_ID["mig-ddp-start"]
    assert "(NCCL 2.21)" in q["question"] and "never reaches its first step" in q["question"]
    assert "far slower" not in q["question"] and "mig-ddp-slow" not in BY_ID
    assert q["answer"] == choice_with("mig-ddp-start", "share that GPU's PCI bus ID")
    assert "'Duplicate GPU detected" in q["explanation"] and "since 2.5" in q["explanation"]
    assert "no peer-to-peer path" in q["explanation"] and "experimental" in q["explanation"]
    # hsdp-cross-node-bytes: a 3.25 GB shard; a ring among 4 replicas sends 1.5 times it.
    assert 13e9 * BF16_BYTES / 8 / 1e9 == 3.25 and RING_FACTOR["all_reduce"](4) == 1.5
    assert NUMERIC["hsdp-cross-node-bytes"]() == pytest.approx(4.875)
    # hsdp-shard-group: 70B × 16 bytes over 8, 16, 32 and 128 GPUs; 40 GB must remain of 80; replicas 128 / group.
    state = {group: model_state_gb(70e9, group, 3) for group in (8, 16, 32, 128)}
    assert state == {8: 140, 16: 70, 32: 35, 128: 8.75}
    assert min(g for g, gb in state.items() if 80 - gb >= 40) == 32 and 80 - 35 == 45 and 80 - 70 == 10
    choices = BY_ID["hsdp-shard-group"]["choices"]
    for group, gb in state.items():
        [c] = [c for c in choices if c.startswith(f"{group} GPUs,")]
        assert f"{gb:g} GB of state" in c and f"{128 // group} replica" in c
    assert choices[BY_ID["hsdp-shard-group"]["answer"]].startswith("32 GPUs,")
    # hsdp-from-full-shard: 7B × 16 bytes over 512 GPUs ≈ 0.22 GB, over a node's 8 = 14 GB.
    assert round(model_state_gb(7e9, 512, 3), 2) == 0.22 and model_state_gb(7e9, 8, 3) == 14


def test_pipeline_figures_of_the_top_up():
    # pp-accum-is-microbatches: 16 × 4 × 8 = 512; with dp=4 each pipeline runs 512 / (4 × 4) = 32 microbatches and
    # 1F1B's bubble is 3/35 of the step (3/32 idle over compute); the other choices' m and shares.
    assert with_microbatch(TrainConfig(dp=16, grad_accum=8), 4).batch_size == 512
    assert accum_steps(512, 4, 4) == 32 and TrainConfig(dp=4, pp=4).world_size == 16
    shares = {m: bubble("1f1b", 4, m) for m in (8, 16, 32, 128)}
    assert shares == pytest.approx({8: 3 / 11, 16: 3 / 19, 32: 3 / 35, 128: 3 / 131})
    assert [round(100 * v) for v in shares.values()] == [27, 16, 9, 2]
    q = BY_ID["pp-accum-is-microbatches"]
    for m, v in shares.items():
        [c] = [c for c in q["choices"] if c.startswith(f"{m} microbatches,")]
        assert f"3/{m + 3} of the step is bubble, about {round(100 * v)}%" in c
    assert q["choices"][q["answer"]].startswith("32 microbatches,")
    # pp-slow-last-stage: stage 3 at 16 ms paces 16 microbatches, plus a fill of 3 × 10 ms: 286 ms; balanced stages
    # take 218.5 ms, all at 10 ms 190 ms; the stages' sum times 16 is 736 ms, stage 3 alone times 16 is 256 ms.
    def step_ms(per_stage):
        return schedules.simulate(schedules.build("1f1b", 4, 16), 4, 16, cost_f=[t / 3 for t in per_stage],
                                  cost_b=[2 * t / 3 for t in per_stage]).makespan

    assert step_ms([10, 10, 10, 16]) == pytest.approx(286) == 16 * 16 + 3 * 10
    assert step_ms([11.5] * 4) == pytest.approx(218.5) and round(218.5 + 0.5) == 219
    assert step_ms([10] * 4) == pytest.approx(190) and 46 * 16 == 736 and 16 * 16 == 256
    assert BY_ID["pp-slow-last-stage"]["answer"] == choice_with("pp-slow-last-stage", "about 286 ms")


def test_figures_of_the_second_top_up():
    """The 21 questions added to the seven smallest notebooks: every figure their choices and explanations state."""
    from torch.utils.data import DistributedSampler

    from gpucourse.parallel.precision import DynamicLossScaler as Scaler

    # pp-halve-microbatch: p=8, m=8 → 7/15; m=16 → 7/23 ≈ 30%; 7/30 and 7/16 are the misreadings.
    assert bubble("1f1b", 8, 8) == pytest.approx(7 / 15) and bubble("1f1b", 8, 16) == pytest.approx(7 / 23)
    assert [round(100 * x) for x in (7 / 15, 7 / 23, 7 / 30, 7 / 16)] == [47, 30, 23, 44]
    assert schedules.formula_bubble_ratio("1f1b", 8, 16) == pytest.approx(7 / 16)
    # pp-layout-bubble: 128 sequences, microbatch 1: pp=8 × dp=4 runs m=32, pp=4 × dp=8 m=16; 7/39 > 3/19.
    assert accum_steps(128, 1, 4) == 32 and accum_steps(128, 1, 8) == 16 and 32 / 8 == 16 / 4 == 4
    assert bubble("1f1b", 8, 32) == pytest.approx(7 / 39) and bubble("1f1b", 4, 16) == pytest.approx(3 / 19)
    assert [round(100 * x) for x in (7 / 39, 3 / 19, 3 / 11, 1 / 32, 1 / 16)] == [18, 16, 27, 3, 6]
    assert f"{100 * 7 / 39:.1f}" == "17.9" and f"{100 * 3 / 19:.1f}" == "15.8"
    # pp-p2p-bytes: 128 MiB a microbatch.
    assert 2 * 4096 * 8192 * BF16_BYTES / 2**20 == 128
    # prof-oom-read-message: 1.52 GiB cached but unused is less than the 2 GiB asked for.
    assert 1.52 < 2.00 and round(79.19 - 1.06 - 75.80 - 1.52, 2) == 0.81
    # prof-scaler-collapse: 16 halvings take 65536 to 1.
    assert scale_after(65536, overflow=True, steps=16) == 1 == 65536 / 2**16
    assert Scaler(init_scale=1.0).scale == 1.0
    # prof-uneven-shards-hang: 80,004 files, files[rank::8]: ranks 0–3 get 10,001, 4–7 10,000; the sampler pads.
    files = list(range(80_004))
    assert [len(files[r::8]) for r in range(8)] == [10_001] * 4 + [10_000] * 4 and 80_004 == 8 * 10_000 + 4
    assert {len(DistributedSampler(files, num_replicas=8, rank=r)) for r in range(8)} == {10_001}
    assert len(DistributedSampler(files, num_replicas=8, rank=0, drop_last=True)) == 10_000
    from torch.nn.parallel import DistributedDataParallel
    assert hasattr(DistributedDataParallel, "join")
    # dp-allreduce-time: 5.2 GB × 1.75 / 200 GB/s = 45.5 ms; algbw 114 GB/s.
    assert NUMERIC["dp-allreduce-time"]() == pytest.approx(45.5) and round(200 / 1.75) == 114
    # dp-same-batches: 8 × 32 = 256 distinct sequences with a sampler.
    assert 8 * 32 == 256
    # dp-accum-sync-count: 8 × 45 = 360 ms against 45.
    assert 8 * 45 == 360
    # pipe-interleave-slow-links: p=8, m=16, v=4, transfers 0, 0.5 and 1 unit.
    plain = {c: schedules.simulate(schedules.one_f_one_b(8, 16), 8, 16, 1.0, 2.0, c).makespan for c in (0, 0.5, 1)}
    inter = {c: interleaved(8, 16, 4, c).makespan for c in (0, 0.5, 1)}
    assert plain == pytest.approx({0: 69, 0.5: 105, 1: 141}) and inter == pytest.approx({0: 53.25, 0.5: 92, 1: 142})
    assert round(53.25) == 53 and round(141 / 4) == 35
    assert one_f_one_b(8, 16).bubble_ratio == pytest.approx(7 / 16)
    assert interleaved(8, 16, 4).bubble_ratio == pytest.approx(7 / 64)
    ops, _ = schedules_virtual.build("interleaved-1f1b", 8, 16, 4)
    assert sends_per_microbatch(ops, 16) == sends_per_microbatch(ops, 16, schedules.SEND_B) == 31 == 7 + 24
    # pipe-interleave-chunk-layers: p=4, v=3: rank 1 holds chunks 1, 5, 9 (layers 2–3, 10–11, 18–19).
    layout = schedules_virtual.Layout(4, 3)
    assert [layout.virtual(1, c) for c in range(3)] == [1, 5, 9]
    assert [layout.virtual(2, c) for c in range(3)] == [2, 6, 10] and 24 // 12 == 2
    ops, _ = schedules_virtual.build("interleaved-1f1b", 4, 8, 3)
    assert sends_per_microbatch(ops, 8) == 11 and sends_per_microbatch(schedules.one_f_one_b(4, 8), 8) == 3
    # pipe-looped-bfs-memory: the same idle time over compute, 3/16; 16 chunks on each rank against 11, 9, 7, 5.
    peaks, ratios, sends = {}, {}, {}
    for name in ("looped-bfs", "interleaved-1f1b"):
        ops, layout = schedules_virtual.build(name, 4, 8, 2)
        sim = schedules_virtual.simulate(ops, layout, 8, 1.0, 2.0, 0.0, 0.0)
        peaks[name], ratios[name], sends[name] = sim.peak_in_flight, sim.bubble_ratio, sends_per_microbatch(ops, 8)
    assert peaks == {"looped-bfs": [16] * 4, "interleaved-1f1b": [11, 9, 7, 5]}
    assert ratios["looped-bfs"] == ratios["interleaved-1f1b"] == pytest.approx(3 / 16)
    assert sends["looped-bfs"] == sends["interleaved-1f1b"] == 7 and 16 / 2 == 8 and 11 / 2 == 5.5
    # fsdp-step-bytes: 12.25 GB a collective, 36.75 for three, 24.5 for DDP.
    assert RING_FACTOR["all_gather"](8) * 14 == 12.25 and RING_FACTOR["all_reduce"](8) * 14 == 24.5
    assert 36.75 / 24.5 == 1.5
    # fsdp-reshard-after-forward: 26 GB of bf16 weights, 3.25 GB a shard; the docstring says what False does.
    from torch.distributed.fsdp import fully_shard
    assert "avoids the all-gather in backward" in " ".join(fully_shard.__doc__.split())
    assert 13e9 * BF16_BYTES / 1e9 == 26 and 26 / 8 == 3.25 and 26 - 3.25 == 22.75 < 30
    # zero-stage-fits: 38.5, 26.25, 14 GB; 28 GB free; 112 GB in all.
    gb = {z: model_state_gb(7e9, 8, z) for z in (1, 2, 3)}
    assert gb == pytest.approx({1: 38.5, 2: 26.25, 3: 14}) and model_state_gb(7e9) == 112
    assert min(z for z, v in gb.items() if v <= 40 - 12) == 2
    # tp-col-col-gather: 64 MiB after proj, 256 MiB of GELU output, a 16 MiB slice.
    assert 4 * 2048 * 4096 * BF16_BYTES / 2**20 == 64 and 4 * 2048 * 16384 * BF16_BYTES / 2**20 == 256 == 4 * 64
    assert 64 / 4 == 16
    # tp-forward-bytes: 64 MiB payload, 112 MiB an all-reduce, two in forward.
    assert 4096 * 8192 * BF16_BYTES / 2**20 == 64 and RING_FACTOR["all_reduce"](8) * 64 == 112
    # tp-vocab-logits: 2 × 4096 × 128,000 fp32 logits ≈ 3.9 GiB, a 16,000-entry shard ≈ 0.49 GiB.
    full = 2 * 4096 * 128_000 * 4
    assert 128_000 // 8 == 16_000 and f"{full / 2**30:.1f}" == "3.9" and f"{full / 8 / 2**30:.2f}" == "0.49"
    # setup-busbw-from-time: algbw 181.8 GB/s × 1.875.
    assert f"{4e9 / 0.022 / 1e9:.1f}" == "181.8" and bus_factor("all_reduce", 16) == 1.875
    assert f"{NUMERIC['setup-busbw-from-time']():.1f}" == "340.9"
    # setup-reduce-scatter-choice: 14 GB for the all-reduce, 7 for the reduce-scatter, a 1 GB slice.
    assert RING_FACTOR["all_reduce"](8) * 8 == 14 and RING_FACTOR["reduce_scatter"](8) * 8 == 7 and 8 / 8 == 1
    # setup-small-message-latency: 8192 B in 25 µs: algbw 0.33 GB/s, busbw 0.57; 0.017 µs at 480 GB/s, the
    # course's modelled H100 busbw at 8 GiB.
    algbw = 8192 / 25e-6 / 1e9
    assert f"{algbw:.2f}" == "0.33" and f"{algbw * bus_factor('all_reduce', 8):.2f}" == "0.57"
    assert f"{8192 / 480e9 * 1e6:.3f}" == "0.017"
    assert round(Cluster(get_gpu("h100"), 8).bus_bandwidth("all_reduce", 8 << 30, 8) / 1e9) == 480


# --- LoRA memory, 2:4 sparsity, NCCL's network variables, GPUDirect Storage, Grace Hopper and GB200 NVL72 -----------

from gpucourse.modeled import serve_plan  # noqa: E402
from gpucourse.modeled.shapes import get_shape  # noqa: E402

# The questions of these topics, by group: each group is held to the bank's rules against guessing, and each
# question cites where its facts come from (a documentation page or a paper).
PLATFORM_QUESTIONS = {
    ("07_memory_batch", "memory-batch"): ["mem-lora-params", "mem-lora-memory", "mem-lora-rank", "mem-lora-step-cost",
                                          "mem-lora-merge", "mem-sparse-pattern", "mem-sparse-what-speeds"],
    ("08_profiling", "profiling-troubleshooting"): ["prof-sparse-peak"],
    ("01_collectives", "distributed-setups"): ["setup-nccl-socket-ifname", "setup-nccl-ib-hca-prefix",
                                               "setup-nccl-gdr-level", "setup-nccl-conf-file", "setup-c2c-offload",
                                               "setup-c2c-coherent", "setup-nvl72-tp16", "setup-nvl72-disagg",
                                               "setup-nvl72-aggregate"],
    ("10_accelerate_scaling", "distributed-setups"): ["ft-gds-direct-path", "ft-gds-torch-api", "ft-gds-filesystem"],
    ("10_accelerate_scaling", "profiling-troubleshooting"): ["ft-gds-compat-mode"],
}
SOURCE = re.compile(r"arxiv\.org/abs/|docs\.|nvidia\.github\.io/|developer\.nvidia\.com/|huggingface\.co/docs/|"
                    r"pytorch\.org/")
INFERENCE_PREFIX = "inf-"  # notebook 15's questions: speculative decoding, prefix caching, split-KV, ...


def right_choice_of(qid: str) -> str:
    q = BY_ID[qid]
    return q["choices"][q["answer"]]


def test_platform_questions_are_scenarios_cite_sources_and_are_not_gameable():
    qs = []
    for (notebook, topic), ids in PLATFORM_QUESTIONS.items():
        for qid in ids:
            q = BY_ID[qid]
            assert (q["notebook"], q["topic"]) == (notebook, topic), qid
            qs.append(q)
    assert len(qs) == 21 and all(q["kind"] != "numeric" for q in qs)
    assert all(scenario_detail(q["question"]) is not None and len(q["question"]) > 150 for q in qs)
    assert [q["id"] for q in qs if not SOURCE.search(q["explanation"])] == []
    assert_not_gameable(qs, letters=4)


def test_new_topics_reach_mastery_and_the_mock_exam():
    """The serving and platform questions count in each exam topic's mastery and can be drawn by a mock exam."""
    from gpucourse.quiz.exam import _exam_pool
    from gpucourse.quiz.review import mastery

    new = [qid for ids in PLATFORM_QUESTIONS.values() for qid in ids]
    new += [q["id"] for q in BANK if q["id"].startswith(INFERENCE_PREFIX)]
    assert len(new) >= 45 and len(set(new)) == len(new)
    pool = {q["id"] for qs in _exam_pool().values() for q in qs}
    assert set(new) <= pool
    record = {"questions": {qid: {"box": 0, "due": 1, "last_right": True} for qid in new}}
    topics = mastery(record)["topics"]
    assert {t: v["total"] for t, v in topics.items()} == Counter(q["topic"] for q in BANK)
    assert {t: v["mastered"] for t, v in topics.items() if v["mastered"]} == Counter(BY_ID[qid]["topic"] for qid in new)


def test_lora_figures():
    s = get_shape("llama3-8b")
    assert (s.layers, s.hidden, s.kv * s.head_dim) == (32, 4096, 1024) and round(s.params() / 1e9, 2) == 8.03
    r, d, kv = 16, s.hidden, s.kv * s.head_dim
    shapes = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d)}  # (d_in, d_out)
    adapters = {name: (torch.zeros(r, d_in), torch.zeros(d_out, r)) for name, (d_in, d_out) in shapes.items()}
    per_layer = sum(a.numel() + b.numel() for a, b in adapters.values())
    lora = per_layer * s.layers
    assert per_layer == 425_984 and lora == 13_631_488 and f"{100 * lora / s.params():.2f}" == "0.17"
    # mem-lora-params: the right count and the distractors' (MHA shapes; A alone; B alone).
    counts = {"right": lora, "mha": 4 * 2 * r * d * s.layers, "a only": sum(r * i for i, _ in shapes.values()) * 32,
              "b only": sum(r * o for _, o in shapes.values()) * 32}
    assert {k: round(v / 1e6, 1) for k, v in counts.items()} == {"right": 13.6, "mha": 16.8, "a only": 8.4,
                                                                  "b only": 5.2}
    assert right_choice_of("mem-lora-params").startswith("about 13.6 M")
    # mem-lora-memory: frozen bf16 weights, 16 bytes a trainable parameter.
    per_trainable = sum(estimate_params(1, 1, 0, "bf16", True, scratch_padding=False).values())
    frozen, states = s.params() * 2 / 1e9, lora * per_trainable / 1e9
    assert per_trainable == 16 and round(frozen, 2) == 16.06 and round(states, 2) == 0.22
    assert round(frozen + states, 1) == 16.3 and round(s.params() * 16 / 1e9) == 128
    assert round(s.params() * 4 / 1e9) == 32 and round(s.params() * 6 / 1e9) == 48
    assert right_choice_of("mem-lora-memory").startswith("about 16.3 GB")
    # mem-lora-rank: r = 32 doubles the adapters; a fourfold count would add 0.65 GB; doubling all would be 32.6 GB.
    assert round(2 * lora / 1e6, 1) == 27.3 and round(frozen + 2 * states, 1) == 16.5
    assert round(3 * lora * 16 / 1e9, 2) == 0.65 and round(2 * (frozen + states), 1) == 32.6
    assert right_choice_of("mem-lora-rank").startswith("parameters double; the model states grow by about 0.22 GB")
    # mem-lora-step-cost: 6N → 4N; the fraction trained is about 1/600.
    assert (2 + 2) / (2 + 2 + 2) == pytest.approx(2 / 3) and round(s.params() / lora, -2) == 600
    assert right_choice_of("mem-lora-step-cost").startswith("about 2/3 of the FLOPs")


def test_lora_frozen_weights_get_no_gradient_and_the_adapter_merges():
    gen = torch.Generator().manual_seed(0)
    # Backward reaches an adapter below a frozen layer, and the frozen weights get no gradient of their own.
    base, top = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    for p in (base.weight, top.weight):
        p.requires_grad_(False)
    a, b = torch.randn(2, 8, generator=gen, requires_grad=True), torch.randn(8, 2, generator=gen, requires_grad=True)
    x = torch.randn(4, 8, generator=gen)
    top(base(x) + x @ a.T @ b.T).sum().backward()
    assert base.weight.grad is None and top.weight.grad is None and a.grad is not None and b.grad is not None
    # mem-lora-merge: W + (alpha/r)·BA gives the adapter's outputs; without the scale it does not.
    r, alpha = 16, 32
    w, a, b = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((64, 48), (r, 48), (64, r)))
    x = torch.randn(5, 48, generator=gen, dtype=torch.float64)
    unmerged = x @ w.T + alpha / r * (x @ a.T @ b.T)
    assert alpha / r == 2 and torch.allclose(x @ (w + alpha / r * b @ a).T, unmerged)
    assert not torch.allclose(x @ (w + b @ a).T, unmerged)
    assert right_choice_of("mem-lora-merge").startswith("merge W + (32/16)·BA")


def test_two_four_sparsity_figures():
    def rows(qid):
        return {c: [float(v) for v in c.strip("[]").replace("|", ",").split(",")] for c in BY_ID[qid]["choices"]}

    def two_four(values):  # at least two zeros in each group of four consecutive values
        return all(sum(v == 0 for v in values[i:i + 4]) >= 2 for i in range(0, len(values), 4))

    candidates = rows("mem-sparse-pattern")
    assert [c for c, v in candidates.items() if two_four(v)] == [right_choice_of("mem-sparse-pattern")]
    assert any(sum(v == 0 for v in values) == 4 and not two_four(values) for values in candidates.values())
    assert "2:4 sparsity" in " ".join(torch.sparse.SparseSemiStructuredTensor.__doc__.split())
    assert right_choice_of("mem-sparse-what-speeds").startswith("the matmuls whose pruned weight operand")
    # prof-sparse-peak: the datasheet's 1,979 is twice the dense 989 the course uses.
    dense = get_gpu("h100").peak_flops("bf16") / 1e12
    assert dense == 989 and 1979 == pytest.approx(2 * dense, rel=1e-3) and 3958 == 2 * 1979
    mfu = {"dense": 742 / dense, "sparse": 742 / 1979, "fp8 sparse": 742 / 3958, "recompute": 742 * 8 / 6 / 1979}
    assert {k: round(100 * v, 1) for k, v in mfu.items()} == {"dense": 75.0, "sparse": 37.5, "fp8 sparse": 18.7,
                                                               "recompute": 50.0}
    assert right_choice_of("prof-sparse-peak").startswith("1,979 assumes 2:4 sparsity")


def nccl_match(value: str, names: list[str]) -> list[str]:
    """The names an NCCL_SOCKET_IFNAME or NCCL_IB_HCA value selects, by NCCL's documented rules: a comma-separated
    list of prefixes; a leading ^ excludes, a leading = (after any ^) asks for exact names."""
    exclude = value.startswith("^")
    value = value.removeprefix("^")
    exact = value.startswith("=")
    tokens = value.removeprefix("=").split(",")
    hit = [n for n in names if any(n == t if exact else n.startswith(t) for t in tokens)]
    return [n for n in names if n not in hit] if exclude else hit


def test_nccl_network_variable_figures():
    interfaces = ["lo", "docker0", "eth0", "ens1f0", "ens1f1"]
    chosen = {v: nccl_match(v, interfaces) for v in ("ens1", "^eth", "=ens1f0", "^=eth0")}
    assert chosen == {"ens1": ["ens1f0", "ens1f1"], "^eth": ["lo", "docker0", "ens1f0", "ens1f1"],
                      "=ens1f0": ["ens1f0"], "^=eth0": ["lo", "docker0", "ens1f0", "ens1f1"]}
    assert right_choice_of("setup-nccl-socket-ifname").startswith("NCCL_SOCKET_IFNAME==ens1f0")
    hcas = [f"mlx5_{i}" for i in range(12)]
    assert nccl_match("mlx5_0,mlx5_1", hcas) == ["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_11"]
    assert nccl_match("=mlx5_0,mlx5_1", hcas) == ["mlx5_0", "mlx5_1"]
    assert "use =mlx5_0,mlx5_1" in right_choice_of("setup-nccl-ib-hca-prefix")
    # setup-nccl-gdr-level: the levels in order of distance; PIX stops short of PXB.
    levels = ["LOC", "PIX", "PXB", "PHB", "SYS"]
    def gdr(path, level): return levels.index(path) <= levels.index(level) and level != "LOC"
    assert not gdr("PXB", "PIX") and gdr("PXB", "PXB") and gdr("PXB", "SYS") and not gdr("PIX", "LOC")
    assert right_choice_of("setup-nccl-gdr-level").startswith("PIX allows GPUDirect RDMA under one switch only")
    # setup-nccl-conf-file: system configuration against debugging, as NCCL's documentation files them.
    system, debugging = {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"}, {"NCCL_P2P_DISABLE", "NCCL_BUFFSIZE"}
    q = BY_ID["setup-nccl-conf-file"]
    assert {q["choices"][i].split("=")[0] for i in q["answer"]} == system
    assert {c.split("=")[0] for i, c in enumerate(q["choices"]) if i not in q["answer"]} == debugging
    assert 4 * 2**20 == 4_194_304 == 4 * 1_048_576


def test_gpudirect_storage_figures():
    from torch.cuda.gds import GdsFile

    doc = " ".join(GdsFile.__doc__.split())
    assert "cuFile" in doc and "os.O_DIRECT`` will be added automatically" in doc
    assert all(hasattr(GdsFile, m) for m in ("load_storage", "save_storage"))
    assert right_choice_of("ft-gds-torch-api").startswith("torch.cuda.gds.GdsFile(f, flags).load_storage(")
    s = get_shape("llama3-70b")
    assert round(serve_plan.weight_bytes(s) / 1e9) == 141 and round(s.params() * 2 / 8 / 1e9, 1) == 17.6
    assert right_choice_of("ft-gds-direct-path").startswith("storage DMAs straight into GPU memory")
    assert right_choice_of("ft-gds-compat-mode").startswith("cuFile falls back to POSIX reads")
    assert right_choice_of("ft-gds-filesystem").startswith("Lustre over InfiniBand")


def test_grace_hopper_and_nvl72_figures():
    h100, b200 = get_gpu("h100"), get_gpu("b200")
    # setup-c2c-offload: one direction of each link; 900/128 is about 7.
    seconds = {"c2c": 64 / 450, "pcie": 64 / h100.pcie_GBps, "c2c both": 64 / 900, "pcie both": 64 / 128,
               "c2c bits": 64 / (450 / 8), "pcie bits": 64 / (64 / 8), "hbm": 64 / h100.hbm_GBps}
    assert {k: round(v, 2) for k, v in seconds.items()} == {"c2c": 0.14, "pcie": 1.0, "c2c both": 0.07,
                                                            "pcie both": 0.5, "c2c bits": 1.14, "pcie bits": 8.0,
                                                            "hbm": 0.02}
    assert h100.pcie_GBps == 64 and round(900 / 128) == 7
    assert right_choice_of("setup-c2c-offload") == "about 0.14 s on the GH200 against 1.0 s on PCIe Gen5"
    assert right_choice_of("setup-c2c-coherent").startswith("nothing special")
    # setup-nvl72-tp16 and setup-nvl72-aggregate: 1.8 TB/s a GPU counts both directions; 72 of them make ~130 TB/s.
    assert b200.intra_node_GBps == 900 == 1800 / 2 and 72 * 1.8 == pytest.approx(129.6) and round(72 * 1.8, -1) == 130
    assert 900 / h100.inter_node_GBps == 18 and round(130 / 16) == 8 and round(130 / 64) == 2
    assert right_choice_of("setup-nvl72-tp16").startswith("900 GB/s, 18 times")
    assert right_choice_of("setup-nvl72-aggregate").startswith("900 GB/s: 130 TB/s is 72 GPUs × 1.8 TB/s")
    # setup-nvl72-disagg: a 320 MiB share through a 50 GB/s NIC and over 900 GB/s of NVLink.
    share = 8192 * serve_plan.kv_bytes_per_token(get_shape("llama3-70b"), 8)
    ms = {"nic": share / 50e9, "nvlink": share / 900e9, "both ways": share / 1.8e12, "whole": 8 * share / 900e9,
          "whole nic": 8 * share / 50e9}
    assert share == 320 * 2**20 and {k: round(v * 1e3, 2) for k, v in ms.items()} == {
        "nic": 6.71, "nvlink": 0.37, "both ways": 0.19, "whole": 2.98, "whole nic": 53.69}
    assert right_choice_of("setup-nvl72-disagg").startswith("about 6.7 ms through the NIC, about 0.37 ms")
