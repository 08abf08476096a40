"""ZeRO the PyTorch way, beside ``zero.py``'s from-scratch stages (``impl="torch"``).

- Stage 1: ``ZeroRedundancyOptimizer`` under DDP. DDP all-reduces the gradients; the optimizer shards whole
  parameters between ranks (not one flat buffer, so its shards are as even as the parameters' sizes allow), steps
  its own and broadcasts them.
- Stages 2 and 3: FSDP2's ``fully_shard`` on each block, then on the whole model: the weights live sharded
  (a DTensor per parameter), each block is all-gathered before its forward and its gradients reduce-scattered in
  backward. ``reshard_after_forward=False`` keeps the gathered weights from forward to backward (stage 2's
  memory: gradients and optimizer sharded, weights whole during the step); ``True`` frees them after forward and
  gathers again for backward (stage 3).
"""

from __future__ import annotations

import torch

from ..measure import optimizer_state_bytes
from ..model import blocks_of
from ..optim import ADAMW
from .data_parallel import TorchDDP
from .single import Trainer


class TorchZero1(TorchDDP):
    """ZeRO-1 the PyTorch way: DDP for gradients, ZeroRedundancyOptimizer for the step."""

    def make_optimizer(self, lr):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer_class, kwargs = self.optimizer_class, self.optimizer_kwargs
        if optimizer_class is None:  # the course's AdamW
            optimizer_class, kwargs = torch.optim.AdamW, ADAMW
        return ZeroRedundancyOptimizer(
            [p for p in self.model.parameters() if p.requires_grad], optimizer_class=optimizer_class,
            process_group=self.group, lr=lr, **kwargs)

    def optimizer_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer.optim)

    def torch_optimizer(self):
        return self.optimizer.optim  # the optimizer over this rank's own parameters: it holds their state


class TorchFSDP(Trainer):
    """FSDP2: each block (then the whole model) wrapped by ``fully_shard`` over the dp mesh."""

    def __init__(self, model, dp_mesh, stage: int = 3, **options):
        from torch.distributed.fsdp import fully_shard

        reshard = stage == 3
        for block in blocks_of(model):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
        super().__init__(model, **options)

    def accumulating(self, last: bool):
        # Skip the reduce-scatter on all but the last microbatch, as DDP's no_sync does.
        self.model.set_requires_gradient_sync(last)
        return super().accumulating(last)
