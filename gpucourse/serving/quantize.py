"""Quantization: fewer bytes per weight and per cached token, and what it costs in loss and in tokens.

**Why it speeds decode.** A decode step multiplies each sequence's one new token by every weight: 2 FLOPs per
weight and sequence, while an H100 SXM can do about 300 bf16 FLOPs in the time it reads one byte of HBM (989
TFLOP/s over 3.35 TB/s). Until a batch holds hundreds of sequences, decode waits on reading the weights, so a
step takes about as many times less as its weights take fewer bytes: bf16's 2 bytes against int4's 0.5 + 4/32
(group 32, fp32 scales, as here) is 3.2 times, against 0.5 + 2/128 (GPTQ's group 128, fp16 scales) 3.9 times.
Prefill runs the whole prompt through each weight it reads — hundreds of FLOPs per weight — so it is limited by
compute, which weight-only quantization leaves as it was: the weight is dequantized and multiplied in bf16
(or fp32 here) like before, plus the work of dequantizing.

**The weight schemes** (weight-only: activations stay in full precision). A Linear's weight (out, in) is stored
as small numbers and a *scale*; as in :mod:`gpucourse.modeled.tensor_cores`, the scale multiplies a weight into the
stored range and divides it back out: ŵ = stored / scale. Symmetric absmax: the largest magnitude (amax) of a
row or a group lands on the largest stored value, so nothing saturates. Scales are fp32 here (GPTQ and AWQ
checkpoints keep them in fp16: half their bytes).

- ``int8``, one scale per output channel (row): scale = 127 / amax_row, stored round(w · scale) in [-127, 127].
  Rounding to the nearest integer step of 1/scale: |w − ŵ| ≤ 1/(2·scale) = amax_row/254.
  Bytes per weight: 1 + 4/in.
- ``int4``, one scale per group of ``group`` consecutive input features of a row (GPTQ's and AWQ's g = 128;
  32 here, for narrow models): scale = 7 / amax_group, stored round(w · scale) + 8 in 1..15, two values a
  byte (the even feature in the low four bits). |w − ŵ| ≤ amax_group/14. Bytes per weight: 1/2 + 4/group.
  One outlier in a row would coarsen the step of the whole row; a group confines it to its group.
- ``fp8``, E4M3 (or E5M2) with one scale per row, or one for the tensor (``per_tensor``): scale = 448 / amax,
  stored fp8(w · scale). FP8 rounds to 3 mantissa bits, a relative step, not an absolute one:
  |w − ŵ| ≤ |w|·2⁻⁴ in the normal range, plus at most half the smallest subnormal (2⁻¹⁰) / scale below it
  (2⁻³ and 2⁻¹⁷ for E5M2). Bytes per weight: 1 + 4/in (per row) or 1 + 4/(out·in) (per tensor).

:func:`quantize_model` stores every Linear inside the transformer blocks so (a :class:`QuantizedLinear`, the
Linear's interface, its weight dequantized at each forward). The embeddings, the norms, the biases and the
output head stay in full precision — the head's error goes straight into the logits, and bitsandbytes skips
``lm_head`` by default — and so does a mixture of experts' router (AutoAWQ leaves Mixtral's ``gate`` alone): a
rounding that changes a token's choice of expert changes its output by a whole expert. A model therefore saves
less than the ratio per weight: gpt2-small's blocks hold 85 M of its 163 M parameters (:func:`weight_bytes`
counts both parts).

**FP8 KV cache.** :class:`FP8KVCache` keeps keys and values in FP8 with one scale (vLLM's
``kv_cache_dtype="fp8"``, scale 1 unless calibrated): 2 · n_layer · n_embd bytes a token instead of 4 times
that in fp32 or twice in bf16. What attention reads back is ``tensor_cores.quantize(k, fmt, scale)`` bit for
bit; the prompt's own attention (prefill) reads the cache too, so it sees rounded keys and values from the first
token on. E5M2 reaches 57344 and needs no scale for most activations, but keeps one mantissa bit fewer. A scale
that is a power of two only shifts exponents: it changes which values underflow or saturate, never how the
others round.

:func:`quantization_effect` measures what a scheme costs: the loss on a fixed batch of the course's data and
the share of next-token predictions and of greedy tokens equal to the full-precision model's. Measure a trained
model: a randomly initialised one predicts nearly uniform logits, whose order rounding reshuffles. Once a greedy
token differs, the rest of its row continues another text, so that share falls by whole continuations.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data import global_batch
from ..model import loss_fn
from .kv_cache import KVCache, check_fits, inference

SCHEMES = ("int8", "int4", "fp8")
# The FP8 formats of tensor_cores (a tool the core may not import); the tests hold the two equal.
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
INT_MAX = {"int8": 127, "int4": 7}  # symmetric: int4's -8 stays unused, so that 0 is exactly 0


def check_scheme(scheme: str, group: int = 32, fmt: str = "e4m3", layers=()) -> None:
    """Refuse, in one sentence, a quantization that cannot be applied to ``layers`` ((name, in_features) pairs)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}: the schemes are {', '.join(SCHEMES)}.")
    if scheme == "fp8" and fmt not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}: the formats are {', '.join(FP8_FORMATS)}.")
    if scheme == "int4" and (group < 2 or group % 2):
        raise ValueError(f"int4 groups must hold an even number of input features (two 4-bit values share a "
                         f"byte); got {group}.")
    for name, in_features in layers if scheme == "int4" else ():
        if in_features % group:
            raise ValueError(f"int4 groups of {group} input features do not divide the {in_features} "
                             f"input features of {name}.")


def to_fp8(x: torch.Tensor, fmt: str, scale) -> torch.Tensor:
    """``x`` times ``scale``, saturated at the format's largest value and rounded to FP8 (to nearest, ties to even):
    the stored half of :func:`gpucourse.modeled.tensor_cores.quantize`, whose other half is ``.float() / scale``."""
    top = torch.finfo(FP8_FORMATS[fmt]).max
    return (x.float() * scale).clamp(-top, top).to(FP8_FORMATS[fmt])


def quantize_weight(w: torch.Tensor, scheme: str = "int8", group: int = 32, fmt: str = "e4m3",
                    per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (out, in) as stored: ``(data, scale)``. data: int8 (out, in) for int8; uint8 (out, in/2), two
    values a byte, for int4; float8 (out, in) for fp8. scale (fp32): (out, 1); (out, in/group); (out, 1) or ()."""
    out, n_in = w.shape
    check_scheme(scheme, group, fmt, [("the weight", n_in)])
    w = w.detach().float()
    if scheme == "int4":
        w = w.reshape(out, n_in // group, group)
    amax = w.abs().amax() if scheme == "fp8" and per_tensor else w.abs().amax(-1, keepdim=True)
    top = torch.finfo(FP8_FORMATS[fmt]).max if scheme == "fp8" else INT_MAX[scheme]
    scale = torch.where(amax > 0, top / amax, 1.0)  # a row of zeros: any scale stores its zeros exactly
    if scheme == "fp8":
        return to_fp8(w, fmt, scale), scale
    q = torch.round(w * scale).clamp(-top, top).to(torch.int8)
    if scheme == "int8":
        return q, scale
    pairs = (q.view(out, n_in // 2, 2) + 8).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4), scale.squeeze(-1)


def dequantize_weight(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The weight a forward multiplies by: the stored values divided by their scales, in ``dtype``. The scheme
    is read from ``data``'s dtype (uint8: int4, two values a byte)."""
    if data.dtype == torch.uint8:
        q = torch.stack([data & 15, data >> 4], -1).view(data.shape[0], scale.shape[1], -1).float() - 8
        return (q / scale[..., None]).view(data.shape[0], -1).to(dtype)
    return (data.float() / scale).to(dtype)


def stored_bytes(out_features: int, in_features: int, scheme: str, group: int = 32, per_tensor: bool = False) -> int:
    """Bytes of an (out, in) weight stored in ``scheme``, its fp32 scales included: the formula."""
    weights = out_features * in_features
    values = weights // 2 if scheme == "int4" else weights
    scales = {"int8": out_features, "int4": weights // group, "fp8": 1 if per_tensor else out_features}[scheme]
    return values + 4 * scales


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored quantized and dequantized at every forward (weight-only quantization): the
    same inputs, outputs, bias and ``weight`` (dequantized) as the Linear it replaces."""

    def __init__(self, linear: nn.Linear, scheme: str = "int8", group: int = 32, fmt: str = "e4m3",
                 per_tensor: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        data, scale = quantize_weight(linear.weight, scheme, group, fmt, per_tensor)
        self.register_buffer("data", data)  # buffers: moved by .to(device), saved in the state dict
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_weight(self.data, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_weight(self.data, self.scale, x.dtype), self.bias)

    def stored_bytes(self) -> int:
        """Bytes the weight takes as stored: its values and its scales (the bias is counted as a parameter)."""
        return self.data.nbytes + self.scale.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def quantize_model(model: nn.Module, scheme: str = "int8", group: int = 32, fmt: str = "e4m3",
                   per_tensor: bool = False, inplace: bool = False) -> nn.Module:
    """``model`` (a copy unless ``inplace``) with every Linear inside its ``blocks`` a :class:`QuantizedLinear`;
    the embeddings, norms, head and routers stay as they are. A scheme a layer cannot take is refused before any
    change."""
    layers = [(name, m) for name, m in model.named_modules()
              if name.startswith("blocks.") and isinstance(m, nn.Linear) and not name.endswith(".router")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Linear layer inside `blocks` to quantize.")
    check_scheme(scheme, group, fmt, [(name, m.in_features) for name, m in layers])
    if not inplace:
        model = copy.deepcopy(model)
    for name, _ in layers:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, QuantizedLinear(getattr(owner, child), scheme, group, fmt, per_tensor))
    return model


def weight_bytes(model: nn.Module) -> dict:
    """The model's weight memory, counted from its tensors: the quantized weights (values and scales) beside what
    the same weights take in fp32 and bf16, and every other parameter as it is stored."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    weights = sum(m.in_features * m.out_features for m in quantized)
    stored = sum(m.stored_bytes() for m in quantized)
    other = sum(p.nbytes for p in model.parameters())
    return {"quantized_weights": weights, "stored_bytes": stored, "fp32_bytes": 4 * weights, "bf16_bytes": 2 * weights,
            "bytes_per_weight": stored / max(weights, 1), "other_bytes": other, "total_bytes": stored + other}


class FP8KVCache(KVCache):
    """A :class:`KVCache` holding keys and values in FP8 (``fmt`` e4m3 or e5m2, one byte a number) times one
    ``scale``; reads give them back in ``dtype``: ``tensor_cores.quantize(k, fmt, scale)``, bit for bit."""

    def __init__(self, cfg, batch: int, max_len: int, fmt: str = "e4m3", scale: float = 1.0,
                 heads: int | None = None, dtype=torch.float32, device=None):
        if fmt not in FP8_FORMATS:
            raise ValueError(f"unknown FP8 format {fmt!r} for the KV cache: the formats are {', '.join(FP8_FORMATS)}.")
        if not scale > 0:
            raise ValueError(f"an FP8 KV cache's scale multiplies every key and value, so it must be positive; "
                             f"got {scale}.")
        super().__init__(cfg, batch, max_len, heads, dtype=FP8_FORMATS[fmt], device=device)
        self.fmt, self.scale, self.dtype = fmt, float(scale), dtype

    def write(self, layer, k, v):
        super().write(layer, to_fp8(k, self.fmt, self.scale), to_fp8(v, self.fmt, self.scale))

    def read(self, layer):
        k, v = super().read(layer)
        return (k.float() / self.scale).to(self.dtype), (v.float() / self.scale).to(self.dtype)


def evaluate(model, x: torch.Tensor, y: torch.Tensor, prompts: torch.Tensor, new_tokens: int,
             kv: str | None = None, kv_scale: float = 1.0) -> dict:
    """Through a KV cache (the model's fp32 one, or an :class:`FP8KVCache` of format ``kv``): the loss on ``(x, y)``,
    the most likely next token at each position of ``x`` (B, T), and the greedy continuations (B, new_tokens) of
    ``prompts`` (B, P)."""
    weight = next(model.parameters())

    def cache(rows, length):
        if kv is None:
            return KVCache(model.cfg, rows, length, dtype=weight.dtype, device=weight.device)
        return FP8KVCache(model.cfg, rows, length, kv, kv_scale, dtype=weight.dtype, device=weight.device)

    with inference(model):
        c = cache(*x.shape)
        c.positions = torch.arange(x.shape[1], device=x.device).expand_as(x)  # every row from position 0
        c.valid = torch.ones_like(x, dtype=torch.bool)
        logits = model(x, cache=c)
        c, idx, chosen = cache(len(prompts), prompts.shape[1] + new_tokens), prompts, []
        counts = torch.full((len(prompts),), prompts.shape[1], device=prompts.device)  # prefill, then one a step
        for _ in range(new_tokens):
            chosen.append(c.feed_rows(model, idx, counts).argmax(-1))
            idx, counts = chosen[-1][:, None], torch.ones_like(counts)
    return {"loss": loss_fn(logits, y).item(), "predicted": logits.argmax(-1), "generated": torch.stack(chosen, 1)}


def quantization_effect(model, quantized=None, kv: str | None = None, kv_scale: float = 1.0, rows: int = 8,
                        seq_len: int = 64, prompt_len: int = 16, new_tokens: int = 32, seed: int = 1) -> dict:
    """What a quantization changes against ``model`` in full precision: ``quantized`` (a :func:`quantize_model`
    copy; ``model`` itself if None) and an FP8 KV cache if ``kv`` names a format. On a fixed batch of the course's
    data (``rows`` × ``seq_len``): the loss, and the share of positions whose most likely next token is unchanged
    (each position on the true text: a flip does not carry over). Then the share of greedy tokens equal to the
    full-precision model's, ``new_tokens`` after each row's first ``prompt_len`` tokens (a flip there sends the
    rest of the row down another text)."""
    check_fits(model.cfg, seq_len, 1, "the batch")
    check_fits(model.cfg, prompt_len, new_tokens, "a prompt")
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in global_batch(0, rows, seq_len, seed))
    base = evaluate(model, x, y, x[:, :prompt_len], new_tokens)
    got = evaluate(model if quantized is None else quantized, x, y, x[:, :prompt_len], new_tokens, kv, kv_scale)
    return {"loss": base["loss"], "quantized_loss": got["loss"], "loss_change": got["loss"] - base["loss"],
            "same_next_token": (got["predicted"] == base["predicted"]).float().mean().item(),
            "same_greedy_tokens": (got["generated"] == base["generated"]).float().mean().item()}
