"""The modeled cluster's kernels against this machine's: each matmul of a model's block and its attention, timed here
and by :meth:`gpucourse.modeled.cluster.Cluster.kernel_s`, side by side.

``scripts/gpu-check`` runs it on a GPU box (gpt2-small's kernels on the GPU it finds, against that GPU's entry in
:mod:`gpucourse.modeled.gpus`), and the ratios it prints go into ``docs/gpu-results.md``: the model's constants are public
measurements and a fit to published runs, and this is the check on the card at hand::

    from gpucourse.modeled.calibrate import kernel_ratios, format_ratios
    print(format_ratios(kernel_ratios("cuda", "h200")))
"""

from __future__ import annotations

import statistics
import time

import torch

from ..model import MODELS
from .cluster import Cluster
from .shapes import Shape

# What torch.cuda.get_device_name() says, and the entry of gpucourse.modeled.gpus it is.
NAMES = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"), ("A100", "a100"), ("L4", "l4"))


def gpu_entry(device_name: str) -> str | None:
    """The :mod:`gpucourse.modeled.gpus` entry for a device name ("NVIDIA H100 80GB HBM3" → "h100"), or None."""
    for token, entry in NAMES:
        if token in device_name:
            return entry
    return None


def _sync_of(device: str):
    """What waits for ``device``'s queued work: CUDA's synchronize, or nothing on the CPU."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _timed(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after a warm-up, synchronising CUDA around each."""
    sync = _sync_of(device)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_ratios(device: str, gpu: str, model: str = "gpt2-small", tokens: int = 4096, seq_len: int = 512,
                  precision: str = "bf16", repeats: int = 10) -> list[dict]:
    """Each forward matmul of one block of ``model`` (``tokens`` tokens, sequences of ``seq_len``) and its causal
    attention, timed on ``device`` and by the model of ``gpu``: ``{"kernel", "shape", "measured_s", "modeled_s",
    "ratio"}`` (ratio: modeled over measured)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    shape = Shape.of_model(MODELS[model])
    cluster = Cluster.of(gpu)
    rows = []
    for k in shape.kernels(tokens, seq_len):
        if k["kind"] == "gemm":
            m, n, kk = int(k["m"]), int(k["n"]), int(k["k"])
            a = torch.randn(m, kk, device=device, dtype=dtype)
            b = torch.randn(kk, n, device=device, dtype=dtype)
            measured = _timed(lambda: a @ b, device, repeats)
            label = f"{m}×{kk} @ {kk}×{n}"
        elif k["kind"] == "attention":
            seqs, heads, d = int(k["sequences"]), int(k["heads"]), k["head_dim"]
            q, kv = (torch.randn(seqs, heads, seq_len, d, device=device, dtype=dtype) for _ in range(2))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            measured = _timed(lambda: sdpa(q, kv, kv, is_causal=True), device, repeats)
            label = f"{seqs} × {heads} heads × {seq_len} tokens, head {d}"
        else:
            continue
        modeled = cluster.kernel_s(k, precision)
        rows.append({"kernel": k.get("name", k["kind"]), "shape": label, "measured_s": measured,
                     "modeled_s": modeled, "ratio": modeled / measured})
    return rows


def serving_ratios(device: str, gpu: str, model: str = "gpt2-small", prompt_len: int = 512, prompts: int = 8,
                   batches=(1, 16), new_tokens: int = 32, precision: str = "bf16", repeats: int = 3) -> list[dict]:
    """``model`` serving on ``device`` beside :mod:`gpucourse.modeled.serve_plan`'s model of ``gpu``: a prefill of
    ``prompts`` prompts of ``prompt_len`` tokens (tokens/s), and decode with the KV cache at each batch of
    ``batches`` (``new_tokens`` tokens after a prompt of ``prompt_len``: tokens/s). Rows as :func:`kernel_ratios`'
    (``ratio``: modeled over measured time)."""
    from ..model import build_model
    from .serve_plan import decode_step, prefill
    from ..serving import KVCache

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    cfg = MODELS[model]
    net = build_model(cfg, 0).to(device=device, dtype=dtype).eval()
    shape, weights = Shape.of_model(cfg), "fp32" if precision == "fp32" else "bf16"
    g = torch.Generator().manual_seed(0)
    rows = []
    ids = torch.randint(0, cfg.vocab_size, (prompts, prompt_len), generator=g).to(device)
    with torch.no_grad():
        measured = _timed(lambda: net(ids), device, repeats)  # every position's logits: the head's matmul too
    modeled = prefill(shape, gpu, prompts, prompt_len, weights=weights)["first_token_s"]
    rows.append({"kernel": "prefill", "shape": f"{prompts} prompts × {prompt_len} tokens", "measured_s": measured,
                 "modeled_s": modeled, "ratio": modeled / measured})
    sync = _sync_of(device)
    for batch in batches:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
        steps = []
        for _ in range(repeats + 1):  # the first pass warms up
            cache = KVCache(cfg, batch, prompt_len + new_tokens, dtype=dtype, device=device)
            with torch.no_grad():
                logits = cache.feed_rows(net, prompt, torch.full((batch,), prompt_len, device=device))
                sync()
                start = time.perf_counter()
                for _ in range(new_tokens):  # decode: one token a sequence a step, through the cache
                    logits = cache.feed_rows(net, logits.argmax(-1)[:, None], torch.ones(batch, dtype=torch.long,
                                                                                          device=device))
                sync()
            steps.append((time.perf_counter() - start) / new_tokens)
        measured = statistics.median(steps[1:])
        modeled = decode_step(shape, gpu, batch, prompt_len + new_tokens // 2, weights=weights, kv=weights)["token_s"]
        rows.append({"kernel": "decode", "shape": f"batch {batch}, {prompt_len}+{new_tokens} tokens",
                     "measured_s": measured, "modeled_s": modeled, "ratio": modeled / measured})
    return rows


def format_ratios(rows: list[dict], gpu: str = "") -> str:
    """The table gpu-check prints: each kernel's measured and modeled time and their ratio."""
    lines = [f"{'kernel':<10} {'shape':<36} {'measured':>10} {'modeled' + (' ' + gpu if gpu else ''):>14} "
             f"{'modeled/measured':>17}"]
    for r in rows:
        lines.append(f"{r['kernel']:<10} {r['shape']:<36} {1e6 * r['measured_s']:>8.1f}µs {1e6 * r['modeled_s']:>12.1f}µs "
                     f"{r['ratio']:>17.2f}")
    return "\n".join(lines)
