"""Context parallelism with PyTorch's own ring attention (``--cp N --impl torch``); ours is context_parallel.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import blocks_of
from ..readable import ConfigError
from .context_parallel import ATTENTIONS, embed_at_positions

# --- PyTorch's ring attention ---------------------------------------------------------------------
#
# ``torch.distributed.tensor.experimental`` holds PyTorch's context parallelism: q, k and v become
# DTensors sharded along the sequence (dimension 2) over the cp mesh, and with its dispatcher on,
# SDPA on such DTensors runs PyTorch's ring (``_templated_ring_attention``): each K/V shard visits
# every rank, partial results merged by their log-sum-exp, the causal blocks skipped or halved by
# the head-tail load balancer — the zig-zag split above. The shards travel by one all-to-all a hop
# (``set_rotate_method("alltoall")``: our ``ring``) or are all-gathered once and taken one by one
# (``"allgather"``, its default: our ``allgather``). Backward is a ring too; the K/V gradients
# travel home by all-to-all in both. ``torch.distributed.tensor.experimental.context_parallel``
# turns the same dispatcher on for a ``with`` block (patching F.scaled_dot_product_attention) and
# shards the buffers it is given (inputs, labels, positions) along the sequence; here the data
# module already hands each rank its tokens.
#
# Bytes per layer and step, each rank, K and V blocks of 2·4·b·H·(T/cp)·d (fp32):
# ring: forward cp − 1 all-to-alls of a block pair, backward cp − 1 more and cp of their gradients;
# allgather: forward and backward one all-gather each (cp block pairs), and cp all-to-alls of gradients.
#
# PyTorch registers its ring for CUDA's attention kernels (flash, memory-efficient, cuDNN). On CPU
# SDPA calls its CPU flash kernel, which returns the same output and log-sum-exp; ``_cpu_ring``
# registers PyTorch's same ring around that kernel, so the algorithm runs on a laptop unchanged.

# Our --cp-algo -> PyTorch's rotate method, where it has one (the algorithms' records say).
TORCH_ROTATE = {a.name: a.torch_rotate for a in ATTENTIONS.values() if a.torch_rotate}


def torch_context_parallel():
    """PyTorch's context-parallel module, or None where this torch lacks the pieces used here."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return None
    needed = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options",
              "set_rotate_method", "_enable_context_parallel_dispatcher")
    return _attention if all(hasattr(_attention, name) for name in needed) else None


def apply_torch_context_parallel(module: torch.nn.Module, cp_mesh, seq_len: int, algo: str = "ring",
                                 zigzag: bool = False) -> torch.nn.Module:
    """Make ``module``'s attention PyTorch's ring attention over ``cp_mesh`` (a 1-D mesh); return it."""
    from torch.distributed.tensor import DTensor, Shard

    cp_api = torch_context_parallel()
    cp_api._cp_options.enable_load_balance = zigzag  # head-tail: rank i holds chunks i and 2·cp − 1 − i
    cp_api.set_rotate_method(TORCH_ROTATE[algo])
    cp_api._enable_context_parallel_dispatcher()
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _CPU_KERNELS:
        handlers[op] = _cpu_ring
    embed_at_positions(module, cp_mesh.get_group(), seq_len, zigzag)

    def attend(q, k, v):
        q, k, v = (DTensor.from_local(t, cp_mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).to_local()

    for block in blocks_of(module):
        block.attn.attend = attend
    return module


_CPU_KERNELS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _cpu_ring(op_call, args, kwargs):
    """DTensor's handler for the CPU flash kernel, forward or backward: PyTorch's ring around it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    cp_api = torch_context_parallel()
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    named = dict(zip((a.name for a in op_call._schema.arguments), info.local_args), **info.local_kwargs)
    group = info.compute_mesh.get_group()
    if op_call is _CPU_KERNELS[0]:
        results = cp_api._templated_ring_attention(group, 2, op_call, **named)
    else:
        results = cp_api._templated_ring_attention_backward(group, 2, op_call, grad_out_name="grad_out", **named)
    wrapped = []
    for local in results:  # every output is sharded along the sequence, as the inputs were
        placements = (Shard(2),)
        shape, stride = compute_global_tensor_info(local, info.compute_mesh, placements)
        spec = DTensorSpec(info.compute_mesh, placements, TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
        wrapped.append(DTensor(local, spec, requires_grad=False))
    return tuple(wrapped)


def apply(model, mesh, cfg, built):
    """impl "torch": PyTorch's context-parallel attention on the cp slice of ``mesh``."""
    if cfg.cp == 1 or cfg.impl != "torch":
        return model
    return apply_torch_context_parallel(model, mesh["cp"], cfg.seq_len, cfg.cp_algo, cfg.zigzag)


def check(cfg, mc, runnable: bool = True) -> None:
    """What PyTorch's context parallelism refuses (``impl="torch"``), one sentence each."""
    if cfg.cp == 1 or cfg.impl != "torch":
        return
    if cfg.cp_algo not in TORCH_ROTATE:
        raise ConfigError(f"PyTorch's context parallelism is a ring ({' or '.join(TORCH_ROTATE)}); it has no "
                          f"cp_algo={cfg.cp_algo!r}: use impl='scratch' for it.")
    if torch_context_parallel() is None:
        raise ConfigError(f"this torch ({torch.__version__}) lacks the context-parallel ring this build uses "
                          f"(torch.distributed.tensor.experimental._context_parallel): use impl='scratch'.")
