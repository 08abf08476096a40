"""The ``gpucourse`` command: the same runtime as the notebooks, from a terminal.

Every subcommand checks its input before any rank starts; bad input gets one
sentence on stderr and exit status 2, and no file is half-written.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..config import ConfigError
from ..runtime.launcher import LaunchError, LaunchTimeout, WorkerError
from . import course, jobs, planning, serving, tools, train
from .common import Parser, UsageError, config_from

__all__ = ["UsageError", "build_parser", "config_from", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gpucourse", description="Run, watch and check distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (train, jobs, planning, serving, tools, course):  # each command group adds its own subcommands
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpucourse`` console script."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (ConfigError, LaunchError, UsageError) as e:
        print(f"gpucourse: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"gpucourse: {e}", file=sys.stderr)
        return 1
    except LaunchTimeout as e:
        print(f"gpucourse: timeout: {e}", file=sys.stderr)
        if e.waiting:
            from ..runtime.collective_status import diagnose_hang

            print(f"gpucourse: diagnosis: {diagnose_hang(e.waiting)}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("gpucourse: interrupted; every rank was stopped.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output piped into a reader that stopped reading (| head): no more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, when Python flushes
        return 141


if __name__ == "__main__":
    sys.exit(main())
