"""Exercise 3: gradient buckets, all-reduced during backward.

Taught in notebooks/02_data_parallelism.ipynb; check your work with
``from gpucourse import check; check("ex03")`` or ``gpucourse grade ex03``.
Compare with the reference, gpucourse/parallel/data_parallel_buckets.py, once yours passes.

Averaging gradients one parameter at a time, after backward, sends many small
messages and leaves the network idle while backward computes. Buckets fix both.

``assign_buckets(model, cap_bytes)``
    Return the names (as in ``model.named_parameters()``) of the trainable
    parameters — ``requires_grad`` True; frozen ones are left out — grouped in
    buckets, a list of lists. Order them as their gradients become ready during
    backward: the reverse of ``model.named_parameters()``. Walk that order and
    put each parameter into the current bucket unless that would take the
    bucket's size (``numel() * element_size()`` summed) past ``cap_bytes``; then
    start a new bucket with it. A parameter bigger than the cap gets a bucket of
    its own; no bucket is empty.

``BucketedGradientSync(model, cap_bytes)``
    On construction, assign the buckets (keep them as ``self.buckets``) and
    register a hook on each trainable parameter
    (``p.register_post_accumulate_grad_hook``) that copies its gradient into
    its bucket's flat buffer. When the last gradient of a bucket has arrived,
    launch that bucket's all-reduce with ``dist.all_reduce(buffer,
    async_op=True)`` — during backward, one per bucket.
    ``finish()`` is called after ``loss.backward()``: wait for every bucket,
    divide by the world size, and write the averages back into each ``p.grad``,
    leaving everything ready for the next backward. Every trainable parameter
    receives a gradient in every backward.

Besides the averages, the grader holds ``BucketedGradientSync`` to the contract
every caller relies on (a broken promise fails its own check, in one line
naming it): *keeps the dtype*, a float64 model's gradients are averaged in
float64 (a buffer made without ``dtype=`` is float32, and rounds them).
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def assign_buckets(model: nn.Module, cap_bytes: int) -> list[list[str]]:
    """Names of the trainable parameters, in gradient-ready order, in buckets of at most ``cap_bytes``."""
    raise NotImplementedError("assign_buckets")


class BucketedGradientSync:
    """Averages a model's gradients over all ranks, one asynchronous all-reduce per bucket, during backward."""

    def __init__(self, model: nn.Module, cap_bytes: int):
        raise NotImplementedError("BucketedGradientSync.__init__")

    def finish(self) -> None:
        """Wait for every bucket, and put the averaged gradients into ``p.grad``; ready for the next backward."""
        raise NotImplementedError("BucketedGradientSync.finish")
