"""What the grader learns from a submission's source before running any of it.

A file that is missing or does not parse scores 0, with the reason. So does one
that hands the work to the course's own answers — the reference strategies in
``gpucourse.parallel``, the grader's helpers in ``gpucourse.grading``, or the
``solutions`` folder — found by reading the code (its syntax tree), not by
running it. ``import torch.distributed`` is, of course, fine; so are the few
names of ``gpucourse.parallel.schedules`` that describe the op format and
check a schedule (``Op``, the op kinds, ``validate``, ``simulate``, ``gantt``),
and of ``gpucourse.parallel.schedules_virtual`` the layout of virtual stages, the
transfers and the checkers (``Layout``, ``with_transfers``, ``check``,
``validate``, ``simulate``).

This is the early, readable refusal (it names the line); the wall is the
sandbox (:mod:`gpucourse.grading.sandbox`), whose audit hook refuses at run
time whatever this misses: an import built out of strings, a file read by path.
"""

from __future__ import annotations

import ast
import os

REFERENCE_MODULES = ("gpucourse.parallel", "gpucourse.grading", "solutions")
# Tools and vocabulary, not answers: a learner may import these by name.
_SCHEDULE_TOOLS = {"Op", "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "KINDS", "PEER", "PARTNER",
                   "ScheduleError", "Simulation", "validate", "simulate", "gantt"}
ALLOWED_NAMES = {
    "gpucourse.parallel.schedules": _SCHEDULE_TOOLS,
    # The layout of virtual stages, the transfers around a compute order, and the checker and simulator of
    # such schedules (exercise 13); the op vocabulary it re-exports too.
    "gpucourse.parallel.schedules_virtual": _SCHEDULE_TOOLS | {"Layout", "with_transfers", "check"},
}
_IMPORTERS = {"import_module", "__import__", "run_path", "run_module", "spec_from_file_location",
              "SourceFileLoader", "exec", "open", "append", "insert"}


def _reference(module: str) -> str | None:
    for ref in REFERENCE_MODULES:
        if module == ref or module.startswith(ref + "."):
            return ref
    return None


def _string_names_reference(text: str) -> bool:
    parts = text.replace("\\", "/").replace(".py", "").replace("/", ".").split(".")
    dotted = ".".join(p for p in parts if p)
    return _reference(dotted) is not None or "solutions" in parts or "gpucourse.parallel" in dotted \
        or "gpucourse.grading" in dotted


def find_reference_use(tree: ast.AST) -> list[str]:
    """Sentences naming each place where ``tree`` reaches for the course's reference code."""
    found = []

    def say(node, what):
        found.append(f"line {node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _reference(alias.name):
                    say(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: no package to resolve against, judge by the names
                if any(_string_names_reference(n) for n in [base] + [a.name for a in node.names] if n):
                    say(node, f"from {'.' * node.level}{base} import ...")
                continue
            allowed = ALLOWED_NAMES.get(base)

            def refused(name: str) -> bool:
                if allowed is not None:
                    return name not in allowed
                full = f"{base}.{name}"
                return bool(_reference(base) or (_reference(full) and full not in ALLOWED_NAMES))

            bad = [a.name for a in node.names if refused(a.name)]
            if bad:
                say(node, f"from {base} import {', '.join(bad)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if _reference(f"{node.value.id}.{node.attr}"):
                say(node, f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _IMPORTERS:
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                            and _string_names_reference(arg.value):
                        say(node, f"{name}({arg.value!r})")
    return sorted(set(found), key=lambda s: int(s.split(":")[0].split()[1]))


def inspect(path: str, module: str) -> str | None:
    """None if ``path`` may be run; otherwise why the exercise scores 0 (one paragraph)."""
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        near = sorted(f for f in os.listdir(folder) if f.startswith(module[:4]) and f.endswith(".py")) \
            if os.path.isdir(folder) else []
        also = f" (found {', '.join(near)}: the grader looks for {module}.py)" if near else ""
        return f"{path} is missing{also}."
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        line = (e.text or "").rstrip()
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        return f"{os.path.basename(path)} does not parse: SyntaxError at {where}: {e.msg}" + \
            (f"\n    {line}" if line else "")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{path} cannot be read: {e}"
    uses = find_reference_use(tree)
    if uses:
        return (f"{os.path.basename(path)} uses the course's own reference code ({'; '.join(uses)}). "
                f"The exercise is to write it yourself, so it scores 0; compare with the reference in a "
                f"notebook instead, and hand in your own code.")
    return None
