"""What every command group shares: one sentence for bad input, output paths checked before anything runs, and
the layout flags that describe a TrainConfig."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import sys

from ..config import TrainConfig
from ..parallel import KINDS
from ..files import write_atomic
from ..measure import RunResult
from ..readable import ConfigError
from ..modeled.replay import check_run
from ..values import Kind, ReadableFile, json_value
from ..parallel.context_parallel import ATTENTIONS
from ..parallel.schedule_table import SCHEDULES


class ProgressBar:
    """A one-line bar on a terminal; a line per tenth of the work otherwise. Call it with what is done of the
    total and a line of text: ``bar(3, 20, "loss 2.1")`` shows "step  3/20  loss 2.1"."""

    def __init__(self, stream=None, unit: str = "step"):
        self.stream = stream or sys.stderr
        self.tty, self.unit = self.stream.isatty(), unit

    def __call__(self, done: int, total: int, text: str) -> None:
        line = f"{self.unit} {done:>{len(str(total))}}/{total}  {text}"
        if self.tty:
            width = 24
            filled = round(width * done / total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {line}")
            if done == total:
                self.stream.write("\n")
        elif done == total or done % max(1, total // 10) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


def _saved_run(text: str) -> RunResult:
    found = json_value(text)
    if not isinstance(found, dict):
        raise ValueError(f"a saved run is a JSON object, not {type(found).__name__}")
    try:
        run = RunResult.from_dict(found)
    except TypeError:  # from_dict names none of the fields it lacks
        missing = [f.name for f in dataclasses.fields(RunResult) if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and f.name not in found]
        raise ValueError(f"it lacks {', '.join(missing)}") from None
    return check_run(run)


SAVED_RUN = ReadableFile(_saved_run, "a run saved with 'gpucourse train --json FILE'")


class UsageError(Exception):
    """Bad command-line input; the message is one sentence."""


class DefaultsSaid(argparse.HelpFormatter):
    """``--help`` says each flag's default: "(default: X)" after a flag's help that does not say it already. Switches
    (off unless given) and flags without a default are left as they are."""

    def _get_help_string(self, action):
        text = action.help or ""
        quiet = (argparse.SUPPRESS, None, False, [], ())
        if (action.option_strings and action.default not in quiet and "default" not in text.lower()
                and not isinstance(action, (argparse._StoreConstAction, argparse._StoreTrueAction,
                                            argparse._StoreFalseAction, argparse._HelpAction))):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse, but a wrong flag gets one sentence (``gpucourse plan: error: ...``), not the whole usage; a flag is
    never taken for the start of a longer one (``--tp`` is not ``--tpot-ms``), and one that is not known is answered
    with the flags that were perhaps meant. ``--help`` says every flag's default."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False  # every subcommand's parser is made by this class too
        kwargs.setdefault("formatter_class", DefaultsSaid)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_sentence(message)} (see '{self.prog} --help').\n")

    def _get_value(self, action, text):
        # A kind of value (gpucourse.values) checks the text itself and names the flag in its sentence, which
        # reads as every other refused value does (gpucourse: error: ..., status 2), not as a misspelt flag.
        if isinstance(action.type, Kind):
            try:
                return action.type.from_text(text, action.option_strings[0] if action.option_strings else "")
            except ConfigError as e:
                raise UsageError(str(e)) from None
        return super()._get_value(action, text)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            leaf = chosen(self, namespace)
            leaf.error(leaf.unknown(extras))
        return namespace

    def unknown(self, extras: list[str]) -> str:
        """The sentence for words this parser does not take: a flag with the flags perhaps meant, or a word."""
        flags = [s for a in self._actions for s in a.option_strings]
        for word in extras:
            if word.startswith("-") and len(word) > 1:
                flag = word.split("=", 1)[0]
                near = [f for f in flags if f.startswith(flag)]
                near += [f for f in difflib.get_close_matches(flag, flags, n=3, cutoff=0.7) if f not in near]
                nearest = f"; the nearest: {', '.join(near[:3])}" if near else ""
                return f"{flag} is not a flag of {self.prog}{nearest}"
        return f"{self.prog} does not take {extras[0]!r}"


def chosen(parser: argparse.ArgumentParser, namespace) -> argparse.ArgumentParser:
    """The subcommand's parser that ``namespace`` was parsed by (``gpucourse workshop start``'s for that command)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(namespace, action.dest, None) in action.choices:
            return chosen(action.choices[getattr(namespace, action.dest)], namespace)
    return parser


def _sentence(message: str) -> str:
    """argparse's own messages as a sentence in the course's words (without the final full stop)."""
    message = message.rstrip(".")
    found = re.fullmatch(r"argument ([^:]+): (.*)", message, re.S)
    if not found:
        return message
    flag, what = found.group(1).split("/")[0], found.group(2)
    choice = re.fullmatch(r"invalid choice: (.*) \(choose from (.*)\)", what, re.S)
    if choice:
        names = [n.strip("'") for n in choice.group(2).split(", ")]
        near = difflib.get_close_matches(choice.group(1).strip("'"), names, n=2, cutoff=0.6)
        said = f"{flag} {choice.group(1)}" if flag.startswith("-") else choice.group(1)
        return f"{said} is not one of {', '.join(names)}" + (f" (did you mean {' or '.join(near)}?)" if near else "")
    wanted = re.fullmatch(r"expected (one|\d+) arguments?", what)
    if wanted:
        return f"{flag} needs {'a value' if wanted.group(1) == 'one' else wanted.group(1) + ' values'}"
    invalid = re.fullmatch(r"invalid (\w+) value: (.*)", what, re.S)
    if invalid:
        return f"{flag} {invalid.group(2)} must be {'a whole number' if invalid.group(1) == 'int' else 'a number'}"
    if what.startswith("ignored explicit argument"):
        return f"{flag} takes no value"
    other = re.fullmatch(r"not allowed with argument (.*)", what)
    if other:
        return f"{flag} cannot be given with {other.group(1).split('/')[0]}"
    return f"{flag}: {what}"


def check_writable(path: str, flag: str) -> None:
    """Refuse an output path we could not write, before anything runs."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path} cannot be written: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path} cannot be written: permission denied.")


def _records_listed(name: str) -> str:
    """What a flag's help adds from the strategies' records: the schedules and context-parallel attentions there are."""
    if name == "schedule":
        return ": " + ", ".join(SCHEDULES)
    if name == "cp_algo":
        return ": " + "; ".join(f"{key} ({a.summary})" for key, a in ATTENTIONS.items())
    return ""


def _flag_type(annotation: str):
    """int, float or str from a field's annotation ("int", "float | None", "str | None"...)."""
    for name, kind in (("int", int), ("float", float)):
        if name in annotation.replace(" ", "").split("|"):
            return kind
    return str


def add_layout_args(p: argparse.ArgumentParser, train: bool = False, changed: dict | None = None) -> None:
    """A flag for each :class:`TrainConfig` field, derived from the field's tag and help (config.py): the
    model, the layout and the run options; ``train`` adds those only ``gpucourse train`` takes (save, resume,
    profile, memory snapshot). ``changed``: a field's flag made otherwise (its type, default or help) where a
    command reads it otherwise, as ``memory --serve`` reads --precision as the weights' format."""
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        if "help" not in meta or (meta.get("train_only") and not train):
            continue
        spec = {k: meta[k] for k in ("choices", "nargs", "const", "metavar") if k in meta}
        flag, help_ = meta.get("flag", "--" + f.name.replace("_", "-")), meta["help"] + _records_listed(f.name)
        if isinstance(f.default, bool) and "nargs" not in spec:
            # A switch: "--sequence-parallel" turns it on; a field on by default is turned off ("--no-record").
            p.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true", help=help_)
        else:
            spec = {"type": meta.get("allowed") or KINDS.get(f.name) or _flag_type(f.type), "default": meta.get("cli_default", f.default),
                    "help": help_, **spec, **(changed or {}).get(f.name, {})}
            p.add_argument(flag, dest=f.name, **spec)


def layout_flags(cfg: TrainConfig, train: bool = False) -> list[str]:
    """The flags of :func:`add_layout_args` that describe ``cfg``: one for each field that differs from its default,
    in the fields' order (how ``gpucourse submit`` writes a run into its batch script)."""
    flags = []
    for f in dataclasses.fields(TrainConfig):
        meta, value = f.metadata, getattr(cfg, f.name)
        if "help" not in meta or (meta.get("train_only") and not train) or value == f.default:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        if isinstance(f.default, bool) and "nargs" not in meta:
            flags.append(flag)  # a switch: given, it turns the field from its default
        else:
            flags += [flag, str(meta["const"] if value is True else value)]
    return flags


def config_from(args) -> TrainConfig:
    """The TrainConfig the flags describe (flags a subcommand lacks keep their defaults)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if "schedule" in given:
        if given["schedule"] is None:
            del given["schedule"]
        elif given.get("pp", 1) == 1:  # a schedule orders a pipeline: without one it would change nothing
            raise UsageError(f"--schedule {given['schedule']} orders a pipeline's stages; give --pp 2 or more with it.")
    return TrainConfig(**given)


def write_json(path: str | None, data) -> None:
    if path:
        write_atomic(path, json.dumps(data, indent=1, default=str))
        print(f"  written to {path}")
