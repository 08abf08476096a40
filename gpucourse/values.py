"""What a value a learner gives may be, and the one sentence that refuses one that is not.

A command-line flag and a notebook's call take the same values, so each kind of value is said once, here: how
text becomes it, and what is allowed. A value that is not allowed is refused in one sentence naming where it was
given, the value, and what is allowed — the flag and the text on the command line, the argument in Python:

    --burst 0 must be at least 1.
    batch_size=-4 must be at least 1.
    --gpu 'h900' is not one of a100, h100, h200, b200, l4 (did you mean h100 or h200?).

``gpucourse.cli.common`` turns each kind into an argparse ``type``; the functions notebooks call check their
arguments with :meth:`Kind.check`. Physical bounds are part of a kind where they exist (a fraction of peak is at
most 1); bounds between values (a prompt no longer than the model's context) are checked where both are known.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import shlex
from typing import Callable, Iterable

from .readable import ConfigError


def subject(name: str, value) -> str:
    """How a refusal names what it refuses: ``--flag text`` on the command line (a positional argument: the text
    alone, ``name`` empty), ``name=value`` in Python."""
    if not name:
        return shlex.quote(str(value)) if str(value) else "''"
    if name.startswith("-"):
        if isinstance(value, (tuple, list)):  # a flag of several values: as they were typed
            return f"{name} {' '.join(shlex.quote(str(v)) for v in value)}"
        text = value if isinstance(value, str) else str(value)
        return f"{name} {shlex.quote(text) if text else repr(text)}"
    return f"{name}={value!r}"


def refuse(name: str, value, problem: str) -> ConfigError:
    """The one sentence that refuses ``value`` given as ``name``: ``problem`` says what is wrong or allowed."""
    return ConfigError(f"{subject(name, value)} {problem}.")


def _number(text: str) -> float:
    return float(text.strip().replace("_", ""))


class Kind:
    """A kind of value: ``parse`` turns text into it (ValueError if the text is not one), ``problem`` says what is
    wrong with a value (None when it is allowed)."""

    def __init__(self, what: str, parse: Callable[[str], object], problem: Callable[[object], str | None]):
        self.what, self._parse, self._problem = what, parse, problem

    def __repr__(self) -> str:
        return f"Kind({self.what})"

    def problem(self, value) -> str | None:
        return self._problem(value)

    def check(self, value, name: str):
        """``value`` if it is allowed, else :class:`ConfigError` in one sentence naming ``name``."""
        problem = self._problem(value)
        if problem:
            raise refuse(name, value, problem)
        return value

    def __call__(self, text: str):
        """As an argparse ``type`` of a parser other than gpucourse's, which names the flag itself."""
        return self.from_text(text, "the value")

    def from_text(self, text: str, name: str):
        """The value ``text`` stands for, checked; refused in one sentence naming ``name`` (a flag)."""
        try:
            value = self._parse(text)
        except (ValueError, TypeError, OverflowError):
            raise refuse(name, text, f"must be {self.what}") from None
        problem = self._problem(value)
        if problem:
            raise refuse(name, text, problem)
        return value


def whole(least: int | None = None, most: int | None = None, why: str = "") -> Kind:
    """A whole number from ``least`` to ``most`` (either may be open); ``why`` says where the top comes from."""
    if least is not None and most is not None:
        span = f" from {least} to {most}"
    else:
        span = f" of at least {least}" if least is not None else f" of at most {most}" if most is not None else ""
    what = "a whole number" + span
    reason = f" ({why})" if why else ""

    def problem(value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return f"must be {what}"
        if least is not None and value < least:
            return f"must be at least {least}"
        if most is not None and value > most:
            return f"must be at most {most}{reason}"
        return None

    return Kind(what, lambda text: int(text.strip().replace("_", "")), problem)


def among(allowed: tuple[int, ...], what: str) -> Kind:
    """A whole number among ``allowed``, which ``what`` names ("a ZeRO stage: 0, 1, 2 or 3")."""
    def problem(value) -> str | None:
        ok = not isinstance(value, bool) and isinstance(value, numbers.Integral) and value in allowed
        return None if ok else f"must be {what}"

    return Kind(what, lambda text: int(text.strip()), problem)


def number(above: float | None = None, least: float | None = None, most: float | None = None,
           below: float | None = None, why: str = "") -> Kind:
    """A finite number, above ``above`` (or from ``least``) and up to ``most`` (or below ``below``)."""
    parts = [f"more than {above:g}" if above is not None else f"of at least {least:g}" if least is not None else "",
             f"at most {most:g}" if most is not None else f"below {below:g}" if below is not None else ""]
    what = "a finite number" + (" " + " and ".join(p for p in parts if p) if any(parts) else "")

    def problem(value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return f"must be {what}"
        if above is not None and not value > above:
            return f"must be more than {above:g}"
        if least is not None and value < least:
            return f"must be at least {least:g}"
        if most is not None and value > most:
            return f"must be at most {most:g}" + (f" ({why})" if why else "")
        if below is not None and not value < below:
            return f"must be below {below:g}" + (f" ({why})" if why else "")
        return None

    return Kind(what, _number, problem)


class Name(Kind):
    """One of the names ``known`` (a callable where the names can change, as the GPU table's can); ``fold``
    normalises a name before it is looked up (``str.lower`` where any case will do)."""

    def __init__(self, known: Callable[[], Iterable[str]] | Iterable[str], fold: Callable[[str], str] = str,
                 unknown: str = "is not one of {names}"):
        self._known = known if callable(known) else (lambda names=tuple(known): names)
        self._says = unknown  # the refusal: {names} lists the names known, {near} (or the end) those nearest
        super().__init__("a known name", fold, self._unknown)

    def names(self) -> list[str]:
        return list(self._known())

    def _unknown(self, value) -> str | None:
        names = self.names()
        if isinstance(value, str) and self._parse(value) in names:
            return None
        near = difflib.get_close_matches(self._parse(value), names, n=2, cutoff=0.6) if isinstance(value, str) else []
        near = f" (did you mean {' or '.join(near)}?)" if near else ""
        return self._says.format(names=", ".join(names), near=near) + ("" if "{near}" in self._says else near)

    def check(self, value, name: str):
        problem = self._unknown(value)
        if problem:
            raise ConfigError(f"{name} {value!r} {problem}." if name.startswith("-") else
                              f"{subject(name, value)} {problem}.")
        return self._parse(value)

    def from_text(self, text: str, name: str) -> str:
        return self.check(text, name)


class ReadableFile(Kind):
    """A file whose text ``parse`` turns into a value: a path that is no file or cannot be read, or whose text is not
    ``what``, is refused, saying which. ``parse`` raises ValueError, TypeError or KeyError with the reason the text
    is not ``what``."""

    def __init__(self, parse: Callable[[str], object], what: str):
        super().__init__(what, parse, lambda value: None)

    def from_text(self, text: str, name: str):
        try:
            with open(text, encoding="utf-8") as f:
                content = f.read()
        except IsADirectoryError:
            raise refuse(name, text, f"is a folder; give {self.what}") from None
        except FileNotFoundError:
            raise refuse(name, text, f"does not exist; give {self.what}") from None
        except (OSError, ValueError) as e:  # unreadable, or not text at all
            raise refuse(name, text, f"cannot be read as {self.what} ({getattr(e, 'strerror', None) or e})") from None
        try:
            return self._parse(content)
        except (ValueError, TypeError, KeyError) as e:
            raise refuse(name, text, f"is not {self.what}: {str(e).rstrip('.')}") from None
        except RecursionError:
            raise refuse(name, text, f"is not {self.what}: it nests too deeply") from None


def json_value(text: str):
    """``text`` as JSON, or ValueError saying where it is not (for a :class:`ReadableFile`'s ``parse``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        why = "it is empty" if not text.strip() else f"it is not JSON ({e.msg} at line {e.lineno})"
        raise ValueError(why) from None


def ordered(pair, name: str) -> tuple:
    """A (least, most) pair whose first is not above its second."""
    low, high = pair
    if low > high:
        raise refuse(name, tuple(pair), "must go from the smaller to the larger")
    return tuple(pair)


# The kinds the commands and the notebooks' functions share.
POSITIVE = whole(least=1)
NON_NEGATIVE = whole(least=0)
SEED = whole(least=0, most=2**32 - 1, why="what every random generator takes")
POSITIVE_NUMBER = number(above=0)
NON_NEGATIVE_NUMBER = number(least=0)
FRACTION = number(above=0, most=1, why="a share of the whole")
PROBABILITY = number(least=0, below=1, why="a probability that drops everything would train nothing")
# Bounds a planner's loops and a layout's ranks run into: past them no machine or model is, and the work grows.
RANKS = whole(least=1, most=1 << 20, why="more GPUs than any cluster holds")
GPUS_PER_NODE = whole(least=1, most=1024, why="more than any server or NVLink domain holds")
TOKENS = whole(least=1, most=1 << 24, why="longer than any model's context")
SEQUENCES = whole(least=1, most=1 << 24, why="more sequences than any run's batch")
