"""A serving layout in vLLM's engine arguments and TensorRT-LLM's LLM API: every name printed is one of the tool's
own (the lists below cite where each was read), the values land where the tool keeps them, and what a tool cannot
express is said in a sentence. Pure text: neither tool is imported."""

from __future__ import annotations

import ast
import shlex

import pytest

from gpucourse.readable import ConfigError
from gpucourse.interop.serve_config import TOOLS, layout_from_plan, render
from gpucourse.modeled.serve_plan import plan

pytestmark = pytest.mark.timeout(60)

# vLLM 0.33.0 (the wheel on PyPI), vllm/engine/arg_utils.py: each an EngineArgs field whose add_argument call spells
# it --field-with-dashes; a bool field (enable_chunked_prefill) gets --name and --no-name (BooleanOptionalAction).
# `vllm serve` takes the model as its first word (model_tag, vllm/entrypoints/common/cli_args.py).
VLLM_FIELDS = {
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "enable_chunked_prefill", "dtype", "kv_cache_dtype", "block_size", "quantization",
    "gpu_memory_utilization",
}
VLLM_FLAGS = {"--" + f.replace("_", "-") for f in VLLM_FIELDS} | {"--no-enable-chunked-prefill"}
VLLM_SWITCHES = {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}
# vllm/config/model.py ModelDType; vllm/config/cache.py CacheDType (a part of it);
# vllm/model_executor/layers/quantization/__init__.py QuantizationMethods (a part of it).
VLLM_CHOICES = {"--dtype": {"auto", "half", "float16", "bfloat16", "float", "float32"},
                "--kv-cache-dtype": {"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"},
                "--quantization": {"fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel"}}

# TensorRT-LLM, tensorrt_llm/llmapi/llm_args.py at main commit 0004396: BaseLlmArgs fields (LLM(**kwargs) builds
# TorchLlmArgs from them) and KvCacheConfig fields; KvCacheConfig.validate_dtype accepts "auto", "fp8", "fp8_ds_mla",
# "nvfp4" or a torch dtype name; LLM and KvCacheConfig are exported by tensorrt_llm/llmapi/__init__.py.
TRTLLM_FIELDS = {
    "model", "tensor_parallel_size", "pipeline_parallel_size", "dtype", "max_seq_len", "max_input_len",
    "max_batch_size", "max_num_tokens", "enable_chunked_prefill", "kv_cache_config",
}
TRTLLM_KV_CACHE_FIELDS = {"dtype", "tokens_per_block", "free_gpu_memory_fraction"}
TRTLLM_KV_DTYPES = {"auto", "fp8", "fp8_ds_mla", "nvfp4", "bfloat16", "float16"}

SAMPLE = {"model": "meta-llama/Llama-3.1-70B-Instruct", "tp": 4, "pp": 2, "context": 8192, "batch": 64,
          "token_budget": 2048, "kv": "fp8", "block_size": 32, "gpu_memory_fraction": 0.9}
LAYOUTS = {
    "sample": SAMPLE,
    "plain": {"context": 4096, "batch": 8},
    "everything": {**SAMPLE, "replicas": 2, "weights": "fp8", "block_size": 24, "token_budget": 16,
                   "shape": "llama3-70b", "gpu": "h100"},
    "odd model name": {"model": "/models/my llama's copy", "context": 2048, "batch": 300},
}


def vllm(text: str) -> tuple[str, dict]:
    """(the model, {--flag: value}) of a `vllm serve` command; a switch's value is None."""
    words = shlex.split(" ".join(line.removesuffix(" \\") for line in text.splitlines() if not line.startswith("#")))
    assert words[:2] == ["vllm", "serve"], text
    model, flags, rest = words[2], {}, words[3:]
    while rest:
        flag = rest.pop(0)
        assert flag.startswith("--") and flag not in flags, (flag, text)
        flags[flag] = None if flag in VLLM_SWITCHES else rest.pop(0)
    return model, flags


def trtllm(text: str) -> tuple[dict, dict]:
    """(LLM's keywords, KvCacheConfig's keywords) of the Python text, as values."""
    tree = ast.parse(text)
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert [(i.module, [a.name for a in i.names]) for i in imports] == [("tensorrt_llm.llmapi",
                                                                         ["LLM", "KvCacheConfig"])]
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.func.id == "LLM")
    llm = {k.arg: k.value for k in call.keywords}
    cache = llm.pop("kv_cache_config")
    assert isinstance(cache, ast.Call) and cache.func.id == "KvCacheConfig"
    return ({k: ast.literal_eval(v) for k, v in llm.items()} | {"kv_cache_config": None},
            {k.arg: ast.literal_eval(k.value) for k in cache.keywords})


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_printed_name_is_the_tools_own(name):
    model, flags = vllm(render("vllm", LAYOUTS[name])[0])
    assert model == LAYOUTS[name].get("model", "your-org/your-model")
    assert set(flags) <= VLLM_FLAGS
    for flag, value in flags.items():
        assert value in VLLM_CHOICES.get(flag, {value})
    llm, cache = trtllm(render("trtllm", LAYOUTS[name])[0])
    assert set(llm) <= TRTLLM_FIELDS and set(cache) <= TRTLLM_KV_CACHE_FIELDS
    assert cache["dtype"] in TRTLLM_KV_DTYPES and llm["model"] == model


def test_each_setting_lands_where_the_tool_keeps_it():
    text, notes = render("vllm", SAMPLE)
    _, flags = vllm(text)
    assert flags == {"--tensor-parallel-size": "4", "--pipeline-parallel-size": "2", "--max-model-len": "8192",
                     "--max-num-seqs": "64", "--enable-chunked-prefill": None, "--max-num-batched-tokens": "2048",
                     "--dtype": "bfloat16", "--kv-cache-dtype": "fp8", "--block-size": "32",
                     "--gpu-memory-utilization": "0.9"}
    assert notes == []  # one replica, a block of 32 and a budget above the batch: vLLM says all of it
    llm, cache = trtllm(render("trtllm", {**SAMPLE, "gpu_memory_fraction": None})[0])
    assert llm == {"model": SAMPLE["model"], "tensor_parallel_size": 4, "pipeline_parallel_size": 2,
                   "dtype": "bfloat16", "max_seq_len": 8192, "max_input_len": 8192, "max_batch_size": 64,
                   "max_num_tokens": 2048, "enable_chunked_prefill": True, "kv_cache_config": None}
    assert cache == {"dtype": "fp8", "tokens_per_block": 32}
    assert render("trtllm", {**SAMPLE, "gpu_memory_fraction": None})[1] == []
    _, flags = vllm(render("vllm", {**SAMPLE, "replicas": 3, "kv": "bf16", "weights": "fp8"})[0])
    assert (flags["--data-parallel-size"], flags["--kv-cache-dtype"], flags["--quantization"]) == \
        ("3", "bfloat16", "fp8_per_tensor")
    assert trtllm(render("trtllm", {**SAMPLE, "kv": "bf16"})[0])[1]["dtype"] == "auto"  # the model's bfloat16


def test_what_a_tool_cannot_express_is_said_not_dropped():
    text, notes = render("trtllm", {**SAMPLE, "replicas": 2})
    assert "max_batch_size=64" in text and any("no data-parallel replicas" in n and "start 2 LLMs" in n for n in notes)
    # Block sizes: vLLM's FlashAttention wants a multiple of 16, TensorRT-LLM a power of two.
    odd = {**SAMPLE, "block_size": 24}
    assert vllm(render("vllm", odd)[0])[1]["--block-size"] == "32"
    assert trtllm(render("trtllm", odd)[0])[1]["tokens_per_block"] == 32
    assert all(any("not 24" in n for n in render(tool, odd)[1]) for tool in TOOLS)
    assert vllm(render("vllm", {**SAMPLE, "block_size": 48})[0])[1]["--block-size"] == "48"
    assert trtllm(render("trtllm", {**SAMPLE, "block_size": 48})[0])[1]["tokens_per_block"] == 64
    # A token budget below the batch: vLLM refuses it, TensorRT-LLM warns.
    text, notes = render("vllm", {**SAMPLE, "token_budget": 16})
    assert vllm(text)[1]["--max-num-batched-tokens"] == "64" and any("refuses" in n for n in notes)
    assert any("warns" in n for n in render("trtllm", {**SAMPLE, "token_budget": 16})[1])
    # No budget: chunked prefill off, but both still cap an iteration's tokens.
    whole = {**SAMPLE, "token_budget": None}
    assert vllm(render("vllm", whole)[0])[1]["--no-enable-chunked-prefill"] is None
    assert vllm(render("vllm", whole)[0])[1]["--max-num-batched-tokens"] == "8192"
    llm, _ = trtllm(render("trtllm", whole)[0])
    assert (llm["enable_chunked_prefill"], llm["max_num_tokens"]) == (False, 8192)
    assert all(any("feeds every waiting prompt whole" in n for n in render(t, whole)[1]) for t in TOOLS)
    # fp8 weights: vLLM quantizes as it loads; TensorRT-LLM's LLM API needs an fp8 checkpoint.
    text, notes = render("trtllm", {**SAMPLE, "weights": "fp8"})
    assert "quant" not in text.split("llm = LLM(")[1] and any("fp8 checkpoint" in n for n in notes)
    # The memory fraction: the whole GPU for vLLM, what the weights leave for TensorRT-LLM.
    text, notes = render("trtllm", SAMPLE)
    assert "free_gpu_memory_fraction" not in trtllm(text)[1] and any("not translated" in n for n in notes)
    sized = {**SAMPLE, "shape": "llama3-70b", "gpu": "h100"}
    fraction = trtllm(render("trtllm", sized)[0])[1]["free_gpu_memory_fraction"]
    assert 0 < fraction < 0.9 and any("left after the weights" in n for n in render("trtllm", sized)[1])
    for tool in TOOLS:
        assert all(n.endswith(".") and "\n" not in n for n in render(tool, LAYOUTS["everything"])[1])


def test_a_plan_row_becomes_a_layout_with_every_microbatch_in_flight():
    result = plan("llama3-8b", 8)
    row = next(r for r in result["layouts"] if r["pp"] > 1 and r["batch"])
    layout = layout_from_plan(result, row, model="meta-llama/Llama-3.1-8B-Instruct")
    assert layout["batch"] == row["pp"] * row["batch"]
    _, flags = vllm(render("vllm", layout)[0])
    assert (flags["--max-num-seqs"], flags["--pipeline-parallel-size"]) == (str(layout["batch"]), str(row["pp"]))


@pytest.mark.parametrize("tool, layout, words", [
    ("sglang", SAMPLE, "not one of vllm, trtllm"),
    ("vllm", {**SAMPLE, "tp": 3, "shape": "llama3-8b"}, "tp=3 does not divide the 32 attention heads"),
    ("trtllm", {**SAMPLE, "pp": 100, "shape": "llama3-8b"}, "pp=100"),
    ("vllm", {**SAMPLE, "tensor_parallel": 2}, "unknown layout key tensor_parallel"),
    ("vllm", {"batch": 4}, "needs context"),
    ("trtllm", {**SAMPLE, "weights": "int4"}, "weights='int4'"),
    ("vllm", {**SAMPLE, "batch": 0}, "batch=0"),
    ("vllm", {**SAMPLE, "gpu_memory_fraction": 1.5}, "(0, 1]"),
    ("trtllm", {**SAMPLE, "gpu": "h100"}, "only read with shape"),
    ("trtllm", {**SAMPLE, "shape": "llama3-70b", "gpu": "h100", "tp": 1, "gpu_memory_fraction": 0.5}, "no room"),
])
def test_bad_input_is_one_sentence(tool, layout, words):
    with pytest.raises(ConfigError) as err:
        render(tool, layout)
    message = str(err.value)
    assert words in message and "\n" not in message and message.endswith(".")
