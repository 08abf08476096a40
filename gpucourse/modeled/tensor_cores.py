"""What tensor cores compute with — TF32 and FP8 — and the shapes they want, emulated exactly on any CPU.

A GPU's tensor cores multiply small matrix tiles in reduced precision and add the products in fp32. Three things a
learner meets on NVIDIA GPUs, each reproduced here bit for bit so its error can be measured without one:

- **TF32** (A100 and later): an fp32 matmul may round its *inputs* to TensorFloat-32 — fp32's 8-bit exponent, so
  the same range, but 10 explicit mantissa bits instead of 23 — and accumulate in fp32. :func:`to_tf32` rounds
  the way the hardware does (to nearest, ties to even). PyTorch leaves it off for matmuls unless asked
  (``torch.set_float32_matmul_precision("high")``); cuDNN convolutions use it by default.
- **FP8** (Ada and Hopper GPUs and later: the L4, the H100): two 8-bit formats. **E4M3** (4 exponent bits, 3
  mantissa bits, largest 448) keeps more precision and is used for weights and activations; **E5M2** (5 and 2,
  largest 57344) keeps more range and is used for gradients — Transformer Engine's ``HYBRID`` recipe. Eight bits
  cover so little range that every tensor is *scaled* into it first: multiplied by ``scale = max_of_format / amax``
  (amax: the largest magnitude), cast, and divided by the scale after the matmul. :func:`quantize` is that round
  trip.
- **Delayed scaling** (Transformer Engine's default recipe): knowing amax would need a pass over the tensor before
  the cast, so the scale is computed from the amaxes of the *previous* iterations (a window of ``history_len``,
  reduced by ``max``), with a safety ``margin`` of powers of two. :class:`DelayedScaling` keeps that history. The
  price: a tensor whose values jump above the history's largest is clipped for that step (saturated at the
  format's maximum) — which :func:`delayed_scaling_demo` shows.
- **Shapes**: a tensor core works on tiles; a matrix dimension that is not a multiple of 8 elements (16 bytes in
  fp16/bf16) is padded or falls back to slower kernels. :func:`misaligned_dims` lists a model's matmul dimensions
  that are not, and :func:`padded` rounds one up (GPT-2's vocabulary 50257 → 50304, a multiple of 64 and 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MANTISSA_BITS = {"fp32": 23, "tf32": 10, "bf16": 7, "e4m3": 3, "e5m2": 2}  # explicitly stored
ALIGN_ELEMENTS = 8  # 16 bytes of fp16/bf16: the tile edge a tensor-core matmul wants its dimensions to be a multiple of


def fp8_max(fmt: str) -> float:
    """The largest finite value of an FP8 format: 448 for e4m3, 57344 for e5m2."""
    return torch.finfo(_dtype(fmt)).max


def fp8_smallest(fmt: str) -> float:
    """The smallest positive (subnormal) value of an FP8 format: 2^-9 for e4m3, 2^-16 for e5m2; below half of it a
    value becomes 0."""
    info = torch.finfo(_dtype(fmt))
    return info.tiny * info.eps


def _dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}: the formats are {', '.join(FORMATS)}.")
    return FORMATS[fmt]


def quantize(x: torch.Tensor, fmt: str, scale: float = 1.0) -> torch.Tensor:
    """``x`` after the FP8 round trip: times ``scale``, saturated at the format's maximum, cast to FP8, back to
    fp32 and divided by ``scale`` — what the matmul sees of ``x``."""
    top = fp8_max(fmt)
    scaled = (x.float() * scale).clamp(-top, top)
    return scaled.to(_dtype(fmt)).float() / scale


def amax_scale(amax: float, fmt: str, margin: int = 0) -> float:
    """The scale that maps ``amax`` onto the format's maximum, ``2**margin`` below it: (max / amax) / 2**margin."""
    return fp8_max(fmt) / amax / 2 ** margin if amax > 0 else 1.0


def errors(x: torch.Tensor, fmt: str, scale: float = 1.0) -> dict:
    """What the FP8 round trip of ``x`` (see :func:`quantize`) loses: the relative error of the whole tensor (norm
    of the difference over the norm of ``x``), the share of non-zero values that became 0 (underflow) and the
    share that was clipped at the format's maximum (saturated)."""
    x = x.float()
    q = quantize(x, fmt, scale)
    nonzero = x != 0
    return {"relative_error": ((q - x).norm() / x.norm().clamp_min(1e-30)).item(),
            "underflow": ((q == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1),
            "saturated": ((x * scale).abs() > fp8_max(fmt)).sum().item() / max(x.numel(), 1)}


@dataclass
class DelayedScaling:
    """Transformer Engine's delayed scaling for one tensor, with its defaults: the scale for this step comes from
    the amaxes of earlier steps (the last ``history_len``, reduced by ``algo``: ``"max"`` or ``"most_recent"``),
    ``2**margin`` below the format's maximum; each step then records its own amax. Before any history the scale
    is 1."""

    fmt: str = "e4m3"
    history_len: int = 1024
    algo: str = "max"
    margin: int = 0
    history: list = field(default_factory=list)

    def scale(self) -> float:
        if not self.history:
            return 1.0
        amax = max(self.history) if self.algo == "max" else self.history[-1]
        return amax_scale(amax, self.fmt, self.margin)

    def __call__(self, x: torch.Tensor) -> dict:
        """Quantize ``x`` with the scale of the history so far: that scale, ``x``'s amax and :func:`errors`; then
        ``x``'s amax joins the history."""
        amax, scale = x.abs().max().item(), self.scale()
        self.history = (self.history + [amax])[-self.history_len:]
        return {"amax": amax, "scale": scale, **errors(x, self.fmt, scale)}


def delayed_scaling_demo(steps: int = 8, jump_at: int = 5, jump: float = 4.0, seed: int = 0, **recipe) -> list:
    """A tensor whose magnitude grows slowly and then jumps ``jump`` times at step ``jump_at``, quantized each step
    with delayed scaling: one row per step with its amax, the scale used, and the errors. The jump's step saturates
    (its scale came from smaller amaxes); from the next step on the history holds the jump."""
    gen = torch.Generator().manual_seed(seed)
    ds = DelayedScaling(**recipe)
    rows = []
    for step in range(steps):
        x = torch.randn(4096, generator=gen) * (1.0 + 0.05 * step) * (jump if step == jump_at else 1.0)
        rows.append({"step": step, **ds(x)})
    return rows


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to TF32: 10 mantissa bits, round to nearest, ties to even; still stored as fp32."""
    drop = MANTISSA_BITS["fp32"] - MANTISSA_BITS["tf32"]
    bits = x.float().contiguous().view(torch.int32)
    keep = (bits >> drop) & 1  # the last kept bit, for ties to even
    rounded = (bits + ((1 << (drop - 1)) - 1) + keep) & ~((1 << drop) - 1)
    finite = torch.isfinite(x)
    return torch.where(finite, rounded.view(torch.float32), x.float())


def matmul_error(a: torch.Tensor, b: torch.Tensor, how: str) -> float:
    """Relative error of ``a @ b`` when the inputs are rounded as a tensor core would (``"tf32"``, ``"bf16"``,
    ``"e4m3"`` with per-tensor amax scaling) and the products are added in fp32, against the fp64 product."""
    exact = a.double() @ b.double()
    if how == "tf32":
        qa, qb = to_tf32(a), to_tf32(b)
    elif how == "bf16":
        qa, qb = a.bfloat16().float(), b.bfloat16().float()
    elif how in FORMATS:
        qa = quantize(a, how, amax_scale(a.abs().max().item(), how))
        qb = quantize(b, how, amax_scale(b.abs().max().item(), how))
    elif how == "fp32":
        qa, qb = a.float(), b.float()
    else:
        raise ValueError(f"unknown input rounding {how!r}: use fp32, tf32, bf16, e4m3 or e5m2.")
    got = (qa.float() @ qb.float()).double()
    return ((got - exact).norm() / exact.norm()).item()


def padded(n: int, multiple: int = 64) -> int:
    """``n`` rounded up to a multiple (a vocabulary padded for tensor cores: 50257 → 50304 for 64)."""
    return math.ceil(n / multiple) * multiple


def matmul_dims(model_config, tp: int = 1) -> dict[str, tuple[int, int]]:
    """A transformer's matmul dimensions as (size, shards): the hidden size, one head's size (attention's own
    matmuls), and the two that tensor parallelism splits over ``tp`` ranks — the MLP's inner size and the
    vocabulary (the output layer)."""
    c = model_config
    return {"hidden": (c.n_embd, 1), "head": (c.head_dim, 1), "mlp inner": (4 * c.n_embd, tp),
            "vocabulary": (c.vocab_size, tp)}


def misaligned_dims(model_config, tp: int = 1, multiple: int = ALIGN_ELEMENTS) -> dict[str, int]:
    """The matmul dimensions whose every shard is not a multiple of ``multiple`` elements (8: 16 bytes of bf16) —
    a split dimension must divide by ``multiple × tp``, Megatron's rule for padding the vocabulary."""
    return {k: size for k, (size, shards) in matmul_dims(model_config, tp).items() if size % (multiple * shards)}
