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
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be positive.")
        mc = self.model_config()
        if self.seq_len > mc.block_size:
            raise ConfigError(f"seq_len={self.seq_len} is longer than model {self.model!r}'s "
                              f"block_size={mc.block_size}.")
        per_step = self.dp * self.grad_accum
        if self.batch_size % per_step:
            raise ConfigError(f"batch_size={self.batch_size} must be divisible by grad_accum × dp = "
                              f"{self.grad_accum} × {self.dp} = {per_step}.")
        from .parallel import check_strategies  # each strategy's own rules, in the order they apply

        check_strategies(self, mc, runnable)
        return self

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
            from .parallel.context_parallel import ATTENTIONS

            moved = {"alltoall": "all-to-all hops", "allgather": "one all-gather"}.get(
                ATTENTIONS[self.cp_algo].torch_rotate, "")
            algo = f"PyTorch's ring, K/V by {moved}" if torch_impl else f"{self.cp_algo} attention"
            parts.append(f"context parallel, {algo}{' (zig-zag)' if self.zigzag else ''}")
        if self.ep > 1:
            parts.append(f"expert parallel, {self.moe_experts // self.ep} of {self.moe_experts} experts per rank "
                         f"(all-to-all dispatch)")
        elif self.moe_experts:
            parts.append(f"mixture of {self.moe_experts} experts, replicated")
        from .parallel import DATA_PARALLEL, data_parallel_kind  # the choice parallelize makes, by its name

        kind = data_parallel_kind(self)
        if kind:
            parts.append(DATA_PARALLEL[kind].format(zero=self.zero))
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
