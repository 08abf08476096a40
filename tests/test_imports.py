"""The package's import graph is a layered DAG: no cycles, the core never imports the tools, no private names across modules.

Read from the source (every ``import`` statement, including those inside
functions, since a lazy import is still a dependency), so this runs in a
fraction of a second and names the offending line.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gpucourse"

# Each folder is a wing of the package, and each states which folders it may import (itself always). The modules at
# the top are the trainers' building blocks. The core (the top, runtime, parallel, serving and the cluster on paper,
# which a run on GPUs asks whether it fits) never imports the tools: the translations to other stacks, the course's
# own tools, grading, the quiz, the figures, the workshop, the benchmarks and the command line.
RULES = {
    "top": {"runtime", "parallel", "modeled"},
    "runtime": {"top"},
    "parallel": {"top"},
    "serving": {"top", "runtime", "parallel"},
    "modeled": {"top", "parallel", "serving"},
    "interop": {"top", "parallel", "modeled"},
    "viz": {"top", "parallel", "modeled"},
    "course": {"top", "runtime", "parallel", "modeled", "viz"},
    "grading": {"top", "runtime", "parallel", "modeled", "course"},
    "quiz": {"top", "course"},
    "workshop": {"top", "runtime", "course", "grading"},
    "bench": {"top", "runtime", "parallel", "serving", "modeled", "course", "viz", "grading", "quiz", "workshop"},
    "cli": {"top", "runtime", "parallel", "serving", "modeled", "interop", "course", "grading", "quiz", "workshop",
            "bench"},
}
CORE = ("top", "runtime", "parallel", "serving", "modeled")
TOP_MODULES_AT_MOST = 16


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name (without the ``gpucourse.`` prefix; "" for the package itself) -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The longest known module that ``name`` (dotted, project-relative) is or is inside."""
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every project import in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "gpucourse" or alias.name.startswith("gpucourse."):
                    target = _resolve(alias.name.removeprefix("gpucourse").lstrip("."))
                    out.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "gpucourse" or node.module.startswith("gpucourse.")):
                base = node.module.removeprefix("gpucourse").lstrip(".")
            else:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                if full in MODULES:  # a submodule imported by name
                    out.append((full, "", node.lineno))
                else:
                    out.append((_resolve(base), alias.name, node.lineno))
    out = [(t, n, line) for t, n, line in out if t is not None and t != module]
    # Importing ``a.b.c`` runs ``a`` and ``a.b`` (their __init__) first: the package edges, but for a package the
    # importer is inside (Python has already started it).
    packages = [(".".join(t.split(".")[:i]), "", line) for t, _, line in out for i in range(1, t.count(".") + 1)]
    inside = {".".join(module.split(".")[:i]) for i in range(module.count(".") + 2)}
    return out + [p for p in packages if p[0] not in inside and p[0] in MODULES]


GRAPH = {m: _imports(m) for m in MODULES}


def _folder(module: str) -> str:
    """The wing a module belongs to: its folder, or "top" for a module at the top (``__main__`` is the command line's
    door, and the package itself imports nothing by name)."""
    head = module.split(".")[0]
    if head == "__main__":
        return "cli"
    return head if module.count(".") or (PACKAGE / head).is_dir() else "top"


def _rule_violations(graph) -> list[str]:
    return [f"gpucourse.{m} ({_folder(m)}) imports gpucourse.{t} ({_folder(t)}), line {line}"
            for m in graph for t, _, line in graph[m]
            if _folder(t) != _folder(m) and _folder(t) not in RULES[_folder(m)]]


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def test_the_graph_was_read():
    # A parser that found nothing would pass every test below.
    assert len(MODULES) > 40
    assert {"parallel", "checkpoint", "config"} <= {t for t, _, _ in GRAPH["train"]}
    assert ("comm", "all_gather_flat", 36) in [(t, n, line) for t, n, line in GRAPH["course.bandwidth"]]


def test_no_import_cycles():
    cycles = _cycles()
    detail = []
    for component in cycles:
        edges = sorted({f"{m} -> {t} (line {line})" for m in component for t, _, line in GRAPH[m] if t in component})
        detail.append("; ".join(edges))
    assert not cycles, "import cycles: " + " | ".join(detail)


def test_every_module_belongs_to_a_wing_with_a_rule():
    assert not [m for m in MODULES if m and _folder(m) not in RULES]
    top = sorted(m for m in MODULES if m and _folder(m) in ("top", "cli") and "." not in m
                 and not (PACKAGE / m).is_dir())
    assert len(top) + 1 <= TOP_MODULES_AT_MOST, f"{len(top) + 1} modules at the top (with __init__): {top}"


def test_each_folder_imports_only_the_folders_its_rule_allows():
    bad = _rule_violations(GRAPH)
    assert not bad, "\n".join(bad)


def test_the_core_never_imports_the_tools():
    """Read from the rules: a core folder's rule names core folders only, so no edge from the core reaches a tool."""
    assert not {f: RULES[f] - set(CORE) for f in CORE if RULES[f] - set(CORE)}


def test_a_planted_import_against_the_rules_is_found():
    planted = {**GRAPH, "modeled.plan": GRAPH["modeled.plan"] + [("cli", "", 1)],
               "parallel.zero": GRAPH["parallel.zero"] + [("modeled.memory", "estimate", 2)]}
    assert _rule_violations(planted) == [
        "gpucourse.modeled.plan (modeled) imports gpucourse.cli (cli), line 1",
        "gpucourse.parallel.zero (parallel) imports gpucourse.modeled.memory (modeled), line 2"]


def test_the_package_edges_are_read():
    """Importing ``a.b`` runs ``a`` first: an import of ``parallel.pipeline`` depends on ``parallel`` too."""
    assert any(t == "parallel" for t, _, _ in GRAPH["modeled.plan"])  # plan imports parallel.pipeline
    assert not any(t == "parallel" for t, _, _ in GRAPH["parallel.pipeline"])  # its own package: already running
    assert not any(t == "config" for t, _, _ in GRAPH["parallel"])  # the strategies read a config, never import it


def test_the_benchmark_toolkit_imports_nothing_from_the_project():
    assert GRAPH["course.readings"] == []


def test_no_private_name_is_imported_across_modules():
    bad = [f"gpucourse.{m} imports {name} from gpucourse.{t} (line {line})"
           for m in GRAPH for t, name, line in GRAPH[m]
           if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_reached_through_another_module():
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        # Names this module binds to other project modules: ``from . import comm``, ``from .runtime import worker``.
        bound = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names
                 for target, name, _ in GRAPH[module] if name == "" and target.rsplit(".", 1)[-1] == alias.name}
        bad += [f"gpucourse.{module} line {node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("planted, expected", [
    ({"a": [("b", "", 1)], "b": [("c", "", 1)], "c": [("a", "", 1)]}, [["a", "b", "c"]]),
    ({"a": [("b", "", 1)], "b": [], "c": [("b", "", 1)]}, []),
])
def test_the_cycle_finder_finds_a_planted_cycle(monkeypatch, planted, expected):
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", planted)
    assert _cycles() == expected


def test_a_planted_loop_through_a_package_is_found(tmp_path, monkeypatch):
    """``top`` imports ``sub.leaf``, which runs ``sub/__init__``, which imports ``top``: a loop that reading module
    edges alone misses."""
    pkg = tmp_path / "gpucourse"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import x\nfrom ..top import f\n")
    (pkg / "sub" / "leaf.py").write_text("x = 1\n")
    (pkg / "top.py").write_text("def f():\n    from .sub.leaf import x\n    return x\n")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "PACKAGE", pkg)
    monkeypatch.setattr(this, "MODULES", _modules())
    monkeypatch.setattr(this, "GRAPH", {m: _imports(m) for m in this.MODULES})
    assert _cycles() == [["sub", "top"]]


# What runs without torch: a workshop's hub (its spawner, dashboard and reports), the lab server's helper, the
# progress file and the quiz, writing a file whole, and the model shapes a plan counts. Each pays seconds and
# hundreds of MB for importing torch.
TORCH_FREE = ("gpucourse.files", "gpucourse.modeled.shapes", "gpucourse.course.kernel_sockets", "gpucourse.course.lab",
              "gpucourse.course.progress", "gpucourse.quiz", "gpucourse.workshop.hub", "gpucourse.workshop.spawner",
              "gpucourse.workshop.dashboard", "gpucourse.workshop.report", "gpucourse.workshop.kernels")


def test_the_hub_the_lab_and_the_progress_file_import_without_torch():
    code = f"import sys\nfor m in {TORCH_FREE!r}:\n    __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_the_old_names_of_moved_modules_still_import_with_a_warning():
    """A notebook or a learner's file written before the folders keeps working for one release, and is told where
    the module went, at its own line."""
    code = ("import warnings, sys\nwarnings.simplefilter('always')\n"
            "import gpucourse.plan as old\nimport gpucourse.modeled.plan as new\n"
            "from gpucourse import stack_config\nfrom gpucourse.tour import main\n"
            "from gpucourse import progress, TrainConfig\n"
            "print(old is new, new.__spec__.name, stack_config.__name__, main.__module__, progress.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "gpucourse.modeled.plan", "gpucourse.interop.stack_config",
                                  "gpucourse.course.tour", "gpucourse.course.progress"]
    warned = [line for line in out.stderr.splitlines() if "DeprecationWarning" in line]
    assert warned == [
        "<string>:3: DeprecationWarning: gpucourse.plan is now gpucourse.modeled.plan; the old name will be removed "
        "in the next release",
        "<string>:5: DeprecationWarning: gpucourse.stack_config is now gpucourse.interop.stack_config; the old name "
        "will be removed in the next release",
        "<string>:6: DeprecationWarning: gpucourse.tour is now gpucourse.course.tour; the old name will be removed "
        "in the next release"]


def test_the_course_itself_uses_the_new_names():
    import re
    old = "|".join(sorted(gpucourse_moved(), key=len, reverse=True))
    pattern = re.compile(rf"\bgpucourse\.({old})\b|from gpucourse import [\w, ]*\b({old})\b"
                         rf"|from gpucourse import \([^)]*\b({old})\b[^)]*\)")
    root = PACKAGE.parent
    files = [p for d in ("notebooks", "exercises", "solutions", "scripts", "tests", "docs", "gpucourse")
             for p in (root / d).rglob("*") if p.is_file() and p.suffix in (".py", ".ipynb", ".md", "")]
    files += [root / "README.md", root / "Makefile"]
    here = pathlib.Path(__file__).resolve()
    skip = {here, PACKAGE / "__init__.py"}  # this test and the table of old names
    bad = [f"{p.relative_to(root)}: {m.group(0)}" for p in files if p.resolve() not in skip
           for m in pattern.finditer(p.read_text(errors="replace"))]
    assert not bad, "\n".join(bad[:20])


def gpucourse_moved() -> dict[str, str]:
    import gpucourse
    return {old: new for old, new in vars(gpucourse)["_MOVED"].items() if old != "progress"}


def test_a_config_is_data():
    """config.py imports neither the strategies, the runtime nor the GPUs' platforms: each strategy checks its own
    fields where a layout is run or planned (gpucourse.parallel.check), and precision "auto" is resolved where the
    device is planned."""
    reached = {t for t, _, _ in GRAPH["config"]}
    assert not {t for t in reached if _folder(t) in ("parallel", "runtime", "modeled") or t == "platforms"}, reached
    assert reached <= {"model", "readable", "values"}


def test_code_asks_a_schedule_record_never_its_name():
    """What a schedule is (how many chunks, whether Megatron-LM runs it, its bubble's closed form) is a property of
    its record in parallel/schedule_table.py; the rest of the package asks the record, so a new schedule is one
    record, not a search for every place that compares names."""
    import re

    from gpucourse.parallel.schedule_table import SCHEDULES

    names = "|".join(re.escape(n) for n in SCHEDULES)
    compared = re.compile(rf"""(==|!=|\bin\b|\bnot in\b)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=)""")
    allowed = {"parallel.schedule_table", "parallel.schedules", "parallel.schedules_virtual"}  # the builders
    bad = [f"gpucourse/{m.replace('.', '/')}.py:{i}: {line.strip()}" for m, path in MODULES.items()
           if m not in allowed for i, line in enumerate(path.read_text().splitlines(), 1)
           if compared.search(line) and not re.search(r"\bfor\b.*\bin\s*\(", line)]  # a loop over names is data
    assert not bad, "\n".join(bad)
