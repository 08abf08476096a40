"""Published runs the cost model is checked against: configurations from papers and official pages, and what
they measured.

Each :class:`Published` names its source, the layout (on paper: :func:`gpucourse.modeled.plan.step_time` times it
with the same :class:`~gpucourse.modeled.cluster.Cluster` that replays recorded runs), the framework whose overlap it
ran with, the figure the source reports, how to turn the model's step time into that figure, and the set it
belongs to. The table was split into a fitting and a held-out set before any constant was tuned: :func:`fit`
tunes a GPU's fitted constants (:data:`FITTED`) on its fitting runs alone; :func:`compare` predicts every run,
:func:`errors` gives the figures ``gpucourse bench`` reports, and ``tests/test_published.py`` holds the model to
15 % on the fitting set (20 % on B200's) and 25 % on the held-out one. :func:`agreement` asks the planner to rank
the layouts the sources chose. ``docs/modeled-timing.md`` prints both tables.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
from dataclasses import dataclass, field

from ..config import TrainConfig
from .cluster import Cluster
from .gpus import GPUSpec, get_gpu
from .plan import RECOMPUTE_NOTE, step_time
from .shapes import get_shape


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
    shape: str = ""                  # the model's own shape (gpucourse.modeled.shapes.SHAPES); "": the layout's course GPT
    framework: str = ""              # whose overlap of communication (gpucourse.modeled.plan.FRAMEWORKS); "": the default
    split: str = "heldout"           # "fit": constants may be tuned on it; "heldout": only ever checked
    choice: str = ""                 # where the source compared layouts: the one it chose, and against what
    chosen: tuple = ()               # that choice as (field, value) pairs a planned row must match (see agreement)
    ends_as_layers: bool = False     # the embedding and the loss each take a layer's place in the pipeline's split
    matmuls: str = ""                # what the matmuls multiply in, when not the layout's precision ("fp8")
    assumed: str = ""                # what the source leaves out of the setting, and what the row takes for it
    fp8_params: bool = False         # the matmul weights held in fp8 themselves (Megatron-Core's fp8_param_gather)
    fp32_grads: bool | None = None   # the gradients in fp32 (True) or bf16 (False) where the run sets it; None: the
                                     # framework's own (gpucourse.modeled.plan.Overlap.fp32_grads)

    @property
    def tolerance(self) -> float:
        """What the model is held to on this run: 15 % on the fitting set (20 % on B200's, whose five rows hold the
        same Llama 3 8B layout at three NeMo releases, 26,006 to 30,624 tokens/s, which no constant fits at once),
        25 % on the held-out set."""
        if self.split != "fit":
            return 0.25
        return 0.20 if self.gpu == "b200" else 0.15

    @property
    def kind(self) -> str:
        """What the run exercises: "collective", "moe", "zero3" (or FSDP), "cp" (long context), "tp×pp", "dp"."""
        if self.metric == "bus_bandwidth":
            return "collective"
        layout = self.layout
        if layout.get("overrides", {}).get("moe_experts"):
            return "moe"
        if layout.get("zero") == 3:
            return "zero3"
        if layout.get("cp", 1) > 1:
            return "cp"
        return "tp×pp" if layout.get("tp", 1) * layout.get("pp", 1) > 1 else "dp"


def _gpt(n_layer, n_embd, n_head, vocab, seq) -> dict:
    return {"model": "gpt2-small", "seq_len": seq,
            "overrides": {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "vocab_size": vocab,
                          "block_size": seq}}


def _megatron_flops(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """FLOPs of one iteration as Megatron-LM counts them (Narayanan et al. 2021, eq. 3, with recomputation):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


SC21 = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM "
        "(SC21, arXiv:2104.04473)")
MCORE_H100 = ("Megatron-LM README (github.com/NVIDIA/Megatron-LM), weak-scaling table of GPT models on H100 "
              "(images/model_table.png): sequence 4096, vocabulary 131072")
LLAMA3 = "Llama 3 Herd of Models (Dubey et al. 2024, arXiv:2407.21783), Table 4"
# Its section 3.3.2 says how the 405B ran besides: no activation checkpointing at 8K tokens, and a Transformer layer
# fewer on the first and the last pipeline stage, where the embedding and the loss go (``ends_as_layers``).
FOUNDRY = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md: MFU tables (FSDP FULL_SHARD, FlashAttention; "
           "MFU = (6·N + 12·L·C·T per token) over the bf16 peak)")
MEGASCALE = "Jiang et al. 2024, MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs (NSDI), Table 2"
# Megatron-LM's --hidden-dropout and --attention-dropout default to 0.1 and the Megatron rows' sources do not change
# them: their layers keep dropout's masks (what the memory model counts; the timing model does not read it).
MEGATRON_DROPOUT = 0.1


def _chose(tp: int, pp: int, at_scale: bool) -> dict:
    """A layout its authors chose at scale (512 GPUs or more): the planner should rank its tp × pp first or near."""
    if not at_scale:
        return {}
    return {"choice": f"tp {tp} × pp {pp}", "chosen": (("tp", tp), ("pp", pp))}


def _sc21(layers, hidden, heads, tp, pp, dp, batch, tflops, split, v=0, name=""):
    """A run of SC21's Table 1 (weak scaling, PTD-P with full recomputation, microbatches of one sequence):
    Megatron-LM's own FLOP count per GPU."""
    sched = dict(schedule="interleaved-1f1b", virtual_stages=v) if v else {}
    m = batch // dp
    grid = dict(microbatches=m) if pp > 1 else dict(grad_accum=m)
    return Published(
        name or f"GPT {layers}×{hidden}, {tp * pp * dp} A100 (tp {tp}, pp {pp}, dp {dp})",
        f"{SC21}, Table 1: {layers} layers, hidden {hidden}, {heads} heads, tp {tp}, pp {pp}, {tp * pp * dp} GPUs, "
        f"batch {batch}: {tflops} TFLOP/s per GPU. Microbatches of one sequence and "
        + (f"the interleaved schedule with {v} chunks per rank " if v else "") + "assumed (not in the table)",
        "a100", tflops * 1e12, "FLOP/s per GPU (Megatron's count)", "compute",
        dict(**_gpt(layers, hidden, heads, 51200, 2048), dp=dp, tp=tp, pp=pp, batch_size=batch,
             precision="bf16", master_weights=True, dropout=MEGATRON_DROPOUT,
             checkpoint_activations=True, **grid, **sched),
        params=12 * layers * hidden**2 + 51200 * hidden, metric="megatron_flops", framework="megatron-2021",
        split=split, **_chose(tp, pp, at_scale=tp * pp * dp >= 512))


def _zero3_2021(layers, hidden, heads, gpus, batch, micro, tflops, split, chosen=False):
    """SC21's Table 2: ZeRO-3 (DeepSpeed) without model parallelism, against PTD-P."""
    return Published(
        f"GPT {12 * layers * hidden**2 / 1e9:.0f}B ZeRO-3, {gpus} A100 (microbatch {micro})",
        f"{SC21}, Table 2 (ZeRO-3 without model parallelism): batch {batch}, {gpus} GPUs, microbatch {micro}: "
        f"{tflops} TFLOP/s per GPU. 'by doubling the number of GPUs (keeping the batch size the same), PTD-P "
        "outperforms ZeRO-3 by 70% for both models due to less cross-node communication'",
        "a100", tflops * 1e12, "FLOP/s per GPU (Megatron's count)", "communication",
        dict(**_gpt(layers, hidden, heads, 51200, 2048), dp=gpus, zero=3, batch_size=batch,
             grad_accum=batch // (gpus * micro), precision="bf16", master_weights=True, checkpoint_activations=True),
        params=12 * layers * hidden**2 + 51200 * hidden, metric="megatron_flops", framework="deepspeed-zero3",
        split=split, choice="tp × pp (PTD-P) over ZeRO-3 at the same GPUs and batch" if chosen else "",
        chosen=(("model_parallel", True),) if chosen else ())


def _mcore(params_b, layers, hidden, heads, tp, pp, batch, tflops, split, v=0):
    """A row of Megatron-LM's H100 weak-scaling table (dp 48; microbatches of one, sequence parallelism and the
    distributed optimizer assumed)."""
    dp = 48
    sched = dict(schedule="interleaved-1f1b", virtual_stages=v) if v else {}
    m = batch // dp
    grid = dict(microbatches=m) if pp > 1 else dict(grad_accum=m)
    return Published(
        f"GPT {params_b}B, {tp * pp * dp} H100 (tp {tp}, pp {pp}, dp {dp})",
        f"{MCORE_H100}: {params_b}B, {layers} layers, hidden {hidden}, {heads} heads, tp {tp}, pp {pp}, dp 48, "
        f"batch {batch}: {tflops} TFLOP/s per GPU; data-, tensor- and pipeline-parallel communication overlapped "
        f"('--overlap-grad-reduce --overlap-param-gather', '--tp-comm-overlap'). Microbatches of one sequence"
        + (f", the interleaved schedule with {v} chunks per rank" if v else "") + " assumed (not in the table)",
        "h100", tflops * 1e12, "FLOP/s per GPU (model FLOPs)", "compute",
        dict(**_gpt(layers, hidden, heads, 131072, 4096), dp=dp, tp=tp, pp=pp, batch_size=batch,
             precision="bf16", master_weights=True, dropout=MEGATRON_DROPOUT,
             sequence_parallel=tp > 1, zero=1, **grid, **sched),
        params=12 * layers * hidden**2 + 2 * 131072 * hidden, metric="model_flops",
        framework="megatron-core-tp-overlap", split=split, **_chose(tp, pp, at_scale=tp * pp * dp >= 512))


def _foundry(name, layers, hidden, heads, gpu, gpus, seq, micro, accum, mfu, ckpt, split):
    """A row of llm-foundry's MFU tables (MPT: the course's block, vocabulary 50368)."""
    return Published(
        f"{name}, {gpus} {gpu.upper()} (FSDP, {seq} tokens)",
        f"{FOUNDRY}: {name} ({layers} layers, d_model {hidden}), {gpus} × {gpu}_80gb, seq {seq}, microbatch {micro}, "
        f"gradient accumulation {accum}, activation checkpointing {ckpt}: MFU {mfu} %",
        gpu, mfu / 100, "MFU", "compute",
        dict(**_gpt(layers, hidden, heads, 50368, seq), dp=gpus, zero=3, batch_size=gpus * micro * accum,
             grad_accum=accum, precision="bf16", checkpoint_activations=ckpt),
        params=12 * layers * hidden**2 + 50368 * hidden, metric="mfu", framework="fsdp", split=split)


def _bus(name: str, source: str, gpu: str, GBps: float, ranks: int, split: str = "heldout") -> Published:
    """An all-reduce's bus bandwidth as nccl-tests prints it, for 8 GiB on the first ``ranks`` GPUs."""
    return Published(name, source, gpu, GBps * 1e9, "bytes/s bus bandwidth", "communication", metric="bus_bandwidth",
                     collective=("all_reduce", 8 << 30, ranks), split=split)


def _megascale(dp: int, batch: int, mfu: float) -> Published:
    """A Megatron-LM row of MegaScale's Table 2: 175B (96 layers, hidden 12288, 128 heads, vocabulary 64000, sequence
    2048), tp 8, pp 8, interleaved with 6 chunks a rank, microbatches of one sequence assumed."""
    return Published(
        f"GPT 175B, {64 * dp} A100 (Megatron-LM, tp 8, pp 8, dp {dp})",
        f"{MEGASCALE}: Megatron-LM on {64 * dp:,} Ampere GPUs, 175B (96 layers, hidden 12288, 128 heads, vocabulary "
        f"64000, sequence 2048), tp 8, pp 8, interleaved with 6 chunks, batch {batch}: MFU {mfu} %",
        "a100", mfu / 100, "MFU", "compute",
        dict(**_gpt(96, 12288, 128, 64000, 2048), dp=dp, tp=8, pp=8, microbatches=batch // dp, batch_size=batch,
             schedule="interleaved-1f1b", virtual_stages=6, precision="bf16", master_weights=True,
             sequence_parallel=True, dropout=MEGATRON_DROPOUT),
        params=174.6e9, metric="mfu", framework="megatron-core")


NEMO_2502 = ("NeMo Framework performance summary, container NeMo 25.02, 'Pretraining' (FP8, per-tensor scaling "
             "computed in the current step), docs.nvidia.com/nemo-framework/user-guide/latest/performance/"
             "performance_summary.html as published for 25.02")
BRIDGE_2509 = ("Megatron-Bridge docs/performance-summary.md, '25.09 NeMo Container' (github.com/NVIDIA-NeMo/"
               "Megatron-Bridge, commit fa0315a, 2025-10-10)")
BRIDGE_2511 = ("Megatron-Bridge docs/performance-summary.md, '25.11 NeMo Container' (github.com/NVIDIA-NeMo/"
               "Megatron-Bridge, commit 97ad8cc, 2025-12-04)")
# What the NeMo and Megatron-Bridge tables leave out, the same for each of their rows: the recipes' tensor-parallel
# communication overlap and sequence parallelism where tp > 1, the distributed optimizer, FlashAttention (cuDNN's
# fused attention through Transformer Engine) and no activation recomputation. The last is the recipes' own
# setting (NVIDIA/NeMo scripts/performance/recommended_model_configs/model_configs_b200.csv and _h100.csv, commit
# 96578928a7, 2025-04-07, the first with those columns: recompute_layers 0 and activation_offload_layers 0 on each
# of these layouts; at d26ad52, 2025-03-21, the recipes set no recomputation either).
# The same recipes keep the weights in fp8 and reduce the gradients in bf16 (fp8_params, fp32_grads False):
# - NeMo 25.02: scripts/performance/llm/pretrain_*.py (NVIDIA/NeMo d26ad52) take bf16_with_fp8_mixed()
#   (nemo/collections/llm/recipes/precision/mixed_precision.py: fp8_params=True, which MegatronMixedPrecision turns
#   into fp8_param_gather) and set grad_reduce_in_fp32 False, which MegatronStrategy copies into the DDP config;
# - Megatron-Bridge 25.09 (fa0315a): scripts/performance/configs/*/*.yaml set mixed_precision.grad_reduce_in_fp32
#   false, and utils/helpers.py's "cs" recipe is bf16_with_fp8_current_scaling_mixed()
#   (src/megatron/bridge/training/mixed_precision.py: fp8_param_gather=True; first_last_layers_bf16 set False);
# - Megatron-Bridge 25.11 (97ad8cc): scripts/performance/configs/llama/llama3(1)_llm_pretrain.py's common configs
#   set grad_reduce_in_fp32 False, utils/precision.py's fp8_cs the same current-scaling recipe.
NEMO_ASSUMED = ("sequence parallelism and --tp-comm-overlap where tp > 1, the distributed optimizer (ZeRO-1), fused "
                "attention and no activation recomputation; microbatches as the table's MBS; the recipes' weights "
                "in fp8 (fp8_param_gather) and gradients reduced in bf16 (grad_reduce_in_fp32 False)")
# The 25.09 table has no precision column; its footnote says the figures in parentheses use 32 × 32 block scaling.
BRIDGE_2509_ASSUMED = ("; FP8 with per-tensor current scaling for the figure outside the parentheses (the 25.11 "
                       "table labels the same rows 'FP8-CS (FP8-MX)')")
NEMOTRON_15B = {"layers": 32, "hidden": 6144, "heads": 48, "kv_heads": 8, "vocab": 256000}
# Nemotron-4 340B Technical Report (NVIDIA 2024, arXiv:2406.11704), Table 1: 96 layers, hidden 18432, 96 heads,
# 8 K/V heads, vocabulary 256000; its MLP is squared ReLU, 4 × hidden (73728).
NEMOTRON_340B = {"layers": 96, "hidden": 18432, "heads": 96, "kv_heads": 8, "vocab": 256000}


def _nemo(source: str, system: str, gpu: str, model: str, shape, params: float, gpus: int, batch: int,
          micro: int, seq: int, tp: int, pp: int, cp: int, v: int, tokens: float, split: str, zero: int = 1,
          precision: str = "FP8", assumed: str = "") -> Published:
    """A dense row of NVIDIA's NeMo / Megatron-Bridge performance tables: tokens/s per GPU of ``model`` on ``gpus``
    GPUs of ``system`` (DGX-B200, DGX-H100) at the table's layout, FP8 matmuls (Transformer Engine's recipe) with
    bf16 weights and fp32 master weights. ``precision``: what the table prints ("" where it prints none). Llama 3.1
    405B's embedding and loss each take a layer's place in the pipeline's split, as NeMo's recipe sets
    (nemo/collections/llm/recipes/llama31_405b.py: account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split, True)."""
    dp = gpus // (tp * pp * cp)
    m = batch // (dp * micro)
    sched = dict(schedule="interleaved-1f1b", virtual_stages=v) if pp > 1 and v > 1 else {}
    grid = dict(microbatches=m) if pp > 1 else dict(grad_accum=m)
    sizes = get_shape(shape)
    hidden, layers, heads, vocab = sizes.hidden, sizes.layers, sizes.heads, sizes.vocab
    layout = dict(**_gpt(layers, hidden, heads, vocab, seq), dp=dp, tp=tp, pp=pp, cp=cp, batch_size=batch,
                  precision="bf16", master_weights=True, sequence_parallel=tp > 1, zero=zero, zigzag=cp > 1,
                  **grid, **sched)
    return Published(
        f"{model}, {gpus} {gpu.upper()} {precision or 'FP8'} (tp {tp}, pp {pp}" + f", cp {cp}" * (cp > 1)
        + f", dp {dp})",
        f"{source}, System: {system}: {model}, {gpus} GPUs, " + f"precision {precision}, " * bool(precision)
        + f"GBS {batch}, MBS {micro}, sequence {seq}, TP {tp}, PP {pp}, CP {cp}, VP {v if pp > 1 else 'n/a'}, GA {m}"
        + (", FSDP" if zero == 3 else "") + f": {tokens:,} tokens/s per GPU",
        gpu, float(tokens), "tokens/s per GPU", "compute", layout, params=params,
        shape=shape, framework="megatron-core-tp-overlap" if tp > 1 else "megatron-core", split=split,
        ends_as_layers=shape == "llama3-405b", matmuls="fp8", assumed=NEMO_ASSUMED + assumed, fp8_params=True,
        fp32_grads=False)


def _moe(layout: dict, experts: int, top_k: int) -> dict:
    return {**layout, "overrides": {**layout["overrides"], "moe_experts": experts, "moe_top_k": top_k}}


RUNS = tuple([
    # --- A100: Megatron-LM (SC21), tensor × pipeline parallelism, 1.7B to 1T ---------------------------------------
    _sc21(24, 2304, 24, 1, 1, 32, 512, 137, "fit"),
    _sc21(30, 3072, 32, 2, 1, 32, 512, 138, "heldout"),
    _sc21(36, 4096, 32, 4, 1, 32, 512, 142, "heldout"),
    _sc21(40, 6144, 48, 8, 1, 32, 1024, 135, "fit"),
    _sc21(48, 8192, 64, 8, 2, 32, 1536, 138, "heldout", v=2),
    _sc21(60, 10240, 80, 8, 4, 32, 1792, 140, "heldout", v=3),
    _sc21(80, 12288, 96, 8, 8, 24, 2304, 148, "fit", v=2),
    _sc21(96, 16384, 128, 8, 16, 15, 2160, 155, "heldout", v=2),
    _sc21(105, 20480, 128, 8, 35, 9, 2520, 163, "heldout", v=3),
    _sc21(128, 25600, 160, 8, 64, 6, 3072, 163, "fit", v=2),
    # SC21, Table 2: the same 530B with fewer replicas (PTD-P side of the ZeRO-3 comparison).
    _sc21(105, 20480, 128, 8, 35, 2, 2240, 171, "heldout", v=3,
          name="GPT 530B, 560 A100 (tp 8, pp 35, dp 2; against ZeRO-3)"),
    _sc21(105, 20480, 128, 8, 35, 8, 2240, 159, "heldout", v=3,
          name="GPT 530B, 2240 A100 (tp 8, pp 35, dp 8; against ZeRO-3)"),
    # --- A100: ZeRO-3 without model parallelism (SC21, Table 2) --------------------------------------------------
    _zero3_2021(96, 12288, 96, 384, 1536, 4, 144, "heldout"),
    _zero3_2021(96, 12288, 96, 768, 1536, 2, 88, "fit", chosen=True),
    _zero3_2021(96, 12288, 96, 1536, 1536, 1, 44, "heldout", chosen=True),
    _zero3_2021(105, 20480, 128, 640, 2560, 4, 138, "heldout"),
    _zero3_2021(105, 20480, 128, 2240, 2240, 1, 48, "heldout", chosen=True),
    Published(
        "GPT-3 175B, 1024 A100 (tp 8, pp 16, dp 8)",
        "Megatron-LM README (github.com/NVIDIA/Megatron-LM, commit e0097a0, 2024): examples/pretrain_gpt3_175B.sh "
        "on 1024 A100s, global batch 1536, 'each iteration takes around 32 seconds' (138 TFLOP/s per GPU)",
        "a100", 32.0, "seconds per iteration", "compute",
        dict(**_gpt(96, 12288, 96, 51200, 2048), dp=8, tp=8, pp=16, microbatches=192, batch_size=1536,
             precision="bf16", master_weights=True, checkpoint_activations=True),
        params=174.6e9, metric="step_s", framework="megatron-2021"),
    _megascale(192, 6144, 41.2),
    _megascale(4, 768, 53.0),
    # --- A100: FSDP ----------------------------------------------------------------------------------------------
    _foundry("MPT-70B", 80, 8192, 64, "a100", 64, 2048, 8, 4, 53.33, True, "fit"),
    _foundry("MPT-13B", 40, 5120, 40, "a100", 8, 4096, 10, 3, 57.62, True, "heldout"),
    _foundry("MPT-7B", 32, 4096, 32, "a100", 8, 65536, 1, 2, 46.97, True, "heldout"),
    Published(
        "Llama 3 8B, 64 A100 (FSDP)",
        "torchtitan docs/performance.md (github.com/pytorch/torchtitan): Llama 3 8B, FSDP2 on 64 A100 80GB, "
        "local batch 1, selective op activation checkpointing: 2,973 tokens/s per GPU (MFU 58.2 %)",
        "a100", 2973.0, "tokens/s per GPU", "compute",
        dict(**_gpt(32, 4096, 32, 128256, 8192), dp=64, zero=3, batch_size=64, precision="bf16"),
        params=8.03e9, shape="llama3-8b", framework="fsdp"),
    # --- H100: Megatron-Core weak scaling ---------------------------------------------------------------------------
    _mcore(1.7, 24, 2048, 16, 1, 1, 192, 408.8, "fit"),
    _mcore(7.1, 30, 4096, 32, 2, 1, 192, 465.9, "heldout"),
    _mcore(16, 32, 6144, 48, 4, 1, 192, 489.1, "fit"),
    _mcore(32, 48, 7168, 56, 8, 1, 192, 459.6, "heldout"),
    _mcore(70, 84, 8192, 64, 8, 2, 384, 419.7, "heldout", v=2),
    _mcore(119, 92, 10240, 80, 8, 4, 768, 420.5, "heldout"),
    _mcore(177, 96, 12288, 96, 8, 6, 1152, 432.8, "fit", v=2),
    _mcore(314, 96, 16384, 128, 8, 8, 1536, 474.4, "heldout", v=2),
    _mcore(462, 112, 18432, 144, 8, 16, 3072, 459.9, "fit", v=7),
    # --- H100: Llama 3 405B -------------------------------------------------------------------------------------------
    Published(
        "Llama 3 405B, 8192 H100 (tp 8, pp 16, dp 64)",
        f"{LLAMA3}: 8,192 GPUs, tp 8, cp 1, pp 16, dp 64, sequence 8192, batch 32 a data-parallel group, 16M tokens "
        "a batch: 430 TFLOP/s per GPU (BF16 MFU 43 %). Interleaved schedule with 2 chunks a rank assumed",
        "h100", 430e12, "FLOP/s per GPU (model FLOPs)", "compute",
        dict(**_gpt(126, 16384, 128, 128256, 8192), dp=64, tp=8, pp=16, microbatches=32, batch_size=2048,
             schedule="interleaved-1f1b", virtual_stages=2, precision="bf16", master_weights=True,
             sequence_parallel=True, zero=2),
        params=405e9, metric="model_flops", shape="llama3-405b", framework="megatron-core", ends_as_layers=True,
        split="fit",
        choice="tp 8 × pp 16 (no cp) at 8192 tokens", chosen=(("tp", 8), ("pp", 16), ("cp", 1))),
    Published(
        "Llama 3 405B, 16384 H100 (tp 8, pp 16, dp 128)",
        f"{LLAMA3}: 16,384 GPUs, tp 8, cp 1, pp 16, dp 128, sequence 8192, batch 16 a data-parallel group: "
        "400 TFLOP/s per GPU (BF16 MFU 41 %)",
        "h100", 400e12, "FLOP/s per GPU (model FLOPs)", "compute",
        dict(**_gpt(126, 16384, 128, 128256, 8192), dp=128, tp=8, pp=16, microbatches=16, batch_size=2048,
             schedule="interleaved-1f1b", virtual_stages=2, precision="bf16", master_weights=True,
             sequence_parallel=True, zero=2),
        params=405e9, metric="model_flops", shape="llama3-405b", framework="megatron-core", ends_as_layers=True,
        choice="tp 8 × pp 16 (no cp) at 8192 tokens", chosen=(("tp", 8), ("pp", 16), ("cp", 1))),
    Published(
        "Llama 3 405B, 16384 H100, 131072 tokens (tp 8, cp 16, pp 16, dp 8)",
        f"{LLAMA3}: 16,384 GPUs, tp 8, cp 16, pp 16, sequence 131072, batch 16 a data-parallel group, 16M tokens a "
        "batch: 380 TFLOP/s per GPU (BF16 MFU 38 %). The table prints dp 4, which gives 8,192 GPUs and 8M tokens; "
        "dp 8 matches both its GPUs and its tokens",
        "h100", 380e12, "FLOP/s per GPU (model FLOPs)", "compute",
        dict(**_gpt(126, 16384, 128, 128256, 131072), dp=8, tp=8, cp=16, pp=16, microbatches=16, batch_size=128,
             zigzag=True, schedule="interleaved-1f1b", virtual_stages=2, precision="bf16", master_weights=True,
             sequence_parallel=True,
             zero=2),
        params=405e9, metric="model_flops", shape="llama3-405b", framework="megatron-core", ends_as_layers=True,
        choice="tp 8 × cp 16 × pp 16 at 131072 tokens", chosen=(("tp", 8), ("pp", 16), ("cp", 16))),
    # --- H100: FSDP (llm-foundry) ---------------------------------------------------------------------------------
    _foundry("MPT-70B", 80, 8192, 64, "h100", 512, 2048, 8, 1, 41.25, True, "fit"),
    _foundry("MPT-70B", 80, 8192, 64, "h100", 128, 2048, 8, 1, 43.36, True, "heldout"),
    _foundry("MPT-7B", 32, 4096, 32, "h100", 512, 2048, 6, 1, 42.2, False, "heldout"),
    _foundry("MPT-30B", 48, 7168, 56, "h100", 8, 8192, 1, 21, 29.92, True, "heldout"),
    _foundry("MPT-7B", 32, 4096, 32, "h100", 8, 65536, 1, 2, 28.59, True, "heldout"),
    _foundry("MPT-13B", 40, 5120, 40, "h100", 8, 32768, 1, 3, 31.68, True, "heldout"),
    # --- H100: a mixture of experts, and a GQA model on tp 8 ------------------------------------------------------
    Published(
        "Mixtral 8x7B, 64 H100 (ep 8, pp 4, dp 16)",
        "Megatron-LM megatron/core/transformer/moe/README.md: Mixtral 8x7B dropless, 64 H100, tp 1, ep 8, pp 4 "
        "with 8 virtual stages, microbatch 1, batch 256, sequence 4096: 468 TFLOP/s per GPU (MCore v0.9). "
        "'For Mixtral 8x7B, EP8xTP1 outperforms EP4xTP2'",
        "h100", 468e12, "FLOP/s per GPU (model FLOPs)", "compute",
        dict(**_moe(_gpt(32, 4096, 32, 32000, 4096), 8, 2), dp=16, ep=8, pp=4, microbatches=16,
             batch_size=256, schedule="interleaved-1f1b", virtual_stages=8, precision="bf16",
             master_weights=True, zero=1),
        params=46.7e9, metric="model_flops", shape="mixtral-8x7b", framework="megatron-core",
        choice="ep 8 × tp 1 × pp 4 (EP8xTP1 over EP4xTP2)", chosen=(("tp", 1), ("ep", 8), ("pp", 4))),
    Published(
        "Nemotron-4 15B, 768 H100 (tp 8, dp 96)",
        "Nemotron-4 15B Technical Report (Parmar et al. 2024, arXiv:2402.16819), Table 2: 768 GPUs, tp 8, dp 96, "
        "batch 384, sequence 4096 (32 layers, hidden 6144, 48 heads, 8 K/V heads, squared-ReLU MLP 4×, "
        "vocabulary 256000): MFU 34.3 %",
        "h100", 0.343, "MFU", "compute",
        dict(**_gpt(32, 6144, 48, 256000, 4096), dp=96, tp=8, grad_accum=4, batch_size=384, precision="bf16",
             master_weights=True,
             sequence_parallel=True, zero=1),
        params=15.7e9, metric="mfu", framework="megatron-core",
        shape={"layers": 32, "hidden": 6144, "heads": 48, "kv_heads": 8, "vocab": 256000}),
    # --- B200 and H100 in FP8: NVIDIA's NeMo and Megatron-Bridge performance tables -------------------------------
    # The split was set before any of these rows was compared with the model, by a rule blind to errors: the B200
    # rows alternate within each source's table, in its order, starting with a fitting row (B200's fitted constants
    # come from those alone); the H100 rows are all held out (H100's constants were fitted on the runs above).
    _nemo(NEMO_2502, "DGX-B200", "b200", "GPT3-175B", "gpt3-175b", 175e9, 512, 2048, 2, 2048, 4, 4, 1, 6, 1600,
          "fit"),
    _nemo(NEMO_2502, "DGX-B200", "b200", "LLAMA3-8B", "llama3-8b", 8.03e9, 8, 128, 2, 8192, 1, 1, 1, 1, 26006,
          "heldout"),
    _nemo(NEMO_2502, "DGX-B200", "b200", "LLAMA3-70B", "llama3-70b", 70.6e9, 64, 128, 1, 8192, 2, 4, 2, 5, 3062,
          "fit"),
    _nemo(NEMO_2502, "DGX-B200", "b200", "LLAMA3-405B", "llama3-405b", 405e9, 128, 64, 1, 8192, 4, 8, 2, 8, 625,
          "heldout"),
    _nemo(NEMO_2502, "DGX-B200", "b200", "Nemotron-15B", NEMOTRON_15B, 15.7e9, 64, 256, 2, 4096, 1, 1, 1, 1, 14760,
          "fit"),
    _nemo(NEMO_2502, "DGX-B200", "b200", "Nemotron-340B", NEMOTRON_340B, 341e9, 128, 32, 1, 4096, 8, 4, 1, 12, 602,
          "heldout"),
    _nemo(NEMO_2502, "DGX-H100", "h100", "GPT3-175B", "gpt3-175b", 175e9, 512, 2048, 2, 2048, 4, 8, 1, 6, 866,
          "heldout"),
    _nemo(BRIDGE_2509, "DGX-B200", "b200", "LLAMA3_8B", "llama3-8b", 8.03e9, 8, 128, 2, 8192, 1, 1, 1, 1, 29994,
          "fit", precision="", assumed=BRIDGE_2509_ASSUMED),
    _nemo(BRIDGE_2509, "DGX-B200", "b200", "LLAMA3.1_405B", "llama3-405b", 405e9, 128, 64, 1, 8192, 4, 8, 2, 8, 664,
          "heldout", precision="", assumed=BRIDGE_2509_ASSUMED),
    _nemo(BRIDGE_2509, "DGX-H100", "h100", "LLAMA3_8B", "llama3-8b", 8.03e9, 8, 128, 1, 8192, 1, 1, 1, 1, 14079,
          "heldout", zero=3, precision="", assumed=BRIDGE_2509_ASSUMED),
    _nemo(BRIDGE_2509, "DGX-H100", "h100", "LLAMA3_70B", "llama3-70b", 70.6e9, 64, 128, 1, 8192, 4, 8, 1, 5, 1619,
          "heldout", precision="", assumed=BRIDGE_2509_ASSUMED),
    _nemo(BRIDGE_2509, "DGX-H100", "h100", "LLAMA3.1_405B", "llama3-405b", 405e9, 1024, 512, 1, 8192, 8, 8, 2, 8, 302,
          "heldout", precision="", assumed=BRIDGE_2509_ASSUMED),
    _nemo(BRIDGE_2511, "DGX-B200", "b200", "LLAMA3_8B", "llama3-8b", 8.03e9, 8, 128, 2, 8192, 1, 1, 1, 1, 30624,
          "fit", precision="FP8-CS"),
    _nemo(BRIDGE_2511, "DGX-B200", "b200", "LLAMA3.1_405B", "llama3-405b", 405e9, 128, 64, 1, 8192, 4, 8, 2, 8, 661,
          "heldout", precision="FP8-CS"),
    _nemo(BRIDGE_2511, "DGX-H100", "h100", "LLAMA3_8B", "llama3-8b", 8.03e9, 8, 128, 1, 8192, 1, 1, 1, 1, 14451,
          "heldout", zero=3, precision="FP8-CS"),
    _nemo(BRIDGE_2511, "DGX-H100", "h100", "LLAMA3_70B", "llama3-70b", 70.6e9, 64, 128, 1, 8192, 4, 8, 1, 5, 1602,
          "heldout", precision="FP8-CS"),
    _nemo(BRIDGE_2511, "DGX-H100", "h100", "LLAMA3.1_405B", "llama3-405b", 405e9, 1024, 512, 1, 8192, 8, 8, 2, 8, 292,
          "heldout", precision="FP8-CS"),
    # --- collectives ----------------------------------------------------------------------------------------------
    _bus("all-reduce bus bandwidth, 8 A100 (NVLink 3)",
         "nccl-tests all_reduce_perf on 8 A100 SXM4 (NVSwitch), large messages: 230-250 GB/s bus bandwidth "
         "(reference table, 'NCCL-tests in practice', docs.alayanew.com, 2026)", "a100", 240, 8, "fit"),
    _bus("all-reduce bus bandwidth, 8 H100 (NVLink 4)",
         "nccl-tests all_reduce_perf on 8 H100 SXM5 (NVSwitch), large messages: 460-480 GB/s bus bandwidth "
         "(same reference table; NCCL uses NVLink SHARP there, which the model does not)", "h100", 470, 8),
    _bus("all-reduce bus bandwidth, DGX A100 servers (8 × 200 Gb/s each)",
         "NVIDIA/nccl issue #812, a maintainer: 'On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we "
         "measure 192GB/s AllReduce BusBW' (across servers; four of them here)", "a100", 192, 32),
    _bus("all-reduce bus bandwidth, DGX H100 servers (8 × 400 Gb/s each)",
         "NVIDIA/nccl-tests issue #290, a maintainer: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC': eight "
         "cards a server, 376 GB/s (four servers here)", "h100", 376, 32),
])


# Rows of the same sources left out, and why: each names the table and what the model cannot take or the source
# does not give.
EXCLUDED = (
    ("NeMo 25.02, DGX-B200 and DGX-H100: Mixtral-8x7B, Mixtral-8x22B",
     "mixtures of experts whose token routing the tables do not state (dropless or capped); the B200 rows are FP8 "
     "with experts in grouped GEMMs the model times as one"),
    ("NeMo 25.02, DGX-H100: the rows after GPT3-175B",
     "the stored copy of the page is cut after the first H100 row; no figure is taken from memory"),
    ("Megatron-Bridge 25.09/25.11, DGX-B200 and DGX-H100: DeepSeekV3, Qwen3 30B-A3B and 235B-A22B, GPT OSS 120B",
     "mixtures of experts with token dropping, multi-head latent attention or sliding-window attention, which the "
     "model's shapes do not have; GPT OSS 120B is the only B200 BF16 row of these tables"),
    ("Megatron-Bridge 25.09/25.11, the figures in parentheses (MXFP8)",
     "block-scaled FP8 (32 × 32), another GEMM than the per-tensor FP8 the rows take"),
    ("H200: no NeMo, Megatron-Bridge or Megatron-LM table of training throughput on H200",
     "MLPerf Training prints minutes to a quality target, not a step's time at a stated layout"),
)


METRICS = {
    "step_s": "seconds per iteration",
    "tokens_per_gpu": "tokens per second per GPU",
    "megatron_flops": "FLOP/s per GPU as Megatron-LM counts them (Narayanan et al. 2021, eq. 3)",
    "model_flops": "FLOP/s per GPU of 6·N + 12·L·C·T per token (PaLM's count; no causal halving)",
    "mfu": "model FLOP/s (PaLM's count) over the GPUs' bf16 peak",
    "bus_bandwidth": "nccl-tests bus bandwidth",
}


def predict(run: Published, gpu: GPUSpec | None = None) -> float:
    """The model's value of ``run.reported`` (``gpu``: a GPUSpec to use instead of the table's, as the fit does)."""
    gpu = gpu or get_gpu(run.gpu)
    if run.metric == "bus_bandwidth":
        op, nbytes, n = run.collective
        return Cluster(gpu, run.gpus_per_node).bus_bandwidth(op, nbytes, n)
    cfg = TrainConfig(**run.layout)
    t = step_time(cfg, int(run.params), gpu, run.gpus_per_node, shape=run.shape or None,
                  framework=run.framework or None, matmuls=run.matmuls or None)
    if run.metric == "step_s":
        return t.step_s
    if run.metric == "megatron_flops":
        ov = run.layout["overrides"]
        flops = _megatron_flops(cfg.batch_size, cfg.seq_len, ov["n_layer"], ov["n_embd"], ov["vocab_size"])
        return flops / (t.step_s * cfg.world_size)
    if run.metric == "model_flops":
        return t.model_flops / (t.step_s * cfg.world_size)
    if run.metric == "mfu":
        return t.mfu
    if run.metric != "tokens_per_gpu":
        raise ValueError(f"no metric {run.metric!r}; known: {', '.join(METRICS)}.")
    return t.tokens_per_s / cfg.world_size


def memory(run: Published) -> dict:
    """What each GPU of ``run`` holds by the memory model, as the run's framework keeps it
    (:func:`gpucourse.modeled.plan.memory_of`), beside what the card leaves a run (``usable``) and whether it fits."""
    from .plan import DEFAULT_FRAMEWORK, memory_of
    from .shapes import get_shape

    cfg = TrainConfig(**run.layout)
    shape = get_shape(run.shape or {k: v for k, v in cfg.overrides.items() if k != "block_size"})
    mem = memory_of(cfg, shape, framework=run.framework or DEFAULT_FRAMEWORK, fp8=run.matmuls == "fp8",
                    ends_as_layers=run.ends_as_layers, gpu=run.gpu, fp8_params=run.fp8_params,
                    fp32_grads=run.fp32_grads)
    usable = get_gpu(run.gpu).usable_bytes()
    return {**mem, "name": run.name, "usable": usable, "fits": mem["max_total"] <= usable}


def memory_fits(runs=None) -> list[dict]:
    """:func:`memory` of every published training run (or ``runs``): every layout in the table ran, so each must
    fit its GPU."""
    return [memory(run) for run in (RUNS if runs is None else runs) if run.metric != "bus_bandwidth"]


def compare(runs=None, gpus: dict | None = None) -> list[dict]:
    """Every published run (or ``runs``): reported, predicted, relative error, the tolerance it is held to and
    whether it is in the fitting or the held-out set. ``gpus``: GPUSpecs by name to use instead of the table's."""
    rows = []
    for run in RUNS if runs is None else runs:
        got = predict(run, (gpus or {}).get(run.gpu))
        rows.append({"name": run.name, "gpu": run.gpu, "unit": run.unit, "reported": run.reported,
                     "predicted": got, "error": (got - run.reported) / run.reported, "bound": run.bound,
                     "tolerance": run.tolerance, "source": run.source, "split": run.split,
                     "fp8": run.matmuls == "fp8"})
    return rows


def errors(rows=None) -> dict:
    """The figures ``gpucourse bench`` reports: the largest error on the fitting set, the largest and median on
    the held-out set, and the largest on the held-out B200 runs with fp8 matmuls."""
    rows = compare() if rows is None else rows
    fit = [abs(r["error"]) for r in rows if r["split"] == "fit"]
    held = sorted(abs(r["error"]) for r in rows if r["split"] == "heldout")
    b200_fp8 = [abs(r["error"]) for r in rows if r["split"] == "heldout" and r["gpu"] == "b200" and r["fp8"]]
    return {"fit_max": max(fit), "heldout_max": max(held), "heldout_median": statistics.median(held),
            "heldout_max_b200_fp8": max(b200_fp8), "fit_runs": len(fit), "heldout_runs": len(held)}


# The constants tuned on the fitting set, per GPU, and the values tried (a grid: the fit is exhaustive and
# repeatable, and a test checks that the table holds its best point).
FITTED = {"sustained": (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0), "gemm_overhead_k": (0, 128, 256, 512, 768, 1024)}
# The fitted constants a GPU has measured instead: B200's tile cost comes from XLA's sm_100 matmul table
# (gpucourse.modeled.gpus), so its fit tunes sustained alone.
MEASURED = {"b200": ("gemm_overhead_k",)}


def fitted(gpu: str) -> dict:
    """The constants :func:`fit` tunes for ``gpu`` and the values it tries: :data:`FITTED` less its measured ones."""
    return {k: v for k, v in FITTED.items() if k not in MEASURED.get(gpu, ())}


def _matches(row: dict, chosen) -> bool:
    for key, value in chosen:
        if key == "model_parallel":
            if (row["tp"] * row["pp"] > 1 and row["zero"] < 3) != value:
                return False
        elif row.get(key, 1) != value:
            return False
    return True


def agreement(runs=None, within: float = 0.05) -> list[dict]:
    """For every run whose source chose a layout (``chosen``): ``gpucourse plan`` on the same model, GPUs, batch,
    sequence and framework, and whether the best fitting row that matches the published choice is first or within
    ``within`` of the first. Each row: name, the choice, the planner's first and the best matching row (their
    layouts and steps), their ratio and ``agrees``."""
    if runs is None and within == 0.05:
        return list(_table_agreement())
    from .plan import plan

    out = []
    for run in RUNS if runs is None else runs:
        if not run.chosen:
            continue
        cfg = TrainConfig(**run.layout)
        shape = run.shape or {k: v for k, v in cfg.overrides.items() if k != "block_size"}
        result = plan(None, cfg.world_size, run.gpu, run.gpus_per_node, cfg.batch_size, cfg.seq_len,
                      cfg.precision, shape=shape, framework=run.framework or None)
        # The same recomputation as the run (a setting the source fixed, not part of the layout it chose).
        fitting = [r for r in result["layouts"] if r["fits"]
                   and r["checkpoint_activations"] == cfg.checkpoint_activations]
        mine = [r for r in fitting if _matches(r, run.chosen)]
        first = fitting[0] if fitting else None
        best = mine[0] if mine else None
        ratio = best["step_s"] / first["step_s"] if best and first else float("inf")
        out.append({"name": run.name, "choice": run.choice, "first": _layout(first), "chosen": _layout(best),
                    "first_step_s": first and first["step_s"], "chosen_step_s": best and best["step_s"],
                    "ratio": ratio, "agrees": ratio <= 1 + within, "first_row": first, "chosen_row": best})
    return out


@functools.lru_cache(maxsize=1)
def _table_agreement() -> tuple:
    """:func:`agreement` over the whole table, planned once a process (about 15 s of planning)."""
    return tuple(agreement(RUNS))


def _layout(row) -> str:
    if row is None:
        return "none fits"
    parts = " ".join(f"{k} {row[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if row.get(k, 1) > 1)
    return parts + f", ZeRO-{row['zero']}" * bool(row["zero"]) + RECOMPUTE_NOTE[row["checkpoint_activations"]] \
        + f", {row['schedule']}" * bool(row.get("schedule"))


def fit(gpu: str, runs=None) -> dict:
    """The values of :func:`fitted` for ``gpu`` that make the largest error over its runs of the fitting set
    smallest (ties: the smaller value): ``{"values": {...}, "max_error": e, "runs": n}``. Only rows with
    ``split == "fit"`` are looked at; the held-out set never moves a constant."""
    chosen = [r for r in (RUNS if runs is None else runs) if r.split == "fit" and r.gpu == gpu]
    if not chosen:
        raise ValueError(f"no run of the fitting set is on {gpu!r}.")
    base = get_gpu(gpu)
    grid = fitted(gpu)
    best = None
    for values in itertools.product(*grid.values()):
        spec = dataclasses.replace(base, **dict(zip(grid, values)))
        worst = max(abs(r["error"]) for r in compare(chosen, {gpu: spec}))
        if best is None or worst < best[1] - 1e-12:
            best = (dict(zip(grid, values)), worst)
    return {"values": best[0], "max_error": best[1], "runs": len(chosen)}


def _show(value: float, unit: str) -> str:
    if unit == "MFU":
        return f"{value:.1%} MFU"
    if unit.startswith("bytes/s"):
        return f"{value / 1e9:.0f} GB/s"
    if unit.startswith("FLOP/s"):
        return f"{value / 1e12:.0f} TFLOP/s"
    if unit.startswith("seconds"):
        return f"{value:.1f} s"
    return f"{value:,.0f} tokens/s"


def markdown_table() -> str:
    """The comparison as the Markdown table docs/modeled-timing.md prints (a test keeps the two equal)."""
    lines = ["| published run | set | reported | modeled | error |", "|---|---|---|---|---|"]
    for r in compare():
        lines.append(f"| {r['name']} | {r['split']} | {_show(r['reported'], r['unit'])} | "
                     f"{_show(r['predicted'], r['unit'])} | {r['error']:+.1%} |")
    return "\n".join(lines)


def agreement_table(rows=None) -> str:
    """The planner against the sources' choices, as the Markdown table docs/modeled-timing.md prints."""
    rows = agreement() if rows is None else rows
    lines = ["| published run | its choice | planner's first | the choice's step / first's | agrees |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['chosen']} | {r['first']} | {r['ratio']:.2f} | "
                     f"{'yes' if r['agrees'] else 'no'} |")
    share = sum(r["agrees"] for r in rows) / len(rows)
    lines.append(f"\n{sum(r['agrees'] for r in rows)} of {len(rows)} agree ({share:.0%}).")
    return "\n".join(lines)
