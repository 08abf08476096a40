"""ZeRO stage 3 from scratch: the weights sharded too, each block gathered just in time.

Stages 1 and 2 (``zero.py``) shard the optimizer state and the gradients, but
every rank still keeps every weight: 4·P bytes in fp32. Stage 3 keeps 1/dp of
them. The model is cut into *units*: each transformer block is one, and the
rest (embeddings, final norm, head) is the root unit. A unit's trainable
parameters live in one flat buffer padded to a multiple of dp; rank r keeps
only shard r of it, S_u = ceil(P_u / dp) values, and that shard is what the
optimizer steps. The full buffer exists only while the unit computes:

    before a block's forward     all-gather its shards into its flat buffer: the full weights
    after its forward            free the buffer (autograd still refers to the weights; it no longer holds them)
    before its backward          all-gather again
    after its backward           reduce-scatter its gradient into the shard's gradient; free the buffer

The root unit is gathered when the model's forward starts and stays gathered
until backward ends: its embeddings run first and its head last, so freeing it
after forward would only gather it again at once (FSDP2 keeps its root
gathered for the same reason).

How the code finds those moments, all with PyTorch hooks:

- forward: a forward pre-hook and a forward hook on each block;
- before backward: a hook on the block's *output* tensor runs when that
  output's gradient is complete, which is just before the block's backward;
- after backward: blocks run backward one after another, so when the next
  one starts (or backward ends) the previous one's gradients are complete.
  That is when the previous block is reduce-scattered and freed — before the
  next is gathered, so at most the root and one block are whole at once. The
  end of backward is a callback queued on autograd's engine.

Memory per rank at the optimizer step, with S = Σ_u ceil(P_u / dp):
weights 4·S, gradients 4·S, Adam 8·S bytes — all three divided by dp. The
price is transient and in communication: while computing, a rank holds the
root and one block whole (4·(P'_root + max P'_block) bytes, ``extras["zero"]``
reports the largest measured), and every step each block is all-gathered
twice and reduce-scattered once: 1.5× plain data parallelism's all-reduce
(the root, kept between forward and backward, is gathered once).

With several microbatches (gradient accumulation or a pipeline), every
microbatch's backward reduce-scatters into the shards' gradients, which add
up: communication grows with the microbatches, memory does not. Frozen
parameters are not sharded (they need no gradient and no optimizer state).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm
from ..measure import tensor_bytes
from ..model import blocks_of
from .data_parallel import broadcast_parameters
from .single import Trainer
from .sharded_state import load_sharded_optimizer_state, sharded_optimizer_state


def memory_formula(units: dict[str, int], dp: int, value_bytes: int = 4) -> dict:
    """Bytes per rank at the optimizer step (Adam, fp32), and the most weights whole at once ("gathered").

    ``units``: the parameter count of each unit ("root" and the blocks), each padded to a multiple of dp.
    """
    shard = sum(math.ceil(n / dp) for n in units.values())
    padded = {name: math.ceil(n / dp) * dp for name, n in units.items()}
    largest_block = max((n for name, n in padded.items() if name != "root"), default=0)
    return {"weights": value_bytes * shard, "gradients": value_bytes * shard, "optimizer": 8 * shard,
            "gathered": value_bytes * (padded.get("root", 0) + largest_block)}


class Unit:
    """A group of parameters gathered and freed together: views into one flat buffer, of which a rank keeps a shard."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], group):
        self.name, self.params, self.group = name, params, group
        dp, rank = dist.get_world_size(group), dist.get_rank(group)
        numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(numel / dp)
        first = params[0]
        self.flat = torch.zeros(self.shard_size * dp, dtype=first.dtype, device=first.device)
        self.slices, offset = [], 0
        for p in params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)  # the module's weight is a view of the buffer
            self.slices.append((offset, p.numel()))
            offset += p.numel()
        lo = rank * self.shard_size
        # The shard has storage of its own: it stays when the buffer is freed.
        self.shard = torch.nn.Parameter(self.flat[lo:lo + self.shard_size].clone())
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.got_grad: set[int] = set()  # parameters that received a gradient this step
        self.gathered = True
        self.free()

    def gather(self) -> None:
        """All-gather every rank's shard into the flat buffer: the unit's weights are whole again."""
        self.flat.untyped_storage().resize_(self.nbytes)
        comm.all_gather_into_tensor(self.flat, self.shard.detach(), group=self.group,
                                    name=f"all_gather {self.name}")
        self.gathered = True

    def keep_shard(self) -> None:
        """Copy this rank's shard out of the (gathered) flat buffer: after the weights were written whole."""
        lo = dist.get_rank(self.group) * self.shard_size
        with torch.no_grad():
            self.shard.copy_(self.flat[lo:lo + self.shard_size])

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)  # every view (the module's weights) now points at nothing
        self.gathered = False

    def reduce_scatter_gradients(self) -> None:
        """Sum every rank's gradients of this unit; keep this rank's shard of the average (added to its .grad)."""
        flat_grad = torch.zeros_like(self.flat)
        for i, (p, (offset, n)) in enumerate(zip(self.params, self.slices)):
            if p.grad is not None:
                flat_grad[offset:offset + n].copy_(p.grad.reshape(-1))
                self.got_grad.add(i)
                p.grad = None  # the full gradient is not kept
        shard_grad = torch.empty_like(self.shard)
        comm.reduce_scatter_tensor(shard_grad, flat_grad, group=self.group,
                                   name=f"reduce_scatter {self.name} gradients")
        shard_grad /= dist.get_world_size(self.group)
        if self.shard.grad is None:
            self.shard.grad = shard_grad
        else:
            self.shard.grad += shard_grad

    def untouched(self, rank: int) -> list[tuple[int, int]]:
        """(start, end) inside this rank's shard of every parameter that got no gradient this step."""
        lo, spans = rank * self.shard_size, []
        for i, (offset, n) in enumerate(self.slices):
            start, end = max(offset - lo, 0), min(offset + n - lo, self.shard_size)
            if i not in self.got_grad and start < end:
                spans.append((start, end))
        return spans


class Zero3Scratch(Trainer):
    """ZeRO stage 3 over the data-parallel ``group``, from scratch: each unit's weights gathered only to compute."""

    def __init__(self, model, group, **options):
        self.group = group
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        broadcast_parameters(model, group)
        try:
            blocks = blocks_of(model)
        except TypeError:  # a model without transformer blocks is one unit
            blocks = []
        self.units, in_blocks = [], set()
        names = {id(m): name for name, m in model.named_modules()}
        for block in blocks:
            params = [p for p in block.parameters() if p.requires_grad]
            in_blocks.update(map(id, block.parameters()))
            if params:
                unit = Unit(names[id(block)], params, group)
                self.units.append(unit)
                block.register_forward_pre_hook(lambda module, args, unit=unit: self._before_forward(unit))
                block.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_blocks]
        self.root = Unit("root", rest, group) if rest else None  # (the name memory_formula looks for)
        if self.root is not None:
            self.units.append(self.root)
            model.register_forward_pre_hook(lambda module, args: self._before_forward(self.root))
            model.register_forward_hook(lambda module, args, out: self._after_forward(self.root, out))
        self._in_backward: Unit | None = None  # the block whose backward is running
        self._callback_queued = False
        self.gathered_peak = 0
        super().__init__(model, **options)
        self.extras["zero"] = {"stage": 3, "num_params": sum(sum(n for _, n in u.slices) for u in self.units),
                               "shard_size": sum(u.shard_size for u in self.units),
                               "units": {u.name: sum(n for _, n in u.slices) for u in self.units}}

    # --- forward: gather before, free after (the root stays) ---------------------------------
    def _before_forward(self, unit: Unit) -> None:
        if not unit.gathered:
            self._gather(unit)

    def _after_forward(self, unit: Unit, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a forward run again inside backward (activation checkpointing): keep the weights
        needs_backward = isinstance(out, torch.Tensor) and out.requires_grad
        if needs_backward:
            out.register_hook(lambda grad: self._before_backward(unit))
        if unit is not self.root or not needs_backward:
            self._free(unit)

    # --- backward: finish the previous block, gather this one ---------------------------------
    def _before_backward(self, unit: Unit) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if unit is not self.root:  # (the root's backward spans the whole backward: it ends last)
            if self._in_backward is not None and self._in_backward is not unit:
                self._finish(self._in_backward)  # its backward is over: its gradients are complete
            self._in_backward = unit
        if not unit.gathered:
            self._gather(unit)

    def _end_of_backward(self) -> None:
        for unit in self.units:
            if unit.gathered:
                self._finish(unit)
        self._in_backward, self._callback_queued = None, False

    def _finish(self, unit: Unit) -> None:
        unit.reduce_scatter_gradients()
        self._free(unit)
        if unit is self._in_backward:
            self._in_backward = None

    def _gather(self, unit: Unit) -> None:
        unit.gather()
        self.rec.activations.exclude([unit.flat])  # the gathered weights are not activations
        self.gathered_peak = max(self.gathered_peak, sum(u.nbytes for u in self.units if u.gathered))

    def _free(self, unit: Unit) -> None:
        self.rec.activations.forget([unit.flat])
        unit.free()

    # --- the optimizer steps the shards --------------------------------------------------------
    def make_optimizer(self, lr):
        return self.optimizer_for([u.shard for u in self.units], lr)

    def gradients(self):
        return [u.shard.grad for u in self.units if u.shard.grad is not None]

    def sync_gradients(self) -> None:
        for unit in self.units:  # whatever backward left gathered (a backward the hooks did not see end)
            if unit.gathered:
                self._finish(unit)
        for unit in self.units:  # a unit no microbatch's backward reached: a zero gradient, all of it untouched
            if unit.shard.grad is None:
                unit.shard.grad = torch.zeros_like(unit.shard)

    def optimizer_step(self) -> None:
        # As in stages 1 and 2: a parameter that got no gradient is left as it was (one device skips it).
        kept = [(u, start, u.shard[start:end].clone()) for u in self.units for start, end in u.untouched(self.rank)]
        masters = dict(zip(map(id, (u.shard for u in self.units)), getattr(self.optimizer, "masters", ())))
        with self.rec.span("optimizer"):
            self.optimizer.step()
        with torch.no_grad():
            for unit, start, values in kept:
                unit.shard[start:start + len(values)] = values
                if id(unit.shard) in masters:  # fp32 master weights: the same
                    masters[id(unit.shard)][start:start + len(values)] = values
        self.measure_memory()
        self.extras["zero"]["gathered_peak_bytes"] = self.gathered_peak
        self.optimizer.zero_grad(set_to_none=True)
        for unit in self.units:
            unit.got_grad.clear()

    # --- what this rank holds -------------------------------------------------------------------
    def weight_bytes(self) -> int:
        sharded = {id(p) for u in self.units for p in u.params}
        frozen = [p for p in self.model.parameters() if id(p) not in sharded]
        return tensor_bytes([u.shard for u in self.units]) + tensor_bytes(frozen)

    def gradient_bytes(self) -> int:
        return tensor_bytes(u.shard.grad for u in self.units if u.shard.grad is not None)

    def local_state_dict(self) -> dict:
        """The whole (tensor-parallel-local) weights: every unit gathered once, copied, freed again."""
        return self._whole(lambda: {k: v.detach().clone() for k, v in self.model.state_dict().items()})

    def load_model_state(self, state: dict) -> None:
        def load():
            self.model.load_state_dict(state)
            for unit in self.units:
                unit.keep_shard()
        self._whole(load)

    def _whole(self, fn):
        """``fn()`` with every unit gathered (a collective), each freed again after."""
        was = [u.gathered for u in self.units]
        for unit in self.units:
            if not unit.gathered:
                unit.gather()
        try:
            return fn()
        finally:
            for unit, gathered in zip(self.units, was):
                if not gathered:
                    unit.free()

    def _shards(self) -> list:
        names = self.parameter_names()
        return [(u.shard, [(names[p], offset, n, p.shape) for p, (offset, n) in zip(u.params, u.slices)])
                for u in self.units]

    def optimizer_state(self) -> dict:
        return sharded_optimizer_state(self.optimizer, self._shards(), self.group)

    def load_optimizer_state(self, state: dict) -> None:
        load_sharded_optimizer_state(self.optimizer, self._shards(), state, self.group)
