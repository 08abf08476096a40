"""The single-device trainer: the baseline every strategy must equal.

One optimizer step on a global batch of B sequences, split into ``grad_accum``
microbatches so that a batch too big for memory still trains as one step:

    for each microbatch:   loss = mean cross-entropy / grad_accum
                           loss.backward()          (gradients add up in .grad)
    sync_gradients()                                (nothing to do on one device)
    optimizer.step(); optimizer.zero_grad()

Dividing each microbatch loss by ``grad_accum`` makes the summed gradient the
gradient of the mean loss over the whole batch, exactly as if it had been one
forward. Parallel trainers reuse this loop: data parallel fills in
``sync_gradients`` (and ``accumulating``, to skip communication on all but the
last microbatch), a pipeline replaces the microbatch loop by its schedule, ZeRO
replaces the optimizer step; tensor parallelism only changes the model's layers.
``parallel/__init__.py`` puts them together.
"""

from __future__ import annotations

import contextlib
import torch

from ..measure import Recorder, optimizer_state_bytes, tensor_bytes
from ..model import loss_fn
from ..optim import MasterWeightsAdamW, init_state, make_optimizer
from .precision import Precision


def cpu_state_dict(state: dict) -> dict:
    """A CPU copy of ``state``; a DTensor is gathered whole first (a collective where it is sharded)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def microbatch_loop(trainer: "Trainer", x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward and backward of ``trainer.grad_accum`` microbatches, one after the other; their summed loss.

    The loop of every trainer without a pipeline. Only the last microbatch's
    backward may communicate (``accumulating``): the others add up locally.
    """
    total = torch.zeros((), device=x.device)
    micro = list(zip(x.chunk(trainer.grad_accum), y.chunk(trainer.grad_accum)))
    for i, (mx, my) in enumerate(micro):
        with trainer.accumulating(last=i == len(micro) - 1):
            total += trainer.forward_backward(mx, my, i)
    return total


class Trainer:
    """Trains ``model`` on one device; the strategies fill in the rest.

    - Data parallel subclasses fill in ``sync_gradients`` (and ``accumulating``);
      ZeRO also replaces the optimizer step.
    - ``loop`` runs the forward and backward passes of one step and returns the
      loss: :func:`microbatch_loop`, or a pipeline's schedule.
    - ``gathers`` turn this rank's weights into the whole model's, one function
      per strategy that cut them (tensor parallel's shards, then the pipeline's
      stages), for :meth:`full_state_dict`.
    - ``placements`` say where this rank's pieces sit in the whole tensors, for
      a checkpoint (:meth:`state_dict`): tensor parallel's slices.
    - ``precision`` (see ``precision.py``) chooses autocast or master weights and,
      for fp16, the loss scaler.
    - ``rec`` records spans, bytes and memory; without one nothing is recorded.
    - ``lr``, ``optimizer_class`` and ``optimizer_kwargs``: any ``torch.optim.Optimizer``,
      its learning rate and its other settings; the course's AdamW by default.
    - ``grad_accum``: microbatches per step in :func:`microbatch_loop`.

    So a model of your own trains with ``Trainer(model, lr=0.1, optimizer_class=torch.optim.SGD)``,
    and data parallel over a group with ``DataParallelScratch(model, group, lr=0.1, ...)``.
    """

    group = None  # the data-parallel group, where there is one: ranks agree on skipping a step over it
    loop = staticmethod(microbatch_loop)
    gathers: tuple = ()
    placements: tuple = ()

    def __init__(self, model: torch.nn.Module, *, lr: float = 1e-3, grad_accum: int = 1, rec: Recorder | None = None,
                 precision: Precision | None = None, loop=None, gathers=(), placements=(), optimizer_class=None,
                 optimizer_kwargs: dict | None = None):
        self.model = model
        self.grad_accum = grad_accum
        self.rec = rec if rec is not None else Recorder(0, next(model.parameters()).device, enabled=False)
        self.precision = precision or Precision()
        if loop is not None:
            self.loop = loop
        self.gathers = tuple(gathers)
        self.placements = tuple(placements)
        self.memory: dict = {}
        self.extras: dict = {}  # what this trainer can say about the run (buckets, shards, the schedule)
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, dict(optimizer_kwargs or {})
        self.optimizer = self.make_optimizer(lr)

    def new_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        """The optimizer this trainer was given, over ``params``: the course's AdamW unless another was."""
        if self.optimizer_class is None:
            return make_optimizer(params, lr)
        return self.optimizer_class(params, lr=lr, **self.optimizer_kwargs)

    def optimizer_for(self, params, lr: float):
        """That optimizer, on fp32 master copies when the parameters themselves are half precision."""
        if self.precision.master_weights:
            return MasterWeightsAdamW(params, lr, self.new_optimizer)
        return self.new_optimizer(params, lr)

    def make_optimizer(self, lr: float):
        return self.optimizer_for([p for p in self.model.parameters() if p.requires_grad], lr)

    def accumulating(self, last: bool):
        """Context for one microbatch's forward and backward (a no-op here)."""
        return contextlib.nullcontext()

    def sync_gradients(self) -> None:
        """Make gradients the same on every replica (nothing to do on one device)."""

    def optimizer_step(self) -> None:
        with self.rec.span("optimizer"):
            self.optimizer.step()
        self.measure_memory()
        self.optimizer.zero_grad(set_to_none=True)

    # What this rank holds, by category, counted from the tensors themselves.
    def weight_bytes(self) -> int:
        return tensor_bytes(self.model.parameters())

    def gradient_bytes(self) -> int:
        return tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def optimizer_bytes(self) -> int:
        if hasattr(self.optimizer, "state_bytes"):
            return self.optimizer.state_bytes()
        return optimizer_state_bytes(self.optimizer)

    def measure_memory(self) -> None:
        """Record weights, gradients and optimizer state (after the first step, when all exist)."""
        if not self.memory:
            self.memory = {"weights": self.weight_bytes(), "gradients": self.gradient_bytes(),
                           "optimizer": self.optimizer_bytes(), "activations": self.rec.activations.peak}
            if self.rec.on_cuda:  # the allocator's own peak, beside the categories counted from tensors
                self.memory["device_peak"] = torch.cuda.max_memory_allocated()

    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer will read (unscaled in place for fp16)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, microbatch: int) -> torch.Tensor:
        with self.rec.span("forward", microbatch=microbatch), self.precision.autocast(), \
                self.rec.activations.forward(microbatch):
            loss = loss_fn(self.model(x), y) / self.grad_accum
        with self.rec.span("backward", microbatch=microbatch):
            self.precision.scale(loss).backward()
        self.rec.activations.release(microbatch)
        return loss.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step on this rank's share of the batch; its mean loss (None on a stage that has none)."""
        loss = self.loop(self, x, y)
        self.sync_gradients()
        if self.precision.finish_gradients(self.gradients(), self.group):
            self.optimizer_step()
        else:  # fp16 overflow: skip this step, the scaler has backed off
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    @property
    def module(self) -> torch.nn.Module:
        """The model without a wrapper that renames its parameters (DDP's ``module.``)."""
        return self.model

    def local_state_dict(self) -> dict:
        """This rank's weights under the model's own names."""
        return self.module.state_dict()

    # --- Checkpoints: the Stateful protocol of torch.distributed.checkpoint (DCP) -----------------
    #
    # state_dict() says what this rank holds, under single-device names; DCP writes it, each rank its
    # part, and at load fills the same dictionary in place; load_state_dict() hands it back. Every
    # tensor is either whole or a DTensor saying where its piece sits in the whole tensor, so what is
    # saved does not depend on the layout: a checkpoint saved at one layout loads at another.

    def state_dict(self) -> dict:
        """``{"model": {name: weights}, "optim": {"name.field": optimizer state}}`` (+ ``"loss_scale"``).

        With fp32 master weights, ``"name.master"`` too.
        """
        state = {"model": self.model_state(), "optim": self.optimizer_state()}
        for placement in self.placements:
            state = placement.place(state)
        if self.precision.scaler is not None:  # fp16: the loss scale and its count of good steps are state too
            scaler = self.precision.scaler
            state["loss_scale"] = {"scale": scaler.scale, "good_steps": scaler.good_steps, "skipped": scaler.skipped}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Take the state :meth:`state_dict` described, filled in by a load (keys it lacks stay fresh)."""
        for placement in reversed(self.placements):
            state = placement.local(state)
        self.load_model_state(state["model"])
        self.load_optimizer_state(state.get("optim", {}))
        if "loss_scale" in state:
            vars(self.precision.scaler).update(state["loss_scale"])

    def model_state(self) -> dict:
        return self.local_state_dict()

    def load_model_state(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def parameter_names(self) -> dict:
        """``{parameter: its name}`` under the model's own names."""
        return {p: name for name, p in self.module.named_parameters()}

    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer holding the state: keyed by the parameters, or by their fp32 masters."""
        return self.optimizer.inner if isinstance(self.optimizer, MasterWeightsAdamW) else self.optimizer

    def _state_keys(self) -> dict:
        """``{name: the tensor the optimizer keys its state by}`` (the parameter, or its fp32 master)."""
        names = self.parameter_names()
        if isinstance(self.optimizer, MasterWeightsAdamW):
            return {names[p]: master for p, master in zip(self.optimizer.params, self.optimizer.masters)}
        owned = {id(p) for group in self.torch_optimizer().param_groups for p in group["params"]}
        return {name: p for p, name in names.items() if id(p) in owned}

    def optimizer_state(self) -> dict:
        optimizer = self.torch_optimizer()
        init_state(optimizer)  # fresh (about to load): make the tensors a load fills in
        state = {}
        for name, key in self._state_keys().items():
            for field, value in optimizer.state.get(key, {}).items():
                state[f"{name}.{field}"] = value
            if isinstance(self.optimizer, MasterWeightsAdamW):
                state[f"{name}.master"] = key
        return state

    def load_optimizer_state(self, state: dict) -> None:
        optimizer, by_name = self.torch_optimizer(), {}
        for key, value in state.items():  # "blocks.0.ln1.weight.exp_avg" → ("blocks.0.ln1.weight", "exp_avg")
            name, _, field = key.rpartition(".")
            by_name.setdefault(name, {})[field] = value
        for name, key in self._state_keys().items():
            fields = by_name.get(name, {})
            master = fields.pop("master", None)
            if master is not None and master is not key:
                with torch.no_grad():
                    key.copy_(master)
            if fields:
                optimizer.state[key] = fields
            else:  # not in the checkpoint: the parameter had no state there (it never got a gradient)
                optimizer.state.pop(key, None)

    def full_state_dict(self) -> dict:
        """The whole model's weights under single-device names, on CPU (collective when strategies cut them)."""
        state = self.local_state_dict()
        for gather in self.gathers:  # tensor parallel's shards made whole, then every pipeline stage's merged
            state = gather(state)
        return cpu_state_dict(state)
