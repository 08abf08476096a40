"""Mixed precision: the two regimes a user meets, and loss scaling for fp16.

bf16 and fp16 halve the bytes of every matrix multiply's inputs and run on the
GPU's tensor cores. Two ways to use them:

- **Autocast** (what PyTorch AMP does): parameters, gradients and Adam's state
  stay fp32; inside ``torch.autocast`` each matrix multiply casts its inputs to
  half precision. Memory per parameter is unchanged (4 + 4 + 8 bytes); the
  activations saved for backward shrink.
- **Master weights** (what Megatron and the ZeRO paper count): the model itself
  is half precision, so its gradients are too (half the gradient traffic of
  data parallelism), and the optimizer keeps an fp32 *master* copy of every
  weight, applies Adam to it and writes the rounded result back
  (``gpucourse.optim.MasterWeightsAdamW``).
  2 (weights) + 2 (gradients) + 4 + 4 + 4 (master, two moments) = 16 bytes per
  parameter, of which ZeRO can shard the last 12.

fp16 has a narrow range: small gradients underflow to zero. **Loss scaling**
multiplies the loss by S before backward so the gradients are S times larger,
and divides them by S before the optimizer step. A *dynamic* scaler starts with
a large S; when any gradient is inf or NaN the step is skipped and S is halved
(back-off); after ``growth_interval`` good steps in a row S is doubled. bf16 has
fp32's range and needs no scaling.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Keeps the fp16 loss scale: back off on overflow, grow after a run of good steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 200):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0
        self.history: list[tuple[float, bool]] = []  # each step of this run: the scale its backward used, overflowed?

    def update(self, found_inf: bool) -> None:
        """Call once per step with whether any gradient overflowed."""
        self.history.append((self.scale, found_inf))
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


class Precision:
    """What a trainer needs to know about its number format."""

    def __init__(self, precision: str = "fp32", master_weights: bool = False, device_type: str = "cpu"):
        self.name = precision
        self.dtype = DTYPES[precision]
        self.master_weights = master_weights and precision != "fp32"
        self.device_type = device_type
        self.scaler = DynamicLossScaler() if precision == "fp16" else None

    def autocast(self):
        """Half-precision matrix multiplies in the autocast regime; nothing otherwise."""
        if self.name == "fp32" or self.master_weights:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler else loss

    def finish_gradients(self, grads: list[torch.Tensor], group=None) -> bool:
        """Unscale the gradients; return False (skip the step) if any overflowed.

        Ranks that hold different gradients (ZeRO shards) must agree on
        skipping, so the verdict is all-reduced over ``group``.
        """
        if self.scaler is None:
            return True
        inv = 1.0 / self.scaler.scale
        found = torch.zeros((), device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if group is not None and dist.get_world_size(group) > 1:
            comm.all_reduce(found, op=dist.ReduceOp.MAX, group=group, name="all_reduce found_inf")
        overflow = bool(found.item())
        self.scaler.update(overflow)
        return not overflow

    def extras(self) -> dict:
        out = {"precision": self.name, "master_weights": self.master_weights}
        if self.scaler:
            out.update(skipped_steps=self.scaler.skipped, loss_scale=self.scaler.scale,
                       step_scales=[scale for scale, _ in self.scaler.history],
                       skipped_at=[i for i, (_, overflow) in enumerate(self.scaler.history) if overflow])
        return out
