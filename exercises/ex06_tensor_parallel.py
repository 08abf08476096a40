"""Exercise 6: column- and row-parallel linear layers, forward and backward.

Taught in notebooks/05_tensor_parallelism.ipynb; check your work with
``from gpucourse import check; check("ex06")`` or ``gpucourse grade ex06``.
Compare with the reference, gpucourse/parallel/tensor_parallel.py, once yours passes.

Tensor parallelism cuts one layer's weight between the ranks (all ranks of the
default process group), which all see the same batch. For ``y = x W^T + b``
with W of shape (out, in):

``ColumnParallelLinear(full)``
    Keeps rank r's contiguous slice of ``full``'s *output* features — rows
    ``r*out/n`` to ``(r+1)*out/n`` of ``full.weight`` and of ``full.bias`` (n
    divides out) — as its own new Parameters ``weight`` and ``bias``. Its
    forward takes the whole input x (the same on every rank) and returns this
    rank's slice of y's last dimension. In backward, the gradient that reaches
    x must be the whole dL/dx: each rank's slice contributes only a part of it.

``RowParallelLinear(full)``
    Keeps rank r's contiguous slice of ``full``'s *input* features — columns
    ``r*in/n`` to ``(r+1)*in/n`` of ``full.weight`` — and the whole bias. Its
    forward takes this rank's slice of x's last dimension and returns the whole
    y, the same on every rank, the bias counted once. Gradients must come out
    right for its weight, its bias and its input slice.

Both must work for a ``full`` made with ``bias=False`` (``full.bias`` is None):
then the layer has no bias either (``self.bias = None``). The slices are copies
(``.clone()``), not views of ``full``'s tensors, so the whole weight can be freed.

The communication belongs in two small ``torch.autograd.Function``s (each a
``forward`` and a ``backward``) that you apply inside the layers' forwards.
Do not change the input tensors.

Besides the values, the grader holds both layers' forward to the contract every
caller of a layer relies on (a broken promise fails its own check, in one line
naming it):

- *inputs unchanged*: x comes back bit for bit, after forward and after backward;
- *keeps the dtype*: bf16 in, bf16 out; float64 in, float64 out, to float64's
  precision;
- *any strides*: x may be a view (a transposed batch of three dimensions).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class ColumnParallelLinear(nn.Module):
    """This rank's slice of ``full``'s output features; takes the whole input, returns its slice of the output."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        raise NotImplementedError("ColumnParallelLinear.__init__")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ColumnParallelLinear.forward")


class RowParallelLinear(nn.Module):
    """This rank's slice of ``full``'s input features; takes its slice of the input, returns the whole output."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        raise NotImplementedError("RowParallelLinear.__init__")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("RowParallelLinear.forward")
