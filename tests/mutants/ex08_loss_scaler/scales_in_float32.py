"""Wrong answer for ex08: scale returns the scaled loss in float32, whatever the loss's dtype (fp16 in,
float32 out): right for a float32 loss, not the caller's dtype for any other."""

import torch
import torch.distributed as dist


class LossScaler:
    """The loss scale of fp16 training: back off on overflow, grow after ``growth_interval`` good steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.loss_scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale: call ``.backward()`` on this."""
        return loss.float() * self.loss_scale  # float32: S times the loss may not fit in fp16

    def unscale_(self, grads, group=None) -> bool:
        """Divide every gradient in ``grads`` by the scale, in place; True if any holds an inf or a NaN."""
        grads = list(grads)
        found = torch.zeros((), device=grads[0].device if grads else "cpu")
        for g in grads:
            g.div_(self.loss_scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        # Ranks holding different gradients (ZeRO shards) must all skip, or their weights drift apart.
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Back off and restart the count after an overflow; grow after ``growth_interval`` good steps in a row."""
        if found_inf:
            self.loss_scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.loss_scale *= self.growth_factor
            self.good_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, group=None) -> bool:
        """Unscale the gradients of ``optimizer``'s parameters, step unless they overflowed, update the scale.

        Returns whether the optimizer stepped.
        """
        grads = [p.grad for pg in optimizer.param_groups for p in pg["params"] if p.grad is not None]
        found_inf = self.unscale_(grads, group)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf
