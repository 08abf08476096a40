"""Errors a learner causes, shown in a notebook as what went wrong rather than as a wall of traceback.

IPython asks an exception for ``_render_traceback_()`` before it formats the
stack; the errors gpucourse raises for a learner's input or code (a config that
cannot run, a rank that raised, a group that hung) answer with their message
alone: the sentence that says what to change, and for a failed rank the
traceback of that rank's own code. Outside IPython nothing changes.
"""

from __future__ import annotations

RED, BOLD, RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


class Readable:
    """Mixin: IPython shows ``Name: message`` and nothing of gpucourse's own frames."""

    def _render_traceback_(self) -> list[str]:
        first, *rest = str(self).splitlines() or [""]
        return [f"{RED}{BOLD}{type(self).__name__}{RESET}: {first}", *rest]
