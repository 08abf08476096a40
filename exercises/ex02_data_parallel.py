"""Exercise 2: data-parallel gradient averaging.

Taught in notebooks/02_data_parallelism.ipynb; check your work with
``from gpucourse import check; check("ex02")`` or ``gpucourse grade ex02``.
Compare with the reference, gpucourse/parallel/data_parallel.py, once yours passes.

Every rank holds the same model (same weights) and is handed the same global
batch. Write:

``average_gradients(model)``
    Replace every parameter's ``.grad`` by the mean of that gradient over all
    ranks of the default process group. Parameters whose ``.grad`` is None
    (frozen, or unused in this step) are left alone, still None.

``data_parallel_step(model, optimizer, loss_fn, inputs, targets)``
    One training step. With B rows in ``inputs`` and n ranks (n divides B),
    rank r trains on its contiguous share, rows ``r*B/n`` up to ``(r+1)*B/n``
    of ``inputs`` and ``targets``: clear the gradients left from before, run the
    model on its rows, ``loss_fn(output, its_targets)`` (a mean over its rows),
    backward, average the gradients, and take the optimizer step. Afterwards
    every rank's weights must equal those of the same step taken by one device
    on the whole batch. Do not change ``inputs`` or ``targets``.

Besides the weights, the grader holds ``data_parallel_step`` to the contract
every caller relies on (a broken promise fails its own check, in one line
naming it):

- *inputs unchanged*: ``inputs`` and ``targets`` come back bit for bit;
- *any strides*: ``inputs`` and ``targets`` may be views (a transposed matrix);
- *keeps the dtype*: a float64 model is averaged and stepped in float64 (a
  buffer made without ``dtype=`` is float32, and rounds its gradients).
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def average_gradients(model: nn.Module) -> None:
    """Replace every parameter's ``.grad`` by its mean over all ranks; parameters without one are skipped."""
    raise NotImplementedError("average_gradients")


def data_parallel_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, inputs: torch.Tensor,
                       targets: torch.Tensor) -> None:
    """One training step on this rank's share of the global batch ``inputs`` / ``targets``."""
    raise NotImplementedError("data_parallel_step")
