"""Published serving measurements the serving model (:mod:`gpucourse.modeled.serve_plan`) is checked against.

Each :class:`ServeRun` is one number a source printed for Llama-class models and Mixtral 8×7B — the model, GPUs, tensor-parallel
degree, precision of the weights and of the KV cache, batch (or concurrency), prompt and output lengths — and what
it measured. :func:`modeled` turns the same setting into the same figure with :func:`serve_plan.prefill` and
:func:`serve_plan.decode_step`, and a static batch with :func:`serve_plan.serve`, the function the serving planner sizes and
times its batches with:

- ``"output_tokens_per_s_per_gpu"``, a *static* batch (TensorRT-LLM's ``gptSessionBenchmark``): all ``batch``
  prompts are prefilled at once, which makes the first output token; then ``output − 1`` decode steps of the whole
  batch. A decode step's cost grows linearly with its context, so the steps together cost ``output − 1`` steps at
  the mean context, ``prompt + output / 2`` (what each sequence holds on average, :func:`serve_plan.held`). The
  figure is ``batch × output ÷ (prefill + decode) ÷ tp``, as
  TensorRT-LLM defines it (docs/source/blogs/Falcon180B-H200.md: ``out_tps=output_seqlen*batch_size/total_latency/tp``);
- ``"tpot_s"``, the time per output token at the stated concurrency: one decode step of ``batch`` sequences at the
  mean context;
- ``"first_token_s"``: the prefill of ``batch`` prompts.

A measurement whose batch or concurrency is not stated is left out rather than guessed (:data:`EXCLUDED` says
which, and why). The rows were split into a fitting and a held-out set by a rule that ignores the errors —
within each source table, in the source's order, rows alternate fit, held-out, fit, … — so a constant tuned on the
fitting rows is judged on the others. gpt-fast's rows (one request at a time on A100s, ``"tokens_per_s"``: 200 new
tokens over the prefill and 199 decode steps, as its generate.py times them) came after the constant was fitted
and are all held out. ``tests/test_serve_published.py`` recomputes every row and keeps the table in
``docs/modeled-timing.md`` equal to :func:`markdown_table`; ``gpucourse bench`` reports the largest error
(``serve_model_vs_published_max_error``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .serve_plan import decode_step, held, prefill, serve
from .shapes import Shape, get_shape

TRTLLM_V09 = ("NVIDIA TensorRT-LLM, docs/source/performance.md at release v0.9.0 "
              "(github.com/NVIDIA/TensorRT-LLM/blob/v0.9.0/docs/source/performance.md; 'All data was generated "
              "using version 0.9.0'); engines built with FP8 weights and FP8 KV cache (quant_algo FP8, "
              "kv_cache_quant_algo FP8), measured with gptSessionBenchmark (static batching)")
TRTLLM_URL = "https://github.com/NVIDIA/TensorRT-LLM/blob/v0.9.0/docs/source/performance.md"
NIM = ("NVIDIA NIM for LLMs benchmarking guide, Performance page (docs.nvidia.com/nim/benchmarking/llm/1.0.0/"
       "performance), Llama-3.3-70b-instruct results, NIM container version 1.8.0, 2 x H100 80G, fp8 TP2")
NIM_URL = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance"

GPT_FAST = ("PyTorch gpt-fast, README.md at commit c9f683e (github.com/pytorch-labs/gpt-fast/blob/"
            "c9f683edd4f89d3e81ed8f52387e866a245e3226/README.md), 'Tensor Parallelism' table; 'Benchmarks run on an "
            "8xA100-80GB, power limited to 330W ... all benchmarks are run at batch size=1 ... a very small prompt "
            "length (just 5 tokens)'; generate.py's 200 new tokens, torch.compile with CUDA graphs")
GPT_FAST_URL = "https://github.com/pytorch-labs/gpt-fast/blob/c9f683edd4f89d3e81ed8f52387e866a245e3226/README.md"
GPT_FAST_MOE = ("PyTorch gpt-fast, mixtral-moe/README.md at commit 48328fb (github.com/pytorch-labs/gpt-fast/blob/"
                "48328fbe8ffc24fd14ddb59c8dfcce3a0291100f/mixtral-moe/README.md), 'Benchmarks' table, "
                "baseline(bfloat16) row; the same 8xA100-80GB at 330 W, batch size 1, a 5-token prompt, 200 new "
                "tokens; each step multiplies only the experts its token is routed to")
GPT_FAST_MOE_URL = ("https://github.com/pytorch-labs/gpt-fast/blob/48328fbe8ffc24fd14ddb59c8dfcce3a0291100f/"
                    "mixtral-moe/README.md")
SOURCES = {TRTLLM_URL: "TensorRT-LLM v0.9.0", NIM_URL: "NIM 1.8.0", GPT_FAST_URL: "gpt-fast",
           GPT_FAST_MOE_URL: "gpt-fast"}

# Llama 2 7B as TensorRT-LLM's benchmark configures it (the same page, "Llama2-7b": 32 layers, 32 heads, hidden
# 4096, intermediate 11008, 32 K/V heads, vocabulary 32000); not a planner shape, so it lives here.
LLAMA2_7B = Shape(32, 4096, 32, ffn=11008, mlp="swiglu", vocab=32000, name="llama2-7b",
                  source="Touvron et al. 2023, Llama 2, and TensorRT-LLM's Llama2-7b benchmark config: 32 layers, "
                         "4096 wide, 32 heads (multi-head attention), SwiGLU MLP 11008, vocabulary 32000")

METRICS = {"output_tokens_per_s_per_gpu": "output tokens/s per GPU", "tpot_s": "s per output token",
           "first_token_s": "s to the first token", "tokens_per_s": "output tokens/s of one request"}


@dataclass(frozen=True)
class ServeRun:
    """One published serving measurement and the setting it was measured in."""

    name: str
    source: str       # the citation: document, table, version
    url: str
    gpu: str          # a name of gpucourse.modeled.gpus
    shape: object     # a name of gpucourse.modeled.shapes.SHAPES, or a Shape
    metric: str       # one of METRICS
    reported: float   # the figure the source prints, in METRICS' unit (seconds, not ms)
    batch: int        # sequences served together: the static batch, or the concurrency
    prompt: int       # input tokens a sequence
    output: int       # output tokens a sequence
    tp: int = 1
    weights: str = "bf16"
    kv: str = "bf16"
    split: str = "heldout"   # "fit": serve_plan's constants may be tuned on it; "heldout": only ever checked
    assumed: str = ""        # what the source leaves out and the row assumes

    @property
    def setting(self) -> str:
        """The setting in words: GPUs, layout, precision, batch and lengths."""
        model = self.name.split(",")[0]
        kv = f", KV cache {self.kv}" if self.kv != self.weights else ", KV cache too"
        lengths = f"{self.prompt} in" if self.metric == "first_token_s" else f"{self.prompt} in / {self.output} out"
        return (f"{model} ({get_shape(self.shape).name}), {self.tp} × {self.gpu.upper()} (tp {self.tp}), "
                f"{self.weights} weights{kv}, batch {self.batch}, {lengths}")


def _trtllm_tput(shape, batch, tp, prompt, output, tokens_s, split) -> ServeRun:
    model = "Llama 2 70B" if shape == "llama2-70b" else "Llama 2 7B"
    return ServeRun(f"{model}, H100 fp8, batch {batch}, {prompt}/{output}",
                    f"{TRTLLM_V09}: 'Peak Throughput', H100 GPUs (FP8): LLaMA {model[-3:].strip()}, batch {batch}, "
                    f"TP {tp}, input {prompt}, output {output}: {tokens_s:,} output tokens/s per GPU",
                    TRTLLM_URL, "h100", shape, "output_tokens_per_s_per_gpu", float(tokens_s), batch, prompt, output,
                    tp, "fp8", "fp8", split)


def _trtllm_ttft(shape, tp, prompt, ms, split) -> ServeRun:
    model = "Llama 2 70B" if shape == "llama2-70b" else "Llama 2 7B"
    return ServeRun(f"{model}, H100 fp8, first token of {prompt}",
                    f"{TRTLLM_V09}: 'Low Latency', H100 GPUs (FP8): LLaMA {model[-3:].strip()}, batch 1, TP {tp}, "
                    f"input {prompt}: first-token latency {ms} ms",
                    TRTLLM_URL, "h100", shape, "first_token_s", ms / 1e3, 1, prompt, 1, tp, "fp8", "fp8", split)


def _nim_itl(prompt, output, ms, split) -> ServeRun:
    return ServeRun(f"Llama 3.3 70B, 2 H100 fp8, concurrency 1, {prompt}/{output}",
                    f"{NIM}, {prompt} input tokens / {output} output tokens, concurrency 1: ITL {ms} ms "
                    "(measured at the client with AIPerf)",
                    NIM_URL, "h100", "llama3-70b", "tpot_s", ms / 1e3, 1, prompt, output, 2, "fp8", "bf16", split,
                    assumed="KV cache in bf16 (the page names fp8 for the model only; at one sequence the cache is "
                            "under 3 % of the bytes a step reads)")


def _gpt_fast(shape, tp, tokens_s, moe=False) -> ServeRun:
    model = {"mixtral-8x7b": "Mixtral 8x7B", "llama2-70b": "Llama 2 70B"}.get(shape, "Llama 2 7B")
    source = GPT_FAST_MOE if moe else GPT_FAST
    return ServeRun(f"{model}, {tp} A100 bf16, batch 1, gpt-fast",
                    f"{source}: {model}, {tp} GPU{'s' * (tp > 1)}: {tokens_s} tokens/s",
                    GPT_FAST_MOE_URL if moe else GPT_FAST_URL, "a100", shape, "tokens_per_s", tokens_s, 1, 5, 200,
                    tp, "bf16", "bf16", "heldout",
                    assumed="the A100's bandwidth at its datasheet figure (the 330 W power limit slows its arithmetic, "
                            "which batch 1 barely uses); 200 new tokens after 5 prompt tokens, timed from the prefill "
                            "to the last token as generate.py does")


RUNS = (
    # TensorRT-LLM v0.9.0, H100 FP8, peak throughput (static batches) ------------------------------------------------
    _trtllm_tput("llama2-70b", 1024, 2, 128, 128, 3214, "fit"),
    _trtllm_tput("llama2-70b", 512, 4, 128, 2048, 2725, "heldout"),
    _trtllm_tput("llama2-70b", 96, 2, 2048, 128, 346, "fit"),
    _trtllm_tput("llama2-70b", 64, 2, 2048, 2048, 1011, "heldout"),
    _trtllm_tput(LLAMA2_7B, 896, 1, 128, 128, 19854, "fit"),
    _trtllm_tput(LLAMA2_7B, 120, 1, 128, 2048, 6944, "heldout"),
    _trtllm_tput(LLAMA2_7B, 84, 1, 2048, 128, 2163, "fit"),
    _trtllm_tput(LLAMA2_7B, 56, 1, 2048, 2048, 2826, "heldout"),
    # TensorRT-LLM v0.9.0, H100 FP8, first-token latency at batch 1 --------------------------------------------------
    _trtllm_ttft(LLAMA2_7B, 1, 128, 6.3, "fit"),
    _trtllm_ttft(LLAMA2_7B, 1, 2048, 30.8, "heldout"),
    _trtllm_ttft("llama2-70b", 4, 128, 19.6, "fit"),
    _trtllm_ttft("llama2-70b", 8, 2048, 85.1, "heldout"),
    # NIM 1.8.0 (TensorRT-LLM inside), time per output token of one request at a time ----------------------------
    _nim_itl(5000, 500, 18.58, "fit"),
    _nim_itl(500, 2000, 18.91, "heldout"),
    # gpt-fast, one request at a time on A100s, tensor parallel: added after STEP_OVERHEAD_S was fitted, to check
    # batch-1 decode (GEMVs, tp scaling, a mixture of experts' routed experts); every row held out ----------------
    _gpt_fast(LLAMA2_7B, 1, 104.9),
    _gpt_fast(LLAMA2_7B, 2, 168.84),
    _gpt_fast(LLAMA2_7B, 4, 254.02),
    _gpt_fast(LLAMA2_7B, 8, 328.43),
    _gpt_fast("llama2-70b", 2, 21.32),
    _gpt_fast("llama2-70b", 4, 38.01),
    _gpt_fast("llama2-70b", 8, 62.50),
    _gpt_fast("mixtral-8x7b", 2, 96.67, moe=True),
    _gpt_fast("mixtral-8x7b", 4, 155.35, moe=True),
    _gpt_fast("mixtral-8x7b", 8, 227.82, moe=True),
)

# Published figures read and left out, with why: each lacks part of the setting the model needs.
EXCLUDED = (
    ("NVIDIA technical blog, 'Achieving Top Inference Performance with the NVIDIA H100 Tensor Core GPU and NVIDIA "
     "TensorRT-LLM' (December 2023): Llama 2 70B on one DGX H100, 2048 in / 128 out, batch 1, 1.7 s a request "
     "(TensorRT-LLM v0.5.0)",
     "the batch-1 run's precision and layout are not stated: with FP8 and tp 8 the model gives 1.18 s, with FP16 "
     "and tp 8 1.60 s, so the row would test a guess"),
    ("TensorRT-LLM's later performance overview (docs/source/performance/perf-overview.md) and MLPerf Inference's "
     "Llama 2 70B results",
     "maximum throughput at a batch or concurrency the benchmark chose and does not print"),
    ("the NIM guide's Llama 3.1 8B and 70B tables", "their GPUs, precision and lengths were not read"),
)


def _mean_context(run: ServeRun) -> float:
    return held(run.prompt, run.output)["read"]


def modeled(run: ServeRun) -> float:
    """The serving model's value of ``run``'s figure, in the row's own unit (see the module docstring)."""
    if run.metric == "first_token_s":
        return prefill(run.shape, run.gpu, run.batch, run.prompt, run.tp, weights=run.weights)["first_token_s"]
    if run.metric == "tpot_s":
        return decode_step(run.shape, run.gpu, run.batch, _mean_context(run), run.tp, weights=run.weights,
                           kv=run.kv)["token_s"]
    if run.metric in ("output_tokens_per_s_per_gpu", "tokens_per_s"):  # a static batch (of one, for gpt-fast)
        tokens_s = serve(run.shape, run.gpu, run.batch, run.prompt, run.output, "static", run.tp,
                         weights=run.weights, kv=run.kv)["tokens_per_s"]
        return tokens_s / run.tp if run.metric == "output_tokens_per_s_per_gpu" else tokens_s
    raise ValueError(f"no metric {run.metric!r}: {', '.join(METRICS)}.")


def compare(runs=RUNS) -> list[dict]:
    """Every row with its modeled value and relative error (modeled − published) / published."""
    rows = []
    for run in runs:
        value = modeled(run)
        rows.append({"name": run.name, "split": run.split, "gpu": run.gpu, "metric": run.metric,
                     "setting": run.setting, "source": run.source, "url": run.url, "reported": run.reported,
                     "modeled": value, "error": (value - run.reported) / run.reported})
    return rows


def errors(rows=None) -> dict:
    """The largest error over all rows, over each set, and the held-out median."""
    rows = compare() if rows is None else rows
    worst = max(rows, key=lambda r: abs(r["error"]))
    split = {s: [abs(r["error"]) for r in rows if r["split"] == s] for s in ("fit", "heldout")}
    return {"max": abs(worst["error"]), "worst": worst["name"], "fit_max": max(split["fit"]),
            "heldout_max": max(split["heldout"]), "heldout_median": statistics.median(split["heldout"]),
            "fit_runs": len(split["fit"]), "heldout_runs": len(split["heldout"])}


def _show(value: float, metric: str) -> str:
    if metric == "output_tokens_per_s_per_gpu":
        return f"{value:,.0f} tokens/s/GPU"
    if metric == "tokens_per_s":
        return f"{value:,.1f} tokens/s"
    return f"{value * 1e3:.1f} ms" + (" a token" if metric == "tpot_s" else " to first token")


def markdown_table(rows=None) -> str:
    """The comparison as docs/modeled-timing.md prints it (a test keeps the two equal)."""
    rows = compare() if rows is None else rows
    lines = ["| published | setting | set | published | modeled | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {SOURCES[r['url']]} | {r['setting']} | {r['split']} | {_show(r['reported'], r['metric'])} | "
                     f"{_show(r['modeled'], r['metric'])} | {r['error']:+.1%} |")
    return "\n".join(lines)
