"""The same training loop through Hugging Face Accelerate.

Accelerate hides the launcher, the process group and the wrapping behind one
object: ``accelerator.prepare(model, optimizer)`` returns a DDP-wrapped model
(or an FSDP one, with a plugin), and ``accelerator.backward(loss)`` replaces
``loss.backward()``. Under the hood it is exactly ``data_parallel.TorchDDP`` or
``zero_torch.TorchFSDP``: the losses equal the single-device run's.

Two traps this file avoids:

- On a machine without GPUs, ``Accelerator()`` inside a distributed launch can
  quietly run every rank as a separate single process on the full data. Asking
  for ``cpu=True`` makes it join the CPU process group; and we check that it
  really sees every rank before training.
- Accelerate would shard the data itself through its DataLoader wrapper; the
  course feeds every rank its own share of the global batch, as in every other
  layout, so that the runs stay comparable.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from ..readable import ConfigError
from ..measure import Recorder, optimizer_state_bytes, tensor_bytes
from ..model import loss_fn
from ..optim import make_optimizer
from .precision import Precision
from .single import Trainer, cpu_state_dict


class AccelerateTrainer(Trainer):
    """Data parallel (zero=0: DDP) or FSDP (zero=3) driven by ``accelerate.Accelerator``."""

    def __init__(self, model, *, zero: int = 0, lr: float = 1e-3, grad_accum: int = 1, rec=None):
        from accelerate import Accelerator

        plugin = None
        if zero == 3:
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.accelerator = Accelerator(cpu=on_cpu, fsdp_plugin=plugin)
        if self.accelerator.num_processes != dist.get_world_size():
            raise ConfigError(f"Accelerate sees {self.accelerator.num_processes} process(es) but "
                              f"{dist.get_world_size()} ranks are running: it did not go distributed.")
        if zero == 3 and "FSDP" not in str(self.accelerator.distributed_type):
            raise ConfigError(f"Accelerate chose {self.accelerator.distributed_type}, not FSDP, for zero=3.")
        self.rec = rec if rec is not None else Recorder(0, next(model.parameters()).device, enabled=False)
        self.grad_accum = grad_accum
        optimizer = make_optimizer(model.parameters(), lr)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.precision = Precision()  # fp32: Accelerate's own mixed precision is not used here
        self.memory = {}
        self.extras = {"accelerate": {"distributed_type": str(self.accelerator.distributed_type),
                                      "num_processes": self.accelerator.num_processes}}

    def accumulating(self, last: bool):
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def forward_backward(self, x, y, microbatch):
        with self.rec.span("forward", microbatch=microbatch):
            loss = loss_fn(self.model(x), y) / self.grad_accum
        with self.rec.span("backward", microbatch=microbatch):
            self.accelerator.backward(loss)
        return loss.detach()

    def measure_memory(self) -> None:
        if not self.memory:
            self.memory = {"weights": tensor_bytes(self.model.parameters()),
                           "gradients": tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None),
                           "optimizer": optimizer_state_bytes(self.optimizer.optimizer)}

    @property
    def module(self):
        return self.accelerator.unwrap_model(self.model)

    def torch_optimizer(self):
        return self.optimizer.optimizer  # Accelerate's wrapper around ours

    def full_state_dict(self) -> dict:
        return cpu_state_dict(self.accelerator.get_state_dict(self.model))
