"""Every single-point mistake in a solution: the mutants that judge whether the checks catch mistakes nobody chose.

The wrong answers in ``tests/mutants/`` are mistakes someone thought of; these are made by rule. From a solved
exercise (``solutions/exNN_*.py``) :func:`mutants` makes one file per small change to the code a learner writes,
and only there: the functions and methods whose body differs from the stub's in ``exercises/`` (a stub's body
raises NotImplementedError; exercise 10's stub is whole code with one bug) and those the stub does not have (a
solution's helpers). What the stub gives is left alone.

One change per mutant, each of one kind (:data:`OPERATORS`): an arithmetic, comparison or boolean operator
swapped, a constant moved (n to n ± 1, True to False, a float doubled or halved), an index, slice bound or
range end off by one, a statement dropped (replaced by ``pass``), two call arguments of the same kind swapped,
a keyword argument dropped (``dim=``, ``dtype=``, ``minlength=``...), ``.clone()``, ``.detach()``, a
conversion or a ``reversed``/``sorted`` removed, a dtype changed, a function swapped for its opposite
(``min``/``max``, ``sum``/``mean``...), a returned value changed. A change is made in the text of the
solution, so a mutant differs from it in one place only; one that does not parse, or whose syntax tree is the
solution's (or an earlier mutant's), is dropped. The order is the source's, so ids are the same on every run.

:func:`score_mutants` grades the mutants and puts the survivors through the differential test of
:mod:`gpucourse.grading.equivalence`; ``scripts/mutation-score`` prints and records the result (docs/mutation.md).
Making mutants imports neither torch nor the checks, and runs nothing.
"""

from __future__ import annotations

import ast
import copy
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import catalog

REPO = Path(__file__).resolve().parents[2]

OPERATORS = ("arithmetic", "comparison", "boolean", "dim", "constant", "off-by-one", "statement", "arguments",
             "keyword", "removal", "dtype", "function", "return")

_ARITHMETIC = {ast.Add: (ast.Sub,), ast.Sub: (ast.Add,), ast.Mult: (ast.Div,), ast.Div: (ast.Mult, ast.FloorDiv),
               ast.FloorDiv: (ast.Div, ast.Mult), ast.Mod: (ast.FloorDiv,), ast.Pow: (ast.Mult,),
               ast.MatMult: (ast.Mult,), ast.BitAnd: (ast.BitOr,), ast.BitOr: (ast.BitAnd,)}
_COMPARISON = {ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE), ast.Gt: (ast.GtE, ast.Lt),
               ast.GtE: (ast.Gt, ast.LtE), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.Is: (ast.IsNot,),
               ast.IsNot: (ast.Is,), ast.In: (ast.NotIn,), ast.NotIn: (ast.In,)}
# Methods and functions whose call can be taken off its value (x.clone() -> x, int(x) -> x).
_REMOVABLE_METHODS = ("clone", "detach", "contiguous", "float", "double", "half", "bfloat16", "to", "item")
_REMOVABLE_FUNCTIONS = ("reversed", "sorted", "int", "float", "bool", "list", "tuple")
# A function or method swapped for its opposite.
_OPPOSITES = {"min": "max", "max": "min", "maximum": "minimum", "minimum": "maximum", "any": "all", "all": "any",
              "zeros": "ones", "ones": "zeros", "zeros_like": "ones_like", "ones_like": "zeros_like",
              "new_zeros": "new_ones", "new_ones": "new_zeros", "sum": "mean", "mean": "sum", "amax": "amin",
              "amin": "amax", "ceil": "floor", "floor": "ceil"}
_DTYPES = {"float64": "float32", "double": "float32", "float32": "float64", "float": "float64",
           "float16": "bfloat16", "half": "bfloat16", "bfloat16": "float16", "long": "int32", "int64": "int32",
           "int32": "int64", "int": "int64"}
_DIM_KEYWORDS = ("dim", "axis", "keepdim")


@dataclass(frozen=True)
class Mutant:
    """One changed copy of a solution: ``id`` ("ex07-012"), where (``line`` of the solution), which ``operator``,
    a one-line ``description`` ("solutions/ex07_memory_estimate.py:17: a // b → a / b") and the whole ``source``."""

    id: str
    line: int
    operator: str
    description: str
    source: str


@dataclass(frozen=True)
class _Change:
    start: tuple[int, int]   # (line, column in UTF-8 bytes), as ast gives them
    end: tuple[int, int]
    text: str                # what replaces the span
    operator: str
    what: str                # "a // b → a / b"


def learner_functions(solution: str, stub: str) -> list[ast.FunctionDef]:
    """The functions and methods of ``solution`` a learner writes: those ``stub`` lacks or whose body differs
    from the stub's (docstrings aside), by qualified name ("LossScaler.update"), in source order."""
    given = {name: _body_dump(node) for name, node in _functions(ast.parse(stub))}
    return [node for name, node in _functions(ast.parse(solution)) if given.get(name) != _body_dump(node)]


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _body_dump(fn: ast.FunctionDef) -> str:
    return ast.dump(ast.Module(body=_without_docstring(fn.body), type_ignores=[]))


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def mutants(solution: str, stub: str, *, name: str = "solution.py", prefix: str = "m") -> list[Mutant]:
    """Every single-point mutant of ``solution``'s learner-written functions (see the module docstring), in
    source order; ``name`` is the file named in each description, ``prefix`` starts each id."""
    lines = solution.encode().split(b"\n")
    seen = {ast.dump(ast.parse(solution))}
    out = []
    for change in sorted(_changes(learner_functions(solution, stub)),
                         key=lambda c: (c.start, c.end, OPERATORS.index(c.operator), c.text)):
        source = _apply(lines, change)
        try:
            tree = ast.dump(ast.parse(source))
        except (SyntaxError, ValueError):
            continue
        if tree in seen:
            continue
        seen.add(tree)
        out.append(Mutant(f"{prefix}-{len(out) + 1:03d}", change.start[0], change.operator,
                          f"{name}:{change.start[0]}: {change.operator}: {change.what}", source))
    return out


def exercise_mutants(exercise: str, repo: str | Path = REPO) -> list[Mutant]:
    """The mutants of exercise ``exercise``'s solution ("ex07" or any name :func:`catalog.resolve` takes), from
    ``solutions/`` and ``exercises/`` of ``repo``; ids "ex07-001", ..."""
    ex_id, module = catalog.resolve(exercise)
    repo = Path(repo)
    solution = (repo / "solutions" / f"{module}.py").read_text(encoding="utf-8")
    stub = (repo / "exercises" / f"{module}.py").read_text(encoding="utf-8")
    return mutants(solution, stub, name=f"solutions/{module}.py", prefix=ex_id)


def _apply(lines: list[bytes], change: _Change) -> str:
    (l0, c0), (l1, c1) = change.start, change.end
    head, tail = lines[l0 - 1][:c0], lines[l1 - 1][c1:]
    return b"\n".join(lines[:l0 - 1] + [head + change.text.encode() + tail] + lines[l1:]).decode()


# --- the changes -------------------------------------------------------------------------------------------------


def _short(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _span(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    return (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)


_ATOMS = (ast.Name, ast.Attribute, ast.Subscript, ast.Call, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp,
          ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.JoinedStr)


def _text(node: ast.AST) -> str:
    """``node`` as source that can stand wherever an expression stood: parenthesized unless it is an atom."""
    text = ast.unparse(node)
    atom = isinstance(node, _ATOMS) or (isinstance(node, ast.Constant) and not (
        isinstance(node.value, (int, float)) and not isinstance(node.value, bool) and node.value < 0))
    return text if atom or isinstance(node, ast.Slice) else f"({text})"


def _replace(node: ast.AST, new: ast.AST, operator: str, what: str | None = None) -> _Change:
    start, end = _span(node)
    return _Change(start, end, _text(new), operator,
                   what or f"{_short(ast.unparse(node))} → {_short(ast.unparse(new))}")


def _changes(functions: list[ast.FunctionDef]):
    for fn in functions:
        for stmt in _without_docstring(fn.body):
            yield from _statement_changes(stmt)


def _statement_changes(stmt: ast.stmt):
    if not isinstance(stmt, ast.Pass):
        start, end = _span(stmt)
        yield _Change(start, end, "pass", "statement", f"dropped `{_short(ast.unparse(stmt).splitlines()[0])}`")
    if isinstance(stmt, ast.Return) and stmt.value is not None and not (
            isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
        yield _replace(stmt.value, ast.Constant(None), "return", f"return {_short(ast.unparse(stmt.value))} → "
                                                                 f"return None")
    if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Tuple):
        yield from _swaps(stmt.value, stmt.value.elts, "return", lambda elts: ast.Tuple(elts, ast.Load()))
    if isinstance(stmt, ast.Break):
        yield _Change(*_span(stmt), "continue", "statement", "break → continue")
    if isinstance(stmt, ast.Continue):
        yield _Change(*_span(stmt), "break", "statement", "continue → break")
    if isinstance(stmt, ast.AugAssign):
        for op in _ARITHMETIC.get(type(stmt.op), ()):
            new = copy.copy(stmt)
            new.op = op()
            yield _Change(*_span(stmt), ast.unparse(new), "arithmetic",
                          f"{_short(ast.unparse(stmt))} → {_short(ast.unparse(new))}")
    for field, value in ast.iter_fields(stmt):
        if field in ("annotation", "returns", "decorator_list", "type_comment"):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.stmt):
                yield from _statement_changes(child)
            elif isinstance(child, ast.expr):
                yield from _expression_changes(child)
            elif isinstance(child, ast.excepthandler):
                for s in child.body:
                    yield from _statement_changes(s)
            elif isinstance(child, (ast.withitem, ast.comprehension)):
                for sub in ast.iter_child_nodes(child):
                    if isinstance(sub, ast.expr):
                        yield from _expression_changes(sub)


def _expression_changes(node: ast.expr):
    if isinstance(node, ast.JoinedStr):
        return  # a message: nothing the checks grade
    yield from _own_changes(node)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.expr):
            yield from _expression_changes(child)
        elif isinstance(child, ast.comprehension):
            for sub in ast.iter_child_nodes(child):
                if isinstance(sub, ast.expr):
                    yield from _expression_changes(sub)
        elif isinstance(child, ast.keyword):
            yield from _expression_changes(child.value)
        elif isinstance(child, ast.arguments):
            continue  # a lambda's parameters


def _own_changes(node: ast.expr):
    if isinstance(node, ast.BinOp):
        for op in _ARITHMETIC.get(type(node.op), ()):
            yield _replace(node, ast.BinOp(node.left, op(), node.right), "arithmetic")
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new_op in _COMPARISON.get(type(op), ()):
                ops = list(node.ops)
                ops[i] = new_op()
                yield _replace(node, ast.Compare(node.left, ops, node.comparators), "comparison")
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield _replace(node, ast.BoolOp(other, node.values), "boolean")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
        yield _replace(node, node.operand, "boolean" if isinstance(node.op, ast.Not) else "arithmetic")
    elif isinstance(node, ast.IfExp):
        yield _replace(node, ast.IfExp(node.test, node.orelse, node.body), "boolean")
    elif isinstance(node, ast.Constant):
        yield from _constant_changes(node)
    elif isinstance(node, ast.Subscript):
        yield from _subscript_changes(node)
    elif isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in _DTYPES:
            yield _replace(node, ast.Attribute(node.value, _DTYPES[node.attr], ast.Load()), "dtype")
    elif isinstance(node, ast.Call):
        yield from _call_changes(node)


def _constant_changes(node: ast.Constant):
    value = node.value
    if isinstance(value, bool):
        yield _replace(node, ast.Constant(not value), "constant")
    elif isinstance(value, int):
        for new in (value + 1, value - 1):
            yield _replace(node, ast.Constant(new), "constant")
    elif isinstance(value, float):
        for new in ((value * 2, value / 2) if value else (1.0,)):
            yield _replace(node, ast.Constant(new), "constant")


def _shown(context: ast.AST, old: ast.AST, new: ast.AST) -> str:
    """``context`` as source with ``old`` (a node inside it) replaced by ``new``; ``context`` is left as it was."""
    for parent in ast.walk(context):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                try:
                    return ast.unparse(context)
                finally:
                    setattr(parent, field, old)
            if isinstance(value, list) and any(v is old for v in value):
                i = next(i for i, v in enumerate(value) if v is old)
                value[i] = new
                try:
                    return ast.unparse(context)
                finally:
                    value[i] = old
    return ast.unparse(new)


def _off_by_one(node: ast.expr, context: ast.AST):
    """``node`` + 1 and ``node`` - 1, unless it is a constant (whose changes :func:`_constant_changes` makes);
    described in ``context`` (the subscript or the call around it)."""
    if isinstance(node, ast.Constant) or (isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant)):
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and isinstance(node.right, ast.Constant):
        return  # n - 1 already becomes n - 0 and n - 2
    for op in (ast.Add(), ast.Sub()):
        new = ast.BinOp(node, op, ast.Constant(1))
        yield _replace(node, new, "off-by-one",
                       f"{_short(ast.unparse(context))} → {_short(_shown(context, node, new))}")


def _subscript_changes(node: ast.Subscript):
    index = node.slice
    if isinstance(index, ast.Slice):
        if index.lower is None:
            if index.upper is not None or index.step is None:
                new = ast.Slice(ast.Constant(1), index.upper, index.step)
                yield _replace(index, new, "off-by-one", f"{_short(ast.unparse(node))} → "
                                                         f"{_short(_shown(node, index, new))}")
        else:
            yield from _off_by_one(index.lower, node)
        if index.upper is not None:
            yield from _off_by_one(index.upper, node)
    elif isinstance(index, (ast.Name, ast.BinOp, ast.UnaryOp, ast.Attribute)):
        yield from _off_by_one(index, node)


def _same_kind(a: ast.expr, b: ast.expr) -> bool:
    if type(a) is not type(b) or ast.dump(a) == ast.dump(b):
        return False
    return not isinstance(a, ast.Constant) or type(a.value) is type(b.value)


def _swaps(node: ast.expr, items: list[ast.expr], operator: str, rebuild):
    for i in range(len(items) - 1):
        if _same_kind(items[i], items[i + 1]):
            swapped = list(items)
            swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
            yield _replace(node, rebuild(swapped), operator)


def _call_changes(node: ast.Call):
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name == "range":
        for arg in node.args[:2]:
            yield from _off_by_one(arg, node)
    yield from _swaps(node, node.args, "arguments", lambda args: ast.Call(func, args, node.keywords))
    for i, kw in enumerate(node.keywords):
        if kw.arg is None:
            continue
        rest = node.keywords[:i] + node.keywords[i + 1:]
        yield _replace(node, ast.Call(func, node.args, rest), "keyword",
                       f"{_short(ast.unparse(node))} → {_short(ast.unparse(ast.Call(func, node.args, rest)))}")
        if kw.arg in _DIM_KEYWORDS and isinstance(kw.value, ast.Constant):
            for change in _constant_changes(kw.value):  # the same as the constant's own, under their name
                yield _Change(change.start, change.end, change.text, "dim", f"{kw.arg}={change.what}")
    if isinstance(func, ast.Attribute) and name in _REMOVABLE_METHODS:
        yield _replace(node, func.value, "removal")
    if isinstance(func, ast.Name) and name in _REMOVABLE_FUNCTIONS and len(node.args) == 1 and not node.keywords:
        yield _replace(node, node.args[0], "removal")
    if name in _OPPOSITES:
        other = ast.Attribute(func.value, _OPPOSITES[name], ast.Load()) if isinstance(func, ast.Attribute) \
            else ast.Name(_OPPOSITES[name], ast.Load())
        yield _replace(node, ast.Call(other, node.args, node.keywords), "function")


# --- scoring the checks ------------------------------------------------------------------------------------------


def score_mutants(exercise: str, found: list[Mutant], *, seeds: tuple[int, ...] = (1,),
                  compare_seeds: tuple[int, ...] = (11, 12, 13), timeout: float | None = None) -> dict:
    """Grade each of ``found`` (mutants of ``exercise``) under ``seeds``, in one grading process; put each one
    that scores full marks through the differential test (:mod:`.equivalence`) under ``compare_seeds``. The solution
    is graded first in the same process: RuntimeError if it does not score full marks (nothing could be judged).

    A mutant is *caught* when it scores less than full marks under some seed, *equivalent* when it survives and no
    call of the differential test under any of ``compare_seeds`` tells it from the solution, and *surviving*
    otherwise; one the grader could not run is *not graded* and counts nowhere. The result: ``exercise``,
    ``total``, ``caught``, ``equivalent``, ``surviving``, ``not_graded`` (counts), ``score`` = caught / (total -
    equivalent - not graded), ``survivors`` and ``equivalents`` (each ``{"id", "description", "difference"}``),
    ``not_graded_ids``, ``caught_by`` (how many mutants each check caught), the seeds and ``time_s``.
    """
    from .runner import DEFAULT_TIMEOUT_S, compare_runs, grade_runs

    start = time.monotonic()
    ex_id, module = catalog.resolve(exercise)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    with tempfile.TemporaryDirectory(prefix="gpucourse-mutants-") as folder:
        paths = {}
        for m in found:
            paths[m.id] = os.path.join(folder, f"{m.id}.py")
            Path(paths[m.id]).write_text(m.source, encoding="utf-8")
        graded: dict[str, list[dict]] = {m.id: [] for m in found}
        runs = [(ex_id, paths[m.id], s) for m in found for s in seeds]
        # The solution first, under every seed, in the same process: a mutant is caught only where it is not.
        solution = [(ex_id, str(REPO / "solutions" / f"{module}.py"), s) for s in seeds]
        results = grade_runs(solution + runs, timeout=timeout)
        for r in results[:len(solution)]:
            if r.get("grader_error") or r["score"] < r["max_score"]:
                failed = "; ".join(f"{c['name']}: {c['message'][:200]}" for c in r["checks"] if c["status"] != "passed")
                raise RuntimeError(f"the solution of {ex_id} itself scored {r['score']}/{r['max_score']} under seed "
                                   f"{r['seed']}, so no mutant can be judged: {r.get('grader_error') or failed}")
        for (_, path, _), r in zip(runs, results[len(solution):]):
            graded[Path(path).stem].append(r)
        caught, survivors, not_graded = {}, [], []
        for m in found:
            failed = [r for r in graded[m.id] if not r.get("grader_error") and r["score"] < r["max_score"]]
            if failed:
                caught[m.id] = [c["name"] for c in failed[0]["checks"] if c["status"] != "passed"]
            elif any(r.get("grader_error") for r in graded[m.id]):
                not_graded.append(m.id)
            else:
                survivors.append(m)
        verdicts: dict[str, list[dict]] = {m.id: [] for m in survivors}
        runs = [(ex_id, paths[m.id], s) for m in survivors for s in compare_seeds]
        for (_, path, _), r in zip(runs, compare_runs(runs, timeout=timeout) if runs else []):
            verdicts[Path(path).stem].append(r)
    equivalents, surviving = [], []
    for m in survivors:
        different = [r for r in verdicts[m.id] if not r.get("equivalent")]
        entry = {"id": m.id, "description": m.description, "difference": None}
        if different:
            r = different[0]
            entry["difference"] = r.get("difference") or f"could not be compared: {r.get('grader_error')}"
            surviving.append(entry)
        else:
            equivalents.append(entry)
    judged = len(found) - len(equivalents) - len(not_graded)
    caught_by: dict[str, int] = {}
    for names in caught.values():
        for name in names:
            caught_by[name] = caught_by.get(name, 0) + 1
    return {"exercise": ex_id, "module": module, "total": len(found), "caught": len(caught),
            "equivalent": len(equivalents), "surviving": len(surviving), "not_graded": len(not_graded),
            "score": len(caught) / judged if judged else None, "survivors": surviving,
            "equivalents": equivalents, "not_graded_ids": not_graded, "caught_by": caught_by,
            "seeds": list(seeds), "compare_seeds": list(compare_seeds), "time_s": round(time.monotonic() - start, 1)}


def score(exercises: list[str] | None = None, **options) -> dict[str, dict]:
    """:func:`score_mutants` of every mutant of each of ``exercises`` (default: all), one exercise after another;
    ``options`` are its keyword arguments. Results by exercise id."""
    chosen = [catalog.resolve(e)[0] for e in exercises] if exercises else list(catalog.modules())
    return {ex_id: score_mutants(ex_id, exercise_mutants(ex_id), **options) for ex_id in chosen}
