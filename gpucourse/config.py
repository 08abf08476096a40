"""One run, described by one plain dataclass.

A run is a *layout* (pp · dp · cp · tp ranks) plus the usual training knobs. The same
config drives a notebook cell, the ``gpucourse train`` command and the grader. A config is
data: it imports neither the strategies nor the runtime. :meth:`TrainConfig.validate` checks
its values alone; :func:`gpucourse.parallel.check` adds each strategy's own rules, and every
place that runs or plans a layout calls it, so a bad one is refused *before* any process
starts, with one sentence that names the broken constraint. Precision ``"auto"`` stays
``"auto"`` here: it is resolved where the device is planned (:func:`gpucourse.platforms.resolve`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field

from .model import MODELS, GPTConfig
from .readable import ConfigError
from .values import (NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE, POSITIVE_NUMBER, PROBABILITY, RANKS, SEED, Name,
                     among, whole)

__all__ = ["ConfigError", "TrainConfig"]

IMPLS = ("scratch", "torch", "accelerate")
PRECISIONS = ("fp32", "bf16", "fp16")
AUTO_PRECISION = "auto"  # the half precision the ranks compute natively: chosen where the device is planned
DEVICES = ("auto", "cpu", "cuda")

def setting(default, help: str, **flag):
    """A field that says what the run computes (the model, its batch, precision, optimisation): a resume keeps it.

    ``help`` is what ``gpucourse train --FIELD`` says; ``flag`` holds argparse's choices, nargs or metavar where
    the plain type of the default is not enough, and ``allowed`` the kind of value allowed (:mod:`gpucourse.values`), which
    both the flag and :meth:`TrainConfig.validate` check. The CLI derives each field's flag from these
    (``cli.common``)."""
    return field(default=default, metadata={"kind": "training", "help": help, **flag})


def layout(default, help: str, **flag):
    """A field that says how the computation is laid out on ranks: a checkpoint resumes at another value of it,
    since every layout equals one device."""
    return field(default=default, metadata={"kind": "layout", "help": help, **flag})


def run_option(default, help: str, train_only: bool = False, **flag):
    """A field that says how long or where a run goes, or what it records: never what it computes.
    ``train_only``: a flag of ``gpucourse train`` alone (saving, resuming, profiling), not of the planning commands."""
    return field(default=default, metadata={"kind": "run", "help": help, "train_only": train_only, **flag})


@functools.lru_cache(maxsize=None)  # a planner sizing thousands of layouts asks hundreds of thousands of times
def allowed(name: str):
    """The kind of value (:mod:`gpucourse.values`) :class:`TrainConfig`'s field ``name`` takes."""
    return next(f.metadata["allowed"] for f in dataclasses.fields(TrainConfig) if f.name == name)


@functools.lru_cache(maxsize=1)
def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(TrainConfig))


def fields_of(kind: str) -> tuple[str, ...]:
    """The names of :class:`TrainConfig`'s fields of one ``kind``: "layout", "run", or "training" (what the run
    computes — the model, its batch, precision and optimisation — which a resume keeps)."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("kind", "training") == kind)


@dataclass
class TrainConfig:
    """Everything that defines one training run.

    ``batch_size`` is the *global* batch per optimizer step, in sequences:
    microbatch × grad_accum × dp. Keeping it fixed while changing the layout keeps
    the optimisation the same, which is why every layout can be compared with the
    single-device run.
    """

    model: str = setting("tiny", "model size: " + ", ".join(MODELS), allowed=Name(MODELS))
    dp: int = layout(1, "data-parallel degree", allowed=RANKS)
    tp: int = layout(1, "tensor-parallel degree", allowed=RANKS)
    pp: int = layout(1, "pipeline-parallel degree (stages)", allowed=RANKS)
    cp: int = layout(1, "context-parallel degree: seq_len / cp tokens of every sequence per rank", allowed=RANKS)
    zero: int = layout(0, "ZeRO stage 0-3", allowed=among((0, 1, 2, 3), "a ZeRO stage: 0, 1, 2 or 3"))
    # The schedules and attentions are the strategies' records: parallel.KINDS names them, parallel.check checks them.
    schedule: str = layout("1f1b", "pipeline schedule (with --pp > 1; default 1f1b)", cli_default=None)
    virtual_stages: int = layout(2, "interleaved-1f1b: model chunks per pipeline rank", allowed=POSITIVE)
    microbatches: int = layout(1, "pipeline microbatches per step", allowed=POSITIVE)
    grad_accum: int = layout(1, "gradient-accumulation microbatches", allowed=POSITIVE)
    precision: str = setting("fp32", "fp32, bf16, fp16 (autocast unless --master-weights) or auto: bf16 where the GPUs "
                                     "compute it natively (and on CPU ranks), else fp16 with the loss scaler",
                             allowed=Name(PRECISIONS + (AUTO_PRECISION,)))
    master_weights: bool = setting(False, "half-precision weights and gradients, fp32 master copy in the optimizer")
    # Activation recomputation: False / "none", "selective" (attention's scores, softmax, dropout and weighted sum
    # recomputed in backward, as Megatron-LM's selective recomputation), True / "full" (every block's forward).
    checkpoint_activations: bool | str = layout(
        False, "recompute activations in backward instead of keeping them: full (alone: every block's) or "
               "selective (attention's scores, softmax and weighted sum only)",
        nargs="?", const="full", choices=("none", "selective", "full"), cli_default="none")
    sequence_parallel: bool = layout(
        False, "with --tp: keep seq_len / tp tokens per rank between sub-layers (LayerNorm, residual)")
    cp_algo: str = layout("ring", "context-parallel attention")  # how it meets the others' keys
    zigzag: bool = layout(False, "context parallel: 2·cp chunks, rank i holding i and 2·cp-1-i (causal load balance)")
    # Mixture of experts (model.MoE): E experts per MoE block; None keeps the model's own setting.
    moe_experts: int = setting(0, "mixture of experts: E expert MLPs in place of each MoE block's MLP (0: dense)",
                               allowed=whole(0, 1024, why="the course model holds every expert's weights"))
    moe_top_k: int | None = setting(None, "mixture of experts: experts per token (2)", allowed=POSITIVE)
    moe_every: int | None = setting(None, "mixture of experts in every block (1) or every n-th block (n)",
                                    allowed=POSITIVE)
    moe_capacity: float | None = setting(
        None, "capacity factor: an expert takes at most c·tokens·top_k/E choices (default: no dropping)",
        allowed=POSITIVE_NUMBER)
    moe_aux: float | None = setting(None, "weight of the load-balancing loss (0.01)", allowed=NON_NEGATIVE_NUMBER)
    # Not a layout field yet: a resume does not spread a checkpoint's experts over another ep.
    ep: int = setting(1, "expert-parallel degree: experts spread over ep dp ranks", allowed=RANKS)
    impl: str = layout("scratch", "scratch (gpucourse's own), torch (PyTorch's) or accelerate (Hugging Face "
                                  "Accelerate)", allowed=Name(IMPLS))
    bucket_mb: float | None = layout(
        None, "data parallel: gradient bucket size in MB, all-reduced during backward (default: scratch all-reduces "
              "after backward, PyTorch's DDP takes 25 MB)", allowed=POSITIVE_NUMBER)
    steps: int = run_option(20, "optimizer steps", allowed=POSITIVE)
    batch_size: int = setting(8, "global batch per optimizer step, in sequences (= microbatch × grad_accum × dp)",
                              allowed=POSITIVE)
    seq_len: int = setting(64, "tokens per sequence", allowed=POSITIVE)
    lr: float = setting(3e-3, "learning rate (AdamW)", allowed=POSITIVE_NUMBER)
    seed: int = setting(0, "seed for weights and data order", allowed=SEED)
    dropout: float = setting(0.0, "dropout probability", allowed=PROBABILITY)
    attention: str = layout("flash", "flash (fused: no T × T scores kept) or math (the scores written out and kept, "
                                     "as before FlashAttention)", choices=("flash", "math"))
    device: str = run_option("auto", "auto, cpu or cuda", allowed=Name(DEVICES))
    record: bool = run_option(True, "record timeline spans", flag="--no-record")
    # A planted fault for profiling practice: its peers wait for the slow rank in their next collective.
    straggler: str | None = run_option(
        None, "plant a straggler: that rank loses MS milliseconds every step, as a slow device would",
        metavar="RANK:MS")
    profile: str | None = run_option(
        None, "write a torch.profiler Chrome trace per rank (DIR/rankN.trace.json) and print where each rank's time "
              "went: compute, communication, idle", train_only=True, metavar="DIR")
    memory_snapshot: str | None = run_option(
        None, "on GPUs: record every CUDA allocation of each rank and write DIR/rankN.memory.pickle at the end (also "
              "after an out-of-memory error), to open in https://pytorch.org/memory_viz", train_only=True,
        metavar="DIR")
    save: str | None = run_option(None, "save distributed checkpoints into DIR (DIR/step-NNNNNN)", train_only=True,
                                  metavar="DIR")
    save_every: int = run_option(0, "with --save: a checkpoint every N steps, and one at the end (default 0: only at "
                                    "the end)", train_only=True, metavar="N", allowed=NON_NEGATIVE)
    resume: str | None = run_option(
        None, "go on from the newest complete checkpoint in DIR (same model and settings; the layout and --steps "
              "may change); if DIR is also --save and holds none yet, start from step 0", train_only=True,
        metavar="DIR")
    overrides: dict = field(default_factory=dict)  # GPTConfig fields changed from the model's; no flag

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
        """Every field by name, as :func:`dataclasses.asdict` gives them (containers copied, not shared)."""
        return {name: copy.deepcopy(value) if isinstance(value, (dict, list, tuple)) else value
                for name, value in ((name, getattr(self, name)) for name in _field_names())}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the first constraint this config's values break, each field's and
        those between fields (the batch splits into dp × grad_accum, the sequence fits the model); the strategies'
        own rules are :func:`gpucourse.parallel.check`'s, which calls this first."""
        for f in dataclasses.fields(self):  # each field's kind of value, as its flag checks it
            kind, value = f.metadata.get("allowed"), getattr(self, f.name)
            if kind is not None and not (value is None and f.default is None):
                kind.check(value, f.name)
        RANKS.check(self.world_size, "pp × dp × cp × tp")  # each may be allowed and their product not
        if self.straggler is not None:
            self.straggler_delay()  # refused here, in one sentence, if it does not parse or names no rank
        mc = self.model_config()
        if self.seq_len > mc.block_size:
            raise ConfigError(f"seq_len={self.seq_len} is longer than model {self.model!r}'s "
                              f"block_size={mc.block_size}.")
        per_step = self.dp * self.grad_accum
        if self.batch_size % per_step:
            raise ConfigError(f"batch_size={self.batch_size} must be divisible by grad_accum × dp = "
                              f"{self.grad_accum} × {self.dp} = {per_step}.")
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

    def kind(self) -> str:
        """The layout's name in the ``--list`` table (``single``, ``dp``, ``zero1``, ``dp×tp``...)."""
        names = [n for n, d in (("dp", self.dp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))
                 if d > 1]
        if self.zero:
            names = [f"zero{self.zero}"] + [n for n in names if n != "dp"]
        moe = "+moe" if self.moe_experts and self.ep == 1 else ""
        return "×".join(names) + ("+sp" if self.sequence_parallel else "") + moe if names else "single" + moe


def train_command(changes: dict) -> str:
    """The ``gpucourse train`` command line for a config that differs from the defaults by ``changes``."""
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in changes.items() if v is not False]
    return " ".join(["gpucourse train", *flags])
