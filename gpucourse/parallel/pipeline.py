"""Pipeline parallelism: each rank holds a few consecutive blocks, and microbatches flow through.

The model is cut by depth into ``pp`` *stages* — stage 0 also holds the
embeddings, the last stage the final LayerNorm and the head. The batch is cut
into ``m`` microbatches. A microbatch's forward runs stage after stage, each
sending its output activation (microbatch × seq_len × n_embd) to the next; its
backward runs the other way, each stage sending the gradient of its input back.
In *what order* each stage does its forwards, backwards, sends and receives is
the schedule — plain data from ``schedules.py`` that :class:`PipelineSchedule`
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
own parameters; the optimizer step is the usual one, per stage. The schedule is
only the trainer's loop: whatever data parallelism the trainer does (all-reduce,
buckets, ZeRO) then runs over the stage's own data-parallel group, and with
tp > 1 the stage's blocks are also split between tp ranks (``tensor_parallel.py``).

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
from ..readable import ConfigError
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
        blocks = blocks_of(model)  # a model without blocks is refused before anything moves
        self.first, self.last = stage == 0, stage == pp - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
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


class PipelineSchedule:
    """One stage's op list from ``schedules.py``, executed op by op: the loop of a pipeline-parallel trainer.

    A trainer calls it in place of the microbatch loop (``Trainer(..., loop=...)``);
    its data-parallel sync and optimizer step then run on this stage's gradients.
    """

    def __init__(self, pp_group, schedule: str, microbatches: int, hidden: int):
        self.pp_group = pp_group
        self.stage, pp, self.m = dist.get_rank(pp_group), dist.get_world_size(pp_group), microbatches
        # Neighbours as global ranks: the same dp and tp index, one stage up or down.
        self.prev = dist.get_global_rank(pp_group, self.stage - 1) if self.stage > 0 else None
        self.next = dist.get_global_rank(pp_group, self.stage + 1) if self.stage < pp - 1 else None
        self.ops = build(schedule, pp, microbatches)[self.stage]
        self.last_backward = max(i for i, op in enumerate(self.ops) if op.kind == B)
        self.hidden = hidden

    def __call__(self, trainer: Trainer, x: torch.Tensor, y: torch.Tensor):
        """This stage's part of one step; returns the loss on the last stage, None on the others.

        With gradient accumulation the schedule runs ``grad_accum`` times, one after
        the other, on parts of the batch; gradients add up and data parallelism
        communicates during the very last backward only.
        """
        parts = trainer.grad_accum
        losses = [self._schedule(trainer, px, py, part, parts)
                  for part, (px, py) in enumerate(zip(x.chunk(parts), y.chunk(parts)))]
        return sum(losses) if self.next is None else None

    def _schedule(self, trainer: Trainer, x: torch.Tensor, y: torch.Tensor, part: int, parts: int):
        model, rec = trainer.model, trainer.rec
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        first = part * self.m  # microbatches are numbered across the parts of the step
        # Every activation has the same, known shape: no shape exchange is needed.
        shape = (xs[0].shape[0], x.shape[1], self.hidden)
        inputs, outputs, grads = {}, {}, {}  # per microbatch: received input, output (or loss), output grad
        loss = torch.zeros((), device=x.device) if self.next is None else None
        for n, op in enumerate(self.ops):
            i = op.microbatch
            mb = first + i  # the microbatch's number in the step (timeline, activations)
            if op.kind == RECV_F:
                inputs[i] = self._recv(shape, x.device, self.prev, f"recv activation {i}").requires_grad_()
            elif op.kind == F:
                with rec.span("forward", microbatch=mb), rec.activations.forward(mb):
                    out = model(xs[i] if self.prev is None else inputs[i])
                    if self.next is None:
                        # Each microbatch's mean loss / (m · parts): the gradients add up to those of the mean.
                        out = loss_fn(out, ys[i]) / (self.m * parts)
                        loss += out.detach()
                outputs[i] = out
            elif op.kind == SEND_F:
                comm.send(outputs[i].detach(), self.next, group=self.pp_group, name=f"send activation {i}")
            elif op.kind == RECV_B:
                grads[i] = self._recv(shape, x.device, self.next, f"recv gradient {i}")
            elif op.kind == B:
                # Data parallelism may communicate during the last backward only (its buckets).
                last = n == self.last_backward and part == parts - 1
                with trainer.accumulating(last=last), rec.span("backward", microbatch=mb):
                    # pop: once backward has run, this microbatch's activations can be freed.
                    torch.autograd.backward(outputs.pop(i), grads.pop(i, None))
                rec.activations.release(mb)
            elif op.kind == SEND_B:
                comm.send(inputs.pop(i).grad, self.prev, group=self.pp_group, name=f"send gradient {i}")
        return loss

    def _recv(self, shape, device, src: int, name: str) -> torch.Tensor:
        buf = torch.empty(shape, device=device)
        comm.recv(buf, src, group=self.pp_group, name=name)
        return buf


class TorchPipelineSchedule:
    """The same stages under ``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``.

    Like :class:`PipelineSchedule`, it is a trainer's loop.

    Loss scaling: the schedule calls its ``loss_fn`` on each microbatch; here that
    is the microbatch's mean loss divided by m · grad_accum, so that the summed
    gradients are those of the mean, as in scratch (``scale_grads=False``: torch
    would otherwise divide every accumulated gradient by m at the end of each
    ``step``). The losses it hands back are those scaled means; their sum is the
    step's loss. With gradient accumulation ``step`` runs once per part of the batch.

    Measuring: torch sends with its own batched ``isend``/``irecv``, not through
    ``gpucourse.comm``; ``train_worker`` counts those at the dispatcher
    (``comm.counting``): per step the same activations and gradients scratch
    sends, plus, on the first step only, a few hundred bytes of handshake (tensor
    metadata, a warm-up vote) with each neighbour. The stage's
    ``forward_one_chunk`` / ``backward_one_chunk`` are wrapped to record spans.
    """

    def __init__(self, pp_group, schedule: str, microbatches: int, device):
        self.pp_group, self.schedule_name, self.m, self.device = pp_group, schedule, microbatches, device
        self.stage, self.pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self.schedule = None
        self.first_microbatch = 0  # microbatches are numbered across the accumulated parts of a step

    def _build(self, trainer: Trainer) -> None:
        # Built from the trainer's model as data parallelism left it: PipelineStage itself
        # holds DDP's all-reduce (no_sync) and FSDP's reduce-scatter to the last microbatch.
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        from .schedule_table import get

        pipe = PipelineStage(trainer.model, self.stage, self.pp, self.device, group=self.pp_group)
        for name, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            setattr(pipe, name, _spanning(getattr(pipe, name), trainer.rec, kind, lambda: self.first_microbatch))
        schedule_class = getattr(pipelining, get(self.schedule_name).torch_class)
        scale = self.m * trainer.grad_accum
        self.schedule = schedule_class(pipe, n_microbatches=self.m, loss_fn=lambda out, y: loss_fn(out, y) / scale,
                                       scale_grads=False)

    def __call__(self, trainer: Trainer, x: torch.Tensor, y: torch.Tensor):
        """This stage's part of one step; returns the loss on the last stage, None on the others."""
        if self.schedule is None:
            self._build(trainer)
        losses: list[torch.Tensor] = []
        for n, (px, py) in enumerate(zip(x.chunk(trainer.grad_accum), y.chunk(trainer.grad_accum))):
            self.first_microbatch, part = n * self.m, []  # (step() empties the list it is given)
            # The first stage feeds tokens, the last compares with targets; the middle ones receive.
            self.schedule.step(*([px] if self.first else []), **({"target": py, "losses": part} if self.last else {}))
            losses += part
        return torch.stack(losses).sum().detach() if self.last else None


def _spanning(method, rec, kind: str, first_microbatch):
    """Wrap ``forward_one_chunk`` / ``backward_one_chunk`` (first argument: microbatch) in a span."""
    @functools.wraps(method)
    def wrapper(chunk_id, *args, **kwargs):
        with rec.span(kind, microbatch=first_microbatch() + chunk_id):
            return method(chunk_id, *args, **kwargs)
    return wrapper


def pipeline_extras(mesh, schedule: str, microbatches: int, virtual_stages: int = 2) -> dict:
    """What every rank can say about the whole run: each stage's ops, and which stage each rank runs."""
    from . import schedules_virtual

    ranks = mesh.mesh  # (pp, dp, cp, tp) tensor of global ranks
    pp = ranks.shape[0]
    ops = build(schedule, pp, microbatches) if schedule not in schedules_virtual.SCHEDULES else \
        schedules_virtual.build(schedule, pp, microbatches, virtual_stages)[0]
    return {"schedule": [[str(op) for op in row] for row in ops],
            "stage_of_rank": {str(int(r)): s for s in range(pp) for r in ranks[s].flatten()}}


def merge_stages(pp_group, state: dict) -> dict:
    """Every stage's state dict, gathered to every rank of ``pp_group`` and merged in stage order.

    ``torch.distributed`` directly, not ``gpucourse.comm``: exporting is not training traffic.
    """
    gathered: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, cpu_state_dict(state), group=pp_group)
    return {k: v for part in gathered for k, v in part.items()}


# --- how the engine applies it ---------------------------------------------------------------------------------------

def apply(model, mesh, cfg, built):
    """The one-chunk schedules: ``model`` becomes this rank's stage (its blocks; the embedding on the first, the
    head on the last) and the step loop becomes the schedule's, on the pp slice of ``mesh``.
    What the engine needs later goes into ``built`` (``parallel.Built``)."""
    from .schedule_table import get

    if cfg.pp == 1 or get(cfg.schedule).virtual:
        return model
    pp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    built.gathers.append(functools.partial(merge_stages, pp_group))
    built.extras.update(pipeline_extras(mesh, cfg.schedule, cfg.microbatches, cfg.virtual_stages))
    built.loop = TorchPipelineSchedule(pp_group, cfg.schedule, cfg.microbatches, built.device) \
        if cfg.impl == "torch" else PipelineSchedule(pp_group, cfg.schedule, cfg.microbatches, cfg.model_config().n_embd)
    return GPTStage(model, pp_rank, cfg.pp)


# --- its rules -----------------------------------------------------------------------------------------------------

def check(cfg, mc, runnable: bool = True) -> None:
    """What pipeline parallelism and its schedules refuse, one sentence each (a schedule's own needs are in its
    record, :mod:`.schedule_table`)."""
    from .schedule_table import SCHEDULES

    if cfg.pp > mc.n_layer:
        raise ConfigError(f"pp={cfg.pp} is more than the {mc.n_layer} blocks of model {cfg.model!r}; "
                          f"each stage needs at least one block.")
    record = SCHEDULES[cfg.schedule]
    if record.virtual:
        _check_chunked(cfg, mc, runnable, record)
    if cfg.pp > 1:
        per_part = cfg.batch_size // (cfg.dp * cfg.grad_accum)  # a pipeline runs its schedule once per part
        if per_part % cfg.microbatches:
            part = "rank" if cfg.grad_accum == 1 else "rank's accumulated part"
            raise ConfigError(f"microbatches={cfg.microbatches} must divide the batch of each data-parallel "
                              f"{part}, batch_size / (dp × grad_accum) = {per_part} sequences.")
    elif cfg.microbatches != 1:
        raise ConfigError("microbatches=M splits the batch between pipeline stages and needs pp > 1; "
                          "on one stage use grad_accum to split it.")
    if runnable and cfg.impl == "torch" and cfg.pp > 1:
        if record.torch_class is None and not record.virtual:
            raise ConfigError(f"torch.distributed.pipelining has no {cfg.schedule!r} schedule; use gpipe or 1f1b, "
                              "or impl='scratch'.")
        if record.torch_class == "Schedule1F1B" and cfg.microbatches < cfg.pp:
            raise ConfigError(f"torch's Schedule1F1B needs microbatches >= pp ({cfg.microbatches} < {cfg.pp}); "
                              f"use more microbatches, gpipe, or impl='scratch'.")


def _check_chunked(cfg, mc, runnable: bool, record) -> None:
    """The schedules with several chunks a rank or a split backward (``pipeline_virtual.py`` runs them)."""
    from .schedule_table import SCHEDULES

    if cfg.pp == 1:
        raise ConfigError(f"schedule={cfg.schedule!r} is a pipeline schedule; it needs pp > 1.")
    problem = record.problem(cfg.pp, cfg.microbatches, cfg.virtual_stages)
    if problem:
        raise ConfigError(problem)
    v = record.chunks_per_rank(cfg.virtual_stages)
    if cfg.pp * v > mc.n_layer:
        raise ConfigError(f"{cfg.schedule} cuts the model into pp × {v} = {cfg.pp * v} chunks, more than the "
                          f"{mc.n_layer} blocks of model {cfg.model!r}.")
    if not runnable:
        return
    if cfg.impl == "torch" and record.torch_class is None:
        others = [s.name for s in SCHEDULES.values() if s.torch_class and s.virtual]
        raise ConfigError(f"torch.distributed.pipelining has no {cfg.schedule} schedule ({record.summary}); "
                          f"with impl='torch' use {', '.join(others)}, or impl='scratch'.")
    if cfg.impl == "torch" and (cfg.dp > 1 or cfg.tp > 1 or cfg.zero or cfg.grad_accum > 1):
        raise ConfigError(f"schedule={cfg.schedule!r} with impl='torch' runs the pipeline alone in this build "
                          f"(dp=1, tp=1, zero=0, grad_accum=1); the scratch engine composes it.")
    if cfg.impl == "accelerate":
        raise ConfigError(f"schedule={cfg.schedule!r} runs with impl='scratch' or 'torch'.")
    if cfg.zero == 3 or cfg.bucket_mb is not None or cfg.cp > 1 or cfg.moe_experts \
            or cfg.checkpoint_activations or cfg.precision != "fp32":
        raise ConfigError(f"schedule={cfg.schedule!r} runs with data parallelism (ZeRO 1 or 2 too) and "
                          f"tensor parallelism in fp32 in this build; not with zero=3, buckets, cp, a mixture "
                          f"of experts, activation checkpointing or half precision.")
