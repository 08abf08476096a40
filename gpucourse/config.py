"""One run, described by one plain dataclass.

A run is a *layout* (dp · tp · pp ranks) plus the usual training knobs. The same
config drives a notebook cell, the ``gpucourse train`` command and the grader, and
:meth:`TrainConfig.validate` refuses a bad one *before* any process starts, with
one sentence that names the broken constraint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .model import MODELS, GPTConfig


class ConfigError(ValueError):
    """A config that cannot run; the message is one sentence saying why."""


# Which (strategy, impl) pairs this build supports. ``gpucourse train --list``
# prints this table, and validate() refuses anything outside it.
IMPLS = ("scratch", "torch")
SCHEDULES = ("naive", "gpipe", "1f1b")
PRECISIONS = ("fp32",)
SUPPORTED = {
    # layout kind -> impls that implement it
    "single": ("scratch", "torch"),
    "dp": ("scratch", "torch"),
}


@dataclass
class TrainConfig:
    """Everything that defines one training run.

    ``batch_size`` is the *global* batch per optimizer step, in sequences:
    microbatch × grad_accum × dp. Keeping it fixed while changing the layout keeps
    the optimisation the same, which is why every layout can be compared with the
    single-device run.
    """

    model: str = "tiny"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    grad_accum: int = 1
    precision: str = "fp32"
    checkpoint_activations: bool = False
    impl: str = "scratch"
    steps: int = 20
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    dropout: float = 0.0
    device: str = "auto"
    record: bool = True
    overrides: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatch_size(self) -> int:
        """Sequences in one forward/backward on one data-parallel rank."""
        return self.batch_size // (self.dp * self.grad_accum)

    def layout(self) -> str:
        """A short name for the layout, e.g. ``dp2`` or ``single``."""
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if v > 1]
        return "×".join(parts) or "single"

    def model_config(self) -> GPTConfig:
        """The GPT size this run trains, with ``overrides`` and dropout applied."""
        base = MODELS[self.model]
        return dataclasses.replace(base, dropout=self.dropout, **self.overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the first constraint this config breaks."""
        for name in ("dp", "tp", "pp", "grad_accum", "microbatches", "steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a whole number of at least 1.")
        if self.model not in MODELS:
            raise ConfigError(f"model={self.model!r} is not one of {', '.join(MODELS)}.")
        if self.impl not in IMPLS:
            raise ConfigError(f"impl={self.impl!r} is not one of {', '.join(IMPLS)}.")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)} in this build.")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be at least 0 and below 1.")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be positive.")
        kind = self.kind()
        if kind not in SUPPORTED:
            raise ConfigError(f"the layout {self.layout()} (zero={self.zero}) is not supported by this build; "
                              f"`gpucourse train --list` shows what is.")
        if self.impl not in SUPPORTED[kind]:
            raise ConfigError(f"impl={self.impl!r} does not implement the {kind} layout; it supports "
                              f"{', '.join(i for i, ks in _impls_by_kind().items() if kind in ks) or 'none'}.")
        per_step = self.dp * self.grad_accum
        if self.batch_size % per_step:
            raise ConfigError(f"batch_size={self.batch_size} must be divisible by grad_accum × dp = "
                              f"{self.grad_accum} × {self.dp} = {per_step}.")
        mc = self.model_config()
        if self.seq_len > mc.block_size:
            raise ConfigError(f"seq_len={self.seq_len} is longer than model {self.model!r}'s "
                              f"block_size={mc.block_size}.")
        return self

    def kind(self) -> str:
        """The family of strategy this layout needs (``single``, ``dp``, ...)."""
        if self.tp == 1 and self.pp == 1 and self.zero == 0:
            return "single" if self.dp == 1 else "dp"
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}-zero{self.zero}"


def _impls_by_kind() -> dict:
    out: dict = {}
    for kind, impls in SUPPORTED.items():
        for impl in impls:
            out.setdefault(impl, []).append(kind)
    return out


def supported_table() -> list[dict]:
    """Rows of what this build runs, for ``gpucourse train --list``."""
    examples = {
        "single": "gpucourse train",
        "dp": "gpucourse train --dp 2",
    }
    rows = []
    for kind, impls in SUPPORTED.items():
        for impl in impls:
            cmd = examples[kind] + ("" if impl == "scratch" else f" --impl {impl}")
            rows.append({"layout": kind, "impl": impl, "example": cmd})
    return rows
