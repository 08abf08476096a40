"""Exercise 8: a dynamic loss scaler for fp16 training.

Taught in notebooks/07_memory_batch.ipynb; check your work with
``from gpucourse import check; check("ex08")`` or ``gpucourse grade ex08``.
Compare with the reference, gpucourse/parallel/precision.py
(``DynamicLossScaler`` and ``Precision.finish_gradients``), and with PyTorch's
``torch.amp.GradScaler``, once yours passes.

fp16's largest number is 65504 and its smallest about 6e-8: gradients much
smaller than that, computed in fp16 during backward, round to zero and the
model stops learning.
Loss scaling multiplies the loss by S before backward, so every gradient is S
times larger (and survives), then divides the gradients by S before the
optimizer uses them. Too large an S overflows to inf instead: a *dynamic*
scaler starts high, and when any gradient is inf or NaN it skips that step
and halves S; after ``growth_interval`` good steps in a row it doubles S.
(bf16 has fp32's range and needs none of this.)

``LossScaler(init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000)``
    Keep the current scale in ``self.loss_scale`` (a Python float) and count
    the good steps since the last change of scale.

``scale(loss)``
    Return ``loss * self.loss_scale``; the caller runs ``.backward()`` on it.

``unscale_(grads, group=None) -> bool``
    Divide each tensor of the list ``grads`` by the scale, in place, and
    return True if any of them holds an inf or a NaN (``torch.isfinite``). With
    ZeRO each rank holds a different shard of the gradients, so one rank may
    overflow alone; yet all ranks must skip the same steps, or their weights
    drift apart. So when ``torch.distributed`` is initialised
    (``dist.is_initialized()``) all-reduce the verdict, as a 0-d float tensor
    on the gradients' device, with ``ReduceOp.MAX`` over ``group`` (None:
    every rank); without it, do no communication at all.

``update(found_inf)``
    After an overflow multiply the scale by ``backoff_factor`` and restart the
    count of good steps; otherwise count one more good step, and when the
    count reaches ``growth_interval`` multiply the scale by ``growth_factor``
    and restart the count.

``step(optimizer, group=None) -> bool``
    Unscale the gradients of every parameter of ``optimizer.param_groups``
    that has one (``unscale_`` over the same ``group``), call
    ``optimizer.step()`` only if none overflowed, then ``update``. Return
    whether the optimizer stepped. (Zeroing the gradients stays the training
    loop's job.)

Besides the values, the grader holds the scaler to the contract every caller
relies on (a broken promise fails its own check, in one line naming it):

- *inputs unchanged*: ``scale`` leaves the loss it is given as it was (a loop
  may log it after scaling);
- *keeps the dtype*: ``scale`` returns the loss's dtype (fp16, bf16, float64);
- *any strides*: ``unscale_`` takes gradients that are views (a transposed one).
"""

import torch
import torch.distributed as dist


class LossScaler:
    """The loss scale of fp16 training: back off on overflow, grow after ``growth_interval`` good steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        raise NotImplementedError("LossScaler.__init__")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale: call ``.backward()`` on this."""
        raise NotImplementedError("LossScaler.scale")

    def unscale_(self, grads, group=None) -> bool:
        """Divide every gradient in ``grads`` by the scale, in place; True if any holds an inf or a NaN."""
        raise NotImplementedError("LossScaler.unscale_")

    def update(self, found_inf: bool) -> None:
        """Back off and restart the count after an overflow; grow after ``growth_interval`` good steps in a row."""
        raise NotImplementedError("LossScaler.update")

    def step(self, optimizer: torch.optim.Optimizer, group=None) -> bool:
        """Unscale the gradients of ``optimizer``'s parameters, step unless they overflowed, update the scale.

        Returns whether the optimizer stepped.
        """
        raise NotImplementedError("LossScaler.step")
