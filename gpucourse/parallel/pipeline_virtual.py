"""The pipeline engine for today's schedules: several model chunks per rank, and the backward split in two.

``pipeline.py`` runs one contiguous stage per rank. Here a rank holds the
chunks its :class:`~gpucourse.parallel.schedules_virtual.Layout` gives it
(interleaved 1F1B: v chunks, p apart), and executes the ops of
``schedules_virtual.py`` one by one:

    RECV_F i.c   receive the input of chunk c's microbatch i (or take it from this rank's previous chunk)
    F i.c        run chunk c's blocks (the model's first chunk embeds, its last computes the loss / m)
    SEND_F i.c   post the output to the rank of the next chunk (``isend``: the rank goes on)
    RECV_B i.c   receive the gradient of that output
    B i.c        backward of chunk c: with a split schedule, the *input* gradients only
    SEND_B i.c   post the input's gradient to the previous chunk's rank
    W i.c        the *weight* gradients of chunk c (zero-bubble schedules)

**Splitting the backward.** B asks autograd for the gradients of the chunk's
input and of every layer's output — ``torch.autograd.grad(loss or output,
[input, layer outputs…], retain_graph=True)`` — which runs every input-gradient
matmul and skips every weight-gradient one (autograd computes only what is
asked). W then gives each layer (each module that owns parameters: Linear,
LayerNorm, Embedding) its weight gradient from the output gradient B left it:
``torch.autograd.backward(layer_output, its_gradient, inputs=its_parameters)``,
one node of the graph per layer. Nothing waits for W but the optimizer step,
so the schedule puts it where the rank would otherwise idle. (Production code,
Megatron-LM's zero-bubble support among it, defers the weight-gradient GEMMs in
its own linear layers instead of keeping the graph.)

Transfers are posted asynchronously and waited for at the end of the step:
the schedules were validated under exactly that rule. Gradients add up over the
m microbatches (each loss / m) as in ``pipeline.py``, so the optimizer step and
data parallelism after it are unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..model import GPT, blocks_of, loss_fn
from . import schedule_table
from .pipeline import merge_stages, pipeline_extras, stage_blocks
from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W
from .schedules_virtual import build
from .single import Trainer


class GPTChunks(nn.Module):
    """This rank's chunks of a GPT under ``layout``: their blocks (keyed by index in the whole model), plus the
    embeddings if it holds the first chunk and the head if it holds the last. Names stay the single device's."""

    def __init__(self, model: GPT, rank: int, layout):
        super().__init__()
        blocks = blocks_of(model)
        self.layout, self.rank = layout, rank
        self.vstages = [layout.virtual(rank, c) for c in range(layout.v)]
        self.chunk_blocks = [list(stage_blocks(len(blocks), layout.stages, vs)) for vs in self.vstages]
        self.first, self.last = 0 in self.vstages, layout.stages - 1 in self.vstages
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): blocks[i] for ids in self.chunk_blocks for i in sorted(ids)})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head
        for name in [name for name, _ in model.named_children()]:
            delattr(model, name)

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        vs = self.vstages[chunk]
        if vs == 0:
            x = GPT.embed(self, x)
        for i in self.chunk_blocks[chunk]:
            x = self.blocks[str(i)](x)
        return GPT.logits(self, x) if vs == self.layout.stages - 1 else x

    def layers(self, chunk: int) -> list[nn.Module]:
        """The modules of chunk ``chunk`` that own parameters (their outputs are where W starts)."""
        vs = self.vstages[chunk]
        parts = [self.blocks[str(i)] for i in self.chunk_blocks[chunk]]
        if vs == 0:
            parts = [self.wte, self.wpe] + parts
        if vs == self.layout.stages - 1:
            parts += [self.ln_f, self.head]
        return [m for part in parts for m in part.modules() if any(True for _ in m.parameters(recurse=False))]


class VirtualPipelineSchedule:
    """One rank's op list from ``schedules_virtual.py``, executed op by op (a trainer's loop)."""

    def __init__(self, pp_group, schedule: str, microbatches: int, virtual_stages: int, hidden: int):
        self.pp_group, self.m, self.hidden = pp_group, microbatches, hidden
        self.rank, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        schedule_ops, self.layout = build(schedule, pp, microbatches, virtual_stages)
        self.ops = schedule_ops[self.rank]
        # What each peer sends this rank, in the order it posts them: receives are posted in that same order,
        # so that every send meets its own receive (gloo and NCCL match a pair's messages in order).
        self.arrivals = {peer: [partner for op in schedule_ops[peer] if op.kind in (SEND_F, SEND_B)
                                for there, partner in [self.layout.route(peer, op)] if there == self.rank]
                         for peer in range(pp) if peer != self.rank}
        self.split = any(op.kind == W for op in self.ops)
        self.last_grad_op = max(i for i, op in enumerate(self.ops) if op.kind == (W if self.split else B))

    def __call__(self, trainer: Trainer, x: torch.Tensor, y: torch.Tensor):
        parts = trainer.grad_accum
        losses = [self._schedule(trainer, px, py, part, parts)
                  for part, (px, py) in enumerate(zip(x.chunk(parts), y.chunk(parts)))]
        return sum(losses) if trainer.module.last else None

    def _peer(self, op) -> int:
        peer, _ = self.layout.route(self.rank, op)
        return dist.get_global_rank(self.pp_group, peer)

    def _schedule(self, trainer: Trainer, x: torch.Tensor, y: torch.Tensor, part: int, parts: int):
        model, rec, chunks = trainer.model, trainer.rec, trainer.module
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        shape = (xs[0].shape[0], x.shape[1], self.hidden)
        last_vs = self.layout.stages - 1
        inputs, outputs, grads, pending_w, handles = {}, {}, {}, {}, []
        self.posted, self.next_arrival = {}, {peer: 0 for peer in self.arrivals}
        for peer in self.arrivals:  # the first message from each neighbour can arrive while this rank computes
            self._post_next(peer, shape, x.device)
        loss = torch.zeros((), device=x.device) if chunks.last else None
        for n, op in enumerate(self.ops):
            key, vs = (op.microbatch, op.chunk), chunks.vstages[op.chunk]
            mb = (part * self.m + op.microbatch) * self.layout.v + op.chunk  # a chunk's microbatch, numbered
            if op.kind == RECV_F:
                inputs[key] = self._recv(op, shape, x.device).requires_grad_()
            elif op.kind == F:
                if vs > 0 and key not in inputs:  # the previous chunk lives here: its output, cut from its graph
                    prev = (op.microbatch, self.layout.place(vs - 1)[1])
                    inputs[key] = outputs[prev].detach().requires_grad_()
                    inputs[key].local_from = prev
                with rec.span("forward", microbatch=mb), rec.activations.forward(mb):
                    seen = _Capture(chunks.layers(op.chunk)) if self.split else None
                    out = model(xs[op.microbatch] if vs == 0 else inputs[key], op.chunk)
                    if seen is not None:
                        seen.remove()
                    if vs == last_vs:
                        out = loss_fn(out, ys[op.microbatch]) / (self.m * parts)
                        loss += out.detach()
                outputs[key] = out
                if self.split:
                    pending_w[key] = seen.outputs
            elif op.kind == SEND_F:
                handles.append(comm.isend(outputs[key].detach(), self._peer(op), group=self.pp_group,
                                          name=f"send activation {op}"))
            elif op.kind == RECV_B:
                grads[key] = self._recv(op, shape, x.device)
            elif op.kind == B:
                grad = grads.pop(key, None)
                if grad is None and vs < last_vs:  # the next chunk lives here: the gradient it left
                    grad = grads.pop(("local", key))
                last = n == self.last_grad_op and part == parts - 1
                with trainer.accumulating(last=last), rec.span("backward", microbatch=mb):
                    self._backward(key, outputs, inputs, grad, pending_w)
                if not self.split:
                    outputs.pop(key)
                    rec.activations.release(mb)
                source = inputs.get(key)
                if source is not None and hasattr(source, "local_from"):
                    grads[("local", source.local_from)] = source.grad
            elif op.kind == SEND_B:
                handles.append(comm.isend(inputs.pop(key).grad, self._peer(op), group=self.pp_group,
                                          name=f"send gradient {op}"))
            elif op.kind == W:
                last = n == self.last_grad_op and part == parts - 1
                with trainer.accumulating(last=last), rec.span("backward", f"weights {op}", microbatch=mb):
                    for output, grad in pending_w.pop(key):
                        if grad is not None:
                            torch.autograd.backward(output, grad, inputs=output.own_parameters)
                outputs.pop(key)
                rec.activations.release(mb)
        for h in handles:
            h.wait()
        return loss

    def _backward(self, key, outputs, inputs, grad, pending_w) -> None:
        """The chunk's backward: whole (weights too), or with a split schedule the input gradients only."""
        out, source = outputs[key], inputs.get(key)
        if not self.split:
            torch.autograd.backward(out, grad)
            return
        layer_outputs = pending_w[key]
        wanted = ([source] if source is not None else []) + layer_outputs
        got = torch.autograd.grad(out, wanted, grad_outputs=grad, retain_graph=True, allow_unused=True)
        if source is not None:
            source.grad, got = got[0], got[1:]
        pending_w[key] = list(zip(layer_outputs, got))

    def _recv(self, op, shape, device) -> torch.Tensor:
        """Wait for ``op``'s data, posting the receives of everything its sender sent before it first; then post
        the sender's next message before waiting, so that it can arrive while this rank computes (a posted
        receive is what lets a transport move a message sent early)."""
        peer, _ = self.layout.route(self.rank, op)
        while op not in self.posted:
            if not self._post_next(peer, shape, device):
                raise RuntimeError(f"{op}: rank {peer} sends this rank nothing more in this step.")
        buf, handle = self.posted.pop(op)
        self._post_next(peer, shape, device)
        handle.wait()
        return buf

    def _post_next(self, peer: int, shape, device) -> bool:
        """Post the receive of the next message ``peer`` sends this rank in this step; False when none is left."""
        if self.next_arrival[peer] == len(self.arrivals[peer]):
            return False
        expected = self.arrivals[peer][self.next_arrival[peer]]
        self.next_arrival[peer] += 1
        buf = torch.empty(shape, device=device)
        what = "activation" if expected.kind == RECV_F else "gradient"
        self.posted[expected] = (buf, comm.irecv(buf, dist.get_global_rank(self.pp_group, peer),
                                                 group=self.pp_group, name=f"recv {what} {expected}"))
        return True


class _Capture:
    """Forward hooks that keep each layer's output (the tensor W will start from), in forward order."""

    def __init__(self, layers):
        self.outputs: list = []
        self.hooks = [m.register_forward_hook(self._keep) for m in layers]

    def _keep(self, module, args, output):
        output.own_parameters = [p for p in module.parameters(recurse=False) if p.requires_grad]
        self.outputs.append(output)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()



# --- impl="torch": the same chunks under torch.distributed.pipelining's multi-stage schedules ---------------


class _Chunk(nn.Module):
    """One chunk of a :class:`GPTChunks` as a module of its own (its blocks, and the embeddings or the head
    where it has them): what a ``PipelineStage`` wraps. The parameters are the GPTChunks' own, shared."""

    def __init__(self, chunks: GPTChunks, chunk: int):
        super().__init__()
        vs, last = chunks.vstages[chunk], chunks.layout.stages - 1
        self.first, self.last = vs == 0, vs == last
        if self.first:
            self.wte, self.wpe, self.drop = chunks.wte, chunks.wpe, chunks.drop
        self.blocks = nn.ModuleList(chunks.blocks[str(i)] for i in chunks.chunk_blocks[chunk])
        if self.last:
            self.ln_f, self.head = chunks.ln_f, chunks.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = GPT.embed(self, x)
        for block in self.blocks:
            x = block(x)
        return GPT.logits(self, x) if self.last else x


class TorchVirtualPipeline:
    """interleaved-1f1b and zbv with ``torch.distributed.pipelining``: one ``PipelineStage`` per chunk, under
    ``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble`` (losses / (m · parts), ``scale_grads=False``, as
    ``pipeline.TorchPipelineSchedule``). They run on CPU ranks over gloo as on GPUs."""

    def __init__(self, pp_group, schedule: str, microbatches: int, device):
        self.pp_group, self.name, self.m, self.device = pp_group, schedule, microbatches, device
        self.schedule = None

    def _build(self, trainer: Trainer) -> None:
        from torch.distributed import pipelining

        chunks = trainer.module
        stages = [pipelining.PipelineStage(_Chunk(chunks, c), chunks.vstages[c], chunks.layout.stages, self.device,
                                           group=self.pp_group) for c in range(chunks.layout.v)]
        scale = self.m * trainer.grad_accum
        self.schedule = getattr(pipelining, schedule_table.get(self.name).torch_class)(
            stages, n_microbatches=self.m, loss_fn=lambda out, y: loss_fn(out, y) / scale, scale_grads=False)

    def __call__(self, trainer: Trainer, x: torch.Tensor, y: torch.Tensor):
        if self.schedule is None:
            self._build(trainer)
        chunks, losses = trainer.module, []
        for px, py in zip(x.chunk(trainer.grad_accum), y.chunk(trainer.grad_accum)):
            part: list = []
            self.schedule.step(*([px] if chunks.first else []), **({"target": py, "losses": part} if chunks.last else {}))
            losses += part
        return torch.stack(losses).sum().detach() if chunks.last else None


# --- how the engine applies it ---------------------------------------------------------------------------------------

def apply(model, mesh, cfg, built):
    """The schedules with several chunks a rank or a split backward: ``model`` becomes this rank's chunks and the
    step loop the schedule's, on the pp slice of ``mesh``.
    What the engine needs later goes into ``built`` (``parallel.Built``)."""
    if cfg.pp == 1 or not schedule_table.get(cfg.schedule).virtual:
        return model
    pp_group = mesh["pp"].get_group()
    built.gathers.append(functools.partial(merge_stages, pp_group))
    built.extras.update(pipeline_extras(mesh, cfg.schedule, cfg.microbatches, cfg.virtual_stages))
    built.loop = TorchVirtualPipeline(pp_group, cfg.schedule, cfg.microbatches, built.device) if cfg.impl == "torch" \
        else VirtualPipelineSchedule(pp_group, cfg.schedule, cfg.microbatches, cfg.virtual_stages,
                                     cfg.model_config().n_embd)
    return GPTChunks(model, mesh["pp"].get_local_rank(),
                     build(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)[1])
