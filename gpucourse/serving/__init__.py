"""Serving: generating tokens for many requests at once, with the training model unchanged.

Short lessons, each a file to read top to bottom:

- ``kv_cache``: prefill and decode with a cache of keys and values, equal to recomputing the prefix;
- ``paged``: the cache as blocks found through a block table, allocated as sequences grow;
- ``prefix_cache``: full blocks named by their tokens and all before them, kept after a request and shared by the
  next ones that start alike (a system prompt), with reference counts and least-recently-used eviction;
- ``trace``: a seeded synthetic workload (Poisson arrivals, prompt and answer lengths);
- ``scheduler``: continuous batching against static batching, on a measured or a modeled clock (the modeled one,
  with ``simulate``, is ``gpucourse.modeled.serve_clock``),
  read through ``metrics`` (time to first token, time per output token, throughput, goodput);
- ``parallel_decode``: tensor-, pipeline-, data- and expert-parallel decode with the training strategies,
  each making the single-device tokens and sending the bytes per token its formula says;
- ``quantize``: weight-only INT8 and INT4 (group-wise) and FP8 weights, an FP8 KV cache, their bytes and errors;
- ``speculative``: a draft (a smaller GPT, or prompt lookup) proposes tokens, the model verifies them in one forward:
  greedy tokens equal to plain decoding, sampled tokens distributed as the model's;
- ``split_kv``: a decode step's attention with the cache cut into chunks combined by their log-sum-exp
  (Flash-Decoding), equal to plain attention.
"""

from .kv_cache import Cache, KVCache, check_fits, generate, next_token
from .metrics import Iteration, Report
from .paged import BlockAllocator, OutOfBlocks, PagedKVCache
from .scheduler import ModelRunner, Scheduler, Sequence, Simulated, serve, wall_clock
from .trace import Request, load_trace, poisson_trace, save_trace
from .quantize import (FP8KVCache, QuantizedLinear, dequantize_weight, quantization_effect, quantize_model,
                       quantize_weight, stored_bytes, weight_bytes)
from .speculative import ModelDraft, PromptLookupDraft, speculative_generate, truncated

__all__ = ["BlockAllocator", "Cache", "Iteration", "KVCache", "ModelRunner", "OutOfBlocks",
           "PagedKVCache", "Report", "Request", "Scheduler", "Sequence", "Simulated", "check_fits", "generate",
           "load_trace", "next_token", "poisson_trace", "save_trace", "serve", "wall_clock",
           "FP8KVCache", "QuantizedLinear", "dequantize_weight", "quantization_effect", "quantize_model",
           "quantize_weight", "stored_bytes", "weight_bytes",
           "ModelDraft", "PromptLookupDraft", "speculative_generate", "truncated"]
