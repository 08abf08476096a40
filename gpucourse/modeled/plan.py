"""Plan a layout on paper: which dp × tp × pp × cp (× ep, ZeRO stage, schedule) fits, and how fast it would be.

For a model's shape (:mod:`gpucourse.modeled.shapes`: a public one by name, one's own parts, or a plausible one for a
parameter count) on G GPUs of a stated kind, every layout with dp·cp·tp·pp = G (tp within one server and
splitting the heads, pp no more than the blocks), every ZeRO stage the framework offers, 1F1B and interleaved
1F1B, with and without activation checkpointing, is sized — by :func:`gpucourse.modeled.memory.estimate` (checked against
real runs) for the course's own block, by :func:`activation_bytes` and the shape's own parameters for others —
and timed by :func:`step_time`, the sum of these parts:

- **compute**: one microbatch on the pipeline stage that sets the pace (the most blocks, the head on the last),
  kernel by kernel — each matmul of a block as its own (m, n, k) on a roofline with tile and wave quantization,
  attention as a fused kernel (or unfused, as Megatron-LM ran it in 2021), element-wise work by the bytes it
  moves (:meth:`gpucourse.modeled.cluster.Cluster.kernel_s`); backward is each matmul's two gradients and attention's
  backward; times the microbatches m;
- **recompute**: with activation checkpointing, the blocks' forward once more;
- **bubble**: the share of that compute the schedule leaves idle, as ``gpucourse schedule`` lays it out
  (:func:`bubble_ratio`): (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved, less for zero-bubble schedules;
- **tensor-parallel communication**: per block and microbatch two all-reduces forward and two backward (three
  forward with recomputation) of a rank's activations (its T/cp tokens), inside a server;
- **pipeline communication**: each microbatch's activation forward and its gradient back at each boundary, 1/tp
  of it a rank where the framework scatters it (Megatron-LM) or sequence parallelism has split it, all-gathered
  on arrival;
- **context-parallel ring**: per block and microbatch, cp − 1 hops of a rank's K and V (only kv_heads wide)
  forward, cp − 1 again and cp of their gradients backward;
- **expert-parallel all-to-alls**: dispatch and combine, forward and backward, per MoE block and microbatch;
- **data-parallel communication**: the gradients' all-reduce (ZeRO-1/2: reduce-scatter and all-gather, the same
  bytes) once a step; ZeRO-3 gathers each block's weights for forward and for backward (and the recomputed
  forward) and reduce-scatters its gradients, every microbatch;
- **optimizer**: Adam over the parameters the rank updates, memory-bound.

Which communication hides behind compute is the **framework's** setting (:class:`Overlap`, :data:`FRAMEWORKS`,
each named after what it copies): Megatron-LM 2021 all-reduced the gradients after the pipeline flush, Megatron-Core
overlaps them with the last backward, FSDP prefetches its gathers, ``--tp-comm-overlap`` splits tensor-parallel
collectives beside their matmuls, the cp ring sends beside attention. Only what is left over counts (``*_exposed_s``;
``*_comm_s`` is the whole). Each transfer is timed by :class:`gpucourse.modeled.cluster.Cluster`'s α–β model over the links
its group crosses — the same model that replays recorded runs (:mod:`gpucourse.modeled.replay`). ``gpucourse.modeled.published``
holds the model against published runs; ``docs/modeled-timing.md`` prints the table. A layout that does not fit in
the GPU's memory is never ranked as fitting.

From ``LONG_SEQUENCE`` tokens on (and always under Megatron-Core), layouts with tp > 1 use **sequence
parallelism**; from ``LONG_SEQUENCE`` on the planner also tries **context parallelism** (zig-zag ring attention).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap
from dataclasses import dataclass

from ..config import ConfigError, TrainConfig
from ..parallel import check
from ..parallel.schedule_table import get as get_schedule
from ..readable import human_bytes
from ..values import GPUS_PER_NODE, RANKS, SEQUENCES, TOKENS, Name, number
from . import shapes
from .cluster import Cluster
from .costs import COSTS, Step, StepTime
from .gpus import get_gpu
from .memory import Activations, MemoryParts, bytes_per_param, estimate, estimate_params, fp8_copies_are
from .offload import offload_memory, offload_time
from .shapes import Shape, ShapeError, for_params, get_shape


def shape_for_params(num_params: float) -> dict:
    """A plausible GPT shape (n_layer, n_embd, n_head, vocab_size) with about ``num_params`` parameters
    (:func:`gpucourse.modeled.shapes.for_params`)."""
    return for_params(num_params).overrides()


LONG_SEQUENCE = 16384  # from here on the planner also tries sequence and context parallelism

# Named shapes to plan (``gpucourse plan --shape NAME``): public models' shapes, each with its source.
SHAPES = shapes.SHAPES


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def candidates(shape: Shape, gpus: int, gpus_per_node: int, batch_size: int, seq_len: int, precision: str,
               sequence_parallel: bool = False, zero_stages=(0, 1, 2, 3), even_split: bool = False,
               attention: str = "flash", left_out: dict | None = None):
    """Every layout worth sizing, as TrainConfigs (not necessarily runnable in this build). ``shape``: anything
    :func:`gpucourse.modeled.shapes.get_shape` takes. ``sequence_parallel``: with tensor parallelism, always (as
    Megatron-Core runs it); else only from ``LONG_SEQUENCE`` on. ``even_split``: only pipelines whose stages (and
    interleaved chunks) hold equal blocks, interleaving only past two stages (:attr:`Overlap.even_split`).
    ``attention``: the framework's kernel as the model's ``attention`` ("math": the scores kept, which selective
    recomputation frees, so it is tried beside none and full; a fused kernel keeps none to free). ``left_out``, if
    given, gathers the degrees the shape or the batch rule out: {"tp": {...}, "pp": {...}, "dp": {...}}."""
    shape = get_shape(shape)
    long = seq_len >= LONG_SEQUENCE
    out = left_out if left_out is not None else {}
    for tp in _divisors(gpus):
        # A tensor-parallel group stays in one server (its all-reduces are every block's): tp divides a server.
        if gpus_per_node % tp:
            continue
        if shape.heads % tp or (shape.kv % tp and tp % shape.kv):
            out.setdefault("tp", set()).add(tp)
            continue
        for cp in _divisors(gpus // tp) if long else [1]:
            if seq_len % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if pp > shape.layers:
                    out.setdefault("pp", set()).add(pp)
                if batch_size % dp:
                    out.setdefault("dp", set()).add(dp)
                if pp > shape.layers or batch_size % dp or even_split and shape.layers % pp:
                    continue
                # One sequence per microbatch on a pipeline keeps its bubble small.
                micro = batch_size // dp if pp > 1 else 1
                grad_accum = 1 if pp > 1 else batch_size // dp
                # A mixture of experts: expert parallelism over ep of the dp ranks (ep divides the experts).
                eps = [ep for ep in _divisors(dp) if shape.experts % ep == 0] if shape.experts else [1]
                for ep, zero in ((ep, zero) for ep in eps for zero in zero_stages):
                    if zero and dp * cp == 1 or zero == 3 and ep > 1:
                        continue
                    # A pipeline also tries the interleaved schedule with 2, 4 or 8 chunks a rank, where the blocks go.
                    chunks = [v for v in (2, 4, 8) if pp > 1 and shape.layers >= v * pp and micro % pp == 0
                              and not (even_split and (shape.layers % (v * pp) or pp <= 2))]
                    schedules = [("1f1b", 2)] + [("interleaved-1f1b", v) for v in chunks]
                    recomputes = (False, "selective", True) if attention == "math" else (False, True)
                    for (schedule, v), ckpt in ((sv, ckpt) for sv in schedules for ckpt in recomputes):
                        yield TrainConfig(model="gpt2-small", overrides={**shape.overrides(), "block_size": seq_len},
                                          dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zigzag=cp > 1,
                                          sequence_parallel=(long or sequence_parallel) and tp > 1, zero=zero,
                                          microbatches=micro, grad_accum=grad_accum, schedule=schedule,
                                          virtual_stages=v, batch_size=batch_size, seq_len=seq_len,
                                          precision=precision, master_weights=precision != "fp32",
                                          checkpoint_activations=ckpt, attention=attention)


def activation_bytes(cfg: TrainConfig, shape: Shape, stage: int, ends_as_layers: bool = False) -> float:
    """Activations a rank of pipeline stage ``stage`` holds at its peak, for a practitioner's ``shape``
    (:func:`activations`, its total)."""
    return activations(cfg, shape, stage, ends_as_layers).total


def layer_bytes_per_token(cfg: TrainConfig, shape: Shape) -> float:
    """What one layer keeps for backward per token of a microbatch, 16-bit activations: Korthikanti et al.'s (2022)
    count (their section 4.1: 34·s·b·h + 5·a·s²·b bytes a GPT layer without recomputation; Table 2 with tensor
    and sequence parallelism) with the shape's own widths, term by term:

    - the two norms' inputs, 2·C bytes each, and their outputs that q, k, v and the MLP's first matmul read, 2·C
      each (÷ tp under sequence parallelism: kept scattered, all-gathered again in backward);
    - with dropout, its masks after attention and after the MLP, C bytes each (÷ tp likewise); none without;
    - Q, K and V (K and V only kv_heads wide), ÷ tp, and attention's output, the output projection's input, 2·C ÷ tp;
    - the MLP's hidden values ÷ tp: GELU's input and output, 2 × 2·F; SwiGLU's gate and up projections (the fused
      activation's input) and their product (the down projection's input), 3 × 2·F; experts: top_k of them;
    - attention's core: a fused kernel (FlashAttention) keeps only its log-sum-exp, 4 bytes a head (fp32); written
      out (``attention="math"``), the softmax's output, 2 bytes a head and key, and with dropout its mask and
      output, 3 more (Korthikanti's 5·a·s/h); selective recomputation keeps neither;
    - full recomputation: the layer's input alone, 2·C (÷ tp under sequence parallelism).
    """
    C, d, tp = shape.hidden, shape.head_dim, cfg.tp
    sp = tp if cfg.sequence_parallel and tp > 1 else 1
    if cfg.recompute == "full":
        return 2 * C / sp
    norms = 4 * C + 4 * C                      # the norms' inputs, and their outputs the matmuls read
    masks = 2 * C if cfg.dropout else 0.0      # dropout's masks after attention and after the MLP
    qkv = 2 * d * (shape.heads / tp + 2 * shape.kv_heads_per_rank(tp))
    width = shape.expert_width * shape.top_k if shape.experts else shape.width
    mlp = (6 if shape.mlp == "swiglu" else 4) * width / tp
    core = 0.0
    if cfg.recompute == "none":
        core = (5 if cfg.dropout else 2) * shape.heads / tp * cfg.seq_len if cfg.attention == "math" \
            else 4 * shape.heads / tp
    return (norms + masks) / sp + qkv + 2 * C / tp + mlp + core


def pipeline_chunks(cfg: TrainConfig, layers: int, ends_as_layers: bool = False) -> list:
    """The layer ids of each chunk of each pipeline rank of ``cfg`` (:func:`gpucourse.modeled.memory.chunk_layers`,
    as many chunks and placed as the schedule's record says)."""
    from .memory import chunk_layers

    record = get_schedule(cfg.schedule)
    v = record.chunks_per_rank(cfg.virtual_stages) if cfg.pp > 1 else 1
    return chunk_layers(layers, cfg.pp, v, record.placement if cfg.pp > 1 else "loop", ends_as_layers)


def _ends(cfg: TrainConfig) -> tuple[int, int]:
    """(the rank holding the embedding, the rank holding the head and the loss): the first and the last virtual
    stage's."""
    from ..parallel.schedules_virtual import Layout

    if cfg.pp == 1:
        return 0, 0
    record = get_schedule(cfg.schedule)
    layout = Layout(cfg.pp, record.chunks_per_rank(cfg.virtual_stages), "v" if record.placement == "v" else "loop")
    return layout.place(0)[0], layout.place(layout.stages - 1)[0]


def activations(cfg: TrainConfig, shape: Shape, stage: int, ends_as_layers: bool = False) -> Activations:
    """What a rank of pipeline stage ``stage`` keeps at its peak (:class:`gpucourse.modeled.memory.Activations`):
    :func:`layer_bytes_per_token` times a microbatch's tokens on the rank (÷ cp) for each layer-microbatch the
    schedule holds at once — its ops replayed, each chunk weighed by its layers
    (:func:`gpucourse.modeled.memory.held_layers`: 1F1B's first stage holds pp microbatches, interleaving more) —
    and on the loss's rank the fp32 logits of one microbatch."""
    from .memory import held_layers

    m = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    tokens = cfg.batch_size / (cfg.dp * m) * cfg.seq_len / cfg.cp
    chunks = pipeline_chunks(cfg, shape.layers, ends_as_layers)
    layers = sum(len(c) for c in chunks[stage])
    held = held_layers(cfg.schedule, cfg.pp, _enough(cfg), chunks)[stage]
    layer = layer_bytes_per_token(cfg, shape) * tokens
    logits = 4 * tokens * shape.vocab / cfg.tp if stage == _ends(cfg)[1] else 0.0
    return Activations(layer, layers, held / layers if layers else 0.0, layer * held + logits, cfg.recompute,
                       cfg.attention)


def _enough(cfg: TrainConfig) -> int:
    """Microbatches enough to reach a pipeline's peak in flight: the warm-up of an interleaved schedule is under
    3·pp microbatches (2·(pp − 1) + (v − 1)·pp chunk-steps), so laying out more does not change the peak (tested),
    and laying out a thousand would take seconds a layout."""
    return min(cfg.microbatches, 3 * cfg.pp) if get_schedule(cfg.schedule).interleaved else cfg.microbatches


def memory_of(cfg: TrainConfig, shape: Shape, offload: bool = False, framework=None, fp8: bool = False,
              ends_as_layers: bool = False, gpu=None, fp8_params: bool = False, fp32_grads: bool | None = None) -> dict:
    """Memory per GPU of ``cfg`` training ``shape``, on the busiest pipeline rank: ``max`` (the four categories),
    ``max_total`` (those and the communication buffers) and ``parts`` (:meth:`MemoryParts.as_dict`).

    The course's own block with no ``framework`` named: :func:`gpucourse.modeled.memory.estimate` (``gpucourse memory``,
    what the course's runtime keeps, checked against its runs). Otherwise what ``framework`` (:data:`FRAMEWORKS`;
    None: ``DEFAULT_FRAMEWORK``) keeps, part by part (:func:`memory_parts`). ``ends_as_layers``: the embedding and
    the loss each take a layer's place in the pipeline's split (Llama 3's balancing). ``gpu``, ``fp8_params``,
    ``fp32_grads``: as :func:`memory_parts` takes them.

    NCCL's own buffers, cuBLAS's workspaces and the allocator's slack are not counted here: they are the reserve
    :meth:`gpucourse.modeled.gpus.GPUSpec.usable_bytes` keeps out of the card. ``offload``: the optimizer's state on the
    host (:func:`gpucourse.modeled.offload.offload_memory`; ``host_bytes`` says how much)."""
    if offload:
        held = memory_of(cfg, shape, framework=framework, fp8=fp8, ends_as_layers=ends_as_layers, gpu=gpu,
                         fp8_params=fp8_params, fp32_grads=fp32_grads)
        on_gpu, host = offload_memory(held["max"], cfg.master_weights and cfg.precision != "fp32")
        moved = held["max"]["optimizer"]
        parts = {**held["parts"], "optimizer": 0, "total": held["parts"]["total"] - moved}
        return {**held, "max": on_gpu, "max_total": held["max_total"] - moved, "host_bytes": host, "parts": parts}
    if shape.is_course_block and framework is None:
        m = _enough(cfg)
        if m == cfg.microbatches:
            return estimate(cfg, every_rank=False)
        # The same microbatches (sequences each), fewer of them: the same peak, laid out in a fraction of the time.
        fewer = dataclasses.replace(cfg, microbatches=m, batch_size=cfg.batch_size // cfg.microbatches * m)
        return {**estimate(fewer, every_rank=False), "config": cfg.to_dict()}
    check(cfg, runnable=False)
    overlap = get_framework(framework)
    worst = max((memory_parts(cfg, shape, stage, overlap, fp8, ends_as_layers, gpu, fp8_params, fp32_grads)
                 for stage in range(cfg.pp)), key=lambda parts: parts.total)
    return {"config": cfg.to_dict(), "num_params": shape.params(), "max": worst.categories,
            "max_total": worst.total, "parts": worst.as_dict(), "framework": overlap.name}


def memory_parts(cfg: TrainConfig, shape: Shape, stage: int, framework=None, fp8: bool = False,
                 ends_as_layers: bool = False, gpu=None, fp8_params: bool = False,
                 fp32_grads: bool | None = None) -> MemoryParts:
    """One rank of pipeline stage ``stage`` as ``framework`` keeps it, part by part
    (:class:`gpucourse.modeled.memory.MemoryParts`), from the shape's own parameters (GQA, SwiGLU, its vocabulary,
    experts over ep) and the layers the rank's chunks hold:

    - **weights** in bf16, **optimizer**: an fp32 master copy and Adam's two moments, 12 bytes a parameter, divided
      by dp·cp under ZeRO-1 and up (Megatron-Core's distributed optimizer is ZeRO-1); **gradients** in fp32 where
      the framework accumulates them so (:attr:`Overlap.fp32_grads`): Megatron-LM's docs/source/distrib_optimizer.md
      table, "bf16 param, fp32 grads": 18 bytes a parameter, 6 + 12/d with the distributed optimizer; Rajbhandari
      et al. 2020 (ZeRO), section 3 and Table 1: (2 + 2 + K)·Ψ, K = 12; ZeRO-2 and 3 shard the gradients, ZeRO-3
      the weights;
    - ``fp8``: Transformer Engine's fp8 copy of every matmul weight, kept between microbatches, and its transpose
      (1 byte each) where the ``gpu``'s fp8 GEMMs take only the "TN" layout, so backward reads a transposed copy:
      Hopper's; Blackwell's read either (:meth:`gpucourse.modeled.gpus.GPUSpec.fp8_any_layout`; no ``gpu``:
      Hopper's). ``fp8_params``: the matmul weights are kept in fp8 themselves, 1 byte each and no bf16 copy, the
      transpose beside them where the GPU needs it (Megatron-Core's fp8_param_gather: its parameter buffer holds
      them as uint8, megatron/core/distributed/distributed_data_parallel.py at core_v0.11.0; TransformerEngine
      v2.9's Float8TensorStorage.update_usage makes the transpose on TN-only GPUs and never on the others; the fp32
      master copy stays in the optimizer's 12 bytes). ``fp32_grads``: the gradients' precision where the run sets
      it (Megatron-Core's grad_reduce_in_fp32: fp32, or the weights' bf16); None: the framework's own;
    - **activations**: :func:`activations`, by the recomputation and the attention kernel, times the
      layer-microbatches the schedule keeps in flight;
    - **buffers**: ZeRO-3's gathered weights, the unit computing and the next one prefetched, with the root unit
      (embedding, final norm, head: FSDP gathers it for the whole forward and again for the whole backward), in
      the precision the matmuls read, and the gradients of the root and of one unit whole until they are
      reduce-scattered — a unit is a block, or under DeepSpeed a submodule, the largest matrix
      (:attr:`Overlap.zero3_unit`); under sequence parallelism the all-gathered sequence a column-parallel matmul
      reads (one microbatch's tokens × C, 2 bytes: Megatron-LM's global memory buffer); PyTorch DDP's buckets, a
      copy of the gradients (``gradient_as_bucket_view=False``, its default). Pipeline transfers add none: a
      received activation is its first layer's saved input, and Megatron-LM frees a sent output's data
      (``deallocate_pipeline_outputs``).
    """
    overlap = get_framework(framework)
    chunks = pipeline_chunks(cfg, shape.layers, ends_as_layers)
    ids = [i for chunk in chunks[stage] for i in chunk]
    first, last = (stage == rank for rank in _ends(cfg))
    n, experts = shape.stage_params(cfg.pp, stage, cfg.tp, cfg.ep, ids=ids, first=first, last=last)
    mem = estimate_params(int(n - experts), cfg.dp * cfg.cp, cfg.zero, cfg.precision, cfg.master_weights,
                          scratch_padding=False)
    if experts:
        more = estimate_params(int(experts), cfg.dp // cfg.ep, cfg.zero, cfg.precision, cfg.master_weights,
                               scratch_padding=False)
        mem = {c: v + more[c] for c, v in mem.items()}
    w, g, o = bytes_per_param(cfg.precision, cfg.master_weights)
    half = cfg.precision != "fp32" and cfg.master_weights
    if half and (overlap.fp32_grads if fp32_grads is None else fp32_grads):
        mem["gradients"] *= 2  # Megatron-LM accumulates and reduces bf16 runs' gradients in fp32
        g = 4
    # Every matmul weight the rank holds (not the norms, 2·C a layer, the embedding or the head, nor the final norm).
    root = shape.stage_params(cfg.pp, stage, cfg.tp, cfg.ep, ids=[], first=first, last=last)[0]
    matmul = n - 2 * shape.hidden * len(ids) - root
    sharded = cfg.dp * cfg.cp if cfg.zero == 3 else 1
    transposed = not (gpu is not None and (get_gpu(gpu) if isinstance(gpu, str) else gpu).fp8_any_layout())
    in_fp8 = matmul if fp8 and fp8_params else 0.0
    mem["weights"] -= (w - 1) * in_fp8 / sharded   # 1 byte each, not the bf16 copy's w
    copies = 0.0
    if fp8:  # a transpose of each matmul weight where the GPU needs one; an fp8 copy of a bf16 weight
        copies = (transposed + (not fp8_params)) * matmul / sharded
    buffers = {}
    compute = 4 if cfg.precision == "fp32" else 2  # what the matmuls read and what backward produces, a value
    if cfg.zero == 3 and cfg.dp * cfg.cp > 1:
        if overlap.zero3_unit == "module":  # the largest matrix: the embedding or head, q-k-v, an MLP matrix
            C, tp = shape.hidden, cfg.tp
            mlp = shape.expert_width if shape.experts else shape.width
            unit = max(shape.vocab * C / tp if first or last else 0.0,
                       C * shape.head_dim * (shape.heads / tp + 2 * shape.kv_heads_per_rank(tp)), C * mlp / tp)
            whole = 0.0
        else:
            unit = max((shape.stage_params(cfg.pp, stage, cfg.tp, cfg.ep, ids=[i], first=False, last=False)[0]
                        for i in ids), default=0.0)
            whole = root
        buffers["zero3_gathered"] = compute * (whole + 2 * unit)  # the unit computing and the next, prefetched
        buffers["zero3_gradients"] = compute * (whole + unit)     # until their reduce-scatter is done
    act = activations(cfg, shape, stage, ends_as_layers)
    if cfg.sequence_parallel and cfg.tp > 1:
        tokens = cfg.batch_size / (cfg.dp * (cfg.microbatches if cfg.pp > 1 else cfg.grad_accum)) \
            * cfg.seq_len / cfg.cp
        buffers["sp_gather"] = 2 * tokens * shape.hidden
    if overlap.bucket_copy and cfg.dp * cfg.cp > 1:
        buffers["ddp_buckets"] = mem["gradients"]
    return MemoryParts(stage, n, mem["weights"], mem["gradients"], mem["optimizer"], act, w, g, o, cfg.zero,
                       cfg.dp * cfg.cp, copies, buffers, overlap.name, in_fp8, fp8 and transposed)


def attention_flops(n_layer: int, n_embd: int, seq_len: int, recompute: bool = False) -> float:
    """Attention's own FLOPs per token, forward and backward: 12·L·C·T (16·L·C·T recomputing the forward).

    Per block and token, forward: q·kᵀ against T keys and the weighted sum of T values, 2 · 2·C·T; backward
    twice that. Counted without the causal mask's saving, as PaLM's MFU formula does.
    """
    return (16 if recompute else 12) * n_layer * n_embd * seq_len


def lay_out_schedule(schedule: str, pp: int, m: int, v: int = 2, cost_f: float = 1.0, cost_b: float = 2.0,
                     cost_comm: float = 0.0):
    """Any pipeline schedule of the course, by name, built, checked and laid out on the clock: ``(ops, layout,
    simulation, costs)``. ``layout`` is None for the one-chunk schedules of :mod:`.parallel.schedules`; ``costs``
    are the op costs used: the zero-bubble schedules split a backward into B and W of ``cost_b / 2`` each, the
    others' B is the whole backward. What ``gpucourse schedule`` prints and the planner's bubble both come from here.
    """
    from ..parallel import schedules, schedules_virtual
    from ..parallel.schedule_table import get

    record = get(schedule)
    if not record.virtual:
        ops = schedules.build(schedule, pp, m)
        schedules.validate(ops, pp, m)
        return ops, None, schedules.simulate(ops, pp, m, cost_f, cost_b, cost_comm), {"f": cost_f, "b": cost_b}
    split = record.split_backward
    costs = {"f": cost_f, "b": cost_b / 2, "w": cost_b / 2} if split else {"f": cost_f, "b": cost_b}
    ops, layout = schedules_virtual.build(schedule, pp, m, v)
    schedules_virtual.validate(ops, layout, m)
    sim = schedules_virtual.simulate(ops, layout, m, cost_f, costs["b"], costs.get("w", 0.0), cost_comm)
    return ops, layout, sim, costs


@functools.lru_cache(maxsize=512)
def bubble_ratio(schedule: str, pp: int, m: int, v: int = 2) -> float:
    """Idle over compute time of a pipeline ``schedule`` of ``pp`` stages and ``m`` microbatches: what
    ``gpucourse schedule`` prints as Megatron-LM's bubble (:func:`lay_out_schedule` with a backward twice a
    forward, transfers free). ``v``: chunks per rank of interleaved-1f1b.

    For gpipe, 1f1b and interleaved-1f1b the clock gives exactly the papers' formulas, (p−1)/m and
    (p−1)/(v·m) (tests/test_schedules.py lays them out on many shapes), so those are used as they are: a
    planner sizes hundreds of layouts. The others are laid out on the clock, once per shape.
    """
    from ..parallel import schedules, schedules_virtual

    if pp == 1:
        return 0.0
    record = get_schedule(schedule)
    if record.formula:  # the papers' closed form, which the clock gives exactly
        return (schedules_virtual.formula_bubble_ratio(schedule, pp, m, v) if record.virtual else
                schedules.formula_bubble_ratio(schedule, pp, m))
    return lay_out_schedule(schedule, pp, m, v)[2].bubble_ratio


@dataclass(frozen=True)
class Overlap:
    """Which communication a framework runs beside compute, and the attention kernel it uses.

    ``dp``: the gradients' reduction ``"backward"`` (bucketed, started as each bucket's gradients are ready, so it
    hides behind the last microbatch's backward) or ``"after"`` (once the backward is done). ``prefetch``: ZeRO-3 /
    FSDP gathers the next layer's weights while this one computes. ``tp``: tensor-parallel collectives split and
    overlapped with their matmuls. ``cp``: the context-parallel ring sends the next K/V block while attention
    works on this one. ``pp_scatter``: a pipeline send carries 1/tp of the activation from each tensor-parallel
    rank (Megatron-LM's scatter/gather; with sequence parallelism the activation is split already). ``pp``: sends
    and receives between stages overlap compute. ``elementwise``: how many times the memory traffic of one fused
    pass the element-wise work (norms, activations, adds, rotary) moves: eager PyTorch runs each as several
    kernels (torchtitan measures torch.compile +16 % on Llama 3.1 8B, docs/performance.md: about 3× the traffic
    of a fused pass in this model). ``attention``: ``"flash"`` (the GPU's best fused kernel: FlashAttention-3
    or cuDNN on Hopper), ``"flash2"`` (FlashAttention-2, what PyTorch's scaled-dot-product attention and
    llm-foundry use) or ``"unfused"``.
    """

    name: str
    dp: str
    prefetch: bool
    tp: bool
    cp: bool
    attention: str
    pp_scatter: bool
    source: str
    one_card: bool = False  # ZeRO-3's collectives reach one network card per GPU, not the server's eight at once
    pp: bool = False        # pipeline sends and receives run beside compute (only the first of each way waits)
    elementwise: float = 1  # memory traffic of norms, activations and adds over one fused pass (eager: several)
    zero: tuple = (0, 1, 2, 3)  # the ZeRO stages it offers (what the planner may choose)
    # Pipelines only of equal stages: pp divides the layers and pp·v too when interleaved, which needs more than two
    # stages (Megatron-LM's argument checks, 2021). Others may split unevenly: the busiest stage sets the pace.
    even_split: bool = False
    # bf16 runs' gradients accumulated and reduced in fp32, 4 bytes a parameter (Megatron-LM's arguments.py sets
    # accumulate_allreduce_grads_in_fp32 for bf16); others keep them in the weights' bf16.
    fp32_grads: bool = False
    # Gradients copied into the all-reduce's buckets, a second copy of them (PyTorch DDP's default,
    # gradient_as_bucket_view=False; Megatron-LM and FSDP reduce in the gradients' own buffer).
    bucket_copy: bool = False
    # What ZeRO-3 gathers whole at a time: "block" (FSDP's units: each block, and the root of embedding, final norm
    # and head) or "module" (DeepSpeed gathers each submodule's parameters as its forward or backward runs).
    zero3_unit: str = "block"


FRAMEWORKS = {o.name: o for o in (
    Overlap("megatron-2021", dp="after", prefetch=False, tp=False, cp=False, attention="unfused", pp_scatter=True,
            zero=(0,), even_split=True, fp32_grads=True,
            source="Narayanan et al. 2021 (SC21), section 4: the gradient all-reduce runs after the pipeline "
                   "flush; scatter/gather of the activations between stages; attention as two batched matmuls "
                   "and a fused softmax (no FlashAttention yet)"),
    Overlap("megatron-core", dp="backward", prefetch=True, tp=False, cp=True, attention="flash", pp_scatter=True,
            pp=True, fp32_grads=True,
            source="Megatron-Core: --overlap-grad-reduce and --overlap-param-gather (distributed optimizer), "
                   "FlashAttention through Transformer Engine, context parallelism's ring overlapped with "
                   "attention; --tp-comm-overlap left off (its default)"),
    Overlap("megatron-core-tp-overlap", dp="backward", prefetch=True, tp=True, cp=True, attention="flash",
            pp_scatter=True, pp=True, fp32_grads=True,
            source="Megatron-Core with --tp-comm-overlap (Transformer Engine's userbuffers)"),
    Overlap("fsdp", dp="backward", prefetch=True, tp=False, cp=True, attention="flash2", pp_scatter=False,
            elementwise=3, zero=(0, 2, 3), source="PyTorch FSDP2 as torchtitan runs it: all-gathers prefetched one layer ahead, reduce-scatters "
                   "behind backward; scaled-dot-product attention with the flash backend (FlashAttention-2); eager "
                   "element-wise kernels"),
    Overlap("deepspeed-zero3", dp="backward", prefetch=True, tp=False, cp=False, attention="unfused",
            pp_scatter=False, one_card=True, zero=(0, 1, 2, 3), zero3_unit="module",
            source="DeepSpeed ZeRO-3 as SC21 measured it (Narayanan et al. 2021, Table 2): prefetched gathers, but "
                   "each rank's traffic crosses its own network card, so a gather takes S ÷ one card's bandwidth "
                   "(total throughput stays flat as GPUs double at a fixed batch, as the table shows)"),
    Overlap("ddp", dp="backward", prefetch=False, tp=False, cp=False, attention="flash2", pp_scatter=False,
            elementwise=3, zero=(0, 1), bucket_copy=True, source="PyTorch DistributedDataParallel: bucketed all-reduces started during backward; eager PyTorch"),
)}
DEFAULT_FRAMEWORK = "megatron-core"
FRAMEWORK = Name(FRAMEWORKS)  # a framework's name (plan --framework)
PRECISIONS = ("bf16", "fp8", "fp32")  # what a planned run's matmuls compute in (plan --precision)
# A parameter count to plan: below 1e5 no transformer worth splitting, above 1e15 a thousand times the largest trained.
PARAMS = number(least=1e5, most=1e15, why="a thousand times the largest model trained")
EFFICIENCY = number(above=0, most=1, why="a share of the GPU's peak FLOP/s")


def get_framework(framework) -> Overlap:
    """An :class:`Overlap` by name (``FRAMEWORKS``), or the one given; None: ``DEFAULT_FRAMEWORK``."""
    if isinstance(framework, Overlap):
        return framework
    return FRAMEWORKS[FRAMEWORK.check(framework or DEFAULT_FRAMEWORK, "framework")]


def _stage_compute(cfg: TrainConfig, shape: Shape, cluster: Cluster, m: int, overlap: Overlap,
                   matmuls: str) -> dict:
    """One microbatch on the pipeline stage that sets the pace: forward, backward and recomputed forward seconds,
    and its attention's and matmuls' shares (what cp and tp communication may hide behind)."""
    from ..parallel.pipeline import stage_blocks

    tokens = cfg.batch_size / (cfg.dp * m) * cfg.seq_len / cfg.cp  # one rank's tokens of one microbatch
    sp = cfg.sequence_parallel and cfg.tp > 1

    def timed(kernels, backward):
        parts = {"gemm": 0.0, "attention": 0.0, "memory": 0.0}
        for k in kernels:
            if k["kind"] == "memory":
                k = {**k, "elements": k["elements"] * overlap.elementwise}
            parts[k["kind"]] += cluster.kernel_s(k, matmuls, backward, overlap.attention)
        return parts

    kinds = {False: shape.kernels(tokens, cfg.seq_len, cfg.tp, cfg.cp, cfg.ep, False, sp)}
    if shape.experts:
        kinds[True] = shape.kernels(tokens, cfg.seq_len, cfg.tp, cfg.cp, cfg.ep, True, sp)
    block = {moe: (timed(k, False), timed(k, True)) for moe, k in kinds.items()}
    head = timed(shape.head_kernels(tokens, cfg.tp), False), timed(shape.head_kernels(tokens, cfg.tp), True)
    worst = None
    for stage in range(cfg.pp):
        ids = stage_blocks(shape.layers, cfg.pp, stage)
        moe = sum(1 for i in ids if shape.experts and i >= shape.dense_layers)
        f = {p: (len(ids) - moe) * block[False][0][p] + moe * block.get(True, block[False])[0][p] for p in head[0]}
        b = {p: (len(ids) - moe) * block[False][1][p] + moe * block.get(True, block[False])[1][p] for p in head[0]}
        # Recomputation: full, the blocks' forward again; selective, their attention's core (its forward kernel).
        redo = {"full": sum(f.values()), "selective": f["attention"]}.get(cfg.recompute, 0.0)
        if stage == cfg.pp - 1:
            f = {p: f[p] + head[0][p] for p in f}
            b = {p: b[p] + head[1][p] for p in b}
        row = {"forward": sum(f.values()), "backward": sum(b.values()), "recompute": redo, "blocks": len(ids),
               "attention": f["attention"] + b["attention"], "gemm": f["gemm"] + b["gemm"]}
        if worst is None or row["forward"] + row["backward"] + redo > worst["forward"] + worst["backward"] + \
                worst["recompute"]:
            worst = row
    return worst


def step_time(cfg: TrainConfig, num_params: int, gpu, gpus_per_node: int, efficiency: float | None = None,
              shape: Shape | dict | str | None = None, framework: str | Overlap | None = None,
              matmuls: str | None = None, offload: bool = False) -> StepTime:
    """The timing model above for one layout: seconds per step, by part (a :class:`~.costs.StepTime`; its
    ``as_dict()`` is a plan's row).

    Compute is timed kernel by kernel on the model's ``shape`` (default: the course GPT of ``cfg``'s sizes) on
    the pipeline stage that sets the pace; ``efficiency`` instead spreads the step's FLOPs evenly over the GPUs
    at that share of the peak. Every transfer is timed by :class:`gpucourse.modeled.cluster.Cluster`'s α–β model over
    the link its group crosses — the same model that replays a recorded run (:mod:`gpucourse.modeled.replay`). Ranks are
    placed as the runtime places them (pp, dp, cp, tp, tensor-parallel ranks adjacent), ``gpus_per_node`` to a
    server. ``framework``: which communication overlaps compute (:data:`FRAMEWORKS`; default
    ``DEFAULT_FRAMEWORK``). ``matmuls``: the precision the matmuls run in, when not ``cfg.precision``:
    ``"fp8"`` times them at the GPU's fp8 peak (Transformer Engine's recipe: fp8 matmuls, bf16 attention and the
    rest, bf16 weights with fp32 master weights in memory). ``offload``: the optimizer steps on the CPU
    (:mod:`gpucourse.modeled.offload`): its part is the step's wait for PCIe and the CPU instead of the GPU's Adam.

    Each strategy's part is its own function in :mod:`gpucourse.modeled.costs` (:data:`~.costs.COSTS`).
    """
    mc = cfg.model_config()
    try:
        shape = get_shape(shape) if shape is not None else Shape.of_model(mc)
        shape.check_tp(cfg.tp)
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    overlap = get_framework(framework)
    cluster = Cluster(gpu, gpus_per_node, max(1, -(-cfg.world_size // gpus_per_node)))
    tokens = cfg.batch_size * cfg.seq_len
    m = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    model_flops = shape.flops_per_token(cfg.seq_len, causal=False) * tokens
    if efficiency:  # the step's FLOPs spread evenly at one share of the peak: 6·N (N active) + attention's
        weights = num_params * shape.active_params() / shape.params()
        full = cfg.recompute == "full"
        flops = (8 if full else 6) * weights * tokens
        flops += attention_flops(shape.layers, shape.hidden, cfg.seq_len, cfg.recompute != "none") * tokens
        compute = cluster.compute_s(flops / cfg.world_size, precision=cfg.precision, efficiency=efficiency)
        redo = (2 * weights * full + 4 * shape.layers * shape.hidden * cfg.seq_len) * tokens
        recompute = compute * redo / flops if cfg.recompute != "none" else 0.0
        pace = {"forward": (compute - recompute) / 3 / m, "backward": 2 * (compute - recompute) / 3 / m,
                "recompute": recompute / m, "attention": 0.0, "gemm": compute / m, "blocks": shape.layers / cfg.pp}
    else:
        pace = _stage_compute(cfg, shape, cluster, m, overlap, matmuls or cfg.precision)
        recompute = m * pace["recompute"]
        compute = m * (pace["forward"] + pace["backward"]) + recompute
    step = Step(cfg, shape, cluster, overlap, gpus_per_node, num_params, m, pace, compute, recompute,
                bubble_ratio(cfg.schedule, cfg.pp, m, cfg.virtual_stages) if cfg.pp > 1 else 0.0)
    parts = {name: cost(step) for name, cost in COSTS.items()}
    # Adam updates what the rank holds: its 1/(tp·pp) of the weights (experts also 1/ep), 1/(dp·cp) of that with ZeRO.
    all_experts = shape.expert_params()
    held = (num_params - all_experts) / (cfg.tp * cfg.pp) + all_experts / (cfg.tp * cfg.pp * cfg.ep)
    stepped = held / (cfg.dp * cfg.cp) if cfg.zero else held  # the parameters this GPU's optimizer steps
    offloaded = offload_time(stepped, cluster.gpu, cfg.precision, step.window_s) if offload else None
    optimizer = offloaded["exposed_s"] if offload else cluster.optimizer_s(stepped)
    return StepTime(compute, parts, optimizer, tokens, model_flops, cluster.gpu.peak_flops(cfg.precision) *
                    cfg.world_size, overlap.name, offloaded)


def plan(num_params: float | None, gpus: int, gpu: str = "h100", gpus_per_node: int = 8, batch_size: int = 1024,
         seq_len: int = 4096, precision: str = "bf16", efficiency: float | None = None,
         shape: Shape | dict | str | None = None, framework: str | None = None, offload: bool = False) -> dict:
    """Size and time every layout; return them ranked (fitting ones first, fastest first).

    ``shape``: a model's shape — a name from ``SHAPES``, a dict of parts (:func:`gpucourse.modeled.shapes.get_shape`) or
    a :class:`~gpucourse.modeled.shapes.Shape` — instead of the one :func:`shape_for_params` picks for ``num_params``.
    ``framework``: whose overlap of communication and compute to assume (:data:`FRAMEWORKS`).
    ``offload``: also try each layout with its optimizer on the CPU (:mod:`gpucourse.modeled.offload`; rows say
    ``"offload": True``), as DeepSpeed's ``offload_optimizer`` or Megatron-Core's ``--optimizer-cpu-offload`` run it.
    """
    for name, value, kind in (("gpus", gpus, RANKS), ("gpus_per_node", gpus_per_node, GPUS_PER_NODE),
                              ("batch_size", batch_size, SEQUENCES), ("seq_len", seq_len, TOKENS)):
        kind.check(value, name)
    Name(PRECISIONS).check(precision, "precision")
    if efficiency is not None:
        EFFICIENCY.check(efficiency, "efficiency")
    if num_params is not None:
        PARAMS.check(num_params, "num_params")
    if shape is None:
        if num_params is None:
            raise ConfigError("plan needs num_params (a parameter count) or a shape.")
        shape = for_params(num_params)
    else:
        try:
            shape = get_shape(shape)
        except ShapeError as e:
            raise ConfigError(str(e)) from None
    overlap = get_framework(framework)
    spec = get_gpu(gpu)
    if offload and not (spec.pcie_GBps and spec.host_GBps):
        raise ConfigError(f"offload needs the GPU's host link (pcie_GBps, host_GBps), which {spec.name} has not "
                          f"in the table: add them in your GPU table to plan offload.")
    rows, left_out, refused = [], {}, []
    matmuls = precision
    if precision == "fp8":  # fp8 matmuls; the weights, their gradients and the rest in bf16 (memory as bf16's)
        if not spec.peak_fp8_flops:
            raise ConfigError(f"precision='fp8' needs fp8 tensor cores; {spec.name} has none (Ada and Hopper GPUs "
                              f"and later do).")
        precision = "bf16"
    for cfg in candidates(shape, gpus, gpus_per_node, batch_size, seq_len, precision,
                          sequence_parallel=overlap.name.startswith("megatron-core"), zero_stages=overlap.zero,
                          even_split=overlap.even_split,
                          attention="math" if overlap.attention == "unfused" else "flash", left_out=left_out):
        for offloaded in (False, True) if offload else (False,):
            try:
                # The course's own block as the course's runtime keeps it (gpucourse memory); other shapes as the
                # framework does.
                mem = memory_of(cfg, shape, offloaded, None if shape.is_course_block else framework,
                                fp8=matmuls == "fp8", gpu=spec)
            except ConfigError as e:
                refused.append(str(e))
                break
            rows.append(_row(cfg, shape, mem, spec, gpus_per_node, efficiency, overlap, matmuls, offloaded))
    rows.sort(key=lambda r: (not r["fits"], r["step_s"]))
    if num_params is None:
        num_params = shape.params()
    moe = {"active_params": shape.active_params()} if shape.experts else {}
    return {"params": num_params, "model_params": shape.params(), **moe, "shape": shape.as_dict(), "gpus": gpus,
            "gpu": dataclasses.asdict(spec), "gpus_per_node": gpus_per_node,
            "batch_size": batch_size, "seq_len": seq_len, "precision": matmuls,
            "efficiency": efficiency, "framework": overlap.name, "offload": offload,
            "layouts": rows, "notes": _notes(shape, batch_size, left_out, refused), "searched": _searched(rows, seq_len)}


def _searched(rows: list[dict], seq_len: int) -> dict:
    """What the planner tried, from the layouts it sized: each degree's values, the ZeRO stages, the schedules
    (interleaved with its chunks a rank), the recomputations, and the rule that limited context parallelism."""
    def values(key):
        return sorted({r[key] for r in rows})

    return {"layouts": len(rows), "tp": values("tp"), "pp": values("pp"), "dp": values("dp"), "cp": values("cp"),
            "ep": values("ep"), "zero": values("zero"), "schedules": sorted({schedule_name(r) for r in rows} - {""}),
            "recompute": [k for k in RECOMPUTE_NOTE if any(r["checkpoint_activations"] == k for r in rows)],
            "offload": sorted({bool(r.get("offload")) for r in rows}),
            "cp_rule": f"context parallelism from {LONG_SEQUENCE} tokens on" + (
                "" if seq_len >= LONG_SEQUENCE else f": not tried at {seq_len}")}


def format_searched(searched: dict) -> str:
    """The search space in one paragraph (``gpucourse plan --explain``): what a layout could be, so that a layout
    absent from the ranking reads as left out, not as losing."""
    recompute = {False: "none", "selective": "selective", True: "full"}
    degrees = "; ".join(f"{k} {_degrees(searched[k])}" for k in ("tp", "pp", "dp", "cp", "ep")
                        if searched[k] and (k != "ep" or searched[k] != [1]))  # ep only for a mixture of experts
    schedules = ", ".join(searched["schedules"]) or "none (no pipeline)"
    return (f"searched {searched['layouts']} layouts: {degrees}; ZeRO {_degrees(searched['zero'])}; pipeline "
            f"schedules {schedules} (iN: interleaved, N chunks a rank); recomputation "
            f"{_degrees([recompute[k] for k in searched['recompute']])}"
            + ("; the optimizer on the GPU or the CPU" if len(searched["offload"]) > 1 else "")
            + f"; {searched['cp_rule']}. A tensor-parallel group stays inside a server.")


def _degrees(values) -> str:
    values = sorted(values)
    return ", ".join(map(str, values[:-1])) + " and " + str(values[-1]) if len(values) > 1 else str(values[0])


def _notes(shape: Shape, batch_size: int, left_out: dict, refused: list[str]) -> list[str]:
    """What narrowed the search, said once: degrees the shape or the batch rule out, layouts no run could take."""
    notes = []
    if "tp" in left_out:
        kv = f" and split or replicate its {shape.kv} K/V heads evenly" if shape.kv != shape.heads else ""
        notes.append(f"tp {_degrees(left_out['tp'])} left out: tensor parallelism must divide the model's "
                     f"{shape.heads} attention heads{kv}.")
    if "pp" in left_out:
        notes.append(f"pp {_degrees(left_out['pp'])} left out: a pipeline stage needs at least one of the model's "
                     f"{shape.layers} blocks.")
    if "dp" in left_out:
        notes.append(f"dp {_degrees(left_out['dp'])} left out: data parallelism must divide the batch of "
                     f"{batch_size} sequences.")
    if refused:
        notes.append(f"{len(refused)} layout{'s' * (len(refused) > 1)} left out as no run could take "
                     f"{'them' if len(refused) > 1 else 'it'}, e.g. {refused[0][0].lower()}{refused[0][1:]}")
    return notes


def _row(cfg: TrainConfig, shape: Shape, mem: dict, spec, gpus_per_node: int, efficiency, overlap: Overlap,
         matmuls: str, offload: bool) -> dict:
    """One layout's line of :func:`plan`: its memory, whether it fits, its timed step."""
    return {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep, "sp": cfg.sequence_parallel,
            "zero": cfg.zero, "schedule": cfg.schedule if cfg.pp > 1 else "", "microbatches": cfg.microbatches,
            "grad_accum": cfg.grad_accum, "checkpoint_activations": cfg.checkpoint_activations,
            "memory": mem["max"], "memory_total": mem["max_total"], "host_bytes": mem.get("host_bytes", 0.0),
            "memory_parts": mem.get("parts"),
            "fits": mem["max_total"] <= spec.usable_bytes(), "config": cfg.to_dict(),
            "kv_replication": shape.kv_replication(cfg.tp),
            "memory_source": COURSE_MEMORY if shape.is_course_block else
            "from the shape's own parameters and Korthikanti et al.'s activations",
            **step_time(cfg, mem["num_params"], spec, gpus_per_node, efficiency, shape, overlap, matmuls,
                       offload).as_dict()}


COURSE_MEMORY = "gpucourse memory's estimate"
# How a row's recomputation reads: in a layout's description, and in the table's ckpt column.
RECOMPUTE_NOTE = {False: "", "selective": ", selective recomputation", True: ", checkpointing"}
CKPT_COLUMN = {False: "no", "selective": "sel", True: "yes"}
PARTS = {"compute": "compute", "recompute": "recompute", "bubble": "bubble", "tp": "tp comm", "cp": "cp comm",
         "ep": "ep comm", "pp": "pp comm", "dp": "dp comm exposed", "optimizer": "optimizer"}


def schedule_name(row: dict) -> str:
    """A row's pipeline schedule, short: "1f1b", "i2" (interleaved, 2 chunks a rank), "" without a pipeline."""
    if not row.get("schedule"):
        return ""
    return f"i{row['config']['virtual_stages']}" if get_schedule(row["schedule"]).interleaved else row["schedule"]


def explain(row: dict) -> str:
    """One layout's step as its parts, each with its share, and the memory it needs per GPU: what makes it fast or
    slow (``gpucourse plan --explain``)."""
    layout = " ".join(f"{k} {row[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if row.get(k, 1) > 1) or "one GPU"
    if row.get("schedule"):
        v = row["config"]["virtual_stages"]
        layout += f" ({row['schedule']}{f', {v} chunks a rank' if get_schedule(row['schedule']).interleaved else ''})"
    layout += f", ZeRO-{row['zero']}" * bool(row["zero"]) + RECOMPUTE_NOTE[row["checkpoint_activations"]]
    if row.get("offload"):
        moved = row["offload"]
        layout += (f", optimizer on the CPU ({human_bytes(row['host_bytes'])} of host memory; to the host "
                   f"{moved['to_host_s']:.2f} s, CPU Adam {moved['cpu_adam_s']:.2f} s, back {moved['to_gpu_s']:.2f} s)")
    if row.get("kv_replication", 1) > 1:  # more tensor-parallel ranks than K/V heads
        layout += f" (each K/V head held by {row['kv_replication']} of the tp ranks)"
    parts = ", ".join(f"{PARTS[k]} {v:.2f} s ({v / row['step_s']:.0%})" for k, v in row["parts"].items()
                      if v >= 0.005)
    hidden = [f"{k} {row[f'{k}_comm_s'] - (row['parts'][k]):.2f} s" for k in ("tp", "cp", "pp", "dp")
              if row.get(f"{k}_comm_s", 0) - row["parts"][k] >= 0.005]
    hides = f"; hidden behind compute: {', '.join(hidden)}" if hidden else ""
    return (f"{layout}: step {row['step_s']:.2f} s = {parts}{hides}; {human_bytes(row['memory_total'])} per GPU "
            f"({row.get('memory_source', COURSE_MEMORY)}){memory_terms(row['memory'], row.get('memory_parts'))}")


def memory_terms(mem: dict, parts: dict | None = None) -> str:
    """The memory of one GPU as its parts: ``: weights …, gradients …, optimizer …, activations …``, and where the
    row has its :class:`~gpucourse.modeled.memory.MemoryParts` (``as_dict``), what each is made of: bytes a
    parameter and the ZeRO shards, the fp8 copies, the activations' factors (one layer × layers × microbatches in
    flight, the recomputation and the attention kernel) and each communication buffer."""
    if not parts:
        return ": " + ", ".join(f"{k} {human_bytes(mem[k])}" for k in ("weights", "gradients", "optimizer",
                                                                         "activations"))
    d, zero = parts["shards"], parts["zero"]

    def each(name: str, sharded: bool) -> str:
        return f"{parts[name + '_bytes']} bytes a parameter" + (f" ÷ {d}" if sharded and d > 1 else "")

    in_fp8 = parts.get("fp8_params", 0)
    terms = [f"weights {human_bytes(parts['weights'])} ({each('weight', zero == 3)}"
             + f", {in_fp8:,.0f} of the {parts['params']:,.0f} in fp8 at 1 byte" * bool(in_fp8) + ")"]
    if parts["fp8_copies"]:
        terms.append(f"fp8 copies {human_bytes(parts['fp8_copies'])} ({fp8_copies_are(parts)})")
    terms += [f"gradients {human_bytes(parts['gradients'])} ({each('grad', zero >= 2)})",
              f"optimizer {human_bytes(parts['optimizer'])} ({each('optimizer', zero >= 1)})",
              f"activations {human_bytes(parts['activations'])} ({human_bytes(parts['layer_bytes'])} a layer and "
              f"microbatch × {parts['layers']} layers × {parts['in_flight']:.3g} "
              f"microbatch{'es' * (parts['in_flight'] != 1)} in flight + "
              f"{human_bytes(parts['ends_bytes'])} at the ends; recompute {parts['recompute']}, "
              f"{parts['attention']} attention)"]
    terms += [f"{name.replace('_', ' ')} buffer {human_bytes(b)}" for name, b in parts["buffers"].items()]
    return ": " + ", ".join(terms)


def format_plan(result: dict, top: int = 10, explained: bool = False) -> str:
    """The ranked table ``gpucourse plan`` prints; ``explained``: each row's step as parts below it."""
    fitting = [r for r in result["layouts"] if r["fits"]]
    gpu = result["gpu"]
    cp_head = f" {'cp':>3} {'sp':>3}" if result["seq_len"] >= LONG_SEQUENCE else ""  # long sequences: cp and sp too
    ep_head = f" {'ep':>3}" if "active_params" in result else ""  # a mixture of experts: expert parallelism too
    off_head = f" {'offl':>4}" if result.get("offload") else ""  # offload tried: which rows step on the CPU
    shape = get_shape({k: v for k, v in result["shape"].items() if k != "source"})
    experts = f": {result['active_params'] / 1e9:.1f} B active per token" if ep_head else ""
    lines = [f"{result['params'] / 1e9:.1f} B parameters ({shape.describe()}{experts}) on {result['gpus']} × "
             f"{gpu['name']} ({gpu['memory_gb']:g} GB, "
             f"{result['gpus_per_node']} per node), batch {result['batch_size']} × {result['seq_len']} tokens, "
             f"{result['precision']} with fp32 master weights",
             f"{len(fitting)} of {len(result['layouts'])} layouts fit; the fastest, by the timing model:",
             f"  {'dp':>4}{ep_head} {'tp':>3} {'pp':>3}{cp_head} {'sched':>5} {'zero':>4}{off_head} {'ckpt':>4} "
             f"{'memory/GPU':>11} "
             f"{'step':>8} {'compute':>8} {'comm':>8} {'bubble':>8} {'tokens/s':>10}"]
    for r in fitting[:top]:
        cp = f" {r.get('cp', 1):>3} {'yes' if r.get('sp') else 'no':>3}" if cp_head else ""
        ep = f" {r.get('ep', 1):>3}" if ep_head else ""
        off = f" {'yes' if r.get('offload') else 'no':>4}" if off_head else ""
        lines.append(f"  {r['dp']:>4}{ep} {r['tp']:>3} {r['pp']:>3}{cp} {schedule_name(r):>5} {r['zero']:>4}{off} "
                     f"{CKPT_COLUMN[r['checkpoint_activations']]:>4} {human_bytes(r['memory_total']):>11} "
                     f"{r['step_s']:>7.2f}s {r['compute_s']:>7.2f}s {r['communication_s']:>7.2f}s "
                     f"{r['bubble_s']:>7.2f}s {r['tokens_per_s']:>10,.0f}")
        if explained:
            lines.append(textwrap.fill(explain(r), 110, initial_indent="      ", subsequent_indent="        "))
    if not fitting:
        best = min(result["layouts"], key=lambda r: r["memory_total"]) if result["layouts"] else None
        lines.append("  none fits" + (f": the smallest needs {human_bytes(best['memory_total'])} per GPU"
                                      if best else ""))
    lines += [textwrap.fill(note, 110, initial_indent="  note: ", subsequent_indent="        ")
              for note in result.get("notes", [])]
    if explained and result.get("searched"):
        lines.append(textwrap.fill(format_searched(result["searched"]), 110, initial_indent="  ",
                                   subsequent_indent="    "))
    return "\n".join(lines)
