"""How much memory a layout needs per rank, before it runs — by the same categories a run measures.

Four categories (bytes per rank):

- **weights**: the parameters this rank holds. Tensor parallelism splits the
  blocks' q, k, v, attention projection and MLP matrices tp ways (biases of the
  row-parallel projections, LayerNorms and embeddings stay whole); a pipeline
  stage holds only its blocks (plus embeddings on the first stage, final norm
  and head on the last); ZeRO-3 splits everything dp ways.
- **gradients**: one per trainable weight, in the weights' precision; ZeRO-2
  and 3 keep only 1/dp of them.
- **optimizer**: Adam's two fp32 moments (8 bytes per parameter), plus the fp32
  master copy (4 more) when the weights themselves are half precision;
  ZeRO-1 and up keep 1/dp. ZeRO from scratch pads the flat buffer to a multiple
  of dp: S = ceil(P / dp) and P' = S·dp, exactly as ``parallel/zero.py``.
- **activations**: the tensors autograd saves for backward, for every
  microbatch a rank holds at once (1 with gradient accumulation; on a pipeline
  stage, the schedule's peak in flight). Per block, for b sequences of T tokens
  of width C and h heads, in fp32: 16·bTC bytes replicated across tensor
  parallelism (the two LayerNorms' inputs and outputs), 48·bTC/tp sharded
  (q, k, v, attention output, MLP hidden layer before and after GELU),
  16·bT for LayerNorm statistics and 4·b·(h/tp)·T for attention's
  log-sum-exp. Attention written out (``attention="math"``) keeps its softmax
  output instead of the log-sum-exp, b·(h/tp)·T² numbers, and its causal mask,
  T² bytes; selective recomputation drops both (and the log-sum-exp). With
  full checkpointing a block keeps only its input, 4·bTC. The
  first stage adds the token ids; the last the final norm's and head's inputs,
  the logits and the targets. These counts are what autograd saves in
  ``gpucourse.model`` (the tests compare them with measured runs); half
  precision roughly halves them.

``estimate(config)`` takes the same TrainConfig as ``train`` — so any run can be
sized before it starts, at any model size and layout — and
``estimate_params(N, ...)`` the parameter-only part for a model of N parameters.

Beside the categories, each estimate names its parts (:class:`MemoryParts`, as
:class:`gpucourse.modeled.costs.StepTime` names a step's): the weights and their
bytes a parameter, fp8 copies, gradients, the optimizer's shard, the activations
by factor (:class:`Activations`: one layer, the layers, the microbatches the
schedule holds, the recomputation and the attention kernel) and the
**communication buffers** a strategy keeps besides (here: from-scratch ZeRO-3's
weights gathered whole). ``gpucourse memory`` prints them (:func:`format_parts`),
and so does ``gpucourse plan --explain`` for the frameworks it sizes
(:func:`gpucourse.modeled.plan.memory_parts`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from ..config import AUTO_PRECISION, TrainConfig, allowed
from ..model import GPTConfig
from ..parallel import check
from ..parallel.pipeline import stage_blocks
from ..parallel.schedule_table import get as get_schedule
from ..readable import ConfigError
from ..readable import human_bytes
from ..values import NON_NEGATIVE_NUMBER

CATEGORIES = ("weights", "gradients", "optimizer", "activations")

# Bytes saved per (token × channel) of one block: (replicated, sharded over tp).
_BLOCK_BYTES = {"fp32": (16, 48), "autocast": (16, 30.5), "half": (8, 24)}


@dataclass(frozen=True)
class Activations:
    """What autograd keeps for backward on one rank at its peak, by factor (bytes)."""

    layer_bytes: float  # one layer (a block), one microbatch
    layers: int         # the layers this rank holds
    in_flight: float    # microbatches held at the peak, in whole stages (the layer-microbatches held ÷ layers)
    total: float        # all of it: the layers' and what the pipeline's ends keep (token ids, the loss's logits)
    recompute: str = "none"    # none, selective (attention's core recomputed) or full (each layer keeps its input)
    attention: str = "flash"   # flash: fused, no T × T scores kept; math: the scores written out

    @property
    def ends_bytes(self) -> float:
        """Beside the layers: the first stage's token ids, the last's final norm, head, logits and targets."""
        return self.total - self.layer_bytes * self.layers * self.in_flight


@dataclass(frozen=True)
class MemoryParts:
    """One rank's memory by named part, in bytes, each beside what it is made of.

    ``weights``: the parameters it computes with (``params`` of them held, ``weight_bytes`` each, but for
    ``fp8_params`` of them kept in fp8, 1 byte each; ZeRO-3 keeps 1/``shards`` of them). ``fp8_copies``: what
    Transformer Engine keeps of each matmul weight besides: its fp8 copy of a bf16 weight, and where the GPU's fp8
    GEMMs take only one layout (``fp8_transposed``) its transpose — of a weight kept in fp8, the transpose alone.
    ``gradients``: ``grad_bytes`` each (ZeRO-2 and 3: 1/``shards``). ``optimizer``: ``optimizer_bytes`` each —
    Adam's two fp32 moments, and the fp32 master copy where the weights are half precision — 1/``shards`` of
    them from ZeRO-1 on (Megatron-LM's distributed optimizer is ZeRO-1). ``activations``: :class:`Activations`.
    ``buffers``: each communication buffer kept besides, by name. ``categories`` folds them into the four a run
    measures (fp8 copies are weights); ``total`` is everything.
    """

    stage: int
    params: float
    weights: float
    gradients: float
    optimizer: float
    activations: Activations
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    zero: int = 0
    shards: int = 1
    fp8_copies: float = 0.0
    buffers: dict = field(default_factory=dict)
    kept_by: str = "gpucourse"   # whose tensors these are: the course's runtime, or a framework's name
    fp8_params: float = 0.0      # of ``params``, those kept in fp8 themselves (Megatron-Core's fp8_param_gather)
    fp8_transposed: bool = True  # whether ``fp8_copies`` hold transposes (fp8 GEMMs that take only "TN")

    @property
    def categories(self) -> dict:
        return {"weights": self.weights + self.fp8_copies, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations.total}

    @property
    def buffers_bytes(self) -> float:
        return sum(self.buffers.values())

    @property
    def total(self) -> float:
        return sum(self.categories.values()) + self.buffers_bytes

    def as_dict(self) -> dict:
        """The parts as plain data (a plan's rows and ``--json`` hold this): every field, the activations' factors
        flat beside them (``layer_bytes``, ``layers``, ``in_flight``, ``ends_bytes``, ``recompute``,
        ``attention``), ``activations`` and ``buffers_bytes`` in bytes and the ``total``."""
        act = self.activations
        return {"stage": self.stage, "params": self.params, "weights": self.weights, "fp8_copies": self.fp8_copies,
                "fp8_params": self.fp8_params, "fp8_transposed": self.fp8_transposed,
                "gradients": self.gradients, "optimizer": self.optimizer, "activations": act.total,
                "buffers": dict(self.buffers), "buffers_bytes": self.buffers_bytes, "total": self.total,
                "weight_bytes": self.weight_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "zero": self.zero, "shards": self.shards,
                "kept_by": self.kept_by, "layer_bytes": act.layer_bytes, "layers": act.layers,
                "in_flight": act.in_flight, "ends_bytes": act.ends_bytes, "recompute": act.recompute,
                "attention": act.attention}


# What each communication buffer is, as format_parts names it.
BUFFERS = {
    "zero3_gathered": "ZeRO-3's weights gathered whole while they compute",
    "zero3_gradients": "ZeRO-3's gradients of a unit whole until their reduce-scatter",
    "sp_gather": "the all-gathered sequence a column-parallel matmul reads (sequence parallelism)",
    "ddp_buckets": "DDP's buckets, a copy of the gradients",
}


def bytes_per_param(precision: str, master_weights: bool) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes a parameter: half-precision weights and gradients with an fp32 master
    copy beside Adam's two fp32 moments (2, 2, 12: ZeRO's (2 + 2 + K)·Ψ with K = 12); otherwise fp32 weights and
    gradients (autocast computes in half precision from them) and the two moments (4, 4, 8)."""
    half = precision != "fp32" and master_weights
    return (2, 2, 12) if half else (4, 4, 8)


def chunk_layers(layers: int, pp: int, v: int = 1, placement: str = "loop",
                 ends_as_layers: bool = False) -> list[list[list[int]]]:
    """Per pipeline rank, per model chunk it holds, the layer ids of the chunk.

    The layers split over the pp·v virtual stages as the runtime splits blocks over stages (balanced and
    contiguous, earlier ones one more), placed as the schedule's record says (``placement``: looping through the
    ranks, or in a V). ``ends_as_layers``: the input embedding and the loss each take one layer's place in the split
    (Llama 3's balancing, Dubey et al. 2024, section 3.3.2: a layer fewer on the first and the last stage, so the
    first chunk of the first stage may hold the embedding alone; Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``).
    """
    return [[list(chunk) for chunk in row] for row in _chunk_layers(layers, pp, v, placement, ends_as_layers)]


@functools.lru_cache(maxsize=4096)
def _chunk_layers(layers: int, pp: int, v: int, placement: str, ends_as_layers: bool) -> tuple:
    from ..parallel.schedules_virtual import Layout

    layout = Layout(pp, v, "v" if placement == "v" else "loop")
    slots = layers + 2 if ends_as_layers else layers
    held = [[() for _ in range(v)] for _ in range(pp)]
    for vstage in range(layout.stages):
        ids = stage_blocks(slots, layout.stages, vstage)
        rank, chunk = layout.place(vstage)
        held[rank][chunk] = tuple(i - 1 for i in ids if 0 < i <= layers) if ends_as_layers else tuple(ids)
    return tuple(tuple(row) for row in held)


def held_layers(schedule: str, pp: int, m: int, chunks: list[list[list[int]]]) -> list[float]:
    """Per rank, the most layer-microbatches it holds activations for at once: the schedule's ops replayed in the
    order the rank runs them, each forward adding its chunk's layers and the op that frees them (the backward, or W
    where it is split off) taking them away. A one-chunk schedule's record gives its peak in closed form."""
    return list(_held_layers(schedule, pp, m, tuple(tuple(len(chunk) for chunk in row) for row in chunks)))


@functools.lru_cache(maxsize=1024)
def _held_layers(schedule: str, pp: int, m: int, counts: tuple) -> tuple:
    if pp == 1:
        return (float(sum(counts[0])),)
    record = get_schedule(schedule)
    if record.in_flight is not None:
        return tuple(float(peak * counts[rank][0]) for rank, peak in enumerate(record.in_flight(pp, m)))
    ops, _ = _virtual(schedule, pp, m, len(counts[0]))
    return tuple(_weighted_peaks(ops, counts))


@dataclass(frozen=True)
class BlockParams:
    """Parameters of one transformer block, split by how tensor parallelism treats them."""

    sharded: int     # q, k, v, fc (weights and biases) and both projection weights
    replicated: int  # LayerNorms and the two projection biases


def block_params(mc: GPTConfig) -> BlockParams:
    C = mc.n_embd
    sharded = (C * C + C) + C * C + (C * C + C) + C * C + (4 * C * C + 4 * C) + 4 * C * C  # k has no bias
    replicated = 4 * C + C + C
    return BlockParams(sharded, replicated)


def expert_params(mc: GPTConfig, tp: int = 1) -> int:
    """Parameters of one expert (an MLP) on one rank: fc and proj weights and fc's bias cut tp ways, proj's bias whole."""
    C = mc.n_embd
    return (4 * C * C + 4 * C + 4 * C * C) // tp + C


def moe_block_params(mc: GPTConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(everything but the experts, the experts) one rank holds of a mixture-of-experts block: the attention,
    norms and router (replicated), and E/ep experts."""
    bp = block_params(mc)
    # The block's own MLP is one expert's size; the router is C × E, no bias.
    dense = bp.sharded // tp + bp.replicated - expert_params(mc, tp) + mc.n_embd * mc.moe_experts
    return dense, mc.moe_experts // ep * expert_params(mc, tp)


def stage_units(mc: GPTConfig, pp: int, stage: int, tp: int, ep: int = 1) -> dict:
    """Parameters one rank holds on stage ``stage`` of ``pp`` (its 1/tp share of the blocks), by unit.

    The units are ZeRO-3's (``parallel/zero3.py``): each block (``blocks.i``), and
    the rest (``root``: embeddings on the first stage, final norm and head on the last).
    A mixture-of-experts block holds its E/ep experts.
    """
    bp = block_params(mc)
    units = {f"blocks.{i}": sum(moe_block_params(mc, tp, ep)) if mc.is_moe(i) else bp.sharded // tp + bp.replicated
             for i in stage_blocks(mc.n_layer, pp, stage)}
    root = 0
    if stage == 0:
        root += mc.vocab_size * mc.n_embd + mc.block_size * mc.n_embd  # token and position embeddings
    if stage == pp - 1:
        root += 2 * mc.n_embd + mc.n_embd * mc.vocab_size             # final LayerNorm and head
    if root:
        units["root"] = root
    return units


def stage_params(mc: GPTConfig, pp: int, stage: int, tp: int, ep: int = 1) -> int:
    """Parameters one rank holds: stage ``stage`` of ``pp``, its 1/tp share of the blocks (E/ep experts)."""
    return sum(stage_units(mc, pp, stage, tp, ep).values())


def stage_expert_params(mc: GPTConfig, pp: int, stage: int, tp: int, ep: int) -> int:
    """Of :func:`stage_params`, the experts' (replicated over dp/ep ranks, not dp)."""
    return sum(moe_block_params(mc, tp, ep)[1] for i in stage_blocks(mc.n_layer, pp, stage) if mc.is_moe(i))


def active_params(mc: GPTConfig) -> int:
    """Parameters one token's forward uses: all but the experts it is not routed to."""
    blocks = sum(mc.is_moe(i) for i in range(mc.n_layer))
    return num_params(mc) - blocks * (mc.moe_experts - mc.moe_top_k) * expert_params(mc)


def moe_activation_bytes(mc: GPTConfig, b: int, T: int, tp: int = 1, ep: int = 1) -> float:
    """What one mixture-of-experts block saves beyond its attention (fp32), for b sequences of T tokens.

    Counted on the model and checked against runs: per token choice (N·k of them, N = b·T tokens, assuming the
    choices spread evenly over the experts' ranks under ep) the expert's input and output, fc's output and
    GELU's (4 + 4 + 16 + 16 bytes per channel), the weighted output again (4) and 32 bytes of indices and
    weights; per token the router's probabilities (4·E) and 4 bytes; per sequence the balance loss's
    fractions (4·E). Tensor parallelism cuts the hidden layer (the 32 bytes per channel of fc and GELU).
    Expert parallelism keeps one more row per choice and its index and mask (4·C + 9 bytes, measured).
    """
    N, C, E, k = b * T, mc.n_embd, mc.moe_experts, mc.moe_top_k
    dispatch = N * k * (4 * C + 9) if ep > 1 else 0
    return N * k * (12 * C + 32 * C / tp + 32) + N * (4 * E + 4) + 4 * b * E + dispatch


def num_params(mc: GPTConfig) -> int:
    """All parameters of the model (equals ``sum(p.numel())`` of ``gpucourse.model.GPT``)."""
    return stage_params(mc, 1, 0, 1)


def _regime(cfg: TrainConfig) -> str:
    if cfg.precision == "fp32":
        return "fp32"
    return "half" if cfg.master_weights else "autocast"


def estimate_params(num: int, dp: int = 1, zero: int = 0, precision: str = "fp32",
                    master_weights: bool = False, scratch_padding: bool = True, units=None) -> dict:
    """Weights, gradients and optimizer bytes per rank for ``num`` parameters on one rank's share.

    ``units``: the parameter counts of ZeRO-3's units, each padded to a multiple of dp
    on its own in the from-scratch ZeRO-3 (``scratch_padding``).
    """
    NON_NEGATIVE_NUMBER.check(num, "num")
    for name, value in (("dp", dp), ("zero", zero), ("precision", precision)):
        allowed(name).check(value, name)
    half = precision != "fp32" and master_weights
    w = 2 if half else 4
    opt_per_param = 8 + (4 if half else 0)
    shard = math.ceil(num / dp)
    if zero == 3 and scratch_padding and units:
        shard = sum(math.ceil(n / dp) for n in units)
    padded = shard * dp if (zero in (1, 2) and scratch_padding) else num
    return {
        "weights": w * (shard if zero == 3 else padded),
        "gradients": w * (shard if zero >= 2 else padded),
        "optimizer": opt_per_param * (shard if zero >= 1 else num),
    }


def _activation_bytes(cfg: TrainConfig, mc: GPTConfig, stage: int, in_flight: float) -> int:
    per_block, blocks, ids, head = _activation_parts(cfg, mc, stage)
    return int((blocks * per_block + ids + head) * in_flight)


def _activation_parts(cfg: TrainConfig, mc: GPTConfig, stage: int) -> tuple[float, int, float, float]:
    """One microbatch's activations on pipeline rank ``stage``: (bytes per block, its blocks, the token ids it
    holds on the first rank, the final norm's and head's inputs, logits and targets on the loss's)."""
    b = cfg.batch_size // _forwards(cfg)
    # Context parallelism: a rank holds T/cp tokens of each sequence all the way through.
    T, C, V, tp = cfg.seq_len // cfg.cp, mc.n_embd, mc.vocab_size, cfg.tp
    regime = _regime(cfg)
    scale = 0.5 if regime == "half" else 1.0
    in_stage = stage_blocks(mc.n_layer, cfg.pp, stage)
    blocks = len(in_stage)
    sp = tp if cfg.sequence_parallel else 1  # sequence parallelism: T/tp tokens between sub-layers
    heads = mc.n_head // tp
    if cfg.recompute == "full":
        per_block = 4 * scale * b * T * C / sp
    else:
        rep, shard = _BLOCK_BYTES[regime]
        # Under sequence parallelism the LayerNorms' inputs (half of ``rep``) and statistics hold T/tp
        # tokens; their outputs, all-gathered for q, k, v and fc (which keep them), stay whole.
        rep = rep / 2 / sp + rep / 2
        per_block = b * T * C * (rep + shard / tp) + scale * 16 * b * T / sp + _attention_core_bytes(cfg, b, T, heads)
        per_block += _context_attention_bytes(cfg, b, T, C / tp)
    moe_blocks = sum(mc.is_moe(i) for i in in_stage)
    if moe_blocks and cfg.recompute != "full":  # the MLP's 32 bytes per channel (fp32) become the experts'
        per_block += moe_blocks / blocks * scale * (moe_activation_bytes(mc, b, T, tp, cfg.ep) - 32 * b * T * C / tp)
    ids = 8 * b * T + 8 * T if stage == 0 else 0.0            # token ids, positions
    head = scale * (8 * b * T * C + 4 * b * T * V) + 16 * b * T + 4 if stage == _loss_stage(cfg) else 0.0
    return per_block, blocks, ids, head


def _attention_core_bytes(cfg: TrainConfig, b: int, t: int, heads: int) -> float:
    """What attention's core (scores to weighted sum) keeps beyond its queries, keys and values, per block: the
    fused kernel's log-sum-exp (fp32 in every precision, 4·b·heads·t); written out, the
    softmax's output (b·heads·t² in the weights' precision) and the causal mask (t² bytes); nothing when it is
    recomputed (selective)."""
    if cfg.recompute == "selective":
        return 0.0
    if cfg.attention == "math":
        return (2 if _regime(cfg) == "half" else 4) * b * heads * t * t + t * t
    return 4 * b * heads * t


def _chunk_shares(cfg: TrainConfig, mc: GPTConfig, layout) -> list[list[float]]:
    """Per rank, each chunk's share of the rank's activations for one microbatch: its own blocks, the token ids
    with virtual stage 0 and the head's with the last."""
    shares = []
    for stage in range(cfg.pp):
        per_block, blocks, ids, head = _activation_parts(cfg, mc, stage)
        total = blocks * per_block + ids + head
        row = []
        for chunk in range(layout.v):
            vstage = layout.virtual(stage, chunk)
            mine = len(stage_blocks(mc.n_layer, layout.stages, vstage)) * per_block
            mine += (ids if vstage == 0 else 0.0) + (head if vstage == layout.stages - 1 else 0.0)
            row.append(mine / total)
        shares.append(row)
    return shares


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """One transformer layer's activation bytes per GPU by Korthikanti et al. (2022), 16-bit activations.

    s tokens per sequence, b sequences, hidden size h, a heads, tensor parallelism tp:

    - no recompute: s·b·h·(34 + 5·a·s/h) on one GPU; with tp, s·b·h·(10 + 24/tp + 5·a·s/(h·tp)) — the 10 is
      what stays replicated between sub-layers (LayerNorms, dropout, residual); with tp and sequence
      parallelism s·b·h·(34/tp + 5·a·s/(h·tp)): everything divided by tp;
    - ``recompute="selective"``: attention's softmax, dropout and score terms (the 5·a·s/h) recomputed;
    - ``recompute="full"``: each layer keeps only its input, 2·s·b·h (divided by tp under sequence parallelism).

    Their count is for Megatron's GPT in 16 bit; ``estimate`` counts what this course's model keeps.
    """
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h / tp
    between = 10 / tp if sp else 10  # LayerNorms, dropout and the residual: replicated unless SP
    return s * b * h * (between + 24 / tp + attention)


def _context_attention_bytes(cfg: TrainConfig, b: int, t: int, width: float) -> float:
    """What context-parallel attention keeps beyond one device's (fp32; t tokens a rank holds, width = C/tp): its
    algorithm's record says (:data:`gpucourse.parallel.context_parallel.ATTENTIONS`)."""
    if cfg.cp == 1:
        return 0
    from ..parallel.context_parallel import ATTENTIONS

    return ATTENTIONS[cfg.cp_algo].kept(b, t, t * cfg.cp, width)


def _loss_stage(cfg: TrainConfig) -> int:
    """The pipeline rank that holds the final norm and the head: the last, or on the V placement the first."""
    from ..parallel.schedule_table import get

    return 0 if get(cfg.schedule).placement == "v" else cfg.pp - 1


@functools.lru_cache(maxsize=256)
def _virtual(schedule: str, pp: int, m: int, v: int):
    """A multi-chunk schedule's (ops, layout), built once per shape (read, never changed, by this module)."""
    from ..parallel import schedules_virtual

    return schedules_virtual.build(schedule, pp, m, v)


@functools.lru_cache(maxsize=1024)
def _cached_in_flight(schedule: str, pp: int, m: int, virtual_stages: int, shares) -> tuple:
    return tuple(_in_flight(schedule, pp, m, virtual_stages, shares))


def in_flight(schedule: str, pp: int, m: int, virtual_stages: int = 2, shares=None) -> list[float]:
    """Most microbatches each stage holds activations for at once (see :func:`_in_flight`); cached by shape."""
    if shares is not None and not isinstance(shares, tuple):
        shares = tuple(tuple(row) for row in shares)
    return list(_cached_in_flight(schedule, pp, m, virtual_stages, shares))


def _in_flight(schedule: str, pp: int, m: int, virtual_stages: int = 2, shares=None) -> list[float]:
    """Most microbatches each stage holds activations for at once (what ``schedules.simulate`` finds).

    With several chunks per rank (interleaved, V) or a split backward, the peak of microbatch-chunks held, each
    1/v of a stage's activations — or, given ``shares[rank][chunk]`` (each chunk's share of its rank's
    activations), the peak of their weighted sum, in the order the rank runs its ops (a zero-bubble W keeps its
    chunk's until it runs).
    """
    if pp == 1:
        return [1]
    from ..parallel import schedules_virtual
    from ..parallel.schedule_table import get

    record = get(schedule)
    if record.in_flight is not None:  # a one-chunk schedule's closed form
        return record.in_flight(pp, m)
    ops, layout = _virtual(schedule, pp, m, virtual_stages)
    if shares is None:
        return [peak / layout.v for peak in schedules_virtual.simulate(ops, layout, m).peak_in_flight]
    return _weighted_peaks(ops, shares)


def _weighted_peaks(ops, shares) -> list[float]:
    """Per rank, the most of its activations held at once: +share at a chunk's forward, −share where that
    microbatch's chunk is done with them (its W where the backward is split, else its B)."""
    from ..parallel.schedules import B, F, W

    peaks = []
    for rank, row in enumerate(ops):
        frees = W if any(op.kind == W for op in row) else B
        held = peak = 0.0
        for op in row:
            if op.kind == F:
                held += shares[rank][op.chunk]
                peak = max(peak, held)
            elif op.kind == frees:
                held -= shares[rank][op.chunk]
        peaks.append(peak)
    return peaks


def estimate(cfg: TrainConfig, every_rank: bool = True) -> dict:
    """Memory per rank for ``cfg``: ``{"per_rank": {rank: {category: bytes}}, "max": {...}, ...}``.

    ``max``: the busiest rank's four categories; ``max_total``: their sum and the communication buffers it keeps
    besides; ``parts``: that rank's :class:`MemoryParts` (``as_dict``).

    Ranks follow the run's DeviceMesh (dims pp, dp, tp; tp innermost), so rank r
    is on pipeline stage r // (dp·tp). ``every_rank=False``: ``per_rank`` holds the first rank of each
    pipeline stage only (the others of a stage hold the same), as a planner sizing thousands of GPUs wants.
    """
    if cfg.precision == AUTO_PRECISION:
        raise ConfigError("precision 'auto' is chosen where the ranks run (gpucourse.platforms.resolve); an "
                          "estimate on paper needs fp32, bf16 or fp16.")
    check(cfg, runnable=False)
    mc = cfg.model_config()
    from ..parallel import schedules_virtual

    shares = None
    if cfg.pp > 1 and cfg.schedule in schedules_virtual.SCHEDULES:  # chunks of unequal weight: count each its own
        shares = _chunk_shares(cfg, mc, _virtual(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)[1])
        shares = tuple(tuple(row) for row in shares)
    held = in_flight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages, shares)
    per_stage = []
    for stage in range(cfg.pp):
        units = stage_units(mc, cfg.pp, stage, cfg.tp, cfg.ep)
        if _loss_stage(cfg) != cfg.pp - 1 and cfg.pp > 1:  # the V placement: the head lives with the embeddings
            head = 2 * mc.n_embd + mc.n_embd * mc.vocab_size
            units["root"] = units.get("root", 0) + (head if stage == 0 else -head if stage == cfg.pp - 1 else 0)
            if not units["root"]:
                del units["root"]
        n = sum(units.values())
        # ZeRO shards over every rank holding the same weights: dp × cp (context-parallel ranks too); under
        # expert parallelism the experts' weights over their dp/ep replicas, in a flat buffer of their own.
        experts = stage_expert_params(mc, cfg.pp, stage, cfg.tp, cfg.ep) if cfg.ep > 1 else 0
        mem = estimate_params(n - experts, cfg.dp * cfg.cp, cfg.zero, cfg.precision, cfg.master_weights,
                              scratch_padding=cfg.impl == "scratch", units=units.values())
        if experts:
            mem = {c: v + w for (c, v), w in zip(mem.items(), estimate_params(
                experts, cfg.dp // cfg.ep, cfg.zero, cfg.precision, cfg.master_weights,
                scratch_padding=cfg.impl == "scratch").values())}
        mem["activations"] = _activation_bytes(cfg, mc, stage, held[stage])
        gathered = _gathered_bytes(cfg, units)
        per_stage.append((n, mem, gathered, _course_parts(cfg, mc, stage, n, mem, held[stage], gathered)))
    stage_ranks = cfg.world_size // cfg.pp  # the mesh is (pp, dp, cp, tp): each stage's ranks are contiguous
    ranks = range(cfg.world_size) if every_rank else range(0, cfg.world_size, stage_ranks)
    per_rank = {r: dict(per_stage[r // stage_ranks][1]) for r in ranks}
    _, worst, gathered, parts = max(per_stage, key=lambda s: sum(s[1].values()) + s[2])
    est = {"config": cfg.to_dict(), "num_params": num_params(mc),
           "params_per_rank": {r: per_stage[r // stage_ranks][0] for r in ranks},
           "per_rank": per_rank, "max": dict(worst), "max_total": sum(worst.values()) + gathered,
           "in_flight": list(held), "parts": parts.as_dict()}
    if cfg.zero == 3 and cfg.impl == "scratch":
        est["gathered"] = {r: per_stage[r // stage_ranks][2] for r in ranks}
    if mc.moe_experts:
        est["moe"] = moe_summary(cfg)
    return est


def _course_parts(cfg: TrainConfig, mc: GPTConfig, stage: int, n: int, mem: dict, held: float,
                  gathered: float) -> MemoryParts:
    """:class:`MemoryParts` of one rank of pipeline stage ``stage`` as the course's runtime keeps them: the
    categories of :func:`estimate` and, as buffers, from-scratch ZeRO-3's weights gathered whole."""
    per_block, blocks, _, _ = _activation_parts(cfg, mc, stage)
    w, g, o = bytes_per_param(cfg.precision, cfg.master_weights)
    act = Activations(per_block, blocks, held, mem["activations"], cfg.recompute, cfg.attention)
    return MemoryParts(stage, n, mem["weights"], mem["gradients"], mem["optimizer"], act, w, g, o, cfg.zero,
                       cfg.dp * cfg.cp, buffers={"zero3_gathered": gathered} if gathered else {})


def fp8_copies_are(parts: dict) -> str:
    """What a rank's ``fp8_copies`` are (:meth:`MemoryParts.as_dict`'s parts), in words."""
    if parts.get("fp8_params"):
        return "the transpose of each matmul weight kept in fp8: the GPU's fp8 GEMMs take only TN"
    if parts.get("fp8_transposed", True):
        return "each matmul weight once more in fp8, and transposed"
    return "each matmul weight once more in fp8, not transposed: the GPU's fp8 GEMMs read either layout"


def format_parts(parts: dict, indent: str = "  ") -> list[str]:
    """The lines ``gpucourse memory`` prints for one rank's :class:`MemoryParts` (as ``as_dict`` gives them): each
    part, its bytes and what it is made of."""
    hb = functools.partial(human_bytes, binary=True)
    n, d, zero = parts["params"], parts["shards"], parts["zero"]
    shard = {"weights": zero == 3, "gradients": zero >= 2, "optimizer": zero >= 1}
    over = {k: f", ÷ {d} (ZeRO-{zero})" if on and d > 1 else "" for k, on in shard.items()}
    moments = "fp32 master copy and Adam's two moments" if parts["optimizer_bytes"] == 12 else "Adam's two moments"
    f = parts.get("fp8_params", 0)
    held = f"{n - f:,.0f} parameters × {parts['weight_bytes']} bytes" + f" + {f:,.0f} in fp8 × 1 byte" * bool(f)
    rows = [("weights", parts["weights"], held + over["weights"])]
    if parts["fp8_copies"]:
        rows.append(("fp8 copies", parts["fp8_copies"], fp8_copies_are(parts)))
    rows += [("gradients", parts["gradients"], f"× {parts['grad_bytes']} bytes{over['gradients']}"),
             ("optimizer", parts["optimizer"], f"× {parts['optimizer_bytes']} bytes ({moments}){over['optimizer']}"),
             ("activations", parts["activations"],
              f"{hb(parts['layer_bytes'])} a layer and microbatch × {parts['layers']} layers × "
              f"{parts['in_flight']:.3g} microbatch{'es' * (parts['in_flight'] != 1)} in flight\n"
              f"+ {hb(parts['ends_bytes'])} at the pipeline's ends; "
              f"recompute {parts['recompute']}, {parts['attention']} attention")]
    rows += [("buffers", b, BUFFERS.get(name, name)) for name, b in parts["buffers"].items()]
    # A why of two lines goes on under its first, so that each printed line keeps to a notebook's width.
    under = "\n" + " " * (len(indent) + 26)
    lines = [f"{indent}{name:<12}{hb(value):>12}  {why.replace(chr(10), under)}" for name, value, why in rows]
    lines.append(f"{indent}{'total':<12}{hb(parts['total']):>12}")
    return lines


def all_to_all_bytes(cfg: TrainConfig) -> int:
    """Expert parallelism's all-to-all payload per step, summed over every rank (``expert_parallel.py``).

    Per MoE block and forward, each rank of a stage sends E token counts (8 bytes each) and, out and back, its
    kept token choices (N·k rows of C fp32); backward sends the rows out and back again. With no dropping the
    rows are exactly the batch's tokens × k, whatever the routing; every tensor-parallel rank sends them too.
    """
    if cfg.ep == 1:
        return 0
    mc = cfg.model_config()
    blocks = sum(mc.is_moe(i) for i in range(mc.n_layer))
    forwards = cfg.grad_accum * (cfg.microbatches if cfg.pp > 1 else 1)
    counts = cfg.world_size // cfg.pp * mc.moe_experts * 8 * forwards
    rows = cfg.tp * 4 * cfg.batch_size * cfg.seq_len * mc.moe_top_k * mc.n_embd * 4
    return blocks * (counts + rows)


def moe_summary(cfg: TrainConfig) -> dict:
    """Total and active parameters, the experts' weights per rank, and the all-to-all per step."""
    mc = cfg.model_config()
    blocks = sum(mc.is_moe(i) for i in range(mc.n_layer))
    per_expert = expert_params(mc, cfg.tp)
    return {"experts": mc.moe_experts, "top_k": mc.moe_top_k, "moe_blocks": blocks,
            "total_params": num_params(mc), "active_params": active_params(mc),
            "experts_per_rank": mc.moe_experts // cfg.ep,
            "expert_params_per_rank": blocks * mc.moe_experts // cfg.ep * per_expert,
            "expert_params_replicated": blocks * mc.moe_experts * per_expert,
            "all_to_all_bytes_per_step": all_to_all_bytes(cfg)}


def _gathered_bytes(cfg: TrainConfig, units: dict) -> int:
    """From-scratch ZeRO-3's most weights whole at once: the root unit and the largest block, each padded."""
    if not (cfg.zero == 3 and cfg.impl == "scratch"):
        return 0
    from ..parallel.zero3 import memory_formula
    value_bytes = 2 if cfg.precision != "fp32" and cfg.master_weights else 4
    return memory_formula(units, cfg.dp * cfg.cp, value_bytes)["gathered"]


def _forwards(cfg: TrainConfig) -> int:
    """How many forwards share a step's batch: dp ranks × accumulated parts × pipeline microbatches."""
    return cfg.dp * cfg.grad_accum * (cfg.microbatches if cfg.pp > 1 else 1)


def with_microbatch(cfg: TrainConfig, micro: int) -> TrainConfig:
    """``cfg`` with its global batch set so each forward sees ``micro`` sequences."""
    return dataclasses.replace(cfg, batch_size=micro * _forwards(cfg))


def largest_microbatch(cfg: TrainConfig, budget_bytes: float, fits=None, limit: int = 1 << 16) -> dict:
    """The largest microbatch (sequences per forward on one rank) whose memory stays within ``budget_bytes``.

    ``fits(config) -> bool`` decides; by default the estimate's busiest rank
    must stay within the budget (on CUDA the CLI passes a measuring trial run
    instead). Doubling finds a bound, then bisection the edge.
    """
    fits = fits or (lambda c: estimate(c)["max_total"] <= budget_bytes)
    tried = {}

    def ok(micro: int) -> bool:
        if micro not in tried:
            tried[micro] = bool(fits(with_microbatch(cfg, micro)))
        return tried[micro]

    if not ok(1):
        return {"microbatch": 0, "tried": tried}
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"microbatch": lo, "batch_size": with_microbatch(cfg, lo).batch_size, "tried": tried}


def format_estimate(est: dict) -> str:
    """A readable per-stage breakdown (ranks of one stage hold the same)."""
    cfg = TrainConfig.from_dict(est["config"])
    lines = [f"model {cfg.model}: {est['num_params'] / 1e6:,.1f} M parameters; layout {cfg.layout()} "
             f"(zero {cfg.zero}, {cfg.precision}{', master weights' if cfg.master_weights else ''}"
             f"{'' if cfg.recompute == 'none' else f', {cfg.recompute} recomputation'})"]
    buffers = est.get("gathered")  # the only buffer the course's runtime keeps besides: ZeRO-3's gathered weights
    header = f"  {'ranks':<10}" + "".join(f"{c:>14}" for c in CATEGORIES) + f"{'buffers':>14}" * bool(buffers) \
        + f"{'total':>14}"
    lines.append(header)
    group = cfg.world_size // cfg.pp
    for stage in range(cfg.pp):
        mem = est["per_rank"][stage * group]
        extra = [buffers[stage * group]] if buffers else []
        label = f"{stage * group}-{stage * group + group - 1}" if group > 1 else str(stage)
        lines.append(f"  {label:<10}" + "".join(f"{human_bytes(v, binary=True):>14}"
                                                for v in [mem[c] for c in CATEGORIES] + extra)
                     + f"{human_bytes(sum(mem.values()) + sum(extra), binary=True):>14}")
    mc = cfg.model_config()
    lines.append(f"  activations: recompute {cfg.recompute}, {cfg.attention} attention"
                 + (f", sequence parallel over tp {cfg.tp}" if cfg.sequence_parallel and cfg.tp > 1 else "")
                 + (f"; microbatches in flight per stage ({cfg.schedule}"
                    + (f", {cfg.virtual_stages} chunks a rank" if get_schedule(cfg.schedule).chunks == 0 else "")
                    + "): " + ", ".join(f"{h:.3g}" for h in est["in_flight"]) if "in_flight" in est and cfg.pp > 1
                    else ""))
    lines.append(f"  the busiest rank's parts (stage {est['parts']['stage']}):")
    lines += format_parts(est["parts"], "    ")
    lines.append("  NCCL's own buffers, cuBLAS's workspaces and the allocator's slack are not counted: they are the")
    lines.append("  reserve a GPU's usable memory leaves out")
    paper = korthikanti_layer_bytes(cfg.seq_len // cfg.cp, cfg.batch_size // _forwards(cfg), mc.n_embd, mc.n_head,
                                    cfg.tp, cfg.sequence_parallel, cfg.recompute)
    lines.append(f"  Korthikanti et al.'s count for one layer at this shape (16-bit activations, per GPU): "
                 f"{human_bytes(paper, binary=True)}")
    if "moe" in est:
        m = est["moe"]
        lines.append(f"  mixture of {m['experts']} experts, top-{m['top_k']}, in {m['moe_blocks']} blocks: "
                     f"{m['total_params'] / 1e6:,.1f} M parameters in all, {m['active_params'] / 1e6:,.1f} M used "
                     f"per token; each rank holds {m['experts_per_rank']} expert{'s' * (m['experts_per_rank'] > 1)} per block, "
                     f"{m['expert_params_per_rank'] / 1e6:,.2f} M expert parameters "
                     f"({m['expert_params_replicated'] / 1e6:,.2f} M without expert parallelism)")
        if m["all_to_all_bytes_per_step"]:
            lines.append(f"  expert parallelism's all-to-all: {human_bytes(m['all_to_all_bytes_per_step'])} per "
                         f"step over all ranks (no dropping; about (ep - 1)/ep of it leaves each rank)")
    return "\n".join(lines)
