"""Pipeline parallelism: each rank holds a few consecutive blocks, and microbatches flow through.

The model is cut by depth into ``pp`` *stages* — stage 0 also holds the
embeddings, the last stage the final LayerNorm and the head. The batch is cut
into ``m`` microbatches. A microbatch's forward runs stage after stage, each
sending its output activation (microbatch × seq_len × n_embd) to the next; its
backward runs the other way, each stage sending the gradient of its input back.
In *what order* each stage does its forwards, backwards, sends and receives is
the schedule — plain data from ``schedules.py`` that :class:`PipelineScratch`
executes op by op:

    RECV_F i   receive microbatch i's activation from the previous stage
    F i        run this stage's blocks (first: embed tokens; last: logits, loss / m)
    SEND_F i   send the output activation to the next stage
    RECV_B i   receive the gradient of that output from the next stage
    B i        torch.autograd.backward(output, grad)   (last stage: from the loss)
    SEND_B i   send the gradient of the input activation to the previous stage

Sends and receives block, so their order matters: a schedule that has two
neighbours both sending to each other first never finishes (``schedules.validate``
finds that before anything runs). Every activation has the known shape
(microbatch, seq_len, n_embd), so a receive needs no shape exchange first.

Every stage adds the gradients of its m microbatches (each loss divided by m),
so after the schedule each stage holds exactly the single-device gradient of its
own parameters; the optimizer step is the usual one, per stage. With dp > 1 each
stage then averages its gradients over its data-parallel group; with tp > 1 the
stage's blocks are also split between tp ranks (``tensor_parallel.py``).

Communication per optimizer step, each pipeline (fp32, 4 bytes a number; B is
the global batch, so B/dp/m sequences a microbatch):

    2 × (pp − 1) × m × (B/dp/m) × seq_len × n_embd × 4 bytes sent

— one activation forward and one gradient backward per microbatch over each of
the pp − 1 stage boundaries. There are dp × tp pipelines: with tensor
parallelism inside a stage, each tp rank sends its own (identical) copy to the
same tp rank of the next stage.

``impl="torch"`` runs the same stage modules with ``torch.distributed.pipelining``
(``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..model import GPT, blocks_of, loss_fn
from .data_parallel import allreduce_gradients, broadcast_parameters
from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, build
from .single import Trainer, cpu_state_dict


def stage_blocks(n_layer: int, pp: int, stage: int) -> range:
    """The block indices stage ``stage`` of ``pp`` holds: balanced and contiguous, earlier stages one more."""
    per, extra = divmod(n_layer, pp)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


class GPTStage(nn.Module):
    """One stage of a GPT: its share of the blocks, plus the embeddings (first) or the head (last).

    Parts keep their single-device names — ``blocks`` is a ModuleDict keyed by the
    original block index — so this stage's ``state_dict`` keys ("blocks.2.ln1.weight")
    are those of the whole model, and merging every stage's is the model's.
    The parts are the GPT's own modules, moved here, not copies.
    """

    def __init__(self, model: GPT, stage: int, pp: int):
        super().__init__()
        self.first, self.last = stage == 0, stage == pp - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        blocks = blocks_of(model)
        self.blocks = nn.ModuleDict({str(i): blocks[i] for i in stage_blocks(len(blocks), pp, stage)})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head
        # Empty the caller's GPT, so the layers other stages own are freed once
        # nothing else refers to them.
        for name in [name for name, _ in model.named_children()]:
            delattr(model, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or activations in; activations or logits (last stage) out."""
        if self.first:
            x = GPT.embed(self, x)  # the GPT's own code: it only needs wte, wpe and drop
        for block in self.blocks.values():
            x = block(x)
        return GPT.logits(self, x) if self.last else x


class PipelineScratch(Trainer):
    """Executes one stage's op list from ``schedules.py`` each step, then the optimizer step."""

    def __init__(self, stage_module: GPTStage, cfg, mesh, rec, device, tp_group=None):
        self.pp_group = mesh["pp"].get_group()
        self.stage, self.m = mesh["pp"].get_local_rank(), cfg.microbatches
        # Neighbours as global ranks: the same dp and tp index, one stage up or down.
        self.prev = dist.get_global_rank(self.pp_group, self.stage - 1) if self.stage > 0 else None
        self.next = dist.get_global_rank(self.pp_group, self.stage + 1) if self.stage < cfg.pp - 1 else None
        self.ops = build(cfg.schedule, cfg.pp, cfg.microbatches)[self.stage]
        # Every activation has the same, known shape: no shape exchange is needed.
        mc = cfg.model_config()
        self.shape = (cfg.batch_size // cfg.dp // cfg.microbatches, cfg.seq_len, mc.n_embd)
        self.device = device
        self.tp_group = tp_group
        if tp_group is not None:
            from .tensor_parallel import apply_tensor_parallel
            apply_tensor_parallel(stage_module, tp_group)
        super().__init__(stage_module, cfg.lr, 1, rec, grad_sync=_dp_sync(stage_module, mesh, cfg))
        self.extras = _extras(cfg, mesh)

    def step(self, x: torch.Tensor, y: torch.Tensor):
        """One optimizer step; returns the loss on the last stage, None on the others."""
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        inputs, outputs, grads = {}, {}, {}  # per microbatch: received input, output (or loss), output grad
        loss = torch.zeros((), device=x.device) if self.next is None else None
        for op in self.ops:
            i = op.microbatch
            if op.kind == RECV_F:
                inputs[i] = self._recv(self.prev, f"recv activation {i}").requires_grad_()
            elif op.kind == F:
                with self.rec.span("forward", microbatch=i), self.rec.activations.forward(i):
                    out = self.model(xs[i] if self.prev is None else inputs[i])
                    if self.next is None:
                        # Each microbatch's mean loss / m: the gradients add up to those of the mean.
                        out = loss_fn(out, ys[i]) / self.m
                        loss += out.detach()
                outputs[i] = out
            elif op.kind == SEND_F:
                comm.send(outputs[i].detach(), self.next, group=self.pp_group, name=f"send activation {i}")
            elif op.kind == RECV_B:
                grads[i] = self._recv(self.next, f"recv gradient {i}")
            elif op.kind == B:
                with self.rec.span("backward", microbatch=i):
                    # pop: once backward has run, this microbatch's activations can be freed.
                    torch.autograd.backward(outputs.pop(i), grads.pop(i, None))
                self.rec.activations.release(i)
            elif op.kind == SEND_B:
                comm.send(inputs.pop(i).grad, self.prev, group=self.pp_group, name=f"send gradient {i}")
        self.sync_gradients()
        self.optimizer_step()
        return loss

    def _recv(self, src: int, name: str) -> torch.Tensor:
        buf = torch.empty(self.shape, device=self.device)
        comm.recv(buf, src, group=self.pp_group, name=name)
        return buf

    def full_state_dict(self) -> dict:
        """Every stage's weights, merged, on every rank (collective over the pp and tp groups)."""
        if self.tp_group is not None:
            from .tensor_parallel import full_tensor_state
            local = full_tensor_state(self.model, self.tp_group)
        else:
            local = cpu_state_dict(self.model.state_dict())
        return _merge_stages(local, self.pp_group)


class PipelineTorch(Trainer):
    """The same stages under ``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``.

    Loss scaling: the schedule calls ``loss_fn`` on each microbatch (a mean) and,
    with ``scale_grads=True`` (its default), divides the summed gradients by m
    at the end — the gradient of the mean over microbatches, as in scratch. The
    losses it hands back are the unscaled microbatch means; their mean is the
    step's loss.

    Measuring: torch sends with its own batched ``isend``/``irecv``, not through
    ``gpucourse.comm``; ``train_worker`` counts those at the dispatcher
    (``comm.counting``): per step the same activations and gradients scratch
    sends, plus, on the first step only, a few hundred bytes of handshake (tensor
    metadata, a warm-up vote) with each neighbour. The stage's
    ``forward_one_chunk`` / ``backward_one_chunk`` are wrapped to record spans.
    """

    def __init__(self, stage_module: GPTStage, cfg, mesh, rec, device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.pp_group = mesh["pp"].get_group()
        stage, self.m = mesh["pp"].get_local_rank(), cfg.microbatches
        self.first, self.last = stage == 0, stage == cfg.pp - 1
        self.pipe = PipelineStage(stage_module, stage, cfg.pp, device, group=self.pp_group)
        for name, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            setattr(self.pipe, name, _spanning(getattr(self.pipe, name), rec, kind))
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
        self.schedule = schedule(self.pipe, n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=True)
        super().__init__(stage_module, cfg.lr, 1, rec, grad_sync=_dp_sync(stage_module, mesh, cfg))
        self.extras = _extras(cfg, mesh)

    def step(self, x: torch.Tensor, y: torch.Tensor):
        losses: list[torch.Tensor] = []
        # The first stage feeds tokens, the last compares with targets; the middle ones receive.
        self.schedule.step(*([x] if self.first else []), **({"target": y, "losses": losses} if self.last else {}))
        self.sync_gradients()
        self.optimizer_step()
        return torch.stack(losses).mean().detach() if self.last else None

    def full_state_dict(self) -> dict:
        return _merge_stages(cpu_state_dict(self.model.state_dict()), self.pp_group)


def _spanning(method, rec, kind: str):
    """Wrap ``forward_one_chunk`` / ``backward_one_chunk`` (first argument: microbatch) in a span."""
    @functools.wraps(method)
    def wrapper(chunk_id, *args, **kwargs):
        with rec.span(kind, microbatch=chunk_id):
            return method(chunk_id, *args, **kwargs)
    return wrapper


def _dp_sync(stage_module, mesh, cfg):
    """With dp > 1: start the stage's replicas equal and average its gradients over dp after each schedule."""
    if cfg.dp == 1:
        return None
    group = mesh["dp"].get_group()
    broadcast_parameters(stage_module, group)
    return functools.partial(allreduce_gradients, stage_module, group)


def _extras(cfg, mesh) -> dict:
    """What every rank can say about the whole run: each stage's ops, and which stage each rank runs."""
    ranks = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    return {"schedule": [[str(op) for op in ops] for ops in build(cfg.schedule, cfg.pp, cfg.microbatches)],
            "stage_of_rank": {str(int(r)): s for s in range(cfg.pp) for r in ranks[s].flatten()}}


def _merge_stages(local: dict, pp_group) -> dict:
    """Every stage's state dict, gathered to every rank and merged in stage order.

    ``torch.distributed`` directly, not ``gpucourse.comm``: exporting is not training traffic.
    """
    gathered: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, local, group=pp_group)
    return {k: v for part in gathered for k, v in part.items()}


def make_pipeline_trainer(model: GPT, mesh, cfg, rec, device) -> Trainer:
    """Cut ``model`` into this rank's stage and return the trainer for ``cfg.impl``.

    With tp > 1 (scratch), the stage's blocks are then split between the tp ranks
    by ``tensor_parallel.apply_tensor_parallel``: tensor parallel inside a stage,
    the pipeline across stages, data parallelism across whole pipelines.
    """
    stage = GPTStage(model, mesh["pp"].get_local_rank(), cfg.pp)
    if cfg.impl == "torch":
        return PipelineTorch(stage, cfg, mesh, rec, device)
    return PipelineScratch(stage, cfg, mesh, rec, device, tp_group=mesh["tp"].get_group() if cfg.tp > 1 else None)
