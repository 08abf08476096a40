"""The shapes of the models practitioners train, and the work one step of them does: parameters, FLOPs, matmuls.

This course's own GPT (:mod:`gpucourse.model`) has one kind of block: multi-head attention and a 4×-wide GELU MLP.
The models a practitioner plans for differ in ways that change both memory and time:

- **grouped-query attention** (GQA): ``kv_heads`` < ``heads``, so K and V are narrower than Q (Llama 3: 8 K/V heads
  for 128 query heads); tensor parallelism then splits the K/V heads too, and when tp exceeds them each rank holds a
  replica of one (tp/kv_heads copies of each);
- **the MLP**: ``gelu`` (two matrices, C×F and F×C) or ``swiglu`` (three: a gate and an up projection of C×F, a
  down projection F×C), with a width ``ffn`` of its own (Llama 3 70B: 28672 for 8192);
- **a vocabulary** of its own (Llama 3: 128256), an input embedding and an output head (tied or not);
- **experts**: ``experts`` MLPs of width ``expert_ffn`` of which each token uses ``top_k``, plus ``shared_experts``
  every token uses (DeepSeek), in every block after the first ``dense_layers``.

A :class:`Shape` counts what one token costs, forward: 2 FLOPs per weight of every matmul it passes through (the
input embedding is a look-up, not a matmul; the head is one) plus attention's scores and weighted sum,
2·2·(heads·head_dim) FLOPs per token and block for every earlier token it attends to. **Causal halving**: with a
causal mask a token attends to half the sequence on average, and a flash-attention kernel skips the masked half,
so :meth:`Shape.flops_per_token` counts T/2 keys with ``causal=True`` (what the GPU does) and T with
``causal=False`` (PaLM's and Megatron-LM's MFU formulas count the whole square). Backward is twice the forward.

:meth:`Shape.kernels` lists one block's matmuls for one rank of a layout — each as the (m, n, k) the GPU multiplies —
with its attention and its memory-bound work, which :meth:`gpucourse.modeled.cluster.Cluster.kernel_s` times one by one.

``SHAPES`` holds public shapes by name, each with its source; :func:`get_shape` takes a name, a dict of parts, or
an existing Shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..readable import ConfigError
from ..values import NON_NEGATIVE, POSITIVE, Name

MLPS = ("gelu", "swiglu")


class ShapeError(ValueError):
    """A model shape that cannot be built or split as asked."""


# The values each part may take (``gpucourse plan --layers ...`` checks the same): 0 for kv_heads, ffn and
# expert_ffn means "the default" (as many as heads, 4 × hidden, ffn).
PART_KINDS = {"layers": POSITIVE, "hidden": POSITIVE, "heads": POSITIVE, "kv_heads": NON_NEGATIVE,
              "ffn": NON_NEGATIVE, "mlp": Name(MLPS), "vocab": POSITIVE, "experts": NON_NEGATIVE, "top_k": POSITIVE,
              "expert_ffn": NON_NEGATIVE, "shared_experts": NON_NEGATIVE, "dense_layers": NON_NEGATIVE}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int = 0          # 0: as many as heads (multi-head attention)
    ffn: int = 0               # the MLP's width; 0: 4 × hidden
    mlp: str = "gelu"          # "gelu" (two matrices) or "swiglu" (three)
    vocab: int = 32000
    experts: int = 0           # routed experts in each MoE block (0: dense)
    top_k: int = 2
    expert_ffn: int = 0        # an expert's MLP width; 0: ffn
    shared_experts: int = 0    # experts every token goes through as well (DeepSeek)
    dense_layers: int = 0      # the first blocks keep a dense MLP of width ffn
    tied: bool = False         # the head reuses the input embedding
    name: str = ""
    source: str = ""

    def __post_init__(self):
        for part, kind in PART_KINDS.items():
            try:
                kind.check(getattr(self, part), part)
            except ConfigError as e:
                raise ShapeError(str(e)) from None
        if self.hidden % self.heads:
            raise ShapeError(f"hidden={self.hidden} must be divisible by heads={self.heads}.")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ShapeError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (each K/V head serves a "
                             f"group of query heads).")
        if self.mlp not in MLPS:
            raise ShapeError(f"mlp={self.mlp!r} is not one of {', '.join(MLPS)}.")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ShapeError(f"top_k={self.top_k} must be between 1 and experts={self.experts}.")
        if self.dense_layers > self.layers:
            raise ShapeError(f"dense_layers={self.dense_layers} exceeds layers={self.layers}.")

    # --- the parts, with defaults resolved ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.width

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def _mlp_params(self, width: int) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * width

    # --- parameters --------------------------------------------------------------------------------------------------
    def attention_params(self) -> int:
        C, d = self.hidden, self.head_dim
        return C * self.heads * d * 2 + C * self.kv * d * 2  # q and out; k and v (narrower under GQA)

    def params(self) -> int:
        """Every parameter (norms included, biases left out as modern models do)."""
        dense = self.layers - self.moe_layers
        moe = self.experts * self._mlp_params(self.expert_width) + self.hidden * self.experts
        moe += self.shared_experts * self._mlp_params(self.expert_width)
        blocks = self.layers * (self.attention_params() + 2 * self.hidden)
        blocks += dense * self._mlp_params(self.width) + self.moe_layers * moe
        return blocks + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def active_params(self) -> int:
        """The parameters one token's forward uses: all but the experts it is not routed to."""
        unused = self.moe_layers * (self.experts - self.top_k) * self._mlp_params(self.expert_width)
        return self.params() - unused

    def expert_params(self) -> int:
        """Every routed expert's parameters, over all MoE blocks (what expert parallelism splits)."""
        return self.moe_layers * self.experts * self._mlp_params(self.expert_width)

    def stage_params(self, pp: int, stage: int, tp: int = 1, ep: int = 1, ids=None, first: bool | None = None,
                     last: bool | None = None) -> tuple[float, float]:
        """(all, of which routed experts) parameters one rank holds on pipeline stage ``stage`` of ``pp``: its
        blocks' 1/tp (experts also 1/ep; replicated K/V heads whole), the embedding on the first stage, the head and
        final norm on the last. The blocks split as the runtime splits them (``parallel.pipeline.stage_blocks``,
        which imports torch: an even split, earlier stages one more), or are the layer ``ids`` given; ``first`` and
        ``last`` say whether the rank holds the embedding and the head, where they are not its stage's."""
        if ids is None:
            per, extra = divmod(self.layers, pp)
            start = stage * per + min(stage, extra)
            ids = range(start, start + per + (stage < extra))
        first = stage == 0 if first is None else first
        last = stage == pp - 1 if last is None else last
        C, d = self.hidden, self.head_dim
        attention = 2 * C * self.heads * d / tp + 2 * C * d * self.kv_heads_per_rank(tp)
        total = experts = 0.0
        for i in ids:
            total += attention + 2 * C
            if self.experts and i >= self.dense_layers:
                routed = self.experts * self._mlp_params(self.expert_width) / (tp * ep)
                total += routed + self.shared_experts * self._mlp_params(self.expert_width) / tp + C * self.experts
                experts += routed
            else:
                total += self._mlp_params(self.width) / tp
        if first:
            total += self.vocab * C / tp
        if last:
            total += (0 if self.tied and first else self.vocab * C / tp) + C
        return total, experts

    # --- FLOPs -------------------------------------------------------------------------------------------------------
    def matmul_params(self) -> int:
        """The active weights a token multiplies by: all active parameters but the input embedding and norms."""
        return self.active_params() - self.vocab * self.hidden * (0 if self.tied else 1) \
            - (2 * self.layers + 1) * self.hidden

    def attention_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Attention's scores and weighted sum, forward, per token: 4·L·heads·head_dim·(T/2 causal, T not)."""
        keys = seq_len / 2 if causal else seq_len
        return 4 * self.layers * self.heads * self.head_dim * keys

    def flops_per_token(self, seq_len: int, causal: bool = True, backward: bool = True) -> float:
        """FLOPs per token of a training step (forward and backward; ``backward=False``: forward only)."""
        forward = 2 * self.matmul_params() + self.attention_flops_per_token(seq_len, causal)
        return forward * (3 if backward else 1)

    # --- tensor parallelism ------------------------------------------------------------------------------------------
    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel degree the heads cannot be split by (one sentence)."""
        if self.heads % tp:
            raise ShapeError(f"tp={tp} does not divide the {self.heads} attention heads.")
        if self.kv % tp and tp % self.kv:
            raise ShapeError(f"tp={tp} and the {self.kv} K/V heads: neither divides the other, so the K/V heads "
                             f"cannot be split or replicated evenly.")

    def kv_heads_per_rank(self, tp: int) -> float:
        """K/V heads one tensor-parallel rank computes: kv/tp, or one (a replica) when tp exceeds them."""
        return max(1, self.kv / tp)

    def kv_replication(self, tp: int) -> int:
        """How many ranks hold a copy of each K/V head: tp/kv when tp exceeds the K/V heads, else 1."""
        return max(1, tp // self.kv)

    # --- the kernels of one block on one rank ------------------------------------------------------------------------
    def kernels(self, tokens: float, seq_len: int, tp: int = 1, cp: int = 1, ep: int = 1, moe: bool = False,
                sequence_parallel: bool = False) -> list[dict]:
        """One block's forward on one rank, as kernels: ``tokens`` the rank's tokens of one microbatch (its T/cp of
        each sequence), ``seq_len`` the whole sequence (what its queries attend to, across the cp ring).

        Each entry: ``{"kind": "gemm", "name", "m", "n", "k"}`` (an m×k by k×n matmul; ``count`` of them),
        ``{"kind": "attention", "sequences", "heads", "q", "kv", "head_dim"}`` (a causal flash-attention kernel), or
        ``{"kind": "memory", "name", "elements"}`` (element-wise work: values read and written).
        """
        C, d, t = self.hidden, self.head_dim, tokens
        heads, kv = self.heads / tp, self.kv_heads_per_rank(tp)
        out = [_gemm("qkv", t, (heads + 2 * kv) * d, C), _gemm("out", t, C, heads * d),
               {"kind": "attention", "sequences": tokens * cp / seq_len, "heads": heads, "q": seq_len / cp,
                "kv": seq_len, "head_dim": d}]
        gate = 2 if self.mlp == "swiglu" else 1
        if moe:
            assignments = t * self.top_k  # balanced: each rank receives as many as it sends
            local = self.experts / ep
            rows = assignments / local if local >= 1 else assignments
            width = self.expert_width / tp
            out += [_gemm("router", t, self.experts, C),
                    _gemm("expert_up", rows, gate * width, C, count=max(1, local)),
                    _gemm("expert_down", rows, C, width, count=max(1, local))]
            if self.shared_experts:
                out += [_gemm("shared_up", t, gate * self.shared_experts * width, C),
                        _gemm("shared_down", t, C, self.shared_experts * width)]
            mlp_elements = assignments * width * (gate + 1)
        else:
            width = self.width / tp
            out += [_gemm("mlp_up", t, gate * width, C), _gemm("mlp_down", t, C, width)]
            mlp_elements = t * width * (gate + 1)
        # Element-wise: two norms (read, write), two residual adds (read two, write one), the activation; under
        # sequence parallelism the norms and adds see T/tp tokens, without it every tp rank repeats them.
        between = t * C * 10 / (tp if sequence_parallel else 1)
        out.append({"kind": "memory", "name": "elementwise", "elements": between + mlp_elements})
        return out

    def head_kernels(self, tokens: float, tp: int = 1) -> list[dict]:
        """The output head and its loss for one rank's tokens of a microbatch (on the last pipeline stage)."""
        return [_gemm("head", tokens, self.vocab / tp, self.hidden),
                {"kind": "memory", "name": "loss", "elements": 3 * tokens * self.vocab / tp}]

    def describe(self) -> str:
        parts = [f"{self.layers} blocks of {self.hidden}", f"{self.heads} heads"]
        if self.kv != self.heads:
            parts.append(f"{self.kv} K/V heads")
        parts.append(f"{self.mlp} MLP {self.width}")
        if self.experts:
            parts.append(f"{self.experts} experts of {self.expert_width} top-{self.top_k}"
                         + (f" + {self.shared_experts} shared" if self.shared_experts else ""))
        parts.append(f"vocabulary {self.vocab}")
        return f"{self.name or 'shape'}: " + ", ".join(parts)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    # --- the course's own GPT ----------------------------------------------------------------------------------------
    @property
    def is_course_block(self) -> bool:
        """Whether this is the course's own block (multi-head attention, a 4×-wide GELU MLP): then the course's
        memory model (:func:`gpucourse.modeled.memory.estimate`, checked against runs) sizes it exactly."""
        return self.kv == self.heads and self.mlp == "gelu" and self.width == 4 * self.hidden \
            and not self.shared_experts and not self.dense_layers and self.expert_width == self.width

    def overrides(self) -> dict:
        """The course GPT's sizes (``TrainConfig.overrides``) closest to this shape: same depth, width, heads,
        vocabulary and experts; its own block otherwise."""
        out = {"n_layer": self.layers, "n_embd": self.hidden, "n_head": self.heads, "vocab_size": self.vocab}
        if self.experts:
            out.update(moe_experts=self.experts, moe_top_k=self.top_k)
        return out

    @classmethod
    def of_model(cls, mc) -> "Shape":
        """The shape of a course GPT (a :class:`gpucourse.model.GPTConfig`)."""
        return cls(layers=mc.n_layer, hidden=mc.n_embd, heads=mc.n_head, vocab=mc.vocab_size,
                   experts=mc.moe_experts, top_k=mc.moe_top_k if mc.moe_experts else 2)


def _gemm(name: str, m: float, n: float, k: float, count: float = 1) -> dict:
    return {"kind": "gemm", "name": name, "m": m, "n": n, "k": k, "count": count}


# Public shapes. Each is the model's published depth, width, heads, MLP and vocabulary; ``params()`` counts them
# without biases, so it lands within a percent or two of the figure each source quotes (tests check each).
SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape(96, 12288, 96, vocab=50257, tied=True, name="gpt3-175b",
          source="Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1: 96 layers, d_model 12288, "
                 "96 heads of 128, d_ff = 4 × d_model; GPT-2's 50257-token vocabulary, tied embeddings"),
    Shape(128, 25600, 160, vocab=51200, name="megatron-1t",
          source="Narayanan et al. 2021 (SC21), Efficient Large-Scale Language Model Training on GPU Clusters "
                 "Using Megatron-LM, Table 1: 128 layers, hidden 25600, 160 heads; vocabulary 51200"),
    Shape(80, 8192, 64, vocab=32000, name="llama2-70b", kv_heads=8, ffn=28672, mlp="swiglu",
          source="Touvron et al. 2023, Llama 2, Table 1 and the released config: 80 layers, 8192 wide, 64 heads, "
                 "8 K/V heads (GQA), SwiGLU MLP 28672, vocabulary 32000"),
    Shape(32, 4096, 32, kv_heads=8, ffn=14336, mlp="swiglu", vocab=128256, name="llama3-8b",
          source="Llama 3 Herd of Models (Dubey et al. 2024), Table 3: 32 layers, model dimension 4096, FFN "
                 "14336, 32 attention heads, 8 key/value heads, vocabulary 128000 (128256 in the release)"),
    Shape(80, 8192, 64, kv_heads=8, ffn=28672, mlp="swiglu", vocab=128256, name="llama3-70b",
          source="Llama 3 Herd of Models, Table 3: 80 layers, 8192, FFN 28672, 64 heads, 8 K/V heads"),
    Shape(126, 16384, 128, kv_heads=8, ffn=53248, mlp="swiglu", vocab=128256, name="llama3-405b",
          source="Llama 3 Herd of Models, Table 3: 126 layers, 16384, FFN 53248, 128 heads, 8 K/V heads"),
    Shape(32, 4096, 32, kv_heads=8, ffn=14336, mlp="swiglu", vocab=32000, experts=8, top_k=2, name="mixtral-8x7b",
          source="Jiang et al. 2024, Mixtral of Experts, Table 1: 32 layers, dim 4096, 32 heads, 8 K/V heads, "
                 "hidden 14336, 8 experts, top 2, vocabulary 32000 (46.7 B parameters, 12.9 B active)"),
    Shape(61, 7168, 128, ffn=18432, mlp="swiglu", vocab=129280, experts=256, top_k=8, expert_ffn=2048,
          shared_experts=1, dense_layers=3, name="deepseek-v3-like",
          source="DeepSeek-V3 Technical Report (2024), section 4.2: 61 layers, hidden 7168, 128 heads of 128, "
                 "first 3 blocks dense (FFN 18432), then 1 shared and 256 routed experts of 2048, 8 active; "
                 "vocabulary 129280. Its multi-head latent attention is counted here as plain multi-head "
                 "attention of the same heads (671 B parameters, 37 B active, in the report)"),
)}

SHAPE = Name(SHAPES, unknown="is not a shape of the table; known: {names}")  # a shape's name (plan --shape)

PARTS = ("layers", "hidden", "heads", "kv_heads", "ffn", "mlp", "vocab", "experts", "top_k", "expert_ffn",
         "shared_experts", "dense_layers", "tied")


def get_shape(shape) -> Shape:
    """A :class:`Shape` from a name in ``SHAPES``, a dict of its parts (:data:`PARTS`, or the course's ``n_layer``,
    ``n_embd``, ``n_head``, ``vocab_size``, ``moe_experts``, ``moe_top_k``), or a Shape."""
    if isinstance(shape, Shape):
        return shape
    if isinstance(shape, str):
        try:
            return SHAPES[SHAPE.check(shape, "shape")]
        except ConfigError as e:
            raise ShapeError(str(e)) from None
    if not isinstance(shape, dict):
        raise ShapeError(f"a shape is a name, a dict of parts or a Shape, not {type(shape).__name__}.")
    course = {"n_layer": "layers", "n_embd": "hidden", "n_head": "heads", "vocab_size": "vocab",
              "moe_experts": "experts", "moe_top_k": "top_k"}
    parts = {course.get(k, k): v for k, v in shape.items() if k not in ("block_size", "name", "source")}
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ShapeError(f"unknown shape part{'s' * (len(unknown) > 1)} {', '.join(unknown)}; the parts are "
                         f"{', '.join(PARTS)}.")
    missing = [p for p in ("layers", "hidden", "heads") if p not in parts]
    if missing:
        raise ShapeError(f"a shape needs layers, hidden and heads; {', '.join(missing)} missing.")
    return Shape(**parts, name=shape.get("name", ""))


def for_params(num_params: float) -> Shape:
    """A plausible GPT shape with about ``num_params`` parameters: width ≈ 100 × depth (Llama-2 70B has 80 blocks
    of 8192), heads of 128, a 32000-token vocabulary; from 1024 on, the width is a multiple of 8 heads, so that
    tensor parallelism of 2, 4 or 8 divides the heads."""
    n_layer = max(2, round((num_params / (12 * 100**2)) ** (1 / 3)))
    width = math.sqrt(num_params / (12 * n_layer))
    step = 1024 if width >= 1024 else 128
    n_embd = max(128, round(width / step) * step)
    return Shape(n_layer, n_embd, n_embd // 128, vocab=32000)
