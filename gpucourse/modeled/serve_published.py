"""Published serving measurements the serving model (:mod:`gpucourse.modeled.serve_plan`) is checked against.

Each :class:`ServeRun` is one number a source printed for Llama-class models, GPT-J and Mixtral 8×7B — the model,
GPUs, tensor-parallel degree, precision of the weights and of the KV cache, batch (or concurrency), prompt and output
lengths — and what it measured. :func:`modeled` turns the same setting into the same figure with
:func:`serve_plan.prefill` and :func:`serve_plan.decode_step`, and a static batch with :func:`serve_plan.serve`, the
function the serving planner sizes and times its batches with:

- ``"output_tokens_per_s_per_gpu"``, a *static* batch (TensorRT-LLM's ``gptSessionBenchmark``): all ``batch``
  prompts are prefilled at once, which makes the first output token; then ``output − 1`` decode steps of the whole
  batch. A decode step's cost grows linearly with its context, so the steps together cost ``output − 1`` steps at
  the mean context, ``prompt + output / 2`` (what each sequence holds on average, :func:`serve_plan.held`). The
  figure is ``batch × output ÷ (prefill + decode) ÷ tp``, as
  TensorRT-LLM defines it (docs/source/blogs/Falcon180B-H200.md: ``out_tps=output_seqlen*batch_size/total_latency/tp``);
- ``"tokens_per_s"``, the same static batch's output tokens per second on all its GPUs together: gpt-fast's one
  request (200 new tokens over the prefill and 199 decode steps, as its generate.py times them) and LMDeploy's
  ``batch`` concurrent requests (its profile_generation.py: every output token over the run's wall time);
- ``"tpot_s"``, the time per output token at the stated concurrency: one decode step of ``batch`` sequences at the
  mean context;
- ``"first_token_s"``: the prefill of ``batch`` prompts.

A measurement whose batch, concurrency, layout or precision is not stated is left out rather than guessed
(:data:`EXCLUDED` says which, and why). Where a source names the weights' precision but not the KV cache's, a row is
kept only if the cache's precision moves its modeled figure by at most :data:`KV_UNSTATED_MOVES` (:func:`kv_moves`),
and ``assumed`` says what was taken. The rows were split into a fitting and a held-out set before fitting, by a rule
that ignores the errors — within each source table the constant was fitted on (TensorRT-LLM v0.9.0's, NIM's), in the
source's order, rows alternate fit, held-out, fit, … — so a constant tuned on the 7 fitting rows is judged on the
others. Every row added since (gpt-fast's bf16, INT8 and INT4 rows on A100s; LMDeploy's FP16 rows on A100s;
TensorRT-LLM's H200 blogs) came after the constant was fitted and is held out; no constant was changed for them.

A row's weights are the format its source ran (:class:`serve_plan.WeightFormat`): gpt-fast's INT8 and INT4 are
:data:`GPT_FAST_FORMATS`, their groups, scales and zero points as its quantize.py stores them, not the model's own
``int8`` and ``int4``. Where the model is far off a held-out row, the setting says why (``docs/modeled-timing.md``,
"Serving"): INT4 and INT8 weight-only kernels at batch 1 read their weights more slowly than a plain streaming kernel
(the model charges nothing for widening them); LMDeploy's first tokens reach its client about one decode step after
the model's prefill ends, and at batch 16 and more in turns; its Llama 2 70B on 4 A100s spends about 5 ms a step more
than the model's and gpt-fast's. A step's growth with its batch is checked against LMDeploy's own time per token
(:data:`LMDEPLOY_STEP_S`). ``tests/test_serve_published.py`` recomputes every row and
keeps the table in ``docs/modeled-timing.md`` equal to :func:`markdown_table`; ``gpucourse bench`` reports the largest
error (``serve_model_vs_published_max_error``), the held-out rows' largest and median errors
(``serve_model_heldout_max_error``, ``serve_model_heldout_median_error``) and the fitting rows' largest
(``serve_model_fit_max_error``).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from .serve_plan import WeightFormat, decode_step, held, prefill, serve
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
            "c9f683edd4f89d3e81ed8f52387e866a245e3226/README.md); 'Benchmarks run on an 8xA100-80GB, power limited to "
            "330W ... all benchmarks are run at batch size=1 ... a very small prompt length (just 5 tokens)'; "
            "generate.py's 200 new tokens, torch.compile with CUDA graphs")
GPT_FAST_URL = "https://github.com/pytorch-labs/gpt-fast/blob/c9f683edd4f89d3e81ed8f52387e866a245e3226/README.md"
GPT_FAST_MOE = ("PyTorch gpt-fast, mixtral-moe/README.md at commit 48328fb (github.com/pytorch-labs/gpt-fast/blob/"
                "48328fbe8ffc24fd14ddb59c8dfcce3a0291100f/mixtral-moe/README.md), 'Benchmarks' table, "
                "baseline(bfloat16) row; the same 8xA100-80GB at 330 W, batch size 1, a 5-token prompt, 200 new "
                "tokens; each step multiplies only the experts its token is routed to")
GPT_FAST_MOE_URL = ("https://github.com/pytorch-labs/gpt-fast/blob/48328fbe8ffc24fd14ddb59c8dfcce3a0291100f/"
                    "mixtral-moe/README.md")
LMDEPLOY = ("InternLM LMDeploy, docs/en/benchmark/a100_fp16.md at commit ebe90bc (github.com/InternLM/lmdeploy/blob/"
            "ebe90bc943eeace841b33fa54fbf1726311b63db/docs/en/benchmark/a100_fp16.md), 'Static Inference Benchmark'; "
            "'tested on (x8) A100-80G CUDA 11.8', 'The tested lmdeploy version is v0.1.0a1' (TurboMind, FP16 weights "
            "and KV cache); its benchmark/profile_generation.py runs `batch` threads, each sending requests of "
            "`prompt_tokens` random token ids and streaming `output_tokens` tokens, and prints all output tokens over "
            "the run's wall time (throughput) and the first token's latency at the client (FTL)")
LMDEPLOY_URL = ("https://github.com/InternLM/lmdeploy/blob/ebe90bc943eeace841b33fa54fbf1726311b63db/docs/en/benchmark/"
                "a100_fp16.md")
# What a decode step costs as its batch grows, as LMDeploy's client saw it: the same table's per-token latency, the
# median ('50%(s)', printed in whole ms), at 128 in / 128 out and batch 1, 16, 32 and 64 (not rows of RUNS: the
# table's rows RUNS takes are its throughput and first tokens).
LMDEPLOY_BATCHES = (1, 16, 32, 64)
LMDEPLOY_STEP_S = {("llama2-7b", 1): (0.010, 0.011, 0.012, 0.014), ("llama2-70b", 4): (0.029, 0.030, 0.032, 0.037)}
H200_LAUNCH = ("NVIDIA TensorRT-LLM, docs/source/blogs/H200launch.md at commit 1555478 (github.com/NVIDIA/TensorRT-LLM/"
               "blob/1555478c1b417a0b34de05209862ea5a2ab9add1/docs/source/blogs/H200launch.md), 'H200 FP8 Max "
               "throughput' table; 'TensorRT-LLM v0.5.0, TensorRT v9.1.0.4 | H200, H100 FP8'; static batches, "
               "'Throughput (out tok/s/GPU)'")
H200_LAUNCH_URL = ("https://github.com/NVIDIA/TensorRT-LLM/blob/1555478c1b417a0b34de05209862ea5a2ab9add1/docs/source/"
                   "blogs/H200launch.md")
H200_FALCON = ("NVIDIA TensorRT-LLM, docs/source/blogs/Falcon180B-H200.md at commit 3c44cb9 (github.com/NVIDIA/"
               "TensorRT-LLM/blob/3c44cb974badec8966108b16054a99c0923e410d/docs/source/blogs/Falcon180B-H200.md), "
               "'Llama-70B on H200 up to 6.7x A100' table; 'TensorRT-LLM v0.7a | Llama2-70B | 1xH200 = TP1 | FP8 | BS: "
               "(in order) 960, 960, 192, 560, 96, 640'; 'out_tps=output_seqlen*batch_size/total_latency/tp'")
H200_FALCON_URL = ("https://github.com/NVIDIA/TensorRT-LLM/blob/3c44cb974badec8966108b16054a99c0923e410d/docs/source/"
                   "blogs/Falcon180B-H200.md")
H100_A100 = ("NVIDIA TensorRT-LLM, docs/source/blogs/H100vsA100.md at commit 15ed780 (github.com/NVIDIA/TensorRT-LLM/"
             "blob/15ed78097ea2c14b3831ca017935a32dec54476e/docs/source/blogs/H100vsA100.md), 'Max Throughput & Min "
             "Latency' table; 'FP8 H100, FP16 A100, SXM 80GB GPUs, TP1, ISL/OSL's provided, TensorRT-LLM v0.5.0., "
             "TensorRT 9.1'; static batches")
H100_A100_URL = ("https://github.com/NVIDIA/TensorRT-LLM/blob/15ed78097ea2c14b3831ca017935a32dec54476e/docs/source/"
                 "blogs/H100vsA100.md")
SOURCES = {TRTLLM_URL: "TensorRT-LLM v0.9.0", NIM_URL: "NIM 1.8.0", GPT_FAST_URL: "gpt-fast",
           GPT_FAST_MOE_URL: "gpt-fast", LMDEPLOY_URL: "LMDeploy v0.1.0a1", H200_LAUNCH_URL: "TensorRT-LLM blogs",
           H200_FALCON_URL: "TensorRT-LLM blogs", H100_A100_URL: "TensorRT-LLM blogs"}

# Llama 2 7B as TensorRT-LLM's benchmark configures it (the same page, "Llama2-7b": 32 layers, 32 heads, hidden
# 4096, intermediate 11008, 32 K/V heads, vocabulary 32000); not a planner shape, so it lives here.
LLAMA2_7B = Shape(32, 4096, 32, ffn=11008, mlp="swiglu", vocab=32000, name="llama2-7b",
                  source="Touvron et al. 2023, Llama 2, and TensorRT-LLM's Llama2-7b benchmark config: 32 layers, "
                         "4096 wide, 32 heads (multi-head attention), SwiGLU MLP 11008, vocabulary 32000")
# GPT-J 6B as TensorRT-LLM's blog benchmarks it: its attention and MLP run side by side from one norm, the same
# matmuls in the same number as a sequential block.
GPTJ_6B = Shape(28, 4096, 16, ffn=16384, mlp="gelu", vocab=50400, name="gpt-j-6b",
                source="Wang and Komatsuzaki 2021, GPT-J-6B, and its released config: 28 layers, 4096 wide, 16 heads "
                       "of 256, GELU MLP 16384, vocabulary 50400, untied head")
# Llama 2 13B, for the H200 blog's rows that the KV-cache rule below leaves out (nothing in RUNS uses it).
LLAMA2_13B = Shape(40, 5120, 40, ffn=13824, mlp="swiglu", vocab=32000, name="llama2-13b",
                   source="Touvron et al. 2023, Llama 2, and its released config: 40 layers, 5120 wide, 40 heads "
                          "(multi-head attention), SwiGLU MLP 13824, vocabulary 32000")

METRICS = {"output_tokens_per_s_per_gpu": "output tokens/s per GPU", "tpot_s": "s per output token",
           "first_token_s": "s to the first token", "tokens_per_s": "output tokens/s of the whole batch"}
KV_UNSTATED_MOVES = 0.05  # the most a row's figure may move with a KV-cache precision its source leaves unstated


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
    weights: object = "bf16"  # a name of serve_plan.WEIGHTS, or the WeightFormat the source states
    kv: str = "bf16"
    split: str = "heldout"   # "fit": serve_plan's constants may be tuned on it; "heldout": only ever checked
    assumed: str = ""        # what the source leaves out and the row assumes

    @property
    def setting(self) -> str:
        """The setting in words: GPUs, layout, precision, batch and lengths."""
        model = self.name.split(",")[0]
        kv = f", KV cache {self.kv}" if self.kv != self.weights else ", KV cache too"
        stated = f" ({self.weights.described})" if isinstance(self.weights, WeightFormat) else ""
        lengths = f"{self.prompt} in" if self.metric == "first_token_s" else f"{self.prompt} in / {self.output} out"
        return (f"{model} ({get_shape(self.shape).name}), {self.tp} × {self.gpu.upper()} (tp {self.tp}), "
                f"{self.weights} weights{stated}{kv}, batch {self.batch}, {lengths}")


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


# gpt-fast's quantize.py: "8-bit" is int8 weight-only with one bf16 scale an output channel, "4-bit (G=32)" int4 with
# a bf16 scale and a bf16 zero point every 32 weights along k, run by tinygemm's _weight_int4pack_mm; both replace
# every nn.Linear, the output head included (mixtral-moe/quantize.py leaves the router, "gate", in bf16); the
# embedding and the norms are no nn.Linear and stay bf16.
GPT_FAST_FORMATS = {
    "int8": WeightFormat("gpt-fast int8", "W8A16", 8, "bf16", group=0, others="bf16", scale="bf16", head=True),
    "int4": WeightFormat("gpt-fast int4", "W4A16", 4, "bf16", group=32, others="bf16", scale="bf16", zero=True,
                         head=True)}
GPT_FAST_QUANT = {"int8": "int8 weight-only, one bf16 scale an output channel (quantize.py --mode int8)",
                  "int4": "int4 weight-only, a bf16 scale and zero point every 32 weights (quantize.py --mode int4 "
                          "--groupsize 32)"}
GPT_FAST_ASSUMED = ("the A100's bandwidth at its datasheet figure (the 330 W power limit slows its arithmetic, which "
                    "batch 1 barely uses); 200 new tokens after 5 prompt tokens, timed from the prefill to the last "
                    "token as generate.py does")


def _gpt_fast(shape, tp, tokens_s, moe=False, weights="bf16", table="Tensor Parallelism") -> ServeRun:
    model = {"mixtral-8x7b": "Mixtral 8x7B", "llama2-70b": "Llama 2 70B"}.get(shape, "Llama 2 7B")
    source = GPT_FAST_MOE if moe else GPT_FAST
    how = f", {GPT_FAST_QUANT[weights]}" if weights in GPT_FAST_QUANT else ""
    return ServeRun(f"{model}, {tp} A100 {weights}, batch 1, gpt-fast",
                    f"{source}, '{table}' table: {model}, {tp} GPU{'s' * (tp > 1)}{how}: {tokens_s} tokens/s",
                    GPT_FAST_MOE_URL if moe else GPT_FAST_URL, "a100", shape, "tokens_per_s", tokens_s, 1, 5, 200,
                    tp, GPT_FAST_FORMATS.get(weights, weights), "bf16", "heldout", assumed=GPT_FAST_ASSUMED)


def _lmdeploy(shape, tp, batch, prompt, output, figure, metric="tokens_per_s") -> ServeRun:
    model = "Llama 2 70B" if shape == "llama2-70b" else "Llama 2 7B"
    what = (f"batch {batch}, {prompt}/{output}" if metric == "tokens_per_s" else f"first token of {prompt}")
    printed = (f"throughput {figure} out tok/s" if metric == "tokens_per_s" else
               f"FTL(ave) {figure} s (the row of {prompt} prompt tokens and {output} output tokens)")
    return ServeRun(f"{model}, {tp} A100 fp16, {what}, LMDeploy",
                    f"{LMDEPLOY}: {model.lower().replace(' ', '')}, batch {batch}, tp {tp}, prompt_tokens {prompt}, "
                    f"output_tokens {output}: {printed}",
                    LMDEPLOY_URL, "a100", shape, metric, figure, batch, prompt, output, tp, "bf16", "bf16", "heldout",
                    assumed="FP16 timed as bf16 (the same bytes, the same A100 tensor-core peak); the batch served "
                            "as a static one, its prompts prefilled in one step and then decoded together (the "
                            "threads start at once; TurboMind admits their prompts as they come, so a batch of 16 or "
                            "more reaches its first tokens in turns: FTL(ave) 0.13 to 1.29 s in the same rows)")


def _h200(source, url, shape, batch, tp, prompt, output, tokens_s) -> ServeRun:
    model = "Llama 2 70B" if shape == "llama2-70b" else "Llama 2 13B"
    version = "v0.5.0" if url == H200_LAUNCH_URL else "v0.7a"
    return ServeRun(f"{model}, H200 fp8, batch {batch}, {prompt}/{output}, TensorRT-LLM {version}",
                    f"{source}: {model}, batch {batch}, TP {tp}, input {prompt}, output {output}: {tokens_s:,} output "
                    f"tokens/s per GPU", url, "h200", shape, "output_tokens_per_s_per_gpu", float(tokens_s), batch,
                    prompt, output, tp, "fp8", "fp8", "heldout",
                    assumed=KV_FP8 + ("; 'llama_70b' read as Llama 2 70B (v0.5.0, November 2023)"
                                      if version == "v0.5.0" else ""))


def _gptj(gpu, metric, batch, figure) -> ServeRun:
    weights = "fp8" if gpu == "h100" else "bf16"
    what = f"batch {batch}, 128/128" if metric == "output_tokens_per_s_per_gpu" else \
        f"first token of 128 at batch {batch}"
    printed = f"{figure:,} out tok/s" if metric == "output_tokens_per_s_per_gpu" else \
        f"1st token latency {figure * 1e3:g} ms"
    assumed = (KV_FP8 if metric == "output_tokens_per_s_per_gpu" else
               "the KV cache's precision is not stated; a first token does not read a cache") if gpu == "h100" else \
        "FP16 timed as bf16 (the same bytes, the same A100 tensor-core peak), the KV cache too, the engine's precision"
    return ServeRun(f"GPT-J 6B, {gpu.upper()} {'fp8' if gpu == 'h100' else 'fp16'}, {what}, TensorRT-LLM v0.5.0",
                    f"{H100_A100}: {gpu.upper()}, GPT-J 6B, batch size {batch}, input length 128"
                    + (", output length 128" if metric == "output_tokens_per_s_per_gpu" else "") + f": {printed}",
                    H100_A100_URL, gpu, GPTJ_6B, metric, float(figure), batch, 128, 128, 1, weights, weights,
                    "heldout", assumed=assumed)


KV_FP8 = ("the KV cache in FP8, as TensorRT-LLM's FP8 benchmarks built it (v0.9.0's page: kv_cache_quant_algo FP8); "
          "the blog names FP8 without saying whether the cache is, so only rows whose modeled figure a bf16 cache "
          f"moves by at most {KV_UNSTATED_MOVES:.0%} are kept (KV_UNSTATED)")
# Every row of TensorRT-LLM's blog tables whose setting is stated but for the KV cache's precision (the v0.7a table's
# 8-GPU rows are not: 'max TP/PP/DP config'). A bf16 cache moves a long or wide batch's figure by up to 41 %; RUNS
# takes the rows that it moves by at most KV_UNSTATED_MOVES (kv_moves), a rule on the setting, not on the error.
KV_UNSTATED = (
    _h200(H200_LAUNCH, H200_LAUNCH_URL, LLAMA2_13B, 1024, 1, 128, 128, 11819),
    _h200(H200_LAUNCH, H200_LAUNCH_URL, LLAMA2_13B, 128, 1, 128, 2048, 4750),
    _h200(H200_LAUNCH, H200_LAUNCH_URL, LLAMA2_13B, 64, 1, 2048, 128, 1349),
    _h200(H200_LAUNCH, H200_LAUNCH_URL, "llama2-70b", 512, 1, 128, 128, 3014),
    _h200(H200_LAUNCH, H200_LAUNCH_URL, "llama2-70b", 512, 2, 128, 2048, 1654),
    _h200(H200_LAUNCH, H200_LAUNCH_URL, "llama2-70b", 64, 1, 2048, 128, 341),
    _h200(H200_LAUNCH, H200_LAUNCH_URL, "llama2-70b", 32, 1, 2048, 128, 303),
    _h200(H200_FALCON, H200_FALCON_URL, "llama2-70b", 960, 1, 128, 128, 3803),
    _h200(H200_FALCON, H200_FALCON_URL, "llama2-70b", 192, 1, 128, 2048, 2941),
    _h200(H200_FALCON, H200_FALCON_URL, "llama2-70b", 96, 1, 128, 4096, 1946),
    _gptj("h100", "output_tokens_per_s_per_gpu", 64, 10907),
)
KV_KEPT = ("Llama 2 70B, H200 fp8, batch 512, 128/128, TensorRT-LLM v0.5.0",
           "Llama 2 70B, H200 fp8, batch 64, 2048/128, TensorRT-LLM v0.5.0",
           "Llama 2 70B, H200 fp8, batch 32, 2048/128, TensorRT-LLM v0.5.0",
           "Llama 2 70B, H200 fp8, batch 960, 128/128, TensorRT-LLM v0.7a")


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
    # Added after the fit, every row held out: gpt-fast's INT8 and INT4 weight-only rows (its 'Benchmarks' table on
    # one A100, 'Tensor Parallelism + Quantization' on eight, and the Mixtral table) ------------------------------
    _gpt_fast(LLAMA2_7B, 1, 155.58, weights="int8", table="Benchmarks"),
    _gpt_fast(LLAMA2_7B, 1, 196.80, weights="int4", table="Benchmarks"),
    _gpt_fast("llama2-70b", 1, 19.13, weights="int8", table="Benchmarks"),
    _gpt_fast("llama2-70b", 1, 25.25, weights="int4", table="Benchmarks"),
    _gpt_fast("llama2-70b", 8, 80.44, weights="int8", table="Tensor Parallelism + Quantization"),
    _gpt_fast("llama2-70b", 8, 90.77, weights="int4", table="Tensor Parallelism + Quantization"),
    _gpt_fast("mixtral-8x7b", 1, 97.92, weights="int8", table="Mixtral 8x7B"),
    _gpt_fast("mixtral-8x7b", 2, 155.03, weights="int8", table="Mixtral 8x7B"),
    _gpt_fast("mixtral-8x7b", 4, 216.87, weights="int8", table="Mixtral 8x7B"),
    _gpt_fast("mixtral-8x7b", 8, 279.35, weights="int8", table="Mixtral 8x7B"),
    # LMDeploy v0.1.0a1 on A100s in FP16, Llama 2 7B (tp 1) and 70B (tp 4), by one rule: 128 in / 128 out at every
    # batch the table prints, one request of 2048 in / 2048 out, and one request's first token at 128 and 2048 ----
    *(_lmdeploy(shape, tp, batch, 128, 128, figure)
      for shape, tp, figures in ((LLAMA2_7B, 1, (102.21, 1272.47, 2125.47, 3024.07)),
                                 ("llama2-70b", 4, (33.63, 439.77, 746.36, 1159.84)))
      for batch, figure in zip((1, 16, 32, 64), figures)),
    _lmdeploy(LLAMA2_7B, 1, 1, 2048, 2048, 93.78),
    _lmdeploy("llama2-70b", 4, 1, 2048, 2048, 31.9),
    _lmdeploy(LLAMA2_7B, 1, 1, 128, 128, 0.022, "first_token_s"),
    _lmdeploy(LLAMA2_7B, 1, 1, 2048, 128, 0.139, "first_token_s"),
    _lmdeploy("llama2-70b", 4, 1, 128, 128, 0.074, "first_token_s"),
    _lmdeploy("llama2-70b", 4, 1, 2048, 128, 0.402, "first_token_s"),
    # TensorRT-LLM's blogs: H200 static batches in FP8 (v0.5.0 and v0.7a), the rows the KV-cache rule keeps; GPT-J
    # on one H100 in FP8 and one A100 in FP16 (v0.5.0), each row of its table whose setting is printed ----------
    *(r for r in KV_UNSTATED if r.name in KV_KEPT),
    _gptj("h100", "first_token_s", 64, 0.102),
    _gptj("h100", "first_token_s", 1, 0.0071),
    _gptj("a100", "output_tokens_per_s_per_gpu", 64, 3679),
    _gptj("a100", "first_token_s", 64, 0.481),
    _gptj("a100", "first_token_s", 1, 0.0125),
)

# Published figures read and left out, with why: each lacks part of the setting the model needs.
EXCLUDED = (
    ("NVIDIA technical blog, 'Achieving Top Inference Performance with the NVIDIA H100 Tensor Core GPU and NVIDIA "
     "TensorRT-LLM' (December 2023): Llama 2 70B on one DGX H100, 2048 in / 128 out, batch 1, 1.7 s a request "
     "(TensorRT-LLM v0.5.0)",
     "the batch-1 run's precision and layout are not stated: with FP8 and tp 8 the model gives 1.18 s, with FP16 "
     "and tp 8 1.60 s, so the row would test a guess"),
    ("TensorRT-LLM's later performance overview (docs/source/performance/perf-overview.md)",
     "maximum throughput at a batch or concurrency the benchmark chose and does not print"),
    ("MLPerf Inference v4.0's Llama 2 70B Offline results (NVIDIA's closed submission, H100 and H200)",
     "the submission's configs print the engine's batch (configs/llama2-70b/Offline: gpu_batch_size 896 on 2 H100s "
     "at tp 2, 806 on one H200) and the FP8 weights, but the KV cache's precision is not in them and the OpenOrca "
     "set's mean prompt length was not found printed anywhere citable: the row would rest on two guesses"),
    ("the NIM guide's Llama 3.1 8B and 70B tables", "their GPUs, precision and lengths were not read"),
    ("TensorRT-LLM's blogs: on H200s, Llama 2 13B's three rows (batch 1024, 128/128; 128, 128/2048; 64, 2048/128), "
     "Llama 2 70B at batch 512 and tp 2, 128/2048 (v0.5.0), and at batch 192, 128/2048 and 96, 128/4096 (v0.7a); on "
     "an H100, GPT-J 6B at batch 64, 128/128 (v0.5.0)",
     "no blog says whether the KV cache is FP8, and a bf16 cache moves these rows' modeled figures by 14 to 41 % "
     "(KV_UNSTATED, kv_moves): each would test a guess"),
    ("TensorRT-LLM's H100vsA100 blog: GPT-J 6B at batch 1 (185 and 111 tokens/s)",
     "its output length is printed as '-': not stated"),
    ("TensorRT-LLM's v0.7a H200 blog: Llama 2 70B on 8 H200s (3,803, 3,163 and 2,263 tokens/s per GPU)",
     "'max TP/PP/DP config': the layout is not stated"),
    ("TensorRT-LLM's v0.7a H200 blog: Falcon-180B on one H200 in INT4 AWQ",
     "its figures are in a chart, not printed; and its AWQ multiplies in FP8, a format the model has not"),
    ("LMDeploy's A100 tables: Llama 2 13B, InternLM-20B, and the Llama 2 7B and 70B rows the rule above does not take",
     "not taken, so that one table does not outweigh the other sources (the rule took 14 of its 40 rows of those two "
     "models); at 2048-token prompts and batches of 32 or more its requests waited for cache (FTL(max) up to 116 s), "
     "so the batch was not all served at once"),
    ("LMDeploy's W4A16 guide (docs/en/w4a16.md): Llama 2 7B and 13B in 4 bits", "measured on an RTX 4090, a GPU "
     "the course's table has not"),
)


def kv_moves(run: ServeRun) -> float:
    """How far ``run``'s modeled figure moves when its KV cache is bf16 instead of FP8: the share of the figure a
    source that does not say which it used leaves to a guess."""
    return abs(modeled(dataclasses.replace(run, kv="bf16")) / modeled(dataclasses.replace(run, kv="fp8")) - 1)


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
    """The comparison as docs/modeled-timing.md prints it, then what each row assumes where its source is silent (a
    test keeps the two equal)."""
    rows = compare() if rows is None else rows
    lines = ["| published | setting | set | published | modeled | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {SOURCES[r['url']]} | {r['setting']} | {r['split']} | {_show(r['reported'], r['metric'])} | "
                     f"{_show(r['modeled'], r['metric'])} | {r['error']:+.1%} |")
    assumed = {}
    for run in (run for run in RUNS if run.name in {r["name"] for r in rows} and run.assumed):
        assumed.setdefault(run.assumed, []).append(run.name)
    if assumed:
        lines += ["", "Assumed where the source is silent:", ""]
        lines += [f"- {'; '.join(names)}: {text}." for text, names in assumed.items()]
    return "\n".join(lines)
