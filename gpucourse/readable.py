"""Readable output: byte counts in words, and errors shown as what went wrong rather than as a wall of traceback.

IPython asks an exception for ``_render_traceback_()`` before it formats the
stack; the errors gpucourse raises for a learner's input or code (a config that
cannot run, a rank that raised, a group that hung) answer with their message
alone: the sentence that says what to change, and for a failed rank the
traceback of that rank's own code. Outside IPython nothing changes.
"""

from __future__ import annotations

RED, BOLD, RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"

DECIMAL = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))
BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def byte_unit(largest: float, binary: bool = False) -> tuple[float, str]:
    """A divisor and unit that keep ``largest`` bytes between 1 and 1000 (or 1024): ``(1e6, "MB")``."""
    for scale, unit in (BINARY if binary else DECIMAL):
        if largest >= scale:
            return scale, unit
    return 1.0, "B"


def human_bytes(n: float, binary: bool = False) -> str:
    """``1234567`` -> ``'1.23 MB'``; whole numbers stay whole: ``65536, binary=True`` -> ``'64 KiB'``.

    Decimal units (powers of 1000) are what bandwidths and disks are quoted in;
    binary units (powers of 1024) are what memory and message sizes come in.
    """
    scale, unit = byte_unit(abs(n), binary)
    value = n / scale
    if unit == "B" or value == round(value):
        return f"{value:.0f} {unit}"
    return f"{value:.2f} {unit}"


class Readable:
    """Mixin: IPython shows ``Name: message`` and nothing of gpucourse's own frames."""

    def _render_traceback_(self) -> list[str]:
        first, *rest = str(self).splitlines() or [""]
        return [f"{RED}{BOLD}{type(self).__name__}{RESET}: {first}", *rest]


class ConfigError(Readable, ValueError):
    """A config that cannot run; the message is one sentence saying why. (Here, not in :mod:`gpucourse.config`,
    so that a strategy can refuse a setting without importing the config that names it.)"""
