"""Published runs the cost model is checked against: configurations from papers and official pages, and what
they measured.

Each :class:`Published` names its source, the layout (on paper: :func:`gpucourse.plan.step_time` times it
with the same :class:`~gpucourse.cluster.Cluster` that replays recorded runs), the figure the source
reports, and how to turn the model's step time into that figure. :func:`compare` predicts every one;
``docs/modeled-timing.md`` prints the table and ``tests/test_published.py`` holds the model to it:
within 20 % where compute rules, 30 % where communication does.

The two free numbers per GPU, ``achievable`` (the share of peak a training step reaches) and
``bus_efficiency`` (the share of a link NCCL's ring reaches), are in :mod:`gpucourse.gpus`; they are set
once per GPU for all of these runs, not per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import Cluster
from .config import TrainConfig
from .gpus import get_gpu
from .plan import step_time


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    gpu: str
    reported: float                  # the figure the source prints
    unit: str                        # what it is
    bound: str                       # "compute" or "communication": which tolerance applies
    layout: dict = field(default_factory=dict)   # TrainConfig fields (a GPT shape in overrides)
    params: float = 0.0              # the model's parameters, as the source counts them
    gpus_per_node: int = 8
    metric: str = "tokens_per_gpu"   # how the step time becomes ``reported`` (see predict)
    collective: tuple = ()           # for a bus-bandwidth figure: (op, bytes, ranks)

    @property
    def tolerance(self) -> float:
        return 0.20 if self.bound == "compute" else 0.30


def _gpt(n_layer, n_embd, n_head, vocab, seq) -> dict:
    return {"model": "gpt2-small", "seq_len": seq,
            "overrides": {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "vocab_size": vocab,
                          "block_size": seq}}


def _megatron_flops(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """FLOPs of one iteration as Megatron-LM counts them (Narayanan et al. 2021, eq. 3, with recomputation):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


RUNS = (
    Published(
        "GPT-3 175B, 1024 A100 (tp 8, pp 16, dp 8)",
        "Megatron-LM README (github.com/NVIDIA/Megatron-LM, commit e0097a0, 2024): examples/pretrain_gpt3_175B.sh "
        "on 1024 A100s, global batch 1536, 'each iteration takes around 32 seconds' (138 TFLOP/s per GPU)",
        "a100", 32.0, "seconds per iteration", "compute",
        dict(**_gpt(96, 12288, 96, 51200, 2048), dp=8, tp=8, pp=16, microbatches=192, batch_size=1536,
             precision="bf16", checkpoint_activations=True),
        params=174.6e9, metric="step_s"),
    Published(
        "GPT 1T, 3072 A100 (tp 8, pp 64, dp 6)",
        "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
        "SC21, Table 1: 128 layers of 25600, 160 heads, batch 3072: 163 TFLOP/s per GPU (52 % of peak)",
        "a100", 163e12, "FLOP/s per GPU (Megatron's count)", "compute",
        dict(**_gpt(128, 25600, 160, 51200, 2048), dp=6, tp=8, pp=64, microbatches=512, batch_size=3072,
             precision="bf16", checkpoint_activations=True),
        params=1008e9, metric="megatron_flops"),
    Published(
        "Llama 3 8B, 64 A100 (FSDP)",
        "torchtitan docs/performance.md (github.com/pytorch/torchtitan): Llama 3 8B, FSDP2 on 64 A100 80GB, "
        "local batch 1, selective op activation checkpointing: 2,973 tokens/s per GPU (MFU 58.2 %)",
        "a100", 2973.0, "tokens/s per GPU", "compute",
        dict(**_gpt(32, 4096, 32, 128256, 8192), dp=64, zero=3, batch_size=64, precision="bf16"),
        params=8.03e9),
    Published(
        "Llama 3.1 8B, 8 H100 (FSDP)",
        "torchtitan docs/performance.md: Llama 3.1 8B, FSDP on 8 H100 (96 GB HBM2e, 500 W), local batch 2, "
        "selective activation checkpointing, eager: 5,762 tokens/s per GPU",
        "h100", 5762.0, "tokens/s per GPU", "compute",
        dict(**_gpt(32, 4096, 32, 128256, 8192), dp=8, zero=3, batch_size=16, precision="bf16"),
        params=8.03e9),
    Published(
        "all-reduce bus bandwidth, 8 A100 (NVLink 3)",
        "nccl-tests all_reduce_perf on 8 A100 SXM4 (NVSwitch), large messages: 230-250 GB/s bus bandwidth "
        "(reference table, 'NCCL-tests in practice', docs.alayanew.com, 2026)",
        "a100", 240e9, "bytes/s bus bandwidth", "communication", metric="bus_bandwidth",
        collective=("all_reduce", 8 << 30, 8)),
    Published(
        "all-reduce bus bandwidth, 8 H100 (NVLink 4)",
        "nccl-tests all_reduce_perf on 8 H100 SXM5 (NVSwitch), large messages: 460-480 GB/s bus bandwidth "
        "(same reference table; NCCL uses NVLink SHARP there, which the model does not)",
        "h100", 470e9, "bytes/s bus bandwidth", "communication", metric="bus_bandwidth",
        collective=("all_reduce", 8 << 30, 8)),
)


def predict(run: Published) -> float:
    """The model's value of ``run.reported``."""
    gpu = get_gpu(run.gpu)
    if run.metric == "bus_bandwidth":
        op, nbytes, n = run.collective
        return Cluster(gpu, run.gpus_per_node).bus_bandwidth(op, nbytes, n)
    cfg = TrainConfig(**run.layout)
    t = step_time(cfg, int(run.params), gpu, run.gpus_per_node)
    if run.metric == "step_s":
        return t["step_s"]
    if run.metric == "megatron_flops":
        ov = run.layout["overrides"]
        flops = _megatron_flops(cfg.batch_size, cfg.seq_len, ov["n_layer"], ov["n_embd"], ov["vocab_size"])
        return flops / (t["step_s"] * cfg.world_size)
    return t["tokens_per_s"] / cfg.world_size


def compare() -> list[dict]:
    """Every published run: reported, predicted, relative error and the tolerance it is held to."""
    rows = []
    for run in RUNS:
        got = predict(run)
        rows.append({"name": run.name, "gpu": run.gpu, "unit": run.unit, "reported": run.reported,
                     "predicted": got, "error": (got - run.reported) / run.reported, "bound": run.bound,
                     "tolerance": run.tolerance, "source": run.source})
    return rows


def _show(value: float, unit: str) -> str:
    if unit.startswith("bytes/s"):
        return f"{value / 1e9:.0f} GB/s"
    if unit.startswith("FLOP/s"):
        return f"{value / 1e12:.0f} TFLOP/s"
    if unit.startswith("seconds"):
        return f"{value:.1f} s"
    return f"{value:,.0f} tokens/s"


def markdown_table() -> str:
    """The comparison as the Markdown table docs/modeled-timing.md prints (a test keeps the two equal)."""
    lines = ["| published run | reported | modeled | error | held to |", "|---|---|---|---|---|"]
    for r in compare():
        lines.append(f"| {r['name']} | {_show(r['reported'], r['unit'])} | {_show(r['predicted'], r['unit'])} | "
                     f"{r['error']:+.1%} | ±{r['tolerance']:.0%} ({r['bound']}) |")
    return "\n".join(lines)
