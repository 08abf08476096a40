"""One serving layout in the names the production servers use: vLLM's engine arguments and TensorRT-LLM's LLM API.

:func:`render` turns a serving layout — tp × pp GPUs a replica, replicas, the longest sequence, how many sequences
decode together, the chunked-prefill token budget, the number formats and the KV block size — into a ``vllm serve``
command or a TensorRT-LLM ``LLM(...)`` call a learner can paste, and says in one sentence each what the tool cannot
express or does differently (a *note*), never dropping a setting silently::

    from gpucourse.interop.serve_config import render
    text, notes = render("vllm", {"model": "meta-llama/Llama-3.1-70B-Instruct", "tp": 4, "replicas": 2,
                                  "context": 8192, "batch": 64, "token_budget": 2048, "kv": "fp8"})

The same settings under the two tools' names (layout key: vLLM's ``EngineArgs`` field, TensorRT-LLM's field):

=========================  ==========================  ===============================================
``tp``                     ``tensor_parallel_size``    ``tensor_parallel_size``
``pp``                     ``pipeline_parallel_size``  ``pipeline_parallel_size``
``replicas``               ``data_parallel_size``      none: one ``LLM`` per replica
``context``                ``max_model_len``           ``max_seq_len`` (and ``max_input_len``)
``batch``                  ``max_num_seqs``            ``max_batch_size``
``token_budget``           ``max_num_batched_tokens``  ``max_num_tokens``
(chunked prefill)          ``enable_chunked_prefill``  ``enable_chunked_prefill``
``kv``                     ``kv_cache_dtype``          ``kv_cache_config.dtype``
``block_size``             ``block_size``              ``kv_cache_config.tokens_per_block``
``weights``                ``quantization``            none: an fp8 checkpoint
``gpu_memory_fraction``    ``gpu_memory_utilization``  ``kv_cache_config.free_gpu_memory_fraction``
=========================  ==========================  ===============================================

Every name was read in the tool's own source:

- **vLLM 0.33.0** (the wheel on PyPI): ``vllm/engine/arg_utils.py`` (the ``EngineArgs`` fields and the
  ``add_argument`` calls that make each a ``--flag``; a bool field gets ``--name`` / ``--no-name``),
  ``vllm/config/cache.py`` (``CacheDType``, ``block_size``, ``gpu_memory_utilization``: a share of the whole GPU
  for weights, activations and cache), ``vllm/config/scheduler.py`` (``max_num_batched_tokens`` must be at least
  ``max_num_seqs``), ``vllm/model_executor/layers/quantization/__init__.py`` and ``fp8.py`` (``fp8`` reads an fp8
  checkpoint; ``fp8_per_tensor`` quantizes a bf16 one as it loads), ``vllm/v1/attention/backends/flash_attn.py``
  (blocks of a multiple of 16 tokens), ``vllm/entrypoints/llm.py`` (``LLM(data_parallel_size>1)`` refused in one
  process), ``vllm/entrypoints/common/cli_args.py`` (``vllm serve`` takes the model as its first word).
- **TensorRT-LLM**, ``tensorrt_llm/llmapi/llm_args.py`` at main commit 0004396 (2026; its ``KvCacheConfig`` lies
  between the 1.3.0rc27 and 1.4.0rc4 API references; the PyPI package is a stub that installs from NVIDIA's own
  index, so the source was read from the repository): ``BaseLlmArgs`` (``model``, ``tensor_parallel_size``,
  ``pipeline_parallel_size``, ``dtype``, ``max_batch_size``, ``max_input_len``, ``max_seq_len``,
  ``max_num_tokens``, ``enable_chunked_prefill``, ``kv_cache_config``; no data-parallel replicas:
  ``enable_attention_dp`` splits attention inside the tp group), ``KvCacheConfig`` (``dtype``, ``tokens_per_block``,
  ``free_gpu_memory_fraction``: a share of the memory still free once the model is loaded, as the documentation's
  "How to Change KV Cache Behavior" puts it), ``TorchLlmArgs`` (its
  ``quant_config`` is private: the PyTorch backend takes quantized weights from the checkpoint);
  ``docs/source/features/kvcache.md`` (a block holds a power of two tokens, more than one);
  ``tensorrt_llm/llmapi/__init__.py`` (``LLM`` and ``KvCacheConfig`` are exported there).
"""

from __future__ import annotations

import re

from ..readable import ConfigError

TOOLS = ("vllm", "trtllm")
VLLM_RELEASE = "vLLM 0.33.0"
TRTLLM_RELEASE = "TensorRT-LLM main at 0004396"

FORMATS = ("bf16", "fp8")
DEFAULTS = {"model": "your-org/your-model", "tp": 1, "pp": 1, "replicas": 1, "token_budget": None,
            "weights": "bf16", "kv": "bf16", "block_size": 16, "gpu_memory_fraction": None, "shape": None,
            "gpu": None}
KEYS = ("context", "batch", *DEFAULTS)

VLLM_BLOCK_MULTIPLE = 16  # FlashAttention's kernel block: vllm/v1/attention/backends/flash_attn.py


def render(tool: str, layout: dict) -> tuple[str, list[str]]:
    """``layout`` as ``tool``'s configuration: (the text to paste, what the tool cannot express, one sentence each).

    ``layout`` keys: ``context`` (most tokens a sequence holds, prompt and answer) and ``batch`` (sequences one
    replica holds at once) are required; ``model`` (name or path), ``tp``, ``pp``, ``replicas``, ``token_budget``
    (tokens an iteration feeds: chunked prefill; None feeds whole prompts), ``weights`` and ``kv`` ("bf16" or
    "fp8"), ``block_size`` (tokens a KV block holds), ``gpu_memory_fraction`` (share of each GPU the server may
    fill: weights, activations and cache) are optional; ``shape`` (a :mod:`gpucourse.modeled.shapes` name or dict) checks
    tp and pp against the model, and with ``gpu`` (a :mod:`gpucourse.modeled.gpus` name) sizes TensorRT-LLM's cache
    fraction. A bad tool or layout raises :class:`~gpucourse.readable.ConfigError` (one sentence)."""
    if tool not in TOOLS:
        raise ConfigError(f"tool {tool!r} is not one of {', '.join(TOOLS)}.")
    lay = _checked(layout)
    return _vllm(lay) if tool == "vllm" else _trtllm(lay)


def layout_from_plan(result: dict, row: dict, model: str = DEFAULTS["model"]) -> dict:
    """The layout of one row of :func:`gpucourse.modeled.serve_plan.plan`'s ``result["layouts"]``. The plan's batch is one
    pipeline microbatch, and pp of them are in flight, so a replica holds pp × batch sequences."""
    return {"model": model, "tp": row["tp"], "pp": row["pp"], "replicas": row["replicas"],
            "context": result["context"], "batch": row["pp"] * row["batch"], "weights": result["weights"],
            "kv": result["kv"], "shape": result["shape"], "gpu": result["gpu"],
            "token_budget": result.get("token_budget")}


# --- the layout ------------------------------------------------------------------------------------------------

def _checked(layout: dict) -> dict:
    unknown = sorted(set(layout) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown layout key{'s' * (len(unknown) > 1)} {', '.join(unknown)}; the keys are "
                          f"{', '.join(KEYS)}.")
    missing = [k for k in ("context", "batch") if k not in layout]
    if missing:
        raise ConfigError(f"a serving layout needs {' and '.join(missing)} (tokens a sequence holds, sequences a "
                          f"replica holds at once).")
    lay = {**DEFAULTS, **layout}
    for key in ("tp", "pp", "replicas", "context", "batch", "block_size", "token_budget"):
        value = lay[key]
        if key == "token_budget" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} must be a whole number of at least 1.")
    for key in ("weights", "kv"):
        if lay[key] not in FORMATS:
            raise ConfigError(f"{key}={lay[key]!r} is not one of {', '.join(FORMATS)}.")
    fraction = lay["gpu_memory_fraction"]
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"gpu_memory_fraction={fraction} must lie in (0, 1].")
    if lay["gpu"] is not None and lay["shape"] is None:
        raise ConfigError("gpu is only read with shape: the weights a GPU holds depend on the model.")
    if lay["shape"] is not None:
        _check_shape(lay)
    return lay


def _check_shape(lay: dict) -> None:
    from ..modeled.shapes import ShapeError, get_shape

    try:
        shape = get_shape(lay["shape"])
        shape.check_tp(lay["tp"])
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    if lay["pp"] > shape.layers:
        raise ConfigError(f"pp={lay['pp']} stages cannot each hold a block of a model of {shape.layers} blocks.")
    if lay["gpu"] is not None and lay["gpu_memory_fraction"] is not None:
        _, _, free = _memory(lay)
        if free <= 0:
            raise ConfigError(f"gpu_memory_fraction={lay['gpu_memory_fraction']} of a {lay['gpu']} leaves no room "
                              f"for a KV cache beside the weights each GPU holds.")


def _memory(lay: dict) -> tuple[float, float, float]:
    """(a GPU's memory, the weights it holds, the bytes ``gpu_memory_fraction`` leaves for the cache)."""
    from ..modeled.gpus import get_gpu
    from ..modeled.serve_plan import weight_bytes
    from ..modeled.shapes import get_shape

    total = get_gpu(lay["gpu"]).memory_gb * 2**30
    weights = weight_bytes(get_shape(lay["shape"]), lay["tp"], lay["pp"], lay["weights"])
    return total, weights, lay["gpu_memory_fraction"] * total - weights


def _gpus(lay: dict) -> str:
    per = lay["tp"] * lay["pp"]
    many = f", {lay['replicas']} replicas: {per * lay['replicas']} GPUs" if lay["replicas"] > 1 else ""
    return f"tp={lay['tp']} × pp={lay['pp']} ({per} GPU{'s' * (per > 1)} a replica{many})"


def _iteration_tokens(tool: str, names: tuple[str, str], lay: dict, refuses: bool) -> tuple[int, list[str]]:
    """The tokens one iteration may feed under ``tool``'s (token cap, batch cap) ``names``, and what to say."""
    budget, batch = lay["token_budget"], lay["batch"]
    if budget is None:
        cap = max(lay["context"], batch)
        return cap, [f"{tool} caps the tokens one iteration feeds even without chunked prefill ({names[0]}={cap}, so "
                     f"the longest prompt fits whole), where this scheduler feeds every waiting prompt whole."]
    if budget >= batch:
        return budget, []
    if refuses:
        return batch, [f"{tool} refuses {names[0]} below {names[1]} (every running sequence must be able to decode "
                       f"in one iteration): {batch} above, not the token budget {budget}."]
    return budget, [f"{tool} warns when {names[0]} ({budget}) is below {names[1]} ({batch}): an iteration feeds at "
                    f"most {budget} tokens, so not every sequence decodes in each one."]


# --- vLLM ------------------------------------------------------------------------------------------------------

def _vllm(lay: dict) -> tuple[str, list[str]]:
    notes = []
    args = {"tensor_parallel_size": lay["tp"], "pipeline_parallel_size": lay["pp"]}
    if lay["replicas"] > 1:
        args["data_parallel_size"] = lay["replicas"]
        notes.append(f"vLLM runs data-parallel replicas under vllm serve, which spreads requests over them; its "
                     f"offline LLM(...) refuses data_parallel_size={lay['replicas']} in one process.")
    args.update(max_model_len=lay["context"], max_num_seqs=lay["batch"])
    tokens, said = _iteration_tokens("vLLM", ("max_num_batched_tokens", "max_num_seqs"), lay, refuses=True)
    args.update(enable_chunked_prefill=lay["token_budget"] is not None, max_num_batched_tokens=tokens)
    notes += said
    args.update(dtype="bfloat16", kv_cache_dtype="fp8" if lay["kv"] == "fp8" else "bfloat16")
    block = -(-lay["block_size"] // VLLM_BLOCK_MULTIPLE) * VLLM_BLOCK_MULTIPLE
    if block != lay["block_size"]:
        notes.append(f"vLLM's FlashAttention backend takes KV blocks of a multiple of {VLLM_BLOCK_MULTIPLE} tokens: "
                     f"--block-size {block} above, not {lay['block_size']}.")
    args["block_size"] = block
    if lay["weights"] == "fp8":
        args["quantization"] = "fp8_per_tensor"
    if lay["gpu_memory_fraction"] is not None:
        args["gpu_memory_utilization"] = lay["gpu_memory_fraction"]
    head = [f"# {VLLM_RELEASE} engine arguments for {_gpus(lay)}",
            "# each --flag is the EngineArgs field of the same name (dashes for underscores), as LLM(...) takes it"]
    if lay["weights"] == "fp8":
        head.append("# --quantization fp8_per_tensor quantizes bf16 weights as they load; an fp8 checkpoint needs none")
    words = [f"vllm serve {_shell_word(lay['model'])}"]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words.append(f"{flag} {_shell_word(value)}")
    return "\n".join(head) + "\n" + " \\\n    ".join(words) + "\n", notes


def _shell_word(value) -> str:
    text = str(value)
    return text if re.fullmatch(r"[\w./:+-]+", text) else "'" + text.replace("'", "'\\''") + "'"


# --- TensorRT-LLM ---------------------------------------------------------------------------------------------

def _trtllm(lay: dict) -> tuple[str, list[str]]:
    notes = []
    if lay["replicas"] > 1:
        notes.append(f"TensorRT-LLM's LLM API has no data-parallel replicas (enable_attention_dp splits attention "
                     f"inside the tp group, not whole copies of the model): start {lay['replicas']} LLMs, each on "
                     f"its own {lay['tp'] * lay['pp']} GPUs, and spread requests over them.")
    args = {"model": lay["model"], "tensor_parallel_size": lay["tp"], "pipeline_parallel_size": lay["pp"],
            "dtype": "bfloat16", "max_seq_len": lay["context"], "max_input_len": lay["context"],
            "max_batch_size": lay["batch"]}
    tokens, said = _iteration_tokens("TensorRT-LLM", ("max_num_tokens", "max_batch_size"), lay, refuses=False)
    args.update(max_num_tokens=tokens, enable_chunked_prefill=lay["token_budget"] is not None)
    notes += said
    cache = {"dtype": "fp8" if lay["kv"] == "fp8" else "auto"}  # auto: the model's bfloat16
    block = 1 << max(1, (lay["block_size"] - 1).bit_length())
    if block != lay["block_size"]:
        notes.append(f"TensorRT-LLM's KV blocks hold a power of two tokens, more than one: tokens_per_block={block} "
                     f"above, not {lay['block_size']}.")
    cache["tokens_per_block"] = block
    if lay["weights"] == "fp8":
        notes.append("TensorRT-LLM's LLM API (PyTorch backend) takes fp8 weights from a checkpoint quantized ahead "
                     "of time, which carries its own quantization config; no argument quantizes bf16 weights as "
                     "they load, so point model at an fp8 checkpoint.")
    fraction = lay["gpu_memory_fraction"]
    if fraction is not None and lay["gpu"] is not None:
        total, weights, free = _memory(lay)
        cache["free_gpu_memory_fraction"] = int(100 * free / (total - weights)) / 100
        notes.append(f"TensorRT-LLM's free_gpu_memory_fraction is a share of the memory left after the weights, not "
                     f"of the whole GPU: {fraction} of each {lay['gpu']}, less the weights it holds, is "
                     f"{cache['free_gpu_memory_fraction']} of what the weights leave (modeled; activations left out).")
    elif fraction is not None:
        notes.append(f"TensorRT-LLM sizes the KV cache as a share of the memory left after the weights "
                     f"(free_gpu_memory_fraction), not of the whole GPU; without the model's shape and GPU the "
                     f"weights are unknown, so {fraction} is not translated and the default stands.")
    head = [f"# {TRTLLM_RELEASE}: the LLM API (PyTorch backend) for {_gpus(lay)}",
            "from tensorrt_llm.llmapi import LLM, KvCacheConfig", "", "llm = LLM("]
    if lay["weights"] == "fp8":
        head.insert(1, "# model must be an fp8 checkpoint: the PyTorch backend reads its quantization from it")
    lines = [f"    {name}={value!r}," for name, value in args.items()]
    lines += ["    kv_cache_config=KvCacheConfig(", *(f"        {k}={v!r}," for k, v in cache.items()), "    ),", ")"]
    return "\n".join(head + lines) + "\n", notes
