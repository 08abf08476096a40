"""Serving on modeled GPUs: what prefill and decode cost, and which layout serves a model best.

Generation has two phases with opposite bottlenecks:

- **Prefill** runs a prompt's P tokens through the model at once: every matmul has P rows, so the weights read
  from memory are used P times each and the GPU runs at its arithmetic peak — *compute-bound*, timed here by the
  cluster model's matmuls on their own shapes (``Cluster.gemm_s``) and its attention kernel.
- **Decode** makes one token per sequence per step: a batch of B sequences gives matmuls of B rows, so each
  weight read from memory does 2·B FLOPs, and every step also reads each sequence's whole KV cache — *memory-bound*
  until B reaches the GPU's ridge point (peak FLOP/s over memory bandwidth, about 300 FLOPs a byte on an H100).
  A step costs about (weight bytes + KV bytes of every sequence) / HBM bandwidth, whatever B is, so batching more
  sequences multiplies tokens per second for almost nothing — until the KV cache fills the memory. Each matmul costs
  the larger of its compute and its bytes; one of a few rows runs as a GEMV (``Cluster.skinny_gemm_s``), so batch 1
  reads the weights at the bandwidth a streaming kernel reaches. A **mixture of experts** reads only the experts the
  step's tokens are routed to (:func:`experts_touched`): Mixtral's 2 of 8 at batch 1, nearly all 8 by batch 16.
  Weights stored in fewer bytes (:data:`WEIGHTS`) shorten what reads them: FP8 multiplied as FP8 (W8A8) where the GPU
  has FP8 tensor cores, weight-only elsewhere; INT8 and INT4 weight-only (W8A16, W4A16), read small and multiplied
  in bf16 — decode faster, a long prefill not.

On several GPUs (``tp`` × ``pp`` per replica, ``gpus / (tp·pp)`` replicas):

- **tensor parallelism** splits each step's weight and KV reads tp ways (KV heads too; a K/V head is replicated when
  kv_heads < tp) and adds two all-reduces of B × hidden numbers per block — small messages, so their latency, not
  their bandwidth, is the cost: why tp stays inside an NVLink server;
- **pipeline parallelism** holds 1/pp of the layers on each GPU; a token passes every stage in turn, so its latency
  is the *sum* of the stages (plus a send between each), and throughput comes from keeping pp microbatches of
  sequences in flight;
- **replicas** (data parallelism) multiply throughput and change no latency.

:func:`step` times one iteration of an engine — decodes and prompt chunks in one forward, as vLLM's scheduler
batches them — and every other time here is made of it: :func:`decode_step` and :func:`prefill` are its plain
cases; :func:`serve` serves a batch of requests, static or continuous, at the context each sequence actually holds
in a paged cache (:func:`held`); :func:`plan` sizes and ranks every layout with it by modeled tokens per second under
a time-per-output-token target (``gpucourse plan --serve``). Every figure is modeled: the same GPU table and links as
the training planner (``gpucourse/modeled/cluster.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

from ..config import ConfigError
from ..serving.speculative import expected_tokens
from ..serving.split_kv import num_splits
from ..values import GPUS_PER_NODE, POSITIVE, POSITIVE_NUMBER, RANKS, TOKENS, Name
from .cluster import SKINNY_ROWS, Cluster
from .gpus import get_gpu
from .shapes import ShapeError, get_shape

ELEM = {"fp32": 4, "bf16": 2, "fp8": 1}  # bytes a cached number (or a plain weight) is stored in
FORMAT = Name(ELEM)  # the KV cache's number format
SCALE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}  # bytes a weight-only format's scale (and zero point) is stored in


@dataclass(frozen=True)
class WeightFormat:
    """How a served model's matmul weights are stored, read and multiplied.

    ``scheme`` names the bits of the weights and of the activations the tensor cores multiply (W8A8: both FP8;
    W4A16: 4-bit weights widened to bf16 inside the kernel before a bf16 multiply, what vLLM's Marlin and AWQ kernels
    and TensorRT-LLM's weight-only GEMMs do). ``group``: the weights along k that share one scale (None: one scale a
    tensor, nothing a weight; 0: one an output channel, k weights), stored in ``scale`` (:data:`SCALE_BYTES`);
    ``zero``: whether each group also stores a zero point in the scale's format (an asymmetric format: gpt-fast's
    INT4 keeps a bf16 scale and a bf16 zero point every 32 weights). ``others``: the format of the weights outside
    the blocks' matmuls — embedding, output head, norms, router — which AWQ's and GPTQ's checkpoints leave in bf16
    (vLLM quantizes the head only when asked: ``lm_head_quantized``); "" where they are stored as the rest.
    ``head``: the output head stored in this format all the same (gpt-fast quantizes every ``nn.Linear``, the head
    included, and leaves the embedding, the norms and a Mixtral router in bf16)."""

    name: str
    scheme: str
    bits: float
    multiply: str
    group: int | None = None
    others: str = ""
    scale: str = "fp16"
    zero: bool = False
    head: bool = False

    def __str__(self) -> str:
        return self.name

    def bytes(self, k: float) -> float:
        """Bytes one weight of a k-deep matmul is read in, its share of the scales (and zero points) included."""
        scales = 0.0 if self.group is None else SCALE_BYTES[self.scale] * (1 + self.zero) / (self.group or k)
        return self.bits / 8 + scales

    @property
    def described(self) -> str:
        """The format in one line: its scheme, and what shares a scale (and a zero point) where it has them."""
        if self.group is None:
            return self.scheme + (", one scale a tensor" if self.bits < 16 else "")
        share = "an output channel" if self.group == 0 else f"every {self.group} weights along k"
        return f"{self.scheme}, one {self.scale} scale{' and zero point' * self.zero} {share}"

    @property
    def plain(self) -> bool:
        """Weights and activations in the format the tensor cores multiply, with no scales a weight to read."""
        return self.group is None and self.bits / 8 == ELEM[self.multiply]


WEIGHTS = {f.name: f for f in (
    WeightFormat("fp32", "W32A32", 32, "fp32"),
    WeightFormat("bf16", "W16A16", 16, "bf16"),
    # FP8 weights and activations, one scale a tensor, on tensor cores that multiply FP8 (compute capability 8.9 on).
    WeightFormat("fp8", "W8A8", 8, "fp8"),
    # Weight-only: INT8 with one scale an output channel (TensorRT-LLM's int8 weight-only, the course's quantize.py),
    # INT4 in groups of 128 along k with fp16 scales (GPTQ's and AWQ's usual group).
    WeightFormat("int8", "W8A16", 8, "bf16", group=0, others="bf16"),
    WeightFormat("int4", "W4A16", 4, "bf16", group=128, others="bf16"),
)}
WEIGHT_FORMAT = Name(WEIGHTS)  # how the weights are stored


def _format(weights) -> WeightFormat:
    """``weights``: a name of :data:`WEIGHTS`, or a :class:`WeightFormat` of its own (a source's stated format)."""
    return weights if isinstance(weights, WeightFormat) else WEIGHTS[WEIGHT_FORMAT.check(weights, "weights")]


def weight_format(weights, gpu) -> WeightFormat:
    """``weights``' format as ``gpu`` runs it: FP8 weights on a GPU whose tensor cores do not multiply FP8 (compute
    capability under 8.9: the A100) run weight-only, W8A16 — widened to bf16 in the kernel, as vLLM's FP8 Marlin does
    ("FP8 computation is supported on NVIDIA GPUs with compute capability >= 8.9 ... FP8 models will run on compute
    capability >= 7.5 as weight-only W8A16", vLLM's FP8 W8A8 documentation)."""
    fmt = _format(weights)
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if fmt.multiply == "fp8" and not spec.multiplies_fp8():
        return dataclasses.replace(fmt, scheme="W8A16", multiply="bf16")
    return fmt


def weights_note(weights, gpu) -> str | None:
    """The sentence that says FP8 weights run weight-only on ``gpu``, or None where they do not."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if _format(weights).multiply != "fp8" or weight_format(weights, spec).multiply == "fp8":
        return None
    cc = f"compute capability {spec.compute_capability:.1f}" if spec.compute_capability else "no fp8 peak in its record"
    return (f"fp8 weights on the {spec.name} ({cc}) run weight-only, W8A16: its tensor cores do not multiply FP8, so "
            f"each matmul widens the weights to bf16 — half bf16's bytes read, bf16's arithmetic.")


CONTEXT = 4096  # tokens a served sequence may hold (prompt and answer) unless told: a common serving window
BLOCK_SIZE = 16  # tokens a KV block holds: vLLM's default block size, and the course's paged cache's (serving.paged)
BATCHING = Name(("continuous", "static"))  # how an engine batches: per iteration (vLLM, TensorRT-LLM), or whole batches
ACTIVATIONS = "bf16"  # what flows between layers and ranks (all-reduces, pipeline sends), whatever the weights
# What an engine spends on each iteration besides the kernels the model times: the host's scheduling, sampling and
# bookkeeping, and the gaps between launches. One constant, fitted on the fitting rows of
# gpucourse.modeled.serve_published (TensorRT-LLM's and NIM's published H100 runs): the value, on a grid of 0.1 ms, that
# makes the largest fitting error smallest; the held-out rows check it. Without it every latency-bound row came out
# 16-33 % too fast (2-3 ms short a step).
STEP_OVERHEAD_S = 1.4e-3


def kv_bytes_per_token(shape, tp: int = 1, kv: str = "bf16") -> float:
    """Bytes of keys and values one token adds to one GPU's cache: 2 × layers × its K/V heads × head_dim."""
    return 2 * shape.layers * shape.kv_heads_per_rank(tp) * shape.head_dim * ELEM[kv]


def weight_bytes(shape, tp: int = 1, pp: int = 1, weights: str = "bf16", ep: int = 1) -> float:
    """Bytes of weights on the busiest GPU of a tp × pp replica (experts also split ep ways): the blocks' matmul
    weights in ``weights`` (:data:`WEIGHTS`: scales counted, one a channel taken as k = hidden), the embedding, head,
    norms and router in the format's ``others``."""
    return _weight_bytes(get_shape(shape), tp, pp, _format(weights), ep)


@functools.lru_cache(maxsize=1024)
def _weight_bytes(shape, tp: int, pp: int, fmt: WeightFormat, ep: int) -> float:
    per = fmt.bytes(shape.hidden)
    other = ELEM[fmt.others] if fmt.others else per
    # A head stored in the format moves out of the rest (a tied head on one stage is the embedding, kept as the rest).
    head = shape.vocab * shape.hidden / tp if fmt.head and fmt.others and not (shape.tied and pp == 1) else 0.0
    return max((params - rest) * per + rest * other
               for params, rest in ((shape.stage_params(pp, stage, tp, ep)[0],
                                     _other_params(shape, pp, stage, tp) - head * (stage == pp - 1))
                                    for stage in range(pp)))


def _other_params(shape, pp: int, stage: int, tp: int) -> float:
    """The parameters of pipeline stage ``stage`` outside its blocks' matmuls, as ``Shape.stage_params`` counts them:
    its blocks' two norms and routers, the embedding on the first stage, the head and final norm on the last."""
    per, extra = divmod(shape.layers, pp)
    start = stage * per + min(stage, extra)
    ids = range(start, start + per + (stage < extra))
    C = shape.hidden
    rest = 2 * C * len(ids) + C * shape.experts * sum(1 for i in ids if shape.experts and i >= shape.dense_layers)
    if stage == 0:
        rest += shape.vocab * C / tp
    if stage == pp - 1:
        rest += (0 if shape.tied and pp == 1 else shape.vocab * C / tp) + C
    return rest


def experts_touched(shape, tokens: float, skew: float = 0.0) -> float:
    """Expected distinct routed experts a step of ``tokens`` tokens runs in one MoE block.

    Assumption: each token picks its top_k of the E experts independently of the other tokens. Under **uniform**
    routing (``skew`` 0, what a router trained with a balance loss aims at) an expert is missed by a token with
    probability 1 − k/E, so a step touches E·(1 − (1 − k/E)^tokens): k at one token (Mixtral: 2 of 8), nearly all E by
    a few dozen. ``skew`` > 0 gives expert i a share ∝ (i + 1)^−skew of the choices (a Zipf popularity, each expert
    chosen by a token with probability min(1, k·share)): popular experts are touched sooner, so fewer distinct experts
    are read at the same batch."""
    E, k = shape.experts, shape.top_k
    if not E:
        return 0.0
    weights = [(i + 1) ** -skew for i in range(E)]
    total = sum(weights)
    return sum(1 - (1 - min(1.0, k * w / total)) ** tokens for w in weights)


@functools.lru_cache(maxsize=4096)  # a simulated trace's iterations repeat their sizes
def _block(shape, cluster, tokens: float, seq_len: int, tp: int, ep: int, weights: str, skew: float):
    """One block's kernels on one GPU and their seconds, the MoE block's experts as a step runs them: only the
    experts its tokens route to (``experts_touched``, over the ``ep`` ranks' tokens together: a rank's E/ep experts
    serve every rank's tokens), each a grouped GEMM of its share of the choices. A matmul of few rows (decode) runs as
    a GEMV or split-K kernel (``Cluster.skinny_gemm_s``). Returns (kernels, seconds of each, experts a rank runs)."""
    kernels = shape.kernels(tokens, seq_len, tp, ep=ep, moe=bool(shape.experts))
    local = 0.0
    if shape.experts:
        local = experts_touched(shape, tokens * ep, skew) / ep
        rows = tokens * shape.top_k / local  # a rank receives, balanced, as many choices as its own tokens make
        kernels = [dict(k, m=rows, count=local) if k.get("name") in ("expert_up", "expert_down") else k
                   for k in kernels]
    fmt = weight_format(weights, cluster.gpu)
    return kernels, [_seconds(cluster, k, fmt) for k in kernels], local


def _check(shape, tp: int, pp: int, weights: str, kv: str, ep: int = 1) -> None:
    POSITIVE.check(tp, "tp")
    POSITIVE.check(pp, "pp")
    POSITIVE.check(ep, "ep")
    if ep > 1 and (not shape.experts or shape.experts % ep):
        raise ConfigError(f"ep={ep} must divide the model's {shape.experts} experts: each GPU holds E/ep of them."
                          if shape.experts else f"ep={ep} spreads the experts of a mixture of experts; this model "
                                                f"has none.")
    try:
        shape.check_tp(tp)
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    if pp > shape.layers:
        raise ConfigError(f"pp={pp} stages cannot each hold a block of a model of {shape.layers} blocks.")
    _format(weights)
    FORMAT.check(kv, "kv")


def _seconds(cluster, kernel: dict, fmt: WeightFormat) -> float:
    """One kernel's seconds as serving runs it, its weights in ``fmt``: a matmul of few rows as a GEMV or split-K
    kernel. A weight-only format's matmul reads its weights (and their scales) at their own bytes and its activations
    in bf16, and multiplies in bf16: it saves bytes, never arithmetic."""
    if kernel["kind"] != "gemm":
        return cluster.kernel_s(kernel, fmt.multiply)
    if fmt.others and (kernel.get("name") == "router" or kernel.get("name") == "head" and not fmt.head):
        fmt = WEIGHTS[fmt.others]
    m, n, k, count = kernel["m"], kernel["n"], kernel["k"], kernel["count"]
    elems = {} if fmt.plain else {"weight_elem": fmt.bytes(k), "activation_elem": ELEM[fmt.multiply]}
    if m <= SKINNY_ROWS:
        return cluster.skinny_gemm_s(m, n, k, fmt.multiply, count, **elems)
    return cluster.gemm_s(m, n, k, fmt.multiply, count, **elems)


def _expert_exchange_s(shape, cluster, tokens: float, tp: int, ep: int, blocks: int) -> float:
    """Expert parallelism's all-to-alls over a stage's ``blocks`` MoE blocks: the E counts, then each token choice's
    hidden vector to its expert's rank and back (``serving.parallel_decode``'s ep), among the ep GPUs at one tp
    position. At decode sizes (a few kB) each is its (ep − 1) latencies."""
    if ep == 1:
        return 0.0
    ranks = range(0, tp * ep, tp)
    choices = tokens * shape.top_k * shape.hidden * ELEM[ACTIVATIONS]
    return blocks * (cluster.collective_s("all_to_all", shape.experts * 8, ranks)[0]
                     + 2 * cluster.collective_s("all_to_all", choices, ranks)[0])


class Chunk(NamedTuple):
    """Prompt tokens one step feeds for ``count`` sequences: ``tokens`` each, after ``cached`` of theirs already in the
    cache (a prompt's first chunk: 0). ``last``: the chunk ends its prompt, so the step samples the sequence's first
    token from it (an earlier chunk's logits are not computed, as vLLM's runner computes only those it samples)."""

    tokens: float
    cached: float = 0
    count: float = 1
    last: bool = True


def step(shape, gpu, decodes: float = 0, context: float = 0, chunks=(), tp: int = 1, pp: int = 1,
         weights: str = "bf16", kv: str = "bf16", gpus_per_node: int = 8, ep: int = 1, skew: float = 0.0,
         new_tokens: int = 1) -> dict:
    """One iteration of a serving engine on one tp × pp replica: what every modeled serving time is made of (a
    decode step, a prefill, a static batch, continuous batching's steady state, ``serve-bench``'s modeled clock).

    As vLLM's scheduler batches an iteration, ``decodes`` sequences each feed the token they made last (``new_tokens``
    a sequence when a model verifies proposed tokens), reading ``context`` cached tokens each on average, and
    ``chunks`` (:class:`Chunk`) feed prompt tokens, whole prompts or a token budget's chunks of them — all in one
    forward: every matmul has one row for each token fed, so decodes ride along with a prefill chunk for the price of
    its rows. Attention is per sequence: a decode reads its cache (memory-bound: the bytes over the bandwidth), a
    chunk runs the fused kernel over its queries against its cached keys and its own (``Cluster.attention_s``: on
    average cached + tokens/2 keys a query), or reads its cached keys, whichever is slower.

    Each matmul costs the larger of its compute and its bytes (weights and activations) over the bandwidth a
    streaming kernel reaches; one of few rows runs as a GEMV (``Cluster.skinny_gemm_s``), so batch 1 is memory-bound.
    A mixture of experts reads only the experts the step's tokens route to (``experts_touched``: under uniform
    routing, ``skew`` 0, E·(1 − (1 − k/E)^tokens) a block). ``ep``: expert parallelism as ``serving.parallel_decode``
    runs it — ep tp × pp groups, each serving a step like this one of its own, the experts spread E/ep a group, and
    three all-to-alls a MoE block (the counts, the choices there and back).

    Returns seconds by part for the busiest pipeline stage (``stage_s``: its matmuls, its KV reads and chunks'
    attention, its tp all-reduces, its expert all-to-alls; the stage's share of the head), the step's latency
    (``seconds``: every stage in turn, the sends between them, and what the engine spends besides its kernels,
    ``STEP_OVERHEAD_S``), the bytes a GPU reads and the FLOPs it does. With pp > 1 the step is one microbatch: pp of
    them are in flight, one on each stage."""
    shape = get_shape(shape)
    cluster = Cluster.of(gpu, gpus_per_node, max(1, -(-tp * pp * ep // gpus_per_node)))
    _check(shape, tp, pp, weights, kv, ep)
    chunks = [c if isinstance(c, Chunk) else Chunk(*c) for c in chunks]
    fed = sum(c.tokens * c.count for c in chunks)
    rows = decodes * new_tokens + fed
    if rows <= 0:
        raise ConfigError("a step feeds no token: give it decodes or prompt chunks.")
    kernels, seconds, local = _block(shape, cluster, rows, 1, tp, ep, weights, skew)
    matmuls = sum(t for k, t in zip(kernels, seconds) if k["kind"] != "attention")
    per_token = kv_bytes_per_token(shape, tp, kv) / shape.layers  # one layer's keys and values of a token, a GPU
    heads = shape.heads / tp
    # A layer's attention: each decode reads its cache; each chunk's queries attend to its cached keys and its own.
    decode_read = decodes * context * per_token
    chunk_s = sum(max(_attention_s(cluster, c, heads, shape.head_dim), c.count * c.cached * per_token / cluster.hbm_Bps)
                  for c in chunks)
    attention = decode_read / cluster.hbm_Bps + chunk_s
    sampled = decodes * new_tokens + sum(c.count for c in chunks if c.last)
    head = _seconds(cluster, shape.head_kernels(sampled, tp)[0], weight_format(weights, cluster.gpu)) \
        if sampled else 0.0  # no loss when serving
    elem = ELEM[ACTIVATIONS]
    all_reduces = 2 * cluster.collective_s("all_reduce", rows * shape.hidden * elem, range(tp))[0] if tp > 1 else 0.0
    exchange = _expert_exchange_s(shape, cluster, rows, tp, ep, 1) if shape.experts else 0.0
    layer = matmuls + attention + all_reduces + exchange
    blocks = -(-shape.layers // pp)  # the busiest stage's (the first stages take one more when pp does not divide)
    send = cluster.collective_s("send", rows * shape.hidden * elem, (0, tp))[0] if pp > 1 else 0.0
    unread = 0.0
    if shape.experts:  # the experts on this GPU no token of the step routes to
        unread = (shape.experts / ep - local) * shape.expert_params() / (shape.experts * tp * pp) * \
            _format(weights).bytes(shape.hidden)
    kv_read = (decode_read + sum(c.count * c.cached for c in chunks) * per_token) * shape.layers / pp
    attended = decodes * new_tokens * context + sum(c.count * c.tokens * (c.cached + c.tokens / 2) for c in chunks)
    return {"seconds": shape.layers * layer + head + (pp - 1) * send + STEP_OVERHEAD_S,
            "stage_s": blocks * layer + head / pp, "matmul_s": blocks * matmuls + head / pp,
            "attention_s": blocks * attention, "tp_comm_s": blocks * all_reduces, "ep_comm_s": blocks * exchange,
            "pp_send_s": (pp - 1) * send, "send_s": send, "experts_read": local, "tokens_fed": rows,
            "tokens_made": sampled, "bytes_read": weight_bytes(shape, tp, pp, weights, ep) - unread + kv_read,
            "flops": (2 * rows * _active_params(shape) + 4 * attended * shape.heads * shape.head_dim * shape.layers)
            / (tp * pp)}


@functools.lru_cache(maxsize=256)
def _active_params(shape) -> int:
    return shape.active_params()


def _attention_s(cluster, chunk: Chunk, heads: float, head_dim: int) -> float:
    """A layer's fused attention over ``chunk``'s queries: whole chunks share the kernel's waves; a fraction of one (a
    steady state's share of a prompt a step) costs that share of a whole one's."""
    whole, part = divmod(chunk.count, 1)
    keys = 2 * chunk.cached + chunk.tokens  # the kernel takes the causal span: cached + tokens / 2 keys a query
    return (cluster.attention_s(whole, heads, chunk.tokens, keys, head_dim) if whole else 0.0) + \
        (part * cluster.attention_s(1, heads, chunk.tokens, keys, head_dim) if part else 0.0)


def decode_step(shape, gpu, batch: int, context: int, tp: int = 1, pp: int = 1, weights: str = "bf16",
                kv: str = "bf16", gpus_per_node: int = 8, new_tokens: int = 1, ep: int = 1,
                skew: float = 0.0) -> dict:
    """One decode step of ``batch`` sequences holding ``context`` tokens each, on one tp × pp replica (:func:`step`
    with decodes alone): seconds by part (a stage's matmuls, its KV reads, its tp all-reduces, its expert
    all-to-alls; the pipeline's sends), the time per output token (every stage in turn), the bytes a GPU reads and
    the arithmetic intensity (FLOPs per byte read) that places it on the roofline.
    With pp > 1, ``batch`` is one microbatch: pp of them are in flight, one on each stage, so the replica serves
    pp × batch sequences and makes ``batch`` tokens every stage time; with ep > 1 each of the ep groups serves
    ``batch`` sequences of its own.

    ``new_tokens``: the tokens each sequence feeds (1 in plain decode; k + 1 when the model verifies k proposed
    tokens, ``speculative_speedup``): the matmuls get batch × new_tokens rows, the cache is still read once."""
    s = step(shape, gpu, batch, context, (), tp, pp, weights, kv, gpus_per_node, ep, skew, new_tokens)
    return {"stage_s": s["stage_s"], "token_s": s["seconds"], "matmul_s": s["matmul_s"],
            "attention_s": s["attention_s"], "tp_comm_s": s["tp_comm_s"], "ep_comm_s": s["ep_comm_s"],
            "pp_send_s": s["pp_send_s"], "experts_read": s["experts_read"], "bytes_read": s["bytes_read"],
            "flops": s["flops"], "intensity": s["flops"] / s["bytes_read"],
            # pp microbatches of ``batch`` in flight, one leaving the last stage every stage_s; ep groups side by side
            "tokens_per_s": ep * batch / (s["stage_s"] + s["send_s"] + STEP_OVERHEAD_S / pp)}


def prefill(shape, gpu, prompts: int, prompt_len: int, tp: int = 1, pp: int = 1, weights: str = "bf16",
            gpus_per_node: int = 8, ep: int = 1, skew: float = 0.0) -> dict:
    """Prefill of ``prompts`` prompts of ``prompt_len`` tokens on one tp × pp replica (:func:`step` with whole
    prompts alone; ``ep``: on each of ep such groups, as in :func:`decode_step`): seconds to the first token (every
    stage in turn), the share of it that is attention, and the arithmetic intensity."""
    shape = get_shape(shape)
    s = step(shape, gpu, 0, 0, [Chunk(prompt_len, 0, prompts)], tp, pp, weights, "bf16", gpus_per_node, ep, skew)
    whole = shape.layers / -(-shape.layers // pp)  # every stage's blocks over the busiest stage's
    tokens = prompts * prompt_len
    flops = tokens * shape.flops_per_token(prompt_len, causal=True, backward=False)
    read = weight_bytes(shape, tp, pp, weights, ep) * pp + tokens * kv_bytes_per_token(shape, tp)
    return {"first_token_s": s["seconds"], "attention_s": whole * s["attention_s"], "tp_comm_s": whole * s["tp_comm_s"],
            "ep_comm_s": whole * s["ep_comm_s"], "flops": flops, "bytes_read": read, "intensity": flops / read,
            "tokens_per_s": tokens / s["seconds"]}


def held(prompt: float, output: float, batching: str = "continuous", block: int = BLOCK_SIZE) -> dict:
    """What one sequence of ``prompt`` tokens in and ``output`` out holds in a paged KV cache (blocks of ``block``
    tokens) while it is served, beside the window (``prompt + output``) a max-length reservation would set aside:

    - ``read``: the tokens a decode step reads on average, prompt + output / 2. A static batch's steps run at
      prompt + 1, …, prompt + output − 1 tokens, and a step's cost is linear in its context, so the mean stands for
      them exactly; under continuous batching the sequences are at every age at once, with the same mean;
    - ``slots``: the cache slots a sequence is counted at when a batch is sized. A static batch's members grow
      together and all reach their last block at the last step: prompt + output rounded up to a block. Under
      continuous batching the sum over the batch is what must fit, and it is the batch times the mean over a
      sequence's life of its tokens rounded up to a block (the sum of many sequences at different ages strays
      little from it; the scheduler preempts when it does).

    Paging allocates no more than the blocks a sequence has reached; reserving the window for every sequence, as
    static batching without paging must, counts each at ``window``."""
    if batching not in BATCHING.names():
        BATCHING.check(batching, "batching")
    for name, value in (("prompt", prompt), ("output", output), ("block", block)):
        POSITIVE_NUMBER.check(value, name)
    window = prompt + output
    blocks = lambda tokens: -(-tokens // block) * block  # noqa: E731
    if batching == "static":
        slots = blocks(window)
    else:  # the mean over its output steps of the blocks it holds then
        n = int(output)
        slots = sum(blocks(prompt + j) for j in range(1, n + 1)) / n
    return {"read": prompt + output / 2, "slots": slots, "window": window, "block": block, "batching": batching}


def serve(shape, gpu, batch: int, prompt: int, output: int, batching: str = "continuous", tp: int = 1, pp: int = 1,
          weights: str = "bf16", kv: str = "bf16", gpus_per_node: int = 8, block: int = BLOCK_SIZE, ep: int = 1,
          skew: float = 0.0, token_budget: int | None = None) -> dict:
    """``batch`` sequences of ``prompt`` tokens in and ``output`` out served together on one tp × pp replica, each
    step timed by :func:`step` at the context the sequences actually hold (:func:`held`):

    - ``"static"``: the batch's prompts are prefilled at once, which makes each sequence's first token, then
      ``output − 1`` decode steps of the whole batch at the mean context; the time per output token is one such
      step, the throughput ``batch × output`` over the prefill and the steps (TensorRT-LLM's ``gptSessionBenchmark``
      and its ``out_tps = output_seqlen × batch_size / total_latency``);
    - ``"continuous"``: the steady state of an engine that refills a seat as soon as it is free. Each step a sequence
      in ``output`` finishes and a new one takes its seat, so every step feeds, beside the decodes, batch / output
      prompts' worth of prompt tokens (``Chunk``: vLLM's scheduler puts prefill and decode tokens in one batch), and
      makes ``batch`` tokens; the time per output token is that step, the throughput ``batch`` tokens a step. Under a
      ``token_budget`` (vLLM's ``max_num_batched_tokens``, TensorRT-LLM's ``max_num_tokens``) a step feeds at most
      that many tokens, the decodes first: a prompt is fed in chunks of what the decodes leave, each attending to the
      chunks before it (on average half the prompt less half a chunk), and a batch whose decodes and prompts need
      more than the budget a step cannot be kept up.

    With pp > 1 the batch is one microbatch of the pp in flight; with ep > 1 each of the ep groups serves its own."""
    h = held(prompt, output, batching, block)
    shape = get_shape(shape)
    common = dict(tp=tp, pp=pp, weights=weights, kv=kv, gpus_per_node=gpus_per_node, ep=ep, skew=skew)
    if batching == "static":
        if token_budget is not None:
            raise ConfigError("static batching feeds whole prompts; a token budget (chunked prefill) is for "
                              "continuous batching.")
        first = step(shape, gpu, chunks=[Chunk(prompt, 0, batch)], **common)
        decode = step(shape, gpu, batch, h["read"], **common) if output > 1 else None
        pace = decode["stage_s"] + decode["send_s"] + STEP_OVERHEAD_S / pp if decode else 0.0
        total = first["seconds"] + (output - 1) * pace
        return {"held": h, "step": decode or first, "first_token_s": first["seconds"],
                "token_s": decode["seconds"] if decode else first["seconds"], "total_s": total,
                "tokens_per_s": ep * batch * output / total}
    arriving = batch / output  # sequences that finish, and as many that are admitted, each step
    decodes, fed = batch - arriving, arriving * prompt
    chunks = [Chunk(prompt, 0, arriving)]
    if token_budget is not None:
        POSITIVE.check(token_budget, "token_budget")
        if decodes + fed > token_budget:
            raise ConfigError(f"a batch of {batch} sequences of {prompt} tokens in and {output} out feeds "
                              f"{decodes + fed:,.0f} tokens a step, more than the token budget of {token_budget:,}; "
                              f"at most {budget_batch(prompt, output, token_budget)} sequences keep up.")
        size = min(prompt, token_budget - decodes)  # a chunk: what the decodes leave of the budget
        pieces = fed / size
        chunks = [Chunk(size, (prompt - size) / 2, pieces - arriving, False), Chunk(size, (prompt - size) / 2,
                                                                                     arriving, True)]
        chunks = [c for c in chunks if c.count > 1e-12]
    mixed = step(shape, gpu, decodes, h["read"], chunks, **common)
    return {"held": h, "step": mixed, "token_s": mixed["seconds"], "prefill_tokens": fed,
            "chunk": chunks[-1].tokens,
            # pp microbatches in flight, one leaving the last stage every stage time; ep groups side by side
            "tokens_per_s": ep * batch / (mixed["stage_s"] + mixed["send_s"] + STEP_OVERHEAD_S / pp)}


def budget_batch(prompt: int, output: int, token_budget: int) -> int:
    """The most sequences of ``prompt`` in and ``output`` out continuous batching keeps up under ``token_budget``
    tokens a step: batch × (1 − 1/output) decodes and batch × prompt / output prompt tokens a step."""
    return int(token_budget // (1 - 1 / output + prompt / output))


# A draft for Llama 3's vocabulary: Llama 3.2 1B (Meta's released config.json: 16 layers, hidden 2048, 32 heads,
# 8 K/V heads, SwiGLU 8192, vocabulary 128256, tied embeddings), what vLLM's and TensorRT-LLM's examples pair with
# Llama 3 8B and 70B targets.
LLAMA3_DRAFT = {"name": "llama3.2-1b", "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192,
                "mlp": "swiglu", "vocab": 128256, "tied": True}


def speculative_speedup(shape, gpu, batch: int, context: int, k: int, acceptance: float, draft=None, tp: int = 1,
                        weights: str = "bf16", kv: str = "bf16", gpus_per_node: int = 8) -> dict:
    """Speculative decoding (``serving.speculative``) against plain decode, on one tp replica: a round is ``k``
    decode steps of the ``draft`` model (a shape; None for a draft that costs nothing, prompt lookup), then one step
    of the target feeding k + 1 tokens a sequence; it makes ``expected_tokens(acceptance, k)`` tokens a sequence.

    The engine's per-iteration overhead (``STEP_OVERHEAD_S``) is paid once a round, the draft's steps are kernels
    only. At batch 1 the verifying step costs about a plain one (memory-bound: the same weights read for k + 1 rows
    as for 1) and the speed-up nears the tokens a round; as the batch grows, its batch × (k + 1) rows cross the
    ridge point, each round costs more and the rejected proposals' compute is wasted: the speed-up falls below 1."""
    plain = decode_step(shape, gpu, batch, context, tp, 1, weights, kv, gpus_per_node)
    check = decode_step(shape, gpu, batch, context, tp, 1, weights, kv, gpus_per_node, new_tokens=k + 1)
    draft_s = 0.0 if draft is None else \
        k * (decode_step(draft, gpu, batch, context, tp, 1, weights, kv, gpus_per_node)["token_s"] - STEP_OVERHEAD_S)
    made = expected_tokens(acceptance, k)
    round_s = draft_s + check["token_s"]
    return {"plain_s": plain["token_s"], "verify_s": check["token_s"], "draft_s": draft_s, "round_s": round_s,
            "tokens_per_round": made, "speedup": made * plain["token_s"] / round_s,
            "plain_tokens_per_s": batch / plain["token_s"], "tokens_per_s": batch * made / round_s}


def split_kv_decode(shape, gpu, batch: int, context: int, tp: int = 1, kv: str = "bf16",
                    splits: int | None = None) -> dict:
    """A decode step's attention on one GPU with and without split-KV (``serving.split_kv``): the thread blocks of
    a layer (sequences × the K/V heads a GPU holds, each K/V head's query heads packed into one block, as
    FlashAttention does at decode; × ``splits`` chunks, FlashAttention's own count ``num_splits`` if None), the
    SMs they keep busy, the cache bytes each busy SM reads a layer, and the seconds for every layer.

    Each busy SM draws its 1/SMs share of the memory bandwidth, so a GPU with fewer busy SMs reads the cache more
    slowly by as much (an SM alone can draw somewhat more than its share: the loss without a split is an upper
    bound). With every SM busy the time is ``decode_step``'s attention, the cache read at the full bandwidth.
    Combining writes and reads each chunk's partial output and log-sum-exp in fp32, per query head: a few hundred
    bytes a chunk against the chunk's kilobytes of cache."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    shape, cluster = get_shape(shape), Cluster.of(spec)
    _check(shape, tp, 1, "bf16", kv)
    blocks, sms = int(batch * shape.kv_heads_per_rank(tp)), spec.sm_count
    block_n = 256 if shape.head_dim <= 64 else 128 if shape.head_dim <= 128 else 64  # FlashAttention's keys a tile
    key_blocks = -(-context // block_n)
    # FlashAttention counts two thread blocks of 128 threads per SM.
    splits = num_splits(blocks, 2 * sms, key_blocks) if splits is None else splits
    layer = batch * context * kv_bytes_per_token(shape, tp, kv) / shape.layers  # one layer's cache on this GPU

    def seconds(n):
        # Waves over the SMs, each as long as one thread block's share of the cache at one SM's bandwidth.
        waves = -(-blocks * n // sms)
        merge = 2 * batch * shape.heads / tp * n * (shape.head_dim + 1) * 4 if n > 1 else 0.0
        return shape.layers * (waves * layer / (blocks * n) * sms + merge) / cluster.hbm_Bps

    return {"thread_blocks": blocks, "sms": sms, "splits": splits, "key_blocks": key_blocks,
            "busy_sms_without": min(sms, blocks), "busy_sms_with": min(sms, blocks * splits),
            "bytes_per_sm_without": layer / min(sms, blocks), "bytes_per_sm_with": layer / min(sms, blocks * splits),
            "without_s": seconds(1), "with_s": seconds(splits),
            "full_bandwidth_s": shape.layers * layer / cluster.hbm_Bps}


def ridge_point(gpu, precision: str = "bf16") -> float:
    """FLOPs per byte at which the GPU's peak compute and its memory bandwidth take equal time: below it a
    kernel is memory-bound."""
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return g.peak_flops(precision) / (g.hbm_GBps * 1e9)


def largest_batch(shape, gpu, context: int, tp: int = 1, pp: int = 1, weights: str = "bf16",
                  kv: str = "bf16", budget: float | None = None) -> int:
    """The most sequences of ``context`` tokens a microbatch may hold with the KV cache of all pp microbatches in
    flight beside the weights on each GPU (each GPU holds its 1/pp of the layers' cache for pp × batch sequences);
    the card's usable memory, ``GPUSpec.usable_bytes``; a decode step's activations are small and left out."""
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    shape = get_shape(shape)
    free = (g.usable_bytes() if budget is None else budget) - weight_bytes(shape, tp, pp, weights)
    return max(0, int(free // (context * kv_bytes_per_token(shape, tp, kv))))


def memory(shape, context: int = CONTEXT, tp: int = 1, pp: int = 1, weights: str = "bf16", kv: str = "bf16",
           gpu: str = "h100", budget: float | None = None) -> dict:
    """What serving ``shape`` holds on each GPU of a tp × pp replica (``gpucourse memory --serve``): the weights,
    the KV cache's bytes per token, and the largest batch of ``context``-token sequences that fits ``budget``
    bytes (default: the GPU's usable memory)."""
    try:
        shape = get_shape(shape)
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    _check(shape, tp, pp, weights, kv)
    TOKENS.check(context, "context")
    if budget is not None:
        POSITIVE_NUMBER.check(budget, "budget")
    spec = get_gpu(gpu)
    budget = spec.usable_bytes() if budget is None else budget
    batch = largest_batch(shape, spec, context, tp, pp, weights, kv, budget)
    return {"shape": shape.as_dict(), "tp": tp, "pp": pp, "weights": weights, "kv": kv, "context": context,
            "weights_per_gpu": weight_bytes(shape, tp, pp, weights), "kv_per_token": kv_bytes_per_token(shape, tp, kv),
            "kv_heads_per_gpu": shape.kv_heads_per_rank(tp), "budget": budget, "largest_batch": batch,
            "kv_per_gpu": batch * context * kv_bytes_per_token(shape, tp, kv)}


def format_memory(m: dict) -> str:
    """The lines ``gpucourse memory --serve`` prints."""
    from ..readable import human_bytes

    s = m["shape"]
    return "\n".join([
        f"serving {s['name'] or 'the shape'} with tp={m['tp']} pp={m['pp']}, weights {m['weights']}, KV cache "
        f"{m['kv']}: per GPU",
        f"  weights              {human_bytes(m['weights_per_gpu'])}",
        f"  KV cache per token   {human_bytes(m['kv_per_token'])} (2 × {s['layers']} layers × "
        f"{m['kv_heads_per_gpu']:g} K/V heads × {s['hidden'] // s['heads']} × {ELEM[m['kv']]} bytes)",
        f"  budget               {human_bytes(m['budget'])}: at most {m['largest_batch']} sequences of "
        f"{m['context']} tokens ({human_bytes(m['kv_per_gpu'])} of KV cache)"])


def plan(shape, gpus: int, gpu: str = "h100", context: int = CONTEXT, tpot_s: float = 0.05, weights: str = "bf16",
         kv: str = "bf16", gpus_per_node: int = 8, prompt: int | None = None, output: int | None = None,
         batching: str = "continuous", block: int = BLOCK_SIZE, token_budget: int | None = None) -> dict:
    """Every tp × pp layout of ``gpus`` GPUs (replicas over what is left), each at the batch with the most tokens
    per second among those that fit its memory and meet the time-per-output-token target ``tpot_s`` (the largest
    such batch, or a round number of rows below it when the largest just spills into one more row of matmul
    tiles); ranked by modeled output tokens per second.

    Requests hold ``prompt`` tokens in and ``output`` out (default: the ``context`` window filled, half of it each
    when neither is given); a batch is
    sized and timed at what its sequences actually hold in a paged cache (:func:`held`, :func:`serve`) under
    ``batching``, not at the whole window for every sequence; continuous batching under a ``token_budget`` holds
    no more sequences than the budget keeps up (:func:`budget_batch`).
    A layout that fits no sequence, or misses the target even at a batch of one, ranks last."""
    try:
        shape = get_shape(shape)
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    for name, value, kind in (("gpus", gpus, RANKS), ("context", context, TOKENS),
                              ("gpus_per_node", gpus_per_node, GPUS_PER_NODE), ("block", block, TOKENS)):
        kind.check(value, name)
    POSITIVE_NUMBER.check(tpot_s, "tpot_s")
    given = [f"{name}={TOKENS.check(value, name)}" for name, value in (("prompt", prompt), ("output", output))
             if value is not None]
    if prompt is None and output is None:
        prompt, output = context // 2, context - context // 2
    prompt = context - output if prompt is None else prompt  # the window filled: what is not answer is prompt
    output = context - prompt if output is None else output
    if prompt < 1 or output < 1 or prompt + output > context:
        room = "both" if len(given) == 2 else "an answer" if output < 1 else "a prompt"
        raise ConfigError(f"{' and '.join(given)} leave{'s' * (len(given) == 1)} no room for {room} in the "
                          f"context={context} tokens a sequence may hold.")
    BATCHING.check(batching, "batching")
    if token_budget is not None:
        POSITIVE.check(token_budget, "token_budget")
        if batching == "static":
            raise ConfigError("static batching feeds whole prompts; a token budget (chunked prefill) is for "
                              "continuous batching.")
    spec = get_gpu(gpu)
    _check(shape, 1, 1, weights, kv)
    h = held(prompt, output, batching, block)
    rows, left_out = [], []
    for tp in (t for t in range(1, min(gpus, gpus_per_node) + 1) if gpus % t == 0 and gpus_per_node % t == 0):
        try:
            shape.check_tp(tp)
        except ShapeError:
            left_out.append(tp)
            continue
        for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0 and p <= shape.layers):
            replicas = gpus // (tp * pp)
            fits = largest_batch(shape, spec, h["slots"], tp, pp, weights, kv)
            if token_budget is not None:
                fits = min(fits, budget_batch(prompt, output, token_budget))

            def served(size):
                return serve(shape, spec, size, prompt, output, batching, tp, pp, weights, kv, gpus_per_node, block,
                             token_budget=token_budget)

            batch, best = 0, None
            lo, hi = 1, fits  # the largest batch whose step meets the target: a step grows with the batch
            while lo <= hi:
                mid = (lo + hi) // 2
                trial = served(mid)
                if trial["token_s"] <= tpot_s:
                    batch, best, lo = mid, trial, mid + 1
                else:
                    hi = mid - 1
            # The largest batch is not always the fastest: a few rows past a multiple of the matmul tiles' height
            # (64, 128) cost a whole row of tiles more. Try the round numbers below it too.
            for size in sorted({batch // tile * tile for tile in (16, 32, 64, 128)} - {0, batch}):
                trial = served(size)
                if trial["tokens_per_s"] > best["tokens_per_s"]:
                    batch, best = size, trial
            rows.append({"tp": tp, "pp": pp, "replicas": replicas, "max_batch": fits, "batch": batch,
                         "weights_per_gpu": weight_bytes(shape, tp, pp, weights),
                         "kv_per_token": kv_bytes_per_token(shape, tp, kv),
                         "tokens_per_s": replicas * best["tokens_per_s"] if best else 0.0,
                         "token_s": best["token_s"] if best else None, "step": best["step"] if best else None,
                         "served": best})
    rows.sort(key=lambda r: -r["tokens_per_s"])
    notes = [note] if (note := weights_note(weights, spec)) else []
    if left_out:
        kv_heads = f" and split or replicate its {shape.kv} K/V heads evenly" if shape.kv != shape.heads else ""
        notes.append(f"tp {', '.join(map(str, left_out))} left out: tensor parallelism must divide the model's "
                     f"{shape.heads} attention heads{kv_heads}.")
    return {"shape": shape.as_dict(), "gpus": gpus, "gpu": spec.name, "context": context, "tpot_s": tpot_s,
            "weights": weights, "kv": kv, "prompt": prompt, "output": output, "batching": batching, "held": h,
            "token_budget": token_budget,
            "layouts": rows, "notes": notes}


def format_plan(result: dict, top: int = 10) -> str:
    """The table ``gpucourse plan --serve`` prints."""
    from ..readable import human_bytes

    h = result["held"]
    lines = [f"serving {result['shape']['name'] or 'the shape'} on {result['gpus']} × {result['gpu']}, "
             f"{result['prompt']} tokens in / {result['output']} out ({result['context']}-token window), "
             f"{result['batching']} batching"
             + (f" ({result['token_budget']:,} tokens a step)" if result.get("token_budget") else "")
             + f", time per output token ≤ {result['tpot_s'] * 1e3:g} ms "
             f"(modeled; weights {result['weights']}, KV cache {result['kv']})",
             f"  a sequence holds {h['read']:,.0f} tokens on average, " + (
                 f"{h['slots']:,.0f} KV slots paged in blocks of {h['block']}, not the {h['window']:,} of its window"
                 if h["batching"] == "continuous" else
                 f"and a static batch's members all reach {h['slots']:,.0f} KV slots at its last step"),
             f"  {'tp':>3} {'pp':>3} {'replicas':>8} {'weights/GPU':>12} {'KV/token':>9} {'fits':>6} {'batch':>6} "
             f"{'ms/token':>9} {'tokens/s':>10}"]
    for r in result["layouts"][:top]:
        ms = f"{r['token_s'] * 1e3:.1f}" if r["token_s"] else "-"
        lines.append(f"  {r['tp']:>3} {r['pp']:>3} {r['replicas']:>8} {human_bytes(r['weights_per_gpu']):>12} "
                     f"{human_bytes(r['kv_per_token']):>9} {r['max_batch']:>6} {r['batch']:>6} {ms:>9} "
                     f"{r['tokens_per_s']:>10,.0f}")
    lines += [textwrap.fill(note, 110, initial_indent="  note: ", subsequent_indent="        ")
              for note in result.get("notes", [])]
    return "\n".join(lines)
