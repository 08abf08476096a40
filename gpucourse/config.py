"""One run, described by one plain dataclass.

A run is a *layout* (pp · dp · cp · tp ranks) plus the usual training knobs. The same
config drives a notebook cell, the ``gpucourse train`` command and the grader, and
:meth:`TrainConfig.validate` refuses a bad one *before* any process starts, with
one sentence that names the broken constraint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .model import MODELS, GPTConfig
from .readable import ConfigError

__all__ = ["ConfigError", "TrainConfig"]

IMPLS = ("scratch", "torch", "accelerate")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")  # what backward recomputes (checkpoint_activations)
ATTENTION = ("flash", "math")              # how attention computes (model.GPTConfig.attention)


def layout(default):
    """A field that says how the computation is laid out on ranks: a checkpoint resumes at another value of it,
    since every layout equals one device."""
    return field(default=default, metadata={"kind": "layout"})


def run_option(default):
    """A field that says how long or where a run goes, or what it records: never what it computes."""
    return field(default=default, metadata={"kind": "run"})


def fields_of(kind: str) -> tuple[str, ...]:
    """The names of :class:`TrainConfig`'s fields of one ``kind``: "layout", "run", or "training" (untagged:
    what the run computes — the model, its batch, precision and optimisation — which a resume keeps)."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("kind", "training") == kind)


@dataclass
class TrainConfig:
    """Everything that defines one training run.

    ``batch_size`` is the *global* batch per optimizer step, in sequences:
    microbatch × grad_accum × dp. Keeping it fixed while changing the layout keeps
    the optimisation the same, which is why every layout can be compared with the
    single-device run.
    """

    model: str = "tiny"
    dp: int = layout(1)
    tp: int = layout(1)
    pp: int = layout(1)
    cp: int = layout(1)  # context parallel: each rank holds seq_len / cp tokens of every sequence
    zero: int = layout(0)
    schedule: str = layout("1f1b")
    virtual_stages: int = layout(2)  # interleaved-1f1b: model chunks per pipeline rank
    microbatches: int = layout(1)
    grad_accum: int = layout(1)
    precision: str = "fp32"
    master_weights: bool = False
    # Activation recomputation: False / "none", "selective" (attention's scores, softmax, dropout and weighted sum
    # recomputed in backward, as Megatron-LM's selective recomputation), True / "full" (every block's forward).
    checkpoint_activations: bool | str = layout(False)
    sequence_parallel: bool = layout(False)  # with tp: activations between sub-layers cut along the sequence
    # How context-parallel attention meets the other ranks' keys: ring, allgather, ulysses.
    cp_algo: str = layout("ring")
    zigzag: bool = layout(False)  # context parallel: 2·cp chunks, rank i holding i and 2·cp-1-i (causal balance)
    # Mixture of experts (model.MoE): E experts per MoE block; None keeps the model's own setting.
    moe_experts: int = 0
    moe_top_k: int | None = None      # experts per token (2)
    moe_every: int | None = None      # an MoE in every block (1) or every n-th (n)
    moe_capacity: float | None = None  # capacity factor; None: no token dropped
    moe_aux: float | None = None      # weight of the load-balancing loss (0.01)
    # Expert parallel: experts spread over ep of the dp ranks (ep divides dp). Not a layout field yet: a resume
    # does not spread a checkpoint's experts over another ep.
    ep: int = 1
    impl: str = layout("scratch")
    bucket_mb: float | None = layout(None)
    steps: int = run_option(20)
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    dropout: float = 0.0
    attention: str = layout("flash")  # "flash" (fused, no scores kept) or "math" (T × T scores kept): model.py
    device: str = run_option("auto")
    record: bool = run_option(True)
    # A planted fault for profiling practice: "RANK:MS" slows that rank by MS milliseconds every step, as a
    # slow or throttled device would; its peers wait for it in their next collective.
    straggler: str | None = run_option(None)
    # Run options that are not part of the optimisation: where to write a
    # torch.profiler trace per rank, and where to save / resume checkpoints.
    profile: str | None = run_option(None)
    memory_snapshot: str | None = run_option(None)  # a folder for a CUDA memory snapshot per rank (CUDA only)
    save: str | None = run_option(None)
    save_every: int = run_option(0)
    resume: str | None = run_option(None)
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        # One spelling each for "no recomputation" and "every block": False and True, as before there were three.
        self.checkpoint_activations = {"none": False, "full": True}.get(self.checkpoint_activations,
                                                                         self.checkpoint_activations)

    @property
    def recompute(self) -> str:
        """What backward recomputes: "none", "selective" (attention's core) or "full" (every block)."""
        return {False: "none", True: "full"}.get(self.checkpoint_activations, self.checkpoint_activations)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def microbatch_size(self) -> int:
        """Sequences in one forward/backward on one data-parallel rank."""
        return self.batch_size // (self.dp * self.grad_accum)

    def layout(self) -> str:
        """A short name for the layout, e.g. ``dp2`` or ``single``."""
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp),
                                         ("pp", self.pp)) if v > 1]
        return "×".join(parts) or "single"

    def model_config(self) -> GPTConfig:
        """The GPT size this run trains, with ``overrides`` and dropout applied."""
        base = MODELS[self.model]
        moe = {name: value for name, value in (("moe_experts", self.moe_experts), ("moe_top_k", self.moe_top_k),
                                               ("moe_every", self.moe_every), ("moe_capacity", self.moe_capacity),
                                               ("moe_aux", self.moe_aux)) if value is not None}
        return dataclasses.replace(base, **{"dropout": self.dropout, "attention": self.attention, **moe,
                                            **self.overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self, runnable: bool = True) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the first constraint this config breaks.

        ``runnable=False`` checks only that the layout makes sense (for estimates
        on paper), not that this build can train it.
        """
        for name in ("dp", "tp", "pp", "cp", "ep", "grad_accum", "microbatches", "steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a whole number of at least 1.")
        if self.model not in MODELS:
            raise ConfigError(f"model={self.model!r} is not one of {', '.join(MODELS)}.")
        if self.straggler is not None:
            self.straggler_delay()  # refused here, in one sentence, if it does not parse or names no rank
        if self.impl not in IMPLS:
            raise ConfigError(f"impl={self.impl!r} is not one of {', '.join(IMPLS)}.")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}.")
        from .parallel.schedule_table import SCHEDULES  # each schedule's record (what it needs, what runs it)

        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero={self.zero!r} must be a ZeRO stage: 0, 1, 2 or 3.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be at least 0 and below 1.")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"checkpoint_activations={self.checkpoint_activations!r} is not one of "
                              f"{', '.join(RECOMPUTE)} (or False / True).")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention={self.attention!r} is not one of {', '.join(ATTENTION)}.")
        if self.attention == "math" and self.precision != "fp32" and not self.master_weights:
            raise ConfigError(f"attention='math' under autocast keeps its scores in whatever precision the device's "
                              f"autocast lists give softmax (fp32 on CUDA, {self.precision} on CPU); run it in fp32 "
                              f"or with master_weights, where the scores' precision is the weights'.")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be positive.")
        mc = self.model_config()
        if self.seq_len > mc.block_size:
            raise ConfigError(f"seq_len={self.seq_len} is longer than model {self.model!r}'s "
                              f"block_size={mc.block_size}.")
        if self.tp > 1:
            if mc.n_head % self.tp:
                raise ConfigError(f"tp={self.tp} must divide n_head={mc.n_head} of model {self.model!r}: "
                                  f"each rank holds whole attention heads.")
            if (4 * mc.n_embd) % self.tp:
                raise ConfigError(f"tp={self.tp} must divide the MLP width 4 × n_embd = {4 * mc.n_embd}.")
        if self.pp > mc.n_layer:
            raise ConfigError(f"pp={self.pp} is more than the {mc.n_layer} blocks of model {self.model!r}; "
                              f"each stage needs at least one block.")
        per_step = self.dp * self.grad_accum
        if self.batch_size % per_step:
            raise ConfigError(f"batch_size={self.batch_size} must be divisible by grad_accum × dp = "
                              f"{self.grad_accum} × {self.dp} = {per_step}.")
        if self.cp > 1 or self.zigzag:
            self._check_context_parallel(mc)
        if SCHEDULES[self.schedule].virtual:
            self._check_virtual_schedule(mc, runnable)
        self._check_experts(mc, runnable)
        if self.sequence_parallel:
            if self.tp == 1:
                raise ConfigError("sequence_parallel cuts tensor parallelism's replicated activations along the "
                                  "sequence; it needs tp > 1.")
            local = self.seq_len // self.cp  # the tokens a context-parallel rank holds
            if local % self.tp:
                held = f"seq_len={self.seq_len}" if self.cp == 1 else f"seq_len / cp = {local}"
                raise ConfigError(f"{held} must divide by tp={self.tp} under sequence parallelism: each rank "
                                  f"keeps 1/tp of its tokens between sub-layers.")
        if self.pp > 1:
            per_part = self.batch_size // per_step  # a pipeline runs its schedule once per accumulated part
            if per_part % self.microbatches:
                part = "rank" if self.grad_accum == 1 else "rank's accumulated part"
                raise ConfigError(f"microbatches={self.microbatches} must divide the batch of each data-parallel "
                                  f"{part}, batch_size / (dp × grad_accum) = {per_part} sequences.")
        elif self.microbatches != 1:
            raise ConfigError("microbatches=M splits the batch between pipeline stages and needs pp > 1; "
                              "on one stage use grad_accum to split it.")
        if self.master_weights and self.precision == "fp32":
            raise ConfigError("master_weights keeps an fp32 copy of half-precision weights; "
                              "choose precision bf16 or fp16 with it.")
        if self.bucket_mb is not None:
            if not self.bucket_mb > 0:
                raise ConfigError(f"bucket_mb={self.bucket_mb} must be a positive number of megabytes.")
            if self.dp * self.cp == 1 or self.zero or self.impl == "accelerate":
                raise ConfigError("bucket_mb sets the gradient buckets of plain data parallelism "
                                  "(dp × cp > 1, zero=0, impl scratch or torch).")
        if runnable:
            self._check_supported()
        return self

    def _check_supported(self) -> None:
        if self.precision != "fp32" and (self.tp > 1 or self.pp > 1 or self.impl == "accelerate"
                                         or (self.zero and self.impl != "scratch")):
            raise ConfigError(f"precision={self.precision} runs with single, data-parallel and scratch ZeRO "
                              f"layouts in this build, not {self.kind()} with impl={self.impl!r}.")
        if self.master_weights and self.impl == "torch" and self.zero:
            raise ConfigError("master_weights with impl='torch' is offered for DDP only (zero=0).")
        if self.zero == 1 and self.impl == "torch" and (self.tp > 1 or self.pp > 1):
            raise ConfigError("torch's ZeRO-1 (ZeroRedundancyOptimizer) runs with data parallelism alone (tp=1, pp=1); "
                              "use zero=2 or 3 (FSDP2), or impl='scratch'.")
        if self.impl == "torch" and self.tp > 1 and self.dp > 1 and not self.zero:
            if not has_replicate():
                raise ConfigError(f"data parallelism over DTensor (tensor-parallel) parameters needs PyTorch's "
                                  f"composable replicate, which torch {_torch_version()} lacks; use zero=2 or 3 "
                                  f"(FSDP2), or impl='scratch'.")
            if self.bucket_mb is not None:
                raise ConfigError("bucket_mb sets DistributedDataParallel's buckets; with DTensor tensor parallelism "
                                  "data parallelism is PyTorch's replicate, which all-reduces block by block.")
        if self.impl == "torch":
            if self.pp > 1 and self.schedule == "naive":
                raise ConfigError("torch.distributed.pipelining has no 'naive' schedule; use gpipe or 1f1b, "
                                  "or impl='scratch'.")
            if self.pp > 1 and self.schedule == "1f1b" and self.microbatches < self.pp:
                raise ConfigError(f"torch's Schedule1F1B needs microbatches >= pp ({self.microbatches} < {self.pp}); "
                                  f"use more microbatches, gpipe, or impl='scratch'.")
        if self.impl == "accelerate":
            if self.tp > 1 or self.pp > 1:
                raise ConfigError("impl='accelerate' runs data parallelism only (tp=1, pp=1).")
            if self.zero not in (0, 3):
                raise ConfigError(f"impl='accelerate' offers DDP (zero=0) and FSDP (zero=3), not zero={self.zero}.")

    def _check_virtual_schedule(self, mc, runnable: bool) -> None:
        if self.pp == 1:
            raise ConfigError(f"schedule={self.schedule!r} is a pipeline schedule; it needs pp > 1.")
        from .parallel.schedule_table import SCHEDULES, get

        record = get(self.schedule)
        problem = record.problem(self.pp, self.microbatches, self.virtual_stages)
        if problem:
            raise ConfigError(problem)
        v = record.chunks_per_rank(self.virtual_stages)
        if self.pp * v > mc.n_layer:
            raise ConfigError(f"{self.schedule} cuts the model into pp × {v} = {self.pp * v} chunks, more than the "
                              f"{mc.n_layer} blocks of model {self.model!r}.")
        if not runnable:
            return
        if self.impl == "torch" and record.torch_class is None:
            others = [s.name for s in SCHEDULES.values() if s.torch_class and s.virtual]
            raise ConfigError(f"torch.distributed.pipelining has no {self.schedule} schedule ({record.summary}); "
                              f"with impl='torch' use {', '.join(others)}, or impl='scratch'.")
        if self.impl == "torch" and (self.dp > 1 or self.tp > 1 or self.zero or self.grad_accum > 1):
            raise ConfigError(f"schedule={self.schedule!r} with impl='torch' runs the pipeline alone in this build "
                              f"(dp=1, tp=1, zero=0, grad_accum=1); the scratch engine composes it.")
        if self.impl == "accelerate":
            raise ConfigError(f"schedule={self.schedule!r} runs with impl='scratch' or 'torch'.")
        if self.zero == 3 or self.bucket_mb is not None or self.cp > 1 or self.moe_experts \
                or self.checkpoint_activations or self.precision != "fp32":
            raise ConfigError(f"schedule={self.schedule!r} runs with data parallelism (ZeRO 1 or 2 too) and "
                              f"tensor parallelism in fp32 in this build; not with zero=3, buckets, cp, a mixture "
                              f"of experts, activation checkpointing or half precision.")

    def _check_context_parallel(self, mc) -> None:
        from .parallel.context_parallel import ALGORITHMS

        if self.cp_algo not in ALGORITHMS:
            raise ConfigError(f"cp_algo={self.cp_algo!r} is not one of {', '.join(ALGORITHMS)}.")
        if self.cp == 1:
            raise ConfigError("zigzag orders the tokens of context-parallel ranks; it needs cp > 1.")
        chunks = 2 * self.cp if self.zigzag else self.cp
        if self.seq_len % chunks:
            split = f"2 × cp = {chunks} zig-zag chunks" if self.zigzag else f"cp = {chunks} chunks"
            raise ConfigError(f"seq_len={self.seq_len} must divide into {split} of equal length.")
        heads = mc.n_head // self.tp
        if self.cp_algo == "ulysses" and heads % self.cp:
            raise ConfigError(f"ulysses gives each of cp={self.cp} ranks whole heads: cp must divide the "
                              f"{heads} heads each tensor-parallel rank holds (n_head={mc.n_head}, tp={self.tp}).")
        if self.dropout:
            raise ConfigError(f"dropout={self.dropout} inside context-parallel attention is not written: "
                              f"use dropout=0 with cp > 1.")
        if self.attention != "flash":
            raise ConfigError(f"attention={self.attention!r} is one device's kernel; with cp > 1 attention is "
                              f"context parallelism's own ({self.cp_algo}): leave attention='flash'.")
        if self.recompute == "selective":
            raise ConfigError("selective recomputation with cp > 1 is not written: recomputing context-parallel "
                              "attention would run its communication again in backward; use 'full' or none.")
        if self.impl == "torch":
            self._check_torch_context_parallel()
        elif self.impl != "scratch":
            raise ConfigError(f"context parallelism runs with impl='scratch' or 'torch', not impl={self.impl!r}.")

    def _check_torch_context_parallel(self) -> None:
        import torch

        from .parallel.context_parallel_torch import TORCH_ROTATE, torch_context_parallel

        if self.cp_algo not in TORCH_ROTATE:
            raise ConfigError(f"PyTorch's context parallelism is a ring ({' or '.join(TORCH_ROTATE)}); it has no "
                              f"cp_algo={self.cp_algo!r}: use impl='scratch' for it.")
        if torch_context_parallel() is None:
            raise ConfigError(f"this torch ({torch.__version__}) lacks the context-parallel ring this build uses "
                              f"(torch.distributed.tensor.experimental._context_parallel): use impl='scratch'.")

    def _check_experts(self, mc, runnable: bool) -> None:
        given = [f"moe_{n}" for n in ("top_k", "every", "capacity", "aux") if getattr(self, f"moe_{n}") is not None]
        if not isinstance(self.moe_experts, int) or isinstance(self.moe_experts, bool) or self.moe_experts < 0:
            raise ConfigError(f"moe_experts={self.moe_experts!r} must be a whole number of experts (0: none).")
        if not mc.moe_experts:
            if given:
                raise ConfigError(f"{given[0]} sets up a mixture of experts; give moe_experts (how many) with it.")
            if self.ep > 1:
                raise ConfigError(f"ep={self.ep} spreads the experts of a mixture of experts; give moe_experts "
                                  f"with it.")
            return
        E, k = mc.moe_experts, mc.moe_top_k
        if E < 2:
            raise ConfigError(f"moe_experts={E}: a mixture needs at least 2 experts.")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E:
            raise ConfigError(f"moe_top_k={k!r} must be between 1 and the {E} experts.")
        if not isinstance(mc.moe_every, int) or not 1 <= mc.moe_every <= mc.n_layer:
            raise ConfigError(f"moe_every={mc.moe_every!r} must be between 1 (every block) and the "
                              f"{mc.n_layer} blocks.")
        if self.moe_capacity is not None and not self.moe_capacity > 0:
            raise ConfigError(f"moe_capacity={self.moe_capacity} must be a positive capacity factor "
                              f"(leave it out to drop no token).")
        if self.moe_aux is not None and self.moe_aux < 0:
            raise ConfigError(f"moe_aux={self.moe_aux} must be at least 0.")
        if self.ep > 1:
            if self.dp % self.ep:
                raise ConfigError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism is carved out of "
                                  f"the data-parallel ranks.")
            if E % self.ep:
                raise ConfigError(f"ep={self.ep} must divide moe_experts={E}: each rank holds E/ep experts.")
        if runnable:
            self._check_experts_supported()

    def _check_experts_supported(self) -> None:
        if self.cp > 1:
            raise ConfigError("a mixture of experts with cp > 1 is not written: its balance loss is computed over "
                              "whole sequences, which context parallelism cuts.")
        if self.sequence_parallel:
            raise ConfigError("a mixture of experts with sequence_parallel is not written: route whole sequences "
                              "(leave sequence_parallel off).")
        if self.recompute == "full":
            raise ConfigError("checkpoint_activations with a mixture of experts is not written: recomputing a "
                              "block would route its tokens, and count them, twice.")
        if self.precision == "fp16":
            raise ConfigError("fp16's loss scaling does not scale the experts' balance loss here; use bf16 or "
                              "fp32 with a mixture of experts.")
        if self.impl != "scratch":
            raise ConfigError(f"a mixture of experts runs from scratch in this build (impl='scratch'), not "
                              f"impl={self.impl!r}: PyTorch has no mixture-of-experts layer of its own.")
        if self.ep > 1 and self.zero == 3:
            raise ConfigError("ep > 1 with zero=3 is not written: use zero 1 or 2 (experts get shards of their "
                              "own), or ep=1.")
        if self.ep > 1 and self.bucket_mb is not None:
            raise ConfigError("bucket_mb with ep > 1 is not written: experts' gradients are averaged over a "
                              "group of their own.")
        if self.ep > 1 and (self.save or self.resume):
            raise ConfigError("checkpoints of expert-parallel runs are not written yet; save with ep=1.")

    def straggler_delay(self) -> tuple[int, float] | None:
        """``straggler`` as (rank, seconds lost per step), or None."""
        if self.straggler is None:
            return None
        try:
            rank, ms = str(self.straggler).split(":")
            rank, ms = int(rank), float(ms)
        except ValueError:
            raise ConfigError(f"straggler={self.straggler!r} must look like 'RANK:MS', e.g. '2:50'.") from None
        if not 0 <= rank < self.world_size or not ms > 0:
            raise ConfigError(f"straggler={self.straggler!r}: the rank must be from 0 to {self.world_size - 1} and "
                              f"the delay a positive number of milliseconds.")
        return rank, ms / 1e3

    def validate_on(self, device: str) -> "TrainConfig":
        """The checks that depend on where the ranks run (``cpu`` or ``cuda``)."""
        if device == "cpu" and self.memory_snapshot:
            raise ConfigError("A memory snapshot records the CUDA allocator and these ranks run on the CPU: run on "
                              "GPUs, or use 'gpucourse memory' for the same parts estimated.")
        if device == "cpu" and self.impl == "accelerate" and self.zero == 3:
            raise ConfigError("Accelerate offers FSDP only on GPUs; on CPU ranks use impl='torch' with zero=3 "
                              "(the same FSDP2 it would use).")
        return self

    def describe(self) -> str:
        """What trains this layout, in a few words per strategy (``gpucourse train --list``)."""
        torch_impl = self.impl != "scratch"
        parts = []
        if self.pp > 1:
            parts.append(("torch.distributed.pipelining" if torch_impl else "pipeline")
                         + ("" if torch_impl and self.schedule in ("1f1b", "gpipe") else f", {self.schedule} schedule")
                         + (f", {self.virtual_stages} chunks per rank" if self.chooses_chunks() else ""))
        if self.tp > 1:
            parts.append("DTensor tensor parallel" if torch_impl else "Megatron-style column/row parallel")
            if self.sequence_parallel:
                parts.append("sequence parallel")
        if self.cp > 1:
            moved = "all-to-all hops" if self.cp_algo == "ring" else "one all-gather"
            algo = f"PyTorch's ring, K/V by {moved}" if torch_impl else f"{self.cp_algo} attention"
            parts.append(f"context parallel, {algo}{' (zig-zag)' if self.zigzag else ''}")
        if self.ep > 1:
            parts.append(f"expert parallel, {self.moe_experts // self.ep} of {self.moe_experts} experts per rank "
                         f"(all-to-all dispatch)")
        elif self.moe_experts:
            parts.append(f"mixture of {self.moe_experts} experts, replicated")
        if self.zero == 3 and self.impl == "scratch":
            parts.append("ZeRO-3 (flat shards per block, each gathered just in time)")
        elif self.zero and self.impl == "scratch":
            parts.append(f"ZeRO-{self.zero} (flat shards)")
        elif self.zero and self.impl == "torch":
            parts.append({1: "ZeroRedundancyOptimizer", 2: "FSDP2, parameters kept between forward and backward",
                          3: "FSDP2 fully_shard"}[self.zero])
        elif self.zero:
            parts.append("accelerate.Accelerator (FSDP; CUDA only)")
        elif self.dp * self.cp > 1 and self.impl == "scratch":
            parts.append("bucketed all-reduce overlapped with backward" if self.bucket_mb
                         else "one all-reduce per gradient after backward")
        elif self.dp > 1 and self.impl == "torch" and self.tp > 1:
            parts.append("replicate (DDP on FSDP2's machinery, for DTensor parameters)")
        elif self.dp > 1:
            parts.append("DistributedDataParallel" if self.impl == "torch" else "accelerate.Accelerator (DDP)")
        return " + ".join(parts) or "one device, the baseline"

    def kind(self) -> str:
        """The layout's name in the ``--list`` table (``single``, ``dp``, ``zero1``, ``dp×tp``...)."""
        names = [n for n, d in (("dp", self.dp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))
                 if d > 1]
        if self.zero:
            names = [f"zero{self.zero}"] + [n for n in names if n != "dp"]
        moe = "+moe" if self.moe_experts and self.ep == 1 else ""
        return "×".join(names) + ("+sp" if self.sequence_parallel else "") + moe if names else "single" + moe

    def chooses_chunks(self) -> bool:
        """Whether this run's schedule takes its chunks per rank from ``virtual_stages`` (interleaving)."""
        from .parallel.schedule_table import get

        return self.pp > 1 and get(self.schedule).chunks == 0

    def list_name(self) -> str:
        """The layout's row name in ``--list``: :meth:`kind`, plus the schedule where the many-chunk pipeline engine
        runs it (``pp+zb-h1``); GPipe and 1F1B share the one-stage engine and its rows."""
        from .parallel.schedule_table import get

        return self.kind() + (f"+{self.schedule}" if self.pp > 1 and get(self.schedule).virtual else "")


def has_replicate() -> bool:
    """Whether this torch has the composable ``replicate`` built on FSDP2 (DDP that takes DTensor parameters)."""
    import importlib.util
    return importlib.util.find_spec("torch.distributed._composable.replicate_with_fsdp") is not None


def _torch_version() -> str:
    import torch
    return torch.__version__


# The layouts ``gpucourse train --list`` tries, each dimension at degree 2: validate() decides which run.
MESHES = [dict(), dict(dp=2), dict(tp=2), dict(pp=2), dict(dp=2, tp=2), dict(dp=2, pp=2), dict(tp=2, pp=2),
          dict(dp=2, tp=2, pp=2), dict(cp=2), dict(dp=2, cp=2)]


def supported() -> list[tuple[str, str, str, dict]]:
    """``(layout, impl, what it is, changes from the defaults)`` of each combination that ``validate()`` accepts.

    Generated by trying each mesh of :data:`MESHES` with each impl, ZeRO stage
    (where there are dp ranks to shard over) and bucket setting: the list of what
    runs comes from the same rules that refuse.
    """
    rows = []
    for mesh in MESHES:
        for impl in IMPLS if mesh else ["scratch"]:  # one device is one device, whatever the impl
            for zero in (0, 1, 2, 3) if "dp" in mesh else [0]:  # ZeRO shards over dp ranks
                for bucket_mb in (None, 1) if impl == "scratch" else [None]:  # DDP buckets by itself
                    changes = {**mesh, **({"microbatches": 2} if "pp" in mesh else {}), "zero": zero,
                               "bucket_mb": bucket_mb, "impl": impl}
                    changes = {k: v for k, v in changes.items() if v != getattr(TrainConfig, k)}
                    try:
                        cfg = TrainConfig(**changes).validate()
                    except ConfigError:
                        continue
                    rows.append((cfg.list_name(), impl, cfg.describe(), changes))
        if mesh in (dict(), dict(dp=2), dict(dp=2, tp=2), dict(dp=2, pp=2)):  # a mixture of 4 experts on it
            for ep, zero in ((1, 0), (2, 0), (2, 1), (2, 2)) if "dp" in mesh else [(1, 0)]:
                if zero and mesh != dict(dp=2):
                    continue
                changes = {**mesh, **({"microbatches": 2} if "pp" in mesh else {}), "moe_experts": 4,
                           **({"ep": ep} if ep > 1 else {}), **({"zero": zero} if zero else {})}
                cfg = TrainConfig(**changes).validate()
                rows.append((cfg.kind(), "scratch", cfg.describe(), changes))
        if mesh == dict(pp=2):  # the many-chunk engine's schedules, in each impl that runs them
            from .parallel.schedule_table import SCHEDULES

            for schedule in [name for name, record in SCHEDULES.items() if record.virtual]:
                for impl in IMPLS:
                    changes = {"pp": 2, "microbatches": 4, "schedule": schedule,
                               **({"virtual_stages": 2} if SCHEDULES[schedule].chunks == 0 else {}),
                               **({"impl": impl} if impl != "scratch" else {})}
                    try:
                        cfg = TrainConfig(**changes).validate()
                    except ConfigError:
                        continue
                    rows.append((cfg.list_name(), impl, cfg.describe(), changes))
        if mesh == dict(tp=2):  # sequence parallelism: an option of tensor parallelism, shown on its own mesh
            for impl in ("scratch", "torch"):
                changes = {"tp": 2, "sequence_parallel": True, **({"impl": impl} if impl != "scratch" else {})}
                cfg = TrainConfig(**changes).validate()
                rows.append((cfg.kind(), impl, cfg.describe(), changes))
    return rows


def supported_table() -> list[dict]:
    """Rows of what this build runs, for ``gpucourse train --list``, each with the command that trains it."""
    return [{"layout": layout, "impl": impl, "what": what, "example": train_command(changes)}
            for layout, impl, what, changes in supported()]


def train_command(changes: dict) -> str:
    """The ``gpucourse train`` command line for a config that differs from the defaults by ``changes``."""
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in changes.items() if v is not False]
    return " ".join(["gpucourse train", *flags])
