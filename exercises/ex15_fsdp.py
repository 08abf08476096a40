"""Exercise 15: fully sharded data parallel (ZeRO-3) with a compute dtype.

Taught in notebooks/03_zero_fsdp.ipynb; check your work with
``from gpucourse import check; check("ex15")`` or ``gpucourse grade ex15``.
Compare with the reference, gpucourse/parallel/fsdp_module.py, once yours passes.

ZeRO-1 shards the optimizer's state; FSDP shards the weights too, and gathers
each one whole only while it is used. A training loop uses it as it uses DDP::

    fsdp = FSDP(model, compute_dtype=torch.float16)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)   # steps the shards
    loss = my_loss(fsdp(x))
    loss.backward()
    fsdp.finish_gradient_synchronization()
    opt.step()

``FSDP(module, compute_dtype=None)``, an ``nn.Module``; every rank is handed
the same ``module``, and the default process group is the data-parallel group.

- **Which parameters**: every parameter with two or more dimensions is
  sharded; vectors (biases, norm gains) stay whole on every rank.
- **The shard**: flatten the parameter, pad it with zeros to a multiple of the
  world size n, cut it into n pieces of ``ceil(numel / n)``; rank r keeps piece
  r as the parameter's ``.data`` (same dtype as before). So
  ``fsdp.parameters()`` are the module's own parameters, holding shards.
- **Forward, per submodule, through hooks**: before a submodule that holds
  sharded parameters runs (``register_forward_pre_hook``), all-gather each of
  them whole (``dist.all_gather_single``) and put the whole weight where the
  submodule's ``forward`` reads it: ``module.__dict__[name] = whole`` (Python
  finds an instance attribute before the parameter). After it ran
  (``register_forward_hook``), remove the attribute and **free** the whole
  weight: ``buffer.untyped_storage().resize_(0)`` frees the memory under every
  view of it, those autograd saved included. A submodule called twice gathers
  twice: each call is one use.
- **Backward**: when the gradient of a call's output arrives (a hook on the
  output tensor), gather the weight again into the same memory
  (``resize_(nbytes)``, then all-gather), since that call's backward reads it.
  Make the whole weight the output of a ``torch.autograd.Function`` whose
  ``forward(ctx, param, ...)`` returns it: its ``backward`` receives the whole
  weight's gradient for that call; free the weight, pad the gradient flat with
  zeros like the shard (the padding is no weight: its gradient is zero, so it
  stays zero) and start ``dist.reduce_scatter_single(piece, flat, async_op=True)``,
  so that rank r receives the sum of piece r. Return None for ``param``.
- **compute_dtype** (None, or e.g. ``torch.float16``): cast the shard to it
  *before* the all-gather (the gather moves half the bytes) and compute with
  it; the shards (master weights) stay fp32; cast the gradient to the shard's
  dtype *before* the reduce-scatter, so the sum and ``p.grad`` are fp32.
  Vectors keep their own dtype.
- ``finish_gradient_synchronization()``: after backward, wait for every
  reduce-scatter, divide by n and put the piece in the shard's ``.grad`` (add
  it, for a weight used twice); all-reduce each vector's gradient and divide
  by n. Each rank then holds, for each shard, the averaged gradient of its
  piece in the shard's shape and dtype.

The grader compares the shards after each SGD step with one device (taking
the same batch in the ranks' parts) on 1, 2 and 3 ranks, in fp32 and with
fp16 compute; looks for whole weights still holding memory between forward and
backward; and counts the bytes the ranks send each other in a step.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


class FSDP(nn.Module):
    """Every matrix of ``module`` sharded over the ranks, gathered whole only while a submodule holding it runs."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        raise NotImplementedError("FSDP.__init__")

    def forward(self, *args, **kwargs):
        raise NotImplementedError("FSDP.forward")

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters and put each averaged piece in its shard's ``.grad``; all-reduce and
        average the replicated parameters' gradients."""
        raise NotImplementedError("FSDP.finish_gradient_synchronization")
